"""Helpers of the Spark tests: run a training driver (or several runs in one), read its log as it goes; the fault harness."""

import contextlib
import fcntl
import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from conftest import ROOT

# tools/chaos.py, the fault harness (workers connected to the exchanger, killed at seeded moments), by its path:
# bench/ has a chaos.py of its own.
_spec = importlib.util.spec_from_file_location("tools_chaos", os.path.join(ROOT, "tools", "chaos.py"))
chaos = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chaos  # for its dataclasses
_spec.loader.exec_module(chaos)


def final_accuracy(log):
    values = re.findall(r"Test net output #0: accuracy = ([\d.]+)", log)
    assert values, log[-3000:]
    return float(values[-1])


def start_training(solver, *flags):
    return subprocess.Popen([sys.executable, "-m", "deepspark.cli", "train", "--solver", solver, *flags],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)


def read_until(process, pattern, timeout=300):
    """Lines of the process's stderr up to and including the first that matches."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"never saw {pattern!r}:\n" + "".join(lines[-40:]))


# Runs each solver in turn in one driver process and one SparkSession; a JSON line per summary on stdout.
RUNS = """
import json, sys
import deepspark
from deepspark.config import load_solver, override
from deepspark.spark.session import spark_session
knobs, solvers = json.loads(sys.argv[1]), sys.argv[2:]
ds = override(load_solver(solvers[0]), **knobs).param.deepspark_param
spark, _ = spark_session(ds, ds.workers)
try:
    for solver in solvers:
        print(json.dumps(deepspark.train(solver, **knobs).summary), flush=True)
finally:
    spark.stop()
"""


def start_runs(solvers, **knobs):
    """Train each solver in turn (knobs: DeepSparkParameter fields, as deepspark.train takes them) in one
    driver process and one SparkSession, so that a later run skips the session's start and finds its
    Python workers with TensorFlow loaded. Each run's log is its output folder's train.log; the process's
    stdout holds each run's summary as a JSON line."""
    return subprocess.Popen([sys.executable, "-c", RUNS, json.dumps(knobs), *solvers], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT},
                            start_new_session=True)


def kill_while_training(driver, train_log, max_iter, kills, seed, window, timeout, wait, say=None, **options):
    """tools/chaos.py's harness on `driver`'s job (a process from start_runs or start_training, its log at
    `train_log`): `kills` seeded kills within `window` (fractions of max_iter), the harness giving up after
    `timeout` s, the driver awaited `wait` s (options: the harness's others: picks); (stdout, stderr, the
    harness's kills). A driver still running at the end, however it ends, is killed with its process group."""
    harness = chaos.Chaos(None, kills, seed, log=chaos.DriverLog(str(train_log), max_iter), window=window,
                          ended=lambda: driver.poll() is not None, timeout=timeout, say=say, **options)
    try:
        harness.start()
        stdout, stderr = driver.communicate(timeout=wait)
        return stdout, stderr, harness.join(10)
    finally:
        harness.stop()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)

def train_with_straggler(solver, *flags, share=0.1, go=None):
    """Train `solver` in a driver of its own (start_training), the first worker to connect to its exchanger held to
    `share` of the wall clock (chaos.Throttle); with `go`, a file written once the throttle holds it, for a net
    whose workers wait for it before their first step (a job shorter than the throttle's look at /proc under load
    can end unheld). (the driver's return code, its log, the pid of the worker held: None if none was). A driver
    still running at the end, however it ends, is killed."""
    driver = start_training(solver, *flags)
    throttle = None
    try:
        seen = read_until(driver, r"Exchanger listening on ")
        port = int(re.search(r"Exchanger listening on [\d.]+:(\d+)", seen[-1]).group(1))
        throttle = chaos.Throttle(port, share=share, ended=lambda: driver.poll() is not None, timeout=120).start()
        if go is not None:
            def release():
                if throttle.holding.wait(120):
                    pathlib.Path(go).touch()
            threading.Thread(target=release, daemon=True).start()
        _, stderr = driver.communicate(timeout=600)
    finally:
        if throttle is not None:
            throttle.stop()
        if driver.poll() is None:
            driver.send_signal(signal.SIGKILL)
            driver.wait()
    return driver.returncode, "".join(seen) + stderr, throttle.pid


def workers_done(log):
    return sorted(int(w) for w in re.findall(r"Worker (\d+) on \S+ \(in [^)]*\): \d+ iterations", log))


def free_ports(count):
    """The first of `count` consecutive loopback ports that are free now (a cluster left running by another
    run keeps its own ports, and this one does not join it)."""
    for base in range(17000, 30000, 97):
        probes = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no free loopback ports")


@contextlib.contextmanager
def machine_lock(name):
    """Held by one test of all the test runs on this machine at a time (an flock on a file in the temporary folder):
    for what takes a port or a name that every run would take."""
    with open(os.path.join(tempfile.gettempdir(), f"deepspark-test-{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def cluster(folder, hide=None, gpus=0):
    """tools/spark-cluster.sh's master and two workers on free ports, in folder/cluster; `hide`: a folder
    the workers must not see; `gpus`: GPU addresses each worker offers (GPUS). Yields (master URL, cluster
    folder)."""
    script = os.path.join(ROOT, "tools", "spark-cluster.sh")
    # Another test run on this machine (a second checkout's `make test`) picks its ports only once this cluster has
    # bound its own: free_ports alone lets two runs probe the same free ports at once.
    with machine_lock("cluster-ports"):
        base = free_ports(4)  # the master, its web UI, and the two workers' web UIs after it
        env = {**os.environ, "CLUSTER_DIR": str(folder / "cluster"), "SPARK_MASTER_PORT": str(base),
               "SPARK_MASTER_WEBUI_PORT": str(base + 1), "VENV": os.path.dirname(os.path.dirname(sys.executable)),
               "HIDE_FROM_WORKERS": str(hide or ""), "GPUS": str(gpus)}
        started = subprocess.run(["bash", script, "start"], env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"spark://127.0.0.1:{base}", folder / "cluster"
    finally:
        subprocess.run(["bash", script, "stop"], env=env, capture_output=True, timeout=120)
