"""Caffe's fillers: statistics of each, Caffe's fan definitions, defaults, determinism by seed."""

import math

import numpy as np
import pytest
from google.protobuf import text_format

from deepspark import fillers
from deepspark.config import parse_net
from deepspark.graph import Graph
from deepspark.proto import deepspark_pb2 as pb


def filler(text):
    return text_format.Parse(text, pb.FillerParameter())


def fill(text, shape, seed=0):
    return fillers.fill(filler(text), shape, np.random.default_rng(seed))


def test_constant():
    data = fill('type: "constant" value: 2.5', (3, 4))
    assert data.dtype == np.float32 and np.all(data == 2.5)
    assert np.all(fill("", (5,)) == 0)  # Caffe's default filler: constant 0


def test_uniform():
    data = fill('type: "uniform" min: -2 max: 3', (200, 100))
    assert data.min() >= -2 and data.max() < 3
    assert data.mean() == pytest.approx(0.5, abs=0.05)
    assert data.var() == pytest.approx(25 / 12, rel=0.05)


def test_gaussian():
    data = fill('type: "gaussian" mean: 1 std: 0.5', (200, 100))
    assert data.mean() == pytest.approx(1.0, abs=0.02)
    assert data.std() == pytest.approx(0.5, rel=0.03)


def test_gaussian_sparse_keeps_sparse_over_num_outputs():
    data = fill('type: "gaussian" std: 1 sparse: 5', (20, 5000))
    assert np.mean(data != 0) == pytest.approx(5 / 20, abs=0.01)


def test_xavier_fan_in_out_average():
    shape = (64, 32, 3, 3)  # fan_in = 32*9 = 288, fan_out = 64*9 = 576
    for norm, n in (("FAN_IN", 288), ("FAN_OUT", 576), ("AVERAGE", 432)):
        data = fill(f'type: "xavier" variance_norm: {norm}', shape)
        scale = math.sqrt(3 / n)
        assert np.abs(data).max() <= scale
        assert data.var() == pytest.approx(scale ** 2 / 3, rel=0.05)


def test_xavier_on_inner_product_uses_caffe_fans():
    data = fill('type: "xavier"', (500, 800))  # fan_in = count/shape[0] = 800
    assert np.abs(data).max() <= math.sqrt(3 / 800)
    assert np.abs(data).max() > 0.95 * math.sqrt(3 / 800)


def test_msra():
    shape = (64, 32, 3, 3)
    for norm, n in (("FAN_IN", 288), ("FAN_OUT", 576), ("AVERAGE", 432)):
        data = fill(f'type: "msra" variance_norm: {norm}', shape)
        assert data.mean() == pytest.approx(0, abs=0.01)
        assert data.std() == pytest.approx(math.sqrt(2 / n), rel=0.05)


def test_positive_unitball_rows_sum_to_one():
    data = fill('type: "positive_unitball"', (10, 3, 4, 4))
    assert np.all(data >= 0)
    assert data.reshape(10, -1).sum(axis=1) == pytest.approx(np.ones(10), rel=1e-5)


def test_bilinear_is_caffes_upsampling_kernel():
    data = fill('type: "bilinear"', (2, 1, 4, 4))
    line = np.array([0.25, 0.75, 0.75, 0.25])  # f = 2, c = 0.75
    assert np.allclose(data[1, 0], np.outer(line, line))
    third = [1 / 3, 2 / 3, 1, 2 / 3, 1 / 3]  # factor 3: kernel 5, f = 3, c = 2/3
    assert np.allclose(fill('type: "bilinear"', (1, 1, 5, 5))[0, 0], np.outer(third, third))


def test_bad_fillers():
    with pytest.raises(ValueError, match="unknown filler"):
        fill('type: "orthogonal"', (3, 3))
    with pytest.raises(ValueError, match="sparse"):
        fill('type: "xavier" sparse: 2', (3, 3))
    with pytest.raises(ValueError, match="square"):
        fill('type: "bilinear"', (1, 1, 3, 4))


NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "prelu" type: "PReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.2 } } }
"""


def graph():
    return Graph(parse_net(NET)[0])


def test_init_params_defaults_and_order():
    params = fillers.init_params(graph(), seed=3)
    shapes = [p.shape for p in params]
    assert shapes == [(4, 3, 3, 3), (4,), (4,), (4,), (1,), (4,), (4,), (4,), (500 // 100, 4 * 6 * 6), (5,)]
    assert all(p.dtype == np.float32 for p in params)
    conv_w, conv_b, mean, var, factor, scale, shift, slope, ip_w, ip_b = params
    assert conv_w.std() > 0 and np.all(conv_b == 0)          # bias default: constant 0
    assert np.all(mean == 0) and np.all(var == 0) and np.all(factor == 0)  # BatchNorm blobs
    assert np.all(scale == 1) and np.all(shift == 0)          # Scale: 1, its bias: 0
    assert np.all(slope == 0.25)                              # PReLU: 0.25
    assert np.all(ip_b == np.float32(0.2))


def test_init_params_deterministic_by_seed():
    a = fillers.init_params(graph(), seed=7)
    b = fillers.init_params(graph(), seed=7)
    c = fillers.init_params(graph(), seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
