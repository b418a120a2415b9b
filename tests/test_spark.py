"""The Spark job on real Spark: local[2], a standalone cluster, a DataFrame, a killed driver resumed with every worker's momentum."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pyspark
import pytest

from conftest import ROOT, run_cli
from deepspark import checkpoint
from sparkjobs import cluster, final_accuracy, read_until, start_training, workers_done
from synthetic import make_job

pytestmark = pytest.mark.spark

NOISE = re.compile(r"oneDNN|cuda|rebuild TensorFlow|^E0000|^I0000|^W0000|WARNING: All log|absl")


def test_local_two_workers_tensorflow(tmp_path):
    solver = make_job(tmp_path, max_iter=120, test_interval=60, snapshot=0)
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--worker-threads", "3")
    assert status == 0, log[-3000:]
    assert "Each worker computes on 3 threads (worker_threads 3)" in log
    # local[N,F]: F past any failure budget, which the driver counts for an exchanger's job (spark/budget.py)
    assert "on local[2,1000000] with 2 workers (tensorflow backend, async EASGD)" in log
    assert workers_done(log) == [0, 1]
    # each worker its own count, the two summing to 2 x max_iter (the exchanger's leases), exchanging every 4
    counts = re.findall(r"Worker \d on \S+ .*: (\d+) iterations, (\d+) exchanges, spilled 100 records", log)
    assert len(counts) == 2 and sum(int(n) for n, _ in counts) == 240, log[-3000:]
    assert all(int(n) // 4 <= int(e) <= int(n) // 4 + 3 for n, e in counts), counts
    assert re.search(r"Spill took [\d.]+s, [\d.]+% of training time", log)
    assert final_accuracy(log) >= 0.9
    # async workers run on past a test point (this job can pass 60 between two looks); a test
    # is still labelled with Caffe's multiple
    tested = [int(i) for i in re.findall(r"Iteration (\d+), Testing net", log)]
    assert tested[0] == 0 and tested[-1] == 120 and all(i % 60 == 0 for i in tested)
    out = sorted(os.listdir(tmp_path / "out"))
    assert {"tiny_iter_120.caffemodel", "tiny_iter_120.solverstate", "progress.png", "train.log",
            "tensorboard"} <= set(out)
    tags = tensorboard_tags(tmp_path / "out" / "tensorboard")
    assert {"train/loss", "train/learning_rate", "test0/accuracy", "exchange/latency_ms"} <= tags, tags
    # the center snapshot is a real .caffemodel that `test` scores like the final test did
    status, _, err = run_cli("test", "--model", str(tmp_path / "net.prototxt"), "--weights",
                             str(tmp_path / "out" / "tiny_iter_120.caffemodel"), "--iterations", "10")
    assert status == 0 and float(re.search(r"accuracy = ([\d.]+)", err).group(1)) == final_accuracy(log)


def tensorboard_tags(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    tags = events.Tags()
    return set(tags.get("scalars", [])) | set(tags.get("tensors", []))


@pytest.mark.caffe
def test_local_two_workers_caffe_shipping_records(tmp_path):
    solver = make_job(tmp_path, max_iter=120, test_interval=60)
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--backend", "caffe", "--ship-records")
    assert status == 0, log[-3000:]
    assert "(caffe backend, async EASGD)" in log and workers_done(log) == [0, 1]
    assert "Sharded 200 records into 2 shards (shipped through Spark from the driver" in log
    assert final_accuracy(log) >= 0.9


def test_dataframe_fed_run(tmp_path):
    solver = make_job(tmp_path, max_iter=100, test_interval=50)
    script = f"""
import sys, json, numpy as np
sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
from deepspark.spark.session import spark_session
from deepspark.proto import deepspark_pb2 as pb
import deepspark
rng = np.random.default_rng(0)
rows = []
for i in range(160):
    label = int(rng.integers(2))
    image = rng.integers(0, 60, size=(8, 8)).astype(np.uint8)
    image[(slice(0, 4) if label == 0 else slice(4, 8)), :] += 150
    rows.append((image.tolist(), label))
spark, _ = spark_session(pb.DeepSparkParameter(), 2)
df = spark.createDataFrame(rows, ["data", "label"])
summary = deepspark.train({solver!r}, data=df, workers=2).summary
assert spark.range(5).count() == 5  # the caller's session is still theirs, and running
print(json.dumps(summary))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training on a DataFrame of ['data', 'label'], repartitioned into 2 shards" in done.stderr
    assert workers_done(done.stderr) == [0, 1]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["iterations"] == 100 and summary["test0/accuracy"] >= 0.9


