"""DeepSpark: Caffe-defined networks trained on Spark with asynchronous EASGD."""

import os

__version__ = "0.1.0"

# The Python API's classes, each imported from its module when first asked for (`from deepspark import Net`),
# so that `import deepspark` stays light: TensorFlow or pycaffe load only when a net is built.
LAZY = {"Net": "deepspark.net", "Classifier": "deepspark.classifier"}

# TensorFlow prints its C++ start-up notices (oneDNN, CPU features, absl) unless told before it loads, and
# more than our backend load it (tensorboard's writer does); every DeepSpark process, driver or worker,
# imports this package first. A user's own setting wins. oneDNN itself stays on (see log.NATIVE_BANNER).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def train(solver, data=None, **options):
    """Train from a solver .prototxt, as `deepspark train` does; returns the job's summary dict.

    The options are deepspark.spark.train's: weights, snapshot, iterations,
    output, and any DeepSparkParameter field by name (workers, algorithm,
    period, moving_rate, master, backend, ...).
    """
    from deepspark import spark  # deferred: deepspark.spark imports pyspark, which `import deepspark.x` need not

    return spark.train(solver, data, **options).summary


def __getattr__(name):
    if name in LAZY:
        import importlib  # deferred with the module it loads: see LAZY

        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'deepspark' has no attribute '{name}'")


def __dir__():
    return sorted(list(globals()) + list(LAZY))
