"""The TensorFlow backend's Model: variables in Caffe's layout and a compiled solver step."""

import functools
import itertools
import logging
from types import SimpleNamespace

import numpy as np

from deepspark import fillers, schedule
from deepspark.backends import base
from deepspark.backends.tensorflow import compiler, lite, runtime
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import backward_needs
from deepspark.proto import deepspark_pb2 as pb

log = logging.getLogger(__name__)
# What runs a forward pass after its first lite.CALLS_BEFORE calls (the DEBUG line that says which).
PATHS = {True: "TensorFlow Lite's interpreter", False: "TensorFlow's executor (the interpreter refused it)"}

# After runtime's quiet import of TensorFlow: the parts of its eager runtime that direct_call uses.
from tensorflow.python.eager import context as eager_context, execute  # noqa: E402
from tensorflow.python.framework.ops import EagerTensor  # noqa: E402

TF_OPS = SimpleNamespace(sqrt=tf.sqrt, sign=tf.sign, sum=tf.reduce_sum, where=tf.where)


def traced(fn, **options):
    """tf.function(fn) without AutoGraph. A net's Python runs at trace time only (loops over the layer table,
    branches on the prototxt's values), so AutoGraph finds nothing to turn into graph control flow, yet it
    transpiles each function it meets first (about 80 for LeNet's step): most of the first step's time, in every
    worker's start-up; the graph and the losses are the same without it (bench/startup.py measures it)."""
    return tf.function(fn, autograph=False, **options)


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

        scalar = tf.TensorSpec((), tf.float32)
        flat = tf.TensorSpec((self.param_count,), tf.float32)
        self._compile_options = dict(jit_compile=jit_compile, reduce_retracing=True)
        self._apply_fn = traced(self._apply_accumulated, input_signature=[scalar, scalar], **self._compile_options)
        self._get_flat_fn = traced(self._flat, input_signature=[])
        self._set_flat_fn = traced(self._assign_flat, input_signature=[flat])
        self._shaped = {}  # the input shapes -> their graph, carried state and passes (see _compile)
        self._forward_calls = ForwardCalls(self)  # how each forward pass is called (see forward)
        self._compile()

    def _compile(self):
        """The passes for self.graph's input shapes: compiled once per shape, each traced (at its first call)
        with its own graph, the shapes Caffe's rules give every blob at those inputs."""
        key = tuple(sorted(self.feeds.items()))
        if key not in self._shaped:
            feed = {top: tf.TensorSpec(shape, tf.float32) for top, shape in self.feeds.items()}
            scalar = tf.TensorSpec((), tf.float32)
            options = self._compile_options
            self._shaped[key] = SimpleNamespace(
                graph=self.graph,
                state=compiler.carried_state(self.graph),  # a recurrent layer's last hidden state
                step=traced(self._step, input_signature=[feed, scalar, scalar], **options),
                accumulate=traced(self._accumulate, input_signature=[feed], **options),
                forward=traced(self._forward, input_signature=[feed], **options),
                gradients=traced(self._gradients, input_signature=[feed], **options))
        shaped = self._shaped[key]
        self.graph, self._state = shaped.graph, shaped.state
        self._step_fn, self._accumulate_fn = shaped.step, shaped.accumulate
        self._forward_fn, self._gradients_fn = shaped.forward, shaped.gradients

    def _reshaped(self):
        super()._reshaped()
        self._compile()

    # -- the traced computations -------------------------------------------------

    def _pass(self, inputs, differentiate):
        """Forward (and backward): (loss, {blob: Blob}, Caffe's diffs or None, running-stat updates)."""
        ctx = compiler.Context(self.graph, inputs, self.train, self._rng, self._random_seed,
                               self._orders, self._state)
        watched = [self._variables[i] for i in self._trainable]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(watched)
            loss, blobs = compiler.run(self.graph, self._variables, ctx)
        for variable, value in ctx.carries:  # every forward pass moves it on, as Caffe's does
            variable.assign(value)
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
            return solve_momentum(self.solver_param, self._variables, self._history, grads, rate, self._lr_mults,
                                  self._decay_mults)
        weights, history = schedule.apply_update(
            self.solver_param, self._variables, grads, self._history, rate, iteration,
            self._lr_mults, self._decay_mults, ops=TF_OPS)
        for i in self._trainable:  # a zero lr_mult leaves the blob as it is
            self._variables[i].assign(weights[i])
        for variable, value in zip(self._history, history):
            variable.assign(value)

    def _outputs(self, blobs):
        return {name: blobs[name].caffe for name in self.graph.outputs}

    def _step(self, inputs, rate, iteration):
        loss, blobs, grads, updates = self._pass(inputs, True)
        self._apply_running(updates)
        self._solve(grads, rate, iteration)
        return loss, self._outputs(blobs)

    def _accumulate(self, inputs):
        loss, blobs, grads, updates = self._pass(inputs, True)
        self._apply_running(updates)
        for total, grad in zip(self._accumulated, grads):
            total.assign_add(grad)
        return loss, self._outputs(blobs)

    def _apply_accumulated(self, rate, iteration):
        self._solve([total.read_value() for total in self._accumulated], rate, iteration)
        for total in self._accumulated:
            total.assign(tf.zeros_like(total))

    def _forward(self, inputs):
        _, blobs, _, updates = self._pass(inputs, False)
        self._apply_running(updates)
        return self._outputs(blobs)

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
            loss, self._train_outputs = self._step_fn(self.feed(batches[0]), rate, iteration)
        else:
            passes = [self._accumulate_fn(self.feed(b)) for b in batches]
            loss = tf.add_n([pass_loss for pass_loss, _ in passes]) / self.iter_size
            self._train_outputs = passes[-1][1]
            self._apply_fn(rate, iteration)
        self.iter += 1
        self._forward_calls.writes += 1
        return float(loss)

    def train_outputs(self):
        outputs = getattr(self, "_train_outputs", None)
        return None if outputs is None else {name: value.numpy() for name, value in outputs.items()}

    def forward(self, batch):
        """The pass's outputs: by TensorFlow's executor (direct_call), or, for a small pass called again and
        again, by TensorFlow Lite's interpreter (lite: the first lite.CALLS_BEFORE calls by the executor)."""
        return self._forward_calls.call(self._forward_fn)(self.feed(batch))

    def gradients(self, batch):
        loss, grads = self._gradients_fn(self.feed(batch))
        return float(loss), [g.numpy() for g in grads]

    def serving_module(self, batch_size=None, any_size=None):
        """serving_module(self, batch_size, any_size): this net as a tf.Module to save as a SavedModel."""
        return serving_module(self, batch_size, any_size)

    def layer_passes(self, batch):
        """Each layer compiled on its own, Caffe's Forward and Backward timed by themselves (layer_passes)."""
        return layer_passes(self, batch)

    def get_params(self):
        return [self._load(i, v) for i, v in enumerate(self._variables)]

    def set_params(self, arrays):
        for i, (variable, array) in enumerate(zip(self._variables, self.check_arrays(arrays))):
            variable.assign(self._store(i, array))
        self._forward_calls.writes += 1

    def get_flat(self, out=None):
        flat = self._get_flat_fn().numpy()
        if out is None:
            return flat if flat.flags.writeable else flat.copy()
        np.copyto(out, flat)
        return out

    def set_flat(self, vector):
        self._set_flat_fn(self.check_flat(vector))
        self._forward_calls.writes += 1

    def get_history(self):
        self._ensure_solver()
        return [self._load(i, h) for i, h in enumerate(self._history)]

    def set_history(self, arrays):
        self._ensure_solver()
        arrays = self.check_arrays(arrays, self.history_shapes, "history blob")
        for i, (variable, array) in enumerate(zip(self._history, arrays)):
            variable.assign(self._store(i, array))


