"""How much decoupling the exchange from the compute saves (#14 item 2, RQ3): the share of each worker's time blocked on the exchange, overlapped and not, at periods 1 to 64, on LeNet and on a GoogLeNet-sized vector, beside the planner's projection and the paper's ~10%.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/communication.py [--quick] [--out FILE]

Each run is the product's async EASGD job (deepspark.spark.train) with 2 workers on local[2], tests and snapshots
off; all runs share one SparkSession in this process, so Spark's start-up is paid once, and an unrecorded first job
starts the Python workers (TensorFlow stays loaded in them). A worker's blocked share is the figures of its summary
line ("trained Xs, blocked on exchange Ys"), blocked over trained seconds, its first step (the trace) taken out of
both: its own clock, after its spill and build. The blocked seconds are the time inside the exchange client's calls;
a worker's reads and writes of its parameters around them, and whatever the overlapped exchange's thread and the
driver's exchanger take from the steps' cores, show only in the time per iteration, recorded beside it. Both modes end
the same way (the exchange in flight waited for, the final state sent blocking), so a run is long enough that period
64 exchanges several times per worker. Two models: models/lenet on Fashion-MNIST (real data; 431,080 parameters) and
bench/_wide.py's synthetic net of GoogLeNet's parameter count (6,998,552; 7,007,598 here). The planner's exchange
share (deepspark.plan.project) is from the costs measured here on one thread, as `deepspark plan` measures them, and
this machine's loopback measured in the same run (bench/plan_check.py's). --quick: LeNet only, periods 1 and 10.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)
import plan_check  # noqa: E402  (bench/plan_check.py: loopback's bandwidth and latency)
import time_to_accuracy as tta  # noqa: E402  (bench/time_to_accuracy.py: the LeNet solver)
from _tables import cell, table  # noqa: E402  (bench/_tables.py)
from _wide import wide_job  # noqa: E402  (bench/_wide.py)
from deepspark import plan  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

PERIODS = (1, 4, 10, 16, 64)
QUICK_PERIODS = (1, 10)
WORKERS = 2
# A run's iterations: at least FLOOR (wide's step is 2x LeNet's, its exchange 20x), and 3 exchanges per worker at
# period 64; then TAIL more, so that the last overlapped exchange is back before the loop ends (both modes then
# end with one blocking exchange, the final state, which weighs 1/4 at period 64 and little below).
FLOOR = {"lenet": 150, "wide": 40}
EXCHANGES = 3
TAIL = 8
WARM_UP = 20  # iterations of an unrecorded first job
SMOKE_PERIOD, SMOKE_ITERATIONS = 10, 30  # --smoke: one period, overlapped and not; its figures mean nothing
# DeepSpark's paper (Kim et al., arXiv 1602.08191), as issue #14 quotes it: communication ~10% of a minibatch's time.
PAPER_SHARE = 0.10


def iterations_of(model, period):
    return max(FLOOR[model], EXCHANGES * period) + TAIL


def train(solver_path, folder, **knobs):
    """The summary of the 2-worker EASGD job of `solver_path` with `knobs` (DeepSparkParameter fields and
    iterations), tests and snapshots off."""
    import deepspark.spark as spark  # deferred: pyspark starts only for the runs
    from deepspark.config import load_solver

    solver = load_solver(solver_path)
    solver.param.test_interval, solver.param.snapshot, solver.param.snapshot_after_train = 0, 0, False
    del solver.param.test_iter[:]  # no test nets: the job would test x̃ at its end, on the next run's time
    return spark.train(solver, workers=WORKERS, output=folder, algorithm="easgd", **knobs).summary


def run(model, solver_path, period, overlap, folder, iterations=None):
    """One job's record: the workers' blocked shares, seconds per iteration and exchanges."""
    iterations = iterations or iterations_of(model, period)
    summary = train(solver_path, folder, iterations=iterations, period=period, overlap=overlap)
    rows = sorted(summary["workers"], key=lambda r: r["worker"])
    # The first step traces the backend's step function (seconds, where a step takes milliseconds): it is the
    # worker's start-up, not its training, and would dilute the share of a short run.
    timed = [(r["train_seconds"] - r["first_step_seconds"], r["iterations"] - 1, r["blocked_seconds"]) for r in rows]
    shares = [blocked / seconds for seconds, _, blocked in timed]
    return {"blocked_share": round(statistics.mean(shares), 4), "worker_blocked_shares": [round(s, 4) for s in shares],
            "seconds_per_iteration": round(statistics.mean(seconds / steps for seconds, steps, _ in timed), 5),
            "exchanges": [r["exchanges"] for r in rows], "iterations": iterations,
            "wall_seconds": round(summary["wall_seconds"], 1),
            # A shared machine's other work takes the same cores: it shows in the times, less in the shares.
            "load_average": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="LeNet only, periods 1 and 10")
    parser.add_argument("--smoke", action="store_true", help="runs end to end only (make bench-smoke): LeNet, "
                        f"period {SMOKE_PERIOD}, {SMOKE_ITERATIONS} iterations a run")
    parser.add_argument("--out", default=_results.results_path("communication"))
    args = parser.parse_args()
    args.quick = args.quick or args.smoke
    started = time.monotonic()
    periods = (SMOKE_PERIOD,) if args.smoke else QUICK_PERIODS if args.quick else PERIODS
    # Before Spark starts: its JVM and workers would share the cores with these measurements.
    network = plan_check.loopback()
    _results.emit({"bench": "communication", "figure": "loopback", "bandwidth_gbit": round(8e-9 * network.bandwidth, 2),
                   "latency_ms": round(1e3 * network.latency, 4)}, args.out)
    with tempfile.TemporaryDirectory() as scratch:
        models = {"lenet": tta.SOLVER}
        if not args.quick:
            models["wide"] = wide_job(os.path.join(scratch, "wide"))
        costs = {}
        for model, solver in models.items():
            net, source, param, shape = plan.training_net(solver)
            costs[model] = plan.measure(net, source, param, pb.PlanParameter(cores=1), shape)
        from deepspark.spark.session import spark_session

        spark, _ = spark_session(pb.DeepSparkParameter(workers=WORKERS), WORKERS)
        try:
            # Unrecorded: the first job forks the Python workers and imports TensorFlow there, and its first steps
            # run colder than any later job's.
            train(tta.SOLVER, os.path.join(scratch, "warm-up"), iterations=WARM_UP)
            for model, solver in models.items():
                for i, period in enumerate(periods):
                    # Each mode first in turn: the load of a shared machine drifts from one run to the next.
                    for overlap in ((True, False) if i % 2 == 0 else (False, True)):
                        ds = pb.DeepSparkParameter(algorithm=pb.DeepSparkParameter.EASGD, period=period,
                                                   overlap=overlap)
                        projection = plan.project(costs[model], network, ds, WORKERS)
                        folder = os.path.join(scratch, f"{model}-{period}-{'overlapped' if overlap else 'blocking'}")
                        _results.emit({"bench": "communication", "model": model, "floats": costs[model].floats,
                                       "period": period, "overlap": overlap,
                                       **run(model, solver, period, overlap, folder,
                                             SMOKE_ITERATIONS if args.smoke else None),
                                       "projected_exchange_share": round(projection.exchange_share, 4),
                                       "projected_seconds_per_iteration": round(projection.cycle / period, 5)},
                                      args.out)
        finally:
            spark.stop()
    _results.emit({"bench": "communication", "figure": "wall", "quick": args.quick,
                   "wall_seconds": round(time.monotonic() - started, 1)}, args.out)


def percent(share, digits=1):
    return cell(None if share is None else 100 * share, digits, "%")


def span(shares):
    """"a–b%" of a list of shares (one value: "a%")."""
    low, high = min(shares), max(shares)
    return percent(low) if percent(low) == percent(high) else f"{cell(100 * low, 1)}–{percent(high)}"


def page_section(records, data_folder):
    """The results page's section: per model and period, the blocked share overlapped and not, what overlap
    saves, the planner's shares, and how they compare with the paper's ~10%."""
    runs = [r for r in records if "period" in r]
    if not runs:
        return ("_Not measured yet: run `OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python bench/communication.py` "
                "(blocked shares, overlapped and not)._")
    by = {(r["model"], r["period"], r["overlap"]): r for r in runs}  # a later record of the same run wins
    keys = list(dict.fromkeys((r["model"], r["period"]) for r in runs))
    rows = []
    for model, period in keys:
        on, off = by.get((model, period, True)), by.get((model, period, False))
        saved = None if not (on and off) else off["blocked_share"] - on["blocked_share"]
        rows.append([model, cell((on or off)["floats"]), str(period), percent(on and on["blocked_share"]),
                     percent(off and off["blocked_share"]),
                     "—" if saved is None else f"{cell(100 * saved, 1)} points"
                     + (f" ({cell(100 * saved / off['blocked_share'], 0)}% of it)" if off["blocked_share"] else ""),
                     cell(on and 1e3 * on["seconds_per_iteration"], 1, " ms"),
                     cell(off and 1e3 * off["seconds_per_iteration"], 1, " ms"),
                     percent(on and on.get("projected_exchange_share")),
                     percent(off and off.get("projected_exchange_share"))])
    header = ["model", "parameters", "period", "blocked, overlapped", "blocked, not overlapped", "what overlap saves",
              "iteration, overlapped", "iteration, not overlapped", "planner: overlapped", "planner: not overlapped"]
    sentences = []
    for model in dict.fromkeys(m for m, _ in keys):
        mine = [r for r in runs if r["model"] == model]
        periods = sorted({r["period"] for r in mine})
        said = []
        for overlap, how in ((True, "overlapped"), (False, "not overlapped")):
            shares = [r["blocked_share"] for r in mine if r["overlap"] == overlap]
            under = sorted({r["period"] for r in mine if r["overlap"] == overlap and r["blocked_share"] <= PAPER_SHARE})
            if shares:
                said.append(f"{how} {span(shares)}, at or under {percent(PAPER_SHARE, 0)} at " + (
                    f"period{'s' * (len(under) > 1)} {', '.join(map(str, under))}" if under else "no period"))
        pairs = [(by[(model, p, True)], by[(model, p, False)]) for p in periods
                 if (model, p, True) in by and (model, p, False) in by]
        if pairs:  # what the blocked share cannot show: the exchange's work moved onto the steps' cores
            changes = [on["seconds_per_iteration"] / off["seconds_per_iteration"] - 1 for on, off in pairs]
            said.append(f"time per iteration overlapped against not {min(changes):+.1%} to {max(changes):+.1%}")
        sentences.append(f"{model} ({cell(mine[0]['floats'])} parameters, period{'s' * (len(periods) > 1)} "
                         f"{', '.join(map(str, periods))}): " + "; ".join(said))
    loopback = next((r for r in records if r.get("figure") == "loopback"), None)
    loads = [r["load_average"] for r in runs if r.get("load_average") is not None]
    return "\n\n".join(filter(None, [
        table(header, rows),
        f"DeepSpark's paper (Kim et al., arXiv 1602.08191) puts communication at about {percent(PAPER_SHARE, 0)} of a "
        "minibatch's time. Here, the share of a worker's time blocked on the exchange: " + "; ".join(sentences) + ".",
        f"From `{os.path.relpath(data_folder, ROOT)}/communication.jsonl` (bench/communication.py): 2 workers on "
        "local[2], each worker's blocked seconds over its training seconds (its summary line), the mean of the two. "
        "The planner's shares are from the costs measured in the same run"
        + (f" and loopback at {cell(loopback['bandwidth_gbit'], 1)} Gbit/s, {cell(loopback['latency_ms'], 3)} ms"
           if loopback else "")
        + "; they count a worker's own work per exchange (its parameters read and written, the snapshot), which the "
        "blocked seconds do not: it shows in the time per iteration."
        + (f" The machine's 1-minute load average at the runs' ends was {cell(min(loads), 1)} to "
           f"{cell(max(loads), 1)} on {runs[0]['cores']} cores: above that count other work shared the workers' "
           "cores, which shows in the times per iteration more than in the shares." if loads else "")]))


if __name__ == "__main__":
    main()
