"""Which per-frame seal the exchanger should use (#27): LeNet-size round trips, sealed each way, against unsealed ones.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/seal.py [--floats 431080] [--seconds 2] [--repeats 3]

An echo peer in another process, each side on a core of its own where the machine has two: the client sends a
frame (header + float32 payload + tag), the peer checks the tag and sends the payload back sealed, the client
checks that tag. Each candidate gives per-frame integrity with replay protection: its tag covers the frame's
sequence number (in the MAC's input, or as the nonce), keyed per direction.

- hmac-sha256: HMAC-SHA256 over sequence, header, payload (the exchanger's seal through protocol version 3)
- blake2b: keyed BLAKE2b-256 over the same
- poly1305: Poly1305 under a one-time key from ChaCha20(key, sequence), as ChaCha20-Poly1305 makes it
- aes-gmac: AES-256-GCM authenticating header and payload (no encryption), the sequence as its IV
- tls: the stream inside TLS 1.3 (the standard library's ssl, AES-GCM), which encrypts as well

The echo prices each candidate alone: a frame hashed whole before it goes, checked whole after it came. The
exchanger itself (the target's figure) is measured the same way: a real ExchangeServer (EasgdHandler) in another
process on the other core and an ExchangeClient, EASGD round trips of LeNet's size with exchange_integrity on
against the same with it off, interleaved with the candidates. Its frames are hashed slice by slice as they are
read, and a model frame's tag is sent after its payload, so that each side hashes while the other does.

One JSON line per candidate (round trips a second, and its ratio to the unsealed ones measured in the same
repetitions), one for the exchanger, then the choice: the fastest whose ratio is at least TARGET.
"""

import argparse
import hashlib
import hmac
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.poly1305 import Poly1305

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _results  # noqa: E402  (bench/_results.py)
import _tables  # noqa: E402  (bench/_tables.py)
from deepspark.algorithms.easgd import EasgdHandler  # noqa: E402
from deepspark.exchange import ExchangeClient, ExchangeServer, protocol  # noqa: E402
from deepspark.exchange.transport import recv_exact  # noqa: E402

HOST = "127.0.0.1"
HEADER = 36
TARGET = 0.6
SECRET = b"bench-seal-secret"
EXCHANGER_ROWS = {"exchanger": True, "exchanger unsealed": False}  # exchange_integrity on, off


class Hmac:
    tag_size = 32

    def __init__(self, key):
        self.keyed, self.sequence = hmac.new(key, digestmod=hashlib.sha256), 0

    def tag(self, header, payload):
        mac = self.keyed.copy()
        mac.update(struct.pack("<Q", self.sequence))
        self.sequence += 1
        mac.update(header)
        mac.update(payload)
        return mac.digest()


class Blake:
    tag_size = 32

    def __init__(self, key):
        self.key, self.sequence = key, 0

    def tag(self, header, payload):
        mac = hashlib.blake2b(struct.pack("<Q", self.sequence), key=self.key, digest_size=32)
        self.sequence += 1
        mac.update(header)
        mac.update(payload)
        return mac.digest()


class Poly:
    tag_size = 16

    def __init__(self, key):
        self.key, self.sequence = key, 0

    def tag(self, header, payload):
        nonce = struct.pack("<QQ", 0, self.sequence)
        self.sequence += 1
        one_time = Cipher(algorithms.ChaCha20(self.key, nonce), None).encryptor().update(bytes(32))
        mac = Poly1305(one_time)
        mac.update(header)
        mac.update(payload)
        return mac.finalize()


class Gmac:
    tag_size = 16

    def __init__(self, key):
        self.sealer = protocol.Sealer(key)  # the exchanger's own seal

    def tag(self, header, payload):
        mac = self.sealer.begin(header)
        mac.update(payload)
        return mac.digest()


SEALS = {"hmac-sha256": Hmac, "blake2b": Blake, "poly1305": Poly, "aes-gmac": Gmac}
EXCHANGER = "aes-gmac"  # protocol.Sealer: the seal the exchanger's frames carry
WHAT = {"hmac-sha256": "32 bytes; the exchanger's seal through protocol version 3",
        "blake2b": "32 bytes", "poly1305": "16 bytes", "aes-gmac": "16 bytes",
        "tls": "TLS 1.3's records (encrypts as well)"}


def pin(core):
    """Each side on a core of its own, where there are two."""
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {core % os.cpu_count()})


