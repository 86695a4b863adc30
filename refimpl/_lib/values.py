"""Checked values: sizes, factors, switches, seeds, and how an error shows them.

`MoEConfig` and the readers of Hugging Face configurations (K3's keys and the
other families') check every value the same way, with these; every public
function that takes a switch (`renormalize`, `return_intermediates`,
`leave_one_out`, `overwrite`, ...) or a seed checks it with `switch_value`,
`seed_value` or `generator_value`, so that no switch is read as truthy and
no seed is rounded, anywhere.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

#: The positive numbers float32, the layer's compute dtype, holds: its smallest subnormal and its largest value.
FLOAT32_RANGE: tuple[float, float] = (float(np.finfo(np.float32).smallest_subnormal), float(np.finfo(np.float32).max))


def is_integer(value: Any) -> bool:
    """An integer of any integral type (int, np.int64, ...), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def is_real(value: Any) -> bool:
    """A real number of any type (int, float, np.float32, Fraction, ...), but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def shown(value: Any, width: int = 60) -> str:
    """`repr(value)`, cut to `width` characters for an error message."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def same_json_value(a: Any, b: Any) -> bool:
    """Equal values of the same JSON kind (true is not 1): two spellings of one key agree only if this holds."""
    return isinstance(a, bool | np.bool_) == isinstance(b, bool | np.bool_) and a == b


def integer_value(value: Any, label: str, *, low: int) -> int:
    """`value` as a Python int if it is an integer >= `low`; else a `ValueError` naming `label`."""
    if not is_integer(value) or value < low:
        what = "a positive integer" if low == 1 else "a non-negative integer" if low == 0 else f"an integer >= {low}"
        raise ValueError(f"{label} must be {what}, got {value!r}")
    return int(value)


def factor_value(value: Any, label: str, *, allowed: str = "") -> float:
    """`value` as a Python float if it is a positive real that float32 holds; else a `ValueError` naming `label`.

    The layer computes in float32, so a factor float32 rounds to zero or to
    infinity (1e308 as `routed_scaling_factor`) would make every output
    non-finite; it is refused with the bound. `allowed` names the other values
    the field takes (" or None").
    """
    try:
        # A NumPy float32 or float16 is read as the decimal it prints as (np.float32(1.1) is 1.1, not
        # 1.100000023841858), which is what the user typed and what a capacity factor is computed from.
        number = (float(str(value)) if isinstance(value, np.floating) else float(value)) if is_real(value) else math.nan
    except OverflowError:  # an int beyond float64
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{label} must be a positive finite number{allowed}, got {value!r}")
    with np.errstate(over="ignore"):
        in_float32 = np.float32(number)
    if not 0 < in_float32 < np.inf:
        low, high = FLOAT32_RANGE
        raise ValueError(f"{label} must be a number float32 (the layer's compute dtype) holds: between {low:.4g} "
                         f"and {high:.8g}, got {value!r}")
    return number


def switch_value(value: Any, label: str) -> bool:
    """`value` as a Python bool if it is a real boolean (bool or np.bool_); else a `TypeError` naming `label`.

    A switch is never read as truthy: the string "false" (from a JSON file, a command line or a form) is a
    non-empty string, and 0, 1 or None are not answers to a yes-or-no question.
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{label} must be True or False, got {type(value).__name__} {shown(value)}")
    return bool(value)


def seed_value(value: Any, label: str = "seed", *, high: int = 2**63) -> int:
    """`value` as a Python int if it is an integer seed in [0, `high`); else an error naming `label`.

    A `TypeError` for what is not an integer (1.5 is not rounded to 1, True is not 1, "7" is not parsed); a
    `ValueError` for an integer out of range.
    """
    if not is_integer(value):
        raise TypeError(f"{label} must be an integer, got {type(value).__name__} {shown(value)}")
    if not 0 <= value < high:
        raise ValueError(f"{label} must be an integer in [0, {high}), got {value}")
    return int(value)


def generator_value(rng: Any, label: str = "rng") -> np.random.Generator:
    """A NumPy `Generator` from `rng`: a `Generator` itself, a `BitGenerator` or `SeedSequence`, an integer seed
    (`seed_value`), or None (fresh entropy). A float, a bool or a string is refused, never rounded or hashed."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, np.random.BitGenerator | np.random.SeedSequence):
        return np.random.default_rng(rng)
    if not is_integer(rng):
        raise TypeError(f"{label} must be a numpy.random.Generator (or BitGenerator, SeedSequence), an integer "
                        f"seed or None, got {type(rng).__name__} {shown(rng)}")
    return np.random.default_rng(seed_value(rng, label))
