"""Caffe's Datum and BlobProto records to and from numpy arrays (raw, float_data, PNG/JPEG)."""

import io
import itertools

import numpy as np
from google.protobuf.message import DecodeError

from deepspark import checkpoint
from deepspark.errors import ConfigError
from deepspark.graph import fmt
from deepspark.proto import deepspark_pb2 as pb


class DataError(ConfigError):
    """A bad data file or record: one line naming the file (and the record's key)."""


def _where(key):
    """A record as errors name it: by its key (an LMDB key, a Parquet key column), or `row N` given an
    int (a Parquet file's or a DataFrame's row, where there is no key)."""
    if key is None:
        return "record"
    if isinstance(key, int):
        return f"row {key}"
    if isinstance(key, (bytes, bytearray, memoryview)):
        key = bytes(key).decode("utf-8", "backslashreplace")
    return f"record {key!r}"


# Colour order: Caffe reads images with OpenCV, so a 3-channel Datum holds BGR
# (raw or encoded-then-decoded). Pillow speaks RGB; we flip at the Pillow boundary
# so that our LMDBs and Caffe's hold the same bytes.

def image_to_array(image, color=None):
    """A Pillow image to uint8 CHW in Caffe's channel order (gray: 1 channel, colour: BGR).

    color=None keeps the image's own kind (Caffe's DecodeDatumNative), True forces
    3 channels, False forces 1.
    """
    if color is None:
        color = image.mode not in ("L", "I;16", "I", "F", "1", "LA")
    image = image.convert("RGB" if color else "L")
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        return array[np.newaxis].copy()
    return np.ascontiguousarray(array[:, :, ::-1].transpose(2, 0, 1))


def array_to_image(array):
    """uint8 CHW (1 channel, or 3 channels BGR) to a Pillow image."""
    from PIL import Image
    array = np.asarray(array)
    if array.ndim != 3 or array.shape[0] not in (1, 3):
        raise ValueError(f"an image needs 1 or 3 channels in CHW order, got shape {array.shape}")
    if array.dtype != np.uint8:
        raise ValueError(f"an encoded image needs uint8 pixels, got {array.dtype}")
    if array.shape[0] == 1:
        return Image.fromarray(array[0], "L")
    return Image.fromarray(np.ascontiguousarray(array[::-1].transpose(1, 2, 0)), "RGB")


def encode_image(array, encode_type):
    """uint8 CHW to PNG or JPEG bytes (Caffe's cv::imencode of '.png'/'.jpg')."""
    kind = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG"}.get(encode_type.lower().lstrip("."))
    if kind is None:
        raise ValueError(f"unknown encode type {encode_type!r} (png or jpg)")
    out = io.BytesIO()
    # OpenCV's default JPEG quality is 95.
    array_to_image(array).save(out, kind, **({"quality": 95} if kind == "JPEG" else {}))
    return out.getvalue()


def decode_image(data, color=None):
    """PNG/JPEG bytes to uint8 CHW (Caffe channel order)."""
    from PIL import Image
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image_to_array(image, color)


def make_datum(array, label=0, encoded=None):
    """A Datum message from a CHW array: uint8 → data bytes, float → float_data."""
    array = np.asarray(array)
    if array.ndim != 3:
        raise ValueError(f"a Datum holds one CHW image, got shape {array.shape}")
    datum = pb.Datum()
    if encoded:
        datum.data = encode_image(array, encoded)
        datum.encoded = True
        datum.label = int(label)
        return datum
    datum.channels, datum.height, datum.width = (int(d) for d in array.shape)
    if array.dtype == np.uint8:
        datum.data = array.tobytes()
    else:
        datum.float_data.extend(array.astype(np.float32).ravel().tolist())
    datum.label = int(label)
    return datum


def encode_datum(array, label=0, encoded=None):
    """Serialized Datum bytes of a CHW array; encoded='png'|'jpg' stores a compressed image.

    Like Caffe's convert_imageset, an encoded Datum carries only data, label and
    encoded=true (no channels/height/width).
    """
    return make_datum(array, label, encoded).SerializeToString()


def parse_datum(value, key=None, filename=None):
    """Serialized bytes to a Datum message, or DataError naming the key."""
    datum = pb.Datum()
    try:
        datum.ParseFromString(bytes(value))
    except (DecodeError, RuntimeError, ValueError) as e:
        raise DataError(f"{_where(key)}: corrupt Datum ({e})", filename) from None
    return datum


def datum_to_array(datum, key=None, filename=None, color=None):
    """A Datum message to a CHW array: uint8 for data bytes/encoded, float32 for float_data."""
    if datum.encoded:
        try:
            return decode_image(datum.data, color)
        except Exception as e:  # Pillow raises many kinds for bad images
            raise DataError(f"{_where(key)}: cannot decode the encoded image ({e})",
                            filename) from None
    shape, dtype = raw_shape(datum, key, filename)
    if dtype == np.uint8:
        array = np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    else:
        array = np.array(datum.float_data, dtype=np.float32).reshape(shape)
    if color is not None and array.shape[0] != (3 if color else 1):
        raise DataError(f"{_where(key)}: force_color/force_gray apply to encoded Datums only "
                        f"(this one is raw with {array.shape[0]} channels)", filename)
    return array


