"""The backend contract: a Caffe net and solver as a model with Caffe's parameter layout.

Every backend's Model takes the same arguments and honours the same
layout: parameters are float32 arrays in Caffe's blob order and shapes
(graph.params: layer by layer, shared blobs once; OIHW convolution weights),
and the flat vector the exchanger moves is their concatenation in that
order. `step` is one Caffe solver iteration, `forward` one Caffe forward
pass, and the solver state is Caffe's SolverState.

The contract, each part declared here: `feeds` (the {top: shape} a batch
holds), step, forward, gradients, layer_passes, get/set_params,
get/set_flat, get/set_history, get/set_state and close; a backend
implements the abstract ones and may override the others where it has a
faster way.
"""

import abc
import numbers
from typing import Callable, NamedTuple

import numpy as np

from deepspark import checkpoint, schedule
from deepspark.config import random_seed
from deepspark.errors import ConfigError
from deepspark.graph import DATA_TYPES, Graph, ShapeError, count, fmt, legacy, with_batch_size, with_input_shapes
from deepspark.proto import deepspark_pb2 as pb


class LayerPass(NamedTuple):
    """One layer as `deepspark time` runs it: its name and its Forward and Backward, each a call of no argument."""

    name: str
    forward: Callable[[], object]
    backward: Callable[[], object]


