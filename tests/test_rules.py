"""Update rules, checked as plain arithmetic with no sockets."""

import re

import numpy as np
import pytest

from deepspark import rules

import reference


def test_elastic_step_matches_the_paper():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(100).astype(np.float32)
    center = rng.standard_normal(100).astype(np.float32)
    x0, c0 = x.copy(), center.copy()
    d = reference.easgd_step(x, center, 0.25)
    np.testing.assert_array_equal(d, np.float32(0.25) * (x0 - c0))
    np.testing.assert_array_equal(x, x0 - d)
    np.testing.assert_array_equal(center, c0 + d)
    # The elastic force is symmetric: x + x̃ is preserved (up to float32 rounding).
    np.testing.assert_allclose(x + center, x0 + c0, rtol=1e-6, atol=1e-6)


def test_elastic_difference_in_place_and_server_factor():
    x = np.array([4.0, -2.0, 1.0], dtype=np.float32)
    center = np.array([2.0, 2.0, 1.0], dtype=np.float32)
    d = rules.elastic_difference(x, center, 0.5, out=x)
    assert d is x
    np.testing.assert_array_equal(d, [1.0, -2.0, 0.0])
    scratch = np.empty(3, dtype=np.float32)
    rules.apply_to_center(center, d, server_factor=0.5, scratch=scratch)
    np.testing.assert_array_equal(center, [2.5, 1.0, 1.0])
    rules.apply_to_center(center, d)
    np.testing.assert_array_equal(center, [3.5, -1.0, 1.0])


def test_moving_rate_has_full_elastic_pull_at_one():
    x = np.array([3.0], dtype=np.float32)
    center = np.array([1.0], dtype=np.float32)
    reference.easgd_step(x, center, 1.0)
    # α = 1: worker and center swap.
    assert x[0] == 1.0 and center[0] == 3.0


def test_all_finite():
    a = np.ones(5, dtype=np.float32)
    ok = np.empty(5, dtype=bool)
    assert rules.all_finite(a, ok)
    huge = np.full(5, 3e38, dtype=np.float32)  # a·a overflows, yet every value is finite
    assert rules.all_finite(huge, ok)
    huge[1] = np.nan  # the overflow fallback still finds it
    assert not rules.all_finite(huge, ok)
    for bad in (np.nan, np.inf, -np.inf):
        a[2] = bad
        assert not rules.all_finite(a, ok)
        assert not rules.all_finite(a)


@pytest.mark.parametrize("count, expected", [(0, 0.8), (9, 0.8), (10, 0.4), (25, 0.2), (30, 0.1), (39, 0.1),
                                             (40, 0.07), (1000, 0.07)])
def test_decay_steps_and_floor(count, expected):
    # rate · gamma^⌊count / step⌋, never below the floor (the proto's moving_rate_limit).
    assert rules.decayed(0.8, 0.5, 10, 0.07, count) == pytest.approx(expected)


def test_decay_disabled_and_unbounded():
    assert rules.decayed(0.8, 0.5, 0, 0.1, 100) == 0.8     # step 0: never
    assert rules.decayed(0.8, 1.0, 10, 0.1, 100) == 0.8    # gamma 1: never
    assert rules.decayed(0.8, 0.5, 10, 0.0, 40) == pytest.approx(0.05)  # floor 0: no bound


def test_fixed_period_schedule():
    s = rules.ExchangeSchedule(3)
    assert [s.step(1.0) for _ in range(7)] == [False, False, True, False, False, True, False]
    assert rules.periodic_due(6, 3) and not rules.periodic_due(7, 3)


def test_adaptive_period_exchanges_when_loss_exceeds_first_period():
    s = rules.ExchangeSchedule(2, adaptive=True)
    # First period: fixed, its summed loss (3.0 + 3.0) becomes the threshold.
    assert [s.step(3.0), s.step(3.0)] == [False, True]
    assert s.first_period_loss == 6.0
    # Lower losses stretch the period: 2+2+2 = 6 is not above 6, the fourth crosses it.
    assert [s.step(2.0), s.step(2.0), s.step(2.0), s.step(2.0)] == [False, False, False, True]
    # Higher losses shorten it.
    assert [s.step(7.0)] == [True]
    assert not rules.adaptive_due(5.0, None)
    assert rules.adaptive_due(6.5, 6.0) and not rules.adaptive_due(6.0, 6.0)


def test_schedule_rejects_bad_period():
    with pytest.raises(ValueError):
        rules.ExchangeSchedule(0)


def test_model_averaging_baselines():
    workers = [np.full(4, v, dtype=np.float32) for v in (1.0, 2.0, 6.0)]
    np.testing.assert_array_equal(rules.average_models(workers), np.full(4, 3.0))
    out = np.empty(4, dtype=np.float32)
    assert rules.average_models(workers, out=out) is out
    # Periodic averaging (SparkNet-style): nothing until the period, then everyone holds the mean.
    assert not reference.averaging_step(workers, period=2, iteration=1)
    assert workers[0][0] == 1.0
    assert reference.averaging_step(workers, period=2, iteration=2)
    for w in workers:
        np.testing.assert_array_equal(w, np.full(4, 3.0))
    # Synchronous averaging (CaffeOnSpark-style) is period 1.
    workers[1][:] = 5.0
    assert reference.averaging_step(workers, period=1, iteration=7)
    np.testing.assert_allclose(workers[2], np.full(4, 11.0 / 3), rtol=1e-6)
    with pytest.raises(ValueError):
        rules.average_models([])


