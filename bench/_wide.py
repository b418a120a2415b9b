"""A synthetic job of GoogLeNet's parameter count (6,998,552) and a cheap step, for the benchmarks where the exchange, not the compute, is what is measured (#14): inner products over 32x32 synthetic images."""

import os

import numpy as np

from deepspark.data import encode_datum
from deepspark.data.lmdb_io import write_lmdb

GOOGLENET_PARAMETERS = 6_998_552

# 1024 -> 4096 -> 684 -> 10 with biases: 4,198,400 + 2,802,348 + 6,850 = 7,007,598; the last hidden width is
# GoogLeNet's count within 0.2%, close enough for a vector that is what the exchange moves.
NET = """name: "Wide"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{source}" batch_size: 32 backend: LMDB }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param {{ num_output: 4096 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 684 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "ip2" top: "ip2" }}
layer {{ name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }}
"""

SOLVER = """net: "{net}"
base_lr: 0.001
momentum: 0.9
weight_decay: 0.0005
lr_policy: "fixed"
display: 10
max_iter: 1000
snapshot: 0
snapshot_after_train: false
snapshot_prefix: "{prefix}"
random_seed: 1
"""


def wide_job(folder, records=2048, seed=0):
    """The wide net, its solver and a synthetic LMDB of `records` 1x32x32 images (10 classes, each a brighter band)
    in `folder`; the solver's path."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    items = []
    for i in range(records):
        label = int(rng.integers(10))
        image = rng.integers(0, 60, size=(1, 32, 32), dtype=np.uint8)
        image[:, 3 * label:3 * label + 3, :] += 150
        items.append((b"%08d" % i, encode_datum(image, label)))
    source = os.path.join(folder, "train_lmdb")
    if not os.path.exists(source):
        write_lmdb(source, items)
    net = os.path.join(folder, "wide.prototxt")
    with open(net, "w") as stream:
        stream.write(NET.format(source=source))
    solver = os.path.join(folder, "solver.prototxt")
    with open(solver, "w") as stream:
        stream.write(SOLVER.format(net=net, prefix=os.path.join(folder, "wide")))
    return solver
