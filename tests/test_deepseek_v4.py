"""DeepSeek-V4's MoE block, held against transformers' own (5.24, pinned in the test extra).

`DeepseekV4SparseMoeBlock` differs from DeepSeek-V3's in four ways, each read
and computed here and compared with the real block in float64 (its router
computes in the block's dtype, so the two agree to float64's rounding):

* the experts and the shared expert clamp SwiGLU's branches, the gate to
  `min(a, swiglu_limit)` and the up branch to `[-swiglu_limit, swiglu_limit]`;
* the router scores with sqrt(softplus) and always renormalizes, scaled by
  `routed_scaling_factor` (1.5 by default);
* one shared expert of the routed width, whatever `n_shared_experts` says;
* the first layers (`mlp_layer_types == "hash_moe"`) take their experts from a
  stored table `gate.tid2eid` indexed by the token id.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts, DeepseekV4SparseMoeBlock

import refimpl
from refimpl import MoEConfig
from refimpl.checkpoints import hf_hash_table, hf_state_dict_from_params, params_from_hf_state_dict
from refimpl.layer.activations import expert_glu, expert_glu_and_grad

SMALL = dict(num_attention_heads=2, vocab_size=32)


def v4_config(**keys) -> transformers.DeepseekV4Config:
    return transformers.DeepseekV4Config(**{**SMALL, **keys})


# ---------------------------------------------------------------------------
# The clamped SwiGLU and its derivative
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [0.5, 3.0])
def test_the_clamped_swiglu_and_its_partials_are_transformers(limit):
    rng = np.random.default_rng(0)
    a, b = rng.normal(scale=2.0, size=(2, 64, 12))
    a[0, :3], b[0, :3] = limit, -limit  # the bounds themselves: PyTorch's clamp passes gradient there
    config = MoEConfig.tiny(activation="swiglu", situ_linear_beta=None, swiglu_limit=limit)
    hf = v4_config(hidden_size=8, n_routed_experts=2, moe_intermediate_size=12, swiglu_limit=limit)
    experts = DeepseekV4Experts(hf).double()
    ta, tb = torch.from_numpy(a).requires_grad_(), torch.from_numpy(b).requires_grad_()
    h_torch = experts._apply_gate(torch.cat([ta, tb], dim=-1))
    h_torch.sum().backward()
    np.testing.assert_allclose(expert_glu(a.copy(), b.copy(), config), h_torch.detach().numpy(), rtol=1e-14, atol=1e-15)
    h, d_gate, d_up = expert_glu_and_grad(a.copy(), b.copy(), config)
    np.testing.assert_allclose(h, h_torch.detach().numpy(), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(d_gate, ta.grad.numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(d_up, tb.grad.numpy(), rtol=1e-13, atol=1e-15)
    assert np.any(d_gate == 0) and np.any(d_up == 0)  # the clamp did cut some entries


def test_a_limit_needs_swiglu_and_has_no_k3_key():
    with pytest.raises(ValueError, match="swiglu_limit.*needs activation='swiglu'"):
        MoEConfig.tiny(swiglu_limit=10.0)
    with pytest.raises(ValueError, match="swiglu_limit"):
        MoEConfig.tiny(activation="swiglu", swiglu_limit=-1.0)
    with pytest.raises(ValueError, match="model_type 'deepseek_v4'"):
        MoEConfig.tiny(activation="swiglu", swiglu_limit=10.0).to_hf_config()


# ---------------------------------------------------------------------------
# The configuration, as DeepseekV4Config reads it
# ---------------------------------------------------------------------------

def test_a_default_configuration_reads_as_the_class_builds_it():
    config = MoEConfig.from_hf_config(v4_config().to_dict())
    assert config.replace(hidden_size=16, latent_size=16) == MoEConfig(
        hidden_size=16, latent_size=16, use_latent_projection=False, use_latent_norm=False, num_experts=256, top_k=6,
        intermediate_size=2048, num_shared_experts=1, activation="swiglu", situ_linear_beta=None,
        score_function="sqrtsoftplus", renormalize=True, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
        num_moe_layers=43, num_hash_layers=3, swiglu_limit=10.0)


@st.composite
def v4_keys(draw) -> dict:
    n = draw(st.sampled_from([4, 6, 8]))
    layers = draw(st.integers(1, 5))
    keys = {"hidden_size": draw(st.sampled_from([8, 12])), "n_routed_experts": n,
            "num_experts_per_tok": draw(st.integers(1, min(4, n - 1))),
            "moe_intermediate_size": draw(st.integers(2, 8)), "num_hidden_layers": layers}
    optional = {"routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
                "swiglu_limit": draw(st.sampled_from([0.4, 7.0])),
                "n_shared_experts": draw(st.integers(0, 3)),  # read by nothing in the block
                "norm_topk_prob": draw(st.booleans()),  # read by nothing in the block
                "mlp_layer_types": draw(st.lists(st.sampled_from(["hash_moe", "moe"]), min_size=layers,
                                                 max_size=layers))}
    keep = draw(st.sets(st.sampled_from(sorted(optional))))
    keys.update({k: v for k, v in optional.items() if k in keep})
    return keys


def expected(hf: transformers.DeepseekV4Config) -> MoEConfig:
    """The layer of a top-k block of `hf`, read from the constructed block's own attributes."""
    block = DeepseekV4SparseMoeBlock(hf, hf.mlp_layer_types.index("moe") if "moe" in hf.mlp_layer_types else 0)
    n, two_f, d = block.experts.gate_up_proj.shape
    return MoEConfig(
        hidden_size=d, latent_size=d, use_latent_projection=False, use_latent_norm=False, num_experts=n,
        top_k=block.gate.top_k, intermediate_size=two_f // 2,
        num_shared_experts=block.shared_experts.gate_proj.weight.shape[0] // (two_f // 2), activation="swiglu",
        situ_linear_beta=None, score_function="sqrtsoftplus", renormalize=True,
        routed_scaling_factor=block.gate.routed_scaling_factor, rms_norm_eps=hf.rms_norm_eps,
        num_moe_layers=len(hf.mlp_layer_types), num_hash_layers=hf.mlp_layer_types.count("hash_moe"),
        swiglu_limit=block.experts.limit)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(v4_keys())
