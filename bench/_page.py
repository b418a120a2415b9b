"""docs/results.md and its plots from the JSON lines the page's benchmarks wrote into docs/data/ (#14): `make bench` runs them, then this; every figure on the page is one of theirs, and a section whose data is missing says so.

    .venv/bin/python bench/_page.py [--data docs/data] [--out docs/results.md]
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks, each of which draws its own section

import backends  # noqa: E402  (bench/backends.py)
import chaos  # noqa: E402  (bench/chaos.py)
import communication  # noqa: E402  (bench/communication.py)
import data_integration  # noqa: E402  (bench/data_integration.py)
import network  # noqa: E402  (bench/network.py)
import plan_check  # noqa: E402  (bench/plan_check.py)
import seal  # noqa: E402  (bench/seal.py)
import startup as start_up  # noqa: E402  (bench/startup.py)
import time_to_accuracy  # noqa: E402  (bench/time_to_accuracy.py)
import _slow_links  # noqa: E402  (bench/_slow_links.py)
from _tables import cell, load, missing, table  # noqa: E402  (bench/_tables.py)


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
    points = record.get("points") or [[None, None, None]]
    best = max((p[2] for p in points if p[2] is not None), default=None)
    return (f"not in its {cell(points[-1][0], 0, ' s')} ({cell(points[-1][1])} samples"
            + (f"; best test {cell(best, 4)})" if best is not None else ")"))


def _rate(record):
    """Images/s of a run between its first and its last tested point (its start-up apart)."""
    points = record.get("points") or []
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _samples_ratio(run, base, target):
    """The run's samples to `target` over base's, or a lower bound ("> x") when it did not reach it."""
    d = time_to_accuracy.d_value(run, base, target)
    return "—" if d is None else d + "x"


def _loopback_rows(accuracy, single, easgd, how, elephas):
    """The loopback targets' rows for `easgd` (the period 10 run, `how` its learning rate): within 1.3x of single's
    time to 0.88, and ahead of Elephas's best mode."""
    rows = []
    s, e = _seconds(single), _seconds(easgd)
    ratio = e / s if e and s else None
    speed = _rate(easgd) / _rate(single) if _rate(easgd) and _rate(single) else None
    why = (f"easgd needed {_samples_ratio(easgd, single, '0.85')} single's samples to 0.85 and "
           f"{_samples_ratio(easgd, single, '0.88')} to 0.88 (d, RQ5; —: single did not reach it), and trained at "
           f"{cell(speed, 2, 'x')} single's images/s on these 2 cores (one core a worker, against one process on both), "
           "with its workers' start-up on its clock")
    if easgd.get("seconds_to_0.85") and single.get("seconds_to_0.85"):
        why += f"; to 0.85 it took {easgd['seconds_to_0.85'] / single['seconds_to_0.85']:.2f}x single's time"
    periods = [r for r in accuracy if r.get("run", "").startswith("easgd period") and _seconds(r) is not None
               and r.get("tests") == "off the clock" and not r.get("learning_rate_times")]
    if periods and s and not how:  # the period the target names is not the only one run
        fastest = min(periods, key=_seconds)
        why += f"; easgd's fastest period here, {fastest['run'][len('easgd '):]}, took {_seconds(fastest) / s:.2f}x"
    met = ratio is not None and ratio <= 1.3
    rows.append((f"loopback, tests off the clock: easgd (period 10{how}) within 1.3x of single's time to 0.88",
                 f"easgd {_reach(easgd)}, single {_reach(single)}" + (f": {ratio:.2f}x" if ratio else ""),
                 met, "" if met else why))
    if elephas:
        best = min(elephas, key=lambda r: (_seconds(r) is None, _seconds(r) or 0))
        ahead = e is not None and (_seconds(best) is None or e < _seconds(best))
        rows.append(("... and ahead of Elephas's best mode", f"Elephas's best ({best['run']}): {_reach(best)}",
                     ahead, "" if ahead else "easgd did not reach 0.88 within its run" if e is None else
                     "Elephas reached it first"))
    return rows


