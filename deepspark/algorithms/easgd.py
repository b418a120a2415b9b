"""Asynchronous EASGD (the default): N long Spark tasks, each exchanging with the driver's center every period, overlapped with its next iterations; its handler (with the job's leases and, where its workers steal records, its ledger), worker loop and cost."""

import contextlib
import logging
import math
import threading
import time
import weakref

import numpy as np

from deepspark import rules
from deepspark.algorithms.base import Algorithm, Projection, center_rate, exchange_seconds, period_note, send_history
from deepspark.config import random_seed
from deepspark.data.resume import BLOCKS
from deepspark.exchange import ExchangeOptions, OverlappedExchange
from deepspark.exchange import protocol as P
from deepspark.exchange.handlers import Handler, Leases
from deepspark.exchange.ledger import Ledger
from deepspark.exchange.transport import mapped, slice_floats
from deepspark.nets import train_order
from deepspark.schedule import stop_iteration

log = logging.getLogger(__name__)


class EasgdHandler(Handler):
    """Asynchronous EASGD on EXCHANGE frames: d = α(x − x̃) goes back to the worker, x̃ += server_factor·d.

    moving_rate    α; × moving_rate_gamma every moving_rate_step exchanges, never below moving_rate_limit
                   (rules.decayed; the knobs of DeepSparkParameter)
    server_factor  scales the center's share of d
    rate_weighted  weigh each exchange by the worker's training rate as a share s of the fastest live worker's
                   (rules.rate_weighted, rules.TrainingRates): d = min(1, α/s)(x − x̃) back to the worker,
                   x̃ += server_factor·α·s(x − x̃). Off here (the paper's rule, exactly); a job takes the schema's
                   (on)
    straggler_share, straggler_gain
                   with rate_weighted, a worker under straggler_share of the fastest rate exchanges by its progress
                   (Progress): d = x − x̃ back (pull 1), x̃ += server_factor·straggler_gain·(x − h), h the center it
                   was handed at its last exchange. 0: none does (here; a job takes the schema's)
    consistent     serialise updates under a lock (deterministic tests); the default is the
                   paper's lock-free variant
    chunk          floats per slice of the update (default: transport.slice_floats by size)

    Parameters holding NaN or Inf are refused with the center untouched, and the
    connection goes on (the worker resets from x̃).

    leases         the job's Leases: each reply (DIFF, CENTER to a PULL) leases its worker the iterations it may
                   train to, so that the workers' iterations sum to the job's total whoever trains them; None:
                   each worker trains to its own stop
    """

    frame = P.EXCHANGE
    kind = "an asynchronous EASGD"

    def __init__(self, moving_rate, *, server_factor=1.0, moving_rate_gamma=1.0, moving_rate_step=0,
                 moving_rate_limit=0.0, rate_weighted=False, straggler_share=0.0, straggler_gain=0.5,
                 consistent=False, chunk=None):
        if not 0.0 < moving_rate <= 1.0:
            raise ValueError(f"moving_rate must be in (0, 1], got {moving_rate!r}")
        if not 0.0 <= straggler_share <= 1.0 or not 0.0 < straggler_gain <= 1.0:
            raise ValueError(f"straggler_share must be in [0, 1] and straggler_gain in (0, 1], got "
                             f"{straggler_share!r} and {straggler_gain!r}")
        self.base_moving_rate = float(moving_rate)
        self.server_factor = float(server_factor)
        self.decay = (float(moving_rate_gamma), int(moving_rate_step), float(moving_rate_limit))
        self.rates = rules.TrainingRates() if rate_weighted else None
        self.straggler_share, self.straggler_gain = float(straggler_share), float(straggler_gain)
        self.progress = {}  # a straggler's worker id: its Progress (of its current connection)
        self.consistent = bool(consistent)
        self.lock = threading.Lock() if consistent else contextlib.nullcontext()
        self.copy_lock = self.send_lock = self.lock
        self.chunk = chunk
        self.leases = None

    @classmethod
    def of(cls, options, **kwargs):
        """The rule of a job's ExchangeOptions: its moving rate, the rate's decay and floor, the server factor and
        the rate weighting (kwargs: consistent, chunk)."""
        return cls(options.moving_rate, server_factor=options.server_factor,
                   moving_rate_gamma=options.moving_rate_gamma, moving_rate_step=options.moving_rate_step,
                   moving_rate_limit=options.moving_rate_limit, rate_weighted=options.rate_weighted,
                   straggler_share=options.straggler_share, straggler_gain=options.straggler_gain, **kwargs)

    def attach(self, server, center):
        super().attach(server, center)
        self.step, self.span = slice_floats(center.size, self.chunk)
        self.scratch = self.span

    @property
    def moving_rate(self):
        """α after the exchanges the server has applied so far."""
        return rules.decayed(self.base_moving_rate, *self.decay, 0 if self.server is None else self.server.exchanges)

    def lease(self, worker_id, iteration):
        return None if self.leases is None else self.leases.grant(worker_id, iteration)

    def release(self, worker_id, iteration):
        if self.leases is not None:
            self.leases.release(worker_id, iteration)

    def job_iteration(self, iterations):
        """The iterations trained together / workers, with leases (Leases.iteration); else the slowest's."""
        return super().job_iteration(iterations) if self.leases is None else self.leases.iteration(iterations)

    def serve(self, conn, h):
        started = time.monotonic()  # the header has just arrived
        server, center = self.server, self.center
        buf, ok, wid = conn.buf, conn.ok, conn.worker_id
        n, step = center.size, self.step
        count = server.exchanges
        alpha = rules.decayed(self.base_moving_rate, *self.decay, count)
        factor = self.server_factor
        progress = pushed = None
        if self.rates is not None:
            share = self.rates.share(wid, h.iteration, started)
            # d = pull·(x − x̃) to the worker; the center takes server_factor·α·s(x − x̃) = factor·d.
            pull, toward = rules.rate_weighted(alpha, share)
            progress = self.straggler(conn, share)
            if progress is None:
                alpha, factor = pull, factor * toward / pull
            else:
                # d = x − x̃ (pull 1), in which h is the x̃ read; the center takes factor·(x − h), h the last
                # exchange's, or rate weighting's factor·d on a straggler's first (Progress.handed: none kept).
                pushed = progress.handed
                progress.handed = False  # until this exchange is through: h is being overwritten
                alpha, factor = 1.0, factor * (self.straggler_gain if pushed else toward)
        finite = True

        def difference(start, end):
            # Lock-free, x̃ is read while other workers add to it, as in the paper's asynchronous variant.
            nonlocal finite
            span = self.span if end == n else step  # all of x is in: the rest in as few calls as the scratch allows
            for lo in range(start, end, span):
                hi = min(lo + span, end)
                seg = buf[lo:hi]
                if progress is None:
                    rules.elastic_difference(seg, center[lo:hi], alpha, out=seg)
                else:
                    progress.difference(seg, center, lo, hi, pushed)
                if finite and not rules.all_finite(seg, ok[:hi - lo]):
                    finite = False

        frames = conn.frames
        try:
            # Outside the lock: a consistent server reads x whole first (a slow sender holds up nobody); a coded
            # x always comes whole, its tag checked, and decodes to the server's picture of the worker.
            frames.prefetch_params(self.consistent)
        except P.CodecError:
            finite = False
        with self.lock:
            if finite:
                # d = α(x − x̃) slice by slice as x arrives, in its receive buffer; a frame changed on the way
                # raises here, before anything has touched the center.
                frames.receive_params(difference, step)
            if not finite:
                # Nothing has touched the center yet: refuse, keep the connection.
                server.count(wid, "refused_nonfinite")
                reason = f"worker {wid} sent NaN or Inf parameters at iteration {h.iteration}; reset from the center"
                log.warning(reason)
                raise P.Declined(P.E_NONFINITE, reason)
            # Committed: counted before the reply so that a worker never sees its
            # exchange done before the server's books do.
            server.committed((wid,))
            self._reply(conn, count, self.lease(wid, h.iteration), factor, progress.pushed if pushed else buf)
            if progress is not None:
                progress.handed = True
            server.record(wid, latency=time.monotonic() - started)

    def left(self, worker_id):
        """Its rate and its Progress go with its connection (TrainingRates.forget): a replacement's are its own."""
        self.progress.pop(worker_id, None)
        if self.rates is not None:
            self.rates.forget(worker_id)

    def straggler(self, conn, share):
        """The Progress of the worker on `conn`, now at `share` of the fastest rate, where it is a straggler (kept
        until it is one no longer, or its connection ends or is replaced); None where it is not."""
        wid = conn.worker_id
        if share >= self.straggler_share:
            self.progress.pop(wid, None)
            return None
        progress = self.progress.get(wid)
        if progress is None or progress.conn() is not conn:  # new, or kept for a connection since replaced
            progress = self.progress[wid] = Progress(self.center.size, conn)
        return progress

    def _reply(self, conn, count, lease, factor, delta):
        """DIFF d to the worker and x̃ += factor·delta (d itself, or a straggler's progress), overlapped (the
        transport's send_delta says how), with the worker's `lease` (F_LEASE) in place of the exchanges' count where
        there is one."""
        center, scratch = self.center, conn.scratch

        def add(start, end):
            rules.apply_to_center(center[start:end], delta[start:end], factor, scratch[:end - start])

        flags = self.server.history.reply_flags(conn.worker_id)
        if lease is None:
            conn.frames.send_delta(P.DIFF, count, flags, self.span, add)
        else:
            conn.frames.send_delta(P.DIFF, lease, flags | P.F_LEASE, self.span, add)


