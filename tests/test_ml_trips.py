"""The trips a Spark user met in deepspark.ml, each with the one line it now gives or the right result, on real
Spark (local[2]) and Fashion-MNIST: labels out of range or not whole, nulls and malformed rows (handleInvalid),
flat arrays with double labels in another column, Datum bytes with a label column, fits with no test data of the
solver's and with validation rows, the summary's accuracy that of the final model, a model fitted on pixels given
pixels already in [0, 1], Datums scored as Caffe takes them (with no job before the action), a stable uid across
save and load, and pandas for toPandas.

One SparkSession serves the module."""

import os
import shutil

import numpy as np
import pytest

from deepspark import checkpoint, fillers
from deepspark.data import decode_datum, encode_datum, lmdb_io
from deepspark.errors import ConfigError
from deepspark.graph import Graph
from deepspark.nets import deploy_net
from deepspark.proto import deepspark_pb2 as pb

pytestmark = pytest.mark.spark
pyspark = pytest.importorskip("pyspark")
from pyspark.ml.linalg import Vectors, VectorUDT  # noqa: E402  (after the skip)
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from deepspark.ml import DeepSparkEstimator, DeepSparkModel, frames, images  # noqa: E402
from deepspark.ml.model import image_shape  # noqa: E402
from deepspark.spark.failures import JobError  # noqa: E402
from deepspark.spark.session import spark_session  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENET = os.path.join(ROOT, "models", "lenet")
TRAIN = os.path.join(ROOT, "data", "fashion_mnist_train_lmdb")
TEST = os.path.join(ROOT, "data", "fashion_mnist_test_lmdb")


@pytest.fixture(scope="module")
def spark():
    if not (lmdb_io.is_lmdb(TRAIN) and lmdb_io.is_lmdb(TEST)):
        pytest.skip("run `make setup` for the Fashion-MNIST LMDBs")
    yield spark_session(pb.DeepSparkParameter(), 2)[0]
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


def fashion(source, count):
    """(N x 28 x 28 uint8 images, N labels) of the first `count` records of an LMDB."""
    pairs = [decode_datum(value) for _, value in lmdb_io.read_records(source, 0, count)]
    return np.stack([image[0] for image, _ in pairs]), np.array([int(label) for _, label in pairs])


@pytest.fixture(scope="module")
def solver_without_test_data(tmp_path_factory):
    """LeNet's solver, its test net reading an LMDB that is not there."""
    folder = tmp_path_factory.mktemp("solver")
    net = open(os.path.join(LENET, "train_val.prototxt")).read()
    (folder / "train_val.prototxt").write_text(net.replace("data/fashion_mnist_test_lmdb", "/nowhere/test_lmdb"))
    solver = open(os.path.join(LENET, "solver.prototxt")).read().replace("models/lenet/train_val.prototxt",
                                                                         str(folder / "train_val.prototxt"))
    (folder / "solver.prototxt").write_text(solver)
    shutil.copy(os.path.join(LENET, "deepspark.prototxt"), folder)
    shutil.copy(os.path.join(LENET, "deploy.prototxt"), folder)
    return str(folder / "solver.prototxt")


def schema(text):
    """A DDL schema, with `vector` for a Spark ML vector (which DDL does not name)."""
    fields = [field.strip().split(" ") for field in text.split(",")]
    return T.StructType([T.StructField(name, VectorUDT() if kind == "vector" else T._parse_datatype_string(kind))
                         for name, kind in fields])


def estimator(tmp_path, **params):
    return DeepSparkEstimator(solver=os.path.join(LENET, "solver.prototxt"), output=str(tmp_path), maxIter=1,
                              **params)


