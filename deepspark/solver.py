"""Caffe's Solver::Solve in one process (`deepspark train --algorithm single`) and the `test` verb."""

import collections
import gc
import os
import time

import numpy as np

from deepspark import checkpoint
from deepspark.backends import create_model
from deepspark.config import load_net, load_solver, random_seed
from deepspark.errors import ConfigError
from deepspark.data import DataFeeder, source_shape
from deepspark.log import Log, progress_bar
from deepspark.proto import deepspark_pb2 as pb


def data_shape(layer_param):
    """Data layers take their image shape from their LMDB."""
    return source_shape(layer_param)


def feeders_for(graph, phase, seed=None, shard=0, num_shards=1):
    """One DataFeeder per Data layer of the graph; other data layers need no feeding here."""
    feeders = []
    for layer in graph.layers:
        if layer.type in ("Input", "MemoryData"):
            raise ConfigError(f"layer '{layer.name}' ({layer.type}) has no data to train or test on; "
                              "use a Data layer reading an LMDB", *graph.source.where(layer.index))
        if layer.type == "Data":
            feeders.append(DataFeeder(layer.param, phase, shard=shard, num_shards=num_shards,
                                      seed=seed, batch_size=graph.context.batch_size))
    return feeders


def next_batch(feeders):
    batch = {}
    for feeder in feeders:
        batch.update(feeder.next_batch())
    return batch


def copy_weights(source_graph, arrays, target_graph, initial):
    """Caffe's ShareTrainedLayersWith: parameters copied by layer name from one net to another."""
    return checkpoint.weights_for(target_graph, checkpoint.layer_blobs(source_graph, arrays), initial)


class Evaluator:
    """The solver's test nets: each scores parameters over test_iter batches, Caffe's Test()."""

    def __init__(self, solver, backend, log, seed=None):
        self.solver, self.log = solver, log
        self.nets = []
        for (net, source, state), iterations in zip(solver.test_nets, solver.param.test_iter):
            model = create_model(backend, net, None, phase=pb.TEST, source=source, stages=list(state.stage),
                                 data_shape=data_shape, seed=seed)
            self.nets.append((model, feeders_for(model.graph, pb.TEST, seed=seed), iterations))

    def test(self, iteration, graph, arrays, test_index=None):
        """Score `arrays` (in `graph`'s parameter order); log and return [{output: mean value}] per net."""
        results = []
        for i, (model, feeders, iterations) in enumerate(self.nets):
            if test_index is not None and i != test_index:
                continue
            self.log.info(f"Iteration {iteration}, Testing net (#{i})")
            model.set_params(copy_weights(graph, arrays, model.graph, model.get_params()))
            results.append(score(model, feeders, iterations, self.log))
        return results

    def close(self):
        for _, feeders, _ in self.nets:
            for feeder in feeders:
                feeder.close()


def score(model, feeders, iterations, log=None):
    """Mean of every output over `iterations` batches; logged as Caffe's `Test net output #j`."""
    sums = collections.OrderedDict()
    for _ in range(iterations):
        for name, value in model.forward(next_batch(feeders)).items():
            value = np.asarray(value, np.float64)
            sums[name] = sums[name] + value if name in sums else value
    means = collections.OrderedDict((name, total / max(iterations, 1)) for name, total in sums.items())
    if log:
        log_outputs(log, model.graph, means, "    Test net output #{index}: ")
    return means


def log_outputs(log, graph, means, prefix):
    """One line per output value, with Caffe's `(* weight = weighted loss)` for loss outputs."""
    weights = {top: w for layer in graph.layers for top, w in zip(layer.tops, layer.loss_weights)}
    index = 0
    for name, mean in means.items():
        for value in np.ravel(mean):
            suffix = f" (* {weights[name]:g} = {weights[name] * value:g} loss)" if weights.get(name) else ""
            log.info(prefix.format(index=index) + f"{name} = {value:g}{suffix}")
            index += 1


