"""Synchronous SGD by parameter averaging after every iteration, the CaffeOnSpark-style baseline: rounds on the driver's exchanger, all N tasks in one barrier stage; its handler, worker loop and cost."""

import logging
import math
import socket
import threading
import time
import zlib

import numpy as np

from deepspark import rules
from deepspark.algorithms.base import Algorithm, Pace, Projection, WorkerError, read_params, send_history, write_params
from deepspark.exchange import RefusedError
from deepspark.exchange import protocol as P
from deepspark.exchange.handlers import Handler
from deepspark.schedule import stop_iteration

log = logging.getLogger(__name__)
# Seconds a sync worker waits beyond exchange_timeout for its round: the server fails a round that
# cannot complete after exchange_timeout with the reason, and the worker should report that reason,
# not a bare timeout of its own.
REASON_SECONDS = 10


class _Round:
    """One synchronous averaging round: the workers' parameters received so far (their receive buffers)."""

    def __init__(self):
        self.iteration = None
        self.params = {}     # worker id -> its connection's buffer, untouched while it waits
        self.done = False
        self.failure = None  # why the round can never complete


class RoundsHandler(Handler):
    """Synchronous averaging rounds on AVERAGE frames (the CaffeOnSpark-style baseline).

    workers        N: the AVERAGE frames of N workers for the same iteration form a round; the
                   center becomes their mean (rules.average_models, in worker-id order) and each
                   worker gets it back as CENTER
    round_timeout  seconds a worker waits for the rest of its round (default: the server's options' timeout)
    pace           the workers' rates (base.Pace: from each reply sent to the worker's next frame), and the line
                   that says a straggler holds the rounds

    A round that cannot complete (a worker left, or round_timeout passed) is failed for
    every worker in it, with the reason. Every (re)joining worker restarts at the last
    completed round, so that they agree.
    """

    frame = P.AVERAGE
    kind = "a synchronous"

    def __init__(self, workers, *, round_timeout=None, pace=None):
        if int(workers) < 1:
            raise ValueError(f"a synchronous round needs at least one worker, got {workers!r}")
        self.workers = int(workers)
        self.round_timeout = round_timeout
        self._cond = threading.Condition()
        self.copy_lock = self._cond  # never half-way through writing a round's mean
        self._round = _Round()
        self._rounds = 0
        self._round_iteration = None  # the iteration of the last completed round
        self._gone = set()  # workers that left and have not rejoined: no round can complete without them
        self.pace = Pace() if pace is None else pace
        self._replied = {}  # worker id -> when its last round's reply went: its work since is its own

    def attach(self, server, center):
        super().attach(server, center)
        if self.round_timeout is None:
            self.round_timeout = server.idle_timeout
        self._round_iteration = server.resume_iteration

    @property
    def rounds(self):
        """Synchronous averaging rounds completed so far."""
        return self._rounds

    def start_iteration(self, worker_id):
        """The last completed round. An open round that holds this worker's frame holds its previous
        connection's (a process Spark has since replaced, whose server thread still waits in the round
        and never saw its socket die): it can never complete as it is, so it fails, and its waiters with it."""
        self._replied.pop(worker_id, None)  # a rejoin's wait is not its work
        with self._cond:
            self._gone.discard(worker_id)
            rnd = self._round
            if worker_id in rnd.params and not rnd.done and not rnd.failure:
                rnd.failure = (f"worker {worker_id} rejoined while the round of iteration {rnd.iteration} held its "
                               "previous connection's parameters; the round starts again")
                self._round = _Round()
                self._cond.notify_all()
            return self._round_iteration

    def serve(self, conn, h):
        """Add x to the round of its iteration; once all N are in, every worker gets their mean."""
        wid = conn.worker_id
        replied = self._replied.pop(wid, None)
        if replied is not None:  # the header has just arrived: its step and its x read out since the last reply
            self.pace.add(wid, time.monotonic() - replied)
        try:
            conn.frames.receive_params()  # the worker's x as the server sees it
            finite = rules.all_finite(conn.buf)
        except P.CodecError:
            finite = False
        if not finite:
            # A round cannot go on without this worker's parameters: it fails for everyone.
            raise P.Refusal(P.E_NONFINITE, f"worker {wid} sent NaN or Inf parameters at iteration {h.iteration}; "
                            "the synchronous round cannot complete")
        with self._cond:
            rnd = self._round
            if rnd.params and h.iteration != rnd.iteration:
                raise P.ProtocolError(f"worker {wid} sent iteration {h.iteration} while the round of iteration "
                                      f"{rnd.iteration} is open")
            if wid in rnd.params:
                raise P.ProtocolError(f"worker {wid} sent twice in the round of iteration {h.iteration}")
            rnd.iteration = h.iteration
            rnd.params[wid] = conn.buf
            if len(rnd.params) == self.workers:
                rules.average_models([rnd.params[w] for w in sorted(rnd.params)], out=self.center)
                rnd.done = True
                self._round = _Round()
                self._rounds += 1
                self._round_iteration = h.iteration
                self.server.committed(rnd.params)
                self._cond.notify_all()
                said = self.pace.judge()
                if said:
                    log.info(said)
            elif not self._cond.wait_for(lambda: rnd.done or rnd.failure, self.round_timeout):
                self._fail_late(rnd)
            if rnd.failure:
                raise P.Refusal(P.E_TIMEOUT, rnd.failure)
            # The center changes again only when a round completes, which needs this
            # worker's next frame: sending it outside the lock is safe (and so is a PULL's).
        conn.frames.send_model(P.CENTER, self.center, h.iteration, self.server.history.reply_flags(wid))
        self._replied[wid] = time.monotonic()

    def _fail_late(self, rnd):
        """Fail `rnd`, which round_timeout passed without. A worker that left may be rejoining (Spark retries
        a barrier stage as a whole), so its absence only fails the round at the timeout, but the message names it."""
        gone = (f"; worker {', '.join(map(str, sorted(self._gone)))} left after the round of iteration "
                f"{self._round_iteration} and has not rejoined") if self._gone else ""
        rnd.failure = (f"round of iteration {rnd.iteration}: {len(rnd.params)} of {self.workers} workers "
                       f"({', '.join(map(str, sorted(rnd.params)))}) arrived within {self.round_timeout:g}s{gone}")
        self._round = _Round()
        self._cond.notify_all()

    def left(self, worker_id):
        """An open round it is in, or that waits for it, can never complete (the server calls this for a
        worker's current connection only)."""
        with self._cond:
            self._gone.add(worker_id)
            rnd = self._round
            if rnd.params and not rnd.done and not rnd.failure:
                rnd.failure = (f"worker {worker_id} left during the round of iteration {rnd.iteration} "
                               f"({len(rnd.params) - (worker_id in rnd.params)} of {self.workers} workers had "
                               "arrived)")
                self._round = _Round()
                self._cond.notify_all()


