"""The results page's section on the slow-link regime (#27): LeNet to 0.88 on each emulated link, float32 against the compressed exchange, in seconds and in bytes a worker sent, with sync and average priced beside them; its targets and its plots.

bench/_page.py draws it from docs/data/network.jsonl (bench/network.py) and time_to_accuracy.jsonl.
"""

import os
import statistics

import network  # noqa: E402  (bench/network.py)
import time_to_accuracy as tta  # noqa: E402  (bench/time_to_accuracy.py)
from _tables import cell, missing, table  # noqa: E402  (bench/_tables.py)

FLOAT32 = "easgd period 10" + network.SCALED_SUFFIX
AVERAGE = "average period 10" + network.SCALED_SUFFIX
SYNC = "sync" + network.SCALED_SUFFIX
SLOWEST = "100M"
SAMPLES_PER_ITERATION = tta.BATCH * tta.WORKERS  # every run here has 2 workers
TIMES_FASTER, BYTES_FEWER, SAMPLES_WITHIN = 2.0, 100.0, 0.10  # the targets
MEASURED = (FLOAT32, tta.COMPRESSED, AVERAGE)  # trained to accuracy on every link (network.EVERY_LINK)
PER_ITERATION = ("easgd period 10, int8", "sync, int8")
CODED = f"{tta.CODEC} period {tta.CODEC_PERIOD}"
LABELS = {FLOAT32: "easgd period 10, float32", tta.COMPRESSED: f"easgd period {tta.CODEC_PERIOD}, {tta.CODEC}",
          AVERAGE: "average period 10, float32 (through Spark)", SYNC: "sync, float32 (computed)"}
STYLES = {FLOAT32: ("tab:blue", "o"), tta.COMPRESSED: ("tab:green", "s"), AVERAGE: ("tab:orange", "D"),
          SYNC: ("tab:red", "v")}


def _lenet(records, network_name, run):
    return next((r for r in records if r.get("model") == "lenet" and r.get("network") == network_name
                 and r.get("run") == run), None)


def _loopback(accuracy, run):
    return next(iter(_loopbacks(accuracy, run)), None)


def _loopbacks(accuracy, run):
    """Every loopback record of `run` off the clock, the first made first (tta.REPEATS makes some more than once)."""
    return sorted((r for r in accuracy if r.get("run") == run and r.get("tests", "off the clock") == "off the clock"
                   and r.get("points")), key=lambda r: r.get("repeat", 1))


def _last(record):
    """(seconds, samples) of a run's last tested point: how far it went."""
    return tuple(record["points"][-1][:2]) if record.get("points") else (None, None)


def _sync_at(records, network_name):
    """Sync's float32 record on a link that gives its seconds and bytes an iteration: the scaled run where it ran
    (1 Gbit/s), else the one run per iteration (its rate does not change a step's time)."""
    return _lenet(records, network_name, SYNC) or _lenet(records, network_name, "sync")


