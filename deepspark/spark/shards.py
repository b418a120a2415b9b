"""The shards of a training job, planned on the driver, which never holds a record: an LMDB's record ranges, a Parquet dataset's or a DataFrame's rows moved into one partition per worker, or each worker's share of what a net reads itself."""

import dataclasses
import itertools
import logging
import os
import socket

import numpy as np

from deepspark import nets
from deepspark.data import LISTED_SOURCES, checked_records, decode_datum, lmdb_io, source_for
from deepspark.data.claimed import HELD_BLOCKS
from deepspark.data.feeder import records_per_block
from deepspark.data.parquet import COLUMNS, DATUM, null_row
from deepspark.data.sources import datum_shape, row_datum
from deepspark.errors import ConfigError
from deepspark.graph import layer_included
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.failures import failed, first_line, interrupted
from deepspark.spark.session import sql_session

log = logging.getLogger(__name__)
STREAMED = "each task streams its partition into its local LMDB; the driver holds no records"


def plan(sc, solver, data, workers, ship_records):
    """The RDD of the workers' shards, one partition each, and the (C, H, W) of their images when the plan
    read it (None: the net's Data layer says it); the plan's line logged. data: a DataFrame, else the train
    net's LMDB or Parquet dataset, or the data its own layers read. The record source's kind picks its plan
    (PLANS)."""
    location = data if data is not None else train_source(solver)
    source = None if location is None else source_for(location)
    if source is None:
        shards, shape = sc.parallelize([Listed(worker, workers) for worker in range(workers)], workers), None
        log.info(f"Sharded the train net's own data sources into {workers} shards (each executor reads its share "
                 "of them itself; nothing is spilled)")
    else:
        shards, shape, line = PLANS[source.name](sc, source, workers, ship_records)
        log.info(line)
    if ship_records and (source is None or source.name not in SHIPPED):
        log.warning("ship_records applies to an LMDB source; this job's shards are read by the executors")
    return shards, shape


def lmdb_plan(sc, source, workers, ship_records):
    """(shards, None, the plan's line) of an LMDB: each executor's record range, or (ship_records) its
    records shipped from the driver."""
    if ship_records:
        shards, total = shipped_shards(sc, source.location, workers)
        return shards, None, (f"Sharded {total} records into {workers} shards (shipped through Spark from the driver: "
                              "ship_records, bounded by the driver's memory)")
    ranges, total = lmdb_ranges(source.location, workers)
    return sc.parallelize(ranges, workers), None, (
        f"Sharded {total} records into {workers} shards (each executor reads its record range of "
        f"{ranges[0].source} itself; no records pass through the driver)")


def parquet_plan(sc, source, workers, ship_records):
    """(shards, (C, H, W), the plan's line) of a Parquet dataset, read by Spark's own reader."""
    shards, shape, total = parquet_shards(sql_session(sc), source.location, workers)
    return shards, shape, (f"Planned {workers} shards of the {total} records of {source.describe()} "
                           f"({STREAMED})")


def frame_plan(sc, source, workers, ship_records):
    """(shards, (C, H, W), the plan's line) of a DataFrame, repartitioned by Spark."""
    shards, shape, total = dataframe_shards(source.location, workers)
    return shards, shape, (f"Training on {source.describe()}, repartitioned into {workers} shards of its "
                           f"{total} records ({STREAMED})")


# How a job's shards are planned, by the kind of its record source (data.sources.SOURCES), and the kinds
# whose records the driver can ship (ship_records).
PLANS = {"lmdb": lmdb_plan, "parquet": parquet_plan, "dataframe": frame_plan}
SHIPPED = frozenset({"lmdb"})


def stealing(ds, algorithm, solver, data, workers):
    """(the workers' record Ranges and the records in a block, or None; the log's line saying which): a job's
    workers claim blocks of records from the exchanger's ledger (work stealing, steal_records) where the algorithm
    lets each train at its own speed (easgd) and every executor reads the source, an LMDB; elsewhere each worker
    reads its own shard, as before."""
    location = data if data is not None else train_source(solver)
    kind = None if location is None else source_for(location).name
    off = ("steal_records is off" if not ds.steal_records else
           f"{algorithm.name}'s workers train in step" if not algorithm.steals else
           "one worker reads every record" if workers == 1 else
           "the net's own layers read its data" if kind is None else
           f"a {kind} source's shards are spilled to each executor, which no other reads" if kind != "lmdb" else
           "ship_records: the executors need not see the LMDB" if ds.ship_records else None)
    if off:
        return None, f"Work stealing: off ({off}); each worker reads its own shard"
    ranges, _ = lmdb_ranges(location, workers)
    key, value = lmdb_io.first_record(location)
    block = records_per_block(decode_datum(value, key, location)[0].nbytes)
    return (ranges, block), (f"Work stealing: on; the workers claim blocks of {block} records of every worker's "
                             "range from the exchanger's ledger, their own first, then the range most behind, and "
                             f"shuffle the {HELD_BLOCKS} they hold: each record read once a job epoch, a straggler's "
                             "unread records by the others")


