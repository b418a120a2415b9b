"""The center x̃ on the driver at Caffe's cadence: the display line, the tests on the solver's test nets, the snapshots (with the workers' solver histories), TensorBoard's scalars and the plot's points."""

import concurrent.futures
import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
import types

import numpy as np

from deepspark import checkpoint, engine, nets
from deepspark.plot import plot_history

log = logging.getLogger(__name__)

# Seconds a snapshot waits at most for the training workers' solver histories (each sends its own at its
# next exchange, a period's steps away); one not in time goes in as it last sent it, and the log says so.
HISTORY_SECONDS = 10.0
# tensorboard's switch (a module by this name, importable) that makes it write through its own stand-in for
# TensorFlow, which it otherwise imports to write an event file.
TENSORBOARD_WITHOUT_TF = "tensorboard.compat.notf"


class Scalars:
    """TensorBoard scalars (loss, test outputs, learning rate, exchange latency), when tensorboard is installed."""

    def __init__(self, folder):
        try:
            from tensorboard.summary import Writer
        except ImportError:
            log.warning("tensorboard is not installed; no TensorBoard scalars")
            self.writer = None
            return
        if "tensorflow" in sys.modules:
            self.writer = Writer(folder)
            return
        # A driver that has not loaded TensorFlow (no test nets yet) does not load it for a file of scalars: it
        # would hold TensorFlow's memory all job long (bench/startup.py). tensorboard reads the switch once, as
        # this first writer opens its file; it is taken down after.
        switched = TENSORBOARD_WITHOUT_TF not in sys.modules
        if switched:
            sys.modules[TENSORBOARD_WITHOUT_TF] = types.ModuleType(TENSORBOARD_WITHOUT_TF)
        try:
            self.writer = Writer(folder)
        finally:
            if switched:
                del sys.modules[TENSORBOARD_WITHOUT_TF]

    def add(self, tag, value, step):
        if self.writer is not None and np.isfinite(value):
            self.writer.add_scalar(tag, float(value), int(step))

    def close(self):
        if self.writer is not None:
            self.writer.close()


def lower_priority(nice):
    """This thread's nice raised to `nice` (never lowered: that needs privileges), on Linux, where nice is per
    thread and the threads it starts from now on inherit it; the nice it runs at."""
    tid = threading.get_native_id()
    nice = max(nice, os.getpriority(os.PRIO_PROCESS, tid))
    os.setpriority(os.PRIO_PROCESS, tid, nice)
    return nice