def tls_contexts(folder):
    """A self-signed certificate for localhost in `folder` (made once), and TLS contexts that serve and trust it."""
    cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    if not os.path.exists(cert_path):
        import datetime

        from cryptography import x509  # deferred: only the TLS candidate needs it
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
                .sign(key, hashes.SHA256()))
        with open(key_path, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        with open(cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cert_path)
    return server, client


class Side:
    """One end of the echo: its socket, buffers and the seals of its two directions."""

    def __init__(self, sock, n, seal, key, folder, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if seal == "tls":
            contexts = tls_contexts(folder)
            sock = contexts[0].wrap_socket(sock, server_side=True) if server else \
                contexts[1].wrap_socket(sock, server_hostname="localhost")
        keys = (key, key[::-1]) if server else (key[::-1], key)  # (send, receive): one key a direction
        kind = SEALS.get(seal)
        self.out = kind(keys[0]) if kind else None
        self.inn = kind(keys[1]) if kind else None
        self.sock, self.tls = sock, seal == "tls"
        self.header = memoryview(bytearray(HEADER))
        self.payload = memoryview(bytearray(4 * n))
        self.tag = memoryview(bytearray(kind.tag_size if kind else 0))

    def send(self):
        parts = [self.header, self.payload] + ([self.out.tag(self.header, self.payload)] if self.out else [])
        if self.tls:  # an SSLSocket has no sendmsg
            for part in parts:
                self.sock.sendall(part)
            return
        sent = self.sock.sendmsg(parts)
        for part in parts:
            if sent < len(part):
                self.sock.sendall(memoryview(part)[sent:])
                sent = 0
            else:
                sent -= len(part)

    def receive(self):
        recv_exact(self.sock, self.header)
        recv_exact(self.sock, self.payload)
        if self.inn:
            recv_exact(self.sock, self.tag)
            if not hmac.compare_digest(self.inn.tag(self.header, self.payload), self.tag):
                raise SystemExit("a tag did not verify")


def echo(listener, n, seal, key, folder):
    pin(1)
    sock, _ = listener.accept()
    side = Side(sock, n, seal, key, folder, server=True)
    try:
        while True:
            side.receive()
            side.send()
    except ConnectionError:
        pass


def round_trips(n, seal, key, folder, seconds):
    """Round trips a second through a fresh echo peer sealed with `seal` ('none': unsealed)."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(1)
    if seal == "tls":
        tls_contexts(folder)  # the certificate, made before the peer forks, so that both sides read the same
    proc = mp.get_context("fork").Process(target=echo, args=(listener, n, seal, key, folder), daemon=True)
    proc.start()
    side = Side(socket.create_connection(listener.getsockname()), n, seal, key, folder, server=False)
    np.frombuffer(side.payload, np.float32)[:] = np.random.default_rng(0).standard_normal(n)
    for _ in range(3):  # warm up
        side.send()
        side.receive()
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        side.send()
        side.receive()
        count += 1
    rate = count / (time.perf_counter() - began)
    side.sock.close()
    listener.close()
    proc.join(5)
    return rate


def serve_exchanges(n, integrity, pipe):
    pin(1)
    server = ExchangeServer(np.zeros(n, np.float32), SECRET, EasgdHandler(0.5), integrity=integrity).start()
    pipe.send(server.address[1])
    pipe.recv()  # until told to stop
    server.stop()


def exchanger_round_trips(n, integrity, seconds):
    """EASGD round trips a second of a real ExchangeClient with a real ExchangeServer in another process."""
    ours, theirs = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=serve_exchanges, args=(n, integrity, theirs), daemon=True)
    proc.start()
    client = ExchangeClient((HOST, ours.recv()), SECRET, 0, integrity=integrity)
    params = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    try:
        for _ in range(3):  # warm up: the handshake, the buffers, the socket windows
            client.exchange(params)
        count, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds:
            client.exchange(params)
            count += 1
        return count / (time.perf_counter() - began)
    finally:
        client.close()
        ours.send("stop")
        proc.join(5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=int, default=431080)  # LeNet's parameter count
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 s, 2 repeats")
    parser.add_argument("--smoke", action="store_true", help="runs end to end only (make bench-smoke): 0.1 s, 1 repeat")
    parser.add_argument("--out", default=_results.results_path("seal"))
    args = parser.parse_args()
    if args.smoke:
        args.seconds, args.repeats = 0.1, 1
    elif args.quick:
        args.seconds, args.repeats = 1.0, 2
    pin(0)
    key = os.urandom(32)
    candidates = ["none"] + list(SEALS) + ["tls"]
    rates = {seal: [] for seal in candidates + list(EXCHANGER_ROWS)}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):  # interleaved, so the machine's drift hits every candidate alike
            for seal in candidates:
                rates[seal].append(round_trips(args.floats, seal, key, folder, args.seconds))
            for row, integrity in EXCHANGER_ROWS.items():
                rates[row].append(exchanger_round_trips(args.floats, integrity, args.seconds))
    ratios = {}
    for seal in candidates[1:]:
        ratios[seal] = statistics.median(r / base for r, base in zip(rates[seal], rates["none"]))
        _results.emit({"bench": "seal", "seal": seal, "floats": args.floats,
                       "round_trips_per_s": round(statistics.median(rates[seal]), 1),
                       "unsealed_round_trips_per_s": round(statistics.median(rates["none"]), 1),
                       "ratio_to_unsealed": round(ratios[seal], 3), "apart_cpus": (os.cpu_count() or 1) > 1,
                       "runs": [round(r, 1) for r in rates[seal]]}, args.out)
    sealed, unsealed = (rates[row] for row in EXCHANGER_ROWS)
    exchanger = statistics.median(r / base for r, base in zip(sealed, unsealed))
    _results.emit({"bench": "seal", "figure": "exchanger", "seal": EXCHANGER, "floats": args.floats,
                   "round_trips_per_s": round(statistics.median(sealed), 1),
                   "unsealed_round_trips_per_s": round(statistics.median(unsealed), 1),
                   "ratio_to_unsealed": round(exchanger, 3), "apart_cpus": (os.cpu_count() or 1) > 1,
                   "runs": [round(r, 1) for r in sealed], "unsealed_runs": [round(r, 1) for r in unsealed]}, args.out)
    best = max((seal for seal in SEALS), key=ratios.get)
    _results.emit({"bench": "seal", "figure": "choice", "fastest": best, "ratio": round(ratios[best], 3),
                   "exchanger": EXCHANGER, "exchanger_ratio": round(exchanger, 3), "target": TARGET,
                   "met": exchanger >= TARGET, "load_average": round(os.getloadavg()[0], 1)}, args.out)


# ---- the page's section (bench/_page.py) and docs/measured.md's row ------------------------------------------------

def page_section(records, data):
    """The candidates' round trips against the unsealed ones, the exchanger's own, and its seal against the target."""
    rows = [r for r in records if r.get("seal") and "figure" not in r]
    exchanger = next((r for r in records if r.get("figure") == "exchanger"), None)
    choice = next((r for r in records if r.get("figure") == "choice"), None)
    if not rows or choice is None:
        return _tables.missing("the seal candidates' round trips", "OPENBLAS_NUM_THREADS=1 python bench/seal.py")
    cell = _tables.cell
    ours = choice.get("exchanger", EXCHANGER)
    lines = [[f"{r['seal']} (echo)", cell(r["round_trips_per_s"], 1), cell(r["unsealed_round_trips_per_s"], 1),
              cell(r["ratio_to_unsealed"], 2, "x"), WHAT.get(r["seal"], "")] for r in rows]
    if exchanger is not None:
        lines.append([f"the exchanger's EASGD round trip ({exchanger['seal']})", cell(exchanger["round_trips_per_s"], 1),
                      cell(exchanger["unsealed_round_trips_per_s"], 1), cell(exchanger["ratio_to_unsealed"], 2, "x"),
                      "slice by slice as frames are read; a model's tag after its payload"])
    table = _tables.table(["seal", "round trips / s", "unsealed, same repetitions", "ratio", "tag"], lines)
    ratio = choice.get("exchanger_ratio")
    return table + (
        f"\n\nTarget (#27): a LeNet-size round trip sealed at least {cell(choice['target'], 1, 'x')} the unsealed "
        f"one, apart CPUs: the exchanger's ({ours}) {cell(ratio, 2, 'x')}, "
        f"{'met' if choice.get('met') else '**not met**'}; the fastest candidate in the echo {choice['fastest']} "
        f"({cell(choice['ratio'], 2, 'x')}). From `{os.path.relpath(data, ROOT)}/seal.jsonl` (bench/seal.py): each "
        f"side pinned to a core of its own, {cell(rows[0]['floats'])} floats (LeNet) each way sealed by the sender "
        "and checked by the receiver. The echo hashes a frame whole before it goes and after it came (each "
        "candidate's own cost); the exchanger's row is a real ExchangeServer and ExchangeClient with "
        "exchange_integrity on against off. Everything interleaved in each repetition, medians of the repetitions' "
        f"ratios; the machine's 1-minute load average at the end: {cell(choice.get('load_average'), 1)} on 2 cores.")


def measured_row(records):
    """docs/measured.md's row of the exchanger's seal (None without records)."""
    ours = next((r for r in records if r.get("figure") == "exchanger"), None)
    if ours is None:
        return None
    old = next((r for r in records if r.get("seal") == "hmac-sha256" and "figure" not in r), None)
    return (f"| EASGD round trips sealed with AES-GMAC (the exchanger's seal, the default), different CPUs, LeNet | "
            f"{ours['round_trips_per_s']:,.0f} per s: {ours['ratio_to_unsealed']:.2f}×"
            + (f" (HMAC-SHA256 in the echo, the seal before it: {old['ratio_to_unsealed']:.2f}×)" if old else "")
            + f" | the same exchanges unsealed: {ours['unsealed_round_trips_per_s']:,.0f} per s (`make bench`, "
            "`bench/seal.py`; docs/data/seal.jsonl) |")


if __name__ == "__main__":
    main()
