"""Training data as Parquet, the format Spark splits and reads from any URI: one row per record.

A dataset is a `.parquet` file, a folder of Parquet files, or a URI with a scheme
(`file:`, `hdfs://`, `s3a://`, ...). Its rows hold the record's LMDB key, its
serialized Caffe Datum and, for convenience (filters, counts), the Datum's label.
"""

import contextlib
import json
import os
import re
import urllib.parse

from deepspark.data import lmdb_io
from deepspark.data.datum import DataError, parse_datum

# The columns, in order: what `convert-lmdb` writes and every reader expects.
KEY, DATUM, LABEL = "key", "datum", "label"
COLUMNS = (KEY, DATUM, LABEL)

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def is_parquet(source):
    """Whether a Data layer's source names a Parquet dataset, not an LMDB: a path ending in `.parquet`,
    a folder holding Parquet files (and no LMDB), or a URI with a scheme (`hdfs://...`, `file:...`)."""
    if not source:
        return False
    if is_uri(source):
        return True
    path = source.rstrip("/")
    if path.endswith(".parquet"):
        return True
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "data.mdb")):
        return any(name.endswith(".parquet") for name in os.listdir(path))
    return False


# ---------------------------------------------------------------------------
# Where a dataset lives

def _arrow():
    """pyarrow with its fs and parquet modules, imported on first use: LMDB-only runs need not wait for it."""
    import pyarrow.fs
    import pyarrow.parquet
    return pyarrow


def _first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def is_uri(source):
    """Whether a source is a URI with a scheme (`file:...`, `hdfs://...`), not a plain path."""
    return bool(_SCHEME.match(source)) and not re.match(r"^[A-Za-z]:[\\/]", source)  # not a Windows drive


def local_path(source):
    """The local path of a plain path (as it is) or of a `file:` URI; None for any other scheme."""
    if not is_uri(source):
        return source
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return os.path.abspath(urllib.parse.unquote(parsed.path))
    return None


def _filesystem(source):
    """(pyarrow FileSystem, path on it): local paths and `file:` URIs here, any other scheme through
    pyarrow's FileSystem.from_uri (Spark's `s3a://` is pyarrow's `s3://`)."""
    pa = _arrow()
    path = local_path(source)
    if path is not None:
        return pa.fs.LocalFileSystem(), os.path.abspath(path)
    scheme = urllib.parse.urlparse(source).scheme
    uri = "s3" + source[len("s3a"):] if scheme == "s3a" else source
    try:
        return pa.fs.FileSystem.from_uri(uri)
    except Exception as e:  # ArrowInvalid, ArrowNotImplementedError, OSError (no libhdfs): all one line
        raise DataError(f"pyarrow cannot open {scheme}:// here ({_first_line(e)}); train on Spark, which "
                        "reads it on the executors, or copy the dataset to a local path", source) from None


def _hidden(name):
    # Spark's and Hive's bookkeeping beside the part files: _SUCCESS, _metadata, .part-*.crc
    return name.startswith(("_", "."))


def part_files(source):
    """(FileSystem, [(path, name for errors)]) of a dataset: the file itself, or a folder's part files in
    sorted name order (Spark's order of the DataFrame's partitions)."""
    pa = _arrow()
    fs, root = _filesystem(source)
    try:
        info = fs.get_file_info(root)
        if info.type == pa.fs.FileType.NotFound:
            raise DataError("no such Parquet dataset (write one with deepspark convert-lmdb, or fix "
                            "data_param.source)", source)
        if info.type == pa.fs.FileType.File:
            return fs, [(root, source)]
        found = fs.get_file_info(pa.fs.FileSelector(root, recursive=True))
    except OSError as e:
        raise DataError(f"cannot read ({_first_line(e)})", source) from None
    names = sorted(f.path[len(root.rstrip("/")) + 1:] for f in found if f.type == pa.fs.FileType.File)
    names = [name for name in names if not any(_hidden(part) for part in name.split("/"))]
    if not names:
        raise DataError("the folder holds no Parquet files", source)
    return fs, [(f"{root.rstrip('/')}/{name}", f"{source.rstrip('/')}/{name}") for name in names]


@contextlib.contextmanager
def _opened(fs, path, where):
    """A ParquetFile on one part file with the columns checked, closed at the end; a bad file is one DataError."""
    pa = _arrow()
    try:
        stream = fs.open_input_file(path)
    except OSError as e:
        raise DataError(f"cannot read ({_first_line(e)})", where) from None
    try:
        try:
            file = pa.parquet.ParquetFile(stream)
        except (pa.ArrowException, OSError) as e:  # not Parquet, a truncated footer
            raise DataError(f"not a Parquet file ({_first_line(e)})", where) from None
        _check_schema(file.schema_arrow, where)
        yield file
    finally:
        stream.close()


