"""ExchangeServer: holds the center x̃ and serves every worker's connection (handshake, frames, bookkeeping) for one handler."""

import array
import contextvars
import fcntl
import logging
import math
import socket
import termios
import threading
import time

import numpy as np

from deepspark import rules
from deepspark.exchange import handshake
from deepspark.exchange import protocol as P
from deepspark.exchange.history import HistoryHandler
from deepspark.exchange.options import ExchangeOptions
from deepspark.exchange.transport import Connection, Deadline, PeerClosed, tune

log = logging.getLogger("deepspark.exchange.server")

# A handshake is two round trips and two HMACs, milliseconds on any network; the rest is slack for a loaded
# executor. A peer that paces its bytes (a byte every few seconds) is cut off here, not at each read's timeout.
HANDSHAKE_SECONDS = 10.0
# Connections from one address in their handshake at once: local[N]'s workers all join from one address at the
# job's start, and a few more than that absorb a rejoin beside them; a flood from one address churns within these.
PER_ADDRESS = 16
# A worker's connections that exchanged whose times its stats keep: far more than can come between two of the
# driver's looks, which each place a failure between them.
TRAINED_AT_KEPT = 16


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
    handshake_timeout  seconds a new connection has for its whole handshake (a deadline, however its bytes
                  are paced), refused with E_TIMEOUT past it
    max_handshakes  connections from strangers' addresses (none a worker has authenticated from) in their
                  handshake at once; per_address  connections from one address in their handshake at once.
                  One more closes, unanswered (and noted in `refused`), the connection it would exceed a limit
                  with that has made least progress (no whole HELLO yet before a HELLO), oldest first (Gate):
                  the newcomer always gets in, so that no number of slow or garbage connections keeps a worker
                  out, and a worker's address keeps per_address slots of its own that strangers cannot take
    history_sets  the workers' solver history is this many model-sized vectors (Caffe's SolverState
                  history: 1 for SGD, 2 for Adam); 0 keeps none. The server then holds one history
                  per worker (history.HistoryHandler) for the driver's snapshots, and hands it back
                  to a worker that asks as it joins
    histories     {worker id: (iteration, current_step, float32 vector)} to hold from the start
    """

    def __init__(self, center, secret, handler, host="127.0.0.1", port=0, *, options=None, shapes=None,
                 resume_iteration=0, handshake_timeout=HANDSHAKE_SECONDS, max_handshakes=64, per_address=PER_ADDRESS,
                 history_sets=0, histories=None, **changes):
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
        self.gate = Gate(int(max_handshakes), int(per_address))
        self._flooded = -math.inf  # when a connection in its handshake was last closed to make way
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
        # Its threads carry the run's context, so that their lines go to the run's own Log (log.current), not to
        # the newest open one where two runs share the process.
        self._accept_thread = threading.Thread(target=contextvars.copy_context().run, args=(self._accept_loop,),
                                               name="exchange-accept", daemon=True)
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
        connection started at), finished (it said BYE), loss, latency (seconds from its last EXCHANGE header to the last
        byte of the reply handed to the kernel: receiving x, the rule, sending d), seconds_since_exchange,
        seconds_since_contact, connected, connections, refused_nonfinite, peer, trained_at (when each of its last
        connections that exchanged first did: time.time())."""
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
                stats = self._workers[wid]
                stats["exchanges"] += 1
                stats["last_exchange"] = now
                if not stats["exchanged_here"]:  # this connection's first: when it trained, on Spark's clock
                    stats["exchanged_here"] = True
                    stats["trained_at"] = (*stats["trained_at"], time.time())[-TRAINED_AT_KEPT:]

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
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            try:
                self._admit(sock, peer)
            except Exception as error:  # one connection's trouble must not end the accepting: that would be a way in
                log.warning(f"could not serve {peer[0]}:{peer[1]}: {error}")
                sock.close()

    def _admit(self, sock, peer):
        """Serve a new connection in a thread of its own, past the Gate (a function of its own, so that nothing
        here keeps its buffers alive once it has ended)."""
        tune(sock)
        session = Session(self, Connection(sock, f"{peer[0]}:{peer[1]}"), peer[0])
        for old in self.gate.admit(session):
            reason = f"made way for a newer connection ({self.gate.describe(session.address)})"
            if time.monotonic() - self._flooded > 60:  # one warning per quiet spell, not one per connection
                log.warning(f"closed {old.conn.peer} in its handshake, and may close more: {reason}")
            self._flooded = time.monotonic()
            self._note_refused(old.conn.peer, reason)  # noted before the peer sees the close
            old.close_unanswered()
        t = threading.Thread(target=contextvars.copy_context().run, args=(session.run,),
                             name=f"exchange-{peer[0]}:{peer[1]}", daemon=True)
        with self._books:
            self._conns.add((sock, t))
        try:
            t.start()
        except RuntimeError:  # no thread to be had: the Gate must not keep it
            with self._books:
                self._conns.discard((sock, t))
            self.gate.done(session)
            raise

    def _note_refused(self, peer, reason):
        with self._books:
            self.refused.append((peer, reason))
            del self.refused[:-100]

    def send_center(self, conn, iteration):
        """The reply to PULL from a worker at `iteration`: x̃ as it is, in float32 whatever the codec (the worker
        starts over from it), with the worker's lease where the handler leases (F_LEASE)."""
        lease = self.handler.lease(conn.worker_id, iteration)
        with self.handler.send_lock:
            if lease is None:
                conn.frames.send_center(self._center, self._exchanges)
            else:
                conn.frames.send_center(self._center, lease, P.F_LEASE)

    def job_iteration(self, stats=None):
        """The job's iteration as the handler counts it (Handler.job_iteration) from the workers' last reported
        iterations (`stats`: a stats() taken already)."""
        stats = self.stats() if stats is None else stats
        return self.handler.job_iteration({w: s.get("iteration", 0) for w, s in stats.items()})


