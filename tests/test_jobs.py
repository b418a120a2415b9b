"""What the Spark jobs take from the solver, without Spark: the moving-rate schedule the EASGD job
gives its exchanger (decay and its floor, moving_rate_limit), and Caffe's cadence arithmetic."""

import numpy as np
import pytest

from deepspark.exchange import ExchangeClient, ExchangeServer
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark import easgd
from deepspark.spark.job import last_multiple, next_multiple


def test_moving_rate_limit_is_the_floor_of_the_servers_decayed_rate():
    ds = pb.DeepSparkParameter(moving_rate=0.5, moving_rate_gamma=0.5, moving_rate_step=1, moving_rate_limit=0.2)
    center = np.zeros(6, np.float32)
    x = np.arange(1, 7, dtype=np.float32)
    expected_center, expected_x = center.copy(), x.copy()
    rates = []
    with ExchangeServer(center, "secret", easgd.handler(ds)) as server:
        with ExchangeClient(server.address, "secret", 0) as client:
            for k in range(5):
                rate = server.handler.moving_rate
                rates.append(rate)
                d = np.float32(rate) * (expected_x - expected_center)
                expected_x -= d
                expected_center += d
                client.exchange(x)
        np.testing.assert_allclose(server.pull(), expected_center, rtol=1e-6)
    np.testing.assert_allclose(x, expected_x, rtol=1e-6)
    assert rates == pytest.approx([0.5, 0.25, 0.2, 0.2, 0.2])  # without the floor: 0.125, 0.0625, ...


def test_without_a_limit_the_rate_decays_on():
    ds = pb.DeepSparkParameter(moving_rate=0.5, moving_rate_gamma=0.5, moving_rate_step=2)
    handler = easgd.handler(ds)
    assert handler.moving_rate == pytest.approx(0.5)
    assert easgd.handler(pb.DeepSparkParameter()).moving_rate == pytest.approx(pb.DeepSparkParameter().moving_rate)


def test_cadence_is_caffes_multiples():
    assert next_multiple(0, 500, include_current=True) == 0
    assert next_multiple(0, 500) == 500 and next_multiple(499, 500) == 500 and next_multiple(500, 500) == 1000
    assert next_multiple(123, 0) == float("inf")
    assert last_multiple(5046, 5000, 0) == 5000 and last_multiple(4990, 5000, 4000) == 4000
