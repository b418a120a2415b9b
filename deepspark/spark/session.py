"""The job's SparkContext (or SparkSession, where it reads a DataFrame): the caller's when one is running, else one
this job starts, quiet.

A JVM that DeepSpark starts itself logs errors only (log4j2.properties beside this
module, given before the JVM starts), and its stderr (where Spark's Python workers
print in local mode too) reaches the console through log.echo: above the progress
line, never inside it, without the start-up banners no setting turns off.
"""

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import weakref

import pyspark
from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

from deepspark.errors import ConfigError
from deepspark.log import echo

LOG4J = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")
# The JVM's collector and first heap in local mode, where it schedules tasks and the Python workers compute: the
# serial collector grows a small heap from 16 MB where G1 commits 1/64 of the machine's memory at once, and adds
# its own tables for the maximum heap (spark.driver.memory's, unchanged); the JVM holds less (bench/startup.py).
LOCAL_JVM = "-XX:+UseSerialGC -Xms16m"
# The executors' pyspark daemon (spark.python.daemon.module), and the environment variables naming the
# backend it imports and the socket of its zygote, which imports it while the JVM starts (daemon.py).
DAEMON, DAEMON_BACKEND, ZYGOTE = "deepspark.spark.daemon", "DEEPSPARK_DAEMON_BACKEND", "DEEPSPARK_DAEMON_ZYGOTE"
# The backends the daemon imports before it forks: TensorFlow takes its thread counts when a model starts its runtime,
# in the worker after the fork. pycaffe is not: its BLAS reads the worker's thread count as it loads
# (executor.set_threads sets it first), which an import in the daemon would read from the daemon's environment instead.
PRELOADED = ("tensorflow",)
ZYGOTES = weakref.WeakKeyDictionary()  # SparkContext -> the zygote process start_zygote started for it
# Spark's attempts of a task where the driver's failure budget counts the failures (budget.py): past any budget
# (a failure every second for 11 days), so that Spark's count never ends a job the budget lets go on.
WATCHED_ATTEMPTS = 1_000_000
# The folder Spark extracts executor_env into, in each executor's working directory (`--archives ENV#environment`).
ENV_ALIAS = "environment"
# The JVM's class-data sharing says nothing: an archive it cannot map (another JDK) is left unused in silence.
QUIET_CDS = "-Xlog:cds*=off"

# Lines a JVM prints at start whatever log4j says: the JDK's incubator warning (Spark 4 adds
# jdk.incubator.vector) and Spark's notes about its default profile (when log4j2 is not ours).
BANNER = re.compile(r"^WARNING: Using incubator modules|Using Spark's default log4j profile|"
                    r"^Setting default log level to|^To adjust logging level use sc\.setLogLevel|"
                    r"NativeCodeLoader: Unable to load native-hadoop")


def is_connect(frame_or_session):
    """Whether a DataFrame or a SparkSession is Spark Connect's (which has no SparkContext, JVM, RDDs, broadcasts or
    accumulators)."""
    return type(frame_or_session).__module__.startswith("pyspark.sql.connect")


def is_local(master):
    return master.startswith("local")


def setting(sc, key, default=None):
    """One setting of `sc`'s conf: one call into the JVM, where sc.getConf() copies every setting (a call each)."""
    return sc._conf.get(key, default)


def worker_threads(sc, concurrent):
    """Compute threads per Python worker when `concurrent` tasks run at once: the cores shared out in local
    mode, an executor's cores on a cluster."""
    return threads_line(sc, concurrent)[0]


