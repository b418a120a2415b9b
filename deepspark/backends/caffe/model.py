"""The Caffe backend's Model: a real pycaffe Net (and Caffe solver) behind base.Model's contract."""

import contextlib
import functools
import os
import shutil
import tempfile

import numpy as np

from deepspark import checkpoint, fillers
from deepspark.backends import base
from deepspark.backends.caffe import compiler, layers, python_layer, runtime
from deepspark.graph import fmt
from deepspark.proto import deepspark_pb2 as pb

DATA_LAYERS = ("input", "caffe")


class Model(base.Model):
    """base.Model on pycaffe: Caffe's own layers, and Caffe's own solver for the update.

    A TRAIN model owns a Caffe solver (its net is solver.net); a TEST model a
    caffe.Net. `step` copies the batch into the Input blobs and calls
    `solver.step(1)`; with iter_size > 1 the first iter_size - 1 passes run
    from the solver's on_start callback (each on its own batch), and the summed
    diff is normalized in on_gradients_ready, before Caffe clips and updates.
    The history lives in Caffe's solver; get/set_history go through Caffe's
    own SolverState snapshot and restore.

    data_layers: "input" (default) feeds Data layers from the shared pipeline
    through Input layers; "caffe" keeps them, and Caffe's Data layer reads the
    LMDB itself (then `step`/`forward` take a batch only for the other fed tops).
    """

    def __init__(self, net_param, solver_param=None, phase=pb.TRAIN, source=None, batch_size=None,
                 seed=None, stages=None, data_shape=None, threads=None, data_layers="input"):
        self._solver = self._net = None
        runtime.caffe()  # before the graph: a Python layer's module may use pycaffe's parts (pylayer.stand_in)
        super().__init__(net_param, solver_param, phase, source=source, batch_size=batch_size, seed=seed,
                         stages=stages, data_shape=data_shape, threads=threads)
        if data_layers not in DATA_LAYERS:
            raise ValueError(f"data_layers must be one of {', '.join(DATA_LAYERS)}, not {data_layers!r}")
        caffe = runtime.caffe(self.threads)
        self._caffe = caffe
        self.data_layers = data_layers
        ours = compiler.net_param(self.graph, keep_data=data_layers == "caffe")
        missing = layers.lacking(self.graph, ours, set(caffe.layer_type_list()))
        if missing:
            raise missing
        self.feeds = compiler.fed_tops(self.graph, ours)  # a Data layer Caffe reads itself is not fed
        # The scratch folder is there only while Caffe reads a file from it (_in_scratch): a process that ends
        # without a collection (a Spark Python worker leaves by os._exit, a chaos test's by SIGKILL) would
        # otherwise leave one in the temp dir per net.
        self._dir = tempfile.mkdtemp(prefix="deepspark-caffe-")
        with self._in_scratch():
            if self.seed is not None:
                caffe.set_random_seed(self.seed)
            net = compiler.to_caffe(ours, caffe.proto.caffe_pb2.NetParameter)
            python_layer.prepare(self.graph)
            if self.train:
                solver = compiler.to_caffe(compiler.solver_param(self.solver_param, self.iter_size),
                                           caffe.proto.caffe_pb2.SolverParameter)
                solver.net_param.CopyFrom(net)
                solver.snapshot_prefix = os.path.join(self._dir, "state")
                self._solver = caffe.get_solver(self._write("solver.prototxt", compiler.to_text(solver)))
                self._net = self._solver.net
                self._solver.add_callback(self._on_start, self._on_gradients_ready)
            else:
                self._net = caffe.Net(self._write("net.prototxt", compiler.to_text(net)), caffe.TEST)
        self._steps = timesteps(self.graph)  # as Caffe's Recurrent layers are set up
        self._blobs = param_blobs(self.graph, self._net)
        self._views = [blob.data for blob in self._blobs]  # parameters never reshape
        self._loss_tops = self._loss_blobs()
        self._outputs = output_blobs(self.graph, self._net)
        self._pass_losses = []
        self._pending = []  # the batches of the passes before Caffe's own, for on_start
        self._caffe_iter, self._caffe_current_step = 0, 0
        self.set_params(fillers.init_params(self.graph, self.seed))

    def reshape(self, shapes):
        """base.Model.reshape; the net as it was where Caffe's layers refuse the shapes (before pycaffe aborts)."""
        before = self.net_param, self.graph, self.feeds
        try:
            super().reshape(shapes)
        except ValueError:
            self.net_param, self.graph, self.feeds = before
            raise

    def _reshaped(self):
        """pycaffe's Net::Reshape after the fed blobs' (the graph and check_timesteps checked them: Caffe aborts on
        a shape it refuses)."""
        check_timesteps(self.graph, self._steps)
        self.feeds = compiler.fed_tops(self.graph, compiler.net_param(self.graph, self.data_layers == "caffe"))
        for top, shape in self.feeds.items():
            self._net.blobs[top].reshape(*shape)
        self._net.reshape()
        self._outputs = output_blobs(self.graph, self._net)

    # -- construction --------------------------------------------------------------

    def _write(self, name, content):
        """A file in this model's scratch folder (text or bytes); its path."""
        path = os.path.join(self._dir, name)
        with open(path, "wb") as stream:
            stream.write(content.encode() if isinstance(content, str) else content)
        return path

    def _loss_blobs(self):
        """(Caffe's blob, loss weight) of each loss top, by position: every automatic top is "(automatic)"."""
        net, blobs = self._net, self._net._blobs
        positions = compiler.layer_positions(self.graph, list(net._layer_names))
        return [(blobs[blob], weight) for layer, at in zip(self.graph.layers, positions)
                for blob, weight in zip(net._top_ids(at), layer.loss_weights) if weight]

    def close(self):
        """Drop the Caffe net and solver."""
        self._solver = self._net = None
        self._blobs, self._views = [], []

    @contextlib.contextmanager
    def _in_scratch(self):
        """The scratch folder, there for the `with` block alone: Caffe's solver writes its snapshots under the
        snapshot_prefix it read from the solver's file, in that folder."""
        os.makedirs(self._dir, exist_ok=True)
        try:
            yield
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- iteration counters: Caffe's solver keeps its own, synced before a step ------

    def _sync_solver(self):
        """Give Caffe's solver our iter and current_step if someone changed them (a resumed worker)."""
        if (self._caffe_iter, self._caffe_current_step) != (self.iter, self.current_step):
            self._restore(self.get_state())

    # -- feeding ------------------------------------------------------------------

    def _load(self, batch):
        blobs = self._net.blobs
        for top, array in self.feed(batch).items():
            blobs[top].data[...] = array

    def _loss(self):
        return float(sum(weight * float(np.sum(blob.data, dtype=np.float64)) for blob, weight in self._loss_tops))

    # -- running ------------------------------------------------------------------

    def _on_start(self):
        """Caffe's step has cleared the diffs: run the extra iter_size passes, then load the last batch."""
        if not self._pending:
            return
        *earlier, last = self._pending
        for batch in earlier:
            self._load(batch)
            self._net.forward()
            self._pass_losses.append(self._loss())
            self._net.backward()
        self._load(last)

    def _on_gradients_ready(self):
        if self.iter_size > 1:
            scale = np.float32(1.0 / self.iter_size)
            for blob in self._blobs:
                blob.diff[...] *= scale

    def step(self, batch):
        if self._solver is None:
            raise RuntimeError("this model was built for the TEST phase; it has no solver to step")
        batches = self.batches({} if batch is None and self.data_layers == "caffe" else batch)
        self._sync_solver()
        self.next_rate()  # advance our mirror of Caffe's current_step
        self._pass_losses = []
        if self.iter_size == 1:
            self._load(batches[0])
        else:
            self._pending = batches
        try:
            self._solver.step(1)
        finally:
            self._pending = []
        self._pass_losses.append(self._loss())
        self.iter = self._caffe_iter = int(self._solver.iter)
        self._caffe_current_step = self.current_step
        return float(np.mean(self._pass_losses))

    def train_outputs(self):
        if self._solver is None or not self.iter:
            return None
        blobs = self._net.blobs  # as the last forward of the last step left them
        return {name: np.array(blobs[name].data, np.float32) for name in self.graph.outputs}

    def forward(self, batch):
        self._load(batch)
        self._net.forward()
        return {name: np.array(blob.data, np.float32) for name, blob in self._outputs}

    def gradients(self, batch):
        self.graph.check_backward()  # a TEST net too: pycaffe's backward would abort
        self._load(batch)
        self._net.clear_param_diffs()
        self._net.forward()
        loss = self._loss()
        self._net.backward()
        return loss, [np.array(blob.diff, np.float32).reshape(shape)
                      for blob, shape in zip(self._blobs, self.param_shapes)]

    def layer_passes(self, batch):
        """Caffe's own layers one by one: pycaffe's net._forward(i, i) and net._backward(i, i).

        The batch is copied into the Input blobs once; Caffe's inserted Split
        layers are listed too (they do Caffe's copying and summing of diffs). A
        layer Caffe's Net needs no backward for (a deploy net, an Accuracy
        layer) is skipped by Net::BackwardFromTo, as in net.backward().
        """
        self.graph.check_backward()  # a TEST net too: pycaffe's backward would abort
        self._load(batch)
        net = self._net
        return [base.LayerPass(name, functools.partial(net._forward, i, i), functools.partial(net._backward, i, i))
                for i, name in enumerate(net._layer_names)], self._loss

    # -- parameters ---------------------------------------------------------------

    def get_params(self):
        return [np.array(view, np.float32).reshape(shape) for view, shape in zip(self._views, self.param_shapes)]

    def set_params(self, arrays):
        for view, array in zip(self._views, self.check_arrays(arrays)):
            view[...] = array.reshape(view.shape)

    def get_flat(self, out=None):
        return self.join_flat(self._views, out)  # straight from Caffe's blobs, without get_params' copies

    # -- solver state: Caffe's own SolverState files ------------------------------

    def _snapshot(self):
        """Caffe's SolverState of the solver as it is (iter, current_step, history)."""
        with self._in_scratch():
            self._solver.snapshot()
            (name,) = [name for name in os.listdir(self._dir) if name.endswith(".solverstate")]
            return checkpoint.read_solverstate(os.path.join(self._dir, name))

    def _restore(self, state):
        """Load a SolverState without learned_net (the weights stay) into Caffe's solver."""
        with self._in_scratch():
            self._solver.restore(self._write("restore.solverstate", state.SerializeToString()))
        self.iter = self._caffe_iter = int(state.iter)
        self.current_step = self._caffe_current_step = int(state.current_step)

    def _require_solver(self):
        if self._solver is None:
            raise RuntimeError("this model was built for the TEST phase; it has no solver state")

    def get_history(self):
        self._require_solver()
        state = self._snapshot()
        if len(state.history) != len(self.history_shapes):
            raise RuntimeError(f"Caffe's solver holds {len(state.history)} history blobs, "
                               f"expected {len(self.history_shapes)}")
        return [np.asarray(blob.data, np.float32).reshape(shape)
                for blob, shape in zip(state.history, self.history_shapes)]

    def set_history(self, arrays):
        self._require_solver()
        arrays = self.check_arrays(arrays, self.history_shapes, "history blob")
        self._restore(checkpoint.solver_state(self.iter, self.current_step, arrays))


