"""DeepSparkModel.transform under Spark Connect: a local Spark Connect server (pyspark's own, started by the client
in a process of its own) transforms the same Parquet rows (vectors in [0, 1], integer arrays, Datum bytes) to the
same outputs as classic Spark, its Python workers the client's with no PYSPARK_PYTHON given (deepspark's import sets
it); fit there is one line saying where it runs, and workers whose Python lacks what transform runs one line naming
PYSPARK_PYTHON."""

import os
import subprocess
import sys

import numpy as np
import pytest

from deepspark import checkpoint, fillers
from deepspark.data import decode_datum, encode_datum, lmdb_io
from deepspark.graph import Graph
from deepspark.nets import deploy_net
from deepspark.proto import deepspark_pb2 as pb

pytestmark = pytest.mark.spark
pytest.importorskip("pyspark.sql.connect.session")  # pyspark[connect]: grpcio, grpcio-status, zstandard
from pyspark.ml import PipelineModel  # noqa: E402  (after the skip)
from pyspark.ml.linalg import Vectors, VectorUDT  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from deepspark.ml import DeepSparkModel  # noqa: E402
from deepspark.spark.session import spark_session, stop_context  # noqa: E402
from sparkjobs import machine_lock  # noqa: E402

# The port of pyspark's local Spark Connect server (remote("local[...]")): one per machine, so another test run's
# server waits for this one's to end (two at once: "Failed to bind to address 0.0.0.0:15002").
CONNECT_PORT = "spark-connect-15002"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "models", "lenet", "deploy.prototxt")
TEST = os.path.join(ROOT, "data", "fashion_mnist_test_lmdb")
COLUMNS = ("features", "pixels", "datum")
SCHEMA = T.StructType([T.StructField("id", T.LongType()), T.StructField("features", VectorUDT()),
                       T.StructField("pixels", T.ArrayType(T.IntegerType())), T.StructField("datum", T.BinaryType())])

# Each input column transformed through the same model, as a Spark Connect client writes it.
CONNECT = """
import sys
import numpy as np
from pyspark.ml import PipelineModel
from pyspark.sql import SparkSession
from deepspark.errors import ConfigError
from deepspark.ml import DeepSparkEstimator, DeepSparkModel

deploy, weights, data, out, saved = sys.argv[1:6]
spark = SparkSession.builder.remote("local[2]").getOrCreate()
assert type(spark).__module__ == "pyspark.sql.connect.session", type(spark)
frame = spark.read.parquet(data)
found = {}
for column in ("features", "pixels", "datum"):
    model = DeepSparkModel.from_caffe(deploy, weights, transform="scale: 0.00390625", inputCol=column, batchSize=50)
    rows = model.transform(frame).select("id", "prediction", "probability").orderBy("id").collect()
    found[column + "/prediction"] = [row.prediction for row in rows]
    found[column + "/probability"] = [row.probability.toArray() for row in rows]
# Saved under Connect (over itself), loaded, in a PipelineModel; and the PipelineModel classic Spark saved.
model = DeepSparkModel.from_caffe(deploy, weights, transform="scale: 0.00390625", inputCol="features", batchSize=50)
model.write().overwrite().save(saved + "/connect_model")
model.write().overwrite().save(saved + "/connect_model")
loaded = DeepSparkModel.load(saved + "/connect_model")
PipelineModel(stages=[loaded]).save(saved + "/connect_pipeline")
classic = PipelineModel.load(saved + "/classic_pipeline")
assert classic.stages[0].getHistory() == [{"iteration": 1.0, "loss": 2.5}], classic.stages[0].getHistory()
assert classic.stages[0].summary == {"iterations": 1}
for name, stage in (("loaded", loaded), ("pipeline", PipelineModel.load(saved + "/connect_pipeline")),
                    ("classic", classic)):
    rows = stage.transform(frame).select("id", "probability").orderBy("id").collect()
    found[name + "/probability"] = [row.probability.toArray() for row in rows]
try:
    DeepSparkEstimator(solver="solver.prototxt", inputCol="features").fit(frame)
except ConfigError as error:
    print(error)
np.savez(out, **found)
"""


def outputs(model_of, frame):
    found = {}
    for column in COLUMNS:
        rows = model_of(column).transform(frame).select("id", "prediction", "probability").orderBy("id").collect()
        found[column + "/prediction"] = np.array([row.prediction for row in rows])
        found[column + "/probability"] = np.array([row.probability.toArray() for row in rows])
    return found


