"""The exchange server's handshake under a flood of slow and garbage connections: a worker still joins, rejoins and
exchanges, and the center stays untouched by the flood (loopback only, bounded in connections and time)."""

import os
import socket
import threading
import time

import numpy as np

from deepspark.algorithms.easgd import EasgdHandler
from deepspark.exchange import ExchangeClient, ExchangeServer
from deepspark.exchange import protocol as P

from test_exchange import N, SECRET, SHAPES, bits, make_center, wait_for

HELLO = P.encode_header(P.HELLO, 7, length=P.NONCE_SIZE) + bytes(P.NONCE_SIZE)


class Lane:
    """One flooding connection from `source`, opened again whenever the server closes it: "slow" sends a HELLO a
    byte every `drip` seconds (each read's own timeout never fires), "garbage" sends junk once and waits."""

    def __init__(self, kind, source, drip=0.2):
        self.kind, self.source, self.drip = kind, source, drip
        self.sock, self.sent, self.next = None, 0, 0.0

    def tick(self, address, now, counts):
        if self.sock is None:
            if now < self.next:
                return
            self.sock = socket.socket()
            self.sock.bind((self.source, 0))
            self.sock.setblocking(False)
            self.sock.connect_ex(address)
            self.sent, self.next = 0, now
            counts["connects"] += 1
        try:
            if self.sock.recv(4096) == b"":
                return self.cut(now, counts)
        except BlockingIOError:
            pass
        except OSError:
            return self.cut(now, counts)
        if now >= self.next and self.sent < len(HELLO):
            try:
                if self.kind == "garbage":
                    self.sock.send(os.urandom(64))
                    self.sent = len(HELLO)  # once
                else:
                    self.sent += self.sock.send(HELLO[self.sent:self.sent + 1])
                self.next = now + self.drip
            except BlockingIOError:
                pass  # not connected yet
            except OSError:
                self.cut(now, counts)

    def cut(self, now, counts):
        self.sock.close()
        self.sock = None
        self.next = now + (0.5 if self.kind == "garbage" else 0.0)  # junk is refused at once: pace its reconnects
        counts["cut"] += 1

    def close(self):
        if self.sock is not None:
            self.sock.close()


class Flood(threading.Thread):
    """Lanes kept up against `address` until stop()."""

    def __init__(self, address, lanes):
        super().__init__(daemon=True)
        self.address, self.lanes = address, lanes
        self.counts = {"connects": 0, "cut": 0}
        self._halt = threading.Event()

    def run(self):
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                for lane in self.lanes:
                    lane.tick(self.address, now, self.counts)
                time.sleep(0.02)
        finally:
            for lane in self.lanes:
                lane.close()

    def stop(self):
        self._halt.set()
        self.join(10.0)


def test_a_worker_joins_and_rejoins_through_a_flood_of_slow_and_garbage_connections(caplog):
    center = make_center()
    # The server's own limits (64 strangers, 16 an address); a 2 s handshake deadline keeps the test short.
    srv = ExchangeServer(center, SECRET, EasgdHandler(0.5, consistent=True), shapes=SHAPES, handshake_timeout=2.0,
                         timeout=10.0).start()
    lanes = ([Lane("slow", "127.0.0.1") for _ in range(30)]  # beside the worker: more than its address's slots
             + [Lane("slow", f"127.0.1.{i}") for i in range(1, 41)]  # strangers, more than their slots
             + [Lane("garbage", f"127.0.2.{i % 10 + 1}") for i in range(30)])
    flood = Flood(srv.address, lanes)
    try:
        flood.start()
        wait_for(lambda: flood.counts["connects"] >= 100 and srv.gate.evictions > 0, timeout=10.0)  # full
        time.sleep(2.5)  # past the deadline
        assert bits(srv.pull()) == bits(center)  # the flood did not touch the center
        x = np.zeros(N, dtype=np.float32)
        for attempt in range(3):  # a join, then rejoins from a worker's address
            before = srv.pull()
            client = ExchangeClient(srv.address, SECRET, 1, shapes=SHAPES, timeout=10.0)  # the job's retries
            client.connect()
            mine = x.copy()
            assert client.exchange(mine) == "applied"
            client.close()
            d = np.float32(0.5) * (x - before)
            np.testing.assert_allclose(srv.pull(), before + d, rtol=0, atol=1e-6)
            np.testing.assert_allclose(mine, x - d, rtol=0, atol=1e-6)
            assert srv.stats()[1]["connections"] == attempt + 1
        # Slow connections were closed (by the deadline, or to make way) and came back; how many of each depends on
        # the machine's pace (test_a_handshake_sent_a_byte_at_a_time_is_cut_at_its_deadline has the deadline alone).
        assert any("made way for a newer connection" in record.getMessage() for record in caplog.records)
        assert flood.counts["cut"] > 30
    finally:
        flood.stop()
        srv.stop()


def test_a_handshake_sent_a_byte_at_a_time_is_cut_at_its_deadline():
    srv = ExchangeServer(make_center(), SECRET, EasgdHandler(0.5), shapes=SHAPES, handshake_timeout=1.0).start()
    try:
        with socket.create_connection(srv.address, timeout=0.2) as s:
            reply = b""
            for byte in HELLO:  # 0.2 s a byte: 72 bytes would take 14 s, each read well within 1 s
                try:
                    s.sendall(bytes([byte]))
                    reply = s.recv(4096)
                    break  # the server answered (its ERROR) or closed
                except socket.timeout:
                    continue
            h = P.decode_header(reply[:P.HEADER_SIZE])
            assert h.type == P.ERROR and h.flags == P.E_TIMEOUT
            assert "handshake not done within 1s" in P.decode_error(reply[P.HEADER_SIZE:P.HEADER_SIZE + h.length])
    finally:
        srv.stop()


def test_strangers_that_stay_silent_hold_at_most_max_handshakes_connections_and_the_oldest_makes_way():
    srv = ExchangeServer(make_center(), SECRET, EasgdHandler(0.5, consistent=True), shapes=SHAPES,
                         handshake_timeout=30.0, max_handshakes=2).start()
    try:
        threads = threading.active_count()
        with socket.create_connection(srv.address, timeout=5.0) as first, \
                socket.create_connection(srv.address, timeout=5.0) as second:  # silent: up to 30 s each
            wait_for(lambda: srv.open_connections == 2)
            with socket.create_connection(srv.address, timeout=5.0) as third:
                assert first.recv(1) == b""  # the oldest closed, unanswered, to make way
                wait_for(lambda: srv.open_connections == 2 and threading.active_count() == threads + 2)
                assert srv.refused[-1][1].startswith("made way for a newer connection (2 from strangers' addresses")
                # A worker gets in at once (the silent second makes way) and exchanges beside the silent third.
                client = ExchangeClient(srv.address, SECRET, 1, shapes=SHAPES, timeout=10.0, retries=1)
                client.connect()
                assert second.recv(1) == b""
                assert client.exchange(np.zeros(N, dtype=np.float32)) == "applied"
                client.close()
                third.sendall(P.encode_header(P.PULL, 1))  # still served: refused for what it says
                assert third.recv(1) != b""
    finally:
        srv.stop()
