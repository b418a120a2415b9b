"""The executor side every job shares: what a task receives, the spill of its shard to a local LMDB, its Trainer, its way to the center, its summary (imported as `executor`)."""

import collections
import dataclasses
import functools
import itertools
import logging
import math
import os
import re
import resource
import shutil
import socket
import sys
import tempfile
import time

import numpy as np

import deepspark
from deepspark import nets, schedule
from deepspark.algorithms.base import WorkerError
from deepspark.backends import BACKENDS, backend_module, use_gpu
from deepspark.config import Solver, random_seed
from deepspark.data import checked_records, decode_datum, lmdb_io
from deepspark.data.claimed import HELD_BLOCKS
from deepspark.data.feeder import BLOCK_BYTES, STREAM_WINDOW_BYTES, DataFeeder
from deepspark.errors import SourceMap
from deepspark.exchange import ExchangeClient, ExchangeOptions
from deepspark.exchange.protocol import E_DIVERGED
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.shards import Listed, Range, unreadable_lmdb

# In a worker process no run's Log is open: its lines go to the process's console, stderr, which Spark keeps in the
# executor's log (deepspark.log.CONSOLE).
log = logging.getLogger(__name__)

# Seconds a worker tries to reach the driver's exchanger before it gives up (capped by exchange_timeout):
# long enough for a driver busy starting its other workers' tasks.
CONNECT_SECONDS = 30.0
# A training job's way on, beside the ones every executor has, for an LMDB it cannot see.
WAYS_ON = (" and train from that, or ship its records through the driver with --ship-records (bounded by the "
           "driver's memory)")


@dataclasses.dataclass(frozen=True)
class Task:
    """What every Spark task of a job receives from the driver (pickled into the task's closure).

    job_id: names the job's local folders; solver, train_net: the serialized
    SolverParameter and train NetParameter; solver_path: for error messages;
    address: (host, port) of the driver's exchanger, None for a job without
    one; secret: the job's exchange secret; threads: compute threads per worker;
    steal: the train Data layer reads the record blocks the exchanger's ledger grants (work stealing), not its
    own shard alone.
    """

    job_id: str
    solver: bytes
    train_net: bytes
    solver_path: str
    address: tuple = None
    secret: str = ""
    threads: int = 1
    steal: bool = False

    @functools.cached_property
    def param(self):
        """The SolverParameter, parsed once per process that reads it."""
        return pb.SolverParameter.FromString(self.solver)

    def solver_for(self, shard_path):
        """The job's solver with the train net's Data layers reading the local shard (None: as they are)."""
        net = pb.NetParameter.FromString(self.train_net)
        for layer in net.layer:
            if layer.type == "Data" and shard_path is not None:
                layer.data_param.source = shard_path
        return Solver(self.param, self.solver_path, net, SourceMap(self.solver_path), [])


