"""Caffe's own rules for layer names: two layers of one name in a phase build, train and save.

BVLC's examples/mnist/mnist_autoencoder.prototxt has two layers named "loss"
(Caffe's Net::Init accepts a repeated name). Where a name is looked up, the
rules are Caffe's, checked against real pycaffe here: net.params[name] and
layer_by_name give the last layer of that name; a .caffemodel (Net::ToProto)
holds every layer under its own name, in order; loading one
(CopyTrainedLayersFrom) copies each of its layers into the FIRST layer of the
net with that name, ignores a name the net lacks, and refuses another count
or shape of blobs.
"""

import math
import subprocess
import sys

import numpy as np
import pytest

from deepspark import checkpoint, compare, engine, fillers, nets
from deepspark.backends.caffe import runtime
from deepspark.config import load_solver, override, parse_net
from deepspark.errors import ConfigError
from deepspark.graph import Graph, with_taps
from deepspark.proto import deepspark_pb2 as pb
from tests.conftest import ROOT, run_cli
from tests.synthetic import make_lmdb

pytestmark = pytest.mark.caffe

caffe = runtime.caffe()

# BVLC's examples/mnist/mnist_autoencoder.prototxt, as it is.
AUTOENCODER = """name: "MNISTAutoencoder"
layer {
  name: "data"
  type: "Data"
  top: "data"
  include {
    phase: TRAIN
  }
  transform_param {
    scale: 0.0039215684
  }
  data_param {
    source: "examples/mnist/mnist_train_lmdb"
    batch_size: 100
    backend: LMDB
  }
}
layer {
  name: "data"
  type: "Data"
  top: "data"
  include {
    phase: TEST
    stage: "test-on-train"
  }
  transform_param {
    scale: 0.0039215684
  }
  data_param {
    source: "examples/mnist/mnist_train_lmdb"
    batch_size: 100
    backend: LMDB
  }
}
layer {
  name: "data"
  type: "Data"
  top: "data"
  include {
    phase: TEST
    stage: "test-on-test"
  }
  transform_param {
    scale: 0.0039215684
  }
  data_param {
    source: "examples/mnist/mnist_test_lmdb"
    batch_size: 100
    backend: LMDB
  }
}
layer {
  name: "flatdata"
  type: "Flatten"
  bottom: "data"
  top: "flatdata"
}
layer {
  name: "encode1"
  type: "InnerProduct"
  bottom: "data"
  top: "encode1"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 1
    decay_mult: 0
  }
  inner_product_param {
    num_output: 1000
    weight_filler {
      type: "gaussian"
      std: 1
      sparse: 15
    }
    bias_filler {
      type: "constant"
      value: 0
    }
  }
}
layer {
  name: "encode1neuron"
  type: "Sigmoid"
  bottom: "encode1"
  top: "encode1neuron"
}
layer {
  name: "encode2"
  type: "InnerProduct"
  bottom: "encode1neuron"
  top: "encode2"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 1
    decay_mult: 0
  }
  inner_product_param {
    num_output: 500
    weight_filler {
      type: "gaussian"
      std: 1
      sparse: 15
    }
    bias_filler {
      type: "constant"
      value: 0
    }
  }
}
layer {
  name: "encode2neuron"
  type: "Sigmoid"
  bottom: "encode2"
  top: "encode2neuron"
}
layer {
  name: "encode3"
  type: "InnerProduct"
  bottom: "encode2neuron"
  top: "encode3"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 1
    decay_mult: 0
  }
  inner_product_param {
    num_output: 250
    weight_filler {
      type: "gaussian"
      std: 1
      sparse: 15
    }
    bias_filler {
      type: "constant"
      value: 0
    }
  }
}
layer {
  name: "encode3neuron"
  type: "Sigmoid"
  bottom: "encode3"
  top: "encode3neuron"
}
layer {
  name: "encode4"
  type: "InnerProduct"
  bottom: "encode3neuron"
  top: "encode4"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 1
    decay_mult: 0
  }
  inner_product_param {
    num_output: 30
    weight_filler {
      type: "gaussian"
      std: 1
      sparse: 15
    }
    bias_filler {
      type: "constant"
      value: 0
    }
  }
}
layer {
  name: "decode4"
  type: "InnerProduct"
  bottom: "encode4"
  top: "decode4"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 1
    decay_mult: 0
  }
  inner_product_param {
    num_output: 250
    weight_filler {
      type: "gaussian"
      std: 1
      sparse: 15
    }
    bias_filler {
      type: "constant"
      value: 0
    }
  }
}
layer {
  name: "decode4neuron"
  type: "Sigmoid"
  bottom: "decode4"
  top: "decode4neuron"
}
layer {
  name: "decode3"
  type: "InnerProduct"
  bottom: "decode4neuron"
  top: "decode3"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 1
    decay_mult: 0
  }
  inner_product_param {
    num_output: 500
    weight_filler {
      type: "gaussian"
      std: 1
      sparse: 15
    }
    bias_filler {
      type: "constant"
      value: 0
    }
  }
}
layer {
  name: "decode3neuron"
  type: "Sigmoid"
  bottom: "decode3"
  top: "decode3neuron"
}
layer {
  name: "decode2"
  type: "InnerProduct"
  bottom: "decode3neuron"
  top: "decode2"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 1
    decay_mult: 0
  }
  inner_product_param {
    num_output: 1000
    weight_filler {
      type: "gaussian"
      std: 1
      sparse: 15
    }
    bias_filler {
      type: "constant"
      value: 0
    }
  }
}
layer {
  name: "decode2neuron"
  type: "Sigmoid"
  bottom: "decode2"
  top: "decode2neuron"
}
layer {
  name: "decode1"
  type: "InnerProduct"
  bottom: "decode2neuron"
  top: "decode1"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 1
    decay_mult: 0
  }
  inner_product_param {
    num_output: 784
    weight_filler {
      type: "gaussian"
      std: 1
      sparse: 15
    }
    bias_filler {
      type: "constant"
      value: 0
    }
  }
}
layer {
  name: "loss"
  type: "SigmoidCrossEntropyLoss"
  bottom: "decode1"
  bottom: "flatdata"
  top: "cross_entropy_loss"
  loss_weight: 1
}
layer {
  name: "decode1neuron"
  type: "Sigmoid"
  bottom: "decode1"
  top: "decode1neuron"
}
layer {
  name: "loss"
  type: "EuclideanLoss"
  bottom: "decode1neuron"
  bottom: "flatdata"
  top: "l2_error"
  loss_weight: 0
}
"""

