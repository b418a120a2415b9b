"""What DeepSparkEstimator.fit does, step by step: the solver with the Params over it, the DataFrame's images and
labels checked and their scale found, validation rows held out for the driver's test nets, the training job on
the rest, the final model tested, and the Model of its last snapshot with the fit's history."""

import contextlib
import importlib.util
import logging
import math
import os
import secrets
import sys
import time

import numpy as np
from google.protobuf import text_format
from py4j.protocol import Py4JJavaError
from pyspark import StorageLevel
from pyspark.errors.exceptions.captured import CapturedException

from deepspark import checkpoint, config, engine, nets, spark
from deepspark.data import load_mean
from deepspark.data.datum import save_mean
from deepspark.errors import ConfigError
from deepspark.graph import DATA_TYPES, Graph, layer_included
from deepspark.log import Log, train_log
from deepspark.ml import frames, images
from deepspark.ml.columns import BACKEND_MODULES
from deepspark.ml.images import DATUM
from deepspark.ml.model import DeepSparkModel, check_shape, image_shape, parse_transform
from deepspark.spark.failures import failed
from deepspark.spark.session import is_connect, quiet_tasks, this_python
from deepspark.proto import deepspark_pb2 as pb

log = logging.getLogger(__name__)
# How a backend's library gets into the environment: setup.py's extras, or pycaffe built (tools/build-caffe.sh).
INSTALL = {"tensorflow": "pip install -e '.[tensorflow]' (or '.[notebook]', which brings it)",
           "caffe": "make caffe (it builds pycaffe into this environment)"}
# The layers whose first bottom's channels are the classes a label indexes, with the message of their axis.
CLASS_LAYERS = {"SoftmaxWithLoss": "softmax_param", "Accuracy": "accuracy_param", "MultinomialLogisticLoss": None,
                "InfogainLoss": "infogain_loss_param"}


def class_count(graph):
    """(how many classes the net's labels index: the channels of what its loss or accuracy compares the label with,
    a label value it ignores or None); (None, None) for a net with no such layer."""
    for layer in graph.layers:
        if layer.type in CLASS_LAYERS and len(layer.bottoms) > 1 and layer.bottom_shapes[0]:
            field = CLASS_LAYERS[layer.type]
            axis = getattr(layer.param, field).axis if field and layer.param.HasField(field) else 1
            loss = layer.param.loss_param
            return layer.bottom_shapes[0][axis], loss.ignore_label if loss.HasField("ignore_label") else None
    return None, None


def test_transform(solver):
    """The transform_param of the solver's first test net's Data layer (else its train net's): what the
    Model applies to an image before the deploy net, as Caffe's TEST phase does."""
    nets = [net for net, _, _ in solver.test_nets] + [solver.train_net]
    for net in nets:
        for layer in net.layer:
            if layer.type in DATA_TYPES and layer.HasField("transform_param"):
                return text_format.MessageToString(layer.transform_param, as_one_line=True)
    return ""


def test_data_layers(solver):
    """[(test net index, its Data layer in the TEST phase)] of the solver's test nets."""
    return [(i, layer) for i, (net, _, state) in enumerate(solver.test_nets) for layer in net.layer
            if layer.type == "Data" and layer_included(layer, state)]