def rows(records, accuracy):
    """One dict per (link, run) of the section's table and plots: label, network, gbit, seconds and bytes a worker
    sent an iteration, seconds, samples and bytes to 0.88 (`lower`: the run stopped short of it, and the figures
    are how far it went), and `how` it was found."""
    sync_loop = _loopback(accuracy, tta.SYNC_SCALED)
    found = []
    for network_name, gbit in network.NETWORKS.items():
        for run in MEASURED:
            r = _lenet(records, network_name, run)
            if r is None:
                continue
            lower = r.get("seconds_to_0.88") is None
            seconds, samples = (_last(r) if lower else (r["seconds_to_0.88"], r["samples_to_0.88"]))
            found.append({"run": run, "network": network_name, "gbit": gbit, "record": r,
                          "seconds_per_iteration": r.get("seconds_per_iteration"),
                          "exchange_share": r.get("exchange_share"), "bytes_per_iteration": r.get("bytes_per_iteration"),
                          "seconds": seconds, "samples": samples, "lower": lower,
                          "bytes": None if samples is None or r.get("bytes_per_iteration") is None else
                          r["bytes_per_iteration"] * samples / SAMPLES_PER_ITERATION,
                          "how": "loopback run, the link's transfers added by the model" if r.get("emulated") else
                          "measured"})
        s = _sync_at(records, network_name)
        if s is not None and sync_loop is not None and s.get("seconds_per_iteration"):
            lower = sync_loop.get("samples_to_0.88") is None
            samples = _last(sync_loop)[1] if lower else sync_loop["samples_to_0.88"]
            iterations = samples / SAMPLES_PER_ITERATION
            found.append({"run": SYNC, "network": network_name, "gbit": gbit, "record": s,
                          "seconds_per_iteration": s["seconds_per_iteration"],
                          "exchange_share": s.get("exchange_share"), "bytes_per_iteration": s.get("bytes_per_iteration"),
                          "seconds": iterations * s["seconds_per_iteration"], "samples": samples, "lower": lower,
                          "bytes": None if s.get("bytes_per_iteration") is None else
                          iterations * s["bytes_per_iteration"],
                          "how": f"computed: its samples to 0.88 on loopback (`{tta.SYNC_SCALED}`) at its seconds "
                                 f"and bytes an iteration here (`{s['run']}`), training alone"})
    return found


def _bound(value, lower, digits=1, unit=""):
    return ("> " if lower else "") + cell(value, digits, unit) if value is not None else "—"


def table_rows(found, records):
    out = []
    for f in found:
        r = f["record"]
        out.append([f["network"], LABELS.get(f["run"], f["run"]), cell(f["seconds_per_iteration"], 4, " s"),
                    cell(None if f["exchange_share"] is None else 100 * f["exchange_share"], 1, "%"),
                    cell(None if f["bytes_per_iteration"] is None else f["bytes_per_iteration"] / 1e3, 1, " kB"),
                    _bound(f["seconds"], f["lower"], 1, " s"), _bound(f["samples"], f["lower"]),
                    _bound(None if f["bytes"] is None else f["bytes"] / 1e6, f["lower"], 1, " MB"),
                    f["how"] + (f" (sent in all: {cell(r['sent_mb_per_worker'], 1, ' MB')}, of which the snapshots' "
                                f"solver histories {cell(r.get('histories_mb_per_worker'), 1, ' MB')})"
                                if f["how"] == "measured" and r.get("sent_mb_per_worker") is not None else
                                " (stopped at its cap, no summary lines: sent from its frames' size)"
                                if f["how"] == "measured" and r.get("bytes_from", "").startswith("frame") else "")])
    for network_name in network.NETWORKS:
        for run in PER_ITERATION:
            r = _lenet(records, network_name, run)
            if r is not None:
                out.append([network_name, run, cell(r.get("seconds_per_iteration"), 4, " s"),
                            cell(None if r.get("exchange_share") is None else 100 * r["exchange_share"], 1, "%"),
                            cell(None if r.get("bytes_per_iteration") is None else r["bytes_per_iteration"] / 1e3, 1,
                                 " kB"), "per iteration only", "", "", "measured"])
    return out


