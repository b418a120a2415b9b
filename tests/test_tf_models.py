"""Every net of the model zoo (models/*/) compiles on the TensorFlow backend and trains a step.

The Data layers get their image shape from the model's deploy.prototxt Input
and a batch of 2; labels are 0, valid for every classifier.
"""

import glob
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from deepspark.backends import create_model  # noqa: E402
from deepspark.config import load_net, load_solver, parse_net  # noqa: E402
from deepspark.errors import ConfigError  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(ROOT, "models", "*", "solver.prototxt")))
BATCH = 2


def image_shape(folder):
    """(C, H, W) of the deploy net's Input, which is the crop the train net's Data layers produce."""
    deploy, _ = load_net(os.path.join(folder, "deploy.prototxt"))
    for layer in deploy.layer:
        if layer.type == "Input":
            return tuple(layer.input_param.shape[0].dim[1:])
    return tuple(deploy.input_shape[0].dim[1:]) if deploy.input_shape else tuple(deploy.input_dim[1:4])


def random_batch(model, seed=0):
    rng = np.random.default_rng(seed)
    return {top: (rng.standard_normal(shape).astype(np.float32) if len(shape) > 1 else np.zeros(shape, np.float32))
            for top, shape in model.feeds.items()}


def test_the_zoo_is_there():
    assert MODELS, "models/*/solver.prototxt: no nets found"