class Session:
    """One accepted connection on the server's side, in its own thread: the handshake, then the worker's
    frames until it leaves (its handler's, the history's, PULL, REPORT, CLAIM, BYE, ERROR); a refusal gets its
    ERROR frame before the close."""

    def __init__(self, server, conn, address=None):
        self.server, self.conn, self.address = server, conn, address
        self.hello = False    # a whole HELLO came (Gate ranks it above one still coming)
        self.evicted = False  # closed by the Gate to make way (under its lock)

    def progress(self):
        """How far the handshake has come, for the Gate: 2 a whole HELLO read, 1 one in the socket's buffer not yet
        read (a worker's is there microseconds after it connects, however long its thread takes to start), 0
        neither."""
        if self.hello:
            return 2
        waiting = array.array("i", [0])
        try:
            fcntl.ioctl(self.conn.sock.fileno(), termios.FIONREAD, waiting)
        except (OSError, ValueError):  # closed meanwhile (its descriptor -1)
            return 0
        return int(waiting[0] >= P.HEADER_SIZE + P.NONCE_SIZE)

    def close_unanswered(self):
        """End the handshake from another thread (the Gate's eviction): the session's read returns at once."""
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def run(self):
        server, conn = self.server, self.conn
        sock = self.sock = conn.sock
        entry = (sock, threading.current_thread())
        try:
            conn.sock = Deadline(sock, server.handshake_timeout)
            self.handshake()
            conn.sock = sock
            sock.settimeout(server.idle_timeout)
            conn.allocate(server.size, server.handler.scratch, server.codec)
            self.loop()
        except (P.Refusal, P.ProtocolError) as e:
            self.refuse(e.code, str(e))
        except socket.timeout:
            if conn.worker_id is None:
                self.refuse(P.E_TIMEOUT, f"handshake not done within {server.handshake_timeout:g}s (silent or slow)")
            else:
                self.refuse(P.E_TIMEOUT, f"silent for more than {server.idle_timeout:g}s during the exchange")
        except (PeerClosed, OSError) as e:
            if not server._stopping.is_set() and not self.evicted:
                log.info(f"worker {conn.worker_id} ({conn.peer}) disconnected: {e}")
        finally:
            sock.close()
            server.gate.done(self)
            wid = conn.worker_id
            with server._books:
                server._conns.discard(entry)
                # A worker's connection that has been replaced by a newer one (its process rejoined) is not
                # the worker leaving: only the current one's end is.
                current = wid is not None and server._workers.get(wid, {}).get("peer") == conn.peer
                if current:
                    server._workers[wid]["connected"] = False
                    finished = server._workers[wid]["finished"]
            if current:  # outside the books: a handler takes its own lock, then the books
                server.handler.left(wid)
                ledger = server.handler.ledger
                if ledger is not None:
                    # A worker done training (BYE) has read some of the records of the blocks it holds, which
                    # another would read again: they stay claimed. A lost worker's go back, for another to read.
                    ledger.keep(wid) if finished else ledger.give_back(wid)

    def refuse(self, code, reason):
        conn, wid = self.conn, self.conn.worker_id
        who = f"worker {wid} ({conn.peer})" if wid is not None else conn.peer
        log.warning(f"refused {who}: {P.ERROR_NAMES[code]}: {reason}")
        self.server._note_refused(conn.peer, reason)
        conn.sock = self.sock  # past the handshake's deadline too: the ERROR has its own second
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
                                           server.codec.name, on_hello=self.said_hello)
        # Asked before the books are taken: a handler may hold its own lock and then the books.
        iteration = server.handler.start_iteration(wid)
        if not server.gate.done(self, authenticated=True):  # closed to make way just now: no WELCOME
            raise PeerClosed("closed to make way for a newer connection")
        with server._books:
            prev = server._workers.get(wid)
            if iteration is None:
                # A rejoining worker continues from its last reported iteration.
                iteration = prev["iteration"] if prev else server.resume_iteration
            handshake.welcome(conn, wid, iteration, keys if server.integrity else None)
            server._workers[wid] = joined(prev, iteration, conn.peer)
        log.info(f"worker {wid} joined from {conn.peer}")
        if server.handler.ledger is not None:
            # A worker that joins again has started over (its process, or its connection and with it its claims):
            # the blocks it held unread go back, as the claims it makes from now on say.
            server.handler.ledger.give_back(wid)
        conn.worker_id = wid
        conn.history_bytes = 4 * server.history.floats
        return wid

    def said_hello(self):
        self.hello = True

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
                server.send_center(conn, me["iteration"])
            elif h.type == P.REPORT:  # verified with its header (it has no payload)
                Session.note(me, h)
            elif h.type == P.CLAIM:
                self.claim(h)
            elif h.type == P.BYE:
                log.info(f"worker {wid} left")
                me["finished"] = True  # its training done (the driver's watch tells it from a loss)
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

    def claim(self, h):
        """A CLAIM answered with the blocks the job's ledger grants (CLAIMED); an ERROR instead, the connection going
        on, where the job keeps no ledger or the claim names a ticket the worker does not hold."""
        conn, ledger = self.conn, self.server.handler.ledger
        wanted, done = P.decode_claim(conn.read_small(h.length))  # verified, and its counts checked, first
        try:
            if ledger is None:
                raise ValueError("a CLAIM, but this job's workers read their own shards (it keeps no ledger)")
            grants = ledger.claim(conn.worker_id, wanted, done)
        except ValueError as e:
            conn.send_frame_bytes(P.encode_error(P.E_PROTOCOL, str(e), conn.worker_id))
            return
        conn.send(P.CLAIMED, P.encode_grants(grants))


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
        "finished": False,  # it said BYE: done training
        "connections": (prev["connections"] if prev else 0) + 1,
        "exchanged_here": False,  # whether this connection has exchanged
        # The wall-clock time of the first exchange of each of its last connections that exchanged (the driver tells
        # by them whether a worker trained between two of its failures that one look at Spark's tasks finds).
        "trained_at": prev["trained_at"] if prev else (),
        "refused_nonfinite": prev["refused_nonfinite"] if prev else 0,
        "peer": peer,
        "history_iteration": prev["history_iteration"] if prev else None,  # of the last it sent
        "restored_history": None,  # the iteration of the history handed to this connection
    }


