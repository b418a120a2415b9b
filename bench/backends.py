"""Backend comparison (#14, item 7): LeNet and cifar10_quick trained by `deepspark train` on the Caffe and the TensorFlow backends, side by side: images/s per worker, time to accuracy, final accuracy; JSON lines.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/backends.py [--quick] [--out FILE]

Each run is `deepspark train --backend caffe|tensorflow` in a process of its own: 2 workers on local[2], async EASGD
at period 10 and moving rate 0.45 (models/lenet/deepspark.prototxt's knobs, given to both models), each model's
solver hyperparameters, a fixed number of iterations per worker whatever the backend. Two models:

- models/lenet on Fashion-MNIST (real data: data/fashion_mnist_{train,test}_lmdb, `make data`), 2 epochs
  (`--quick`: 0.5); targets 0.85 and 0.88, bench/time_to_accuracy.py's;
- models/cifar10_quick on SYNTHETIC data, as no CIFAR-10 can be downloaded here: 3x32x32 uint8 images over uniform
  noise whose class is which band of 3 rows is brighter in one channel (bench/data_scale.py's bands, fainter),
  written with deepspark/data's writers to LMDBs in a temp folder, with their mean image (compute_image_mean) as
  the net's mean_file. 120 iterations per worker (24,000 images); its target is 0.9: the set is learnt to ~1.0
  in 45-60 iterations per worker, and 0.9 is crossed on the steep part of that curve (30-60), so it times the
  learning, not the plateau after it. Not in `--quick`.

The clock is bench/time_to_accuracy.py's: it starts at the driver's "Solving" line, and a point's time is its
"Snapshotting to binary proto file" line, which the driver writes after it has waited for the workers' solver
histories (up to an exchange period: seconds under load), so a point is dated late. Tests are off the clock: each
run snapshots 8 times (SNAPSHOTS) and every snapshot is tested afterwards with the TensorFlow backend, whichever
backend trained it (a .caffemodel is the same weights on either; one tester keeps the two runs' accuracies
comparable): LeNet's on its 10,000 test images, cifar10_quick's on its synthetic test set. Images/s per worker are
the workers' summary lines (iterations x batch over the seconds each trained: its training loop from joining the
center, first steps' compile and the exchanges it blocked on included), their mean.
"""

import argparse
import contextlib
import dataclasses
import functools
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import _results  # noqa: E402  (bench/_results.py)
import time_to_accuracy as tta  # noqa: E402  (bench/time_to_accuracy.py: the clock, the snapshots, the targets)
from _tables import cell, table  # noqa: E402  (bench/_tables.py)
from network import WORKER  # noqa: E402  (bench/network.py: the workers' summary lines)

BACKENDS = ("caffe", "tensorflow")
KNOBS = {"algorithm": "easgd", "workers": 2, "period": 10, "moving_rate": 0.45}
SNAPSHOTS = 8  # points on each accuracy curve: enough to place a target, few enough that tests stay ~15 s a run
SMOKE_ITERATIONS = 10  # --smoke: LeNet only, one snapshot; the bench runs end to end, its figures mean nothing

CIFAR = os.path.join(ROOT, "models", "cifar10_quick")
CIFAR_DATA = "synthetic 3x32x32, 10 classes, a faint band each (no CIFAR-10 here): 20,000 train, 2,000 test"
CIFAR_TRAIN, CIFAR_TEST = 20_000, 2_000
CIFAR_TARGETS = (0.9,)


@dataclasses.dataclass
class Model:
    data: str
    batch: int
    iterations: int  # per worker, the full bench's
    quick_iterations: int  # 0: not in --quick
    targets: tuple


MODELS = {
    "lenet": Model("Fashion-MNIST (real)", tta.BATCH, round(2 * tta.TRAIN_IMAGES / (tta.BATCH * tta.WORKERS)),
                   round(tta.TRAIN_IMAGES / (2 * tta.BATCH * tta.WORKERS)), tta.TARGETS),
    "cifar10_quick": Model(CIFAR_DATA, 100, 120, 0, CIFAR_TARGETS),
}