class ForwardCalls:
    """The call of each traced forward pass of a Model: direct_call through TensorFlow's executor, or, for a small
    pass called again and again, TensorFlow Lite's interpreter (lite), chosen once per pass."""

    def __init__(self, model):
        self._model = model
        self.calls = {}  # a forward tf.function -> its direct_call or interpreted pass, once traced (see call)
        self._counts = {}  # a forward tf.function -> its calls so far, until its pass is chosen (see call)
        self.writes = 0  # counts the writes to the parameters: an interpreted pass sets them again after one

    def call(self, fn):
        """What runs the forward tf.function `fn` (the model's at its present shape) this time: by the executor
        at first; after lite.CALLS_BEFORE calls of a pass lite.worth_it takes, by the interpreter where it can."""
        model = self._model
        if fn not in self.calls:
            self.calls[fn] = direct_call(fn.get_concrete_function(), model.feeds)
            self._counts[fn] = 0 if lite.worth_it(model.graph, model.train) else None
        if self._counts.get(fn) is not None:
            self._counts[fn] += 1
            if self._counts[fn] > lite.CALLS_BEFORE:
                self._counts[fn] = None  # chosen, for good
                interpreted = self._interpreted()
                self.calls[fn] = interpreted or self.calls[fn]
                shapes = ", ".join("x".join(map(str, shape)) for shape in model.feeds.values())
                log.debug(f"Forward pass at {shapes}: by {PATHS[bool(interpreted)]} from now on")
        return self.calls[fn]

    def _interpreted(self):
        """This shape's forward pass run by TensorFlow Lite's interpreter (lite.interpreted), the parameters fed
        as inputs; None where it refuses the pass, or where the pass moves state (a carried state, running
        statistics): the executor runs those."""
        model = self._model
        names = list(model.feeds)
        specs = [tf.TensorSpec(model.feeds[name], tf.float32, name=f"input{i}") for i, name in enumerate(names)]
        specs += [tf.TensorSpec(shape, tf.float32, name=f"param{i}") for i, shape in enumerate(model._stored_shapes)]
        moved = []

        def inference(*tensors):
            ctx = compiler.Context(model.graph, dict(zip(names, tensors)), model.train, model._rng,
                                   model._random_seed, model._orders, model._state)
            _, blobs = compiler.run(model.graph, tensors[len(names):], ctx)
            moved.extend(ctx.updates + ctx.carries)
            return [blobs[name].caffe for name in model.graph.outputs]

        concrete = traced(inference, input_signature=specs).get_concrete_function()
        if moved:
            return None
        return lite.interpreted(concrete, names, model.graph.outputs, model._variables, lambda: self.writes,
                                model.threads)


