"""The engine every run shares: a Trainer (Caffe's Solver::Solve) and an Evaluator (Caffe's Test) over a built model and its batches.

The engine knows the backend contract (deepspark.backends.base.Model) and
anything with `next_batch()` and `close()` as a batch source, but builds
neither: deepspark.nets builds them (for the one-process verbs, every Spark
worker and the driver's test nets) and hands them in. `Cadence` is Caffe's
display/test/snapshot arithmetic, which a Trainer and a Spark job's driver
share; `write_snapshot` is Caffe's Snapshot, which both write with.
`benchmark` is Caffe's `time` loop, written once over the per-layer passes
every backend hands it.
"""

import collections
import dataclasses
import gc
import logging
import time

import numpy as np

from deepspark import checkpoint, detection_eval, graph, progress, schedule
from deepspark.errors import ConfigError

log = logging.getLogger(__name__)


def next_batch(feeders):
    """One batch {top: array} from every feeder of a net."""
    batch = {}
    for feeder in feeders:
        batch.update(feeder.next_batch())
    return batch


def close_all(closables):
    for item in closables:
        item.close()


def copy_weights(source_graph, arrays, target_graph, initial):
    """Caffe's ShareTrainedLayersWith: parameters copied by layer name from one net to another."""
    return checkpoint.weights_for(target_graph, checkpoint.layer_blobs(source_graph, arrays), initial)


class SyntheticBatches:
    """Seeded random batches for a model's fed tops: normal images, and integer labels below each
    labelled layer's class count (for timing and comparing without data)."""

    def __init__(self, model, seed=0):
        self.feeds = model.feeds
        self.classes = label_classes(model.graph)
        self.rng = np.random.default_rng(seed)

    def next_batch(self):
        batch = {}
        for top, shape in self.feeds.items():
            if top in self.classes:
                batch[top] = self.rng.integers(0, self.classes[top], shape).astype(np.float32)
            else:
                batch[top] = self.rng.standard_normal(shape).astype(np.float32)
        return batch

    def close(self):
        pass


def label_classes(net):
    """{top: number of classes} for the tops a loss or accuracy layer of `net` (a graph.Graph) reads as labels."""
    classes = {}
    for layer in net.layers:
        if layer.type in graph.LABELLED_TYPES and len(layer.bottoms) > 1:
            shape = layer.bottom_shapes[0]
            n = shape[1] if len(shape) > 1 else 2
            label = layer.bottoms[1]
            classes[label] = min(classes.get(label, n), n)
    return classes


def score(model, feeders, iterations, logged=False):
    """Mean of every output over `iterations` batches; with `logged`, logged as Caffe's `Test net output #j`."""
    sums = collections.OrderedDict()
    for _ in range(iterations):
        for name, value in model.forward(next_batch(feeders)).items():
            value = np.asarray(value, np.float64)
            sums[name] = sums[name] + value if name in sums else value
    means = collections.OrderedDict((name, total / max(iterations, 1)) for name, total in sums.items())
    if logged:
        log_outputs(model.graph, means, "    Test net output #{index}: ")
    return means


def detection_score(model, feeders, iterations, ap_version):
    """The fork's TestDetection (eval_type "detection"): each output's mAP over `iterations` batches of
    DetectionEvaluate rows (deepspark.detection_eval.pass_map), logged as its `Test net output #j` lines."""
    means = detection_eval.pass_map([model.forward(next_batch(feeders)) for _ in range(iterations)], ap_version)
    log_outputs(model.graph, means, "    Test net output #{index}: ")
    return means


def log_outputs(net, means, prefix):
    """One line per output value, with Caffe's `(* weight = weighted loss)` for loss outputs; outputs in
    Caffe's order, by name (Net::Init collects them in a std::set)."""
    weights = {top: w for layer in net.layers for top, w in zip(layer.tops, layer.loss_weights)}
    index = 0
    for name, mean in sorted(means.items()):
        for value in np.ravel(mean):
            suffix = f" (* {weights[name]:g} = {weights[name] * value:g} loss)" if weights.get(name) else ""
            log.info(prefix.format(index=index) + f"{name} = {value:g}{suffix}")
            index += 1


