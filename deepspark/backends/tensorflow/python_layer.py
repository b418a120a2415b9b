"""Caffe's Python layer on TensorFlow: the user's layer on numpy through tf.numpy_function, its backward as the gradient.

Forward is one tf.numpy_function calling the layer's reshape and forward on
the bottoms' arrays; under a GradientTape, tf.custom_gradient hands the tops'
diffs to a second numpy_function that calls the layer's backward, as Caffe's
Backward does (the bottoms' and tops' data restored first, each bottom told to
propagate). Each model keeps one instance of the layer per Python layer of
its graph, set up once (pylayer.Runner): a layer that counts or reads files
goes on where it was, across the traced step, forward and gradient passes,
as one Caffe net's layer does.
"""

import weakref

from deepspark import pylayer
from deepspark.backends.tensorflow.runtime import tf

_runners = weakref.WeakKeyDictionary()  # graph -> {layer position: pylayer.Runner}


def runner(layer, graph):
    """The model's instance of `layer` (a graph.Layer of `graph`), set up on its first use."""
    per_graph = _runners.setdefault(graph, {})
    key = id(layer)
    if key not in per_graph:
        per_graph[key] = pylayer.Runner(layer.param, layer.bottom_shapes, graph.context.folder, graph.phase)
    return per_graph[key]


def run(layer, bottoms, graph):
    """The layer's top tensors (Caffe's layout) for its bottom tensors (Caffe's layout)."""
    python = runner(layer, graph)
    dtypes = [tf.float32] * len(layer.tops)
    shapes = [tuple(shape) for shape in layer.top_shapes]
    name = layer.name.replace("/", "_")

    def forward(*xs):
        tops = tf.numpy_function(python.forward, list(xs), dtypes, stateful=True, name=f"{name}_forward")
        for top, shape in zip(tops, shapes):
            top.set_shape(shape)
        return list(tops)

    if not bottoms:
        return forward()

    @tf.custom_gradient
    def bridged(*xs):
        tops = forward(*xs)

        def backward(*dys):
            dys = [tf.zeros_like(top) if dy is None else dy for top, dy in zip(tops, dys)]
            diffs = tf.numpy_function(lambda *arrays: python.backward(arrays[:len(xs)], arrays[len(xs):-len(dys)],
                                                                      arrays[-len(dys):]),
                                      list(xs) + tops + dys, [tf.float32] * len(xs), stateful=True,
                                      name=f"{name}_backward")
            for diff, x in zip(diffs, xs):
                diff.set_shape(x.shape)
            return list(diffs)

        return tops, backward

    return bridged(*bottoms)
