"""HDF5Data, ImageData, WindowData and HDF5Output through the shared data pipeline; snapshot_format: HDF5."""

import contextlib
import gzip
import os
import shutil

import h5py
import numpy as np
import pytest

from conftest import ROOT, run_cli
from deepspark import checkpoint, config, nets
from deepspark.data import feeder_for
from deepspark.data.datum import array_to_image
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

HDF5_EXAMPLE = os.path.join(ROOT, "tests", "data", "bvlc", "examples", "hdf5_classification")
FASHION = "/usr/share/datasets/fashion-mnist"

SOLVER = """{nets}
test_iter: 5
test_interval: {iterations}
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "fixed"
display: 1
max_iter: {iterations}
snapshot_prefix: "{prefix}"
random_seed: 1
solver_mode: CPU
"""


def train_here(solver, backend, cwd=None, **options):
    """`deepspark train --algorithm single --backend BACKEND` in this process (in `cwd`): TensorFlow and pycaffe
    load once for the module's tests, not once per run; returns its summary."""
    with contextlib.chdir(cwd or os.getcwd()):
        return nets.train(config.override(config.load_solver(str(solver)), algorithm="single", backend=backend),
                          **options).summary


def two_classes(n, seed):
    """BVLC's hdf5_classification data in kind: 4 features, two classes (a linear rule and some noise)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = ((x @ np.array([1.0, -2.0, 0.5, 1.5]) + 0.3 * rng.standard_normal(n)) > 0).astype(np.float32)
    return x, y


def hdf5_example(root, rows=(100, 60), files=1):
    """The folder examples/hdf5_classification/data the example's nets name (relative to `root`): .h5 files
    with datasets data and label, and the train.txt/test.txt lists naming them, as BVLC's notebook writes them."""
    data = root / "examples" / "hdf5_classification" / "data"
    data.mkdir(parents=True)
    for split, n, seed in (("train", rows[0], 0), ("test", rows[1], 1)):
        names = []
        for f in range(files):
            x, y = two_classes(n, seed * 10 + f)
            name = f"examples/hdf5_classification/data/{split}{f}.h5"
            with h5py.File(root / name, "w") as h5:
                h5["data"], h5["label"] = x, y
            names.append(name)
        (data / f"{split}.txt").write_text("\n".join(names) + "\n")
    return data


@pytest.mark.parametrize("net", ["train_val.prototxt", "nonlinear_train_val.prototxt"])
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_the_hdf5_classification_example_trains_from_its_list(tmp_path, net, backend):
    hdf5_example(tmp_path)
    shutil.copy(os.path.join(HDF5_EXAMPLE, net), tmp_path / "examples" / "hdf5_classification")
    solver = tmp_path / "examples" / "hdf5_classification" / "solver.prototxt"
    solver.write_text(SOLVER.format(nets=f'net: "examples/hdf5_classification/{net}"', iterations=40,
                                    prefix="examples/hdf5_classification/logreg"))
    train_here("examples/hdf5_classification/solver.prototxt", backend, tmp_path)
    log = (tmp_path / "examples" / "hdf5_classification" / "train.log").read_text()
    accuracy = [float(line.split("= ")[1]) for line in log.splitlines() if "Test net output #0: accuracy" in line]
    assert len(accuracy) == 2 and accuracy[-1] > 0.8 and accuracy[-1] > accuracy[0], accuracy


def test_hdf5_feeder_reads_files_in_order_and_shards_rows(tmp_path, monkeypatch):
    hdf5_example(tmp_path, rows=(7, 3), files=3)
    monkeypatch.chdir(tmp_path)
    net, _ = config.parse_net(open(os.path.join(HDF5_EXAMPLE, "train_val.prototxt")).read())
    layer = net.layer[0]
    rows = np.concatenate([h5py.File(f"examples/hdf5_classification/data/train{f}.h5")["data"][()] for f in range(3)])
    whole = feeder_for(layer, batch_size=4)
    seen = np.concatenate([whole.next_batch()["data"] for _ in range(6)])  # 24 rows: a pass of 21 and 3 more
    np.testing.assert_array_equal(seen, np.concatenate([rows, rows[:3]]))
    assert whole.epoch == 1 and whole.shapes == {"data": (4, 4), "label": (4,)}
    shards = [feeder_for(layer, shard=i, num_shards=2, batch_size=1) for i in range(2)]
    firsts = [np.concatenate([s.next_batch()["data"] for _ in range(s.size)]) for s in shards]
    assert [s.size for s in shards] == [10, 11]
    np.testing.assert_array_equal(np.concatenate(firsts), rows)  # each shard its share, together all rows


