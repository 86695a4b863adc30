r"""What a user's function returned: converted, validated and formatted for the report, the same way by every check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._lib.values import switch_value
from .._lib.xp import dtype_name, is_array
from .report import (
    Violation,
    errors,
)

__all__ = ["bias_output", "count", "error_line", "error_sizes", "float_output", "fmt", "is_float", "route_output",
           "sorted_route", "token_lines", "user_array", "within"]


# ---------------------------------------------------------------------------
# Small helpers shared by the checks
# ---------------------------------------------------------------------------

def user_array(name: str, value: Any, dtype: Any = None) -> np.ndarray:
    """`np.asarray(value)`, for what the user's code returned; a conversion that fails is a `Violation` naming it.

    A GPU array, a tensor that requires grad, a ragged list: NumPy refuses each with its own error, which the
    report shows with the conversion that was tried, instead of letting it escape from inside the check.
    """
    try:
        with np.errstate(all="ignore"):
            return np.asarray(value, dtype=dtype)
    except Exception as exc:  # anything NumPy or the object's __array__ raises
        raise Violation(f"{name} could not be converted with np.asarray(..."
                        f"{', dtype=' + np.dtype(dtype).name if dtype is not None else ''}): "
                        f"{type(exc).__name__}: {exc}",
                        [f"it is a {type(value).__module__}.{type(value).__qualname__}; return a NumPy array "
                         "(from PyTorch: tensor.detach().cpu().numpy())"]) from None


def is_float(a: np.ndarray) -> bool:
    return dtype_name(a.dtype) in ("float16", "bfloat16", "float32", "float64")


def within(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Elementwise `|actual - expected| <= atol + rtol |expected|` (NaN never passes)."""
    return np.abs(actual - expected) <= atol + rtol * np.abs(expected)


def error_sizes(actual: np.ndarray, expected: np.ndarray) -> str:
    abs_err, rel_err = errors(actual, expected)
    return f"max abs error {abs_err:.3g}, max rel error {rel_err:.3g} (relative to the largest |expected|)"


def error_line(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> str:
    return f"{error_sizes(actual, expected)}; tolerance: atol {atol:g} + rtol {rtol:g} x |expected|"


def fmt(values: np.ndarray, digits: int = 6, *, longest: int | None = None) -> str:
    """`values` as the report prints them: `digits` significant decimals; with `longest`, a longer vector is
    summarized by its first and last four entries."""
    summary = {} if longest is None else {"threshold": longest, "edgeitems": 4}
    return np.array2string(np.asarray(values, dtype=np.float64) + 0.0, precision=digits, separator=", ",
                           max_line_width=200, suppress_small=False, **summary)


def sorted_route(index: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's experts in increasing id order, with their weights: routes compared as sets."""
    order = np.argsort(index, axis=1, kind="stable")
    return np.take_along_axis(index, order, axis=1), np.take_along_axis(weights, order, axis=1)


def float_output(name: str, out: Any, shape: tuple[int, ...], shape_text: str, *, finite: bool = True) -> np.ndarray:
    """Validate a user's floating output (an array, its shape, a real floating dtype, finite) and return it as float64.

    `shape_text` names the expected shape in symbols, e.g. `"[m, d]"`, for the report. With `finite=False`
    non-finite entries are kept, for a check that reports them as disagreements of their own.
    """
    finite = switch_value(finite, "finite")
    if not is_array(out) and not isinstance(out, list | tuple) and not hasattr(out, "__array__"):
        raise Violation(f"{name} must be an array {shape_text}, got {type(out).__name__}")
    out = user_array(name, out)
    if out.shape != shape:
        raise Violation(f"{name} must have the shape {shape_text} = {list(shape)}, got {list(out.shape)}")
    if not is_float(out):
        raise Violation(f"{name} must be a real floating array, got dtype {out.dtype}")
    out = out.astype(np.float64)
    if finite and not np.all(np.isfinite(out)):
        raise Violation(f"{name} must be finite, got {int(np.sum(~np.isfinite(out)))} NaN or inf entries")
    return out


def route_output(out: Any, m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a router's `(index, weights)` and return them as int64 and float64 arrays."""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise Violation(f"the router must return a pair (index, weights), got {type(out).__name__}")
    index, weights = user_array("index", out[0]), user_array("weights", out[1])
    if index.shape != (m, k) or weights.shape != (m, k):
        raise Violation(f"index and weights must both have shape [m, k] = [{m}, {k}], "
                        f"got {list(index.shape)} and {list(weights.shape)}")
    if not np.issubdtype(index.dtype, np.integer):
        raise Violation(f"index must be an integer array, got dtype {index.dtype}")
    weights = float_output("weights", weights, (m, k), "[m, k]")
    if index.size and (index.min() < 0 or index.max() >= n):
        raise Violation(f"expert ids must lie in [0, {n - 1}], got values in [{index.min()}, {index.max()}]")
    return index.astype(np.int64), weights


def bias_output(out: Any, n: int) -> np.ndarray:
    """Validate an update's new bias `[n]` and return it as float64."""
    return float_output("the new bias", out, (n,), "[n]")


def count(number: int, one: str, many: str | None = None) -> str:
    return f"{number} {one if number == 1 else (many or one + 's')}"


def token_lines(rows: np.ndarray, what: Callable[[int], str], limit: int = 3) -> list[str]:
    lines = [what(int(i)) for i in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"... and {len(rows) - limit} more tokens")
    return lines
