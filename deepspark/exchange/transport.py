"""Socket plumbing shared by the exchange server and client: exact reads into preallocated buffers, scatter sends, socket options."""

import socket

from . import protocol


# Slices of the elastic update. While x is still arriving, the server computes
# d = α(x − x̃) and checks it in RECV_SLICE pieces, so the arithmetic runs while the
# worker's core is still sending; once all of x is in, the rest goes in one piece
# (fewest numpy calls). Two regimes show on this 2-core machine (LeNet size, short
# turns interleaved with a raw echo in the same run): when the worker and the server
# run on different cores, 64K-float pieces give 15–20% more round trips than the whole
# vector (32K pieces lose part of it to per-call overhead); when the scheduler puts
# them on one core (or `taskset -c 0`) nothing overlaps, x is all in at the first read,
# and slicing it anyway cost 3–30%, which computing the rest whole avoids.
# Big models keep SLICE_FLOATS pieces as x arrives: 64K pieces there meant 4× the
# numpy calls and cost 6% of the round trips (GoogLeNet and 25M, on two CPUs).
# The reply goes back whole below PIPELINE_BYTES, because extra sends cost the worker
# wake-ups (measured: LeNet-size exchanges ran at 0.6× a raw echo with a sliced reply);
# above it the server adds d to x̃ and sends it in SLICE_FLOATS pieces, so the worker
# applies while the server adds.
# The worker's x −= d runs in APPLY_SLICE pieces as d arrives at every size: its
# receive loop is the same either way, so only the numpy calls are added (LeNet
# size: 0.7× → 0.9–1.0× echo).
RECV_SLICE = 1 << 16
SLICE_FLOATS = 1 << 18
PIPELINE_BYTES = 16 << 20
APPLY_SLICE = 1 << 17


def slice_floats(n, chunk=None):
    """(floats per slice as x arrives, floats per slice of the reply) for an n-float model.

    `chunk` overrides both, so that small-chunk tests cover every slicing path.
    """
    if chunk:
        c = max(1, min(int(chunk), n))
        return c, c
    if 4 * n <= PIPELINE_BYTES:
        return min(n, RECV_SLICE), n
    return SLICE_FLOATS, SLICE_FLOATS


class PeerClosed(ConnectionError):
    """The peer closed the connection, possibly in the middle of a frame."""


def tune(sock):
    # Small frames (headers, PULL, REPORT) must not wait for Nagle; the kernel's
    # own buffer autotuning beats fixed SO_SNDBUF/SO_RCVBUF sizes on loopback (measured).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def byte_view(array):
    """A writable/readable byte memoryview of a contiguous numpy array (no copy)."""
    return memoryview(array).cast("B")


def recv_exact(sock, view):
    """Fill `view` completely from `sock`; PeerClosed if the stream ends first."""
    got, want = 0, len(view)
    while got < want:
        k = sock.recv_into(view[got:])
        if not k:
            raise PeerClosed("peer closed the connection after %d of %d bytes" % (got, want))
        got += k


def recv_header(sock, view, model_bytes):
    """Read and validate one header into `view` (HEADER_SIZE bytes)."""
    recv_exact(sock, view)
    return protocol.decode_header(view, model_bytes)


def send_frame(sock, header, payload=None):
    """Send a header and an optional payload (a byte view) with one syscall when the kernel takes it all."""
    if payload is None or len(payload) == 0:
        sock.sendall(header)
        return
    sent = sock.sendmsg([header, payload])
    hlen = len(header)
    if sent < hlen:
        sock.sendall(memoryview(header)[sent:])
        sock.sendall(payload)
    elif sent - hlen < len(payload):
        sock.sendall(payload[sent - hlen:])
