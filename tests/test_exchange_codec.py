"""The exchanger with coded model frames (float16, bfloat16, int8, int4): the rule, convergence, bytes, and every
bad input refused with the center bit-identical, as with float32."""

import threading

import numpy as np
import pytest

from deepspark.algorithms.easgd import EasgdHandler
from deepspark.exchange import ExchangeClient, ExchangeServer, RefusedError
from deepspark.exchange import codec as C
from deepspark.exchange import protocol as P
from deepspark.algorithms.sync import RoundsHandler

from test_exchange import (N, SECRET, SHAPES, BitFlipper, _exact, bits, error_of, handshake_bytes, least_squares,
                           make_center, raw, read_until_closed, run_worker, wait_for)

CODED = ["float16", "bfloat16", "int8", "int4"]


def coded_server(codec, alpha=0.5, **kwargs):
    return ExchangeServer(make_center(), SECRET, EasgdHandler(alpha, consistent=True), shapes=SHAPES, codec=codec,
                          handshake_timeout=0.5, timeout=10.0, **kwargs).start()


def decoded(codec, values):
    """What `values` become through `codec`, as both ends of a channel compute it."""
    c = C.get(codec)
    payload = memoryview(bytearray(c.payload_bytes(values.size)))
    c.encode(values, payload)
    out = np.empty_like(values)
    c.decode(payload, out)
    return out


@pytest.mark.parametrize("codec", CODED)
def test_one_coded_exchange_is_the_rule_on_what_was_decoded(codec):
    """The server takes x as decoded, moves x̃ by the exact d = α(x̂ − x̃), and the worker subtracts d as decoded."""
    server = coded_server(codec)
    try:
        before = server.pull()
        with ExchangeClient(server.address, SECRET, 1, shapes=SHAPES, codec=codec) as client:
            x = np.random.default_rng(3).standard_normal(N).astype(np.float32)
            sent = x.copy()
            assert client.exchange(x, 1) == "applied"
            x_hat = decoded(codec, sent)  # a new connection's picture of the worker starts at zero
            d = np.subtract(x_hat, before) * np.float32(0.5)
            assert bits(server.pull()) == bits(before + d)  # the center's arithmetic is float32's, exact
            np.testing.assert_array_equal(x, sent - decoded(codec, d))
    finally:
        server.stop()


