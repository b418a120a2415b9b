"""The layer registry (one row per type: shapes, blobs, fillers, flags) and the net as a DAG for one phase."""

import copy
import math
from dataclasses import dataclass, field

from deepspark import pylayer
from deepspark.errors import SourceMap
from deepspark.proto import deepspark_pb2 as pb
from deepspark.upgrade import input_layer, upgrade_input


class ShapeError(ValueError):
    """A shape that cannot exist; the graph names the layer."""


# ---------------------------------------------------------------------------
# The layer registry: one row per layer type, as Caffe keeps one class per type.
# Backends keep their own table of what each type computes (backends/*/layers.py),
# each checked against this one when it is imported (check_table).


AUTOMATIC = "(automatic)"  # Caffe's name for a top the prototxt does not name (Net::AppendTop)


def _no_blobs(lp):
    return []


@dataclass(frozen=True)
class LayerSpec:
    """One layer type: its shapes, its parameter blobs and their fillers, and what kind of layer it is.

    shapes(lp, bottom shapes, BuildContext) -> (top shapes, parameter blob shapes
    in Caffe's order). fillers(lp) -> the FillerParameter of each parameter blob
    the layer has, with Caffe's default where the prototxt gives none; how many
    there are is the blob count when the input shape is unknown.
    loss: its first top is a loss (default loss_weight 1); data: a data layer,
    with no bottoms; fed: its tops come from a batch (DummyData makes its own);
    labelled: its second bottom is a label; learned: False where the blobs are
    statistics that Caffe keeps out of the solver (BatchNorm).
    bottoms: how many bottoms it needs at least (a data layer none).
    tops: how many tops it needs at least (Caffe's MinTopBlobs/ExactNumTopBlobs); a loss layer given none
    gets Caffe's automatic one.
    no_backward: the bottoms (by position; negative from the last) Caffe's
    Backward refuses a diff for, with a glog abort: labels, indices, sequence
    markers, a Threshold's input. TensorFlow gives them none either.
    unforced: the bottoms force_backward leaves alone (Caffe's AllowForceBackward).
    """

    type: str
    shapes: object
    fillers: object = _no_blobs
    loss: bool = False
    data: bool = False
    fed: bool = False
    labelled: bool = False
    learned: bool = True
    bottoms: int = 1
    tops: int = 1
    no_backward: tuple = ()
    unforced: tuple = ()

    def blob_count(self, lp):
        """How many parameter blobs a layer of this type has, known before its shapes are."""
        return len(self.fillers(lp))

    @property
    def min_bottoms(self):
        return 0 if self.data else self.bottoms

    def refused(self, bottoms):
        """The positions among `bottoms` (a count) that take no diff in Caffe's Backward."""
        return _positions(self.no_backward, bottoms)

    def forced(self, bottoms):
        """The positions among `bottoms` (a count) that force_backward gives a diff."""
        return [b for b in range(bottoms) if b not in _positions(self.unforced, bottoms)]


def _positions(indices, count):
    """Positions `indices` (negative: from the last) among `count` bottoms, those that exist."""
    return {i % count for i in indices if -count <= i < count}


REGISTRY = {}  # layer type -> LayerSpec


def layer_type(*types, **row):
    """Register a shape function as the row of each of `types`, with the rest of the row in `row`."""
    def register(function):
        for kind in types:
            REGISTRY[kind] = LayerSpec(kind, function, **row)
        return function
    return register


def spec(kind):
    """The registry row of layer type `kind`."""
    return REGISTRY[kind]


def supported_types():
    return sorted(REGISTRY)


def check_table(table, backend):
    """Raise a RuntimeError naming the types if a backend's layer table and the registry differ.

    Each backend's layers.py calls it as it is imported, so that a type added
    to one place and not the other fails at once, not when a net first uses it.
    """
    missing, extra = sorted(set(REGISTRY) - set(table)), sorted(set(table) - set(REGISTRY))
    problems = []
    if missing:
        problems.append(f"registered in graph.py but missing from the {backend} table: {', '.join(missing)}")
    if extra:
        problems.append(f"in the {backend} table but not registered in graph.py: {', '.join(extra)}")
    if problems:
        raise RuntimeError(f"the {backend} layer table and graph.REGISTRY differ: {'; '.join(problems)}")


def _constant_filler(value):
    return pb.FillerParameter(type="constant", value=value)


def _given_filler(param, name, default):
    """param's filler `name`, or Caffe's default for it when the prototxt gives none."""
    return getattr(param, name) if param.HasField(name) else default


def _weight_and_bias(param):
    return [param.weight_filler] + [param.bias_filler] * param.bias_term


def canonical_axis(axis, num_axes, what="axis"):
    if not -num_axes <= axis < num_axes:
        raise ShapeError(f"{what} {axis} is out of range for a {num_axes}-axis blob")
    return axis % num_axes


def count(shape, start=0, end=None):
    return math.prod(shape[start:end])


def fmt(shape):
    if shape is None:
        return "?"
    return "x".join(str(d) for d in shape) if shape else "scalar"


def _same(lp, bottoms, ctx):
    return [bottoms[0]] * max(len(lp.top), 1), []


layer_type("ReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "Exp", "Log", "BNLL", "Dropout",
           "Softmax")(_same)


@layer_type("Split")
def _split(lp, bottoms, ctx):
    return [bottoms[0]] * len(lp.top), []


@layer_type("Silence", tops=0)
def _silence(lp, bottoms, ctx):
    return [], []


@layer_type("LRN")
def _lrn(lp, bottoms, ctx):
    if len(bottoms[0]) != 4:
        raise ShapeError(f"LRN needs a 4-axis input, got {fmt(bottoms[0])}")
    if lp.lrn_param.local_size % 2 == 0:
        raise ShapeError("LRN local_size must be odd")
    return [bottoms[0]], []


@layer_type("PReLU", fillers=lambda lp: [_given_filler(lp.prelu_param, "filler", _constant_filler(0.25))])
def _prelu(lp, bottoms, ctx):
    if len(bottoms[0]) < 2:
        raise ShapeError("PReLU needs an input with a channel axis")
    slopes = () if lp.prelu_param.channel_shared else (bottoms[0][1],)
    return [bottoms[0]], [slopes]


