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
from hypothesis import given
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
    scale = rng.integers(0, 255, size=(3, 5, 4), dtype=np.uint8)
    np.testing.assert_array_equal(mxfp4_decode(packed, scale), mxfp4_decode_reference(packed, scale))


# ---------------------------------------------------------------------------
# compressed-tensors as the oracle
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_decode_bit_for_bit_with_compressed_tensors(seed):
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, size=(48, 64), dtype=np.uint8)  # [out, in/2], in = 128
    # Every scale byte except 255 (NaN), including those whose products overflow or go subnormal.
    scale = rng.integers(0, 255, size=(48, 4), dtype=np.uint8)
    scale[0] = [0, 1, 253, 254]
    ours = mxfp4_decode(packed, scale, dtype=ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, _ct_decode(packed, scale))


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


@given(w=hnp.arrays(np.float32, (4, 64), elements=st.floats(-1e6, 1e6, width=32)))
def test_encode_error_is_bounded(w):
    # The worst rounding error is half an E2M1 step at the top, 1 * X; X <= max|w| / 3.5 (scale rule).
    packed, scale = mxfp4_encode(w)
    back = mxfp4_decode(packed, scale)
    blocks, back_blocks = w.reshape(4, 2, 32), back.reshape(4, 2, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    X = np.ldexp(1.0, scale.astype(np.int32) - 127)[..., None]
    err = np.abs(back_blocks - blocks)
    assert np.all(err <= X * 1.0 + 1e-45)
    assert np.all(np.abs(back_blocks) <= np.maximum(amax, 6 * X))  # no value grows past the block maximum's cap


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


@given(x=hnp.arrays(np.float32, (2, 96), elements=st.floats(-2.0**99, 2.0**99, width=32)))
def test_mxfp8_is_idempotent_and_close(x):
    once = mxfp8_round(x)
    np.testing.assert_array_equal(mxfp8_round(once), once)
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normal elements; E4M3's subnormal step is 2^-9 X,
    # and X <= max|x| / 224 (the scale never clips, so the block maximum lands in (224, 448]).
    blocks = x.reshape(2, 3, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    err = np.abs(once.reshape(2, 3, 32) - blocks)
    assert np.all(err <= np.abs(blocks) * 2.0**-4 + amax / 224 * 2.0**-10 + 1e-45)


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
