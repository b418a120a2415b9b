"""The dataset tools: convert-mnist, convert-imageset, compute-image-mean — results and bad inputs."""

import gzip
import logging
import os
import re

import numpy as np
import pytest

from conftest import run_cli
from deepspark.errors import ConfigError
from deepspark.data import DataFeeder, convert, lmdb_io, peek_shape
from deepspark.data.datum import decode_datum, encode_datum, load_mean
from deepspark.proto import deepspark_pb2 as pb
from test_data import data_layer, leftovers

FASHION = "/usr/share/datasets/fashion-mnist"


def write_idx(path, magic, dims, payload, gz=False):
    data = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims) + bytes(payload)
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(data)
    return str(path)


@pytest.fixture
def idx(tmp_path):
    """A small synthetic MNIST: 5 images 4x3, gzipped images and plain labels."""
    pixels = np.arange(5 * 4 * 3, dtype=np.uint8).reshape(5, 4, 3) * 4
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    images = write_idx(tmp_path / "images.gz", 2051, (5, 4, 3), pixels.tobytes(), gz=True)
    return images, write_idx(tmp_path / "labels", 2049, (5,), labels.tobytes()), pixels, labels


# -- convert-mnist ----------------------------------------------------------------------

def test_convert_mnist_round_trips(idx, tmp_path, capfd, caplog):
    images, labels, pixels, label_values = idx
    out = str(tmp_path / "mnist_lmdb")
    caplog.set_level(logging.INFO, logger=convert.__name__)
    assert convert.convert_mnist(images, labels, out) == 5
    assert "A total of 5 items." in caplog.messages
    printed, err = capfd.readouterr()  # logged, not printed: glog lines on stderr (deepspark.log), none on stdout
    assert printed == "" and all(re.match(r"I\d{4} [\d:.]+ \d+ deepspark\] ", line) for line in err.splitlines()), err
    assert re.search(r"deepspark\] A total of 5 items\.$", err, re.M), err
    records = list(lmdb_io.read_records(out))
    assert [k for k, _ in records] == [f"{i:08d}".encode() for i in range(5)]
    for i, (key, value) in enumerate(records):
        datum = pb.Datum.FromString(value)
        assert (datum.channels, datum.height, datum.width) == (1, 4, 3) and not datum.encoded
        assert datum.data == pixels[i].tobytes() and datum.label == label_values[i]
    batch = DataFeeder(data_layer(out, batch=5, transform_text="scale: 0.00390625"), "TEST").next_batch()
    np.testing.assert_array_equal(batch["data"][:, 0], pixels.astype(np.float32) / 256)
    np.testing.assert_array_equal(batch["label"], label_values)
    assert leftovers(tmp_path) == []


