"""The SSD fork's annotated-image geometry for AnnotatedData: sampled crops (sampler.cpp), box projection and emit constraints (bbox_util.cpp), the WARP resize.

A box is (xmin, ymin, xmax, ymax) of np.float32, relative to its image, and an
annotation a row [group, instance, xmin, ymin, xmax, ymax, difficult]; the
arithmetic is the fork's, in float32.
"""

import numpy as np

from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

f32 = np.float32
UNIT = (f32(0), f32(0), f32(1), f32(1))


def box_size(box):
    """BBoxSize of a normalised box: width x height, 0 for an inverted one."""
    if box[2] < box[0] or box[3] < box[1]:
        return f32(0)
    return f32(f32(box[2] - box[0]) * f32(box[3] - box[1]))


def intersection(a, b):
    """IntersectBBox: the common box, all zeros where they do not meet."""
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return (f32(0),) * 4
    return (max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))


def jaccard(a, b):
    """JaccardOverlap: intersection over union."""
    common = intersection(a, b)
    width, height = f32(common[2] - common[0]), f32(common[3] - common[1])
    if width > 0 and height > 0:
        inter = f32(width * height)
        return f32(inter / f32(f32(box_size(a) + box_size(b)) - inter))
    return f32(0)


def coverage(a, b):
    """BBoxCoverage(a, b): the share of a that b covers."""
    inter = box_size(intersection(a, b))
    return f32(inter / box_size(a)) if inter > 0 else f32(0)


def clip(box):
    """ClipBBox: each coordinate into [0, 1]."""
    return tuple(min(max(f32(v), f32(0)), f32(1)) for v in box)


def satisfies(box, objects, constraint):
    """SatisfySampleConstraint: true without constraints, else where some object box meets every bound given
    (jaccard overlap, the share of the sample it covers, the share of it the sample covers)."""
    tests = [(jaccard, "jaccard_overlap", False), (coverage, "sample_coverage", False),
             (coverage, "object_coverage", True)]
    tests = [test for test in tests if constraint.HasField("min_" + test[1]) or constraint.HasField("max_" + test[1])]
    if not tests:
        return True
    found = False
    for obj in objects:
        for measure, name, swapped in tests:
            value = measure(obj, box) if swapped else measure(box, obj)
            if (constraint.HasField("min_" + name) and value < f32(getattr(constraint, "min_" + name))) or \
                    (constraint.HasField("max_" + name) and value > f32(getattr(constraint, "max_" + name))):
                break  # the fork's `continue` to the next object, leaving `found` as an earlier test set it
            found = True
    return found


def check_sampler(sampler, where):
    """A one-line ConfigError for the bounds SampleBBox CHECKs (and the aspect-ratio ranges whose uniform draw
    it would abort on for some scale), else None."""
    low, high, ar_low, ar_high = (sampler.min_scale, sampler.max_scale, sampler.min_aspect_ratio,
                                  sampler.max_aspect_ratio)
    if not 0 < low <= high <= 1:
        raise ConfigError(f"{where}: sampler scales need 0 < min_scale <= max_scale <= 1, got {low:g}, {high:g}")
    if not 0 < ar_low <= ar_high:
        raise ConfigError(f"{where}: sampler aspect ratios need 0 < min_aspect_ratio <= max_aspect_ratio, "
                          f"got {ar_low:g}, {ar_high:g}")
    if high * high * ar_low > 1 or high * high > ar_high:
        raise ConfigError(f"{where}: a scale up to {high:g} leaves no aspect ratio in [{ar_low:g}, {ar_high:g}] "
                          "(the fork's SampleBBox aborts): lower max_scale or widen the aspect ratios")


def sample_box(sampler, rng):
    """SampleBBox: a scale, then an aspect ratio within the sampler's and [scale^2, 1/scale^2], then a place."""
    scale = f32(rng.uniform(sampler.min_scale, sampler.max_scale))
    ar_low = max(f32(sampler.min_aspect_ratio), f32(float(scale) ** 2))
    ar_high = min(f32(sampler.max_aspect_ratio), f32(1 / float(scale) ** 2))
    root = f32(np.sqrt(f32(rng.uniform(ar_low, ar_high))))
    width, height = f32(scale * root), f32(scale / root)
    x0 = f32(rng.uniform(0, max(f32(1 - width), f32(0))))
    y0 = f32(rng.uniform(0, max(f32(1 - height), f32(0))))
    return (x0, y0, f32(x0 + width), f32(y0 + height))


