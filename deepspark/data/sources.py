"""The record sources a Data layer or a job reads Datum records from, in one registry: LMDB, Parquet, DataFrame.

A source is a dataset of (key, Datum bytes) records in an order of its own (an
LMDB's key order, a Parquet dataset's file order, a DataFrame's row order),
read by record range: count, chunks and read of records [start, stop), the
first record, the Shard a worker reads (shard_range's contiguous part), and
write where a source of that kind can be made. `source_for(location)` picks the
kind: a Spark DataFrame, a Parquet dataset (a `.parquet` path, a folder of
them, a URI), else an LMDB. Callers ask the source (its `name`, `kind`,
`keyed`, `counterpart`), never which module reads it.

HDF5Data and ImageData lists are not record sources: their rows are a layer's
own arrays or image files, read by their feeders (hdf5.py, images.py), which
share the feeder interface of resume.py (shards, resume, the order hook).
"""

import dataclasses
import itertools

import numpy as np

from deepspark.data import lmdb_io, parquet
from deepspark.data.datum import DataError, check_datum, decode_datum, encode_datum
from deepspark.graph import fmt

CHUNK = 4096  # records per chunk a reader yields unless asked otherwise


class RecordSource:
    """A dataset of (key, Datum bytes) records read by record range: the interface every kind implements.

    name: its row in SOURCES; kind: what a line calls it ("LMDB"); keyed: whether a
    record can be fetched by its key (a shuffled shard then streams, not held whole);
    counterpart: the SOURCES name that convert-lmdb turns it into (None: none).
    present(), output_refusal(out), write(): what a converter asks of it.
    """

    name = kind = counterpart = None
    keyed = False
    key_order = False  # whether it holds its records in key order, one per key (what it is written in, not given)

    def __init__(self, location):
        self.location = location

    def present(self):
        """Whether its location holds a source of this kind (a Parquet dataset's reader says itself why not)."""
        return True

    @classmethod
    def output_refusal(cls, out):
        """Why `out` cannot name a new source of this kind (one line), or None."""
        return None

    @classmethod
    def claims(cls, location):
        """Whether `location` names a source of this kind."""
        raise NotImplementedError

    def count(self):
        """Number of records."""
        raise NotImplementedError

    def chunks(self, start=0, stop=None, chunk=CHUNK):
        """Lists of up to `chunk` (key, value) pairs of records start..stop-1, in the source's order; memory
        bounded by a chunk (or a Parquet row group), whatever the dataset's size."""
        raise NotImplementedError

    def read(self, start=0, stop=None, keys_only=False):
        """(key, value) pairs of records start..stop-1 in the source's order (keys only: each key)."""
        for block in self.chunks(start, stop):
            yield from ((key for key, _ in block) if keys_only else block)

    def first_record(self):
        """(key, value) of the first record, or DataError if there is none."""
        for record in self.read(0, 1):
            return record
        raise DataError(f"the {self.kind} is empty", self.where)

    @property
    def where(self):
        """What an error names as the file: the source's path or URI."""
        return self.location

    def shard(self, shard, num_shards):
        """The Shard `shard` of `num_shards` (lmdb_io.shard_range's records), or DataError if it is empty."""
        total = self.count()
        start, stop = lmdb_io.shard_range(total, shard, num_shards)
        if start == stop:
            raise DataError(f"shard {shard} of {num_shards} is empty: the {self.kind} holds only {total} records",
                            self.where)
        return Shard(self, start, stop)

    def lookup(self):
        """A Lookup of records by key; only where `keyed`."""
        raise DataError(f"a {self.kind} has no lookup by key", self.where)

    @classmethod
    def write(cls, out, records, overwrite=False, source=None):
        """Write (key, Datum bytes) pairs as a new source of this kind at `out` (under a temporary name renamed
        at the end); the count. source: where the records come from, for errors."""
        raise DataError(f"DeepSpark does not write a {cls.kind}", out)

    def describe(self):
        """The source in a log line's words: `the LMDB /data/train_lmdb`."""
        return f"the {self.kind} {self.location}"


