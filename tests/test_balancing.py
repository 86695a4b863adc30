"""Eq. (14): the exact Quantile Balancing update, the sign rule and the balancers.

References are independent: full sorts instead of partitions, Python loops
over experts, routing with `refimpl.layer.routing.route` to count what a bias does.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from conftest import load_example
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from refimpl._lib.xp import to_numpy
from refimpl.balancing import (
    Balancer,
    QuantileBalancer,
    SignBalancer,
    cutoff_values,
    cutoffs,
    interpolated_kth_largest,
    kth_largest,
    load_ratio,
    margins,
    quantile_balancing_update,
    sign_balancing_update,
    target_load,
)
from refimpl.layer.routing import expert_load, route, selection_cutoff

# ---------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------


def reference_margins(s: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """M = s - alpha with alpha the (k+1)-th largest of s + b, by a full sort of each row."""
    n = s.shape[1]
    alpha = np.sort(s + b, axis=1)[:, n - k - 1]
    return s - alpha[:, None]


def reference_leave_one_out_margins(s: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """s_ij minus the k-th largest biased score among the other experts, by deleting column j and sorting."""
    m, n = s.shape
    out = np.empty((m, n))
    for j in range(n):
        others = np.delete(s + b, j, axis=1)
        out[:, j] = s[:, j] - np.sort(others, axis=1)[:, n - 1 - k]
    return out


def reference_threshold(margins: np.ndarray, k: int) -> np.ndarray:
    """-M_(q+1),j for each column, q = mk/n: a full sort, with the interpolation rule written out."""
    m, n = margins.shape
    desc = -np.sort(-margins, axis=0)  # each column descending; row r is the (r+1)-th largest
    q = m * k / n
    lo = math.floor(q)
    w = q - lo
    threshold = desc[lo] if w == 0 else (1 - w) * desc[lo] + w * desc[lo + 1]
    return -threshold


def reference_update(s: np.ndarray, b: np.ndarray, k: int, center: bool = True) -> np.ndarray:
    """Eq. (14) by sorting every margin column."""
    b_tilde = reference_threshold(reference_margins(s, b, k), k)
    return b_tilde - b_tilde.mean() if center else b_tilde


def reference_leave_one_out_update(s: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """The leave-one-out extension's threshold (uncentred), from the margins made by deleting columns."""
    return reference_threshold(reference_leave_one_out_margins(s, b, k), k)


