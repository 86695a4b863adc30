"""The kit's third round of fixes: no check passes on what it did not look at, and bad arguments are named.

* an invariant that covered fewer than `MIN_COVERED` cases fails, whatever kept the cases out (declined,
  scoped out, or rejected while they were drawn), and `pinned` keys are checked before anything is drawn: a
  key the block's reader does not read, or values no configuration takes, are a `ValueError`;
* a port whose first named difference shows on every case and cannot be assumed is not reported as holding once
  it is scoped out;
* `check_router` checks the weights on tied inputs too, and judges a half-precision router by the bias it
  actually received;
* a forward one call behind is named a stale output, not a drift;
* every check refuses a bad argument with an error naming it, and an adapter without a protocol method is a
  reported violation naming the method.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hf_reference_block import build_block, planted
from hypothesis import reject, settings
from hypothesis import strategies as st

import refimpl
import refimpl.testing as kit
from refimpl.testing import CheckFailure, check_balancer_lifecycle, check_hf_moe_block, check_router
from refimpl.testing.hf_cases import pinned_keys
from refimpl.testing.lifecycle_check import ReferenceAdapter
from refimpl.testing.report import MIN_COVERED, Invariant, OutOfScope, run_invariant

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")

FEW = settings(kit.QUICK, max_examples=15)  # these ports fail on most cases; the tests are about the report


def _failure(check, fn, **options) -> CheckFailure:
    """The CheckFailure a check raises (the test fails if the check passes)."""
    with pytest.raises(CheckFailure) as info:
        check(fn, **options)
    return info.value


def _violation(failure: CheckFailure, invariant: str):
    return next(v for v in failure.violations if v.invariant.name == invariant)


def stable_router(scores, bias, top_k):
    """Eq. (13) computed in float64: the stable top-k of s + b, weights the raw scores renormalized."""
    s, b = scores.astype(np.float64), bias.astype(np.float64)
    index = np.argsort(-(s + b), axis=1, kind="stable")[:, :top_k]
    raw = np.take_along_axis(s, index, axis=1)
    return index, raw / raw.sum(axis=1, keepdims=True)


def refimpl_port(text_config, state_dict, *, factor=1.0):
    """refimpl itself as a port (times `factor`), reading the K3 cases with its default reader."""
    config = refimpl.MoEConfig.from_hf_config(text_config)
    params = refimpl.params_from_hf_state_dict(state_dict, config)
    return lambda x: factor * np.asarray(refimpl.stable_latent_moe(x.astype(np.float64), params, config),
                                         dtype=x.dtype)


# ---------------------------------------------------------------------------
# Too few cases covered is a failure, whatever kept them out
# ---------------------------------------------------------------------------

def _outcome(strategy, body=lambda case: None):
    return run_invariant(Invariant("holds", "a test invariant", strategy, body), FEW)


def test_an_invariant_whose_every_draw_is_rejected_fails_saying_so():
    outcome = _outcome(st.integers(0, 10).map(lambda _: reject()))
    assert outcome.violation is not None and outcome.coverage.covered == 0
    assert outcome.violation.summary.startswith("too few cases were covered to check anything: 0 covered")
    assert any("rejected while it was drawn" in line for line in outcome.violation.details)


def test_an_invariant_whose_every_case_is_scoped_out_fails_saying_so():
    def body(case):
        raise OutOfScope

    outcome = _outcome(st.integers(0, 10**6), body)
    assert outcome.violation is not None and outcome.coverage.scoped_out > 0
    assert "scoped out" in outcome.violation.summary
    assert any("a difference already named shows" in line for line in outcome.violation.details)


def test_an_invariant_covering_enough_cases_holds():
    outcome = _outcome(st.integers(0, 10**6))
    assert outcome.violation is None and outcome.coverage.covered >= MIN_COVERED


# ---------------------------------------------------------------------------
# Pinned keys are checked before anything is drawn
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("pinned", "options", "named"), [
    ({"num_experts": 0}, {}, "pinned['num_experts']"),
    ({"hidden_act": "gelu"}, {}, "pinned['hidden_act']"),
    ({"num_experts": 2, "num_experts_per_token": 3}, {}, "top_k"),
    ({"hiden_act": "situ"}, {}, "'hiden_act'"),
    ({"num_experts_per_tok": 2}, {}, "'num_experts_per_tok'"),  # a transformers spelling: K3's code reads another
    ({"routed_expert_hidden_size": 3}, {"mxfp4": True}, "mxfp4=False"),
])
def test_pinned_keys_no_configuration_takes_are_refused_naming_them(pinned, options, named):
    def wrong(text_config, state_dict):  # every output 1.5 x too large: a check that ran must fail
        return refimpl_port(text_config, state_dict, factor=1.5)

    with pytest.raises(ValueError, match="pinned") as info:
        check_hf_moe_block(wrong, pinned=pinned, **{"mxfp4": False, "settings": FEW, **options})
    assert named in str(info.value)


def test_a_misspelt_pinned_key_lists_the_keys_the_reader_knows():
    with pytest.raises(ValueError, match="does not read") as info:
        pinned_keys({"hiden_act": "situ"})
    assert "'hidden_act'" in str(info.value) and "'latent_moe_use_norm'" in str(info.value)
    with pytest.raises(ValueError, match="Qwen3MoeConfig"):
        pinned_keys({"n_group": 2}, model_type="qwen3_moe")


def test_a_pinned_alias_is_written_under_the_key_the_family_draws():
    assert pinned_keys({"num_experts": 2}, model_type="qwen3_moe") == {"num_local_experts": 2}
    with pytest.raises(ValueError, match="two values"):
        pinned_keys({"num_experts": 2, "num_local_experts": 4}, model_type="qwen3_moe")


def test_pins_some_configuration_takes_pass_through():
    pins = {"hidden_act": "situ", "latent_moe_use_norm": True, "routed_expert_hidden_size": 3}
    assert pinned_keys(pins) == pins
    assert pinned_keys(None) == {}


# ---------------------------------------------------------------------------
# Every difference: a difference that shows on every case
# ---------------------------------------------------------------------------

def test_a_round_that_scopes_out_every_case_is_not_reported_as_held():
    # Summed in a bfloat16 buffer: an output computed another way, which cannot be assumed, on every case.
    failure = _failure(check_hf_moe_block, planted("experts_summed_in_bfloat16", "shared_experts_dropped"),
                       mxfp4=False, settings=FEW)
    scoped = "matches the reference block, with experts_summed_in_bfloat16 scoped out"
    assert "experts_summed_in_bfloat16" in _violation(failure, "matches the reference block").conventions
    assert scoped in failure.failed and scoped not in failure.passed, str(failure)
    summary = _violation(failure, scoped).summary
    assert summary.startswith("could not check anything beyond experts_summed_in_bfloat16"), summary
    assert failure.coverage[scoped].covered < MIN_COVERED


# ---------------------------------------------------------------------------
# The router: weights on tied inputs, half dtypes
# ---------------------------------------------------------------------------

def mask_router(scores, bias, top_k):
    """Selection right; weights renormalized over every expert at or above the k-th s + b (more than k on a tie)."""
    biased = scores + bias
    index = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
    kth = np.take_along_axis(biased, index[:, -1:], axis=1)  # [m, 1]
    denominator = (scores * (biased >= kth)).sum(axis=1, keepdims=True)
    return index, np.take_along_axis(scores, index, axis=1) / denominator


def test_weights_renormalized_over_a_tie_fail_on_tied_inputs():
    failure = _failure(check_router, mask_router, tie_order="lower_id")
    assert failure.failed == ["ties give a valid top-k"], str(failure)
    assert _violation(failure, "ties give a valid top-k").summary.startswith("on an input with tied biased scores")


def test_a_correct_router_passes_with_ties_and_without_renormalization():
    def raw_router(scores, bias, top_k):
        index, _ = stable_router(scores, bias, top_k)
        return index, 2.5 * np.take_along_axis(scores.astype(np.float64), index, axis=1)

    assert check_router(stable_router, tie_order="lower_id").covered > 0
    assert check_router(raw_router, renormalize=False, scaling_factor=2.5, tie_order="lower_id").covered > 0


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_a_correct_router_passes_in_a_half_dtype(dtype):
    result = check_router(stable_router, dtype=dtype)
    assert "bias-shift invariance" in result.passed


def test_a_half_dtype_router_weighted_by_the_biased_scores_still_fails_the_shift():
    def biased_weights(scores, bias, top_k):
        s = scores.astype(np.float64) + bias.astype(np.float64)
        index = np.argsort(-s, axis=1, kind="stable")[:, :top_k]
        raw = np.take_along_axis(s, index, axis=1)
        return index, raw / raw.sum(axis=1, keepdims=True)

    failure = _failure(check_router, biased_weights, dtype=np.float16)
    assert "bias-shift invariance" in failure.failed


# ---------------------------------------------------------------------------
# A forward one call behind is a stale output
# ---------------------------------------------------------------------------

def one_call_behind(text_config, state_dict):
    """Each call returns the answer to the previous input (the first call is right)."""
    forward, previous = build_block(text_config, state_dict), []

    def lagging(x):
        y = forward(x)
        out = previous[0] if previous else y
        previous[:] = [y]
        return out
    return lagging


def test_a_forward_one_call_behind_is_named_stale_output():
    failure = _failure(check_hf_moe_block, one_call_behind, mxfp4=False, settings=FEW)
    summary = _violation(failure, "one build answers every input").summary
    assert summary.startswith("stale output"), summary


def one_buffer(text_config, state_dict):
    """Each call's answer is right, written into the one output buffer every call returns."""
    forward, buffers = build_block(text_config, state_dict), {}

    def refilled(x):
        y = np.asarray(forward(x))
        out = buffers.setdefault(y.shape, np.empty_like(y))
        out[...] = y
        return out
    return refilled