def test_hdf5_shuffle_keeps_files_whole_and_resumes_exactly(tmp_path, monkeypatch):
    hdf5_example(tmp_path, rows=(5, 3), files=3)
    monkeypatch.chdir(tmp_path)
    net, _ = config.parse_net(open(os.path.join(HDF5_EXAMPLE, "train_val.prototxt")).read())
    layer = net.layer[0]
    layer.hdf5_data_param.shuffle = True
    feeder = feeder_for(layer, seed=4, batch_size=5)
    batches = [feeder.next_batch()["data"] for _ in range(3)]
    files = [h5py.File(f"examples/hdf5_classification/data/train{f}.h5")["data"][()] for f in range(3)]
    for batch in batches:  # one file per batch of 5 rows: whole files, rows permuted
        match = [f for f in files if sorted(map(tuple, f)) == sorted(map(tuple, batch))]
        assert len(match) == 1
    assert any(not np.array_equal(b, f) for b, f in zip(batches, files))
    feeder.next_batch()
    meta, order = feeder.get_state()
    expected = [feeder.next_batch()["data"] for _ in range(4)]
    resumed = feeder_for(layer, seed=99, batch_size=5)
    resumed.set_state(meta, order)
    for batch in expected:
        np.testing.assert_array_equal(resumed.next_batch()["data"], batch)