class Trainer:
    """One training process: model, shard of data, Caffe's display/test/snapshot cadence."""

    def __init__(self, solver, backend="tensorflow", log=None, weights=None, snapshot=None, max_iter=None,
                 shard=0, num_shards=1, evaluate=True, seed_offset=None):
        self.solver, self.param = solver, solver.param
        self.log = log or Log()
        self.max_iter = self.param.max_iter if max_iter is None else max_iter
        seed = random_seed(self.param)
        self.model = create_model(backend, solver.train_net, self.param, source=solver.train_map,
                                  data_shape=data_shape)
        offset = shard if seed_offset is None else seed_offset
        self.feeders = feeders_for(self.model.graph, pb.TRAIN, seed=None if seed is None else seed + offset,
                                   shard=shard, num_shards=num_shards)
        self.evaluator = Evaluator(solver, backend, self.log, seed) if evaluate and solver.test_nets else None
        if weights:
            self.load_weights(weights)
        if snapshot:
            self.restore(snapshot)
        self.losses = collections.deque(maxlen=max(self.param.average_loss, 1))
        self._heap_frozen = False

    def load_weights(self, path):
        self.log.info(f"Finetuning from {path}")
        blobs = checkpoint.read_caffemodel(path)
        self.model.set_params(checkpoint.weights_for(self.model.graph, blobs, self.model.get_params(), path))

    def restore(self, path):
        self.log.info(f"Restoring previous solver status from {path}")
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
        batches = [next_batch(self.feeders) for _ in range(self.model.iter_size)]
        loss = float(self.model.step(batches[0] if len(batches) == 1 else batches))
        self.losses.append(loss)
        if not self._heap_frozen:
            # After the first step the backend is built and traced, and its hundreds of thousands of
            # objects live as long as the trainer: taken out of the cyclic collector's generations,
            # they are no longer walked by every full collection (with TensorFlow loaded one took
            # ~0.15 s, and PySpark's task launch in such a worker 0.2 s instead of 0.06 s).
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
            return self.evaluator.test(self.iter, self.model.graph, self.model.get_params())
        return []

    def snapshot(self):
        prefix = self.param.snapshot_prefix or "snapshot"
        model_path, state_path = checkpoint.snapshot_paths(prefix, self.iter)
        self.log.info(f"Snapshotting to binary proto file {model_path}")
        checkpoint.save_caffemodel(model_path, self.model.graph, self.model.get_params())
        state = self.model.get_state()
        state.learned_net = model_path
        self.log.info(f"Snapshotting solver state to binary proto file {state_path}")
        checkpoint.save_solverstate(state_path, state)
        return model_path, state_path

    def solve(self, after_step=None):
        """Caffe's Solver::Solve: test every test_interval, display, snapshot; returns the last test results."""
        p, log = self.param, self.log
        log.info(f"Solving {self.model.graph.name}")
        log.info(f"Learning Rate Policy: {p.lr_policy or 'fixed'}")
        started, last_time, last_iter, results = time.monotonic(), time.monotonic(), self.iter, []
        while self.iter < self.max_iter:
            if p.test_interval and self.iter % p.test_interval == 0 and (self.iter > 0 or p.test_initialization):
                results = self.test_all()
            rate = self.model.learning_rate()
            iteration = self.iter
            loss = self.step()
            if after_step:
                after_step(self, loss)
            if p.display and iteration % p.display == 0:
                now = time.monotonic()
                speed = (iteration - last_iter) / (now - last_time) if now > last_time and iteration > last_iter else 0
                log.info(f"Iteration {iteration} ({speed:.4g} iter/s), loss = {self.smoothed_loss:.6g}")
                log.info(f"    Train net output #0: loss = {loss:.6g}")
                log.info(f"Iteration {iteration}, lr = {rate:.6g}")
                last_time, last_iter = now, iteration
            log.progress(progress_bar(self.iter, self.max_iter, started=started,
                                      extra=f"loss {self.smoothed_loss:.4f}"))
            if p.snapshot and self.iter % p.snapshot == 0:
                self.snapshot()
        log.end_progress()
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if p.display and self.iter % p.display == 0:
            log.info(f"Iteration {self.iter}, loss = {self.smoothed_loss:.6g}")
        if p.test_interval and self.iter % p.test_interval == 0:
            results = self.test_all()
        log.info("Optimization Done.")
        return results

    def close(self):
        for feeder in self.feeders:
            feeder.close()
        if self.evaluator:
            self.evaluator.close()
        if self._heap_frozen:
            gc.unfreeze()  # what was frozen may be collected again once this trainer is gone


