"""The driver's test passes (spark/center.py) compute in threads at test_nice, off the workers' priority, with the same results."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from synthetic import SOLVER, make_lmdb

# A LeNet-sized test net: convolutions large enough for TensorFlow to share them out to its threads.
NET = """name: "Wide"
layer {{ name: "data" type: "Data" top: "data" top: "label" transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{source}" batch_size: 50 backend: LMDB }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 20 kernel_size: 5 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param {{ num_output: 50 kernel_size: 5 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
  inner_product_param {{ num_output: 2 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""

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
        return values, line, {t: (after[t][0], after[t][1] - before.get(t, (0, 0))[1], threads().get(t, (0,))[0])
                              for t in after}

    solver = load_solver(sys.argv[1])
    niced, line, seen = passes(solver, sys.argv[2], int(sys.argv[3]))
    solver.param.deepspark_param.test_nice = 0
    plain, plain_line, _ = passes(solver, sys.argv[2], 1)
    def probe(held):  # may this process raise a thread's priority again (root with CAP_SYS_NICE, or RLIMIT_NICE)?
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 1)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
            held.append(True)
        except PermissionError:
            held.append(False)
    held = []
    probing = threading.Thread(target=probe, args=(held,))
    probing.start()
    probing.join()
    restores = held[0]
    print(json.dumps({"restores": restores, "niced": niced, "plain": plain, "line": line, "plain_line": plain_line,
                      "threads": seen, "main": [threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)]}))
""")


def wide_job(folder):
    """A solver of NET on one 28x28 LMDB (train and test), testing 2 batches; its path."""
    source = make_lmdb(folder / "lmdb", 100, seed=2, size=28)
    (folder / "net.prototxt").write_text(NET.format(source=source))
    solver = folder / "solver.prototxt"
    solver.write_text(SOLVER.format(net=folder / "net.prototxt", test_interval=10, max_iter=20, snapshot=0,
                                    prefix=folder / "out" / "wide", workers=2, connect_timeout=60)
                      .replace("test_iter: 10", "test_iter: 2"))
    return str(solver)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice per thread is Linux's")
def test_the_driver_tests_compute_at_test_nice_and_score_as_at_the_drivers_priority(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT, wide_job(tmp_path), str(tmp_path / "tb"), "10"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["niced"][0] == seen["plain"][0] and 0 <= seen["niced"][0]["test0/accuracy"] <= 1
    assert seen["line"] == "Tests: on the driver at nice 10, 2 threads"
    assert seen["plain_line"] == "Tests: on the driver at the driver's priority, 2 threads"
    # The caller, which runs the passes' Python (and the exchanger's threads it starts), keeps its priority: a
    # Python thread at a lower one would hold the GIL they wait for.
    assert seen["main"][1] == 0
    # TensorFlow's threads, started at nice 10, computed a share of the passes.
    niced = [ticks for nice, ticks, _ in seen["threads"].values() if nice == 10]
    assert len(niced) >= 2 and sum(niced) >= 5, seen["threads"]
    if seen["restores"]:  # and after the job they serve at its priority whatever runs TensorFlow next
        assert {closed for _, _, closed in seen["threads"].values()} == {0}
