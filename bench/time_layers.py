"""`deepspark time` per layer: the Caffe backend against pycaffe timing the same layers itself, and TF's per-layer cost.

1. `time_vs_pycaffe`: LeNet (models/lenet/train_val.prototxt, TRAIN) on the
   Caffe backend. Ours: the per-layer forward `deepspark time` reports
   (engine.benchmark over the model's layer_passes, on the net's first LMDB
   batch). Pycaffe's: a caffe.Net pycaffe builds from the same prototxt, with
   our weights and its own Data layer reading the LMDB, each layer timed by
   hand around net._forward(i, i) in Caffe's loop (forwards in order, then
   backwards in reverse). Same process, rounds alternating who goes first;
   ratio = ours / pycaffe's milliseconds, per layer and over every layer but
   the data layer (ours is an Input blob already filled, Caffe's copies a
   prefetched batch).
2. `blank_input`: pycaffe's same loop on the net the backend compiles (its
   Data layer as an Input, bench/_pycaffe.py) with its Input blobs zeroed,
   against the same net holding the batch: max pooling
   runs several times faster on a blank net (its comparisons all go one
   way), which is what a baseline that never loads a batch measures.
3. `tensorflow_layers`: the TensorFlow backend's per-layer forward and
   backward, summed, against its compiled forward (model.forward) and
   forward+gradient (model.gradients) on the same batch: what timing layer
   by layer adds on TensorFlow (a function dispatch per layer and pass).

Prints one JSON line per figure and appends them to bench/results/time_layers.jsonl (or --out).
Run it as `make bench` does, with one OpenBLAS thread: with two on two busy
cores a GEMM waits on a descheduled helper thread and single rounds swing 3x.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/time_layers.py [--rounds 5] [--iterations 10] [--smoke]
"""

import argparse
import io
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)  # the zoo's LMDB paths are relative to the repository

import numpy as np  # noqa: E402

import _pycaffe  # noqa: E402  (bench/_pycaffe.py: pycaffe's net of the backend's compiled net, our weights)
import _results  # noqa: E402  (bench/_results.py)
from deepspark import engine, nets  # noqa: E402
from deepspark.backends.caffe import runtime  # noqa: E402
from deepspark.log import Log  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

NET = os.path.join("models", "lenet", "train_val.prototxt")
OUT = _results.results_path("time_layers")


def emit(record):
    _results.emit(record, OUT)


def ours(model, batch, iterations):
    """{layer: forward ms} as `deepspark time` reports it."""
    passes, loss = model.layer_passes(batch)
    with Log(stream=io.StringIO()):
        timing = engine.benchmark(passes, loss, iterations)
    return {name: forward for name, forward, _ in timing.layers}


def pycaffe(net, iterations):
    """{layer: forward ms} of Caffe's time loop, timed by hand around pycaffe's net._forward(i, i)."""
    count = len(net.layers)
    forward = [0.0] * count
    for i in range(count):  # warm-up, as caffe time's first Forward and Backward
        net._forward(i, i)
    for i in reversed(range(count)):
        net._backward(i, i)
    for _ in range(iterations):
        for i in range(count):
            started = time.perf_counter()
            net._forward(i, i)
            forward[i] += time.perf_counter() - started
        for i in reversed(range(count)):
            net._backward(i, i)
    return {name: f * 1000.0 / iterations for name, f in zip(net._layer_names, forward)}


def medians(rounds):
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def first_batch(model):
    feeders = nets.feeders_for(model, model.phase)
    try:
        return engine.next_batch(feeders)
    finally:
        engine.close_all(feeders)