def test_a_forward_that_refills_the_buffer_it_returned_is_named_stale_output():
    """Every answer is right when it comes back, so only re-reading an earlier answer shows it."""
    failure = _failure(check_hf_moe_block, one_buffer, mxfp4=False, settings=FEW)
    summary = _violation(failure, "one build answers every input").summary
    assert summary.startswith("stale output: forward returned a buffer that its later calls write over"), summary


# ---------------------------------------------------------------------------
# Bad arguments are refused by name
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "error", "named"), [
    ({"rtol": -1.0}, ValueError, "rtol"),
    ({"rtol": float("nan")}, ValueError, "rtol"),
    ({"atol": float("inf")}, ValueError, "atol"),
    ({"rtol": "1e-5"}, TypeError, "rtol"),
    ({"scaling_factor": "2"}, TypeError, "scaling_factor"),
    ({"scaling_factor": 0}, ValueError, "scaling_factor"),
    ({"scaling_factor": float("nan")}, ValueError, "scaling_factor"),
    ({"dtype": "nonsense"}, TypeError, "dtype"),
    ({"dtype": np.int32}, TypeError, "dtype"),
    ({"max_experts": 1}, ValueError, "max_experts"),
    ({"max_tokens": -3}, ValueError, "max_tokens"),
    ({"max_tokens": 2.5}, TypeError, "max_tokens"),
    ({"settings": ["quick"]}, TypeError, "settings"),
    ({"settings": "quik"}, ValueError, "settings"),
])
def test_check_router_refuses_bad_arguments_by_name(options, error, named):
    with pytest.raises(error, match=f"^{named} must"):
        check_router(stable_router, **options)


