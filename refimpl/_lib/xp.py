r"""Array-namespace helpers: the few operations the array-API standard lacks.

Every numerical function in this package starts with
`xp = array_namespace(x, ...)` and then calls only functions of `xp`, the
pattern SciPy uses. The same readable code is therefore meant for NumPy,
CuPy and any other array-API library; the tests run it on NumPy and on
`array_api_strict` (their stand-in for "some array library that is not
NumPy", which, like CuPy, refuses implicit conversion to NumPy) everywhere,
and on CuPy where a GPU is present (on an H200 with CuPy 14.2 they all
passed; the benchmark page has the run).

The standard has no top-k, no bincount and no scatter-add. This module gives
each one a portable definition built from standard functions (stable sorts,
`searchsorted`, cumulative sums), and calls the native NumPy or CuPy routine
(or the partitioning top-k of `refimpl._lib.fast`) when the input is one of
those. Both paths return the same values, and the tests check that they do.

Tie order is part of the contract: `topk` ranks equal values by the lower
index first, which is the rule Eq. (13) uses to resolve ties between experts.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

from .fast import enabled, topk_by_partition

Array = Any  # any array of an array-API namespace (NumPy, CuPy, array_api_strict, ...)

__all__ = [
    "Array",
    "array_namespace",
    "bincount",
    "compute_dtype",
    "dtype_name",
    "is_array",
    "is_cupy",
    "is_numpy",
    "is_real_floating",
    "to_numpy",
    "topk",
]


def array_namespace(*arrays: Array) -> Any:
    """The array-API namespace shared by `arrays` (NumPy arrays give a NumPy-compatible one)."""
    return array_api_compat.array_namespace(*arrays)


def is_array(x: Any) -> bool:
    """True when `x` is an array of some namespace (it has a `shape` and a `dtype`); the one test of "is it an array"."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def is_numpy(xp: Any) -> bool:
    """True when `xp` is NumPy's namespace (native or wrapped by array_api_compat)."""
    return array_api_compat.is_numpy_namespace(xp)


def is_cupy(xp: Any) -> bool:
    """True when `xp` is CuPy's namespace."""
    return array_api_compat.is_cupy_namespace(xp)


def dtype_name(dtype: Any) -> str:
    """A dtype's plain name ("float32", "bfloat16"), whatever library it comes from."""
    return str(getattr(dtype, "name", dtype)).rsplit(".", 1)[-1]


def is_real_floating(x: Array) -> bool:
    """True for real floating arrays, bfloat16 (from `ml_dtypes`) included.

    `bfloat16` is not a NumPy floating type (`np.issubdtype` says no and
    `isdtype` raises), so it is recognised by name.
    """
    name = dtype_name(x.dtype)
    if name == "bfloat16":
        return True
    return name in ("float16", "float32", "float64")


def compute_dtype(xp: Any, *arrays: Array) -> Any:
    """The dtype used for arithmetic: float64 if any input is float64, else float32.

    Half-precision inputs (float16, bfloat16) are computed in float32 and cast
    back by the caller, as the K3 code does for its activations.
    """
    if any(dtype_name(a.dtype) == "float64" for a in arrays):
        return xp.float64
    return xp.float32


def to_numpy(x: Array) -> np.ndarray:
    """Any array as a NumPy array on the host, by an explicit transfer.

    CuPy copies from the device with `.get()`; a library that refuses
    implicit conversion (CuPy does) is never handed to `np.asarray`. Other
    arrays on the CPU come through DLPack, the array API's exchange protocol,
    and only what supports neither falls back to `np.asarray`.
    """
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):  # CuPy
        return x.get()
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError):
            pass  # on another device, or a dtype DLPack lacks: let np.asarray try, or say why not
    return np.asarray(x)


def topk(x: Array, k: int) -> tuple[Array, Array]:
    """The `k` largest entries of each row of `x` and their column indices.

    Returns `(values, index)`, both `[..., k]`, sorted by value descending;
    equal values are ordered by the lower index first, so the result is fully
    determined by the input.

    The readable definition is a stable descending sort. On NumPy the fast
    path (`refimpl._lib.fast.topk_by_partition`) partitions instead, O(n) per row plus a sort
    of the k survivors, with the same tie rule.
    """
    xp = array_namespace(x)
    n = x.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise TypeError(f"k must be an integer, got {type(k).__name__} {k!r}")
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] for rows of length {n}, got k={k}")
    if enabled() and is_numpy(xp) and 0 < k < n:
        return topk_by_partition(np.asarray(x), k)
    # Portable definition: a stable descending sort keeps lower indices first among equals.
    index = xp.argsort(x, axis=-1, descending=True, stable=True)[..., :k]  # [..., k]
    values = xp.take_along_axis(x, index, axis=-1)  # [..., k]
    return values, index


def bincount(index: Array, n: int) -> Array:
    """How often each of `0, ..., n-1` occurs in the integer array `index` (any shape).

    Returns an `[n]` integer array. The portable path sorts the indices and
    counts each value with two `searchsorted` calls. Both paths raise on a
    negative id and ignore ids `>= n`.
    """
    xp = array_namespace(index)
    flat = xp.reshape(index, (-1,))
    if flat.shape[0] and int(xp.min(flat)) < 0:
        raise ValueError(f"index must hold non-negative integers, got a minimum of {int(xp.min(flat))}")
    if is_numpy(xp) or is_cupy(xp):
        return xp.bincount(flat, minlength=n)[:n]
    ordered = xp.sort(flat)
    values = xp.arange(n, dtype=ordered.dtype)
    left = xp.searchsorted(ordered, values, side="left")
    right = xp.searchsorted(ordered, values, side="right")
    return xp.astype(right - left, xp.int64)