def _network_rows(emulated, suffix, how):
    """The 1 Gbit/s target's row for the LeNet runs named with `suffix` (their learning rate, `how`): easgd (period
    10) reaches 0.88 before sync and average."""
    easgd, sync, average = (next((r for r in emulated if r.get("model") == "lenet" and r.get("network") == "1G"
                                  and r.get("run") == name + suffix), None)
                            for name in ("easgd period 10", "sync", "average period 10"))
    if not easgd:
        return []
    e, others = _seconds(easgd), [_seconds(sync), _seconds(average)]
    met = e is not None and all(o is None or e < o for o in others)
    first = min(((s, n) for s, n in zip(others, ("sync", "average")) if s is not None), default=None)
    at_85 = "; to 0.85: " + ", ".join(f"{n} {cell(r and r.get('seconds_to_0.85'), 1, ' s')}" for n, r in (
        ("easgd", easgd), ("sync", sync), ("average", average)))  # the lower target, when 0.88 is not
    return [(f"emulated 1 Gbit/s{how}: easgd (period 10) reaches 0.88 before sync and average",
             f"easgd {_reach(easgd)}; sync {_reach(sync)}; average {_reach(average)}", met,
             "easgd did not reach 0.88 within its run" + at_85 if e is None else
             f"{first[1]} reached it first" if first and not met else "")]


def _seeded(accuracy, name):
    """The records of run `name` off the clock that trained (one a seed)."""
    return [r for r in accuracy if r.get("run") == name and r.get("tests", "off the clock") == "off the clock"
            and "points" in r]


def _medians(runs, key):
    return time_to_accuracy.median([r.get(key) for r in runs])


def _peer_rows(accuracy):
    """#44's acceptance: easgd's median time to 0.88 at most 0.8x each single-process peer's, DeepSpark single's
    samples/s at least keras single's; all from the rounds of one bench/time_to_accuracy.py invocation."""
    rows, easgd = [], _seeded(accuracy, time_to_accuracy.COMPARED_EASGD)
    spread = time_to_accuracy.spread
    for peer in time_to_accuracy.PEERS_COMPARED:
        runs = _seeded(accuracy, peer)
        if not easgd or not runs:
            continue
        e, p = _medians(easgd, "seconds_to_0.88"), _medians(runs, "seconds_to_0.88")
        ratio = e / p if e and p else None
        rows.append((f"{time_to_accuracy.COMPARED_EASGD} (the zoo's LeNet knobs) median time to 0.88 at most 0.8x "
                     f"{peer}'s, same invocation",
                     f"easgd {spread([r.get('seconds_to_0.88') for r in easgd], 1, ' s')}, {peer} "
                     f"{spread([r.get('seconds_to_0.88') for r in runs], 1, ' s')} (medians and ranges of "
                     f"{len(easgd)} and {len(runs)} seeds)" + (f": {ratio:.2f}x" if ratio else ""),
                     ratio is not None and ratio <= 0.8,
                     "easgd's median seed did not reach 0.88" if e is None else
                     f"{peer}'s median seed did not reach 0.88" if p is None else f"easgd took {ratio:.2f}x"))
    single, keras = _seeded(accuracy, "single"), _seeded(accuracy, "keras single")
    if single and keras:
        s, k = _medians(single, "samples_per_second"), _medians(keras, "samples_per_second")
        ratio = s / k if s and k else None
        rows.append(("DeepSpark single's samples/s at least keras single's, same invocation",
                     f"single {cell(s, 0)}, keras single {cell(k, 0)} (medians of {len(single)} and {len(keras)} "
                     "seeds, between each run's first and last test point)" + (f": {ratio:.2f}x" if ratio else ""),
                     ratio is not None and ratio >= 1, f"single trained at {ratio:.2f}x keras's samples/s" if ratio else
                     "a run had fewer than two test points"))
    return rows


def start_line(accuracy):
    """The single run's start against keras single's: from its process's start to its first step."""
    single, keras = _seeded(accuracy, "single"), _seeded(accuracy, "keras single")
    s, k = _medians(single, "process_start_to_first_step"), _medians(keras, "process_start_to_first_step")
    if not s or not k:
        return None
    return (f"Start-up, from the process's start to its first step (medians of the seeds): DeepSpark single "
            f"{s:.1f} s, keras single {k:.1f} s: {s / k:.2f}x (DeepSpark's imports TensorFlow, reads the solver and "
            "builds its net and feeders; keras's imports TensorFlow, loads the arrays, builds and compiles its "
            "model and traces fit's step).")