class Progress:
    """What the server keeps of a straggler (EasgdHandler's straggler_share) on its connection `conn` (held weakly):
    h, the center it handed the worker at its last exchange, and x − h, the progress it pushes to the center at this
    one; handed: h is whole."""

    def __init__(self, n, conn):
        self.conn = weakref.ref(conn)
        # Model-sized, and kept a while: mappings of their own, unmapped when they go (transport.mapped's reason).
        self.h, self.pushed = mapped(n, np.float32), mapped(n, np.float32)
        self.handed = False

    def difference(self, seg, center, lo, hi, pushed):
        """On x's slice `seg` (in place): x − h into pushed where h is whole, h ← x̃ as read now, and d = x − h."""
        h = self.h[lo:hi]
        if pushed:
            np.subtract(seg, h, out=self.pushed[lo:hi])
        np.copyto(h, center[lo:hi])  # lock-free, x̃ moves: d and the next push count from what was read
        rules.elastic_difference(seg, h, 1.0, out=seg)


def handler(ds):
    """The exchanger's EASGD rule with the job's moving rate, its decay and floor, and the server factor."""
    return EasgdHandler.of(ExchangeOptions.of(ds))


def train_worker(trainer, client, params):
    """A worker's loop: local steps, and every period an elastic exchange (overlapped by default) with
    the center, to the iteration the exchanger leases it (its own stop where it leases none); there, the
    exchange in flight and then a last one, whose reply may lease more (the job's total not reached yet):
    the center gets the worker's final state. (last loss, no extra summary fields)."""
    model, param = trainer.model, trainer.param
    ds = param.deepspark_param
    schedule = rules.ExchangeSchedule(ds.period, adaptive=ds.adaptive_period)
    exchange = OverlappedExchange(client, model.get_flat, model.set_flat, params, overlap=ds.overlap)
    loss = math.nan
    stop = stop_iteration(param)

    def limit():
        return stop if client.lease is None else client.lease

    while True:
        while model.iter < limit():
            loss = trainer.step()
            exchange.poll()
            if schedule.step(loss):
                exchange.start(model.iter, loss, before=lambda: send_history(client, model, asked=True))
            else:
                client.report(model.iter, loss)  # nothing while an exchange is in flight
        if client.lease is not None and exchange.wait() and model.iter < limit():
            continue  # the reply in flight leased more
        # The last solver history is held for the job's last snapshot.
        exchange.finish(model.iter, loss, before=lambda: send_history(client, model))
        if model.iter >= limit():
            return loss, {}