def test_check_router_refuses_a_router_that_is_no_function():
    with pytest.raises(TypeError, match="^fn must"):
        check_router(None)


@pytest.mark.parametrize(("options", "error", "named"), [
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"max_experts": 1}, ValueError, "max_experts"),
    ({"dtype": "nonsense"}, TypeError, "dtype"),
    ({"settings": ["quick"]}, TypeError, "settings"),
])
def test_check_hf_moe_block_refuses_bad_arguments_by_name(options, error, named):
    with pytest.raises(error, match=f"^{named} must"):
        check_hf_moe_block(build_block, mxfp4=False, **options)


def test_check_balancer_lifecycle_refuses_a_make_that_is_no_function():
    with pytest.raises(TypeError, match="^make must"):
        check_balancer_lifecycle(None)


def test_an_adapter_without_a_protocol_method_is_reported_naming_it():
    failure = _failure(check_balancer_lifecycle, lambda n, k: object())
    assert all("observe()" in v.summary and "load_state_dict()" in v.summary for v in failure.violations)

    class NoStateDict(ReferenceAdapter):
        state_dict = None

    failure = _failure(check_balancer_lifecycle, NoStateDict)
    assert all("without the method state_dict() of the adapter protocol" in v.summary for v in failure.violations)


# ---------------------------------------------------------------------------
# The reference adapter: its own arguments and state checked
# ---------------------------------------------------------------------------

def test_the_reference_adapter_refuses_an_estimator_it_does_not_have():
    from refimpl.testing.lifecycle_check import ReferenceAdapter

    with pytest.raises(ValueError, match="estimator must be 'exact' or 'histogram', got 'exakt'"):
        ReferenceAdapter(8, 2, estimator="exakt")  # used to run the histogram silently


@pytest.mark.parametrize(("state", "message"), [
    ({"bias": np.zeros(3), "blocks": []}, r"state\['bias'\] must be 8 finite values \(one per expert\), got shape \[3\]"),
    ({"bias": np.full(8, np.nan), "blocks": []}, r"got shape \[8\] with NaN or inf"),
    ({"bias": np.zeros(8), "blocks": [np.zeros((4, 5))]}, r"state\['blocks'\]\[0\] must be \[m, 8\] scores, got shape "
                                                          r"\[4, 5\]"),
    ({"bias": np.zeros(8)}, r"exactly the keys \['bias', 'blocks'\], got \['bias'\]"),
    ({"bias": np.zeros(8), "blocks": np.zeros((2, 8))}, r"state\['blocks'\] must be a list"),
])
def test_the_reference_adapter_refuses_a_state_that_is_not_its_own(state, message):
    from refimpl.testing.lifecycle_check import ReferenceAdapter

    adapter = ReferenceAdapter(8, 2)
    adapter.observe(np.full((4, 8), 0.5, np.float32))
    before = adapter.state_dict()
    with pytest.raises(ValueError, match=message):
        adapter.load_state_dict(state)
    after = adapter.state_dict()  # nothing changed
    np.testing.assert_array_equal(after["bias"], before["bias"])
    assert len(after["blocks"]) == len(before["blocks"]) == 1
