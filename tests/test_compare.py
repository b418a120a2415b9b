"""`deepspark compare`: the Caffe and TensorFlow backends agree blob by blob and step by step."""

import io
import os
import re

import numpy as np
import pytest

from deepspark import compare
from deepspark.backends import create_model
from deepspark.config import parse_net
from deepspark.graph import Graph, with_taps
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.caffe

FASHION = os.path.join(ROOT, "data", "fashion_mnist_train_lmdb")
ENV = {"GLOG_minloglevel": "2", "TF_CPP_MIN_LOG_LEVEL": "2"}

# A 1x1 convolution over a 2x2 image of 2 channels: C == H == W, where a
# transpose between NCHW and NHWC is not a reshape.
CUBE_NET = """
name: "cube"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 2 dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "y"
  convolution_param { num_output: 1 kernel_size: 1 bias_term: false weight_filler { type: "constant" value: 1 } } }
layer { name: "pool" type: "Pooling" bottom: "y" top: "p" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
"""


def test_layout_change_of_equal_sized_axes_is_a_transpose():
    """Pins a TF backend fix: _permute took NCHW->NHWC of a 1x2x2x2 blob for a free reshape."""
    import tensorflow as tf

    from deepspark.backends.tensorflow.layout import _permute

    x = np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)
    np.testing.assert_array_equal(_permute(tf.constant(x), (0, 2, 3, 1)).numpy(), x.transpose(0, 2, 3, 1))
    one = np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3)  # one channel: a reshape, and still right
    np.testing.assert_array_equal(_permute(tf.constant(one), (0, 2, 3, 1)).numpy(), one.transpose(0, 2, 3, 1))

    x = np.zeros((1, 2, 2, 2), np.float32)
    x[0, 0] = [[1, 0], [0.5, 0.25]]
    x[0, 1] = [[0, 1], [0.5, 0.75]]
    net = parse_net(CUBE_NET)[0]
    expected = x.sum(axis=1)[0]  # every position sums to 1
    for backend in ("caffe", "tensorflow"):
        out = create_model(backend, net, None, phase=pb.TEST).forward({"x": x})
        np.testing.assert_allclose(out["p"].ravel(), [1.0], err_msg=backend)
    model = create_model("tensorflow", parse_net(CUBE_NET.split('layer { name: "pool"')[0])[0], None, phase=pb.TEST)
    np.testing.assert_allclose(model.forward({"x": x})["y"][0, 0], expected)


def test_difference_is_relative_to_the_blob_scale():
    assert compare.difference([1.0, 0.0], [1.0, 0.0]) == (0.0, 0.0)
    absolute, relative = compare.difference([100.0, 1e-9], [100.0, 2e-9])
    assert absolute == pytest.approx(1e-9) and relative == pytest.approx(1e-11)
    assert compare.difference([1.0], [1.0, 2.0]) == (float("inf"), float("inf"))
    assert compare.difference([np.nan, 1.0], [np.nan, 1.0]) == (0.0, 0.0)
    assert compare.difference([np.inf, 1.0], [1.0, 1.0])[1] == float("inf")


def test_taps_expose_every_blob_without_changing_the_outputs():
    net = parse_net(CUBE_NET + 'layer { name: "relu" type: "ReLU" bottom: "p" top: "p" }')[0]
    tapped = with_taps(net, Graph(net, pb.TEST))
    outputs = Graph(tapped, pb.TEST).outputs
    assert outputs == ["y@conv", "p"]  # pool's 'p' is rewritten in place: tapped after relu, i.e. the output


def run_compare(*args):
    status, out, err = run_cli("compare", *args, env=ENV)
    return status, out, err


ZOO = sorted(name for name in os.listdir(os.path.join(ROOT, "models"))
             if os.path.exists(os.path.join(ROOT, "models", name, "deploy.prototxt")))


@pytest.mark.parametrize("model", ZOO)
def test_compare_forward_every_blob_on_every_zoo_net(model):
    batch = "2" if model in ("lenet", "cifar10_quick", "cifar10_full") else "1"
    status, out, err = run_compare("--model", f"models/{model}", "--batch-size", batch)
    assert status == 0, out + err
    assert "prob" in out and "images/s: caffe" in out and "OK: within tolerance" in out