def record_in_mlflow(history):
    """The history's losses and test outputs as metrics of the MLflow run in progress (autolog's), by iteration;
    nothing where MLflow is not in use."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return
    for entry in history:
        metrics = {("train_loss" if name == "loss" else name): value for name, value in entry.items()
                   if name not in ("iteration", "seconds") and np.isfinite(value)}
        if metrics:
            mlflow.log_metrics(metrics, step=int(entry["iteration"]))


def backend_installed(backend):
    """One line, before anything starts, unless this Python imports `backend`'s library: the job's workers run this
    Python (PYSPARK_PYTHON, set as deepspark is imported), and would fail one by one after connect_timeout."""
    module = BACKEND_MODULES.get(backend)
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError(f"backend '{backend}' needs {module}, which this Python ({sys.executable}) cannot import: "
                          f"{INSTALL[backend]}")


@contextlib.contextmanager
def params_named(est):
    """A ConfigError about a schema field that the Estimator's Param set, raised inside, said as that Param: the
    user's word (`maxIter must be at least 1`, not `iterations ...`) and no file, since the file did not say it."""
    names = {field: name for name, (message, field, _) in est._schema.items()
             if message is pb.DeepSparkParameter and est.isSet(name)}
    if est.isSet("maxIter"):
        names["iterations"] = "maxIter"
    try:
        yield
    except ConfigError as error:
        field = error.message.split(" ", 1)[0]
        if field not in names:
            raise
        raise ConfigError(f"DeepSparkEstimator's {names[field]}{error.message[len(field):]}") from None


