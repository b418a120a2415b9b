"""Caffe's `type: "Python"` layers: the user's module on both backends (pycaffe natively, TensorFlow through the
numpy bridge), BVLC's examples/pycaffe/linreg.prototxt with its pyloss module, Python data layers, bad modules."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_cli
from deepspark import config, graph
from deepspark.backends import create_model
from deepspark.proto import deepspark_pb2 as pb
from test_data_layers import train_here

PYCAFFE = os.path.join(ROOT, "tests", "data", "bvlc", "examples", "pycaffe")
PYLOSS = os.path.join(PYCAFFE, "layers", "pyloss.py")
SYNTHETIC = os.path.join(ROOT, "tests", "data", "python_layers", "synthetic_layers.py")

# Inputs through InnerProducts into the Python Euclidean loss: the bridge's forward and backward, all blobs.
REGRESSION = """name: "regression"
layer { name: "in" type: "Input" top: "x" top: "y"
        input_param { shape { dim: 5 dim: 3 dim: 2 } shape { dim: 5 dim: 4 } } }
layer { name: "ipx" type: "InnerProduct" bottom: "x" top: "ipx"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } bias_filler { type: "gaussian" } } }
layer { name: "ipy" type: "InnerProduct" bottom: "y" top: "ipy"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "Python" bottom: "ipx" bottom: "ipy" top: "loss"
        python_param { module: "pyloss" layer: "EuclideanLossLayer" } loss_weight: 0.5 }
"""

DATA_NET = """name: "python_data"
layer { name: "data" type: "Python" top: "data" top: "label"
        python_param { module: "synthetic_layers" layer: "SyntheticData" param_str: '{"batch": 16, "seed": 3}' } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
"""

# FCN's shape of net: a Python data layer, a strided convolution, a Deconvolution back up, a Crop to the input.
FCN_NET = """name: "fcn_style"
layer { name: "data" type: "Python" top: "data" top: "label"
        python_param { module: "synthetic_layers" layer: "SyntheticSegmentation" param_str: '{"batch": 2, "size": 16}' } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3 stride: 2 pad: 8 weight_filler { type: "xavier" } } }
layer { name: "up" type: "Deconvolution" bottom: "conv" top: "up"
        convolution_param { num_output: 3 kernel_size: 4 stride: 2 bias_term: false weight_filler { type: "xavier" } } }
