"""Inference that never answers wrong or dies (issue 43, points 2-7): what export, a SavedModel and `deepspark.Net`
refuse in one line where they once served zeros, uninitialised memory or a raw TensorFlow error, or aborted."""

import os

import numpy as np
import pytest

from conftest import ROOT, run_cli
from deepspark import checkpoint, compare, config
from deepspark.graph import Graph
from deepspark.proto import deepspark_pb2 as pb

DATA = os.path.join(ROOT, "tests", "data")
LENET = os.path.join(ROOT, "models", "lenet", "deploy.prototxt")


def lenet_weights(path, rename=lambda name: name):
    """A .caffemodel of LeNet's deploy net (its fillers' values) with each layer called rename(its name)."""
    net, _ = config.load_net(LENET)
    model = compare.build(["tensorflow"], net, phase=pb.TEST)["tensorflow"]
    params = model.get_params()
    model.close()
    for layer in net.layer:
        layer.name = rename(layer.name)
    checkpoint.save_caffemodel(str(path), Graph(net, pb.TEST), params)
    return str(path)


def one_line_error(args):
    status, _, err = run_cli("export", *args)
    lines = err.strip().splitlines()
    assert status == 1 and lines[-1].startswith("deepspark export: error: "), err[-2000:]
    return lines[-1]


def test_export_refuses_weights_that_lack_a_layer_of_the_net(tmp_path):
    """Weights without LeNet's ip2 (a character net's classifier renamed in fine-tuning, say) once exported with
    exit 0 and served ip2's fillers, 1/10 for every class; weights of another net sharing no layer name served
    zeros everywhere. Both are refused in one line naming the layers; --allow-uncovered exports with a warning."""
    out = tmp_path / "saved"
    renamed = lenet_weights(tmp_path / "renamed.caffemodel", lambda name: name + "_ft" if name == "ip2" else name)
    line = one_line_error(["--model", LENET, "--weights", renamed, "--output", str(out)])
    assert "lack 1 of the net's 4 layers with parameters ('ip2')" in line and "--allow-uncovered" in line, line
    foreign = lenet_weights(tmp_path / "foreign.caffemodel", lambda name: "other_" + name)
    line = one_line_error(["--model", LENET, "--weights", foreign, "--output", str(out)])
    assert "share no layer name with the net" in line and "'conv1', 'conv2', 'ip1', 'ip2'" in line, line
    assert not out.exists()
    status, printed, err = run_cli("export", "--model", LENET, "--weights", renamed, "--output", str(out),
                                   "--allow-uncovered")
    assert status == 0 and out.exists(), err[-2000:]
    assert [line for line in err.splitlines() if line.startswith("warning: ")] == [
        f"warning: {renamed}: the weights lack 1 of the net's 4 layers with parameters ('ip2'), which would serve "
        "their fillers' values, not trained ones"], err[-2000:]
    assert printed.startswith(f"Wrote the SavedModel {out}")


def test_export_refuses_a_net_with_no_outputs(tmp_path):
    """richzhang/colorization's deploy net ends in a Silence layer that eats class8_ab: its SavedModel had no
    outputs at all, written silently."""
    prototxt = os.path.join(DATA, "silenced_output.prototxt")
    net, _ = config.load_net(prototxt)
    model = compare.build(["tensorflow"], net, phase=pb.TEST)["tensorflow"]
    weights = str(tmp_path / "colorization.caffemodel")
    checkpoint.save_caffemodel(weights, model.graph, model.get_params())
    model.close()
    line = one_line_error(["--model", prototxt, "--weights", weights, "--output", str(tmp_path / "saved")])
    assert "silenced_output.prototxt:" in line and "the net has no outputs (layer 'Silence' (Silence) takes " \
        "class8_ab)" in line, line
    assert os.listdir(tmp_path) == ["colorization.caffemodel"]
