"""A training job on Spark, what every algorithm (deepspark.algorithms) shares on the driver: its start (session, shards, the center's start, the exchanger, the Task) and its finish (the workers' lines, the last snapshot and test, the summary); and `train`, what `deepspark train` and `deepspark.train` run."""

import contextlib
import dataclasses
import logging
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
import time
import uuid

import numpy as np

from deepspark import algorithms, checkpoint, fillers, pylayer, rules, schedule
from deepspark.engine import JobResult
from deepspark.config import host_port, load_solver, output_folder, override, random_seed
from deepspark.data import absolute_sources, source_shape
from deepspark.errors import ConfigError
from deepspark.exchange import ExchangeOptions, ExchangeServer
from deepspark.graph import Graph
from deepspark.log import Log, train_log
from deepspark.progress import display
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark import executor, rounds, shards
from deepspark.spark.budget import Budget, Limits, Outages
from deepspark.spark.center import HISTORY_SECONDS, CenterCadence
from deepspark.spark.executor import Task
from deepspark.spark.failures import JobError, interrupted
from deepspark.spark.session import (WATCHED_ATTEMPTS, is_local, on_loopback, quiet_tasks, setting, spark_context,
                                     stop_context, this_python, threads_line)
from deepspark.spark.watch import Watch

log = logging.getLogger(__name__)
_WARNED = set()  # masters already warned about, in this process
# A worker's divergence (executor.check_finite's line): its job stops with no snapshot, the center being suspect.
_DIVERGED = re.compile(r"worker \d+ diverged at iteration \d+")


class HungUp(KeyboardInterrupt):
    """SIGHUP while a job runs: it stops as on SIGINT, its center snapshotted first."""


class StopSignals:
    """SIGINT and SIGHUP while a job runs in the main thread (installed by `with`, the previous handlers back
    after): each raises there (KeyboardInterrupt, HungUp), and the job stops with its center snapshotted
    (Job.stopped_early). SIGHUP would kill the driver with no snapshot and nothing of its own cleaned up; pyspark's
    SIGINT handler cancels Spark's jobs through Py4J from inside the Py4J call the main thread may be in (a round's
    collect), which Py4J refuses with a traceback: the job's end stops Spark's session instead. Py4J logs an
    interrupt of its call with a traceback on the root logger: those records are dropped meanwhile (Py4JQuiet)."""

    SIGNALS = (signal.SIGINT, signal.SIGHUP)

    def __init__(self):
        self.previous, self.quiet = {}, Py4JQuiet()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {number: signal.signal(number, self.handle) for number in self.SIGNALS}
            self.quiet.__enter__()
        return self

    def __exit__(self, *exc):
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        if self.previous:
            self.quiet.__exit__(*exc)

    @staticmethod
    def handle(number, frame):
        raise HungUp("SIGHUP") if number == signal.SIGHUP else KeyboardInterrupt()


class Py4JQuiet(logging.Filter):
    """Py4J's log of an interrupted call ("KeyboardInterrupt while sending command.", a traceback through the root
    logger) dropped while `with`; and the handler Py4J's logging.exception gave a root logger that had none taken
    away after (logging.basicConfig's: it would print every record that reaches the root from then on)."""

    # A logger's filter sees only what is logged through it, not what its children pass up: Py4J's own loggers too.
    LOGGERS = ("", "py4j", "py4j.clientserver", "py4j.java_gateway")

    def filter(self, record):
        if not record.exc_info or f"{os.sep}py4j{os.sep}" not in record.pathname:
            return True
        # The interrupt itself, or what it broke on the way out (a BrokenPipeError while Py4J shut the connection).
        return interrupted(record.exc_info[1]) is None

    def __enter__(self):
        root = logging.getLogger()
        self.unconfigured = not root.handlers
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def __exit__(self, *exc):
        root = logging.getLogger()
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)
        if self.unconfigured:
            for handler in list(root.handlers):
                root.removeHandler(handler)


