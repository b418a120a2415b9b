"""Record sources behind one interface: each kind reads the same records, a shard exactly its own, a feeder resumes."""

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from synthetic import make_lmdb
from test_data import data_layer
from deepspark.data import DataError, DataFeeder, SOURCES, encode_datum, feeder, feeder_for, source_for
from deepspark.data.sources import LmdbSource, ParquetSource, write_records
from deepspark.proto import deepspark_pb2 as pb
from google.protobuf import text_format


@pytest.fixture
def kinds(tmp_path):
    """{kind: location} of 23 records: an LMDB, the same as Parquet written through the interface, and the same
    as a Parquet file pyarrow wrote (two row groups) -- each a source_for location."""
    lmdb = make_lmdb(tmp_path / "a_lmdb", 23, seed=3)
    records = list(LmdbSource(lmdb).read())
    ours = str(tmp_path / "ours.parquet")
    assert write_records(ours, iter(records)) == 23
    theirs = str(tmp_path / "theirs")
    os.mkdir(theirs)
    table = pa.table({"key": [k.decode() for k, _ in records], "datum": [v for _, v in records]})
    pq.write_table(table, os.path.join(theirs, "part-0.parquet"), row_group_size=10)
    return {"lmdb": lmdb, "parquet": ours, "pyarrow": theirs}, records


def test_every_kind_reads_the_same_records_through_the_interface(kinds):
    locations, records = kinds
    for name, location in locations.items():
        source = source_for(location)
        assert source.name == ("lmdb" if name == "lmdb" else "parquet") and source.describe().endswith(location)
        assert source.count() == 23, name
        assert list(source.read()) == records, name
        assert list(source.read(5, 9, keys_only=True)) == [k for k, _ in records[5:9]], name
        assert source.first_record() == records[0], name
        assert max(len(block) for block in source.chunks(2, 21, chunk=8)) <= 8, name  # a row group may cut one
        assert [r for block in source.chunks(2, 21, chunk=8) for r in block] == records[2:21], name


def test_a_shard_reads_exactly_its_records_and_an_empty_one_says_so(kinds):
    locations, records = kinds
    for location in locations.values():
        source = source_for(location)
        shards = [source.shard(i, 3) for i in range(3)]
        assert [(s.start, s.stop) for s in shards] == [(0, 7), (7, 15), (15, 23)]
        for shard in shards:
            assert list(shard.read()) == records[shard.start:shard.stop]
            assert [r for block in shard.chunks(2, chunk=3) for r in block] == records[shard.start + 2:shard.stop]
            assert shard.first_record() == records[shard.start]
        with pytest.raises(DataError, match=rf"shard 0 of 24 is empty: the {source.kind} holds only 23 records"):
            source.shard(0, 24)


def test_the_registry_picks_the_kind_and_the_converter_its_counterpart(tmp_path, kinds):
    locations, _ = kinds
    assert list(SOURCES) == ["dataframe", "parquet", "lmdb"]
    assert isinstance(source_for("hdfs://host/x"), ParquetSource) and isinstance(source_for("x_lmdb"), LmdbSource)
    assert SOURCES[source_for(locations["lmdb"]).counterpart] is ParquetSource
    assert SOURCES[source_for(locations["parquet"]).counterpart] is LmdbSource
    os.mkdir(tmp_path / "empty")
    assert source_for(locations["lmdb"]).present() and not source_for(str(tmp_path / "empty")).present()
    assert "a local folder" in LmdbSource.output_refusal("out.parquet") and LmdbSource.output_refusal("out") is None
    with pytest.raises(DataError, match="Parquet dataset has no lookup by key"):
        source_for(locations["parquet"]).lookup()
    lookup = source_for(locations["lmdb"]).lookup()
    assert lookup.values([b"00000003"]) == [dict(kinds[1])[b"00000003"]]
    lookup.close()