# BVLC's mnist_autoencoder_solver.prototxt (two test nets of the one net, a stage each), scaled down.
SOLVER = """net: "mnist_autoencoder.prototxt"
test_state: { stage: 'test-on-train' }
test_iter: 2
test_state: { stage: 'test-on-test' }
test_iter: 1
test_interval: 4
test_compute_loss: true
base_lr: 0.01
lr_policy: "step"
gamma: 0.1
stepsize: 10000
display: 2
max_iter: 4
weight_decay: 0.0005
snapshot: 4
snapshot_prefix: "mnist_autoencoder"
momentum: 0.9
solver_mode: GPU
random_seed: 3
"""

# Two layers named "ip" with blobs (the same shapes, so that Caffe can reload its own file),
# two named "act" without, and two named "tied" sharing a weight blob by param name.
FILLED = 'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 }'
TWICE = f"""
name: "twice"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 2 dim: 3 }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "a" inner_product_param {{ num_output: 3 {FILLED} }} }}
layer {{ name: "act" type: "ReLU" bottom: "a" top: "a" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "a" top: "b" inner_product_param {{ num_output: 3 {FILLED} }} }}
layer {{ name: "act" type: "Sigmoid" bottom: "b" top: "c" }}
layer {{ name: "tied" type: "InnerProduct" bottom: "c" top: "d" param {{ name: "w" }}
  inner_product_param {{ num_output: 3 {FILLED} }} }}
layer {{ name: "tied" type: "InnerProduct" bottom: "d" top: "e" param {{ name: "w" }}
  inner_product_param {{ num_output: 3 {FILLED} }} }}
"""


