"""Tests of `refimpl.mx`: MXFP4 against compressed-tensors (the format's own library), MXFP8 by its definition."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refimpl.mx import (
    E2M1_VALUES,
    mxfp4_decode,
    mxfp4_decode_reference,
    mxfp4_encode,
    mxfp4_scale_exponent,
    mxfp8_round,
)

# The E2M1 magnitudes of the OCP specification, typed in from its table.
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _mxfp4_scheme() -> QuantizationScheme:
    weights = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                               scale_dtype=torch.uint8)
    return QuantizationScheme(targets=["Linear"], weights=weights)


def _ct_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors' own decoder (MXFP4PackedCompressor.decompress), bfloat16 out, as raw uint16 bits."""
    state = {"weight_packed": torch.from_numpy(packed.copy()), "weight_scale": torch.from_numpy(scale.copy())}
    weight = MXFP4PackedCompressor.decompress(state, _mxfp4_scheme())["weight"]
    assert weight.dtype == torch.bfloat16
    return weight.view(torch.int16).numpy().view(np.uint16)


def _ct_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """compressed-tensors' encoder, step by step: its scale rule, its FP4 rounding, its packing."""
    t = torch.from_numpy(w.astype(np.float32))
    out, inp = t.shape
    groups = t.reshape(out, inp // 32, 32)
    amax = groups.abs().amax(dim=-1)  # [out, in/32]
    scale = generate_mx_scales(amax, num_bits=4)  # E8M0 exponents as floats
    scale = scale.clamp(0, 254).to(torch.uint8)
    X = 2.0 ** (scale.to(torch.float32) - 127)  # [out, in/32]
    q = cast_to_fp4((groups / X[..., None]).clamp(-6, 6).reshape(out, inp))
    return pack_fp4_to_uint8(q).numpy(), scale.numpy()


# ---------------------------------------------------------------------------
# The element table and the byte layout
# ---------------------------------------------------------------------------

def test_e2m1_table_matches_the_specification():
    assert E2M1_VALUES[:8].tolist() == E2M1_TABLE
    assert E2M1_VALUES[8:].tolist() == [-v for v in E2M1_TABLE]
    assert np.signbit(E2M1_VALUES[8])  # code 8 is -0


def test_one_group_decoded_by_hand():
    # Byte 0x2B: low nibble 0xB = -1.5 (even column), high nibble 0x2 = 1.0 (odd column).
    packed = np.full((1, 16), 0x2B, dtype=np.uint8)
    scale = np.array([[120]], dtype=np.uint8)  # 2^(120 - 127) = 1/128
    w = mxfp4_decode(packed, scale)
    assert w.shape == (1, 32)
    assert w[0, 0::2].tolist() == [-1.5 / 128] * 16
    assert w[0, 1::2].tolist() == [1.0 / 128] * 16


def test_decode_agrees_with_the_readable_version():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, size=(3, 5, 64), dtype=np.uint8)
    # float32 holds every product of scale bytes 0-252; float64 holds those of every byte but 255 (NaN).
    scale = rng.integers(0, 253, size=(3, 5, 4), dtype=np.uint8)
    np.testing.assert_array_equal(mxfp4_decode(packed, scale), mxfp4_decode_reference(packed, scale))
    scale = rng.integers(0, 255, size=(3, 5, 4), dtype=np.uint8)
    np.testing.assert_array_equal(mxfp4_decode(packed, scale, dtype=np.float64),
                                  mxfp4_decode_reference(packed, scale, dtype=np.float64))


# ---------------------------------------------------------------------------
# compressed-tensors as the oracle
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_decode_bit_for_bit_with_compressed_tensors(seed):
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, size=(48, 64), dtype=np.uint8)  # [out, in/2], in = 128
    # Every scale byte whose products bfloat16 holds (0-252), including those that go subnormal.
    scale = rng.integers(0, 253, size=(48, 4), dtype=np.uint8)
    scale[0] = [0, 1, 251, 252]
    ours = mxfp4_decode(packed, scale, dtype=ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, _ct_decode(packed, scale))


