"""The driver side every training job on Spark shares: the session, the shards, the center's start, Caffe's test/snapshot/display cadence, progress, TensorBoard scalars and the summary."""

import contextlib
import dataclasses
import itertools
import os
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
import types
import uuid

import numpy as np

from deepspark import checkpoint, engine, fillers, local, pylayer, schedule
from deepspark.config import host_port, random_seed
from deepspark.data import absolute_sources, checked_records, decode_datum, lmdb_io, source_shape
from deepspark.data.feeder import WINDOW_DATA_UNTRAINED
from deepspark.data.parquet import COLUMNS, DATUM, is_parquet, null_row
from deepspark.errors import ConfigError, DeepSparkError
from deepspark.exchange import ExchangeServer
from deepspark.exchange.protocol import E_DIVERGED
from deepspark.graph import Graph, layer_included
from deepspark.log import Log
from deepspark.plot import plot_history
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.session import is_local, on_loopback, spark_context, sql_session, stop_context, worker_threads
from deepspark.spark.worker import Listed, Range, Task, row_datum

# Seconds the driver waits for the Spark job's thread once it has cancelled the job.
CANCEL_SECONDS = 30
# Seconds between two looks at the workers' progress.
WATCH_SECONDS = 0.5
# Seconds a snapshot waits at most for the training workers' solver histories (each sends its own at its
# next exchange, a period's steps away); one not in time goes in as it last sent it, and the log says so.
HISTORY_SECONDS = 10.0


class JobError(DeepSparkError):
    """The job cannot go on; the message says what happened and what Spark reports."""


def executor_report(sc, listing=False):
    """What Spark says about its executors (the driver's among them), for error messages; with `listing`,
    the executors but the driver as {id: "HOST:PORT"} instead (None when Spark cannot say), for the watch
    to see one go."""
    try:
        if listing:  # the status store's list has the executors' ids (the driver's is "driver")
            active = sc._jsc.sc().statusStore().executorList(True)
            return {e.id(): e.hostPort() for e in map(active.apply, range(active.size())) if e.id() != "driver"}
        infos = sc._jsc.sc().statusTracker().getExecutorInfos()
        hosts = [f"{info.host()}:{info.port()} ({info.numRunningTasks()} running)" for info in infos]
        return f"Spark reports {len(hosts)} executor(s): {', '.join(hosts) or 'none'}"
    except Exception as error:  # only used to enrich a message
        return None if listing else f"Spark's executor list is unavailable ({error})"


_EXCEPTION_LINE = re.compile(r"^\s*([\w.]+(?:Error|Exception)): (.+)$")


def first_line(error):
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


def failed(error, sc):
    """The JobError for a Spark job that raised `error`."""
    line = first_line(error)
    if re.search(r"No module named '?deepspark\b", line):
        line = (f"the executors' Python cannot import deepspark ({line}); ship an environment that has it: "
                f"--executor-env ENV.tar.gz (tools/pack-env.sh packs one), or spark-submit --archives "
                f"ENV.tar.gz#environment with PYSPARK_PYTHON=./environment/bin/python, or install deepspark on "
                f"every node")
    return JobError(f"the Spark job failed: {line}; {executor_report(sc)}")


_WARNED = set()  # masters already warned about, in this process


def warn_if_the_secret_is_readable(sc, log):
    """Once per master: a cluster whose Spark RPC is neither authenticated nor encrypted carries the job's
    exchange secret (in the task closure) in clear to every executor; anyone on that network can read it."""
    conf, master = sc.getConf(), sc.master
    if is_local(master) or master in _WARNED:
        return
    if conf.get("spark.authenticate", "false") == "true" and conf.get("spark.network.crypto.enabled",
                                                                      "false") == "true":
        return
    _WARNED.add(master)
    log.warning(f"{master}: Spark's RPC is not authenticated and encrypted, so the exchange secret travels to the "
                "executors readable by anyone on the network; set spark.authenticate=true (with "
                "spark.authenticate.secret, or YARN/Kubernetes' own) and spark.network.crypto.enabled=true")


def train_source(solver):
    """The LMDB or Parquet dataset the train net's one Data layer reads in the TRAIN phase, or None for a net
    that reads its data through its own layers (HDF5Data, ImageData, a Python data layer, DummyData: each
    executor reads its share itself); a one-line error if there is not exactly one Data layer or none, or its
    source is not there."""
    train = pb.NetState(phase=pb.TRAIN)
    included = [(i, layer) for i, layer in enumerate(solver.train_net.layer) if layer_included(layer, train)]
    sources = {layer.data_param.source for _, layer in included if layer.type == "Data"}
    windows = [i for i, layer in included if layer.type == "WindowData"]
    if windows:
        raise ConfigError(f"layer '{solver.train_net.layer[windows[0]].name}': {WINDOW_DATA_UNTRAINED}",
                          *solver.train_map.where(windows[0]))
    if not sources and any(reads_its_own_data(layer) for _, layer in included):
        local.check_sources(solver.train_net, solver.train_map, pb.TRAIN)
        return None
    if len(sources) != 1:
        raise ConfigError("the Spark job needs exactly one Data layer (an LMDB or a Parquet dataset) in the TRAIN "
                          "phase of the train net", solver.path)
    local.check_sources(solver.train_net, solver.train_map, pb.TRAIN)
    return sources.pop()


