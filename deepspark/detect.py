"""SSD detection on deepspark.Net: images in, DetectionOutput's rows out as boxes in pixels, scores and classes."""

from typing import NamedTuple

import numpy as np

from deepspark.config import set_fields
from deepspark.detection_eval import AP_VERSIONS, average_precision, mean_average_precision  # noqa: F401 (moved there)
from deepspark.errors import ConfigError
from deepspark.io import Transformer, load_image, resize_image
from deepspark.net import Net
from deepspark.proto import deepspark_pb2 as pb


class Detections(NamedTuple):
    """One image's detections, best first within a class as DetectionOutput orders them: boxes (K x 4
    xmin, ymin, xmax, ymax in pixels, float), scores (K) and classes (K, int)."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray


def detections(rows, width, height, images=None):
    """A DetectionOutput top (1 x 1 x K x 7 rows [item, label, score, xmin, ymin, xmax, ymax], coordinates
    relative to the image) as one Detections per image: the coordinates times the image's width and height
    (a number, or one per image), not clipped (Caffe's boxes may cross the border). Caffe's row of -1s for a
    batch without any detection gives none. images: how many items the batch had (default: the highest item in
    the rows, plus one)."""
    rows = np.asarray(rows, np.float32).reshape(-1, 7)
    rows = rows[rows[:, 1] >= 0]
    items = rows[:, 0].astype(int)
    count = int(items.max()) + 1 if images is None and len(rows) else (images or 0)
    widths, heights = (np.broadcast_to(np.asarray(size, np.float32), (count,)) for size in (width, height))
    found = []
    for item in range(count):
        mine = rows[items == item]
        scale = np.array([widths[item], heights[item], widths[item], heights[item]], np.float32)
        found.append(Detections(mine[:, 3:7] * scale, mine[:, 2].copy(), mine[:, 1].astype(int)))
    return found


def read_image(path):
    """load_image's HxWx3 RGB image in [0, 1], or a ConfigError naming the file that cannot be read as one."""
    try:
        return load_image(path)
    except OSError as error:  # a missing file, or one Pillow cannot identify
        raise ConfigError(f"cannot read the image ({error.strerror or error})", path) from None


def detector(model_file, pretrained_file=None, backend="tensorflow", **options):
    """A Detector preparing each image as DetectParameter's fields by name (`options`) say; a mean given both
    ways is refused in one line, as Caffe's DataTransformer refuses it."""
    param = set_fields(pb.DetectParameter(), options, "the detect options")
    if param.mean_value and param.mean_file:
        raise ConfigError("give mean_value or mean_file, not both", "the detect options")
    return Detector(model_file, pretrained_file, mean=list(param.mean_value) or param.mean_file or None,
                    input_scale=param.input_scale if param.HasField("input_scale") else None,
                    raw_scale=param.raw_scale, channel_swap=list(param.channel_swap) or [2, 1, 0], backend=backend)


class Detector(Net):
    """A Net with a DetectionOutput layer that detects in HxWxK images (load_image's), as SSD's examples do:
    each image is resized to the net's input HxW and preprocessed by a deepspark.io.Transformer (transpose
    (2, 0, 1), then the given mean (per-channel values, an array or a .binaryproto path), input_scale,
    raw_scale and channel_swap, as Classifier's); detect returns one Detections per image, its boxes in the
    image's own pixels."""

    def __init__(self, model_file, pretrained_file=None, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, backend="tensorflow"):
        super().__init__(model_file, weights=pretrained_file, phase="test", backend=backend)
        tops = [top for layer in self._graph.layers if layer.type == "DetectionOutput" for top in layer.tops]
        if not tops:
            raise ConfigError("the net has no DetectionOutput layer to read detections from", model_file)
        self.detection_top = tops[-1]
        in_ = self.inputs[0]
        self.transformer = Transformer({in_: self.blobs[in_].data.shape})
        self.transformer.set_transpose(in_, (2, 0, 1))
        for setter, value in ((self.transformer.set_mean, mean), (self.transformer.set_input_scale, input_scale),
                              (self.transformer.set_raw_scale, raw_scale),
                              (self.transformer.set_channel_swap, channel_swap)):
            if value is not None:
                try:
                    setter(in_, value)
                except ValueError as error:  # a mean or channel swap that does not fit the input
                    raise ConfigError(str(error), model_file) from None

    def detect(self, images):
        """One Detections per HxWxK image, the net's batch at a time (the last padded, as forward_all)."""
        in_ = self.inputs[0]
        size = self.blobs[in_].data.shape[2:]
        batch = self.blobs[in_].data.shape[0]
        found = []
        for start in range(0, len(images), batch):
            chunk = images[start:start + batch]
            caffe_in = np.zeros((batch,) + self.blobs[in_].data.shape[1:], np.float32)
            for ix, image in enumerate(chunk):
                caffe_in[ix] = self.transformer.preprocess(in_, resize_image(image, size))
            rows = self.forward(**{in_: caffe_in})[self.detection_top]
            found += detections(rows, [image.shape[1] for image in chunk], [image.shape[0] for image in chunk],
                                images=len(chunk))
        return found
