"""Tests of Eq. (12) and Appendix B: softcap, SiTU-GLU, SwiGLU, their derivatives, RMSNorm.

Expectations come from closed forms written here with `math` (tanh, exp,
cosh), from central finite differences, and from Taylor series; never from
the functions under test.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl._lib.xp import to_numpy
from refimpl.layer.activations import (
    _sech2,
    hard_clamp,
    hard_clamp_grad,
    rms_norm,
    sigmoid,
    situ_glu,
    situ_glu_grad,
    softcap,
    softcap_grad,
    swiglu,
    swiglu_grad,
)

BETA1, BETA2 = 4.0, 25.0
BOUND = BETA1 * BETA2  # 100
BF16 = ml_dtypes.bfloat16
HALF_DTYPES = [np.float16, BF16]
ALL_NUMPY_DTYPES = [np.float64, np.float32, np.float16, BF16]

with_xp = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def exact_sigmoid(z: float) -> float:
    """The logistic function in Python floats, stable on both sides."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def situ_exact(a: float, b: float, beta1: float = BETA1, beta2: float = BETA2) -> float:
    return beta1 * math.tanh(a / beta1) * exact_sigmoid(a) * beta2 * math.tanh(b / beta2)


def swiglu_exact(a: float, b: float) -> float:
    return a * exact_sigmoid(a) * b


def extremes(dtype) -> list[float]:
    """Large finite values of `dtype`, ±1e30 where it is finite, and a few ordinary ones."""
    big = float(np.finfo(dtype).max) if dtype is not BF16 else float(ml_dtypes.finfo(BF16).max)
    values = [0.0, 1.0, -1.0, 3.5, -3.5, 50.0, -50.0, 1e4, -1e4, big, -big, big / 2, -big / 2]
    if big > 1e30:
        values += [1e30, -1e30]
    return values


# ---------------------------------------------------------------------------
# The bound: |SiTU-GLU| <= beta1 * beta2
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_bound_holds_at_the_extremes_of_every_dtype(dtype):
    values = np.array(extremes(dtype), dtype=dtype)
    a, b = np.meshgrid(values, values)  # every pair of extreme inputs
    out = situ_glu(a, b)
    assert out.dtype == np.dtype(dtype)  # half precision in, half precision out
    out64 = out.astype(np.float64)
    assert np.all(np.isfinite(out64))
    assert np.max(np.abs(out64)) <= BOUND
    # Floating point saturates exactly at the bound: tanh rounds to 1 and sigmoid to 1.
    assert np.max(np.abs(out64)) == BOUND
    # SwiGLU at the same inputs is unbounded (it overflows or exceeds the bound by far).
    with np.errstate(over="ignore", invalid="ignore"):
        sw = swiglu(a, b).astype(np.float64)
    assert not np.all(np.abs(sw[np.isfinite(sw)]) <= BOUND) or not np.all(np.isfinite(sw))


@with_xp
@given(a=st.floats(allow_nan=False, allow_infinity=False),
       b=st.floats(allow_nan=False, allow_infinity=False))
def test_bound_holds_for_all_finite_float64(xp, a, b):
    out = to_numpy(situ_glu(xp.asarray([a], dtype=xp.float64), xp.asarray([b], dtype=xp.float64)))
    assert abs(out[0]) <= BOUND


@with_xp
@given(a=st.floats(allow_nan=False, allow_infinity=False, width=32),
       b=st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_bound_holds_for_all_finite_float32(xp, a, b):
    out = situ_glu(xp.asarray([a], dtype=xp.float32), xp.asarray([b], dtype=xp.float32))
    assert out.dtype == xp.float32
    assert abs(float(to_numpy(out)[0])) <= BOUND


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: np.dtype(d).name)
def test_bound_holds_for_every_half_precision_value(dtype):
    # Every finite value of the 16-bit type, paired with every extreme: exhaustive on one axis.
    bits = np.arange(2**16, dtype=np.uint16).view(dtype)
    finite = bits[np.isfinite(bits.astype(np.float32))]
    for partner in np.array(extremes(dtype), dtype=dtype):
        for gate, up in ((finite, np.full_like(finite, partner)), (np.full_like(finite, partner), finite)):
            out = situ_glu(gate, up)
            assert out.dtype == np.dtype(dtype)
            assert np.max(np.abs(out.astype(np.float64))) <= BOUND


