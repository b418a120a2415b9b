"""Parquet datasets: convert-lmdb both ways, Spark reads ours and we read Spark's, a Data layer on Parquet."""

import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, run_cli
from synthetic import make_job, make_lmdb
from test_data import data_layer, leftovers
from test_data_convert import write_idx
from deepspark.cli import main
from deepspark.data import DataError, DataFeeder, count, missing_source, parquet, peek_shape, source_shape
from deepspark.data import lmdb_io, source_for
from deepspark.proto import deepspark_pb2 as pb

FASHION_TEST = os.path.join(ROOT, "data", "fashion_mnist_test_lmdb")


def records_of(source):
    return list(source_for(source).read())


def to_parquet(lmdb, out, **kwargs):
    return parquet.write_parquet(str(out), lmdb_io.read_records(lmdb), **kwargs)


@pytest.fixture
def small(tmp_path):
    """A 25-record LMDB and the same records as Parquet in row groups of ~4 records."""
    lmdb = make_lmdb(tmp_path / "small_lmdb", 25, seed=5)
    size = len(lmdb_io.first_record(lmdb)[1])
    return lmdb, str(tmp_path / "small.parquet"), to_parquet(lmdb, tmp_path / "small.parquet",
                                                             row_group_bytes=4 * size)


# -- the format -------------------------------------------------------------------------

def test_schema_row_groups_and_record_ranges(small):
    lmdb, path, written = small
    expected = records_of(lmdb)
    file = pq.ParquetFile(path)
    assert written == 25 == count(path) and file.metadata.num_row_groups == 7
    assert file.schema_arrow == pa.schema([("key", pa.string()), ("datum", pa.binary()), ("label", pa.int32())])
    table = file.read()
    assert table.column("label").to_pylist() == [pb.Datum.FromString(v).label for _, v in expected]
    assert records_of(path) == expected
    for start, stop in [(0, 1), (3, 9), (4, 8), (11, 25), (24, 40), (30, 40), (7, 7)]:
        assert list(parquet.read_records(path, start, stop)) == expected[start:stop], (start, stop)
    assert [len(c) for c in parquet.read_chunks(path, 2, 23, chunk=5)] == [2, 4, 4, 4, 4, 3]  # row groups of 4
    assert list(parquet.read_records(f"file://{path}", 5, 6)) == expected[5:6]
    assert peek_shape(path) == (1, 8, 8) and parquet.is_parquet(path)


def test_a_folder_of_part_files_reads_in_name_order_and_writes_atomically(small, tmp_path):
    lmdb, path, _ = small
    expected = records_of(lmdb)
    folder = tmp_path / "parts"
    folder.mkdir()
    table = pq.read_table(path)
    for name, start, stop in [("part-00002.parquet", 20, 25), ("part-00000.parquet", 0, 12),
                              ("part-00001.parquet", 12, 20)]:
        pq.write_table(table.slice(start, stop - start), folder / name)
    (folder / "_SUCCESS").write_text("")
    (folder / ".part-00000.parquet.crc").write_text("not parquet")
    assert parquet.is_parquet(str(folder)) and count(str(folder)) == 25
    assert records_of(str(folder)) == expected
    assert list(parquet.read_records(str(folder), 10, 22)) == expected[10:22]
    # A destination without .parquet is a folder with one part file, as Spark would write it.
    out = str(tmp_path / "as_folder")
    assert parquet.write_parquet(out, iter(expected)) == 25
    assert os.listdir(out) == ["part-00000.parquet"] and records_of(out) == expected
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("memory_limit", [None, 0])  # in memory, and streamed a window at a time
def test_feeder_on_parquet_gives_the_lmdbs_batches_by_shard_wrapping_at_the_end(small, memory_limit):
    lmdb, path, _ = small
    kwargs = {} if memory_limit is None else {"memory_limit": memory_limit}
    for shard in range(2):
        with DataFeeder(data_layer(lmdb, batch=5), shard=shard, num_shards=2, **kwargs) as theirs, \
                DataFeeder(data_layer(path, batch=5), shard=shard, num_shards=2, **kwargs) as ours:
            assert ours.in_memory == (memory_limit is None) and (ours.start, ours.size) == (theirs.start, theirs.size)
            for _ in range(7):  # 35 records of a 12- or 13-record shard: across the seam, twice
                a, b = theirs.next_batch(), ours.next_batch()
                np.testing.assert_array_equal(a["data"], b["data"])
                np.testing.assert_array_equal(a["label"], b["label"])
            assert ours.epoch == theirs.epoch == 2
    layer = data_layer(path)
    assert source_shape(layer) == (1, 8, 8) and missing_source(layer) is None


