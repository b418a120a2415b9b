"""`deepspark time`: Caffe's lines in Caffe's order, totals that add up, one meaning of backward on both backends."""

import io
import re

import numpy as np
import pytest

from conftest import run_cli
from synthetic import make_job

from deepspark import engine, nets
from deepspark.backends.base import LayerPass
from deepspark.graph import backward_needs
from deepspark.log import Log
from deepspark.proto import deepspark_pb2 as pb

LENET = ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"]  # TRAIN: no Split
NUMBER = r"([\d.]+(?:e[+-]\d+)?)"
LINE = re.compile(r"[IWEF]\d{4} [\d:.]+ +\d+ deepspark\] (.*)")


def messages(text):
    """The messages of a log, without Caffe's `I1201 11:24:07.027002 18482 deepspark] ` prefix."""
    return [match.group(1) for match in map(LINE.fullmatch, text.splitlines()) if match]


def read_report(lines, iterations):
    """`caffe time`'s report, checked line by line: (per-iteration ms, [(layer, fwd, bwd)], {total: ms})."""
    lines = lines[lines.index("Performing Forward"):]
    assert re.fullmatch(rf"Initial loss: {NUMBER}", lines[1]), lines[1]
    assert lines[2:5] == ["Performing Backward", "*** Benchmark begins ***", f"Testing for {iterations} iterations."]
    steps = [re.fullmatch(rf"Iteration: (\d+) forward-backward time: {NUMBER} ms\.", line)
             for line in lines[5:5 + iterations]]
    assert all(steps), lines[5:5 + iterations]
    assert [int(step.group(1)) for step in steps] == list(range(1, iterations + 1))
    at = 5 + iterations
    assert lines[at] == "Average time per layer: "
    layers = []
    while True:
        forward = re.fullmatch(rf"( *)(\S+)\tforward: {NUMBER} ms\.", lines[at + 1])
        if not forward:
            break
        backward = re.fullmatch(rf"( *)(\S+)\tbackward: {NUMBER} ms\.", lines[at + 2])
        assert backward and backward.group(2) == forward.group(2), lines[at + 2]
        assert len(forward.group(1) + forward.group(2)) == max(10, len(forward.group(2)))  # Caffe's setw(10)
        layers.append((forward.group(2), float(forward.group(3)), float(backward.group(3))))
        at += 2
    totals = {}
    for name, line in zip(("Average Forward pass", "Average Backward pass", "Average Forward-Backward",
                           "Total Time"), lines[at + 1:at + 5]):
        match = re.fullmatch(rf"{name}: {NUMBER} ms\.", line)
        assert match, (name, line)
        totals[name] = float(match.group(1))
    assert lines[at + 5:] == ["*** Benchmark ends ***"]
    return [float(step.group(2)) for step in steps], layers, totals


def check_sums(steps, layers, totals):
    """Total = iterations x Average Forward-Backward; a pass is its layers plus the loop's microseconds."""
    iterations = len(steps)
    assert totals["Total Time"] == pytest.approx(iterations * totals["Average Forward-Backward"], rel=2e-5)
    assert sum(steps) <= totals["Total Time"] * (1 + 1e-5)
    assert np.mean(steps) == pytest.approx(totals["Average Forward pass"] + totals["Average Backward pass"],
                                           rel=1e-4)
    for column, name in ((1, "Average Forward pass"), (2, "Average Backward pass")):
        layer_sum, whole = sum(row[column] for row in layers), totals[name]
        assert layer_sum <= whole * (1 + 1e-4) + 1e-3, name
        assert whole - layer_sum <= 0.1 * whole + 0.5, name  # a preemption between two layers' timers, at most


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_time_prints_caffes_lines_and_its_totals_add_up(backend):
    status, _, err = run_cli("time", "--model", "models/lenet/train_val.prototxt", "--backend", backend,
                             "--iterations", "3")
    assert status == 0, err
    steps, layers, totals = read_report(messages(err), 3)
    assert [row[0] for row in layers] == LENET
    check_sums(steps, layers, totals)


