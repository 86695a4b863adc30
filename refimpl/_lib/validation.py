"""Input checks shared by the public functions.

Each check raises `TypeError` (wrong kind of value) or `ValueError` (right
kind, wrong shape or value) with a message that names the argument, what was
expected and what was given. Nothing is broadcast silently.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .values import shown
from .xp import Array, array_namespace, dtype_name, is_array, is_real_floating

__all__ = [
    "check_bias",
    "check_finite",
    "check_float_array",
    "check_float_dtype",
    "check_int",
    "check_positive",
    "check_shape",
]


#: The floating dtypes weights and decoded values may have, in NumPy's native byte order.
FLOAT_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16,
                                                                    np.float32, np.float64))


def check_float_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """`dtype` as a native-order NumPy dtype if it is a real floating type (float16, bfloat16, float32, float64).

    The one check of every `dtype=` argument that chooses what weights or decoded values are stored in
    (`init_params`, `params_from_hf_state_dict`, `load_hf_layer`, `mxfp4_decode`). Anything else is a
    `TypeError` naming the argument, before any array is made: "banana" is no dtype, and an integer,
    boolean or complex dtype would truncate every weight or carry an imaginary part the layer has no
    use for. A big-endian float32 (">f4") is float32: values are computed in the machine's own order.
    """
    expected = "a floating dtype (float16, bfloat16, float32 or float64)"
    try:
        resolved = np.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be {expected}, got {shown(dtype)}") from None
    native = resolved.newbyteorder("=") if resolved.byteorder not in ("=", "|") else resolved
    if native not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be {expected}, got {resolved.name}")
    return native


def _describe(x: Any) -> str:
    if is_array(x):
        return f"{type(x).__name__} of dtype {x.dtype}"
    return type(x).__name__


def check_float_array(name: str, x: Any, ndim: int | None = None) -> None:
    """`x` must be a real floating array (float16/32/64 or bfloat16), of rank `ndim` if given."""
    if not is_array(x):
        raise TypeError(f"{name} must be an array, got {_describe(x)}")
    if not is_real_floating(x):
        raise TypeError(f"{name} must be a real floating array (float16/32/64 or bfloat16), got dtype {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")


def check_shape(name: str, x: Array, expected: Sequence[int | None]) -> None:
    """`x.shape` must equal `expected`; `None` entries match any size."""
    shape = tuple(x.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, shape, strict=False))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(shape)}")


def check_finite(name: str, x: Array) -> None:
    """Every entry of `x` must be finite (no NaN, no infinity)."""
    xp = array_namespace(x)
    bad = ~xp.isfinite(x)
    if bool(xp.any(bad)):
        count = int(xp.sum(xp.astype(bad, xp.int64)))
        raise ValueError(f"{name} must be finite, got {count} non-finite entries (NaN or inf)")


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """`value` must be an integer (not a bool) in `[low, high]`; returns it as `int`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_positive(name: str, value: Any) -> float:
    """`value` must be a positive finite real number; returns it as `float`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float64 (10**400)
        raise ValueError(f"{name} must be positive and finite, got {shown(value)} (beyond float64)") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be positive and finite, got {number}")
    return number


def check_bias(bias: Any, n: int | None = None, *, name: str = "bias", context: str = "(one entry per expert)") -> None:
    r"""`bias` must be a finite `[n]` selection bias in float32 or float64 (never a half dtype).

    The bias drifts far from zero while it balances. In bfloat16 (8
    significant bits) values near 10 are 0.0625 apart, coarser than the score
    differences they must separate, so hundreds of distinct biases collapse
    onto a few and most tokens' top-$k$ changes: a half-precision bias is
    refused, not rounded. `n` (if given) is the number of experts it must
    have; `context` says why, in the message.
    """
    check_float_array(name, bias, ndim=1)
    if n is not None and bias.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}] {context}, got {list(bias.shape)}")
    if bias.shape[0] < 1:
        raise ValueError(f"{name} must hold at least one expert, got shape {list(bias.shape)}")
    if dtype_name(bias.dtype) in ("float16", "bfloat16"):
        raise TypeError(
            f"{name} must be float32 or float64, got {bias.dtype}: a half-precision bias far from zero merges "
            "distinct values and changes the top-k (keep it in float32 and mean-centred)")
    check_finite(name, bias)
