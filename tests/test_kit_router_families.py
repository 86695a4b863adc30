"""`check_router(fn, model_type=...)`: a family's router checked at the router level, with transformers' own.

* transformers' real `Qwen3MoeTopKRouter`, `MixtralTopKRouter` and `DeepseekV3TopkRouter`, behind the adapter a
  porter writes (an identity gate weight: the logits go in as hidden states), pass their family's check;
* a softmax family draws no bias, a family with groups draws them, and each family's rule on a single weight is
  held (DeepSeek-V3 renormalizes it; K3's code does not);
* planted mistakes fail with the invariant named: groups masked with 0, a DeepSeek top-1 weight kept raw, a
  Qwen3 router that ignores `norm_topk_prob`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

import refimpl.testing as kit
from refimpl.families import FAMILIES
from refimpl.testing import CheckFailure, check_router
from refimpl.testing.router_check import family_router_cases

FEW = settings(kit.QUICK, max_examples=25)

ROUTERS = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeTopKRouter), "mixtral": (MixtralConfig, MixtralTopKRouter),
           "deepseek_v3": (DeepseekV3Config, DeepseekV3TopkRouter)}


def transformers_router(model_type: str, *, masked_with=float("-inf"), norm_topk_prob=None):
    """The adapter a porter writes around transformers' router: logits in as hidden states, identity gate."""
    config_class, router_class = ROUTERS[model_type]

    def fn(logits, bias, text_config):
        keys = dict(text_config)
        if norm_topk_prob is not None:
            keys["norm_topk_prob"] = norm_topk_prob  # a planted misreading of the key
        router = router_class(config_class(**keys))
        n = logits.shape[1]
        with torch.no_grad():
            router.weight.copy_(torch.eye(n))
            if bias is not None:
                router.e_score_correction_bias.copy_(torch.from_numpy(bias))
            if masked_with != float("-inf"):  # a planted mistake: dropped groups masked with another value
                original = torch.Tensor.masked_fill

                def masked_fill(self, mask, value):
                    return original(self, mask, masked_with if value == float("-inf") else value)
                torch.Tensor.masked_fill = masked_fill
            try:
                out = router(torch.from_numpy(logits))
            finally:
                if masked_with != float("-inf"):
                    torch.Tensor.masked_fill = original
        _, weights, index = out  # (router_logits, weights, indices) for all three
        return index.numpy(), weights.float().numpy()

    return fn


@pytest.mark.parametrize("model_type", sorted(ROUTERS))
def test_transformers_own_router_passes_its_familys_check(model_type):
    result = check_router(transformers_router(model_type), model_type=model_type, settings=FEW)
    assert "weights from raw scores" in result.passed
    if model_type == "deepseek_v3":
        assert "experts only from the chosen groups" in result.passed
        assert "bias-shift invariance" in result.passed
    else:
        assert "bias-shift invariance" not in result.passed  # a softmax family has no selection bias
        assert "selection is the top-k of s" in result.passed
    assert result.covered > 0 and "cases covered" in str(result)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "nemotron_h"])
@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(data=__import__("hypothesis").strategies.data())
def test_the_drawn_routers_follow_the_family(model_type, data):
    case = data.draw(family_router_cases(model_type))
    family = FAMILIES[model_type]
    assert (case.bias is None) == (not family.has_bias)
    assert case.logits.dtype == np.float32 and case.logits.shape == (case.m, case.text_config["hidden_size"])
    index, weights = case.reference()
    assert index.shape == (case.m, case.config.top_k)


def test_groups_are_drawn_where_the_family_has_them():
    seen = set()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None)
    @given(family_router_cases("deepseek_v3"))
    def collect(case):
        seen.add((case.config.n_group, case.config.topk_group))
    collect()
    assert any(topk < groups for groups, topk in seen), seen


def test_dropped_groups_masked_with_zero_fail_the_group_invariant():
    with pytest.raises(CheckFailure) as info:
        check_router(transformers_router("deepseek_v3", masked_with=0.0), model_type="deepseek_v3",
                     settings=settings(kit.QUICK, max_examples=60))
    assert "experts only from the chosen groups" in info.value.failed, str(info.value)


def test_a_deepseek_router_that_keeps_a_single_weight_raw_fails_naming_the_rule():
    def k3_rule(logits, bias, text_config):  # K3's code: a single weight is not renormalized
        index, weights = transformers_router("deepseek_v3")(logits, bias, text_config)
        if index.shape[1] == 1:
            scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
            scale = text_config.get("routed_scaling_factor", 2.5)
            weights = (np.take_along_axis(scores, index, axis=1) * scale).astype(np.float32)
        return index, weights

    with pytest.raises(CheckFailure) as info:
        check_router(k3_rule, model_type="deepseek_v3", settings=settings(kit.QUICK, max_examples=80))
    failure = info.value
    assert "weights from raw scores" in failure.failed
    assert "renormalizes the single weight" in str(failure)


def test_a_qwen3_router_that_ignores_norm_topk_prob_fails():
    with pytest.raises(CheckFailure) as info:
        check_router(transformers_router("qwen3_moe", norm_topk_prob=True), model_type="qwen3_moe", settings=FEW)
    assert "weights from raw scores" in info.value.failed


def test_a_router_check_refuses_an_unknown_family_and_a_tie_order_with_a_family():
    with pytest.raises(ValueError, match="model_type"):
        check_router(lambda *a: None, model_type="llama")
    with pytest.raises(ValueError, match="tie_order"):
        check_router(lambda *a: None, model_type="qwen3_moe", tie_order="lower_id")
