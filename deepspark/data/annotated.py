"""Annotated detection data: convert-annoset's AnnotatedDatum records (the SSD fork's convert_annoset and io.cpp)."""

import os
import random
import re
import xml.etree.ElementTree as ElementTree

import numpy as np
from google.protobuf import text_format

from deepspark.data.convert import log, read_image, read_list_text
from deepspark.data.datum import DataError, encode_image
from deepspark.data import parquet
from deepspark.data.sources import write_records
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

ENCODINGS = ("png", "jpg", "jpeg")
# boost's ptree get<int>(path, default) answers the default when the text is not one whole integer.
_INT = re.compile(r"\s*[+-]?\d+\s*")


def read_label_map(path, check_label=False):
    """{name: label} of a LabelMap text proto (the fork's MapNameToLabel; check_label refuses repeated names)."""
    text = read_list_text(path, "label map file")
    label_map = pb.LabelMap()
    try:
        text_format.Parse(text, label_map)
    except text_format.ParseError as e:
        raise ConfigError(f"not a LabelMap text proto ({e})", path) from None
    names = {}
    for item in label_map.item:
        if check_label and item.name in names:
            raise ConfigError(f"there are many duplicates of name: {item.name} (--check-label)", path)
        names[item.name] = item.label
    return names


def read_annoset_list(listfile, detection=True):
    """[(image, annotation-or-label, line)] of a list file of whitespace-separated pairs, as the fork reads it."""
    tokens = [(token, number) for number, line in enumerate(read_list_text(listfile).splitlines(), 1)
              for token in line.split()]
    pairs = []
    for i in range(0, len(tokens) - 1, 2):
        (image, number), (second, _) = tokens[i], tokens[i + 1]
        if not detection:
            if not re.fullmatch(r"[+-]?\d+", second):
                raise ConfigError(f"expected 'IMAGE LABEL', got {image} {second!r}", listfile, number)
            second = int(second)
        pairs.append((image, second, number))
    if len(tokens) % 2:
        raise ConfigError(f"{tokens[-1][0]!r} has no annotation file after it", listfile, tokens[-1][1])
    if not pairs:
        raise DataError("the list file names no images", listfile)
    return pairs


def _group_for(anno_datum, label):
    """A new Annotation in label's group (made if absent), its instance_id the group's next."""
    for group in anno_datum.annotation_group:
        if group.group_label == label:
            instance_id = group.annotation[-1].instance_id + 1 if group.annotation else 0
            break
    else:
        group = anno_datum.annotation_group.add(group_label=label)
        instance_id = 0
    return group.annotation.add(instance_id=instance_id)


def _set_box(anno, xmin, ymin, xmax, ymax, width, height, difficult, labelfile):
    """The box normalised by the image's size in float32 arithmetic, as the fork stores it."""
    if not (0 <= xmin <= xmax <= width and 0 <= ymin <= ymax <= height):
        log.warning(f"{labelfile}: bounding box ({xmin}, {ymin}, {xmax}, {ymax}) exceeds the image "
                    f"({width}x{height}) or is irregular")
    w, h = np.float32(width), np.float32(height)
    anno.bbox.xmin, anno.bbox.ymin = float(np.float32(xmin) / w), float(np.float32(ymin) / h)
    anno.bbox.xmax, anno.bbox.ymax = float(np.float32(xmax) / w), float(np.float32(ymax) / h)
    anno.bbox.difficult = difficult


def _xml_size(root, img_height, img_width, labelfile):
    """(height, width) from annotation.size, else the image's own (the fork warns and does the same)."""
    height, width = (root.findtext(f"size/{axis}") for axis in ("height", "width"))
    if height is None or width is None or not (_INT.fullmatch(height) and _INT.fullmatch(width)):
        log.warning(f"{labelfile}: no annotation.size; using the image's {img_width}x{img_height}")
        height, width = img_height, img_width
    height, width = int(height), int(width)
    if (height, width) != (img_height, img_width):
        log.warning(f"{labelfile}: inconsistent image size ({width}x{height} against {img_width}x{img_height})")
    if not width or not height:
        raise DataError("no valid image width/height", labelfile)
    return height, width