def reads_its_own_data(layer):
    """A data layer that is not an LMDB's: it reads its own list, or makes its data (a Python layer without
    bottoms, DummyData)."""
    return layer.type in ("HDF5Data", "ImageData", "DummyData") or (layer.type == "Python" and not layer.bottom)


def ship_python_layers(sc, solver):
    """Each module a Python layer of the train net names, to every executor with the job (sc.addPyFile): found
    where the layer finds it, beside the net's prototxt or on sys.path."""
    folder = pylayer.source_folder(solver.train_map.filename)
    for module in dict.fromkeys(layer.python_param.module for layer in solver.train_net.layer
                                if layer.type == "Python"):
        try:
            path = pylayer.module_file(module, folder)
        except pylayer.PythonLayerError as error:
            raise ConfigError(str(error), solver.train_map.filename) from None
        if os.path.basename(path) == "__init__.py":  # a package goes as a zip of its folder
            package = os.path.dirname(path)
            zipped = os.path.join(tempfile.mkdtemp(prefix="deepspark-pylayer-"), os.path.basename(package))
            path = shutil.make_archive(zipped, "zip", os.path.dirname(package), os.path.basename(package))
        sc.addPyFile(path)


def shard_of(index, total, shards):
    """The shard that record `index` of `total` falls in: the inverse of lmdb_io.shard_range, i.e. the
    largest i with total * i // shards <= index, which is ((index + 1) * shards - 1) // total."""
    return ((index + 1) * shards - 1) // total


def too_few(workers, total, what):
    """The one line for a dataset that cannot give every worker a record."""
    return f"{workers} workers but {what} holds only {total} records"


def shard_payloads(solver, workers):
    """Per worker: the Range of the train net's LMDB that its executor reads itself, and the LMDB's
    record count. Only the count is read here."""
    source = train_source(solver)
    total = lmdb_io.count(source)
    if total < workers:
        raise ConfigError(too_few(workers, total, "the LMDB"), source)
    return [Range(os.path.abspath(source), *lmdb_io.shard_range(total, worker, workers), total)
            for worker in range(workers)], total


def partition_counts(sc, rows):
    """Per partition of the RDD `rows`: its row count, counted on the executors; and the first row of
    the first partition that has one (None if none has)."""

    def count(items):
        first = next(items, None)
        return [(0 if first is None else 1 + sum(1 for _ in items), first)]

    try:
        counted = rows.mapPartitions(count).collect()
    except Exception as error:
        raise failed(error, sc) from None
    return [n for n, _ in counted], next((row for n, row in counted if n), None)


def balanced_shards(rows, counts, workers, datum, what):
    """`rows` (an RDD whose partitions hold `counts` rows) as `workers` partitions of (index, Datum
    bytes): shard i holds the records lmdb_io.shard_range(total, i, workers) of `rows` in its
    order, `datum(index, row)` each; and the total.

    Indexing and `datum` run on the executors. The RDD that was counted is the one indexed,
    and its partitions are fixed once it exists, so a record has one index and a worker gets
    the same shard on every retry (Spark refetches the shuffle's output, or recomputes the
    lost part of it from the same partitions).
    """
    total = sum(counts)
    if total < workers:
        raise ConfigError(too_few(workers, total, what))
    starts = np.cumsum([0, *counts[:-1]]).tolist()

    def indexed(partition, items):
        return ((index, datum(index, row)) for index, row in enumerate(items, starts[partition]))

    return by_shard(rows.mapPartitionsWithIndex(indexed), total, workers), total


def by_shard(indexed, total, workers):
    """An RDD of (index, Datum bytes) moved into `workers` partitions: partition i holds the indexes
    lmdb_io.shard_range(total, i, workers)."""
    return indexed.partitionBy(workers, lambda index: shard_of(index, total, workers))


def shipped_shards(sc, source, workers):
    """The LMDB's records shipped from the driver through Spark (ship_records), as balanced_shards gives
    them, and the total: the driver streams them, but sc.parallelize keeps them all in its JVM."""
    total = lmdb_io.count(source)
    if total < workers:
        raise ConfigError(too_few(workers, total, "the LMDB"), source)
    values = sc.parallelize(LmdbValues(source, total), workers)
    return balanced_shards(values, partition_counts(sc, values)[0], workers, lambda index, value: value, "the LMDB")


class LmdbValues:
    """An LMDB's values with its count as len(): sc.parallelize streams a sized iterable (it lists only
    what has no len)."""

    def __init__(self, source, total):
        self.source, self.total = source, total

    def __len__(self):
        return self.total

    def __iter__(self):
        return (value for _, value in lmdb_io.read_records(self.source))


