"""The exchanger under load (#13): 16 worker processes on loopback, per-client exchanges/s, the server's RSS per connection, and a reconnect loop that must lose nothing; prints JSON lines.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/exchange_load.py [--quick] [--out bench/measured_load.jsonl]

The server is ExchangeServer with the EASGD handler, built as algorithms/easgd.py's row builds it from a default
DeepSparkParameter (moving rate, server factor, idle timeout, integrity tags on), in a Python process of its own so
that /proc/PID/status's VmRSS and VmHWM are its own; it answers this process's requests with JSON lines on its
stdout (nothing from the network is ever unpickled). Per size (bench/exchange.py's SIZES):

load       `--clients` processes each exchange with blocking `exchange()` in a loop for `--seconds`, with no compute
           between exchanges (`--compute-ms` adds a sleep), the most the server can be asked for: per-client
           exchanges/s (min, median, max; starvation shows as a small min/max ratio), the total, and the server's
           RSS idle, with every client connected, after they left, and its peak; bytes per connection =
           (RSS connected − RSS idle) / clients, against the buffers a connection allocates
           (transport.Connection.allocate: the n-float model buffer, and the handler's scratch floats and bools).
reconnect  as many processes, each `--cycles` times: connect, `--per-cycle` exchanges, then leave in turn with BYE,
           by closing the socket between frames without BYE, or by resetting it half-way through an EXCHANGE
           frame; in `--phases` phases, after each of which the server's open connections must return to 0 and its
           threads to their number before, and its RSS is read. Checked: the server's exchange count (total and
           per worker id) equals the clients' completed exchanges exactly, its threads return to their idle
           number, the center holds only finite values, and RSS growth per 100 connections after the first phase
           (which warms the allocator up).

A connection's buffers are mappings of their own (transport.mapped), returned to the kernel when it ends; from
malloc, glibc's per-thread arenas kept them (its dynamic mmap threshold puts model-sized blocks below 32 MB there
once one has been freed): 830-890 MB resident after a GoogLeNet reconnect loop, against 108 MB with every buffer
mapped. Each line says the MALLOC_* settings it ran with (malloc_env), which no longer change that.
"""

import argparse
import json
import multiprocessing as mp
import os
import queue
import select
import socket
import statistics
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import _results  # noqa: E402  (bench/_results.py)
from exchange import HOST, SECRET, SIZES  # noqa: E402  (bench/exchange.py: the same sizes and secret)
from deepspark.exchange import ExchangeClient  # noqa: E402
from deepspark.exchange import protocol as P  # noqa: E402
from deepspark.exchange.transport import byte_view  # noqa: E402

ENDINGS = ("bye", "drop", "mid_frame")
REPLY_SECONDS = 60.0  # the longest the server may take to answer a request (it waits for nothing)


# ---- the server, in a process of its own ---------------------------------------

def _status():
    """This process's VmRSS, VmHWM (KiB) and thread count, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                fields[key] = int(value.split()[0])
    return {"rss_kb": fields["VmRSS"], "hwm_kb": fields["VmHWM"], "threads": fields["Threads"]}


def serve(n):
    """The exchange server as a job runs it, answering one JSON line per request on stdin: status, check, stop."""
    from deepspark import rules
    from deepspark.exchange import ExchangeOptions, ExchangeServer
    from deepspark.proto import deepspark_pb2 as pb
    from deepspark.algorithms import easgd

    ds = pb.DeepSparkParameter()  # the defaults a job runs with
    center = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    server = ExchangeServer(center, SECRET, easgd.handler(ds), host=HOST, options=ExchangeOptions.of(ds)).start()
    del center  # as the job's driver frees the temporaries it built the flat center from
    snapshot = server.pull()  # made (and paged in) now, so the final check adds nothing to RSS

    def reply(record):
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()

    reply({"port": server.address[1], "scratch_floats": server.handler.scratch,
           "moving_rate": ds.moving_rate, "integrity": server.integrity})
    for line in sys.stdin:
        request = line.strip()
        if request == "stop":
            break
        record = dict(_status(), open_connections=server.open_connections, exchanges=server.exchanges,
                      refused=len(server.refused),
                      workers={wid: {k: w[k] for k in ("exchanges", "connections", "connected")}
                               for wid, w in server.stats().items()})
        if request == "check":
            record["center_finite"] = rules.all_finite(server.pull(snapshot))
        reply(record)
    server.stop()


class Server:
    """This side of the server process: start it, ask it, stop it."""

    def __init__(self, n):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", str(n)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": ROOT})
        self.hello = self._read()
        self.port = self.hello["port"]

    def _read(self):
        if not select.select([self.proc.stdout], [], [], REPLY_SECONDS)[0]:
            raise TimeoutError("the exchange server process did not answer in %gs" % REPLY_SECONDS)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the exchange server process ended (status %s)" % self.proc.poll())
        return json.loads(line)

    def ask(self, request="status"):
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        record = self._read()
        record["workers"] = {int(wid): w for wid, w in record["workers"].items()}  # JSON keys are strings
        return record

    def drained(self, timeout=30.0, threads=None):
        """The server's status once its open connections are back to 0 and, given `threads`, its threads back to
        that many, and the seconds that took. A connection's buffers live as long as its thread, which ends a
        little after the connection stops counting: on a loaded machine an RSS read in between (CI run K) held one
        connection's buffers, 5-6 MB for LeNet."""
        started = time.monotonic()
        while True:
            status = self.ask()
            done = status["open_connections"] == 0 and (threads is None or status["threads"] <= threads)
            if done or time.monotonic() - started > timeout:
                return status, time.monotonic() - started
            time.sleep(0.05)

    def stop(self):
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