@pytest.mark.parametrize("shuffle", [True, "blocks"])
@pytest.mark.parametrize("kind", ["lmdb", "parquet"])
@pytest.mark.parametrize("memory_limit", [None, 0], ids=["held", "streamed"])
def test_a_feeder_resumes_where_another_stopped(kinds, kind, memory_limit, shuffle, small_blocks):
    if shuffle is True and kind == "parquet" and memory_limit == 0:
        pytest.skip("a streamed Parquet shard has no lookup by key: it shuffles by blocks")
    location = kinds[0][kind]
    make = lambda: DataFeeder(data_layer(location, 5), pb.TRAIN, shard=1, num_shards=2, seed=7, shuffle=shuffle,
                              memory_limit=memory_limit)
    with make() as first, make() as second:
        for _ in range(4):  # into the second epoch of the 12-record shard
            first.next_batch()
        meta, order = first.get_state()
        second.set_state(json.loads(json.dumps(meta)), order)
        for _ in range(5):
            a, b = first.next_batch(), second.next_batch()
            np.testing.assert_array_equal(a["data"], b["data"])
            np.testing.assert_array_equal(a["label"], b["label"])
        assert first.epoch == second.epoch == 3  # 45 records of a 12-record shard


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 3 of the 64-byte records (1x8x8 uint8), a shuffle buffer of 2 blocks."""
    monkeypatch.setattr(feeder, "BLOCK_BYTES", 3 * 64)
    monkeypatch.setattr(feeder, "STREAM_WINDOW_BYTES", 2 * 3 * 64)


@pytest.mark.parametrize("kind", ["lmdb", "parquet", "pyarrow"])
def test_a_shard_shuffled_by_blocks_sees_every_record_once_an_epoch_in_a_new_order(tmp_path, kind, small_blocks):
    images = np.random.default_rng(0).integers(0, 255, (23, 1, 8, 8), dtype=np.uint8)
    lmdb = make_indexed_lmdb(tmp_path / "indexed_lmdb", images)  # label i: record i
    location = {"lmdb": lmdb, "parquet": str(tmp_path / "i.parquet"), "pyarrow": str(tmp_path / "i")}[kind]
    if kind == "parquet":
        write_records(location, LmdbSource(lmdb).read())
    elif kind == "pyarrow":  # row groups of 5 cut the blocks of 3
        os.mkdir(location)
        keys, values = zip(*LmdbSource(lmdb).read())
        pq.write_table(pa.table({"key": [k.decode() for k in keys], "datum": list(values)}),
                       os.path.join(location, "part-0.parquet"), row_group_size=5)

    def epochs(seed, memory_limit=None):  # 5 epochs of the 23 records (8 blocks, the last of 2) in batches of 5
        with DataFeeder(data_layer(location, 5), pb.TRAIN, seed=seed, shuffle="blocks",
                        memory_limit=memory_limit) as fed:
            labels = [int(label) for _ in range(23) for label in fed.next_batch()["label"]]
            return [labels[i:i + 23] for i in range(0, 115, 23)], fed._stream and fed._stream.reads

    first, _ = epochs(1)
    assert all(sorted(epoch) == list(range(23)) for epoch in first)
    assert all(a != b for a, b in zip(first, first[1:])) and first[0] != list(range(23))
    for epoch in first:  # a shuffle buffer of 6: each run of 6 positions from 3 blocks at most (one cut short)
        assert all(len({label // 3 for label in epoch[i:i + 6]}) <= 3 for i in range(0, 23, 6)), epoch
    streamed, reads = epochs(1, memory_limit=0)
    # Held or streamed, the same order; streamed, each block read once an epoch at most, and 4 blocks held at most
    # (so at least 4 of the 8 read again each later epoch).
    assert streamed == first and 8 + 4 * 4 <= reads <= 8 * 5, reads
    assert epochs(1)[0] == first and epochs(2)[0] != first


def make_indexed_lmdb(path, images):
    return write_and_return(str(path), [(b"%08d" % i, encode_datum(image, i)) for i, image in enumerate(images)])


def write_and_return(path, records):
    LmdbSource.write(path, iter(records))
    return path


def test_an_hdf5_feeder_shares_the_resumable_interface(tmp_path):
    for i in range(3):
        with h5py.File(tmp_path / f"{i}.h5", "w") as h5:
            h5["data"] = np.arange(i * 40, i * 40 + 40, dtype=np.float32).reshape(10, 4)
            h5["label"] = np.arange(i * 10, i * 10 + 10, dtype=np.float32)
    (tmp_path / "list.txt").write_text("\n".join(str(tmp_path / f"{i}.h5") for i in range(3)))
    layer = text_format.Parse(f'name: "h5" type: "HDF5Data" top: "data" top: "label" hdf5_data_param {{ '
                              f'source: "{tmp_path / "list.txt"}" batch_size: 4 shuffle: true }}', pb.LayerParameter())
    first, second = feeder_for(layer, seed=3), feeder_for(layer, seed=3)
    for _ in range(9):  # 36 rows: a pass of 30 and into the next
        first.next_batch()
    meta, order = first.get_state()
    second.set_state(json.loads(json.dumps(meta)), order)
    served = [first.next_batch()["label"] for _ in range(16)]  # rows 36..99: the third pass whole
    assert all(np.array_equal(a, second.next_batch()["label"]) for a in served)
    assert first.epoch == second.epoch == 3 and sorted(np.concatenate(served)[24:54]) == list(range(30))
    with pytest.raises(ValueError, match="the state is of a shard of 30 rows, not 15"):
        feeder_for(layer, shard=0, num_shards=2).set_state(meta, order)


DATAFRAME = """
import json, sys
from deepspark.data import source_for
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.session import spark_session
spark, _ = spark_session(pb.DeepSparkParameter(), 1)
records = list(source_for(sys.argv[1]).read())
df = spark.createDataFrame([(bytearray(v),) for _, v in records[::-1]], "datum binary")
source = source_for(df)
mine = list(source.read())
shard = source.shard(1, 3)
print(json.dumps({"name": source.name, "count": source.count(), "describe": source.describe(),
                  "same": [v for _, v in mine] == [v for _, v in records[::-1]],
                  "keys": [k.decode() for k, _ in mine[:2]],
                  "shard": [shard.start, shard.stop, list(shard.read()) == mine[shard.start:shard.stop]]}))
"""


@pytest.mark.spark
def test_a_dataframe_is_a_record_source_too(kinds):
    done = subprocess.run([sys.executable, "-c", DATAFRAME, kinds[0]["lmdb"]], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said == {"name": "dataframe", "count": 23, "describe": "a DataFrame of ['datum']", "same": True,
                    "keys": ["00000000", "00000001"], "shard": [7, 15, True]}
