"""Elephas 7.3 training the Keras LeNet on Spark local[2]: its synchronous SparkModel and its asynchronous parameter server, per epoch and per batch."""

import math
import socket
import time

from elephas.parameter.client import HttpClient
from elephas.spark_model import AsynchronousSparkModel, SparkModel
from elephas.utils.rdd_utils import to_simple_rdd
from pyspark import SparkContext, TaskContext

import _peer_common
import _peer_keras

VERSIONS = ("elephas", "tensorflow", "keras", "pyspark")
NO_SYNCHRONOUS_BATCH = (
    "elephas 7.3 has no synchronous per-batch mode: its synchronous SparkModel averages the workers' deltas once per "
    "epoch and takes no frequency; AsynchronousSparkModel(mode='synchronous', frequency='batch') is accepted, but its "
    "parameter server then takes no lock (elephas/parameter/server.py locks in mode 'asynchronous' only) and the "
    "workers meet at no barrier: that is hogwild, not synchronous training")


def setting(config):
    """(SparkContext, train images N×28×28×1, train labels, the compiled master model, whole epochs to run)."""
    sc = SparkContext(conf=_peer_common.spark_conf(config["workers"]))
    sc.setLogLevel("ERROR")
    x, y, *_ = _peer_common.load(config)
    # elephas's fit runs whole epochs over each worker's partition: a fraction of one is not a place it stops at.
    return sc, x[..., None], y, _peer_keras.lenet(config), max(1, math.ceil(config["epochs"]))


def synchronous(config):
    """SparkModel: per epoch, one Spark job in which each worker trains an epoch on its partition from the broadcast
    weights; the driver averages their deltas. Checkpoints at epoch ends, the only place the weights meet."""
    if config["frequency"] != "epoch":
        raise _peer_common.Unavailable(NO_SYNCHRONOUS_BATCH)
    sc, x, y, model, epochs = setting(config)
    start = time.time()
    rdd = to_simple_rdd(sc, x, y)  # local[2]'s default parallelism: one partition per worker, so no num_workers
    spark_model = SparkModel(model, batch_size=config["batch"])
    for epoch in range(1, epochs + 1):
        # fit(epochs=1) per epoch is what fit(epochs=N) does inside, with the driver's weights in hand between.
        spark_model.fit(rdd, epochs=1, batch_size=config["batch"], verbose=0)
        _peer_common.save(config, start, epoch * len(x), spark_model.master_network.get_weights())
    return {"clock": "from before the data is parallelized (SparkContext up, the data and the master model in the "
                     "driver): the RDD of 60,000 (image, label) pairs in 2 partitions, then per epoch a Spark job "
                     "(weights broadcast, task launch, on the first the Python workers' TensorFlow import; each "
                     "worker builds and compiles the model and trains an epoch on its partition), the deltas "
                     "collected and averaged on the driver, and the checkpoint write",
            "epochs": epochs, "versions": _peer_common.versions(*VERSIONS)}


class MilestoneClient(HttpClient):
    """Elephas's HTTP client that, in worker 0, also writes the center it pulls every `every` pulls: the checkpoints
    of an asynchronous run, whose parameter server is a process of its own with no hook.

    Before its n-th pull worker 0 has pushed n−1 updates, and the other worker, at the same pace, about as many: the
    checkpoint counts (n−1)·per_pull samples.
    """

    def __init__(self, port, config, start, per_pull):
        super().__init__(port)
        self.config, self.start, self.per_pull, self.pulls = config, start, per_pull, 0
        self.every = _peer_common.every(config, per_pull)

    def get_parameters(self):
        weights = super().get_parameters()
        task = TaskContext.get()
        if task is not None and task.partitionId() == 0:
            if self.pulls and self.pulls % self.every == 0:
                _peer_common.save(self.config, self.start, self.pulls * self.per_pull, weights)
            self.pulls += 1
        return weights


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def asynchronous(config):
    """AsynchronousSparkModel, mode 'asynchronous' (the server locks): one Spark job in which each worker pulls the
    weights from the Flask parameter server, trains a batch or an epoch, and pushes its delta back."""
    sc, x, y, model, epochs = setting(config)
    port = free_port()
    start = time.time()
    rdd = to_simple_rdd(sc, x, y)
    spark_model = AsynchronousSparkModel(model, mode="asynchronous", frequency=config["frequency"],
                                         parameter_server_mode="http", port=port, batch_size=config["batch"])
    per_pull = config["batch"] * config["workers"] if config["frequency"] == "batch" else len(x)
    spark_model.client = MilestoneClient(port, config, start, per_pull)
    # elephas stops its server only when fit returns: daemonic, a failed run's server ends with it instead of
    # keeping the run's process waiting for it at exit.
    spark_model.parameter_server.server.daemon = True
    spark_model.fit(rdd, epochs=epochs, batch_size=config["batch"], verbose=0)
    _peer_common.save(config, start, epochs * len(x), spark_model.master_network.get_weights())
    return {"clock": "from before the data is parallelized (SparkContext up, the data and the master model in the "
                     "driver): the RDD of 60,000 (image, label) pairs in 2 partitions, the Flask parameter server "
                     "forked from the driver, one Spark job (task launch, the Python workers' TensorFlow import, "
                     f"model build and compile; training with a pull and a push over HTTP every "
                     f"{config['frequency']}; worker 0's checkpoint writes), and the final pull and checkpoint write",
            "epochs": epochs, "versions": _peer_common.versions(*VERSIONS)}


RUNS = {"synchronous": synchronous, "asynchronous": asynchronous}
tester = _peer_keras.tester
