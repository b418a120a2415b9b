"""The peak memory of a whole process tree (a driver, its JVM, its Python workers), as the sum of each process's PSS, sampled while it runs: what the benchmarks compare jobs and peers by."""

import os
import threading
import time

from deepspark.spark.daemon import WAITER_MARK

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


def role(pid, root):
    """What a process of a Spark job's tree is, by its command line: the driver (`root`), its JVM, the
    pyspark daemon (the JVM's Python child, which forks the workers) or a Python worker."""
    if pid == root:
        return "driver"
    argv = _argv(pid)
    if not argv:
        return "other"
    name = os.path.basename(argv[0].decode(errors="replace"))
    if name == "java":
        return "JVM"
    if name.startswith("python"):
        # The daemon runs `-m pyspark.daemon` (or the module spark.python.daemon.module names) and its forks keep
        # that command line: the daemon is the one whose parent is not a daemon. Without a daemon, a worker runs
        # `-m pyspark.worker`. Ours (deepspark/spark/daemon.py) is a zygote's fork (`--zygote` in its command line,
        # the driver's child), and the process the JVM launched waits for it: the three are the daemon.
        parent = _parent(pid)
        if WAITER_MARK.encode() in argv or (_is_zygote(pid) and not _is_zygote(_parent(parent))):
            return "pyspark daemon"  # the waiter, the zygote or its fork the daemon; the daemon's forks are workers
        if _is_daemon(pid) and not (parent is not None and _is_daemon(parent)):
            return "pyspark daemon"
        return "Python worker"
    return "other"


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return int(stream.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _argv(pid):
    """A process's command line as bytes; [] when it is gone (or `pid` is None)."""
    if pid is None:
        return []
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as stream:
            return stream.read().split(b"\0")
    except OSError:
        return []


def _is_zygote(pid):
    return b"--zygote" in _argv(pid)


def _is_daemon(pid):
    argv = _argv(pid)
    if b"-m" not in argv or not os.path.basename(argv[0].decode(errors="replace")).startswith("python"):
        return False
    module = argv[argv.index(b"-m") + 1] if argv.index(b"-m") + 1 < len(argv) else b""
    return not module.endswith(b".worker")


def _resident_ranges(pid):
    """The [start, end) address ranges of a process's mappings that have pages in memory (from smaps)."""
    ranges, current = [], None
    with open(f"/proc/{pid}/smaps") as stream:
        for line in stream:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = head.split("-")
                current = (int(start, 16), int(end, 16))
            elif line.startswith("Rss:") and int(line.split()[1]) > 0:
                ranges.append(current)
    return ranges


def _frames(pid):
    """The physical page frames a process has in memory (/proc/PID/pagemap; root only), as a numpy array."""
    import numpy as np

    page, found = os.sysconf("SC_PAGE_SIZE"), []
    with open(f"/proc/{pid}/pagemap", "rb") as stream:
        for start, end in _resident_ranges(pid):
            stream.seek(start // page * 8)
            entries = np.frombuffer(stream.read((end - start) // page * 8), np.uint64)
            present = entries[(entries >> np.uint64(63)) == 1]
            found.append(present & np.uint64((1 << 55) - 1))
    return np.concatenate(found) if found else np.empty(0, np.uint64)


def alone_mb(pids):
    """{pid: MB}: each process's PSS as if these processes were alone on the machine (a page shared by k of them
    counts 1/k to each; by any other process, not at all), whose sum is what they hold together. The PSS that
    smaps gives also splits a page with processes outside the tree (another job's TensorFlow maps the same
    libraries), so a busy machine lowers it; this does not. None where page frames cannot be read (not root)."""
    import numpy as np

    frames, kept = [], []
    for pid in pids:
        try:
            frames.append(_frames(pid))
            kept.append(pid)
        except PermissionError:
            return None
        except OSError:  # gone meanwhile
            continue
    if not frames:
        return {}
    every = np.concatenate(frames)
    if every.size and not every.any():  # frame numbers read as 0: no CAP_SYS_ADMIN
        return None
    _, inverse, counts = np.unique(every, return_inverse=True, return_counts=True)
    owner = np.repeat(np.arange(len(kept)), [len(f) for f in frames])
    shares = np.bincount(owner, weights=1.0 / counts[inverse], minlength=len(kept))
    return {pid: float(share) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20 for pid, share in zip(kept, shares)}


# Seconds between two alone_mb samples at least: one costs ~0.1-0.3 s of a core for a Spark job's tree.
ALONE_SECONDS = 1.0


class PeakPssByRole(PeakPss):
    """PeakPss that also keeps, at the sample where the tree's sum peaked, each role's PSS (role(): driver, JVM,
    pyspark daemon, Python worker, other; the workers summed): `at_peak` {role: MB}, `counts` {role: processes};
    each role's own peak over the run, `role_peaks` {role: MB}; and with `alone`, alone_mb's sum at its peak,
    `alone_peak_mb` (None where page frames cannot be read), and `alone_at_peak` {role: MB}, sampled at most
    every ALONE_SECONDS while the tree's PSS is within 5% of its peak so far."""

    def __init__(self, pid, alone=False):
        self.at_peak, self.counts, self.role_peaks = {}, {}, {}
        self.alone_peak_mb, self.alone_at_peak = (0.0 if alone else None), {}
        self._alone_last = 0.0
        super().__init__(pid)

    def _run(self):
        while not self._stop.wait(SAMPLE_SECONDS):
            pids = tree(self.pid)
            sums, counts = {}, {}
            for p in pids:
                name = role(p, self.pid)
                sums[name] = sums.get(name, 0.0) + pss_mb(p)
                counts[name] = counts.get(name, 0) + 1
            for name, mb in sums.items():
                self.role_peaks[name] = max(self.role_peaks.get(name, 0.0), mb)
            total = sum(sums.values())
            if total > self.peak_mb:
                self.peak_mb, self.at_peak, self.counts = total, sums, counts
            if self.alone_peak_mb is not None and total >= 0.95 * self.peak_mb:
                self._sample_alone(pids)

    def _sample_alone(self, pids):
        now = time.monotonic()
        if now - self._alone_last < ALONE_SECONDS:
            return
        self._alone_last = now
        alone = alone_mb(pids)
        if alone is None:
            self.alone_peak_mb = None
            return
        roles = {}
        for p, mb in alone.items():
            roles[role(p, self.pid)] = roles.get(role(p, self.pid), 0.0) + mb
        if sum(roles.values()) > self.alone_peak_mb:
            self.alone_peak_mb, self.alone_at_peak = sum(roles.values()), roles
