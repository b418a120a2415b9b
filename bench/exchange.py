"""Benchmark of the ParameterExchanger on loopback, against a raw-socket echo and a pickle-over-socket exchange; prints JSON lines."""

import argparse
import json
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from deepspark.exchange import ExchangeClient, ExchangeServer  # noqa: E402

HOST = "127.0.0.1"
SECRET = b"bench-secret"
SIZES = {"lenet": 431_080, "googlenet": 6_998_552, "25M": 25_000_000}
ALPHA = 0.5


# ---- baseline peers (each in its own process, like the driver and an executor) ----

def _recv_exact(sock, view):
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("closed")
        got += k


def _listen():
    ls = socket.create_server((HOST, 0))
    return ls, ls.getsockname()[1]


def _echo_server(n, pipe):
    """Raw-socket echo of the same bytes: recv_into a preallocated buffer, sendall it back."""
    ls, port = _listen()
    pipe.send(port)
    sock, _ = ls.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(4 * n))
    try:
        while True:
            _recv_exact(sock, view)
            sock.sendall(view)
    except (ConnectionError, OSError):
        pass


def _recv_pickled(sock):
    # Elephas-style: a length prefix, then the pickle read in pieces and joined.
    head = bytearray(8)
    _recv_exact(sock, memoryview(head))
    (left,) = struct.unpack("<Q", head)
    parts = []
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError("closed")
        parts.append(part)
        left -= len(part)
    return pickle.loads(b"".join(parts))


