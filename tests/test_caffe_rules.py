"""Caffe's rules where DeepSpark once went silently its own way, each against real pycaffe: the automatic top of a
loss layer that names none, Convolution and Deconvolution taking N bottoms to N tops through one set of blobs, and
Accuracy on NaN scores and ties as Caffe's AccuracyLayer ranks them (std::partial_sort on (score, class) pairs).
"""

import os

import numpy as np
import pytest

from conftest import ROOT, run_cli
from deepspark.backends import create_model
from deepspark.config import load_net, parse_net
from deepspark.errors import ConfigError
from deepspark.graph import AUTOMATIC, Graph
from deepspark.proto import deepspark_pb2 as pb
from test_zoo_layers import L, caffe, check_backends, close, normal, seeded  # noqa: F401 (caffe, seeded: fixtures)

pytestmark = pytest.mark.caffe

DATA = os.path.join(ROOT, "tests", "data")
RCNN = os.path.join(DATA, "rcnn_finetune_automatic_top.prototxt")  # rbgirshick/rcnn's shape: V0, loss without top
CONV_2_INPS = os.path.join(DATA, "conv_2_inps.prototxt")  # opencv_extra's: one Convolution, 2 bottoms, 2 tops
SOLVER = dict(base_lr=0.01, momentum=0.9, weight_decay=0.0005, lr_policy="fixed")
STEPS = 3


def batches(rng, count, data=(4, 3, 15, 15), classes=21):
    return [{"data": rng.standard_normal(data).astype(np.float32),
             "label": rng.integers(0, classes, (data[0], 1, 1, 1)).astype(np.float32)} for _ in range(count)]


def initial_weights(net, seed):
    model = create_model("tensorflow", net, phase=pb.TEST, seed=seed)
    try:
        return model.get_params()
    finally:
        model.close()


def train(backend, net, solver, initial, feeds):
    """(the loss of each step, the weights after each step) of `backend` from the weights `initial`."""
    model = create_model(backend, net, solver)
    try:
        model.set_params(initial)
        losses, weights = [], []
        for batch in feeds:
            losses.append(model.step(batch))
            weights.append(model.get_params())
        return losses, weights
    finally:
        model.close()


def pycaffe_train(caffe, tmp_path, net_path, graph, initial, feeds):
    """The same steps in pycaffe's own solver on the prototxt as it is (Caffe upgrades it and names the top)."""
    solver_path = tmp_path / "solver.prototxt"
    solver_path.write_text(f'net: "{net_path}"\n' + "".join(f"{k}: {v!r}\n".replace("'", '"')
                                                            for k, v in SOLVER.items())
                           + 'type: "SGD"\nmax_iter: 100\ndisplay: 0\nsnapshot_after_train: false\n'
                           + "solver_mode: CPU\n")
    solver = caffe.get_solver(str(solver_path))
    net = solver.net
    for param, array in zip(graph.params, initial):
        net.params[param.layer][param.index].data[...] = array
    losses, weights = [], []
    for batch in feeds:
        for top, array in batch.items():
            net.blobs[top].data[...] = array
        solver.step(1)
        losses.append(float(net.blobs[AUTOMATIC].data))  # the forward pass of this step, before its update
        weights.append([np.array(net.params[p.layer][p.index].data) for p in graph.params])
    return losses, weights


# -- 1. the automatic top --------------------------------------------------------------------------------------------

def test_a_loss_layer_without_a_top_gets_caffes_automatic_top_with_its_loss_weight(caffe):
    net, _ = load_net(RCNN)
    graph = Graph(net, pb.TRAIN)
    loss = graph.layer("loss")
    assert (loss.type, loss.tops, loss.loss_weights, loss.top_shapes) == ("SoftmaxWithLoss", [AUTOMATIC], [1.0], [()])
    assert AUTOMATIC not in graph.outputs and AUTOMATIC not in graph.blobs  # no other layer can read it
    pycaffe = caffe.Net(RCNN, caffe.TRAIN)
    assert AUTOMATIC in pycaffe.blobs and AUTOMATIC not in pycaffe.outputs
    assert "loss        SoftmaxWithLoss  (automatic) scalar" in graph.describe()
    status, out, err = run_cli("describe", RCNN)
    assert status == 0 and "(automatic) scalar" in out, err
    weighted = parse_net('layer { name: "in" type: "Input" top: "x" top: "label" input_param { shape { dim: 2 '
                         'dim: 3 } shape { dim: 2 } } }\n'
                         + L("loss", "SoftmaxWithLoss", ["x", "label"], "loss_weight: 2.5", tops=[]))[0]
    assert Graph(weighted, pb.TRAIN).layer("loss").loss_weights == [2.5]  # one weight for the one automatic top


