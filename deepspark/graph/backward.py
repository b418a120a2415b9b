"""Which diffs Caffe's Net computes in its backward, layer by layer."""

from deepspark.graph.registry import REGISTRY


def backward_needs(graph):
    """Per layer, (bottom positions, blob positions) whose diffs Caffe's Net computes in its backward.

    Net::Init's rules: a blob needs a diff when a layer that wrote it needs a
    backward, and a layer needs one when a bottom needs a diff or a blob has a
    nonzero lr_mult; propagate_down overrides a bottom; a layer under no loss,
    or whose tops all skip back-propagation, computes none; force_backward
    gives every layer all of its blobs and the bottoms its type allows
    (Caffe's AllowForceBackward: the registry row's `unforced` are left out).
    """
    layers = graph.layers
    wants, needed, rows = set(), [], []  # blob names that need a diff; per layer: does it need a backward
    for layer in layers:
        down = list(layer.param.propagate_down)
        bottoms = [b for b, name in enumerate(layer.bottoms) if (down[b] if down else name in wants)]
        params = [b for b in range(len(layer.blob_params)) if layer.param_spec(b)[0] != 0]
        need = any(name in wants for name in layer.bottoms) or bool(params)
        if need:
            wants.update(layer.tops)
        needed.append(need)
        rows.append((bottoms, params))
    under_loss, read, kept = set(), set(), set()  # a blob read, but with no reader wanting its diff, skips
    for position in reversed(range(len(layers))):  # (Caffe decides this per Split top; here per blob)
        layer, (bottoms, params) = layers[position], rows[position]
        contributes = any(layer.loss_weights) or any(top in under_loss for top in layer.tops)
        if not contributes or all(top in read and top not in kept for top in layer.tops):
            needed[position], bottoms = False, []
        for b, name in enumerate(layer.bottoms):
            if contributes:
                under_loss.add(name)
            read.add(name)
            if b in bottoms:
                kept.add(name)
        rows[position] = (bottoms, params) if needed[position] else ([], [])
    if graph.net_param.force_backward:
        return [(sorted(set(bottoms) | set(REGISTRY[layer.type].forced(len(layer.bottoms)))),
                 list(range(len(layer.blob_params)))) for layer, (bottoms, _) in zip(layers, rows)]
    return rows