@st.composite
def batches(draw, max_m=40, max_n=9):
    """(scores [m, n] float64 in (0, 1), bias [n], k) with enough tokens for Eq. (14)."""
    n = draw(st.integers(2, max_n))
    k = draw(st.integers(1, n - 1))
    m_min = math.ceil(n / (n - k)) + 1
    m = draw(st.integers(m_min, max(m_min, max_m)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scores = 1.0 / (1.0 + np.exp(-rng.normal(size=(m, n)) - rng.normal(size=n)))
    bias = rng.normal(scale=draw(st.sampled_from([0.0, 0.05, 0.5])), size=n)
    return scores, bias, k


@st.composite
def integer_q_batches(draw, max_n=9, max_multiple=5):
    """Like `batches`, with m a multiple of n/gcd(n, k) so that q = mk/n is an integer, and a non-zero bias."""
    n = draw(st.integers(2, max_n))
    k = draw(st.integers(1, n - 1))
    step = n // math.gcd(n, k)
    m = step * draw(st.integers(max(1, math.ceil((n / (n - k) + 1) / step)), max_multiple))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scores = 1.0 / (1.0 + np.exp(-rng.normal(size=(m, n)) - rng.normal(size=n)))
    return scores, rng.normal(scale=0.3, size=n), k


# ---------------------------------------------------------------------------
# The exact update against the sort-based reference
# ---------------------------------------------------------------------------


@given(batches())
def test_update_equals_sort_reference(batch):
    s, b, k = batch
    np.testing.assert_allclose(quantile_balancing_update(s, b, k), reference_update(s, b, k), rtol=0, atol=1e-15)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # xp is a module constant
@given(batches(max_m=30, max_n=6))
def test_update_on_every_backend(xp, batch):
    s, b, k = batch
    out = to_numpy(quantile_balancing_update(xp.asarray(s), xp.asarray(b), k))
    np.testing.assert_allclose(out, reference_update(s, b, k), rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_update_across_blocks_equals_sort_reference(dtype):
    # Large enough for several blocks of tokens and of experts, and for the sampled selection.
    rng = np.random.default_rng(21)
    m, n, k = 9000, 130, 3
    s = (1.0 / (1.0 + np.exp(-rng.normal(size=(m, n)) - rng.normal(size=n)))).astype(dtype)
    b = (0.1 * rng.normal(size=n)).astype(dtype)
    expected = reference_update(s.astype(np.float64), b.astype(np.float64), k)
    tolerance = 1e-6 if dtype == np.float32 else 1e-15
    np.testing.assert_allclose(quantile_balancing_update(s, b, k), expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_float32_update_on_every_backend(xp, leave_one_out):
    """In float32, on a batch large enough for the selection paths of NumPy and CuPy, every backend
    agrees with the float64 sort reference to float32 rounding (the extension's variant too)."""
    rng = np.random.default_rng(23)
    m, n, k = 3000, 40, 3
    s = (1.0 / (1.0 + np.exp(-rng.normal(size=(m, n)) - rng.normal(size=n)))).astype(np.float32)
    b = (0.1 * rng.normal(size=n)).astype(np.float32)
    s64, b64 = s.astype(np.float64), b.astype(np.float64)
    if leave_one_out:
        expected = reference_leave_one_out_update(s64, b64, k)
    else:
        expected = reference_update(s64, b64, k, center=False)
    out = quantile_balancing_update(xp.asarray(s), xp.asarray(b), k, center=False, leave_one_out=leave_one_out)
    assert str(out.dtype).endswith("float32")
    np.testing.assert_allclose(to_numpy(out), expected, rtol=0, atol=2e-7)


def test_leave_one_out_across_blocks_equals_reference():
    rng = np.random.default_rng(22)
    m, n, k = 4500, 70, 2
    s = 1.0 / (1.0 + np.exp(-rng.normal(size=(m, n))))
    b = 0.1 * rng.normal(size=n)
    np.testing.assert_allclose(quantile_balancing_update(s, b, k, center=False, leave_one_out=True),
                               reference_leave_one_out_update(s, b, k), rtol=0, atol=1e-15)


@given(batches())
def test_new_bias_has_zero_mean(batch):
    s, b, k = batch
    assert abs(float(np.mean(quantile_balancing_update(s, b, k)))) < 1e-14


@given(batches(), st.floats(-3.0, 3.0))
def test_constant_added_to_bias_changes_nothing(batch, c):
    s, b, k = batch
    # Order statistics move by at most the rounding of the shifted values.
    np.testing.assert_allclose(quantile_balancing_update(s, b + c, k), quantile_balancing_update(s, b, k),
                               rtol=0, atol=1e-12)


@given(batches(), st.data())
def test_constant_added_to_one_token_changes_nothing(batch, data):
    s, b, k = batch
    i = data.draw(st.integers(0, s.shape[0] - 1))
    c = data.draw(st.floats(-2.0, 2.0))
    shifted = s.copy()
    shifted[i] += c
    np.testing.assert_allclose(quantile_balancing_update(shifted, b, k), quantile_balancing_update(s, b, k),
                               rtol=0, atol=1e-12)


@given(batches(), st.randoms(use_true_random=False))
def test_permuting_tokens_changes_nothing(batch, rnd):
    s, b, k = batch
    order = list(range(s.shape[0]))
    rnd.shuffle(order)
    np.testing.assert_array_equal(quantile_balancing_update(s[order], b, k), quantile_balancing_update(s, b, k))


@given(batches(), st.randoms(use_true_random=False))
def test_permuting_experts_permutes_the_bias(batch, rnd):
    s, b, k = batch
    perm = list(range(s.shape[1]))
    rnd.shuffle(perm)
    np.testing.assert_allclose(quantile_balancing_update(s[:, perm], b[perm], k),
                               quantile_balancing_update(s, b, k)[perm], rtol=0, atol=1e-15)


@given(integer_q_batches())
def test_exactly_q_tokens_clear_the_new_threshold_with_cutoffs_held(batch):
    s, b, k = batch
    m, n = s.shape
    q = m * k // n
    M = reference_margins(s, b, k)
    desc = -np.sort(-M, axis=0)
    assume(np.all(desc[q - 1] > desc[q]))  # no tie at the boundary of the q-th and (q+1)-th margin
    b_tilde = quantile_balancing_update(s, b, k, center=False)
    # Token i would take expert j iff s_ij + b~_j > alpha_i, i.e. M_ij > -b~_j.
    np.testing.assert_array_equal((M > -b_tilde[None, :]).sum(axis=0), np.full(n, q))


def test_fractional_target_interpolates_by_hand():
    # n = 3, k = 1, m = 5: q = 5/3, so the threshold is 1/3 of the way from the 2nd to the 3rd largest margin.
    s = np.array([[0.9, 0.1, 0.2],
                  [0.8, 0.3, 0.1],
                  [0.7, 0.2, 0.6],
                  [0.6, 0.5, 0.4],
                  [0.2, 0.1, 0.3]])
    b = np.zeros(3)
    # alpha_i = second largest of each row: 0.2, 0.3, 0.6, 0.5, 0.2
    # margins, expert 0: 0.7, 0.5, 0.1, 0.1, 0.0 -> 2nd 0.5, 3rd 0.1 -> 0.5 + (2/3)(0.1 - 0.5)
    # expert 1: -0.1, 0.0, -0.4, 0.0, -0.1 -> 2nd 0.0, 3rd -0.1 -> 0.0 + (2/3)(-0.1)
    # expert 2: 0.0, -0.2, 0.0, -0.1, 0.1 -> 2nd 0.0, 3rd 0.0 -> 0.0
    expected_threshold = np.array([0.5 - (2 / 3) * 0.4, -(2 / 3) * 0.1, 0.0])
    got = quantile_balancing_update(s, b, 1, center=False)
    np.testing.assert_allclose(got, -expected_threshold, atol=1e-15)
    np.testing.assert_allclose(quantile_balancing_update(s, b, 1), -expected_threshold + expected_threshold.mean(),
                               atol=1e-15)


def test_target_load():
    assert target_load(4096, 896, 16) == pytest.approx(73.142857, rel=1e-6)
    assert target_load(64, 8, 2) == 16


# ---------------------------------------------------------------------------
# Edge cases and bad input
# ---------------------------------------------------------------------------


def test_k_equal_n_returns_the_centered_bias():
    rng = np.random.default_rng(0)
    s = rng.random((10, 4))
    b = np.array([1.0, 2.0, 3.0, 6.0])
    np.testing.assert_allclose(quantile_balancing_update(s, b, 4), b - 3.0)


def test_too_few_tokens_is_a_clear_error():
    s = np.random.default_rng(0).random((3, 4))
    # n = 4, k = 3: q = 2.25 needs the 4th largest margin of 3 tokens.
    with pytest.raises(ValueError, match="too few tokens"):
        quantile_balancing_update(s, np.zeros(4), 3)
    quantile_balancing_update(s[:, :4], np.zeros(4), 2)  # q = 1.5 needs the 3rd: fine


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_scores_or_bias_rejected(bad):
    s = np.random.default_rng(0).random((8, 4))
    s_bad = s.copy()
    s_bad[2, 1] = bad
    with pytest.raises(ValueError, match="scores must be finite"):
        quantile_balancing_update(s_bad, np.zeros(4), 1)
    b_bad = np.zeros(4)
    b_bad[0] = bad
    with pytest.raises(ValueError, match="bias must be finite"):
        quantile_balancing_update(s, b_bad, 1)


def test_bad_shapes_and_k_rejected():
    s = np.random.default_rng(0).random((8, 4))
    with pytest.raises(ValueError, match=r"bias must have shape \[4\]"):
        quantile_balancing_update(s, np.zeros(5), 1)
    with pytest.raises(ValueError, match="top_k must be <= 4"):
        quantile_balancing_update(s, np.zeros(4), 5)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        quantile_balancing_update(s, np.zeros(4), 0)
    with pytest.raises(TypeError, match="top_k must be an integer"):
        quantile_balancing_update(s, np.zeros(4), 1.5)
    with pytest.raises(ValueError, match="2 dimensions"):
        quantile_balancing_update(s[0], np.zeros(4), 1)
    with pytest.raises(TypeError, match="bias must be float32 or float64"):
        quantile_balancing_update(s, np.zeros(4, dtype=np.float16), 1)
    with pytest.raises(ValueError, match="at least one token"):
        quantile_balancing_update(s[:0], np.zeros(4), 1)


# ---------------------------------------------------------------------------
# The pieces: cutoffs, margins, order statistics
# ---------------------------------------------------------------------------


@given(batches())
def test_margins_use_the_routing_cutoff(batch):
    s, b, k = batch
    np.testing.assert_array_equal(margins(s, b, k), reference_margins(s, b, k))


def test_fast_cutoff_equals_selection_cutoff_bit_for_bit():
    rng = np.random.default_rng(5)
    s = rng.random((300, 64), dtype=np.float32)
    b = (rng.normal(size=64) * 0.1).astype(np.float32)
    _, alpha = selection_cutoff(s, b, 7)
    np.testing.assert_array_equal(cutoff_values(s, b, 7), alpha)


@given(st.integers(1, 30), st.integers(0, 10**6), st.sampled_from([0.0, 0.25, 0.5, 0.99]))
def test_interpolated_kth_largest_against_sort(whole, seed, frac):
    rng = np.random.default_rng(seed)
    values = np.round(rng.normal(size=(35, 3)), 1)  # rounding creates ties
    assume(whole + (frac > 0) <= 35)
    desc = -np.sort(-values, axis=0)
    expected = desc[whole - 1] + frac * (desc[whole] - desc[whole - 1]) if frac else desc[whole - 1]
    np.testing.assert_allclose(interpolated_kth_largest(values, whole + frac), expected, atol=1e-15)
    np.testing.assert_allclose(interpolated_kth_largest(values.T.copy(), whole + frac, axis=1), expected,
                               atol=1e-15)


def test_interpolated_kth_largest_rejects_ranks_outside_the_data():
    v = np.arange(5.0)
    assert interpolated_kth_largest(v, 5) == 0.0
    assert interpolated_kth_largest(v, 4.5) == 0.5
    with pytest.raises(ValueError, match="rank must lie in"):
        interpolated_kth_largest(v, 5.5)
    with pytest.raises(ValueError, match="rank must lie in"):
        interpolated_kth_largest(v, 0.5)
    with pytest.raises(TypeError, match="rank must be a finite real"):
        interpolated_kth_largest(v, float("nan"))


def test_cupy_branch_of_the_update_with_numpy_standing_in(monkeypatch):
    """The code CuPy runs, checked without a GPU: the balancing module is told its arrays are CuPy's
    (one block, `cupy.partition` for the selection) and NumPy's `partition`, which has the same
    contract, stands in for CuPy's. A slip in that branch's ranks fails here, not first on a GPU."""
    import types

    import refimpl.balancing.quantile as balancing

    monkeypatch.setattr(balancing, "is_numpy", lambda xp: False)
    monkeypatch.setattr(balancing, "is_cupy", lambda xp: True)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(partition=np.partition))
    rng = np.random.default_rng(24)
    for m, n, k in ((2000, 24, 3), (2001, 24, 5), (40, 6, 2)):
        s = 1.0 / (1.0 + np.exp(-rng.normal(size=(m, n)) - rng.normal(size=n)))
        b = 0.1 * rng.normal(size=n)
        np.testing.assert_allclose(quantile_balancing_update(s, b, k), reference_update(s, b, k),
                                   rtol=0, atol=1e-15)
        np.testing.assert_allclose(quantile_balancing_update(s, b, k, center=False, leave_one_out=True),
                                   reference_leave_one_out_update(s, b, k), rtol=0, atol=1e-15)
    # The public order statistic, along either axis (a transposed view on the way in) and for a fractional rank.
    v = rng.normal(size=(300, 7))
    for axis, rank in ((0, 5), (0, 17.25), (1, 2), (1, 3.5)):
        desc = -np.sort(-(v if axis == 1 else v.T), axis=1)
        whole, frac = math.floor(rank), rank - math.floor(rank)
        expected = desc[:, whole - 1] + (frac * (desc[:, whole] - desc[:, whole - 1]) if frac else 0.0)
        np.testing.assert_allclose(interpolated_kth_largest(v, rank, axis=axis), expected, rtol=0, atol=1e-15)


def test_kth_largest_portable_path_matches(xp):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 50))
    desc = -np.sort(-x, axis=1)
    kth, prev = kth_largest(xp.asarray(x), 7, previous=True)
    np.testing.assert_array_equal(to_numpy(kth), desc[:, 6])
    np.testing.assert_array_equal(to_numpy(prev), desc[:, 5])


# ---------------------------------------------------------------------------
# The atom of ties at -b_j, and the leave-one-out extension
# ---------------------------------------------------------------------------


def test_the_atom_holds_an_under_loaded_expert_in_place():
    # 6 tokens, 3 experts, k = 1, q = 2. Expert 2 is every token's second choice and nobody's first.
    s = np.array([[0.9, 0.1, 0.5],
                  [0.8, 0.2, 0.6],
                  [0.7, 0.3, 0.45],
                  [0.2, 0.9, 0.55],
                  [0.1, 0.8, 0.65],
                  [0.3, 0.7, 0.4]])
    b = np.zeros(3)
    np.testing.assert_array_equal(expert_load(route(s, b, 1)[0], 3), [3, 3, 0])
    M = reference_margins(s, b, 1)
    np.testing.assert_array_equal(M[:, 2], np.zeros(6))  # the whole column is the atom at -b_2 = 0
    b_tilde = quantile_balancing_update(s, b, 1, center=False)
    assert b_tilde[2] == 0.0  # the 3rd largest margin is in the atom: expert 2's bias does not move
    # With the cutoffs held, a raise of 0.01 would seem to bring in all six tokens ...
    assert int(np.sum(M[:, 2] > -0.01)) == 6
    # ... but in truth expert 2 must overtake each token's first choice, and none switches.
    assert expert_load(route(s, np.array([0.0, 0.0, 0.01]), 1)[0], 3)[2] == 0
    # The leave-one-out margins are s_i2 minus the first choice: -0.4, -0.2, -0.25, -0.35, -0.15, -0.3.
    loo = quantile_balancing_update(s, b, 1, center=False, leave_one_out=True)
    assert loo[2] == pytest.approx(0.25, abs=1e-15)  # minus the 3rd largest
    # Any bias strictly between minus the 3rd and minus the 2nd largest gives expert 2 exactly q = 2 tokens.
    assert expert_load(route(s, np.array([0.0, 0.0, 0.225]), 1)[0], 3)[2] == 2


@given(integer_q_batches(max_n=6, max_multiple=4))
def test_leave_one_out_gives_each_expert_exactly_q_when_it_moves_alone(batch):
    s, b, k = batch
    m, n = s.shape
    q = m * k // n
    M = reference_leave_one_out_margins(s, b, k)
    desc = -np.sort(-M, axis=0)
    b_tilde = quantile_balancing_update(s, b, k, center=False, leave_one_out=True)
    np.testing.assert_allclose(b_tilde, -desc[q], rtol=0, atol=1e-15)
    for j in range(n):
        assume(desc[q - 1, j] - desc[q, j] > 1e-9)
        # Halfway between the q-th and (q+1)-th margin: moving b_j alone gives expert j exactly q tokens.
        moved = b.copy()
        moved[j] = -(desc[q - 1, j] + desc[q, j]) / 2
        assert expert_load(route(s, moved, k)[0], n)[j] == q


# ---------------------------------------------------------------------------
# The sign rule
# ---------------------------------------------------------------------------


@given(st.integers(2, 20), st.integers(0, 10**6), st.sampled_from([1e-3, 1e-2, 0.1]))
def test_sign_rule_against_a_loop(n, seed, rate):
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 10, size=n)
    bias = rng.normal(size=n).astype(np.float32)
    q = load.sum() / n
    expected = bias.copy()
    for j in range(n):
        expected[j] = bias[j] + np.float32(rate) * np.float32(np.sign(q - load[j]))
    got = sign_balancing_update(load, bias, rate)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_sign_rule_leaves_an_on_target_expert_alone(xp):
    load = xp.asarray(np.array([3, 5, 4, 4]))
    bias = xp.asarray(np.zeros(4))
    np.testing.assert_array_equal(to_numpy(sign_balancing_update(load, bias, 0.5)), [0.5, -0.5, 0.0, 0.0])


