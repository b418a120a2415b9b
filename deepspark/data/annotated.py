"""Annotated detection data: convert-annoset's AnnotatedDatum records and the AnnotatedData layer's batches (the SSD fork's convert_annoset, io.cpp and annotated_data_layer.cpp)."""

import logging
import os
import random
import re
import xml.etree.ElementTree as ElementTree

import numpy as np
from google.protobuf import text_format
from google.protobuf.message import DecodeError

from deepspark.data.convert import image_errors, read_image, read_list_text, write_images
from deepspark.data import parquet
from deepspark.data.datum import DataError, datum_to_array, decode_image, encode_image
from deepspark.data.lmdb_io import shard_range
from deepspark.data.resume import Resumable
from deepspark.data.sampler import (batch_samples, check_resize, check_sampler, clip, crop_pixels, projected, warp,
                                    warps)
from deepspark.data.sources import source_for
from deepspark.data.table import feeds
from deepspark.data.transform import ANNOTATED_EXTRAS, Transformer, _phase
from deepspark.data.feeder import _color
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

log = logging.getLogger(__name__)
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
            with image_errors(path, listfile, number):
                if detection:
                    record = annotated_datum(path, os.path.join(root, second), names, label_type, not gray, resize,
                                             min_dim, max_dim, encoding, previous)
                else:
                    datum, _ = _image_datum(path, not gray, resize, min_dim, max_dim, encoding, previous)
                    datum.label = second
                    record = pb.AnnotatedDatum(datum=datum)
            previous = record.datum
            yield f"{index:08d}_{filename}".encode(), record.SerializeToString()

    return write_images(out, records(), overwrite)


# ---------------------------------------------------------------------------
# The AnnotatedData layer's batches

def read_annotated(path, start=0, stop=None):
    """[(key, AnnotatedDatum)] of records [start, stop) of an LMDB of AnnotatedDatum; a corrupt one in one line."""
    records = []
    for key, value in source_for(path).read(start, stop):
        try:
            records.append((bytes(key), pb.AnnotatedDatum.FromString(bytes(value))))
        except DecodeError:
            raise DataError(f"record {bytes(key).decode('utf-8', 'backslashreplace')!r} is not an AnnotatedDatum "
                            "(convert-annoset writes them)", path) from None
    if not records:
        raise DataError("the dataset holds no records", path)
    return records


def box_count(record):
    """The boxes of one AnnotatedDatum."""
    return sum(len(group.annotation) for group in record.annotation_group)


def source_shape(layer_param, given=None):
    """What AnnotatedData's shape rule needs: {"image": (C, H, W) of the first record, "boxes": (the most boxes one
    record holds,) (the label top holds the batch's boxes, padded to the most a batch can hold), "records": (the
    record count,), "typed": (1,) when records carry an annotation type, else (0,) (then the label is the datum's,
    per image)}; with --data-shape `given`, one box per record."""
    if given is not None:
        return {"image": tuple(given), "boxes": (1,), "records": (0,), "typed": (1,)}
    path = layer_param.data_param.source
    records = read_annotated(path)
    key, first = records[0]
    color = _color(layer_param.transform_param)
    image = datum_to_array(first.datum, key, path, color).shape
    resize = resize_of(layer_param)
    image = image[:1] + resize if resize else image  # every image is warped to it (InferBlobShape's)
    return {"image": tuple(int(d) for d in image), "typed": (int(first.HasField("type")),),
            "boxes": (max(box_count(r) for _, r in records),), "records": (len(records),)}


def label_rows(boxes, batch):
    """G of the label top (1 x 1 x G x 8): the most boxes a batch can hold, at least 1. A shard smaller than the
    batch repeats its records in one batch (a Spark worker's may hold one), so it is batch x the most one holds."""
    return max(1, batch * boxes[0])


def record_rows(record):
    """[group, instance, xmin, ymin, xmax, ymax, difficult] rows of an AnnotatedDatum's boxes (float32
    coordinates), groups in the record's order."""
    f32 = np.float32
    return [[group.group_label, anno.instance_id, f32(anno.bbox.xmin), f32(anno.bbox.ymin), f32(anno.bbox.xmax),
             f32(anno.bbox.ymax), float(anno.bbox.difficult)]
            for group in record.annotation_group for anno in group.annotation]


