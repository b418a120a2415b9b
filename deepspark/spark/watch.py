"""The driver following its workers through the exchanger's stats while the Spark job runs: progress rows, Caffe's cadence on the center, and the job's end."""

import contextvars
import dataclasses
import threading
import time

import numpy as np

from deepspark.exchange.protocol import E_DIVERGED
from deepspark.progress import display
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.budget import Budget, Limits
from deepspark.spark.failures import JobError, failed
from deepspark.spark.losses import Losses
from deepspark.spark.membership import Membership

# Seconds between two looks at the workers' progress.
WATCH_SECONDS = 0.5


@dataclasses.dataclass
class Watch:
    """What the driver has seen of the workers, from one look at the exchanger's stats to the next.

    sc: the SparkContext; server: the ExchangeServer; cadence: the CenterCadence that
    displays, tests and snapshots x̃; connect_timeout: the seconds a worker has to
    (re)join before it leaves the job (min_workers) or, where every worker is needed, the job fails.
    budget (None: the defaults' Limits), stops, barrier: the Losses' (losses.py: the failure Budget, whether a
    spent one stops the job, a barrier stage); min_workers, barrier: the Membership's (membership.py).
    """

    sc: object
    server: object
    cadence: object
    workers: int
    max_iter: int
    connect_timeout: float
    batch_size: int = 0  # images per worker iteration, for images/s
    budget: dataclasses.InitVar[Budget] = None
    stops: dataclasses.InitVar[bool] = True
    barrier: dataclasses.InitVar[bool] = False
    min_workers: dataclasses.InitVar[int] = 0
    began: float = dataclasses.field(default_factory=time.monotonic)
    seconds: float = 0.0  # the Spark job's whole time, every attempt of every task in it, once it has ended
    losses: Losses = dataclasses.field(init=False)
    membership: Membership = dataclasses.field(init=False)

    def __post_init__(self, budget, stops, barrier, min_workers):
        budget = budget if budget is not None else Budget(Limits.of(pb.DeepSparkParameter()))
        self.losses = Losses(self.sc, self.connect_timeout, budget, self.began, stops=stops, barrier=barrier)
        self.membership = Membership(self.sc, self.server, self.losses, self.workers, self.connect_timeout,
                                     min_workers, barrier)

    @property
    def outages(self):
        """Every loss and rejoin with its cost (budget.Outages)."""
        return self.losses.outages

    @property
    def left(self):
        """The workers that left the job: {worker: why}."""
        return self.membership.left

    def run(self, run_tasks=None, run_worker=None):
        """Run the Spark job and follow the workers until it ends: progress, rejoins, losses, display, test and
        snapshot; the workers' results. run_tasks(): one Spark job of every worker's task (a barrier stage's);
        run_worker(w): worker w's own Spark job of its one task, each in a thread and job group of its own, so that
        a worker leaves the job alone (leave: its group cancelled) and joins it again alone (join)."""
        self.membership.start(run_tasks, run_worker)
        # A terminal's live rows, a notebook's widgets or plain lines (deepspark/progress.py).
        progress = display(self.workers, self.max_iter, self.batch_size)
        try:
            self.follow(progress)
        finally:
            progress.close()
        self.seconds = time.monotonic() - self.began
        current = self.membership.current()
        failure = next((j.outcome["failure"] for j in current if "failure" in j.outcome), None)
        if failure is not None:
            raise failed(failure, self.sc)
        return [r for j in current for r in j.outcome["results"]]

    def follow(self, progress):
        """The driver's looks at the workers, every WATCH_SECONDS until their Spark jobs end; raises the JobError
        that stops the job (its Spark jobs cancelled)."""
        membership, idle_since = self.membership, None
        while membership.running():
            membership.wait(WATCH_SECONDS)
            stats = self.server.stats()
            stop = self.failures(stats)
            if stop:  # the budget is spent, or too few would train on: the job stops with the line that says why
                membership.cancel()
                raise JobError(stop)
            membership.ended()  # after failures(): a job that failed says its worker's loss first
            lost = self.rejoins(stats)
            self.losses.tell_losses(WATCH_SECONDS)
            mine = {w: s for w, s in stats.items() if w not in membership.left}
            progress.draw(mine, lost, iteration=self.server.job_iteration(stats))
            diverged = [s["error"][1] for _, s in sorted(stats.items()) if s.get("error", (0,))[0] == E_DIVERGED]
            if diverged:  # stop at once: a retry from the center would diverge again at the same rate
                membership.cancel()
                raise JobError(diverged[0])
            stop = membership.overdue(stats)
            if stop:
                membership.cancel()
                raise JobError(stop)
            membership.grow()
            if len(mine) < len(membership.members()):
                continue
            # Once all have joined, no worker connected means none trains: a lost worker's task (or a rerun
            # stage) has a free slot, or never will (its executors gone for good). It must (re)join within
            # connect_timeout, else the job fails with what was lost rather than hang.
            if any(s.get("connected") for s in mine.values()):
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.connect_timeout:
                membership.cancel()
                if not membership.running() and all("results" in j.outcome for j in membership.current()):
                    break  # it ended as the deadline came
                raise self.losses.idle_error(lost)
            stop = self.looking_on(self.center, stats)  # every worker's iterations, a left one's too: the job's
            if stop:                                        # count is of all trained
                membership.cancel()
                raise JobError(stop)
        if all("results" in j.outcome for j in membership.current()):
            # One look after the job: the last one inside the loop may come before the workers' last exchanges
            # (a job shorter than a look), and Caffe's cadence at their last iteration would never be seen.
            stats = self.server.stats()
            progress.draw({w: s for w, s in stats.items() if w not in membership.left}, self.rejoins(stats),
                          iteration=self.server.job_iteration(stats))
            self.center(stats)

    def failures(self, stats):
        """Spark's failed tasks since the last look counted against the budget (Losses.failures): the line that
        stops the job, else None."""
        return self.losses.failures(stats, self.membership)

    def rejoins(self, stats):
        """The rejoins and losses since the last look said (Losses.rejoins): the workers lost, not yet back."""
        return self.losses.rejoins(stats, self.membership)

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
