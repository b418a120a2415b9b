"""How a model frame's floats travel: float32 as they are, float16/bfloat16, or int8/int4 codes with per-block scales.

A codec turns n float32 values into a payload of `payload_bytes(n)` bytes and
back. The layouts, all little-endian:

    float32   n × float32
    float16   n × IEEE half
    bfloat16  n × the upper 16 bits of each float32, rounded to nearest even
    int8      ⌈n/B⌉ × float32 scale, then n × int8 code in [−127, 127]
    int4      ⌈n/B⌉ × float32 scale, then ⌈n/2⌉ bytes: two codes in [−7, 7] a byte,
              the first in the low nibble, each stored as code + 8

with B = BLOCK floats a block; value = code × its block's scale, the scale being
the block's largest magnitude over the largest code. Decoding checks what it
makes: a scale that is negative or not finite, a code out of range, or a half
that decodes to ±Inf/NaN is refused (ProtocolError) before anyone uses it.
Encoding and decoding write into buffers the caller allocated once.

What one frame loses to rounding is not lost for good: `Feedback` carries the
residual into the next frame (error feedback), so the sum of what a peer
receives tracks the sum of what was meant to a bounded error.
"""

import numpy as np

from deepspark.exchange.protocol import CODEC_NAMES, CodecError
from deepspark.rules import all_finite

# Floats that share one scale. 256 keeps the scales to 1.6% of an int8 payload
# (3% of int4) while one outlier coarsens only its own block.
BLOCK = 256


class Float32:
    name = "float32"

    def payload_bytes(self, n):
        return 4 * n

    def encode(self, values, payload):
        payload[:] = memoryview(values).cast("B")

    def decode(self, payload, out):
        out[:] = np.frombuffer(payload, np.float32)
        if not all_finite(out):
            raise CodecError("float32 payload holds a NaN or an infinity")


class Float16:
    name = "float16"

    def payload_bytes(self, n):
        return 2 * n

    def encode(self, values, payload):
        with np.errstate(over="ignore"):
            np.copyto(np.frombuffer(payload, np.float16), values, casting="unsafe")

    def decode(self, payload, out):
        np.copyto(out, np.frombuffer(payload, np.float16))
        if not all_finite(out):
            raise CodecError("float16 payload holds a NaN or an infinity (a value beyond ±65504 on the way)")


class BFloat16:
    name = "bfloat16"

    def payload_bytes(self, n):
        return 2 * n

    def encode(self, values, payload):
        bits = values.view(np.uint32)
        # Round to nearest even on the 16 bits dropped: add 0x7FFF plus the kept part's lowest bit.
        rounded = (bits >> 16) & 1
        rounded += 0x7FFF
        rounded += bits
        np.copyto(np.frombuffer(payload, np.uint16), rounded >> 16, casting="unsafe")

    def decode(self, payload, out):
        wide = out.view(np.uint32)
        np.copyto(wide, np.frombuffer(payload, np.uint16))
        wide <<= 16
        if not all_finite(out):
            raise CodecError("bfloat16 payload holds a NaN or an infinity")


SMALLEST_INVERTIBLE = np.float32(1) / np.finfo(np.float32).max