_UINT8, _FLOAT32 = np.dtype(np.uint8), np.dtype(np.float32)


def raw_shape(datum, key=None, filename=None):
    """((C, H, W), uint8 or float32) of a raw (not encoded) Datum whose data or float_data holds
    C×H×W values; else DataError naming the key."""
    shape = (datum.channels, datum.height, datum.width)
    size = shape[0] * shape[1] * shape[2]
    if min(shape) <= 0:
        raise DataError(f"{_where(key)}: Datum has no shape "
                        f"(channels={shape[0]} height={shape[1]} width={shape[2]})", filename)
    data = len(datum.data)  # one read: each copies the bytes out of the message
    if data:
        if data != size:
            raise DataError(f"{_where(key)}: data holds {data} bytes, expected {size} for {fmt(shape)}", filename)
        return shape, _UINT8
    if len(datum.float_data):
        if len(datum.float_data) != size:
            raise DataError(f"{_where(key)}: float_data holds {len(datum.float_data)} values, "
                            f"expected {size} for {fmt(shape)}", filename)
        return shape, _FLOAT32
    raise DataError(f"{_where(key)}: Datum has neither data nor float_data", filename)


def decode_datum(value, key=None, filename=None, color=None):
    """Serialized Datum bytes to (CHW array, label); corrupt records raise DataError naming the key."""
    datum = parse_datum(value, key, filename)
    return datum_to_array(datum, key, filename, color), datum.label


# ---------------------------------------------------------------------------
# The .binaryproto mean file of compute_image_mean

def load_mean(path):
    """A mean .binaryproto to float32 CHW; errors name the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read the mean file ({e.strerror})", path) from None
    return parse_mean(raw, path)


def parse_mean(raw, path="<mean>"):
    """load_mean of a mean file's bytes; `path` names it in errors."""
    blob = pb.BlobProto()
    try:
        blob.ParseFromString(raw)
        mean = checkpoint.blob_to_array(blob)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise DataError(f"not a BlobProto mean file ({e})", path) from None
    if mean.ndim == 4 and mean.shape[0] == 1:
        mean = mean[0]
    if mean.ndim != 3 or mean.size == 0:
        raise DataError(f"a mean file holds one CxHxW image, this one is "
                        f"{'x'.join(map(str, mean.shape)) or 'empty'}", path)
    return mean


def save_mean(array, path):
    """Write a CHW mean as .binaryproto, 1xCxHxW as Caffe's compute_image_mean writes it (temp name, then rename)."""
    checkpoint.atomic_write(path, mean_bytes(array))


def mean_bytes(array):
    """A CHW mean as the bytes of a .binaryproto (1xCxHxW, as compute_image_mean writes it)."""
    array = np.asarray(array, np.float32)
    return checkpoint.array_to_blob(array[np.newaxis] if array.ndim == 3 else array,
                                    legacy_dims=True).SerializeToString()


# ---------------------------------------------------------------------------
# Many records at once

def _varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _tail_label(tail):
    """The label of a Datum tail (the bytes after data) holding only label/encoded=false, else None."""
    datum = pb.Datum()
    try:
        datum.ParseFromString(tail)
    except (DecodeError, RuntimeError, ValueError):
        return None
    fields = {f.name for f, _ in datum.ListFields()}
    if fields - {"label", "encoded"} or datum.encoded:
        return None
    return datum.label


def _tail_labels(tails):
    """(float32 labels, ok) of the rows of Datum tails: `label` as a varint, maybe `encoded: false`."""
    n, width = tails.shape
    if width == 0:
        return np.zeros(n, dtype=np.float32), np.ones(n, dtype=bool)
    varint = tails[:, 1:]
    if 2 <= width <= 6 and (tails[:, 0] == 0x28).all():
        # A non-negative label: 0x28 then a varint whose last byte alone lacks the high bit.
        high = varint >= 0x80
        if (high[:, :-1].all() and not high[:, -1].any()):
            weights = np.left_shift(np.int64(1), 7 * np.arange(width - 1, dtype=np.int64))
            return ((varint & 0x7F).astype(np.int64) @ weights).astype(np.float32), np.ones(n, bool)
    # Anything else (negative labels, an explicit encoded=false): one parse per distinct tail.
    unique, inverse = np.unique(tails, axis=0, return_inverse=True)
    parsed = [_tail_label(t.tobytes()) for t in unique]
    ok = np.array([label is not None for label in parsed], dtype=bool)[inverse.ravel()]
    values = np.array([label or 0 for label in parsed], dtype=np.float32)[inverse.ravel()]
    return values, ok


