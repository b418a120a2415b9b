"""The bundled pycaffe's extra types (brocolli-caffe 9.0.2) on both backends against it: the neurons ReLU6,
HardSwish, HardSigmoid; Pad, Unsqueeze, Upsample, PixelShuffle, MaxUnPool, BilinearInterpolate, Resize and
SmoothL1Loss; and Pooling's mask top, which MaxUnPool reads. Forward, and the diff its Backward gives: ReLU6's,
Resize's, SmoothL1Loss's and Pooling's; the others' is empty, so that no diff reaches their input (a ReLU on
another input gives the check one), except in place, where the input's diff is the top's own. Each refuses in
one line what the fork's CHECKs abort on or its Forward misreads."""

import os
import subprocess
import sys

import numpy as np
import pytest

from deepspark import checkpoint, export
from deepspark.backends import create_model
from deepspark.backends.caffe import runtime
from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.graph import Graph
from deepspark.proto import deepspark_pb2 as pb
from test_export import SERVE
from test_zoo_layers import L, check_backends, net_text, normal, seeded  # noqa: F401 (seeded: a fixture)

pytestmark = pytest.mark.caffe

tf = pytest.importorskip("tensorflow")


@pytest.fixture(scope="module", autouse=True)
def pycaffe():
    try:
        return runtime.caffe()
    except ImportError as error:
        pytest.skip(str(error))


# A copy of x (Power's identity), so that a layer in place rewrites the copy, not the Parameter's own blob.
COPY = L("copy", "Power", ["x"])


def relu6_reference(x, slope=0.0, threshold=6.0):
    return np.minimum(np.maximum(x, 0) + slope * np.minimum(x, 0), threshold)


@pytest.mark.parametrize("body, slope, threshold", [("", 0.0, 6.0),
                                                    ("relu6_param { negative_slope: 0.1 threshold: 2 }", 0.1, 2.0)])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu6(body, slope, threshold, in_place):
    x = normal(2, 3, 4, 5) * 4
    x[0, 0, 0, :2] = [0.0, threshold]  # the edges: Caffe's diff is the slope at 0 and none at the threshold
    top = "copy" if in_place else "r"
    values, diffs = check_backends(COPY + L("r", "ReLU6", ["copy"], body, [top]), {"x": x}, ranks={top: 4})
    np.testing.assert_allclose(values[top], relu6_reference(x, slope, threshold), rtol=1e-6)
    assert diffs["x"][0][0, 0, 0, 1] == 0


@pytest.mark.parametrize("kind, body, reference", [
    ("HardSwish", "", lambda x: x * np.clip(x / 6 + 0.5, 0, 1)),
    ("HardSigmoid", "", lambda x: np.clip(0.2 * x + 0.5, 0, 1)),
    ("HardSigmoid", "hardsigmoid_param { alpha: 0.3 beta: 0.4 }", lambda x: np.clip(0.3 * x + 0.4, 0, 1)),
])
def test_hard_neurons_and_their_empty_backward(kind, body, reference):
    """Beside a layer of the type, a ReLU on a second input gives the check a diff to compare: the type's own
    input gets none from Caffe's empty Backward; in place, its input's diff is the probe's."""
    x, y, z = normal(2, 3, 4, 5) * 4, normal(2, 3), normal(2, 3, 4, 5) * 4
    layers = (L("h", kind, ["x"], body) + L("r", "ReLU", ["y"]) + L("zc", "Power", ["z"])
              + L("hz", kind, ["zc"], body, ["zc"]))
    values, diffs = check_backends(layers, {"x": x, "y": y, "z": z}, ranks={"h": 4, "r": 2, "zc": 4})
    np.testing.assert_allclose(values["h"], reference(x), rtol=1e-6, atol=1e-7)
    assert not np.any(diffs["x"][0]) and np.any(diffs["z"][0])


# -- Pad, Unsqueeze: the fork's, with an empty Backward -------------------------------------------------------

CONV = L("conv", "Convolution", ["x"], 'convolution_param { num_output: 3 kernel_size: 1 bias_term: false '
         'weight_filler { type: "constant" value: 1 } }')