def test_transform_under_spark_connect_gives_classic_sparks_outputs(tmp_path):
    if not lmdb_io.is_lmdb(TEST):
        pytest.skip("run `make setup` for the Fashion-MNIST LMDBs")
    graph = Graph(deploy_net(DEPLOY, "test")[0], pb.TEST)
    weights = str(tmp_path / "lenet.caffemodel")  # LeNet's fillers, seeded: any weights show the same path
    checkpoint.save_caffemodel(weights, graph, fillers.init_params(graph, 3))
    images = [decode_datum(value) for _, value in lmdb_io.read_records(TEST, 0, 300)]
    rows = [(i, Vectors.dense(x.ravel() / 255.0), x.ravel().astype(int).tolist(), encode_datum(x, int(y)))
            for i, (x, y) in enumerate(images)]
    spark, _ = spark_session(pb.DeepSparkParameter(), 2)
    data = str(tmp_path / "rows.parquet")
    spark.createDataFrame(rows, SCHEMA).coalesce(2).write.parquet(data)
    frame = spark.read.parquet(data)

    def model_of(column):
        return DeepSparkModel.from_caffe(DEPLOY, weights, transform="scale: 0.00390625", inputCol=column, batchSize=50)

    classic = outputs(model_of, frame)
    saved = tmp_path / "saved"
    stage = model_of("features")
    stage.history, stage.summary = [{"iteration": 1.0, "loss": 2.5}], {"iterations": 1}
    PipelineModel(stages=[stage]).save(str(saved / "classic_pipeline"))
    stop_context(spark.sparkContext)

    script = tmp_path / "connect.py"
    script.write_text(CONNECT)
    # No PYSPARK_PYTHON and no venv on PATH (`python3` is another Python): the local server the client starts after
    # `import deepspark` runs the client's Python, which deepspark's import named in PYSPARK_PYTHON.
    venv_bin = os.path.dirname(sys.executable)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1",
           "PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                   if os.path.abspath(p) != os.path.abspath(venv_bin))}
    for name in ("PYSPARK_PYTHON", "VIRTUAL_ENV"):
        env.pop(name, None)
    with machine_lock(CONNECT_PORT):
        done = subprocess.run([sys.executable, str(script), DEPLOY, weights, data, str(tmp_path / "connect.npz"),
                               str(saved)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == (
        "fit runs the training job through a SparkContext, which Spark Connect does not give; fit in classic Spark "
        "(a DeepSparkModel's transform runs under Spark Connect too)")
    connect = np.load(tmp_path / "connect.npz")
    for column in COLUMNS:
        assert len(connect[column + "/prediction"]) == 300
        np.testing.assert_array_equal(connect[column + "/prediction"], classic[column + "/prediction"])
        np.testing.assert_array_equal(connect[column + "/probability"], classic[column + "/probability"])
    for name in ("loaded", "pipeline", "classic"):  # saved and loaded under Connect, or saved in classic Spark
        np.testing.assert_array_equal(connect[name + "/probability"], classic["features/probability"])
    # The vectors in [0, 1] took inputScale 255: the net saw the pixels again, to float32's rounding.
    assert np.mean(classic["features/prediction"] == classic["pixels/prediction"]) > 0.99
    np.testing.assert_array_equal(classic["pixels/probability"], classic["datum/probability"])


# A Connect client whose server's workers run another Python than the client's.
WORKERS = """
import sys
import numpy as np
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from deepspark.errors import ConfigError
from deepspark.ml import DeepSparkModel

deploy, weights = sys.argv[1:3]
spark = SparkSession.builder.remote("local[1]").getOrCreate()
frame = spark.createDataFrame([(Vectors.dense(np.zeros(784)),)], ["features"])
try:
    DeepSparkModel.from_caffe(deploy, weights, inputCol="features").transform(frame).collect()
except ConfigError as error:
    print(error)
"""


def test_a_connect_server_whose_workers_lack_what_transform_runs_is_one_line_naming_their_python(tmp_path):
    system = "/usr/bin/python3"
    if not os.path.exists(system) or not subprocess.run([system, "-c", "import pyarrow"],
                                                        capture_output=True).returncode:
        pytest.skip("needs a Python without pyarrow at /usr/bin/python3")
    graph = Graph(deploy_net(DEPLOY, "test")[0], pb.TEST)
    weights = str(tmp_path / "lenet.caffemodel")
    checkpoint.save_caffemodel(weights, graph, fillers.init_params(graph, 3))
    script = tmp_path / "workers.py"
    script.write_text(WORKERS)
    env = {**os.environ, "PYSPARK_PYTHON": system, "SPARK_LOCAL_IP": "127.0.0.1"}
    with machine_lock(CONNECT_PORT):
        done = subprocess.run([sys.executable, str(script), DEPLOY, weights], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    said = done.stdout.strip().splitlines()[-1]
    # deepspark itself the workers find on PYTHONPATH, as this test's server has it.
    assert said.startswith(f"the Spark workers' Python ({system}) cannot import pyarrow, numpy, "), said
    assert said.endswith(", tensorflow: start the Spark Connect server with PYSPARK_PYTHON set to a Python that has "
                         f"them (this one: PYSPARK_PYTHON={sys.executable})"), said