def apply_overrides(solver, args):
    """Command-line flags over the solver's deepspark_param and max_iter."""
    ds = solver.param.deepspark_param
    if getattr(args, "backend", None):
        ds.backend = args.backend
    if getattr(args, "workers", None):
        ds.workers = args.workers
    if getattr(args, "master", None):
        ds.master = args.master
    if getattr(args, "algorithm", None):
        ds.algorithm = pb.DeepSparkParameter.Algorithm.Value(args.algorithm.upper())
    if getattr(args, "period", None):
        ds.period = args.period
    if getattr(args, "moving_rate", None) is not None:
        ds.moving_rate = args.moving_rate
    if getattr(args, "shared_data", False):
        ds.shared_data = True
    if getattr(args, "iterations", None):
        solver.param.max_iter = args.iterations
    if getattr(args, "output", None):
        prefix = os.path.basename(solver.param.snapshot_prefix or solver.train_net.name or "snapshot")
        solver.param.snapshot_prefix = os.path.join(args.output, prefix)
    return solver


def run_single(solver, args):
    """One process, no exchange; returns the last test results as {output: value}."""
    output = os.path.dirname(solver.param.snapshot_prefix) or "."
    log = Log(os.path.join(output, "train.log"), append=bool(args.snapshot))
    trainer = Trainer(solver, solver.param.deepspark_param.backend, log, weights=args.weights,
                      snapshot=args.snapshot)
    try:
        results = trainer.solve()
    finally:
        trainer.close()
        log.close()
    return {f"test{i}/{name}": float(np.ravel(value)[0]) for i, means in enumerate(results)
            for name, value in means.items()}


def cmd_train(args):
    solver = apply_overrides(load_solver(args.solver), args)
    if solver.param.deepspark_param.algorithm == pb.DeepSparkParameter.SINGLE:
        run_single(solver, args)
    else:
        from deepspark.spark.driver import run as run_spark

        run_spark(solver, args)
    return 0


def cmd_test(args):
    from deepspark.cli import net_path

    path = net_path(args.model)
    net, source = load_net(path)
    log = Log()
    model = create_model(args.backend, net, None, phase=pb.TEST, source=source, data_shape=data_shape)
    blobs = checkpoint.read_caffemodel(args.weights)
    model.set_params(checkpoint.weights_for(model.graph, blobs, model.get_params(), args.weights))
    feeders = feeders_for(model.graph, pb.TEST)
    try:
        log.info(f"Running for {args.iterations} iterations.")
        means = score(model, feeders, args.iterations)
    finally:
        for feeder in feeders:
            feeder.close()
    log_outputs(log, model.graph, means, "")
    return 0


def synthetic_batch(graph, seed=0):
    """Random inputs for the data tops of a graph (labels 0), for timing without data."""
    rng = np.random.default_rng(seed)
    batch = {}
    for layer in graph.layers:
        if layer.type in ("Data", "Input", "MemoryData"):
            for i, (top, shape) in enumerate(zip(layer.tops, layer.top_shapes)):
                labels = layer.type != "Input" and i > 0
                batch[top] = np.zeros(shape, np.float32) if labels else rng.standard_normal(shape).astype(np.float32)
    return batch


def cmd_time(args):
    """Per-layer forward/backward milliseconds, printed like `caffe time`."""
    from deepspark.cli import _phase, net_path

    path = net_path(args.model)
    net, source = load_net(path)
    log = Log()
    model = create_model(args.backend, net, None, phase=_phase(args.phase), source=source, data_shape=data_shape)
    feeders = []
    try:
        feeders = feeders_for(model.graph, model.phase)
        batch = next_batch(feeders) if feeders else synthetic_batch(model.graph)
    except ConfigError:
        batch = synthetic_batch(model.graph)  # Input layers, or no LMDB: timing needs no real data
    finally:
        for feeder in feeders:
            feeder.close()
    log.info(f"Performing Forward/Backward for {args.iterations} iterations")
    started = time.perf_counter()
    rows = model.time_layers(batch, args.iterations)
    total = (time.perf_counter() - started) * 1000.0
    log.info("Average time per layer: ")
    width = max(len(name) for name, _, _ in rows)
    for name, forward, backward in rows:
        log.info(f"{name:>{width}}\tforward: {forward:.4g} ms.")
        log.info(f"{name:>{width}}\tbackward: {backward:.4g} ms.")
    forward, backward = sum(r[1] for r in rows), sum(r[2] for r in rows)
    log.info(f"Average Forward pass: {forward:.4g} ms.")
    log.info(f"Average Backward pass: {backward:.4g} ms.")
    log.info(f"Average Forward-Backward: {forward + backward:.4g} ms.")
    log.info(f"Total Time: {total:.4g} ms.")
    log.info("*** Benchmark ends ***")
    return 0
