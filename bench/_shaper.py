"""A commodity network on loopback, shaped in user space (the kernel here has no netem): a token-bucket proxy between the workers and the exchanger, for the benchmarks (#14); not a product feature.

Each connection a worker opens to the proxy is its node's link; all of them reach the
exchanger through one more link, the driver's. Every link has `bandwidth` bytes per
second each way (full duplex) and a byte crosses it after `latency` seconds one way:

    a chunk read at t leaves the proxy at  max(worker link free, driver link free, t) + size / bandwidth + latency

where each link is a reservation clock (the time it is next free), so that the
workers' traffic queues on the driver's link as it would on a real switch port.
Python's sleep and socket copies bound what it can emulate: `ceiling()` measures the
proxy's own throughput with no shaping, and a benchmark says when a setting nears it.
"""

import collections
import socket
import threading
import time

CHUNK = 64 << 10  # bytes read at a time: ~0.5 ms at 1 Gbit/s, small beside a LeNet exchange (1.7 MB)


class Link:
    """One direction of a link: bytes cross it one after another at `bandwidth` bytes per second."""

    def __init__(self, bandwidth):
        self.bandwidth = bandwidth
        self.free = 0.0  # time.monotonic() when it is next free
        self.lock = threading.Lock()

    def reserve(self, size, ready):
        """The time `size` bytes that are ready at `ready` have crossed this link."""
        with self.lock:
            self.free = max(self.free, ready) + size / self.bandwidth
            return self.free


class Shaper:
    """A proxy on 127.0.0.1:`port` (0: a free one) to `target` (host, port), shaping as the module says.

    bandwidth: bytes per second each way of every link (None: unshaped); latency: seconds one way.
    """

    def __init__(self, target, bandwidth=None, latency=0.0, port=0):
        self.target, self.bandwidth, self.latency = tuple(target), bandwidth, latency
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.2)
        self.address = self.listener.getsockname()[:2]
        # The driver's link, one per direction, shared by every worker's connection.
        self.to_driver, self.from_driver = (Link(bandwidth), Link(bandwidth)) if bandwidth else (None, None)
        self.bytes = {"to_driver": 0, "from_driver": 0}
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True, name="shaper-accept")]
        self.threads[0].start()

    def _accept(self):
        while not self.stopping.is_set():
            try:
                worker, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                driver = socket.create_connection(self.target)
            except OSError:
                worker.close()
                continue
            for sock in (worker, driver):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # This worker's node link, one per direction.
            up, down = (Link(self.bandwidth), Link(self.bandwidth)) if self.bandwidth else (None, None)
            for source, sink, links, name in ((worker, driver, (up, self.to_driver), "to_driver"),
                                              (driver, worker, (self.from_driver, down), "from_driver")):
                self._pipe(source, sink, links, name)

    def _pipe(self, source, sink, links, name):
        """One direction of one connection: a reader stamps what arrives; a writer sends each chunk when the
        links have carried it and its latency has passed."""
        queue, ready = collections.deque(), threading.Condition()

        def read():
            try:
                while True:
                    data = source.recv(CHUNK)
                    now = time.monotonic()
                    with ready:
                        queue.append((now, data))
                        ready.notify()
                    if not data:
                        return
            except OSError:
                with ready:
                    queue.append((time.monotonic(), b""))
                    ready.notify()

        def write():
            try:
                while True:
                    with ready:
                        while not queue:
                            ready.wait()
                        arrived, data = queue.popleft()
                    if not data:
                        break
                    crossed = max((link.reserve(len(data), arrived) for link in links if link), default=arrived)
                    delay = crossed + self.latency - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    sink.sendall(data)
                    self.bytes[name] += len(data)
            except OSError:
                pass
            finally:
                for sock in (sink, source):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        for target in (read, write):
            thread = threading.Thread(target=target, daemon=True, name=f"shaper-{name}")
            thread.start()
            self.threads.append(thread)

    def close(self):
        self.stopping.set()
        self.listener.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def transfer_seconds(address, size):
    """Seconds to push `size` bytes through `address` to a sink that answers one byte when it has them all."""
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    block = bytes(min(size, 1 << 20))
    started = time.monotonic()
    left = size
    while left:
        sock.sendall(block[:min(left, len(block))])
        left -= min(left, len(block))
    sock.recv(1)
    seconds = time.monotonic() - started
    sock.close()
    return seconds


def sink(size):
    """A server on loopback that reads `size` bytes per connection and answers one byte; (address, stop)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                sock, _ = server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            buf, left = memoryview(bytearray(1 << 20)), size
            while left:
                got = sock.recv_into(buf[:min(left, len(buf))])
                if not got:
                    break
                left -= got
            sock.sendall(b"k")
            sock.close()

    threading.Thread(target=serve, daemon=True).start()

    def close():
        stop.set()
        server.close()

    return server.getsockname()[:2], close


def ceiling(size=64 << 20):
    """The proxy's own throughput unshaped, bytes per second: what no setting can exceed here."""
    address, close = sink(size)
    try:
        with Shaper(address) as shaper:
            return size / transfer_seconds(shaper.address, size)
    finally:
        close()
