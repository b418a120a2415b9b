"""A graph.Graph as one TensorFlow forward pass: the layer table applied in order.

`run` is traced once inside a tf.function; the Python loop over layers runs
at trace time only.
"""

import tensorflow as tf

from deepspark.backends.tensorflow.layers import LAYERS, Blob


def blob_index(graph):
    """{layer name: [index into graph.params of each of its parameter blobs]} (shared blobs resolved)."""
    owner = {}
    for i, param in enumerate(graph.params):
        owner[(param.layer, param.index)] = i
        for sharer in param.sharers:
            owner[tuple(sharer)] = i
    return {layer.name: [owner[(layer.name, b)] for b in range(len(layer.param_shapes))]
            for layer in graph.layers}


class Context:
    """What layer functions need beyond their bottoms: inputs, phase, randomness, state updates."""

    def __init__(self, graph, inputs, train, rng=None, seed=0, index=None):
        self.graph = graph
        self.inputs = inputs
        self.train = train
        self.rng = rng
        self.seed = seed
        self.index = index if index is not None else blob_index(graph)
        self.updates = []  # (parameter index, new value): BatchNorm's running statistics

    def update(self, layer, blob, value):
        self.updates.append((self.index[layer.name][blob], value))


def layer_params(layer, indices, params):
    values = []
    for i, shape in zip(indices, layer.param_shapes):
        value = params[i]
        if tuple(value.shape) != tuple(shape):  # a blob shared with a differently shaped owner
            value = tf.reshape(value, shape)
        values.append(value)
    return values


def run(graph, params, ctx):
    """One forward pass: (the weighted loss, {blob name: its last Blob}).

    `params` are tensors (or variables) in graph.params order and Caffe's shapes.
    """
    blobs = {}
    loss = tf.constant(0.0)
    for layer in graph.layers:
        bottoms = [blobs[name] for name in layer.bottoms]
        propagate = list(layer.param.propagate_down)
        if propagate:
            bottoms = [b if down else Blob(tf.stop_gradient(b.tensor), b.nhwc)
                       for b, down in zip(bottoms, propagate)]
        tops = LAYERS[layer.type](layer, bottoms, layer_params(layer, ctx.index[layer.name], params), ctx)
        for name, value, weight in zip(layer.tops, tops, layer.loss_weights):
            blobs[name] = value
            if weight:
                loss = loss + weight * tf.reduce_sum(value.tensor)
    return loss, blobs
