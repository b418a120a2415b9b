"""`deepspark compare`: one net, the same weights and batches, on several backends, side by side.

The forward pass is compared in the TEST phase (dropout off, no random crop
or mirror); with a solver, each backend trains K iterations from the same
weights on the same batches and the loss trajectories are compared, and each
step from the first backend's weights and history is compared blob by blob
(Dropout switched off there: each backend draws its own masks). A blob's
relative difference is its largest absolute difference over the larger of
the two blobs' largest magnitudes, so values near zero do not blow it up
(a parameter blob's: over its layer's blobs' largest magnitude).

The tolerance rule: a blob differs when its relative difference exceeds the
tolerance plus NOISE_MARGIN times its noise floor, the relative difference
the first backend gives against itself (a twin model of it, in the same
hidden state: an LSTM carries its own from pass to pass) when each value
of the batch is nudged by up to NUDGE (one part in a million: float32
rounding of the order that two backends' different summation orders make,
amplified as this net and solver amplify it). The floor scales with the blob's magnitude and with
the solver: Adam, RMSProp, AdaGrad and AdaDelta normalise each element's
update, so an element whose gradient is within rounding of zero moves by up
to the full step on one backend and not on the other, and the nudge moves it
so too (huangzehao/caffe-vdsr's Adam: 8.6e-4 after one step, pycaffe against
itself nudged 7.9e-4); a deep recurrent stack (LRCN's lstm2) amplifies its
inputs' rounding likewise. Where nothing amplifies rounding, the floor is
near zero and the tolerance alone judges.
"""

import copy
import os
import sys
import time

import numpy as np

from deepspark import checkpoint, engine
from deepspark.backends import BACKENDS, backend_module, create_model
from deepspark.config import load_net, load_solver, model_file, net_path, random_seed, set_fields
from deepspark.data import READ_SOURCES, feeder_for, source_of, source_shape
from deepspark.errors import ConfigError
from deepspark.fillers import fill
from deepspark.graph import Graph, spec, with_batch_size, with_taps
from deepspark.proto import deepspark_pb2 as pb

SEED = 1701
TIMING_REPEATS = 3
NUDGE = 1e-6  # the relative change of each batch value that measures a blob's noise floor
NOISE_MARGIN = 2  # the floor is one draw of rounding; the other backend's makes a second of the same size


# -- data ---------------------------------------------------------------------------


def deploy_shapes(net_path):
    """{top: (C, H, W)} of the Input layers of the deploy.prototxt beside `net_path`, if there is one."""
    deploy = model_file(net_path, "deploy.prototxt")
    if not deploy:
        return {}
    net, _ = load_net(deploy)
    return {top: tuple(shape.dim)[1:] for layer in net.layer if layer.type == "Input"
            for top, shape in zip(layer.top, layer.input_param.shape)}


def shape_finder(net_path, given=None):
    """data_shape for data layers: their source's, else --data-shape (`given`, as describe takes it), else the
    prototxt's, else the deploy net's input."""
    beside = deploy_shapes(net_path)

    def data_shape(layer_param):
        shape = source_shape(layer_param, given)
        if isinstance(shape, str) and layer_param.top and layer_param.top[0] in beside:
            return beside[layer_param.top[0]]
        return shape
    return data_shape


def sourced(model):
    """The data layers of a model's net that read a source (Data, HDF5Data, ImageData)."""
    return [layer for layer in model.graph.layers if layer.type in READ_SOURCES]


class PipelineBatches:
    """Batches from the shared pipeline for the data layers with a source, synthetic ones for any other fed top."""

    def __init__(self, model, phase, seed=SEED):
        self.feeders = [feeder_for(layer.param, phase, seed=seed, batch_size=model.graph.context.batch_size)
                        for layer in sourced(model)]
        self.synthetic = engine.SyntheticBatches(model, seed)

    def next_batch(self):
        batch = self.synthetic.next_batch()
        for feeder in self.feeders:
            batch.update(feeder.next_batch())
        return batch

    def close(self):
        engine.close_all(self.feeders)