def test_hdf5_errors_name_the_list_and_its_line(tmp_path, monkeypatch):
    data = hdf5_example(tmp_path)
    monkeypatch.chdir(tmp_path)
    net, _ = config.parse_net(open(os.path.join(HDF5_EXAMPLE, "train_val.prototxt")).read())
    layer = net.layer[0]
    with h5py.File("examples/hdf5_classification/data/other.h5", "w") as h5:
        h5["data"] = np.zeros((3, 4), np.float32)
    (data / "train.txt").write_text("examples/hdf5_classification/data/train0.h5\n"
                                    "examples/hdf5_classification/data/other.h5\n")
    with pytest.raises(ConfigError) as caught:
        feeder_for(layer)
    assert str(caught.value) == ("examples/hdf5_classification/data/train.txt:2: HDF5 file "
                                 "'examples/hdf5_classification/data/other.h5' has no dataset 'label' (each top of "
                                 "an HDF5Data layer names the dataset it reads; the file has: data)")
    (data / "train.txt").write_text("examples/hdf5_classification/data/train0.h5 missing.h5\n")
    with pytest.raises(ConfigError, match=r"train.txt:1: HDF5 file 'missing.h5' not found$"):
        feeder_for(layer)
    # and from the command line: one line, exit status 1
    solver = data.parent / "solver.prototxt"
    shutil.copy(os.path.join(HDF5_EXAMPLE, "train_val.prototxt"), data.parent)
    solver.write_text(SOLVER.format(nets='net: "examples/hdf5_classification/train_val.prototxt"', iterations=2,
                                    prefix=str(tmp_path / "x")))
    status, _, err = run_cli("train", "--solver", str(solver), "--algorithm", "single", cwd=str(tmp_path))
    assert status == 1 and err.count("\n") == 1 and "HDF5 file 'missing.h5' not found" in err


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_hdf5_output_writes_its_bottoms_as_caffe_does(tmp_path, backend, monkeypatch):
    hdf5_example(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.h5"
    text = open(os.path.join(HDF5_EXAMPLE, "train_val.prototxt")).read() + (
        f'layer {{ name: "save" type: "HDF5Output" bottom: "fc1" bottom: "label" '
        f'hdf5_output_param {{ file_name: "{out}" }} }}\n')
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    model = nets.test_model(str(path), backend)
    try:
        (feeder,) = nets.feeders_for(model, pb.TEST)
        for _ in range(2):  # Caffe's own layer aborts on its second forward; this one writes each
            batch = feeder.next_batch()
            outputs = model.forward(batch)
    finally:
        model.close()
    with h5py.File(out) as h5:
        assert h5["data"].shape == (10, 2, 1, 1) and h5["label"].shape == (10, 1, 1, 1)  # legacy 4-axis blobs
        np.testing.assert_array_equal(h5["label"][()].ravel(), batch["label"])
        assert h5["data"].dtype == np.float32 and np.isfinite(h5["data"][()]).all()
    assert "accuracy" in outputs


def png_folder(root, count=24):
    """`count` Fashion-MNIST test images as PNGs in root/images and a `path label` list of them."""
    with gzip.open(f"{FASHION}/t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)[:count]
    with gzip.open(f"{FASHION}/t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)[:count]
    (root / "images").mkdir()
    lines = []
    for i, (image, label) in enumerate(zip(images, labels)):
        array_to_image(image[np.newaxis]).save(root / "images" / f"img {i}.png")  # a space, as Caffe allows
        lines.append(f"img {i}.png {label}")
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    return images, labels


IMAGE_NET = """name: "images"
layer {{ name: "data" type: "ImageData" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 {transform} }}
  image_data_param {{ source: "{root}/list.txt" root_folder: "{root}/images/" batch_size: 6 {extra} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include {{ phase: TEST }} }}
"""


@pytest.mark.skipif(not os.path.exists(f"{FASHION}/t10k-images-idx3-ubyte.gz"), reason="dataset-fashion-mnist")
def test_image_data_reads_the_list_as_caffe_does(tmp_path):
    images, labels = png_folder(tmp_path)
    net, _ = config.parse_net(IMAGE_NET.format(root=tmp_path, transform="", extra="is_color: false"))
    feeder = feeder_for(net.layer[0], pb.TEST)
    batch = feeder.next_batch()
    assert feeder.shapes == {"data": (6, 1, 28, 28), "label": (6,)}
    np.testing.assert_allclose(batch["data"][:, 0], images[:6] / 256.0, rtol=1e-6)
    np.testing.assert_array_equal(batch["label"], labels[:6])
    # colour (3 equal BGR channels of a gray PNG), resized, cropped; shards split the list
    net, _ = config.parse_net(IMAGE_NET.format(root=tmp_path, transform="crop_size: 16",
                                               extra="new_height: 20 new_width: 24"))
    shards = [feeder_for(net.layer[0], pb.TEST, shard=i, num_shards=2) for i in range(2)]
    assert [s.size for s in shards] == [12, 12]
    assert shards[0].shapes["data"] == (6, 3, 16, 16) and shards[0].source_shape == (3, 20, 24)
    assert list(shards[1].next_batch()["label"]) == list(labels[12:18])
    # shuffle: every pass a new order of the same images
    net, _ = config.parse_net(IMAGE_NET.format(root=tmp_path, transform="", extra="shuffle: true"))
    feeder = feeder_for(net.layer[0], pb.TRAIN, seed=3)
    first = np.concatenate([feeder.next_batch()["label"] for _ in range(4)])
    second = np.concatenate([feeder.next_batch()["label"] for _ in range(4)])
    assert sorted(first) == sorted(second) == sorted(labels) and list(first) != list(labels)


@pytest.mark.skipif(not os.path.exists(f"{FASHION}/t10k-images-idx3-ubyte.gz"), reason="dataset-fashion-mnist")
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_image_data_trains_from_a_folder_of_pngs(tmp_path, backend):
    png_folder(tmp_path)
    net = tmp_path / "net.prototxt"
    net.write_text(IMAGE_NET.format(root=tmp_path, transform="", extra="is_color: false shuffle: true"))
    solver = tmp_path / "solver.prototxt"
    solver.write_text(SOLVER.format(nets=f'net: "{net}"', iterations=4, prefix=tmp_path / "images"))
    train_here(solver, backend)
    log = (tmp_path / "train.log").read_text()
    assert log.count("Train net output #0: loss = ") == 4 and "Test net output #0: accuracy = " in log


def test_image_data_names_a_missing_image_by_its_list_line(tmp_path):
    (tmp_path / "images").mkdir()
    array_to_image(np.zeros((1, 4, 4), np.uint8)).save(tmp_path / "images" / "a.png")
    (tmp_path / "list.txt").write_text("a.png 0\n\nb.png 1\n")
    net = tmp_path / "net.prototxt"
    net.write_text(IMAGE_NET.format(root=tmp_path, transform="", extra=""))
    solver = tmp_path / "solver.prototxt"
    solver.write_text(SOLVER.format(nets=f'net: "{net}"', iterations=1, prefix=tmp_path / "x"))
    status, _, err = run_cli("train", "--solver", str(solver), "--algorithm", "single")
    assert status == 1 and err.strip() == (f"deepspark train: error: {tmp_path}/list.txt:3: image "
                                           f"'{tmp_path}/images/b.png' not found (root_folder '{tmp_path}/images/' "
                                           "+ the listed path)")


def test_window_data_describes_and_says_why_it_does_not_train(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text('name: "rcnn"\nlayer {\n  name: "data"\n  type: "WindowData"\n  top: "data"\n  top: "label"\n'
                   '  transform_param { crop_size: 227 mirror: true }\n'
                   f'  window_data_param {{ source: "{tmp_path}/window_file.txt" batch_size: 128 }}\n}}\n'
                   'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param '
                   '{ num_output: 21 } }\nlayer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" '
                   'top: "loss" }\n')
    status, out, err = run_cli("describe", str(net))
    assert status == 0 and "data 128x3x227x227, label 128" in out, err
    (tmp_path / "window_file.txt").write_text("# 0\nimg.jpg\n3\n10\n10\n1\n1 1.0 0 0 9 9\n")
    solver = tmp_path / "solver.prototxt"
    solver.write_text(SOLVER.format(nets=f'net: "{net}"', iterations=1, prefix=tmp_path / "x").replace(
        "test_iter: 5\n", ""))
    status, _, err = run_cli("train", "--solver", str(solver), "--algorithm", "single")
    assert status == 1 and err.count("\n") == 1
    assert err.startswith(f"deepspark train: error: {net}:2:1: layer 'data': WindowData (R-CNN's window sampler")


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_hdf5_snapshots_have_caffes_layout_and_resume(tmp_path, backend):
    hdf5_example(tmp_path)
    shutil.copy(os.path.join(HDF5_EXAMPLE, "nonlinear_train_val.prototxt"), tmp_path)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(SOLVER.format(nets='net: "nonlinear_train_val.prototxt"', iterations=4, prefix="snap/net")
                      .replace("lr_policy", "snapshot: 2\nsnapshot_format: HDF5\nlr_policy"))
    (tmp_path / "snap").mkdir()
    train_here("solver.prototxt", backend, tmp_path)
    log = (tmp_path / "snap" / "train.log").read_text()
    assert "Snapshotting to HDF5 file snap/net_iter_2.caffemodel.h5" in log
    assert "Snapshotting solver state to HDF5 file snap/net_iter_4.solverstate.h5" in log
    with h5py.File(tmp_path / "snap" / "net_iter_4.caffemodel.h5") as h5:
        assert set(h5["data"]) == {"data", "fc1", "relu1", "fc2", "loss"}  # every layer of the TRAIN net
        assert h5["data/fc1/0"].shape == (40, 4) and h5["data/fc1/1"].shape == (40,)
        assert h5["data/fc2/0"].shape == (2, 40) and len(h5["data/relu1"]) == 0
    with h5py.File(tmp_path / "snap" / "net_iter_4.solverstate.h5") as h5:
        assert int(h5["iter"][()]) == 4 and h5["learned_net"][()] == b"snap/net_iter_4.caffemodel.h5"
        assert sorted(h5["history"], key=int) == ["0", "1", "2", "3"] and h5["history/2"].shape == (2, 40)
    weights = dict(checkpoint.read_caffemodel(str(tmp_path / "snap" / "net_iter_4.caffemodel.h5")))
    assert weights["fc1"][0].shape == (40, 4)
    state = checkpoint.read_solverstate(str(tmp_path / "snap" / "net_iter_2.solverstate.h5"))
    checkpoint.save_solverstate(str(tmp_path / "copy.solverstate"), state)  # the same state as a binary proto
    assert checkpoint.read_solverstate(str(tmp_path / "copy.solverstate")) == state and state.iter == 2
    train_here("solver.prototxt", backend, tmp_path, snapshot="snap/net_iter_2.solverstate.h5")
    log = (tmp_path / "snap" / "train.log").read_text().split("Restoring previous solver status from "
                                                               "snap/net_iter_2.solverstate.h5")[1]
    assert "Finetuning from snap/net_iter_2.caffemodel.h5" in log  # the state's learned_net, as Caffe restores
    assert "Iteration 2 (" in log and "Iteration 0 (" not in log and "Iteration 1 (" not in log
