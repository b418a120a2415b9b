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


def training_workers(driver_pid):
    """pids of the Python worker processes under this driver (pyspark.daemon's children), the largest
    first: a training worker holds a backend (hundreds of MB), an idle Python worker a few dozen."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,rss,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    rows = [line.split(None, 3) for line in out]
    children, rss = {}, {}
    for pid, ppid, size, args in rows:
        children.setdefault(int(ppid), []).append((int(pid), args))
        rss[int(pid)] = int(size)
    tree, frontier = [], [driver_pid]
    while frontier:
        pid = frontier.pop()
        for child, args in children.get(pid, []):
            tree.append((child, args))
            frontier.append(child)
    daemons = {pid for pid, args in tree if "pyspark.daemon" in args}
    workers = [pid for pid, args in tree if "pyspark.daemon" in args and
               any(pid == child for d in daemons for child, _ in children.get(d, []))]
    return sorted(workers, key=lambda pid: -rss[pid])


def train_and_kill_a_worker(solver, *flags):
    """Train, SIGKILL one worker's Python process once the log passes iteration 100, let the job go on;
    (exit status, log)."""
    driver = start_training(solver, *flags)
    try:
        read_until(driver, r"Iteration [1-9]\d\d, loss")
        victims = training_workers(driver.pid)
        assert victims, "no pyspark worker process found"
        os.kill(victims[0], signal.SIGKILL)
        _, log = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    return driver.returncode, log
