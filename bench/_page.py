"""docs/results.md and its plots from the JSON lines the page's benchmarks wrote into docs/data/ (#14): `make bench` runs them, then this; every figure on the page is one of theirs, and a section whose data is missing says so.

    .venv/bin/python bench/_page.py [--data docs/data] [--out docs/results.md]
"""

import argparse
import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("0.85", "0.88")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks that draw their own sections


def load(folder, name):
    """The records of docs/data/NAME.jsonl (none if it is not there)."""
    path = os.path.join(folder, f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as stream:
        return [json.loads(line) for line in stream if line.strip()]


def cell(value, digits=1, unit=""):
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value:,}{unit}" if isinstance(value, int) else str(value)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def missing(what, command):
    return f"_Not measured yet: run `{command}` ({what})._"


def accuracy_section(records, data, plot):
    """RQ1/RQ2: the time-to-accuracy table of DeepSpark's runs and the peers', and the plot of all."""
    runs = [r for r in records if "points" in r or "error" in r]
    if not runs:
        return missing("DeepSpark's runs and the peers'", "make bench")
    rows = []
    for r in runs:
        name = r.get("run") + (f" ({r['tests']})" if r.get("tests") == "on the clock" else "")
        if "error" in r:
            rows.append([name, "could not run: " + r["error"], *["—"] * 6])
            continue
        rows.append([name, *[cell(r.get(f"seconds_to_{t}"), 1, " s") for t in TARGETS],
                     *[cell(r.get(f"samples_to_{t}")) for t in TARGETS], cell(r.get("accuracy_at_180s"), 4),
                     cell(r.get("final_accuracy"), 4), cell(r.get("peak_pss_mb"), 0, " MB")])
    header = ["run", "seconds to 0.85", "seconds to 0.88", "samples to 0.85", "samples to 0.88", "accuracy at 180 s",
              "final accuracy", "peak PSS"]
    plotted = draw_accuracy(runs, plot)
    clocks = sorted({r["clock"] for r in runs if r.get("clock")})
    return "\n\n".join(filter(None, [
        table(header, rows),
        f"![test accuracy against wall-clock seconds]({os.path.basename(plot)})" if plotted else None,
        f"From `{os.path.relpath(data, ROOT)}/time_to_accuracy.jsonl` (bench/time_to_accuracy.py) and "
        f"`peers.jsonl` (bench/peers.py). DeepSpark's clock starts at the driver's `Solving` line (Spark's session "
        "up, shards planned): it holds the workers' start-up and their training"
        + ("; the peers' clocks, each as its record says:" if clocks else "."),
        "\n".join(f"- {c}" for c in clocks) or None]))