# ---- the clients, one process each -------------------------------------------------

def _client(body, wid, results, barrier, *args):
    """Run body(wid, barrier, *args) and put its dict (or its error) on `results`; a failure breaks the barrier
    so that no one waits for this process."""
    try:
        results.put(dict(worker=wid, **body(wid, barrier, *args)))
    except BaseException as e:  # handed to the parent, which fails the run with it
        barrier.abort()
        results.put({"worker": wid, "error": "%s: %s" % (type(e).__name__, e)})


def _load_client(wid, barrier, port, n, seconds, compute):
    client = ExchangeClient((HOST, port), SECRET, wid)
    x = np.random.default_rng(wid).standard_normal(n).astype(np.float32)
    client.exchange(x)  # connected, buffers paged in, before anyone is timed
    barrier.wait(REPLY_SECONDS + seconds)
    k, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        client.exchange(x, iteration=k)
        k += 1
        if compute:
            time.sleep(compute)
    elapsed = time.perf_counter() - started
    barrier.wait(REPLY_SECONDS + seconds)  # everyone done and still connected: the server's RSS is read now
    barrier.wait(REPLY_SECONDS)
    client.close()
    return {"timed": k, "seconds": elapsed, "exchanges": client.exchanges, "reconnects": client.reconnects}


def _leave(client, ending, x):
    """End a connection as a worker can: BYE; the socket closed between frames without BYE; or half an EXCHANGE
    frame sent, then the socket reset (SO_LINGER 0: RST, as when a process dies with data in flight)."""
    if ending == "bye":
        client.close()
        return
    # The abrupt endings need the client's socket, which its API keeps to itself on purpose.
    sock = client._sock
    if ending == "mid_frame":
        client._conn.send(P.EXCHANGE, byte_view(x)[:2 * x.size], length=4 * x.size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _reconnect_client(wid, barrier, port, n, cycles, phases, per_cycle):
    x = np.random.default_rng(wid).standard_normal(n).astype(np.float32)
    done, reconnects, endings = 0, 0, dict.fromkeys(ENDINGS, 0)
    for phase in range(phases):
        for cycle in range(phase * cycles // phases, (phase + 1) * cycles // phases):
            client = ExchangeClient((HOST, port), SECRET, wid)
            for i in range(per_cycle):
                client.exchange(x, iteration=i)
            ending = ENDINGS[(wid + cycle) % len(ENDINGS)]  # every phase holds all three
            _leave(client, ending, x)
            done += client.exchanges
            reconnects += client.reconnects
            endings[ending] += 1
        barrier.wait(REPLY_SECONDS * cycles)  # the phase is over: the parent reads the server
        barrier.wait(REPLY_SECONDS)
    return {"exchanges": done, "reconnects": reconnects, "endings": endings}


def _warm_up_client(wid, barrier, port, n):
    client = ExchangeClient((HOST, port), SECRET, wid)
    client.exchange(np.zeros(n, np.float32))
    client.close()
    return {}


def _run_clients(body, clients, args, steps, pause):
    """Start `clients` processes running body; at each of their `steps` barriers call pause(step) (the parent is the
    barrier's last party, so the clients wait on it); their dicts, by worker id."""
    ctx = mp.get_context("fork")  # cheap; the parent holds no threads and no server
    barrier, results = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(body, wid, results, barrier, *args), daemon=True)
             for wid in range(clients)]
    try:
        for p in procs:
            p.start()
        for step in range(steps):
            barrier.wait(REPLY_SECONDS * 20)
            pause(step)
        out = [results.get(timeout=REPLY_SECONDS) for _ in procs]
        for p in procs:
            p.join(REPLY_SECONDS)
    except BaseException:
        barrier.abort()
        errors = []
        try:
            while True:  # what the failed clients said, once they have said it
                errors.append(results.get(timeout=5.0))
        except queue.Empty:
            pass
        raise RuntimeError("a client failed: %s" % [e for e in errors if "error" in e]) from None
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    failed = [r for r in out if "error" in r]
    if failed:
        raise RuntimeError("clients failed: %s" % failed)
    return {r["worker"]: r for r in out}