@pytest.fixture(scope="module")
def autoencoder(tmp_path_factory):
    """mnist_autoencoder.prototxt and its solver in a folder, over small 28x28 LMDBs."""
    folder = tmp_path_factory.mktemp("autoencoder")
    train = make_lmdb(folder / "mnist_train_lmdb", 200, seed=1, size=28)
    test = make_lmdb(folder / "mnist_test_lmdb", 100, seed=2, size=28)
    text = AUTOENCODER.replace("examples/mnist/mnist_train_lmdb", train)
    (folder / "mnist_autoencoder.prototxt").write_text(text.replace("examples/mnist/mnist_test_lmdb", test))
    (folder / "mnist_autoencoder_solver.prototxt").write_text(SOLVER)
    return folder


@pytest.fixture()
def twice(tmp_path):
    path = tmp_path / "twice.prototxt"
    path.write_text(TWICE)
    return str(path)


def names_and_types(net):
    return [(layer.name, layer.type) for layer in net.layer]


def caffe_params(graph, net):
    """graph.params-ordered copies of a pycaffe net's blobs (a net Caffe inserts no Split layer into)."""
    assert list(net._layer_names) == [layer.name for layer in graph.layers]
    arrays = [None] * len(graph.params)
    for layer, caffe_layer in zip(graph.layers, net.layers):
        for i, blob in zip(layer.blob_params, caffe_layer.blobs):
            arrays[i] = blob.data.copy()
    return arrays


def caffe_layers(net):
    """[(name, [arrays])] of a pycaffe net's layers, in order, as a .caffemodel lists them."""
    return [(name, [blob.data.copy() for blob in layer.blobs]) for name, layer in zip(net._layer_names, net.layers)]


def assert_same_arrays(ours, theirs, what=""):
    assert len(ours) == len(theirs), what
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, np.reshape(b, a.shape), err_msg=what)


def assert_same_layers(ours, theirs):
    """Two [(name, [arrays])] lists hold the same names in order, and the same blobs."""
    assert [name for name, _ in ours] == [name for name, _ in theirs]
    for (name, a), (_, b) in zip(ours, theirs):
        assert_same_arrays(a, b, name)


# -- the BVLC net: describe, build, train on both backends, snapshot ------------------------


def test_describe_lists_both_loss_layers(autoencoder):
    """`deepspark describe mnist_autoencoder.prototxt`: both 'loss' layers, each with its own top."""
    status, out, err = run_cli("describe", str(autoencoder / "mnist_autoencoder.prototxt"), cwd=ROOT)
    assert status == 0, out + err
    losses = [line.split() for line in out.splitlines() if line.startswith("loss ")]
    assert [row[:3] for row in losses] == [["loss", "SigmoidCrossEntropyLoss", "cross_entropy_loss"],
                                           ["loss", "EuclideanLoss", "l2_error"]]
    assert "total parameters: 2837314" in out


def test_the_graph_holds_both_and_a_lookup_by_name_is_caffes(autoencoder):
    net = parse_net((autoencoder / "mnist_autoencoder.prototxt").read_text())[0]
    graph = Graph(net, pb.TEST, stages=["test-on-test"], data_shape=lambda layer: (1, 28, 28))
    losses = [layer for layer in graph.layers if layer.name == "loss"]
    assert [(l.type, l.tops, l.loss_weights) for l in losses] == [
        ("SigmoidCrossEntropyLoss", ["cross_entropy_loss"], [1.0]), ("EuclideanLoss", ["l2_error"], [0.0])]
    assert graph.layer("loss") is losses[1]  # Caffe's Net::layer_by_name: the last of the name
    assert [layer.param.data_param.source for layer in graph.layers if layer.name == "data"] == [
        str(autoencoder / "mnist_test_lmdb")]  # the stage picks the data layer
    assert set(graph.outputs) == {"cross_entropy_loss", "l2_error"}


