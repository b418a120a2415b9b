"""What a job itself costs (#14): the workers' start-up in parts, a driver without TensorFlow while its workers train, Python workers forked with the backend loaded; bench/startup.py's page section."""

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, load_script
from synthetic import make_job

from deepspark.spark import daemon
from deepspark.spark.executor import Summary

startup = load_script("bench/startup.py", "bench_startup")


def run_script(script):
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_start_up_parts_add_up_and_a_worker_forked_before_solving_has_no_fork_part():
    at = 1000.0
    fresh = Summary(0, forked_at=at + 1.0, task_at=at + 1.5, spill_seconds=0.25, import_seconds=0.0,
                    build_seconds=0.5, connect_seconds=0.05, first_step_seconds=1.0, first_step_at=at + 3.4)
    parts = fresh.startup(at)
    assert list(parts) == ["fork", "task start", "spill", "import", "build", "connect", "first step", "other"]
    assert parts["fork"] == 1.0 and parts["task start"] == 0.5 and abs(sum(parts.values()) - 3.4) < 1e-9
    assert abs(parts["other"] - 0.1) < 1e-9
    reused = Summary(0, forked_at=at - 60, task_at=at + 0.2, first_step_seconds=1.0, first_step_at=at + 1.3)
    assert reused.startup(at)["fork"] == 0 and abs(reused.startup(at)["task start"] - 0.2) < 1e-9
    assert Summary(0).startup(at) == {}  # no first step here: nothing to say


@pytest.mark.spark
def test_a_job_trains_with_no_tensorflow_in_the_driver_and_its_workers_account_for_their_start_up(tmp_path):
    solver = make_job(tmp_path, max_iter=40, test_interval=0)
    script = f"""
import json, sys
import deepspark
from deepspark.spark import job

seen = {{}}
finish = job.Job.finish

def watched(self, results):  # training is over, the last test not yet run
    seen["tensorflow"] = "tensorflow" in sys.modules
    return finish(self, results)

job.Job.finish = watched
summary = deepspark.train({solver!r}, workers=2).summary
print(json.dumps({{**summary, "tensorflow_while_training": seen["tensorflow"],
                  "tensorflow_after": "tensorflow" in sys.modules}}))
"""
    done = run_script(script)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # With no test_interval the driver never tests (Caffe's rule, as the single run's) and so never loads
    # TensorFlow: no test net, its scalars written without it.
    log = (tmp_path / "out" / "train.log").read_text()
    assert summary["iterations"] == 40 and summary["tensorflow_while_training"] is False
    assert summary["tensorflow_after"] is False and not any(key.startswith("test0/") for key in summary)
    assert "Test net output" not in log and "Optimization Done." in log
    from test_spark import tensorboard_tags

    assert {"train/loss", "train/learning_rate", "exchange/latency_ms"} <= tensorboard_tags(tmp_path / "out" /
                                                                                              "tensorboard")
    lines = re.findall(r"Start-up of worker (\d): ([\d.]+)s from Solving to its first step done: (.*)", log)
    assert sorted(int(w) for w, _, _ in lines) == [0, 1], log[-3000:]
    for worker, total, text in lines:
        parts = {name: float(s) for name, s in re.findall(r"([a-z][a-z ]*?) (-?[\d.]+)s", text)}
        assert list(parts) == ["fork", "task start", "spill", "import", "build", "connect", "first step", "other"]
        # The measured parts account for the time from Solving to the first step (the rest is a few lines of code),
        # and the worker, forked by our daemon, found the backend imported: no import of its own.
        assert abs(parts["other"]) <= 0.05 * float(total) + 0.01, text
        assert parts["import"] <= 0.02 * float(total), text
        assert parts["first step"] > 0 and parts["spill"] >= 0  # a small shard spills within the log's 0.01 s
    assert abs(max(float(t) for _, t, _ in lines) - summary["startup_seconds"]) < 0.01
    for worker in summary["workers"]:
        assert 0 < worker["forked_at"] <= worker["task_at"] < worker["ready_at"] < worker["first_step_at"]


