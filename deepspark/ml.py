"""DeepSpark as pyspark.ml stages: an Estimator whose fit trains on a DataFrame, and the Model it returns, a
Transformer that runs the deploy net on the executors.

    from deepspark.ml import DeepSparkEstimator, DeepSparkModel
    estimator = DeepSparkEstimator(solver="models/lenet/solver.prototxt", inputCol="datum", maxIter=2000)
    model = Pipeline(stages=[estimator]).fit(train_df)
    model.transform(test_df).select("prediction", "probability")
    model.save("lenet_model")                  # pyspark.ml persistence; data/ holds
                                               # deploy.prototxt and weights.caffemodel
    DeepSparkModel.from_caffe("models/lenet/deploy.prototxt", "lenet.caffemodel",
                              transform="scale: 0.00390625")

The Params are the schema's: one per field of DeepSparkParameter (how to
train) and of ScoreParameter (which columns, which blobs), named in Spark's
camelCase (movingRate for moving_rate), typed, documented and defaulted from
proto/deepspark.proto. A DeepSparkParameter Param left unset keeps what the
solver's prototxt (or the deepspark.prototxt beside it) says, as `deepspark
train` does with a flag not given.
"""

import os

from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor
from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.linalg import VectorUDT
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsReader, DefaultParamsWritable, DefaultParamsWriter
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import types as T

from deepspark import checkpoint, config, nets, spark
from deepspark.data import datum, load_mean
from deepspark.errors import ConfigError
from deepspark.graph import DATA_TYPES, Graph, tap_name, with_batch_size, with_taps
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.scoring import Forward, rows_with_outputs

_CONVERTERS = {FieldDescriptor.TYPE_BOOL: TypeConverters.toBoolean, FieldDescriptor.TYPE_STRING: TypeConverters.toString,
               FieldDescriptor.TYPE_FLOAT: TypeConverters.toFloat, FieldDescriptor.TYPE_DOUBLE: TypeConverters.toFloat,
               FieldDescriptor.TYPE_UINT32: TypeConverters.toInt, FieldDescriptor.TYPE_INT32: TypeConverters.toInt,
               FieldDescriptor.TYPE_UINT64: TypeConverters.toInt, FieldDescriptor.TYPE_INT64: TypeConverters.toInt}

# DeepSparkParameter fields that say where a job runs and how its data gets there: the DataFrame's session
# and its rows decide both for fit.
_NOT_FOR_FIT = {"master", "executor_env", "ship_records"}

# Files of a saved Model, under its path's data/ folder: Caffe's own, loadable by Caffe as they are.
DEPLOY, WEIGHTS, MEAN = "deploy.prototxt", "weights.caffemodel", "mean.binaryproto"


def camel(name):
    """A schema field's name as a Spark ML Param's: moving_rate -> movingRate."""
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


def schema_params(message, skip=()):
    """{Param name: (Param, default, field)} for each field of a schema message: typed, with the .proto's
    comment as its doc and the .proto's default as its default (an enum by its lower-case name)."""
    comments = config.field_comments(message.DESCRIPTOR.name)
    params = {}
    for field in message.DESCRIPTOR.fields:
        if field.name in skip:
            continue
        default = field.default_value
        if field.enum_type is not None:
            default, converter = field.enum_type.values_by_number[default].name.lower(), TypeConverters.toString
        else:
            converter = _CONVERTERS[field.type]
        name = camel(field.name)
        params[name] = (Param(Params._dummy(), name, comments.get(field.name, field.name), converter), default,
                        field.name)
    return params


def with_schema(*messages, skip=()):
    """A class decorator: the Params of `messages` (schema_params) as class attributes, each with Spark's
    get<Name> and set<Name>, and `_schema` mapping Param names to (message, field)."""

    def decorate(cls):
        cls._schema = dict(getattr(cls, "_schema", {}))
        for message in messages:
            for name, (param, default, field) in schema_params(message, skip).items():
                setattr(cls, name, param)
                title = name[0].upper() + name[1:]
                setattr(cls, f"get{title}", lambda self, p=name: self.getOrDefault(p))
                setattr(cls, f"set{title}", lambda self, value, p=name: self._set(**{p: value}))
                cls._schema[name] = (message, field, default)
        return cls

    return decorate


class _Stage(Params):
    """What both stages share: the schema's defaults set at construction."""

    def _schema_defaults(self):
        self._setDefault(**{name: default for name, (_, _, default) in self._schema.items()})

    def _set_kwargs(self, kwargs):
        return self._set(**{key: value for key, value in kwargs.items() if value is not None})


