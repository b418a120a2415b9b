"""The external peers of the time-to-accuracy table (#14): Elephas, Spark's TorchDistributor, and single-process tf.keras and PyTorch loops training models/lenet's LeNet on Fashion-MNIST; JSON lines in time_to_accuracy's schema.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/peers.py [--quick] [--epochs 2.5] [--only NAME,...]
        [--seed N]

The peers live in a venv of their own, bench/.venv-peers (tools/peers-env.sh, run first here: a no-op once built),
since elephas 7.3 pins TensorFlow < 2.20, numpy < 2 and pyspark <= 4.0.0. Each run is a process of that venv on the
same machine, data and Spark master (local[2]) as time_to_accuracy's, with models/lenet's solver numbers: batch 64,
SGD at base_lr 0.01 (constant: no "inv" decay, no lr_mult 2 on biases), momentum 0.9, weight decay 5e-4 added to
the gradient, Caffe's xavier fillers, inputs scaled by transform_param's 1/256. The clock starts where training
starts (each record's "clock" says what it holds: for the distributed peers, their workers' start-up); the Spark
session, the imports and the data read come before it. Tests are off the clock, as time_to_accuracy's: each run
writes its weights every 6,400 samples (time_to_accuracy.GRID_SAMPLES; the per-epoch modes only at epoch ends, the
one place their weights meet; elephas's modes run whole epochs), each checkpoint is tested afterwards on the 10,000
test images; the single-process peers also test each as they write it, off their clock, and stop at the first at or
above 0.88 (STOPS_EARLY). Peak memory is the PSS of the run's process tree, the load average is read while it
trains. A run that cannot run emits a line with "error": the reason. By default the distributed peers run
(DISTRIBUTED); bench/time_to_accuracy.py runs the single-process ones at each seed in its rounds.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import _memory  # noqa: E402  (bench/_memory.py)
import _results  # noqa: E402  (bench/_results.py)
import time_to_accuracy  # noqa: E402  (bench/time_to_accuracy.py: the schema, the milestones, the solver)
from deepspark.config import load_solver  # noqa: E402
from deepspark.data.convert import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

BENCH = os.path.join(ROOT, "bench")
PYTHON = os.path.join(BENCH, ".venv-peers", "bin", "python")
FASHION = "/usr/share/datasets/fashion-mnist"
# Runs a peer module's command line by the module's name (bench/_peer_common.py says why).
LAUNCH = "import importlib, sys, _peer_common; peer = importlib.import_module(sys.argv[1]); " \
         "_peer_common.main(peer.RUNS, peer.tester)"

# name: (peer, module in bench/, its run's knobs, mode)
RUNS = {
    "elephas synchronous epoch": ("elephas", "_peer_elephas", {"run": "synchronous", "frequency": "epoch"},
                                  "mode='synchronous' (SparkModel), frequency='epoch'"),
    "elephas synchronous batch": ("elephas", "_peer_elephas", {"run": "synchronous", "frequency": "batch"},
                                  "mode='synchronous', frequency='batch'"),
    "elephas asynchronous epoch": ("elephas", "_peer_elephas", {"run": "asynchronous", "frequency": "epoch"},
                                   "mode='asynchronous' (AsynchronousSparkModel, HTTP server), frequency='epoch'"),
    "elephas asynchronous batch": ("elephas", "_peer_elephas", {"run": "asynchronous", "frequency": "batch"},
                                   "mode='asynchronous' (AsynchronousSparkModel, HTTP server), frequency='batch'"),
    "torchdistributor": ("TorchDistributor", "_peer_torch", {"run": "distributor"},
                         "DDP over gloo, local_mode, 2 processes x batch 32, CPU"),
    "keras single": ("tf.keras", "_peer_keras", {"run": "single"}, "single process, model.fit, batch 64"),
    "torch single": ("PyTorch", "_peer_torch", {"run": "single"}, "single process, a training loop, batch 64"),
}
# What `make bench` runs of them here: the distributed peers, once each, Elephas in its best mode on the last full page
# (asynchronous, a pull and a push every batch; its epoch modes took 130-160 s a run and did not reach 0.88 first).
# The single-process peers run in bench/time_to_accuracy.py's rounds, at each seed beside DeepSpark's runs; the other
# modes run with --only.
DISTRIBUTED = ("torchdistributor", "elephas asynchronous batch")
QUICK = ("torchdistributor",)
# The runs that stop once a checkpoint tests at or above the last target (their own tests, off their clock).
STOPS_EARLY = ("torch single", "keras single")
# --smoke: one cheap peer for a few steps, in the peers' venv as it is (never built by the smoke run; without it the
# peers are skipped, in one line, after DeepSpark's side of the runs: the solver's numbers and the data file).
SMOKE, SMOKE_EPOCHS = ("torch single",), 0.02


def solver_numbers():
    """What the peers take from models/lenet: the solver's SGD numbers and the train Data layer's scale."""
    solver = load_solver(time_to_accuracy.SOLVER)
    data = next(layer for layer in solver.train_net.layer if layer.type == "Data"
                and any(rule.phase == pb.TRAIN for rule in layer.include))
    p = solver.param
    # The prototxt's floats come back as float32: 0.01 reads 0.009999999776; six digits give the file's numbers.
    return {"base_lr": float(f"{p.base_lr:.6g}"), "momentum": float(f"{p.momentum:.6g}"),
            "weight_decay": float(f"{p.weight_decay:.6g}"), "scale": data.transform_param.scale,
            "batch": data.data_param.batch_size}


def write_data(path):
    """Fashion-MNIST's IDX files as one .npz of uint8 arrays (x_train, y_train, x_test, y_test) for the peers."""
    arrays = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        (n, rows, cols), pixels = read_idx(f"{FASHION}/{prefix}-images-idx3-ubyte.gz", IDX_IMAGES_MAGIC)
        _, labels = read_idx(f"{FASHION}/{prefix}-labels-idx1-ubyte.gz", IDX_LABELS_MAGIC)
        arrays[f"x_{split}"] = np.frombuffer(pixels, np.uint8).reshape(n, rows, cols)
        arrays[f"y_{split}"] = np.frombuffer(labels, np.uint8)
    np.savez(path, **arrays)


