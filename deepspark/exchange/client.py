"""ExchangeClient: a worker's persistent connection to the exchange server (Link: connect, one round trip, rejoin), blocking or overlapped with computation, or in synchronous rounds."""

import contextlib
import logging
import math
import socket
import threading
import time

import numpy as np

from deepspark import rules
from deepspark.exchange import handshake
from deepspark.exchange import protocol as P
from deepspark.exchange.options import ExchangeOptions
from deepspark.exchange.transport import Connection, apply_floats, tune

log = logging.getLogger("deepspark.exchange.client")

APPLIED = "applied"  # the elastic difference was applied
RESET = "reset"      # parameters were replaced by the center (non-finite refusal or rejoin)
# Refusals that only mean "this connection is over": the worker rejoins (a frame changed on the way,
# by a bad network or someone on it, ends that connection; a new one is authenticated again).
_CONNECTION_LOST = (P.E_TIMEOUT, P.E_SHUTDOWN, P.E_INTEGRITY)


class NonFiniteError(P.RefusedError):
    """The server refused parameters holding NaN or Inf."""


class Link:
    """A worker's one connection to the exchange server, kept across reconnects: connect and authenticate
    with retries, a model frame's round trip, and a rejoin from the center when the connection is lost.

    address      (host, port) of the ExchangeServer, or "host:port"
    secret       the per-job secret
    worker_id    this worker's id (uint32)
    options      ExchangeOptions (default: the schema's), as the server's: its timeout is the seconds to wait
                 on the server before treating the connection as lost; integrity: tagged frames after the
                 handshake (a reply that fails its tag ends the connection; the worker rejoins and resets
                 from the center); codec: how model frames travel (codec.CODECS: float32, float16, bfloat16,
                 int8, int4), a PULL's center always coming whole, in float32
    **changes    options' fields over `options` (tests: integrity=False, timeout=0.5)
    shapes       blob shapes for the model fingerprint (default: one flat blob of the params' size)
    connect_timeout  seconds one connection attempt may take
    retries      connection attempts (with exponential back-off from `backoff` to `max_backoff`)
    on_nonfinite "reset": replace the parameters with the center; "raise": NonFiniteError
    history_sets as the server's: the worker's solver history is this many model-sized vectors
                 (send_history, pull_history); 0 exchanges none
    chunk        floats per slice of x −= d as d arrives (default: transport.apply_floats)
    """

    def __init__(self, address, secret, worker_id, *, options=None, shapes=None, connect_timeout=10.0, retries=8,
                 backoff=0.05, max_backoff=2.0, on_nonfinite="reset", chunk=None, history_sets=0, **changes):
        if on_nonfinite not in ("reset", "raise"):
            raise ValueError("on_nonfinite must be 'reset' or 'raise'")
        if isinstance(address, str):
            host, _, port = address.rpartition(":")
            address = (host, port)
        self.address = (address[0], int(address[1]))
        self._secret = P.as_secret(secret)
        self.worker_id = int(worker_id)
        if not 0 <= self.worker_id < 2 ** 32:
            raise ValueError("worker_id must fit in 32 bits")
        self._shapes = None if shapes is None else P.normalize_shapes(shapes)
        self.options = options = (options or ExchangeOptions.of()).but(**changes)
        self.timeout, self.connect_timeout = options.timeout, connect_timeout
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.on_nonfinite = on_nonfinite
        self._chunk = chunk
        self.integrity = options.integrity  # as the server's: tag every frame after the handshake
        self.history_sets = int(history_sets)
        self.codec = options.codec
        # The server asked for this worker's solver history (a reply's F_SEND_HISTORY): send_history it
        # once no exchange is in flight. Set by the thread that read the reply, before the result is handed over.
        self.history_wanted = False
        # The iteration this worker may train to, as the server's replies lease it (F_LEASE): None while it has
        # leased none (the worker trains to its own stop). Set by the thread that read the reply; it only grows.
        self.lease = None
        self._conn = None  # made at the first connect; its buffer is also the overlapped snapshot
        self._closed = False
        # Held for a request and its reply by a thread other than the one that trains (the overlapped exchange's)
        # and by a claim, which the training thread's feeder makes while an exchange may be in flight.
        self._wire = threading.RLock()
        self.exchanges = self.resets = self.reconnects = 0
        self.connections = 0  # connections authenticated so far: a claim's blocks are void past a new one
        self.resume_iteration = 0  # the iteration the server last heard from this worker id

    @property
    def where(self):
        """The server's host:port, as messages name it."""
        return f"{self.address[0]}:{self.address[1]}"

    @property
    def size(self):
        return None if self._conn is None else self._conn.buf.size

    @property
    def sent_bytes(self):
        """Bytes this worker has sent the exchanger: frames with their headers and tags, not the handshakes."""
        return 0 if self._conn is None else self._conn.sent_bytes

    @property
    def received_bytes(self):
        """Bytes this worker has had from the exchanger, counted as sent_bytes."""
        return 0 if self._conn is None else self._conn.received_bytes

    @property
    def _sock(self):
        return None if self._conn is None else self._conn.sock

    def connect(self, size=None):
        """Connect and authenticate (with retries); `size` or shapes fix the parameter count."""
        if self._conn is None:
            if self._shapes is None:
                if size is None:
                    raise ValueError("the first connect needs the parameter count (or pass shapes=)")
                self._shapes = P.normalize_shapes(None, size)
            n = P.shapes_size(self._shapes)
            if size is not None and size != n:
                raise ValueError(f"params hold {size} values, shapes {n}")
            self._fingerprint = P.fingerprint(self._shapes)
            self._apply_step = apply_floats(n, self._chunk)
            self._conn = Connection(None, self.where, self.worker_id).allocate(n, codec=self.codec)
            self._conn.history_bytes = 4 * self.history_sets * n
        delay = self.backoff
        for attempt in range(1, self.retries + 1):
            try:
                self._open()
                return self
            except P.RefusedError:
                raise  # wrong secret or model: retrying cannot help
            except OSError as e:
                self._drop()
                if attempt == self.retries or self._closed:
                    raise ConnectionError(f"could not reach the exchange server at {self.where} after {attempt} "
                                          f"attempts: {e}") from e
                log.info(f"worker {self.worker_id}: connecting to {self.where} failed ({e}); retrying in {delay:.2f}s")
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff)

    def _open(self):
        conn = self._conn
        conn.sock = socket.create_connection(self.address, timeout=self.connect_timeout)
        tune(conn.sock)
        bound = bytes([P.CODEC_IDS[self.codec.name]]) + self._fingerprint  # the codec, then the model
        self.resume_iteration = handshake.join(
            conn, self._secret, self.worker_id, bound, self.integrity, self.where)
        conn.frames.restart()  # as the server's new connection starts it
        conn.sock.settimeout(self.timeout)
        self.connections += 1

    def _request(self, type_, params=None, iteration=0, value=math.nan, reply=None):
        """Send a frame (with the parameters `params`, in the job's codec) and read the header of its reply,
        which must be a `reply` frame; an ERROR frame becomes RefusedError (NonFiniteError for non-finite
        parameters)."""
        if params is None:
            self._conn.send(type_, None, iteration, value)
        else:
            self._conn.frames.send_params(type_, params, iteration, value)
        h = self._conn.read_header(len(self._conn.view))
        error = handshake.refused(self._conn, h)
        if error is not None:
            raise NonFiniteError(error.code, error.reason) if error.code == P.E_NONFINITE else error
        if h.type != reply:
            raise P.ProtocolError(f"expected {P.TYPE_NAMES[reply]}, got {P.TYPE_NAMES[h.type]}")
        return h

    def _drop(self):
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.close()
            finally:
                conn.sock = None

    def _ensure(self, size):
        if self._conn is not None and size != self._conn.buf.size:
            raise ValueError(f"params hold {size} values, this client exchanges {self._conn.buf.size}")
        if self._sock is None:
            self.connect(size)

    def _round_trip(self, send_from, apply_to, iteration, loss):
        """Send x from `send_from`; apply d to `apply_to`, or leave d in the buffer when None.

        Returns APPLIED or RESET. After a lost connection the worker rejoins and resumes
        from x̃ (written where d would have been applied), rather than guessing whether
        the server applied the interrupted update.
        """
        with self._wire:  # the whole of it, a rejoin too: a claim from the training thread waits
            try:
                return self._exchange_once(send_from, apply_to, iteration, loss)
            except NonFiniteError:
                if self.on_nonfinite == "raise":
                    raise
                log.warning(f"worker {self.worker_id}: server refused non-finite parameters; resetting from the "
                            "center")
                self._pull_into(self._conn.buf if apply_to is None else apply_to)
                self.resets += 1
                return RESET
            except P.RefusedError as e:
                if e.code not in _CONNECTION_LOST:
                    raise
                return self._rejoin(apply_to, e)
            except (OSError, P.ProtocolError) as e:
                return self._rejoin(apply_to, e)

    def _rejoin(self, apply_to, cause):
        if self._closed:
            raise cause
        log.warning(f"worker {self.worker_id}: exchange connection lost ({cause}); rejoining")
        self._drop()
        self.connect()
        self.reconnects += 1
        self._pull_into(self._conn.buf if apply_to is None else apply_to)
        self.resets += 1
        return RESET

    def _exchange_once(self, send_from, apply_to, iteration, loss):
        conn = self._conn
        h = self._request(P.EXCHANGE, send_from, iteration, loss, reply=P.DIFF)
        self.history_wanted = bool(h.flags & P.F_SEND_HISTORY)
        self.lease = P.lease_of(h, self.lease)
        if apply_to is None:
            conn.frames.receive_delta()
        else:
            buf = conn.buf

            def apply(start, end):
                rules.apply_to_worker(apply_to[start:end], buf[start:end])
            # x −= d slice by slice while the rest of d is still arriving; a d that fails its check
            # (ProtocolError, or a coded one that does not decode) makes the round trip rejoin and reset x
            # from the center.
            conn.frames.receive_delta(apply, self._apply_step)
        self.exchanges += 1
        return APPLIED

    def claim(self, wanted, done, owners, records):
        """`wanted` blocks of records from the job's ledger (work stealing), having read those of tickets `done`:
        [(ticket, epoch, owner, first, count)], checked against a job of `owners` record ranges over `records`
        records; and the connection they were granted on (self.connections: a later one makes them void, the
        server having given them back as it joined). A lost connection is made again first, once."""
        payload = P.encode_claim(wanted, done)
        with self._wire:
            for attempt in (1, 2):
                try:
                    return self._claim_once(payload, wanted, owners, records)
                except P.RefusedError as e:
                    if e.code not in _CONNECTION_LOST or attempt == 2:
                        raise
                except (OSError, P.ProtocolError):
                    if attempt == 2:
                        raise
                log.warning(f"worker {self.worker_id}: exchange connection lost during a claim; connecting again")
                self._drop()
                self.reconnects += 1
                payload = P.encode_claim(wanted)  # its tickets went back with the lost connection

    def _claim_once(self, payload, wanted, owners, records):
        self._ensure(self.size)
        at = self.connections
        self._conn.send(P.CLAIM, payload)
        h = self._conn.read_header(len(self._conn.view))
        error = handshake.refused(self._conn, h)
        if error is not None:
            raise error
        if h.type != P.CLAIMED:
            raise P.ProtocolError(f"expected CLAIMED, got {P.TYPE_NAMES[h.type]}")
        return P.decode_grants(self._conn.read_small(h.length), wanted, owners, records), at

    def _pull_into(self, out):
        h = self._request(P.PULL, reply=P.CENTER)
        self.lease = P.lease_of(h, self.lease)
        self._conn.frames.receive_center(out)  # where the server's picture of this worker now starts
        return out