@pytest.mark.skipif(not os.path.exists(f"{FASHION}/t10k-images-idx3-ubyte.gz"),
                    reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
def test_convert_real_fashion_mnist_t10k(tmp_path):
    out = str(tmp_path / "t10k_lmdb")
    n = convert.convert_mnist(f"{FASHION}/t10k-images-idx3-ubyte.gz",
                              f"{FASHION}/t10k-labels-idx1-ubyte.gz", out)
    assert n == 10000 and lmdb_io.count(out) == 10000 and peek_shape(out) == (1, 28, 28)
    with gzip.open(f"{FASHION}/t10k-images-idx3-ubyte.gz") as f:
        raw = f.read()
    key, value = next(lmdb_io.read_records(out, 9999, 10000))
    image, label = decode_datum(value)
    assert key == b"00009999" and 0 <= label < 10
    np.testing.assert_array_equal(image.ravel(), np.frombuffer(raw[16 + 9999 * 784:], np.uint8))
    feeder = DataFeeder(data_layer(out, batch=64, transform_text="scale: 0.00390625"), "TEST")
    labels = np.concatenate([feeder.next_batch()["label"] for _ in range(157)])[:10000]
    assert sorted(np.bincount(labels.astype(int))) == [1000] * 10  # ten balanced classes


def assert_failed_cleanly(status, err, out, *messages):
    assert status == 1, err
    lines = err.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith("deepspark ")
    for message in messages:
        assert message in lines[-1], lines[-1]
    assert not os.path.exists(out)
    assert leftovers(os.path.dirname(out)) == []


def test_convert_mnist_bad_inputs(idx, tmp_path):
    images, labels, _, _ = idx
    out = str(tmp_path / "out_lmdb")
    status, _, err = run_cli("convert-mnist", labels, labels, out)
    assert_failed_cleanly(status, err, out, f"{labels}: wrong magic number 2049",
                          "an IDX image file starts with 2051")
    few = write_idx(tmp_path / "few", 2049, (4,), b"\x01\x02\x03\x04")
    status, _, err = run_cli("convert-mnist", images, few, out)
    assert_failed_cleanly(status, err, out, f"{images}: holds 5 images but {few} holds 4 labels")
    short = write_idx(tmp_path / "short", 2051, (5, 4, 3), b"\x00" * 59)
    status, _, err = run_cli("convert-mnist", short, labels, out)
    assert_failed_cleanly(status, err, out, "holds 59 bytes after the header", "says 60")
    status, _, err = run_cli("convert-mnist", str(tmp_path / "absent"), labels, out)
    assert_failed_cleanly(status, err, out, "absent: cannot read (No such file or directory)")


def test_convert_mnist_refuses_to_overwrite(idx, tmp_path):
    images, labels, _, _ = idx
    out = str(tmp_path / "mnist_lmdb")
    convert.convert_mnist(images, labels, out)
    status, _, err = run_cli("convert-mnist", images, labels, out)
    assert status == 1 and f"{out}: already exists" in err
    assert lmdb_io.count(out) == 5 and leftovers(tmp_path) == []


# -- convert-imageset ----------------------------------------------------------------------

@pytest.fixture
def images(tmp_path):
    """Four PNG files (RGB and gray, 6x8) and a list file naming them."""
    from PIL import Image
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(2)
    pictures = {}
    for i, name in enumerate(["a.png", "b.png", "sub/c d.png", "e.png"]):
        rgb = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        Image.fromarray(rgb, "RGB").save(root / name)
        pictures[name] = rgb
    listfile = tmp_path / "list.txt"
    listfile.write_text("a.png 0\nb.png 1\n\nsub/c d.png 2\ne.png 3\n")
    return str(root), str(listfile), pictures


def test_convert_imageset_raw_colour_is_bgr_with_caffes_keys(images, tmp_path):
    root, listfile, pictures = images
    out = str(tmp_path / "set_lmdb")
    assert convert.convert_imageset(root + "/", listfile, out) == 4
    records = list(lmdb_io.read_records(out))
    assert [k.decode() for k, _ in records] == ["00000000_a.png", "00000001_b.png",
                                               "00000002_sub/c d.png", "00000003_e.png"]
    datum = pb.Datum.FromString(records[2][1])
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 6, 8, 2)
    image, _ = decode_datum(records[2][1])
    np.testing.assert_array_equal(image, pictures["sub/c d.png"][:, :, ::-1].transpose(2, 0, 1))


def test_convert_imageset_gray_and_resize(images, tmp_path):
    from PIL import Image
    root, listfile, pictures = images
    out = str(tmp_path / "gray_lmdb")
    convert.convert_imageset(root, listfile, out, gray=True, resize_height=3, resize_width=5)
    image, label = decode_datum(next(lmdb_io.read_records(out))[1])
    expected = np.asarray(Image.fromarray(pictures["a.png"]).convert("L").resize((5, 3), Image.BILINEAR))
    assert image.shape == (1, 3, 5) and label == 0
    np.testing.assert_array_equal(image[0], expected)
    with pytest.raises(ConfigError, match="both --resize-height and --resize-width"):
        convert.convert_imageset(root, listfile, str(tmp_path / "x_lmdb"), resize_height=3)


def test_convert_imageset_encoded(images, tmp_path):
    root, listfile, pictures = images
    out = str(tmp_path / "png_lmdb")
    convert.convert_imageset(root, listfile, out, encoded=True)
    key, value = next(lmdb_io.read_records(out))
    datum = pb.Datum.FromString(value)
    assert datum.encoded and not datum.HasField("channels")
    assert datum.data == open(os.path.join(root, "a.png"), "rb").read()  # the file as it is
    assert peek_shape(out) == (3, 6, 8)
    out_jpg = str(tmp_path / "jpg_lmdb")
    convert.convert_imageset(root, listfile, out_jpg, encoded=True, encode_type="jpg",
                             resize_height=6, resize_width=4)
    datum = pb.Datum.FromString(next(lmdb_io.read_records(out_jpg))[1])
    assert datum.data[:2] == b"\xff\xd8" and peek_shape(out_jpg) == (3, 6, 4)
    batch = DataFeeder(data_layer(out, batch=4), "TEST").next_batch()
    np.testing.assert_array_equal(batch["data"][0], pictures["a.png"][:, :, ::-1].transpose(2, 0, 1))


