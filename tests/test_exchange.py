"""ParameterExchanger over real loopback sockets: arithmetic, EASGD convergence, overlap, rejoin, and every bad input."""

import contextlib
import logging
import socket
import threading
import time
import types

import numpy as np
import pytest

from deepspark import rules
from deepspark.algorithms.easgd import Easgd, EasgdHandler
from deepspark.exchange import (ExchangeClient, ExchangeOptions, ExchangeServer, NonFiniteError, OverlappedExchange,
                                RefusedError)
from deepspark.exchange import protocol as P
from deepspark.exchange.transport import PIPELINE_BYTES, RECV_SLICE, SLICE_FLOATS, Connection, slice_floats
from deepspark.proto import deepspark_pb2 as pb

import reference

SECRET = b"per-job-secret"
N = 1000
SHAPES = ((10, 10), (900,))


def make_center(n=N):
    return np.linspace(-1.0, 1.0, n, dtype=np.float32)


@pytest.fixture
def server():
    srv = ExchangeServer(make_center(), SECRET, EasgdHandler(0.5, consistent=True, chunk=64), shapes=SHAPES,
                         handshake_timeout=0.3, timeout=10.0).start()
    yield srv
    srv.stop()


@pytest.fixture
def good(server):
    """A well-behaved worker, connected before any misbehaviour starts."""
    client = ExchangeClient(server.address, SECRET, 1, shapes=SHAPES, timeout=10.0)
    client.connect()
    yield client
    client.close()


def bits(a):
    return a.view(np.uint32).tobytes()


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def still_serves(server, good, before):
    """The center is bit-identical, and a well-behaved worker still exchanges."""
    wait_for(lambda: server.open_connections <= 1)  # only `good` is left
    assert bits(server.pull()) == bits(before)
    x = np.zeros(N, dtype=np.float32)
    assert good.exchange(x) == "applied"
    np.testing.assert_array_equal(x, np.float32(0.5) * before)  # x − α(x − x̃) with x = 0
    assert bits(server.pull()) != bits(before)


def raw(server):
    return socket.create_connection(server.address, timeout=5.0)


def read_until_closed(sock):
    chunks = []
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    except (ConnectionResetError, socket.timeout):
        pass
    return b"".join(chunks)


def error_of(data):
    """(code, reason) of the ERROR frame at the start of `data`."""
    h = P.decode_header(data[:P.HEADER_SIZE])
    assert h.type == P.ERROR
    return h.flags, P.decode_error(data[P.HEADER_SIZE:P.HEADER_SIZE + h.length])


def handshake(sock, wid=9, secret=SECRET, shapes=SHAPES):
    """The client side of the handshake by hand; returns the server's final header and payload."""
    nonce = P.new_nonce()
    sock.sendall(P.encode_header(P.HELLO, wid, length=len(nonce)) + nonce)
    h = P.decode_header(_exact(sock, P.HEADER_SIZE))
    challenge = _exact(sock, h.length)
    fp = bytes([P.CODEC_IDS["float32"]]) + P.fingerprint(P.normalize_shapes(shapes))  # the codec, then the model
    proof = P.client_proof(P.as_secret(secret), nonce, challenge[:P.NONCE_SIZE], wid, fp)
    sock.sendall(P.encode_header(P.AUTH, wid, length=len(proof) + len(fp)) + proof + fp)
    h = P.decode_header(_exact(sock, P.HEADER_SIZE))
    return h, _exact(sock, h.length)


def _exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        assert k, "closed early"
        got += k
    return bytes(buf)


# ---- arithmetic and API ------------------------------------------------------

@pytest.mark.parametrize("consistent", [True, False])
def test_exchange_arithmetic_is_the_rule(consistent):
    center = make_center()
    with ExchangeServer(center, SECRET, EasgdHandler(0.25, consistent=consistent, chunk=7)) as srv:
        host, port = srv.address
        x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
        x_rule, c_rule = x.copy(), center.copy()
        reference.easgd_step(x_rule, c_rule, 0.25)
        with ExchangeClient("%s:%d" % (host, port), SECRET, 0, chunk=5) as client:
            assert client.exchange(x, iteration=3, loss=0.5) == "applied"
            assert bits(x) == bits(x_rule)
            # Lock-free, the server may still be adding d to x̃ after replying.
            wait_for(lambda: bits(srv.pull()) == bits(c_rule))
            assert bits(client.pull()) == bits(c_rule)
        assert srv.exchanges == 1


