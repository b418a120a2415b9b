"""Net.forward called again and again, as a detector calls it at batch 1: what the caller writes into the params
between calls is what the next call uses, though unchanged params are not set into the backend again."""

import os

import numpy as np
import pytest

import deepspark

PNET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "zoo", "mtcnn_det1.prototxt")


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_params_written_between_forwards_are_used(backend):
    data = np.random.default_rng(3).uniform(-1, 1, (1, 3, 12, 12)).astype(np.float32)
    net = deepspark.Net(PNET, backend=backend, seed=2)
    first = {name: value.copy() for name, value in net.forward(data=data).items()}
    again = net.forward(data=data)
    assert all(np.array_equal(again[name], first[name]) for name in first)
    net.params["conv1"][0].data[...] *= 0.5  # in place, as with pycaffe's
    net.params["conv2"][1].data = net.params["conv2"][1].data + 0.25  # through the setter
    changed = net.forward(data=data)
    fresh = deepspark.Net(PNET, backend=backend, seed=2)
    fresh.params["conv1"][0].data[...] *= 0.5
    fresh.params["conv2"][1].data[...] += 0.25
    expected = fresh.forward(data=data)
    assert not np.allclose(changed["conv4-2"], first["conv4-2"])
    for name in expected:
        np.testing.assert_allclose(changed[name], expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("caffe", marks=pytest.mark.caffe)])
def test_a_params_array_kept_from_before_the_first_forward_is_read_at_every_forward(backend):
    """An array read out of net.params before any forward and written after several: Net skips setting
    parameters that were never read out, and compares the ones that were."""
    data = np.random.default_rng(4).uniform(-1, 1, (1, 3, 12, 12)).astype(np.float32)
    net = deepspark.Net(PNET, backend=backend, seed=2)
    kept = net.params["conv3"][0].data
    first = {name: value.copy() for name, value in net.forward(data=data).items()}
    net.forward(data=data)
    kept[...] *= 0.5
    changed = net.forward(data=data)
    assert not np.allclose(changed["conv4-2"], first["conv4-2"])
    kept[...] *= 2.0  # back to the first values, bit for bit
    again = net.forward(data=data)
    assert all(np.array_equal(again[name], first[name]) for name in first)
