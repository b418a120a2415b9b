"""Old nets and solvers as Caffe reads them: V0/V1 layers, input fields, solver_type; `upgrade-net` and
`upgrade-solver` against Caffe's own upgrade (pycaffe's upgrade_net_text), field for field."""

import os
import subprocess
import sys

import pytest
from google.protobuf import text_format

from conftest import ROOT, run_cli
from deepspark import config
from deepspark.proto import deepspark_pb2 as pb
from test_data_layers import train_here

V1_LENET = os.path.join(ROOT, "tests", "data", "bvlc", "v1", "lenet_train_test.prototxt")
TRAIN_LMDB = os.path.join(ROOT, "data", "fashion_mnist_train_lmdb")
TEST_LMDB = os.path.join(ROOT, "data", "fashion_mnist_test_lmdb")

# A V0 net (2013): padding layers folded into the convolution after them, V0 fields into today's messages.
V0_NET = """name: "CaffeNet"
input: "data"
input_dim: 10
input_dim: 3
input_dim: 227
input_dim: 227
layers {
  layer { name: "conv1" type: "conv" num_output: 96 kernelsize: 11 stride: 4
          weight_filler { type: "gaussian" std: 0.01 } bias_filler { type: "constant" value: 0. }
          blobs_lr: 1. blobs_lr: 2. weight_decay: 1. weight_decay: 0. }
  bottom: "data"
  top: "conv1"
}
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: MAX kernelsize: 3 stride: 2 } bottom: "conv1" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 5 alpha: 0.0001 beta: 0.75 } bottom: "pool1" top: "norm1" }
layers { layer { name: "pad2" type: "padding" pad: 2 } bottom: "norm1" top: "pad2" }
layers {
  layer { name: "conv2" type: "conv" num_output: 256 group: 2 kernelsize: 5 biasterm: false }
  bottom: "pad2"
  top: "conv2"
}
layers { layer { name: "drop" type: "dropout" dropout_ratio: 0.4 } bottom: "conv2" top: "conv2" }
layers { layer { name: "fc" type: "innerproduct" num_output: 10 } bottom: "conv2" top: "fc" }
layers { layer { name: "prob" type: "softmax" } bottom: "fc" top: "prob" }
"""

# A V1 data layer with its transform fields still in data_param, and a shared, strictly checked blob.
V1_TRANSFORM = """name: "old"
layers {
  name: "data" type: DATA top: "data" top: "label"
  data_param { source: "lmdb" batch_size: 4 scale: 0.5 mirror: true crop_size: 20 mean_file: "m.binaryproto" }
}
layers {
  name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip"
  param: "shared_w" blob_share_mode: STRICT blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
  inner_product_param { num_output: 3 }
}
layers { name: "loss" type: SOFTMAX_LOSS bottom: "ip" bottom: "label" top: "loss" loss_weight: 2 }
"""

# Today's layers with a legacy deploy header (input_shape) and an old BatchNorm with its three ParamSpecs.
INPUT_SHAPE_AND_BATCH_NORM = """name: "deploy"
input: "data"
input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }
layer { name: "bn" type: "BatchNorm" bottom: "data" top: "bn"
        param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } }
"""

# A deploy file with a bare `input:` beside the Input layer that makes the blob: Caffe drops the field.
BARE_INPUT = """name: "deploy"
input: "data"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 4 dim: 4 } } }
layer { name: "relu" type: "ReLU" bottom: "data" top: "relu" }
"""

OLD_NETS = {"v0": V0_NET, "v1_transform": V1_TRANSFORM, "input_shape_batch_norm": INPUT_SHAPE_AND_BATCH_NORM,
            "bare_input": BARE_INPUT}


