"""The blob layout library: a tensor in Caffe's (N, C, H, W) or NHWC, and the moves between them.

Convolutions, pooling and LRN compute in NHWC (TensorFlow's fast layout on
CPU) and hand NHWC blobs on; layers that only care about the channel axis keep
that layout, every other layer sees Caffe's (N, C, H, W).
"""

from typing import NamedTuple

from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import canonical_axis


TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)

# Convolution kernels as HWIO, TensorFlow's own layout: the permutation from Caffe's OIHW.
HWIO = (2, 3, 1, 0)


def batch_free(shape):
    """A blob's static shape for tf.reshape with its first (batch) axis left to the tensor: the same
    shape at the graph's batch size, and any batch in a SavedModel served with another."""
    return (-1,) + tuple(shape[1:])


def _permute(x, order):
    """tf.transpose, or a free reshape when the moved axes are all of size 1 (e.g. one channel)."""
    shape = x.shape.as_list()
    moved = [shape[i] for i in order]
    kept = [i for i in order if shape[i] != 1]  # a reshape only if the other axes keep their order
    if None not in shape and kept == sorted(kept):
        return tf.reshape(x, moved)
    return tf.transpose(x, order)


class Blob(NamedTuple):
    """A blob's tensor and its layout: Caffe's, or NHWC (4-axis blobs only)."""

    tensor: tf.Tensor
    nhwc: bool = False

    @property
    def rank(self):
        return self.tensor.shape.rank

    @property
    def caffe(self):
        """The tensor in Caffe's layout."""
        return _permute(self.tensor, TO_NCHW) if self.nhwc else self.tensor

    @property
    def as_nhwc(self):
        if self.nhwc:
            return self.tensor
        if self.rank != 4:
            raise NotImplementedError(f"the TensorFlow backend supports 2D spatial layers only, got a "
                                      f"{self.rank}-axis blob")
        return _permute(self.tensor, TO_NHWC)

    def axis(self, axis):
        """The tensor axis that holds Caffe's axis `axis`."""
        axis = canonical_axis(axis, self.rank)
        return TO_NHWC.index(axis) if self.nhwc else axis

    def like(self, tensor):
        return Blob(tensor, self.nhwc)


def same_layout(blobs):
    """The tensors of `blobs` in one layout (NHWC only if all are), and that layout."""
    nhwc = all(b.nhwc for b in blobs)
    return [b.tensor if nhwc else b.caffe for b in blobs], nhwc


def broadcast(blob, operand, axis):
    """(x, operand) ready to combine: operand covers Caffe axes axis..axis+operand.rank of blob."""
    count = operand.shape.rank
    if blob.nhwc and axis == 1 and count == 1:
        return blob.tensor, operand
    if blob.nhwc and axis == 1 and count == 3:
        return blob.tensor, tf.transpose(operand, (1, 2, 0))
    x = blob.caffe
    # An axis of unknown size (a served batch, SENet's N x C excitation at axis 0) is read from the tensor.
    dims = [tf.shape(operand)[i] if d is None else d for i, d in enumerate(operand.shape.as_list())]
    shape = [1] * axis + dims + [1] * (x.shape.rank - axis - count)
    return x, tf.reshape(operand, shape)


def one_top(function):
    """A layer whose single top is function(x, param) on the bottom's tensor, layout kept."""
    def run(layer, bottoms, params, ctx):
        return [bottoms[0].like(function(bottoms[0].tensor, layer.param))]
    run.__name__ = function.__name__
    run.__doc__ = function.__doc__
    return run