def draw_accuracy(runs, path):
    """One line per run of test accuracy against seconds; False when nothing can be drawn."""
    drawn = [r for r in runs if r.get("points")]
    if not drawn:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5.5))
    for r in drawn:
        seconds, accuracy = zip(*[(s, a) for s, _, a in r["points"]])
        axes.plot(seconds, accuracy, marker=".", label=r["run"] + (" (tests on the clock)"
                                                                    if r.get("tests") == "on the clock" else ""))
    axes.axhline(0.88, color="grey", linewidth=0.6, linestyle="--")
    axes.set_xlabel("seconds since training started")
    axes.set_ylabel("test accuracy (10,000 images)")
    axes.set_ylim(0.6, 0.95)
    axes.legend(fontsize=7, loc="lower right")
    axes.set_title("LeNet on Fashion-MNIST, 2 cores")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def network_section(records, data):
    """The emulated commodity network: time per iteration, exchange share, time to 0.88, the planner's error."""
    runs = [r for r in records if r.get("run")]
    if not runs:
        return missing("easgd and sync through bench/_shaper.py", "OPENBLAS_NUM_THREADS=1 python bench/network.py")
    ceiling = next((r["gbit"] for r in records if r.get("figure") == "proxy ceiling"), None)
    rows = [[r["model"], r["network"], r["run"], cell(r.get("seconds_per_iteration"), 4, " s"),
             cell(None if r.get("exchange_share") is None else 100 * r["exchange_share"], 1, "%"),
             cell(r.get("seconds_to_0.88"), 1, " s") if r["model"] == "lenet" else "—",
             cell(r.get("projected_seconds_per_iteration"), 4, " s"), cell(r.get("plan_error_percent"), 1, "%"),
             "yes" if r.get("proxy_bound") else ""] for r in runs]
    header = ["model", "network", "run", "s / iteration", "exchange share", "seconds to 0.88", "planner: s / iteration",
              "planner error", "near the proxy's ceiling"]
    off = [r for r in runs if r.get("plan_error_percent") is not None and abs(r["plan_error_percent"]) > 20]
    why = "" if not off else (
        "\n\nWhere the planner is off by more than 20% (" + ", ".join(
            f"{r['model']} {r['network']} {r['run']}: {r['plan_error_percent']:+.1f}%" for r in off) +
        "), what it leaves out: here the proxy (a Python thread copying every byte through its token buckets), the "
        "exchanger (its integrity tags over each vector) and both workers share 2 cores, where the model gives the "
        "center and each worker a node, and the links their own NICs; a worker's own part of an exchange (reading "
        "and writing its variables) runs beside its steps on the same core, which the model adds once a cycle.")
    return (table(header, rows) + f"\n\nFrom `{os.path.relpath(data, ROOT)}/network.jsonl` (bench/network.py); the "
            f"proxy's own unshaped ceiling here: {cell(ceiling, 2)} Gbit/s. `average` moves its models through Spark, "
            "not the exchanger: its row is a loopback run with each round's transfers over the link added by the "
            "model (its record says so)." + why)


def plan_section(records, data):
    """The throughput model against measured runs on this machine."""
    runs = [r for r in records if "workers" in r]
    if not runs:
        return missing("the planner against 1, 2 and 4 workers", "OPENBLAS_NUM_THREADS=1 python bench/plan_check.py")
    rows = [[str(r["workers"]), str(r["threads_per_worker"]), cell(r["cores_shared_by"], 1),
             cell(r["projected_images_per_s"], 0), cell(r["measured_images_per_s"], 0), cell(r["error_percent"], 1, "%"),
             cell(r["projected_exchange_percent"], 2, "%"), cell(r["measured_exchange_percent"], 2, "%")] for r in runs]
    header = ["workers", "threads each", "oversubscribed by", "projected images/s", "measured images/s", "error",
              "projected exchange share", "measured exchange share"]
    costs = {r["threads"]: r for r in records if r.get("figure") == "costs"}
    why = []
    for r in runs:
        if abs(r["error_percent"]) <= 20:
            continue
        c = costs.get(r["threads_per_worker"])
        center = "" if not c else (
            f" the center's own work, {c['server']:.1f} ms an exchange for each worker's every {r['period']} steps "
            f"of {c['step']:.1f} ms, is {100 * r['workers'] * c['server'] / (r['period'] * c['step'] * max(1, r['cores_shared_by'])) / 2:.0f}% "
            "of the 2 cores here, which the model gives a node of its own;")
        shared = " the model divides the cores by the workers' threads (\"oversubscribed by\"), not counting what two " \
            "TensorFlow processes time-slicing one core lose to switching and caches;" if r["cores_shared_by"] > 1 else ""
        why.append(f"- {r['workers']} worker{'s' * (r['workers'] != 1)} ({r['error_percent']:+.1f}%):{center}{shared} "
                   "the driver's JVM and its watch loop share the cores too, unmodelled.")
    text = table(header, rows) + f"\n\nFrom `{os.path.relpath(data, ROOT)}/plan_check.jsonl` (bench/plan_check.py): " \
        "measured images/s are the workers' steady state (their first step, where TensorFlow traces, left out; " \
        "start-up is the last section's)."
    if why:
        text += "\n\nWhere the error is over 20%, what the model leaves out that this machine has:\n\n" + "\n".join(why)
    return text