class LmdbSource(RecordSource):
    """An LMDB of Datum records (Caffe's convert_imageset's), in key order; its records can be looked up by key."""

    name, kind, counterpart, keyed, key_order = "lmdb", "LMDB", "parquet", True, True

    @classmethod
    def claims(cls, location):
        return isinstance(location, str)  # the fallback: a path that is nothing else is read (or refused) as an LMDB

    def present(self):
        return lmdb_io.is_lmdb(self.location)

    @classmethod
    def output_refusal(cls, out):
        if parquet.writes_parquet(out) or parquet.is_uri(out):
            return "the output is an LMDB: a local folder, not a name ending in .parquet or a URI"
        return None

    def count(self):
        return lmdb_io.count(self.location)

    def chunks(self, start=0, stop=None, chunk=CHUNK):
        return lmdb_io.read_chunks(self.location, start, stop, chunk)

    def read(self, start=0, stop=None, keys_only=False):
        return lmdb_io.read_records(self.location, start, stop, keys_only)

    def lookup(self):
        return Lookup(self.location)

    @classmethod
    def write(cls, out, records, overwrite=False, source=None):
        return lmdb_io.write_lmdb(out, records, overwrite=overwrite)


class ParquetSource(RecordSource):
    """A Parquet dataset (parquet.py's columns) on any URI pyarrow opens here, in file order; no lookup by key."""

    name, kind, counterpart = "parquet", "Parquet dataset", "lmdb"

    @classmethod
    def claims(cls, location):
        return isinstance(location, str) and parquet.is_parquet(location)

    def count(self):
        return parquet.count(self.location)

    def chunks(self, start=0, stop=None, chunk=CHUNK):
        return parquet.read_chunks(self.location, start, stop, chunk)

    @classmethod
    def write(cls, out, records, overwrite=False, source=None):
        return parquet.write_parquet(out, records, overwrite=overwrite, source=source)


class DataFrameSource(RecordSource):
    """A Spark DataFrame of `datum` (Datum bytes) or `data` (an image array) and `label` columns, in row order;
    record i's key is `%08d` of i. Read here through the driver (toLocalIterator, a partition at a time): a
    job's shards read it on the executors instead (spark/shards.py)."""

    name, kind = "dataframe", "DataFrame"

    @classmethod
    def claims(cls, location):
        return hasattr(location, "columns") and hasattr(location, "toLocalIterator")  # no pyspark import here

    @property
    def where(self):
        return None  # a DataFrame has no file; its errors name the row

    @property
    def columns(self):
        """The columns the records are made of, or a DataError saying which are needed, or that the labels
        are not integers."""
        columns = set(self.location.columns)
        if "datum" in columns:
            return ["datum"]
        if not {"data", "label"} <= columns:
            raise DataError(f"the DataFrame needs a 'datum' column (Datum bytes) or 'data' and 'label' columns; "
                            f"it has {sorted(columns)}")
        kind = self.location.schema["label"].dataType.typeName()
        if kind not in ("byte", "short", "integer", "long"):
            raise DataError(f"the DataFrame's 'label' column holds {kind} values; Caffe's labels are integers "
                            "(cast it: df.withColumn('label', df.label.cast('int')))")
        return ["data", "label"]

    def count(self):
        return self.location.count()

    def chunks(self, start=0, stop=None, chunk=CHUNK):
        rows = self.location.select(*self.columns).toLocalIterator()
        block, shape = [], None
        for index, row in enumerate(rows):
            if stop is not None and index >= stop:
                break
            if index < start:
                continue
            datum = row_datum(index, row, shape)
            if shape is None:
                shape = datum_shape(datum)
            block.append((b"%08d" % index, datum))
            if len(block) == chunk:
                yield block
                block = []
        if block:
            yield block

    def describe(self):
        return f"a DataFrame of {self.location.columns}"


def datum_shape(datum):
    """(C, H, W) of a Datum's image (decoded if encoded): what every later row of a DataFrame must match."""
    return tuple(int(d) for d in decode_datum(datum)[0].shape)