@pytest.mark.parametrize("consistent", [True, False])
def test_default_slicing_of_a_model_bigger_than_one_slice(consistent):
    # Default slices (no chunk=): when x arrives over several reads the server computes
    # slices while it is still arriving and the rest whole (on loopback either may happen). The result is the rule, bit for
    # bit, and a NaN or Inf in any slice — the first, or the last one to arrive — still
    # leaves x̃ bit-identical, though earlier slices of d were already computed.
    n = 3 * RECV_SLICE + 1234
    assert slice_floats(n) == (RECV_SLICE, n)
    center = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    with ExchangeServer(center, SECRET, EasgdHandler(0.25, consistent=consistent)) as srv:
        with ExchangeClient(srv.address, SECRET, 0, on_nonfinite="raise") as client:
            x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
            x_rule, c_rule = x.copy(), center.copy()
            reference.easgd_step(x_rule, c_rule, 0.25)
            assert client.exchange(x) == "applied"
            assert bits(x) == bits(x_rule)
            wait_for(lambda: bits(srv.pull()) == bits(c_rule))
            for where, bad in ((0, np.nan), (n - 1, np.inf), (RECV_SLICE + 5, -np.inf)):
                y = x.copy()
                y[where] = bad
                before = srv.pull()
                with pytest.raises(NonFiniteError):
                    client.exchange(y)
                assert bits(srv.pull()) == bits(before)
            assert srv.exchanges == 1


def test_slices_follow_chunk_and_size():
    assert slice_floats(10) == (10, 10)
    assert slice_floats(10 ** 6, chunk=7) == (7, 7)
    big = PIPELINE_BYTES // 4 + 1
    assert slice_floats(big) == (SLICE_FLOATS, SLICE_FLOATS)


def test_server_factor_and_moving_rate_decay():
    center = np.zeros(4, dtype=np.float32)
    srv = ExchangeServer(center, SECRET, EasgdHandler(0.5, server_factor=0.5, consistent=True,
                                                      moving_rate_gamma=0.5, moving_rate_step=1, moving_rate_limit=0.25)).start()
    try:
        with ExchangeClient(srv.address, SECRET, 0) as client:
            x = np.full(4, 8.0, dtype=np.float32)
            client.exchange(x)               # α = 0.5: d = 4
            np.testing.assert_array_equal(x, np.full(4, 4.0))
            np.testing.assert_array_equal(srv.pull(), np.full(4, 2.0))  # x̃ += 0.5·d
            assert srv.handler.moving_rate == 0.25
            client.exchange(x)               # α = 0.25: d = 0.25·(4 − 2)
            np.testing.assert_array_equal(x, np.full(4, 3.5))
            client.exchange(x)               # floor 0.25: α stays 0.25
            assert srv.handler.moving_rate == 0.25
    finally:
        srv.stop()


def test_rate_weighting_pulls_a_worker_at_a_tenth_of_the_others_rate_to_the_center_and_moves_the_center_little():
    """rate_weighted (the schema's default for a job): the fastest worker exchanges by the paper's rule; one training
    at a tenth of its rate takes min(1, α / 0.1) = all of the center's pull, and moves the center by α·0.1 of x − x̃."""
    center = np.zeros(N, dtype=np.float32)
    handler = EasgdHandler(0.2, rate_weighted=True, consistent=True)
    with ExchangeServer(center, SECRET, handler) as srv, ExchangeClient(srv.address, SECRET, 0) as fast, \
            ExchangeClient(srv.address, SECRET, 1) as slow:
        for k in range(1, 4):  # 100 iterations a round for worker 0, 10 for worker 1
            fast.exchange(np.zeros(N, dtype=np.float32), iteration=100 * k)
            slow.exchange(np.zeros(N, dtype=np.float32), iteration=10 * k)
            time.sleep(0.2)
        c = srv.pull()
        x = c + np.float32(10.0)
        slow.exchange(x, iteration=40)
        np.testing.assert_allclose(x, c, atol=1e-4)  # pull 1: the slow worker takes the center
        moved = srv.pull() - c
        assert 0.0 < moved.min() <= moved.max() < 1.0, moved[:4]  # α·s·10 with s ~0.1; the paper's rule: 2
        c = srv.pull()
        x = c + np.float32(10.0)
        fast.exchange(x, iteration=400)
        np.testing.assert_allclose(x, c + np.float32(8.0), rtol=1e-6)  # share 1: d = α(x − x̃) = 2
        np.testing.assert_allclose(srv.pull(), c + np.float32(2.0), rtol=1e-6)
    assert not EasgdHandler(0.2).rates and EasgdHandler.of(ExchangeOptions.of()).rates is not None