@pytest.mark.caffe
def test_a_deploy_net_without_fillers_is_compared_on_weights_that_mean_something(tmp_path):
    """BVLC's deploy nets carry no fillers: Caffe's default leaves every weight 0, and every difference 0."""
    text = open(os.path.join(ROOT, "models", "lenet", "deploy.prototxt")).read()
    bare = re.sub(r"weight_filler \{[^}]*\}", "", text)
    assert "weight_filler" not in bare
    (tmp_path / "deploy.prototxt").write_text(bare)
    status, out, err = run_compare("--model", str(tmp_path / "deploy.prototxt"), "--batch-size", "2")
    assert status == 0, out + err
    assert "no weight filler in the prototxt for conv1, conv2, ip1, ip2: " in out
    assert "Caffe's xavier filler (seed 1701)" in out and "warning:" not in out
    ip2 = re.search(r"^ip2@ip2 +2x10 +\S+ +(\S+) +(\S+)$", out, re.M)  # floor, max abs, rel
    assert ip2 and 0 < float(ip2.group(2)) < 1e-4, out  # a real, small difference, not a vacuous 0


KYLE_NET = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 2 dim: 2 } } }
layer { name: "bn" type: "BatchNormKyle" bottom: "x" top: "y" batch_norm_param { use_alpha_beta: true } }
"""


def test_an_untrained_batch_norm_kyle_is_compared_with_unit_statistics():
    """Its fillers' zero statistics would make the TEST pass x / sqrt(eps); both backends agree on x / sqrt(1 + eps)."""
    x = np.random.default_rng(3).normal(size=(2, 3, 2, 2)).astype(np.float32)
    models = compare.build(["caffe", "tensorflow"], parse_net(KYLE_NET)[0])
    try:
        for name, model in models.items():
            np.testing.assert_allclose(model.forward({"x": x})["y"], x / np.sqrt(1 + 1e-5), rtol=1e-5, err_msg=name)
    finally:
        compare.close_all(models)


def test_compare_train_val_with_data_layers_and_no_lmdb_uses_the_deploy_shapes():
    status, out, err = run_compare("--model", "models/cifar10_full/train_val.prototxt", "--batch-size", "2")
    assert status == 0, out + err
    assert "synthetic data, batch 2" in out and "accuracy" in out


def test_compare_exit_status_and_errors(tmp_path):
    # A negative tolerance is exceeded by any difference, even none: the failing path.
    status, out, _ = run_compare("--model", "models/lenet", "--batch-size", "2", "--forward-tolerance", "-1")
    assert status == 1 and "FORWARD DIFFERS" in out and "FAILED" in out
    status, _, err = run_compare("--model", "models/lenet", "--backends", "caffe,theano")
    assert status == 1 and "unknown backend 'theano'" in err
    with pytest.raises(ConfigError, match="at least two"):
        compare.run("models/lenet", backends=["caffe"], out=io.StringIO())


def test_training_loss_curves_track_and_each_step_agrees(tmp_path):
    """LeNet on Fashion-MNIST (or synthetic digits without the LMDB): 12 iterations on both backends."""
    solver = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the solver's LMDB paths are relative to the repository
    try:
        result = compare.run(os.path.join(ROOT, "models", "lenet"), backends=["caffe", "tensorflow"], solver_path=solver,
                             iterations=12, batch_size=32, out=out)
    finally:
        os.chdir(cwd)
    training = result["training"]
    caffe_losses, tf_losses = training["losses"]["caffe"], training["losses"]["tensorflow"]
    assert len(caffe_losses) == 12 and caffe_losses[-1] < caffe_losses[0]
    np.testing.assert_allclose(tf_losses, caffe_losses, rtol=1e-3)
    assert training["worst_step_relative"] < 1e-5, out.getvalue()
    assert result["ok"], out.getvalue()
    assert "step loss" in out.getvalue()


