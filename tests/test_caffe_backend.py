"""The Caffe backend against the contract: layout, flat vector, Caffe's solver arithmetic, state, data feeding."""

import ctypes
import os
import tempfile

import numpy as np
import pytest

from deepspark import fillers, schedule
from deepspark.backends import create_model
from deepspark.backends.caffe import runtime
from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.data import DataFeeder, source_shape
from deepspark.data.convert import convert_mnist
from deepspark.graph import Graph
from deepspark.proto import deepspark_pb2 as pb

pytestmark = pytest.mark.caffe

# Two convolutions sharing nothing, a shared InnerProduct weight, lr/decay mults, a loss.
NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 2 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" }
    bias_filler { type: "uniform" min: -0.1 max: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool" top: "ip1"
  param { name: "shared" lr_mult: 1 } param { lr_mult: 0 }
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "pool" top: "ip2"
  param { name: "shared" } param { lr_mult: 1 }
  inner_product_param { num_output: 5 bias_filler { type: "constant" value: 0.2 } } }
layer { name: "sum" type: "Eltwise" bottom: "ip1" bottom: "ip2" top: "sum" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "sum" bottom: "label" top: "loss" }
"""

SOLVER_KINDS = {
    "SGD": dict(momentum=0.9),
    "Nesterov": dict(momentum=0.9),
    "AdaGrad": dict(delta=1e-6),
    "RMSProp": dict(rms_decay=0.9, delta=1e-6),
    "AdaDelta": dict(momentum=0.95, delta=1e-6),
    "Adam": dict(momentum=0.9, momentum2=0.999, delta=1e-8),
}


def net():
    return parse_net(NET)[0]


def solver(kind="SGD", **kw):
    fields = dict(base_lr=0.05, lr_policy="step", gamma=0.5, stepsize=2, weight_decay=0.01, random_seed=3)
    fields.update(SOLVER_KINDS[kind])
    fields.update(kw)
    if kind in ("AdaGrad", "AdaDelta") and "momentum" not in SOLVER_KINDS[kind]:
        fields.pop("momentum", None)
    return pb.SolverParameter(type=kind, **fields)


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"data": rng.standard_normal((4, 2, 6, 6)).astype(np.float32),
             "label": rng.integers(0, 5, 4).astype(np.float32)} for _ in range(n)]


def reference_steps(param, graph, weights, steps):
    """Caffe's solver in NumPy (schedule.apply_update) over the Caffe backend's own gradients."""
    grads_model = create_model("caffe", graph.net_param, param)
    weights = [w.copy() for w in weights]
    history = [np.zeros_like(w) for w in weights] * schedule.history_sets(param)
    current_step, losses = 0, []
    for iteration, step in enumerate(steps):
        step = step if isinstance(step, list) else [step]
        grads_model.set_params(weights)
        total, loss = None, 0.0
        for batch in step:
            value, grads = grads_model.gradients(batch)
            loss += value / len(step)
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        rate, current_step = schedule.learning_rate(param, iteration, current_step)
        weights, history = schedule.apply_update(param, weights, total, history, rate, iteration,
                                                 [p.lr_mult for p in graph.params],
                                                 [p.decay_mult for p in graph.params])
        losses.append(loss)
    return weights, history, losses


def close(a, b, rtol=2e-5, atol=1e-6):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_params_in_caffe_order_from_our_fillers():
    model = create_model("caffe", net(), solver(), seed=7)
    graph = Graph(net(), pb.TRAIN)
    assert model.param_shapes == [(3, 2, 3, 3), (3,), (5, 12), (5,), (5,)]
    close(model.get_params(), fillers.init_params(graph, 7), rtol=0, atol=0)
    assert model.get_blobs("ip2")[0] is not None
    np.testing.assert_array_equal(model.get_blobs("ip2")[0], model.get_blobs("ip1")[0])  # shared by name


def test_flat_vector_round_trip_and_shared_blob():
    model = create_model("caffe", net(), solver(), seed=1)
    flat = model.get_flat()
    assert flat.dtype == np.float32 and flat.shape == (model.param_count,)
    new = np.arange(model.param_count, dtype=np.float32) / model.param_count
    model.set_flat(new)
    np.testing.assert_array_equal(model.get_flat(), new)
    out = np.empty_like(new)
    assert model.get_flat(out) is out
    # Caffe's sharer sees the owner's memory.
    np.testing.assert_array_equal(model._net.params["ip2"][0].data, model.split_flat(new)[2])
    with pytest.raises(ValueError):
        model.set_flat(new[:-1])
    with pytest.raises(ValueError):
        model.set_params(model.get_params()[:-1])


@pytest.mark.parametrize("kind", sorted(SOLVER_KINDS))
def test_step_is_caffes_solver_arithmetic(kind):
    param = solver(kind)
    model = create_model("caffe", net(), param, seed=2)
    graph = Graph(net(), pb.TRAIN)
    start = model.get_params()
    steps = batches(4)
    losses = [model.step(b) for b in steps]
    weights, history, expected = reference_steps(param, graph, start, steps)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    close(model.get_params(), weights, rtol=1e-4, atol=1e-6)
    close(model.get_history(), history, rtol=1e-4, atol=1e-6)
    assert model.iter == 4


def test_iter_size_and_clipping_run_each_pass_on_its_own_batch():
    param = solver("SGD", iter_size=3, clip_gradients=0.05)
    model = create_model("caffe", net(), param, seed=4)
    graph = Graph(net(), pb.TRAIN)
    start = model.get_params()
    steps = [batches(3, seed=s) for s in range(3)]
    losses = [model.step(b) for b in steps]
    weights, _, expected = reference_steps(param, graph, start, steps)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    close(model.get_params(), weights, rtol=1e-4, atol=1e-6)
    # The same batch thrice is not the same as three batches.
    same = create_model("caffe", net(), param, seed=4)
    same.step([steps[0][0]] * 3)
    assert not np.allclose(same.get_flat(), create_model("caffe", net(), param, seed=4).get_flat())
    with pytest.raises(ValueError, match="iter_size"):
        model.step(steps[0][0])


def test_solver_state_round_trip_resumes_identically():
    param = solver("Adam", lr_policy="multistep", stepvalue=[1, 3])
    a = create_model("caffe", net(), param, seed=5)
    steps = batches(6, seed=9)
    for b in steps[:3]:
        a.step(b)
    state, weights = a.get_state(), a.get_params()
    assert (state.iter, state.current_step) == (3, 1) and len(state.history) == 2 * len(weights)
    caffes = a._snapshot()  # Caffe's own counters agree with ours
    assert (caffes.iter, caffes.current_step) == (3, 1)
    rest = [a.step(b) for b in steps[3:]]

    b_model = create_model("caffe", net(), param, seed=99)
    b_model.set_params(weights)
    b_model.set_state(state)
    assert (b_model.iter, b_model.current_step) == (3, 1)
    np.testing.assert_allclose([b_model.step(b) for b in steps[3:]], rest, rtol=1e-6)
    close(b_model.get_params(), a.get_params(), rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="history"):
        b_model.set_state(pb.SolverState(iter=1))


def test_setting_iter_moves_caffes_learning_rate():
    """A worker that resumes at iteration N sets model.iter; Caffe's solver must follow."""
    param = solver("SGD", lr_policy="step", gamma=0.1, stepsize=10, momentum=0.0, weight_decay=0.0)
    a = create_model("caffe", net(), param, seed=6)
    b = create_model("caffe", net(), param, seed=6)
    b.iter = 10
    batch = batches(1)[0]
    start = a.get_flat()
    a.step(batch)
    b.step(batch)
    assert b.iter == 11 and a.iter == 1
    np.testing.assert_allclose((b.get_flat() - start), 0.1 * (a.get_flat() - start), rtol=1e-3, atol=1e-9)


