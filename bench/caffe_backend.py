"""Training-step throughput: the Caffe backend against pycaffe's own solver.step(1), and both backends.

1. `caffe_vs_pycaffe`: our Caffe backend's `step(batch)` against a plain
   pycaffe loop (copy the batch into the Input blobs, `solver.step(1)`) on the
   same compiled net and solver and the same batches, rounds interleaved so
   machine noise hits both alike; the ratio is ours / pycaffe's images/s.
2. `backends`: images/s of the Caffe and TensorFlow backends on the same net,
   batches and weights.
3. `data_path`: the Caffe backend fed from the shared pipeline (DataFeeder ->
   Input layers) against Caffe's own Data layer reading the LMDB
   (data_layers="caffe"); LeNet on Fashion-MNIST, when its LMDB exists.

Prints one JSON line per figure and appends them to bench/results/caffe_backend.jsonl (or --out).
The backend is driven through its contract (create_model, step, get_params); the baseline is pycaffe's own solver
built from the same compiled net and solver (bench/_pycaffe.py), never from the backend's insides.

    PYTHONPATH=. .venv/bin/python bench/caffe_backend.py [--rounds 5] [--nets lenet,cifar10_quick] [--smoke]
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)  # the zoo's LMDB paths are relative to the repository

import numpy as np  # noqa: E402

import _pycaffe  # noqa: E402  (bench/_pycaffe.py: pycaffe's solver on the backend's compiled net)
import _results  # noqa: E402  (bench/_results.py)
from deepspark import compare, engine  # noqa: E402
from deepspark.backends import create_model  # noqa: E402
from deepspark.config import load_solver  # noqa: E402
from deepspark.data import DataFeeder  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

STEPS = {"lenet": 100, "cifar10_quick": 20}
CHUNK = {"lenet": 10, "cifar10_quick": 2}  # steps per interleaved turn
SMOKE_STEPS = 4  # --smoke: the bench runs end to end, its figures mean nothing
OUT = _results.results_path("caffe_backend")


def emit(record):
    _results.emit(record, OUT)


class PyCaffe:
    """The baseline: pycaffe's solver on the net and solver the backend compiles for `model`, with its starting
    weights, fed by hand."""

    def __init__(self, model):
        self.solver = _pycaffe.solver(model)
        self.blobs = self.solver.net.blobs
        self.tops = list(model.feeds)

    def step(self, batch):
        for top in self.tops:
            self.blobs[top].data[...] = batch[top]
        self.solver.step(1)


def timed(step, plan):
    started = time.perf_counter()
    for batch in plan:
        step(batch)
    return time.perf_counter() - started


def build(name, backend, data_layers="input"):
    solver = load_solver(os.path.join(ROOT, "models", name, "solver.prototxt"))
    kwargs = {"data_layers": data_layers} if backend == "caffe" else {}
    return create_model(backend, solver.train_net, solver.param, source=solver.train_map,
                        data_shape=compare.shape_finder(solver.param.net), seed=1, **kwargs)


def bench_net(name, rounds, steps=None):
    steps = steps or STEPS.get(name, 20)
    ours = build(name, "caffe")
    baseline = PyCaffe(ours)
    tf_model = build(name, "tensorflow")
    tf_model.set_params(ours.get_params())
    batch_images = next(iter(ours.feeds.values()))[0]
    synthetic = engine.SyntheticBatches(ours, seed=7)
    plan = [synthetic.next_batch() for _ in range(steps)]
    for batch in plan[:2]:  # warm-up: allocation, tracing
        ours.step(batch), baseline.step(batch), tf_model.step(batch)
    times = {"deepspark caffe": [], "pycaffe solver.step(1)": [], "deepspark tensorflow": []}
    ratios = []
    chunk = min(CHUNK.get(name, 5), steps)
    for r in range(rounds):
        # Short turns, alternating who goes first: a noisy neighbour hits both alike.
        a = b = 0.0
        for i in range(0, steps, chunk):
            part = plan[i:i + chunk]
            if (r + i // chunk) % 2:
                b += timed(baseline.step, part)
                a += timed(ours.step, part)
            else:
                a += timed(ours.step, part)
                b += timed(baseline.step, part)
        times["deepspark caffe"].append(a)
        times["pycaffe solver.step(1)"].append(b)
        ratios.append(b / a)
    for _ in range(rounds):
        times["deepspark tensorflow"].append(timed(tf_model.step, plan))
    per_second = {impl: steps * batch_images / statistics.median(t) for impl, t in times.items()}
    emit({"bench": "caffe_vs_pycaffe", "net": name, "batch": batch_images, "steps": steps, "rounds": rounds,
          "ours_images_per_s": round(per_second["deepspark caffe"], 1),
          "pycaffe_images_per_s": round(per_second["pycaffe solver.step(1)"], 1),
          "ratio": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios]})
    emit({"bench": "backends", "net": name, "batch": batch_images,
          "caffe_images_per_s": round(per_second["deepspark caffe"], 1),
          "tensorflow_images_per_s": round(per_second["deepspark tensorflow"], 1)})
    ours.close()


def bench_data_path(rounds, steps=100):
    """LeNet fed by our pipeline through Input layers vs Caffe's Data layer reading the LMDB."""
    solver = load_solver(os.path.join(ROOT, "models", "lenet", "solver.prototxt"))
    layer = next(l for l in solver.train_net.layer if l.type == "Data" and
                 any(rule.phase == pb.TRAIN for rule in l.include))
    if not os.path.exists(layer.data_param.source):
        emit({"bench": "data_path", "skipped": f"no LMDB at {layer.data_param.source} (make data)"})
        return
    fed, own = build("lenet", "caffe"), build("lenet", "caffe", data_layers="caffe")
    feeder = DataFeeder(layer, pb.TRAIN)
    fed_step = lambda _: fed.step(feeder.next_batch())  # noqa: E731
    own_step = lambda _: own.step(None)  # noqa: E731
    for _ in range(2):
        fed_step(None), own_step(None)
    times = {"pipeline": [], "caffe_data_layer": []}
    chunk = min(10, steps)
    for r in range(rounds):
        a = b = 0.0
        for i in range(0, steps, chunk):
            if (r + i // chunk) % 2:
                b += timed(own_step, range(chunk))
                a += timed(fed_step, range(chunk))
            else:
                a += timed(fed_step, range(chunk))
                b += timed(own_step, range(chunk))
        times["pipeline"].append(a)
        times["caffe_data_layer"].append(b)
    batch = fed.feeds["data"][0]
    emit({"bench": "data_path", "net": "lenet", "batch": batch, "steps": steps,
          "pipeline_input_images_per_s": round(steps * batch / statistics.median(times["pipeline"]), 1),
          "caffe_data_layer_images_per_s": round(steps * batch / statistics.median(times["caffe_data_layer"]), 1),
          "ratio_pipeline_vs_caffe": round(statistics.median(np.divide(times["caffe_data_layer"],
                                                                      times["pipeline"])), 3)})
    feeder.close()


def main():
    global OUT  # emit's file
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nets", default="lenet,cifar10_quick")
    parser.add_argument("--smoke", action="store_true",
                        help=f"runs end to end only: LeNet, 1 round of {SMOKE_STEPS} steps")
    parser.add_argument("--out", default=OUT, help="JSON lines are also appended here")
    args = parser.parse_args()
    OUT = args.out
    if args.smoke:
        args.rounds, args.nets = 1, "lenet"
    steps = SMOKE_STEPS if args.smoke else None
    emit({"bench": "environment", "cpus": os.cpu_count(), "smoke": args.smoke})
    for name in args.nets.split(","):
        bench_net(name.strip(), args.rounds, steps)
    bench_data_path(args.rounds, steps or 100)


if __name__ == "__main__":
    main()
