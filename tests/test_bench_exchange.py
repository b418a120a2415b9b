"""bench/exchange.py's selectors server applies the same EASGD rule as ExchangeServer, partial replies included."""

import threading

import numpy as np
import pytest

from deepspark.exchange import ExchangeClient
from conftest import load_script
import reference

bench = load_script("bench/exchange.py", "bench_exchange")


@pytest.mark.parametrize("n", [1000, 4_000_000])  # 16 MB replies go out in several sends
def test_selectors_server_is_easgd(n):
    server = bench.SelectorsServer(n)
    serving = threading.Thread(target=server.serve, args=(2, 60.0))
    serving.start()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    want_xs, want_center = [x.copy() for x in xs], np.zeros(n, dtype=np.float32)
    clients = [ExchangeClient(("127.0.0.1", server.port), bench.SECRET, w, timeout=30.0, integrity=False)  # its frames
               for w in range(2)]
    try:
        for w in (0, 1, 1, 0):
            clients[w].exchange(xs[w], iteration=1)
            reference.easgd_step(want_xs[w], want_center, bench.ALPHA)
    finally:
        for c in clients:
            c.close()
        serving.join(60.0)
        server.stop()
    assert not serving.is_alive()
    assert server.exchanges == 4
    for x, want in zip(xs, want_xs):
        np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(server.center, want_center, rtol=1e-6, atol=1e-6)


def test_placement():
    assert bench._placement("free", {0, 1}) is None
    assert bench._placement("same", {2, 3}) == ({2}, {2})
    assert bench._placement("apart", {2, 3}) == ({2}, {3})
