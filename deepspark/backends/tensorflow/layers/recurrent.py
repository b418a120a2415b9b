"""Recurrent layers in TensorFlow: Caffe's unrolled LSTM and RNN nets, time-major, and LSTMUnit."""

from deepspark.backends.tensorflow.layers.table import layer
from deepspark.backends.tensorflow.layout import Blob
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import RECURRENT_STATES, recurrent_inputs


def lstm_unit(previous, gates, cont):
    """Caffe's LSTMUnit on N x D cells, N x 4D gate inputs (i, f, o, g) and N markers: (c, h).

    f is cont * sigmoid (0 where cont is 0); the backward is Caffe's, whose
    f (1 - f) is the gradient only for cont in {0, 1}.
    """
    hidden = previous.shape[-1]
    cont = cont[:, None]

    @tf.custom_gradient
    def unit(previous, gates):
        i, f, o = (tf.sigmoid(gates[:, k * hidden:(k + 1) * hidden]) for k in range(3))
        g = tf.tanh(gates[:, 3 * hidden:])
        f = tf.where(tf.equal(cont, 0.0), 0.0, cont * f)
        c = f * previous + i * g
        tanh_c = tf.tanh(c)

        def grad(c_diff, h_diff):
            c_diff = tf.zeros_like(c) if c_diff is None else c_diff
            h_diff = tf.zeros_like(c) if h_diff is None else h_diff
            c_term = c_diff + h_diff * o * (1.0 - tf.square(tanh_c))
            gates_diff = tf.concat([c_term * g * i * (1.0 - i), c_term * previous * f * (1.0 - f),
                                    h_diff * tanh_c * o * (1.0 - o), c_term * i * (1.0 - tf.square(g))], axis=1)
            return c_term * f, gates_diff
        return (c, o * tanh_c), grad
    return unit(previous, gates)


@layer("LSTMUnit")
def lstm_unit_layer(layer, bottoms, params, ctx):
    cell, gates, cont = (blob.caffe for blob in bottoms)
    c, h = lstm_unit(cell[0], gates[0], cont[0])
    return [Blob(c[None]), Blob(h[None])]


def recurrent_state(layer):
    """The shapes of what a LSTM/RNN carries from one forward pass to the next: h (and c), 1 x N x num_output;
    nothing when expose_hidden gives them as bottoms and tops."""
    exposed, _ = recurrent_inputs(layer.param)
    state = (1, layer.bottom_shapes[0][1], layer.param.recurrent_param.num_output)
    return [] if exposed else [state] * RECURRENT_STATES[layer.type]


@layer("LSTM", "RNN", state=recurrent_state)
def recurrent(layer, bottoms, params, ctx):
    """Caffe's LSTM and RNN layers over T steps of N streams, as their unrolled nets compute them.

    Step t reads h_{t-1} * cont_t (and the LSTMUnit zeroes f where cont_t is
    0), so cont_t = 0 starts a new sequence. h_0 (and c_0) are the last
    step's of the previous forward pass (zeros at first), or the exposed
    bottoms; Caffe passes no diff into or out of them (hence stop_gradient).
    """
    exposed, static = recurrent_inputs(layer.param)
    hidden = layer.param.recurrent_param.num_output
    steps, streams = layer.bottom_shapes[0][:2]
    x = tf.reshape(bottoms[0].caffe, (steps * streams, -1))
    cont = tf.reshape(bottoms[1].caffe, (steps, streams))
    weights = list(params)
    inputs = tf.reshape(tf.matmul(x, weights[0], transpose_b=True) + weights[1], (steps, streams, -1))
    if static:
        static_x = tf.reshape(bottoms[2].caffe, (streams, -1))
        inputs = inputs + tf.matmul(static_x, weights[2], transpose_b=True)[None]
    recurrent_weights = weights[2 + static:]
    if exposed:
        state = [tf.reshape(blob.caffe, (streams, hidden)) for blob in bottoms[2 + static:]]
    else:
        carried = ctx.carried(layer)
        state = ([tf.reshape(v, (streams, hidden)) for v in carried] if carried
                 else [tf.zeros((streams, hidden))] * RECURRENT_STATES[layer.type])
    state = [tf.stop_gradient(s) for s in state]
    outputs = []
    for t in range(steps):
        held = state[0] * cont[t][:, None]
        if layer.type == "LSTM":
            gates = tf.matmul(held, recurrent_weights[0], transpose_b=True) + inputs[t]
            c, h = lstm_unit(state[1], gates, cont[t])
            state = [h, c]
            outputs.append(h)
        else:
            w_hh, w_ho, b_o = recurrent_weights
            h = tf.tanh(tf.matmul(held, w_hh, transpose_b=True) + inputs[t])
            state = [h]
            outputs.append(tf.tanh(tf.matmul(h, w_ho, transpose_b=True) + b_o))
    final = [tf.reshape(tf.stop_gradient(s), (1, streams, hidden)) for s in state]
    if not exposed:
        ctx.carry(layer, final)
    return [Blob(tf.stack(outputs))] + [Blob(s) for s in final[:exposed]]
