"""The throughput model against runs here (#14): `deepspark plan`'s projection of the LeNet job at 1, 2 and 4 workers (4 oversubscribe the 2 cores) beside measured runs of the same job, and the error of each.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/plan_check.py [--iterations 600] [--quick] [--out FILE]

The costs are measured as `deepspark plan` measures them (deepspark.plan.measure), once per thread count, each in a
process of its own (TensorFlow fixes its thread pools once per process); the network is this machine's loopback, its
bandwidth and latency measured in the same run. Each run is `deepspark train`'s async EASGD job on Fashion-MNIST
(real data) with tests and snapshots off, its throughput the sum over its workers of iterations x batch / training
seconds (from each worker's own clock: after its spill, build and first step, the steady state the model is of), its
exchange share the workers' mean blocked share.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)
from _tables import cell, missing, table  # noqa: E402  (bench/_tables.py)
from deepspark import plan  # noqa: E402
from deepspark.algorithms import easgd  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

MODEL = os.path.join(ROOT, "models", "lenet")
CORES = os.cpu_count() or 1

# One process measuring the costs at a thread count: Costs as a JSON line.
MEASURE = """
import dataclasses, json, sys
from deepspark import plan
from deepspark.proto import deepspark_pb2 as pb
net, source, param, shape = plan.training_net(sys.argv[1])
costs = plan.measure(net, source, param, pb.PlanParameter(cores=int(sys.argv[2])), shape)
print(json.dumps(dataclasses.asdict(costs)))
"""


def costs_at(threads):
    done = subprocess.run([sys.executable, "-c", MEASURE, MODEL, str(threads)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if done.returncode:
        raise SystemExit(f"measuring the costs failed:\n{done.stderr[-3000:]}")
    return plan.Costs(**json.loads(done.stdout.strip().splitlines()[-1]))


def loopback(megabytes=256, pings=200):
    """Loopback's Network: one-way bytes per second of a stream through a TCP socket, and half a small round trip."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo():
        sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(1 << 20))
        while True:
            got = sock.recv_into(buf)
            if not got:
                return
            if got == 1:  # a ping
                sock.sendall(b"p")

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(pings):
        at = time.perf_counter()
        client.sendall(b"p")
        client.recv(1)
        rtts.append(time.perf_counter() - at)
    block = bytes(8 << 20)
    at = time.perf_counter()
    for _ in range(megabytes // 8):
        client.sendall(block)
    client.close()
    thread.join()
    seconds = time.perf_counter() - at
    server.close()
    return plan.Network((megabytes << 20) / seconds, statistics.median(rtts) / 2)


def measured(workers, iterations, batch, folder):
    """(images/s, the workers' mean exchange share) of the LeNet EASGD job at `workers`, tests and snapshots off."""
    import deepspark.spark as spark  # deferred: pyspark starts only for the runs
    from deepspark.config import load_solver

    solver = load_solver(os.path.join(MODEL, "solver.prototxt"))
    solver.param.test_interval, solver.param.snapshot, solver.param.snapshot_after_train = 0, 0, False
    summary = spark.train(solver, workers=workers, iterations=iterations, output=folder, algorithm="easgd").summary
    rows = summary["workers"]
    # The model is of a worker's steady state: its first step, where the backend traces its step function (a
    # second or more, start-up's last part: bench/startup.py), is left out of the measured rate.
    images = sum((r["iterations"] - 1) * batch / (r["train_seconds"] - r["first_step_seconds"]) for r in rows)
    return images, statistics.mean(r["blocked_seconds"] / r["train_seconds"] for r in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument("--quick", action="store_true", help="1 and 2 workers only, 300 iterations a run")
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): 2 workers, 20 iterations")
    parser.add_argument("--out", default=_results.results_path("plan_check"))
    args = parser.parse_args()
    iterations = 20 if args.smoke else 300 if args.quick else args.iterations
    network = loopback()
    _results.emit({"bench": "plan_check", "figure": "loopback", "bandwidth_gbit": round(8 * network.bandwidth / 1e9, 2),
                   "latency_ms": round(1e3 * network.latency, 4)}, args.out)
    costs = {}
    errors = []
    ds = pb.DeepSparkParameter(period=plan.training_net(MODEL)[2].deepspark_param.period)
    with tempfile.TemporaryDirectory() as folder:
        for workers in (2,) if args.smoke else (1, 2) if args.quick else (1, 2, 4):
            threads = max(1, CORES // workers)  # as deepspark.spark.session.worker_threads shares local mode's cores
            if threads not in costs:
                costs[threads] = costs_at(threads)
                _results.emit({"bench": "plan_check", "figure": "costs", "threads": threads,
                               **{k: (round(v * 1e3, 3) if isinstance(v, float) else v)
                                  for k, v in costs[threads].__dict__.items()}, "unit": "ms"}, args.out)
            shared = max(1.0, workers * threads / CORES)  # workers on fewer cores than their threads
            projected = easgd.project(costs[threads], network, workers, ds.period, shared=shared)
            images, share = measured(workers, iterations, costs[threads].batch, os.path.join(folder, str(workers)))
            error = projected.images_per_second / images - 1
            errors.append(abs(error))
            _results.emit({"bench": "plan_check", "workers": workers, "threads_per_worker": threads,
                           "cores_shared_by": round(shared, 2), "iterations": iterations, "period": ds.period,
                           "projected_images_per_s": round(projected.images_per_second, 1),
                           "measured_images_per_s": round(images, 1), "error_percent": round(100 * error, 1),
                           "projected_exchange_percent": round(100 * projected.exchange_share, 2),
                           "measured_exchange_percent": round(100 * share, 2)}, args.out)
    _results.emit({"bench": "plan_check", "figure": "largest error", "error_percent": round(100 * max(errors), 1),
                   "target_percent": 20}, args.out)



def page_section(records, data):
    """The throughput model against measured runs on this machine."""
    runs = [r for r in records if "workers" in r]
    if not runs:
        return missing("the planner against 1, 2 and 4 workers", "OPENBLAS_NUM_THREADS=1 python bench/plan_check.py")
    rows = [[str(r["workers"]), str(r["threads_per_worker"]), cell(r["cores_shared_by"], 1),
             cell(r["projected_images_per_s"], 0), cell(r["measured_images_per_s"], 0), cell(r["error_percent"], 1, "%"),
             cell(r["projected_exchange_percent"], 2, "%"), cell(r["measured_exchange_percent"], 2, "%")] for r in runs]
    header = ["workers", "threads each", "oversubscribed by", "projected images/s", "measured images/s", "error",
              "projected exchange share", "measured exchange share"]
    costs = {r["threads"]: r for r in records if r.get("figure") == "costs"}
    why = []
    for r in runs:
        if abs(r["error_percent"]) <= 20:
            continue
        c = costs.get(r["threads_per_worker"])
        center = "" if not c else (
            f" the center's own work, {c['server']:.1f} ms an exchange for each worker's every {r['period']} steps "
            f"of {c['step']:.1f} ms, is {100 * r['workers'] * c['server'] / (r['period'] * c['step'] * max(1, r['cores_shared_by'])) / 2:.0f}% "
            "of the 2 cores here, which the model gives a node of its own;")
        shared = " the model divides the cores by the workers' threads (\"oversubscribed by\"), not counting what two " \
            "TensorFlow processes time-slicing one core lose to switching and caches;" if r["cores_shared_by"] > 1 else ""
        why.append(f"- {r['workers']} worker{'s' * (r['workers'] != 1)} ({r['error_percent']:+.1f}%):{center}{shared} "
                   "the driver's JVM and its watch loop share the cores too, unmodelled.")
    text = table(header, rows) + f"\n\nFrom `{os.path.relpath(data, ROOT)}/plan_check.jsonl` (bench/plan_check.py): " \
        "measured images/s are the workers' steady state (their first step, where TensorFlow traces, left out; " \
        "start-up is the last section's)."
    if why:
        text += "\n\nWhere the error is over 20%, what the model leaves out that this machine has:\n\n" + "\n".join(why)
    return text


if __name__ == "__main__":
    main()
