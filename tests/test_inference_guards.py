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
    assert [line.split("] ", 1)[1] for line in err.splitlines() if line.startswith("W")] == [
        f"{renamed}: the weights lack 1 of the net's 4 layers with parameters ('ip2'), which would serve "
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


def saved_model(prototxt, folder):
    """`prototxt` exported with its fillers' weights into `folder`/saved; the SavedModel's folder."""
    net, _ = config.load_net(prototxt)
    model = compare.build(["tensorflow"], net, phase=pb.TEST)["tensorflow"]
    weights = str(folder / "weights.caffemodel")
    checkpoint.save_caffemodel(weights, model.graph, model.get_params())
    model.close()
    status, _, err = run_cli("export", "--model", prototxt, "--weights", weights, "--output", str(folder / "saved"))
    assert status == 0, err[-2000:]
    return folder / "saved"


def test_a_fully_convolutional_saved_model_refuses_an_input_smaller_than_the_net_takes(tmp_path):
    """MTCNN's P-Net takes 11 x 11 and more (Caffe's ceil-mode pooling): fed 2 x 16 its SavedModel said
    `Incompatible shapes: [1,3,2,16] vs. [32]`, and smaller than a kernel a net answered uninitialised memory
    (-2.4e24 after a ReLU). Now one line names the smallest size, as deepspark.Net refuses it; 11 x 11 and
    12 x 40 are served."""
    from test_export import serve_alone  # its SavedModel runner, in a process without DeepSpark

    saved = saved_model(os.path.join(DATA, "zoo", "mtcnn_det1.prototxt"), tmp_path)
    rng = np.random.default_rng(0)
    shapes = [(1, 3, 2, 16), (2, 3, 10, 12), (1, 3, 12, 10), (1, 3, 11, 11), (2, 3, 12, 40)]
    runs = [(saved, {"data": rng.uniform(-1, 1, shape).astype(np.float32)}, tmp_path / f"run{i}")
            for i, shape in enumerate(shapes)]
    *refused, small, wide = serve_alone(runs, tmp_path)
    for line, shape in zip(refused, shapes):
        assert isinstance(line, str) and "\n" not in line, line
        assert ("input data must be N x 3 x any x any, at least 11 x 11 (smaller, the net has nothing to compute); "
                f"it is] [{' '.join(map(str, shape))}]") in line, line
    assert small["prob1"].shape == (1, 2, 1, 1) and wide["prob1"].shape == (2, 2, 1, 15)


@pytest.mark.caffe
def test_export_of_senets_se_block_gives_pycaffes_outputs(tmp_path):
    """hujie-frank/SENet's SE block (Scale with a second bottom, N x C, at axis 0) ran in deepspark.Net but its
    export died in a 50-line TensorFlow traceback: the served batch is of unknown size. Its SavedModel now
    gives pycaffe's outputs at batches 1 and 3, as Net does on both backends."""
    from test_export import TOLERANCE, serve_alone
    from test_net import pycaffe_forward, random_weights  # deferred: it imports pycaffe

    import deepspark

    prototxt = os.path.join(DATA, "se_block.prototxt")
    weights = random_weights(prototxt, str(tmp_path / "se.caffemodel"), seed=5)
    status, _, err = run_cli("export", "--model", prototxt, "--weights", weights, "--output", str(tmp_path / "se"))
    assert status == 0, err[-3000:]
    rng = np.random.default_rng(2)
    feeds = [rng.normal(0, 1, (batch, 3, 12, 12)).astype(np.float32) for batch in (1, 3)]
    served = serve_alone([(tmp_path / "se", {"data": data}, tmp_path / f"b{i}") for i, data in enumerate(feeds)],
                         tmp_path)
    for data, outputs in zip(feeds, served):
        expected, _, _ = pycaffe_forward(prototxt, weights, data)
        nets = [deepspark.Net(prototxt, weights, backend=backend) for backend in ("tensorflow", "caffe")]
        for ours in [outputs] + [net.forward(data=data) for net in nets]:
            assert ours["prob"].shape == expected["prob"].shape == (len(data), 5)
            assert np.ptp(expected["prob"]) > 0
            _, relative = compare.difference(ours["prob"], expected["prob"])
            assert relative <= TOLERANCE, relative


# Net on the LRCN-shaped net, in a process of its own (Caffe's CHECK aborted the whole process): at another number
# of timesteps (5 for 4), then, the net as it was, at its own; prints the error's line and the output's shape.
TIMESTEPS = """
import sys
import numpy as np
import caffe
import deepspark
net = deepspark.Net(sys.argv[1], backend=sys.argv[2])
feed = lambda steps: dict(data=np.ones((steps, 2, 6), np.float32), clip_markers=np.ones((steps, 2), np.float32))
try:
    print(net.forward(**feed(5))["probs"].shape)
except ValueError as error:
    print(str(error).replace("\\n", " | "))
print(net.forward(**feed(4))["probs"].shape)
"""


@pytest.mark.caffe
@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_another_number_of_lstm_timesteps_is_one_line_on_the_caffe_backend(backend):
    """Caffe's Recurrent layer fixes T at setup and aborts (exit 134) on another: the Caffe backend refuses it
    first in one ValueError, and runs on at the net's own T; the TensorFlow backend computes any T."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TIMESTEPS, os.path.join(DATA, "lrcn_lstm.prototxt"), backend],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.strip().splitlines()[-2:]
    if backend == "caffe":
        assert first == ("layer 'lstm1' (LSTM) was set up for 4 timesteps and Caffe's Recurrent layer cannot take 5 "
                         "(it aborts: input number of timesteps changed); build a new net at that size"), first
    else:
        assert first == "(5, 2, 3)", first
    assert second == "(4, 2, 3)", second


@pytest.mark.caffe
@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_an_empty_batch_or_a_missing_axis_is_one_line_naming_the_input(backend):
    """An empty batch gave a raw TensorFlow error (and Caffe's backend a SIGFPE); a 3-D image gave an error at
    pool1. Each is one ValueError naming the input and its axes, and the net runs on after it."""
    import deepspark

    net = deepspark.Net(os.path.join(DATA, "zoo", "mtcnn_det1.prototxt"), backend=backend)
    cases = [((0, 3, 12, 12), "input 'data' is 0x3x12x12: an empty batch; every axis needs at least one item"),
             ((3, 12, 12), "input 'data' is 3x12x12, 3 axes; the net takes 4 (as 1x3x12x12) (a batch of one item "
                           "is array[None])")]
    for shape, said in cases:
        with pytest.raises(ValueError) as raised:
            net.forward(data=np.zeros(shape, np.float32))
        assert str(raised.value) == said
    assert net.forward(data=np.zeros((2, 3, 12, 12), np.float32))["prob1"].shape == (2, 2, 1, 1)


DEPLOY_ONLY = """name: "deploy_only"
layer { name: "data" type: "Input" top: "data" include { phase: TEST }
        input_param { shape { dim: 4 dim: 2 dim: 6 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 3 axis: 2 } }
"""


def test_describe_names_phase_test_when_the_train_phase_of_a_deploy_net_fails(tmp_path):
    """describe builds the TRAIN phase by default: a deploy-only net (LRCN's, its input included in TEST alone)
    failed there with no word of --phase TEST. The line now names it where TEST builds; an explicit phase, or a
    net whose TEST phase fails too, keeps the error as it was."""
    path = tmp_path / "deploy.prototxt"
    path.write_text(DEPLOY_ONLY)
    status, _, err = run_cli("describe", str(path))
    line = err.strip().splitlines()[-1]
    assert status == 1 and line.startswith("deepspark describe: error: ") and "'data'" in line, err
    assert line.endswith("(in the TRAIN phase, describe's default; the TEST phase builds: give --phase TEST)"), line
    status, out, _ = run_cli("describe", str(path), "--phase", "TEST")
    assert status == 0 and "fc 4x2x3" in " ".join(out.split()), out
    status, _, err = run_cli("describe", str(path), "--phase", "TRAIN")
    assert status == 1 and "--phase TEST" not in err, err
    path.write_text(DEPLOY_ONLY.replace(" include { phase: TEST }", "").replace('"data" top: "fc"', '"x" top: "fc"'))
    status, _, err = run_cli("describe", str(path))
    assert status == 1 and "--phase TEST" not in err and "'x'" in err, err


HDF5_NET = """name: "hdf5_fed"
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST }
        hdf5_data_param { source: "{source}" batch_size: 2 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
layer { name: "silence" type: "Silence" bottom: "label" }
"""


@pytest.mark.caffe
@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_net_reads_an_hdf5_data_layers_source_as_pycaffe(tmp_path, backend):
    """Net refused a net with an HDF5Data layer ("its data shape is unknown") though describe read the shape from
    the same list: it now takes the shape from the source and, as pycaffe, reads the next batch at each forward."""
    import h5py
    import deepspark
    from test_net import random_weights  # deferred: it imports pycaffe
    import caffe

    rng = np.random.default_rng(3)
    with h5py.File(tmp_path / "rows.h5", "w") as stream:
        stream["data"] = rng.normal(0, 1, (6, 3, 5, 5)).astype(np.float32)
        stream["label"] = np.arange(6, dtype=np.float32)
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'rows.h5'}\n")
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(HDF5_NET.replace("{source}", str(tmp_path / "list.txt")))
    weights = random_weights(str(prototxt), str(tmp_path / "net.caffemodel"), seed=2)
    theirs = caffe.Net(str(prototxt), weights, caffe.TEST)
    net = deepspark.Net(str(prototxt), weights, backend=backend)
    assert net.inputs == [] and net.blobs["data"].shape == (2, 3, 5, 5)
    for _ in range(3):
        expected = np.array(theirs.forward()["prob"])
        ours = net.forward()["prob"]
        assert np.ptp(expected) > 0 and np.abs(ours - expected).max() <= 1e-5, (ours, expected)
        assert np.array_equal(net.blobs["data"].data, theirs.blobs["data"].data)


@pytest.mark.caffe
@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_openpose_placeholder_inputs_load_and_are_checked_at_forward(tmp_path, backend):
    """OpenPose's deploy input is 1x3x1x1, "defined at runtime": pycaffe loads it, Net refused it at construction
    (a 2x2 pooling over a 1x1 map). It now loads with the input blob as declared; a forward at the caller's size
    gives pycaffe's outputs, and one at a size the layers refuse is one ValueError, as Caffe checks at Reshape."""
    import caffe
    import deepspark
    from test_net import random_weights  # deferred: it imports pycaffe

    prototxt = os.path.join(DATA, "openpose_placeholder.prototxt")
    weights = random_weights(prototxt, str(tmp_path / "openpose.caffemodel"), seed=9)
    net = deepspark.Net(prototxt, weights, backend=backend)
    assert net.inputs == ["image"] and net.blobs["image"].shape == (1, 3, 1, 1)
    image = np.random.default_rng(4).normal(0, 1, (2, 3, 24, 20)).astype(np.float32)
    theirs = caffe.Net(prototxt, weights, caffe.TEST)
    theirs.blobs["image"].reshape(*image.shape)
    theirs.reshape()
    expected = np.array(theirs.forward(image=image)["net_output"])
    ours = net.forward(image=image)["net_output"]
    assert ours.shape == expected.shape == (2, 5, 6, 5) and np.ptp(expected) > 0
    assert np.abs(ours - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())
    with pytest.raises(ValueError) as raised:
        net.forward(image=np.zeros((1, 3, 1, 1), np.float32))
    assert "\n" not in str(raised.value) and "pool1_stage1" in str(raised.value), raised.value


FASHION_TEST = os.path.join(ROOT, "data", "fashion_mnist_test_lmdb")


@pytest.mark.caffe
@pytest.mark.skipif(not os.path.exists(FASHION_TEST), reason="needs `make data` (Fashion-MNIST's test LMDB)")
def test_net_reads_a_data_layers_lmdb_as_pycaffe(monkeypatch):
    """LeNet's train_val TEST phase reads Fashion-MNIST's LMDB: Net takes its shape from it and feeds the same
    batches (scaled by transform_param) as pycaffe's Data layer, forward after forward, on both backends.
    (One pycaffe net only: two on one LMDB hang pycaffe itself.)"""
    import caffe
    import deepspark

    monkeypatch.chdir(ROOT)  # the prototxt's source is relative, read from the current folder as Caffe does
    prototxt = os.path.join("models", "lenet", "train_val.prototxt")
    theirs = caffe.Net(prototxt, caffe.TEST)
    nets = [deepspark.Net(prototxt, backend=backend) for backend in ("tensorflow", "caffe")]
    for net in nets:
        assert net.inputs == [] and net.blobs["data"].shape == theirs.blobs["data"].data.shape
        for name, blobs in theirs.params.items():
            for ours, blob in zip(net.params[name], blobs):
                ours.data[...] = blob.data
    for _ in range(2):
        expected = {name: float(value) for name, value in theirs.forward().items()}
        for net in nets:
            got = net.forward()
            assert np.array_equal(net.blobs["data"].data, theirs.blobs["data"].data)
            assert np.array_equal(net.blobs["label"].data, theirs.blobs["label"].data)
            assert abs(float(got["loss"]) - expected["loss"]) < 1e-5 and float(got["accuracy"]) == expected["accuracy"]