@given(a=st.floats(-30, 30), b=st.floats(-200, 200))
def test_strictly_below_the_bound_where_tanh_does_not_round_to_one(a, b):
    # In exact arithmetic |SiTU-GLU| < beta1*beta2 everywhere; float64 shows it while
    # tanh(a/4) and tanh(b/25) are still below 1.
    assert abs(situ_exact(a, b)) < BOUND
    assert abs(float(situ_glu(np.array([a]), np.array([b]))[0])) < BOUND


def test_softcap_bounded_and_odd(xp):
    x = xp.asarray([-1e30, -100.0, -1.0, 0.0, 1.0, 100.0, 1e30], dtype=xp.float64)
    y = to_numpy(softcap(x, 4.0))
    assert np.all(np.abs(y) <= 4.0)
    np.testing.assert_array_equal(y, -y[::-1])
    np.testing.assert_allclose(y, [4.0 * math.tanh(v / 4.0) for v in to_numpy(x)], rtol=1e-15)


# ---------------------------------------------------------------------------
# First-order equivalence with SwiGLU near 0, and the limit beta -> infinity
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [4.0, 25.0])
def test_softcap_taylor_series(xp, beta):
    # softcap(z, beta) = z - z^3 / (3 beta^2) + O(z^5 / beta^4)
    z = xp.asarray([1e-1, 3e-2, 1e-2, 3e-3], dtype=xp.float64)
    err = to_numpy(softcap(z, beta)) - to_numpy(z)
    z = to_numpy(z)
    np.testing.assert_allclose(err / z**3, -1.0 / (3 * beta**2), rtol=1e-2 * (z.max() / beta) ** 2 * 100)
    # Third order: the error falls 27-fold when z falls 3-fold.
    np.testing.assert_allclose(err[:-1:2] / err[1::2], (z[:-1:2] / z[1::2]) ** 3, rtol=1e-3)


@given(a0=st.floats(-2, 2), b0=st.floats(-2, 2))
def test_situ_agrees_with_swiglu_to_first_order_near_zero(a0, b0):
    # Along the ray (t a0, t b0), SiTU-GLU - SwiGLU is O(t^3) (in fact O(t^4): two
    # factors, each off by O(t^3)); the derivatives agree at 0.
    t = np.array([1e-1, 1e-2, 1e-3])
    diff = situ_glu(t * a0, t * b0) - swiglu(t * a0, t * b0)
    assert np.all(np.abs(diff) <= 0.05 * t**3 + 1e-300)
    ga_s, gb_s = situ_glu_grad(np.array([0.0]), np.array([b0]))
    ga_w, gb_w = swiglu_grad(np.array([0.0]), np.array([b0]))
    # At a = 0: d/da = sigma(0) * softcap(b) vs sigma(0) * b, and d/db = 0 for both.
    assert abs(ga_s[0] - ga_w[0]) <= 0.5 * abs(b0) ** 3 / (3 * BETA2**2) + 1e-16
    assert gb_s[0] == gb_w[0] == 0.0


def test_situ_converges_to_swiglu_as_beta_grows(xp):
    grid = np.linspace(-8.0, 8.0, 33)
    a, b = (xp.asarray(v) for v in np.meshgrid(grid, grid))
    reference = to_numpy(swiglu(a, b))
    errors = []
    for scale in [1.0, 10.0, 100.0, 1000.0, 1e4]:
        out = to_numpy(situ_glu(a, b, beta=BETA1 * scale, linear_beta=BETA2 * scale))
        errors.append(float(np.max(np.abs(out - reference))))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:], strict=False))
    # The error falls like 1/beta^2: 100-fold per 10-fold beta.
    assert errors[-1] < 1e-6 and errors[-2] / errors[-1] == pytest.approx(100, rel=0.05)


def test_pointwise_convergence_matches_closed_form():
    for a, b in [(1.0, 2.0), (-3.0, 5.0), (7.0, -0.5)]:
        for beta in [1e2, 1e4, 1e6]:
            got = float(situ_glu(np.array([a]), np.array([b]), beta=beta, linear_beta=beta)[0])
            assert got == pytest.approx(situ_exact(a, b, beta, beta), rel=1e-14)
        assert got == pytest.approx(swiglu_exact(a, b), rel=1e-10)


