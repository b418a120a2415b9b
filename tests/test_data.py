"""The data pipeline: Datum codecs, LMDB shards, Caffe's transform_param, batches, converters."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from conftest import ROOT
from deepspark import checkpoint
from deepspark.data import DataFeeder, peek_shape, source_shape
from deepspark.data import lmdb_io
from deepspark.data.datum import DataError, decode_datum, decode_datums, encode_datum, load_mean, save_mean
from deepspark.data.transform import Transformer
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

FASHION = "/usr/share/datasets/fashion-mnist"


def transform(text=""):
    return text_format.Parse(text, pb.TransformationParameter())


def data_layer(source, batch=4, transform_text="", tops=("data", "label")):
    tops = " ".join(f'top: "{t}"' for t in tops)
    return text_format.Parse(
        f'name: "data" type: "Data" {tops} transform_param {{ {transform_text} }} '
        f'data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }}', pb.LayerParameter())


def make_lmdb(path, arrays, labels=None):
    labels = range(len(arrays)) if labels is None else labels
    lmdb_io.write_lmdb(str(path), ((f"{i:08d}", encode_datum(a, int(l)))
                                   for i, (a, l) in enumerate(zip(arrays, labels))))
    return str(path)


def leftovers(folder):
    return sorted(name for name in os.listdir(folder) if ".tmp-" in name or ".old-" in name)


# -- Datum -------------------------------------------------------------------------

def test_raw_datum_round_trip_and_caffe_layout():
    image = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    value = encode_datum(image, 7)
    datum = pb.Datum.FromString(value)
    assert (datum.channels, datum.height, datum.width, datum.label) == (2, 3, 4, 7)
    assert datum.data == image.tobytes() and not datum.encoded
    array, label = decode_datum(value)
    assert array.dtype == np.uint8 and label == 7
    np.testing.assert_array_equal(array, image)


def test_float_datum_round_trip():
    image = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 2, 2)
    datum = pb.Datum.FromString(encode_datum(image, 3))
    assert not datum.data and len(datum.float_data) == 12
    array, label = decode_datum(datum.SerializeToString())
    assert array.dtype == np.float32 and label == 3
    np.testing.assert_array_equal(array, image)


@pytest.mark.parametrize("channels", [1, 3])
def test_png_datum_is_lossless_and_carries_no_shape(channels):
    image = np.random.default_rng(0).integers(0, 256, (channels, 5, 7), dtype=np.uint8)
    datum = pb.Datum.FromString(encode_datum(image, 2, encoded="png"))
    assert datum.encoded and datum.data[:4] == b"\x89PNG"
    assert not datum.HasField("channels")  # as Caffe's convert_imageset --encoded writes it
    array, label = decode_datum(datum.SerializeToString())
    assert label == 2
    np.testing.assert_array_equal(array, image)


def test_jpg_datum_is_close():
    image = np.tile(np.linspace(0, 255, 16, dtype=np.uint8), (3, 16, 1))
    image[0] //= 2
    value = encode_datum(image, 1, encoded="jpg")
    assert pb.Datum.FromString(value).data[:2] == b"\xff\xd8"
    array, _ = decode_datum(value)
    assert array.shape == image.shape
    assert np.abs(array.astype(int) - image).mean() < 3


def test_encoded_colour_is_bgr_like_opencv():
    from PIL import Image
    import io
    red = io.BytesIO()
    Image.new("RGB", (2, 2), (255, 0, 0)).save(red, "PNG")
    array, _ = decode_datum(pb.Datum(data=red.getvalue(), encoded=True).SerializeToString())
    assert array[:, 0, 0].tolist() == [0, 0, 255]  # B, G, R


def test_corrupt_records_name_their_key():
    with pytest.raises(DataError, match=r"db: record '00000042': corrupt Datum"):
        decode_datum(b"\xff\xff\xff", b"00000042", "db")
    short = pb.Datum(channels=1, height=2, width=2, data=b"abc").SerializeToString()
    with pytest.raises(DataError, match=r"record 'k7': data holds 3 bytes, expected 4"):
        decode_datum(short, b"k7")
    bad_png = pb.Datum(data=b"\x89PNG not really", encoded=True).SerializeToString()
    with pytest.raises(DataError, match=r"record 'img': cannot decode the encoded image"):
        decode_datum(bad_png, "img")


def test_bulk_decode_matches_one_by_one():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (40, 2, 3, 3), dtype=np.uint8)
    labels = [0, 1, 127, 128, 300, -1, 2 ** 30] + list(range(33))
    values = [encode_datum(a, l) for a, l in zip(images, labels)]
    values[5] = pb.Datum(channels=2, height=3, width=3, data=images[5].tobytes(), label=-1,
                         encoded=False).SerializeToString()
    keys = [f"{i:08d}".encode() for i in range(40)]
    got, got_labels = decode_datums(keys, values)
    np.testing.assert_array_equal(got, images)
    np.testing.assert_array_equal(got_labels, np.array(labels, dtype=np.float32))
    values[9] = encode_datum(images[9][:, :2], 0)
    with pytest.raises(DataError, match=r"record '00000009' is 2x2x3 uint8 but the first record is 2x3x3"):
        decode_datums(keys, values)


def test_mean_binaryproto_like_compute_image_mean(tmp_path):
    mean = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) / 7
    save_mean(mean, str(tmp_path / "written.binaryproto"))
    blob = pb.BlobProto.FromString((tmp_path / "written.binaryproto").read_bytes())
    assert list(blob.shape.dim) == [1, 2, 3, 4]
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 2, 3, 4)
    np.testing.assert_array_equal(checkpoint.blob_to_array(blob)[0], mean)
    legacy = pb.BlobProto(num=1, channels=2, height=3, width=4, data=mean.ravel().tolist())
    path = tmp_path / "legacy.binaryproto"
    path.write_bytes(legacy.SerializeToString())
    np.testing.assert_array_equal(load_mean(str(path)), mean)
    save_mean(mean, str(tmp_path / "m.binaryproto"))
    np.testing.assert_array_equal(load_mean(str(tmp_path / "m.binaryproto")), mean)
    (tmp_path / "junk.binaryproto").write_bytes(b"\x0a\x05junk")
    with pytest.raises(DataError, match="junk.binaryproto: not a BlobProto mean file"):
        load_mean(str(tmp_path / "junk.binaryproto"))
    with pytest.raises(DataError, match="nope.binaryproto: cannot read the mean file"):
        load_mean(str(tmp_path / "nope.binaryproto"))


# -- transform_param -----------------------------------------------------------------

def caffe_transform(image, param, h_off, w_off, mirror, mean=None):
    """Caffe's DataTransformer::Transform(Datum), pixel by pixel, as the C++ loop reads."""
    c_n, height, width = image.shape
    crop_h = param.crop_h or param.crop_size or height
    crop_w = param.crop_w or param.crop_size or width
    out = np.zeros((c_n, crop_h, crop_w), np.float32)
    for c in range(c_n):
        for h in range(crop_h):
            for w in range(crop_w):
                value = np.float32(image[c, h_off + h, w_off + w])
                if mean is not None:
                    value -= np.float32(mean[c, h_off + h, w_off + w])
                elif len(param.mean_value):
                    value -= np.float32(param.mean_value[c if len(param.mean_value) > 1 else 0])
                out[c, h, crop_w - 1 - w if mirror else w] = value * np.float32(param.scale)
    return out


