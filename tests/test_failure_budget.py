"""The failure budget shaped for long jobs (#45): per worker and per job within a window, a crash loop stopped in one line naming the worker; each loss and rejoin counted with its cost; on real Spark, a worker killed more times than max_failures still finishes its job."""

import os
import re
import signal
import time

import pytest

from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.budget import Budget, Limits, Outages

from sparkjobs import kill_while_training, start_training, workers_done
from synthetic import before_conv, make_job

CRASH = "SparkException: Python worker exited unexpectedly (crashed)"


def test_the_defaults_let_a_worker_fail_every_15_s_for_hours_and_train_between():
    budget = Budget(Limits.of(pb.DeepSparkParameter()))
    for k in range(4 * 3600 // 15):  # four hours, one worker killed every 15 s, training between kills
        assert budget.fail(1, 15.0 * k, CRASH) is None, k
        budget.trained(1)


def test_a_crash_loop_stops_at_max_failures_in_a_row_in_one_line_naming_the_worker_and_cause():
    budget = Budget(Limits.of(pb.DeepSparkParameter(max_failures=4)))
    budget.fail(0, 0.0, CRASH)
    budget.trained(0)  # worker 0 trains again: its earlier failure is no part of a loop
    lines = [budget.fail(1, 100.0 + 20 * k, "ValueError: no such file\n  at the build") for k in range(4)]
    assert lines[:3] == [None] * 3
    assert lines[3] == ("worker 1 failed 4 times in a row in 60s without training between them (max_failures 4); "
                        "the last: ValueError: no such file at the build")
    assert budget.failures(1) == (4, 4) and budget.failures(0) == (1, 0)


def test_max_failures_1_stops_at_the_first_failure():
    assert Budget(Limits(1, 3600, 0, 0)).fail(3, 5.0, CRASH).startswith("worker 3 failed once in a row")


def test_the_window_slides_per_worker_and_per_job():
    budget = Budget(Limits(in_a_row=100, window=60, per_worker=3, per_job=5))
    # Worker 0 fails every 30 s, training between: at most two in any 60 s, so it goes on.
    for k in range(10):
        assert budget.fail(0, 30.0 * k + 0.5, CRASH) is None
        budget.trained(0)
    # A third within 60 s of two others stops the job, naming the worker, the count and the window.
    assert budget.fail(0, 275.0, CRASH) == (f"worker 0 failed 3 times in 60s (failure_window 60s, "
                                            f"max_worker_failures 3); the last: {CRASH}")
    # The job's count: two workers each under their own limit, five failures in all within the window.
    budget = Budget(Limits(in_a_row=100, window=60, per_worker=3, per_job=5))
    for at, worker in ((0, 0), (10, 1), (20, 0), (30, 1)):
        assert budget.fail(worker, at, CRASH) is None
        budget.trained(worker)
    assert budget.fail(2, 40, CRASH).startswith("the workers failed 5 times in 60s (failure_window 60s, "
                                                 "max_job_failures 5), worker 2 the last; the last: ")
    # Window 0: the whole job.
    budget = Budget(Limits(in_a_row=100, window=0, per_worker=3, per_job=0))
    assert [budget.fail(0, 1e4 * k, CRASH) is None for k in range(3)] == [True, True, False]


def test_a_long_cause_is_cut_to_one_short_line():
    line = Budget(Limits(1, 0, 0, 0)).fail(0, 0, "x" * 2000 + "\n" + "y")
    assert "\n" not in line and len(line) < 1200 and line.endswith("...")


def test_every_loss_and_rejoin_is_counted_with_its_cost():
    outages = Outages()
    assert outages.summary(0) == ""
    assert outages.lost(1, 10.0, 300).iteration == 300
    assert outages.lost(1, 11.0, 300) is None  # the same loss seen again (Spark's report after the exchanger's)
    assert outages.rejoined(1, 16.5).cost(99) == 6.5
    outages.lost(1, 30.0, 500)
    outages.rejoined(1, 34.0)
    outages.lost(0, 40.0, 600)  # not back by the end
    assert outages.restarts(1) == 2 and outages.restarts(0) == 0
    assert outages.summary(50.0) == ("Workers lost 3 times (worker 0: 1, worker 1: 2) and rejoined 2 times (after "
                                     "6.5s, 4.0s); 20.5s of worker time lost in all")
    # A loss's time is its worker's last exchange the driver saw, but never before its last rejoin.
    assert outages.lost(1, 33.0, 700).lost_at == 34.0
    outages.rejoined(1, 35.0)
    # A rejoin with no loss seen (both between two looks) still counts as both.
    outages.rejoined(2, 60.0)
    assert re.match(r"Workers lost 5 times .* rejoined 4 times", outages.summary(60.0))
    # Spark's report of that loss, seen a look after the replacement connected, is the same loss: not one more
    # that never ends. A loss seen long after is another.
    late = outages.lost(2, 60.5, 800)
    assert late is not None and late.rejoined_at == 60.0 and late.iteration == 800 and 2 not in outages.open
    assert re.match(r"Workers lost 5 times .* rejoined 4 times", outages.summary(61.0))
    outages.rejoined(3, 70.0)
    assert outages.lost(3, 90.0, 900).rejoined_at is None and 3 in outages.open


def test_two_failures_one_look_finds_count_in_a_row_only_without_a_connection_that_exchanged_between_them():
    """One look at Spark's tasks can find a worker's two failures (its retry forks in milliseconds and trains
    before the next look): whether it trained between them is told by Spark's times of the failures and the
    exchanger's of its connections' first exchanges, not by the look they were found in."""
    from deepspark.spark.losses import Losses

    class Found(Losses):  # what Spark's status store lists: each failure's worker, cause, attempt and end
        def failed_tasks(self, membership):
            found, self.found = self.found, []
            return found

    class Membership:  # every worker needed: one whose budget is spent stops the job
        left = {}

        def leave(self, worker, stop):
            return stop

    def look(trained_at, *ends):
        losses = Found(None, 60.0, Budget(Limits(in_a_row=2, window=3600, per_worker=0, per_job=0)))
        losses.found = [(0, CRASH, (1, n), ended) for n, ended in enumerate(ends)]
        stop = losses.failures({0: {"iteration": 7, "trained_at": trained_at}}, Membership())
        return stop, losses.budget.failures(0)

    # Its first connection trained (before the first failure), its second (between the two) too: 1 in a row.
    assert look((90.0, 105.0), 100.0, 110.0) == (None, (2, 1))
    # The second connected but was killed before its first exchange; the third trains after both: 2 in a row.
    stop, counts = look((90.0, 115.0), 100.0, 110.0)
    assert stop.startswith("worker 0 failed 2 times in a row") and counts == (2, 2)
    # Found a look apart, the same: the driver keeps the first's end.
    losses = Found(None, 60.0, Budget(Limits(in_a_row=2, window=3600, per_worker=0, per_job=0)))
    for ended, trained_at in ((100.0, (90.0,)), (110.0, (90.0, 105.0))):
        losses.found = [(0, CRASH, (1, 0), ended)]
        assert losses.failures({0: {"trained_at": trained_at}}, Membership()) is None
    assert losses.budget.failures(0) == (2, 1)


# The tiny job (synthetic.py) of one worker, long enough for three kills and their rejoins in its first half
# on a loaded machine (its iterations take a millisecond or two; a rejoin, seconds).
KILLED_MAX_ITER = 6000


@pytest.mark.spark
def test_a_worker_killed_more_times_than_max_failures_rejoins_each_time_and_the_summary_counts_them(tmp_path):
    """max_failures 2 was two attempts of a task over the whole job (Spark's local[1,2]): the third kill of the
    one worker ended it. Now it counts failures in a row without training, and the worker trains between kills."""
    solver = make_job(tmp_path, max_iter=KILLED_MAX_ITER, test_interval=KILLED_MAX_ITER, workers=1)
    driver = start_training(solver, "--max-failures", "2")
    said = []
    _, stderr, kills = kill_while_training(driver, tmp_path / "out" / "train.log", KILLED_MAX_ITER, 3, 5, (0.05, 0.5),
                                           timeout=120, wait=300, say=said.append)
    text = (tmp_path / "out" / "train.log").read_text()
    assert driver.returncode == 0, (said, stderr[-3000:])
    assert len(kills) == 3 and all(k.rejoined_at for k in kills), (said, text[-3000:])
    # Each loss is one line with its cause and its count, each rejoin one line with what it cost.
    losses = re.findall(r"Worker 0 lost at iteration (\d+), [\d.]+s into the job: (.*) \(its failure (\d+) in 3600s, "
                        r"1 in a row without training\)", text)
    assert [int(n) for _, _, n in losses] == [1, 2, 3], text[-3000:]
    assert all("Python worker exited unexpectedly" in cause for _, cause, _ in losses), losses
    back = re.findall(r"Worker 0 rejoined the exchanger \(connection (\d)\); it goes on from the center at "
                      r"iteration \d+, ([\d.]+)s after its loss", text)
    assert [c for c, _ in back] == ["2", "3", "4"], text[-3000:]
    costs = [float(seconds) for _, seconds in back]
    summary = re.search(r"Workers lost 3 times \(worker 0: 3\) and rejoined 3 times \(after (.*)\); ([\d.]+)s of "
                        r"worker time lost in all", text)
    assert summary and summary.group(1) == ", ".join(f"{c:.1f}s" for c in costs), text[-3000:]
    # The summary covers every attempt: the worker's line names its attempts, its start-up is its last task's.
    assert re.search(r"Worker 0 on \S+ \(in [^)]*\): \d+ iterations, .*; its last of 4 attempts", text), text[-3000:]
    assert re.search(r"Start-up of worker 0: [\d.]+s from its task's start \(attempt 4\)", text), text[-3000:]
    assert "Optimization Done." in text and workers_done(text) == [0]


# A pass-through Python layer whose setup fails in the Spark tasks of the workers FAILING (gated prepends it), and
# nowhere else (the driver builds the test net with it): those workers crash in a loop before they ever train.
GATE = '''import caffe
from pyspark import TaskContext


class Gate(caffe.Layer):
    def setup(self, bottom, top):
        task = TaskContext.get()
        if task is not None and task.partitionId() in FAILING:
            raise RuntimeError(f"worker {task.partitionId()} cannot start")

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = top[0].diff
'''


def gated(tmp_path, failing=(1,), **knobs):
    """The tiny job (synthetic.make_job with `knobs`) with the workers `failing` crashing in their every Spark task
    before they train (GATE)."""
    solver = make_job(tmp_path, **knobs)
    before_conv(tmp_path, "gate", "crash_gate", "Gate", f"FAILING = {tuple(failing)!r}\n{GATE}")
    return solver


@pytest.mark.spark
def test_a_worker_that_crashes_in_a_loop_stops_the_job_with_one_line_naming_it(tmp_path):
    solver = gated(tmp_path, max_iter=100000, test_interval=0)
    started = time.monotonic()
    driver = start_training(solver)
    try:
        _, stderr = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    elapsed = time.monotonic() - started
    last = stderr.strip().splitlines()[-1]
    assert driver.returncode == 1, stderr[-3000:]
    assert re.fullmatch(r"deepspark train: error: worker 1 failed 4 times in a row in \d+s without training between "
                        r"them \(max_failures 4\); the last: .*'gate' \(Python\): .*RuntimeError: worker 1 cannot "
                        r"start", last), stderr[-3000:]
    text = (tmp_path / "out" / "train.log").read_text()
    counts = re.findall(r"Worker 1 lost at iteration 0, [\d.]+s into the job: .*RuntimeError: worker 1 cannot start "
                        r"\(its failure (\d) in 3600s, (\d) in a row without training\)", text)
    assert counts == [(str(k), str(k)) for k in (1, 2, 3, 4)], text[-3000:]
    assert "Worker 0 lost" not in text and elapsed < 120  # long before max_iter or connect_timeout


@pytest.mark.spark
def test_max_job_failures_in_the_window_stops_the_job_and_each_loss_names_the_worker_that_was_killed(tmp_path):
    """Two workers, max_job_failures 3 within failure_window 600 s, three kills: a worker, its replacement, then the
    other worker. The first two rejoin, the third ends the job with the budget's one line. Each loss names the worker
    killed: the third kill's task (the other worker's first attempt) has a lower task id than the replacement's, which
    failed before it (failures.failed_tasks knows a failure by its task id, not by its place in Spark's list)."""
    max_iter = 40000
    solver = make_job(tmp_path, max_iter=max_iter, test_interval=max_iter, workers=2)
    driver = start_training(solver, "--max-job-failures", "3", "--failure-window", "600")
    said = []
    _, stderr, kills = kill_while_training(driver, tmp_path / "out" / "train.log", max_iter, 3, 3, (0.05, 0.4),
                                           timeout=120, wait=300, say=said.append, picks=[None, "new", "survivor"])
    text = (tmp_path / "out" / "train.log").read_text()
    assert len(kills) == 3 and kills[0].rejoined_at and kills[1].rejoined_at, (said, text[-3000:])
    assert driver.returncode == 1, (said, stderr[-3000:])
    losses = re.findall(r"Worker (\d) lost at iteration \d+, [\d.]+s into the job: .*Python worker exited "
                        r"unexpectedly.* \(its failure (\d) in 600s, 1 in a row without training\)", text)
    first = int(losses[0][0]) if losses else 0
    assert losses == [(str(first), "1"), (str(first), "2"), (str(1 - first), "1")], (said, text[-3000:])
    # The first two kills' replacements rejoin. The third's may too: Spark starts its retry (a fork of the warm
    # zygote, milliseconds) before the driver's next look counts the failure that ends the job.
    rejoins = [int(w) for w in re.findall(r"Worker (\d) rejoined the exchanger", text)]
    assert rejoins[:2] == [first, first] and rejoins[2:] in ([], [1 - first]), text
    assert re.fullmatch(rf"deepspark train: error: the workers failed 3 times in 600s \(failure_window 600s, "
                        rf"max_job_failures 3\), worker {1 - first} the last; the last: .*Python worker exited "
                        rf"unexpectedly.*", stderr.strip().splitlines()[-1]), stderr[-3000:]


def test_the_driver_goes_on_looking_at_failures_while_a_test_pass_holds_its_loop():
    """Watch.looking_on: a test pass or snapshot (tens of seconds under load) does not leave the failures to be
    counted all at once after it, with no training seen between them: a thread looks every WATCH_SECONDS."""
    from deepspark.spark import watch

    class Driver:  # what looking_on reads of a Watch: the exchanger's stats, the failures' and rejoins' looks
        def __init__(self):
            self.server = self
            self.looks, self.rejoined = [], 0

        def stats(self):
            return {0: {"exchanges": len(self.looks)}}

        def failures(self, stats):
            self.looks.append(time.monotonic())
            return "worker 0 failed 2 times in a row" if len(self.looks) == 4 else None

        def rejoins(self, stats):
            self.rejoined += 1

    driver = Driver()
    began = time.monotonic()
    stop = watch.Watch.looking_on(driver, lambda stats: time.sleep(8 * watch.WATCH_SECONDS), {})
    assert stop == "worker 0 failed 2 times in a row"
    assert len(driver.looks) == 4 and driver.rejoined == 4  # it stopped looking at the stop
    assert all(at - began < 8 * watch.WATCH_SECONDS for at in driver.looks)  # during the pass, not after it
    assert watch.Watch.looking_on(Driver(), lambda stats: None, {}) is None
