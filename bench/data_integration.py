"""Does DeepSpark fit existing data pipelines (#14, RQ4): LeNet trained from a Spark DataFrame and from a Parquet dataset against the same job from the LMDB path.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/data_integration.py [--quick] [--out FILE]

Fashion-MNIST (real data): the training LMDB that `make data` builds, the same records converted to one Parquet
file (deepspark.data.convert.convert_lmdb, what `deepspark convert-lmdb` runs), and a DataFrame a user's
pipeline would hand over: Spark's own reader on that Parquet file, `spark.read.parquet(path).select("datum",
"label")`, built inside the timed job (Spark reads the files, the library repartitions the rows into the shards).
Each source trains the same 2-worker async EASGD job on local[2] through `deepspark.spark.train`, in one process
with one SparkSession (its start-up paid once, before any run), tests and snapshots off, one epoch of the 60,000
images (469 iterations per worker; --quick: 150) — every run spills all 60,000 records, 30,000 per worker.
The sources alternate (lmdb, parquet, dataframe, lmdb, ...), twice each (--quick: once), after a short
Parquet warm-up job that is not reported: the first job of a session pays the Python workers' start and
TensorFlow's import, and the first read of Parquet through Spark SQL its planning and code generation, which
would otherwise land on whichever source went first.

One JSON line per run: images/s of training (the sum over the workers of iterations x batch / training seconds,
each on the worker's own clock after its spill and its backend's build), the job's wall time (from the call,
the DataFrame's construction included, to its return), each worker's records, spill and training seconds, and
the spill's share of the worker's run (spill / (spill + training); the backend's build is not reported and so
not counted). The spill is the worker's write of its shard into its local LMDB only; what comes before it for
Parquet and a DataFrame (Spark's read of the files, the shuffle of the rows into the shards) shows in
ready_seconds, the job's "Shards ready" time from the Spark job's start to the last spill's end, and in
ready_share, that against it plus the slower worker's training. A last line gives each source's medians and its
ratios against LMDB's.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)
from _tables import cell, missing, table  # noqa: E402  (bench/_tables.py)
from parquet_vs_lmdb import LMDBS, solver_for  # noqa: E402  (bench/parquet_vs_lmdb.py)

MODEL = os.path.join(ROOT, "models", "lenet")
DEEPSPARK = os.path.join(MODEL, "deepspark.prototxt")
SOURCES = ("lmdb", "parquet", "dataframe")
WORKERS = 2
BATCH = 64  # models/lenet/train_val.prototxt's train batch_size (checked against the net in solver())
EPOCH = -(-60000 // (WORKERS * BATCH))  # iterations per worker for the workers to see every image once
WARM_UP = 10  # iterations of the unreported first job
FIGURES = ("images_per_s", "wall_seconds", "spill_seconds", "spill_share", "ready_seconds", "ready_share")


def solver(path, iterations, folder):
    """The loaded solver at `path` with LeNet's DeepSpark knobs, its tests and snapshots off."""
    from deepspark.config import load_solver, override

    loaded = load_solver(path, DEEPSPARK)
    batch = next(layer.data_param.batch_size for layer in loaded.train_net.layer if layer.type == "Data")
    assert batch == BATCH, f"{path}'s train batch is {batch}, not {BATCH}"
    p = loaded.param
    p.test_interval, p.snapshot, p.snapshot_after_train = 0, 0, False
    # No test_interval, no test (Caffe's rule); no test_iter, no test net built either.
    del p.test_iter[:]
    return override(loaded, iterations=iterations, output=folder, workers=WORKERS, algorithm="easgd")


def run(kind, iterations, folder, sources):
    """One job from source `kind`; its record (without bench, run)."""
    import deepspark.spark as spark  # deferred: pyspark starts only for the runs

    path = sources["solvers"][kind]
    job = solver(path, iterations, os.path.join(folder, f"{kind}_{time.monotonic_ns()}"))
    started = time.monotonic()
    data = None
    if kind == "dataframe":
        from pyspark.sql import SparkSession

        data = SparkSession.getActiveSession().read.parquet(sources["parquet"]).select("datum", "label")
    summary = spark.train(job, data).summary
    wall = time.monotonic() - started
    workers = [dict(worker=w["worker"], records=w["records"], spill_seconds=round(w["spill_seconds"], 3),
                    train_seconds=round(w["train_seconds"], 2),
                    spill_share=round(w["spill_seconds"] / (w["spill_seconds"] + w["train_seconds"]), 4))
               for w in summary["workers"]]
    # A worker that trained none (an easgd job's leases: in a short run a late one may) adds no images/s.
    images = sum(w["iterations"] * BATCH / w["train_seconds"] for w in summary["workers"] if w["train_seconds"] > 0)
    ready = summary["ready_seconds"]
    return dict(source=kind, iterations=summary["iterations"], images_per_s=round(images, 1),
                wall_seconds=round(wall, 2), spill_seconds=max(w["spill_seconds"] for w in workers),
                spill_share=round(statistics.mean(w["spill_share"] for w in workers), 4),
                ready_seconds=round(ready, 2), ready_share=round(ready / (ready + summary["train_seconds"]), 4),
                records=sum(w["records"] for w in workers), per_worker=workers)


