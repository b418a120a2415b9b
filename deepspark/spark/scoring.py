"""Trained nets run forward on the executors, one path for the pyspark.ml Model's transform, `deepspark score`
and `deepspark extract-features`.

The driver describes the net once, as a Forward: the net, the backend, the
weights (a Spark broadcast, fetched once per executor), Caffe's
transform_param, and which tops take the images and the labels. A Python
worker builds the net on its first batch and keeps it for its later tasks and
stages (the session sets spark.python.worker.reuse), so a net is built once
per Python worker, not per task, batch or row. Records go through in batches
of the Forward's size: a transform pads the last short batch of a partition (a
TEST-phase net computes each image apart from the others), a score runs it at
its own size (its outputs are means over the batch).
"""

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import time

import numpy as np
import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import functions as F

from deepspark import checkpoint, engine
from deepspark.backends import create_model
from deepspark.config import load_net, net_path
from deepspark.data import (DataError, Transformer, decode_datum, encode_datum, lmdb_io, load_mean, peek_shape,
                            source_for)
from deepspark.data.datum import decode_datums, parse_datum
from deepspark.data.parquet import is_uri, write_parquet, writes_parquet
from deepspark.errors import ConfigError, DeepSparkError
from deepspark.graph import Graph, fmt, layer_included, tap_name, with_batch_size, with_taps
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.executor import set_threads
from deepspark.spark.failures import failed, interrupted
from deepspark.spark.session import spark_session, stop_context, worker_threads
from deepspark.spark.shards import parquet_located, unreadable_lmdb

log = logging.getLogger(__name__)
# Records per partition of a dataset that score or extract-features read (more partitions than cores
# balance the executors; each builds its net once whatever their number).
RECORDS_PER_PARTITION = 20_000

_BUILT = {}  # in each Python worker: (Forward.key, batch size) -> (model, transformer)


def _reworded(error, what):
    """A DataError of decode_datum (which names no record here) as one naming `what`."""
    text = str(error)
    return DataError(f"{what}: {text.split(': ', 1)[1]}" if text.startswith("record: ") else f"{what}: {text}")