def test_a_dataframe_that_cannot_train_says_which_column_or_row(tmp_path):
    solver = make_job(tmp_path, max_iter=20, test_interval=0)
    script = f"""
import numpy as np
from deepspark.spark.session import spark_session
from deepspark.errors import DeepSparkError
from deepspark.proto import deepspark_pb2 as pb
import deepspark
spark, _ = spark_session(pb.DeepSparkParameter(max_failures=1), 2)
image = np.zeros((8, 8), np.uint8).tolist()
for rows in ([(image, "cat"), (image, "dog")], [(image, 0)] * 5 + [(np.zeros((9, 9), np.uint8).tolist(), 1)] + [(image, 1)] * 4):
    try:
        deepspark.train({solver!r}, data=spark.createDataFrame(rows, ["data", "label"]), workers=2)
    except DeepSparkError as error:
        print("error:", str(error).split("; Spark reports")[0])
print("still running:", spark.range(3).count())
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "error: the DataFrame's 'label' column holds string values; Caffe's labels are integers "
        "(cast it: df.withColumn('label', df.label.cast('int')))",
        "error: the Spark job failed: DataFrame row 5: its image is 1x9x9, the first row's is 1x8x8; "
        "a net takes images of one size",
        "still running: 3"], done.stdout + done.stderr[-3000:]


def test_workers_that_never_connect_fail_with_the_timeout_message(tmp_path):
    # One second is less than an executor needs to start TensorFlow, so no worker is in time.
    solver = make_job(tmp_path, max_iter=50, test_interval=0, connect_timeout=1)
    started = time.monotonic()
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2")
    assert status == 1
    last = log.strip().splitlines()[-1]
    assert re.search(r"only [01] of 2 workers connected to the exchanger within 1s; Spark reports \d+ executor", last)
    assert time.monotonic() - started < 120


def display_losses(text):
    """{iteration: loss} of the driver's `Iteration N, loss = L` lines."""
    return {int(i): float(loss) for i, loss in re.findall(r"Iteration (\d+), loss = ([\d.e+-]+)", text)}


# The killed-driver job's length: long enough that the driver, which looks at the workers every 0.5 s, sees them
# at a snapshot multiple (every 100) before the end on a loaded machine. At 600 iterations (~2.4 s unloaded) one
# fresh-clone `make test` took its first look when both workers had finished, and its only snapshot was the last.
RESUME_MAX_ITER = 2400


def test_killed_driver_resumes_from_its_snapshot_with_every_workers_momentum(tmp_path):
    solver = make_job(tmp_path, max_iter=RESUME_MAX_ITER, test_interval=RESUME_MAX_ITER, snapshot=100)
    driver = start_training(solver, "--workers", "2")
    try:
        lines = read_until(driver, r"Snapshotting solver state to binary proto file \S+tiny_iter_\d+\.solverstate")
        state = re.search(r"(\S+tiny_iter_(\d+)\.solverstate) \(with the solver history of 2 workers\)", lines[-1])
        assert state, lines[-1]
        path, snapshot_iter = state.group(1), int(state.group(2))
        # The run goes on unharmed for a few displays past the snapshot: what the resumed run is held to.
        while max(display_losses("".join(lines)), default=0) < min(snapshot_iter + 150, RESUME_MAX_ITER - 100):
            lines += read_until(driver, r"Iteration \d+, loss")
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:  # the line comes before the write
            time.sleep(0.05)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    assert 100 <= snapshot_iter < RESUME_MAX_ITER and snapshot_iter % 100 == 0  # named like Caffe's, by the multiple
    saved = checkpoint.read_solverstate(path)
    assert sorted(w.worker for w in saved.worker_state) == [0, 1]
    assert all(any(w.history[0].data) for w in saved.worker_state)  # momentum, not zeros
    # each worker its own count: theirs together at least the job's at the snapshot (the exchanger's leases)
    assert sum(w.iter for w in saved.worker_state) >= 2 * snapshot_iter, [w.iter for w in saved.worker_state]
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--snapshot", path)
    assert status == 0, log[-3000:]
    assert f"Restoring previous solver status from {path}" in log
    assert re.search(r"Restoring the solver history of worker\(s\) 0, 1 \(as each was at iteration \d+, \d+\)", log)
    restored = re.findall(r"Worker \d on \S+ .*?: (\d+) iterations.*; started from its solver history of "
                          r"iteration (\d+)", log)
    assert len(restored) == 2 and sum(int(n) for n, _ in restored) == 2 * (RESUME_MAX_ITER - snapshot_iter), \
        log[-3000:]
    assert {int(i) for _, i in restored} == {w.iter for w in saved.worker_state}
    assert os.path.exists(tmp_path / "out" / f"tiny_iter_{RESUME_MAX_ITER}.caffemodel")
    assert final_accuracy(log) >= 0.9
    # The resumed run's loss at its first display does not jump above the interrupted run's own noise there
    # (the range its displays took from the one before the snapshot to the kill, widened by that range or by half
    # its top, whichever is more: with one or two displays in it the range is no measure of a loss that moves by
    # a few percent from batch to batch), as a resume that lost the workers' state would.
    # One-sided: this tiny job's loss is ~1e-4 and still falling, and the driver displays once per look (0.5 s,
    # ~250 iterations here), so below the range is not a jump.
    before, after = display_losses("".join(lines)), display_losses(log)
    first = min(i for i in after if i > snapshot_iter)
    window = [loss for i, loss in sorted(before.items()) if i >= snapshot_iter - 20]
    low, high = min(window), max(window)
    assert after[first] <= high + max(high - low, high / 2), (first, after[first], sorted(before.items()))


