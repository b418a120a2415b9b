"""Single-worker SGD in this process, the baseline the others are measured against: no Spark, no exchanger; its cost."""

from deepspark import nets
from deepspark.algorithms.base import Algorithm, Projection
from deepspark.errors import ConfigError


class Single(Algorithm):
    """One Trainer here (deepspark.nets.train), as `caffe train` runs."""

    name = "single"
    spark = False
    exchanger = False
    no_codec = "single exchanges nothing"

    def title(self, ds):
        return "single-worker SGD"

    def run(self, solver, options):
        """Train `solver` here (options: the spark Job's Options); its JobResult."""
        if options.data is not None:
            raise ConfigError("a DataFrame is trained on by the Spark algorithms, not 'single'", solver.path)
        return nets.train(solver, weights=options.weights, snapshot=options.snapshot)

    def cost(self, costs, network, ds, workers, shared=1.0):
        """One worker's steps, nothing else: images/s = batch / (T_comp · shared)."""
        images = costs.batch / (costs.step * shared)
        return Projection(1, images, 1.0, 0.0, 0.0, costs.step * shared)