layer { name: "score" type: "Crop" bottom: "up" bottom: "data" top: "score" crop_param { axis: 2 offset: 5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss" }
"""

SOLVER = """net: "{net}"
base_lr: 0.01
momentum: 0.9
lr_policy: "fixed"
display: 1
max_iter: {iterations}
snapshot_after_train: false
random_seed: 5
solver_mode: CPU
"""


def beside(tmp_path, text, *modules, name="net.prototxt"):
    """A prototxt in tmp_path with copies of `modules` beside it (where Caffe's users keep them)."""
    for module in modules:
        shutil.copy(module, tmp_path)
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load(path, **kw):
    net, source = config.parse_net(open(path).read(), path)
    return net, source


@pytest.mark.caffe
def test_the_bridge_gives_pycaffes_forward_and_backward(tmp_path):
    """pycaffe runs the module natively; the TensorFlow backend runs the same module through numpy_function,
    its backward as the gradient: the same loss and diffs, loss_weight included."""
    path = beside(tmp_path, REGRESSION, PYLOSS)
    net, source = load(path)
    solver = pb.SolverParameter(base_lr=0.1, lr_policy="fixed")
    models = {name: create_model(name, net, solver, source=source, seed=7) for name in ("caffe", "tensorflow")}
    try:
        params = models["caffe"].get_params()
        models["tensorflow"].set_params(params)
        rng = np.random.default_rng(0)
        batch = {"x": rng.standard_normal((5, 3, 2)), "y": rng.standard_normal((5, 4))}
        (loss_c, grads_c), (loss_t, grads_t) = (models[n].gradients(batch) for n in ("caffe", "tensorflow"))
        assert loss_t == pytest.approx(loss_c, rel=1e-5) and loss_c > 0
        for c, t in zip(grads_c, grads_t):
            np.testing.assert_allclose(t, c, rtol=1e-4, atol=1e-6)
        assert any(np.abs(g).max() > 0 for g in grads_c)
        # and a step of each from the same weights lands on the same weights
        steps = [models[n].step(batch) for n in ("caffe", "tensorflow")]
        assert steps[1] == pytest.approx(steps[0], rel=1e-5)
        np.testing.assert_allclose(models["tensorflow"].get_flat(), models["caffe"].get_flat(), rtol=1e-4, atol=1e-6)
    finally:
        for model in models.values():
            model.close()


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_linreg_with_its_pyloss_module_trains(tmp_path, monkeypatch, backend):
    """BVLC's examples/pycaffe/linreg.prototxt as it is, its module from PYTHONPATH as BVLC's readme says."""
    solver = tmp_path / "solver.prototxt"
    solver.write_text(SOLVER.format(net=os.path.join(PYCAFFE, "linreg.prototxt"), iterations=3)
                      + f'snapshot_prefix: "{tmp_path}/linreg"\n')
    monkeypatch.syspath_prepend(os.path.join(PYCAFFE, "layers"))  # BVLC's readme: PYTHONPATH=examples/pycaffe/layers
    train_here(solver, backend)
    log = (tmp_path / "train.log").read_text()
    lines = [line for line in log.splitlines() if "Train net output #0: loss = " in line]
    assert len(lines) == 3 and all("(* 1 = " in line for line in lines)
    losses = [float(line.split("loss = ")[1].split()[0]) for line in lines]
    assert all(np.isfinite(losses)) and min(losses) > 0


def test_tensorflow_runs_a_module_that_imports_caffe_without_pycaffe(tmp_path):
    """The module says `import caffe` and subclasses caffe.Layer; the TensorFlow backend gives it the stand-in,
    found beside the prototxt, and never loads pycaffe (nor leaves the stand-in as `caffe`)."""
    path = beside(tmp_path, REGRESSION, PYLOSS)
    code = f"""
import sys
import numpy as np
from deepspark import config
from deepspark.backends import create_model
from deepspark.proto import deepspark_pb2 as pb
net, source = config.parse_net(open({path!r}).read(), {path!r})
model = create_model("tensorflow", net, pb.SolverParameter(base_lr=0.1, lr_policy="fixed"), source=source, seed=1)
rng = np.random.default_rng(0)
batch = {{"x": rng.standard_normal((5, 3, 2)), "y": rng.standard_normal((5, 4))}}
first = model.step(batch)
for _ in range(20):
    last = model.step(batch)
assert last < first, (first, last)
assert "caffe" not in sys.modules and not any(m.startswith("caffe.") for m in sys.modules), sorted(sys.modules)
print("ok", first, last)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=str(tmp_path))
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_a_python_data_layer_feeds_the_net(tmp_path, backend):
    net_path = beside(tmp_path, DATA_NET, SYNTHETIC)
    net, source = load(net_path)
    assert [layer.top_shapes for layer in graph.Graph(net, source=source).layers[:1]] == [[(16, 3, 8, 8), (16,)]]
    solver = tmp_path / "solver.prototxt"
    solver.write_text(SOLVER.format(net=net_path, iterations=40)
                      + f'snapshot_prefix: "{tmp_path}/data"\n')
    train_here(solver, backend)
    log = (tmp_path / "train.log").read_text()
    accuracy = [float(line.split("= ")[1]) for line in log.splitlines() if "Train net output #0: accuracy" in line]
    losses = [float(line.split("= ")[1].split()[0]) for line in log.splitlines()
              if "Train net output #1: loss" in line]
    assert len(accuracy) == len(losses) == 40
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) and np.mean(accuracy[-10:]) > np.mean(accuracy[:10])


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_an_fcn_style_net_with_a_python_data_layer_and_crop_trains(tmp_path, backend):
    net_path = beside(tmp_path, FCN_NET, SYNTHETIC)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(SOLVER.format(net=net_path, iterations=3) + f'snapshot_prefix: "{tmp_path}/fcn"\n')
    status, out, err = run_cli("describe", net_path)
    assert status == 0 and "score  Crop" in out and "score 2x3x16x16" in out, err
    train_here(solver, backend)
    log = (tmp_path / "train.log").read_text()
    assert log.count("Train net output #0: loss = ") == 3


@pytest.mark.parametrize("module,layer,expected", [
    ("no_such_module", "Layer", "cannot import module 'no_such_module' (looked in {folder} and sys.path"),
    ("synthetic_layers", "NoSuchLayer", "module 'synthetic_layers' has no layer class 'NoSuchLayer'"),
    ("synthetic_layers", "FailingSetup",
     "synthetic_layers.FailingSetup.setup raised ValueError: param_str must name a split"),
])
def test_a_bad_python_layer_is_one_line_at_the_layer(tmp_path, module, layer, expected):
    text = DATA_NET.replace('module: "synthetic_layers" layer: "SyntheticData"', f'module: "{module}" layer: "{layer}"')
    path = beside(tmp_path, text, SYNTHETIC)
    status, _, err = run_cli("describe", path)
    assert status == 1 and err.count("\n") == 1, err
    assert err.startswith(f"deepspark describe: error: {path}:2:1: layer 'data' (Python): "
                          + expected.format(folder=tmp_path)), err


def test_export_refuses_a_python_layer_in_one_line(tmp_path):
    path = beside(tmp_path, REGRESSION, PYLOSS, name="deploy.prototxt")
    status, _, err = run_cli("export", "--model", path, "--weights", str(tmp_path / "w.caffemodel"),
                             "--output", str(tmp_path / "saved"))
    assert status == 1 and err.strip() == (f"deepspark export: error: {path}:8:1: layer 'loss' is a Python layer: a "
                                           "SavedModel carries no Python code, so export cannot hold it")
    assert not (tmp_path / "saved").exists()


# A module that uses pycaffe's compiled part, as published layers do (caffe._caffe's layer_type_list here).
USES_PYCAFFE = '''import caffe
import caffe._caffe


class Doubler(caffe.Layer):
    def setup(self, bottom, top):
        self.types = len(caffe._caffe.layer_type_list())

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 2 * top[0].diff
'''

DOUBLER_NET = """name: "doubler"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "double" type: "Python" bottom: "x" top: "y" python_param { module: "uses_pycaffe" layer: "Doubler" } }
"""

# deepspark.Net on the Caffe backend, then on TensorFlow in the same process (pycaffe loaded by the first).
RUN_DOUBLER = """
import sys
import numpy as np
import deepspark
x = np.arange(6, dtype=np.float32).reshape(2, 3)
for backend in ("caffe", "tensorflow"):
    print(backend, deepspark.Net(sys.argv[1], backend=backend).forward(x=x)["y"].ravel().tolist())
"""


@pytest.mark.caffe
def test_a_module_using_pycaffes_own_parts_runs_where_pycaffe_is_loaded(tmp_path):
    """A Python layer whose module imports caffe._caffe was refused by the stand-in `caffe` even on the Caffe
    backend, whose pycaffe has it: where pycaffe is loaded, the stand-in hands such names on to it, on both
    backends; the module's answer is pycaffe's."""
    (tmp_path / "uses_pycaffe.py").write_text(USES_PYCAFFE)
    (tmp_path / "doubler.prototxt").write_text(DOUBLER_NET)
    done = subprocess.run([sys.executable, "-c", RUN_DOUBLER, str(tmp_path / "doubler.prototxt")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT}, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    expected = [2.0 * value for value in range(6)]
    assert done.stdout.strip().splitlines()[-2:] == [f"caffe {expected}", f"tensorflow {expected}"], done.stdout