def test_easgd_rules_alone_reach_the_least_squares_optimum():
    # p workers on shards of a zero-residual least-squares problem, exchanging every τ.
    rng = np.random.default_rng(1)
    dim, p, tau, alpha, lr = 8, 4, 4, 0.9 / 4, 0.05
    x_star = rng.standard_normal(dim).astype(np.float32)
    shards = []
    for _ in range(p):
        a = rng.standard_normal((100, dim)).astype(np.float32)
        shards.append((a, a @ x_star))
    center = np.zeros(dim, dtype=np.float32)
    workers = [center.copy() for _ in range(p)]
    for it in range(1, 401):
        for x, (a, b) in zip(workers, shards):
            rows = rng.integers(0, len(a), 10)
            x -= lr * a[rows].T @ (a[rows] @ x - b[rows]) / 10
            if rules.periodic_due(it, tau):
                reference.easgd_step(x, center, alpha)
    assert np.linalg.norm(center - x_star) / np.linalg.norm(x_star) < 1e-3


def test_outer_step_is_dilocos_nesterov_and_plain_averaging_at_rate_one_without_momentum():
    rng = np.random.default_rng(3)
    center, mean = rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    velocity = np.zeros_like(center)
    # the mean up to rounding (x̃ − (x̃ − mean)); algorithms/average.py takes the mean itself at these defaults
    np.testing.assert_allclose(rules.outer_step(center.copy(), mean, velocity, 1.0, 0.0), mean, rtol=0, atol=1e-6)
    # two rounds by hand: g = x̃ − mean, v = μv + g, x̃ −= η(g + μv)
    x, v = np.array([1.0], np.float32), np.zeros(1, np.float32)
    rules.outer_step(x, np.zeros(1, np.float32), v, 0.7, 0.9)
    np.testing.assert_allclose((x, v), ([1 - 0.7 * (1 + 0.9)], [1.0]), rtol=1e-6)
    g = x.copy()
    rules.outer_step(x, np.zeros(1, np.float32), v, 0.7, 0.9)
    v_expected = 0.9 * 1.0 + g
    np.testing.assert_allclose((x, v), (g - 0.7 * (g + 0.9 * v_expected), v_expected), rtol=1e-6)


@pytest.mark.parametrize("knob, value, line", [
    ("outer_momentum", 1.0, "outer_momentum must be in [0, 1), not 1"),
    ("outer_learning_rate", 0.0, "outer_learning_rate must be positive, not 0"),
])
def test_outer_optimizer_knobs_out_of_range_are_one_line(knob, value, line):
    from deepspark.config import check_deepspark
    from deepspark.errors import ConfigError
    from deepspark.proto import deepspark_pb2 as pb

    with pytest.raises(ConfigError, match=re.escape(line)):
        check_deepspark(pb.DeepSparkParameter(**{knob: value}), "x.prototxt")


def test_rate_weighting_pulls_a_slow_worker_harder_and_the_center_less_toward_it():
    assert rules.rate_weighted(0.2, 1.0) == (0.2, 0.2)  # one pace: the paper's rule
    pull, toward = rules.rate_weighted(0.2, 0.5)
    assert pull == pytest.approx(0.4) and toward == pytest.approx(0.1)
    # Never past the center: at a tenth of the top rate the worker takes the center (pull 1).
    assert rules.rate_weighted(0.2, 0.1) == (1.0, pytest.approx(0.02))


def test_training_rates_give_each_worker_its_share_of_the_fastest_live_one():
    rates = rules.TrainingRates()
    # One exchange each: no rate yet, share 1.
    assert rates.share(0, 30, 10.0) == 1.0 and rates.share(1, 10, 10.0) == 1.0
    # Worker 0 trains 30 iterations a second, worker 1 10.
    assert rates.share(0, 60, 11.0) == 1.0
    assert rates.share(1, 20, 11.0) == pytest.approx(1 / 3)
    # A new figure counts half: worker 1 at 30 a second now has (10 + 30) / 2 = 20.
    assert rates.share(1, 50, 12.0) == pytest.approx(2 / 3)
    # Worker 0 stopped exchanging (more than 4 of its 1 s intervals ago): worker 1 (now (20 + 2.5) / 2 = 11.25 a
    # second) is the fastest live one.
    assert rates.share(1, 60, 16.0) == 1.0 and rates.seen[1][3] == pytest.approx(11.25)
    # An exchange with no new iteration (a rejoin going on from where its worker stood) keeps the rate it had.
    assert rates.share(1, 60, 16.5) == 1.0 and rates.seen[1][3] == pytest.approx(11.25)
    # A worker that left is forgotten: its replacement's first exchange, 20 s on, has no rate yet (share 1; had
    # the 20 s counted, 0.38), and its second a rate of its own (30 a second, against worker 0's 22.8: share 1).
    assert rates.share(0, 90, 36.0) == 1.0 and rates.share(0, 120, 37.0) == 1.0
    rates.forget(1)
    assert rates.share(1, 70, 36.5) == 1.0 and rates.seen[1][3] is None
    assert rates.share(1, 100, 37.5) == 1.0 and rates.seen[1][3] == pytest.approx(30.0)