def with_dummy_data_fed(net):
    """A copy of `net` whose DummyData layers with a random filler are Input layers of the same tops and shapes:
    each backend draws DummyData from its own generator, so a comparison feeds both the same values instead
    (constant fillers stay: they fill the same on every backend)."""
    net = copy.deepcopy(net)
    for layer in net.layer:
        fillers = layer.dummy_data_param.data_filler
        if layer.type != "DummyData" or all((f.type or "constant") == "constant" for f in fillers) and fillers:
            continue
        shapes = [tuple(shape.dim) for shape in layer.dummy_data_param.shape]
        if not shapes:  # the legacy num/channels/height/width form
            param = layer.dummy_data_param
            fields = [list(param.num), list(param.channels), list(param.height), list(param.width)]
            count = max(len(f) for f in fields)
            shapes = [tuple(f[i] if len(f) > 1 else f[0] for f in fields) for i in range(count)]
        shapes = shapes * len(layer.top) if len(shapes) == 1 else shapes
        layer.type = "Input"
        layer.ClearField("dummy_data_param")
        for shape in shapes:
            layer.input_param.shape.add().dim.extend(shape)
    return net


def with_dropout_off(net):
    """A copy of `net` whose Dropout layers have dropout_ratio 0 (Caffe's Dropout in TRAIN is then the identity),
    and the names of the layers switched off: each backend draws its own masks, so a training comparison with
    them on compares two draws."""
    net = copy.deepcopy(net)
    names = []
    for layer in net.layer:
        if layer.type == "Dropout" and layer.dropout_param.dropout_ratio != 0:
            layer.dropout_param.dropout_ratio = 0
            names.append(layer.name)
    return net, names


def batch_source(model, phase):
    """Real batches when every data layer's source exists, else seeded synthetic ones."""
    data = sourced(model)
    if data and all(os.path.exists(source_of(layer.param)) for layer in data):
        return PipelineBatches(model, phase), "/".join(sorted({layer.type for layer in data}))
    return engine.SyntheticBatches(model, SEED), "synthetic"


def images(batch, model):
    """Images in one batch: the first fed top's batch axis."""
    shapes = list(model.feeds.values())
    return shapes[0][0] if shapes and shapes[0] else 1


# -- differences ----------------------------------------------------------------------


def difference(a, b):
    """(max absolute difference, that over the larger of the two max magnitudes)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf"), float("inf")
    finite = np.isfinite(a) & np.isfinite(b)
    if np.any(np.isfinite(a) != np.isfinite(b)) or np.any(a[~finite] != b[~finite]) \
            and not np.all(np.isnan(a[~finite]) & np.isnan(b[~finite])):
        return float("inf"), float("inf")  # inf or NaN in one backend and not the other
    a, b = a[finite], b[finite]
    if a.size == 0:
        return 0.0, 0.0
    absolute = float(np.max(np.abs(a - b)))
    scale = max(float(np.max(np.abs(a))), float(np.max(np.abs(b))))
    return absolute, (absolute / scale if scale > 0 else absolute)


def nudged(batch, seed=SEED):
    """`batch` (a dict of arrays, or a list of them) with each value multiplied by 1 + NUDGE * u, u uniform in
    [0, 1) and seeded: upwards only, so that an integer label keeps its integer part (Caffe truncates it)."""
    if not isinstance(batch, dict):
        return [nudged(part, seed + i) for i, part in enumerate(batch)]
    rng = np.random.default_rng(seed)
    return {top: (np.asarray(array, np.float64) * (1 + NUDGE * rng.random(np.shape(array)))).astype(np.float32)
            for top, array in batch.items()}


def allowed(tolerance, floor):
    """The largest relative difference a blob may show: the tolerance above NOISE_MARGIN times its noise floor."""
    return tolerance + NOISE_MARGIN * floor


def excess(relative, floor):
    """How far a relative difference lies above NOISE_MARGIN times its noise floor: what the tolerance bounds."""
    return relative - NOISE_MARGIN * floor


def param_blobs(graph):
    """Each parameter blob in Caffe's order as (name, the indices of its layer's blobs): the name `layer[k]`,
    pycaffe's net.params[layer][k] (a shared blob by its first owner)."""
    blobs = [None] * len(graph.params)
    for layer in graph.layers:
        for k, index in enumerate(layer.blob_params):
            blobs[index] = blobs[index] or (f"{layer.name}[{k}]", list(layer.blob_params))
    return blobs


