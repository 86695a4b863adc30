r"""OCP microscaling: the MXFP4 weights and MXFP8 activations of K3's deployment.

K3 ships its routed experts in **MXFP4** and runs their inputs in **MXFP8**
in deployment. Both are *microscaling* formats of the OCP Microscaling
specification v1.0: a block of 32 consecutive values shares one scale, a
power of two stored as an 8-bit exponent (**E8M0**), and each value keeps
only a tiny float of its own:

$$
w_j \;=\; X \cdot P_j, \qquad X = 2^{\,s - 127}, \qquad j = 1, \dots, 32,
$$

where $s \in \{0, \dots, 254\}$ is the scale byte (255 encodes NaN) and $P_j$
is the element: **E2M1** (4 bits) for MXFP4, **E4M3** (8 bits, largest 448)
for MXFP8. A 32-value MXFP4 block takes $32 \cdot 4 + 8 = 136$ bits, 4.25 bits
a value, against 16 for bfloat16.

## The E2M1 element and the byte layout

An E2M1 code has a sign bit (bit 3), two exponent bits and one mantissa bit.
Codes 0 to 7 are the magnitudes

| code | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
|---|---|---|---|---|---|---|---|---|
| value | 0 | 0.5 | 1 | 1.5 | 2 | 3 | 4 | 6 |

and codes 8 to 15 their negatives (code 8 is $-0$). compressed-tensors, the
format of K3's checkpoint, stores a quantized `X.weight [out, in]` as

* `X.weight_packed`, uint8 `[out, in/2]`: two codes per byte, the **low nibble
  holds the even input column** and the high nibble the odd one;
* `X.weight_scale`, uint8 `[out, in/32]`: the E8M0 byte $s$ of each block of 32
  consecutive input columns.

So byte `0x2B` in column $c$ of `weight_packed` is the pair (low nibble
`0xB` = $-1.5$ at input column $2c$, high nibble `0x2` = $1$ at column $2c+1$),
and with scale byte 120 they stand for $-1.5 \cdot 2^{-7}$ and $2^{-7}$.

## Decoding

`mxfp4_decode` is the equation above read right to left. Since a byte
holds two codes, the fast path looks each **byte** up in a 256-entry table of
value pairs (one gather gives both columns) and multiplies each block by its
scale. Multiplying by a power of two is exact, so the decoded weights are
exactly the stored ones in float32 (and in bfloat16, whose exponent range is
float32's) as long as they fit. The tests check this against
compressed-tensors' own decoder bit for bit on random bytes.

Two scale bytes need care, and the decoder refuses to guess:

* **Byte 255 is E8M0's NaN**: a block with that scale has no value. Decoding
  it is a `ValueError` that says where it is, never 32 NaNs slipped into a
  weight matrix (`load_hf_layer` adds the tensor and the expert).
* **The top of the range does not fit in float32.** Scale byte 254 is
  $2^{127}$, and the largest element 6 makes $6 \cdot 2^{127} \approx
  1.02 \times 10^{39}$, beyond float32's $3.4 \times 10^{38}$ (bytes 253 and 254
  are the only ones that can overflow). compressed-tensors returns infinity
  there; `mxfp4_decode` raises a `ValueError` that names the byte, the value
  and the fix, `dtype=np.float64`, in which every MXFP4 value is exact.
* **The bottom of the range does not fit in float16.** Its smallest value is
  $2^{-24}$, and a block's values are multiples of half its scale, so blocks
  with scale bytes below 104 can hold values that float16 rounds or flushes to
  zero. `mxfp4_decode(..., dtype=np.float16)` raises a `ValueError` for such a
  value, naming the block, the value and what float16 makes of it, instead of
  returning the weight changed (bfloat16, float32 and float64 hold every
  small value).

## Encoding: which scale

The OCP specification picks $X = 2^{\lfloor \log_2 \max_j |w_j| \rfloor - 2}$
(2 is the exponent of E2M1's largest value, 6): the block maximum lands in
$[4, 8)$ and values above 6 are clamped to 6, so a block maximum just under a
power of two, say $7.9 \cdot X$, loses a quarter of its size.
compressed-tensors' encoder (the library whose format K3's checkpoint uses)
first rounds the block maximum to E2M1's single mantissa bit (half up) and
takes the exponent of that. Writing the block maximum as
$a = \max_j |w_j| = \mu \cdot 2^{E}$ with $\mu \in [1, 2)$, that is

$$
X = \begin{cases} 2^{E - 2} & \mu < 1.75 \\ 2^{E - 1} & \mu \ge 1.75 \end{cases}
$$

so a block whose maximum would round to 8 or more gets the next scale up and
its maximum lands in $[3.5, 4)$ instead of being clipped; otherwise $a/X$ lies
in $[4, 7)$ and rounds to at most 6. `mxfp4_encode` uses **that rule**, so
that it reproduces compressed-tensors' encoder; the tests check that its bytes
equal compressed-tensors' on random weights. Each scaled value then rounds to
the nearest E2M1 value, ties to the even code (magnitudes in $(6, 7)$ round
down to 6). An all-zero block gets scale byte 0 (the exponent $-\infty$
clamped to E8M0's smallest, $2^{-127}$); blocks of values so small that
their exponent would fall below $-127$ get that smallest scale too, and their
values round to the nearest E2M1 value times $2^{-127}$ (multiples of
$2^{-128}$ up to $2^{-126}$, coarser above; most such values round to zero).

## MXFP8 for the activations

`mxfp8_round` quantizes and dequantizes in one step: blocks of 32 along
the last axis, elements rounded to E4M3 (ties to even), then multiplied back.
The scale is the **smallest power of two that does not clip**,

$$
X = 2^{\lceil \log_2 (\max_j |x_j| / 448) \rceil},
$$

so every element fits under E4M3's largest value 448 and none is saturated.
The OCP rule $2^{\lfloor \log_2 \max_j |x_j| \rfloor - 8}$ differs from it only
for blocks whose maximum has a mantissa above 1.75; there it clips the
maximum to 448, an error of up to 12.5 %, where this rule loses one bit of
resolution instead (the same choice compressed-tensors' encoder makes for
MXFP4, above). The result is a float32 array of values that MXFP8 can hold,
and rounding such an array again changes nothing (the tests check it). This
is how the deployment precision of `stable_latent_moe` feeds each expert
product: quantize–dequantize, then float32 arithmetic.

## Numbers at the edges

An encoder that meets a number it cannot represent must say so or saturate;
it must never hand back a finite value that is wrong by more than its
rounding, or an infinity for a finite input. The encoders here compute in
float32 (float64 for float64 input) and follow three rules:

* **Non-finite input** (NaN, $\pm\infty$) is a `ValueError` that counts the
  entries.
* **Finite input the arithmetic cannot hold** is a `ValueError` naming the
  argument and its largest magnitude. Finiteness is checked on what the
  arithmetic sees, after the cast: a float64 $10^{39}$ is finite, but it is
  infinity in the float32 that `mxfp8_round` computes in. For MXFP4, whose
  largest value is $6 \cdot 2^{127}$, a float64 block whose maximum needs a
  scale above $2^{127}$ (a maximum of $7 \cdot 2^{127} \approx 1.19 \times
  10^{39}$ or more) is refused rather than clipped to a tenth of its size.
* **Rounding up past the largest float**: a float32 value within a rounding
  step of float32's maximum rounds to $2^{128}$, which float32 cannot hold
  (`mxfp4_encode` on $3.4 \times 10^{38}$ would pick code 4 at scale
  $2^{126}$; `mxfp8_round` would round $255.99 \cdot 2^{120}$ to the E4M3 value
  256). Such an element **saturates**: it takes the next code down, the
  largest value of its block that float32 holds, still within the error bound
  of one step $X$. So every finite float32 input encodes to values that
  decode to finite float32 values, and the tests draw inputs across float32's
  whole range to check it.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ._lib.validation import FLOAT_DTYPES, check_float_dtype
from ._lib.xp import is_array

__all__ = [
    "E2M1_VALUES",
    "MX_BLOCK",
    "e2m1_decode",
    "e8m0_decode",
    "mxfp4_decode",
    "mxfp4_encode",
    "mxfp4_scale_exponent",
    "mxfp8_round",
    "mxfp8_scale_exponent",
]

#: Values per shared scale in every MX format.
MX_BLOCK = 32

#: The 16 E2M1 values by code: bit 3 is the sign, codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES: np.ndarray = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)

# E2M1's and E4M3's largest values and their exponents (6 = 1.5 * 2^2, 448 = 1.75 * 2^8).
_E2M1_MAX, _E2M1_EMAX = 6.0, 2
_E4M3_MAX, _E4M3_EMAX = 448.0, 8
# E8M0 holds exponents -127 .. 127 (byte 255 is NaN).
_E8M0_MIN, _E8M0_MAX = -127, 127


def _check_blocks(name: str, x: Any, *, kind: str) -> np.ndarray:
    """`x` as a NumPy array with at least one axis; `kind` is 'float' or 'uint8'."""
    if not is_array(x):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    x = np.asarray(x)
    if not x.dtype.isnative:  # big-endian bytes (read from a file): the same values in the machine's order
        x = x.astype(x.dtype.newbyteorder("="))
    if kind == "uint8" and x.dtype != np.uint8:
        raise TypeError(f"{name} must be a uint8 array, got dtype {x.dtype}")
    if kind == "float" and np.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a real floating array, got dtype {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least one axis, got a scalar")
    return x


def _in_working_dtype(name: str, x: np.ndarray, work: type) -> np.ndarray:
    """`x` cast to `work`, refusing non-finite entries and finite ones that the cast turns into infinity.

    Finiteness is checked twice: on the input, and on what the arithmetic
    will see, since a finite float64 such as 1e39 is infinity in float32.
    """
    finite = np.isfinite(x)
    if not np.all(finite):
        raise ValueError(f"{name} must be finite, got {int(np.sum(~finite))} non-finite entries")
    with np.errstate(over="ignore"):
        cast = x.astype(work, copy=False)
    if not np.all(np.isfinite(cast)):
        largest = float(np.max(np.abs(x.astype(np.float64))))
        raise ValueError(
            f"{name} holds values beyond {np.dtype(work).name}'s range, which this function computes in: "
            f"largest magnitude {largest:.6g}, and {np.dtype(work).name} holds at most "
            f"{float(np.finfo(work).max):.8g}")
    return cast


# ---------------------------------------------------------------------------
# Elements and scales
# ---------------------------------------------------------------------------

def _check_codes(name: str, x: Any, high: int, what: str) -> np.ndarray:
    """`x` as a uint8 array if it holds integers in [0, `high`] (any integer dtype); else an error naming `name`.

    A code is a bit pattern: a float (1.7), a bool or a value out of range (256, -1) is no code, and a cast
    to uint8 would wrap it silently onto another one, so each is refused (`TypeError` for the dtype,
    `ValueError` for the values, with their range and count).
    """
    x = np.asarray(x)
    if x.dtype.kind not in "ui":
        raise TypeError(f"{name} must be an array of {what} (uint8, or integers in [0, {high}]), got dtype {x.dtype}")
    if x.dtype != np.uint8 or high < 255:
        outside = (x < 0) | (x > high)
        if np.any(outside):
            raise ValueError(f"{name} must hold {what} in [0, {high}], got {int(np.sum(outside))} value(s) outside "
                             f"it (values in [{int(x.min())}, {int(x.max())}])")
    return x.astype(np.uint8, copy=False)


def e2m1_decode(codes: Any) -> np.ndarray:
    """The float32 value of each 4-bit E2M1 code: `codes` holds integers 0-15 (uint8 or any integer dtype).

    A float, a bool or a code above 15 is refused, naming `codes` (a TypeError or ValueError).
    """
    return E2M1_VALUES[_check_codes("codes", codes, 15, "4-bit E2M1 codes")]


def e8m0_decode(scale: Any) -> np.ndarray:
    r"""The float32 value $2^{s - 127}$ of each E8M0 byte $s$ (255 gives NaN; every other byte is exact).

    `scale` holds bytes 0-255 (uint8 or any integer dtype); a float, a bool or a value outside a byte is
    refused, naming `scale` (a cast would wrap 256 onto byte 0 and -1 onto the NaN byte).
    """
    scale = _check_codes("scale", scale, 255, "E8M0 scale bytes")
    return scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def _floor_log2(a: np.ndarray) -> np.ndarray:
    r"""$\lfloor \log_2 a \rfloor$ for positive finite `a`, exactly (from the float's own exponent)."""
    # frexp: a = m 2^e with m in [0.5, 1), so floor(log2 a) = e - 1.
    _, e = np.frexp(a)
    return e.astype(np.int32) - 1


def _mxfp4_exponent(amax: np.ndarray) -> np.ndarray:
    r"""compressed-tensors' MXFP4 exponent of blocks with maxima `amax`, before E8M0's range is applied.

    $e = \lfloor \log_2 a \rfloor - 2$, plus one when the mantissa of $a$ is
    at least 1.75; an all-zero block gets $-127$.
    """
    amax = np.asarray(amax)
    positive = amax > 0
    safe = np.where(positive, amax, 1.0)
    e = _floor_log2(safe)  # floor(log2 amax)
    # The mantissa of amax, in [1, 2): round it half up to one bit; 1.75 and above becomes 2.
    mantissa = safe / np.ldexp(np.ones_like(safe), e)
    e = e + (mantissa >= 1.75)
    # $$X = 2^{\lfloor \log_2 \operatorname{round}_1(a) \rfloor - 2}$$
    e = e - _E2M1_EMAX
    return np.where(positive, e, _E8M0_MIN).astype(np.int32)


def mxfp4_scale_exponent(amax: np.ndarray) -> np.ndarray:
    r"""The shared exponent $\log_2 X$ of MXFP4 blocks with maxima `amax` (compressed-tensors' rule).

    $e = \lfloor \log_2 a \rfloor - 2$, plus one when $a \ge 1.75 \cdot 2^{\lfloor \log_2 a \rfloor}$
    (the maximum would round to 8 or more), clamped to E8M0's $[-127, 127]$;
    an all-zero block gets $-127$. Returns int32 exponents. `amax` must hold
    finite, non-negative real numbers (a block's largest magnitude): anything
    else is a `TypeError` or `ValueError` naming it.
    """
    return np.clip(_mxfp4_exponent(_check_maxima(amax)), _E8M0_MIN, _E8M0_MAX).astype(np.int32)


def _check_maxima(amax: Any) -> np.ndarray:
    """`amax` as an array of finite, non-negative real numbers: blocks' largest magnitudes, or an error naming it."""
    a = np.asarray(amax)
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer) or a.dtype.newbyteorder("=") in FLOAT_DTYPES):
        raise TypeError(f"amax must hold real numbers (blocks' largest magnitudes), got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.integer) or a.dtype == ml_dtypes.bfloat16:
        a = a.astype(np.float64)  # exactly (frexp needs a NumPy float)
    bad = ~np.isfinite(a) | (a < 0)
    if np.any(bad):
        first = tuple(int(i) for i in np.argwhere(bad)[0]) if a.ndim else ()
        raise ValueError(f"amax must hold finite, non-negative values (blocks' largest magnitudes), got "
                         f"{float(a[first])} at index {list(first)} ({int(bad.sum())} such entries)")
    return a


# ---------------------------------------------------------------------------
# MXFP4: encode and decode (teaching code first)
# ---------------------------------------------------------------------------

def mxfp4_encode(w: Any) -> tuple[np.ndarray, np.ndarray]:
    """Encode `w` `[..., K]` as MXFP4 along its last axis (K a multiple of 32).

    Returns `(packed, scale)`: `packed` uint8 `[..., K/2]` (low nibble = even
    column) and `scale` uint8 `[..., K/32]` (E8M0 bytes), the layout of
    compressed-tensors' `weight_packed` and `weight_scale`. The scale rule is
    compressed-tensors' (see the page); values round to the nearest E2M1
    value, ties to even. Computes in float32 (float64 for float64 input).

    Raises `ValueError` for non-finite input and for a float64 block whose
    maximum lies beyond MXFP4's range (it would need a scale above
    2^127). An element whose nearest MXFP4 value float32 cannot hold
    (within a rounding step of float32's largest value) saturates to the next
    code down, so the result always decodes to finite values in the working
    dtype.
    """
    w = _check_blocks("w", w, kind="float")
    K = w.shape[-1]
    if K % MX_BLOCK:
        raise ValueError(f"w must have a last axis that is a multiple of {MX_BLOCK}, got shape {list(w.shape)}")
    work = np.float64 if w.dtype == np.float64 else np.float32
    blocks = _in_working_dtype("w", w, work).reshape(*w.shape[:-1], K // MX_BLOCK, MX_BLOCK)  # [..., K/32, 32]
    # One exponent per block of 32, from the block's largest magnitude.
    amax = np.max(np.abs(blocks), axis=-1)  # [..., K/32]
    e = _mxfp4_exponent(amax)
    if np.any(e > _E8M0_MAX):
        raise ValueError(
            f"w holds values beyond MXFP4's range: largest magnitude {float(np.max(amax)):.6g}, and the "
            f"format's largest value is 6 * 2^127 = {6 * 2.0**127:.6g} (values below 7 * 2^127 round to it)")
    e = np.maximum(e, _E8M0_MIN)  # tiny blocks: the smallest scale, their values round towards zero
    # $$P_j = \operatorname{round}_{\text{E2M1}}(w_j / X)$$ (ties to even, saturating at 6)
    scaled = np.ldexp(blocks, -e[..., None])  # exact: a power of two
    codes = np.clip(scaled, -_E2M1_MAX, _E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    codes = _saturate_mxfp4_codes(codes, e, work)  # [..., K/32, 32]
    codes = codes.reshape(*w.shape[:-1], K // 2, 2)  # [..., K/2, 2]
    # Two codes a byte: even column in the low nibble, odd column in the high nibble.
    packed = codes[..., 0] | (codes[..., 1] << 4)  # [..., K/2]
    scale = (e + 127).astype(np.uint8)  # [..., K/32], E8M0 bytes
    return packed.astype(np.uint8), scale


def _saturate_mxfp4_codes(codes: np.ndarray, e: np.ndarray, work: type) -> np.ndarray:
    r"""Step down every code whose value $X P_j$ is beyond the largest finite value of `work`.

    Only blocks at the very top of float32's range can hold one: code 4 at
    scale $2^{126}$ is $2^{128}$. The next code down (3, so $1.5 \cdot 2^{127}$)
    is within one step $X$ of the input, the encoder's error bound.
    """
    limit = float(np.finfo(work).max)
    if not np.any(np.ldexp(_E2M1_MAX, e) > limit):  # the usual case: no block comes near
        return codes
    value = np.ldexp(E2M1_VALUES[codes & 0x07].astype(np.float64), e[..., None])  # [..., K/32, 32], |X P_j|
    return np.where(value > limit, codes - 1, codes).astype(np.uint8)  # magnitude - 1, the sign bit kept


def mxfp4_decode_reference(packed: np.ndarray, scale: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    r"""Decode MXFP4 as the format is defined, nibble by nibble: $w_j = 2^{s-127} P_j$ in `dtype`.

    The readable version of `mxfp4_decode`, kept for teaching and tests. It
    is the bare formula: it checks nothing, so scale byte 255 gives NaN and a
    product beyond `dtype`'s range gives infinity; `mxfp4_decode` refuses both.
    """
    low = packed & 0x0F  # [..., K/2], even columns
    high = packed >> 4  # [..., K/2], odd columns
    codes = np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)  # [..., K]
    P = e2m1_decode(codes).astype(dtype)  # [..., K]
    X = e8m0_decode(scale).astype(dtype)  # [..., K/32]
    # $$w_j = X\, P_j$$
    with np.errstate(over="ignore"):
        return (P.reshape(*scale.shape, MX_BLOCK) * X[..., None]).reshape(P.shape)


# Fast path: one table lookup decodes a byte into both of its values.
# _PAIRS[b] holds the float32 bits of (value of low nibble, value of high nibble) as one uint64.
_PAIRS: np.ndarray = np.stack(
    [E2M1_VALUES[np.arange(256) & 0x0F], E2M1_VALUES[np.arange(256) >> 4]], axis=-1
).astype(np.float32).view(np.uint64).reshape(256)


def mxfp4_decode(packed: Any, scale: Any, dtype: Any = np.float32) -> np.ndarray:
    r"""Decode MXFP4 `packed` `[..., K/2]` with `scale` `[..., K/32]` into `[..., K]` values of `dtype`.

    The inverse of `mxfp4_encode` on every representable value and the same
    bytes-to-values map as compressed-tensors' decoder. Fast path: a
    256-entry table turns each byte into its two float32 values in one
    gather, then each block of 32 is multiplied by its power-of-two scale
    (exact). `dtype` is float32 (default), bfloat16, float16 or float64; in
    float64 every MXFP4 value is exact.

    Raises `ValueError` for a scale byte 255 (E8M0's NaN: the block has no
    value) and for a value `dtype` cannot hold (scale bytes 253 and 254 in
    float32 or bfloat16 can reach $6 \cdot 2^{127}$; decode those with
    `dtype=np.float64`), too large or too small: float16 cannot hold some
    values of blocks with scale bytes below 104 (scales under $2^{-23}$), and
    a value it would round, or flush to zero, is refused rather than returned
    changed. Each names the block; `TypeError` for a `dtype` that is not
    floating.
    """
    packed = _check_blocks("packed", packed, kind="uint8")
    scale = _check_blocks("scale", scale, kind="uint8")
    dtype = check_float_dtype(dtype)
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * MX_BLOCK:
        raise ValueError(
            f"packed [..., K/2] and scale [..., K/32] must describe the same K: got packed "
            f"{list(packed.shape)} and scale {list(scale.shape)} (expected scale "
            f"{list(packed.shape[:-1]) + [packed.shape[-1] * 2 // MX_BLOCK]})")
    nan_blocks = scale == 255
    if np.any(nan_blocks):
        first = tuple(int(i) for i in np.argwhere(nan_blocks)[0])
        raise ValueError(f"scale holds the E8M0 NaN byte 255 in {int(nan_blocks.sum())} block(s), the first "
                         f"at scale index {list(first)}: a block with that scale has no value")
    work = np.float64 if dtype == np.float64 else np.float32
    # [..., K/2] bytes -> [..., K/2] pairs of float32 -> [..., K/32, 32] values
    values = np.take(_PAIRS, packed).view(np.float32).reshape(*scale.shape, MX_BLOCK).astype(work, copy=False)
    # $$w_j = 2^{s - 127} P_j$$, block by block (overflow is looked for below, where it can happen)
    with np.errstate(over="ignore"):
        values *= e8m0_decode(scale).astype(work)[..., None]
        out = values.reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(dtype, copy=False)
    if scale.size and int(scale.max()) >= _first_overflowing_byte(dtype):
        _refuse_overflow(out, scale, dtype)
    if scale.size and int(scale.min()) < _first_exact_byte(dtype):
        _refuse_underflow(out, values.reshape(out.shape), scale, dtype)
    return out


def _first_exact_byte(dtype: np.dtype) -> int:
    r"""The smallest scale byte $s$ whose every value `dtype` holds exactly.

    A block's values are $P \cdot 2^{s - 127}$ with $P$ an E2M1 magnitude, whose lowest bit is $2^{-1}$ (0.5,
    1.5), so each is a multiple of $2^{s - 128}$: `dtype` holds them all when that is at least its smallest
    subnormal (float16's $2^{-24}$: bytes from 104; bfloat16, float32 and float64 hold every byte's).
    """
    _, exponent = np.frexp(float(ml_dtypes.finfo(dtype).smallest_subnormal))  # = 0.5 * 2^exponent
    return 128 + int(exponent) - 1


def _refuse_underflow(out: np.ndarray, exact: np.ndarray, scale: np.ndarray, dtype: np.dtype) -> None:
    """Raise if a decoded value lost bits in `dtype` (rounded, or flushed to zero), naming the block."""
    lost = out.astype(exact.dtype) != exact
    if not np.any(lost):
        return
    where, block, s = _first_block(lost, scale)
    raise ValueError(
        f"MXFP4 values too small for {dtype.name}: the block at scale index {list(block)} has scale byte {s} "
        f"(2^{s - 127}), and its value {float(exact[where]):.6g} becomes {float(out[where]):.6g} in "
        f"{dtype.name} (whose smallest value is {float(ml_dtypes.finfo(dtype).smallest_subnormal):.6g}); "
        f"decode with dtype=np.float32, which holds every MXFP4 value below 2^128 exactly")


def _first_block(mask: np.ndarray, scale: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The first element where `mask` (`[..., K]`) holds, its block's index in `scale` and that block's byte."""
    where = tuple(int(i) for i in np.argwhere(mask)[0])
    block = where[:-1] + (where[-1] // MX_BLOCK,)
    return where, block, int(scale[block])


def _first_overflowing_byte(dtype: np.dtype) -> int:
    r"""The smallest scale byte $s$ whose block can exceed `dtype`: $6 \cdot 2^{s - 127}$ > its largest value."""
    # $$6 \cdot 2^{s-127} > M \iff s > 127 + \log_2(M / 6)$$
    _, exponent = np.frexp(float(ml_dtypes.finfo(dtype).max) / _E2M1_MAX)  # M/6 = m 2^exponent, m in [0.5, 1)
    return 127 + int(exponent)


def _refuse_overflow(out: np.ndarray, scale: np.ndarray, dtype: np.dtype) -> None:
    """Raise if a decoded value overflowed to infinity, naming the block, its scale byte and the value."""
    overflow = np.isinf(out)
    if not np.any(overflow):
        return
    _, block, s = _first_block(overflow, scale)
    raise ValueError(
        f"MXFP4 values overflow {dtype.name}: the block at scale index {list(block)} has scale byte {s} "
        f"(2^{s - 127}), and one of its values is beyond {dtype.name}'s largest "
        f"{float(ml_dtypes.finfo(dtype).max):.6g} (MXFP4 reaches 6 * 2^127 = {6 * 2.0**127:.6g}); "
        f"decode with dtype=np.float64, which holds every MXFP4 value exactly")


# ---------------------------------------------------------------------------
# MXFP8: quantize and dequantize the activations
# ---------------------------------------------------------------------------

def mxfp8_scale_exponent(amax: np.ndarray) -> np.ndarray:
    r"""The shared exponent of MXFP8 blocks with maxima `amax`: $\lceil \log_2(a / 448) \rceil$, exactly.

    $\lfloor \log_2 a \rfloor - 8$, plus one when the mantissa of $a$ exceeds
    1.75 ($448 = 1.75 \cdot 2^8$), clamped to E8M0's $[-127, 127]$; an all-zero
    block gets $-127$. Returns int32 exponents. `amax` must hold finite,
    non-negative real numbers, as for `mxfp4_scale_exponent`.
    """
    amax = _check_maxima(amax)
    positive = amax > 0
    safe = np.where(positive, amax, 1.0)
    e = _floor_log2(safe)
    mantissa = safe / np.ldexp(np.ones_like(safe), e)  # [1, 2)
    # $$e = \lceil \log_2 (a / 448) \rceil$$
    e = e - _E4M3_EMAX + (mantissa > _E4M3_MAX / 2.0**_E4M3_EMAX)
    e = np.where(positive, e, _E8M0_MIN)
    return np.clip(e, _E8M0_MIN, _E8M0_MAX).astype(np.int32)


def mxfp8_round(x: Any) -> np.ndarray:
    r"""Round `x` `[..., K]` to MXFP8 and back (float32), blocks of 32 along the last axis.

    Scale $X = 2^{\lceil \log_2(\max|x| / 448) \rceil}$ (`mxfp8_scale_exponent`: no
    element is clipped), elements rounded to E4M3, ties to even. A last axis
    that is not a multiple of 32 is an error: the format has no partial
    blocks. Idempotent: `mxfp8_round(mxfp8_round(x)) == mxfp8_round(x)`.

    Returns float32: non-finite input, and finite input beyond float32's
    range (a float64 1e39), is a `ValueError`. Each element is rounded once,
    from its own value (a float64 is not rounded to float32 on the way, which
    would round twice), and the scale is that of the block's exact maximum.
    An element that would round up past float32's largest value saturates to
    the next E4M3 value down, so a finite input never comes back infinite.
    """
    x = _check_blocks("x", x, kind="float")
    K = x.shape[-1]
    if K % MX_BLOCK:
        raise ValueError(f"x must have a last axis that is a multiple of {MX_BLOCK}, got shape {list(x.shape)}")
    checked = _in_working_dtype("x", x, np.float32)  # non-finite input, and values float32 cannot hold, refused
    # A float64 element is scaled and rounded to E4M3 from its own value: rounding it to float32 first would
    # round twice (1.0625 + 2^-30 becomes the tie 1.0625, then 1.0, where E4M3's nearest value is 1.125).
    exact = x if x.dtype == np.float64 else checked
    blocks = exact.reshape(*x.shape[:-1], K // MX_BLOCK, MX_BLOCK)  # [..., K/32, 32]
    e = mxfp8_scale_exponent(np.max(np.abs(blocks), axis=-1))[..., None]  # [..., K/32, 1]
    # $$x_j \approx X \operatorname{round}_{\text{E4M3}}(x_j / X)$$ (the clip only guards the E8M0 clamp)
    scaled = np.clip(np.ldexp(blocks, -e), -_E4M3_MAX, _E4M3_MAX)
    rounded = scaled.astype(ml_dtypes.float8_e4m3fn)  # [..., K/32, 32]
    with np.errstate(over="ignore"):
        out = np.ldexp(rounded.astype(np.float32), e)
    overflow = np.isinf(out)
    if np.any(overflow):
        # Saturate: 256 * 2^120 = 2^128 is the only product that can overflow; step to the code below (240).
        codes = rounded.view(np.uint8).copy()
        codes[overflow] -= 1  # one E4M3 code down in magnitude, the sign bit (bit 7) kept
        out = np.ldexp(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32), e)
    return out.reshape(x.shape)
