"""The driver's tests off the workers' clock (#44): the workers' images/s with the driver's test passes at test_nice 10 and 2 threads (the default) against at its own priority and TensorFlow's threads; JSON lines.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/driver_tests.py [--rounds 3] [--iterations 1000] [--test-interval 100]

Each run is `deepspark train` of models/lenet (Fashion-MNIST) on 2 easgd workers in local[2], in a process of its
own, testing the center every --test-interval iterations on the 10,000 test images; the two runs alternate, round
after round, each round in the other order, so that both see the machine's load alike. A run's images/s is its
workers' (each worker's iterations x the batch over its training seconds, from the job's summary lines, summed); the
last line gives each round's ratio (default over off), their median, the medians' ratio, and each side's test
passes' share of the job's wall time. A driver behind on its tests tests the latest multiple: a run at test_nice may
make fewer passes, which is part of what it saves the workers.
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
from network import WORKER  # noqa: E402  (bench/network.py: the workers' summary lines)
from time_to_accuracy import BATCH, SOLVER, command  # noqa: E402  (bench/time_to_accuracy.py: the same runs)

# name: the DeepSparkParameter knobs of the run; "off" is the driver as it tested before test_nice.
RUNS = {"nice 10, 2 threads": {"test_nice": 10, "test_threads": 2},
        "off": {"test_nice": 0, "test_threads": 0}}
ROUNDS, ITERATIONS, TEST_INTERVAL, TEST_ITER = 3, 1000, 100, 100  # a test pass: 100 batches of 100, 10,000 images
SMOKE_ITERATIONS, SMOKE_TEST_INTERVAL, SMOKE_TEST_ITER = 20, 10, 2
COST = re.compile(r"Tests: (\d+) pass(?:es)? on the driver took ([\d.]+) s \(([\d.]+)% of the job's")


def solver_copy(folder, test_interval, test_iter):
    """models/lenet's solver in `folder`, testing every `test_interval` iterations over `test_iter` batches, with no
    snapshots; its path."""
    from google.protobuf import text_format

    from deepspark.config import load_solver

    param = load_solver(SOLVER).param
    param.test_interval, param.test_iter[:], param.test_initialization = test_interval, [test_iter], False
    param.snapshot, param.snapshot_after_train, param.display = 0, False, test_interval
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "solver.prototxt")
    with open(path, "w") as stream:
        stream.write(text_format.MessageToString(param))
    return path


def run(name, knobs, iterations, test_interval, test_iter, folder):
    """One run's record: its workers' images/s and its test passes' cost, from its train.log."""
    solver = solver_copy(folder, test_interval, test_iter)
    done = subprocess.run(command(solver, folder, iterations, {"algorithm": "easgd", "workers": 2, **knobs}),
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if done.returncode:
        raise SystemExit(f"{name}: the run failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(folder, "train.log")) as stream:
        text = stream.read()
    workers = WORKER.findall(text)
    cost = COST.search(text)
    if len(workers) != 2 or cost is None:
        raise SystemExit(f"{name}: no summary of 2 workers and the tests' cost in {folder}/train.log")
    return {"bench": "driver_tests", "run": name, **knobs, "iterations": iterations, "test_interval": test_interval,
            "images_per_second": round(sum(int(n) * BATCH / float(s) for _, n, _, s, _ in workers), 1),
            "test_passes": int(cost.group(1)), "test_seconds": float(cost.group(2)),
            "test_share": float(cost.group(3)) / 100}


def verdict(records):
    """The medians of each run, the ratio of the default's workers' images/s to off's in each round, and the ratio
    of the medians."""
    def median(name, key):
        return statistics.median(r[key] for r in records if r["run"] == name)
    on, off = RUNS
    rounds = sorted({r["round"] for r in records})
    ratios = [next(r["images_per_second"] for r in records if r["run"] == on and r["round"] == i) /
              next(r["images_per_second"] for r in records if r["run"] == off and r["round"] == i) for i in rounds]
    return {"bench": "driver_tests", "verdict": True, "rounds": len(rounds),
            "round_ratios": [round(ratio, 3) for ratio in ratios],
            "median_round_ratio": round(statistics.median(ratios), 3),
            "images_per_second": {name: median(name, "images_per_second") for name in RUNS},
            "test_share": {name: median(name, "test_share") for name in RUNS},
            "ratio": round(median(on, "images_per_second") / median(off, "images_per_second"), 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--test-interval", type=int, default=TEST_INTERVAL)
    parser.add_argument("--smoke", action="store_true",
                        help=f"runs end to end only (make bench-smoke): 1 round, {SMOKE_ITERATIONS} iterations, "
                        f"a test every {SMOKE_TEST_INTERVAL} of {SMOKE_TEST_ITER} batches")
    parser.add_argument("--out", default=_results.results_path("driver_tests"))
    args = parser.parse_args()
    rounds, iterations, interval, test_iter = ((1, SMOKE_ITERATIONS, SMOKE_TEST_INTERVAL, SMOKE_TEST_ITER)
                                               if args.smoke else
                                               (args.rounds, args.iterations, args.test_interval, TEST_ITER))
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(rounds):  # interleaved, each round in the other order, so that both see the machine's load alike
            for name, knobs in list(RUNS.items())[::1 if i % 2 == 0 else -1]:
                record = {**run(name, knobs, iterations, interval, test_iter, os.path.join(scratch, f"{i}-{name}")),
                          "round": i}
                records.append(record)
                _results.emit(record, args.out)
    _results.emit(verdict(records), args.out)


if __name__ == "__main__":
    main()
