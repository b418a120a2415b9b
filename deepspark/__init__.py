"""DeepSpark: Caffe-defined networks trained on Spark with asynchronous EASGD."""

__version__ = "0.1.0"


def train(solver, data=None, **options):
    """Train from a solver .prototxt, as `deepspark train` does; returns the job's summary dict.

    data: a Spark DataFrame to train on instead of the train net's LMDB, with
    a `datum` column (Caffe Datum bytes) or `data` (image array) and `label`
    columns; its SparkSession runs the job. options: the command's flags as
    keywords (backend, workers, master, algorithm, period, moving_rate,
    weights, snapshot, output, iterations, shared_data).
    """
    import argparse

    from deepspark.config import load_solver
    from deepspark.proto import deepspark_pb2 as pb
    from deepspark.solver import apply_overrides, run_single

    flags = {"backend": None, "workers": None, "master": None, "algorithm": None, "period": None,
             "moving_rate": None, "weights": None, "snapshot": None, "output": None, "iterations": None,
             "shared_data": False}
    unknown = set(options) - set(flags)
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
    args = argparse.Namespace(**{**flags, **options})
    loaded = apply_overrides(load_solver(solver), args)
    if loaded.param.deepspark_param.algorithm == pb.DeepSparkParameter.SINGLE:
        if data is not None:
            raise ValueError("a DataFrame is trained on by the Spark algorithms, not 'single'")
        return run_single(loaded, args)
    from deepspark.spark.driver import run

    return run(loaded, args, data=data)
