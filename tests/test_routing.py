"""Tests of Eq. (13): router scores, biased selection, raw-score weights, loads.

Scores and biases are drawn on a dyadic grid (multiples of 2**-10, small
magnitudes), so every biased score s + b and every shifted bias b + c is
exact in float32 and float64: the invariants can then be asserted exactly,
and exact ties occur often, which exercises the lower-id rule. The expected
selection comes from Python's `sorted` with the key (-biased score, id).
"""

from __future__ import annotations

import math
from collections import Counter

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl._lib.xp import to_numpy
from refimpl.layer.routing import biased_scores, expert_load, route, router_scores, selection_cutoff

with_xp = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

GRID = 2.0**-10


@st.composite
def routing_cases(draw, max_m: int = 6, max_n: int = 9, coarse: bool | None = None):
    """(scores [m, n], bias [n], k) on a dyadic grid; `coarse` grids make ties frequent."""
    m = draw(st.integers(1, max_m))
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, n))
    seed = draw(st.integers(0, 2**32 - 1))
    coarse = draw(st.booleans()) if coarse is None else coarse
    rng = np.random.default_rng(seed)
    step = 0.25 if coarse else GRID
    # Scores strictly inside (0, 1), bias within [-1, 1]; both multiples of `step`.
    scores = rng.integers(1, round(1 / step), size=(m, n)) * step
    bias = rng.integers(-round(1 / step), round(1 / step) + 1, size=n) * step
    return scores.astype(np.float64), bias.astype(np.float64), k


def expected_route(scores: np.ndarray, bias: np.ndarray, k: int) -> np.ndarray:
    """Top-k ids of s + b per token, by value descending and then the lower id."""
    biased = scores + bias
    return np.array([sorted(range(len(row)), key=lambda j, r=row: (-r[j], j))[:k] for row in biased],
                    dtype=np.int64).reshape(len(biased), k)


def as_xp(xp, *arrays, dtype=None):
    return [xp.asarray(a) if dtype is None else xp.asarray(a, dtype=dtype) for a in arrays]


# ---------------------------------------------------------------------------
# Selection and weights
# ---------------------------------------------------------------------------

@with_xp
@given(case=routing_cases())
def test_selection_is_the_biased_top_k_with_ties_to_the_lower_id(xp, case):
    scores, bias, k = case
    index, weights = route(*as_xp(xp, scores, bias), k)
    index = to_numpy(index)
    assert index.shape == (scores.shape[0], k)
    np.testing.assert_array_equal(index, expected_route(scores, bias, k))
    # k distinct ids per token, each a valid expert.
    assert all(len(set(row)) == k for row in index.tolist())
    assert index.min() >= 0 and index.max() < scores.shape[1]


@with_xp
@given(case=routing_cases(), scale=st.floats(0.125, 8.0), renormalize=st.booleans())
def test_weights_are_raw_scores_renormalized_and_scaled(xp, case, scale, renormalize):
    scores, bias, k = case
    index, weights = route(*as_xp(xp, scores, bias), k, renormalize=renormalize, scaling_factor=scale)
    index, weights = to_numpy(index), to_numpy(weights)
    raw = np.take_along_axis(scores, index, axis=1)  # the unbiased scores of the chosen experts
    expected = raw / raw.sum(axis=1, keepdims=True) * scale if renormalize else raw * scale
    np.testing.assert_allclose(weights, expected, rtol=1e-15)
    assert np.all(weights >= 0)
    if renormalize:
        np.testing.assert_allclose(weights.sum(axis=1), scale, rtol=1e-14)


@with_xp
@given(case=routing_cases(), shift=st.integers(-4096, 4096))
def test_a_constant_added_to_the_bias_changes_nothing(xp, case, shift):
    scores, bias, k = case
    c = shift * GRID  # exact, so s + b + c keeps every order and every tie
    index, weights = route(*as_xp(xp, scores, bias), k)
    index_c, weights_c = route(*as_xp(xp, scores, bias + c), k)
    np.testing.assert_array_equal(to_numpy(index_c), to_numpy(index))
    np.testing.assert_array_equal(to_numpy(weights_c), to_numpy(weights))


@with_xp
@given(case=routing_cases(), seed=st.integers(0, 2**32 - 1))
def test_the_bias_changes_selection_but_never_the_weights_of_a_selection(xp, case, seed):
    scores, bias, k = case
    other = np.random.default_rng(seed).integers(-1024, 1025, size=bias.shape) * GRID
    index_a, weights_a = (to_numpy(a) for a in route(*as_xp(xp, scores, bias), k))
    index_b, weights_b = (to_numpy(a) for a in route(*as_xp(xp, scores, other), k))
    for i in range(scores.shape[0]):
        if set(index_a[i]) == set(index_b[i]):
            by_id_a = dict(zip(index_a[i].tolist(), weights_a[i].tolist(), strict=True))
            by_id_b = dict(zip(index_b[i].tolist(), weights_b[i].tolist(), strict=True))
            assert by_id_a == pytest.approx(by_id_b, rel=1e-15)


