"""The driver following its workers through the exchanger's stats while the Spark job runs: progress rows, rejoins and losses, Caffe's cadence on the center, and the job's end."""

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
from deepspark.spark.failures import JobError, executor_report, failed, failed_tasks

log = logging.getLogger(__name__)
# Seconds the driver waits for the Spark job's thread once it has cancelled the job.
CANCEL_SECONDS = 30
# Seconds between two looks at the workers' progress.
WATCH_SECONDS = 0.5


@dataclasses.dataclass
class Watch:
    """What the driver has seen of the workers, from one look at the exchanger's stats to the next.

    sc: the SparkContext; server: the ExchangeServer; cadence: the CenterCadence that
    displays, tests and snapshots x̃; connect_timeout: the seconds a worker has to
    (re)join before the job fails.
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

    def run(self, run_tasks):
        """Run `run_tasks()` (the Spark job) in a thread and follow the workers until it ends: progress,
        rejoins, display, test and snapshot; its result."""
        outcome = {}

        def spark_job():
            try:
                self.sc.setJobGroup(self.group, "DeepSpark training", False)
                outcome["results"] = run_tasks()
            except Exception as error:  # reported below with Spark's view
                outcome["failure"] = error

        thread = threading.Thread(target=spark_job, name="deepspark-spark-job", daemon=True)
        thread.start()
        # A terminal's live rows, a notebook's widgets or plain lines (deepspark/progress.py).
        progress = display(self.workers, self.max_iter, self.batch_size)
        connect_deadline = time.monotonic() + self.connect_timeout
        idle_since = None
        while thread.is_alive():
            thread.join(WATCH_SECONDS)
            stats = self.server.stats()
            stop = self.failures(stats)
            if stop:  # the budget is spent: the job stops (its center snapshotted) with the line that says why
                self.cancel(thread)
                raise JobError(stop)
            lost = self.rejoins(stats)
            self.tell_losses()
            progress.draw(stats, lost)
            diverged = [s["error"][1] for _, s in sorted(stats.items()) if s.get("error", (0,))[0] == E_DIVERGED]
            if diverged:  # stop at once: a retry from the center would diverge again at the same rate
                self.cancel(thread)
                raise JobError(diverged[0])
            if len(stats) < self.workers and time.monotonic() > connect_deadline:
                self.cancel(thread)
                raise JobError(f"only {len(stats)} of {self.workers} workers connected to the exchanger within "
                               f"{self.connect_timeout:g}s; {executor_report(self.sc)}")
            if len(stats) < self.workers:
                continue
            # Once all have joined, no worker connected means none trains: a lost worker's task (or a rerun
            # stage) has a free slot, or never will (its executors gone for good). It must (re)join within
            # connect_timeout, else the job fails with what was lost rather than hang.
            if any(s.get("connected") for s in stats.values()):
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.connect_timeout:
                self.cancel(thread)
                if not thread.is_alive() and "results" in outcome:  # it ended as the deadline came
                    break
                raise self.idle_error(lost)
            self.center(stats)
        if "results" in outcome:
            # One look after the job: the last one inside the loop may come before the workers' last exchanges
            # (a job shorter than a look), and Caffe's cadence at their last iteration would never be seen.
            stats = self.server.stats()
            progress.draw(stats, self.rejoins(stats))
            self.center(stats)
        progress.close()
        self.seconds = time.monotonic() - self.began
        if "failure" in outcome:
            raise failed(outcome["failure"], self.sc)
        return outcome["results"]

    def cancel(self, thread):
        """Cancel the Spark job and give its thread CANCEL_SECONDS to end."""
        self.sc.cancelAllJobs()
        thread.join(CANCEL_SECONDS)

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
            if not s.get("connected", True) and not s.get("finished") and "error" not in s:
                lost.setdefault(wid, s.get("iteration", 0))
                self.outages.lost(wid, self.exchanged_at.get(wid, time.monotonic()), lost[wid])
        executors = executor_report(self.sc, listing=True)
        if executors is None:
            return lost
        seen = self.executors
        seen.update(executors)  # an executor's host:port as Spark last gave it (it may lack the port at first)
        gone = [f"executor {e} on {seen[e]}" for e in sorted(set(seen) - set(executors) - self.named)]
        unsaid = [w for w in sorted(lost) if w not in self.said]
        if gone and unsaid:
            waited = f"{self.connect_timeout:g}s (connect_timeout)"
            if executors:
                left = ", ".join(f"executor {e} on {host}" for e, host in sorted(executors.items()))
                then = (f" (left: {left}); its shard is re-placed when a slot frees and it "
                        f"goes on from the center where it was; the job fails if no worker trains for {waited} "
                        f"before it rejoins")
            else:
                then = (f" and has none left; its shard is re-placed if Spark gets an executor within {waited}, "
                        f"else the job fails")
            for wid in unsaid:
                log.warning(f"Worker {wid} lost at iteration {lost[wid]}: Spark lost {' and '.join(gone)}{then}")
                self.lost_with[wid] = gone
            self.said.update(unsaid)
            self.named.update(set(seen) - set(executors))
        return lost

    def failures(self, stats):
        """Spark's failed tasks since the last look, each a worker's loss said in one line with its cause and
        counted against the budget; the budget's line once it is spent, else None."""
        now = time.monotonic()
        for wid, s in stats.items():
            if s.get("exchanges", 0) > self.marks.get(wid, 0):
                self.budget.trained(wid)
            if s.get("connections", 1) == self.connections.get(wid, 1) and s.get("seconds_since_exchange") is not None:
                self.exchanged_at[wid] = now - s["seconds_since_exchange"]
        for wid, cause, attempt in failed_tasks(self.sc, self.group, self.seen):
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
                return stop
        return None

    def tell_losses(self):
        """A line for each loss the exchanger saw a look ago that Spark has not reported as a failure (a task
        killed with its barrier stage), unless it rejoined meanwhile or its executor's loss was said (rejoins)."""
        now = time.monotonic()
        for wid, outage in sorted(self.outages.open.items()):
            if not outage.said and wid not in self.said and now - outage.lost_at >= WATCH_SECONDS:
                outage.said = True
                log.warning(f"Worker {wid} lost at iteration {outage.iteration}, {outage.lost_at - self.began:.1f}s "
                            f"into the job: its connection to the exchanger ended")
