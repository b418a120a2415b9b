"""What the external peers' runs share, in bench/.venv-peers: their data, their milestone checkpoints and their command line.

    PYTHONPATH=bench python -c LAUNCH _peer_X train CONFIG.json     trains: FOLDER/ckpt-*.npz, FOLDER/run.json
    PYTHONPATH=bench python -c LAUNCH _peer_X evaluate CONFIG.json  prints [[seconds, samples, accuracy], ...]

LAUNCH imports the peer's module by its name and calls main() below with it (bench/peers.py does this), so that
what Spark and torchrun pickle of a peer's module is found by name in their workers, not as __main__.

CONFIG is what bench/peers.py writes: the data file, the folder, the epochs, the solver's numbers (batch, base_lr,
momentum, weight_decay, the input scale), the milestone in samples, the workers, and the run's own knobs. A run may
fail on purpose (a mode the peer does not have): it raises Unavailable, and its message lands in FOLDER/error.txt.
"""

import glob
import importlib.metadata
import json
import os
import sys
import time
import traceback

import numpy as np


class Unavailable(Exception):
    """The peer cannot run this way; the message says exactly why."""


def load(config):
    """(train images, train labels, test images, test labels): uint8 arrays, images N×28×28, from peers.py's .npz."""
    with np.load(config["data"]) as data:
        return data["x_train"], data["y_train"], data["x_test"], data["y_test"]


def every(config, samples_per_step):
    """Steps between two checkpoints: the milestone in samples, rounded to whole steps (as time_to_accuracy does)."""
    return max(1, round(config["milestone"] / samples_per_step))


def save(config, start, samples, arrays, tested=0.0):
    """Writes a checkpoint: the arrays and the seconds since `start`, a time.time() (the clock crosses processes),
    less the `tested` seconds the run's own tests took (off the clock, as every test here).

    From any process of the run (a driver, a Spark worker, a DDP rank): the file's name holds the samples, written
    under a temporary name and renamed, so that a reader never sees half of one.
    """
    seconds = time.time() - start - tested
    path = os.path.join(config["folder"], f"ckpt-{samples:09d}.npz")
    partial = path + ".partial.npz"
    np.savez(partial, *arrays, seconds=seconds)
    os.replace(partial, path)


class Stop:
    """A single-process run's early stop: each checkpoint tested as it is written, off the clock (its seconds kept in
    `tested`), and the run told to stop once one is at or above config["stop_at"] (None: never; the test then never
    runs). Its first step's time.time() in `first_step`, for the page's start-up line."""

    def __init__(self, config, tester):
        self.stop_at, self.tested, self.reached, self.first_step = config.get("stop_at"), 0.0, False, None
        if self.stop_at:
            *_, x_test, y_test = load(config)
            self.test = tester(config, x_test, y_test)

    def stepped(self):
        if self.first_step is None:
            self.first_step = time.time()

    def saved(self, arrays):
        """After a checkpoint of `arrays`: whether the run may stop."""
        if self.stop_at and not self.reached:
            began = time.time()
            self.reached = self.test(arrays) >= self.stop_at
            self.tested += time.time() - began
        return self.reached

    def report(self, start):
        return {"clock_start": start, "first_step_at": self.first_step, "stopped_at": self.stop_at if self.reached
                else None}


def checkpoints(folder):
    """[(seconds, samples, [arrays])] of a run's checkpoints, in order of samples."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "ckpt-*[0-9].npz"))):
        with np.load(path) as data:
            arrays = [data[f"arr_{i}"] for i in range(len(data.files) - 1)]
            found.append((float(data["seconds"]), int(os.path.basename(path)[5:14]), arrays))
    return found


def versions(*packages):
    """{package: installed version}."""
    return {name: importlib.metadata.version(name) for name in packages}


def accuracy(predict, x_test, y_test, batch=1000):
    """The fraction of the test images whose highest logit (predict: uint8 images → numpy logits) is their label."""
    right = 0
    for i in range(0, len(x_test), batch):
        right += int((predict(x_test[i:i + batch]).argmax(axis=1) == y_test[i:i + batch]).sum())
    return right / len(x_test)


def spark_conf(workers):
    """The SparkConf of a peer's local[workers] Spark, set up as DeepSpark's own session is (bound to 127.0.0.1,
    no UI, Python workers reused)."""
    from pyspark import SparkConf

    conf = SparkConf().setMaster(f"local[{workers}]").setAppName("peer")
    conf.set("spark.driver.host", "127.0.0.1").set("spark.driver.bindAddress", "127.0.0.1")
    conf.set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
    return conf.set("spark.python.worker.reuse", "true")


def main(runs, tester):
    """The command line: `train` runs runs[config["run"]](config) → {clock, epochs, versions} into run.json;
    `evaluate` prints, for every checkpoint, its seconds, samples and tester(config, x_test, y_test)(arrays)."""
    verb, config_path = sys.argv[-2:]
    with open(config_path) as stream:
        config = json.load(stream)
    if verb == "evaluate":
        *_, x_test, y_test = load(config)
        test = tester(config, x_test, y_test)
        points = [[seconds, samples, test(arrays)] for seconds, samples, arrays in checkpoints(config["folder"])]
        print(json.dumps(points))
        return
    try:
        report = runs[config["run"]](config)
    except Exception as error:  # noqa: BLE001  (whatever stops a peer is what its record must say)
        traceback.print_exc()
        with open(os.path.join(config["folder"], "error.txt"), "w") as stream:
            stream.write(str(error) if isinstance(error, Unavailable) else f"{type(error).__name__}: {error}")
        sys.exit(1)
    with open(os.path.join(config["folder"], "run.json"), "w") as stream:
        json.dump(report, stream)
