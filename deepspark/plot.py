"""Loss and test outputs against wall-clock time, from a run's history or from any training log."""

import datetime
import re

import numpy as np

from deepspark.errors import ConfigError

LINE = re.compile(r"^[IWEF](\d{4} \d\d:\d\d:\d\d\.\d+) \S+ \S+\] (.*)$")
TRAIN = re.compile(r"Iteration (\d+)(?: \([^)]*\))?, loss = ([-+\w.]+)")
TESTING = re.compile(r"Iteration (\d+), Testing net \(#(\d+)\)")
OUTPUT = re.compile(r"Test net output #\d+: (\S+) = ([-+\w.]+)")


def parse_log(lines):
    """History entries (seconds, iteration, loss, {test output: value}) from Caffe-style log lines."""
    history, start, testing = [], None, None
    for line in lines:
        match = LINE.match(line.rstrip("\n"))
        if not match:
            continue
        when = datetime.datetime.strptime(match.group(1), "%m%d %H:%M:%S.%f")
        start = when if start is None else start
        seconds, message = (when - start).total_seconds(), match.group(2)
        if (m := TESTING.search(message)):
            testing = (int(m.group(1)), m.group(2))
            history.append((seconds, testing[0], float("nan"), {}))
        elif (m := OUTPUT.search(message)) and testing is not None and history:
            history[-1][3][f"test{testing[1]}/{m.group(1)}"] = float(m.group(2))
        elif (m := TRAIN.search(message)):
            testing = None
            history.append((seconds, int(m.group(1)), float(m.group(2)), {}))
    return history


def plot_history(history, path, title="training"):
    """A PNG with the training loss and each test output against seconds."""
    # A Figure of its own, not pyplot's: a fit in a notebook leaves the user's backend (inline plots) as it was.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 6))
    top, bottom = figure.subplots(2, 1, sharex=True)
    train = [(t, loss) for t, _, loss, _ in history if np.isfinite(loss)]
    if train:
        top.plot(*zip(*train), label="train loss")
    tests = {}
    for t, _, _, values in history:
        for name, value in values.items():
            tests.setdefault(name, []).append((t, value))
    for name, points in sorted(tests.items()):
        (top if "loss" in name else bottom).plot(*zip(*points), marker="o", label=name)
    top.set_ylabel("loss")
    bottom.set_ylabel("test output")
    bottom.set_xlabel("wall-clock seconds")
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(loc="best")
    top.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def plot_log(path, output):
    """`deepspark plot`: loss and test outputs against time from a Caffe-style training log at `path`, as a PNG."""
    try:
        with open(path, encoding="utf-8") as stream:
            history = parse_log(stream)
    except OSError as error:
        raise ConfigError(f"cannot read the log: {error.strerror}", path) from None
    if not history:
        raise ConfigError("no 'Iteration N, loss = L' or test output lines in this log", path)
    return plot_history(history, output, title=path)
