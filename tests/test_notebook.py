"""A data scientist's notebook, run in a real Jupyter kernel (nbclient) on the venv's Python registered as the README
says (`python -m ipykernel install`), with PATH not holding the venv: Fashion-MNIST rows as vectors in [0, 1],
StringIndexer, a DeepSparkEstimator fit in a Pipeline, its history plotted, evaluate, save/load, MLflow (sqlite), and
cells that fail as a user's do. Its saved outputs are what the user reads: no Spark INFO/WARN lines after the fit,
the workers' progress drawn with ipywidgets and, in a kernel whose Python cannot import them, as plain lines, no
cursor codes in any text, and each failing cell's output starting with DeepSpark's one line.

The progress's pieces (deepspark/progress.py) are tested apart, with no kernel, at the end."""

import io
import os
import re
import subprocess
import sys
import types

import pytest

from deepspark.log import Log
from deepspark import progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
FASHION = "/usr/share/datasets/fashion-mnist"
# A line of Spark's log4j console pattern (`26/12/05 08:21:47 WARN Utils: ...`).
SPARK_LINE = re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (INFO|WARN) ", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
WIDGET = "application/vnd.jupyter.widget-view+json"

SESSION = """
import gzip
import numpy as np
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StringIndexer
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from deepspark.ml import DeepSparkEstimator, DeepSparkModel

spark = SparkSession.builder.master("local[2]").getOrCreate()
"""

DATA = f"""
NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]

def fashion(split, count):
    with gzip.open(f"{FASHION}/{{split}}-images-idx3-ubyte.gz", "rb") as f:
        pixels = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784)[:count]
    with gzip.open(f"{FASHION}/{{split}}-labels-idx1-ubyte.gz", "rb") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)[:count]
    rows = [(i, Vectors.dense(x / 255.0), NAMES[y]) for i, (x, y) in enumerate(zip(pixels, labels))]
    # In slices of 100 rows: Spark warns of any task over 1000 KiB, its own line whether DeepSpark runs or not.
    sliced = spark.sparkContext.parallelize(rows, max(2, count // 100))
    return spark.createDataFrame(sliced, ["id", "features", "class"])

train, test = fashion("train", TRAIN_ROWS), fashion("t10k", 500)
"""

MLFLOW = """
import mlflow, mlflow.pyspark.ml
mlflow.set_tracking_uri("sqlite:///mlflow.db")
mlflow.set_experiment("fashion")
mlflow.pyspark.ml.autolog()
"""

FIT = f"""
indexer = StringIndexer(inputCol="class", outputCol="label")
estimator = DeepSparkEstimator(solver="{SOLVER}", inputCol="features", validationFraction=0.1, maxIter=ITERATIONS)
model = Pipeline(stages=[indexer, estimator]).fit(train)
fitted = model.stages[-1]
"""

PLOT = """
import matplotlib.pyplot as plt
history = fitted.getHistory()
shown = [h for h in history if np.isfinite(h["loss"])]
plt.plot([h["iteration"] for h in shown], [h["loss"] for h in shown])
plt.xlabel("iteration"); plt.ylabel("train loss")
plt.show()
"""

EVALUATE = """
predictions = model.transform(test)
accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(predictions)
print(f"accuracy {accuracy:.3f}")
"""

SAVE_LOAD = """
model.write().overwrite().save("fashion_model")
loaded = PipelineModel.load("fashion_model")
before = [r.prediction for r in predictions.orderBy("id").select("prediction").collect()]
after = [r.prediction for r in loaded.transform(test).orderBy("id").select("prediction").collect()]
print("same predictions:", before == after)
"""

PYFUNC = """
run = mlflow.last_active_run()
logged = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
scorer = mlflow.pyfunc.load_model(logged[0].model_uri)
rows = test.orderBy("id").toPandas()
print("pyfunc agrees:", list(scorer.predict(rows)["prediction"]) == before)
"""

# The cells that fail, as a user's do: (name, code, a word the DeepSpark line names).
FAILURES = [
    ("wrong size", 'fitted.transform(spark.createDataFrame([(Vectors.dense([0.5] * 100),)], ["features"])).collect()',
     "features"),
    ("null row", 'from pyspark.sql.types import StructField, StructType\nfrom pyspark.ml.linalg import VectorUDT\n'
     'rows = [(Vectors.dense([0.5] * 784),), (None,)]\n'
     'fitted.transform(spark.createDataFrame(rows, StructType([StructField("features", VectorUDT())]))).collect()',
     "features"),
    ("bad prototxt", 'with open("bad_solver.prototxt", "w") as f:\n    f.write("net: \\"lenet.prototxt\\"\\nbase_lr: '
     'oops\\n")\nDeepSparkEstimator(solver="bad_solver.prototxt", inputCol="features").fit(train)',
     "bad_solver.prototxt"),
]


