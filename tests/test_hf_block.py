"""Tests of `check_hf_moe_block` and its catalogue of convention differences.

The evidence, in the kit's usual three kinds:

* **Correct blocks pass**: the reference block as PyTorch modules
  (`tests/hf_reference_block.py`, itself checked here against the functional
  transcription `test_checkpoint.reference_block`), in float32 and bfloat16, and a
  wrapper of refimpl's own forward pass reading the tensors with
  `params_from_hf_state_dict`.
* **Planted mistakes fail, and the report names them**: each mistake is written
  into the PyTorch block, independently of the catalogue's NumPy variants; the
  check must fail, its report must print a case that reproduces the failure when
  pasted, and the catalogue entry of that mistake must be named.
* **The machinery keeps its promises**: cases are deterministic functions of their
  seed, their expected output is the per-token reference's, the strategies draw
  every switch of the reference code, the tolerance is what the page says.
"""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest
import torch
from hf_reference_block import KimiSparseMoeBlock, build_block, planted, to_torch
from hypothesis import given, settings
from test_checkpoint import reference_block

import refimpl
import refimpl.testing as kit
from refimpl.testing import CATALOGUE, CheckFailure, check_hf_moe_block, hf_block_case, hf_block_cases
from refimpl.testing.conventions import convention
from refimpl.testing.hf_block_check import reference_output
from refimpl.testing.hf_cases import GROWTH, tolerance

FEW = settings(kit.QUICK, max_examples=20)  # for properties whose failures show on most cases


def refimpl_block(text_config, state_dict):
    """A port that is refimpl itself: the config from the keys, the weights from the tensor names."""
    # The kit draws K3's keys; with every K3-only key absent they would read as transformers' Kimi Linear.
    config = refimpl.MoEConfig.from_hf_config(text_config, code="k3")
    params = refimpl.params_from_hf_state_dict(state_dict, config)
    return lambda x: refimpl.stable_latent_moe(x, params, config)


# ---------------------------------------------------------------------------
# The PyTorch reference block is the reference code
# ---------------------------------------------------------------------------

@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(hf_block_cases(max_tokens=5))
def test_the_module_block_equals_the_functional_transcription(case):
    text = case.text_config
    if text.get("moe_router_activation_func") == "softmax":
        text = dict(text, moe_router_activation_func="sigmoid")  # the functional one has sigmoid only
        case = hf_block_case(text, case.seed, tokens=case.tokens, activation_scale=case.activation_scale)
    tensors = {k: to_torch(v).float() for k, v in case.state_dict.items()}
    functional_text = dict(text)
    for key in ("num_expert_group", "topk_group"):  # the functional one reads them with .get(key, 1)
        functional_text.setdefault(key, 1)
    theirs = reference_block(functional_text, tensors, torch.from_numpy(case.x)).numpy()
    ours = build_block(text, case.state_dict)(case.x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6 * max(1.0, np.abs(theirs).max()))


# ---------------------------------------------------------------------------
# Correct blocks pass
# ---------------------------------------------------------------------------

def test_the_reference_block_passes():
    result = check_hf_moe_block(build_block)
    assert result.passed == ["builds and runs", "one build answers every input", "matches the reference block",
                             "unchanged when every bias shifts by one constant",
                             "matches the reference block with MXFP4 experts"]


def test_the_reference_block_passes_in_bfloat16():
    check_hf_moe_block(build_block, dtype=ml_dtypes.bfloat16, mxfp4=False, settings=FEW)


def test_refimpl_wrapped_as_a_port_passes():
    check_hf_moe_block(refimpl_block)
    check_hf_moe_block(refimpl_block, dtype=np.float64, mxfp4=False, settings=FEW)


# ---------------------------------------------------------------------------
# Planted mistakes fail, with a pasteable case and the mistake named
# ---------------------------------------------------------------------------

def _failure(build, **options) -> CheckFailure:
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(build, **options)
    return info.value


def _replay(report: str, build) -> float:
    """Paste the first case of `report` back: the largest error of `build` on it, relative to the largest |y|."""
    text_json = re.search(r"text_config = json\.loads\('(.*)'\)", report).group(1)
    call = re.search(r"case = (refimpl\.testing\.hf_block_case\(.*\))", report).group(1)
    text_config = json.loads(text_json)
    case = eval(call, {"refimpl": refimpl, "np": np, "ml_dtypes": ml_dtypes, "text_config": text_config})
    y, expected = build(text_config, case.state_dict)(case.x), case.expected()
    return float(np.max(np.abs(y - expected)) / np.max(np.abs(expected)))


# The six mistakes every port must be told apart, each against its catalogue entry.
DENSE_MISTAKES = ["bias_in_weights", "top1_renormalized", "scale_applied_twice", "up_cap_flipped",
                  "latent_norm_dropped", "groups_by_max"]