def direct_call(concrete, feeds, single_threaded=None):
    """`concrete`, a traced pass of {top: tensor} (the tops of `feeds`) -> {blob: tensor}, as a function of
    {top: float32 array} (checked: base.Model.feed) -> {blob: array}, run by TensorFlow's executor directly.

    Calling a ConcreteFunction binds its arguments to its signature, casts and flattens them and looks for a
    gradient tape each time, in Python: about 90 us a call here, more than half of what MTCNN's P-Net costs
    at 12 x 12 and batch 1 (bench/tf_speed.py). This is what that call ends in (atomic_function.call_flat's
    eager branch): the function's name, its inputs in TensorFlow's flattening order (a dict's: by key) and
    its captured variables, with the context's call options read at each call, as TensorFlow reads them.
    Each array is copied into its tensor, as tf.constant does (TensorFlow may otherwise write into it).

    With one inter-op thread on the CPU, TensorFlow's executor runs the kernels one at a time on that thread
    while the caller waits; its single-threaded executor runs the same kernels, in the same order of data, in
    one go, without scheduling each (measured on MTCNN at batch 1: R-Net's call 8% faster at a load average of
    4 on 2 cores, 19% at 16). The pass still runs on TensorFlow's pool thread, not the caller's (the eager
    runtime hands the function over; measured by the threads' CPU time: P-Net 12 x 12's kernels ~95 us there
    a call, the caller's Python and dispatch ~60 us). It refuses control flow and asynchronous kernels before running
    any, with a FailedPreconditionError at the first call: the default executor runs that pass from then on.
    single_threaded: try it (True), never (False), or where TensorFlow has one inter-op thread on the CPU (None).
    """
    tops = tf.nest.flatten({top: top for top in feeds})
    outputs = {name: name for name in concrete.structured_outputs}
    names, count = tf.nest.flatten(outputs), len(outputs)
    name = concrete._inference_function.name.decode()  # the function as registered in the eager context
    captured = list(concrete.captured_inputs)
    ctx = eager_context.context()
    float32 = tf.float32.as_datatype_enum
    inline = single_threaded if single_threaded is not None else (
        tf.config.threading.get_inter_op_parallelism_threads() == 1 and runtime.device() == "CPU")
    proven = False  # a call has run: an error now is the pass's own

    def run(inputs, single):
        options = ctx.function_call_options.as_attrs()
        if single and not options["executor_type"]:  # an executor the caller chose stays
            options["executor_type"] = "SINGLE_THREADED_EXECUTOR"
        return execute.execute(name, count, inputs + captured, tuple(itertools.chain(*options.items())), ctx)

    def call(arrays):
        nonlocal inline, proven
        inputs = [EagerTensor(np.array(arrays[top]), ctx.device_name, float32) for top in tops]
        try:
            values = run(inputs, inline)
        except tf.errors.FailedPreconditionError:
            if proven or not inline:
                raise
            inline = False
            values = run(inputs, False)
        proven = True
        return {blob: value.numpy() for blob, value in zip(names, values)}

    call.concrete = concrete  # held: collected, it would take its function out of the eager context
    return call