@pytest.mark.parametrize("body, reference", [
    ("pad_param { pad_u: 1 pad_d: 2 pad_l: 3 pad_r: 0 pad_value: 1.5 }",
     lambda x: np.pad(x, [(0, 0), (0, 0), (1, 2), (3, 0)], constant_values=1.5)),
    ("pad_param { pad_type: REPLICATE pad_u: 2 pad_d: 1 pad_l: 0 pad_r: 3 }",
     lambda x: np.pad(x, [(0, 0), (0, 0), (2, 1), (0, 3)], mode="edge")),
    ("pad_param { pad_type: REFLECT pad_u: 1 pad_d: 3 pad_l: 2 pad_r: 1 }",
     lambda x: np.pad(x, [(0, 0), (0, 0), (1, 3), (2, 1)], mode="reflect")),
    ("pad_param { pad_u: -1 pad_d: -2 pad_l: -1 pad_r: -3 }", lambda x: x[:, :, 1:-2, 1:-3]),
])
@pytest.mark.parametrize("after_conv", [False, True])
def test_pad_and_its_empty_backward(body, reference, after_conv):
    """Both layouts (after a Convolution the TF backend's blob is NHWC); a ReLU on a second input gives the check
    a diff: Pad's own input gets none from Caffe's empty Backward."""
    x, y = normal(2, 3, 5, 6), normal(2, 3)
    source = "conv" if after_conv else "x"
    layers = (CONV if after_conv else "") + L("p", "Pad", [source], body) + L("r", "ReLU", ["y"])
    values, diffs = check_backends(layers, {"x": x, "y": y}, ranks={"p": 4, "r": 2})
    expected = reference(x.sum(axis=1, keepdims=True).repeat(3, axis=1) if after_conv else x)
    np.testing.assert_allclose(values["p"], expected, rtol=1e-5, atol=1e-6)
    assert not np.any(diffs["x"][0])


@pytest.mark.parametrize("body, tops, message", [
    ("pad_param { pad_u: 1 pad_d: -1 }", None, "all non-negative or all negative"),
    ("pad_param { pad_type: REFLECT pad_l: 6 }", None, "must be smaller than"),
    ("pad_param { pad_u: -3 pad_d: -3 pad_l: -1 pad_r: -1 }", None, "negative size"),
    ("pad_param { pad_u: 1 }", ["x"], "in-place"),
])
def test_pad_refuses_what_caffe_aborts_or_indexes_past_on(body, tops, message):
    text = net_text(L("p", "Pad", ["x"], body, tops), {"x": normal(2, 3, 5, 6)}, {}, {})
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dim, expected", [(0, (1, 2, 3, 4)), (2, (2, 3, 1, 4)), (-1, (2, 3, 4, 1)),
                                           (-4, (1, 2, 3, 4))])
@pytest.mark.parametrize("in_place", [False, True])
def test_unsqueeze_and_its_empty_backward(dim, expected, in_place):
    """Caffe's empty Backward: no diff reaches the input; in place, the input's diff is the top's own."""
    x, y = normal(2, 3, 4), normal(2, 3)
    top = "copy" if in_place else "u"
    layers = COPY + L("u", "Unsqueeze", ["copy"], f"unsqueeze_param {{ dim: {dim} }}", [top]) + L("r", "ReLU", ["y"])
    values, diffs = check_backends(layers, {"x": x, "y": y}, ranks={top: 4, "r": 2})
    assert values[top].shape == expected
    np.testing.assert_array_equal(values[top], x.reshape(expected))
    assert np.any(diffs["x"][0]) == in_place


def test_unsqueeze_refuses_a_dim_out_of_range():
    text = net_text(L("u", "Unsqueeze", ["x"], "unsqueeze_param { dim: 4 }"), {"x": normal(2, 3, 4)}, {}, {})
    with pytest.raises(ConfigError, match="Unsqueeze dim 4 is out of range") as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


# -- SmoothL1Loss ---------------------------------------------------------------------------------------------

def smooth_l1_reference(a, b):
    d = a - b
    return np.where(np.abs(d) < 1, 0.5 * d * d, np.abs(d) - 0.5).sum() / a.shape[0]


