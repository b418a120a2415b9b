"""What the Spark jobs take from the solver, without Spark: the moving-rate schedule the EASGD job
gives its exchanger (decay and its floor, moving_rate_limit), Caffe's cadence arithmetic, and the address the
workers are told."""

import numpy as np
import pytest

from synthetic import make_job

from deepspark.config import check_deepspark, load_solver, override
from deepspark.errors import ConfigError
from deepspark.algorithms.easgd import EasgdHandler
from deepspark.exchange import ExchangeClient, ExchangeServer
from deepspark.proto import deepspark_pb2 as pb
from deepspark.algorithms import easgd
from deepspark.engine import last_multiple, next_multiple
from deepspark.spark.job import Job


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


def test_the_workers_are_told_exchange_address_when_it_is_set_else_where_the_exchanger_listens(tmp_path):
    solver = load_solver(make_job(tmp_path))
    job = Job()  # run(plan) sets what a running job knows; here only its DeepSparkParameter and its server
    job.ds, job.server = solver.param.deepspark_param, None
    assert job.exchange_address() is None  # average: no exchanger
    with ExchangeServer(np.zeros(4, np.float32), b"s", EasgdHandler(0.5)) as job.server:
        assert job.exchange_address() == tuple(job.server.address)
        override(solver, exchange_address="proxy.example:7100")
        assert job.exchange_address() == ("proxy.example", 7100)
    for bad, line in (("noport", "exchange_address must be host:port, not 'noport'"),
                      ("h:99999", "exchange_address must be host:port, not 'h:99999'")):
        with pytest.raises(ConfigError, match=line):
            check_deepspark(pb.DeepSparkParameter(exchange_address=bad), "x")
    with pytest.raises(ConfigError, match=r"exchange_port must be a TCP port \(0 to 65535\), not 70000"):
        check_deepspark(pb.DeepSparkParameter(exchange_port=70000), "x")