def test_the_net_with_an_automatic_top_trains_as_pycaffe_trains_it(caffe, tmp_path):
    """rcnn's fine-tuning net, small: three SGD steps from the same weights, losses and weights within 1e-4."""
    net, _ = load_net(RCNN)
    graph = Graph(net, pb.TRAIN)
    solver = pb.SolverParameter(type="SGD", **SOLVER)
    initial = initial_weights(net, 3)
    feeds = batches(np.random.default_rng(7), STEPS)
    want_losses, want_weights = pycaffe_train(caffe, tmp_path, RCNN, graph, initial, feeds)
    assert min(want_losses) > 1.0  # ln 21 = 3.04 at the start: a loss Caffe trains on
    moved = [float(np.max(np.abs(w - i))) for w, i in zip(want_weights[-1], initial)]
    assert all(m > 0 for m in moved), moved
    for backend in ("caffe", "tensorflow"):
        losses, weights = train(backend, net, solver, initial, feeds)
        close(losses, want_losses, f"{backend}: losses")
        for step, (got, want) in enumerate(zip(weights, want_weights)):
            for param, g, w in zip(graph.params, got, want):
                close(g, w, f"{backend}: blob {param.index} of '{param.layer}' after step {step + 1}")


def test_two_loss_layers_without_tops_each_count_their_loss(caffe):
    """Both tops are "(automatic)": each loss is still counted once, with its own loss_weight."""
    text = ('layer { name: "in" type: "Input" top: "x" top: "label" top: "target" input_param { shape { dim: 6 '
            'dim: 5 } shape { dim: 6 } shape { dim: 6 dim: 4 } } }\n'
            + L("score", "InnerProduct", ["x"], 'inner_product_param { num_output: 4 weight_filler { type: '
                '"gaussian" std: 0.5 } }')
            + L("softmax", "SoftmaxWithLoss", ["score", "label"], tops=[])
            + L("euclid", "EuclideanLoss", ["score", "target"], "loss_weight: 0.5", tops=[]))
    net = parse_net(text)[0]
    graph = Graph(net, pb.TRAIN)
    assert [layer.tops for layer in graph.layers[2:]] == [[AUTOMATIC], [AUTOMATIC]]
    solver = pb.SolverParameter(type="SGD", base_lr=0.1, momentum=0.9)
    rng = np.random.default_rng(3)
    feeds = [{"x": normal(6, 5), "label": rng.integers(0, 4, 6).astype(np.float32), "target": normal(6, 4)}
             for _ in range(STEPS)]
    initial = initial_weights(net, 4)
    theirs, ours = (train(backend, net, solver, initial, feeds) for backend in ("caffe", "tensorflow"))
    close(ours[0], theirs[0], "losses")
    for got, want in zip(ours[1][-1], theirs[1][-1]):
        close(got, want, "weights after three steps")
    model = create_model("caffe", net, phase=pb.TEST)  # the two weighted losses, summed as Caffe sums them
    try:
        model.set_params(initial)
        softmax_only = create_model("caffe", parse_net(text.rsplit("layer {", 1)[0])[0], phase=pb.TEST)
        softmax_only.set_params(initial)
        scores = feeds[0]["x"] @ initial[0].T + initial[1]
        euclid = 0.5 * float(np.sum((scores - feeds[0]["target"]) ** 2)) / (2 * 6)
        assert model.gradients(feeds[0])[0] == pytest.approx(softmax_only.gradients(feeds[0])[0] + euclid, rel=1e-5)
        softmax_only.close()
    finally:
        model.close()


def test_a_layer_that_is_no_loss_layer_still_needs_its_top():
    text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }\n'
            'layer { name: "relu" type: "ReLU" bottom: "x" }\n')
    net, source = parse_net(text, "net.prototxt")
    with pytest.raises(ConfigError, match=r"^net.prototxt:2:.*layer 'relu' \(ReLU\) needs a top"):
        Graph(net, pb.TRAIN, source=source)


# -- 2. N bottoms to N tops through one set of blobs ----------------------------------------------------------------

def test_opencvs_two_input_convolution_computes_pycaffes_outputs(caffe):
    net, _ = load_net(CONV_2_INPS)
    pycaffe = caffe.Net(CONV_2_INPS, caffe.TEST)  # Caffe's own msra fill
    graph = Graph(net, pb.TEST)
    assert graph.param_count == sum(blob.count for blobs in pycaffe.params.values() for blob in blobs) == 26
    weights = [np.array(blob.data) for blob in pycaffe.params["Convolution1"]]
    weights[1] = normal(2)  # a bias Caffe would leave at 0
    for blob, array in zip(pycaffe.params["Convolution1"], weights):
        blob.data[...] = array
    inputs = {"input_0": normal(1, 3, 4, 5), "input_1": normal(1, 3, 4, 5)}
    for name, array in inputs.items():
        pycaffe.blobs[name].data[...] = array
    want = {name: np.array(value) for name, value in pycaffe.forward().items()}
    assert set(want) == {"out_0", "out_1"} and not np.allclose(want["out_0"], want["out_1"])
    for backend in ("caffe", "tensorflow"):
        model = create_model(backend, net, phase=pb.TEST)
        try:
            model.set_params(weights)
            got = model.forward(inputs)
        finally:
            model.close()
        for name in want:
            close(got[name], want[name], f"{backend}: {name}")


