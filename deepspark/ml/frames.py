"""A DataFrame's images and labels for fit and transform: checked on the driver in Spark SQL (one line naming the
column and the bad value), sampled for their scale, split for validation, and made Caffe Datums on the executors
through Arrow (mapInArrow, which Spark Connect serves too)."""

import contextlib
import dataclasses
import logging
import typing

import numpy as np
import pyarrow as pa
from py4j.protocol import Py4JError, Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import SparseVector, VectorUDT
from pyspark.sql import functions as F
from pyspark.sql import types as T

from deepspark.data import lmdb_io
from deepspark.errors import ConfigError
from deepspark.graph import fmt
from deepspark.ml import images
from deepspark.ml.images import ARRAY, DATUM, VECTOR
from deepspark.spark.failures import JobError, first_line

# Rows of the input a fit or transform looks at to tell the scale of its values (the first ones: no full pass).
SAMPLE_ROWS = 64
# A Spark ML vector as toArrow gives it (VectorUDT's sqlType; images.SPARSE).
VECTOR_ARROW = pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                          ("values", pa.list_(pa.float64()))])


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Where a DataFrame's images and labels are, and what the net takes."""

    column: str  # inputCol
    kind: str  # DATUM, VECTOR or ARRAY
    depth: int  # how deep an ARRAY's arrays nest
    shape: tuple  # (C, H, W) of an image; None: each Datum's own
    label: str = None  # labelCol; None: the Datums' own labels
    classes: int = None  # how many classes the net's labels index; None: no check
    ignored: int = None  # a label value the net's loss ignores (loss_param.ignore_label)


def input_kind(df, column):
    """(DATUM, VECTOR or ARRAY: what the input column holds, how deep its arrays nest); one line if none."""
    if column not in df.columns:
        raise ConfigError(f"the DataFrame has no column '{column}' (inputCol); it has {df.columns}")
    kind = df.schema[column].dataType
    if isinstance(kind, T.BinaryType):
        return DATUM, 0
    if isinstance(kind, VectorUDT):
        return VECTOR, 0
    depth = 0
    while isinstance(kind, T.ArrayType):
        kind, depth = kind.elementType, depth + 1
    if depth and isinstance(kind, T.NumericType):
        return ARRAY, depth
    raise ConfigError(f"inputCol '{column}' holds {df.schema[column].dataType.simpleString()}; DeepSpark takes "
                      "Caffe Datum bytes (binary), a Spark ML vector, or an array of numbers (flat or nested)")


def flat_numbers(column, kind, depth):
    """The Column of an image's numbers as one flat array (None for Datum bytes, which Spark SQL cannot read)."""
    if kind == VECTOR:
        return vector_to_array(F.col(column))
    if kind == ARRAY:
        flat = F.col(column)
        for _ in range(depth - 1):
            flat = F.flatten(flat)
        return flat
    return None


def label_column(df, column, required):
    """`column` when the DataFrame has it (its values whole numbers of any numeric type), else None where a Datum
    carries its own label (not `required`); one line otherwise."""
    if column not in df.columns:
        if required:
            raise ConfigError(f"the DataFrame has no column '{column}' (labelCol) beside its images; it has "
                              f"{df.columns}")
        return None
    kind = df.schema[column].dataType
    if not isinstance(kind, (T.NumericType, T.BooleanType)):
        raise ConfigError(f"labelCol '{column}' holds {kind.simpleString()} values; a label is a class index "
                          "(0, 1, ...): index them first (pyspark.ml.feature.StringIndexer)")
    return column


def label_names(df, column):
    """The class names whose indices `column` holds, in index order, where a StringIndexer made it (its nominal ML
    attribute: the stage before DeepSpark's in a Pipeline), else None."""
    attribute = df.schema[column].metadata.get("ml_attr", {}) if column else {}
    return [str(name) for name in attribute["vals"]] if attribute.get("type") == "nominal" and \
        "vals" in attribute else None


