"""The exchange's transport, shared by the server and the client: per-connection buffers, exact reads, receive-while-applying, scatter sends, the seal, and model frames in the job's codec (the application sees float32 arrays)."""

import math
import mmap
import socket
import time
import weakref

import numpy as np

from deepspark.exchange import codec as C
from deepspark.exchange import protocol


# Slices of the elastic update (bench/exchange.py measures them; docs/architecture.md has the figures).
# While x arrives, the server computes d = α(x − x̃) in RECV_SLICE pieces, so its arithmetic overlaps the
# worker's send; once all of x is in, the rest goes in one piece, because slicing what is already there
# only adds numpy calls. Big models keep SLICE_FLOATS pieces, fewer calls for the same overlap.
# Below PIPELINE_BYTES the reply goes back whole: each extra send costs the worker a wake-up. Above it the
# server adds d to x̃ and sends it SLICE_FLOATS at a time, so the worker applies while the server adds.
# The worker's x −= d runs in APPLY_SLICE pieces as d arrives at every size (one numpy call for all the
# whole slices a read brings). A sealed model frame goes SEAL_SLICE bytes at a time, each hashed after it went, so
# that the receiver's hashing of one slice overlaps the sender's of the next (its tag after the last).
RECV_SLICE = 1 << 16
SLICE_FLOATS = 1 << 18
PIPELINE_BYTES = 16 << 20
APPLY_SLICE = 1 << 17
SEAL_SLICE = 1 << 18
# Payload bytes past which a worker's model frame has its tag sent after it (a small frame goes in one syscall).
TAG_AFTER = 1 << 16


def slice_floats(n, chunk=None):
    """The server's (floats per slice as x arrives, floats per slice once it is all in and of the reply) for an n-float model.

    `chunk` overrides both, so that small-chunk tests cover every slicing path.
    """
    if chunk:
        c = _clamp(chunk, n)
        return c, c
    if 4 * n <= PIPELINE_BYTES:
        return min(n, RECV_SLICE), n
    return SLICE_FLOATS, SLICE_FLOATS


def apply_floats(n, chunk=None):
    """The worker's floats per slice of x −= d as d arrives (`chunk` overrides APPLY_SLICE)."""
    return _clamp(chunk or APPLY_SLICE, n)


def _clamp(floats, n):
    return max(1, min(int(floats), n))


class PeerClosed(ConnectionError):
    """The peer closed the connection, possibly in the middle of a frame."""


def tune(sock):
    # Small frames (headers, PULL, REPORT) must not wait for Nagle; the kernel's
    # own buffer autotuning beats fixed SO_SNDBUF/SO_RCVBUF sizes on loopback (bench/exchange.py).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def mapped(count, dtype):
    """A zeroed array of `count` items on a mapping of its own, unmapped when the array goes. A connection's
    buffers are model-sized and live as long as its thread: from malloc, glibc's per-thread arenas kept them
    after the connection ended (bench/exchange_load.py's reconnect loop shows it)."""
    nbytes = count * np.dtype(dtype).itemsize
    if not nbytes:
        return np.empty(0, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype)


def byte_view(array):
    """A writable/readable byte memoryview of a contiguous numpy array (no copy)."""
    return memoryview(array).cast("B")


def _recv_some(sock, view, got):
    """Read what has arrived into view[got:]; the new fill level. PeerClosed if the stream ended."""
    k = sock.recv_into(view[got:])
    if not k:
        raise PeerClosed(f"peer closed the connection after {got} of {len(view)} bytes")
    return got + k


def recv_exact(sock, view):
    """Fill `view` completely from `sock`; PeerClosed if the stream ends first."""
    got, want = 0, len(view)
    while got < want:
        got = _recv_some(sock, view, got)


def recv_applying(sock, view, apply, step, received=0):
    """Fill `view` (a float32 buffer's bytes) from `sock`, calling apply(start, end) on the floats that are in.

    While bytes are still arriving it is called once per read that completes whole
    `step`-float slices (fewer numpy calls), with all of them; once everything is in,
    on the rest. `received` bytes are already in (the server's consistent mode reads
    x whole first). Every float is applied exactly once, in order; the last call ends at
    the last float.
    """
    nbytes = len(view)
    n = nbytes >> 2
    got, done = received, 0
    while done < n:
        if got < nbytes:
            got = _recv_some(sock, view, got)
        ready = got >> 2
        if got < nbytes:
            ready -= ready % step
        if ready > done:
            apply(done, ready)
            done = ready


