"""The exchange server's two applications: asynchronous EASGD on EXCHANGE frames, synchronous averaging rounds on AVERAGE frames."""

import contextlib
import logging
import threading
import time

from .. import rules
from . import codec as C
from . import protocol as P
from .transport import slice_floats

log = logging.getLogger("deepspark.exchange.handlers")


class Handler:
    """What an application adds to ExchangeServer's one loop; the server calls it from each worker's connection thread.

    frame      the model frame type it serves (the other one is refused)
    kind       what that makes the server, for the refusal ("a synchronous")
    scratch    floats of scratch space each connection needs (Connection.allocate)
    copy_lock  held while ExchangeServer.pull() copies the center
    send_lock  held while the reply to a PULL frame sends the center
    """

    frame = None
    kind = None
    scratch = 0
    copy_lock = send_lock = contextlib.nullcontext()
    server = center = None

    def attach(self, server, center):
        """Serve `server`, whose center x̃ is the array `center` (called once, before it starts)."""
        if self.server is not None:
            raise ValueError("a handler serves one server; make one per ExchangeServer")
        self.server, self.center = server, center

    def serve(self, conn, header):
        """Answer one `frame` frame whose header has been read, through the connection's frames (conn.frames:
        float32 arrays in and out, whatever the codec); raise protocol.Declined to refuse the frame and go on,
        protocol.Refusal to end the connection."""
        raise NotImplementedError

    def start_iteration(self, worker_id):
        """The iteration a (re)joining worker starts at; None for its own last reported one
        (resume_iteration when the id is new). Never called under the server's bookkeeping lock."""
        return None

    def left(self, worker_id):
        """An authenticated worker's connection has ended."""