def test_test_phase_crops_the_centre_with_integer_division():
    image = np.arange(6 * 7, dtype=np.uint8).reshape(1, 6, 7)
    t = Transformer(transform("crop_size: 3 mirror: true"), "TEST")
    out = t.apply(image[None])
    # (6-3)//2 = 1, (7-3)//2 = 2; TEST mirrors at random as TRAIN does.
    window = image[0, 1:4, 2:5]
    assert (out[0, 0] == window).all() or (out[0, 0] == window[:, ::-1]).all()
    assert t.output_shape((1, 6, 7)) == (1, 3, 3)
    assert Transformer(transform("crop_h: 2 crop_w: 4"), "TEST").output_shape((3, 6, 7)) == (3, 2, 4)


def test_train_phase_random_crop_reaches_every_offset():
    image = np.arange(5 * 6, dtype=np.uint8).reshape(1, 5, 6)
    t = Transformer(transform("crop_size: 3"), pb.TRAIN, seed=3)
    batch = np.repeat(image[None], 200, axis=0)
    h_off, w_off, mirror = offsets = t.offsets(200, (1, 5, 6))
    assert set(h_off) == {0, 1, 2} and set(w_off) == {0, 1, 2, 3} and not mirror.any()
    out = t.apply(batch, offsets=offsets)
    for i in range(200):
        np.testing.assert_array_equal(out[i, 0], image[0, h_off[i]:h_off[i] + 3, w_off[i]:w_off[i] + 3])


