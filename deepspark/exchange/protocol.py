"""Wire format of the ParameterExchanger: frame header, message types, handshake proofs and validation (no sockets)."""

import hashlib
import hmac
import math
import secrets
import struct
from collections import namedtuple

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from deepspark.proto import deepspark_pb2 as pb

MAGIC = b"DSPX"
VERSION = 6  # 2: every frame after the handshake carries an integrity tag; 3: workers' solver history;
            # 4: the tag is AES-GCM's (16 bytes), not HMAC-SHA256's; 5: a reply's lease (F_LEASE);
            # 6: a worker's claim of record blocks (CLAIM, CLAIMED)

# magic, version, type, flags, worker id, iteration, payload length (bytes), value.
# `value` carries the loss on EXCHANGE, AVERAGE and REPORT so progress needs no extra frame, and the
# solver's current_step on HISTORY; `flags` carries the error code on ERROR, and F_SEND_HISTORY on a
# reply (DIFF, CENTER) asks the worker for its solver history. A reply flagged F_LEASE (DIFF, or CENTER to a
# PULL) carries in `iteration` the iteration the worker may train to (its lease: handlers.Leases), never less
# than the last it was told; without it, the server's count of exchanges.
HEADER = struct.Struct("<4sBBHIqQd")
HEADER_SIZE = HEADER.size

# Message types.
HELLO = 1        # client -> server: client nonce
CHALLENGE = 2    # server -> client: server nonce + server's proof
AUTH = 3         # client -> server: client's proof + model fingerprint
WELCOME = 4      # server -> client: accepted
EXCHANGE = 5     # client -> server: parameters x (float32)
DIFF = 6         # server -> client: elastic difference d (float32)
PULL = 7         # client -> server: ask for the center
CENTER = 8       # server -> client: the center x~ (float32)
REPORT = 9       # client -> server: iteration and loss, no reply
ERROR = 10       # either way: UTF-8 reason, code in flags
BYE = 11         # client -> server: closing, no reply
AVERAGE = 12     # client -> server: parameters x for the synchronous round `iteration`; reply CENTER (the mean)
HISTORY = 13     # either way: a worker's solver history (history sets x the model's floats), no reply;
                 # server -> client as the reply to GET_HISTORY, empty when the server holds none for it
GET_HISTORY = 14  # client -> server: ask for the solver history held for this worker (a resumed job's)
CLAIM = 15       # client -> server: blocks wanted, and the tickets of the blocks read since (work stealing)
CLAIMED = 16     # server -> client: the blocks granted (ticket, epoch, owner, first record, count each)

# Header flags of a reply to a model frame.
F_SEND_HISTORY = 1  # the driver is snapshotting: send a HISTORY frame (once the reply is applied)
F_CODED = 2         # a CENTER frame in the job's codec (the reply to AVERAGE); without it, float32 (PULL's)
F_LEASE = 4         # a reply's iteration is the worker's lease: it trains to there, and asks again

# The codecs of model frames (codec.py), by the id a worker's AUTH names its own with: the schema's ExchangeCodec
# numbers, by their names in lower case.
CODEC_IDS = {value.name.lower(): value.number for value in pb.DeepSparkParameter.ExchangeCodec.DESCRIPTOR.values}
CODEC_NAMES = {number: name for name, number in CODEC_IDS.items()}

TYPE_NAMES = {
    HELLO: "HELLO", CHALLENGE: "CHALLENGE", AUTH: "AUTH", WELCOME: "WELCOME",
    EXCHANGE: "EXCHANGE", DIFF: "DIFF", PULL: "PULL", CENTER: "CENTER",
    REPORT: "REPORT", ERROR: "ERROR", BYE: "BYE", AVERAGE: "AVERAGE", HISTORY: "HISTORY",
    GET_HISTORY: "GET_HISTORY", CLAIM: "CLAIM", CLAIMED: "CLAIMED",
}

# Error codes (ERROR frame flags).
E_PROTOCOL = 1
E_AUTH = 2
E_FINGERPRINT = 3
E_NONFINITE = 4
E_TIMEOUT = 5
E_SHUTDOWN = 6
E_DIVERGED = 7  # client -> server: the worker's loss is no longer finite; it stops (the reason says where)
E_INTEGRITY = 8  # a sealed frame failed its tag: the connection ends (the worker rejoins on a new one)
ERROR_NAMES = {
    E_PROTOCOL: "protocol", E_AUTH: "authentication", E_FINGERPRINT: "fingerprint",
    E_NONFINITE: "non-finite", E_TIMEOUT: "timeout", E_SHUTDOWN: "shutdown", E_DIVERGED: "diverged",
    E_INTEGRITY: "integrity",
}

