"""DeepSparkModel: a deploy net and its weights as a pyspark.ml Transformer whose transform runs the net on the
executors through an Arrow UDF (classic Spark and Spark Connect alike)."""

import dataclasses
import functools
import logging

import numpy as np
from google.protobuf import text_format
from pyspark.ml import Model
from pyspark.ml.functions import array_to_vector, vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import functions as F
from pyspark.sql import types as T

from deepspark import checkpoint, config, nets
from deepspark.data import load_mean
from deepspark.errors import ConfigError
from deepspark.graph import Graph, crop_of, crop_shape, fmt, tap_name, with_batch_size, with_taps
from deepspark.ml import frames, images
from deepspark.ml.columns import Held, SkipCount, check_workers, outputs_of
from deepspark.ml.images import ARRAY, DATUM, VECTOR
from deepspark.ml.params import Stage, with_accessors, with_schema
from deepspark.ml.persist import ModelReader, ModelWriter
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.scoring import Forward
from deepspark.spark.session import is_connect, this_python


def parse_transform(text):
    """A TransformationParameter from prototxt text; one line if it is not one."""
    param = pb.TransformationParameter()
    try:
        text_format.Parse(text, param)
    except text_format.ParseError as error:
        raise ConfigError(f"transformParam: not a transform_param ({error})") from None
    return param


