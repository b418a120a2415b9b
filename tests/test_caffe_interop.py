"""Files and messages cross between DeepSpark and real Caffe: .caffemodel, LMDB, prototxt."""

import glob
import os

import numpy as np
import pytest

from deepspark import checkpoint, fillers
from deepspark.backends import create_model
from deepspark.backends.caffe import compiler, runtime
from deepspark.compare import shape_finder
from deepspark.config import load_net, load_solver, parse_net
from deepspark.data import DataFeeder
from deepspark.errors import ConfigError
from deepspark.graph import Graph
from deepspark.proto import deepspark_pb2 as pb
from tests.conftest import ROOT, run_cli
from tests.test_caffe_backend import mnist_files

pytestmark = pytest.mark.caffe

caffe = runtime.caffe()
caffe_pb2 = caffe.proto.caffe_pb2

# Nets and solvers; a model folder's deepspark.prototxt holds DeepSpark's knobs, not a Caffe message.
MODELS = sorted(p for p in glob.glob(os.path.join(ROOT, "models", "*", "*.prototxt"))
                if os.path.basename(p) != "deepspark.prototxt")


def deploy(name):
    return os.path.join(ROOT, "models", name, "deploy.prototxt")


# -- .caffemodel ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lenet", "cifar10_quick"])
def test_our_caffemodel_loads_in_caffe(tmp_path, name):
    net, source = load_net(deploy(name))
    graph = Graph(net, pb.TEST, source=source)
    arrays = fillers.init_params(graph, 11)
    path = str(tmp_path / "ours.caffemodel")
    checkpoint.save_caffemodel(path, graph, arrays)
    caffe_net = caffe.Net(deploy(name), caffe.TEST, weights=path)
    loaded = [caffe_net.params[p.layer][p.index].data for p in graph.params]
    assert len(loaded) == len(arrays)
    for ours, theirs in zip(arrays, loaded):
        np.testing.assert_array_equal(theirs.reshape(ours.shape), ours)


@pytest.mark.parametrize("name", ["lenet", "cifar10_quick"])
def test_caffes_caffemodel_loads_in_ours(tmp_path, name):
    caffe.set_random_seed(5)
    caffe_net = caffe.Net(deploy(name), caffe.TEST)  # Caffe's own fillers
    path = str(tmp_path / "theirs.caffemodel")
    caffe_net.save(path)
    net, source = load_net(deploy(name))
    graph = Graph(net, pb.TEST, source=source)
    blobs = checkpoint.read_caffemodel(path)
    arrays = checkpoint.weights_for(graph, blobs, [np.zeros(p.shape, np.float32) for p in graph.params], path)
    for param, array in zip(graph.params, arrays):
        theirs = caffe_net.params[param.layer][param.index].data
        np.testing.assert_array_equal(array, theirs.reshape(param.shape))
        assert np.any(array != 0) or param.index == 1  # not left at the zeros we passed in


def test_caffe_backend_weights_through_a_caffemodel_written_by_caffe(tmp_path):
    """Our Caffe backend's parameters, saved by pycaffe's own Net.save, read back by checkpoint."""
    net, source = load_net(deploy("lenet"))
    model = create_model("caffe", net, None, phase=pb.TEST, source=source, seed=3)
    path = str(tmp_path / "backend.caffemodel")
    model._net.save(path)
    arrays = checkpoint.weights_for(model.graph, checkpoint.read_caffemodel(path), model.get_params(), path)
    for ours, theirs in zip(model.get_params(), arrays):
        np.testing.assert_array_equal(ours, theirs)


# -- LMDB: our converters feed Caffe's Data layer ------------------------------------------

DATA_NET = """
name: "reader"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ {transform} }}
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}
"""


def caffe_batches(tmp_path, source, transform, batch, count):
    path = tmp_path / "reader.prototxt"
    path.write_text(DATA_NET.format(source=source, transform=transform, batch=batch))
    net = caffe.Net(str(path), caffe.TEST)
    out = []
    for _ in range(count):
        net.forward()
        out.append({"data": net.blobs["data"].data.copy(), "label": net.blobs["label"].data.copy()})
    return out


def our_batches(source, transform, batch, count):
    layer = parse_net(DATA_NET.format(source=source, transform=transform, batch=batch))[0].layer[0]
    with DataFeeder(layer, pb.TEST) as feeder:
        return [feeder.next_batch() for _ in range(count)]


