"""Tests of `MoEConfig`: the K3 numbers, presets, validation, and the Hugging Face keys of the released config."""

from __future__ import annotations

import dataclasses
import json
import re
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from refimpl.config import HF_KEYS, HF_SYNONYMS, MoEConfig, count_moe_layers, is_moe_layer

# K3's layer keys and values, typed in from the released configuration: HF key -> K3 value.
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
    (dict(activation="gelu"), ValueError, r"MoEConfig.activation must be one of \('situ', 'swiglu', 'relu2'\), got 'gelu'"),
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

def test_hf_keys_are_k3s_configuration_keys():
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
    with pytest.raises(ValueError, match=r"hf\['latent_moe_use_norm'\] must be true or false, got str 'false'"):
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
# The reference code's semantics; the forward-pass comparisons with a
# transcription of the reference block are in test_checkpoint.py
# ---------------------------------------------------------------------------

# K3's config.json, nested as released (vision keys left out).
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
    with pytest.raises(ValueError, match=r"hf\['text_config'\] must be a mapping of the language model's keys, "
                                         r"got list \[\]"):
        MoEConfig.from_hf_config({"text_config": []})
    with pytest.raises(ValueError, match=r"hf\['text_config'\] must be a mapping .*got NoneType None"):
        MoEConfig.from_hf_config({"text_config": None})
    with pytest.raises(ValueError, match=r"hf\['activation_situ_linear_beta'\] must be a positive finite number "
                                         r"or null, got 0"):
        MoEConfig.from_hf_config(dict(K3_HF, activation_situ_linear_beta=0))


# ---------------------------------------------------------------------------
# Numbers of any type, stored as Python numbers; factors float32 can hold
# ---------------------------------------------------------------------------

SIZES = ("hidden_size", "latent_size", "num_experts", "top_k", "intermediate_size", "num_shared_experts",
         "n_group", "topk_group", "num_moe_layers", "num_hash_layers")


@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint8, np.int16, int])
def test_sizes_accept_any_integral_type_and_store_ints(kind):
    plain = dict(hidden_size=8, latent_size=4, num_experts=6, top_k=2, intermediate_size=6, num_shared_experts=1,
                 n_group=3, topk_group=2, num_moe_layers=2, num_hash_layers=1)
    c = MoEConfig(**{name: kind(value) for name, value in plain.items()})
    assert c == MoEConfig(**plain)
    for name in SIZES:
        assert type(getattr(c, name)) is int, name


@pytest.mark.parametrize("value", [True, np.bool_(True), 2.0, np.float64(2.0), "2", None])
def test_sizes_refuse_what_is_not_an_integer(value):
    with pytest.raises(ValueError, match=r"MoEConfig.top_k must be a positive integer, got"):
        MoEConfig.tiny(top_k=value)


FACTORS = ("situ_beta", "situ_linear_beta", "rms_norm_eps", "routed_scaling_factor", "capacity_factor")


@pytest.mark.parametrize("kind", [np.float32, np.float64, np.float16, float, Fraction])
def test_factors_accept_any_real_type_and_store_floats(kind):
    plain = dict(situ_beta=4.0, situ_linear_beta=25.0, rms_norm_eps=0.5, routed_scaling_factor=2.5,
                 capacity_factor=1.25)  # all exact in float16
    c = MoEConfig.tiny(**{name: kind(value) for name, value in plain.items()})
    assert c == MoEConfig.tiny(**plain)
    for name in FACTORS:
        assert type(getattr(c, name)) is float, name


def test_a_numpy_capacity_factor_runs_the_forward():
    # A NumPy scalar used to reach the capacity arithmetic and raise TypeError there.
    from refimpl import init_params, stable_latent_moe
    config = MoEConfig.tiny(capacity_factor=np.float32(1.25))
    plain = MoEConfig.tiny(capacity_factor=1.25)
    params = init_params(plain, 0)
    x = np.random.default_rng(1).standard_normal((10, 8))
    np.testing.assert_array_equal(stable_latent_moe(x, params, config), stable_latent_moe(x, params, plain))


F32_LOW, F32_HIGH = float(np.finfo(np.float32).smallest_subnormal), float(np.finfo(np.float32).max)


@pytest.mark.parametrize("name", FACTORS)
@pytest.mark.parametrize("value", [1e308, 1e39, 1e-50, 10**400])
def test_factors_float32_cannot_hold_are_refused(name, value):
    pattern = (rf"MoEConfig.{name} must be a number float32 \(the layer's compute dtype\) holds: between "
               rf"1.401e-45 and 3.4028235e\+38, got" if value != 10**400
               else rf"MoEConfig.{name} must be a positive finite number")
    with pytest.raises(ValueError, match=pattern):
        MoEConfig.tiny(**{name: value})


