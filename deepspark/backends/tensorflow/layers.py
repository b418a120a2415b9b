"""The layer table: each Caffe layer type as one small TensorFlow function.

A layer function takes (layer, bottoms, params, ctx): the graph.Layer (its
LayerParameter and shapes), its bottom Blobs, its parameter blobs as tensors
in Caffe's shapes (or in the axis order its registration asks for), and the
compiler's Context; it returns its top Blobs. Adding a layer means one
function and its @layer registration here (docs/layers.md); the table is
checked against graph.REGISTRY as this module is imported.

Convolutions, pooling and LRN compute in NHWC (TensorFlow's fast layout on
CPU) and hand NHWC blobs on; layers that only care about the channel axis keep
that layout, every other layer sees Caffe's (N, C, H, W).
"""

import math
from typing import NamedTuple

import numpy as np

from deepspark import checkpoint, fillers
from deepspark.backends.base import infogain_matrix
from deepspark.backends.tensorflow import python_layer
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import (FED_TYPES, RECURRENT_STATES, Layer, canonical_axis, check_table, conv_geometry, count,
                             crop_offsets, pool_geometry, recurrent_inputs, spp_levels)
from deepspark.proto import deepspark_pb2 as pb

TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)

# Convolution kernels as HWIO, TensorFlow's own layout: the permutation from Caffe's OIHW.
HWIO = (2, 3, 1, 0)


class Entry(NamedTuple):
    """One layer type's row: its function, the axis order it takes each parameter blob in, what it carries.

    param_order: {blob index: permutation of Caffe's axes} for the blobs it
    wants in another layout than Caffe's; the model stores them so, and
    converts only at the contract's boundary. state: None, or a function of the
    graph.Layer giving the shapes of what the layer carries from one forward
    pass to the next (a recurrent layer's last hidden state): the model keeps
    them as variables (Context.carried), the function hands the new values on
    (Context.carry).
    """

    function: object
    param_order: dict
    state: object = None


LAYERS = {}  # layer type -> Entry


def layer(*types, param_order=None, state=None):
    def register(function):
        for kind in types:
            LAYERS[kind] = Entry(function, dict(param_order or {}), state)
        return function
    return register


def batch_free(shape):
    """A blob's static shape for tf.reshape with its first (batch) axis left to the tensor: the same
    shape at the graph's batch size, and any batch in a SavedModel served with another."""
    return (-1,) + tuple(shape[1:])


def _permute(x, order):
    """tf.transpose, or a free reshape when the moved axes are all of size 1 (e.g. one channel)."""
    shape = x.shape.as_list()
    moved = [shape[i] for i in order]
    kept = [i for i in order if shape[i] != 1]  # a reshape only if the other axes keep their order
    if None not in shape and kept == sorted(kept):
        return tf.reshape(x, moved)
    return tf.transpose(x, order)


class Blob(NamedTuple):
    """A blob's tensor and its layout: Caffe's, or NHWC (4-axis blobs only)."""

    tensor: tf.Tensor
    nhwc: bool = False

    @property
    def rank(self):
        return self.tensor.shape.rank

    @property
    def caffe(self):
        """The tensor in Caffe's layout."""
        return _permute(self.tensor, TO_NCHW) if self.nhwc else self.tensor

    @property
    def as_nhwc(self):
        if self.nhwc:
            return self.tensor
        if self.rank != 4:
            raise NotImplementedError(f"the TensorFlow backend supports 2D spatial layers only, got a "
                                      f"{self.rank}-axis blob")
        return _permute(self.tensor, TO_NHWC)

    def axis(self, axis):
        """The tensor axis that holds Caffe's axis `axis`."""
        axis = canonical_axis(axis, self.rank)
        return TO_NHWC.index(axis) if self.nhwc else axis

    def like(self, tensor):
        return Blob(tensor, self.nhwc)


def same_layout(blobs):
    """The tensors of `blobs` in one layout (NHWC only if all are), and that layout."""
    nhwc = all(b.nhwc for b in blobs)
    return [b.tensor if nhwc else b.caffe for b in blobs], nhwc


def broadcast(blob, operand, axis):
    """(x, operand) ready to combine: operand covers Caffe axes axis..axis+operand.rank of blob."""
    count = operand.shape.rank
    if blob.nhwc and axis == 1 and count == 1:
        return blob.tensor, operand
    if blob.nhwc and axis == 1 and count == 3:
        return blob.tensor, tf.transpose(operand, (1, 2, 0))
    x = blob.caffe
    shape = [1] * axis + operand.shape.as_list() + [1] * (x.shape.rank - axis - count)
    return x, tf.reshape(operand, shape)


def one_top(function):
    """A layer whose single top is function(x, param) on the bottom's tensor, layout kept."""
    def run(layer, bottoms, params, ctx):
        return [bottoms[0].like(function(bottoms[0].tensor, layer.param))]
    run.__name__ = function.__name__
    run.__doc__ = function.__doc__
    return run


# -- data -----------------------------------------------------------------------

@layer(*sorted(FED_TYPES))
def data(layer, bottoms, params, ctx):
    return [Blob(ctx.inputs[top]) for top in layer.tops]


@layer("DummyData")
def dummy_data(layer, bottoms, params, ctx):
    """Caffe's DummyData: filled once for constant fillers, refilled every pass otherwise."""
    specs = list(layer.param.dummy_data_param.data_filler) or [pb.FillerParameter()]
    tops = []
    for i, shape in enumerate(layer.top_shapes):
        filler = specs[i] if len(specs) > 1 else specs[0]
        kind = filler.type or "constant"
        if kind == "constant":
            value = tf.fill(shape, filler.value)
        elif kind == "uniform":
            value = ctx.rng.uniform(shape, filler.min, filler.max)
        elif kind == "gaussian" and filler.sparse < 0:
            value = ctx.rng.normal(shape, filler.mean, filler.std)
        else:
            value = tf.constant(fillers.fill(filler, shape, np.random.default_rng(ctx.seed)))
        tops.append(Blob(value))
    return tops


@layer("Python")
def python(layer, bottoms, params, ctx):
    """Caffe's Python layer: the user's module on numpy, its backward as the gradient (python_layer)."""
    return [Blob(top) for top in python_layer.run(layer, [b.caffe for b in bottoms], ctx.graph)]