@pytest.fixture(scope="module")
def standalone_cluster(tmp_path_factory):
    """One standalone cluster for this module's tests: (master URL, its folder, a folder only the driver
    sees: the workers run in a mount namespace with it covered by an empty tmpfs, as on cluster nodes
    without that disk; None when that cannot be done here). Each worker offers one GPU address to Spark's
    resource scheduling (a fake one where the machine has no GPU), which only a job that asks for GPUs takes."""
    folder = tmp_path_factory.mktemp("standalone")
    hidden = folder / "driver_only" if os.geteuid() == 0 else None
    if hidden is not None:
        hidden.mkdir()
    with cluster(folder, hide=hidden, gpus=1) as (master, where):  # GPU addresses for test_gpu's placement
        yield master, where, hidden


def test_an_lmdb_the_executors_cannot_see_fails_at_once_with_the_ways_on(standalone_cluster):
    master, _, data = standalone_cluster
    if data is None:
        pytest.skip("hiding a folder from the workers takes a mount namespace (root)")
    solver = make_job(data, max_iter=50, test_interval=0)  # the LMDB is on the driver's disk only
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--master", master,
                             "--backend", "caffe", "--max-failures", "1")
    assert status == 1
    last = log.strip().splitlines()[-1]
    assert last.startswith(f"deepspark train: error: the Spark job failed: worker ") and \
        f"the LMDB {data / 'train_lmdb'} is not visible here; put it on storage every executor sees at that " \
        "path, or convert it to Parquet (deepspark convert-lmdb" in last and "--ship-records" in last, log[-3000:]
    assert "Solving" in log and "connect" not in last  # failed as the workers started, not on connect_timeout


def test_a_failed_job_is_reported_by_the_workers_own_error_line():
    from deepspark.spark.failures import first_line

    report = """An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.
org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 failed 4 times
  File "/work/main/deepspark/spark/sync.py", line 84, in train_worker
    raise executor.WorkerError(f"{where}: {error.reason}") from None
deepspark.spark.worker.WorkerError: worker 1 on vm: worker 0 left during the round of iteration 175
 SQLSTATE: 38000
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:1097)"""
    assert first_line(report) == "worker 1 on vm: worker 0 left during the round of iteration 175"
    assert first_line(report.replace("deepspark.spark.worker.WorkerError", "ValueError")) == \
        "ValueError: worker 1 on vm: worker 0 left during the round of iteration 175"
    assert first_line("org.apache.spark.SparkException: Job aborted\nmore") == "SparkException: Job aborted"