@pytest.mark.parametrize("name", FACTORS)
def test_factors_at_the_ends_of_float32_are_accepted(name):
    assert getattr(MoEConfig.tiny(**{name: F32_HIGH}), name) == F32_HIGH
    assert getattr(MoEConfig.tiny(**{name: F32_LOW}), name) == F32_LOW


# ---------------------------------------------------------------------------
# from_hf_config: every value checked, and named when it is wrong
# ---------------------------------------------------------------------------

K3_FILE = dict(K3_HF, num_hidden_layers=93, first_k_dense_replace=1, moe_layer_freq=1)

NOT_A_NUMBER = ["", [], {}, False, True, "4.0", [4.0]]
BAD_VALUES = {
    "activation_situ_beta": NOT_A_NUMBER + [-1.0, float("inf"), float("nan"), 1e39],
    "activation_situ_linear_beta": NOT_A_NUMBER + [0, -25.0, float("inf"), 1e308],
    "rms_norm_eps": NOT_A_NUMBER + [None, 0, -1e-5, 1e-50],
    "routed_scaling_factor": NOT_A_NUMBER + [None, 0.0, -1.0, 1e308],
    "hidden_size": [True, 7168.0, "7168", -1, 0, [7168]],
    "routed_expert_hidden_size": [True, 3584.0, "3584", 0, -3584],
    "num_experts": [True, 896.0, "896", 0, [896]],
    "num_experts_per_token": [False, 16.0, "16", 0],
    "moe_intermediate_size": [True, 3072.5, "3072", 0],
    "num_shared_experts": [True, 2.0, "2", -1],
    "num_expert_group": [True, 1.0, "1", 0],
    "topk_group": [True, 1.0, "1", 0],
    "num_hidden_layers": [True, 93.0, "93", -1, 0, 1e18],
    "first_k_dense_replace": [True, 1.0, "1", -1, None],
    "moe_layer_freq": [True, 1.0, "1", 0, None],
    "moe_renormalize": ["true", 1, 0, None, [True]],
    "latent_moe_use_norm": ["false", 0, None],
    "moe_router_activation_func": ["relu", 1, None, ["sigmoid"]],
    "topk_method": ["greedy", None, 0],
    "hidden_act": ["relu", None, ["situ"], 1],
}


@pytest.mark.parametrize("key,value", [(key, value) for key, values in BAD_VALUES.items() for value in values],
                         ids=lambda v: repr(v)[:20])
def test_a_bad_value_is_an_error_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"hf\['{key}'\]"):
        MoEConfig.from_hf_config(dict(K3_FILE, **{key: value}))


@pytest.mark.parametrize("value", [None, 0, 0.0])
def test_beta_null_and_zero_mean_one_as_in_the_reference(value):
    assert MoEConfig.from_hf_config(dict(K3_HF, activation_situ_beta=value)).situ_beta == 1.0
    assert MoEConfig.from_hf_config({k: v for k, v in K3_HF.items() if k != "activation_situ_beta"}).situ_beta == 1.0


def test_numpy_values_in_a_config_mapping_are_read():
    hf = dict(K3_HF, hidden_size=np.int64(7168), num_experts=np.int32(896), routed_scaling_factor=np.float32(1.0),
              rms_norm_eps=np.float64(1e-5))
    c = MoEConfig.from_hf_config(hf)
    assert c == MoEConfig.from_hf_config(K3_HF) and type(c.hidden_size) is int and type(c.rms_norm_eps) is float


def test_a_combination_no_layer_has_names_the_keys():
    with pytest.raises(ValueError, match=r"hf describes no layer this package computes: MoEConfig.top_k must be <= "
                                         r"num_experts=896, got 900 \(in config.json: num_experts is "
                                         r"'num_experts', top_k is 'num_experts_per_token'\)"):
        MoEConfig.from_hf_config(dict(K3_HF, num_experts_per_token=900))


def test_a_huge_layer_count_is_counted_not_looped():
    import time
    start = time.perf_counter()
    c = MoEConfig.from_hf_config(dict(K3_HF, num_hidden_layers=10**18, first_k_dense_replace=3, moe_layer_freq=7))
    assert time.perf_counter() - start < 1.0
    # The MoE layers are the multiples of 7 from 7 (the first at or past layer 3) below 10^18: len() of that
    # range is computed by Python without iterating.
    assert c.num_moe_layers == len(range(7, 10**18, 7))


