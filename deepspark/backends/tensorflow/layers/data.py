"""Data layers in TensorFlow: the fed types' tensors, DummyData's fillers, HDF5Output's writes."""

import numpy as np

from deepspark import checkpoint, fillers
from deepspark.backends.tensorflow.layers.table import layer
from deepspark.backends.tensorflow.layout import Blob
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import FED_TYPES
from deepspark.proto import deepspark_pb2 as pb


@layer(*sorted(FED_TYPES))
def data(layer, bottoms, params, ctx):
    return [Blob(ctx.inputs[top]) for top in layer.tops]


@layer("DummyData")
def dummy_data(layer, bottoms, params, ctx):
    """Caffe's DummyData: filled once for constant fillers, refilled every pass otherwise."""
    specs = list(layer.param.dummy_data_param.data_filler) or [pb.FillerParameter()]
    tops = []
    for i, shape in enumerate(layer.top_shapes):
        filler = specs[i] if len(specs) > 1 else specs[0]
        kind = filler.type or "constant"
        if kind == "constant":
            value = tf.fill(shape, filler.value)
        elif kind == "uniform":
            value = ctx.rng.uniform(shape, filler.min, filler.max)
        elif kind == "gaussian" and filler.sparse < 0:
            value = ctx.rng.normal(shape, filler.mean, filler.std)
        else:
            value = tf.constant(fillers.fill(filler, shape, np.random.default_rng(ctx.seed)))
        tops.append(Blob(value))
    return tops


@layer("HDF5Output")
def hdf5_output(layer, bottoms, params, ctx):
    """Caffe's HDF5Output: every forward writes its two bottoms to the file (a stateful op the pass runs)."""
    path = layer.param.hdf5_output_param.file_name

    def write(data, label):
        checkpoint.write_hdf5_output(path, data, label)
        return np.float32(0)

    tf.numpy_function(write, [bottoms[0].caffe, bottoms[1].caffe], tf.float32, stateful=True,
                      name=layer.name.replace("/", "_") + "_write")
    return []