@pytest.mark.parametrize("kind, body", [
    ("Convolution", "convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 group: 2 "),
    ("Deconvolution", "convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 "),
])
def test_n_bottoms_to_n_tops_share_the_blobs_forward_and_backward(kind, body):
    """Three bottoms through one layer: its tops, and its blobs' diffs summed over the three, as Caffe's."""
    layers = L("conv", kind, ["a", "b", "c"], body + 'weight_filler { type: "gaussian" std: 0.3 } '
               'bias_filler { type: "gaussian" std: 0.3 } }', tops=["ta", "tb", "tc"])
    sources = {name: normal(2, 4, 5, 6) for name in "abc"}
    values, diffs = check_backends(layers, sources, ranks={"ta": 4, "tb": 4, "tc": 4})
    assert len({values[top].shape for top in ("ta", "tb", "tc")}) == 1
    assert all(np.any(d != 0) for d in diffs["conv"])


@pytest.mark.parametrize("bottoms, tops, shapes, message", [
    (["a", "b"], ["ta"], [(2, 4, 5, 6)] * 2, "makes one top per bottom: 2 bottoms, 1 top"),
    (["a", "b"], ["ta", "tb"], [(2, 4, 5, 6), (2, 4, 5, 7)], "bottoms must all have one shape"),
])
def test_n_bottoms_to_n_tops_is_refused_where_caffe_aborts(bottoms, tops, shapes, message):
    text = "".join(f'layer {{ name: "{b}" type: "Input" top: "{b}" input_param {{ shape {{ '
                   + " ".join(f"dim: {d}" for d in shape) + " } } }\n" for b, shape in zip(bottoms, shapes))
    text += L("conv", "Convolution", bottoms, "convolution_param { num_output: 2 kernel_size: 3 }", tops=tops)
    net, source = parse_net(text, "net.prototxt")
    with pytest.raises(ConfigError, match=message):
        Graph(net, pb.TRAIN, source=source)


# -- 3. Accuracy on NaN scores and ties ---------------------------------------------------------------------------

def accuracy_net(n, classes, body):
    return parse_net(f'layer {{ name: "in" type: "Input" top: "score" top: "label" input_param {{ shape {{ dim: {n} '
                     f'dim: {classes} }} shape {{ dim: {n} }} }} }}\n'
                     + L("accuracy", "Accuracy", ["score", "label"], f"accuracy_param {{ {body} }}",
                         tops=["accuracy", "per_class"]))[0]


def accuracies(backend, net, cases):
    model = create_model(backend, net, phase=pb.TEST)
    try:
        return [model.forward(case) for case in cases]
    finally:
        model.close()


def test_accuracy_on_all_nan_scores_is_pycaffes_not_one():
    """The issue's case: every score NaN, the labels 0..9 alike: Caffe counts only the last class right (0.1)."""
    net = accuracy_net(50, 10, "")
    case = {"score": np.full((50, 10), np.nan, np.float32), "label": np.arange(50, dtype=np.float32) % 10}
    (theirs,), (ours,) = (accuracies(backend, net, [case]) for backend in ("caffe", "tensorflow"))
    assert float(theirs["accuracy"]) == pytest.approx(0.1)
    np.testing.assert_array_equal(ours["accuracy"], theirs["accuracy"])
    np.testing.assert_array_equal(ours["per_class"], theirs["per_class"])


@pytest.mark.parametrize("body", ["top_k: 1", "top_k: 2", "top_k: 5", "top_k: 3 ignore_label: 2",
                                  "top_k: 1 ignore_label: 0"])
def test_accuracy_with_nans_and_ties_equals_pycaffes(body):
    """Scores of few values (many ties) with NaNs sprinkled at several rates, and a row of NaN only."""
    rng = np.random.default_rng(11)
    n, classes = 64, 7
    cases = []
    for rate in (0.0, 0.1, 0.4, 0.8):
        score = rng.integers(-2, 3, (n, classes)).astype(np.float32)
        score[rng.random((n, classes)) < rate] = np.nan
        score[0] = np.nan
        cases.append({"score": score, "label": rng.integers(0, classes, n).astype(np.float32)})
    net = accuracy_net(n, classes, body)
    theirs, ours = (accuracies(backend, net, cases) for backend in ("caffe", "tensorflow"))
    for case, got, want in zip(cases, ours, theirs):
        for top in ("accuracy", "per_class"):
            np.testing.assert_array_equal(got[top], want[top], err_msg=f"{body}: {top}")
    assert len({float(want["accuracy"]) for want in theirs}) > 1
