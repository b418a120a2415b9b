"""Training jobs: `train` — what `deepspark train` and `deepspark.train` run — over what every job shares (the algorithms are deepspark.algorithms)."""

from deepspark import algorithms
from deepspark.config import load_solver, override
from deepspark.spark.job import Job, JobPlan, JobResult, Options


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
    algorithm = algorithms.of(solver.param.deepspark_param)
    algorithm.check(solver.param.deepspark_param, solver.path)
    options = Options(weights=weights, snapshot=snapshot, data=data)
    if not algorithm.spark:
        return algorithm.run(solver, options)
    return Job().run(JobPlan.of(solver, options, algorithm))


__all__ = ["train", "Job", "JobPlan", "JobResult", "Options"]