def timesteps(graph):
    """Per layer of `graph`, the number of timesteps T (x's first axis) of an LSTM or RNN, else None: Caffe's
    Recurrent layer fixes it at setup, and aborts in Reshape on another."""
    return [layer.bottom_shapes[0][0] if layer.type in ("LSTM", "RNN") else None for layer in graph.layers]


def check_timesteps(graph, steps):
    """A ValueError where a Recurrent layer of `graph` has another T than `steps` (timesteps') say it was set
    up for: pycaffe would abort the process."""
    for layer, before, now in zip(graph.layers, steps, timesteps(graph)):
        if before != now:
            raise ValueError(f"layer '{layer.name}' ({layer.type}) was set up for {before} timesteps and Caffe's "
                             f"Recurrent layer cannot take {now} (it aborts: input number of timesteps changed); "
                             "build a new net at that size")


def output_blobs(graph, net):
    """[(name, pycaffe's blob)] of the outputs of `graph`, for forward: Graph.outputs walks every layer at each
    read (a third of MTCNN P-Net's Python per forward at 12 x 12, bench/tf_speed.py), and a pycaffe blob stays
    the same object across reshapes."""
    return [(name, net.blobs[name]) for name in graph.outputs]


def param_blobs(graph, net):
    """Caffe's blob (of pycaffe's `net`) of each graph.params entry (its owner's: sharers share its memory)."""
    blobs, layers = [], net.layers
    positions = compiler.layer_positions(graph, list(net._layer_names))
    for param in graph.params:
        blob = layers[positions[param.owner]].blobs[param.index]  # by position: a name may repeat
        shape = tuple(blob.data.shape)
        if shape != tuple(param.shape) and blob.count != int(np.prod(param.shape)):
            raise RuntimeError(f"Caffe's blob {param.index} of layer '{param.layer}' is {fmt(shape)}, "
                               f"the graph says {fmt(param.shape)}")
        blobs.append(blob)
    return blobs