def peer_env():
    """The environment of a peer's processes: its modules found by name (by Spark's and torchrun's workers too),
    Spark on 127.0.0.1, and the executors on the peers' Python (pyspark would otherwise start `python3`)."""
    return {**os.environ, "PYTHONPATH": BENCH, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": PYTHON}


def run(name, config, folder):
    """The run's record: trained in its own process (peak PSS of its tree, the machine's load), then its checkpoints
    tested."""
    peer, module, _, mode = RUNS[name]
    os.makedirs(folder)
    config_path, log_path = os.path.join(folder, "config.json"), os.path.join(folder, "run.log")
    with open(config_path, "w") as stream:
        json.dump({**config, "folder": folder}, stream)
    load, began, started = time_to_accuracy.Load(), time.time(), time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen([PYTHON, "-c", LAUNCH, module, "train", config_path], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env=peer_env())
        memory = _memory.PeakPss(process.pid)
        process.wait()
    peak, wall = memory.stop(), time.monotonic() - started
    report = {}
    if os.path.exists(os.path.join(folder, "run.json")):
        with open(os.path.join(folder, "run.json")) as stream:
            report = json.load(stream)
    loads = load.stop(report.pop("clock_start", None))
    head = {"peer": peer, "mode": mode}
    if process.returncode:
        error_path = os.path.join(folder, "error.txt")
        if os.path.exists(error_path):
            with open(error_path) as stream:
                error = stream.read()
        else:
            with open(log_path) as stream:
                error = "".join(stream.readlines()[-20:])
        return {"bench": "time_to_accuracy", "run": name, **head, "error": error}
    tested = subprocess.run([PYTHON, "-c", LAUNCH, module, "evaluate", config_path], cwd=ROOT, env=peer_env(),
                            capture_output=True, text=True)
    if tested.returncode:
        raise SystemExit(f"{name}: testing its checkpoints failed:\n{tested.stderr[-3000:]}")
    points = [tuple(point) for point in json.loads(tested.stdout.splitlines()[-1])]
    first = report.pop("first_step_at", None)
    return {**time_to_accuracy.figures(name, points, peak, wall, on_clock=False), **head, **report, **loads,
            **({"seed": config["seed"]} if config.get("seed") else {}),
            **({"process_start_to_first_step": round(first - began, 2)} if first else {})}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)}, {time_to_accuracy.QUICK_EPOCHS:g} epochs")
    parser.add_argument("--epochs", type=float, help=f"default {time_to_accuracy.EPOCHS:g}")
    parser.add_argument("--seed", type=int, help="the runs' seed (their initial weights and order; default: none "
                        "set, each peer's own)")
    parser.add_argument("--only", help=f"comma-separated run names: {', '.join(RUNS)}")
    parser.add_argument("--smoke", action="store_true", help=f"runs end to end only (make bench-smoke): "
                        f"{', '.join(SMOKE)}, {SMOKE_EPOCHS:g} epochs, where bench/.venv-peers is (else no peer)")
    parser.add_argument("--out", default=_results.results_path("peers"))
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SMOKE if args.smoke else QUICK if args.quick else DISTRIBUTED)
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        parser.error(f"no run {', '.join(unknown)}; the runs: {', '.join(RUNS)}")
    epochs = args.epochs or (SMOKE_EPOCHS if args.smoke else time_to_accuracy.QUICK_EPOCHS if args.quick else
                             time_to_accuracy.EPOCHS)
    if not args.smoke:
        built = subprocess.run(["bash", os.path.join(ROOT, "tools", "peers-env.sh")], capture_output=True, text=True)
    with tempfile.TemporaryDirectory() as scratch:
        data = os.path.join(scratch, "fashion-mnist.npz")
        write_data(data)
        config = {"data": data, "epochs": epochs, "workers": time_to_accuracy.WORKERS,
                  "milestone": time_to_accuracy.GRID_SAMPLES, **solver_numbers(),
                  **({"seed": args.seed} if args.seed is not None else {})}
        if args.smoke and not os.path.exists(PYTHON):
            print(f"peers: no {os.path.relpath(PYTHON, ROOT)} (make peers-env): {', '.join(names)} skipped",
                  file=sys.stderr, flush=True)
            _results.emit({"bench": "time_to_accuracy", "skipped": names, "reason": "no peers venv",
                           "config": {k: v for k, v in config.items() if k != "data"}}, args.out)
            return
        for i, name in enumerate(names):
            if not args.smoke and built.returncode:
                record = {"bench": "time_to_accuracy", "run": name, "peer": RUNS[name][0], "mode": RUNS[name][3],
                          "error": f"tools/peers-env.sh failed: {(built.stderr.strip() or '?').splitlines()[-1]}"}
            else:
                stop = {"stop_at": time_to_accuracy.TARGETS[-1]} if name in STOPS_EARLY else {}
                record = run(name, {**config, **RUNS[name][2], **stop}, os.path.join(scratch, str(i)))
            _results.emit({**record, "epochs": record.get("epochs", epochs),
                           **({"repeat": args.seed} if args.seed and args.seed > 1 else {})}, args.out)


if __name__ == "__main__":
    main()