def test_sign_rule_bad_input():
    with pytest.raises(TypeError, match="load must be an integer array"):
        sign_balancing_update(np.ones(3), np.zeros(3), 0.1)
    with pytest.raises(ValueError, match=r"load must have shape \[3\]"):
        sign_balancing_update(np.ones(4, dtype=int), np.zeros(3), 0.1)
    with pytest.raises(ValueError, match="rate must be positive"):
        sign_balancing_update(np.ones(3, dtype=int), np.zeros(3), 0.0)


def test_load_ratio():
    assert load_ratio(np.array([2, 4, 3])) == 2.0
    assert load_ratio(np.array([0, 4])) == math.inf


# ---------------------------------------------------------------------------
# The balancers
# ---------------------------------------------------------------------------


def skewed_batch(rng, m, n, offsets):
    return (1.0 / (1.0 + np.exp(-(rng.normal(size=(m, n)) + offsets)))).astype(np.float32)


def test_quantile_balancer_routes_with_the_bias_it_held():
    rng = np.random.default_rng(0)
    n, k = 8, 2
    offsets = rng.normal(size=n)
    bal = QuantileBalancer(n, k)
    for _ in range(4):
        batch = skewed_batch(rng, 64, n, offsets)
        held = bal.bias
        step = bal.step(batch)
        np.testing.assert_array_equal(step.bias, held)
        np.testing.assert_array_equal(step.index, route(batch, held, k)[0])
        np.testing.assert_array_equal(step.load, expert_load(route(batch, held, k)[0], n))
        expected_next = quantile_balancing_update(batch, held, k)
        np.testing.assert_array_equal(step.next_bias, expected_next)
        np.testing.assert_array_equal(bal.bias, expected_next)
        # The check can fail: the bias derived from this batch routes it differently.
        assert not np.array_equal(route(batch, expected_next, k)[0], step.index)
    assert bal.step_count == 4 and len(bal.loads) == 4 and len(bal.biases) == 4
    assert bal.ratios[-1] == load_ratio(bal.loads[-1])


