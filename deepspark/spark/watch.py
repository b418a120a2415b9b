"""The driver following its workers through the exchanger's stats while the Spark job runs: progress rows, rejoins and losses, Caffe's cadence on the center, and the job's end."""

import contextvars
import dataclasses
import logging
import threading
import time
import uuid

import numpy as np

from deepspark.exchange.protocol import E_DIVERGED
from deepspark.progress import display
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.budget import Budget, Limits, Outages
from deepspark.spark.failures import JobError, executor_report, failed, failed_tasks, first_line

log = logging.getLogger(__name__)
# Seconds the driver waits for the Spark job's thread once it has cancelled the job.
CANCEL_SECONDS = 30
# Seconds between two looks at the workers' progress.
WATCH_SECONDS = 0.5


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
class Watch:
    """What the driver has seen of the workers, from one look at the exchanger's stats to the next.

    sc: the SparkContext; server: the ExchangeServer; cadence: the CenterCadence that
    displays, tests and snapshots x̃; connect_timeout: the seconds a worker has to
    (re)join before it leaves the job (min_workers) or, where every worker is needed, the job fails.
    """

    sc: object
    server: object
    cadence: object
    workers: int
    max_iter: int
    connect_timeout: float
    batch_size: int = 0  # images per worker iteration, for images/s
    connections: dict = dataclasses.field(default_factory=dict)  # worker -> its connections so far
    lost: dict = dataclasses.field(default_factory=dict)  # worker -> the iteration it was lost at, until it rejoins
    said: set = dataclasses.field(default_factory=set)  # lost workers whose loss has been told
    executors: dict = dataclasses.field(default_factory=dict)  # executor id -> host:port as Spark last gave it
    named: set = dataclasses.field(default_factory=set)  # executors whose loss has been told
    lost_with: dict = dataclasses.field(default_factory=dict)  # lost worker -> the executors Spark lost with it
    # The failure Budget (budget.py) that stops the job, every loss and rejoin with its cost (Outages), the Spark
    # job's group (whose failed tasks are the job's failures), what failed_tasks has seen, and each worker's
    # exchanges at its last failure (more since: it trained), and when each last exchanged, as far as the
    # driver has seen (a loss's time: a lost worker's stats may be its next connection's by the next look).
    budget: Budget = dataclasses.field(default_factory=lambda: Budget(Limits.of(pb.DeepSparkParameter())))
    outages: Outages = dataclasses.field(default_factory=Outages)
    group: str = dataclasses.field(default_factory=lambda: f"deepspark-{uuid.uuid4().hex[:12]}")
    seen: dict = dataclasses.field(default_factory=dict)
    marks: dict = dataclasses.field(default_factory=dict)
    exchanged_at: dict = dataclasses.field(default_factory=dict)  # worker -> its last exchange seen (monotonic)
    began: float = dataclasses.field(default_factory=time.monotonic)
    seconds: float = 0.0  # the Spark job's whole time, every attempt of every task in it, once it has ended
    # Whether a spent budget stops the job: not where Spark's own count does (its attempts as max_failures: a
    # caller's context, max_failures 1, average), which says its own line.
    stops: bool = True
    # A barrier stage (sync): one task's failure ends the attempt, and a peer's failure in it (its round cut short)
    # is that one's consequence, not counted; the stage attempts whose failure has been counted.
    barrier: bool = False
    charged: set = dataclasses.field(default_factory=set)
    # Elastic membership (a job of one Spark job per worker): the fewest workers it trains on (0: all of them),
    # the workers that left it and why, each worker's SparkJob (None: the single one of all), how many each has
    # had, by when (monotonic) each must connect, the executors Spark listed at the last look and every one
    # it has listed (a new one takes a worker that left).
    min_workers: int = 0
    left: dict = dataclasses.field(default_factory=dict)
    jobs: dict = dataclasses.field(default_factory=dict)
    started: dict = dataclasses.field(default_factory=dict)
    due: dict = dataclasses.field(default_factory=dict)
    listed: dict = None
    granted: set = dataclasses.field(default_factory=set)
    run_worker: object = None

    def run(self, run_tasks=None, run_worker=None):
        """Run the Spark job and follow the workers until it ends: progress, rejoins, losses, display, test and
        snapshot; the workers' results. run_tasks(): one Spark job of every worker's task (a barrier stage's);
        run_worker(w): worker w's own Spark job of its one task, each in a thread and job group of its own, so that
        a worker leaves the job alone (leave: its group cancelled) and joins it again alone (join)."""
        self.run_worker = run_worker
        if run_worker is None:
            self.jobs[None] = SparkJob.start(self.sc, self.group, run_tasks)
        else:
            for worker in range(self.workers):
                self.start_worker(worker)
        self.due = dict.fromkeys(range(self.workers), time.monotonic() + self.connect_timeout)
        # A terminal's live rows, a notebook's widgets or plain lines (deepspark/progress.py).
        progress = display(self.workers, self.max_iter, self.batch_size)
        try:
            self.follow(progress)
        finally:
            progress.close()
        self.seconds = time.monotonic() - self.began
        failure = next((j.outcome["failure"] for j in self.current() if "failure" in j.outcome), None)
        if failure is not None:
            raise failed(failure, self.sc)
        return [r for j in self.current() for r in j.outcome["results"]]

    def follow(self, progress):
        """The driver's looks at the workers, every WATCH_SECONDS until their Spark jobs end; raises the JobError
        that stops the job (its Spark jobs cancelled)."""
        idle_since = None
        while self.running():
            self.wait(WATCH_SECONDS)
            stats = self.server.stats()
            stop = self.failures(stats)
            if stop:  # the budget is spent, or too few would train on: the job stops with the line that says why
                self.cancel()
                raise JobError(stop)
            self.ended()  # after failures(): a job that failed says its worker's loss first
            lost = self.rejoins(stats)
            self.tell_losses()
            mine = {w: s for w, s in stats.items() if w not in self.left}
            progress.draw(mine, lost, iteration=self.server.job_iteration(stats))
            diverged = [s["error"][1] for _, s in sorted(stats.items()) if s.get("error", (0,))[0] == E_DIVERGED]
            if diverged:  # stop at once: a retry from the center would diverge again at the same rate
                self.cancel()
                raise JobError(diverged[0])
            stop = self.overdue(stats)
            if stop:
                self.cancel()
                raise JobError(stop)
            self.grow()
            if len(mine) < len(self.members()):
                continue
            # Once all have joined, no worker connected means none trains: a lost worker's task (or a rerun
            # stage) has a free slot, or never will (its executors gone for good). It must (re)join within
            # connect_timeout, else the job fails with what was lost rather than hang.
            if any(s.get("connected") for s in mine.values()):
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.connect_timeout:
                self.cancel()
                if not self.running() and all("results" in j.outcome for j in self.current()):
                    break  # it ended as the deadline came
                raise self.idle_error(lost)
            stop = self.looking_on(self.center, stats)  # every worker's iterations, a left one's too: the job's
            if stop:                                        # count is of all trained
                self.cancel()
                raise JobError(stop)
        if all("results" in j.outcome for j in self.current()):
            # One look after the job: the last one inside the loop may come before the workers' last exchanges
            # (a job shorter than a look), and Caffe's cadence at their last iteration would never be seen.
            stats = self.server.stats()
            progress.draw({w: s for w, s in stats.items() if w not in self.left}, self.rejoins(stats),
                          iteration=self.server.job_iteration(stats))
            self.center(stats)

    def members(self):
        """The workers that are the job's: each one that has not left."""
        return set(range(self.workers)) - set(self.left)

    def current(self):
        """The Spark jobs of the training: the single one, or each member's."""
        return [j for w, j in sorted(self.jobs.items(), key=str) if w not in self.left]

    def looking_on(self, work, stats):
        """work(stats) (Caffe's cadence on the center: a test pass or a snapshot, tens of seconds on a loaded driver)
        while a thread of its own goes on looking at Spark's failed tasks and the rejoins every WATCH_SECONDS: looked
        at only after it, a kill every few seconds would come as failures all at once with no training seen between
        them, a crash loop to the budget. The line that stops the job, else None."""
        done, stops = threading.Event(), []

        def look():
            while not done.wait(WATCH_SECONDS) and not stops:
                stats = self.server.stats()
                stop = self.failures(stats)
                if stop:
                    stops.append(stop)
                self.rejoins(stats)

        thread = threading.Thread(target=contextvars.copy_context().run, args=(look,), daemon=True,
                                  name="deepspark-watch")
        thread.start()
        try:
            work(stats)
        finally:
            done.set()
            thread.join()
        return stops[0] if stops else None

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

    # -- elastic membership: a worker leaves when it cannot go on, and joins again on a new executor -------

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
        self.lost.pop(worker, None)
        self.said.add(worker)
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
        now = time.monotonic()
        for worker in sorted(self.members()):
            job, s = self.jobs.get(worker), stats.get(worker)
            if job is not None and "results" in job.outcome:  # it finished
                continue
            due = self.due.get(worker, 0.0)
            if s is not None and worker in self.lost and worker in self.outages.open:
                due = max(due, self.outages.open[worker].lost_at + self.connect_timeout)
            elif s is not None:
                continue
            if now <= due:
                continue
            if not stats:  # none has connected: no job to go on with
                return (f"only 0 of {self.workers} workers connected to the exchanger within "
                        f"{self.connect_timeout:g}s; {executor_report(self.sc)}")
            waited = f"{self.connect_timeout:g}s (connect_timeout)"
            why = (f"it did not connect to the exchanger within {waited}" if s is None else
                   f"lost at iteration {self.lost[worker]}, it was not back within {waited}")
            if self.leave(worker, why) is None:
                continue
            if s is None:
                return (f"only {len(stats)} of {self.workers} workers connected to the exchanger within "
                        f"{self.connect_timeout:g}s; {executor_report(self.sc)}")
        return None

    def grow(self):
        """A worker that left starts again on each executor Spark granted since the last look (a new Worker of a
        standalone cluster, dynamic allocation), from the center."""
        listed = self.listed or {}
        new = sorted(set(listed) - self.granted)
        self.granted.update(listed)
        for worker, executor in zip(sorted(self.left), new):
            del self.left[worker]
            self.budget.trained(worker)  # a fresh start: its failures in a row are behind it
            self.due[worker] = time.monotonic() + self.connect_timeout
            self.start_worker(worker)
            log.warning(f"Worker {worker} joins the job again on executor {executor} ({listed[executor]}), which "
                        f"Spark granted; it starts from the center, {len(self.members())} of {self.workers} "
                        f"workers train")

    def idle_error(self, lost):
        """The JobError of a job whose workers have all been gone for connect_timeout."""
        waited = f"{self.connect_timeout:g}s (connect_timeout)"
        if not lost:
            return JobError(f"every worker finished, but Spark's job has not ended within {waited} of the "
                            f"last; {executor_report(self.sc)}")
        what = "; ".join(f"worker {w} at iteration {it}"
                         + (f" with {' and '.join(self.lost_with[w])}" if w in self.lost_with else "")
                         for w, it in sorted(lost.items()))
        return JobError(f"lost {what}; no worker has trained for {waited} and no executor took up the "
                        f"lost work; {executor_report(self.sc)}; resume from the last snapshot (--snapshot)")

    def center(self, stats):
        """Caffe's cadence on x̃ at the job's iteration (the exchanger's handler counts it: easgd's, the workers'
        iterations together / workers), with the exchange's scalars on each display."""
        iteration = self.server.job_iteration(stats)
        losses = [x for x in (s.get("loss", float("nan")) for s in stats.values()) if np.isfinite(x)]
        if self.cadence.observe(iteration, float(np.mean(losses)) if losses else float("nan")):
            scalars = self.cadence.scalars
            scalars.add("exchange/seconds_since_exchange",
                        max(s.get("seconds_since_exchange") or 0 for s in stats.values()), iteration)
            latencies = [s["latency"] for s in stats.values() if s.get("latency") is not None]
            if latencies:
                scalars.add("exchange/latency_ms", 1e3 * float(np.mean(latencies)), iteration)
            scalars.add("exchange/exchanges", sum(s.get("exchanges", 0) for s in stats.values()), iteration)

    def rejoins(self, stats):
        """A line for each worker that connected again (Spark retried its task, or reran the stage), and one
        for each that lost its connection before it finished as Spark lost an executor (a machine gone):
        what was lost and what happens next. Returns the workers lost (connection gone before the last
        iteration, no error) not yet back: {worker: iteration it was lost at}."""
        lost = self.lost
        for wid, s in sorted(stats.items()):
            count = s.get("connections", 1)
            if count > self.connections.get(wid, 1):
                out = self.outages.rejoined(wid, time.monotonic()).cost(0)
                log.warning(f"Worker {wid} rejoined the exchanger (connection {count}); it goes on from the center at "
                            f"iteration {s.get('joined_at', 0)}, {out:.1f}s after its loss")
                lost.pop(wid, None)
                self.said.discard(wid)
                self.lost_with.pop(wid, None)
            self.connections[wid] = count
            if (not s.get("connected", True) and not s.get("finished") and "error" not in s
                    and wid not in self.left):
                lost.setdefault(wid, s.get("iteration", 0))
                self.outages.lost(wid, self.exchanged_at.get(wid, time.monotonic()), lost[wid])
        executors = self.listed = executor_report(self.sc, listing=True)
        if executors is None:
            return lost
        seen = self.executors
        seen.update(executors)  # an executor's host:port as Spark last gave it (it may lack the port at first)
        gone = [f"executor {e} on {seen[e]}" for e in sorted(set(seen) - set(executors) - self.named)]
        unsaid = [w for w in sorted(lost) if w not in self.said]
        if gone and unsaid:
            waited = f"{self.connect_timeout:g}s (connect_timeout)"
            left = ", ".join(f"executor {e} on {host}" for e, host in sorted(executors.items()))
            then = f" (left: {left})" if executors else " and has none left"
            if self.fewest() < self.workers:  # elastic: the job goes on without it
                then += (f"; it goes on from the center where it was when a slot frees, or leaves the job if not "
                         f"back within {waited}")
            elif executors:
                then += (f"; its shard is re-placed when a slot frees and it goes on from the center where it was; "
                         f"the job fails if no worker trains for {waited} before it rejoins")
            else:
                then += f"; its shard is re-placed if Spark gets an executor within {waited}, else the job fails"
            for wid in unsaid:
                log.warning(f"Worker {wid} lost at iteration {lost[wid]}: Spark lost {' and '.join(gone)}{then}")
                self.lost_with[wid] = gone
            self.said.update(unsaid)
            self.named.update(set(seen) - set(executors))
        return lost

    def failures(self, stats):
        """Spark's failed tasks since the last look, each a worker's loss said in one line with its cause and
        counted against the budget; a worker whose own budget is spent leaves (as far as min_workers allows); the
        line that stops the job, else None."""
        now = time.monotonic()
        for wid, s in stats.items():
            if s.get("exchanges", 0) > self.marks.get(wid, 0):
                self.budget.trained(wid)
            if s.get("connections", 1) == self.connections.get(wid, 1) and s.get("seconds_since_exchange") is not None:
                self.exchanged_at[wid] = now - s["seconds_since_exchange"]
        for wid, cause, attempt in self.failed_tasks():
            if wid in self.left:  # it left with an earlier failure of this look
                continue
            iteration = stats.get(wid, {}).get("iteration", 0)
            self.marks[wid] = stats.get(wid, {}).get("exchanges", 0)
            if self.barrier and attempt in self.charged:
                outage = self.outages.lost(wid, self.exchanged_at.get(wid, now), iteration) or self.outages.open[wid]
                outage.said = True
                log.warning(f"Worker {wid} lost at iteration {outage.iteration}, {now - self.began:.1f}s into the job: "
                            f"{cause} (with its barrier stage's attempt, which another's failure ended: not counted)")
                continue
            self.charged.add(attempt)
            stop = self.budget.fail(wid, now, cause)
            opened = self.outages.lost(wid, self.exchanged_at.get(wid, now), iteration)
            outage = opened or self.outages.open[wid]  # open already: it failed again before it rejoined
            outage.said = True
            window, in_a_row = self.budget.failures(wid)
            limits = self.budget.limits
            span = f"{limits.window:g}s" if limits.window else "the job"
            at = opened.lost_at if opened else now
            log.warning(f"Worker {wid} lost at iteration {outage.iteration}, {at - self.began:.1f}s into "
                        f"the job: {cause} (its failure {window} in {span}, {in_a_row} in a row without training)")
            if stop and self.stops:
                stop = stop if stop.whole_job else self.leave(wid, stop)
                if stop:
                    return stop
        return None

    def failed_tasks(self):
        """failed_tasks of the training's Spark jobs since the last look, as [(worker, cause, (stage, attempt))]: a
        task's partition in the single job, the worker whose job it is in one of each worker's."""
        found = []
        for worker, job in sorted(self.jobs.items(), key=str):
            if worker not in self.left:
                found += [(partition if worker is None else worker, cause, attempt)
                          for partition, cause, attempt in failed_tasks(self.sc, job.group, self.seen)]
        return found

    def tell_losses(self):
        """A line for each loss the exchanger saw a look ago that Spark has not reported as a failure (a task
        killed with its barrier stage), unless it rejoined meanwhile or its executor's loss was said (rejoins)."""
        now = time.monotonic()
        for wid, outage in sorted(self.outages.open.items()):
            if not outage.said and wid not in self.said and now - outage.lost_at >= WATCH_SECONDS:
                outage.said = True
                log.warning(f"Worker {wid} lost at iteration {outage.iteration}, {outage.lost_at - self.began:.1f}s "
                            f"into the job: its connection to the exchanger ended")