# ---------------------------------------------------------------------------
# Derivatives
# ---------------------------------------------------------------------------

def central_difference(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    step = h * np.maximum(1.0, np.abs(x))
    return (f(x + step) - f(x - step)) / (2 * step)


@given(z=st.floats(-60, 60), beta=st.floats(0.5, 30))
def test_softcap_grad_matches_closed_form_and_finite_differences(z, beta):
    got = float(softcap_grad(np.array([z]), beta)[0])
    assert got == pytest.approx(1.0 / math.cosh(z / beta) ** 2, rel=1e-13, abs=1e-300)
    fd = central_difference(lambda v: softcap(v, beta), np.array([z]))[0]
    assert got == pytest.approx(fd, rel=1e-6, abs=1e-9)


def test_softcap_grad_keeps_its_precision_far_past_the_cap(xp):
    # 1 - tanh^2 would be exactly 0 here (tanh rounds to 1 from |z|/beta = 19 in float64).
    z = np.array([20.0, 50.0, 100.0, 300.0]) * 4.0
    got = to_numpy(softcap_grad(xp.asarray(z), 4.0))
    np.testing.assert_allclose(got, [1.0 / math.cosh(v / 4.0) ** 2 for v in z], rtol=1e-13)
    assert np.all(got > 0)
    z32 = np.array([10.0, 20.0, 40.0], dtype=np.float32) * 4.0
    got32 = to_numpy(softcap_grad(xp.asarray(z32), 4.0))
    np.testing.assert_allclose(got32, [1.0 / math.cosh(float(v) / 4.0) ** 2 for v in z32], rtol=1e-5)


@given(a=st.floats(-40, 40), b=st.floats(-150, 150))
def test_situ_glu_grad_matches_finite_differences(a, b):
    ga, gb = situ_glu_grad(np.array([a]), np.array([b]))
    fd_a = central_difference(lambda v: situ_glu(v, np.array([b])), np.array([a]))[0]
    fd_b = central_difference(lambda v: situ_glu(np.array([a]), v), np.array([b]))[0]
    assert ga[0] == pytest.approx(fd_a, rel=1e-5, abs=1e-7)
    assert gb[0] == pytest.approx(fd_b, rel=1e-5, abs=1e-7)


@given(a=st.floats(-40, 40), b=st.floats(-150, 150))
def test_situ_glu_grad_matches_closed_form(a, b):
    s = exact_sigmoid(a)
    g = BETA1 * math.tanh(a / BETA1) * s
    g_prime = s / math.cosh(a / BETA1) ** 2 + BETA1 * math.tanh(a / BETA1) * s * (1 - s)
    h = BETA2 * math.tanh(b / BETA2)
    ga, gb = situ_glu_grad(np.array([a]), np.array([b]))
    assert ga[0] == pytest.approx(g_prime * h, rel=1e-12, abs=1e-13)
    assert gb[0] == pytest.approx(g / math.cosh(b / BETA2) ** 2, rel=1e-12, abs=1e-300)


@given(a=st.floats(-40, 40), b=st.floats(-100, 100))
def test_swiglu_grad_matches_closed_form_and_finite_differences(a, b):
    s = exact_sigmoid(a)
    ga, gb = swiglu_grad(np.array([a]), np.array([b]))
    assert ga[0] == pytest.approx((s + a * s * (1 - s)) * b, rel=1e-12, abs=1e-13)
    assert gb[0] == pytest.approx(a * s, rel=1e-13, abs=1e-300)
    fd_a = central_difference(lambda v: swiglu(v, np.array([b])), np.array([a]))[0]
    assert ga[0] == pytest.approx(fd_a, rel=1e-5, abs=1e-7)


def test_derivatives_on_backends(xp):
    a = xp.asarray([-3.0, 0.0, 2.0, 9.0], dtype=xp.float64)
    b = xp.asarray([1.0, -4.0, 30.0, 0.5], dtype=xp.float64)
    ga, gb = (to_numpy(g) for g in situ_glu_grad(a, b))
    wa, wb = (to_numpy(g) for g in swiglu_grad(a, b))
    for i, (av, bv) in enumerate(zip(to_numpy(a), to_numpy(b), strict=True)):
        s = exact_sigmoid(av)
        gp = s / math.cosh(av / 4) ** 2 + 4 * math.tanh(av / 4) * s * (1 - s)
        assert ga[i] == pytest.approx(gp * 25 * math.tanh(bv / 25), rel=1e-12)
        assert gb[i] == pytest.approx(4 * math.tanh(av / 4) * s / math.cosh(bv / 25) ** 2, rel=1e-12, abs=1e-300)
        assert wa[i] == pytest.approx((s + av * s * (1 - s)) * bv, rel=1e-12)
        assert wb[i] == pytest.approx(av * s, rel=1e-12, abs=1e-300)


def test_non_zero_derivative_where_a_hard_clamp_is_flat(xp):
    # Past the cap the hard clamp passes no gradient at all; the softcap still does.
    for dtype, top in [(xp.float64, 100.0), (xp.float32, 20.0)]:
        z = xp.asarray(np.concatenate([np.linspace(1.01, top, 200), -np.linspace(1.01, top, 200)]) * 4.0,
                       dtype=dtype)
        clamp = to_numpy(hard_clamp_grad(z, 4.0))
        soft = to_numpy(softcap_grad(z, 4.0))
        assert np.all(clamp == 0.0)
        assert np.all(soft > 0.0)
        # And the clamp itself is flat there: its values are exactly +-beta.
        assert np.all(np.abs(to_numpy(hard_clamp(z, 4.0))) == 4.0)


def test_hard_clamp_inside_the_cap(xp):
    z = xp.asarray([-3.9, 0.0, 2.5], dtype=xp.float64)
    np.testing.assert_array_equal(to_numpy(hard_clamp(z, 4.0)), [-3.9, 0.0, 2.5])
    np.testing.assert_array_equal(to_numpy(hard_clamp_grad(z, 4.0)), [1.0, 1.0, 1.0])


def test_sech2_helper(xp):
    u = xp.asarray([0.0, 0.5, -3.0, 19.5, 200.0], dtype=xp.float64)
    np.testing.assert_allclose(to_numpy(_sech2(u)), [1.0 / math.cosh(v) ** 2 for v in to_numpy(u)],
                               rtol=1e-14)


# ---------------------------------------------------------------------------
# sigmoid
# ---------------------------------------------------------------------------

def test_sigmoid_is_accurate_on_both_sides(xp):
    z = np.concatenate([-np.geomspace(1e-3, 700, 60), [0.0], np.geomspace(1e-3, 700, 60)])
    got = to_numpy(sigmoid(xp.asarray(z)))
    np.testing.assert_allclose(got, [exact_sigmoid(v) for v in z], rtol=4e-16)
    # The (1 + tanh(z/2)) / 2 form returned exactly 0 here; the true value is about 4e-18.
    assert to_numpy(sigmoid(xp.asarray([-40.0])))[0] == pytest.approx(math.exp(-40) / (1 + math.exp(-40)),
                                                                     rel=1e-15)
    z32 = np.array([-80.0, -30.0, -1.0, 0.0, 1.0, 30.0], dtype=np.float32)
    got32 = to_numpy(sigmoid(xp.asarray(z32)))
    np.testing.assert_allclose(got32, [exact_sigmoid(float(v)) for v in z32], rtol=3e-7)


def test_sigmoid_never_overflows_and_stays_in_unit_interval():
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        s = sigmoid(np.array([-1e308, -1000.0, 1000.0, 1e308]))
    np.testing.assert_array_equal(s, [0.0, 0.0, 1.0, 1.0])


# ---------------------------------------------------------------------------
# Precision: half in, half out; computed in float32
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: np.dtype(d).name)
def test_half_precision_in_half_precision_out(dtype):
    a = np.array([-6.0, -0.5, 0.0, 0.75, 3.0, 40.0], dtype=dtype)
    b = np.array([2.0, -1.0, 5.0, 0.25, -30.0, 1.5], dtype=dtype)
    outputs = [softcap(a, 4.0), softcap_grad(a, 4.0), hard_clamp(a, 4.0), hard_clamp_grad(a, 4.0),
               sigmoid(a), situ_glu(a, b), *situ_glu_grad(a, b), swiglu(a, b), *swiglu_grad(a, b),
               rms_norm(a, np.ones(6, dtype=dtype))]
    for out in outputs:
        assert out.dtype == np.dtype(dtype)
    # Computed in float32 and rounded once: within one half-precision rounding of the exact value.
    expected = np.array([situ_exact(float(x), float(y)) for x, y in zip(a, b, strict=True)])
    eps = float(ml_dtypes.finfo(dtype).eps)
    np.testing.assert_allclose(situ_glu(a, b).astype(np.float64), expected, rtol=eps, atol=1e-6)


