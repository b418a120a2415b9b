"""A Spark job that stops early loses nothing: Ctrl-C on a running `deepspark train` snapshots the center (and the
workers' solver states) before the driver exits non-zero with one line, and leaves no folder of its own behind."""

import contextlib
import glob
import os
import signal
import sys
import time

import pytest

from deepspark import checkpoint
from sparkjobs import read_until, start_training
from synthetic import make_job

pytestmark = pytest.mark.spark


def zygote_folder(driver):
    """The folder of the zygote `driver` started (session.start_zygote): its child's `--zygote PATH`."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(stat[:-len("stat")] + "cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == driver.pid and "--zygote" in argv:
            return os.path.dirname(argv[argv.index("--zygote") + 1])
    raise AssertionError("the driver started no zygote")


# average's rounds collect in the driver's main thread, where Ctrl-C lands in a Py4J call (it printed four
# tracebacks); easgd's main thread watches.
@pytest.mark.parametrize("sent, algorithm", [(signal.SIGINT, "easgd"), (signal.SIGHUP, "easgd"),
                                             (signal.SIGINT, "average")], ids=["SIGINT", "SIGHUP", "average-SIGINT"])
def test_a_signal_stops_a_running_job_with_a_snapshot_and_one_line(tmp_path, sent, algorithm):
    solver = make_job(tmp_path, max_iter=100000, test_interval=0, snapshot=0)  # would run for hours
    driver = start_training(solver, "--workers", "2", "--algorithm", algorithm)
    try:
        read_until(driver, r"Iteration [1-9]\d*, loss = ")  # the workers train, the center has moved
        folder = zygote_folder(driver)
        assert not os.path.exists(folder)  # the zygote took its hand-over, and its folder with it
        # Ctrl-C reaches the terminal's whole process group (start_training's own session); a hang-up, the driver.
        if sent == signal.SIGINT:
            os.killpg(driver.pid, sent)
        else:
            driver.send_signal(sent)
        _, stderr = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode != 0, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert lines[-1] == "deepspark train: interrupted", stderr[-3000:]
    assert "Traceback" not in stderr and "py4j" not in stderr.lower(), stderr[-3000:]
    name = "SIGINT" if sent == signal.SIGINT else "SIGHUP"
    stopping = [line for line in lines if "Stopping early at iteration" in line and name in line]
    assert stopping and "Optimization stopped early." in stderr, stderr[-3000:]
    models = glob.glob(str(tmp_path / "out" / "tiny_iter_*.caffemodel"))
    states = glob.glob(str(tmp_path / "out" / "tiny_iter_*.solverstate"))
    assert len(models) == 1 and len(states) == 1, stderr[-3000:]
    state = checkpoint.read_solverstate(states[0])
    assert state.iter > 0 and os.path.basename(state.learned_net) == os.path.basename(models[0])
    if algorithm == "easgd":  # the workers' solver states the driver holds go with it (average's stay on executors)
        assert sorted(w.worker for w in state.worker_state) == [0, 1]
    assert not os.path.exists(folder)  # the driver's zygote folder went with it


def test_a_driver_killed_outright_leaves_no_zygote_folder(tmp_path):
    solver = make_job(tmp_path, max_iter=100000, test_interval=0, snapshot=0)
    driver = start_training(solver, "--workers", "2")
    try:
        read_until(driver, r"Iteration [1-9]\d*, loss = ")
        folder = zygote_folder(driver)
        driver.kill()  # SIGKILL: no cleanup of the driver's own runs
        driver.wait()
        # Spark's JVM ends with its driver's pipe, stopping the daemon; the zygote removed its folder at the
        # hand-over (an orphaned one before it would, as it exits).
        deadline = time.monotonic() + 90
        while os.path.exists(folder) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(folder)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)  # whatever of its group is left
        driver.wait()


def test_an_error_raised_while_an_interrupt_went_out_through_py4j_stops_the_job_as_that_interrupt():
    """The average-SIGINT case under load: Ctrl-C cut the round's collect short, Py4J shut its connection, and
    pyspark's call-site `with` around the collect failed on a new one ("Answer from Java side is empty"), which
    Python raised in the interrupt's place; the round made it a JobError, and the job ended as "the Spark job failed"
    instead of "interrupted". Job.train finds the interrupt behind it (failures.interrupted)."""
    from py4j.protocol import Py4JNetworkError

    from deepspark.spark.failures import JobError, interrupted
    from deepspark.spark.job import HungUp, Job

    def round_cut_short(signal_error):
        try:
            try:
                raise signal_error
            except KeyboardInterrupt:
                raise Py4JNetworkError("Answer from Java side is empty")  # the call-site `with`'s exit
        except Exception as error:
            raise JobError(f"the Spark job failed: {error}") from None  # rounds.one_round

    class Algorithm:
        def __init__(self, raises):
            self.raises = raises

        def train(self, job, task):
            self.raises()

    stopped = []
    job = Job.__new__(Job)
    job.task, job.own_sc = None, None
    job.stopped_early, job.stop_session = stopped.append, lambda: None
    for signal_error in (KeyboardInterrupt(), HungUp("SIGHUP")):
        job.algorithm = Algorithm(lambda: round_cut_short(signal_error))
        with pytest.raises(KeyboardInterrupt) as raised:
            job.train()
        assert raised.value is signal_error and stopped[-1] is signal_error
    # A job's own failure, and any other error, go on as they were; only the failure is snapshotted first.
    failure = JobError("the Spark job failed: Job aborted")

    def abort():
        raise failure

    job.algorithm = Algorithm(abort)
    with pytest.raises(JobError) as raised:
        job.train()
    assert raised.value is failure and stopped[-1] is failure and len(stopped) == 3
    job.algorithm = Algorithm(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        job.train()
    assert len(stopped) == 3 and interrupted(ValueError()) is None


def test_py4j_s_log_of_a_connection_an_interrupt_broke_is_dropped_and_other_errors_are_not(capsys):
    """The average-SIGINT case's stray traceback: Py4J logs the BrokenPipeError it met shutting down the connection
    the interrupt left half-used, through its own logger ("py4j.clientserver"), whose records reach the root's
    handler without passing the root's filters."""
    import logging

    import py4j.clientserver

    from deepspark.spark.job import Py4JQuiet

    logger = logging.getLogger("py4j.clientserver")

    def log(error):
        try:
            raise error
        except Exception:
            record = logger.makeRecord(logger.name, logging.ERROR, py4j.clientserver.__file__, 504,
                                       "Exception occurred while shutting down connection", (), sys.exc_info())
        logger.handle(record)

    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    try:
        with Py4JQuiet():
            try:
                raise KeyboardInterrupt()
            except KeyboardInterrupt:
                log(BrokenPipeError(32, "Broken pipe"))  # raised while the interrupt was handled: its context
            log(ConnectionResetError(104, "reset"))  # no interrupt behind it: kept
    finally:
        logging.getLogger().removeHandler(handler)
    err = capsys.readouterr().err
    assert "BrokenPipeError" not in err and "ConnectionResetError" in err, err
