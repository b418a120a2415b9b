"""The dataset tools: convert-mnist, convert-imageset and compute-image-mean, as Caffe's tools do them, and convert-lmdb."""

import contextlib
import gzip
import io
import logging
import os
import random
import zlib

import numpy as np

from deepspark.errors import ConfigError
from deepspark.data import lmdb_io
from deepspark.data.parquet import is_uri
from deepspark.data.sources import SOURCES, source_for, write_records
from deepspark.data.datum import (DataError, datum_to_array, encode_image, save_mean,
                                  image_to_array, make_datum, parse_datum)
from deepspark.proto import deepspark_pb2 as pb

IDX_IMAGES_MAGIC = 2051
IDX_LABELS_MAGIC = 2049

# What Caffe's tools print as they go (counts, progress), as log lines: the CLI shows them.
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# MNIST (IDX files, gzipped or not)

def read_idx(path, magic):
    """(header dims, payload bytes) of an IDX file with the expected magic number."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read ({e.strerror})", path) from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"corrupt gzip file ({e})", path) from None
    ndims = 3 if magic == IDX_IMAGES_MAGIC else 1
    kind = "image" if magic == IDX_IMAGES_MAGIC else "label"
    header = 4 * (1 + ndims)
    found = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if found != magic:
        raise DataError(f"wrong magic number {found} (an IDX {kind} file starts with {magic})",
                        path)
    if len(raw) < header:
        raise DataError(f"too short for an IDX {kind} file ({len(raw)} bytes)", path)
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndims)]
    expected = int(np.prod(dims))
    payload = memoryview(raw)[header:]
    if len(payload) != expected:
        raise DataError(f"holds {len(payload)} bytes after the header, but the header "
                        f"({'x'.join(map(str, dims))}) says {expected}", path)
    return dims, payload


def convert_mnist(images, labels, out, overwrite=False):
    """IDX images + labels → LMDB (or Parquet) of Datum (1x28x28 raw bytes), keys %08d; returns the count."""
    (n, rows, cols), pixels = read_idx(images, IDX_IMAGES_MAGIC)
    (n_labels,), label_bytes = read_idx(labels, IDX_LABELS_MAGIC)
    if n != n_labels:
        raise DataError(f"holds {n} images but {labels} holds {n_labels} labels", images)
    log.info(f"A total of {n} items.")
    log.info(f"Rows: {rows} Cols: {cols}")
    pixels = np.frombuffer(pixels, dtype=np.uint8).reshape(n, 1, rows, cols)
    label_values = np.frombuffer(label_bytes, dtype=np.uint8)

    def records():
        for i in range(n):
            yield f"{i:08d}".encode(), make_datum(pixels[i], int(label_values[i])).SerializeToString()

    written = write_records(out, records(), overwrite=overwrite)
    log.info(f"Processed {written} files.")
    return written


# ---------------------------------------------------------------------------
# Image folders (Caffe's convert_imageset)

def read_list_text(listfile, what="list file"):
    """The text of a list file (convert-imageset's, an ImageData or HDF5Data layer's source); one line if not."""
    try:
        with open(listfile, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"cannot read the {what} ({e.strerror})", listfile) from None
    except UnicodeDecodeError:
        raise DataError(f"the {what} is not UTF-8 text", listfile) from None


def read_list_file(listfile):
    """[(filename, label, line_number)] of a `FILENAME LABEL` list file."""
    text = read_list_text(listfile)
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        # Caffe splits at the last space, so filenames may hold spaces.
        filename, _, label = line.rpartition(" ")
        try:
            label = int(label)
        except ValueError:
            filename = ""
        if not filename.strip():
            raise ConfigError(f"expected 'FILENAME LABEL', got {line!r}", listfile, number)
        entries.append((filename.strip(), label, number))
    if not entries:
        raise DataError("the list file names no images", listfile)
    return entries


def _match_ext(filename, encode_type):
    ext = os.path.splitext(filename)[1].lower().lstrip(".")
    aliases = {"jpg": "jpeg"}
    return aliases.get(ext, ext) == aliases.get(encode_type, encode_type)


def read_image(path, color, resize=None):
    """Caffe's ReadImageToCVMat: (the file's bytes, whether it is a colour image, uint8 CHW pixels in Caffe's
    channel order: colour as BGR, or one gray channel), resized to (height, width) when `resize` is given."""
    from PIL import Image, ImageOps
    with open(path, "rb") as f:
        raw = f.read()
    with Image.open(io.BytesIO(raw)) as image:
        image.load()
        own_color = image.mode not in ("L", "1", "I", "I;16", "F", "LA")
        image = ImageOps.exif_transpose(image)  # OpenCV's imread honours EXIF orientation
        if resize:
            image = image.convert("RGB" if color else "L").resize(
                (resize[1], resize[0]), Image.BILINEAR)
        return raw, own_color, image_to_array(image, color)


def _read_image_datum(path, label, color, resize, encode_type):
    """Caffe's ReadImageToDatum: a Datum of the image at path (raw pixels, or encoded bytes)."""
    raw, own_color, array = read_image(path, color, resize)
    if not encode_type:
        return make_datum(array, label)
    # Like Caffe, an encoded Datum carries no channels/height/width.
    datum = pb.Datum(label=label, encoded=True)
    if own_color == color and not resize and _match_ext(path, encode_type):
        datum.data = raw  # the file as it is (Caffe's ReadFileToDatum)
    else:
        datum.data = encode_image(array, encode_type)
    return datum


