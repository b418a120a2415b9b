"""Shape rules of the loss layers and Accuracy."""

from deepspark.graph.registry import ShapeError, canonical_axis, count, exactly, fmt, layer_type, legacy, one_per_item


def _loss(lp, bottoms, ctx):
    return [()] + [bottoms[0]] * (len(lp.top) - 1), []


@layer_type("SoftmaxWithLoss", loss=True, labelled=True, no_backward=(1,), unforced=(1,))
def _softmax_loss(lp, bottoms, ctx):
    shape = bottoms[0]
    axis = canonical_axis(lp.softmax_param.axis, len(shape))
    if len(bottoms) < 2 or count(shape[:axis]) * count(shape, axis + 1) != count(bottoms[1]):
        raise ShapeError(f"SoftmaxWithLoss needs one label per prediction: predictions {fmt(shape)}, "
                         f"labels {fmt(bottoms[1]) if len(bottoms) > 1 else 'missing'}")
    return _loss(lp, bottoms, ctx)


@layer_type("SigmoidCrossEntropyLoss", loss=True, labelled=True, no_backward=(1,), unforced=(1,))
@layer_type("EuclideanLoss", loss=True, unforced=(1,))
def _pairwise_loss(lp, bottoms, ctx):
    if len(bottoms) != 2 or count(bottoms[0]) != count(bottoms[1]):
        raise ShapeError(f"{lp.type} needs two inputs of the same size, got "
                         f"{', '.join(fmt(s) for s in bottoms)}")
    return _loss(lp, bottoms, ctx)


@layer_type("Accuracy", labelled=True, no_backward=(0, 1))
def _accuracy(lp, bottoms, ctx):
    shape = bottoms[0]
    axis = canonical_axis(lp.accuracy_param.axis, len(shape))
    if lp.accuracy_param.top_k > shape[axis]:
        raise ShapeError(f"top_k {lp.accuracy_param.top_k} exceeds the {shape[axis]} classes")
    if len(bottoms) < 2 or count(shape[:axis]) * count(shape, axis + 1) != count(bottoms[1]):
        raise ShapeError("Accuracy needs one label per prediction")
    return [()] + [(shape[axis],)] * (len(lp.top) - 1), []


@layer_type("ContrastiveLoss", loss=True, bottoms=3, unforced=(2,))
def _contrastive_loss(lp, bottoms, ctx):
    exactly(lp, bottoms, 3, 1)
    a, b, similar = bottoms
    if (legacy(a, 1) != legacy(b, 1) or any(legacy(s, axis) != 1 for s in (a, b) for axis in (2, 3))
            or count(b) < count(a)):
        raise ShapeError(f"ContrastiveLoss needs two N x C feature blobs, got {fmt(a)} and {fmt(b)}")
    one_per_item(a, similar, "similarity label")
    return [()], []


@layer_type("InfogainLoss", loss=True, labelled=True, bottoms=2, no_backward=(1, 2), unforced=(1,))
def _infogain_loss(lp, bottoms, ctx):
    if len(bottoms) not in (2, 3) or len(lp.top) != 1:
        raise ShapeError("InfogainLoss takes 2 or 3 bottoms (predictions, labels, the infogain matrix) and 1 top")
    shape = bottoms[0]
    one_per_item(shape, bottoms[1], "label")
    dim = count(shape, 1)
    if len(bottoms) == 3 and tuple(legacy(bottoms[2], axis) for axis in range(4)) != (1, 1, dim, dim):
        raise ShapeError(f"the infogain matrix must be 1x1x{dim}x{dim} for {fmt(shape)}, got {fmt(bottoms[2])}")
    if len(bottoms) == 2 and not lp.infogain_loss_param.source:
        raise ShapeError("InfogainLoss needs infogain_loss_param.source, or the matrix as a third bottom")
    return [()], []


@layer_type("HingeLoss", loss=True, labelled=True, bottoms=2, no_backward=(1,), unforced=(1,))
@layer_type("MultinomialLogisticLoss", loss=True, labelled=True, bottoms=2, no_backward=(1,), unforced=(1,))
def _class_loss(lp, bottoms, ctx):
    exactly(lp, bottoms, 2, 1)
    if bottoms[0][:1] != bottoms[1][:1] or (lp.type == "MultinomialLogisticLoss" and count(bottoms[1], 1) != 1):
        raise ShapeError(f"{lp.type} needs one label per item: input {fmt(bottoms[0])}, labels {fmt(bottoms[1])}")
    return [()], []


@layer_type("SmoothL1Loss", loss=True, bottoms=2)
def _smooth_l1_loss(lp, bottoms, ctx):
    """The fork's (Fast R-CNN's) SmoothL1Loss: predictions and targets of one legacy shape past the first axis,
    the same first axis; one loss top. Its third bottom (weights) is refused: LossLayer's ExactNumBottomBlobs
    (2) makes this pycaffe abort on it."""
    if len(bottoms) == 3:
        raise ShapeError("SmoothL1Loss's weights (a third bottom) abort this pycaffe (its LossLayer takes exactly "
                         "2 bottoms)")
    exactly(lp, bottoms, 2, 1)
    shape = bottoms[0]
    if shape[:1] != bottoms[1][:1]:
        raise ShapeError(f"SmoothL1Loss's predictions {fmt(shape)} and targets {fmt(bottoms[1])} differ in "
                         "their first axis")
    if any(legacy(bottoms[1], axis) != legacy(shape, axis) for axis in (1, 2, 3)):
        raise ShapeError(f"SmoothL1Loss's inputs differ in shape: {fmt(shape)}, {fmt(bottoms[1])}")
    return [()], []
