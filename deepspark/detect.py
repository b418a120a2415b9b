"""SSD detection on deepspark.Net: images in, DetectionOutput's rows out as boxes in pixels, scores and classes."""

from typing import NamedTuple

import numpy as np

from deepspark.errors import ConfigError
from deepspark.io import Transformer, load_image, resize_image
from deepspark.net import Net


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


AP_VERSIONS = ("11point", "MaxIntegral", "Integral")  # the fork's SolverParameter.ap_version, Integral its default


def average_precision(true_pos, false_pos, scores, positives, ap_version="Integral"):
    """The fork's ComputeAP for one class in its float arithmetic: detections best first (a stable sort),
    cumulative precision and recall over `positives` ground-truth boxes, then VOC2007's 11 recall points,
    VOC2012's MaxIntegral or the natural Integral of precision over recall; 0 without detections or boxes."""
    if ap_version not in AP_VERSIONS:
        raise ConfigError(f"unknown ap_version '{ap_version}'; the fork's: {', '.join(AP_VERSIONS)}")
    if not len(scores) or positives == 0:
        return np.float32(0)
    order = np.argsort(-np.asarray(scores, np.float32), kind="stable")
    tp, fp = (np.cumsum(np.asarray(x, int)[order]) for x in (true_pos, false_pos))
    f32, eps = np.float32, np.float32(1e-6)
    prec = (tp.astype(f32) / (tp + fp).astype(f32)).astype(f32)
    rec = (tp.astype(f32) / f32(positives)).astype(f32)
    ap = f32(0)
    if ap_version == "11point":
        best = np.zeros(11, f32)
        start = len(rec) - 1
        for j in range(10, -1, -1):
            for i in range(start, -1, -1):
                if rec[i] < j / 10.0:
                    start = i
                    if j > 0:
                        best[j - 1] = best[j]
                    break
                best[j] = max(best[j], prec[i])
        for j in range(10, -1, -1):
            ap = f32(ap + best[j] / f32(11))
    elif ap_version == "MaxIntegral":
        cur_rec, cur_prec = rec[-1], prec[-1]
        for i in range(len(rec) - 2, -1, -1):
            cur_prec = max(prec[i], cur_prec)
            if abs(f32(cur_rec - rec[i])) > eps:
                ap = f32(ap + cur_prec * abs(f32(cur_rec - rec[i])))
            cur_rec = rec[i]
        ap = f32(ap + cur_rec * cur_prec)
    else:
        previous = f32(0)
        for i in range(len(rec)):
            if abs(f32(rec[i] - previous)) > eps:
                ap = f32(ap + prec[i] * abs(f32(rec[i] - previous)))
            previous = rec[i]
    return ap


def mean_average_precision(results, ap_version="Integral"):
    """The mAP the fork's solver reports for a detection test net (eval_type "detection"), from its
    DetectionEvaluate tops over the test iterations (each 1 x 1 x R x 5): (mAP, {class: AP}). Rows [-1, class,
    positives, ...] add up each class's ground-truth boxes; a detection row that is neither true nor false
    positive (a difficult box's) is left out; a class with boxes and no detection scores no AP and still
    counts in the mean, as the fork's."""
    positives, found = {}, {}
    for rows in results:
        for item, label, score, tp, fp in np.asarray(rows, np.float32).reshape(-1, 5):
            if int(item) == -1:
                positives[int(label)] = positives.get(int(label), 0) + int(score)
            elif int(tp) or int(fp):
                found.setdefault(int(label), []).append((score, int(tp), int(fp)))
    aps = {label: average_precision([d[1] for d in found[label]], [d[2] for d in found[label]],
                                    [d[0] for d in found[label]], count, ap_version)
           for label, count in sorted(positives.items()) if label in found}
    total = np.float32(0)
    for ap in aps.values():
        total = np.float32(total + ap)
    return (float(total / np.float32(len(positives))) if positives else 0.0), {k: float(v) for k, v in aps.items()}
