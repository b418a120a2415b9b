"""Shape rules of the fork's detection layers: Permute, Normalize, PriorBox, DetectionOutput, MultiBoxLoss, Proposal.

Written from brocolli-caffe 9.0.2's permute_layer.cpp, normalize_layer.cpp, prior_box_layer.cpp,
detection_output_layer.cpp, multibox_loss_layer.cpp and proposal_layer.cpp: each CHECK there (a process abort
in pycaffe) is a ShapeError here.
"""

import numpy as np

from deepspark.graph.registry import ShapeError, constant_filler, count, fmt, given_filler, layer_type, legacy
from deepspark.proto import deepspark_pb2 as pb


def permute_order(param, rank):
    """Caffe's full axis order of a Permute layer: the given orders, then the axes they leave out, in order."""
    orders = []
    for order in param.order:
        if order >= rank:
            raise ShapeError(f"Permute order {order} is not an axis of a {rank}-axis input")
        if order in orders:
            raise ShapeError(f"Permute order {order} is given twice")
        orders.append(order)
    return orders + [axis for axis in range(rank) if axis not in orders]


@layer_type("Permute")
def _permute(lp, bottoms, ctx):
    if len(bottoms) != 1 or len(lp.top) != 1:
        raise ShapeError(f"Permute takes 1 bottom and makes 1 top, got {len(bottoms)} and {len(lp.top)}")
    shape = bottoms[0]
    return [tuple(shape[axis] for axis in permute_order(lp.permute_param, len(shape)))], []


def _normalize_fillers(lp):
    return [given_filler(lp.norm_param, "scale_filler", constant_filler(1.0))]


@layer_type("Normalize", fillers=_normalize_fillers)
def _normalize(lp, bottoms, ctx):
    """L2 normalisation over each item (across_spatial) or each position's channels; its scale blob is one
    value (channel_shared, a 0-axis blob) or one per channel."""
    if len(bottoms) != 1 or len(lp.top) != 1:
        raise ShapeError(f"Normalize takes 1 bottom and makes 1 top, got {len(bottoms)} and {len(lp.top)}")
    shape = bottoms[0]
    if len(shape) < 2:
        raise ShapeError(f"Normalize needs an input of at least 2 axes, got {fmt(shape)}")
    channels = legacy(shape, 1)
    return [shape], [() if lp.norm_param.channel_shared else (channels,)]


def aspect_ratios(param):
    """PriorBox's aspect ratios in Caffe's order: 1, then each given ratio not yet listed (within 1e-6) and,
    with flip, its inverse, as float32 (Caffe's vector<float>)."""
    ratios = [np.float32(1.0)]
    for ratio in param.aspect_ratio:
        ratio = np.float32(ratio)
        if any(abs(np.float32(ratio - known)) < 1e-6 for known in ratios):
            continue
        ratios.append(ratio)
        if param.flip:
            ratios.append(np.float32(1.0 / np.float64(ratio)))
    return ratios


def prior_count(param):
    """How many priors PriorBox places at each position: each min_size with every aspect ratio, plus one per
    max_size."""
    return len(aspect_ratios(param)) * len(param.min_size) + len(param.max_size)


def _given_pair(param, one, high, wide):
    """PriorBox's (height, width) from the fields `high` and `wide`, or both from `one`, or None where neither
    is given; each at least 1, and not both forms."""
    if param.HasField(high) or param.HasField(wide):
        if param.HasField(one):
            raise ShapeError(f"PriorBox takes {one} or {high}/{wide}, not both")
        if getattr(param, high) <= 0 or getattr(param, wide) <= 0:
            raise ShapeError(f"PriorBox needs {high} and {wide} larger than 0")
        return getattr(param, high), getattr(param, wide)
    if param.HasField(one):
        if getattr(param, one) <= 0:
            raise ShapeError(f"PriorBox needs {one} larger than 0")
        return getattr(param, one), getattr(param, one)
    return None


def prior_image_size(param):
    """(img_h, img_w) given in the prototxt, or None where the second bottom gives them."""
    return _given_pair(param, "img_size", "img_h", "img_w")


def prior_step(param):
    """(step_h, step_w) given in the prototxt, or None where the image and the feature map give them."""
    return _given_pair(param, "step", "step_h", "step_w")