def test_bad_labels_and_bad_rows_are_one_line_naming_the_column_and_value_before_anything_trains(spark, tmp_path):
    images, labels = fashion(TRAIN, 40)
    rows = [(Vectors.dense(x.ravel() / 255.0), float(y)) for x, y in zip(images, labels)]

    def fit(rows, schema="features vector, label double", **params):
        return estimator(tmp_path, inputCol="features", **params).fit(spark.createDataFrame(rows, globals()["schema"](
            schema)))

    with pytest.raises(ConfigError, match=r"^labelCol 'label' holds 10.0 in 1 row; the net has 10 outputs, so its "
                                          r"labels are 0 to 9$"):
        fit(rows[:-1] + [(rows[-1][0], 10.0)])
    with pytest.raises(ConfigError, match=r"^labelCol 'y' holds -1 in 2 rows; the net has 10 outputs"):
        fit([(v, -1 if i < 2 else int(y)) for i, (v, y) in enumerate(rows)], "features vector, y int", labelCol="y")
    with pytest.raises(ConfigError, match=r"^labelCol 'label' holds 2.5, not a whole number; a label is a class "
                                          r"index \(0, 1, \.\.\.\)$"):
        fit(rows[:-1] + [(rows[-1][0], 2.5)])
    with pytest.raises(ConfigError, match=r"^labelCol 'label' holds string values; a label is a class index "
                                          r"\(0, 1, \.\.\.\): index them first \(pyspark.ml.feature.StringIndexer\)$"):
        fit([(v, str(y)) for v, y in rows], "features vector, label string")
    with pytest.raises(ConfigError, match=r"^labelCol 'label' is null in 1 row \(handleInvalid='skip' leaves them "
                                          r"out\)$"):
        fit(rows[:-1] + [(rows[-1][0], None)])
    with pytest.raises(ConfigError, match=r"^inputCol 'features' is null in 1 row \(handleInvalid='skip' leaves them "
                                          r"out\)$"):
        fit(rows[:-1] + [(None, 1.0)])
    with pytest.raises(ConfigError, match=r"^inputCol 'features' holds 783 numbers in 1 row; the net takes 1x28x28 = "
                                          r"784 \(set inputShape for another layout, or handleInvalid='skip'\)$"):
        fit(rows[:-1] + [(Vectors.dense(np.zeros(783)), 1.0)])
    with pytest.raises(ConfigError, match=r"^inputCol 'features' holds string; DeepSpark takes Caffe Datum bytes"):
        fit([("x", 1.0)], "features string, label double")
    with pytest.raises(ConfigError, match=r"^validationFraction is 1.5; it takes a fraction of the rows"):
        fit(rows, validationFraction=1.5)
    assert not list(tmp_path.glob("*/train.log"))  # no job started
    bare, output = tmp_path / "bare", tmp_path / "bare-output"  # a solver and its net, no deploy net beside them
    bare.mkdir(), output.mkdir()
    for name in ("solver.prototxt", "train_val.prototxt"):
        shutil.copy(os.path.join(LENET, name), bare / name)
    with pytest.raises(ConfigError, match=r"no deploy.prototxt beside the solver: set the Estimator's deploy Param"):
        DeepSparkEstimator(solver=str(bare / "solver.prototxt"), inputCol="features", output=str(output),
                           maxIter=1).fit(spark.createDataFrame(rows, schema("features vector, label double")))
    assert not list(output.iterdir())  # looked for before the fit's own folder is made


@pytest.fixture(scope="module")
def datum_fit(spark, tmp_path_factory):
    """A fit on Datum bytes whose own labels are all 0, the true labels in a column `y` beside them, 500 rows held
    out for validation by a column; and the rows."""
    images, labels = fashion(TRAIN, 2500)
    rows = [(encode_datum(x[None], 0), float(y), i < 500) for i, (x, y) in enumerate(zip(images, labels))]
    frame = spark.createDataFrame(rows, "datum binary, y double, held boolean")
    model = DeepSparkEstimator(solver=os.path.join(LENET, "solver.prototxt"), inputCol="datum", labelCol="y",
                               validationCol="held", maxIter=150, output=str(tmp_path_factory.mktemp("datum"))) \
        .fit(frame)
    return model, frame


def accuracy(frame, label="y"):
    return frame.select(F.avg((F.col("prediction") == F.col(label)).cast("double"))).first()[0]


def test_datums_take_the_label_column_and_the_summary_is_the_final_models_on_the_validation_rows(datum_fit):
    model, frame = datum_fit
    held = model.transform(frame.filter("held"))
    validated = accuracy(held)
    assert validated > 0.5  # trained on `y`: the Datums' own labels (all 0) would give one class, 10%
    # 500 rows, test batches of 100: the test net saw each once, as transform did.
    assert model.summary["test0/accuracy"] == pytest.approx(validated, abs=1e-6)
    history = model.getHistory()
    assert history[-1]["iteration"] == 150
    assert history[-1]["test0/accuracy"] == pytest.approx(model.summary["test0/accuracy"], abs=1e-4)  # as logged
    displayed = [h["iteration"] for h in history if np.isfinite(h["loss"])]
    assert len(displayed) == 1 and 100 <= displayed[0] < 150  # the solver's display, 100, as the driver saw it
    assert model.getInputScale() == 1.0 and model.getLabelCol() == "y" and model.getInputCol() == "datum"
    assert "inputScale: " in model.explainParams() and "(default: 1.0)" in model.explainParam("inputScale")
    pandas = held.select("y", "prediction", "probability").toPandas()
    assert len(pandas) == 500 and len(pandas["probability"][0]) == 10


