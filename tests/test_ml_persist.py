"""What a notebook user's model keeps and says, on real Spark (local[2]): a saved model loads with the history,
summary and input scale it was fitted with; fit says in one line when its rows are held in the driver; a net with
no Softmax gives raw scores under rawPredictionCol; transform says a wrong-sized column on the driver, names a null
row, and says in one line how many rows handleInvalid='skip' left out.

One SparkSession serves the module."""

import json
import os
import time

import numpy as np
import pytest

from deepspark import checkpoint, fillers
from deepspark.errors import ConfigError
from deepspark.graph import Graph
from deepspark.nets import deploy_net
from deepspark.proto import deepspark_pb2 as pb

pytestmark = pytest.mark.spark
pytest.importorskip("pyspark")
from pyspark.ml.linalg import Vectors, VectorUDT  # noqa: E402  (after the skip)
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from deepspark.ml import DeepSparkEstimator, DeepSparkModel, columns, frames  # noqa: E402
from deepspark.ml.persist import plain  # noqa: E402
from deepspark.spark.failures import JobError  # noqa: E402
from deepspark.spark.session import spark_session  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENET = os.path.join(ROOT, "models", "lenet")
VECTORS = T.StructType([T.StructField("id", T.LongType()), T.StructField("features", VectorUDT()),
                        T.StructField("label", T.DoubleType())])


@pytest.fixture(scope="module")
def spark():
    yield spark_session(pb.DeepSparkParameter(), 2)[0]
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


