"""The TensorFlow backend's solver step against hand-computed gradients and schedule.py's NumPy reference.

The net is Input -> InnerProduct -> EuclideanLoss, whose gradient is known in
closed form: with r = W x + b - y, loss = sum(r^2) / 2N, dW = r^T x / N, db = sum(r) / N.
"""

import numpy as np
import pytest
from google.protobuf import text_format

pytest.importorskip("tensorflow")

from deepspark import schedule  # noqa: E402
from deepspark.backends import create_model  # noqa: E402
from deepspark.config import parse_net  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

N, K, M = 4, 3, 2

NET = f"""
layer {{ name: "data" type: "Input" top: "x" top: "y"
  input_param {{ shape {{ dim: {N} dim: {K} }} shape {{ dim: {N} dim: {M} }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "p" PARAMS
  inner_product_param {{ num_output: {M} weight_filler {{ type: "gaussian" std: 0.5 }}
                        bias_filler {{ type: "uniform" min: -0.5 max: 0.5 }} }} }}
layer {{ name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }}
"""


def make(solver_text, params=""):
    net, source = parse_net(NET.replace("PARAMS", params))
    solver = text_format.Parse(solver_text, pb.SolverParameter())
    return create_model("tensorflow", net, solver, source=source, seed=5), solver


def batch(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((N, K)).astype(np.float32),
            "y": rng.standard_normal((N, M)).astype(np.float32)}


def by_hand(weights, data):
    w, b = (p.astype(np.float64) for p in weights)
    r = data["x"] @ w.T + b - data["y"]
    return (r ** 2).sum() / (2 * N), [r.T @ data["x"] / N, r.sum(axis=0) / N]


def reference_run(solver, params, batches_per_step, lr_mults=(1, 1), decay_mults=(1, 1)):
    """Losses and final weights of Caffe's solver, in NumPy (float64 gradients, float32 state)."""
    weights = [p.copy() for p in params]
    history = [np.zeros_like(p) for p in weights] * schedule.history_sets(solver)
    losses, step = [], 0
    for iteration, batches in enumerate(batches_per_step):
        results = [by_hand(weights, b) for b in batches]
        losses.append(np.mean([loss for loss, _ in results]))
        grads = [sum(g[i] for _, g in results).astype(np.float32) for i in range(2)]
        rate, step = schedule.learning_rate(solver, iteration, step)
        weights, history = schedule.apply_update(solver, weights, grads, history, rate, iteration,
                                                 list(lr_mults), list(decay_mults))
        weights = [np.asarray(w, np.float32) for w in weights]
    return losses, weights, history


SOLVERS = {
    "SGD": 'type: "SGD" base_lr: 0.1 momentum: 0.9 weight_decay: 0.01 lr_policy: "inv" gamma: 0.1 power: 0.75',
    "Nesterov": 'type: "Nesterov" base_lr: 0.1 momentum: 0.9 weight_decay: 0.01 lr_policy: "step" gamma: 0.5 stepsize: 2',
    "AdaGrad": 'type: "AdaGrad" base_lr: 0.1 weight_decay: 0.01',
    "RMSProp": 'type: "RMSProp" base_lr: 0.01 rms_decay: 0.9 weight_decay: 0.01',
    "AdaDelta": 'type: "AdaDelta" base_lr: 1.0 momentum: 0.95 delta: 1e-6 weight_decay: 0.01',
    "Adam": 'type: "Adam" base_lr: 0.01 momentum: 0.9 momentum2: 0.999 lr_policy: "exp" gamma: 0.9',
    "deprecated enum": 'solver_type: NESTEROV base_lr: 0.1 momentum: 0.5',
}