def first_values(results):
    """{"test<i>/<output>": first value} of Evaluator.test's results: the run's summary and scalars."""
    return {f"test{i}/{name}": float(np.ravel(mean)[0]) for i, means in enumerate(results)
            for name, mean in means.items()}


def entry(started, iteration, loss, values=None):
    """A history entry: {"iteration", "seconds" since `started` (time.monotonic()), "loss", test output: value}."""
    return {"iteration": iteration, "seconds": time.monotonic() - started, "loss": loss, **(values or {})}


def test_entries(started, iteration, results):
    """The history entries of a test (Evaluator.test's results), one per test net as the log has a `Testing net`
    line for each, with each output as its line says it (a many-valued output: its last line's)."""
    return [entry(started, iteration, float("nan"),
                  {f"test{i}/{name}": float(f"{np.ravel(mean)[-1]:g}") for name, mean in means.items()})
            for i, means in enumerate(results)]


def outputs(entry):
    """A history entry's test outputs: {name: value}."""
    return {name: value for name, value in entry.items() if name not in ("iteration", "seconds", "loss")}


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a training job gives back, whatever its algorithm. summary: {"iterations", "weights" (the final
    .caffemodel, if snapshotted), "wall_seconds", "test<i>/<output>": value; a Spark job's also "spill_seconds",
    "ready_seconds", "train_seconds", "startup_seconds" (from the Solving line to the slowest worker's first step),
    "workers" (each worker's Summary as a dict)}; history: the displays and tests as the log gave them (entry's
    and test_entries'); final_test: the final model's test outputs (those of the summary); weights: the final
    arrays in Caffe's order, [(layer name, [blobs])] (checkpoint.layer_blobs), as the final snapshot holds them;
    snapshots: [(caffemodel, solverstate)] written; started: time.monotonic() as the job started."""

    summary: dict
    output: str
    history: tuple = ()
    final_test: dict = dataclasses.field(default_factory=dict)
    weights: tuple = ()
    snapshots: tuple = ()
    started: float = None


@dataclasses.dataclass
class Timing:
    """What `caffe time` reports, in milliseconds: [(layer, forward, backward)] means, and per pass."""

    layers: list
    forward: float  # Average Forward pass
    backward: float  # Average Backward pass
    total: float  # Total Time: iterations x Average Forward-Backward
    iterations: int

    @property
    def forward_backward(self):
        return self.total / self.iterations


def benchmark(passes, loss, iterations):
    """Caffe's `caffe time` (tools/caffe.cpp, time()) over a model's layer_passes, logged in its lines; a Timing.

    One Forward and one Backward first, untimed, where a backend compiles
    and allocates; then `iterations` times every layer's forward in order and
    every backward in reverse, each layer timed alone and each pass whole.
    Total Time runs from `Benchmark begins` to the end of the last
    iteration, so it is iterations x Average Forward-Backward; a pass is
    the sum of its layers plus the loop's own microseconds.
    """
    if iterations < 1:
        raise ValueError(f"time needs at least one iteration, not {iterations}")
    log.info("Performing Forward")
    for layer in passes:
        layer.forward()
    log.info(f"Initial loss: {loss():g}")
    log.info("Performing Backward")
    for layer in reversed(passes):
        layer.backward()
    log.info("*** Benchmark begins ***")
    log.info(f"Testing for {iterations} iterations.")
    clock = time.perf_counter
    forwards = list(enumerate(layer.forward for layer in passes))
    backwards = list(enumerate(layer.backward for layer in passes))[::-1]
    forward_layers, backward_layers = [0.0] * len(passes), [0.0] * len(passes)
    forward_pass = backward_pass = 0.0
    started = clock()
    for j in range(iterations):
        began = clock()
        for i, run in forwards:
            at = clock()
            run()
            forward_layers[i] += clock() - at
        middle = clock()
        for i, run in backwards:
            at = clock()
            run()
            backward_layers[i] += clock() - at
        ended = clock()
        forward_pass += middle - began
        backward_pass += ended - middle
        log.info(f"Iteration: {j + 1} forward-backward time: {(ended - began) * 1000:g} ms.")
    total = (clock() - started) * 1000
    per = 1000 / iterations
    rows = [(layer.name, f * per, b * per) for layer, f, b in zip(passes, forward_layers, backward_layers)]
    log.info("Average time per layer: ")
    for name, forward, backward in rows:
        log.info(f"{name:>10}\tforward: {forward:g} ms.")
        log.info(f"{name:>10}\tbackward: {backward:g} ms.")
    timing = Timing(rows, forward_pass * per, backward_pass * per, total, iterations)
    log.info(f"Average Forward pass: {timing.forward:g} ms.")
    log.info(f"Average Backward pass: {timing.backward:g} ms.")
    log.info(f"Average Forward-Backward: {timing.forward_backward:g} ms.")
    log.info(f"Total Time: {timing.total:g} ms.")
    log.info("*** Benchmark ends ***")
    return timing


class Evaluator:
    """The solver's test nets, Caffe's Test(): each scores parameters over its test_iter batches.

    nets: [(model, feeders, iterations)], one per test net, built by the caller; ap_version: the solver's where
    its eval_type is "detection" (detection_eval.ap_version_of), each output's mAP then instead of its mean.
    """

    def __init__(self, nets, ap_version=None):
        self.nets, self.ap_version = list(nets), ap_version

    def test(self, iteration, source_graph, arrays):
        """Score `arrays` (in `source_graph`'s parameter order); log and return [{output: mean value}] per net."""
        results = []
        for i, (model, feeders, iterations) in enumerate(self.nets):
            log.info(f"Iteration {iteration}, Testing net (#{i})")
            model.set_params(copy_weights(source_graph, arrays, model.graph, model.get_params()))
            results.append(score(model, feeders, iterations, logged=True) if self.ap_version is None
                           else detection_score(model, feeders, iterations, self.ap_version))
        return results

    def close(self):
        for model, feeders, _ in self.nets:
            close_all(feeders)
            model.close()


def next_multiple(iteration, interval, include_current=False):
    """The first multiple of `interval` after `iteration` (or at it, with include_current); inf for 0."""
    if not interval:
        return float("inf")
    if include_current and iteration % interval == 0:
        return iteration
    return (iteration // interval + 1) * interval


def last_multiple(iteration, interval, start):
    """The last multiple of `interval` at or before `iteration`, never before the run's start."""
    return max(iteration - iteration % interval, start)


class Cadence:
    """Caffe's Solver cadence: which iterations display, test and snapshot, and the learning rate shown.

    A Trainer sees every iteration and asks of each (`displays`, `tests`, `snapshots`). The
    driver of a Spark job sees the job's iteration now and then, past multiples
    perhaps, and asks what has come due since it last asked (`*_due`, from `start` on).
    """

    def __init__(self, param, start=0):
        self.param, self.start = param, start
        self.next_display = next_multiple(start, param.display)
        self.next_test = next_multiple(start, param.test_interval, param.test_initialization)
        self.next_snapshot = next_multiple(start, param.snapshot)

    def displays(self, iteration):
        return bool(self.param.display) and iteration % self.param.display == 0

    def tests(self, iteration):
        """Caffe's Solver tests `iteration` when it is a test_interval multiple (no test_interval, no test); its
        loop skips iteration 0 unless test_initialization, the end of Solve tests the last on this rule alone."""
        return bool(self.param.test_interval) and iteration % self.param.test_interval == 0

    def snapshots(self, iteration):
        return bool(self.param.snapshot) and iteration % self.param.snapshot == 0

    def learning_rate(self, iteration):
        """The learning rate a worker uses at `iteration` (multistep's counter derived, not carried)."""
        param = self.param
        return schedule.learning_rate(param, iteration, sum(iteration >= v for v in param.stepvalue))[0]

    def display_due(self, iteration):
        """A display multiple has come due by the watched `iteration` (and the next one is set)."""
        if iteration < self.next_display:
            return False
        self.next_display = next_multiple(iteration, self.param.display)
        return True

    def test_due(self, iteration):
        """The test_interval multiple a test due by the watched `iteration` carries, or None."""
        if iteration < self.next_test:
            return None
        self.next_test = next_multiple(iteration, self.param.test_interval)
        return last_multiple(iteration, self.param.test_interval, self.start)

    def snapshot_due(self, iteration):
        """The snapshot multiple a snapshot due by the watched `iteration` carries, or None."""
        if iteration < self.next_snapshot:
            return None
        self.next_snapshot = next_multiple(iteration, self.param.snapshot)
        return last_multiple(iteration, self.param.snapshot, self.start)

    def steps_from(self, iteration, period):
        """Steps from `iteration` to the end of a round of at most `period`: rounds end where training stops
        (schedule.stop_iteration) and at the next test and snapshot multiples, so that those fall on their
        iterations."""
        return int(min(period, schedule.stop_iteration(self.param) - iteration, self.next_test - iteration,
                       self.next_snapshot - iteration))


def hdf5_snapshots(param):
    """Whether the solver's snapshots are HDF5 (snapshot_format: HDF5) rather than binary protos."""
    return param.snapshot_format == param.HDF5


def write_snapshot(prefix, iteration, net, arrays, solver_state, hdf5=False):
    """Caffe's Snapshot: `<prefix>_iter_N.caffemodel` of `arrays` (in `net`'s parameter order), then the
    .solverstate that names it (with hdf5, each an HDF5 file ending in .h5), each logged as Caffe logs it.
    solver_state(model path) gives (the SolverState, what its line adds). Returns both paths."""
    model_path, state_path = checkpoint.snapshot_paths(prefix, iteration, hdf5)
    log.info(f"Snapshotting to {checkpoint.snapshot_words(model_path)} {model_path}")
    checkpoint.save_caffemodel(model_path, net, arrays)
    state, note = solver_state(model_path)
    log.info(f"Snapshotting solver state to {checkpoint.snapshot_words(state_path)} {state_path}{note}")
    checkpoint.save_solverstate(state_path, state)
    return model_path, state_path


class Trainer:
    """One training process: a model, the batches of its shard, Caffe's display/test/snapshot cadence.

    solver: the config.Solver; model: a backend model of its train net; feeders:
    the train net's batch sources; evaluator: the test nets, or None.
    """

    def __init__(self, solver, model, feeders, evaluator=None):
        self.solver, self.param = solver, solver.param
        self.model, self.feeders, self.evaluator = model, list(feeders), evaluator
        self.losses = collections.deque(maxlen=max(self.param.average_loss, 1))
        self._heap_frozen = False
        # (time.time() when it was done, seconds it took) of this trainer's first step, where a backend traces
        # and compiles: the last part of a worker's start-up.
        self.first_step = None
        # Called with (trainer, loss) after every step, before anything uses the loss (a Spark worker's
        # divergence check; Caffe's own Solve goes on whatever the loss, and so does the single run).
        self.on_step = None
        # What solve() displayed and tested, as its lines say it (entry, test_entries), and the snapshots it
        # wrote [(caffemodel, solverstate)]: the single run's JobResult.
        self.history, self.snapshots, self.snapshotted, self.started = [], [], None, time.monotonic()

    def load_weights(self, path):
        log.info(f"Finetuning from {path}")
        blobs = checkpoint.read_caffemodel(path)
        self.model.set_params(checkpoint.weights_for(self.model.graph, blobs, self.model.get_params(), path))

    def restore(self, path):
        log.info(f"Restoring previous solver status from {path}")
        state = checkpoint.read_solverstate(path)
        learned = checkpoint.learned_net_path(state, path)
        if learned:
            self.load_weights(learned)
        try:
            self.model.set_state(state)
        except ValueError as error:
            raise ConfigError(f"solver state does not fit this net and solver: {error}", path) from None

    @property
    def iter(self):
        return self.model.iter

    def step(self):
        """One solver iteration on the next iter_size batches; returns the loss."""
        began = time.monotonic()
        batches = [next_batch(self.feeders) for _ in range(self.model.iter_size)]
        loss = float(self.model.step(batches[0] if len(batches) == 1 else batches))
        if self.first_step is None:
            self.first_step = (time.time(), time.monotonic() - began)
        if self.on_step is not None:
            self.on_step(self, loss)
        self.losses.append(loss)
        if not self._heap_frozen:
            # After the first step the backend is built and traced, and its hundreds of thousands of
            # objects live as long as the trainer: taken out of the cyclic collector's generations,
            # they are no longer walked by every full collection (which, with TensorFlow loaded, also
            # slowed PySpark's task launch in such a worker: docs/architecture.md has the figures).
            gc.freeze()
            self._heap_frozen = True
        return loss

    def get_state(self):
        """Everything a fresh Trainer of the same job and shard needs to go on exactly where this one is:
        {name: array} (the solver's history, each feeder's epoch order) and JSON-able metadata."""
        arrays = {f"history{i}": h for i, h in enumerate(self.model.get_history())}
        feeders = []
        for i, feeder in enumerate(self.feeders):
            meta, order = feeder.get_state()
            if order is not None:
                arrays[f"order{i}"] = order
            feeders.append(meta)
        return arrays, {"iter": self.model.iter, "current_step": self.model.current_step, "feeders": feeders}

    def set_state(self, arrays, meta):
        history = [arrays[f"history{i}"] for i in range(len(self.model.history_shapes))]
        self.model.set_history(history)
        self.model.iter, self.model.current_step = int(meta["iter"]), int(meta["current_step"])
        for i, (feeder, feeder_meta) in enumerate(zip(self.feeders, meta["feeders"], strict=True)):
            feeder.set_state(feeder_meta, arrays.get(f"order{i}"))

    @property
    def smoothed_loss(self):
        return float(np.mean(self.losses)) if self.losses else float("nan")

    def test_all(self):
        if self.evaluator:
            results = self.evaluator.test(self.iter, self.model.graph, self.model.get_params())
            self.history.extend(test_entries(self.started, self.iter, results))
            return results
        return []

    def display(self, iteration, shown=None):
        """Caffe's `Iteration N... loss = L` line (`shown`: what goes between N and the comma), in the history."""
        loss = self.smoothed_loss
        log.info(f"Iteration {iteration}{shown or ''}, loss = {loss:.6g}")
        self.history.append(entry(self.started, iteration, float(f"{loss:.6g}")))  # as the line says it

    def snapshot(self):
        def state_of(model_path):
            state = self.model.get_state()
            state.learned_net = model_path
            return state, ""

        paths = write_snapshot(self.param.snapshot_prefix or "snapshot", self.iter, self.model.graph,
                               self.model.get_params(), state_of, hdf5_snapshots(self.param))
        self.snapshots.append(paths)
        self.snapshotted = self.iter
        return paths

    def log_train_outputs(self, loss):
        """Caffe's display of the train net's outputs after a step: `Train net output #k: name = v`, with
        `(* w = v' loss)` for a loss; the step's loss alone where a backend cannot tell them."""
        outputs = self.model.train_outputs()
        if outputs is None:
            log.info(f"    Train net output #0: loss = {loss:.6g}")
        else:
            log_outputs(self.model.graph, outputs, "    Train net output #{index}: ")

    def solve(self):
        """Caffe's Solver::Solve: test every test_interval, display, snapshot; returns the last test results."""
        p, cadence = self.param, Cadence(self.param)
        stop = schedule.stop_iteration(p)
        log.info(f"Solving {self.model.graph.name}")
        log.info(f"Learning Rate Policy: {p.lr_policy or 'fixed'}")
        if schedule.stop_note(p):
            log.info(schedule.stop_note(p))
        self.started = started = time.monotonic()
        last_time, last_iter, results = started, self.iter, []
        shown = progress.display(1, stop, exchanges=False)
        while self.iter < stop:
            if cadence.tests(self.iter) and (self.iter > 0 or p.test_initialization):
                results = self.test_all()
            rate = self.model.learning_rate()
            iteration = self.iter
            loss = self.step()
            if cadence.displays(iteration):
                now = time.monotonic()
                speed = (iteration - last_iter) / (now - last_time) if now > last_time and iteration > last_iter else 0
                self.display(iteration, f" ({speed:.4g} iter/s)")
                self.log_train_outputs(loss)
                log.info(f"Iteration {iteration}, lr = {rate:.6g}")
                last_time, last_iter = now, iteration
            shown.draw({0: {"iteration": self.iter, "loss": self.smoothed_loss}})
            if cadence.snapshots(self.iter):
                self.snapshot()
        shown.close()
        if p.snapshot_after_train and not cadence.snapshots(self.iter):
            self.snapshot()
        if cadence.displays(self.iter):
            self.display(self.iter)
        if cadence.tests(self.iter):
            results = self.test_all()
        log.info("Optimization Done.")
        return results

    def close(self):
        close_all(self.feeders)
        if self.evaluator:
            self.evaluator.close()
        self.model.close()
        if self._heap_frozen:
            gc.unfreeze()  # what was frozen may be collected again once this trainer is gone