def test_top_scale_bytes_against_compressed_tensors():
    # Scale bytes 253 and 254: compressed-tensors returns infinity where a value exceeds bfloat16; refimpl
    # raises there, and in float64 gives the exact value, which is compressed-tensors' wherever that is finite.
    rng = np.random.default_rng(11)
    packed = rng.integers(0, 256, size=(16, 64), dtype=np.uint8)
    scale = rng.integers(249, 255, size=(16, 4), dtype=np.uint8)
    theirs = _ct_decode(packed, scale).view(ml_dtypes.bfloat16).astype(np.float64)
    exact = mxfp4_decode(packed, scale, dtype=np.float64)
    too_big = np.abs(exact) > float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert too_big.any() and (~too_big).any()
    assert np.all(np.isinf(theirs[too_big])) and np.all(np.sign(theirs[too_big]) == np.sign(exact[too_big]))
    np.testing.assert_array_equal(exact[~too_big], theirs[~too_big])
    with pytest.raises(ValueError, match=r"MXFP4 values overflow bfloat16.*dtype=np.float64"):
        mxfp4_decode(packed, scale, dtype=ml_dtypes.bfloat16)


def test_decode_float32_bit_for_bit_with_compressed_tensors_unpacking():
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, size=(16, 32), dtype=np.uint8)
    scale = rng.integers(0, 255, size=(16, 2), dtype=np.uint8)
    values = unpack_fp4_from_uint8(torch.from_numpy(packed), 16, 64, dtype=torch.float32)
    X = 2.0 ** (torch.from_numpy(scale.astype(np.float32)) - 127)
    expected = (values.reshape(16, 2, 32) * X[..., None]).reshape(16, 64).numpy()
    np.testing.assert_array_equal(mxfp4_decode(packed, scale).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("scale_of_weights", [1e-3, 0.05, 1.0, 300.0])
def test_encode_agrees_with_compressed_tensors(scale_of_weights):
    rng = np.random.default_rng(3)
    w = (scale_of_weights * rng.standard_normal((64, 256))).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    w[1, :32] = 7.9  # a block maximum just under a power of two
    packed, scale = mxfp4_encode(w)
    ct_packed, ct_scale = _ct_encode(w)
    np.testing.assert_array_equal(scale[1:], ct_scale[1:])  # the all-zero block: see below
    np.testing.assert_array_equal(packed, ct_packed)
    assert scale[0, 0] == 0  # our rule for an all-zero block: the smallest scale


def test_scale_rule_against_its_definition():
    # floor(log2 a) - 2, one more when the mantissa of a is >= 1.75, computed here with math.log2.
    import math
    for a in [1.0, 1.5, 1.74, 1.75, 1.99, 2.0, 6.0, 7.0, 7.99, 8.0, 1e-30, 3e30]:
        exponent = math.floor(math.log2(a))
        expected = exponent - 2 + (a / 2.0**exponent >= 1.75)
        assert int(mxfp4_scale_exponent(np.array([a], dtype=np.float64))[0]) == expected, a


# ---------------------------------------------------------------------------
# Properties of the codec
# ---------------------------------------------------------------------------

@st.composite
def representable_groups(draw, rows=3, groups=2):
    """Arrays whose every block of 32 is exactly representable: E2M1 codes times a power of two per block.

    Each block keeps its own maximum magnitude in [2, 6] so that the encoder picks the same scale back.
    """
    codes = draw(hnp.arrays(np.uint8, (rows, groups, 32), elements=st.integers(0, 15)))
    big = draw(hnp.arrays(np.uint8, (rows, groups), elements=st.integers(4, 7)))  # magnitude 2..6
    codes[..., 0] = big | (codes[..., 0] & 0x08)
    exponents = draw(hnp.arrays(np.int32, (rows, groups), elements=st.integers(-100, 100)))
    w = E2M1_VALUES[codes] * np.ldexp(np.float32(1.0), exponents)[..., None]
    return w.reshape(rows, groups * 32).astype(np.float32)


@given(w=representable_groups())
def test_encode_decode_is_exact_on_representable_groups(w):
    packed, scale = mxfp4_encode(w)
    np.testing.assert_array_equal(mxfp4_decode(packed, scale), w)


def _assert_mxfp4_error_bounded(w: np.ndarray, back: np.ndarray, scale: np.ndarray) -> None:
    """Every decoded value within one step X of its input (float64 arithmetic), none past its block's cap."""
    blocks = w.astype(np.float64).reshape(*scale.shape, 32)
    back_blocks = back.astype(np.float64).reshape(*scale.shape, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    X = np.ldexp(1.0, scale.astype(np.int32) - 127)[..., None]
    err = np.abs(back_blocks - blocks)
    assert np.all(err <= X), float(np.max(err / X))
    assert np.all(np.abs(back_blocks) <= np.maximum(amax, 6 * X))  # no value grows past the block maximum's cap


@given(w=hnp.arrays(np.float32, (4, 64), elements=st.floats(-1e6, 1e6, width=32)))
def test_encode_error_is_bounded(w):
    # The worst rounding error is half an E2M1 step at the top, 1 * X; X <= max|w| / 3.5 (scale rule).
    packed, scale = mxfp4_encode(w)
    _assert_mxfp4_error_bounded(w, mxfp4_decode(packed, scale), scale)


F32_MAX = float(np.finfo(np.float32).max)


@given(w=hnp.arrays(np.float32, (2, 64), elements=st.floats(allow_nan=False, allow_infinity=False, width=32)))
@example(w=np.full((2, 64), F32_MAX, np.float32))  # code 4 at scale 2^126 would be 2^128: saturates to 3
@example(w=np.full((2, 64), -np.float32(2.0**127 * 1.99), np.float32))
@example(w=np.full((2, 64), np.float32(1e-45), np.float32))  # the smallest subnormal: rounds to zero
def test_encode_over_all_of_float32_decodes_finite_and_close(w):
    # Across float32's whole range: the encoding decodes to finite float32 values within one step X,
    # and float64 decoding agrees with float32 decoding wherever both are computed.
    packed, scale = mxfp4_encode(w)
    back = mxfp4_decode(packed, scale)
    assert np.all(np.isfinite(back))
    _assert_mxfp4_error_bounded(w, back, scale)
    np.testing.assert_array_equal(mxfp4_decode(packed, scale, dtype=np.float64), back.astype(np.float64))


SEVEN_TIMES_2_127 = 7 * 2.0**127  # from here on a block would need a scale above 2^127


@given(w=hnp.arrays(np.float64, (2, 32), elements=st.floats(-2e39, 2e39)))
@example(w=np.full((2, 32), 6 * 2.0**127))  # MXFP4's largest value: exact in float64
@example(w=np.full((2, 32), np.nextafter(SEVEN_TIMES_2_127, 0)))  # just below: rounds down to 6 * 2^127
@example(w=np.full((2, 32), SEVEN_TIMES_2_127))  # refused
@example(w=np.full((2, 32), 1e-300))  # far below E8M0's smallest scale: zero
def test_encode_float64_saturates_or_raises(w):
    amax = float(np.max(np.abs(w)))
    if amax >= SEVEN_TIMES_2_127:
        with pytest.raises(ValueError, match=r"w holds values beyond MXFP4's range: largest magnitude"):
            mxfp4_encode(w)
        return
    packed, scale = mxfp4_encode(w)
    back = mxfp4_decode(packed, scale, dtype=np.float64)
    assert np.all(np.isfinite(back))
    _assert_mxfp4_error_bounded(w, back, scale)


@given(w=hnp.arrays(np.float32, (3, 64), elements=st.floats(-1e4, 1e4, width=32)))
def test_decode_encode_decode_is_stable(w):
    once = mxfp4_decode(*mxfp4_encode(w))
    np.testing.assert_array_equal(mxfp4_decode(*mxfp4_encode(once)), once)


# ---------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------

def _mxfp8_by_definition(x: np.ndarray) -> np.ndarray:
    """Block by block with Python floats: the smallest X = 2^e with max|x| <= 448 X, nearest E4M3 value (ties even)."""
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    grid = np.unique(e4m3[np.isfinite(e4m3)])
    out = np.empty_like(x, dtype=np.float64)
    for row in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            block = x[row, 32 * b:32 * (b + 1)].astype(np.float64)
            amax = np.abs(block).max()
            e = -140
            while amax > 448.0 * 2.0**e:
                e += 1
            e = max(-127, min(127, e))
            for j, v in enumerate(block):
                s = min(max(v / 2.0**e, -448.0), 448.0)
                dist = np.abs(grid - s)
                best = grid[dist == dist.min()]
                if len(best) > 1:  # a tie: the even mantissa (its code is even)
                    codes = np.array(best, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
                    best = best[codes % 2 == 0]
                out[row, 32 * b + j] = best[0] * 2.0**e
    return out.astype(np.float32)


def test_mxfp8_against_its_definition():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 64)) * np.array([1e-3, 1.0, 1e3])[:, None]).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 5] = 511.0 / 256  # the block's maximum, just under a power of two
    x[2, 40] = 1.75 * 2.0**12  # a maximum exactly at 448 X
    np.testing.assert_array_equal(mxfp8_round(x), _mxfp8_by_definition(x))


