"""The bundled pycaffe's extra neuron types (brocolli-caffe 9.0.2: ReLU6, HardSwish, HardSigmoid) on both
backends against it: forward, and the diff its Backward gives (ReLU6's; HardSwish's and HardSigmoid's is empty,
so that no diff reaches their input, except in place, where the input's diff is the top's own)."""

import numpy as np
import pytest

from deepspark.backends.caffe import runtime
from test_zoo_layers import L, check_backends, normal, seeded  # noqa: F401 (seeded: a fixture)

pytestmark = pytest.mark.caffe

tf = pytest.importorskip("tensorflow")


@pytest.fixture(scope="module", autouse=True)
def pycaffe():
    try:
        return runtime.caffe()
    except ImportError as error:
        pytest.skip(str(error))


# A copy of x (Power's identity), so that a layer in place rewrites the copy, not the Parameter's own blob.
COPY = L("copy", "Power", ["x"])


def relu6_reference(x, slope=0.0, threshold=6.0):
    return np.minimum(np.maximum(x, 0) + slope * np.minimum(x, 0), threshold)


@pytest.mark.parametrize("body, slope, threshold", [("", 0.0, 6.0),
                                                    ("relu6_param { negative_slope: 0.1 threshold: 2 }", 0.1, 2.0)])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu6(body, slope, threshold, in_place):
    x = normal(2, 3, 4, 5) * 4
    x[0, 0, 0, :2] = [0.0, threshold]  # the edges: Caffe's diff is the slope at 0 and none at the threshold
    top = "copy" if in_place else "r"
    values, diffs = check_backends(COPY + L("r", "ReLU6", ["copy"], body, [top]), {"x": x}, ranks={top: 4})
    np.testing.assert_allclose(values[top], relu6_reference(x, slope, threshold), rtol=1e-6)
    assert diffs["x"][0][0, 0, 0, 1] == 0


@pytest.mark.parametrize("kind, body, reference", [
    ("HardSwish", "", lambda x: x * np.clip(x / 6 + 0.5, 0, 1)),
    ("HardSigmoid", "", lambda x: np.clip(0.2 * x + 0.5, 0, 1)),
    ("HardSigmoid", "hardsigmoid_param { alpha: 0.3 beta: 0.4 }", lambda x: np.clip(0.3 * x + 0.4, 0, 1)),
])
def test_hard_neurons_and_their_empty_backward(kind, body, reference):
    """Beside a layer of the type, a ReLU on a second input gives the check a diff to compare: the type's own
    input gets none from Caffe's empty Backward; in place, its input's diff is the probe's."""
    x, y, z = normal(2, 3, 4, 5) * 4, normal(2, 3), normal(2, 3, 4, 5) * 4
    layers = (L("h", kind, ["x"], body) + L("r", "ReLU", ["y"]) + L("zc", "Power", ["z"])
              + L("hz", kind, ["zc"], body, ["zc"]))
    values, diffs = check_backends(layers, {"x": x, "y": y, "z": z}, ranks={"h": 4, "r": 2, "zc": 4})
    np.testing.assert_allclose(values["h"], reference(x), rtol=1e-6, atol=1e-7)
    assert not np.any(diffs["x"][0]) and np.any(diffs["z"][0])
