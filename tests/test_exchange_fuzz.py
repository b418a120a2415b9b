"""Hypothesis fuzzing of the exchange frame parser, alone and against a live server."""

import socket

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspark.algorithms.easgd import EasgdHandler
from deepspark.exchange import ExchangeClient, ExchangeServer
from deepspark.exchange import protocol as P

SECRET = b"fuzz-secret"
N = 64
MODEL_BYTES = 4 * N

model_bytes = st.one_of(st.none(), st.integers(0, 2 ** 40))
history_bytes = st.one_of(st.just(0), st.integers(0, 2 ** 41))


@given(st.binary(min_size=0, max_size=2 * P.HEADER_SIZE), model_bytes, history_bytes)
@settings(max_examples=500, deadline=None)
def test_arbitrary_bytes_parse_or_are_refused(data, mb, hb):
    try:
        h = P.decode_header(data, mb, hb)
    except P.ProtocolError:
        return
    assert len(data) == P.HEADER_SIZE and data[:4] == P.MAGIC
    _assert_length_allowed(h, mb, hb)


@given(st.integers(0, 255), st.integers(0, 2 ** 64 - 1), st.integers(0, 2 ** 16 - 1),
       st.integers(0, 2 ** 32 - 1), st.integers(-2 ** 63, 2 ** 63 - 1), st.floats(), model_bytes, history_bytes)
@settings(max_examples=1000, deadline=None)
def test_well_formed_headers_are_checked_against_the_limits(type_, length, flags, wid, it, value, mb, hb):
    data = P.HEADER.pack(P.MAGIC, P.VERSION, type_, flags, wid, it, length, value)
    try:
        h = P.decode_header(data, mb, hb)
    except P.ProtocolError:
        return
    assert (h.type, h.length, h.flags, h.worker_id, h.iteration) == (type_, length, flags, wid, it)
    _assert_length_allowed(h, mb, hb)


def test_every_message_type_has_a_length_rule():
    assert set(P.TYPE_NAMES) == set(P.MODEL_TYPES) | set(P._SMALL_LIMITS) | {P.HISTORY}
    assert not set(P.MODEL_TYPES) & set(P._SMALL_LIMITS)
    assert P.HISTORY not in set(P.MODEL_TYPES) | set(P._SMALL_LIMITS)


def _assert_length_allowed(h, mb, hb):
    # Nothing the parser accepts may make a reader allocate beyond the model, its solver history or the
    # small-frame cap.
    if h.type in P.MODEL_TYPES:
        assert mb is not None and h.length == mb
    elif h.type == P.HISTORY:
        assert mb is not None and hb and h.length in (0, hb)
    else:
        assert h.type in P.TYPE_NAMES and h.length <= P.MAX_SMALL_PAYLOAD


@given(st.binary(max_size=300))
@settings(max_examples=500, deadline=None)
def test_fingerprint_parser_never_over_reads(data):
    try:
        count, shapes = P.parse_fingerprint(data)
    except P.ProtocolError:
        return
    assert P.fingerprint(shapes)[12:] == data[12:]


@given(st.lists(st.lists(st.integers(0, 1000), max_size=5), max_size=20))
def test_fingerprint_round_trip(shapes):
    shapes = P.normalize_shapes(shapes)
    assert P.parse_fingerprint(P.fingerprint(shapes)) == (P.shapes_size(shapes), shapes)


@given(st.integers(0, 2 ** 32 - 1), st.text(max_size=2000))
def test_error_frames_are_capped(code, reason):
    frame = P.encode_error(code % 65536, reason)
    h = P.decode_header(frame[:P.HEADER_SIZE])
    assert h.length == len(frame) - P.HEADER_SIZE <= P.MAX_ERROR_BYTES
    assert reason.startswith(P.decode_error(frame[P.HEADER_SIZE:]))


def _handshake(sock, wid):
    nonce = P.new_nonce()
    sock.sendall(P.encode_header(P.HELLO, wid, length=len(nonce)) + nonce)
    challenge = _exact(sock, P.HEADER_SIZE + P.NONCE_SIZE + P.PROOF_SIZE)[P.HEADER_SIZE:]
    fp = bytes([P.CODEC_IDS["float32"]]) + P.fingerprint(P.normalize_shapes(None, N))  # the codec, then the model
    proof = P.client_proof(SECRET, nonce, challenge[:P.NONCE_SIZE], wid, fp)
    sock.sendall(P.encode_header(P.AUTH, wid, length=len(proof) + len(fp)) + proof + fp)
    h = P.decode_header(_exact(sock, P.HEADER_SIZE))
    assert h.type == P.WELCOME


def _exact(sock, n):
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        assert part
        out += part
    return out


def _drain(sock):
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


def test_live_server_survives_fuzzed_frames():
    center = np.linspace(-1, 1, N, dtype=np.float32)
    srv = ExchangeServer(center, SECRET, EasgdHandler(0.5), handshake_timeout=0.5, timeout=0.5).start()
    good = ExchangeClient(srv.address, SECRET, 1)
    before = srv.pull()

    frame = st.builds(
        lambda t, length, wid, tail: P.HEADER.pack(P.MAGIC, P.VERSION, t, 0, wid, 0, length, 0.0) + tail,
        st.integers(0, 255).filter(lambda t: t != P.EXCHANGE),  # a valid EXCHANGE is allowed to move x̃
        st.one_of(st.integers(0, 2 ** 64 - 1), st.sampled_from([0, 32, MODEL_BYTES, MODEL_BYTES + 4])),
        st.sampled_from([0, 2]), st.binary(max_size=300))
    noise = st.binary(min_size=1, max_size=400)

    @given(st.booleans(), st.lists(st.one_of(frame, noise), min_size=1, max_size=3))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def attack(authenticated, frames):
        with socket.create_connection(srv.address, timeout=5) as s:
            if authenticated:
                _handshake(s, 2)
            try:
                s.sendall(b"".join(frames))
            except OSError:
                pass  # the server may already have hung up on the first bad frame
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            _drain(s)
        assert srv.pull().tobytes() == before.tobytes()

    try:
        attack()
        x = np.zeros(N, dtype=np.float32)
        assert good.exchange(x) == "applied"
        np.testing.assert_array_equal(x, np.float32(0.5) * before)
        assert srv.exchanges == 1
    finally:
        good.close()
        srv.stop()