@dataclasses.dataclass
class Summary:
    """One worker's account of its run, for the driver's summary lines."""

    worker: int
    host: str = ""
    pid: int = 0
    cwd: str = ""
    package: str = ""  # where this executor imported deepspark from
    records: int = 0
    spill_seconds: float = 0.0
    train_seconds: float = 0.0
    iterations: int = 0
    final_iteration: int = 0
    exchanges: int = 0
    blocked_seconds: float = 0.0
    sent_bytes: int = 0  # through the exchanger, frames with their headers and tags (exchange_codec's)
    received_bytes: int = 0
    gpu: str = ""  # the GPU address Spark's resource scheduling gave its task, if any
    device: str = "CPU"  # where its backend computed: "GPU:0" (CUDA's numbering in its process) or "CPU"
    loss: float = float("nan")
    digest: str = ""  # sync: a fingerprint of the parameters after the last round
    spill_rss_mb: float = 0.0  # the worker process's peak RSS in this task when its spill was done
    peak_rss_mb: float = 0.0  # and at the end of its training
    ready_at: float = 0.0  # when its spill was done (time.time())
    restored_history: int = None  # the iteration of the solver history it started from (a resumed job's), if any
    # Its start-up, in the order it runs (the spill's seconds above): when its Python worker process was forked
    # and when its task began there (time.time(), 0 where unknown), then each step's seconds, and when its first
    # step was done. The driver's start-up line and bench/startup.py read them.
    forked_at: float = 0.0
    task_at: float = 0.0
    import_seconds: float = 0.0  # this task's import of the backend (TensorFlow): 0 when the process had it
    preloaded: str = ""  # the backend its process had imported before its task began (the daemon's fork), if any
    carried_batches: int = 0  # the batches its feeders moved on as it joined: where a lost worker stood
    build_seconds: float = 0.0  # the model and feeders built, the import apart
    connect_seconds: float = 0.0  # joining the center: connect, pull x̃ and any solver history, move its feeders on
    first_step_seconds: float = 0.0  # the first step, which traces the backend's step function
    first_step_at: float = 0.0

    def startup(self, since):
        """Its start-up from `since` (time.time(): the driver's Solving line) to its first step done, in parts
        that add up to it: {part: seconds}; empty when it did not report one (a job without a first step here).
        A Python worker already running at `since` (Spark reused it, or forked it earlier) has no fork part."""
        if not self.first_step_at:
            return {}
        forked = min(max(self.forked_at, since), self.task_at)
        parts = {"fork": forked - since, "task start": self.task_at - forked, "spill": self.spill_seconds,
                 "import": self.import_seconds, "build": self.build_seconds, "connect": self.connect_seconds,
                 "first step": self.first_step_seconds}
        parts["other"] = self.first_step_at - since - sum(parts.values())
        return parts

    @classmethod
    def here(cls, worker, **fields):
        """A summary of worker `worker` running in this process."""
        return cls(worker, host=socket.gethostname(), pid=os.getpid(), cwd=os.getcwd(),
                   package=os.path.dirname(deepspark.__file__), **fields)


def peak_rss_mb():
    """This process's peak resident memory in MB since reset_peak_rss (Linux's VmHWM); else since it
    started (getrusage, which a Python worker that Spark reuses carries over from earlier tasks)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def process_started_at():
    """When this process started, as time.time() (Linux: its start in /proc, against the uptime, to 10 ms);
    0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
            booted = time.time() - float(uptime.read().split()[0])
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def reset_peak_rss():
    """Start peak_rss_mb afresh for this task (Linux: writing 5 to clear_refs resets VmHWM); a no-op
    where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def local_dir():
    """Where this executor may write: Spark's local directory, else the temp folder."""
    for variable in ("SPARK_LOCAL_DIRS", "SPARK_EXECUTOR_DIRS"):
        value = os.environ.get(variable)
        if value:
            return value.split(",")[0]
    return tempfile.gettempdir()


def job_dir(job_id):
    """This executor's folder of one job: its shards and hand-over states."""
    return os.path.join(local_dir(), f"deepspark-{job_id}")


def record_key(index):
    """The local LMDB's key of record `index` of a streamed shard: zero-padded, so key order is index order."""
    return b"%010d" % index


def shard_records(payload, worker):
    """The (key, Datum bytes) records of a shard, as a stream: read from its Range of the LMDB, or keyed
    from the (index, Datum bytes) pairs that Spark streams to the task.

    A Range's records are checked on the way (checked_records: no Datum, another shape than the
    LMDB's first record), here where the LMDB and the key are known; the local LMDB's reader would
    name only itself. Streamed records were checked where Spark read them (shards.parquet_records,
    shards.row_datum)."""
    if not isinstance(payload, Range):
        return ((record_key(index), datum) for index, datum in payload)
    unreadable = unreadable_lmdb(payload.source, payload.total, f"worker {worker}", WAYS_ON)
    if unreadable:
        raise WorkerError(unreadable)
    key, value = lmdb_io.first_record(payload.source)
    first, _ = decode_datum(value, key, payload.source)
    return checked_records(lmdb_io.read_records(payload.source, payload.start, payload.stop), payload.source,
                           first.shape, first.dtype)


