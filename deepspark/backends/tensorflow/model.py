"""The TensorFlow backend's Model: variables in Caffe's layout and a compiled solver step."""

import time
from types import SimpleNamespace

import numpy as np

from deepspark import fillers, schedule
from deepspark.backends import base
from deepspark.backends.tensorflow import compiler, runtime
from deepspark.backends.tensorflow.runtime import tf
from deepspark.proto import deepspark_pb2 as pb

TF_OPS = SimpleNamespace(sqrt=tf.sqrt, sign=tf.sign, sum=tf.reduce_sum, where=tf.where)


class Model(base.Model):
    """base.Model on TensorFlow: every pass is one traced tf.function; the rate is a tensor argument.

    jit_compile: compile the step with XLA (off by default: measured slower for
    LeNet on CPU here).
    """

    def __init__(self, net_param, solver_param=None, phase=pb.TRAIN, source=None, batch_size=None,
                 seed=None, stages=None, data_shape=None, threads=None, jit_compile=False):
        super().__init__(net_param, solver_param, phase, source=source, batch_size=batch_size, seed=seed,
                         stages=stages, data_shape=data_shape, threads=threads)
        runtime.set_threads(self.threads)  # before the first variable starts TensorFlow's runtime
        graph = self.graph
        self._index = graph.blob_params
        self._orders = compiler.storage_orders(graph)  # conv kernels live as HWIO inside
        self._inverse = [compiler.inverse(order) for order in self._orders]
        self._variables = [tf.Variable(self._store(i, array), name=f"param{i}")
                           for i, array in enumerate(fillers.init_params(graph, self.seed))]
        self._stored_shapes = [tuple(v.shape) for v in self._variables]
        rng_seed = self.seed if self.seed is not None else np.random.SeedSequence().entropy % 2 ** 63
        self._rng = tf.random.Generator.from_seed(rng_seed)
        self._random_seed = int(rng_seed)
        self._lr_mults = [p.lr_mult for p in graph.params]
        self._decay_mults = [p.decay_mult for p in graph.params]
        self._trainable = [i for i, mult in enumerate(self._lr_mults) if mult != 0]
        self._history = None
        self._accumulated = None

        feed = {top: tf.TensorSpec(shape, tf.float32) for top, shape in self.feeds.items()}
        scalar = tf.TensorSpec((), tf.float32)
        flat = tf.TensorSpec((self.param_count,), tf.float32)
        compile_options = dict(jit_compile=jit_compile, reduce_retracing=True)
        self._step_fn = tf.function(self._step, input_signature=[feed, scalar, scalar], **compile_options)
        self._accumulate_fn = tf.function(self._accumulate, input_signature=[feed], **compile_options)
        self._apply_fn = tf.function(self._apply_accumulated, input_signature=[scalar, scalar],
                                     **compile_options)
        self._forward_fn = tf.function(self._forward, input_signature=[feed], **compile_options)
        self._gradients_fn = tf.function(self._gradients, input_signature=[feed], **compile_options)
        self._get_flat_fn = tf.function(self._flat, input_signature=[])
        self._set_flat_fn = tf.function(self._assign_flat, input_signature=[flat])

    # -- the traced computations -------------------------------------------------

    def _pass(self, inputs, differentiate):
        """Forward (and backward): (loss, {blob: Blob}, Caffe's diffs or None, running-stat updates)."""
        ctx = compiler.Context(self.graph, inputs, self.train, self._rng, self._random_seed, self._index,
                               self._orders)
        watched = [self._variables[i] for i in self._trainable]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(watched)
            loss, blobs = compiler.run(self.graph, self._variables, ctx)
        grads = None
        if differentiate:
            found = tape.gradient(loss, watched) if watched else []
            grads = [tf.zeros(shape, tf.float32) for shape in self._stored_shapes]
            for i, grad in zip(self._trainable, found):
                if grad is not None:
                    grads[i] = tf.convert_to_tensor(grad)
        return loss, blobs, grads, ctx.updates

    def _apply_running(self, updates):
        for i, value in updates:
            self._variables[i].assign(value)

    def _solve(self, grads, rate, iteration):
        if self.solver_type in ("SGD", "Nesterov"):
            return self._solve_momentum(grads, rate)
        weights, history = schedule.apply_update(
            self.solver_param, self._variables, grads, self._history, rate, iteration,
            self._lr_mults, self._decay_mults, ops=TF_OPS)
        for i in self._trainable:  # a zero lr_mult leaves the blob as it is
            self._variables[i].assign(weights[i])
        for variable, value in zip(self._history, history):
            variable.assign(value)

    def _solve_momentum(self, grads, rate):
        """Caffe's SGD and Nesterov through TF's fused momentum kernel, one op per blob.

        With lr = 1 and grad = local_rate * g the kernel's accumulator is Caffe's
        history v = m v + local_rate g, and it subtracts v (SGD) or
        local_rate g + m v, which equals Caffe's (1+m) v - m v_prev (Nesterov).
        """
        param = self.solver_param
        grads = schedule.effective_grads(param, self._variables, grads, self._decay_mults, TF_OPS)
        one = tf.constant(1.0, tf.float32)
        for i, (weight, grad, history) in enumerate(zip(self._variables, grads, self._history)):
            step = grad * schedule.local_rate(rate, self._lr_mults[i])
            if self._lr_mults[i] == 0:  # a zero lr_mult leaves the blob as it is
                history.assign(param.momentum * history + step)
                continue
            tf.raw_ops.ResourceApplyMomentum(var=weight.handle, accum=history.handle, lr=one, grad=step,
                                             momentum=tf.constant(param.momentum, tf.float32),
                                             use_nesterov=self.solver_type == "Nesterov")

    def _step(self, inputs, rate, iteration):
        loss, _, grads, updates = self._pass(inputs, True)
        self._apply_running(updates)
        self._solve(grads, rate, iteration)
        return loss

    def _accumulate(self, inputs):
        loss, _, grads, updates = self._pass(inputs, True)
        self._apply_running(updates)
        for total, grad in zip(self._accumulated, grads):
            total.assign_add(grad)
        return loss

    def _apply_accumulated(self, rate, iteration):
        self._solve([total.read_value() for total in self._accumulated], rate, iteration)
        for total in self._accumulated:
            total.assign(tf.zeros_like(total))

    def _forward(self, inputs):
        _, blobs, _, updates = self._pass(inputs, False)
        self._apply_running(updates)
        return {name: blobs[name].caffe for name in self.graph.outputs}

    def _gradients(self, inputs):
        loss, _, grads, _ = self._pass(inputs, True)
        return loss, [compiler.permute(g, order) for g, order in zip(grads, self._inverse)]

    def _flat(self):
        return tf.concat([tf.reshape(compiler.permute(v, order), [-1])
                          for v, order in zip(self._variables, self._inverse)], axis=0)

    def _assign_flat(self, vector):
        parts = tf.split(vector, self.param_sizes)
        for variable, part, shape, order in zip(self._variables, parts, self.param_shapes, self._orders):
            variable.assign(compiler.permute(tf.reshape(part, shape), order))

    def _store(self, i, array):
        """A Caffe-layout array of parameter i (or its history) in its stored layout."""
        order = self._orders[i % len(self._orders)]
        return array if order is None else np.ascontiguousarray(np.transpose(array, order))

    def _load(self, i, variable):
        """A stored variable of parameter i (or its history) as a Caffe-layout float32 array."""
        array = variable.numpy()
        order = self._inverse[i % len(self._inverse)]
        return np.array(array if order is None else np.transpose(array, order), np.float32, order="C")

    # -- the contract --------------------------------------------------------------

    def _ensure_solver(self):
        if self._history is None:
            self._history = [tf.Variable(tf.zeros(shape, tf.float32), name=f"history{i}")
                             for i, shape in enumerate(self._stored_shapes * self.history_sets)]
        if self.iter_size > 1 and self._accumulated is None:
            self._accumulated = [tf.Variable(tf.zeros(shape, tf.float32), name=f"diff{i}")
                                 for i, shape in enumerate(self._stored_shapes)]

    def step(self, batch):
        batches = self.batches(batch)
        self._ensure_solver()
        rate = tf.constant(self.next_rate(), tf.float32)
        iteration = tf.constant(float(self.iter), tf.float32)
        if self.iter_size == 1:
            loss = self._step_fn(self.feed(batches[0]), rate, iteration)
        else:
            loss = tf.add_n([self._accumulate_fn(self.feed(b)) for b in batches]) / self.iter_size
            self._apply_fn(rate, iteration)
        self.iter += 1
        return float(loss)

    def forward(self, batch):
        return {name: value.numpy() for name, value in self._forward_fn(self.feed(batch)).items()}

    def gradients(self, batch):
        loss, grads = self._gradients_fn(self.feed(batch))
        return float(loss), [g.numpy() for g in grads]

    def time_layers(self, batch, iterations=10):
        """[(layer, forward ms, backward ms)]: each layer compiled on its own, timed on its real inputs.

        Backward is the layer's forward-and-gradient function less its forward,
        with an upstream gradient of ones, as `caffe time` reports per layer.
        """
        inputs = {top: tf.constant(array) for top, array in self.feed(batch).items()}
        ctx = compiler.Context(self.graph, inputs, self.train, self._rng, self._random_seed, self._index,
                               self._orders)
        blobs, rows = {}, []
        for layer in self.graph.layers:
            function = compiler.LAYERS[layer.type].function
            bottoms = [blobs[name] for name in layer.bottoms]
            params = compiler.layer_params(layer, ctx.index[layer.name], self._variables, ctx.orders)

            forward, backward = _layer_passes(layer, function, ctx)
            forward_ms = _time(tf.function(forward), bottoms, params, iterations)
            backward_ms = _time(tf.function(backward), bottoms, params, iterations) if (bottoms or params) else 0.0
            tops = function(layer, bottoms, params, ctx)
            for name, top in zip(layer.tops, tops):
                blobs[name] = top
            ctx.updates.clear()
            rows.append((layer.name, forward_ms, max(backward_ms - forward_ms, 0.0)))
        return rows

    def get_params(self):
        return [self._load(i, v) for i, v in enumerate(self._variables)]

    def set_params(self, arrays):
        for i, (variable, array) in enumerate(zip(self._variables, self.check_arrays(arrays))):
            variable.assign(self._store(i, array))

    def get_flat(self, out=None):
        flat = self._get_flat_fn().numpy()
        if out is None:
            return flat if flat.flags.writeable else flat.copy()
        np.copyto(out, flat)
        return out

    def set_flat(self, vector):
        self._set_flat_fn(self.check_flat(vector))

    def get_history(self):
        self._ensure_solver()
        return [self._load(i, h) for i, h in enumerate(self._history)]

    def set_history(self, arrays):
        self._ensure_solver()
        arrays = self.check_arrays(arrays, self.history_shapes, "history blob")
        for i, (variable, array) in enumerate(zip(self._history, arrays)):
            variable.assign(self._store(i, array))


def _layer_passes(layer, function, ctx):
    """One layer's forward, and its forward-and-gradient with an upstream gradient of ones."""
    def forward(bottoms, params):
        return function(layer, bottoms, params, ctx)

    def backward(bottoms, params):
        sources = [b.tensor for b in bottoms] + list(params)
        with tf.GradientTape() as tape:
            tape.watch(sources)
            tops = function(layer, bottoms, params, ctx)
            total = [tf.reduce_sum(t.tensor) for t in tops if t.tensor.dtype.is_floating]
            total = tf.add_n(total) if total else tf.constant(0.0)
        grads = tape.gradient(total, sources, unconnected_gradients="zero") if sources else []
        return [g for g in grads if g is not None]

    return forward, backward


def _time(function, bottoms, params, iterations):
    """Milliseconds per call of a compiled function, after one call that traces it."""
    function(bottoms, params)
    started = time.perf_counter()
    for _ in range(iterations):
        function(bottoms, params)
    return (time.perf_counter() - started) * 1000.0 / max(iterations, 1)
