"""Data at scale on real Spark: the driver holds no records (its peak RSS does not grow with the training set) for an LMDB, a Parquet dataset and a DataFrame; shards are balanced and deterministic; a Parquet source trains."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.spark

# The training sets of the RSS test: 3x32x32 uint8 records (~3 KB each), ~6 MB and ~60 MB.
SMALL, LARGE = 2000, 20000
# How much the driver's peak RSS may grow from the small set to the large one: a fraction of the
# 54 MB between them (a driver that held the records grows by at least that much).
GROWTH_KB = 16 * 1024

# The driver of the RSS test, run in a fresh process: it writes the data first (LMDBs, and Parquet
# datasets through Spark), then trains on each source kind at each size, resetting the kernel's
# high-water mark of its RSS (VmHWM) before each job and reading it after.
DRIVER = r"""
import json, os, re, sys
import numpy as np
import deepspark
from deepspark.data import encode_datum
from deepspark.data.lmdb_io import write_lmdb
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.session import spark_session

folder, sizes, kinds = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], sys.argv[3].split(",")

NET = '''name: "Wide"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 } data_param { source: "%s" batch_size: 10 backend: LMDB } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { scale: 0.00390625 } data_param { source: "%s" batch_size: 10 backend: LMDB } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''
SOLVER = '''net: "%s"
test_iter: 5
test_interval: 20
base_lr: 0.05
momentum: 0.9
lr_policy: "fixed"
display: 0
max_iter: 20
snapshot: 0
snapshot_prefix: "%s"
random_seed: 3
deepspark_param { workers: 2 period: 4 moving_rate: 0.4 exchange_timeout: 60 connect_timeout: 120 }
'''


def record(i):
    # (key, Datum bytes, label) of record i: a 3x32x32 image whose bright half is its class.
    rng = np.random.default_rng(i)
    label = int(rng.integers(2))
    image = rng.integers(0, 60, size=(3, 32, 32), dtype=np.uint8)
    image[:, (slice(0, 16) if label == 0 else slice(16, 32))] += 150
    return b"%08d" % i, encode_datum(image, label), label


def solver_for(name, source):
    net = os.path.join(folder, f"{name}.prototxt")
    with open(net, "w") as f:
        f.write(NET % (source, test))
    path = os.path.join(folder, f"{name}.solver.prototxt")
    with open(path, "w") as f:
        f.write(SOLVER % (net, os.path.join(folder, name, "wide")))
    return path


def peak_kb():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))


def reset_peak():  # the high-water mark becomes the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


test = os.path.join(folder, "test_lmdb")
write_lmdb(test, (record(10**7 + i)[:2] for i in range(50)))
lmdbs = {}
for n in sizes:
    lmdbs[n] = os.path.join(folder, f"train{n}_lmdb")
    write_lmdb(lmdbs[n], (record(i)[:2] for i in range(n)))
spark, _ = spark_session(pb.DeepSparkParameter(), 2)
schema = "key binary, datum binary, label int"


parquets = {}
for n in sizes:  # written by the executors: the driver never holds the rows
    parquets[n] = os.path.join(folder, f"train{n}.parquet")
    spark.createDataFrame(spark.sparkContext.range(n, numSlices=4).map(record), schema).write.parquet(parquets[n])

peaks, summaries = {}, {}
for kind in kinds:
    for n in sizes:
        name = f"{kind}{n}"
        reset_peak()
        if kind == "dataframe":
            frame = spark.read.parquet(parquets[n]).select("datum", "label")
            summary = deepspark.train(solver_for(name, lmdbs[n]), data=frame).summary
        elif kind == "ship":  # the opt-in: the driver streams the records into Spark, which holds them
            summary = deepspark.train(solver_for(name, lmdbs[n]), ship_records=True).summary
        else:
            summary = deepspark.train(solver_for(name, (lmdbs if kind == "lmdb" else parquets)[n])).summary
        peaks[name], summaries[name] = peak_kb(), summary
        print(f"{name}: driver peak RSS {peaks[name] / 1024:.1f} MB, summary {summary}", file=sys.stderr, flush=True)
print(json.dumps({"peaks": peaks, "summaries": summaries}))
"""


def driver_peaks(folder, sizes, kinds, pythonpath=ROOT):
    """{"peaks": {kind+size: the driver process's peak RSS in kB during that job}, "summaries": {kind+size:
    the job's summary}}, and the driver's log."""
    done = subprocess.run([sys.executable, "-c", DRIVER, str(folder), ",".join(map(str, sizes)), ",".join(kinds)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": pythonpath})
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    return driver_peaks(tmp_path_factory.mktemp("scale"), [SMALL, LARGE], ["lmdb", "parquet", "dataframe"])


@pytest.mark.slow  # its fixture trains on two sizes of each kind
@pytest.mark.parametrize("kind", ["lmdb", "parquet", "dataframe"])
def test_the_drivers_peak_rss_does_not_grow_with_the_training_set(peaks, kind):
    result, log = peaks
    peak = result["peaks"]
    small, large = peak[f"{kind}{SMALL}"], peak[f"{kind}{LARGE}"]
    assert large - small < GROWTH_KB, (f"{kind}: the driver's peak RSS grew from {small / 1024:.1f} MB to "
                                       f"{large / 1024:.1f} MB when the training set grew 10x", log[-3000:])
    spilled = [int(n) for n in re.findall(r"spilled (\d+) records", log)]
    assert spilled.count(LARGE // 2) >= 2 and spilled.count(SMALL // 2) >= 2, spilled  # every job ran both shards


def test_the_log_says_how_each_source_was_sharded(peaks):
    # with an LMDB in local mode, no records pass through the driver
    _, log = peaks
    assert re.search(rf"Sharded {LARGE} records into 2 shards \(each executor reads its record range of "
                     rf"\S+train{LARGE}_lmdb itself; no records pass through the driver\)", log), log[-3000:]
    assert re.search(rf"Planned 2 shards of the {LARGE} records of the Parquet dataset \S+train{LARGE}.parquet "
                     r"\(each task streams its partition", log), log[-3000:]
    assert f"repartitioned into 2 shards of its {LARGE} records (each task streams" in log


def test_the_time_until_the_shards_are_ready_is_reported_beside_the_spill(peaks):
    # the spill is the task's own step; the time from the job's start to the last spill's end adds
    # Spark's read of the source and any shuffle, and is said as a share of training time as well
    result, log = peaks
    for name, summary in result["summaries"].items():
        assert summary["ready_seconds"] > summary["spill_seconds"] > 0, (name, summary)
    ready = re.findall(r"Shards ready ([\d.]+)s after the Spark job started \(Spark's read of the data, any shuffle, "
                       r"then the spill\), ([\d.]+)% of training time", log)
    assert len(ready) == len(result["summaries"]), log[-3000:]


def test_a_parquet_source_trains(peaks):
    # from the Parquet datasets Spark wrote as four files each; the test set is an LMDB
    result, _ = peaks
    for n in (SMALL, LARGE):
        summary = result["summaries"][f"parquet{n}"]
        assert summary["iterations"] == 20 and summary["test0/accuracy"] >= 0.9, summary


def test_shards_are_balanced_by_count_and_the_same_on_every_run(tmp_path):
    script = """
import json, os, sys
import numpy as np
from deepspark.data import decode_datum, encode_datum
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.shards import dataframe_shards, parquet_shards
from deepspark.errors import DeepSparkError
from deepspark.spark.session import spark_session
spark, _ = spark_session(pb.DeepSparkParameter(), 2)
# 7 partitions of uneven sizes: 120 records
rdd = spark.sparkContext.parallelize(range(150), 7).filter(lambda i: i % 3 or i < 60) \\
    .map(lambda i: (encode_datum(np.full((1, 1, 1), i, np.uint8), 0),))
df = spark.createDataFrame(rdd, "datum binary")
shards, _, total = dataframe_shards(df, 3)
first = shards.glom().map(lambda items: sorted(items)).collect()
again = shards.glom().map(lambda items: sorted(items)).collect()
# a Parquet dataset in three files: its records in sorted file order, row by row
path = sys.argv[1]
df.repartition(3).write.parquet(path)
files = sorted(name for name in os.listdir(path) if name.endswith(".parquet"))
in_order = [bytes(row[0]) for name in files for row in spark.read.parquet(os.path.join(path, name)).collect()]
planned = parquet_shards(spark, path, 3)[0].glom().map(lambda items: sorted(items)).collect()
parquet = {"sizes": [len(s) for s in planned], "files": len(files),
           "in_order": [d for s in planned for _, d in s] == in_order,
           "indexes": [i for s in planned for i, _ in s] == list(range(120))}
try:
    parquet_shards(spark, "file:/nonexistent/train.parquet", 2)
except DeepSparkError as error:
    message = str(error)
print(json.dumps({"total": total, "first": [[[i, int(decode_datum(d)[0][0, 0, 0])] for i, d in s] for s in first],
                  "same": first == again, "parquet": parquet, "error": message}))
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "train.parquet")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["total"] == 120 and result["same"]
    values = [i for i in range(150) if i % 3 or i < 60]
    # shard i is records shard_range(120, i, 3) in the DataFrame's order, whatever its partitions held
    assert result["first"] == [[[i, values[i]] for i in range(a, a + 40)] for a in (0, 40, 80)]
    # a Parquet dataset's shards are its records in sorted file order, row by row, however Spark splits them
    assert result["parquet"] == {"sizes": [40, 40, 40], "files": 3, "in_order": True, "indexes": True}
    error = result["error"]
    assert error.startswith("file:/nonexistent/train.parquet: Spark cannot read the Parquet dataset: ") and \
        "Path does not exist" in error and "\n" not in error, error


def test_shard_of_inverts_shard_range():
    from deepspark.data.lmdb_io import shard_range
    from deepspark.spark.shards import shard_of

    for total in (1, 2, 3, 7, 10, 103, 1000):
        for shards in range(1, min(total, 9) + 1):
            owners = [shard_of(index, total, shards) for index in range(total)]
            assert owners == [s for s in range(shards) for _ in range(*shard_range(total, s, shards))]


def test_an_lmdb_an_executor_cannot_see_is_one_line_naming_the_ways_on(tmp_path, monkeypatch):
    from deepspark.spark.executor import WorkerError, spill
    from deepspark.spark.failures import first_line
    from deepspark.spark.shards import Range

    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))  # where the spill would go
    with pytest.raises(WorkerError) as raised:
        spill(Range("/data/only-on-the-driver_lmdb", 0, 10, 20), "job", 1)
    message = str(raised.value)
    assert re.fullmatch(r"worker 1 on \S+: the LMDB /data/only-on-the-driver_lmdb is not visible here; put it on "
                        r"storage every executor sees at that path, or convert it to Parquet \(deepspark convert-lmdb "
                        r"/data/only-on-the-driver_lmdb DEST.parquet\) and train from that, or ship its records "
                        r"through the driver with --ship-records \(bounded by the driver's memory\)", message), message
    # the job's line is the worker's, out of Spark's report
    report = f"org.apache.spark.SparkException: Job aborted\ndeepspark.spark.worker.WorkerError: {message}\n\tat x"
    assert first_line(report) == message
