"""What a new Caffe or Spark user meets first: a missing LMDB named as such, out-of-range flags refused in
one line before anything starts, `| head` ending quietly, distributed snapshots that pycaffe restores, a
console without TensorFlow's or Spark's banners whose progress line nothing cuts into."""

import os
import re
import subprocess
import sys

import pytest
from google.protobuf import text_format

from conftest import ROOT, run_cli
from synthetic import make_job

from deepspark import checkpoint
from deepspark.proto import deepspark_pb2 as pb


def relative_source_job(folder):
    """The tiny job with its train net reading `train_lmdb` relative to the working directory, as BVLC
    nets read `examples/mnist/...`; the LMDB is not there."""
    solver = make_job(folder)
    net = folder / "net.prototxt"
    net.write_text(net.read_text().replace(str(folder / "train_lmdb"), "train_lmdb"))
    return solver


@pytest.mark.parametrize("algorithm", ["single", "easgd"])
def test_a_missing_lmdb_is_named_with_where_a_relative_source_was_read(tmp_path, algorithm):
    solver = relative_source_job(tmp_path)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    status, _, err = run_cli("train", "--solver", solver, "--algorithm", algorithm, cwd=str(cwd))
    assert status == 1
    last = err.strip().splitlines()[-1]
    assert last == (f"deepspark train: error: {tmp_path / 'net.prototxt'}:2:1: layer 'data': source 'train_lmdb' "
                    f"not found (a relative source is read from the current directory, {cwd}, as Caffe reads it); "
                    "create it or correct the path"), err[-2000:]
    assert "Solving" not in err  # said before Spark or the backend start


@pytest.mark.parametrize("flags, line", [
    (["--workers", "0"], "workers must be at least 1, not 0"),
    (["--period", "0"], "period must be at least 1, not 0"),
    (["--moving-rate", "-0.5"], r"moving_rate must be in \(0, 1\], not -0.5"),
    (["--iterations", "0"], "iterations must be at least 1, not 0"),
    (["--workers", "-3"], "argument --workers: must not be negative, not -3"),
    (["--algorithm", "hogwild"], "argument --algorithm: invalid choice: 'hogwild'"),
])
def test_out_of_range_flags_are_one_line_before_anything_starts(tmp_path, flags, line):
    status, _, err = run_cli("train", "--solver", make_job(tmp_path), *flags)
    assert status in (1, 2) and len(err.strip().splitlines()) == 1, err[-2000:]
    assert re.search(line, err), err