def test_real_fashion_mnist_test_set_streams_the_same_batches(tmp_path):
    if not lmdb_io.is_lmdb(FASHION_TEST):
        pytest.skip("run `make setup` for data/fashion_mnist_test_lmdb")
    path = str(tmp_path / "t10k.parquet")
    assert to_parquet(FASHION_TEST, path) == 10000 == count(path)
    transform = "scale: 0.00390625"
    with DataFeeder(data_layer(FASHION_TEST, 64, transform), pb.TEST, memory_limit=0) as theirs, \
            DataFeeder(data_layer(path, 64, transform), pb.TEST, memory_limit=0) as ours:
        for _ in range(160):  # 10,240 records: one epoch and a wrap
            a, b = theirs.next_batch(), ours.next_batch()
            np.testing.assert_array_equal(a["data"], b["data"])
            np.testing.assert_array_equal(a["label"], b["label"])


# -- convert-lmdb, convert-mnist --------------------------------------------------------

@pytest.mark.caffe
def test_lmdb_parquet_lmdb_round_trip_is_byte_identical_and_feeds_caffes_data_layer(tmp_path):
    from test_caffe_interop import caffe_batches, our_batches

    lmdb = make_lmdb(tmp_path / "a_lmdb", 37, seed=9)
    middle, back = str(tmp_path / "a.parquet"), str(tmp_path / "b_lmdb")
    status, _, err = run_cli("convert-lmdb", lmdb, middle)
    assert status == 0 and "A total of 37 records" in err and "Processed 37 of 37 records." in err, err
    status, _, err = run_cli("convert-lmdb", middle, back)
    assert status == 0, err
    assert records_of(back) == records_of(lmdb) == records_of(middle)
    transform = "scale: 0.00390625"
    theirs = caffe_batches(tmp_path, back, transform, 10, 5)  # 50 of 37 records: Caffe wraps too
    expected = [pb.Datum.FromString(v) for _, v in records_of(lmdb)]
    labels = np.concatenate([batch["label"] for batch in theirs])
    assert labels.tolist() == [float(expected[i % 37].label) for i in range(50)]
    first = np.frombuffer(expected[0].data, np.uint8).reshape(1, 8, 8)
    np.testing.assert_allclose(theirs[0]["data"][0], first / 256.0, rtol=1e-6)
    for a, b in zip(theirs, our_batches(middle, transform, 10, 5)):
        np.testing.assert_allclose(a["data"], b["data"], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(a["label"], b["label"])
    assert leftovers(tmp_path) == []


def test_convert_mnist_to_parquet_equals_lmdb_then_convert_lmdb(tmp_path):
    rng = np.random.default_rng(3)
    images = write_idx(tmp_path / "images.gz", 2051, (30, 6, 5), rng.integers(0, 256, 900, np.uint8), gz=True)
    labels = write_idx(tmp_path / "labels", 2049, (30,), rng.integers(0, 10, 30, np.uint8))
    direct, lmdb, converted = (str(tmp_path / name) for name in ("direct.parquet", "m_lmdb", "converted.parquet"))
    for args in [(images, labels, direct), (images, labels, lmdb)]:
        status, _, err = run_cli("convert-mnist", *args)
        assert status == 0, err
    assert run_cli("convert-lmdb", lmdb, converted)[0] == 0
    assert pq.read_table(direct).equals(pq.read_table(converted))
    assert records_of(direct) == records_of(lmdb) and len(records_of(direct)) == 30


def test_bad_inputs_are_one_line_and_leave_nothing(small, tmp_path, capfd):
    lmdb, path, _ = small
    no_datum = tmp_path / "no_datum.parquet"
    pq.write_table(pa.table({"key": ["a"], "image": [b"x"]}), no_datum)

    def fails(*args):
        status = main(["convert-lmdb", *args])  # the command's own error handling, in this process
        err = capfd.readouterr().err
        assert status == 1, err
        return err.strip().splitlines()[-1]

    line = fails(str(no_datum), str(tmp_path / "out_lmdb"))
    assert line.startswith("deepspark convert-lmdb: error: ") and "has no 'datum' column" in line, line
    with pytest.raises(DataError, match="has no 'datum' column"):
        DataFeeder(data_layer(str(no_datum)))
    assert "already exists" in fails(lmdb, path)
    assert "the output is an LMDB" in fails(path, str(tmp_path / "again.parquet"))
    (tmp_path / "empty").mkdir()
    assert "neither an LMDB" in fails(str(tmp_path / "empty"), str(tmp_path / "x.parquet"))
    assert "no such LMDB or Parquet dataset" in fails(str(tmp_path / "nothing_lmdb"), str(tmp_path / "y.parquet"))
    assert "pyarrow cannot open hdfs:// here" in fails("hdfs://namenode:8020/train.parquet", str(tmp_path / "h_lmdb"))
    # A corrupt record after many good ones: no output, no temp left, either way.
    good = lmdb_io.read_records(lmdb)
    lmdb_io.write_lmdb(str(tmp_path / "bad_lmdb"), (*good, (b"zzz", b"\xff\xff not a datum")))
    assert "record 'zzz': corrupt Datum" in fails(str(tmp_path / "bad_lmdb"), str(tmp_path / "bad.parquet"))
    table = pq.read_table(path)
    keys = table.column("key").to_pylist()
    nulls = table.set_column(1, "datum", pa.array([b"x"] * 24 + [None], pa.binary()))
    pq.write_table(nulls, tmp_path / "nulls.parquet", row_group_size=4)
    assert "a row's datum is null" in fails(str(tmp_path / "nulls.parquet"), str(tmp_path / "n_lmdb"))
    repeats = table.set_column(0, "key", pa.array(keys[:-1] + keys[-2:-1], pa.string()))
    pq.write_table(repeats, tmp_path / "repeats.parquet")
    assert "repeats, and an LMDB holds one record per key" in fails(str(tmp_path / "repeats.parquet"),
                                                                    str(tmp_path / "r_lmdb"))
    assert sorted(os.listdir(tmp_path)) == ["bad_lmdb", "empty", "no_datum.parquet", "nulls.parquet", "repeats.parquet",
                                            "small.parquet", "small_lmdb"]
    # Where a source lives: a missing local path is named; a URI is left to its reader.
    assert "source '/nowhere/x.parquet' not found" in missing_source(data_layer("/nowhere/x.parquet"))
    assert missing_source(data_layer("hdfs://namenode/train.parquet")) is None
    assert "pyarrow cannot open hdfs:// here" in source_shape(data_layer("hdfs://namenode/train.parquet"))


# -- Spark reads ours, we read Spark's; one training run on each ------------------------

SPARK_SCRIPT = """
import json, sys
from pyspark.sql import Row
from deepspark.spark.session import spark_session
from deepspark.proto import deepspark_pb2 as pb
ours, theirs = sys.argv[1:]
spark, _ = spark_session(pb.DeepSparkParameter(), 1)
df = spark.read.parquet(ours)
rows = [(r.key, bytes(r.datum), r.label) for r in df.collect()]
print(json.dumps({"columns": df.columns, "types": [f.dataType.simpleString() for f in df.schema.fields],
                  "rows": [(k, d.hex(), l) for k, d, l in rows]}))
spark.createDataFrame([Row(key=k, datum=bytearray(d), label=l) for k, d, l in rows]).repartition(3) \\
    .sortWithinPartitions("key").write.parquet(theirs)
spark.stop()
"""


@pytest.mark.spark
def test_spark_reads_what_we_write_and_we_read_what_spark_writes(small, tmp_path):
    lmdb, path, _ = small
    theirs = str(tmp_path / "spark_out")
    done = subprocess.run([sys.executable, "-c", SPARK_SCRIPT, path, theirs], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    import json
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    expected = records_of(lmdb)
    assert seen["columns"] == ["key", "datum", "label"] and seen["types"] == ["string", "binary", "int"]
    assert [(k.encode(), bytes.fromhex(d)) for k, d, _ in seen["rows"]] == expected
    assert [label for *_, label in seen["rows"]] == [pb.Datum.FromString(v).label for _, v in expected]
    parts = sorted(name for name in os.listdir(theirs) if name.startswith("part-"))
    assert len(parts) == 3 and parquet.is_parquet(theirs)
    by_part = [pq.read_table(os.path.join(theirs, name)).column("key").to_pylist() for name in parts]
    ours = records_of(theirs)  # part files in name order, rows in file order
    assert [key.decode() for key, _ in ours] == [key for keys in by_part for key in keys]
    assert sorted(ours) == expected and count(theirs) == 25


def losses(log):
    return re.findall(r"Iteration (\d+).*loss = ([-\d.e+]+)", log)


def test_single_process_run_on_parquet_gives_the_lmdbs_losses(tmp_path):
    solver = make_job(tmp_path, max_iter=30, test_interval=30, workers=1)
    net = (tmp_path / "net.prototxt").read_text()
    for name in ("train", "test"):
        to_parquet(str(tmp_path / f"{name}_lmdb"), tmp_path / f"{name}.parquet")
        net = net.replace(f'"{tmp_path / f"{name}_lmdb"}"', f'"{tmp_path / f"{name}.parquet"}"')
    assert net.count(".parquet") == 2
    (tmp_path / "pq").mkdir()
    (tmp_path / "pq" / "net.prototxt").write_text(net)
    (tmp_path / "pq" / "solver.prototxt").write_text(
        open(solver).read().replace(str(tmp_path / "net.prototxt"), str(tmp_path / "pq" / "net.prototxt"))
        .replace(str(tmp_path / "out"), str(tmp_path / "pq" / "out")))
    # `deepspark train --solver S --algorithm single` on each, in one process: TensorFlow starts once.
    code = ("import sys; from deepspark.cli import main\n"
            "for solver in sys.argv[1:]:\n"
            "    print('=== run', file=sys.stderr, flush=True)\n"
            "    assert main(['train', '--solver', solver, '--algorithm', 'single']) == 0\n")
    done = subprocess.run([sys.executable, "-c", code, solver, str(tmp_path / "pq" / "solver.prototxt")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    logs = done.stderr.split("=== run")[1:]
    assert len(logs) == 2 and len(losses(logs[0])) >= 2 and losses(logs[0]) == losses(logs[1])
    accuracy = [re.findall(r"accuracy = ([\d.]+)", log) for log in logs]
    assert accuracy[0] and accuracy[0] == accuracy[1]