def test_smooth_l1_loss():
    """Both inputs take Caffe's diff, +-f'(d) / N times the loss weight; the values cross |d| = 1 both ways."""
    a, b = normal(2, 3, 4, 5) * 2, normal(2, 3, 4, 5)
    layers = L("loss", "SmoothL1Loss", ["a", "b"], "loss_weight: 3")
    values, diffs = check_backends(layers, {"a": a, "b": b}, tops=["loss"])
    np.testing.assert_allclose(values["loss"], smooth_l1_reference(a, b), rtol=1e-5)
    assert np.any(diffs["a"][0]) and np.any(diffs["b"][0])


@pytest.mark.parametrize("shapes, message", [
    ([(2, 3, 4), (2, 4, 3)], "SmoothL1Loss's inputs differ in shape"),
    ([(2, 3), (3, 3)], "differ in their first axis"),
    ([(2, 3), (2, 3), (2, 3)], "abort this pycaffe"),
])
def test_smooth_l1_loss_refuses_what_caffe_aborts_on(shapes, message):
    sources = {name: normal(*shape) for name, shape in zip("abw", shapes)}
    text = net_text(L("loss", "SmoothL1Loss", list(sources)), sources, {}, {})
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


# -- Upsample: the fork's nearest neighbour, with an empty Backward -------------------------------------------

@pytest.mark.parametrize("body, shape, axes, after_conv", [
    ("upsample_param { scale: 2 }", (2, 3, 4, 5), (2, 3), False),
    ("upsample_param { scale: 2 }", (2, 3, 4, 5), (2, 3), True),
    ("upsample_param { scale: 3 dims_num: 3 }", (2, 3, 4), (2,), False),
    ("", (2, 3, 4, 5), (), True),
])
def test_upsample_and_its_empty_backward(body, shape, axes, after_conv):
    """Both layouts (after a Convolution the TF backend's blob is NHWC); the input takes no diff."""
    x, y = normal(*shape), normal(2, 3)
    source = "conv" if after_conv else "x"
    layers = (CONV if after_conv else "") + L("u", "Upsample", [source], body) + L("r", "ReLU", ["y"])
    values, diffs = check_backends(layers, {"x": x, "y": y}, ranks={"u": len(shape), "r": 2})
    expected = x.sum(axis=1, keepdims=True).repeat(3, axis=1) if after_conv else x
    scale = 3 if "scale: 3" in body else 2 if axes else 1
    for axis in axes:
        expected = expected.repeat(scale, axis=axis)
    np.testing.assert_allclose(values["u"], expected, rtol=1e-5, atol=1e-6)
    assert not np.any(diffs["x"][0])


@pytest.mark.parametrize("body, shape, tops, message", [
    ("upsample_param { dims_num: 5 }", (2, 3, 4, 5), None, "dims_num must be 3 or 4"),
    ("upsample_param { dims_num: 3 }", (2, 3, 4, 5), None, "needs a 3-axis input"),
    ("upsample_param { scale: 0 }", (2, 3, 4, 5), None, "at least 1"),
    ("upsample_param { scale: 2 }", (2, 3, 4, 5), ["x"], "in place"),
])
def test_upsample_refuses_what_caffe_aborts_or_misreads_on(body, shape, tops, message):
    text = net_text(L("u", "Upsample", ["x"], body, tops), {"x": normal(*shape)}, {}, {})
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


# -- PixelShuffle: the fork's, with an empty Backward ---------------------------------------------------------

def pixel_shuffle_reference(x, r):
    n, c, h, w = x.shape
    out = c // (r * r)
    y = x[:, :out * r * r].reshape(n, out, r, r, h, w).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(n, out, h * r, w * r)


@pytest.mark.parametrize("channels, r, after_conv", [(8, 2, False), (12, 2, True), (6, 2, False), (9, 3, False),
                                                     (3, 1, False)])
