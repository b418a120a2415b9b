"""The fork's detection layers in TensorFlow: Permute, Normalize, PriorBox, DetectionOutput, MultiBoxLoss,
DetectionEvaluate, Proposal.

Each follows brocolli-caffe 9.0.2's layer (permute_layer.cpp, normalize_layer.cpp, prior_box_layer.cpp,
detection_output_layer.cpp with util/bbox_util.cpp, proposal_layer.cpp with util/nms.cpp) down to its float and
double arithmetic, so that the boxes and the non-maximum suppression's decisions are Caffe's. DetectionOutput
and Proposal are TensorFlow ops only (no numpy bridge), so that a SavedModel of an SSD or Faster R-CNN net runs
them in plain TensorFlow.
"""

import math

import numpy as np

from deepspark.backends.tensorflow.layers.loss import items, loss_normalizer
from deepspark.backends.tensorflow.layers.table import layer
from deepspark.backends.tensorflow.layout import Blob
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import aspect_ratios, legacy, permute_order, prior_image_size, prior_step, proposal_anchors
from deepspark.proto import deepspark_pb2 as pb

CODE = pb.PriorBoxParameter


@layer("Permute")
def permute(layer, bottoms, params, ctx):
    """Caffe's axes in the given order; from an NHWC blob the transpose reads each Caffe axis where it sits
    (order 0, 2, 3, 1, SSD's, is then no move at all)."""
    blob = bottoms[0]
    order = permute_order(layer.param.permute_param, blob.rank)
    moves = [blob.axis(axis) for axis in order]
    return [Blob(blob.tensor if moves == list(range(blob.rank)) else tf.transpose(blob.tensor, moves))]


@layer("Normalize")
def normalize(layer, bottoms, params, ctx):
    """x / sqrt(sum of squares + eps) over each item (across_spatial) or each position's channels, times the
    scale (one value, or one per channel). Caffe's Backward is the gradient of this, the scale's diff included."""
    param, blob = layer.param.norm_param, bottoms[0]
    x = blob.tensor
    channel = blob.axis(1)
    axes = list(range(1, blob.rank)) if param.across_spatial else [channel]
    norm = tf.sqrt(tf.reduce_sum(tf.square(x), axes, keepdims=True) + param.eps)
    y = x * (1.0 / norm) if param.across_spatial else x / norm  # Caffe scales by the inverse, or divides
    scale = params[0]
    if not param.channel_shared:
        shape = [1] * blob.rank
        shape[channel] = -1
        scale = tf.reshape(scale, shape)
    return [blob.like(y * scale)]


def prior_boxes(param, feature, image):
    """PriorBox's top (1 x 2 x H*W*priors*4) for a feature map of `feature` (height, width) and an image of
    `image` (height, width), in Caffe's arithmetic: centres in float, corners in double then stored as float,
    min_size and max_size truncated to integers as this fork's Forward_cpu does."""
    height, width = feature
    img_h, img_w = prior_image_size(param) or image
    step = prior_step(param)
    f32 = np.float32
    step_h, step_w = (f32(step[0]), f32(step[1])) if step else (f32(img_h) / f32(height), f32(img_w) / f32(width))
    offset = f32(param.offset)
    sizes = []  # (box width, box height) of each prior at a position, in Caffe's order, as floats
    for s, low in enumerate(param.min_size):
        low = int(low)
        sizes.append((f32(low), f32(low)))
        if param.max_size:
            side = f32(np.sqrt(np.float64(low * int(param.max_size[s]))))
            sizes.append((side, side))
        for ratio in aspect_ratios(param):
            if abs(float(ratio) - 1.0) < 1e-6:
                continue
            root = np.sqrt(ratio)  # sqrt of a float is float in C++: the products too
            sizes.append((f32(low) * root, f32(low) / root))
    box = np.array(sizes, np.float64)  # P x 2
    cx = ((np.arange(width, dtype=f32) + offset) * step_w).astype(np.float64)
    cy = ((np.arange(height, dtype=f32) + offset) * step_h).astype(np.float64)
    cy, cx = np.meshgrid(cy, cx, indexing="ij")  # H x W
    cx, cy = cx[:, :, None], cy[:, :, None]
    half_w, half_h = box[:, 0] / 2.0, box[:, 1] / 2.0
    corners = np.stack([(cx - half_w) / img_w, (cy - half_h) / img_h, (cx + half_w) / img_w,
                        (cy + half_h) / img_h], axis=-1).astype(f32).reshape(-1)
    if param.clip:
        corners = np.minimum(np.maximum(corners, f32(0)), f32(1))
    variance = list(param.variance) or [0.1]
    variances = np.resize(np.array(variance, f32), corners.size)
    return np.stack([corners, variances])[None]


@layer("PriorBox")
def prior_box(layer, bottoms, params, ctx):
    """A constant: the boxes depend on the bottoms' shapes alone, so neither bottom takes a diff (Caffe's
    Backward does nothing)."""
    feature = layer.bottom_shapes[0]
    image = layer.bottom_shapes[1] if len(layer.bottom_shapes) > 1 else None
    size = (legacy(image, 2), legacy(image, 3)) if image is not None else None
    value = prior_boxes(layer.param.prior_box_param, (legacy(feature, 2), legacy(feature, 3)), size)
    return [Blob(tf.constant(value))]


def _corners(xmin, ymin, xmax, ymax):
    """Corners stacked on the last axis, each rounded to float as Caffe stores a NormalizedBBox's fields."""
    return tf.cast(tf.stack([xmin, ymin, xmax, ymax], axis=-1), tf.float32)


def _f64(x):
    return tf.cast(x, tf.float64)


def _times(*factors):
    """A float product, left to right, each step rounded to float as Caffe's. Each step goes through double
    (exact for two floats) and back: Grappler's MinimizeBroadcasts reorders a chain of float products or sums
    whose operands broadcast (v * dx * width into v * width * dx), which changes the last bit; a cast ends
    the chain."""
    product = factors[0]
    for factor in factors[1:]:
        product = tf.cast(_f64(product) * _f64(factor), tf.float32)
    return product


def _plus(a, b):
    """A float sum rounded as Caffe's, through double as _times, so that no chain of sums is reordered."""
    return tf.cast(_f64(a) + _f64(b), tf.float32)


