"""Shape rules of the common layers: blob plumbing, inner products, normalisation, reductions, Python."""

from deepspark import pylayer
from deepspark.graph.registry import (ShapeError, canonical_axis, constant_filler, count, exactly, fmt, given_filler,
                                      layer_type, legacy, same, weight_and_bias)
from deepspark.proto import deepspark_pb2 as pb


layer_type("Softmax")(same)


@layer_type("Split")
def _split(lp, bottoms, ctx):
    return [bottoms[0]] * len(lp.top), []


@layer_type("Silence", tops=0)
def _silence(lp, bottoms, ctx):
    return [], []


@layer_type("BatchNorm", fillers=lambda lp: [constant_filler(0.0)] * 3, learned=False)
def _batch_norm(lp, bottoms, ctx):
    channels = bottoms[0][1] if len(bottoms[0]) > 1 else 1
    return [bottoms[0]], [(channels,), (channels,), (1,)]


def _kyle_fillers(lp):
    """BatchNorm's three statistics, then (use_alpha_beta) alpha 1 and beta 0: the fork sets them, reading no
    filler."""
    alpha_beta = [constant_filler(1.0), constant_filler(0.0)] if lp.batch_norm_param.use_alpha_beta else []
    return [constant_filler(0.0)] * 3 + alpha_beta


@layer_type("BatchNormKyle", fillers=_kyle_fillers)
def _batch_norm_kyle(lp, bottoms, ctx):
    """The fork's BatchNorm with a learned scale and shift (use_alpha_beta) after it. Unlike BatchNorm's, its
    statistics keep their ParamSpecs: the solver decays them by weight_decay, as pycaffe's does."""
    tops, blobs = _batch_norm(lp, bottoms, ctx)
    return tops, blobs + blobs[:1] * 2 * lp.batch_norm_param.use_alpha_beta


def _broadcast_shape(lp, bottoms, param, what):
    """The shape of a Scale/Bias operand: bottom[1]'s, or the learned blob's."""
    shape = bottoms[0]
    if len(bottoms) > 1:
        operand = bottoms[1]
        axis = 0 if not operand else canonical_axis(param.axis, len(shape))
        if tuple(shape[axis:axis + len(operand)]) != tuple(operand):
            raise ShapeError(f"{what} operand {fmt(operand)} does not match input {fmt(shape)} at axis {axis}")
        return tuple(operand), False
    if param.num_axes < -1:
        raise ShapeError(f"{what} num_axes must be -1 or non-negative")
    axis = canonical_axis(param.axis, len(shape)) if len(shape) else 0
    end = len(shape) if param.num_axes == -1 else axis + param.num_axes
    if end > len(shape):
        raise ShapeError(f"{what} axis {param.axis} + num_axes {param.num_axes} exceeds input {fmt(shape)}")
    return tuple(shape[axis:end]), True


def _scale_fillers(lp):
    """The learned scale (when bottom[1] does not give it), then the bias (with bias_term)."""
    param = lp.scale_param
    learned = [given_filler(param, "filler", constant_filler(1.0))] if len(lp.bottom) == 1 else []
    return learned + [param.bias_filler] * param.bias_term


@layer_type("Scale", fillers=_scale_fillers)
def _scale(lp, bottoms, ctx):
    operand, learned = _broadcast_shape(lp, bottoms, lp.scale_param, "Scale")
    params = [operand] if learned else []
    if lp.scale_param.bias_term:
        params.append(operand)
    return [bottoms[0]], params


@layer_type("Bias", fillers=lambda lp: [lp.bias_param.filler] if len(lp.bottom) == 1 else [])
def _bias(lp, bottoms, ctx):
    operand, learned = _broadcast_shape(lp, bottoms, lp.bias_param, "Bias")
    return [bottoms[0]], [operand] if learned else []


@layer_type("Eltwise")
def _eltwise(lp, bottoms, ctx):
    for shape in bottoms[1:]:
        if shape != bottoms[0]:
            raise ShapeError(f"Eltwise inputs differ in shape: {', '.join(fmt(s) for s in bottoms)}")
    param = lp.eltwise_param
    if param.coeff and (param.operation != pb.EltwiseParameter.SUM or len(param.coeff) != len(bottoms)):
        raise ShapeError("Eltwise coeff is for SUM only, one per input")
    return [bottoms[0]], []