def _caffe_layout(values, shape):
    """Per distinct length of the serialized `values`: (rows, ok, pixels, labels), where ok marks the rows
    that are raw uint8 Datums of (C, H, W) `shape` laid out as Caffe writes them (channels, height,
    width, data, label), pixels views their data (N×C×H×W, no copy of the joined rows) and labels
    are float32. A handful of numpy operations per length instead of a protobuf parse per record."""
    size = int(np.prod(shape))
    header = (pb.Datum(channels=shape[0], height=shape[1], width=shape[2]).SerializeToString()
              + b"\x22" + _varint(size))
    lengths = list(map(len, values))
    distinct = set(lengths)
    for length in sorted(distinct):
        if length < len(header) + size:
            continue
        whole = len(distinct) == 1  # the usual case: one layout, no gathers
        rows = np.arange(len(values)) if whole else np.flatnonzero(np.array(lengths) == length)
        buf = np.frombuffer(b"".join(values if whole else [values[i] for i in rows]),
                            dtype=np.uint8).reshape(len(rows), length)
        ok = (buf[:, :len(header)] == np.frombuffer(header, dtype=np.uint8)).all(axis=1)
        labels, tail_ok = _tail_labels(buf[:, len(header) + size:])
        pixels = buf[:, len(header):len(header) + size].reshape((len(rows),) + tuple(shape))
        yield rows, ok & tail_ok, pixels, labels


def _one_size(key, filename, found, found_dtype, shape, dtype):
    """DataError unless a record of (C, H, W) `found` and `found_dtype` is of the first record's."""
    if tuple(found) != tuple(shape) or np.dtype(found_dtype) != dtype:
        raise DataError(
            f"{_where(key)} is {fmt(found)} {np.dtype(found_dtype)} but the first record is {fmt(shape)} "
            f"{np.dtype(dtype)}; records must be one size (convert-imageset --resize-height/--resize-width)",
            filename)


def decode_datums(keys, values, filename=None, color=None, shape=None, dtype=None):
    """Many serialized Datums → (N×C×H×W array, float32 labels); all must be one shape.

    Raw uint8 Datums laid out as Caffe writes them are decoded by _caffe_layout's
    vectorised compare; any other record takes the per-record path, which is also
    where a corrupt record gets its error.
    """
    n = len(values)
    if shape is None and n:
        first, _ = decode_datum(values[0], keys[0], filename, color)
        shape, dtype = first.shape, first.dtype
    images = np.empty((n,) + tuple(shape), dtype=dtype)
    labels = np.empty(n, dtype=np.float32)
    done = np.zeros(n, dtype=bool)
    if n and dtype == np.uint8:
        for rows, ok, pixels, row_labels in _caffe_layout(values, shape):
            if len(rows) == n and ok.all():
                images[:], labels[:] = pixels, row_labels
                done[:] = True
                break
            take = rows[ok]
            images[take], labels[take] = pixels[ok], row_labels[ok]
            done[take] = True
    for i in np.flatnonzero(~done):
        array, label = decode_datum(values[i], keys[i], filename, color)
        _one_size(keys[i], filename, array.shape, array.dtype, shape, dtype)
        images[i], labels[i] = array, label
    return images, labels


def check_datums(keys, values, filename=None, shape=None, dtype=None):
    """DataError naming the first of the serialized Datums `values` that is not a record of (C, H, W)
    `shape` and `dtype` (default: the first one's): not a Datum, data of another length than C×H×W,
    another shape or channel count. What decode_datums refuses, for less: raw uint8 Datums in
    Caffe's layout pass _caffe_layout's compare with no copy of their pixels; any other record is
    parsed, and an encoded image is not decoded (its reader decodes it, and names it if it cannot).
    """
    n = len(values)
    if not n:
        return
    if shape is None:
        first, _ = decode_datum(values[0], keys[0], filename)
        shape, dtype = first.shape, first.dtype
    done = np.zeros(n, dtype=bool)
    if np.dtype(dtype) == np.uint8:
        for rows, ok, _, _ in _caffe_layout(values, shape):
            done[rows[ok]] = True
    for i in np.flatnonzero(~done):
        check_datum(values[i], keys[i], filename, shape, dtype)


def check_datum(value, key=None, filename=None, shape=None, dtype=None):
    """check_datums of one record, by a parse: DataError naming `key` unless `value` is a Datum (a raw one
    of (C, H, W) `shape` and `dtype`, where given); an encoded image is parsed, not decoded."""
    datum = parse_datum(value, key, filename)
    if not datum.encoded:
        found, found_dtype = raw_shape(datum, key, filename)
        if shape is not None:
            _one_size(key, filename, found, found_dtype, shape, found_dtype if dtype is None else dtype)


# Records a stream hands to check_datums at a time: enough to make its numpy calls cheap per
# record, few enough that a stream holds only this many.
CHECK_EVERY = 1024


def checked_records(records, filename=None, shape=None, dtype=None):
    """The (key, Datum bytes) pairs of `records` as they come, CHECK_EVERY at a time through check_datums
    first (against `shape` and `dtype`, default the first record's): a stream that stops at its first
    bad record with the DataError that names it."""
    records = iter(records)
    while True:
        block = list(itertools.islice(records, CHECK_EVERY))
        if not block:
            return
        keys, values = zip(*block)
        if shape is None:
            first, _ = decode_datum(values[0], keys[0], filename)
            shape, dtype = first.shape, first.dtype
        check_datums(keys, values, filename, shape, dtype)
        yield from block