def weight_difference(reference, other, blobs):
    """(worst relative difference, its blob's name, its absolute difference) between two parameter lists in Caffe's
    blob order; blobs: param_blobs'. A blob's largest absolute difference is taken relative to the largest
    magnitude of its layer's blobs: a bias a step has just moved from 0 holds values near 0, and the float32
    rounding of its gradient's sum, relative to them, says nothing of the layer. The first blob's on a tie;
    (0.0, None, 0.0) for a net without parameters."""
    worst = (0.0, None, 0.0)
    for (name, _), (relative, absolute) in zip(blobs, blob_differences(reference, other, blobs)):
        if worst[1] is None or relative > worst[0]:
            worst = (relative, name, absolute)
    return worst


def blob_differences(reference, other, blobs):
    """[(relative, absolute) difference] of each parameter blob, as weight_difference measures it."""
    def magnitude(array):
        array = np.abs(np.asarray(array, np.float64))
        array = array[np.isfinite(array)]
        return float(np.max(array)) if array.size else 0.0

    magnitudes = [max(magnitude(a), magnitude(b)) for a, b in zip(reference, other, strict=True)]
    result = []
    for (_, layer), a, b in zip(blobs, reference, other, strict=True):
        absolute = difference(a, b)[0]
        scale = max(magnitudes[i] for i in layer)
        result.append((absolute / scale if scale > 0 and np.isfinite(absolute) else absolute, absolute))
    return result


# -- the runs -----------------------------------------------------------------------------


def build(backends, net, solver_param=None, phase=pb.TEST, source=None, batch_size=None, data_shape=None,
          weights=None, seed=None, out=None, stages=None):
    """{backend: Model}, all holding the same parameters: the weights file's, else the first's fillers,
    with Caffe's xavier filler for any weight blob the prototxt leaves constant (a deploy net without
    fillers is all zeros, and every difference then says 0); `out` is told which.

    seed: the fillers' (default: the solver's random_seed when set, else SEED).
    """
    if seed is None:
        seed = (random_seed(solver_param) if solver_param is not None else None)
        seed = SEED if seed is None else seed
    models = {}
    for name in backends:
        models[name] = create_model(name, net, solver_param, phase=phase, source=source, batch_size=batch_size,
                                    data_shape=data_shape, seed=seed, stages=stages)
    first = models[backends[0]]
    params = first.get_params()
    if weights:
        params = checkpoint.weights_for(first.graph, checkpoint.read_caffemodel(weights), params, weights)
    else:
        params = unit_batch_norm(first, xavier_where_constant(first, params, seed, out))
    for model in models.values():
        model.set_params(params)
    return models


def xavier_where_constant(model, params, seed, out=None):
    """The parameters with each learned weight blob (a layer's first) that its fillers left constant
    filled instead by Caffe's xavier filler, seeded; `out` gets a line naming those layers."""
    params, filled = list(params), []
    xavier = pb.FillerParameter(type="xavier")
    for layer in model.graph.layers:
        indices = layer.blob_params
        if not indices or not spec(layer.type).learned:
            continue
        first = indices[0]
        weights = params[first]
        if weights.ndim >= 2 and weights.size > 1 and np.ptp(weights) == 0:
            params[first] = fill(xavier, weights.shape, np.random.default_rng([seed, first]))
            filled.append(layer.name)
    if filled and out is not None:
        out.write(f"no weight filler in the prototxt for {', '.join(filled)}: Caffe's default would leave them "
                  f"constant, so they are filled with Caffe's xavier filler (seed {seed}); give --weights to "
                  "compare trained weights\n")
    return params


