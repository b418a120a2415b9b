"""bench/network.py: which runs each link gets, and what a worker sent, read from the summary lines a job writes."""

import dataclasses

from conftest import load_script
from deepspark import plan
from deepspark.exchange import protocol

bench = load_script("bench/network.py", "bench_network")

LENET = plan.Costs(step=0.01, batch=64, floats=431_080, server=0.001, worker=0.001)


def summary(worker, iterations, exchanges, sent, received):
    """A worker's summary line as deepspark/spark/job.py logs it."""
    return (f"I1204 00:11:02.200141 10026 deepspark] Worker {worker} on vm (in /w, deepspark from /w/deepspark): "
            f"{iterations} iterations, {exchanges} exchanges, spilled 30000 records in 0.36s, trained 198.5s, blocked "
            f"on exchange 1.26s, sent {sent} MB and received {received} MB through the exchanger, peak RSS 270 MB "
            "after the spill, 409 MB")


def test_every_link_trains_the_slow_link_runs_to_accuracy_and_the_coded_runs_per_iteration():
    slow = bench.runs_of("lenet", "100M", quick=False)
    assert {name for name, (_, accuracy) in slow.items() if accuracy} == set(bench.EVERY_LINK)
    assert slow[bench.tta.COMPRESSED][0] == {"algorithm": "easgd", "period": 32, "exchange_codec": "int4"}
    assert not slow["sync, int8"][1] and not slow["sync"][1]  # sync: per iteration only, on the slow link
    gigabit = bench.runs_of("lenet", "1G", quick=False)
    assert gigabit["sync, learning rate x2"][1] and gigabit["easgd period 64"][1]  # the #14 targets' runs, as before
    assert set(bench.runs_of("wide", "100M", quick=False)) == set(bench.RUNS) | set(bench.CODED["wide"])
    assert set(bench.runs_of("wide", "1G", quick=True)) == set(bench.QUICK_RUNS)
    assert bench.runs_of("lenet", "1G", quick=True) == {}


def test_a_worker_sends_its_frames_a_period_and_the_rest_is_the_snapshots_histories():
    int4 = dataclasses.replace(LENET, codec="int4")
    frame = protocol.HEADER_SIZE + 431_080 // 2 + 4 * 1684 + protocol.TAG_SIZE
    log = "\n".join([summary(0, 1600, 100, 46.2, 24.5), summary(1, 1600, 100, 45.2, 24.5)])
    record = bench.traffic(log, int4, {"algorithm": "easgd", "period": 16, "exchange_codec": "int4"})
    assert record["frame_bytes"] == frame and record["bytes_from"] == "summaries"
    assert record["bytes_per_iteration"] == round(frame * 100 / 1600)
    assert record["sent_mb_per_worker"] == 45.7 and record["received_mb_per_worker"] == 24.5
    assert record["histories_mb_per_worker"] == round(45.7 - frame * 100 / 1e6, 3)
    # A run stopped at its cap prints no summaries: its frames' arithmetic, one a period (sync: one an iteration).
    capped = bench.traffic("", LENET, {"algorithm": "sync"})
    assert capped["bytes_per_iteration"] == protocol.HEADER_SIZE + 4 * 431_080 + protocol.TAG_SIZE
    assert capped["bytes_from"].startswith("frame arithmetic")
    # Average moves float32 models through Spark, S each way a round.
    assert bench.traffic("", LENET, {"algorithm": "average", "period": 10}) == {
        "bytes_through": "spark", "bytes_per_iteration": round(4 * 431_080 / 10)}


def test_sent_figures_in_exponent_form_parse():
    record = bench.traffic(summary(0, 300, 300, "1.04e+03", "1.04e+03"), LENET, {"algorithm": "sync"})
    assert record["sent_mb_per_worker"] == 1040.0 and record["exchanges_per_worker"] == 300
