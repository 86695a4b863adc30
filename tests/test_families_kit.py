"""`check_hf_moe_block(build, model_type=...)`: the kit for every MoE family of transformers.

* **A literal build of a correct block passes**: for each family, the ten lines a porter would paste (the
  model's own configuration class from the drawn keys, its own block class, a strict load), run on
  transformers' real block;
* **planted mistakes fail and are named**: transformers' blocks with one convention changed;
* **a port may decline** what it does not cover with `Unsupported`, and is told when too little was covered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from test_families import BLOCKS  # each family's transformers configuration class and MoE block
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from refimpl import MoEConfig
from refimpl.families import FAMILIES
from refimpl.testing import CheckFailure, Unsupported, check_hf_moe_block, hf_block_cases

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")


def literal_build(model_type: str):
    """The build a porter pastes: the model's config class, its block class, a strict load."""
    config_class, block_class = BLOCKS[model_type]

    def build(text_config, state_dict):
        block = block_class(config_class(**text_config)).eval()
        block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
        return lambda x: block(torch.from_numpy(x)[None])[0].detach().numpy()

    return build


@pytest.mark.parametrize("model_type", sorted(BLOCKS))
def test_a_literal_build_of_the_real_block_passes(model_type):
    result = check_hf_moe_block(literal_build(model_type), model_type=model_type, settings="quick")
    shift = ["unchanged when every bias shifts by one constant"] if FAMILIES[model_type].has_bias else []
    assert result.passed == ["builds and runs", "one build answers every input", "matches the reference block", *shift]


@pytest.mark.parametrize("model_type", sorted(BLOCKS))
@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(data=__import__("hypothesis").strategies.data())
def test_the_drawn_keys_build_the_models_own_config_and_the_layer_it_computes(model_type, data):
    case = data.draw(hf_block_cases(model_type=model_type, max_tokens=2))
    config_class, block_class = BLOCKS[model_type]
    hf = config_class(**case.text_config)
    assert hf.model_type == model_type
    assert MoEConfig.from_hf_config(hf.to_dict()) == case.config
    block = block_class(hf)
    assert set(block.state_dict()) == set(case.state_dict)  # the tensors the block holds, no more, no fewer
    if not FAMILIES[model_type].has_bias:
        assert not case.params64["gate.e_score_correction_bias"].any()


def _planted(model_type: str, change):
    """A literal build whose configuration keys are changed by `change` before the block is built."""
    config_class, block_class = BLOCKS[model_type]

    def build(text_config, state_dict):
        block = block_class(config_class(**change(dict(text_config)))).eval()
        block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
        return lambda x: block(torch.from_numpy(x)[None])[0].detach().numpy()

    return build


def test_qwen3_with_norm_topk_prob_read_the_other_way_is_caught_and_named():
    build = _planted("qwen3_moe", lambda t: dict(t, norm_topk_prob=not t.get("norm_topk_prob", False)))
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(build, model_type="qwen3_moe", settings="quick")
    mismatch = [v for v in info.value.violations if v.invariant.name == "matches the reference block"]
    assert mismatch and "renormalization_flipped" in mismatch[0].conventions
    assert "model_type='qwen3_moe'" in str(info.value)  # the pasteable case rebuilds the family's tensors


def test_deepseek_v3_with_the_scaling_factor_dropped_is_caught_and_named():
    build = _planted("deepseek_v3", lambda t: dict(t, routed_scaling_factor=1.0))
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(build, model_type="deepseek_v3", settings="quick")
    mismatch = [v for v in info.value.violations if v.invariant.name == "matches the reference block"]
    assert mismatch and "scale_never_applied" in mismatch[0].conventions


def test_a_port_declines_what_it_does_not_cover_and_still_passes_on_the_rest():
    real = literal_build("deepseek_v3")

    def build(text_config, state_dict):
        if text_config.get("n_group", 8) > 1:
            raise Unsupported("no group-limited routing in this port")
        return real(text_config, state_dict)

    result = check_hf_moe_block(build, model_type="deepseek_v3", settings="quick")
    assert result.passed == ["builds and runs", "one build answers every input", "matches the reference block",
                             "unchanged when every bias shifts by one constant"]


def test_a_port_that_declines_everything_is_told_it_covered_too_little():
    def build(text_config, state_dict):
        raise Unsupported("nothing yet")

    with pytest.raises(CheckFailure, match=r"declined with refimpl\.testing\.Unsupported"):
        check_hf_moe_block(build, model_type="mixtral", settings="quick")


def test_an_unknown_family_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"model_type must be one of .*got 'llama4'"):
        check_hf_moe_block(lambda t, s: None, model_type="llama4")