def unit_batch_norm(model, params):
    """Untrained BatchNorm (and BatchNormKyle) statistics as mean 0, variance 1 (the fillers' zeros make a
    TEST pass divide by sqrt(eps), which overflows a deep net to inf)."""
    params = list(params)
    for layer in model.graph.layers:
        if layer.type in ("BatchNorm", "BatchNormKyle"):
            mean, variance, factor = layer.blob_params[:3]
            params[mean] = np.zeros_like(params[mean])
            params[variance] = np.ones_like(params[variance])
            params[factor] = np.ones_like(params[factor])
    return params


def compare_forward(models, batches, repeats=TIMING_REPEATS, floors=None, twin=None):
    """Forward each model on one batch: ({backend: images/s}, [(blob, shape, {backend: (abs, rel)}, constant)]).

    Differences are against the first backend; constant: the first backend's blob holds one value only.
    floors: a dict to fill with each blob's noise floor, the first backend against itself on the batch nudged,
    run by `twin` (a fresh model of the first backend: a recurrent layer carries its hidden state from pass to
    pass, so the first's own next pass would start elsewhere).
    """
    names = list(models)
    batch = batches.next_batch()
    outputs, speed = {}, {}
    for name, model in models.items():
        outputs[name] = model.forward(batch)  # also the warm-up (tracing, allocation)
        started = time.perf_counter()
        for _ in range(repeats):
            model.forward(batch)
        speed[name] = repeats * images(batch, model) / (time.perf_counter() - started)
    rows = []
    reference = outputs[names[0]]
    if floors is not None:
        again = (twin or models[names[0]]).forward(nudged(batch))
        floors.update((blob, difference(value, again[blob])[1]) for blob, value in reference.items())
    for blob, value in reference.items():
        diffs = {name: difference(value, outputs[name].get(blob, np.full(1, np.nan))) for name in names[1:]}
        constant = np.size(value) > 1 and bool(np.all(np.asarray(value) == np.ravel(value)[0]))
        rows.append((blob, tuple(np.shape(value)), diffs, constant))
    return speed, rows


def training_plan(model, batches, iterations):
    """The batches of `iterations` steps (a list of iter_size dicts when iter_size > 1)."""
    plan = [[batches.next_batch() for _ in range(model.iter_size)] for _ in range(iterations)]
    return [b[0] if len(b) == 1 else b for b in plan]


def compare_training(models, plan):
    """Train each model through `plan` from its current state: ({backend: images/s}, {backend: [loss]})."""
    first = next(iter(models.values()))
    losses, speed = {}, {}
    per_step = images(None, first) * first.iter_size
    for name, model in models.items():
        losses[name], started = [], None
        for i, batch in enumerate(plan):
            if i == 1:
                started = time.perf_counter()  # the first step traces / allocates
            losses[name].append(float(model.step(batch)))
        elapsed = time.perf_counter() - started if started else float("nan")
        speed[name] = (len(plan) - 1) * per_step / elapsed if len(plan) > 1 else float("nan")
    return speed, losses


def compare_steps(models, plan, params, state, twin=None):
    """Each iteration from the first backend's exact state: {backend: [(loss rel, weights rel, blob, floor)]},
    the weights' those of the blob furthest above its noise floor (blob_differences; the floor: the first
    backend's own step on the batch nudged, against its step) and `blob` its name. twin: a second model of
    the first backend that takes the nudged steps (a recurrent layer's hidden state, carried from pass to
    pass, then follows the first's); without it the first takes them, and is set back after each.

    Starting every backend's step from the same weights and history separates
    a difference in one step (a bug) from float32 rounding that free-running
    training amplifies (a ReLU input or max-pool pair within rounding of a tie
    goes one way on one backend and the other way on the other).
    """
    names = list(models)
    reference = models[names[0]]
    blobs = param_blobs(reference.graph)
    reference.set_params(params)
    reference.set_state(state)
    steps = {name: [] for name in names[1:]}
    for batch in plan:
        params, state = reference.get_params(), reference.get_state()
        loss = reference.step(batch)
        after, after_state = reference.get_params(), reference.get_state()
        floors = [relative for relative, _ in blob_differences(after, step_from(twin or reference, params, state,
                                                                                nudged(batch)), blobs)]
        if twin is None:
            reference.set_params(after)
            reference.set_state(after_state)
        for name in names[1:]:
            losses = []
            relatives = blob_differences(after, step_from(models[name], params, state, batch, losses), blobs)
            worst = max(range(len(blobs)), key=lambda i: excess(relatives[i][0], floors[i]), default=None)
            row = (relatives[worst][0], blobs[worst][0], floors[worst]) if worst is not None else (0.0, None, 0.0)
            steps[name].append((abs(losses[0] - loss) / max(abs(loss), 1e-12),) + row)
    return steps


