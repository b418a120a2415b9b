"""A resumed job is the job that was interrupted: the workers' solver histories go into the snapshot and back
to each worker, through the exchanger (no Spark here) and onto a real backend's solver state."""

import threading
import time

import numpy as np
import pytest

from deepspark import checkpoint, nets
from deepspark.config import load_solver
from deepspark.engine import outputs
from deepspark.errors import ConfigError
from deepspark.algorithms.easgd import EasgdHandler
from deepspark.algorithms.sync import RoundsHandler
from deepspark.exchange import ExchangeClient, ExchangeServer
from deepspark.exchange import protocol as P
from deepspark.exchange.transport import byte_view
from deepspark.spark import executor
from deepspark.spark.center import CenterCadence
from deepspark.spark.job import initial_center
from synthetic import make_job

SECRET = b"resume-secret"
SHAPES = ((10, 10), (900,))
N = 1000


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def history_of(seed, sets=2):
    return np.random.default_rng(seed).standard_normal(sets * N).astype(np.float32)


@pytest.mark.parametrize("handler", ["easgd", "sync"])
def test_the_driver_asks_each_worker_for_its_history_and_holds_what_it_sends(handler):
    make = {"easgd": lambda: EasgdHandler(0.5, consistent=True), "sync": lambda: RoundsHandler(1)}[handler]
    with ExchangeServer(np.zeros(N, np.float32), SECRET, make(), shapes=SHAPES, history_sets=2) as server:
        client = ExchangeClient(server.address, SECRET, 0, shapes=SHAPES, timeout=10.0, history_sets=2)
        x = np.ones(N, np.float32)
        exchange = client.exchange if handler == "easgd" else client.average
        exchange(x, 1)
        assert not client.history_wanted and server.histories() == {}
        request = server.request_histories()
        exchange(x, 2)
        assert client.history_wanted  # the reply asked
        history = history_of(1)
        client.send_history(history, iteration=2, current_step=1)
        assert not client.history_wanted
        wait_for(lambda: 0 in server.histories(since=request))
        held = server.histories(since=request)[0]
        assert held.vector.tobytes() == history.tobytes() and (held.iteration, held.current_step) == (2, 1)
        exchange(x, 3)
        assert not client.history_wanted  # answered: not asked again until the next request
        assert server.histories(since=request + 1) == {}
        client.close()


def test_a_resumed_server_hands_each_worker_its_own_history_once_it_asks():
    saved = history_of(2)
    with ExchangeServer(np.zeros(N, np.float32), SECRET, EasgdHandler(0.5), shapes=SHAPES, history_sets=2,
                        resume_iteration=300, histories={3: (304, 2, saved)}) as server:
        mine = ExchangeClient(server.address, SECRET, 3, shapes=SHAPES, timeout=10.0, history_sets=2)
        other = ExchangeClient(server.address, SECRET, 4, shapes=SHAPES, timeout=10.0, history_sets=2)
        out = np.empty(2 * N, np.float32)
        assert mine.pull_history(out) == (304, 2) and out.tobytes() == saved.tobytes()
        assert other.pull_history(out) is None  # nothing held for worker 4: it starts with zero momentum
        assert mine.resume_iteration == other.resume_iteration == 300
        assert server.stats()[3]["restored_history"] == 304 and server.stats()[4]["restored_history"] is None
        mine.close()
        other.close()