@with_schema(pb.ScoreParameter)
@with_schema(pb.DeepSparkParameter, skip=_NOT_FOR_FIT)
class DeepSparkEstimator(Estimator, _Stage, DefaultParamsWritable, DefaultParamsReadable):
    """fit(df) trains the solver's net on the DataFrame's rows with the Spark job `deepspark train` runs
    (the DataFrame's SparkSession runs it) and returns a DeepSparkModel of the deploy net and the
    learned weights. The rows hold Datum bytes in inputCol, or an image array in inputCol and an integer
    label in labelCol."""

    solver = Param(Params._dummy(), "solver", "the solver .prototxt (its net names the train and test nets)",
                   TypeConverters.toString)
    deepspark = Param(Params._dummy(), "deepspark", "a DeepSparkParameter .prototxt over the solver's own "
                      "(default: deepspark.prototxt beside the solver, if there is one)", TypeConverters.toString)
    deploy = Param(Params._dummy(), "deploy", "the deploy .prototxt of the Model (default: deploy.prototxt "
                   "beside the solver)", TypeConverters.toString)
    weights = Param(Params._dummy(), "weights", "a .caffemodel to start from (fine-tuning)", TypeConverters.toString)
    output = Param(Params._dummy(), "output", "the folder for snapshots and logs (default: the solver's "
                   "snapshot_prefix's)", TypeConverters.toString)
    maxIter = Param(Params._dummy(), "maxIter", "iterations per worker, over the solver's max_iter",
                    TypeConverters.toInt)

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__()
        self._schema_defaults()
        self._set_kwargs(self._input_kwargs)

    @keyword_only
    def setParams(self, **kwargs):
        return self._set_kwargs(self._input_kwargs)

    def _given(self, name):
        return self.getOrDefault(name) if self.isDefined(name) else None

    def _fit(self, dataset):
        path = self._given("solver")
        if not path:
            raise ConfigError("DeepSparkEstimator needs a solver: DeepSparkEstimator(solver='solver.prototxt')")
        solver = config.load_solver(path, self._given("deepspark"))
        solver.param.snapshot_after_train = True  # the Model is made of the final snapshot
        knobs = {field: self.getOrDefault(name) for name, (message, field, _) in self._schema.items()
                 if message is pb.DeepSparkParameter and self.isSet(name)}
        frame = training_frame(dataset, self.getOrDefault("inputCol"), self.getOrDefault("labelCol"))
        summary = spark.train(solver, frame, weights=self._given("weights"), iterations=self._given("maxIter"),
                              output=self._given("output"), **knobs)
        deploy = self._given("deploy") or os.path.join(os.path.dirname(os.path.abspath(path)), "deploy.prototxt")
        model = DeepSparkModel.from_caffe(deploy, summary["weights"], transform=test_transform(solver),
                                          backend=solver.param.deepspark_param.backend)
        for name, (message, _, _) in self._schema.items():
            if message is pb.ScoreParameter and self.isSet(name):
                model._set(**{name: self.getOrDefault(name)})
        model.summary = summary
        return model


def training_frame(df, input_col, label_col):
    """`df` with the columns the training job reads: `datum` (Datum bytes), or `data` and `label`."""
    if input_col not in df.columns:
        raise ConfigError(f"the DataFrame has no column '{input_col}' (inputCol); it has {df.columns}")
    if isinstance(df.schema[input_col].dataType, T.BinaryType):
        return df.select(df[input_col].alias("datum"))
    if label_col not in df.columns:
        raise ConfigError(f"the DataFrame has no column '{label_col}' (labelCol) beside its images in "
                          f"'{input_col}'; it has {df.columns}")
    return df.select(df[input_col].alias("data"), df[label_col].alias("label"))


def test_transform(solver):
    """The transform_param of the solver's first test net's Data layer (else its train net's): what the
    Model applies to an image before the deploy net, as Caffe's TEST phase does."""
    nets = [net for net, _, _ in solver.test_nets] + [solver.train_net]
    for net in nets:
        for layer in net.layer:
            if layer.type in DATA_TYPES and layer.HasField("transform_param"):
                return text_format.MessageToString(layer.transform_param, as_one_line=True)
    return ""