def recv_header(sock, view, model_bytes, history_bytes=0, coded_bytes=None):
    """Read and validate one header into `view` (HEADER_SIZE bytes)."""
    recv_exact(sock, view)
    return protocol.decode_header(view, model_bytes, history_bytes, coded_bytes)


def send_frame(sock, header, payload=None, tag=b""):
    """Send a header, an optional payload (a byte view) and a tag with one syscall when the kernel takes it all."""
    parts = [memoryview(part).cast("B") for part in (header, payload, tag) if part is not None and len(part)]
    sent = sock.sendmsg(parts)
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        sock.sendall(part[sent:])
        sent = 0


class Deadline:
    """A socket whose every read and write ends by one deadline, however the peer paces its bytes: a handshake's.
    A socket's own timeout restarts at each read, so a peer that sends a byte every few seconds would hold a
    handshake open without end; here each read waits at most what is left (socket.timeout once it is spent)."""

    def __init__(self, sock, seconds):
        self.sock, self.deadline = sock, time.monotonic() + seconds

    def _arm(self):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the deadline has passed")
        self.sock.settimeout(left)

    def recv_into(self, view):
        self._arm()
        return self.sock.recv_into(view)

    def sendmsg(self, parts):
        self._arm()
        return self.sock.sendmsg(parts)

    def sendall(self, data):
        self._arm()
        return self.sock.sendall(data)

    def __getattr__(self, name):  # settimeout, close, shutdown, ...: the socket's own
        return getattr(self.sock, name)