@pytest.mark.parametrize("mistake", DENSE_MISTAKES)
def test_a_planted_mistake_fails_and_is_named(mistake):
    failure = _failure(planted(mistake), mxfp4=False)
    # Weights from s + b also move when every bias shifts: that mistake breaks the shift invariant too.
    also = ["unchanged when every bias shifts by one constant"] if mistake == "bias_in_weights" else []
    assert failure.failed == ["matches the reference block", *also]
    violation = failure.violations[0]
    assert mistake in violation.conventions, str(failure)
    report = str(failure)
    assert f"- {convention(mistake).describe()}" in report
    assert _replay(report, planted(mistake)) > tolerance(np.float32)  # the pasted case still shows the mistake
    assert _replay(report, build_block) < tolerance(np.float32) / 4  # and the correct block passes on it


@pytest.mark.parametrize("mistake", ["mxfp4_nibbles_swapped", "e8m0_bias_125", "e8m0_as_e4m3"])
def test_a_planted_mxfp4_mistake_fails_only_on_packed_experts_and_is_named(mistake):
    failure = _failure(planted(mistake))
    assert failure.failed == ["matches the reference block with MXFP4 experts"]
    assert failure.violations[0].conventions == [mistake], str(failure)
    assert "mxfp4=True" in str(failure)


@pytest.mark.parametrize("mistake", ["silu_for_situ", "bf16_router", "scale_skipped_without_renormalization",
                                     "bias_subtracted", "gate_up_swapped", "shared_experts_dropped",
                                     "bias_on_logits"])
def test_other_catalogued_mistakes_are_named_too(mistake):
    failure = _failure(planted(mistake), mxfp4=False)
    assert mistake in failure.violations[0].conventions, str(failure)


def test_a_mistake_outside_the_catalogue_is_reported_without_a_name():
    def off_by_a_little(text_config, state_dict):
        forward = build_block(text_config, state_dict)
        return lambda x: forward(x) * 1.001

    failure = _failure(off_by_a_little, mxfp4=False, settings=FEW)
    assert failure.violations[0].conventions == []
    assert "catalogued convention differences that change this case's output reproduces it" in str(failure)
    assert "the closest" in str(failure)


def test_a_build_that_raises_or_a_wrong_shape_is_reported():
    def wrong_names(text_config, state_dict):
        block = KimiSparseMoeBlock(text_config)
        block.load_state_dict({k.replace("gate.", "router."): to_torch(v) for k, v in state_dict.items()})
        return lambda x: x

    failure = _failure(wrong_names, settings=FEW)
    assert failure.failed == ["builds and runs"]
    assert "the function raised RuntimeError" in str(failure) and "router.weight" in str(failure)
    failure = _failure(lambda text, sd: (lambda x: x[:, :1]), settings=FEW)
    assert "y must have the shape [m, d]" in str(failure)
    failure = _failure(lambda text, sd: None, settings=FEW)
    assert "must return a function forward(x)" in str(failure)


# ---------------------------------------------------------------------------
# Cases, strategies, tolerance
# ---------------------------------------------------------------------------

