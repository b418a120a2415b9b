"""Caffe's binary proto files (.caffemodel, .solverstate, .binaryproto) in and out, written atomically."""

import os

import numpy as np

from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb


def atomic_write(path, data):
    """Write bytes to a temporary name beside `path`, then rename: never a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def read_message(path, message, what):
    """Parse a binary protobuf file into `message`; one-line errors name the file."""
    try:
        with open(path, "rb") as stream:
            data = stream.read()
    except OSError as error:
        raise ConfigError(f"cannot read {what}: {error.strerror}", path) from None
    try:
        message.ParseFromString(data)
    except Exception:
        raise ConfigError(f"not a {what} ({type(message).__name__}): cannot parse it", path) from None
    return message


def array_to_blob(array, blob=None, legacy_dims=False):
    """A float32 BlobProto of `array` with its shape; `legacy_dims` also sets a 4-axis blob's
    num/channels/height/width, as the mean files of Caffe's compute_image_mean carry them."""
    blob = blob if blob is not None else pb.BlobProto()
    array = np.asarray(array, dtype=np.float32)
    blob.shape.dim.extend(int(d) for d in array.shape)
    if legacy_dims and array.ndim == 4:
        blob.num, blob.channels, blob.height, blob.width = (int(d) for d in array.shape)
    blob.data.extend(array.ravel().tolist())
    return blob


def blob_to_array(blob):
    """A BlobProto as float32, with its shape (or the legacy num/channels/height/width)."""
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    elif blob.num or blob.channels or blob.height or blob.width:
        shape = (blob.num, blob.channels, blob.height, blob.width)
    else:
        shape = (len(blob.data) or len(blob.double_data),)
    values = blob.data if len(blob.data) else blob.double_data
    array = np.asarray(values, dtype=np.float32)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"blob holds {array.size} values for shape {'x'.join(map(str, shape))}")
    return array.reshape(shape)


def layer_blobs(graph, arrays):
    """Per layer name, its parameter arrays in Caffe's order (shared blobs repeated in each sharer)."""
    if len(arrays) != len(graph.params):
        raise ValueError(f"{len(arrays)} arrays for {len(graph.params)} parameters")
    checked = []
    for param, array in zip(graph.params, arrays):
        array = np.asarray(array, dtype=np.float32)
        if tuple(array.shape) != tuple(param.shape):
            raise ValueError(f"layer '{param.layer}' param {param.index}: shape {array.shape}, "
                             f"expected {param.shape}")
        checked.append(array)
    return {name: [checked[i] for i in positions] for name, positions in graph.blob_params.items()}


def net_to_proto(graph, arrays):
    """A NetParameter like Caffe's Net::ToProto: every layer's definition, learned blobs attached."""
    net = pb.NetParameter(name=graph.name)
    blobs = layer_blobs(graph, arrays)
    for layer in graph.layers:
        out = net.layer.add()
        out.CopyFrom(layer.param)
        del out.blobs[:]
        out.phase = graph.phase
        for array in blobs[layer.name]:
            array_to_blob(array, out.blobs.add())
    return net


def save_caffemodel(path, graph, arrays):
    """Write the weights of `graph` (arrays in graph.params order) as a Caffe .caffemodel."""
    atomic_write(path, net_to_proto(graph, arrays).SerializeToString())


def read_caffemodel(path):
    """{layer name: [float32 arrays]} from a .caffemodel written by Caffe or by us."""
    net = read_message(path, pb.NetParameter(), ".caffemodel")
    if not net.layer:
        raise ConfigError("this .caffemodel has no layers (V1 'layers' models need Caffe's upgrade tool)", path)
    try:
        return {layer.name: [blob_to_array(b) for b in layer.blobs] for layer in net.layer if layer.blobs}
    except ValueError as error:
        raise ConfigError(f"corrupt blob: {error}", path) from None


def weights_for(graph, layer_blobs, initial, path="<weights>"):
    """graph.params-ordered arrays: copied from `layer_blobs` by layer name (Caffe's
    CopyTrainedLayersFrom), `initial` for layers the file does not have."""
    out = []
    for param, init in zip(graph.params, initial):
        source = layer_blobs.get(param.layer)
        if source is None:
            out.append(init)
            continue
        if param.index >= len(source):
            raise ConfigError(f"layer '{param.layer}' has {len(source)} blobs in the weights, "
                              f"the net needs {len(graph.layer(param.layer).param_shapes)}", path)
        blob = source[param.index]
        if tuple(blob.shape) != tuple(param.shape):
            if blob.size != int(np.prod(param.shape)) or blob.ndim != 4:
                raise ConfigError(f"cannot copy param {param.index} of layer '{param.layer}': shape mismatch, "
                                  f"weights have {blob.shape}, the net needs {param.shape}", path)
            blob = blob.reshape(param.shape)  # legacy 4D blob, as Caffe accepts
        out.append(np.ascontiguousarray(blob, dtype=np.float32))
    return out


def snapshot_paths(prefix, iteration):
    base = f"{prefix}_iter_{iteration}"
    return base + ".caffemodel", base + ".solverstate"


def solver_state(iteration, current_step=0, history=(), learned_net=None):
    """Caffe's SolverState: the solver's counters, its history blobs and the snapshot it goes with.

    learned_net is left unset without a snapshot: Caffe's restore loads any learned_net that is set.
    """
    state = pb.SolverState(iter=int(iteration), current_step=int(current_step))
    if learned_net:
        state.learned_net = learned_net
    for array in history:
        array_to_blob(array, state.history.add())
    return state


def save_solverstate(path, state):
    atomic_write(path, state.SerializeToString())


def read_solverstate(path):
    return read_message(path, pb.SolverState(), ".solverstate")


def learned_net_path(state, solverstate_path):
    """The .caffemodel a solver state names, relative to the state's folder when not found as is."""
    learned = state.learned_net
    if learned and not os.path.exists(learned):
        beside = os.path.join(os.path.dirname(solverstate_path), os.path.basename(learned))
        if os.path.exists(beside):
            return beside
    return learned
