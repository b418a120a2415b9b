"""Faults, several per run (#13), on real Spark: three workers killed in one EASGD run and in one sync run, each ending within a point of its unharmed run; a standalone Spark Worker JVM killed for good never hangs the job."""

import os
import re
import signal
import threading
import time

import pytest

from sparkjobs import chaos, cluster, final_accuracy, kill_while_training, start_runs, start_training, workers_done
from synthetic import make_job

pytestmark = pytest.mark.spark

KILLS = 3
# The kills are keyed on the log's iterations (the slowest worker's), each at a point drawn in its third of
# KILLS_WINDOW (shares of max_iter), and each waits for the rejoin before it (a Python worker's start, TensorFlow's
# import, the spill) and for the job to train again (a line every WATCH_SECONDS). The job must be long enough
# that a victim has work left after the third kill however loaded the machine: a loaded machine slows a killed
# worker's restart (seconds to fork a Python worker) far more than the survivor's training, which goes on alone
# meanwhile. Too short a job (2400 EASGD iterations; 600 sync rounds), or a window reaching to half the job, left
# the third kill no room in `make test` runs. With 4800 EASGD iterations and the window to 0.3 one CI run still
# made no third kill (#35): EASGD runs twice that, and a victim killed as it finished, whose rejoin comes and goes
# between two looks at /proc, counts as rejoined by the driver's line (tools/chaos.py).
KILLS_WINDOW = (0.03, 0.3)
MAX_ITER = {"easgd": 9600, "sync": 2000}


def rejoins(log):
    found = re.findall(r"Worker (\d+) rejoined the exchanger \(connection (\d+)\)", log)
    return sorted((int(w), int(c)) for w, c in found)


def unharmed_and_harmed(tmp_path, seed, algorithm):
    """The tiny job twice in one driver (one SparkSession): unharmed, then with KILLS workers killed by the
    harness at seeded moments of its run; (exit status, the driver's stderr, unharmed log, harmed log,
    the kills)."""
    solvers = []
    for name in ("unharmed", "harmed"):
        (tmp_path / name).mkdir()
        solvers.append(make_job(tmp_path / name, max_iter=MAX_ITER[algorithm], test_interval=MAX_ITER[algorithm]))
    # Four attempts of a task (local[2,4]): three kills of the same EASGD worker take three. A sync kill fails
    # the barrier stage's attempt instead, and Spark's spark.stage.maxConsecutiveAttempts (4 by default)
    # allows three reruns: a fourth kill fails the job whatever max_failures says.
    driver = start_runs(solvers, workers=2, max_failures=4, algorithm=algorithm)
    said = []  # the harness's own lines (each kill, each rejoin, a kill not made and why), first in a failure
    _, stderr, kills = kill_while_training(driver, tmp_path / "harmed" / "out" / "train.log", MAX_ITER[algorithm],
                                           KILLS, seed, KILLS_WINDOW, timeout=300, wait=900,
                                           say=lambda line: said.append(f"{time.time():.2f} {line}"))
    logs = [(tmp_path / name / "out" / "train.log").read_text() for name in ("unharmed", "harmed")]
    return driver.returncode, stderr, *logs, Kills(kills, said)


class Kills(list):
    """The kills made, and the harness's lines: a failed assertion shows them first (CI shows a message's start)."""

    def __init__(self, kills, said):
        super().__init__(kills)
        self.said = said

    def __repr__(self):
        return "\n".join(self.said) + "\n" + super().__repr__()


def test_three_workers_killed_in_one_easgd_run_rejoin_and_it_ends_within_a_point_of_the_unharmed_run(tmp_path):
    status, stderr, unharmed, harmed, kills = unharmed_and_harmed(tmp_path, 13, "easgd")
    assert status == 0, stderr[-3000:]
    assert [k.number for k in kills] == [1, 2, 3] and all(k.rejoined_at for k in kills), (kills, harmed[-3000:])
    # Each kill hit a training worker: Spark retried that worker's task alone, and it rejoined.
    found = rejoins(harmed)
    assert len(found) == KILLS, harmed[-3000:]
    for worker in (0, 1):
        assert [c for w, c in found if w == worker] == list(range(2, 2 + sum(w == worker for w, _ in found)))
    assert "rejoined" not in unharmed
    assert "Optimization Done." in harmed and workers_done(harmed) == [0, 1]
    assert abs(final_accuracy(harmed) - final_accuracy(unharmed)) <= 0.01


def test_three_workers_killed_in_one_sync_run_rerun_the_stage_and_it_ends_within_a_point_of_the_unharmed_run(
        tmp_path):
    # Each kill fails the barrier stage; Spark reruns it whole, and every worker rejoins at the last round.
    status, stderr, unharmed, harmed, kills = unharmed_and_harmed(tmp_path, 7, "sync")
    assert status == 0, stderr[-3000:]
    assert [k.number for k in kills] == [1, 2, 3] and all(k.rejoined_at for k in kills), (kills, harmed[-3000:])
    assert rejoins(harmed) == [(w, c) for w in (0, 1) for c in range(2, 2 + KILLS)], harmed[-3000:]
    # The last attempt: both workers went on from the same completed round, one round per iteration.
    last = re.findall(r"Worker (\d) rejoined the exchanger \(connection 4\); it goes on from the center at iteration "
                      r"(\d+)", harmed)
    (round_,) = {int(i) for _, i in last}
    assert sorted(w for w, _ in last) == ["0", "1"] and 0 < round_ < MAX_ITER["sync"], harmed[-3000:]
    rounds = str(MAX_ITER["sync"] - round_)
    final = re.findall(r"Worker (\d) on \S+ \(in [^)]*\): (\d+) iterations, (\d+) exchanges", harmed)
    assert final == [("0", rounds, rounds), ("1", rounds, rounds)], harmed[-3000:]
    assert "Workers hold the center after the last round: yes" in harmed
    assert "Optimization Done." in harmed and workers_done(harmed) == [0, 1]
    assert abs(final_accuracy(harmed) - final_accuracy(unharmed)) <= 0.01