@layer_type("PriorBox")
def _prior_box(lp, bottoms, ctx):
    """1 x 2 x (H * W * priors * 4): the boxes of every position of the feature map, then their variances.
    Its second bottom (the image) gives only its size, and neither bottom takes a diff (Caffe's Backward
    does nothing)."""
    param = lp.prior_box_param
    if len(lp.top) != 1:
        raise ShapeError(f"PriorBox makes 1 top, got {len(lp.top)}")
    if not param.min_size:
        raise ShapeError("PriorBox needs min_size")
    if any(size <= 0 for size in param.min_size):
        raise ShapeError("PriorBox needs every min_size positive")
    if param.max_size:
        if len(param.max_size) != len(param.min_size):
            raise ShapeError(f"PriorBox gives {len(param.max_size)} max_size for {len(param.min_size)} min_size")
        if any(high <= low for low, high in zip(param.min_size, param.max_size)):
            raise ShapeError("PriorBox needs each max_size greater than its min_size")
    if len(param.variance) not in (0, 1, 4):
        raise ShapeError(f"PriorBox takes 1 or 4 variances, got {len(param.variance)}")
    if any(v <= 0 for v in param.variance):
        raise ShapeError("PriorBox needs every variance positive")
    image = prior_image_size(param)
    prior_step(param)
    if image is None and len(bottoms) < 2:
        raise ShapeError("PriorBox needs the image as a second bottom, or img_size / img_h and img_w")
    for shape in bottoms[:2]:
        legacy(shape, 0)
    positions = legacy(bottoms[0], 2) * legacy(bottoms[0], 3)
    size = positions * prior_count(param) * 4
    if size <= 0:
        raise ShapeError(f"PriorBox places no box on a {fmt(bottoms[0])} input")
    return [(1, 2, size)], []


def detection_classes(param):
    """(num_classes, how many classes the locations are given for), Caffe's DetectionOutput's checks made."""
    if not param.HasField("num_classes"):
        raise ShapeError("DetectionOutput needs num_classes")
    if param.HasField("nms_param"):
        if param.nms_param.nms_threshold < 0:
            raise ShapeError("DetectionOutput needs nms_threshold non-negative")
        if not 0 < param.nms_param.eta <= 1:
            raise ShapeError(f"DetectionOutput needs 0 < eta <= 1, got {param.nms_param.eta}")
    if param.share_location and param.background_label_id == -1 and param.num_classes > 0:
        raise ShapeError("DetectionOutput with share_location and background_label_id -1 decodes no box for any "
                         "class (Caffe aborts)")
    return param.num_classes, 1 if param.share_location else param.num_classes


@layer_type("DetectionOutput", bottoms=3, no_backward=(0, 1, 2, 3))
def _detection_output(lp, bottoms, ctx):
    """Locations (N x priors * loc classes * 4), confidences (N x priors * classes) and the priors
    (1 x 2 x priors * 4) into 1 x 1 x K x 7 rows [item, label, score, xmin, ymin, xmax, ymax]: K is known only
    from the data, so the shape given here is Caffe's before its first forward pass (one row). No backward
    (Caffe's aborts)."""
    if not 3 <= len(bottoms) <= 4 or len(lp.top) != 1:
        raise ShapeError(f"DetectionOutput takes 3 or 4 bottoms and makes 1 top, got {len(bottoms)} and "
                         f"{len(lp.top)}")
    classes, loc_classes = detection_classes(lp.detection_output_param)
    loc, conf, priors = bottoms[:3]
    if legacy(loc, 0) != legacy(conf, 0):
        raise ShapeError(f"DetectionOutput's locations {fmt(loc)} and confidences {fmt(conf)} differ in items")
    num_priors = legacy(priors, 2) // 4
    if num_priors * loc_classes * 4 != legacy(loc, 1):
        raise ShapeError(f"DetectionOutput has {num_priors} priors ({fmt(priors)}): the locations need "
                         f"{num_priors * loc_classes * 4} channels, got {fmt(loc)}")
    if num_priors * classes != legacy(conf, 1):
        raise ShapeError(f"DetectionOutput has {num_priors} priors ({fmt(priors)}) and {classes} classes: the "
                         f"confidences need {num_priors * classes} channels, got {fmt(conf)}")
    if count(priors) < 2 * num_priors * 4:
        raise ShapeError(f"DetectionOutput's priors {fmt(priors)} hold no variances")
    return [(1, 1, 1, 7)], []