@dataclasses.dataclass(frozen=True)
class Forward:
    """What a task needs to build a net and run it forward; small, shipped in the task's closure."""

    key: str  # a fingerprint of everything a build depends on (Forward.of): the per-worker cache's key
    net: bytes  # the NetParameter (TEST phase), every blob wanted already one of its outputs
    backend: str
    weights: object  # a Spark Broadcast of (.caffemodel bytes, the mean image or None)
    transform: bytes  # the TransformationParameter, applied as Caffe's TEST phase does (centre crop, no mirror)
    image: str  # the top the images go to
    label: str  # the top the labels go to ("": none)
    shape: tuple  # (C, H, W) the net takes, after transform_param's crop
    raw_shape: tuple  # (C, H, W) of the records a Data layer reads (before the crop); None for an Input net
    batch_size: int
    outputs: tuple  # the net's outputs a run returns
    threads: int
    counters: tuple = None  # (builds, build seconds): Spark accumulators, or None

    @classmethod
    def of(cls, net, backend, caffemodel, mean, transform, image, label, shape, raw_shape, batch_size, outputs):
        """The Forward of a NetParameter with its weights (.caffemodel bytes, the mean image or None) and
        TransformationParameter; its key fingerprints each of them, the backend and the image shapes it
        is built for, so that a Python worker builds again for anything that differs."""
        net_bytes, transform_bytes = net.SerializeToString(), transform.SerializeToString()
        parts = (net_bytes, caffemodel, b"" if mean is None else mean.tobytes(), backend.encode(), transform_bytes,
                 repr((None if mean is None else mean.shape, tuple(shape), raw_shape)).encode())
        key = hashlib.sha256(b"".join(hashlib.sha256(part).digest() for part in parts)).hexdigest()
        return cls(key=key, net=net_bytes, backend=backend, weights=(caffemodel, mean), transform=transform_bytes,
                   image=image, label=label, shape=tuple(shape), raw_shape=raw_shape, batch_size=batch_size,
                   outputs=tuple(outputs), threads=1)

    def shipped(self, sc, counters=None):
        """This Forward as tasks take it: the weights (and mean) as a Spark broadcast, the thread count of a
        Python worker among the context's concurrent tasks, and build counters if given."""
        return dataclasses.replace(self, weights=sc.broadcast(self.weights), counters=counters,
                                   threads=worker_threads(sc, sc.defaultParallelism))

    def built(self, batch_size):
        """(model, transformer) of this net at `batch_size`, built on this Python worker's first call."""
        key = (self.key, batch_size)
        if key not in _BUILT:
            started = time.monotonic()
            set_threads(self.threads)
            caffemodel, mean = self.weights.value
            net = with_batch_size(pb.NetParameter.FromString(self.net), batch_size)
            raw = self.raw_shape
            model = create_model(self.backend, net, phase=pb.TEST, batch_size=batch_size, threads=self.threads,
                                 data_shape=None if raw is None else (lambda layer: raw))
            model.set_params(checkpoint.weights_for(model.graph, checkpoint.parse_caffemodel(caffemodel),
                                                    model.get_params(), "the model's weights"))
            param = pb.TransformationParameter.FromString(self.transform)
            param.mirror = False  # Caffe's TEST phase mirrors at random; a prediction must not depend on a draw
            transformer = Transformer(param, pb.TEST, mean=mean)
            _BUILT[key] = (model, transformer)
            if self.counters is not None:
                self.counters[0].add(1)
                self.counters[1].add(time.monotonic() - started)
        return _BUILT[key]

    def built_for(self, n, pad):
        """built() for a batch of n records: at batch_size when padded (or full), else at n."""
        return self.built(self.batch_size if pad or n == self.batch_size else n)

    def image_of(self, value, what, transformer):
        """(C x H x W image, label) of one input: Datum bytes, an image array (nested or flat) or a Spark ML
        vector; a DataError naming `what` when it is not an image the net takes."""
        label = 0
        if isinstance(value, (bytes, bytearray, memoryview)):
            try:
                array, label = decode_datum(bytes(value))
            except DataError as error:
                raise _reworded(error, what) from None
        elif value is None:
            raise DataError(f"{what}: no image (null)")
        else:
            array = np.asarray(value.toArray() if hasattr(value, "toArray") else value)
            if array.dtype.kind not in "buif":
                raise DataError(f"{what}: not an image of numbers ({array.dtype} of shape {fmt(array.shape)})")
        if array.ndim == 2:
            array = array[None]
        expected = self.shape if self.raw_shape is None else self.raw_shape
        if array.ndim != 3 or transformer.output_shape(array.shape) != self.shape:
            if array.ndim != 3 and array.size == int(np.prod(expected)):
                return array.reshape(expected), label  # a flat image (a vector, a CSV's row)
            crop = " after transform_param's crop" if transformer.crop_h else ""
            raise DataError(f"{what}: its image is {fmt(array.shape)}; the net takes {fmt(self.shape)}{crop}")
        return array, label

    def decoded(self, values, transformer):
        """(N x C x H x W images, N labels) of `values` where they are Caffe's Datums of one size that the net takes,
        decoded all at once (data.decode_datums); None for anything else (images_of's one-by-one path names it)."""
        if not len(values) or not all(isinstance(value, bytes) for value in values):
            return None
        try:
            images, labels = decode_datums([None] * len(values), values)
        except DataError:
            return None
        return (images, labels) if transformer.output_shape(images.shape[1:]) == self.shape else None

    def images_of(self, items, transformer):
        """(N x C x H x W images, N labels) of (what, value) items: Caffe's raw Datums of one size decoded
        all at once (decoded), anything else one by one (image_of, which names a bad one)."""
        found = self.decoded([value for _, value in items], transformer)
        if found is not None:
            return found
        pairs = [self.image_of(value, what, transformer) for what, value in items]
        return np.stack([image for image, _ in pairs]), np.array([label for _, label in pairs], np.float32)

    def forward_batch(self, items, pad):
        """{output: array of the n records} of one batch of n <= batch_size (what, value) items. pad: fill a
        short batch up to batch_size (else run it at its own size)."""
        return self.forward_images(*self.images_of(items, self.built_for(len(items), pad)[1]), pad)

    def forward_images(self, images, labels, pad):
        """{output: array of the n images} of one batch of n <= batch_size images as decoded (N x C x H x W, before
        transform_param) and their labels. pad: as forward_batch's."""
        n = len(images)
        model, transformer = self.built_for(n, pad)
        size = self.batch_size if pad else n
        batch = np.zeros((size,) + self.shape, np.float32)
        transformer.apply(images, out=batch[:n])
        feed = {self.image: batch}
        if self.label:
            feed[self.label] = np.zeros(size, np.float32)
            feed[self.label][:n] = labels
        outputs = model.forward(feed)
        return {name: outputs[name][:n] if size != n else outputs[name] for name in self.outputs}


