"""Batches for a Data layer: one shard of an LMDB or Parquet dataset, looped like Caffe's Data layer, transformed."""

import collections
import functools
import itertools
import logging
import queue
import threading

import numpy as np

from deepspark.errors import ConfigError
from deepspark.data.claimed import HELD_BLOCKS, ClaimedStream, Positions
from deepspark.data.datum import DataError, decode_datum, decode_datums
from deepspark.data.resume import BLOCKS, Resumable, block_order
from deepspark.data.sources import source_for
from deepspark.data.table import feeds
from deepspark.data.transform import Transformer, _phase
from deepspark.proto import deepspark_pb2 as pb

# A shard whose decoded pixels fit in this many bytes is read into memory once
# (cheap for MNIST's 60,000 records); a larger one is streamed from a cursor.
MEMORY_LIMIT = 2 << 30
# A TEST shard is held only up to this size: the driver tests the center, and its
# memory must not grow with the test set. CIFAR-10's test set (30 MB) stays in memory;
# a larger one is re-read every test pass (streamed, about as fast as from memory into
# a batch: bench/data.py).
TEST_MEMORY_LIMIT = 64 << 20
# A streamed shard is decoded a window of records at a time; shuffled by blocks, its shuffle buffer holds as many
# bytes of records, read in blocks of BLOCK_BYTES (one LMDB cursor run or Parquet range each).
STREAM_WINDOW_BYTES = 64 << 20
BLOCK_BYTES = 4 << 20

log = logging.getLogger(__name__)


