"""Rounds without an exchanger, on Spark: broadcast the center, each worker's steps from it on a Trainer cached in its Python worker, collect; the driver's algorithm makes the next center (algorithms/average.py)."""

import dataclasses
import json
import logging
import os
import shutil
import time

import numpy as np

from deepspark import nets
from deepspark.schedule import stop_iteration
from deepspark.spark import executor
from deepspark.spark.failures import failed, first_line

log = logging.getLogger(__name__)


def run_rounds(job, task, train_round, update_center, draw):
    """Rounds to schedule.stop_iteration: each broadcasts the center (job.center), runs `train_round(trainer,
    steps)` on every worker from it, and hands what they returned (in worker order) to `update_center(job,
    returned)`; drives the cadence's tests, snapshots and display, and `draw`s each worker's iteration and loss
    after each round (progress.display's draw). The workers' Summaries."""
    p, ds = job.param, job.ds
    boundaries = [x for x in (p.test_interval, p.snapshot) if x and x % ds.period]
    if boundaries:
        log.info(f"Rounds also end at multiples of {' and '.join(map(str, boundaries))} (test_interval/snapshot "
                 f"not multiples of period {ds.period}), so that tests and snapshots fall on their iterations")
    iteration = job.start_iter
    workers = {}  # worker -> its running Summary
    handovers, restarts = {}, {}  # worker -> rounds it went on from another Python worker's state / restarted
    try:
        job.cadence.due(iteration)  # x̃ at its start: test_initialization's test
        while iteration < stop_iteration(p):
            steps = job.cadence.multiples.steps_from(iteration, ds.period)
            started = time.monotonic()
            returned = one_round(job, task, train_round, iteration, steps)
            update_center(job, returned)
            iteration += steps
            # The round's wall time less the slowest build (spill + backend) of this round.
            wall = time.monotonic() - started - max(r["build_seconds"] for r in returned)
            for r in returned:
                account(workers.setdefault(r["worker"], executor.Summary(r["worker"])), r, steps, wall,
                        handovers, restarts)
            draw({r["worker"]: {"iteration": iteration, "loss": r["loss"]} for r in returned})
            job.cadence.observe(iteration, float(np.mean([r["loss"] for r in returned])))
    finally:
        release_all(job, task.job_id)
    if handovers:
        log.info(f"Rounds that went on from a state another Python worker left (PySpark moved the partition): "
                 f"{handovers}; momentum and data position carried over through the executor's local folder")
    if restarts:
        log.warning(f"Rounds that found no state of their worker's last round (moved to another executor): "
                    f"{restarts}; each restarted that worker's momentum history (its data position moved on)")
    return list(workers.values()) or [executor.Summary.here(0, final_iteration=iteration)]


def one_round(job, task, train_round, iteration, steps):
    """One round on the executors: each worker's `steps` iterations from the broadcast center at
    `iteration`; what each returned (worker_round's), in worker order."""
    center = job.sc.broadcast(job.center)
    try:
        # job.shards is not persisted: a shard is one Range, or a shuffle's output, which Spark
        # keeps and each round streams again (drained); cached, it would sit in executor memory.
        returned = job.shards.mapPartitionsWithIndex(
            lambda i, items: [worker_round(i, items, task, train_round, center.value, iteration, steps)]).collect()
    except Exception as error:
        raise failed(error, job.sc) from None
    finally:
        center.destroy()
    return sorted(returned, key=lambda r: r["worker"])


def release_all(job, job_id):
    """Close the cached Trainers and local shards of this job wherever the tasks land (best effort)."""
    try:
        job.sc.parallelize(range(job.workers), job.workers).foreach(lambda _: release(job_id))
    except Exception as error:  # cleanup only; the executors' temp folders go with them anyway
        log.warning(f"could not release the workers' cached trainers: {first_line(error)}")


def account(summary, r, steps, wall, handovers, restarts):
    """A worker's round `r` (worker_round's) added to its running Summary, and to the counts of rounds it
    went on from another Python worker's state (handovers) or restarted from none (restarts)."""
    w = r["worker"]
    if r["handed_over"]:
        handovers[w] = handovers.get(w, 0) + 1
    elif r["handed_over"] is not None and summary.exchanges:
        restarts[w] = restarts.get(w, 0) + 1
    summary.host, summary.pid, summary.cwd, summary.loss = r["host"], r["pid"], r["cwd"], r["loss"]
    summary.package = r["package"]
    summary.final_iteration = r["iteration"]
    summary.iterations += steps
    summary.exchanges += 1
    summary.train_seconds += wall
    summary.blocked_seconds += max(wall - r["seconds"], 0.0)
    summary.peak_rss_mb = max(summary.peak_rss_mb, r["peak_rss_mb"])
    if r["spilled"] is not None:
        summary.records, summary.ready_at = r["spilled"]["records"], r["spilled"]["ready_at"]
        summary.spill_seconds += r["spilled"]["spill_seconds"]
        summary.spill_rss_mb = max(summary.spill_rss_mb, r["spilled"]["spill_rss_mb"])


# Per Python worker process: the Trainer of each (job id, worker) it has run a round for, so that
# rounds reuse the backend (Spark reuses Python workers, spark.python.worker.reuse). A partition that
# lands on another process builds there (a cache miss), from the partition's own shard.
_TRAINERS = {}


def worker_round(worker, items, task, train_round, center, iteration, steps):
    """One worker's round: from the broadcast center at `iteration`, train_round's `steps` local iterations;
    returns its parameters."""
    key = (task.job_id, worker)
    built = time.monotonic()
    spilled = None
    if key not in _TRAINERS:
        for other in [k for k in _TRAINERS if k[0] != task.job_id]:
            release(other[0])
        trainer, shard_path, spilled = executor.build(worker, executor.payload_of(items), task)
        _TRAINERS[key] = (trainer, shard_path)
    # Read the partition even when it is not needed, without holding it: the cache lives in this
    # Python worker, and PySpark reuses one only after its task has consumed all of its input.
    executor.drain(items)
    built = time.monotonic() - built
    trainer = _TRAINERS[key][0]
    model = trainer.model
    handed = None
    if model.iter != iteration:
        # Another Python worker of this executor ran this worker's last round (PySpark does not
        # keep a partition on one process): go on from the state it left, not from our stale one.
        handed = take_over(trainer, task.job_id, worker, iteration)
        if not handed and iteration > model.iter:  # a fresh or stale Trainer: its feeders to where the worker stood
            nets.carry_on(trainer, (iteration - model.iter) * model.iter_size)
    model.set_flat(np.asarray(center, dtype=np.float32))
    model.iter = iteration
    started = time.monotonic()
    loss = train_round(trainer, steps)
    hand_over(trainer, task.job_id, worker)
    here = executor.Summary.here(worker)
    return {"worker": worker, "host": here.host, "pid": here.pid, "cwd": here.cwd, "package": here.package,
            "params": model.get_flat(),
            "iteration": model.iter, "loss": loss, "seconds": time.monotonic() - started, "build_seconds": built,
            "spilled": spilled and dataclasses.asdict(spilled), "peak_rss_mb": executor.peak_rss_mb(), "handed_over": handed}


def _handoff_path(job_id, worker):
    return os.path.join(executor.job_dir(job_id), f"worker{worker}.state.npz")


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
        executor.remove_shard(shard_path)
    shutil.rmtree(executor.job_dir(job_id), ignore_errors=True)
    return []
