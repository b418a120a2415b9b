"""The layer registry: one row per layer type (shapes, blobs, fillers, flags); the helpers its shape rules share."""

import math
from dataclasses import dataclass

from deepspark.proto import deepspark_pb2 as pb


class ShapeError(ValueError):
    """A shape that cannot exist; the graph names the layer."""


# One row per layer type, as Caffe keeps one class per type; the rows are registered by the family modules
# beside this one (neuron, vision, common, loss, recurrent, data). Backends keep their own table of what each
# type computes (backends/*/layers), each checked against this one when it is imported (check_table).


AUTOMATIC = "(automatic)"  # Caffe's name for a top the prototxt does not name (Net::AppendTop)


def _no_blobs(lp):
    return []


@dataclass(frozen=True)
class LayerSpec:
    """One layer type: its shapes, its parameter blobs and their fillers, and what kind of layer it is.

    shapes(lp, bottom shapes, BuildContext) -> (top shapes, parameter blob shapes
    in Caffe's order). fillers(lp) -> the FillerParameter of each parameter blob
    the layer has, with Caffe's default where the prototxt gives none; how many
    there are is the blob count when the input shape is unknown.
    loss: its first top is a loss (default loss_weight 1); data: a data layer,
    with no bottoms; fed: its tops come from a batch (DummyData makes its own);
    labelled: its second bottom is a label; learned: False where the blobs are
    statistics that Caffe keeps out of the solver (BatchNorm).
    bottoms: how many bottoms it needs at least (a data layer none).
    tops: how many tops it needs at least (Caffe's MinTopBlobs/ExactNumTopBlobs); a loss layer given none
    gets Caffe's automatic one.
    no_backward: the bottoms (by position; negative from the last) Caffe's
    Backward refuses a diff for, with a glog abort: labels, indices, sequence
    markers, a Threshold's input. TensorFlow gives them none either.
    unforced: the bottoms force_backward leaves alone (Caffe's AllowForceBackward).
    """

    type: str
    shapes: object
    fillers: object = _no_blobs
    loss: bool = False
    data: bool = False
    fed: bool = False
    labelled: bool = False
    learned: bool = True
    bottoms: int = 1
    tops: int = 1
    no_backward: tuple = ()
    unforced: tuple = ()

    def blob_count(self, lp):
        """How many parameter blobs a layer of this type has, known before its shapes are."""
        return len(self.fillers(lp))

    @property
    def min_bottoms(self):
        return 0 if self.data else self.bottoms

    def refused(self, bottoms):
        """The positions among `bottoms` (a count) that take no diff in Caffe's Backward."""
        return _positions(self.no_backward, bottoms)

    def forced(self, bottoms):
        """The positions among `bottoms` (a count) that force_backward gives a diff."""
        return [b for b in range(bottoms) if b not in _positions(self.unforced, bottoms)]


def _positions(indices, count):
    """Positions `indices` (negative: from the last) among `count` bottoms, those that exist."""
    return {i % count for i in indices if -count <= i < count}


REGISTRY = {}  # layer type -> LayerSpec


def layer_type(*types, **row):
    """Register a shape function as the row of each of `types`, with the rest of the row in `row`."""
    def register(function):
        for kind in types:
            REGISTRY[kind] = LayerSpec(kind, function, **row)
        return function
    return register


def spec(kind):
    """The registry row of layer type `kind`."""
    return REGISTRY[kind]


def supported_types():
    return sorted(REGISTRY)


def check_table(table, backend):
    """Raise a RuntimeError naming the types if a backend's layer table and the registry differ.

    Each backend's layers.py calls it as it is imported, so that a type added
    to one place and not the other fails at once, not when a net first uses it.
    """
    missing, extra = sorted(set(REGISTRY) - set(table)), sorted(set(table) - set(REGISTRY))
    problems = []
    if missing:
        problems.append(f"registered in deepspark/graph but missing from the {backend} table: {', '.join(missing)}")
    if extra:
        problems.append(f"in the {backend} table but not registered in deepspark/graph: {', '.join(extra)}")
    if problems:
        raise RuntimeError(f"the {backend} layer table and graph.REGISTRY differ: {'; '.join(problems)}")


def constant_filler(value):
    return pb.FillerParameter(type="constant", value=value)


def given_filler(param, name, default):
    """param's filler `name`, or Caffe's default for it when the prototxt gives none."""
    return getattr(param, name) if param.HasField(name) else default


def weight_and_bias(param):
    return [param.weight_filler] + [param.bias_filler] * param.bias_term


def canonical_axis(axis, num_axes, what="axis"):
    if not -num_axes <= axis < num_axes:
        raise ShapeError(f"{what} {axis} is out of range for a {num_axes}-axis blob")
    return axis % num_axes


def count(shape, start=0, end=None):
    return math.prod(shape[start:end])


def fmt(shape):
    if shape is None:
        return "?"
    return "x".join(str(d) for d in shape) if shape else "scalar"


def same(lp, bottoms, ctx):
    return [bottoms[0]] * max(len(lp.top), 1), []


def exactly(lp, bottoms, count, tops=None):
    """A ShapeError unless the layer has `count` bottoms (and `tops` tops), as Caffe's CHECKs demand."""
    if len(bottoms) != count:
        raise ShapeError(f"{lp.type} takes {count} bottoms, got {len(bottoms)}")
    if tops is not None and len(lp.top) != tops:
        raise ShapeError(f"{lp.type} makes {tops} top{'s' * (tops != 1)}, got {len(lp.top)}")


def legacy(shape, axis):
    """Caffe's LegacyShape: axis `axis` of a blob of at most 4 axes, 1 past its last (num, channels, height, width)."""
    if len(shape) > 4:
        raise ShapeError(f"a {len(shape)}-axis blob {fmt(shape)} where Caffe reads num/channels/height/width")
    return shape[axis] if axis < len(shape) else 1


def one_per_item(shape, labels, what):
    """A ShapeError unless `labels` holds one value per item of `shape` (N x 1 x 1 x 1)."""
    if any(legacy(labels, axis) != 1 for axis in (1, 2, 3)) or labels[:1] != shape[:1]:
        raise ShapeError(f"{what} needs one per item: input {fmt(shape)}, {what} {fmt(labels)}")


def types(flag):
    """The layer types whose registry row sets `flag` (loss, data, fed, labelled), as registered so far."""
    return frozenset(kind for kind, row in REGISTRY.items() if getattr(row, flag))