def test_test_phase_forward_and_errors():
    model = create_model("caffe", net(), None, phase=pb.TEST, seed=1)
    batch = batches(1)[0]
    out = model.forward(batch)
    assert set(out) == {"loss"} and out["loss"].shape == ()
    with pytest.raises(RuntimeError, match="TEST"):
        model.step(batch)
    with pytest.raises(KeyError, match="label"):
        model.forward({"data": batch["data"]})
    with pytest.raises(ValueError, match="shape"):
        model.forward({"data": batch["data"][:2], "label": batch["label"]})


def test_no_net_leaves_a_scratch_folder_and_a_solver_state_still_goes_through_caffe(tmp_path, monkeypatch):
    # A Spark Python worker leaves by os._exit, a killed one by SIGKILL: what a net left in the temp dir stayed
    # there, one folder a net (#35: 31 after one suite). The folder is there only while Caffe reads or writes in it.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scoring = create_model("caffe", net(), None, phase=pb.TEST, seed=1)
    assert os.listdir(tmp_path) == []
    assert scoring.forward(batches(1)[0])["loss"].shape == ()
    training = create_model("caffe", net(), solver(), seed=1)
    assert os.listdir(tmp_path) == []
    training.step(batches(1)[0])
    history = training.get_history()  # Caffe's own snapshot, through the folder made again for it
    assert training.get_state().iter == 1 and any(np.abs(h).sum() > 0 for h in history)
    training.set_history([h * 2 for h in history])  # Caffe's own restore, likewise
    assert all(np.array_equal(a, b * 2) for a, b in zip(training.get_history(), history))
    assert os.listdir(tmp_path) == []


