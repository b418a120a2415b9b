"""`train --iterations N` stops at iteration N and leaves the solver's learning-rate schedule as it is: the rates a
run logs equal those pycaffe's own solver logs for the solver's real max_iter, policy by policy."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import run_cli
from synthetic import make_job

from deepspark import checkpoint, schedule
from deepspark.config import load_solver, override
from deepspark.errors import ConfigError

MAX_ITER, ITERATIONS = 10, 5
BASE_LR = 0.05

# Every lr_policy Caffe's SGDSolver::GetLearningRate knows, with values that move the rate within ITERATIONS
# steps. Only poly reads max_iter there; the others are the control (sigmoid reads stepsize, step stepsize).
POLICIES = {
    "poly": 'lr_policy: "poly" power: 2',
    "fixed": 'lr_policy: "fixed"',
    "step": 'lr_policy: "step" gamma: 0.5 stepsize: 2',
    "exp": 'lr_policy: "exp" gamma: 0.8',
    "inv": 'lr_policy: "inv" gamma: 0.5 power: 0.75',
    "multistep": 'lr_policy: "multistep" gamma: 0.5 stepvalue: 1 stepvalue: 3',
    "sigmoid": 'lr_policy: "sigmoid" gamma: -0.5 stepsize: 2',
}

# pycaffe's reference: a solver of the same schedule over a net that needs no data, stepped, its `lr = ` lines read.
PYCAFFE_NET = """name: "lr"
layer { name: "x" type: "Input" top: "x" top: "label" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
PYCAFFE_STEP = "import sys, caffe; caffe.set_mode_cpu(); caffe.get_solver(sys.argv[1]).step(int(sys.argv[2]))"
LR_LINE = re.compile(r"Iteration (\d+), lr = (\S+)")


def rates(log):
    """[(iteration, rate)] of a log's `Iteration N, lr = R` lines (Caffe's and ours are the same)."""
    return [(int(i), float(r)) for i, r in LR_LINE.findall(log)]


def pycaffe_rates(folder, policy, max_iter, steps):
    """The rates pycaffe's SGDSolver logs over `steps` steps of a solver with `policy` and `max_iter`."""
    (folder / "pycaffe_net.prototxt").write_text(PYCAFFE_NET)
    solver = folder / "pycaffe_solver.prototxt"
    solver.write_text(f'net: "{folder / "pycaffe_net.prototxt"}"\nbase_lr: {BASE_LR}\n{policy}\nmax_iter: {max_iter}\n'
                      "display: 1\n")
    done = subprocess.run([sys.executable, "-c", PYCAFFE_STEP, str(solver), str(steps)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "GLOG_minloglevel": "0", "GLOG_logtostderr": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return rates(done.stderr)


def job_with(folder, policy):
    """The synthetic job's solver with `policy`, max_iter MAX_ITER, a display every iteration and no tests."""
    path = make_job(folder, max_iter=MAX_ITER, test_interval=0)
    kept = [line for line in open(path).read().splitlines()
            if not line.startswith(("lr_policy", "gamma", "power", "display", "base_lr"))]
    with open(path, "w") as stream:
        stream.write("\n".join(kept + [f"base_lr: {BASE_LR}", policy, "display: 1"]) + "\n")
    return path


def train(solver, backend, *flags):
    status, _, err = run_cli("train", "--solver", solver, "--algorithm", "single", "--backend", backend, *flags,
                             env={"GLOG_minloglevel": "2"})
    assert status == 0, err[-3000:]
    return err


@pytest.mark.caffe
@pytest.mark.parametrize("name", POLICIES)
def test_iterations_stop_the_run_and_keep_the_solvers_schedule(tmp_path, name):
    policy = POLICIES[name]
    solver = job_with(tmp_path, policy)
    log = train(solver, "caffe", "--iterations", str(ITERATIONS))
    ours = rates(log)
    expected = pycaffe_rates(tmp_path, policy, MAX_ITER, ITERATIONS)
    assert [i for i, _ in ours] == list(range(ITERATIONS)) == [i for i, _ in expected], log[-3000:]
    np.testing.assert_allclose([r for _, r in ours], [r for _, r in expected], rtol=1e-5)
    param = load_solver(solver).param
    formula = [schedule.learning_rate(param, i, sum(i >= v for v in param.stepvalue))[0] for i in range(ITERATIONS)]
    np.testing.assert_allclose([r for _, r in ours], formula, rtol=1e-5)  # Caffe's formula, worked in float64
    if name == "poly":  # the one policy a run cut short by max_iter would have rescaled
        shortened = pycaffe_rates(tmp_path, policy, ITERATIONS, ITERATIONS)
        assert not np.allclose([r for _, r in ours], [r for _, r in shortened])
        assert "Stopping at iteration 5 (iterations), not max_iter 10" in log
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".log") == ["tiny_iter_5.caffemodel",
                                                                         "tiny_iter_5.solverstate"]
    assert "Optimization Done." in log


@pytest.mark.caffe
def test_a_run_cut_short_resumes_on_the_same_schedule_and_both_backends_apply_it(tmp_path):
    """The end-of-run snapshot of `--iterations 5` resumes to max_iter on the rates pycaffe's solver gives in one
    run of 10; the TensorFlow backend's weights after 5 poly steps equal the Caffe backend's (pycaffe's own
    solver, which reads max_iter itself) from the same start and batches."""
    policy = POLICIES["poly"]
    solver = job_with(tmp_path, policy)
    train(solver, "caffe", "--iterations", str(ITERATIONS))
    caffe_weights = checkpoint.read_caffemodel(str(tmp_path / "out" / "tiny_iter_5.caffemodel"))
    log = train(solver, "caffe", "--snapshot", str(tmp_path / "out" / "tiny_iter_5.solverstate"))
    expected = pycaffe_rates(tmp_path, policy, MAX_ITER, MAX_ITER)
    resumed = rates(log)
    assert [i for i, _ in resumed] == [i for i, _ in expected[ITERATIONS:]] == list(range(ITERATIONS, MAX_ITER))
    np.testing.assert_allclose([r for _, r in resumed], [r for _, r in expected[ITERATIONS:]], rtol=1e-5)
    assert (tmp_path / "out" / "tiny_iter_10.caffemodel").exists()

    train(solver, "tensorflow", "--iterations", str(ITERATIONS), "--output", str(tmp_path / "tf"))
    tf_weights = checkpoint.read_caffemodel(str(tmp_path / "tf" / "tiny_iter_5.caffemodel"))
    assert [name for name, _ in tf_weights] == [name for name, _ in caffe_weights]
    for (name, ours), (_, theirs) in zip(tf_weights, caffe_weights):
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name)


def test_iterations_is_the_stop_not_max_iter(tmp_path):
    solver = override(load_solver(make_job(tmp_path, max_iter=100)), iterations=7)
    assert solver.param.max_iter == 100 and schedule.stop_iteration(solver.param) == 7
    assert schedule.stop_iteration(load_solver(solver.path).param) == 100
    with pytest.raises(ConfigError, match="iterations must be at least 1, not 0"):
        override(load_solver(solver.path), iterations=0)


def test_poly_refuses_iterations_past_max_iter_and_a_missing_max_iter(tmp_path):
    path = job_with(tmp_path, POLICIES["poly"])
    with pytest.raises(ConfigError, match="iterations 11 goes past max_iter 10, where lr_policy 'poly'"):
        override(load_solver(path), iterations=11)
    assert schedule.stop_iteration(override(load_solver(path), iterations=10).param) == 10
    with open(path) as stream:
        text = stream.read().replace(f"max_iter: {MAX_ITER}\n", "")
    with open(path, "w") as stream:
        stream.write(text)
    with pytest.raises(ConfigError, match="lr_policy 'poly' needs max_iter"):
        load_solver(path)


@pytest.mark.spark
def test_every_spark_algorithm_stops_at_iterations_with_max_iter_left_alone(tmp_path):
    """easgd, sync and average on local[2]: a poly solver of max_iter 1000 trained with iterations=8 stops at 8 on
    every worker, says so in one line, and snapshots its end there (snapshot_after_train)."""
    from sparkjobs import start_runs

    solvers = []
    for algorithm in ("easgd", "sync", "average"):
        folder = tmp_path / algorithm
        folder.mkdir()
        path = make_job(folder, max_iter=1000, test_interval=0)
        text = open(path).read().replace('lr_policy: "inv"', 'lr_policy: "poly"')
        with open(path, "w") as stream:
            stream.write(text.replace("deepspark_param {", f"deepspark_param {{ algorithm: {algorithm.upper()}"))
        solvers.append(path)
    runs = start_runs(solvers, iterations=8, workers=2)
    out, err = runs.communicate(timeout=600)
    assert runs.returncode == 0, err[-3000:]
    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [s["iterations"] for s in summaries] == [8, 8, 8], err[-3000:]
    for algorithm, summary in zip(("easgd", "sync", "average"), summaries):
        log = (tmp_path / algorithm / "out" / "train.log").read_text()
        assert "Stopping at iteration 8 (iterations), not max_iter 1000" in log, algorithm
        assert re.findall(r"Worker \d on \S+ \(in [^)]*\): (\d+) iterations", log) == ["8", "8"], algorithm
        assert summary["weights"].endswith("tiny_iter_8.caffemodel"), algorithm
