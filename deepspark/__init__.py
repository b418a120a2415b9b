"""DeepSpark: Caffe-defined networks trained on Spark with asynchronous EASGD."""

import os
import sys

__version__ = "0.1.0"

# The Python API's classes, each imported from its module when first asked for (`from deepspark import Net`),
# so that `import deepspark` stays light: TensorFlow or pycaffe load only when a net is built.
LAZY = {"Net": "deepspark.net", "Classifier": "deepspark.classifier", "Detector": "deepspark.detect",
        "detections": "deepspark.detect"}

# TensorFlow prints its C++ start-up notices (oneDNN, CPU features, absl) unless told before it loads, and
# more than our backend load it (tensorboard's writer does); every DeepSpark process, driver or worker,
# imports this package first. A user's own setting wins. oneDNN itself stays on (see log.NATIVE_BANNER).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The `deepspark` logger's handler (deepspark.log.Log, the process's console until a run opens its own), there
# before any module logs: every DeepSpark process imports this package first.
from deepspark import log  # noqa: E402,F401


def _executors_python():
    """The Python the executors run, where the user chose none: this one (where deepspark is), from the session's
    first job. pyspark's own default, `python3` on PATH, is another Python wherever the venv is not activated (a
    notebook's kernel, an IDE, cron): it may lack deepspark, and a user's UDFs would run there before the first
    DeepSpark job and here after it (spark.session.this_python). A SparkContext already running is told too."""
    if os.environ.get("PYSPARK_PYTHON") or not sys.executable:  # the user's choice; an embedded Python's none
        return
    context = getattr(sys.modules.get("pyspark.context"), "SparkContext", None)  # pyspark is not imported for it
    if getattr(context, "_active_spark_context", None) is not None:
        from deepspark.spark.session import this_python  # deferred with pyspark, which is loaded already here

        this_python(context._active_spark_context)
    os.environ["PYSPARK_PYTHON"] = sys.executable  # read as each SparkContext starts (a Connect server's too)


_executors_python()


def train(solver, data=None, **options):
    """Train from a solver .prototxt, as `deepspark train` does; returns the job's JobResult (`.summary`: the
    summary dict; `.history`: the displays and tests, as train.log has them; `.weights`: the final snapshot's
    arrays in memory; `.snapshots`), the same for every algorithm.

    The options are deepspark.spark.train's: weights, snapshot, iterations,
    output, and any DeepSparkParameter field by name (workers, algorithm,
    period, moving_rate, master, backend, ...).
    """
    from deepspark import spark  # deferred: deepspark.spark imports pyspark, which `import deepspark.x` need not

    return spark.train(solver, data, **options)


def __getattr__(name):
    if name in LAZY:
        import importlib  # deferred with the module it loads: see LAZY

        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'deepspark' has no attribute '{name}'")


def __dir__():
    return sorted(list(globals()) + list(LAZY))