@layer("HDF5Output")
def hdf5_output(layer, bottoms, params, ctx):
    """Caffe's HDF5Output: every forward writes its two bottoms to the file (a stateful op the pass runs)."""
    path = layer.param.hdf5_output_param.file_name

    def write(data, label):
        checkpoint.write_hdf5_output(path, data, label)
        return np.float32(0)

    tf.numpy_function(write, [bottoms[0].caffe, bottoms[1].caffe], tf.float32, stateful=True,
                      name=layer.name.replace("/", "_") + "_write")
    return []


# -- vision ---------------------------------------------------------------------

def _explicit_pad(pad):
    return [[0, 0], [pad[0], pad[0]], [pad[1], pad[1]], [0, 0]] if any(pad) else "VALID"


def _check_2d(layer, what):
    param = layer.param.convolution_param
    if len(layer.bottom_shapes[0]) != 4 or canonical_axis(param.axis, 4) != 1:
        raise NotImplementedError(f"layer '{layer.name}': the TensorFlow backend supports 2D {what} only")


def dilate_kernel(weights, dilation):
    """An HWIO kernel with dilation-1 zeros between taps: TF on CPU has no dilated convolution gradients."""
    for axis, d in enumerate(dilation):
        if d == 1:
            continue
        size = weights.shape[axis]
        spaced = tf.stack([weights] + [tf.zeros_like(weights)] * (d - 1), axis=axis + 1)
        shape = weights.shape.as_list()
        shape[axis] = size * d
        weights = tf.reshape(spaced, shape)
        weights = weights[:(size - 1) * d + 1] if axis == 0 else weights[:, :(size - 1) * d + 1]
    return weights


@layer("Convolution", param_order={0: HWIO})
def convolution(layer, bottoms, params, ctx):
    """Each bottom through the same blobs, a top each (Caffe's N bottoms to N tops)."""
    _check_2d(layer, "convolution")
    param = layer.param.convolution_param
    kernel, pad, stride, dilation = conv_geometry(param, 2)
    weights = dilate_kernel(params[0], dilation)  # HWIO (its param_order)
    # TF has no grouped-convolution gradient on CPU: one convolution per group.
    group = param.group
    filters = tf.split(weights, group, axis=3) if group > 1 else [weights]

    def convolve(x):
        inputs = tf.split(x, group, axis=3) if group > 1 else [x]
        ys = [tf.nn.conv2d(xg, wg, strides=[1, *stride, 1], padding=_explicit_pad(pad))
              for xg, wg in zip(inputs, filters)]
        y = tf.concat(ys, axis=3) if group > 1 else ys[0]
        return tf.nn.bias_add(y, params[1]) if param.bias_term else y

    return [Blob(convolve(bottom.as_nhwc), True) for bottom in bottoms]