def test_training_on_both_backends_agrees_and_the_snapshot_loads_in_caffe(autoencoder, tmp_path):
    """`deepspark train --solver mnist_autoencoder_solver.prototxt --algorithm single`, on each
    backend: the same losses on both test nets; the snapshot holds both 'loss' layers and pycaffe
    loads it."""
    results = {}
    for backend in ("caffe", "tensorflow"):
        solver = load_solver(str(autoencoder / "mnist_autoencoder_solver.prototxt"))
        override(solver, output=str(tmp_path / backend), algorithm="single", backend=backend)
        results[backend] = nets.train(solver).summary
    keys = ["test0/cross_entropy_loss", "test0/l2_error", "test1/cross_entropy_loss", "test1/l2_error"]
    assert all(math.isfinite(results["caffe"][key]) for key in keys), results
    for key in keys:
        assert results["tensorflow"][key] == pytest.approx(results["caffe"][key], rel=1e-4), key

    snapshot = tmp_path / "tensorflow" / "mnist_autoencoder_iter_4.caffemodel"
    saved = pb.NetParameter.FromString(snapshot.read_bytes())
    assert [t for name, t in names_and_types(saved) if name == "loss"] == ["SigmoidCrossEntropyLoss",
                                                                           "EuclideanLoss"]
    theirs = caffe.Net(str(autoencoder / "mnist_autoencoder.prototxt"), caffe.TEST, stages=["test-on-test"],
                       weights=str(snapshot))
    ours = [(name, arrays) for name, arrays in checkpoint.read_caffemodel(str(snapshot)) if arrays]
    assert_same_layers(ours, [(name, arrays) for name, arrays in caffe_layers(theirs) if arrays])


# -- weights of same-named layers with blobs, against pycaffe ---------------------------------


@pytest.mark.parametrize("writer", ["ours", "pycaffe"])
def test_a_caffemodel_loads_into_the_first_layer_of_each_name_in_both(twice, tmp_path, writer):
    """Saved by us or by pycaffe's Net.save, one .caffemodel loads the same in both: each of its
    layers into the first net layer of its name (the later 'ip' overwriting the earlier), the
    second 'ip' left as it was, the shared blob from the last 'tied' that carries it."""
    graph = Graph(parse_net(TWICE)[0], pb.TEST)
    file = tmp_path / f"{writer}.caffemodel"
    path = str(file)
    if writer == "ours":
        checkpoint.save_caffemodel(path, graph, fillers.init_params(graph, 1))
    else:
        caffe.set_random_seed(1)
        caffe.Net(twice, caffe.TEST).save(path)
    saved = pb.NetParameter.FromString(file.read_bytes())
    assert [name for name, _ in names_and_types(saved)] == ["data", "ip", "act", "ip", "act", "tied", "tied"]
    caffe.set_random_seed(5)
    theirs = caffe.Net(twice, caffe.TEST)
    initial = caffe_params(graph, theirs)
    before = caffe_layers(theirs)
    theirs.copy_from(path)
    loaded = checkpoint.weights_for(graph, checkpoint.read_caffemodel(path), initial, path)
    ours = checkpoint.layer_blobs(graph, loaded)
    assert_same_layers(ours, caffe_layers(theirs))
    # The rule spelled out: the first 'ip' holds the file's second one, the second 'ip' is as it was,
    # and the first 'tied' (the shared weight's owner) holds the file's last 'tied'.
    written = checkpoint.read_caffemodel(path)
    assert_same_arrays(ours[1][1], written[3][1], "first ip")
    assert_same_arrays(ours[3][1], before[3][1], "second ip")
    assert_same_arrays(ours[5][1], written[6][1], "first tied")


