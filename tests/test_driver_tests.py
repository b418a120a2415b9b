"""The driver's test passes (spark/center.py) run at test_nice, off the workers' priority, with the same results."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from synthetic import make_job

# A fresh process, so that TensorFlow's threads start from the tests' thread (in this one an earlier test may have
# started them): it tests x̃ as the job starts with the solver's test_nice, samples every thread's nice and CPU
# ticks around the passes, then tests the same x̃ with test_nice 0.
SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    from deepspark.config import load_solver
    from deepspark.spark.center import CenterCadence
    from deepspark.spark.job import initial_center

    def threads():
        held = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # ended since the listing
                continue
            held[int(tid)] = (int(fields[16]), int(fields[11]) + int(fields[12]))  # nice, utime + stime
        return held

    def passes(solver, folder, count):
        graph, arrays, _, _ = initial_center(solver, 1)
        flat = __import__("numpy").concatenate([a.reshape(-1) for a in arrays])
        cadence = CenterCadence(solver, graph, 0, lambda: flat)
        cadence.start(folder)
        before = threads()
        values = [cadence.test(0) for _ in range(count)]
        after = threads()
        line = cadence.passes.line()
        cadence.close()
        return values, line, {t: (after[t][0], after[t][1] - before.get(t, (0, 0))[1]) for t in after}

    solver = load_solver(sys.argv[1])
    niced, line, seen = passes(solver, sys.argv[2], int(sys.argv[3]))
    solver.param.deepspark_param.test_nice = 0
    plain, plain_line, _ = passes(solver, sys.argv[2], 1)
    print(json.dumps({"niced": niced, "plain": plain, "line": line, "plain_line": plain_line, "threads": seen,
                      "main": [threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)]}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice per thread is Linux's")
def test_the_driver_tests_run_at_test_nice_and_score_as_at_the_drivers_priority(tmp_path):
    solver = make_job(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT, solver, str(tmp_path / "tb"), "20"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["niced"][0] == seen["plain"][0] and seen["niced"][0]["test0/accuracy"] >= 0
    assert seen["line"] == "Tests: on the driver at nice 10, 1 thread"
    assert seen["plain_line"] == "Tests: on the driver at the driver's priority, 1 thread"
    assert seen["main"][1] == 0  # the caller, and the threads it starts (the exchanger's), keep their priority
    niced = sum(ticks for nice, ticks in seen["threads"].values() if nice == 10)
    # The passes' CPU went to threads at nice 10; the caller only waited (and read x̃).
    assert niced >= 10 and niced >= 0.8 * sum(ticks for _, ticks in seen["threads"].values()), seen["threads"]
