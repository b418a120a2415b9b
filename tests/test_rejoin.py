"""Fast rejoin (#45): a lost worker's replacement carries on its shard where the lost one stood (feeders moved on, every record once an epoch), and on a standalone cluster its Python worker is the daemon's fork with TensorFlow already imported."""

import collections
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from deepspark import engine, nets
from deepspark.config import load_solver
from deepspark.data import decode_datum, encode_datum, feeder_for, lmdb_io
from deepspark.data.datum import array_to_image
from deepspark.data.feeder import DataFeeder
from deepspark.data.resume import BLOCKS
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark import executor
from deepspark.spark.shards import Range
from sparkjobs import cluster, kill_while_training, start_runs
from synthetic import make_job

SIZE, BATCH = 42, 4  # 21 batches are two epochs exactly: a batch spans the seam between epochs


def labelled_lmdb(path):
    """An LMDB whose record i has label i: a batch's labels name the records it read."""
    images = np.random.default_rng(0).integers(0, 255, (SIZE, 1, 3, 3), dtype=np.uint8)
    lmdb_io.write_lmdb(str(path), ((b"%08d" % i, encode_datum(image, i)) for i, image in enumerate(images)))
    return str(path)


def data_layer(source):
    return text_format.Parse(f'name: "data" type: "Data" top: "data" top: "label" '
                             f'data_param {{ source: "{source}" batch_size: {BATCH} backend: LMDB }}', pb.LayerParameter())


def labels(feeder, batches):
    return [int(label) for _ in range(batches) for label in feeder.next_batch()["label"]]


