"""deepspark.detection_eval: the SSD fork's ComputeAP and TestDetection mAP on hand-computed rows, eval_type and
ap_version checked as the fork's solver does (#43)."""

import numpy as np
import pytest

from deepspark.detection_eval import AP_VERSIONS, ap_version_of, pass_map
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

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
