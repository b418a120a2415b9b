"""What the project itself costs (#14): the workers' start-up, from the driver's Solving line to their first step, in parts, and the peak memory of the whole process tree, per process, for `single` and `easgd` on 2 workers; JSON lines.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/startup.py [--quick] [--out FILE]

Each run is `deepspark train` of models/lenet in a process of its own, as bench/time_to_accuracy.py runs it with its
tests off the clock (no test_interval), for a few hundred iterations; the runs alternate, `--repeats` times. Start-up
runs from the Solving line (time_to_accuracy's clock starts there) to the end of the first training step: for
`single` the log's "Iteration 0" line; for `easgd` the slowest worker's, in the parts the driver's "Start-up of worker
N" lines give (fork: Spark schedules the task and forks a Python worker for it, 0 when one was ready; task start: the
task reaches that worker, its closure unpickled; spill; import of TensorFlow; build; connect to the exchanger; first
step, which traces the step). Each run also says when its process reached Solving and the first step, from its
start. The target: the workers' start-up within 2x the single process's (medians), each from its process's start to
its first step (the single process's Solving line comes after its import and build). Peak memory is the tree's PSS
sampled every 0.25 s (bench/_memory.py, as time_to_accuracy and the peers measure it), and its PSS "alone", counting
a page only among the run's own processes (what they hold together, which other processes on the machine that map
the same libraries do not lower), each broken down by process at its peak: the driver, its JVM, the pyspark daemon,
the Python workers. The target: alone at or under TorchDistributor's peak PSS on the same LeNet (bench/peers.py's
record in docs/data/peers.jsonl). Images/s is the training rate after the first step.
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _memory  # noqa: E402  (bench/_memory.py)
import _results  # noqa: E402  (bench/_results.py)
from _tables import cell, missing, table  # noqa: E402  (bench/_tables.py)
from network import WORKER  # noqa: E402  (bench/network.py: the workers' summary lines)
from time_to_accuracy import BATCH, command, solver_copy  # noqa: E402  (bench/time_to_accuracy.py: the same runs)
from deepspark.plot import LINE  # noqa: E402

RUNS = {"single": {"algorithm": "single"}, "easgd": {"algorithm": "easgd", "workers": 2}}
ITERATIONS, REPEATS = 200, 2
QUICK_ITERATIONS, QUICK_REPEATS = 150, 1
SMOKE_ITERATIONS = 20  # --smoke: one run of each; the bench runs end to end, its figures mean nothing
STARTUP_TARGET = 2.0  # the workers' start-up within this many times the single process's, process start to first step
# TorchDistributor's peak PSS on the same LeNet (2 DDP processes), MB: bench/peers.py's record in docs/data/peers.jsonl
# of the first `make bench`, used when that file is not there.
TORCH_PEAK_MB = 1323
ROLES = ("driver", "JVM", "pyspark daemon", "Python worker", "other")

STARTUP_LINE = re.compile(r"Start-up of worker (\d+): ([\d.]+)s from Solving to its first step done: (.*)$")


def log_lines(path):
    """(time.time(), message) of each line of a train.log (its stamps are local time, without the year)."""
    lines, year = [], datetime.datetime.now().year
    with open(path) as stream:
        for line in stream:
            match = LINE.match(line.rstrip("\n"))
            if match:
                when = datetime.datetime.strptime(f"{year}{match.group(1)}", "%Y%m%d %H:%M:%S.%f")
                lines.append((when.timestamp(), match.group(2)))
    return lines


def first(lines, pattern):
    """(time, match) of the first line whose message matches `pattern`; (None, None) if none does."""
    for when, message in lines:
        match = re.search(pattern, message)
        if match:
            return when, match
    return None, None


def single_figures(lines, iterations):
    """Start-up and rate of a single run: Solving to the "Iteration 0" line (its first step), and the steps after."""
    solving, _ = first(lines, r"^Solving ")
    stepped, _ = first(lines, r"^Iteration 0 \(")
    ended, _ = first(lines, rf"^Iteration {iterations}, loss = ")
    rate = (iterations - 1) * BATCH / (ended - stepped) if ended and ended > stepped else None
    return solving, stepped - solving, {"first step": stepped - solving}, [], rate


def easgd_figures(lines):
    """Start-up and rate of a Spark run from the driver's lines: the slowest worker's start-up and its parts,
    every worker's, and the images/s of all workers after their first steps."""
    solving, _ = first(lines, r"^Solving ")
    workers, trained = {}, {}
    for _, message in lines:
        if (m := STARTUP_LINE.search(message)):
            parts = {name: float(seconds) for name, seconds in re.findall(r"([a-z][a-z ]*?) (-?[\d.]+)s", m.group(3))}
            workers[int(m.group(1))] = (float(m.group(2)), parts)
        elif (m := WORKER.search(message)):
            trained[int(m.group(1))] = (int(m.group(2)), float(m.group(4)))
    slowest = max(workers.values(), key=lambda w: w[0])
    steps = sum(n - 1 for n, _ in trained.values())
    seconds = max(t - workers[w][1]["first step"] for w, (_, t) in trained.items())
    return (solving, slowest[0], slowest[1], [{"worker": w, "startup_seconds": s, "parts": p}
                                               for w, (s, p) in sorted(workers.items())], steps * BATCH / seconds)


