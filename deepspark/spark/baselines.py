"""The baselines beside async EASGD: sync averaging (CaffeOnSpark-style) and periodic model averaging (SparkNet-style).

sync averages every worker's parameters each iteration; average runs
period τ local iterations per partition, then averages through Spark.
"""

import json
import math
import os
import shutil
import socket
import time
import zlib

import numpy as np

from deepspark import rules
from deepspark.spark import worker as worker_module
from deepspark.spark.driver import Job, JobError, _first_line, executor_report


def digest(params):
    """A short fingerprint of a parameter vector, to show in the log that workers agree."""
    return f"{zlib.crc32(np.ascontiguousarray(params).view(np.uint8)):08x}"


# ---- sync: every worker's parameters averaged every iteration ----------------

class SyncJob(Job):
    """Synchronous SGD by parameter averaging after every iteration: the exchanger in synchronous mode
    (a round barrier on the driver) and Spark's barrier execution mode, so that all N tasks start together."""

    title = "synchronous averaging every iteration"

    def start_exchanger(self, center, host):
        from deepspark.exchange import ExchangeServer

        ds = self.ds
        server = ExchangeServer(center, self.secret, 1.0, host=host, port=0,
                                shapes=[tuple(p.shape) for p in self.graph.params],
                                idle_timeout=ds.exchange_timeout, round_timeout=ds.exchange_timeout,
                                resume_iteration=self.start_iter, sync_workers=self.workers).start()
        self.log.info(f"Exchanger listening on {server.address[0]}:{server.address[1]}; {self.workers} workers "
                      f"averaged every iteration (synchronous rounds, timeout {ds.exchange_timeout:g}s)")
        if ds.HasField("period") and ds.period != 1:
            self.log.warning(f"sync averages every iteration; period {ds.period} is not used")
        return server

    def run_tasks(self):
        job = self.job
        # The shuffle after the barrier stage makes it a ShuffleMapStage, which Spark reruns
        # whole when a task fails (a barrier ResultStage fails the job instead): every worker
        # then rejoins at the last completed round.
        return self.shards.barrier().mapPartitionsWithIndex(
            lambda i, items: [sync_worker(i, worker_module.payload_of(items), job)]).repartition(1).collect()

    def finish(self):
        digests = {r["digest"] for r in self.results}
        center = digest(self.center_flat())
        agree = "yes" if digests == {center} else "NO"
        self.log.info(f"Workers hold the center after the last round: {agree} "
                      f"(crc32 {', '.join(r['digest'] for r in sorted(self.results, key=lambda r: r['worker']))}; "
                      f"center {center})")
        super().finish()


def sync_worker(worker, payload, job):
    """One worker of the sync job in a barrier task: a local step, then the round's mean, every iteration."""
    from deepspark.exchange import RefusedError

    trainer, shard_path, records, spill_seconds = worker_module.build(worker, payload, job)
    ds = trainer.param.deepspark_param
    where = f"worker {worker} on {socket.gethostname()}"
    try:
        model = trainer.model
        # The server fails a round that cannot complete after exchange_timeout with the reason;
        # the client waits a little longer so that the reason, not a bare timeout, is what it reports.
        # Every worker restarts at the last completed round.
        client, params = worker_module.join_center(worker, job, model, ds.exchange_timeout + 10)
        start_iter = model.iter
        started, loss = time.monotonic(), math.nan
        while model.iter < trainer.param.max_iter:
            loss = trainer.step()
            params = model.get_flat(params)
            try:
                client.average(params, model.iter, loss)
            except RefusedError as error:
                raise worker_module.WorkerError(f"{where}: {error.reason}") from None
            except OSError as error:
                raise worker_module.WorkerError(
                    f"{where}: no average from the driver's exchanger for iteration {model.iter} within "
                    f"{client.timeout:g}s ({error or type(error).__name__})") from None
            model.set_flat(params)
        summary = {"worker": worker, **worker_module.place(), "records": records, "spill_seconds": spill_seconds,
                   "train_seconds": time.monotonic() - started, "iterations": model.iter - start_iter,
                   "final_iteration": model.iter, "exchanges": client.exchanges,
                   "blocked_seconds": client.blocked_seconds, "loss": loss, "digest": digest(params)}
        client.close()
        return summary
    finally:
        trainer.close()
        shutil.rmtree(shard_path, ignore_errors=True)


