"""Reliability on real Spark (local[2]): a diverging worker ends the job with one line, in bounded time."""

import os
import re
import time

import pytest

from deepspark.proto import deepspark_pb2 as pb

from conftest import run_cli
from synthetic import make_job

pytestmark = pytest.mark.spark


def test_a_diverging_worker_stops_the_job_at_once_with_the_line_that_says_where(tmp_path):
    solver = make_job(tmp_path, max_iter=5000, test_interval=0, snapshot=0)
    # weight decay x base_lr = 5e4: each step multiplies the weights by ~5e4, Inf in ~8 steps, then NaN.
    with open(solver) as stream:
        text = stream.read().replace("base_lr: 0.05", "base_lr: 1e8")
    with open(solver, "w") as stream:
        stream.write(text)
    started = time.monotonic()
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2")  # async EASGD (sync: the same path)
    elapsed = time.monotonic() - started
    assert status == 1, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert re.fullmatch(r"deepspark train: error: worker [01] diverged at iteration \d+: its loss is nan at learning "
                        r"rate [\d.e+]+; lower base_lr \(or set clip_gradients\) and resume from the last snapshot",
                        last), log[-3000:]
    iteration = int(re.search(r"at iteration (\d+)", last).group(1))
    assert iteration < 100  # long before max_iter: the first non-finite loss stops it
    assert "retry" not in log.lower() and elapsed < 120  # no Spark retries of a task that would diverge again
    assert not list((tmp_path / "out").glob("*.caffemodel"))  # nothing snapshotted from a diverged job


def _crash(_):
    os._exit(3)  # the Python worker dies, as one killed from outside does


def _raise(_):
    raise ValueError("a task that raises")


def test_the_failure_line_names_the_cause_of_a_real_spark_failure():
    """Py4J's report puts Spark's abort on a line that starts with ": ": the line still names the task, its
    failures and the cause, not "An error occurred while calling z:...collectAndServe."."""
    from deepspark.spark.failures import failed
    from deepspark.spark.session import spark_context

    sc, started = spark_context(pb.DeepSparkParameter(max_failures=1), 1)  # local[1,1]: no retry
    try:
        lines = {}
        for name, task in (("crash", _crash), ("raise", _raise)):
            with pytest.raises(Exception) as caught:
                sc.parallelize([1], 1).map(task).collect()
            lines[name] = str(failed(caught.value, sc))
    finally:
        if started:
            sc.stop()
    assert re.match(r"the Spark job failed: Task 0 in stage \S+ failed \d+ times?, the last: Python worker exited "
                    r"unexpectedly \(crashed\); Spark reports", lines["crash"]), lines["crash"]
    assert lines["raise"].startswith("the Spark job failed: ValueError: a task that raises; "), lines["raise"]