def records_per_block(nbytes):
    """Records of `nbytes` decoded bytes each in a block of BLOCK_BYTES: a streamed shard's unit of reading, and the
    job's ledger's unit of claiming (work stealing)."""
    return max(1, BLOCK_BYTES // max(nbytes, 1))


def _color(transform_param):
    if transform_param.force_color and transform_param.force_gray:
        raise ConfigError("transform_param: force_color and force_gray cannot both be set")
    if transform_param.force_color:
        return True
    if transform_param.force_gray:
        return False
    return None


class DataFeeder(Resumable):
    """Batches {top: array} for one Data layer: data float32 NCHW, label float32 (N,).

    Reads records [start, stop) (shard `shard` of `num_shards`) of the LMDB in key
    order or of the Parquet dataset in file order, and like Caffe's Data layer goes
    back to the shard's first record at its end, a batch spanning the seam. With
    shuffle=True the order is a fresh permutation every epoch; with shuffle="blocks"
    a fresh block_order (permuted blocks of BLOCK_BYTES through a shuffle buffer of
    STREAM_WINDOW_BYTES), which a streamed shard of any source reads each block of
    once an epoch. The same seed gives the same batches, whichever backend consumes
    them. A shard whose pixels fit in memory_limit (default MEMORY_LIMIT;
    TEST_MEMORY_LIMIT in TEST) is read once and held; a larger one is streamed, the
    same batches in bounded memory.
    """

    def __init__(self, layer_param, phase=pb.TRAIN, source=None, shard=0, num_shards=1,
                 seed=None, shuffle=False, batch_size=None, prefetch=0, memory_limit=None,
                 mean=None):
        if layer_param.type != "Data":
            raise ConfigError(f"layer {layer_param.name!r}: DataFeeder reads Data layers, "
                              f"not {layer_param.type}")
        data_param = layer_param.data_param
        if data_param.HasField("backend") and data_param.backend == pb.DataParameter.LEVELDB:
            raise ConfigError(f"layer {layer_param.name!r}: LEVELDB is not supported; "
                              "use backend: LMDB")
        self.name = layer_param.name
        self.tops = list(layer_param.top)
        if len(self.tops) not in (1, 2):
            raise ConfigError(f"layer {self.name!r}: a Data layer has one or two tops (data, label)")
        self.path = source or data_param.source
        if not self.path:
            raise ConfigError(f"layer {self.name!r}: data_param.source is not set")
        self.batch_size = int(batch_size or data_param.batch_size)
        if self.batch_size <= 0:
            raise ConfigError(f"layer {self.name!r}: data_param.batch_size must be positive")
        self.phase = _phase(phase)
        seeds = np.random.SeedSequence(seed).spawn(2)
        self.order_rng = np.random.default_rng(seeds[0])
        self.transformer = Transformer(_merged_transform(layer_param), self.phase, mean=mean,
                                       seed=seeds[1])
        self.shuffle = shuffle if shuffle == BLOCKS else bool(shuffle)
        self._color = _color(layer_param.transform_param)
        self._open(source_for(self.path).shard(shard, num_shards), memory_limit)
        self._order = None
        self._position = 0
        self.epoch = 0
        self._claimed = self._own = None  # steal(): the ledger's blocks, this shard's place in the source
        self._prefetch = int(prefetch)
        self._queue = None
        self._thread = None
        self._stop = threading.Event()

    def _open(self, shard, memory_limit):
        """Read `shard` into memory, or set up its stream: by the size of its records, the first one's."""
        self.shard, self.start, self.stop, self.size = shard, shard.start, shard.stop, shard.size
        key, value = shard.first_record()
        first, _ = decode_datum(value, key, self.path, self._color)
        self.source_shape, self._dtype = tuple(first.shape), first.dtype
        self.transformer.check(self.source_shape)
        block = records_per_block(first.nbytes)
        self.blocks = (block, max(1, STREAM_WINDOW_BYTES // (block * max(first.nbytes, 1))))  # (records, window)
        if memory_limit is None:
            memory_limit = TEST_MEMORY_LIMIT if self.phase == pb.TEST else MEMORY_LIMIT
        self.in_memory = self.size * first.nbytes <= memory_limit
        self._stream = None
        if self.in_memory:
            self._images, self._labels = self._load()
            return
        if self.shuffle is True and not shard.source.keyed:
            raise ConfigError(f"layer {self.name!r}: a shard of a {shard.source.kind} shuffled whole must fit in "
                              f"memory ({memory_limit} bytes), having no lookup by key (shuffled by blocks, it streams)")
        self._stream = BlockStream(shard, self._decode, self.blocks) if self.shuffle == BLOCKS else \
            StreamedShard(shard, self._decode, first, self.batch_size, self.shuffle)

    def _epoch_order(self):
        if self.shuffle == BLOCKS:
            return block_order(self.size, self.order_rng, *self.blocks)
        return super()._epoch_order()

    # -- reading -----------------------------------------------------------

    def _decode(self, keys, values, path=None):
        """Decoded records of `path` (the shard's own by default: a stolen block's is the source's, which a bad
        record's error must name)."""
        return decode_datums(keys, values, path or self.path, self._color, self.source_shape, self._dtype)

    def _load(self, chunk=8192):
        images = np.empty((self.size,) + self.source_shape, dtype=self._dtype)
        labels = np.empty(self.size, dtype=np.float32)
        filled = 0
        for block in self.shard.chunks(0, chunk):
            end = filled + len(block)
            images[filled:end], labels[filled:end] = decode_block(self._decode, block)
            filled = end
        return images, labels

    def _next_indices(self, n):
        """The next n positions in the shard (0-based), wrapping at the end of an epoch."""
        out = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            if self._position == 0:
                self._order = self._epoch_order()
            take = min(n - filled, self.size - self._position)
            if self._order is not None:
                out[filled:filled + take] = self._order[self._position:self._position + take]
            else:
                out[filled:filled + take] = np.arange(self._position, self._position + take)
            filled += take
            self._position += take
            if self._position == self.size:
                self._position = 0
                self.epoch += 1
                log.debug("%s: Restarting data prefetching from start.", self.name)
        return out

    def skip(self, batches):
        """Resumable's: the positions only, an epoch at most at a time (never a long job's indices at once), and
        the crops and mirrors those batches drew (so that the next batch draws what it would have); not once a
        prefetch thread reads ahead of the position."""
        if self._thread is not None:
            return batches == 0
        if self._claimed is not None:  # where the job's reading stands is the ledger's: nothing here to move on
            return True
        left = batches * self.batch_size
        while left:
            take = min(left, self.size)
            self._next_indices(take)
            left -= take
        for _ in range(batches):  # a batch's draws interleave mirror and offsets: one batch's at a time
            self.transformer.offsets(self.batch_size, self.source_shape)
        return True

    def steal(self, claim, current, source, own, held=HELD_BLOCKS):
        """From now on, read the blocks the job's ledger grants (ClaimedStream's claim and current): this shard's
        (records [start, stop) = `own` of the LMDB at `source`, which the shard holds in their order) from the shard,
        another worker's from `source`, which every executor reads; each epoch is the job's."""
        self._own = (Positions(source), *own)
        self._claimed = ClaimedStream(claim, current, self._run, self.order_rng, held, self.shuffle == BLOCKS)

    def _run(self, first, count):
        """(images, labels) of the source's records [first, first + count): from this shard where they are its own
        (in memory, or its LMDB), else from the source."""
        source, start, stop = self._own
        if start <= first and first + count <= stop and self.in_memory:
            return self._images[first - start:first - start + count], self._labels[first - start:first - start + count]
        positions, at = (self._spill, first - start) if start <= first < stop else (source, first)
        records = positions.run(at, count)
        if len(records) != count:
            raise DataError(f"the dataset changed while being read (record {first + len(records)} is gone)",
                            positions.path)
        return decode_block(functools.partial(self._decode, path=positions.path), records)

    @functools.cached_property
    def _spill(self):
        return Positions(self.path)

    def _assemble(self):
        if self._claimed is not None:
            images, labels = self._claimed.read(self.batch_size)
            self.epoch = self._claimed.epoch
        elif self.in_memory:
            indices = self._next_indices(self.batch_size)
            if self._order is None and indices[-1] - indices[0] == len(indices) - 1:
                images = self._images[indices[0]:indices[-1] + 1]  # a view: no gather
            else:
                images = self._images[indices]
            labels = self._labels[indices]
        else:
            images, labels = self._stream.read(self._next_indices(self.batch_size))
        batch = {self.tops[0]: self.transformer.apply(images)}
        if len(self.tops) > 1:
            batch[self.tops[1]] = labels
        return batch

    # -- the interface -------------------------------------------------------

    @property
    def shape(self):
        """(N, C, H, W) of the data top after transform."""
        return (self.batch_size,) + self.transformer.output_shape(self.source_shape)

    @property
    def shapes(self):
        """{top: shape} of every top."""
        out = {self.tops[0]: self.shape}
        if len(self.tops) > 1:
            out[self.tops[1]] = (self.batch_size,)
        return out

    def next_batch(self):
        """The next batch {top: array}."""
        if self._prefetch <= 0:
            return self._assemble()
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self._prefetch)
            self._thread = threading.Thread(target=self._produce, name=f"prefetch-{self.name}",
                                            daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _produce(self):
        while not self._stop.is_set():
            try:
                item = self._assemble()
            except BaseException as e:  # handed to the consumer, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def get_state(self):
        """Where the feeder is (Resumable's), for another feeder of the same shard to go on with the same
        batches; not of a prefetching feeder: a queue of assembled batches would be ahead of the position."""
        if self._prefetch > 0 or self._claimed is not None:
            raise ValueError(f"{self.name}: a {'prefetching' if self._prefetch > 0 else 'stealing'} feeder has no "
                             "single position")
        return super().get_state()

    def close(self):
        """Stop the prefetch thread and release the database."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._stream is not None:
            self._stream.close()
        if self._own is not None:
            self._own[0].close()
        if "_spill" in self.__dict__:  # opened by a run of the shard's own records
            self._spill.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # a half-built feeder, or interpreter shutdown
            pass


def decode_block(decode, block):
    """decode(keys, values) of a block of (key, value) records."""
    return decode([key for key, _ in block], [value for _, value in block])


class StreamedShard:
    """A Shard of a record source read as a batch asks for it, never held whole: in order a decoded window of
    records at a time, or (shuffle, a keyed source: an LMDB) one lookup per record by its key.
    decode(keys, values) gives (images, labels); `first` is the shard's first image."""

    def __init__(self, shard, decode, first, batch_size, shuffle):
        self.shard, self._decode = shard, decode
        self._shape, self._dtype = tuple(first.shape), first.dtype
        self._keys = list(shard.read(keys_only=True)) if shuffle else None
        self._lookup = shard.source.lookup() if shuffle else None
        self._chunks = None
        self._window = (0, (), ())
        self._window_size = max(batch_size, min(8192, STREAM_WINDOW_BYTES // max(first.nbytes, 1)))

    def read(self, indices):
        """(images, labels) of the records at shard positions `indices`."""
        if self._keys is not None:
            # Shuffled: one lookup per record, in this epoch's order.
            keys = [self._keys[index] for index in indices]
            return self._decode(keys, self._lookup.values(keys))
        # In order: decode a window of records at a time; a batch takes runs of it.
        images = np.empty((len(indices),) + self._shape, dtype=self._dtype)
        labels = np.empty(len(indices), dtype=np.float32)
        j = 0
        while j < len(indices):
            index = int(indices[j])
            first, window_images, window_labels = self._window
            if not first <= index < first + len(window_images):
                self._window = self._next_window(index)
                continue
            run = min(len(indices) - j, first + len(window_images) - index)
            images[j:j + run] = window_images[index - first:index - first + run]
            labels[j:j + run] = window_labels[index - first:index - first + run]
            j += run
        return images, labels

    def _next_window(self, index):
        """The decoded window of records starting at shard position `index`."""
        first, window_images, _ = self._window
        if self._chunks is None or index != first + len(window_images):
            if self._chunks is not None:
                self._chunks.close()
            self._chunks = self.shard.chunks(index, self._window_size)
        block = next(self._chunks, None)
        if block is None:
            raise DataError(f"the dataset changed while being read (record {self.shard.start + index} "
                            "is gone)", self.shard.source.where)
        return (index,) + decode_block(self._decode, block)

    def close(self):
        """Release the chunk reader and the lookup."""
        if self._chunks is not None:
            self._chunks.close()
            self._chunks = None
        if self._lookup is not None:
            self._lookup.close()


class BlockStream:
    """A Shard read as a block_order asks for it: blocks of `block` records, the last `window` + 2 it read held
    decoded, so that each block is read once an epoch and memory holds about one shuffle buffer. A keyed
    source's block (an LMDB's) is a cursor run from its first key, those keys read once here."""

    def __init__(self, shard, decode, blocks):
        self.shard, self._decode = shard, decode
        self.block, window = blocks
        self._capacity = window + 2
        self._held = collections.OrderedDict()  # block number -> (images, labels), least recently used first
        self.reads = 0  # blocks read so far (the test counts them)
        self._lookup = shard.source.lookup() if shard.source.keyed else None
        self._starts = None if self._lookup is None else \
            list(itertools.islice(shard.read(keys_only=True), 0, None, self.block))

    def read(self, indices):
        """(images, labels) of the records at shard positions `indices`. The blocks held after it are the
        most recently used in the order's sense: by their last record in `indices`."""
        numbers = indices // self.block
        reverse, last = np.unique(numbers[::-1], return_index=True)
        used = [int(n) for n in reverse[np.argsort(-last)]]  # by their last record in `indices`, the latest last
        for number in used:
            if number not in self._held:
                self._held[number] = self._read_block(number)
            self._held.move_to_end(number)
        images, labels = None, np.empty(len(indices), dtype=np.float32)
        by_block = np.argsort(numbers, kind="stable")
        for at in np.split(by_block, np.flatnonzero(np.diff(numbers[by_block])) + 1):  # a block's places at a time
            number = int(numbers[at[0]])
            held_images, held_labels = self._held[number]
            if images is None:
                images = np.empty((len(indices),) + held_images.shape[1:], dtype=held_images.dtype)
            offsets = indices[at] - number * self.block
            images[at], labels[at] = held_images[offsets], held_labels[offsets]
        while len(self._held) > self._capacity:
            self._held.popitem(last=False)
        return images, labels

    def _read_block(self, number):
        """The decoded records of block `number`, read now."""
        first = number * self.block
        count = min(self.block, self.shard.size - first)
        if self._lookup is not None:
            records = self._lookup.run(self._starts[number], count)
        else:
            start = self.shard.start + first
            records = [record for chunk in self.shard.source.chunks(start, start + count, count) for record in chunk]
        if len(records) != count:
            raise DataError(f"the dataset changed while being read (record {self.shard.start + first + len(records)} "
                            "is gone)", self.shard.source.where)
        self.reads += 1
        return decode_block(self._decode, records)

    def close(self):
        self._held.clear()
        if self._lookup is not None:
            self._lookup.close()


def _merged_transform(layer_param):
    """transform_param with Caffe's deprecated data_param scale/mean_file/crop_size/mirror folded in."""
    tp = pb.TransformationParameter()
    tp.CopyFrom(layer_param.transform_param)
    dp = layer_param.data_param
    for field in ("scale", "mean_file", "crop_size", "mirror"):
        if dp.HasField(field) and not tp.HasField(field):
            setattr(tp, field, getattr(dp, field))
    return tp


# What keeps WindowData off a training run, said once.
WINDOW_DATA_UNTRAINED = ("WindowData (R-CNN's window sampler: foreground and background windows drawn per batch "
                         "from whole images, cropped with context and warped) is read and described, not trained "
                         "on: crop and warp the windows into an LMDB once, and train from a Data layer")


feeds("Data", make=lambda layer_param, phase, where, options: DataFeeder(layer_param, phase, **where, **options),
      param="data_param")
feeds("WindowData", param="window_data_param", refusal=WINDOW_DATA_UNTRAINED)