def test_mirror_flips_width_in_either_phase_as_caffe_does():
    image = np.arange(2 * 2 * 3, dtype=np.uint8).reshape(1, 2, 2, 3)
    batch = np.repeat(image, 64, axis=0)
    out = Transformer(transform("mirror: true"), "TRAIN", seed=0).apply(batch)
    flipped = [bool((o == image[0, :, :, ::-1]).all()) for o in out]
    straight = [bool((o == image[0]).all()) for o in out]
    assert all(f != s for f, s in zip(flipped, straight)) and 10 < sum(flipped) < 54
    # Caffe's DataTransformer: do_mirror = param_.mirror() && Rand(2), whatever the phase.
    test = Transformer(transform("mirror: true"), "TEST", seed=1).apply(batch)
    flipped = [bool((o == image[0, :, :, ::-1]).all()) for o in test]
    assert 10 < sum(flipped) < 54
    assert (Transformer(transform("mirror: false"), "TEST", seed=1).apply(batch) == image[0]).all()


def test_mean_file_is_taken_at_the_uncropped_position(tmp_path):
    image = np.array([[[10, 20, 30, 40],
                       [50, 60, 70, 80],
                       [90, 100, 110, 120]]], dtype=np.uint8)
    mean = np.array([[[1, 2, 3, 4],
                      [5, 6, 7, 8],
                      [9, 10, 11, 12]]], dtype=np.float32)
    save_mean(mean, str(tmp_path / "mean.binaryproto"))
    param = transform(f'crop_size: 2 scale: 0.5 mean_file: "{tmp_path / "mean.binaryproto"}"')
    out = Transformer(param, "TEST").apply(image[None])
    # centre: h_off = (3-2)//2 = 0, w_off = (4-2)//2 = 1 → pixels 20 30 / 60 70, mean 2 3 / 6 7
    np.testing.assert_array_equal(out[0, 0], [[9.0, 13.5], [27.0, 31.5]])
    t = Transformer(param, "TRAIN")
    mirrored = t.apply(image[None], offsets=(np.array([1]), np.array([2]), np.array([True])))
    # rows 1..2, cols 2..3 → (70-7, 80-8 / 110-11, 120-12) * 0.5, then flipped
    np.testing.assert_array_equal(mirrored[0, 0], [[36.0, 31.5], [54.0, 49.5]])


def test_mean_value_one_for_all_or_one_per_channel():
    image = np.full((1, 3, 2, 2), 100, dtype=np.uint8)
    one = Transformer(transform("mean_value: 10 scale: 2"), "TEST").apply(image)
    assert (one == 180).all()
    per = Transformer(transform("mean_value: 104 mean_value: 117 mean_value: 123"), "TEST").apply(image)
    assert per[0, :, 0, 0].tolist() == [-4.0, -17.0, -23.0]
    with pytest.raises(ConfigError, match="2 mean_value for 3-channel images"):
        Transformer(transform("mean_value: 1 mean_value: 2"), "TEST").apply(image)
    with pytest.raises(ConfigError, match="mean_file or mean_value, not both"):
        Transformer(transform('mean_value: 1 mean_file: "m.binaryproto"'), "TEST")
    with pytest.raises(ConfigError, match="crop 3x3 is larger than the 2x2 images"):
        Transformer(transform("crop_size: 3"), "TEST").apply(image)


def test_lenet_scale_maps_bytes_to_unit_interval():
    batch = np.array([0, 1, 128, 255], dtype=np.uint8).reshape(4, 1, 1, 1)
    out = Transformer(transform("scale: 0.00390625"), "TRAIN").apply(batch)
    assert out.dtype == np.float32
    assert out.ravel().tolist() == [0.0, 0.00390625, 0.5, 0.99609375]


