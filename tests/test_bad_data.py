"""Bad data (#13): a corrupt Datum, a record of another shape, a truncated or unreadable LMDB, a Parquet row without its datum: one line naming the source, the record and what is wrong; nothing half-written."""

import glob
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, run_cli
from synthetic import make_job
from test_data import leftovers
from deepspark.cli import main
from deepspark.data import DataError, encode_datum, lmdb_io
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark import executor, shards

# make_job's train LMDB holds 200 records of 1x8x8 and two workers split it 0-99, 100-199: record 150 is in
# the middle of worker 1's shard, far from either end of the LMDB.
BAD = 150
KEY = "00000150"
FIRST_IS = "the first record is 1x8x8 uint8; records must be one size (convert-imageset --resize-height/--resize-width)"
# Each bad record, and what the one line says about it after `SOURCE: `.
RECORDS = {
    "not a Datum": (b"\xff\xff\xff not a datum",
                    rf"record '{KEY}': corrupt Datum \(Error parsing message[^)]*\)"),
    "data of another length": (pb.Datum(channels=1, height=8, width=8, data=bytes(63), label=1).SerializeToString(),
                               rf"record '{KEY}': data holds 63 bytes, expected 64 for 1x8x8"),
    "another channel count": (encode_datum(np.zeros((3, 8, 8), np.uint8), 1),
                              rf"record '{KEY}' is 3x8x8 uint8 but {re.escape(FIRST_IS)}"),
    "another size": (encode_datum(np.zeros((1, 9, 9), np.uint8), 1),
                     rf"record '{KEY}' is 1x9x9 uint8 but {re.escape(FIRST_IS)}"),
}


def with_record(lmdb, index, value):
    """Rewrite the LMDB at `lmdb` with record `index`'s value replaced (its key kept)."""
    records = list(lmdb_io.read_records(lmdb))
    records[index] = (records[index][0], value)
    lmdb_io.write_lmdb(lmdb, records, overwrite=True)
    return lmdb


def bad_job(folder, value):
    """make_job (2 workers, snapshots every 10 iterations) with record BAD of its train LMDB replaced."""
    solver = make_job(folder, max_iter=40, test_interval=0, snapshot=10)
    return solver, with_record(str(folder / "train_lmdb"), BAD, value)


def last_line(err):
    lines = err.strip().splitlines()
    assert lines, "no error line"
    return lines[-1]


def nothing_half_written(folder):
    """No snapshot from the failed run, no temp name of any write; [] when all is well."""
    found = glob.glob(str(folder / "**" / "*.caffemodel"), recursive=True)
    found += glob.glob(str(folder / "**" / "*.solverstate"), recursive=True)
    found += glob.glob(str(folder / "**" / "*.tmp-*"), recursive=True) + glob.glob(str(folder / "**" / "*.old-*"),
                                                                                    recursive=True)
    return found


# -- one process: `deepspark train --algorithm single` ---------------------------------------

def test_the_cli_names_a_corrupt_datum_in_one_last_line(tmp_path):
    solver, train = bad_job(tmp_path, RECORDS["not a Datum"][0])
    status, _, err = run_cli("train", "--solver", solver, "--algorithm", "single")
    assert status == 1, err[-3000:]
    assert re.fullmatch(rf"deepspark train: error: {re.escape(train)}: {RECORDS['not a Datum'][1]}",
                        last_line(err)), err[-3000:]
    assert nothing_half_written(tmp_path) == []


@pytest.mark.parametrize("case", list(RECORDS))
def test_a_single_run_names_the_record_and_what_is_wrong(case, tmp_path, capfd):
    value, said = RECORDS[case]
    solver, train = bad_job(tmp_path, value)
    status = main(["train", "--solver", solver, "--algorithm", "single"])  # the verb's own error handling
    err = capfd.readouterr().err
    assert status == 1, err[-3000:]
    assert re.fullmatch(rf"deepspark train: error: {re.escape(train)}: {said}", last_line(err)), err[-3000:]
    assert nothing_half_written(tmp_path) == []


