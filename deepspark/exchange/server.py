"""ExchangeServer: holds the center x̃ and applies asynchronous EASGD (or synchronous averaging rounds) for every connected worker."""

import logging
import math
import socket
import threading
import time

import numpy as np

from .. import rules
from . import protocol as P
from .transport import PeerClosed, byte_view, recv_exact, recv_header, send_frame, slice_floats, tune

log = logging.getLogger("deepspark.exchange.server")

class _Refuse(Exception):
    def __init__(self, code, reason):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Round:
    """One synchronous averaging round: the workers' parameters received so far (their receive buffers)."""

    def __init__(self):
        self.iteration = None
        self.params = {}    # worker id -> its connection's buffer, untouched while it waits
        self.done = False
        self.failure = None  # why the round can never complete


class ExchangeServer:
    """The parameter exchanger's server side: one thread per worker connection.

    center        initial x̃ (copied into one float32 vector)
    secret        the per-job secret (str or bytes) both sides prove they hold
    moving_rate   α; decays × decay_rate every decay_step exchanges, at most decay_limit times (<0: no bound)
    server_factor scales the center's share of d (x̃ += server_factor·d); decays likewise
    shapes        blob shapes for the model fingerprint (default: one flat blob)
    resume_iteration  the iteration a worker id never seen before starts from (a resumed job's);
                  a rejoining worker is told its own last reported iteration instead
    consistent    serialise updates under a lock (deterministic tests); default is lock-free
    idle_timeout  seconds an authenticated worker may stay silent before it is dropped (set it
                  above the longest expected period; a dropped worker rejoins from x̃)
    handshake_timeout  seconds a new connection has to complete the handshake
    chunk         floats per slice of the update (default: whole vector up to 16 MB, else 1 MB slices)
    sync_workers  N > 0 makes it a synchronous server (the CaffeOnSpark-style baseline): AVERAGE
                  frames of N workers for the same iteration form a round, the center becomes
                  their mean (rules.average_models, in worker-id order) and each gets it back as
                  CENTER; EXCHANGE is refused. A round that cannot complete (a worker left, or
                  round_timeout seconds passed) is failed for every worker in it, with the reason.
    round_timeout seconds a worker waits for the rest of its round (default: idle_timeout)
    """

    def __init__(self, center, secret, moving_rate, host="127.0.0.1", port=0, *,
                 shapes=None, server_factor=1.0,
                 decay_rate=1.0, decay_step=0, decay_limit=-1,
                 factor_decay_rate=1.0, factor_decay_step=0, factor_decay_limit=-1,
                 resume_iteration=0, consistent=False, idle_timeout=3600.0, handshake_timeout=10.0,
                 chunk=None, sync_workers=0, round_timeout=None):
        center = np.asarray(center)
        if not np.issubdtype(center.dtype, np.floating) or center.size == 0:
            raise ValueError("center must be a non-empty float array")
        self._center = np.array(center, dtype=np.float32).ravel()  # own copy
        if not rules.all_finite(self._center):
            raise ValueError("center holds NaN or Inf")
        self._shapes = P.normalize_shapes(shapes, self._center.size)
        if P.shapes_size(self._shapes) != self._center.size:
            raise ValueError("shapes hold %d parameters, the center %d"
                             % (P.shapes_size(self._shapes), self._center.size))
        self._fingerprint = P.fingerprint(self._shapes)
        self._secret = P.as_secret(secret)
        if not 0.0 < moving_rate <= 1.0:
            raise ValueError("moving_rate must be in (0, 1], got %r" % (moving_rate,))
        self.base_moving_rate = float(moving_rate)
        self.base_server_factor = float(server_factor)
        self.decay = (float(decay_rate), int(decay_step), int(decay_limit))
        self.factor_decay = (float(factor_decay_rate), int(factor_decay_step), int(factor_decay_limit))
        self.consistent = consistent
        self.resume_iteration = int(resume_iteration)
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self._chunk = chunk
        self._host, self._port = host, port
        self._lock = threading.Lock() if consistent else None
        self._books = threading.Lock()  # bookkeeping only, never held during the update
        self._workers = {}
        self._exchanges = 0
        self.refused = []  # (peer, reason) of refused connections, most recent last
        self._conns = set()
        self._listener = None
        self._accept_thread = None
        self._stopping = threading.Event()
        self._started = time.monotonic()
        self.sync_workers = int(sync_workers)
        self.round_timeout = idle_timeout if round_timeout is None else round_timeout
        self._round_cond = threading.Condition()
        self._round = _Round()
        self._rounds = 0  # completed synchronous rounds
        self._round_iteration = self.resume_iteration  # the iteration of the last completed round
        self._gone = set()  # workers that left and have not rejoined: no round can complete without them

    # ---- public ---------------------------------------------------------

    @property
    def address(self):
        if self._listener is None:
            raise RuntimeError("server not started")
        return self._listener.getsockname()[:2]

    @property
    def size(self):
        return self._center.size

    @property
    def exchanges(self):
        """Elastic updates applied to the center so far (all workers)."""
        return self._exchanges

    @property
    def rounds(self):
        """Synchronous averaging rounds completed so far."""
        return self._rounds

    @property
    def open_connections(self):
        """Connections being served right now (authenticated or not)."""
        with self._books:
            return len(self._conns)

    @property
    def moving_rate(self):
        return rules.decayed(self.base_moving_rate, *self.decay, self._exchanges)

    @property
    def server_factor(self):
        return rules.decayed(self.base_server_factor, *self.factor_decay, self._exchanges)

    def start(self):
        sock = socket.create_server((self._host, self._port), backlog=64)
        sock.settimeout(0.2)  # the accept loop notices stop() within this
        self._listener = sock
        self._accept_thread = threading.Thread(target=self._accept_loop, name="exchange-accept",
                                               daemon=True)
        self._accept_thread.start()
        log.info("exchange server on %s:%d, %d parameters", *self.address, self._center.size)
        return self

    def pull(self, out=None):
        """A copy of the center x̃ (for evaluation and snapshots)."""
        if out is None:
            out = np.empty_like(self._center)
        if self.sync_workers:
            with self._round_cond:  # never half-way through writing a round's mean
                np.copyto(out, self._center)
        elif self._lock is not None:
            with self._lock:
                np.copyto(out, self._center)
        else:
            np.copyto(out, self._center)
        return out

    def stats(self):
        """Per worker_id, a plain dict: exchanges, iteration, joined_at (the iteration its last
        connection started at), loss, latency (seconds from its last EXCHANGE header to the last
        byte of the reply handed to the kernel: receiving x, the rule, sending d), seconds_since_exchange,
        seconds_since_contact, connected, connections, refused_nonfinite, peer."""
        now = time.monotonic()
        with self._books:
            out = {}
            for wid, w in self._workers.items():
                d = dict(w)
                d["seconds_since_contact"] = now - d.pop("last_contact")
                last = d.pop("last_exchange")
                d["seconds_since_exchange"] = None if last is None else now - last
                out[wid] = d
            return out

    def stop(self):
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(2.0)
        with self._books:
            conns = list(self._conns)
        for sock, thread in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for sock, thread in conns:
            thread.join(2.0)

    def __enter__(self):
        if self._listener is None:
            self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- connections ----------------------------------------------------

    def _accept_loop(self):
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            tune(sock)
            t = threading.Thread(target=self._serve, args=(sock, peer),
                                 name="exchange-%s:%d" % peer[:2], daemon=True)
            with self._books:
                self._conns.add((sock, t))
            t.start()

    def _serve(self, sock, peer):
        peer_name = "%s:%d" % peer[:2]
        wid = None
        entry = (sock, threading.current_thread())
        try:
            sock.settimeout(self.handshake_timeout)
            wid = self._handshake(sock, peer_name)
            sock.settimeout(self.idle_timeout)
            self._loop(sock, wid)
        except _Refuse as e:
            self._refuse(sock, peer_name, wid, e.code, e.reason)
        except P.ProtocolError as e:
            self._refuse(sock, peer_name, wid, P.E_PROTOCOL, str(e))
        except socket.timeout:
            phase = "handshake" if wid is None else "exchange"
            limit = self.handshake_timeout if wid is None else self.idle_timeout
            self._refuse(sock, peer_name, wid, P.E_TIMEOUT,
                         "silent for more than %gs during the %s" % (limit, phase))
        except (PeerClosed, OSError) as e:
            if not self._stopping.is_set():
                log.info("worker %s (%s) disconnected: %s", wid, peer_name, e)
        finally:
            sock.close()
            if self.sync_workers and wid is not None:
                self._fail_round(wid)
            with self._books:
                self._conns.discard(entry)
                if wid is not None and self._workers.get(wid, {}).get("peer") == peer_name:
                    self._workers[wid]["connected"] = False

    def _refuse(self, sock, peer_name, wid, code, reason):
        who = "worker %d (%s)" % (wid, peer_name) if wid is not None else peer_name
        log.warning("refused %s: %s: %s", who, P.ERROR_NAMES[code], reason)
        with self._books:
            self.refused.append((peer_name, reason))
            del self.refused[:-100]
        try:
            sock.settimeout(1.0)
            sock.sendall(P.encode_error(code, reason, wid or 0))
        except OSError:
            pass

    def _handshake(self, sock, peer_name):
        hview = memoryview(bytearray(P.HEADER_SIZE))
        small = memoryview(bytearray(P.MAX_SMALL_PAYLOAD))
        h = recv_header(sock, hview, None)
        if h.type != P.HELLO:
            raise P.ProtocolError("expected HELLO, got %s" % P.TYPE_NAMES[h.type])
        wid = h.worker_id
        recv_exact(sock, small[:h.length])
        client_nonce = bytes(small[:h.length])
        server_nonce = P.new_nonce()
        proof = P.server_proof(self._secret, client_nonce, server_nonce, wid)
        send_frame(sock, P.encode_header(P.CHALLENGE, wid, length=len(server_nonce) + len(proof)),
                   server_nonce + proof)
        h = recv_header(sock, hview, None)
        if h.type != P.AUTH or h.worker_id != wid:
            raise P.ProtocolError("expected AUTH from worker %d, got %s from worker %d"
                                  % (wid, P.TYPE_NAMES[h.type], h.worker_id))
        recv_exact(sock, small[:h.length])
        their_proof = bytes(small[:P.PROOF_SIZE])
        their_fp = bytes(small[P.PROOF_SIZE:h.length])
        if not P.proofs_match(their_proof, P.client_proof(self._secret, client_nonce,
                                                          server_nonce, wid, their_fp)):
            raise _Refuse(P.E_AUTH, "authentication failed: worker %d does not hold this job's secret" % wid)
        if their_fp != self._fingerprint:
            mine = P.describe_shapes(P.shapes_size(self._shapes), self._shapes)
            try:
                theirs = P.describe_shapes(*P.parse_fingerprint(their_fp))
            except P.ProtocolError as e:
                theirs = "a malformed fingerprint (%s)" % e
            raise _Refuse(P.E_FINGERPRINT, "model mismatch: the server holds %s, worker %d was built with %s"
                          % (mine, wid, theirs))
        if self.sync_workers:
            # Every worker of a synchronous job restarts from the last completed round, so
            # that they agree. (Taken before _books: _average holds the two the other way round.)
            with self._round_cond:
                self._gone.discard(wid)
                round_iteration = self._round_iteration
        with self._books:
            prev = self._workers.get(wid)
            # A rejoining worker continues from its last reported iteration.
            if self.sync_workers:
                iteration = round_iteration
            else:
                iteration = prev["iteration"] if prev else self.resume_iteration
            send_frame(sock, P.encode_header(P.WELCOME, wid, iteration=iteration))
            self._workers[wid] = {
                "exchanges": prev["exchanges"] if prev else 0,
                "iteration": iteration,
                "joined_at": iteration,
                "latency": prev["latency"] if prev else None,
                "loss": prev["loss"] if prev else math.nan,
                "last_contact": time.monotonic(),
                "last_exchange": prev["last_exchange"] if prev else None,
                "connected": True,
                "connections": (prev["connections"] if prev else 0) + 1,
                "refused_nonfinite": prev["refused_nonfinite"] if prev else 0,
                "peer": peer_name,
            }
        log.info("worker %d joined from %s", wid, peer_name)
        return wid

    def _loop(self, sock, wid):
        n = self._center.size
        model_bytes = 4 * n
        buf = np.empty(n, dtype=np.float32)  # receives x, becomes d in place, is sent back
        view = byte_view(buf)
        step, chunk = slice_floats(n, self._chunk)
        ok = np.empty(chunk, dtype=bool)
        scratch = np.empty(chunk, dtype=np.float32)
        hview = memoryview(bytearray(P.HEADER_SIZE))
        out_header = bytearray(P.HEADER_SIZE)
        small = memoryview(bytearray(P.MAX_ERROR_BYTES))
        me = self._workers[wid]
        while True:
            h = recv_header(sock, hview, model_bytes)
            if h.worker_id != wid:
                raise P.ProtocolError("frame from worker %d on worker %d's connection" % (h.worker_id, wid))
            me["last_contact"] = time.monotonic()
            if h.type in (P.EXCHANGE, P.AVERAGE, P.REPORT):
                me["iteration"] = h.iteration
                if math.isfinite(h.value):
                    me["loss"] = h.value
            if h.type == P.EXCHANGE and not self.sync_workers:
                self._exchange(sock, wid, h, buf, view, step, chunk, ok, scratch, out_header)
            elif h.type == P.AVERAGE and self.sync_workers:
                self._average(sock, wid, h, buf, view, out_header)
            elif h.type == P.PULL:
                P.pack_header_into(out_header, P.CENTER, wid, iteration=self._exchanges, length=model_bytes)
                if self._lock is not None:
                    with self._lock:
                        send_frame(sock, out_header, byte_view(self._center))
                else:
                    send_frame(sock, out_header, byte_view(self._center))
            elif h.type == P.REPORT:
                pass
            elif h.type == P.BYE:
                log.info("worker %d left", wid)
                return
            elif h.type == P.ERROR:
                recv_exact(sock, small[:h.length])
                log.warning("worker %d sent an error: %s", wid, P.decode_error(small[:h.length]))
                return
            elif h.type in (P.EXCHANGE, P.AVERAGE):
                mode = "a synchronous" if self.sync_workers else "an asynchronous EASGD"
                raise P.ProtocolError("%s from worker %d, but this is %s server"
                                      % (P.TYPE_NAMES[h.type], wid, mode))
            else:
                raise P.ProtocolError("unexpected %s from worker %d" % (P.TYPE_NAMES[h.type], wid))

    # ---- synchronous rounds ------------------------------------------------

    def _average(self, sock, wid, h, buf, view, out_header):
        """Add x to the round of its iteration; once all N are in, every worker gets their mean."""
        recv_exact(sock, view)
        if not rules.all_finite(buf):
            # A round cannot go on without this worker's parameters: it fails for everyone.
            raise _Refuse(P.E_NONFINITE, "worker %d sent NaN or Inf parameters at iteration %d; "
                          "the synchronous round cannot complete" % (wid, h.iteration))
        with self._round_cond:
            rnd = self._round
            if rnd.params and h.iteration != rnd.iteration:
                raise P.ProtocolError("worker %d sent iteration %d while the round of iteration %d is open"
                                      % (wid, h.iteration, rnd.iteration))
            if wid in rnd.params:
                raise P.ProtocolError("worker %d sent twice in the round of iteration %d" % (wid, h.iteration))
            rnd.iteration = h.iteration
            rnd.params[wid] = buf
            if len(rnd.params) == self.sync_workers:
                rules.average_models([rnd.params[w] for w in sorted(rnd.params)], out=self._center)
                rnd.done = True
                self._round = _Round()
                self._rounds += 1
                self._round_iteration = h.iteration
                with self._books:
                    self._exchanges += 1
                    for w in rnd.params:
                        self._workers[w]["exchanges"] += 1
                        self._workers[w]["last_exchange"] = time.monotonic()
                self._round_cond.notify_all()
            elif not self._round_cond.wait_for(lambda: rnd.done or rnd.failure, self.round_timeout):
                # A worker that left may be rejoining (Spark retries a barrier stage as a whole),
                # so its absence only fails the round at the timeout, but the message names it.
                gone = ("; worker %s left after the round of iteration %d and has not rejoined"
                        % (", ".join(map(str, sorted(self._gone))), self._round_iteration)) if self._gone else ""
                rnd.failure = ("round of iteration %d: %d of %d workers (%s) arrived within %gs%s"
                               % (rnd.iteration, len(rnd.params), self.sync_workers,
                                  ", ".join(map(str, sorted(rnd.params))), self.round_timeout, gone))
                self._round = _Round()
                self._round_cond.notify_all()
            if rnd.failure:
                raise _Refuse(P.E_TIMEOUT, rnd.failure)
            # The center changes again only when a round completes, which needs this
            # worker's next frame: sending it outside the lock is safe.
        P.pack_header_into(out_header, P.CENTER, wid, iteration=h.iteration, length=view.nbytes)
        send_frame(sock, out_header, byte_view(self._center))

    def _fail_round(self, wid):
        """Worker `wid` left: an open round it is in, or that waits for it, can never complete."""
        with self._round_cond:
            self._gone.add(wid)
            rnd = self._round
            if rnd.params and not rnd.done and not rnd.failure:
                rnd.failure = ("worker %d left during the round of iteration %d (%d of %d workers had arrived)"
                               % (wid, rnd.iteration, len(rnd.params) - (wid in rnd.params), self.sync_workers))
                self._round = _Round()
                self._round_cond.notify_all()

    def _exchange(self, sock, wid, h, buf, view, step, chunk, ok, scratch, out_header):
        started = time.monotonic()  # the header has just arrived
        center = self._center
        n = center.size
        nbytes = 4 * n
        count = self._exchanges
        alpha = rules.decayed(self.base_moving_rate, *self.decay, count)
        factor = rules.decayed(self.base_server_factor, *self.factor_decay, count)
        lock = self._lock
        finite = True
        if lock is not None:
            recv_exact(sock, view)
            lock.acquire()
        try:
            # d = α(x − x̃) slice by slice as the bytes arrive (lock-free: x̃ is read
            # while other workers add to it, as in the paper's asynchronous variant).
            done = 0
            got = nbytes if lock is not None else 0
            while done < n:
                if got < nbytes:
                    k = sock.recv_into(view[got:])
                    if not k:
                        raise PeerClosed("worker %d closed the connection after %d of %d payload bytes"
                                         % (wid, got, nbytes))
                    got += k
                ready = got >> 2
                if got < nbytes:
                    ready -= ready % step  # whole slices only, fewer numpy calls
                    span = step
                else:
                    span = chunk  # all of x is in: the rest in as few calls as the scratch allows
                while done < ready:
                    end = min(done + span, ready)
                    seg = buf[done:end]
                    rules.elastic_difference(seg, center[done:end], alpha, out=seg)
                    if finite and not rules.all_finite(seg, ok[:end - done]):
                        finite = False
                    done = end
            if not finite:
                # Nothing has touched the center yet: refuse, keep the connection.
                with self._books:
                    self._workers[wid]["refused_nonfinite"] += 1
                reason = "worker %d sent NaN or Inf parameters at iteration %d; reset from the center" % (wid, h.iteration)
                log.warning(reason)
                sock.sendall(P.encode_error(P.E_NONFINITE, reason, wid))
                return
            # Committed: counted before the reply so that a worker never sees its
            # exchange done before the server's books do.
            with self._books:
                self._exchanges += 1
                self._workers[wid]["exchanges"] += 1
                self._workers[wid]["last_exchange"] = time.monotonic()
            P.pack_header_into(out_header, P.DIFF, wid, iteration=count, length=nbytes)
            if chunk >= n:
                # Reply first, then add d to x̃: the add overlaps the worker's own
                # x −= d. This worker's next frame is read only after the add.
                send_frame(sock, out_header, view)
                rules.apply_to_center(center, buf, factor, scratch)
            else:
                # Big models: add and send slice by slice so the worker applies while we add.
                for start in range(0, n, chunk):
                    end = min(start + chunk, n)
                    rules.apply_to_center(center[start:end], buf[start:end], factor, scratch[:end - start])
                    if start == 0:
                        send_frame(sock, out_header, view[:4 * end])
                    else:
                        sock.sendall(view[4 * start:4 * end])
            with self._books:
                self._workers[wid]["latency"] = time.monotonic() - started
        finally:
            if lock is not None:
                lock.release()