def kernel(tmp_path, widgets):
    """The venv's Python as a Jupyter kernel named deepspark in a folder of its own (JUPYTER_PATH), registered as
    the README says; without `widgets`, a sitecustomize on its PYTHONPATH makes `import ipywidgets` fail in it."""
    prefix = tmp_path / "jupyter"
    paths = [ROOT]
    if not widgets:
        blocked = tmp_path / "no_widgets"
        blocked.mkdir()
        (blocked / "sitecustomize.py").write_text('import sys\nsys.modules["ipywidgets"] = None  # as if not installed\n')
        paths.insert(0, str(blocked))
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", "deepspark",
                    "--env", "PYTHONPATH", os.pathsep.join(paths)], check=True, capture_output=True)
    return str(prefix / "share" / "jupyter")


def path_without_venv():
    """PATH without the venv's bin folder, as a kernel or a script started outside it has: `python3` is another one."""
    venv_bin = os.path.abspath(os.path.dirname(sys.executable))
    return os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if os.path.abspath(p) != venv_bin)


def run_notebook(tmp_path, monkeypatch, cells, widgets):
    """The notebook of `cells` [(tag, code)] executed in a fresh kernel: its cells, outputs saved."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    monkeypatch.setenv("JUPYTER_PATH", kernel(tmp_path, widgets))
    monkeypatch.setenv("PATH", path_without_venv())
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    # ipykernel leaves the output of its process's file descriptors (the JVM's, which a user's notebook shows) out of
    # the cells under pytest: not here.
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    notebook = nbformat.v4.new_notebook()
    for tag, code in cells:
        cell = nbformat.v4.new_code_cell(code.strip())
        cell.metadata["tags"] = [tag] + (["raises-exception"] if tag.startswith("fails") else [])
        notebook.cells.append(cell)
    work = tmp_path / "work"
    work.mkdir()
    client = nbclient.NotebookClient(notebook, kernel_name="deepspark", timeout=900,
                                     resources={"metadata": {"path": str(work)}})
    client.execute()
    nbformat.write(notebook, str(tmp_path / "fashion.ipynb"))  # kept for a look when the test fails
    return notebook.cells


def texts(cell):
    """The text a user reads in `cell`'s outputs, in order: streams, results, errors (their traceback)."""
    out = []
    for output in cell.outputs:
        if output.output_type == "stream":
            out.append(output.text)
        elif output.output_type == "error":
            out.append("\n".join(output.traceback))
        elif "text/plain" in output.get("data", {}) and WIDGET not in output.get("data", {}):
            out.append(output.data["text/plain"])
    return out


def stream_text(cell):
    return "".join(output.text for output in cell.outputs if output.output_type == "stream")


def tagged(cells, tag):
    return next(i for i, cell in enumerate(cells) if tag in cell.metadata.get("tags", []))


def check_quiet(cells):
    """No Spark INFO/WARN line after the fit cell (nor in it, after the fit ended)."""
    fit = tagged(cells, "fit")
    spark_lines = {i: SPARK_LINE.findall(stream_text(cell)) for i, cell in enumerate(cells) if i > fit}
    assert not any(spark_lines.values()), {i: stream_text(cells[i])[:2000] for i, found in spark_lines.items() if found}


def check_plain(cells):
    """No cursor code in any cell's text, nor tqdm's warning, and no carriage return once DeepSpark has begun
    (before it, Spark's own stage bar draws the user's first jobs: the pyspark shell's, which DeepSpark stops in a
    notebook as it starts a fit)."""
    began = False
    for i, cell in enumerate(cells):
        for output in (o for o in cell.outputs if o.output_type == "stream"):
            after = output.text  # what came once DeepSpark began: the kernel sends a cell's stderr in batches, and
            if not began and " deepspark] " in after:  # Spark's bar for the StringIndexer's job may share one
                began, after = True, after[after.index(" deepspark] "):]
            assert "\x1b[" not in output.text and not (began and "\r" in after), (i, output.text[-2000:])
            assert "IProgress not found" not in output.text, (i, output.text[-2000:])


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The user's notebook run once with ipywidgets: its cells, outputs saved."""
    if not os.path.exists(f"{FASHION}/train-images-idx3-ubyte.gz"):
        pytest.skip("apt-get install dataset-fashion-mnist")
    pytest.importorskip("mlflow")
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_notebook(tmp_path_factory.mktemp("notebook"), monkeypatch, [
            ("session", SESSION), ("data", DATA.replace("TRAIN_ROWS", "3000")), ("mlflow", MLFLOW),
            ("fit", FIT.replace("ITERATIONS", "300")), ("plot", PLOT), ("evaluate", EVALUATE), ("save", SAVE_LOAD),
            ("pyfunc", PYFUNC)] + [(f"fails: {name}", code) for name, code, _ in FAILURES], widgets=True)