def bench_caffe(rounds, iterations):
    caffe = runtime.caffe()
    model = nets.test_model(NET, "caffe", pb.TRAIN)
    batch = first_batch(model)
    theirs = _pycaffe.with_weights(caffe.Net(NET, caffe.TRAIN), model)  # the same weights
    data = [name for name, layer in zip(theirs._layer_names, theirs.layers) if layer.type == "Data"]
    a, b = [], []
    for r in range(rounds):  # alternate who goes first: a noisy neighbour hits both alike
        if r % 2:
            b.append(pycaffe(theirs, iterations))
            a.append(ours(model, batch, iterations))
        else:
            a.append(ours(model, batch, iterations))
            b.append(pycaffe(theirs, iterations))
    mine, other = medians(a), medians(b)
    layers = [name for name in mine if name in other and name not in data]
    ratios = [sum(x[n] for n in layers) / sum(y[n] for n in layers) for x, y in zip(a, b)]
    emit({"bench": "time_vs_pycaffe", "net": "lenet", "phase": "TRAIN", "batch": int(batch["data"].shape[0]),
          "rounds": rounds, "iterations": iterations,
          "ours_forward_ms": round(sum(mine[n] for n in layers), 3),
          "pycaffe_forward_ms": round(sum(other[n] for n in layers), 3),
          "ratio": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
          "layer_ratio": {n: round(mine[n] / other[n], 3) for n in layers if other[n] > 0.05}})

    blank = {top: np.zeros_like(array) for top, array in batch.items()}
    compiled = _pycaffe.net(model)
    filled, zeroed = [], []
    for _ in range(rounds):
        _pycaffe.load(compiled, model, batch)
        filled.append(pycaffe(compiled, iterations))
        _pycaffe.load(compiled, model, blank)
        zeroed.append(pycaffe(compiled, iterations))
    full, empty = medians(filled), medians(zeroed)
    layers = [name for name in full if name not in data]
    emit({"bench": "blank_input", "net": "lenet", "rounds": rounds, "iterations": iterations,
          "batch_forward_ms": round(sum(full[n] for n in layers), 3),
          "blank_forward_ms": round(sum(empty[n] for n in layers), 3),
          "ratio_batch_vs_blank": round(sum(full[n] for n in layers) / sum(empty[n] for n in layers), 3),
          "layer_ratio": {n: round(full[n] / empty[n], 3) for n in layers if empty[n] > 0.05}})
    model.close()
    return batch


def bench_tensorflow(batch, rounds, iterations):
    model = nets.test_model(NET, "tensorflow", pb.TRAIN)
    passes, loss = model.layer_passes(batch)
    model.forward(batch), model.gradients(batch)  # trace the compiled passes
    layers_f, layers_fb, whole_f, whole_fb = [], [], [], []
    for _ in range(rounds):
        with Log(stream=io.StringIO()):
            timing = engine.benchmark(passes, loss, iterations)
        layers_f.append(timing.forward)
        layers_fb.append(timing.forward + timing.backward)
        started = time.perf_counter()
        for _ in range(iterations):
            model.forward(batch)
        middle = time.perf_counter()
        for _ in range(iterations):
            model.gradients(batch)
        whole_f.append((middle - started) * 1000.0 / iterations)
        whole_fb.append((time.perf_counter() - middle) * 1000.0 / iterations)
    f, fb = statistics.median(layers_f), statistics.median(layers_fb)
    cf, cfb = statistics.median(whole_f), statistics.median(whole_fb)
    emit({"bench": "tensorflow_layers", "net": "lenet", "rounds": rounds, "iterations": iterations,
          "layers_forward_ms": round(f, 3), "compiled_forward_ms": round(cf, 3),
          "layers_forward_backward_ms": round(fb, 3), "compiled_gradients_ms": round(cfb, 3),
          "ratio_forward": round(f / cf, 3), "ratio_forward_backward": round(fb / cfb, 3)})
    model.close()


def main():
    global OUT  # emit's file
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): 1 round of 2 iterations")
    parser.add_argument("--out", default=OUT, help="JSON lines are also appended here")
    args = parser.parse_args()
    OUT = args.out
    if args.smoke:
        args.rounds, args.iterations = 1, 2
    emit({"bench": "environment", "cpus": os.cpu_count(), "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS")})
    source = "data/fashion_mnist_train_lmdb"
    if not os.path.exists(source):
        emit({"bench": "time_vs_pycaffe", "skipped": f"no LMDB at {source} (make data)"})
        return
    batch = bench_caffe(args.rounds, args.iterations)
    bench_tensorflow(batch, args.rounds, args.iterations)


if __name__ == "__main__":
    main()