def vector_rows(count, seed=0):
    """(id, 784 values in [0, 1] as a vector, a class) rows."""
    rng = np.random.default_rng(seed)
    return [(i, Vectors.dense(rng.random(784)), float(i % 10)) for i in range(count)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """LeNet's fillers, seeded, as a .caffemodel: any weights show the path."""
    graph = Graph(deploy_net(os.path.join(LENET, "deploy.prototxt"), "test")[0], pb.TEST)
    path = str(tmp_path_factory.mktemp("weights") / "lenet.caffemodel")
    checkpoint.save_caffemodel(path, graph, fillers.init_params(graph, 3))
    return path


def test_a_saved_model_loads_with_its_history_summary_and_scale_and_fit_says_rows_held_in_the_driver(
        spark, tmp_path, capfd):
    frame = spark.createDataFrame(vector_rows(80), VECTORS)
    assert frames.held_in_driver(frame)
    parquet = str(tmp_path / "rows.parquet")
    frame.write.parquet(parquet)
    assert not frames.held_in_driver(spark.read.parquet(parquet)) and not frames.held_in_driver(spark.range(10))
    capfd.readouterr()
    model = DeepSparkEstimator(solver=os.path.join(LENET, "solver.prototxt"), output=str(tmp_path), maxIter=2,
                               workers=1, inputCol="features", validationFraction=0.25, seed=1).fit(frame)
    said = [line for line in capfd.readouterr().err.splitlines() if "held in the driver" in line]
    assert len(said) == 1 and said[0].endswith("fit on spark.read.parquet(path)"), said
    assert model.getHistory() and any("test0/accuracy" in entry for entry in model.getHistory())
    assert model.summary["iterations"] == 2 and model.getInputScale() == 255.0
    for path in (str(tmp_path / "model"), "file://" + str(tmp_path / "model2")):
        model.write().overwrite().save(path)
        model.write().overwrite().save(path)  # over itself
        loaded = DeepSparkModel.load(path)
        assert json.dumps(loaded.getHistory()) == json.dumps(model.getHistory())
        assert json.dumps(loaded.summary, default=plain) == json.dumps(model.summary, default=plain)
        assert loaded.getInputScale() == 255.0 and loaded.uid == model.uid
    data = spark.read.parquet(parquet)
    np.testing.assert_array_equal(
        [r.probability.toArray() for r in loaded.transform(data).orderBy("id").collect()],
        [r.probability.toArray() for r in model.transform(data).orderBy("id").collect()])


def test_a_net_with_no_softmax_gives_raw_scores_under_raw_prediction_col(spark, tmp_path, weights):
    text = open(os.path.join(LENET, "deploy.prototxt")).read()
    cut = text.rindex("layer {")
    assert 'type: "Softmax"' in text[cut:]
    (tmp_path / "deploy.prototxt").write_text(text[:cut])
    frame = spark.createDataFrame(vector_rows(6), VECTORS)
    probabilities = DeepSparkModel.from_caffe(os.path.join(LENET, "deploy.prototxt"), weights,
                                              inputCol="features").transform(frame)
    scores = DeepSparkModel.from_caffe(str(tmp_path / "deploy.prototxt"), weights,
                                       inputCol="features").transform(frame)
    assert "probability" in probabilities.columns and "rawPrediction" not in probabilities.columns
    assert "rawPrediction" in scores.columns and "probability" not in scores.columns
    p = np.array([row.probability.toArray() for row in probabilities.orderBy("id").collect()])
    s = np.array([row.rawPrediction.toArray() for row in scores.orderBy("id").collect()])
    np.testing.assert_allclose(p.sum(axis=1), 1, rtol=1e-5)
    softmax = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(softmax / softmax.sum(axis=1, keepdims=True), p, rtol=1e-4, atol=1e-6)
    renamed = DeepSparkModel.from_caffe(str(tmp_path / "deploy.prototxt"), weights, inputCol="features",
                                        rawPredictionCol="scores").transform(frame)
    assert "scores" in renamed.columns


def unplugged(_):
    raise ConfigError("camera 3 is unplugged")


def test_transform_says_bad_rows_in_one_line_and_how_many_it_skipped(spark, weights, capfd):
    model = DeepSparkModel.from_caffe(os.path.join(LENET, "deploy.prototxt"), weights, inputCol="features")
    # A job of DeepSpark's own (the first rows, read for their size and scale) fails with the workers' DeepSpark
    # line, raised from None: no Py4JJavaError, no worker traceback in its message.
    with pytest.raises(JobError, match=r"^reading the first rows of inputCol 'features': camera 3 is unplugged$") as no:
        model.transform(spark.range(3).withColumn("features", F.udf(unplugged, VectorUDT())("id")))
    assert no.value.__suppress_context__ and "Traceback" in no.value.detail
    wrong = spark.createDataFrame([(i, Vectors.dense(np.zeros(783)), 0.0) for i in range(5)], VECTORS)
    with pytest.raises(ConfigError, match=r"^inputCol 'features' \(its first 5 rows that are not null\): row 0 holds "
                                          r"783 numbers; the net takes 1x28x28 = 784 \(set inputShape"):
        model.transform(wrong)
    rows = vector_rows(12)
    rows[7] = (7, None, 0.0)
    # A null among the first rows, which the driver reads anyway: one line as transform() is called.
    with pytest.raises(ConfigError, match=r"^inputCol 'features': row 7 is null \(handleInvalid='skip' leaves"):
        model.transform(spark.createDataFrame(rows, VECTORS).coalesce(1))
    # A null past them reaches the net's UDF (not vector_to_array's Java error), which names it.
    far = vector_rows(frames.SAMPLE_ROWS + 8)
    far[-3] = (len(far) - 3, None, 0.0)
    with pytest.raises(Exception, match=rf"inputCol 'features' \(Arrow batch 0 of a partition\): row {len(far) - 3} "
                                        r"is null"):
        model.transform(spark.createDataFrame(far, VECTORS).coalesce(1)).collect()
    rows[9] = (9, Vectors.dense(np.zeros(10)), 0.0)
    capfd.readouterr()
    frame = spark.createDataFrame(rows, VECTORS).repartition(3)
    part = dict(frame.select("id", F.spark_partition_id()).collect())
    assert part[7] != part[9]
    kept = model.copy({model.handleInvalid: "skip"}).transform(frame)
    # Partition i's task ends 2i s late: the two skipped rows' counts come in seconds apart, as the tasks of one
    # action did on a loaded machine (CI run K said "skipped 1 row" twice when the driver waited a second at most),
    # and the driver still says them in one line, once Spark runs no job.
    late = kept.rdd.mapPartitionsWithIndex(lambda i, kept_rows: time.sleep(2 * i) or kept_rows)
    assert sorted(row.id for row in late.collect()) == [i for i in range(12) if i not in (7, 9)]
    said, deadline = [], time.monotonic() + columns.SAID_AT_MOST
    while not said and time.monotonic() < deadline:
        time.sleep(0.2)
        said += [line for line in capfd.readouterr().err.splitlines() if "transform: skipped" in line]
    time.sleep(columns.SAID_AFTER + 1)
    said += [line for line in capfd.readouterr().err.splitlines() if "transform: skipped" in line]
    assert len(said) == 1 and said[0].endswith("transform: skipped 2 rows with a null or wrong-sized inputCol "
                                               "'features' (handleInvalid='skip')"), said