def test_sign_balancer_routes_with_the_bias_it_held():
    rng = np.random.default_rng(1)
    n, k = 8, 2
    bal = SignBalancer(n, k, rate=0.01)
    batch = skewed_batch(rng, 64, n, rng.normal(size=n))
    step = bal.step(batch)
    np.testing.assert_array_equal(step.index, route(batch, np.zeros(n, np.float32), k)[0])
    np.testing.assert_array_equal(step.next_bias, sign_balancing_update(step.load, np.zeros(n, np.float32), 0.01))


# Every balancer of the training CLI, plus the extension's options and a float64 bias: the kinds that save.
N, K = 16, 3


def training_balancer(name):
    from refimpl.train import BALANCERS, TrainConfig, default_layer

    config = TrainConfig(balancer=name, batch=128, micro_batches=3, sign_rate=1e-2,
                         moe=default_layer(num_experts=N, top_k=K))
    return BALANCERS[name](config)


def every_kind():
    from refimpl.train import BALANCERS

    makers = {name: (lambda name=name: training_balancer(name)) for name in BALANCERS}
    makers["qb, leave-one-out, damped"] = lambda: QuantileBalancer(N, K, leave_one_out=True, damping=0.5)
    makers["qb, float64"] = lambda: QuantileBalancer(N, K, dtype=np.float64, bias=0.01 * np.arange(N))
    return makers


