"""The order a job reads its train shards in (DeepSparkParameter.data_order): each epoch of an LMDB, a Parquet and a
DataFrame-fed shard sees every record once, in a new order each epoch that the same seed repeats, where the job
shuffles (Spark's default); a single run's default is Caffe's, the source's order."""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from google.protobuf import text_format

from deepspark import checkpoint, nets
from deepspark.config import load_solver, override
from deepspark.data import encode_datum, feeder_for
from deepspark.data.resume import BLOCKS
from deepspark.data.sources import write_records
from deepspark.log import Log
from deepspark.proto import deepspark_pb2 as pb
from synthetic import NET, SOLVER, make_lmdb

RECORDS = 60  # each record's label is its number: a batch's labels say which records it holds


def numbered(path, count=RECORDS):
    """A dataset at `path` (an LMDB, or Parquet for a name ending in .parquet) of `count` 1x8x8 records, record i
    labelled i, in key order."""
    rng = np.random.default_rng(0)
    records = [(b"%08d" % i, encode_datum(rng.integers(0, 255, (1, 8, 8), dtype=np.uint8), i)) for i in range(count)]
    assert write_records(str(path), iter(records)) == count
    return str(path)


def solver_at(folder, train, **knobs):
    (folder / "net.prototxt").write_text(NET.format(train=train, test=train))
    (folder / "solver.prototxt").write_text(SOLVER.format(net=folder / "net.prototxt", test_interval=0, max_iter=10,
                                                          snapshot=0, prefix=folder / "tiny", workers=2,
                                                          connect_timeout=60))
    return override(load_solver(str(folder / "solver.prototxt")), **knobs)