def decode(loc, priors, variances, param):
    """Caffe's DecodeBBox for every prediction: loc ... x P x 4 against priors and variances P x 4. Float
    where Caffe computes in float, double where it does (each corner from a centre and a half size)."""
    px0, py0, px1, py1 = tf.unstack(priors, axis=-1)
    v = tf.unstack(variances, axis=-1)
    if param.variance_encoded_in_target:
        v = [tf.ones_like(px0)] * 4
    dx, dy, dw, dh = tf.unstack(loc, axis=-1)
    if param.code_type == CODE.CORNER:
        return _corners(_plus(px0, _times(v[0], dx)), _plus(py0, _times(v[1], dy)), _plus(px1, _times(v[2], dw)),
                        _plus(py1, _times(v[3], dh)))
    width, height = px1 - px0, py1 - py0
    if param.code_type == CODE.CORNER_SIZE:
        return _corners(_plus(px0, _times(v[0], dx, width)), _plus(py0, _times(v[1], dy, height)),
                        _plus(px1, _times(v[2], dw, width)), _plus(py1, _times(v[3], dh, height)))
    cx = _plus(_times(v[0], dx, width), (px0 + px1) / 2.0)
    cy = _plus(_times(v[1], dy, height), (py0 + py1) / 2.0)
    # Caffe's expf (glibc's, correctly rounded): exp in double rounded to float, then a float product.
    width = _times(tf.cast(tf.exp(_f64(_times(v[2], dw))), tf.float32), width)
    height = _times(tf.cast(tf.exp(_f64(_times(v[3], dh))), tf.float32), height)
    return _corners(_f64(cx) - _f64(width) / 2.0, _f64(cy) - _f64(height) / 2.0, _f64(cx) + _f64(width) / 2.0,
                    _f64(cy) + _f64(height) / 2.0)


def box_size(boxes):
    """Caffe's BBoxSize of normalized boxes (... x 4): width * height in float, 0 for an inverted box."""
    x0, y0, x1, y1 = tf.unstack(boxes, axis=-1)
    return tf.where((x1 < x0) | (y1 < y0), 0.0, (x1 - x0) * (y1 - y0))


def jaccard(a, a_size, b, b_size):
    """Caffe's JaccardOverlap of boxes `a` with boxes `b` (... x 4, broadcast against each other; their sizes
    ...): IntersectBBox, then intersection / (size + size - intersection) in float; 0 where they do not meet."""
    a, b = tf.unstack(a, axis=-1), tf.unstack(b, axis=-1)
    apart = (b[0] > a[2]) | (b[2] < a[0]) | (b[1] > a[3]) | (b[3] < a[1])
    width = tf.minimum(a[2], b[2]) - tf.maximum(a[0], b[0])
    height = tf.minimum(a[3], b[3]) - tf.maximum(a[1], b[1])
    meets = ~apart & (width > 0) & (height > 0)
    inter = width * height
    return tf.where(meets, inter / (_plus(a_size, b_size) - inter), 0.0)


# Up to this many candidates per row, NMS compares every pair at once (rows x K x K) and settles in a few
# passes; beyond it (or with eta < 1) it goes through the candidates one by one, as Caffe does.
PAIRWISE = 512


def suppress(boxes, sizes, valid, nms, bound, overlaps=jaccard):
    """Caffe's ApplyNMSFast on each row of candidates already in its order (R x K, K at most `bound`): a
    candidate is kept when its overlap with every kept one before it is at most nms_threshold (which eta < 1
    lowers after each keep while it is above 0.5). The rows' kept mask (R x K). `overlaps` is jaccard's
    signature (Proposal's nms_cpu measures in whole pixels)."""
    if nms.eta < 1 or bound > PAIRWISE:
        return _suppress_in_turn(boxes, sizes, valid, nms, overlaps)
    k = tf.shape(valid)[1]
    overlap = overlaps(boxes[:, :, None], sizes[:, :, None], boxes[:, None], sizes[:, None])  # [r, j, i]
    earlier = tf.range(k)[None, :] < tf.range(k)[:, None]  # i before j
    beaten = ~(overlap <= nms.nms_threshold) & earlier[None]

    def settle(kept, _):
        """j is kept when no kept i before it beats it: from all kept, each pass settles one more candidate at
        least, and the pass that changes nothing has Caffe's answer (the only one the rule allows)."""
        now = valid & ~tf.reduce_any(beaten & kept[:, None, :], axis=2)
        return now, tf.reduce_any(now != kept)

    kept, _ = tf.while_loop(lambda kept, changed: changed, settle, (valid, tf.constant(True)))
    return kept


def _suppress_in_turn(boxes, sizes, valid, nms, overlaps):
    """suppress, one candidate after another."""
    rows, k = tf.shape(valid)[0], tf.shape(valid)[1]
    eta = nms.eta

    def step(j, kept, threshold):
        overlap = overlaps(boxes[:, j, None], sizes[:, j, None], boxes, sizes)
        clear = tf.reduce_all(~kept | (overlap <= threshold[:, None]), axis=1)
        keep = valid[:, j] & clear
        kept = kept | (keep[:, None] & tf.equal(tf.range(k), j)[None, :])
        if eta < 1:
            threshold = tf.where(keep & (threshold > 0.5), threshold * eta, threshold)
        return j + 1, kept, threshold

    threshold = tf.fill([rows], tf.constant(nms.nms_threshold, tf.float32))
    _, kept, _ = tf.while_loop(lambda j, *_: j < k, step, (0, tf.zeros([rows, k], tf.bool), threshold))
    return kept


def candidates(scores, param):
    """Per row of scores (R x P): (the candidates' indices in Caffe's order, R x K; which of them stand; the
    most K can be).
    With nms_param: the scores above confidence_threshold, best first (ties by index), the first top_k; the
    K columns are as many as the row with the most. Without: every prediction, in index order."""
    if not param.HasField("nms_param"):
        index = tf.broadcast_to(tf.range(tf.shape(scores)[1]), tf.shape(scores))
        return index, tf.ones_like(scores, tf.bool), scores.shape[1]
    threshold = param.confidence_threshold if param.HasField("confidence_threshold") else -np.finfo(np.float32).max
    above = scores > threshold
    k = scores.shape[1]
    if param.nms_param.HasField("top_k") and -1 < param.nms_param.top_k < k:
        k = param.nms_param.top_k
    most = tf.minimum(tf.reduce_max(tf.reduce_sum(tf.cast(above, tf.int32), axis=1)), k)
    _, index = tf.math.top_k(tf.where(above, scores, -np.inf), k=k)  # equal scores: the lower index first
    index = index[:, :most]
    return index, tf.gather(above, index, batch_dims=1), k


def per_row(conf, boxes, labels, shared):
    """The rows NMS runs on, one per (item, label) in that order: their scores (R x P), boxes (R x P x 4) and
    box sizes (R x P); boxes are N x location classes x P x 4."""
    priors = conf.shape[1]
    scores = tf.reshape(tf.transpose(tf.gather(conf, labels, axis=2), (0, 2, 1)), (-1, priors))
    if shared:
        boxes = tf.repeat(boxes, len(labels), axis=1)
    else:
        boxes = tf.gather(boxes, labels, axis=1)
    boxes = tf.reshape(boxes, (-1, priors, 4))
    return scores, boxes, box_size(boxes)