def assert_same_batches(theirs, ours):
    for a, b in zip(theirs, ours):
        np.testing.assert_allclose(a["data"], b["data"], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(a["label"], b["label"])


def test_convert_mnist_lmdb_feeds_caffes_data_layer(tmp_path):
    images, labels = mnist_files(tmp_path, 50, seed=2)
    out = str(tmp_path / "mnist_lmdb")
    status, _, err = run_cli("convert-mnist", images, labels, out)
    assert status == 0, err
    transform = "scale: 0.00390625"
    # 4 batches of 16 from 50 records: the last one wraps to the start, as Caffe's does.
    assert_same_batches(caffe_batches(tmp_path, out, transform, 16, 4), our_batches(out, transform, 16, 4))


def test_convert_imageset_lmdb_with_mean_and_crop_feeds_caffes_data_layer(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(4)
    root = tmp_path / "images"
    root.mkdir()
    lines = []
    for i in range(12):
        pixels = rng.integers(0, 256, (9, 11, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{i}.png")
        lines.append(f"{i}.png {i % 3}")
    listfile = tmp_path / "list.txt"
    listfile.write_text("\n".join(lines) + "\n")
    out, mean = str(tmp_path / "color_lmdb"), str(tmp_path / "mean.binaryproto")
    assert run_cli("convert-imageset", str(root), str(listfile), out)[0] == 0
    assert run_cli("compute-image-mean", out, mean)[0] == 0
    # TEST phase: the centre crop; no mirror (random, and Caffe mirrors in TEST too); scale after the mean.
    for transform in (f'mean_file: "{mean}" crop_size: 7 scale: 0.5',
                      "mean_value: 100 mean_value: 120 mean_value: 140 crop_size: 5"):
        assert_same_batches(caffe_batches(tmp_path, out, transform, 5, 3), our_batches(out, transform, 5, 3))


# -- prototxt messages round-trip through caffe_pb2 ------------------------------------------


@pytest.mark.parametrize("path", MODELS, ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "models")))
def test_prototxt_round_trips_through_caffe_pb2(path):
    if os.path.basename(path) == "solver.prototxt":
        ours = load_solver(path).param
        theirs = caffe_pb2.SolverParameter.FromString(ours.SerializeToString())
        # DeepSpark's own knobs are one field Caffe does not know, kept through the trip.
        assert compiler.unknown_fields(theirs) == (["SolverParameter: field 8000"]
                                                   if ours.HasField("deepspark_param") else [])
        ours.ClearField("deepspark_param")
        clean = caffe_pb2.SolverParameter.FromString(ours.SerializeToString())
        assert pb.SolverParameter.FromString(clean.SerializeToString()) == ours
    else:
        ours, _ = load_net(path)
        theirs = compiler.to_caffe(ours, caffe_pb2.NetParameter)  # raises on any field Caffe lacks
        assert compiler.from_caffe(theirs, pb.NetParameter) == ours
        # and through Caffe's text format, which is what pycaffe's C++ reads
        back = parse_net(compiler.to_text(theirs))[0]
        assert back == ours


def test_unknown_field_is_refused_not_dropped():
    net = pb.NetParameter(name="x")
    layer = net.layer.add(name="p", type="Pooling")
    layer.pooling_param.ceil_mode = False  # this fork's field 13: known
    assert compiler.to_caffe(net, caffe_pb2.NetParameter).layer[0].pooling_param.ceil_mode is False
    solver = pb.SolverParameter(base_lr=0.1)
    solver.deepspark_param.workers = 2
    with pytest.raises(ConfigError, match="field 8000"):
        compiler.to_caffe(solver, caffe_pb2.SolverParameter)


@pytest.mark.parametrize("name", ["lenet", "cifar10_quick", "cifar10_full"])
def test_our_compiled_net_builds_in_caffe(name):
    """What the backend hands pycaffe (phase resolved, Data as Input) builds with the graph's shapes."""
    path = os.path.join(ROOT, "models", name, "train_val.prototxt")
    net, source = load_net(path)
    for phase, caffe_phase in ((pb.TRAIN, caffe.TRAIN), (pb.TEST, caffe.TEST)):
        graph = Graph(net, phase, source=source, data_shape=shape_finder(path), batch_size=2)
        text = compiler.to_text(compiler.to_caffe(compiler.net_param(graph), caffe_pb2.NetParameter))
        folder = os.environ.get("TMPDIR", "/tmp")
        file = os.path.join(folder, f"deepspark-interop-{os.getpid()}-{name}.prototxt")
        with open(file, "w") as stream:
            stream.write(text)
        try:
            caffe_net = caffe.Net(file, caffe_phase)
        finally:
            os.unlink(file)
        for layer in graph.layers:
            for top, shape in zip(layer.tops, layer.top_shapes):
                assert tuple(caffe_net.blobs[top].data.shape) == tuple(shape), (name, phase, top)