class Gate:
    """Who may be in a handshake: the connections from each address, and those from strangers' addresses (none a
    worker has authenticated from) together, each up to a limit. A newcomer always gets in; the connection that
    makes way is, of those the newcomer would exceed a limit with, the one with least progress (Session.progress:
    no whole HELLO before a HELLO), oldest first. A worker's rejoin takes milliseconds and so is never the oldest, and its address's
    slots are its own: a flood from elsewhere cannot touch them, one from beside it churns within them."""

    def __init__(self, strangers, per_address):
        self.strangers, self.per_address = strangers, per_address
        self.known = set()  # addresses a worker has authenticated from
        self.evictions = 0  # connections closed to make way so far
        self._open = {}     # id(session): session, in their handshake, oldest first
        self._lock = threading.Lock()

    def admit(self, session):
        """Let `session` in; the sessions that make way for it (evicted: theirs to close)."""
        with self._lock:
            mine = [s for s in self._open.values() if s.address == session.address]
            strangers = [s for s in self._open.values() if s.address not in self.known]
            if len(mine) >= self.per_address:
                crowd = mine
            elif session.address not in self.known and len(strangers) >= self.strangers:
                crowd = strangers
            else:
                crowd = []
            out = [min(crowd, key=Session.progress)] if crowd else []  # min: the first, oldest, of the least
            self.evictions += len(out)
            for s in out:
                s.evicted = True
                del self._open[id(s)]
            self._open[id(session)] = session
            return out

    def done(self, session, authenticated=False):
        """`session`'s handshake is over (its address now a worker's when `authenticated`); False if it was
        evicted first."""
        with self._lock:
            self._open.pop(id(session), None)
            if authenticated and not session.evicted:
                self.known.add(session.address)
            return not session.evicted

    def describe(self, address):
        """The limit a newcomer from `address` met, for the log."""
        if address in self.known:
            return f"{self.per_address} from {address}, a worker's address"
        return f"{self.strangers} from strangers' addresses or {self.per_address} from {address}"
