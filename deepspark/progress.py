"""A training job's progress, one display with one interface for every run (the single run, every Spark job, fit):
`display(workers, max_iter, batch_size)` gives an object whose draw(stats, lost) takes each worker's
{"iteration", "loss", ...} and whose close() ends it. What it draws depends on where the console is:

- a terminal: live rows below the log lines (the current log.Log's progress line), one per worker (a bar for the
  single run);
- a running Jupyter kernel with ipywidgets: one tqdm widget per worker that updates in place;
- anything else (a CI log, a captured stderr, a kernel without ipywidgets): whole log lines, every tenth of the job
  and at its end, with no cursor codes.

tqdm is the notebooks' usual progress library, already a dependency, with no dependencies of its own: its
tqdm.notebook draws an ipywidgets bar per worker. Its text bar is for terminals: in a notebook each redraw becomes a
new line and its cursor moves (`\\x1b[A`, `\\r`) show as text that log lines glue onto, and tqdm.auto falls back to
it (with an "IProgress not found" warning) where ipywidgets is missing; hence the plain lines there.
"""

import importlib.util
import sys
import time

import numpy as np

from deepspark import log

# The lines of a job without a live progress display: one each time the slowest worker passes another tenth of
# max_iter, and one at the end (a notebook cell of a long fit stays ten lines long, however many iterations).
LINES_PER_JOB = 10


def in_notebook():
    """Whether this process runs a Jupyter kernel now: IPython's running shell has a kernel (ipykernel's
    ZMQInteractiveShell, its stderr no terminal, a widget draws). Not whether ipykernel is imported: pyspark imports
    it, and a plain script in a venv that has it would draw widgets nobody sees (a bar frozen at 0%)."""
    ipython = sys.modules.get("IPython")  # a kernel has imported it; looking does not import it where none runs
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def has_widgets():
    """Whether ipywidgets imports in this process (what tqdm.notebook draws with); a None in sys.modules (an import
    blocked on purpose) counts as missing."""
    if "ipywidgets" in sys.modules:
        return sys.modules["ipywidgets"] is not None
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):
        return False


def display(workers, max_iter, batch_size=0, exchanges=True):
    """The progress display on the console of the Log that this thread's records go to (log.current(); module
    docstring): a run with no `exchanges` (the single run) a Bar,
    drawn on a terminal alone (elsewhere its Caffe display lines say how it goes, one each `display` iterations);
    a job's workers WorkerBars in a notebook with ipywidgets, else Rows on a terminal, else Lines."""
    if not exchanges:
        return Bar(max_iter)
    if in_notebook() and has_widgets():
        return WorkerBars(workers, max_iter, batch_size)
    if log.current().progress_enabled:
        return Rows(workers, max_iter)
    return Lines(workers, max_iter, batch_size)


class Rates:
    """Each worker's images/s since its first report."""

    def __init__(self, workers, batch_size):
        self.batch_size = batch_size
        self.seen = [None] * workers  # (time, iteration) of each worker's first report

    def of(self, worker, iteration, now):
        if self.seen[worker] is None:
            self.seen[worker] = (now, iteration)
        since, first = self.seen[worker]
        return (iteration - first) * self.batch_size / (now - since) if now > since else 0.0


def worker_note(stats, rate, lost):
    """`loss 1.2345, 3,200 img/s` (and `, lost, to rejoin`) of one worker's stats."""
    loss = stats.get("loss", float("nan"))
    note = f"loss {loss:.4f}" if np.isfinite(loss) else "loss -"  # none reported yet
    return note + f", {rate:,.0f} img/s" + (", lost, to rejoin" if lost else "")


class WorkerBars:
    """One tqdm bar per worker, moved to the iteration the exchanger's stats say: ipywidgets bars in a notebook, or
    tqdm's text bar into `file` where one is given."""

    def __init__(self, workers, max_iter, batch_size, file=None):
        if file is None:
            from tqdm.notebook import tqdm  # widgets: display checked that ipywidgets imports
        else:
            from tqdm import tqdm  # text into `file`
        self.rates = Rates(workers, batch_size)
        self.bars = [tqdm(total=max_iter, desc=f"w{worker}", position=worker, unit="it", leave=True, file=file,
                          mininterval=0, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                          "[{elapsed}<{remaining}{postfix}]") for worker in range(workers)]

    def draw(self, stats, lost=(), iteration=None):
        """Each worker's bar at its iteration, with its loss and images/s; `lost`: workers lost before they ended."""
        now = time.monotonic()
        for worker, bar in enumerate(self.bars):
            s = stats.get(worker)
            if not s:
                continue
            iteration = min(s.get("iteration", 0), bar.total)
            bar.set_postfix_str(worker_note(s, self.rates.of(worker, iteration, now), worker in lost), refresh=False)
            bar.update(iteration - bar.n)

    def close(self):
        for bar in self.bars:
            bar.close()