@layer_type("BatchNorm", fillers=lambda lp: [_constant_filler(0.0)] * 3, learned=False)
def _batch_norm(lp, bottoms, ctx):
    channels = bottoms[0][1] if len(bottoms[0]) > 1 else 1
    return [bottoms[0]], [(channels,), (channels,), (1,)]


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
    learned = [_given_filler(param, "filler", _constant_filler(1.0))] if len(lp.bottom) == 1 else []
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


@layer_type("InnerProduct", fillers=lambda lp: _weight_and_bias(lp.inner_product_param))
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


def _per_axis(repeated, h, w, has_hw, default, spatial, what):
    """Caffe's rule for kernel/pad/stride: the _h/_w pair (2D), else one value or one per axis."""
    if has_hw:
        if spatial != 2:
            raise ShapeError(f"{what}_h/{what}_w are for 2D only")
        return [h, w]
    values = list(repeated)
    if not values:
        if default is None:
            raise ShapeError(f"{what} is required")
        return [default] * spatial
    if len(values) == 1:
        return values * spatial
    if len(values) != spatial:
        raise ShapeError(f"{what} needs 1 or {spatial} values, got {len(values)}")
    return values


def conv_geometry(param, spatial):
    """kernel, pad, stride, dilation lists of a ConvolutionParameter (Caffe's defaults)."""
    kernel = _per_axis(param.kernel_size, param.kernel_h, param.kernel_w,
                       param.HasField("kernel_h") or param.HasField("kernel_w"), None, spatial, "kernel_size")
    pad = _per_axis(param.pad, param.pad_h, param.pad_w,
                    param.HasField("pad_h") or param.HasField("pad_w"), 0, spatial, "pad")
    stride = _per_axis(param.stride, param.stride_h, param.stride_w,
                       param.HasField("stride_h") or param.HasField("stride_w"), 1, spatial, "stride")
    dilation = _per_axis(param.dilation, 0, 0, False, 1, spatial, "dilation")
    if any(k <= 0 for k in kernel) or any(s <= 0 for s in stride) or any(d <= 0 for d in dilation):
        raise ShapeError("kernel, stride and dilation must be positive")
    return kernel, pad, stride, dilation


def _conv_output(lp, shape):
    """(channel axis, kernel, output size of each spatial axis) of a Convolution, Deconvolution or Im2col layer."""
    param = lp.convolution_param
    axis = canonical_axis(param.axis, len(shape))
    spatial = len(shape) - axis - 1
    if spatial < 1:
        raise ShapeError(f"{lp.type} needs spatial axes after axis {axis}, got {fmt(shape)}")
    kernel, pad, stride, dilation = conv_geometry(param, spatial)
    out = []
    for size, k, p, s, d in zip(shape[axis + 1:], kernel, pad, stride, dilation):
        extent = d * (k - 1) + 1
        if lp.type == "Deconvolution":
            o = s * (size - 1) + extent - 2 * p
        else:
            if size + 2 * p < extent:
                raise ShapeError(f"kernel extent {extent} is larger than the padded input "
                                 f"{size}+2*{p} of {fmt(shape)}")
            o = (size + 2 * p - extent) // s + 1
        if o <= 0:
            raise ShapeError(f"output size {o} from input {fmt(shape)} is not positive")
        out.append(o)
    return axis, kernel, out