@given(total=st.integers(1, 200), first=st.integers(0, 210), freq=st.integers(1, 25))
def test_count_moe_layers_equals_the_loop(total, first, freq):
    assert count_moe_layers(total, first, freq) == sum(is_moe_layer(L, first, freq) for L in range(total))


# Anything a JSON file (or a Python mapping) might hold, for any key.
JUNK = (st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=6) | st.lists(st.integers(0, 9), max_size=2) | st.sampled_from(["sigmoid", "silu", "situ"]))


@given(key=st.sampled_from(sorted(BAD_VALUES)), value=JUNK)
@example(key="activation_situ_beta", value="")
@example(key="activation_situ_beta", value=False)
@example(key="routed_scaling_factor", value=1e308)
@example(key="topk_group", value=2)  # a key whose error comes from the combination (topk_group > n_group)
@example(key="activation_situ_beta", value=1)  # an int factor is stored as a float
@example(key="moe_layer_freq", value=93)  # no layer is left: the error names the keys
@example(key="activation_situ_beta", value=2**53 + 1)  # found by the dev profile: stored as float(2^53 + 1)
def test_any_value_is_read_as_given_or_refused_by_name(key, value):
    # Either the value is refused with an error that names its key, or the config holds exactly that value:
    # never a default in its place.
    try:
        c = MoEConfig.from_hf_config(dict(K3_FILE, **{key: value}))
    except ValueError as exc:
        assert f"['{key}']" in str(exc) or f"'{key}'" in str(exc), str(exc)
        return
    field = {v: k for k, v in HF_KEYS.items()}.get(key)
    meaning_of_null = {"routed_expert_hidden_size": None, "num_shared_experts": 0, "activation_situ_beta": 1.0,
                       "activation_situ_linear_beta": None, "num_expert_group": 1, "topk_group": 1}
    if value is None:
        assert key in meaning_of_null or key == "num_hidden_layers"
    elif key == "num_hidden_layers":
        assert c.num_moe_layers == value - 1
    elif key == "first_k_dense_replace":
        assert c.num_moe_layers == 93 - value
    elif key == "moe_layer_freq":
        assert c.num_moe_layers == len(range(value, 93, value))
    elif key == "hidden_act":
        assert c.activation == {"situ": "situ", "silu": "swiglu"}[value]
    elif key == "activation_situ_beta" and value == 0:
        assert c.situ_beta == 1.0
    elif key in ("activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps", "routed_scaling_factor"):
        # Stored as the nearest Python float: an integer beyond 2^53 rounds, as it will in the arithmetic.
        assert getattr(c, field) == float(value) and type(getattr(c, field)) is float, (field, value)
    else:
        assert getattr(c, field) == value and type(getattr(c, field)) is type(value), (field, value)


# ---------------------------------------------------------------------------
# Keys other MoE configurations spell differently
# ---------------------------------------------------------------------------

# synonym -> (a value that agrees with K3's key, one that does not)
SYNONYM_CASES = {
    "n_routed_experts": (896, 256),
    "num_local_experts": (896, 8),
    "moe_num_experts": (896, 64),
    "num_experts_per_tok": (16, 8),
    "moe_k": (16, 6),
    "moe_topk": (16, 1),
    "n_shared_experts": (2, 1),
    "moe_num_shared_experts": (2, 1),
    "shared_expert_intermediate_size": (2 * 3072, 3072),
    "intermediate_size": (18432, None),  # may differ: next to moe_intermediate_size it is the dense FFN's width
    "scoring_func": ("sigmoid", "softmax"),
    "norm_topk_prob": (True, False),
    "n_group": (1, 8),
    "decoder_sparse_step": (1, 2),
}


def test_every_synonym_has_a_case():
    assert set(SYNONYM_CASES) == set(HF_SYNONYMS)


@pytest.mark.parametrize("found", sorted(SYNONYM_CASES))
def test_a_synonym_without_its_key_names_both(found):
    expected = HF_SYNONYMS[found].expected
    agreeing, _ = SYNONYM_CASES[found]
    hf = {k: v for k, v in K3_FILE.items() if k != expected}
    hf[found] = agreeing
    with pytest.raises(ValueError, match=rf"hf\['{found}'\] = .* but no '{expected}', the key this package reads"):
        MoEConfig.from_hf_config(hf)