def epochs_seen(solver, count, spark, shard=1, num_shards=2, log=None, rank=None):
    """The labels of `count` epochs of the train feeder of worker `shard` (seeded as that worker, or as worker
    `rank`), one array each; its trainer's log goes to the file `log` if given."""
    with Log(str(log) if log else None, stream=io.StringIO(), progress=False):
        trainer = nets.trainer(solver, shard=shard, num_shards=num_shards, rank=rank, evaluate=False, spark=spark)
        try:
            (feeder,) = trainer.feeders
            seen = np.concatenate([feeder.next_batch()["label"] for _ in range(count * feeder.size // 10)])
            return seen.astype(int).reshape(count, feeder.size)
        finally:
            trainer.close()


def order_lines(log):
    return re.findall(r"Data order: .*", log.read_text())


def assert_shuffled_epochs(epochs, records):
    """Every epoch a permutation of `records`, none in their order, each in another order than the last's."""
    for epoch in epochs:
        assert sorted(epoch) == sorted(records)
        assert list(epoch) != sorted(records)
    for last, this in zip(epochs, epochs[1:]):
        assert list(this) != list(last)


@pytest.mark.parametrize("kind", ["lmdb", "parquet"])
def test_a_spark_workers_shard_is_shuffled_every_epoch_and_the_seed_repeats_it(tmp_path, kind):
    train = numbered(tmp_path / ("train_lmdb" if kind == "lmdb" else "train.parquet"))
    log = tmp_path / "train.log"
    epochs = epochs_seen(solver_at(tmp_path, train), 3, spark=True, log=log)
    assert_shuffled_epochs(epochs, range(30, 60))  # shard 1 of 2: the second half
    seed = nets.worker_seed(3, 1)  # random_seed 3, worker 1
    assert order_lines(log) == [f"Data order: shuffled per epoch (seed {seed}), blocks of 4 MB of records through a "
                                "64 MB shuffle buffer; 'data' 30 records a block, 30 a buffer, of 30"]
    assert (epochs_seen(solver_at(tmp_path, train), 3, spark=True) == epochs).all()
    # asked for, a single run shuffles too (seeded as worker 1 here); another seed, another order
    again = epochs_seen(solver_at(tmp_path, train, data_order="shuffled"), 3, spark=False)
    assert (again == epochs).all()
    reseeded = solver_at(tmp_path, train)
    reseeded.param.random_seed = 4
    assert not (epochs_seen(reseeded, 3, spark=True) == epochs).all()


def test_adjacent_seeds_give_their_workers_other_orders_and_worker_0_keeps_the_jobs_seed(tmp_path):
    """Job s's worker 1 and job s+1's worker 0 read one shard in different orders (seed + rank made them the same);
    worker 0, as a single run, is seeded by random_seed itself."""
    train = numbered(tmp_path / "train_lmdb")
    first = epochs_seen(solver_at(tmp_path, train), 2, spark=True, shard=0, num_shards=1, rank=1)
    following = solver_at(tmp_path, train)
    following.param.random_seed = 4
    assert not (epochs_seen(following, 2, spark=True, shard=0, num_shards=1, rank=0) == first).all()
    assert nets.worker_seed(4, 0) == 4 and nets.worker_seed(None, 1) is None
    assert len({nets.worker_seed(s, r) for s in range(20) for r in range(20)}) == 400


def test_a_single_runs_default_order_is_caffes_and_source_is_asked_on_spark(tmp_path):
    train = numbered(tmp_path / "train_lmdb")
    log = tmp_path / "train.log"
    in_order = np.tile(np.arange(30, 60), (2, 1))
    assert (epochs_seen(solver_at(tmp_path, train), 2, spark=False, log=log) == in_order).all()
    assert order_lines(log) == ["Data order: as the source (Caffe's)"]
    assert (epochs_seen(solver_at(tmp_path, train, data_order="source"), 2, spark=True) == in_order).all()


def test_a_data_feeder_moved_on_reads_what_the_one_that_read_them_reads_next_crops_and_mirrors_too(tmp_path):
    train = numbered(tmp_path / "train_lmdb")
    layer = text_format.Parse(f'name: "data" type: "Data" top: "data" top: "label" transform_param {{ mirror: true '
                              f'crop_size: 5 }} data_param {{ source: "{train}" batch_size: 7 backend: LMDB }}',
                              pb.LayerParameter())
    read, moved = (feeder_for(layer, pb.TRAIN, seed=9, shuffle=BLOCKS) for _ in range(2))
    for _ in range(20):  # 140 records of 60: into the third epoch
        read.next_batch()
    assert moved.skip(20) and moved.epoch == read.epoch == 2
    for _ in range(10):
        ours, theirs = moved.next_batch(), read.next_batch()
        assert all(np.array_equal(ours[top], theirs[top]) for top in ours)


def test_a_resumed_single_run_reads_on_in_its_shuffled_order_and_ends_where_the_uninterrupted_one_does(tmp_path):
    """A shuffled single run of 10 iterations snapshotted at 5, and a run resumed from that snapshot: the same final
    weights (on TensorFlow, which computes the same steps from the same batches), its log saying where it carried on;
    one that read epoch 0's order again would differ."""
    train = make_lmdb(tmp_path / "train_lmdb", RECORDS)  # labels 0 and 1, for the net's softmax
    solver = solver_at(tmp_path, train, data_order="shuffled", backend="tensorflow")
    solver.param.snapshot = 5
    nets.train(override(solver, output=str(tmp_path / "whole")))
    resumed = override(solver_at(tmp_path, train, data_order="shuffled", backend="tensorflow"),
                       output=str(tmp_path / "resumed"))
    nets.train(resumed, snapshot=str(tmp_path / "whole" / "tiny_iter_5.solverstate"))
    assert "Data order: carried on at iteration 5, 5 batches in (epoch 0)" in (tmp_path / "resumed" / "train.log").read_text()
    whole = checkpoint.read_caffemodel(str(tmp_path / "whole" / "tiny_iter_10.caffemodel"))
    again = checkpoint.read_caffemodel(str(tmp_path / "resumed" / "tiny_iter_10.caffemodel"))
    for (name, ours), (_, theirs) in zip(again, whole, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)


# A Python layer that passes the labels on, and appends each batch's to a file of its process's (one per worker).
RECORDER = '''import os
import caffe


class Recorder(caffe.Layer):
    def setup(self, bottom, top):
        self.path = os.path.join(self.param_str, "%d.txt" % os.getpid())

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data
        with open(self.path, "a") as out:
            out.write(" ".join(str(int(label)) for label in bottom[0].data) + "\\n")

    def backward(self, top, propagate_down, bottom):
        pass
'''

RECORDED_NET = """name: "recorded"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{train}" batch_size: 10 backend: LMDB }} }}
layer {{ name: "seen" type: "Python" bottom: "label" top: "seen"
  python_param {{ module: "order_recorder" layer: "Recorder" param_str: "{seen}" }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 1 weight_filler {{ type: "constant" }} }} }}
layer {{ name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "seen" top: "loss" }}
"""

RECORDED_SOLVER = """net: "{net}"
base_lr: 1e-12
lr_policy: "fixed"
max_iter: 24
snapshot_prefix: "{prefix}"
random_seed: 5
deepspark_param {{ workers: 2 period: 4 exchange_timeout: 60 connect_timeout: 120 }}
"""

# Two runs of the same solver on one DataFrame of 160 rows (row i labelled i), in one driver and one session.
DATAFRAME_RUNS = """
import sys, json, numpy as np
from deepspark.spark.session import spark_session
from deepspark.proto import deepspark_pb2 as pb
import deepspark
rng = np.random.default_rng(0)
rows = [(rng.integers(0, 255, size=(8, 8)).tolist(), i) for i in range(160)]
spark, _ = spark_session(pb.DeepSparkParameter(), 2)
df = spark.createDataFrame(rows, ["data", "label"]).cache()
for solver in sys.argv[1:]:
    print(json.dumps(deepspark.train(solver, data=df).summary["iterations"]))
"""


@pytest.mark.spark
def test_a_dataframe_fed_shard_is_shuffled_every_epoch_on_the_executors(tmp_path):
    train = numbered(tmp_path / "train_lmdb")
    solvers = []
    for run in ("first", "second"):
        folder = tmp_path / run
        (folder / "seen").mkdir(parents=True)
        (folder / "order_recorder.py").write_text(RECORDER)
        (folder / "net.prototxt").write_text(RECORDED_NET.format(train=train, seen=folder / "seen"))
        # sync: its workers train in step, each its max_iter, 3 epochs of its shard (easgd's split the job's
        # iterations as their speeds go: under load one read a single epoch)
        (folder / "solver.prototxt").write_text(RECORDED_SOLVER.format(net=folder / "net.prototxt",
                                                                       prefix=folder / "out" / "recorded")
                                                .replace("workers: 2", "workers: 2 algorithm: SYNC"))
        solvers.append(str(folder / "solver.prototxt"))
    done = subprocess.run([sys.executable, "-c", DATAFRAME_RUNS, *solvers], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["24", "24"]
    assert "Data order: shuffled per epoch (seed 5 and the worker's rank)" in done.stderr
    runs = []
    for run in ("first", "second"):
        seen = {}  # a worker's shard (its records) -> the labels it read, in order
        for name in os.listdir(tmp_path / run / "seen"):
            lines = (tmp_path / run / "seen" / name).read_text().split()
            labels = np.array(lines, dtype=int)
            seen[frozenset(labels.tolist())] = labels
        assert len(seen) == 2 and sorted(r for shard in seen for r in shard) == list(range(160)), seen.keys()
        runs.append(seen)
    assert set(runs[0]) == set(runs[1])  # each worker the same shard in both runs
    for shard, labels in runs[0].items():
        size = len(shard)
        epochs = labels[:len(labels) // size * size].reshape(-1, size)
        assert len(epochs) >= 2, (size, len(labels))
        assert_shuffled_epochs(epochs, shard)
        again = runs[1][shard]
        common = min(len(labels), len(again))
        assert (again[:common] == labels[:common]).all()  # the same seed, the same orders


# A job of each algorithm run whole and resumed from its first snapshot before its end, in one driver and one
# session (argv: the recorded folders, named by algorithm, each with solver.prototxt and resumed.prototxt); prints
# each resume's iteration.
RESUMED_RUNS = """
import glob, os, re, sys
import deepspark
for folder in sys.argv[1:]:
    algorithm = os.path.basename(folder)
    last = deepspark.train(os.path.join(folder, "solver.prototxt"), algorithm=algorithm).summary["iterations"]
    snapshots = glob.glob(os.path.join(folder, "out", "recorded_iter_*.solverstate"))
    at = min(int(re.search(r"_iter_(\\d+)", path).group(1)) for path in snapshots)
    assert at < last, snapshots
    deepspark.train(os.path.join(folder, "resumed.prototxt"), algorithm=algorithm,
                    snapshot=os.path.join(folder, "out", f"recorded_iter_{at}.solverstate"))
    print(at)
"""

# The Recorder with each batch's time (one clock for the processes of a machine): PySpark may run an average job's
# rounds of one worker in several Python workers, so a worker's batches are found in several files.
TIMED_RECORDER = RECORDER.replace("import os", "import os\nimport time").replace(
    'out.write(" ".join(', 'out.write(str(time.monotonic_ns()) + " " + " ".join(')

# Each algorithm's job: (max_iter, snapshot). The driver snapshots an exchanger's job at the multiple it sees the
# workers pass (it looks every 0.5 s): long enough to see one before the end (here ~10 of 12 multiples seen);
# average's rounds end at every multiple.
RESUMED_JOBS = {"sync": (1200, 100), "average": (24, 12)}


def labels_by_shard(folder):
    """{the first record of a worker's shard (shard 0 or 1 of the 60 records): the labels it read, in order} of
    the timed Recorder files under `folder`."""
    batches = sorted(tuple(int(word) for word in line.split()) for name in os.listdir(folder)
                     for line in (folder / name).read_text().splitlines())
    seen = {}
    for _, *labels in batches:
        seen.setdefault(labels[0] // 30 * 30, []).extend(labels)
    return {first: np.array(labels) for first, labels in seen.items()}


@pytest.mark.spark
def test_a_resumed_spark_job_reads_on_in_each_workers_order_where_the_whole_job_did(tmp_path):
    """sync (workers joining the exchanger) and average (rounds on cached Trainers): a 2-worker shuffled job and
    the same job resumed from its first snapshot; each worker's batches after the resume are the ones the whole
    job read from that iteration on (not epoch 0's order again)."""
    train = numbered(tmp_path / "train_lmdb")
    folders = []
    for algorithm, (max_iter, snapshot) in RESUMED_JOBS.items():
        folder = tmp_path / algorithm
        for run, name in (("whole", "solver"), ("resumed", "resumed")):
            (folder / run).mkdir(parents=True)
            (folder / f"{run}_net.prototxt").write_text(RECORDED_NET.format(train=train, seen=folder / run))
            (folder / f"{name}.prototxt").write_text(
                RECORDED_SOLVER.format(net=folder / f"{run}_net.prototxt", prefix=folder / "out" / "recorded")
                .replace("max_iter: 24", f"max_iter: {max_iter}\nsnapshot: {snapshot}"))
        (folder / "order_recorder.py").write_text(TIMED_RECORDER)
        folders.append(folder)
    done = subprocess.run([sys.executable, "-c", RESUMED_RUNS, *map(str, folders)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    for folder, at in zip(folders, map(int, done.stdout.split()), strict=True):
        max_iter = RESUMED_JOBS[folder.name][0]
        whole, resumed = (labels_by_shard(folder / run) for run in ("whole", "resumed"))
        assert sorted(whole) == sorted(resumed) == [0, 30], folder
        for shard, labels in whole.items():
            assert len(labels) == 10 * max_iter and len(resumed[shard]) == 10 * (max_iter - at), (folder, at)
            assert sorted(labels[:30]) == list(range(shard, shard + 30))
            assert (labels[:30] != labels[120:150]).any()  # epoch 4 in another order than epoch 0
            assert (resumed[shard] == labels[10 * at:]).all(), (folder, at)