# ---- the figures -------------------------------------------------------------------

def _mb(kb):
    return round(kb / 1024, 1)


def load(server, n, clients, seconds, compute_ms):
    """Per-client exchanges/s of `clients` processes exchanging at once, and the server's RSS per connection."""
    # One connection and exchange first: what the server allocates once, on its first sealed exchange (~1.5 MB,
    # the same after 1 client as after 64), is not what the clients leave behind, which is what idle is kept for.
    _run_clients(_warm_up_client, 1, (server.port, n), 0, None)
    server.drained()
    idle = server.ask()
    seen = {}

    def pause(step):
        if step == 1:  # timed loops over, every client still connected
            seen["connected"] = server.ask()

    got = _run_clients(_load_client, clients, (server.port, n, seconds, compute_ms / 1e3), 3, pause)
    after, drain_seconds = server.drained(threads=idle["threads"])
    connected = seen["connected"]
    rates = sorted(r["timed"] / r["seconds"] for r in got.values())
    wall = max(r["seconds"] for r in got.values())
    scratch = server.hello["scratch_floats"]
    # What Connection.allocate gives each connection: the model buffer, and the handler's scratch floats and bools.
    allocated = 4 * n + 5 * scratch
    per_connection = 1024 * (connected["rss_kb"] - idle["rss_kb"]) / clients
    return {
        "figure": "load", "floats": n, "clients": clients, "seconds": seconds, "compute_ms": compute_ms,
        "integrity": server.hello["integrity"],
        "per_client_exchanges_per_s": {"min": round(rates[0], 2), "median": round(statistics.median(rates), 2),
                                       "max": round(rates[-1], 2)},
        "min_max_ratio": round(rates[0] / rates[-1], 3),
        "total_exchanges_per_s": round(sum(r["timed"] for r in got.values()) / wall, 1),
        "server_counted_all": after["exchanges"] - idle["exchanges"] == sum(r["exchanges"] for r in got.values()),
        "client_reconnects": sum(r["reconnects"] for r in got.values()),
        "server_rss_mb": {"idle": _mb(idle["rss_kb"]), "connected": _mb(connected["rss_kb"]),
                          "after": _mb(after["rss_kb"]), "peak": _mb(connected["hwm_kb"])},
        "server_open_connections": {"connected": connected["open_connections"], "after": after["open_connections"]},
        "server_threads": {"idle": idle["threads"], "connected": connected["threads"], "after": after["threads"]},
        "bytes_per_connection": round(per_connection),
        "connection_buffer_bytes": allocated,
        "ratio_to_buffers": round(per_connection / allocated, 3),
        "model_buffer_bytes": 4 * n,
        "ratio_to_model_buffer": round(per_connection / (4 * n), 3),
        "drain_seconds": round(drain_seconds, 2),
    }


