"""The driver's account of its workers' losses while the Spark job runs: each loss and rejoin said in one line, Spark's failed tasks counted against the failure budget."""

import dataclasses
import logging
import math
import time

from deepspark.spark.budget import Budget, Outages
from deepspark.spark.failures import JobError, executor_report, failed_tasks

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Losses:
    """What the driver has seen of the workers' losses, from one look at the exchanger's stats to the next.

    sc: the SparkContext; connect_timeout: the seconds a lost worker has to rejoin, as its lines say; budget: the
    failure Budget (budget.py) that stops the job; began: the job's start (monotonic), which each line's time
    counts from. The Membership (membership.py) that rejoins and failures are handed says which workers left the
    job and their Spark jobs, and makes a worker whose own budget is spent leave.
    """

    sc: object
    connect_timeout: float
    budget: Budget
    began: float = dataclasses.field(default_factory=time.monotonic)
    connections: dict = dataclasses.field(default_factory=dict)  # worker -> its connections so far
    lost: dict = dataclasses.field(default_factory=dict)  # worker -> the iteration it was lost at, until it rejoins
    said: set = dataclasses.field(default_factory=set)  # lost workers whose loss has been told
    executors: dict = dataclasses.field(default_factory=dict)  # executor id -> host:port as Spark last gave it
    named: set = dataclasses.field(default_factory=set)  # executors whose loss has been told
    lost_with: dict = dataclasses.field(default_factory=dict)  # lost worker -> the executors Spark lost with it
    # Every loss and rejoin with its cost (Outages), what failed_tasks has seen, when each worker's last failure
    # ended (a connection that exchanged since: it trained), and when each last exchanged, as far as the driver has
    # seen (a loss's time: a lost worker's stats may be its next connection's by the next look).
    outages: Outages = dataclasses.field(default_factory=Outages)
    seen: dict = dataclasses.field(default_factory=dict)
    failed_at: dict = dataclasses.field(default_factory=dict)  # worker -> its last failure's end (s, the epoch)
    exchanged_at: dict = dataclasses.field(default_factory=dict)  # worker -> its last exchange seen (monotonic)
    # Whether a spent budget stops the job: not where Spark's own count does (its attempts as max_failures: a
    # caller's context, max_failures 1, average), which says its own line.
    stops: bool = True
    # A barrier stage (sync): one task's failure ends the attempt, and a peer's failure in it (its round cut short)
    # is that one's consequence, not counted; the stage attempts whose failure has been counted.
    barrier: bool = False
    charged: set = dataclasses.field(default_factory=set)
    # Executors Spark listed at the last look (a new one takes a worker that left: Membership.grow).
    listed: dict = None

    def rejoins(self, stats, membership):
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
                    and wid not in membership.left):
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
            if membership.fewest() < membership.workers:  # elastic: the job goes on without it
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

    def failures(self, stats, membership):
        """Spark's failed tasks since the last look, each a worker's loss said in one line with its cause and
        counted against the budget; a worker whose own budget is spent leaves (as far as min_workers allows); the
        line that stops the job, else None."""
        now = time.monotonic()
        for wid, s in stats.items():
            if s.get("connections", 1) == self.connections.get(wid, 1) and s.get("seconds_since_exchange") is not None:
                self.exchanged_at[wid] = now - s["seconds_since_exchange"]
        for wid, cause, attempt, ended in self.failed_tasks(membership):
            if wid in membership.left:  # it left with an earlier failure of this look
                continue
            # It trained since its last failure if a connection of its exchanged between the two: told by Spark's
            # times, not by looks, since one look can find several failures (a retry forks in milliseconds).
            since = self.failed_at.get(wid, -math.inf)
            if any(since < at < ended for at in stats.get(wid, {}).get("trained_at", ())):
                self.budget.trained(wid)
            self.failed_at[wid] = ended
            iteration = stats.get(wid, {}).get("iteration", 0)
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
                stop = stop if stop.whole_job else membership.leave(wid, stop)
                if stop:
                    return stop
        return None

    def failed_tasks(self, membership):
        """failed_tasks of the training's Spark jobs since the last look, as [(worker, cause, (stage, attempt), when it
        ended)]: a task's partition in the single job, the worker whose job it is in one of each worker's."""
        found = []
        for worker, job in sorted(membership.jobs.items(), key=str):
            if worker not in membership.left:
                found += [(partition if worker is None else worker, cause, attempt, ended)
                          for partition, cause, attempt, ended in failed_tasks(self.sc, job.group, self.seen)]
        return found

    def tell_losses(self, after):
        """A line for each loss the exchanger saw `after` seconds ago or more (a look ago) that Spark has not
        reported as a failure (a task killed with its barrier stage), unless it rejoined meanwhile or its executor's
        loss was said (rejoins)."""
        now = time.monotonic()
        for wid, outage in sorted(self.outages.open.items()):
            if not outage.said and wid not in self.said and now - outage.lost_at >= after:
                outage.said = True
                log.warning(f"Worker {wid} lost at iteration {outage.iteration}, {outage.lost_at - self.began:.1f}s "
                            f"into the job: its connection to the exchanger ended")

    def forget(self, worker):
        """`worker` left the job: its loss is no longer one to tell or to wait for."""
        self.lost.pop(worker, None)
        self.said.add(worker)

    def idle_error(self, lost):
        """The JobError of a job whose workers have all been gone for connect_timeout (`lost`: rejoins')."""
        waited = f"{self.connect_timeout:g}s (connect_timeout)"
        if not lost:
            return JobError(f"every worker finished, but Spark's job has not ended within {waited} of the "
                            f"last; {executor_report(self.sc)}")
        what = "; ".join(f"worker {w} at iteration {it}"
                         + (f" with {' and '.join(self.lost_with[w])}" if w in self.lost_with else "")
                         for w, it in sorted(lost.items()))
        return JobError(f"lost {what}; no worker has trained for {waited} and no executor took up the "
                        f"lost work; {executor_report(self.sc)}; resume from the last snapshot (--snapshot)")