def spill(payload, job_id, worker):
    """Stream this worker's shard into a local LMDB (DeepSpark's spill step) in batched transactions, so
    that memory does not grow with the shard; (path, records, seconds).

    A record range's spill is named by the range, and a lost worker's replacement on the same executor takes the
    spill its killed process left whole (lmdb_io publishes a spill only once it is complete) instead of writing the
    same records again; what dead processes of this worker left half-written, or spilled from a stream, is removed
    first, so a worker killed every few seconds does not fill the executor's disk with copies of its shard."""
    started = time.monotonic()
    folder = job_dir(job_id)
    os.makedirs(folder, exist_ok=True)
    remove_dead_spills(folder, worker)
    if isinstance(payload, Range):
        path = os.path.join(folder, f"shard-{worker}-{payload.start}-{payload.stop}_lmdb")
        if os.path.isdir(path):
            count = lmdb_io.count(path)
            if count == payload.stop - payload.start:
                return path, count, time.monotonic() - started
            shutil.rmtree(path)
    else:
        path = os.path.join(folder, f"shard-{worker}-pid{os.getpid()}_lmdb")
        shutil.rmtree(path, ignore_errors=True)
    count = lmdb_io.write_lmdb(path, shard_records(payload, worker))
    if not count:
        shutil.rmtree(path, ignore_errors=True)
        raise WorkerError(f"worker {worker} on {socket.gethostname()}: its shard is empty")
    return path, count, time.monotonic() - started


def remove_dead_spills(folder, worker):
    """Remove what processes of worker `worker` that are gone left in `folder`: a spill half-written (lmdb_io's
    .tmp-PID) or one of a streamed shard (pid PID), which no other process reads."""
    for name in os.listdir(folder):
        found = re.fullmatch(rf"shard-{worker}-(?:pid(\d+)_lmdb|.*_lmdb\.tmp-(\d+))", name)
        pid = found and int(found.group(1) or found.group(2))
        if pid and pid != os.getpid() and not process_alive(pid):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def process_alive(pid):
    """Whether process `pid` runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True


def payload_of(items):
    """A partition's shard, never held whole: its one Range to read or Listed share, or the stream of its
    (index, Datum bytes) records."""
    items = iter(items)
    first = next(items, None)
    if first is None:
        return iter(())
    if isinstance(first, (Range, Listed)):
        drain(items)  # to its end, which PySpark must see to reuse this Python worker
        return first
    return itertools.chain([first], items)


def drain(items):
    """Consume what is left of a partition's input: PySpark reuses a Python worker only after its task
    has read all of it."""
    collections.deque(items, maxlen=0)


def set_threads(threads):
    """Keep N workers on one machine from oversubscribing its cores: the native libraries loaded from
    here on (OpenMP, OpenBLAS, MKL) read these; the backend gets the count as its parameter."""
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = str(threads)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a worker's spill and build did, named as its Summary names it."""

    records: int
    spill_seconds: float
    spill_rss_mb: float  # the task's peak RSS when the spill was done
    ready_at: float  # when it was done (time.time())
    import_seconds: float = 0.0
    build_seconds: float = 0.0
    gpu: str = ""
    device: str = "CPU"
    preloaded: str = ""


class Diverged(WorkerError):
    """A worker's loss is no longer finite: the job stops rather than spread it (a worker restarted from the
    center at the same rate would diverge again)."""


def check_finite(worker, client, trainer, loss):
    """Trainer.on_step of a Spark worker: a worker whose loss became NaN or Inf stops before its parameters
    reach the exchanger (which would refuse them); it tells the server why, in the one line the driver
    stops the job with (a retry would diverge again at the same rate), and raises it."""
    if math.isfinite(loss):
        return
    model = trainer.model
    iteration = model.iter - 1  # the step that made the loss; the model has counted it
    rate = schedule.learning_rate(model.solver_param, iteration, model.current_step)[0]
    line = (f"worker {worker} diverged at iteration {iteration}: its loss is {loss} at learning rate {rate:g}; "
            f"lower base_lr (or set clip_gradients) and resume from the last snapshot")
    if client is not None:
        client.abort(E_DIVERGED, line)
    raise Diverged(line)