def comparison(runs):
    """Each source's medians over its runs and its ratios against LMDB's: the summary line."""
    medians = {}
    for kind in SOURCES:
        mine = [r for r in runs if r["source"] == kind]
        medians[kind] = {key: statistics.median(r[key] for r in mine) for key in FIGURES}
        medians[kind]["runs"] = len(mine)
    lmdb = dict(medians["lmdb"])
    for m in medians.values():
        m["images_per_s_vs_lmdb"] = round(m["images_per_s"] / lmdb["images_per_s"], 3)
        m["wall_vs_lmdb"] = round(m["wall_seconds"] / lmdb["wall_seconds"], 3)
        for key in FIGURES:
            m[key] = round(m[key], 4 if key.endswith("_share") else 2)
    return medians


def page_section(records, data_folder):
    """RQ4: training from a DataFrame and from Parquet against the LMDB path, from the last comparison line."""
    summaries = [r for r in records if r.get("figure") == "comparison"]
    if not summaries:
        return missing("LeNet from a DataFrame and from Parquet against the LMDB path",
                       "OPENBLAS_NUM_THREADS=1 python bench/data_integration.py")
    last = summaries[-1]
    rows = [[kind, cell(m["images_per_s"], 0), cell(m["images_per_s_vs_lmdb"], 2, "x"),
             cell(m["spill_seconds"], 2, " s"), cell(100 * m["spill_share"], 1, "%"),
             f"{cell(m['ready_seconds'], 1, ' s')} ({cell(100 * m['ready_share'], 1, '%')})",
             f"{cell(m['wall_seconds'], 1, ' s')} ({cell(m['wall_vs_lmdb'], 2, 'x')})"]
            for kind, m in last["sources"].items()]
    header = ["source", "images/s", "throughput vs LMDB", "spill seconds", "spill share of a worker's run",
              "shards ready: read, shuffle, spill (share)", "wall time (vs LMDB)"]
    runs = min(m["runs"] for m in last["sources"].values())
    how = "one run per source" if runs == 1 else f"medians of {runs} runs per source, alternating"
    return (table(header, rows) + f"\n\nFrom `{os.path.relpath(data_folder, ROOT)}/data_integration.jsonl` "
            f"(bench/data_integration.py): LeNet on Fashion-MNIST, async EASGD, {last['workers']} workers on "
            f"local[{last['workers']}], {last['iterations']} iterations per worker, all 60,000 images spilled in "
            f"each run; {how}. The DataFrame is "
            "Spark's reader on the Parquet file (`spark.read.parquet(path).select(\"datum\", \"label\")`); images/s "
            "is the workers' training after their spill and build, the spill share each worker's spill against its "
            "spill and training (mean of the workers), shards ready the time from the Spark job's start to the last "
            "spill's end (Spark's read of the data and its shuffle into the shards come before the spill), the wall "
            "time the whole `deepspark.spark.train` call. "
            f"The machine's load average went from {cell(last['load_average'][0], 1)} to "
            f"{cell(last['load_average'][1], 1)} on its {last['cores']} cores: other work skews these figures.")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="150 iterations a run, one run per source")
    parser.add_argument("--out", default=_results.results_path("data_integration"),
                        help="JSON lines are also appended here")
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): 10 iterations a run, one run per source")
    args = parser.parse_args()
    iterations, rounds = (10, 1) if args.smoke else (150, 1) if args.quick else (EPOCH, 2)
    os.chdir(ROOT)  # the zoo's prototxt paths are relative to the repository
    missing_data = [path for path in LMDBS.values() if not os.path.isdir(path)]
    if missing_data:
        sys.exit(f"{', '.join(missing_data)} missing: run `make data` first")
    from deepspark.data.convert import convert_lmdb
    from deepspark.spark.session import spark_session

    started, load = time.monotonic(), round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="deepspark-bench-integration-") as folder:
        train_parquet = os.path.join(folder, "fashion_mnist_train.parquet")
        convert_lmdb(LMDBS["train"], train_parquet)
        lenet = os.path.join(MODEL, "solver.prototxt")
        sources = {"parquet": train_parquet, "solvers": {
            "lmdb": lenet, "dataframe": lenet,  # a DataFrame given to train() replaces the net's source
            "parquet": solver_for(folder, "parquet", {"train": train_parquet, "test": LMDBS["test"]})}}
        # One session for every job: train() uses the running one and leaves it running.
        spark, _ = spark_session(solver(lenet, WARM_UP, folder).param.deepspark_param, WORKERS)
        try:
            run("parquet", WARM_UP, folder, sources)
            runs = []
            for number in range(1, rounds + 1):
                for kind in SOURCES:
                    runs.append(run(kind, iterations, folder, sources))
                    _results.emit(dict(bench="data_integration", run=number, workers=WORKERS, **runs[-1],
                                       data="fashion-mnist (real)"), args.out)
        finally:
            spark.stop()
    # Other processes on the machine's cores skew every figure here: the load says how busy it was.
    _results.emit(dict(bench="data_integration", figure="comparison", workers=WORKERS, iterations=iterations,
                       sources=comparison(runs), bench_seconds=round(time.monotonic() - started, 1),
                       load_average=[load, round(os.getloadavg()[0], 2)], cores=os.cpu_count()), args.out)


if __name__ == "__main__":
    main()
