"""Caffe-style log lines (glog's prefix) to stderr and a log file, and a progress line on a terminal."""

import contextlib
import datetime
import importlib
import logging
import os
import re
import sys
import tempfile
import threading

# One console: a Log's lines, its progress line and other processes' lines (echo) never cut into each other.
_CONSOLE = threading.RLock()
_DRAWING = []  # the Logs whose progress line is on the screen now


class _Forward(logging.Handler):
    """The standard-library loggers under `deepspark` (the exchanger's, the data feeder's) into the Log that keeps
    a file, the job's: their warnings go to train.log and above the progress line, in glog's form, where
    Python's last-resort handler wrote them bare into the progress line and never to the file."""

    def __init__(self):
        super().__init__(logging.WARNING)  # their INFO lines (a worker joined, left) the job says in its own words
        self.logs = []  # the Logs with a file, newest last: the one a record goes to

    def emit(self, record):
        if self.logs:
            self.logs[-1].info(self.format(record), "E" if record.levelno >= logging.ERROR else "W")
        else:  # no job's log in this process (an executor's worker): stderr, above any progress line
            echo(self.format(record))


_FORWARD = _Forward()
logging.getLogger("deepspark").addHandler(_FORWARD)


class Log:
    """`I1129 13:02:03.123456 4242 deepspark] message` lines, like Caffe's glog output.

    The prefix carries the wall-clock time that `deepspark plot` reads back.
    On a terminal a progress line is redrawn below the log lines.
    """

    def __init__(self, path=None, stream=None, progress=None, append=False):
        self.stream = stream or sys.stderr
        self.file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a" if append else "w", encoding="utf-8")
            _FORWARD.logs.append(self)
        self.progress_enabled = self.stream.isatty() if progress is None else progress
        self._progress = ""

    def info(self, message, level="I", file=True):
        """A line on the console (above the progress line) and in the log file; `file`: False for the console
        alone (what shows a job going: bars.Lines)."""
        now = datetime.datetime.now()
        line = f"{level}{now:%m%d %H:%M:%S.%f} {os.getpid()} deepspark] {message}"
        with _CONSOLE:
            self._above(line)
            if self.file and file:
                self.file.write(line + "\n")
                self.file.flush()

    def _above(self, line):
        """`line` on the console, above the progress line if one is drawn."""
        if self._progress:
            self.stream.write("\r\033[K")
        self.stream.write(line + "\n")
        if self._progress:
            self.stream.write(self._progress)
        self.stream.flush()

    def warning(self, message):
        self.info(message, "W")

    @contextlib.contextmanager
    def details(self, kind):
        """An error of `kind` raised inside, its `detail` (the whole of what it says in one line: a Spark job's
        tracebacks) written to the log file alone on its way out: the console keeps the one line."""
        try:
            yield
        except kind as error:
            if getattr(error, "detail", None) and self.file:
                with _CONSOLE:
                    self.file.write(error.detail.rstrip("\n") + "\n")
                    self.file.flush()
            raise

    def progress(self, text):
        """Redraw the progress line (terminals only)."""
        if not self.progress_enabled:
            return
        with _CONSOLE:
            if self not in _DRAWING:
                _DRAWING.append(self)
            self._progress = text
            self.stream.write("\r\033[K" + text)
            self.stream.flush()

    def end_progress(self):
        with _CONSOLE:
            if self in _DRAWING:
                _DRAWING.remove(self)
            if self._progress:
                self.stream.write("\r\033[K")
                self.stream.flush()
                self._progress = ""

    def close(self):
        self.end_progress()
        if self in _FORWARD.logs:
            _FORWARD.logs.remove(self)
        if self.file:
            self.file.close()
            self.file = None


def echo(line, stream=None):
    """Another process's line (the JVM's, a Spark worker's) on stderr, above a progress line if one is
    drawn there, never in the middle of one."""
    stream = stream or sys.stderr
    with _CONSOLE:
        drawing = next((log for log in _DRAWING if log.stream is stream), None)
        if drawing is not None:
            drawing._above(line)
        else:
            stream.write(line + "\n")
            stream.flush()


# What TensorFlow's native libraries print to fd 2 as they load, whatever TF_CPP_MIN_LOG_LEVEL says, on a CPU
# where TensorFlow turns oneDNN on by itself (AVX-512, AMX): absl's notice and the oneDNN line, once per library.
# Only TF_ENABLE_ONEDNN_OPTS=0 stops them, and that turns off oneDNN, which makes TensorFlow's LeNet step much faster.
NATIVE_BANNER = re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
                           r"|^I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on\.")


def import_quietly(name):
    """importlib.import_module(name), with what native code prints to fd 2 meanwhile held back and then written
    to stderr, but for its start-up banner (NATIVE_BANNER): the console keeps DeepSpark's lines and real errors."""
    if name in sys.modules:
        return sys.modules[name]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            return importlib.import_module(name)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for raw in held:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if not NATIVE_BANNER.search(line):
                    echo(line)