@pytest.mark.parametrize("consistent", [True, False])
def test_a_straggler_is_sent_to_the_center_and_the_center_takes_the_gain_of_its_progress_since_it_was_handed(
        consistent):
    """straggler_share (the schema's 0.9, with rate_weighted): a worker at a tenth of the fastest rate exchanges by
    its progress. Each exchange hands it the center h (pull 1), and the next moves the center by
    straggler_gain·(x − h), in slices (chunk) and lock-free too; the fastest worker keeps the paper's rule, and a
    straggler that catches up leaves nothing kept."""
    center = np.zeros(N, dtype=np.float32)
    handler = EasgdHandler(0.2, rate_weighted=True, straggler_share=0.9, straggler_gain=0.5, consistent=consistent,
                           chunk=64)
    with ExchangeServer(center, SECRET, handler) as srv, ExchangeClient(srv.address, SECRET, 0) as fast, \
            ExchangeClient(srv.address, SECRET, 1) as slow:
        handed = np.zeros(N, dtype=np.float32)
        for k in range(1, 4):  # 100 iterations a round for worker 0, 10 for worker 1
            fast.exchange(np.full(N, k, dtype=np.float32), iteration=100 * k)
            slow.exchange(handed, iteration=10 * k)  # from its second on, a straggler: handed the center
            time.sleep(0.2)
        assert len(handler.progress) == 1
        wait_for(lambda: bits(srv.pull()) == bits(srv.pull()))  # lock-free: the last add is in
        c = srv.pull()
        x = handed + np.float32(10.0)  # the slow worker holds h (the center it was handed), and trained 10 since
        slow.exchange(x, iteration=40)
        np.testing.assert_allclose(x, c, rtol=0, atol=1e-5)  # pull 1: it takes the center as read
        wait_for(lambda: np.allclose(srv.pull(), c + np.float32(5.0), rtol=0, atol=1e-5))  # x̃ += 0.5·(x − h)
        c = srv.pull()
        x = c + np.float32(10.0)
        fast.exchange(x, iteration=400)
        np.testing.assert_allclose(x, c + np.float32(8.0), rtol=1e-6)  # share 1: d = α(x − x̃) = 2
        wait_for(lambda: np.allclose(srv.pull(), c + np.float32(2.0), rtol=1e-6))
        time.sleep(0.2)
        slow.exchange(srv.pull(), iteration=40 + 2000)  # 2,000 iterations in 0.2 s: no straggler now
        assert len(handler.progress) == 0
        slow.close()  # its rate goes with it: a replacement's is its own
        wait_for(lambda: 1 not in handler.rates.seen and 0 in handler.rates.seen)
        # What is kept of a straggler is its connection's: afresh for a new one, and gone when the worker leaves.
        ends = [socket.socketpair() for _ in range(2)]
        conn, again = (Connection(ours, "127.0.0.1:7", 7) for ours, _ in ends)
        kept = handler.straggler(conn, 0.1)
        assert handler.straggler(conn, 0.1) is kept and kept.h.size == N
        assert handler.straggler(again, 0.1) is not kept
        handler.left(7)
        assert 7 not in handler.progress
        for pair in ends:
            for end in pair:
                end.close()
    assert EasgdHandler.of(ExchangeOptions.of()).straggler_share == pytest.approx(0.9)
    with pytest.raises(ValueError, match="straggler_gain"):
        EasgdHandler(0.2, straggler_gain=0.0)
    said = Easgd().listening(types.SimpleNamespace(workers=2, ds=pb.DeepSparkParameter()))  # the job's line
    assert said.endswith("rate; under 0.9 of it, the center takes 0.5 of a worker's progress"), said
    assert Easgd().listening(types.SimpleNamespace(workers=2, ds=pb.DeepSparkParameter(straggler_share=0))).endswith(
        "share of the fastest one's rate")


