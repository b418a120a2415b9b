"""Time to accuracy (#14, RQ1 and RQ2; #44): LeNet on Fashion-MNIST (real data) trained by DeepSpark and by the single-process peers, at three seeds in interleaved rounds, test accuracy against wall-clock and samples; JSON lines.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/time_to_accuracy.py [--quick] [--seeds 3]
        [--epochs E] [--only NAME,...]

The rounds (SEEDS): seed 1 of each compared run, then seed 2, ...: DeepSpark's single run and easgd (2 workers on
local[2] at the zoo's period 32, base_lr x2), each `deepspark train` on models/lenet in a process of its own with the solver's
hyperparameters, its deepspark.prototxt and random_seed the seed; and bench/peers.py's torch single and keras single
at the same seed. Then the slow-link section's loopback runs, once (AFTER). Every DeepSpark run reads its shards
shuffled each epoch, as the peers do. The clock starts at the driver's "Solving" line: Spark's session is up and the
shards are planned, so it holds the workers' start-up (task launch, TensorFlow, the spill, the backend build) and
their training. Tests are off the clock, as the peers' clocks have them: the run snapshots every 6,400 samples
(GRID_SAMPLES, the peers' checkpoints too; the compressed exchange and its float32 twin at every exchange,
MILESTONES) and each snapshot is tested afterwards on the 10,000 test images. Each record has its samples/s between
test points (a run that slowed shows), the machine's load average read every LOAD_SECONDS while it trained, and a
single run's process start to its first step. Peak memory is the PSS of the run's whole process tree (driver, JVM,
Python workers), sampled every 0.25 s.
"""

import argparse
import collections
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _memory  # noqa: E402  (bench/_memory.py)
import _results  # noqa: E402  (bench/_results.py)
from _tables import cell, missing, table  # noqa: E402  (bench/_tables.py)
from deepspark.plot import LINE  # noqa: E402

SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
NET = os.path.join(ROOT, "models", "lenet", "train_val.prototxt")
TRAIN_IMAGES, BATCH, WORKERS = 60_000, 64, 2
# The page's test grid: every run here and every peer (bench/peers.py) checkpoints every 6,400 samples (100 steps of
# single's batch, 50 of two workers', 25 of four), each tested afterwards: a time to a target is at most one interval
# late, the same interval for every framework. bench/network.py's LeNet runs keep MILESTONE_SAMPLES.
GRID_SAMPLES, MILESTONE_SAMPLES = 6_400, 15_000
TARGETS = (0.85, 0.88)
LABELS = tuple(str(t) for t in TARGETS)  # as the records' keys name them: seconds_to_0.88
AT_SECONDS = 180