def test_a_large_bias_forces_an_expert_in_without_changing_its_weight(xp):
    scores = np.array([[0.9, 0.1, 0.8, 0.2], [0.7, 0.05, 0.6, 0.3]])
    bias = np.array([0.0, 5.0, 0.0, 0.0])  # expert 1 has the lowest scores but a huge bias
    index, weights = (to_numpy(a) for a in route(*as_xp(xp, scores, bias), 2))
    np.testing.assert_array_equal(index, [[1, 0], [1, 0]])
    # Its weight is still its raw score, renormalized: 0.1 / (0.1 + 0.9) and 0.05 / (0.05 + 0.7).
    np.testing.assert_allclose(weights, [[0.1, 0.9], [0.05 / 0.75, 0.7 / 0.75]], rtol=1e-15)
    # Without the bias the selection is the raw top-2.
    np.testing.assert_array_equal(to_numpy(route(*as_xp(xp, scores, np.zeros(4)), 2)[0]), [[0, 2], [0, 2]])


@with_xp
@given(case=routing_cases(), seed=st.integers(0, 2**32 - 1))
def test_permuting_tokens_permutes_the_outputs(xp, case, seed):
    scores, bias, k = case
    perm = np.random.default_rng(seed).permutation(scores.shape[0])
    index, weights = (to_numpy(a) for a in route(*as_xp(xp, scores, bias), k))
    index_p, weights_p = (to_numpy(a) for a in route(*as_xp(xp, scores[perm], bias), k))
    np.testing.assert_array_equal(index_p, index[perm])
    np.testing.assert_array_equal(weights_p, weights[perm])


@with_xp
@given(case=routing_cases(coarse=False), seed=st.integers(0, 2**32 - 1))
def test_permuting_experts_relabels_the_selection(xp, case, seed):
    scores, bias, k = case
    biased = scores + bias
    # Relabelling changes which of two tied experts counts as "lower": only compare tie-free rows.
    kth = np.sort(biased, axis=1)[:, ::-1]
    tie_free = np.array([k == len(row) or row[k - 1] != row[k] for row in kth])
    pi = np.random.default_rng(seed).permutation(scores.shape[1])  # new expert j is old expert pi[j]
    index, weights = (to_numpy(a) for a in route(*as_xp(xp, scores, bias), k))
    index_p, weights_p = (to_numpy(a) for a in route(*as_xp(xp, scores[:, pi], bias[pi]), k))
    for i in np.flatnonzero(tie_free):
        old = dict(zip(index[i].tolist(), weights[i].tolist(), strict=True))
        new = dict(zip(pi[index_p[i]].tolist(), weights_p[i].tolist(), strict=True))
        assert new == pytest.approx(old, rel=1e-15)


def test_exact_ties_go_to_the_lower_id(xp):
    scores = np.array([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
                       [0.25, 0.75, 0.75, 0.75, 0.125, 0.75],
                       [0.5, 0.25, 0.5, 0.75, 0.5, 0.5]])
    bias = np.zeros(6)
    index, _ = route(*as_xp(xp, scores, bias), 3)
    np.testing.assert_array_equal(to_numpy(index), [[0, 1, 2], [1, 2, 3], [3, 0, 2]])
    # A tie created by the bias (0.25 + 0.5 == 0.75 + 0.0) also goes to the lower id.
    scores = np.array([[0.75, 0.25, 0.5]])
    bias = np.array([0.0, 0.5, 0.0])
    index, weights = route(*as_xp(xp, scores, bias), 1)
    assert to_numpy(index).tolist() == [[0]]
    index, _ = route(*as_xp(xp, scores[:, ::-1].copy(), bias[::-1].copy()), 1)
    assert to_numpy(index).tolist() == [[1]]  # the same tie, relabelled: again the lower id wins


def test_float32_scores_route_in_float32(xp):
    scores = np.random.default_rng(0).random((4, 6)).astype(np.float32)
    index, weights = route(*as_xp(xp, scores, np.zeros(6, dtype=np.float32)), 2)
    assert weights.dtype == xp.float32
    index64, weights64 = route(*as_xp(xp, scores, np.zeros(6)), 2)  # a float64 bias widens the arithmetic
    assert weights64.dtype == xp.float64
    np.testing.assert_array_equal(to_numpy(index), to_numpy(index64))