def warn_if_the_secret_is_readable(sc):
    """Once per master: a cluster whose Spark RPC is neither authenticated nor encrypted carries the job's
    exchange secret (in the task closure) in clear to every executor; anyone on that network can read it."""
    master = sc.master
    if is_local(master) or master in _WARNED:
        return
    if setting(sc, "spark.authenticate", "false") == "true" and setting(sc, "spark.network.crypto.enabled",
                                                                        "false") == "true":
        return
    _WARNED.add(master)
    log.warning(f"{master}: Spark's RPC is not authenticated and encrypted, so the exchange secret travels to the "
                "executors readable by anyone on the network; set spark.authenticate=true (with "
                "spark.authenticate.secret, or YARN/Kubernetes' own) and spark.network.crypto.enabled=true")


def ship_python_layers(sc, solver):
    """Each module a Python layer of the train net names, to every executor with the job (sc.addPyFile): found
    where the layer finds it, beside the net's prototxt or on sys.path; a package goes as a zip of its folder."""
    folder = pylayer.source_folder(solver.train_map.filename)
    for module in dict.fromkeys(layer.python_param.module for layer in solver.train_net.layer
                                if layer.type == "Python"):
        try:
            path = pylayer.module_file(module, folder)
        except pylayer.PythonLayerError as error:
            raise ConfigError(str(error), solver.train_map.filename) from None
        if os.path.basename(path) == "__init__.py":
            package = os.path.dirname(path)
            zipped = os.path.join(tempfile.mkdtemp(prefix="deepspark-pylayer-"), os.path.basename(package))
            path = shutil.make_archive(zipped, "zip", os.path.dirname(package), os.path.basename(package))
        sc.addPyFile(path)


def batch_size(graph):
    """Items per worker iteration, for the bars' images/s: the first fed top's first axis, else (a net that makes
    its own data: a Python data layer, DummyData) the first top of its first layer without bottoms; 0 if none."""
    shapes = list(graph.fed_tops().values()) or [shape for layer in graph.layers if not layer.bottoms
                                                 for shape in layer.top_shapes]
    return shapes[0][0] if shapes and shapes[0] else 0


def initial_center(solver, history_sets, weights=None, snapshot=None, shape=None):
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
        histories = checkpoint.worker_histories(state, [p.shape for p in graph.params], history_sets, snapshot)
    if weights:
        log.info(f"Initialising the center from {weights}")
        arrays = checkpoint.weights_for(graph, checkpoint.read_caffemodel(weights), arrays, weights)
    return graph, arrays, start, histories


@dataclasses.dataclass
class Options:
    """How a job starts, beside its solver (whose deepspark_param names the master): --weights, --snapshot,
    a DataFrame."""

    weights: str = None
    snapshot: str = None
    data: object = None  # a pyspark DataFrame to train on instead of the train net's source


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What a job is, made once before it starts: the solver (its deepspark_param names the workers and the
    master), its algorithm (the ALGORITHMS row of deepspark_param.algorithm, unless given), how it starts
    (Options), the output folder and the solver's history sets."""

    solver: object
    algorithm: algorithms.Algorithm
    options: Options
    output: str
    history_sets: int

    @classmethod
    def of(cls, solver, options=None, algorithm=None):
        return cls(solver, algorithm or algorithms.of(solver.param.deepspark_param), options or Options(),
                   output_folder(solver), schedule.history_sets(solver.param))

    @property
    def workers(self):
        return self.solver.param.deepspark_param.workers