def multibox_check(lp):
    """MultiBoxLoss's LayerSetUp checks (a pycaffe abort each) as ShapeErrors: (num_classes, location classes)."""
    param = lp.multibox_loss_param
    if not param.HasField("num_classes") or param.num_classes < 1:
        raise ShapeError("MultiBoxLoss needs num_classes of at least 1")
    mining = param.mining_type != pb.MultiBoxLossParameter.NONE
    if param.HasField("do_neg_mining") and param.do_neg_mining != mining:
        raise ShapeError(f"MultiBoxLoss's deprecated do_neg_mining: {str(param.do_neg_mining).lower()} contradicts "
                         f"mining_type {pb.MultiBoxLossParameter.MiningType.Name(param.mining_type)}")
    if mining and not param.share_location:
        raise ShapeError("MultiBoxLoss mines negatives only with share_location: true")
    if param.mining_type == pb.MultiBoxLossParameter.HARD_EXAMPLE and param.sample_size <= 0:
        raise ShapeError("MultiBoxLoss's HARD_EXAMPLE mining needs sample_size larger than 0")
    if param.conf_loss_type == pb.MultiBoxLossParameter.SOFTMAX and param.background_label_id >= param.num_classes:
        raise ShapeError(f"MultiBoxLoss's background_label_id {param.background_label_id} is not one of its "
                         f"{param.num_classes} classes (Softmax needs it within)")
    if param.map_object_to_agnostic and param.num_classes != 2:
        raise ShapeError("MultiBoxLoss's map_object_to_agnostic needs num_classes 2 (background and object)")
    return param.num_classes, 1 if param.share_location else param.num_classes


@layer_type("MultiBoxLoss", loss=True, bottoms=4, no_backward=(2, 3), unforced=(1,))  # LossLayer's rule
def _multibox_loss(lp, bottoms, ctx):
    """Locations (N x priors * loc classes * 4), confidences (N x priors * classes), the priors
    (1 x 2 x priors * 4) and the ground truth (1 x 1 x G x 8 rows [item, label, instance, xmin, ymin, xmax,
    ymax, difficult]; as Caffe's, the first G rows of any N x C x G x 8 blob) into one loss. Only the
    locations and confidences take a diff (Caffe aborts on the others')."""
    if len(bottoms) != 4 or len(lp.top) != 1:
        raise ShapeError(f"MultiBoxLoss takes 4 bottoms and makes 1 top, got {len(bottoms)} and {len(lp.top)}")
    classes, loc_classes = multibox_check(lp)
    loc, conf, priors, truth = bottoms
    if legacy(loc, 0) != legacy(conf, 0):
        raise ShapeError(f"MultiBoxLoss's locations {fmt(loc)} and confidences {fmt(conf)} differ in items")
    num_priors = legacy(priors, 2) // 4
    if num_priors * loc_classes * 4 != legacy(loc, 1) or count(loc, 2) != 1:
        raise ShapeError(f"MultiBoxLoss has {num_priors} priors ({fmt(priors)}): the locations need "
                         f"{num_priors * loc_classes * 4} channels, got {fmt(loc)}")
    if num_priors * classes != legacy(conf, 1) or count(conf, 2) != 1:
        raise ShapeError(f"MultiBoxLoss has {num_priors} priors ({fmt(priors)}) and {classes} classes: the "
                         f"confidences need {num_priors * classes} channels, got {fmt(conf)}")
    if count(priors) < 2 * num_priors * 4:
        raise ShapeError(f"MultiBoxLoss's priors {fmt(priors)} hold no variances")
    if legacy(truth, 3) != 8:
        raise ShapeError(f"MultiBoxLoss reads its ground truth as rows of 8 values (N x C x G x 8, the first G "
                         f"rows read), got {fmt(truth)}")
    return [()], []