NONCE_SIZE = 32
PROOF_SIZE = 32  # HMAC-SHA256
TAG_SIZE = 16  # AES-GCM's tag of a sealed frame
MAX_ERROR_BYTES = 1024
MAX_FINGERPRINT_BYTES = 64 * 1024
MAX_DIMS = 32
# Blocks one CLAIM may ask for, and tickets it may report read: a worker holds a few blocks at a time (a block is
# megabytes of records), so this bounds a frame, not a worker.
MAX_CLAIM = 64
CLAIM_HEAD = struct.Struct("<II")   # blocks wanted, tickets reported read (that many u64 follow)
TICKET = struct.Struct("<Q")
GRANT = struct.Struct("<QQIIQ")     # ticket, epoch, owner, count, first record

# Payload lengths the small (non-model) frames may have: (minimum, maximum).
_SMALL_LIMITS = {
    HELLO: (NONCE_SIZE, NONCE_SIZE),
    CHALLENGE: (NONCE_SIZE + PROOF_SIZE, NONCE_SIZE + PROOF_SIZE),
    AUTH: (PROOF_SIZE + 1, PROOF_SIZE + 1 + MAX_FINGERPRINT_BYTES),  # proof, codec id, fingerprint
    WELCOME: (0, 0),
    PULL: (0, 0),
    REPORT: (0, 0),
    ERROR: (0, MAX_ERROR_BYTES),
    BYE: (0, 0),
    GET_HISTORY: (0, 0),
    CLAIM: (CLAIM_HEAD.size, CLAIM_HEAD.size + MAX_CLAIM * TICKET.size),
    CLAIMED: (0, MAX_CLAIM * GRANT.size),
}
MAX_SMALL_PAYLOAD = max(hi for _, hi in _SMALL_LIMITS.values())
MODEL_TYPES = (EXCHANGE, DIFF, CENTER, AVERAGE)

Header = namedtuple("Header", "type flags worker_id iteration length value")


class ProtocolError(Exception):
    """A frame that breaks the protocol; the connection cannot go on."""

    code = E_PROTOCOL


class CodecError(ProtocolError):
    """A payload that does not decode to finite floats: refused as non-finite parameters are (here, not in
    codec.py, so that a handler catches it without the codec)."""

    code = E_NONFINITE


class IntegrityError(ProtocolError):
    """A sealed frame whose tag does not match: changed on the way, or not from the authenticated peer."""

    code = E_INTEGRITY


class Refusal(Exception):
    """This side refuses the peer: an ERROR frame with `code` goes back, then the connection closes."""

    def __init__(self, code, reason):
        super().__init__(reason)
        self.code = code


class Declined(Exception):
    """This side declines one frame: an ERROR frame with `code` goes back, and the connection goes on."""

    def __init__(self, code, reason):
        super().__init__(reason)
        self.code = code


class RefusedError(Exception):
    """The peer sent an ERROR frame; `code` says why (see ERROR_NAMES)."""

    def __init__(self, code, reason):
        super().__init__(f"exchange refused ({ERROR_NAMES.get(code, code)}): {reason}")
        self.code = code
        self.reason = reason


def encode_header(type_, worker_id=0, iteration=0, length=0, value=math.nan, flags=0):
    return HEADER.pack(MAGIC, VERSION, type_, flags, worker_id, iteration, length, value)


def pack_header_into(buf, type_, worker_id=0, iteration=0, length=0, value=math.nan, flags=0):
    """Write a header into a preallocated buffer (the hot path allocates nothing)."""
    HEADER.pack_into(buf, 0, MAGIC, VERSION, type_, flags, worker_id, iteration, length, value)


def decode_header(buf, model_bytes=None, history_bytes=0, coded_bytes=None):
    """Parse and validate a header; raise ProtocolError on anything unexpected.

    `model_bytes` is the exact payload length of a model-sized frame (4 × the
    parameter count); before the handshake it is None and model frames are refused.
    `coded_bytes` is that of a frame in the job's codec (EXCHANGE, DIFF, AVERAGE and
    a CENTER flagged F_CODED); None: the codec is float32, coded_bytes = model_bytes.
    `history_bytes` is a HISTORY frame's (history sets × model_bytes), which may also
    be empty; 0 refuses HISTORY frames (a peer that keeps no solver history).
    A length is checked before anything is read or allocated after the header.
    """
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    magic, version, type_, flags, worker_id, iteration, length, value = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (not a DeepSpark exchange peer)")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, expected {VERSION}")
    if type_ in MODEL_TYPES:
        if model_bytes is None:
            raise ProtocolError(f"{TYPE_NAMES[type_]} before the handshake completed")
        coded = type_ != CENTER or flags & F_CODED
        want = coded_bytes if coded and coded_bytes is not None else model_bytes
        if length != want:
            coded_note = " in the job's codec" if want != model_bytes else ""
            raise ProtocolError(f"{TYPE_NAMES[type_]} payload of {length} bytes, the model needs exactly {want}"
                                f"{coded_note}")
    elif type_ == HISTORY:
        if model_bytes is None or not history_bytes:
            why = "before the handshake completed" if model_bytes is None else "to a peer that keeps no solver history"
            raise ProtocolError(f"HISTORY {why}")
        if length not in (0, history_bytes):
            raise ProtocolError(f"HISTORY payload of {length} bytes, the solver history needs exactly {history_bytes} "
                                "(or 0)")
    elif type_ in _SMALL_LIMITS:
        lo, hi = _SMALL_LIMITS[type_]
        if not lo <= length <= hi:
            raise ProtocolError(f"{TYPE_NAMES[type_]} payload of {length} bytes, allowed {lo}..{hi}")
    else:
        raise ProtocolError(f"unknown message type {type_}")
    return Header(type_, flags, worker_id, iteration, length, value)