def targets(accuracy, emulated, startup):
    """(target, what was measured, met, why not) for each of the issue's targets, from the records."""
    rows = _peer_rows(accuracy)
    for suffix, how in (("", ""), (network.SCALED_SUFFIX, ", base_lr x2 for all three")):
        rows.extend(_network_rows(emulated, suffix, how))
    single, easgd = _run(accuracy, "single"), _run(accuracy, "easgd period 10")
    elephas = [r for r in accuracy if r.get("run", "").startswith("elephas") and "error" not in r]
    scaled = _run(accuracy, time_to_accuracy.SCALED)
    for run, how in ((easgd, ""), (scaled, ", base_lr x2: linear scaling to its global batch of 2 x 64")):
        if single and run:
            rows.extend(_loopback_rows(accuracy, single, run, how, elephas))
    rows.extend(_slow_links.targets(emulated, accuracy))
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
                     f"from process start to the first step {cell(start.get('easgd_to_first_step_seconds'), 1, ' s')} "
                     f"against {cell(start.get('single_to_first_step_seconds'), 1, ' s')}: "
                     f"{cell(start.get('startup_ratio'), 2, 'x')}; from Solving "
                     f"{cell(start.get('easgd_startup_seconds'), 1, ' s')} against "
                     f"{cell(start.get('single_startup_seconds'), 1, ' s')} (the single process's import and build come "
                     "before its Solving line)",
                     bool(start.get("startup_met")),
                     "the workers wait on Spark's JVM and SparkContext, then on their daemon (the fork part): the last "
                     "section has the parts"))
    return rows


def targets_section(accuracy, emulated, startup):
    rows = targets(accuracy, emulated, startup)
    if not rows:
        return missing("the runs the targets are measured on", "make bench")
    return table(["target", "measured", "met", "why not"],
                 [[t, m, "yes" if ok else "**no**", "" if ok else why] for t, m, ok, why in rows]) + \
        "\n\nEach row is computed from the records of the sections below." + \
        (f" {start_line(accuracy)}" if start_line(accuracy) else "")


def compare_block(accuracy):
    """The README's "How it compares" lines: each run's time to 0.88, from the same records as the page; a run made
    at several seeds is one row, its medians and (ranges), as the page's own table has them."""
    shown = [r for r in accuracy if "points" in r and r.get("tests") == "off the clock"
             and (r.get("workers") in (None, 1, 2)) and not r["run"].startswith("easgd 1 worker")]
    rows = []
    for label, group in time_to_accuracy.grouped(shown).items():
        if len(group) == 1:
            r = group[0]
            rows.append([label, _reach(r), cell(r.get("samples_to_0.88")), cell(r.get("seconds_to_0.85"), 1, " s"),
                         cell(r.get("peak_pss_mb"), 0, " MB")])
            continue
        figures = {key: [r.get(key) for r in group] for key in ("seconds_to_0.88", "samples_to_0.88",
                                                                 "seconds_to_0.85", "peak_pss_mb")}
        rows.append([f"{label} ({len(group)} seeds)", time_to_accuracy.spread(figures["seconds_to_0.88"], 1, " s"),
                     time_to_accuracy.spread(figures["samples_to_0.88"], 0),
                     time_to_accuracy.spread(figures["seconds_to_0.85"], 1, " s"),
                     time_to_accuracy.spread(figures["peak_pss_mb"], 0, " MB")])
    if not rows:
        return None
    return table(["run (LeNet, Fashion-MNIST, 2 cores)", "seconds to 0.88", "samples to 0.88", "seconds to 0.85",
                  "peak PSS"], rows)


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


def rewrite_row(row, path=os.path.join(ROOT, "docs", "measured.md")):
    """Replace the row of the page at `path` that begins as `row` does (its first cell) with `row` (None: leave
    it)."""
    if row is None:
        return False
    with open(path) as stream:
        text = stream.read()
    first = row.split(" | ")[0] + " | "
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if line.startswith(first)), None)
    if at is None or lines[at] == row:
        return at is not None
    lines[at] = row
    with open(path + ".tmp", "w") as stream:
        stream.write("\n".join(lines))
    os.replace(path + ".tmp", path)
    return True