@layer_type("Concat")
def _concat(lp, bottoms, ctx):
    param = lp.concat_param
    axis = param.concat_dim if param.HasField("concat_dim") else param.axis
    axis = canonical_axis(axis, len(bottoms[0]))
    total = 0
    for shape in bottoms:
        if len(shape) != len(bottoms[0]) or any(
                a != b for i, (a, b) in enumerate(zip(shape, bottoms[0])) if i != axis):
            raise ShapeError(f"Concat inputs must match except on axis {axis}: "
                             f"{', '.join(fmt(s) for s in bottoms)}")
        total += shape[axis]
    top = list(bottoms[0])
    top[axis] = total
    return [tuple(top)], []


@layer_type("Slice")
def _slice(lp, bottoms, ctx):
    param = lp.slice_param
    axis = param.slice_dim if param.HasField("slice_dim") else param.axis
    shape = bottoms[0]
    axis = canonical_axis(axis, len(shape))
    points = list(param.slice_point)
    tops = len(lp.top)
    if points:
        if len(points) != tops - 1:
            raise ShapeError(f"Slice needs {tops - 1} slice_point values for {tops} tops")
        bounds = [0] + points + [shape[axis]]
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ShapeError(f"slice points {points} do not split axis {axis} of size {shape[axis]}")
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    else:
        if shape[axis] % tops:
            raise ShapeError(f"axis {axis} of size {shape[axis]} does not split into {tops} equal parts")
        sizes = [shape[axis] // tops] * tops
    return [shape[:axis] + (size,) + shape[axis + 1:] for size in sizes], []


@layer_type("Flatten")
def _flatten(lp, bottoms, ctx):
    shape = bottoms[0]
    start = canonical_axis(lp.flatten_param.axis, len(shape))
    end = canonical_axis(lp.flatten_param.end_axis, len(shape))
    return [shape[:start] + (count(shape, start, end + 1),) + shape[end + 1:]], []


@layer_type("Unsqueeze")
def _unsqueeze(lp, bottoms, ctx):
    """The fork's Unsqueeze: a 1 inserted at `dim` (negative from the end, -1 after the last axis); its
    Backward is empty."""
    shape, param = bottoms[0], lp.unsqueeze_param
    if not param.HasField("dim"):
        raise ShapeError("Unsqueeze needs unsqueeze_param.dim (Caffe aborts)")
    index = param.dim + len(shape) + 1 if param.dim < 0 else param.dim
    if not 0 <= index <= len(shape):
        raise ShapeError(f"Unsqueeze dim {param.dim} is out of range for {fmt(shape)}")
    return [shape[:index] + (1,) + shape[index:]], []


@layer_type("Reshape")
def _reshape(lp, bottoms, ctx):
    shape, param = bottoms[0], lp.reshape_param
    start = param.axis if param.axis >= 0 else len(shape) + param.axis + 1
    if not 0 <= start <= len(shape):
        raise ShapeError(f"Reshape axis {param.axis} is out of range for {fmt(shape)}")
    end = len(shape) if param.num_axes == -1 else start + param.num_axes
    if param.num_axes < -1 or end > len(shape):
        raise ShapeError(f"Reshape num_axes {param.num_axes} is out of range for {fmt(shape)}")
    dims = list(param.shape.dim)
    if dims.count(-1) > 1:
        raise ShapeError("Reshape allows at most one -1 dimension")
    new = []
    for i, dim in enumerate(dims):
        if dim == 0:
            if start + i >= len(shape):
                raise ShapeError(f"Reshape dim {i} is 0 but the input has no axis {start + i}")
            dim = shape[start + i]
        elif dim < -1:
            raise ShapeError(f"Reshape dim {dim} is invalid")
        new.append(dim)
    top = list(shape[:start]) + new + list(shape[end:])
    if -1 in top:
        known = count([d for d in top if d != -1])
        if known == 0 or count(shape) % known:
            raise ShapeError(f"cannot reshape {fmt(shape)} into {fmt(top)}")
        top[top.index(-1)] = count(shape) // known
    if count(top) != count(shape):
        raise ShapeError(f"Reshape changes the element count: {fmt(shape)} to {fmt(top)}")
    return [tuple(top)], []


@layer_type("InnerProduct", fillers=lambda lp: weight_and_bias(lp.inner_product_param))
def _inner_product(lp, bottoms, ctx):
    param, shape = lp.inner_product_param, bottoms[0]
    if not param.num_output:
        raise ShapeError("InnerProduct needs num_output")
    axis = canonical_axis(param.axis, len(shape))
    k, n = count(shape, axis), param.num_output
    params = [(k, n) if param.transpose else (n, k)]
    if param.bias_term:
        params.append((n,))
    return [shape[:axis] + (n,)], params


@layer_type("ArgMax", no_backward=(0,))
def _argmax(lp, bottoms, ctx):
    shape, param = bottoms[0], lp.argmax_param
    if param.HasField("axis"):
        axis = canonical_axis(param.axis, len(shape))
        if param.top_k > shape[axis]:
            raise ShapeError(f"top_k {param.top_k} exceeds axis {axis} of size {shape[axis]}")
        top = list(shape)
        top[axis] = param.top_k
    else:
        if param.top_k > count(shape, 1):
            raise ShapeError(f"top_k {param.top_k} exceeds the {count(shape, 1)} values per item")
        top = [1] * max(len(shape), 3)
        top[0], top[2] = shape[0], param.top_k
        top[1] = 2 if param.out_max_val else 1
    return [tuple(top)], []


@layer_type("Embed", fillers=lambda lp: weight_and_bias(lp.embed_param), no_backward=(0,))
def _embed(lp, bottoms, ctx):
    exactly(lp, bottoms, 1, 1)
    param = lp.embed_param
    if not param.num_output or not param.input_dim:
        raise ShapeError("Embed needs num_output and input_dim")
    params = [(param.input_dim, param.num_output)] + [(param.num_output,)] * param.bias_term
    return [bottoms[0] + (param.num_output,)], params


@layer_type("Reduction")
def _reduction(lp, bottoms, ctx):
    exactly(lp, bottoms, 1, 1)
    return [bottoms[0][:canonical_axis(lp.reduction_param.axis, len(bottoms[0]))]], []


@layer_type("MVN")
def _mvn(lp, bottoms, ctx):
    exactly(lp, bottoms, 1, 1)
    legacy(bottoms[0], 0)
    return [bottoms[0]], []


@layer_type("Tile")
def _tile(lp, bottoms, ctx):
    exactly(lp, bottoms, 1, 1)
    param, top = lp.tile_param, list(bottoms[0])
    if not param.HasField("tiles") or param.tiles <= 0:
        raise ShapeError("Tile needs a positive tile_param.tiles")
    axis = canonical_axis(param.axis, len(top))
    top[axis] *= param.tiles
    return [tuple(top)], []


@layer_type("Filter", bottoms=2, no_backward=(-1,))
def _filter(lp, bottoms, ctx):
    """The tops' first axis holds the selected items, as many as the selector's non-zeros: known only from
    the data, so the shapes given here are Caffe's before its first forward pass (every item)."""
    *blobs, selector = bottoms
    if len(lp.top) != len(blobs):
        raise ShapeError(f"Filter makes one top per bottom before the selector ({len(blobs)}), got {len(lp.top)}")
    if any(d != 1 for d in selector[1:]) or any(shape[:1] != selector[:1] for shape in blobs):
        raise ShapeError(f"Filter's selector must be N x 1 x ... for inputs of N items, got {fmt(selector)} for "
                         f"{', '.join(fmt(s) for s in blobs)}")
    return blobs, []


@layer_type("BatchReindex", bottoms=2, no_backward=(1,))
def _batch_reindex(lp, bottoms, ctx):
    exactly(lp, bottoms, 2, 1)
    if len(bottoms[1]) != 1:
        raise ShapeError(f"BatchReindex's indices must be one axis, got {fmt(bottoms[1])}")
    return [bottoms[1] + bottoms[0][1:]], []


@layer_type("Parameter", fillers=lambda lp: [constant_filler(0.0)], bottoms=0)
def _parameter(lp, bottoms, ctx):
    exactly(lp, bottoms, 0, 1)
    shape = tuple(lp.parameter_param.shape.dim)
    return [shape], [shape]


# A Python layer: the user's module, set up on zero arrays of its bottoms' shapes (pylayer.Runner).

_python_shapes = {}  # (layer, bottom shapes, folder, phase) -> its top shapes: setup runs once per process


@layer_type("Python", bottoms=0, tops=0)
def _python(lp, bottoms, ctx):
    key = (lp.SerializeToString(), tuple(bottoms), ctx.folder, ctx.phase)
    if key not in _python_shapes:
        try:
            _python_shapes[key] = pylayer.Runner(lp, bottoms, ctx.folder, ctx.phase).top_shapes
        except pylayer.PythonLayerError as error:
            raise ShapeError(str(error)) from None
    return list(_python_shapes[key]), []
