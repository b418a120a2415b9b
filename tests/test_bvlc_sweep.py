"""BVLC Caffe's own nets, every one: its examples/ (vendored in tests/data/bvlc) and models/ (in the pycaffe sdist)
all describe, and every net under 30M parameters gives the same forward pass (and, with its solver, the same
training steps) on both backends."""

import glob
import io
import os

import pytest

from conftest import ROOT
from deepspark import compare, config, graph, nets
from deepspark.proto import deepspark_pb2 as pb
from test_data_layers import hdf5_example

BVLC = os.path.join(ROOT, "tests", "data", "bvlc")
EXAMPLES = sorted(os.path.relpath(p, BVLC) for p in glob.glob(os.path.join(BVLC, "**", "*.prototxt"), recursive=True)
                  if "solver" not in os.path.basename(p))
COMPARE_LIMIT = 30_000_000  # parameters: larger nets are described, not compared (minutes each on 2 cores)

# C,H,W of the data layers whose source (an LMDB of BVLC's) is not here, by the folder or file.
DATA_SHAPES = {"mnist": (1, 28, 28), "v1": (1, 28, 28), "cifar10": (3, 32, 32), "siamese": (2, 28, 28),
               "models": (3, 256, 256)}
# A net whose test net takes its layers from its solver's test_state stages: the solver, its first stage.
SOLVERS = {"examples/mnist/mnist_autoencoder.prototxt": ("examples/mnist/mnist_autoencoder_solver.prototxt",
                                                         "test-on-train")}


def data_shape(relative):
    for key, shape in DATA_SHAPES.items():
        if key in relative.split(os.sep):
            return shape
    return None


def unsupported(path):
    """The layer types of a net that the registry has no row for."""
    net, _ = config.load_net(path)
    return sorted({layer.type for layer in net.layer} - set(graph.REGISTRY))


@pytest.fixture
def in_example_tree(tmp_path, monkeypatch):
    """A working directory laid out as BVLC's repository root (the examples' paths are relative to it), with
    the HDF5 example's data, and pycaffe's example layers on sys.path (as BVLC's readme sets PYTHONPATH)."""
    hdf5_example(tmp_path, rows=(40, 20))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(os.path.join(BVLC, "examples", "pycaffe", "layers"))
    return tmp_path


def sweep_nets(caffe_source=None):
    found = [(relative, os.path.join(BVLC, relative)) for relative in EXAMPLES]
    if caffe_source:
        found += [(os.path.join("models", os.path.relpath(p, os.path.join(caffe_source, "models"))), p)
                  for p in sorted(glob.glob(os.path.join(caffe_source, "models", "*", "*.prototxt")))
                  if "solver" not in os.path.basename(p)]
    return found


def test_every_bvlc_net_describes(caffe_source, in_example_tree):
    found = sweep_nets(caffe_source)
    assert len(found) == len(EXAMPLES) + 9 and len(EXAMPLES) == 9
    described = {}
    for relative, path in found:
        for phase in (pb.TRAIN, pb.TEST):
            stages = [SOLVERS[relative][1]] if relative in SOLVERS and phase == pb.TEST else None
            table, _ = nets.describe(path, phase, data_shape(relative), stages=stages)
            assert table.splitlines()[0].split() == ["name", "type", "tops", "parameters"], relative
        described[relative] = table.splitlines()[-1]
    # the ones whose data is here or given: a real total
    for relative in ("examples/mnist/lenet.prototxt", "v1/lenet_train_test.prototxt", "models/bvlc_googlenet/deploy.prototxt",
                     "examples/hdf5_classification/nonlinear_train_val.prototxt"):
        assert described[relative].startswith("total parameters: ") and described[relative].split()[-1].isdigit()
    assert described["examples/mnist/lenet.prototxt"] == "total parameters: 431080"


def test_every_bvlc_net_has_only_registered_layer_types(caffe_source):
    lacking = {relative: unsupported(path) for relative, path in sweep_nets(caffe_source) if unsupported(path)}
    assert not lacking


@pytest.mark.caffe
@pytest.mark.parametrize("relative,path", [pytest.param(relative, path, id=relative) for relative, path in sweep_nets()])
def test_small_bvlc_examples_agree_across_backends(in_example_tree, relative, path):
    run_compare(relative, path)


@pytest.mark.caffe
def test_small_bvlc_models_agree_across_backends(caffe_source, in_example_tree):
    compared = 0
    for relative, path in sweep_nets(caffe_source):
        if not relative.startswith("models"):
            continue
        compared += run_compare(relative, path)
    assert compared >= 1  # GoogLeNet's deploy net; AlexNet, CaffeNet, R-CNN and Flickr Style are over 30M


def run_compare(relative, path):
    """compare on one net (batch 1, with its solver where its test net needs its stages); 1 if compared."""
    solver, stage = SOLVERS.get(relative, (None, None))
    table, _ = nets.describe(path, pb.TEST, data_shape(relative), batch_size=1, stages=[stage] if stage else None)
    total = table.splitlines()[-1].split()[-1]
    if not total.isdigit() or int(total) >= COMPARE_LIMIT or (relative.startswith("models") and "deploy" not in relative):
        return 0  # over the limit (a models/ train_val is its deploy net's architecture again)
    out = io.StringIO()
    result = compare.run(path, solver_path=os.path.join(BVLC, solver) if solver else None, out=out,
                         data_shape=data_shape(relative), batch_size=1, iterations=1)
    assert result["ok"], out.getvalue()
    assert result["forward"]["worst_relative"] <= 1e-4, out.getvalue()
    return 1
