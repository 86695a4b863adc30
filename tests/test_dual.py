"""Appendix C: the assignment LP, its dual, coordinate descent, and the HiGHS cross-check.

Independent references: brute-force enumeration of every balanced assignment
on tiny batches, full sorts, explicit perturbations of D, and HiGHS itself.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from conftest import load_example
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl._lib.xp import to_numpy
from refimpl.balancing import quantile_balancing_update
from refimpl.balancing.dual import (
    alpha_step,
    beta_step,
    beta_subgradient,
    coordinate_descent,
    dual_objective,
    separating_dual,
    solve_assignment_lp,
    subgradient_check,
)
from refimpl.layer.routing import expert_load, route


def sigmoid_scores(rng, m, n):
    return 1.0 / (1.0 + np.exp(-(rng.normal(size=(m, n)) + 0.5 * rng.normal(size=n))))


def cyclic_assignment(m: int, n: int, k: int) -> np.ndarray:
    """A balanced 0/1 assignment: token i takes experts (ik + r) mod n, r < k; each expert gets mk/n tokens."""
    x = np.zeros((m, n))
    for i in range(m):
        x[i, [(i * k + r) % n for r in range(k)]] = 1.0
    return x


@st.composite
def lp_instances(draw, max_n=8, max_multiple=4):
    """(scores [m, n], k) with an integer q and at least n/(n-k) + 1 tokens."""
    n = draw(st.integers(2, max_n))
    k = draw(st.integers(1, n - 1))
    step = n // math.gcd(n, k)
    m = step * draw(st.integers(max(1, math.ceil((n / (n - k) + 1) / step)), max_multiple))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return sigmoid_scores(rng, m, n), k


# ---------------------------------------------------------------------------
# The dual objective and weak duality
# ---------------------------------------------------------------------------


def test_dual_objective_against_a_loop():
    rng = np.random.default_rng(0)
    s = rng.random((5, 4))
    a, b = rng.normal(size=5), rng.normal(size=4)
    k = 2
    expected = k * a.sum() + (5 * 2 / 4) * b.sum()
    for i in range(5):
        for j in range(4):
            expected += max(0.0, s[i, j] - a[i] - b[j])
    assert dual_objective(s, a, b, k) == pytest.approx(expected, rel=1e-14)


@given(lp_instances(), st.integers(0, 10**6))
def test_weak_duality_for_random_feasible_x_and_multipliers(instance, seed):
    s, k = instance
    m, n = s.shape
    rng = np.random.default_rng(seed)
    # A random balanced assignment: permute the tokens and experts of a cyclic one; then mix two of them
    # (a fractional point of the relaxed polytope).
    x1 = cyclic_assignment(m, n, k)[rng.permutation(m)][:, rng.permutation(n)]
    x2 = cyclic_assignment(m, n, k)[rng.permutation(m)][:, rng.permutation(n)]
    w = rng.random()
    for x in (x1, w * x1 + (1 - w) * x2):
        np.testing.assert_allclose(x.sum(axis=1), k)
        np.testing.assert_allclose(x.sum(axis=0), m * k / n)
        for scale in (0.01, 1.0, 10.0):
            a, b = rng.normal(scale=scale, size=m), rng.normal(scale=scale, size=n)
            assert float(np.sum(s * x)) <= dual_objective(s, a, b, k) + 1e-12


def test_dual_objective_on_every_backend(xp):
    rng = np.random.default_rng(1)
    s, a, b = rng.random((6, 3)), rng.normal(size=6), rng.normal(size=3)
    assert dual_objective(xp.asarray(s), xp.asarray(a), xp.asarray(b), 1) == pytest.approx(
        dual_objective(s, a, b, 1), rel=1e-15)


# ---------------------------------------------------------------------------
# The LP solved by HiGHS
# ---------------------------------------------------------------------------


def brute_force_optimum(s: np.ndarray, k: int) -> float:
    """The best balanced assignment by enumerating every choice of k experts per token."""
    m, n = s.shape
    q = m * k // n
    best = -math.inf
    for choice in itertools.product(list(itertools.combinations(range(n), k)), repeat=m):
        load = np.zeros(n, dtype=int)
        for experts in choice:
            load[list(experts)] += 1
        if np.all(load == q):
            best = max(best, sum(s[i, list(e)].sum() for i, e in enumerate(choice)))
    return best


@pytest.mark.parametrize("m,n,k,seed", [(4, 4, 1, 0), (4, 2, 1, 1), (6, 3, 1, 2), (4, 4, 2, 3), (6, 3, 2, 4)])
def test_lp_optimum_equals_brute_force(m, n, k, seed):
    s = np.random.default_rng(seed).random((m, n))
    r = solve_assignment_lp(s, k)
    assert r.objective == pytest.approx(brute_force_optimum(s, k), rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(lp_instances())
def test_lp_strong_duality_integrality_and_feasibility(instance):
    s, k = instance
    m, n = s.shape
    r = solve_assignment_lp(s, k)
    # Strong duality: the recovered multipliers reach the optimum (relative 1e-9).
    assert dual_objective(s, r.alpha, r.beta, k) == pytest.approx(r.objective, rel=1e-9, abs=1e-12)
    # Total unimodularity: the solution is integral.
    assert r.integrality <= 1e-9
    np.testing.assert_allclose(r.x.sum(axis=1), k, atol=1e-9)
    np.testing.assert_allclose(r.x.sum(axis=0), r.q, atol=1e-9)
    assert r.objective == pytest.approx(float(np.sum(s * r.x)), rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(lp_instances())
def test_routing_with_minus_beta_reproduces_the_lp_assignment(instance):
    s, k = instance
    r = solve_assignment_lp(s, k)
    chosen = np.round(r.x) == 1.0
    # The vertex dual: the LP's choice is *a* top-k of s - beta* (its edge may be tied).
    v = s - r.beta[None, :]
    worst_chosen = np.where(chosen, v, np.inf).min(axis=1)
    best_other = np.where(chosen, -np.inf, v).max(axis=1)
    assert np.all(worst_chosen >= best_other - 1e-9)
    # Where the optimum is unique, the separating dual routes to exactly the LP's assignment.
    sep = separating_dual(s, r.x)
    assert dual_objective(s, sep.alpha, sep.beta, k) == pytest.approx(r.objective, rel=1e-9)
    if sep.margin > 1e-9:
        index, _ = route(s, -sep.beta, k)
        np.testing.assert_array_equal(np.sort(index, axis=1), r.index)


def test_vertex_dual_can_tie_where_the_separating_dual_does_not():
    rng = np.random.default_rng(0)
    s = 1.0 / (1.0 + np.exp(-rng.standard_normal((64, 8))))
    r = solve_assignment_lp(s, 2)
    v = np.sort(s - r.beta, axis=1)
    assert np.sum(np.isclose(v[:, -2], v[:, -3], rtol=0, atol=1e-12)) > 0  # ties at the k-th/(k+1)-th edge
    sep = separating_dual(s, r.x)
    assert sep.margin > 0
    np.testing.assert_array_equal(expert_load(route(s, -sep.beta, 2)[0], 8), np.full(8, 16))


def test_lp_bad_input():
    rng = np.random.default_rng(0)
    s = rng.random((6, 4))
    with pytest.raises(ValueError, match="integer target load"):
        solve_assignment_lp(s, 1)  # q = 6/4
    with pytest.raises(ValueError, match="infeasible"):
        solve_assignment_lp(rng.random((8, 4)), 5)  # q = 10 > m = 8
    bad = rng.random((8, 4))
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="scores must be finite"):
        solve_assignment_lp(bad, 1)
    with pytest.raises(ValueError, match="HiGHS did not solve.*[Ii]teration limit"):
        solve_assignment_lp(rng.random((64, 8)), 2, options={"maxiter": 1})


def test_lp_with_k_equal_n_takes_everything():
    r = solve_assignment_lp(np.random.default_rng(0).random((5, 3)), 3)
    np.testing.assert_allclose(r.x, 1.0)


# ---------------------------------------------------------------------------
# Coordinate descent and its relation to Eq. (14)
# ---------------------------------------------------------------------------


@given(lp_instances(max_multiple=6), st.integers(0, 10**6))
def test_alpha_and_beta_steps_are_exact_coordinate_minima(instance, seed):
    s, k = instance
    m, n = s.shape
    rng = np.random.default_rng(seed)
    beta = rng.normal(scale=0.2, size=n)
    alpha = alpha_step(s, beta, k)
    np.testing.assert_array_equal(alpha, np.sort(s - beta, axis=1)[:, n - k - 1])
    d = dual_objective(s, alpha, beta, k)
    for delta in (1e-3, 0.1):
        for i in range(m):
            for sign in (1.0, -1.0):
                moved = alpha.copy()
                moved[i] += sign * delta
                assert dual_objective(s, moved, beta, k) >= d - 1e-12
    new_beta = beta_step(s, alpha, k)
    np.testing.assert_array_equal(new_beta, -np.sort(-(s - alpha[:, None]), axis=0)[m * k // n])
    d = dual_objective(s, alpha, new_beta, k)
    for delta in (1e-3, 0.1):
        for j in range(n):
            for sign in (1.0, -1.0):
                moved = new_beta.copy()
                moved[j] += sign * delta
                assert dual_objective(s, alpha, moved, k) >= d - 1e-12


@given(lp_instances(), st.integers(0, 10**6))
def test_one_qb_update_is_one_alpha_step_then_one_beta_step(instance, seed):
    s, k = instance
    b = np.random.default_rng(seed).normal(scale=0.3, size=s.shape[1])
    beta = beta_step(s, alpha_step(s, -b, k), k)
    np.testing.assert_array_equal(quantile_balancing_update(s, b, k, center=False), -beta)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # xp is a module constant
@given(lp_instances(max_n=5, max_multiple=3))
def test_steps_on_every_backend(xp, instance):
    s, k = instance
    beta = np.linspace(-0.1, 0.1, s.shape[1])
    alpha = alpha_step(s, beta, k)
    np.testing.assert_array_equal(to_numpy(alpha_step(xp.asarray(s), xp.asarray(beta), k)), alpha)
    np.testing.assert_array_equal(to_numpy(beta_step(xp.asarray(s), xp.asarray(alpha), k)), beta_step(s, alpha, k))


def test_lp_tools_take_arrays_of_every_backend(xp):
    """HiGHS, the separating dual, coordinate descent and the subgradient check accept any backend's
    arrays (moving them to the host themselves) and give what they give for NumPy input."""
    s = sigmoid_scores(np.random.default_rng(5), 12, 4)
    k = 2
    bias = np.array([0.02, -0.01, 0.0, -0.01])
    lp, lp_xp = solve_assignment_lp(s, k), solve_assignment_lp(xp.asarray(s), k)
    np.testing.assert_array_equal(lp_xp.x, lp.x)
    assert lp_xp.objective == pytest.approx(lp.objective, rel=1e-12)
    sep, sep_xp = separating_dual(s, lp.x), separating_dual(xp.asarray(s), xp.asarray(lp.x))
    for name in ("alpha", "beta"):
        np.testing.assert_allclose(to_numpy(getattr(sep_xp, name)), getattr(sep, name), rtol=0, atol=1e-12)
    trace, trace_xp = coordinate_descent(s, k, iterations=5), coordinate_descent(xp.asarray(s), k, iterations=5)
    for name in ("objective", "loads", "index", "beta"):
        np.testing.assert_allclose(to_numpy(getattr(trace_xp, name)), getattr(trace, name), rtol=1e-12, atol=1e-15)
    check, check_xp = subgradient_check(s, bias, k), subgradient_check(xp.asarray(s), xp.asarray(bias), k)
    for name in ("load", "q_minus_load", "sign_rule_step"):
        np.testing.assert_array_equal(to_numpy(getattr(check_xp, name)), getattr(check, name))
    # A difference quotient with h = 1e-6 carries the rounding of D divided by h, about 1e-9 here, and a
    # device may sum D in another order than NumPy: the two quotients agree to that, not to the last bit.
    np.testing.assert_allclose(to_numpy(check_xp.finite_difference), check.finite_difference, rtol=0, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(lp_instances())
def test_coordinate_descent_never_increases_d_and_stays_above_the_lp(instance):
    s, k = instance
    trace = coordinate_descent(s, k, iterations=30)
    assert np.all(np.diff(trace.objective) <= 1e-12)
    assert trace.objective[-1] >= solve_assignment_lp(s, k).objective - 1e-9
    np.testing.assert_array_equal(trace.loads[0], expert_load(route(s, np.zeros(s.shape[1]), k)[0], s.shape[1]))
    # Row t routes with b = -beta_t, and the first update is Eq. (14) from b = 0.
    np.testing.assert_allclose(-(trace.beta[1] - trace.beta[1].mean()),
                               quantile_balancing_update(s, np.zeros(s.shape[1]), k), atol=1e-15)


def test_coordinate_descent_stalls_above_the_optimum_on_a_fixed_batch():
    """The finding: m = 64, n = 8, k = 2, seed 0 stops at D = 94.107 against an LP optimum of 94.039."""
    rng = np.random.default_rng(0)
    s = 1.0 / (1.0 + np.exp(-rng.standard_normal((64, 8))))
    trace = coordinate_descent(s, 2, iterations=100)
    lp = solve_assignment_lp(s, 2)
    assert trace.fixed_point is not None and trace.fixed_point < 100
    assert trace.objective[-1] == pytest.approx(94.1074, abs=1e-4)
    assert lp.objective == pytest.approx(94.0394, abs=1e-4)
    assert np.any(trace.loads[-1] != 16)


def test_coordinate_descent_bad_input():
    s = np.random.default_rng(0).random((8, 4))
    with pytest.raises(ValueError, match="top_k must be <= 3"):
        coordinate_descent(s, 4)
    with pytest.raises(ValueError, match=r"bias must have shape \[4\]"):
        coordinate_descent(s, 1, bias=np.zeros(3))
    with pytest.raises(ValueError, match=r"alpha must have shape \[8\]"):
        dual_objective(s, np.zeros(7), np.zeros(4), 1)


# ---------------------------------------------------------------------------
# The subgradient and the sign rule
# ---------------------------------------------------------------------------


@given(lp_instances(max_n=6), st.integers(0, 10**6))
def test_subgradient_in_beta_is_q_minus_load(instance, seed):
    s, k = instance
    m, n = s.shape
    b = np.random.default_rng(seed).normal(scale=0.2, size=n)
    check = subgradient_check(s, b, k, step=1e-7)
    load = expert_load(route(s, b, k)[0], n)
    np.testing.assert_array_equal(check.load, load)
    np.testing.assert_array_equal(check.q_minus_load, m * k / n - load)
    np.testing.assert_allclose(check.finite_difference, m * k / n - load, atol=1e-5)
    # The sign rule moves beta = -b against the sign of the subgradient: SignSGD.
    np.testing.assert_array_equal(check.sign_rule_step, -np.sign(m * k / n - load))


def test_beta_subgradient_counts_strictly_positive_entries():
    s = np.array([[0.5, 0.25], [0.125, 0.375]])
    alpha = np.array([0.25, 0.125])
    beta = np.array([0.0, 0.25])
    # s - beta - alpha = [[0.25, -0.25], [0, 0]] exactly: one entry above zero in column 0, none in column 1.
    np.testing.assert_array_equal(beta_subgradient(s, alpha, beta, 1), [1.0 - 1.0, 1.0 - 0.0])


# ---------------------------------------------------------------------------
# The worked examples run, and what they print holds
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_example_12_lp_crosscheck(tmp_path, capsys):
    result = load_example("12_lp_crosscheck").main(["--out", str(tmp_path)])
    assert all(g > 1e-3 for g in result["gaps"])  # iterated Eq. (14) stops above the optimum on all three
    assert all(v <= 1e-9 for v in result["integrality"])
    assert all(abs(v) <= 1e-8 for v in result["strong_duality"])
    assert result["separating_agree"] == [1.0, 1.0, 1.0]
    assert all(t > 0 for t in result["vertex_ties"])
    assert "SignSGD" in capsys.readouterr().out
    assert (tmp_path / "duality_gap.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_example_13_fixed_batch_stall(tmp_path):
    result = load_example("13_fixed_batch_stall").main(["--out", str(tmp_path)])
    assert result["stalled"] == result["seeds"]  # every seeded batch stops above the LP optimum
    assert result["under_in_atom"] == result["under"]  # each under-loaded expert is held by the atom
    assert result["damped_balanced"] == 0
    assert result["remedy_balanced"] == result["seeds"]
    assert (tmp_path / "stall.png").read_bytes().startswith(b"\x89PNG")
