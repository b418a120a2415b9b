"""docs/results.md and its plots from the JSON lines the page's benchmarks wrote into docs/data/ (#14): `make bench` runs them, then this; every figure on the page is one of theirs, and a section whose data is missing says so.

    .venv/bin/python bench/_page.py [--data docs/data] [--out docs/results.md]
"""

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("0.85", "0.88")


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
        "up, shards planned): it holds the workers' start-up and their training; the peers' clocks, each as its "
        "record says:" if runs else None,
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
    return (table(header, rows) + f"\n\nFrom `{os.path.relpath(data, ROOT)}/network.jsonl` (bench/network.py); the "
            f"proxy's own unshaped ceiling here: {cell(ceiling, 2)} Gbit/s.")


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
    return table(header, rows) + f"\n\nFrom `{os.path.relpath(data, ROOT)}/plan_check.jsonl` (bench/plan_check.py)."


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    args = parser.parse_args()
    folder = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(folder, exist_ok=True)
    sections = [
        "# DeepSpark against its peers, measured here",
        "Every figure below is from a benchmark in `bench/` and the JSON lines it wrote into `docs/data/`, "
        "regenerated by `make bench` (`make bench QUICK=1`: a subset) on a 2-core machine without GPU.",
        "## Time to accuracy (RQ1, RQ2)",
        accuracy_section(load(args.data, "time_to_accuracy") + load(args.data, "peers"), args.data,
                         os.path.join(folder, "time_to_accuracy.png")),
        "## The throughput model against runs here",
        plan_section(load(args.data, "plan_check"), args.data),
        "## A commodity network, emulated (RQ3, RQ5)",
        network_section(load(args.data, "network"), args.data),
    ]
    with open(args.out, "w") as stream:
        stream.write("\n\n".join(sections) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