def step_from(model, params, state, batch, losses=None):
    """`model`'s parameters after one step on `batch` from `params` and solver `state`; its loss appended to
    `losses` where given."""
    model.set_params(params)
    model.set_state(state)
    loss = model.step(batch)
    if losses is not None:
        losses.append(loss)
    return model.get_params()


def loss_differences(losses):
    """Per iteration, the absolute difference of each later backend's loss to the first's.

    Absolute, as the loss tolerance is stated (the forward tolerance is the relative one).
    """
    names = list(losses)
    reference = np.asarray(losses[names[0]], np.float64)
    return {name: np.abs(np.asarray(losses[name], np.float64) - reference) for name in names[1:]}


# -- the command ------------------------------------------------------------------------


def _table(rows, out):
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(str(cell).rjust(w) if i else str(cell).ljust(w)
                            for i, (cell, w) in enumerate(zip(row, widths))).rstrip() + "\n")


def run(model_path, weights=None, solver_path=None, out=sys.stdout, data_shape=None, **options):
    """The comparison `deepspark compare` prints; returns a dict of results with 'ok'.

    options: CompareParameter fields by name (backends as a comma-separated string or a
    list, iterations, batch_size, forward_tolerance, loss_tolerance, weight_tolerance). data_shape: (C, H, W)
    of the data layers whose source is absent, as `describe --data-shape` takes it. With a
    solver, the forward pass is the TEST phase of its first test net's state (test_state stages).
    """
    if isinstance(options.get("backends"), (list, tuple)):
        options["backends"] = ",".join(options["backends"])
    param = set_fields(pb.CompareParameter(), options)
    backends = [name.strip() for name in param.backends.split(",") if name.strip()]
    if len(backends) < 2:
        raise ConfigError(f"--backends needs at least two backends, got {','.join(backends) or 'none'}")
    unknown = [name for name in backends if name not in BACKENDS]
    if unknown:
        raise ConfigError(f"unknown backend '{unknown[0]}'; supported: {', '.join(sorted(BACKENDS))}")
    if "caffe" in backends:
        backend_module("caffe")  # pycaffe before TensorFlow: its protobuf symbols stay its own
    batch_size = param.batch_size or None
    result = {"model": model_path, "backends": backends, "ok": True}
    path = net_path(model_path)
    net, source = load_net(path)
    solver = load_solver(solver_path) if solver_path else None
    stages = list(solver.test_nets[0][2].stage) if solver and solver.test_nets else None
    finder = shape_finder(path, data_shape)
    net = with_batch_size(with_dummy_data_fed(net), batch_size)
    net = with_taps(net, Graph(net, pb.TEST, stages=stages, source=source, data_shape=finder, batch_size=batch_size))
    compare_forward_pass(out, result, backends, net, path, batch_size, weights, param.forward_tolerance, source,
                         finder, stages)
    if solver:
        compare_training_run(out, result, backends, solver, path, batch_size, weights, param.iterations,
                             param.loss_tolerance, data_shape, param.weight_tolerance)
    out.write("OK: within tolerance\n" if result["ok"] else "FAILED: differences exceed tolerance\n")
    return result