def lease_of(h, held):
    """The lease a reply's header `h` carries (F_LEASE), checked against the one held (None: none yet); `held` for a
    reply without one. ProtocolError for a lease below zero or below the one held: a lease only grows."""
    if not h.flags & F_LEASE:
        return held
    if h.iteration < 0 or (held is not None and h.iteration < held):
        raise ProtocolError(f"{TYPE_NAMES[h.type]} leases iteration {h.iteration}, below "
                            f"{'zero' if h.iteration < 0 else f'the {held} leased before'}")
    return h.iteration


def encode_claim(wanted, done=()):
    """A CLAIM's payload: `wanted` blocks (1..MAX_CLAIM), having read the blocks of tickets `done`."""
    if not 1 <= wanted <= MAX_CLAIM or len(done) > MAX_CLAIM:
        raise ValueError(f"a claim asks for 1..{MAX_CLAIM} blocks and reports at most {MAX_CLAIM} read")
    return CLAIM_HEAD.pack(wanted, len(done)) + b"".join(TICKET.pack(ticket) for ticket in done)


def decode_claim(payload):
    """(wanted, [tickets read]) of a CLAIM's payload; ProtocolError unless its length and counts agree and are in
    range."""
    payload = bytes(payload)
    if len(payload) < CLAIM_HEAD.size:
        raise ProtocolError(f"CLAIM payload of {len(payload)} bytes, shorter than its {CLAIM_HEAD.size}-byte head")
    wanted, count = CLAIM_HEAD.unpack_from(payload)
    if not 1 <= wanted <= MAX_CLAIM or count > MAX_CLAIM or len(payload) != CLAIM_HEAD.size + count * TICKET.size:
        raise ProtocolError(f"CLAIM of {wanted} blocks with {count} tickets in {len(payload)} bytes (1..{MAX_CLAIM} "
                            f"blocks, at most {MAX_CLAIM} tickets, {TICKET.size} bytes each)")
    return wanted, [TICKET.unpack_from(payload, CLAIM_HEAD.size + i * TICKET.size)[0] for i in range(count)]


def encode_grants(grants):
    """A CLAIMED's payload: each grant's (ticket, epoch, owner, first, count)."""
    return b"".join(GRANT.pack(g.ticket, g.epoch, g.owner, g.count, g.first) for g in grants)


def decode_grants(payload, wanted, owners, records):
    """[(ticket, epoch, owner, first, count)] of a CLAIMED's payload, answering a claim of `wanted` blocks in a job
    of `owners` record ranges over a source of `records`; ProtocolError for a length that is not whole grants, more
    than wanted, or a grant outside the source."""
    payload = bytes(payload)
    if len(payload) % GRANT.size or len(payload) // GRANT.size > wanted:
        raise ProtocolError(f"CLAIMED payload of {len(payload)} bytes for a claim of {wanted} blocks "
                            f"({GRANT.size} bytes each)")
    grants = []
    for at in range(0, len(payload), GRANT.size):
        ticket, epoch, owner, count, first = GRANT.unpack_from(payload, at)
        if owner >= owners or not count or first + count > records:
            raise ProtocolError(f"CLAIMED block of worker {owner}'s range, records [{first}, {first + count}): not "
                                f"in the job's {owners} ranges of {records} records")
        grants.append((ticket, epoch, owner, first, count))
    return grants