def train_source(solver):
    """The LMDB or Parquet dataset the train net's one Data layer reads in the TRAIN phase, or None for a net
    that reads its data through its own layers (HDF5Data, ImageData, a Python data layer, DummyData: each
    executor reads its share itself); a one-line error if there is not exactly one Data layer or none, or its
    source is not there, or the net has a WindowData layer."""
    nets.check_sources(solver.train_net, solver.train_map, pb.TRAIN)  # each source there; WindowData refused
    train = pb.NetState(phase=pb.TRAIN)
    included = [layer for layer in solver.train_net.layer if layer_included(layer, train)]
    sources = {layer.data_param.source for layer in included if layer.type == "Data"}
    if not sources and any(map(reads_its_own_data, included)):
        return None
    if len(sources) != 1:
        raise ConfigError("the Spark job needs exactly one Data layer (an LMDB or a Parquet dataset) in the TRAIN "
                          "phase of the train net", solver.path)
    return sources.pop()


def reads_its_own_data(layer):
    """A data layer that is not an LMDB's: it reads its own list, or makes its data (a Python layer without
    bottoms, DummyData)."""
    return layer.type in LISTED_SOURCES or layer.type == "DummyData" or (layer.type == "Python" and not layer.bottom)


def shard_of(index, total, shards):
    """The shard that record `index` of `total` falls in: the inverse of lmdb_io.shard_range, i.e. the
    largest i with total * i // shards <= index, which is ((index + 1) * shards - 1) // total."""
    return ((index + 1) * shards - 1) // total


def too_few(workers, total, what):
    """The one line for a dataset that cannot give every worker a record."""
    return f"{workers} workers but {what} holds only {total} records"


def shard_payloads(solver, workers):
    """lmdb_ranges of the train net's LMDB."""
    return lmdb_ranges(train_source(solver), workers)


def lmdb_ranges(source, workers):
    """Per worker: the Range of the LMDB at `source` that its executor reads itself, and the LMDB's
    record count. Only the count is read here."""
    total = lmdb_io.count(source)
    if total < workers:
        raise ConfigError(too_few(workers, total, "the LMDB"), source)
    return [Range(os.path.abspath(source), *lmdb_io.shard_range(total, worker, workers), total)
            for worker in range(workers)], total


def partition_counts(sc, rows):
    """Per partition of the RDD `rows`: its row count, counted on the executors; and the first row of
    the first partition that has one (None if none has)."""

    def count(items):
        first = next(items, None)
        return [(0 if first is None else 1 + sum(1 for _ in items), first)]

    try:
        counted = rows.mapPartitions(count).collect()
    except Exception as error:
        raise interrupted(error) or failed(error, sc) from None
    return [n for n, _ in counted], next((row for n, row in counted if n), None)


def balanced_shards(rows, counts, workers, datum, what):
    """`rows` (an RDD whose partitions hold `counts` rows) as `workers` partitions of (index, Datum
    bytes): shard i holds the records lmdb_io.shard_range(total, i, workers) of `rows` in its
    order, `datum(index, row)` each; and the total.

    Indexing and `datum` run on the executors. The RDD that was counted is the one indexed,
    and its partitions are fixed once it exists, so a record has one index and a worker gets
    the same shard on every retry (Spark refetches the shuffle's output, or recomputes the
    lost part of it from the same partitions).
    """
    total = sum(counts)
    if total < workers:
        raise ConfigError(too_few(workers, total, what))
    starts = np.cumsum([0, *counts[:-1]]).tolist()

    def indexed(partition, items):
        return ((index, datum(index, row)) for index, row in enumerate(items, starts[partition]))

    return by_shard(rows.mapPartitionsWithIndex(indexed), total, workers), total


def by_shard(indexed, total, workers):
    """An RDD of (index, Datum bytes) moved into `workers` partitions: partition i holds the indexes
    lmdb_io.shard_range(total, i, workers)."""
    return indexed.partitionBy(workers, lambda index: shard_of(index, total, workers))


def shipped_shards(sc, source, workers):
    """The LMDB's records shipped from the driver through Spark (ship_records), as balanced_shards gives
    them, and the total: the driver streams them, but sc.parallelize keeps them all in its JVM."""
    total = lmdb_io.count(source)
    if total < workers:
        raise ConfigError(too_few(workers, total, "the LMDB"), source)
    values = sc.parallelize(LmdbValues(source, total), workers)
    return balanced_shards(values, partition_counts(sc, values)[0], workers, lambda index, value: value, "the LMDB")


class LmdbValues:
    """An LMDB's values with its count as len(): sc.parallelize streams a sized iterable (it lists only
    what has no len)."""

    def __init__(self, source, total):
        self.source, self.total = source, total

    def __len__(self):
        return self.total

    def __iter__(self):
        return (value for _, value in lmdb_io.read_records(self.source))


def parquet_shards(spark, source, workers):
    """The shards of a Parquet dataset as by_shard gives them, the (C, H, W) of its images and the total,
    planned from Spark's own reader (any URI it reads: file:, hdfs://, s3a://): parquet_records's."""
    indexed, shape, total = parquet_records(spark, source)
    if total < workers:
        raise ConfigError(too_few(workers, total, f"the Parquet dataset {source}"))
    return by_shard(indexed, total, workers), shape, total


