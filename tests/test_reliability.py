"""Reliability on real Spark (local[2]): a diverging worker ends the job with one line, in bounded time."""

import re
import time

import pytest

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