class Connection:
    """One peer's socket and the buffers its frames are read into and sent from, allocated once.

    The server makes one per accepted socket; a client keeps one across reconnects
    (a new socket is attached to the same buffers).

    Once sealed (after the handshake, with the keys it derived) every frame carries a
    tag: AES-GCM's under the sending direction's key over its header and payload, its
    sequence number the IV (protocol.Sealer). The tag is the connection's business alone: `send`
    and `send_sliced` hash what goes out, `receive` hashes what arrives, slice by slice
    before anything overwrites it, and checks the tag before it returns, so that a frame
    changed on the way is refused before its reader acts on it.
    """

    def __init__(self, sock, peer, worker_id=None):
        self.sock = sock
        self.peer = peer             # "host:port", for messages
        self.worker_id = worker_id   # None until the handshake has authenticated it
        self.header = memoryview(bytearray(protocol.HEADER_SIZE))       # the header being read
        self.out_header = bytearray(protocol.HEADER_SIZE)               # the header being sent
        self.small = memoryview(bytearray(protocol.MAX_SMALL_PAYLOAD))  # handshake and ERROR payloads
        self.tag = memoryview(bytearray(protocol.TAG_SIZE))              # the tag being read
        self.buf = self.view = self.ok = self.scratch = None
        self.history_bytes = 0       # a HISTORY frame's payload: 0 while solver history is not exchanged
        self.frames = Float32Frames(self)  # model frames in the job's codec (allocate)
        self.sent_bytes = self.received_bytes = 0  # on the wire, headers and tags included
        self.unseal()

    # -- integrity ------------------------------------------------------------------

    def seal(self, send_key, recv_key):
        """From now on, tag what is sent under send_key and check what arrives under recv_key."""
        self._out, self._in = protocol.Sealer(send_key), protocol.Sealer(recv_key)
        self._sending = self._reading = None

    def unseal(self):
        """Untagged frames (a new socket's handshake)."""
        self._out = self._in = self._sending = self._reading = self.on_verified = None

    @property
    def sealed(self):
        return self._out is not None

    def _absorb(self, data):
        """Payload bytes of the frame being read, in order, as they arrive (the tag's input)."""
        if self._reading is not None:
            self._reading.update(data)

    def _verify(self):
        """The frame being read is complete: read its tag and check it (IntegrityError if it differs), then
        call `on_verified` once if it is set (what may be believed of the frame's header)."""
        if self._reading is not None:
            mac, self._reading = self._reading, None
            recv_exact(self.sock, self.tag)
            if not protocol.proofs_match(mac.digest(), self.tag):
                raise protocol.IntegrityError(
                    f"frame {self._in.sequence - 1} from {self.peer} failed its integrity check (changed on the way, "
                    "or not from this job's peer)")
        verified, self.on_verified = self.on_verified, None
        if verified is not None:
            verified()

    # -- receiving ------------------------------------------------------------------

    def fill(self, view):
        """Read a payload whole into `view` without acting on it (receive(..., received=len(view)) then
        applies and verifies it); its length."""
        recv_exact(self.sock, view)
        return len(view)

    def receive(self, view, apply=None, step=1, received=0):
        """The payload of the frame whose header was read, into `view` (a float32 buffer's bytes for `apply`),
        and its tag checked before this returns (IntegrityError if it fails).

        apply(start, end) runs on the floats that are in as they arrive, in `step`-float slices
        (recv_applying's); each slice is hashed before, since apply may overwrite it in place.
        `received` bytes are in already (fill). What apply wrote must not be believed, nor acted
        on, before this returns.
        """
        if apply is None:
            recv_exact(self.sock, view[received:])
            self._absorb(view)
        else:
            def hashed(start, end):
                self._absorb(view[4 * start:4 * end])
                apply(start, end)

            recv_applying(self.sock, view, hashed, step, received)
        self._verify()

    def read_small(self, length):
        """The payload of a small frame whose header said `length` (a view, valid until the next read), verified."""
        view = self.small[:length]
        self.receive(view)
        return view

    def allocate(self, n, scratch=0, codec=C.CODECS["float32"]):
        """The model buffer (x in, d or the mean out, in place) and `scratch` floats of scratch space, each on
        a mapping of its own (`mapped`); scratch pages never touched (server_factor 1) take no memory. Model
        frames then travel in `codec` (one of codec.CODECS: ExchangeOptions.codec)."""
        self.buf = mapped(n, np.float32)
        self.view = byte_view(self.buf)
        self.ok = mapped(scratch, bool)               # rules.all_finite's
        self.scratch = mapped(scratch, np.float32)    # rules.apply_to_center's
        self.frames = Float32Frames(self) if codec.name == "float32" else CodedFrames(self, C.Channel(codec, n))
        return self

    def read_header(self, model_bytes):
        """The next header, validated (model frames must be exactly `model_bytes` long); a sealed frame
        without a payload is verified here, one with a payload by `receive`."""
        h = recv_header(self.sock, self.header, model_bytes, self.history_bytes, self.frames.coded_bytes)
        self.received_bytes += protocol.HEADER_SIZE + h.length + (protocol.TAG_SIZE if self._in is not None else 0)
        if self._in is not None:
            self._reading = self._in.begin(self.header)
            if not h.length:
                self._verify()
        return h

    # -- sending --------------------------------------------------------------------

    def send_frame_bytes(self, frame):
        """A whole frame built elsewhere (an ERROR), tagged when sealed."""
        self.sent_bytes += len(frame) + (protocol.TAG_SIZE if self._out is not None else 0)
        if self._out is None:
            self.sock.sendall(frame)
            return
        mac = self._out.begin(memoryview(frame)[:protocol.HEADER_SIZE])
        mac.update(memoryview(frame)[protocol.HEADER_SIZE:])
        send_frame(self.sock, frame, None, mac.digest())

    def send(self, type_, payload=None, iteration=0, value=math.nan, tag_after=False, flags=0, length=None):
        """A frame from this connection's worker id: the header (packed in place), its payload and its tag.

        The tag goes out with the frame in one syscall, or with tag_after (model frames, which
        the peer reads to the end) just after it, hashed while the peer reads and hashes. `length`:
        the whole payload's, when `payload` is only its first slice (send_sliced's).
        """
        whole = length is None
        if whole:
            length = 0 if payload is None else len(payload)
        self.sent_bytes += protocol.HEADER_SIZE + length + (protocol.TAG_SIZE if self._out is not None else 0)
        protocol.pack_header_into(self.out_header, type_, self.worker_id, iteration, length, value, flags)
        if self._out is None:
            send_frame(self.sock, self.out_header, payload)
            return
        mac = self._out.begin(self.out_header)
        if whole and not tag_after:
            # The tag goes out with the frame, in one syscall: a peer that refuses the frame at its
            # header has then had all of it, and its ERROR is what this side reads next.
            if payload is not None and len(payload):
                mac.update(payload)
            send_frame(self.sock, self.out_header, payload, mac.digest())
            return
        # Slice by slice, each hashed just after it went: the peer reads and hashes a slice while this side hashes
        # it and sends the next, and the tag follows the last.
        first = payload[:SEAL_SLICE] if whole and payload is not None else payload
        send_frame(self.sock, self.out_header, first)
        if first is not None and len(first):
            mac.update(first)
        if not whole:
            self._sending = mac
            return
        for start in range(SEAL_SLICE, length, SEAL_SLICE):
            part = payload[start:start + SEAL_SLICE]
            self.sock.sendall(part)
            mac.update(part)
        self.sock.sendall(mac.digest())

    def send_sliced(self, type_, view, step, before, iteration=0, flags=0):
        """A model frame from `view` (a float32 buffer's bytes) sent `step` floats at a time, before(start, end)
        run on each slice's floats just before it goes out; the tag after the last slice."""
        n = len(view) >> 2
        for start in range(0, n, step):
            end = min(start + step, n)
            before(start, end)
            part = view[4 * start:4 * end]
            if start == 0:
                self.send(type_, part, iteration=iteration, flags=flags, length=len(view))
                continue
            self.sock.sendall(part)
            if self._sending is not None:
                self._sending.update(part)
        if self._sending is not None:
            mac, self._sending = self._sending, None
            self.sock.sendall(mac.digest())


