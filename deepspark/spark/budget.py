"""The driver's account of its workers' failures: the budget that stops a job whose workers fail too often (per worker and per job, in a row and within a window), and the losses and rejoins with the time each cost."""

import collections
import dataclasses

# The longest cause a line quotes (first_line has made it one line already; our own errors' lines, with their fix,
# run to a few hundred characters).
CAUSE_CHARS = 1000
# How long after a rejoin whose loss was not seen (its Outage made by the rejoin) Spark's report of the failed task
# may come and still be that loss, not another: a look or a few (watch.WATCH_SECONDS is 0.5), on a loaded driver.
LATE_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """DeepSparkParameter's failure budget. in_a_row (max_failures): one worker's failures with no training
    between them at which the job stops (a crash loop); window (failure_window): the seconds the next two count
    over, 0 for the whole job; per_worker (max_worker_failures) and per_job (max_job_failures): the failures of one
    worker, and of all, within a window at which the job stops (0: no such limit)."""

    in_a_row: int
    window: float
    per_worker: int
    per_job: int

    @classmethod
    def of(cls, ds):
        return cls(max(ds.max_failures, 1), float(ds.failure_window), ds.max_worker_failures, ds.max_job_failures)


class Spent(str):
    """A spent budget's one line; whole_job: the workers' failures together (max_job_failures) spent it, not one
    worker's own (which that worker's leaving makes good, as far as min_workers allows)."""

    whole_job = False

    @classmethod
    def of_job(cls, line):
        spent = cls(line)
        spent.whole_job = True
        return spent


class Budget:
    """The failures seen so far, against Limits: fail() says when the job must stop, and why, in one line."""

    def __init__(self, limits):
        self.limits = limits
        self.times = collections.defaultdict(collections.deque)  # worker -> its failures' times within the window
        self.all = collections.deque()  # every worker's failure times within the window
        self.run = {}  # worker -> (failures in a row without training, the first one's time)

    def trained(self, worker):
        """`worker` trained (exchanged) since its last failure: its run of failures without training ends."""
        self.run.pop(worker, None)

    def fail(self, worker, at, cause):
        """Count a failure of `worker` at `at` (seconds, monotonic) whose cause Spark gave as `cause`: None
        while the job may go on, else the one line that says why it stops (Spent)."""
        limits = self.limits
        count, first = self.run.get(worker, (0, at))
        self.run[worker] = (count + 1, first)
        for times in (self.times[worker], self.all):
            times.append(at)
            while limits.window and times[0] <= at - limits.window:
                times.popleft()
        last = f"the last: {one_line(cause)}"
        if count + 1 >= limits.in_a_row:
            return Spent(f"worker {worker} failed {how_often(count + 1)} in a row in {at - first:.0f}s without "
                         f"training between them (max_failures {limits.in_a_row}); {last}")
        span = f"in {limits.window:g}s" if limits.window else "in the job"
        window = f"failure_window {limits.window:g}s"
        if limits.per_worker and len(self.times[worker]) >= limits.per_worker:
            return Spent(f"worker {worker} failed {how_often(len(self.times[worker]))} {span} ({window}, "
                         f"max_worker_failures {limits.per_worker}); {last}")
        if limits.per_job and len(self.all) >= limits.per_job:
            return Spent.of_job(f"the workers failed {how_often(len(self.all))} {span} ({window}, "
                                f"max_job_failures {limits.per_job}), worker {worker} the last; {last}")
        return None

    def failures(self, worker):
        """(failures of `worker` within the window, failures in a row without training)."""
        return len(self.times[worker]), self.run.get(worker, (0, 0))[0]


def how_often(count):
    """"once", "2 times", ..."""
    return "once" if count == 1 else f"{count} times"


def one_line(cause):
    """A cause as one short line."""
    text = " ".join(str(cause).split())
    return text if len(text) <= CAUSE_CHARS else text[:CAUSE_CHARS - 3] + "..."


@dataclasses.dataclass
class Outage:
    """One loss of a worker: when (seconds, monotonic) and at which iteration, when it rejoined (None while it has
    not), and whether its loss has been said."""

    worker: int
    lost_at: float
    iteration: int
    rejoined_at: float = None
    said: bool = False
    seen: bool = True  # its loss seen: False for one its rejoin made (the loss seen a look or more after it)

    def cost(self, now):
        """The seconds it was (or has been) out."""
        return (self.rejoined_at if self.rejoined_at is not None else now) - self.lost_at


class Outages:
    """Every loss and rejoin of the job's workers, over all their attempts."""

    def __init__(self):
        self.all = []
        self.open = {}  # worker -> its Outage not yet ended

    def lost(self, worker, at, iteration):
        """`worker` lost at `at` (iteration `iteration`; its last exchange, as a loss is seen a look later: no
        earlier than its last rejoin); its Outage, or None when it was already out. A loss seen within LATE_SECONDS
        of a rejoin that made its own Outage (Spark reported the failed task after the replacement connected) is
        that Outage's."""
        if worker in self.open:
            return None
        last = next((o for o in reversed(self.all) if o.worker == worker), None)
        if last is not None and not last.seen and at - last.rejoined_at <= LATE_SECONDS:
            last.seen, last.iteration = True, last.iteration or iteration
            return last
        back = [o.rejoined_at for o in self.all if o.worker == worker and o.rejoined_at is not None]
        self.open[worker] = outage = Outage(worker, max([at, *back]), iteration)
        self.all.append(outage)
        return outage

    def rejoined(self, worker, at):
        """`worker` back at `at`: its Outage (its loss made now if none was seen: a loss and rejoin between two
        looks)."""
        outage = self.open.pop(worker, None) or Outage(worker, at, 0, seen=False)
        if outage not in self.all:
            self.all.append(outage)
        outage.rejoined_at = at
        return outage

    def restarts(self, worker):
        """How many times `worker` rejoined."""
        return sum(1 for o in self.all if o.worker == worker and o.rejoined_at is not None)

    def summary(self, now):
        """The summary's line of every loss and rejoin and their cost; "" when there was none."""
        if not self.all:
            return ""
        back = [o for o in self.all if o.rejoined_at is not None]
        per = collections.Counter(o.worker for o in self.all)
        costs = ", ".join(f"{o.cost(now):.1f}s" for o in back)
        return (f"Workers lost {len(self.all)} times ({', '.join(f'worker {w}: {n}' for w, n in sorted(per.items()))})"
                f" and rejoined {len(back)} times{f' (after {costs})' if back else ''}; "
                f"{sum(o.cost(now) for o in self.all):.1f}s of worker time lost in all")
