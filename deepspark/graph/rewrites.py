"""Rewrites of a net for a forward pass (compare, the scoring path, Net): batch size, input shapes, taps, a span of
layers."""

import copy

from deepspark.graph.registry import types
from deepspark.proto import deepspark_pb2 as pb
from deepspark.upgrade import upgrade_input


def with_batch_size(net, batch_size):
    """A copy of `net` whose Input layers (and legacy inputs) have batch `batch_size`."""
    net = copy.deepcopy(net)
    if batch_size:
        for layer in net.layer:
            if layer.type == "Input":
                for shape in layer.input_param.shape:
                    if shape.dim:
                        shape.dim[0] = batch_size
        for shape in net.input_shape:
            if shape.dim:
                shape.dim[0] = batch_size
        if net.input_dim:
            for i in range(0, len(net.input_dim), 4):
                net.input_dim[i] = batch_size
    return net


def with_input_shapes(net, shapes):
    """A copy of `net` whose inputs named in `shapes` ({top: shape}) take those shapes: its Input layers' tops
    (legacy `input:` fields become an Input layer first, as Caffe upgrades them); a KeyError names a top that
    is no input."""
    net = copy.deepcopy(net)
    upgrade_input(net)
    found = set()
    for layer in net.layer:
        if layer.type != "Input" or not any(top in shapes for top in layer.top):
            continue
        given = [list(shape.dim) for shape in layer.input_param.shape]
        given = given * len(layer.top) if len(given) == 1 else given
        del layer.input_param.shape[:]
        for top, dims in zip(layer.top, given):
            layer.input_param.shape.add().dim.extend(shapes.get(top, dims))
        found.update(layer.top)
    missing = [top for top in shapes if top not in found]
    if missing:
        raise KeyError(f"'{missing[0]}' is not an input of this net")
    return net


TAP = "{top}@{layer}"


def tap_name(graph, blob):
    """The output that carries `blob` of `graph` once with_taps has tapped it: the blob itself when it is
    an output already, else `blob@<its last writer>`; a KeyError naming the blobs there are if none."""
    if blob in graph.outputs:
        return blob
    writers = [layer for layer in graph.layers if blob in layer.tops]
    if not writers:
        known = list(dict.fromkeys(top for layer in graph.layers for top in layer.tops))
        raise KeyError(f"the net has no blob '{blob}'; its blobs are {', '.join(known)}")
    return TAP.format(top=blob, layer=writers[-1].name)


def with_taps(net, graph, blobs=None):
    """A copy of `net` with a Split copying each blob (or each of `blobs`) out as an output, after its
    last writer.

    Backends return only a net's outputs; a copy named `top@layer` (tap_name)
    makes a blob one of them. A blob rewritten in place is tapped after its
    last in-place layer (Caffe cannot split a blob that an in-place layer also
    reads): its value after the forward pass, as pycaffe's net.blobs holds it.
    Nothing else in the forward pass changes.
    """
    wanted = None if blobs is None else {tap_name(graph, blob) for blob in blobs}
    net = copy.deepcopy(net)
    del net.layer[:]
    outputs = set(graph.outputs)
    for i, layer in enumerate(graph.layers):
        added = net.layer.add()
        added.CopyFrom(layer.param)
        for field_name in ("include", "exclude"):
            added.ClearField(field_name)
        if layer.type in types("data"):
            continue
        for top in layer.named_tops:
            if top in outputs or any(top in later.tops for later in graph.layers[i + 1:]):
                continue  # already an output, or rewritten in place later: tapped there
            name = TAP.format(top=top, layer=layer.name)
            if wanted is not None and name not in wanted:
                continue
            tap = net.layer.add(name=name + "/tap", type="Split")
            tap.bottom.append(top)
            tap.top.append(name)
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")
    return net


def layers_between(graph, first, last, shapes):
    """A net of the layers first..last of `graph` (indices into graph.layers, both run), as Caffe's
    Net::ForwardFromTo runs them on blobs that hold what earlier passes left: each blob they read before any of
    them writes it is an input of the shape `shapes` gives it ({blob: shape}), and so are the data layers' tops
    among them (the caller feeds their blobs). The layers keep their parameters' names and order."""
    net = pb.NetParameter(name=f"{graph.layers[first].name}..{graph.layers[last].name}")
    written, inputs, kept = set(), [], []
    for layer in graph.layers[first:last + 1]:
        if layer.type in types("data"):
            inputs += [top for top in layer.named_tops if top not in inputs]
            written.update(layer.tops)
            continue
        inputs += [bottom for bottom in layer.bottoms if bottom not in written and bottom not in inputs]
        written.update(layer.tops)
        kept.append(layer)
    if inputs:
        fed = net.layer.add(name="inputs@span", type="Input")
        fed.top.extend(inputs)
        for blob in inputs:
            fed.input_param.shape.add().dim.extend(shapes[blob])
    for layer in kept:
        added = net.layer.add()
        added.CopyFrom(layer.param)
        for field_name in ("include", "exclude"):
            added.ClearField(field_name)
    return net
