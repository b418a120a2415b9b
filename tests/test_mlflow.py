"""MLflow over a fit as a notebook user tracks one, in a sqlite store as MLflow recommends: a Pipeline (StringIndexer,
DeepSparkEstimator) fitted under mlflow.pyspark.ml.autolog logs the DeepSpark model as a pyfunc (ml/flavor.py) that
mlflow.pyfunc.load_model loads and runs on a pandas DataFrame, without Spark, to the outputs of the model's
transform, with the class names of the Pipeline's StringIndexer beside its index; autolog says nothing about an
allowlist or scipy (its dataset's schema, the [mlflow] extra's); a fit that fails leaves no run and no folder."""

import gzip
import os
import sys

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.spark
mlflow = pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")  # MLflow's sqlite store
import mlflow.pyspark.ml  # noqa: E402  (autolog's module, after the skip)
from pyspark.ml import Pipeline  # noqa: E402
from pyspark.ml.feature import StringIndexer  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from deepspark.errors import ConfigError  # noqa: E402
from deepspark.ml import DeepSparkEstimator, DeepSparkModel  # noqa: E402
from deepspark.ml import flavor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
FASHION = "/usr/share/datasets/fashion-mnist"
NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


def fashion(split, count):
    """(count x 784 pixels in [0, 1], their class names) of Fashion-MNIST's `split`, as a user reads them."""
    def idx(kind, header):
        with gzip.open(f"{FASHION}/{split}-{kind}-ubyte.gz", "rb") as f:
            return np.frombuffer(f.read(), np.uint8, offset=header)

    pixels, labels = idx("images-idx3", 16).reshape(-1, 784)[:count], idx("labels-idx1", 8)[:count]
    return pixels / 255.0, [NAMES[y] for y in labels]


@pytest.fixture(scope="module")
def spark():
    if not os.path.exists(f"{FASHION}/train-images-idx3-ubyte.gz"):
        pytest.skip("apt-get install dataset-fashion-mnist")
    session = SparkSession.builder.master("local[2]").getOrCreate()
    yield session
    session.stop()


def test_a_fit_under_autolog_logs_a_pyfunc_model_that_scores_pandas_as_transform_does(spark, tmp_path, capfd,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)  # a sqlite store keeps its artifacts in ./mlruns
    pixels, names = fashion("train", 1000)
    frame = spark.createDataFrame([(i, Vectors.dense(x), c) for i, (x, c) in enumerate(zip(pixels, names))],
                                  ["id", "features", "class"])
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.pyspark.ml.autolog()  # as a user turns it on: its models and datasets too
    capfd.readouterr()
    try:
        estimator = DeepSparkEstimator(solver=SOLVER, inputCol="features", maxIter=60, validationFraction=0.1,
                                       output=str(tmp_path))
        model = Pipeline(stages=[StringIndexer(inputCol="class", outputCol="label"), estimator]).fit(frame)
        run = mlflow.last_active_run()
    finally:
        mlflow.pyspark.ml.autolog(disable=True)
    said = capfd.readouterr().err
    assert "not allowlisted" not in said and "scipy" not in said, said[-3000:]
    logged = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    assert [m.name for m in logged] == ["model"] and logged[0].source_run_id == run.info.run_id
    assert run.data.params["DeepSparkEstimator.maxIter"] == "60"
    # The Pipeline's StringIndexer's labels travel with the DeepSpark stage: its pyfunc answers class names too.
    labels = model.stages[0].labels
    assert model.stages[-1].getLabels() == labels and sorted(labels) == sorted(NAMES)

    fitted = model.stages[-1]
    test = spark.createDataFrame([(i, Vectors.dense(x)) for i, x in enumerate(fashion("t10k", 200)[0])],
                                 ["id", "features"])
    expected = fitted.transform(test).orderBy("id").toPandas()
    loaded = mlflow.pyfunc.load_model(logged[0].model_uri)
    got = loaded.predict(test.orderBy("id").toPandas())  # its vectors as toPandas gives them
    assert list(got.columns) == ["prediction", "probability", "predictedLabel"]
    assert list(got["predictedLabel"]) == [labels[int(p)] for p in got["prediction"]]
    assert np.array_equal(got["prediction"].to_numpy(), expected["prediction"].to_numpy())
    probability = np.stack([v.toArray() for v in expected["probability"]])
    assert np.allclose(np.stack(got["probability"]), probability, atol=1e-6)
    assert (got["prediction"].to_numpy() == np.argmax(probability, axis=1)).all()

    # The same model scores plain arrays, and each row's own columns where there is no inputCol.
    pixels = np.stack([v.toArray() for v in test.orderBy("id").toPandas()["features"]])
    by_rows = loaded.predict(pd.DataFrame(pixels[:5]))
    assert np.array_equal(by_rows["prediction"].to_numpy(), expected["prediction"].to_numpy()[:5])
    # The pyfunc's own model is the fitted one, loaded without Spark: its Params and history kept.
    again = flavor.load(os.path.join(mlflow.artifacts.download_artifacts(logged[0].model_uri), flavor.DATA))
    assert isinstance(again, DeepSparkModel) and again.uid == fitted.uid
    assert again.getInputScale() == fitted.getInputScale() and len(again.getHistory()) == len(fitted.getHistory())
    assert again.getLabels() == labels