def parquet_shards(spark, source, workers):
    """The shards of a Parquet dataset as by_shard gives them, the (C, H, W) of its images and the total,
    planned from Spark's own reader (any URI it reads: file:, hdfs://, s3a://): parquet_records's."""
    indexed, shape, total = parquet_records(spark, source)
    if total < workers:
        raise ConfigError(too_few(workers, total, f"the Parquet dataset {source}"))
    return by_shard(indexed, total, workers), shape, total


def parquet_records(spark, source):
    """(an RDD of (index, Datum bytes) of a Parquet dataset, the (C, H, W) of its images, its record count),
    read by Spark's own reader.

    A record's index is its place in the files taken in sorted path order, row by row (the
    order the single-process reader reads them in): from its file's start, summed from
    per-file counts the executors make, and its row in the file (`_metadata.row_index`). It
    depends on neither how Spark splits the files into partitions nor on when, so a worker
    gets the same shard on every retry and in every run over the same files.

    The records are checked as Spark reads them (a null `datum`, not a Datum, another shape than
    the first record's), so that a bad one is named by its part file and row.
    """
    try:
        # A local path as the driver sees it; anything else (a URI) is Spark's to open.
        df = spark.read.parquet(os.path.abspath(source) if os.path.exists(source) else source)
    except Exception as error:
        raise ConfigError(f"Spark cannot read the Parquet dataset: {first_line(error)}", source) from None
    if DATUM not in df.columns:
        raise ConfigError(f"the Parquet dataset has no '{DATUM}' column (Caffe Datum bytes) but {df.columns}; "
                          f"deepspark convert-lmdb writes {', '.join(COLUMNS)}", source)
    what = f"the Parquet dataset {source}"
    located = df.select("_metadata.file_path", "_metadata.row_index", DATUM)
    try:
        counts = sorted(df.groupBy("_metadata.file_path").count().collect())
        first = located.first()
    except Exception as error:
        raise ConfigError(f"Spark cannot read the Parquet dataset: {first_line(error)}", source) from None
    if first is None:
        raise ConfigError(f"{what} is empty")
    starts = dict(zip([path for path, _ in counts], np.cumsum([0] + [n for _, n in counts[:-1]]).tolist()))
    total = sum(n for _, n in counts)
    if first[2] is None:
        raise null_row(DATUM, first[1], None, first[0])
    image, _ = decode_datum(bytes(first[2]), first[1], first[0])
    shape, dtype = tuple(int(d) for d in image.shape), image.dtype

    def present(rows, file):
        for _, row, datum in rows:
            if datum is None:
                raise null_row(DATUM, row, None, file)
            yield row, bytes(datum)

    def indexed(rows):
        # Checked here, where a record's part file and row are known (the worker's spill knows only its index);
        # a partition reads runs of rows of one file.
        for file, run in itertools.groupby(rows, key=lambda row: row[0]):
            for row, datum in checked_records(present(run, file), file, shape, dtype):
                yield starts[file] + row, datum

    return located.rdd.mapPartitions(indexed), shape, total


def dataframe_shards(df, workers, what="the DataFrame"):
    """A DataFrame's rows as balanced_shards gives them, the (C, H, W) of its images and the total.

    Rows hold either `datum` (serialized Caffe Datum bytes) or `data` (an image
    array: C x H x W, or H x W for one channel; uint8 or float) and `label`.
    """
    columns = set(df.columns)
    if "datum" not in columns and not {"data", "label"} <= columns:
        raise ConfigError(f"the DataFrame needs a 'datum' column (Datum bytes) or 'data' and 'label' columns; "
                          f"it has {sorted(columns)}")
    if "datum" not in columns:
        kind = df.schema["label"].dataType.typeName()
        if kind not in ("byte", "short", "integer", "long"):
            raise ConfigError(f"the DataFrame's 'label' column holds {kind} values; Caffe's labels are integers "
                              "(cast it: df.withColumn('label', df.label.cast('int')))")
    rows = df.select(*(["datum"] if "datum" in columns else ["data", "label"])).rdd
    counts, first = partition_counts(df.sparkSession.sparkContext, rows)
    if first is None:
        raise ConfigError(f"{what} is empty")
    shape = tuple(int(d) for d in decode_datum(row_datum(0, first))[0].shape)
    shards, total = balanced_shards(rows, counts, workers, lambda index, row: row_datum(index, row, shape), what)
    return shards, shape, total


def initial_center(solver, log, weights=None, snapshot=None, shape=None):
    """x̃ at the start: the fillers, a --weights file, or a --snapshot's learned net; the start iteration; and
    the workers' solver histories the snapshot holds ({worker: (iteration, current_step, flat history)})."""
    graph = Graph(solver.train_net, pb.TRAIN, source=solver.train_map,
                  data_shape=source_shape if shape is None else (lambda layer: shape))
    arrays = fillers.init_params(graph, random_seed(solver.param))
    start, histories = 0, {}
    if snapshot:
        log.info(f"Restoring previous solver status from {snapshot}")
        state = checkpoint.read_solverstate(snapshot)
        weights, start = checkpoint.learned_net_path(state, snapshot), state.iter
        histories = checkpoint.worker_histories(state, [p.shape for p in graph.params],
                                                schedule.history_sets(solver.param), snapshot)
    if weights:
        log.info(f"Initialising the center from {weights}")
        arrays = checkpoint.weights_for(graph, checkpoint.read_caffemodel(weights), arrays, weights)
    return graph, arrays, start, histories


