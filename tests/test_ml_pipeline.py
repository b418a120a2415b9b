"""The pipeline a Spark user writes, run as they run it: Fashion-MNIST as a vector column of pixels in [0, 1] and
string class names through StringIndexer (no cast stage), DeepSparkEstimator in a Pipeline holding out a
validation fraction, from a Python whose venv is not activated (the executors told nothing about which Python to
run); it fits to the accuracy of the same images as 0-255 integers, and the fitted PipelineModel saves, loads in a
new process and transforms to identical outputs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.spark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
FASHION = "/usr/share/datasets/fashion-mnist"
TRAIN_IMAGES, TEST_IMAGES, ITERATIONS = 4000, 1000, 200

# What both processes share: the data as a user reads it, and a session as a user starts it.
COMMON = """
import gzip, json, sys
import numpy as np
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StringIndexer
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from deepspark.ml import DeepSparkEstimator

FASHION, SOLVER, OUT, TRAIN, TEST, ITERATIONS = sys.argv[1:7]
# Named so that their alphabetical order is Fashion-MNIST's: StringIndexer (alphabetAsc) gives each class its own
# number, and the two fits compared below start the net's outputs on the same classes.
NAMES = ["0 T-shirt/top", "1 Trouser", "2 Pullover", "3 Dress", "4 Coat", "5 Sandal", "6 Shirt", "7 Sneaker", "8 Bag",
         "9 Ankle boot"]

def idx(name, header, count):
    with gzip.open(f"{FASHION}/{name}", "rb") as f:
        data = np.frombuffer(f.read(), np.uint8, offset=header)
    return data.reshape(-1, 784)[:count] if header == 16 else data[:count]

def frames(split, count):
    pixels, labels = idx(f"{split}-images-idx3-ubyte.gz", 16, count), idx(f"{split}-labels-idx1-ubyte.gz", 8, count)
    scaled = spark.createDataFrame([(i, Vectors.dense(x / 255.0), NAMES[y]) for i, (x, y) in enumerate(zip(pixels, labels))],
                                   ["id", "features", "class"])
    whole = spark.createDataFrame([(i, x.tolist(), int(y)) for i, (x, y) in enumerate(zip(pixels, labels))],
                                  "id long, pixels array<int>, label int")
    return scaled, whole

spark = SparkSession.builder.master("local[2]").getOrCreate()
accuracy = MulticlassClassificationEvaluator(metricName="accuracy")
"""

FIT = COMMON + """
scaled, whole = frames("train", int(TRAIN))
scaled_test, whole_test = frames("t10k", int(TEST))
# Synchronous averaging: two fits of the same rows train alike (async EASGD's interleaving varies from run to run
# by more than the point the two inputs are compared to), both in the source's order: with the Spark default,
# shuffled per epoch, the two fits differed by 0.019, more than that point.
estimator = DeepSparkEstimator(solver=SOLVER, inputCol="features", validationFraction=0.1, maxIter=int(ITERATIONS),
                               algorithm="sync", output=OUT, dataOrder="source")
indexer = StringIndexer(inputCol="class", outputCol="label", stringOrderType="alphabetAsc")
model = Pipeline(stages=[indexer, estimator]).fit(scaled)
out = model.transform(scaled_test)
scaled_accuracy = accuracy.evaluate(out)
fitted = model.stages[-1]
whole_model = DeepSparkEstimator(solver=SOLVER, inputCol="pixels", validationFraction=0.1, maxIter=int(ITERATIONS),
                                 algorithm="sync", output=OUT, dataOrder="source").fit(whole)
model.write().overwrite().save(OUT + "/pipeline")
rows = out.select("id", "prediction", "probability").orderBy("id").collect()
np.savez(OUT + "/before.npz", prediction=[r.prediction for r in rows], probability=[r.probability.toArray() for r in rows])
print(json.dumps({"scaled": scaled_accuracy, "whole": accuracy.evaluate(whole_model.transform(whole_test)),
                  "input_scale": fitted.getInputScale(), "validation": fitted.summary.get("test0/accuracy"),
                  "history": len(fitted.getHistory()), "python": spark.sparkContext.pythonExec}))
"""

LOAD = COMMON + """
scaled_test, _ = frames("t10k", int(TEST))
rows = PipelineModel.load(OUT + "/pipeline").transform(scaled_test).select("id", "prediction", "probability") \\
    .orderBy("id").collect()
np.savez(OUT + "/after.npz", prediction=[r.prediction for r in rows], probability=[r.probability.toArray() for r in rows])
"""


def unactivated_environment():
    """This environment as a shell without the venv has it: the venv's folder off PATH, no VIRTUAL_ENV, nothing
    naming the executors' Python."""
    venv = os.path.dirname(sys.executable)
    env = {key: value for key, value in os.environ.items()
           if key not in ("VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv)
    env["SPARK_LOCAL_IP"] = "127.0.0.1"  # this machine's (ENVIRONMENT.md), not the Python's
    return env


def run(script, tmp_path, env):
    path = tmp_path / "script.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path), FASHION, SOLVER, str(tmp_path / "out"), str(TRAIN_IMAGES),
                           str(TEST_IMAGES), str(ITERATIONS)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.slow
def test_a_spark_users_pipeline_fits_scaled_pixels_as_it_fits_integers_and_reloads_to_identical_outputs(tmp_path):
    if not os.path.exists(os.path.join(FASHION, "t10k-labels-idx1-ubyte.gz")):
        pytest.skip("needs the dataset-fashion-mnist Debian package (make setup)")
    env = unactivated_environment()
    python3 = subprocess.run(["python3", "-c", "import deepspark"], env=env, cwd=tmp_path, capture_output=True,
                             text=True)
    assert python3.returncode != 0, "the test needs a `python3` on PATH that is not the venv's"
    (tmp_path / "out").mkdir()
    fitted = run(FIT, tmp_path, env)
    figures = json.loads(fitted.stdout.strip().splitlines()[-1])
    print(figures)
    assert figures["python"] == sys.executable  # the executors ran the driver's interpreter, untold
    # The one line that says the pixels were already scaled, and what was done about it.
    said = [line for line in fitted.stderr.splitlines() if "holds values within [0, 1]" in line]
    assert len(said) == 1 and "multiplied by 255 first" in said[0], fitted.stderr[-3000:]
    assert figures["input_scale"] == 255.0 and figures["history"] > 2
    assert figures["scaled"] > 0.6 and abs(figures["scaled"] - figures["whole"]) <= 0.01, figures
    assert abs(figures["validation"] - figures["scaled"]) < 0.05, figures  # the summary's is the final model's

    run(LOAD, tmp_path, env)
    before, after = np.load(tmp_path / "out" / "before.npz"), np.load(tmp_path / "out" / "after.npz")
    assert len(before["prediction"]) == TEST_IMAGES
    np.testing.assert_array_equal(before["prediction"], after["prediction"])
    np.testing.assert_array_equal(before["probability"], after["probability"])
