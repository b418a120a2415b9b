"""Benchmark of batch assembly (DataFeeder, LeNet's transform) against a raw cursor read of the same LMDB; prints JSON lines."""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from google.protobuf import text_format  # noqa: E402

import _results  # noqa: E402  (bench/_results.py)
from deepspark.data import DataFeeder, convert, lmdb_io  # noqa: E402
from deepspark.data.datum import encode_datum, decode_datum  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

FASHION = "/usr/share/datasets/fashion-mnist"
TARGET = 0.5  # batch assembly should run at least half as fast as a raw cursor read


def build_lmdb(path, source, records):
    """(seconds, how) to make the benchmark's LMDB: Fashion-MNIST train, or random LeNet-size records."""
    start = time.perf_counter()
    images = f"{FASHION}/train-images-idx3-ubyte.gz"
    if source == "fashion" and os.path.exists(images):
        n = convert.convert_mnist(images, f"{FASHION}/train-labels-idx1-ubyte.gz", path)
        how = "fashion-mnist train (convert_mnist)"
    else:
        rng = np.random.default_rng(0)
        pixels = rng.integers(0, 256, (records, 1, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, records)
        n = lmdb_io.write_lmdb(path, ((f"{i:08d}", encode_datum(pixels[i], int(labels[i])))
                                      for i in range(records)))
        how = "synthetic 1x28x28 (write_lmdb)"
    return n, time.perf_counter() - start, how


def raw_read(path):
    """Records/s of a sequential cursor read of every value, touching each one."""
    env = lmdb_io.open_db(path)
    try:
        start = time.perf_counter()
        n = total = 0
        with env.begin(buffers=False) as txn:
            for value in txn.cursor().iternext(keys=False, values=True):
                total += len(value)
                n += 1
        return n / (time.perf_counter() - start)
    finally:
        lmdb_io.close_db(path)


def naive_decode(path):
    """Records/s of a cursor read that parses each Datum and builds its array one by one."""
    start = time.perf_counter()
    n = 0
    for key, value in lmdb_io.read_records(path):
        decode_datum(value, key)
        n += 1
    return n / (time.perf_counter() - start)


def lenet_layer(path, batch):
    return text_format.Parse(
        f'name: "mnist" type: "Data" top: "data" top: "label" '
        f'transform_param {{ scale: 0.00390625 }} '
        f'data_param {{ source: "{path}" batch_size: {batch} backend: LMDB }}', pb.LayerParameter())


def feeder_rate(path, batch, epochs, **kwargs):
    """(steady records/s, records/s of the first epoch including the load) of DataFeeder."""
    start = time.perf_counter()
    feeder = DataFeeder(lenet_layer(path, batch), pb.TRAIN, seed=0, **kwargs)
    loaded = time.perf_counter()
    per_epoch = -(-feeder.size // batch)
    checksum = 0.0
    for _ in range(per_epoch):
        checksum += float(feeder.next_batch()["data"][0, 0, 0, 0])
    first = time.perf_counter()
    steady = epochs * per_epoch
    for _ in range(steady):
        checksum += float(feeder.next_batch()["data"][0, 0, 0, 0])
    end = time.perf_counter()
    feeder.close()
    return (steady * batch / (end - first), per_epoch * batch / (first - start),
            loaded - start)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--source", choices=["fashion", "synthetic"], default="fashion")
    ap.add_argument("--records", type=int, default=60000, help="records when synthetic")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3, help="steady-state epochs per measurement")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median)")
    ap.add_argument("--out", default="bench/results/data.jsonl", help="JSON lines are also appended here")
    ap.add_argument("--smoke", action="store_true",
                    help="runs end to end only (make bench-smoke): 2,000 synthetic records, 1 epoch, 1 repetition")
    args = ap.parse_args(argv)
    if args.smoke:
        args.source, args.records, args.epochs, args.reps = "synthetic", 2000, 1, 1

    def emit(rec):
        _results.emit(dict(bench="data", **rec), args.out)

    with tempfile.TemporaryDirectory(prefix="deepspark-bench-data-") as tmp:
        path = os.path.join(tmp, "train_lmdb")
        n, seconds, how = build_lmdb(path, args.source, args.records)
        emit(dict(figure="write_lmdb", records=n, source=how, records_per_s=round(n / seconds)))

        modes = {
            "in_memory": dict(),
            "in_memory_shuffle": dict(shuffle=True),
            "in_memory_prefetch": dict(prefetch=4),
            "streamed": dict(memory_limit=0),
            "streamed_shuffle": dict(memory_limit=0, shuffle=True),
        }
        samples = {"raw": [], "naive_decode": []}
        samples.update({m: [] for m in modes})
        for _ in range(args.reps):  # interleaved, so a noisy neighbour hits every figure alike
            samples["raw"].append(raw_read(path))
            samples["naive_decode"].append(naive_decode(path))
            for mode, kwargs in modes.items():
                samples[mode].append(feeder_rate(path, args.batch, args.epochs, **kwargs))

        raw = statistics.median(samples["raw"])
        emit(dict(figure="raw_cursor_read", records=n, records_per_s=round(raw)))
        naive = statistics.median(samples["naive_decode"])
        emit(dict(figure="naive_decode", records=n, records_per_s=round(naive),
                  ratio_to_raw=round(naive / raw, 3),
                  note="cursor read + one protobuf parse and np.frombuffer per record"))
        for mode in modes:
            steady = statistics.median(s[0] for s in samples[mode])
            cold = statistics.median(s[1] for s in samples[mode])
            load = statistics.median(s[2] for s in samples[mode])
            emit(dict(figure=f"batch_assembly_{mode}", records=n, batch=args.batch,
                      transform="scale 0.00390625", records_per_s=round(steady),
                      ratio_to_raw=round(steady / raw, 3), target=TARGET,
                      meets_target=steady / raw >= TARGET,
                      first_epoch_records_per_s=round(cold),
                      first_epoch_ratio_to_raw=round(cold / raw, 3), load_s=round(load, 4)))


if __name__ == "__main__":
    main()