def threads_line(sc, concurrent, asked=0):
    """(compute threads per Python worker, the line that says how many and why): `asked` (the worker_threads
    knob) where set, else worker_threads's share."""
    if asked:
        count, why = asked, f"worker_threads {asked}"
    elif is_local(sc.master):
        cores = os.cpu_count() or 1
        count = max(1, cores // max(concurrent, 1))
        why = f"{cores} cores shared by {concurrent} worker{'s' * (concurrent != 1)}"
    else:
        count = int(setting(sc, "spark.executor.cores", "1"))
        why = f"spark.executor.cores {count}"
    return count, f"Each worker computes on {count} thread{'s' * (count != 1)} ({why})"


def start_python_workers(sc, count):
    """Have Spark start its Python daemon and `count` Python workers now, in a job of no-op tasks that the driver
    does not wait for; Spark reuses them (spark.python.worker.reuse) for the next job's tasks. Its thread; a failure
    there is left to the tasks that come after, which report their own."""

    def start():
        try:
            sc.parallelize(range(count), count).foreach(lambda _: None)
        except Exception:  # its tasks' errors are the next job's to report
            pass

    thread = threading.Thread(target=start, name="deepspark-python-workers", daemon=True)
    thread.start()
    return thread


def on_loopback(master):
    """A local master, or one on 127.0.0.1/localhost: the driver binds to 127.0.0.1 too."""
    return is_local(master) or any(h in master for h in ("//127.0.0.1:", "//localhost:"))


def spark_session(ds, workers, watched=False):
    """(the SparkSession, whether this call started its SparkContext): spark_context's, with Spark SQL's session
    on it."""
    sc, started = spark_context(ds, workers, watched)
    return sql_session(sc), started


def spark_context(ds, workers, watched=False):
    """(the SparkContext, whether this call started it). A running one (the caller's) is used as it is
    and left running; else one starts on ds.master (`local[N,F]` by default, bound to 127.0.0.1 on a
    loopback master), or on spark-submit's master as it configured it, its tasks' attempts as `attempts` says
    (`watched`: the driver counts the job's failures itself, budget.py). Spark SQL's session is not started here:
    a job reading no DataFrame does without it (seconds of the JVM's start-up, on the cores the workers' start-up
    needs: bench/startup.py); sql_session starts it when a job needs it."""
    if SparkContext._active_spark_context is not None:
        return this_python(SparkContext._active_spark_context), False
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # under spark-submit the JVM is up with its master
    tries = attempts(ds, watched)
    master = ds.master or (None if submitted else f"local[{workers},{tries}]")
    conf = SparkConf().setAppName("deepspark")
    if master:
        conf.setMaster(master)
    if master and on_loopback(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        conf.set("spark.driver.host", "127.0.0.1").set("spark.driver.bindAddress", "127.0.0.1")
        conf.set("spark.ui.enabled", "false")
    # A sync job's lost worker fails its barrier stage's attempt, which Spark reruns whole: the same count
    # governs those reruns too (Spark's own default, 4 attempts, would cap them whatever the flag says).
    conf.set("spark.task.maxFailures", str(tries))
    conf.set("spark.stage.maxConsecutiveAttempts", str(tries))
    conf.set("spark.python.worker.reuse", "true").set("spark.ui.showConsoleProgress", "false")
    if master:
        # The executors run a Python that has deepspark (executor_python: this one on this process's path, or
        # executor_env's, which holds it), where our daemon is: it imports the backend once and forks the Python
        # workers with it loaded (daemon.py), the first attempt's and a retried task's alike (a rejoin without
        # TensorFlow's import). In local mode its zygote, started below before the JVM, imports it while the JVM
        # starts. Under spark-submit the executors' Python is the user's: pyspark's own daemon.
        conf.set("spark.python.daemon.module", DAEMON)
        conf.set(f"spark.executorEnv.{DAEMON_BACKEND}", ds.backend)
    own_jvm = not submitted and SparkContext._gateway is None  # pyspark keeps one JVM per process
    if own_jvm:
        conf.set("spark.driver.extraJavaOptions", jvm_options(master))
    python = executor_python(ds, master, conf)
    zygote = start_zygote(python, conf, ds.backend) if master and is_local(master) else None
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python  # read once, by SparkContext: what the executors run
    try:
        sc = SparkContext(conf=conf, gateway=quiet_gateway(conf) if own_jvm else None)
    except BaseException:
        close_zygote(zygote)
        raise
    finally:
        if saved is None:
            del os.environ["PYSPARK_PYTHON"]
        else:
            os.environ["PYSPARK_PYTHON"] = saved
    if zygote is not None:
        ZYGOTES[sc] = zygote
    if master and is_local(master):
        # Its Python workers start (the first job's scheduling, the daemon from its zygote) while the job plans its
        # shards and starts the center; its tasks then take them up.
        start_python_workers(sc, workers)
    sc.setLogLevel("ERROR")
    return sc, True


def attempts(ds, watched):
    """Spark's attempts of each task, and of a barrier stage: max_failures (1 at least) where Spark counts the
    failures; WATCHED_ATTEMPTS where the driver's budget does (`watched`), so that Spark never ends the job first,
    unless max_failures is 1 (no retry, whoever counts)."""
    return WATCHED_ATTEMPTS if watched and ds.max_failures > 1 else max(ds.max_failures, 1)


def this_python(sc):
    """`sc`, its local-mode executors made to run this process's Python (sys.executable, where deepspark is) unless
    the user chose another (PYSPARK_PYTHON, spark.pyspark.python): a context the user started from a Python whose venv
    is not activated (a notebook's kernel, an IDE, cron), before deepspark was imported (which sets PYSPARK_PYTHON
    where it is unset), would run `python3` from PATH, which may not have it. pyspark reads sc.pythonExec as it
    ships each function."""
    chosen = os.environ.get("PYSPARK_PYTHON", sys.executable) != sys.executable or setting(sc, "spark.pyspark.python")
    if is_local(sc.master) and not chosen:
        sc.pythonExec = sys.executable
    return sc


# The loggers by which Spark reports a failed task to the console (its Python traceback, its Java stack, and again
# as the stage fails): a job of DeepSpark's says it in one line, and keeps the whole report in its log file.
TASK_LOGGERS = ("org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager",
                "org.apache.spark.scheduler.TaskSchedulerImpl", "org.apache.spark.api.python.PythonRunner")
_QUIET = {"jobs": 0, "levels": {}}  # DeepSpark jobs running (fits in parallel share one JVM), and the levels found
_QUIET_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet_tasks(sc):
    """TASK_LOGGERS off while DeepSpark's jobs run on `sc` (its local executors log in this JVM; a cluster's
    driver logs the tasks it lost), the configuration as it was once the last one ends: a logger that had a level
    of its own gets it back, one that inherited its level inherits it again (its LoggerConfig removed). An inherited
    level restored as an explicit one gets past Spark's shell filter (SparkShellLoggingFilter lets through a logger
    with a configuration of its own): every later action would print its INFO lines."""
    log4j = sc._jvm.org.apache.logging.log4j
    with _QUIET_LOCK:
        if not _QUIET["jobs"]:
            config = log4j.LogManager.getContext(False).getConfiguration()
            found = {}
            for name in TASK_LOGGERS:
                own = config.getLoggers().get(name)  # the LoggerConfig of this very name, or None
                found[name] = own.getLevel() if own is not None else None
            _QUIET["levels"] = found
            for name in TASK_LOGGERS:
                log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
        _QUIET["jobs"] += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET["jobs"] -= 1
            if not _QUIET["jobs"]:
                restore_levels(log4j, _QUIET["levels"])


def restore_levels(log4j, levels):
    """{logger name: its own level, or None where it inherited one} back as they were."""
    context = log4j.LogManager.getContext(False)
    config = context.getConfiguration()
    for name, level in levels.items():
        if level is not None:
            log4j.core.config.Configurator.setLevel(name, level)
        elif config.getLoggers().get(name) is not None:
            config.removeLogger(name)
    context.updateLoggers()


def sql_session(sc):
    """Spark SQL's session on `sc` (the running one, or one started on it)."""
    return SparkSession.builder.getOrCreate()  # its SparkContext is the running one, sc


def stop_context(sc):
    """Stop `sc`, and Spark SQL's session on it if one was started (its stop stops `sc` too, and forgets the
    session, so that the next job's getOrCreate starts a new one)."""
    session = SparkSession._instantiatedSession
    if session is not None and session.sparkContext is sc:
        session.stop()
    else:
        sc.stop()
    close_zygote(ZYGOTES.pop(sc, None))


def start_zygote(python, conf, backend):
    """The zygote of the executors' daemon (daemon.py), started before the JVM so that the backend's import runs
    while the JVM and its SparkContext start: `python` on the executors' path, listening in a folder of its own,
    named to the daemon through conf. None for a backend the daemon does not import (PRELOADED)."""
    if backend not in PRELOADED:
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="deepspark-zygote-"), "socket")  # the folder: this user's alone
    env = {**os.environ, "PYTHONPATH": conf.get("spark.executorEnv.PYTHONPATH", ""), DAEMON_BACKEND: backend}
    # Its stdin is the driver's hold on it: closed (close_zygote, or the driver's exit), a zygote not yet handed a
    # daemon exits. It prints nothing: the daemon it forks writes to the JVM's pipes.
    process = subprocess.Popen([python, "-m", DAEMON, "--zygote", path], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    conf.set(f"spark.executorEnv.{ZYGOTE}", path)
    return process


def close_zygote(process):
    """Let go of a zygote: one still waiting for its daemon exits; one that forked it exits with it (the JVM stops
    the daemon with its SparkContext)."""
    if process is None:
        return
    process.stdin.close()
    remove_zygote_socket(process.args[-1])  # the zygote's, where it took its daemon already


def remove_zygote_socket(path):
    """A zygote's socket at `path` and its folder, each where still there: the driver and the zygote both remove
    them (close_zygote, daemon.zygote), whichever is first."""
    for remove, name in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        with contextlib.suppress(OSError):
            remove(name)


def jvm_options(master, archived=True):
    """The Java options of a JVM this process starts for `master`: our log4j, LOCAL_JVM's in local mode, and, when
    `archived` and jvm_archive() is there, the class archive to start from."""
    options = [f"-Dlog4j2.configurationFile=file:{LOG4J}", *([LOCAL_JVM] if master and is_local(master) else [])]
    if archived and os.path.isfile(jvm_archive()):
        options += [f"-XX:SharedArchiveFile={jvm_archive()}", QUIET_CDS]
    return " ".join(options)


def jvm_archive():
    """Where `make setup` (tools/jvm-archive.py) writes the classes a Spark driver's JVM loads as it starts, for
    this pyspark (its version, its jars' folder and when that was written: the archive holds the jars' paths and
    times, and a reinstalled pyspark gets an archive of its own): the JDK's class-data sharing maps
    them from it instead of loading each from Spark's jars: a SparkContext sooner, and less of the JVM's own
    memory (bench/startup.py). A JVM that cannot use it (another JDK) starts without it, silently
    (QUIET_CDS)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    jars = os.path.join(os.path.dirname(os.path.abspath(pyspark.__file__)), "jars")
    written = os.stat(jars).st_mtime_ns if os.path.isdir(jars) else 0
    where = hashlib.sha256(f"{jars} {written}".encode()).hexdigest()[:12]
    return os.path.join(cache, "deepspark", f"spark-{pyspark.__version__}-{where}-classes.jsa")


def executor_python(ds, master, conf):
    """The Python the executors run, with what it needs set in conf: executor_env's, shipped as a Spark
    archive; else this Python (or PYSPARK_PYTHON), finding our modules on this process's path (one
    machine, or nodes installed alike)."""
    if not ds.executor_env:
        conf.set("spark.executorEnv.PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
        return os.environ.get("PYSPARK_PYTHON", sys.executable)
    if not master or is_local(master):
        raise ConfigError(f"executor_env ships a Python environment to a cluster's executors; "
                          f"{master or 'spark-submit'} runs them from this process's Python "
                          f"(under spark-submit, pass --archives ENV.tar.gz#{ENV_ALIAS} to it instead)")
    if not os.path.isfile(ds.executor_env):
        raise ConfigError(f"executor_env '{ds.executor_env}' is not a file; pack one with tools/pack-env.sh "
                          f"or venv-pack -o ENV.tar.gz")
    conf.set("spark.archives", f"{os.path.abspath(ds.executor_env)}#{ENV_ALIAS}")
    return f"./{ENV_ALIAS}/bin/python"


def quiet_gateway(conf):
    """pyspark's JVM gateway with its stdout and stderr read line by line into the console, its banners
    left out."""
    read, write = os.pipe()
    threading.Thread(target=forward, args=(read,), name="jvm-output", daemon=True).start()
    try:
        return launch_gateway(conf, popen_kwargs={"stdout": write, "stderr": write})
    finally:
        os.close(write)  # the JVM holds its own copy; the pipe ends when the JVM does


def forward(fd):
    """Echo the JVM's lines but its banners, until it exits."""
    with os.fdopen(fd, "rb") as stream:
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line.strip() and not BANNER.search(line):
                echo(line)