@pytest.mark.parametrize("consistent", [True, False])
def test_moving_rate_decays_to_its_floor_and_the_center_moves_by_it(consistent):
    # α·γ^⌊k/step⌋ never below the floor (the proto's moving_rate_gamma / _step / _limit):
    # 0.8, 0.8, 0.4, 0.4, 0.2, 0.2, then the floor 0.15 where 0.1 would come.
    alpha, gamma, step, floor = 0.8, 0.5, 2, 0.15
    rng = np.random.default_rng(3)
    center = rng.standard_normal(N).astype(np.float32)
    handler = EasgdHandler(alpha, moving_rate_gamma=gamma, moving_rate_step=step, moving_rate_limit=floor,
                           consistent=consistent)
    with ExchangeServer(center, SECRET, handler) as srv, ExchangeClient(srv.address, SECRET, 0) as client:
        c_rule = center.copy()
        for k in range(9):
            rate = max(alpha * gamma ** (k // step), floor)
            assert srv.handler.moving_rate == rate
            x = rng.standard_normal(N).astype(np.float32)
            x_rule = x.copy()
            reference.easgd_step(x_rule, c_rule, rate)
            assert client.exchange(x) == "applied"
            assert bits(x) == bits(x_rule)
            wait_for(lambda: bits(srv.pull()) == bits(c_rule))  # lock-free: the add may follow the reply
        assert srv.exchanges == 9 and srv.handler.moving_rate == floor


def test_stats_per_worker(server, good):
    x = np.zeros(N, dtype=np.float32)
    began = time.time()
    good.exchange(x, iteration=40, loss=1.5)
    good.report(41, 1.25)
    wait_for(lambda: server.stats()[1]["iteration"] == 41)
    s = server.stats()[1]
    assert s["exchanges"] == 1 and s["loss"] == 1.25 and s["connected"]
    assert 0 < s["latency"] < 10  # header in to reply out, seconds
    assert 0 <= s["seconds_since_contact"] <= s["seconds_since_exchange"]
    good.exchange(x, iteration=50, loss=1.0)
    good.close()
    wait_for(lambda: not server.stats()[1]["connected"])
    # When each connection that exchanged first did (the driver's clock): one time for this one's two exchanges; a
    # second connection that exchanges adds its own, one that does not adds none.
    (first,) = server.stats()[1]["trained_at"]
    assert began <= first <= time.time()
    for exchanges in (1, 0):
        with ExchangeClient(server.address, SECRET, 1, shapes=SHAPES, timeout=10.0) as again:
            again.connect()
            for _ in range(exchanges):
                again.exchange(x, iteration=60, loss=1.0)
        wait_for(lambda: not server.stats()[1]["connected"])
    trained = server.stats()[1]["trained_at"]
    assert len(trained) == 2 and trained[0] == first < trained[1] and server.stats()[1]["connections"] == 3


def test_overlapped_exchange_applies_difference_of_the_snapshot(server):
    center = server.pull()
    with ExchangeClient(server.address, SECRET, 2, shapes=SHAPES) as client:
        params = np.ones(N, dtype=np.float32)
        snapshot = params.copy()
        client.exchange_async(params, iteration=1)
        assert client.pending
        params += 1.0  # the backend keeps computing t+1, t+2, ...
        params += 1.0
        deadline = time.monotonic() + 5
        while not client.poll(params):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        d = np.float32(0.5) * (snapshot - center)
        np.testing.assert_array_equal(params, snapshot + 2.0 - d)
        np.testing.assert_array_equal(server.pull(), center + d)
        # wait() with nothing in flight is a no-op; a second round uses wait().
        assert not client.wait(params)
        client.exchange_async(params)
        assert client.wait(params)
        assert client.exchanges == 2


class Worker:
    """A worker's parameters outside the exchange (as a backend holds them), read and written as OverlappedExchange
    reads and writes a model's."""

    def __init__(self, values):
        self.values = values.copy()
        self.reads = self.writes = 0

    def read(self, out):
        self.reads += 1
        np.copyto(out, self.values)
        return out

    def write(self, params):
        self.writes += 1
        np.copyto(self.values, params)


@pytest.mark.parametrize("overlap", [True, False])
def test_overlapped_exchange_start_poll_finish(server, overlap):
    """start() sends the snapshot and returns (the worker steps on); poll() applies d = α(snapshot − x̃) to the
    current parameters once it is back; a second start() applies the first first, so that its snapshot holds it;
    `before` runs with nothing in flight; finish() applies what is in flight and sends the final state."""
    center = server.pull()
    alpha = np.float32(0.5)
    with ExchangeClient(server.address, SECRET, 2, shapes=SHAPES) as client:
        worker = Worker(np.ones(N, np.float32))
        exchange = OverlappedExchange(client, worker.read, worker.write, np.empty(N, np.float32), overlap=overlap)
        assert not exchange.poll()  # nothing in flight
        in_flight = []
        exchange.start(1, 0.5, before=lambda: in_flight.append(client.pending))
        snapshot = np.ones(N, np.float32)
        d = alpha * (snapshot - center)
        center = center + d
        worker.values += 1.0  # the backend's next steps
        if overlap:
            wait_for(lambda: client.ready)
            assert exchange.poll() and not client.pending
        np.testing.assert_array_equal(worker.values, snapshot + 1.0 - d)
        np.testing.assert_array_equal(server.pull(), center)
        snapshot = worker.values.copy()
        exchange.start(2, 0.5, before=lambda: in_flight.append(client.pending))
        d = alpha * (snapshot - center)
        center = center + d
        worker.values += 1.0
        final = worker.values.copy()
        if overlap:
            final -= d  # finish applies the second difference before the final exchange
        exchange.finish(3, 0.5, before=lambda: in_flight.append(client.pending))
        d_final = alpha * (final - center)
        np.testing.assert_array_equal(server.pull(), center + d_final)
        assert in_flight == [False, False, False] and client.exchanges == 3
        assert client.blocked_seconds > 0


def test_exchange_options_come_from_the_schema():
    """One value of the exchanger's knobs, read from DeepSparkParameter: the schema's defaults, a job's own
    values, changes over them; the server and the client take theirs from it."""
    defaults = pb.DeepSparkParameter()
    options = ExchangeOptions.of()
    assert (options.codec.name, options.integrity, options.timeout) == \
        ("float32", defaults.exchange_integrity, defaults.exchange_timeout)
    assert options.moving_rate == defaults.moving_rate and options.server_factor == defaults.server_factor
    ds = pb.DeepSparkParameter(exchange_codec=pb.DeepSparkParameter.INT8, exchange_integrity=False,
                               exchange_timeout=7.0, moving_rate=0.25, moving_rate_step=3)
    options = ExchangeOptions.of(ds, timeout=9.0)
    assert (options.codec.name, options.integrity, options.timeout, options.moving_rate_step) == ("int8", False, 9.0, 3)
    assert options.but(codec="float16").codec.name == "float16" and options.but() is options
    with pytest.raises(ValueError, match="unknown exchange codec"):
        ExchangeOptions.of(codec="float8")
    with pytest.raises(TypeError):
        ExchangeOptions.of(idle_timeout=3.0)
    handler = EasgdHandler.of(options)
    assert handler.base_moving_rate == 0.25 and handler.decay == (1.0, 3, 0.0)
    with ExchangeServer(make_center(), SECRET, handler, options=options, shapes=SHAPES) as srv:
        assert (srv.idle_timeout, srv.integrity, srv.codec.name) == (9.0, False, "int8")
        client = ExchangeClient(srv.address, SECRET, 0, options=options, shapes=SHAPES)
        assert (client.timeout, client.integrity, client.codec.name) == (9.0, False, "int8")
        with client:
            x = np.zeros(N, np.float32)
            client.exchange(x)  # the same options on both ends: they speak
            assert client.exchanges == 1


def test_params_must_be_flat_float32(server):
    with ExchangeClient(server.address, SECRET, 3, shapes=SHAPES) as client:
        with pytest.raises(TypeError):
            client.exchange(np.zeros(N, dtype=np.float64))
        with pytest.raises(ValueError):
            client.exchange(np.zeros(N + 1, dtype=np.float32))


# ---- convergence ---------------------------------------------------------------

def least_squares(p, dim=8, rows=100, seed=1):
    rng = np.random.default_rng(seed)
    x_star = rng.standard_normal(dim).astype(np.float32)
    shards = []
    for _ in range(p):
        a = rng.standard_normal((rows, dim)).astype(np.float32)
        shards.append((a, a @ x_star))  # zero residual: every shard's optimum is x*
    return x_star, shards


def run_worker(address, wid, shard, iterations, period, overlapped, errors, codec="float32"):
    try:
        a, b = shard
        rng = np.random.default_rng(100 + wid)
        schedule = rules.ExchangeSchedule(period)
        with ExchangeClient(address, SECRET, wid, codec=codec) as client:
            x = np.zeros(a.shape[1], dtype=np.float32)
            client.pull(x)
            for it in range(iterations):
                rows = rng.integers(0, len(a), 10)
                r = a[rows] @ x - b[rows]
                x -= np.float32(0.05) * (a[rows].T @ r) / 10
                if overlapped:
                    client.poll(x)
                if schedule.step(float(r @ r)):
                    if overlapped:
                        client.exchange_async(x, iteration=it)
                    else:
                        client.exchange(x, iteration=it)
            client.wait(x)
    except BaseException as e:  # surfaced by the test thread
        errors.append(e)


@pytest.mark.parametrize("workers, overlapped", [(2, False), (4, True)])
def test_async_easgd_center_converges_to_least_squares_optimum(workers, overlapped):
    x_star, shards = least_squares(workers)
    srv = ExchangeServer(np.zeros(x_star.size, dtype=np.float32), SECRET, EasgdHandler(0.9 / workers)).start()
    try:
        errors = []
        threads = [threading.Thread(target=run_worker,
                                    args=(srv.address, w, shards[w], 600, 4, overlapped, errors))
                   for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert srv.exchanges == workers * 150
        center = srv.pull()
        assert np.linalg.norm(center - x_star) / np.linalg.norm(x_star) < 1e-3
        assert set(srv.stats()) == set(range(workers))
    finally:
        srv.stop()


# ---- handshake refusals ----------------------------------------------------------

def test_wrong_secret_is_refused_and_logged(server, good, caplog):
    before = server.pull()
    caplog.set_level(logging.WARNING, logger="deepspark.exchange")
    intruder = ExchangeClient(server.address, b"not-the-secret", 5, shapes=SHAPES, retries=1)
    with pytest.raises(RefusedError) as err:
        intruder.exchange(np.zeros(N, dtype=np.float32))
    assert err.value.code == P.E_AUTH
    assert "secret" in str(err.value)
    intruder.close()
    assert any("authentication" in r.getMessage() for r in caplog.records)
    still_serves(server, good, before)


def test_stranger_with_a_forged_proof_is_refused(server, good):
    before = server.pull()
    with raw(server) as s:
        h, payload = handshake(s, secret=b"guess")
        assert h.type == P.ERROR and h.flags == P.E_AUTH
        assert "does not hold this job's secret" in P.decode_error(payload)
    still_serves(server, good, before)


def test_client_refuses_a_server_without_the_secret(good, server):
    other = ExchangeServer(make_center(), b"another-job", EasgdHandler(0.5), shapes=SHAPES).start()
    try:
        client = ExchangeClient(other.address, SECRET, 4, shapes=SHAPES, retries=1)
        with pytest.raises(RefusedError) as err:
            client.connect()
        assert err.value.code == P.E_AUTH
        client.close()
    finally:
        other.stop()


@pytest.mark.parametrize("shapes", [((10, 10), (899,), (1,)), ((100, 10),), ((N,),)])
def test_worker_built_from_a_different_net_is_refused(server, good, shapes):
    before = server.pull()
    size = P.shapes_size(shapes)
    client = ExchangeClient(server.address, SECRET, 6, shapes=shapes, retries=1)
    with pytest.raises(RefusedError) as err:
        client.exchange(np.zeros(size, dtype=np.float32))
    assert err.value.code == P.E_FINGERPRINT
    assert "model mismatch" in err.value.reason and "1000 parameters in 2 blobs" in err.value.reason
    client.close()
    still_serves(server, good, before)


# ---- bad input before the handshake ------------------------------------------------

@pytest.mark.parametrize("junk, reason", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 20, "bad magic"),
    (P.encode_header(P.EXCHANGE, 1, length=4 * N), "before the handshake"),
    (P.encode_header(P.HELLO, 1, length=2 ** 62), "HELLO payload"),
    (P.encode_header(P.AUTH, 1, length=2 ** 40), "AUTH payload"),
    (P.encode_header(P.PULL, 1), "expected HELLO"),
    (P.HEADER.pack(P.MAGIC, 99, P.HELLO, 0, 1, 0, 32, 0.0), "protocol version"),
])
def test_garbage_before_the_handshake(server, good, junk, reason):
    before = server.pull()
    with raw(server) as s:
        s.sendall(junk)
        code, why = error_of(read_until_closed(s))
    assert code == P.E_PROTOCOL and reason in why
    still_serves(server, good, before)


def test_silent_peer_is_dropped_after_the_handshake_timeout(server, good):
    before = server.pull()
    with raw(server) as s:
        code, why = error_of(read_until_closed(s))  # we say nothing at all
    assert code == P.E_TIMEOUT and "silent" in why
    still_serves(server, good, before)


def _exchange_header(length=4 * N, wid=9, type_=P.EXCHANGE):
    return P.HEADER.pack(P.MAGIC, P.VERSION, type_, 0, wid, 1, length, 0.0)


@pytest.mark.parametrize("frame, reason", [
    (_exchange_header(4 * N - 4) + b"\0" * (4 * N - 4), "needs exactly 4000"),
    (_exchange_header(2 ** 63), "needs exactly 4000"),
    (_exchange_header(2 ** 40, type_=P.ERROR), "ERROR payload"),
    (_exchange_header(0, type_=99), "unknown message type 99"),
    (_exchange_header(4 * N, type_=P.DIFF) + b"\0" * 4 * N, "unexpected DIFF"),
    (_exchange_header(4 * N, wid=1) + b"\0" * 4 * N, "on worker 9's connection"),
    (b"\xde\xad\xbe\xef" * 9, "bad magic"),
])
def test_bad_frames_from_an_authenticated_worker(server, good, frame, reason):
    before = server.pull()
    with raw(server) as s:
        h, _ = handshake(s)
        assert h.type == P.WELCOME
        s.sendall(frame)
        code, why = error_of(read_until_closed(s))
    assert code == P.E_PROTOCOL and reason in why, why
    still_serves(server, good, before)


@pytest.mark.parametrize("cut", ["header", "payload"])
def test_peer_that_disconnects_mid_frame(server, good, cut):
    before = server.pull()
    with raw(server) as s:
        handshake(s)
        frame = _exchange_header() + np.ones(N, dtype=np.float32).tobytes()
        s.sendall(frame[:20] if cut == "header" else frame[:P.HEADER_SIZE + 2001])
    still_serves(server, good, before)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_payload_is_refused_and_the_worker_told(server, good, bad):
    before = server.pull()
    x = np.ones(N, dtype=np.float32)
    x[N - 1] = bad  # the very last value: refused after the whole frame was read
    strict = ExchangeClient(server.address, SECRET, 7, shapes=SHAPES, on_nonfinite="raise")
    with pytest.raises(NonFiniteError):
        strict.exchange(x.copy())
    assert bits(server.pull()) == bits(before)
    # Default: the worker resets from the center, on the same connection.
    resetting = ExchangeClient(server.address, SECRET, 8, shapes=SHAPES)
    assert resetting.exchange(x) == "reset"
    assert bits(x) == bits(before)
    assert resetting.resets == 1 and resetting.reconnects == 0
    assert server.stats()[8]["refused_nonfinite"] == 1
    # Both connections are still usable.
    y = before.copy()
    assert strict.exchange(y) == "applied"
    np.testing.assert_array_equal(y, before)  # x = x̃ gives d = 0
    strict.close()
    resetting.close()
    still_serves(server, good, before)


def test_worker_dropped_for_idling_rejoins_and_resumes_from_the_center():
    srv = ExchangeServer(make_center(), SECRET, EasgdHandler(0.5, consistent=True), timeout=0.3).start()
    try:
        client = ExchangeClient(srv.address, SECRET, 3, backoff=0.01)
        x = np.zeros(N, dtype=np.float32)
        assert client.exchange(x) == "applied"
        wait_for(lambda: srv.open_connections == 0)  # the server gave up on us
        x += 5.0
        assert client.exchange(x) == "reset"
        assert bits(x) == bits(srv.pull())
        assert client.reconnects == 1
        assert client.exchange(x) == "applied"
        assert srv.stats()[3]["connections"] == 2
        client.close()
    finally:
        srv.stop()


def test_client_retries_until_the_server_is_up():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    client = ExchangeClient(("127.0.0.1", port), SECRET, 0, retries=40, backoff=0.01, max_backoff=0.05)
    started = []

    def late_start():
        time.sleep(0.2)
        started.append(ExchangeServer(make_center(), SECRET, EasgdHandler(0.5), port=port).start())

    t = threading.Thread(target=late_start)
    t.start()
    try:
        x = np.zeros(N, dtype=np.float32)
        assert client.exchange(x) == "applied"
    finally:
        t.join()
        client.close()
        for s in started:
            s.stop()


def test_unreachable_server_gives_a_clear_error():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    client = ExchangeClient(("127.0.0.1", port), SECRET, 0, retries=2, backoff=0.01)
    with pytest.raises(ConnectionError, match="could not reach the exchange server"):
        client.exchange(np.zeros(3, dtype=np.float32))


def test_rejoining_worker_is_told_its_last_iteration_and_new_ones_the_resume_point():
    center = np.zeros(8, np.float32)
    with ExchangeServer(center, "s3cret", EasgdHandler(0.5), resume_iteration=300) as server:
        first = ExchangeClient(server.address, "s3cret", 0)
        first.connect(8)
        assert first.resume_iteration == 300
        first.exchange(np.ones(8, np.float32), iteration=420)
        first.close()
        again = ExchangeClient(server.address, "s3cret", 0)
        again.connect(8)
        assert again.resume_iteration == 420
        other = ExchangeClient(server.address, "s3cret", 1)
        other.connect(8)
        assert other.resume_iteration == 300
        stats = server.stats()  # what the driver reports a rejoin with
        assert (stats[0]["connections"], stats[0]["joined_at"]) == (2, 420)
        assert (stats[1]["connections"], stats[1]["joined_at"]) == (1, 300)
        again.close()
        other.close()


def test_ready_says_when_an_overlapped_result_has_arrived():
    with ExchangeServer(np.zeros(4, np.float32), "k", EasgdHandler(0.5)) as server:
        client = ExchangeClient(server.address, "k", 0)
        params = np.ones(4, np.float32)
        assert not client.ready
        client.exchange_async(params, iteration=1)
        deadline = time.monotonic() + 10
        while not client.ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.ready and client.poll(params) and not client.ready
        assert np.allclose(params, 0.5)
        client.close()


# ---- a man in the middle on loopback -----------------------------------------------------------

class BitFlipper:
    """A TCP relay between a client and the server that flips one bit of the first connection's stream
    in one direction, at byte `offset` of that direction (a man in the middle who rewrites a frame)."""

    def __init__(self, target, direction, offset):
        self.target, self.direction, self.offset = target, direction, offset
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            far = socket.create_connection(self.target)
            first = self.connections == 0
            self.connections += 1
            for src, dst, way in ((near, far, "c2s"), (far, near, "s2c")):
                flip = self.offset if first and way == self.direction else None
                threading.Thread(target=self._relay, args=(src, dst, flip), daemon=True).start()

    @staticmethod
    def _relay(src, dst, flip):
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if flip is not None and seen <= flip < seen + len(data):
                    data = bytearray(data)
                    data[flip - seen] ^= 0x10
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self):
        self.listener.close()


