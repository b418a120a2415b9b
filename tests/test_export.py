"""`deepspark export`: every zoo deploy net and its weights as a SavedModel that a process without DeepSpark loads,
giving real pycaffe's outputs within 1e-4; bad input is one line and leaves nothing."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_cli
from deepspark import checkpoint, compare, config, export
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
    nested = tmp_path / "serving" / "lenet" / "1"  # the folders export makes for it go again when it fails
    status, _, err = run_cli("export", "--model", deploy, "--weights", wrong, "--output", str(nested))
    assert status == 1 and "conv1" in err.strip().splitlines()[-1] and os.listdir(tmp_path) == ["cifar.caffemodel"]
    out.mkdir()
    status, _, err = run_cli("export", "--model", deploy, "--weights", wrong, "--output", str(out))
    assert status == 1 and "already exists" in err.strip().splitlines()[-1]


# Runs SavedModels with plain TensorFlow where DeepSpark cannot be imported (-I drops PYTHONPATH and the current
# folder; an editable install's finder and any sys.path entry holding a deepspark package go too): FOLDER
# INPUTS.npz OUT triples, OUT.npz getting the outputs, or OUT.txt the one line of the error that refused the inputs.
SERVE_ALONE = """
import os
import sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path = [p for p in sys.path if not os.path.isdir(os.path.join(p, "deepspark"))]
try:
    import deepspark
except ImportError:
    pass
else:
    raise SystemExit("deepspark is importable here: " + deepspark.__file__)
import numpy as np
import tensorflow as tf
for folder, inputs, out in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    serve = tf.saved_model.load(folder).signatures["serving_default"]
    try:
        outputs = serve(**{name: tf.constant(value) for name, value in np.load(inputs).items()})
    except tf.errors.InvalidArgumentError as error:
        with open(out + ".txt", "w") as stream:
            stream.write("\\n".join(line for line in str(error).splitlines() if "assertion failed" in line))
        continue
    np.savez(out + ".npz", **{name: value.numpy() for name, value in outputs.items()})
"""


def serve_alone(runs, cwd):
    """SERVE_ALONE over (folder, {input: array}, out) runs; [outputs dict, or the error line] per run."""
    args = []
    for i, (folder, inputs, out) in enumerate(runs):
        np.savez(f"{out}_in.npz", **inputs)
        args += [str(folder), f"{out}_in.npz", str(out)]
    done = subprocess.run([sys.executable, "-I", "-c", SERVE_ALONE, *args], cwd=str(cwd), capture_output=True,
                          text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [dict(np.load(f"{out}.npz")) if os.path.exists(f"{out}.npz") else open(f"{out}.txt").read()
            for _, _, out in runs]


def test_a_saved_model_of_fixed_size_refuses_another_in_one_line(tmp_path):
    """LeNet's InnerProduct fixes its input at 1x28x28: another size, or other channels, is refused by one
    line naming the shape it takes and the layer that fixes it, never answered; its own size is served at
    any batch."""
    deploy = os.path.join(ROOT, "models", "lenet", "deploy.prototxt")
    net, _ = config.load_net(deploy)
    model = compare.build(["tensorflow"], net, phase=pb.TEST)["tensorflow"]
    weights = str(tmp_path / "lenet.caffemodel")
    checkpoint.save_caffemodel(weights, model.graph, model.get_params())
    model.close()
    saved = tmp_path / "lenet"
    inputs, outputs = export.export(deploy, weights, str(saved))
    assert inputs == {"data": (None, 1, 28, 28)} and outputs == ["prob"]
    rng = np.random.default_rng(0)
    runs = [(saved, {"data": rng.uniform(0, 1, shape).astype(np.float32)}, tmp_path / f"run{i}")
            for i, shape in enumerate([(1, 1, 32, 32), (2, 3, 28, 28), (3, 1, 28, 28)])]
    wider, channels, right = serve_alone(runs, tmp_path)
    for refused, given in ((wider, "1 1 32 32"), (channels, "2 3 28 28")):
        assert isinstance(refused, str) and "\n" not in refused, refused
        assert ("input data must be N x 1 x 28 x 28 (layer ip1, InnerProduct, fixes its size); it is] "
                f"[{given}]") in refused, refused
    assert right["prob"].shape == (3, 10)


FULLY_CONVOLUTIONAL = {  # net under tests/data: (its input sizes, prob's height x width at each)
    # the sizes of the issue that brought any size: P-Net's 63x47 and 2x2
    "zoo/mtcnn_det1": ([(1, 3, 12, 12), (2, 3, 135, 104), (1, 3, 14, 13)], [(1, 1), (63, 47), (2, 2)]),
    "zoo/squeezenet_v1.0_deploy": ([(1, 3, 227, 227), (2, 3, 224, 224), (1, 3, 195, 163)], [(1, 1)] * 3),
    # FCN-8s's Deconvolution and Crop, ResNet's BatchNorm + Scale: the output is the input's size
    "fcn_skips": ([(1, 3, 32, 32), (2, 3, 27, 19), (3, 3, 8, 13)], [(32, 32), (27, 19), (8, 13)]),
}


@pytest.mark.caffe
@pytest.mark.parametrize("name", sorted(FULLY_CONVOLUTIONAL))
def test_a_fully_convolutional_saved_model_gives_caffes_outputs_at_every_size(name, tmp_path):
    """MTCNN's P-Net, SqueezeNet (global pooling: no layer fixes its size) and an FCN-8s-shaped segmentation net
    (upsampled by Deconvolution, cut by Crop), each exported once to TF Serving's serving/name/version (its
    folders made), serve pycaffe's outputs at three sizes and batches: P-Net's 63x47 and 2x2 where a SavedModel
    traced at one size gave 62x47 and 1x1, SqueezeNet's answer at 224 where it gave another class, the FCN's
    map at each input's size where its Deconvolution and Crop had fixed the size."""
    from test_net import pycaffe_forward, random_weights  # deferred: it imports pycaffe

    prototxt = os.path.join(ROOT, "tests", "data", name + ".prototxt")
    short = os.path.basename(name)
    weights = random_weights(prototxt, str(tmp_path / f"{short}.caffemodel"), seed=11)
    saved = tmp_path / "serving" / short / "1"
    status, out, err = run_cli("export", "--model", prototxt, "--weights", weights, "--output", str(saved))
    assert status == 0, err[-3000:]
    assert "takes data (Nx3xanyxany float32)" in out, out
    rng = np.random.default_rng(1)
    shapes, sizes = FULLY_CONVOLUTIONAL[name]
    feeds = [rng.normal(0, 1, shape).astype(np.float32) for shape in shapes]
    served = serve_alone([(saved, {"data": data}, tmp_path / f"size{i}") for i, data in enumerate(feeds)], tmp_path)
    for data, outputs in zip(feeds, served):
        expected, _, _ = pycaffe_forward(prototxt, weights, data)
        assert sorted(outputs) == sorted(expected)
        for blob, value in expected.items():
            assert outputs[blob].shape == value.shape, (blob, outputs[blob].shape, value.shape)
            assert np.ptp(value) > 0, f"{name}: {blob} is constant: a vacuous comparison"
            _, relative = compare.difference(outputs[blob], value)
            assert relative <= TOLERANCE, (blob, data.shape, relative)
    prob = "prob1" if "prob1" in served[0] else "prob"
    assert [outputs[prob].shape[2:] for outputs in served] == sizes
