"""The kit holds: a function that writes into its inputs, an output NumPy cannot convert, a call that hangs.

Before this release a router that overwrote its caller's scores and bias passed `check_router` (the kit hands
it copies, so the reference never saw the damage), and an output whose conversion failed escaped as a raw
`TypeError` from inside the check. Each case below is now a failed invariant that names what happened.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from refimpl.balancing import quantile_balancing_update
from refimpl.layer.baselines import capacity_keep
from refimpl.layer.routing import route
from refimpl.testing import (
    CheckFailure,
    call_deadline,
    check_balancing_update,
    check_capacity,
    check_router,
)


class Unconvertible:
    """What a CUDA tensor looks like to NumPy."""

    def __array__(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


def failure(check, fn, **kwargs) -> CheckFailure:
    with pytest.raises(CheckFailure) as exc:
        check(fn, **kwargs)
    return exc.value


# ---------------------------------------------------------------------------
# Writing into the inputs is reported, naming them
# ---------------------------------------------------------------------------

def router_writing_into(*names):
    def router(scores, bias, top_k):
        index, weights = route(scores, bias, top_k)
        for name in names:
            {"scores": scores, "bias": bias}[name][...] = 0.5
        return index, weights
    return router


@pytest.mark.parametrize("names", [("scores",), ("bias",), ("scores", "bias")])
def test_a_router_that_writes_into_its_inputs_fails(names):
    report = str(failure(check_router, router_writing_into(*names)))
    assert f"the function wrote into its input{'s' if len(names) > 1 else ''} {', '.join(names)}" in report


def test_an_update_that_writes_into_its_scores_fails():
    def update(scores, bias, top_k):
        new = quantile_balancing_update(scores, bias, top_k)
        scores.sort(axis=0)  # sorting in place: the caller's scores are reordered
        return new

    assert "wrote into its input scores" in str(failure(check_balancing_update, update))


def test_writing_the_same_values_back_is_not_a_change():
    def router(scores, bias, top_k):
        scores[...] = scores.copy()
        return route(scores, bias, top_k)

    check_router(router)


# ---------------------------------------------------------------------------
# An output NumPy cannot convert is a failure that names the conversion
# ---------------------------------------------------------------------------

def test_an_unconvertible_router_output_names_the_conversion():
    def router(scores, bias, top_k):
        index, _ = route(scores, bias, top_k)
        return index, Unconvertible()

    report = str(failure(check_router, router))
    assert "weights could not be converted with np.asarray(...): TypeError: can't convert cuda:0" in report
    assert "Unconvertible; return a NumPy array" in report


def test_an_unconvertible_update_or_capacity_output_names_the_conversion():
    report = str(failure(check_balancing_update, lambda scores, bias, top_k: Unconvertible()))
    assert "could not be converted with np.asarray" in report

    def keep(index, weights, num_experts, capacity):
        return Unconvertible(), weights

    assert "kept could not be converted with np.asarray" in str(failure(check_capacity, keep))


def test_a_ragged_list_is_named_not_raised():
    def router(scores, bias, top_k):
        index, weights = route(scores, bias, top_k)
        return [[0], [1, 2]], weights

    assert "index could not be converted with np.asarray" in str(failure(check_router, router))


# ---------------------------------------------------------------------------
# A per-call deadline
# ---------------------------------------------------------------------------

def test_a_call_that_hangs_is_reported_within_the_deadline():
    release = threading.Event()

    def hanging(scores, bias, top_k):
        release.wait(600)
        return route(scores, bias, top_k)

    start = time.monotonic()
    try:
        with call_deadline(0.2):
            report = str(failure(check_router, hanging))
    finally:
        release.set()  # let the abandoned threads end
    assert "did not return within the deadline of 0.2 s" in report
    assert time.monotonic() - start < 60


def test_a_deadline_lets_a_correct_function_pass_and_is_removed_after_the_block():
    def slow_once(scores, bias, top_k, calls=[0]):  # noqa: B006 - a counter kept between calls
        calls[0] += 1
        return route(scores, bias, top_k)

    with call_deadline(30):
        check_router(slow_once)
        check_capacity(lambda index, weights, n, c: (capacity_keep(index, n, c),
                                                     np.where(capacity_keep(index, n, c), weights, 0.0)))

    def slower(scores, bias, top_k):
        time.sleep(0.01)
        return route(scores, bias, top_k)

    check_router(slower, settings="quick")  # no deadline outside the block


@pytest.mark.parametrize("seconds", [0, -1, float("inf"), float("nan"), True, "5"])
def test_a_deadline_must_be_a_positive_number_of_seconds(seconds):
    with pytest.raises(ValueError, match=r"seconds must be a positive finite number of seconds or None"):
        with call_deadline(seconds):
            pass


# ---------------------------------------------------------------------------
# Nothing left in the user's folder
# ---------------------------------------------------------------------------

def test_a_check_leaves_no_hypothesis_folder_in_the_working_directory(tmp_path):
    import subprocess
    import sys

    script = ("from refimpl.layer.routing import route\n"
              "from refimpl.testing import CheckFailure, check_router\n"
              "check_router(lambda s, b, k: route(s, b, k))\n"
              "try:\n    check_router(lambda s, b, k: route(s, -b, k))\nexcept CheckFailure:\n    pass\n"
              "import hypothesis.configuration as c\n"
              "assert vars(c)['__hypothesis_home_directory'] is None, 'the setting was not restored'\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={k: v for k, v in __import__("os").environ.items()
                                           if k != "HYPOTHESIS_STORAGE_DIRECTORY"})
    assert run.returncode == 0, run.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# Unsupported: a port declines the cases it does not cover
# ---------------------------------------------------------------------------

def test_a_router_may_decline_some_cases_and_still_pass():
    from refimpl.testing import Unsupported

    seen = {"declined": 0}

    def top1_only(scores, bias, top_k):
        if top_k != 1:
            seen["declined"] += 1
            raise Unsupported("this port routes to one expert only")
        return route(scores, bias, top_k)

    check_router(top1_only)
    assert seen["declined"] > 0


def test_declining_everything_is_a_failure_that_says_so():
    from refimpl.testing import Unsupported

    def nothing(scores, bias, top_k):
        raise Unsupported("not written yet")

    failure_ = failure(check_router, nothing)
    report = str(failure_)
    assert "too few cases were covered to check anything: 0 covered" in report
    assert "declined because: not written yet" in report


def test_a_wrong_port_that_declines_some_cases_still_fails_on_the_others():
    from refimpl.testing import Unsupported

    def wrong(scores, bias, top_k):
        if scores.shape[0] > 3:
            raise Unsupported("small batches only")
        return route(scores, -bias, top_k)

    assert "selection is the top-k of s + b" in failure(check_router, wrong).failed


def test_a_build_that_reads_only_weight_is_told_about_mxfp4_false():
    from refimpl.testing import check_hf_moe_block

    def float_only(text_config, state_dict):
        experts = [state_dict[f"experts.{e}.w1.weight"] for e in range(text_config["num_experts"])]
        return lambda x: x * 0 + len(experts)

    failure_ = failure(check_hf_moe_block, float_only, settings="quick")
    mxfp4 = next(v for v in failure_.violations if v.invariant.name == "matches the reference block with MXFP4 "
                                                                       "experts")
    assert "the function raised KeyError" in mxfp4.summary
    assert any("checked with mxfp4=False" in line for line in mxfp4.details)


# ---------------------------------------------------------------------------
# The kit's switches are real booleans, its seeds integers: anything else is refused, naming the argument
# ---------------------------------------------------------------------------

def kit_switch_calls() -> dict[str, object]:
    """Every switch of the kit's public functions, each called with a value `v` and nothing else wrong."""
    from refimpl.testing import (
        check_balancing_update,
        check_hf_moe_block,
        hf_block_case,
        hf_block_cases,
        hf_text_configs,
    )
    from refimpl.testing import strategies as rst
    from refimpl.testing.lifecycle_check import (
        MegatronGlobalBatchAdapter,
        ReferenceAdapter,
        TorchtitanAdapter,
    )
    from refimpl.testing.outputs import float_output
    from refimpl.testing.update_check import update_cases

    text = {"hidden_size": 4, "num_experts": 4, "num_experts_per_token": 1, "moe_intermediate_size": 2}
    scores = np.full((8, 4), 0.5, dtype=np.float32)
    calls = {
        "check_router(renormalize)": lambda v: check_router(route, renormalize=v, settings="quick"),
        "check_hf_moe_block(mxfp4)": lambda v: check_hf_moe_block(lambda t, s: None, mxfp4=v),
        "check_balancing_update(integer_q_only)": lambda v: check_balancing_update(
            quantile_balancing_update, integer_q_only=v),
        "update_cases(integer_q)": lambda v: update_cases(v, 12, 8),
        "hf_block_case(mxfp4)": lambda v: hf_block_case(text, 1, mxfp4=v),
        "hf_block_cases(mxfp4)": lambda v: hf_block_cases(mxfp4=v),
        "hf_text_configs(mxfp4)": lambda v: hf_text_configs(mxfp4=v),
        "min_tokens_for_update(integer_q)": lambda v: rst.min_tokens_for_update(4, 2, integer_q=v),
        "routing_sizes(for_update)": lambda v: rst.routing_sizes(for_update=v),
        "configs(vary_switches)": lambda v: rst.configs(vary_switches=v),
        "scores(ties)": lambda v: rst.scores(3, 4, ties=v),
        "routing_cases(distinct)": lambda v: rst.routing_cases(distinct=v),
        "routing_cases(allow_all_experts)": lambda v: rst.routing_cases(allow_all_experts=v),
        "partitions(allow_empty)": lambda v: rst.partitions(4, allow_empty=v),
        "float_output(finite)": lambda v: float_output("y", scores, (8, 4), "[m, n]", finite=v),
    }
    for adapter in (ReferenceAdapter, MegatronGlobalBatchAdapter, TorchtitanAdapter):
        for flag in ("training", "grad", "recomputing", "replica"):
            calls[f"{adapter.__name__}.observe({flag})"] = (
                lambda v, adapter=adapter, flag=flag: adapter(4, 2).observe(scores, **{flag: v}))
    return calls