def test_iter_size_steps_agree_across_backends():
    """Caffe's iter_size > 1 (our passes before Caffe's own) against the TF backend's accumulation."""
    net = parse_net("""
name: "acc"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 1 dim: 6 dim: 6 } shape { dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
""")[0]
    param = pb.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=1e-3, lr_policy="fixed", iter_size=2,
                               clip_gradients=0.5, random_seed=2)
    models = compare.build(["caffe", "tensorflow"], net, param, pb.TRAIN)
    rng = np.random.default_rng(3)
    plan = [[{"data": rng.standard_normal((8, 1, 6, 6)).astype(np.float32),
              "label": rng.integers(0, 3, 8).astype(np.float32)} for _ in range(2)] for _ in range(5)]
    _, losses = compare.compare_training(models, plan)
    np.testing.assert_allclose(losses["tensorflow"], losses["caffe"], rtol=1e-5)
    np.testing.assert_allclose(models["tensorflow"].get_flat(), models["caffe"].get_flat(), rtol=1e-4, atol=1e-6)


# A small net with Dropout in TRAIN: drop1 with its ratio written, drop2 with Caffe's default (0.5).
DROPOUT_NET = """name: "drop"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 1 dim: 6 dim: 6 } shape { dim: 8 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 16 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.4 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 12 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "drop2" type: "Dropout" bottom: "ip2" top: "ip2" }
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }
"""
DROPOUT_SOLVER = """net: "{net}"
base_lr: 0.1
momentum: 0.9
weight_decay: 0.001
lr_policy: "fixed"
max_iter: 100
random_seed: 5
"""


def dropout_job(folder):
    (folder / "net.prototxt").write_text(DROPOUT_NET)
    (folder / "solver.prototxt").write_text(DROPOUT_SOLVER.format(net=folder / "net.prototxt"))
    return str(folder / "net.prototxt"), str(folder / "solver.prototxt")


def test_with_dropout_the_training_comparison_switches_it_off_and_says_so(tmp_path):
    net, solver = dropout_job(tmp_path)
    status, out, err = run_compare("--model", net, "--solver", solver, "--iterations", "4")
    assert status == 0, out + err
    lines = [line for line in out.splitlines() if line.startswith("compare: Dropout")]
    assert lines == ["compare: Dropout switched off in layers drop1, drop2 (each backend draws its own masks)"], out
    assert re.search(r"^worst weight difference one step from the same state: \S+ relative \(ip\d\[\d\] on "
                     r"tensorflow, iteration \d\)(, noise floor \S+)?$", out, re.M), out
    assert "OK: within tolerance" in out
    # What it avoids: with the masks on, each backend draws its own, and the same step gives another loss.
    models = compare.build(["caffe", "tensorflow"], parse_net(DROPOUT_NET)[0],
                           pb.SolverParameter(base_lr=0.1, lr_policy="fixed", random_seed=5), pb.TRAIN)
    rng = np.random.default_rng(1)
    plan = [{"data": rng.standard_normal((8, 1, 6, 6)).astype(np.float32),
             "label": rng.integers(0, 4, 8).astype(np.float32)} for _ in range(2)]
    _, losses = compare.compare_training(models, plan)
    compare.close_all(models)
    assert np.max(np.abs(np.subtract(losses["caffe"], losses["tensorflow"]))) > 1e-3, losses


