"""A job is a value: spark.train returns a JobResult, for every algorithm, whose history is what train.log says
(the displays and tests, as logged), whose weights are the final snapshot's arrays in memory, and a fit's
Model.history is that history ending with the final model's test. Real Spark (local), real LMDB."""

import math
import os

import numpy as np
import pytest

from deepspark import checkpoint
from deepspark.plot import parse_log
from synthetic import make_job

pytestmark = pytest.mark.spark
pytest.importorskip("pyspark")
from deepspark import spark  # noqa: E402  (after the skip)


def logged(path):
    """train.log's displays and tests, as the plot command reads any log: [(iteration, loss, {output: value})]."""
    with open(path, encoding="utf-8") as lines:
        return [(iteration, loss, values) for _, iteration, loss, values in parse_log(lines)]


def same(a, b):
    return (a[0] == b[0] and (a[1] == b[1] or math.isnan(a[1]) and math.isnan(b[1])) and a[2] == b[2])


@pytest.mark.parametrize("algorithm", ["single", "easgd", "average"])
def test_the_result_holds_the_history_the_log_says_and_the_final_snapshots_weights(tmp_path, algorithm):
    solver = make_job(tmp_path, max_iter=40, test_interval=20, snapshot=20)
    result = spark.train(solver, algorithm=algorithm, period=5)
    history = [(e["iteration"], e["loss"], {k: v for k, v in e.items() if k.startswith("test")})
               for e in result.history]
    log = logged(os.path.join(result.output, "train.log"))
    assert len(history) == len(log) and all(same(a, b) for a, b in zip(history, log)), (history, log)
    tested = [e["iteration"] for e in result.history if "test0/accuracy" in e]
    assert tested[0] == 0 and tested[-1] == 40  # a short job's driver may see the workers past 20 at once
    assert all(np.isfinite(e["loss"]) for e in result.history if "test0/accuracy" not in e)
    seconds = [e["seconds"] for e in result.history]
    assert seconds == sorted(seconds) and seconds[0] >= 0
    assert result.final_test == {k: v for k, v in result.summary.items() if k.startswith("test")} != {}
    assert os.path.basename(result.snapshots[-1][0]) == "tiny_iter_40.caffemodel"
    assert result.summary["weights"] == result.snapshots[-1][0]
    written = checkpoint.read_caffemodel(result.summary["weights"])
    assert [name for name, _ in result.weights] == [name for name, _ in written]
    for (_, ours), (_, theirs) in zip(result.weights, written):
        assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    with pytest.raises(AttributeError):
        result.history = ()  # a value: frozen


def test_a_fits_model_history_is_what_its_train_log_says_ending_with_the_final_models_test(tmp_path):
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    from deepspark.ml import DeepSparkEstimator
    from deepspark.proto import deepspark_pb2 as pb
    from deepspark.spark.session import spark_session

    session = spark_session(pb.DeepSparkParameter(), 2)[0]
    try:
        rng = np.random.default_rng(0)
        schema = T.StructType([T.StructField("features", VectorUDT()), T.StructField("label", T.DoubleType())])
        frame = session.createDataFrame([(Vectors.dense(rng.random(784)), float(i % 10)) for i in range(80)], schema)
        lenet = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "lenet")
        model = DeepSparkEstimator(solver=os.path.join(lenet, "solver.prototxt"), output=str(tmp_path), maxIter=3,
                                   workers=1, inputCol="features", validationFraction=0.25, seed=1).fit(frame)
    finally:
        session.stop()
    history = [(e["iteration"], e["loss"], {k: v for k, v in e.items() if k.startswith("test")})
               for e in model.getHistory()]
    log = logged(os.path.join(model.summary["output"], "train.log"))
    assert len(history) == len(log) and all(same(a, b) for a, b in zip(history, log)), (history, log)
    assert history[-1][0] == 3 and history[-1][2]["test0/accuracy"] == pytest.approx(
        model.summary["test0/accuracy"], abs=1e-5)