class EasgdHandler(Handler):
    """Asynchronous EASGD on EXCHANGE frames: d = α(x − x̃) goes back to the worker, x̃ += server_factor·d.

    moving_rate    α; × moving_rate_gamma every moving_rate_step exchanges, never below moving_rate_limit
                   (rules.decayed; the knobs of DeepSparkParameter)
    server_factor  scales the center's share of d
    consistent     serialise updates under a lock (deterministic tests); the default is the
                   paper's lock-free variant
    chunk          floats per slice of the update (default: transport.slice_floats by size)

    Parameters holding NaN or Inf are refused with the center untouched, and the
    connection goes on (the worker resets from x̃).
    """

    frame = P.EXCHANGE
    kind = "an asynchronous EASGD"

    def __init__(self, moving_rate, *, server_factor=1.0, moving_rate_gamma=1.0, moving_rate_step=0,
                 moving_rate_limit=0.0, consistent=False, chunk=None):
        if not 0.0 < moving_rate <= 1.0:
            raise ValueError("moving_rate must be in (0, 1], got %r" % (moving_rate,))
        self.base_moving_rate = float(moving_rate)
        self.server_factor = float(server_factor)
        self.decay = (float(moving_rate_gamma), int(moving_rate_step), float(moving_rate_limit))
        self.consistent = bool(consistent)
        self.lock = threading.Lock() if consistent else contextlib.nullcontext()
        self.copy_lock = self.send_lock = self.lock
        self.chunk = chunk

    @classmethod
    def of(cls, options, **kwargs):
        """The rule of a job's ExchangeOptions: its moving rate, the rate's decay and floor, and the server factor
        (kwargs: consistent, chunk)."""
        return cls(options.moving_rate, server_factor=options.server_factor,
                   moving_rate_gamma=options.moving_rate_gamma, moving_rate_step=options.moving_rate_step,
                   moving_rate_limit=options.moving_rate_limit, **kwargs)

    def attach(self, server, center):
        super().attach(server, center)
        self.step, self.span = slice_floats(center.size, self.chunk)
        self.scratch = self.span

    @property
    def moving_rate(self):
        """α after the exchanges the server has applied so far."""
        return rules.decayed(self.base_moving_rate, *self.decay, 0 if self.server is None else self.server.exchanges)

    def serve(self, conn, h):
        started = time.monotonic()  # the header has just arrived
        server, center = self.server, self.center
        buf, ok, wid = conn.buf, conn.ok, conn.worker_id
        n, step = center.size, self.step
        count = server.exchanges
        alpha = rules.decayed(self.base_moving_rate, *self.decay, count)
        finite = True

        def difference(start, end):
            # Lock-free, x̃ is read while other workers add to it, as in the paper's asynchronous variant.
            nonlocal finite
            span = self.span if end == n else step  # all of x is in: the rest in as few calls as the scratch allows
            for lo in range(start, end, span):
                hi = min(lo + span, end)
                seg = buf[lo:hi]
                rules.elastic_difference(seg, center[lo:hi], alpha, out=seg)
                if finite and not rules.all_finite(seg, ok[:hi - lo]):
                    finite = False

        frames = conn.frames
        try:
            # Outside the lock: a consistent server reads x whole first (a slow sender holds up nobody); a coded
            # x always comes whole, its tag checked, and decodes to the server's picture of the worker.
            frames.prefetch_params(self.consistent)
        except C.CodecError:
            finite = False
        with self.lock:
            if finite:
                # d = α(x − x̃) slice by slice as x arrives, in its receive buffer; a frame changed on the way
                # raises here, before anything has touched the center.
                frames.receive_params(difference, step)
            if not finite:
                # Nothing has touched the center yet: refuse, keep the connection.
                server.count(wid, "refused_nonfinite")
                reason = ("worker %d sent NaN or Inf parameters at iteration %d; reset from the center"
                          % (wid, h.iteration))
                log.warning(reason)
                raise P.Declined(P.E_NONFINITE, reason)
            # Committed: counted before the reply so that a worker never sees its
            # exchange done before the server's books do.
            server.committed((wid,))
            self._reply(conn, count)
            server.record(wid, latency=time.monotonic() - started)

    def _reply(self, conn, count):
        """DIFF d to the worker and x̃ += server_factor·d, overlapped (the transport's send_difference says how)."""
        center, buf, scratch, factor = self.center, conn.buf, conn.scratch, self.server_factor

        def add(start, end):
            rules.apply_to_center(center[start:end], buf[start:end], factor, scratch[:end - start])

        conn.frames.send_difference(count, self.server.history.reply_flags(conn.worker_id), self.span, add)


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

    A round that cannot complete (a worker left, or round_timeout passed) is failed for
    every worker in it, with the reason. Every (re)joining worker restarts at the last
    completed round, so that they agree.
    """

    frame = P.AVERAGE
    kind = "a synchronous"

    def __init__(self, workers, *, round_timeout=None):
        if int(workers) < 1:
            raise ValueError("a synchronous round needs at least one worker, got %r" % (workers,))
        self.workers = int(workers)
        self.round_timeout = round_timeout
        self._cond = threading.Condition()
        self.copy_lock = self._cond  # never half-way through writing a round's mean
        self._round = _Round()
        self._rounds = 0
        self._round_iteration = None  # the iteration of the last completed round
        self._gone = set()  # workers that left and have not rejoined: no round can complete without them

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
        with self._cond:
            self._gone.discard(worker_id)
            rnd = self._round
            if worker_id in rnd.params and not rnd.done and not rnd.failure:
                rnd.failure = ("worker %d rejoined while the round of iteration %d held its previous connection's "
                               "parameters; the round starts again" % (worker_id, rnd.iteration))
                self._round = _Round()
                self._cond.notify_all()
            return self._round_iteration

    def serve(self, conn, h):
        """Add x to the round of its iteration; once all N are in, every worker gets their mean."""
        wid = conn.worker_id
        try:
            conn.frames.receive_params()  # the worker's x as the server sees it
            finite = rules.all_finite(conn.buf)
        except C.CodecError:
            finite = False
        if not finite:
            # A round cannot go on without this worker's parameters: it fails for everyone.
            raise P.Refusal(P.E_NONFINITE, "worker %d sent NaN or Inf parameters at iteration %d; "
                            "the synchronous round cannot complete" % (wid, h.iteration))
        with self._cond:
            rnd = self._round
            if rnd.params and h.iteration != rnd.iteration:
                raise P.ProtocolError("worker %d sent iteration %d while the round of iteration %d is open"
                                      % (wid, h.iteration, rnd.iteration))
            if wid in rnd.params:
                raise P.ProtocolError("worker %d sent twice in the round of iteration %d" % (wid, h.iteration))
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
            elif not self._cond.wait_for(lambda: rnd.done or rnd.failure, self.round_timeout):
                # A worker that left may be rejoining (Spark retries a barrier stage as a whole),
                # so its absence only fails the round at the timeout, but the message names it.
                gone = ("; worker %s left after the round of iteration %d and has not rejoined"
                        % (", ".join(map(str, sorted(self._gone))), self._round_iteration)) if self._gone else ""
                rnd.failure = ("round of iteration %d: %d of %d workers (%s) arrived within %gs%s"
                               % (rnd.iteration, len(rnd.params), self.workers,
                                  ", ".join(map(str, sorted(rnd.params))), self.round_timeout, gone))
                self._round = _Round()
                self._cond.notify_all()
            if rnd.failure:
                raise P.Refusal(P.E_TIMEOUT, rnd.failure)
            # The center changes again only when a round completes, which needs this
            # worker's next frame: sending it outside the lock is safe (and so is a PULL's).
        conn.frames.send_mean(self.center, h.iteration, self.server.history.reply_flags(wid))

    def left(self, worker_id):
        """An open round it is in, or that waits for it, can never complete (the server calls this for a
        worker's current connection only)."""
        with self._cond:
            self._gone.add(worker_id)
            rnd = self._round
            if rnd.params and not rnd.done and not rnd.failure:
                rnd.failure = ("worker %d left during the round of iteration %d (%d of %d workers had arrived)"
                               % (worker_id, rnd.iteration, len(rnd.params) - (worker_id in rnd.params),
                                  self.workers))
                self._round = _Round()
                self._cond.notify_all()