@pytest.mark.spark
@pytest.mark.slow
def test_a_users_notebook_fits_plots_evaluates_saves_and_tracks(notebook):
    cells = notebook
    assert any("image/png" in o.get("data", {}) for o in cells[tagged(cells, "plot")].outputs)
    accuracy = float(re.search(r"accuracy ([\d.]+)", stream_text(cells[tagged(cells, "evaluate")])).group(1))
    assert accuracy > 0.6, accuracy  # 300 iterations of LeNet on 2,700 images
    assert "same predictions: True" in stream_text(cells[tagged(cells, "save")])
    assert "pyfunc agrees: True" in stream_text(cells[tagged(cells, "pyfunc")])


@pytest.mark.spark
@pytest.mark.slow
def test_the_fit_draws_a_widget_per_worker_with_ipywidgets(notebook):
    fit = notebook[tagged(notebook, "fit")]
    views = [o for o in fit.outputs if WIDGET in o.get("data", {})]
    assert len(views) == 2, fit.outputs  # a bar per worker, a widget each
    assert "Progress: iteration" not in stream_text(fit)  # the widgets, not the lines


@pytest.mark.spark
@pytest.mark.slow
def test_the_cells_hold_no_cursor_codes(notebook):
    check_plain(notebook)


@pytest.mark.spark
@pytest.mark.slow
def test_the_cells_hold_no_spark_log_lines_after_the_fit(notebook):
    check_quiet(notebook)


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("name, word", [(name, word) for name, _, word in FAILURES])
def test_a_failing_cell_starts_with_deepsparks_line(notebook, name, word):
    cell = notebook[tagged(notebook, f"fails: {name}")]
    assert any(o.output_type == "error" for o in cell.outputs), cell.outputs
    lines = [line for line in ANSI.sub("", "\n".join(texts(cell))).splitlines() if line.strip()]
    assert [line for line in lines[:3] if word in line and ("Error" in line or "deepspark" in line.lower())], \
        lines[:20]


@pytest.mark.spark
@pytest.mark.slow
def test_a_notebook_without_ipywidgets_gets_plain_progress_lines(tmp_path, monkeypatch):
    if not os.path.exists(f"{FASHION}/train-images-idx3-ubyte.gz"):
        pytest.skip("apt-get install dataset-fashion-mnist")
    cells = run_notebook(tmp_path, monkeypatch, [
        ("session", SESSION + "\nimport importlib.util\nprint('widgets:', importlib.util.find_spec('ipywidgets') "
         "is not None and __import__('sys').modules.get('ipywidgets', 0) is not None)"),
        ("data", DATA.replace("TRAIN_ROWS", "600")), ("fit", FIT.replace("ITERATIONS", "60")), ("evaluate", EVALUATE)],
        widgets=False)
    assert "widgets: False" in stream_text(cells[tagged(cells, "session")])
    fit = cells[tagged(cells, "fit")]
    assert not any(WIDGET in o.get("data", {}) for o in fit.outputs), fit.outputs
    said = re.findall(r"Progress: iteration (\d+) of 60 .*w0 .*w1 ", stream_text(fit))
    assert said and said[-1] == "60" and len(said) <= progress.LINES_PER_JOB + 1, stream_text(fit)[-3000:]
    check_plain(cells)
    check_quiet(cells)


# A user's script in the venv: ipykernel imported (pyspark imports it as it names a call's site) but no kernel runs;
# its session started before deepspark is imported, and a UDF of its own run before the fit and after it.
SCRIPT = f"""
import sys
import ipykernel  # what pyspark's errors.utils imports: no kernel for all that
import numpy as np
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession, functions as F

spark = SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1").getOrCreate()
from deepspark.ml import DeepSparkEstimator

def python():
    return spark.range(1).select(F.udf(lambda _: sys.executable)("id")).first()[0]

print("before:", python())
rng = np.random.default_rng(0)
rows = [(Vectors.dense(rng.random(784)), float(i % 10)) for i in range(200)]
DeepSparkEstimator(solver="{SOLVER}", inputCol="features", maxIter=20, output=sys.argv[1]).fit(
    spark.createDataFrame(rows, ["features", "label"]))
print("after:", python())
print("kernel modules:", "ipykernel" in sys.modules)
"""