@layer_type("DetectionEvaluate", bottoms=2, no_backward=(0, 1))
def _detection_evaluate(lp, bottoms, ctx):
    """DetectionOutput's rows (1 x 1 x K x 7) against the ground truth (1 x 1 x G x 8) into 1 x 1 x
    (classes - 1 + K) x 5 rows: [-1, label, positives, -1, -1] per class, then [item, label, score, true
    positive, false positive] per detection (zeros after the last). K is known only from the data. No
    backward (Caffe's aborts)."""
    param = lp.detection_evaluate_param
    if len(bottoms) != 2 or len(lp.top) != 1:
        raise ShapeError(f"DetectionEvaluate takes 2 bottoms and makes 1 top, got {len(bottoms)} and {len(lp.top)}")
    if not param.HasField("num_classes") or param.background_label_id >= param.num_classes:
        raise ShapeError("DetectionEvaluate needs num_classes, with background_label_id one of them")
    if param.overlap_threshold <= 0:
        raise ShapeError(f"DetectionEvaluate needs overlap_threshold above 0, got {param.overlap_threshold:g}")
    if param.name_size_file:
        raise ShapeError("DetectionEvaluate's name_size_file (evaluating in pixels of each image of a listed DB) is "
                         "not supported: leave it out to evaluate in normalized coordinates")
    detections, truth = bottoms
    for shape, width, what in ((detections, 7, "detections"), (truth, 8, "ground truth")):
        if legacy(shape, 0) != 1 or legacy(shape, 1) != 1 or legacy(shape, 3) != width:
            raise ShapeError(f"DetectionEvaluate's {what} must be 1 x 1 x rows x {width}, got {fmt(shape)}")
    return [(1, 1, param.num_classes - 1 + legacy(detections, 2), 5)], []


def proposal_anchors(param):
    """The fork's generate_anchors: per ratio, then per scale, (x1, y1, x2, y2) about the base box's centre, in
    its float arithmetic (the half sizes 0.5 * round(w * scale / base_size - 1), the division in double)."""
    f = np.float32
    base = param.base_size
    centre = f(0.5) * (f(base) - f(1))
    anchors = []
    for ratio in np.array(param.ratio, f):
        width = f(np.sqrt(f(f(base * base) / ratio)))
        height = f(width * ratio)
        for scale in np.array(param.scale, f):
            half_w, half_h = (f(0.5) * int(float(f(side * scale)) / base - 1.0 + 0.5) for side in (width, height))
            anchors.append([centre - half_w, centre - half_h, centre + half_w, centre + half_h])
    return np.array(anchors, f).reshape(-1, 4)


@layer_type("Proposal", bottoms=3)
def _proposal(lp, bottoms, ctx):
    """Faster R-CNN's proposals from the scores (N x 2A x H x W, the second A channels the objects'), the box
    deltas (N x 4A x H x W) and the image's height and width (the first item's two first values): rows
    [item, x1, y1, x2, y2] and (a second top) their scores. How many each item keeps is known only from the data:
    the shapes given here are Caffe's before its first forward pass (post_nms_topn per item). Its Backward is
    empty: no diff reaches the inputs."""
    param = lp.proposal_param
    if len(bottoms) != 3 or not 1 <= len(lp.top) <= 2:
        raise ShapeError(f"Proposal takes 3 bottoms and makes 1 or 2 tops, got {len(bottoms)} and {len(lp.top)}")
    if not param.ratio or not param.scale:
        raise ShapeError("Proposal needs at least one ratio and one scale (the fork's Forward reads past no anchor)")
    scores, deltas, info = bottoms
    anchors = len(param.ratio) * len(param.scale)
    if len(scores) != 4 or tuple(deltas) != (scores[0], 4 * anchors) + tuple(scores[2:]) or scores[1] != 2 * anchors:
        raise ShapeError(f"Proposal with {anchors} anchors needs scores N x {2 * anchors} x H x W and deltas "
                         f"N x {4 * anchors} x H x W, got {fmt(scores)} and {fmt(deltas)}")
    if count(info) < 2:
        raise ShapeError(f"Proposal's image info {fmt(info)} needs the image's height and width")
    rows = scores[0] * param.post_nms_topn
    return [(rows, 5), (rows,)][:len(lp.top)], []