def caffe_upgrade(kind, path):
    """(text, clean) of pycaffe's own upgrade (Caffe's upgrade_{net,solver}_proto_text, tools/build-caffe.sh
    binds them), in a process of its own: Caffe aborts on what it refuses."""
    code = ("import sys, caffe; text, clean = getattr(caffe._caffe, 'upgrade_%s_text')(sys.argv[1]); "
            "sys.stdout.write(text)" % kind)
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GLOG_minloglevel": "2"})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def pycaffe_upgrade():
    """Skips a test where pycaffe lacks Caffe's upgrade functions (a build older than tools/build-caffe.sh's)."""
    done = subprocess.run([sys.executable, "-c", "import caffe; caffe._caffe.upgrade_net_text"], capture_output=True,
                          env={**os.environ, "GLOG_minloglevel": "2"})
    if done.returncode != 0:
        pytest.skip("pycaffe without upgrade_net_text (make caffe builds it)")


@pytest.mark.caffe
@pytest.mark.parametrize("name", sorted(OLD_NETS) + ["v1_lenet"])
def test_upgrade_net_equals_caffes_field_for_field(tmp_path, name, pycaffe_upgrade):
    old = V1_LENET if name == "v1_lenet" else str(tmp_path / f"{name}.prototxt")
    if name != "v1_lenet":
        open(old, "w").write(OLD_NETS[name])
    out = tmp_path / "upgraded.prototxt"
    status, stdout, err = run_cli("upgrade-net", old, str(out))
    assert status == 0, err
    assert stdout.strip() == f"Wrote upgraded NetParameter text proto to {out}"
    ours = text_format.Parse(out.read_text(), pb.NetParameter())
    theirs = text_format.Parse(caffe_upgrade("net", old), pb.NetParameter())
    assert ours == theirs, (text_format.MessageToString(ours), text_format.MessageToString(theirs))
    assert not ours.layers and not ours.input and ours.layer


@pytest.mark.caffe
def test_upgrade_solver_equals_caffes(tmp_path, pycaffe_upgrade):
    old = tmp_path / "solver.prototxt"
    old.write_text('net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nsolver_type: NESTEROV\nmomentum: 0.9\n'
                   "max_iter: 10\n")
    out = tmp_path / "upgraded.prototxt"
    status, _, err = run_cli("upgrade-solver", str(old), str(out))
    assert status == 0, err
    ours = text_format.Parse(out.read_text(), pb.SolverParameter())
    assert ours.type == "Nesterov" and not ours.HasField("solver_type")
    assert ours == text_format.Parse(caffe_upgrade("solver", str(old)), pb.SolverParameter())


def test_v0_net_describes_with_padding_folded(tmp_path):
    net, source = config.parse_net(V0_NET, "v0.prototxt")
    assert [layer.type for layer in net.layer] == ["Input", "Convolution", "ReLU", "Pooling", "LRN", "Convolution",
                                                   "Dropout", "InnerProduct", "Softmax"]
    conv2 = net.layer[5]
    assert list(conv2.bottom) == ["norm1"] and list(conv2.convolution_param.pad) == [2]
    assert not conv2.convolution_param.bias_term and conv2.convolution_param.group == 2
    # Each upgraded layer points into the file: conv2 came from the 6th `layers` block (line 18).
    assert source.where(5) == ("v0.prototxt", 18, 1) and source.where(0) == ("v0.prototxt", 2, 1)
    path = tmp_path / "v0.prototxt"
    path.write_text(V0_NET)
    status, out, err = run_cli("describe", str(path))
    assert status == 0, err
    assert "conv2  Convolution   conv2 10x256x27x27  256x48x5x5" in out


def test_bare_input_beside_an_input_layer_is_dropped_as_caffe_drops_it(tmp_path):
    path = tmp_path / "deploy.prototxt"
    path.write_text(BARE_INPUT)
    status, out, err = run_cli("describe", str(path))
    assert status == 0, err
    assert out.splitlines()[1].split()[:3] == ["data", "Input", "data"]
    # A bare input nothing makes: Caffe's unknown bottom, here at the layer that reads it.
    path.write_text(BARE_INPUT.replace('top: "data" input_param', 'top: "image" input_param'))
    status, _, err = run_cli("describe", str(path))
    assert status == 1 and err.count("\n") == 1
    assert f"{path}:4:35: layer 'relu': bottom 'data' is not produced by any earlier layer" in err


