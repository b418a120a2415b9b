"""deepspark.ml on real Spark (local[2]): a Pipeline with the Estimator fits on a DataFrame of Fashion-MNIST
images, transforms, saves and loads in a new SparkSession; transform, `score` and Caffe's `test` agree on
the 10,000 test images for each backend; the net is built once per Python worker; bad input is one line.

One SparkSession serves the module (its tests share one xdist process); the persistence test stops it and
starts the new one the tests after it use.
"""

import os
import subprocess
import sys
from typing import Iterator

import numpy as np
import pyarrow as pa
import pytest

from deepspark import nets
from deepspark.data import decode_datum, lmdb_io, source_for
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

pyspark = pytest.importorskip("pyspark")
from pyspark.ml import Pipeline, PipelineModel  # noqa: E402  (after the skip)
from pyspark.ml.classification import LogisticRegression  # noqa: E402
from pyspark.ml.linalg import VectorUDT  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from deepspark.ml import DeepSparkEstimator, DeepSparkModel  # noqa: E402
from deepspark.spark import scoring  # noqa: E402
from deepspark.spark.session import spark_session  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENET = os.path.join(ROOT, "models", "lenet")
TRAIN = os.path.join(ROOT, "data", "fashion_mnist_train_lmdb")
TEST = os.path.join(ROOT, "data", "fashion_mnist_test_lmdb")
TRAIN_RECORDS = 4000


def session():
    """The module's SparkSession: the running one, or local[2] started."""
    return spark_session(pb.DeepSparkParameter(), 2)[0]


def image_rows(source, count=None):
    """(28 x 28 image as nested lists, label) rows of an LMDB."""
    rows = []
    for _, value in lmdb_io.read_records(source, 0, count):
        image, label = decode_datum(value)
        rows.append((image[0].tolist(), int(label)))
    return rows


