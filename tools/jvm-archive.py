"""Write the class archive a Spark driver's JVM starts from (deepspark.spark.session.jvm_archive): a JVM of the
driver's options runs a small local job and writes the classes it loaded as it exits (the JDK's
-XX:ArchiveClassesAtExit). `make setup` runs this; an archive already there is kept. Run it again after changing the
JDK (a JVM that cannot use the archive starts without it). Each checkout's pyspark has an archive of its own (~70
MB): of the others in the cache folder only the KEEP most recently written stay, so that fresh clones (CI) do not
fill the disk; a checkout whose archive went writes it again at its next `make`. A job reading Parquet loads Spark
SQL's classes beyond it: an archive of those too costs a LeNet job more memory than it saves a session's start
(bench/startup.py).

    .venv/bin/python tools/jvm-archive.py [--force]
"""

import argparse
import glob
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pyspark import SparkConf, SparkContext  # noqa: E402
from pyspark.java_gateway import launch_gateway  # noqa: E402

from deepspark.spark.session import QUIET_CDS, jvm_archive, jvm_options  # noqa: E402

KEEP = 3  # other checkouts' archives kept in the cache folder, the most recently written


def prune(archive, keep=KEEP):
    """Remove the archives beside `archive` but it and the `keep` most recently written (and partial ones an
    interrupted run left over a day ago): the paths removed."""
    folder = os.path.dirname(archive)
    others = sorted((p for p in glob.glob(os.path.join(folder, "spark-*-classes.jsa")) if p != archive),
                    key=os.path.getmtime, reverse=True)
    stale = [p for p in glob.glob(os.path.join(folder, "spark-*-classes.jsa.*.partial"))
             if time.time() - os.path.getmtime(p) > 86400]
    removed = others[keep:] + stale
    for path in removed:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # another checkout's make pruned it first
    return removed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="write it again even if it is there")
    archive = jvm_archive()
    pruned = prune(archive) if os.path.isdir(os.path.dirname(archive)) else []
    if pruned:
        print(f"[jvm-archive] removed {len(pruned)} other checkouts' archives (the {KEEP} newest kept)")
    if os.path.isfile(archive) and not parser.parse_args().force:
        return
    os.makedirs(os.path.dirname(archive), exist_ok=True)
    began, partial = time.time(), f"{archive}.{os.getpid()}.partial"
    master = "local[2]"
    conf = (SparkConf().setMaster(master).setAppName("deepspark-jvm-archive").set("spark.ui.enabled", "false")
            .set("spark.driver.host", "127.0.0.1").set("spark.driver.bindAddress", "127.0.0.1")
            .set("spark.driver.extraJavaOptions",
                 f"{jvm_options(master, archived=False)} -XX:ArchiveClassesAtExit={partial} {QUIET_CDS}"))
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    gateway = launch_gateway(conf, popen_kwargs={"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL})
    sc = SparkContext(conf=conf, gateway=gateway)
    sc.setLogLevel("ERROR")
    try:
        sc.parallelize(range(4), 2).map(lambda x: x * 2).collect()
    finally:
        sc.stop()
        SparkContext._gateway = None
        gateway.shutdown()
        gateway.proc.stdin.close()  # the JVM exits at its stdin's end, writing the archive
        gateway.proc.wait()
    if not os.path.isfile(partial):
        raise SystemExit(f"[jvm-archive] the JVM wrote no archive to {partial}")
    os.replace(partial, archive)
    print(f"[jvm-archive] {archive}: {os.path.getsize(archive) / 1e6:.0f} MB in {time.time() - began:.0f} s")


if __name__ == "__main__":
    main()
