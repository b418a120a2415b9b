"""A commodity network, emulated (#14, items 2 and 5; #27): easgd at period 1, 10 and 64 against sync, float32 and the compressed exchange, each worker's exchanges through a token-bucket proxy (bench/_shaper.py) at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s; time per iteration, exchange share, bytes sent, time and bytes to 0.88 (LeNet), and what `deepspark plan` projected for each.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/network.py [--quick] [--seconds 60] [--slow-seconds 150]
        [--epochs 3.5] [--only lenet|wide] [--networks 100M,...] [--runs NAME,...]

Two models: models/lenet on Fashion-MNIST (real data; 431,080 parameters), and "wide", a synthetic net of
GoogLeNet's parameter count (6,998,552: inner products on 32x32 synthetic images) whose step is cheap beside its
exchange. The jobs are `deepspark train` with 2 workers on local[2]; the exchanger listens on a fixed port and the
workers are told the proxy's (--exchange-port, --exchange-address), so every byte of the exchange crosses the
emulated links: each worker's own and the driver's, shared (bench/_shaper.py). LeNet runs to accuracy at 1 Gbit/s
(LENET_NETWORKS says why): they stop after --seconds or --epochs, snapshot every ~15,000 samples and are tested
afterwards (bench/time_to_accuracy.py's way), and its easgd period 10, sync and average run again at base_lr x2
(SCALED). The slow-link regime's runs (EVERY_LINK: float32 easgd at period 10, the compressed exchange and
average, at base_lr x2) train to accuracy on every link, at 100 Mbit/s capped at --slow-seconds. Every other run
measures time per iteration: it trains the iterations the planner projects for PER_ITERATION_SECONDS
(ITERATIONS_FLOOR to ITERATIONS_CAP). Each record has what a worker sent through the exchanger (its summary line)
and the bytes an iteration of its exchanges. The proxy's own ceiling (unshaped) is measured first: a setting near
it is bounded by the proxy, not the emulated link, and the record says so.
"""

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)
from _tables import cell, missing, table  # noqa: E402  (bench/_tables.py)
import _shaper  # noqa: E402  (bench/_shaper.py)
import time_to_accuracy as tta  # noqa: E402  (bench/time_to_accuracy.py: the clock, the snapshots, the tests, the names)
from _wide import wide_job  # noqa: E402  (bench/_wide.py)
from deepspark import plan  # noqa: E402
from deepspark.algorithms import average  # noqa: E402
from deepspark.exchange import protocol  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

NETWORKS = {"10G": 10.0, "1G": 1.0, "100M": 0.1}  # Gbit/s
# LeNet trains to accuracy, a minute or more a run, at 1 Gbit/s, the commodity link of the targets; at 10 Gbit/s and
# 100 Mbit/s it runs per iteration only, but for the slow-link regime's runs (EVERY_LINK). At 10 Gbit/s its 1.7 MB
# exchange (1.4 ms) is lost in a 160 ms cycle and the loopback runs of time_to_accuracy stand for it; at 100 Mbit/s
# sync's ~0.6 s an iteration would not reach 0.88 in any cap the whole page can afford.
LENET_NETWORKS = ("1G",)
LATENCY_MS = 0.1  # one way, a LAN's
RUNS = {"easgd period 1": {"algorithm": "easgd", "period": 1}, "easgd period 10": {"algorithm": "easgd", "period": 10},
        "easgd period 64": {"algorithm": "easgd", "period": 64}, "sync": {"algorithm": "sync"}}
# `average` moves its models through Spark (a broadcast and a collect), not the exchanger, so no proxy sits in its
# way: it runs on loopback, and each round's transfers over the emulated link are added to its clock by the
# model (average.transfers: 2·N·S / bandwidth + 2·latency a round). The record says so.
MODELLED = {"average period 10": {"algorithm": "average", "period": 10}}
# At 1 Gbit/s the target's three runs again at base_lr x2 (time_to_accuracy.LEARNING_RATE_TIMES's linear rule for a
# global batch of 2 x 64 a step), so that easgd is compared with sync and average at the scaled rate as at single's.
SCALED_TIMES = 2
SCALED_SUFFIX = f", learning rate x{SCALED_TIMES}"
SCALED = {name + SCALED_SUFFIX: knobs for name, knobs in
          (("easgd period 10", RUNS["easgd period 10"]), ("sync", RUNS["sync"]),
           ("average period 10", MODELLED["average period 10"]))}
