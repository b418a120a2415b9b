"""Periodic model averaging in pure Spark, the SparkNet-style baseline, with DiLoCo's outer Nesterov step: each round broadcasts the center, every worker runs period iterations from it, the driver averages; its cost."""

import logging
import math

import numpy as np

from deepspark import rules
from deepspark.algorithms.base import Algorithm, Pace, Projection, period_note

log = logging.getLogger(__name__)
# Seconds a Spark round of `average` costs outside its steps and its transfers (task launch, the
# broadcast's and the collect's own work), as measured on local[2] with LeNet (bench/plan_check.py checks the model).
AVERAGE_ROUND_SECONDS = 0.2


def train_round(trainer, steps):
    """A worker's part of a round, from the broadcast center already in its model: `steps` local iterations;
    the last loss."""
    loss = math.nan
    for _ in range(steps):
        loss = trainer.step()
    return loss


def transfers(costs, network, workers):
    """An `average` round's transfers over the driver's one link: 2 · N · S / bandwidth + 2 · latency, S the
    float32 parameters (Spark's broadcast and collect, not the exchanger's codec)."""
    return 2 * workers * costs.spark_bytes / network.bandwidth + 2 * network.latency


def project(costs, network, workers, period, shared=1.0):
    """Periodic model averaging in Spark rounds (SparkNet-style): the driver broadcasts the center to N
    and collects N models over its one link; a round costs its Spark overhead too.

        cycle = period · T_comp · shared + 2 · N · S / bandwidth + 2 · latency + AVERAGE_ROUND_SECONDS
    """
    compute = period * costs.step * shared
    moved = transfers(costs, network, workers)
    cycle = compute + moved + AVERAGE_ROUND_SECONDS
    images = workers * period * costs.batch / cycle
    return Projection(workers, images, images * costs.step / costs.batch, 1 - compute / cycle, moved / cycle, cycle)


class Average(Algorithm):
    """Each round broadcasts the center; every partition runs `period` local iterations from it on a Trainer cached
    in its Python worker (the spark Job's run_rounds), and the driver averages what they return
    (rules.average_models) into the next center, or moves the center toward that mean by DiLoCo's outer Nesterov
    step (rules.outer_step) when outer_learning_rate or outer_momentum say so. No exchanger: the driver holds
    the center between rounds (job.center, and the outer momentum job.velocity)."""

    name = "average"
    exchanger = False
    no_codec = "average moves its models through Spark's broadcast and collect"

    @staticmethod
    def outer(ds):
        """The outer optimizer is on: the center is not simply the workers' mean."""
        return ds.outer_learning_rate != 1.0 or ds.outer_momentum != 0.0

    def title(self, ds):
        outer = (f", outer Nesterov (DiLoCo) rate {ds.outer_learning_rate:g}, momentum "
                 f"{ds.outer_momentum:g}") if self.outer(ds) else ""
        return f"model averaging every {ds.period} iterations{outer}"

    def hold_center(self, job, center, host, secret):
        job.center = center
        job.velocity = np.zeros_like(center) if self.outer(job.ds) else None  # the outer momentum
        job.pace, job.paced = Pace(), job.start_iter  # the workers' rates, and the iteration rounds ended at
        log.info(f"No exchanger: the center is broadcast every {job.ds.period} iterations and "
                 f"the {job.workers} workers' parameters averaged on the driver")
        return None

    def center_flat(self, job):
        return job.center.copy()

    def train(self, job, task):
        return job.run_rounds(task, train_round, self.update_center)

    def update_center(self, job, returned):
        """The next center from the round's parameters (in worker order): their mean (rules.average_models,
        collected rather than tree-aggregated so that it is that exact rule), or DiLoCo's outer step toward it; a
        line when a straggler holds the rounds (base.Pace: each worker's steps over its own seconds in them)."""
        steps, job.paced = returned[0]["iteration"] - job.paced, returned[0]["iteration"]
        for r in returned:
            job.pace.add(r["worker"], r["seconds"], steps)
        said = job.pace.judge()
        if said:
            log.info(said)
        mean = rules.average_models([r["params"] for r in returned])
        if self.outer(job.ds):
            rules.outer_step(job.center, mean, job.velocity, job.ds.outer_learning_rate, job.ds.outer_momentum)
        else:
            job.center = mean

    def plan_note(self, ds):
        return period_note(ds)

    def cost(self, costs, network, ds, workers, shared=1.0):
        return project(costs, network, workers, ds.period, shared)