@pytest.mark.parametrize("bad, reason", [
    ("short", "HISTORY payload of 40 bytes, the solver history needs exactly 8000 (or 0)"),
    ("nan", "worker 0 sent a solver history holding NaN or Inf at iteration 7"),
    ("empty", "empty HISTORY from worker 0"),
])
def test_a_bad_history_is_refused_and_nothing_held_changes(bad, reason):
    held = history_of(3)
    center = np.linspace(-1, 1, N, dtype=np.float32)
    with ExchangeServer(center, SECRET, EasgdHandler(0.5), shapes=SHAPES, history_sets=2,
                        histories={0: (5, 0, held)}) as server:
        client = ExchangeClient(server.address, SECRET, 0, shapes=SHAPES, timeout=10.0, history_sets=2)
        client.connect()
        payload = {"short": np.zeros(10, np.float32), "nan": np.full(2 * N, np.nan, np.float32),
                   "empty": np.zeros(0, np.float32)}[bad]
        client._conn.send(P.HISTORY, byte_view(payload) if payload.size else None, 7, 0.0)
        wait_for(lambda: server.refused)
        assert reason in server.refused[-1][1]
        assert server.histories()[0].vector.tobytes() == held.tobytes()
        assert server.pull().tobytes() == center.tobytes()
        client.close()


def test_a_server_that_keeps_no_history_refuses_one():
    with ExchangeServer(np.zeros(N, np.float32), SECRET, EasgdHandler(0.5), shapes=SHAPES) as server:
        client = ExchangeClient(server.address, SECRET, 0, shapes=SHAPES, timeout=10.0, history_sets=1)
        client.connect()
        client._conn.send(P.HISTORY, byte_view(np.zeros(N, np.float32)), 1, 0.0)
        wait_for(lambda: server.refused)
        assert "HISTORY to a peer that keeps no solver history" in server.refused[-1][1]
        with pytest.raises(RuntimeError, match="keeps no solver history"):
            server.request_histories()


def test_worker_states_round_trip_through_a_solverstate_and_another_net_is_one_line(tmp_path):
    shapes = [(4, 1, 3, 3), (4,), (2, 36), (2,)]
    count = sum(int(np.prod(s)) for s in shapes)
    vector = np.arange(2 * count, dtype=np.float32)  # two history sets (Adam's)
    state = checkpoint.solver_state(40)
    state.worker_state.extend([checkpoint.worker_state(1, 43, 2, vector, shapes)])
    path = str(tmp_path / "x.solverstate")
    checkpoint.save_solverstate(path, state)
    restored = checkpoint.worker_histories(checkpoint.read_solverstate(path), shapes, 2, path)
    assert list(restored) == [1]
    iteration, step, got = restored[1]
    assert (iteration, step) == (43, 2) and got.tobytes() == vector.tobytes()
    with pytest.raises(ConfigError, match=r"worker 1's solver state has 8 history blobs; this net and solver have 4"):
        checkpoint.worker_histories(checkpoint.read_solverstate(path), shapes, 1, path)
    with pytest.raises(ConfigError, match=r"worker 1's history blob 2 has shape \(2, 36\); this net needs \(3, 36\)"):
        checkpoint.worker_histories(checkpoint.read_solverstate(path), [(4, 1, 3, 3), (4,), (3, 36), (2,)], 2, path)


def trainer_of(solver, backend):
    solver = load_solver(solver)
    solver.param.deepspark_param.backend = backend
    return nets.trainer(solver, evaluate=False)


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_a_worker_joining_a_resumed_job_takes_its_momentum_and_steps_on_exactly(tmp_path, backend):
    """The state, asserted directly: the worker's own join (worker.join_center) puts the saved history into
    a fresh backend model, which then takes the very step the interrupted one would have."""
    solver = make_job(tmp_path, max_iter=100)
    before = trainer_of(solver, backend)
    for _ in range(7):
        before.step()  # momentum is no longer zero
    history, params = before.model.get_history_flat(), before.model.get_flat()
    assert np.abs(history).max() > 0
    with ExchangeServer(params, SECRET, EasgdHandler(0.5), shapes=before.model.param_shapes,
                        history_sets=before.model.history_sets, resume_iteration=7,
                        histories={0: (7, before.model.current_step, history)}) as server:
        after = trainer_of(solver, backend)
        task = executor.Task(job_id="resume", solver=before.param.SerializeToString(),
                             train_net=before.solver.train_net.SerializeToString(), solver_path=solver,
                             address=server.address, secret=SECRET.decode())
        client, _, restored = executor.join_center(0, task, after.model, timeout=10.0)
        client.close()
    assert restored == 7 and after.model.iter == 7
    for mine, theirs in zip(after.model.get_history(), before.model.get_history()):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(after.model.get_flat(), params)
    batch = before.feeders[0].next_batch()  # the same batch into both
    loss_before, loss_after = before.model.step(batch), after.model.step(batch)
    np.testing.assert_allclose(loss_after, loss_before, rtol=1e-6)
    np.testing.assert_allclose(after.model.get_flat(), before.model.get_flat(), rtol=0, atol=1e-7)
    before.close()
    after.close()