def convert_imageset(root, listfile, out, gray=False, shuffle=False, resize_height=0,
                     resize_width=0, encoded=False, encode_type="", check_size=False,
                     seed=None, overwrite=False):
    """Images listed in `FILENAME LABEL` lines → LMDB (or Parquet) of Datum with keys %08d_FILENAME.

    Colour images are stored BGR, as Caffe (OpenCV) stores them. Returns the count.
    """
    if bool(resize_height) != bool(resize_width):
        raise ConfigError("give both --resize-height and --resize-width, or neither")
    if resize_height < 0 or resize_width < 0:
        raise ConfigError("--resize-height and --resize-width must be positive")
    encode_type = (encode_type or "").lower().lstrip(".")
    if encode_type and encode_type not in ("png", "jpg", "jpeg"):
        raise ConfigError(f"unknown --encode-type {encode_type!r} (png or jpg)")
    if encode_type and not encoded:
        encoded = True  # Caffe: "encode_type specified, assuming encoded=true"
    entries = read_list_file(listfile)
    if shuffle:
        log.info("Shuffling data")
        random.Random(seed).shuffle(entries)
    log.info(f"A total of {len(entries)} images.")
    resize = (resize_height, resize_width) if resize_height else None
    color = not gray
    first_size = []

    def records():
        for index, (filename, label, number) in enumerate(entries):
            path = os.path.join(root, filename)
            if encoded:
                kind = encode_type or os.path.splitext(filename)[1].lower().lstrip(".")
                if kind not in ("png", "jpg", "jpeg"):
                    raise ConfigError(f"cannot guess the encoding of {filename!r}; "
                                      "give --encode-type png|jpg", listfile, number)
            else:
                kind = ""
            with image_errors(path, listfile, number):
                datum = _read_image_datum(path, label, color, resize, kind)
            if check_size and not encoded:
                size = (datum.channels, datum.height, datum.width)
                if first_size and size != first_size[0]:
                    raise ConfigError(f"image {path} is {'x'.join(map(str, size))}, the first "
                                      f"was {'x'.join(map(str, first_size[0]))} (--check-size)",
                                      listfile, number)
                first_size[:] = [size]
            yield f"{index:08d}_{filename}".encode(), datum.SerializeToString()

    return write_images(out, records(), overwrite)


@contextlib.contextmanager
def image_errors(path, listfile, number):
    """An image that cannot be read or decoded, as one line naming it and the list's line."""
    try:
        yield
    except OSError as e:
        raise ConfigError(f"cannot read image {path} ({e.strerror or e})", listfile, number) from None
    except (ValueError, SyntaxError) as e:
        raise ConfigError(f"cannot decode image {path} ({e})", listfile, number) from None


