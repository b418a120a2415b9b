"""A graph.Graph and its solver as the messages pycaffe builds from, each layer through the layer table.

Caffe aborts the process on a net it rejects, so it only ever sees what our
Graph has already validated: the layers of one phase (include/exclude rules
resolved here), each as the layer table gives it to Caffe (fed data layers
as Input layers). Messages cross to pycaffe's own `caffe_pb2` as bytes (same
field numbers); a field Caffe does not know is an error, never dropped
silently.
"""

from google.protobuf import text_format

from deepspark import schedule
from deepspark.backends.caffe.layers import LAYERS
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

# SolverParameter fields this backend runs itself (testing, snapshots, display, the
# choice of net) or that belong to DeepSpark: cleared before Caffe sees the solver.
SOLVER_FIELDS_WE_RUN = (
    "net", "net_param", "train_net", "train_net_param", "test_net", "test_net_param", "train_state",
    "test_state", "test_iter", "test_interval", "test_compute_loss", "test_initialization", "display",
    "average_loss", "snapshot", "snapshot_prefix", "snapshot_diff", "snapshot_format", "snapshot_after_train",
    "solver_mode", "device_id", "debug_info", "solver_type", "deepspark_param", "iter_size", "clip_gradients",
)


def fed_tops(graph, net):
    """{top: shape} a batch feeds into `net` (net_param's of `graph`): the tops of its Input layers."""
    return graph.fed_tops([layer for layer, out in zip(graph.layers, net.layer) if out.type == "Input"])


def layer_positions(graph, caffe_names):
    """Where each layer of `graph` sits among the layers of Caffe's net (`caffe_names`, in order).

    Caffe inserts a Split layer after each blob several layers read, and a
    name may repeat, so a layer is found by its name in order, past the last.
    """
    positions, at = [], 0
    for layer in graph.layers:
        while at < len(caffe_names) and caffe_names[at] != layer.name:
            at += 1
        if at == len(caffe_names):
            raise RuntimeError(f"layer '{layer.name}' is not in Caffe's net ({', '.join(caffe_names)})")
        positions.append(at)
        at += 1
    return positions


def check_in_place(graph):
    """A ConfigError for a blob that an in-place layer rewrites while another layer also reads it.

    Caffe's split insertion renames the in-place layer's bottom but not its top,
    then aborts on 'Top blob produced by multiple sources'; the TensorFlow
    backend runs such nets, Caffe cannot.
    """
    readers = {}  # (blob, version) -> layer names
    version = {}
    for layer in graph.layers:
        for bottom in layer.bottoms:
            readers.setdefault((bottom, version.get(bottom, 0)), []).append(layer)
        for top in layer.tops:
            version[top] = version.get(top, 0) + 1
    for (blob, _), layers in readers.items():
        in_place = [layer for layer in layers if blob in layer.tops]
        if in_place and len(layers) > 1:
            layer = in_place[0]
            others = ", ".join(f"'{other.name}'" for other in layers if other is not layer)
            raise ConfigError(f"layer '{layer.name}' ({layer.type}) rewrites '{blob}' in place while {others} "
                              f"also read it; Caffe cannot run that (give '{layer.name}' its own top)",
                              *graph.source.where(layer.index))


def net_param(graph, keep_data=False):
    """The NetParameter Caffe runs for `graph`: one phase, no rules, fed layers as Input.

    keep_data: leave Data layers in, for Caffe to read their LMDB itself (the
    batch size is still the graph's).
    """
    check_in_place(graph)
    net = pb.NetParameter(name=graph.name)
    for field in ("force_backward", "debug_info"):
        if graph.net_param.HasField(field):
            setattr(net, field, getattr(graph.net_param, field))
    net.state.phase = graph.phase
    for layer in graph.layers:
        net.layer.add().CopyFrom(LAYERS[layer.type](layer, graph, keep_data))
    return net


def solver_param(param, iter_size=1):
    """The SolverParameter Caffe's solver runs: the update rule and lr policy only.

    Caffe does one forward/backward per step here; the backend runs the other
    iter_size - 1 passes on its own batches and scales the summed diff by
    1/iter_size itself, so the clipping threshold is scaled with it
    (clip(g/k, c/k) = clip(g, c)/k).
    """
    out = pb.SolverParameter()
    out.CopyFrom(param)
    for field in SOLVER_FIELDS_WE_RUN:
        out.ClearField(field)
    out.type = schedule.solver_type(param)
    out.lr_policy = param.lr_policy or "fixed"
    out.base_lr = param.base_lr * schedule.lr_scale(param.deepspark_param)  # lr_scaling's rule (no warm-up here)
    out.display = 0
    out.test_initialization = False
    out.snapshot_after_train = False
    out.solver_mode = pb.SolverParameter.CPU
    if param.clip_gradients >= 0:
        out.clip_gradients = param.clip_gradients / max(iter_size, 1)
    return out


def unknown_fields(message, path=""):
    """Dotted paths of fields a parsed message did not know (field numbers), depth first."""
    from google.protobuf import unknown_fields as unknown

    found = [f"{path or message.DESCRIPTOR.name}: field {field.field_number}"
             for field in unknown.UnknownFieldSet(message)]
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None:
            continue
        name = f"{path}.{descriptor.name}" if path else descriptor.name
        if descriptor.is_repeated:
            for i, item in enumerate(value):
                found += unknown_fields(item, f"{name}[{i}]")
        else:
            found += unknown_fields(value, name)
    return found


def to_caffe(message, caffe_class):
    """Our message as pycaffe's `caffe_class`, by bytes; a ConfigError names what Caffe lacks."""
    out = caffe_class.FromString(message.SerializeToString())
    missing = unknown_fields(out)
    if missing:
        raise ConfigError(f"Caffe does not support {', '.join(missing[:5])} "
                          f"({len(missing)} unknown field{'s' if len(missing) > 1 else ''})")
    return out


def from_caffe(message, our_class):
    """pycaffe's message as ours, by bytes."""
    return our_class.FromString(message.SerializeToString())


def to_text(message):
    return text_format.MessageToString(message)