def compare_forward_pass(out, result, backends, net, path, batch_size, weights, forward_tolerance, source=None,
                         finder=None, stages=None):
    """The forward table: every blob of every other backend against the first; fills result["forward"]."""
    options = dict(source=source, batch_size=batch_size, data_shape=finder or shape_finder(path), stages=stages)
    models = build(backends, net, None, pb.TEST, weights=weights, out=out, **options)
    twin = twin_of(models[backends[0]], backends[0], net, None, pb.TEST, **options)
    try:
        batches, kind = batch_source(models[backends[0]], pb.TEST)
        floors = {}
        try:
            speed, rows = compare_forward(models, batches, floors=floors, twin=twin)
        finally:
            batches.close()
        others = backends[1:]
        out.write(f"forward, TEST phase: {path} ({kind} data, batch {images(None, models[backends[0]])}; "
                  f"differences against {backends[0]}, tolerance {forward_tolerance:g} relative above "
                  f"{NOISE_MARGIN} x the noise floor, {backends[0]} against itself on the batch nudged by {NUDGE:g})\n")
        table = [("blob", "shape", "floor") + tuple(h for name in others for h in (f"{name} max abs", f"{name} rel"))]
        worst, worst_floor = 0.0, 0.0
        for blob, shape, diffs, _ in rows:
            cells = []
            for name in others:
                absolute, relative = diffs[name]
                relative = relative if not np.isnan(relative) else float("inf")
                if excess(relative, floors[blob]) > excess(worst, worst_floor):
                    worst, worst_floor = relative, floors[blob]
                cells += [f"{absolute:.3g}", f"{relative:.3g}"]
            table.append((blob, "x".join(map(str, shape)) or "scalar", f"{floors[blob]:.3g}", *cells))
        _table(table, out)
        constant = [blob for blob, _, _, same in rows if same]
        if constant:
            out.write(f"warning: {', '.join(constant)} hold one value on {backends[0]} (a constant output): "
                      "their differences say little\n")
        blobs = {blob: {name: diffs[name] for name in others} for blob, _, diffs, _ in rows}
        _verdict(out, result, "forward", {"blobs": blobs, "worst_relative": worst, "floors": floors}, speed, worst,
                 allowed(forward_tolerance, worst_floor), "FORWARD DIFFERS: worst relative difference")
    finally:
        close_all({**models, "twin": twin})


def twin_of(model, backend, net, solver_param, phase, **options):
    """A second model of `backend` holding `model`'s parameters: what measures the noise floors (create_model's
    options: source, batch_size, data_shape, stages)."""
    twin = create_model(backend, net, solver_param, phase=phase, **options)
    twin.set_params(model.get_params())
    return twin


def compare_training_run(out, result, backends, solver, path, batch_size, weights, iterations, loss_tolerance,
                         data_shape=None, weight_tolerance=pb.CompareParameter().weight_tolerance):
    """The training table: each backend's loss at each iteration from the same weights and batches, and each
    step's weights from the same state; fills result["training"]."""
    others = backends[1:]
    solver_path = solver.path
    train_net, dropped = with_dropout_off(with_batch_size(with_dummy_data_fed(solver.train_net), batch_size))
    options = dict(source=solver.train_map, batch_size=batch_size, stages=list(solver.param.train_state.stage) or None,
                   data_shape=shape_finder(solver.param.net or solver.param.train_net or path, data_shape))
    models = build(backends, train_net, solver.param, pb.TRAIN, weights=weights, **options)
    twin = twin_of(models[backends[0]], backends[0], train_net, solver.param, pb.TRAIN, **options)
    try:
        first = models[backends[0]]
        batches, kind = batch_source(first, pb.TRAIN)
        try:
            plan = training_plan(first, batches, iterations)
        finally:
            batches.close()
        params, state = first.get_params(), first.get_state()
        speed, losses = compare_training(models, plan)
        twin.set_state(state)
        for batch in plan:  # as the first did: a recurrent layer's carried hidden state then is the first's
            twin.step(batch)
        steps = compare_steps(models, plan, params, state, twin)
        diffs = loss_differences(losses)
        out.write(f"\ntraining: {solver_path}, {iterations} iterations ({kind} data, batch "
                  f"{images(None, models[backends[0]])}; loss tolerance {loss_tolerance:g} absolute, weight "
                  f"tolerance {weight_tolerance:g} relative above {NOISE_MARGIN} x the noise floor)\n")
        if dropped:
            out.write(f"compare: Dropout switched off in layers {', '.join(dropped)} (each backend draws its own "
                      "masks)\n")
        out.write("(diff: free-running absolute loss difference; step: one step from the same weights and "
                  f"history, loss and weights relative difference; floor: that blob's, {backends[0]}'s own step on "
                  f"the batch nudged by {NUDGE:g})\n")
        table = [("iter",) + tuple(f"{name} loss" for name in backends)
                 + tuple(h for name in others for h in (f"{name} diff", "step loss", "step weights", "floor"))]
        for i in range(iterations):
            table.append((i,) + tuple(f"{losses[name][i]:.6f}" for name in backends)
                         + tuple(f"{cell:.3g}" for name in others for cell in
                                 (diffs[name][i], steps[name][i][0], steps[name][i][1], steps[name][i][3])))
        _table(table, out)
        worst_loss = max((float(np.max(d)) if len(d) else 0.0 for d in diffs.values()), default=0.0)
        if not np.isfinite(worst_loss):
            worst_loss = float("inf")
        worst_step = max((max(row[0] for row in rows) for rows in steps.values() if rows), default=0.0)
        weights_at = worst_weights(steps)
        _verdict(out, result, "training", {"losses": losses, "worst_absolute": worst_loss, "steps": steps,
                                           "worst_step_relative": worst_step, "worst_weights": weights_at,
                                           "dropout_off": dropped}, speed, worst_loss, loss_tolerance,
                 "LOSS DIFFERS: worst absolute difference",
                 f"worst loss difference: free-running {worst_loss:.3g}, one step from the same state {worst_step:.3g}",
                 weights_line(weights_at))
        judge_weights(out, result, weights_at, weight_tolerance)
    finally:
        close_all({**models, "twin": twin})