@pytest.mark.parametrize("found", sorted(k for k, (_, bad) in SYNONYM_CASES.items() if bad is not None))
def test_a_synonym_that_disagrees_names_both(found):
    expected = HF_SYNONYMS[found].expected
    _, disagreeing = SYNONYM_CASES[found]
    with pytest.raises(ValueError, match=rf"hf\['{found}'\] = {re.escape(repr(disagreeing))} .*"
                                         rf"(disagrees with hf\['{expected}'\]|is not num_shared_experts)"):
        MoEConfig.from_hf_config(dict(K3_FILE, **{found: disagreeing}))


@pytest.mark.parametrize("found", sorted(SYNONYM_CASES))
def test_a_synonym_that_agrees_reads_as_k3(found):
    agreeing, _ = SYNONYM_CASES[found]
    assert MoEConfig.from_hf_config(dict(K3_FILE, **{found: agreeing})) == MoEConfig.k3()


def test_true_is_not_one():
    with pytest.raises(ValueError, match=r"hf\['norm_topk_prob'\] = 1 .*disagrees with hf\['moe_renormalize'\]"):
        MoEConfig.from_hf_config(dict(K3_FILE, norm_topk_prob=1))


@pytest.mark.parametrize("dense_width", [18432, 3072, 1])
def test_k3_file_with_a_dense_intermediate_size_is_k3(dense_width):
    # K3's text_config has intermediate_size, the first layer's dense FFN width, beside moe_intermediate_size.
    hf = json.loads(json.dumps(K3_CONFIG_JSON))
    hf["text_config"]["intermediate_size"] = dense_width
    assert MoEConfig.from_hf_config(hf) == MoEConfig.k3()


# The MoE keys of DeepSeek-V3's released config.json (deepseek-ai/DeepSeek-V3, typed in).
DEEPSEEK_V3_JSON = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
}


def test_deepseek_v3_config_read_as_k3s_keys_is_refused_key_by_key():
    with pytest.raises(ValueError) as info:
        MoEConfig.from_hf_config(DEEPSEEK_V3_JSON, code="k3")
    message = str(info.value)
    for found in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "scoring_func",
                  "norm_topk_prob"):
        assert f"hf['{found}']" in message and f"'{HF_SYNONYMS[found].expected}'" in message, found
    assert "intermediate_size'" not in message.replace("moe_intermediate_size", "")  # its dense width is fine


def test_deepseek_v3_config_is_read_as_deepseek_v3_and_is_the_preset():
    assert MoEConfig.from_hf_config(DEEPSEEK_V3_JSON) == MoEConfig.deepseek_v3()


def test_the_deepseek_v3_preset_writes_as_its_family_and_reads_back():
    """The preset differed from its file (epsilon 1e-5, a SiTU cap of 25), so its family refused to write it."""
    from refimpl.config import family_hf_config

    preset = MoEConfig.deepseek_v3()
    for model_type in ("deepseek_v3", "kimi_k25"):
        written = family_hf_config(preset, model_type, 3)
        assert MoEConfig.from_hf_config(written) == preset, model_type


def test_deepseek_v3_renamed_is_the_preset():
    hf = {HF_SYNONYMS[k].expected if k in HF_SYNONYMS and k != "intermediate_size" else k: v
          for k, v in DEEPSEEK_V3_JSON.items()}
    c, preset = MoEConfig.from_hf_config(hf), MoEConfig.deepseek_v3()
    for field in ("hidden_size", "latent_size", "use_latent_projection", "use_latent_norm", "num_experts", "top_k",
                  "intermediate_size", "num_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                  "renormalize", "score_function", "activation", "num_moe_layers"):
        assert getattr(c, field) == getattr(preset, field), field


def test_mixtral_config_is_refused():
    # Mixtral-8x7B's MoE keys: intermediate_size is each expert's width there.
    mixtral = {"hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
               "num_hidden_layers": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5}
    with pytest.raises(ValueError, match=r"'num_local_experts'.*'num_experts'.*'num_experts_per_tok'.*"
                                         r"'num_experts_per_token'.*'intermediate_size'.*'moe_intermediate_size'"):
        MoEConfig.from_hf_config(mixtral)


def test_a_numpy_float32_factor_is_the_decimal_it_prints_as():
    """np.float32(1.1) is stored as 1.1, so the capacity is the one 1.1 gives (11 for kN/E = 10, not 12)."""
    from refimpl.layer.baselines import expert_capacity

    config = MoEConfig.tiny(num_experts=6, top_k=2, capacity_factor=np.float32(1.1))
    assert config.capacity_factor == 1.1 and type(config.capacity_factor) is float
    assert expert_capacity(30, 6, 2, config.capacity_factor) == 11
