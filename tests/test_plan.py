"""The throughput model (deepspark.plan): its formulas on given costs, and `deepspark plan` on a real net."""

import re

import pytest

from conftest import run_cli
from deepspark import plan
from deepspark.algorithms import average, base, easgd, sync
from deepspark.proto import deepspark_pb2 as pb

# A 1 MB model, a 10 ms step of batch 64, 2 ms of the center's work and 1 ms of the worker's per exchange.
COSTS = plan.Costs(step=0.010, batch=64, floats=250_000, server=0.002, worker=0.001)
GIGABIT = plan.Network.of(1, 0.1)  # 125 MB/s each way, 0.1 ms


def test_easgd_is_the_formula_on_given_costs():
    # T_comm = 2 x 1 MB / 125 MB/s + 2 x 0.1 ms + 2 ms = 18.2 ms; 10 steps = 100 ms hide it: cycle 101 ms.
    assert base.exchange_seconds(COSTS, GIGABIT) == pytest.approx(0.0182)
    one = easgd.project(COSTS, GIGABIT, 1, period=10)
    assert one.cycle == pytest.approx(0.101)
    assert one.images_per_second == pytest.approx(640 / 0.101)
    assert one.speedup == pytest.approx(0.1 / 0.101)
    assert one.exchange_share == pytest.approx(1 - 0.1 / 0.101)
    # The center's link moves 1 MB each way per exchange: R = 125 exchanges/s, so it serves 12 workers
    # of 101 ms cycles; 64 workers queue, and the job runs at R x period x batch.
    assert base.center_rate(COSTS, GIGABIT) == pytest.approx(125)
    ds = pb.DeepSparkParameter(period=10)
    assert plan.saturation(COSTS, GIGABIT, ds) == 12
    many = easgd.project(COSTS, GIGABIT, 64, period=10)
    assert many.images_per_second == pytest.approx(125 * 10 * 64) and many.center_load == 1.0
    assert many.cycle == pytest.approx(64 / 125)
    # Blocking adds T_comm to every cycle instead of hiding it.
    assert easgd.project(COSTS, GIGABIT, 1, period=10, overlap=False).cycle == pytest.approx(0.1 + 0.0182 + 0.001)


def test_a_codec_moves_its_own_bytes_through_the_exchanger_and_float32_through_spark():
    import dataclasses
    int8 = dataclasses.replace(COSTS, codec="int8")
    # 250,000 int8 codes and a float32 scale per 256 of them: 253,908 bytes a frame, against 1 MB.
    assert int8.bytes == 250_000 + 4 * 977 and int8.spark_bytes == COSTS.bytes == 1_000_000
    assert base.exchange_seconds(int8, GIGABIT) == pytest.approx(2 * 253_908 / 125e6 + 0.0002 + 0.002)
    assert base.center_rate(int8, GIGABIT) == pytest.approx(125e6 / 253_908)  # 3.9x float32's 125
    assert sync.project(int8, GIGABIT, 4).cycle < sync.project(COSTS, GIGABIT, 4).cycle
    assert average.project(int8, GIGABIT, 4, 10).cycle == average.project(COSTS, GIGABIT, 4, 10).cycle


def test_sync_and_average_are_their_formulas():
    s = sync.project(COSTS, GIGABIT, 4)
    # a step + the worker's 1 ms + 4 vectors each way over the center's link + 2 latencies + 4 x 2 ms
    assert s.cycle == pytest.approx(0.010 + 0.001 + 2 * 4 * 1e6 / 125e6 + 0.0002 + 0.008)
    assert s.images_per_second == pytest.approx(4 * 64 / s.cycle)
    a = average.project(COSTS, GIGABIT, 4, period=10)
    assert a.cycle == pytest.approx(0.1 + 2 * 4 * 1e6 / 125e6 + 0.0002 + average.AVERAGE_ROUND_SECONDS)


