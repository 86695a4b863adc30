"""K3 in transformers' fused layout: the converters against a literal build of the draft `kimi_k3` block.

`tests/k3_draft_block.py` builds the draft's `KimiK3MoE` on transformers 5.24's own router, experts loop and
RMSNorm. The converters' `model_type="kimi_k3"` names must load into it with `strict=True`, read back from its
`state_dict()` to the same weights, and compute the layer refimpl computes: equal within the draft's float32
rounding (its router, and its SiTU-GLU, which it computes in float32 even in a float64 block).

One real difference remains, and is asserted as such: the draft routes with DeepSeek-V3's router, which divides
the chosen weights by their sum even when there is only one (`num_experts_per_tok = 1` gives every token the
weight `routed_scaling_factor`); K3's code keeps a single expert's raw score.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from k3_draft_block import draft_block
from safetensors.numpy import save_file

import refimpl
from refimpl.checkpoints import hf_state_dict_from_params, params_from_hf_state_dict

U32 = float(np.finfo(np.float32).eps) / 2  # float32's unit roundoff


@st.composite
def k3_layers(draw, top_k=None):
    """A small K3 layer (latent, norm, SiTU, sigmoid scores with a bias) and a seed for its weights."""
    groups = draw(st.sampled_from([(1, 1), (4, 2), (2, 1)]))
    k = draw(st.integers(2, 4) if top_k is None else top_k)
    config = refimpl.MoEConfig(
        hidden_size=32, latent_size=16, num_experts=16, top_k=k, intermediate_size=draw(st.sampled_from([8, 12])),
        num_shared_experts=draw(st.integers(0, 2)), situ_linear_beta=draw(st.sampled_from([25.0, None, 2.0])),
        situ_beta=draw(st.sampled_from([4.0, 1.5])), routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        renormalize=draw(st.booleans()) if k > 1 else False, n_group=groups[0], topk_group=groups[1],
        num_moe_layers=1)
    return config, draw(st.integers(0, 2**16))


def _weights(config: refimpl.MoEConfig, seed: int) -> refimpl.MoEParams:
    """Weights at a scale where the activation's caps are reached, biases far from zero, a gain not one."""
    params = refimpl.init_params(config, seed, dtype=np.float64, bias_scale=0.3)
    rng = np.random.default_rng(seed)
    params["gate.e_score_correction_bias"] = params["gate.e_score_correction_bias"] - 20.0
    params["routed_expert_norm.weight"] = 1.0 + 0.3 * rng.standard_normal(config.latent_size)
    for name in ("experts.w1", "experts.w3"):
        params[name] = 3.0 * params[name]
    return params


def _loaded(config: refimpl.MoEConfig, params: refimpl.MoEParams) -> torch.nn.Module:
    block = draft_block(config)
    state = hf_state_dict_from_params(params, config, model_type="kimi_k3")
    block.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()}, strict=True)
    return block


