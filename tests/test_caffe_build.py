"""Checks that the pycaffe built by tools/build-caffe.sh (`make caffe`) works in this venv."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.caffe

# Input + Convolution + InnerProduct + SoftmaxWithLoss, two images of 1x8x8.
TINY_NET = """
name: "tiny"
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 2 dim: 1 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

# Imports caffe and TensorFlow in the order given by argv[1], then runs the
# tiny net forward and backward and checks the loss against numpy.
IMPORT_ORDER_SCRIPT = """
import sys
order, net_path = sys.argv[1], sys.argv[2]
if order == "tensorflow-first":
    import tensorflow as tf
    import caffe
else:
    import caffe
    import tensorflow as tf
import numpy as np

caffe.set_mode_cpu()
net = caffe.Net(net_path, caffe.TRAIN)
rng = np.random.default_rng(0)
net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
net.blobs["label"].data[...] = [0, 2]
loss = float(net.forward()["loss"])
logits = net.blobs["ip"].data.astype(np.float64)
p = np.exp(logits - logits.max(axis=1, keepdims=True))
p /= p.sum(axis=1, keepdims=True)
expected = -np.mean(np.log(p[[0, 1], [0, 2]]))
assert abs(loss - expected) < 1e-4 * max(1.0, expected), (loss, expected)
net.backward()
grad = net.params["conv"][0].diff
assert np.isfinite(grad).all() and np.abs(grad).sum() > 0, grad
assert float(tf.reduce_sum(tf.constant([1.0, 2.0]))) == 3.0
print("loss", loss)
"""

INNER_PRODUCT_NET = """
name: "ip"
force_backward: true
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
  inner_product_param { num_output: 3 } }
"""

# Sets known weights, runs forward and backward, prints everything as .npz.
INNER_PRODUCT_SCRIPT = """
import sys
import caffe
import numpy as np

net_path, x_path, out_path = sys.argv[1:4]
inputs = np.load(x_path)
caffe.set_mode_cpu()
net = caffe.Net(net_path, caffe.TEST)
net.params["ip"][0].data[...] = inputs["w"]
net.params["ip"][1].data[...] = inputs["b"]
net.blobs["x"].data[...] = inputs["x"]
y = net.forward()["y"].copy()
net.blobs["y"].diff[...] = inputs["g"]
net.backward()
np.savez(out_path, y=y, dw=net.params["ip"][0].diff, db=net.params["ip"][1].diff,
         dx=net.blobs["x"].diff)
"""

# A Data layer reading an LMDB of Datum records, trained with caffe.get_solver.
LMDB_NET = """
name: "lmdb"
layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "%(db)s" backend: LMDB batch_size: 16 }
  transform_param { scale: 0.00390625 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

LMDB_SOLVER = """
net: "%(net)s"
base_lr: 0.5
momentum: 0.9
lr_policy: "fixed"
max_iter: 100
display: 0
random_seed: 1
solver_mode: CPU
"""

LMDB_SCRIPT = """
import sys
import caffe
import lmdb
import numpy as np
from caffe.proto import caffe_pb2

db_path, solver_path = sys.argv[1:3]
rng = np.random.default_rng(0)
images = []
env = lmdb.open(db_path, map_size=1 << 24)
with env.begin(write=True) as txn:
    for i in range(64):
        label = i % 2
        image = (rng.integers(0, 100, (1, 4, 4)) + 150 * label).astype(np.uint8)
        images.append(image)
        datum = caffe_pb2.Datum(channels=1, height=4, width=4, label=label,
                                data=image.tobytes())
        txn.put(b"%08d" % i, datum.SerializeToString())
env.close()

caffe.set_mode_cpu()
solver = caffe.get_solver(solver_path)
assert isinstance(solver, caffe.SGDSolver), type(solver)
solver.step(1)
net = solver.net
# The first batch is the first 16 records, in key order, scaled by 1/256.
np.testing.assert_allclose(net.blobs["data"].data, np.stack(images[:16]) / 256.0, rtol=1e-6)
np.testing.assert_array_equal(net.blobs["label"].data, [i % 2 for i in range(16)])
first = float(net.blobs["loss"].data)
solver.step(39)
last = float(net.blobs["loss"].data)
assert solver.iter == 40, solver.iter
assert last < 0.5 * first, (first, last)
print("loss", first, "->", last)
"""

# Input of ten 3x8x8 images + InnerProduct + Softmax: what caffe.Classifier needs.
CLASSIFIER_NET = """
name: "classifier"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 10 dim: 3 dim: 8 dim: 8 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""