def test_bad_net_is_our_error_not_a_caffe_abort():
    bad = parse_net(NET.replace('bottom: "pool" top: "ip2"', 'bottom: "nowhere" top: "ip2"'))[0]
    with pytest.raises(ConfigError, match="nowhere"):
        create_model("caffe", bad, solver())


@pytest.fixture(scope="module")
def mnist_lmdb(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mnist")
    images, labels = mnist_files(folder, 64)
    out = str(folder / "lmdb")
    convert_mnist(images, labels, out)
    return out


def mnist_files(folder, count, seed=0):
    """Gzipped IDX images and labels of `count` random 28x28 digits."""
    import gzip
    import struct

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, count, dtype=np.uint8)
    images_path, labels_path = folder / "images.gz", folder / "labels.gz"
    with gzip.open(images_path, "wb") as stream:
        stream.write(struct.pack(">IIII", 2051, count, 28, 28) + pixels.tobytes())
    with gzip.open(labels_path, "wb") as stream:
        stream.write(struct.pack(">II", 2049, count) + labels.tobytes())
    return str(images_path), str(labels_path)


LMDB_NET = """
name: "reader"
layer { name: "mnist" type: "Data" top: "data" top: "label"
  transform_param { scale: 0.00390625 }
  data_param { source: "%s" batch_size: 16 backend: LMDB } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_caffe_data_layer_option_reads_the_same_batches(mnist_lmdb):
    """data_layers='caffe' keeps Caffe's Data layer; it trains exactly as fed from our pipeline."""
    net_param = parse_net(LMDB_NET % mnist_lmdb)[0]
    param = pb.SolverParameter(base_lr=0.1, momentum=0.9, lr_policy="fixed", random_seed=1)
    fed = create_model("caffe", net_param, param, data_shape=source_shape, seed=1)
    own = create_model("caffe", net_param, param, data_shape=source_shape, seed=1, data_layers="caffe")
    assert "data" in fed.feeds and "data" not in own.feeds
    feeder = DataFeeder(net_param.layer[0], pb.TRAIN)
    for _ in range(6):  # 96 records: past the end of the 64, wrapping like Caffe
        a, b = fed.step(feeder.next_batch()), own.step(None)
        assert a == pytest.approx(b, rel=1e-6)
    np.testing.assert_allclose(fed.get_flat(), own.get_flat(), rtol=1e-6, atol=1e-8)


def test_threads_parameter_sets_caffes_openblas():
    def caffes_openblas_threads():
        libraries = [ctypes.CDLL(path) for path in runtime._loaded_openblas()]
        return [lib.openblas_get_num_threads() for lib in libraries if hasattr(lib, "openblas_get_num_threads")]

    runtime.caffe()
    (before,) = set(caffes_openblas_threads())
    try:
        for count in (1, 2):
            assert create_model("caffe", net(), solver(), threads=count).threads == count
            assert set(caffes_openblas_threads()) == {count}
        create_model("caffe", net(), solver())  # None: the count stays as it is
        assert set(caffes_openblas_threads()) == {2}
    finally:
        runtime.set_threads(before)  # the other tests in this process run as they did
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(ValueError, match="threads"):
            create_model("caffe", net(), solver(), threads=bad)
    assert os.environ.get("GLOG_minloglevel") is not None


def test_time_verb_on_the_caffe_backend():
    from tests.conftest import run_cli

    status, _, err = run_cli("time", "--model", "models/lenet/train_val.prototxt", "--backend", "caffe",
                             "--iterations", "2", env={"GLOG_minloglevel": "2"})
    assert status == 0, err
    assert "conv1\tforward:" in err and "Average Forward-Backward" in err