class Job:
    """One training job on Spark: what every algorithm shares. The plan's algorithm (algorithms/<name>.py) says
    how the center is held (hold_center, center_flat) and how the workers train (train, through run_workers or
    run_rounds); the rest is here.

    run(plan) starts Spark, the exchanger, the test nets and the scalars, and stops whatever it started,
    whatever raises. An algorithm without an exchanger keeps x̃ on the job itself (job.center).
    """

    server = None  # the exchanger, for an algorithm that has one
    watched = None  # the Watch that followed the workers (its losses and rejoins), for an algorithm with an exchanger
    stealing = None  # (the workers' record Ranges, records per block) where they steal record blocks (shards.stealing)
    own_sc = None  # the SparkContext run() started, until stop_session stops it

    @property
    def title(self):
        """In the log's "Solving" line and the plot."""
        return self.algorithm.title(self.ds)

    def center_flat(self):
        """A copy of x̃ as one float32 vector."""
        return self.algorithm.center_flat(self)

    def run_workers(self, task, train_worker, timeout, barrier=False):
        """One long Spark task per worker, each `executor.run` with the algorithm's loop `train_worker(trainer,
        client, params)` (joining the center within `timeout` seconds), followed through the exchanger (watch);
        their Summaries. Each worker's task is a Spark job of its own, so that one leaves the job or joins it
        again alone (min_workers); barrier: Spark's barrier execution mode, all N tasks together in one job."""
        stage = self.shards.barrier() if barrier else self.shards
        done = stage.mapPartitionsWithIndex(lambda i, items: [executor.run(i, items, task, train_worker, timeout)])
        if barrier:
            # The shuffle after a barrier stage makes it a ShuffleMapStage, which Spark reruns whole when
            # a task fails (a barrier ResultStage fails the job instead).
            return self.watch(lambda: done.repartition(1).collect(), barrier=True)
        return self.watch(run_worker=lambda worker: self.sc.runJob(done, lambda summaries: summaries, [worker]))

    def run_rounds(self, task, train_round, update_center):
        """Rounds without an exchanger (spark/rounds.py): the center broadcast, `train_round(trainer, steps)` on
        every worker, `update_center(job, returned)` on the driver; the workers' Summaries."""
        progress = display(self.workers, schedule.stop_iteration(self.param), batch_size(self.graph))
        try:
            return rounds.run_rounds(self, task, train_round, update_center, progress.draw)
        finally:
            progress.close()

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
                              options=ExchangeOptions.of(ds), shapes=[tuple(p.shape) for p in self.graph.params],
                              resume_iteration=self.start_iter, history_sets=self.history_sets,
                              histories=self.resume_histories).start()

    def watch(self, run_tasks=None, barrier=False, run_worker=None):
        """Run the Spark job (`run_tasks()`, in a barrier stage or not) or each worker's (`run_worker(w)`) and
        follow the workers through the exchanger (Watch), their failures counted against the job's budget, a worker
        that cannot go on leaving as far as min_workers allows; the workers' results."""
        self.watched = Watch(self.sc, self.server, self.cadence, self.workers, schedule.stop_iteration(self.param),
                             self.ds.connect_timeout, batch_size(self.graph), budget=Budget(Limits.of(self.ds)),
                             stops=setting(self.sc, "spark.task.maxFailures") == str(WATCHED_ATTEMPTS),
                             barrier=barrier, min_workers=self.ds.min_workers)
        return self.watched.run(run_tasks, run_worker)

    # -- the run ----------------------------------------------------------------

    def run(self, plan):
        """The whole job of JobPlan `plan`; its JobResult."""
        self.plan, self.algorithm = plan, plan.algorithm
        self.solver, self.param, self.ds = plan.solver, plan.solver.param, plan.solver.param.deepspark_param
        self.options, self.workers, self.output, self.history_sets = (plan.options, plan.workers, plan.output,
                                                                      plan.history_sets)
        with contextlib.ExitStack() as stack:
            run_log = stack.enter_context(Log(train_log(self.output), append=bool(self.options.snapshot)))
            stack.enter_context(run_log.details(JobError))  # a failure's whole report to the log file alone
            self.started = time.monotonic()
            if self.options.data is not None:
                self.sc = this_python(self.options.data.sparkSession.sparkContext)  # the caller's: theirs to stop
            else:
                shards.train_source(self.solver)  # a missing LMDB is said before Spark starts
                # An algorithm with an exchanger is watched: the driver's budget counts its failures, not Spark.
                self.sc, own = spark_context(self.ds, self.workers, watched=self.algorithm.exchanger)
                if own:
                    self.own_sc = self.sc
                    stack.callback(self.stop_session)
            stack.enter_context(quiet_tasks(self.sc))
            warn_if_the_secret_is_readable(self.sc)
            ship_python_layers(self.sc, self.solver)
            self.task = self.start(stack)
            log.info(f"Solving {self.graph.name} on {self.sc.master} with {self.workers} workers "
                     f"({self.ds.backend} backend, {self.title})")
            log.info(executor.order_line(self.param, self.stealing is not None))
            if schedule.stop_note(self.param):
                log.info(schedule.stop_note(self.param))
            if schedule.scaling_line(self.param):
                log.info(schedule.scaling_line(self.param))
            self.submitted = time.time()  # the workers' ready_at is in the same clock
            results = self.train()
            self.stop_session()  # its executors and Python workers are done: their memory goes before the last test
            return self.finish(results)

    def train(self):
        """The algorithm's training (its workers' Summaries); a job that stops early (StopSignals, or a JobError)
        is snapshotted (stopped_early) and its Spark session stopped before the exception goes on. An error raised
        while a signal's interrupt went out through Py4J (failures.interrupted) is that interrupt."""
        try:
            with StopSignals():
                return self.algorithm.train(self, self.task)
        except (KeyboardInterrupt, Exception) as error:
            stop = interrupted(error) or error
            if not isinstance(stop, (KeyboardInterrupt, JobError)):
                raise
            self.stopped_early(stop)
            if self.own_sc is not None:  # Spark's errors about the tasks its stop kills are no news
                with contextlib.suppress(Exception):
                    self.own_sc.setLogLevel("OFF")
            self.stop_session()  # the workers go before the exchanger does, or each says it lost it
            if stop is error:
                raise
            raise stop from None

    def stopped_early(self, error):
        """Before a job that stops early (SIGINT, SIGHUP, Spark's retries spent, its workers lost) exits, its
        center (intact: held by the driver) snapshotted with the workers' solver states the driver holds, as
        Caffe's Solve does when a signal stops it; not after a divergence, whose center is suspect."""
        if _DIVERGED.search(str(error)) or not rules.all_finite(self.center_flat()):
            return
        why = ("SIGHUP" if isinstance(error, HungUp) else "SIGINT" if isinstance(error, KeyboardInterrupt)
               else "the job failed")
        try:
            self.cadence.stop_early(why)
        except Exception as failure:  # the job's own error is the one to report
            log.warning(f"could not snapshot x̃ as the job stopped: {failure}")

    def start(self, stack):
        """The shards planned, x̃ at its start and held, the test nets and the scalars up (each stopped by
        `stack`); the Task every worker receives."""
        self.shards, shape = shards.plan(self.sc, self.solver, self.options.data, self.workers, self.ds.ship_records)
        self.stealing, line = shards.stealing(self.ds, self.algorithm, self.solver, self.options.data, self.workers)
        log.info(line)
        self.load_center(shape)
        host = "127.0.0.1" if on_loopback(self.sc.master) else setting(self.sc, "spark.driver.host")
        secret = secrets.token_hex(32)
        center = np.concatenate([a.reshape(-1) for a in self.center0]).astype(np.float32)
        self.server = self.algorithm.hold_center(self, center, host, secret)
        if self.server is not None:
            stack.callback(self.server.stop)
            if self.ds.exchange_address:
                log.info(f"Workers connect to the exchanger through {self.ds.exchange_address}")
        self.cadence = CenterCadence(self.solver, self.graph, self.start_iter, self.center_flat,
                                     server=self.server, history_sets=self.history_sets,
                                     history_seconds=min(HISTORY_SECONDS, self.ds.exchange_timeout),
                                     started=self.started)
        stack.callback(self.cadence.close)
        self.cadence.start(os.path.join(self.output, "tensorboard"))
        threads, line = threads_line(self.sc, self.workers, self.ds.worker_threads)
        log.info(line)
        return Task(job_id=uuid.uuid4().hex[:12], solver=self.param.SerializeToString(),
                    train_net=absolute_sources(self.solver.train_net).SerializeToString(),
                    solver_path=self.solver.path,
                    address=self.exchange_address(), secret=secret, threads=threads,
                    steal=self.stealing is not None)

    def load_center(self, shape):
        """x̃'s start (the graph, center0, the start iteration) and the solver histories a --snapshot holds
        for this job's workers."""
        workers = self.workers
        self.graph, self.center0, self.start_iter, histories = initial_center(
            self.solver, self.history_sets, self.options.weights, self.options.snapshot, shape)
        self.resume_histories = {w: held for w, held in histories.items() if w < workers}
        if self.resume_histories:
            log.info(f"Restoring the solver history of worker(s) {', '.join(map(str, sorted(self.resume_histories)))} "
                     f"(as each was at iteration "
                     f"{', '.join(str(held[0]) for _, held in sorted(self.resume_histories.items()))})")
        if len(self.resume_histories) < len(histories):
            log.warning(f"the snapshot holds the solver history of {len(histories)} workers; this job has {workers}: "
                        f"worker(s) {', '.join(str(w) for w in sorted(histories) if w >= workers)} left out")

    def stop_session(self):
        """Stop the SparkContext this job started (and Spark SQL's session on it, if it read Parquet), once."""
        if self.own_sc is not None:
            stop_context(self.own_sc)
            self.own_sc = None

    def restarts(self, results):
        """({worker: times it rejoined}, the Outages the watch saw: empty for a job without one)."""
        outages = self.watched.outages if self.watched is not None else Outages()
        return {r.worker: outages.restarts(r.worker) for r in results}, outages

    def finish(self, results):
        """The workers' summary lines, the last snapshot and test, the plot; the JobResult."""
        final = self.algorithm.final_iteration(self, results)
        spill = max(r.spill_seconds for r in results)
        restarts, outages = self.restarts(results)
        # A restarted worker's Summary is its last attempt's: the job's training is the Spark job's whole time.
        train = max([r.train_seconds for r in results] + ([self.watched.seconds] if outages.all else []))
        for r in sorted(results, key=lambda r: r.worker):
            log.info(f"Worker {r.worker} on {r.host} (in {r.cwd}, deepspark from {r.package}): "
                     f"{r.iterations} iterations, {r.exchanges} exchanges, spilled {r.records} records in "
                     f"{r.spill_seconds:.2f}s, trained {r.train_seconds:.1f}s, blocked on exchange "
                     f"{r.blocked_seconds:.2f}s, sent {r.sent_bytes / 1e6:.3g} MB and received "
                     f"{r.received_bytes / 1e6:.3g} MB through the exchanger, peak RSS {r.spill_rss_mb:.0f} MB after the spill, "
                     f"{r.peak_rss_mb:.0f} MB"
                     + (f"; GPU {r.gpu} from Spark, computed on {r.device}" if r.gpu else
                        f"; computed on {r.device}" if r.device != "CPU" else "")
                     + ("" if r.restored_history is None else
                        f"; started from its solver history of iteration {r.restored_history}")
                     + (f"; its last of {restarts[r.worker] + 1} attempts" if restarts[r.worker] else ""))
        unused = [r for r in results if r.gpu and r.device == "CPU"]
        if unused:
            log.warning(f"Spark gave {len(unused)} of the workers a GPU, but the {self.ds.backend} backend saw none "
                        f"there ({', '.join(sorted({r.host for r in unused}))}): they trained on the CPU")
        # A restarted worker's start-up is its last attempt's, from its task's start (not from Solving).
        startup = {r.worker: r.startup(r.task_at if restarts[r.worker] else self.submitted)
                   for r in results if r.first_step_at}
        for worker, parts in sorted(startup.items()):
            since = (f"its task's start (attempt {restarts[worker] + 1})" if restarts[worker] else "Solving")
            log.info(f"Start-up of worker {worker}: {sum(parts.values()):.2f}s from {since} to its first step done: "
                     + ", ".join(f"{part} {seconds:.2f}s" for part, seconds in parts.items()))
        log.info(f"Spill took {spill:.2f}s, {100 * spill / max(train, 1e-9):.2f}% of training time")
        ready = max([r.ready_at for r in results if not restarts[r.worker]], default=0.0) - self.submitted
        if ready > 0:  # not so when no worker spilled in this run (every ready_at 0)
            log.info(f"Shards ready {ready:.1f}s after the Spark job started (Spark's read of the data, any shuffle, "
                     f"then the spill), {100 * ready / max(train, 1e-9):.2f}% of training time")
        if outages.all:
            log.info(outages.summary(time.monotonic()))
        left = self.watched.left if self.watched is not None else {}
        if left:
            log.info(f"Trained on {len(results)} of {self.workers} workers to the end: "
                     + "; ".join(f"worker {w} left ({why})" for w, why in sorted(left.items())))
        weights, values, arrays = self.cadence.finish(final)
        log.info("Optimization Done.")
        plot_path = self.cadence.plot(self.output, f"{self.graph.name}: {self.workers} workers, {self.title}")
        log.info(f"Plot of loss and test outputs against time: {plot_path}")
        summary = {"iterations": final, "weights": weights, "spill_seconds": spill, "ready_seconds": max(ready, 0.0),
                   "train_seconds": train, "wall_seconds": time.monotonic() - self.started,
                   "losses": len(outages.all), "rejoins": sum(restarts.values()), "left": sorted(left),
                   "lost_seconds": sum(o.cost(time.monotonic()) for o in outages.all),
                   "startup_seconds": max((sum(parts.values()) for parts in startup.values()), default=None),
                   "workers": [dataclasses.asdict(r) for r in sorted(results, key=lambda r: r.worker)], **values}
        return JobResult(summary, self.output, history=tuple(self.cadence.history), final_test=dict(values),
                         weights=tuple(checkpoint.layer_blobs(self.graph, arrays)),
                         snapshots=tuple(self.cadence.snapshots), started=self.started)