def solve_momentum(param, variables, histories, grads, rate, lr_mults, decay_mults):
    """Caffe's SGD and Nesterov (the solver `param`'s) on `variables` and their `histories` through TF's fused
    momentum kernel, one op per blob.

    With lr = 1 and grad = local_rate * g the kernel's accumulator is Caffe's
    history v = m v + local_rate g, and it subtracts v (SGD) or
    local_rate g + m v, which equals Caffe's (1+m) v - m v_prev (Nesterov).
    """
    grads = schedule.effective_grads(param, variables, grads, decay_mults, TF_OPS)
    one = tf.constant(1.0, tf.float32)
    nesterov = schedule.solver_type(param) == "Nesterov"
    for weight, grad, history, lr_mult in zip(variables, grads, histories, lr_mults):
        step = grad * schedule.local_rate(rate, lr_mult)
        if lr_mult == 0:  # a zero lr_mult leaves the blob as it is
            history.assign(param.momentum * history + step)
            continue
        tf.raw_ops.ResourceApplyMomentum(var=weight.handle, accum=history.handle, lr=one, grad=step,
                                         momentum=tf.constant(param.momentum, tf.float32), use_nesterov=nesterov)


def serving_module(model, batch_size=None, any_size=None):
    """A tf.Module that holds the parameters of `model` (a Model) as they are now and whose `serve` is its forward pass,
    the TEST phase's, for tf.saved_model.save: inputs by the net's input names, N x C x H x W float32 as
    Caffe takes them (N: batch_size, None for any), outputs by the names of the blobs nothing consumes.
    It needs neither DeepSpark nor the Model once saved.

    any_size: serve every height and width Caffe would reshape the net to (a fully convolutional net:
    compiler.size_fixers finds none; the default); otherwise an input of another shape than the net's is
    refused by an assertion whose message names the shape expected, never answered wrongly.
    """
    graph, orders = model.graph, model._orders
    fixers = compiler.size_fixers(graph)
    if any_size is None:
        any_size = not fixers
    elif any_size and fixers:
        raise ValueError(f"layer '{fixers[0].name}' ({fixers[0].type}) fixes the input size: the net cannot "
                         "be served at any size")
    module = tf.Module()
    module.params = [tf.Variable(v, trainable=False, name=f"param{i}") for i, v in enumerate(model._variables)]
    names = list(model.feeds)
    shapes = {name: (batch_size,) + tuple(model.feeds[name][1:]) for name in names}
    if any_size:  # height and width left to the data; the channels stay the net's
        shapes = {name: shape[:2] + (None,) * (len(shape) - 2) for name, shape in shapes.items()}
    specs = [tf.TensorSpec((batch_size,) + (None,) * (len(shapes[name]) - 1), tf.float32, name=name)
             for name in names]

    smallest = minimum_sizes(model) if any_size else {}

    def serve(*inputs):
        fed = {name: _checked_input(name, x, shapes[name], fixers, smallest.get(name))
               for name, x in zip(names, inputs)}
        ctx = compiler.Context(graph, fed, False, orders=orders)
        _, blobs = compiler.run(graph, module.params, ctx)
        return {name: blobs[name].caffe for name in graph.outputs}

    module.serve = traced(serve, input_signature=specs)
    module.input_shapes = shapes  # what it serves, None where any size goes (not saved: for the caller)
    return module