def build(worker, payload, task):
    """Spill the shard and build the worker's Trainer: (trainer, shard path or None, Prepared)."""
    set_threads(task.threads)
    reset_peak_rss()
    if isinstance(payload, Listed):  # the net's own layers read this worker's share: nothing to spill
        shard_path, records, spill_seconds, shard, shards = None, 0, 0.0, payload.shard, payload.shards
    else:
        (shard_path, records, spill_seconds), shard, shards = spill(payload, task.job_id, worker), 0, 1
    ready_at, spill_rss = time.time(), peak_rss_mb()
    try:
        began, backend = time.monotonic(), task.param.deepspark_param.backend
        preloaded = backend if BACKENDS[backend] in sys.modules else ""
        backend_module(backend)  # its import (TensorFlow's) timed apart from the build
        imported = time.monotonic()
        solver = task.solver_for(shard_path)
        gpu, device = place(worker, solver)
        trainer = nets.trainer(solver, shard=shard, num_shards=shards, rank=worker, threads=task.threads,
                               evaluate=False, spark=True)
        trainer.on_step = functools.partial(check_finite, worker, None)  # until it joins the center
    except BaseException:
        remove_shard(shard_path)
        raise
    prepared = Prepared(records, spill_seconds, spill_rss, ready_at, import_seconds=imported - began,
                        build_seconds=time.monotonic() - imported, gpu=gpu, device=device, preloaded=preloaded)
    return trainer, shard_path, prepared


def order_line(param, stealing=False):
    """The driver's line of the order every worker reads its train shard in (each worker's own log adds its
    blocks in records): data_order's on Spark, seeded by random_seed and the worker's rank (nets.worker_seed), as
    build seeds it; with `stealing`, through the blocks each worker holds claimed (DataFeeder.steal)."""
    seed = random_seed(param)
    return nets.order_line(nets.train_order(param.deepspark_param, spark=True),
                           None if seed is None else f"{seed} and the worker's rank",
                           buffer=HELD_BLOCKS * BLOCK_BYTES if stealing else STREAM_WINDOW_BYTES)


def task_gpu():
    """The address of the GPU Spark's resource scheduling gave this task (spark.task.resource.gpu.amount, as
    TensorFlowOnSpark and Horovod take theirs), or None; the first, where it gave several."""
    from pyspark import TaskContext  # deferred: pyspark is the executor's, loaded by the time a task runs

    context = TaskContext.get()
    gpus = None if context is None else context.resources().get("gpu")
    return gpus.addresses[0] if gpus is not None and gpus.addresses else None


def place(worker, solver):
    """Where worker `worker`'s backend computes, pinned before it builds a net: on the GPU Spark gave its task
    (made CUDA's only device in this process, as Spark's resource docs advise), else as the solver's
    solver_mode and device_id say (nets.place); (the GPU address from Spark or "", the device)."""
    address = task_gpu()
    if address is None:
        return "", nets.place(solver)
    os.environ["CUDA_VISIBLE_DEVICES"] = address
    where = use_gpu(solver.param.deepspark_param.backend, 0)
    log.info(f"worker {worker}: GPU {address} from Spark; the {solver.param.deepspark_param.backend} backend "
             + (f"runs on it ({where} in this process)" if where != "CPU" else
                f"sees no GPU on {socket.gethostname()}: it runs on the CPU"))
    return address, where