def _draft_output(block: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return block(torch.from_numpy(x)[None])[0].numpy()  # [m, d]


def _bound(x: np.ndarray, params, y: np.ndarray) -> float:
    """The draft's float32 rounding carried through the output: the router's logits and the SiTU-GLU."""
    d = x.shape[1]
    # The float32 logits are off by (d + 2) u |x| |W|, which moves each score and mixture weight by a few times
    # that; the SiTU-GLU in float32 is off by a few u of each activation (its inputs rounded, tanh, sigmoid and
    # three products): both move the output by that times its own size, and the latent norm keeps the ratio.
    dz = (d + 2) * U32 * float((np.abs(x) @ np.abs(params["gate.weight"]).T).max())
    return 8 * (dz + 8 * U32) * (1 + float(np.abs(y).max()))


@settings(max_examples=25)
@given(k3_layers())
@example((refimpl.MoEConfig(hidden_size=32, latent_size=16, num_experts=16, top_k=4, intermediate_size=8,
                            num_shared_experts=0, n_group=4, topk_group=2, num_moe_layers=1), 0))
def test_the_draft_block_loads_the_kimi_k3_names_strictly_and_computes_refimpls_layer(case):
    config, seed = case
    params = _weights(config, seed)
    block = _loaded(config, params)
    x = np.random.default_rng(seed + 1).standard_normal((24, config.hidden_size))
    y_draft = _draft_output(block, x)
    y = refimpl.stable_latent_moe(x, params, config)
    assert np.abs(y - y_draft).max() <= _bound(x, params, y_draft)


@settings(max_examples=10)
@given(k3_layers())
def test_the_draft_blocks_own_state_dict_reads_back_as_the_same_weights(case):
    config, seed = case
    params = _weights(config, seed)
    block = _loaded(config, params)
    read = params_from_hf_state_dict(block.state_dict(), config, model_type="kimi_k3", dtype=np.float64)
    assert list(read) == list(params)
    for name, value in params.items():
        np.testing.assert_array_equal(read[name], value, err_msg=name)


@settings(max_examples=10)
@given(k3_layers(top_k=st.just(1)))
def test_with_one_expert_the_draft_renormalizes_its_weight_where_k3_keeps_the_raw_score(case):
    """The one difference: the draft's single weight is `routed_scaling_factor`, K3's is that times the score.

    A K3 file of a top-1 layer says `moe_renormalize: true` (the default), which K3's code ignores for a single
    expert and the draft's DeepSeek-V3 router obeys. K3's latent norm divides a token's one weight out again
    but for its epsilon: the outputs differ where the latent sum is small against the epsilon, as it is here
    (the experts' down matrices scaled by 1e-3).
    """
    config, seed = case
    params = _weights(config, seed)
    params["experts.w2"] = 1e-3 * params["experts.w2"]
    block = draft_block(config, norm_topk_prob=True)
    state = hf_state_dict_from_params(params, config, model_type="kimi_k3")
    block.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()}, strict=True)
    x = np.random.default_rng(seed + 1).standard_normal((24, config.hidden_size))
    y_draft = _draft_output(block, x)
    ours = refimpl.stable_latent_moe(x, params, config, return_intermediates=True)
    renormalized = np.full_like(ours.weights, config.routed_scaling_factor)  # [m, 1]: s / s, scaled
    y_renormalized = refimpl.stable_latent_moe(x, params, config, routing=(ours.index, renormalized))
    bound = _bound(x, params, y_draft)
    assert np.abs(y_renormalized - y_draft).max() <= bound
    # ... and that is a real difference from K3's layer, far above the rounding.
    assert np.abs(ours.y - y_draft).max() > 100 * bound


def test_a_folder_in_the_drafts_layout_reads_with_load_hf_layer(tmp_path):
    """K3's configuration with the block's tensors under `model.layers.{L}.mlp.`, fused: one call reads it."""
    config = refimpl.MoEConfig(hidden_size=32, latent_size=16, num_experts=16, top_k=4, intermediate_size=8,
                               num_shared_experts=1, n_group=4, topk_group=2, num_moe_layers=3)
    params = _weights(config, 3)
    layer = 2
    state = hf_state_dict_from_params(params, config, model_type="kimi_k3", layer=layer)
    assert all(name.startswith(f"model.layers.{layer}.mlp.") for name in state)
    assert {f"model.layers.{layer}.mlp.experts.gate_up_proj", f"model.layers.{layer}.mlp.experts.down_proj"} <= set(state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config(nested=True)))
    read_config, read = refimpl.load_hf_layer(tmp_path, layer, dtype=np.float64)
    assert read_config == config
    for name, value in params.items():
        got = np.stack(list(read[name])) if name.startswith("experts.") else read[name]
        np.testing.assert_array_equal(got, value, err_msg=name)
    with pytest.raises(ValueError, match="layer 0 is a dense layer"):
        refimpl.load_hf_layer(tmp_path, 0)