def batch_samples(rows, samplers, rng):
    """GenerateBatchSamples: every sampler (those with use_original_image; the fork does nothing with the others)
    draws up to max_trials boxes, keeping those that satisfy its constraint, at most max_sample of them."""
    objects = [tuple(f32(v) for v in row[2:6]) for row in rows]
    found = []
    for sampler in samplers:
        if not sampler.use_original_image:
            continue
        kept = 0
        for _ in range(sampler.max_trials):
            if sampler.HasField("max_sample") and kept >= sampler.max_sample:
                break
            box = sample_box(sampler.sampler, rng)  # LocateBBox in the unit box leaves it as it is
            if satisfies(box, objects, sampler.sample_constraint):
                kept += 1
                found.append(box)
    return found


def emitted(crop, box, emit):
    """MeetEmitConstraint: CENTER keeps a box whose centre lies in the crop (edges included), MIN_OVERLAP one
    the crop covers by more than emit_overlap."""
    if emit.emit_type == pb.EmitConstraint.CENTER:
        x, y = f32((box[0] + box[2]) / f32(2)), f32((box[1] + box[3]) / f32(2))
        return bool(crop[0] <= x <= crop[2] and crop[1] <= y <= crop[3])
    return bool(coverage(box, crop) > f32(emit.emit_overlap))


def projected(rows, crop, mirror=False, emit=None):
    """TransformAnnotation: the rows whose box meets the emit constraint (if any) and overlaps the crop box,
    projected into it, clipped to [0, 1], empty ones dropped, then mirrored."""
    x0, y0, x1, y1 = crop
    width, height = f32(x1 - x0), f32(y1 - y0)
    out = []
    for group, instance, bx0, by0, bx1, by1, difficult in rows:
        if emit is not None and not emitted(crop, (bx0, by0, bx1, by1), emit):
            continue
        if bx0 >= x1 or bx1 <= x0 or by0 >= y1 or by1 <= y0:
            continue
        box = clip(((bx0 - x0) / width, (by0 - y0) / height, (bx1 - x0) / width, (by1 - y0) / height))
        if not box_size(box) > 0:
            continue
        if mirror:
            box = (f32(1) - box[2], box[1], f32(1) - box[0], box[3])
        out.append([group, instance, *box, difficult])
    return out


def crop_pixels(box, height, width):
    """CropImage's pixel window of a sampled box: (top, left, rows, columns), truncated as the fork's ints (and
    at least one pixel each way, where the fork would make an empty image)."""
    x0, y0, x1, y1 = (f32(v * f32(side)) for v, side in zip(clip(box), (width, height, width, height)))
    return min(int(y0), height - 1), min(int(x0), width - 1), max(1, int(f32(y1 - y0))), max(1, int(f32(x1 - x0)))


def check_resize(param, where):
    """(height, width) old_resize_param sizes every image to (InferBlobShape's); a one-line ConfigError where one
    is missing."""
    if not param.height or not param.width:
        raise ConfigError(f"{where}: old_resize_param {pb.OldResizeParameter.Resize_mode.Name(param.resize_mode)} "
                          "needs height and width")
    return int(param.height), int(param.width)


def warps(param):
    """Whether old_resize_param's resize is the one done here (warp()): WARP with LINEAR sampling, the fork's
    defaults."""
    return param.resize_mode == pb.OldResizeParameter.WARP and all(
        mode == pb.OldResizeParameter.LINEAR for mode in param.interp_mode)


def _linear(n_in, n_out):
    """OpenCV INTER_LINEAR's source of each output pixel: (index, next index, weight of the next), pixel
    centres aligned ((o + 0.5) n_in / n_out - 0.5), indices clamped to the edge."""
    x = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
    low = np.floor(x)
    weight = np.where(x < 0, 0.0, x - low)
    low = np.clip(low, 0, n_in - 1).astype(np.int64)
    return low, np.minimum(low + 1, n_in - 1), weight


def warp(image, height, width):
    """cv::resize of a uint8 CHW image to height x width with INTER_LINEAR's sampling, rounded to uint8 (OpenCV
    rounds its weights to 11 bits, so a pixel may differ from its by one level)."""
    if image.shape[1:] == (height, width):
        return image
    rows, next_rows, wy = _linear(image.shape[1], height)
    cols, next_cols, wx = _linear(image.shape[2], width)
    pixels = image.astype(np.float64)
    across = pixels[:, :, cols] * (1 - wx) + pixels[:, :, next_cols] * wx
    out = across[:, rows] * (1 - wy)[:, None] + across[:, next_rows] * wy[:, None]
    return np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8)  # OpenCV's fixed point rounds a half up
