"""Fashion-MNIST from Parquet and from its LMDB (#11): the same 2-worker async EASGD run on each, side by side.

The LMDBs that `make data` converts from the Debian package dataset-fashion-mnist
(real data) are converted to Parquet with `deepspark convert-lmdb` (the same
records in the same order); the LeNet net is trained from each, its train and
test Data layers reading one kind, with the same solver, seed and iterations.
Async EASGD is not deterministic (the workers' exchanges interleave as they
happen), so the target is an accuracy within 0.5 points, not equality; the
single-process run, which is deterministic, gives identical losses from both
(tests/test_parquet.py checks that). One JSON line per run and one comparing them:

    PYTHONPATH=. .venv/bin/python bench/parquet_vs_lmdb.py [--iterations 2000] [--workers 2]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)

import deepspark  # noqa: E402

NET = os.path.join(ROOT, "models", "lenet", "train_val.prototxt")
SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
LMDBS = {"train": "data/fashion_mnist_train_lmdb", "test": "data/fashion_mnist_test_lmdb"}
TARGET_POINTS = 0.5


def solver_for(folder, kind, sources):
    """A copy of the LeNet solver and net whose Data layers read `sources` (train, test)."""
    with open(NET) as stream:
        net = stream.read()
    for split, lmdb_path in LMDBS.items():
        assert f'source: "{lmdb_path}"' in net, f"{NET} no longer reads {lmdb_path}"
        net = net.replace(f'source: "{lmdb_path}"', f'source: "{sources[split]}"')
    net_path = os.path.join(folder, f"{kind}_train_val.prototxt")
    with open(net_path, "w") as stream:
        stream.write(net)
    with open(SOLVER) as stream:
        solver = re.sub(r'^net: ".*"$', f'net: "{net_path}"', stream.read(), flags=re.M)
    solver = re.sub(r'^snapshot_prefix: ".*"$', f'snapshot_prefix: "{folder}/{kind}/lenet"', solver, flags=re.M)
    solver_path = os.path.join(folder, f"{kind}_solver.prototxt")
    with open(solver_path, "w") as stream:
        stream.write(solver)
    # The zoo's DeepSpark knobs beside the copy, as beside the original (`deepspark train` reads the file next to
    # the solver): without it the copy would run at the schema's defaults (moving rate 0.2, not LeNet's 0.45).
    shutil.copy(os.path.join(os.path.dirname(SOLVER), "deepspark.prototxt"), folder)
    return solver_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000, help="per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=_results.results_path("parquet_vs_lmdb"),
                        help="JSON lines are also appended here")
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): 10 iterations a run")
    args = parser.parse_args()
    if args.smoke:
        args.iterations = 10
    os.chdir(ROOT)  # the zoo's prototxt paths are relative to the repository
    missing = [path for path in LMDBS.values() if not os.path.isdir(path)]
    if missing:
        sys.exit(f"{', '.join(missing)} missing: run `make data` first")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="deepspark-bench-parquet-") as folder:
        parquets = {split: os.path.join(folder, f"fashion_mnist_{split}.parquet") for split in LMDBS}
        for split, lmdb_path in LMDBS.items():
            subprocess.run([sys.executable, "-m", "deepspark.cli", "convert-lmdb", lmdb_path, parquets[split]],
                           check=True, env={**os.environ, "PYTHONPATH": ROOT})
        for kind, sources in (("lmdb", LMDBS), ("parquet", parquets)):
            solver = solver_for(folder, kind, sources)
            started = time.monotonic()
            summary = deepspark.train(solver, workers=args.workers, algorithm="easgd", iterations=args.iterations,
                                      output=os.path.join(folder, kind)).summary
            accuracy = next(value for name, value in summary.items() if name.endswith("/accuracy"))
            runs[kind] = dict(bench="parquet_vs_lmdb", source=kind, workers=args.workers, algorithm="easgd",
                              iterations=summary["iterations"], accuracy=round(float(accuracy), 4),
                              spill_seconds=round(summary["spill_seconds"], 3),
                              ready_seconds=round(summary["ready_seconds"], 2),
                              train_seconds=round(summary["train_seconds"], 2),
                              wall_seconds=round(time.monotonic() - started, 1), data="fashion-mnist (real)")
            _results.emit(runs[kind], args.out)
    points = 100 * abs(runs["parquet"]["accuracy"] - runs["lmdb"]["accuracy"])
    _results.emit(dict(bench="parquet_vs_lmdb_accuracy", accuracy_lmdb=runs["lmdb"]["accuracy"],
                       accuracy_parquet=runs["parquet"]["accuracy"], difference_points=round(points, 2),
                       target_points=TARGET_POINTS, within_target=points <= TARGET_POINTS), args.out)


if __name__ == "__main__":
    main()