def project(costs, network, workers, period, overlap=True, shared=1.0):
    """Async EASGD: a worker computes `period` steps, then exchanges.

        compute = period · T_comp · shared            (shared > 1: workers share cores)
        cycle   = max(compute, T_comm) + T_worker     (overlapped: the exchange runs during the next steps)
        cycle   = compute + T_comm + T_worker         (blocking)
        cycle_N = max(cycle, N / R)                   (past R the workers queue at the center)
        images/s = N · period · batch / cycle_N
    """
    compute = period * costs.step * shared
    comm = exchange_seconds(costs, network)
    cycle = (max(compute, comm) if overlap else compute + comm) + costs.worker
    rate = center_rate(costs, network)
    cycle_n = max(cycle, workers / rate)
    images = workers * period * costs.batch / cycle_n
    return Projection(workers, images, images * costs.step / costs.batch, 1 - compute / cycle_n,
                      min(1.0, workers / cycle_n / rate), cycle_n)


class Easgd(Algorithm):
    """Async EASGD: every period, d = α(x − x̃); the worker takes x − d, the center x̃ + d (rules.py)."""

    name = "easgd"
    steals = True

    def title(self, ds):
        return "async EASGD"

    def handler(self, ds, workers):
        return handler(ds)

    def job_handler(self, job):
        """The handler, leasing the job's iterations (Leases): each worker 2 periods past its last exchange, a
        lone worker all of them (its fixed count, as before), none past max_iter under poly (its rate is 0 there)."""
        ds, param = job.ds, job.param
        rule = handler(ds)
        rule.leases = Leases(job.workers, stop_iteration(param), job.start_iter,
                             lookahead=None if job.workers == 1 else 2 * ds.period,
                             cap=param.max_iter if param.lr_policy == "poly" else None)
        if job.stealing is not None:  # the record blocks the workers claim, in the order the job's seed draws
            ranges, block = job.stealing
            rule.ledger = Ledger([(r.start, r.stop) for r in ranges], block, seed=random_seed(param),
                                 shuffle=train_order(ds, spark=True) == BLOCKS)
        return rule

    def final_iteration(self, job, results):
        """The job's iteration: the iterations trained together / workers."""
        return job.server.job_iteration()

    def listening(self, job):
        ds = job.ds
        said = f"{job.workers} workers, period {ds.period}, moving rate {ds.moving_rate:g}"
        if ds.rate_weighted:
            said += ", weighted by each worker's share of the fastest one's rate"
            if ds.straggler_share > 0:
                said += (f"; under {ds.straggler_share:g} of it, the center takes {ds.straggler_gain:g} of a "
                         "worker's progress")
        return said

    def train(self, job, task):
        results = job.run_workers(task, train_worker, job.ds.exchange_timeout)
        leases, ledger = job.server.handler.leases, job.server.handler.ledger
        if leases is not None:
            log.info(leases.line({w: s.get("iteration", 0) for w, s in job.server.stats().items()}))
        if ledger is not None:
            log.info(ledger.line())
        return results

    def plan_note(self, ds):
        return period_note(ds)

    def cost(self, costs, network, ds, workers, shared=1.0):
        return project(costs, network, workers, ds.period, ds.overlap, shared)

    def saturation(self, costs, network, ds):
        """R × the cycle of one worker alone."""
        alone = project(costs, network, 1, ds.period, ds.overlap)
        return int(alone.cycle * center_rate(costs, network))