def worst_weights(steps):
    """The blob furthest above its noise floor over every step and backend of compare_steps' rows: {"relative",
    "blob", "iteration", "backend", "floor"} (relative 0.0 and blob None where no step was compared)."""
    worst = {"relative": 0.0, "blob": None, "iteration": None, "backend": None, "floor": 0.0}
    for backend, rows in steps.items():
        for i, (_, relative, blob, *floor) in enumerate(rows):
            floor = floor[0] if floor else 0.0
            if worst["blob"] is None or excess(relative, floor) > excess(worst["relative"], worst["floor"]):
                worst = {"relative": relative, "blob": blob, "iteration": i, "backend": backend, "floor": floor}
    return worst


def weights_line(worst):
    where = f" ({worst['blob']} on {worst['backend']}, iteration {worst['iteration']})" if worst["blob"] else ""
    return (f"worst weight difference one step from the same state: {worst['relative']:.3g} relative{where}"
            f"{floor_words(worst.get('floor', 0.0))}")


def floor_words(floor):
    """How a line names a blob's noise floor (nothing where it has none)."""
    return f", noise floor {floor:.3g}" if floor else ""


def judge_weights(out, result, worst, tolerance):
    """The failure line, naming the blob, when a step's weights differ by more than `tolerance` (relative) above
    NOISE_MARGIN times the blob's noise floor."""
    floor = worst.get("floor", 0.0)
    if worst["blob"] is not None and worst["relative"] > allowed(tolerance, floor):
        result["ok"] = False
        beyond = f" + {NOISE_MARGIN} x noise floor {floor:.3g}" if floor else ""
        out.write(f"WEIGHTS DIFFER: {worst['blob']} on {worst['backend']} after the step of iteration "
                  f"{worst['iteration']}, relative difference {worst['relative']:.3g} > {tolerance:g}{beyond}\n")


def _verdict(out, result, part, record, speed, worst, tolerance, failure, *lines):
    """The images/s line and `lines`; result[part] = record with the speeds; the failure line when `worst`
    exceeds `tolerance`."""
    for line in ("images/s: " + ", ".join(f"{name} {value:.1f}" for name, value in speed.items()), *lines):
        out.write(line + "\n")
    result[part] = {**record, "images_per_second": speed}
    if worst > tolerance:
        result["ok"] = False
        out.write(f"{failure} {worst:.3g} > {tolerance:g}\n")


def close_all(models):
    engine.close_all(models.values())