@given(x=hnp.arrays(np.float32, (2, 96), elements=st.floats(allow_nan=False, allow_infinity=False, width=32)))
@example(x=np.full((2, 96), F32_MAX, np.float32))  # 255.99 * 2^120 rounds to 256 * 2^120 = 2^128: saturates
@example(x=np.full((2, 96), -F32_MAX, np.float32))
@example(x=np.full((2, 96), np.float32(1e-45), np.float32))
def test_mxfp8_is_idempotent_and_close(x):
    once = mxfp8_round(x)
    np.testing.assert_array_equal(mxfp8_round(once), once)
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normal elements; E4M3's subnormal step is 2^-9 X,
    # and X <= max|x| / 224 (the scale never clips, so the block maximum lands in (224, 448]) unless the
    # block is so small that X is E8M0's smallest, 2^-127.
    blocks = x.reshape(2, 3, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    X_bound = np.maximum(amax / 224, 2.0**-127)
    err = np.abs(once.reshape(2, 3, 32) - blocks)
    assert np.all(np.isfinite(once))
    assert np.all(err <= np.abs(blocks) * 2.0**-4 + X_bound * 2.0**-10)


def test_mxfp8_saturates_at_the_top_of_float32():
    # float32's largest value, 3.4028235e38 = (2 - 2^-23) 2^127: scale 2^120, 255.99... rounds to E4M3's 256,
    # and 256 * 2^120 = 2^128 is beyond float32; the next E4M3 value down is 240 (1.875 * 2^7).
    x = np.full(32, F32_MAX, np.float32)
    np.testing.assert_array_equal(mxfp8_round(x), np.full(32, 240 * 2.0**120, np.float32))
    np.testing.assert_array_equal(mxfp8_round(-x), np.full(32, -240 * 2.0**120, np.float32))


def test_mxfp8_refuses_what_float32_cannot_hold():
    # 1e39 is finite in float64 but infinity in float32, the dtype mxfp8_round computes in.
    with pytest.raises(ValueError, match=r"x holds values beyond float32's range.*largest magnitude 1e\+39"):
        mxfp8_round(np.full(32, 1e39))
    with pytest.raises(ValueError, match=r"x holds values beyond float32's range.*largest magnitude 3.40282\d*e\+38"):
        mxfp8_round(np.full(32, 2.0**128 - 2.0**103))  # the first float64 that rounds to infinity in float32
    # A float64 just above float32's maximum that still rounds to it is what the arithmetic sees: accepted.
    just_above = np.nextafter(F32_MAX, np.inf)
    np.testing.assert_array_equal(mxfp8_round(np.full(32, just_above)), mxfp8_round(np.full(32, F32_MAX)))


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"w must have a last axis that is a multiple of 32, got shape \[2, 30\]"):
        mxfp4_encode(np.zeros((2, 30), np.float32))
    with pytest.raises(ValueError, match=r"w must be finite, got 1 non-finite"):
        mxfp4_encode(np.array([np.nan] + [0.0] * 31, np.float32))
    with pytest.raises(TypeError, match=r"w must be a real floating array, got dtype int64"):
        mxfp4_encode(np.zeros(32, np.int64))
    with pytest.raises(TypeError, match=r"packed must be a uint8 array, got dtype int32"):
        mxfp4_decode(np.zeros((1, 16), np.int32), np.zeros((1, 1), np.uint8))
    with pytest.raises(ValueError, match=r"packed \[\.\.\., K/2\] and scale \[\.\.\., K/32\] must describe the same K"):
        mxfp4_decode(np.zeros((1, 16), np.uint8), np.zeros((1, 2), np.uint8))
    with pytest.raises(ValueError, match=r"x must have a last axis that is a multiple of 32"):
        mxfp8_round(np.zeros((3, 33), np.float32))
    with pytest.raises(TypeError, match=r"w must be an array, got list"):
        mxfp4_encode([0.0] * 32)
    with pytest.raises(ValueError, match=r"x must be finite, got 2 non-finite"):
        mxfp8_round(np.array([np.inf, -np.inf] + [0.0] * 30, np.float32))
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype \(float16, bfloat16, float32 or "
                                        r"float64\), got int32"):
        mxfp4_decode(np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.uint8), dtype=np.int32)
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype .*got bool"):
        mxfp4_decode(np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.uint8), dtype=bool)