# The slow-link regime (#27): on every link LeNet trains to accuracy at base_lr x2 float32 easgd at period 10, the
# compressed exchange (time_to_accuracy.COMPRESSED: int4 codes at period 32, the bits and the period together: easgd
# needs more samples to 0.88 than sync, so 100x fewer bytes to it asks more than 100x an iteration, and int4 at
# period 16 or int8 at period 32, ~125x, leave no margin), and average, whose one loopback run each link's
# transfers are added to. Sync is not run to accuracy there (its ~0.6 s an iteration at 100 Mbit/s): the page prices its
# loopback samples to 0.88 at its bytes and seconds an iteration on each link.
SCALED[tta.COMPRESSED] = tta.RUNS[tta.COMPRESSED]
EVERY_LINK = ("easgd period 10" + SCALED_SUFFIX, tta.COMPRESSED, "average period 10" + SCALED_SUFFIX)
# Per iteration on every link: the bits alone (int8 at easgd's period 10) and sync coded, on LeNet; on the wide net,
# where the exchange is most of a step, the compressed exchange and sync coded.
CODED = {"lenet": {"easgd period 10, int8": {"algorithm": "easgd", "period": 10, "exchange_codec": "int8"},
                   "sync, int8": {"algorithm": "sync", "exchange_codec": "int8"}},
         "wide": {f"easgd period {tta.CODEC_PERIOD}, {tta.CODEC}": tta.COMPRESSED_KNOBS,
                  "sync, int8": {"algorithm": "sync", "exchange_codec": "int8"}}}
QUICK_RUNS = ("easgd period 10", "sync", f"easgd period {tta.CODEC_PERIOD}, {tta.CODEC}")  # the wide net's, at 1G
SMOKE_RUNS = ("easgd period 10",)  # --smoke: the wide net's, at 1G, ITERATIONS_FLOOR iterations
WORKER = re.compile(r"Worker (\d+) on .*?: (\d+) iterations, (\d+) exchanges, .*? trained ([\d.]+)s, blocked on exchange "
                    r"([\d.]+)s")
TRAFFIC = re.compile(r"Worker \d+ on .*?: (\d+) iterations, (\d+) exchanges, .*? sent ([\d.e+]+) MB and received "
                     r"([\d.e+]+) MB through the exchanger")
# A per-iteration run's length as the planner projects it: iterations = PER_ITERATION_SECONDS / its s per iteration,
# at least ITERATIONS_FLOOR (the wide net's sync at 100 Mbit/s: 9 s an iteration), at most ITERATIONS_CAP.
PER_ITERATION_SECONDS, ITERATIONS_FLOOR, ITERATIONS_CAP = 8, 5, 300


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train(solver, knobs, gbit, folder, iterations, seconds=None):
    """One 2-worker job whose exchanges cross a proxy shaped to `gbit` (None: no proxy); (its stderr, the
    proxy's bytes)."""
    if gbit is None:
        return run_job(solver, {**knobs, "workers": 2}, folder, iterations, seconds), {}
    port = free_port()
    with _shaper.Shaper(("127.0.0.1", port), bandwidth=gbit * 1e9 / 8, latency=LATENCY_MS / 1e3) as proxy:
        knobs = {**knobs, "workers": 2, "exchange_port": port, "exchange_address": f"127.0.0.1:{proxy.address[1]}"}
        return run_job(solver, knobs, folder, iterations, seconds), dict(proxy.bytes)


def run_job(solver, knobs, folder, iterations, seconds):
    """`deepspark train` with `knobs`, stopped as a user would (SIGINT: its snapshots are written) after
    `seconds`; its stderr."""
    process = subprocess.Popen(tta.command(solver, folder, iterations, knobs), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT},
                               start_new_session=True)
    try:
        return process.communicate(timeout=seconds)[1]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)
        return process.communicate(timeout=120)[1]