class Lines:
    """The workers' progress as whole log lines on the console (not the log file): `Progress: iteration 200 of 1000
    (20%, ETA 41s): w0 loss 0.5123, 3,200 img/s | w1 ...` each time the job's iteration passes another
    1/LINES_PER_JOB of max_iter, and at the end. The job's iteration is the one draw() is given (an easgd job's:
    its workers' iterations trained together, so neither a straggler nor a worker that left holds the lines), else
    the slowest worker's once every worker has reported (workers that train in step)."""

    def __init__(self, workers, max_iter, batch_size):
        self.log, self.workers, self.max_iter = log.current(), workers, max_iter
        self.every = max(1, -(-max_iter // LINES_PER_JOB))
        self.rates = Rates(workers, batch_size)
        self.started = time.monotonic()
        self.next = self.every
        self.last = None  # (iteration, notes) of the last draw, for the line at the end
        self.said = -1  # the iteration of the last line

    def draw(self, stats, lost=(), iteration=None):
        now = time.monotonic()
        notes = {w: worker_note(s, self.rates.of(w, min(s.get("iteration", 0), self.max_iter), now), w in lost)
                 for w, s in stats.items() if s}
        ready = iteration is not None or len(notes) == self.workers
        if iteration is None:
            iteration = min((s.get("iteration", 0) for s in stats.values() if s), default=0)
        iteration = min(iteration, self.max_iter)
        if notes:
            self.last = (iteration, notes)
        if ready and iteration >= self.next:
            self.say(iteration, notes, now)

    def say(self, iteration, notes, now):
        self.next = (iteration // self.every + 1) * self.every
        if iteration == self.said:
            return
        self.said = iteration
        rate = iteration / (now - self.started) if now > self.started else 0.0
        eta = f", ETA {(self.max_iter - iteration) / rate:.0f}s" if 0 < iteration < self.max_iter and rate else ""
        rows = " | ".join(f"w{w} {notes[w]}" if w in notes else f"w{w} not training" for w in range(self.workers))
        self.log.console(f"Progress: iteration {iteration} of {self.max_iter} ({100 * iteration / self.max_iter:.0f}%"
                         f"{eta}): {rows}")

    def close(self):
        """The line at the end, where the last one said less."""
        if self.last is not None:
            self.say(*self.last, time.monotonic())


class Rows:
    """Per-worker rows on a terminal, the current Log's live line (log.Log.progress), which other lines print above:
    iteration, loss, exchanges, seconds since the last exchange."""

    def __init__(self, workers, max_iter):
        self.log, self.workers, self.max_iter = log.current(), workers, max_iter

    def draw(self, stats, lost=(), iteration=None):
        """The row of each worker from the exchanger's stats; `lost`: the workers lost before they finished."""
        rows = []
        for worker in range(self.workers):
            s = stats.get(worker)
            if not s:
                rows.append(f"w{worker}: waiting")
                continue
            loss = s.get("loss", float("nan"))
            since = s.get("seconds_since_exchange")
            latency = s.get("latency")
            loss = f"{loss:.4f}" if np.isfinite(loss) else "-"  # none reported yet
            rows.append(f"w{worker}: it {s.get('iteration', 0)}/{self.max_iter} loss {loss} "
                        f"ex {s.get('exchanges', 0)}"
                        + (f" ({1e3 * latency:.1f} ms, {since:.1f}s ago)" if since is not None and latency else "")
                        + (" lost, to rejoin" if worker in lost else ""))
        self.log.progress(" | ".join(rows))

    def close(self):
        self.log.end_progress()


class Bar:
    """The single run's live bar on a terminal: `[=====>    ] 1200/10000  312 it/s  ETA 28s  loss 0.1234`."""

    def __init__(self, max_iter):
        self.log, self.max_iter, self.started = log.current(), max_iter, time.monotonic()

    def draw(self, stats, lost=(), iteration=None):
        s = stats.get(0) or {}
        loss = s.get("loss", float("nan"))
        self.log.progress(bar_text(s.get("iteration", 0), self.max_iter, started=self.started,
                                   extra=f"loss {loss:.4f}" if np.isfinite(loss) else ""))

    def close(self):
        self.log.end_progress()


def bar_text(done, total, width=30, started=None, extra=""):
    """`[=====>    ] 1200/10000  312 it/s  ETA 28s  extra`."""
    fraction = min(done / total, 1.0) if total else 1.0
    filled = int(fraction * width)
    bar = "=" * filled + (">" if filled < width else "") + " " * (width - filled - 1)
    text = f"[{bar[:width]}] {done}/{total}"
    if started is not None and done:
        elapsed = time.monotonic() - started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else 0.0
        text += f"  {rate:.1f} it/s  ETA {eta:.0f}s"
    return text + (f"  {extra}" if extra else "")
