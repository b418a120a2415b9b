"""A fit leaves the session's log levels as it found them: in a Python process that started its own SparkSession
(Spark's default log4j profile, its shell filter keeping INFO lines off the console), a Spark action prints as many
lines after a fit, and after a fit that failed its checks, as before it."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spark
pytest.importorskip("pyspark")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A user's driver: count, fit, count, a fit refused by its checks, count; each count's stderr between markers.
DRIVER = """
import sys, time
import numpy as np
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from deepspark.errors import ConfigError
from deepspark.ml import DeepSparkEstimator

solver, output = sys.argv[1:3]
spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.ui.enabled", "false").getOrCreate())
rng = np.random.default_rng(0)
rows = [(Vectors.dense(rng.random(784)), float(i % 10)) for i in range(40)]
frame = spark.createDataFrame(rows, ["features", "label"]).cache()
frame.count()


def count(tag):
    sys.stderr.write(f"@@ {tag}\\n")
    sys.stderr.flush()
    frame.groupBy("label").count().collect()
    time.sleep(2)  # the scheduler's last lines of the job, written as the driver goes on
    sys.stderr.write("@@ end\\n")
    sys.stderr.flush()


def fit(data):
    return DeepSparkEstimator(solver=solver, output=output, maxIter=1, workers=1, inputCol="features").fit(data)


count("before")
fit(frame)
count("after a fit")
try:
    fit(spark.createDataFrame(rows[:-1] + [(rows[-1][0], 10.0)], ["features", "label"]))
except ConfigError as error:
    print(error)
count("after a failed fit")
"""


# Spark's console progress bar (`[Stage 4:>   (0 + 2) / 2]`, then blanks that erase it, each after a carriage
# return): drawn only when a stage outlasts 500 ms, so by the machine's load, not by the log levels.
PROGRESS_BAR = re.compile(r"^(\[Stage \d+:.*|\s*)$")


def sections(stderr):
    """{tag: the log lines written between `@@ tag` and `@@ end`}, without the console progress bar."""
    found, tag = {}, None
    for line in stderr.splitlines():
        if line.startswith("@@ "):
            tag = None if line == "@@ end" else line[3:]
            if tag:
                found[tag] = []
        elif tag and not PROGRESS_BAR.match(line):
            found[tag].append(line)
    return found


def test_a_fit_and_a_failed_fit_leave_spark_actions_as_quiet_as_before(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": ROOT, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run([sys.executable, str(script), os.path.join(ROOT, "models", "lenet", "solver.prototxt"),
                           str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1].startswith("labelCol 'label' holds 10.0 in 1 row")
    lines = sections(done.stderr)
    assert set(lines) == {"before", "after a fit", "after a failed fit"}, done.stderr[-4000:]
    assert lines["after a fit"] == lines["before"], "\n".join(lines["after a fit"])
    assert lines["after a failed fit"] == lines["before"], "\n".join(lines["after a failed fit"])