def truncated(lmdb):
    data = os.path.join(lmdb, "data.mdb")
    size = os.path.getsize(data)
    os.truncate(data, size // 2)
    return f"truncated: its data.mdb holds {size // 2} bytes but its pages run to byte {size}; copy or rebuild the LMDB"


def not_an_lmdb(lmdb):
    with open(os.path.join(lmdb, "data.mdb"), "wb") as stream:
        stream.write(b"not an LMDB " * 1000)
    return "not a readable LMDB (MDB_INVALID: File is not an LMDB file)"


def emptied(lmdb):
    os.truncate(os.path.join(lmdb, "data.mdb"), 0)
    return "not a readable LMDB (its data.mdb is empty)"


@pytest.mark.parametrize("damage", [truncated, not_an_lmdb, emptied])
def test_a_truncated_or_unreadable_lmdb_is_one_line_not_a_crash(damage, tmp_path, capfd):
    # Read as it is, a data.mdb cut short kills the process with SIGBUS (LMDB maps the file) and no line at all.
    solver = make_job(tmp_path, max_iter=40, test_interval=0, snapshot=10)
    train = str(tmp_path / "train_lmdb")
    said = damage(train)
    assert main(["train", "--solver", solver, "--algorithm", "single"]) == 1
    assert last_line(capfd.readouterr().err) == f"deepspark train: error: {train}: {said}"
    out = str(tmp_path / "mean.binaryproto")
    assert main(["compute-image-mean", train, out]) == 1
    assert last_line(capfd.readouterr().err) == f"deepspark compute-image-mean: error: {train}: {said}"
    assert main(["convert-lmdb", train, str(tmp_path / "train.parquet")]) == 1
    assert last_line(capfd.readouterr().err) == f"deepspark convert-lmdb: error: {train}: {said}"
    assert sorted(os.listdir(tmp_path)) == ["net.prototxt", "out", "solver.prototxt", "test_lmdb", "train_lmdb"]
    assert nothing_half_written(tmp_path) == []


# -- the converters -------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["not a Datum", "another size"])
def test_the_converters_name_the_record_and_leave_no_output(case, tmp_path, capfd):
    _, train = bad_job(tmp_path, RECORDS[case][0])
    mean, parquet = str(tmp_path / "mean.binaryproto"), str(tmp_path / "train.parquet")
    assert main(["compute-image-mean", train, mean]) == 1
    line = last_line(capfd.readouterr().err)
    if case == "another size":  # compute-image-mean names the first record by its key
        assert line == (f"deepspark compute-image-mean: error: {train}: record '{KEY}' is 1x9x9 but record "
                        "'00000000' is 1x8x8; a mean needs images of one size"), line
    else:
        assert re.fullmatch(rf"deepspark compute-image-mean: error: {re.escape(train)}: {RECORDS[case][1]}", line)
    if case == "not a Datum":  # convert-lmdb copies records as they are: only one that is no Datum stops it
        assert main(["convert-lmdb", train, parquet]) == 1
        line = last_line(capfd.readouterr().err)
        assert re.fullmatch(rf"deepspark convert-lmdb: error: {re.escape(train)}: {RECORDS[case][1]}", line)
    assert not os.path.exists(mean) and not os.path.exists(parquet) and leftovers(tmp_path) == []


# -- a Parquet dataset, read in this process ----------------------------------------------------

def parquet_job(folder, table):
    """make_job's job in `folder` (made) with its TRAIN Data layer reading `table`, written as a Parquet file."""
    path = str(folder / "train.parquet")
    pq.write_table(table, path, row_group_size=64)
    net = folder / "net.prototxt"
    net.write_text(net.read_text().replace(str(folder / "train_lmdb"), path))
    return str(folder / "solver.prototxt"), path


def train_table(folder, **columns):
    """The train LMDB's 200 records as a table of key, datum, label, with columns replaced by `columns`."""
    records = list(lmdb_io.read_records(str(folder / "train_lmdb")))
    table = {"key": pa.array([key.decode() for key, _ in records], pa.string()),
             "datum": pa.array([value for _, value in records], pa.binary()),
             "label": pa.array([pb.Datum.FromString(value).label for _, value in records], pa.int32())}
    table.update(columns)
    return pa.table({name: column for name, column in table.items() if column is not None})


def test_a_single_run_on_parquet_names_a_null_datum_or_a_missing_column(tmp_path, capfd):
    make_job(tmp_path, max_iter=40, test_interval=0, snapshot=10)
    datums = [value for _, value in lmdb_io.read_records(str(tmp_path / "train_lmdb"))]
    solver, path = parquet_job(tmp_path, train_table(tmp_path, datum=pa.array(
        datums[:BAD] + [None] + datums[BAD + 1:], pa.binary())))
    assert main(["train", "--solver", solver, "--algorithm", "single"]) == 1
    assert last_line(capfd.readouterr().err) == (f"deepspark train: error: {path}: a row's datum is null "
                                                 f"(row {BAD}, key '{KEY}'); every row needs its datum")
    pq.write_table(train_table(tmp_path, datum=None), path)
    assert main(["train", "--solver", solver, "--algorithm", "single"]) == 1
    assert last_line(capfd.readouterr().err) == (
        f"deepspark train: error: {path}: has no 'datum' column (it has key, label); a dataset has columns key, "
        "datum, label, as deepspark convert-lmdb writes them")
    assert main(["convert-lmdb", path, str(tmp_path / "back_lmdb")]) == 1
    assert "has no 'datum' column" in last_line(capfd.readouterr().err)
    assert not os.path.exists(tmp_path / "back_lmdb") and nothing_half_written(tmp_path) == []


# -- the Spark worker's spill, in this process --------------------------------------------------

@pytest.mark.parametrize("case", list(RECORDS))
def test_the_spill_names_the_lmdb_and_key_and_leaves_no_shard(case, tmp_path, monkeypatch):
    value, said = RECORDS[case]
    _, train = bad_job(tmp_path, value)
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path / "local"))
    with pytest.raises(DataError) as error:
        executor.spill(shards.Range(train, 100, 200, 200), "job0", 1)
    assert re.fullmatch(f"{re.escape(train)}: {said}", str(error.value))
    assert os.listdir(executor.job_dir("job0")) == []  # neither the shard nor its temp name
    # Worker 0's shard is good: its spill is the records as they are, under their LMDB keys.
    path, count, _ = executor.spill(shards.Range(train, 0, 100, 200), "job0", 0)
    assert count == 100 and list(lmdb_io.read_records(path)) == list(lmdb_io.read_records(train, 0, 100))