def handshake_bytes(direction):
    """Bytes a client sends (c2s) or receives (s2c) in the handshake, before its first sealed frame."""
    fingerprint = P.fingerprint(P.normalize_shapes(SHAPES))
    if direction == "c2s":  # HELLO, AUTH (its proof, the codec's id, the fingerprint)
        return 2 * P.HEADER_SIZE + P.NONCE_SIZE + P.PROOF_SIZE + 1 + len(fingerprint)
    return 2 * P.HEADER_SIZE + P.NONCE_SIZE + P.PROOF_SIZE  # CHALLENGE, WELCOME


@pytest.mark.parametrize("consistent", [True, False], ids=["locked", "lock-free"])
def test_a_bit_flipped_in_an_exchange_frame_is_refused_and_the_center_stays_bit_identical(consistent):
    # Lock-free (the default) computes d slice by slice as x arrives, and checks the tag once x is in.
    server = ExchangeServer(make_center(), SECRET, EasgdHandler(0.5, consistent=consistent), shapes=SHAPES).start()
    before = server.pull()
    # A bit in the middle of the first EXCHANGE frame's payload, after the handshake.
    relay = BitFlipper(server.address, "c2s", handshake_bytes("c2s") + P.HEADER_SIZE + 2 * N)
    try:
        client = ExchangeClient(relay.address, SECRET, 5, shapes=SHAPES)
        x = np.full(N, 3.0, dtype=np.float32)
        assert client.exchange(x, 1) == "reset"  # refused; it rejoined and took the center
        assert bits(x) == bits(before) and client.reconnects == 1
        assert bits(server.pull()) == bits(before)  # the tampered frame moved nothing
        assert any("integrity" in reason for _, reason in server.refused)
        assert client.exchange(x, 2) == "applied"  # the new connection is not tampered with
        client.close()
    finally:
        relay.close()
        server.stop()


def test_a_bit_flipped_in_a_reply_is_caught_by_the_worker_which_rejoins_from_the_center(server):
    relay = BitFlipper(server.address, "s2c", handshake_bytes("s2c") + P.HEADER_SIZE + 2 * N)
    try:
        client = ExchangeClient(relay.address, SECRET, 6, shapes=SHAPES)
        x = np.full(N, 3.0, dtype=np.float32)
        assert client.exchange(x, 1) == "reset"  # its d failed the check: x is the center, not x - bad d
        assert client.reconnects == 1 and bits(x) == bits(server.pull())
        client.close()
    finally:
        relay.close()


def test_a_frame_replayed_on_its_connection_does_not_verify():
    sealer, again = P.Sealer(b"k" * 32), P.Sealer(b"k" * 32)
    header = P.encode_header(P.REPORT, 1, iteration=3)
    first = sealer.begin(header).digest()
    assert again.begin(header).digest() == first  # the same frame, the same place: the same tag
    assert sealer.begin(header).digest() != first  # the same frame once more: the next sequence number
