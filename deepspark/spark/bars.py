"""A training job's progress as one bar per worker (iteration of max_iter, loss, images/s, ETA) drawn by tqdm: a
widget in a Jupyter notebook, a text bar elsewhere.

tqdm is the notebooks' usual progress library: tqdm.auto picks its Jupyter widget in a kernel (the text bar where
ipywidgets is missing) and the text bar on a terminal, and it has no dependencies of its own. A terminal keeps the
job's own progress line (log.Log.progress), which other processes' lines print above; a notebook's stderr is no
terminal, and there the bars are what shows the job going.
"""

import sys
import time

import numpy as np


def in_notebook():
    """Whether this process is a Jupyter kernel (where stderr is not a terminal, and a widget draws)."""
    return "ipykernel" in sys.modules


class WorkerBars:
    """One tqdm bar per worker, moved to the iteration the exchanger's stats say; `file`: where a text bar draws
    (None: tqdm's choice, stderr)."""

    def __init__(self, workers, max_iter, batch_size, file=None):
        if file is None:
            from tqdm.auto import tqdm  # a widget in a notebook, text elsewhere
        else:
            from tqdm import tqdm  # text into `file`
        self.batch_size = batch_size
        self.bars = [tqdm(total=max_iter, desc=f"w{worker}", position=worker, unit="it", leave=True, file=file,
                          mininterval=0, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                          "[{elapsed}<{remaining}{postfix}]") for worker in range(workers)]
        self.seen = [None] * workers  # (time, iteration) of each worker's first report

    def draw(self, stats, lost=()):
        """Each worker's bar at its iteration, with its loss and images/s; `lost`: workers lost before they ended."""
        now = time.monotonic()
        for worker, bar in enumerate(self.bars):
            s = stats.get(worker)
            if not s:
                continue
            iteration = min(s.get("iteration", 0), bar.total)
            if self.seen[worker] is None:
                self.seen[worker] = (now, iteration)
            since, first = self.seen[worker]
            rate = (iteration - first) * self.batch_size / (now - since) if now > since else 0.0
            loss = s.get("loss", float("nan"))
            postfix = f"loss {loss:.4f}" if np.isfinite(loss) else "loss -"
            postfix += f", {rate:,.0f} img/s" + (", lost, to rejoin" if worker in lost else "")
            bar.set_postfix_str(postfix, refresh=False)
            bar.update(iteration - bar.n)

    def close(self):
        for bar in self.bars:
            bar.close()
