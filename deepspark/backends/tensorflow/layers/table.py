"""The layer table itself: LAYERS, its rows (Entry) and the @layer registration the family modules use."""

from typing import NamedTuple


class Entry(NamedTuple):
    """One layer type's row: its function, the axis order it takes each parameter blob in, what it carries.

    param_order: {blob index: permutation of Caffe's axes} for the blobs it
    wants in another layout than Caffe's; the model stores them so, and
    converts only at the contract's boundary. state: None, or a function of the
    graph.Layer giving the shapes of what the layer carries from one forward
    pass to the next (a recurrent layer's last hidden state): the model keeps
    them as variables (Context.carried), the function hands the new values on
    (Context.carry).
    """

    function: object
    param_order: dict
    state: object = None


LAYERS = {}  # layer type -> Entry


def layer(*types, param_order=None, state=None):
    def register(function):
        for kind in types:
            LAYERS[kind] = Entry(function, dict(param_order or {}), state)
        return function
    return register