def test_a_case_is_a_function_of_its_seed_and_its_expected_output_is_the_reference():
    text = {"hidden_size": 8, "routed_expert_hidden_size": 4, "latent_moe_use_norm": True, "num_experts": 4,
            "num_experts_per_token": 2, "moe_intermediate_size": 3, "num_shared_experts": 1, "hidden_act": "situ"}
    a, b = hf_block_case(text, 7, tokens=3), hf_block_case(text, 7, tokens=3)
    assert sorted(a.state_dict) == sorted(b.state_dict)
    assert all(np.array_equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert not np.array_equal(hf_block_case(text, 8, tokens=3).x, a.x)
    assert np.any(a.params64["gate.e_score_correction_bias"] != 0)  # always a nonzero bias
    per_token = refimpl.stable_latent_moe_reference(a.x64, a.params64, a.config)
    np.testing.assert_allclose(a.expected(), per_token, rtol=1e-12, atol=1e-12)
    packed = hf_block_case(dict(text, hidden_size=64, routed_expert_hidden_size=32, moe_intermediate_size=32), 7,
                           mxfp4=True)
    assert packed.state_dict["experts.0.w1.weight_packed"].dtype == np.uint8
    bf16 = hf_block_case(text, 7, dtype=ml_dtypes.bfloat16)
    assert bf16.state_dict["gate.weight"].dtype == ml_dtypes.bfloat16
    assert bf16.state_dict["gate.e_score_correction_bias"].dtype == np.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        hf_block_case(text, 0, dtype=np.int32)


ALL_SWITCHES = {"latent", "no latent", "norm", "latent without norm", "situ", "swiglu", "capped up", "uncapped up",
                "beta 1", "beta 4", "sigmoid", "softmax", "top-1", "top-k", "groups", "scale", "no renormalization",
                "0 shared", "1 shared", "2 shared", "null shared", "large activations"}


def test_the_strategy_draws_every_switch_of_the_reference_code():
    seen: set[str] = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(hf_block_cases())
    def draw(case):
        c, t = case.config, case.text_config
        seen.update(name for name, present in [
            ("latent", c.use_latent_projection), ("no latent", not c.use_latent_projection),
            ("norm", c.use_latent_norm), ("latent without norm", c.use_latent_projection and not c.use_latent_norm),
            ("situ", c.activation == "situ"), ("swiglu", c.activation == "swiglu"),
            ("capped up", c.situ_linear_beta is not None), ("uncapped up", c.situ_linear_beta is None),
            ("beta 1", c.situ_beta == 1.0), ("beta 4", c.situ_beta == 4.0),
            ("sigmoid", c.score_function == "sigmoid"), ("softmax", c.score_function == "softmax"),
            ("top-1", c.k == 1), ("top-k", c.k > 1), ("groups", c.n_group > 1 and c.topk_group < c.n_group),
            ("scale", c.routed_scaling_factor != 1.0), ("no renormalization", c.k > 1 and not c.renormalize),
            ("0 shared", c.num_shared_experts == 0), ("1 shared", c.num_shared_experts == 1),
            ("2 shared", c.num_shared_experts == 2), ("null shared", t.get("num_shared_experts", 0) is None),
            ("large activations", case.activation_scale > 1)] if present)

    draw()
    assert seen == ALL_SWITCHES, f"never drawn: {ALL_SWITCHES - seen}"


def test_the_tolerance_follows_the_dtype():
    assert tolerance(np.float32) == GROWTH * 2.0**-24
    assert tolerance(np.float64) == GROWTH * 2.0**-53  # a float64 check asks for a float64 computation
    assert tolerance(ml_dtypes.bfloat16) == GROWTH * 2.0**-8
    assert tolerance(np.float16) == GROWTH * 2.0**-11
    with pytest.raises(ValueError, match="dtype must be one of"):
        check_hf_moe_block(build_block, dtype=np.int8)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_the_reference_block_stays_within_half_the_tolerance(dtype):
    """The margin the page promises: the correct block's error is at most half of the bound, on the drawn cases."""
    worst = [0.0]

    @settings(max_examples=100, deadline=None, derandomize=True, database=None)
    @given(hf_block_cases(dtype=dtype))
    def measure(case):
        y = build_block(case.text_config, case.state_dict)(case.x).astype(np.float64)
        out = refimpl.stable_latent_moe(case.x64, case.params64, case.config, return_intermediates=True)
        size = np.max(np.abs(out.y_shared) + np.abs(out.y_routed), axis=1)
        ratio = np.max(np.abs(y - out.y), axis=1) / (tolerance(dtype) * size)
        compared = reference_output(case).compared
        worst[0] = max(worst[0], float(np.max(ratio[compared], initial=0.0)))

    measure()
    print(f"largest error of the reference block: {worst[0]:.3f} of the tolerance")
    assert worst[0] <= 0.5


def test_every_catalogue_entry_runs_and_changes_some_case():
    names = [entry.name for entry in CATALOGUE]
    assert len(names) == len(set(names))
    text = {"hidden_size": 64, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "num_experts": 8,
            "num_experts_per_token": 2, "moe_intermediate_size": 32, "num_shared_experts": 1, "hidden_act": "situ",
            "activation_situ_linear_beta": 3.0, "routed_scaling_factor": 2.5, "moe_renormalize": False,
            "num_expert_group": 4, "topk_group": 2}
    cases = [hf_block_case(text, 1, tokens=8, activation_scale=6.0, mxfp4=True),
             hf_block_case(dict(text, latent_moe_use_norm=False), 3, tokens=8),
             hf_block_case(dict(text, hidden_size=32, num_shared_experts=None), 6, tokens=8),
             hf_block_case(dict(text, num_experts_per_token=1, latent_moe_use_norm=False, moe_renormalize=True), 2,
                           tokens=8),
             hf_block_case({"model_type": "deepseek_v3", "hidden_size": 8, "n_routed_experts": 8,
                            "num_experts_per_tok": 1, "moe_intermediate_size": 4, "n_group": 2, "topk_group": 1,
                            "num_hidden_layers": 1, "first_k_dense_replace": 0}, 4, tokens=8,
                           model_type="deepseek_v3", bias_offset=3.0),
             hf_block_case({"model_type": "deepseek_v3", "hidden_size": 8, "n_routed_experts": 8,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 4, "n_group": 4, "topk_group": 1,
                            "num_hidden_layers": 1, "first_k_dense_replace": 0}, 5, tokens=8,
                           model_type="deepseek_v3", bias_offset=-20.0)]
    for entry in CATALOGUE:
        changed = False
        for case in cases:
            if entry.applies(case):
                y = entry.output(case)
                assert y.shape == case.x.shape, entry.name
                changed |= not np.allclose(y, case.expected(), rtol=1e-6, atol=1e-6, equal_nan=False)
        assert changed, f"{entry.name} changed no case"
    with pytest.raises(ValueError, match="no catalogued convention"):
        convention("nope")


def test_the_catalogue_table_of_the_page_is_the_catalogue():
    """The table in the module's docstring (its page) lists every entry with its issue, in order."""
    from refimpl.testing import conventions

    rows = re.findall(r"^\| `(\w+)` \|[^|]*\|([^|]*)\|$", conventions.__doc__, flags=re.MULTILINE)
    assert [name for name, _ in rows] == [entry.name for entry in CATALOGUE]
    assert [issue.strip() for _, issue in rows] == [entry.issue or "" for entry in CATALOGUE]