def test_a_dataframe_row_that_is_no_datum_is_named_by_its_row():
    good = encode_datum(np.zeros((1, 8, 8), np.uint8), 1)
    assert shards.row_datum(5, {"datum": bytearray(good)}, (1, 8, 8)) == good
    with pytest.raises(DataError, match=r"^DataFrame row 5: its 'datum' is null; every row needs its Datum bytes$"):
        shards.row_datum(5, {"datum": None}, (1, 8, 8))
    with pytest.raises(DataError, match=r"^DataFrame row 5: corrupt Datum \(Error parsing message"):
        shards.row_datum(5, {"datum": RECORDS["not a Datum"][0]}, (1, 8, 8))
    with pytest.raises(DataError, match=rf"^DataFrame row 5 is 1x9x9 uint8 but {re.escape(FIRST_IS)}$"):
        shards.row_datum(5, {"datum": RECORDS["another size"][0]}, (1, 8, 8))


# -- real Spark (local[2]) -------------------------------------------------------------------------

@pytest.mark.spark
def test_a_spark_job_names_the_lmdb_and_key_and_snapshots_nothing(tmp_path):
    solver, train = bad_job(tmp_path, RECORDS["not a Datum"][0])
    local = tmp_path / "local"
    local.mkdir()
    # --max-failures 1: the spill meets the same record on every retry (the default 4 attempts give the same line).
    status, _, err = run_cli("train", "--solver", solver, "--workers", "2", "--max-failures", "1",
                             env={"SPARK_LOCAL_DIRS": str(local)})
    assert status == 1, err[-3000:]
    assert re.fullmatch(rf"deepspark train: error: the Spark job failed: {re.escape(train)}: "
                        rf"{RECORDS['not a Datum'][1]}; Spark reports .*", last_line(err)), err[-3000:]
    # Local mode's workers spill into Spark's block manager folders, which Spark removes when it stops; that a
    # failed spill leaves nothing of itself is test_the_spill_names_the_lmdb_and_key_and_leaves_no_shard's.
    assert glob.glob(str(local / "**" / "shard-*"), recursive=True) == []
    assert nothing_half_written(tmp_path) == []  # the driver snapshots only once every worker has joined