class Model(abc.ABC):
    """A net (and its solver) compiled by one backend.

    net_param: the NetParameter; solver_param: the SolverParameter (None for a
    net that is only run forward); phase: pb.TRAIN or pb.TEST; source: the
    net's config.SourceMap, for errors; batch_size: overrides the data layers'
    batch size; seed: fillers and random layers (default: the solver's
    random_seed when set; a negative one, as in Caffe, leaves it unseeded);
    stages: NetState stages; data_shape: callable (LayerParameter -> (C, H, W))
    giving Data layers their image shape; threads: the framework's thread
    count in this process (None: its default).
    """

    def __init__(self, net_param, solver_param=None, phase=pb.TRAIN, source=None, batch_size=None,
                 seed=None, stages=None, data_shape=None, threads=None):
        # The batch size is every fed layer's: a Data layer's batch_size and an Input layer's first axis alike.
        self.net_param = with_batch_size(net_param, batch_size) if batch_size else net_param
        self.solver_param = pb.SolverParameter() if solver_param is None else solver_param
        self.threads = thread_count(threads)
        self._graph_options = dict(stages=stages, source=source, data_shape=data_shape, batch_size=batch_size)
        self.graph = Graph(self.net_param, phase, **self._graph_options)
        check_shapes(self.graph)
        if self.graph.phase == pb.TRAIN:
            self.graph.check_backward()  # before pycaffe could abort in its backward pass
        if seed is None:
            seed = random_seed(self.solver_param)
        self.seed = None if seed is None or seed < 0 else int(seed)  # None: unseeded
        self.phase = self.graph.phase
        self.train = self.phase == pb.TRAIN
        self.feeds = self.graph.fed_tops()  # {top: shape} a batch holds; a backend may narrow it
        self.solver_type = schedule.solver_type(self.solver_param)
        self.iter = 0
        self.current_step = 0
        self.param_shapes = [tuple(p.shape) for p in self.graph.params]
        self.param_sizes = [int(np.prod(s, dtype=np.int64)) for s in self.param_shapes]
        self.param_offsets = np.concatenate([[0], np.cumsum(self.param_sizes, dtype=np.int64)]).tolist()
        self.param_count = self.param_offsets[-1]
        self.iter_size = max(self.solver_param.iter_size, 1)
        self.history_sets = schedule.SOLVER_TYPES[self.solver_type]

    # -- parameters -----------------------------------------------------------

    @abc.abstractmethod
    def get_params(self):
        """float32 copies of the parameters, Caffe's order and shapes."""

    @abc.abstractmethod
    def set_params(self, arrays):
        """Load parameters given in Caffe's order and shapes."""

    def get_flat(self, out=None):
        """All parameters as one C-contiguous float32 vector, Caffe's order (into `out` when given)."""
        return self.join_flat(self.get_params(), out)

    def set_flat(self, vector):
        """Load parameters from one flat float32 vector, Caffe's order."""
        self.set_params(self.split_flat(vector))

    def join_flat(self, arrays, out=None):
        """Arrays in Caffe's order (each of its parameter's size) as one flat float32 vector."""
        if out is None:
            out = np.empty(self.param_count, np.float32)
        for array, start, end in zip(arrays, self.param_offsets, self.param_offsets[1:]):
            out[start:end] = array.reshape(-1)
        return out

    def check_flat(self, vector):
        """`vector` as a float32 array of param_count values, or a ValueError."""
        vector = np.asarray(vector, np.float32)
        if vector.shape != (self.param_count,):
            raise ValueError(f"flat parameter vector has shape {vector.shape}, expected ({self.param_count},)")
        return vector

    def split_flat(self, vector):
        """Views of a flat vector as the parameter arrays."""
        vector = self.check_flat(vector)
        return [vector[start:end].reshape(shape) for shape, start, end
                in zip(self.param_shapes, self.param_offsets, self.param_offsets[1:])]

    def check_arrays(self, arrays, shapes=None, what="parameter"):
        """float32 arrays in the expected shapes, or a ValueError naming the first mismatch."""
        shapes = self.param_shapes if shapes is None else shapes
        arrays = list(arrays)
        if len(arrays) != len(shapes):
            raise ValueError(f"expected {len(shapes)} {what} arrays, got {len(arrays)}")
        result = []
        for i, (array, shape) in enumerate(zip(arrays, shapes)):
            array = np.asarray(array, np.float32)
            if array.shape != tuple(shape):
                if array.size != int(np.prod(shape, dtype=np.int64)):
                    raise ValueError(f"{what} {i} has shape {fmt(array.shape)}, expected {fmt(shape)}")
                array = array.reshape(shape)  # Caffe's legacy 4-axis blobs of the same count
            result.append(array)
        return result

    def layer_blobs(self, layer_name):
        """Indices into the parameter list of a layer's blobs, in the layer's order (shared ones too).

        Of several layers called `layer_name`, the last with blobs, as pycaffe's net.params[name].
        """
        named = [layer for layer in self.graph.layers if layer.name == layer_name]
        if not named:
            raise KeyError(f"no layer '{layer_name}' in this net")
        return list(([layer for layer in named if layer.blob_params] or named)[-1].blob_params)

    def get_blobs(self, layer_name):
        """A layer's parameter blobs (Caffe's net.params[layer_name]) as float32 arrays."""
        params = self.get_params()
        return [params[i] for i in self.layer_blobs(layer_name)]

    def set_blobs(self, layer_name, arrays):
        params = self.get_params()
        indices = self.layer_blobs(layer_name)
        arrays = self.check_arrays(arrays, [self.param_shapes[i] for i in indices], f"'{layer_name}' blob")
        for i, array in zip(indices, arrays):
            params[i] = array
        self.set_params(params)

    # -- input shapes -----------------------------------------------------------

    def reshape(self, shapes):
        """Caffe's Net::Reshape after its input blobs were reshaped: the net for the inputs `shapes` ({top: shape},
        those not named keep theirs), every blob's shape by Caffe's rules (reshaped_net's errors)."""
        shapes = {top: tuple(int(d) for d in shape) for top, shape in shapes.items()}
        if any(self.feeds.get(top) != shape for top, shape in shapes.items()):
            self.net_param, self.graph = reshaped_net(self.net_param, shapes, self.phase, self.param_shapes,
                                                      self._graph_options)
            self._reshaped()

    def _reshaped(self):
        """Make what the backend runs follow self.graph's new shapes (`reshape` has just replaced it)."""
        self.feeds = self.graph.fed_tops()

    # -- running --------------------------------------------------------------

    @abc.abstractmethod
    def step(self, batch):
        """One solver iteration; `batch` is {data top: array}, or a list of iter_size of them.

        Returns the loss (sum of loss_weight * loss tops, averaged over iter_size).
        """

    def train_outputs(self):
        """{output blob: float32 array} of the last step's last forward pass (what Caffe's Solver displays as
        `Train net output #k`), or None before the first step."""
        return None

    @abc.abstractmethod
    def forward(self, batch):
        """{output blob: array} of one forward pass (the phase's semantics), Caffe's layout."""

    @abc.abstractmethod
    def gradients(self, batch):
        """(loss, Caffe's parameter diffs of one forward/backward), without touching the weights."""

    @abc.abstractmethod
    def layer_passes(self, batch):
        """`deepspark time`'s layers on `batch`: ([LayerPass] in forward order, loss), for engine.benchmark.

        A pass's forward runs that layer's Forward alone, on the bottoms the
        forwards before it left; its backward runs that layer's Backward alone:
        the diffs of its bottoms and parameters from the diffs its tops hold,
        without running its forward again, and only those Caffe's Net would
        compute (a bottom or parameter that needs backward, under a loss).
        Both take no argument and are ready to call; the first call may
        compile or allocate, so a caller times from the second pass on.
        loss(): the weighted loss of the last forwards, as Net::Forward returns it.
        """

    def close(self):
        """Release what the model holds beyond Python objects (scratch files, a framework's net)."""

    def feed(self, batch):
        """The batch as float32 arrays for the data tops (`self.feeds`: {top: shape}), checked against their shapes."""
        batch = batch or {}
        result = {}
        for top, shape in self.feeds.items():
            if top not in batch:
                raise KeyError(f"the batch has no '{top}'; this net reads {', '.join(self.feeds)}")
            array = np.asarray(batch[top], np.float32)
            if array.shape != shape:
                if array.size != int(np.prod(shape)):
                    raise ValueError(f"batch '{top}' has shape {fmt(array.shape)}, the net expects {fmt(shape)}")
                array = array.reshape(shape)
            result[top] = array
        return result

    def batches(self, batch):
        """`batch` as a list of iter_size dicts."""
        batches = [batch] if isinstance(batch, dict) else list(batch)
        if len(batches) != self.iter_size:
            raise ValueError(f"step needs {self.iter_size} batches (iter_size), got {len(batches)}")
        return batches

    def learning_rate(self):
        """The learning rate Caffe's solver would use at the current iteration."""
        return schedule.learning_rate(self.solver_param, self.iter, self.current_step)[0]

    def next_rate(self):
        """The rate for this iteration, advancing the multistep counter as Caffe does."""
        rate, self.current_step = schedule.learning_rate(self.solver_param, self.iter, self.current_step)
        return rate

    # -- solver state ---------------------------------------------------------

    @property
    def history_shapes(self):
        return self.param_shapes * self.history_sets

    @abc.abstractmethod
    def get_history(self):
        """The solver's history blobs, Caffe's SolverState order, as float32 arrays."""

    @abc.abstractmethod
    def set_history(self, arrays):
        """Load history blobs given in Caffe's SolverState order."""

    def get_history_flat(self):
        """The history blobs as one float32 vector (history_sets x param_count values, SolverState order):
        what a Spark worker ships to the exchanger for the job's snapshots."""
        return np.concatenate([np.ravel(h) for h in self.get_history()]).astype(np.float32, copy=False)

    def set_history_flat(self, vector):
        """Load history blobs from get_history_flat's vector."""
        n = self.param_count
        vector = np.asarray(vector, np.float32)
        if vector.shape != (self.history_sets * n,):
            raise ValueError(f"flat solver history has shape {vector.shape}, expected ({self.history_sets * n},)")
        self.set_history([array for k in range(self.history_sets) for array in self.split_flat(vector[k * n:(k + 1) * n])])

    def get_state(self):
        """Caffe's SolverState: iter, current_step and one history blob per history array.

        No learned_net: the weights are the caller's to save (Caffe's restore
        reads whatever file learned_net names, even an empty name).
        """
        return checkpoint.solver_state(self.iter, self.current_step, self.get_history())

    def set_state(self, state):
        """Resume from Caffe's SolverState: its counters, then its history (the weights are not in it)."""
        if len(state.history) != len(self.history_shapes):
            raise ValueError(f"solver state has {len(state.history)} history blobs; a {self.solver_type} "
                             f"solver for this net has {len(self.history_shapes)}")
        arrays = [np.asarray(blob.double_data if len(blob.double_data) else blob.data, np.float32)
                  for blob in state.history]
        arrays = self.check_arrays(arrays, self.history_shapes, "history blob")
        # The counters first, so that a backend whose solver keeps its own takes both in one restore.
        self.iter = int(state.iter)
        self.current_step = int(state.current_step)
        self.set_history(arrays)


