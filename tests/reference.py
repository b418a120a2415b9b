"""The update rules composed as the tests check the exchanger and the baselines against: one elastic exchange on
both sides, and one periodic averaging round, in place on plain arrays (no socket, no Spark)."""

import numpy as np

from deepspark import rules


def easgd_step(x, center, moving_rate, server_factor=1.0):
    """One elastic exchange on both sides, in place; returns d."""
    d = rules.elastic_difference(x, center, moving_rate)
    rules.apply_to_worker(x, d)
    rules.apply_to_center(center, d, server_factor)
    return d


def averaging_step(workers, period, iteration, out=None):
    """Baseline round: when due, every worker's parameters become their mean (in place); returns whether it ran."""
    if not rules.periodic_due(iteration, period):
        return False
    mean = rules.average_models(workers, out=out)
    for w in workers:
        np.copyto(w, mean)
    return True
