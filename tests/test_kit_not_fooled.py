"""`check_hf_moe_block` cannot be fooled, reports every difference, and spends its draws on the port.

Each port here is wrong in one way a real client has been (or is correct, where the point is that it passes):

* a forward that returns a stale output, one that drifts from its second call, a build that writes into what
  it was handed: each fails "one build answers every input", named;
* a port computing in float32 checked at float64: fails, saying it computes in float32, with the precision
  it achieved;
* a port with two catalogued differences at once: both are named, each with its own case;
* `pinned` keys stay fixed in every draw, and every result says how many cases it covered and declined;
* K3's cases mean K3's code: a null `num_shared_experts` hands no shared tensors (a strict port passes), and
  `MoEConfig.from_hf_config(text_config)` reads them as K3's code does.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference_block import build_block, planted
from hypothesis import given, settings

import refimpl
import refimpl.testing as kit
from refimpl.testing import CheckFailure, Unsupported, check_hf_moe_block, hf_block_case, hf_block_cases
from refimpl.testing.conventions import convention

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")

FEW = settings(kit.QUICK, max_examples=15)  # these ports fail on most cases; the tests are about the report


def _failure(build, **options) -> CheckFailure:
    options = {"mxfp4": False, "settings": FEW, **options}
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(build, **options)
    return info.value


def _violation(failure: CheckFailure, invariant: str):
    return next(v for v in failure.violations if v.invariant.name == invariant)


def refimpl_block(text_config, state_dict, *, compute=np.float64):
    """A port that is refimpl itself, read by refimpl's own default reader, computing in `compute`."""
    config = refimpl.MoEConfig.from_hf_config(text_config)  # the K3 cases name K3's code: no code= needed
    params = refimpl.params_from_hf_state_dict(state_dict, config)
    params = {name: np.asarray(value, dtype=compute) for name, value in params.items()}
    return lambda x: np.asarray(refimpl.stable_latent_moe(x.astype(compute), params, config), dtype=x.dtype)


# ---------------------------------------------------------------------------
# Not fooled
# ---------------------------------------------------------------------------

def stale(text_config, state_dict):
    """A forward that keeps its first answer and returns it for every later input."""
    forward, first = build_block(text_config, state_dict), []

    def cached(x):
        if not first:
            first.append(forward(x))
        return first[0]
    return cached


def drifting(text_config, state_dict):
    """A forward right on its first call and 1.5 x off from its second."""
    forward, calls = build_block(text_config, state_dict), [0]

    def drifts(x):
        calls[0] += 1
        return forward(x) * (1.0 if calls[0] == 1 else 1.5)
    return drifts


def test_a_stale_forward_fails_named_stale_output():
    failure = _failure(stale)
    assert failure.failed == ["one build answers every input"]  # a fresh build per case matches the reference
    assert _violation(failure, "one build answers every input").summary.startswith("stale output")
    assert "x_other" in str(failure)  # the second batch is printed, to reproduce it


def test_a_forward_that_drifts_from_its_second_call_fails_named_drift():
    failure = _failure(drifting)
    v = _violation(failure, "one build answers every input")
    assert v.summary.startswith("drift"), str(failure)
    assert any("1.5 x " in line for line in v.details), v.details


def test_a_build_that_writes_into_its_state_dict_or_text_config_fails_naming_it():
    def pops(text_config, state_dict):
        forward = build_block(text_config, state_dict)
        state_dict.pop("gate.weight")
        return forward

    def rewrites_config(text_config, state_dict):
        forward = build_block(text_config, state_dict)
        text_config["num_experts_per_token"] = text_config["num_experts_per_token"] + 0.5
        return forward

    def later(text_config, state_dict):  # keeps the state dict and zeroes the router when forward runs
        forward = build_block(text_config, state_dict)

        def run(x):
            y = forward(x)
            state_dict["gate.weight"][...] = 0
            return y
        return run

    for build, name in [(pops, "state_dict"), (rewrites_config, "text_config")]:
        failure = _failure(build)
        assert failure.failed == ["builds and runs"]
        assert f"wrote into its input {name}" in failure.violations[0].summary
    failure = _failure(later)
    assert failure.failed == ["one build answers every input"]
    assert "wrote into state_dict later" in failure.violations[0].summary


def test_a_port_computing_in_float32_fails_the_float64_check_saying_so():
    def in_float32(text_config, state_dict):
        return refimpl_block(text_config, state_dict, compute=np.float32)

    check_hf_moe_block(in_float32, settings=FEW, mxfp4=False)  # a float32 port passes the float32 check
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(in_float32, dtype=np.float64, settings=FEW, mxfp4=False)
    failure = info.value
    v = _violation(failure, "matches the reference block")
    assert "computes in float32, not in the float64 it was asked for" in v.summary
    assert v.conventions == ["computed_in_float32"]
    assert any(line.startswith("precision achieved:") and "within float32's tolerance" in line for line in v.details)
    # The next round holds it at float32's tolerance: it passes there, so no other difference is reported.
    assert "matches the reference block, with float32 precision scoped out" in failure.passed


def test_a_float64_port_passes_the_float64_check():
    check_hf_moe_block(refimpl_block, dtype=np.float64, settings=FEW, mxfp4=False)


# ---------------------------------------------------------------------------
# Every difference
# ---------------------------------------------------------------------------