def minimum_sizes(model):
    """{input: (the smallest size of each axis after the channels that Caffe's reshape takes)} of a model that
    serves any size, each axis found alone (the others at the net's size) by bisection between 1 and the net's
    size, the graph's shape rules deciding (reshaped_net: where they refuse, Caffe's Net::Reshape aborts and
    TensorFlow would compute on empty or negative extents, answering uninitialised memory)."""
    smallest = {}
    for name, shape in model.feeds.items():
        sizes = []
        for axis in range(2, len(shape)):
            low, high = 0, shape[axis]  # low: refused (or none), high: taken
            while high - low > 1:
                middle = (low + high) // 2
                trial = {name: shape[:axis] + (middle,) + shape[axis + 1:]}
                try:
                    base.reshaped_net(model.net_param, trial, model.phase, model.param_shapes, model._graph_options)
                    high = middle
                except ValueError:
                    low = middle
            sizes.append(high)
        if any(size > 1 for size in sizes):
            smallest[name] = tuple(sizes)
    return smallest


def _checked_input(name, x, shape, fixers, smallest=None):
    """Input `name` of a served net with the static `shape` (None: any) its layers are compiled for, after an
    assertion that refuses, in one line naming the shape (and the `smallest` size of each axis after the
    channels, where any size goes), an input the SavedModel would answer wrongly."""
    expected = " x ".join("N" if i == 0 and d is None else "any" if d is None else str(d) for i, d in enumerate(shape))
    # No quotes in the message: TensorFlow prints an assertion's strings C-escaped (\').
    why = f" (layer {fixers[0].name}, {fixers[0].type}, fixes its size)" if fixers and None not in shape[1:] else ""
    given = tf.shape(x)
    conditions = [tf.equal(given[i], d) for i, d in enumerate(shape) if d is not None]
    if smallest:
        why += f", at least {' x '.join(str(d) for d in smallest)} (smaller, the net has nothing to compute)"
        conditions += [tf.greater_equal(given[2 + i], d) for i, d in enumerate(smallest)]
    fits = tf.reduce_all(conditions or [True])
    check = tf.debugging.Assert(fits, [f"input {name} must be {expected}{why}; it is", given], summarize=8)
    with tf.control_dependencies([check]):
        return tf.ensure_shape(tf.identity(x), shape)


def layer_passes(model, batch):
    """Each layer of `model` (a Model) compiled on its own (a tf.function), fed the blobs the forwards before it made.

    Forward calls the layer's function under a GradientTape when Caffe's Net
    would give the layer a backward (graph.backward_needs), so that TensorFlow
    keeps what the gradient reads, as Caffe's Forward keeps a pooling mask;
    backward runs the gradient TensorFlow compiled for that call on the
    diffs of the layer's tops (its loss_weight for a loss top) into the
    diffs of its bottoms and parameters: Caffe's Backward, with no forward
    run again, timed by itself. (The earlier measure, a forward-and-gradient
    function less the forward, was the difference of two noisy timings,
    clipped at 0 ms for ReLU and the loss, and took every bottom's gradient:
    conv1's of the data too, which Caffe never computes.) Every call pays
    TensorFlow's dispatch of a function, a few hundred microseconds on a
    busy 2-core machine, which the compiled training step pays once for
    the whole net (bench/time_layers.py measures the sum against it).
    """
    inputs = {top: tf.constant(array) for top, array in model.feed(batch).items()}
    ctx = compiler.Context(model.graph, inputs, model.train, model._rng, model._random_seed,
                           model._orders)
    blobs, diffs, passes = {}, {}, []  # what Caffe's blobs hold as data and as diff
    losses = {}  # layer: [(top tensor, loss_weight)] of its last forward, by layer: automatic tops share a name
    for layer, needs in zip(model.graph.layers, backward_needs(model.graph)):
        params = compiler.layer_params(layer, model._variables, ctx.orders)
        params = [tf.convert_to_tensor(value) for value in params]  # the weights stay as they are
        passes.append(_layer_pass(layer, params, needs, ctx, blobs, diffs, losses))

    def loss():
        return sum(weight * float(tf.reduce_sum(top)) for terms in losses.values() for top, weight in terms)

    return passes, loss


