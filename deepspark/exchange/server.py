"""ExchangeServer: holds the center x̃ and serves every worker's connection (handshake, frames, bookkeeping) for one handler."""

import logging
import math
import socket
import threading
import time

import numpy as np

from deepspark import rules
from deepspark.exchange import handshake
from deepspark.exchange import protocol as P
from deepspark.exchange.history import HistoryHandler
from deepspark.exchange.options import ExchangeOptions
from deepspark.exchange.transport import Connection, PeerClosed, tune

log = logging.getLogger("deepspark.exchange.server")


class ExchangeServer:
    """The parameter exchanger's server side: one thread per worker connection, one handler for what they exchange.

    center        initial x̃ (copied into one float32 vector)
    secret        the per-job secret (str or bytes) both sides prove they hold
    handler       the application, a handlers.Handler: an algorithm's (algorithms/easgd.py's EasgdHandler on EXCHANGE
                  frames, algorithms/sync.py's RoundsHandler on AVERAGE frames)
    options       ExchangeOptions (default: the schema's): its timeout is the idle timeout (seconds an
                  authenticated worker may stay silent before it is dropped; set it above the longest expected
                  period: a dropped worker rejoins from x̃); integrity: tag every frame after the handshake and
                  refuse one whose tag fails (the center untouched); codec: how model frames travel, the
                  center's arithmetic staying float32 whatever it is. The workers' clients must say the same
    **changes     options' fields over `options` (tests: integrity=False, codec="int8", timeout=0.5)
    shapes        blob shapes for the model fingerprint (default: one flat blob)
    resume_iteration  the iteration a worker id never seen before starts from (a resumed job's);
                  a rejoining worker is told its own last reported iteration instead, unless
                  the handler says otherwise
    handshake_timeout  seconds a new connection has to complete the handshake
    max_handshakes  connections in their handshake at once; one more is closed as it is accepted,
                  unanswered (and noted in `refused`), so that strangers that connect and stay silent
                  hold at most this many threads, each for handshake_timeout
    history_sets  the workers' solver history is this many model-sized vectors (Caffe's SolverState
                  history: 1 for SGD, 2 for Adam); 0 keeps none. The server then holds one history
                  per worker (history.HistoryHandler) for the driver's snapshots, and hands it back
                  to a worker that asks as it joins
    histories     {worker id: (iteration, current_step, float32 vector)} to hold from the start
    """

    def __init__(self, center, secret, handler, host="127.0.0.1", port=0, *, options=None, shapes=None,
                 resume_iteration=0, handshake_timeout=10.0, max_handshakes=64, history_sets=0, histories=None,
                 **changes):
        center = np.asarray(center)
        if not np.issubdtype(center.dtype, np.floating) or center.size == 0:
            raise ValueError("center must be a non-empty float array")
        self._center = np.array(center, dtype=np.float32).ravel()  # own copy
        if not rules.all_finite(self._center):
            raise ValueError("center holds NaN or Inf")
        self._shapes = P.normalize_shapes(shapes, self._center.size)
        if P.shapes_size(self._shapes) != self._center.size:
            raise ValueError(f"shapes hold {P.shapes_size(self._shapes)} parameters, the center {self._center.size}")
        self._fingerprint = P.fingerprint(self._shapes)
        self._secret = P.as_secret(secret)
        self.resume_iteration = int(resume_iteration)
        self.options = options = (options or ExchangeOptions.of()).but(**changes)
        self.idle_timeout = options.timeout
        self.handshake_timeout = handshake_timeout
        self.max_handshakes = int(max_handshakes)
        self._handshaking = 0  # connections accepted and not yet through their handshake (under _books)
        self.integrity = options.integrity  # tag every frame after the handshake (transport.Connection.seal)
        self.codec = options.codec
        self.history = HistoryHandler(int(history_sets) * self._center.size, histories)
        self._host, self._port = host, port
        self._books = threading.Lock()  # bookkeeping only, never held during the update
        self._workers = {}
        self._exchanges = 0
        self.refused = []  # (peer, reason) of refused connections, most recent last
        self._conns = set()
        self._listener = None
        self._accept_thread = None
        self._stopping = threading.Event()
        self.handler = handler
        handler.attach(self, self._center)
        self.history.attach(self)

    # ---- public ----------------------------------------------------------

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
        """Updates applied to the center so far (all workers): elastic exchanges, or completed rounds."""
        return self._exchanges

    @property
    def open_connections(self):
        """Connections being served right now (authenticated or not)."""
        with self._books:
            return len(self._conns)

    def start(self):
        sock = socket.create_server((self._host, self._port), backlog=64)
        sock.settimeout(0.2)  # the accept loop notices stop() within this
        self._listener = sock
        self._accept_thread = threading.Thread(target=self._accept_loop, name="exchange-accept",
                                               daemon=True)
        self._accept_thread.start()
        log.info(f"exchange server on {self.address[0]}:{self.address[1]}, {self._center.size} parameters")
        return self

    def pull(self, out=None):
        """A copy of the center x̃ (for evaluation and snapshots)."""
        if out is None:
            out = np.empty_like(self._center)
        with self.handler.copy_lock:
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

    def request_histories(self):
        """Ask every worker for its solver history (HistoryHandler.request); the request's number."""
        return self.history.request()

    def histories(self, since=0):
        """{worker id: history.Held} of the workers' solver histories held now, sent in answer to request
        `since` or later (0: any)."""
        return self.history.since(since)

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

    # ---- the handler's bookkeeping ------------------------------------------

    def committed(self, worker_ids):
        """Count one update of the center made from these workers' frames (before any reply goes out)."""
        now = time.monotonic()
        with self._books:
            self._exchanges += 1
            for wid in worker_ids:
                self._workers[wid]["exchanges"] += 1
                self._workers[wid]["last_exchange"] = now

    def count(self, worker_id, key):
        """Add one to a counter of the worker's stats."""
        with self._books:
            self._workers[worker_id][key] += 1

    def record(self, worker_id, **values):
        """Set entries of the worker's stats."""
        with self._books:
            self._workers[worker_id].update(values)

    # ---- connections --------------------------------------------------------

    def _accept_loop(self):
        turning_away = False  # the last connection was closed unanswered (max_handshakes were in progress)
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            with self._books:
                full = self._handshaking >= self.max_handshakes
                if not full:
                    self._handshaking += 1
                    t = threading.Thread(target=self._serve, args=(sock, peer),
                                         name=f"exchange-{peer[0]}:{peer[1]}", daemon=True)
                    self._conns.add((sock, t))
            if full:
                reason = f"{self.max_handshakes} connections were in their handshake: closed unanswered"
                if not turning_away:  # once while full, not once a connection: a flood would flood the log
                    log.warning(f"refused {peer[0]}:{peer[1]} and any more until a handshake ends: {reason}")
                self._note_refused(f"{peer[0]}:{peer[1]}", reason)  # noted before the peer sees the close
                sock.close()
            else:
                tune(sock)
                t.start()
            turning_away = full

    def _serve(self, sock, peer):
        Session(self, Connection(sock, f"{peer[0]}:{peer[1]}")).run()

    def _handshake_over(self):
        with self._books:
            self._handshaking -= 1

    def _note_refused(self, peer, reason):
        with self._books:
            self.refused.append((peer, reason))
            del self.refused[:-100]

    def send_center(self, conn):
        """The reply to PULL: x̃ as it is, in float32 whatever the codec (the worker starts over from it)."""
        with self.handler.send_lock:
            conn.frames.send_center(self._center, self._exchanges)


