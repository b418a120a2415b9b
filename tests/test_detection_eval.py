"""deepspark.detection_eval: the SSD fork's ComputeAP and TestDetection mAP on hand-computed rows, eval_type and
ap_version checked as the fork's solver does, and `deepspark train`'s test pass logging the mAP pycaffe's solver
logs (#43)."""

import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT, run_cli
from deepspark.detection_eval import AP_VERSIONS, ap_version_of, mean_average_precision, pass_map
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb
from test_detection import pycaffe  # noqa: F401 (a fixture)

# Two test iterations of one DetectionEvaluate output: class 1 has 2 boxes and 3 detections (scores 0.9 true,
# 0.8 false, 0.7 true, the last in the second iteration); class 2 has 1 box and no detection; a difficult
# box's detection (neither true nor false) and the zero rows after the last are left out.
FIRST = np.array([[-1, 1, 2, -1, -1], [-1, 2, 1, -1, -1], [0, 1, 0.9, 1, 0], [0, 1, 0.8, 0, 1],
                  [1, 1, 0.95, 0, 0], [0, 0, 0, 0, 0]], np.float32).reshape(1, 1, -1, 5)
SECOND = np.array([[2, 1, 0.7, 1, 0]], np.float32).reshape(1, 1, -1, 5)
# By hand: precision 1, 1/2, 2/3 and recall 1/2, 1/2, 1 best first. Integral: 1 x 1/2 + 2/3 x 1/2 = 5/6;
# MaxIntegral the same here; 11point: precision 1 at recall 0..0.5 (6 points), 2/3 at 0.6..1 (5 points).
# Class 2 scores nothing and still counts: the mean is over both classes.
EXPECTED = {"Integral": 5 / 6 / 2, "MaxIntegral": 5 / 6 / 2, "11point": (6 + 5 * 2 / 3) / 11 / 2}


@pytest.mark.parametrize("version", AP_VERSIONS)
def test_map_of_the_hand_computed_rows(version):
    means = pass_map([{"ev": FIRST}, {"ev": SECOND}], version)
    assert list(means) == ["ev"]
    assert means["ev"] == pytest.approx(EXPECTED[version], abs=1e-6)


def test_outputs_are_each_their_own_map_in_name_order():
    means = pass_map([{"b": SECOND * 0, "a": FIRST}, {"b": FIRST, "a": SECOND}], "Integral")
    assert list(means) == ["a", "b"]
    assert means["a"] == pytest.approx(5 / 12, abs=1e-6)
    assert means["b"] == pytest.approx(1 / 4, abs=1e-6)  # class 1: one true positive of 2 boxes, best first


def test_an_output_that_is_not_rows_of_five_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="'loss' is 1, not DetectionEvaluate's rows of width 5") as caught:
        pass_map([{"ev": FIRST, "loss": np.ones(1, np.float32)}], "Integral")
    assert "\n" not in str(caught.value)


def test_eval_type_and_ap_version_as_the_fork_reads_them():
    solver = pb.SolverParameter()
    assert (solver.eval_type, solver.ap_version) == ("classification", "Integral")  # the fork's defaults
    assert ap_version_of(solver) is None and ap_version_of(None) is None
    solver.eval_type = "detection"
    assert ap_version_of(solver) == "Integral"
    solver.ap_version = "11point"
    assert ap_version_of(solver) == "11point"
    for field, value in (("ap_version", "VOC"), ("eval_type", "segmentation")):
        bad = pb.SolverParameter(eval_type="detection")
        setattr(bad, field, value)
        with pytest.raises(ConfigError, match=f"unknown {field} '{value}'"):
            ap_version_of(bad)


# -- the solver's test pass: `deepspark train` with eval_type "detection" logs the fork solver's mAP ------------

NET = """layer {{ name: "in" type: "HDF5Data" top: "det" top: "gt" hdf5_data_param {{ source: "{list}" batch_size: 1 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "det" top: "ip" include {{ phase: TRAIN }}
  inner_product_param {{ num_output: 1 weight_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "loss" type: "Reduction" bottom: "ip" top: "loss" loss_weight: 1 include {{ phase: TRAIN }} }}
layer {{ name: "ev" type: "DetectionEvaluate" bottom: "det" bottom: "gt" top: "ev" include {{ phase: TEST }}
  detection_evaluate_param {{ num_classes: 4 }} }}
"""


def detection_solver(folder, version):
    """A solver whose one test pass (2 iterations) evaluates test_detect's detections against its ground truth,
    stored in an HDF5 file that its net reads."""
    from test_detect import TRUTH, evaluated_detections
    with h5py.File(folder / "ev.h5", "w") as stream:
        stream["det"], stream["gt"] = evaluated_detections(), TRUTH.reshape(1, 1, -1, 8)
    (folder / "list.txt").write_text(f"{folder}/ev.h5\n")
    (folder / "net.prototxt").write_text(NET.format(list=folder / "list.txt"))
    solver = folder / f"{version}.prototxt"
    solver.write_text(f'net: "{folder}/net.prototxt"\ntest_iter: 2\ntest_interval: 100\ntest_initialization: true\n'
                      f'base_lr: 0\nlr_policy: "fixed"\neval_type: "detection"\nap_version: "{version}"\nmax_iter: 1\n'
                      f'snapshot_prefix: "{folder}/snapshot"\n')  # its snapshot and train.log there, not in the cwd
    return str(solver)


def logged_map(text):
    found = re.findall(r"Test net output #0: ev = ([0-9.e+-]+)", text)
    assert len(found) == 1, text[-3000:]
    return float(found[0])


def test_train_logs_the_detection_map_of_its_test_pass(tmp_path):
    from test_detect import evaluate
    status, _, err = run_cli("train", "--solver", detection_solver(tmp_path, "11point"), "--algorithm", "single")
    assert status == 0, err[-3000:]
    rows = evaluate("tensorflow", "")  # the same rows, twice over the two test iterations
    assert logged_map(err) == pytest.approx(mean_average_precision([rows, rows], "11point")[0], abs=1e-6)
    assert 0 < logged_map(err) < 1


@pytest.mark.caffe
def test_the_map_is_the_one_pycaffes_solver_logs(pycaffe, tmp_path):
    solver = detection_solver(tmp_path, "MaxIntegral")
    script = "import sys\nfrom deepspark.backends.caffe import runtime\nruntime.caffe().get_solver(sys.argv[1]).step(1)\n"
    theirs = subprocess.run([sys.executable, "-c", script, solver], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "GLOG_logtostderr": "1", "GLOG_minloglevel": "0", "PYTHONPATH": ROOT})
    status, _, err = run_cli("train", "--solver", solver, "--algorithm", "single")
    assert status == 0, err[-3000:]
    assert logged_map(err) == pytest.approx(logged_map(theirs.stderr), abs=1e-6)
