"""A Model's transform on the executors: the Arrow UDF that runs the net over each Arrow batch of the input column and
gives its outputs as columns (a prediction as a double, a blob as a list of doubles the Model makes a vector), in
classic Spark and under Spark Connect alike."""

import logging
import sys
import threading
import time
from typing import Iterator

import numpy as np
import pyarrow as pa
from py4j.protocol import Py4JError
from pyspark.accumulators import AccumulatorParam
from pyspark.sql import functions as F

from deepspark.errors import ConfigError
from deepspark.ml import images
from deepspark.ml.frames import spark_job

log = logging.getLogger(__name__)
# Bytes of Datums an Arrow batch's are decoded in at a time (their images as many bytes again, at most).
DECODE_BYTES = 16 << 20
# Seconds with no task reporting skipped rows after which the driver says how many an action skipped, once Spark
# runs no job: a task's count comes in as it ends, and on a loaded machine an action's tasks can end seconds apart.
SAID_AFTER = 1.0
# The longest the driver holds a count back while Spark runs jobs (an action that goes on, or another's).
SAID_AT_MOST = 60.0


class SkipCount(AccumulatorParam):
    """The rows handleInvalid='skip' leaves out of a transform, as a classic Spark accumulator: the executors count
    them as they score (no second pass over the data), and the driver adds up the tasks' counts as they come in and
    says them in one warning once its tasks stop reporting (SAID_AFTER) and `tracker` (the SparkContext's
    StatusTracker) shows no job running, or SAID_AT_MOST after the first count."""

    def __init__(self, column, tracker):
        self.column, self.tracker, self.on_driver = column, tracker, True
        self.pending, self.first, self.timer, self.lock = 0, None, None, threading.Lock()

    def __getstate__(self):  # what the executors get: the count alone
        return {"column": self.column}

    def __setstate__(self, state):
        self.column, self.on_driver = state["column"], False

    def zero(self, value):
        return 0

    def addInPlace(self, value1, value2):
        if self.on_driver and value2:  # a task's count, reported to the driver
            with self.lock:
                self.pending += value2
                self.first = self.first or time.monotonic()
                self._wait()
        return value1 + value2

    def _wait(self):
        """(Re)start the timer that says the count: called with the lock held."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer = threading.Timer(SAID_AFTER, self.say)
        self.timer.daemon = True
        self.timer.start()

    def running(self):
        """Whether Spark runs a job now (the tracker's view lags the tasks' ends a little: one more wait)."""
        try:
            return bool(self.tracker.getActiveJobsIds())
        except Py4JError:  # the context stopped: nothing more will come
            return False

    def say(self):
        running = self.running()  # a call into the JVM: not under the lock, which the accumulator server takes
        with self.lock:
            if self.timer is not threading.current_thread():  # a newer count started a timer of its own
                return
            if running and time.monotonic() - self.first < SAID_AT_MOST:
                self._wait()
                return
            count, self.pending, self.first, self.timer = self.pending, 0, None, None
        log.warning(f"transform: skipped {count} row{'s' if count != 1 else ''} with a null or wrong-sized inputCol "
                    f"'{self.column}' (handleInvalid='skip')")


# What a Spark Connect server's Python workers must import to run a transform, beside the backend's module; and the
# function that looks, defined outside any module so that it travels by value (the workers may not have deepspark).
WORKER_NEEDS = ("pyarrow", "numpy", "deepspark")
BACKEND_MODULES = {"tensorflow": "tensorflow", "caffe": "caffe"}
PROBE = """
def probe(_):
    import importlib.util, sys
    return sys.executable + "\\t" + ",".join(name for name in NEEDS if importlib.util.find_spec(name) is None)
