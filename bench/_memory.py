"""The peak memory of a whole process tree (a driver, its JVM, its Python workers), as the sum of each process's PSS, sampled while it runs: what the benchmarks compare jobs and peers by."""

import os
import threading

# Seconds between two samples: a Spark job's processes live for seconds at least.
SAMPLE_SECONDS = 0.25


def tree(pid):
    """`pid` and every process below it, from /proc's parent links."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stream:
                parent = int(stream.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(children.get(current, ()))
    return found


def pss_mb(pid):
    """A process's proportional set size in MB (shared pages split among their users); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as stream:
            for line in stream:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class PeakPss:
    """Samples the PSS of `pid`'s whole tree every SAMPLE_SECONDS until stopped; `peak_mb` is the largest sum."""

    def __init__(self, pid):
        self.pid, self.peak_mb = pid, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-pss")
        self._thread.start()

    def _run(self):
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak_mb = max(self.peak_mb, sum(pss_mb(p) for p in tree(self.pid)))

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.peak_mb
