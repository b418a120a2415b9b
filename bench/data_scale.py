"""Data at cluster scale (#11): a Parquet training set of several GB, trained on local[2] with async EASGD.

Synthetic data (nothing can be downloaded here): 3x64x64 uint8 records, ten
classes, each class a brighter band of rows, so the net has something to learn.
For each dataset size it writes the Parquet dataset (streamed), trains a small
conv net for a few hundred iterations per worker from it, and prints one JSON line:

- driver_peak_rss_mb: the driver Python process's peak RSS (its VmHWM; the JVM
  is a process of its own and not counted);
- workers: each worker's peak RSS in its task after its spill and at the end of
  training (a worker holds its shard's pixels in memory when they fit in the
  feeder's 2 GiB, and the LMDB pages it reads count while mapped);
- spill records/s and MB/s, and spill_vs_raw: one worker's spill throughput
  against a raw single-transaction LMDB write of the same records (one worker's
  share) in this process alone, timed around the puts, the commit and the sync;
  spill_vs_raw_two_at_once: against the slower of two such raw writes run at
  once, one per worker's share, as the two workers' spills run (one disk, two
  cores: the like-for-like baseline here); both_workers_spill_vs_raw: both
  workers' records over the spill time against the lone raw write;
- spill_share_of_run: the spill's share of a full run, extrapolated as the paper
  does: spill time against the time `--epochs` passes over a worker's shard
  take at the measured iterations per second (and the share of one epoch);
  shards_ready_share_of_run: the same for the time from the Spark job's start
  to the last spill's end, which adds Spark's read of the Parquet files and its
  shuffle into the workers' shards.

A last line compares the sizes: the driver's peak RSS must not grow with the data.

    PYTHONPATH=. .venv/bin/python bench/data_scale.py [--sizes-gb 1 4] [--iterations 300] [--folder DIR] [--out FILE]
"""

import argparse
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lmdb  # noqa: E402
import numpy as np  # noqa: E402

import _results  # noqa: E402  (bench/_results.py)
from deepspark.data import encode_datum  # noqa: E402
from deepspark.data import parquet  # noqa: E402

OUT = _results.results_path("data_scale")
SHAPE = (3, 64, 64)
RECORD_BYTES = int(np.prod(SHAPE))
BATCH = 64

NET = """name: "scale"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{source}" batch_size: {batch} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 16 kernel_size: 5 stride: 2 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }}
"""

SOLVER = """net: "{net}"
base_lr: 0.01
momentum: 0.9
lr_policy: "fixed"
display: 50
max_iter: {iterations}
snapshot_after_train: false
snapshot_prefix: "{prefix}"
solver_mode: CPU
"""

# Runs `deepspark ARGS` and says the process's own peak RSS on its last stderr line: VmHWM, which
# belongs to this process's memory map alone (getrusage's ru_maxrss carries the peak of the process that
# forked it, this bench, across the exec).
DRIVER = """import runpy, sys
sys.argv = ["deepspark"] + sys.argv[1:]
try:
    runpy.run_module("deepspark.cli", run_name="__main__")
except SystemExit as done:
    status = done.code
else:
    status = 0
with open("/proc/self/status") as lines:
    peak = next(line.split()[1] for line in lines if line.startswith("VmHWM:"))
print("DRIVER_PEAK_RSS_KB", peak, file=sys.stderr, flush=True)
sys.exit(status)
"""


def emit(record):
    _results.emit(record, OUT)


def records(count, seed=0):
    """(key, Datum bytes) of `count` synthetic records, made as they are read (nothing held)."""
    rng = np.random.default_rng(seed)
    band = SHAPE[1] // 10
    for i in range(count):
        label = int(rng.integers(10))
        image = rng.integers(0, 96, size=SHAPE, dtype=np.uint8)
        image[:, label * band:(label + 1) * band, :] += 150
        yield b"%08d" % i, encode_datum(image, label)


def raw_lmdb_write(source, start, stop, folder):
    """MB/s of one transaction putting records start..stop-1 of `source` into a fresh LMDB: the put calls,
    the commit (where LMDB writes the pages) and the sync to disk, timed; reading the Parquet is not."""
    path = os.path.join(folder, f"raw_{start}_lmdb")
    shutil.rmtree(path, ignore_errors=True)
    env = lmdb.open(path, map_size=2 * (stop - start) * (RECORD_BYTES + 256) + (64 << 20), meminit=False,
                    sync=False)
    seconds, size = 0.0, 0
    try:
        txn = env.begin(write=True)
        for key, value in parquet.read_records(source, start, stop):
            key = key.encode() if isinstance(key, str) else key
            started = time.perf_counter()
            txn.put(key, value)
            seconds += time.perf_counter() - started
            size += len(value)
        started = time.perf_counter()
        txn.commit()
        env.sync(True)
        seconds += time.perf_counter() - started
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return size / 1e6 / seconds