def test_the_case_a_report_prints_rebuilds_the_familys_tensors():
    from refimpl.testing import hf_block_case

    text = {"model_type": "glm4_moe", "hidden_size": 4, "n_routed_experts": 4, "moe_intermediate_size": 2,
            "num_hidden_layers": 1, "first_k_dense_replace": 0, "num_experts_per_tok": 1}
    case = hf_block_case(text, 3, tokens=2, model_type="glm4_moe", bias_offset=-20.0)
    assert set(case.state_dict) == {"gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj",
                                    "experts.down_proj", "shared_experts.gate_proj.weight",
                                    "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"}
    assert (case.state_dict["gate.e_score_correction_bias"] < -19).all()
    y = literal_build("glm4_moe")(text, case.state_dict)(case.x)
    np.testing.assert_allclose(y, case.expected(), rtol=2**-16, atol=2**-16 * np.abs(case.expected()).max())
    with pytest.raises(ValueError, match="mxfp4=True is K3's packed layout"):
        hf_block_case(text, 3, model_type="glm4_moe", mxfp4=True)


def test_the_pages_deepseek_v3_example_passes_as_written():
    """The example on the kit's page, run as written (transformers' block standing in for the port)."""
    import re

    from refimpl.testing import hf_block_check

    code = re.search(r"```python\n(import torch\nfrom transformers import DeepseekV3Config.*?)```",
                     hf_block_check.__doc__, re.S).group(1)
    exec(code, {})


# ---------------------------------------------------------------------------
# Two mistakes that shipped in real routers, planted in transformers' own DeepSeek-V3 router
# ---------------------------------------------------------------------------

def _router_forward(router, hidden_states, *, bias_dtype=torch.float32, masked_value=float("-inf")):
    """DeepseekV3TopkRouter's forward as transformers 5.24 writes it, with the bias dtype and the mask value
    as parameters (the defaults are transformers' own)."""
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states.float(), router.weight.float())
    scores = logits.sigmoid()
    choice = scores + router.e_score_correction_bias.to(bias_dtype).float()
    per_group = router.num_experts // router.num_group
    group_scores = choice.view(-1, router.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, router.num_group, per_group).reshape(-1, router.num_experts)
    choice = choice.masked_fill(~score_mask.bool(), masked_value)
    index = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * router.routed_scaling_factor, index


def _deepseek_v3_with_router(**mistake):
    """The literal DeepSeek-V3 build, its router's forward replaced by `_router_forward(..., **mistake)`."""
    def build(text_config, state_dict):
        block = DeepseekV3MoE(transformers.DeepseekV3Config(**text_config)).eval()
        block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
        block.gate.forward = lambda h: _router_forward(block.gate, h, **mistake)
        return lambda x: block(torch.from_numpy(x)[None])[0].detach().numpy()

    return build


def test_the_router_transcription_is_transformers_own():
    """With transformers' dtype and mask, the transcription passes: the planted builds differ in one thing only."""
    result = check_hf_moe_block(_deepseek_v3_with_router(), model_type="deepseek_v3", settings="quick")
    assert "unchanged when every bias shifts by one constant" in result.passed


def test_a_bias_kept_in_bfloat16_is_caught_by_the_bias_shift_and_named():
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(_deepseek_v3_with_router(bias_dtype=torch.bfloat16), model_type="deepseek_v3",
                           settings="quick")
    named = {name for v in info.value.violations for name in getattr(v, "conventions", [])}
    assert "bias_in_bfloat16" in named, str(info.value)


def test_dropped_groups_masked_with_zero_are_caught_and_named():
    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(_deepseek_v3_with_router(masked_value=0.0), model_type="deepseek_v3", settings="quick")
    named = {name for v in info.value.violations for name in getattr(v, "conventions", [])}
    assert "groups_masked_with_zero" in named, str(info.value)


def test_an_output_scaled_by_a_constant_is_reported_as_that_multiple():
    real = literal_build("mixtral")

    def build(text_config, state_dict):
        forward = real(text_config, state_dict)
        return lambda x: 2.5 * forward(x)

    with pytest.raises(CheckFailure, match=r"the block's output is 2\.5 x the reference's on every compared token"):
        check_hf_moe_block(build, model_type="mixtral", settings="quick")


@pytest.mark.parametrize("offset", [float("nan"), float("inf"), "3", True])
def test_a_bias_offset_that_is_not_a_finite_number_is_refused(offset):
    from refimpl.testing import hf_block_case

    with pytest.raises(ValueError, match=r"bias_offset must be a finite number, got"):
        hf_block_case({"hidden_size": 4, "num_experts": 2, "num_experts_per_token": 1, "moe_intermediate_size": 2},
                      0, bias_offset=offset)
