"""The driver side of a training job: Spark session, exchanger, shards, test, snapshots, progress."""

import os
import re
import secrets
import sys
import threading
import time
import uuid

import numpy as np

from deepspark import checkpoint
from deepspark.config import random_seed
from deepspark.errors import ConfigError, DeepSparkError
from deepspark.data import lmdb_io
from deepspark.graph import Graph, layer_included
from deepspark.log import Log
from deepspark.proto import deepspark_pb2 as pb
from deepspark.solver import Evaluator, data_shape


class JobError(DeepSparkError):
    """The job cannot go on; the message says what happened and what Spark reports."""


def is_local(master):
    return master.startswith("local")


def on_loopback(master):
    """A local master, or one on 127.0.0.1/localhost: the driver binds to 127.0.0.1 too."""
    return is_local(master) or any(h in master for h in ("//127.0.0.1:", "//localhost:"))


def spark_session(ds, workers, master=None):
    """The job's SparkSession: `local[N,F]` by default, bound to 127.0.0.1; a spark-submit session as is."""
    from pyspark.sql import SparkSession

    # Under spark-submit the JVM is already up with its master; use that session as configured.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    master = master or ds.master or (None if submitted else f"local[{workers},{max(ds.max_failures, 1)}]")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("deepspark")
    if master:
        builder = builder.master(master)
    if master and on_loopback(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (builder.config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.ui.enabled", "false"))
    builder = (builder.config("spark.task.maxFailures", str(max(ds.max_failures, 1)))
               .config("spark.python.worker.reuse", "true")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(p for p in sys.path if p)))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def executor_report(sc):
    """What Spark says about its executors, for error messages."""
    try:
        infos = sc._jsc.sc().statusTracker().getExecutorInfos()
        hosts = [f"{info.host()}:{info.port()} ({info.numRunningTasks()} running)" for info in infos]
        return f"Spark reports {len(hosts)} executor(s): {', '.join(hosts) or 'none'}"
    except Exception as error:  # only used to enrich a message
        return f"Spark's executor list is unavailable ({error})"


def shard_payloads(solver, workers, shared_data):
    """Per worker: its record range of the train net's LMDB, as records shipped through Spark
    or (shared storage) as a path and range to read directly."""
    sources = [layer.data_param.source for layer in solver.train_net.layer
               if layer.type == "Data" and _in_train(layer)]
    if len(set(sources)) != 1:
        raise ConfigError("the Spark job needs exactly one Data layer (LMDB) in the TRAIN phase of the train net",
                          solver.path)
    source = sources[0]
    if not os.path.exists(source):
        raise ConfigError(f"training LMDB '{source}' not found", solver.path)
    total = lmdb_io.count(source)
    payloads = []
    for worker in range(workers):
        start, stop = lmdb_io.shard_range(total, worker, workers)
        if stop <= start:
            raise ConfigError(f"{workers} workers but the LMDB holds only {total} records", source)
        if shared_data:
            payloads.append(("range", os.path.abspath(source), start, stop))
        else:
            payloads.append(("records", list(lmdb_io.read_records(source, start, stop))))
    return payloads, total


def dataframe_shards(df, workers):
    """An RDD of N partitions of (key, Datum bytes) from a DataFrame, and the (C, H, W) of its images.

    Rows hold either `datum` (serialized Caffe Datum bytes) or `data` (an image
    array: C x H x W, or H x W for one channel; uint8 or float) and `label`.
    """
    from deepspark.data import decode_datum
    from deepspark.spark.worker import row_to_record

    columns = set(df.columns)
    if "datum" not in columns and not {"data", "label"} <= columns:
        raise ConfigError(f"the DataFrame needs a 'datum' column (Datum bytes) or 'data' and 'label' columns; "
                          f"it has {sorted(columns)}")
    first = df.first()
    if first is None:
        raise ConfigError("the DataFrame is empty")
    shape = decode_datum(row_to_record(0, first)[1])[0].shape
    use = ["datum"] if "datum" in columns else ["data", "label"]
    records = df.select(*use).rdd.zipWithIndex().map(lambda pair: row_to_record(pair[1], pair[0]))
    return records.repartition(workers), tuple(int(d) for d in shape)


def _in_train(layer):
    return layer_included(layer, pb.NetState(phase=pb.TRAIN))


def initial_center(solver, log, weights=None, snapshot=None, shape=None):
    """x̃ at the start: the fillers, a --weights file, or a --snapshot's learned net; and the start iteration."""
    from deepspark.fillers import init_params

    graph = Graph(solver.train_net, pb.TRAIN, source=solver.train_map,
                  data_shape=data_shape if shape is None else (lambda layer: shape))
    seed = random_seed(solver.param)
    arrays = init_params(graph, seed)
    start = 0
    if snapshot:
        log.info(f"Restoring previous solver status from {snapshot}")
        state = checkpoint.read_solverstate(snapshot)
        weights, start = checkpoint.learned_net_path(state, snapshot), state.iter
    if weights:
        log.info(f"Initialising the center from {weights}")
        arrays = checkpoint.weights_for(graph, checkpoint.read_caffemodel(weights), arrays, weights)
    return graph, arrays, start


def rate_at(param, iteration):
    """The learning rate a worker uses at `iteration` (multistep's counter derived, not carried)."""
    from deepspark import schedule

    return schedule.learning_rate(param, iteration, sum(iteration >= v for v in param.stepvalue))[0]


class Progress:
    """Per-worker rows on a terminal: iteration, loss, exchanges, seconds since the last exchange."""

    def __init__(self, log, workers, max_iter):
        self.log, self.workers, self.max_iter = log, workers, max_iter

    def draw(self, stats):
        rows = []
        for worker in range(self.workers):
            s = stats.get(worker)
            if not s:
                rows.append(f"w{worker}: waiting")
                continue
            loss = s.get("loss", float("nan"))
            since = s.get("seconds_since_exchange")
            latency = s.get("latency")
            rows.append(f"w{worker}: it {s.get('iteration', 0)}/{self.max_iter} loss {loss:.4f} "
                        f"ex {s.get('exchanges', 0)}"
                        + (f" ({1e3 * latency:.1f} ms, {since:.1f}s ago)" if since is not None and latency else ""))
        self.log.progress(" | ".join(rows))


class Scalars:
    """TensorBoard scalars (loss, test outputs, learning rate, exchange latency), when tensorboard is installed."""

    def __init__(self, folder, log):
        try:
            from tensorboard.summary import Writer
        except ImportError:
            log.warning("tensorboard is not installed; no TensorBoard scalars")
            self.writer = None
            return
        self.writer = Writer(folder)

    def add(self, tag, value, step):
        if self.writer is not None and np.isfinite(value):
            self.writer.add_scalar(tag, float(value), int(step))

    def close(self):
        if self.writer is not None:
            self.writer.close()


def run(solver, args, data=None):
    """`deepspark train` on Spark: async EASGD (N tasks exchanging with the driver's center), or a
    baseline of deepspark.spark.baselines (sync, average).

    `data`: a Spark DataFrame to train on instead of the train net's LMDB (see dataframe_shards).
    """
    from deepspark.spark import baselines

    ds = solver.param.deepspark_param
    algorithm = pb.DeepSparkParameter.Algorithm.Name(ds.algorithm).lower()
    jobs = {"easgd": Job, "sync": baselines.SyncJob, "average": baselines.AverageJob}
    if algorithm not in jobs:
        raise ConfigError(f"algorithm '{algorithm}' does not run on Spark; use {', '.join(jobs)} or single",
                          solver.path)
    output = os.path.dirname(solver.param.snapshot_prefix) or "output"
    log = Log(os.path.join(output, "train.log"), append=bool(getattr(args, "snapshot", None)))
    job = jobs[algorithm](solver, log, output, getattr(args, "weights", None), getattr(args, "snapshot", None),
                          getattr(args, "master", None), data)
    try:
        job.run()
    finally:
        job.close()
        log.close()
    return job.summary


class Job:
    """One asynchronous EASGD training job; the baselines (deepspark.spark.baselines) override
    start_exchanger, run_tasks, center_flat and run, and share the rest."""

    title = "async EASGD"  # in the log's "Solving" line and the plot

    def __init__(self, solver, log, output, weights=None, snapshot=None, master=None, data=None):
        self.solver, self.param, self.log, self.output = solver, solver.param, log, output
        ds = self.ds = solver.param.deepspark_param
        self.workers = ds.workers
        self.summary = None
        if self.workers < 1:
            raise ConfigError("workers must be at least 1", solver.path)
        self.spark = data.sparkSession if data is not None else spark_session(ds, self.workers, master)
        self.sc = self.spark.sparkContext
        if data is not None:
            self.shards, shape = dataframe_shards(data, self.workers)
            log.info(f"Training on a DataFrame of {data.columns}, repartitioned into {self.workers} shards")
            self.graph, center, self.start_iter = initial_center(solver, log, weights, snapshot, shape)
        else:
            self.graph, center, self.start_iter = initial_center(solver, log, weights, snapshot)
            payloads, records = shard_payloads(solver, self.workers, ds.shared_data)
            self.shards = self.sc.parallelize(payloads, self.workers)
            how = "read by executors from shared storage" if ds.shared_data else "shipped through Spark"
            log.info(f"Sharded {records} records into {self.workers} shards ({how})")
        local = is_local(self.sc.master)
        host = "127.0.0.1" if on_loopback(self.sc.master) else self.sc.getConf().get("spark.driver.host")
        self.secret = secrets.token_hex(32)
        flat = np.concatenate([a.reshape(-1) for a in center]).astype(np.float32)
        self.server = self.start_exchanger(flat, host)
        cores = os.cpu_count() or 1
        threads = max(1, cores // self.workers) if local else int(self.sc.getConf().get("spark.executor.cores", "1"))
        self.job = {"id": uuid.uuid4().hex[:12], "solver": self.param.SerializeToString(),
                    "train_net": solver.train_net.SerializeToString(),
                    "address": list(self.server.address) if self.server else None,
                    "secret": self.secret, "threads": threads, "solver_path": solver.path}
        self.evaluator = Evaluator(solver, ds.backend, log,
                                   random_seed(self.param))
        self.scalars = Scalars(os.path.join(output, "tensorboard"), log)
        self.history = []  # (seconds, iteration, loss, {test output: value})
        # Iterations of the last test and snapshot, and the last test's outputs.
        self.tested, self.snapshotted, self.last_test_values = None, None, {}
        self.started = time.monotonic()
        self.results, self.failure = None, None

    def start_exchanger(self, center, host):
        """The exchanger holding x̃, started; None for a job without one."""
        from deepspark.exchange import ExchangeServer

        ds = self.ds
        server = ExchangeServer(center, self.secret, ds.moving_rate, host=host, port=0,
                                shapes=[tuple(p.shape) for p in self.graph.params],
                                server_factor=ds.server_factor, decay_rate=ds.moving_rate_gamma,
                                decay_step=ds.moving_rate_step,
                                idle_timeout=ds.exchange_timeout,
                                resume_iteration=self.start_iter).start()
        self.log.info(f"Exchanger listening on {server.address[0]}:{server.address[1]}; "
                      f"{self.workers} workers, period {ds.period}, moving rate {ds.moving_rate:g}")
        return server

    # -- the Spark part ------------------------------------------------------

    def run_tasks(self):
        """One long Spark task per worker; their summaries."""
        from deepspark.spark import worker as worker_module

        job = self.job
        return self.shards.mapPartitionsWithIndex(
            lambda i, items: [worker_module.run(i, worker_module.payload_of(items), job)]).collect()

    def _spark_job(self):
        try:
            self.results = self.run_tasks()
        except Exception as error:  # reported by the monitor loop with Spark's view
            self.failure = error

    # -- the driver's loop ---------------------------------------------------

    def run(self):
        p, log = self.param, self.log
        log.info(f"Solving {self.graph.name} on {self.sc.master} with {self.workers} workers "
                 f"({self.ds.backend} backend, {self.title})")
        thread = threading.Thread(target=self._spark_job, name="deepspark-spark-job", daemon=True)
        thread.start()
        progress = Progress(log, self.workers, p.max_iter)
        self.start_cadence()
        connect_deadline = time.monotonic() + self.ds.connect_timeout
        connections = {}
        while thread.is_alive():
            thread.join(0.5)
            stats = self.server.stats()
            progress.draw(stats)
            self.report_rejoins(stats, connections)
            if len(stats) < self.workers and time.monotonic() > connect_deadline:
                self.sc.cancelAllJobs()
                thread.join(30)
                raise JobError(f"only {len(stats)} of {self.workers} workers connected to the exchanger within "
                               f"{self.ds.connect_timeout:g}s; {executor_report(self.sc)}")
            iteration = self._iteration(stats)
            if iteration is None:
                continue
            if self.display(iteration, self._loss(stats)):
                self.scalars.add("exchange/seconds_since_exchange",
                                 max(s.get("seconds_since_exchange") or 0 for s in stats.values()), iteration)
                latencies = [s["latency"] for s in stats.values() if s.get("latency") is not None]
                if latencies:
                    self.scalars.add("exchange/latency_ms", 1e3 * float(np.mean(latencies)), iteration)
                self.scalars.add("exchange/exchanges", sum(s.get("exchanges", 0) for s in stats.values()),
                                 iteration)
            self.test_and_snapshot(iteration)
        log.end_progress()
        if self.failure is not None:
            raise JobError(f"the Spark job failed: {_first_line(self.failure)}; {executor_report(self.sc)}")
        self.finish()

    def report_rejoins(self, stats, connections):
        """A line for each worker that connected again (Spark retried its task, or reran the stage)."""
        for wid, s in sorted(stats.items()):
            count = s.get("connections", 1)
            if count > connections.get(wid, 1):
                self.log.warning(f"Worker {wid} rejoined the exchanger (connection {count}); it goes on from "
                                 f"the center at iteration {s.get('joined_at', 0)}")
            connections[wid] = count

    def start_cadence(self):
        """The next iterations at which to test, snapshot and display, from the job's start."""
        p = self.param
        self.next_test = self._next_multiple(self.start_iter, p.test_interval, p.test_initialization)
        self.next_snapshot = self._next_multiple(self.start_iter, p.snapshot, False)
        self.next_display = self._next_multiple(self.start_iter, p.display, False)

    def display(self, iteration, loss):
        """Caffe's `Iteration N, loss = L` line and the train scalars, once `iteration` reaches the next
        display multiple; True when shown."""
        p = self.param
        if not (p.display and iteration >= self.next_display and np.isfinite(loss)):
            return False
        self.log.info(f"Iteration {iteration}, loss = {loss:.6g}")
        self.scalars.add("train/loss", loss, iteration)
        self.scalars.add("train/learning_rate", rate_at(p, iteration), iteration)
        self.history.append((time.monotonic() - self.started, iteration, loss, {}))
        self.next_display = self._next_multiple(iteration, p.display, False)
        return True

    def test_and_snapshot(self, iteration):
        """Test and snapshot x̃ once `iteration` reaches the next test_interval / snapshot multiple.

        Workers run on while the driver watches, so the slowest may already be past
        the multiple when it is seen; the test and the snapshot carry the multiple's
        number, as Caffe's do (lenet_iter_5000), and a line says where the workers were.
        """
        p = self.param
        if p.test_interval and iteration >= self.next_test:
            self.test(self._reached(iteration, p.test_interval), observed=iteration)
            self.next_test = self._next_multiple(iteration, p.test_interval, False)
        if p.snapshot and iteration >= self.next_snapshot:
            self.snapshot(self._reached(iteration, p.snapshot), observed=iteration)
            self.next_snapshot = self._next_multiple(iteration, p.snapshot, False)

    def _reached(self, iteration, interval):
        """The last multiple of `interval` at or before `iteration` (never before the job's start)."""
        return max(iteration - iteration % interval, self.start_iter)

    @staticmethod
    def _next_multiple(iteration, interval, include_current):
        if not interval:
            return float("inf")
        if include_current and iteration % interval == 0:
            return iteration
        return (iteration // interval + 1) * interval

    def _iteration(self, stats):
        """The job's iteration: the slowest worker's (Caffe counts max_iter on each node)."""
        if len(stats) < self.workers:
            return None
        return min(s.get("iteration", 0) for s in stats.values())

    @staticmethod
    def _loss(stats):
        losses = [s.get("loss", float("nan")) for s in stats.values()]
        losses = [x for x in losses if np.isfinite(x)]
        return float(np.mean(losses)) if losses else float("nan")

    def center_flat(self):
        """A copy of x̃ as one float32 vector."""
        return self.server.pull()

    def center_arrays(self):
        flat = self.center_flat()
        sizes = [int(np.prod(p.shape)) for p in self.graph.params]
        offsets = np.cumsum([0] + sizes)
        return [flat[a:b].reshape(p.shape) for p, a, b in zip(self.graph.params, offsets, offsets[1:])]

    def _note_observed(self, what, iteration, observed):
        if observed is not None and observed != iteration:
            self.log.info(f"{what} x̃ as iteration {iteration}; the slowest worker is at iteration {observed}")

    def test(self, iteration, observed=None):
        self.tested = iteration
        self._note_observed("Testing", iteration, observed)
        results = self.evaluator.test(iteration, self.graph, self.center_arrays())
        values = {}
        for i, means in enumerate(results):
            for name, mean in means.items():
                value = float(np.ravel(mean)[0])
                values[f"test{i}/{name}"] = value
                self.scalars.add(f"test{i}/{name}", value, iteration)
        self.history.append((time.monotonic() - self.started, iteration, float("nan"), values))
        self.last_test_values = values
        return values

    def snapshot(self, iteration, observed=None):
        self.snapshotted = iteration
        self._note_observed("Snapshotting", iteration, observed)
        model_path, state_path = checkpoint.snapshot_paths(self.param.snapshot_prefix, iteration)
        self.log.info(f"Snapshotting to binary proto file {model_path}")
        checkpoint.save_caffemodel(model_path, self.graph, self.center_arrays())
        state = pb.SolverState(iter=iteration, learned_net=model_path)
        self.log.info(f"Snapshotting solver state to binary proto file {state_path}")
        checkpoint.save_solverstate(state_path, state)
        return model_path

    def finish(self):
        p, log = self.param, self.log
        final = max(r["final_iteration"] for r in self.results)
        spill = max(r["spill_seconds"] for r in self.results)
        train = max(r["train_seconds"] for r in self.results)
        for r in sorted(self.results, key=lambda r: r["worker"]):
            log.info(f"Worker {r['worker']} on {r['host']} (in {r['cwd']}): {r['iterations']} iterations, "
                     f"{r['exchanges']} exchanges, spilled {r['records']} records in {r['spill_seconds']:.2f}s, trained "
                     f"{r['train_seconds']:.1f}s, blocked on exchange {r['blocked_seconds']:.2f}s")
        log.info(f"Spill took {spill:.2f}s, {100 * spill / max(train, 1e-9):.2f}% of training time")
        if p.snapshot_after_train and self.snapshotted != final:
            self.snapshot(final)
        values = self.last_test_values
        if self.evaluator.nets and self.tested != final:
            values = self.test(final)
        log.info("Optimization Done.")
        self.summary = {"iterations": final, "spill_seconds": spill, "train_seconds": train,
                        "wall_seconds": time.monotonic() - self.started, **values}
        from deepspark.plot import plot_history

        plot_path = os.path.join(self.output, "progress.png")
        plot_history(self.history, plot_path, title=f"{self.graph.name}: {self.workers} workers, {self.title}")
        log.info(f"Plot of loss and test outputs against time: {plot_path}")

    def close(self):
        self.scalars.close()
        self.evaluator.close()
        if self.server is not None:
            self.server.stop()
        self.spark.stop()


_EXCEPTION_LINE = re.compile(r"^\s*([\w.]+(?:Error|Exception)): (.+)$")


def _first_line(error):
    """The one line that says why a Spark job failed: our own error's message if a worker raised one,
    else the first Python exception, else the first exception named anywhere in Spark's report."""
    text = str(error).strip()
    found = [m.groups() for m in map(_EXCEPTION_LINE.match, text.splitlines()) if m]
    ours = [message for name, message in found if name.startswith("deepspark.")]
    if ours:
        return ours[0].strip()
    python = [(name, message) for name, message in found if not name.startswith(("org.", "java.", "py4j.", "scala."))]
    if python or found:
        name, message = (python or found)[0]
        return f"{name.rsplit('.', 1)[-1]}: {message.strip()}"
    return text.splitlines()[0] if text else type(error).__name__
