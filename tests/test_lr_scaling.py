"""deepspark_param.lr_scaling on a real backend: a Spark worker's TensorFlow solver steps at the scaled rate, warmed
up from the solver's own, and a single run of the same solver at the solver's own."""

import numpy as np
import pytest

from deepspark import engine, nets
from deepspark.config import load_solver, override
from synthetic import make_job

KNOBS = {"own": {}, "linear": {"lr_scaling": "linear", "lr_warmup": 4},
         "single": {"lr_scaling": "linear", "algorithm": "single"}}


def test_a_workers_step_moves_by_the_scaled_rate_and_a_single_run_by_the_solvers(tmp_path):
    path = make_job(tmp_path, max_iter=100)
    rates, moves, batch, start = {}, {}, None, None
    for name, knobs in KNOBS.items():
        solver = override(load_solver(path), **knobs)
        solver.param.momentum, solver.param.weight_decay, solver.param.lr_policy = 0.0, 0.0, "fixed"
        trainer = nets.trainer(solver, evaluate=False, spark=name != "single")
        try:
            rates[name] = []
            for iteration in range(6):
                trainer.model.iter = iteration
                rates[name].append(trainer.model.learning_rate())
            batch = batch or engine.next_batch(trainer.feeders)
            start = trainer.model.get_flat() if start is None else start
            trainer.model.set_flat(start)
            trainer.model.step(batch)  # iteration 5, past the warm-up: plain SGD moves by rate x gradient
            moves[name] = trainer.model.get_flat() - start
        finally:
            trainer.close()
    assert rates["own"] == rates["single"] == pytest.approx([0.05] * 6)
    assert rates["linear"] == pytest.approx([0.05, 0.0625, 0.075, 0.0875, 0.1, 0.1])  # 2 workers, 4 warm-up
    np.testing.assert_array_equal(moves["single"], moves["own"])
    assert np.abs(moves["own"]).max() > 0
    np.testing.assert_allclose(moves["linear"], 2 * moves["own"], rtol=1e-5, atol=1.5e-7)  # float32 weights: ulps