def divergence_section(records, data):
    """RQ5: d(α, τ, n), the samples an EASGD run needs to reach a test accuracy over `single`'s, by workers and
    period, at 0.85 and 0.88 (a run that did not reach it gives a lower bound: its samples over single's)."""
    single = next((r for r in records if r.get("run") == "single" and r.get("tests") == "off the clock"), None)
    easgd = [r for r in records if r.get("run", "").startswith("easgd") and r.get("tests") == "off the clock"
             and r.get("workers") and r.get("points")]
    if not single or not easgd:
        return missing("single and easgd at several periods and worker counts", "make bench")
    periods = sorted({r["period"] for r in easgd})
    header = ["target", "workers ↓ period →", *[str(p) for p in periods]]
    rows = []
    for target in TARGETS:
        base = single.get(f"samples_to_{target}")
        if not base:
            rows.append([target, "—", *[f"single did not reach {target}"] + [""] * (len(periods) - 1)])
            continue
        rows.append([target, "1 (single)", *["1.00" if i == 0 else "" for i in range(len(periods))]])
        for workers in sorted({r["workers"] for r in easgd}):
            row = [target, str(workers)]
            for period in periods:
                run = next((r for r in easgd if r["workers"] == workers and r["period"] == period), None)
                samples = run and run.get(f"samples_to_{target}")
                row.append("" if run is None else f"{samples / base:.2f}" if samples else
                           f"> {run['points'][-1][1] / base:.2f}")
            rows.append(row)
    bases = ", ".join(f"{cell(single.get(f'samples_to_{t}'))} to {t}" for t in TARGETS)
    return "\n\n".join([
        table(header, rows),
        f"d = the samples a run needed to reach the target test accuracy / `single`'s ({bases}); \"> x\": not "
        "reached within its samples (x of single's). The moving rate keeps β = p·α = 0.9 (α = 0.45 and 0.225 for 2 "
        "and 4 workers); a blank cell was not run. Samples are counted at the snapshots (every ~15,000 samples), so "
        "d moves in steps of that over single's samples. 4 workers oversubscribe the 2 cores (two a core): the table "
        f"compares samples, not seconds. From `{os.path.relpath(data, ROOT)}/time_to_accuracy.jsonl`."])


def _run(records, name, tests="off the clock"):
    return next((r for r in records if r.get("run") == name and r.get("tests", tests) == tests
                 and "error" not in r), None)


def _seconds(record):
    return None if record is None else record.get("seconds_to_0.88")


def _reach(record):
    """When `record`'s run reached 0.88, or how far it went without."""
    if record is None:
        return "not run"
    if _seconds(record) is not None:
        return cell(_seconds(record), 1, " s")
    last = (record.get("points") or [[None, None]])[-1]
    return f"not in its {cell(last[0], 0, ' s')} ({cell(last[1])} samples)"


def _rate(record):
    """Images/s of a run between its first and its last tested point (its start-up apart)."""
    points = record.get("points") or []
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _samples_ratio(run, base, target):
    """The run's samples to `target` over base's, or a lower bound ("> x") when it did not reach it."""
    b = base.get(f"samples_to_{target}")
    if not b:
        return "—"
    n = run.get(f"samples_to_{target}")
    return f"{n / b:.2f}x" if n else f"> {run['points'][-1][1] / b:.2f}x"


