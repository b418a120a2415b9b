"""bench/exchange_load.py at small scale: every client progresses, and connecting and leaving in a loop loses nothing and leaves nothing behind."""

from conftest import load_script

bench = load_script("bench/exchange_load.py", "bench_exchange_load")


def test_load_and_reconnect_loop():
    # The connection buffers are mappings of their own (transport.mapped): RSS shows what the server keeps. A leak
    # of 1/12 of a model buffer per connection adds four buffers over the 48 connections after the first phase
    # (with malloc'd buffers glibc's arenas kept tens of buffers: bench/exchange_load.py). Less is noise:
    # one more thread's stack and arena when a phase's connections overlap moved RSS by 1.9 MB in one CI run.
    load, loop = bench.run("lenet", clients=4, seconds=2.0, cycles=16, phases=4, per_cycle=3)
    buffer_mb = load["model_buffer_bytes"] / 2 ** 20

    assert load["per_client_exchanges_per_s"]["min"] > 0  # no client starved outright
    assert load["server_counted_all"] and load["client_reconnects"] == 0
    assert load["server_open_connections"] == {"connected": 4, "after": 0}
    threads = load["server_threads"]
    assert threads["connected"] == threads["idle"] + 4 and threads["after"] == threads["idle"]
    assert load["bytes_per_connection"] >= load["model_buffer_bytes"]  # the buffers x and d pass through
    assert load["server_rss_mb"]["after"] - load["server_rss_mb"]["idle"] < buffer_mb  # freed as clients leave

    assert loop["connections"] == 64 and all(loop["endings"][e] > 0 for e in bench.ENDINGS)
    assert loop["client_exchanges"] == 4 * 16 * 3
    assert loop["server_exchanges"] == loop["client_exchanges"]  # half-sent frames counted by no one
    assert loop["counts_match"] and loop["per_worker_counts_match"]
    assert loop["client_reconnects"] == 0 and loop["refused"] == 0
    assert loop["open_connections_after_each_phase"] == [0, 0, 0, 0]
    assert loop["threads"]["after"] == loop["threads"]["before"]
    assert loop["center_finite"]
    assert loop["rss_last_minus_first_phase_mb"] < 4 * buffer_mb, loop["server_rss_mb_after_each_phase"]