def test_pixel_shuffle_and_its_empty_backward(channels, r, after_conv):
    """6 channels at r 2: Caffe's CHECK passes (6 % 2) and it keeps 1 channel, from the first 4."""
    x, y = normal(2, channels, 3, 4), normal(2, 3)
    conv = (L("conv", "Convolution", ["x"], f'convolution_param {{ num_output: {channels} kernel_size: 1 '
              'bias_term: false weight_filler { type: "gaussian" std: 1 } }') if after_conv else "")
    layers = conv + L("s", "PixelShuffle", ["conv" if after_conv else "x"],
                      f"pixelshuffle_param {{ upscale_factor: {r} }}") + L("r", "ReLU", ["y"])
    values, diffs = check_backends(layers, {"x": x, "y": y}, ranks={"s": 4, "r": 2})
    assert values["s"].shape == (2, channels // (r * r), 3 * r, 4 * r)
    if not after_conv:
        np.testing.assert_array_equal(values["s"], pixel_shuffle_reference(x, r))
    assert not np.any(diffs["x"][0])


@pytest.mark.parametrize("body, shape, message", [
    ("pixelshuffle_param { upscale_factor: 2 }", (2, 3, 4, 5), "do not divide by upscale_factor 2"),
    ("pixelshuffle_param { upscale_factor: 2 }", (2, 4, 5), "takes a 4-axis input"),
    ("pixelshuffle_param { upscale_factor: 0 }", (2, 4, 4, 5), "at least 1"),
])
def test_pixel_shuffle_refuses_what_caffe_aborts_or_misreads_on(body, shape, message):
    text = net_text(L("s", "PixelShuffle", ["x"], body), {"x": normal(*shape)}, {}, {})
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


# -- MaxUnPool: the fork's, with an empty Backward ------------------------------------------------------------

def max_unpool_reference(x, mask, height, width):
    n, c = x.shape[:2]
    y = np.zeros((n, c, height * width), np.float32)
    for item in range(n):
        for channel in range(c):
            for value, index in zip(x[item, channel].ravel(), mask[item, channel].ravel()):
                y[item, channel, int(index)] = value  # in order: the later of two at one index wins
    return y.reshape(n, c, height, width)


def max_pooling(x, kernel, stride):
    """Caffe's max Pooling (no pad) and its mask: the first largest of each window, as index h W + w."""
    n, c, height, width = x.shape
    out = [-(-(size - kernel) // stride) + 1 for size in (height, width)]
    pooled, mask = np.zeros((n, c, *out), np.float32), np.zeros((n, c, *out), np.float32)
    for i in range(out[0]):
        for j in range(out[1]):
            h, w = i * stride, j * stride
            window = x[:, :, h:h + kernel, w:w + kernel]
            rows, cols = window.shape[2:]
            best = window.reshape(n, c, -1).argmax(axis=2)
            pooled[:, :, i, j] = window.reshape(n, c, -1).max(axis=2)
            mask[:, :, i, j] = (h + best // cols) * width + w + best % cols
    return pooled, mask


@pytest.mark.parametrize("kernel, stride", [(2, 2), (3, 2)])
def test_max_unpool_of_a_max_pooling(kernel, stride):
    """A max Pooling's values and mask (overlapping windows at kernel 3: one input twice), pooled by the test;
    neither takes a diff, so the ReLU on a third input gives the check one."""
    pooled, mask = max_pooling(normal(2, 3, 7, 7), kernel, stride)
    y = normal(2, 3)
    layers = L("u", "MaxUnPool", ["x", "mask"], "max_unpool_param { dst_h: 7 dst_w: 7 }") + L("r", "ReLU", ["y"])
    values, diffs = check_backends(layers, {"x": pooled, "mask": mask, "y": y}, ranks={"u": 4, "r": 2})
    np.testing.assert_array_equal(values["u"], max_unpool_reference(pooled, mask, 7, 7))
    assert not np.any(diffs["x"][0]) and not np.any(diffs["mask"][0])


def test_max_unpool_puts_the_later_of_two_values_at_one_index():
    x, y = normal(1, 2, 2, 3), normal(2, 3)
    mask = np.array([[[[0, 5, 5], [11, 0, 3]], [[1, 1, 1], [2, 2, 9]]]], np.float32)
    layers = L("u", "MaxUnPool", ["x", "mask"], "max_unpool_param { dst_h: 3 dst_w: 4 }") + L("r", "ReLU", ["y"])
    values, _ = check_backends(layers, {"x": x, "mask": mask, "y": y}, ranks={"u": 4, "r": 2})
    np.testing.assert_array_equal(values["u"], max_unpool_reference(x, mask, 3, 4))


@pytest.mark.parametrize("body, mask, message", [
    ("max_unpool_param { dst_h: 4 }", (2, 3, 2, 2), "needs max_unpool_param.dst_h and dst_w"),
    ("max_unpool_param { dst_h: 4 dst_w: 4 }", (2, 3, 4), "is not the shape of its input"),
])
def test_max_unpool_refuses_what_caffe_aborts_or_misreads_on(body, mask, message):
    sources = {"x": normal(2, 3, 2, 2), "mask": np.zeros(mask, np.float32)}
    text = net_text(L("u", "MaxUnPool", ["x", "mask"], body), sources, {}, {})
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


# -- BilinearInterpolate: the fork's, with an empty Backward --------------------------------------------------

@pytest.mark.parametrize("body, size", [
    ("bilinear_interpolate_param { dst_h: 9 dst_w: 4 }", (9, 4)),
    ("bilinear_interpolate_param { dst_h: 3 dst_w: 11 align_corners: false }", (3, 11)),
    ("bilinear_interpolate_param { dst_w: 8 }", (5, 8)),
    ("bilinear_interpolate_param { scale_factor: 1.5 align_corners: false }", (7, 9)),
    ("bilinear_interpolate_param { scale_factor: 2 }", (10, 12)),
])
@pytest.mark.parametrize("after_conv", [False, True])
def test_bilinear_interpolate_and_its_empty_backward(body, size, after_conv):
    x, y = normal(2, 3, 5, 6), normal(2, 3)
    source = "conv" if after_conv else "x"
    layers = (CONV if after_conv else "") + L("b", "BilinearInterpolate", [source], body) + L("r", "ReLU", ["y"])
    values, diffs = check_backends(layers, {"x": x, "y": y}, ranks={"b": 4, "r": 2})
    assert values["b"].shape == (2, 3) + size
    assert not np.any(diffs["x"][0])


@pytest.mark.parametrize("body, shape, message", [
    ("", (2, 3, 5, 6), "one of the two"),
    ("bilinear_interpolate_param { dst_h: 4 scale_factor: 2 }", (2, 3, 5, 6), "one of the two"),
    ("bilinear_interpolate_param { dst_h: 4 }", (2, 3, 1, 6), "at least 2x2"),
    ("bilinear_interpolate_param { dst_h: 1 }", (2, 3, 5, 6), "too small"),
    ("bilinear_interpolate_param { dst_h: 4 }", (2, 3, 6), "4-axis"),
])
def test_bilinear_interpolate_refuses_what_caffe_leaves_unset_or_misreads(body, shape, message):
    text = net_text(L("b", "BilinearInterpolate", ["x"], body), {"x": normal(*shape)}, {}, {})
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


# -- Resize: the fork's bilinear resize, with its Backward ----------------------------------------------------

@pytest.mark.parametrize("body, size", [
    ("resize_param { height: 9 width: 4 }", (9, 4)),
    ("resize_param { height: 3 width: 11 }", (3, 11)),
    ("resize_param { is_pyramid_test: true out_height_scale: 1.5 out_width_scale: 0.5 }", (7, 3)),
])
@pytest.mark.parametrize("after_conv", [False, True])
def test_resize_and_its_backward(body, size, after_conv):
    x = normal(2, 3, 5, 6)
    source = "conv" if after_conv else "x"
    layers = (CONV if after_conv else "") + L("s", "Resize", [source], body)
    values, diffs = check_backends(layers, {"x": x}, ranks={"s": 4})
    assert values["s"].shape == (2, 3) + size
    assert np.any(diffs["x"][0])


@pytest.mark.parametrize("body, shape, message", [
    ("resize_param { height: 4 }", (2, 3, 5, 6), "needs resize_param.height and width"),
    ("resize_param { is_pyramid_test: true out_height_scale: 2 }", (2, 3, 5, 6), "needs out_height_scale"),
    ("resize_param { height: 0 width: 3 }", (2, 3, 5, 6), "is empty"),
    ("resize_param { height: 4 width: 3 }", (2, 3, 6), "4-axis"),
])
def test_resize_refuses_what_caffe_aborts_on(body, shape, message):
    text = net_text(L("s", "Resize", ["x"], body), {"x": normal(*shape)}, {}, {})
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


# -- Pooling's mask top (Caffe's, which MaxUnPool reads) --------------------------------------------------------

@pytest.mark.parametrize("body", [
    "kernel_size: 3 stride: 2",
    "kernel_size: 2 stride: 2",
    "kernel_size: 3 stride: 2 pad: 1",
    "kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 3 pad_h: 1 pad_w: 0",
    "kernel_size: 3 stride: 3 ceil_mode: false",
    "global_pooling: true",
])
@pytest.mark.parametrize("after_conv", [False, True])
def test_max_pooling_mask_top(body, after_conv):
    """Both tops against pycaffe's, in both layouts, with padding and windows past the edge; equal values in a
    window (rounded inputs) take the first, as Caffe's loop. The values' diff reaches the input, the mask's none."""
    x = np.round(normal(2, 3, 7, 8) * 2) / 2
    source = "conv" if after_conv else "x"
    layers = (CONV if after_conv else "") + L("p", "Pooling", [source], f"pooling_param {{ pool: MAX {body} }}",
                                              ["p", "mask"])
    values, diffs = check_backends(layers, {"x": x}, ranks={"p": 4, "mask": 4})
    assert np.all(values["mask"] >= 0) and np.any(diffs["x"][0])
    if not after_conv and body.startswith("kernel_size: 2"):
        np.testing.assert_array_equal(values["mask"], max_pooling(x, 2, 2)[1])


def test_max_unpool_of_the_tf_backends_pooling_mask():
    layers = (L("p", "Pooling", ["x"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 }", ["p", "mask"])
              + L("u", "MaxUnPool", ["p", "mask"], "max_unpool_param { dst_h: 7 dst_w: 7 }"))
    x = normal(2, 3, 7, 7)
    values, _ = check_backends(layers, {"x": x}, ranks={"u": 4, "p": 4})
    pooled, mask = max_pooling(x, 3, 2)
    np.testing.assert_array_equal(values["u"], max_unpool_reference(pooled, mask, 7, 7))


@pytest.mark.parametrize("body, tops, message", [
    ("pool: AVE kernel_size: 2", 2, "Pooling makes 1 top"), ("pool: MAX kernel_size: 2", 3, "Pooling makes 1 or 2"),
    ("kernel_size: 2 pad_h: 1", 1, "pad or both pad_h and pad_w"),
    ("kernel_size: 2 stride: 1 stride_h: 1 stride_w: 1", 1, "stride or both"),
])
def test_pooling_refuses_what_caffe_aborts_on(body, tops, message):
    tops = ["p", "mask", "more"][:tops]
    text = net_text(L("p", "Pooling", ["x"], f"pooling_param {{ {body} }}", tops), {"x": normal(2, 3, 4, 4)}, {}, {})
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)


def pooling_deploy(height, width):
    """A deploy net of one max Pooling with its mask, on a 2 x 3 x height x width input."""
    return ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 '
            f'dim: {height} dim: {width} }} }} }}\n'
            + L("p", "Pooling", ["x"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }", ["p", "mask"]))


def test_a_saved_model_serves_the_pooling_mask_at_any_size(tmp_path):
    """A net of Pooling alone takes any size in its SavedModel: values and mask at another size than the
    prototxt's are pycaffe's at that size (the mask's index reads the data's width)."""
    deploy = pooling_deploy
    prototxt, weights = tmp_path / "deploy.prototxt", str(tmp_path / "none.caffemodel")
    prototxt.write_text(deploy(7, 8))
    model = create_model("tensorflow", parse_net(deploy(7, 8))[0], phase=pb.TEST)
    checkpoint.save_caffemodel(weights, model.graph, [])
    model.close()
    inputs, _ = export.export(str(prototxt), weights, str(tmp_path / "saved"))
    assert inputs["x"][2:] == ("any", "any")
    x = np.round(normal(2, 3, 9, 11) * 2) / 2
    np.savez(tmp_path / "in.npz", x=x)
    done = subprocess.run([sys.executable, "-c", SERVE, str(tmp_path / "saved"), str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    served = np.load(tmp_path / "out.npz")
    caffe = create_model("caffe", parse_net(deploy(9, 11))[0], phase=pb.TEST)
    try:
        want = caffe.forward({"x": x})
    finally:
        caffe.close()
    np.testing.assert_array_equal(served["p"], want["p"])
    np.testing.assert_array_equal(served["mask"], want["mask"])