def test_a_model_fitted_on_pixels_says_so_and_scores_pixels_already_in_0_1_alike(datum_fit, spark, capfd):
    model, _ = datum_fit
    images, labels = fashion(TEST, 500)
    pixels = spark.createDataFrame([(i, encode_datum(x[None], int(y)), Vectors.dense(x.ravel() / 255.0), float(y))
                                    for i, (x, y) in enumerate(zip(images, labels))],
                                   schema("id long, datum binary, features vector, y double"))
    capfd.readouterr()
    whole = model.transform(pixels).select("id", "prediction").orderBy("id").collect()
    assert "inputScale" not in capfd.readouterr().err
    scaled = model.copy({model.inputCol: "features"}).transform(pixels).select("id", "prediction").orderBy(
        "id").collect()
    said = [line for line in capfd.readouterr().err.splitlines() if "DeepSparkModel: inputCol 'features'" in line]
    assert len(said) == 1 and "inputScale 255 (it was fitted with 1" in said[0]
    agree = np.mean([a.prediction == b.prediction for a, b in zip(whole, scaled)])
    assert agree > 0.99  # the pixels again, to float32's rounding: the same answers


def test_flat_arrays_and_double_labels_fit_without_the_solvers_test_data_skipping_bad_rows(
        spark, solver_without_test_data, tmp_path, capfd):
    images, labels = fashion(TRAIN, 600)
    rows = [(x.ravel().astype(float).tolist(), float(y)) for x, y in zip(images, labels)]
    rows += [(None, 1.0), ([0.0] * 10, 2.0), (rows[0][0], None)]
    frame = spark.createDataFrame(rows, "image array<double>, y double")
    fit = DeepSparkEstimator(solver=solver_without_test_data, inputCol="image", labelCol="y", maxIter=20,
                             handleInvalid="skip", output=str(tmp_path))
    model = fit.fit(frame)
    assert model.summary["iterations"] == 20 and not [k for k in model.summary if k.startswith("test")]
    assert "No validation: the solver's test data /nowhere/test_lmdb is not there" in capfd.readouterr().err
    out = model.transform(frame.limit(600)).select("prediction").collect()  # a model all the same
    assert len(out) == 600


def test_a_saved_model_loads_with_its_uid_and_params(datum_fit, tmp_path):
    model, _ = datum_fit
    model.write().overwrite().save(str(tmp_path / "model"))
    loaded = DeepSparkModel.load(str(tmp_path / "model"))
    assert loaded.uid == model.uid and loaded.getLabelCol() == "y" and loaded.getInputScale() == 1.0
    assert loaded.explainParams() == model.explainParams()


def test_a_failure_on_the_executors_is_one_line_with_the_whole_report_in_the_fits_log(spark, tmp_path, capfd):
    images, labels = fashion(TRAIN, 60)
    rows = [(encode_datum(x[None], int(y)),) for x, y in zip(images, labels)] + [(b"not a datum",)]
    capfd.readouterr()
    with pytest.raises(JobError) as failure:
        estimator(tmp_path, inputCol="datum").fit(spark.createDataFrame(rows, "datum binary").coalesce(1))
    assert str(failure.value).startswith("the Spark job failed: inputCol 'datum': row 60: corrupt Datum (")
    console = capfd.readouterr().err
    assert "Traceback" not in console and "\tat org.apache" not in console, console[-3000:]
    (log,) = tmp_path.glob("fit-*/train.log")
    assert "Traceback (most recent call last)" in log.read_text()  # Spark's whole report, for whoever digs