def test_float32_stays_float32_and_float64_stays_float64(xp):
    for dtype in (xp.float32, xp.float64):
        a = xp.asarray([0.5, -2.0], dtype=dtype)
        assert situ_glu(a, a).dtype == dtype
        assert swiglu(a, a).dtype == dtype
        assert softcap(a, 2.0).dtype == dtype


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------

@with_xp
@given(seed=st.integers(0, 2**32 - 1), c=st.floats(1e-3, 1e3), eps=st.floats(1e-8, 1e-2))
def test_rms_norm_formula_and_scale_identity(xp, seed, c, eps):
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((3, 5))
    g = rng.standard_normal(5)
    expected = u / np.sqrt(np.mean(u**2, axis=-1, keepdims=True) + eps) * g
    got = to_numpy(rms_norm(xp.asarray(u), xp.asarray(g), eps))
    np.testing.assert_allclose(got, expected, rtol=1e-13)
    # Exact identity: RMSNorm_eps(c u) = RMSNorm_{eps / c^2}(u), so only eps breaks the invariance.
    scaled = to_numpy(rms_norm(xp.asarray(c * u), xp.asarray(g), eps))
    np.testing.assert_allclose(scaled, to_numpy(rms_norm(xp.asarray(u), xp.asarray(g), eps / c**2)),
                               rtol=1e-12)


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

