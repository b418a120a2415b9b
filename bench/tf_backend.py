"""LeNet training-step throughput: the TensorFlow backend against a hand-written tf.keras LeNet.

Same shapes, batch (64), optimizer (SGD, momentum 0.9, weight decay 0.0005,
lr_policy inv) and numpy batches per step, measured in one process, rounds
interleaved so machine noise hits both alike. Prints one JSON line per figure.

    PYTHONPATH=. .venv/bin/python bench/tf_backend.py [--steps 200] [--rounds 5] [--jit]
"""

import argparse
import resource
import statistics
import time

import numpy as np
import tensorflow as tf
from google.protobuf import text_format

import _results  # bench/_results.py: the shared JSON lines
from deepspark.backends import create_model
from deepspark.config import parse_net
from deepspark.proto import deepspark_pb2 as pb

BATCH = 64

# Caffe's examples/mnist/lenet_train_test.prototxt with Input layers for Data.
LENET = """
name: "LeNet"
layer { name: "mnist" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 64 dim: 1 dim: 28 dim: 28 } shape { dim: 64 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  convolution_param { num_output: 20 kernel_size: 5 stride: 1
    weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  param { lr_mult: 1 } param { lr_mult: 2 }
  convolution_param { num_output: 50 kernel_size: 5 stride: 1
    weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 500 weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

SOLVER = """
base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005
lr_policy: "inv" gamma: 0.0001 power: 0.75
"""


def batches(count, layout):
    rng = np.random.default_rng(0)
    shape = (BATCH, 1, 28, 28) if layout == "nchw" else (BATCH, 28, 28, 1)
    return [(rng.random(shape, np.float32), rng.integers(0, 10, BATCH).astype(np.float32))
            for _ in range(count)]


class KerasLeNet:
    """LeNet in tf.keras, trained by a tf.function step with keras' SGD (the baseline)."""

    def __init__(self):
        layers = tf.keras.layers
        self.model = tf.keras.Sequential([
            tf.keras.Input((28, 28, 1), batch_size=BATCH),
            layers.Conv2D(20, 5), layers.MaxPooling2D(2, 2),
            layers.Conv2D(50, 5), layers.MaxPooling2D(2, 2),
            layers.Flatten(), layers.Dense(500, activation="relu"), layers.Dense(10)])
        schedule = tf.keras.optimizers.schedules.InverseTimeDecay(0.01, 1, 0.0001)  # same cost class as inv
        self.optimizer = tf.keras.optimizers.SGD(schedule, momentum=0.9, weight_decay=0.0005)
        self.loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.step_fn = tf.function(self._step)

    def _step(self, images, labels):
        with tf.GradientTape() as tape:
            loss = self.loss(labels, self.model(images, training=True))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss

    def step(self, images, labels):
        return float(self.step_fn(images, labels))


def ours(jit):
    net, source = parse_net(LENET, "lenet")
    solver = text_format.Parse(SOLVER, pb.SolverParameter())
    model = create_model("tensorflow", net, solver, source=source, seed=1, jit_compile=jit)
    return lambda images, labels: model.step({"data": images, "label": labels})


def timed(step, data, steps):
    start = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
    return BATCH * steps / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--jit", action="store_true", help="compile our step with XLA")
    parser.add_argument("--out", default="bench/results/tf_backend.jsonl", help="JSON lines are also appended here")
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): 1 round of 3 steps after 2 warm-up steps")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.rounds, args.warmup = 3, 1, 2

    def emit(record):
        _results.emit(record, args.out)

    contenders = {"deepspark_tf": (ours(args.jit), batches(16, "nchw")),
                  "keras": (KerasLeNet().step, batches(16, "nhwc"))}
    rates = {name: [] for name in contenders}
    for name, (step, data) in contenders.items():
        timed(step, data, args.warmup)
    order = list(contenders)
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            step, data = contenders[name]
            rates[name].append(timed(step, data, args.steps))
    for name, r in rates.items():
        emit({"bench": "tf_backend_lenet_step", "impl": name, "batch": BATCH,
              "images_per_s": round(statistics.median(r), 1), "best": round(max(r), 1),
              "jit_compile": args.jit if name == "deepspark_tf" else False})
    # Rounds alternate, so each pair saw about the same machine load: the median
    # of the per-round ratios is the figure least moved by other processes.
    ratios = [ours / theirs for ours, theirs in zip(rates["deepspark_tf"], rates["keras"])]
    emit({"bench": "tf_backend_lenet_step", "ratio_vs_keras": round(statistics.median(ratios), 3),
          "ratio_of_best": round(max(rates["deepspark_tf"]) / max(rates["keras"]), 3), "target": 0.95})
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    emit({"bench": "tf_backend_lenet_step", "peak_rss_mb": round(peak_kb / 1024, 1)})


if __name__ == "__main__":
    main()
