"""What an application of the exchange server is (Handler): the algorithms' handlers (deepspark.algorithms) serve one model frame type each, on decoded float32 arrays, with the job's ledger of record blocks where its workers steal them; and the iterations a job's workers train, counted together (Leases)."""

import contextlib
import threading
import time


class Handler:
    """What an application adds to ExchangeServer's one loop; the server calls it from each worker's connection thread.

    frame      the model frame type it serves (the other one is refused)
    kind       what that makes the server, for the refusal ("a synchronous")
    scratch    floats of scratch space each connection needs (Connection.allocate)
    copy_lock  held while ExchangeServer.pull() copies the center
    send_lock  held while the reply to a PULL frame sends the center
    ledger     the job's ledger.Ledger of record blocks, which the server answers CLAIM frames from (work
               stealing); None: each worker reads its own shard
    """

    frame = None
    kind = None
    scratch = 0
    ledger = None
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

    def lease(self, worker_id, iteration):
        """The iteration worker `worker_id`, at `iteration`, may train to, for a reply (F_LEASE); None: the job
        leases none (each worker trains to its own stop)."""
        return None

    def release(self, worker_id, iteration):
        """Worker `worker_id` has left the job for good at `iteration` (its last reported): what the handler holds
        for it past there goes to the others (EASGD's leases); it may join again later."""

    def job_iteration(self, iterations):
        """The job's iteration, as the driver's cadence counts it, from each worker's last reported one
        ({worker id: iteration}): the slowest's, where the workers train in step or each to its own stop."""
        return min(iterations.values(), default=0)

    def left(self, worker_id):
        """An authenticated worker's connection has ended."""


# A worker that trained less than this share of its iterations is named in the end's line as one the others helped.
STRAGGLER_SHARE = 0.9


class Leases:
    """The iterations a job's workers train, counted together: the solver's max_iter is the job's total divided by
    its workers, so the job ends once the workers' iterations sum to workers × (stop − start), whoever trained
    them; each worker counts its own.

    workers    the job's workers (a worker that never trains leaves its share to the others)
    stop       the iteration the job stops at (schedule.stop_iteration); start: the one it starts at (a resume's)
    lookahead  iterations a worker is leased past the one it reports, at each reply: enough to train on until
               its next reply is in (2 periods, overlapped), few enough that a straggler holds little of the job
               when the rest is spent; None: all that is left (one worker: today's fixed count)
    cap        the most iterations a worker's own count may reach (poly's learning rate is 0 at max_iter); None

    A lease only grows, so a worker never trains past one it was told; the leases sum to the total at most,
    and each worker asks again (its next exchange) when it reaches its own: the job ends when none is left.
    The share (stop − start) of each worker that has not joined yet is kept for it, so that a short job is not
    trained whole by the first to come while the others' tasks are still starting; a worker released before it
    ever joined gives its share to the others.
    """

    def __init__(self, workers, stop, start=0, lookahead=None, cap=None):
        self.workers, self.stop, self.start = int(workers), int(stop), int(start)
        self.total = self.workers * max(self.stop - self.start, 0)
        self.lookahead, self.cap = lookahead, cap
        self._lock = threading.Lock()
        self._leased = {}  # worker id -> the iteration it may train to
        self._base = {}    # worker id -> the iteration it started counting at
        self._seen = {}    # worker id -> (first (monotonic, iteration), last (monotonic, iteration)) it reported
        self._released = {}  # worker id -> the iteration it was released at (gone for good)
        self._absent = set()  # workers released before they ever joined: their shares are the others'

    def _granted(self):
        return sum(self._leased[w] - self._base[w] for w in self._leased)

    def grant(self, worker, iteration):
        """The lease of `worker`, at `iteration`, for its reply: its last one, grown to iteration + lookahead (all
        that is left, without one) as far as the total allows."""
        with self._lock:
            if worker not in self._leased:
                self._base[worker] = self._leased[worker] = int(iteration)
            self._released.pop(worker, None)  # back after it left: it leases again
            now = time.monotonic()
            first, _ = self._seen.get(worker, ((now, int(iteration)), None))
            self._seen[worker] = (first, (now, int(iteration)))  # for its rate
            lease = self._leased[worker]
            waiting = self.workers - len(self._leased.keys() | self._absent)  # not joined yet: their shares kept
            left = max(0, self.total - self._granted() - waiting * (self.stop - self.start))
            want = lease + left if self.lookahead is None else int(iteration) + self.lookahead
            if self.cap is not None:
                want = min(want, self.cap)
            self._leased[worker] = max(lease, min(want, lease + left))
            return self._leased[worker]

    def release(self, worker, iteration):
        """`worker` is gone for good at `iteration` (its last reported): what it was leased past that goes back
        to the others."""
        with self._lock:
            if worker in self._leased:
                self._leased[worker] = max(self._base[worker], min(self._leased[worker], int(iteration)))
                self._released[worker] = self._leased[worker]
            else:
                self._absent.add(worker)

    def trained(self, iterations):
        """The iterations trained together, from each worker's last reported one ({worker id: iteration})."""
        with self._lock:
            return sum(max(0, min(it, self._leased.get(w, it)) - self._base.get(w, it)) for w, it in iterations.items())

    def iteration(self, iterations):
        """The job's iteration: start + the iterations trained together / workers (stop once all are trained)."""
        return self.start + self.trained(iterations) // max(self.workers, 1)

    def line(self, iterations):
        """The end's line: each worker's iterations and rate, and the total against the job's."""
        with self._lock:
            done = {w: max(0, it - self._base.get(w, it)) for w, it in sorted(iterations.items())}
            rates = {w: rate(*self._seen[w]) if w in self._seen else 0.0 for w in done}
        share = self.total / max(self.workers, 1)
        parts = []
        for w, n in done.items():
            # Within a tenth of its share is two workers' ordinary spread (a demo's 9,780 and 10,220), not a straggler.
            fewer = ("" if n >= STRAGGLER_SHARE * share else
                     f", fewer than its share of {share:g}: the others took the rest")
            gone = f", released at iteration {self._released[w]}" if w in self._released else ""
            parts.append(f"worker {w} {n} at {rates[w]:.1f} it/s{fewer}{gone}")
        return (f"Iterations trained together: {sum(done.values())} of {self.total} "
                f"({self.workers} worker{'s' * (self.workers != 1)} x {self.stop - self.start}): " + "; ".join(parts))


def rate(first, last):
    """Iterations per second between two (monotonic, iteration) reports."""
    (t0, i0), (t1, i1) = first, last
    return (i1 - i0) / (t1 - t0) if t1 > t0 else 0.0
