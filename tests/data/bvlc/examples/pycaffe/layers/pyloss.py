"""A Euclidean loss written as a Caffe Python layer: the module and class examples/pycaffe/linreg.prototxt names.

DeepSpark's own code (not BVLC's file of the same name), for the tests: it
runs in pycaffe's native Python layer and in DeepSpark's TensorFlow bridge.
"""

import caffe
import numpy as np


class EuclideanLossLayer(caffe.Layer):
    """loss = sum((a - b)^2) / 2N over a batch of N, as Caffe's EuclideanLoss; its diffs are
    +-(a - b) / N times the loss's own diff (its loss_weight)."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise ValueError("EuclideanLossLayer takes two bottoms: a prediction and its target")

    def reshape(self, bottom, top):
        if bottom[0].count != bottom[1].count:
            raise ValueError("the prediction and the target differ in size")
        self.residual = np.zeros(bottom[0].data.shape, dtype=np.float32)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.residual[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.residual ** 2) / bottom[0].num / 2.0

    def backward(self, top, propagate_down, bottom):
        scale = top[0].diff[0] / bottom[0].num
        for i, sign in enumerate((1.0, -1.0)):
            if propagate_down[i]:
                bottom[i].diff[...] = sign * scale * self.residual
