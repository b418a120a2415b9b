"""Training jobs: `train` — what `deepspark train` and `deepspark.train` run — over what every job shares (the algorithms are deepspark.algorithms)."""

import importlib

# The package's API, each name imported from its module when first asked for (`from deepspark.spark import train`):
# the executors' daemon runs as `python -m deepspark.spark.daemon`, which imports this package first, and in local
# mode hands its pipes to a zygote that has imported the jobs already (daemon.py); it must not import them again on
# the way, on the cores the job's start-up needs.
LAZY = {"train": "deepspark.spark.job", "Job": "deepspark.spark.job", "JobPlan": "deepspark.spark.job",
        "JobResult": "deepspark.engine", "Options": "deepspark.spark.job"}


def __getattr__(name):
    if name in LAZY:
        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'deepspark.spark' has no attribute '{name}'")


def __dir__():
    return sorted(list(globals()) + list(LAZY))


__all__ = list(LAZY)
