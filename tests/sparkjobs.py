"""Helpers of the Spark tests: run a training driver, read its log as it goes, find its workers."""

import os
import re
import signal
import subprocess
import sys
import time

from conftest import ROOT


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


def exchanger_clients(port):
    """pids of the processes with an established TCP connection to the exchanger on `port`: the training
    workers, found through /proc (the socket inodes of /proc/net/tcp*, then each process's fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:  # gone, or not ours to read
            continue
        if links & inodes:
            pids.append(int(pid))
    return sorted(pids)


def train_and_kill_a_worker(solver, *flags):
    """Train, SIGKILL one worker's Python process (one connected to the exchanger) once the log passes
    iteration 100, let the job go on; (exit status, log)."""
    driver = start_training(solver, *flags)
    try:
        lines = read_until(driver, r"Iteration [1-9]\d\d, loss")
        port = int(re.search(r"Exchanger listening on [\d.]+:(\d+)", "".join(lines)).group(1))
        victims = exchanger_clients(port)
        # A worker that started first may have finished already (it said BYE and its process idles):
        # only a connected one is still training.
        assert victims, f"no worker is connected to the exchanger on port {port}"
        os.kill(victims[0], signal.SIGKILL)
        _, log = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    return driver.returncode, log
