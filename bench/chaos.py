"""Staying power (#45): `make demo`'s job (LeNet on Fashion-MNIST, 2 workers; real data) on a standalone cluster on 127.0.0.1, clean, with a worker SIGKILLed every 15 s from the first exchange to the end, and with one worker throttled to a third, for easgd and sync; each run's time to the clean run's final test accuracy as a ratio to the clean run's, all in one invocation.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/chaos.py [--iterations 4000] [--every 15]
        [--share 0.333] [--algorithms easgd sync] [--repeats 1] [--master cluster|local|spark://...] [--quick]
        [--smoke] [--out bench/measured_chaos.jsonl] [--plot docs/chaos.png]

The solver is models/lenet/solver.prototxt with its defaults (the failure budget, the exchange) but
test_interval (--test-interval, 100: the curve's points; the driver tests off the workers' clock). A
run's clock starts at the driver's Solving line; its time to an accuracy is the first test that reached
it. The kills are tools/chaos.py's --every (each on the clock, whatever the last rejoin took); the
straggler is its Throttle (SIGSTOP/SIGCONT, as cpulimit does). One JSON line per run (its test points,
kills and rejoins, the machine's load average at its start and end), then one per harmed run (each trains
ROOM, 1.5, times the clean run's iterations, so that a late reach is timed): its ratio
to the clean run's time to that run's final accuracy (and to it less --tolerance, 0.005: a harmed run's
last test can fall a few hundredths of a point short of a clean run's by the tests' noise alone), against
the target (kills 1.3x, easgd's straggler 1.2x; sync's straggler has none: it is shown beside). For easgd
three more runs: the straggler under the paper's rule (--no-rate-weighted, beside the default's), under rate
weighting alone (--straggler-share 0: no straggler exchanges by its progress), and one worker alone (--workers 1),
whose time to the clean run's final accuracy bounds the straggler's: the least any exchange rule could take with
these cores (figure "straggler's bound"). Each figure also says what its
time ratio is made of: the run's samples/s (its workers' iterations over their training time, from the driver's
Worker lines) and the samples it trained to the accuracy, each against the clean run's. --repeats N runs an
algorithm's clean and harmed runs N rounds, each harmed run against its own round's clean run, and the page shows
the median round with the range. --plot draws test accuracy against time; --figures recomputes the ratios and the
plot from a file's run records.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402  (bench/_results.py)
from _tables import cell, missing, table  # noqa: E402  (bench/_tables.py)

# tools/chaos.py by its path: this file is chaos.py too.
_spec = importlib.util.spec_from_file_location("tools_chaos", os.path.join(ROOT, "tools", "chaos.py"))
chaos = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chaos
_spec.loader.exec_module(chaos)

SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
CLUSTER = os.path.join(ROOT, "tools", "spark-cluster.sh")
STAMP = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+) ")
TESTING = re.compile(r"\] Iteration (\d+), Testing net")
ACCURACY = re.compile(r"Test net output #\d+: accuracy = ([\d.]+)")
REJOINED = re.compile(r"Worker (\d+) rejoined the exchanger .*, ([\d.]+)s after its loss")
TRAINED = re.compile(r"Worker (\d+) on \S+ \(in [^)]*\): (\d+) iterations, .*?, trained ([\d.]+)s")
STARTUP = re.compile(r"Start-up of worker (\d+): .*\(attempt (\d+)\) to its first step done: (.*)$", re.M)
TARGETS = {"kill": 1.3, "straggler": {"easgd": 1.2}}
LONE = "one worker alone"  # the run the straggler's bound is drawn from
UNWEIGHTED = "the paper's rule"  # a straggler run without rate_weighted
UNPUSHED = "rate weighting alone"  # a straggler run without straggler_share (no exchange by its progress)
ROOM = 1.5  # the harmed and lone runs' iterations, in the clean run's: room to reach its final accuracy late


def solver_file(folder, test_interval):
    """The LeNet solver with test_interval `test_interval` and its net by its absolute path, written in `folder`."""
    with open(SOLVER) as stream:
        text = stream.read()
    text = re.sub(r"test_interval: \d+", f"test_interval: {test_interval}", text)
    text = re.sub(r'net: "([^"]+)"', lambda m: f'net: "{os.path.join(ROOT, m.group(1))}"', text)
    path = os.path.join(folder, "solver.prototxt")
    with open(path, "w") as stream:
        stream.write(text)
    return path


def seconds_of(line):
    """The seconds of the day a glog line was written at (None: no stamp)."""
    found = STAMP.match(line)
    return None if found is None else int(found.group(1)) * 3600 + int(found.group(2)) * 60 + float(found.group(3))


def test_points(log):
    """[(seconds from the Solving line, iteration, test accuracy)] of a driver's log."""
    points, start, iteration = [], None, None
    for line in log.splitlines():
        at = seconds_of(line)
        if start is None and "] Solving " in line:
            start = at
        tested = TESTING.search(line)
        iteration = int(tested.group(1)) if tested else iteration
        found = ACCURACY.search(line)
        if found and start is not None and at is not None:
            points.append((round((at - start) % 86400, 2), iteration, float(found.group(1))))
    return points