# The kinds, asked in this order: the first that claims a location reads it (an LMDB claims any other path).
SOURCES = {kind.name: kind for kind in (DataFrameSource, ParquetSource, LmdbSource)}


def source_for(location):
    """The RecordSource of a Data layer's source (a path or URI) or of a DataFrame."""
    for kind in SOURCES.values():
        if kind.claims(location):
            return kind(location)
    raise DataError(f"not a record source: {type(location).__name__} (an LMDB or Parquet path, a URI or a "
                    "DataFrame)")


def writer_for(out):
    """The source kind `write_records` makes at `out`: Parquet for a name ending in `.parquet`, else an LMDB."""
    return ParquetSource if parquet.writes_parquet(out) else LmdbSource


def write_records(out, records, overwrite=False):
    """(key, Datum bytes) pairs to a new dataset at out: Parquet when out ends in `.parquet`, else an LMDB."""
    return writer_for(out).write(out, records, overwrite=overwrite)


@dataclasses.dataclass(frozen=True)
class Shard:
    """Records [start, stop) of a source: what one worker's feeder reads, in the source's order."""

    source: RecordSource
    start: int
    stop: int

    @property
    def size(self):
        return self.stop - self.start

    def chunks(self, offset=0, chunk=CHUNK):
        """source.chunks of the shard's records from its position `offset` to its end."""
        return self.source.chunks(self.start + offset, self.stop, chunk)

    def read(self, keys_only=False):
        return self.source.read(self.start, self.stop, keys_only)

    def first_record(self):
        return next(iter(self.source.read(self.start, self.start + 1)))


class Lookup:
    """Records of an LMDB fetched by key in one read transaction, opened on first use (a shuffled streamed shard):
    each of some keys, or a run of records from a key on."""

    def __init__(self, path):
        self.path, self._txn = path, None

    def _begun(self):
        if self._txn is None:
            self._txn = lmdb_io.open_db(self.path).begin(buffers=False)
        return self._txn

    def values(self, keys):
        txn = self._begun()
        return [txn.get(key) for key in keys]

    def run(self, key, count, skip=0):
        """Up to `count` (key, value) records in key order from `key` on, `skip` records past it: a cursor placed by
        key, then stepped over those."""
        cursor = self._begun().cursor()
        if not cursor.set_range(key):
            return []
        for _ in range(skip):
            if not cursor.next():
                return []
        return list(itertools.islice(cursor.iternext(), count))

    def close(self):
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
            lmdb_io.close_db(self.path)


def row_datum(index, row, shape=None):
    """The Datum bytes of DataFrame row `index`: its `datum` bytes, or its `data` array (of `shape`,
    when given: the first row's) and `label`; a DataError naming the row when it cannot be one."""
    fields = row.asDict() if hasattr(row, "asDict") else dict(row)
    if "datum" in fields:
        if fields["datum"] is None:
            raise DataError(f"DataFrame row {index}: its 'datum' is null; every row needs its Datum bytes")
        datum = bytes(fields["datum"])
        try:
            check_datum(datum, index, None, shape)  # a parse: row_datum runs once per row, where it is known
        except DataError as error:
            raise DataError(f"DataFrame {error}") from None  # "row N: what" as "DataFrame row N: what"
        return datum
    image = np.asarray(fields["data"])
    if image.ndim == 2:
        image = image[None]
    if image.dtype.kind not in "buif" or image.ndim != 3:
        raise DataError(f"DataFrame row {index}: 'data' must be an image array (C x H x W, or H x W) of numbers, "
                        f"not {image.dtype} of shape {fmt(image.shape)}")
    if shape is not None and image.shape != tuple(shape):
        raise DataError(f"DataFrame row {index}: its image is {fmt(image.shape)}, the first row's is {fmt(shape)}; "
                        "a net takes images of one size")
    try:
        label = int(fields["label"])
    except (TypeError, ValueError):
        raise DataError(f"DataFrame row {index}: label {fields['label']!r} is not an integer") from None
    return encode_datum(image if image.dtype == np.uint8 else image.astype(np.float32), label)