KINDS = every_kind()


def balancer_batches(count, m=128, seed=7):
    """Batches of skewed scores (each with token ids, which the hash rule routes by)."""
    rng = np.random.default_rng(seed)
    offsets = rng.normal(size=N)
    return [(skewed_batch(rng, m, N, offsets), rng.integers(0, 256, m)) for _ in range(count)]


def assert_same_state(a, b):
    """Two balancers hold the same kind, options, bias and history, bit for bit."""
    assert type(a) is type(b) and a.kind == b.kind and a.options() == b.options()
    assert (a.num_experts, a.top_k, a.step_count) == (b.num_experts, b.top_k, b.step_count)
    assert a.bias.dtype == b.bias.dtype and a.bias.tobytes() == b.bias.tobytes()
    assert [x.tobytes() for x in a.loads] == [x.tobytes() for x in b.loads]
    assert [x.tobytes() for x in a.biases] == [x.tobytes() for x in b.biases]
    assert np.array(a.ratios).tobytes() == np.array(b.ratios).tobytes()


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_saves_and_restores_bit_for_bit(tmp_path, name):
    """Stop after 3 of 6 batches, save, restore: the next batches route exactly as without the stop."""
    batches = balancer_batches(6)
    straight = KINDS[name]()
    for scores, ids in batches:
        straight.step(scores, token_ids=ids)
    first = KINDS[name]()
    for scores, ids in batches[:3]:
        first.step(scores, token_ids=ids)
    path = tmp_path / "state.npz"
    first.save(path)
    resumed = Balancer.restore(path)
    assert_same_state(resumed, first)
    for scores, ids in batches[3:]:
        a, b = first.step(scores, token_ids=ids), resumed.step(scores, token_ids=ids)
        np.testing.assert_array_equal(a.index, b.index)
        assert a.next_bias.tobytes() == b.next_bias.tobytes()
    assert_same_state(resumed, straight)
    # The file needs no pickle.
    with np.load(path, allow_pickle=False) as data:
        assert str(data["kind"]) == first.kind