def targets(records, accuracy):
    """(target, what was measured, met, why not) of the slow-link regime's three targets."""
    found = {(f["network"], f["run"]): f for f in rows(records, accuracy)}
    out = []
    coded, plain = found.get((SLOWEST, tta.COMPRESSED)), found.get((SLOWEST, FLOAT32))
    if coded and plain:
        # A ratio only where the codec's run reached 0.88 (float32's short of it makes the ratio a lower bound).
        ratio = None if coded["lower"] or not (coded["seconds"] and plain["seconds"]) else \
            plain["seconds"] / coded["seconds"]
        met = ratio is not None and ratio > TIMES_FASTER
        out.append((f"emulated 100 Mbit/s, base_lr x2: easgd {CODED} reaches 0.88 in under half float32 easgd "
                    f"period 10's time", f"{tta.CODEC} {_bound(coded['seconds'], coded['lower'], 1, ' s')}, float32 "
                    f"{_bound(plain['seconds'], plain['lower'], 1, ' s')}" + (
                        "" if ratio is None else
                        f": float32 took {_bound(ratio, plain['lower'], 2, 'x')} {tta.CODEC}'s time"), met,
                    f"{tta.CODEC} did not reach 0.88 within its run" if coded["lower"] else
                    f"float32 stopped short of 0.88 before twice {tta.CODEC}'s time" if ratio is None or plain["lower"]
                    else f"float32 took less than twice {tta.CODEC}'s time"))
    sync = found.get((SLOWEST, SYNC))
    if coded and sync and coded.get("bytes") and sync.get("bytes"):
        own = sync["bytes"] / coded["bytes"]
        matched = sync["bytes_per_iteration"] / coded["bytes_per_iteration"]
        met = not coded["lower"] and matched >= BYTES_FEWER and (own >= BYTES_FEWER or sync["lower"])
        out.append(("... and sends at least 100x fewer bytes to reach it than sync would at its bytes an iteration",
                    f"{tta.CODEC} {coded['bytes'] / 1e6:.1f} MB a worker to 0.88; sync "
                    f"{_bound(sync['bytes'] / 1e6, sync['lower'], 0, ' MB')} at its samples to 0.88 "
                    f"({_bound(own, sync['lower'], 0, 'x')}), {matched:.0f}x at {tta.CODEC}'s own "
                    f"samples ({cell(sync['bytes_per_iteration'] / 1e3, 0, ' kB')} against "
                    f"{cell(coded['bytes_per_iteration'] / 1e3, 1, ' kB')} an iteration)", met,
                    "" if met else f"{tta.CODEC} did not reach 0.88 within its run" if coded["lower"] else
                    f"under {BYTES_FEWER:.0f}x"))
    twins, pairs = _loopbacks(accuracy, tta.COMPRESSED_TWIN), _loopbacks(accuracy, tta.COMPRESSED)
    if twins and pairs:
        out.append(_twin_row(pairs, twins))
    return out


def _samples(record):
    """(samples to 0.88, or the last snapshot's where the run stopped short of it; whether it stopped short)."""
    reached = record.get("samples_to_0.88")
    return (reached, False) if reached else (_last(record)[1], True)


