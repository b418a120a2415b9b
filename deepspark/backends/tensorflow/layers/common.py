"""Common layers in TensorFlow: inner products, normalisations, elementwise joins, reshapes, the Python layer."""

import math

from deepspark.backends.tensorflow import python_layer
from deepspark.backends.tensorflow.layers.table import layer
from deepspark.backends.tensorflow.layout import Blob, batch_free, broadcast, same_layout
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import canonical_axis, count
from deepspark.proto import deepspark_pb2 as pb


@layer("Python")
def python(layer, bottoms, params, ctx):
    """Caffe's Python layer: the user's module on numpy, its backward as the gradient (python_layer)."""
    return [Blob(top) for top in python_layer.run(layer, [b.caffe for b in bottoms], ctx.graph)]


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


@layer("BatchNorm")
def batch_norm(layer, bottoms, params, ctx):
    """Caffe's BatchNorm: blobs (mean*s, var*s, s); batch statistics update them in TRAIN."""
    return [bottoms[0].like(_normalized(layer, bottoms[0], params, ctx)[0])]


@layer("BatchNormKyle")
def batch_norm_kyle(layer, bottoms, params, ctx):
    """The fork's BatchNormKyle: BatchNorm, then (use_alpha_beta) alpha x + beta per channel. Its statistics
    take no diff; with the stored ones its Backward returns before alpha's and beta's diffs: none then either."""
    y, shape, use_global = _normalized(layer, bottoms[0], [tf.stop_gradient(p) for p in params[:3]], ctx)
    if layer.param.batch_norm_param.use_alpha_beta:
        alpha, beta = (tf.stop_gradient(p) if use_global else p for p in params[3:5])
        y = y * tf.reshape(alpha, shape) + tf.reshape(beta, shape)
    return [bottoms[0].like(y)]


def _normalized(layer, blob, params, ctx):
    """(BatchNorm's output, the shape a per-channel vector broadcasts in, whether the stored statistics
    served): the batch's statistics in TRAIN (unless use_global_stats) moving the blobs."""
    param = layer.param.batch_norm_param
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
    return y, shape, use_global


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


@layer("Unsqueeze")
def unsqueeze(layer, bottoms, params, ctx):
    """The fork's Unsqueeze: a copy with a 1 inserted at `dim`. Its Backward is empty: no diff reaches the
    bottom, except in place, where the bottom's diff is the top's own."""
    y = tf.reshape(bottoms[0].caffe, batch_free(layer.top_shapes[0]))
    return [Blob(y if layer.in_place else tf.stop_gradient(y))]


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


@layer("Parameter")
def parameter(layer, bottoms, params, ctx):
    """Its blob as its top: the diff of the top is the blob's."""
    return [Blob(tf.identity(params[0]))]