# ---- average: broadcast the center, τ local iterations, average, repeat -------

class AverageJob(Job):
    """SparkNet-style model averaging in pure Spark: each round broadcasts the center, every partition
    runs `period` local iterations from it on a Trainer cached in its Python worker, and the driver
    averages what they return (rules.average_models) into the next center."""

    @property
    def title(self):
        return f"model averaging every {self.ds.period} iterations"

    def start_exchanger(self, center, host):
        self.center = center  # no exchanger: the driver holds the center between rounds
        self.last_round = []  # (worker, parameters) of the last round, in worker order
        self.log.info(f"No exchanger: the center is broadcast every {self.ds.period} iterations and "
                      f"the {self.workers} workers' parameters averaged on the driver")
        return None

    def center_flat(self):
        return self.center.copy()

    def run(self):
        p, ds, log, sc = self.param, self.ds, self.log, self.sc
        if ds.period < 1:
            raise JobError("period must be at least 1 for the average algorithm")
        log.info(f"Solving {self.graph.name} on {sc.master} with {self.workers} workers "
                 f"({ds.backend} backend, {self.title})")
        boundaries = [x for x in (p.test_interval, p.snapshot) if x and x % ds.period]
        if boundaries:
            log.info(f"Rounds also end at multiples of {' and '.join(map(str, boundaries))} (test_interval/snapshot "
                     f"not multiples of period {ds.period}), so that tests and snapshots fall on their iterations")
        shards = self.shards.persist()
        job = self.job
        iteration = self.start_iter
        self.start_cadence()
        workers = {}  # worker -> running totals for its summary line
        try:
            while True:
                self.test_and_snapshot(iteration)
                if iteration >= p.max_iter:
                    break
                steps = int(min(ds.period, p.max_iter - iteration, self.next_test - iteration,
                                self.next_snapshot - iteration))
                started = time.monotonic()
                center = sc.broadcast(self.center)
                try:
                    returned = shards.mapPartitionsWithIndex(
                        lambda i, items: [average_round(i, items, job, center.value, iteration, steps)]).collect()
                except Exception as error:
                    raise JobError(f"the Spark job failed: {_first_line(error)}; {executor_report(sc)}") from None
                finally:
                    center.destroy()
                # collect + average_models rather than treeAggregate: the exact rule in worker order, and
                # per-worker stats; measured here with 2 LeNet workers the round cost the same (0.17 vs 0.15 s).
                returned.sort(key=lambda r: r["worker"])
                self.last_round = [(r["worker"], r["params"]) for r in returned]
                self.center = rules.average_models([r["params"] for r in returned])
                iteration += steps
                # The round's wall time less the slowest build (spill + backend) of this round.
                wall = time.monotonic() - started - max(r["build_seconds"] for r in returned)
                for r in returned:
                    w = workers.setdefault(r["worker"], {"worker": r["worker"], "iterations": 0, "exchanges": 0,
                                                         "train_seconds": 0.0, "blocked_seconds": 0.0,
                                                         "spill_seconds": 0.0, "handovers": 0,
                                                         "restarts": 0})
                    if r["handed_over"]:
                        w["handovers"] += 1
                    elif r["handed_over"] is not None and w["exchanges"]:
                        w["restarts"] += 1
                    w.update({k: r[k] for k in ("host", "pid", "cwd", "loss")})
                    w["final_iteration"] = r["iteration"]
                    w["iterations"] += steps
                    w["exchanges"] += 1
                    w["train_seconds"] += wall
                    w["blocked_seconds"] += max(wall - r["seconds"], 0.0)
                    if r["records"] is not None:
                        w["records"] = r["records"]
                        w["spill_seconds"] += r["spill_seconds"]
                self.display(iteration, float(np.mean([r["loss"] for r in returned])))
        finally:
            self._release(shards)
        moved = {w: s["handovers"] for w, s in workers.items() if s["handovers"]}
        if moved:
            log.info(f"Rounds that went on from a state another Python worker left (PySpark moved the partition): "
                     f"{moved}; momentum and data position carried over through the executor's local folder")
        restarted = {w: s["restarts"] for w, s in workers.items() if s["restarts"]}
        if restarted:
            log.warning(f"Rounds that found no state of their worker's last round (moved to another executor): "
                        f"{restarted}; each restarted that worker's momentum history and data order")
        self.results = list(workers.values()) or [{"worker": 0, "final_iteration": iteration, "iterations": 0,
                                                   "exchanges": 0, "records": 0, "spill_seconds": 0.0,
                                                   "train_seconds": 0.0, "blocked_seconds": 0.0,
                                                   **worker_module.place()}]
        self.finish()

    def _release(self, shards):
        """Close the cached Trainers and local shards of this job wherever the tasks land (best effort)."""
        job_id = self.job["id"]
        try:
            self.sc.parallelize(range(self.workers), self.workers).foreach(lambda _: release(job_id))
        except Exception as error:  # cleanup only; the executors' temp folders go with them anyway
            self.log.warning(f"could not release the workers' cached trainers: {_first_line(error)}")
        shards.unpersist()