@pytest.mark.spark
def test_local_python_workers_are_forks_of_a_daemon_that_loaded_the_backend():
    script = """
import json, os, sys
from deepspark.spark.session import spark_session
from deepspark.proto import deepspark_pb2 as pb

spark, started = spark_session(pb.DeepSparkParameter(), 2)

def look(_):
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as stream:
        parent = stream.read().split(b"\\0")
    keras = "keras" in sys.modules, os.environ.get("TF_USE_LEGACY_KERAS")
    import tensorflow as tf
    return [("tensorflow" in sys.modules, os.getppid(), [a.decode() for a in parent],
             [*keras, tf.keras.layers.Dense(3).units, tf.keras.__name__])]

seen = spark.sparkContext.parallelize(range(2), 2).mapPartitions(look).collect()
print(json.dumps({"started": started, "workers": seen, "driver_tensorflow": "tensorflow" in sys.modules}))
spark.stop()
"""
    result = json.loads(run_script(script).stdout.strip().splitlines()[-1])
    assert result["started"] and result["driver_tensorflow"] is False
    assert len(result["workers"]) == 2
    for loaded, parent, argv, keras in result["workers"]:
        assert loaded, "the task's Python worker had not imported TensorFlow before its task"
        assert argv[1:3] == ["-m", "deepspark.spark.daemon"], argv
        # TensorFlow's eager import of Keras was skipped (deepspark.backends.keras_deferred, asked for by the
        # daemon), and tf.keras is Keras 3 on use.
        assert keras == [False, None, 3, "keras._tf_keras.keras"], keras
    assert len({parent for _, parent, _, _ in result["workers"]}) == 1  # one daemon forked both


def test_the_cli_loads_tensorflow_without_its_eager_keras_and_tf_keras_still_loads_keras(tmp_path):
    make_job(tmp_path)
    script = f"""
import json, os, sys
from deepspark import cli
cli.main(["time", "--model", {str(tmp_path / "net.prototxt")!r}, "--iterations", "1"])
seen = ["tensorflow" in sys.modules, "keras" in sys.modules, os.environ.get("TF_USE_LEGACY_KERAS")]
import pkgutil
import tensorflow as tf
print(json.dumps(seen + [tf.keras.layers.Dense(3).units, len(list(pkgutil.iter_modules(tf.__path__))) > 0]))
"""
    assert json.loads(run_script(script).stdout.strip().splitlines()[-1]) == [True, False, None, 3, True]


@pytest.mark.spark
def test_the_daemon_is_the_zygotes_fork_the_jvm_launched_a_waiter_and_the_jvm_maps_the_class_archive():
    # make setup wrote the archive (tools/jvm-archive.py): the driver's JVM starts from it.
    script = """
import json, os, sys
from deepspark.spark.session import ZYGOTES, jvm_archive, spark_context, stop_context
from deepspark.proto import deepspark_pb2 as pb

sc, started = spark_context(pb.DeepSparkParameter(), 2)
zygote = ZYGOTES[sc]

def argv(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as stream:
        return [a.decode() for a in stream.read().split(b"\\0") if a]

def look(_):
    daemon = os.getppid()
    with open(f"/proc/{daemon}/stat") as stream:
        return [(daemon, int(stream.read().rsplit(")", 1)[1].split()[1]), "tensorflow" in sys.modules)]

seen = sc.parallelize(range(2), 2).mapPartitions(look).collect()
jvm = sc._gateway.proc.pid
def parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return int(stream.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None

children = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(int(p)) == jvm]
with open(f"/proc/{jvm}/maps") as stream:
    mapped = jvm_archive() in stream.read()
print(json.dumps({"zygote": zygote.pid, "zygote_argv": argv(zygote.pid), "workers": seen,
                  "jvm_children": [argv(c) for c in children], "archive_mapped": mapped}))
sc.stop()  # as a pyspark.ml script's spark.stop() does: not session.stop_context
print(json.dumps({"zygote_exit": zygote.wait(timeout=60), "folder": os.path.exists(os.path.dirname(zygote.args[-1]))}))
"""
    lines = run_script(script).stdout.strip().splitlines()
    result, ended = json.loads(lines[-2]), json.loads(lines[-1])
    assert result["zygote_argv"][1:4] == ["-m", "deepspark.spark.daemon", "--zygote"]
    assert len(result["workers"]) == 2 and all(loaded for _, _, loaded in result["workers"])
    daemons = {(daemon, parent) for daemon, parent, _ in result["workers"]}
    assert len(daemons) == 1 and daemons.pop()[1] == result["zygote"]  # one daemon, the zygote's fork
    # What the JVM launched handed its streams over and became a waiter (a few MB), not a second daemon.
    waiters = [a for a in result["jvm_children"] if "deepspark-daemon-waiter" in a]
    assert len(waiters) == 1 and not any("deepspark.spark.daemon" in a for a in result["jvm_children"])
    assert result["archive_mapped"], "the driver's JVM did not map make setup's class archive"
    assert ended["zygote_exit"] == 0  # its daemon stopped with the SparkContext, and so did it
    assert not ended["folder"]  # and it took its folder with it: stopped by sc.stop(), the driver removes none


