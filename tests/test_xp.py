"""Tests of the array-namespace helpers: top-k with its tie rule, bincount, dtype helpers.

The reference for top-k is Python's own `sorted` with the key (-value, index):
descending by value, lower index first among equals. Both paths of `topk`
(the NumPy partition fast path and the portable stable-argsort path) must
reproduce it exactly, ties included.
"""

from __future__ import annotations

from collections import Counter

import array_api_strict
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl._lib import fast as _fast
from refimpl._lib.xp import (
    array_namespace,
    bincount,
    compute_dtype,
    dtype_name,
    is_cupy,
    is_numpy,
    is_real_floating,
    to_numpy,
    topk,
)

# Hypothesis with the function-scoped `xp` fixture: the fixture returns a module, so no state leaks.
with_xp = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def reference_topk(rows: np.ndarray, k: int) -> np.ndarray:
    """Top-k ids of each row by Python's sort: value descending, then lower index first."""
    flat = rows.reshape(-1, rows.shape[-1])
    ids = [sorted(range(flat.shape[1]), key=lambda j, r=r: (-r[j], j))[:k] for r in flat]
    return np.array(ids, dtype=np.int64).reshape(*rows.shape[:-1], k)


@st.composite
def tied_rows(draw, max_rows: int = 6, max_n: int = 9, strict_k: bool = False):
    """A matrix with few distinct values (so ties everywhere) and a k in [0, n].

    With `strict_k`, n >= 2 and 0 < k < n: the range where the NumPy fast path is used.
    """
    m = draw(st.integers(1, max_rows))
    n = draw(st.integers(2 if strict_k else 1, max_n))
    levels = draw(st.integers(1, 4))  # 1 level: every entry equal
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.integers(0, levels, size=(m, n)).astype(np.float64) / 4 - 0.5
    k = draw(st.integers(1, n - 1) if strict_k else st.integers(0, n))
    return x, k


# ---------------------------------------------------------------------------
# topk
# ---------------------------------------------------------------------------

@with_xp
@given(data=tied_rows())
def test_topk_matches_sorted_reference_with_heavy_ties(xp, data):
    x, k = data
    values, index = topk(xp.asarray(x), k)
    expected = reference_topk(x, k)
    np.testing.assert_array_equal(to_numpy(index), expected)
    np.testing.assert_array_equal(to_numpy(values), np.take_along_axis(x, expected, axis=-1))


@given(data=tied_rows(strict_k=True))
def test_numpy_fast_path_equals_portable_path_and_stable_argsort(data):
    x, k = data
    fast_values, fast_index = _fast.topk_by_partition(x, k)
    strict_values, strict_index = topk(array_api_strict.asarray(x), k)
    # A third, independent reference: NumPy's stable argsort of the negated row.
    stable = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(fast_index, to_numpy(strict_index))
    np.testing.assert_array_equal(fast_index, stable)
    np.testing.assert_array_equal(fast_values, to_numpy(strict_values))
    np.testing.assert_array_equal(fast_index, reference_topk(x, k))


@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 7))
def test_numpy_fast_path_on_distinct_values(seed, k):
    x = np.random.default_rng(seed).standard_normal((5, 8))
    values, index = _fast.topk_by_partition(x, k)
    np.testing.assert_array_equal(index, reference_topk(x, k))
    # Sorted descending.
    assert np.all(np.diff(values, axis=-1) <= 0)


def test_topk_ties_go_to_the_lower_index(xp):
    x = xp.asarray([[0.3, 0.7, 0.7, 0.7, 0.1],
                    [1.0, 1.0, 1.0, 1.0, 1.0],
                    [0.0, -0.0, 0.0, 2.0, 0.0]])
    _, index = topk(x, 2)
    np.testing.assert_array_equal(to_numpy(index), [[1, 2], [0, 1], [3, 0]])