def test_describe_into_head_ends_quietly():
    done = subprocess.run(f"{sys.executable} -m deepspark.cli describe models/googlenet | head -2", shell=True,
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert len(done.stdout.splitlines()) == 2 and done.stderr == "", done.stderr


def caffe_solver(solver_path, folder):
    """A copy of a solver that real Caffe parses, without DeepSpark's deepspark_param block (and without
    its test net: the restore is what is tested)."""
    param = text_format.Parse(open(solver_path).read(), pb.SolverParameter())
    for field in ("deepspark_param", "test_iter", "test_interval"):
        param.ClearField(field)
    path = folder / "caffe_solver.prototxt"
    path.write_text(text_format.MessageToString(param))
    return str(path)


DISTRIBUTED = ["easgd", "sync", "average"]

# Trains each solver given as ALGORITHM SOLVER pairs for 2 workers, all in this one driver process and its
# one Spark session (a job runs in the caller's active session): one JVM start for the three.
TRAIN_EACH = """
import sys
import deepspark
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.session import spark_session
spark, _ = spark_session(pb.DeepSparkParameter(), 2)
for algorithm, solver in zip(sys.argv[1::2], sys.argv[2::2]):
    deepspark.train(solver, workers=2, algorithm=algorithm)
spark.stop()
"""

# Restores each .solverstate given as SOLVER STATE pairs in real pycaffe and steps 2 iterations on.
RESTORE_EACH = """
import sys
import caffe
caffe.set_mode_cpu()
for solver_path, state in zip(sys.argv[1::2], sys.argv[2::2]):
    solver = caffe.get_solver(solver_path)
    solver.restore(state)
    start = solver.iter
    solver.step(2)
    print(start, solver.iter)
"""


@pytest.fixture(scope="module")
def restored(tmp_path_factory):
    """{algorithm: (iteration pycaffe restored, iteration after 2 more steps, the workers whose own solver
    state the snapshot holds)} for a 20-iteration 2-worker run of each distributed algorithm, snapshotted at 20."""
    folder = tmp_path_factory.mktemp("distributed")
    solvers = {}
    for algorithm in DISTRIBUTED:
        (folder / algorithm).mkdir()
        solvers[algorithm] = make_job(folder / algorithm, max_iter=20, test_interval=0, snapshot=20)
    done = subprocess.run([sys.executable, "-c", TRAIN_EACH, *[a for pair in solvers.items() for a in pair]],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    pairs = [(caffe_solver(solvers[a], folder / a), str(folder / a / "out" / "tiny_iter_20.solverstate"))
             for a in DISTRIBUTED]
    done = subprocess.run([sys.executable, "-c", RESTORE_EACH, *[p for pair in pairs for p in pair]], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    workers = [sorted(w.worker for w in checkpoint.read_solverstate(state).worker_state) for _, state in pairs]
    return {algorithm: (*(int(n) for n in line.split()), saved)
            for algorithm, line, saved in zip(DISTRIBUTED, done.stdout.splitlines(), workers)}


@pytest.mark.spark
@pytest.mark.caffe
@pytest.mark.parametrize("algorithm", DISTRIBUTED)
def test_pycaffe_restores_a_distributed_snapshot_and_steps_on(restored, algorithm):
    # pycaffe skips the workers' own solver states that easgd and sync snapshots hold for our resume
    assert restored[algorithm] == (20, 22, [] if algorithm == "average" else [0, 1])


@pytest.mark.caffe
def test_every_zoo_solver_is_one_real_caffe_parses():
    script = """
import glob, sys
from google.protobuf import text_format
from caffe.proto import caffe_pb2
paths = sorted(glob.glob("models/*/solver.prototxt"))
for path in paths:
    text_format.Parse(open(path).read(), caffe_pb2.SolverParameter())
print(len(paths))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout) == len(os.listdir(os.path.join(ROOT, "models")))


def test_deepspark_knobs_from_their_own_file_embedded_block_then_file_then_flags(tmp_path):
    from deepspark.config import load_solver, override

    solver = make_job(tmp_path)  # its deepspark_param block: workers 2, period 4, moving_rate 0.4, ...
    assert load_solver(solver).param.deepspark_param.period == 4
    (tmp_path / "deepspark.prototxt").write_text("period: 7\nalgorithm: SYNC\n")
    ds = load_solver(solver).param.deepspark_param
    assert (ds.period, ds.algorithm, ds.workers) == (7, pb.DeepSparkParameter.SYNC, 2)  # file over block
    other = tmp_path / "other.prototxt"
    other.write_text("period: 9\n")
    ds = override(load_solver(solver, str(other)), period=11).param.deepspark_param
    assert (ds.period, ds.algorithm) == (11, pb.DeepSparkParameter.EASGD)  # --deepspark replaces the file beside
    other.write_text("peroid: 9\n")
    with pytest.raises(Exception, match=r"other.prototxt:1:1: .*unknown field 'peroid' in DeepSparkParameter"):
        load_solver(solver, str(other))
    ds = load_solver(os.path.join(ROOT, "models/lenet/solver.prototxt")).param.deepspark_param
    assert (ds.workers, ds.period, round(ds.moving_rate, 6)) == (2, 32, 0.45)  # the zoo's, beside its solver


def test_a_solver_where_a_net_is_expected_and_a_missing_python_module_are_named(tmp_path):
    status, _, err = run_cli("describe", "models/lenet/solver.prototxt")
    assert status == 1 and err.strip() == (
        "deepspark describe: error: models/lenet/solver.prototxt:2:1: this is a solver prototxt ('net' is a solver "
        "field), where a net is expected; give the net it names, or the model folder")
    # A Python layer whose module is nowhere: one line at the layer (Python layers run: tests/test_python_layer.py).
    net = tmp_path / "python.prototxt"
    net.write_text("name: 'x'\nlayer {\n  python_param { module: 'm' layer: 'L' }\n  name: 'py'\n  type: 'Python'\n"
                   "  top: 'data'\n}\n")
    status, _, err = run_cli("describe", str(net))
    assert status == 1 and err.count("\n") == 1
    assert f"{net}:2:1: layer 'py' (Python): cannot import module 'm' (looked in {tmp_path} and sys.path" in err


def test_a_bad_solver_value_points_at_its_line(tmp_path):
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{ROOT}/models/lenet/train_val.prototxt"\nbase_lr: 0.01\nlr_policy: "invv"\n')
    status, _, err = run_cli("train", "--solver", str(solver))
    assert status == 1 and err.strip().splitlines()[-1] == (
        f"deepspark train: error: {solver}:3:1: lr_policy: unknown policy 'invv'; "
        "supported: fixed, step, exp, inv, multistep, poly, sigmoid")


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_solver_mode_gpu_says_once_where_the_backend_runs(tmp_path, backend):
    solver = make_job(tmp_path, max_iter=10, test_interval=0)
    with open(solver, "a") as stream:
        stream.write("solver_mode: GPU\n")
    status, _, err = run_cli("train", "--solver", solver, "--algorithm", "single", "--backend", backend)
    assert status == 0, err[-3000:]
    said = re.findall(r"solver_mode: GPU.*", err)
    assert said == [f"solver_mode: GPU, but the {backend} backend has no GPU here: it runs on the CPU"], said


# What TensorFlow and Spark print at start when nobody silences them (their banner lines).
BANNERS = ("oneDNN", "cpu_feature_guard", "absl::", "This TensorFlow binary", "To enable the following instructions",
           "log4j", "Setting default log level", "setLogLevel", "NativeCodeLoader", "incubator modules", " WARN ")
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ deepspark\] ")
# A worker's part of the progress line: `loss -` until it reports one (never `loss nan`).
_WORKER = r"w\d+: (waiting|it \d+/\d+ loss (-|\d+\.\d{4}) ex \d+( \([\d.]+ ms, [\d.]+s ago\))?)"
PROGRESS_LINE = re.compile(rf"^{_WORKER}( \| {_WORKER})*$")


def on_a_terminal(args, cwd=ROOT):
    """(exit status, everything written to the terminal) of `args` run with a pseudo-terminal as its
    stdout and stderr, as a user at a console sees it."""
    import pty

    leader, follower = pty.openpty()
    process = subprocess.Popen(args, cwd=cwd, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                               env={**os.environ, "PYTHONPATH": ROOT})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return process.wait(timeout=600), b"".join(chunks).decode("utf-8", "replace")


def screen_pieces(text):
    """The pieces a terminal shows one by one: a line, or one drawing of the progress line (each
    drawing starts by clearing the line, `\\r\\033[K`)."""
    return [piece for piece in re.split(r"\r?\n|\r\x1b\[K", text) if piece]


@pytest.mark.spark
def test_the_two_worker_demo_prints_no_banner_and_its_progress_line_is_never_cut(tmp_path):
    # `make demo`'s job, shortened: LeNet on Fashion-MNIST, 2 workers, EASGD, TensorFlow, at a terminal.
    status, text = on_a_terminal([sys.executable, "-m", "deepspark.cli", "train", "--solver",
                                  "models/lenet/solver.prototxt", "--workers", "2", "--iterations", "20",
                                  "--output", str(tmp_path)])
    assert status == 0, text[-3000:]
    pieces = screen_pieces(text)
    assert [p for p in pieces if any(banner in p for banner in BANNERS)] == []
    # Every piece is one of ours, whole: a log line, or the progress line alone (not cut by another line).
    assert [p for p in pieces if not (GLOG_LINE.match(p) or PROGRESS_LINE.match(p))] == [], text[-3000:]
    assert any(p.startswith("w0: it ") for p in pieces) and "Optimization Done." in text


@pytest.mark.spark
def test_worker_output_lands_above_the_progress_line_and_the_callers_session_stays_up(tmp_path):
    script = f"""
import sys, time
import deepspark
from deepspark.log import Log
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.session import spark_session
spark, started = spark_session(pb.DeepSparkParameter(), 2)
log = Log(progress=True)
log.progress("w0: it 1/2 loss - ex 0")
def shout(i):
    import sys
    # One write a line: Spark runs its Python workers unbuffered (PYTHONUNBUFFERED), where print writes the text
    # and its newline apart, and two workers that print at once interleave on the shared pipe.
    sys.stderr.write(f"worker line {{i}}\\n")
spark.sparkContext.parallelize(range(4), 2).foreach(shout)
time.sleep(1)
log.progress("w0: it 2/2 loss - ex 0")
log.close()
deepspark.train({make_job(tmp_path, max_iter=20, test_interval=0)!r}, workers=2, backend="caffe")
print("still running:", spark.range(5).count(), "started:", started)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    out, err = done.stdout.decode(), done.stderr.decode()  # bytes: the terminal's \r kept
    assert done.returncode == 0, err[-3000:]
    assert out.splitlines()[-1] == "still running: 5 started: True"  # deepspark.train left it running
    pieces = screen_pieces(err)
    assert sorted(p for p in pieces if p.startswith("worker line")) == [f"worker line {i}" for i in range(4)]
    assert [p for p in pieces if any(banner in p for banner in BANNERS)] == []
    assert "Optimization Done." in err


def test_an_error_after_tensorflow_loads_is_alone_on_the_console(tmp_path):
    solver = make_job(tmp_path)
    weights = pb.NetParameter()  # a .caffemodel whose 'conv' blob has another shape than the net's
    blob = weights.layer.add(name="conv", type="Convolution").blobs.add()
    blob.shape.dim.extend([8, 1, 3, 3])
    blob.data.extend([0.0] * 72)
    (tmp_path / "other.caffemodel").write_bytes(weights.SerializeToString())
    status, _, err = run_cli("train", "--solver", solver, "--algorithm", "single", "--backend", "tensorflow",
                             "--weights", str(tmp_path / "other.caffemodel"))
    assert status == 1
    lines = err.strip().splitlines()
    assert lines[-1].startswith("deepspark train: error: ") and "conv" in lines[-1], err[-2000:]
    assert [line for line in lines[:-1] if not GLOG_LINE.match(line)] == [], err[-2000:]  # no banner before it


def test_tensorflow_compiles_caffes_parameterless_neurons_without_a_warning(tmp_path):
    net = tmp_path / "neurons.prototxt"
    chain = [("Sigmoid", "data"), ("TanH", "sigmoid"), ("AbsVal", "tanh"), ("BNLL", "absval")]
    net.write_text('name: "neurons"\n'
                   'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }\n'
                   + "".join(f'layer {{ name: "{kind.lower()}" type: "{kind}" bottom: "{bottom}" '
                             f'top: "{kind.lower()}" }}\n' for kind, bottom in chain))
    status, _, err = run_cli("time", "--model", str(net), "--backend", "tensorflow", "--iterations", "1")
    assert status == 0, err[-2000:]
    assert [line for line in err.splitlines() if not GLOG_LINE.match(line)] == [], err[-2000:]  # no AutoGraph lines


def test_native_start_up_lines_are_held_back_and_the_rest_reaches_stderr(tmp_path):
    """log.import_quietly: what native code prints to fd 2 while a module loads reaches stderr, but for
    TensorFlow's start-up banner (printed on CPUs where it turns oneDNN on, whatever TF_CPP_MIN_LOG_LEVEL says)."""
    (tmp_path / "noisy.py").write_text(
        "import os\n"
        "os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n')\n"
        "os.write(2, b'I0000 00:00:1796165047.185893   15904 port.cc:153] oneDNN custom operations are on. "
        "You may see slightly different numerical results\\n')\n"
        "os.write(2, b'E0000 something real went wrong\\n')\n")
    done = subprocess.run([sys.executable, "-c", "from deepspark.log import import_quietly; import_quietly('noisy'); "
                                                 "import sys; print('after', file=sys.stderr)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["E0000 something real went wrong", "after"]