def chunks(items, size):
    """`items` as lists of up to `size`."""
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# -- the two uses --------------------------------------------------------------------------


def output_sums(forward, source):
    """The mapPartitions function of a score: per partition, one (record count, {output: sum over its
    records}), each batch's mean output weighted by the batch's size."""

    def run(items):
        total, sums = 0, collections.OrderedDict()
        for chunk in chunks(items, forward.batch_size):
            outputs = forward.forward_batch([(where(source, index, key), value) for index, key, value in chunk],
                                            pad=False)
            total += len(chunk)
            for name in forward.outputs:
                value = np.asarray(outputs[name], np.float64) * len(chunk)
                sums[name] = sums[name] + value if name in sums else value
        return [(total, sums)] if total else []

    return run


def feature_rows(forward, source):
    """The mapPartitions function of extract-features: (index, the record's label, [per output of the Forward:
    the record's values, float32]) per record, in the partition's order."""

    def run(items):
        for chunk in chunks(items, forward.batch_size):
            outputs = forward.forward_batch([(where(source, index, key), value) for index, key, value in chunk],
                                            pad=True)
            for i, (index, key, value) in enumerate(chunk):
                yield index, parse_datum(value, key, source).label, [np.asarray(outputs[name][i], np.float32)
                                                                     for name in forward.outputs]

    return run


# A score's per-partition sums as rows: an output's name, and its sum (flat) and shape.
SUMS = "output string, sum array<double>, shape array<long>"
# Extract-features' rows: the record's index and label, and the Forward's outputs for it (float32 bytes, shapes).
FEATURES = "index long, label long, values array<binary>, shapes array<array<long>>"


def arrow_sums(forward, source):
    """The mapInArrow function of a score over RECORDS: output_sums as rows of SUMS."""

    def run(batches):
        for _, sums in output_sums(forward, source)(arrow_records(batches)):
            yield pa.RecordBatch.from_pylist([{"output": name, "sum": value.ravel().tolist(),
                                               "shape": list(value.shape)} for name, value in sums.items()])

    return run


def arrow_features(forward, source):
    """The mapInArrow function of extract-features over RECORDS: feature_rows as rows of FEATURES."""

    def run(batches):
        for chunk in chunks(feature_rows(forward, source)(arrow_records(batches)), ROWS_PER_BATCH):
            yield pa.RecordBatch.from_pylist([{"index": index, "label": int(label),
                                               "values": [v.tobytes() for v in values],
                                               "shapes": [list(v.shape) for v in values]}
                                              for index, label, values in chunk])

    return run


def feature_values(rows):
    """feature_rows' (index, label, [float32 arrays]) of FEATURES' rows, on the driver."""
    for row in rows:
        yield row["index"], row["label"], [np.frombuffer(v, np.float32).reshape(shape)
                                           for v, shape in zip(row["values"], row["shapes"])]