@pytest.mark.parametrize("name", SOLVERS)
def test_each_solver_matches_caffe_arithmetic(name):
    model, solver = make(SOLVERS[name])
    start = model.get_params()
    steps = [[batch(i)] for i in range(4)]
    losses = [model.step(b[0]) for b in steps]
    want_losses, want_weights, want_history = reference_run(solver, start, steps)
    assert losses == pytest.approx(want_losses, rel=1e-4)
    for got, want in zip(model.get_params(), want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    state = model.get_state()
    assert state.iter == 4 and len(state.history) == 2 * schedule.history_sets(solver)
    for blob, want in zip(state.history, want_history):
        np.testing.assert_allclose(np.array(blob.data).reshape(tuple(blob.shape.dim)), want,
                                   rtol=1e-4, atol=1e-6)


def test_first_sgd_step_by_hand():
    model, _ = make('base_lr: 0.5 lr_policy: "fixed"')
    w, b = model.get_params()
    data = batch(0)
    loss, (gw, gb) = by_hand([w, b], data)
    assert model.step(data) == pytest.approx(loss, rel=1e-5)
    w2, b2 = model.get_params()
    np.testing.assert_allclose(w2, w - 0.5 * gw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b2, b - 0.5 * gb, rtol=1e-5, atol=1e-6)


def test_gradients_are_caffes_diffs():
    model, _ = make("base_lr: 0.1")
    loss, grads = model.gradients(batch(1))
    want_loss, want = by_hand(model.get_params(), batch(1))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_iter_size_accumulates_and_divides():
    text = "base_lr: 0.1 momentum: 0.9 iter_size: 2 weight_decay: 0.001"
    model, solver = make(text)
    start = model.get_params()
    steps = [[batch(2 * i), batch(2 * i + 1)] for i in range(3)]
    losses = [model.step(b) for b in steps]
    want_losses, want_weights, _ = reference_run(solver, start, steps)
    assert losses == pytest.approx(want_losses, rel=1e-4)
    for got, want in zip(model.get_params(), want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="iter_size"):
        model.step(batch(0))


def test_clip_gradients():
    model, solver = make("base_lr: 0.1 momentum: 0.9 clip_gradients: 0.05")
    start = model.get_params()
    steps = [[batch(i)] for i in range(3)]
    for b in steps:
        model.step(b[0])
    _, want_weights, _ = reference_run(solver, start, steps)
    assert np.linalg.norm(by_hand(start, steps[0][0])[1][0]) > 0.05  # the clip is active
    for got, want in zip(model.get_params(), want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_lr_mult_decay_mult_and_l1():
    params = "param { lr_mult: 0 decay_mult: 1 } param { lr_mult: 3 decay_mult: 0 }"
    model, solver = make('base_lr: 0.05 momentum: 0.5 weight_decay: 0.1 regularization_type: "L1"', params)
    start = model.get_params()
    steps = [[batch(i)] for i in range(3)]
    for b in steps:
        model.step(b[0])
    _, want_weights, _ = reference_run(solver, start, steps, lr_mults=(0, 3), decay_mults=(1, 0))
    got = model.get_params()
    np.testing.assert_array_equal(got[0], start[0])  # lr_mult 0: frozen
    np.testing.assert_allclose(got[1], want_weights[1], rtol=1e-4, atol=1e-6)


def test_state_save_restore_continues_identically():
    text = SOLVERS["Adam"]
    a, _ = make(text)
    for i in range(3):
        a.step(batch(i))
    state, flat = a.get_state(), a.get_flat()
    b, _ = make(text)
    b.set_flat(flat)
    b.set_state(pb.SolverState.FromString(state.SerializeToString()))
    assert b.iter == 3 and b.learning_rate() == pytest.approx(a.learning_rate())
    for i in range(3, 5):
        assert b.step(batch(i)) == pytest.approx(a.step(batch(i)), rel=1e-6)
    np.testing.assert_array_equal(a.get_flat(), b.get_flat())
    c, _ = make(SOLVERS["SGD"])
    with pytest.raises(ValueError, match="history blobs"):
        c.set_state(state)  # Adam keeps two blobs per parameter, SGD one


def test_flat_vector_contract():
    model, _ = make("base_lr: 0.1")
    params = model.get_params()
    flat = model.get_flat()
    assert flat.dtype == np.float32 and flat.flags.c_contiguous and flat.shape == (model.param_count,)
    assert model.param_count == M * K + M and model.param_shapes == [(M, K), (M,)]
    np.testing.assert_array_equal(flat, np.concatenate([p.ravel() for p in params]))
    out = np.empty_like(flat)
    assert model.get_flat(out) is out
    model.set_flat(flat * 2)
    np.testing.assert_array_equal(model.get_params()[0], params[0] * 2)
    model.set_params(params)
    np.testing.assert_array_equal(model.get_flat(), flat)
    model.set_blobs("ip", [np.ones((M, K)), np.zeros(M)])
    assert np.all(model.get_blobs("ip")[0] == 1)
    with pytest.raises(ValueError, match="shape"):
        model.set_flat(flat[:-1])
    with pytest.raises(KeyError, match="'y'"):
        model.step({"x": batch(0)["x"]})


def test_same_seed_same_start_and_trajectory():
    a, _ = make(SOLVERS["SGD"])
    b, _ = make(SOLVERS["SGD"])
    np.testing.assert_array_equal(a.get_flat(), b.get_flat())
    assert a.step(batch(0)) == b.step(batch(0))


CONV_NET = """
layer { name: "data" type: "Input" top: "x" top: "y"
  input_param { shape { dim: 2 dim: 3 dim: 5 dim: 5 } shape { dim: 2 dim: 4 dim: 3 dim: 3 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "c" bottom: "y" top: "loss" }
"""


def test_conv_kernels_cross_the_contract_in_caffe_layout():
    # Kernels are stored HWIO inside; params, flat vector and history are OIHW outside.
    net, _ = parse_net(CONV_NET)
    model = create_model("tensorflow", net, text_format.Parse('type: "Adam" base_lr: 0.1 momentum: 0.9', pb.SolverParameter()))
    assert model.param_shapes == [(4, 3, 3, 3), (4,)]
    values = np.arange(model.param_count, dtype=np.float32)
    model.set_flat(values)
    np.testing.assert_array_equal(model.get_params()[0], values[:108].reshape(4, 3, 3, 3))
    np.testing.assert_array_equal(model.get_flat(), values)
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((2, 3, 5, 5)), "y": rng.standard_normal((2, 4, 3, 3))}
    model.set_params([rng.standard_normal((4, 3, 3, 3)) * 0.1, np.zeros(4)])
    loss, grads = model.gradients(data)
    w = model.get_params()[0].astype(np.float64)
    patches = np.stack([data["x"][:, :, i:i + 3, j:j + 3] for i in range(3) for j in range(3)], axis=-1)
    c = np.einsum("ncklp,ockl->nop", patches, w).reshape(2, 4, 3, 3)
    r = c - data["y"]
    assert loss == pytest.approx((r ** 2).sum() / 4, rel=1e-4)
    want = np.einsum("nop,ncklp->ockl", r.reshape(2, 4, 9), patches) / 2
    np.testing.assert_allclose(grads[0], want, rtol=1e-4, atol=1e-5)
    model.step(data)
    history = model.get_history()
    assert [h.shape for h in history] == [(4, 3, 3, 3), (4,)] * 2
    np.testing.assert_allclose(history[0], 0.1 * want, rtol=1e-4, atol=1e-6)  # Adam's m after one step
    state = model.get_state()
    other = create_model("tensorflow", net, text_format.Parse('type: "Adam" base_lr: 0.1 momentum: 0.9', pb.SolverParameter()))
    other.set_state(state)
    np.testing.assert_array_equal(other.get_history()[2], history[2])


def test_one_trace_for_all_iterations():
    # The rate and the iteration are tensor arguments: a changing schedule does not retrace the step.
    model, _ = make(SOLVERS["Adam"])
    for i in range(4):
        model.step(batch(i))
    assert model._step_fn.experimental_get_tracing_count() == 1
