"""Shape rules of the recurrent layers: LSTM, RNN and LSTMUnit."""

from deepspark.graph.registry import ShapeError, count, exactly, fmt, layer_type


RECURRENT_STATES = {"LSTM": 2, "RNN": 1}  # hidden state blobs carried between passes: (h, c), (h)


def recurrent_inputs(lp):
    """(how many hidden-state bottoms and tops expose_hidden adds, whether a static input follows `cont`)."""
    exposed = RECURRENT_STATES[lp.type] if lp.recurrent_param.expose_hidden else 0
    return exposed, len(lp.bottom) > 2 + exposed


def _recurrent_fillers(lp):
    """Caffe's unrolled net's blobs: W_x, b, [W_static,] W_h (LSTM), and W_o, b_o after them (RNN)."""
    weight, bias = lp.recurrent_param.weight_filler, lp.recurrent_param.bias_filler
    static = recurrent_inputs(lp)[1]
    return [weight, bias] + [weight] * static + [weight] + [weight, bias] * (lp.type == "RNN")


@layer_type("LSTM", "RNN", fillers=_recurrent_fillers, bottoms=2, no_backward=(1,), unforced=(1,))
def _recurrent(lp, bottoms, ctx):
    """Caffe's Recurrent layers: x (T x N x ...), cont (T x N), [static (N x ...)], [exposed h_0 (, c_0)]."""
    param = lp.recurrent_param
    exposed, static = recurrent_inputs(lp)
    if len(bottoms) not in (2 + exposed, 3 + exposed) or len(lp.top) != 1 + exposed:
        raise ShapeError(f"{lp.type} takes x, cont{', a static input' if static else ''}"
                         f"{' and the exposed hidden states' * bool(exposed)}, and makes {1 + exposed} top(s)")
    x, cont = bottoms[:2]
    if len(x) < 2 or cont != x[:2]:
        raise ShapeError(f"{lp.type} needs x of T x N x ... and cont of T x N, got {fmt(x)} and {fmt(cont)}")
    if not param.num_output:
        raise ShapeError(f"{lp.type} needs recurrent_param.num_output")
    steps, streams, hidden = x[0], x[1], param.num_output
    gates = 4 * hidden if lp.type == "LSTM" else hidden
    params = [(gates, count(x, 2)), (gates,)]
    if static:
        if not bottoms[2] or bottoms[2][0] != streams:
            raise ShapeError(f"{lp.type}'s static input must be N x ..., N = {streams}, got {fmt(bottoms[2])}")
        params.append((gates, count(bottoms[2], 1)))
    params.append((gates, hidden))
    if lp.type == "RNN":
        params += [(hidden, hidden), (hidden,)]
    state = (1, streams, hidden)
    for shape in bottoms[2 + static:]:
        if shape != state:
            raise ShapeError(f"{lp.type}'s exposed hidden state must be {fmt(state)}, got {fmt(shape)}")
    return [(steps, streams, hidden)] + [state] * exposed, params


@layer_type("LSTMUnit", bottoms=3, no_backward=(2,), unforced=(2,))
def _lstm_unit(lp, bottoms, ctx):
    exactly(lp, bottoms, 3, 2)
    cell, gates, cont = bottoms
    if (len(cell) != 3 or cell[0] != 1 or gates != (1, cell[1], 4 * cell[2]) or cont != (1, cell[1])):
        raise ShapeError(f"LSTMUnit needs c_prev 1 x N x D, gates 1 x N x 4D and cont 1 x N, got "
                         f"{', '.join(fmt(s) for s in bottoms)}")
    return [cell, cell], []
