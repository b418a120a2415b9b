"""Caffe's Solver::Solve in one process: `deepspark train --algorithm single`, `test` and `plot`."""

import re

import pytest

from conftest import run_cli
from synthetic import make_job


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    solver = make_job(folder, max_iter=60, test_interval=30, snapshot=40)
    status, out, err = run_cli("train", "--solver", solver, "--algorithm", "single")
    assert status == 0, err
    return folder, err


def test_log_lines_are_caffes(trained):
    _, log = trained
    for pattern in (r"Iteration 0, Testing net \(#0\)", r"Test net output #0: accuracy = [\d.]+",
                    r"Iteration 20 \([\d.]+ iter/s\), loss = [\d.]+", r"Iteration 40, lr = 0.0498",
                    r"Snapshotting to binary proto file \S+tiny_iter_40.caffemodel",
                    r"Snapshotting solver state to binary proto file \S+tiny_iter_40.solverstate",
                    r"Iteration 60, Testing net", "Optimization Done."):
        assert re.search(pattern, log), pattern


def test_snapshots_at_interval_and_end(trained):
    folder, _ = trained
    names = sorted(p.name for p in (folder / "out").iterdir())
    assert names == ["tiny_iter_40.caffemodel", "tiny_iter_40.solverstate", "tiny_iter_60.caffemodel",
                     "tiny_iter_60.solverstate", "train.log"]


def test_learns_and_reloaded_weights_give_the_same_accuracy(trained):
    folder, log = trained
    final = float(re.findall(r"Test net output #0: accuracy = ([\d.]+)", log)[-1])
    assert final >= 0.9  # the halves problem is easy
    status, out, err = run_cli("test", "--model", str(folder / "net.prototxt"),
                               "--weights", str(folder / "out" / "tiny_iter_60.caffemodel"), "--iterations", "10")
    assert status == 0, err
    assert float(re.search(r"accuracy = ([\d.]+)", err).group(1)) == pytest.approx(final, abs=1e-6)


def test_resume_from_snapshot_continues_to_max_iter(trained):
    folder, _ = trained
    status, _, err = run_cli("train", "--solver", str(folder / "solver.prototxt"), "--algorithm", "single",
                             "--snapshot", str(folder / "out" / "tiny_iter_40.solverstate"))
    assert status == 0, err
    assert "Restoring previous solver status" in err and "Iteration 0, Testing" not in err
    assert "Iteration 60, Testing net" in err


def test_plot_from_log(trained, tmp_path):
    folder, _ = trained
    png = tmp_path / "curves.png"
    status, out, err = run_cli("plot", str(folder / "out" / "train.log"), "-o", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_bad_solver_and_weights_are_one_line_errors(tmp_path, trained):
    folder, _ = trained
    status, _, err = run_cli("train", "--solver", str(tmp_path / "absent.prototxt"), "--algorithm", "single")
    assert status == 1 and err.strip().endswith("absent.prototxt: solver file not found")
    bad = tmp_path / "bad.caffemodel"
    bad.write_bytes(b"garbage!")
    status, _, err = run_cli("test", "--model", str(folder / "net.prototxt"), "--weights", str(bad))
    assert status == 1 and "not a .caffemodel" in err.strip().splitlines()[-1]


def test_time_prints_caffes_per_layer_report(trained):
    folder, _ = trained
    status, _, err = run_cli("time", "--model", str(folder / "net.prototxt"), "--iterations", "3")
    assert status == 0, err
    for layer in ("data", "conv", "pool", "relu", "ip", "loss"):
        assert re.search(rf"\] +{layer}\tforward: [\d.e+-]+ ms\.", err), layer
        assert re.search(rf"\] +{layer}\tbackward: [\d.e+-]+ ms\.", err), layer
    for total in ("Average Forward pass", "Average Backward pass", "Average Forward-Backward", "Total Time"):
        assert re.search(rf"{total}: [\d.e+-]+ ms\.", err), total


def test_time_runs_on_a_deploy_net_without_data():
    status, _, err = run_cli("time", "--model", "models/cifar10_quick", "--iterations", "2")
    assert status == 0, err
    assert "conv3\tforward:" in err and "*** Benchmark ends ***" in err


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_a_trainer_state_lets_a_fresh_trainer_go_on_exactly(tmp_path, backend):
    """What the average job hands from one Python worker to another: history, iter, data position."""
    import numpy as np

    from deepspark import nets
    from deepspark.config import load_solver

    solver = load_solver(make_job(tmp_path, max_iter=40, test_interval=0))
    solver.param.deepspark_param.backend = backend
    trainers = [nets.trainer(solver, evaluate=False, shard=0, num_shards=2) for _ in range(3)]
    first, other, untouched = trainers
    try:
        for _ in range(13):  # 130 records over a shard of 100: into the second epoch
            first.step()
        arrays, meta = first.get_state()
        assert meta["iter"] == 13 and any(np.any(h) for h in arrays.values())
        for trainer in (other, untouched):
            trainer.model.set_flat(first.model.get_flat())
        other.set_state(arrays, meta)
        for _ in range(5):
            assert first.step() == other.step()
        np.testing.assert_array_equal(first.model.get_flat(), other.model.get_flat())
        assert other.iter == 18
        for _ in range(5):
            untouched.step()
        assert not np.array_equal(first.model.get_flat(), untouched.model.get_flat())  # the state mattered
    finally:
        for trainer in trainers:
            trainer.close()


def test_the_trainer_takes_its_built_backend_out_of_the_cyclic_collector(tmp_path):
    import gc

    from deepspark import nets
    from deepspark.config import load_solver

    trainer = nets.trainer(load_solver(make_job(tmp_path, max_iter=5, test_interval=0)), evaluate=False)
    try:
        before = gc.get_freeze_count()
        trainer.step()  # built and traced: TensorFlow's objects are frozen, not walked by each collection
        assert gc.get_freeze_count() > before + 10_000
    finally:
        trainer.close()
    assert gc.get_freeze_count() == 0  # and given back to the collector with the trainer
