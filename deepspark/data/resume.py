"""The feeder interface every fed data layer's batches come through: batches, resume where another feeder stopped, each epoch's order."""

import numpy as np

# The shuffle of a stream (DataFeeder's shuffle="blocks"): permuted record blocks through a shuffle buffer.
BLOCKS = "blocks"


def block_order(size, rng, block, window):
    """A permutation of range(size) that a stream reads in bounded memory: the shard's blocks of `block`
    consecutive positions in a random order, then the positions of each run of `window` x `block` of that
    stream shuffled together (a shuffle buffer, filled and drained whole). A reader holding the last
    window + 2 blocks it read reads each block once an epoch."""
    starts = rng.permutation(-(-size // block)) * block
    stream = (starts[:, None] + np.arange(block)).ravel()
    stream = stream[stream < size]  # the last block's missing tail
    span = window * block
    for start in range(0, size, span):
        rng.shuffle(stream[start:start + span])  # a view: shuffled in place
    return stream


class Resumable:
    """A feeder of one shard of `size` items (records, images, rows) for one layer `name`: next_batch() gives
    {top: array}, `shapes` their shapes, `epoch` the passes completed; get_state/set_state carry where it is
    to another feeder of the same shard, which then gives the same batches; _epoch_order draws each epoch's
    order (the hook of per-epoch shuffling). A record feeder keeps `_position`, this epoch's `_order` (None:
    the shard's own order), `order_rng` and its transformer's rng; another kind says its own by _state and
    _restore."""

    unit = "records"  # what the shard holds, as an error names it

    def next_batch(self):
        raise NotImplementedError

    def _epoch_order(self):
        """The order of the next epoch's positions: a fresh permutation from order_rng with shuffle, else None
        (the shard's own order). The one place a feeder draws an epoch's order."""
        return self.order_rng.permutation(self.size) if self.shuffle else None

    def get_state(self):
        """(position, epoch, RNG states) as JSON-able values, and this epoch's order (an array, or None)."""
        meta, order = self._state()
        return {"epoch": self.epoch, "size": self.size, **meta}, order

    def set_state(self, meta, order=None):
        if meta["size"] != self.size or (order is not None and len(order) != self.size):
            raise ValueError(f"{self.name}: the state is of a shard of {meta['size']} {self.unit}, not {self.size}")
        self.epoch = int(meta["epoch"])
        self._restore(meta, order)

    def _state(self):
        return {"position": self._position, "order_rng": self.order_rng.bit_generator.state,
                "transform_rng": self.transformer.rng.bit_generator.state}, self._order

    def _restore(self, meta, order):
        self._position = int(meta["position"])
        self.order_rng.bit_generator.state = meta["order_rng"]
        self.transformer.rng.bit_generator.state = meta["transform_rng"]
        self._order = None if order is None else np.asarray(order, dtype=np.int64)

    def skip(self, batches):
        """Move on `batches` batches without reading them, to where as many next_batch() calls would leave it
        (each epoch's order drawn on the way): True; False where this kind of feeder cannot, and stays where it
        is. A feeder that can replays its transformer's random draws (crop, mirror) too."""
        return batches == 0

    def close(self):
        """Release what the feeder holds open."""

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