class Float32Frames:
    """A connection's model frames in float32: a payload is an array's own bytes, received into the connection's
    buffer slice by slice while the application applies what is in (recv_applying), sealed as it goes.

    Three kinds of model payload, whatever frame type the application's handler names for each: parameters
    (a worker's x: EASGD's EXCHANGE, sync's AVERAGE), a delta (sent with the codec's error feedback: EASGD's DIFF
    d) and a model (in the codec, as the receiver's picture of it: sync's CENTER mean); and the center whole
    (CENTER, the reply to PULL, float32 whatever the codec). Each has a send and a receive here, the same names
    in CodedFrames, so that the application never sees the codec.
    """

    coded_bytes = None  # a model frame is model_bytes long

    def __init__(self, conn):
        # A proxy, not a reference: with no cycle between them, a connection's buffers are unmapped as soon as its
        # thread lets go of it, not at the next garbage collection (bench/exchange_load.py's reconnect loop).
        self.conn = weakref.proxy(conn)
        self._received = 0  # bytes of parameters read ahead (prefetch_params)

    def restart(self, values=None):
        """Both ends start over (a new connection: zeros; a PULL: `values`, the center sent whole)."""

    def send_params(self, type_, values, iteration, value):
        """The worker's parameters `values` (EXCHANGE, AVERAGE); a big frame's tag after it, so that the server
        hashes each slice as it arrives while this side hashes what it sent."""
        payload = byte_view(values)
        self.conn.send(type_, payload, iteration, value, tag_after=len(payload) > TAG_AFTER)

    def prefetch_params(self, whole):
        """Ahead of receive_params, outside the application's lock: all of x when `whole` (a slow sender then
        holds up nobody), else nothing."""
        self._received = self.conn.fill(self.conn.view) if whole else 0

    def receive_params(self, apply=None, step=1):
        """The worker's x into the connection's buffer, apply(start, end) on its floats as they arrive, in
        `step`-float slices; verified before this returns (a frame changed on the way raises here)."""
        received, self._received = self._received, 0
        self.conn.receive(self.conn.view, apply, step, received)

    def send_delta(self, type_, iteration, flags, step, add):
        """A `type_` frame of the delta in the connection's buffer (EASGD's DIFF d) back to the worker, add(start,
        end) run on every `step`-float slice of it: a model of one slice goes whole and is added after (the add
        overlaps the worker's own x −= d); a bigger one slice by slice, each added just before it goes, so that
        the worker applies while this adds."""
        conn, n = self.conn, self.conn.buf.size
        if step < n:
            conn.send_sliced(type_, conn.view, step, add, iteration=iteration, flags=flags)
            return
        conn.send(type_, conn.view, iteration=iteration, tag_after=True, flags=flags)
        add(0, n)

    def receive_delta(self, apply=None, step=1):
        """d into the connection's buffer, apply(start, end) on its floats as they arrive; one that fails its
        check raises (ProtocolError) before this returns."""
        self.conn.receive(self.conn.view, apply, step)

    def send_model(self, type_, values, iteration, flags):
        """A `type_` frame of the model `values` back to the worker (sync's CENTER: a round's mean)."""
        self.conn.send(type_, byte_view(values), iteration=iteration, tag_after=True, flags=flags)

    def receive_model(self, h, out):
        """send_model's model into `out` (h: its frame's header)."""
        if h.flags & protocol.F_CODED:
            raise protocol.ProtocolError(f"a {protocol.TYPE_NAMES[h.type]} in the job's codec")
        self.conn.receive(byte_view(out))

    def send_center(self, center, iteration, flags=0):
        """CENTER: the reply to PULL, x̃ whole in float32 whatever the codec (the worker starts over from it)."""
        conn = self.conn
        if not conn.sealed:
            conn.send(protocol.CENTER, byte_view(center), iteration=iteration, flags=flags)
            return
        # Lock-free, other workers move x̃ while it is sent: the tag must cover the bytes that went out, so a
        # snapshot in this connection's buffer (free: the worker waits) goes.
        np.copyto(conn.buf, center)
        conn.send(protocol.CENTER, conn.view, iteration=iteration, tag_after=True, flags=flags)

    def receive_center(self, out):
        """PULL's reply: x̃ whole into `out`; both ends start over from it."""
        self.conn.receive(byte_view(out))
        self.restart(out)

    # A solver history goes in float32 whatever the codec: it is held and handed back, never applied, and a
    # resumed worker must get back exactly what it sent (so CodedFrames has no history methods of its own).

    def send_history(self, history=None, iteration=0, current_step=0):
        """HISTORY: a worker's solver history `history` (float32, history sets × the model's floats) with the
        iteration and current_step it was taken at; None sends an empty one (GET_HISTORY's reply where none is
        held). A big frame's tag after it, as send_params's."""
        if history is None:
            self.conn.send(protocol.HISTORY)
            return
        payload = byte_view(history)
        self.conn.send(protocol.HISTORY, payload, iteration, float(current_step), tag_after=len(payload) > TAG_AFTER)

    def receive_history(self, out):
        """A HISTORY's solver history (its header read, its length what `out` holds) into `out`, verified before
        this returns; whether its values may be believed (finite) is the caller's to check."""
        self.conn.receive(byte_view(out))


