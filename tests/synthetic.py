"""Small synthetic LMDBs and nets for tests: a learnable two-class image problem."""

import numpy as np

from deepspark.data import encode_datum
from deepspark.data.lmdb_io import write_lmdb


def make_lmdb(path, count, seed=0, size=8, classes=2):
    """Images whose class is which half of the image is bright; labels 0..classes-1."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        label = int(rng.integers(classes))
        image = rng.integers(0, 60, size=(1, size, size), dtype=np.uint8)
        rows = slice(0, size // 2) if label == 0 else slice(size // 2, size)
        image[:, rows, :] += 150
        records.append((b"%08d" % i, encode_datum(image, label)))
    write_lmdb(str(path), records)
    return str(path)


NET = """name: "Tiny"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{train}" batch_size: 10 backend: LMDB }} }}
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{test}" batch_size: 10 backend: LMDB }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 4 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "relu" type: "ReLU" bottom: "pool" top: "pool" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param {{ num_output: 2 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""

SOLVER = """net: "{net}"
test_iter: 10
test_interval: {test_interval}
base_lr: 0.05
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 20
max_iter: {max_iter}
snapshot: {snapshot}
snapshot_prefix: "{prefix}"
random_seed: 3
deepspark_param {{ workers: {workers} period: 4 moving_rate: 0.4 exchange_timeout: 60 connect_timeout: {connect_timeout} }}
"""


def make_job(folder, max_iter=60, test_interval=30, snapshot=0, workers=2, train_records=200, connect_timeout=120):
    """A tiny solver + net + LMDBs under `folder`; returns the solver path."""
    train = make_lmdb(folder / "train_lmdb", train_records, seed=1)
    test = make_lmdb(folder / "test_lmdb", 100, seed=2)  # 10 test batches of 10 cover it exactly
    (folder / "net.prototxt").write_text(NET.format(train=train, test=test))
    solver = folder / "solver.prototxt"
    solver.write_text(SOLVER.format(net=folder / "net.prototxt", test_interval=test_interval, max_iter=max_iter,
                                    snapshot=snapshot, prefix=folder / "out" / "tiny", workers=workers,
                                    connect_timeout=connect_timeout))
    return str(solver)


def before_conv(folder, name, module, layer, code):
    """The tiny net of make_job in `folder` with a pass-through Python layer `name` (`module`.`layer`, whose source
    `code` is written beside the net) between its data and its Convolution."""
    (folder / f"{module}.py").write_text(code)
    net = (folder / "net.prototxt").read_text()
    conv = 'layer { name: "conv" type: "Convolution" bottom: "data"'
    assert conv in net
    (folder / "net.prototxt").write_text(net.replace(conv, (
        f'layer {{ name: "{name}" type: "Python" bottom: "data" top: "{name}" '
        f'python_param {{ module: "{module}" layer: "{layer}" }} }}\n'
        f'layer {{ name: "conv" type: "Convolution" bottom: "{name}"')))


# A pass-through Python layer that, in a Spark task (the driver's tests never wait), holds its forward number HOLD until
# the file GO exists (at most 120 s): a harness writes GO once what it does has landed while the workers train (a
# throttle found its worker, a kill was made). A tiny job's thousands of iterations pass in seconds, and a harness
# looking at /proc from a loaded machine can come after them.
HOLD_LAYER = '''import os
import time
import caffe
from pyspark import TaskContext


class Hold(caffe.Layer):
    def setup(self, bottom, top):
        self.forwards, self.in_task = 0, TaskContext.get() is not None

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        self.forwards += 1
        if self.in_task and self.forwards == HOLD:
            deadline = time.monotonic() + 120
            while not os.path.exists(GO) and time.monotonic() < deadline:
                time.sleep(0.02)
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = top[0].diff
'''


def hold_before_conv(folder, go, hold=1):
    """The tiny net of make_job in `folder` with HOLD_LAYER before its Convolution: each Spark task's forward number
    `hold` waits for the file `go`."""
    before_conv(folder, "hold", "hold_layer", "Hold", f"GO = {str(go)!r}\nHOLD = {int(hold)}\n{HOLD_LAYER}")
