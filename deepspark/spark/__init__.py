"""Training jobs: the algorithm registry, and `train` — what `deepspark train` and `deepspark.train` run."""

from deepspark import nets
from deepspark.config import load_solver, output_folder, override
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.average import AverageJob
from deepspark.spark.easgd import EasgdJob
from deepspark.spark.job import JobResult, Options
from deepspark.spark.sync import SyncJob

# The algorithms that run on Spark, by DeepSparkParameter.Algorithm; SINGLE runs in this process (deepspark.nets).
JOBS = {pb.DeepSparkParameter.EASGD: EasgdJob, pb.DeepSparkParameter.SYNC: SyncJob,
        pb.DeepSparkParameter.AVERAGE: AverageJob}


def train(solver, data=None, *, deepspark=None, weights=None, snapshot=None, iterations=None, output=None, **knobs):
    """Train from a solver .prototxt (a path, or a loaded config.Solver); returns its JobResult (`.summary`: the
    summary dict, `.history`, `.weights` in memory; the same for every algorithm).

    data: a Spark DataFrame to train on instead of the train net's source, with a
    `datum` column (Caffe Datum bytes) or `data` (an image array) and `label`
    columns; its SparkSession runs the job and stays the caller's. deepspark: a
    DeepSparkParameter prototxt (default: deepspark.prototxt beside the solver,
    if there is one) over the solver's own deepspark_param block. weights: a
    .caffemodel to start from; snapshot: a .solverstate to resume; iterations:
    the iteration training stops at (max_iter, and so the learning-rate
    schedule, as the solver says); output: the folder for snapshots and logs; knobs: any
    DeepSparkParameter field by name (workers=4, algorithm="sync", period=10,
    moving_rate=0.45, ...), over both.
    """
    solver = load_solver(solver, deepspark) if isinstance(solver, str) else solver
    override(solver, iterations=iterations, output=output, **knobs)
    algorithm = solver.param.deepspark_param.algorithm
    if algorithm == pb.DeepSparkParameter.SINGLE:
        if data is not None:
            raise ConfigError("a DataFrame is trained on by the Spark algorithms, not 'single'", solver.path)
        return nets.train(solver, weights=weights, snapshot=snapshot)
    options = Options(weights=weights, snapshot=snapshot, data=data)
    return JOBS[algorithm](solver, options).run()