def encode_error(code, reason, worker_id=0):
    """A whole ERROR frame; the reason is cut to MAX_ERROR_BYTES on a character boundary."""
    data = reason.encode("utf-8")[:MAX_ERROR_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return encode_header(ERROR, worker_id, length=len(data), flags=code) + data


def decode_error(payload):
    return bytes(payload).decode("utf-8", "replace")


# ---- handshake -------------------------------------------------------------

def as_secret(secret):
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise ValueError("the job secret must be a non-empty str or bytes")
    return bytes(secret)


def new_nonce():
    return secrets.token_bytes(NONCE_SIZE)


def server_proof(secret, client_nonce, server_nonce, worker_id):
    msg = b"DSPX-server" + client_nonce + server_nonce + struct.pack("<I", worker_id)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def client_proof(secret, client_nonce, server_nonce, worker_id, fingerprint_bytes):
    # The fingerprint is bound into the proof so nobody in between can swap it.
    msg = (b"DSPX-client" + server_nonce + client_nonce + struct.pack("<I", worker_id)
           + fingerprint_bytes)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def proofs_match(a, b):
    return hmac.compare_digest(bytes(a), bytes(b))


def session_keys(secret, client_nonce, server_nonce, worker_id):
    """(client-to-server key, server-to-client key) of one connection: bound to the job's secret and
    both nonces of its handshake, so no other connection's frames (or this one's replayed the other
    way) verify."""
    tail = client_nonce + server_nonce + struct.pack("<I", worker_id)
    return (hmac.new(secret, b"DSPX-key-c2s" + tail, hashlib.sha256).digest(),
            hmac.new(secret, b"DSPX-key-s2c" + tail, hashlib.sha256).digest())


class Sealer:
    """The tags of one direction of a sealed connection: AES-256-GCM over each frame's header and payload as
    authenticated data (GMAC: nothing is encrypted), with the frame's sequence number, counting that
    direction's frames from 0, as the IV. A frame dropped, replayed or reordered is checked under another
    IV and does not verify; each connection's keys are its own (session_keys), so no IV repeats under a key.

    AES-GCM from the `cryptography` library, against HMAC-SHA256 (this seal until protocol version 3):
    bench/seal.py measures the candidates in LeNet-size round trips."""

    def __init__(self, key):
        self._aes = algorithms.AES(key)
        self.sequence = 0

    def begin(self, header):
        """The tag of the next frame, fed its header; the caller feeds the payload (update) and ends it (digest)."""
        mac = _FrameTag(Cipher(self._aes, modes.GCM(_IV.pack(self.sequence))).encryptor())
        self.sequence += 1
        mac.update(header)
        return mac


_IV = struct.Struct("<4xQ")  # GCM's 96-bit IV: 4 zero bytes, then the sequence number


class _FrameTag:
    """One frame's GMAC as it is fed, slice by slice."""

    __slots__ = ("_gcm",)

    def __init__(self, gcm):
        self._gcm = gcm

    def update(self, data):
        if len(data):
            self._gcm.authenticate_additional_data(data)

    def digest(self):
        self._gcm.finalize()
        return self._gcm.tag


# ---- model fingerprint -----------------------------------------------------

def normalize_shapes(shapes, size=None):
    """Blob shapes as a tuple of int tuples; a flat vector of `size` when shapes is None."""
    if shapes is None:
        if size is None:
            raise ValueError("need blob shapes or a parameter count")
        return ((int(size),),)
    out = tuple(tuple(int(d) for d in s) for s in shapes)
    if any(d < 0 for s in out for d in s) or any(len(s) > MAX_DIMS for s in out) \
            or shapes_size(out) >= 2 ** 62:
        raise ValueError(f"bad blob shapes {shapes!r}")
    return out


def shapes_size(shapes):
    return sum(math.prod(s) for s in shapes)


def fingerprint(shapes):
    """Parameter count and blob shapes as bytes: <Q count> <I blobs> then <I ndim> <Q dims>…"""
    parts = [struct.pack("<QI", shapes_size(shapes), len(shapes))]
    for s in shapes:
        parts.append(struct.pack(f"<I{len(s)}Q", len(s), *s))
    data = b"".join(parts)
    if len(data) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"model has too many blobs for a fingerprint ({len(data)} bytes)")
    return data


def parse_fingerprint(data):
    """(count, shapes) from fingerprint bytes; ProtocolError when malformed (never over-reads)."""
    data = bytes(data)
    try:
        count, nblobs = struct.unpack_from("<QI", data, 0)
        off = 12
        shapes = []
        for _ in range(nblobs):
            (ndim,) = struct.unpack_from("<I", data, off)
            if ndim > MAX_DIMS:
                raise ProtocolError(f"fingerprint blob with {ndim} dimensions")
            shapes.append(struct.unpack_from(f"<{ndim}Q", data, off + 4))
            off += 4 + 8 * ndim
    except struct.error:
        raise ProtocolError("truncated model fingerprint") from None
    if off != len(data):
        raise ProtocolError(f"model fingerprint has {len(data) - off} trailing bytes")
    return count, tuple(shapes)


def describe_shapes(count, shapes, limit=6):
    shown = ", ".join("x".join(map(str, s)) or "scalar" for s in shapes[:limit])
    more = ", …" if len(shapes) > limit else ""
    return f"{count} parameters in {len(shapes)} blobs [{shown}{more}]"