def resize_of(layer_param):
    """(height, width) that transform_param.old_resize_param sizes every image to, or None."""
    tp = layer_param.transform_param
    return check_resize(tp.old_resize_param, f"layer {layer_param.name!r}") if tp.HasField("old_resize_param") \
        else None


# NoiseParameter's effects (jpeg: a quality, -1 for none); with none on, the fork's noise changes nothing.
NOISE_EFFECTS = ("hist_eq", "inverse", "decolorize", "gauss_blur", "jpeg", "posterize", "erode", "saltpepper",
                 "clahe", "convert_to_hsv", "convert_to_lab")
# What the bundled pycaffe (built without OpenCV) does with an image the fork would resize or noise through
# OpenCV: data_transformer.cpp's LOG(FATAL) for an encoded record, its size CHECKs for a raw one.
PYCAFFE_ABORTS = {True: "'Encoded datum requires OpenCV; compile with USE_OPENCV'",
                  False: "data_transformer.cpp's 'Check failed' on the record's size"}


def noise_effects(param):
    """The names of the NoiseParameter effects that are on (the fork's ApplyNoise does each, whatever its prob)."""
    return [name for name in NOISE_EFFECTS if getattr(param, name) not in (False, -1)]


def noise_refusal(where, effects):
    """The one line refusing noise_param on an encoded record."""
    return (f"{where}: transform_param.noise_param {effects[0]}: the fork noises encoded records through OpenCV, "
            f"and the bundled pycaffe, built without it, aborts on them ({PYCAFFE_ABORTS[True]}); remove it "
            "(raw records, which the fork never noises, keep it: convert-annoset without --encoded)")


def resize_refusal(where, param, size, encoded, sampled=False):
    """The one line refusing an old_resize_param other than WARP with LINEAR sampling (warps()) that would change
    a (height, width) `size` image (or batch_sampler's crops), or None where it leaves the image as it is, as in
    every build of the fork."""
    if warps(param) or (size == check_resize(param, where) and not sampled):
        return None
    what = (f"interp_mode {'/'.join(pb.OldResizeParameter.Interp_mode.Name(m) for m in param.interp_mode)}"
            if param.resize_mode == pb.OldResizeParameter.WARP
            else f"resize_mode {pb.OldResizeParameter.Resize_mode.Name(param.resize_mode)}")
    case = ("of batch_sampler's crops" if sampled
            else f"of a {size[0]}x{size[1]} {'encoded' if encoded else 'raw'} record to {param.height}x{param.width}")
    return (f"{where}: old_resize_param {what} {case} is not done here: the fork does it through OpenCV, and the "
            f"bundled pycaffe, built without it, aborts ({PYCAFFE_ABORTS[encoded]}); use WARP with LINEAR "
            "sampling, or the records' own size")


def refused_fields(layer_param):
    """A one-line refusal for what AnnotatedData would take but this feeder does not do, or None."""
    tp, where = layer_param.transform_param, f"layer {layer_param.name!r}"
    if layer_param.annotated_data_param.batch_sampler and not tp.HasField("old_resize_param"):
        return (f"{where}: batch_sampler's crops come in many sizes; add transform_param.old_resize_param "
                "{ height: H width: W } to warp them to one, as SSD's nets do")
    if layer_param.data_param.HasField("backend") and layer_param.data_param.backend != pb.DataParameter.LMDB:
        return f"{where}: AnnotatedData reads an LMDB; use backend: LMDB"
    return None


