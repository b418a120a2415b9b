"""Benchmark of DeepSpark's spill step (shard → executor-local LMDB) as a fraction of training time, on the demo job; prints JSON lines."""

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)
import deepspark  # noqa: E402
from deepspark.config import load_solver  # noqa: E402

PAPER = 0.01  # DeepSpark reports the spill under 1% of training time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--solver", default=os.path.join(ROOT, "models/lenet/solver.prototxt"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--algorithm", default="easgd")
    ap.add_argument("--iterations", type=int, default=1000,
                    help="iterations per worker to run (the full run's are extrapolated from their speed)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/spill.jsonl"),
                    help="JSON lines are also appended here")
    ap.add_argument("--smoke", action="store_true", help="runs end to end only (make bench-smoke): 10 iterations")
    args = ap.parse_args()
    if args.smoke:
        args.iterations = 10

    os.chdir(ROOT)  # the zoo's prototxt paths are relative to the repository
    full = load_solver(args.solver).param.max_iter
    with tempfile.TemporaryDirectory(prefix="deepspark-bench-spill-") as output:
        started = time.monotonic()
        summary = deepspark.train(args.solver, workers=args.workers, algorithm=args.algorithm,
                                  iterations=args.iterations, output=output).summary
        wall = time.monotonic() - started
    spill, train, done = summary["spill_seconds"], summary["train_seconds"], summary["iterations"]
    config = {"solver": os.path.relpath(args.solver, ROOT), "workers": args.workers, "algorithm": args.algorithm}
    speed = done / train
    records = [
        {"figure": "spill_fraction_measured", **config, "iterations": done, "spill_seconds": round(spill, 4),
         "train_seconds": round(train, 2), "fraction": round(spill / train, 5), "iterations_per_second": round(speed, 2),
         "job_wall_seconds": round(wall, 1), "scaled": done != full,
         "note": "slowest worker's spill over its training loop time, both from the job summary"
                 + ("" if done == full else f"; training ran {done} of the solver's {full} iterations")},
    ]
    if done != full:
        extrapolated = full / speed
        records.append(
            {"figure": "spill_fraction_full_run_extrapolated", **config, "iterations": full,
             "spill_seconds": round(spill, 4), "train_seconds_extrapolated": round(extrapolated, 1),
             "fraction": round(spill / extrapolated, 5), "scaled": True,
             "note": f"training time extrapolated from {speed:.1f} iter/s measured over {done} iterations "
                     "(the spill does not depend on max_iter); the measured run includes TF's warm-up"})
    for record in records:
        record["paper_fraction_below"] = PAPER
        record["ratio_to_paper"] = round(record["fraction"] / PAPER, 3)
        _results.emit({"bench": "spill", **record}, args.out)


if __name__ == "__main__":
    main()