def check_shapes(graph):
    """A ConfigError at the first layer of `graph` whose top shape is unknown (it comes from the data source)."""
    for layer in graph.layers:
        if any(shape is None for shape in layer.top_shapes):
            kind = "its data shape" if layer.type in DATA_TYPES else "a shape"
            # The first layer of unknown shape is a data layer; the data pipeline said why.
            reason = graph.context.unknown.get(layer.name) or (
                f"layer '{layer.name}' ({layer.type}): {kind} is unknown (it comes from the data source)")
            raise ConfigError(reason, *graph.source.where(layer.index))


def reshaped_net(net, shapes, phase, param_shapes, graph_options):
    """(NetParameter, Graph) of `net` with its inputs reshaped to `shapes` ({top: shape}); a ValueError where the
    shapes would change one of `param_shapes` (an InnerProduct's input size, say) or break a layer's rule, a
    KeyError for a top that is no input."""
    net = with_input_shapes(net, shapes)
    said = ", ".join(f"'{top}' {fmt(shape)}" for top, shape in shapes.items())
    try:
        graph = Graph(net, phase, **graph_options)
    except ConfigError as error:
        raise ValueError(f"inputs {said}: {error.message}") from None
    for param, shape in zip(graph.params, param_shapes):
        if tuple(param.shape) != shape:
            raise ValueError(f"inputs {said}: layer '{param.layer}' would need a {fmt(param.shape)} parameter, "
                             f"its blob is {fmt(shape)} (the net takes no other input size there)")
    return net, graph