def datum_frame(spark, source, partitions=4, count=None):
    return spark.createDataFrame([(bytes(v),) for _, v in lmdb_io.read_records(source, 0, count)], "datum binary") \
        .repartition(partitions)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A Pipeline of one DeepSparkEstimator fitted by 2-worker EASGD on 4,000 training images (arrays and
    integer labels), and the folder it trained in."""
    if not (lmdb_io.is_lmdb(TRAIN) and lmdb_io.is_lmdb(TEST)):
        pytest.skip("run `make setup` for the Fashion-MNIST LMDBs")
    folder = tmp_path_factory.mktemp("fit")
    spark = session()
    train = spark.createDataFrame(image_rows(TRAIN, TRAIN_RECORDS), "image array<array<int>>, label int")
    estimator = DeepSparkEstimator(solver=os.path.join(LENET, "solver.prototxt"), inputCol="image", maxIter=150,
                                   output=str(folder), workers=2)
    yield Pipeline(stages=[estimator]).fit(train), folder
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


def accuracy(rows):
    return float(np.mean([decode_datum(datum)[1] == prediction for datum, prediction in rows]))


@pytest.mark.spark
@pytest.mark.slow  # its fixture fits a model
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_transform_score_and_caffes_test_agree_on_the_10000_test_images(fitted, backend):
    pipeline_model, _ = fitted
    model = pipeline_model.stages[0]
    weights = model.summary["weights"]
    spark = session()
    model = DeepSparkModel.from_caffe(os.path.join(LENET, "deploy.prototxt"), weights,
                                      transform=model.getOrDefault("transformParam"), backend=backend,
                                      inputCol="datum", batchSize=100)
    rows = model.transform(datum_frame(spark, TEST)).select("datum", "prediction").collect()
    assert len(rows) == 10000
    transformed = accuracy(rows)
    tested = nets.test(os.path.join(LENET, "train_val.prototxt"), weights, 100, backend)
    scored = scoring.score(LENET, weights, backend=backend)
    assert round(transformed, 4) == round(float(tested["accuracy"]), 4) == round(float(scored["accuracy"]), 4)
    assert abs(float(scored["loss"]) - float(tested["loss"])) < 1e-5
    assert transformed > 0.6  # trained: well above the 10% of chance


def python_workers(spark):
    """The PIDs of the Python workers a 16-task job of Arrow UDFs (the transform's kind) runs on, with whether each
    holds a built net."""

    def probe(ids: Iterator[pa.Array]) -> Iterator[pa.Array]:
        from deepspark.spark import scoring as executor_side

        for batch in ids:
            yield pa.array([f"{os.getpid()} {int(bool(executor_side._BUILT))}"] * len(batch))

    found = spark.range(0, 16, 1, 16).select(F.arrow_udf(probe, "string")("id").alias("probe")).collect()
    return {int(pid): bool(int(built)) for pid, built in (row.probe.split() for row in found)}


@pytest.mark.spark
def test_the_net_is_built_once_per_python_worker_not_per_batch_partition_or_job(fitted):
    model = fitted[0].stages[0].copy()
    model.setBatchSize(16).setInputCol("datum")  # 2,000 images in 8 partitions: 128 batches
    spark = session()
    # (Not .limit(): a task that stops reading its input early loses its Python worker, net and all.)
    frame = datum_frame(spark, TEST, partitions=8, count=2000)
    first = model.transform(frame).select("prediction").collect()
    builds = model.counters[0].value
    workers = python_workers(spark)
    # The fit left a few idle Python workers (its training tasks' and its planning jobs'); each built once.
    assert len(first) == 2000 and 1 <= builds <= sum(workers.values()) < 8, (builds, workers)
    again = model.transform(frame).select("prediction").collect()
    assert model.counters[0].value == 0 and again == first  # the same workers kept their net


@pytest.mark.spark
def test_transform_adds_named_blobs_as_vectors_and_bad_input_is_one_line(fitted):
    model = fitted[0].stages[0].copy()
    spark = session()
    frame = spark.createDataFrame(image_rows(TEST, 5), "image array<array<int>>, label int")
    model.setOutputBlobs("ip1")
    rows = model.transform(frame).collect()
    assert len(rows[0]["ip1"]) == 500 and len(rows[0]["probability"]) == 10
    assert rows[0]["prediction"] == float(np.argmax(rows[0]["probability"]))
    assert min(rows[0]["ip1"]) >= 0  # ip1 after relu1, which rewrites it in place: the blob as Caffe leaves it

    with pytest.raises(ConfigError, match=r"^the DataFrame has no column 'pixels' \(inputCol\); it has "):
        model.copy({model.inputCol: "pixels"}).transform(frame)
    with pytest.raises(ConfigError, match=r"^outputBlobs: the net has no blob 'fc7'; its blobs are data, conv1"):
        model.copy({model.outputBlobs: "fc7"}).transform(frame)
    small = spark.createDataFrame([([[0] * 14] * 14, 0)] * 3, "image array<array<int>>, label int").coalesce(1)
    with pytest.raises(ConfigError, match=r"^inputCol 'image' holds 1x14x14 images \(its first row's\); the net "
                                          r"takes 1x28x28$"):
        model.transform(small)
    ragged = spark.createDataFrame([([[0] * 28] * 28,), ([[0] * 28] * 27,)], "image array<array<int>>").coalesce(1)
    # Said on the driver as transform is called (the first rows it reads), not in a Spark job's traceback.
    with pytest.raises(ConfigError, match=r"^inputCol 'image' \(its first 2 rows that are not null\): row 1 holds "
                                          r"756 numbers; the net takes 1x28x28 = 784 \(set inputShape for another "
                                          r"layout\)$"):
        model.transform(ragged)
    assert model.copy({model.handleInvalid: "skip"}).transform(ragged).count() == 1
    cifar_deploy = os.path.join(ROOT, "models", "cifar10_quick", "deploy.prototxt")
    with pytest.raises(ConfigError, match=r"lenet_iter_150.caffemodel: cannot copy param 0 of layer 'conv1': shape "
                                          r"mismatch, weights have \(20, 1, 5, 5\), the net needs \(32, 3, 5, 5\)$"):
        DeepSparkModel.from_caffe(cifar_deploy, fitted[0].stages[0].summary["weights"])


CAFFE_LOADS = """
import sys
import numpy as np
import caffe
net = caffe.Net(sys.argv[1], sys.argv[2], caffe.TEST)
image = np.array([float(v) for v in sys.argv[3].split(",")], np.float32).reshape(1, 1, 28, 28)
net.blobs["data"].reshape(1, 1, 28, 28)
net.blobs["data"].data[...] = image * 0.00390625
print(",".join(repr(float(v)) for v in net.forward()["prob"].ravel()))
"""


@pytest.mark.spark
@pytest.mark.caffe
def test_a_fitted_pipeline_saves_and_loads_in_a_new_session_to_identical_outputs_and_caffe_loads_it(
        fitted, tmp_path):
    pipeline_model, _ = fitted
    spark = session()
    # The same rows in the same partitions on both sides: the same batches, so the same bits.
    frame = spark.createDataFrame(image_rows(TEST, 300), "image array<array<int>>, label int")
    before = pipeline_model.transform(frame).collect()
    before = {tuple(map(tuple, row["image"])): (row["prediction"], row["probability"].toArray()) for row in before}
    pipeline_model.write().overwrite().save(str(tmp_path / "pipeline"))
    spark.stop()

    spark = session()  # a new SparkSession (and SparkContext) in this process
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    assert isinstance(loaded.stages[0], DeepSparkModel) and loaded.stages[0].uid == pipeline_model.stages[0].uid
    after = loaded.transform(spark.createDataFrame(image_rows(TEST, 300), "image array<array<int>>, label int"))
    after = {tuple(map(tuple, row["image"])): (row["prediction"], row["probability"].toArray())
             for row in after.collect()}
    assert after.keys() == before.keys()
    for key, (prediction, probability) in after.items():
        assert prediction == before[key][0] and np.array_equal(probability, before[key][1])

    data = tmp_path / "pipeline" / "stages"
    (stage,) = [p for p in data.iterdir()]
    image = next(iter(after))
    out = subprocess.run([sys.executable, "-c", CAFFE_LOADS, str(stage / "data" / "deploy.prototxt"),
                          str(stage / "data" / "weights.caffemodel"),
                          ",".join(str(v) for row in image for v in row)],
                         capture_output=True, text=True, env={**os.environ, "GLOG_minloglevel": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    caffe_prob = np.array([float(v) for v in out.stdout.strip().splitlines()[-1].split(",")])
    np.testing.assert_allclose(caffe_prob, after[image][1], rtol=1e-4, atol=1e-6)


PYCAFFE_FEATURES = """
import sys
import numpy as np
import caffe
caffe.set_mode_cpu()
features, net_path, weights, out = sys.argv[1:5]
data = open(net_path).read()
reader = caffe.NetSpec()
reader.data = caffe.layers.Data(source=features, backend=caffe.params.Data.LMDB, batch_size=50, ntop=1)
with open(out + "reader.prototxt", "w") as f:
    f.write(str(reader.to_proto()))
read = caffe.Net(out + "reader.prototxt", caffe.TEST)
lenet = caffe.Net(net_path, weights, caffe.TEST)
got, want = [], {"ip1": [], "ip2": []}
for _ in range(5):
    got.append(read.forward()["data"].copy())
    lenet.forward()
    for blob in want:
        want[blob].append(lenet.blobs[blob].data.copy())
np.save(out + "read.npy", np.concatenate(got))
for blob, parts in want.items():
    np.save(out + blob + ".npy", np.concatenate(parts))
"""


@pytest.mark.spark
@pytest.mark.caffe
def test_extract_features_writes_datums_caffes_data_layer_reads_with_pycaffes_values(fitted, tmp_path):
    weights = fitted[0].stages[0].summary["weights"]
    subset = str(tmp_path / "test250_lmdb")
    lmdb_io.write_lmdb(subset, lmdb_io.read_records(TEST, 0, 250))
    with pytest.raises(ConfigError, match=r"^--blobs: the net has no blob 'fc7'; its blobs are data, label, conv1"):
        scoring.extract_features(LENET, weights, ["fc7"], [str(tmp_path / "x")], source=subset)
    with pytest.raises(ConfigError, match=r"^2 blobs but 1 outputs"):
        scoring.extract_features(LENET, weights, ["ip1", "ip2"], [str(tmp_path / "x")], source=subset)
    session()
    outputs = [str(tmp_path / "ip1_lmdb"), str(tmp_path / "ip2.parquet")]
    written = scoring.extract_features(LENET, weights, ["ip1", "ip2"], outputs, source=subset,
                                       backend="tensorflow")
    assert written == {"ip1": 250, "ip2": 250}

    net = open(os.path.join(LENET, "train_val.prototxt")).read()
    net = net.replace('source: "data/fashion_mnist_test_lmdb"', f'source: "{subset}"').replace(
        "batch_size: 100", "batch_size: 50")
    (tmp_path / "lenet.prototxt").write_text(net)
    out = subprocess.run([sys.executable, "-c", PYCAFFE_FEATURES, outputs[0], str(tmp_path / "lenet.prototxt"),
                          weights, str(tmp_path) + "/"], capture_output=True, text=True,
                         env={**os.environ, "GLOG_minloglevel": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    read = np.load(tmp_path / "read.npy")  # our LMDB, through Caffe's own Data layer
    pycaffe_ip1, pycaffe_ip2 = np.load(tmp_path / "ip1.npy"), np.load(tmp_path / "ip2.npy")
    assert read.shape == (250, 500, 1, 1)
    assert np.abs(read.reshape(250, 500) - pycaffe_ip1).max() <= 1e-4 * np.abs(pycaffe_ip1).max()
    keys, values = zip(*source_for(outputs[1]).read())
    assert list(keys) == [b"%010d" % i for i in range(250)]  # Caffe's keys: the record's index, 10 digits
    ours = np.stack([decode_datum(v)[0] for v in values]).reshape(250, 10)
    assert np.abs(ours - pycaffe_ip2).max() <= 1e-4 * np.abs(pycaffe_ip2).max()
    # Beside the Datum, the record's label and the blob as a Spark ML vector: what pyspark.ml's stages take.
    frame = session().read.parquet(outputs[1]).orderBy("key")
    assert isinstance(frame.schema["ip2"].dataType, VectorUDT)
    rows = frame.select("label", "ip2").collect()
    assert [row.label for row in rows] == [int(decode_datum(v)[1]) for _, v in lmdb_io.read_records(subset)]
    np.testing.assert_array_equal(np.stack([row.ip2.toArray() for row in rows]), ours)
    classifier = LogisticRegression(featuresCol="ip2", maxIter=20).fit(frame)
    assert classifier.summary.accuracy > 0.5


def test_the_params_are_the_schemas_fields_with_their_comments_and_defaults():
    from deepspark.config import field_comments

    estimator, model = DeepSparkEstimator(), DeepSparkModel()
    for message, stages in ((pb.DeepSparkParameter, [estimator]), (pb.ScoreParameter, [estimator, model])):
        comments = field_comments(message.DESCRIPTOR.name)
        for field in message.DESCRIPTOR.fields:
            if field.name in ("master", "executor_env", "ship_records", "iterations"):  # iterations: maxIter
                assert not estimator.hasParam(field.name)
                continue
            default = field.default_value if field.enum_type is None else \
                field.enum_type.values_by_number[field.default_value].name.lower()
            name = "".join(part if i == 0 else part.title() for i, part in enumerate(field.name.split("_")))
            for stage in stages:
                param = stage.getParam(name)
                assert param.doc == comments[field.name] and stage.getOrDefault(param) == default, name
    estimator.setMovingRate(0.3).setWorkers(3)
    assert estimator.getMovingRate() == pytest.approx(0.3) and estimator.getWorkers() == 3
    assert not estimator.isSet("period")  # left to the solver's prototxt


def test_every_field_type_the_flags_take_has_a_param_type_too():
    """A schema field of a type the CLI's flags take (int64 and uint64 among them) is a Param too: a new field of
    such a type in DeepSparkParameter or ScoreParameter must not break `import deepspark.ml`."""
    from google.protobuf.descriptor import FieldDescriptor

    from deepspark import cli
    from deepspark.ml import params

    assert {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64} <= set(cli._TYPES)
    assert set(cli._TYPES) | {FieldDescriptor.TYPE_BOOL} <= set(params._CONVERTERS)


def test_score_and_extract_features_refuse_bad_input_in_one_line_before_spark_starts(tmp_path, capsys):
    from deepspark import cli

    weights = str(tmp_path / "w.caffemodel")
    open(weights, "wb").close()
    assert cli.main(["score", "--model", LENET, "--weights", weights, "--data", str(tmp_path / "none")]) == 1
    assert capsys.readouterr().err.strip().endswith(f"the dataset '{tmp_path / 'none'}' is not there")
    assert cli.main(["score", "--model", os.path.join(LENET, "deploy.prototxt"), "--weights", weights]) == 1
    assert "the net has 0 Data layers in its TEST phase" in capsys.readouterr().err
    assert cli.main(["extract-features", "--model", LENET, "--weights", weights, "--blobs", "ip1",
                     "--output", str(tmp_path / "f")]) == 1
    assert capsys.readouterr().err.strip().endswith("this .caffemodel has no layers")
