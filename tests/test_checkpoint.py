""".caffemodel and .solverstate files: round trips, Caffe's copy-by-layer-name rules, atomic writes."""

import os
import threading

import numpy as np
import pytest

from deepspark import checkpoint
from deepspark.config import load_net
from deepspark.errors import ConfigError
from deepspark.graph import Graph
from deepspark.proto import deepspark_pb2 as pb

from conftest import ROOT


@pytest.fixture(scope="module")
def lenet():
    net, source = load_net(os.path.join(ROOT, "models/lenet/deploy.prototxt"))
    return Graph(net, pb.TEST, source=source)


def random_params(graph, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(p.shape).astype(np.float32) for p in graph.params]


def test_caffemodel_round_trip_is_bit_exact(lenet, tmp_path):
    arrays = random_params(lenet)
    path = tmp_path / "lenet.caffemodel"
    checkpoint.save_caffemodel(str(path), lenet, arrays)
    blobs = checkpoint.read_caffemodel(str(path))
    assert [name for name, arrays in blobs if arrays] == ["conv1", "conv2", "ip1", "ip2"]
    back = checkpoint.weights_for(lenet, blobs, [None] * len(arrays))
    for a, b in zip(arrays, back):
        assert a.shape == b.shape and np.array_equal(a, b)
    assert not [f for f in os.listdir(tmp_path) if f != "lenet.caffemodel"]  # no temp file left


def test_caffemodel_is_a_caffe_netparameter_with_layer_definitions(lenet, tmp_path):
    path = tmp_path / "w.caffemodel"
    checkpoint.save_caffemodel(str(path), lenet, random_params(lenet))
    net = pb.NetParameter.FromString(path.read_bytes())
    conv1 = next(layer for layer in net.layer if layer.name == "conv1")
    assert conv1.type == "Convolution" and conv1.convolution_param.num_output == 20
    assert list(conv1.blobs[0].shape.dim) == [20, 1, 5, 5] and len(conv1.blobs[0].data) == 500


def test_layers_missing_from_weights_keep_their_initial_values(lenet):
    arrays = random_params(lenet)
    initial = random_params(lenet, seed=1)
    blobs = {"conv1": arrays[:2]}
    merged = checkpoint.weights_for(lenet, blobs, initial)
    assert np.array_equal(merged[0], arrays[0]) and np.array_equal(merged[2], initial[2])


def test_legacy_4d_blobs_of_the_same_count_are_accepted(lenet):
    initial = random_params(lenet)
    legacy = initial[6].reshape(1, 1, 10, 500)  # ip2 weights as an old 4-axis blob
    merged = checkpoint.weights_for(lenet, {"ip2": [legacy, initial[7]]}, random_params(lenet, 2))
    assert np.array_equal(merged[6], initial[6])


def test_shape_mismatch_names_layer_and_shapes(lenet):
    with pytest.raises(ConfigError) as caught:
        checkpoint.weights_for(lenet, {"ip2": [np.zeros((5, 500), np.float32), np.zeros(10, np.float32)]},
                               random_params(lenet), "w.caffemodel")
    assert str(caught.value) == ("w.caffemodel: cannot copy param 0 of layer 'ip2': shape mismatch, "
                                 "weights have (5, 500), the net needs (10, 500)")


def test_garbage_and_missing_weights_files(tmp_path):
    bad = tmp_path / "bad.caffemodel"
    bad.write_bytes(b"\xff\xff\xff not a protobuf")
    with pytest.raises(ConfigError, match="bad.caffemodel: not a .caffemodel"):
        checkpoint.read_caffemodel(str(bad))
    with pytest.raises(ConfigError, match="cannot read .caffemodel: No such file"):
        checkpoint.read_caffemodel(str(tmp_path / "absent.caffemodel"))


def test_solverstate_round_trip_and_learned_net_beside_it(tmp_path):
    state = pb.SolverState(iter=500, current_step=2, learned_net="/elsewhere/x_iter_500.caffemodel")
    state.history.add().data.extend([1.0, 2.0])
    path = tmp_path / "x_iter_500.solverstate"
    checkpoint.save_solverstate(str(path), state)
    back = checkpoint.read_solverstate(str(path))
    assert back == state
    (tmp_path / "x_iter_500.caffemodel").write_bytes(b"")
    assert checkpoint.learned_net_path(back, str(path)) == str(tmp_path / "x_iter_500.caffemodel")


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "out.caffemodel"

    def boom(fd):
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        checkpoint.atomic_write(str(target), b"data")
    assert os.listdir(tmp_path) == []


def test_a_blob_is_the_message_data_extend_makes(lenet):
    # array_to_blob merges the packed field's bytes whole; the message is the one a float at a time makes.
    for array in [*random_params(lenet), np.array([np.nan, -0.0, np.inf], np.float32), np.zeros((0, 3), np.float32)]:
        made = pb.BlobProto()
        made.shape.dim.extend(array.shape)
        made.data.extend(array.ravel().tolist())
        assert checkpoint.array_to_blob(array).SerializeToString() == made.SerializeToString()
    assert list(checkpoint.array_to_blob(np.arange(6.0).reshape(1, 1, 2, 3), legacy_dims=True).data) == [0, 1, 2, 3,
                                                                                                           4, 5]


def test_writes_behind_go_in_order_on_their_own_thread_and_are_there_after_the_block(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync

    def recorded(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), threading.current_thread().name))
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", recorded)
    paths = [str(tmp_path / f"s_iter_{i}.caffemodel") for i in range(5)]
    with checkpoint.writes_behind():
        for i, path in enumerate(paths):
            checkpoint.atomic_write(path, bytes([i]) * 1000)
    assert [open(path, "rb").read() for path in paths] == [bytes([i]) * 1000 for i in range(5)]
    assert [os.path.basename(p).split(".tmp-")[0] for p, _ in synced] == [os.path.basename(p) for p in paths]
    assert {name for _, name in synced} == {"checkpoint-writer"}
    checkpoint.atomic_write(str(tmp_path / "after"), b"x")  # after the block: on the caller's thread again
    assert synced[-1][1] == threading.current_thread().name


def test_a_failed_write_behind_is_raised_and_leaves_nothing(tmp_path, monkeypatch):
    def boom(fd):
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        with checkpoint.writes_behind():
            checkpoint.atomic_write(str(tmp_path / "a.caffemodel"), b"data")
    assert os.listdir(tmp_path) == []
    # The block's own error wins; the writes before it are still waited for.
    monkeypatch.undo()
    with pytest.raises(KeyError):
        with checkpoint.writes_behind():
            checkpoint.atomic_write(str(tmp_path / "b.caffemodel"), b"data")
            raise KeyError("the solver's")
    assert os.listdir(tmp_path) == ["b.caffemodel"]