# name: DeepSparkParameter knobs. The moving rate is the zoo's (0.45 for 2 workers: β = p·α = 0.9, the EASGD paper's);
# 4 workers keep β at 0.9 (RQ5's d(α, τ, n); they oversubscribe the 2 cores, two a core). One worker is `single`
# (d = 1 by definition). Every run reads its shards in a new seeded order each epoch (data_order shuffled), as the
# peers reshuffle theirs: a single run's default is Caffe's order (#44: reshuffling is worth 0.2-0.3 points).
SCALED = "easgd period 10, learning rate x2"
# The compressed exchange of the slow-link regime (#27; bench/network.py says why this one), and its float32 twin.
CODEC, CODEC_PERIOD = "int4", 32
COMPRESSED_KNOBS = {"algorithm": "easgd", "period": CODEC_PERIOD, "exchange_codec": CODEC}
COMPRESSED = f"easgd period {CODEC_PERIOD}, {CODEC}, learning rate x2"
COMPRESSED_TWIN = f"easgd period {CODEC_PERIOD}, learning rate x2"
SYNC_SCALED = "sync, learning rate x2"
# The compared easgd run (#44): the zoo's knobs at base_lr x4, the best measured of x2, x3 and x4 (samples to 0.88,
# seeds 1-3, --only runs of 2.5-3 epochs on 2026-12-06: x2 143,360-159,744, x3 122,880-143,360, x4 114,688-118,784;
# single's median 108,800 at the solver's own rate).
TUNED = f"easgd period {CODEC_PERIOD}, learning rate x4"
RUNS = {
    "single": {"algorithm": "single"},
    "easgd period 1": {"algorithm": "easgd", "period": 1},
    "easgd period 4": {"algorithm": "easgd", "period": 4},
    "easgd period 10": {"algorithm": "easgd", "period": 10},
    "easgd period 16": {"algorithm": "easgd", "period": 16},
    "easgd period 64": {"algorithm": "easgd", "period": 64},
    "sync": {"algorithm": "sync"},
    "average period 10": {"algorithm": "average", "period": 10},
    "average period 10, DiLoCo outer Nesterov": {"algorithm": "average", "period": 10, "outer_learning_rate": 0.7,
                                                 "outer_momentum": 0.9},
    "easgd 4 workers period 10": {"algorithm": "easgd", "workers": 4, "period": 10, "moving_rate": 0.225},
    "easgd 4 workers period 64": {"algorithm": "easgd", "workers": 4, "period": 64, "moving_rate": 0.225},
    SCALED: {"algorithm": "easgd", "period": 10},
    # The slow-link regime's runs (#27), on loopback at the scaled rate: the compressed exchange bench/network.py
    # runs at 100 Mbit/s beside its float32 twin at the same period (their samples to 0.88 within 10%), and sync,
    # whose samples to 0.88 the slow links' section prices at its bytes and seconds an iteration there.
    COMPRESSED_TWIN: {"algorithm": "easgd", "period": CODEC_PERIOD},
    COMPRESSED: COMPRESSED_KNOBS,
    SYNC_SCALED: {"algorithm": "sync"},
    TUNED: {"algorithm": "easgd", "period": CODEC_PERIOD},
}
ORDER = {"data_order": "shuffled"}
# Solver changes of a run: the scaled run's workers step at base_lr x workers, Goyal et al.'s linear rule for their
# global batch (2 x 64 a step against single's 64; TorchDistributor keeps single's global batch instead, 2 x 32).
LEARNING_RATE_TIMES = {SCALED: 2, COMPRESSED_TWIN: 2, COMPRESSED: 2, SYNC_SCALED: 2, TUNED: 4}
# The codec's pair snapshots at every exchange (a period: 4,096 samples, ~3% of the ~135,000 to 0.88), so that 10%
# can be told apart: the driver snapshots the center when it hears of a milestone, at an exchange, and a milestone
# that is not a multiple of the period would fall on one exchange or the next.
MILESTONES = {name: CODEC_PERIOD * BATCH * WORKERS for name in (COMPRESSED_TWIN, COMPRESSED, TUNED)}
# The comparison of #44's acceptance, made at each seed: DeepSpark's single run and easgd (2 workers, the rate scaled
# to their global batch), and the single-process peers of bench/peers.py. The rounds interleave them (seed 1 of
# each, then seed 2, ...), so that a slow patch of the shared machine does not land on one framework.
SEEDS = (1, 2, 3)
# easgd in the rounds is the zoo's LeNet at its own knobs (models/lenet/deepspark.prototxt: period 32, the best measured
# of 10, 16, 32 and 64 here: as many samples to 0.88 as period 10 at ~1.3x its samples/s) at base_lr x4 (TUNED); period
# 10 (SCALED) and period 32 at x2 (COMPRESSED_TWIN, the codec's twin) run once after the rounds, for the sections that
# compare them.
COMPARED_EASGD = TUNED
COMPARED = ("single", COMPARED_EASGD)
PEERS_COMPARED = ("torch single", "keras single")
# Each compared run's samples, in epochs: enough for every seed to pass 0.88 (single reached it in ~2.3 epochs of
# Caffe's order here, easgd at x4 in ~2, torch and keras single in 2.0-2.25), no more: the rounds are
# most of the page's hour. The peers stop early once a checkpoint tests at or above the last target (bench/peers.py).
COMPARED_EPOCHS = {"single": 3.0, COMPARED_EASGD: 2.5, "torch single": 3.0, "keras single": 3.0}
# After the rounds, once each: the slow-link section's loopback runs (bench/network.py's and _slow_links.py's), as
# long as each needed to pass 0.88 on the last full page and a margin (the codec's pair 143,360-172,032 samples, sync
# 104,832).
AFTER = {SCALED: 3.0, COMPRESSED_TWIN: 3.0, COMPRESSED: 3.0, SYNC_SCALED: 2.5}
# --quick: the rounds at two seeds (medians and ranges drawn), a few test points each; --smoke: one seed, a step or
# two, the peers' torch single only (none without bench/.venv-peers).
QUICK_SEEDS, QUICK_EPOCHS, SMOKE_EPOCHS = 2, 0.5, 0.02
EPOCHS = 2.5  # --only's runs
# bench/network.py's LeNet runs to accuracy train as long as easgd at the scaled rate here once did to pass 0.88.
TARGET_EPOCHS = 3.5
LOAD_SECONDS = 5  # between two readings of /proc/loadavg while a run trains


def solver_copy(folder, every, on_clock, solver=SOLVER, learning_rate_times=1, seed=None):
    """A copy of `solver` in `folder` (its deepspark.prototxt embedded) that snapshots every `every` iterations and
    tests then too when `on_clock` (else never: the snapshots are tested afterwards), its base_lr times
    `learning_rate_times`, its random_seed `seed` (None: the solver's); its path."""
    from google.protobuf import text_format

    from deepspark.config import load_solver

    param = load_solver(solver).param
    param.test_interval = every if on_clock else 0
    param.test_initialization = False
    param.snapshot, param.snapshot_after_train, param.display = every, True, every
    param.base_lr *= learning_rate_times
    if seed is not None:
        param.random_seed = seed
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "solver.prototxt")
    with open(path, "w") as stream:
        stream.write(text_format.MessageToString(param))
    return path