def run(name, knobs, iterations, folder):
    """One run of `deepspark train`: its JSON record."""
    solver = solver_copy(folder, iterations, on_clock=False)
    began = time.time()
    process = subprocess.Popen(command(solver, folder, iterations, knobs), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    memory = _memory.PeakPssByRole(process.pid, alone=True)
    _, err = process.communicate()
    peak, wall = memory.stop(), time.time() - began
    if process.returncode:
        raise SystemExit(f"{name}: the run failed:\n{err[-3000:]}")
    lines = log_lines(os.path.join(folder, "train.log"))
    if knobs["algorithm"] == "single":
        solving, startup, parts, workers, rate = single_figures(lines, iterations)
    else:
        solving, startup, parts, workers, rate = easgd_figures(lines)
    return {"bench": "startup", "run": name, "workers": knobs.get("workers", 1), "iterations": iterations,
            "startup_seconds": round(startup, 3), "parts": {k: round(v, 3) for k, v in parts.items()},
            "worker_startups": [{**w, "startup_seconds": round(w["startup_seconds"], 3)} for w in workers],
            "to_solving_seconds": round(solving - began, 2),
            "to_first_step_seconds": round(solving + startup - began, 2),
            "images_per_second": None if rate is None else round(rate),
            "peak_pss_mb": round(peak), "pss_at_peak_mb": {k: round(v) for k, v in sorted(memory.at_peak.items())},
            "processes_at_peak": dict(sorted(memory.counts.items())),
            "role_peak_pss_mb": {k: round(v) for k, v in sorted(memory.role_peaks.items())},
            "alone_peak_mb": None if memory.alone_peak_mb is None else round(memory.alone_peak_mb),
            "alone_at_peak_mb": {k: round(v) for k, v in sorted(memory.alone_at_peak.items())},
            "wall_seconds": round(wall, 1)}


def torch_peak_mb(folder):
    """TorchDistributor's peak PSS from bench/peers.py's records in `folder` (peers.jsonl), else TORCH_PEAK_MB; and
    where it came from."""
    path = os.path.join(folder, "peers.jsonl")
    if os.path.exists(path):
        with open(path) as stream:
            for line in stream:
                record = json.loads(line) if line.strip() else {}
                if record.get("run") == "torchdistributor" and record.get("peak_pss_mb"):
                    return record["peak_pss_mb"], os.path.relpath(path, ROOT)
    return TORCH_PEAK_MB, "bench/startup.py's TORCH_PEAK_MB"


def median(records, run, key):
    """The median of `key` over the records of run `run` that have it; None if none has."""
    values = [r[key] for r in records if r.get("run") == run and r.get(key) is not None]
    return statistics.median(values) if values else None


def verdict(records, torch_mb):
    """The targets against the runs' medians: {startup_ratio, startup_met, peak_pss_mb, memory_met, ...}."""
    single, easgd = median(records, "single", "startup_seconds"), median(records, "easgd", "startup_seconds")
    # The target's measure is each process's start to its first step: the single process's Solving line comes
    # after its TensorFlow import and build, a Spark job's before its workers', so from Solving one would compare
    # the workers' import and build with nothing.
    launched = {run: median(records, run, "to_first_step_seconds") for run in ("single", "easgd")}
    ratio = launched["easgd"] / launched["single"] if launched["single"] and launched["easgd"] is not None else None
    pss, alone = median(records, "easgd", "peak_pss_mb"), median(records, "easgd", "alone_peak_mb")
    peak = alone if alone is not None else pss  # the larger, and the one other processes on the machine do not lower
    return {"bench": "startup", "figure": "targets", "single_startup_seconds": single, "easgd_startup_seconds": easgd,
            "single_to_first_step_seconds": launched["single"], "easgd_to_first_step_seconds": launched["easgd"],
            "startup_ratio": None if ratio is None else round(ratio, 2), "startup_target": STARTUP_TARGET,
            "startup_met": None if ratio is None else ratio <= STARTUP_TARGET, "easgd_peak_pss_mb": pss,
            "easgd_alone_peak_mb": alone, "torchdistributor_peak_pss_mb": torch_mb,
            "memory_met": None if peak is None else peak <= torch_mb}


def page_section(records, data_folder):
    """The results page's section (markdown) from this benchmark's records: a table of the runs' start-up in parts
    and their peak PSS by process, and a line naming the file and whether each target is met."""
    runs = [r for r in records if r.get("bench") == "startup" and r.get("run")]
    source = f"`{os.path.relpath(os.path.join(data_folder, 'startup.jsonl'), ROOT)}` (bench/startup.py)"
    if not runs:
        return missing("start-up and peak memory of single and easgd",
                       "OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/startup.py")
    parts = list(dict.fromkeys([*max((r["parts"] for r in runs), key=len), *(p for r in runs for p in r["parts"])]))
    roles = [role for role in ROLES if any(r["pss_at_peak_mb"].get(role, 0) >= 1 for r in runs)]

    header = ["run", "start-up (from Solving)", *parts, "process start to first step", "images/s", "peak PSS",
              "peak alone", *[f"{role} at the peak (alone)" for role in roles]]
    rows = []
    for r in runs:
        count = r["processes_at_peak"]
        rows.append([f"{r['run']} ({r['workers']} worker{'s' if r['workers'] > 1 else ''})",
                     cell(r["startup_seconds"], 2, " s"), *[cell(r["parts"].get(p), 2, " s") for p in parts],
                     cell(r["to_first_step_seconds"], 1, " s"), cell(r.get("images_per_second"), 0),
                     cell(r["peak_pss_mb"], 0, " MB"), cell(r.get("alone_peak_mb"), 0, " MB"),
                     *[cell((r.get("alone_at_peak_mb") or r["pss_at_peak_mb"]).get(role), 0, " MB")
                       + (f" ({count[role]})" if count.get(role, 1) > 1 else "") for role in roles]])
    torch_mb, torch_from = torch_peak_mb(data_folder)
    v = verdict(runs, torch_mb)
    said = {True: "met", False: "not met", None: "not measured"}
    alone = v["easgd_alone_peak_mb"]
    line = (f"From {source}. Start-up target, the workers' within {STARTUP_TARGET:g}x the single process's, each "
            f"from its process's start to its first step: {said[v['startup_met']]} ({cell(v['startup_ratio'], 2)}x, "
            "medians of the runs; from Solving the single process has only its first step left, its import and build "
            "done before its Solving line). Memory target, easgd's peak "
            f"at or under TorchDistributor's PSS ({torch_mb:,} MB, from {torch_from}): {said[v['memory_met']]} "
            + (f"({alone:,.0f} MB alone, {cell(v['easgd_peak_pss_mb'], 0, ' MB')} PSS)" if alone is not None else
               f"({cell(v['easgd_peak_pss_mb'], 0, ' MB')} PSS)")
            + ". PSS splits a page among every process that maps it, on the machine; alone splits it only among the "
            "run's own processes (what they hold together, whatever else runs: TensorFlow's libraries are shared "
            "with any other TensorFlow process). A part is the slowest worker's; a process count in brackets sums "
            "that many processes. The pyspark daemon's are three: its zygote, which the driver starts before the JVM "
            "so that TensorFlow's import runs while the JVM starts; the daemon the zygote forks, whose forks are the "
            "Python workers; and the process the JVM launched, which handed its pipes to the zygote and waits "
            "(deepspark/spark/daemon.py). The JVM maps the classes it starts with from the archive `make setup` "
            "writes (tools/jvm-archive.py).")
    return table(header, rows) + "\n\n" + line


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REPEATS} run of each, {QUICK_ITERATIONS} iterations")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--smoke", action="store_true",
                        help=f"runs end to end only (make bench-smoke): 1 run of each, {SMOKE_ITERATIONS} iterations")
    parser.add_argument("--out", default=_results.results_path("startup"))
    args = parser.parse_args()
    repeats, iterations = (1, SMOKE_ITERATIONS) if args.smoke else (QUICK_REPEATS, QUICK_ITERATIONS) if args.quick \
        else (args.repeats, args.iterations)
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(repeats):  # interleaved, so that both runs see the machine's load alike
            for name, knobs in RUNS.items():
                record = {**run(name, knobs, iterations, os.path.join(scratch, f"{name}-{i}")), "repeat": i}
                records.append(record)
                _results.emit(record, args.out)
    _results.emit(verdict(records, torch_peak_mb(os.path.join(ROOT, "docs", "data"))[0]), args.out)


if __name__ == "__main__":
    main()
