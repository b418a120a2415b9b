"""The price of the exchange's integrity tags in the demo configuration (#13): the share of each worker's training
time blocked on the exchange, with exchange_integrity on (the default) and off, in alternating runs of `make demo`'s
job (LeNet on Fashion-MNIST, 2 workers, async EASGD, period 10, overlapped; real data), shortened to --iterations.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/integrity.py [--iterations 1000] [--repeats 2]

One JSON line per run, then one comparing the medians (target: tags add at most 1 point to the blocked share).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)

SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
WORKER = re.compile(r"Worker (\d+) on .*?: (\d+) iterations, (\d+) exchanges, .*? trained ([\d.]+)s, blocked on exchange "
                    r"([\d.]+)s")
TARGET_POINTS = 1.0


def run(iterations, integrity, folder):
    """The shares of each worker's training time blocked on the exchange, from the job's summary lines."""
    flag = "--exchange-integrity" if integrity else "--no-exchange-integrity"
    out = subprocess.run([sys.executable, "-m", "deepspark.cli", "train", "--solver", SOLVER, "--iterations",
                          str(iterations), "--output", folder, flag], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    workers = WORKER.findall(out.stderr)
    if out.returncode or len(workers) != 2:
        raise SystemExit(f"the run failed:\n{out.stderr[-3000:]}")
    return [100 * float(blocked) / float(trained) for _, _, _, trained, blocked in workers], \
        [int(exchanges) for _, _, exchanges, _, _ in workers]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): 20 iterations, one run with tags and one without")
    parser.add_argument("--out", default=_results.results_path("integrity"))
    args = parser.parse_args()
    if args.smoke:
        args.iterations, args.repeats = 20, 1
    shares = {True: [], False: []}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for integrity in (True, False):  # alternating, so the machine's drift hits both alike
                blocked, exchanges = run(args.iterations, integrity, os.path.join(folder, f"{repeat}-{integrity}"))
                shares[integrity] += blocked
                _results.emit({"bench": "integrity", "integrity": integrity, "iterations": args.iterations,
                               "blocked_percent_per_worker": [round(b, 3) for b in blocked],
                               "exchanges_per_worker": exchanges}, args.out)
    on, off = statistics.median(shares[True]), statistics.median(shares[False])
    _results.emit({"bench": "integrity", "figure": "demo blocked share", "iterations": args.iterations,
                   "runs_each": args.repeats, "blocked_percent_with_tags": round(on, 3),
                   "blocked_percent_without": round(off, 3), "added_points": round(on - off, 3),
                   "target_points": TARGET_POINTS, "meets_target": on - off <= TARGET_POINTS,
                   "data": "Fashion-MNIST (real), the demo's LeNet job"}, args.out)


if __name__ == "__main__":
    main()