class ExchangeClient(Link):
    """One worker's side of the exchange (Link's arguments): elastic exchanges blocking or overlapped with the
    worker's steps, synchronous rounds, progress reports, and the worker's solver history."""

    def __init__(self, address, secret, worker_id, **options):
        super().__init__(address, secret, worker_id, **options)
        self.blocked_seconds = 0.0
        self._overlap = _Overlap()

    # ---- blocking API -----------------------------------------------------

    def exchange(self, params, iteration=0, loss=math.nan):
        """One elastic exchange, in place on `params` (flat contiguous float32).

        Returns "applied", or "reset" when `params` were replaced by the center.
        """
        params = _check_params(params)
        self.wait(params)  # an overlapped exchange still in flight first (wait counts its own blocked time)
        with self.blocking():
            self._ensure(params.size)
            return self._round_trip(params, params, iteration, loss)

    def average(self, params, iteration=0, loss=math.nan):
        """One synchronous round with a server whose handler is RoundsHandler(N), in place on `params`:
        send x for `iteration`, get back the mean of all N workers' x.

        Never rejoins: a round cannot be finished by one worker alone, so a lost
        connection, a failed round (RefusedError with the server's reason) or a
        silent server (socket.timeout after `timeout` seconds) ends the worker.
        """
        params = _check_params(params)
        with self.blocking():
            self._ensure(params.size)
            h = self._request(P.AVERAGE, params, iteration, loss, reply=P.CENTER)
            self._conn.frames.receive_model(h, params)
            self.history_wanted = bool(h.flags & P.F_SEND_HISTORY)
            self.exchanges += 1

    def pull(self, out=None):
        """A copy of the center x̃ (a rejoining worker starts from it)."""
        self._idle()
        if out is None:
            if self._conn is None and self._shapes is None:
                raise ValueError("pull before the first exchange needs out= or shapes=")
            out = np.empty(self.size if self._conn is not None else P.shapes_size(self._shapes),
                           dtype=np.float32)
        out = _check_params(out)
        self._ensure(out.size)
        try:
            return self._pull_into(out)
        except P.RefusedError as e:
            if e.code not in _CONNECTION_LOST:
                raise
        except (OSError, P.ProtocolError):
            pass
        self._drop()
        self.connect()
        self.reconnects += 1
        return self._pull_into(out)

    def report(self, iteration, loss=math.nan):
        """Tell the server the worker's iteration and loss (for the driver's progress display)."""
        if self.pending or self._sock is None:
            return  # progress is best-effort; never block training for it
        try:
            with self._wire:  # a claim from a feeder's prefetch thread may be on the wire
                self._conn.send(P.REPORT, iteration=iteration, value=loss)
        except OSError:
            self._drop()

    def _idle(self):
        if self.pending:
            raise RuntimeError("an overlapped exchange is in flight; call wait(params) first")

    # ---- the worker's solver history ---------------------------------------------

    def _check_history(self, vector):
        if 4 * vector.size != self._conn.history_bytes:
            raise ValueError(f"a solver history of {vector.size} values; this client's is "
                             f"{self._conn.history_bytes // 4}")

    def send_history(self, history, iteration, current_step=0):
        """Send the solver's history (Caffe's history blobs as one float32 vector of history_sets x the
        model's floats) for the server to hold; no reply. Best-effort like report(): on a lost connection
        the next exchange rejoins."""
        history = _check_params(history)
        self._idle()
        self._check_history(history)
        self.history_wanted = False
        if self._sock is None:
            return
        try:
            with self._wire:
                self._conn.frames.send_history(history, iteration, current_step)
        except OSError:
            self._drop()

    def pull_history(self, out):
        """The solver history the server holds for this worker (a resumed job's snapshot, or what it last
        sent) into `out`: (iteration, current_step) when it held one, else None."""
        out = _check_params(out)
        self._idle()
        self._ensure(self._conn.buf.size if self._conn is not None else None)
        self._check_history(out)
        h = self._request(P.GET_HISTORY, reply=P.HISTORY)
        if not h.length:
            return None
        self._conn.frames.receive_history(out)
        if not rules.all_finite(out):
            raise P.ProtocolError("the server sent a solver history holding NaN or Inf")
        return h.iteration, int(h.value)

    # ---- overlapped API -----------------------------------------------------

    @property
    def pending(self):
        return self._overlap.pending

    @property
    def ready(self):
        """An overlapped exchange's result has arrived: poll() will apply it without waiting."""
        return self._overlap.ready

    def exchange_async(self, params, iteration=0, loss=math.nan):
        """Start exchanging a snapshot of `params` and return at once.

        The difference comes back while the caller keeps computing; `poll(params)`
        applies it when it has arrived (taken against the snapshot sent, applied
        to the current params). A previous exchange still in flight is waited for first.
        """
        params = _check_params(params)
        with self.blocking():
            if self.pending:
                self._apply(params, self._overlap.take())
            self._ensure(params.size)
            np.copyto(self._conn.buf, params)  # the snapshot; d later arrives in the same buffer
            self._overlap.start(self._round_trip, self._conn.buf, iteration, loss, self.worker_id)

    def poll(self, params):
        """Apply the in-flight exchange's result to `params` if it has arrived; True when applied."""
        if not self.ready:
            return False
        return self.wait(params)

    def wait(self, params):
        """Block until the in-flight exchange is back and apply it; False when nothing was in flight."""
        if not self.pending:
            return False
        with self.blocking():
            self._apply(_check_params(params), self._overlap.take())
        return True

    @contextlib.contextmanager
    def blocking(self):
        """The time in this block counts as blocked on the exchange: a worker's own part of one (reading its
        parameters out for it, writing the result back), which its steps wait on as they wait on the wire."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_seconds += time.perf_counter() - t0

    def _apply(self, params, result):
        if isinstance(result, BaseException):
            raise result
        if result == APPLIED:
            rules.apply_to_worker(params, self._conn.buf)
        else:
            np.copyto(params, self._conn.buf)

    # ---- teardown -------------------------------------------------------------

    def abort(self, code, reason):
        """Leave with an ERROR frame that tells the server why (a diverged worker: E_DIVERGED), instead of BYE."""
        self._leave(P.encode_error(code, reason, self.worker_id))

    def close(self):
        self._leave(None)

    def _leave(self, error):
        if self._closed:
            return
        if self.pending:
            self._overlap.take()  # its result is not applied: the worker is leaving
        self._closed = True
        self._overlap.stop()
        if self._sock is not None:
            try:
                if error is None:
                    self._conn.send(P.BYE)
                else:
                    self._conn.send_frame_bytes(error)
            except OSError:
                pass
            self._drop()
        self._overlap.join(5.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class OverlappedExchange:
    """A worker's elastic exchanges through its whole training loop, each overlapped with its next steps (the
    client's exchange_async): start() every period, poll() after every step, finish() at the end.

    client    the worker's ExchangeClient
    read      read(out): the worker's parameters into `out` (a flat float32 vector), returned
    write     write(params): `params` back into the worker
    params    the vector they are read into
    overlap   False: every exchange blocks (start returns with it applied)

    Reading the parameters out and writing a result back count as blocked on the exchange
    (client.blocked_seconds): the worker's own part of one, which its steps wait on as they
    wait on the wire. `before` (start, finish) runs once no exchange is in flight, just before
    the next is sent: the worker's solver history goes there, never while one is in flight.
    """

    def __init__(self, client, read, write, params, overlap=True):
        self.client, self._read, self._write, self.params, self.overlap = client, read, write, params, overlap

    def _read_params(self):
        with self.client.blocking():
            self.params = self._read(self.params)

    def _write_params(self):
        with self.client.blocking():
            self._write(self.params)

    def poll(self):
        """The exchange in flight applied to the worker if its result has arrived, without waiting; True if so."""
        return self.client.ready and self.wait()

    def start(self, iteration, loss, before=None):
        """The exchange in flight applied first (waiting for it), so that the snapshot includes it; before();
        then a snapshot of the parameters sent, and back at once (overlap), or exchanged and applied."""
        client = self.client
        self._read_params()
        if client.pending:
            client.wait(self.params)
            self._write_params()
        if before is not None:
            before()
        if self.overlap:
            client.exchange_async(self.params, iteration, loss)
        else:
            client.exchange(self.params, iteration, loss)
            self._write_params()

    def wait(self):
        """The exchange in flight applied to the worker, waiting for it; False when none was in flight."""
        if not self.client.pending:
            return False
        self._read_params()
        self.client.wait(self.params)
        self._write_params()
        return True

    def finish(self, iteration, loss, before=None):
        """The exchange in flight applied, before(), then one last blocking exchange: the center gets the
        worker's final state."""
        self._read_params()
        self.client.wait(self.params)
        if before is not None:
            before()
        self.client.exchange(self.params, iteration, loss)