def time_to(points, accuracy):
    """Seconds to the first test at or above `accuracy` (None: never)."""
    return next((seconds for seconds, _, reached in points if reached >= accuracy), None)


def run(args, folder, name, algorithm, harm=None, workers=2, iterations=None, flags=(), repeat=0):
    """One training run (`harm`: "kill", "straggler" or None) of `workers` workers, with the CLI's `flags` over the
    solver's, in the invocation's `repeat`th round: its record."""
    iterations = iterations or args.iterations
    out = os.path.join(folder, f"{algorithm}-{name}-{repeat}")
    flags = [*flags, *(["--master", args.master] if args.master != "local" else [])]
    load = os.getloadavg()[0]
    driver = subprocess.Popen([sys.executable, "-m", "deepspark.cli", "train", "--solver", args.solver,
                               "--iterations", str(iterations), "--output", out, "--algorithm", algorithm,
                               "--workers", str(workers), *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    ended = lambda: driver.poll() is not None  # noqa: E731
    log = chaos.DriverLog(os.path.join(out, "train.log"), iterations)
    harness = None
    try:
        if harm:
            with contextlib.suppress(TimeoutError):  # the job ended before its exchanger started: its record says how
                harness = start_harm(args, harm, log.wait_for_port(600, ended), ended)
        _, stderr = driver.communicate(timeout=3600)
    finally:
        if harness is not None:
            harness.stop()
        if driver.poll() is None:
            driver.kill()
    text = ""
    if os.path.exists(log.path):
        with open(log.path, encoding="utf-8") as stream:
            text = stream.read()
    points = test_points(text)
    record = {"bench": "chaos", "algorithm": algorithm, "run": name, "repeat": repeat, "date": time.strftime("%F"),
              "iterations": iterations, "workers": workers, "master": args.master, "returncode": driver.returncode,
              "points": points, "trained": [[int(w), int(n), float(s)] for w, n, s in TRAINED.findall(text)],
              "final_accuracy": points[-1][2] if points else None,
              "load_average": [round(load, 2), round(os.getloadavg()[0], 2)]}
    if harm == "kill":
        kills = harness.kills if harness is not None else []
        record["kills"] = len(kills)
        record["seconds_kill_to_connection"] = [round(k.seconds_to_rejoin, 2) for k in kills
                                                if k.seconds_to_rejoin is not None]
        record["rejoins"] = [[int(w), float(s)] for w, s in REJOINED.findall(text)]
        record["startups"] = [[int(w), int(a), parts] for w, a, parts in STARTUP.findall(text)]
    if harm == "straggler" and harness is not None:  # a hold let go before the job's end is a straggler no longer
        record["straggler_held_seconds"], record["straggler_released"] = harness.held, harness.released
    if driver.returncode:
        record["error"] = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
    return record


def measured_runs(args, algorithm):
    """The runs measured against `algorithm`'s clean run, as (name, harm, run's keywords): a kill every args.every
    s and a straggler; for a straggler target, the straggler under the paper's rule (no rate weighting: the
    weighting's effect) and under rate weighting alone (the straggler's exchange by its progress off: its effect),
    and one worker alone (the straggler's bound)."""
    runs = [(f"kill every {args.every:g} s", "kill", {}), (f"straggler at {args.share:.2f}", "straggler", {})]
    if algorithm in TARGETS["straggler"] and not args.smoke:
        runs += [(f"straggler at {args.share:.2f}, {UNWEIGHTED}", "straggler", {"flags": ["--no-rate-weighted"]}),
                 (f"straggler at {args.share:.2f}, {UNPUSHED}", "straggler",
                  {"flags": ["--straggler-share", "0"]}),
                 (LONE, None, {"workers": 1})]
    return runs


def start_harm(args, harm, port, ended):
    """The harm of a run, started on the exchanger at `port`: kills every args.every s, or a straggler."""
    if harm == "kill":
        return chaos.Chaos(port, None, args.seed, every=args.every, ended=ended, timeout=600,
                           say=lambda line: print(line, file=sys.stderr, flush=True)).start()
    return chaos.Throttle(port, args.share, ended=ended, timeout=600).start()


def samples_per_second(record):
    """The batches a second the run's workers trained together (each worker's iterations over its training time,
    summed; the net's batch is the same in every run), from its Worker lines; None without them."""
    rates = [iterations / seconds for _, iterations, seconds in record.get("trained") or [] if seconds > 0]
    return sum(rates) or None


def samples_to(record, accuracy):
    """The batches (the job's iteration × its workers) the run trained to its first test at or above `accuracy`
    (None: never, or a record of before the workers were kept)."""
    workers = record.get("workers")
    reached = (iteration * workers for _, iteration, at in record["points"] if at >= accuracy)
    return next(reached, None) if workers else None


def figure(clean, harmed, tolerance):
    """The ratio record of a harmed run against its clean run: time to the clean run's final accuracy, and to it
    less `tolerance` (a test's noise: the harmed run's last test may fall a few hundredths of a point short of it);
    and what the time ratio is made of, the run's samples/s and the samples it took, each against the clean's."""
    algorithm, harm = harmed["algorithm"], "kill" if "kills" in harmed else "straggler"
    target = TARGETS[harm].get(algorithm) if isinstance(TARGETS[harm], dict) else TARGETS[harm]
    target = None if UNWEIGHTED in harmed["run"] or UNPUSHED in harmed["run"] else target  # the default's only
    record = {"bench": "chaos", "algorithm": algorithm, "figure": harmed["run"], "accuracy": clean["final_accuracy"],
              "tolerance": tolerance, "finished": harmed["returncode"] == 0, "target": target,
              "harmed_final_accuracy": harmed["final_accuracy"], "harmed_iterations": harmed["iterations"],
              "clean_iterations": clean["iterations"], "repeat": harmed.get("repeat", 0)}
    rates = samples_per_second(harmed), samples_per_second(clean)
    needed = samples_to(harmed, clean["final_accuracy"]), samples_to(clean, clean["final_accuracy"])
    record["samples_per_second_ratio"] = round(rates[0] / rates[1], 3) if None not in rates else None
    record["samples_ratio"] = round(needed[0] / needed[1], 3) if None not in needed and needed[1] else None
    for suffix, accuracy in (("", clean["final_accuracy"]), ("_within", clean["final_accuracy"] - tolerance)):
        base, took = time_to(clean["points"], accuracy), time_to(harmed["points"], accuracy)
        ratio = None if took is None or not base else round(took / base, 3)
        record.update({f"clean_seconds{suffix}": base, f"seconds{suffix}": took, f"ratio{suffix}": ratio,
                       f"meets_target{suffix}": None if target is None else bool(
                           ratio is not None and ratio <= target and record["finished"])})
    return record


def bound(clean, lone, share, tolerance):
    """The least time any exchange rule could take to the clean run's final accuracy with one of its two workers
    at `share` of the wall clock, from a lone worker's run: the straggler's samples count at best as the lone
    worker's (one worker's SGD, no averaging), at the job's (1 + share) times a lone worker's samples/s. Its
    start-up (Solving to its first test) counts whole. A ratio to the clean run's time above the straggler's target
    says no exchange rule reaches it with these cores."""
    record = {"bench": "chaos", "algorithm": clean["algorithm"], "figure": "straggler's bound", "share": share,
              "accuracy": clean["final_accuracy"], "tolerance": tolerance, "lone_iterations": lone["iterations"],
              "target": TARGETS["straggler"].get(clean["algorithm"]), "repeat": lone.get("repeat", 0)}
    start = lone["points"][0][0] if lone.get("points") else None
    for suffix, accuracy in (("", clean["final_accuracy"]), ("_within", clean["final_accuracy"] - tolerance)):
        base, alone = time_to(clean["points"], accuracy), time_to(lone.get("points") or [], accuracy)
        least = None if alone is None or start is None else round(start + (alone - start) / (1 + share), 2)
        record.update({f"clean_seconds{suffix}": base, f"lone_seconds{suffix}": alone, f"seconds{suffix}": least,
                       f"ratio{suffix}": None if least is None or not base else round(least / base, 3)})
    return record


def figures(records, tolerance, share=1 / 3):
    """The ratio records of every harmed run in `records` against its algorithm's clean run of the same round
    (repeat), and the straggler's bound where a lone worker's run is there."""
    key = lambda r: (r["algorithm"], r.get("repeat", 0))  # noqa: E731
    clean = {key(r): r for r in records if r.get("run") == "clean" and r.get("points") and not r.get("error")}
    found = [figure(clean[key(r)], r, tolerance) for r in records
             if r.get("run") not in (None, "clean", LONE) and key(r) in clean]
    return found + [bound(clean[key(r)], r, share, tolerance) for r in records
                    if r.get("run") == LONE and key(r) in clean and not r.get("error")]


def medians(found):
    """`found`'s figure records by (algorithm, figure), in their order, each group as (its median record by ratio,
    the lower of the two middle ones, a run that never reached the accuracy counted highest; the group's ratios)."""
    order = lambda f: (f["ratio"] is None, f["ratio"] or 0.0)  # noqa: E731
    return [(sorted(group, key=order)[(len(group) - 1) // 2], [f["ratio"] for f in group])
            for group in grouped(found, lambda f: (f["algorithm"], f["figure"])).values()]


def spread_of(ratios):
    """' (median of N: A-Bx)' for N > 1 ratios ('not reached' for B where one never did), '' for one."""
    if len(ratios) < 2:
        return ""
    reached = sorted(r for r in ratios if r is not None)
    high = f"{reached[-1]:.2f}x" if len(reached) == len(ratios) else "not reached"
    return f" (median of {len(ratios)}: {reached[0]:.2f}-{high})" if reached else f" ({len(ratios)} runs)"


def plot(records, path):
    """Test accuracy against seconds from Solving, a line per run, a panel per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    runs = [r for r in records if r.get("run") and r.get("points") and not r.get("repeat")]  # the first round's
    algorithms = list(dict.fromkeys(r["algorithm"] for r in runs))
    figure_, axes = pyplot.subplots(1, len(algorithms), figsize=(6 * len(algorithms), 4), squeeze=False)
    for axis, algorithm in zip(axes[0], algorithms):
        for r in (r for r in runs if r["algorithm"] == algorithm):
            seconds, _, accuracy = zip(*r["points"])
            axis.plot(seconds, accuracy, marker=".", label=r["run"] + (" (the job failed)" if r["returncode"] else ""))
        axis.set(title=f"{algorithm}, 2 workers", xlabel="seconds from Solving", ylabel="test accuracy")
        axis.set_ylim(0.6, 0.92)
        axis.grid(alpha=0.3)
        axis.legend()
    figure_.tight_layout()
    figure_.savefig(path, dpi=90)
    pyplot.close(figure_)


def page_section(records, data_folder=None):
    """The results page's chaos section (markdown) from this benchmark's records."""
    found = [r for r in records if r.get("bench") == "chaos" and r.get("figure") and "ratio_within" in r
             and "lone_seconds" not in r]
    bounds = [r for r in records if r.get("bench") == "chaos" and "lone_seconds" in r]
    runs = [r for r in records if r.get("bench") == "chaos" and r.get("run") and "points" in r]
    if not found:
        return missing("staying power: kills every 15 s and a straggler",
                       "OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/chaos.py")
    said = {True: "met", False: "not met", None: "no target"}
    rounds = medians(found)
    rows = [[f["algorithm"], f["figure"], cell(f["accuracy"], 4),
             f"{cell(f['harmed_final_accuracy'], 4)} ({f['harmed_iterations']:,} / {f['clean_iterations']:,})",
             *[f"{cell(f['seconds' + s], 0, ' s') if f['seconds' + s] is not None else 'not reached'} / "
               f"{cell(f['clean_seconds' + s], 0, ' s')} = {cell(f['ratio' + s], 2, 'x')}" for s in ("", "_within")],
             f"{f['target']}x: {said[f['meets_target']]}, {said[f['meets_target_within']]}" if f["target"]
             else said[None]] for f, _ in rounds]
    for row, (_, ratios) in zip(rows, rounds):
        row[4] += spread_of(ratios)
    made_of = [f for f, _ in rounds if f["figure"].startswith("straggler") and f.get("samples_ratio")
               and f.get("samples_per_second_ratio")]
    kills = grouped([r for r in runs if "kills" in r], lambda r: r["algorithm"])
    loads = [x for r in runs for x in r.get("load_average", [])]
    text = ("## Staying power: a kill every 15 s, a straggler (#45)\n\n"
            + table(["algorithm", "run", "clean run's final accuracy",
                     "run's final accuracy (its iterations / the clean's)",
                     "time to the clean's final accuracy: run / clean",
                     f"to it less {found[0]['tolerance']:g}: run / clean",
                     "target (strict, less the tolerance)"], rows)
            + "\n\nFrom `bench/measured_chaos.jsonl` (bench/chaos.py); the plot is `docs/chaos.png`. "
            + "; ".join(f"{algorithm}: {sum(r['kills'] for r in its)} kills"
                        + (f" in {len(its)} runs" if len(its) > 1 else "") + ", from a kill to the replacement's "
                        "connection (tools/chaos.py) "
                        f"{spread([x for r in its for x in r['seconds_kill_to_connection']])}, the driver's rejoin "
                        f"lines {spread([x for r in its for _, x in r['rejoins']])}"
                        for algorithm, its in kills.items())
            + (f". The machine's 1-minute load average at the runs' starts and ends: {min(loads):.1f}-{max(loads):.1f}."
               if loads else "")
            + f" The runs' dates: {dates(runs)}."
            + "".join(f" {r['algorithm']}'s {r['run']} run failed: {r['error']}." for r in runs if r.get("error"))
            + (" A row of several rounds (--repeats) is the round whose ratio is the median (the lower of the two"
               " middle ones), its range beside it; the plot draws each algorithm's first round."
               if any(len(ratios) > 1 for _, ratios in rounds) else "")
            + " A run's clock starts at the driver's Solving line, its executors' start-up on it; the driver's rejoin"
            " lines run long where its watch was testing the center (it sees a loss or a rejoin only after the test),"
            " the harness's times do not. Each worker computes on one thread (its executor's one core), so a throttled"
            " worker's idle core is not the other's."
            + (f" The straggler's default run exchanges by its progress (straggler_share: the center takes half of what"
               f" it trained since it was last handed the center); {UNPUSHED} turns that off (--straggler-share 0),"
               f" {UNWEIGHTED} rate weighting too (--no-rate-weighted)."
               if any(UNPUSHED in f["figure"] for f in found) else "")
            + " What a straggler's time is made of, its samples/s and the samples"
            " it trained to the clean run's final accuracy, each against the clean run's: "
            + ("; ".join(f"{f['algorithm']}'s {f['figure']}, {f['samples_per_second_ratio']:.2f}x the samples/s and"
                         f" {f['samples_ratio']:.2f}x the samples" for f in made_of) or "not measured")
            + "."
            + "".join(f" The bound on {b['algorithm']}'s straggler: one worker alone took "
                      f"{cell(b['lone_seconds'], 0, ' s') if b['lone_seconds'] is not None else 'more than its run'} to"
                      f" {cell(b['accuracy'], 4)}; were the straggler's samples worth the lone worker's (one worker's"
                      f" SGD, no averaging) at {1 + b['share']:.2f}x its samples/s, the job would take "
                      + (f"{cell(b['seconds'], 0, ' s')}, {cell(b['ratio'], 2, 'x')} the clean run's"
                         f" ({cell(b['ratio_within'], 2, 'x')} to it less the tolerance)"
                         if b["ratio"] is not None else "longer than the lone run shows")
                      + f": the least any exchange rule could reach with these cores, against the {b['target']}x"
                      " target." for b, _ in medians(bounds))
            + "\n\n![test accuracy against time](chaos.png)")
    return text


def grouped(items, key):
    """{key(item): its items}, in the items' order."""
    found = {}
    for item in items:
        found.setdefault(key(item), []).append(item)
    return found


def dates(runs):
    """'easgd, 2026-12-07; sync, ...' of the runs' dates by algorithm (records before the date was kept: undated)."""
    said = []
    for algorithm, its in grouped(runs, lambda r: r["algorithm"]).items():
        days = sorted({r["date"] for r in its if r.get("date")})
        said.append(f"{algorithm}, {', '.join(days) or 'undated (an earlier invocation)'}")
    return "; ".join(said)


def spread(seconds):
    """'median M s (A-B s)' of a list of seconds, or 'none'."""
    if not seconds:
        return "none"
    ordered = sorted(seconds)
    return f"median {ordered[len(ordered) // 2]:.1f} s ({ordered[0]:.1f}-{ordered[-1]:.1f} s)"


def start_cluster(folder):
    """tools/spark-cluster.sh's master and two Workers on free loopback ports: (master URL, its environment)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1] % 20000 + 20000
    env = {**os.environ, "CLUSTER_DIR": os.path.join(folder, "cluster"), "SPARK_MASTER_PORT": str(base),
           "SPARK_MASTER_WEBUI_PORT": str(base + 1), "VENV": os.path.dirname(os.path.dirname(sys.executable))}
    subprocess.run(["bash", CLUSTER, "start"], env=env, check=True, capture_output=True, timeout=300)
    return f"spark://127.0.0.1:{base}", env


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 4,000: at the zoo's period 32, with the job's iterations leased (each worker's max_iter summed), a
    # 1,500-iteration clean easgd run lasts ~33 s here, one or two kills; 4,000 lasts ~65 s, four.
    parser.add_argument("--iterations", type=int, default=4000)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between two kills")
    parser.add_argument("--share", type=float, default=1 / 3, help="the straggler's share of the wall clock")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--test-interval", type=int, default=100)
    parser.add_argument("--algorithms", nargs="+", choices=("easgd", "sync"), default=["easgd", "sync"])
    parser.add_argument("--repeats", type=int, default=1, help="rounds of an algorithm's runs (its clean run and "
                        "each harmed one), each harmed run against its round's clean run; the page gives the median")
    parser.add_argument("--master", default="cluster",
                        help="cluster: start tools/spark-cluster.sh's on free ports; local: local mode; or a URL")
    parser.add_argument("--quick", action="store_true", help="600 iterations, easgd only")
    parser.add_argument("--smoke", action="store_true",
                        help="runs end to end only (make bench-smoke): local mode, 200 iterations, easgd, a kill "
                             "every 5 s")
    parser.add_argument("--out", default=_results.results_path("chaos"))
    parser.add_argument("--tolerance", type=float, default=0.005,
                        help="the second figure's accuracy: the clean run's final less this")
    parser.add_argument("--plot", default="", help="a PNG of test accuracy against time (docs/chaos.png)")
    parser.add_argument("--figures", metavar="JSONL", help="run nothing: the ratios and the plot again from the "
                        "runs' records in JSONL (another --tolerance), to --out")
    args = parser.parse_args()
    if args.figures:
        with open(args.figures) as stream:
            runs = [r for r in map(json.loads, stream) if r.get("run")]
        for record in runs + figures(runs, args.tolerance, args.share):
            _results.emit(record, args.out)
        if args.plot:
            plot(runs, args.plot)
        return
    if args.quick:
        args.iterations, args.algorithms = 600, ["easgd"]
    if args.smoke:
        args.iterations, args.algorithms, args.master, args.every, args.test_interval = 200, ["easgd"], "local", 5, 100
    records = []
    with tempfile.TemporaryDirectory() as folder:
        args.solver = solver_file(folder, args.test_interval)
        env = None
        if args.master == "cluster":
            args.master, env = start_cluster(folder)
        try:
            for algorithm in args.algorithms:
                for repeat in range(args.repeats):
                    clean = run(args, folder, "clean", algorithm, repeat=repeat)
                    records.append(clean)
                    _results.emit(clean, args.out)
                    for name, harm, knobs in measured_runs(args, algorithm):
                        measured = run(args, folder, name, algorithm, harm, iterations=int(args.iterations * ROOM),
                                       repeat=repeat, **knobs)
                        for record in [measured, *figures([clean, measured], args.tolerance, args.share)]:
                            records.append(record)
                            _results.emit(record, args.out)
        finally:
            if env is not None:
                subprocess.run(["bash", CLUSTER, "stop"], env=env, capture_output=True, timeout=120)
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