def test_every_kind_restores_after_import_refimpl_alone(tmp_path):
    """A fresh interpreter that imports only `refimpl` restores every kind, and routes the next batch the same."""
    batches = balancer_batches(4)
    expected = {}
    for number, make in enumerate(KINDS.values()):
        balancer = make()
        for scores, ids in batches[:3]:
            balancer.step(scores, token_ids=ids)
        balancer.save(tmp_path / f"{number}.npz")
        expected[number] = balancer.step(*batches[3][:1], token_ids=batches[3][1]).index
    np.savez(tmp_path / "batch.npz", scores=batches[3][0], ids=batches[3][1])
    code = (
        "import sys, numpy as np, refimpl\n"
        "assert 'refimpl.train' not in sys.modules and 'refimpl.train_baselines' not in sys.modules\n"
        f"batch = np.load({str(tmp_path / 'batch.npz')!r})\n"
        f"for number in range({len(KINDS)}):\n"
        f"    b = refimpl.Balancer.restore({str(tmp_path)!r} + f'/{{number}}.npz')\n"
        "    np.save(f'" + str(tmp_path) + "/index-{number}.npy', b.step(batch['scores'], token_ids=batch['ids']).index)\n"
    )
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for number, index in expected.items():
        np.testing.assert_array_equal(np.load(tmp_path / f"index-{number}.npy"), index)