def parse_shape(text, param="inputShape"):
    """(C, H, W) of "C,H,W" (or "H,W": one channel)."""
    try:
        shape = tuple(int(d) for d in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise ConfigError(f"{param} is '{text}'; it takes C,H,W (or H,W for one channel): '1,28,28'")
    return shape if len(shape) == 3 else (1,) + shape


log = logging.getLogger(__name__)
COLUMNAR_INPUT = "spark.sql.execution.arrow.pythonUDF.columnarInput.enabled"


def quoted(name):
    """The column `name` as a Column, whatever characters it holds (a dot, a backtick)."""
    return F.col("`%s`" % name.replace("`", "``"))


def net_input(net):
    """(the deploy net's one input top, its (C, H, W))."""
    fed = Graph(net, pb.TEST).fed_tops()
    if len(fed) != 1:
        raise ConfigError(f"the deploy net takes {len(fed)} inputs ({', '.join(fed)}); a Model feeds one")
    (top, shape), = fed.items()
    return top, tuple(shape[1:])


def image_shape(dataset, column, kind, depth, given, net, head=None, transform=None):
    """(C, H, W) of the images in `column`: `given` (inputShape), else a nested array's or a Datum's own (the first
    row's), else the deploy `net`'s input. `head`: a function that returns frames.head(dataset, column).
    `transform`: Caffe's transform_param the images are to take; where it crops nothing, Datums are taken to be of
    the net's input shape with no job to read one (a transform's executors check each Datum as they decode it)."""
    if given:
        return parse_shape(given)
    if kind == DATUM and transform is not None and not all(crop_of(transform)):
        return net_input(net)[1]
    if kind == DATUM or (kind == ARRAY and depth > 1):
        first = head() if head else frames.head(dataset, column)
        if not len(first):
            raise ConfigError(f"inputCol '{column}' holds no image (every row is null)")
        if kind == DATUM:
            return images.column_images(first, kind, None)[0].shape[1:]
        return (1,) * (3 - depth) + np.asarray(first[0].as_py()).shape
    return net_input(net)[1]


def check_shape(column, shape, net, transform):
    """One line unless images of `shape` are what the deploy `net` takes after Caffe's `transform` (its crop)."""
    wanted = net_input(net)[1]
    if crop_shape(transform, shape) != wanted:
        crop = " after transform_param's crop" if all(crop_of(transform)) else ""
        raise ConfigError(f"inputCol '{column}' holds {fmt(shape)} images (its first row's); the net takes "
                          f"{fmt(wanted)}{crop}")


@with_accessors
@with_schema(pb.ScoreParameter)
class DeepSparkModel(Model, Stage, MLWritable, MLReadable):
    """A deploy net and its weights as a Transformer: transform(df) runs the net on the executors over inputCol
    (Datum bytes, or an image as a Spark ML vector or an array, flat or nested; inputScale, then Caffe's TEST-phase
    transform_param first) and adds predictionCol (the argmax of the net's output), the output as a vector in
    probabilityCol where a Softmax layer makes it (probabilities), else in rawPredictionCol (raw scores, as Spark ML's
    classifiers name them) and a vector column per blob of outputBlobs. The net is built once per Python worker, and run
    batchSize images at a time."""

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
        self.history = []  # its tests and displays: [{"iteration", "seconds", "loss", "test0/accuracy", ...}]
        self.labels = None  # the class names of its label indices, where a StringIndexer gave them (getLabels)
        self.counters = None  # (builds, build seconds) of the last classic transform, once an action ran it

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
        model._set(transformParam=text_format.MessageToString(param, as_one_line=True))
        model._set_kwargs(params)
        model._check(caffemodel)
        return model

    def write(self):
        return ModelWriter(self)

    @classmethod
    def read(cls):
        return ModelReader(cls)

    def getHistory(self):
        """The fit's training history: per display and per test, {"iteration", "seconds", "loss" (the train loss
        displayed; NaN at a test), and each test output by name ("test0/accuracy")}."""
        return list(self.history)

    def getLabels(self):
        """The class names the predictions index (a prediction p is the class getLabels()[int(p)]), where the fit's
        labelCol came from a StringIndexer (its labels, as IndexToString takes them); else None."""
        return None if self.labels is None else list(self.labels)

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
        return net_input(with_batch_size(self.deploy, self.getOrDefault("batchSize")))

    def output(self):
        """(the net's output a prediction and its scores come from: its one output blob, the column those scores go
        to: probabilityCol where a Softmax layer makes the blob, else rawPredictionCol; '' for none)."""
        graph = self._graph()
        outputs = graph.outputs
        if len(outputs) != 1:
            if self.getOrDefault("predictionCol") or self.getOrDefault("probabilityCol"):
                raise ConfigError(f"the deploy net has {len(outputs)} outputs ({', '.join(outputs)}); predictionCol "
                                  "and probabilityCol take the one output of a classifier (set them to '' and name "
                                  "blobs in outputBlobs)")
            return None, ""
        made_by = [layer.type for layer in graph.layers if outputs[0] in layer.tops][-1]
        return outputs[0], self.getOrDefault("probabilityCol" if made_by == "Softmax" else "rawPredictionCol")

    def output_columns(self):
        """[(kind, net output, column name)] of the columns transform adds: the prediction, the scores (as output
        says), a vector per blob of outputBlobs."""
        out, scores = self.output()
        prediction = self.getOrDefault("predictionCol") if out else ""
        columns = [("prediction", out, prediction)] if prediction else []
        columns += [("vector", out, scores)] if scores else []
        graph = self._graph()
        return columns + [("vector", tap_name(graph, blob), blob) for blob in self.blobs()]

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
        if is_connect(dataset):
            check_workers(dataset.sparkSession, self.getOrDefault("backend"))
        # The input's first rows, taken once (one Spark job) where its shape or its scale is read from them.
        first = functools.cache(lambda: frames.first_rows(dataset, self.getOrDefault("inputCol")))

        def head():  # image_shape and scale_for take a function: they may not need the rows
            return first().values

        inputs = self.inputs_of(dataset, head)
        columns = self.output_columns()
        fields = [T.StructField(name, T.DoubleType() if kind == "prediction" else VectorUDT())
                  for kind, _, name in columns]
        taken = [field.name for field in fields if field.name in dataset.columns]
        if taken:
            raise ConfigError(f"the DataFrame already has a column '{taken[0]}'; name another output column")
        skip = self.getOrDefault("handleInvalid") == "skip"
        if not skip and inputs.kind != DATUM:
            self.check_first_rows(inputs, first())
        forward = self.forward_spec(dataset, [name for _, name, _ in columns], self.scale_for(dataset, inputs, head))
        carried = [T.StructField(f.name, T.ArrayType(T.DoubleType()) if isinstance(f.dataType, VectorUDT)
                                 else f.dataType) for f in fields]
        # An Arrow UDF takes no vectors: Spark's vector_to_array makes them flat arrays of doubles (below).
        arrays = dataclasses.replace(inputs, kind=ARRAY, depth=1) if inputs.kind == VECTOR else inputs
        context = None if not skip or is_connect(dataset) else dataset.sparkSession.sparkContext
        skipped = None if context is None else \
            context.accumulator(0, SkipCount(inputs.column, context.statusTracker()))
        net = F.arrow_udf(outputs_of(forward, arrays, columns, skip, skipped), T.StructType(carried))
        # One struct column from the UDF, then its fields: Spark evaluates the UDF once (it does not inline an
        # expensive expression into each field's reference), and the other columns never leave the JVM.
        held = "__deepspark_outputs"
        while held in dataset.columns:
            held += "_"
        if any(isinstance(field.dataType, T.UserDefinedType) for field in dataset.schema.fields):
            # Spark's columnar input to Arrow UDFs converts every column of a columnar scan (Parquet's) to Arrow, and
            # has no conversion for a user-defined type such as a Spark ML vector: off, the rows go as they always did.
            dataset.sparkSession.conf.set(COLUMNAR_INPUT, "false")
        image = quoted(inputs.column)
        # vector_to_array refuses a null vector (a Java error, with no row named): the net's UDF takes it as null.
        out = dataset.withColumn(held, net(F.when(image.isNotNull(), vector_to_array(image))
                                           if inputs.kind == VECTOR else image))
        if skip:
            out = out.filter(F.col(held).isNotNull())
        return out.select(*(quoted(name) for name in dataset.columns),
                          *((array_to_vector(F.col(held)[f.name]) if isinstance(f.dataType, VectorUDT)
                             else F.col(held)[f.name]).alias(f.name) for f in fields))

    def inputs_of(self, dataset, head=None):
        """Where the images are in `dataset` and their (C, H, W) (image_shape)."""
        column = self.getOrDefault("inputCol")
        kind, depth = frames.input_kind(dataset, column)
        transform = parse_transform(self.getOrDefault("transformParam"))
        shape = image_shape(dataset, column, kind, depth, self.getOrDefault("inputShape"), self.deploy, head,
                            transform)
        check_shape(column, shape, self.deploy, transform)
        return frames.Inputs(column, kind, depth, shape)

    @staticmethod
    def check_first_rows(inputs, first):
        """One line, on the driver as transform() is called, unless the input's first rows (`first`:
        frames.first_rows') hold images of the net's size and no null: such a column fails here, not in the
        executors' tasks, whose Java and Python errors a user reads before its line. The rows after them are
        checked as the executors score them."""
        if first.null_row is not None:
            raise ConfigError(f"inputCol '{inputs.column}': row {first.null_row} is null (handleInvalid='skip' "
                              "leaves such rows out)")
        ok = images.column_images(first.values, inputs.kind, inputs.shape)[1]
        if not ok.all():
            raise images.bad_row(first.values, inputs.kind, inputs.shape, ok,
                                 f"inputCol '{inputs.column}' (its first {len(ok)} rows that are not null)")

    def scale_for(self, dataset, inputs, head=None):
        """inputScale as set, else as a sample of the input needs it (images.input_scale; Datums, Caffe's own
        records, take the transform_param as Caffe gives it them: 1), said in one line where that is not what the
        model was fitted with (its default: what its training data needed)."""
        if self.isSet("inputScale") and self.getOrDefault("inputScale") > 0:
            return self.getOrDefault("inputScale")
        fitted = self.getOrDefault("inputScale") or 1.0
        if inputs.kind == DATUM:
            if fitted != 1:
                log.info(f"DeepSparkModel: inputCol '{inputs.column}' holds Caffe Datums, which take the net's "
                         f"transform_param as Caffe gives it them: inputScale 1 (it was fitted with {fitted:g}; "
                         "set inputScale to choose)")
            return 1.0
        scale = parse_transform(self.getOrDefault("transformParam")).scale
        found = frames.sample(dataset, inputs.column, inputs.kind, inputs.shape, head() if head else None)
        if not found.size:
            return fitted
        wanted = images.input_scale(found, scale)
        if wanted != fitted:
            log.info(f"DeepSparkModel: inputCol '{inputs.column}' holds values in [{found.min():g}, "
                     f"{found.max():g}] and the net's transform_param scales by {scale:g}: inputScale {wanted:g} "
                     f"(it was fitted with {fitted:g}; set inputScale to choose)")
        return wanted

    def forward_spec(self, dataset, outputs, scale=1.0):
        """The scoring path's Forward of this model for `outputs` (tap names), the input multiplied by `scale`
        before the transform_param; shipped as classic Spark ships it (a broadcast, fresh build counters), or
        in the task's closure under Spark Connect."""
        forward = self.forward(outputs, scale)
        if is_connect(dataset):
            self.counters = None
            return dataclasses.replace(forward, weights=Held(forward.weights))
        sc = this_python(dataset.sparkSession.sparkContext)
        self.counters = (sc.accumulator(0), sc.accumulator(0.0))
        return forward.shipped(sc, self.counters)

    def forward(self, outputs, scale=1.0):
        """forward_spec's Forward before it is shipped: its weights the bytes themselves (Held in this process:
        ml/flavor.py's MLflow model scores without Spark)."""
        size = self.batch_size()
        net = with_batch_size(self.deploy, size)
        net = with_taps(net, Graph(net, pb.TEST), [o.split("@")[0] for o in outputs])
        top, shape = self.input_top()
        transform, mean = images.scaled_transform(parse_transform(self.getOrDefault("transformParam")), scale,
                                                  self.mean)
        return Forward.of(net, self.getOrDefault("backend"), self.weights, mean, transform, image=top, label="",
                          shape=shape, raw_shape=None, batch_size=size, outputs=dict.fromkeys(outputs))