def kept_top_k(kept, scores, keep_top_k):
    """Which detections each item keeps (kept: N x M, in label order then NMS order) and the key that orders
    them: Caffe's keep_top_k keeps an item's best keep_top_k over all labels when it has more (best first
    within a label, ties by label and order); an item with fewer keeps them all, in their order."""
    position = tf.broadcast_to(tf.range(tf.shape(kept)[1]), tf.shape(kept))
    if keep_top_k < 0:
        return kept, position
    _, best = tf.math.top_k(tf.where(kept, scores, -np.inf), k=tf.shape(kept)[1])
    rank = tf.argsort(best, axis=1, stable=True)  # the inverse permutation: each detection's place
    truncated = tf.reduce_sum(tf.cast(kept, tf.int32), axis=1, keepdims=True) > keep_top_k
    return kept & (~truncated | (rank < keep_top_k)), tf.where(truncated, rank, position)


@layer("DetectionOutput")
def detection_output(layer, bottoms, params, ctx):
    """Caffe's DetectionOutput (no backward): decode each prior's box, per item and label the candidates
    (nms_param: above confidence_threshold, best top_k) through NMS, then keep_top_k per item; rows
    [item, label, score, xmin, ymin, xmax, ymax] by item, then label, then best first, as 1 x 1 x K x 7.
    With no detection in the whole batch, one row [item, -1, ..., -1] per item, as Caffe's."""
    param = layer.param.detection_output_param
    classes = param.num_classes
    loc_classes = 1 if param.share_location else classes
    num_priors = legacy(layer.bottom_shapes[2], 2) // 4
    loc, conf, prior = [tf.stop_gradient(b.caffe) for b in bottoms[:3]]
    items = tf.shape(loc)[0]
    labels = [c for c in range(classes) if c != param.background_label_id]
    if not labels:
        return [Blob(_no_detections(items))]
    loc = tf.transpose(tf.reshape(loc, (-1, num_priors, loc_classes, 4)), (0, 2, 1, 3))
    conf = tf.reshape(conf, (-1, num_priors, classes))
    prior = tf.reshape(tf.reshape(prior, (-1,))[:2 * num_priors * 4], (2, num_priors, 4))
    scores, boxes, sizes = per_row(conf, decode(loc, prior[0], prior[1], param), labels, param.share_location)
    index, valid, bound = candidates(scores, param)
    boxes, sizes = tf.gather(boxes, index, batch_dims=1), tf.gather(sizes, index, batch_dims=1)
    scores = tf.gather(scores, index, batch_dims=1)
    kept = suppress(boxes, sizes, valid, param.nms_param, bound) if param.HasField("nms_param") else valid
    k = tf.shape(index)[1]
    per_item = (items, len(labels) * k)
    kept, order = kept_top_k(tf.reshape(kept, per_item), tf.reshape(scores, per_item), param.keep_top_k)
    label_of = tf.repeat(tf.constant(labels, tf.float32), k)  # per column of an item's detections
    item_of = tf.range(items)[:, None] + tf.zeros(per_item, tf.int32)
    columns = tf.broadcast_to(tf.range(per_item[1]), per_item)
    key = (tf.cast(item_of, tf.int64) * len(labels) + tf.cast(columns // k, tf.int64)) * tf.cast(per_item[1],
                                                                                                  tf.int64)
    key = tf.boolean_mask(key + tf.cast(order, tf.int64), kept)
    chosen = tf.gather(tf.where(tf.reshape(kept, (-1,)))[:, 0], tf.argsort(key, stable=True))
    rows = tf.concat([tf.cast(tf.gather(tf.reshape(item_of, (-1,)), chosen), tf.float32)[:, None],
                      tf.gather(tf.tile(label_of, [items]), chosen)[:, None],
                      tf.gather(tf.reshape(scores, (-1,)), chosen)[:, None],
                      tf.gather(tf.reshape(boxes, (-1, 4)), chosen)], axis=1)
    rows = tf.cond(tf.size(rows) > 0, lambda: rows, lambda: _no_detections(items)[0, 0])
    return [Blob(tf.reshape(rows, (1, 1, -1, 7)))]


def pixel_overlaps(a, a_size, b, b_size):
    """nms_cpu's iou of boxes `a` with boxes `b` (... x 4, broadcast) in whole pixels (a side is x2 - x1 + 1;
    sizes so measured): 0 where they do not meet, else intersection / (size + size - intersection) in float."""
    a, b = tf.unstack(a, axis=-1), tf.unstack(b, axis=-1)
    apart = (a[0] > b[2]) | (a[1] > b[3]) | (a[2] < b[0]) | (a[3] < b[1])
    width = tf.maximum(0.0, _plus(tf.minimum(a[2], b[2]) - tf.maximum(a[0], b[0]), 1.0))
    height = tf.maximum(0.0, _plus(tf.minimum(a[3], b[3]) - tf.maximum(a[1], b[1]), 1.0))
    inter = width * height
    return tf.where(apart, 0.0, inter / (_plus(a_size, b_size) - inter))


def pixel_size(boxes):
    """(x2 - x1 + 1) (y2 - y1 + 1) of boxes ... x 4, in float."""
    x0, y0, x1, y1 = tf.unstack(boxes, axis=-1)
    return _plus(x1 - x0, 1.0) * _plus(y1 - y0, 1.0)


def proposal_boxes(deltas, anchors, stride, image_hw, min_size):
    """Each anchor at each position (N x H x W x A x 4 deltas, in that order) moved by its deltas as the fork's
    transform_box, clipped to the image, and whether both its sides reach min_size: (N x P x 4, N x P)."""
    sizes = tf.shape(deltas)
    ys = tf.cast(tf.range(sizes[1]) * stride, tf.float32)[:, None, None]
    xs = tf.cast(tf.range(sizes[2]) * stride, tf.float32)[None, :, None]
    x0, y0, x1, y1 = (_plus(origin, anchors[:, i]) for i, origin in enumerate((xs, ys, xs, ys)))
    dx, dy, dw, dh = tf.unstack(deltas, axis=-1)
    width, height = _plus(x1 - x0, 1.0), _plus(y1 - y0, 1.0)
    cx, cy = _plus(_times(dx, width), _plus(x0, 0.5 * width)), _plus(_times(dy, height), _plus(y0, 0.5 * height))
    # the fork's exp of a float: glibc's expf, correctly rounded, as exp in double rounded to float
    new_w = _times(tf.cast(tf.exp(_f64(dw)), tf.float32), width)
    new_h = _times(tf.cast(tf.exp(_f64(dh)), tf.float32), height)
    high_x, high_y = image_hw[1] - 1.0, image_hw[0] - 1.0
    box = [tf.maximum(0.0, tf.minimum(corner, high))
           for corner, high in ((cx - 0.5 * new_w, high_x), (cy - 0.5 * new_h, high_y),
                                (_plus(cx, 0.5 * new_w), high_x), (_plus(cy, 0.5 * new_h), high_y))]
    big = (_plus(box[2] - box[0], 1.0) >= min_size) & (_plus(box[3] - box[1], 1.0) >= min_size)
    return tf.reshape(tf.stack(box, axis=-1), (sizes[0], -1, 4)), tf.reshape(big, (sizes[0], -1))


# The fork sorts Proposal's scores with its own quicksort (sort_box), which leaves equal scores in an order of
# its own that decides which of them reach the NMS first; fork_order runs that quicksort in TensorFlow ops (a
# SavedModel serves it), every range of one recursion depth partitioned at once, so that ties go as pycaffe's.

def _partition(v, pos, start, end, active):
    """sort_box's partition of every active range [start, end] (each position holds its range's) at once: its
    scans skip values equal to the pivot v[start], so the k-th value under it from the left swaps with the k-th
    over it from the right while the first lies before the second, and `right` stops at the next value over it
    past the last swapped one, else at that one, else at start; then the pivot swaps to `right`. Returns each
    position's gather source and its range's `right`."""
    pivot = tf.gather(v, start)
    inner = active & (pos > start)
    lt, gt = inner & (v < pivot), inner & (v > pivot)
    lt_sum, gt_sum = tf.cumsum(tf.cast(lt, tf.int32)), tf.cumsum(tf.cast(gt, tf.int32))
    lt_before, gt_before = tf.gather(lt_sum, start), tf.gather(gt_sum, start)
    lt_count, gt_count = tf.gather(lt_sum, end) - lt_before, tf.gather(gt_sum, end) - gt_before
    lows = tf.concat([tf.cast(tf.where(lt)[:, 0], tf.int32), [0]], 0)  # never empty
    highs = tf.concat([tf.cast(tf.where(gt)[:, 0], tf.int32), [0]], 0)

    def low(k):  # the k-th position (from the left) of a value under the pivot, in each position's segment
        return tf.gather(lows, tf.clip_by_value(lt_before + k, 0, tf.size(lows) - 1))

    def high(k):  # the k-th (from the right) of a value over it
        return tf.gather(highs, tf.clip_by_value(gt_before + gt_count - 1 - k, 0, tf.size(highs) - 1))

    lt_rank, gt_rank = lt_sum - lt_before - 1, gt_count - (gt_sum - gt_before)
    partner_of_low, partner_of_high = high(lt_rank), low(gt_rank)
    swap_low = lt & (lt_rank < gt_count) & (pos < partner_of_low)
    swap_high = gt & (gt_rank < lt_count) & (partner_of_high < pos)
    swaps = tf.cumsum(tf.cast(swap_low, tf.int32))
    k = tf.gather(swaps, end) - tf.gather(swaps, start)  # the pairs swapped, a prefix of both lists
    last_low = tf.where(k > 0, low(k - 1), start)
    next_high = high(k)
    right = tf.where((k < gt_count) & (next_high > last_low), next_high, last_low)
    source = tf.where(swap_low, partner_of_low, tf.where(swap_high, partner_of_high, pos))
    pivot_moves = active & (right > start)
    source = tf.where(pivot_moves & (pos == start), tf.gather(source, right),
                      tf.where(pivot_moves & (pos == right), start, source))
    return source, right


def _peeled(v, pos, start, end, active, item_start, num_top):
    """sort_box leaves a range whose first value is its maximum as it is and goes on with the rest (when that
    rest starts before num_top and holds two values): each active range's run of such first values skipped at
    once, that is the values of its non-increasing head down to the maximum M of what follows the head. Returns
    the ranges' new starts and which positions are still in an active range (none where it is all head)."""
    far = ranges = tf.size(pos)  # past every position; a range is known by its start
    rises = active & (pos > start) & (v > tf.gather(v, tf.maximum(pos - 1, 0)))
    head_end = tf.gather(tf.math.unsorted_segment_min(tf.where(rises, pos, far), start, ranges), start)
    tail = active & (pos >= head_end)
    most = tf.gather(tf.math.unsorted_segment_max(tf.where(tail, v, -np.inf), start, ranges), start)
    first = tf.gather(tf.math.unsorted_segment_min(tf.where(active & ~tail & (v < most), pos, far), start, ranges),
                      start)
    first = tf.where(head_end <= end, first, far)  # no rise: all of it is left as it is
    moved = first > start
    go_on = (first <= end) & (~moved | ((first - item_start < num_top) & (first < end)))
    still = active & go_on & (pos >= first)
    return tf.where(still, first, start), still


def fork_order(scores, num_top):
    """Each row's indices (N x P) in the order the fork's Proposal sort_box(list, 0, P - 1, num_top) leaves
    its scores: a quicksort whose pivot is each range's first value, partitioned from both ends, that sorts
    the first num_top places only; here every range of one recursion depth is partitioned at once."""
    rows, size = tf.shape(scores)[0], tf.shape(scores)[1]
    values = tf.reshape(scores, (-1,))
    pos = tf.range(rows * size)
    base = pos // size * size
    state = (pos, base, base + size - 1, tf.fill(tf.shape(pos), size > 1))

    def level(order, start, end, active):
        v = tf.gather(values, order)
        start, active = _peeled(v, pos, start, end, active, base, num_top)
        source, right = _partition(v, pos, start, end, active)
        order = tf.where(active, tf.gather(order, source), order)
        left_side, right_side = active & (pos < right), active & (pos > right)
        active = (left_side & (start < right - 1)) | (right_side & (right + 1 - base < num_top) & (right + 1 < end))
        return (order, tf.where(right_side, right + 1, start), tf.where(left_side, right - 1, end), active)

    order, *_ = tf.while_loop(lambda order, start, end, active: tf.reduce_any(active), level, state)
    return tf.reshape(order - base, (rows, size))


def proposal_order(scores, num_top):
    """The indices of each row's first min(num_top, P) scores (N x P) in the order the fork's sort_box leaves
    them: top_k's where no two of them (nor the last and the next) tie, the only descending order then; else
    fork_order's, whose passes are as many as the fork's recursion is deep."""
    k = tf.minimum(num_top, tf.shape(scores)[1])
    best = tf.math.top_k(scores, k=tf.minimum(k + 1, tf.shape(scores)[1]))
    ties = tf.reduce_any(best.values[:, 1:] == best.values[:, :-1])
    return tf.cond(ties, lambda: fork_order(scores, num_top)[:, :k], lambda: best.indices[:, :k])


@layer("Proposal")
def proposal(layer, bottoms, params, ctx):
    """The fork's Proposal (Faster R-CNN's; no backward): every anchor at every position moved by its deltas,
    clipped, scored 0 under min_size; per item the best pre_nms_topn (ties in the order of the fork's quicksort)
    through nms_cpu (iou over nms_thresh suppresses), the first post_nms_topn kept as rows
    [item, x1, y1, x2, y2] by item, best first, and their scores (a second top)."""
    param = layer.param.proposal_param
    anchors = proposal_anchors(param)
    count = len(anchors)
    scores, deltas, info = [tf.stop_gradient(b.caffe) for b in bottoms]
    scores = tf.reshape(tf.transpose(scores[:, count:], (0, 2, 3, 1)), (tf.shape(scores)[0], -1))
    deltas = tf.transpose(tf.reshape(deltas, tf.concat([[-1, count, 4], tf.shape(deltas)[2:]], 0)), (0, 3, 4, 1, 2))
    boxes, big = proposal_boxes(deltas, tf.constant(anchors), param.feat_stride, tf.reshape(info, (-1,))[:2],
                                float(param.min_size))
    scores = tf.where(big, scores, 0.0 * scores)
    bound = min(param.pre_nms_topn, math.prod(layer.bottom_shapes[0][2:]) * count)
    order = proposal_order(scores, param.pre_nms_topn)
    scores, boxes = tf.gather(scores, order, batch_dims=1), tf.gather(boxes, order, batch_dims=1)
    nms = pb.NonMaximumSuppressionParameter(nms_threshold=param.nms_thresh)
    kept = suppress(boxes, pixel_size(boxes), tf.ones_like(scores, tf.bool), nms, bound, pixel_overlaps)
    kept &= tf.cumsum(tf.cast(kept, tf.int32), axis=1) <= param.post_nms_topn
    item = tf.cast(tf.broadcast_to(tf.range(tf.shape(kept)[0])[:, None], tf.shape(kept)), tf.float32)
    rows = tf.concat([tf.boolean_mask(item, kept)[:, None], tf.boolean_mask(boxes, kept)], axis=1)
    return [Blob(rows), Blob(tf.boolean_mask(scores, kept))][:len(layer.tops)]


def _no_detections(items):
    """Caffe's rows when the batch has no detection: [item, -1, -1, -1, -1, -1, -1] per item, 1 x 1 x N x 7."""
    fill = tf.fill([items, 6], -1.0)
    return tf.reshape(tf.concat([tf.cast(tf.range(items), tf.float32)[:, None], fill], axis=1), (1, 1, -1, 7))


# -- MultiBoxLoss ------------------------------------------------------------------------------------------
# Its matching and mining are Caffe's loops (bbox_util.cpp's FindMatches, MatchBBox, MineHardExamples,
# EncodeLocPrediction, EncodeConfPrediction) on numpy, through one tf.numpy_function: discrete choices made
# greedily, in Caffe's map and loop order, that take no gradient (Caffe's Backward copies diffs to the chosen
# rows only). They hand TensorFlow the rows chosen and their targets; the losses over those rows are TensorFlow
# ops, so that the locations and confidences get their diffs by autodiff. A train net's loss is never exported,
# so the numpy bridge costs one host round trip per step and nothing else.

MB = pb.MultiBoxLossParameter
F32 = np.float32


def np_box_size(boxes):
    """BBoxSize of normalized boxes (... x 4) in float: 0 for an inverted box."""
    inverted = (boxes[..., 2] < boxes[..., 0]) | (boxes[..., 3] < boxes[..., 1])
    return np.where(inverted, F32(0), (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1]))