def digest(params):
    """A short fingerprint of a parameter vector, to show in the log that workers agree."""
    return f"{zlib.crc32(np.ascontiguousarray(params).view(np.uint8)):08x}"


def train_worker(trainer, client, params):
    """A sync worker's loop: a local step, then the round's mean, every iteration. Never rejoins: a
    round cannot complete without every worker (Spark reruns the whole stage instead)."""
    model, where = trainer.model, f"worker {client.worker_id} on {socket.gethostname()}"
    loss = math.nan
    stop = stop_iteration(trainer.param)
    while model.iter < stop:
        loss = trainer.step()
        params = read_params(client, model, params)
        try:
            client.average(params, model.iter, loss)
        except RefusedError as error:
            raise WorkerError(f"{where}: {error.reason}") from None
        except OSError as error:
            raise WorkerError(
                f"{where}: no average from the driver's exchanger for iteration {model.iter} within "
                f"{client.timeout:g}s ({error or type(error).__name__})") from None
        write_params(client, model, params)
        send_history(client, model, asked=True)
    send_history(client, model)  # held for the job's last snapshot
    return loss, {"digest": digest(params)}


def project(costs, network, workers, shared=1.0):
    """Synchronous averaging every iteration (CaffeOnSpark-style), through the one center: after each step
    all N send x and get the mean back; the center's link carries N vectors each way and it serves the
    round's N frames one after another.

        cycle = T_comp · shared + T_worker + 2 · N · S / bandwidth + 2 · latency + N · T_server
    """
    center = 2 * workers * costs.bytes / network.bandwidth + workers * costs.server
    cycle = costs.step * shared + costs.worker + center + 2 * network.latency
    images = workers * costs.batch / cycle
    return Projection(workers, images, images * costs.step / costs.batch, 1 - costs.step * shared / cycle,
                      center / cycle, cycle)


class Sync(Algorithm):
    """Every worker's parameters averaged after every iteration (the exchanger's synchronous rounds), in Spark's
    barrier execution mode so that all N tasks start together."""

    name = "sync"

    def title(self, ds):
        return "synchronous averaging every iteration"

    def handler(self, ds, workers):
        return RoundsHandler(workers)

    def listening(self, job):
        return (f"{job.workers} workers averaged every iteration (synchronous rounds, timeout "
                f"{job.ds.exchange_timeout:g}s)")

    def hold_center(self, job, center, host, secret):
        server = super().hold_center(job, center, host, secret)
        if job.ds.HasField("period") and job.ds.period != 1:
            log.warning(f"sync averages every iteration; period {job.ds.period} is not used")
        return server

    def train(self, job, task):
        # The barrier stage: all N tasks start together, and Spark reruns the whole stage when one fails
        # (every worker then rejoins at the last completed round).
        results = job.run_workers(task, train_worker, job.ds.exchange_timeout + REASON_SECONDS, barrier=True)
        digests = {r.digest for r in results}
        center = digest(job.center_flat())
        agree = "yes" if digests == {center} else "NO"
        log.info(f"Workers hold the center after the last round: {agree} "
                 f"(crc32 {', '.join(r.digest for r in sorted(results, key=lambda r: r.worker))}; "
                 f"center {center})")
        return results

    def cost(self, costs, network, ds, workers, shared=1.0):
        return project(costs, network, workers, shared)
