"""What every algorithm's module fills in (Algorithm), and what their worker loops and cost models share."""

import dataclasses
import logging
import statistics
import threading
import time

from deepspark.errors import ConfigError, DeepSparkError
from deepspark.proto import deepspark_pb2 as pb

log = logging.getLogger(__name__)
# Seconds of rounds a Pace judges at once, and the fewest seconds between two of its lines: a straggler is said
# soon after it starts to hold the rounds, then once a minute while it does, not every round.
PACE_WINDOW_SECONDS = 5.0
PACE_EVERY_SECONDS = 60.0
# A worker holds the round when its own rate is under this share of the others' (their median): a quarter
# slower, well past the few percent two workers on one machine differ by.
PACE_SHARE = 0.8


class WorkerError(DeepSparkError):
    """A worker that cannot go on (lost driver, bad shard): the message says why."""


@dataclasses.dataclass(frozen=True)
class Projection:
    """What `workers` workers do: images per second of the whole job, its speedup over one worker alone
    (no exchange), the share of a worker's time blocked on the exchange, the center's busy share
    (1: saturated), and the seconds between two exchanges of one worker."""

    workers: int
    images_per_second: float
    speedup: float
    exchange_share: float
    center_load: float
    cycle: float


class Algorithm:
    """One row of the ALGORITHMS table: an algorithm whole, as the spark Job, plan and the training check use it.

    The spark Job (deepspark.spark.job) calls hold_center and train with itself as `job`: the session
    (job.sc), the shards, the cadence, exchange_server and run_workers are its, the rule is the row's.
    """

    name = None  # DeepSparkParameter.algorithm's value name, lower case
    spark = True  # trained by the spark Job; False: in this process (train)
    exchanger = True  # its workers exchange through the driver's exchanger (codec, saturation)
    no_codec = ""  # without the exchanger: why exchange_codec means nothing to it
    steals = False  # its workers train at their own speeds: they claim record blocks from a ledger (steal_records)

    def title(self, ds):
        """What the log's "Solving" line and the plot call it."""
        return self.name

    def check(self, ds, path):
        """DeepSparkParameter values this algorithm cannot run: one line naming the field (after config's
        own check_deepspark)."""
        if not self.exchanger and ds.exchange_codec != pb.DeepSparkParameter.FLOAT32:
            raise ConfigError(f"exchange_codec {pb.DeepSparkParameter.ExchangeCodec.Name(ds.exchange_codec)} codes "
                              f"the exchanger's frames (easgd, sync); {self.no_codec}", path)

    def handler(self, ds, workers):
        """The exchanger's Handler (deepspark.exchange.handlers) of a job of `workers` workers; None without one."""
        return None

    def hold_center(self, job, center, host, secret):
        """The started ExchangeServer holding x̃ (`center`, one float32 vector), or None for an algorithm that holds
        x̃ on the driver itself (then center_flat says where)."""
        server = job.exchange_server(center, host, secret, self.job_handler(job))
        log.info(f"Exchanger listening on {server.address[0]}:{server.address[1]}; {self.listening(job)}")
        return server

    def job_handler(self, job):
        """The handler of spark Job `job` (its workers, its solver): handler()'s, unless the algorithm needs more."""
        return self.handler(job.ds, job.workers)

    def final_iteration(self, job, results):
        """The job's last iteration, its final snapshot's, from the workers' Summaries: the furthest's."""
        return max(r.final_iteration for r in results)

    def listening(self, job):
        """The rest of the "Exchanger listening" line: how the workers use it."""
        return f"{job.workers} workers"

    def center_flat(self, job):
        """A copy of x̃ as one float32 vector."""
        return job.server.pull()

    def train(self, job, task):
        """Train the workers to schedule.stop_iteration (driving test, snapshot and display); their Summaries."""
        raise NotImplementedError

    def cost(self, costs, network, ds, workers, shared=1.0):
        """The Projection (plan) of `workers` workers; `shared` > 1 when workers share cores."""
        raise NotImplementedError

    def plan_note(self, ds):
        """What `plan`'s header says of how it runs, beside its name ("" for nothing)."""
        return ""

    def saturation(self, costs, network, ds):
        """The most workers the single center serves without their exchanges queueing; None where it does not
        apply."""
        return None


# -- what the cost models share ----------------------------------------------------------------


def exchange_seconds(costs, network):
    """T_comm of one exchange alone: x up and d down, each over the worker's link and the center's
    (S / bandwidth each way, for S = costs.bytes), two latencies, and the center's work."""
    return 2 * costs.bytes / network.bandwidth + 2 * network.latency + costs.server


def center_rate(costs, network):
    """R: the exchanges per second the single center can serve. Its link carries S in and S out per
    exchange (full duplex: S / bandwidth), its work costs T_server; the larger bounds it."""
    return 1.0 / max(costs.bytes / network.bandwidth, costs.server)


def period_note(ds):
    """`plan`'s note of an algorithm that exchanges every period."""
    return f"period {ds.period}, {'overlapped' if ds.overlap else 'blocking'}"


# -- what the algorithms in step share --------------------------------------------------------------


class Pace:
    """Each worker's own rate in rounds that all workers finish together (sync's, average's): its iterations over
    the seconds it worked on them (not those it then waited for the others), judged every `window` seconds of
    rounds; the line that says the slowest holds the round, at most once every `every` seconds. Thread-safe."""

    def __init__(self, window=PACE_WINDOW_SECONDS, every=PACE_EVERY_SECONDS, share=PACE_SHARE, clock=time.monotonic):
        self.window, self.every, self.share, self.clock = window, every, share, clock
        self.lock = threading.Lock()
        self.work = {}  # worker -> [seconds, iterations] in this window
        self.since = clock()
        self.said = None  # when the last line was said

    def add(self, worker, seconds, iterations=1):
        """Worker `worker` worked `seconds` on `iterations` iterations of a round."""
        with self.lock:
            work = self.work.setdefault(worker, [0.0, 0])
            work[0] += seconds
            work[1] += iterations

    def judge(self):
        """Once a window's rounds are in: the line when its slowest worker's rate is under `share` of the others'
        and none was said within `every` seconds, else None (the next window starts)."""
        with self.lock:
            now = self.clock()
            if now - self.since < self.window:
                return None
            rates = {w: n / s for w, (s, n) in self.work.items() if s > 0}
            self.work, self.since = {}, now
            if len(rates) < 2:
                return None
            slow = min(rates, key=rates.get)
            others = statistics.median(r for w, r in rates.items() if w != slow)
            if rates[slow] >= self.share * others or (self.said is not None and now - self.said < self.every):
                return None
            self.said = now
        return f"Worker {slow} holds the round: {rates[slow]:.1f} it/s against {others:.1f} for the others"


# -- what the worker loops share -------------------------------------------------------------------


def read_params(client, model, params):
    """The model's parameters read out into `params` for an exchange; the time counts as blocked on it: the
    worker's own part of an exchange, which its steps wait on as they wait on the wire."""
    with client.blocking():
        return model.get_flat(params)


def write_params(client, model, params):
    """An exchange's result in `params` written back into the model, counted as blocked on it."""
    with client.blocking():
        model.set_flat(params)


def send_history(client, model, asked=False):
    """Send the worker's solver history to the exchanger, which holds it for the job's snapshots (asked: only
    if the driver asked for it, in the reply to the last exchange). Between exchanges, never while one is in
    flight: the model's history is the training thread's."""
    if not asked or client.history_wanted:
        client.send_history(model.get_history_flat(), model.iter, model.current_step)