def parquet_records(spark, source):
    """(an RDD of (index, Datum bytes) of a Parquet dataset, the (C, H, W) of its images, its record count),
    read by Spark's own reader (parquet_located)."""
    located, indexed, shape, total = parquet_located(spark, source)
    return located.rdd.mapPartitions(indexed), shape, total


def parquet_located(spark, source):
    """(a DataFrame of a Parquet dataset's (part file, row in it, Datum bytes), the function that makes a partition's
    rows of it (index, Datum bytes), the (C, H, W) of its images, its record count), read by Spark's own reader.

    A record's index is its place in the files taken in sorted path order, row by row (the
    order the single-process reader reads them in): from its file's start, summed from
    per-file counts the executors make, and its row in the file (`_metadata.row_index`). It
    depends on neither how Spark splits the files into partitions nor on when, so a worker
    gets the same shard on every retry and in every run over the same files.

    The records are checked as Spark reads them (a null `datum`, not a Datum, another shape than
    the first record's), so that a bad one is named by its part file and row.
    """
    try:
        # A local path as the driver sees it; anything else (a URI) is Spark's to open.
        df = spark.read.parquet(os.path.abspath(source) if os.path.exists(source) else source)
    except Exception as error:
        raise ConfigError(f"Spark cannot read the Parquet dataset: {first_line(error)}", source) from None
    if DATUM not in df.columns:
        raise ConfigError(f"the Parquet dataset has no '{DATUM}' column (Caffe Datum bytes) but {df.columns}; "
                          f"deepspark convert-lmdb writes {', '.join(COLUMNS)}", source)
    what = f"the Parquet dataset {source}"
    located = df.select("_metadata.file_path", "_metadata.row_index", DATUM)
    try:
        counts = sorted(df.groupBy("_metadata.file_path").count().collect())
        first = located.first()
    except Exception as error:
        raise ConfigError(f"Spark cannot read the Parquet dataset: {first_line(error)}", source) from None
    if first is None:
        raise ConfigError(f"{what} is empty")
    starts = dict(zip([path for path, _ in counts], np.cumsum([0] + [n for _, n in counts[:-1]]).tolist()))
    total = sum(n for _, n in counts)
    if first[2] is None:
        raise null_row(DATUM, first[1], None, first[0])
    image, _ = decode_datum(bytes(first[2]), first[1], first[0])
    shape, dtype = tuple(int(d) for d in image.shape), image.dtype

    def present(rows, file):
        for _, row, datum in rows:
            if datum is None:
                raise null_row(DATUM, row, None, file)
            yield row, bytes(datum)

    def indexed(rows):
        # Checked here, where a record's part file and row are known (the worker's spill knows only its index);
        # a partition reads runs of rows of one file.
        for file, run in itertools.groupby(rows, key=lambda row: row[0]):
            for row, datum in checked_records(present(run, file), file, shape, dtype):
                yield starts[file] + row, datum

    return located, indexed, shape, total


def dataframe_shards(df, workers, what="the DataFrame"):
    """A DataFrame's rows as balanced_shards gives them, the (C, H, W) of its images and the total.

    Rows hold either `datum` (serialized Caffe Datum bytes) or `data` (an image
    array: C x H x W, or H x W for one channel; uint8 or float) and `label`.
    """
    rows = df.select(*source_for(df).columns).rdd
    counts, first = partition_counts(df.sparkSession.sparkContext, rows)
    if first is None:
        raise ConfigError(f"{what} is empty")
    shape = datum_shape(row_datum(0, first))
    shards, total = balanced_shards(rows, counts, workers, lambda index, row: row_datum(index, row, shape), what)
    return shards, shape, total


@dataclasses.dataclass(frozen=True)
class Range:
    """A shard that its executor reads itself: records [start, stop) of the LMDB at `source`, which
    holds `total` records when the driver counts them (its partition's one item)."""

    source: str
    start: int
    stop: int
    total: int


@dataclasses.dataclass(frozen=True)
class Listed:
    """A shard of a net that reads its data through its own layers (HDF5Data and ImageData lists, a Python
    data layer, DummyData): shard `shard` of `shards`, which the executor's feeders read themselves, nothing
    spilled (its partition's one item)."""

    shard: int
    shards: int


def unreadable_lmdb(source, total, who, ways_on=""):
    """Why this executor cannot read the LMDB at `source` as the driver counted it (`total` records), in one
    line that starts with `who` and, for an LMDB it cannot see, names the ways on (`ways_on` adds to them);
    None when it can."""
    host = socket.gethostname()
    if not os.path.exists(source):
        return (f"{who} on {host}: the LMDB {source} is not visible here; put it on storage every executor sees at "
                f"that path, or convert it to Parquet (deepspark convert-lmdb {source} DEST.parquet){ways_on}")
    here = lmdb_io.count(source)
    if here != total:
        return (f"{who} on {host}: the LMDB {source} holds {here} records here and {total} on the driver; every "
                "executor must see the same LMDB")
    return None
