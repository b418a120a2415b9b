"""Caffe's learning-rate policies and the NumPy solver arithmetic, against numbers worked by hand."""

import math

import numpy as np
import pytest
from google.protobuf import text_format

from deepspark import schedule
from deepspark.proto import deepspark_pb2 as pb


def solver(text):
    return text_format.Parse(text, pb.SolverParameter())


def rate(text, iteration, current_step=0):
    return schedule.learning_rate(solver(text), iteration, current_step)


def test_fixed():
    assert rate('base_lr: 0.01 lr_policy: "fixed"', 1234)[0] == pytest.approx(0.01)
    assert rate("base_lr: 0.5", 7)[0] == pytest.approx(0.5)  # no policy means fixed


def test_step():
    text = 'base_lr: 0.1 lr_policy: "step" gamma: 0.5 stepsize: 10'
    assert rate(text, 9) == (pytest.approx(0.1), 0)
    assert rate(text, 10) == (pytest.approx(0.05), 1)
    assert rate(text, 35) == (pytest.approx(0.0125), 3)


def test_exp():
    assert rate('base_lr: 1 lr_policy: "exp" gamma: 0.9', 3)[0] == pytest.approx(0.729)


def test_inv():
    # LeNet's schedule at iteration 100: 0.01 * (1 + 0.0001*100)^-0.75
    text = 'base_lr: 0.01 lr_policy: "inv" gamma: 0.0001 power: 0.75'
    assert rate(text, 0)[0] == pytest.approx(0.01)
    assert rate(text, 100)[0] == pytest.approx(0.01 * 1.01 ** -0.75, rel=1e-6)
    assert rate(text, 10000)[0] == pytest.approx(0.01 * 2 ** -0.75, rel=1e-6)


def test_multistep_advances_once_per_call_as_caffe():
    text = 'base_lr: 1 lr_policy: "multistep" gamma: 0.1 stepvalue: 2 stepvalue: 4'
    step, rates = 0, []
    for iteration in range(6):
        value, step = rate(text, iteration, step)
        rates.append(value)
    assert rates == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    # Resumed late with a stale counter, Caffe catches up one step per iteration.
    assert rate(text, 10, 0) == (pytest.approx(0.1), 1)


def test_poly():
    text = 'base_lr: 0.1 lr_policy: "poly" power: 2 max_iter: 100'
    assert rate(text, 50)[0] == pytest.approx(0.025)
    assert rate(text, 100)[0] == pytest.approx(0.0)


def test_sigmoid():
    text = 'base_lr: 2 lr_policy: "sigmoid" gamma: 0.5 stepsize: 10'
    assert rate(text, 10)[0] == pytest.approx(1.0)
    assert rate(text, 12)[0] == pytest.approx(2 / (1 + math.exp(-1)))
    assert rate('base_lr: 2 lr_policy: "sigmoid" gamma: -10 stepsize: 0', 1000)[0] == 0.0


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown lr_policy"):
        rate('base_lr: 1 lr_policy: "cosine"', 0)


# -- solver arithmetic, one scalar worked by hand per solver -------------------------

def update(text, w, g, history, rate_value=0.1, iteration=0, lr_mult=1.0, decay_mult=1.0):
    param = solver(text)
    n = len(w)
    weights, hist = schedule.apply_update(param, [np.float32(x) for x in w], [np.float32(x) for x in g],
                                          [np.float32(h) for h in history], rate_value, iteration,
                                          [lr_mult] * n, [decay_mult] * n)
    return [float(x) for x in weights], [float(h) for h in hist]


def test_sgd_momentum_and_l2():
    # v = 0.9*0.5 + 0.1*(2 + 0.01*1) = 0.651; w = 1 - 0.651
    w, h = update('type: "SGD" momentum: 0.9 weight_decay: 0.01', [1.0], [2.0], [0.5])
    assert h == pytest.approx([0.651]) and w == pytest.approx([0.349])


def test_l1_uses_the_sign():
    w, h = update('momentum: 0 weight_decay: 0.5 regularization_type: "L1"', [-3.0], [1.0], [0.0])
    assert h == pytest.approx([0.1 * (1 - 0.5)]) and w == pytest.approx([-3.05])


def test_lr_and_decay_mults():
    w, _ = update("weight_decay: 1", [1.0], [1.0], [0.0], lr_mult=2, decay_mult=0)
    assert w == pytest.approx([1 - 0.2])


def test_nesterov():
    # v = 0.9*1 + 0.1*2 = 1.1; step = 1.9*1.1 - 0.9*1 = 1.19
    w, h = update('type: "Nesterov" momentum: 0.9', [1.0], [2.0], [1.0])
    assert h == pytest.approx([1.1]) and w == pytest.approx([1 - 1.19])


def test_adagrad():
    w, h = update('type: "AdaGrad" delta: 0', [1.0], [2.0], [5.0])
    assert h == pytest.approx([9.0]) and w == pytest.approx([1 - 0.1 * 2 / 3])


def test_rmsprop():
    w, h = update('type: "RMSProp" rms_decay: 0.5 delta: 0', [1.0], [2.0], [2.0])
    assert h == pytest.approx([3.0]) and w == pytest.approx([1 - 0.1 * 2 / math.sqrt(3)], rel=1e-6)