def test_a_step_whose_weights_differ_fails_naming_the_blob(tmp_path):
    """Real steps on both backends from the same state, one net with ip2's bias at lr_mult 3: the judge names it.
    Then the command's failing path: any difference exceeds a negative tolerance, exit status 1, blob named."""
    net = parse_net("\n".join(line for line in DROPOUT_NET.splitlines() if '"Dropout"' not in line))[0]
    other = parse_net(str(net).replace('name: "ip2"\n  type: "InnerProduct"',
                                       'name: "ip2"\n  type: "InnerProduct"\n  param { lr_mult: 1 }\n'
                                       '  param { lr_mult: 3 }'))[0]
    assert len(other.layer[3].param) == 2
    param = pb.SolverParameter(base_lr=0.1, momentum=0.9, lr_policy="fixed", random_seed=5)
    models = {"caffe": create_model("caffe", net, param, phase=pb.TRAIN, seed=5),
              "tensorflow": create_model("tensorflow", other, param, phase=pb.TRAIN, seed=5)}
    try:
        rng = np.random.default_rng(2)
        plan = [{"data": rng.standard_normal((8, 1, 6, 6)).astype(np.float32),
                 "label": rng.integers(0, 4, 8).astype(np.float32)} for _ in range(3)]
        first = models["caffe"]
        steps = compare.compare_steps(models, plan, first.get_params(), first.get_state())
    finally:
        compare.close_all(models)
    worst = compare.worst_weights(steps)
    assert worst["blob"] == "ip2[1]" and worst["backend"] == "tensorflow" and worst["relative"] > 1e-3, steps
    out, result = io.StringIO(), {"ok": True}
    compare.judge_weights(out, result, worst, 1e-4)
    assert not result["ok"] and out.getvalue().startswith("WEIGHTS DIFFER: ip2[1] on tensorflow after the step of "
                                                          "iteration "), out.getvalue()
    compare.judge_weights(out, result := {"ok": True}, {**worst, "relative": 5e-5}, 1e-4)
    assert result["ok"]

    solver_net, solver = dropout_job(tmp_path)
    status, out, _ = run_compare("--model", solver_net, "--solver", solver, "--iterations", "2",
                                 "--weight-tolerance", "-1")
    assert status == 1 and "FAILED" in out and "LOSS DIFFERS" not in out, out
    assert re.search(r"^WEIGHTS DIFFER: ip\d\[\d\] on tensorflow after the step of iteration \d, relative difference "
                     r"\S+ > -1( \+ 2 x noise floor \S+)?$", out, re.M), out


def test_weight_difference_names_the_blob_that_differs_most():
    blobs = [("conv1[0]", [0, 1]), ("conv1[1]", [0, 1]), ("ip[0]", [2])]
    a = [np.ones((3, 2), np.float32), np.zeros(3, np.float32), np.full(4, 10.0, np.float32)]
    b = [a[0] + 1e-6, a[1].copy(), a[2].copy()]
    b[2][1] = 10.5
    assert compare.weight_difference(a, b, blobs) == (pytest.approx(0.5 / 10.5), "ip[0]", pytest.approx(0.5))
    assert compare.weight_difference(a, a, blobs) == (0.0, "conv1[0]", 0.0)
    # A bias near 0 is judged at its layer's scale (the weights' 1), not at its own 1e-8.
    b = [a[0].copy(), np.full(3, 1e-8, np.float32), a[2].copy()]
    c = [a[0].copy(), np.full(3, 1.1e-8, np.float32), a[2].copy()]
    assert compare.weight_difference(b, c, blobs)[:2] == (pytest.approx(1e-9, rel=1e-3), "conv1[1]")
    c[1][0] = 0.5  # a bias that really moved otherwise
    assert compare.weight_difference(b, c, blobs)[:2] == (pytest.approx(0.5), "conv1[1]")
    c[2][0] = np.nan  # NaN on one side only
    assert compare.weight_difference(b, c, blobs)[:2] == (float("inf"), "ip[0]")
    steps = {"tensorflow": [(0.0, 1e-7, "conv1[0]"), (0.0, 0.2, "ip[0]")], "other": [(0.0, 0.1, "conv1[1]")]}
    assert compare.worst_weights(steps) == {"relative": 0.2, "blob": "ip[0]", "iteration": 1, "backend": "tensorflow",
                                            "floor": 0.0}
    # Above its noise floor: 0.2 with a floor of 0.15 lies below 0.1 with none.
    steps["tensorflow"][1] += (0.15,)
    assert compare.worst_weights(steps)["blob"] == "conv1[1]"
    graph = Graph(parse_net(DROPOUT_NET)[0], pb.TRAIN)
    assert compare.param_blobs(graph) == [(f"ip{i}[{k}]", [2 * i - 2, 2 * i - 1]) for i in (1, 2, 3) for k in (0, 1)]