@contextlib.contextmanager
def spark_job(what):
    """A Spark job DeepSpark runs for `what`, its failure the one line that says why (a worker's DeepSpark line
    first: failures.first_line), raised from None; Spark's whole report (the workers' tracebacks, the Java stack) to
    the "deepspark" logger, at debug level."""
    try:
        yield
    except (PySparkException, Py4JJavaError) as error:
        logging.getLogger("deepspark").debug("%s: Spark's report: %s", what, error)
        raise JobError(f"{what}: {first_line(error)}", detail=str(error)) from None


def held_in_driver(df):
    """Whether the rows of classic Spark's `df` are held in the driver's heap (a DataFrame made from a Python list or a
    pandas DataFrame: a local relation's, or an existing RDD's scan of a parallelized collection), which Spark ships
    inside each task of every job that reads them. Planned, not run."""
    try:
        execution = df._jdf.queryExecution()
        plan = execution.executedPlan().toString()
        if "LocalTableScan" not in plan and "Scan ExistingRDD" not in plan:
            return False
        return "ParallelCollectionRDD" in execution.toRdd().toDebugString()
    except Py4JError:  # only a warning hangs on it
        return False


class Head(typing.NamedTuple):
    """The input's first rows as first_rows reads them: the values that are not null, and where the first null is."""
    values: pa.Array
    null_row: int = None  # the first null row's position among them (None: none)


def first_rows(df, column):
    """The values of `column` in its first SAMPLE_ROWS rows that are not null, on the driver, as the Arrow array
    toArrow gives, and the first null's row: one small job, that an image's shape, the scale of its values and a
    null row (a one-line error on the driver, where vector_to_array's failed in the executors) are all read from.
    Collected as rows: a collected limit reads the first partition (more only where it falls short), where toArrow's
    shuffles the first rows of every partition into one (twice the time here)."""
    kind = input_kind(df, column)[0]
    with spark_job(f"reading the first rows of inputCol '{column}'"):
        rows = [row[0] for row in df.select(column).limit(SAMPLE_ROWS).collect()]
    null_row = next((i for i, value in enumerate(rows) if value is None), None)
    values = [value for value in rows if value is not None]
    if kind == DATUM:
        return Head(pa.array([bytes(value) for value in values], pa.binary()), null_row)
    if kind == VECTOR:
        return Head(pa.array([{"type": images.SPARSE, "size": v.size, "indices": v.indices.tolist(),
                               "values": v.values.tolist()} if isinstance(v, SparseVector) else
                              {"type": 1, "values": v.values.tolist()} for v in values], VECTOR_ARROW), null_row)
    return Head(pa.array(values), null_row)


def head(df, column):
    """The values of first_rows(df, column) that are not null."""
    return first_rows(df, column).values


def sample(df, column, kind, shape, first=None):
    """The images of the first SAMPLE_ROWS rows that hold one, on the driver; `first`: head(df, column) if taken."""
    return images.column_images(head(df, column) if first is None else first, kind, shape)[0]


def checked(df, inputs, skip):
    """`df` with its rows checked in one Spark SQL pass: a null image (or one of another size) or label, a label
    that is not a whole number or not one of the net's `inputs.classes`; one line naming the first, or, with
    `skip`, the rows with a null or malformed image or a null label left out."""
    image = F.col(inputs.column)
    label = F.col(inputs.label).cast("double") if inputs.label else None
    flat = flat_numbers(inputs.column, inputs.kind, inputs.depth)
    size = int(np.prod(inputs.shape)) if inputs.shape else None
    bad = {"null image": image.isNull()}
    if flat is not None and size:
        bad["size"] = F.when(image.isNotNull(), F.size(flat) != size)  # vector_to_array refuses a null
    if label is not None:
        bad["null label"] = label.isNull()
        bad["fraction"] = label != F.floor(label)
        outside = (label < 0) | (label >= inputs.classes) if inputs.classes else F.lit(False)
        bad["range"] = outside if inputs.ignored is None else outside & (label != inputs.ignored)
    counts = df.agg(*(F.sum(F.coalesce(test, F.lit(False)).cast("long")).alias(name)
                      for name, test in bad.items())).first().asDict()
    if skip:
        invalid = [bad[name] for name in ("null image", "size", "null label") if name in bad]
        keep = ~F.coalesce(_any(invalid), F.lit(False))
        counts = {name: n for name, n in counts.items() if name not in ("null image", "size", "null label")}
        df = df.filter(keep)
    for name, n in counts.items():
        if n:
            raise ConfigError(_bad_line(df, inputs, name, n, bad[name], flat, size))
    return df