class Fit:
    """One fit of an Estimator on a DataFrame; run() returns the Model."""

    def __init__(self, estimator, dataset):
        self.est, self.dataset = estimator, dataset
        self.done = set()  # the Data layers rescale() has scaled
        self.output = None  # the fit's own folder, once load_solver made it
        self.made = []  # the folders load_solver made: the fit's own and, where it was not there, output
        self.deploy = None  # the deploy net of the Model, once load_solver found it

    def run(self):
        """The fit, Spark's own reports of a failed task kept off the console: one line says what failed (the fit's
        train.log holds the whole report)."""
        if is_connect(self.dataset):
            raise ConfigError("fit runs the training job through a SparkContext, which Spark Connect does not give; "
                              "fit in classic Spark (a DeepSparkModel's transform runs under Spark Connect too)")
        sc = this_python(self.dataset.sparkSession.sparkContext)  # before any function is shipped to the executors
        try:
            with quiet_tasks(sc), contextlib.ExitStack() as self.kept:
                try:
                    return self.fit()
                except (CapturedException, Py4JJavaError) as error:
                    failure = failed(error, sc)
                if self.output:
                    with Log(train_log(self.output), append=True) as run_log:
                        run_log.detail(failure.detail)
                raise failure
        except BaseException:
            self.tidy()
            raise

    def fit(self):
        est = self.est
        solver = self.solver = self.load_solver()
        deploy = self.deploy
        transform = test_transform(solver)  # as the solver gives it: the Model applies inputScale itself
        inputs = self.inputs(solver, deploy)
        skip = est.getOrDefault("handleInvalid") == "skip"
        wanted = [inputs.column, inputs.label, est.getOrDefault("validationCol")]
        if frames.held_in_driver(self.dataset):
            log.warning("fit: the DataFrame's rows are held in the driver (it was made from a Python list or a "
                        "pandas DataFrame), and Spark ships them inside the tasks of every job that reads them, "
                        "from the driver's heap: a second fit on many rows can run it out of memory; write them "
                        "to Parquet once and fit on spark.read.parquet(path)")
        data = self.dataset.select(*[column for column in wanted if column in self.dataset.columns])
        if self.dataset.storageLevel == StorageLevel.NONE:  # read by the checks, the sample, the split, the job
            data = self.keep(data)
        data = frames.checked(data, inputs, skip)
        scale = self.scale(data, inputs)
        self.rescale(solver.train_net, pb.NetState(phase=pb.TRAIN), scale)
        seed = est.getOrDefault("seed") if est.isSet("seed") else max(solver.param.random_seed, 0)
        train, valid = frames.split(data, est.getOrDefault("validationCol"), est.getOrDefault("validationFraction"),
                                    seed)
        self.validation(solver, valid, inputs, skip, scale)
        # Kept: the job counts the rows, then shards them.
        result = spark.train(solver, self.keep(frames.datum_frame(train, inputs, skip)), weights=est._given("weights"))
        summary, history = self.final_test(solver, result)
        model = DeepSparkModel.from_caffe(deploy, summary["weights"], transform=transform,
                                          backend=solver.param.deepspark_param.backend)
        est._copyValues(model)
        model._setDefault(inputScale=scale)  # what its data needed: a transform checks its own against it
        model.summary, model.history = {**summary, "output": self.output}, history
        model.labels = frames.label_names(self.dataset, inputs.label)  # a Pipeline's StringIndexer's, for MLflow
        record_in_mlflow(history)
        return model

    def keep(self, frame):
        """`frame` persisted (memory, then disk) until the fit ends."""
        frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
        self.kept.callback(frame.unpersist)
        return frame

    def load_solver(self):
        """The solver with the Estimator's Params over it, writing into a folder of this fit's own (fits in parallel,
        as TrainValidationSplit runs them, do not share one)."""
        est = self.est
        path = est._given("solver")
        if not path:
            raise ConfigError("DeepSparkEstimator needs a solver: DeepSparkEstimator(solver='solver.prototxt')")
        for name in ("solver", "deepspark"):
            given = est._given(name)
            if given and not os.path.isfile(given):  # said with the folder a relative path is read from
                raise ConfigError(f"{name} file not found" + ("" if os.path.isabs(given) else
                                  f" in {os.getcwd()} (a relative path is the working directory's)"), given)
        solver = config.load_solver(path, est._given("deepspark"))
        self.deploy = est._given("deploy") or config.model_file(path, "deploy.prototxt")
        if self.deploy is None:  # said before the fit's folder is made
            raise ConfigError("no deploy.prototxt beside the solver: set the Estimator's deploy Param to the "
                              "deploy net of the Model", path)
        solver.param.snapshot_after_train = True  # the Model is made of the final snapshot
        knobs = {field: est.getOrDefault(name) for name, (message, field, _) in est._schema.items()
                 if message is pb.DeepSparkParameter and est.isSet(name)}
        base = config.output_folder(solver, est._given("output"))
        output = os.path.join(base, f"fit-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")
        with params_named(est):
            config.override(solver, iterations=est.getOrDefault("maxIter") if est.isSet("maxIter") else None,
                            output=output, **knobs)
        if est.isSet("seed"):
            solver.param.random_seed = est.getOrDefault("seed")
        backend_installed(solver.param.deepspark_param.backend)
        self.made = [folder for folder in (output, base) if not os.path.isdir(folder)]  # what tidy may remove
        os.makedirs(output)
        self.output = output
        return solver

    def tidy(self):
        """The folders this fit made and left empty (it failed before writing to them) removed: a failed fit
        leaves no empty folder behind."""
        for folder in self.made:
            with contextlib.suppress(OSError):  # not empty (the failure's train.log, a snapshot): kept
                os.rmdir(folder)

    def inputs(self, solver, deploy):
        """Where the DataFrame's images and labels are, the (C, H, W) an image has, and the classes of the net."""
        est, df = self.est, self.dataset
        column = est.getOrDefault("inputCol")
        kind, depth = frames.input_kind(df, column)
        label = frames.label_column(df, est.getOrDefault("labelCol"), kind != DATUM or est.isSet("labelCol"))
        net = nets.deploy_net(deploy, "DeepSparkEstimator")[0]
        shape = image_shape(df, column, kind, depth, est.getOrDefault("inputShape"), net)
        check_shape(column, shape, net, parse_transform(test_transform(solver)))
        graph = Graph(solver.train_net, pb.TRAIN, source=solver.train_map, data_shape=lambda _: tuple(shape))
        classes, ignored = class_count(graph) if label else (None, None)
        return frames.Inputs(column, kind, depth, tuple(shape), label, classes, ignored)

    def scale(self, data, inputs):
        """inputScale as set, else as a sample of the data needs it (said in one line); Datums, Caffe's own records,
        take the transform_param as Caffe gives it them (1)."""
        scale = self.est.getOrDefault("inputScale")
        if self.est.isSet("inputScale") and scale > 0:
            return scale
        if inputs.kind == DATUM:
            return 1.0
        train_scale = next((layer.transform_param.scale for layer in self.solver.train_net.layer
                            if layer.type in DATA_TYPES and layer_included(layer, pb.NetState(phase=pb.TRAIN))), 1.0)
        found = frames.sample(data, inputs.column, inputs.kind, inputs.shape)
        scale = images.input_scale(found, train_scale)
        if scale != 1:
            log.info(f"inputCol '{inputs.column}' holds values within [0, 1] (its first {len(found)} rows: "
                     f"{found.min():g} to {found.max():g}) and the net's transform_param scales by "
                     f"{train_scale:g}, for 0-255 pixels: they are multiplied by {scale:g} first, the pixels "
                     "again, as the net takes them (inputScale; the model keeps it)")
        return scale

    def rescale(self, net, state, scale):
        """The Data layers of `net` in the phase of `state` made to take images multiplied by `scale` first, as
        Caffe's transform_param can hold it (images.scaled_transform; a mean_file's image written scaled)."""
        for index, layer in enumerate(net.layer):
            if scale == 1 or layer.type not in DATA_TYPES or not layer_included(layer, state) or id(layer) in self.done:
                continue
            self.done.add(id(layer))  # a layer of both phases, or of a net two test nets share, is scaled once
            param = layer.transform_param
            scaled, mean = images.scaled_transform(param, scale, load_mean(param.mean_file) if param.mean_file else None)
            if mean is not None:
                scaled.mean_file = os.path.join(self.output, f"mean_{pb.Phase.Name(state.phase)}_{index}.binaryproto")
                save_mean(mean, scaled.mean_file)
            layer.transform_param.CopyFrom(scaled)

    def validation(self, solver, valid, inputs, skip, scale):
        """The validation rows as an LMDB in the fit's folder that the solver's test nets read (test_iter covering
        them, their Data layers taking the rows' scale); without validation rows, the solver's own test data where it
        is there, else no test."""
        layers = test_data_layers(solver)
        if valid is None:
            missing = [layer.data_param.source for _, layer in layers if not os.path.exists(layer.data_param.source)]
            if missing:
                log.info(f"No validation: the solver's test data {missing[0]} is not there (validationCol or "
                         "validationFraction tests the model on rows of the DataFrame as it trains)")
                solver.test_nets = []
                solver.param.ClearField("test_iter")
                solver.param.test_interval = 0
            return
        if not layers:
            raise ConfigError("validation rows need a test net in the solver: a Data layer in the TEST phase "
                              "(as train_val.prototxt has)", solver.path)
        path = os.path.abspath(os.path.join(self.output, "validation_lmdb"))
        count = frames.write_datums(frames.datum_frame(valid, inputs, skip), path)
        if not count:
            raise ConfigError("no rows to validate on (validationCol or validationFraction left none)")
        for i, layer in layers:
            layer.data_param.source = path
            solver.param.test_iter[i] = math.ceil(count / layer.data_param.batch_size)
        for net, _, state in solver.test_nets:
            self.rescale(net, state, scale)
        log.info(f"Validating on {count} rows held out of the DataFrame, at every test_interval "
                 f"({solver.param.test_interval}) and at the end")

    def final_test(self, solver, result):
        """The fit's summary and history (the job's JobResult), the history ending with a test of the final model
        (which the job's own cadence may have left untested; logged in the fit's train.log): the summary's test
        outputs are that model's."""
        summary, history, final = result.summary, list(result.history), result.summary["iterations"]
        tested = [entry["iteration"] for entry in history if any(name.startswith("test") for name in entry)]
        if not solver.test_nets or (tested and tested[-1] == final):
            return summary, history
        with Log(train_log(self.output), append=True):
            evaluator = nets.evaluator(solver)
            try:
                graph = evaluator.nets[0][0].graph
                arrays = checkpoint.weights_for(graph, result.weights, [None] * len(graph.params), summary["weights"])
                results = evaluator.test(final, graph, arrays)
            finally:
                evaluator.close()
        return {**summary, **engine.first_values(results)}, history + engine.test_entries(result.started, final, results)