def command(solver, folder, iterations, knobs):
    """`deepspark train` of `solver` for `iterations` into `folder`, with DeepSparkParameter `knobs` as flags."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
    return [sys.executable, "-m", "deepspark.cli", "train", "--solver", solver, "--output", folder, "--iterations",
            str(iterations), *flags]


def workers_of(knobs):
    return 1 if knobs["algorithm"] == "single" else knobs.get("workers", WORKERS)


def samples_per_iteration(knobs):
    return BATCH * workers_of(knobs)


def stamped(log_path):
    """(seconds since the first "Solving" line, message) of each line of a train.log."""
    lines, start = [], None
    with open(log_path) as stream:
        for line in stream:
            match = LINE.match(line.rstrip("\n"))
            if not match:
                continue
            when = datetime.datetime.strptime(match.group(1), "%m%d %H:%M:%S.%f")
            if start is None and match.group(2).startswith("Solving"):
                start = when
            if start is not None:
                lines.append(((when - start).total_seconds(), match.group(2)))
    return lines


def line_epoch(log_path, pattern):
    """The time.time() of the first line of a train.log whose message matches `pattern`, or None (the log's stamps
    are local time without a year: this year's)."""
    with open(log_path) as stream:
        for line in stream:
            match = LINE.match(line.rstrip("\n"))
            if match and re.match(pattern, match.group(2)):
                when = datetime.datetime.strptime(match.group(1), "%m%d %H:%M:%S.%f")
                return when.replace(year=datetime.datetime.now().year).timestamp()
    return None


def load_average():
    """The machine's 1-minute load average (/proc/loadavg)."""
    with open("/proc/loadavg") as stream:
        return float(stream.read().split()[0])


class Load:
    """/proc/loadavg's 1-minute figure read every LOAD_SECONDS while a run trains: [(time.time(), load)], the
    first when it starts and the last when it is stopped."""

    def __init__(self):
        self.readings = [(time.time(), load_average())]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="load-average")
        self._thread.start()

    def _read(self):
        while not self._stop.wait(LOAD_SECONDS):
            self.readings.append((time.time(), load_average()))

    def stop(self, clock_start=None):
        """The record's load fields: at the start and end, and every reading on the run's clock (seconds since
        `clock_start`, a time.time(); None: since the first reading)."""
        self._stop.set()
        self._thread.join()
        self.readings.append((time.time(), load_average()))
        zero = clock_start or self.readings[0][0]
        return {"load_average_start": self.readings[0][1], "load_average_end": self.readings[-1][1],
                "load_average_during": [[round(t - zero, 1), load] for t, load in self.readings]}


def on_clock_points(lines, per_iteration):
    """[(seconds, samples, accuracy)] from the driver's own tests."""
    points, testing = [], None
    for seconds, message in lines:
        if (m := re.search(r"Iteration (\d+), Testing net \(#0\)", message)):
            testing = int(m.group(1))
        elif (m := re.search(r"Test net output #\d+: accuracy = ([\d.]+)", message)) and testing is not None:
            points.append((seconds, testing * per_iteration, float(m.group(1))))
            testing = None
    return points


def snapshot_points(lines, per_iteration):
    """[(seconds, samples, .caffemodel)] of the snapshots the run wrote, when each was written."""
    points = []
    for seconds, message in lines:
        if (m := re.search(r"Snapshotting to binary proto file (\S+_iter_(\d+)\.caffemodel)", message)):
            points.append((seconds, int(m.group(2)) * per_iteration, m.group(1)))
    return points


_TEST_MODELS = {}  # (net, backend): its test model, built once per process (a build costs more than the test)


def accuracy(weights, net=NET, backend="tensorflow", iterations=100):
    """The test accuracy of a snapshot on the 10,000 test images (off the clock, after the run): Caffe's `test`
    (deepspark.nets.test) on a test model built once and given each snapshot's weights."""
    from deepspark import checkpoint, engine, nets
    from deepspark.proto import deepspark_pb2 as pb

    if (net, backend) not in _TEST_MODELS:
        _TEST_MODELS[net, backend] = nets.test_model(net, backend)
    model = _TEST_MODELS[net, backend]
    model.set_params(checkpoint.weights_for(model.graph, checkpoint.read_caffemodel(weights), model.get_params(),
                                            weights))
    feeders = nets.feeders_for(model, pb.TEST)
    try:
        return float(engine.score(model, feeders, iterations)["accuracy"])
    finally:
        engine.close_all(feeders)


def reached(points, target):
    """(seconds, samples) of the first point at or above `target`, or (None, None)."""
    for seconds, samples, value in points:
        if value >= target:
            return seconds, samples
    return None, None


