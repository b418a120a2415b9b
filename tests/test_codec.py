"""The exchange's codecs (exchange/codec.py): sizes, rounding bounds, error feedback, and payloads refused."""

import math

import numpy as np
import pytest

from deepspark.exchange import codec

RNG = np.random.default_rng(7)
# A codec's worst relative error, against the largest magnitude of the values it carries.
BOUNDS = {"float32": 0.0, "float16": 2 ** -11, "bfloat16": 2 ** -8, "int8": 0.5 / 127, "int4": 0.5 / 7}


def roundtrip(c, values):
    payload = bytearray(c.payload_bytes(len(values)))
    c.encode(values, memoryview(payload))
    out = np.empty_like(values)
    c.decode(memoryview(payload), out)
    return out, payload


@pytest.mark.parametrize("name", sorted(codec.CODECS))
@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 1000, 4099])
def test_roundtrip_within_the_codecs_rounding(name, n):
    c = codec.get(name)
    values = (RNG.standard_normal(n) * 10.0 ** RNG.uniform(-4, 2, n)).astype(np.float32)
    out, payload = roundtrip(c, values)
    assert len(payload) == c.payload_bytes(n)
    if name in ("int8", "int4"):  # blockwise: each value against its own block's largest magnitude
        for start in range(0, n, codec.BLOCK):
            block = slice(start, start + codec.BLOCK)
            top = np.abs(values[block]).max()
            assert np.abs(out[block] - values[block]).max() <= BOUNDS[name] * top * (1 + 1e-5)
    else:
        floor = 2 ** -25 if name == "float16" else 0.0  # half of float16's smallest subnormal step
        assert (np.abs(out - values) <= BOUNDS[name] * np.abs(values) + floor).all()


def test_payload_sizes():
    n = 431080  # LeNet
    sizes = {name: c.payload_bytes(n) for name, c in codec.CODECS.items()}
    assert sizes["float32"] == 4 * n and sizes["float16"] == sizes["bfloat16"] == 2 * n
    blocks = math.ceil(n / codec.BLOCK)
    assert sizes["int8"] == 4 * blocks + n and sizes["int4"] == 4 * blocks + math.ceil(n / 2)


def test_zeros_and_a_zero_block_survive():
    values = np.zeros(3 * codec.BLOCK, np.float32)
    values[codec.BLOCK:2 * codec.BLOCK] = 1.5
    for name in ("int8", "int4"):
        out, _ = roundtrip(codec.get(name), values)
        assert np.array_equal(out, values)


def test_a_block_of_subnormals_is_sent_as_zeros_and_the_next_block_is_untouched():
    # The largest subnormal over 127 has no finite float32 inverse: dividing by it once made NaN codes.
    values = np.full(2 * codec.BLOCK, 1e-40, np.float32)
    values[codec.BLOCK:] = 2.0
    for name in ("int8", "int4"):
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            out, _ = roundtrip(codec.get(name), values)
        assert (out[:codec.BLOCK] == 0).all() and (out[codec.BLOCK:] == 2.0).all()


def test_bfloat16_rounds_to_nearest_even():
    # bfloat16 keeps 7 mantissa bits: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 (odd), 1 + 3·2^-8 between
    # 1 + 2^-7 (odd) and 1 + 2^-6 (even).
    values = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5], np.float32)
    out, _ = roundtrip(codec.get("bfloat16"), values)
    assert out.tolist() == [1.0, 1.0, 1.0 + 2 ** -6, -2.5]


def test_error_feedback_keeps_the_sum_within_one_rounding():
    """Sent many times, what arrives sums to what was meant within the last frame's residual."""
    n = 5000
    c = codec.get("int4")
    feedback = codec.Feedback(c, n)
    payload = memoryview(bytearray(c.payload_bytes(n)))
    meant, arrived, out = np.zeros(n), np.zeros(n), np.empty(n, np.float32)
    for _ in range(40):
        values = (RNG.standard_normal(n) * 1e-3).astype(np.float32)
        meant += values
        feedback.send(values, payload)
        c.decode(payload, out)
        arrived += out
    assert np.allclose(meant - arrived, feedback.residual, atol=1e-6)
    assert np.abs(meant - arrived).max() < 0.5e-3  # one frame's rounding, never 40 frames' worth


def hostile(name, n, edit):
    c = codec.get(name)
    _, payload = roundtrip(c, np.ones(n, np.float32))
    edit(payload)
    with pytest.raises(codec.CodecError):
        c.decode(memoryview(payload), np.empty(n, np.float32))


@pytest.mark.parametrize("scale", [-1.0, math.inf, math.nan])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_bad_scale_is_refused(name, scale):
    hostile(name, 600, lambda p: p.__setitem__(slice(4, 8), np.float32(scale).tobytes()))


def test_codes_out_of_range_are_refused():
    n = 600
    hostile("int8", n, lambda p: p.__setitem__(4 * 3 + 10, 0x80))        # -128
    hostile("int4", n, lambda p: p.__setitem__(4 * 3 + 10, 0x08 & 0xF0))  # low nibble 0: the code -8


@pytest.mark.parametrize("name,bits", [("float16", np.float16(np.inf).view(np.uint16).item()),
                                       ("float16", 0x7E00), ("bfloat16", 0x7F80), ("bfloat16", 0xFFC0)])
def test_a_half_that_is_not_finite_is_refused(name, bits):
    hostile(name, 10, lambda p: p.__setitem__(slice(6, 8), int(bits).to_bytes(2, "little")))


def test_float32_not_finite_is_refused():
    hostile("float32", 10, lambda p: p.__setitem__(slice(8, 12), np.float32(math.nan).tobytes()))


def test_unknown_codec_names_the_known_ones():
    with pytest.raises(ValueError, match="known: float32, float16, bfloat16, int8, int4"):
        codec.get("int2")