def with_transfers(points, costs, gbit, knobs):
    """`average`'s loopback points with each round's transfers over a `gbit` link added to its clock."""
    per_round = tta.samples_per_iteration(knobs) * knobs["period"]
    transfers = average.transfers(costs, plan.Network.of(gbit, LATENCY_MS), tta.workers_of(knobs))
    return [(s + n / per_round * transfers, n, a) for s, n, a in points]


def worker_figures(log):
    """(seconds per iteration, exchange share) of the workers' summary lines: their means."""
    rows = WORKER.findall(log)
    if not rows:
        return None, None
    per_iteration = statistics.mean(float(trained) / int(its) for _, its, _, trained, _ in rows if int(its))
    share = statistics.mean(float(blocked) / float(trained) for _, _, _, trained, blocked in rows if float(trained))
    return per_iteration, share


def display_seconds_per_iteration(lines):
    """Seconds per iteration between the first and the last `Iteration N, loss` line of a stamped log (a run
    stopped at its time cap prints no worker summaries); None with fewer than two."""
    shown = [(seconds, int(m.group(1))) for seconds, message in lines
             if (m := re.match(r"Iteration (\d+), loss", message))]
    if len(shown) < 2 or shown[-1][1] == shown[0][1]:
        return None
    return (shown[-1][0] - shown[0][0]) / (shown[-1][1] - shown[0][1])


def traffic(log, costs, knobs):
    """What a worker of the run sent and received through the exchanger, from the workers' summary lines (their
    means, headers and tags included), and the bytes an iteration its exchanges sent: its model frames (one a
    period for easgd, one an iteration for sync: header, payload in the job's codec, tag) over its iterations. The
    rest of what it sent is the snapshots' solver histories (float32 whatever the codec: a snapshot is exact), a
    cost of the benchmark's snapshots every ~15,000 samples that a job snapshotting as Caffe's solvers do (every
    5,000 iterations) hardly pays. `average` moves float32 models through Spark: S each way a round. A run
    stopped at its cap prints no summaries: its bytes an iteration are then the frames' arithmetic."""
    if knobs["algorithm"] == "average":
        return {"bytes_through": "spark", "bytes_per_iteration": round(costs.spark_bytes / knobs["period"])}
    frame = protocol.HEADER_SIZE + costs.bytes + protocol.TAG_SIZE
    record = {"bytes_through": "exchanger", "frame_bytes": frame}
    rows = [(int(its), int(exchanges), float(sent), float(received))
            for its, exchanges, sent, received in TRAFFIC.findall(log) if int(its)]
    if not rows:
        per = 1 if knobs["algorithm"] == "sync" else knobs["period"]
        return {**record, "bytes_per_iteration": round(frame / per), "bytes_from": "frame arithmetic (no summaries)"}
    sent = statistics.mean(r[2] for r in rows)
    return {**record, "bytes_from": "summaries", "sent_mb_per_worker": round(sent, 3),
            "received_mb_per_worker": round(statistics.mean(r[3] for r in rows), 3),
            "exchanges_per_worker": statistics.mean(r[1] for r in rows),
            "iterations_per_worker": statistics.mean(r[0] for r in rows),
            "bytes_per_iteration": round(statistics.mean(frame * r[1] / r[0] for r in rows)),
            "histories_mb_per_worker": round(statistics.mean(r[2] - frame * r[1] / 1e6 for r in rows), 3)}


def projected(costs, gbit, knobs):
    """What the throughput model says of this run: seconds per iteration of a worker and its exchange share."""
    ds = pb.DeepSparkParameter(algorithm=pb.DeepSparkParameter.Algorithm.Value(knobs["algorithm"].upper()),
                               period=knobs.get("period", 10), exchange_codec=codec_of(knobs))
    workers = 2
    p = plan.project(costs, plan.Network.of(gbit, LATENCY_MS), ds, workers)
    # A worker steps one batch an iteration: whatever a cycle holds (period steps for easgd and average, one for
    # sync), its seconds per iteration are the workers' batches over the projected images/s.
    return workers * costs.batch / p.images_per_second, p.exchange_share