def where(source, index, key):
    """How an error names a record: its LMDB key, or its place in a Parquet dataset; and the source."""
    name = key.decode("utf-8", "backslashreplace") if key is not None else str(index)
    return f"{source}: record {name!r}"


# -- records of a dataset, in whole batches ---------------------------------------------------


def batch_ranges(total, batch_size, partitions):
    """[start, stop) record ranges of `partitions` partitions that hold whole batches of `batch_size`
    (the last one's last batch may be short), in order."""
    batches = -(-total // batch_size)
    bounds = [batches * p // partitions * batch_size for p in range(partitions + 1)]
    return [(start, min(stop, total)) for start, stop in zip(bounds, bounds[1:]) if start < min(stop, total)]


# Each record as a DataFrame row: its index, its LMDB key (null for Parquet) and its Datum bytes.
RECORDS = "index long, key binary, datum binary"
ROWS_PER_BATCH = 1024  # records per Arrow batch that reads an LMDB's range


def arrow_batches(records, size=ROWS_PER_BATCH):
    """Arrow record batches of RECORDS of (index, key, Datum bytes) items."""
    for chunk in chunks(records, size):
        index, key, datum = zip(*chunk)
        yield pa.RecordBatch.from_arrays([pa.array(index, pa.int64()), pa.array(key, pa.binary()),
                                          pa.array(datum, pa.binary())], names=["index", "key", "datum"])


def arrow_records(batches):
    """(index, key, Datum bytes) items of Arrow batches of RECORDS (or of more columns, those first)."""
    for batch in batches:
        yield from zip(*(batch.column(i).to_pylist() for i in range(3)))


def lmdb_ranges(source, total, ranges):
    """The mapInArrow function over spark.range(len(ranges)) that reads each id's record range of the LMDB at
    `source` on an executor, as RECORDS in order."""

    def run(batches):
        unreadable = unreadable_lmdb(source, total, "the executor")
        if unreadable:
            raise DataError(unreadable)
        for batch in batches:
            for i in batch.column(0).to_pylist():
                start, stop = ranges[i]
                yield from arrow_batches((index, bytes(key), bytes(value)) for index, (key, value)
                                         in enumerate(lmdb_io.read_records(source, start, stop), start))

    return run


def parquet_rows(indexed):
    """The mapInArrow function that makes parquet_located's (part file, row, Datum bytes) RECORDS, each checked."""

    def run(batches):
        rows = (row for batch in batches for row in zip(*(column.to_pylist() for column in batch.columns)))
        yield from arrow_batches((index, None, datum) for index, datum in indexed(rows))

    return run


def partitions_for(spark, total, batch_size):
    """How many partitions to read `total` records in: at least one per core, one per RECORDS_PER_PARTITION,
    at most one per batch."""
    batches = -(-total // batch_size)
    return max(1, min(batches, max(spark.sparkContext.defaultParallelism, total // RECORDS_PER_PARTITION)))


def dataset_frame(spark, source, batch_size):
    """(a DataFrame of RECORDS of the LMDB or Parquet dataset at `source`, its partitions holding whole batches of
    `batch_size` in index order; the record count; the partition count): DataFrame operations, which Spark
    Connect serves too. The record source's kind picks how Spark reads it (FRAMES)."""
    found = source_for(source)
    return FRAMES[found.name](spark, found, batch_size)


def parquet_frame(spark, source, batch_size):
    """dataset_frame of a Parquet dataset, read by Spark's own reader."""
    located, indexed, _, total = parquet_located(spark, source.location)
    count = partitions_for(spark, total, batch_size)
    frame = located.mapInArrow(parquet_rows(indexed), RECORDS)
    # Ranges of batch numbers: a range partitioning never splits a key, so no batch straddles two partitions.
    batch = F.floor(F.col("index") / batch_size)
    return frame.repartitionByRange(count, batch).sortWithinPartitions("index"), total, count


def lmdb_frame(spark, source, batch_size):
    """dataset_frame of an LMDB, each partition's record range read by its executor."""
    if not source.present():
        raise ConfigError("not an LMDB or a Parquet dataset", source.location)
    total = source.count()
    if not total:
        raise ConfigError("the LMDB is empty", source.location)
    ranges = batch_ranges(total, batch_size, partitions_for(spark, total, batch_size))
    frame = spark.range(0, len(ranges), 1, len(ranges)).mapInArrow(
        lmdb_ranges(os.path.abspath(source.location), total, ranges), RECORDS)
    return frame, total, len(ranges)


# How score and extract-features read each kind of record source (data.sources.SOURCES) on Spark.
FRAMES = {"lmdb": lmdb_frame, "parquet": parquet_frame}


# -- the driver's side of score and extract-features: a net that reads its own data, as Caffe's tools take --


def test_net(path, source=None):
    """(the NetParameter of the net at `path`, its SourceMap, its one Data layer in the TEST phase, the source
    to read: `source` or that layer's own)."""
    net, source_map = load_net(net_path(path, ("train_val.prototxt", "deploy.prototxt")))
    state = pb.NetState(phase=pb.TEST)
    data = [layer for layer in net.layer if layer.type == "Data" and layer_included(layer, state)]
    if len(data) != 1:
        raise ConfigError(f"the net has {len(data)} Data layers in its TEST phase; score and extract-features run "
                          "a net that reads one dataset (Caffe's train_val.prototxt, or a net with one Data layer)",
                          path)
    return net, source_map, data[0], source or data[0].data_param.source


def forward_of(path, weights, source, backend, batch_size, blobs=None):
    """(the Forward of the TEST net at `path` for the dataset `source` (its weights not yet shipped:
    Forward.shipped), its Graph, the source): the net's outputs, or the tapped `blobs`; the weights checked
    against the net here, before Spark starts."""
    net, source_map, layer, source = test_net(path, source)
    if not (os.path.exists(source) or is_uri(source)):
        raise ConfigError(f"the dataset {source!r} is not there", path)
    raw_shape = peek_shape(source)
    graph = Graph(net, pb.TEST, source=source_map, batch_size=batch_size or None, data_shape=lambda _: raw_shape)
    outputs = list(graph.outputs) if blobs is None else [tap_name_or_error(graph, blob) for blob in blobs]
    run_net = net if blobs is None else with_taps(net, graph, blobs)
    caffemodel = checkpoint.read_bytes(weights, "the weights")
    checkpoint.weights_that_fit(graph, caffemodel, weights)
    param = pb.TransformationParameter()
    param.CopyFrom(layer.transform_param)
    mean = load_mean(param.mean_file) if param.mean_file else None
    param.ClearField("mean_file")  # read here, shipped with the weights
    tops = list(layer.top)
    fed = graph.fed_tops()[tops[0]]
    forward = Forward.of(run_net, backend, caffemodel, mean, param, image=tops[0],
                         label=tops[1] if len(tops) > 1 else "", shape=fed[1:], raw_shape=raw_shape,
                         batch_size=fed[0], outputs=outputs)
    return forward, graph, source


def tap_name_or_error(graph, blob):
    try:
        return tap_name(graph, blob)
    except KeyError as error:
        raise ConfigError(f"--blobs: {error.args[0]}") from None


@contextlib.contextmanager
def on_spark(path, weights, source, backend, batch_size, ds, blobs=None):
    """forward_of's net checked here, then a Spark session (the caller's, or one started and stopped here):
    yields (the SparkContext, the shipped Forward, the net's Graph, the source, its records (dataset_frame: the
    DataFrame, the count, the partitions))."""
    forward, graph, source = forward_of(path, weights, source, backend or ds.backend, batch_size, blobs)
    session, started = spark_session(ds, ds.workers)
    try:
        sc = session.sparkContext
        forward = forward.shipped(sc)
        yield sc, forward, graph, source, dataset_frame(session, source, forward.batch_size)
    finally:
        if started:
            stop_context(session.sparkContext)


def score(path, weights, source=None, backend=None, batch_size=0, ds=None):
    """`deepspark score`: Caffe's `test` over a whole dataset, on the executors: the mean of every output of
    the net's TEST phase over every record of `source` (default: the Data layer's own), logged as `test`
    logs them; {output: mean}."""
    with on_spark(path, weights, source, backend, batch_size, ds or pb.DeepSparkParameter()) as (
            sc, forward, graph, source, (records, total, partitions)):
        log.info(f"Scoring {total} records of {source} on {sc.master} ({partitions} partitions, "
                 f"batches of {forward.batch_size}, {forward.backend} backend)")
        try:
            counted = records.mapInArrow(arrow_sums(forward, source), SUMS).collect()
        except Exception as error:
            raise interrupted(error) or failed(error, sc) from None
        sums = collections.OrderedDict()
        for row in counted:
            name, value = row["output"], np.array(row["sum"], np.float64).reshape(row["shape"])
            sums[name] = sums[name] + value if name in sums else value
        sums = collections.OrderedDict((name, sums[name]) for name in forward.outputs if name in sums)
        means = collections.OrderedDict((name, value / total) for name, value in sums.items())
        engine.log_outputs(graph, means, "")
        return means


def feature_datum(values, label=0):
    """A feature blob's values for one record as Caffe's extract_features stores them: a float Datum of the
    blob's channels x height x width (Caffe's legacy axes: 1 where the blob has none), label 0 unless given."""
    shape = tuple(values.shape) + (1,) * (3 - values.ndim) if values.ndim < 3 else \
        (values.shape[0], values.shape[1], int(np.prod(values.shape[2:])))
    return encode_datum(values.reshape(shape).astype(np.float32), label)


def extract_features(path, weights, blobs, outputs, source=None, backend=None, batch_size=0, ds=None,
                     overwrite=False):
    """`deepspark extract-features`: Caffe's extract_features on the executors. The blobs of the TEST net at
    `path` for every record of `source` (default: the Data layer's), one dataset per blob in `outputs`
    (an LMDB, or Parquet for a path ending in .parquet, with the record's label and the blob as a Spark ML
    vector column of its name beside the Datum), keyed as Caffe keys them (the record's index, 10 digits),
    written from the driver partition by partition; {blob: records written}."""
    if len(blobs) != len(outputs):
        raise ConfigError(f"{len(blobs)} blobs but {len(outputs)} outputs; extract-features writes one dataset "
                          "per blob (--blobs fc7,prob --output fc7_lmdb,prob_lmdb)")
    for out in outputs:
        lmdb_io.refuse_existing(out, overwrite)
    with on_spark(path, weights, source, backend, batch_size, ds or pb.DeepSparkParameter(), blobs) as (
            sc, forward, _, source, (records, total, partitions)):
        log.info(f"Extracting {', '.join(blobs)} of {total} records of {source} on {sc.master} "
                 f"({partitions} partitions, batches of {forward.batch_size})")
        features = records.mapInArrow(arrow_features(forward, source), FEATURES)
        if len(blobs) > 1:
            features = features.persist(StorageLevel.MEMORY_AND_DISK)  # one pass on the executors, one write each
        written = {}
        try:
            for i, (blob, out) in enumerate(zip(blobs, outputs)):
                rows = feature_values(features.toLocalIterator())
                if writes_parquet(out):  # beside Caffe's Datum, the record's label and the blob as a Spark ML vector
                    written[blob] = write_parquet(out, ((b"%010d" % index, feature_datum(values[i], label),
                                                         values[i].ravel()) for index, label, values in rows),
                                                  overwrite=overwrite, vector=blob)
                else:  # Caffe's own: the blob alone, label 0
                    written[blob] = lmdb_io.write_lmdb(out, ((b"%010d" % index, feature_datum(values[i]))
                                                             for index, _, values in rows), overwrite=overwrite)
                log.info(f"Extracted {written[blob]} records of {blob} into {out}")
        except DeepSparkError:
            raise
        except Exception as error:
            raise interrupted(error) or failed(error, sc) from None
        finally:
            features.unpersist()
        return written
