"""Neuron layers in TensorFlow: one top from one bottom, elementwise, the layout kept."""

import math

from deepspark.backends.tensorflow.layers.table import layer
from deepspark.backends.tensorflow.layout import Blob, broadcast, one_top
from deepspark.backends.tensorflow.runtime import tf


@layer("Dropout")
def dropout(layer, bottoms, params, ctx):
    """Caffe's dropout: keep with probability 1-p and scale by 1/(1-p) in TRAIN; identity in TEST."""
    ratio = layer.param.dropout_param.dropout_ratio
    x = bottoms[0].tensor
    if not ctx.train or ratio == 0:
        return [bottoms[0]]
    keep = ctx.rng.uniform(tf.shape(x)) >= ratio
    return [bottoms[0].like(tf.where(keep, x * (1.0 / (1.0 - ratio)), 0.0))]


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


@layer("ReLU6")
def relu6(layer, bottoms, params, ctx):
    """The fork's ReLU6: min(max(x, 0) + negative_slope min(x, 0), threshold). Its Backward: the diff times 1
    where the input is positive, else negative_slope, and 0 from the threshold on; in place, Caffe reads the
    top for the input, and so does this."""
    p = layer.param.relu6_param

    @tf.custom_gradient
    def clipped(x):
        y = tf.minimum(tf.maximum(x, 0.0) + p.negative_slope * tf.minimum(x, 0.0), p.threshold)
        seen = y if layer.in_place else x

        def backward(dy):
            return dy * tf.where(seen > 0, 1.0, p.negative_slope) * tf.cast(seen < p.threshold, tf.float32)
        return y, backward
    return [bottoms[0].like(clipped(bottoms[0].tensor))]


def _without_backward(function):
    """A layer function whose Caffe Backward is empty: no diff reaches its bottom, except in place, where the
    bottom's diff is the top's own, unchanged."""
    def run(layer, bottoms, params, ctx):
        x = bottoms[0].tensor
        if not layer.in_place:
            return [bottoms[0].like(tf.stop_gradient(function(x, layer.param)))]

        @tf.custom_gradient
        def passed(x):
            return function(x, layer.param), lambda dy: dy
        return [bottoms[0].like(passed(x))]
    run.__name__, run.__doc__ = function.__name__, function.__doc__
    return run


def hard_swish(x, lp):
    """The fork's HardSwish: x max(0, min(1, x / 6 + 0.5)); Caffe's Backward is empty."""
    return x * tf.clip_by_value(x / 6.0 + 0.5, 0.0, 1.0)


def hard_sigmoid(x, lp):
    """The fork's HardSigmoid: max(0, min(1, alpha x + beta)); Caffe's Backward is empty."""
    p = lp.hardsigmoid_param
    return tf.clip_by_value(x * p.alpha + p.beta, 0.0, 1.0)


layer("HardSwish")(_without_backward(hard_swish))
layer("HardSigmoid")(_without_backward(hard_sigmoid))