def test_convert_imageset_shuffle_renumbers_keys(images, tmp_path):
    root, listfile, _ = images
    out = str(tmp_path / "shuffled_lmdb")
    convert.convert_imageset(root, listfile, out, shuffle=True, seed=4)
    keys = [k.decode() for k, _ in lmdb_io.read_records(out)]
    assert [k[:9] for k in keys] == [f"{i:08d}_" for i in range(4)]
    names = [k[9:] for k in keys]
    assert sorted(names) == ["a.png", "b.png", "e.png", "sub/c d.png"] and names != sorted(names)
    labels = [decode_datum(v)[1] for _, v in lmdb_io.read_records(out)]
    assert labels == [{"a.png": 0, "b.png": 1, "sub/c d.png": 2, "e.png": 3}[n] for n in names]


def test_convert_imageset_bad_inputs(images, tmp_path):
    root, listfile, _ = images
    out = str(tmp_path / "out_lmdb")
    with open(listfile, "a") as f:
        f.write("missing.png 4\n")
    status, _, err = run_cli("convert-imageset", root, listfile, out)
    assert_failed_cleanly(status, err, out, f"{listfile}:6: cannot read image", "missing.png")
    (tmp_path / "bad.txt").write_text("a.png 0\nb.png one\n")
    status, _, err = run_cli("convert-imageset", root, str(tmp_path / "bad.txt"), out)
    assert_failed_cleanly(status, err, out, "bad.txt:2: expected 'FILENAME LABEL', got 'b.png one'")
    (tmp_path / "images" / "junk.png").write_bytes(b"not a png")
    (tmp_path / "junk.txt").write_text("a.png 0\njunk.png 1\n")
    status, _, err = run_cli("convert-imageset", root, str(tmp_path / "junk.txt"), out)
    assert_failed_cleanly(status, err, out, "junk.txt:2: cannot read image", "junk.png")


# -- compute-image-mean --------------------------------------------------------------------

def test_compute_image_mean(tmp_path, caplog):
    arrays = [np.full((2, 3, 3), v, dtype=np.uint8) for v in (10, 20, 60)]
    arrays[0][1, 2, 2] = 250
    db = str(tmp_path / "db_lmdb")
    lmdb_io.write_lmdb(db, ((f"{i:08d}", encode_datum(a, 0)) for i, a in enumerate(arrays)))
    out = str(tmp_path / "mean.binaryproto")
    caplog.set_level(logging.INFO, logger=convert.__name__)
    assert convert.compute_image_mean(db, out) == 3
    mean = load_mean(out)
    assert mean.shape == (2, 3, 3) and mean[0, 0, 0] == 30 and mean[1, 2, 2] == 110
    blob = pb.BlobProto.FromString(open(out, "rb").read())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 2, 3, 3)
    assert list(blob.shape.dim) == [1, 2, 3, 3]
    assert "Number of channels: 2" in caplog.messages


def test_compute_image_mean_bad_inputs(tmp_path):
    db = str(tmp_path / "db_lmdb")
    lmdb_io.write_lmdb(db, [(b"00000000", encode_datum(np.zeros((1, 2, 2), np.uint8), 0)),
                            (b"00000001_cat.jpg", b"\x0a\xff\xff\x00")])
    out = str(tmp_path / "mean.binaryproto")
    status, _, err = run_cli("compute-image-mean", db, out)
    assert_failed_cleanly(status, err, out, f"{db}: record '00000001_cat.jpg': corrupt Datum")
    status, _, err = run_cli("compute-image-mean", str(tmp_path / "none_lmdb"), out)
    assert_failed_cleanly(status, err, out, "none_lmdb: no such LMDB")
    odd = str(tmp_path / "odd_lmdb")
    lmdb_io.write_lmdb(odd, [(b"a", encode_datum(np.zeros((1, 2, 2), np.uint8), 0)),
                             (b"b", encode_datum(np.zeros((1, 3, 2), np.uint8), 0))])
    status, _, err = run_cli("compute-image-mean", odd, out)
    assert_failed_cleanly(status, err, out, "record 'b' is 1x3x2 but record 'a' is 1x2x2")
