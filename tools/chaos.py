#!/usr/bin/env python3
"""Faults for a running job: SIGKILL k of its training workers at seeded random moments spread over the run, or a standalone Spark Worker JVM for good; what was killed, and when.

    python tools/chaos.py --port EXCHANGER_PORT --kills 3 --seed 1 [--delay 2 8]
    python tools/chaos.py --log OUTPUT/train.log --max-iter 10000 --kills 3 --seed 1 [--window 0.1 0.7]
    python tools/chaos.py --port EXCHANGER_PORT --every 15          # a kill every 15 s until the job ends
    python tools/chaos.py --port EXCHANGER_PORT --throttle 0.333    # one worker held to a third of the time

A training worker is a process with an established TCP connection to the job's exchanger
(found through /proc, so on the machine the workers run on: local mode, or this machine's
standalone cluster). Each kill waits for its moment (a fraction of max_iter that the
driver's log reaches, or a delay in seconds), SIGKILLs one connected worker chosen by the
seed, then waits for the rejoin (a connection to the exchanger that was not there before
the kill; with the log, also a progress line after it: the job trains again) before the
next kill, so that every kill hits a worker that trains; or (--every) a kill every N seconds from the first
worker's connection to the job's end, each on the clock whatever the last one's rejoin took. A straggler
(Throttle) is one worker held to a share of the wall clock by SIGSTOP and SIGCONT, as cpulimit does. One
JSON line per kill on stdout. tests/ and bench/chaos.py import this file and run the same harness;
`tools/spark-cluster.sh kill-worker N` is the by-hand way to lose a standalone Worker.
"""

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_SCRIPT = os.path.join(ROOT, "tools", "spark-cluster.sh")
# Seconds between two looks at /proc or the log (each look reads /proc/net/tcp and every process's fds, a few
# milliseconds): a kill lands within a tick of the driver's own progress lines (every 0.5 s).
POLL_SECONDS = 0.05

_ITERATION = re.compile(r"\] Iteration (\d+), loss = ")
_EXCHANGER = re.compile(r"Exchanger listening on [\d.]+:(\d+)")
_REJOINED = re.compile(r"Worker \d+ rejoined the exchanger")


# -- the workers: processes connected to the exchanger --------------------------------------------

def client_sockets(port):
    """{socket inode: the client's port} of the established TCP connections to `port` on this machine: the
    client side of each (its remote port is the exchanger's), from /proc/net/tcp and tcp6."""
    sockets = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:  # no IPv6 here
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                sockets[f"socket:[{fields[9]}]"] = int(fields[1].rsplit(":", 1)[1], 16)
    return sockets


def exchanger_connections(port):
    """{client port: pid} of the processes with an established TCP connection to the exchanger on `port`:
    the training workers (the sockets of client_sockets, then each process's fds)."""
    sockets = client_sockets(port)
    found = {}
    if not sockets:
        return found
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed since the listing (a worker opens and closes files as it reads): not a socket
                continue
            if link in sockets:
                found[sockets[link]] = int(pid)
    return found


def exchanger_clients(port):
    """pids of the processes connected to the exchanger on `port`: the workers that train now (one that
    has finished said BYE, and its Python process idles unconnected)."""
    return sorted(set(exchanger_connections(port).values()))


# -- the job's progress, from the driver's log -----------------------------------------------------

class DriverLog:
    """The driver's train.log, followed as it grows (it need not exist yet): the exchanger's port, the job's
    iteration (the last `Iteration N, loss` line: the slowest worker's), how many such lines came, and how many
    `Worker N rejoined the exchanger` lines."""

    def __init__(self, path, max_iter=None):
        self.path, self.max_iter = path, max_iter
        self.iteration, self.port, self.displays, self.rejoins, self._offset, self._partial = None, None, 0, 0, 0, ""

    def read(self):
        """Take in what the log gained since the last read."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as stream:
                stream.seek(self._offset)
                text = stream.read()
                self._offset = stream.tell()
        except FileNotFoundError:
            return
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            found = _ITERATION.search(line)
            if found:
                self.iteration, self.displays = int(found.group(1)), self.displays + 1
            self.rejoins += bool(_REJOINED.search(line))
            found = self.port is None and _EXCHANGER.search(line)
            if found:
                self.port = int(found.group(1))

    def progress(self):
        """The share of max_iter the job has done, per its log (None before the first line says)."""
        self.read()
        return None if self.iteration is None else self.iteration / self.max_iter

    def wait_for_port(self, timeout, ended=lambda: False):
        """The exchanger's port once the log names it; a TimeoutError after `timeout` seconds or if the job ends."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not ended():
            self.read()
            if self.port is not None:
                return self.port
            time.sleep(POLL_SECONDS)
        raise TimeoutError(f"{self.path} named no exchanger port within {timeout:g}s, or the job ended")