def test_adadelta():
    # h = 0.5*4 + 0.5*2 = 3; u = 2*sqrt((1+1)/(3+1)); h2 = 0.5*u^2 + 0.5*1
    w, h = update('type: "AdaDelta" momentum: 0.5 delta: 1', [1.0], [2.0], [2.0, 1.0])
    u = 2 * math.sqrt(2 / 4)
    assert h == pytest.approx([3.0, 0.5 * u * u + 0.5]) and w == pytest.approx([1 - 0.1 * u], rel=1e-6)


def test_adam_bias_correction_uses_iter_plus_one():
    # iteration 1 -> t = 2
    w, h = update('type: "Adam" momentum: 0.9 momentum2: 0.999 delta: 0', [1.0], [2.0], [1.0, 1.0],
                  iteration=1)
    m, v = 0.9 + 0.1 * 2, 0.999 + 0.001 * 4
    correction = math.sqrt(1 - 0.999 ** 2) / (1 - 0.9 ** 2)
    assert h == pytest.approx([m, v]) and w == pytest.approx([1 - 0.1 * correction * m / math.sqrt(v)],
                                                             rel=1e-5)


def test_adam_history_is_all_m_then_all_v():
    param = solver('type: "Adam" momentum: 0.5 momentum2: 0.5')
    _, hist = schedule.apply_update(param, [np.float32(0), np.float32(0)], [np.float32(1), np.float32(2)],
                                    [np.float32(0)] * 4, 0.1, 0, [1, 1], [1, 1])
    assert [float(h) for h in hist] == pytest.approx([0.5, 1.0, 0.5, 2.0])


def test_iter_size_and_clipping_order():
    # Caffe clips the accumulated sum first, then divides by iter_size.
    param = solver("momentum: 0 iter_size: 2 clip_gradients: 5")
    weights, _ = schedule.apply_update(param, [np.zeros(2, np.float32)], [np.array([6.0, 8.0], np.float32)],
                                       [np.zeros(2, np.float32)], 1.0, 0, [1], [1])
    # norm 10 > 5: scale by 0.5 -> (3, 4); / iter_size -> (1.5, 2)
    assert weights[0] == pytest.approx([-1.5, -2.0])


def test_no_clipping_below_threshold():
    param = solver("clip_gradients: 100")
    weights, _ = schedule.apply_update(param, [np.zeros(2, np.float32)], [np.array([6.0, 8.0], np.float32)],
                                       [np.zeros(2, np.float32)], 1.0, 0, [1], [1])
    assert weights[0] == pytest.approx([-6.0, -8.0])


def scaled(text):
    return solver(f'base_lr: 0.1 lr_policy: "step" gamma: 0.5 stepsize: 10 deepspark_param {{ {text} }}')


def test_lr_scaling_multiplies_the_policys_rate_by_the_workers_or_their_square_root():
    assert schedule.learning_rate(scaled("workers: 4 lr_scaling: LINEAR"), 12) == (pytest.approx(0.2), 1)
    assert schedule.learning_rate(scaled("workers: 4 lr_scaling: SQRT"), 12)[0] == pytest.approx(0.1)
    assert schedule.learning_rate(scaled("workers: 4"), 12)[0] == pytest.approx(0.05)  # NONE, the default
    single = scaled("workers: 4 lr_scaling: LINEAR algorithm: SINGLE")  # one worker
    assert schedule.learning_rate(single, 12)[0] == pytest.approx(0.05)


def test_the_warm_up_ramps_linearly_from_the_policys_rate_to_the_scaled_one():
    param = scaled("workers: 3 lr_scaling: LINEAR lr_warmup: 8")
    rates = [schedule.learning_rate(param, i)[0] for i in (0, 2, 4, 8, 9)]
    assert rates == pytest.approx([0.1, 0.15, 0.2, 0.3, 0.3])  # 0.1 x (1 + 2 x i / 8), then 0.1 x 3
    assert schedule.learning_rate(param, 10)[0] == pytest.approx(0.15)  # the step policy goes on, scaled


def test_the_scaling_line_says_the_rule_and_only_where_it_scales():
    line = schedule.scaling_line(scaled("workers: 2 lr_scaling: LINEAR lr_warmup: 200"))
    assert line == ("Learning rate: base_lr 0.1 x 2 workers (linear) after 200 warm-up iterations from base_lr, as "
                    "the policy schedules it")
    assert "sqrt(4 workers) = 2 (sqrt) from the first iteration" in schedule.scaling_line(
        scaled("workers: 4 lr_scaling: SQRT"))
    assert schedule.scaling_line(scaled("workers: 2")) is None
    assert schedule.scaling_line(scaled("workers: 2 lr_scaling: LINEAR algorithm: SINGLE")) is None


def test_pycaffes_solver_runs_the_scaled_rate_and_a_warm_up_it_cannot_run_is_one_line():
    from deepspark.backends.caffe import compiler  # pycaffe itself is not imported by the compiler
    from deepspark.config import check_deepspark
    from deepspark.errors import ConfigError

    assert compiler.solver_param(scaled("workers: 2 lr_scaling: LINEAR")).base_lr == pytest.approx(0.2)
    assert compiler.solver_param(scaled("workers: 2")).base_lr == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="lr_warmup runs on the tensorflow backend only"):
        check_deepspark(scaled('workers: 2 lr_scaling: LINEAR lr_warmup: 5 backend: "caffe"').deepspark_param, "s")
    check_deepspark(scaled('workers: 2 lr_scaling: LINEAR backend: "caffe"').deepspark_param, "s")
