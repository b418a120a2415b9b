"""DeepSparkEstimator: the training job as a pyspark.ml Estimator, its Params the schema's (and the solver's files'
values their defaults)."""

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable

from deepspark import config
from deepspark.errors import DeepSparkError
from deepspark.ml import flavor
from deepspark.ml.fit import Fit
from deepspark.ml.params import Stage, enum_name, with_accessors, with_schema
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.bars import no_spark_bar

# DeepSparkParameter fields that say where a job runs and how its data gets there: the DataFrame's session and its
# rows decide both for fit. (iterations is fit's maxIter, Spark ML's name.)
NOT_FOR_FIT = {"master", "ship_records", "iterations"}


def _shown(value):
    """A schema float as its prototxt gave it (0.45, not float32's 0.44999998807907104)."""
    return float(f"{value:.7g}") if isinstance(value, float) else value


@with_accessors
@with_schema(pb.ValidationParameter)
@with_schema(pb.ScoreParameter)
@with_schema(pb.DeepSparkParameter, skip=NOT_FOR_FIT)
class DeepSparkEstimator(Estimator, Stage, DefaultParamsWritable, DefaultParamsReadable):
    """fit(df) trains the solver's net on the DataFrame's rows with the Spark job `deepspark train` runs (the
    DataFrame's SparkSession runs it) and returns a DeepSparkModel of the deploy net and the learned weights. The rows
    hold an image in inputCol (a Spark ML vector, an array of numbers, flat or nested, or Caffe Datum bytes) and a
    class index in labelCol (any numeric type: StringIndexer's doubles as they are; a Datum's own label where the
    DataFrame has no labelCol). Params left unset keep what the solver's files say; explainParams shows those."""

    solver = Param(Params._dummy(), "solver", "the solver .prototxt (its net names the train and test nets)",
                   TypeConverters.toString)
    deepspark = Param(Params._dummy(), "deepspark", "a DeepSparkParameter .prototxt over the solver's own "
                      "(default: deepspark.prototxt beside the solver, if there is one)", TypeConverters.toString)
    deploy = Param(Params._dummy(), "deploy", "the deploy .prototxt of the Model (default: deploy.prototxt "
                   "beside the solver)", TypeConverters.toString)
    weights = Param(Params._dummy(), "weights", "a .caffemodel to start from (fine-tuning)", TypeConverters.toString)
    output = Param(Params._dummy(), "output", "the folder each fit makes its own folder in, for its snapshots, log "
                   "and validation data (default: the solver's snapshot_prefix's folder, else the working "
                   "directory)", TypeConverters.toString)
    maxIter = Param(Params._dummy(), "maxIter", "iterations per worker: the solver's max_iter",
                    TypeConverters.toInt)
    seed = Param(Params._dummy(), "seed", "the solver's random_seed: "
                 + config.field_comments("SolverParameter").get("random_seed", "") + " It also seeds "
                 "validationFraction's split", TypeConverters.toInt)

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__()
        self._schema_defaults()
        self._set_kwargs(self._input_kwargs)

    def _set_kwargs(self, kwargs):
        super()._set_kwargs(kwargs)
        if {"solver", "deepspark"} & set(kwargs):
            self._solver_defaults()
        return self

    def setSolver(self, value):
        return self._set_kwargs({"solver": value})

    def setDeepspark(self, value):
        return self._set_kwargs({"deepspark": value})

    def _solver_defaults(self):
        """The defaults of the solver's knobs (maxIter, seed, the DeepSparkParameter Params) as the solver's files
        give them: what a fit that leaves them unset uses, and what explainParams shows. A solver that does not
        load keeps the schema's defaults; fit says what is wrong with it."""
        path = self._given("solver")
        try:
            solver = config.load_solver(path, self._given("deepspark")) if path else None
        except DeepSparkError:
            solver = None
        if solver is None:
            return
        ds = solver.param.deepspark_param
        for name, (message, field, _) in self._schema.items():
            if message is pb.DeepSparkParameter:
                descriptor, value = ds.DESCRIPTOR.fields_by_name[field], getattr(ds, field)
                self._setDefault(**{name: enum_name(descriptor, value) if descriptor.enum_type else _shown(value)})
        self._setDefault(maxIter=solver.param.max_iter, seed=solver.param.random_seed)

    def _fit(self, dataset):
        no_spark_bar(dataset.sparkSession)  # in a notebook, DeepSpark's progress shows, not Spark's \r stage bar
        try:
            model = Fit(self, dataset).run()
        except BaseException:
            flavor.discard_run()  # under autolog, a failed fit leaves no FAILED run
            raise
        flavor.autologged(model)  # under mlflow.pyspark.ml.autolog, the model as an MLflow pyfunc (ml/flavor.py)
        return model
