"""The exchange algorithms, one module each, and the one table that train, plan and the training check read."""

from deepspark.algorithms.average import Average
from deepspark.algorithms.base import Algorithm, Projection, WorkerError
from deepspark.algorithms.easgd import Easgd
from deepspark.algorithms.single import Single
from deepspark.algorithms.sync import Sync
from deepspark.proto import deepspark_pb2 as pb

# One row per DeepSparkParameter.Algorithm value: the algorithm whole (its module says what each part is).
ALGORITHMS = {pb.DeepSparkParameter.EASGD: Easgd(), pb.DeepSparkParameter.SYNC: Sync(),
              pb.DeepSparkParameter.AVERAGE: Average(), pb.DeepSparkParameter.SINGLE: Single()}


def of(ds):
    """The row of DeepSparkParameter `ds`'s algorithm."""
    return ALGORITHMS[ds.algorithm]


def check(ds, path):
    """DeepSparkParameter values that its algorithm cannot run: one line naming the field (after
    config.check_deepspark, which checks what every algorithm needs)."""
    of(ds).check(ds, path)


__all__ = ["ALGORITHMS", "Algorithm", "Projection", "WorkerError", "of", "check"]
