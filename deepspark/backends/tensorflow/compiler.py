"""A graph.Graph as one TensorFlow forward pass: the layer table applied in order.

`run` is traced once inside a tf.function; the Python loop over layers runs
at trace time only.
"""

from deepspark.backends.tensorflow.layers import LAYERS
from deepspark.backends.tensorflow.layout import Blob
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import canonical_axis, spec

# Layer types whose functions read no blob's height or width from the graph (its shapes at the prototxt's
# input size) when the tensors leave them unknown: a net of these alone serves any input size as Caffe
# reshapes it (a fully convolutional net, FCN's Deconvolution and Crop included). InnerProduct, Reshape, SPP
# and the rest fix it.
SIZE_FREE = frozenset({
    "Input", "Convolution", "Deconvolution", "Pooling", "Crop", "ReLU", "PReLU", "Sigmoid", "TanH", "AbsVal", "ELU",
    "BNLL", "Power", "Exp", "Log", "Threshold", "Clip", "Swish", "Softmax", "Concat", "Dropout", "Split", "Eltwise",
    "LRN", "MVN", "BatchNorm", "BatchNormKyle", "Silence",
})
# Scale and Bias multiply or add an operand (a blob, or a second bottom) over axes axis..axis+rank: free of
# the size where it covers no more than the channels.
PER_CHANNEL = frozenset({"Scale", "Bias"})


def size_free(layer):
    """Whether `layer` serves any input size: its type reads no size, or it is a per-channel Scale or Bias."""
    if layer.type in SIZE_FREE:
        return True
    if layer.type not in PER_CHANNEL:
        return False
    rank = len(layer.bottom_shapes[1]) if len(layer.bottoms) > 1 else len(layer.param_shapes[0])
    param = layer.param.scale_param if layer.type == "Scale" else layer.param.bias_param
    return rank == 0 or (rank == 1 and canonical_axis(param.axis, len(layer.bottom_shapes[0])) == 1)


def size_fixers(graph):
    """The layers of `graph` that fix its input's height and width (none: it serves any size)."""
    return [layer for layer in graph.layers if not size_free(layer)]


def wanted_order(layer_type, blob):
    """The axis order a layer function takes blob `blob` in (None: Caffe's)."""
    return LAYERS[layer_type].param_order.get(blob)


def storage_orders(graph):
    """Per graph.params entry, the permutation of Caffe's axes it is stored in (None: Caffe's).

    A blob is stored as its layer function wants it, unless it is shared by a
    layer that wants it otherwise.
    """
    wanted = [set() for _ in graph.params]  # (order, shape) each user of the blob wants
    for layer in graph.layers:
        for b, (i, shape) in enumerate(zip(layer.blob_params, layer.param_shapes)):
            wanted[i].add((wanted_order(layer.type, b), shape))
    return [users.pop()[0] if len(users) == 1 else None for users in wanted]


def permute(value, order):
    return value if order is None else tf.transpose(value, order)


def inverse(order):
    return None if order is None else tuple(sorted(range(len(order)), key=order.__getitem__))


class Context:
    """What layer functions need beyond their bottoms: inputs, phase, randomness, state updates.

    state: {id(graph.Layer): [tf.Variable]} from carried_state, what layers
    carry between passes (None: each pass starts from zeros, as a fresh net).
    """

    def __init__(self, graph, inputs, train, rng=None, seed=0, orders=None, state=None):
        self.graph = graph
        self.orders = orders or [None] * len(graph.params)  # storage order of each parameter
        self.inputs = inputs
        self.train = train
        self.rng = rng
        self.seed = seed
        self.state = state or {}
        self.updates = []  # (parameter index, new value): BatchNorm's running statistics
        self.carries = []  # (variable, new value): what a layer carries to the next pass

    def update(self, layer, blob, value):
        self.updates.append((layer.blob_params[blob], value))

    def carried(self, layer):
        """The variables holding what `layer` carried from the last pass, or None (start from zeros)."""
        return self.state.get(id(layer))

    def carry(self, layer, values):
        """Hand `values` on to the next pass of `layer` (where the model keeps its state)."""
        self.carries += list(zip(self.state.get(id(layer), ()), values))


def carried_state(graph):
    """{id(layer): [zero tf.Variable per shape]} for the layers of `graph` whose table row carries state."""
    state = {}
    for layer in graph.layers:
        shapes = LAYERS[layer.type].state(layer) if LAYERS[layer.type].state else []
        if shapes:
            state[id(layer)] = [tf.Variable(tf.zeros(shape, tf.float32), trainable=False,
                                            name=f"state{len(state)}_{i}") for i, shape in enumerate(shapes)]
    return state


def layer_params(layer, params, orders):
    """A layer's parameter values in the shapes and axis orders its function takes."""
    values = []
    for b, (i, shape) in enumerate(zip(layer.blob_params, layer.param_shapes)):
        value, stored, wanted = params[i], orders[i], wanted_order(layer.type, b)
        if stored == wanted and (stored is not None or tuple(value.shape) == tuple(shape)):
            values.append(value)
            continue
        value = permute(value, inverse(stored))
        if tuple(value.shape) != tuple(shape):  # a blob shared with a differently shaped owner
            value = tf.reshape(value, shape)
        values.append(permute(value, wanted))
    return values


def run(graph, params, ctx):
    """One forward pass: (the weighted loss, {blob name: its last Blob}).

    `params` are tensors (or variables) in graph.params order, each in Caffe's
    shape permuted by ctx.orders (by default: Caffe's layout).
    """
    blobs = {}
    loss = None
    for layer in graph.layers:
        bottoms = [blobs[name] for name in layer.bottoms]
        propagate = list(layer.param.propagate_down) or [True] * len(bottoms)
        refused = spec(layer.type).refused(len(bottoms))  # labels, indices: Caffe gives them no diff
        if refused or not all(propagate):
            bottoms = [b if down and i not in refused else Blob(tf.stop_gradient(b.tensor), b.nhwc)
                       for i, (b, down) in enumerate(zip(bottoms, propagate))]
        values = layer_params(layer, params, ctx.orders)
        tops = LAYERS[layer.type].function(layer, bottoms, values, ctx)
        for name, value, weight in zip(layer.tops, tops, layer.loss_weights):
            blobs[name] = value
            if weight:
                term = value.tensor if value.tensor.shape.rank == 0 else tf.reduce_sum(value.tensor)
                term = term if weight == 1 else weight * term
                loss = term if loss is None else loss + term
    return (tf.constant(0.0) if loss is None else loss), blobs
