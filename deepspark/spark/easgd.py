"""Asynchronous EASGD on Spark (the default): N long tasks, each exchanging with the driver's center every period, overlapped with its next iterations."""

import math

from deepspark import rules
from deepspark.schedule import stop_iteration
from deepspark.exchange import EasgdHandler
from deepspark.spark import executor
from deepspark.spark.job import Job


def handler(ds):
    """The exchanger's EASGD rule with the job's moving rate, its decay and floor, and the server factor."""
    return EasgdHandler(ds.moving_rate, server_factor=ds.server_factor, moving_rate_gamma=ds.moving_rate_gamma,
                        moving_rate_step=ds.moving_rate_step, moving_rate_limit=ds.moving_rate_limit)


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
    loss = math.nan
    stop = stop_iteration(param)
    while model.iter < stop:
        loss = trainer.step()
        if client.pending and client.ready:
            params = executor.read_params(client, model, params)
            client.poll(params)
            executor.write_params(client, model, params)
        if schedule.step(loss):
            params = executor.read_params(client, model, params)
            if client.pending:  # the previous difference first, so the snapshot includes it
                client.wait(params)
                executor.write_params(client, model, params)
            executor.send_history(client, model, asked=True)
            if ds.overlap:
                client.exchange_async(params, model.iter, loss)
            else:
                client.exchange(params, model.iter, loss)
                executor.write_params(client, model, params)
        elif not client.pending:
            client.report(model.iter, loss)
    params = model.get_flat(params)
    client.wait(params)
    executor.send_history(client, model)  # held for the job's last snapshot
    client.exchange(params, model.iter, loss)  # the center gets the final state
    return loss, {}
