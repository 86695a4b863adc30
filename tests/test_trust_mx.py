"""MXFP4 and MXFP8, read by a sceptic: values the output dtype cannot hold, one rounding from float64, bad maxima.

* `mxfp4_decode(..., dtype=np.float16)` returned values of small blocks rounded, or flushed to zero, where its
  docstring promises a `ValueError` for a value the dtype cannot hold;
* `mxfp8_round` rounded a float64 element to float32 and then to E4M3: twice (1.0625 + 2^-30 came back 1.0,
  where E4M3's nearest value is 1.125);
* the two public scale-exponent functions gave an exponent for an infinite, NaN or negative maximum.

Each expected value is computed independently: the decoded values in float64 (which holds every MXFP4 value),
and MXFP8's scale from the exact maximum with Python's integers.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from refimpl.mx import mxfp4_decode, mxfp4_scale_exponent, mxfp8_round, mxfp8_scale_exponent


def test_float16_decoding_refuses_what_it_would_round_or_flush_to_zero():
    packed = np.full(16, 0x77, np.uint8)  # every value 6 (code 7 in both nibbles)
    with pytest.raises(ValueError, match=r"too small for float16: the block at scale index \[0\] has scale byte "
                                         r"100 \(2\^-27\), and its value 4\.47035e-08 becomes 5\.96046e-08"):
        mxfp4_decode(packed, np.array([100], np.uint8), np.float16)
    with pytest.raises(ValueError, match=r"its value 5\.87747e-39 becomes 0 in float16"):
        mxfp4_decode(np.full(16, 0x11, np.uint8), np.array([1], np.uint8), np.float16)  # 0.5 * 2^-126


def test_float16_decoding_returns_exactly_what_it_accepts():
    """Every byte at scale bytes 90 to 120: either exactly the float64 values, or refused (never changed)."""
    every_byte = np.arange(256, dtype=np.uint8).reshape(16, 16)  # 16 blocks of 32 values
    for s in range(90, 121):
        scale = np.full((16, 1), s, np.uint8)
        exact = mxfp4_decode(every_byte, scale, np.float64)
        if s >= 104:  # scales of 2^-23 and up: float16 holds 0.5 * 2^-23 = 2^-24, its smallest value
            np.testing.assert_array_equal(mxfp4_decode(every_byte, scale, np.float16).astype(np.float64), exact)
        else:
            with pytest.raises(ValueError, match="too small for float16"):
                mxfp4_decode(every_byte, scale, np.float16)
    zeros = mxfp4_decode(np.zeros(16, np.uint8), np.array([0], np.uint8), np.float16)  # zero is exact anywhere
    assert zeros.dtype == np.float16 and not zeros.any()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_bfloat16_and_float32_hold_every_small_block(dtype):
    every_byte = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scale = np.zeros((16, 1), np.uint8)  # 2^-127, the smallest scale
    np.testing.assert_array_equal(mxfp4_decode(every_byte, scale, dtype).astype(np.float64),
                                  mxfp4_decode(every_byte, scale, np.float64))


def _mxfp8_by_hand(block: np.ndarray) -> np.ndarray:
    """MXFP8 of one float64 block of 32: X = 2^ceil(log2(max|x| / 448)) from the exact maximum, then each x / X
    rounded to E4M3 (ties to even) once, from its float64 value."""
    amax = max(abs(float(v)) for v in block)
    if amax == 0:
        return np.zeros(32)
    mantissa, exponent = math.frexp(amax / 448)  # amax / 448 = m 2^exponent, m in [0.5, 1): exact (448 = 7 * 2^6)
    e = exponent - 1 if mantissa == 0.5 else exponent  # ceil(log2(amax / 448))
    e = min(max(e, -127), 127)
    scaled = np.array([math.ldexp(float(v), -e) for v in block])
    return np.array([math.ldexp(float(r), e) for r in scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)])


def test_mxfp8_rounds_a_float64_element_once():
    x = np.zeros(32)
    x[0], x[1], x[2] = 448.0, 1.0625 + 2**-30, 1.0625 - 2**-30  # just above and below E4M3's tie 1.0625
    out = mxfp8_round(x)
    assert out.dtype == np.float32
    assert (out[1], out[2]) == (1.125, 1.0)
    np.testing.assert_array_equal(out.astype(np.float64), _mxfp8_by_hand(x))


def test_mxfp8_of_float64_blocks_against_the_rule_computed_by_hand():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)) * np.exp2(rng.integers(-30, 30, size=(64, 1)))
    # Elements a hair from the ties between E4M3 neighbours of their block's scale.
    x[::2, 5] = np.ldexp(1.0625 + 2.0**-33, 0) * np.abs(x[::2, :]).max(axis=1) / 448 * 256
    out = mxfp8_round(x).astype(np.float64)
    for row in range(x.shape[0]):
        np.testing.assert_array_equal(out[row], _mxfp8_by_hand(x[row]), err_msg=f"block {row}")


def test_mxfp8_of_float32_input_is_unchanged_by_the_float64_path():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    np.testing.assert_array_equal(mxfp8_round(x), mxfp8_round(x.astype(np.float64)))  # exact in float64 too


@pytest.mark.parametrize("function", [mxfp4_scale_exponent, mxfp8_scale_exponent])
@pytest.mark.parametrize(("amax", "error", "message"), [
    (np.array([1.0, np.inf]), ValueError, r"amax must hold finite, non-negative values .*got inf at index \[1\]"),
    (np.array([np.nan]), ValueError, r"got nan at index \[0\]"),
    (np.array([2.0, -1.0]), ValueError, r"got -1\.0 at index \[1\]"),
    (np.array(["6"]), TypeError, r"amax must hold real numbers .*got dtype <U1"),
    (np.array([True]), TypeError, r"got dtype bool"),
])
def test_scale_exponents_refuse_maxima_no_block_has(function, amax, error, message):
    with pytest.raises(error, match=message):
        function(amax)


def test_scale_exponents_of_valid_maxima_are_unchanged():
    assert mxfp4_scale_exponent(np.array([6.0, 0.0, 1.75, 7.0])).tolist() == [0, -127, -1, 1]
    assert mxfp8_scale_exponent(np.array([448.0, 449.0, 0.0])).tolist() == [0, 1, -127]
    assert mxfp4_scale_exponent(np.array([6], np.int64)).tolist() == [0]  # integers, exactly