def _any(tests):
    out = tests[0]
    for test in tests[1:]:
        out = out | test
    return out


def _bad_line(df, inputs, name, n, test, flat, size):
    """The one line for `n` rows failing the check `name`, with the first one's value."""
    rows = f"{n} row{'s' if n > 1 else ''}"
    if name == "null image":
        return f"inputCol '{inputs.column}' is null in {rows} (handleInvalid='skip' leaves them out)"
    if name == "null label":
        return f"labelCol '{inputs.label}' is null in {rows} (handleInvalid='skip' leaves them out)"
    if name == "size":
        found = df.filter(test).select(F.size(flat)).first()[0]
        return (f"inputCol '{inputs.column}' holds {found} numbers in {rows}; the net takes {fmt(inputs.shape)} = "
                f"{size} (set inputShape for another layout, or handleInvalid='skip')")
    value = df.filter(test).select(inputs.label).first()[0]
    if name == "fraction":
        return f"labelCol '{inputs.label}' holds {value!r}, not a whole number; a label is a class index (0, 1, ...)"
    return (f"labelCol '{inputs.label}' holds {value!r} in {rows}; the net has {inputs.classes} outputs, so its "
            f"labels are 0 to {inputs.classes - 1}")


def to_datums(inputs, skip):
    """The mapInArrow function that makes each row of (image, label) one Caffe Datum: `datum` bytes."""
    column, label, kind, shape = inputs.column, inputs.label, inputs.kind, inputs.shape

    def run(batches):
        for batch in batches:
            values = batch.column(0)
            found, ok = images.column_images(values, kind, shape)
            if not ok.all() and not skip:
                raise images.bad_row(values, kind, shape, ok, f"inputCol '{column}'")
            row_labels = images.labels(batch.column(1))[ok] if label else None
            if kind == DATUM:
                kept = [value for value, good in zip(values.to_pylist(), ok) if good]
                out = kept if row_labels is None else images.relabelled(kept, row_labels)
            else:
                out = images.datums(found, row_labels)
            yield pa.RecordBatch.from_arrays([pa.array(out, pa.binary())], ["datum"])

    return run


def datum_frame(df, inputs, skip):
    """`df` as the training job reads it: one `datum` column of Caffe Datum bytes, made on the executors."""
    columns = [inputs.column] + ([inputs.label] if inputs.label else [])
    return df.select(*columns).mapInArrow(to_datums(inputs, skip), "datum binary")


def split(df, column, fraction, seed):
    """(the rows to train on, the rows to validate on or None): `column`'s true rows, or a random `fraction`."""
    if column:
        if column not in df.columns:
            raise ConfigError(f"the DataFrame has no column '{column}' (validationCol); it has {df.columns}")
        if not isinstance(df.schema[column].dataType, T.BooleanType):
            raise ConfigError(f"validationCol '{column}' holds {df.schema[column].dataType.simpleString()}; it "
                              "takes booleans (true: a row to validate on)")
        held = F.coalesce(F.col(column), F.lit(False))
        return df.filter(~held), df.filter(held)
    if not fraction:
        return df, None
    if not 0 < fraction < 1:
        raise ConfigError(f"validationFraction is {fraction:g}; it takes a fraction of the rows, between 0 and 1")
    train, valid = df.randomSplit([1 - fraction, fraction], seed)
    return train, valid


def write_datums(frame, path):
    """The `datum` rows of `frame`, brought to the driver one partition at a time, as an LMDB at `path` (Caffe's
    keys: the index, 10 digits); their count."""
    rows = ((b"%010d" % index, bytes(row[0])) for index, row in enumerate(frame.toLocalIterator()))
    return lmdb_io.write_lmdb(path, rows, overwrite=True)
