"""Caffe's LeNet (models/lenet) in tf.keras for the external peers, its test, and the single-process tf.keras run."""

import math
import time

import keras

import _peer_common


def lenet(config):
    """models/lenet in Keras, compiled with the solver's SGD: uint8 images N×28×28×1 in, logits out."""
    xavier = keras.initializers.VarianceScaling(1.0, "fan_in", "uniform")  # Caffe's xavier: U(±√(3/fan_in))
    # Caffe adds weight_decay·w to every blob's gradient (decay_mult 1): the gradient of (weight_decay/2)·w².
    decay = keras.regularizers.L2(config["weight_decay"] / 2)
    blobs = {"kernel_initializer": xavier, "kernel_regularizer": decay, "bias_regularizer": decay}
    model = keras.Sequential([
        keras.Input((28, 28, 1), dtype="uint8"),
        keras.layers.Rescaling(config["scale"]),  # transform_param's scale, inside the net as in Caffe's Data layer
        keras.layers.Conv2D(20, 5, **blobs),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(50, 5, **blobs),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(500, activation="relu", **blobs),
        keras.layers.Dense(10, **blobs),
    ])
    # Keras's momentum (v = m·v − lr·g, w += v) is Caffe's (v = m·v + lr·g, w −= v) at a constant lr.
    model.compile(keras.optimizers.SGD(config["base_lr"], momentum=config["momentum"]),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tester(config, x_test, y_test):
    """test(weights) → the test accuracy of Keras weights (get_weights() order)."""
    model = lenet(config)

    def test(arrays):
        model.set_weights(arrays)
        return _peer_common.accuracy(lambda images: model.predict_on_batch(images[..., None]), x_test, y_test)
    return test


class Milestones(keras.callbacks.Callback):
    """Writes the weights every `every` batches and after the last, and stops fit there: a fit's checkpoints."""

    def __init__(self, config, start, images, steps, stop):
        super().__init__()
        self.config, self.start, self.images, self.steps, self.stop = config, start, images, steps, stop
        self.every, self.done, self.samples = _peer_common.every(config, config["batch"]), 0, 0

    def on_train_batch_end(self, batch, logs=None):
        # An epoch's last batch is short (60,000 = 937·64 + 32): count the samples it held.
        self.done += 1
        self.stop.stepped()
        self.samples += min(self.config["batch"], self.images - batch * self.config["batch"])
        if self.done % self.every == 0 or self.done == self.steps:
            weights = self.model.get_weights()
            _peer_common.save(self.config, self.start, self.samples, weights, self.stop.tested)
            if self.stop.saved(weights):
                self.model.stop_training = True
        if self.done == self.steps:
            self.model.stop_training = True


def single(config):
    """model.fit on the whole training set in this process, batch 64 (its initial weights and order seeded by config's
    seed)."""
    keras.utils.set_random_seed(config.get("seed", 0))
    x, y, *_ = _peer_common.load(config)
    batch, stop = config["batch"], _peer_common.Stop(config, tester)
    steps = round(config["epochs"] * len(x) / batch)
    start = time.time()
    model, milestones = lenet(config), Milestones(config, start, len(x), steps, stop)
    model.fit(x[..., None], y, batch_size=batch, epochs=math.ceil(steps / math.ceil(len(x) / batch)), shuffle=True,
              verbose=0, callbacks=[milestones])
    return {"clock": "from before the model is built (TensorFlow imported, the data in memory): building and "
                     "compiling the model, fit's start-up (its input pipeline, tracing the train step), training, "
                     "and the checkpoint writes",
            "epochs": milestones.samples / len(x), "versions": _peer_common.versions("tensorflow", "keras"),
            **stop.report(start)}


RUNS = {"single": single}