def codec_of(knobs):
    return pb.DeepSparkParameter.ExchangeCodec.Value(knobs.get("exchange_codec", "float32").upper())


def runs_of(model, network, quick, smoke=False):
    """{name: (knobs, to accuracy)} of `model` on `network`."""
    if quick or smoke:
        return {name: (knobs, False) for name, knobs in {**RUNS, **CODED["wide"]}.items()
                if model == "wide" and network == "1G" and name in (SMOKE_RUNS if smoke else QUICK_RUNS)}
    runs = {name: (knobs, model == "lenet" and network in LENET_NETWORKS) for name, knobs in RUNS.items()}
    if model == "lenet":
        runs.update({name: (knobs, True) for name, knobs in {**MODELLED, **SCALED}.items()
                     if network in LENET_NETWORKS or name in EVERY_LINK})
    runs.update({name: (knobs, False) for name, knobs in CODED[model].items()})
    return runs


class CodecCosts(dict):
    """plan.measure's Costs of a model, measured once per codec (the step once, for all of them)."""

    def __init__(self, solver):
        super().__init__()
        self.net, self.source, self.param, self.shape = plan.training_net(solver)

    def of(self, knobs):
        codec = codec_of(knobs)
        if codec not in self:
            self.param.deepspark_param.exchange_codec = codec
            step_ms = 1e3 * next(iter(self.values())).step if self else 0  # timed with the first codec
            self[codec] = plan.measure(self.net, self.source, self.param, pb.PlanParameter(cores=1, step_ms=step_ms),
                                       self.shape)
        return self[codec]


def to_accuracy(name, knobs, gbit, folder, costs, args, loopback):
    """Train a LeNet run to accuracy (snapshots tested afterwards) through a `gbit` link: (its stderr, the proxy's
    bytes, its points, its stamped lines). `average` runs once on loopback (kept in `loopback` by name) and each
    link's transfers are added to its clock."""
    per = tta.samples_per_iteration(knobs)
    modelled = knobs["algorithm"] == "average"
    if not (modelled and name in loopback):
        times = SCALED_TIMES if name in SCALED else 1
        every = max(1, round(tta.MILESTONE_SAMPLES / per))
        seconds = args.slow_seconds if name in EVERY_LINK and gbit < 1 and not modelled else args.seconds
        err, moved = train(tta.solver_copy(folder, every, False, learning_rate_times=times), knobs,
                           None if modelled else gbit, folder, round(args.epochs * tta.TRAIN_IMAGES / per), seconds)
        lines = tta.stamped(os.path.join(folder, "train.log"))
        loopback[name] = (err, moved, [(s, n, tta.accuracy(path)) for s, n, path in tta.snapshot_points(lines, per)],
                          lines)
    err, moved, points, lines = loopback[name]
    return err, moved, with_transfers(points, costs, gbit, knobs) if modelled else points, lines