def targets(accuracy, network, startup):
    """(target, what was measured, met, why not) for each of the issue's targets, from the records."""
    rows = []
    easgd_1g, sync_1g, average_1g = (next((r for r in network if r.get("model") == "lenet" and r.get("network") == "1G"
                                           and r.get("run") == name), None)
                                     for name in ("easgd period 10", "sync", "average period 10"))
    if easgd_1g:
        e, others = _seconds(easgd_1g), [_seconds(sync_1g), _seconds(average_1g)]
        met = e is not None and all(o is None or e < o for o in others)
        first = min(((s, n) for s, n in zip(others, ("sync", "average")) if s is not None), default=None)
        rows.append(("emulated 1 Gbit/s: easgd (period 10) reaches 0.88 before sync and average",
                     f"easgd {_reach(easgd_1g)}; sync {_reach(sync_1g)}; average {_reach(average_1g)}", met,
                     "easgd did not reach 0.88 within its run" if e is None else
                     f"{first[1]} reached it first" if first and not met else ""))
    single, easgd = _run(accuracy, "single"), _run(accuracy, "easgd period 10")
    elephas = [r for r in accuracy if r.get("run", "").startswith("elephas") and "error" not in r]
    if single and easgd:
        s, e = _seconds(single), _seconds(easgd)
        ratio = e / s if e and s else None
        speed = _rate(easgd) / _rate(single) if _rate(easgd) and _rate(single) else None
        why = (f"easgd needed {_samples_ratio(easgd, single, '0.85')} single's samples to 0.85 and "
               f"{_samples_ratio(easgd, single, '0.88')} to 0.88 (d, RQ5; —: single did not reach it), and trained at {cell(speed, 2, 'x')} "
               "single's images/s on these 2 cores (one core a worker, against one process on both), with its "
               "workers' start-up on its clock")
        periods = [r for r in accuracy if r.get("run", "").startswith("easgd period") and _seconds(r) is not None
                   and r.get("tests") == "off the clock"]
        if periods and s:  # the period the target names is not the only one run
            fastest = min(periods, key=_seconds)
            why += f"; easgd's fastest period here, {fastest['run'][len('easgd '):]}, took {_seconds(fastest) / s:.2f}x"
        rows.append(("loopback, tests off the clock: easgd (period 10) within 1.3x of single's time to 0.88",
                     f"easgd {_reach(easgd)}, single {_reach(single)}" + (f": {ratio:.2f}x" if ratio else ""),
                     ratio is not None and ratio <= 1.3, why))
        if elephas:
            best = min(elephas, key=lambda r: (_seconds(r) is None, _seconds(r) or 0))
            rows.append(("... and ahead of Elephas's best mode",
                         f"Elephas's best ({best['run']}): {_reach(best)}",
                         e is not None and (_seconds(best) is None or e < _seconds(best)),
                         "" if e is not None else "easgd did not reach 0.88 within its run"))
    torch = _run(accuracy, "torchdistributor")
    if easgd and (elephas or torch):
        peak = easgd.get("peak_pss_mb")
        lowest_elephas = min((r["peak_pss_mb"] for r in elephas if r.get("peak_pss_mb")), default=None)
        torch_peak = torch and torch.get("peak_pss_mb")
        where = next((r for r in startup if r.get("run") == "easgd"), None)
        rows.append(("whole-job peak memory (PSS) under Elephas's and at or under TorchDistributor's",
                     f"easgd {cell(peak, 0, ' MB')}, Elephas's lowest {cell(lowest_elephas, 0, ' MB')}, "
                     f"TorchDistributor {cell(torch_peak, 0, ' MB')}",
                     bool(peak) and (lowest_elephas is None or peak < lowest_elephas)
                     and (not torch_peak or peak <= torch_peak),
                     "at its peak in bench/startup.py's run: " + ", ".join(
                         f"{k} {cell(float(v), 0, ' MB')}" for k, v in where["pss_at_peak_mb"].items())
                     if where and where.get("pss_at_peak_mb") else "the last section says where it goes"))
    start = next((r for r in startup if r.get("figure") == "targets"), None)
    if start:
        rows.append(("worker start-up within 2x the single process's",
                     f"{cell(start.get('easgd_startup_seconds'), 1, ' s')} against "
                     f"{cell(start.get('single_startup_seconds'), 1, ' s')}: {cell(start.get('startup_ratio'), 2, 'x')}",
                     bool(start.get("startup_met")), "the last section has its parts"))
    return rows


def targets_section(accuracy, network, startup):
    rows = targets(accuracy, network, startup)
    if not rows:
        return missing("the runs the targets are measured on", "make bench")
    return table(["target", "measured", "met", "why not"],
                 [[t, m, "yes" if ok else "**no**", "" if ok else why] for t, m, ok, why in rows]) + \
        "\n\nEach row is computed from the records of the sections below."


