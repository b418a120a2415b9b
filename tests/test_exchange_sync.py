"""The exchanger's synchronous mode (the `sync` baseline): rounds of N workers get their exact mean; no round hangs."""

import socket
import threading
import time

import numpy as np
import pytest

from deepspark import rules
from deepspark.algorithms.easgd import EasgdHandler
from deepspark.algorithms.sync import RoundsHandler
from deepspark.exchange import ExchangeClient, ExchangeServer, RefusedError
from deepspark.exchange import protocol as P

SECRET = b"per-job-secret"
N = 1000
SHAPES = ((10, 10), (900,))


def make_server(workers, round_timeout=10.0, **options):
    center = np.linspace(-1.0, 1.0, N, dtype=np.float32)
    return ExchangeServer(center, SECRET, RoundsHandler(workers, round_timeout=round_timeout), shapes=SHAPES,
                          timeout=10.0, **options).start()


def client(server, wid, timeout=10.0):
    return ExchangeClient(server.address, SECRET, wid, shapes=SHAPES, timeout=timeout).connect()


def in_threads(functions):
    """Run the functions at once; their results, or the exceptions they raised."""
    results = [None] * len(functions)

    def call(i, f):
        try:
            results[i] = f()
        except BaseException as error:  # handed back to the test
            results[i] = error

    threads = [threading.Thread(target=call, args=(i, f)) for i, f in enumerate(functions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


@pytest.mark.parametrize("workers", [2, 3])
def test_every_worker_gets_the_exact_mean_of_the_round(workers):
    rng = np.random.default_rng(0)
    with make_server(workers) as server:
        clients = [client(server, wid) for wid in range(workers)]
        for iteration in range(1, 6):
            sent = [rng.standard_normal(N).astype(np.float32) for _ in clients]
            params = [x.copy() for x in sent]
            in_threads([lambda c=c, p=p: c.average(p, iteration, 0.5) for c, p in zip(clients, params)])
            mean = rules.average_models(sent)  # worker-id order, as the server sums
            for p in params:
                assert p.tobytes() == mean.tobytes()  # identical on every worker, bit for bit
            assert server.pull().tobytes() == mean.tobytes()
            assert server.handler.rounds == iteration
        stats = server.stats()
        assert all(stats[w]["exchanges"] == 5 and stats[w]["iteration"] == 5 for w in range(workers))
        for c in clients:
            c.close()


def test_a_missing_worker_fails_the_round_after_the_timeout_with_a_message():
    with make_server(2, round_timeout=0.5) as server:
        lonely = client(server, 0)
        started = time.monotonic()
        with pytest.raises(RefusedError, match=r"round of iteration 7: 1 of 2 workers \(0\) arrived within 0.5s"):
            lonely.average(np.zeros(N, np.float32), 7)
        assert time.monotonic() - started < 5


def test_a_worker_that_leaves_fails_the_round_for_the_others_at_once():
    with make_server(3, round_timeout=30.0) as server:
        waiting = [client(server, 0), client(server, 1)]
        leaving = client(server, 2)
        started = time.monotonic()
        results = in_threads([lambda c=c: c.average(np.ones(N, np.float32), 4) for c in waiting] +
                             [lambda: (time.sleep(0.3), leaving._sock.close())])
        for error in results[:2]:
            assert isinstance(error, RefusedError)
            assert "worker 2 left during the round of iteration 4 (2 of 3 workers had arrived)" in str(error)
        assert time.monotonic() - started < 5


def test_a_silent_server_times_the_worker_out():
    with make_server(2, round_timeout=30.0) as server:
        lonely = ExchangeClient(server.address, SECRET, 0, shapes=SHAPES, timeout=0.5).connect()
        with pytest.raises(socket.timeout):
            lonely.average(np.zeros(N, np.float32), 1)  # the client's own timeout ends the wait


def test_non_finite_parameters_fail_the_round_for_everyone():
    with make_server(2) as server:
        a, b = client(server, 0), client(server, 1)
        bad = np.ones(N, np.float32)
        bad[5] = np.nan
        # b's frame comes second, so that its refusal finds a already waiting in the round.
        results = in_threads([lambda: a.average(np.ones(N, np.float32), 1),
                              lambda: (time.sleep(0.2), b.average(bad, 1))])
        assert isinstance(results[1], RefusedError) and results[1].code == P.E_NONFINITE
        assert isinstance(results[0], RefusedError) and "worker 1 left during the round of iteration 1" in str(results[0])
        assert np.isfinite(server.pull()).all() and server.handler.rounds == 0


def test_workers_in_different_rounds_are_refused():
    with make_server(2, round_timeout=5.0) as server:
        a, b = client(server, 0), client(server, 1)
        results = in_threads([lambda: a.average(np.ones(N, np.float32), 3),
                              lambda: (time.sleep(0.2), b.average(np.ones(N, np.float32), 4))])
        assert isinstance(results[1], RefusedError)
        assert "worker 1 sent iteration 4 while the round of iteration 3 is open" in str(results[1])
        assert isinstance(results[0], RefusedError)


def test_modes_refuse_each_others_frames():
    with make_server(2) as server:
        c = client(server, 0)
        with pytest.raises(RefusedError, match="EXCHANGE from worker 0, but this is a synchronous server"):
            c._exchange_once(np.zeros(N, np.float32), np.zeros(N, np.float32), 1, 0.0)
    async_server = ExchangeServer(np.zeros(N, np.float32), SECRET, EasgdHandler(0.5), shapes=SHAPES).start()
    try:
        c = client(async_server, 0)
        with pytest.raises(RefusedError, match="AVERAGE from worker 0, but this is an asynchronous EASGD server"):
            c.average(np.zeros(N, np.float32), 1)
    finally:
        async_server.stop()


def test_rejoining_workers_all_restart_from_the_last_completed_round():
    with make_server(2, resume_iteration=100, round_timeout=0.5) as server:
        a, b = client(server, 0), client(server, 1)
        assert a.resume_iteration == b.resume_iteration == 100
        in_threads([lambda: a.average(np.ones(N, np.float32), 101), lambda: b.average(np.ones(N, np.float32), 101)])
        a._sock.close()  # a dies after a round; b alone starts the next, which fails at the timeout
        time.sleep(0.2)
        with pytest.raises(RefusedError, match=r"round of iteration 102: 1 of 2 workers \(1\) arrived within 0.5s; "
                                               r"worker 0 left after the round of iteration 101 and has not rejoined"):
            b.average(np.ones(N, np.float32), 102)
        again = [client(server, 0), client(server, 1)]
        assert [c.resume_iteration for c in again] == [101, 101]
        center = np.empty(N, np.float32)
        again[0].pull(center)
        np.testing.assert_array_equal(center, np.ones(N, np.float32))
        # a rejoiner that arrives late (still building its backend) does not fail the round
        results = in_threads([lambda: again[0].average(np.zeros(N, np.float32), 102),
                              lambda: (time.sleep(0.3), again[1].average(np.full(N, 2, np.float32), 102))])
        assert not any(isinstance(r, BaseException) for r in results) and server.handler.rounds == 2


def test_a_worker_that_rejoins_while_its_dead_process_waits_in_a_round_starts_the_round_again():
    """Spark reruns a sync stage: the killed process's frame is in the open round and its server thread waits
    there, blind to its dead socket; the new process with the same id sends the same round's frame. The
    round starts again with the new frame (no 'sent twice'), and the old connection's end, once it wakes, is
    not worker 0 leaving: the new round completes with the new processes' parameters."""
    rng = np.random.default_rng(4)
    with make_server(2, round_timeout=20.0) as server:
        old = client(server, 0)
        waiting = threading.Thread(target=lambda: in_threads([lambda: old.average(np.ones(N, np.float32), 1)]))
        waiting.start()
        deadline = time.monotonic() + 10
        while not server.handler._round.params and time.monotonic() < deadline:  # its frame is in the round
            time.sleep(0.01)
        old._conn.sock.shutdown(socket.SHUT_RDWR)  # the process dies; the server's thread still waits
        new0, new1 = client(server, 0), client(server, 1)
        assert new0.resume_iteration == 0  # no round completed: it starts where the job did
        sent = [rng.standard_normal(N).astype(np.float32) for _ in range(2)]
        params = [x.copy() for x in sent]
        results = in_threads([lambda: new0.average(params[0], 1), lambda: new1.average(params[1], 1)])
        assert results == [None, None], results
        assert params[0].tobytes() == params[1].tobytes() == rules.average_models(sent).tobytes()
        assert server.handler.rounds == 1
        waiting.join(10)

        def noted():
            return any("rejoined while the round of iteration 1 held its previous connection" in reason
                       for _, reason in server.refused)
        # The old connection's server thread notes its refusal once it is scheduled again: under load, after the
        # new round (its client saw its own socket close at once, so `waiting` does not wait for it).
        deadline = time.monotonic() + 10
        while not noted() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert noted()
        assert server.stats()[0]["connected"]  # the old connection's end did not count as worker 0 leaving