# ---------------------------------------------------------------------------
# The top and the bottom of the scale byte
# ---------------------------------------------------------------------------

def test_nan_scale_byte_is_refused():
    packed = np.full((2, 32), 0x22, np.uint8)  # every value 1.0
    scale = np.array([[127, 127], [127, 255]], np.uint8)
    with pytest.raises(ValueError, match=r"scale holds the E8M0 NaN byte 255 in 1 block\(s\), the first at "
                                         r"scale index \[1, 1\]"):
        mxfp4_decode(packed, scale)
    with pytest.raises(ValueError, match="NaN byte 255"):
        mxfp4_decode(packed, scale, dtype=np.float64)


@pytest.mark.parametrize("code,s,fits", [
    (7, 254, False),  # 6 * 2^127: beyond float32
    (4, 254, False),  # 2 * 2^127 = 2^128: the first power of two float32 lacks
    (3, 254, True),   # 1.5 * 2^127: float32 holds it
    (6, 253, False),  # 4 * 2^126 = 2^128
    (5, 253, True),   # 3 * 2^126
    (7, 252, True),   # 6 * 2^125 = 1.5 * 2^127, the largest float32 value MXFP4 has
])
def test_values_at_the_top_of_the_range(code, s, fits):
    packed = np.full((1, 16), code | (code << 4), np.uint8)
    scale = np.array([[s]], np.uint8)
    exact = float(E2M1_TABLE[code]) * 2.0 ** (s - 127)  # Python floats: float64, exact
    assert mxfp4_decode(packed, scale, dtype=np.float64).tolist() == [[exact] * 32]
    if fits:
        assert mxfp4_decode(packed, scale).tolist() == [[exact] * 32]
    else:
        with pytest.raises(ValueError, match=rf"MXFP4 values overflow float32: the block at scale index \[0, 0\] "
                                             rf"has scale byte {s} \(2\^{s - 127}\).*dtype=np.float64"):
            mxfp4_decode(packed, scale)


def test_float16_decoding_refuses_overflow():
    # float16 holds up to 65504: scale byte 142 (2^15) times 2 is 65536.
    packed = np.full((1, 16), 0x44, np.uint8)
    with pytest.raises(ValueError, match=r"MXFP4 values overflow float16"):
        mxfp4_decode(packed, np.array([[142]], np.uint8), dtype=np.float16)
    assert mxfp4_decode(packed, np.array([[141]], np.uint8), dtype=np.float16).tolist() == [[2.0**15] * 32]


def test_encode_refuses_blocks_beyond_the_format():
    w = np.zeros((2, 64))
    w[1, 40] = -1e40
    with pytest.raises(ValueError, match=r"w holds values beyond MXFP4's range: largest magnitude 1e\+40, and the "
                                         r"format's largest value is 6 \* 2\^127 = 1.02085e\+39"):
        mxfp4_encode(w)