def raw_lmdb_writes(source, count, folder, writers):
    """MB/s of each of `writers` raw_lmdb_write processes run at once, one shard of `count` records each:
    the raw write under the contention the workers' spills meet (one disk, the machine's cores)."""
    ranges = [(source, count * i // writers, count * (i + 1) // writers, folder) for i in range(writers)]
    with multiprocessing.get_context("fork").Pool(writers) as pool:
        return pool.starmap(raw_lmdb_write, ranges)


def train(folder, source, iterations):
    """(driver peak RSS MB, the run's stderr, wall seconds) of a 2-worker EASGD run on `source`."""
    net = os.path.join(folder, "net.prototxt")
    with open(net, "w") as stream:
        stream.write(NET.format(source=source, batch=BATCH))
    solver = os.path.join(folder, "solver.prototxt")
    with open(solver, "w") as stream:
        stream.write(SOLVER.format(net=net, iterations=iterations, prefix=os.path.join(folder, "out", "scale")))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", DRIVER, "train", "--solver", solver, "--workers", "2",
                           "--algorithm", "easgd", "--output", os.path.join(folder, "out")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    seconds = time.monotonic() - started
    if done.returncode:
        sys.exit(f"training failed:\n{done.stderr[-4000:]}")
    peak = int(re.findall(r"DRIVER_PEAK_RSS_KB (\d+)", done.stderr)[-1]) / 1024
    return peak, done.stderr, seconds


WORKER_LINE = re.compile(r"Worker (\d+) on .*?: (\d+) iterations, .*?spilled (\d+) records in ([\d.]+)s, "
                         r"trained ([\d.]+)s.*?peak RSS ([\d.]+) MB after the spill, ([\d.]+) MB")


def measure(size_gb, iterations, epochs, folder):
    count = int(size_gb * 1e9 / RECORD_BYTES)
    source = os.path.join(folder, f"train_{size_gb:g}gb.parquet")
    if not os.path.exists(source):
        started = time.monotonic()
        parquet.write_parquet(source, records(count))
        print(f"[data_scale] wrote {count} records ({size_gb:g} GB) to {source} in "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    raw = raw_lmdb_write(source, 0, count // 2, folder)  # one worker's share, alone
    raw_both = raw_lmdb_writes(source, count, folder, 2)  # both workers' shares, at once
    driver_mb, log, wall = train(folder, source, iterations)
    workers = [dict(worker=int(w), iterations=int(it), records=int(n), spill_seconds=float(s),
                    train_seconds=float(t), spill_rss_mb=float(a), peak_rss_mb=float(b))
               for w, it, n, s, t, a, b in WORKER_LINE.findall(log)]
    ready = [float(seconds) for seconds in re.findall(r"Shards ready ([\d.]+)s after the Spark job started", log)]
    if len(workers) != 2 or len(ready) != 1:
        sys.exit(f"no worker summary lines in the log:\n{log[-4000:]}")
    spill, ready = max(w["spill_seconds"] for w in workers), ready[0]
    shard = max(w["records"] for w in workers)
    both_mb = sum(w["records"] for w in workers) * RECORD_BYTES / 1e6
    # Iterations per second per worker, of those that trained: an easgd job's workers share its iterations as their
    # speeds go (the exchanger's leases), and in a short run a late worker may train none.
    rate = min((w["iterations"] / w["train_seconds"] for w in workers if w["iterations"] and w["train_seconds"] > 0),
               default=0.0)
    if not rate:
        sys.exit(f"no worker trained an iteration:\n{log[-4000:]}")
    epoch = shard / BATCH / rate
    record = dict(bench="data_scale", size_gb=size_gb, records=count, iterations=iterations,
                  driver_peak_rss_mb=round(driver_mb, 1), workers=workers,
                  spill_records_per_s=round(shard / spill), spill_mb_per_s=round(shard * RECORD_BYTES / 1e6 / spill, 1),
                  raw_lmdb_mb_per_s=round(raw, 1),
                  spill_vs_raw=round(shard * RECORD_BYTES / 1e6 / spill / raw, 3),
                  raw_lmdb_two_at_once_mb_per_s=[round(r, 1) for r in raw_both],
                  spill_vs_raw_two_at_once=round(shard * RECORD_BYTES / 1e6 / spill / min(raw_both), 3),
                  both_workers_spill_mb_per_s=round(both_mb / spill, 1),
                  both_workers_spill_vs_raw=round(both_mb / spill / raw, 3),
                  spill_share_of_one_epoch=round(spill / (spill + epoch), 4), epochs=epochs,
                  spill_share_of_run=round(spill / (spill + epochs * epoch), 5),
                  shards_ready_seconds=ready, shards_ready_share_of_run=round(ready / (ready + epochs * epoch), 5),
                  wall_seconds=round(wall, 1))
    emit(record)
    return record


def main():
    global OUT  # emit's file
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--iterations", type=int, default=300, help="per worker")
    parser.add_argument("--epochs", type=int, default=30, help="the full run the spill share is extrapolated to")
    parser.add_argument("--folder", default="/tmp/deepspark-data-scale")
    parser.add_argument("--keep", action="store_true", help="keep the datasets for another run")
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): 0.01 GB, 5 iterations, in a fresh folder")
    parser.add_argument("--out", default=OUT, help="JSON lines are also appended here")
    args = parser.parse_args()
    OUT = args.out
    if args.smoke:
        args.sizes_gb, args.iterations, args.keep = [0.01], 5, False
        args.folder = tempfile.mkdtemp(prefix="deepspark-data-scale-smoke-")
    os.makedirs(args.folder, exist_ok=True)
    try:
        results = [measure(size, args.iterations, args.epochs, args.folder) for size in args.sizes_gb]
    finally:
        if not args.keep:
            shutil.rmtree(args.folder, ignore_errors=True)
    small, large = results[0], results[-1]
    emit(dict(bench="data_scale_driver_memory", sizes_gb=args.sizes_gb,
              driver_peak_rss_mb=[r["driver_peak_rss_mb"] for r in results],
              growth_mb=round(large["driver_peak_rss_mb"] - small["driver_peak_rss_mb"], 1),
              data_growth=round(large["records"] / small["records"], 2)))


if __name__ == "__main__":
    main()