class CodedFrames(Float32Frames):
    """A connection's model frames in a coded codec (float16, bfloat16, int8, int4) through its codec.Channel:
    each comes whole and is checked as it decodes (CodecError for a payload that does not decode to finite
    floats), the application's apply then runs once on all of it. PULL's center still goes whole in float32."""

    def __init__(self, conn, channel):
        super().__init__(conn)
        self.channel = channel
        self.coded_bytes = len(channel.payload)
        self._decoded = False  # x already received and decoded (prefetch_params)

    def restart(self, values=None):
        self.channel.restart(values)

    def send_params(self, type_, values, iteration, value):
        payload = self.channel.send_toward(values)
        self.conn.send(type_, payload, iteration, value, tag_after=len(payload) > TAG_AFTER)

    def prefetch_params(self, whole):
        """x whole and decoded (the server's picture of the worker), whatever `whole` says: CodecError, the
        picture untouched, for one that does not decode."""
        self.conn.receive(self.channel.payload)
        self.channel.receive_toward(self.conn.buf)
        self._decoded = True

    def receive_params(self, apply=None, step=1):
        if not self._decoded:
            self.prefetch_params(True)
        self._decoded = False
        if apply is not None:
            apply(0, self.conn.buf.size)

    def send_delta(self, type_, iteration, flags, step, add):
        """The delta in the codec, with what earlier replies' rounding left out; add runs on it exact, after it
        went."""
        conn, n = self.conn, self.conn.buf.size
        conn.send(type_, self.channel.send_difference(conn.buf), iteration=iteration, tag_after=True, flags=flags)
        for start in range(0, n, step):
            add(start, min(start + step, n))

    def receive_delta(self, apply=None, step=1):
        self.conn.receive(self.channel.payload)
        self.channel.receive_difference(self.conn.buf)
        if apply is not None:
            apply(0, self.conn.buf.size)

    def send_model(self, type_, values, iteration, flags):
        """The model in the codec: the worker's picture of it, and so its parameters, move by what decodes."""
        self.conn.send(type_, self.channel.send_toward(values), iteration=iteration, tag_after=True,
                       flags=flags | protocol.F_CODED)

    def receive_model(self, h, out):
        if not h.flags & protocol.F_CODED:
            raise protocol.ProtocolError(f"a {protocol.TYPE_NAMES[h.type]} outside the job's codec")
        self.conn.receive(self.channel.payload)
        self.channel.receive_toward(out)

    def send_center(self, center, iteration, flags=0):
        conn = self.conn
        np.copyto(conn.buf, center)  # lock-free, x̃ moves: both ends start from what went out
        conn.send(protocol.CENTER, conn.view, iteration=iteration, tag_after=True, flags=flags)
        self.restart(conn.buf)
