"""Caffe's weight fillers in NumPy, so that every backend starts from identical weights."""

import math

import numpy as np

from deepspark.graph import spec
from deepspark.proto import deepspark_pb2 as pb


def _fans(shape):
    """Caffe's fan_in = count / num and fan_out = count / channels (legacy axes, 1 when absent)."""
    count = math.prod(shape)
    num = shape[0] if len(shape) > 0 else 1
    channels = shape[1] if len(shape) > 1 else 1
    return count / num, count / channels


def _variance_scale(filler, shape):
    fan_in, fan_out = _fans(shape)
    if filler.variance_norm == pb.FillerParameter.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if filler.variance_norm == pb.FillerParameter.FAN_OUT:
        return fan_out
    return fan_in


def _no_sparse(filler):
    if filler.sparse != -1:
        raise ValueError(f"filler '{filler.type}' does not support sparse")


def fill(filler, shape, rng):
    """A float32 array of `shape` filled as Caffe's filler.hpp does."""
    shape = tuple(shape)
    kind = filler.type or "constant"
    if kind == "constant":
        _no_sparse(filler)
        return np.full(shape, filler.value, np.float32)
    if kind == "uniform":
        _no_sparse(filler)
        return rng.uniform(filler.min, filler.max, shape).astype(np.float32)
    if kind == "gaussian":
        data = rng.normal(filler.mean, filler.std, shape).astype(np.float32)
        if filler.sparse < -1:
            raise ValueError("gaussian filler sparse must be -1 or non-negative")
        if filler.sparse >= 0:
            if not shape:
                raise ValueError("sparse gaussian filler needs a blob with at least one axis")
            keep = rng.random(shape) < filler.sparse / shape[0]
            data *= keep
        return data
    if kind == "positive_unitball":
        _no_sparse(filler)
        data = rng.uniform(0.0, 1.0, shape).astype(np.float32)
        rows = data.reshape(shape[0] if shape else 1, -1)
        rows /= rows.sum(axis=1, keepdims=True)
        return data
    if kind == "xavier":
        _no_sparse(filler)
        scale = math.sqrt(3.0 / _variance_scale(filler, shape))
        return rng.uniform(-scale, scale, shape).astype(np.float32)
    if kind == "msra":
        _no_sparse(filler)
        std = math.sqrt(2.0 / _variance_scale(filler, shape))
        return rng.normal(0.0, std, shape).astype(np.float32)
    if kind == "bilinear":
        _no_sparse(filler)
        if len(shape) != 4 or shape[2] != shape[3]:
            raise ValueError(f"bilinear filler needs a 4-axis blob with square kernels, got {shape}")
        size = shape[3]
        f = math.ceil(size / 2.0)
        c = (2 * f - 1 - f % 2) / (2.0 * f)
        line = 1 - np.abs(np.arange(size) / f - c)
        kernel = np.outer(line, line).astype(np.float32)
        return np.broadcast_to(kernel, shape).copy()
    raise ValueError(f"unknown filler type '{kind}'; supported: constant, uniform, gaussian, "
                     "positive_unitball, xavier, msra, bilinear")


def layer_filler(layer, index):
    """The FillerParameter of a graph.Layer's parameter blob `index`, from its type's registry row."""
    given = spec(layer.type).fillers(layer.param)
    if index >= len(given):
        raise ValueError(f"layer '{layer.name}' ({layer.type}) has no parameter blob {index} to fill")
    return given[index]


def init_params(graph, seed=None):
    """Filled float32 arrays for graph.params, in Caffe's order.

    Each blob draws from its own stream, seeded by (seed, blob index), so a
    run is reproducible and one blob's filler does not shift another's.
    """
    base = np.random.SeedSequence(seed).entropy if seed is None or seed < 0 else seed
    arrays = []
    for i, param in enumerate(graph.params):
        layer = graph.layers[param.owner]
        rng = np.random.default_rng([base, i])
        arrays.append(fill(layer_filler(layer, param.index), param.shape, rng))
    return arrays