def join_center(worker, task, model, timeout):
    """Connect to the driver's exchanger and start (or rejoin) from x̃ at the iteration it reports, with the
    solver history it holds for this worker (a resumed job's, or what this worker last sent before a
    retry), if any; (client, params, the iteration that history was taken at or None)."""
    client = ExchangeClient(tuple(task.address), task.secret, worker,
                            options=ExchangeOptions.of(task.param.deepspark_param, timeout=timeout),
                            shapes=model.param_shapes, connect_timeout=min(timeout, CONNECT_SECONDS),
                            history_sets=model.history_sets)
    history = np.empty(model.history_sets * model.param_count, np.float32)
    try:
        client.connect()
        params = client.pull(model.get_flat())
        held = client.pull_history(history)
    except OSError as error:
        raise WorkerError(f"worker {worker} on {socket.gethostname()} cannot reach the driver's exchanger at "
                          f"{task.address[0]}:{task.address[1]}: {error}") from None
    model.set_flat(params)
    model.iter = client.resume_iteration  # 0, a resumed job's, or this worker's before a retry
    if held is not None:
        model.set_history_flat(history)
        model.current_step = held[1]
    return client, params, None if held is None else held[0]


def steal(task, trainer, client, payload):
    """With the job's ledger (task.steal), the train Data feeders read the record blocks it grants this worker
    through its exchange connection (DataFeeder.steal): its own range's from its spill, another's from the source
    LMDB, which every executor reads (shard_records checked it)."""
    if not task.steal or not isinstance(payload, Range):
        return

    def claim(wanted, done):
        return client.claim(wanted, done, task.param.deepspark_param.workers, payload.total)

    for feeder in trainer.feeders:
        if isinstance(feeder, DataFeeder):
            feeder.steal(claim, lambda: client.connections, payload.source, (payload.start, payload.stop))
            # The order line the build logged was of its own shard alone; from here the ledger's blocks are read.
            log.info(f"Data order: '{feeder.name}' reads the blocks the job's ledger grants (work stealing), "
                     f"{HELD_BLOCKS} of {feeder.blocks[0]} records held and shuffled together")


def carry_on(worker, trainer):
    """Move a joining worker's feeders to where it stood at the iteration it joins at, that iteration x iter_size
    batches into its shard, each epoch's order drawn on the way as its reading drew it (the same seed, nets.carry_on):
    a lost worker's replacement, and a resumed job's worker, carries on its shard from there, not from its start
    (epoch 0's order again). The batches moved on (0 at a new job's start)."""
    batches = trainer.model.iter * trainer.model.iter_size
    if batches <= 0:
        return 0
    log.info(f"worker {worker} carries on its shard at iteration {trainer.model.iter}: "
             f"{nets.carry_on(trainer, batches)}")
    return batches


def run(worker, items, task, train, timeout):
    """One worker's whole life in a Spark task: spill, build, join the center (waiting at most `timeout`
    seconds on it), `train(trainer, client, params)` -> (loss, extra Summary fields), leave; its Summary."""
    task_at = time.time()
    payload = payload_of(items)
    trainer, shard_path, prepared = build(worker, payload, task)
    model = trainer.model
    try:
        joining = time.monotonic()
        client, params, restored = join_center(worker, task, model, timeout)
        steal(task, trainer, client, payload)
        carried = carry_on(worker, trainer)
        connect_seconds = time.monotonic() - joining
        trainer.on_step = functools.partial(check_finite, worker, client)
        start_iter, started = model.iter, time.monotonic()
        loss, extra = train(trainer, client, params)
        first_step_at, first_step_seconds = trainer.first_step or (0.0, 0.0)
        summary = Summary.here(worker, train_seconds=time.monotonic() - started, iterations=model.iter - start_iter,
                               final_iteration=model.iter, exchanges=client.exchanges,
                               blocked_seconds=client.blocked_seconds, sent_bytes=client.sent_bytes,
                               received_bytes=client.received_bytes, loss=loss, peak_rss_mb=peak_rss_mb(),
                               restored_history=restored, forked_at=process_started_at(), task_at=task_at,
                               connect_seconds=connect_seconds, first_step_seconds=first_step_seconds,
                               first_step_at=first_step_at, carried_batches=carried, **dataclasses.asdict(prepared),
                               **extra)
        client.close()
        return summary
    finally:
        trainer.close()
        remove_shard(shard_path)


def remove_shard(shard_path):
    """Delete a worker's spilled shard (None: it spilled none)."""
    if shard_path:
        shutil.rmtree(shard_path, ignore_errors=True)
