"""Python data layers for the tests: seeded synthetic batches, as an FCN's data layer makes them from files.

Each subclasses caffe.Layer (pycaffe's in the Caffe backend, DeepSpark's stand-in elsewhere) and takes its
settings from param_str as JSON.
"""

import json

import caffe
import numpy as np


class SyntheticData(caffe.Layer):
    """label (batch,) uniform over the channels; data (batch, channels, size, size): N(0, 1), plus 1 on the
    label's channel."""

    def setup(self, bottom, top):
        if bottom:
            raise ValueError("SyntheticData is a data layer: it takes no bottoms")
        params = json.loads(self.param_str or "{}")
        self.batch, self.channels, self.size = params.get("batch", 4), params.get("channels", 3), params.get("size", 8)
        self.rng = np.random.default_rng(params.get("seed", 0))

    def reshape(self, bottom, top):
        top[0].reshape(self.batch, self.channels, self.size, self.size)
        top[1].reshape(self.batch)

    def forward(self, bottom, top):
        label = self.rng.integers(0, self.channels, self.batch)
        data = self.rng.standard_normal((self.batch, self.channels, self.size, self.size)).astype(np.float32)
        data[np.arange(self.batch), label] += 1.0
        top[0].data[...] = data
        top[1].data[...] = label

    def backward(self, top, propagate_down, bottom):
        pass


class SyntheticSegmentation(caffe.Layer):
    """data (batch, 3, size, size) in N(0, 1); label (batch, 1, size, size): per pixel, the channel that is
    largest there (an FCN's per-pixel classes)."""

    def setup(self, bottom, top):
        params = json.loads(self.param_str or "{}")
        self.batch, self.size = params.get("batch", 2), params.get("size", 16)
        self.rng = np.random.default_rng(params.get("seed", 0))

    def reshape(self, bottom, top):
        top[0].reshape(self.batch, 3, self.size, self.size)
        top[1].reshape(self.batch, 1, self.size, self.size)

    def forward(self, bottom, top):
        data = self.rng.standard_normal((self.batch, 3, self.size, self.size)).astype(np.float32)
        top[0].data[...] = data
        top[1].data[...] = data.argmax(axis=1)[:, np.newaxis]

    def backward(self, top, propagate_down, bottom):
        pass


class FailingSetup(caffe.Layer):
    """A layer whose setup refuses its configuration, as a user's layer may."""

    def setup(self, bottom, top):
        raise ValueError("param_str must name a split")

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass
