"""The net of one phase as a DAG: its layers in order, blob shapes and learnable parameters."""

import copy
from dataclasses import dataclass, field

from deepspark import pylayer
from deepspark.errors import SourceMap
from deepspark.graph.backward import backward_needs
from deepspark.graph.phase import layer_included, make_state
from deepspark.graph.registry import AUTOMATIC, REGISTRY, ShapeError, count, fmt, types
from deepspark.proto import deepspark_pb2 as pb
from deepspark.upgrade import input_layer

# Types of the bundled pycaffe's sources that it cannot run either (docs/layers.md): there is nothing to equal.
UNRUNNABLE = {
    "PSROIPooling": "the bundled pycaffe cannot run it either: its CPU Forward is NOT_IMPLEMENTED (it aborts the "
                    "process, 'Not Implemented Yet')",
    "BN": "the bundled pycaffe cannot run it either: the fork's bn_layer.cpp registers no type (it aborts, "
          "'Unknown layer type: BN'); BatchNormKyle (use_alpha_beta) is the fork's batch norm it runs",
}


@dataclass
class Layer:
    """One layer of the net in this phase, with its shapes."""

    name: str
    type: str
    bottoms: list
    tops: list
    param: object  # the LayerParameter
    index: object  # its position in NetParameter.layer (None when synthesized)
    bottom_shapes: list = field(default_factory=list)
    top_shapes: list = field(default_factory=list)
    param_shapes: list = field(default_factory=list)
    loss_weights: list = field(default_factory=list)
    blob_params: list = field(default_factory=list)  # index into Graph.params of each of its blobs (shared too)
    automatic: int = 0  # how many of its last tops Caffe's Net made, the prototxt naming none (a loss layer's)

    def param_spec(self, i):
        """lr_mult, decay_mult and share name of parameter blob i (Caffe's defaults when unset)."""
        given = self.param.param[i] if i < len(self.param.param) else pb.ParamSpec()
        if not REGISTRY[self.type].learned:
            return 0.0, 0.0, given.name
        return given.lr_mult, given.decay_mult, given.name

    @property
    def named_tops(self):
        """Its tops that other layers can read and the net can output: all but the automatic ones."""
        return self.tops[:len(self.tops) - self.automatic]

    @property
    def in_place(self):
        return bool(self.tops) and self.tops[0] in self.bottoms[:1]


@dataclass
class Param:
    """A learnable blob: its owner layer, index in that layer and Caffe's solver multipliers.

    `layer` is the owner's name, for the user; `owner` its position in
    Graph.layers, for the code (Caffe lets two layers of a phase share a name).
    """

    layer: str
    owner: int
    index: int
    shape: tuple
    lr_mult: float
    decay_mult: float
    sharers: list = field(default_factory=list)  # (layer, index) pairs that reuse it

    @property
    def size(self):
        return count(self.shape) if self.shape is not None else None


class BuildContext:
    """What shape inference needs from outside the prototxt: the data shapes, a batch size, the phase, and the
    prototxt's folder (where a Python layer's module is looked for first)."""

    def __init__(self, data_shape=None, batch_size=None, phase=pb.TRAIN, folder=None):
        self._data_shape = data_shape
        self.batch_size = batch_size
        self.phase = phase
        self.folder = folder
        self.warnings = []
        self.unknown = {}  # layer name -> why its data shape is unknown

    def data_shape(self, layer_param):
        if self._data_shape is None:
            return None
        shape = self._data_shape(layer_param)
        if isinstance(shape, str):
            self.warnings.append(shape)
            self.unknown[layer_param.name] = shape
            return None
        if isinstance(shape, dict):  # per top (HDF5Data's datasets)
            return {top: tuple(dims) for top, dims in shape.items()}
        return tuple(shape) if shape is not None else None