def test_half_precision_bias_is_rejected():
    scores = np.full((2, 4), 0.5, dtype=np.float32)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        with pytest.raises(TypeError, match=r"bias must be float32 or float64, got .*16"):
            route(scores, np.zeros(4, dtype=dtype), 2)


def test_bfloat16_bias_far_from_zero_would_collapse_distinct_values():
    # The failure the TypeError prevents: 64 distinct biases near 10 round to a handful in bfloat16.
    bias = 10.0 + np.arange(64) * 1e-3
    assert len(set(bias.astype(ml_dtypes.bfloat16).astype(np.float64).tolist())) < 8
    centred = bias - bias.mean()
    assert len(set(centred.astype(ml_dtypes.bfloat16).astype(np.float64).tolist())) > 48


# ---------------------------------------------------------------------------
# Group-limited selection
# ---------------------------------------------------------------------------

def expected_group_route(scores, bias, k, n_group, topk_group):
    """DeepSeek-V3 group-limited top-k by hand: group score = sum of its two best biased scores."""
    biased = scores + bias
    m, n = biased.shape
    size = n // n_group
    out = []
    for row in biased:
        group_score = [sum(sorted(row[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        allowed = [j for j in range(n) if j // size in groups]
        out.append(sorted(allowed, key=lambda j: (-row[j], j))[:k])
    return np.array(out, dtype=np.int64)


@st.composite
def group_cases(draw):
    n_group = draw(st.integers(1, 4))
    size = draw(st.integers(1, 3))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, topk_group * size))
    m = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    step = draw(st.sampled_from([0.25, GRID]))
    scores = rng.integers(1, round(1 / step), size=(m, n_group * size)) * step
    bias = rng.integers(-round(1 / step), round(1 / step) + 1, size=n_group * size) * step
    return scores, bias, k, n_group, topk_group


@with_xp
@given(case=group_cases())
def test_group_limited_selection(xp, case):
    scores, bias, k, n_group, topk_group = case
    index, weights = route(*as_xp(xp, scores, bias), k, n_group=n_group, topk_group=topk_group)
    index = to_numpy(index)
    np.testing.assert_array_equal(index, expected_group_route(scores, bias, k, n_group, topk_group))
    raw = np.take_along_axis(scores, index, axis=1)
    np.testing.assert_allclose(to_numpy(weights), raw / raw.sum(axis=1, keepdims=True), rtol=1e-15)


def test_one_group_is_plain_routing(xp):
    scores = np.random.default_rng(1).random((5, 6))
    a = route(*as_xp(xp, scores, np.zeros(6)), 3)
    b = route(*as_xp(xp, scores, np.zeros(6)), 3, n_group=1, topk_group=1)
    np.testing.assert_array_equal(to_numpy(a[0]), to_numpy(b[0]))


def test_top_k_beyond_the_reachable_groups_is_rejected(xp):
    # Three groups of two, one group kept: only 2 experts are reachable, so k = 3 used to pick
    # a masked-out expert with a -inf score and give it a raw-score weight.
    scores = np.random.default_rng(0).random((3, 6))
    with pytest.raises(ValueError, match=r"top_k must be <= topk_group \* n / n_group = 1 \* 2 = 2 .*got top_k=3"):
        route(*as_xp(xp, scores, np.zeros(6)), 3, n_group=3, topk_group=1)


# ---------------------------------------------------------------------------
# Router scores, cutoff, loads
# ---------------------------------------------------------------------------

@with_xp
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 5), n=st.integers(1, 6), d=st.integers(1, 6))
def test_router_scores_are_sigmoids_of_the_logits(xp, seed, m, n, d):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)) * 3
    w = rng.standard_normal((n, d))
    s = to_numpy(router_scores(*as_xp(xp, x, w)))
    expected = [[1.0 / (1.0 + math.exp(-sum(x[i, c] * w[j, c] for c in range(d)))) for j in range(n)]
                for i in range(m)]
    np.testing.assert_allclose(s, np.array(expected).reshape(m, n), rtol=1e-13)
    assert np.all((s > 0) & (s < 1))


def test_router_scores_precision():
    x = np.ones((2, 3), dtype=np.float16)
    w = np.ones((4, 3), dtype=np.float16)
    assert router_scores(x, w).dtype == np.float32  # half precision in, float32 scores
    assert router_scores(x.astype(np.float64), w.astype(np.float32)).dtype == np.float64
    # Very negative logits keep their relative precision (no 0/0 in the weights).
    s = router_scores(np.array([[-50.0]]), np.ones((3, 1)))
    np.testing.assert_allclose(s, math.exp(-50) / (1 + math.exp(-50)), rtol=1e-15)
    _, weights = route(s, np.zeros(3), 2)
    np.testing.assert_allclose(weights, 0.5, rtol=1e-15)