def reconnect(server, n, clients, cycles, phases, per_cycle):
    """The reconnect loop: nothing lost or counted twice, no connection or thread left, RSS flat per connection."""
    before = server.drained()[0]
    ends = []

    def pause(step):
        ends.append(server.drained(threads=before["threads"]))

    got = _run_clients(_reconnect_client, clients, (server.port, n, cycles, phases, per_cycle), 2 * phases,
                       lambda step: step % 2 == 0 and pause(step))
    final = server.ask("check")
    rss = [status["rss_kb"] for status, _ in ends]
    connections = clients * cycles
    # Connections made by the end of each phase; RSS's trend over them after the first phase, which warms
    # glibc's per-thread arenas up (freed buffers stay in them, so RSS moves up and down between phases).
    made = [clients * ((phase + 1) * cycles // phases) for phase in range(phases)]
    growth = np.polyfit(made[1:], rss[1:], 1)[0] * 100 if phases > 2 else None
    exchanges = sum(r["exchanges"] for r in got.values())
    per_worker = {wid: final["workers"][wid]["exchanges"] - before["workers"].get(wid, {}).get("exchanges", 0)
                  for wid in got}
    endings = {e: sum(r["endings"][e] for r in got.values()) for e in ENDINGS}
    return {
        "figure": "reconnect", "floats": n, "processes": clients, "cycles_per_process": cycles,
        "exchanges_per_cycle": per_cycle, "connections": connections, "endings": endings,
        "client_exchanges": exchanges, "server_exchanges": final["exchanges"] - before["exchanges"],
        "counts_match": final["exchanges"] - before["exchanges"] == exchanges,
        "per_worker_counts_match": all(per_worker[wid] == got[wid]["exchanges"] for wid in got),
        "client_reconnects": sum(r["reconnects"] for r in got.values()),
        "open_connections_after_each_phase": [status["open_connections"] for status, _ in ends],
        "drain_seconds_max": round(max(seconds for _, seconds in ends), 2),
        "threads": {"before": before["threads"], "after": final["threads"]},
        "server_rss_mb_before": _mb(before["rss_kb"]),
        "server_rss_mb_after_each_phase": [_mb(kb) for kb in rss],
        "rss_growth_kb_per_100_connections": None if growth is None else round(growth, 1),
        "rss_spread_mb_after_first_phase": _mb(max(rss[1:]) - min(rss[1:])) if phases > 1 else None,
        "rss_last_minus_first_phase_mb": _mb(rss[-1] - rss[0]),
        "server_peak_rss_mb": _mb(final["hwm_kb"]),
        "refused": final["refused"] - before["refused"],
        "center_finite": final["center_finite"],
    }


def run(name, clients, seconds, cycles, phases, per_cycle, compute_ms=0.0):
    """Both figures for one size, against one server process: the load first, then the reconnect loop."""
    n = SIZES[name]
    server = Server(n)
    try:
        first = load(server, n, clients, seconds, compute_ms)
        second = reconnect(server, n, clients, cycles, phases, per_cycle)
    finally:
        server.stop()
    # glibc's malloc settings decide what RSS keeps of freed buffers (see the reconnect figure), so they are said.
    malloc = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    return [dict(bench="exchange_load", model=name, **first, malloc_env=malloc),
            dict(bench="exchange_load", model=name, **second, malloc_env=malloc)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=int, metavar="FLOATS", help=argparse.SUPPRESS)  # the server process
    ap.add_argument("--sizes", default="lenet,googlenet")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", default="15,20", help="timed exchanges per client, per size (in --sizes order)")
    ap.add_argument("--compute-ms", type=float, default=0.0, help="sleep between a client's exchanges")
    ap.add_argument("--cycles", default="48,12", help="reconnect cycles per process, per size (in --sizes order)")
    ap.add_argument("--phases", type=int, default=4, help="reconnect phases: RSS and open connections after each")
    ap.add_argument("--per-cycle", default="3,1", help="exchanges per connection in the reconnect loop, per size")
    ap.add_argument("--quick", action="store_true", help="4 clients, LeNet size, 2 s, 12 cycles in 3 phases")
    ap.add_argument("--smoke", action="store_true",
                    help="runs end to end only (make bench-smoke): 2 clients, LeNet size, 0.5 s, 6 cycles in 3 phases")
    ap.add_argument("--out", default=_results.results_path("exchange_load"))
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    if args.smoke:
        args.sizes, args.clients, args.seconds, args.cycles, args.phases, args.per_cycle = "lenet", 2, "0.5", "6", 3, "1"
    elif args.quick:
        args.sizes, args.clients, args.seconds, args.cycles, args.phases, args.per_cycle = "lenet", 4, "2", "12", 3, "3"
    sizes = args.sizes.split(",")

    def per_size(values, kind):
        values = [kind(v) for v in values.split(",")]
        return values + values[-1:] * (len(sizes) - len(values))  # the last one for the sizes not given one

    for name, seconds, cycles, per_cycle in zip(sizes, per_size(args.seconds, float), per_size(args.cycles, int),
                                                per_size(args.per_cycle, int)):
        for record in run(name, args.clients, seconds, cycles, args.phases, per_cycle, args.compute_ms):
            _results.emit(record, args.out)


if __name__ == "__main__":
    main()