class DriverTests:
    """How the driver's test passes run: the test nets built in a thread of their own at the solver's test_nice
    (DeepSparkParameter), so that the threads their backend starts there (TensorFlow's test_threads intra- and
    inter-op threads, which compute the passes) inherit that priority and yield the cores to the workers; the
    passes run in the caller, as Caffe's Test() blocks its Solve, at the driver's priority: a Python thread at a
    lower one would hold the GIL the exchanger's threads wait for while it waits for a core (it slowed the workers
    here). A backend whose threads started before (TensorFlow run earlier in this process, OpenBLAS's at its load)
    keeps theirs, and the line says so. seconds and cpu: the passes' wall time and their threads' CPU time."""

    def __init__(self, ds):
        self.nice, self.threads = ds.test_nice if sys.platform.startswith("linux") else 0, ds.test_threads
        self.started = []  # the threads the build started (Linux thread ids): the passes' compute
        self.base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if self.nice else 0  # the caller's
        self.passes, self.seconds, self.cpu = 0, 0.0, 0.0

    def build(self, work):
        """work(), the test nets' build, in a thread of its own at nice (in the caller at 0), in the caller's
        context, whose run's log (log.py) its lines go to."""
        if not self.nice:
            return work()
        def lowered():
            self.nice = lower_priority(self.nice)
            return work()
        before = set(os.listdir("/proc/self/task"))
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deepspark-tests") as pool:
            built = pool.submit(contextvars.copy_context().run, lowered).result()
        # Those it started (the pool's own has ended); not one another thread started meanwhile, at its own nice.
        self.started = [int(t) for t in set(os.listdir("/proc/self/task")) - before if self.at_nice(int(t))]
        return built

    def at_nice(self, tid):
        try:
            return os.getpriority(os.PRIO_PROCESS, tid) == self.nice
        except OSError:  # ended since
            return False

    def line(self):
        threads = f"{self.threads} thread{'s' * (self.threads != 1)}" if self.threads else "the backend's threads"
        where = (f"at nice {self.nice}" if self.started else
                 f"at the driver's priority{' (the backend started its threads before)' if self.nice else ''}")
        return f"Tests: on the driver {where}, {threads}"

    def thread_cpu(self):
        """The CPU seconds of the threads the build started, as /proc has them."""
        ticks = 0
        for tid in self.started:
            try:
                with open(f"/proc/self/task/{tid}/stat") as stream:
                    fields = stream.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # ended since
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def timed(self, work, *args):
        """work(*args), its wall and CPU time counted as a test pass's."""
        started, cpu = time.monotonic(), time.thread_time() + self.thread_cpu()
        result = work(*args)
        self.passes, self.seconds = self.passes + 1, self.seconds + time.monotonic() - started
        self.cpu += time.thread_time() + self.thread_cpu() - cpu
        return result

    def close(self):
        """The threads the build started back at the caller's priority, where this process may raise it again
        (root, or RLIMIT_NICE): they serve whatever runs TensorFlow in this process after the job (a notebook's
        next cell, the next test); elsewhere they keep test_nice."""
        for tid in self.started:
            with contextlib.suppress(OSError):  # PermissionError, or the thread has ended
                os.setpriority(os.PRIO_PROCESS, tid, self.base)
        self.started = []

    def cost(self, wall):
        """The log's line of what the passes cost, over a job of `wall` seconds."""
        return (f"Tests: {self.passes} pass{'es' * (self.passes != 1)} on the driver took {self.seconds:.1f} s "
                f"({self.seconds / max(wall, 1e-9):.1%} of the job's {wall:.0f} s), {self.cpu:.1f} s of CPU")


