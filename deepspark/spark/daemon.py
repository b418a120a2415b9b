"""The executors' pyspark daemon (spark.python.daemon.module): pyspark's own, with the jobs' modules and the job's backend imported before it forks the Python workers; and in local mode its zygote, which imports them while Spark's JVM starts.

A Python worker that Spark starts for a task is a fork of this daemon, so it
starts with deepspark's jobs (which a task's closure names) and TensorFlow
already imported, once for all of them, and shares that import's pages with the
daemon (copy-on-write) instead of holding its own. So does the Python worker
Spark starts for a retried task (a lost worker's replacement): it rejoins
without importing TensorFlow again, on a cluster's executor as in local mode. Both
are imported here (`preload`: the jobs, JOBS, then the backend); the package
deepspark.spark, which `python -m` imports first, names its API lazily, so that a
launched daemon reaches its hand-over (below) without them. Nothing here may start a
thread or TensorFlow's runtime: the workers are forks.

In local mode the JVM launches the daemon only once its SparkContext is up, and the import
then takes seconds on the cores the job's start needs. So a local job's driver
starts a zygote first (`start_zygote`, before the JVM): `python -m
deepspark.spark.daemon --zygote PATH` imports the backend while the JVM starts,
and waits on a Unix socket at PATH, in a folder only this user can open. The
daemon the JVM launches hands it its standard streams (the JVM's pipes), its
environment, folder and arguments (`hand_over`); the zygote forks, and its fork
runs pyspark's daemon on them with everything imported. The launched process
stays the JVM's daemon process: it becomes a waiter of a few megabytes that
passes SIGTERM (the JVM's stop) on and exits when the daemon does. Without a
zygote, or when it does not answer, the launched process imports and runs
the daemon itself, as before.
"""

import contextlib
import gc
import importlib
import json
import os
import select
import socket
import struct
import sys

from pyspark import daemon

from deepspark.backends import backend_module, defer_keras
from deepspark.spark.session import DAEMON_BACKEND, PRELOADED, ZYGOTE, remove_zygote_socket

JOBS = "deepspark.spark.job"  # the jobs and the executor's loop (which every task's closure names), with their imports
HEADER = struct.Struct("!Q")  # the length of the hand-over's JSON, sent with the three descriptors
STREAMS = (0, 1, 2)
HAND_OVER_SECONDS = 60  # how long a launched daemon waits on the zygote (its backend import) before running alone
# What the launched daemon process becomes once the zygote's fork runs the daemon (argv: the marker, the pid).
WAITER = """import os, select, signal, sys
pid = int(sys.argv[2])
def stop(*_):
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        pass
signal.signal(signal.SIGTERM, stop)
try:
    select.select([os.pidfd_open(pid)], [], [])
except OSError:
    pass
"""
WAITER_MARK = "deepspark-daemon-waiter"


def preload(backend):
    """Import the jobs (JOBS) and backend `backend` if it is one of PRELOADED, with stdout pointed at stderr
    meanwhile: the daemon's stdout is its channel to the JVM. A backend that does not import is left to the task that
    needs it, whose error names it. Then freeze what is loaded, so that the collector does not write to the pages the
    forks share."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        importlib.import_module(JOBS)
        if backend in PRELOADED:
            defer_keras()  # its forks, the Python workers, are DeepSpark's own
            with contextlib.suppress(Exception):  # a task that imports it says why
                backend_module(backend)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    gc.freeze()


def hand_over(path):
    """Give this process's standard streams, environment, folder and arguments to the zygote at `path`; the pid of
    the daemon it forked for them, or None when there is no zygote there, or it did not answer within
    HAND_OVER_SECONDS (its import included). The zygote forks only on this process's "go", sent once it is ready:
    a hand-over given up here never leaves a second daemon on the JVM's pipes."""
    payload = json.dumps({"environ": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv}).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as link:
            link.settimeout(HAND_OVER_SECONDS)
            link.connect(path)
            socket.send_fds(link, [HEADER.pack(len(payload))], list(STREAMS))
            link.sendall(payload)
            answers = link.makefile("rb")
            if answers.readline() != b"ready\n":
                return None
            link.sendall(b"go\n")
            answer = answers.readline()
        return int(answer) if answer.strip() else None
    except (OSError, ValueError):
        return None


def zygote(path):
    """Listen at `path`, import the backend meanwhile (a daemon launched sooner waits in the backlog), then serve
    one hand-over: fork the daemon with the streams, environment and folder handed over, answer its pid, and wait
    for it (it stays this process's child, in the driver's process tree). Exits when the driver closes this
    process's stdin first. A driver that died first (SIGKILL) never removes the folder (session.close_zygote):
    this process does, as it exits; and once it took its hand-over (the folder's only use), it removes the folder
    itself, for a driver whose SparkContext stopped other than by session.stop_context (a pyspark.ml script's
    spark.stop())."""
    driver = os.getppid()
    try:
        serve_hand_over(path)
    finally:
        if os.getppid() != driver:  # orphaned: the driver is gone
            remove_zygote_socket(path)


def serve_hand_over(path):
    """zygote's work: listen, import, take one hand-over and fork its daemon, and wait for it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        preload(os.environ.get(DAEMON_BACKEND))
        if listener not in select.select([listener, sys.stdin], [], [])[0]:  # the driver is done with this zygote
            return
        link, _ = listener.accept()
    remove_zygote_socket(path)  # its only use is over; the driver may have removed it meanwhile (close_zygote)
    with link:
        link.settimeout(HAND_OVER_SECONDS)
        message, fds, _, _ = socket.recv_fds(link, HEADER.size, len(STREAMS))
        size, payload = HEADER.unpack(message)[0], b""
        while len(payload) < size:
            chunk = link.recv(size - len(payload))
            if not chunk:
                return  # the launched daemon gave up: it runs the daemon itself
            payload += chunk
        link.sendall(b"ready\n")
        if link.makefile("rb").readline() != b"go\n":
            return
        pid = os.fork()
        if pid == 0:
            link.close()
            become_daemon(fds, json.loads(payload))
        for fd in fds:
            os.close(fd)
        link.sendall(b"%d\n" % pid)
    os.waitpid(pid, 0)


def become_daemon(fds, handed):
    """In the zygote's fork: take the launched daemon's streams, environment, folder and arguments, and run
    pyspark's daemon on them. Never returns."""
    code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, stream in zip(fds, STREAMS):
            os.dup2(fd, stream)
            os.close(fd)
        os.environ.clear()
        os.environ.update(handed["environ"])
        os.chdir(handed["cwd"])
        sys.argv = handed["argv"]
        daemon.manager()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        os._exit(code)


def main():
    if sys.argv[1:2] == ["--zygote"]:
        zygote(sys.argv[2])
        return
    path = os.environ.get(ZYGOTE)
    pid = hand_over(path) if path else None
    if pid is not None:
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", WAITER, WAITER_MARK, str(pid)])
    preload(os.environ.get(DAEMON_BACKEND))
    daemon.manager()


if __name__ == "__main__":
    main()
