"""Faults, several per run (#13): `make demo`'s job (LeNet on Fashion-MNIST, 2 workers; real data) shortened to --iterations, once unharmed and once with --kills training workers SIGKILLed at seeded moments by tools/chaos.py's harness (each waits for the rejoin before the next).

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/chaos.py [--iterations 1500] [--kills 3] [--seed 1]
        [--algorithm easgd|sync]

One JSON line per run (test accuracy, wall seconds; the harmed run's kills: iteration, seconds to the
rejoin), then one comparing them: the accuracy difference in points, the wall-time overhead ratio
(harmed / unharmed), the rejoins the driver logged and the median seconds from a kill to its rejoin.
"""

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)

# tools/chaos.py by its path: this file is chaos.py too.
_spec = importlib.util.spec_from_file_location("tools_chaos", os.path.join(ROOT, "tools", "chaos.py"))
chaos = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chaos
_spec.loader.exec_module(chaos)

SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
ACCURACY = re.compile(r"Test net output #\d+: accuracy = ([\d.]+)")
REJOINED = re.compile(r"Worker \d+ rejoined the exchanger")
TARGET_POINTS = 1.0


def run(iterations, algorithm, folder, kills=0, seed=0):
    """One training run, with `kills` workers killed by the harness: (test accuracy, wall seconds, the
    driver's log, the Kills)."""
    log_path = os.path.join(folder, "train.log")
    started = time.monotonic()
    driver = subprocess.Popen([sys.executable, "-m", "deepspark.cli", "train", "--solver", SOLVER, "--iterations",
                               str(iterations), "--output", folder, "--algorithm", algorithm],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT})
    harness = None
    if kills:
        harness = chaos.Chaos(None, kills, seed, log=chaos.DriverLog(log_path, iterations),
                              ended=lambda: driver.poll() is not None, timeout=600,
                              say=lambda line: print(line, file=sys.stderr, flush=True)).start()
    _, stderr = driver.communicate()
    seconds = time.monotonic() - started
    made = harness.join(30) if harness else []
    with open(log_path, encoding="utf-8") as stream:
        log = stream.read()
    accuracies = ACCURACY.findall(log)
    if driver.returncode or not accuracies:
        raise SystemExit(f"the run failed:\n{stderr[-3000:]}")
    return float(accuracies[-1]), seconds, log, made


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1500)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--algorithm", choices=("easgd", "sync"), default="easgd")
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): 200 iterations, 1 kill")
    parser.add_argument("--out", default=_results.results_path("chaos"))
    args = parser.parse_args()
    if args.smoke:
        args.iterations, args.kills = 200, 1  # fewer and the job can end before the kill
    common = {"bench": "chaos", "algorithm": args.algorithm, "iterations": args.iterations,
              "data": "Fashion-MNIST (real), the demo's LeNet job, 2 workers"}
    with tempfile.TemporaryDirectory() as folder:
        accuracy, seconds, _, _ = run(args.iterations, args.algorithm, os.path.join(folder, "unharmed"))
        _results.emit({**common, "run": "unharmed", "test_accuracy": accuracy, "wall_seconds": round(seconds, 1)},
                      args.out)
        harmed, harmed_seconds, log, kills = run(args.iterations, args.algorithm, os.path.join(folder, "harmed"),
                                                 args.kills, args.seed)
    to_rejoin = [k.seconds_to_rejoin for k in kills if k.seconds_to_rejoin is not None]
    _results.emit({**common, "run": "harmed", "kills": len(kills), "seed": args.seed, "test_accuracy": harmed,
                   "wall_seconds": round(harmed_seconds, 1),
                   "killed": [{"iteration": k.iteration, "seconds_to_rejoin": None if k.seconds_to_rejoin is None
                               else round(k.seconds_to_rejoin, 2)} for k in kills]}, args.out)
    delta = 100 * (harmed - accuracy)
    _results.emit({**common, "figure": f"{args.kills} worker kills in one run", "kills_made": len(kills),
                   "accuracy_unharmed": accuracy, "accuracy_harmed": harmed, "accuracy_delta_points": round(delta, 2),
                   "wall_overhead_ratio": round(harmed_seconds / seconds, 3),
                   "rejoins_logged": len(REJOINED.findall(log)),
                   "median_seconds_kill_to_rejoin": round(statistics.median(to_rejoin), 2) if to_rejoin else None,
                   "target_points": TARGET_POINTS,
                   "meets_target": len(kills) == args.kills and abs(delta) <= TARGET_POINTS},
                  args.out)


if __name__ == "__main__":
    main()