class CenterCadence:
    """Caffe's display, test and snapshot on x̃, at the iterations Caffe's Solver would.

    solver: the config.Solver; graph: its train net (x̃'s parameter order); start: the
    job's first iteration; read(): x̃ as one float32 vector; server: the ExchangeServer
    that holds the workers' solver histories (None: a job without one); history_sets:
    the solver's (schedule.history_sets); history_seconds: how long a snapshot waits for
    them; started: the job's time.monotonic() start, the plot's zero.
    """

    def __init__(self, solver, graph, start, read, *, server=None, history_sets=1,
                 history_seconds=HISTORY_SECONDS, started=None):
        self.solver, self.param, self.graph, self.read = solver, solver.param, graph, read
        self.multiples = engine.Cadence(solver.param, start)
        self.server, self.history_sets = server, history_sets
        self.scalars = None  # start() opens them
        self.history_seconds = history_seconds
        self.started = time.monotonic() if started is None else started
        # What the log says, as it says it: {"iteration", "seconds" (since `started`), "loss" (nan for a test),
        # "test<i>/<output>": value}, the job's history and the plot's points.
        self.history = []
        self.snapshots = []  # (caffemodel, solverstate) of each snapshot, in order
        self.snapshot_arrays = None  # (iteration, x̃'s arrays) of the last snapshot, as written
        # Iterations of the last test and snapshot, and the last test's outputs.
        self.tested, self.snapshotted, self.last_test_values = None, None, {}
        self.evaluator = None  # the test nets: test_nets() builds them
        self.passes = None  # where the test passes run (DriverTests): start() or test_nets() sets it up
        self.initial = None  # x̃ as the job starts, while Caffe's test of the start iteration is owed: start() keeps it
        self.observed = start  # the job's iteration when the driver last looked (observe)

    def start(self, folder):
        """The test nets, when the solver tests, and TensorBoard's scalars in `folder`. The test nets load
        TensorFlow into the driver and hold it all job long (bench/startup.py): a job without test_interval
        never tests, and never builds them; the scalars then write without it."""
        if self.param.test_interval:
            self.test_nets()
            log.info(self.passes.line())
            if self.multiples.next_test == self.multiples.start:  # test_initialization: Caffe tests x̃ as it starts
                self.initial = self.read().copy()
        self.scalars = Scalars(folder)

    def test_nets(self):
        """The driver's test nets (an engine.Evaluator), built at the first call."""
        if self.evaluator is None:
            if self.passes is None:
                self.passes = DriverTests(self.param.deepspark_param)
            self.evaluator = self.passes.build(self.build_evaluator)
        return self.evaluator

    def build_evaluator(self):
        nets.place(self.solver)  # the driver's device, before its backend builds a net
        return nets.evaluator(self.solver, self.passes.threads or None)

    def close(self):
        if self.scalars is not None:
            self.scalars.close()
        if self.passes is not None:
            if self.passes.passes:
                log.info(self.passes.cost(time.monotonic() - self.started))
            self.passes.close()
            self.passes = None
        if self.evaluator is not None:
            self.evaluator.close()
            self.evaluator = None

    def display(self, iteration, loss):
        """Caffe's `Iteration N, loss = L` line and the train scalars, once `iteration` reaches the next
        display multiple; True when shown."""
        if not (np.isfinite(loss) and self.multiples.display_due(iteration)):
            return False
        log.info(f"Iteration {iteration}, loss = {loss:.6g}")
        self.scalars.add("train/loss", loss, iteration)
        self.scalars.add("train/learning_rate", self.multiples.learning_rate(iteration), iteration)
        self.history.append(engine.entry(self.started, iteration, float(f"{loss:.6g}")))  # as the line says it
        return True

    def observe(self, iteration, loss):
        """The driver loop's step, every algorithm's: the job is at `iteration` (the exchanger's handler counts it:
        easgd's, the workers' iterations together / workers; sync's and average's, their round's) and the workers'
        loss is `loss` (their mean): Caffe's display when due, then the tests and snapshots due; True when the
        display was shown."""
        self.observed = max(self.observed, iteration)
        shown = self.display(iteration, loss)
        self.due(iteration)
        return shown

    def due(self, iteration):
        """Test and snapshot x̃ once `iteration` reaches the next test_interval / snapshot multiple.

        Workers run on while the driver watches, so the job may already be past
        the multiple when it is seen; the test and the snapshot carry the multiple's
        number, as Caffe's do (lenet_iter_5000), and a line says where the job was.
        """
        tested = self.multiples.test_due(iteration)
        if tested is not None and self.initial is not None:
            # The start's test is of x̃ as the job started, whenever the driver first sees the workers (a short job
            # may be past the next multiple by then, and x̃ has moved since the start).
            initial, self.initial = self.initial, None
            self.test(self.multiples.start, flat=initial)
            if tested == self.multiples.start:
                tested = None
        if tested is not None:
            self.test(tested, observed=iteration)
        snapshotted = self.multiples.snapshot_due(iteration)
        if snapshotted is not None:
            self.snapshot(snapshotted, observed=iteration)

    def arrays(self, flat=None):
        """x̃ (or `flat`, a copy of it) as the train net's parameter arrays."""
        flat = self.read() if flat is None else flat
        sizes = [int(np.prod(p.shape)) for p in self.graph.params]
        offsets = np.cumsum([0] + sizes)
        return [flat[a:b].reshape(p.shape) for p, a, b in zip(self.graph.params, offsets, offsets[1:])]

    def _note_observed(self, what, iteration, observed):
        if observed is not None and observed != iteration:
            log.info(f"{what} x̃ as iteration {iteration}; the job is at iteration {observed}")

    def test(self, iteration, observed=None, flat=None):
        self.tested = iteration
        self._note_observed("Testing", iteration, observed)
        evaluator = self.test_nets()
        results = self.passes.timed(evaluator.test, iteration, self.graph, self.arrays(flat))
        values = engine.first_values(results)
        for tag, value in values.items():
            self.scalars.add(tag, value, iteration)
        self.history.extend(engine.test_entries(self.started, iteration, results))
        self.last_test_values = values
        return values

    def snapshot(self, iteration, observed=None):
        """x̃ as Caffe's snapshot of `iteration`, beside the workers' own solver histories; the model's path.

        The center's own solver state: x̃ moves by elastic differences, not by a solver
        of its own, so its history is zeros, one blob per parameter and history set, as
        Caffe's restore expects; each worker's own goes beside it, for a resume of this
        job (Caffe's restore skips them).
        """
        self.snapshotted = iteration
        self._note_observed("Snapshotting", iteration, observed)

        def state_of(model_path):
            # x̃ was written first, as read: its line is when it was taken (time-to-accuracy reads it), not after
            # the wait for the workers' histories, which only the solver state holds.
            workers = self.worker_states()
            history = [np.zeros(p.shape, np.float32) for p in self.graph.params] * self.history_sets
            state = checkpoint.solver_state(iteration, history=history, learned_net=model_path)
            state.worker_state.extend(workers)
            return state, (f" (with the solver history of {len(workers)} workers)" if workers else "")

        arrays = self.arrays()
        paths = engine.write_snapshot(self.param.snapshot_prefix, iteration, self.graph, arrays, state_of,
                                      engine.hdf5_snapshots(self.param))
        self.snapshots.append(paths)
        self.snapshot_arrays = (iteration, arrays)
        return paths[0]

    def worker_states(self):
        """The workers' solver histories for a snapshot (WorkerSolverStates): each training worker is asked
        for its own and sends it at its next exchange; a worker that has finished sent its last. Waits
        history_seconds at most; a worker not in time goes in with the last it sent, and a line says so."""
        if self.server is None or not self.server.stats():
            return []
        request = self.server.request_histories()
        deadline = time.monotonic() + self.history_seconds
        while True:
            answered = self.server.histories(since=request)
            waiting = [w for w, s in self.server.stats().items() if s["connected"] and w not in answered]
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        held = self.server.histories()
        if waiting:
            log.warning(f"worker(s) {', '.join(map(str, waiting))} sent no solver history within "
                        f"{HISTORY_SECONDS:g}s; the snapshot keeps the last each sent "
                        f"({', '.join(f'iteration {held[w].iteration}' if w in held else 'none' for w in waiting)})")
        shapes = [tuple(p.shape) for p in self.graph.params]
        return [checkpoint.worker_state(w, h.iteration, h.current_step, h.vector, shapes)
                for w, h in sorted(held.items())]

    def finish(self, final):
        """Caffe's end of Solve on x̃ at the `final` iteration: its snapshot (snapshot_after_train) and its
        test, unless done there already; (the final .caffemodel if snapshotted there, the last test values,
        x̃'s final arrays: as that snapshot wrote them, else as x̃ is now)."""
        if self.param.snapshot_after_train and self.snapshotted != final:
            self.snapshot(final)
        weights = (checkpoint.snapshot_paths(self.param.snapshot_prefix, final, engine.hdf5_snapshots(self.param))[0]
                   if self.snapshotted == final else None)
        arrays = self.snapshot_arrays[1] if weights else self.arrays()
        values = self.last_test_values
        if self.solver.test_nets and self.multiples.tests(final) and self.tested != final:  # Caffe's last test
            values = self.test(final)
        return weights, values, arrays

    def stop_early(self, why):
        """Caffe's Solve stopped early (SIGINT, SIGHUP): x̃ snapshotted as the job's iteration when the workers were
        last seen, with the workers' solver states the driver holds, unless the job trained nothing since its
        start or its last snapshot, or snapshot_after_train is off; the model's path (None: no snapshot)."""
        iteration, path = self.observed, None
        if iteration == self.multiples.start:  # stopped before training: nothing to keep, nothing to say
            return path
        if self.param.snapshot_after_train and iteration != self.snapshotted:
            log.warning(f"Stopping early at iteration {iteration} ({why}): snapshotting x̃")
            path = self.snapshot(iteration)
        log.info("Optimization stopped early.")
        return path

    def plot(self, folder, title):
        """The loss and test outputs against time, in folder/progress.png; its path."""
        path = os.path.join(folder, "progress.png")
        plot_history([(e["seconds"], e["iteration"], e["loss"], engine.outputs(e)) for e in self.history], path,
                     title=title)
        return path