class Blockwise:
    """Integer codes in [−top, top] with one float32 scale per BLOCK floats."""

    def __init__(self, name, bits):
        self.name = name
        self.bits = bits
        self.top = 2 ** (bits - 1) - 1

    def blocks(self, n):
        return -(-n // BLOCK)

    def code_bytes(self, n):
        return n if self.bits == 8 else -(-n // 2)

    def payload_bytes(self, n):
        return 4 * self.blocks(n) + self.code_bytes(n)

    def _split(self, payload, n):
        nb = self.blocks(n)
        return np.frombuffer(payload, np.float32, nb), np.frombuffer(payload, np.uint8, offset=4 * nb)

    def encode(self, values, payload):
        n = len(values)
        scales, codes = self._split(payload, n)
        padded = np.zeros(self.blocks(n) * BLOCK, np.float32)
        padded[:n] = values
        blocks = padded.reshape(-1, BLOCK)
        np.max(np.abs(blocks), axis=1, out=scales)
        scales /= self.top
        # A block whose scale has no finite inverse (subnormal values) is sent as zeros; error feedback keeps it.
        scales[scales < SMALLEST_INVERTIBLE] = 0
        inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
        blocks *= inverse[:, None]
        q = np.rint(padded[:n], out=padded[:n]).astype(np.int8)
        if self.bits == 8:
            codes[:] = q.view(np.uint8)
            return
        nibbles = (q + 8).astype(np.uint8)
        if n % 2:
            nibbles = np.append(nibbles, np.uint8(8))
        codes[:] = nibbles[0::2] | (nibbles[1::2] << 4)

    def decode(self, payload, out):
        n = len(out)
        scales, codes = self._split(payload, n)
        with np.errstate(invalid="ignore"):
            if not (np.isfinite(scales).all() and (scales >= 0).all()):
                raise CodecError(f"{self.name} payload has a scale that is negative or not finite")
        if self.bits == 8:
            q = codes.view(np.int8)
            if (q == -128).any():
                raise CodecError("int8 payload has the code -128, outside [-127, 127]")
        else:
            q = np.empty(2 * len(codes), np.int8)
            q[0::2] = codes & 0x0F
            q[1::2] = codes >> 4
            q -= 8
            q = q[:n]
            if (q == -8).any():
                raise CodecError("int4 payload has the code -8, outside [-7, 7]")
        full = (n // BLOCK) * BLOCK
        np.multiply(q[:full].reshape(-1, BLOCK), scales[:n // BLOCK, None], out=out[:full].reshape(-1, BLOCK))
        if full < n:
            np.multiply(q[full:], scales[-1], out=out[full:])


CODECS = {codec.name: codec for codec in (Float32(), Float16(), BFloat16(), Blockwise("int8", 8),
                                          Blockwise("int4", 4))}


def get(name):
    """The codec called `name`: DeepSparkParameter.exchange_codec's value in lower case, or its number (the
    schema's ExchangeCodec numbers are protocol.CODEC_IDS), or a codec (its own)."""
    if not isinstance(name, (str, int)):
        name = name.name
    elif isinstance(name, int):
        name = CODEC_NAMES.get(name, f"id {name}")
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown exchange codec {name!r} (known: {', '.join(CODECS)})") from None


class Feedback:
    """Error feedback for one sender: each frame carries what earlier frames' rounding left out.

    send(values, payload) encodes values + residual into `payload` and keeps the
    new residual; `decoded` is what the receiver will make of it.
    """

    def __init__(self, codec, n):
        self.codec = codec
        self.residual = np.zeros(n, np.float32)
        self.decoded = np.zeros(n, np.float32)

    def send(self, values, payload):
        self.residual += values
        self.codec.encode(self.residual, payload)
        self.codec.decode(payload, self.decoded)
        self.residual -= self.decoded
        return self.decoded


class Channel:
    """One connection's coded model frames, the same object on both ends.

    Both ends hold `reference`, the receiver's picture of the sender's parameters, and move it
    by exactly what was decoded, so that the two pictures stay equal bit for bit:

      parameters out   (EXCHANGE, AVERAGE)   send x − reference; both add what it decodes to, and the
                       server takes reference as x (within one frame's rounding: the error never builds up)
      a difference back (DIFF)               send d with error feedback; both subtract what it decodes to,
                       as the worker does from x
      a mean back      (CENTER, coded)       send mean − reference; both add what it decodes to, and the
                       worker takes reference as its parameters

    `restart(values)` sets the reference where a new connection or a PULL leaves both ends
    (zeros, or the center sent whole). With float32 nothing is coded: a Channel is only made for
    the other codecs.
    """

    def __init__(self, codec, n):
        self.codec = codec
        self.payload = memoryview(bytearray(codec.payload_bytes(n)))
        self.reference = np.zeros(n, np.float32)
        self.decoded = np.zeros(n, np.float32)
        self._feedback = None  # made by the first difference sent: only an EASGD server sends them

    def restart(self, values=None):
        if values is None:
            self.reference.fill(0.0)
        else:
            np.copyto(self.reference, values)
        if self._feedback is not None:
            self._feedback.residual.fill(0.0)

    def send_toward(self, values):
        """The payload that moves the peer's reference to `values` (parameters, or a mean); moves ours too."""
        np.subtract(values, self.reference, out=self.decoded)
        self.codec.encode(self.decoded, self.payload)
        self.codec.decode(self.payload, self.decoded)
        self.reference += self.decoded
        return self.payload

    def receive_toward(self, out):
        """Decode a send_toward payload (in self.payload): the reference moves, and `out` becomes it.
        CodecError, with the reference untouched, for a payload that does not decode to finite floats."""
        self.codec.decode(self.payload, self.decoded)
        self.reference += self.decoded
        np.copyto(out, self.reference)
        return out

    def send_difference(self, d):
        """The payload of d plus what earlier differences' rounding left out; the reference moves by what
        the peer will decode, as the peer's parameters will."""
        if self._feedback is None:
            self._feedback = Feedback(self.codec, len(self.reference))
        self.reference -= self._feedback.send(d, self.payload)
        return self.payload

    def receive_difference(self, out):
        """Decode a send_difference payload (in self.payload) into `out`; the reference moves by it."""
        self.codec.decode(self.payload, out)
        self.reference -= out
        return out
