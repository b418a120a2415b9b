"""The sync and average baselines on real Spark (local[2]) and the tiny synthetic job: accuracy, logs, snapshots, arithmetic."""

import os
import re

import numpy as np
import pytest

from conftest import run_cli
from sparkjobs import final_accuracy
from synthetic import make_job

from deepspark import checkpoint, rules
from deepspark.config import load_solver, override

pytestmark = pytest.mark.spark


def worker_lines(log):
    return re.findall(r"Worker (\d) on \S+ \(in [^)]*\): (\d+) iterations, (\d+) exchanges", log)


def test_sync_averages_every_iteration_and_every_worker_ends_on_the_center(tmp_path):
    solver = make_job(tmp_path, max_iter=120, test_interval=60, snapshot=0)
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--algorithm", "sync")
    assert status == 0, log[-3000:]
    assert "on local[2,1000000] with 2 workers (tensorflow backend, synchronous averaging every iteration)" in log
    assert "averaged every iteration (synchronous rounds, timeout 60s)" in log
    assert "sync averages every iteration; period 4 is not used" in log  # the tiny solver sets period 4
    assert worker_lines(log) == [("0", "120", "120"), ("1", "120", "120")]  # one round per iteration
    agree = re.search(r"Workers hold the center after the last round: (\w+) \(crc32 (\w+), (\w+); center (\w+)\)", log)
    assert agree and agree.group(1) == "yes" and len({agree.group(i) for i in (2, 3, 4)}) == 1, log[-3000:]
    assert re.search(r"Spill took [\d.]+s, [\d.]+% of training time", log)
    assert final_accuracy(log) >= 0.9
    out = set(os.listdir(tmp_path / "out"))
    assert {"tiny_iter_120.caffemodel", "tiny_iter_120.solverstate", "progress.png", "train.log"} <= out


def test_average_runs_rounds_of_period_iterations(tmp_path):
    solver = make_job(tmp_path, max_iter=120, test_interval=60, snapshot=60)
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--algorithm", "average")
    assert status == 0, log[-3000:]
    assert "with 2 workers (tensorflow backend, model averaging every 4 iterations)" in log
    assert worker_lines(log) == [("0", "120", "30"), ("1", "120", "30")]  # 120 / period 4 rounds
    tested = [int(i) for i in re.findall(r"Iteration (\d+), Testing net", log)]
    assert tested == [0, 60, 120]  # Caffe's test iterations, exactly
    assert re.findall(r"Iteration (\d+), loss = ", log) == ["20", "40", "60", "80", "100", "120"]
    # Each worker's progress after its rounds, as easgd's (plain lines on a console that is no terminal).
    assert re.search(r"Progress: iteration 120 of 120 .*w0 loss \d.* \| w1 loss \d", log), log[-3000:]
    assert final_accuracy(log) >= 0.9
    out = set(os.listdir(tmp_path / "out"))
    assert {"tiny_iter_60.caffemodel", "tiny_iter_60.solverstate", "tiny_iter_120.caffemodel",
            "tiny_iter_120.solverstate", "progress.png", "train.log"} <= out
    assert "Optimization Done." in log


@pytest.mark.parametrize("outer", [None, (0.7, 0.9)], ids=["mean", "diloco"])
def test_average_center_is_the_mean_of_what_the_workers_trained_from_it(tmp_path, outer):
    """One round (period = max_iter): each worker ran `period` iterations from the broadcast center on its
    own shard, and the new center is rules.average_models of their parameters (with DiLoCo's outer
    optimizer: rules.outer_step from the start center toward that mean, its momentum from zero)."""
    from deepspark.algorithms import average
    from deepspark.spark import executor, rounds
    from deepspark.spark.job import Job, JobPlan
    from deepspark.spark.shards import shard_payloads

    steps = 12
    path = make_job(tmp_path, max_iter=steps, test_interval=0, snapshot=0)
    knobs = {} if outer is None else {"outer_learning_rate": outer[0], "outer_momentum": outer[1]}
    solver = override(load_solver(path), algorithm="average", period=steps, workers=2, iterations=steps, **knobs)
    class Recorded(average.Average):
        def update_center(self, job, returned):  # the round's parameters, as each worker returned them
            job.last_round = [(r["worker"], r["params"]) for r in returned]
            super().update_center(job, returned)

    job = Job()
    job.run(JobPlan.of(solver, algorithm=Recorded()))
    start = np.concatenate([a.reshape(-1) for a in job.center0]).astype(np.float32)
    assert [w for w, _ in job.last_round] == [0, 1]
    returned = [params for _, params in job.last_round]
    assert not np.array_equal(returned[0], returned[1])
    if outer is not None:
        assert "outer Nesterov (DiLoCo) rate 0.7, momentum 0.9" in job.title
        expected = rules.outer_step(start.copy(), rules.average_models(returned), np.zeros_like(start), *outer)
        np.testing.assert_allclose(job.center, expected, rtol=1e-6, atol=1e-7)
        return
    assert job.center.tobytes() == rules.average_models(returned).tobytes()
    # the snapshot holds that center
    saved = checkpoint.read_caffemodel(str(tmp_path / "out" / f"tiny_iter_{steps}.caffemodel"))
    arrays = checkpoint.weights_for(job.graph, saved, [np.full(p.shape, np.nan, np.float32) for p in job.graph.params])
    np.testing.assert_array_equal(np.concatenate([a.ravel() for a in arrays]), job.center)
    # each worker's parameters are what its Trainer makes of the start center in `steps` iterations
    payloads, _ = shard_payloads(solver, 2)
    for worker, payload in enumerate(payloads):
        trainer, shard, *_ = executor.build(worker, payload, job.task)
        try:
            trainer.model.set_flat(start)
            for _ in range(steps):
                trainer.step()
            np.testing.assert_allclose(trainer.model.get_flat(), returned[worker], rtol=1e-4, atol=1e-5)
        finally:
            trainer.close()
            rounds.release(job.task.job_id)