def cifar_images(count, seed):
    """(key, Datum bytes) of `count` synthetic 3x32x32 records: noise in 0..191, the class's 3 rows +64 in channel
    class % 3, so a class is a faint band a few filters must find (a bright one is learnt in a few iterations)."""
    from deepspark.data import encode_datum

    rng = np.random.default_rng(seed)
    labels = rng.integers(10, size=count)
    images = rng.integers(0, 192, size=(count, 3, 32, 32), dtype=np.uint8)
    for i, label in enumerate(labels):
        images[i, label % 3, 3 * label:3 * label + 3, :] += 64
    return [(b"%08d" % i, encode_datum(image, int(label))) for i, (image, label) in enumerate(zip(images, labels))]


def cifar_job(folder):
    """cifar10_quick's solver and net over synthetic LMDBs and their mean in `folder`: (solver path, a snapshot's
    test accuracy on the whole synthetic test set)."""
    from google.protobuf import text_format

    from deepspark.config import load_net, load_solver
    from deepspark.data.convert import compute_image_mean
    from deepspark.data.lmdb_io import write_lmdb
    from deepspark.proto import deepspark_pb2 as pb

    os.makedirs(folder, exist_ok=True)
    sources = {pb.TRAIN: os.path.join(folder, "train_lmdb"), pb.TEST: os.path.join(folder, "test_lmdb")}
    write_lmdb(sources[pb.TRAIN], cifar_images(CIFAR_TRAIN, seed=1))
    write_lmdb(sources[pb.TEST], cifar_images(CIFAR_TEST, seed=2))
    mean = os.path.join(folder, "mean.binaryproto")
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):  # its "Processed N files." lines
        compute_image_mean(sources[pb.TRAIN], mean)
    net, _ = load_net(os.path.join(CIFAR, "train_val.prototxt"))
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = sources[layer.include[0].phase]
            layer.transform_param.mean_file = mean
    net_path = os.path.join(folder, "train_val.prototxt")
    with open(net_path, "w") as stream:
        stream.write(text_format.MessageToString(net))
    param = load_solver(os.path.join(CIFAR, "solver.prototxt")).param
    param.net = net_path
    test_batch = next(layer.data_param.batch_size for layer in net.layer
                      if layer.type == "Data" and layer.include[0].phase == pb.TEST)
    param.test_iter[:] = [CIFAR_TEST // test_batch]
    solver = os.path.join(folder, "solver.prototxt")
    with open(solver, "w") as stream:
        stream.write(text_format.MessageToString(param))
    return solver, functools.partial(net_accuracy, net_path, param.test_iter[0])


def net_accuracy(net, iterations, weights):
    """The test accuracy of a snapshot on `net`'s TEST phase over `iterations` batches, on the TensorFlow backend."""
    from deepspark import nets
    from deepspark.log import Log

    with open(os.devnull, "w") as quiet, Log(stream=quiet, progress=False):
        means = nets.test(net, weights, iterations, "tensorflow")
    return float(means["accuracy"])


def worker_figures(stderr, batch):
    """Each worker's (images/s, share of its training blocked on the exchange) from the driver's summary lines:
    iterations x batch over the seconds it trained."""
    return [(int(its) * batch / float(trained), float(blocked) / float(trained))
            for _, its, _, trained, blocked in WORKER.findall(stderr) if float(trained)]


def run(name, model, backend, solver, accuracy, iterations, folder, snapshots=SNAPSHOTS):
    """One `deepspark train` of `solver` on `backend`, its snapshots tested afterwards; its JSON record."""
    per_iteration = model.batch * KNOBS["workers"]
    solver = tta.solver_copy(folder, max(1, iterations // snapshots), False, solver=solver)
    started = time.monotonic()
    done = subprocess.run(tta.command(solver, folder, iterations, {**KNOBS, "backend": backend}), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"{name} on {backend}: the run failed:\n{done.stderr[-3000:]}")
    workers = worker_figures(done.stderr, model.batch)
    points = [(s, n, accuracy(path)) for s, n, path in
              tta.snapshot_points(tta.stamped(os.path.join(folder, "train.log")), per_iteration)]
    record = {"bench": "backends", "model": name, "backend": backend, "data": model.data,
              "iterations_per_worker": iterations, "batch": model.batch, "tested_on": "tensorflow",
              "images_per_s_per_worker": round(sum(w for w, _ in workers) / len(workers), 1) if workers else None,
              "workers_images_per_s": [round(w, 1) for w, _ in workers],
              "blocked_on_exchange_share": [round(b, 4) for _, b in workers],
              "points": [[round(s, 2), n, round(a, 4)] for s, n, a in points],
              "final_accuracy": round(points[-1][2], 4) if points else None, "wall_seconds": round(wall, 1)}
    for target in model.targets:
        seconds, samples = tta.reached(points, target)
        record[f"seconds_to_{target}"] = None if seconds is None else round(seconds, 1)
        record[f"samples_to_{target}"] = samples
    return record


def ratio(a, b):
    return None if not a or not b else a / b


def targets_of(record):
    """The targets a record was timed to, as its keys spell them."""
    return sorted(k[len("seconds_to_"):] for k in record if k.startswith("seconds_to_"))


def page_section(records, data_folder):
    """The results page's section: a row per model and backend, the caffe/tensorflow ratios per model, the source."""
    runs = [r for r in records if r.get("bench") == "backends" and "backend" in r]  # not caffe_backend.py's
    if not runs:
        return "_Not measured yet: run `OPENBLAS_NUM_THREADS=1 python bench/backends.py` (each model on each backend)._"
    rows = [[r["model"], r["data"], r["backend"], cell(r.get("iterations_per_worker")),
             cell(r.get("images_per_s_per_worker"), 0),
             ", ".join(f"{t}: {cell(r[f'seconds_to_{t}'], 1, ' s')}" for t in targets_of(r)) or "—",
             cell(r.get("final_accuracy"), 4)] for r in runs]
    header = ["model", "data", "backend", "iterations per worker", "images/s per worker", "seconds to target",
              "final accuracy"]
    lines = []
    for name in dict.fromkeys(r["model"] for r in runs):
        pair = {r["backend"]: r for r in runs if r["model"] == name}
        if not set(BACKENDS) <= set(pair):
            continue
        caffe, tf = pair["caffe"], pair["tensorflow"]
        speed = ratio(caffe.get("images_per_s_per_worker"), tf.get("images_per_s_per_worker"))
        first = targets_of(tf)[0] if targets_of(tf) else None
        late = None if first is None else ratio(caffe.get(f"seconds_to_{first}"), tf.get(f"seconds_to_{first}"))
        lines.append(f"- {name}: caffe / tensorflow images/s per worker {cell(speed, 2)}"
                     + ("" if first is None else f"; seconds to {first} {cell(late, 2)}"))
    return "\n\n".join(filter(None, [
        table(header, rows), "\n".join(lines) or None,
        f"From `{os.path.relpath(data_folder, ROOT)}/backends.jsonl` (bench/backends.py): `deepspark train` with 2 "
        "workers on local[2], async EASGD at period 10, the same iterations on either backend; the clock starts at "
        "the driver's `Solving` line, snapshots are tested afterwards with the TensorFlow backend."]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="LeNet only, half an epoch")
    parser.add_argument("--smoke", action="store_true",
                        help=f"runs end to end only (make bench-smoke): LeNet, {SMOKE_ITERATIONS} iterations, 1 snapshot")
    parser.add_argument("--only", choices=tuple(MODELS))
    parser.add_argument("--out", default=_results.results_path("backends"))
    args = parser.parse_args()
    if args.smoke:
        args.quick, args.only = True, "lenet"
    with tempfile.TemporaryDirectory() as scratch:
        for name, model in MODELS.items():
            iterations = model.quick_iterations if args.quick else model.iterations
            if not iterations or (args.only and name != args.only):
                continue
            iterations = SMOKE_ITERATIONS if args.smoke else iterations
            if name == "lenet":
                solver, accuracy = tta.SOLVER, tta.accuracy
            else:
                solver, accuracy = cifar_job(os.path.join(scratch, name))
            for backend in BACKENDS:
                record = run(name, model, backend, solver, accuracy, iterations,
                             os.path.join(scratch, f"{name}-{backend}"), 1 if args.smoke else SNAPSHOTS)
                _results.emit(record, args.out)


if __name__ == "__main__":
    main()
