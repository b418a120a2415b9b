"""Elastic membership: the training's Spark jobs, a worker leaving the job when it cannot go on (as far as min_workers allows) and joining it again on an executor Spark grants."""

import dataclasses
import logging
import threading
import time
import uuid

from deepspark.spark.failures import JobError, executor_report, failed, first_line

log = logging.getLogger(__name__)
# Seconds the driver waits for the Spark job's thread once it has cancelled the job.
CANCEL_SECONDS = 30


@dataclasses.dataclass
class SparkJob:
    """One Spark job of the training, run in a thread of its own under its job group: its outcome, {"results":
    ...} or {"failure": the exception}, once it ends."""

    thread: threading.Thread
    group: str
    outcome: dict

    @classmethod
    def start(cls, sc, group, run):
        outcome = {}

        def spark_job():
            try:
                sc.setJobGroup(group, "DeepSpark training", False)  # the thread's own (pyspark's pinned threads)
                outcome["results"] = run()
            except Exception as error:  # reported by the watch with Spark's view
                outcome["failure"] = error

        thread = threading.Thread(target=spark_job, name=f"deepspark-spark-job-{group}", daemon=True)
        thread.start()
        return cls(thread, group, outcome)


@dataclasses.dataclass
class Membership:
    """The workers that are the job's and their Spark jobs: one of all the workers' tasks, or (elastic) one per
    worker, so that a worker leaves the job alone (its group cancelled) and joins it again alone.

    sc: the SparkContext; server: the ExchangeServer; losses: the Losses (losses.py) a leaving worker's loss is
    forgotten in, and whose looks list Spark's executors; connect_timeout: the seconds a worker has to (re)join
    before it leaves the job (min_workers) or, where every worker is needed, the job fails.
    """

    sc: object
    server: object
    losses: object
    workers: int
    connect_timeout: float
    # The fewest workers the job trains on (0: all of them), and whether it is a barrier stage (all of them).
    min_workers: int = 0
    barrier: bool = False
    group: str = dataclasses.field(default_factory=lambda: f"deepspark-{uuid.uuid4().hex[:12]}")
    # The workers that left and why, each worker's SparkJob (None: the single one of all), how many each has had,
    # by when (monotonic) each must connect, and every executor Spark has listed (a new one takes a worker that
    # left).
    left: dict = dataclasses.field(default_factory=dict)
    jobs: dict = dataclasses.field(default_factory=dict)
    started: dict = dataclasses.field(default_factory=dict)
    due: dict = dataclasses.field(default_factory=dict)
    granted: set = dataclasses.field(default_factory=set)
    run_worker: object = None

    def start(self, run_tasks=None, run_worker=None):
        """Start the training's Spark jobs: run_tasks(), one Spark job of every worker's task, or run_worker(w)
        for each worker w, its own Spark job of its one task; each worker is due to connect within
        connect_timeout."""
        self.run_worker = run_worker
        if run_worker is None:
            self.jobs[None] = SparkJob.start(self.sc, self.group, run_tasks)
        else:
            for worker in range(self.workers):
                self.start_worker(worker)
        self.due = dict.fromkeys(range(self.workers), time.monotonic() + self.connect_timeout)

    def members(self):
        """The workers that are the job's: each one that has not left."""
        return set(range(self.workers)) - set(self.left)

    def current(self):
        """The Spark jobs of the training: the single one, or each member's."""
        return [j for w, j in sorted(self.jobs.items(), key=str) if w not in self.left]

    def running(self):
        """Whether a Spark job of the training is still running."""
        return any(j.thread.is_alive() for j in self.current())

    def wait(self, seconds):
        """At most `seconds`, less if a Spark job of the training ends meanwhile."""
        alive = [j.thread for j in self.jobs.values() if j.thread.is_alive()]
        if alive:
            alive[0].join(seconds)

    def start_worker(self, worker):
        """Worker `worker`'s Spark job (run_worker's), in a job group of its own: its first or a later one."""
        self.started[worker] = self.started.get(worker, 0) + 1
        group = f"{self.group}-{worker}-{self.started[worker]}"
        self.jobs[worker] = SparkJob.start(self.sc, group, lambda: self.run_worker(worker))

    def cancel(self):
        """Cancel the training's Spark jobs and give each thread CANCEL_SECONDS to end."""
        self.sc.cancelAllJobs()
        for job in self.jobs.values():
            job.thread.join(CANCEL_SECONDS)

    def fewest(self):
        """The fewest workers the job trains on: min_workers, or (0, or a barrier stage) all of them."""
        return self.workers if self.barrier or not self.min_workers else self.min_workers

    def leave(self, worker, why):
        """Worker `worker` leaves the job for `why` (its Spark job cancelled) where the others are at least
        min_workers: None; else the one line that stops the job (`why` alone when every worker is needed)."""
        train_on = len(self.members()) - 1
        if self.run_worker is None or train_on < self.fewest():
            return why if self.fewest() == self.workers else (
                f"{why}; {train_on} of {self.workers} workers would train on, fewer than min_workers "
                f"{self.min_workers}")
        self.left[worker] = why
        self.losses.forget(worker)
        self.sc.cancelJobGroup(self.jobs[worker].group)
        # What the handler leased it past its last reported iteration goes to the others (Handler.release).
        self.server.handler.release(worker, self.server.stats().get(worker, {}).get("iteration", 0))
        log.warning(f"Worker {worker} left the job: {why}; {train_on} of {self.workers} workers train on "
                    f"(min_workers {self.fewest()}); it joins again if Spark grants a new executor")
        return None

    def ended(self):
        """Each member whose Spark job failed (Spark's own attempts spent: a SparkContext of the caller's, or
        max_failures 1) leaves, as far as min_workers allows; where one cannot, the job stops (the others' Spark
        jobs cancelled, as Spark's abort of a single job's stage cancelled its other tasks) with Spark's line."""
        for worker, job in sorted(self.jobs.items(), key=str):
            if worker is not None and worker in self.members() and "failure" in job.outcome:
                error = job.outcome["failure"]
                stop = self.leave(worker, f"its Spark job failed: {first_line(error)}")
                if stop is not None:
                    self.cancel()
                    spark = failed(error, self.sc)
                    raise spark if self.fewest() == self.workers else JobError(stop, detail=spark.detail)
        return None

    def overdue(self, stats):
        """Each member that has not connected to the exchanger by its due (connect_timeout after the job's or its
        own start), or been back within connect_timeout of its loss, leaves where min_workers allows; the line
        that stops the job where one never connected and cannot leave (as every worker must train), else None."""
        now, lost, outages = time.monotonic(), self.losses.lost, self.losses.outages
        for worker in sorted(self.members()):
            job, s = self.jobs.get(worker), stats.get(worker)
            if job is not None and "results" in job.outcome:  # it finished
                continue
            due = self.due.get(worker, 0.0)
            if s is not None and worker in lost and worker in outages.open:
                due = max(due, outages.open[worker].lost_at + self.connect_timeout)
            elif s is not None:
                continue
            if now <= due:
                continue
            if not stats:  # none has connected: no job to go on with
                return (f"only 0 of {self.workers} workers connected to the exchanger within "
                        f"{self.connect_timeout:g}s; {executor_report(self.sc)}")
            waited = f"{self.connect_timeout:g}s (connect_timeout)"
            why = (f"it did not connect to the exchanger within {waited}" if s is None else
                   f"lost at iteration {lost[worker]}, it was not back within {waited}")
            if self.leave(worker, why) is None:
                continue
            if s is None:
                return (f"only {len(stats)} of {self.workers} workers connected to the exchanger within "
                        f"{self.connect_timeout:g}s; {executor_report(self.sc)}")
        return None

    def grow(self):
        """A worker that left starts again on each executor Spark granted since the last look (a new Worker of a
        standalone cluster, dynamic allocation), from the center."""
        listed = self.losses.listed or {}
        new = sorted(set(listed) - self.granted)
        self.granted.update(listed)
        for worker, executor in zip(sorted(self.left), new):
            del self.left[worker]
            self.losses.budget.trained(worker)  # a fresh start: its failures in a row are behind it
            self.due[worker] = time.monotonic() + self.connect_timeout
            self.start_worker(worker)
            log.warning(f"Worker {worker} joins the job again on executor {executor} ({listed[executor]}), which "
                        f"Spark granted; it starts from the center, {len(self.members())} of {self.workers} "
                        f"workers train")