def test_a_daemon_without_a_zygote_runs_alone_and_a_zygote_given_up_on_forks_nothing(tmp_path):
    assert daemon.hand_over(str(tmp_path / "none")) is None  # no zygote there: the daemon imports and runs itself
    path = str(tmp_path / "socket")
    # A zygote of a backend it does not import (caffe) answers at once; a hand-over that never says "go" (a daemon
    # that gave up waiting) leaves no fork behind: the zygote exits.
    zygote = subprocess.Popen([sys.executable, "-m", "deepspark.spark.daemon", "--zygote", path],
                              stdin=subprocess.PIPE, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT, "DEEPSPARK_DAEMON_BACKEND": "caffe"})
    deadline = time.time() + 60
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.05)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as link:
        link.settimeout(60)
        link.connect(path)
        read, write = os.pipe()
        payload = json.dumps({"environ": {}, "cwd": "/", "argv": ["x"]}).encode()
        socket.send_fds(link, [daemon.HEADER.pack(len(payload))], [read, write, write])
        link.sendall(payload)
        assert link.makefile("rb").readline() == b"ready\n"
    assert zygote.wait(timeout=60) == 0
    os.close(write)
    assert os.read(read, 4) == b""  # nothing wrote to the pipes it was handed
    os.close(read)


def record(run, startup_seconds, peak, alone, workers=1, **extra):
    return {"bench": "startup", "run": run, "workers": workers, "startup_seconds": startup_seconds,
            "parts": {"first step": startup_seconds} if run == "single" else
            {"fork": 0.5, "task start": 0.1, "first step": startup_seconds - 0.6},
            "to_first_step_seconds": startup_seconds + (2.0 if run == "single" else 0.0), "images_per_second": 5000,
            "peak_pss_mb": peak, "alone_peak_mb": alone,
            "pss_at_peak_mb": {"driver": peak}, "alone_at_peak_mb": {"driver": alone},
            "processes_at_peak": {"driver": 1}, **extra}


def test_the_page_section_tables_the_runs_and_says_whether_each_target_is_met(tmp_path):
    (tmp_path / "peers.jsonl").write_text(json.dumps({"run": "torchdistributor", "peak_pss_mb": 1300}) + "\n")
    records = [record("single", 0.0, 600, 650), record("single", 0.2, 600, 650),
               record("easgd", 3.9, 1000, 1250, workers=2), record("easgd", 4.5, 1000, 1350, workers=2)]
    section = startup.page_section(records, str(tmp_path))
    assert section.count("\n| single (1 worker) |") == 2 and section.count("| easgd (2 workers) |") == 2
    assert "| fork | task start | first step |" in section
    # medians from process start to the first step (the single runs' Solving 2 s after it): 4.2 s against 2.1 s is
    # 2x, met; 1,300 MB alone against TorchDistributor's 1,300 MB, met
    assert "2x the single process's, each from its process's start to its first step: met (2.00x" in section
    assert "TorchDistributor's PSS (1,300 MB, from" in section and ": met (1,300 MB alone, 1,000 MB PSS)" in section
    slower = startup.page_section(records[:2] + [record("easgd", 4.5, 1400, 1400, workers=2)], str(tmp_path))
    assert "not met (2.14x" in slower and "not met (1,400 MB alone" in slower
    assert "Not measured yet" in startup.page_section([], str(tmp_path))


def test_the_archive_tool_keeps_its_own_archive_and_the_three_newest_of_other_checkouts(tmp_path):
    """tools/jvm-archive.py's prune: a fresh clone's `make` (CI's every run) writes a ~70 MB archive of its own; the
    cache folder keeps this checkout's and KEEP others, the most recently written, and no day-old partial file."""
    spec = importlib.util.spec_from_file_location("jvm_archive_tool", os.path.join(ROOT, "tools", "jvm-archive.py"))
    tool = importlib.util.module_from_spec(spec)  # by its path: tools/ on sys.path would shadow bench/'s chaos.py
    spec.loader.exec_module(tool)
    now = time.time()
    paths = []
    for age in range(6):  # spark-...-0 the newest
        path = tmp_path / f"spark-4.3.0-{age}-classes.jsa"
        path.write_bytes(b"x")
        os.utime(path, (now - age * 60, now - age * 60))
        paths.append(path)
    ours = paths[5]  # this checkout's, the oldest of all: kept whatever its age
    leftover, fresh = tmp_path / "spark-4.3.0-9-classes.jsa.7.partial", tmp_path / "spark-4.3.0-8-classes.jsa.8.partial"
    leftover.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(leftover, (now - 2 * 86400, now - 2 * 86400))
    removed = tool.prune(str(ours))
    assert sorted(removed) == sorted(str(p) for p in (paths[3], paths[4], leftover))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in (*paths[:3], ours)] + [fresh.name])  # a partial file being written now stays
