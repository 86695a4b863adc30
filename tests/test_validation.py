"""Tests of the shared input checks: each names the argument, the expectation and the actual value."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from refimpl._lib.validation import check_finite, check_float_array, check_int, check_positive, check_shape


def test_check_float_array(xp):
    check_float_array("x", xp.asarray([1.0]), ndim=1)
    check_float_array("x", np.zeros((2, 2), dtype=ml_dtypes.bfloat16), ndim=2)
    with pytest.raises(TypeError, match=r"x must be an array, got tuple"):
        check_float_array("x", (1.0,))
    with pytest.raises(TypeError, match=r"w must be a real floating array \(float16/32/64 or bfloat16\), got dtype"):
        check_float_array("w", xp.asarray([1, 2]))
    with pytest.raises(ValueError, match=r"x must have 2 dimensions, got shape \(3,\)"):
        check_float_array("x", xp.asarray([1.0, 2.0, 3.0]), ndim=2)


def test_check_shape(xp):
    a = xp.asarray(np.zeros((2, 3)))
    check_shape("a", a, (2, 3))
    check_shape("a", a, (None, 3))
    with pytest.raises(ValueError, match=r"a must have shape \[\*, 4\], got \[2, 3\]"):
        check_shape("a", a, (None, 4))
    with pytest.raises(ValueError, match=r"a must have shape \[2, 3, 1\], got \[2, 3\]"):
        check_shape("a", a, (2, 3, 1))


def test_check_finite(xp):
    check_finite("x", xp.asarray([0.0, -1e308]))
    with pytest.raises(ValueError, match=r"x must be finite, got 3 non-finite entries \(NaN or inf\)"):
        check_finite("x", xp.asarray([np.nan, np.inf, -np.inf, 1.0]))
    with pytest.raises(ValueError, match=r"h must be finite, got 1 non-finite"):
        check_finite("h", np.array([1.0, np.nan], dtype=ml_dtypes.bfloat16))


def test_check_int():
    assert check_int("k", np.int64(3), low=1, high=5) == 3
    with pytest.raises(TypeError, match=r"k must be an integer, got bool True"):
        check_int("k", True)
    with pytest.raises(TypeError, match=r"k must be an integer, got float 2.0"):
        check_int("k", 2.0)
    with pytest.raises(ValueError, match=r"k must be >= 1, got 0"):
        check_int("k", 0, low=1)
    with pytest.raises(ValueError, match=r"k must be <= 5, got 6"):
        check_int("k", 6, high=5)


def test_check_positive():
    assert check_positive("beta", 4) == 4.0
    with pytest.raises(TypeError, match=r"beta must be a real number, got str '4'"):
        check_positive("beta", "4")
    with pytest.raises(TypeError, match=r"beta must be a real number, got bool True"):
        check_positive("beta", True)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"beta must be positive and finite"):
            check_positive("beta", bad)