def compare_block(accuracy):
    """The README's "How it compares" lines: each run's time to 0.88, from the same records as the page."""
    rows = [[r["run"], cell(r.get("seconds_to_0.88"), 1, " s"), cell(r.get("samples_to_0.88")),
             cell(r.get("peak_pss_mb"), 0, " MB")]
            for r in accuracy if "points" in r and r.get("tests") == "off the clock"
            and (r.get("workers") in (None, 1, 2)) and not r["run"].startswith("easgd 1 worker")]
    if not rows:
        return None
    return table(["run (LeNet, Fashion-MNIST, 2 cores)", "seconds to 0.88", "samples to 0.88", "peak PSS"], rows)


def rewrite_readme(block, path=os.path.join(ROOT, "README.md")):
    """Put `block` between the README's compare markers (when both are there)."""
    begin, end = "<!-- compare:begin (bench/_page.py writes this) -->", "<!-- compare:end -->"
    with open(path) as stream:
        text = stream.read()
    if begin not in text or end not in text or block is None:
        return False
    head, rest = text.split(begin, 1)
    updated = head + begin + "\n" + block + "\n" + end + rest.split(end, 1)[1]
    if updated != text:
        with open(path + ".tmp", "w") as stream:
            stream.write(updated)
        os.replace(path + ".tmp", path)
    return True


def bench_section(name, records, data, command):
    """The section bench/NAME.py draws of its own records (its page_section), or what is missing."""
    if not records:
        return missing(f"bench/{name}.py", command)
    module = importlib.import_module(name)
    return module.page_section(records, data)


def timing_line(records):
    """How long the benchmarks behind this page took (docs/data/timing.jsonl, which `make bench` writes)."""
    if not records:
        return None
    quick = any(r.get("quick") for r in records)
    total = sum(r["seconds"] for r in records)
    parts = ", ".join(f"{r['bench']} {r['seconds'] / 60:.1f}" for r in records)
    return (f"This page's benchmarks took {total / 60:.1f} minutes ({'`QUICK=1`, target under 10' if quick else 'target under 60'}; "
            f"minutes each: {parts}).")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"), help="whose \"How it compares\" "
                        "table to rewrite (\"\": none)")
    args = parser.parse_args()
    folder = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(folder, exist_ok=True)
    ours, peers = load(args.data, "time_to_accuracy"), load(args.data, "peers")
    network, startup = load(args.data, "network"), load(args.data, "startup")
    quick = "make bench"
    sections = [
        "# DeepSpark against its peers, measured here",
        "Every figure below is from a benchmark in `bench/` and the JSON lines it wrote into `docs/data/`, "
        "regenerated by `make bench` (`make bench QUICK=1`: a subset) on a 2-core machine without GPU.",
        timing_line(load(args.data, "timing")),
        "## Targets",
        targets_section(ours + peers, network, startup),
        "## Time to accuracy (RQ1, RQ2)",
        accuracy_section(ours + peers, args.data, os.path.join(folder, "time_to_accuracy.png")),
        "## The divergence penalty d(α, τ, n) (RQ5)",
        divergence_section(ours, args.data),
        "## Time blocked on the exchange, overlapped and not (RQ3)",
        bench_section("communication", load(args.data, "communication"), args.data, quick),
        "## A commodity network, emulated (RQ1, RQ3)",
        network_section(network, args.data),
        "## The throughput model against runs here",
        plan_section(load(args.data, "plan_check"), args.data),
        "## The Caffe and TensorFlow backends side by side",
        bench_section("backends", load(args.data, "backends"), args.data, quick),
        "## Data from a DataFrame, Parquet and LMDB (RQ4)",
        bench_section("data_integration", load(args.data, "data_integration"), args.data, quick),
        "## What the project costs its workers: start-up and memory",
        bench_section("startup", startup, args.data, quick),
    ]
    with open(args.out, "w") as stream:
        stream.write("\n\n".join(filter(None, sections)) + "\n")
    print(f"wrote {args.out}")
    if args.readme and rewrite_readme(compare_block(ours + peers), args.readme):
        print(f"wrote the comparison in {args.readme}")


if __name__ == "__main__":
    main()
