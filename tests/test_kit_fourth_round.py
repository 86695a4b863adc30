"""The kit passes no wrong port and fails no right one on what a dtype, a drawn bias or a stateful balancer hides.

* a router that breaks ties towards the higher id is not failed when a half dtype ties two biased scores;
* the balancer check draws a nonzero initial bias, and notices a `step` that writes into it;
* a check asked for float64 holds float64's tolerance by default, so a float32 port fails it;
* `routing_cases` keeps its documented gap between biased scores whatever the sizes;
* the balancer check names look-ahead only on evidence;
* bad arguments are refused up front, naming them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refimpl
import refimpl.testing as kit
from refimpl.balancing import quantile_balancing_update
from refimpl.testing import (
    CheckFailure,
    check_balancer,
    check_balancing_update,
    check_capacity,
    check_forward,
    check_histogram_update,
    check_router,
    samples,
)
from refimpl.testing import strategies as rst

FEW = settings(kit.QUICK, max_examples=15)


def _failure(check, fn, **options) -> CheckFailure:
    with pytest.raises(CheckFailure) as info:
        check(fn, **options)
    return info.value


# ---------------------------------------------------------------------------
# A half dtype's exact ties leave the choice open
# ---------------------------------------------------------------------------

def higher_id_router(scores, bias, top_k):
    """A valid top-k of s + b in float32 that breaks ties towards the HIGHER id."""
    sb = scores.astype(np.float32) + bias.astype(np.float32)
    n = sb.shape[1]
    idx = (n - 1 - np.argsort(-sb[:, ::-1], axis=1, kind="stable"))[:, :top_k]
    raw = np.take_along_axis(scores.astype(np.float32), idx, 1)
    return idx, raw / raw.sum(1, keepdims=True)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_a_router_with_ties_to_the_higher_id_passes_in_a_half_dtype(dtype):
    check_router(higher_id_router, dtype=dtype, rtol=1e-2, atol=1e-3, settings=settings(kit.QUICK, max_examples=150))


def test_a_router_choosing_a_lower_biased_score_still_fails_in_bfloat16():
    def second_best(scores, bias, top_k):
        sb = scores.astype(np.float32) + bias.astype(np.float32)
        order = np.argsort(-sb, axis=1, kind="stable")
        if top_k == sb.shape[1]:
            return higher_id_router(scores, bias, top_k)
        idx = np.concatenate([order[:, :top_k - 1], order[:, top_k:top_k + 1]], axis=1)
        raw = np.take_along_axis(scores.astype(np.float32), idx, 1)
        return idx, raw / raw.sum(1, keepdims=True)

    failure = _failure(check_router, second_best, dtype=ml_dtypes.bfloat16, rtol=1e-2, atol=1e-3, settings=FEW)
    assert "selection is the top-k of s + b" in failure.failed


# ---------------------------------------------------------------------------
# The balancer starts from a drawn bias, and its inputs stay untouched
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("start", [np.zeros_like, np.negative], ids=["ignored", "negated"])
def test_a_balancer_that_ignores_or_negates_its_initial_bias_fails(start):
    failure = _failure(check_balancer, lambda b, k: samples.Balancer(start(b), k).step, settings=FEW)
    assert "follows the update rule" in failure.failed


def test_the_sample_balancer_passes_from_a_drawn_bias():
    check_balancer(samples.make_balancer)


def test_balancer_cases_draw_a_centred_nonzero_initial_bias():
    seen = []

    @settings(kit.QUICK, max_examples=30)
    @given(rst.balancer_cases())
    def draw(case):
        assert abs(float(case.initial_bias.mean())) < 1e-12
        seen.append(bool(np.any(case.initial_bias != 0)))

    draw()
    assert any(seen)


def test_a_step_that_writes_into_the_initial_bias_is_reported():
    class Writer:
        def __init__(self, initial_bias, top_k):
            self.bias, self.top_k = initial_bias, top_k  # keeps the caller's array

        def step(self, scores):
            index, _ = samples.router(scores, self.bias, self.top_k)
            self.bias[:] = samples.qb_update(scores, self.bias, self.top_k)  # ... and writes into it
            return index

    failure = _failure(check_balancer, lambda b, k: Writer(b, k).step, settings=FEW)
    assert "initial_bias" in str(failure)


# ---------------------------------------------------------------------------
# float64 asks float64's tolerance
# ---------------------------------------------------------------------------

def router64(scores, bias, top_k):
    index, weights = refimpl.route(np.asarray(scores, np.float64), np.asarray(bias, np.float64), top_k)
    return np.asarray(index), np.asarray(weights)


def forward64(x, params, config):
    """The sample port's arithmetic in float64: another order of sums than the reference's."""
    sample = samples.forward.__wrapped__ if hasattr(samples.forward, "__wrapped__") else None
    assert sample is None
    p = {name: np.asarray(value, dtype=np.float64) for name, value in params.items()}
    h = np.asarray(x, dtype=np.float64)
    scores = 1.0 / (1.0 + np.exp(-(h @ p["gate.weight"].T)))
    index, weights = router64(scores, p["gate.e_score_correction_bias"], config.top_k)
    weights = weights * config.routed_scaling_factor
    z = h @ p["routed_expert_down_proj.weight"].T
    u = np.zeros_like(z)
    for e in range(config.num_experts):
        rows, slots = np.nonzero(index == e)
        hidden = samples.situ_glu(z[rows] @ p["experts.w1"][e].T, z[rows] @ p["experts.w3"][e].T,
                                  config.situ_beta, config.situ_linear_beta)
        u[rows] += weights[rows, slots, None] * (hidden @ p["experts.w2"][e].T)
    y = samples.rms_norm(u, p["routed_expert_norm.weight"], config.rms_norm_eps) @ p["routed_expert_up_proj.weight"].T
    shared = samples.situ_glu(h @ p["shared_experts.gate_proj.weight"].T, h @ p["shared_experts.up_proj.weight"].T,
                              config.situ_beta, config.situ_linear_beta) @ p["shared_experts.down_proj.weight"].T
    return shared + y


def qb_update32(scores, bias, top_k):
    return np.asarray(quantile_balancing_update(scores.astype(np.float32), bias.astype(np.float32), top_k),
                      dtype=np.float32)


def qb_update64(scores, bias, top_k):
    """Eq. (14) written out in float64, with a full sort per column (the sample's, without its float32 cast)."""
    s = scores.astype(np.float64)
    m, n = s.shape
    alpha = -np.sort(-(s + bias.astype(np.float64)), axis=1)[:, top_k]
    b_tilde = -samples.kth_largest_interpolated(s - alpha[:, None], m * top_k / n + 1)
    return b_tilde - b_tilde.mean()


@pytest.mark.parametrize("check, port", [(check_router, samples.router), (check_forward, samples.forward),
                                         (check_balancing_update, samples.qb_update),
                                         (check_balancing_update, qb_update32)],
                         ids=["router", "forward", "update", "update32"])
def test_a_float32_port_fails_a_float64_check(check, port):
    _failure(check, port, dtype=np.float64, settings=FEW)


@pytest.mark.parametrize("check, port", [(check_router, router64), (check_forward, forward64),
                                         (check_balancing_update, qb_update64)],
                         ids=["router", "forward", "update"])
def test_a_float64_port_passes_a_float64_check(check, port):
    check(port, dtype=np.float64)


@pytest.mark.parametrize("check, port", [(check_router, samples.router), (check_forward, samples.forward),
                                         (check_balancing_update, samples.qb_update)],
                         ids=["router", "forward", "update"])
def test_the_float32_samples_still_pass_in_float32(check, port):
    check(port)


# ---------------------------------------------------------------------------
# The documented gap holds at any size
# ---------------------------------------------------------------------------

def test_routing_cases_keep_the_documented_gap_on_large_sizes():
    @settings(kit.QUICK, max_examples=40)
    @given(rst.routing_cases(max_tokens=64, max_experts=64, min_experts=60))
    def gap(case):
        sb = np.sort(case.scores + case.bias, axis=1)
        assert np.diff(sb, axis=1).min() >= 2.0**-14 * (1 - 1e-9)
        assert 0 < case.scores.min() and case.scores.max() < 1

    gap()


# ---------------------------------------------------------------------------
# Look-ahead is named on evidence only
# ---------------------------------------------------------------------------

class StaleBalancer:
    """Routes each batch with the bias one update behind (the bias before the previous batch)."""

    def __init__(self, initial_bias, top_k):
        self.bias = self.before = initial_bias.astype(np.float32)
        self.top_k = top_k

    def step(self, scores):
        index, _ = samples.router(scores, self.before, self.top_k)
        self.before, self.bias = self.bias, samples.qb_update(scores, self.bias, self.top_k)
        return index


class LookAheadBalancer:
    def __init__(self, initial_bias, top_k):
        self.bias, self.top_k = initial_bias.astype(np.float32), top_k

    def step(self, scores):
        self.bias = samples.qb_update(scores, self.bias, self.top_k)
        return samples.router(scores, self.bias, self.top_k)[0]


def _follows_hint(failure: CheckFailure) -> str:
    violation = failure.violations[failure.failed.index("follows the update rule")]
    return "\n".join(violation.details)


def test_a_stale_balancer_is_not_called_look_ahead():
    failure = _failure(check_balancer, lambda b, k: StaleBalancer(b, k).step)
    assert "look-ahead" not in _follows_hint(failure)


def test_a_look_ahead_balancer_is_still_named():
    failure = _failure(check_balancer, lambda b, k: LookAheadBalancer(b, k).step)
    assert "look-ahead" in _follows_hint(failure)


# ---------------------------------------------------------------------------
# Bad arguments are refused up front, naming them
# ---------------------------------------------------------------------------

BAD = [
    (check_forward, samples.forward, {"rtol": -1}, ValueError, "rtol"),
    (check_forward, samples.forward, {"rtol": "a"}, TypeError, "rtol"),
    (check_forward, samples.forward, {"max_tokens": 0}, ValueError, "max_tokens"),
    (check_forward, samples.forward, {"configs": {}}, TypeError, "configs"),
    (check_forward, None, {}, TypeError, "fn"),
    (check_forward, samples.forward, {"dtype": np.int32}, (TypeError, ValueError), "dtype"),
    (check_balancing_update, samples.qb_update, {"dtype": np.int64}, (TypeError, ValueError), "dtype"),
    (check_balancing_update, samples.qb_update, {"max_experts": 1}, ValueError, "max_experts"),
    (check_histogram_update, samples.histogram_update, {"bins": 0}, ValueError, "bins"),
    (check_histogram_update, samples.histogram_update, {"bins": -5}, ValueError, "bins"),
    (check_histogram_update, samples.histogram_update, {"max_ranks": 0}, ValueError, "max_ranks"),
    (check_balancer, samples.make_balancer, {"steps": 0}, ValueError, "steps"),
    (check_balancer, samples.make_balancer, {"max_experts": 1}, ValueError, "max_experts"),
    (check_balancer, samples.make_balancer, {"follows": 5}, TypeError, "follows"),
    (check_balancer, samples.make_balancer, {"margin": "x"}, TypeError, "margin"),
    (check_capacity, lambda *a: None, {"max_experts": 0}, ValueError, "max_experts"),
    (check_capacity, lambda *a: None, {"rtol": "x"}, TypeError, "rtol"),
    (check_capacity, lambda *a: None, {"order": ["x"]}, (TypeError, ValueError), "order"),
]


@pytest.mark.parametrize("check, fn, options, error, name", BAD,
                         ids=[f"{c.__name__}-{next(iter(o), 'fn')}-{o.get(next(iter(o), ''), '')!r}"
                              for c, _, o, _, _ in BAD])
def test_bad_arguments_are_refused_naming_them(check, fn, options, error, name):
    with pytest.raises(error, match=name):
        check(fn, **options)


def test_bad_strategy_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="max_abs"):
        rst.bias_shifts(0.0)
    with pytest.raises(ValueError, match="experts"):
        rst.routing_cases(min_experts=1, max_experts=1, for_update=True)
    st.just(0)  # the strategies module builds nothing else on import