@pytest.mark.slow
def test_a_standalone_cluster_runs_a_task_on_each_worker_from_a_packed_environment_and_says_so_when_it_lacks_deepspark(
        tmp_path, standalone_cluster):
    master, cluster, _ = standalone_cluster
    # The Spark way: a venv packed with venv-pack (tools/pack-env.sh; the Caffe backend, so without TensorFlow).
    env = tmp_path / "deepspark-env.tar.gz"
    build = tmp_path / "build"
    packed = subprocess.run(["bash", os.path.join(ROOT, "tools", "pack-env.sh"), str(env)], cwd=ROOT,
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "EXTRAS": "", "BUILD": str(build), "COMPRESS": "1", "VENV": sys.prefix})
    assert packed.returncode == 0, packed.stdout + packed.stderr[-3000:]
    bare = tmp_path / "bare-env.tar.gz"  # a packed venv without deepspark
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    subprocess.run([str(build / "bin" / "venv-pack"), "-q", "-p", str(tmp_path / "bare"), "-o", str(bare)],
                   check=True, timeout=300)
    shutil.rmtree(build)  # nothing to fall back on: the archive is all the executors get

    solver = make_job(tmp_path, max_iter=60, test_interval=30)
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--master", master, "--backend", "caffe",
                             "--executor-env", str(env))
    assert status == 0, log[-3000:]
    assert f"on {master} with 2 workers" in log
    # This cluster runs without spark.authenticate: the job says once that its secret is readable, and how to fix it.
    assert log.count(f"{master}: Spark's RPC is not authenticated and encrypted, so the exchange secret travels") == 1
    assert "spark.authenticate=true" in log and "spark.network.crypto.enabled=true" in log
    places = re.findall(r"Worker \d on \S+ \(in ([^,)]*), deepspark from ([^)]*)\)", log)
    assert len(places) == 2, log[-3000:]
    assert {os.path.relpath(cwd, cluster).split(os.sep)[0] for cwd, _ in places} == {"work-1", "work-2"}
    for cwd, package in places:  # the archive Spark unpacked in the executor's own folder, not this checkout
        assert os.path.realpath(package).startswith(os.path.realpath(cluster)), (cwd, package)
        assert os.path.exists(os.path.join(cwd, "environment", "bin", "python"))
    assert final_accuracy(log) >= 0.9

    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--master", master, "--backend", "caffe",
                             "--executor-env", str(bare), "--max-failures", "1")
    assert status == 1
    assert log.strip().splitlines()[-1].startswith(
        "deepspark train: error: the Spark job failed: the executors' Python cannot import deepspark "
        "(ModuleNotFoundError: No module named 'deepspark'); ship an environment that has it: "
        "--executor-env ENV.tar.gz (tools/pack-env.sh packs one)"), log[-3000:]
    assert "Solving" in log and "connect" not in log  # it fails as the workers start, not on a timeout


GPU_LINE = re.compile(r"Worker (\d+) on \S+ .*; GPU (\S+) from Spark, computed on (\S+)")


def test_each_worker_takes_the_gpu_spark_gave_its_task_and_says_which(standalone_cluster, tmp_path):
    """Each worker takes the GPU address its task was given, a distinct one, and says which; where no GPU is
    present one line says so. Submitted as a GPU cluster's job is (README, "On GPU nodes")."""
    master = standalone_cluster[0]
    solver = make_job(tmp_path, max_iter=20, test_interval=0)  # the placement is the point: a short job, no tests
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1"}
    command = [os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit"), "--master", master, "--conf", "spark.executor.cores=1",
               "--conf", "spark.executor.resource.gpu.amount=1", "--conf", "spark.task.resource.gpu.amount=1",
               "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
               os.path.join(ROOT, "deepspark", "cli.py"), "train", "--solver", solver, "--workers", "2"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert workers_done(log) == [0, 1]
    placed = {int(worker): (address, device) for worker, address, device in GPU_LINE.findall(log)}
    assert sorted(placed) == [0, 1], log[-4000:]
    assert sorted(address for address, _ in placed.values()) == ["0", "1"]  # one GPU each, never the same
    from deepspark.backends import device  # deferred: it imports the backend

    if device("tensorflow") == "CPU":  # no GPU on this machine: the addresses are the discovery scripts' alone
        assert all(where == "CPU" for _, where in placed.values())
        said = [line for line in log.splitlines() if "but the tensorflow backend saw none" in line]
        assert len(said) == 1 and "Spark gave 2 of the workers a GPU" in said[0], log[-4000:]
    else:  # each worker's process sees only its own GPU, as CUDA's device 0
        assert all(where == "GPU:0" for _, where in placed.values())