@pytest.mark.parametrize("text", [
    "crop_size: 4 mirror: true scale: 0.25 MEAN",
    "crop_h: 3 crop_w: 5 mean_value: 3 mean_value: 5",
    "mirror: true mean_value: 7",
    "crop_size: 5 mirror: true MEAN",
])
@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_batches_match_caffes_per_pixel_loop(tmp_path, text, phase):
    rng = np.random.default_rng(5)
    batch = rng.integers(0, 256, (6, 2, 7, 6), dtype=np.uint8)
    mean = None
    if "MEAN" in text:
        mean = rng.uniform(0, 255, (2, 7, 6)).astype(np.float32)
        save_mean(mean, str(tmp_path / "mean.binaryproto"))
        text = text.replace("MEAN", f'mean_file: "{tmp_path / "mean.binaryproto"}"')
    param = transform(text)
    t = Transformer(param, phase, seed=11)
    offsets = t.offsets(len(batch), batch.shape[1:])
    out = t.apply(batch, offsets=offsets)
    for i, image in enumerate(batch):
        expected = caffe_transform(image, param, offsets[0][i], offsets[1][i], offsets[2][i], mean)
        np.testing.assert_array_equal(out[i], expected)


def test_float_data_images_transform_like_bytes():
    batch = np.array([[[[0.5, 2.0]]]], dtype=np.float32)
    out = Transformer(transform("mean_value: 0.5 scale: 4"), "TEST").apply(batch)
    assert out.ravel().tolist() == [0.0, 6.0]


# -- shards and the feeder -------------------------------------------------------------