def rate_at(param, iteration):
    """The learning rate a worker uses at `iteration` (multistep's counter derived, not carried)."""
    return schedule.learning_rate(param, iteration, sum(iteration >= v for v in param.stepvalue))[0]


def next_multiple(iteration, interval, include_current=False):
    """The first multiple of `interval` after `iteration` (or at it, with include_current); inf for 0."""
    if not interval:
        return float("inf")
    if include_current and iteration % interval == 0:
        return iteration
    return (iteration // interval + 1) * interval


def last_multiple(iteration, interval, start):
    """The last multiple of `interval` at or before `iteration`, never before the job's start."""
    return max(iteration - iteration % interval, start)


class Progress:
    """Per-worker rows on a terminal: iteration, loss, exchanges, seconds since the last exchange."""

    def __init__(self, log, workers, max_iter):
        self.log, self.workers, self.max_iter = log, workers, max_iter

    def draw(self, stats, lost=()):
        """The row of each worker from the exchanger's stats; `lost`: the workers lost before they finished."""
        rows = []
        for worker in range(self.workers):
            s = stats.get(worker)
            if not s:
                rows.append(f"w{worker}: waiting")
                continue
            loss = s.get("loss", float("nan"))
            since = s.get("seconds_since_exchange")
            latency = s.get("latency")
            loss = f"{loss:.4f}" if np.isfinite(loss) else "-"  # none reported yet
            rows.append(f"w{worker}: it {s.get('iteration', 0)}/{self.max_iter} loss {loss} "
                        f"ex {s.get('exchanges', 0)}"
                        + (f" ({1e3 * latency:.1f} ms, {since:.1f}s ago)" if since is not None and latency else "")
                        + (" lost, to rejoin" if worker in lost else ""))
        self.log.progress(" | ".join(rows))


# tensorboard's switch (a module by this name, importable) that makes it write through its own stand-in for
# TensorFlow, which it otherwise imports to write an event file.
TENSORBOARD_WITHOUT_TF = "tensorboard.compat.notf"


class Scalars:
    """TensorBoard scalars (loss, test outputs, learning rate, exchange latency), when tensorboard is installed."""

    def __init__(self, folder, log):
        try:
            from tensorboard.summary import Writer
        except ImportError:
            log.warning("tensorboard is not installed; no TensorBoard scalars")
            self.writer = None
            return
        if "tensorflow" in sys.modules:
            self.writer = Writer(folder)
            return
        # A driver that has not loaded TensorFlow (no test nets yet) does not load it for a file of scalars: ~300 MB
        # of its memory all job long (bench/startup.py). tensorboard reads the switch once, as this first writer
        # opens its file; it is taken down after.
        switched = TENSORBOARD_WITHOUT_TF not in sys.modules
        if switched:
            sys.modules[TENSORBOARD_WITHOUT_TF] = types.ModuleType(TENSORBOARD_WITHOUT_TF)
        try:
            self.writer = Writer(folder)
        finally:
            if switched:
                del sys.modules[TENSORBOARD_WITHOUT_TF]

    def add(self, tag, value, step):
        if self.writer is not None and np.isfinite(value):
            self.writer.add_scalar(tag, float(value), int(step))

    def close(self):
        if self.writer is not None:
            self.writer.close()


@dataclasses.dataclass
class Options:
    """How a job starts, beside its solver (whose deepspark_param names the master): --weights, --snapshot,
    a DataFrame."""

    weights: str = None
    snapshot: str = None
    data: object = None  # a pyspark DataFrame to train on instead of the train net's source


class Job:
    """One training job on Spark. An algorithm's job says how the center is held (start_exchanger,
    center_flat) and how the workers train (train); the rest is here.

    Nothing starts in the constructor: run() starts Spark, the exchanger, the test nets
    and the scalars, and stops whatever it started, whatever raises.
    """

    title = "training"  # in the log's "Solving" line and the plot

    def __init__(self, solver, options=None):
        self.solver, self.param = solver, solver.param
        self.ds = solver.param.deepspark_param
        self.options = options or Options()
        self.workers = self.ds.workers
        self.output = os.path.dirname(self.param.snapshot_prefix) or "output"
        self.history = []  # (seconds, iteration, loss, {test output: value})
        # Iterations of the last test and snapshot, and the last test's outputs.
        self.tested, self.snapshotted, self.last_test_values = None, None, {}
        self.resume_histories = {}  # a --snapshot's workers' solver histories, for the exchanger to hand back
        self.evaluator = None  # the driver's test nets: test_nets() builds them
        self.own_sc = None  # the SparkContext run() started, until stop_session stops it

    # -- what an algorithm says ------------------------------------------------

    def start_exchanger(self, center, host, secret):
        """The exchanger holding x̃ (a started ExchangeServer), or None for a job without one."""
        raise NotImplementedError

    def train(self, task):
        """Train the workers to max_iter (driving test, snapshot and display); their Summaries."""
        raise NotImplementedError

    def center_flat(self):
        """A copy of x̃ as one float32 vector."""
        return self.server.pull()

    def exchange_address(self):
        """(host, port) the workers connect to: exchange_address when set, else where the exchanger listens;
        None for a job without one."""
        if self.server is None:
            return None
        return host_port(self.ds.exchange_address) if self.ds.exchange_address else tuple(self.server.address)

    def exchange_server(self, center, host, secret, handler):
        """The started ExchangeServer of an algorithm that exchanges through one (its `handler`): the job's
        timeouts, integrity and resume point, and the workers' solver histories held for its snapshots."""
        ds = self.ds
        return ExchangeServer(center, secret, handler, host=host, port=ds.exchange_port,
                              shapes=[tuple(p.shape) for p in self.graph.params], idle_timeout=ds.exchange_timeout,
                              resume_iteration=self.start_iter, integrity=ds.exchange_integrity,
                              history_sets=schedule.history_sets(self.param),
                              histories=self.resume_histories).start()

    # -- the run ----------------------------------------------------------------

    def run(self):
        """The whole job; returns its summary: {"iterations", "weights" (the final .caffemodel, if snapshotted),
        "spill_seconds", "ready_seconds", "train_seconds", "wall_seconds", "startup_seconds" (from the Solving line
        to the slowest worker's first step), "workers" (each worker's Summary as a
        dict), "test<i>/<output>": value}."""
        data = self.options.data
        with contextlib.ExitStack() as stack:
            self.log = Log(os.path.join(self.output, "train.log"), append=bool(self.options.snapshot))
            stack.callback(self.log.close)
            self.started = time.monotonic()
            own = False
            if data is not None:
                self.sc = data.sparkSession.sparkContext  # the caller's session: theirs to stop
            else:
                train_source(self.solver)  # a missing LMDB is said before Spark starts
                self.sc, own = spark_context(self.ds, self.workers)
                if own:
                    self.own_sc = self.sc
                    stack.callback(self.stop_session)
            warn_if_the_secret_is_readable(self.sc, self.log)
            ship_python_layers(self.sc, self.solver)
            self.shards = self.load_shards()
            self.next_test = next_multiple(self.start_iter, self.param.test_interval, self.param.test_initialization)
            self.next_snapshot = next_multiple(self.start_iter, self.param.snapshot)
            self.next_display = next_multiple(self.start_iter, self.param.display)
            host = "127.0.0.1" if on_loopback(self.sc.master) else self.sc.getConf().get("spark.driver.host")
            secret = secrets.token_hex(32)
            flat = np.concatenate([a.reshape(-1) for a in self.center0]).astype(np.float32)
            self.server = self.start_exchanger(flat, host, secret)
            if self.server is not None:
                stack.callback(self.server.stop)
                if self.ds.exchange_address:
                    self.log.info(f"Workers connect to the exchanger through {self.ds.exchange_address}")
            # The test nets load TensorFlow into the driver and hold it all job long (~300 MB of its memory,
            # bench/startup.py): a job without test_interval never tests, and never builds them.
            stack.callback(self.close_test_nets)
            if self.param.test_interval:
                self.test_nets()
            self.scalars = Scalars(os.path.join(self.output, "tensorboard"), self.log)
            stack.callback(self.scalars.close)
            self.task = task = Task(job_id=uuid.uuid4().hex[:12], solver=self.param.SerializeToString(),
                        train_net=absolute_sources(self.solver.train_net).SerializeToString(),
                        solver_path=self.solver.path,
                        address=self.exchange_address(), secret=secret,
                        threads=self.threads())
            self.log.info(f"Solving {self.graph.name} on {self.sc.master} with {self.workers} workers "
                          f"({self.ds.backend} backend, {self.title})")
            self.submitted = time.time()  # the workers' ready_at is in the same clock
            results = self.train(task)
            if own:  # its executors and Python workers are done: their memory goes before the last test
                self.stop_session()
            return self.finish(results)

    def stop_session(self):
        """Stop the SparkContext this job started (and Spark SQL's session on it, if it read Parquet), once."""
        if self.own_sc is not None:
            stop_context(self.own_sc)
            self.own_sc = None

    def test_nets(self):
        """The driver's test nets (an engine.Evaluator), built at the first call."""
        if self.evaluator is None:
            self.evaluator = local.evaluator(self.solver, self.log)
            local.note_device(self.solver, self.log)  # as the driver's backend sees it, now that it runs
        return self.evaluator

    def close_test_nets(self):
        if self.evaluator is not None:
            self.evaluator.close()
            self.evaluator = None

    def load_shards(self):
        """The RDD of the workers' shards, one partition each; sets the graph, x̃'s start and the start iteration."""
        data, options, log, workers = self.options.data, self.options, self.log, self.workers
        streamed = "each task streams its partition into its local LMDB; the driver holds no records"
        source = None if data is not None else train_source(self.solver)
        if data is None and source is None:
            payloads, total = [Listed(worker, workers) for worker in range(workers)], None
            shards, shape = self.sc.parallelize(payloads, workers), None
            log.info(f"Sharded the train net's own data sources into {workers} shards (each executor reads its "
                     "share of them itself; nothing is spilled)")
        elif source is not None and is_parquet(source):
            shards, shape, total = parquet_shards(sql_session(self.sc), source, workers)
            log.info(f"Planned {workers} shards of the {total} records of the Parquet dataset {source} ({streamed})")
        elif data is not None:
            shards, shape, total = dataframe_shards(data, workers)
            log.info(f"Training on a DataFrame of {data.columns}, repartitioned into {workers} shards of its "
                     f"{total} records ({streamed})")
        elif self.ds.ship_records:
            (shards, total), shape = shipped_shards(self.sc, source, workers), None
            log.info(f"Sharded {total} records into {workers} shards (shipped through Spark from the driver: "
                     f"ship_records, bounded by the driver's memory)")
        else:
            payloads, total = shard_payloads(self.solver, workers)
            shards, shape = self.sc.parallelize(payloads, workers), None
            log.info(f"Sharded {total} records into {workers} shards (each executor reads its record range of "
                     f"{payloads[0].source} itself; no records pass through the driver)")
        if self.ds.ship_records and (data is not None or is_parquet(source)):
            log.warning("ship_records applies to an LMDB source; this job's shards are read by the executors")
        self.graph, self.center0, self.start_iter, histories = initial_center(self.solver, log, options.weights,
                                                                              options.snapshot, shape)
        self.resume_histories = {w: held for w, held in histories.items() if w < workers}
        if self.resume_histories:
            log.info(f"Restoring the solver history of worker(s) {', '.join(map(str, sorted(self.resume_histories)))} "
                     f"(as each was at iteration "
                     f"{', '.join(str(held[0]) for _, held in sorted(self.resume_histories.items()))})")
        if len(self.resume_histories) < len(histories):
            log.warning(f"the snapshot holds the solver history of {len(histories)} workers; this job has {workers}: "
                        f"worker(s) {', '.join(str(w) for w in sorted(histories) if w >= workers)} left out")
        return shards

    def threads(self):
        """Compute threads per worker: the cores shared out in local mode, an executor's cores on a cluster."""
        return worker_threads(self.sc, self.workers)

    # -- watching workers that exchange with the driver's server ----------------

    def watch(self, run_tasks):
        """Run `run_tasks()` (the Spark job) in a thread and follow the workers through the exchanger's
        stats until it ends: progress, rejoins, display, test and snapshot; its result."""
        outcome = {}

        def spark_job():
            try:
                outcome["results"] = run_tasks()
            except Exception as error:  # reported below with Spark's view
                outcome["failure"] = error

        thread = threading.Thread(target=spark_job, name="deepspark-spark-job", daemon=True)
        thread.start()
        progress = Progress(self.log, self.workers, self.param.max_iter)
        connect_deadline = time.monotonic() + self.ds.connect_timeout
        followed, idle_since = {}, None
        while thread.is_alive():
            thread.join(WATCH_SECONDS)
            stats = self.server.stats()
            lost = self.report_rejoins(stats, followed)
            progress.draw(stats, lost)
            diverged = [s["error"][1] for _, s in sorted(stats.items()) if s.get("error", (0,))[0] == E_DIVERGED]
            if diverged:  # stop at once: a retry from the center would diverge again at the same rate
                self.sc.cancelAllJobs()
                thread.join(CANCEL_SECONDS)
                raise JobError(diverged[0])
            if len(stats) < self.workers and time.monotonic() > connect_deadline:
                self.sc.cancelAllJobs()
                thread.join(CANCEL_SECONDS)
                raise JobError(f"only {len(stats)} of {self.workers} workers connected to the exchanger within "
                               f"{self.ds.connect_timeout:g}s; {executor_report(self.sc)}")
            if len(stats) < self.workers:
                continue
            # Once all have joined, no worker connected means none trains: a lost worker's task (or a rerun
            # stage) has a free slot, or never will (its executors gone for good). It must (re)join within
            # connect_timeout, else the job fails with what was lost rather than hang.
            if any(s.get("connected") for s in stats.values()):
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.ds.connect_timeout:
                self.sc.cancelAllJobs()
                thread.join(CANCEL_SECONDS)
                if not thread.is_alive() and "results" in outcome:  # it ended as the deadline came
                    break
                waited = f"{self.ds.connect_timeout:g}s (connect_timeout)"
                if not lost:
                    raise JobError(f"every worker finished, but Spark's job has not ended within {waited} of the "
                                   f"last; {executor_report(self.sc)}")
                with_ = followed.get("lost_with", {})
                what = "; ".join(f"worker {w} at iteration {it}"
                                 + (f" with {' and '.join(with_[w])}" if w in with_ else "")
                                 for w, it in sorted(lost.items()))
                raise JobError(f"lost {what}; no worker has trained for {waited} and no executor took up the "
                               f"lost work; {executor_report(self.sc)}; resume from the last snapshot (--snapshot)")
            # The job's iteration is the slowest worker's (Caffe counts max_iter on each node).
            iteration = min(s.get("iteration", 0) for s in stats.values())
            losses = [x for x in (s.get("loss", float("nan")) for s in stats.values()) if np.isfinite(x)]
            if self.display(iteration, float(np.mean(losses)) if losses else float("nan")):
                self.exchange_scalars(stats, iteration)
            self.test_and_snapshot(iteration)
        self.log.end_progress()
        if "failure" in outcome:
            raise failed(outcome["failure"], self.sc)
        return outcome["results"]

    def report_rejoins(self, stats, followed):
        """A line for each worker that connected again (Spark retried its task, or reran the stage), and one
        for each that lost its connection before it finished as Spark lost an executor (a machine gone):
        what was lost and what happens next. `followed` carries what was seen from one look to the next.
        Returns the workers lost (connection gone before the last iteration, no error) not yet back:
        {worker: iteration it was lost at}."""
        connections, lost = followed.setdefault("connections", {}), followed.setdefault("lost", {})
        said, seen = followed.setdefault("said", set()), followed.setdefault("executors", {})
        for wid, s in sorted(stats.items()):
            count = s.get("connections", 1)
            if count > connections.get(wid, 1):
                self.log.warning(f"Worker {wid} rejoined the exchanger (connection {count}); it goes on from "
                                 f"the center at iteration {s.get('joined_at', 0)}")
                lost.pop(wid, None)
                said.discard(wid)
                followed.get("lost_with", {}).pop(wid, None)
            connections[wid] = count
            if not s.get("connected", True) and s.get("iteration", 0) < self.param.max_iter and "error" not in s:
                lost.setdefault(wid, s.get("iteration", 0))
        executors = executor_report(self.sc, listing=True)
        if executors is None:
            return lost
        seen.update(executors)  # an executor's host:port as Spark last gave it (it may lack the port at first)
        named = followed.setdefault("named", set())
        gone = [f"executor {e} on {seen[e]}" for e in sorted(set(seen) - set(executors) - named)]
        unsaid = [w for w in sorted(lost) if w not in said]
        if gone and unsaid:
            waited = f"{self.ds.connect_timeout:g}s (connect_timeout)"
            if executors:
                left = ", ".join(f"executor {e} on {host}" for e, host in sorted(executors.items()))
                then = (f" (left: {left}); its shard is re-placed when a slot frees and it "
                        f"goes on from the center where it was; the job fails if no worker trains for {waited} "
                        f"before it rejoins")
            else:
                then = (f" and has none left; its shard is re-placed if Spark gets an executor within {waited}, "
                        f"else the job fails")
            for wid in unsaid:
                self.log.warning(f"Worker {wid} lost at iteration {lost[wid]}: Spark lost {' and '.join(gone)}{then}")
                followed.setdefault("lost_with", {})[wid] = gone
            said.update(unsaid)
            named.update(set(seen) - set(executors))
        return lost

    def exchange_scalars(self, stats, iteration):
        self.scalars.add("exchange/seconds_since_exchange",
                         max(s.get("seconds_since_exchange") or 0 for s in stats.values()), iteration)
        latencies = [s["latency"] for s in stats.values() if s.get("latency") is not None]
        if latencies:
            self.scalars.add("exchange/latency_ms", 1e3 * float(np.mean(latencies)), iteration)
        self.scalars.add("exchange/exchanges", sum(s.get("exchanges", 0) for s in stats.values()), iteration)

    # -- Caffe's cadence on the center -----------------------------------------------

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
        self.next_display = next_multiple(iteration, p.display)
        return True

    def test_and_snapshot(self, iteration):
        """Test and snapshot x̃ once `iteration` reaches the next test_interval / snapshot multiple.

        Workers run on while the driver watches, so the slowest may already be past
        the multiple when it is seen; the test and the snapshot carry the multiple's
        number, as Caffe's do (lenet_iter_5000), and a line says where the workers were.
        """
        p = self.param
        if p.test_interval and iteration >= self.next_test:
            self.test(last_multiple(iteration, p.test_interval, self.start_iter), observed=iteration)
            self.next_test = next_multiple(iteration, p.test_interval)
        if p.snapshot and iteration >= self.next_snapshot:
            self.snapshot(last_multiple(iteration, p.snapshot, self.start_iter), observed=iteration)
            self.next_snapshot = next_multiple(iteration, p.snapshot)

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
        values = engine.first_values(self.test_nets().test(iteration, self.graph, self.center_arrays()))
        for tag, value in values.items():
            self.scalars.add(tag, value, iteration)
        self.history.append((time.monotonic() - self.started, iteration, float("nan"), values))
        self.last_test_values = values
        return values

    def snapshot(self, iteration, observed=None):
        self.snapshotted = iteration
        self._note_observed("Snapshotting", iteration, observed)
        model_path, state_path = checkpoint.snapshot_paths(self.param.snapshot_prefix, iteration,
                                                           engine.hdf5_snapshots(self.param))
        center = self.center_arrays()
        # x̃ first, as read: its line is when it was taken (time-to-accuracy reads it), not after the wait for
        # the workers' histories, which only the solver state holds.
        self.log.info(f"Snapshotting to {checkpoint.snapshot_words(model_path)} {model_path}")
        checkpoint.save_caffemodel(model_path, self.graph, center)
        workers = self.worker_states()
        self.log.info(f"Snapshotting solver state to {checkpoint.snapshot_words(state_path)} {state_path}"
                      + (f" (with the solver history of {len(workers)} workers)" if workers else ""))
        # The center's own solver state: x̃ moves by elastic differences, not by a solver of its own, so
        # its history is zeros, one blob per parameter and history set, as Caffe's restore expects; each
        # worker's own goes beside it, for a resume of this job (Caffe's restore skips them).
        history = [np.zeros(p.shape, np.float32) for p in self.graph.params] * schedule.history_sets(self.param)
        state = checkpoint.solver_state(iteration, history=history, learned_net=model_path)
        state.worker_state.extend(workers)
        checkpoint.save_solverstate(state_path, state)
        return model_path

    def worker_states(self):
        """The workers' solver histories for a snapshot (WorkerSolverStates): each training worker is asked
        for its own and sends it at its next exchange; a worker that has finished sent its last. Waits
        HISTORY_SECONDS at most; a worker not in time goes in with the last it sent, and a line says so."""
        if self.server is None or not self.server.stats():
            return []
        request = self.server.request_histories()
        deadline = time.monotonic() + min(HISTORY_SECONDS, self.ds.exchange_timeout)
        while True:
            answered = self.server.histories(since=request)
            waiting = [w for w, s in self.server.stats().items() if s["connected"] and w not in answered]
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        held = self.server.histories()
        if waiting:
            self.log.warning(f"worker(s) {', '.join(map(str, waiting))} sent no solver history within "
                             f"{HISTORY_SECONDS:g}s; the snapshot keeps the last each sent "
                             f"({', '.join(f'iteration {held[w].iteration}' if w in held else 'none' for w in waiting)})")
        shapes = [tuple(p.shape) for p in self.graph.params]
        return [checkpoint.worker_state(w, h.iteration, h.current_step, h.vector, shapes)
                for w, h in sorted(held.items())]

    def finish(self, results):
        """The workers' summary lines, the last snapshot and test, the plot; the job's summary."""
        p, log = self.param, self.log
        final = max(r.final_iteration for r in results)
        spill = max(r.spill_seconds for r in results)
        train = max(r.train_seconds for r in results)
        for r in sorted(results, key=lambda r: r.worker):
            log.info(f"Worker {r.worker} on {r.host} (in {r.cwd}, deepspark from {r.package}): "
                     f"{r.iterations} iterations, {r.exchanges} exchanges, spilled {r.records} records in "
                     f"{r.spill_seconds:.2f}s, trained {r.train_seconds:.1f}s, blocked on exchange "
                     f"{r.blocked_seconds:.2f}s, peak RSS {r.spill_rss_mb:.0f} MB after the spill, "
                     f"{r.peak_rss_mb:.0f} MB"
                     + ("" if r.restored_history is None else
                        f"; started from its solver history of iteration {r.restored_history}"))
        startup = {r.worker: r.startup(self.submitted) for r in results if r.first_step_at}
        for worker, parts in sorted(startup.items()):
            log.info(f"Start-up of worker {worker}: {sum(parts.values()):.2f}s from Solving to its first step done: "
                     + ", ".join(f"{part} {seconds:.2f}s" for part, seconds in parts.items()))
        log.info(f"Spill took {spill:.2f}s, {100 * spill / max(train, 1e-9):.2f}% of training time")
        ready = max(r.ready_at for r in results) - self.submitted
        if ready > 0:  # not so when no worker spilled in this run (every ready_at 0)
            log.info(f"Shards ready {ready:.1f}s after the Spark job started (Spark's read of the data, any shuffle, "
                     f"then the spill), {100 * ready / max(train, 1e-9):.2f}% of training time")
        if p.snapshot_after_train and self.snapshotted != final:
            self.snapshot(final)
        weights = (checkpoint.snapshot_paths(p.snapshot_prefix, final, engine.hdf5_snapshots(p))[0]
                   if self.snapshotted == final else None)
        values = self.last_test_values
        if self.solver.test_nets and engine.due_for_test(p, final) and self.tested != final:  # Caffe's last test
            values = self.test(final)
        log.info("Optimization Done.")
        plot_path = os.path.join(self.output, "progress.png")
        plot_history(self.history, plot_path, title=f"{self.graph.name}: {self.workers} workers, {self.title}")
        log.info(f"Plot of loss and test outputs against time: {plot_path}")
        return {"iterations": final, "weights": weights, "spill_seconds": spill, "ready_seconds": max(ready, 0.0),
                "train_seconds": train, "wall_seconds": time.monotonic() - self.started,
                "startup_seconds": max((sum(parts.values()) for parts in startup.values()), default=None),
                "workers": [dataclasses.asdict(r) for r in sorted(results, key=lambda r: r.worker)], **values}