def test_a_port_with_two_differences_gets_both_names_each_with_its_case():
    failure = _failure(planted("scale_applied_twice", "latent_norm_dropped"))
    rounds = [v for v in failure.violations if v.invariant.name.startswith("matches the reference block")]
    named = [name for v in rounds for name in v.conventions]
    assert {"scale_applied_twice", "latent_norm_dropped"} <= set(named), str(failure)
    assert len(rounds) >= 2 and all(str(v.inputs["case"]).startswith("refimpl.testing.hf_block_case(") for v in rounds)
    report = str(failure)
    assert "Distinct differences named:" in report
    for name in ("scale_applied_twice", "latent_norm_dropped"):
        assert f"- {convention(name).describe()}" in report


def test_a_port_with_one_difference_gets_one_name_and_the_assumed_round_passes():
    failure = _failure(planted("scale_applied_twice"))
    assert failure.failed == ["matches the reference block"]
    assert "matches the reference block, with scale_applied_twice assumed" in failure.passed
    assert failure.coverage["matches the reference block, with scale_applied_twice assumed"].covered >= 10


# ---------------------------------------------------------------------------
# Draws spent on the port
# ---------------------------------------------------------------------------

PINNED = {"hidden_act": "situ", "latent_moe_use_norm": True, "routed_expert_hidden_size": 3,
          "num_shared_experts": 1}


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(hf_block_cases(pinned=PINNED))
def test_pinned_keys_keep_their_values_in_every_draw(case):
    assert {key: case.text_config[key] for key in PINNED} == PINNED
    assert case.config.use_latent_norm and case.config.latent_size == 3 and case.config.activation == "situ"


def test_a_narrow_port_with_its_keys_pinned_is_covered_and_the_result_says_how_much():
    def narrow(text_config, state_dict):  # covers SiTU with the latent norm and one shared expert only
        if any(text_config.get(key) != value for key, value in PINNED.items()):
            raise Unsupported("this port has SiTU, the latent norm and one shared expert only")
        return build_block(text_config, state_dict)

    result = check_hf_moe_block(narrow, pinned=PINNED, settings=FEW, mxfp4=False)
    assert result.declined == 0 and result.covered >= 15 * 3
    assert "cases covered, 0 declined" in str(result)
    unpinned = _failure(narrow)  # without the pins, nearly every draw is declined
    assert unpinned.coverage["builds and runs"].declined > 0
    assert "declined in all" in str(unpinned)


def test_pinned_must_map_key_names():
    with pytest.raises(TypeError, match="pinned"):
        check_hf_moe_block(build_block, pinned=["hidden_act"])
    with pytest.raises(TypeError, match="pinned"):
        check_hf_moe_block(build_block, pinned={1: "situ"})


# ---------------------------------------------------------------------------
# K3's cases mean K3's code
# ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(hf_block_cases())
def test_the_k3_cases_read_as_k3_through_the_default_reader(case):
    assert refimpl.MoEConfig.from_hf_config(case.text_config) == case.config


def test_a_null_shared_count_hands_no_shared_tensors_and_a_strict_port_passes():
    text = {"model_type": "kimi_linear", "auto_map": dict(kit.hf_cases.K3_AUTO_MAP), "hidden_size": 6,
            "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 3, "num_shared_experts": None}
    case = hf_block_case(text, seed=3)
    assert not [name for name in case.state_dict if name.startswith("shared_experts.")]
    y = build_block(text, case.state_dict)(case.x)  # strict load: no shared module, no shared tensors
    np.testing.assert_allclose(y, case.expected(), rtol=1e-5, atol=1e-6)
    zero = hf_block_case(dict(text, num_shared_experts=0), seed=3)  # 0: a width-0 module, zero-element tensors
    assert zero.state_dict["shared_experts.gate_proj.weight"].shape == (0, 6)
    check_hf_moe_block(build_block, pinned={"num_shared_experts": None}, settings=FEW, mxfp4=False)


@pytest.mark.parametrize(("keyword", "value"), [("seed", 1.5), ("seed", True), ("seed", "3"), ("batch", 0.5),
                                                ("mxfp4", "false"), ("mxfp4", 0)])
def test_a_case_takes_only_integer_seeds_and_real_booleans(keyword, value):
    text = {"hidden_size": 4, "num_experts": 4, "num_experts_per_token": 1, "moe_intermediate_size": 2}
    arguments = {"seed": 1, keyword: value}
    with pytest.raises((TypeError, ValueError), match=keyword):
        hf_block_case(text, **arguments)


def test_the_check_takes_only_a_real_boolean_for_mxfp4():
    with pytest.raises(TypeError, match="mxfp4"):
        check_hf_moe_block(build_block, mxfp4="false")


# ---------------------------------------------------------------------------
# The catalogue's new entries, each planted in the PyTorch block and named
# ---------------------------------------------------------------------------

NORM = {"latent_moe_use_norm": True}


@pytest.mark.parametrize(("mistake", "pinned"), [
    ("norm_after_up_projection", {**NORM, "hidden_size": 6, "routed_expert_hidden_size": 6}),
    ("norm_eps_other", NORM),
    ("router_in_bfloat16", {}),
    ("experts_summed_in_bfloat16", {}),
])
def test_a_new_catalogue_entry_planted_is_named(mistake, pinned):
    failure = _failure(planted(mistake), pinned=pinned, settings=settings(kit.QUICK, max_examples=40))
    named = [name for v in failure.violations for name in v.conventions]
    assert mistake in named, str(failure)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(hf_block_cases(model_type="deepseek_v3", pinned={"n_group": 2, "topk_group": 1, "norm_topk_prob": False}))
def test_pinned_keys_hold_for_a_family_too(case):
    assert (case.text_config["n_group"], case.text_config["topk_group"]) == (2, 1)
    assert (case.config.n_group, case.config.topk_group, case.config.renormalize) == (2, 1, False)