def test_a_model_is_not_logged_without_autolog(spark, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pixels, names = fashion("train", 200)
    frame = spark.createDataFrame([(Vectors.dense(x), float(NAMES.index(c))) for x, c in zip(pixels, names)],
                                  ["features", "label"])
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run() as run:
        DeepSparkEstimator(solver=SOLVER, inputCol="features", maxIter=5, output=str(tmp_path)).fit(frame)
    assert mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list") == []


def test_a_fit_that_fails_under_autolog_leaves_no_run_and_no_folder_and_names_the_users_words(spark, tmp_path,
                                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    pixels, names = fashion("train", 50)
    frame = spark.createDataFrame([(Vectors.dense(x), c) for x, c in zip(pixels, names)], ["features", "class"])
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.set_experiment("failures").experiment_id
    output = tmp_path / "fits"  # not there: the fit would make it
    mlflow.pyspark.ml.autolog()
    try:
        indexer = StringIndexer(inputCol="class", outputCol="label")
        with pytest.raises(ConfigError, match=r"^DeepSparkEstimator's maxIter must be at least 1, not 0$"):
            Pipeline(stages=[indexer, DeepSparkEstimator(solver=SOLVER, inputCol="features", maxIter=0,
                                                         output=str(output))]).fit(frame)
        with pytest.raises(ConfigError, match=r"^models/lenet/solver.prototxt: solver file not found in "
                                              + f"{tmp_path} \\(a relative path is the working directory's\\)$"):
            DeepSparkEstimator(solver="models/lenet/solver.prototxt", inputCol="features").fit(frame)
        with pytest.raises(ConfigError, match=r"^labelCol 'class' holds string values"):  # found after the folder
            DeepSparkEstimator(solver=SOLVER, inputCol="features", labelCol="class", output=str(output)).fit(frame)
        with monkeypatch.context() as without:  # as in a venv of `pip install .[notebook]` before it brought TF
            without.setitem(sys.modules, "tensorflow", None)
            with pytest.raises(ConfigError, match=r"^backend 'tensorflow' needs tensorflow, which this Python \(.*\) "
                                                  r"cannot import: pip install -e '\.\[tensorflow\]'"):
                Pipeline(stages=[indexer, DeepSparkEstimator(solver=SOLVER, inputCol="features",
                                                             output=str(output))]).fit(frame)
    finally:
        mlflow.pyspark.ml.autolog(disable=True)
    assert not output.exists()  # the folders the failed fits made, removed
    runs = mlflow.search_runs([experiment], run_view_type=mlflow.entities.ViewType.ACTIVE_ONLY, output_format="list")
    assert not runs, [(r.info.run_id, r.info.status) for r in runs]