class Session:
    """One accepted connection on the server's side, in its own thread: the handshake, then the worker's
    frames until it leaves (its handler's, the history's, PULL, REPORT, BYE, ERROR); a refusal gets its
    ERROR frame before the close."""

    def __init__(self, server, conn):
        self.server, self.conn = server, conn

    def run(self):
        server, conn = self.server, self.conn
        sock = conn.sock
        entry = (sock, threading.current_thread())
        handshaking = True
        try:
            sock.settimeout(server.handshake_timeout)
            self.handshake()
            server._handshake_over()
            handshaking = False
            sock.settimeout(server.idle_timeout)
            conn.allocate(server.size, server.handler.scratch, server.codec)
            self.loop()
        except (P.Refusal, P.ProtocolError) as e:
            self.refuse(e.code, str(e))
        except socket.timeout:
            wid = conn.worker_id
            phase = "handshake" if wid is None else "exchange"
            limit = server.handshake_timeout if wid is None else server.idle_timeout
            self.refuse(P.E_TIMEOUT, f"silent for more than {limit:g}s during the {phase}")
        except (PeerClosed, OSError) as e:
            if not server._stopping.is_set():
                log.info(f"worker {conn.worker_id} ({conn.peer}) disconnected: {e}")
        finally:
            sock.close()
            if handshaking:
                server._handshake_over()
            wid = conn.worker_id
            with server._books:
                server._conns.discard(entry)
                # A worker's connection that has been replaced by a newer one (its process rejoined) is not
                # the worker leaving: only the current one's end is.
                current = wid is not None and server._workers.get(wid, {}).get("peer") == conn.peer
                if current:
                    server._workers[wid]["connected"] = False
            if current:  # outside the books: a handler takes its own lock, then the books
                server.handler.left(wid)

    def refuse(self, code, reason):
        conn, wid = self.conn, self.conn.worker_id
        who = f"worker {wid} ({conn.peer})" if wid is not None else conn.peer
        log.warning(f"refused {who}: {P.ERROR_NAMES[code]}: {reason}")
        self.server._note_refused(conn.peer, reason)
        try:
            conn.sock.settimeout(1.0)
            conn.send_frame_bytes(P.encode_error(code, reason, wid or 0))
        except OSError:
            pass

    def handshake(self):
        """The handshake (handshake.authenticate), then WELCOME at the worker's start iteration and its stats
        opened; sets and returns conn.worker_id."""
        server, conn = self.server, self.conn
        wid, keys = handshake.authenticate(conn, server._secret, server._fingerprint, server._shapes,
                                           server.codec.name)
        # Asked before the books are taken: a handler may hold its own lock and then the books.
        iteration = server.handler.start_iteration(wid)
        with server._books:
            prev = server._workers.get(wid)
            if iteration is None:
                # A rejoining worker continues from its last reported iteration.
                iteration = prev["iteration"] if prev else server.resume_iteration
            handshake.welcome(conn, wid, iteration, keys if server.integrity else None)
            server._workers[wid] = joined(prev, iteration, conn.peer)
        log.info(f"worker {wid} joined from {conn.peer}")
        conn.worker_id = wid
        conn.history_bytes = 4 * server.history.floats
        return wid

    @staticmethod
    def note(me, h):
        """A verified frame's iteration and loss, for the stats."""
        me["iteration"] = h.iteration
        if math.isfinite(h.value):
            me["loss"] = h.value

    def loop(self):
        """Frames from the authenticated worker until it leaves."""
        server, conn = self.server, self.conn
        handler, history, wid = server.handler, server.history, conn.worker_id
        model_bytes = 4 * server.size
        me = server._workers[wid]
        while True:
            h = conn.read_header(model_bytes)
            if h.worker_id != wid:
                raise P.ProtocolError(f"frame from worker {h.worker_id} on worker {wid}'s connection")
            me["last_contact"] = time.monotonic()
            if h.type == handler.frame:
                conn.on_verified = lambda: Session.note(me, h)  # no cycle through this Session to conn
                try:
                    handler.serve(conn, h)  # which verifies the frame before the center moves
                except P.Declined as e:
                    conn.send_frame_bytes(P.encode_error(e.code, str(e), wid))
            elif h.type in history.frames:
                history.serve(conn, h)
            elif h.type == P.PULL:
                server.send_center(conn)
            elif h.type == P.REPORT:  # verified with its header (it has no payload)
                Session.note(me, h)
            elif h.type == P.BYE:
                log.info(f"worker {wid} left")
                return
            elif h.type == P.ERROR:
                reason = P.decode_error(conn.read_small(h.length))
                log.warning(f"worker {wid} sent an error: {reason}")
                me["error"] = (h.flags, reason)  # for the driver's watch: a diverged worker stops the job
                return
            elif h.type in (P.EXCHANGE, P.AVERAGE):
                raise P.ProtocolError(f"{P.TYPE_NAMES[h.type]} from worker {wid}, but this is {handler.kind} server")
            else:
                raise P.ProtocolError(f"unexpected {P.TYPE_NAMES[h.type]} from worker {wid}")

def joined(prev, iteration, peer):
    """A worker's stats as its connection from `peer` joins at `iteration`, carried over from its previous
    connection's (`prev`, or None)."""
    return {
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
        "peer": peer,
        "history_iteration": prev["history_iteration"] if prev else None,  # of the last it sent
        "restored_history": None,  # the iteration of the history handed to this connection
    }
