"""bench/communication.py's section of the results page: a row per model and period from its records, the paper's ~10% compared with figures computed from them."""

import os

from conftest import ROOT, load_script

bench = load_script("bench/communication.py", "bench_communication")


def record(model, period, overlap, share, projected=None, floats=431080, per_iteration=0.02):
    return {"bench": "communication", "model": model, "floats": floats, "period": period, "overlap": overlap,
            "blocked_share": share, "worker_blocked_shares": [share, share], "seconds_per_iteration": per_iteration,
            "exchanges": [10, 10], "projected_exchange_share": projected, "load_average": 1.5 + period / 10,
            "cores": 2}


def test_the_section_tables_each_period_and_compares_with_the_paper():
    records = [{"bench": "communication", "figure": "loopback", "bandwidth_gbit": 12.5, "latency_ms": 0.007},
               record("lenet", 1, True, 0.05, 0.15), record("lenet", 1, False, 0.25, 0.27),
               record("lenet", 10, True, 0.002, per_iteration=0.019), record("lenet", 10, False, 0.04),
               record("wide", 10, True, 0.3, floats=7007598)]
    text = bench.page_section(records, os.path.join(ROOT, "docs", "data"))
    assert "| lenet | 431,080 | 1 | 5.0% | 25.0% | 20.0 points (80% of it) | 20.0 ms | 20.0 ms | 15.0% | 27.0% |" \
        in text
    assert "| lenet | 431,080 | 10 | 0.2% | 4.0% | 3.8 points (95% of it) |" in text
    assert "| wide | 7,007,598 | 10 | 30.0% | — | — |" in text
    assert "lenet (431,080 parameters, periods 1, 10): overlapped 0.2–5.0%, at or under 10% at periods 1, 10; " \
           "not overlapped 4.0–25.0%, at or under 10% at period 10; time per iteration overlapped against not " \
           "-5.0% to +0.0%" in text
    assert "wide (7,007,598 parameters, period 10): overlapped 30.0%, at or under 10% at no period" in text
    assert "`docs/data/communication.jsonl`" in text and "12.5 Gbit/s" in text
    assert "load average at the runs' ends was 1.6 to 2.5 on 2 cores" in text


def test_a_section_without_records_says_how_to_make_them():
    assert "bench/communication.py" in bench.page_section([], os.path.join(ROOT, "docs", "data"))