def _send_pickled(sock, obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _pickle_server(n, pipe):
    """The same EASGD exchange with pickled numpy arrays over a socket (Elephas-style)."""
    ls, port = _listen()
    pipe.send(port)
    sock, _ = ls.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    center = np.zeros(n, dtype=np.float32)
    try:
        while True:
            x = _recv_pickled(sock)
            d = np.float32(ALPHA) * (x - center)
            center += d
            _send_pickled(sock, d)
    except (ConnectionError, OSError):
        pass


def _easgd_server(n, pipe):
    server = ExchangeServer(np.zeros(n, dtype=np.float32), SECRET, ALPHA).start()
    pipe.send(server.address[1])
    pipe.recv()  # until told to stop
    pipe.send(server.exchanges)
    server.stop()


# Where the peers run. On a small machine the scheduler sometimes puts a ping-pong pair
# on one CPU and sometimes on two, and the figures flip with it (on 2 cores: echo
# ~2,700 vs ~1,600 LeNet round trips/s). "same" and "apart" pin every peer — echo,
# pickle and exchange alike — so that each regime can be measured on purpose.
CPUS = None  # None: the scheduler decides; else (client cpus, server cpus)


def _pinned(target, cpus, *args):
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before the server makes its threads, so they inherit it
    target(*args)


def _spawn(target, n):
    ours, theirs = mp.Pipe()
    proc = mp.Process(target=_pinned, args=(target, CPUS and CPUS[1], n, theirs), daemon=True)
    proc.start()
    return proc, ours, ours.recv()


# ---- clients -----------------------------------------------------------------

def _rate(fn, seconds, max_rounds, min_rounds=3):
    """Round trips per second of fn, bounded in time and count."""
    fn()  # warm-up: page in buffers, grow socket windows
    k, t0 = 0, time.perf_counter()
    while k < max_rounds and (k < min_rounds or time.perf_counter() - t0 < seconds):
        fn()
        k += 1
    return k / (time.perf_counter() - t0)


def roundtrips(n, seconds, reps):
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    procs = []

    echo_proc, _, port = _spawn(_echo_server, n)
    echo = socket.create_connection((HOST, port))
    echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = memoryview(bytearray(4 * n))
    xview = memoryview(x).cast("B")

    def echo_rt():
        echo.sendall(xview)
        _recv_exact(echo, back)

    pk_proc, _, port = _spawn(_pickle_server, n)
    pk = socket.create_connection((HOST, port))
    pk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    xp = x.copy()

    def pickle_rt():
        _send_pickled(pk, xp)
        xp.__isub__(_recv_pickled(pk))

    ex_proc, ex_pipe, port = _spawn(_easgd_server, n)
    client = ExchangeClient((HOST, port), SECRET, 0)
    xe = x.copy()

    def exchange_rt():
        client.exchange(xe)

    procs = [echo_proc, pk_proc, ex_proc]
    rates = {"echo": [], "exchange": [], "pickle": []}
    for _ in range(reps):  # interleaved so drift on a shared machine hits all alike
        rates["echo"].append(_rate(echo_rt, seconds, 2000))
        rates["exchange"].append(_rate(exchange_rt, seconds, 2000))
        rates["pickle"].append(_rate(pickle_rt, seconds, 2000, min_rounds=2))
    client.close()
    echo.close()
    pk.close()
    ex_pipe.send("stop")
    ex_pipe.recv()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.terminate()
    med = {k: statistics.median(v) for k, v in rates.items()}
    # Ratios within each interleaved repetition cancel most of the machine's drift.
    ratio = statistics.median(e / b for e, b in zip(rates["exchange"], rates["echo"]))
    speedup = statistics.median(e / b for e, b in zip(rates["exchange"], rates["pickle"]))
    return {
        "figure": "roundtrip", "floats": n, "megabytes": round(4 * n / 1e6, 2),
        "exchange_rt_per_s": round(med["exchange"], 2),
        "echo_rt_per_s": round(med["echo"], 2),
        "pickle_rt_per_s": round(med["pickle"], 2),
        "ratio_vs_echo": round(ratio, 3),
        "speedup_vs_pickle": round(speedup, 2),
        "exchange_gbytes_per_s": round(med["exchange"] * 8 * n / 1e9, 2),
        "runs": {k: [round(r, 2) for r in v] for k, v in rates.items()},
    }


def _throughput_client(port, wid, n, seconds, barrier, queue):
    client = ExchangeClient((HOST, port), SECRET, wid)
    x = np.random.default_rng(wid).standard_normal(n).astype(np.float32)
    client.exchange(x)
    barrier.wait()
    k, t0 = 0, time.perf_counter()
    while k < 100_000 and time.perf_counter() - t0 < seconds:
        client.exchange(x, iteration=k)
        k += 1
    queue.put((k, time.perf_counter() - t0))
    client.close()


def throughput(n, workers, seconds):
    server = ExchangeServer(np.zeros(n, dtype=np.float32), SECRET, ALPHA).start()
    port = server.address[1]
    barrier = mp.Barrier(workers)
    queue = mp.Queue()
    procs = [mp.Process(target=_throughput_client, args=(port, w, n, seconds, barrier, queue), daemon=True)
             for w in range(workers)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(10)
    server.stop()
    total = sum(k for k, _ in results)
    wall = max(t for _, t in results)
    return {"figure": "server_throughput", "floats": n, "workers": workers,
            "exchanges_per_s": round(total / wall, 1),
            "per_worker_per_s": round(total / wall / workers, 1)}


def _numpy_compute(seconds):
    """A compute step that releases the GIL like a real backend: matrix products for `seconds` of wall time."""
    a = np.random.default_rng(1).standard_normal((128, 128)).astype(np.float32)

    def step():
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ a
    return step


def overlap(n, step_seconds, steps, compute):
    proc, pipe, port = _spawn(_easgd_server, n)
    client = ExchangeClient((HOST, port), SECRET, 0)
    params = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    step = (lambda: time.sleep(step_seconds)) if compute == "sleep" else _numpy_compute(step_seconds)
    out = {"figure": "overlap", "floats": n, "compute": compute, "compute_ms": step_seconds * 1e3,
           "period": 1, "steps": steps}
    for mode in ("overlapped", "blocking"):
        client.exchange(params)
        blocked0, t0 = client.blocked_seconds, time.perf_counter()
        for i in range(steps):
            step()
            if mode == "overlapped":
                client.poll(params)
                client.exchange_async(params, iteration=i)
            else:
                client.exchange(params, iteration=i)
        client.wait(params)
        wall = time.perf_counter() - t0
        out["%s_blocked_fraction" % mode] = round((client.blocked_seconds - blocked0) / wall, 4)
        out["%s_ms_per_step" % mode] = round(wall / steps * 1e3, 3)
    client.close()
    pipe.send("stop")
    pipe.recv()
    proc.join(5)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=0.6, help="time bound per measurement")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per size (median)")
    ap.add_argument("--sizes", default="lenet,googlenet,25M")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=200, help="training steps in the overlap figure")
    ap.add_argument("--only", default="roundtrip,throughput,overlap")
    ap.add_argument("--out", default="runs/bench/exchange.jsonl", help="JSON lines are also appended here")
    ap.add_argument("--cpus", choices=("free", "same", "apart"), default="free",
                    help="round trips: let the scheduler place the peers (default), or pin worker and "
                         "servers to one CPU, or to two different CPUs")
    args = ap.parse_args(argv)
    mp.set_start_method("fork")
    only = set(args.only.split(","))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def emit(rec):
        rec = dict(bench="exchange", **rec)
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    if "roundtrip" in only:
        global CPUS
        mine = os.sched_getaffinity(0)
        if args.cpus != "free":
            first, *rest = sorted(mine)
            if args.cpus == "apart" and not rest:
                ap.error("--cpus apart needs two CPUs")
            CPUS = ({first}, {first} if args.cpus == "same" else {rest[0]})
            os.sched_setaffinity(0, CPUS[0])
        for name in args.sizes.split(","):
            emit(dict(model=name, cpus=args.cpus, **roundtrips(SIZES[name], args.seconds, args.reps)))
        os.sched_setaffinity(0, mine)
        CPUS = None
    if "throughput" in only:
        for w in map(int, args.workers.split(",")):
            emit(throughput(SIZES["lenet"], w, 3 * args.seconds))
    if "overlap" in only:
        for compute in ("sleep", "numpy"):
            emit(overlap(SIZES["lenet"], 0.010, args.steps, compute))


if __name__ == "__main__":
    main()