# Seconds a lost worker may take to rejoin once no worker trains (and, on a cluster, to connect at the start:
# the executors' daemon imports TensorFlow; 45 s was missed once with the machine's load at ~15).
CLUSTER_CONNECT_TIMEOUT = 60
# One executor core trains the tiny net at a few hundred iterations a second once TensorFlow has traced its
# step, which takes a worker seconds: long enough that both workers train together for a while.
CLUSTER_MAX_ITER = 3000


def lose_a_spark_worker(solver, cluster_dir, number, max_iter, *flags):
    """Train on a standalone cluster and SIGKILL its Spark Worker `number` for good once every worker of the
    job is connected and the log passes a tenth of max_iter (every worker trains); (exit status, the driver's
    log, the WorkerKill, seconds from the kill to the driver's end)."""
    driver = start_training(solver, *flags)
    log = chaos.DriverLog(os.path.join(os.path.dirname(solver), "out", "train.log"), max_iter)
    workers = int(flags[flags.index("--workers") + 1])
    killed = []

    def lose():
        while driver.poll() is None:
            if (log.progress() or 0) >= 0.1 and len(chaos.exchanger_clients(log.port)) == workers:
                killed.append(chaos.kill_spark_worker(number, cluster_dir))
                return
            time.sleep(chaos.POLL_SECONDS)

    loser = threading.Thread(target=lose, daemon=True)
    loser.start()
    try:
        _, stderr = driver.communicate(timeout=600)
        ended = time.time()
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    loser.join(10)
    assert killed, f"the job ended before Spark worker {number} was killed:\n{stderr[-3000:]}"
    return driver.returncode, stderr, killed[0], ended - killed[0].at


@pytest.mark.slow
def test_a_spark_worker_jvm_killed_for_good_never_hangs_the_job(tmp_path):
    with cluster(tmp_path) as (master, cluster_dir):
        # Two workers, one per Spark Worker (1 core each); one Worker JVM is killed for good: its executor
        # and Python worker go with it, and the lost shard runs on the other executor once its slot frees.
        (tmp_path / "two").mkdir()
        solver = make_job(tmp_path / "two", max_iter=CLUSTER_MAX_ITER, test_interval=CLUSTER_MAX_ITER,
                          connect_timeout=CLUSTER_CONNECT_TIMEOUT)
        status, log, kill, _ = lose_a_spark_worker(solver, cluster_dir, 1, CLUSTER_MAX_ITER, "--workers", "2",
                                                   "--master", master)
        assert status == 0, log[-3000:]
        assert kill.descendants and chaos.alive(kill.descendants) == [], kill  # the executor JVM went with it
        lost = re.findall(r"Worker ([01]) lost at iteration (\d+): Spark lost executor \d+ on 127\.0\.0\.1:\d+ "
                          r"\(left: executor \d+ on 127\.0\.0\.1:\d+\); its shard is re-placed when a slot frees and "
                          rf"it goes on from the center where it was; the job fails if no worker trains for "
                          rf"{CLUSTER_CONNECT_TIMEOUT}s \(connect_timeout\) before it rejoins", log)
        assert len(lost) == 1, log[-3000:]
        worker, iteration = lost[0]
        assert 0 < int(iteration) < CLUSTER_MAX_ITER
        assert f"Worker {worker} rejoined the exchanger (connection 2); it goes on from the center at iteration " \
               f"{iteration}" in log, log[-3000:]
        assert workers_done(log) == [0, 1] and "Optimization Done." in log
        assert final_accuracy(log) >= 0.9

        # One worker on the last Spark Worker, which is killed for good too: its shard has nowhere to go. The
        # job fails with one line naming what was lost, connect_timeout after no worker trains; never hangs.
        (tmp_path / "one").mkdir()
        solver = make_job(tmp_path / "one", max_iter=CLUSTER_MAX_ITER, test_interval=CLUSTER_MAX_ITER,
                          connect_timeout=CLUSTER_CONNECT_TIMEOUT)
        status, log, kill, seconds = lose_a_spark_worker(solver, cluster_dir, 2, CLUSTER_MAX_ITER, "--workers", "1",
                                                         "--master", master)
        assert status == 1, log[-3000:]
        assert re.search(rf"Worker 0 lost at iteration [1-9]\d*: Spark lost executor \d+ on 127\.0\.0\.1:\d+ and has "
                         rf"none left; its shard is re-placed if Spark gets an executor within "
                         rf"{CLUSTER_CONNECT_TIMEOUT}s \(connect_timeout\), else the job fails", log), log[-3000:]
        last = log.strip().splitlines()[-1]
        assert re.fullmatch(rf"deepspark train: error: lost worker 0 at iteration [1-9]\d* with executor \d+ on "
                            rf"127\.0\.0\.1:\d+; no worker has trained for {CLUSTER_CONNECT_TIMEOUT}s "
                            rf"\(connect_timeout\) and no executor took up the lost work; Spark reports .*; resume "
                            rf"from the last snapshot \(--snapshot\)", last), log[-3000:]
        assert CLUSTER_CONNECT_TIMEOUT < seconds < CLUSTER_CONNECT_TIMEOUT + 120  # bounded: it did not hang
