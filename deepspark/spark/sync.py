"""Synchronous SGD by parameter averaging after every iteration, the CaffeOnSpark-style baseline: a round barrier on the driver's exchanger, all N tasks in one barrier stage."""

import math
import socket
import zlib

import numpy as np

from deepspark.exchange import RefusedError, RoundsHandler
from deepspark.schedule import stop_iteration
from deepspark.spark import executor
from deepspark.spark.job import Job

# Seconds a sync worker waits beyond exchange_timeout for its round: the server fails a round that
# cannot complete after exchange_timeout with the reason, and the worker should report that reason,
# not a bare timeout of its own.
REASON_SECONDS = 10


def digest(params):
    """A short fingerprint of a parameter vector, to show in the log that workers agree."""
    return f"{zlib.crc32(np.ascontiguousarray(params).view(np.uint8)):08x}"


class SyncJob(Job):
    """Every worker's parameters averaged after every iteration (the exchanger's synchronous rounds),
    in Spark's barrier execution mode so that all N tasks start together."""

    title = "synchronous averaging every iteration"

    def hold_center(self, center, host, secret):
        ds = self.ds
        server = self.exchange_server(center, host, secret, RoundsHandler(self.workers))
        self.log.info(f"Exchanger listening on {server.address[0]}:{server.address[1]}; {self.workers} workers "
                      f"averaged every iteration (synchronous rounds, timeout {ds.exchange_timeout:g}s)")
        if ds.HasField("period") and ds.period != 1:
            self.log.warning(f"sync averages every iteration; period {ds.period} is not used")
        return server

    def train(self, task):
        timeout = self.ds.exchange_timeout + REASON_SECONDS
        # The shuffle after the barrier stage makes it a ShuffleMapStage, which Spark reruns
        # whole when a task fails (a barrier ResultStage fails the job instead): every worker
        # then rejoins at the last completed round.
        results = self.watch(lambda: self.shards.barrier().mapPartitionsWithIndex(
            lambda i, items: [executor.run(i, items, task, train_worker, timeout)]).repartition(1).collect())
        digests = {r.digest for r in results}
        center = digest(self.center_flat())
        agree = "yes" if digests == {center} else "NO"
        self.log.info(f"Workers hold the center after the last round: {agree} "
                      f"(crc32 {', '.join(r.digest for r in sorted(results, key=lambda r: r.worker))}; "
                      f"center {center})")
        return results


def train_worker(trainer, client, params):
    """A sync worker's loop: a local step, then the round's mean, every iteration. Never rejoins: a
    round cannot complete without every worker (Spark reruns the whole stage instead)."""
    model, where = trainer.model, f"worker {client.worker_id} on {socket.gethostname()}"
    loss = math.nan
    stop = stop_iteration(trainer.param)
    while model.iter < stop:
        loss = trainer.step()
        params = executor.read_params(client, model, params)
        try:
            client.average(params, model.iter, loss)
        except RefusedError as error:
            raise executor.WorkerError(f"{where}: {error.reason}") from None
        except OSError as error:
            raise executor.WorkerError(
                f"{where}: no average from the driver's exchanger for iteration {model.iter} within "
                f"{client.timeout:g}s ({error or type(error).__name__})") from None
        executor.write_params(client, model, params)
        executor.send_history(client, model, asked=True)
    executor.send_history(client, model)  # held for the job's last snapshot
    return loss, {"digest": digest(params)}