class AnnotatedFeeder(Resumable):
    """Batches {data: float32 NCHW, label: float32 1 x 1 x G x 8} for one AnnotatedData layer, records [start, stop)
    of its LMDB (shard `shard` of `num_shards`), looped in key order like Caffe's Data layer and transformed as
    the fork's AnnotatedData and DataTransformer do: with batch_sampler, each image cropped to one of its sampled
    boxes drawn at random (an encoded record's crop through JPEG, as the fork's CropImage), then warped by
    old_resize_param, then crop, mirror, mean, scale; boxes projected into each crop (those emit_constraint
    rejects dropped) and mirrored. The sampling has its own seeded RNG, kept in the feeder's state.

    The label holds the batch's rows [item, group, instance, xmin, ymin, xmax, ymax, difficult], as the fork's;
    a net here has fixed shapes, so they are followed by rows of -1 up to G, the most boxes a batch can hold
    (MultiBoxLoss and DetectionEvaluate skip item -1 rows as the fork does). Records without an annotation type
    give the datum's label per image instead."""

    def __init__(self, layer_param, phase=pb.TRAIN, shard=0, num_shards=1, seed=None, batch_size=None, mean=None):
        refusal = refused_fields(layer_param)
        if refusal:
            raise ConfigError(refusal)
        self.name, self.tops = layer_param.name, list(layer_param.top)
        if len(self.tops) not in (1, 2):
            raise ConfigError(f"layer {self.name!r}: an AnnotatedData layer has one or two tops (data, label)")
        self.path = layer_param.data_param.source
        self.batch_size = int(batch_size or layer_param.data_param.batch_size)
        if self.batch_size <= 0:
            raise ConfigError(f"layer {self.name!r}: data_param.batch_size must be positive")
        whole = source_shape(layer_param)
        start, stop = shard_range(whole["records"][0], shard, num_shards)
        if stop == start:
            raise DataError(f"shard {shard} of {num_shards} is empty: the LMDB holds {whole['records'][0]} records",
                            self.path)
        self.records = read_annotated(self.path, start, stop)
        self.size, self.typed = len(self.records), bool(whole["typed"][0])
        self.rows = label_rows(whole["boxes"], self.batch_size)
        self.color = _color(layer_param.transform_param)
        self.source_shape = whole["image"]
        tp = layer_param.transform_param
        self.resize, self.emit = resize_of(layer_param), tp.emit_constraint if tp.HasField("emit_constraint") else None
        self.samplers = list(layer_param.annotated_data_param.batch_sampler)
        for sampler in self.samplers:
            check_sampler(sampler.sampler, f"layer {self.name!r}")
        self._check_opencv_extras(tp)
        self.sample_rng = np.random.default_rng(None if seed is None else [seed, 43])  # not the transformer's draws
        plain = pb.TransformationParameter()
        plain.CopyFrom(tp)
        for field in ANNOTATED_EXTRAS:  # done here, before and after the transformer
            plain.ClearField(field)
        self.transformer = Transformer(plain, _phase(phase), mean=mean, seed=seed)
        self.transformer.check(self.source_shape)
        self.order_rng, self.shuffle = np.random.default_rng(seed), False  # Caffe's Data order: the keys'
        self._order, self._position, self.epoch = None, 0, 0

    def _check_opencv_extras(self, tp):
        """Refuse in one line the noise and the resize that the fork does through OpenCV (judged by the first
        record; later ones in _sampled), and warn that noise on raw records is not applied, as in the fork."""
        where, (key, first) = f"layer {self.name!r}", self.records[0]
        self.noise, self.resize_param = noise_effects(tp.noise_param), tp.old_resize_param
        if self.noise and first.datum.encoded:
            raise ConfigError(noise_refusal(where, self.noise))
        if self.noise:  # the fork's Transform of a raw Datum never calls ApplyNoise, with OpenCV or without
            log.warning(f"{where}: transform_param.noise_param {', '.join(self.noise)} is not applied: the fork "
                        "noises only encoded records, so raw records' batches are as without it (the bundled "
                        "pycaffe's too)")
        if self.resize:
            size = datum_to_array(first.datum, key, self.path, self.color).shape[1:]
            refusal = resize_refusal(where, tp.old_resize_param, size, first.datum.encoded, bool(self.samplers))
            if refusal:
                raise ConfigError(refusal)

    @property
    def shapes(self):
        out = {self.tops[0]: (self.batch_size,) + self.transformer.output_shape(self.source_shape)}
        if len(self.tops) > 1:
            out[self.tops[1]] = (1, 1, self.rows, 8) if self.typed else (self.batch_size,)
        return out

    def _next_records(self):
        records = []
        while len(records) < self.batch_size:
            records.append(self.records[self._position])
            self._position += 1
            if self._position == self.size:
                self._position, self.epoch = 0, self.epoch + 1
        return records

    def _state(self):
        meta, order = super()._state()
        return {**meta, "sample_rng": self.sample_rng.bit_generator.state}, order

    def _restore(self, meta, order):
        super()._restore(meta, order)
        self.sample_rng.bit_generator.state = meta["sample_rng"]

    def _sampled(self, key, record):
        """(CHW image, annotation rows) of one record after batch sampling (if any) and the resize (if any)."""
        if self.noise and record.datum.encoded:
            raise DataError(noise_refusal(f"layer {self.name!r}", self.noise), self.path)
        image, rows = datum_to_array(record.datum, key, self.path, self.color), record_rows(record)
        boxes = batch_samples(rows, self.samplers, self.sample_rng) if self.samplers else []
        if boxes:
            box = boxes[self.sample_rng.integers(len(boxes))]
            top, left, height, width = crop_pixels(box, *image.shape[1:])
            image = image[:, top:top + height, left:left + width]
            if record.datum.encoded:  # the fork's CropImage stores an encoded record's crop as a JPEG
                image = decode_image(encode_image(np.ascontiguousarray(image), "jpg"), self.color)
            rows = projected(rows, clip(box), emit=self.emit)
        if self.resize and image.shape[1:] != self.resize:
            refusal = resize_refusal(f"layer {self.name!r}", self.resize_param, image.shape[1:], record.datum.encoded)
            if refusal:
                raise DataError(refusal, self.path)
            image = warp(image, *self.resize)
        return image, rows

    def _pixels(self, records):
        pixels = np.empty((len(records),) + self.source_shape, np.uint8)
        annotations = []
        for i, (key, record) in enumerate(records):
            image, rows = self._sampled(key, record)
            if image.shape != self.source_shape:
                raise DataError(f"record {key.decode('utf-8', 'backslashreplace')!r} is "
                                f"{'x'.join(map(str, image.shape))}, the first is "
                                f"{'x'.join(map(str, self.source_shape))}: a net's images are one size "
                                "(convert-annoset --resize-height/--resize-width, or transform_param.old_resize_param)",
                                self.path)
            pixels[i] = image
            annotations.append(rows)
        return pixels, annotations

    def next_batch(self):
        records = self._next_records()
        pixels, annotations = self._pixels(records)
        h_off, w_off, mirror = offsets = self.transformer.offsets(len(records), self.source_shape)
        batch = {self.tops[0]: self.transformer.apply(pixels, offsets=offsets)}
        if len(self.tops) > 1:
            batch[self.tops[1]] = self._labels(records, annotations, h_off, w_off, mirror)
        return batch

    def _labels(self, records, annotations, h_off, w_off, mirror):
        if not self.typed:
            return np.array([record.datum.label for _, record in records], np.float32)
        _, height, width = self.source_shape
        _, out_h, out_w = self.transformer.output_shape(self.source_shape)
        f32 = np.float32
        rows = []
        for item, annotation in enumerate(annotations):
            crop = (f32(w_off[item]) / f32(width), f32(h_off[item]) / f32(height),
                    f32(w_off[item] + out_w) / f32(width), f32(h_off[item] + out_h) / f32(height))
            rows += [[item, *row] for row in projected(annotation, crop, bool(mirror[item]), self.emit)]
        label = np.full((1, 1, self.rows, 8), -1, np.float32)
        if rows:
            label[0, 0, :len(rows)] = rows
        return label


def check_source(layer_param):
    """A one-line error unless the layer's LMDB is there and its first record is an AnnotatedDatum."""
    path = layer_param.data_param.source
    if not os.path.isdir(path):
        raise ConfigError(f"layer {layer_param.name!r}: source {path!r} is not an LMDB folder "
                          "(deepspark convert-annoset makes one)")
    read_annotated(path, 0, 1)


# `listed`: on Spark each executor reads its own share of the LMDB's records (AnnotatedDatum, not the Datum
# records the driver shards for a Data layer).
feeds("AnnotatedData", make=lambda layer_param, phase, where, options: AnnotatedFeeder(
          layer_param, phase, mean=options.get("mean"), **where),
      param="data_param", listed=check_source, shape=source_shape)