def _median(records):
    """The median run's (samples to 0.88, stopped short) of runs alike: one that stopped short of 0.88 ranks above
    every one that reached it (it needed more than it had)."""
    ranked = sorted(map(_samples, records), key=lambda found: (found[1], found[0]))
    middle = ranked[(len(ranked) - 1) // 2:len(ranked) // 2 + 1]  # the middle run, or the two about the middle
    return statistics.mean(n for n, _ in middle), any(short for _, short in middle)


def _twin_row(pairs, twins):
    """The loopback target: the codec's median samples to 0.88 over its runs no more than 10% above its float32
    twin's (the quantization costs no accuracy; fewer is no cost), each run's beside them, with how far apart the
    test accuracy of each run and the other's run made in the same turn was at the snapshots they share."""
    (a, a_short), (b, b_short) = _median(pairs), _median(twins)
    off = None if a_short else a / b - 1  # float32 short of it: a bound
    met = off is not None and off <= SAMPLES_WITHIN
    gaps = []
    for pair, twin in zip(pairs, twins):
        shared = {n: acc for _, n, acc in twin["points"]}
        gaps += [acc - shared[n] for _, n, acc in pair["points"] if n in shared]
    paired = " (each run beside the other's run made in the same turn)" if len(pairs) > 1 else ""
    curves = "" if not gaps else (
        f"; at the {len(gaps)} snapshots both took{paired}, {tta.CODEC}'s test accuracy minus float32's: "
        f"{100 * sum(gaps) / len(gaps):+.2f} points on average, {100 * min(gaps):+.2f} to {100 * max(gaps):+.2f}")

    def each(records):
        return " / ".join(cell(n) if not short else "not in " + cell(n) for n, short in map(_samples, records))

    def median(n, short, records):
        return ("not in " if short else "") + cell(round(n)) + (f" (median of {len(records)}: {each(records)})"
                                                                if len(records) > 1 else "")
    return (f"loopback, base_lr x2: {tta.CODEC}'s samples to 0.88 within 10% of float32's at the same period "
            f"({tta.CODEC_PERIOD}), no more than 10% above them",
            f"{tta.CODEC} {median(a, a_short, pairs)}, float32 {median(b, b_short, twins)}"
            + (f": {100 * off:+.1f}%" + (" or less (float32's median run stopped short)" if b_short else "")
               if off is not None else "")
            + (f" ({tta.CODEC} fewer: a first snapshot at or above 0.88 moves this much between runs alike)"
               if off is not None and off < -SAMPLES_WITHIN else "")
            + f" (snapshots every {cell(pairs[0].get('milestone_samples'))} samples){curves}", met,
            "" if met else f"{tta.CODEC} did not reach 0.88" if a_short else "more than 10% above float32's")


def draw(found, path, key, label, log_y=False, scale=1.0):
    """One line per run of `key` against the link's speed; a hollow marker where the run stopped short (a lower
    bound), dashed where computed. False when nothing can be drawn."""
    series = {}
    for f in found:
        if f.get(key) is not None:
            series.setdefault(f["run"], []).append(f)
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(figsize=(7.5, 4.8))
    for run, points in series.items():
        colour, marker = STYLES.get(run, ("grey", "."))
        points.sort(key=lambda f: f["gbit"])
        axes.plot([f["gbit"] for f in points], [f[key] / scale for f in points], color=colour,
                  linestyle="--" if run == SYNC else "-", label=LABELS.get(run, run))
        for f in points:
            axes.plot(f["gbit"], f[key] / scale, marker="^" if f["lower"] else marker, color=colour,
                      markerfacecolor="none" if f["lower"] else colour, markersize=8)
    axes.set_xscale("log")
    axes.set_xticks([g for g in network.NETWORKS.values()], list(network.NETWORKS))
    axes.minorticks_off()
    if log_y:
        axes.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        axes.yaxis.set_major_formatter(plain)
        axes.yaxis.set_minor_formatter(plain)
    axes.set_xlabel("each node's link (emulated, 0.1 ms one way)")
    axes.set_ylabel(label)
    axes.set_title("LeNet on Fashion-MNIST to 0.88, 2 workers, base_lr x2", fontsize=10)
    axes.legend(fontsize=8, title="hollow ^: stopped short (a lower bound)", title_fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# The codecs and periods the frame sizes are weighed at: the page's runs and the two nearest choices.
WEIGHED = (("float32", 10), ("float32", 64), ("int8", 10), ("int8", 32), ("int4", 16), ("int4", 32))


def why(records, accuracy):
    """Why this codec and period, from the records: the bytes an iteration sync sends over easgd's for each codec
    and period (the frame sizes alone), against what the target asks once easgd's samples to 0.88 over sync's
    are counted."""
    frames = {r["codec"]: r["frame_bytes"] for r in records if r.get("model") == "lenet"
              and r.get("algorithm") == "easgd" and r.get("frame_bytes")}
    plain = frames.get("float32")
    text = (f"The compressed exchange is {tta.CODEC} codes with error feedback at period {tta.CODEC_PERIOD}: the bits "
            "and the period together.")
    if plain is None:
        return text
    weighed = ", ".join(f"{codec} at period {period} {period * plain / frames[codec]:.0f}x"
                        for codec, period in WEIGHED if codec in frames)
    text += (" By the frame sizes alone (a frame a period against sync's float32 frame an iteration), easgd "
             f"sends sync's bytes an iteration over: {weighed}.")
    easgd, sync = _loopback(accuracy, tta.SCALED), _loopback(accuracy, tta.SYNC_SCALED)
    if easgd and sync and easgd.get("samples_to_0.88") and sync.get("samples_to_0.88"):
        more = easgd["samples_to_0.88"] / sync["samples_to_0.88"]
        text += (f" But easgd needs more samples to 0.88 than sync (on loopback at base_lr x2, float32 at period 10: "
                 f"{cell(easgd['samples_to_0.88'])} against {cell(sync['samples_to_0.88'])}, {more:.2f}x, and the "
                 "first snapshot at or above 0.88 moves by tens of thousands of samples from run to run), so 100x "
                 f"fewer bytes to 0.88 asks {100 * more:.0f}x or more an iteration")
        if "int4" in frames:
            half = tta.CODEC_PERIOD // 2 * plain / frames["int4"] / more
            text += (f": at period {tta.CODEC_PERIOD // 2} int4 would send {half:.0f}x fewer to 0.88 at that ratio, "
                     f"{'under' if half < 100 else 'within ' + format(half / 100 - 1, '.0%') + ' of'} the target, "
                     f"and period {tta.CODEC_PERIOD} doubles it")
        text += "."
    return text


def page_section(records, accuracy, data, folder):
    """The section: its targets, the table of the runs to 0.88 on each link, the two plots, how each figure was
    found."""
    found = rows(records, accuracy)
    if not found:
        return missing("the compressed exchange on slow links", "OPENBLAS_NUM_THREADS=1 python bench/network.py "
                       "--only lenet")
    checks = targets(records, accuracy)
    sync_slow = next((f["seconds_per_iteration"] for f in found if f["run"] == SYNC and f["network"] == SLOWEST), None)
    header = ["link", "run", "s / iteration", "exchange share", "sent / iteration", "seconds to 0.88",
              "samples to 0.88", "sent to 0.88", "how"]
    plots = [(os.path.join(folder, "slow_links_seconds.png"), "seconds", "seconds to 0.88 test accuracy", 1.0),
             (os.path.join(folder, "slow_links_bytes.png"), "bytes", "MB a worker sent to 0.88", 1e6)]
    drawn = [f"![{label} against the link's speed]({os.path.basename(path)})"
             for path, key, label, scale in plots if draw(found, path, key, label, True, scale)]
    return "\n\n".join(filter(None, [
        "LeNet, 2 workers, every byte of the exchange through bench/_shaper.py's links, at base_lr x2 (the scaled "
        "rate of the sections above). " + why(records, accuracy),
        table(["target", "measured", "met", "why not"],
              [[t, m, "yes" if ok else "**no**", "" if ok else why] for t, m, ok, why in checks]) if checks else None,
        table(header, table_rows(found, records)),
        "\n\n".join(drawn) or None,
        "Sent is what a worker's exchanges sent (its model frames, headers and tags: its summary line's exchanges "
        "at the codec's frame size, over its iterations); to 0.88, that an iteration times the iterations the run "
        "took to its first snapshot at or above 0.88. Sent in all (the summary line's own figure) adds the solver "
        "history a worker sends at each snapshot, float32 whatever the codec: the benchmark snapshots every "
        "~15,000 samples to test each afterwards, where a job snapshotting as Caffe's solvers do (every 5,000 "
        "iterations) sends one or two; at 100 Mbit/s the histories are also on its clock. Sync is not run to "
        "0.88 on the slow links (" + (f"{cell(sync_slow, 2, ' s')} an iteration at 100 Mbit/s here" if sync_slow
                                      else "too slow an iteration at 100 Mbit/s") +
        "): its rows are computed, its samples to 0.88 "
        f"on loopback at base_lr x2 (`{tta.SYNC_SCALED}`, bench/time_to_accuracy.py) times its seconds and bytes "
        "an iteration measured on that link, training alone (no start-up: the measured rows hold a few seconds "
        "of it). Average moves its float32 models through Spark: its bytes are S each way a round; its one "
        "loopback run is timed on each link by the model. \"> x\": the run stopped short of 0.88 and x is how "
        f"far it went. From `{os.path.relpath(data, network.ROOT)}/network.jsonl` and `time_to_accuracy.jsonl`."]))