@layer("Deconvolution", param_order={0: HWIO})
def deconvolution(layer, bottoms, params, ctx):
    """The adjoint of Caffe's convolution with the same (C_in, C_out/group, kh, kw) blob; each bottom through
    the same blobs, a top each."""
    _check_2d(layer, "deconvolution")
    param = layer.param.convolution_param
    kernel, pad, stride, dilation = conv_geometry(param, 2)
    n, _, h, w = layer.bottom_shapes[0]
    group, outputs = param.group, param.num_output
    full = [s * (size - 1) + d * (k - 1) + 1 for size, k, s, d in zip((h, w), kernel, stride, dilation)]
    weights = dilate_kernel(params[0], dilation)  # (kh, kw, C_out/group, C_in): Caffe's blob in HWIO order
    filters = tf.split(weights, group, axis=3) if group > 1 else [weights]
    out_h, out_w = layer.top_shapes[0][2:]

    def deconvolve(x):
        inputs = tf.split(x, group, axis=3) if group > 1 else [x]
        ys = [tf.nn.conv2d_transpose(xg, wg, [n, *full, outputs // group], strides=[1, *stride, 1],
                                     padding="VALID") for xg, wg in zip(inputs, filters)]
        y = tf.concat(ys, axis=3) if group > 1 else ys[0]
        y = y[:, pad[0]:pad[0] + out_h, pad[1]:pad[1] + out_w, :]
        return tf.nn.bias_add(y, params[1]) if param.bias_term else y

    return [Blob(deconvolve(bottom.as_nhwc), True) for bottom in bottoms]


def average_divisor(size, out, kernel, pad, stride):
    """Caffe's AVE pooling divisor per output position on one axis: the window clipped to size+pad."""
    starts = np.arange(out) * stride - pad
    return np.minimum(starts + kernel, size + pad) - starts


@layer("Pooling")
def pooling(layer, bottoms, params, ctx):
    param = layer.param.pooling_param
    if len(layer.tops) > 1:
        raise NotImplementedError(f"layer '{layer.name}': the pooling mask top is not supported")
    _, _, h, w = layer.bottom_shapes[0]
    kernel, pad, stride = pool_geometry(param, h, w)
    out = layer.top_shapes[0][2:]
    x = bottoms[0].as_nhwc
    if param.pool not in (pb.PoolingParameter.MAX, pb.PoolingParameter.AVE):
        raise NotImplementedError(f"layer '{layer.name}': only MAX and AVE pooling are supported")
    is_max = param.pool == pb.PoolingParameter.MAX
    if None in x.shape[1:3] and not param.global_pooling:  # a SavedModel of any size: the data's, not the graph's
        return [Blob(pooling_any_size(x, kernel, pad, stride, param.ceil_mode, is_max), True)]
    if param.global_pooling or (tuple(kernel) == (h, w) and tuple(out) == (1, 1) and not any(pad)):
        y = tf.reduce_max(x, (1, 2), keepdims=True) if is_max else tf.reduce_mean(x, (1, 2), keepdims=True)
        return [Blob(y, True)]
    # Pad so the VALID windows are exactly Caffe's ceil-mode windows: padding
    # never wins a max and adds nothing to a sum.
    needed = [(o - 1) * s + k for o, s, k in zip(out, stride, kernel)]
    after = [max(n - size - p, 0) for n, size, p in zip(needed, (h, w), pad)]
    if any(pad) or any(after):
        fill = np.finfo(np.float32).min if is_max else 0.0
        x = tf.pad(x, [[0, 0], [pad[0], after[0]], [pad[1], after[1]], [0, 0]], constant_values=fill)
    if any(n < size + p + a for n, size, p, a in zip(needed, (h, w), pad, after)):
        x = x[:, :needed[0], :needed[1], :]
    if is_max:
        return [Blob(tf.nn.max_pool2d(x, kernel, stride, "VALID"), True)]
    y = tf.nn.avg_pool2d(x, kernel, stride, "VALID")
    divisor = np.outer(average_divisor(h, out[0], kernel[0], pad[0], stride[0]),
                       average_divisor(w, out[1], kernel[1], pad[1], stride[1]))
    ratio = (kernel[0] * kernel[1]) / divisor
    if not np.all(ratio == 1):
        y = y * tf.constant(ratio[:, :, None], tf.float32)
    return [Blob(y, True)]


def pooling_any_size(x, kernel, pad, stride, ceil_mode, is_max):
    """Caffe's pooling of an NHWC tensor whose height and width only the data knows (graph.pooled_size's rule
    on tensors): padded after to the last window Caffe starts, an AVE window's divisor clipped to size+pad."""
    sizes = tf.shape(x)[1:3]
    needed, after = [], []
    for i in range(2):
        size, k, p, s = sizes[i], kernel[i], pad[i], stride[i]
        span = size + 2 * p - k
        out = (-(-span // s) if ceil_mode else span // s) + 1
        if p:
            out = tf.where((out - 1) * s >= size + p, out - 1, out)
        needed.append((out - 1) * s + k)
        after.append(tf.maximum(needed[i] - size - p, 0))
    tf.debugging.assert_non_negative(tf.reduce_min(sizes + np.array(pad, np.int32) * 2 - np.array(kernel, np.int32)),
                                     message=f"the pooling kernel {kernel} is larger than the padded input")
    paddings = [[0, 0], [pad[0], after[0]], [pad[1], after[1]], [0, 0]]
    fill = np.finfo(np.float32).min if is_max else 0.0
    x = tf.pad(x, paddings, constant_values=fill)[:, :needed[0], :needed[1], :]
    if is_max:
        return tf.nn.max_pool2d(x, kernel, stride, "VALID")
    padded = tf.concat([[1], sizes + np.array(pad, np.int32) * 2, [1]], 0)
    inside = tf.pad(tf.ones(padded), [[0, 0], [0, after[0]], [0, after[1]], [0, 0]])  # 1 up to size+pad: the divisor
    inside = inside[:, :needed[0], :needed[1], :]
    return tf.nn.avg_pool2d(x, kernel, stride, "VALID") / tf.nn.avg_pool2d(inside, kernel, stride, "VALID")


@layer("LRN")
def lrn(layer, bottoms, params, ctx):
    param = layer.param.lrn_param
    size, alpha, beta = param.local_size, param.alpha, param.beta
    x = bottoms[0].as_nhwc
    if param.norm_region == pb.LRNParameter.ACROSS_CHANNELS:
        # TF's sqr_sum runs over depth_radius on each side: Caffe's window of local_size.
        y = tf.nn.local_response_normalization(x, depth_radius=(size - 1) // 2, bias=param.k,
                                               alpha=alpha / size, beta=beta)
        return [Blob(y, True)]
    # WITHIN_CHANNEL: Caffe's square -> AVE pool (zero padded, divisor size^2) -> (1 + alpha*s)^-beta.
    half = (size - 1) // 2
    squares = tf.pad(tf.square(x), [[0, 0], [half, half], [half, half], [0, 0]])
    mean = tf.nn.avg_pool2d(squares, size, 1, "VALID")
    return [Blob(x * tf.pow(1.0 + alpha * mean, -beta), True)]


# -- common ---------------------------------------------------------------------

@layer("InnerProduct")
def inner_product(layer, bottoms, params, ctx):
    param = layer.param.inner_product_param
    shape = layer.bottom_shapes[0]
    axis = canonical_axis(param.axis, len(shape))
    rows = (-1, math.prod(shape[axis:])) if axis else (1, -1)  # the batch is a row's axis from 1 on
    x = tf.reshape(bottoms[0].caffe, rows)
    y = tf.matmul(x, params[0], transpose_b=not param.transpose)
    if param.bias_term:
        y = tf.nn.bias_add(y, params[1])
    return [Blob(tf.reshape(y, batch_free(layer.top_shapes[0]) if axis else layer.top_shapes[0]))]


@layer("Dropout")
def dropout(layer, bottoms, params, ctx):
    """Caffe's dropout: keep with probability 1-p and scale by 1/(1-p) in TRAIN; identity in TEST."""
    ratio = layer.param.dropout_param.dropout_ratio
    x = bottoms[0].tensor
    if not ctx.train or ratio == 0:
        return [bottoms[0]]
    keep = ctx.rng.uniform(tf.shape(x)) >= ratio
    return [bottoms[0].like(tf.where(keep, x * (1.0 / (1.0 - ratio)), 0.0))]


@layer("BatchNorm")
def batch_norm(layer, bottoms, params, ctx):
    """Caffe's BatchNorm: blobs (mean*s, var*s, s); batch statistics update them in TRAIN."""
    param = layer.param.batch_norm_param
    blob = bottoms[0]
    x = blob.tensor
    channel = blob.axis(1) if blob.rank > 1 else None
    axes = [a for a in range(blob.rank) if a != channel]
    shape = [1] * blob.rank
    if channel is not None:
        shape[channel] = -1
    use_global = param.use_global_stats if param.HasField("use_global_stats") else not ctx.train
    mean_blob, var_blob, factor_blob = params
    if use_global:
        factor = tf.where(factor_blob[0] == 0, 0.0, 1.0 / tf.where(factor_blob[0] == 0, 1.0, factor_blob[0]))
        mean, var = mean_blob * factor, var_blob * factor
    else:
        mean, var = tf.nn.moments(x, axes)
        fraction = param.moving_average_fraction
        m = math.prod(layer.bottom_shapes[0]) // (layer.bottom_shapes[0][1] if blob.rank > 1 else 1)
        correction = m / (m - 1) if m > 1 else 1.0
        ctx.update(layer, 0, fraction * mean_blob + tf.stop_gradient(mean))
        ctx.update(layer, 1, fraction * var_blob + correction * tf.stop_gradient(var))
        ctx.update(layer, 2, fraction * factor_blob + 1.0)
    y = (x - tf.reshape(mean, shape)) * tf.reshape(tf.math.rsqrt(var + param.eps), shape)
    return [blob.like(y)]


def _operand_axis(layer, param, operand_rank):
    rank = len(layer.bottom_shapes[0])
    if len(layer.bottoms) > 1 and operand_rank == 0:
        return 0
    return canonical_axis(param.axis, rank) if rank else 0


@layer("Scale")
def scale(layer, bottoms, params, ctx):
    param = layer.param.scale_param
    blob = bottoms[0]
    params = list(params)
    operand = bottoms[1].caffe if len(bottoms) > 1 else params.pop(0)
    axis = _operand_axis(layer, param, operand.shape.rank)
    x, factor = broadcast(blob, operand, axis)
    y = x * factor
    if param.bias_term:
        y = y + broadcast(blob, params[0], axis)[1]
    return [Blob(y, blob.nhwc and x is blob.tensor)]


@layer("Bias")
def bias(layer, bottoms, params, ctx):
    param = layer.param.bias_param
    blob = bottoms[0]
    operand = bottoms[1].caffe if len(bottoms) > 1 else params[0]
    x, term = broadcast(blob, operand, _operand_axis(layer, param, operand.shape.rank))
    return [Blob(x + term, blob.nhwc and x is blob.tensor)]


@layer("Eltwise")
def eltwise(layer, bottoms, params, ctx):
    param = layer.param.eltwise_param
    xs, nhwc = same_layout(bottoms)
    if param.operation == pb.EltwiseParameter.PROD:
        y = xs[0]
        for x in xs[1:]:
            y = y * x
    elif param.operation == pb.EltwiseParameter.MAX:
        y = xs[0]
        for x in xs[1:]:
            y = tf.maximum(y, x)
    else:
        coeffs = list(param.coeff) or [1.0] * len(xs)
        y = xs[0] if coeffs[0] == 1 else coeffs[0] * xs[0]
        for c, x in zip(coeffs[1:], xs[1:]):
            y = y + (x if c == 1 else c * x)
    return [Blob(y, nhwc)]


@layer("Concat")
def concat(layer, bottoms, params, ctx):
    param = layer.param.concat_param
    axis = param.concat_dim if param.HasField("concat_dim") else param.axis
    xs, nhwc = same_layout(bottoms)
    if len(xs) == 1:
        return [Blob(xs[0], nhwc)]
    return [Blob(tf.concat(xs, Blob(xs[0], nhwc).axis(axis)), nhwc)]


@layer("Slice")
def slice_(layer, bottoms, params, ctx):
    param = layer.param.slice_param
    axis = param.slice_dim if param.HasField("slice_dim") else param.axis
    blob = bottoms[0]
    caffe_axis = canonical_axis(axis, blob.rank)
    sizes = [shape[caffe_axis] for shape in layer.top_shapes]
    return [blob.like(t) for t in tf.split(blob.tensor, sizes, axis=blob.axis(caffe_axis))]


@layer("Split")
def split(layer, bottoms, params, ctx):
    return [bottoms[0]] * len(layer.tops)


@layer("Silence")
def silence(layer, bottoms, params, ctx):
    return []


@layer("Flatten", "Reshape")
def reshape(layer, bottoms, params, ctx):
    return [Blob(tf.reshape(bottoms[0].caffe, batch_free(layer.top_shapes[0])))]


@layer("Softmax")
def softmax(layer, bottoms, params, ctx):
    blob = bottoms[0]
    return [blob.like(tf.nn.softmax(blob.tensor, axis=blob.axis(layer.param.softmax_param.axis)))]


@layer("ArgMax")
def argmax(layer, bottoms, params, ctx):
    """Caffe's ArgMax; among equal values the higher index wins, as Caffe's pair sort does."""
    param = layer.param.argmax_param
    x = tf.stop_gradient(bottoms[0].caffe)
    shape = layer.bottom_shapes[0]
    if param.HasField("axis"):
        axis = canonical_axis(param.axis, len(shape))
        moved = tf.experimental.numpy.moveaxis(x, axis, -1)
    else:
        moved = tf.reshape(x, (-1, math.prod(shape[1:])))
    size = moved.shape[-1]
    values, reversed_index = tf.math.top_k(tf.reverse(moved, [-1]), param.top_k, sorted=True)
    index = tf.cast(size - 1 - reversed_index, tf.float32)
    if param.HasField("axis"):
        y = values if param.out_max_val else index
        y = tf.experimental.numpy.moveaxis(y, -1, axis)
    elif param.out_max_val:
        y = tf.stack([index, values], axis=1)
    else:
        y = index[:, None, :]
    return [Blob(tf.reshape(y, batch_free(layer.top_shapes[0])))]


# -- neurons --------------------------------------------------------------------

@layer("ReLU")
@one_top
def relu(x, lp):
    slope = lp.relu_param.negative_slope
    return tf.nn.relu(x) if slope == 0 else tf.maximum(x, 0.0) + slope * tf.minimum(x, 0.0)


def _elementwise(op):
    """A neuron without parameters of its own: Caffe's function is TensorFlow's op. (A def, not a lambda
    named "<lambda>": AutoGraph cannot find a renamed lambda's source and warns on every trace.)"""
    def neuron(x, lp):
        return op(x)
    return one_top(neuron)


for _kind, _op in {"Sigmoid": tf.sigmoid, "TanH": tf.tanh, "AbsVal": tf.abs, "BNLL": tf.nn.softplus}.items():
    layer(_kind)(_elementwise(_op))


@layer("ELU")
@one_top
def elu(x, lp):
    alpha = lp.elu_param.alpha
    return tf.where(x > 0, x, alpha * tf.math.expm1(tf.minimum(x, 0.0)))


@layer("Power")
@one_top
def power(x, lp):
    """Caffe's Power: (shift + scale * x) ^ power."""
    p = lp.power_param
    y = x if p.scale == 1 else p.scale * x
    if p.shift:
        y = y + p.shift
    if p.power == 1:
        return y
    if p.power == 2:
        return tf.square(y)
    return tf.pow(y, p.power)


@layer("Exp")
@one_top
def exp(x, lp):
    """Caffe's Exp: base ^ (shift + scale * x); base -1 means e."""
    p = lp.exp_param
    log_base = 1.0 if p.base == -1 else math.log(p.base)
    return tf.exp(log_base * (p.shift + p.scale * x))


@layer("Log")
@one_top
def log(x, lp):
    """Caffe's Log: log_base(shift + scale * x); base -1 means e."""
    p = lp.log_param
    y = tf.math.log(p.shift + p.scale * x)
    return y if p.base == -1 else y * (1.0 / math.log(p.base))


@layer("PReLU")
def prelu(layer, bottoms, params, ctx):
    blob = bottoms[0]
    slope = params[0]
    if slope.shape.rank == 0:
        x = blob.tensor
    else:
        x, slope = broadcast(blob, slope, 1)
    y = tf.nn.relu(x) + slope * tf.minimum(x, 0.0)
    return [Blob(y, blob.nhwc and x is blob.tensor)]


# -- losses and scores ------------------------------------------------------------

def items(tensor):
    """The length of a tensor's first axis as a float: the static one, or the data's where only the data says
    (the tops of a Filter layer)."""
    known = tensor.shape[0]
    return float(known) if known is not None else tf.cast(tf.shape(tensor)[0], tf.float32)


def _class_rows(layer, blob, axis):
    """Scores as (outer*inner, classes) rows, Caffe's class axis last."""
    shape = layer.bottom_shapes[0]
    classes = shape[axis]
    x = tf.reshape(blob.caffe, (-1, classes, math.prod(shape[axis + 1:])))
    return tf.reshape(_permute(x, (0, 2, 1)), (-1, classes))


def _labels(blob):
    return tf.cast(tf.reshape(blob.caffe, (-1,)), tf.int32)


def loss_normalizer(loss_param, outer, inner, valid):
    """Caffe's LossLayer::GetNormalizer (with the legacy `normalize` flag), at least 1."""
    mode = loss_param.normalization
    if not loss_param.HasField("normalization") and loss_param.HasField("normalize"):
        mode = pb.LossParameter.VALID if loss_param.normalize else pb.LossParameter.BATCH_SIZE
    if mode == pb.LossParameter.FULL:
        value = outer * inner
    elif mode == pb.LossParameter.VALID:
        value = valid
    elif mode == pb.LossParameter.BATCH_SIZE:
        value = outer
    else:
        value = 1.0
    return tf.maximum(tf.cast(value, tf.float32), 1.0)


@layer("SoftmaxWithLoss")
def softmax_loss(layer, bottoms, params, ctx):
    shape = layer.bottom_shapes[0]
    loss_param = layer.param.loss_param
    axis = canonical_axis(layer.param.softmax_param.axis, len(shape))
    logits = _class_rows(layer, bottoms[0], axis)
    labels = _labels(bottoms[1])
    if loss_param.HasField("ignore_label"):
        valid = tf.not_equal(labels, loss_param.ignore_label)
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.where(valid, labels, 0), logits=logits)
        nll = tf.where(valid, nll, 0.0)
        count = tf.reduce_sum(tf.cast(valid, tf.float32))
    else:
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        count = items(nll)
    inner = math.prod(shape[axis + 1:])
    outer = items(logits) / inner
    loss = tf.reduce_sum(nll) / loss_normalizer(loss_param, outer, inner, count)
    tops = [Blob(loss)]
    if len(layer.tops) > 1:
        tops.append(Blob(tf.nn.softmax(bottoms[0].caffe, axis=axis)))
    return tops


@layer("EuclideanLoss")
def euclidean_loss(layer, bottoms, params, ctx):
    """sum((a - b)^2) / (2 N)."""
    a = bottoms[0].caffe
    b = tf.reshape(bottoms[1].caffe, batch_free(layer.bottom_shapes[0]))
    return [Blob(tf.reduce_sum(tf.square(a - b)) / (2.0 * items(a)))]


@layer("SigmoidCrossEntropyLoss")
def sigmoid_cross_entropy_loss(layer, bottoms, params, ctx):
    """Caffe's SigmoidCrossEntropyLoss: the summed cross-entropy over N (the batch)."""
    logits = bottoms[0].caffe
    targets = tf.reshape(bottoms[1].caffe, batch_free(layer.bottom_shapes[0]))
    entropy = tf.nn.sigmoid_cross_entropy_with_logits(labels=targets, logits=logits)
    return [Blob(tf.reduce_sum(entropy) / items(logits))]


def _ranks_above(scores, classes, mine, label):
    """Caffe's pair order (std::greater on (score, class)): whether (scores, classes) come before (mine, label).

    Ties go to the higher class; a NaN is neither above nor below, so the class decides against it too.
    (Not `~(scores < mine)`: Grappler rewrites that to `scores >= mine`, false where a NaN is.)
    """
    not_below = (scores >= mine) | tf.math.is_nan(scores) | tf.math.is_nan(mine)
    return (mine < scores) | (not_below & (label < classes))


def _heap_top_k(scores, k):
    """The classes of each row that libstdc++'s std::partial_sort puts first, k per row, with Caffe's pair order:
    its __heap_select (a heap of the first k, then each later pair that ranks above the heap's top replaces it)
    step for step, one row per lane.

    Where a row holds a NaN the order is no strict weak order and which classes end first is what the algorithm
    does with it, not a sort; elsewhere it is the k highest.
    """
    n = scores.shape[1]
    depth = k.bit_length() + 1  # a heap of k holds no path longer
    classes = tf.zeros_like(scores, tf.int32) + tf.range(n)  # (a row count known when traced stays known)
    first = tf.zeros_like(classes[:, 0])

    def get(heap, pos):
        return tuple(tf.gather(h, pos[:, None], batch_dims=1)[:, 0] for h in heap)

    def put(heap, pos, pair, where):
        spot = tf.one_hot(pos, k, on_value=True, off_value=False) & where[:, None]
        return tuple(tf.where(spot, p[:, None], h) for h, p in zip(heap, pair))

    def adjust(heap, hole, pair, where):
        """__adjust_heap: sink the hole at `hole` to a leaf, then __push_heap `pair` up from there."""
        top, second = hole, hole
        for _ in range(depth):
            going = where & (second < (k - 1) // 2)
            second = tf.where(going, 2 * (second + 1), second)
            right, left = get(heap, second), get(heap, tf.maximum(second - 1, 0))
            second = tf.where(going & _ranks_above(*right, *left), second - 1, second)
            heap = put(heap, hole, get(heap, second), going)
            hole = tf.where(going, second, hole)
        if k % 2 == 0:
            last = where & (second == (k - 2) // 2)
            child = tf.minimum(2 * second + 1, k - 1)  # the only child, in the rows that have it
            heap = put(heap, hole, get(heap, child), last)
            hole = tf.where(last, child, hole)
        for _ in range(depth):
            parent = tf.maximum((hole - 1) // 2, 0)
            going = where & (hole > top) & _ranks_above(*get(heap, parent), *pair)
            heap = put(heap, hole, get(heap, parent), going)
            hole = tf.where(going, parent, hole)
        return put(heap, hole, pair, where)

    everywhere = tf.ones_like(first, tf.bool)
    heap = (scores[:, :k], classes[:, :k])

    def make(parent, heap):  # __make_heap
        at = first + parent
        return parent - 1, adjust(heap, at, get(heap, at), everywhere)

    def select(i, heap):  # __heap_select's loop: __pop_heap where the pair ranks above the top
        pair = (scores[:, i], classes[:, i])
        above = _ranks_above(*pair, *get(heap, first))
        return i + 1, adjust(heap, first, pair, above)

    if k > 1:
        heap = tf.while_loop(lambda parent, heap: parent >= 0, make, (tf.constant((k - 2) // 2), heap))[1]
    return tf.while_loop(lambda i, heap: i < n, select, (tf.constant(k), heap))[1][1]


@layer("Accuracy")
def accuracy(layer, bottoms, params, ctx):
    """Caffe's Accuracy: correct when std::partial_sort puts the label among the first top_k (score, class) pairs.

    Caffe sorts the pairs descending, so a class ranks above the label when its
    score is greater, or equal with a higher class index: without a NaN, the
    label is correct when fewer than top_k classes rank above it. With a NaN
    the pairs have no order and the result is what libstdc++'s partial_sort
    does with them (_heap_top_k): all NaN, only the last top_k classes count.
    """
    param = layer.param.accuracy_param
    shape = layer.bottom_shapes[0]
    axis = canonical_axis(param.axis, len(shape))
    scores = tf.stop_gradient(_class_rows(layer, bottoms[0], axis))
    labels = _labels(bottoms[1])
    valid = tf.not_equal(labels, param.ignore_label) if param.HasField("ignore_label") else \
        tf.ones_like(labels, tf.bool)
    safe = tf.where(valid, labels, 0)
    mine = tf.gather(scores, safe, batch_dims=1)[:, None]
    classes = tf.range(shape[axis])[None, :]

    def ordered():
        above = _ranks_above(scores, classes, mine, safe[:, None])
        return tf.reduce_sum(tf.cast(above, tf.int32), axis=1) < param.top_k

    def unordered():
        return tf.reduce_any(tf.equal(_heap_top_k(scores, param.top_k), safe[:, None]), axis=1)

    correct = tf.cond(tf.reduce_any(tf.math.is_nan(scores)), unordered, ordered) & valid
    # Counts as float64, each quotient rounded once to float32: Caffe's float division (TF's float32 division
    # can be an ulp off it).
    correct = tf.cast(correct, tf.float64)
    weights = tf.cast(valid, tf.float64)
    tops = [Blob(tf.cast(tf.reduce_sum(correct) / tf.reduce_sum(weights), tf.float32))]
    if len(layer.tops) > 1:
        hits = tf.math.unsorted_segment_sum(correct, safe, shape[axis])
        totals = tf.math.unsorted_segment_sum(weights, safe, shape[axis])
        tops.append(Blob(tf.cast(tf.where(totals > 0, hits / tf.maximum(totals, 1.0), 0.0), tf.float32)))
    return tops


# -- the rest of BVLC Caffe's compute layers ----------------------------------------
# Where Caffe's Backward is not the gradient of its Forward (a clipped log, a
# 1e-4 in a denominator, a variance), tf.custom_gradient gives Caffe's.

@layer("Threshold")
@one_top
def threshold(x, lp):
    """1 where x > threshold, else 0; no gradient (Caffe's has no Backward: the registry's no_backward)."""
    return tf.cast(x > lp.threshold_param.threshold, tf.float32)


@layer("Clip")
@one_top
def clip(x, lp):
    """max(min, min(x, max)); the diff passes where min <= x <= max, the bounds included, as in Caffe."""
    p = lp.clip_param
    inside = (x >= p.min) & (x <= p.max)
    return tf.where(inside, x, tf.stop_gradient(tf.maximum(p.min, tf.minimum(x, p.max))))


@layer("Swish")
@one_top
def swish(x, lp):
    """x * sigmoid(beta x): its gradient is Caffe's beta y + sigmoid(beta x) (1 - beta y)."""
    return x * tf.sigmoid(lp.swish_param.beta * x)


@layer("Crop")
def crop(layer, bottoms, params, ctx):
    shape = layer.bottom_shapes[0]
    axis = canonical_axis(layer.param.crop_param.axis, len(shape))
    begin = crop_offsets(layer.param.crop_param, len(shape))
    size = [-1] * axis + list(layer.top_shapes[0][axis:])  # the axes before `axis` are kept whole
    return [Blob(tf.slice(bottoms[0].caffe, begin, size))]


@layer("Tile")
def tile(layer, bottoms, params, ctx):
    """Caffe's Tile repeats the whole of axis..end `tiles` times within each outer item: tf.tile on that axis."""
    blob = bottoms[0]
    multiples = [1] * blob.rank
    multiples[blob.axis(layer.param.tile_param.axis)] = layer.param.tile_param.tiles
    return [blob.like(tf.tile(blob.tensor, multiples))]


@layer("Reduction")
def reduction(layer, bottoms, params, ctx):
    """SUM, ASUM, SUMSQ or MEAN over the axes from `axis` on, times coeff."""
    param, shape = layer.param.reduction_param, layer.bottom_shapes[0]
    axis = canonical_axis(param.axis, len(shape))
    x = tf.reshape(bottoms[0].caffe, (-1, count(shape, axis)))
    op = pb.ReductionParameter
    values = {op.SUM: x, op.MEAN: x, op.ASUM: tf.abs(x), op.SUMSQ: tf.square(x)}[param.operation]
    coeff = param.coeff / count(shape, axis) if param.operation == op.MEAN else param.coeff
    y = tf.reduce_sum(values, axis=1)
    y = y if coeff == 1 else coeff * y
    return [Blob(tf.reshape(y, batch_free(layer.top_shapes[0]) if axis else ()))]


@layer("MVN")
def mvn(layer, bottoms, params, ctx):
    """(x - mean) / (std + eps) over each item (and channel); Caffe's backward divides by std + eps where the
    gradient of its forward has std in one place (they differ by eps)."""
    param, blob = layer.param.mvn_param, bottoms[0]
    axes = [blob.axis(a) for a in range(1 if param.across_channels else 2, blob.rank)]

    def mean(value):
        return tf.reduce_mean(value, axes, keepdims=True)

    @tf.custom_gradient
    def normalized(x):
        centered = x - mean(x)
        if not param.normalize_variance:
            return centered, lambda dy: dy - mean(dy)
        scale = tf.sqrt(mean(tf.square(centered))) + param.eps
        y = centered / scale
        return y, lambda dy: (dy - mean(dy) - y * mean(y * dy)) / scale
    return [blob.like(normalized(blob.tensor))]


@layer("SPP")
def spp(layer, bottoms, params, ctx):
    """Caffe's SPP: one Pooling per pyramid level, each flattened, concatenated (a single level is not)."""
    levels = spp_levels(layer.param.spp_param, layer.bottom_shapes[0])
    pieces = []
    for i, (pooling_param, shape) in enumerate(levels):
        level = Layer(f"{layer.name}/level{i}", "Pooling", layer.bottoms, [f"{layer.name}/level{i}"],
                      pb.LayerParameter(type="Pooling", pooling_param=pooling_param), None,
                      bottom_shapes=layer.bottom_shapes, top_shapes=[shape])
        pooled = pooling(level, bottoms, [], ctx)[0]
        if len(levels) == 1:
            return [pooled]
        pieces.append(tf.reshape(pooled.caffe, (-1, count(shape, 1))))
    return [Blob(tf.concat(pieces, axis=1))]


@layer("Filter")
def filter_(layer, bottoms, params, ctx):
    """The items whose selector (the last bottom) is non-zero; how many is known only from the data."""
    keep = tf.not_equal(tf.reshape(bottoms[-1].caffe, (-1,)), 0.0)
    return [blob.like(tf.boolean_mask(blob.tensor, keep)) for blob in bottoms[:-1]]


@layer("BatchReindex")
def batch_reindex(layer, bottoms, params, ctx):
    """Items of bottom 0 in the order of the indices in bottom 1; a diff sums over the picks, as Caffe's."""
    index = tf.cast(tf.reshape(bottoms[1].caffe, (-1,)), tf.int32)
    return [bottoms[0].like(tf.gather(bottoms[0].tensor, index))]


@layer("Embed")
def embed(layer, bottoms, params, ctx):
    """Row x of the (input_dim, num_output) weights for each index x (truncated to an integer, as Caffe's cast)."""
    y = tf.gather(params[0], tf.cast(bottoms[0].caffe, tf.int32))
    return [Blob(y + params[1] if layer.param.embed_param.bias_term else y)]


@layer("Im2col")
def im2col(layer, bottoms, params, ctx):
    """Caffe's im2col: channel c, kernel row i and column j become channel (c kh + i) kw + j of each output place."""
    _check_2d(layer, "im2col")
    kernel, pad, stride, dilation = conv_geometry(layer.param.convolution_param, 2)
    x = bottoms[0].as_nhwc
    if any(pad):
        x = tf.pad(x, [[0, 0], [pad[0], pad[0]], [pad[1], pad[1]], [0, 0]])
    patches = tf.image.extract_patches(x, [1, *kernel, 1], [1, *stride, 1], [1, *dilation, 1], "VALID")
    channels = layer.bottom_shapes[0][1]
    _, _, height, width = layer.top_shapes[0]
    patches = tf.reshape(patches, (-1, height, width, kernel[0], kernel[1], channels))  # TF orders (i, j, c)
    y = tf.reshape(tf.transpose(patches, (0, 1, 2, 5, 3, 4)), (-1, height, width, channels * kernel[0] * kernel[1]))
    return [Blob(y, True)]


@layer("Parameter")
def parameter(layer, bottoms, params, ctx):
    """Its blob as its top: the diff of the top is the blob's."""
    return [Blob(tf.identity(params[0]))]


# -- losses over probabilities and scores ------------------------------------------------

LOG_THRESHOLD = 1e-20  # Caffe's kLOG_THRESHOLD: the least probability its logs take


def _rows(layer, blob):
    """A blob as Caffe's N x (count / N) rows."""
    return tf.reshape(blob.caffe, (-1, count(layer.bottom_shapes[0], 1)))


def _weighted_log_loss(probabilities, weights):
    """-sum(weights * log(max(p, 1e-20))) / N, with Caffe's diff -weights / max(p, 1e-20) / N (the
    clipped entries too, where the gradient of the clipped forward would be 0)."""
    n = items(probabilities)

    @tf.custom_gradient
    def loss(p):
        clipped = tf.maximum(p, LOG_THRESHOLD)

        def grad(upstream):
            return upstream * (-weights / clipped / n)
        return -tf.reduce_sum(weights * tf.math.log(clipped)) / n, grad
    return loss(probabilities)


@layer("MultinomialLogisticLoss")
def multinomial_logistic_loss(layer, bottoms, params, ctx):
    p = _rows(layer, bottoms[0])
    return [Blob(_weighted_log_loss(p, tf.one_hot(_labels(bottoms[1]), p.shape[1])))]


@layer("InfogainLoss")
def infogain_loss(layer, bottoms, params, ctx):
    """-sum_j H[label, j] log p_j over N; H from the third bottom, or the `source` file."""
    p = _rows(layer, bottoms[0])
    if len(bottoms) > 2:
        matrix = tf.reshape(bottoms[2].caffe, (p.shape[1], p.shape[1]))
    else:
        matrix = tf.constant(infogain_matrix(layer, ctx.graph.source))
    return [Blob(_weighted_log_loss(p, tf.gather(matrix, _labels(bottoms[1]))))]


@layer("HingeLoss")
def hinge_loss(layer, bottoms, params, ctx):
    """sum of max(0, 1 -+ x) (minus at the label), L1 or squared (L2), over N."""
    x = _rows(layer, bottoms[0])
    sign = 1.0 - 2.0 * tf.one_hot(_labels(bottoms[1]), x.shape[1])
    margins = tf.maximum(0.0, 1.0 + sign * x)  # 0 first: at a tie the diff is 0, as Caffe's sign(0)
    if layer.param.hinge_loss_param.norm == pb.HingeLossParameter.L2:
        margins = tf.square(margins)
    return [Blob(tf.reduce_sum(margins) / items(x))]


@layer("ContrastiveLoss")
def contrastive_loss(layer, bottoms, params, ctx):
    """sum over pairs of d^2 (similar) or max(margin - d, 0)^2 (max(margin - d^2, 0) legacy), over 2N; the
    diff of a dissimilar pair divides by d + 1e-4, as Caffe's Backward does."""
    param = layer.param.contrastive_loss_param
    a = _rows(layer, bottoms[0])
    n, size = tf.shape(a)[0], tf.size(a)
    similar = tf.not_equal(tf.cast(tf.reshape(bottoms[2].caffe, (-1,))[:n], tf.int32), 0)
    b = tf.reshape(tf.reshape(bottoms[1].caffe, (-1,))[:size], tf.shape(a))  # Caffe reads count(a) values of b
    pairs = items(a)

    @tf.custom_gradient
    def loss(a, b):
        diff = a - b
        squared = tf.reduce_sum(tf.square(diff), axis=1)
        distance = tf.sqrt(squared)
        if param.legacy_version:
            short = param.margin - squared
            apart, scale = tf.maximum(short, 0.0), -1.0
        else:
            short = param.margin - distance
            apart, scale = tf.square(tf.maximum(short, 0.0)), -short / (distance + 1e-4)

        def grad(upstream):
            alpha = upstream / pairs
            coefficient = tf.where(similar, alpha, tf.where(short > 0, alpha * scale, 0.0))
            return coefficient[:, None] * diff, -coefficient[:, None] * diff
        return tf.reduce_sum(tf.where(similar, squared, apart)) / pairs / 2.0, grad
    return [Blob(loss(a, b))]


# -- recurrent layers: Caffe's unrolled LSTM and RNN nets, time-major ------------------------

def lstm_unit(previous, gates, cont):
    """Caffe's LSTMUnit on N x D cells, N x 4D gate inputs (i, f, o, g) and N markers: (c, h).

    f is cont * sigmoid (0 where cont is 0); the backward is Caffe's, whose
    f (1 - f) is the gradient only for cont in {0, 1}.
    """
    hidden = previous.shape[-1]
    cont = cont[:, None]

    @tf.custom_gradient
    def unit(previous, gates):
        i, f, o = (tf.sigmoid(gates[:, k * hidden:(k + 1) * hidden]) for k in range(3))
        g = tf.tanh(gates[:, 3 * hidden:])
        f = tf.where(tf.equal(cont, 0.0), 0.0, cont * f)
        c = f * previous + i * g
        tanh_c = tf.tanh(c)

        def grad(c_diff, h_diff):
            c_diff = tf.zeros_like(c) if c_diff is None else c_diff
            h_diff = tf.zeros_like(c) if h_diff is None else h_diff
            c_term = c_diff + h_diff * o * (1.0 - tf.square(tanh_c))
            gates_diff = tf.concat([c_term * g * i * (1.0 - i), c_term * previous * f * (1.0 - f),
                                    h_diff * tanh_c * o * (1.0 - o), c_term * i * (1.0 - tf.square(g))], axis=1)
            return c_term * f, gates_diff
        return (c, o * tanh_c), grad
    return unit(previous, gates)


@layer("LSTMUnit")
def lstm_unit_layer(layer, bottoms, params, ctx):
    cell, gates, cont = (blob.caffe for blob in bottoms)
    c, h = lstm_unit(cell[0], gates[0], cont[0])
    return [Blob(c[None]), Blob(h[None])]


def recurrent_state(layer):
    """The shapes of what a LSTM/RNN carries from one forward pass to the next: h (and c), 1 x N x num_output;
    nothing when expose_hidden gives them as bottoms and tops."""
    exposed, _ = recurrent_inputs(layer.param)
    state = (1, layer.bottom_shapes[0][1], layer.param.recurrent_param.num_output)
    return [] if exposed else [state] * RECURRENT_STATES[layer.type]


@layer("LSTM", "RNN", state=recurrent_state)
def recurrent(layer, bottoms, params, ctx):
    """Caffe's LSTM and RNN layers over T steps of N streams, as their unrolled nets compute them.

    Step t reads h_{t-1} * cont_t (and the LSTMUnit zeroes f where cont_t is
    0), so cont_t = 0 starts a new sequence. h_0 (and c_0) are the last
    step's of the previous forward pass (zeros at first), or the exposed
    bottoms; Caffe passes no diff into or out of them (hence stop_gradient).
    """
    exposed, static = recurrent_inputs(layer.param)
    hidden = layer.param.recurrent_param.num_output
    steps, streams = layer.bottom_shapes[0][:2]
    x = tf.reshape(bottoms[0].caffe, (steps * streams, -1))
    cont = tf.reshape(bottoms[1].caffe, (steps, streams))
    weights = list(params)
    inputs = tf.reshape(tf.matmul(x, weights[0], transpose_b=True) + weights[1], (steps, streams, -1))
    if static:
        static_x = tf.reshape(bottoms[2].caffe, (streams, -1))
        inputs = inputs + tf.matmul(static_x, weights[2], transpose_b=True)[None]
    recurrent_weights = weights[2 + static:]
    if exposed:
        state = [tf.reshape(blob.caffe, (streams, hidden)) for blob in bottoms[2 + static:]]
    else:
        carried = ctx.carried(layer)
        state = ([tf.reshape(v, (streams, hidden)) for v in carried] if carried
                 else [tf.zeros((streams, hidden))] * RECURRENT_STATES[layer.type])
    state = [tf.stop_gradient(s) for s in state]
    outputs = []
    for t in range(steps):
        held = state[0] * cont[t][:, None]
        if layer.type == "LSTM":
            gates = tf.matmul(held, recurrent_weights[0], transpose_b=True) + inputs[t]
            c, h = lstm_unit(state[1], gates, cont[t])
            state = [h, c]
            outputs.append(h)
        else:
            w_hh, w_ho, b_o = recurrent_weights
            h = tf.tanh(tf.matmul(held, w_hh, transpose_b=True) + inputs[t])
            state = [h]
            outputs.append(tf.tanh(tf.matmul(h, w_ho, transpose_b=True) + b_o))
    final = [tf.reshape(tf.stop_gradient(s), (1, streams, hidden)) for s in state]
    if not exposed:
        ctx.carry(layer, final)
    return [Blob(tf.stack(outputs))] + [Blob(s) for s in final[:exposed]]


check_table(LAYERS, "TensorFlow")
