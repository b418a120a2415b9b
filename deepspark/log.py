"""Every `deepspark` logger's records as Caffe-style lines (glog's prefix) on stderr and in a run's train.log, with a
progress line below them on a terminal: Log, the one handler on the `deepspark` logger."""

import contextlib
import contextvars
import datetime
import importlib
import logging
import os
import re
import sys
import tempfile
import threading

# The logger every module's getLogger(__name__) is a child of: its records are the lines of the run.
LOGGER = logging.getLogger("deepspark")
LOGGER.setLevel(logging.INFO)
# The exchanger's INFO lines (a worker joined, left) the job says in its own words: its warnings alone.
logging.getLogger("deepspark.exchange").setLevel(logging.WARNING)

# One console: log lines, the progress line and other processes' lines (echo) never cut into each other. It is
# every Log's handler lock too, so that a line and a redraw of the progress line never interleave.
_CONSOLE = threading.RLock()
_DRAWING = []  # the Logs whose progress line is on the screen now
_OPEN = []  # the Logs on LOGGER, oldest first
_RUN = contextvars.ContextVar("deepspark_log", default=None)  # the Log of the run this thread (context) works for

LEVELS = ((logging.ERROR, "E"), (logging.WARNING, "W"), (logging.NOTSET, "I"))


def train_log(folder):
    """The path of a run's log file in its output folder: what `deepspark plot` and JobResult's history read."""
    return os.path.join(folder, "train.log")


class Glog(logging.Formatter):
    """`I1129 13:02:03.123456 4242 deepspark] message`, glog's prefix as Caffe writes it (W, E for warnings and
    errors): the wall-clock time in it is what `deepspark plot` reads back."""

    def format(self, record):
        level = next(letter for at, letter in LEVELS if record.levelno >= at)
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return f"{level}{datetime.datetime.fromtimestamp(record.created):%m%d %H:%M:%S.%f} {record.process} " \
               f"deepspark] {message}"


def current():
    """The Log that this thread's records go to: its run's (the Log it entered, `with Log(...)`), else the newest
    open one (a thread no run started: the exchanger's, Spark's job thread), else the process's console."""
    run = _RUN.get()
    if run is not None and run in _OPEN:
        return run
    return _OPEN[-1] if _OPEN else CONSOLE


class Log(logging.Handler):
    """Glog lines (Glog) of the `deepspark` loggers on a console `stream` (stderr by default, as it is when a line is
    written) and, given a `path`, in that file: each record goes to one Log, `current()`. On a terminal a progress
    line is redrawn below the log lines. `with Log(path)` is a run's: its records go there until it exits."""

    def __init__(self, path=None, stream=None, progress=None, append=False):
        super().__init__()
        self.setFormatter(Glog())
        self.addFilter(lambda record: current() is self)
        self._stream, self._progress_on, self._progress = stream, progress, ""
        self._token = None
        self.file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a" if append else "w", encoding="utf-8")
        with _CONSOLE:
            _OPEN.append(self)
            LOGGER.addHandler(self)

    def createLock(self):
        self.lock = _CONSOLE

    @property
    def stream(self):
        return self._stream or sys.stderr

    @property
    def progress_enabled(self):
        """Whether a progress line is drawn: on a terminal unless said otherwise."""
        return self.stream.isatty() if self._progress_on is None else self._progress_on

    def __enter__(self):
        self._token = _RUN.set(self)
        return self

    def __exit__(self, *exc):
        if self._token is not None:
            _RUN.reset(self._token)
            self._token = None
        self.close()

    def emit(self, record):
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.write(line)

    def write(self, line, file=True):
        """`line` on the console (above the progress line) and, with `file`, in the log file."""
        with _CONSOLE:
            self._above(line)
            if self.file and file:
                self.file.write(line + "\n")
                self.file.flush()

    def console(self, message):
        """`message` as a glog INFO line on the console alone (what shows a job going: progress.Lines)."""
        self.write(self.format(LOGGER.makeRecord(LOGGER.name, logging.INFO, "", 0, message, None, None)), file=False)

    def _above(self, line):
        """`line` on the console, above the progress line if one is drawn."""
        stream = self.stream
        if self._progress:
            stream.write("\r\033[K")
        stream.write(line + "\n")
        if self._progress:
            stream.write(self._progress)
        stream.flush()

    def detail(self, text):
        """`text` (a failure's whole report: a Spark job's tracebacks) in the log file alone: the console keeps the
        one line that the error says."""
        if text and self.file:
            with _CONSOLE:
                self.file.write(text.rstrip("\n") + "\n")
                self.file.flush()

    @contextlib.contextmanager
    def details(self, kind):
        """An error of `kind` raised inside, its `detail` written to the log file alone (detail) on its way out."""
        try:
            yield
        except kind as error:
            self.detail(getattr(error, "detail", None))
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
        """The progress line ended, the file closed, and the Log off the `deepspark` logger."""
        self.end_progress()
        with _CONSOLE:
            if self in _OPEN:
                _OPEN.remove(self)
            LOGGER.removeHandler(self)
            if self.file:
                self.file.close()
                self.file = None
        super().close()


# The process's console: where records go while no other Log is open (a one-process verb's console lines before
# its run, an executor's worker process, a library call).
CONSOLE = Log()


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