def test_what_each_balancer_declares():
    """The declared interface: the layer each one balances, token ids, the auxiliary loss."""
    from refimpl.config import MoEConfig
    from refimpl.train import BALANCERS

    layer = MoEConfig.tiny(num_experts=N, top_k=K)
    changes = {"capacity-1.0": {"capacity_factor": 1.0}, "capacity-1.25": {"capacity_factor": 1.25},
               "hash": {"hash_routing": True}}
    coefficients = {"aux": 1e-2, "seq": 1e-4}
    for name in BALANCERS:
        balancer = training_balancer(name)
        assert balancer.layer_config(layer) == layer.replace(**changes.get(name, {})), name
        assert balancer.needs_token_ids == (name == "hash"), name
        assert balancer.coefficient == coefficients.get(name, 0.0), name
        assert Balancer.kinds[balancer.kind] is type(balancer)
    with pytest.raises(ValueError, match="num_experts=6"):
        QuantileBalancer(N, K).layer_config(MoEConfig.tiny())


def test_a_step_given_the_layers_route_counts_that_route():
    """With index= the loads are those of the route given (the layer's), and the sign rule moves by them."""
    rng = np.random.default_rng(3)
    scores = skewed_batch(rng, 64, N, rng.normal(size=N))
    given = np.stack([rng.permutation(N)[:K] for _ in range(64)])  # not the top-k of anything
    sign = SignBalancer(N, K, rate=0.01)
    step = sign.step(scores, index=given)
    np.testing.assert_array_equal(step.load, np.bincount(given.ravel(), minlength=N))
    np.testing.assert_array_equal(step.next_bias, sign_balancing_update(step.load, np.zeros(N, np.float32), 0.01))
    # The hash rule routes alone only when it has the token ids.
    hashed = training_balancer("hash")
    with pytest.raises(ValueError, match="needs token_ids"):
        hashed.step(scores)
    with pytest.raises(ValueError, match=r"index must have shape \[64, 3\]"):
        sign.step(scores, index=given[:, :2])


def test_balancer_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"bias must have shape \[4\]"):
        QuantileBalancer(4, 1, bias=np.zeros(3))
    with pytest.raises(ValueError, match="damping must be in"):
        QuantileBalancer(4, 1, damping=1.5)
    with pytest.raises(ValueError, match=r"scores must have shape \[\*, 4\]"):
        QuantileBalancer(4, 1).step(np.zeros((3, 5)))
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        SignBalancer(4, 1, dtype=np.float16)
    # A file that is not a balancer's state, one of an unknown kind, one that is not a zip at all.
    path = tmp_path / "odd.npz"
    np.savez(path, kind=np.array("quantile"), options=np.array("{}"))
    with pytest.raises(ValueError, match=r"it lacks \['biases', 'bias', |it lacks \["):
        Balancer.restore(path)
    QuantileBalancer(4, 1).save(path)
    with np.load(path) as data:
        fields = dict(data)
    np.savez(path, **{**fields, "kind": np.array("mystery")})
    with pytest.raises(ValueError, match="unknown balancer kind 'mystery'"):
        Balancer.restore(path)
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="is not a balancer state"):
        Balancer.restore(tmp_path / "text.npz")
    # Every kind declares its own name, once.
    with pytest.raises(TypeError, match="must set its own kind"):
        type("Nameless", (QuantileBalancer,), {})
    with pytest.raises(TypeError, match="'quantile' is taken"):
        type("Impostor", (Balancer,), {"kind": "quantile"})


