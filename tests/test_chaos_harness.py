"""The fault harness itself (tools/chaos.py), on a real loopback listener and real client processes it kills or throttles: a rejoin is a new connection, or the driver's line for a victim that comes and goes between two looks; kills on the clock (--every); a straggler held to its share.

A rejoin is a new connection, or, for a victim that comes back with nothing left to train and leaves again between
two looks at /proc, the driver's `Worker N rejoined the exchanger` line; with neither, no rejoin is claimed."""

import os
import socket
import subprocess
import sys
import time

import pytest

from sparkjobs import chaos

CLIENT = "import socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); time.sleep(60)"


@pytest.fixture
def exchanger():
    """A listening socket that accepts every connection (its port), and the accepted sockets, closed at the end."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    accepted = []

    def accept():
        try:
            accepted.append(listener.accept()[0])
        except TimeoutError:
            pass

    yield listener.getsockname()[1], accept
    for conn in accepted:
        conn.close()
    listener.close()


def one_kill(tmp_path, port, accept, rejoin_line):
    """A worker process connected to `port`, a log past the kill's moment; the harness's one kill, and after it
    the log's rejoin line (if `rejoin_line`) and a display, with no new connection; (the Kill, the harness's lines)."""
    path = tmp_path / "train.log"
    path.write_text(f"I1205 Exchanger listening on 127.0.0.1:{port}; 2 workers\n")
    worker = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)])
    try:
        deadline = time.monotonic() + 30
        while not chaos.exchanger_clients(port) and time.monotonic() < deadline:
            accept()
        with open(path, "a") as log:
            log.write("I1205 12:00:00.000 1 center.py:130] Iteration 400, loss = 1.5\n")
        said = []
        harness = chaos.Chaos(None, 1, 0, log=chaos.DriverLog(str(path), 1000), window=(0.1, 0.2), timeout=3,
                              say=said.append).start()
        deadline = time.monotonic() + 10
        while worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.returncode == -9, said  # SIGKILLed by the harness
        if rejoin_line:
            with open(path, "a") as log:
                log.write("W1205 12:00:01.000 1 watch.py:167] Worker 0 rejoined the exchanger (connection 2); it goes "
                          "on from the center at iteration 400\n")
            time.sleep(0.5)  # the harness sees the rejoin, then waits for the job to train again
            with open(path, "a") as log:
                log.write("I1205 12:00:01.500 1 center.py:130] Iteration 420, loss = 1.4\n")
        return harness.join(15)[0], said
    finally:
        worker.kill()
        worker.wait()


def test_a_victim_that_comes_and_goes_counts_as_rejoined_by_the_drivers_line(tmp_path, exchanger):
    kill, said = one_kill(tmp_path, *exchanger, rejoin_line=True)
    assert kill.number == 1 and kill.iteration == 400 and kill.rejoined_at is not None, said
    assert said[-1].startswith("chaos: a worker rejoined"), said


def test_without_a_new_connection_or_the_line_no_rejoin_is_claimed(tmp_path, exchanger):
    kill, said = one_kill(tmp_path, *exchanger, rejoin_line=False)
    assert kill.rejoined_at is None and said[-1] == "chaos: no worker rejoined after kill 1", said


def connected(port, accept, count, timeout=30):
    """Accept until `count` processes are connected to `port`."""
    deadline = time.monotonic() + timeout
    while len(chaos.exchanger_clients(port)) < count and time.monotonic() < deadline:
        accept()
    return chaos.exchanger_clients(port)


def test_every_n_seconds_kills_on_the_clock_until_the_job_ends(exchanger):
    """--every: a kill each period from the first connection, each replaced at once by a new process here; the
    harness stops when the job ends."""
    port, accept = exchanger
    workers = [subprocess.Popen([sys.executable, "-c", CLIENT, str(port)])]
    ended = []
    try:
        connected(port, accept, 1)
        harness = chaos.Chaos(port, None, 0, every=0.5, ended=lambda: bool(ended), timeout=10).start()
        for _ in range(3):  # each victim's replacement
            deadline = time.monotonic() + 10
            while workers[-1].poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            workers.append(subprocess.Popen([sys.executable, "-c", CLIENT, str(port)]))
            connected(port, accept, 1)
        ended.append(True)
        kills = harness.join(10)
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert [w.returncode for w in workers[:3]] == [-9] * 3 and len(kills) >= 3, kills
    gaps = [b.at - a.at for a, b in zip(kills, kills[1:])]
    assert all(gap >= 0.45 for gap in gaps), gaps


def test_a_throttled_worker_runs_a_share_of_the_time_and_runs_on_after(exchanger):
    port, accept = exchanger
    # It opens and closes a file as it spins, as a worker reading its data does: an fd closed between the harness's
    # listing of its fds and its look at each is not the worker leaving the exchanger.
    spin = ("import os, socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
            "end = time.monotonic() + 60\nwhile time.monotonic() < end: os.close(os.open(os.devnull, os.O_RDONLY))")
    worker = subprocess.Popen([sys.executable, "-c", spin, str(port)])
    try:
        connected(port, accept, 1)
        throttle = chaos.Throttle(port, share=0.25, period=0.2).start()
        assert throttle.holding.wait(30) and throttle.pid == worker.pid
        time.sleep(0.5)
        before = cpu_seconds(worker.pid)
        time.sleep(2.0)
        share = (cpu_seconds(worker.pid) - before) / 2.0
        throttle.stop()
        assert throttle.pid == worker.pid and share < 0.45, share  # stopped 3/4 of the time; unthrottled, a core
        assert throttle.released == "stopped" and throttle.held >= 2.0, (throttle.released, throttle.held)
        before = cpu_seconds(worker.pid)
        time.sleep(1.0)
        assert cpu_seconds(worker.pid) - before > 0.05  # SIGCONT at the end: it runs on
    finally:
        worker.kill()
        worker.wait()


def cpu_seconds(pid):
    """User and system CPU seconds of process `pid`, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