def measure_run(model, network, name, knobs, accuracy, solver, costs, scratch, args, loopback):
    """One run's record: its time per iteration, exchange share, traffic, what the planner projected, and its
    time and bytes to the targets where it trains to accuracy."""
    gbit = NETWORKS[network]
    folder = os.path.join(scratch, f"{model}-{network}-{name.replace(' ', '-').replace(',', '')}")
    modelled = knobs["algorithm"] == "average"
    times = SCALED_TIMES if name in SCALED else 1
    record = {"bench": "network", "model": model, "network": network, "gbit": gbit, "latency_ms": LATENCY_MS,
              "run": name, "algorithm": knobs["algorithm"], "period": knobs.get("period"),
              "codec": knobs.get("exchange_codec", "float32"),
              **({"learning_rate_times": times} if times != 1 else {}),
              "proxy_bound": not modelled and gbit * 1e9 / 8 > 0.5 * args.ceiling,
              **({"emulated": "on loopback, each round's transfers over the link added by the "
                              "model (average.transfers)"} if modelled else {})}
    model_per_iteration, model_share = projected(costs, gbit, knobs)
    if accuracy:
        err, moved, points, lines = to_accuracy(name, knobs, gbit, folder, costs, args, loopback)
        record.update({k: v for k, v in tta.figures(name, points, 0, 0, False).items()
                       if k.startswith(("seconds_to", "samples_to", "final", "points"))})
    else:
        iterations = ITERATIONS_FLOOR if args.smoke else \
            int(min(ITERATIONS_CAP, max(ITERATIONS_FLOOR, PER_ITERATION_SECONDS / model_per_iteration)))
        err, moved = train(tta.solver_copy(folder, iterations, False, solver) if model == "lenet" else solver, knobs,
                           gbit, folder, iterations)
    per_iteration, share = worker_figures(err)
    if per_iteration is None and accuracy:  # stopped at its cap: from the displays
        per_iteration = display_seconds_per_iteration(lines)
    if modelled and per_iteration:  # the link's share of each round, as with_transfers adds it
        extra = average.transfers(costs, plan.Network.of(gbit, LATENCY_MS), 2) / knobs["period"]
        share = ((share or 0.0) * per_iteration + extra) / (per_iteration + extra)
        per_iteration += extra
    record.update(traffic(err, costs, knobs))
    for target in tta.LABELS:
        samples = record.get(f"samples_to_{target}")
        record[f"bytes_to_{target}"] = None if not samples else \
            round(record["bytes_per_iteration"] * samples / tta.samples_per_iteration(knobs))
    record.update({"seconds_per_iteration": per_iteration, "exchange_share": share,
                   "projected_seconds_per_iteration": round(model_per_iteration, 5),
                   "projected_exchange_share": round(model_share, 4),
                   "plan_error_percent": None if not per_iteration else
                   round(100 * (model_per_iteration / per_iteration - 1), 1),
                   "bytes_through_proxy": moved})
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the wide model only, at 1 Gbit/s: " + ", ".join(QUICK_RUNS))
    parser.add_argument("--seconds", type=float, default=60.0, help="the cap on a LeNet run's wall time")
    parser.add_argument("--slow-seconds", type=float, default=150.0,
                        help="and on the slow-link regime's at 100 Mbit/s (float32 easgd: ~0.06 s an iteration)")
    parser.add_argument("--epochs", type=float, default=tta.TARGET_EPOCHS,
                        help="and on its samples (the runs to accuracy: as long as the loopback target's)")
    parser.add_argument("--only", choices=("lenet", "wide"))
    parser.add_argument("--networks", help="comma-separated links (default: " + ",".join(NETWORKS) + ")")
    parser.add_argument("--runs", help="comma-separated run names (default: all the model's)")
    parser.add_argument("--smoke", action="store_true", help="runs end to end only (make bench-smoke): the wide "
                        f"model at 1 Gbit/s, {', '.join(SMOKE_RUNS)}, {ITERATIONS_FLOOR} iterations")
    parser.add_argument("--out", default=_results.results_path("network"))
    args = parser.parse_args()
    args.quick = args.quick or args.smoke
    known = {**RUNS, **MODELLED, **SCALED, **CODED["lenet"], **CODED["wide"]}
    runs = tta.run_names(args.runs, known) if args.runs else known
    networks = args.networks.split(",") if args.networks else list(NETWORKS)
    args.ceiling = _shaper.ceiling()
    _results.emit({"bench": "network", "figure": "proxy ceiling", "gbit": round(8 * args.ceiling / 1e9, 2)}, args.out)
    with tempfile.TemporaryDirectory() as scratch:
        models = {"lenet": tta.SOLVER, "wide": wide_job(os.path.join(scratch, "wide"))}
        for model, solver in models.items():
            if (args.only and model != args.only) or (args.quick and model != "wide"):
                continue
            costs, loopback = CodecCosts(solver), {}
            for network in networks:
                for name, (knobs, accuracy) in runs_of(model, network, args.quick, args.smoke).items():
                    if name not in runs:
                        continue
                    _results.emit(measure_run(model, network, name, knobs, accuracy, solver, costs.of(knobs),
                                              scratch, args, loopback), args.out)