@pytest.mark.parametrize("call", sorted(kit_switch_calls()))
@pytest.mark.parametrize("value", ["false", 0, 1, None], ids=repr)
def test_a_kit_switch_is_a_real_boolean_or_refused_by_name(call, value):
    switch = call.split("(")[1].rstrip(")")
    with pytest.raises(TypeError, match=rf"^{switch} must be True or False, got {type(value).__name__}"):
        kit_switch_calls()[call](value)


@pytest.mark.parametrize("call", sorted(kit_switch_calls()))
def test_a_real_boolean_is_taken_by_every_kit_switch(call):
    if call.startswith("check_"):
        return  # a check runs for seconds: refusing "false" before it runs is what matters there
    for value in (True, False, np.True_, np.False_):
        kit_switch_calls()[call](value)


@pytest.mark.parametrize(("seed", "error"), [(1.5, TypeError), (True, TypeError), ("3", TypeError),
                                             (None, TypeError), (np.float64(2.0), TypeError), (-1, ValueError),
                                             (2**32, ValueError)])
def test_a_case_seed_is_an_integer_or_refused_by_name(seed, error):
    from refimpl.testing import hf_block_case

    text = {"hidden_size": 4, "num_experts": 4, "num_experts_per_token": 1, "moe_intermediate_size": 2}
    with pytest.raises(error, match="^seed must be an integer"):
        hf_block_case(text, seed)
    assert hf_block_case(text, np.int64(2**32 - 1)).seed == 2**32 - 1