# pycaffe's own image path as a Caffe user runs it: caffe.io.load_image on a colour PNG and a gray JPEG, then
# caffe.Classifier; the build's io.py reads images with Pillow, so neither scikit-image nor scipy loads.
CLASSIFIER_SCRIPT = """
import sys
import caffe
import numpy as np
from PIL import Image

net_path, folder = sys.argv[1:3]
rng = np.random.default_rng(0)
Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(folder + "/color.png")
Image.fromarray(rng.integers(0, 256, (30, 20), dtype=np.uint8)).save(folder + "/gray.jpg")
color = caffe.io.load_image(folder + "/color.png")
gray = caffe.io.load_image(folder + "/gray.jpg")
assert color.dtype == np.float32 and color.shape == (40, 50, 3), (color.dtype, color.shape)
np.testing.assert_allclose(color, np.asarray(Image.open(folder + "/color.png")) / 255.0, atol=1e-7)
assert gray.shape == (30, 20, 3) and (gray[:, :, 0] == gray[:, :, 2]).all(), gray.shape
assert caffe.io.load_image(folder + "/color.png", color=False).shape == (40, 50, 1)
assert caffe.io.resize_image(color, (16, 16)).shape == (16, 16, 3)

caffe.set_mode_cpu()
caffe.Net(net_path, caffe.TEST).save(folder + "/weights.caffemodel")
classifier = caffe.Classifier(net_path, folder + "/weights.caffemodel", image_dims=(12, 12), raw_scale=255,
                              channel_swap=(2, 1, 0), mean=np.array([100.0, 110.0, 120.0]))
for oversample in (True, False):
    predictions = classifier.predict([color, gray], oversample=oversample)
    assert predictions.shape == (2, 4), predictions.shape
    np.testing.assert_allclose(predictions.sum(axis=1), 1, rtol=1e-5)
loaded = sorted(name for name in ("skimage", "scipy") if name in sys.modules)
assert not loaded, loaded
print("predictions", predictions.tolist())
"""


def run_python(code, *args, cwd):
    """Runs code in a fresh interpreter of this venv; fails with its output if it dies."""
    env = dict(os.environ, GLOG_minloglevel="2", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        how = ("killed by %s" % signal.Signals(-proc.returncode).name
               if proc.returncode < 0 else "exit status %d" % proc.returncode)
        pytest.fail("subprocess %s\nstdout:\n%s\nstderr:\n%s"
                    % (how, proc.stdout[-3000:], proc.stderr[-3000:]))
    return proc.stdout


@pytest.fixture(scope="module")
def caffe_importable(tmp_path_factory):
    """Fails (never skips) when pycaffe is missing: `make test` builds it first."""
    proc = subprocess.run(
        [sys.executable, "-c", "import caffe; print(caffe.__file__)"],
        cwd=tmp_path_factory.mktemp("import"), capture_output=True, text=True,
        env=dict(os.environ, GLOG_minloglevel="2"), timeout=120)
    if proc.returncode != 0:
        pytest.fail("import caffe fails in %s; build it with `make caffe` "
                    "(tools/build-caffe.sh %s):\n%s"
                    % (sys.executable, sys.prefix, proc.stderr[-2000:]))
    return proc.stdout.strip()


@pytest.mark.parametrize("order", ["tensorflow-first", "caffe-first"])
def test_net_forward_backward_with_tensorflow_imported(caffe_importable, tmp_path, order):
    net = tmp_path / "tiny.prototxt"
    net.write_text(TINY_NET)
    out = run_python(IMPORT_ORDER_SCRIPT, order, net, cwd=tmp_path)
    assert out.startswith("loss ")


def test_inner_product_matches_numpy(caffe_importable, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    w = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    g = rng.standard_normal((4, 3)).astype(np.float32)
    net = tmp_path / "ip.prototxt"
    net.write_text(INNER_PRODUCT_NET)
    np.savez(tmp_path / "inputs.npz", x=x, w=w, b=b, g=g)
    run_python(INNER_PRODUCT_SCRIPT, net, tmp_path / "inputs.npz", tmp_path / "out.npz",
               cwd=tmp_path)
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(out["y"], x @ w.T + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["dw"], g.T @ x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["db"], g.sum(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["dx"], g @ w, rtol=1e-5, atol=1e-5)


def test_solver_trains_from_lmdb(caffe_importable, tmp_path):
    db = tmp_path / "train_lmdb"
    net = tmp_path / "net.prototxt"
    solver = tmp_path / "solver.prototxt"
    net.write_text(LMDB_NET % {"db": db})
    solver.write_text(LMDB_SOLVER % {"net": net})
    out = run_python(LMDB_SCRIPT, db, solver, cwd=tmp_path)
    assert out.startswith("loss ")


def test_load_image_and_classifier(caffe_importable, tmp_path):
    net = tmp_path / "classifier.prototxt"
    net.write_text(CLASSIFIER_NET)
    out = run_python(CLASSIFIER_SCRIPT, net, tmp_path, cwd=tmp_path)
    assert out.startswith("predictions ")