def np_overlaps(a, b):
    """JaccardOverlap of each box of `a` (A x 4) with each of `b` (B x 4), A x B in float as Caffe's."""
    a, b = a[:, None], b[None]
    apart = (b[..., 0] > a[..., 2]) | (b[..., 2] < a[..., 0]) | (b[..., 1] > a[..., 3]) | (b[..., 3] < a[..., 1])
    width = np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0])
    height = np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1])
    inter = width * height
    meets = ~apart & (width > 0) & (height > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = inter / ((np_box_size(a) + np_box_size(b)) - inter)
    return np.where(meets, value, F32(0)).astype(F32)


def _exp(x):
    """expf as glibc rounds it: exp in double, rounded to float."""
    return np.exp(np.asarray(x, np.float64)).astype(F32)


def _log(x):
    return np.log(np.asarray(x, np.float64)).astype(F32)


def _centre(low, high):
    """(low + high) / 2. in Caffe: a float sum halved (exact), stored as float."""
    return ((low + high).astype(np.float64) / 2.0).astype(F32)


def np_decode(loc, priors, variances, code_type, in_target):
    """DecodeBBox of each prediction (P x 4) against its prior and variance (P x 4), clip off, in Caffe's float
    and double steps."""
    v = np.ones_like(variances) if in_target else variances
    p0, p1, p2, p3 = priors.T
    if code_type == CODE.CORNER:
        return (priors + v * loc).astype(F32)
    width, height = p2 - p0, p3 - p1
    if code_type == CODE.CORNER_SIZE:
        return (priors + v * loc * np.stack([width, height, width, height], 1)).astype(F32)
    cx = v[:, 0] * loc[:, 0] * width + _centre(p0, p2)
    cy = v[:, 1] * loc[:, 1] * height + _centre(p1, p3)
    w, h = _exp(v[:, 2] * loc[:, 2]) * width, _exp(v[:, 3] * loc[:, 3]) * height
    cx, cy, w, h = (np.asarray(t, np.float64) for t in (cx, cy, w, h))
    return np.stack([cx - w / 2.0, cy - h / 2.0, cx + w / 2.0, cy + h / 2.0], 1).astype(F32)


def np_encode(priors, variances, truth, code_type, in_target):
    """EncodeBBox of each matched ground-truth box against its prior (M x 4 each), in Caffe's float steps."""
    if code_type == CODE.CORNER:
        offset = truth - priors
        return offset if in_target else (offset / variances).astype(F32)
    p0, p1, p2, p3 = priors.T
    pw, ph = p2 - p0, p3 - p1
    if code_type == CODE.CORNER_SIZE:
        coded = (truth - priors) / np.stack([pw, ph, pw, ph], 1)
        return coded if in_target else (coded / variances).astype(F32)
    g0, g1, g2, g3 = truth.T
    gw, gh = g2 - g0, g3 - g1
    if (pw <= 0).any() or (ph <= 0).any() or (gw <= 0).any() or (gh <= 0).any():
        raise ValueError("MultiBoxLoss: a matched prior or ground-truth box has no width or height (Caffe aborts)")
    coded = np.stack([(_centre(g0, g2) - _centre(p0, p2)) / pw, (_centre(g1, g3) - _centre(p1, p3)) / ph,
                      _log(gw / pw), _log(gh / ph)], 1)
    return coded if in_target else (coded / variances).astype(F32)


def np_match(truth, boxes, param):
    """MatchBBox of the ground truth (G x 4) with the predictions or priors (P x 4): each one's matched truth
    (-1 none, -2 ignored across the border) and its best overlap. Bipartite first (the largest overlap of an
    unmatched box and a truth still in the pool, the first in (box, truth) order on a tie, as Caffe's strict
    >), then, PER_PREDICTION, every unmatched box to its best truth at or above overlap_threshold."""
    index, best = np.full(len(boxes), -1), np.zeros(len(boxes), F32)
    if not len(truth):
        return index, best
    if param.ignore_cross_boundary_bbox:
        index[((boxes < 0) | (boxes > 1)).any(axis=1)] = -2
    overlap = np_overlaps(boxes, truth)
    recorded = (overlap.astype(np.float64) > 1e-6) & (index != -2)[:, None]
    best = np.where(recorded, overlap, F32(0)).max(axis=1)
    pool = np.ones(len(truth), bool)
    while pool.any():
        open_ = recorded & (index == -1)[:, None] & pool[None]
        if not open_.any():
            break
        i, j = divmod(int(np.argmax(np.where(open_, overlap, -1))), len(truth))
        index[i], best[i], pool[j] = j, overlap[i, j], False
    if param.match_type == MB.PER_PREDICTION:
        good = recorded & (overlap >= F32(param.overlap_threshold))
        pick = np.argmax(np.where(good, overlap, -1), axis=1)
        take = (index == -1) & good.any(axis=1)
        index[take], best[take] = pick[take], overlap[take, pick[take]]
    return index, best


def np_truth(rows, param):
    """GetGroundTruth: {item: (labels G, boxes G x 4)} from 8-value rows, skipping item -1 and, without
    use_difficult_gt, the difficult ones."""
    found = {}
    for row in rows.reshape(-1, 8):
        item, label = int(row[0]), int(row[1])
        if item == -1:
            continue
        if label == param.background_label_id:
            raise ValueError(f"MultiBoxLoss: a ground-truth box of item {item} has the background label {label} "
                             "(Caffe aborts)")
        if label >= param.num_classes or label < 0:
            raise ValueError(f"MultiBoxLoss: ground-truth label {label} of item {item} is not one of the "
                             f"{param.num_classes} classes")
        if bool(row[7]) and not param.use_difficult_gt:
            continue
        found.setdefault(item, []).append((label, row[3:7]))
    return {item: (np.array([b[0] for b in boxes]), np.array([b[1] for b in boxes], F32))
            for item, boxes in found.items()}


def np_find_matches(loc, truth, priors, variances, param):
    """FindMatches for one item: {label (-1 shared): (matched truth per prior, best overlap per prior)} in
    Caffe's map order; empty for an item with no ground truth. loc: P x location classes x 4."""
    if truth is None:
        return {}
    labels, boxes = truth
    classes = param.num_classes
    if param.use_prior_for_matching:
        index, best = np_match(boxes, priors, param)
        if param.share_location:
            return {-1: (index, best)}
        matched = np.where(index > -1, labels[np.maximum(index, 0)], -1)
        return {c: (np.where((index > -1) & (matched == c), index, -1), best)
                for c in range(classes) if c != param.background_label_id}
    matches = {}
    for c in range(loc.shape[1]):
        label = -1 if param.share_location else c
        if label == param.background_label_id:
            continue
        chosen = np.arange(len(labels)) if label == -1 else np.flatnonzero(labels == label)
        decoded = np_decode(loc[:, c], priors, variances, param.code_type, param.encode_variance_in_target)
        index, best = np_match(boxes[chosen], decoded, param)
        matches[label] = (np.where(index > -1, chosen[np.maximum(index, 0)], index), best)
    return matches


def np_conf_loss(conf, labels, param):
    """ComputeConfLoss of each prior (conf: P x classes) against its label, in Caffe's float loop: softmax's
    -log(max(p, FLT_MIN)) or the logistic loss summed over the classes."""
    sum_, loss = np.zeros(len(conf), F32), np.zeros(len(conf), F32)
    rows = np.arange(len(conf))
    if param.conf_loss_type == MB.SOFTMAX:
        shifted = (conf - conf.max(axis=1, keepdims=True)).astype(F32)
        for c in range(conf.shape[1]):
            sum_ = (sum_ + _exp(shifted[:, c])).astype(F32)
        prob = (_exp(shifted[rows, labels]) / sum_).astype(F32)
        return -_log(np.maximum(prob, np.finfo(F32).tiny))
    for c in range(conf.shape[1]):
        x = conf[:, c]
        positive = (x >= 0).astype(F32)
        term = x * ((labels == c).astype(F32) - positive) - _log(F32(1) + _exp(x - F32(2) * x * positive))
        loss = (loss - term.astype(F32)).astype(F32)
    return loss


def np_apply_nms(boxes, scores, threshold, top_k):
    """The older ApplyNMS that mining uses: best score first (stable), top_k of them, boxes smaller than 1e-5
    dropped, each kept one removing the rest that overlap it above `threshold`; stops at top_k kept."""
    order = list(np.argsort(-scores, kind="stable"))
    if -1 < top_k < len(order):
        order = order[:top_k]
    small = np_box_size(boxes).astype(np.float64) < 1e-5
    kept = []
    while order:
        best = order.pop(0)
        if small[best]:
            continue
        kept.append(best)
        if -1 < top_k <= len(kept):
            break
        overlap = np_overlaps(boxes[best:best + 1], boxes[order])[0] if order else np.zeros(0, F32)
        order = [m for m, o in zip(order, overlap) if not small[m] and not o > F32(threshold)]
    return np.array(kept, int)


def np_mine(matches, loss, boxes, priors, param):
    """MineHardExamples for one item (its matches are updated in place): the negatives chosen, in prior order.
    MAX_NEGATIVE: unmatched priors below neg_overlap, the highest losses, neg_pos_ratio per positive;
    HARD_EXAMPLE: the sample_size highest of all, and the positives not among them unmatched. With nms_param
    (nms_threshold > 0) the candidates go through NMS first (on the priors, use_prior_for_nms, or the decoded
    predictions `boxes`)."""
    negatives = []
    for label, (index, over) in matches.items():
        if param.mining_type == MB.MAX_NEGATIVE:
            eligible = np.flatnonzero((index == -1) & (over < F32(param.neg_overlap)))
            wanted = min(int(F32(np.sum(index > -1)) * F32(param.neg_pos_ratio)), len(eligible))
        else:
            eligible = np.arange(len(index))
            wanted = min(param.sample_size, len(eligible))
        if param.HasField("nms_param") and param.nms_param.nms_threshold > 0:
            shown = priors if param.use_prior_for_nms else boxes
            # top_k as given: unset is 0 here (DetectionOutput reads unset as all), which keeps none
            kept = np_apply_nms(shown[eligible], loss[eligible], param.nms_param.nms_threshold,
                                param.nms_param.top_k)
            chosen = set(eligible[kept[:wanted]].tolist())
        else:  # Caffe's std::sort is not stable: equal losses may go either way there, in order here
            chosen = set(eligible[np.argsort(-loss[eligible], kind="stable")[:wanted]].tolist())
        if param.mining_type == MB.HARD_EXAMPLE:
            index[(index > -1) & ~np.isin(np.arange(len(index)), list(chosen))] = -1
        negatives += [int(m) for m in np.flatnonzero(index == -1) if m in chosen]
    return negatives


def np_locations(loc, matches, truth, priors, variances, param):
    """EncodeLocPrediction for one item (loc: P x location classes x 4): per matched prediction, in Caffe's
    order (label in map order, then prior), (its row among the item's P * location classes rows of 4, which
    of its 4 values it keeps (bp_inside puts the target in place of one whose box side is outside the image),
    the encoded target, the divisor both are scaled by (the variance with encode_variance_in_target, else 1))."""
    rows, kept, targets, divisors = [], [], [], []
    for label, (index, _) in matches.items():
        column = 0 if param.share_location else label
        chosen = np.flatnonzero(index > -1)
        target = np_encode(priors[chosen], variances[chosen], truth[1][index[chosen]], param.code_type,
                           param.encode_variance_in_target)
        keep = np.ones((len(chosen), 4), bool)
        if param.bp_inside:
            shown = priors[chosen] if param.use_prior_for_matching else np_decode(
                loc[chosen, column], priors[chosen], variances[chosen], param.code_type,
                param.encode_variance_in_target)
            keep = (shown >= 0) & (shown <= 1)
        rows.append(chosen * loc.shape[1] + column)
        kept.append(keep)
        targets.append(target)
        divisors.append(variances[chosen] if param.encode_variance_in_target else np.ones((len(chosen), 4), F32))
    if not rows:
        return np.zeros(0, int), np.zeros((0, 4), bool), np.zeros((0, 4), F32), np.zeros((0, 4), F32)
    return tuple(np.concatenate(part) for part in (rows, kept, targets, divisors))


def np_loc_loss(loc, located, num_priors, param):
    """ComputeLocLoss for one item: each matched prior's smooth L1 (or half squared) error summed over its 4
    values, 0 for the others (HARD_EXAMPLE mining adds it to the confidence loss)."""
    rows, keep, target, divisor = located
    flat = loc.reshape(-1, 4)[rows]
    diff = (np.where(keep, flat, target) / divisor - target / divisor).astype(F32)
    absolute = np.abs(diff).astype(np.float64)
    if param.loc_loss_type == MB.SMOOTH_L1:
        error = np.where(absolute < 1, 0.5 * absolute * absolute, absolute - 0.5)
    else:
        error = 0.5 * absolute * absolute
    loss = np.zeros(num_priors, F32)
    np.add.at(loss, rows // loc.shape[1], error.astype(F32).sum(axis=1, dtype=F32))
    return loss


def prior_labels(matches, truth, num_priors, background):
    """Each prior's class for the confidence loss: the label of its match (the first label in map order that
    has one), else the background."""
    labels = np.full(num_priors, background)
    for index, _ in reversed(list(matches.values())):
        labels = np.where(index > -1, truth[0][np.maximum(index, 0)], labels)
    return labels


def multibox_plan(loc, conf, prior, truth_rows, param):
    """MultiBoxLoss's Forward up to its two inner losses, on numpy: (location rows of the
    (items * priors * loc classes) x 4 predictions, which of their values they keep, their targets, their
    divisors; confidence rows of the (items * priors) x classes scores, their targets (a label each for
    SOFTMAX, a row of classes for LOGISTIC); the number of matches, the VALID normalizer)."""
    items, classes, background = len(loc), param.num_classes, param.background_label_id
    num_priors = len(conf.reshape(-1)) // (items * classes) if items else 0
    loc = loc.reshape(items, num_priors, -1, 4)
    conf = conf.reshape(items, num_priors, classes)
    priors, variances = prior.reshape(-1)[:2 * num_priors * 4].reshape(2, num_priors, 4)
    truth = np_truth(truth_rows, param)
    mining = param.mining_type != MB.NONE
    locations, conf_rows, conf_labels = [], [], []
    for i in range(items):
        matches = np_find_matches(loc[i], truth.get(i), priors, variances, param)
        negatives = []
        if mining and matches:
            loss = np_conf_loss(conf[i], prior_labels(matches, truth[i], num_priors, background), param)
            if param.mining_type == MB.HARD_EXAMPLE:
                located = np_locations(loc[i], matches, truth[i], priors, variances, param)
                loss = (loss + np_loc_loss(loc[i], located, num_priors, param)).astype(F32)
            boxes = np_decode(loc[i, :, 0], priors, variances, param.code_type, param.encode_variance_in_target)
            negatives = np_mine(matches, loss, boxes, priors, param)
        located = np_locations(loc[i], matches, truth.get(i), priors, variances, param)
        locations.append((located[0] + i * num_priors * loc.shape[2],) + located[1:])
        for label, (index, _) in matches.items():
            chosen = np.flatnonzero(index > -1)
            conf_rows.append(i * num_priors + chosen)
            conf_labels.append(np.full(len(chosen), background + 1) if param.map_object_to_agnostic
                               else truth[i][0][index[chosen]])
        conf_rows.append(i * num_priors + np.array(negatives, int))
        conf_labels.append(np.full(len(negatives), background))
    rows, keep, target, divisor = (np.concatenate([part[k] for part in locations]) for k in range(4))
    matched = F32(len(rows))
    conf_rows, conf_labels = np.concatenate(conf_rows).astype(np.int64), np.concatenate(conf_labels)
    if not mining:
        conf_rows, conf_labels = everything(conf_rows, conf_labels, items, num_priors, classes, param)
    elif param.conf_loss_type == MB.LOGISTIC:
        conf_labels = one_hot(np.arange(len(conf_rows)), conf_labels, len(conf_rows), classes, param)
    return (rows.astype(np.int64), keep, target.astype(F32), divisor.astype(F32), conf_rows,
            conf_labels.astype(np.int32 if param.conf_loss_type == MB.SOFTMAX else F32), matched)


def one_hot(rows, labels, count, classes, param):
    """LOGISTIC's targets, count x classes: Caffe fills them with background_label_id's value (not 0) and sets
    a 1 at each labelled position, so that a background label beyond the classes sets none."""
    target = np.full(count * classes, F32(param.background_label_id), F32)
    inside = labels < classes
    target[rows[inside] * classes + labels[inside]] = 1
    return target.reshape(count, classes)


def everything(rows, labels, items, num_priors, classes, param):
    """Without mining every prior of every item is a confidence row, labelled by its match (a later label in
    map order over an earlier) or the background. LOGISTIC's targets repeat this fork's offset: it moves the
    targets of item i on by i * priors values where its rows are i * priors * classes apart, so that item i's
    1s land at i * priors + prior * classes + label, as pycaffe trains them."""
    count = items * num_priors
    everyone = np.arange(count, dtype=np.int64)
    if param.conf_loss_type == MB.SOFTMAX:
        label = np.full(count, param.background_label_id)
        label[rows] = labels
        return everyone, label
    target = np.full(count * classes, F32(param.background_label_id), F32)
    item, prior = np.divmod(rows, num_priors)
    target[item * num_priors + prior * classes + labels] = 1
    return everyone, target.reshape(count, classes)


@tf.custom_gradient
def _divided(x, divisor):
    """x / divisor whose gradient is the gradient of the quotient: Caffe's Backward copies the diff of the
    predictions it divided by the variance (encode_variance_in_target) to the predictions unscaled."""
    return x / divisor, lambda dy: (dy, tf.zeros_like(divisor))


@layer("MultiBoxLoss")
def multibox_loss(layer, bottoms, params, ctx):
    """Caffe's MultiBoxLoss: the rows multibox_plan chooses, their location loss (SMOOTH_L1, or L2's half
    squared error) times loc_weight and their confidence loss (SOFTMAX's, or LOGISTIC's summed over the
    classes), each over the normalizer (loss_param's normalization of items, priors and matches, at least 1).
    A loss whose bottom has propagate_down false is left out of the top, as Caffe's Forward does."""
    param = layer.param.multibox_loss_param
    loc, conf, prior, truth = (b.caffe for b in bottoms)
    softmax = param.conf_loss_type == MB.SOFTMAX
    rows_read = legacy(layer.bottom_shapes[3], 2) * 8  # Caffe's num_gt: the blob's height, from its start
    plan = tf.numpy_function(lambda *arrays: multibox_plan(*arrays, param),
                             [tf.stop_gradient(loc), tf.stop_gradient(conf), tf.stop_gradient(prior),
                              tf.stop_gradient(tf.reshape(truth, (-1,))[:rows_read])],
                             [tf.int64, tf.bool, tf.float32, tf.float32, tf.int64,
                              tf.int32 if softmax else tf.float32, tf.float32], stateful=False,
                             name=f"{layer.name}_match")
    rows, keep, target, divisor, conf_rows, conf_target, matched = plan
    predicted = tf.gather(tf.reshape(loc, (-1, 4)), rows)
    diff = _divided(tf.where(keep, predicted, target), divisor) - target / divisor
    if param.loc_loss_type == MB.SMOOTH_L1:
        loc_loss = tf.reduce_sum(tf.where(tf.abs(diff) < 1, 0.5 * diff * diff, tf.abs(diff) - 0.5))
    else:
        loc_loss = tf.reduce_sum(diff * diff) / 2.0
    scores = tf.gather(tf.reshape(conf, (-1, param.num_classes)), conf_rows)
    if softmax:
        conf_loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=conf_target, logits=scores)
    else:
        conf_loss = tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.reshape(conf_target, tf.shape(scores)),
                                                            logits=scores)
    num_priors = legacy(layer.bottom_shapes[2], 2) // 4
    normalizer = loss_normalizer(layer.param.loss_param, items(loc), num_priors, tf.reshape(matched, ()))
    down = list(layer.param.propagate_down) or [True, True]
    loss = tf.constant(0.0)
    if down[0]:
        loss += param.loc_weight * loc_loss / normalizer
    if down[1]:
        loss += tf.reduce_sum(conf_loss) / normalizer
    return [Blob(loss)]


