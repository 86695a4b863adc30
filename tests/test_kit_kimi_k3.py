"""`check_hf_moe_block(build, model_type="kimi_k3")`: K3 in transformers' draft, held to K3's code's rules.

The port here is a literal build of the draft's block (`tests/k3_draft_block.py`: transformers 5.24's own
DeepSeek-V3 router, DeepSeek-V4 experts loop and RMSNorm, the draft's K3 lines transcribed), built the way a
porter would: the configuration class from the keys the kit hands (`DeepseekV3Config`, which the draft's
configuration class extends with the latent width and SiTU's two betas), the block class, a strict load.

* declining the top-1 cases (`Unsupported`), it passes, and the result says how many were covered and declined;
* without declining, its one difference is named: the draft's router renormalizes a single weight, K3's code
  keeps the raw score (`top1_renormalized`), and with that difference assumed the rest matches;
* where no case could tell the two apart (K3's latent norm divides a single weight out again but for its
  epsilon), a pass says so instead of claiming it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from k3_draft_block import KimiK3MoE
from transformers import DeepseekV3Config

import refimpl.testing as kit
from refimpl.families import record_of
from refimpl.testing import CheckFailure, Unsupported, check_hf_moe_block, hf_block_case, hf_block_cases
from refimpl.testing.hf_block_check import MATCHES
from refimpl.testing.hf_cases import draft_moe_config

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")

FEW = settings(kit.QUICK, max_examples=20)  # four or five invariants, each a draft block per case
TOP1 = "top_k = 1: the draft's DeepSeek-V3 router renormalizes a single weight, K3's code keeps it raw"


def draft_build(*, decline_top1: bool):
    """The build a porter of the draft pastes: its configuration class from the keys, its block, a strict load."""
    def build(text_config, state_dict):
        if decline_top1 and text_config["num_experts_per_tok"] == 1:
            raise Unsupported(TOP1)
        hf = DeepseekV3Config(**text_config)  # the draft's three keys become attributes, as its class holds them
        hf._experts_implementation = "eager"  # the experts' loop, which runs in any dtype
        block = KimiK3MoE(hf).to(torch.from_numpy(state_dict["gate.weight"]).dtype).eval()  # the dtype handed
        block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)

        def forward(x):
            with torch.no_grad():
                return block(torch.from_numpy(x)[None])[0].numpy()
        return forward
    return build


def test_the_draft_block_declining_top1_passes_kimi_k3():
    result = check_hf_moe_block(draft_build(decline_top1=True), model_type="kimi_k3", settings=FEW)
    print(result)
    assert result.passed == ["builds and runs", "one build answers every input", MATCHES,
                             "unchanged when every bias shifts by one constant"]
    matches = result.coverage[MATCHES]
    assert matches.covered == FEW.max_examples and matches.declined > 0  # top-1 cases were drawn and declined
    assert {reason for c in result.coverage.values() for reason in c.reasons} == {TOP1}
    assert f"{result.covered} cases covered, {result.declined} declined" in str(result)
    assert not result.notes  # no top-1 case was covered: there is nothing to say about a single weight


def test_the_draft_block_without_declining_is_named_top1_renormalized_and_matches_otherwise():
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(draft_build(decline_top1=False), model_type="kimi_k3", settings=FEW)
    failure = info.value
    print(failure)
    assert failure.failed == [MATCHES]
    (violation,) = failure.violations
    assert violation.conventions == ["top1_renormalized"]
    assert violation.case.config.top_k == 1 and violation.case.text_config.get("norm_topk_prob", True)
    # The round with the named difference assumed holds: the draft's block is K3's layer otherwise.
    assumed = f"{MATCHES}, with top1_renormalized assumed"
    assert assumed in failure.passed
    assert failure.coverage[assumed].scoped_out == 0 and failure.coverage[assumed].covered == FEW.max_examples


def test_where_no_case_can_tell_a_renormalized_single_weight_the_pass_says_so():
    """An epsilon far below every latent sum hides the difference: the check passes the draft and says it
    could not tell, rather than claiming a single weight is kept raw."""
    pinned = {"num_experts_per_tok": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-12}
    result = check_hf_moe_block(draft_build(decline_top1=False), model_type="kimi_k3", settings=FEW, pinned=pinned)
    print(result)
    assert MATCHES in result.passed
    (note,) = result.notes
    assert note.startswith("the check could not tell whether the block renormalizes a single weight")
    assert f"none of the {FEW.max_examples} top-1 cases covered" in note
    assert "note: the check could not tell" in str(result)


def test_where_the_epsilon_shows_the_single_weight_every_top1_case_tells_it():
    """An epsilon on the scale of the latent sums makes the single weight visible: the renormalizing draft
    fails on the first top-1 case, and a port that declines nothing but keeps the raw score passes, saying on
    how many cases it was told apart."""
    pinned = {"num_experts_per_tok": 1, "norm_topk_prob": True, "rms_norm_eps": 1.0}
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(draft_build(decline_top1=False), model_type="kimi_k3", settings=FEW, pinned=pinned)
    assert info.value.violations[0].conventions == ["top1_renormalized"]

    def raw_single_weight(text_config, state_dict):  # the draft, told that this top-1 file does not renormalize
        return draft_build(decline_top1=False)({**text_config, "norm_topk_prob": False}, state_dict)

    result = check_hf_moe_block(raw_single_weight, model_type="kimi_k3", settings=FEW, pinned=pinned)
    (note,) = result.notes
    assert note.startswith("a single weight kept raw, as K3's code does, was told apart from a renormalized one")
    assert f"on {FEW.max_examples} of the {FEW.max_examples} top-1 cases covered" in note


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_the_handed_keys_build_the_drafts_config_and_k3s_layer_from_it(data):
    """What `DeepseekV3Config(**text_config)` makes of the keys (its own defaults for absent ones) is the layer
    the kit expects, but for the single weight, which K3's code keeps raw; the block holds exactly the tensors
    handed over."""
    case = data.draw(hf_block_cases(model_type="kimi_k3", max_tokens=2))
    hf = DeepseekV3Config(**case.text_config)
    c = case.config
    assert (hf.hidden_size, hf.routed_expert_hidden_size, hf.n_routed_experts, hf.num_experts_per_tok,
            hf.moe_intermediate_size, hf.n_shared_experts, hf.n_group, hf.topk_group) == (
        c.hidden_size, c.latent_size, c.num_experts, c.top_k, c.intermediate_size, c.num_shared_experts, c.n_group,
        c.topk_group)
    assert (hf.routed_scaling_factor, hf.rms_norm_eps, hf.activation_situ_beta, hf.activation_situ_linear_beta) == (
        c.routed_scaling_factor, c.rms_norm_eps, c.situ_beta, c.situ_linear_beta)
    assert c.renormalize == (hf.norm_topk_prob and c.top_k > 1)
    assert (c.activation, c.use_latent_projection, c.use_latent_norm, c.score_function) == ("situ", True, True,
                                                                                           "sigmoid")
    block = KimiK3MoE(hf)
    assert {name: tuple(t.shape) for name, t in block.state_dict().items()} == {
        name: v.shape for name, v in case.state_dict.items()}


def test_the_case_a_report_prints_rebuilds_the_drafts_tensors():
    text = {"model_type": "kimi_k3", "n_routed_experts": 4, "hidden_size": 6, "moe_intermediate_size": 3,
            "num_hidden_layers": 1, "first_k_dense_replace": 0, "n_group": 2, "topk_group": 1,
            "num_experts_per_tok": 1, "routed_expert_hidden_size": 4, "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": None}
    case = hf_block_case(text, seed=3, tokens=2, model_type="kimi_k3")
    assert case.state_dict["experts.gate_up_proj"].shape == (4, 6, 4)  # [n, 2f, l], gate rows first
    assert case.state_dict["experts.down_proj"].shape == (4, 4, 3)  # [n, l, f]
    assert case.config.top_k == 1 and not case.config.renormalize  # K3's rule, whatever norm_topk_prob says
    assert case.config.routed_scaling_factor == DeepseekV3Config().routed_scaling_factor  # the class's default
    assert "model_type='kimi_k3'" in case.code()
    y = draft_build(decline_top1=False)(text, case.state_dict)(case.x)
    assert y.shape == (2, 6)


def test_the_drafts_keys_are_required_and_checked():
    family = record_of("kimi_k3")
    text = {"hidden_size": 6, "n_routed_experts": 4, "moe_intermediate_size": 3, "num_hidden_layers": 1,
            "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
            "routed_expert_hidden_size": 4, "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0}
    assert draft_moe_config(text, family).latent_size == 4
    with pytest.raises(ValueError, match=r"text_config\['routed_expert_hidden_size'\] is required"):
        draft_moe_config({k: v for k, v in text.items() if k != "routed_expert_hidden_size"}, family)
    with pytest.raises(ValueError, match=r"text_config\['activation_situ_beta'\] must be .*got -1"):
        draft_moe_config({**text, "activation_situ_beta": -1.0}, family)
    with pytest.raises(ValueError, match=r"text_config\['routed_expert_hidden_size'\] must be a positive integer"):
        draft_moe_config({**text, "routed_expert_hidden_size": 2.5}, family)
    with pytest.raises(ValueError, match="has no draft configuration class"):
        draft_moe_config(text, record_of("deepseek_v3"))


@pytest.mark.parametrize("model_type", ["kimi_k25", "kimi_k4"])
def test_a_model_type_the_check_does_not_draw_is_refused_naming_kimi_k3(model_type):
    with pytest.raises(ValueError, match=rf"model_type must be one of \[.*'kimi_k3'.*got '{model_type}'"):
        check_hf_moe_block(lambda t, s: None, model_type=model_type)
    with pytest.raises(ValueError, match="model_type must be one of"):
        hf_block_case({}, seed=0, model_type=model_type)


def test_float64_holds_the_draft_to_float64_and_says_it_computes_in_float32():
    """The draft's router and SiTU-GLU compute in float32 even in a float64 block: checked as float64, it fails
    for that, with the precision it achieved."""
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(draft_build(decline_top1=True), model_type="kimi_k3", settings=settings(FEW, max_examples=10),
                           dtype=np.float64)
    assert "computes in float32, not in the float64 it was asked for" in str(info.value)
