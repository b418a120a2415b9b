"""The executors' pyspark daemon in local mode (spark.python.daemon.module): pyspark's own, with the jobs' modules and the job's backend imported before it forks the Python workers.

A Python worker that Spark starts for a task is a fork of this daemon, so it
starts with deepspark (which a task's closure names) and TensorFlow already
imported, once for all of them, and shares that import's pages with the
daemon (copy-on-write) instead of holding its own. Running as
`python -m deepspark.spark.daemon` has imported deepspark.spark (the jobs and
the executor's loop) by the time this module runs; the backend is imported
here. Nothing here may start a thread or TensorFlow's runtime: the workers
are forks.
"""

import gc
import os
import sys

from pyspark import daemon

from deepspark.backends import backend_module
from deepspark.spark.session import DAEMON_BACKEND

# The backends imported here: TensorFlow takes its thread counts when a model starts its runtime, in the worker
# after the fork. pycaffe is not: its BLAS reads the worker's thread count as it loads (worker.set_threads sets
# it first), which an import here would read from the daemon's environment instead.
PRELOADED = ("tensorflow",)


def preload(backend):
    """Import backend `backend` if it is one of PRELOADED, with stdout pointed at stderr meanwhile: the daemon's
    stdout is its channel to the JVM. A backend that does not import is left to the task that needs it, whose error
    names it. Then freeze what is loaded, so that the collector does not write to the pages the forks share."""
    if backend in PRELOADED:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            backend_module(backend)
        except Exception:  # a task that imports it says why
            pass
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
    gc.freeze()


if __name__ == "__main__":
    preload(os.environ.get(DAEMON_BACKEND))
    daemon.manager()