def write_images(out, records, overwrite):
    """(key, value) records of a list of images written to the LMDB `out`, with convert_imageset's lines
    ("Processed N files." every 1,000 and at the end); the count."""
    def counted():
        for index, record in enumerate(records, 1):
            yield record
            if index % 1000 == 0:
                log.info(f"Processed {index} files.")

    written = write_records(out, counted(), overwrite=overwrite)
    if written % 1000:
        log.info(f"Processed {written} files.")
    return written


# ---------------------------------------------------------------------------
# The mean image

def compute_image_mean(db, out, overwrite=False):
    """The per-pixel mean of an LMDB's (or a Parquet dataset's) images → .binaryproto (1xCxHxW); returns the count."""
    lmdb_io.refuse_existing(out, overwrite)
    total, shape, first_key = None, None, None
    n = 0
    for key, value in source_for(db).read():
        array = datum_to_array(parse_datum(value, key, db), key, db)
        if total is None:
            shape, first_key = array.shape, key
            total = np.zeros(shape, dtype=np.float64 if array.dtype != np.uint8 else np.int64)
        elif array.shape != shape:
            raise DataError(f"record {key.decode('utf-8', 'backslashreplace')!r} is "
                            f"{'x'.join(map(str, array.shape))} but record "
                            f"{first_key.decode('utf-8', 'backslashreplace')!r} is "
                            f"{'x'.join(map(str, shape))}; a mean needs images of one size", db)
        total += array
        n += 1
        if n % 10000 == 0:
            log.info(f"Processed {n} files.")
    if n == 0:
        raise DataError("the dataset is empty; no mean to compute", db)
    if n % 10000:
        log.info(f"Processed {n} files.")
    mean = (total / n).astype(np.float32)
    log.info(f"Write to {out}")
    save_mean(mean, out)
    log.info(f"Number of channels: {shape[0]}")
    for c in range(shape[0]):
        log.info(f"mean_value channel [{c}]: {float(mean[c].mean())}")
    return n


# ---------------------------------------------------------------------------
# LMDB <-> Parquet

REPORT_EVERY = 10000  # records between progress lines, as compute_image_mean reports


def convert_lmdb(source, out, overwrite=False):
    """An LMDB to a Parquet dataset, or a Parquet dataset to an LMDB (the direction read from source).

    Keys and Datum bytes are copied as they are, in the source's order, so LMDB →
    Parquet → LMDB gives back the same database. Returns the record count.
    """
    reader = source_for(source)
    if not reader.present():
        raise DataError("neither an LMDB (a folder holding data.mdb) nor a Parquet dataset (a .parquet file, "
                        "a folder of them, or a URI)" if os.path.exists(source) else "no such LMDB or Parquet dataset",
                        source)
    target = SOURCES[reader.counterpart]
    refusal = target.output_refusal(out)
    if refusal:
        raise DataError(f"the source is a {reader.kind}, so {refusal}", out)
    if not is_uri(out):
        lmdb_io.refuse_existing(out, overwrite)  # before a long read
    total = reader.count()
    log.info(f"A total of {total} records: {source} -> {target.kind} {out}")
    in_order = True

    def records():
        nonlocal in_order
        previous = None
        for n, (key, value) in enumerate(reader.read(), 1):
            if key == previous:
                raise DataError(f"key {key.decode('utf-8', 'backslashreplace')!r} repeats, and an LMDB holds "
                                "one record per key; give every row its own key", source)
            in_order = in_order and (previous is None or key > previous)
            previous = key
            yield key, value
            if n % REPORT_EVERY == 0:
                log.info(f"Processed {n} of {total} records.")

    written = target.write(out, records(), overwrite=overwrite, source=source)
    if written % REPORT_EVERY:
        log.info(f"Processed {written} of {total} records.")
    if target.key_order and not in_order:
        stored = target(out).count()
        if stored < written:  # a repeat that was not next to its first: found only now
            lmdb_io.remove_path(out)
            raise DataError(f"{written - stored} of its keys repeat, and an LMDB holds one record per key; "
                            "give every row its own key", source)
        log.warning(f"the keys of {source} are not in increasing order; the LMDB holds the records in key order, "
                    "not the Parquet's")
    return written
