"""The executor side: spill the shard to a local LMDB, build the backend, train, exchange every period."""

import math
import os
import shutil
import socket
import tempfile
import time

from deepspark import rules
from deepspark.config import Solver
from deepspark.errors import DeepSparkError, SourceMap
from deepspark.data import lmdb_io
from deepspark.proto import deepspark_pb2 as pb


class WorkerError(DeepSparkError):
    """A worker that cannot go on (lost driver, bad shard): the message says why."""


def local_dir():
    """Where this executor may write: Spark's local directory, else the temp folder."""
    for variable in ("SPARK_LOCAL_DIRS", "SPARK_EXECUTOR_DIRS"):
        value = os.environ.get(variable)
        if value:
            return value.split(",")[0]
    return tempfile.gettempdir()


def spill(payload, job_id, worker):
    """Write this worker's shard to a local LMDB (DeepSpark's spill step); (path, records, seconds)."""
    started = time.monotonic()
    folder = os.path.join(local_dir(), f"deepspark-{job_id}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"shard-{worker}-{os.getpid()}_lmdb")
    if os.path.exists(path):
        shutil.rmtree(path)
    kind = payload[0]
    if kind == "records":
        records = payload[1]
    elif kind == "range":
        _, source, start, stop = payload
        if not os.path.exists(source):
            raise WorkerError(f"worker {worker} on {socket.gethostname()}: LMDB {source} is not visible here; "
                              "drop --shared-data to ship the records through Spark")
        records = lmdb_io.read_records(source, start, stop)
    else:
        raise WorkerError(f"unknown shard payload {kind!r}")
    count = lmdb_io.write_lmdb(path, records)
    return path, count, time.monotonic() - started


def payload_of(items):
    """A partition's content as a spill payload: one ("records"|"range", ...) tuple, or (key, value) records."""
    items = list(items)
    if len(items) == 1 and isinstance(items[0], tuple) and items[0][0] in ("records", "range"):
        return items[0]
    return ("records", items)


def row_to_record(index, row):
    """(key, Datum bytes) of a DataFrame row: its `datum` bytes, or its `data` array and `label`."""
    import numpy as np

    from deepspark.data import encode_datum

    fields = row.asDict() if hasattr(row, "asDict") else dict(row)
    if "datum" in fields:
        value = bytes(fields["datum"])
    else:
        image = np.asarray(fields["data"])
        if image.ndim == 2:
            image = image[None]
        if image.dtype != np.uint8:
            image = image.astype(np.float32)
        value = encode_datum(image, int(fields["label"]))
    return b"%08d" % index, value


def _solver_for_worker(job, shard_path):
    """The job's solver with the train net's Data layers reading the local shard."""
    param = pb.SolverParameter.FromString(job["solver"])
    net = pb.NetParameter.FromString(job["train_net"])
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = shard_path
    return Solver(param, "<job solver>", net, SourceMap(job.get("solver_path", "<job solver>")), [])


def set_threads(threads):
    """Keep N workers on one machine from oversubscribing its cores (before the backend starts)."""
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = str(threads)
    os.environ["DEEPSPARK_THREADS"] = str(threads)


def place():
    """Where this worker runs, for the driver's summary lines."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "cwd": os.getcwd()}


def build(worker, payload, job):
    """Spill the shard and build the worker's Trainer: (trainer, shard path, records, spill seconds)."""
    from deepspark.log import Log
    from deepspark.solver import Trainer

    set_threads(job["threads"])
    shard_path, records, spill_seconds = spill(payload, job["id"], worker)
    solver = _solver_for_worker(job, shard_path)
    try:
        # The log goes to the executor's stderr, which Spark keeps in the executor's log.
        trainer = Trainer(solver, solver.param.deepspark_param.backend, Log(progress=False), evaluate=False,
                          shard=0, num_shards=1, seed_offset=worker)
    except BaseException:
        shutil.rmtree(shard_path, ignore_errors=True)
        raise
    return trainer, shard_path, records, spill_seconds


def join_center(worker, job, model, timeout):
    """Connect to the driver's exchanger and start (or rejoin) from x̃ at the iteration it reports."""
    from deepspark.exchange import ExchangeClient

    client = ExchangeClient(tuple(job["address"]), job["secret"], worker, shapes=model.param_shapes,
                            timeout=timeout, connect_timeout=min(timeout, 30.0))
    try:
        client.connect()
        params = client.pull(model.get_flat())
    except OSError as error:
        raise WorkerError(f"worker {worker} on {socket.gethostname()} cannot reach the driver's exchanger at "
                          f"{job['address'][0]}:{job['address'][1]}: {error}") from None
    model.set_flat(params)
    model.iter = client.resume_iteration  # 0, a resumed job's, or this worker's before a retry
    return client, params


def run(worker, payload, job):
    """One worker's whole life in a Spark task; returns a summary dict for the driver."""
    trainer, shard_path, records, spill_seconds = build(worker, payload, job)
    solver, model = trainer.solver, trainer.model
    ds = solver.param.deepspark_param
    try:
        client, params = join_center(worker, job, model, ds.exchange_timeout)
        start_iter = model.iter
        schedule = rules.ExchangeSchedule(ds.period, adaptive=ds.adaptive_period)
        started = time.monotonic()
        loss = math.nan
        while model.iter < solver.param.max_iter:
            loss = trainer.step()
            if client.pending and client.ready:
                params = model.get_flat(params)
                client.poll(params)
                model.set_flat(params)
            if schedule.step(loss):
                params = model.get_flat(params)
                if client.pending:  # the previous difference first, so the snapshot includes it
                    client.wait(params)
                    model.set_flat(params)
                if ds.overlap:
                    client.exchange_async(params, model.iter, loss)
                else:
                    client.exchange(params, model.iter, loss)
                    model.set_flat(params)
            elif not client.pending:
                client.report(model.iter, loss)
        params = model.get_flat(params)
        client.wait(params)
        client.exchange(params, model.iter, loss)  # the center gets the final state
        seconds = time.monotonic() - started
        summary = {"worker": worker, **place(), "records": records, "spill_seconds": spill_seconds,
                   "train_seconds": seconds, "iterations": model.iter - start_iter, "final_iteration": model.iter,
                   "exchanges": client.exchanges, "blocked_seconds": client.blocked_seconds, "loss": loss}
        client.close()
        return summary
    finally:
        trainer.close()
        shutil.rmtree(shard_path, ignore_errors=True)