def test_the_first_rows_read_for_shape_and_scale_are_the_images_spark_arrow_gives_for_every_input_kind(spark):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (5, 1, 4, 4)).astype(np.float64)
    sparse = Vectors.sparse(16, [1, 7], [3.0, 255.0])
    columns = {
        "vector": (VectorUDT(), [Vectors.dense(p.ravel()) for p in pixels[:4]] + [sparse], images.VECTOR, 0),
        "flat": (T.ArrayType(T.DoubleType()), [p.ravel().tolist() for p in pixels], images.ARRAY, 1),
        "nested": (T.ArrayType(T.ArrayType(T.ArrayType(T.DoubleType()))), [p.tolist() for p in pixels],
                   images.ARRAY, 3),
        "datum": (T.BinaryType(), [encode_datum(p.astype(np.uint8), 0) for p in pixels], images.DATUM, 0)}
    schema = T.StructType([T.StructField(name, kind) for name, (kind, _, _, _) in columns.items()])
    rows = [tuple(values[i] for _, values, _, _ in columns.values()) for i in range(5)]
    df = spark.createDataFrame([(None,) * 4] + rows, schema).repartition(3)  # a null row: left out
    for name, (_, _, kind, depth) in columns.items():
        ours = images.column_images(frames.head(df, name), kind, (1, 4, 4))[0]
        arrow = images.column_images(df.select(name).dropna().limit(64).toArrow().column(0), kind, (1, 4, 4))[0]
        assert len(ours) == 5 and sorted(map(bytes, ours)) == sorted(map(bytes, arrow)), name
    wanted = np.zeros(16)
    wanted[[1, 7]] = [3.0, 255.0]
    assert any(np.array_equal(image.ravel(), wanted)
               for image in images.column_images(frames.head(df, "vector"), images.VECTOR, (1, 4, 4))[0])
    assert image_shape(df, "nested", images.ARRAY, 3, "", None) == (1, 4, 4)
    assert image_shape(df, "datum", images.DATUM, 0, "", None) == (1, 4, 4)


def test_datums_are_scored_as_caffe_takes_them_with_no_spark_job_before_the_action(spark, tmp_path, capfd):
    graph = Graph(deploy_net(os.path.join(LENET, "deploy.prototxt"), "test")[0], pb.TEST)
    weights = str(tmp_path / "lenet.caffemodel")
    checkpoint.save_caffemodel(weights, graph, fillers.init_params(graph, 3))
    model = DeepSparkModel.from_caffe(LENET, weights, transform="scale: 0.00390625", inputCol="datum", batchSize=50)
    images_, labels = fashion(TEST, 100)
    # Float Datums already within [0, 1]: Caffe would scale them by 1/256 again, and so does the Model (Datums are
    # Caffe's own records), where a vector or an array in [0, 1] would take inputScale 255.
    frame = spark.createDataFrame([(i, encode_datum(x[None] / 255.0, int(y))) for i, (x, y) in
                                   enumerate(zip(images_, labels))], "id long, datum binary").coalesce(2)
    tracker = spark.sparkContext.statusTracker()
    jobs = len(tracker.getJobIdsForGroup())
    out = model.transform(frame)
    assert len(tracker.getJobIdsForGroup()) == jobs  # neither a shape nor a scale was read from the rows

    def probabilities(scored):
        return np.array([row.probability.toArray() for row in scored.orderBy("id").collect()])

    found = probabilities(out)
    np.testing.assert_array_equal(found, probabilities(model.copy({model.inputScale: 1.0}).transform(frame)))
    assert not np.allclose(found, probabilities(model.copy({model.inputScale: 255.0}).transform(frame)))
    # A model fitted on values in [0, 1] (inputScale 255 its default) given Datums says that it takes them as Caffe
    # does.
    fitted = model.copy()
    fitted._setDefault(inputScale=255.0)
    capfd.readouterr()
    np.testing.assert_array_equal(probabilities(fitted.transform(frame)), found)
    said = [line for line in capfd.readouterr().err.splitlines() if "DeepSparkModel: inputCol 'datum'" in line]
    assert len(said) == 1 and said[0].endswith("holds Caffe Datums, which take the net's transform_param as Caffe "
                                               "gives it them: inputScale 1 (it was fitted with 255; set inputScale "
                                               "to choose)")
    # Datums of another shape: each is checked as the executors decode it, the first named.
    colour = spark.createDataFrame([(encode_datum(np.zeros((3, 32, 32), np.uint8), 0),)], "datum binary")
    with pytest.raises(Exception) as error:
        model.transform(colour).collect()
    assert str(error.value).strip().endswith("DataError: inputCol 'datum' (Arrow batch 0 of a partition), row 0: its "
                                             "image is 3x32x32; the net takes 1x28x28")