class Graph:
    """The net of one phase: layers in order, blob shapes, learnable parameters."""

    def __init__(self, net_param, phase=pb.TRAIN, stages=None, level=None, source=None,
                 data_shape=None, batch_size=None):
        self.net_param = net_param
        self.source = source or SourceMap("<net>")
        self.state = make_state(net_param, phase, stages, level)
        self.phase = self.state.phase
        self.context = BuildContext(data_shape, batch_size, self.phase, pylayer.source_folder(self.source.filename))
        self.layers = []
        self.blobs = {}  # name -> shape (the latest version of in-place blobs)
        self.producers = {}  # name -> layer name
        self.consumers = {}  # name -> [layer names]
        self.params = []
        self._build()

    @property
    def name(self):
        return self.net_param.name

    @property
    def warnings(self):
        return self.context.warnings

    def _error(self, message, index, field=None):
        return self.source.error(message, index, field)

    def _build(self):
        for i, lp in enumerate(self.net_param.layer):
            if lp.type in UNRUNNABLE:
                raise self._error(f"layer '{lp.name}': {lp.type} is refused: {UNRUNNABLE[lp.type]}", i, "type")
            if lp.type not in REGISTRY:
                raise self._error(f"layer '{lp.name}': unknown layer type '{lp.type}' (docs/layers.md lists the "
                                  "supported types)", i, "type")
            if lp.include and lp.exclude:
                raise self._error(f"layer '{lp.name}': give include rules or exclude rules, not both", i)
        # A net built in code may still carry `input:` fields (config upgrades a file's as it reads it).
        upgraded = input_layer(self.net_param, lambda: self.source.where(None))
        entries = [(None, upgraded)] if upgraded else []
        entries += [(i, lp) for i, lp in enumerate(self.net_param.layer) if layer_included(lp, self.state)]
        for index, lp in entries:  # a name may repeat: Caffe's Net::Init does not refuse it
            self._add(index, lp)
        self._collect_params()

    def _add(self, index, lp):
        layer = Layer(lp.name, lp.type, list(lp.bottom), list(lp.top), lp, index)
        row = REGISTRY[lp.type]
        shaped = lp  # what the shape function reads: the prototxt's layer, its automatic top added
        if row.loss and not lp.top:
            # Caffe's Net::AppendTop for a LossLayer (AutoTopBlobs, one top): a top named "(automatic)" that
            # carries the loss (its loss_weight, 1 by default) and that no later layer can read
            layer.tops, layer.automatic = [AUTOMATIC], 1
            shaped = copy.deepcopy(lp)
            shaped.top.append(AUTOMATIC)
        for b, bottom in enumerate(layer.bottoms):
            if bottom not in self.blobs:
                raise self._error(f"layer '{lp.name}': bottom '{bottom}' is not produced by any earlier layer "
                                  f"in phase {pb.Phase.Name(self.phase)}", index, "bottom")
            layer.bottom_shapes.append(self.blobs[bottom])
            self.consumers.setdefault(bottom, []).append(lp.name)
        for t, top in enumerate(layer.named_tops):
            in_place = t < len(layer.bottoms) and layer.bottoms[t] == top
            if top in self.blobs and not in_place:
                raise self._error(f"layer '{lp.name}': top '{top}' is already produced by layer "
                                  f"'{self.producers[top]}' (only in-place use may reuse a blob name)",
                                  index, "top")
        if len(layer.bottoms) < row.min_bottoms:
            needed = "a bottom" if row.min_bottoms == 1 else f"{row.min_bottoms} bottoms"
            raise self._error(f"layer '{lp.name}' ({lp.type}) needs {needed}", index)
        if len(layer.tops) < row.tops:
            raise self._error(f"layer '{lp.name}' ({lp.type}) needs a top (Caffe aborts; it names one itself for "
                              "a loss layer only)", index)
        if any(shape is None for shape in layer.bottom_shapes):
            tops, params = [None] * len(layer.tops), [None] * row.blob_count(shaped)
        else:
            try:
                tops, params = row.shapes(shaped, [tuple(s) for s in layer.bottom_shapes], self.context)
            except ShapeError as error:
                raise self._error(f"layer '{lp.name}' ({lp.type}): {error}", index) from None
        if len(tops) < len(layer.tops):
            raise self._error(f"layer '{lp.name}' ({lp.type}) has {len(layer.tops)} tops; it makes "
                              f"{len(tops)}", index, "top")
        layer.top_shapes = [tuple(s) if s is not None else None for s in tops[:len(layer.tops)]]
        layer.param_shapes = [tuple(s) if s is not None else None for s in params]
        if lp.loss_weight:
            if len(lp.loss_weight) != len(layer.tops):
                raise self._error(f"layer '{lp.name}': loss_weight must be given once per top, or not at all",
                                  index, "loss_weight")
            layer.loss_weights = list(lp.loss_weight)
        else:
            default = 1.0 if row.loss else 0.0
            layer.loss_weights = [default] + [0.0] * (len(layer.tops) - 1) if layer.tops else []
        for top, shape in zip(layer.named_tops, layer.top_shapes):
            self.blobs[top] = shape
            self.producers[top] = lp.name
        self.layers.append(layer)

    def _collect_params(self):
        shared = {}  # share name -> index into self.params
        for position, layer in enumerate(self.layers):
            for i, shape in enumerate(layer.param_shapes):
                lr, decay, name = layer.param_spec(i)
                if name and name in shared:
                    owner = self.params[shared[name]]
                    if owner.shape is not None and shape is not None and count(owner.shape) != count(shape):
                        raise self._error(f"layer '{layer.name}': shared parameter '{name}' has shape "
                                          f"{fmt(shape)}, its owner '{owner.layer}' has {fmt(owner.shape)}",
                                          layer.index, "param")
                    owner.sharers.append((layer.name, i))
                    layer.blob_params.append(shared[name])
                    continue
                if name:
                    shared[name] = len(self.params)
                layer.blob_params.append(len(self.params))
                self.params.append(Param(layer.name, position, i, shape, lr, decay))

    # -- questions the backends and the CLI ask -------------------------------

    def layer(self, name):
        """The layer called `name`; of several, the last (Caffe's Net::layer_by_name)."""
        named = [layer for layer in self.layers if layer.name == name]
        if not named:
            raise KeyError(f"no layer '{name}' in phase {pb.Phase.Name(self.phase)}")
        return named[-1]

    @property
    def outputs(self):
        """Blobs no later layer reads or rewrites (Caffe's net outputs)."""
        result = []
        for i, layer in enumerate(self.layers):
            later = self.layers[i + 1:]
            for top in layer.named_tops:  # an automatic top is not one: Caffe's Net leaves it out
                if top not in result and not any(top in l.bottoms or top in l.tops for l in later):
                    result.append(top)
        return result

    @property
    def param_count(self):
        """Learnable values, shared blobs counted once; None when a shape is unknown."""
        sizes = [p.size for p in self.params]
        return None if None in sizes else sum(sizes)

    @property
    def known_param_count(self):
        return sum(p.size for p in self.params if p.size is not None)

    def fed_tops(self, layers=None):
        """{top: shape} a batch must hold: the tops of the fed layers (or of `layers`), in net order."""
        layers = [layer for layer in self.layers if layer.type in types("fed")] if layers is None else layers
        return {top: tuple(shape) for layer in layers for top, shape in zip(layer.tops, layer.top_shapes)}

    def check_backward(self):
        """A ConfigError if Caffe's backward pass would abort on this net: a diff that back-propagation needs
        through a bottom its layer takes none for (a label, an index, a sequence marker, a Threshold's input)."""
        for layer, (bottoms, _) in zip(self.layers, backward_needs(self)):
            refused = sorted(REGISTRY[layer.type].refused(len(layer.bottoms)) & set(bottoms))
            if refused:
                fix = ("drop force_backward" if self.net_param.force_backward
                       else "give the layer propagate_down: false for it")
                raise self._error(f"layer '{layer.name}' ({layer.type}) takes no gradient to its bottom "
                                  f"'{layer.bottoms[refused[0]]}', which back-propagation reaches here (Caffe "
                                  f"aborts there); {fix}", layer.index)

    def describe(self):
        """`describe` rows: name, type, top shapes, parameter shapes; then the totals line."""
        rows = [("name", "type", "tops", "parameters")]
        for layer in self.layers:
            tops = ", ".join(f"{t} {fmt(s)}" for t, s in zip(layer.tops, layer.top_shapes)) or "-"
            params = ", ".join(fmt(s) for s in layer.param_shapes) or "-"
            rows.append((layer.name, layer.type, tops, params))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
                 for row in rows]
        total = self.param_count
        if total is None:
            unknown = sum(size is None for size in (p.size for p in self.params))
            known = f"; the others hold {self.known_param_count}" if self.known_param_count else ""
            lines.append(f"total parameters: unknown ({unknown} parameter blob{'s' * (unknown != 1)} of unknown "
                         f"shape{known})")
        else:
            lines.append(f"total parameters: {total}")
        return "\n".join(line.rstrip() for line in lines)