@pytest.mark.spark
def test_a_script_in_a_venv_with_ipykernel_prints_progress_lines_and_keeps_one_python(tmp_path):
    pytest.importorskip("ipykernel")
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT, "SPARK_LOCAL_IP": "127.0.0.1", "PATH": path_without_venv()}
    for name in ("PYTEST_CURRENT_TEST", "PYSPARK_PYTHON", "VIRTUAL_ENV"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel modules: True" in done.stdout
    said = re.findall(r"Progress: iteration (\d+) of 20 .*w0 .*w1 ", done.stderr)
    assert said and said[-1] == "20", done.stderr[-3000:]  # lines, as any stream that is no terminal gets
    assert "0%|" not in done.stderr + done.stdout and "HBox" not in done.stdout, done.stdout[-2000:]
    # The executors ran the venv's Python from the first job on: deepspark set it as it was imported.
    assert f"before: {sys.executable}" in done.stdout and f"after: {sys.executable}" in done.stdout, done.stdout


# -- the progress's pieces, no kernel ----------------------------------------------------------------------------


def test_a_stream_that_is_no_terminal_gets_a_line_per_tenth_of_the_job_and_one_at_its_end():
    stream = io.StringIO()
    with Log(stream=stream):
        shown = progress.display(2, 100, 64)
        assert isinstance(shown, progress.Lines)
        for iteration in range(0, 96, 5):
            shown.draw({0: {"iteration": iteration + 3, "loss": 1.5}, 1: {"iteration": iteration}}, lost={1})
        shown.draw({0: {"iteration": 100, "loss": 0.5}, 1: {"iteration": 97, "loss": 0.25}})
        shown.close()
    lines = stream.getvalue().splitlines()
    said = [int(re.search(r"Progress: iteration (\d+) of 100", line).group(1)) for line in lines]
    assert said == [10, 20, 30, 40, 50, 60, 70, 80, 90, 97], lines  # the slowest worker's, then the end
    assert "w0 loss 1.5000, " in lines[0] and " img/s | w1 loss -, " in lines[0] and "lost, to rejoin" in lines[0]
    assert "ETA " in lines[0] and "w1 loss 0.2500" in lines[-1]
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_a_terminal_keeps_its_live_rows_and_a_kernel_without_ipywidgets_gets_lines(monkeypatch):
    pytest.importorskip("ipykernel")  # imported, as pyspark does: this process is no kernel all the same
    assert not progress.in_notebook()
    with Log(stream=io.StringIO(), progress=True) as terminal:
        rows = progress.display(2, 100, 64)
        assert isinstance(rows, progress.Rows)
        rows.draw({0: {"iteration": 5, "loss": 1.5, "exchanges": 1}})
        assert terminal.stream.getvalue().endswith("w0: it 5/100 loss 1.5000 ex 1 | w1: waiting")
        rows.close()
        single = progress.display(1, 100, exchanges=False)  # the single run's bar, on a terminal alone
        single.draw({0: {"iteration": 50, "loss": 0.25}})
        assert "[===============>              ] 50/100" in terminal.stream.getvalue() and "loss 0.2500" in \
            terminal.stream.getvalue()
        single.close()
    shell = types.SimpleNamespace(kernel=object())  # what a running kernel's shell has (ipykernel's)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # whose Python cannot import ipywidgets
    assert progress.in_notebook() and not progress.has_widgets()
    with Log(stream=io.StringIO()):
        assert isinstance(progress.display(2, 100, 64), progress.Lines)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: types.SimpleNamespace()))
    assert not progress.in_notebook()  # a terminal's IPython has a shell, and no kernel


def test_the_progress_lines_stay_out_of_the_log_file(tmp_path):
    with Log(str(tmp_path / "train.log"), stream=io.StringIO()) as log:
        lines = progress.Lines(1, 10, 8)
        lines.draw({0: {"iteration": 10, "loss": 1.0}})
    assert "Progress: iteration 10 of 10" in log.stream.getvalue()
    assert (tmp_path / "train.log").read_text() == ""


def test_the_progress_lines_follow_the_jobs_iteration_past_a_straggler_and_a_worker_that_left():
    with Log(stream=io.StringIO()) as log:
        lines = progress.Lines(2, 100, 8)
        lines.draw({0: {"iteration": 60, "loss": 1.0}})  # in step, w1 not reported yet: no line
        assert "Progress" not in log.stream.getvalue()
        # easgd: the job's iteration is its workers' trained together; w1, far behind, holds no line
        lines.draw({0: {"iteration": 150, "loss": 1.0}, 1: {"iteration": 10, "loss": 2.0}}, iteration=80)
        assert "Progress: iteration 80 of 100" in log.stream.getvalue()
        lines.draw({0: {"iteration": 190, "loss": 1.0}}, iteration=100)  # w1 left the job: the lines go on
        said = log.stream.getvalue().splitlines()[-1]
        assert "Progress: iteration 100 of 100" in said and "w1 not training" in said