def read_xml_annotations(labelfile, img_height, img_width, names, anno_datum):
    """A VOC XML file's objects into anno_datum's groups (the fork's ReadXMLToAnnotatedDatum)."""
    try:
        root = ElementTree.parse(labelfile).getroot()
    except (OSError, ElementTree.ParseError) as e:
        raise DataError(f"cannot read the annotation XML ({e})", labelfile) from None
    height, width = _xml_size(root, img_height, img_width, labelfile)
    for obj in root.findall("object"):
        anno, difficult = None, False
        for field in obj:  # in document order: a bndbox before its name belongs to no object, as in the fork
            if field.tag == "name":
                name = field.text or ""
                if name not in names:
                    raise DataError(f"unknown name: {name} (not in the label map)", labelfile)
                anno = _group_for(anno_datum, names[name])
            elif field.tag == "difficult":
                difficult = (field.text or "") == "1"
            elif field.tag == "bndbox":
                if anno is None:
                    raise DataError("an object's bndbox comes before its name", labelfile)
                xmin, ymin, xmax, ymax = (int(v) if v is not None and _INT.fullmatch(v) else 0
                                          for v in (field.findtext(k) for k in ("xmin", "ymin", "xmax", "ymax")))
                _set_box(anno, xmin, ymin, xmax, ymax, width, height, difficult, labelfile)


def read_txt_annotations(labelfile, height, width, anno_datum):
    """`label xmin ymin xmax ymax` rows (pixels) into anno_datum's groups (the fork's ReadTxtToAnnotatedDatum)."""
    tokens = read_list_text(labelfile, "annotation file").split()
    for i in range(0, len(tokens) - 4, 5):
        row = tokens[i:i + 5]
        try:  # the fork's stream stops at the first row it cannot read
            label, coords = int(row[0]), [np.float32(v) for v in row[1:]]
        except ValueError:
            break
        _set_box(_group_for(anno_datum, label), *coords, width, height, False, labelfile)


def _resize_to(shape, resize, min_dim, max_dim):
    """(height, width) the image is resized to, or None (the fork's ReadImageToCVMat: min/max_dim keep aspect)."""
    rows, cols = shape
    if min_dim or max_dim:
        scale = np.float32(1)
        if min_dim and min(rows, cols) < min_dim:
            scale = np.float32(min_dim) / np.float32(min(rows, cols))
        if max_dim and int(scale * np.float32(max(rows, cols))) > max_dim:
            scale = np.float32(max_dim) / np.float32(max(rows, cols))
        return None if scale == 1 else (round(rows * float(scale)), round(cols * float(scale)))
    return resize


def _image_datum(path, color, resize, min_dim, max_dim, encoding, previous):
    """(the fork's Datum of the image, its original (height, width)): label -1, raw BGR CHW or encoded bytes.

    `previous` is the last record's Datum: the fork reuses one Datum, so a file stored as it is keeps the
    last record's channels, height and width, and we write the same bytes."""
    raw, own_color, array = read_image(path, color)
    size = array.shape[1:]
    target = _resize_to(size, resize, min_dim, max_dim)
    if target:
        _, _, array = read_image(path, color, target)
    datum = pb.Datum(channels=previous.channels, height=previous.height, width=previous.width) \
        if previous.HasField("channels") else pb.Datum()
    if not encoding:
        datum = pb.Datum(channels=array.shape[0], height=array.shape[1], width=array.shape[2],
                         data=array.tobytes(), label=-1)
        datum.encoded = False  # CVMatToDatum sets it, so the fork's record holds the field
        return datum, size
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if own_color == color and not (resize or min_dim or max_dim) and (ext, encoding) in (
            (encoding, encoding), ("jpeg", "jpg")):
        datum.data = raw  # ReadFileToDatum: the file's own bytes
    else:
        datum = pb.Datum(channels=array.shape[0], height=array.shape[1], width=array.shape[2],
                         data=encode_image(array, encoding))
    datum.label, datum.encoded = -1, True
    return datum, size


def annotated_datum(image, labelfile, names, label_type="xml", color=True, resize=None, min_dim=0, max_dim=0,
                    encoding="", previous=None):
    """The fork's ReadRichImageToAnnotatedDatum: an AnnotatedDatum (type BBOX) of an image and its annotation
    file (VOC XML, or `label xmin ymin xmax ymax` txt rows); a missing annotation file gives no boxes."""
    datum, (height, width) = _image_datum(image, color, resize, min_dim, max_dim, encoding,
                                          previous or pb.Datum())
    record = pb.AnnotatedDatum(datum=datum)
    if os.path.exists(labelfile):
        if label_type == "xml":
            read_xml_annotations(labelfile, height, width, names, record)
        else:
            read_txt_annotations(labelfile, height, width, record)
    record.type = pb.AnnotatedDatum.BBOX
    return record