def test_what_the_model_says_of_networks_and_periods():
    ds = pb.DeepSparkParameter(period=10)
    slow = plan.Network.of(0.1, 1.0)
    for n in (1, 2, 8, 32):
        # more bandwidth never slows a job; overlapping never loses to blocking; a longer period exchanges less
        assert easgd.project(COSTS, GIGABIT, n, 10).images_per_second >= easgd.project(COSTS, slow, n, 10).images_per_second
        assert easgd.project(COSTS, slow, n, 10).images_per_second >= \
            easgd.project(COSTS, slow, n, 10, overlap=False).images_per_second
        assert easgd.project(COSTS, slow, n, 64).exchange_share <= easgd.project(COSTS, slow, n, 10).exchange_share
        # on a commodity link, averaging every iteration through one center loses to EASGD
        assert sync.project(COSTS, slow, n).images_per_second < easgd.project(COSTS, slow, n, 10).images_per_second
    assert plan.saturation(COSTS, slow, ds) < plan.saturation(COSTS, GIGABIT, ds)
    assert plan.workers_to_show(64) == [1, 2, 4, 8, 16, 32, 64] and plan.workers_to_show(6) == [1, 2, 4, 6]


def test_plan_prints_the_table_for_a_model_folder():
    status, out, err = run_cli("plan", "--model", "models/lenet", "--workers", "16", "--bandwidth", "10",
                               "--latency", "0.1", "--period", "10", "--step-ms", "10", "--server-ms", "2")
    assert status == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("431,080 parameters (1.7 MB a vector), batch 64; a step 10.00 ms (tensorflow, 1 thread)")
    assert "the center 2.00 ms an exchange, a worker" in lines[0] and "10 Gbit/s links, 0.1 ms latency; easgd, " \
                                                                     "period 10, overlapped" in lines[0]
    rows = [line.split() for line in lines[2:7]]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16]
    images = [float(r[1].replace(",", "")) for r in rows]
    assert all(b > 1.9 * a for a, b in zip(images, images[1:]))  # 10 Gbit/s: below saturation, doubling doubles
    assert re.fullmatch(r"The single center saturates at \d+ workers: beyond that the job stays near [\d,]+ images/s "
                        r"\(a longer period, or a faster link to the driver, moves it\)", lines[-1])


def test_plan_says_the_learning_rate_rule_its_workers_run():
    status, out, err = run_cli("plan", "--model", "models/lenet", "--workers", "4", "--step-ms", "10", "--server-ms",
                               "2", "--lr-scaling", "sqrt", "--lr-warmup", "50")
    assert status == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == ("Learning rate: base_lr 0.01 x sqrt(4 workers) = 2 (sqrt) after 50 warm-up "
                                            "iterations from base_lr, as the policy schedules it")


def test_plan_measures_the_step_and_the_center_when_not_given():
    status, out, err = run_cli("plan", "--model", "models/lenet", "--workers", "2", "--algorithm", "sync")
    assert status == 0, err[-3000:]
    header = out.splitlines()[0]
    assert re.search(r"a step [\d.]+ ms \(tensorflow, 1 thread, measured here\); the center [\d.]+ ms an exchange "
                     r"\(measured here\)", header) and header.endswith("; sync")
    assert "saturates" not in out  # sync has no EASGD center to saturate


def test_a_net_without_a_loss_is_one_line():
    status, _, err = run_cli("plan", "--model", "models/lenet/deploy.prototxt", "--step-ms", "5")
    assert status == 1
    assert err.strip().splitlines()[-1] == (
        "deepspark plan: error: models/lenet/deploy.prototxt: plan times a training step, and this net has no "
        "loss: give a model folder, its solver or its train_val.prototxt")


def test_a_job_in_a_codec_times_the_worker_coding_its_frames():
    net, source, param, shape = plan.training_net("models/lenet")
    param.deepspark_param.exchange_codec = pb.DeepSparkParameter.INT4
    costs = plan.measure(net, source, param, pb.PlanParameter(cores=1, step_ms=5, server_ms=1), shape)
    # 431,080 codes two a byte and a float32 scale per 256 of them.
    assert costs.codec == "int4" and costs.bytes == 431_080 // 2 + 4 * 1684 and costs.worker > 0
