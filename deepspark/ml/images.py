"""Images and labels out of the Arrow columns of a DataFrame as pyspark.ml makes them (Spark ML vectors, flat or
nested arrays of numbers, Caffe Datum bytes), on the driver and the executors alike, and the scale their values
need before a net's transform_param."""

import numpy as np
import pyarrow as pa

from deepspark.data import DataError, decode_datum, encode_datum
from deepspark.data.datum import parse_datum
from deepspark.graph import fmt
from deepspark.proto import deepspark_pb2 as pb

# The kinds of input column, by what Spark's schema says the column holds.
DATUM, VECTOR, ARRAY = "datum", "vector", "array"

# A Spark ML vector as Arrow carries it (VectorUDT's sqlType): struct<type, size, indices, values>; type 0 is a
# SparseVector of `size` with values at `indices`, 1 a DenseVector of `values`.
SPARSE = 0

# What Caffe's transform_param scale is for a net that takes whole 0-255 pixels and means [0, 1] inside: LeNet's
# 0.00390625 (1/256), and 1/255.
PIXEL_SCALES = (1 / 256, 1 / 255)
PIXEL_MAX = 255.0


def _flat_list(array):
    """(the numbers of a list array of any depth as numpy; per row, where its numbers start there and how many)."""
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        n = len(array)
        return array.to_numpy(zero_copy_only=False), np.arange(n, dtype=np.int64), np.ones(n, np.int64)
    offsets = np.asarray(array.offsets, np.int64)
    offsets = offsets - offsets[0]
    values, starts, counts = _flat_list(array.values.slice(int(np.asarray(array.offsets)[0]), int(offsets[-1])))
    first, last = offsets[:-1], offsets[1:] - 1  # each row's first and last element in the level below
    filled = (last >= first) & ~array.is_null().to_numpy(zero_copy_only=False)
    if not len(starts):
        return values, np.zeros(len(array), np.int64), np.zeros(len(array), np.int64)
    row_starts = np.where(filled, starts[np.clip(first, 0, len(starts) - 1)], 0)
    row_ends = np.where(filled, (starts + counts)[np.clip(last, 0, len(starts) - 1)], 0)
    return values, row_starts, row_ends - row_starts


def _flat_vectors(array):
    """_flat_list of a column of Spark ML vectors, each sparse one laid out dense after the rest."""
    kinds, sizes, indices, values = array.flatten()
    null = array.is_null().to_numpy(zero_copy_only=False)
    flat, starts, counts = _flat_list(values)
    counts = np.where(null, 0, counts)
    sparse = np.flatnonzero((kinds.fill_null(1).to_numpy(zero_copy_only=False) == SPARSE) & ~null)
    if not len(sparse):
        return flat, starts, counts
    dense = []
    for row in sparse:
        vector = np.zeros(sizes[row].as_py(), np.float64)
        vector[np.asarray(indices[row].as_py(), np.int64)] = flat[starts[row]:starts[row] + counts[row]]
        starts[row], counts[row] = len(flat) + sum(len(d) for d in dense), len(vector)
        dense.append(vector)
    return np.concatenate([flat, *dense]), starts, counts


def column_images(column, kind, shape):
    """(an N' x C x H x W array of the images of an Arrow column, N bools: which rows hold one): a row holds an image
    when it is not null and has C*H*W numbers (a vector or array) or is a Datum (of `shape`, when given: None takes
    the first one's). Datum images come as stored (uint8, or float32); others as their numbers' type."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if kind == DATUM:
        return _datum_images(column, shape)
    flat, starts, counts = (_flat_vectors if kind == VECTOR else _flat_list)(column)
    size = int(np.prod(shape))
    ok = counts == size
    return flat[starts[ok][:, None] + np.arange(size)].reshape((int(ok.sum()),) + tuple(shape)), ok


def _datum_images(column, shape):
    values = column.to_pylist()
    images, ok = [], np.zeros(len(values), bool)
    for row, value in enumerate(values):
        if value is None:
            continue
        try:
            image, _ = decode_datum(value)
        except DataError:
            continue
        if shape is None:
            shape = image.shape
        if image.shape == tuple(shape):
            images.append(image)
            ok[row] = True
    if not images:
        return np.zeros((0,) + tuple(shape or (0, 0, 0)), np.uint8), ok
    return np.stack(images), ok


def bad_row(column, kind, shape, ok, what):
    """The DataError naming the first row of `column` that column_images found no image in: `what` names the
    column (and the rows' place)."""
    row = int(np.flatnonzero(~ok)[0])
    value = column[row]
    if not value.is_valid:
        return DataError(f"{what}: row {row} is null (handleInvalid='skip' leaves such rows out)")
    if kind == DATUM:
        try:
            image, _ = decode_datum(value.as_py())
        except DataError as error:
            return DataError(f"{what}: row {row}: {str(error).split(': ', 1)[-1]}")
        return DataError(f"{what}: row {row} holds a {fmt(image.shape)} image; the net takes {fmt(shape)}")
    count = int((_flat_vectors if kind == VECTOR else _flat_list)(column.slice(row, 1))[2][0])
    return DataError(f"{what}: row {row} holds {count} numbers; the net takes {fmt(shape)} = {int(np.prod(shape))} "
                     "(set inputShape for another layout)")


def labels(column):
    """The labels of an Arrow column as float64 (null as NaN)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return np.asarray(column.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False), np.float64)


def as_stored(images):
    """`images` as a Datum stores them: uint8 when every value is a whole number in 0..255 (Spark ML's doubles of
    pixels: four times fewer bytes, the same values), else float32."""
    if images.dtype == np.uint8:
        return images
    if images.size and images.min() >= 0 and images.max() <= 255 and np.array_equal(images, np.floor(images)):
        return images.astype(np.uint8)
    return images.astype(np.float32)


def datums(images, row_labels):
    """Serialized Datums of N images and N labels (whole numbers)."""
    stored = as_stored(images)
    return [encode_datum(image, int(label)) for image, label in zip(stored, row_labels)]


def relabelled(values, row_labels):
    """Datum bytes with their labels replaced by `row_labels`."""
    out = []
    for value, label in zip(values, row_labels):
        datum = parse_datum(value)
        datum.label = int(label)
        out.append(datum.SerializeToString())
    return out


def input_scale(sample, transform_scale):
    """The inputScale that images like `sample` need before a transform_param scaling by `transform_scale`: where
    that scale is one of PIXEL_SCALES (a net for 0-255 pixels) and the sampled values are already within [0, 1]
    (not all 0), 255, which makes them again the pixels they were made of (the usual x / 255), so that the net sees
    what it was made for, its transform_param and mean included; else 1."""
    sample = np.asarray(sample)
    for_pixels = any(abs(transform_scale / scale - 1) < 1e-3 for scale in PIXEL_SCALES)
    if for_pixels and sample.size and sample.min() >= 0 and 0 < sample.max() <= 1:
        return PIXEL_MAX
    return 1.0


def scaled_transform(param, scale, mean=None):
    """(the TransformationParameter, the mean image) that do what `param` and `mean` do to images multiplied by
    `scale` first: Caffe's (x * scale - mean) * s is (x - mean / scale) * (s * scale)."""
    out = pb.TransformationParameter()
    out.CopyFrom(param)
    if scale == 1:
        return out, mean
    out.scale = param.scale * scale
    out.mean_value[:] = [value / scale for value in param.mean_value]
    return out, None if mean is None else (np.asarray(mean, np.float32) / np.float32(scale))
