"""Tests of `MoEConfig`: the K3 numbers, presets, validation and the Hugging Face keys of SPEC §0."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refimpl.config import HF_KEYS, MoEConfig

# SPEC §0, typed in from the table: HF key -> K3 value.
K3_HF = {
    "hidden_size": 7168,
    "routed_expert_hidden_size": 3584,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "moe_intermediate_size": 3072,
    "num_shared_experts": 2,
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "latent_moe_use_norm": True,
    "topk_method": "noaux_tc",
    "num_expert_group": 1,
    "topk_group": 1,
    "hidden_act": "situ",
}


def test_k3_numbers():
    c = MoEConfig.k3()
    assert (c.d, c.ell, c.n, c.k, c.f) == (7168, 3584, 896, 16, 3072)
    assert c.num_shared_experts == 2 and c.shared_size == 6144
    assert c.alpha == 2.0
    assert (c.situ_beta, c.situ_linear_beta, c.rms_norm_eps) == (4.0, 25.0, 1e-5)
    assert c.score_function == "sigmoid" and c.activation == "situ"
    assert c.renormalize is True and c.routed_scaling_factor == 1.0 and c.use_latent_norm is True
    assert (c.topk_method, c.n_group, c.topk_group) == ("noaux_tc", 1, 1)
    assert c.num_moe_layers == 92


def test_presets():
    t = MoEConfig.tiny()
    assert (t.d, t.ell, t.n, t.k, t.f, t.shared_size) == (8, 4, 6, 2, 6, 6)
    s = MoEConfig.small()
    assert (s.d, s.ell, s.n, s.k, s.f, s.shared_size) == (1024, 512, 128, 8, 384, 768)
    assert MoEConfig.tiny(top_k=3).k == 3


def test_frozen_and_replace_revalidates():
    c = MoEConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3  # type: ignore[misc]
    assert c.replace(top_k=3).k == 3
    with pytest.raises(ValueError, match=r"MoEConfig.top_k must be <= num_experts=6, got 7"):
        c.replace(top_k=7)


@pytest.mark.parametrize("changes,error,pattern", [
    (dict(hidden_size=0), ValueError, r"MoEConfig.hidden_size must be a positive integer, got 0"),
    (dict(latent_size=-1), ValueError, r"MoEConfig.latent_size must be a positive integer, got -1"),
    (dict(num_experts=2.0), ValueError, r"MoEConfig.num_experts must be a positive integer, got 2.0"),
    (dict(top_k=True), ValueError, r"MoEConfig.top_k must be a positive integer, got True"),
    (dict(intermediate_size=0), ValueError, r"MoEConfig.intermediate_size must be a positive integer"),
    (dict(num_shared_experts=-1), ValueError, r"num_shared_experts must be a non-negative integer, got -1"),
    (dict(top_k=7), ValueError, r"MoEConfig.top_k must be <= num_experts=6, got 7"),
    (dict(latent_size=9), ValueError, r"MoEConfig.latent_size must be <= hidden_size=8, got 9"),
    (dict(use_latent_projection=False), ValueError,
     r"use_latent_projection=False needs latent_size == hidden_size.*latent_size=4, hidden_size=8"),
    (dict(situ_beta=0.0), ValueError, r"MoEConfig.situ_beta must be a positive finite number, got 0.0"),
    (dict(situ_linear_beta=float("inf")), ValueError, r"MoEConfig.situ_linear_beta must be a positive finite"),
    (dict(rms_norm_eps=-1e-5), ValueError, r"MoEConfig.rms_norm_eps must be a positive finite number"),
    (dict(routed_scaling_factor=True), ValueError, r"routed_scaling_factor must be a positive finite number, got True"),
    (dict(renormalize="true"), TypeError, r"MoEConfig.renormalize must be True or False, got str 'true'"),
    (dict(use_latent_norm="false"), TypeError, r"MoEConfig.use_latent_norm must be True or False, got str 'false'"),
    (dict(use_latent_projection=1), TypeError, r"MoEConfig.use_latent_projection must be True or False, got int 1"),
    (dict(score_function="relu"), ValueError, r"MoEConfig.score_function must be one of \('sigmoid', 'softmax', 'sqrtsoftplus'\), got 'relu'"),
    (dict(activation="gelu"), ValueError, r"MoEConfig.activation must be one of \('situ', 'swiglu'\), got 'gelu'"),
    (dict(topk_method="greedy"), ValueError, r"MoEConfig.topk_method must be one of \('noaux_tc',\), got 'greedy'"),
    (dict(n_group=4), ValueError, r"MoEConfig.n_group must divide num_experts=6, got 4"),
    (dict(n_group=2, topk_group=3), ValueError, r"MoEConfig.topk_group must be <= n_group=2, got 3"),
    (dict(n_group=3, topk_group=1, top_k=3), ValueError, r"top_k=3 exceeds the 1 x 2 experts"),
    (dict(num_moe_layers=0), ValueError, r"MoEConfig.num_moe_layers must be a positive integer, got 0"),
])
def test_validation_names_field_expected_and_actual(changes, error, pattern):
    with pytest.raises(error, match=pattern):
        MoEConfig.tiny(**changes)


def test_valid_edge_configs():
    assert MoEConfig.tiny(top_k=6).k == 6  # k = n is allowed
    assert MoEConfig.tiny(latent_size=8, use_latent_projection=False).alpha == 1.0
    assert MoEConfig.tiny(num_shared_experts=0).shared_size == 0
    assert MoEConfig.tiny(n_group=3, topk_group=2, top_k=4).n_group == 3


# ---------------------------------------------------------------------------
# Hugging Face keys
# ---------------------------------------------------------------------------

def test_hf_keys_are_those_of_spec_section_0():
    assert set(HF_KEYS.values()) == set(K3_HF)


def test_from_hf_config_reads_k3():
    hf = dict(K3_HF, num_hidden_layers=93, first_k_dense_replace=1, vocab_size=160000)  # extra keys ignored
    assert MoEConfig.from_hf_config(hf) == MoEConfig.k3()


def test_from_hf_config_through_json():
    # A config.json round trip: booleans and floats survive as JSON types.
    hf = json.loads(json.dumps(MoEConfig.k3().to_hf_config()))
    assert MoEConfig.from_hf_config(hf) == MoEConfig.k3()


def test_to_hf_config_of_k3():
    hf = MoEConfig.k3().to_hf_config()
    for key, value in K3_HF.items():
        assert hf[key] == value, key
    assert hf["num_hidden_layers"] == 93 and hf["first_k_dense_replace"] == 1


def test_from_hf_config_silu_is_swiglu_and_maps_back():
    c = MoEConfig.from_hf_config(dict(K3_HF, hidden_act="silu"))
    assert c.activation == "swiglu"
    assert c.to_hf_config()["hidden_act"] == "silu"


def test_from_hf_config_without_latent_size_is_a_plain_moe():
    hf = {k: v for k, v in K3_HF.items() if k != "routed_expert_hidden_size"}
    c = MoEConfig.from_hf_config(hf)
    assert c.ell == c.d == 7168 and c.use_latent_projection is False and c.alpha == 1.0
    # The reference code builds no norm without the latent, whatever latent_moe_use_norm says.
    assert c.use_latent_norm is False
    assert "routed_expert_hidden_size" not in c.to_hf_config()
    assert MoEConfig.from_hf_config(c.to_hf_config()) == c


def test_from_hf_config_layer_count():
    c = MoEConfig.from_hf_config(dict(K3_HF, num_hidden_layers=10, first_k_dense_replace=3))
    assert c.num_moe_layers == 7


def test_from_hf_config_errors():
    with pytest.raises(TypeError, match=r"hf must be a mapping of Hugging Face config keys, got list"):
        MoEConfig.from_hf_config([("hidden_size", 8)])
    with pytest.raises(ValueError, match=r"hf\['hidden_act'\] must be one of .*got 'relu'"):
        MoEConfig.from_hf_config(dict(K3_HF, hidden_act="relu"))
    with pytest.raises(ValueError, match=r"hf\['hidden_act'\] must be one of .*got \['situ'\]"):
        MoEConfig.from_hf_config(dict(K3_HF, hidden_act=["situ"]))
    with pytest.raises(ValueError, match=r"num_experts_per_token|top_k must be <= num_experts=896, got 900"):
        MoEConfig.from_hf_config(dict(K3_HF, num_experts_per_token=900))
    with pytest.raises(TypeError, match=r"use_latent_norm must be True or False, got str 'false'"):
        MoEConfig.from_hf_config(dict(K3_HF, latent_moe_use_norm="false"))


@st.composite
def configs(draw):
    """Valid small configurations with every switch drawn."""
    n_group = draw(st.sampled_from([1, 2, 3]))
    n = n_group * draw(st.integers(1, 4))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, topk_group * (n // n_group)))
    projection = draw(st.booleans())
    # What the reference code can express: renormalization needs k > 1, the norm needs the latent.
    ell = draw(st.integers(1, 6))
    d = ell * draw(st.integers(1, 3)) if projection else ell
    return MoEConfig(
        hidden_size=d, latent_size=ell, num_experts=n, top_k=k,
        intermediate_size=draw(st.integers(1, 8)), num_shared_experts=draw(st.integers(0, 3)),
        situ_beta=draw(st.floats(0.5, 10)), situ_linear_beta=draw(st.none() | st.floats(1, 50)),
        rms_norm_eps=draw(st.floats(1e-8, 1e-3)), renormalize=k > 1 and draw(st.booleans()),
        routed_scaling_factor=draw(st.floats(0.1, 3)), use_latent_norm=projection and draw(st.booleans()),
        use_latent_projection=projection, activation=draw(st.sampled_from(["situ", "swiglu"])),
        n_group=n_group, topk_group=topk_group, num_moe_layers=draw(st.integers(1, 100)))


@given(config=configs())
def test_hf_round_trip(config):
    hf = config.to_hf_config()
    assert set(HF_KEYS.values()) - set(hf) <= {"routed_expert_hidden_size"}
    assert MoEConfig.from_hf_config(config.to_hf_config(nested=True)) == config
    assert MoEConfig.from_hf_config(hf) == config
    assert MoEConfig.from_hf_config(json.loads(json.dumps(hf))) == config


# ---------------------------------------------------------------------------
# The reference code's semantics (SPEC §9.1); the forward-pass comparisons with a
# transcription of the reference block are in test_checkpoint.py
# ---------------------------------------------------------------------------

# K3's config.json, nested as released: the keys of SPEC §0 and §9.1 (vision keys left out).
K3_CONFIG_JSON = {
    "model_type": "kimi_k3",
    "text_config": dict(
        K3_HF, model_type="kimi_linear", num_hidden_layers=93, first_k_dense_replace=1, moe_layer_freq=1,
        use_grouped_topk=True, vocab_size=163840,
        quantization_config={
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32,
                                                                            "type": "float"}}},
            "ignore": ["re:.*shared_experts.*", "lm_head"]}),
    "vision_config": {"model_type": "moonvit"},
}


def test_k3_config_json_gives_exactly_k3():
    assert MoEConfig.from_hf_config(K3_CONFIG_JSON) == MoEConfig.k3()
    assert MoEConfig.from_hf_config(json.loads(json.dumps(K3_CONFIG_JSON))) == MoEConfig.k3()


def test_nested_config_is_read_not_ignored():
    # A miniature nested config must not come back as K3's defaults.
    small = {"model_type": "kimi_k3", "text_config": {
        "hidden_size": 64, "routed_expert_hidden_size": 32, "num_experts": 8, "num_experts_per_token": 2,
        "moe_intermediate_size": 16, "num_shared_experts": 1, "latent_moe_use_norm": True,
        "hidden_act": "situ"}}
    c = MoEConfig.from_hf_config(small)
    assert (c.d, c.ell, c.n, c.k, c.f, c.num_shared_experts) == (64, 32, 8, 2, 16, 1)


def test_absent_keys_mean_what_the_reference_code_makes_of_them():
    c = MoEConfig.from_hf_config({"hidden_size": 64, "num_experts": 8, "num_experts_per_token": 2,
                                  "moe_intermediate_size": 16})
    assert (c.use_latent_projection, c.use_latent_norm, c.ell) == (False, False, 64)
    assert (c.situ_beta, c.situ_linear_beta) == (1.0, None)
    assert c.num_shared_experts == 0 and c.activation == "swiglu" and c.rms_norm_eps == 1e-6
    assert (c.renormalize, c.routed_scaling_factor, c.n_group, c.topk_group) == (True, 1.0, 1, 1)


def test_null_values():
    c = MoEConfig.from_hf_config(dict(K3_HF, num_shared_experts=None, activation_situ_beta=None,
                                      activation_situ_linear_beta=None))
    assert (c.num_shared_experts, c.situ_beta, c.situ_linear_beta) == (0, 1.0, None)
    assert c.to_hf_config()["num_shared_experts"] is None
    assert MoEConfig.from_hf_config(c.to_hf_config()) == c


def test_top1_is_not_renormalized():
    assert MoEConfig.from_hf_config(dict(K3_HF, num_experts_per_token=1)).renormalize is False
    assert MoEConfig.from_hf_config(dict(K3_HF, num_experts_per_token=2)).renormalize is True


@pytest.mark.parametrize("layers,first,freq,expected", [(93, 1, 1, 92), (10, 0, 1, 10), (10, 2, 3, 3), (7, 0, 2, 4)])
def test_dense_layers_are_recognized(layers, first, freq, expected):
    c = MoEConfig.from_hf_config(dict(K3_HF, num_hidden_layers=layers, first_k_dense_replace=first,
                                      moe_layer_freq=freq))
    # Independent count: the layers L with L >= first and L % freq == 0, listed by hand for these cases.
    by_hand = {(93, 1, 1): 92, (10, 0, 1): 10, (10, 2, 3): len([3, 6, 9]), (7, 0, 2): len([0, 2, 4, 6])}
    assert c.num_moe_layers == by_hand[(layers, first, freq)] == expected


def test_configs_the_reference_cannot_express():
    with pytest.raises(ValueError, match="top_k=1 with renormalize=True has no Hugging Face configuration"):
        MoEConfig.tiny(top_k=1, renormalize=True).to_hf_config()
    with pytest.raises(ValueError, match="a latent norm without the latent projections"):
        MoEConfig.tiny(latent_size=8, use_latent_projection=False).to_hf_config()
    with pytest.raises(ValueError, match=r"hf\['text_config'\]\['moe_intermediate_size'\] is required"):
        MoEConfig.from_hf_config({"text_config": {"hidden_size": 8, "num_experts": 4, "num_experts_per_token": 2}})
    with pytest.raises(ValueError, match=r"has no MoE layer"):
        MoEConfig.from_hf_config(dict(K3_HF, num_hidden_layers=2, first_k_dense_replace=2))
    with pytest.raises(TypeError, match=r"hf\['text_config'\] must be a mapping, got list"):
        MoEConfig.from_hf_config({"text_config": []})
    with pytest.raises(ValueError, match=r"situ_linear_beta must be a positive finite number or None, got 0"):
        MoEConfig.from_hf_config(dict(K3_HF, activation_situ_linear_beta=0))