def _encoding_for(filename, encoded, encode_type, listfile, number):
    """The encoding of one image: --encode-type, else (--encoded) its extension, else '' (raw pixels).

    The fork's guess keeps the dot ('.png'), so it never matches the extension and always re-encodes."""
    if encode_type or not encoded:
        return encode_type
    ext = os.path.splitext(filename)[1].lower().lstrip(".")
    if ext not in ENCODINGS:
        raise ConfigError(f"cannot guess the encoding of {filename!r}; give --encode-type png|jpg",
                          listfile, number)
    return "." + ext


def _check_options(resize_height, resize_width, min_dim, max_dim, encode_type, anno_type, label_type):
    """The converter's options refused in one line each; returns the encode type normalised."""
    if bool(resize_height) != bool(resize_width):
        raise ConfigError("give both --resize-height and --resize-width, or neither")
    if min(resize_height, resize_width, min_dim, max_dim) < 0:
        raise ConfigError("--resize-height, --resize-width, --min-dim and --max-dim must not be negative")
    encode_type = (encode_type or "").lower().lstrip(".")
    if encode_type and encode_type not in ENCODINGS:
        raise ConfigError(f"unknown --encode-type {encode_type!r} (png or jpg)")
    if anno_type not in ("detection", "classification"):
        raise ConfigError(f"unknown --anno-type {anno_type!r} (detection or classification)")
    if label_type not in ("xml", "txt"):
        raise ConfigError(f"--label-type {label_type!r} is not supported (xml or txt; the fork's json is not)")
    return encode_type


def convert_annoset(root, listfile, out, label_map_file="", anno_type="detection", label_type="xml", gray=False,
                    shuffle=False, resize_height=0, resize_width=0, min_dim=0, max_dim=0, encoded=False,
                    encode_type="", check_label=False, seed=None, overwrite=False):
    """Images and their annotations listed in `IMAGE ANNOTATION` lines → an LMDB of AnnotatedDatum,
    keys %08d_IMAGE, as the SSD fork's convert_annoset writes them; returns the count."""
    encode_type = _check_options(resize_height, resize_width, min_dim, max_dim, encode_type, anno_type, label_type)
    if parquet.writes_parquet(out):  # its rows hold a Datum and its label, not an AnnotatedDatum
        raise ConfigError("convert-annoset writes an LMDB of AnnotatedDatum; give an OUT not ending in .parquet")
    detection = anno_type == "detection"
    if detection and not label_map_file and label_type == "xml":
        raise ConfigError("--anno-type detection with XML annotations needs --label-map-file")
    names = read_label_map(label_map_file, check_label) if label_map_file else {}
    entries = read_annoset_list(listfile, detection)
    if shuffle:
        log.info("Shuffling data")
        random.Random(seed).shuffle(entries)
    log.info(f"A total of {len(entries)} images.")
    resize = (resize_height, resize_width) if resize_height else None

    def records():
        previous = pb.Datum()
        for index, (filename, second, number) in enumerate(entries):
            encoding = _encoding_for(filename, encoded, encode_type, listfile, number)
            path = os.path.join(root, filename)
            try:
                if detection:
                    record = annotated_datum(path, os.path.join(root, second), names, label_type, not gray, resize,
                                             min_dim, max_dim, encoding, previous)
                else:
                    datum, _ = _image_datum(path, not gray, resize, min_dim, max_dim, encoding, previous)
                    datum.label = second
                    record = pb.AnnotatedDatum(datum=datum)
            except OSError as e:
                raise ConfigError(f"cannot read image {path} ({e.strerror or e})", listfile, number) from None
            except (ValueError, SyntaxError) as e:
                raise ConfigError(f"cannot decode image {path} ({e})", listfile, number) from None
            previous = record.datum
            yield f"{index:08d}_{filename}".encode(), record.SerializeToString()
            if (index + 1) % 1000 == 0:
                log.info(f"Processed {index + 1} files.")

    written = write_records(out, records(), overwrite=overwrite)
    if written % 1000:
        log.info(f"Processed {written} files.")
    return written