def chaos_section(path=os.path.join(ROOT, "bench", "measured_chaos.jsonl")):
    """The staying-power section (its own heading) that bench/chaos.py draws of its records: it runs apart from
    `make bench` (a standalone cluster, kills), so the page keeps its last records; None where there are none."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as stream:
        records = [json.loads(line) for line in stream if line.strip()]
    return chaos.page_section(records) if records else None


def section(module, data):
    """The section bench/MODULE.py draws of the records it wrote into `data` (its page_section), or what is
    missing."""
    records = load(data, module.__name__)
    if not records:
        return missing(f"bench/{module.__name__}.py", "make bench")
    return module.page_section(records, data)


def timings(data, ours):
    """(this page's timing records, the other kind's): the page is QUICK's when its runs are of QUICK's length."""
    full, quick = load(data, "timing"), load(data, "timing_quick")
    is_quick = any(r.get("epochs") == time_to_accuracy.QUICK_EPOCHS for r in ours)
    return (quick, full) if is_quick else (full, quick)


def timing_line(records, other=()):
    """How long the benchmarks behind this page took (docs/data/timing.jsonl, which `make bench` writes, or
    timing_quick.jsonl for `QUICK=1`), and how long the last run of the other kind took."""
    if not records:
        return None
    quick = any(r.get("quick") for r in records)
    total = sum(r["seconds"] for r in records)
    parts = ", ".join(f"{r['bench']} {r['seconds'] / 60:.1f}" for r in records)
    line = (f"This page's benchmarks took {total / 60:.1f} minutes ({'`QUICK=1`, target under 10' if quick else 'target under 60'}; "
            f"minutes each: {parts}).")
    if other:
        line += (f" The last {'full run' if quick else '`make bench QUICK=1`'} took "
                 f"{sum(r['seconds'] for r in other) / 60:.1f} minutes (target under {60 if quick else 10}).")
    return line


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"), help="whose \"How it compares\" "
                        "table to rewrite (\"\": none)")
    parser.add_argument("--chaos", default=os.path.join(ROOT, "bench", "measured_chaos.jsonl"),
                        help="bench/chaos.py's records, for the staying-power section (\"\": none)")
    parser.add_argument("--measured", default=os.path.join(ROOT, "docs", "measured.md"), help="whose \"Measured "
                        "here\" row of the seal to rewrite (\"\": none)")
    args = parser.parse_args()
    folder = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(folder, exist_ok=True)
    ours, peers = load(args.data, "time_to_accuracy"), load(args.data, "peers")
    network_records, startup = load(args.data, "network"), load(args.data, "startup")
    sections = [
        "# DeepSpark against its peers, measured here",
        "Every figure below is from a benchmark in `bench/` and the JSON lines it wrote into `docs/data/`, "
        "regenerated by `make bench` (`make bench QUICK=1`: a subset) on a 2-core machine without GPU.",
        timing_line(*timings(args.data, ours)),
        "## Targets",
        targets_section(ours + peers, network_records, startup),
        "## Time to accuracy (RQ1, RQ2)",
        time_to_accuracy.page_section(ours + peers, args.data, os.path.join(folder, "time_to_accuracy.png")),
        "## The divergence penalty d(α, τ, n) (RQ5)",
        time_to_accuracy.divergence_section(ours, args.data, os.path.join(folder, "divergence.png")),
        "## Time blocked on the exchange, overlapped and not (RQ3)",
        section(communication, args.data),
        "## A commodity network, emulated (RQ1, RQ3)",
        network.page_section(network_records, args.data),
        "## The slow-link regime: the compressed exchange (#27)",
        _slow_links.page_section(network_records, ours, args.data, folder),
        "## The seal: per-frame integrity and its cost (#27)",
        section(seal, args.data),
        "## The throughput model against runs here",
        section(plan_check, args.data),
        "## The Caffe and TensorFlow backends side by side",
        section(backends, args.data),
        "## Data from a DataFrame, Parquet and LMDB (RQ4)",
        section(data_integration, args.data),
        "## What the project costs its workers: start-up and memory",
        section(start_up, args.data),
        chaos_section(args.chaos),
    ]
    with open(args.out, "w") as stream:
        stream.write("\n\n".join(filter(None, sections)) + "\n")
    print(f"wrote {args.out}")
    if args.readme and rewrite_readme(compare_block(ours + peers), args.readme):
        print(f"wrote the comparison in {args.readme}")
    if args.measured and rewrite_row(seal.measured_row(load(args.data, "seal")), args.measured):
        print(f"wrote the seal's row in {args.measured}")


if __name__ == "__main__":
    main()