def _traced_layer(layer, ctx, layouts, tensors, values):
    """A layer's function on bare tensors (what a tf.function returns), the blobs' layouts kept in `layouts`."""
    bottoms = [compiler.Blob(tensor, nhwc) for tensor, nhwc in zip(tensors, layouts["bottoms"])]
    tops = compiler.LAYERS[layer.type].function(layer, bottoms, values, ctx)
    layouts["tops"] = [top.nhwc for top in tops]
    return [top.tensor for top in tops]


def _layer_pass(layer, params, needs, ctx, blobs, diffs, losses):
    """One layer's base.LayerPass: its function compiled alone, and the gradient TensorFlow compiles for it.

    blobs: {blob: Blob} the forwards fill; diffs: {blob: diff} the backwards
    fill and read, a blob read by several layers summing their diffs; losses:
    {layer: [(top, loss_weight)]} the forward of a loss layer fills.
    """
    bottoms_wanted, params_wanted = needs
    layouts = {}  # "bottoms", "tops": each blob's nhwc flag, fixed from the first call
    # A partial, not a closure: TensorFlow counts traces per code object and would warn of retracing.
    compiled = traced(functools.partial(_traced_layer, layer, ctx, layouts))
    taped = []  # (tape, sources, tops) of the last forward, for the backward
    seeds = {}  # top -> its diff when no later layer gave one: loss_weight on a loss top, else zero

    def forward():
        bottoms = [blobs[name] for name in layer.bottoms]
        if "bottoms" not in layouts:
            layouts["bottoms"] = [bottom.nhwc for bottom in bottoms]
        tensors = [bottom.tensor for bottom in bottoms]
        if bottoms_wanted or params_wanted:
            sources = [tensors[b] for b in bottoms_wanted] + [params[b] for b in params_wanted]
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(sources)
                tops = compiled(tensors, params)
            taped[:] = [(tape, sources, tops)]
        else:
            tops = compiled(tensors, params)
        ctx.updates.clear()  # running statistics stay as they are
        blobs.update((name, compiler.Blob(top, nhwc)) for name, top, nhwc in zip(layer.tops, tops, layouts["tops"]))
        if any(layer.loss_weights):
            losses[id(layer)] = [(top, weight) for top, weight in zip(tops, layer.loss_weights) if weight]

    def backward():
        if not taped:
            for name in layer.tops:
                diffs.pop(name, None)  # a diff nobody reads: its layer has no backward, as in Caffe's Net
            return
        tape, sources, tops = taped.pop()
        targets, upstream = [], []
        for name, top, weight in zip(layer.tops, tops, layer.loss_weights):
            diff = diffs.pop(name, None)
            if not top.dtype.is_floating:
                continue
            if weight or diff is None:
                if name not in seeds:
                    seeds[name] = tf.fill(tf.shape(top), tf.constant(weight, top.dtype))
                diff = seeds[name] if diff is None else diff + seeds[name]
            targets.append(top)
            upstream.append(diff)
        grads = tape.gradient(targets, sources, output_gradients=upstream)
        for b, grad in zip(bottoms_wanted, grads):  # the parameters' diffs are computed, and not kept
            if grad is not None:
                name = layer.bottoms[b]
                diffs[name] = grad if name not in diffs else diffs[name] + grad

    return base.LayerPass(layer.name, forward, backward)