def test_save_is_atomic_and_reads_the_first_format(tmp_path, monkeypatch):
    """A save that fails part-way leaves the previous state; a file of the first format (no options) restores."""
    path = tmp_path / "state.npz"
    balancer = SignBalancer(N, K, rate=0.01)
    balancer.save(path)
    before = path.read_bytes()
    balancer.step(balancer_batches(1)[0][0])

    def broken(handle, **arrays):
        handle.write(b"PK half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError, match="No space left"):
        balancer.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["state.npz"]
    # The first format kept the options as arrays of their own.
    old = tmp_path / "old.npz"
    np.savez(old, kind=np.array("quantile"), num_experts=np.int64(N), top_k=np.int64(K), step_count=np.int64(2),
             bias=np.arange(N, dtype=np.float32), loads=np.ones((2, N), np.int64), ratios=np.ones(2),
             biases=np.zeros((2, N), np.float32), leave_one_out=np.bool_(True), damping=np.float64(0.5))
    restored = Balancer.restore(old)
    assert type(restored) is QuantileBalancer and restored.options() == {"leave_one_out": True, "damping": 0.5}
    assert restored.step_count == 2 and restored.bias.tobytes() == np.arange(N, dtype=np.float32).tobytes()


def test_fixed_batch_extension_reaches_exact_balance():
    """Leave-one-out cutoffs with damping balance a fixed batch exactly, where the paper's rule stalls."""
    rng = np.random.default_rng(0)
    m, n, k = 64, 8, 2
    s = 1.0 / (1.0 + np.exp(-rng.standard_normal((m, n))))
    plain = QuantileBalancer(n, k, dtype=np.float64)
    remedy = QuantileBalancer(n, k, dtype=np.float64, leave_one_out=True, damping=0.5)
    for _ in range(60):
        plain.step(s)
        remedy.step(s)
    final = expert_load(route(s, remedy.bias, k)[0], n)
    np.testing.assert_array_equal(final, np.full(n, 16))
    assert not np.array_equal(expert_load(route(s, plain.bias, k)[0], n), np.full(n, 16))


# ---------------------------------------------------------------------------
# The worked examples run, and what they print holds
# ---------------------------------------------------------------------------


def assert_png(path) -> None:
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow
def test_example_10_qb_by_hand(tmp_path, capsys):
    result = load_example("10_qb_by_hand").main(["--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert result["held"] == [6, 6, 6, 6]  # with the cutoffs held, every expert clears exactly q = 6
    assert sum(result["load"]) == sum(result["again"]) == 24
    assert abs(sum(result["b_new"])) < 1e-12
    assert "inside the atom" in text
    assert_png(tmp_path / "margins_and_loads.png")


@pytest.mark.slow
def test_example_11_k3_balancing_small(tmp_path, capsys):
    result = load_example("11_k3_balancing").main(["--out", str(tmp_path), "--tokens", "2048", "--steps", "6"])
    ratios = result["ratios"]["QB (Eq. 14)"]
    assert ratios[1] < ratios[0] / 3  # one update removes most of the router's skew
    assert min(result["floor"]) >= 1.0
    assert "noise floor" in capsys.readouterr().out
    assert_png(tmp_path / "max_min_load.png")


@pytest.mark.slow
def test_example_14_fresh_batch_noise_small(tmp_path, capsys):
    result = load_example("14_fresh_batch_noise").main(
        ["--out", str(tmp_path), "--atom-tokens", "8192", "--tokens", "2048", "--steps", "6"])
    stuck = result["atom"]
    assert stuck["Eq. (14)"]["stuck"] > 10 * max(1, stuck["leave-one-out (extension)"]["stuck"])
    assert "predicted" in capsys.readouterr().out
    assert_png(tmp_path / "atom_and_noise.png")


@given(st.integers(2, 40), st.integers(3, 12), st.data())
def test_cutoffs_equal_the_k_plus_first_sorted_biased_score(m, n, data):
    """`cutoffs` is the (k+1)-th largest of s + b per token, as a full sort says, and equals `selection_cutoff`."""
    top_k = data.draw(st.integers(1, n - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    scores = rng.random((m, n))
    bias = 0.1 * rng.standard_normal(n)
    expected = np.sort(scores + bias, axis=1)[:, n - top_k - 1]
    np.testing.assert_array_equal(cutoffs(scores, bias, top_k), expected)
    np.testing.assert_array_equal(cutoffs(scores, bias, top_k), selection_cutoff(scores, bias, top_k)[1])


def test_cutoffs_reject_k_equal_to_n():
    """With k = n no (k+1)-th score exists: a clear error naming top_k."""
    with pytest.raises(ValueError, match="top_k"):
        cutoffs(np.full((4, 3), 0.5), np.zeros(3), 3)
