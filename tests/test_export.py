"""`deepspark export`: every zoo deploy net and its weights as a SavedModel that a process without DeepSpark loads,
giving real pycaffe's outputs within 1e-4; bad input is one line and leaves nothing."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_cli
from deepspark import checkpoint, compare, config
from deepspark.graph import with_batch_size
from deepspark.proto import deepspark_pb2 as pb

ZOO = sorted(name for name in os.listdir(os.path.join(ROOT, "models"))
             if os.path.exists(os.path.join(ROOT, "models", name, "deploy.prototxt")))
BATCH = 2
TOLERANCE = 1e-4  # relative to the output's largest magnitude, as `compare` measures it

# Loads each SavedModel given as FOLDER INPUTS.npz OUT.npz triples with TensorFlow alone, runs its serving
# signature on the inputs and saves the outputs; says which modules of DeepSpark it loaded (none).
SERVE = """
import sys
import numpy as np
import tensorflow as tf
for folder, inputs, out in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    serve = tf.saved_model.load(folder).signatures["serving_default"]
    feed = {name: tf.constant(value) for name, value in np.load(inputs).items()}
    np.savez(out, **{name: value.numpy() for name, value in serve(**feed).items()})
print(sorted(name for name in sys.modules if name.split(".")[0] == "deepspark"))
"""

# pycaffe's forward of each deploy net given as DEPLOY WEIGHTS INPUTS.npz OUT.npz, at the inputs' batch size.
PYCAFFE = """
import sys
import numpy as np
import caffe
caffe.set_mode_cpu()
for deploy, weights, inputs, out in zip(*(sys.argv[1 + i::4] for i in range(4))):
    net = caffe.Net(deploy, weights, caffe.TEST)
    feed = dict(np.load(inputs))
    for name, value in feed.items():
        net.blobs[name].reshape(*value.shape)
    net.reshape()
    outputs = net.forward(**feed)
    np.savez(out, **{name: np.array(value) for name, value in outputs.items()})
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{zoo net: (the SavedModel's outputs, pycaffe's outputs)} on the same weights and inputs, batch 2."""
    folder = tmp_path_factory.mktemp("export")
    serve_args, caffe_args = [], []
    rng = np.random.default_rng(7)
    for name in ZOO:
        deploy = os.path.join(ROOT, "models", name, "deploy.prototxt")
        net, _ = config.load_net(deploy)
        model = compare.build(["tensorflow"], with_batch_size(net, BATCH), phase=pb.TEST)["tensorflow"]
        weights = str(folder / f"{name}.caffemodel")
        checkpoint.save_caffemodel(weights, model.graph, model.get_params())
        inputs = str(folder / f"{name}_inputs.npz")
        np.savez(inputs, **{top: rng.uniform(-1, 1, shape).astype(np.float32) for top, shape in model.feeds.items()})
        model.close()
        saved = folder / f"{name}_savedmodel"
        status, out, err = run_cli("export", "--model", deploy, "--weights", weights, "--output", str(saved))
        assert status == 0, err[-3000:]
        assert out.startswith(f"Wrote the SavedModel {saved}: signature 'serving_default' takes ") and " float32)" in out
        serve_args += [str(saved), inputs, str(folder / f"{name}_served.npz")]
        caffe_args += [deploy, weights, inputs, str(folder / f"{name}_pycaffe.npz")]
    done = subprocess.run([sys.executable, "-c", SERVE, *serve_args], cwd=str(folder), capture_output=True, text=True,
                          timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"')) == []  # no DeepSpark in that process
    done = subprocess.run([sys.executable, "-c", PYCAFFE, *caffe_args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: (dict(np.load(folder / f"{name}_served.npz")), dict(np.load(folder / f"{name}_pycaffe.npz")))
            for name in ZOO}


@pytest.mark.caffe
@pytest.mark.slow  # its fixture exports and runs every zoo net
@pytest.mark.parametrize("name", ZOO)
def test_the_saved_model_gives_pycaffes_outputs_without_deepspark(exported, name):
    served, caffe_outputs = exported[name]
    assert set(served) == set(caffe_outputs) and served, (sorted(served), sorted(caffe_outputs))
    for blob, expected in caffe_outputs.items():
        assert served[blob].shape == expected.shape and expected.shape[0] == BATCH, (blob, served[blob].shape)
        assert np.ptp(expected) > 0, f"{name}: {blob} is constant: a vacuous comparison"
        _, relative = compare.difference(served[blob], expected)
        assert relative <= TOLERANCE, (name, blob, relative)


def test_export_refuses_bad_input_in_one_line_and_leaves_nothing(tmp_path):
    deploy = os.path.join(ROOT, "models", "lenet", "deploy.prototxt")
    net, _ = config.load_net(os.path.join(ROOT, "models", "cifar10_quick", "deploy.prototxt"))
    other = compare.build(["tensorflow"], net, phase=pb.TEST)["tensorflow"]
    wrong = str(tmp_path / "cifar.caffemodel")
    checkpoint.save_caffemodel(wrong, other.graph, other.get_params())
    other.close()
    out = tmp_path / "saved"
    cases = [
        (["--model", deploy, "--weights", wrong], "conv1"),  # weights of another net: the blob that does not fit
        (["--model", os.path.join(ROOT, "models", "lenet", "train_val.prototxt"), "--weights", wrong],
         "export takes a deploy net"),
        (["--model", deploy, "--weights", str(tmp_path / "missing.caffemodel")], "missing.caffemodel"),
    ]
    for args, said in cases:
        status, _, err = run_cli("export", *args, "--output", str(out))
        lines = err.strip().splitlines()
        assert status == 1 and lines[-1].startswith("deepspark export: error: ") and said in lines[-1], err[-2000:]
        assert not os.path.exists(out) and os.listdir(tmp_path) == ["cifar.caffemodel"]
    out.mkdir()
    status, _, err = run_cli("export", "--model", deploy, "--weights", wrong, "--output", str(out))
    assert status == 1 and "already exists" in err.strip().splitlines()[-1]