@pytest.mark.caffe
def test_both_backends_list_the_nets_layers_and_caffe_its_splits_too(tmp_path):
    """The TEST net reads `ip` and `label` twice: Caffe times the Split layers it inserts, TensorFlow has none."""
    make_job(tmp_path)
    net = str(tmp_path / "net.prototxt")
    names = {}
    for backend in ("tensorflow", "caffe"):
        log = io.StringIO()
        with Log(stream=log):
            timing = nets.timing(net, 2, backend, pb.TEST)
        names[backend] = [row[0] for row in timing.layers]
        steps, layers, totals = read_report(messages(log.getvalue()), 2)
        assert layers == [(name, pytest.approx(f, rel=1e-5, abs=1e-9), pytest.approx(b, rel=1e-5, abs=1e-9))
                          for name, f, b in timing.layers]
        check_sums(steps, layers, totals)
    assert names["tensorflow"] == ["data", "conv", "pool", "relu", "ip", "accuracy", "loss"]
    assert names["caffe"] == ["data", "label_data_1_split", "conv", "pool", "relu", "ip", "ip_ip_0_split",
                              "accuracy", "loss"]


@pytest.mark.caffe
@pytest.mark.parametrize("frozen", [False, True])
def test_the_tensorflow_backward_differentiates_what_caffes_net_does(tmp_path, frozen):
    """Caffe's Net::Init need_backward rules: after Caffe's backward, a blob has a diff iff a layer's backward wants it.

    frozen: lr_mult 0 on the convolution, so nothing below `ip` needs a diff.
    """
    make_job(tmp_path)
    path = tmp_path / "net.prototxt"
    if frozen:
        path.write_text(path.read_text().replace('top: "conv"\n', 'top: "conv" param { lr_mult: 0 } '
                                                                   'param { lr_mult: 0 }\n'))
    for phase in (pb.TRAIN, pb.TEST):
        model = nets.test_model(str(path), "caffe", phase)
        try:
            wanted = {layer.bottoms[b] for layer, (bottoms, _) in zip(model.graph.layers, backward_needs(model.graph))
                      for b in bottoms}
            model.gradients(engine.SyntheticBatches(model).next_batch())
            blobs = model._net.blobs
            with_diff = {name for name in model.graph.blobs if name != "loss" and np.any(blobs[name].diff)}
        finally:
            model.close()
        assert wanted == with_diff
        assert wanted == ({"ip"} if frozen else {"conv", "pool", "ip"})


def test_benchmark_runs_caffes_loop_once_for_every_backend():
    """Warm-up forward then backward, then per iteration every forward in order and every backward in reverse."""
    calls = []
    passes = [LayerPass(name, lambda name=name: calls.append(("forward", name)),
                        lambda name=name: calls.append(("backward", name))) for name in ("a", "b", "c")]
    log = io.StringIO()
    with Log(stream=log):
        timing = engine.benchmark(passes, lambda: 1.5, 2)
    one = [("forward", "a"), ("forward", "b"), ("forward", "c"), ("backward", "c"), ("backward", "b"),
           ("backward", "a")]
    assert calls == one * 3
    assert [row[0] for row in timing.layers] == ["a", "b", "c"] and timing.iterations == 2
    assert timing.total == pytest.approx(2 * timing.forward_backward)
    steps, layers, totals = read_report(messages(log.getvalue()), 2)
    assert "Initial loss: 1.5" in messages(log.getvalue())
    assert [row[0] for row in layers] == ["a", "b", "c"]
    assert totals["Total Time"] == pytest.approx(timing.total, rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match="at least one iteration"):
        engine.benchmark(passes, lambda: 0.0, 0)


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_the_initial_loss_sums_every_loss_layer_whose_top_caffe_names(tmp_path, backend):
    """Two loss layers with no top in the prototxt: Caffe names both tops "(automatic)"; the loss `time` logs
    is the weighted sum of the two, as the solver's step computes it, not the last one twice."""
    make_job(tmp_path)
    path = tmp_path / "net.prototxt"
    text = path.read_text().replace(' top: "loss" }', " }")
    path.write_text(text + 'layer { name: "ip2" type: "InnerProduct" bottom: "pool" top: "ip2"\n'
                           '  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }\n'
                           'layer { name: "loss2" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" '
                           'loss_weight: 0.5 }\n')
    model = nets.test_model(str(path), backend, pb.TRAIN)
    try:
        batch = engine.SyntheticBatches(model).next_batch()
        expected, _ = model.gradients(batch)
        passes, loss = model.layer_passes(batch)
        for layer_pass in passes:
            layer_pass.forward()
        losses = [layer.tops for layer in model.graph.layers if any(layer.loss_weights)]
        assert losses == [["(automatic)"], ["(automatic)"]]
        assert loss() == pytest.approx(float(expected), rel=1e-5)
    finally:
        model.close()