def test_from_hf_config_of_a_drawn_configuration_is_the_layer_the_block_computes(keys):
    hf = v4_config(**keys)
    assert MoEConfig.from_hf_config(hf.to_dict()) == expected(hf)


def test_the_moe_layer_count_is_the_real_models_count_of_blocks():
    hf = v4_config(hidden_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                   num_hidden_layers=4, mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"])
    model = transformers.AutoModel.from_config(hf)
    blocks = [m for m in model.modules() if isinstance(m, DeepseekV4SparseMoeBlock)]
    config = MoEConfig.from_hf_config(hf.to_dict())
    assert config.num_moe_layers == len(blocks) == 4
    assert config.num_hash_layers == sum(block.is_hash for block in blocks) == 2


def test_bad_layer_kinds_and_score_functions_are_refused_by_name():
    good = v4_config(num_hidden_layers=2).to_dict()
    with pytest.raises(ValueError, match=r"mlp_layer_types.*'hash_moe' or 'moe'.*num_hidden_layers = 2"):
        MoEConfig.from_hf_config({**good, "mlp_layer_types": ["moe", "dense"]})
    with pytest.raises(ValueError, match=r"mlp_layer_types"):
        MoEConfig.from_hf_config({**good, "mlp_layer_types": ["moe"]})
    with pytest.raises(ValueError, match=r"scoring_func.*'sigmoid', 'sqrtsoftplus'.*'softmax'"):
        MoEConfig.from_hf_config({**good, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match=r"swiglu_limit"):
        MoEConfig.from_hf_config({**good, "swiglu_limit": 0})


# ---------------------------------------------------------------------------
# The block's forward against refimpl's, and the tensors both ways
# ---------------------------------------------------------------------------

def _filled_block(hf: transformers.DeepseekV4Config, layer: int, rng: np.random.Generator) -> DeepseekV4SparseMoeBlock:
    block = DeepseekV4SparseMoeBlock(hf, layer).double().eval()
    n, k = hf.n_routed_experts, hf.num_experts_per_tok
    with torch.no_grad():
        for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
            if name == "gate.tid2eid":  # k distinct experts for every token id
                tensor.copy_(torch.from_numpy(np.stack([rng.permutation(n)[:k] for _ in range(tensor.shape[0])])))
            elif name == "gate.e_score_correction_bias":
                tensor.copy_(torch.from_numpy(rng.uniform(-2.0, 2.0, tensor.shape)))
            else:
                tensor.copy_(torch.from_numpy(rng.standard_normal(tensor.shape) * (1.0 if name == "gate.weight" else 0.5)))
    return block


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(v4_keys(), st.integers(0, 2**32 - 1), st.integers(1, 8), st.data())
def test_the_blocks_forward_equals_refimpls_on_either_kind_of_layer(keys, seed, m, data):
    hf = v4_config(**keys)
    layer = data.draw(st.integers(0, hf.num_hidden_layers - 1))
    rng = np.random.default_rng(seed)
    block = _filled_block(hf, layer, rng)
    x = rng.standard_normal((1, m, hf.hidden_size))
    ids = rng.integers(0, hf.vocab_size, size=(1, m))
    with torch.no_grad():
        y_hf = block(torch.from_numpy(x), torch.from_numpy(ids)).numpy()[0]
    config = MoEConfig.from_hf_config(hf.to_dict())
    state = {name: t.numpy() for name, t in block.state_dict().items()}
    params = params_from_hf_state_dict(state, config, model_type="deepseek_v4", hash_layer=block.is_hash,
                                       dtype=np.float64)
    routing = None
    if block.is_hash:
        scores = refimpl.router_scores(x[0], params["gate.weight"], "sqrtsoftplus")
        routing = refimpl.route_by_table(scores, ids[0], hf_hash_table(state, config),
                                         scaling_factor=config.routed_scaling_factor)
    y = np.asarray(refimpl.stable_latent_moe(x[0], params, config, routing=routing))
    # float64 throughout on both sides (the router in the block's dtype): only the order of sums and the 1e-20
    # that transformers adds to each renormalizing sum differ.
    np.testing.assert_allclose(y, y_hf, rtol=1e-11, atol=1e-12 * (1 + np.abs(y_hf).max()))
    # and the state dict written back loads strictly into the block, equal tensor for tensor
    table = hf_hash_table(state, config) if block.is_hash else None
    written = hf_state_dict_from_params(params, config, model_type="deepseek_v4", tid2eid=table)
    fresh = DeepseekV4SparseMoeBlock(hf, layer).double()
    fresh.load_state_dict({name: torch.from_numpy(v) for name, v in written.items()}, strict=True)
    for name, tensor in block.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[name].numpy(), tensor.numpy(), err_msg=name)


def test_a_hash_layer_is_read_only_when_asked_and_its_table_is_checked():
    hf = v4_config(hidden_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
                   num_hidden_layers=4)  # layers 0-2 hash-routed, layer 3 top-k
    config = MoEConfig.from_hf_config(hf.to_dict())
    rng = np.random.default_rng(0)
    state = {n: t.numpy() for n, t in _filled_block(hf, 0, rng).state_dict().items()}
    with pytest.raises(ValueError, match="gate.tid2eid: a hash layer's table; read the layer with hash_layer=True"):
        params_from_hf_state_dict(state, config, model_type="deepseek_v4")
    with pytest.raises(ValueError, match=r"hash_layer=True reads the hash layers of \['deepseek_v4'\]"):
        params_from_hf_state_dict(state, config, model_type="deepseek_v3", hash_layer=True)
    topk_state = {n: t.numpy() for n, t in _filled_block(hf, 3, rng).state_dict().items()}
    with pytest.raises(ValueError, match="missing.*gate.tid2eid"):
        params_from_hf_state_dict(topk_state, config, model_type="deepseek_v4", hash_layer=True)
    with pytest.raises(ValueError, match="no hash-layer table gate.tid2eid"):
        hf_hash_table(topk_state, config)
    with pytest.raises(ValueError, match=r"gate.tid2eid must hold expert ids in \[0, 4\)"):
        hf_hash_table({**state, "gate.tid2eid": state["gate.tid2eid"] + 4}, config)
    with pytest.raises(ValueError, match=r"gate.tid2eid must be an integer table \[vocab, k=2\]"):
        hf_hash_table({**state, "gate.tid2eid": state["gate.tid2eid"].astype(np.float32)}, config)
    params = params_from_hf_state_dict(topk_state, config, model_type="deepseek_v4")
    with pytest.raises(ValueError, match="a hash layer, which routes by its table"):
        hf_state_dict_from_params(params, config, model_type="deepseek_v4", tid2eid=state["gate.tid2eid"])
    with pytest.raises(ValueError, match="pass model_type='deepseek_v4' too"):
        hf_state_dict_from_params(params, config, tid2eid=state["gate.tid2eid"])


def test_route_by_table_refuses_a_repeated_expert_and_a_token_outside_the_table():
    scores = np.full((2, 4), 0.5)
    table = np.array([[0, 1], [2, 2]])
    with pytest.raises(ValueError, match=r"tid2eid\[1\] = \[2, 2\] names an expert twice"):
        refimpl.route_by_table(scores, np.array([0, 1]), table)
    with pytest.raises(ValueError, match=r"token_ids must hold integers in \[0, 2\)"):
        refimpl.route_by_table(scores, np.array([0, 5]), table)
    index, weights = refimpl.route_by_table(scores, np.array([0, 0]), table, scaling_factor=1.5)
    np.testing.assert_array_equal(index, [[0, 1], [0, 1]])
    np.testing.assert_allclose(weights, 0.75)


# ---------------------------------------------------------------------------
# The kit, with DeepSeek-V4's keys and rules
# ---------------------------------------------------------------------------

def test_the_kits_literal_build_of_the_real_v4_block_passes():
    from refimpl.testing import check_hf_moe_block

    def build(text_config, state_dict):
        block = DeepseekV4SparseMoeBlock(transformers.DeepseekV4Config(**text_config), 0).eval()
        block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
        return lambda x: block(torch.from_numpy(x)[None]).detach().numpy()[0]

    result = check_hf_moe_block(build, model_type="deepseek_v4", settings="quick")
    assert result.passed == ["builds and runs", "one build answers every input", "matches the reference block",
                             "unchanged when every bias shifts by one constant"]


def test_the_kit_fails_a_v4_block_without_its_clamp():
    from refimpl.testing import CheckFailure, check_hf_moe_block

    def build(text_config, state_dict):
        unclamped = dict(text_config, swiglu_limit=1e9)
        block = DeepseekV4SparseMoeBlock(transformers.DeepseekV4Config(**unclamped), 0).eval()
        block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
        return lambda x: block(torch.from_numpy(x)[None]).detach().numpy()[0]

    with pytest.raises(CheckFailure) as info:
        check_hf_moe_block(build, model_type="deepseek_v4", settings="quick")
    assert "matches the reference block" in info.value.failed


def test_the_flash_preset_is_the_default_configuration_of_transformers():
    assert MoEConfig.deepseek_v4_flash() == MoEConfig.from_hf_config(v4_config().to_dict())


def test_a_table_that_names_an_expert_twice_in_a_row_is_never_written():
    """route_by_table refuses a row with a repeated expert; the writer refuses to write one, naming the row."""
    hf = v4_config(hidden_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
                   num_hidden_layers=4)
    config = MoEConfig.from_hf_config(hf.to_dict())
    params = refimpl.init_params(config, 0)
    table = np.array([[0, 1], [2, 2], [3, 0]])
    with pytest.raises(ValueError, match=r"tid2eid\[1\] = \[2, 2\] names an expert twice"):
        hf_state_dict_from_params(params, config, model_type="deepseek_v4", tid2eid=table)
    written = hf_state_dict_from_params(params, config, model_type="deepseek_v4", tid2eid=table[[0, 2]])
    np.testing.assert_array_equal(written["gate.tid2eid"], table[[0, 2]])
