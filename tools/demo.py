#!/usr/bin/env python3
"""`make demo`: LeNet on Fashion-MNIST, 2 Spark workers, async EASGD, embedded local[2], TensorFlow backend."""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    from deepspark import cli

    started = time.monotonic()
    status = cli.main(["train", "--solver", "models/lenet/solver.prototxt", "--backend", "tensorflow",
                       "--workers", "2", "--algorithm", "easgd", "--output", "output"])
    seconds = time.monotonic() - started
    if status:
        return status
    from deepspark.plot import parse_log

    with open(os.path.join("output", "train.log"), encoding="utf-8") as stream:
        history = parse_log(stream)
    accuracy = next((values["test0/accuracy"] for _, _, _, values in reversed(history)
                     if "test0/accuracy" in values), None)
    print(json.dumps({"demo": "lenet-fashion-mnist", "workers": 2, "algorithm": "easgd",
                      "seconds": round(seconds, 1), "test_accuracy": accuracy,
                      "output": sorted(os.listdir("output"))}))
    print(f"Demo finished in {seconds:.0f} s with test accuracy {accuracy:.4f}; "
          "snapshots, train.log and progress.png are in output/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