@with_xp
@given(case=routing_cases())
def test_selection_cutoff(xp, case):
    scores, bias, k = case
    n = scores.shape[1]
    if k >= n:
        with pytest.raises(ValueError, match=rf"top_k must be < n={n} .*got top_k={k}"):
            selection_cutoff(*as_xp(xp, scores, bias), k)
        return
    index, alpha = (to_numpy(a) for a in selection_cutoff(*as_xp(xp, scores, bias), k))
    np.testing.assert_array_equal(index, expected_route(scores, bias, k))
    # alpha_i is the (k+1)-th largest biased score.
    np.testing.assert_array_equal(alpha, np.sort(scores + bias, axis=1)[:, ::-1][:, k])


@with_xp
@given(case=routing_cases())
def test_expert_load_counts_each_id(xp, case):
    scores, bias, k = case
    n = scores.shape[1]
    index, _ = route(*as_xp(xp, scores, bias), k)
    load = to_numpy(expert_load(index, n))
    counter = Counter(to_numpy(index).ravel().tolist())
    assert load.tolist() == [counter[j] for j in range(n)]
    assert load.sum() == scores.shape[0] * k


def test_biased_scores(xp):
    s = np.array([[0.25, 0.5]])
    b = np.array([0.5, -0.25])
    np.testing.assert_array_equal(to_numpy(biased_scores(*as_xp(xp, s, b))), [[0.75, 0.25]])


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

def test_bad_input(xp):
    s = xp.asarray(np.full((3, 4), 0.5))
    b = xp.asarray(np.zeros(4))
    with pytest.raises(ValueError, match=r"scores must have 2 dimensions, got shape \(4,\)"):
        route(b, b, 1)
    with pytest.raises(ValueError, match=r"bias must have 1 dimensions, got shape \(3, 4\)"):
        route(s, s, 1)
    with pytest.raises(ValueError, match=r"bias must have shape \[4\] to match scores \[3, 4\], got \[5\]"):
        route(s, xp.asarray(np.zeros(5)), 1)
    with pytest.raises(ValueError, match=r"top_k must be <= 4, got 5"):
        route(s, b, 5)
    with pytest.raises(ValueError, match=r"top_k must be >= 1, got 0"):
        route(s, b, 0)
    with pytest.raises(TypeError, match=r"top_k must be an integer, got float 2.0"):
        route(s, b, 2.0)
    with pytest.raises(ValueError, match=r"bias must be finite, got 1 non-finite entries"):
        route(s, xp.asarray([0.0, np.nan, 0.0, 0.0]), 1)
    with pytest.raises(ValueError, match=r"bias must be finite, got 2 non-finite entries"):
        route(s, xp.asarray([0.0, np.inf, -np.inf, 0.0]), 1)
    with pytest.raises(ValueError, match=r"scores must be finite, got 1 non-finite entries"):
        route(xp.asarray([[0.5, np.nan, 0.5, 0.5]]), b, 1)
    with pytest.raises(TypeError, match=r"scores must be a real floating array .*got dtype .*int"):
        route(xp.asarray([[1, 0, 1, 0]]), b, 1)
    with pytest.raises(ValueError, match=r"scaling_factor must be positive and finite, got 0.0"):
        route(s, b, 1, scaling_factor=0.0)
    with pytest.raises(ValueError, match=r"n_group must divide the number of experts 4, got 3"):
        route(s, b, 1, n_group=3)
    with pytest.raises(ValueError, match=r"topk_group must be <= 2, got 3"):
        route(s, b, 1, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match=r"router_weight must have shape \[n, 4\] to match x of width 4, got \[2, 3\]"):
        router_scores(s, xp.asarray(np.ones((2, 3))))
    with pytest.raises(TypeError, match=r"x must be a real floating array"):
        router_scores(xp.asarray([[1, 2]]), xp.asarray(np.ones((2, 2))))
    with pytest.raises(ValueError, match=r"index must hold expert ids in \[0, 3\], got values in \[0, 4\]"):
        expert_load(xp.asarray([[0, 4]]), 4)
    with pytest.raises(TypeError, match=r"index must be an integer array, got dtype .*float"):
        expert_load(s, 4)
    with pytest.raises(TypeError, match=r"index must be an integer array of expert ids, got list"):
        expert_load([0, 1], 4)
