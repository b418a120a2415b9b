"""DeepSparkEstimator under pyspark.ml's tuning and tracking: TrainValidationSplit fitting two models at once
(parallelism=2), CrossValidator over a grid of two Params, and mlflow.pyspark.ml.autolog recording a fit's Params
and metrics in a sqlite MLflow store. Small fits (one worker, tens of iterations) on Fashion-MNIST."""

import os

import numpy as np
import pytest

from deepspark.data import decode_datum, lmdb_io
from deepspark.proto import deepspark_pb2 as pb

pytestmark = pytest.mark.spark
pytest.importorskip("pyspark")
from pyspark.ml import Pipeline  # noqa: E402  (after the skip)
from pyspark.ml.evaluation import MulticlassClassificationEvaluator  # noqa: E402
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder, TrainValidationSplit  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from deepspark.ml import DeepSparkEstimator, DeepSparkModel  # noqa: E402
from deepspark.spark.session import spark_session  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
TRAIN = os.path.join(ROOT, "data", "fashion_mnist_train_lmdb")


@pytest.fixture(scope="module")
def frame():
    """800 Fashion-MNIST images as integer arrays with integer labels, in a local[2] session."""
    if not lmdb_io.is_lmdb(TRAIN):
        pytest.skip("run `make setup` for the Fashion-MNIST LMDBs")
    spark = spark_session(pb.DeepSparkParameter(), 2)[0]
    pairs = [decode_datum(value) for _, value in lmdb_io.read_records(TRAIN, 0, 800)]
    yield spark.createDataFrame([(x.ravel().tolist(), int(y)) for x, y in pairs], "image array<int>, label int") \
        .cache()
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


def estimator(tmp_path, **params):
    # One worker each: two fits at once take local[2]'s two task slots.
    return DeepSparkEstimator(solver=SOLVER, inputCol="image", workers=1, maxIter=30, validationFraction=0.1,
                              output=str(tmp_path), **params)


def accuracy():
    return MulticlassClassificationEvaluator(metricName="accuracy")  # a JVM object: made once Spark runs


def test_train_validation_split_fits_two_models_at_once(frame, tmp_path):
    fit = estimator(tmp_path)
    grid = ParamGridBuilder().addGrid(fit.movingRate, [0.3, 0.9]).build()
    tuned = TrainValidationSplit(estimator=fit, estimatorParamMaps=grid, evaluator=accuracy(), trainRatio=0.8,
                                 parallelism=2, seed=5).fit(frame)
    assert len(tuned.validationMetrics) == 2 and min(tuned.validationMetrics) > 0.2, tuned.validationMetrics
    assert isinstance(tuned.bestModel, DeepSparkModel)
    # Each fit wrote into a folder of its own: the two that ran at once did not share one.
    assert len(list(tmp_path.glob("fit-*/lenet_iter_30.caffemodel"))) == 3  # two tried, the best refitted


def test_cross_validator_over_two_params(frame, tmp_path):
    fit = estimator(tmp_path)
    grid = ParamGridBuilder().addGrid(fit.maxIter, [5, 40]).addGrid(fit.period, [5]).build()
    pipeline = Pipeline(stages=[fit])
    tuned = CrossValidator(estimator=pipeline, estimatorParamMaps=grid, evaluator=accuracy(), numFolds=2,
                           seed=5).fit(frame)
    assert len(tuned.avgMetrics) == 2
    assert tuned.avgMetrics[1] > tuned.avgMetrics[0], tuned.avgMetrics  # 40 iterations learn more than 5
    best = tuned.bestModel.stages[0]
    assert best.summary["iterations"] == 40


def test_mlflow_autolog_records_a_fits_params_and_metrics(frame, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # MLflow's sqlite store
    import mlflow.pyspark.ml  # noqa: F401  (autolog's module)

    # A sqlite store, as MLflow 3 recommends (it keeps its local file store behind MLFLOW_ALLOW_FILE_STORE), and its
    # artifacts in ./mlruns.
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.pyspark.ml.autolog(log_models=False, log_datasets=False)
    try:
        model = Pipeline(stages=[estimator(tmp_path, movingRate=0.3)]).fit(frame)
        accuracy().evaluate(model.transform(frame))
        run = mlflow.last_active_run()
    finally:
        mlflow.pyspark.ml.autolog(disable=True)
    params, metrics = run.data.params, run.data.metrics
    assert params["DeepSparkEstimator.movingRate"] == "0.3" and params["DeepSparkEstimator.maxIter"] == "30"
    assert params["DeepSparkEstimator.period"] == "32"  # the solver's, a Param left unset
    fitted = model.stages[0]
    assert metrics["test0/accuracy"] == pytest.approx(fitted.summary["test0/accuracy"], abs=1e-4)
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "test0/accuracy")
    assert [m.step for m in history] == [0, 30]  # the test at iteration 0, and the final model's
    evaluated = [name for name in metrics if name.startswith("accuracy_")]  # the evaluator's, autolog's own
    assert len(evaluated) == 1 and np.isfinite(metrics[evaluated[0]])