def test_old_net_errors_point_into_the_file(tmp_path):
    unknown = V0_NET.replace('type: "dropout"', 'type: "maxout"')
    with pytest.raises(config.ConfigError) as caught:
        config.parse_net(unknown, "v0.prototxt")
    assert str(caught.value) == "v0.prototxt:23:1: layer 'drop': unknown V0 layer type 'maxout'"
    both = V1_TRANSFORM + 'layer { name: "x" type: "ReLU" bottom: "ip" top: "ip" }\n'
    with pytest.raises(config.ConfigError) as caught:
        config.parse_net(both, "mixed.prototxt")
    assert str(caught.value).startswith("mixed.prototxt:2:1: the net has both 'layer' and 'layers' blocks")
    short = 'input: "a"\ninput: "b"\ninput_dim: 1\ninput_dim: 2\ninput_dim: 3\ninput_dim: 4\n'
    with pytest.raises(config.ConfigError) as caught:
        config.parse_net(short, "deploy.prototxt")
    assert str(caught.value) == ("deploy.prototxt:1:1: input 'b' needs 4 input_dim values (2 inputs, "
                                 "4 input_dim)")
    solver = tmp_path / "solver.prototxt"
    solver.write_text('net: "n.prototxt"\ntype: "SGD"\nsolver_type: ADAM\n')
    status, _, err = run_cli("upgrade-solver", str(solver), str(tmp_path / "out.prototxt"))
    assert status == 1 and err.strip() == (f"deepspark upgrade-solver: error: {solver}:3:1: the old solver_type "
                                           "field (enum) and the new type field (string) cannot both be given")
    assert not (tmp_path / "out.prototxt").exists()


def test_upgrade_net_unknown_v0_parameter_is_a_warning(tmp_path):
    old = tmp_path / "old.prototxt"
    old.write_text(V0_NET.replace('type: "relu" }', 'type: "relu" num_output: 3 }'))
    status, _, err = run_cli("upgrade-net", str(old), str(tmp_path / "new.prototxt"))
    assert status == 0 and err.strip() == "warning: layer 'relu1': unknown parameter num_output for layer type relu"


@pytest.mark.skipif(not os.path.exists(TRAIN_LMDB), reason="make data builds the Fashion-MNIST LMDBs")
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_v1_lenet_and_an_old_solver_train_unchanged(tmp_path, backend):
    """Caffe's 2014 lenet_train_test.prototxt (V1 `layers`, `include: { phase: TRAIN }`, blobs_lr), as it is,
    from the folder layout its paths assume, with a solver that says solver_type: NESTEROV."""
    os.makedirs(tmp_path / "examples" / "mnist")
    os.symlink(TRAIN_LMDB, tmp_path / "examples" / "mnist" / "mnist_train_lmdb")
    os.symlink(TEST_LMDB, tmp_path / "examples" / "mnist" / "mnist_test_lmdb")
    os.symlink(V1_LENET, tmp_path / "examples" / "mnist" / "lenet_train_test.prototxt")
    solver = tmp_path / "examples" / "mnist" / "lenet_solver.prototxt"
    solver.write_text('net: "examples/mnist/lenet_train_test.prototxt"\ntest_iter: 2\ntest_interval: 2\n'
                      'base_lr: 0.01\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "inv"\ngamma: 0.0001\n'
                      'power: 0.75\ndisplay: 1\nmax_iter: 2\nsnapshot_prefix: "examples/mnist/lenet"\n'
                      "solver_type: NESTEROV\nsolver_mode: CPU\n")
    train_here("examples/mnist/lenet_solver.prototxt", backend, tmp_path)
    log = (tmp_path / "examples" / "mnist" / "train.log").read_text()
    assert "Iteration 1" in log and "Test net output #0: accuracy = " in log
    assert os.path.exists(tmp_path / "examples" / "mnist" / "lenet_iter_2.caffemodel")
