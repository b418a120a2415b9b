"""DeepSpark: Caffe-defined networks trained on Spark with asynchronous EASGD."""

__version__ = "0.1.0"


def train(solver, data=None, **options):
    """Train from a solver .prototxt, as `deepspark train` does; returns the job's summary dict.

    The options are deepspark.spark.train's: weights, snapshot, iterations,
    output, and any DeepSparkParameter field by name (workers, algorithm,
    period, moving_rate, master, backend, ...).
    """
    from deepspark import spark  # deferred: deepspark.spark imports pyspark, which `import deepspark.x` need not

    return spark.train(solver, data, **options)