def _check_schema(schema, where):
    pa = _arrow()
    for name, kinds in ((KEY, (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())),
                        (DATUM, (pa.binary(), pa.large_binary()))):
        index = schema.get_field_index(name)
        if index < 0:
            raise DataError(f"has no {name!r} column (it has {', '.join(schema.names) or 'none'}); a dataset "
                            f"has columns {', '.join(COLUMNS)}, as deepspark convert-lmdb writes them", where)
        if schema.field(index).type not in kinds:
            raise DataError(f"column {name!r} is {schema.field(index).type}, not {kinds[0]}", where)


def _parts(source):
    """[(FileSystem, path, name for errors, number of rows)] of every part file, from the footers."""
    fs, files = part_files(source)
    parts = []
    for path, where in files:
        with _opened(fs, path, where) as file:
            parts.append((fs, path, where, file.metadata.num_rows))
    return parts


# ---------------------------------------------------------------------------
# Reading by record range in file order (sources.ParquetSource)

def count(source):
    """Number of records in the dataset, from its footers (no data read)."""
    return sum(rows for *_, rows in _parts(source))


def read_chunks(source, start=0, stop=None, chunk=4096):
    """Lists of up to `chunk` (key, value) bytes pairs of records start..stop-1, in file order.

    Only the row groups that hold the range are read, one at a time: memory is
    bounded by the largest row group, whatever the dataset's size.
    """
    first = 0
    for fs, path, where, rows in _parts(source):
        begin, end = max(start - first, 0), rows if stop is None else min(stop - first, rows)
        first += rows
        if begin < end:
            with _opened(fs, path, where) as file:
                yield from _file_chunks(file, begin, end, chunk, where)
        if stop is not None and first >= stop:
            return


def _file_chunks(file, begin, end, chunk, where):
    """read_chunks of rows [begin, end) of one part file, a row group at a time.

    One iter_batches per row group: given all of a file's groups at once, pyarrow 26's
    reader keeps what it has read until the end (a pool as large as the file, against one group's
    size one group at a time).
    """
    first = 0
    try:
        for index in range(file.metadata.num_row_groups):
            rows = file.metadata.row_group(index).num_rows
            at = first  # the file's row of the next batch's first row
            skip, take, first = max(begin - first, 0), min(end - first, rows), first + rows
            if skip >= take:
                continue
            for batch in file.iter_batches(batch_size=chunk, row_groups=[index], columns=[KEY, DATUM],
                                           use_threads=False):
                n = batch.num_rows  # rows [skip, take) of this batch are wanted
                if min(take, n) > skip:
                    yield _pairs(batch.slice(skip, min(take, n) - skip), where, at + skip)
                skip, take, at = max(skip - n, 0), take - n, at + n
                if take <= 0:
                    break
    except OSError as e:  # pyarrow's ArrowInvalid (a corrupt page) is an OSError too
        raise DataError(f"cannot read ({_first_line(e)})", where) from None


def _pairs(batch, where, row):
    """(key, Datum bytes) pairs of a batch whose first row is row `row` of the part file `where`."""
    keys, values = batch.column(0).to_pylist(), batch.column(1).to_pylist()
    if None in keys or None in values:
        i = min(column.index(None) for column in (keys, values) if None in column)
        raise null_row(KEY if keys[i] is None else DATUM, row + i, keys[i], where)
    return [(key.encode() if isinstance(key, str) else key, value) for key, value in zip(keys, values)]


def null_row(column, row, key, where):
    """The DataError for a row of the part file `where` whose `column` is null (`key`: its key, if any)."""
    if isinstance(key, (bytes, bytearray)):
        key = bytes(key).decode("utf-8", "backslashreplace")
    named = f"row {row}" if key is None else f"row {row}, key {key!r}"
    return DataError(f"a row's {column} is null ({named}); every row needs its {column}", where)


def read_records(source, start=0, stop=None, keys_only=False):
    """(key, value) bytes of records start..stop-1 in file order (keys only: key)."""
    for block in read_chunks(source, start, stop):
        yield from ((key for key, _ in block) if keys_only else block)


# ---------------------------------------------------------------------------
# Writing

# A row group is flushed when its records reach this many bytes: the writer holds
# about one row group and so does a reader, and Spark splits a file at row-group
# boundaries (the 47 MB of Fashion-MNIST's train set make 3 splits; parquet-mr's
# default group, 128 MB, would make one).
ROW_GROUP_BYTES = 16 << 20
PART_FILE = "part-00000.parquet"  # the one file of a folder dataset, named as Spark names its parts