@pytest.mark.parametrize("name", MODELS)
def test_model_trains_and_tests(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    folder = os.path.join(ROOT, "models", name)
    solver = load_solver(os.path.join(folder, "solver.prototxt"))
    shape = image_shape(folder)

    train = create_model("tensorflow", solver.train_net, solver.param, phase=pb.TRAIN, source=solver.train_map,
                         batch_size=BATCH, seed=1, data_shape=lambda layer: shape)
    assert train.param_count == sum(math.prod(s) for s in train.param_shapes) > 0
    before = train.get_flat()
    loss = train.step(random_batch(train))
    assert math.isfinite(loss) and loss > 0
    after = train.get_flat()
    assert np.all(np.isfinite(after)) and not np.array_equal(before, after)

    net, source, state = solver.test_nets[0] if solver.test_nets else (solver.train_net, solver.train_map,
                                                                        pb.NetState(phase=pb.TEST))
    test = create_model("tensorflow", net, phase=pb.TEST, source=source, batch_size=BATCH, seed=1,
                        stages=list(state.stage), data_shape=lambda layer: shape)
    assert test.param_shapes == train.param_shapes
    test.set_flat(after)
    outputs = test.forward(random_batch(test))
    assert outputs and all(np.all(np.isfinite(v)) for v in outputs.values())
    for top, value in outputs.items():
        if "accuracy" in top:
            assert 0 <= float(value) <= 1


def test_data_layers_need_a_data_shape(monkeypatch):
    monkeypatch.chdir(ROOT)
    solver = load_solver(os.path.join(ROOT, "models", MODELS[0], "solver.prototxt"))
    with pytest.raises(ConfigError, match="data shape is unknown"):
        create_model("tensorflow", solver.train_net, solver.param, source=solver.train_map)


def test_backends_are_imported_only_when_asked_for():
    code = ("import sys, deepspark.backends as b; assert 'tensorflow' not in sys.modules\n"
            "try:\n    b.create_model('theano', None)\nexcept ValueError as e:\n    print(e)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr
    assert "unknown backend 'theano'" in result.stdout



THREADS_SCRIPT = """
import sys, warnings
import tensorflow as tf
from deepspark.backends import create_model
from deepspark.config import parse_net

NET = parse_net('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } } '
                'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" inner_product_param { num_output: 2 } }')[0]
if sys.argv[1] == "started":
    tf.constant(1.0) + 1  # TensorFlow's runtime starts before any model asks for a count

for threads in map(eval, sys.argv[2:]):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        create_model("tensorflow", NET, threads=threads).forward({"x": [[1, 2, 3], [4, 5, 6]]})
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    threading = tf.config.threading
    print(threading.get_intra_op_parallelism_threads(), threading.get_inter_op_parallelism_threads(),
          "|".join(said) or "-", sep="\t")
"""


def thread_rows(when, *counts):
    """(intra, inter, warnings) after each model of a fresh process builds and runs with threads=count."""
    result = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, when, *map(str, counts)], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert result.returncode == 0, result.stderr
    return [tuple(line.split("\t")) for line in result.stdout.splitlines()]


def test_threads_are_set_on_first_use_and_a_later_count_warns():
    rows = thread_rows("fresh", 2, 2, 3, None)
    assert [row[:2] for row in rows] == [("2", "2")] * 4  # the first count stays
    assert [row[2] == "-" for row in rows] == [True, True, False, True]
    assert "runs with 2 threads" in rows[2][2] and "threads=3 is not applied" in rows[2][2]


def test_threads_after_tensorflow_started_warn_and_run():
    rows = thread_rows("started", None, 2)
    assert [row[:2] for row in rows] == [("0", "0")] * 2  # 0: TensorFlow's default
    assert rows[0][2] == "-"
    assert "its default thread counts" in rows[1][2] and "threads=2 is not applied" in rows[1][2]


def test_threads_must_be_a_positive_count():
    net = load_net(os.path.join(ROOT, "models", "lenet", "deploy.prototxt"))[0]
    for bad in (0, -2, "4", 2.0, True):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            create_model("tensorflow", net, phase=pb.TEST, threads=bad)


def test_an_input_net_takes_any_batch_and_size_and_keeps_each_compiled_pass():
    """MTCNN's P-Net (legacy input_dim 1x3x12x12): create_model's batch_size sets its batch; reshape gives
    Caffe's output sizes (63x47 at 135x104, 2x2 at 14x13: ceil-mode pooling) and a size seen before runs the
    pass compiled for it then, traced once."""
    net, source = load_net(os.path.join(ROOT, "tests", "data", "zoo", "mtcnn_det1.prototxt"))
    model = create_model("tensorflow", net, phase=pb.TEST, source=source, batch_size=3)
    assert model.feeds == {"data": (3, 3, 12, 12)}
    assert model.forward(random_batch(model))["prob1"].shape == (3, 2, 1, 1)
    first = model._forward_fn
    for shape, out in [((1, 3, 135, 104), (63, 47)), ((2, 3, 14, 13), (2, 2)), ((3, 3, 12, 12), (1, 1))]:
        model.reshape({"data": shape})
        assert model.feeds == {"data": shape} and model.graph.blobs["prob1"] == shape[:1] + (2,) + out
        outputs = model.forward(random_batch(model))
        assert outputs["prob1"].shape == shape[:1] + (2,) + out and outputs["conv4-2"].shape == shape[:1] + (4,) + out
    assert model._forward_fn is first and first.experimental_get_tracing_count() == 1


def test_reshape_refuses_a_size_that_changes_a_parameter():
    """LeNet's ip1 takes 50x4x4 values: at 32x32 it would need another weight blob; Caffe would abort."""
    net, source = load_net(os.path.join(ROOT, "models", "lenet", "deploy.prototxt"))
    model = create_model("tensorflow", net, phase=pb.TEST, source=source)
    refused = r"inputs 'data' 1x1x32x32: layer 'ip1' would need a 500x1250 parameter, its blob is 500x800"
    with pytest.raises(ValueError, match=refused):
        model.reshape({"data": (1, 1, 32, 32)})
    with pytest.raises(KeyError, match="'label' is not an input of this net"):
        model.reshape({"label": (1,)})
    model.reshape({"data": (5, 1, 28, 28)})  # another batch is any net's
    assert model.forward(random_batch(model))["prob"].shape == (5, 10)


POOLS = """
input: "data" input_shape { dim: 1 dim: 3 dim: 13 dim: 11 }
layer { name: "max" type: "Pooling" bottom: "data" top: "max" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "ave" type: "Pooling" bottom: "data" top: "ave" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "ceil" type: "Pooling" bottom: "data" top: "ceil" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "floor" type: "Pooling" bottom: "data" top: "floor"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 ceil_mode: false } }
"""


def test_a_net_served_at_any_size_pools_as_the_net_compiled_at_each_size():
    """The SavedModel's pooling of sizes only the data knows (MAX and AVE, padded, ceil and floor mode) gives
    what the net compiled at that size gives (that one is pycaffe's: test_net, test_tf_layers)."""
    import tensorflow as tf

    net, source = parse_net(POOLS)
    model = create_model("tensorflow", net, phase=pb.TEST, source=source)
    module = model.serving_module()
    assert module.input_shapes == {"data": (None, 3, None, None)}
    rng = np.random.default_rng(2)
    for shape in [(1, 3, 13, 11), (2, 3, 8, 9), (1, 3, 5, 4), (1, 3, 14, 13)]:
        data = rng.normal(0, 1, shape).astype(np.float32)
        model.reshape({"data": shape})
        expected = model.forward({"data": data})
        served = module.serve(tf.constant(data))
        for name, value in expected.items():
            assert served[name].shape == value.shape, (name, shape)
            np.testing.assert_allclose(served[name].numpy(), value, rtol=1e-6, atol=1e-6, err_msg=f"{name} {shape}")


SCALES = """
input: "data" input_shape { dim: 1 dim: 4 dim: 6 dim: 5 }
layer { name: "channels" type: "Scale" bottom: "data" top: "channels" scale_param { bias_term: true } }
layer { name: "shift" type: "Bias" bottom: "channels" top: "shift" }
layer { name: "bn" type: "BatchNormKyle" bottom: "shift" top: "bn" batch_norm_param { use_alpha_beta: true } }
layer { name: "map" type: "Scale" bottom: "data" top: "map" scale_param { axis: 2 num_axes: 2 } }
"""


def test_a_scale_over_the_channels_serves_any_size_and_one_over_the_map_fixes_it():
    """Scale and Bias serve any size where their blob covers the channels alone (ResNet's Scale after
    BatchNorm), as BatchNormKyle's alpha and beta do; a blob over height and width was made for one size, which Caffe would refuse to reshape."""
    from deepspark.backends.tensorflow.compiler import size_fixers

    net, source = parse_net(SCALES)
    model = create_model("tensorflow", net, phase=pb.TEST, source=source)
    assert [layer.name for layer in size_fixers(model.graph)] == ["map"]
    with pytest.raises(ValueError, match=r"layer 'map' \(Scale\) fixes the input size"):
        model.serving_module(any_size=True)
    assert model.serving_module().input_shapes == {"data": (None, 4, 6, 5)}