def interval_rates(points):
    """Samples a second between each two test points of a run (its grid's intervals, start-up before the first)."""
    return [(n2 - n1) / (s2 - s1) if s2 > s1 else None for (s1, n1, _), (s2, n2, _) in zip(points, points[1:])]


def slow_intervals(record):
    """[(samples at the interval's start, at its end, its samples/s, the run's median interval rate, the highest
    load average read in it)] of the intervals of `record` below half its median interval rate: a run that slowed."""
    points, rates = record.get("points") or [], [r for r in record.get("interval_rates") or [] if r]
    if len(rates) < 3:
        return []
    middle, found = statistics.median(rates), []
    for (s1, n1, _), (s2, n2, _), rate in zip(points, points[1:], record["interval_rates"]):
        if rate and rate < middle / 2:
            loads = [load for t, load in record.get("load_average_during") or [] if s1 - LOAD_SECONDS <= t <= s2]
            found.append((n1, n2, rate, middle, max(loads, default=None)))
    return found


def figures(name, points, peak_mb, wall, on_clock, workers=None, period=None):
    """The run's JSON record: its points and what the table shows of them."""
    record = {"bench": "time_to_accuracy", "run": name, **({"workers": workers, "period": period} if workers else {}),
              "tests": "on the clock" if on_clock else "off the clock",
              "points": [[round(s, 2), n, round(a, 4)] for s, n, a in points], "peak_pss_mb": round(peak_mb),
              "wall_seconds": round(wall, 1)}
    for target in TARGETS:
        seconds, samples = reached(points, target)
        record[f"seconds_to_{target}"] = None if seconds is None else round(seconds, 1)
        record[f"samples_to_{target}"] = samples
    before = [a for s, _, a in points if s <= AT_SECONDS]
    record[f"accuracy_at_{AT_SECONDS}s"] = round(before[-1], 4) if before else None
    record["final_accuracy"] = round(points[-1][2], 4) if points else None
    rates = interval_rates(points)
    record["interval_rates"] = [None if r is None else round(r, 1) for r in rates]
    # Between the first test point and the last: the run's training rate, its start-up left out.
    record["samples_per_second"] = None if len(points) < 2 or points[-1][0] <= points[0][0] else \
        round((points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0]), 1)
    return record


def caffemodel_writes(lines):
    """Seconds each snapshot's .caffemodel held a single run's training loop: from its `Snapshotting to` line to the
    solver state's line."""
    return [b - a for (a, first), (b, then) in zip(lines, lines[1:])
            if first.startswith("Snapshotting to") and then.startswith("Snapshotting solver state")]