def test_backends_give_a_name_the_blobs_pycaffe_does_and_agree(twice):
    """get_blobs('ip') is pycaffe's net.params['ip'] (the last 'ip'); both backends run the net
    with each layer's own blobs and agree blob by blob."""
    net = parse_net(TWICE)[0]
    models = compare.build(["caffe", "tensorflow"], net, phase=pb.TEST, seed=3)
    try:
        ours = models["caffe"]
        assert_same_arrays(ours.get_params(), caffe_params(ours.graph, ours._net))
        assert_same_arrays(ours.get_blobs("ip"), [blob.data for blob in ours._net.params["ip"]])
        first, second = (layer.blob_params for layer in ours.graph.layers if layer.name == "ip")
        assert ours.layer_blobs("ip") == second and first != second
        assert_same_arrays(models["tensorflow"].get_params(), ours.get_params())
        tapped = with_taps(net, ours.graph)
    finally:
        for model in models.values():
            model.close()
    models = compare.build(["caffe", "tensorflow"], tapped, phase=pb.TEST, seed=3)
    try:
        _, rows = compare.compare_forward(models, engine.SyntheticBatches(models["caffe"], 7), repeats=1)
    finally:
        for model in models.values():
            model.close()
    assert {blob for blob, *_ in rows} == {"a@act", "b@ip", "c@act", "d@tied", "e"}
    for blob, _, diffs, _ in rows:
        assert diffs["tensorflow"][1] < 1e-5, blob


CAFFE_REFUSES = {
    "shape": ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "a" '
              'inner_product_param { num_output: 3 } }\n'
              'layer { name: "ip" type: "InnerProduct" bottom: "a" top: "b" inner_product_param { num_output: 2 } }',
              "Cannot copy param 0 weights from layer 'ip'; shape mismatch",
              "cannot copy param 0 of layer 'ip': shape mismatch, weights have (2, 3), the net needs (3, 3) "
              "(its first layer 'ip', the InnerProduct, takes them)"),
    "count": ('layer { name: "x" type: "ReLU" bottom: "data" top: "r" }\n'
              'layer { name: "x" type: "InnerProduct" bottom: "r" top: "b" inner_product_param { num_output: 2 } }',
              "Incompatible number of blobs for layer x",
              "layer 'x' has 2 blobs in the weights, the net needs 0 (its first layer 'x', the ReLU, takes them)"),
}


@pytest.mark.parametrize("case", sorted(CAFFE_REFUSES))
def test_what_caffe_refuses_to_reload_we_refuse(tmp_path, case):
    """Caffe cannot reload its own .caffemodel when the first layer of a repeated name does not
    fit the blobs of a later one: pycaffe aborts, we refuse with a one-line error."""
    layers, caffe_says, we_say = CAFFE_REFUSES[case]
    text = 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }\n' + layers
    net_file, weights = tmp_path / "net.prototxt", str(tmp_path / "w.caffemodel")
    net_file.write_text(text)
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from deepspark.backends.caffe import runtime; "
              "caffe = runtime.caffe(); net = caffe.Net(sys.argv[2], caffe.TEST); net.save(sys.argv[3]); "
              "net.copy_from(sys.argv[3])")
    done = subprocess.run([sys.executable, "-c", script, ROOT, str(net_file), weights], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and caffe_says in done.stderr, done.stderr
    graph = Graph(parse_net(text)[0], pb.TEST)
    with pytest.raises(ConfigError) as caught:
        checkpoint.weights_for(graph, checkpoint.read_caffemodel(weights), fillers.init_params(graph, 0), weights)
    assert str(caught.value) == f"{weights}: {we_say}"