def test_bad_input(xp):
    x = xp.asarray([1.0, 2.0], dtype=xp.float64)
    with pytest.raises(TypeError, match=r"x must be a real floating array .*got dtype .*int"):
        softcap(xp.asarray([1, 2]), 4.0)
    with pytest.raises(TypeError, match=r"x must be an array, got list"):
        softcap([1.0, 2.0], 4.0)
    with pytest.raises(ValueError, match=r"beta must be positive and finite, got 0.0"):
        softcap(x, 0.0)
    with pytest.raises(ValueError, match=r"beta must be positive and finite, got -1.0"):
        softcap_grad(x, -1.0)
    with pytest.raises(ValueError, match=r"beta must be positive and finite, got -4.0"):
        hard_clamp(x, -4.0)
    with pytest.raises(ValueError, match=r"gate and up must have the same shape, got gate \(2,\) and up \(1, 2\)"):
        situ_glu(x, xp.reshape(x, (1, 2)))
    with pytest.raises(ValueError, match=r"gate and up must have the same shape"):
        swiglu_grad(x, xp.asarray([1.0], dtype=xp.float64))
    with pytest.raises(TypeError, match=r"up must be a real floating array"):
        situ_glu(x, xp.asarray([1, 2]))
    with pytest.raises(ValueError, match=r"linear_beta must be positive and finite, got 0.0"):
        situ_glu_grad(x, x, 4.0, 0.0)
    with pytest.raises(ValueError, match=r"weight must have shape \[2\] to match the last axis of x"):
        rms_norm(x, xp.asarray([1.0, 1.0, 1.0], dtype=xp.float64))
    with pytest.raises(ValueError, match=r"eps must be positive and finite, got 0.0"):
        rms_norm(x, x, 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_outputs_never_share_memory_with_inputs(dtype):
    # Inputs already in the compute dtype are not copied on the way in, so a result that is the input
    # itself (or a view of it) would let a caller's later in-place update change the other.
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal((6, 5)).astype(dtype) for _ in range(2))
    gain = np.ones(5, dtype=dtype)
    a_before, b_before = a.copy(), b.copy()
    outputs = {
        "sigmoid": [sigmoid(a)], "softcap": [softcap(a, 4.0)], "softcap_grad": [softcap_grad(a, 4.0)],
        "hard_clamp": [hard_clamp(a, 100.0)], "hard_clamp_grad": [hard_clamp_grad(a, 4.0)],
        "situ_glu": [situ_glu(a, b)], "situ_glu_grad": list(situ_glu_grad(a, b)),
        "swiglu": [swiglu(a, b)], "swiglu_grad": list(swiglu_grad(a, b)), "rms_norm": [rms_norm(a, gain)],
    }
    for name, outs in outputs.items():
        for out in outs:
            assert out.dtype == dtype, name
            assert not np.shares_memory(out, a) and not np.shares_memory(out, b), name
    np.testing.assert_array_equal(a, a_before)
    np.testing.assert_array_equal(b, b_before)