# -- the harness ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Kill:
    """One SIGKILL: its number, the process and its connection's client port, when (time.time()), the job's
    iteration then (per the driver's log, if followed), and when a new connection to the exchanger came."""

    number: int
    pid: int
    client_port: int
    at: float
    iteration: int = None
    rejoined_at: float = None

    @property
    def seconds_to_rejoin(self):
        return None if self.rejoined_at is None else self.rejoined_at - self.at

    def record(self):
        return {**dataclasses.asdict(self), "seconds_to_rejoin": self.seconds_to_rejoin}


class Chaos:
    """`kills` SIGKILLs of the workers connected to the exchanger on `port`, at seeded random moments.

    port      the exchanger's port; None: the one `log` names
    log       the driver's log (a DriverLog with max_iter), or None: kill i waits until the job's
              progress reaches a point drawn in the i-th of `kills` equal slices of `window` (shares
              of max_iter); without it, kill i waits a delay drawn from `delay` (seconds) once a
              worker is connected. A rejoin is a connection that was not there before the kill (or,
              with a log, a rejoin line the driver wrote after it: a victim that had finished
              comes and goes within one look);
              with a log, the next kill also waits for an `Iteration` line after the rejoin: the job
              trains again (a sync job's rounds need every worker back)
    every     seconds: kill a worker every `every` s from the first worker's connection (the job's first
              exchange) until the job ends or `kills` were made (None: no limit), each on the clock; the
              rejoin is awaited only until the next kill's moment, and `log`'s moments are not used
    picks     which worker kill i takes, by its place in the sequence (None, or past its end: any): "survivor",
              one connected since before the last kill (another worker than that victim); "new", one that
              connected since (the victim's replacement), where there is one
    ended     a callable that says the job is over (no more kills, no more waiting)
    timeout   seconds each wait may take (a moment, a connected worker, a rejoin) before the harness
              gives up, with the kills it made
    """

    def __init__(self, port, kills=3, seed=0, *, log=None, window=(0.1, 0.7), delay=(2.0, 8.0),
                 ended=lambda: False, timeout=300.0, say=None, every=None, picks=None):
        self.port, self.log, self.ended, self.timeout = port, log, ended, timeout
        self.every, self.picks, self.survivors = every, list(picks or ()), set()
        self.say = say or (lambda line: None)
        self.rng = random.Random(seed)
        kills = kills or 0
        lo, hi = window
        slice_ = (hi - lo) / max(kills, 1)
        # Stratified, so the kills spread over the run rather than bunch up.
        self.points = [lo + slice_ * (i + self.rng.random()) for i in range(kills)]
        self.delays = [self.rng.uniform(*delay) for _ in range(kills)]
        self.kills = []
        self.stopping = threading.Event()
        self._thread = None

    def run(self):
        """Make the kills (fewer if the job ends first, or a wait times out); the Kills."""
        if self.port is None:
            try:
                self.port = self.log.wait_for_port(self.timeout, self.ended)
            except TimeoutError as error:
                self.say(f"chaos: no kills: {error}")
                return self.kills
        if self.every:
            return self._run_every()
        for number, (point, delay) in enumerate(zip(self.points, self.delays), 1):
            if not self._wait_for_moment(point, delay):
                self.say(f"chaos: kill {number} not made: the job ended or a wait timed out")
                break
            logged = self._rejoin_logged()
            kill, before = self._kill_one(number)
            if kill is None:
                self.say(f"chaos: kill {number} not made: no worker connected to port {self.port}")
                break
            if not self._await_rejoin(kill, before, logged, self.timeout):
                break
            if self.log is not None:  # the job trains again (a sync job's rounds need every worker back)
                self.log.read()
                shown = self.log.displays
                self._wait(lambda: self.log.read() or self.log.displays > shown)
        return self.kills

    def _run_every(self):
        """run() with --every: a kill each `every` seconds from the first worker's connection until the job ends."""
        if self._wait(lambda: client_sockets(self.port)) is None:
            self.say("chaos: no kills: no worker connected, or the job ended")
            return self.kills
        moment = time.monotonic() + self.every
        for number in itertools.count(1):
            if len(self.points) and number > len(self.points):
                break
            if self.stopping.wait(max(moment - time.monotonic(), 0)) or self.ended():
                break
            logged = self._rejoin_logged()
            kill, before = self._kill_one(number)
            if kill is None:
                break
            moment = time.monotonic() + self.every
            self._await_rejoin(kill, before, logged, max(moment - time.monotonic(), 0.1))
        return self.kills

    def _await_rejoin(self, kill, before, logged, timeout):
        """Record `kill`, wait up to `timeout` s for its rejoin, and say both; whether it rejoined."""
        self.kills.append(kill)
        self.say(f"chaos: kill {kill.number}: SIGKILL pid {kill.pid} (client port {kill.client_port})"
                 + (f" at iteration {kill.iteration}" if kill.iteration is not None else ""))
        kill.rejoined_at = self._wait(lambda: set(client_sockets(self.port).values()) - before
                                      or self._rejoin_logged(logged), timeout)
        if kill.rejoined_at is None:
            self.say(f"chaos: no worker rejoined after kill {kill.number}")
            return False
        self.say(f"chaos: a worker rejoined {kill.seconds_to_rejoin:.1f}s after kill {kill.number}")
        return True

    def start(self):
        """run() in a thread; join() waits for it."""
        self._thread = threading.Thread(target=self.run, name="chaos", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout=None):
        self._thread.join(timeout)
        return self.kills

    def stop(self):
        self.stopping.set()

    def _wait(self, condition, timeout=None):
        """time.time() when `condition()` first holds; None if the job ends, stop() or the timeout (`timeout`, else
        the harness's) comes first."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline and not self.stopping.is_set() and not self.ended():
            if condition():
                return time.time()
            time.sleep(POLL_SECONDS)
        return None

    def _rejoin_logged(self, since=None):
        """The log's count of rejoin lines (None: no log); with `since` (an earlier count), whether it grew. A
        victim killed as it finished rejoins, has nothing left to train and leaves again within a look at /proc;
        the driver counts its connections all the same, and says so."""
        if self.log is None:
            return None if since is None else False
        self.log.read()
        return self.log.rejoins if since is None else self.log.rejoins > since

    def _wait_for_moment(self, point, delay):
        if self.log is not None:
            return self._wait(lambda: (self.log.progress() or 0.0) >= point) is not None
        if self._wait(lambda: client_sockets(self.port)) is None:
            return False
        return not self.stopping.wait(delay) and not self.ended()

    def _kill_one(self, number):
        """SIGKILL a connected worker chosen by the seed: (its Kill, the connections' client ports before
        it), or (None, None) if none connects in time."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and self._wait(lambda: client_sockets(self.port)) is not None:
            connected = exchanger_connections(self.port)
            if not connected:  # the one there has just left (or is not ours to see)
                time.sleep(POLL_SECONDS)
                continue
            before = set(client_sockets(self.port).values())
            pick = self.picks[number - 1] if number <= len(self.picks) else None
            chosen = {"survivor": set(connected) & self.survivors, "new": set(connected) - self.survivors}.get(pick)
            client_port = self.rng.choice(sorted(chosen or connected))
            iteration = self.log.iteration if self.log is not None else None
            try:
                os.kill(connected[client_port], signal.SIGKILL)
            except ProcessLookupError:  # it ended in between: look again
                continue
            self.survivors = set(connected) - {client_port}
            return Kill(number, connected[client_port], client_port, time.time(), iteration), before
        return None, None