# A worker's process spills its range of the LMDB, leaves a half-written spill and a streamed one behind, and is
# SIGKILLed (argv: the source, the job's folder's parent, what to leave).
SPILL_AND_DIE = """import os, signal, sys
os.environ["SPARK_LOCAL_DIRS"] = sys.argv[2]
from deepspark.spark import executor
from deepspark.spark.shards import Range
from deepspark.spark.shards import Range
path, count, _ = executor.spill(Range(sys.argv[1], 10, 30, 42), "job", 1)
folder = executor.job_dir("job")
pid = os.getpid()
for name in (f"shard-1-pid{pid}_lmdb", f"shard-1-0-10_lmdb.tmp-{pid}", f"shard-0-pid{pid}_lmdb"):
    os.makedirs(os.path.join(folder, name))
print(path, count, os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_workers_replacement_takes_its_whole_spill_and_clears_what_dead_processes_left(tmp_path,
                                                                                                monkeypatch):
    source = labelled_lmdb(tmp_path / "source_lmdb")
    done = subprocess.run([sys.executable, "-c", SPILL_AND_DIE, source, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    path, count, pid = done.stdout.split()
    assert int(count) == 20
    written = os.stat(os.path.join(path, "data.mdb")).st_mtime_ns
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
    taken, records, _ = executor.spill(Range(source, 10, 30, 42), "job", 1)
    assert (taken, records) == (path, 20) and os.stat(os.path.join(path, "data.mdb")).st_mtime_ns == written
    assert [int(label) for _, value in lmdb_io.read_records(taken, 0, 20)
            for label in [decode_datum(value, b"", taken)[1]]] == list(range(10, 30))
    # Worker 1's dead process's leftovers are gone; worker 0's (another worker: not its to clear) stay.
    assert sorted(os.listdir(executor.job_dir("job"))) == [f"shard-0-pid{pid}_lmdb", "shard-1-10-30_lmdb"]


@pytest.mark.parametrize("shuffle", [False, True, BLOCKS])
def test_a_feeder_moved_on_k_batches_reads_what_the_one_that_read_them_reads_next(tmp_path, shuffle):
    source = labelled_lmdb(tmp_path / "lmdb")
    lost = DataFeeder(data_layer(source), pb.TRAIN, seed=7, shuffle=shuffle)
    replacement = DataFeeder(data_layer(source), pb.TRAIN, seed=7, shuffle=shuffle)
    read = labels(lost, 13)  # into the second epoch
    assert replacement.skip(13) and replacement.epoch == lost.epoch == 1
    carried = labels(replacement, 8)
    assert carried == labels(lost, 8)
    # The lost worker's records and its replacement's: every record once in each of the two epochs.
    seen = read + carried
    for epoch in (seen[:SIZE], seen[SIZE:]):
        assert collections.Counter(epoch) == collections.Counter(range(SIZE))


def test_an_image_list_feeder_moved_on_reads_what_the_one_that_read_them_reads_next_crops_and_mirrors_too(tmp_path):
    (tmp_path / "images").mkdir()
    pixels = np.random.default_rng(0).integers(0, 256, (10, 1, 6, 6), dtype=np.uint8)
    for i in range(10):
        array_to_image(pixels[i]).save(tmp_path / "images" / f"{i}.png")
    (tmp_path / "list.txt").write_text("".join(f"{i}.png {i}\n" for i in range(10)))
    layer = text_format.Parse(f'name: "data" type: "ImageData" top: "data" top: "label" transform_param {{ '
                              f'mirror: true crop_size: 4 }} image_data_param {{ source: "{tmp_path}/list.txt" '
                              f'root_folder: "{tmp_path}/images/" batch_size: 3 shuffle: true is_color: false }}',
                              pb.LayerParameter())
    lost, replacement = (feeder_for(layer, pb.TRAIN, seed=5) for _ in range(2))
    read = labels(lost, 7)
    assert replacement.skip(7) and replacement.epoch == lost.epoch == 2
    for _ in range(3):  # the same records, cropped and mirrored as the lost feeder's next draws do
        ours, theirs = replacement.next_batch(), lost.next_batch()
        assert all(np.array_equal(ours[top], theirs[top]) for top in ours)
        read += [int(label) for label in ours["label"]]
    assert sorted(read[:10]) == sorted(read[10:20]) == list(range(10))


def test_a_replacement_trainer_carries_on_the_shard_where_the_lost_worker_stood(tmp_path):
    solver = load_solver(make_job(tmp_path, train_records=30))
    lost = nets.trainer(solver, rank=1, evaluate=False, spark=True)
    replacement = nets.trainer(solver, rank=1, evaluate=False, spark=True)
    try:
        for _ in range(7):  # 70 records of 30: into its third epoch
            lost.step()
        replacement.model.iter = lost.model.iter  # as join_center sets it from the exchanger
        assert executor.carry_on(1, replacement) == 7
        assert [f.epoch for f in replacement.feeders] == [f.epoch for f in lost.feeders] == [2]
        for _ in range(3):
            ours, theirs = engine.next_batch(replacement.feeders), engine.next_batch(lost.feeders)
            assert all(np.array_equal(ours[top], theirs[top]) for top in ours)
        # A resumed job's worker joins at the snapshot's iteration and carries on there too, not at epoch 0.
        again = nets.trainer(solver, rank=1, evaluate=False, spark=True)
        again.model.iter = 10
        assert executor.carry_on(1, again) == 10 and again.feeders[0].epoch == 3  # 100 records of 30
        again.close()
    finally:
        lost.close()
        replacement.close()


# The tiny job on one executor core each: long enough that the survivor trains on while its peer rejoins.
CLUSTER_MAX_ITER = 6000


@pytest.mark.spark
@pytest.mark.slow
def test_a_killed_workers_replacement_on_a_standalone_cluster_is_forked_with_tensorflow_and_carries_on(tmp_path):
    with cluster(tmp_path) as (master, _):
        (tmp_path / "job").mkdir()
        solver = make_job(tmp_path / "job", max_iter=CLUSTER_MAX_ITER, test_interval=CLUSTER_MAX_ITER,
                          connect_timeout=120)
        driver = start_runs([solver], workers=2, master=master, max_failures=4)
        stdout, stderr, kills = kill_while_training(driver, tmp_path / "job" / "out" / "train.log", CLUSTER_MAX_ITER,
                                                    1, 5, (0.1, 0.3), timeout=300, wait=600)
        text = (tmp_path / "job" / "out" / "train.log").read_text()
        assert driver.returncode == 0, stderr[-3000:]
        assert len(kills) == 1 and kills[0].rejoined_at, text[-3000:]
        rejoined = re.findall(r"Worker (\d) rejoined the exchanger \(connection 2\); it goes on from the center at "
                              r"iteration (\d+)", text)
        assert len(rejoined) == 1, text[-3000:]
        worker, iteration = int(rejoined[0][0]), int(rejoined[0][1])
        summary = {w["worker"]: w for w in json.loads(stdout.splitlines()[-1])["workers"]}
        replacement = summary[worker]
        assert replacement["pid"] != kills[0].pid
        # Its process had TensorFlow before its task began: the executor's daemon forked it with it imported.
        assert replacement["preloaded"] == "tensorflow" and summary[1 - worker]["preloaded"] == "tensorflow"
        # It read on from where the lost worker stood: an iteration's batch per iteration trained before.
        assert 0 < iteration < CLUSTER_MAX_ITER and replacement["carried_batches"] == iteration
        assert summary[1 - worker]["carried_batches"] == 0
        assert re.search(rf"Start-up of worker {worker}: .* import ", text)