def writes_parquet(out_path):
    """Whether a converter's output path asks for Parquet: it ends in `.parquet`."""
    return out_path.rstrip("/").endswith(".parquet")


def write_parquet(out_path, records, overwrite=False, row_group_bytes=ROW_GROUP_BYTES, source=None, vector=None):
    """Write (key, value) pairs (value: a serialized Datum) as a Parquet dataset; returns the count.

    A path ending in `.parquet` becomes one file, any other a folder holding
    part-00000.parquet (the layout Spark writes). Rows go out a row group at a time
    to `out_path.tmp-<pid>`, renamed to out_path at the end: a failed run leaves
    nothing at out_path. A record that is not a Datum is an error naming `source`
    (where the records come from; default out_path). vector: the name of a fourth
    column, a Spark ML vector per record, whose values each record carries third
    ((key, value, values)); Spark reads it back as a vector (spark_schema).
    """
    pa = _arrow()
    path = local_path(out_path)
    if path is None:
        raise DataError("Parquet is written to a local path here (copy it to HDFS or S3 afterwards)", out_path)
    lmdb_io.refuse_existing(path, overwrite)
    tmp = lmdb_io.temp_path(path)
    lmdb_io.remove_path(tmp)
    single, blame = writes_parquet(path), source or out_path
    written = 0
    try:
        if not single:
            os.mkdir(tmp)
        schema = pa.schema([(KEY, pa.string()), (DATUM, pa.binary()), (LABEL, pa.int32())])
        if vector:
            schema = schema.append(pa.field(vector, _vector_type())).with_metadata(spark_schema(vector))
        with pa.parquet.ParquetWriter(tmp if single else os.path.join(tmp, PART_FILE), schema) as writer:
            group, size = [], 0
            for key, value, *values in records:
                group.append((_text(key, blame), value, parse_datum(value, key, blame).label, *values))
                size += len(value)
                if size >= row_group_bytes:
                    _write_group(writer, group)
                    written += len(group)
                    group, size = [], 0
            if group or not written:
                _write_group(writer, group)
                written += len(group)
        lmdb_io.rename_into(tmp, path)
    except BaseException:
        lmdb_io.remove_path(tmp)
        raise
    return written


def _text(key, where):
    if isinstance(key, str):
        return key
    try:
        return bytes(key).decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"key {bytes(key)!r} is not UTF-8 (a Parquet key is a string)", where) from None


def _write_group(writer, group):
    """One row group of (key, value, label[, vector values]) rows."""
    pa = _arrow()
    columns = list(zip(*group)) if group else [()] * len(writer.schema)
    arrays = [pa.array(columns[0], pa.string()), pa.array(columns[1], pa.binary()), pa.array(columns[2], pa.int32())]
    if len(writer.schema) > 3:
        arrays.append(pa.array([{"type": 1, "size": None, "indices": None, "values": list(map(float, v))}
                                for v in columns[3]], _vector_type()))
    writer.write_table(pa.Table.from_arrays(arrays, schema=writer.schema), row_group_size=max(len(group), 1))


def _vector_type():
    """A Spark ML vector as Parquet holds it (VectorUDT's sqlType): `type` 1 for a dense one of `values`."""
    pa = _arrow()
    return pa.struct([pa.field("type", pa.int8(), nullable=False), ("size", pa.int32()),
                      ("indices", pa.list_(pa.field("element", pa.int32(), nullable=False))),
                      ("values", pa.list_(pa.field("element", pa.float64(), nullable=False)))])


def spark_schema(vector):
    """The key-value metadata by which Spark reads the dataset write_parquet writes with a `vector` column back
    with that column a Spark ML vector (VectorUDT), not the struct Parquet holds."""
    udt = {"type": "udt", "class": "org.apache.spark.ml.linalg.VectorUDT", "pyClass": "pyspark.ml.linalg.VectorUDT",
           "sqlType": {"type": "struct", "fields": [
               {"name": "type", "type": "byte", "nullable": False, "metadata": {}},
               {"name": "size", "type": "integer", "nullable": True, "metadata": {}},
               {"name": "indices", "type": {"type": "array", "elementType": "integer", "containsNull": False},
                "nullable": True, "metadata": {}},
               {"name": "values", "type": {"type": "array", "elementType": "double", "containsNull": False},
                "nullable": True, "metadata": {}}]}}
    fields = [{"name": KEY, "type": "string"}, {"name": DATUM, "type": "binary"}, {"name": LABEL, "type": "integer"},
              {"name": vector, "type": udt}]
    schema = {"type": "struct", "fields": [{"nullable": True, "metadata": {}, **field} for field in fields]}
    return {b"org.apache.spark.sql.parquet.row.metadata": json.dumps(schema).encode()}