"""
_PROBED = {}  # Spark Connect session id -> (the workers' Python, what it lacks)


def check_workers(session, backend):
    """One line unless the Python workers of a Spark Connect `session` can import what a transform runs (a server
    runs `python3` from its PATH unless it was started with PYSPARK_PYTHON): one small job per session, a plain
    Python UDF that asks them."""
    key = session.session_id
    if key not in _PROBED:
        needs = WORKER_NEEDS + ((BACKEND_MODULES[backend],) if backend in BACKEND_MODULES else ())
        scope = {"__name__": "deepspark_probe", "NEEDS": needs}
        exec(PROBE, scope)  # noqa: S102  (our constant: a function with no module, pickled by value)
        with spark_job("DeepSparkModel.transform, asking the Spark workers which Python they run"):
            answer = session.range(1).select(F.udf(scope["probe"], "string", useArrow=False)("id")).first()[0]
        _PROBED[key] = tuple(answer.split("\t"))
    python, missing = _PROBED[key]
    if missing:
        raise ConfigError(f"the Spark workers' Python ({python}) cannot import {missing.replace(',', ', ')}: start "
                          f"the Spark Connect server with PYSPARK_PYTHON set to a Python that has them (this one: "
                          f"PYSPARK_PYTHON={sys.executable})")


class Held:
    """A value a task carries in its closure, read as a Spark broadcast is (`.value`): the weights under Spark
    Connect, which has no broadcasts."""

    def __init__(self, value):
        self.value = value


def double_lists(matrix):
    """An Arrow column of float64 lists, one per row of `matrix` (Spark ML's array_to_vector makes them vectors:
    an Arrow UDF cannot return a vector inside its struct)."""
    n, width = matrix.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)),
                                    pa.array(np.ascontiguousarray(matrix, np.float64).ravel()))


def outputs_of(forward, inputs, columns, skip, skipped=None):
    """The scalar-iterator Arrow UDF function of a transform: per Arrow array of inputs.column (frames.Inputs), a
    struct array of the new `columns`, [(kind, output, column name)] with kind "prediction" (the argmax of the output,
    a double) or "vector" (the output's values for the row). Only the input column travels to the Python worker and
    only the outputs back. A row with no image of the net's shape stops the task with one line naming it, or, with
    `skip`, gets a null struct (the transform leaves it out), counted in the `skipped` accumulator (classic Spark's;
    None under Spark Connect, which has none)."""

    def run(arrays: Iterator[pa.Array]) -> Iterator[pa.Array]:  # the hints say which kind of Arrow UDF
        for number, values in enumerate(arrays):
            if isinstance(values, pa.ChunkedArray):
                values = values.combine_chunks()
            what = f"inputCol '{inputs.column}' (Arrow batch {number} of a partition)"
            ok = None
            if inputs.kind == images.DATUM and not skip and not values.null_count:
                found = values.to_pylist()  # the Forward decodes a batch's Datums at once, and names a bad one
            else:
                found, ok = images.column_images(values, inputs.kind, inputs.shape)
                if ok.all():
                    ok = None
                elif not skip:
                    raise images.bad_row(values, inputs.kind, inputs.shape, ok, what)
            outputs = run_net(forward, found, what)
            fields = []
            for kind, name, _ in columns:
                flat = outputs[name].reshape(len(found), -1) if len(found) else np.zeros((0, 1), np.float32)
                if ok is not None:  # the skipped rows' places, filled with zeros under the struct's null
                    full = np.zeros((len(ok), flat.shape[1]), flat.dtype)
                    full[ok] = flat
                    flat = full
                fields.append(pa.array(flat.argmax(axis=1).astype(np.float64)) if kind == "prediction"
                              else double_lists(flat))
            mask = None if ok is None else pa.array(~ok)
            if ok is not None and skipped is not None:
                skipped.add(int((~ok).sum()))
            yield pa.StructArray.from_arrays(fields, names=[column for _, _, column in columns], mask=mask)

    return run


def run_net(forward, found, what):
    """{output: its values for each of the images `found` (arrays, or Datum bytes)}, forward.batch_size images at a
    time (the last batch padded). Datums are decoded DECODE_BYTES of them at a time, not a batch at a time: decoding
    costs per call more than per byte."""
    size = forward.batch_size
    datums = len(found) and isinstance(found[0], bytes)
    group = max(1, DECODE_BYTES // max(len(found[0]) * size, 1)) * size if datums else size
    parts = {}
    for first in range(0, len(found), group):
        values = found[first:first + group]
        decoded = forward.decoded(values, forward.built(size)[1]) if datums else None
        for start in range(0, len(values), size):
            if decoded is not None:
                out = forward.forward_images(decoded[0][start:start + size], decoded[1][start:start + size], pad=True)
            else:  # not Datums of one size the net takes: batch by batch, each row checked and a bad one named
                out = forward.forward_batch([(f"{what}, row {first + start + i}", image)
                                             for i, image in enumerate(values[start:start + size])], pad=True)
            for name in forward.outputs:
                parts.setdefault(name, []).append(np.asarray(out[name]))
    if not parts:
        return {name: np.zeros((0, 1), np.float32) for name in forward.outputs}
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}