# ---------------------------------------------------------------------------
# The uncapped up branch (linear_beta=None): the reference code's form without
# `activation_situ_linear_beta`
# ---------------------------------------------------------------------------

@given(a=st.floats(-60, 60), b=st.floats(-1e4, 1e4), beta=st.floats(0.5, 8))
def test_uncapped_up_branch_matches_closed_form(a, b, beta):
    expected = beta * math.tanh(a / beta) / (1 + math.exp(-a)) * b
    got = float(situ_glu(np.array([a]), np.array([b]), beta=beta, linear_beta=None)[0])
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-300)


def test_uncapped_up_branch_is_not_bounded(xp):
    # Only the gate factor is capped: the output grows linearly with b, past beta1 * beta2.
    a = xp.asarray([20.0, 20.0, 20.0])
    b = xp.asarray([1e2, 1e4, 1e6])
    out = to_numpy(situ_glu(a, b, beta=BETA1, linear_beta=None))
    np.testing.assert_allclose(out, BETA1 * math.tanh(20.0 / BETA1) / (1 + math.exp(-20.0)) * np.array([1e2, 1e4, 1e6]),
                               rtol=1e-12)
    assert out[-1] > 1e3 * BOUND


@given(a=st.floats(-30, 30), b=st.floats(-100, 100))
def test_uncapped_grad_matches_finite_differences(a, b):
    d_gate, d_up = situ_glu_grad(np.array([a]), np.array([b]), beta=BETA1, linear_beta=None)
    h = 1e-6

    def f(x, y):
        return float(situ_glu(np.array([x]), np.array([y]), beta=BETA1, linear_beta=None)[0])
    assert float(d_gate[0]) == pytest.approx((f(a + h, b) - f(a - h, b)) / (2 * h), rel=1e-5, abs=1e-6)
    # d/db is exactly the capped gate factor
    assert float(d_up[0]) == pytest.approx(BETA1 * math.tanh(a / BETA1) / (1 + math.exp(-a)), rel=1e-12, abs=1e-300)


def test_relu_glu_with_one_matrix_is_the_ungated_squared_relu_and_its_partials_are_exact():
    """Nemotron-H's relu(u)^2 as the GLU max(a, 0) b: with a = b = u it is relu(u)^2; its partials, fast and slow."""
    from refimpl._lib.fast import glu_and_grad_by_chunks, glu_in_place
    from refimpl.layer.activations import glu_and_grad, relu_glu

    rng = np.random.default_rng(3)
    u = rng.standard_normal((6, 9))
    np.testing.assert_array_equal(relu_glu(u, u), np.maximum(u, 0) ** 2)
    a, b = rng.standard_normal((2, 6, 9))
    h, d_a, d_b = glu_and_grad(a, b, "relu2")
    np.testing.assert_array_equal(h, np.maximum(a, 0) * b)
    np.testing.assert_array_equal(d_a, (a > 0) * b)  # exact: away from a = 0 the gate is linear
    np.testing.assert_array_equal(d_b, np.maximum(a, 0))
    for fast, slow in zip(glu_and_grad_by_chunks(a.copy(), b.copy(), "relu2", 4.0, None), (h, d_a, d_b), strict=True):
        np.testing.assert_array_equal(fast, slow)
    np.testing.assert_array_equal(glu_in_place(a.copy(), b.copy(), "relu2", 4.0, None), h)