# -- DetectionEvaluate ------------------------------------------------------------------------------------------

def np_grouped(rows, width, stop_at_first_blank):
    """{item: {label: rows}} in Caffe's map order, each group in row order; rows of item -1 skipped
    (GetGroundTruth's LabelBBox form stops at the first one instead)."""
    groups = {}
    for row in rows.reshape(-1, width):
        if int(row[0]) == -1:
            if stop_at_first_blank:
                break
            continue
        groups.setdefault(int(row[0]), {}).setdefault(int(row[1]), []).append(row)
    return {item: {label: np.array(found[label], F32) for label in sorted(found)}
            for item, found in sorted(groups.items())}


def np_evaluate(detections, truth, param):
    """DetectionEvaluate's Forward on numpy: the per-class positives, then each detection (by item, label and,
    where the label has ground truth, best first) true positive when its best overlap with the label's truths
    reaches overlap_threshold and that truth is not taken yet (a difficult one, without evaluate_difficult_gt,
    makes it neither)."""
    found, expected = np_grouped(detections, 7, False), np_grouped(truth, 8, True)
    background = param.background_label_id
    for item in list(found) + list(expected):
        if background in found.get(item, {}) or background in expected.get(item, {}):
            raise ValueError(f"DetectionEvaluate: item {item} has the background label {background} (Caffe aborts)")
    top = np.zeros((param.num_classes - 1 + len(detections.reshape(-1, 7)), 5), F32)
    rows = []
    for label in range(param.num_classes):
        if label != background:
            boxes = [group[label] for group in expected.values() if label in group]
            hard = np.concatenate([b[:, 7] for b in boxes]) if boxes else np.zeros(0)
            rows.append([-1, label, len(hard) if param.evaluate_difficult_gt else np.sum(hard == 0), -1, -1])
    for item, groups in found.items():
        for label, dets in groups.items():
            truths = expected.get(item, {}).get(label)
            if truths is None:
                rows += [[item, label, det[2], 0, 1] for det in dets]
                continue
            dets = dets[np.argsort(-dets[:, 2], kind="stable")]
            overlap = np_overlaps(dets[:, 3:7], truths[:, 3:7])
            taken = np.zeros(len(truths), bool)
            for det, over in zip(dets, overlap):
                j = int(np.argmax(over))
                if over[j] < F32(param.overlap_threshold):
                    rows.append([item, label, det[2], 0, 1])
                elif not param.evaluate_difficult_gt and truths[j, 7]:
                    rows.append([item, label, det[2], 0, 0])
                else:
                    rows.append([item, label, det[2], int(not taken[j]), int(taken[j])])
                    taken[j] = True
    top[:len(rows)] = np.array(rows, F32).reshape(-1, 5)
    return top


@layer("DetectionEvaluate")
def detection_evaluate(layer, bottoms, params, ctx):
    """Caffe's DetectionEvaluate (no backward) on numpy through tf.numpy_function: rows a test net hands the
    solver's mAP (deepspark.detect.mean_average_precision)."""
    param = layer.param.detection_evaluate_param
    detections, truth = (tf.stop_gradient(b.caffe) for b in bottoms)
    top = tf.numpy_function(lambda d, t: np_evaluate(d, t, param), [detections, truth], tf.float32,
                            stateful=False, name=f"{layer.name}_evaluate")
    return [Blob(tf.reshape(top, (1, 1, -1, 5)))]