class Throttle:
    """A straggler: one worker connected to the exchanger on `port` (the first seen) held to `share` of the wall
    clock, SIGCONT for share x `period` s and SIGSTOP for the rest, as cpulimit does, until it leaves the exchanger
    (it finished, or died), the job ends or stop(); then it runs on. `pid` is the worker held (None before), and
    `holding` is set once it is chosen; `held` the seconds from its first hold to its release and `released` why
    it was let go ("left", "died", "ended", "stopped"; None before)."""

    def __init__(self, port, share=1 / 3, period=0.3, ended=lambda: False, timeout=300.0):
        self.port, self.share, self.period, self.ended, self.timeout = port, share, period, ended, timeout
        self.pid, self.stopping, self.holding, self._thread = None, threading.Event(), threading.Event(), None
        self.held, self.released = None, None

    def run(self):
        deadline = time.monotonic() + self.timeout
        while self.pid is None and not self.ended() and not self.stopping.is_set() and time.monotonic() < deadline:
            connected = exchanger_connections(self.port)
            self.pid = connected[min(connected)] if connected else None
            time.sleep(POLL_SECONDS)
        if self.pid is not None:
            self.holding.set()
        start, why = time.monotonic(), None
        try:
            while self.pid is not None and why is None:
                os.kill(self.pid, signal.SIGCONT)
                if self.stopping.wait(self.share * self.period):
                    why = "stopped"
                elif self.ended():
                    why = "ended"
                elif self.pid not in exchanger_clients(self.port):
                    why = "left"
                else:
                    os.kill(self.pid, signal.SIGSTOP)
                    self.stopping.wait((1 - self.share) * self.period)
        except ProcessLookupError:
            why = "died"
        finally:
            if self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGCONT)
                self.held, self.released = round(time.monotonic() - start, 2), why or "stopped"

    def start(self):
        """run() in a thread; stop() ends it."""
        self._thread = threading.Thread(target=self.run, name="throttle", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(10)


# -- a standalone cluster's Worker JVM, for good ---------------------------------------------------

@dataclasses.dataclass
class WorkerKill:
    """A standalone Spark Worker JVM killed for good: its number, pid, the processes it had started
    (executor JVMs, their Python daemons and workers) and when (time.time())."""

    number: int
    pid: int
    descendants: list
    at: float


def descendants(pid):
    """The pids of every process under `pid` (children, theirs, ...), from /proc/*/stat."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return sorted(found)


def alive(pids):
    """Those of `pids` still running (not zombies)."""
    running = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    running.append(pid)
        except OSError:
            pass
    return running


def kill_spark_worker(number, cluster_dir):
    """SIGKILL standalone Worker `number`'s JVM for good (tools/spark-cluster.sh kill-worker: a machine gone,
    as far as Spark can tell); a WorkerKill naming what it had started, which loses its Worker."""
    with open(os.path.join(cluster_dir, f"worker-{number}.pid")) as f:
        pid = int(f.read())
    under = descendants(pid)
    at = time.time()
    done = subprocess.run(["bash", CLUSTER_SCRIPT, "kill-worker", str(number)], capture_output=True, text=True,
                          env={**os.environ, "CLUSTER_DIR": str(cluster_dir)}, timeout=60)
    if done.returncode:
        raise RuntimeError(f"spark-cluster.sh kill-worker {number}: {done.stderr.strip()}")
    return WorkerKill(number, pid, under, at)


# -- by hand -----------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description="SIGKILL k training workers of a running job at seeded random moments, "
                                     "each after the last one's rejoin; a JSON line per kill (a standalone Worker "
                                     "JVM is lost with tools/spark-cluster.sh kill-worker N)")
    parser.add_argument("--port", type=int, help="the exchanger's port (the driver logs 'Exchanger listening on')")
    parser.add_argument("--log", help="the driver's train.log: the port, and the progress the kills are keyed on")
    parser.add_argument("--max-iter", type=int, help="the job's max_iter (with --log)")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=float, nargs=2, default=(0.1, 0.7), metavar=("FROM", "TO"),
                        help="with --log: the shares of max_iter the kills are spread over")
    parser.add_argument("--delay", type=float, nargs=2, default=(2.0, 8.0), metavar=("MIN", "MAX"),
                        help="without --log: seconds from a connected worker (or the last rejoin) to a kill")
    parser.add_argument("--every", type=float, help="a kill every EVERY seconds from the first worker's connection to "
                        "the job's end (--kills caps them; 0: no cap)")
    parser.add_argument("--throttle", type=float, metavar="SHARE", help="no kills: hold the first connected worker "
                        "to SHARE of the wall clock (SIGSTOP/SIGCONT) until it leaves the exchanger")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait may take")
    args = parser.parse_args(argv)
    if args.log and not args.max_iter:
        parser.error("--log needs --max-iter")
    if args.port is None and not args.log:
        parser.error("give --port, or --log to read it from")
    log = DriverLog(args.log, args.max_iter) if args.log else None
    port = args.port if args.port is not None else log.wait_for_port(args.timeout)
    if args.throttle:
        throttle = Throttle(port, args.throttle, timeout=args.timeout)
        throttle.run()
        return 0 if throttle.pid else 1
    chaos = Chaos(port, args.kills, args.seed, log=log, window=args.window, delay=args.delay,
                  timeout=args.timeout, say=lambda line: print(line, file=sys.stderr, flush=True), every=args.every)
    kills = chaos.run()
    for kill in kills:
        print(json.dumps(kill.record()), flush=True)
    if args.every:
        return 0 if kills else 1
    return 0 if len(kills) == args.kills and all(k.rejoined_at for k in kills) else 1


if __name__ == "__main__":
    sys.exit(main())