@pytest.mark.parametrize("codec", CODED)
@pytest.mark.parametrize("workers, overlapped", [(2, False), (2, True)])
def test_coded_easgd_converges_to_the_least_squares_optimum(codec, workers, overlapped):
    x_star, shards = least_squares(workers)
    server = ExchangeServer(np.zeros(x_star.size, np.float32), SECRET, EasgdHandler(0.9 / workers), codec=codec)
    server.start()
    try:
        errors = []
        threads = [threading.Thread(target=run_worker, args=(server.address, w, shards[w], 600, 4, overlapped,
                                                             errors, codec)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert np.linalg.norm(server.pull() - x_star) / np.linalg.norm(x_star) < 1e-2
    finally:
        server.stop()


@pytest.mark.parametrize("codec", CODED)
def test_coded_rounds_average_what_was_decoded(codec):
    server = ExchangeServer(make_center(), SECRET, RoundsHandler(2), shapes=SHAPES, codec=codec).start()
    try:
        xs = [np.full(N, float(w + 1), np.float32) + make_center() for w in range(2)]
        clients = [ExchangeClient(server.address, SECRET, w, shapes=SHAPES, codec=codec) for w in range(2)]
        threads = [threading.Thread(target=c.average, args=(x, 5)) for c, x in zip(clients, xs)]
        expected = (decoded(codec, xs[0]) + decoded(codec, xs[1])) / np.float32(2)
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        center = server.pull()
        np.testing.assert_allclose(center, expected, rtol=1e-6)
        for x in xs:  # each worker's picture of the mean, one rounding away from it
            assert np.abs(x - center).max() <= 0.05 * np.abs(center).max()
        for c in clients:
            c.close()
    finally:
        server.stop()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_coded_frames_send_the_codecs_bytes(codec):
    server = coded_server(codec)
    try:
        with ExchangeClient(server.address, SECRET, 1, shapes=SHAPES, codec=codec) as client:
            x = make_center()
            client.pull(x)
            sent, received = client.sent_bytes, client.received_bytes
            for i in range(5):
                client.exchange(x, i)
            frame = P.HEADER_SIZE + C.get(codec).payload_bytes(N) + P.TAG_SIZE
            assert client.sent_bytes - sent == 5 * frame
            assert client.received_bytes - received == 5 * frame
    finally:
        server.stop()


def test_a_worker_with_another_codec_is_refused_in_one_line():
    server = coded_server("int8")
    try:
        client = ExchangeClient(server.address, SECRET, 3, shapes=SHAPES)  # float32
        with pytest.raises(RefusedError, match="codec mismatch: the server exchanges int8, worker 3 float32"):
            client.exchange(make_center())
    finally:
        server.stop()


# ---- hostile frames and a man in the middle, with every codec ------------------------------------------------

def coded_handshake(sock, codec, wid=9):
    nonce = P.new_nonce()
    sock.sendall(P.encode_header(P.HELLO, wid, length=len(nonce)) + nonce)
    h = P.decode_header(_exact(sock, P.HEADER_SIZE))
    challenge = _exact(sock, h.length)
    bound = bytes([P.CODEC_IDS[codec]]) + P.fingerprint(P.normalize_shapes(SHAPES))
    proof = P.client_proof(SECRET, nonce, challenge[:P.NONCE_SIZE], wid, bound)
    sock.sendall(P.encode_header(P.AUTH, wid, length=len(proof) + len(bound)) + proof + bound)
    h = P.decode_header(_exact(sock, P.HEADER_SIZE))
    assert h.type == P.WELCOME


def hostile_payload(codec):
    """A coded payload of the right length that does not decode to finite floats."""
    c = C.get(codec)
    payload = bytearray(c.payload_bytes(N))
    c.encode(np.ones(N, np.float32), memoryview(payload))
    if codec in ("int8", "int4"):
        payload[0:4] = np.float32(np.nan).tobytes()  # the first block's scale
    else:
        payload[10:12] = (0x7C00 if codec == "float16" else 0x7F80).to_bytes(2, "little")  # +Inf
    return bytes(payload)


@pytest.mark.parametrize("codec", CODED)
def test_a_payload_that_decodes_to_non_finite_floats_is_refused_and_the_center_stays_bit_identical(codec):
    server = coded_server(codec, integrity=False)  # raw frames, untagged: the check is the decoder's, not the tag's
    try:
        before = server.pull()
        with raw(server) as s:
            coded_handshake(s, codec)
            payload = hostile_payload(codec)
            s.sendall(P.encode_header(P.EXCHANGE, 9, iteration=1, length=len(payload)) + payload)
            h = P.decode_header(_exact(s, P.HEADER_SIZE))
            assert h.type == P.ERROR and h.flags == P.E_NONFINITE
            assert "NaN or Inf" in P.decode_error(_exact(s, h.length))
            assert bits(server.pull()) == bits(before)
            # The connection goes on: the worker resets from the center (PULL) and exchanges again.
            s.sendall(P.encode_header(P.PULL, 9))
            h = P.decode_header(_exact(s, P.HEADER_SIZE), 4 * N)
            assert h.type == P.CENTER and bits(np.frombuffer(_exact(s, h.length), np.float32)) == bits(before)
        assert server.stats()[9]["refused_nonfinite"] == 1
    finally:
        server.stop()


@pytest.mark.parametrize("codec", CODED)
def test_a_coded_frame_of_another_length_is_refused(codec):
    server = coded_server(codec, integrity=False)
    try:
        before = server.pull()
        with raw(server) as s:
            coded_handshake(s, codec)
            s.sendall(P.encode_header(P.EXCHANGE, 9, length=4 * N) + b"\0" * 4 * N)  # float32's length
            code, why = error_of(read_until_closed(s))
        assert code == P.E_PROTOCOL and "in the job's codec" in why, why
        wait_for(lambda: server.open_connections == 0)
        assert bits(server.pull()) == bits(before)
    finally:
        server.stop()


def coded_frame_offset(codec, direction):
    """A byte in the middle of the first coded model frame's payload, in `direction`, counted from the start."""
    start = handshake_bytes(direction) + P.HEADER_SIZE
    return start + C.get(codec).payload_bytes(N) // 2


@pytest.mark.parametrize("codec", CODED)
def test_a_bit_flipped_in_a_coded_exchange_is_refused_and_the_center_stays_bit_identical(codec):
    server = coded_server(codec)
    before = server.pull()
    relay = BitFlipper(server.address, "c2s", coded_frame_offset(codec, "c2s"))
    try:
        client = ExchangeClient(relay.address, SECRET, 5, shapes=SHAPES, codec=codec)
        x = np.full(N, 3.0, dtype=np.float32)
        assert client.exchange(x, 1) == "reset"  # refused; it rejoined and took the center
        assert bits(x) == bits(before) and client.reconnects == 1
        assert bits(server.pull()) == bits(before)
        assert any("integrity" in reason for _, reason in server.refused)
        assert client.exchange(x, 2) == "applied"  # the new connection's pictures start over, and agree
        client.close()
    finally:
        relay.close()
        server.stop()


@pytest.mark.parametrize("codec", CODED)
def test_a_bit_flipped_in_a_coded_reply_is_caught_and_the_worker_rejoins_from_the_center(codec):
    server = coded_server(codec)
    relay = BitFlipper(server.address, "s2c", coded_frame_offset(codec, "s2c"))
    try:
        client = ExchangeClient(relay.address, SECRET, 6, shapes=SHAPES, codec=codec)
        x = np.full(N, 3.0, dtype=np.float32)
        assert client.exchange(x, 1) == "reset"
        assert client.reconnects == 1 and bits(x) == bits(server.pull())
        client.close()
    finally:
        relay.close()
        server.stop()