SPARK_SCRIPT = """
import sys
import numpy as np
from deepspark.data import encode_datum
from deepspark.errors import DeepSparkError
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.failures import failed
from deepspark.spark.shards import dataframe_shards, parquet_records
from deepspark.spark.session import spark_session

spark, _ = spark_session(pb.DeepSparkParameter(max_failures=1), 2)


def said(plan):
    try:
        rdd = plan()[0]
        return f"{rdd.count()} records"
    except DeepSparkError as error:  # the driver's own check
        return f"error: {error}"
    except Exception as error:  # an executor's, as the job's one line gives it
        return "error: " + str(failed(error, spark.sparkContext)).split("; Spark reports")[0]


for path in sys.argv[1:]:
    print(said(lambda: parquet_records(spark, path)))
# A DataFrame's rows are checked by row_datum on the executors (its other cases are tested in-process).
good = encode_datum(np.zeros((1, 8, 8), np.uint8), 1)
df = spark.createDataFrame([(good,)] * 5 + [(b"not a datum",)] + [(good,)] * 4, "datum binary")
print(said(lambda: dataframe_shards(df, 2)))
"""


@pytest.mark.spark
def test_spark_names_a_bad_parquet_row_or_dataframe_row(tmp_path):
    make_job(tmp_path)
    records = list(lmdb_io.read_records(str(tmp_path / "train_lmdb")))

    def dataset(name, bad):
        """The train records as a Parquet folder of two part files (rows 0-99, 100-199), record BAD's datum `bad`."""
        folder = tmp_path / name
        folder.mkdir()
        datums = [bad if index == BAD else value for index, (_, value) in enumerate(records)]
        for part in (0, 1):
            rows = slice(100 * part, 100 * part + 100)
            table = pa.table({"key": [key.decode() for key, _ in records[rows]],
                              "datum": pa.array(datums[rows], pa.binary())})
            pq.write_table(table, folder / f"part-{part:05d}.parquet")
        return str(folder)

    paths = [dataset("not_a_datum", RECORDS["not a Datum"][0]), dataset("another_size", RECORDS["another size"][0]),
             dataset("null", None), str(tmp_path / "no_datum.parquet")]
    pq.write_table(pa.table({"key": ["a"], "image": [b"x"]}), paths[-1])
    done = subprocess.run([sys.executable, "-c", SPARK_SCRIPT, *paths], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    # Spark names a part file by its URI; the row is the row in that file (record BAD is row 50 of the second).
    failed, part, row = "error: the Spark job failed: ", "file:(?://)?{}/part-00001\\.parquet", f"row {BAD - 100}"
    expected = [
        rf"{failed}{part.format(re.escape(paths[0]))}: {row}: corrupt Datum \(Error parsing message[^)]*\)",
        rf"{failed}{part.format(re.escape(paths[1]))}: {row} is 1x9x9 uint8 but {re.escape(FIRST_IS)}",
        rf"{failed}{part.format(re.escape(paths[2]))}: a row's datum is null \({row}\); every row needs its datum",
        rf"error: {re.escape(paths[3])}: the Parquet dataset has no 'datum' column \(Caffe Datum bytes\) but "
        r"\['key', 'image'\]; deepspark convert-lmdb writes key, datum, label",
        rf"{failed}DataFrame row 5: corrupt Datum \(Error parsing message[^)]*\)",
    ]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(expected), done.stdout + done.stderr[-3000:]
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