class _ModelWriter(MLWriter):
    """Saves the Params as pyspark.ml's metadata, and the net as Caffe's files under data/ (any path
    Spark's Hadoop file systems write: a local folder, hdfs://, s3a://)."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path):
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc)
        files = {DEPLOY: text_format.MessageToString(self.instance.deploy).encode(), WEIGHTS: self.instance.weights}
        if self.instance.mean is not None:
            files[MEAN] = datum.mean_bytes(self.instance.mean)
        for name, data in files.items():
            write_file(self.sc, f"{path}/data/{name}", data)


class _ModelReader(MLReader):
    def load(self, path):
        sc = self.sparkSession.sparkContext
        metadata = DefaultParamsReader.loadMetadata(path, sc)
        deploy = config.parse_net(read_file(sc, f"{path}/data/{DEPLOY}").decode(), f"{path}/data/{DEPLOY}")[0]
        mean_path = f"{path}/data/{MEAN}"
        mean = datum.parse_mean(read_file(sc, mean_path), mean_path) if exists(sc, mean_path) else None
        model = DeepSparkModel(_files=(deploy, read_file(sc, f"{path}/data/{WEIGHTS}"), mean))
        DefaultParamsReader.getAndSetParams(model, metadata)
        model._check()
        return model


@with_schema(pb.ScoreParameter)
class DeepSparkModel(Model, _Stage, MLWritable, MLReadable):
    """A deploy net and its weights as a Transformer: transform(df) runs the net on the executors over
    inputCol (Datum bytes, or an image array or vector; Caffe's TEST-phase transform_param first) and adds
    predictionCol (the argmax of the net's output), probabilityCol (the output, a vector) and a vector
    column per blob of outputBlobs. The net is built once per Python worker, and run batchSize images at a
    time."""

    backend = Param(Params._dummy(), "backend", config.field_comments("DeepSparkParameter").get("backend", ""),
                    TypeConverters.toString)
    transformParam = Param(Params._dummy(), "transformParam", "Caffe's transform_param applied before the net "
                      "(a TransformationParameter in prototxt text: 'scale: 0.00390625'); a mean_file is read "
                      "once and kept with the model", TypeConverters.toString)

    def __init__(self, _files=None):
        super().__init__()
        self._schema_defaults()
        self._setDefault(backend=pb.DeepSparkParameter().backend, transformParam="")
        self.deploy, self.weights, self.mean = _files if _files is not None else (None, None, None)
        self.summary = None  # the training job's summary, for a fitted model
        self.counters = None  # (builds, build seconds) of the last transform, once an action ran it

    @classmethod
    def from_caffe(cls, deploy, caffemodel, transform=None, **params):
        """A Model of files a user has: a deploy .prototxt (or a model folder) and a .caffemodel;
        transform: Caffe's transform_param (prototxt text, or a TransformationParameter) to apply before
        the net; params: Model Params by name (backend="caffe", outputBlobs="ip1")."""
        net, _ = nets.deploy_net(deploy, "DeepSparkModel")
        weights = checkpoint.read_bytes(caffemodel, "the weights")
        text = transform if isinstance(transform, (str, type(None))) else text_format.MessageToString(
            transform, as_one_line=True)
        param = parse_transform(text or "")
        mean = load_mean(param.mean_file) if param.mean_file else None
        param.ClearField("mean_file")
        model = cls(_files=(net, weights, mean))
        model._set(transformParam=text_format.MessageToString(param, as_one_line=True), **params)
        model._check(caffemodel)
        return model

    def write(self):
        return _ModelWriter(self)

    @classmethod
    def read(cls):
        return _ModelReader()

    # -- the net ---------------------------------------------------------------------------

    def _graph(self):
        return Graph(with_batch_size(self.deploy, self.getOrDefault("batchSize")), pb.TEST)

    def batch_size(self):
        """Images per forward pass: batchSize, else the deploy net's Input batch."""
        return self.getOrDefault("batchSize") or next(iter(self._graph().fed_tops().values()))[0]

    def _check(self, where="the model's weights"):
        """One line unless the weights fit the deploy net: every learnable layer has them, in its shapes."""
        graph = self._graph()
        filled = checkpoint.weights_that_fit(graph, self.weights, where)
        missing = [graph.params[i].layer for i, array in enumerate(filled) if array is None]
        if missing:
            raise ConfigError(f"the weights have nothing for layer '{missing[0]}' of the net "
                              f"{self.deploy.name or ''}; they are not this net's", where)
        self.input_top()
        self.blobs()

    def input_top(self):
        """(the net's one input top, its (C, H, W))."""
        fed = self._graph().fed_tops()
        if len(fed) != 1:
            raise ConfigError(f"the deploy net takes {len(fed)} inputs ({', '.join(fed)}); a Model feeds one")
        (top, shape), = fed.items()
        return top, tuple(shape[1:])

    def output(self):
        """The net's output a prediction and a probability come from: its one output blob."""
        outputs = self._graph().outputs
        if len(outputs) != 1 and (self.getOrDefault("predictionCol") or self.getOrDefault("probabilityCol")):
            raise ConfigError(f"the deploy net has {len(outputs)} outputs ({', '.join(outputs)}); predictionCol "
                              "and probabilityCol take the one output of a classifier (set them to '' and name "
                              "blobs in outputBlobs)")
        return outputs[0]

    def blobs(self):
        """The blobs of outputBlobs, checked against the net."""
        names = [name.strip() for name in self.getOrDefault("outputBlobs").split(",") if name.strip()]
        graph = self._graph()
        for name in names:
            try:
                tap_name(graph, name)
            except KeyError as error:
                raise ConfigError(f"outputBlobs: {error.args[0]}") from None
        return names

    # -- transform ------------------------------------------------------------------------

    def _transform(self, dataset):
        input_col = self.getOrDefault("inputCol")
        if input_col not in dataset.columns:
            raise ConfigError(f"the DataFrame has no column '{input_col}' (inputCol); it has {dataset.columns}")
        columns, fields = [], []
        prediction, probability = self.getOrDefault("predictionCol"), self.getOrDefault("probabilityCol")
        graph = self._graph()
        if prediction or probability:
            out = self.output()
            if prediction:
                columns.append(("prediction", out))
                fields.append(T.StructField(prediction, T.DoubleType()))
            if probability:
                columns.append(("vector", out))
                fields.append(T.StructField(probability, VectorUDT()))
        for blob in self.blobs():
            columns.append(("vector", tap_name(graph, blob)))
            fields.append(T.StructField(blob, VectorUDT()))
        taken = [field.name for field in fields if field.name in dataset.columns]
        if taken:
            raise ConfigError(f"the DataFrame already has a column '{taken[0]}'; name another output column")
        forward = self.forward_spec(dataset.sparkSession, [name for _, name in columns])
        rows = dataset.rdd.mapPartitionsWithIndex(rows_with_outputs(forward, dataset.columns.index(input_col),
                                                                    columns))
        return dataset.sparkSession.createDataFrame(rows, T.StructType(dataset.schema.fields + fields),
                                                    verifySchema=False)

    def forward_spec(self, session, outputs):
        """The scoring path's Forward of this model for `outputs` (tap names), with fresh build counters."""
        sc = session.sparkContext
        size = self.batch_size()
        net = with_batch_size(self.deploy, size)
        net = with_taps(net, Graph(net, pb.TEST), [o.split("@")[0] for o in outputs])
        top, shape = self.input_top()
        self.counters = (sc.accumulator(0), sc.accumulator(0.0))
        return Forward.of(net, self.getOrDefault("backend"), self.weights, self.mean,
                          parse_transform(self.getOrDefault("transformParam")), image=top, label="", shape=shape,
                          raw_shape=None, batch_size=size, outputs=dict.fromkeys(outputs)).shipped(sc, self.counters)


def parse_transform(text):
    """A TransformationParameter from prototxt text; one line if it is not one."""
    param = pb.TransformationParameter()
    try:
        text_format.Parse(text, param)
    except text_format.ParseError as error:
        raise ConfigError(f"transformParam: not a transform_param ({error})") from None
    return param


# -- files through Spark's Hadoop file systems (what pyspark.ml's own writers use) --------------


def _hadoop(sc, path):
    jvm_path = sc._jvm.org.apache.hadoop.fs.Path(path)
    return jvm_path.getFileSystem(sc._jsc.hadoopConfiguration()), jvm_path


def write_file(sc, path, data, chunk=1 << 24):
    fs, jvm_path = _hadoop(sc, path)
    stream = fs.create(jvm_path, True)
    try:
        for start in range(0, len(data), chunk):
            stream.write(bytearray(data[start:start + chunk]))
    finally:
        stream.close()


def read_file(sc, path):
    fs, jvm_path = _hadoop(sc, path)
    stream = fs.open(jvm_path)
    try:
        return bytes(stream.readAllBytes())
    finally:
        stream.close()


def exists(sc, path):
    fs, jvm_path = _hadoop(sc, path)
    return bool(fs.exists(jvm_path))