def run(name, knobs, epochs, on_clock, folder, seed=None):
    """One `deepspark train` run of `knobs` for `epochs` (random_seed `seed`), its snapshots tested afterwards: its
    record, with the machine's load while it trained and, for a single run, its process start to its first step."""
    per_iteration = samples_per_iteration(knobs)
    every = max(1, round(MILESTONES.get(name, GRID_SAMPLES) / per_iteration))
    iterations = round(epochs * TRAIN_IMAGES / per_iteration)
    solver = solver_copy(folder, every, on_clock, learning_rate_times=LEARNING_RATE_TIMES.get(name, 1), seed=seed)
    load, began, started = Load(), time.time(), time.monotonic()
    process = subprocess.Popen(command(solver, folder, iterations, {**knobs, **ORDER}), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": ROOT})
    memory = _memory.PeakPss(process.pid)
    out, err = process.communicate()
    peak, wall = memory.stop(), time.monotonic() - started
    log_path = os.path.join(folder, "train.log")
    loads = load.stop(line_epoch(log_path, r"Solving ") if os.path.exists(log_path) else None)
    if process.returncode:
        raise SystemExit(f"{name}: the run failed:\n{err[-3000:]}")
    lines = stamped(log_path)
    if on_clock:
        points = on_clock_points(lines, per_iteration)
    else:
        points = [(s, n, accuracy(path)) for s, n, path in snapshot_points(lines, per_iteration)]
    # A single run's first step is its first display (display = the snapshots' interval, so iteration 0's).
    first = line_epoch(log_path, r"Iteration 0\b") if workers_of(knobs) == 1 else None
    writes = caffemodel_writes(lines) if workers_of(knobs) == 1 else []
    return {**figures(name, points, peak, wall, on_clock, workers_of(knobs), knobs.get("period")),
            "codec": knobs.get("exchange_codec", "float32"), "milestone_samples": every * per_iteration,
            "data_order": ORDER["data_order"], **({"seed": seed} if seed is not None else {}), **loads,
            **({"process_start_to_first_step": round(first - began, 2)} if first else {}),
            **({"caffemodel_writes_seconds": [round(sum(writes), 2), round(max(writes), 3), len(writes)]}
               if writes else {})}


def run_peer(name, seed, epochs, out, smoke):
    """A peer of bench/peers.py at `seed`, in its own process (its records appended to `out`)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers.py"), "--only", name, "--seed",
                           str(seed), "--epochs", str(epochs), "--out", out, *(["--smoke"] if smoke else [])],
                          cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{name} (seed {seed}): bench/peers.py failed")


def run_names(listed, known=RUNS):
    """The run names of a comma-separated list, where a name may hold commas itself ("sync, learning rate x2"):
    at each place the longest that names a run of `known`."""
    parts, names, i = listed.split(","), [], 0
    while i < len(parts):
        j = next((j for j in range(len(parts), i, -1) if ",".join(parts[i:j]).strip() in known), None)
        if j is None:
            raise SystemExit(f"no run named {parts[i].strip()!r} (known: {'; '.join(known)})")
        names.append(",".join(parts[i:j]).strip())
        i = j
    return names


def plan(args):
    """[(name, seed, epochs)] in the order they run: rounds of the compared runs (ours and the peers'), seed 1 of
    each, then seed 2, ...; then the runs made once (at the first seed)."""
    if args.only:
        names, seeds, after = run_names(args.only, {**RUNS, **dict.fromkeys(PEERS_COMPARED)}), args.seeds or 1, []
    elif args.smoke:
        names, seeds, after = (*COMPARED, PEERS_COMPARED[0]), 1, []
    else:
        names, seeds, after = (*COMPARED, *PEERS_COMPARED), args.seeds or (QUICK_SEEDS if args.quick else
                                                                           len(SEEDS)), ([] if args.quick else list(AFTER))

    def epochs(name):
        return args.epochs or (SMOKE_EPOCHS if args.smoke else QUICK_EPOCHS if args.quick else
                               COMPARED_EPOCHS.get(name, AFTER.get(name, EPOCHS)))
    return [(name, seed, epochs(name)) for seed in SEEDS[:seeds] for name in names] + \
        [(name, SEEDS[0], epochs(name)) for name in after]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"the rounds at {QUICK_SEEDS} seeds, {QUICK_EPOCHS:g} "
                        "epochs each, nothing after them")
    parser.add_argument("--smoke", action="store_true",
                        help=f"runs end to end only (make bench-smoke): one seed, {SMOKE_EPOCHS:g} epochs")
    parser.add_argument("--epochs", type=float, help="each run's epochs (default: COMPARED_EPOCHS's, else "
                        f"{EPOCHS:g})")
    parser.add_argument("--seeds", type=int, choices=range(1, len(SEEDS) + 1),
                        help=f"rounds (default {len(SEEDS)}; 1 with --only)")
    parser.add_argument("--only", help="comma-separated run names (ours, or the peers' " +
                        ", ".join(PEERS_COMPARED) + ")")
    parser.add_argument("--out", default=_results.results_path("time_to_accuracy"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for i, (name, seed, epochs) in enumerate(plan(args)):
            if name in PEERS_COMPARED:
                run_peer(name, seed, epochs, args.out, args.smoke)
                continue
            record = run(name, RUNS[name], epochs, False, os.path.join(scratch, str(i)), seed)
            scaled = {"learning_rate_times": LEARNING_RATE_TIMES[name]} if name in LEARNING_RATE_TIMES else {}
            _results.emit({**record, "epochs": epochs, **scaled, **({"repeat": seed} if seed > 1 else {})}, args.out)


# ---- the page's sections (bench/_page.py) ----------------------------------------------------------------

def median(values):
    """The median of `values`, None (not reached) ranking above every number: None when that is where it falls."""
    ranked = sorted(values, key=lambda v: (v is None, v or 0))
    if not ranked:
        return None
    middle = ranked[(len(ranked) - 1) // 2:len(ranked) // 2 + 1]
    return None if None in middle else sum(middle) / len(middle)


def spread(values, digits=1, unit=""):
    """A table cell of one run's figure over its seeds: the median and (min-max); "not reached" where a seed did
    not reach it."""
    if len(values) < 2:
        return cell(values[0] if values else None, digits, unit)
    if all(v is None for v in values):
        return "—"
    reached_ = [v for v in values if v is not None]
    top = "not reached" if None in values else cell(max(reached_), digits)
    return f"{cell(median(values), digits, unit)} ({cell(min(reached_), digits)}–{top})"


def grouped(runs):
    """{row label: [records]} in the order first seen: a run made at several seeds (or again) is one row."""
    groups = {}
    for r in runs:
        label = r.get("run") + (f" ({r['tests']})" if r.get("tests") == "on the clock" else "")
        groups.setdefault(label if "error" not in r else label + " (error)", []).append(r)
    return groups


def loads_cell(group):
    return " / ".join(f"{cell(r.get('load_average_start'), 1)}→{cell(r.get('load_average_end'), 1)}" for r in group
                      if r.get("load_average_start") is not None) or "—"


def accuracy_rows(groups):
    rows = []
    for label, group in groups.items():
        r = group[0]
        if "error" in r:
            rows.append([label.removesuffix(" (error)"), "could not run: " + r["error"], *["—"] * 8])
            continue
        seeds = ", ".join(str(g["seed"]) for g in group if g.get("seed")) or "—"
        rows.append([label, seeds, *[spread([g.get(f"seconds_to_{t}") for g in group], 1, " s") for t in LABELS],
                     *[spread([g.get(f"samples_to_{t}") for g in group], 0) for t in LABELS],
                     spread([g.get("samples_per_second") for g in group], 0),
                     spread([g.get("final_accuracy") for g in group], 4),
                     cell(max((g.get("peak_pss_mb") or 0 for g in group), default=None) or None, 0, " MB"),
                     loads_cell(group)])
    return rows


def page_section(records, data, plot):
    """RQ1/RQ2: the time-to-accuracy table of DeepSpark's runs and the peers' (a row a run, the median and range of
    its seeds), the plot of all, and what the machine did meanwhile."""
    runs = [r for r in records if "points" in r or "error" in r]
    if not runs:
        return missing("DeepSpark's runs and the peers'", "make bench")
    groups = grouped(runs)
    header = ["run", "seeds", "seconds to 0.85", "seconds to 0.88", "samples to 0.85", "samples to 0.88",
              "samples/s", "final accuracy", "peak PSS", "load average, start→end"]
    plotted = draw_accuracy(groups, plot)
    clocks = sorted({r["clock"] for r in runs if r.get("clock")})
    return "\n\n".join(filter(None, [
        table(header, accuracy_rows(groups)),
        f"![test accuracy against wall-clock seconds]({os.path.basename(plot)})" if plotted else None,
        grid_line(runs),
        f"From `{os.path.relpath(data, ROOT)}/time_to_accuracy.jsonl` (bench/time_to_accuracy.py, with the "
        "single-process peers it runs in its rounds) and `peers.jsonl` (bench/peers.py). DeepSpark's clock starts at "
        "the driver's `Solving` line (its SparkContext up, shards planned): it holds the workers' start-up and their "
        "training" + ("; the peers' clocks, each as its record says:" if clocks else "."),
        "\n".join(f"- {c}" for c in clocks) or None,
        "Every run reads its training set in a new seeded order each epoch: DeepSpark's with `data_order: SHUFFLED` "
        "(each worker its shard; a single run's default is Caffe's order), Keras's `fit(shuffle=True)`, the PyTorch "
        "loop's permutation, DistributedSampler. `easgd` and `sync` take a batch of 64 on each worker, twice "
        "single's samples a step, where TorchDistributor splits one batch of 64 between its two processes; `" +
        SCALED + "` steps at twice single's learning rate, Goyal et al.'s linear rule for its global batch."
        if clocks else None,
        machine_lines(runs),
        noise_line(runs)]))


def grid_line(runs):
    """The test grid, the seeds and the run order, as the records say."""
    grids = sorted({r["milestone_samples"] for r in runs if r.get("milestone_samples")})
    seeds = sorted({r["seed"] for r in runs if r.get("seed")})
    if not seeds and not grids:
        return None
    others = [cell(g) for g in grids if g != GRID_SAMPLES]
    return (f"Each run is tested on the 10,000 test images every {cell(GRID_SAMPLES)} samples (the peers' "
            "checkpoints too; " + (", ".join(others) + " where a run's record says so; " if others else "") +
            "tests off every clock): a time to a target is the first test at or above it, at most one interval late."
            + (f" Seeds {', '.join(map(str, seeds))}: each cell of a run made at several seeds is the median of its "
               "seeds and (their minimum–maximum); a seed that did not reach a target ranks above every time. The "
               "rounds interleave the frameworks (seed 1 of each, then seed 2, ...) so that a slow patch of the "
               "shared machine does not land on one; the last column is the machine's 1-minute load average "
               "(/proc/loadavg) at each run's start and end, by seed." if seeds else ""))


def machine_lines(runs):
    """A line for each run interval below half the run's median interval rate (a run that slowed, with the load
    average read in it), and the single runs' snapshot writes, the one blocking I/O on their training loop."""
    slow = [f"{r['run']}" + (f" (seed {r['seed']})" if r.get("seed") else "") + f": {cell(n1)}–{cell(n2)} samples "
            f"at {cell(rate, 0)} samples/s against its median {cell(middle, 0)}"
            + (f", load average up to {load:.1f}" if load is not None else "")
            for r in runs for n1, n2, rate, middle, load in slow_intervals(r)]
    said = ("Intervals between two tests slower than half their run's median rate: " + "; ".join(slow) + "."
            if slow else "No run had an interval between two tests below half its median rate." if any(
                len(r.get("interval_rates") or []) >= 3 for r in runs) else None)
    writes = [(r, r["caffemodel_writes_seconds"]) for r in runs if r.get("caffemodel_writes_seconds")]
    if writes:
        total = sum(w[0] for _, w in writes)
        trained = sum(r["points"][-1][0] - r["points"][0][0] for r, _ in writes if len(r["points"]) > 1)
        said = (said + " " if said else "") + (
            "The single runs' .caffemodel snapshots held their training loop (from a snapshot's `Snapshotting to` "
            f"line to its solver state's: serialised, then written, fsync'd and renamed by a thread of their own, "
            f"checkpoint.writes_behind) {total:.2f} s in all over {sum(w[2] for _, w in writes)} snapshots, at most "
            f"{max(w[1] for _, w in writes):.3f} s one" + (f": {100 * total / trained:.1f}% of their training time"
                                                           if trained > 0 else "") + ".")
    return said


def noise_line(runs):
    """How long the runs were, and how far one run's test accuracy fell between two of its snapshots: a time to a
    target is the first snapshot at or above it, and the curves are not monotone."""
    epochs = collections.defaultdict(list)  # epochs: the runs that trained them
    for r in runs:
        if r.get("epochs"):
            epochs[round(r["epochs"], 1)].append(r["run"] + (" (on the clock)" if r.get("tests") == "on the clock"
                                                             else ""))
    converged = [r for r in runs if len(r.get("points") or []) > 1 and r["points"][-1][2] >= TARGETS[0]]
    falls = [(max(a - b for (_, _, a), (_, _, b) in zip(r["points"], r["points"][1:])), r["run"]) for r in converged]
    most = max(epochs, key=lambda e: len(epochs[e]), default=None)
    said = None if most is None else f"Runs train {most:g} epochs of samples" + "".join(
        f"; {', '.join(dict.fromkeys(names))}: {e:g}" for e, names in sorted(epochs.items()) if e != most) + (
        " (Elephas trains whole epochs; the single-process peers stop at their first test at or above "
        f"{TARGETS[-1]}; COMPARED_EPOCHS and AFTER in bench/time_to_accuracy.py)."
        if len(epochs) > 1 else ".")
    fall, run = max(falls, default=(0.0, None))
    if fall <= 0:
        return said
    return ((said + " " if said else "") + f"Test accuracy is not monotone: among the runs that end above {TARGETS[0]}, one ({run}) fell by "
            f"{100 * fall:.1f} points between two snapshots; a time to a target is the first snapshot at or above it, "
            "and a run can end below a target it reached.")


def draw_accuracy(groups, path):
    """Test accuracy against seconds, a colour a run and a thin line a seed, and at each target the median time with
    a bar over the seeds' range; False when nothing can be drawn."""
    drawn = {label: [r for r in group if r.get("points")] for label, group in groups.items()}
    drawn = {label: group for label, group in drawn.items() if group}
    if not drawn:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab10" if len(drawn) <= 10 else "tab20").colors  # one a run, told apart
    for i, (label, group) in enumerate(drawn.items()):
        colour, dashed = colours[i % len(colours)], "--" if group[0].get("clock") else "-"  # the peers' dashed
        for k, r in enumerate(group):
            seconds, accuracy_ = zip(*[(s, a) for s, _, a in r["points"]])
            axes.plot(seconds, accuracy_, color=colour, linestyle=dashed, linewidth=1 if len(group) > 1 else 1.5,
                      alpha=0.55 if len(group) > 1 else 1, marker="." if len(group) == 1 else None,
                      label=None if k else label + (f" ({len(group)} seeds)" if len(group) > 1 else ""))
        for target in TARGETS:
            times = [r.get(f"seconds_to_{target}") for r in group]
            middle, known = median(times), [t for t in times if t is not None]
            if middle is not None and len(group) > 1:
                axes.errorbar(middle, target, xerr=[[middle - min(known)], [max(known) - middle]], color=colour,
                              marker="o", markersize=5, capsize=3)
    for target in TARGETS:
        axes.axhline(target, color="grey", linewidth=0.6, linestyle="--")
    axes.set_xlabel("seconds since training started")
    axes.set_ylabel("test accuracy (10,000 images)")
    axes.set_ylim(0.6, 0.95)
    axes.legend(fontsize=7, loc="lower right", title="DeepSpark solid, peers dashed; o: median time to a target, "
                "bar: the seeds' range", title_fontsize=7)
    axes.set_title("LeNet on Fashion-MNIST, 2 cores")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def d_value(run, single, target):
    """d at `target`: the samples `run` needed over `single`'s, "> x" (its samples so far over single's) when it
    stopped short; None when single did not reach it."""
    base, samples = single.get(f"samples_to_{target}"), run.get(f"samples_to_{target}")
    if not base:
        return None
    return f"{samples / base:.2f}" if samples else f"> {run['points'][-1][1] / base:.2f}"


def divergence_rows(records):
    """{row label: {period: run}} of the easgd runs off the clock, a row per worker count, codec and learning rate
    (single's samples the base of all)."""
    groups = {}
    for r in records:
        if r.get("run", "").startswith("easgd") and r.get("tests") == "off the clock" and r.get("workers") \
                and r.get("points") and not r.get("repeat"):
            codec, times = r.get("codec", "float32"), r.get("learning_rate_times")
            key = (r["workers"], codec != "float32", codec, times or 1)
            label = f"{r['workers']}" + (f", {codec}" if codec != "float32" else "") + \
                (f", base_lr x{times}" if times else "")
            groups.setdefault(key, (label, {}))[1][r["period"]] = r
    return dict(groups[key] for key in sorted(groups))


def divergence_section(records, data, plot):
    """RQ5: d(α, τ, n), the samples an EASGD run needs to reach a test accuracy over `single`'s, by workers, codec,
    learning rate and period, at 0.85 and 0.88 (a run that did not reach it gives a lower bound: its samples over
    single's), as a table and a plot."""
    single = next((r for r in records if r.get("run") == "single" and r.get("tests") == "off the clock"), None)
    groups = divergence_rows(records)
    if not single or not groups:
        return missing("single and easgd at several periods and worker counts", "make bench")
    periods = sorted({p for runs in groups.values() for p in runs})
    header = ["target", "workers ↓ period →", *[str(p) for p in periods]]
    rows = []
    for target in LABELS:
        base = single.get(f"samples_to_{target}")
        if not base:
            rows.append([target, "—", *[f"single did not reach {target}"] + [""] * (len(periods) - 1)])
            continue
        rows.append([target, "1 (single)", *["1.00" if i == 0 else "" for i in range(len(periods))]])
        for label, runs in groups.items():
            rows.append([target, label, *["" if p not in runs else d_value(runs[p], single, target)
                                          for p in periods]])
    bases = ", ".join(f"{cell(single.get(f'samples_to_{t}'))} to {t}" for t in LABELS)
    milestones = sorted({r["milestone_samples"] for runs in groups.values() for r in runs.values()
                         if r.get("milestone_samples") not in (None, GRID_SAMPLES)})
    drawn = draw_divergence(groups, single, plot)
    return "\n\n".join(filter(None, [
        table(header, rows),
        f"![d(α, τ, n) against the period]({os.path.basename(plot)})" if drawn else None,
        f"d = the samples a run needed to reach the target test accuracy / `single`'s ({bases}); \"> x\": not "
        "reached within its samples (x of single's). The moving rate keeps β = p·α = 0.9 (α = 0.45 and 0.225 for 2 "
        "and 4 workers); a blank cell was not run. A row with base_lr x2 steps at twice single's learning rate "
        "(Goyal et al.'s linear rule for its global batch of 2 x 64); a codec's row sends its exchanges in it (the "
        "slow-link section's runs, on loopback here). Samples are counted at the snapshots (every "
        f"{cell(GRID_SAMPLES)} samples" + (", " + " or ".join(cell(m) for m in milestones) + " where a run says so" if milestones else "") +
        "), so d moves in steps of that over single's samples. 4 workers oversubscribe the 2 cores (two a core): "
        f"the table compares samples, not seconds. From `{os.path.relpath(data, ROOT)}/time_to_accuracy.jsonl`."]))


def draw_divergence(groups, single, path):
    """d against the period, a panel per target and a line per row of the table; a hollow ^ where the run stopped
    short (its samples over single's: a lower bound). False when nothing can be drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, len(LABELS), figsize=(10, 4.2), sharey=True)
    drawn = False
    for axes, target in zip(panels, LABELS):
        base = single.get(f"samples_to_{target}")
        for i, (label, runs) in enumerate(groups.items()):
            colour = plt.get_cmap("tab10").colors[i % 10]
            points = []
            for period, r in sorted(runs.items()):
                samples = r.get(f"samples_to_{target}")
                if base:
                    points.append((period, (samples or r["points"][-1][1]) / base, samples is None))
            if not points:
                continue
            drawn = True
            axes.plot([p for p, _, _ in points], [d for _, d, _ in points], color=colour, label=label)
            for period, d, lower in points:
                axes.plot(period, d, marker="^" if lower else "o", color=colour, markersize=7,
                          markerfacecolor="none" if lower else colour)
        axes.axhline(1.0, color="grey", linewidth=0.6, linestyle="--")
        axes.set_xscale("log", base=2)
        axes.set_xlabel("period τ (iterations between exchanges)")
        axes.set_title(f"to {target} test accuracy", fontsize=10)
    panels[0].set_ylabel("d: samples / single's")
    panels[-1].legend(fontsize=7, title="workers, codec, rate; hollow ^: a lower bound", title_fontsize=7)
    figure.tight_layout()
    if drawn:
        figure.savefig(path, dpi=110)
    plt.close(figure)
    return drawn


if __name__ == "__main__":
    main()
