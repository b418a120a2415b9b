"""The job's SparkSession: the caller's when one is running, else one this job starts, quiet.

A JVM that DeepSpark starts itself logs errors only (log4j2.properties beside this
module, given before the JVM starts), and its stderr (where Spark's Python workers
print in local mode too) reaches the console through log.echo: above the progress
line, never inside it, without the start-up banners no setting turns off.
"""

import os
import re
import sys
import threading

from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

from deepspark.errors import ConfigError
from deepspark.log import echo

LOG4J = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")
# The folder Spark extracts executor_env into, in each executor's working directory (`--archives ENV#environment`).
ENV_ALIAS = "environment"

# Lines a JVM prints at start whatever log4j says: the JDK's incubator warning (Spark 4 adds
# jdk.incubator.vector) and Spark's notes about its default profile (when log4j2 is not ours).
BANNER = re.compile(r"^WARNING: Using incubator modules|Using Spark's default log4j profile|"
                    r"^Setting default log level to|^To adjust logging level use sc\.setLogLevel|"
                    r"NativeCodeLoader: Unable to load native-hadoop")


def is_local(master):
    return master.startswith("local")


def worker_threads(sc, concurrent):
    """Compute threads per Python worker when `concurrent` tasks run at once: the cores shared out in local
    mode, an executor's cores on a cluster."""
    if is_local(sc.master):
        return max(1, (os.cpu_count() or 1) // max(concurrent, 1))
    return int(sc.getConf().get("spark.executor.cores", "1"))


def on_loopback(master):
    """A local master, or one on 127.0.0.1/localhost: the driver binds to 127.0.0.1 too."""
    return is_local(master) or any(h in master for h in ("//127.0.0.1:", "//localhost:"))


def spark_session(ds, workers):
    """(the SparkSession, whether this call started it). A running one (the caller's) is used as it is
    and left running; else one starts on ds.master (`local[N,F]` by default, bound to 127.0.0.1 on a
    loopback master), or on spark-submit's master as it configured it."""
    if SparkContext._active_spark_context is not None:
        return SparkSession.builder.getOrCreate(), False
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # under spark-submit the JVM is up with its master
    master = ds.master or (None if submitted else f"local[{workers},{max(ds.max_failures, 1)}]")
    conf = SparkConf().setAppName("deepspark")
    if master:
        conf.setMaster(master)
    if master and on_loopback(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        conf.set("spark.driver.host", "127.0.0.1").set("spark.driver.bindAddress", "127.0.0.1")
        conf.set("spark.ui.enabled", "false")
    # A sync job's lost worker fails its barrier stage's attempt, which Spark reruns whole: max_failures
    # governs those reruns too (Spark's own default, 4 attempts, would cap them whatever the flag says).
    conf.set("spark.task.maxFailures", str(max(ds.max_failures, 1)))
    conf.set("spark.stage.maxConsecutiveAttempts", str(max(ds.max_failures, 1)))
    conf.set("spark.python.worker.reuse", "true").set("spark.ui.showConsoleProgress", "false")
    own_jvm = not submitted and SparkContext._gateway is None  # pyspark keeps one JVM per process
    if own_jvm:
        conf.set("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{LOG4J}")
    python = executor_python(ds, master, conf)
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python  # read once, by SparkContext: what the executors run
    try:
        SparkContext(conf=conf, gateway=quiet_gateway(conf) if own_jvm else None)
    finally:
        if saved is None:
            del os.environ["PYSPARK_PYTHON"]
        else:
            os.environ["PYSPARK_PYTHON"] = saved
    spark = SparkSession.builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark, True


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