# An InnerProduct into a EuclideanLoss, stepped by Adam: what the tolerance rule is tested on.
EUCLIDEAN_NET = """
name: "euclidean"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 64 dim: 48 } } }
layer { name: "target" type: "Input" top: "target" input_param { shape { dim: 64 dim: 8 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "y"
        inner_product_param { num_output: 8 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "target" top: "loss" }
"""


def adam_steps(batch, lr_mult=1):
    """compare_steps' rows of one Adam step of EUCLIDEAN_NET on `batch`, pycaffe against TensorFlow (whose ip weights
    take `lr_mult`), and the worst blob."""
    net = parse_net(EUCLIDEAN_NET)[0]
    other = parse_net(EUCLIDEAN_NET.replace('bottom: "data" top: "y"', f'bottom: "data" top: "y" param {{ lr_mult: '
                                                                        f'{lr_mult} }}'))[0]
    param = pb.SolverParameter(type="Adam", base_lr=0.01, momentum=0.9, momentum2=0.999, delta=1e-8,
                               lr_policy="fixed", random_seed=3)
    models = {"caffe": create_model("caffe", net, param, phase=pb.TRAIN, seed=3),
              "tensorflow": create_model("tensorflow", other, param, phase=pb.TRAIN, seed=3)}
    try:
        first = models["caffe"]
        if batch is None:  # residuals that cancel: each odd item's target mirrors the even one's about the output
            rng = np.random.default_rng(4)
            x = np.repeat(rng.standard_normal((32, 48)), 2, axis=0).astype(np.float32)
            weights, bias = first.get_params()
            y = x.astype(np.float64) @ weights.T.astype(np.float64) + bias
            target = rng.standard_normal((64, 8))
            target[1::2] = 2 * y[1::2] - target[::2]
            batch = {"data": x, "target": target.astype(np.float32)}
        steps = compare.compare_steps(models, [batch], first.get_params(), first.get_state())
    finally:
        compare.close_all(models)
    return compare.worst_weights(steps)


def test_adams_per_element_normalisation_is_judged_above_its_noise_floor():
    """A gradient within rounding of zero (two items whose residuals cancel) is normalised by Adam into a step of
    up to the learning rate, either way: the backends' steps differed by 1e-2 of the weights, failing a fixed 1e-4
    (as huangzehao/caffe-vdsr's 8.6e-4 did), though pycaffe against itself on the batch nudged by 1e-6 differs as
    much. Judged above that noise floor it passes; a real difference (ip's weights at 3x the rate) on a batch of
    ordinary gradients still fails, naming the blob."""
    worst = adam_steps(None)
    assert worst["relative"] > 1e-3 and worst["floor"] > 1e-3, worst  # the case: both far above 1e-4
    out, result = io.StringIO(), {"ok": True}
    compare.judge_weights(out, result, worst, 1e-4)
    assert result["ok"], out.getvalue()
    rng = np.random.default_rng(5)
    batch = {"data": rng.standard_normal((64, 48)).astype(np.float32),
             "target": rng.standard_normal((64, 8)).astype(np.float32)}
    assert adam_steps(batch)["relative"] < 1e-5
    worst = adam_steps(batch, lr_mult=3)
    compare.judge_weights(out, result, worst, 1e-4)
    assert worst["blob"] == "ip[0]" and worst["floor"] < 1e-5 and not result["ok"], worst


def test_a_recurrent_nets_noise_floor_is_measured_from_the_same_hidden_state():
    """An LSTM carries its last hidden state into the next forward: measured on the first backend's own second
    pass the floor was 0.2 (the state, not rounding); a fresh twin of it measures ~1e-6, so that the tolerance
    still judges LRCN's blobs."""
    out = io.StringIO()
    result = compare.run(os.path.join(ROOT, "tests", "data", "lrcn_lstm.prototxt"), out=out)
    floors = result["forward"]["floors"]
    assert result["ok"] and set(floors) >= {"lstm1@lstm1", "lstm2@lstm2"}, out.getvalue()
    assert 0 < max(floors.values()) < 1e-5, out.getvalue()