def test_shard_ranges_cover_the_records_once():
    for n in (0, 1, 7, 10, 60000):
        for shards in (1, 2, 3, 7):
            ranges = [lmdb_io.shard_range(n, i, shards) for i in range(shards)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [stop - start for start, stop in ranges]
            assert max(sizes) - min(sizes) <= 1
    assert lmdb_io.shard_range(10, 1, 3) == (3, 6)
    with pytest.raises(ValueError, match="shard 3 is not in 0..2"):
        lmdb_io.shard_range(10, 3, 3)


@pytest.fixture
def ten(tmp_path):
    """An LMDB of ten 1x2x2 images; record i is filled with 10*i and labelled i."""
    arrays = [np.full((1, 2, 2), 10 * i, dtype=np.uint8) for i in range(10)]
    return make_lmdb(tmp_path / "ten_lmdb", arrays)


def labels_of(feeder, batches):
    return [feeder.next_batch()["label"].astype(int).tolist() for _ in range(batches)]


def test_feeder_loops_over_its_shard_like_caffes_data_layer(ten):
    assert lmdb_io.count(ten) == 10 and peek_shape(ten) == (1, 2, 2)
    feeder = DataFeeder(data_layer(ten), "TEST", shard=1, num_shards=2)
    assert feeder.shape == (4, 1, 2, 2) and feeder.shapes["label"] == (4,)
    assert labels_of(feeder, 3) == [[5, 6, 7, 8], [9, 5, 6, 7], [8, 9, 5, 6]]
    assert feeder.epoch == 2
    batch = DataFeeder(data_layer(ten, transform_text="scale: 0.5"), "TEST").next_batch()
    assert batch["data"].dtype == np.float32 and batch["label"].dtype == np.float32
    assert batch["data"][:, 0, 0, 0].tolist() == [0.0, 5.0, 10.0, 15.0]
    small = DataFeeder(data_layer(ten, batch=3), "TEST", shard=4, num_shards=5)  # records 8, 9
    assert labels_of(small, 2) == [[8, 9, 8], [9, 8, 9]]


def test_shuffle_permutes_each_epoch_and_the_seed_fixes_it(ten):
    def epochs(seed, **kwargs):
        feeder = DataFeeder(data_layer(ten, batch=5), "TRAIN", seed=seed, shuffle=True, **kwargs)
        return [sum(labels_of(feeder, 2), []) for _ in range(4)]
    first = epochs(1)
    assert all(sorted(e) == list(range(10)) for e in first)
    assert len({tuple(e) for e in first}) > 1 and first[0] != list(range(10))
    assert epochs(1) == first and epochs(2) != first
    assert epochs(1, memory_limit=0) == first  # streamed from the cursor: same batches
    assert epochs(1, prefetch=2) == first


@pytest.mark.parametrize("window_bytes", [1, 1 << 20])
def test_streamed_and_in_memory_feeders_give_identical_batches(ten, monkeypatch, window_bytes):
    from deepspark.data import feeder
    monkeypatch.setattr(feeder, "STREAM_WINDOW_BYTES", window_bytes)  # 1: windows of one batch
    layer = data_layer(ten, batch=4, transform_text="crop_size: 1 mirror: true")
    a = DataFeeder(layer, "TRAIN", seed=9, shard=1, num_shards=2)
    b = DataFeeder(layer, "TRAIN", seed=9, shard=1, num_shards=2, memory_limit=0)
    assert a.in_memory and not b.in_memory
    for _ in range(7):
        x, y = a.next_batch(), b.next_batch()
        np.testing.assert_array_equal(x["data"], y["data"])
        np.testing.assert_array_equal(x["label"], y["label"])
    b.close()


# A streamed feeder dropped in a reference cycle holds its LMDB open until a collection closes it, and a collection
# runs at whatever allocation comes next: here the one inside open_db's lmdb.open for another LMDB.
COLLECTED_INSIDE_OPEN = """
import gc, sys
import lmdb
from google.protobuf import text_format
from deepspark.data import DataFeeder, lmdb_io
from deepspark.proto import deepspark_pb2 as pb

first, second = sys.argv[1:]
layer = text_format.Parse(f'name: "data" type: "Data" top: "data" top: "label" '
                          f'data_param {{ source: "{first}" batch_size: 2 backend: LMDB }}', pb.LayerParameter())
feeder = DataFeeder(layer, "TRAIN", memory_limit=0)
feeder.next_batch()
assert list(lmdb_io._environments) == [first]
feeder.itself = feeder
del feeder
opening = lmdb.open
lmdb.open = lambda *args, **kwargs: (gc.collect(), opening(*args, **kwargs))[1]
with lmdb_io.opened(second) as env:
    print(env.stat()["entries"], list(lmdb_io._environments) == [second])
"""


def test_a_feeder_collected_inside_open_db_closes_its_lmdb_and_the_open_goes_on(ten, tmp_path):
    second = make_lmdb(tmp_path / "three_lmdb", [np.zeros((1, 2, 2), np.uint8)] * 3)
    try:
        done = subprocess.run([sys.executable, "-c", COLLECTED_INSIDE_OPEN, os.path.realpath(ten),
                               os.path.realpath(second)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": ROOT})
    except subprocess.TimeoutExpired:
        pytest.fail("open_db waited for ever: the collector's close_db found open_db's lock held by its own thread")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["3", "True"]  # the collected feeder's LMDB closed, the other one open


def test_feeder_errors(ten, tmp_path):
    with pytest.raises(DataError, match=r"nowhere_lmdb: no such LMDB"):
        DataFeeder(data_layer(str(tmp_path / "nowhere_lmdb")), "TRAIN")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match=r"file: not an LMDB"):
        DataFeeder(data_layer(str(tmp_path / "file")), "TRAIN")
    with pytest.raises(DataError, match=r"shard 0 of 11 is empty: the LMDB holds only 10 records"):
        DataFeeder(data_layer(ten), "TRAIN", shard=0, num_shards=11)
    leveldb = data_layer(ten)
    leveldb.data_param.backend = pb.DataParameter.LEVELDB
    with pytest.raises(ConfigError, match="LEVELDB is not supported"):
        DataFeeder(leveldb, "TRAIN")
    bad = str(tmp_path / "bad_lmdb")
    lmdb_io.write_lmdb(bad, [(b"00000000", encode_datum(np.zeros((1, 2, 2), np.uint8), 0)),
                             (b"00000001", b"\x0a\xff\xff")])
    with pytest.raises(DataError, match=r"bad_lmdb: record '00000001': corrupt Datum"):
        DataFeeder(data_layer(bad), "TRAIN")


def test_source_shape_order(ten, tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(ten))
    assert source_shape(data_layer("ten_lmdb")) == (1, 2, 2)  # relative to cwd
    assert source_shape(data_layer("ten_lmdb"), (3, 9, 9)) == (1, 2, 2)  # the LMDB wins
    assert source_shape(data_layer("missing_lmdb"), (3, 9, 9)) == (3, 9, 9)
    save_mean(np.zeros((3, 5, 6), np.float32), "mean.binaryproto")
    assert source_shape(data_layer("missing_lmdb", transform_text='mean_file: "mean.binaryproto"')) == (3, 5, 6)
    assert source_shape(data_layer(
        "missing_lmdb", transform_text="crop_size: 4 mean_value: 1 mean_value: 2 mean_value: 3")) == (3, 4, 4)
    warning = source_shape(data_layer("missing_lmdb", transform_text="scale: 0.1"))
    assert isinstance(warning, str) and "'missing_lmdb' not found" in warning


# -- writing LMDBs -----------------------------------------------------------------------

def test_write_lmdb_is_atomic_and_grows_its_map(tmp_path):
    out = str(tmp_path / "out_lmdb")
    big = [(f"{i:08d}", os.urandom(4096)) for i in range(300)]
    assert lmdb_io.write_lmdb(out, big, map_size=1 << 16, commit_every=50) == 300
    assert dict(lmdb_io.read_records(out))[b"00000299"] == big[299][1]
    with pytest.raises(DataError, match=r"out_lmdb: already exists"):
        lmdb_io.write_lmdb(out, big[:1])
    assert lmdb_io.count(out) == 300

    def failing():
        yield b"a", b"1"
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        lmdb_io.write_lmdb(out, failing(), overwrite=True)
    assert lmdb_io.count(out) == 300 and leftovers(tmp_path) == []
    with pytest.raises(RuntimeError):
        lmdb_io.write_lmdb(str(tmp_path / "new_lmdb"), failing())
    assert not os.path.exists(tmp_path / "new_lmdb") and leftovers(tmp_path) == []

    def interrupted():
        yield from big[:120]
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        lmdb_io.write_lmdb(str(tmp_path / "int_lmdb"), interrupted(), commit_every=50)
    assert not os.path.exists(tmp_path / "int_lmdb") and leftovers(tmp_path) == []
    assert lmdb_io.write_lmdb(out, big[:2], overwrite=True) == 2
    assert lmdb_io.count(out) == 2 and leftovers(tmp_path) == []


@pytest.mark.parametrize("memory_limit", [None, 0])  # in memory, and streamed from the LMDB
def test_a_feeder_state_lets_another_feeder_go_on_with_the_same_batches(tmp_path, memory_limit):
    rng = np.random.default_rng(0)
    source = make_lmdb(tmp_path / "db", rng.integers(0, 255, size=(23, 1, 6, 6), dtype=np.uint8))
    layer = data_layer(source, batch=5, transform_text="mirror: true crop_size: 4")
    limits = {} if memory_limit is None else {"memory_limit": memory_limit}
    first = DataFeeder(layer, "TRAIN", seed=7, shuffle=True, **limits)
    for _ in range(6):  # into the second epoch: a permutation and both RNGs have moved
        first.next_batch()
    meta, order = first.get_state()
    other = DataFeeder(layer, "TRAIN", seed=99, shuffle=True, **limits)
    untouched = DataFeeder(layer, "TRAIN", seed=99, shuffle=True, **limits)
    other.set_state(json.loads(json.dumps(meta)), order)  # the state travels as JSON + arrays
    for _ in range(8):
        a, b, c = first.next_batch(), other.next_batch(), untouched.next_batch()
        np.testing.assert_array_equal(a["data"], b["data"])
        np.testing.assert_array_equal(a["label"], b["label"])
    assert not np.array_equal(a["data"], c["data"])  # without the state, other batches
    with pytest.raises(ValueError, match="shard of 23 records, not 12"):
        DataFeeder(layer, "TRAIN", shard=1, num_shards=2).set_state(meta, order)
