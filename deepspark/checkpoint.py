"""Caffe's binary proto files (.caffemodel, .solverstate, .binaryproto) in and out, written atomically."""

import contextlib
import contextvars
import os
import queue
import threading

import numpy as np

from deepspark import upgrade
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb


# The writer of the writes_behind() block this thread's context is in, or None: atomic_write writes at once.
_BEHIND = contextvars.ContextVar("deepspark_checkpoint_writes_behind", default=None)
# Writes a writes_behind() block may have waiting at once: a solver that snapshots faster than the disk takes them
# waits at the third instead of holding more snapshots in memory.
BEHIND_DEPTH = 2


class _Writer:
    """One thread that runs atomic_write's writes in the order they came; the first that fails is raised to the
    block's next write or its end, and no write after it runs (each is whole or absent, never half-written)."""

    def __init__(self):
        self.pending, self.error = queue.Queue(maxsize=BEHIND_DEPTH), None
        self.thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-writer")
        self.thread.start()

    def _run(self):
        while (item := self.pending.get()) is not None:
            if self.error is None:
                try:
                    _write_now(*item)
                except BaseException as error:  # noqa: BLE001  (raised again on the block's own thread)
                    self.error = error

    def raise_error(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def put(self, path, data):
        self.raise_error()
        self.pending.put((path, data))

    def close(self, raising):
        self.pending.put(None)
        self.thread.join()
        if raising:
            self.raise_error()


@contextlib.contextmanager
def writes_behind():
    """Inside the block, atomic_write hands each file to a thread of its own and returns: a solver's snapshots are
    written, fsync'd and renamed off its training loop (0.06-0.24 s a file here on a busy disk, #44). The block's end
    waits for every write, so after it the files are there as atomic_write leaves them; a write that failed is raised
    at the block's next write or at its end. A process killed inside the block may lack its last snapshots, never
    hold half of one."""
    writer = _Writer()
    token = _BEHIND.set(writer)
    try:
        yield
    except BaseException:
        _BEHIND.reset(token)
        writer.close(raising=False)  # the block's own error is the one to see
        raise
    _BEHIND.reset(token)
    writer.close(raising=True)


def atomic_write(path, data):
    """Write bytes to a temporary name beside `path`, then rename: never a half-written file (inside writes_behind(),
    on its thread, after the writes before it)."""
    writer = _BEHIND.get()
    if writer is not None:
        writer.put(path, bytes(data))
        return
    _write_now(path, data)


def _write_now(path, data):
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


def read_bytes(path, what):
    """A file's bytes; the one-line error names `what` and the file."""
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except OSError as error:
        raise ConfigError(f"cannot read {what}: {error.strerror}", path) from None


def read_message(path, message, what):
    """Parse a binary protobuf file into `message`; one-line errors name the file."""
    data = read_bytes(path, what)
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
    if array.size:
        # The packed field's bytes (tag 5, wire type 2: Caffe's `repeated float data = 5 [packed = true]`) merged in
        # whole: the same message as data.extend, 50x faster than a Python float per value (a LeNet snapshot's
        # 431,080 took 50-100 ms on the training loop here, #44).
        raw = array.astype("<f4", copy=False).tobytes()
        blob.MergeFromString(_DATA_TAG + _varint(len(raw)) + raw)
    return blob


_DATA_TAG = bytes([5 << 3 | 2])


def _varint(value):
    """`value` as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


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
    """(layer name, its parameter arrays in Caffe's order) per layer, in net order, blobless layers
    too (Caffe's net.layers; shared blobs repeated in each sharer; a name may repeat)."""
    if len(arrays) != len(graph.params):
        raise ValueError(f"{len(arrays)} arrays for {len(graph.params)} parameters")
    checked = []
    for param, array in zip(graph.params, arrays):
        array = np.asarray(array, dtype=np.float32)
        if tuple(array.shape) != tuple(param.shape):
            raise ValueError(f"layer '{param.layer}' param {param.index}: shape {array.shape}, "
                             f"expected {param.shape}")
        checked.append(array)
    return [(layer.name, [checked[i] for i in layer.blob_params]) for layer in graph.layers]


def net_to_proto(graph, arrays):
    """A NetParameter like Caffe's Net::ToProto: every layer's definition under its own name, in
    order, learned blobs attached."""
    net = pb.NetParameter(name=graph.name)
    for layer, (_, blobs) in zip(graph.layers, layer_blobs(graph, arrays)):
        out = net.layer.add()
        out.CopyFrom(layer.param)
        del out.blobs[:]
        out.phase = graph.phase
        for array in blobs:
            array_to_blob(array, out.blobs.add())
    return net


def save_caffemodel(path, graph, arrays):
    """Write the weights of `graph` (arrays in graph.params order) as a Caffe .caffemodel (.caffemodel.h5:
    HDF5, Caffe's Net::ToHDF5 layout)."""
    if is_hdf5(path):
        return _save_hdf5_weights(path, graph, arrays)
    atomic_write(path, net_to_proto(graph, arrays).SerializeToString())


# -- HDF5: snapshot_format: HDF5 (Caffe's Net::ToHDF5, SGDSolver::SnapshotSolverStateToHDF5), HDF5Output ------


def _h5py():
    import h5py  # deferred: HDF5 snapshots and outputs only; it loads libhdf5
    return h5py


def is_hdf5(path):
    return str(path).endswith(".h5")


def _write_hdf5(path, fill):
    """Write an HDF5 file through fill(h5py.File) at a temporary name beside `path`, then rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with _h5py().File(tmp, "w") as h5:
            fill(h5)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def _save_hdf5_weights(path, graph, arrays):
    """Net::ToHDF5: a group /data/<layer> per layer in net order, dataset <i> per blob the layer owns
    (a shared blob under its owner only), float32 in the blob's shape."""
    owned = {(param.owner, param.index) for param in graph.params}

    def fill(h5):
        data = h5.create_group("data")
        for position, (layer, (name, blobs)) in enumerate(zip(graph.layers, layer_blobs(graph, arrays))):
            if name in data:
                raise ConfigError(f"layer name '{name}' repeats: an HDF5 snapshot holds one group per layer "
                                  "name (Caffe's cannot either); use snapshot_format: BINARYPROTO", path)
            group = data.create_group(name)
            for i, array in enumerate(blobs):
                if (position, i) in owned:
                    group.create_dataset(str(i), data=array)
    _write_hdf5(path, fill)


def _read_hdf5_weights(path):
    """[(layer name, [float32 arrays])] of a .caffemodel.h5 (CopyTrainedLayersFromHDF5's reading)."""
    try:
        with _h5py().File(path, "r") as h5:
            data = h5["data"]
            return [(name, [np.asarray(data[name][str(i)], np.float32) for i in range(len(data[name]))])
                    for name in data]
    except (OSError, KeyError) as error:
        raise ConfigError(f"not a Caffe HDF5 model (a /data group of layers): {error}", path) from None


def _save_hdf5_state(path, state):
    """SnapshotSolverStateToHDF5: iter, learned_net, current_step, /history/<i>; a Spark job's
    workers' states (DeepSpark's own) as their serialized WorkerSolverStates."""
    def fill(h5):
        h5.create_dataset("iter", data=np.int32(state.iter))
        h5.create_dataset("learned_net", data=np.bytes_(state.learned_net.encode()))
        h5.create_dataset("current_step", data=np.int32(state.current_step))
        history = h5.create_group("history")
        for i, blob in enumerate(state.history):
            history.create_dataset(str(i), data=blob_to_array(blob))
        if len(state.worker_state):
            workers = h5.create_group("deepspark_worker_state")
            for saved in state.worker_state:
                workers.create_dataset(str(saved.worker), data=np.void(saved.SerializeToString()))
    _write_hdf5(path, fill)


def _read_hdf5_state(path):
    """A SolverState from a .solverstate.h5 (RestoreSolverStateFromHDF5's reading)."""
    try:
        with _h5py().File(path, "r") as h5:
            state = pb.SolverState(iter=int(h5["iter"][()]), current_step=int(h5["current_step"][()]))
            learned = h5["learned_net"][()]
            state.learned_net = learned.decode() if isinstance(learned, bytes) else str(learned)
            for i in range(len(h5["history"])):
                array_to_blob(np.asarray(h5["history"][str(i)]), state.history.add())
            for worker in h5.get("deepspark_worker_state", {}):
                state.worker_state.add().ParseFromString(h5["deepspark_worker_state"][worker][()].tobytes())
    except (OSError, KeyError) as error:
        raise ConfigError(f"not a Caffe HDF5 solver state (iter, current_step, history): {error}", path) from None
    return state


def write_hdf5_output(path, data, label):
    """Caffe's HDF5OutputLayer::SaveBlobs: datasets 'data' and 'label' in their legacy 4-axis shapes
    (num, channels, height, width), float32, replacing the file."""
    def legacy(array):
        array = np.asarray(array, np.float32)
        if array.ndim > 4:
            raise ValueError(f"HDF5Output writes blobs of up to 4 axes, not {array.shape}")
        return array.reshape(array.shape + (1,) * (4 - array.ndim))

    def fill(h5):
        h5.create_dataset("data", data=legacy(data))
        h5.create_dataset("label", data=legacy(label))
    _write_hdf5(path, fill)


def read_caffemodel(path):
    """[(layer name, [float32 arrays])] of every layer in a .caffemodel written by Caffe or by us, in
    the file's order (blobless layers too: Caffe checks their count; a name may repeat)."""
    if is_hdf5(path):
        if not os.path.exists(path):
            raise ConfigError(".caffemodel.h5 file not found", path)
        return _read_hdf5_weights(path)
    return caffemodel_layers(read_message(path, pb.NetParameter(), ".caffemodel"), path)


def parse_caffemodel(data, path="<weights>"):
    """read_caffemodel of a .caffemodel's bytes (shipped to an executor, read from a URI); `path` names it."""
    net = pb.NetParameter()
    try:
        net.ParseFromString(data)
    except Exception:
        raise ConfigError("not a .caffemodel (NetParameter): cannot parse it", path) from None
    return caffemodel_layers(net, path)


def caffemodel_layers(net, path):
    """read_caffemodel of a parsed NetParameter; an old (V0/V1) model upgraded as Caffe reads one."""
    if upgrade.needs_upgrade(net):
        net = upgrade.upgrade_net(net, lambda i=None: (path, None, None), lambda: (path, None, None))[0]
    if not net.layer:
        raise ConfigError("this .caffemodel has no layers", path)
    try:
        return [(layer.name, [blob_to_array(b) for b in layer.blobs]) for layer in net.layer]
    except ValueError as error:
        raise ConfigError(f"corrupt blob: {error}", path) from None


def weights_for(graph, source, initial, path="<weights>"):
    """graph.params-ordered arrays: `initial` with the weights of `source` copied in by Caffe's
    Net::CopyTrainedLayersFrom.

    `source` is (layer name, arrays) per layer of the weights, in their order
    (read_caffemodel's; a dict when names are unique). Each goes into the
    first layer of the net with its name, later ones overwriting earlier ones,
    a blob shared by name taking what its last copy brings; a name the net
    lacks is ignored; another count of blobs, or another shape (but for a
    legacy 4-axis blob of the same count), is an error.
    """
    out = list(initial)
    first, named = {}, {}
    for layer in graph.layers:
        first.setdefault(layer.name, layer)
        named[layer.name] = named.get(layer.name, 0) + 1
    for name, blobs in (source.items() if hasattr(source, "items") else source):
        target = first.get(name)
        if target is None:
            continue
        # A name the net repeats: say which layer Caffe's rule picked.
        which = f" (its first layer '{name}', the {target.type}, takes them)" if named[name] > 1 else ""
        if len(blobs) != len(target.blob_params):
            raise ConfigError(f"layer '{name}' has {len(blobs)} blobs in the weights, "
                              f"the net needs {len(target.blob_params)}{which}", path)
        for j, (blob, shape, i) in enumerate(zip(blobs, target.param_shapes, target.blob_params)):
            if tuple(blob.shape) != tuple(shape):
                if blob.size != int(np.prod(shape)) or blob.ndim != 4:
                    raise ConfigError(f"cannot copy param {j} of layer '{name}': shape mismatch, "
                                      f"weights have {blob.shape}, the net needs {shape}{which}", path)
            out[i] = np.ascontiguousarray(blob.reshape(graph.params[i].shape), dtype=np.float32)
    return out


def weights_that_fit(graph, data, path="<weights>"):
    """The .caffemodel bytes `data` checked against `graph` by weights_for, without the net's own arrays:
    graph.params-ordered arrays, None where the weights have nothing for a parameter."""
    return weights_for(graph, parse_caffemodel(data, path), [None] * len(graph.params), path)


def snapshot_paths(prefix, iteration, hdf5=False):
    """Caffe's snapshot names: <prefix>_iter_N.caffemodel and .solverstate (with hdf5, each + '.h5')."""
    base = f"{prefix}_iter_{iteration}"
    suffix = ".h5" if hdf5 else ""
    return base + ".caffemodel" + suffix, base + ".solverstate" + suffix


def snapshot_words(path):
    """How Caffe's log names a snapshot's format: 'HDF5 file' or 'binary proto file'."""
    return "HDF5 file" if is_hdf5(path) else "binary proto file"


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


def worker_state(worker, iteration, current_step, history, shapes):
    """A WorkerSolverState of one Spark worker: its solver history (one flat float32 vector, history sets
    x the parameters in `shapes`' order, as the exchanger moves it) as Caffe's history blobs."""
    state = pb.WorkerSolverState(worker=int(worker), iter=int(iteration), current_step=int(current_step))
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    offsets = np.cumsum([0] + sizes * (history.size // max(sum(sizes), 1))).tolist()
    for shape, start, end in zip(shapes * len(offsets), offsets, offsets[1:]):
        array_to_blob(history[start:end].reshape(shape), state.history.add())
    return state


def worker_histories(state, shapes, sets, path="<solverstate>"):
    """{worker: (iteration, current_step, flat float32 history)} of a snapshot's WorkerSolverStates, each
    checked against the net's parameter `shapes` and the solver's `sets` of history blobs; a one-line
    error for one that does not fit (another net or solver type)."""
    histories = {}
    for saved in state.worker_state:
        if len(saved.history) != sets * len(shapes):
            raise ConfigError(f"worker {saved.worker}'s solver state has {len(saved.history)} history blobs; "
                              f"this net and solver have {sets * len(shapes)}", path)
        arrays = []
        for i, blob in enumerate(saved.history):
            array = blob_to_array(blob)
            if array.size != int(np.prod(shapes[i % len(shapes)], dtype=np.int64)):
                raise ConfigError(f"worker {saved.worker}'s history blob {i} has shape {array.shape}; this net "
                                  f"needs {tuple(shapes[i % len(shapes)])}", path)
            arrays.append(array.ravel())
        histories[saved.worker] = (saved.iter, saved.current_step,
                                   np.concatenate(arrays) if arrays else np.zeros(0, np.float32))
    return histories


def save_solverstate(path, state):
    if is_hdf5(path):
        return _save_hdf5_state(path, state)
    atomic_write(path, state.SerializeToString())


def read_solverstate(path):
    if is_hdf5(path):
        if not os.path.exists(path):
            raise ConfigError(".solverstate.h5 file not found", path)
        return _read_hdf5_state(path)
    return read_message(path, pb.SolverState(), ".solverstate")


def learned_net_path(state, solverstate_path):
    """The .caffemodel a solver state names, relative to the state's folder when not found as is."""
    learned = state.learned_net
    if learned and not os.path.exists(learned):
        beside = os.path.join(os.path.dirname(solverstate_path), os.path.basename(learned))
        if os.path.exists(beside):
            return beside
    return learned
