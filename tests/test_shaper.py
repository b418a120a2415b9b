"""bench/_shaper.py, the token-bucket proxy the network benchmarks shape loopback with: it never carries more than
its bandwidth, adds its latency, shares the driver's link among the workers, and carries the exchange unchanged."""

import socket
import threading
import time

import numpy as np

from conftest import load_script
from deepspark.algorithms.easgd import EasgdHandler
from deepspark.exchange import ExchangeClient, ExchangeServer

shaper = load_script("bench/_shaper.py", "bench_shaper")

MBIT = 1e6 / 8  # bytes per second


def test_a_transfer_takes_at_least_its_bytes_over_the_bandwidth_and_halving_it_doubles_the_time():
    size = 2 << 20
    address, close = shaper.sink(size)
    try:
        times = {}
        for mbit in (40, 80):
            with shaper.Shaper(address, bandwidth=mbit * MBIT) as proxy:
                times[mbit] = shaper.transfer_seconds(proxy.address, size)
            assert times[mbit] >= size / (mbit * MBIT)  # never faster than the link
        assert 1.5 < times[40] / times[80] < 2.5, times
    finally:
        close()


def test_latency_is_added_each_way():
    echo = socket.create_server(("127.0.0.1", 0))

    def serve():
        sock, _ = echo.accept()
        while data := sock.recv(16):
            sock.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    with shaper.Shaper(echo.getsockname()[:2], bandwidth=1000 * MBIT, latency=0.02) as proxy:
        sock = socket.create_connection(proxy.address)
        rtts = []
        for _ in range(5):
            started = time.monotonic()
            sock.sendall(b"ping")
            assert sock.recv(16) == b"ping"
            rtts.append(time.monotonic() - started)
        sock.close()
    echo.close()
    assert min(rtts) >= 0.04  # 20 ms there and 20 ms back


def test_the_workers_share_the_drivers_link():
    size, bandwidth = 1 << 20, 40 * MBIT
    address, close = shaper.sink(size)
    try:
        with shaper.Shaper(address, bandwidth=bandwidth) as proxy:
            alone = shaper.transfer_seconds(proxy.address, size)
            spans = []

            def push():
                began = time.monotonic()
                shaper.transfer_seconds(proxy.address, size)
                spans.append((began, time.monotonic()))

            threads = [threading.Thread(target=push) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        # two workers' bytes queue on the driver's one link: the later one finishes after both have crossed it,
        # counted from the first one's start (the second thread may start a few ms later: its own time is shorter)
        both = max(end for _, end in spans) - min(began for began, _ in spans)
        assert both >= 2 * size / bandwidth and alone >= size / bandwidth, (both, alone)
    finally:
        close()


def test_the_exchange_through_the_shaper_is_the_exchange():
    center = np.linspace(-1, 1, 100_000, dtype=np.float32)
    with ExchangeServer(center, b"s", EasgdHandler(0.5, consistent=True)) as server, \
            shaper.Shaper(server.address, bandwidth=200 * MBIT, latency=0.001) as proxy:
        client = ExchangeClient(proxy.address, b"s", 0, timeout=30.0)
        x = np.zeros_like(center)
        for _ in range(3):
            client.exchange(x)
        client.close()
        expected_x, expected_center = np.zeros_like(center), center.copy()
        for _ in range(3):
            d = np.float32(0.5) * (expected_x - expected_center)
            expected_x -= d
            expected_center += d
        np.testing.assert_array_equal(x, expected_x)
        np.testing.assert_array_equal(server.pull(), expected_center)
        assert proxy.bytes["to_driver"] >= 3 * 4 * center.size