@layer_type("Convolution", "Deconvolution", fillers=lambda lp: _weight_and_bias(lp.convolution_param))
def _convolution(lp, bottoms, ctx):
    """One top per bottom, all through the same blobs (Caffe's BaseConvolutionLayer: EqualNumBottomTopBlobs,
    every bottom of bottom[0]'s shape)."""
    param, shape = lp.convolution_param, bottoms[0]
    if len(lp.top) != len(bottoms):
        raise ShapeError(f"{lp.type} makes one top per bottom: {len(bottoms)} bottom{'s' * (len(bottoms) != 1)}, "
                         f"{len(lp.top)} top{'s' * (len(lp.top) != 1)}")
    for other in bottoms[1:]:
        if other != shape:
            raise ShapeError(f"{lp.type}'s bottoms must all have one shape (they share its blobs), got "
                             f"{', '.join(fmt(s) for s in bottoms)}")
    axis, kernel, out = _conv_output(lp, shape)
    channels, outputs, group = shape[axis], param.num_output, param.group
    if not outputs:
        raise ShapeError(f"{lp.type} needs num_output")
    if group < 1 or channels % group or outputs % group:
        raise ShapeError(f"group {group} must divide both input channels {channels} and num_output {outputs}")
    if lp.type == "Deconvolution":
        weights = (channels, outputs // group) + tuple(kernel)
    else:
        weights = (outputs, channels // group) + tuple(kernel)
    params = [weights] + ([(outputs,)] if param.bias_term else [])
    return [shape[:axis] + (outputs,) + tuple(out)] * len(bottoms), params


def pool_geometry(param, height, width):
    """kernel, pad, stride (each as (h, w)) of a PoolingParameter, as Caffe's PoolingLayer sets them up."""
    if param.global_pooling:
        if param.HasField("kernel_size") or param.HasField("kernel_h") or param.HasField("kernel_w"):
            raise ShapeError("global_pooling takes no kernel size")
        kernel = (height, width)
    elif param.HasField("kernel_size") and not (param.HasField("kernel_h") or param.HasField("kernel_w")):
        kernel = (param.kernel_size, param.kernel_size)
    elif param.HasField("kernel_h") and param.HasField("kernel_w") and not param.HasField("kernel_size"):
        kernel = (param.kernel_h, param.kernel_w)
    else:
        raise ShapeError("Pooling needs kernel_size, or kernel_h and kernel_w (not both)")
    pad = (param.pad_h, param.pad_w) if param.HasField("pad_h") or param.HasField("pad_w") else (param.pad,) * 2
    if param.HasField("stride_h") or param.HasField("stride_w"):
        stride = (param.stride_h, param.stride_w)
    else:
        stride = (param.stride,) * 2
    if param.global_pooling and (any(pad) or any(s != 1 for s in stride)):
        raise ShapeError("global_pooling needs pad 0 and stride 1")
    if min(kernel) <= 0 or min(stride) <= 0:
        raise ShapeError("Pooling kernel and stride must be positive")
    if any(pad) and param.pool not in (pb.PoolingParameter.MAX, pb.PoolingParameter.AVE):
        raise ShapeError("padding is implemented for MAX and AVE pooling only")
    if pad[0] >= kernel[0] or pad[1] >= kernel[1]:
        raise ShapeError(f"pad {pad} must be smaller than the kernel {kernel}")
    return kernel, pad, stride


def pooled_size(size, kernel, pad, stride, ceil_mode=True):
    """Caffe's pooled output size: ceil, then clipped so the last window starts inside the input."""
    if size + 2 * pad < kernel:
        raise ShapeError(f"kernel {kernel} is larger than the padded input {size}+2*{pad}")
    span = size + 2 * pad - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@layer_type("Pooling")
def _pooling(lp, bottoms, ctx):
    shape, param = bottoms[0], lp.pooling_param
    if len(shape) != 4:
        raise ShapeError(f"Pooling needs a 4-axis input, got {fmt(shape)}")
    kernel, pad, stride = pool_geometry(param, shape[2], shape[3])
    out = [pooled_size(shape[2 + i], kernel[i], pad[i], stride[i], param.ceil_mode) for i in range(2)]
    tops = [shape[:2] + tuple(out)] * max(len(lp.top), 1)
    return tops, []


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


# ---------------------------------------------------------------------------
# The rest of BVLC Caffe's compute layers (Clip and Swish: BVLC's later additions)

def _exactly(lp, bottoms, count, tops=None):
    """A ShapeError unless the layer has `count` bottoms (and `tops` tops), as Caffe's CHECKs demand."""
    if len(bottoms) != count:
        raise ShapeError(f"{lp.type} takes {count} bottoms, got {len(bottoms)}")
    if tops is not None and len(lp.top) != tops:
        raise ShapeError(f"{lp.type} makes {tops} top{'s' * (tops != 1)}, got {len(lp.top)}")


def legacy(shape, axis):
    """Caffe's LegacyShape: axis `axis` of a blob of at most 4 axes, 1 past its last (num, channels, height, width)."""
    if len(shape) > 4:
        raise ShapeError(f"a {len(shape)}-axis blob {fmt(shape)} where Caffe reads num/channels/height/width")
    return shape[axis] if axis < len(shape) else 1


def _one_per_item(shape, labels, what):
    """A ShapeError unless `labels` holds one value per item of `shape` (N x 1 x 1 x 1)."""
    if any(legacy(labels, axis) != 1 for axis in (1, 2, 3)) or labels[:1] != shape[:1]:
        raise ShapeError(f"{what} needs one per item: input {fmt(shape)}, {what} {fmt(labels)}")


layer_type("Threshold", no_backward=(0,))(_same)
layer_type("Clip", "Swish")(_same)


def crop_offsets(param, rank):
    """Caffe's Crop offset of every axis of a `rank`-axis input: 0 before crop_param.axis, then the offsets."""
    axis = canonical_axis(param.axis, rank)
    offsets = list(param.offset)
    if len(offsets) > 1 and axis + len(offsets) != rank:
        raise ShapeError(f"Crop gives {len(offsets)} offsets for the {rank - axis} axes from axis {axis}")
    return [0] * axis + [offsets[0] if len(offsets) == 1 else offsets[i] if offsets else 0
                         for i in range(rank - axis)]


@layer_type("Crop", bottoms=2)
def _crop(lp, bottoms, ctx):
    _exactly(lp, bottoms, 2, 1)
    shape, reference = bottoms
    offsets = crop_offsets(lp.crop_param, len(shape))
    axis = canonical_axis(lp.crop_param.axis, len(shape))
    if len(reference) < len(shape):
        raise ShapeError(f"Crop's reference {fmt(reference)} has fewer axes than its input {fmt(shape)}")
    top = list(shape)
    for i in range(axis, len(shape)):
        if shape[i] - offsets[i] < reference[i]:
            raise ShapeError(f"the crop of axis {i} to {reference[i]} at offset {offsets[i]} is out of bounds "
                             f"of {fmt(shape)}")
        top[i] = reference[i]
    return [tuple(top)], []


@layer_type("ContrastiveLoss", loss=True, bottoms=3, unforced=(2,))
def _contrastive_loss(lp, bottoms, ctx):
    _exactly(lp, bottoms, 3, 1)
    a, b, similar = bottoms
    if (legacy(a, 1) != legacy(b, 1) or any(legacy(s, axis) != 1 for s in (a, b) for axis in (2, 3))
            or count(b) < count(a)):
        raise ShapeError(f"ContrastiveLoss needs two N x C feature blobs, got {fmt(a)} and {fmt(b)}")
    _one_per_item(a, similar, "similarity label")
    return [()], []


@layer_type("InfogainLoss", loss=True, labelled=True, bottoms=2, no_backward=(1, 2), unforced=(1,))
def _infogain_loss(lp, bottoms, ctx):
    if len(bottoms) not in (2, 3) or len(lp.top) != 1:
        raise ShapeError("InfogainLoss takes 2 or 3 bottoms (predictions, labels, the infogain matrix) and 1 top")
    shape = bottoms[0]
    _one_per_item(shape, bottoms[1], "label")
    dim = count(shape, 1)
    if len(bottoms) == 3 and tuple(legacy(bottoms[2], axis) for axis in range(4)) != (1, 1, dim, dim):
        raise ShapeError(f"the infogain matrix must be 1x1x{dim}x{dim} for {fmt(shape)}, got {fmt(bottoms[2])}")
    if len(bottoms) == 2 and not lp.infogain_loss_param.source:
        raise ShapeError("InfogainLoss needs infogain_loss_param.source, or the matrix as a third bottom")
    return [()], []


@layer_type("HingeLoss", loss=True, labelled=True, bottoms=2, no_backward=(1,), unforced=(1,))
@layer_type("MultinomialLogisticLoss", loss=True, labelled=True, bottoms=2, no_backward=(1,), unforced=(1,))
def _class_loss(lp, bottoms, ctx):
    _exactly(lp, bottoms, 2, 1)
    if bottoms[0][:1] != bottoms[1][:1] or (lp.type == "MultinomialLogisticLoss" and count(bottoms[1], 1) != 1):
        raise ShapeError(f"{lp.type} needs one label per item: input {fmt(bottoms[0])}, labels {fmt(bottoms[1])}")
    return [()], []


@layer_type("Embed", fillers=lambda lp: _weight_and_bias(lp.embed_param), no_backward=(0,))
def _embed(lp, bottoms, ctx):
    _exactly(lp, bottoms, 1, 1)
    param = lp.embed_param
    if not param.num_output or not param.input_dim:
        raise ShapeError("Embed needs num_output and input_dim")
    params = [(param.input_dim, param.num_output)] + [(param.num_output,)] * param.bias_term
    return [bottoms[0] + (param.num_output,)], params


@layer_type("Reduction")
def _reduction(lp, bottoms, ctx):
    _exactly(lp, bottoms, 1, 1)
    return [bottoms[0][:canonical_axis(lp.reduction_param.axis, len(bottoms[0]))]], []


@layer_type("MVN")
def _mvn(lp, bottoms, ctx):
    _exactly(lp, bottoms, 1, 1)
    legacy(bottoms[0], 0)
    return [bottoms[0]], []


@layer_type("Tile")
def _tile(lp, bottoms, ctx):
    _exactly(lp, bottoms, 1, 1)
    param, top = lp.tile_param, list(bottoms[0])
    if not param.HasField("tiles") or param.tiles <= 0:
        raise ShapeError("Tile needs a positive tile_param.tiles")
    axis = canonical_axis(param.axis, len(top))
    top[axis] *= param.tiles
    return [tuple(top)], []


def spp_levels(param, shape):
    """(PoolingParameter, pooled N x C x H x W) of each level of Caffe's SPP pyramid over `shape`."""
    if len(shape) != 4:
        raise ShapeError(f"SPP needs a 4-axis input, got {fmt(shape)}")
    if param.pyramid_height < 1:
        raise ShapeError("SPP needs pyramid_height of at least 1")
    levels = []
    for level in range(param.pyramid_height):
        bins = 2 ** level
        kernel = [-(-size // bins) for size in shape[2:]]
        pad = [(k * bins - size + 1) // 2 for k, size in zip(kernel, shape[2:])]
        pool = pb.PoolingParameter(pool=param.pool, kernel_h=kernel[0], kernel_w=kernel[1], pad_h=pad[0],
                                   pad_w=pad[1], stride_h=kernel[0], stride_w=kernel[1])
        geometry = pool_geometry(pool, *shape[2:])
        out = [pooled_size(shape[2 + i], geometry[0][i], geometry[1][i], geometry[2][i]) for i in range(2)]
        levels.append((pool, shape[:2] + tuple(out)))
    return levels


@layer_type("SPP")
def _spp(lp, bottoms, ctx):
    _exactly(lp, bottoms, 1, 1)
    levels = spp_levels(lp.spp_param, bottoms[0])
    if len(levels) == 1:
        return [levels[0][1]], []
    return [(bottoms[0][0], sum(count(shape, 1) for _, shape in levels))], []


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
    _exactly(lp, bottoms, 2, 1)
    if len(bottoms[1]) != 1:
        raise ShapeError(f"BatchReindex's indices must be one axis, got {fmt(bottoms[1])}")
    return [bottoms[1] + bottoms[0][1:]], []


@layer_type("Im2col")
def _im2col(lp, bottoms, ctx):
    _exactly(lp, bottoms, 1, 1)
    shape = bottoms[0]
    axis, kernel, out = _conv_output(lp, shape)
    return [shape[:axis] + (shape[axis] * math.prod(kernel),) + tuple(out)], []


@layer_type("Parameter", fillers=lambda lp: [_constant_filler(0.0)], bottoms=0)
def _parameter(lp, bottoms, ctx):
    _exactly(lp, bottoms, 0, 1)
    shape = tuple(lp.parameter_param.shape.dim)
    return [shape], [shape]


RECURRENT_STATES = {"LSTM": 2, "RNN": 1}  # hidden state blobs carried between passes: (h, c), (h)


def recurrent_inputs(lp):
    """(how many hidden-state bottoms and tops expose_hidden adds, whether a static input follows `cont`)."""
    exposed = RECURRENT_STATES[lp.type] if lp.recurrent_param.expose_hidden else 0
    return exposed, len(lp.bottom) > 2 + exposed


def _recurrent_fillers(lp):
    """Caffe's unrolled net's blobs: W_x, b, [W_static,] W_h (LSTM), and W_o, b_o after them (RNN)."""
    weight, bias = lp.recurrent_param.weight_filler, lp.recurrent_param.bias_filler
    static = recurrent_inputs(lp)[1]
    return [weight, bias] + [weight] * static + [weight] + [weight, bias] * (lp.type == "RNN")


@layer_type("LSTM", "RNN", fillers=_recurrent_fillers, bottoms=2, no_backward=(1,), unforced=(1,))
def _recurrent(lp, bottoms, ctx):
    """Caffe's Recurrent layers: x (T x N x ...), cont (T x N), [static (N x ...)], [exposed h_0 (, c_0)]."""
    param = lp.recurrent_param
    exposed, static = recurrent_inputs(lp)
    if len(bottoms) not in (2 + exposed, 3 + exposed) or len(lp.top) != 1 + exposed:
        raise ShapeError(f"{lp.type} takes x, cont{', a static input' if static else ''}"
                         f"{' and the exposed hidden states' * bool(exposed)}, and makes {1 + exposed} top(s)")
    x, cont = bottoms[:2]
    if len(x) < 2 or cont != x[:2]:
        raise ShapeError(f"{lp.type} needs x of T x N x ... and cont of T x N, got {fmt(x)} and {fmt(cont)}")
    if not param.num_output:
        raise ShapeError(f"{lp.type} needs recurrent_param.num_output")
    steps, streams, hidden = x[0], x[1], param.num_output
    gates = 4 * hidden if lp.type == "LSTM" else hidden
    params = [(gates, count(x, 2)), (gates,)]
    if static:
        if not bottoms[2] or bottoms[2][0] != streams:
            raise ShapeError(f"{lp.type}'s static input must be N x ..., N = {streams}, got {fmt(bottoms[2])}")
        params.append((gates, count(bottoms[2], 1)))
    params.append((gates, hidden))
    if lp.type == "RNN":
        params += [(hidden, hidden), (hidden,)]
    state = (1, streams, hidden)
    for shape in bottoms[2 + static:]:
        if shape != state:
            raise ShapeError(f"{lp.type}'s exposed hidden state must be {fmt(state)}, got {fmt(shape)}")
    return [(steps, streams, hidden)] + [state] * exposed, params


@layer_type("LSTMUnit", bottoms=3, no_backward=(2,), unforced=(2,))
def _lstm_unit(lp, bottoms, ctx):
    _exactly(lp, bottoms, 3, 2)
    cell, gates, cont = bottoms
    if (len(cell) != 3 or cell[0] != 1 or gates != (1, cell[1], 4 * cell[2]) or cont != (1, cell[1])):
        raise ShapeError(f"LSTMUnit needs c_prev 1 x N x D, gates 1 x N x 4D and cont 1 x N, got "
                         f"{', '.join(fmt(s) for s in bottoms)}")
    return [cell, cell], []


# Data layers: their shapes come from the prototxt or from the data itself.

@layer_type("Input", data=True, fed=True)
def _input(lp, bottoms, ctx):
    shapes = [tuple(s.dim) for s in lp.input_param.shape]
    if len(shapes) not in (1, len(lp.top)):
        raise ShapeError("Input needs one shape, or one per top")
    return (shapes * len(lp.top) if len(shapes) == 1 else shapes), []


@layer_type("DummyData", data=True)
def _dummy(lp, bottoms, ctx):
    param = lp.dummy_data_param
    if param.shape:
        shapes = [tuple(s.dim) for s in param.shape]
    else:
        fields = [list(param.num), list(param.channels), list(param.height), list(param.width)]
        n = max(len(f) for f in fields)
        if n == 0 or any(len(f) not in (1, n) for f in fields):
            raise ShapeError("DummyData needs shape, or num/channels/height/width given 1 or N times")
        shapes = [tuple(f[i] if len(f) > 1 else f[0] for f in fields) for i in range(n)]
    if len(shapes) not in (1, len(lp.top)):
        raise ShapeError("DummyData needs one shape, or one per top")
    return (shapes * len(lp.top) if len(shapes) == 1 else shapes), []


@layer_type("MemoryData", data=True, fed=True)
def _memory(lp, bottoms, ctx):
    p = lp.memory_data_param
    return [(p.batch_size, p.channels, p.height, p.width), (p.batch_size,)][:len(lp.top)], []


def crop_of(transform):
    """(height, width) that transform_param crops to: crop_h and crop_w, else crop_size for both; 0 where unset."""
    return transform.crop_h or transform.crop_size, transform.crop_w or transform.crop_size


def crop_shape(transform, shape):
    """(C, H, W) after transform_param's crop."""
    c, h, w = shape
    crop_h, crop_w = crop_of(transform)
    if crop_h and crop_w:
        if crop_h > h or crop_w > w:
            raise ShapeError(f"crop {crop_h}x{crop_w} is larger than the {h}x{w} images")
        return c, crop_h, crop_w
    return c, h, w


@layer_type("Data", data=True, fed=True)
def _data(lp, bottoms, ctx):
    if not lp.data_param.batch_size:
        raise ShapeError("Data needs data_param.batch_size")
    if len(lp.top) not in (1, 2):
        raise ShapeError("Data has one or two tops (data, label)")
    source_shape = ctx.data_shape(lp)
    batch = ctx.batch_size or lp.data_param.batch_size
    if source_shape is None:
        return [None, (batch,)][:len(lp.top)], []
    return [(batch,) + crop_shape(lp.transform_param, source_shape), (batch,)][:len(lp.top)], []


# The data layers that read files of their own kind: their rows or images come from the shared data
# pipeline (deepspark/data/) as a Data layer's records do, and reach both backends as fed tops.

@layer_type("HDF5Data", data=True, fed=True)
def _hdf5_data(lp, bottoms, ctx):
    batch = ctx.batch_size or lp.hdf5_data_param.batch_size
    if not batch:
        raise ShapeError("HDF5Data needs hdf5_data_param.batch_size")
    if not lp.top:
        raise ShapeError("HDF5Data needs a top per dataset it reads")
    rows = ctx.data_shape(lp)  # {top: the shape of one row}, from the first listed file
    return [None if rows is None else (batch,) + tuple(rows[top]) for top in lp.top], []


@layer_type("ImageData", data=True, fed=True)
def _image_data(lp, bottoms, ctx):
    if len(lp.top) not in (1, 2):
        raise ShapeError("ImageData has one or two tops (data, label)")
    batch = ctx.batch_size or lp.image_data_param.batch_size
    source_shape = ctx.data_shape(lp)
    data = None if source_shape is None else (batch,) + crop_shape(lp.transform_param, source_shape)
    return [data, (batch,)][:len(lp.top)], []


@layer_type("WindowData", data=True, fed=True)
def _window_data(lp, bottoms, ctx):
    if len(lp.top) != 2:
        raise ShapeError("WindowData has two tops (data, label)")
    crop = lp.transform_param.crop_size
    if not crop:
        raise ShapeError("WindowData needs transform_param.crop_size (the size windows are warped to)")
    batch = ctx.batch_size or lp.window_data_param.batch_size
    return [(batch, 3, crop, crop), (batch,)], []  # windows of colour images, warped square


@layer_type("HDF5Output", bottoms=2, tops=0)
def _hdf5_output(lp, bottoms, ctx):
    if len(bottoms) != 2 or lp.top:
        raise ShapeError("HDF5Output takes two bottoms (data, label) and has no tops")
    if not lp.hdf5_output_param.file_name:
        raise ShapeError("HDF5Output needs hdf5_output_param.file_name")
    if bottoms[0][:1] != bottoms[1][:1]:
        raise ShapeError(f"HDF5Output's data {fmt(bottoms[0])} and label {fmt(bottoms[1])} differ in batch size")
    return [], []


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


def _types(flag):
    return frozenset(kind for kind, row in REGISTRY.items() if getattr(row, flag))


# The kinds of layer other modules ask about, from the rows above.
LOSS_TYPES = _types("loss")
DATA_TYPES = _types("data")
FED_TYPES = _types("fed")
LABELLED_TYPES = _types("labelled")


# ---------------------------------------------------------------------------
# Phases and the DAG

def state_meets_rule(state, rule):
    """Caffe's Net::StateMeetsRule."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    return all(s in stages for s in rule.stage) and not any(s in stages for s in rule.not_stage)


def layer_included(layer, state):
    if layer.include:
        return any(state_meets_rule(state, rule) for rule in layer.include)
    return not any(state_meets_rule(state, rule) for rule in layer.exclude)


def make_state(net_param, phase=None, stages=None, level=None):
    state = pb.NetState()
    state.CopyFrom(net_param.state)
    if phase is not None:
        state.phase = phase
    if stages is not None:
        del state.stage[:]
        state.stage.extend(stages)
    if level is not None:
        state.level = level
    return state


@dataclass
class Layer:
    """One layer of the net in this phase, with its shapes."""

    name: str
    type: str
    bottoms: list
    tops: list
    param: object  # the LayerParameter
    index: object  # its position in NetParameter.layer (None when synthesized)
    bottom_shapes: list = field(default_factory=list)
    top_shapes: list = field(default_factory=list)
    param_shapes: list = field(default_factory=list)
    loss_weights: list = field(default_factory=list)
    blob_params: list = field(default_factory=list)  # index into Graph.params of each of its blobs (shared too)
    automatic: int = 0  # how many of its last tops Caffe's Net made, the prototxt naming none (a loss layer's)

    def param_spec(self, i):
        """lr_mult, decay_mult and share name of parameter blob i (Caffe's defaults when unset)."""
        given = self.param.param[i] if i < len(self.param.param) else pb.ParamSpec()
        if not REGISTRY[self.type].learned:
            return 0.0, 0.0, given.name
        return given.lr_mult, given.decay_mult, given.name

    @property
    def named_tops(self):
        """Its tops that other layers can read and the net can output: all but the automatic ones."""
        return self.tops[:len(self.tops) - self.automatic]

    @property
    def in_place(self):
        return bool(self.tops) and self.tops[0] in self.bottoms[:1]


@dataclass
class Param:
    """A learnable blob: its owner layer, index in that layer and Caffe's solver multipliers.

    `layer` is the owner's name, for the user; `owner` its position in
    Graph.layers, for the code (Caffe lets two layers of a phase share a name).
    """

    layer: str
    owner: int
    index: int
    shape: tuple
    lr_mult: float
    decay_mult: float
    sharers: list = field(default_factory=list)  # (layer, index) pairs that reuse it

    @property
    def size(self):
        return count(self.shape) if self.shape is not None else None


class BuildContext:
    """What shape inference needs from outside the prototxt: the data shapes, a batch size, the phase, and the
    prototxt's folder (where a Python layer's module is looked for first)."""

    def __init__(self, data_shape=None, batch_size=None, phase=pb.TRAIN, folder=None):
        self._data_shape = data_shape
        self.batch_size = batch_size
        self.phase = phase
        self.folder = folder
        self.warnings = []
        self.unknown = {}  # layer name -> why its data shape is unknown

    def data_shape(self, layer_param):
        if self._data_shape is None:
            return None
        shape = self._data_shape(layer_param)
        if isinstance(shape, str):
            self.warnings.append(shape)
            self.unknown[layer_param.name] = shape
            return None
        if isinstance(shape, dict):  # per top (HDF5Data's datasets)
            return {top: tuple(dims) for top, dims in shape.items()}
        return tuple(shape) if shape is not None else None


class Graph:
    """The net of one phase: layers in order, blob shapes, learnable parameters."""

    def __init__(self, net_param, phase=pb.TRAIN, stages=None, level=None, source=None,
                 data_shape=None, batch_size=None):
        self.net_param = net_param
        self.source = source or SourceMap("<net>")
        self.state = make_state(net_param, phase, stages, level)
        self.phase = self.state.phase
        self.context = BuildContext(data_shape, batch_size, self.phase, pylayer.source_folder(self.source.filename))
        self.layers = []
        self.blobs = {}  # name -> shape (the latest version of in-place blobs)
        self.producers = {}  # name -> layer name
        self.consumers = {}  # name -> [layer names]
        self.params = []
        self._build()

    @property
    def name(self):
        return self.net_param.name

    @property
    def warnings(self):
        return self.context.warnings

    def _error(self, message, index, field=None):
        return self.source.error(message, index, field)

    def _build(self):
        for i, lp in enumerate(self.net_param.layer):
            if lp.type not in REGISTRY:
                raise self._error(f"layer '{lp.name}': unknown layer type '{lp.type}' (docs/layers.md lists the "
                                  "supported types)", i, "type")
            if lp.include and lp.exclude:
                raise self._error(f"layer '{lp.name}': give include rules or exclude rules, not both", i)
        # A net built in code may still carry `input:` fields (config upgrades a file's as it reads it).
        upgraded = input_layer(self.net_param, lambda: self.source.where(None))
        entries = [(None, upgraded)] if upgraded else []
        entries += [(i, lp) for i, lp in enumerate(self.net_param.layer) if layer_included(lp, self.state)]
        for index, lp in entries:  # a name may repeat: Caffe's Net::Init does not refuse it
            self._add(index, lp)
        self._collect_params()

    def _add(self, index, lp):
        layer = Layer(lp.name, lp.type, list(lp.bottom), list(lp.top), lp, index)
        row = REGISTRY[lp.type]
        shaped = lp  # what the shape function reads: the prototxt's layer, its automatic top added
        if row.loss and not lp.top:
            # Caffe's Net::AppendTop for a LossLayer (AutoTopBlobs, one top): a top named "(automatic)" that
            # carries the loss (its loss_weight, 1 by default) and that no later layer can read
            layer.tops, layer.automatic = [AUTOMATIC], 1
            shaped = copy.deepcopy(lp)
            shaped.top.append(AUTOMATIC)
        for b, bottom in enumerate(layer.bottoms):
            if bottom not in self.blobs:
                raise self._error(f"layer '{lp.name}': bottom '{bottom}' is not produced by any earlier layer "
                                  f"in phase {pb.Phase.Name(self.phase)}", index, "bottom")
            layer.bottom_shapes.append(self.blobs[bottom])
            self.consumers.setdefault(bottom, []).append(lp.name)
        for t, top in enumerate(layer.named_tops):
            in_place = t < len(layer.bottoms) and layer.bottoms[t] == top
            if top in self.blobs and not in_place:
                raise self._error(f"layer '{lp.name}': top '{top}' is already produced by layer "
                                  f"'{self.producers[top]}' (only in-place use may reuse a blob name)",
                                  index, "top")
        if len(layer.bottoms) < row.min_bottoms:
            needed = "a bottom" if row.min_bottoms == 1 else f"{row.min_bottoms} bottoms"
            raise self._error(f"layer '{lp.name}' ({lp.type}) needs {needed}", index)
        if len(layer.tops) < row.tops:
            raise self._error(f"layer '{lp.name}' ({lp.type}) needs a top (Caffe aborts; it names one itself for "
                              "a loss layer only)", index)
        if any(shape is None for shape in layer.bottom_shapes):
            tops, params = [None] * len(layer.tops), [None] * row.blob_count(shaped)
        else:
            try:
                tops, params = row.shapes(shaped, [tuple(s) for s in layer.bottom_shapes], self.context)
            except ShapeError as error:
                raise self._error(f"layer '{lp.name}' ({lp.type}): {error}", index) from None
        if len(tops) < len(layer.tops):
            raise self._error(f"layer '{lp.name}' ({lp.type}) has {len(layer.tops)} tops; it makes "
                              f"{len(tops)}", index, "top")
        layer.top_shapes = [tuple(s) if s is not None else None for s in tops[:len(layer.tops)]]
        layer.param_shapes = [tuple(s) if s is not None else None for s in params]
        if lp.loss_weight:
            if len(lp.loss_weight) != len(layer.tops):
                raise self._error(f"layer '{lp.name}': loss_weight must be given once per top, or not at all",
                                  index, "loss_weight")
            layer.loss_weights = list(lp.loss_weight)
        else:
            default = 1.0 if row.loss else 0.0
            layer.loss_weights = [default] + [0.0] * (len(layer.tops) - 1) if layer.tops else []
        for top, shape in zip(layer.named_tops, layer.top_shapes):
            self.blobs[top] = shape
            self.producers[top] = lp.name
        self.layers.append(layer)

    def _collect_params(self):
        shared = {}  # share name -> index into self.params
        for position, layer in enumerate(self.layers):
            for i, shape in enumerate(layer.param_shapes):
                lr, decay, name = layer.param_spec(i)
                if name and name in shared:
                    owner = self.params[shared[name]]
                    if owner.shape is not None and shape is not None and count(owner.shape) != count(shape):
                        raise self._error(f"layer '{layer.name}': shared parameter '{name}' has shape "
                                          f"{fmt(shape)}, its owner '{owner.layer}' has {fmt(owner.shape)}",
                                          layer.index, "param")
                    owner.sharers.append((layer.name, i))
                    layer.blob_params.append(shared[name])
                    continue
                if name:
                    shared[name] = len(self.params)
                layer.blob_params.append(len(self.params))
                self.params.append(Param(layer.name, position, i, shape, lr, decay))

    # -- questions the backends and the CLI ask -------------------------------

    def layer(self, name):
        """The layer called `name`; of several, the last (Caffe's Net::layer_by_name)."""
        named = [layer for layer in self.layers if layer.name == name]
        if not named:
            raise KeyError(f"no layer '{name}' in phase {pb.Phase.Name(self.phase)}")
        return named[-1]

    @property
    def outputs(self):
        """Blobs no later layer reads or rewrites (Caffe's net outputs)."""
        result = []
        for i, layer in enumerate(self.layers):
            later = self.layers[i + 1:]
            for top in layer.named_tops:  # an automatic top is not one: Caffe's Net leaves it out
                if top not in result and not any(top in l.bottoms or top in l.tops for l in later):
                    result.append(top)
        return result

    @property
    def param_count(self):
        """Learnable values, shared blobs counted once; None when a shape is unknown."""
        sizes = [p.size for p in self.params]
        return None if None in sizes else sum(sizes)

    @property
    def known_param_count(self):
        return sum(p.size for p in self.params if p.size is not None)

    def fed_tops(self, layers=None):
        """{top: shape} a batch must hold: the tops of the fed layers (or of `layers`), in net order."""
        layers = [layer for layer in self.layers if layer.type in FED_TYPES] if layers is None else layers
        return {top: tuple(shape) for layer in layers for top, shape in zip(layer.tops, layer.top_shapes)}

    def check_backward(self):
        """A ConfigError if Caffe's backward pass would abort on this net: a diff that back-propagation needs
        through a bottom its layer takes none for (a label, an index, a sequence marker, a Threshold's input)."""
        for layer, (bottoms, _) in zip(self.layers, backward_needs(self)):
            refused = sorted(REGISTRY[layer.type].refused(len(layer.bottoms)) & set(bottoms))
            if refused:
                fix = ("drop force_backward" if self.net_param.force_backward
                       else "give the layer propagate_down: false for it")
                raise self._error(f"layer '{layer.name}' ({layer.type}) takes no gradient to its bottom "
                                  f"'{layer.bottoms[refused[0]]}', which back-propagation reaches here (Caffe "
                                  f"aborts there); {fix}", layer.index)

    def describe(self):
        """`describe` rows: name, type, top shapes, parameter shapes; then the totals line."""
        rows = [("name", "type", "tops", "parameters")]
        for layer in self.layers:
            tops = ", ".join(f"{t} {fmt(s)}" for t, s in zip(layer.tops, layer.top_shapes)) or "-"
            params = ", ".join(fmt(s) for s in layer.param_shapes) or "-"
            rows.append((layer.name, layer.type, tops, params))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
                 for row in rows]
        total = self.param_count
        if total is None:
            unknown = sum(size is None for size in (p.size for p in self.params))
            known = f"; the others hold {self.known_param_count}" if self.known_param_count else ""
            lines.append(f"total parameters: unknown ({unknown} parameter blob{'s' * (unknown != 1)} of unknown "
                         f"shape{known})")
        else:
            lines.append(f"total parameters: {total}")
        return "\n".join(line.rstrip() for line in lines)



def backward_needs(graph):
    """Per layer, (bottom positions, blob positions) whose diffs Caffe's Net computes in its backward.

    Net::Init's rules: a blob needs a diff when a layer that wrote it needs a
    backward, and a layer needs one when a bottom needs a diff or a blob has a
    nonzero lr_mult; propagate_down overrides a bottom; a layer under no loss,
    or whose tops all skip back-propagation, computes none; force_backward
    gives every layer all of its blobs and the bottoms its type allows
    (Caffe's AllowForceBackward: the registry row's `unforced` are left out).
    """
    layers = graph.layers
    wants, needed, rows = set(), [], []  # blob names that need a diff; per layer: does it need a backward
    for layer in layers:
        down = list(layer.param.propagate_down)
        bottoms = [b for b, name in enumerate(layer.bottoms) if (down[b] if down else name in wants)]
        params = [b for b in range(len(layer.blob_params)) if layer.param_spec(b)[0] != 0]
        need = any(name in wants for name in layer.bottoms) or bool(params)
        if need:
            wants.update(layer.tops)
        needed.append(need)
        rows.append((bottoms, params))
    under_loss, read, kept = set(), set(), set()  # a blob read, but with no reader wanting its diff, skips
    for position in reversed(range(len(layers))):  # (Caffe decides this per Split top; here per blob)
        layer, (bottoms, params) = layers[position], rows[position]
        contributes = any(layer.loss_weights) or any(top in under_loss for top in layer.tops)
        if not contributes or all(top in read and top not in kept for top in layer.tops):
            needed[position], bottoms = False, []
        for b, name in enumerate(layer.bottoms):
            if contributes:
                under_loss.add(name)
            read.add(name)
            if b in bottoms:
                kept.add(name)
        rows[position] = (bottoms, params) if needed[position] else ([], [])
    if graph.net_param.force_backward:
        return [(sorted(set(bottoms) | set(REGISTRY[layer.type].forced(len(layer.bottoms)))),
                 list(range(len(layer.blob_params)))) for layer, (bottoms, _) in zip(layers, rows)]
    return rows


# -- rewrites of a net for a forward pass (compare, the scoring path) ------------------------------


def with_batch_size(net, batch_size):
    """A copy of `net` whose Input layers (and legacy inputs) have batch `batch_size`."""
    net = copy.deepcopy(net)
    if batch_size:
        for layer in net.layer:
            if layer.type == "Input":
                for shape in layer.input_param.shape:
                    if shape.dim:
                        shape.dim[0] = batch_size
        for shape in net.input_shape:
            if shape.dim:
                shape.dim[0] = batch_size
        if net.input_dim:
            for i in range(0, len(net.input_dim), 4):
                net.input_dim[i] = batch_size
    return net


def with_input_shapes(net, shapes):
    """A copy of `net` whose inputs named in `shapes` ({top: shape}) take those shapes: its Input layers' tops
    (legacy `input:` fields become an Input layer first, as Caffe upgrades them); a KeyError names a top that
    is no input."""
    net = copy.deepcopy(net)
    upgrade_input(net)
    found = set()
    for layer in net.layer:
        if layer.type != "Input" or not any(top in shapes for top in layer.top):
            continue
        given = [list(shape.dim) for shape in layer.input_param.shape]
        given = given * len(layer.top) if len(given) == 1 else given
        del layer.input_param.shape[:]
        for top, dims in zip(layer.top, given):
            layer.input_param.shape.add().dim.extend(shapes.get(top, dims))
        found.update(layer.top)
    missing = [top for top in shapes if top not in found]
    if missing:
        raise KeyError(f"'{missing[0]}' is not an input of this net")
    return net


TAP = "{top}@{layer}"


def tap_name(graph, blob):
    """The output that carries `blob` of `graph` once with_taps has tapped it: the blob itself when it is
    an output already, else `blob@<its last writer>`; a KeyError naming the blobs there are if none."""
    if blob in graph.outputs:
        return blob
    writers = [layer for layer in graph.layers if blob in layer.tops]
    if not writers:
        known = list(dict.fromkeys(top for layer in graph.layers for top in layer.tops))
        raise KeyError(f"the net has no blob '{blob}'; its blobs are {', '.join(known)}")
    return TAP.format(top=blob, layer=writers[-1].name)


def with_taps(net, graph, blobs=None):
    """A copy of `net` with a Split copying each blob (or each of `blobs`) out as an output, after its
    last writer.

    Backends return only a net's outputs; a copy named `top@layer` (tap_name)
    makes a blob one of them. A blob rewritten in place is tapped after its
    last in-place layer (Caffe cannot split a blob that an in-place layer also
    reads): its value after the forward pass, as pycaffe's net.blobs holds it.
    Nothing else in the forward pass changes.
    """
    wanted = None if blobs is None else {tap_name(graph, blob) for blob in blobs}
    net = copy.deepcopy(net)
    del net.layer[:]
    outputs = set(graph.outputs)
    for i, layer in enumerate(graph.layers):
        added = net.layer.add()
        added.CopyFrom(layer.param)
        for field_name in ("include", "exclude"):
            added.ClearField(field_name)
        if layer.type in DATA_TYPES:
            continue
        for top in layer.named_tops:
            if top in outputs or any(top in later.tops for later in graph.layers[i + 1:]):
                continue  # already an output, or rewritten in place later: tapped there
            name = TAP.format(top=top, layer=layer.name)
            if wanted is not None and name not in wanted:
                continue
            tap = net.layer.add(name=name + "/tap", type="Split")
            tap.bottom.append(top)
            tap.top.append(name)
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")
    return net