class _Overlap:
    """An overlapped exchange's thread: one round trip at a time from the client's buffer (the snapshot sent;
    d, or x̃ after a rejoin, comes back in its place), its result handed to the training thread. Only the
    thread holds the client, while it runs, so that a client let go frees its buffers at once."""

    def __init__(self):
        self.cond = threading.Condition()
        self.thread = None
        self.job = None          # (iteration, loss) waiting for the thread
        self.pending = False     # an exchange was started and its result not yet taken
        self.result = None       # APPLIED / RESET / an exception, set by the thread
        self.stopping = False

    @property
    def ready(self):
        return self.pending and self.result is not None

    def start(self, round_trip, buf, iteration, loss, worker_id):
        """round_trip(buf, None, iteration, loss) on the thread (started at the first call)."""
        with self.cond:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, args=(round_trip, buf), daemon=True,
                                               name=f"exchange-worker-{worker_id}")
                self.thread.start()
            self.job = (iteration, loss)
            self.pending = True
            self.result = None
            self.cond.notify_all()

    def take(self):
        """The result of the exchange in flight, once it is back."""
        with self.cond:
            while self.result is None:
                self.cond.wait()
            result, self.result, self.pending = self.result, None, False
        return result

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def join(self, timeout):
        if self.thread is not None:
            self.thread.join(timeout)

    def _run(self, round_trip, buf):
        while True:
            with self.cond:
                while self.job is None and not self.stopping:
                    self.cond.wait()
                if self.job is None:
                    return
                iteration, loss = self.job
                self.job = None
            try:
                result = round_trip(buf, None, iteration, loss)
            except BaseException as e:  # handed to the training thread
                result = e
            with self.cond:
                self.result = result
                self.cond.notify_all()

def _check_params(params):
    if not isinstance(params, np.ndarray) or params.dtype != np.float32 \
            or not params.flags.c_contiguous or not params.flags.writeable:
        raise TypeError("params must be a writable C-contiguous float32 numpy array "
                        "(the exchange works in place on it)")
    return params.reshape(-1)
