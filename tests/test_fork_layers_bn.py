"""The bundled pycaffe's BatchNormKyle (brocolli-caffe 9.0.2's batch_norm_kyle_layer.cpp) on both backends
against it: BatchNorm's statistics (the batch's in TRAIN, moving the three blobs; the stored ones in TEST or
with use_global_stats), then with use_alpha_beta a per-channel alpha x + beta. Forward, the diffs of its input
and of alpha and beta (none with the stored statistics: its Backward returns before them), the blobs a TRAIN
pass leaves, and a TEST pass. The fork's `BN` type (bn_layer.cpp) is not registered in this pycaffe, so it
stays refused in one line."""

import numpy as np
import pytest

from deepspark.backends import create_model
from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.graph import Graph
from deepspark.proto import deepspark_pb2 as pb
from test_zoo_layers import SOLVER, L, caffe, check_backends, net_text, normal, seeded  # noqa: F401 (fixtures)

pytestmark = pytest.mark.caffe

tf = pytest.importorskip("tensorflow")


CONV = L("conv", "Convolution", ["x"], 'convolution_param { num_output: 3 kernel_size: 1 bias_term: false '
         'weight_filler { type: "gaussian" std: 1 } }')


def kyle(body, source="x", top="bn"):
    return L("bn", "BatchNormKyle", [source], f"batch_norm_param {{ {body} }}", [top])


@pytest.mark.parametrize("body", ["", "use_alpha_beta: true", "use_alpha_beta: true eps: 0.01 "
                                  "moving_average_fraction: 0.5", "use_alpha_beta: true use_global_stats: true"])
@pytest.mark.parametrize("after_conv", [False, True])
def test_batch_norm_kyle_forward_and_diffs(body, after_conv):
    """Both layouts (after a Convolution the TF backend's blob is NHWC), the batch's statistics and the stored
    ones (zeros: x / sqrt(eps), as the fork's)."""
    x = normal(3, 3, 4, 5) * 2 + 1
    layers = (CONV if after_conv else "") + kyle(body, "conv" if after_conv else "x")
    values, diffs = check_backends(layers, {"x": x}, ranks={"bn": 4})
    if not after_conv and "global" not in body:
        mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
        eps = 0.01 if "eps" in body else 1e-5
        np.testing.assert_allclose(values["bn"], (x - mean) / np.sqrt(var + eps), rtol=1e-4, atol=1e-4)
    if "alpha" in body:
        alpha, beta = diffs["bn"][3:5]
        assert np.any(alpha) != ("global" in body) and np.any(beta) != ("global" in body)


@pytest.mark.parametrize("shape", [(6, 4), (4, 3, 5)])
def test_batch_norm_kyle_other_ranks_and_in_place(shape):
    """In place on a copy of x; a ReLU after it, since a normalised blob's probe alone sums to about 0."""
    x = normal(*shape)
    layers = L("copy", "Power", ["x"]) + kyle("use_alpha_beta: true", "copy", "copy") + L("relu", "ReLU", ["copy"])
    check_backends(layers, {"x": x}, ranks={"relu": len(shape)})


NET = """layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 dim: 2 dim: 3 } } }
layer { name: "bn" type: "BatchNormKyle" bottom: "x" top: "y"
        batch_norm_param { use_alpha_beta: true moving_average_fraction: 0.75 } }
"""


def passes(backend, phase, blobs, x):
    """The top of two forward passes of NET in `phase` from `blobs`, and the layer's blobs after them."""
    model = create_model(backend, parse_net(NET)[0], SOLVER, phase=phase, seed=5)
    try:
        model.set_blobs("bn", blobs)
        model.forward({"x": x})
        return model.forward({"x": x * 2})["y"], model.get_blobs("bn")
    finally:
        model.close()


@pytest.mark.parametrize("phase", [pb.TRAIN, pb.TEST])
def test_batch_norm_kyle_statistics_as_pycaffe(phase):
    """TRAIN moves the three statistics (the variance's with m / (m - 1)) and normalises by the batch's; TEST
    reads them, scaled by the third, and moves nothing; alpha and beta as set."""
    x = normal(4, 3, 2, 3)
    blobs = [normal(3), np.abs(normal(3)) + 0.5, np.array([2.0], np.float32), normal(3), normal(3)]
    want_top, want_blobs = passes("caffe", phase, blobs, x)
    got_top, got_blobs = passes("tensorflow", phase, blobs, x)
    np.testing.assert_allclose(got_top, want_top, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_blobs, want_blobs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (phase == pb.TRAIN) == (not np.allclose(want_blobs[2], blobs[2]))


TRAIN_NET = NET + """layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "x" top: "loss" }
"""
DECAYING = pb.SolverParameter(type="SGD", base_lr=0.5, momentum=0.9, weight_decay=0.1)


def stepped(backend, blobs, batches):
    """The layer's blobs after a solver step on each batch."""
    model = create_model(backend, parse_net(TRAIN_NET)[0], DECAYING, seed=5)
    try:
        model.set_blobs("bn", blobs)
        for batch in batches:
            model.step({"x": batch})
        return model.get_blobs("bn")
    finally:
        model.close()


def test_batch_norm_kyle_statistics_take_the_solvers_steps_as_pycaffe():
    """Unlike BatchNorm, the fork's layer leaves its statistics' ParamSpecs as given (lr_mult 1 by default):
    pycaffe's solver decays them by weight_decay after the forward pass moved them, with momentum."""
    blobs = [normal(3), np.abs(normal(3)) + 0.5, np.array([2.0], np.float32), normal(3), normal(3)]
    batches = [normal(4, 3, 2, 3) for _ in range(3)]
    want, got = stepped("caffe", blobs, batches), stepped("tensorflow", blobs, batches)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert want[2][0] != pytest.approx(0.75 * (0.75 * (0.75 * 2 + 1) + 1) + 1)  # not the moving average alone


def test_bn_is_refused_in_one_line():
    """bn_layer.cpp registers no type in this pycaffe (it aborts: Unknown layer type: BN)."""
    text = net_text(L("bn", "BN", ["x"], "bn_param { frozen: true }"), {"x": normal(2, 3, 4, 4)}, {}, {})
    with pytest.raises(ConfigError, match="BN") as error:
        Graph(parse_net(text)[0], pb.TRAIN)
    assert "\n" not in str(error.value)