def thread_count(threads):
    """`threads` as a positive int, or None (the framework's default); a ValueError otherwise."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads <= 0:
        raise ValueError(f"threads must be a positive integer or None, not {threads!r}")
    return int(threads)


def infogain_matrix(layer, source):
    """The dim x dim matrix an InfogainLoss layer (a graph.Layer) reads from infogain_loss_param.source, as Caffe
    reads it (relative to the current directory; a 1 x 1 x dim x dim BlobProto); a ConfigError at the layer
    (`source`: the net's SourceMap) where Caffe would abort."""
    path = layer.param.infogain_loss_param.source
    dim = count(layer.bottom_shapes[0], 1)
    try:
        matrix = checkpoint.blob_to_array(checkpoint.read_message(path, pb.BlobProto(), "matrix file"))
        if tuple(legacy(matrix.shape, axis) for axis in range(4)) != (1, 1, dim, dim):
            raise ShapeError(f"it is {fmt(matrix.shape)}, the input needs 1x1x{dim}x{dim}")
    except (ConfigError, ShapeError, ValueError) as error:
        raise ConfigError(f"layer '{layer.name}' (InfogainLoss): infogain matrix '{path}': "
                          f"{getattr(error, 'message', error)}", *source.where(layer.index)) from None
    return matrix.reshape(dim, dim)