# Per Python worker process: the Trainer of each (job id, worker) it has run a round for, so that
# rounds reuse the backend (Spark reuses Python workers, spark.python.worker.reuse). A partition that
# lands on another process builds there (a cache miss), from the partition's own shard.
_TRAINERS = {}


def average_round(worker, items, job, center, iteration, steps):
    """One worker's round: from the broadcast center at `iteration`, `steps` local iterations; returns its parameters."""
    # Read the partition even when it is not needed: PySpark reuses a Python worker only after
    # a task has consumed all of its input, and the cache lives in that worker.
    items = list(items)
    key = (job["id"], worker)
    built = time.monotonic()
    records = spill_seconds = None
    if key not in _TRAINERS:
        for other in [k for k in _TRAINERS if k[0] != job["id"]]:
            release(other[0])
        trainer, shard_path, records, spill_seconds = worker_module.build(worker, worker_module.payload_of(items), job)
        _TRAINERS[key] = (trainer, shard_path)
    built = time.monotonic() - built
    trainer = _TRAINERS[key][0]
    model = trainer.model
    handed = None
    if model.iter != iteration:
        # Another Python worker of this executor ran this worker's last round (PySpark does not
        # keep a partition on one process): go on from the state it left, not from our stale one.
        handed = take_over(trainer, job["id"], worker, iteration)
    model.set_flat(np.asarray(center, dtype=np.float32))
    model.iter = iteration
    started, loss = time.monotonic(), math.nan
    for _ in range(steps):
        loss = trainer.step()
    hand_over(trainer, job["id"], worker)
    return {"worker": worker, **worker_module.place(), "params": model.get_flat(), "iteration": model.iter, "loss": loss,
            "seconds": time.monotonic() - started, "build_seconds": built, "records": records,
            "spill_seconds": spill_seconds, "handed_over": handed}


def _handoff_path(job_id, worker):
    return os.path.join(worker_module.local_dir(), f"deepspark-{job_id}", f"worker{worker}.state.npz")


def hand_over(trainer, job_id, worker):
    """Leave this worker's solver history and data position in the executor's local folder (no pickle)."""
    arrays, meta = trainer.get_state()
    path = _handoff_path(job_id, worker)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as stream:
        np.savez(stream, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)


def take_over(trainer, job_id, worker, iteration):
    """Load the state the last round of `worker` left on this executor if it ended at `iteration`:
    True when taken over, False when there is none (another executor ran it; momentum restarts)."""
    try:
        with np.load(_handoff_path(job_id, worker), allow_pickle=False) as saved:
            meta = json.loads(str(saved["meta"]))
            if meta["iter"] != iteration:
                return False
            trainer.set_state({name: saved[name] for name in saved.files if name != "meta"}, meta)
    except FileNotFoundError:
        return False
    return True


def release(job_id):
    """Close this process's cached Trainers of a job and remove the job's local shards."""
    for key in [k for k in _TRAINERS if k[0] == job_id]:
        trainer, shard_path = _TRAINERS.pop(key)
        trainer.close()
        shutil.rmtree(shard_path, ignore_errors=True)
    shutil.rmtree(os.path.join(worker_module.local_dir(), f"deepspark-{job_id}"), ignore_errors=True)
    return []