def page_section(records, data):
    """The emulated commodity network: time per iteration, exchange share, time to 0.88, the planner's error."""
    runs = [r for r in records if r.get("run")]
    if not runs:
        return missing("easgd and sync through bench/_shaper.py", "OPENBLAS_NUM_THREADS=1 python bench/network.py")
    ceiling = next((r["gbit"] for r in records if r.get("figure") == "proxy ceiling"), None)
    rows = [[r["model"], r["network"], r["run"], cell(r.get("seconds_per_iteration"), 4, " s"),
             cell(None if r.get("exchange_share") is None else 100 * r["exchange_share"], 1, "%"),
             cell(None if r.get("bytes_per_iteration") is None else r["bytes_per_iteration"] / 1e3, 1, " kB"),
             cell(r.get("seconds_to_0.88"), 1, " s") if "points" in r else "per iteration only",
             cell(r.get("projected_seconds_per_iteration"), 4, " s"), cell(r.get("plan_error_percent"), 1, "%"),
             "yes" if r.get("proxy_bound") else ""] for r in runs]
    header = ["model", "network", "run", "s / iteration", "exchange share", "sent / iteration", "seconds to 0.88",
              "planner: s / iteration",
              "planner error", "near the proxy's ceiling"]
    off = [r for r in runs if r.get("plan_error_percent") is not None and abs(r["plan_error_percent"]) > 20]
    why = "" if not off else (
        "\n\nWhere the planner is off by more than 20% (" + ", ".join(
            f"{r['model']} {r['network']} {r['run']}: {r['plan_error_percent']:+.1f}%" for r in off) +
        "), what it leaves out: here the proxy (a Python thread copying every byte through its token buckets), the "
        "exchanger (its integrity tags over each vector) and both workers share 2 cores, where the model gives the "
        "center and each worker a node, and the links their own NICs; a worker's own part of an exchange (reading "
        "and writing its variables) runs beside its steps on the same core, which the model adds once a cycle. The "
        "step itself (T_comp) is timed alone before the runs; in a run it shares the cores with the other worker, "
        "the proxy and Spark's JVM: where the exchange is a small share (period 64) the error is that. Where "
        "the link is most of an exchange (easgd at 100 Mbit/s), the model lets the center's link take one worker's "
        "request while it sends another's reply (full duplex, workers out of step); two workers that start together "
        "stay in step and share each direction in turn, up to twice the time an exchange. And a run of a few "
        "periods (the wide net at 100 Mbit/s trains one or two) holds a worker's last exchange and the solver "
        "history it sends as it leaves, which the model's steady state leaves out.")
    saved = []  # sync's time per iteration over easgd period 10's, per model and link
    for model in dict.fromkeys(r["model"] for r in runs):
        for network in NETWORKS:
            pair = {r["run"]: r.get("seconds_per_iteration") for r in runs
                    if r["model"] == model and r["network"] == network}
            if pair.get("sync") and pair.get("easgd period 10"):
                saved.append(f"{model} at {network} {pair['sync'] / pair['easgd period 10']:.1f}x")
    saved_line = "" if not saved else (
        "\n\nWhat easgd (period 10) saves a worker against sync, sync's time per iteration over easgd's: "
        + ", ".join(saved) + ". A LeNet row marked \"per iteration only\" trained no further than its time per "
        "iteration needs (LENET_NETWORKS in bench/network.py says why): at 10 Gbit/s the loopback runs of the first "
        "section stand for its time to accuracy.")
    return (table(header, rows) + saved_line + f"\n\nFrom `{os.path.relpath(data, ROOT)}/network.jsonl` "
            "(bench/network.py); the "
            f"proxy's own unshaped ceiling here: {cell(ceiling, 2)} Gbit/s. `average` moves its models through Spark, "
            "not the exchanger: its row is a loopback run with each round's transfers over the link added by the "
            "model (its record says so). Sent / iteration is what a worker's exchanges sent an iteration, in the "
            "run's codec (the next section says how it is counted; average's, S each way a round, through Spark)."
            + why)


if __name__ == "__main__":
    main()