def test_a_snapshot_keeps_each_workers_history_beside_the_centers_zeros(tmp_path):
    """A Spark job's snapshot (CenterCadence.snapshot) on a live exchanger: the request, the workers' answers,
    one solverstate that Caffe's restore reads (its own history: zeros) and our resume reads (each worker's)."""
    solver = load_solver(make_job(tmp_path, max_iter=100, snapshot=10))
    graph = initial_center(solver, 1)[0]
    shapes = [tuple(p.shape) for p in graph.params]
    count = sum(int(np.prod(s)) for s in shapes)
    with ExchangeServer(np.zeros(count, np.float32), SECRET, EasgdHandler(0.5), shapes=shapes,
                        history_sets=1) as server:
        cadence = CenterCadence(solver, graph, 0, server.pull, server=server, history_sets=1)
        clients = [ExchangeClient(server.address, SECRET, w, shapes=shapes, timeout=10.0, history_sets=1)
                   for w in range(2)]
        x = np.zeros(count, np.float32)
        for c in clients:
            c.exchange(x, 1)
        def answer():  # the workers train on: each answers at its next exchange
            it, deadline = 2, time.monotonic() + 30
            while len(server.histories(since=1)) < 2 and time.monotonic() < deadline:
                for w, c in enumerate(clients):
                    c.exchange(x, it)
                    if c.history_wanted:
                        c.send_history(np.full(count, w + 1, np.float32), it, 0)
                it += 1

        worker = threading.Thread(target=answer)
        worker.start()
        cadence.snapshot(10)
        worker.join()
        for c in clients:
            c.close()
    state = checkpoint.read_solverstate(str(tmp_path / "out" / "tiny_iter_10.solverstate"))
    assert state.iter == 10 and all(not any(b.data) for b in state.history)
    histories = checkpoint.worker_histories(state, shapes, 1)
    assert sorted(histories) == [0, 1]
    assert all((h[2] == w + 1).all() for w, h in histories.items())


def test_the_start_test_is_of_the_center_as_the_job_started_however_late_the_driver_first_sees_the_workers(tmp_path):
    """Caffe tests the net as it starts (test_initialization); the driver sees the workers now and then, and a short
    job may be past the next test_interval multiple when it first does: the start's test is still made, of x̃ as it
    started, not skipped and not of x̃ as it is then."""
    solver = load_solver(make_job(tmp_path, max_iter=40, test_interval=20))
    graph, center0 = initial_center(solver, 1)[:2]
    center = np.concatenate([a.reshape(-1) for a in center0]).astype(np.float32)
    cadence = CenterCadence(solver, graph, 0, lambda: center)
    cadence.start(str(tmp_path / "tensorboard"))
    try:
        at_start = cadence.test(0)
        center[:] = 0  # the workers' exchanges moved x̃ before the driver first saw them, at iteration 25
        cadence.due(25)
        tests = [(e["iteration"], outputs(e)) for e in cadence.history]
        assert [iteration for iteration, _ in tests] == [0, 0, 20]
        # x̃ as it started (the history as logged: :g), then as it is
        assert tests[1][1] == {k: float(f"{v:g}") for k, v in at_start.items()} and tests[2][1] != tests[1][1]
        cadence.due(40)
        assert [e["iteration"] for e in cadence.history if outputs(e)][3:] == [40]
    finally:
        cadence.close()
