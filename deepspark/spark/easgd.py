"""Asynchronous EASGD on Spark (the default): N long tasks, each exchanging with the driver's center every period, overlapped with its next iterations."""

import math

from deepspark import rules
from deepspark.exchange import EasgdHandler, ExchangeOptions, OverlappedExchange
from deepspark.schedule import stop_iteration
from deepspark.spark import executor
from deepspark.spark.job import Job


def handler(ds):
    """The exchanger's EASGD rule with the job's moving rate, its decay and floor, and the server factor."""
    return EasgdHandler.of(ExchangeOptions.of(ds))


class EasgdJob(Job):
    """N Spark tasks, one per worker, each training its shard and exchanging with x̃ on the driver."""

    title = "async EASGD"

    def hold_center(self, center, host, secret):
        ds = self.ds
        server = self.exchange_server(center, host, secret, handler(ds))
        self.log.info(f"Exchanger listening on {server.address[0]}:{server.address[1]}; "
                      f"{self.workers} workers, period {ds.period}, moving rate {ds.moving_rate:g}")
        return server

    def train(self, task):
        timeout = self.ds.exchange_timeout
        return self.watch(lambda: self.shards.mapPartitionsWithIndex(
            lambda i, items: [executor.run(i, items, task, train_worker, timeout)]).collect())


def train_worker(trainer, client, params):
    """A worker's loop: local steps, and every period an elastic exchange (overlapped by default) with
    the center; the center gets the worker's final state. (last loss, no extra summary fields)."""
    model, param = trainer.model, trainer.param
    ds = param.deepspark_param
    schedule = rules.ExchangeSchedule(ds.period, adaptive=ds.adaptive_period)
    exchange = OverlappedExchange(client, model.get_flat, model.set_flat, params, overlap=ds.overlap)
    loss = math.nan
    stop = stop_iteration(param)
    while model.iter < stop:
        loss = trainer.step()
        exchange.poll()
        if schedule.step(loss):
            exchange.start(model.iter, loss, before=lambda: executor.send_history(client, model, asked=True))
        else:
            client.report(model.iter, loss)  # nothing while an exchange is in flight
    # The last solver history is held for the job's last snapshot.
    exchange.finish(model.iter, loss, before=lambda: executor.send_history(client, model))
    return loss, {}