def train(solver, data=None, *, deepspark=None, weights=None, snapshot=None, iterations=None, output=None, **knobs):
    """Train from a solver .prototxt (a path, or a loaded config.Solver); returns its JobResult (`.summary`: the
    summary dict, `.history`, `.weights` in memory; the same for every algorithm).

    data: a Spark DataFrame to train on instead of the train net's source, with a
    `datum` column (Caffe Datum bytes) or `data` (an image array) and `label`
    columns; its SparkSession runs the job and stays the caller's. deepspark: a
    DeepSparkParameter prototxt (default: deepspark.prototxt beside the solver,
    if there is one) over the solver's own deepspark_param block. weights: a
    .caffemodel to start from; snapshot: a .solverstate to resume; iterations:
    the iteration training stops at (max_iter, and so the learning-rate
    schedule, as the solver says); output: the folder for snapshots and logs; knobs: any
    DeepSparkParameter field by name (workers=4, algorithm="sync", period=10,
    moving_rate=0.45, ...), over both.
    """
    solver = load_solver(solver, deepspark) if isinstance(solver, str) else solver
    override(solver, iterations=iterations, output=output, **knobs)
    algorithm = algorithms.of(solver.param.deepspark_param)
    algorithm.check(solver.param.deepspark_param, solver.path)
    options = Options(weights=weights, snapshot=snapshot, data=data)
    if not algorithm.spark:
        return algorithm.run(solver, options)
    return Job().run(JobPlan.of(solver, options, algorithm))