def test_topk_ambiguous_rows_mixed_with_clean_rows():
    # Row 0 has a tie at the k-th value (a partition may pick either), row 1 does not.
    x = np.array([[5.0, 1.0, 3.0, 3.0, 3.0, 0.0],
                  [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    _, index = _fast.topk_by_partition(x, 3)
    np.testing.assert_array_equal(index, [[0, 2, 3], [0, 1, 2]])


def test_topk_on_three_dimensional_input(xp):
    x = np.random.default_rng(3).integers(0, 3, size=(2, 3, 5)).astype(np.float64)
    _, index = topk(xp.asarray(x), 2)
    assert tuple(index.shape) == (2, 3, 2)
    np.testing.assert_array_equal(to_numpy(index), reference_topk(x, 2))


def test_topk_with_minus_infinity_entries(xp):
    x = xp.asarray([[-np.inf, 0.5, -np.inf, 0.2], [-np.inf, -np.inf, -np.inf, -np.inf]])
    _, index = topk(x, 2)
    np.testing.assert_array_equal(to_numpy(index), [[1, 3], [0, 1]])


def test_topk_edge_k(xp):
    x = xp.asarray([[2.0, 1.0, 3.0]])
    values, index = topk(x, 0)
    assert tuple(index.shape) == (1, 0) and tuple(values.shape) == (1, 0)
    _, index = topk(x, 3)
    np.testing.assert_array_equal(to_numpy(index), [[2, 0, 1]])


def test_topk_rejects_bad_k(xp):
    x = xp.asarray([[2.0, 1.0, 3.0]])
    with pytest.raises(ValueError, match=r"k must be in \[0, 3\].*got k=4"):
        topk(x, 4)
    with pytest.raises(ValueError, match=r"got k=-1"):
        topk(x, -1)
    with pytest.raises(TypeError, match=r"k must be an integer, got float 2.0"):
        topk(x, 2.0)


def test_topk_empty_batch():
    values, index = topk(np.zeros((0, 5)), 2)
    assert index.shape == (0, 2) and values.shape == (0, 2)


# ---------------------------------------------------------------------------
# bincount
# ---------------------------------------------------------------------------

@with_xp
@given(ids=st.lists(st.integers(0, 6), max_size=30), n=st.integers(7, 9))
def test_bincount_matches_counter(xp, ids, n):
    counts = bincount(xp.asarray(np.array(ids, dtype=np.int64)), n)
    expected = Counter(ids)
    assert tuple(counts.shape) == (n,)
    assert to_numpy(counts).tolist() == [expected[j] for j in range(n)]


def test_bincount_any_shape_and_ignores_ids_past_n(xp):
    ids = xp.asarray([[0, 2], [2, 5]])
    assert to_numpy(bincount(ids, 3)).tolist() == [1, 0, 2]


def test_bincount_rejects_negative_ids_on_every_path(xp):
    with pytest.raises(ValueError, match="index must hold non-negative integers, got a minimum of -1"):
        bincount(xp.asarray([0, -1, 2]), 3)


# ---------------------------------------------------------------------------
# dtype helpers
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,expected", [
    (np.float16, True), (np.float32, True), (np.float64, True), (ml_dtypes.bfloat16, True),
    (np.int32, False), (np.int64, False), (np.bool_, False), (np.complex128, False),
])
def test_is_real_floating(dtype, expected):
    assert is_real_floating(np.zeros(2, dtype=dtype)) is expected


def test_is_real_floating_on_strict_arrays():
    assert is_real_floating(array_api_strict.asarray([1.0]))
    assert not is_real_floating(array_api_strict.asarray([1]))


def test_dtype_name_and_compute_dtype():
    xp = array_namespace(np.zeros(1))
    assert dtype_name(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"
    assert dtype_name(array_api_strict.float32) == "float32"
    assert compute_dtype(xp, np.zeros(1, np.float16)) == xp.float32
    assert compute_dtype(xp, np.zeros(1, ml_dtypes.bfloat16), np.zeros(1, np.float32)) == xp.float32
    assert compute_dtype(xp, np.zeros(1, np.float32), np.zeros(1, np.float64)) == xp.float64


def test_namespace_predicates_and_to_numpy(xp):
    a = xp.asarray([1.0, 2.0])
    ns = array_namespace(a)
    assert is_numpy(ns) == (xp is np)
    assert not is_cupy(ns) or xp.__name__ == "cupy"
    out = to_numpy(a)
    assert isinstance(out, np.ndarray) and out.tolist() == [1.0, 2.0]


def test_no_backend_but_numpy_converts_implicitly_and_to_numpy_still_works(xp):
    """The test backends keep CuPy's rule: `np.asarray` on a non-NumPy array raises, so nothing in the
    tests or the library may lean on it; `to_numpy` is the explicit way to the host."""
    x = xp.asarray([1.0, 2.0, 3.0])
    if xp is not np:
        with pytest.raises(TypeError):
            np.asarray(x)
    out = to_numpy(x)
    assert isinstance(out, np.ndarray) and out.tolist() == [1.0, 2.0, 3.0]
    assert to_numpy(xp.asarray(5.0)).shape == ()
