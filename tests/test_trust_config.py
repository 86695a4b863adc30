"""Hostile configurations and arguments to `refimpl.config` and `refimpl.families`: each case raised a raw
Python error, named the wrong key, or read as another layer on the release before this one.

* DeepSeek-V4's `scoring_func` as a list or a mapping was a raw `TypeError: unhashable type`;
* Qwen2-MoE's `shared_expert_intermediate_size` next to a null `num_shared_experts` (meaning none) read as a
  shared width of 0, where the same file with `num_shared_experts: 0` was refused;
* Nemotron-H's `hybrid_override_pattern` that is not a string was ignored, and the class's default layout
  read in its place;
* `num_hidden_layers: null` was refused with a hint that leaving the key out means None (it means one MoE
  layer, described on its own);
* `count_moe_layers` and `is_moe_layer` checked nothing: a frequency of 0 divided by zero, negative counts
  gave 0, 10.5 layers counted 10.0 and "10" was a raw TypeError;
* `family_layer_keys` dropped a misspelled field, wrote `hidden_size="16"` unchecked, and for `kimi_k3`
  returned keys that read back as no layer at all;
* `hf_reading_family([1])` named `hf['text_config']` in a ValueError, where `from_hf_config` says `hf` must be
  a mapping (TypeError);
* `MoEConfig(activation=np.array("situ"))` stored the array, and hashing the config raised.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refimpl import MoEConfig
from refimpl.config import count_moe_layers, family_layer_keys, hf_reading_family, is_moe_layer
from refimpl.families import ALL_RECORDS, FAMILIES

# A K3-style configuration of one small layer (K3's own code reads it: no model_type).
K3_SMALL = {"hidden_size": 8, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 4}


def _family_file(model_type: str, drop: tuple[str, ...] = (), **changes) -> dict:
    """The record's test configuration of `model_type`, without the keys `drop`, with `changes`."""
    keys = {"model_type": model_type, **FAMILIES[model_type].test_keys, **changes}
    return {key: value for key, value in keys.items() if key not in drop}


# -- DeepSeek-V4's scoring_func of another type ---------------------------------------------------------------

@pytest.mark.parametrize("value", [[1], ["sigmoid"], {"sigmoid": 1}, {}])
def test_deepseek_v4_scoring_func_of_another_type_is_a_value_error_naming_the_key(value):
    with pytest.raises(ValueError, match=r"hf\['scoring_func'\] must be one of \['sigmoid', 'sqrtsoftplus'\] "
                                         r".*got "):
        MoEConfig.from_hf_config(_family_file("deepseek_v4", scoring_func=value))


# -- Qwen2-MoE's shared width next to a null num_shared_experts -------------------------------------------------

def test_a_shared_width_next_to_null_shared_experts_is_refused_as_next_to_zero():
    # null means no shared experts, as 0 does: a Qwen2-MoE shared width of 16 disagrees with both, and 0 agrees.
    for shared in (None, 0):
        hf = dict(K3_SMALL, num_shared_experts=shared, shared_expert_intermediate_size=16)
        with pytest.raises(ValueError, match=r"hf\['shared_expert_intermediate_size'\] = 16 .* is not "
                                             r"num_shared_experts x moe_intermediate_size = (0|null \(meaning 0\)) x 4 = 0"):
            MoEConfig.from_hf_config(hf)
    for shared in (None, 0):
        hf = dict(K3_SMALL, num_shared_experts=shared, shared_expert_intermediate_size=0)
        assert MoEConfig.from_hf_config(hf).shared_size == 0


# -- Nemotron-H's hybrid_override_pattern ----------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [5, None, ["E", "M"], {"E": 1}, "", "EXE"])
def test_a_nemotron_h_pattern_that_is_not_a_string_of_layer_letters_is_refused_by_name(pattern):
    hf = _family_file("nemotron_h", drop=("layers_block_type",), hybrid_override_pattern=pattern)
    with pytest.raises(ValueError, match=r"hf\['hybrid_override_pattern'\] must be a string of one letter per "
                                         r"layer .*got "):
        MoEConfig.from_hf_config(hf)
    good = _family_file("nemotron_h", drop=("layers_block_type",), hybrid_override_pattern="ME*E-E")
    assert MoEConfig.from_hf_config(good).num_moe_layers == 3


# -- num_hidden_layers: null -----------------------------------------------------------------------------------

def test_a_null_layer_count_is_refused_with_what_leaving_it_out_means():
    with pytest.raises(ValueError, match=r"hf\['num_hidden_layers'\] must not be null: write its value, or leave "
                                         r"the key out \(meaning one MoE layer, described on its own\)"):
        MoEConfig.from_hf_config(dict(K3_SMALL, num_hidden_layers=None))
    assert MoEConfig.from_hf_config(K3_SMALL).num_moe_layers == 1  # what leaving it out does mean


# -- count_moe_layers and is_moe_layer check their arguments ----------------------------------------------------

@pytest.mark.parametrize("args,error,message", [
    ((10, 0, 0), ValueError, r"moe_layer_freq must be an integer >= 1, got 0"),
    ((10, 0, -2), ValueError, r"moe_layer_freq must be an integer >= 1, got -2"),
    ((-5,), ValueError, r"num_hidden_layers must be an integer >= 1, got -5"),
    ((0,), ValueError, r"num_hidden_layers must be an integer >= 1, got 0"),
    ((10, -1), ValueError, r"first_k_dense_replace must be an integer >= 0, got -1"),
    ((10.5,), TypeError, r"num_hidden_layers must be an integer, got float 10.5"),
    ((10.0,), TypeError, r"num_hidden_layers must be an integer, got float 10.0"),
    (("10",), TypeError, r"num_hidden_layers must be an integer, got str '10'"),
    ((True,), TypeError, r"num_hidden_layers must be an integer, got bool True"),
    ((10, None), TypeError, r"first_k_dense_replace must be an integer, got NoneType None"),
    ((10, 0, 2.0), TypeError, r"moe_layer_freq must be an integer, got float 2.0"),
])
def test_count_moe_layers_refuses_what_is_no_layer_count(args, error, message):
    with pytest.raises(error, match=message):
        count_moe_layers(*args)


@pytest.mark.parametrize("args,error,message", [
    ((3, 0, 0), ValueError, r"moe_layer_freq must be an integer >= 1, got 0"),
    ((-3,), ValueError, r"layer must be an integer >= 0, got -3"),
    ((3, -1), ValueError, r"first_k_dense_replace must be an integer >= 0, got -1"),
    ((3.0,), TypeError, r"layer must be an integer, got float 3.0"),
    ((np.bool_(True),), TypeError, r"layer must be an integer, got bool "),
    ((3, "1"), TypeError, r"first_k_dense_replace must be an integer, got str '1'"),
])
def test_is_moe_layer_refuses_what_is_no_layer_index(args, error, message):
    with pytest.raises(error, match=message):
        is_moe_layer(*args)


def test_numpy_integers_are_layer_counts():
    assert count_moe_layers(np.int64(93), np.int32(1)) == 92 and type(count_moe_layers(np.int64(93))) is int
    assert is_moe_layer(np.int64(4), np.int64(1), np.int64(2)) is True


# -- family_layer_keys ------------------------------------------------------------------------------------------

def test_family_layer_keys_refuses_a_misspelled_field_by_name():
    with pytest.raises(TypeError, match=r"family_layer_keys\(\) got fields MoEConfig has not: \['hiddn_size'\] "
                                        r"\(the fields are \[.*'hidden_size'.*\]\)"):
        family_layer_keys("qwen3_moe", hiddn_size=16)


@pytest.mark.parametrize("fields,message", [
    (dict(hidden_size="16"), r"MoEConfig.hidden_size must be a positive integer, got '16'"),
    (dict(top_k=9), r"MoEConfig.top_k must be <= num_experts=8, got 9"),
    (dict(routed_scaling_factor=0.0), r"MoEConfig.routed_scaling_factor must be a positive finite number"),
])
def test_family_layer_keys_checks_the_values_as_moe_config_does(fields, message):
    with pytest.raises(ValueError, match=message):
        family_layer_keys("deepseek_v3", **fields)


def test_family_layer_keys_writes_checked_values():
    keys = family_layer_keys("mixtral", hidden_size=np.int64(16), routed_scaling_factor=2.5)
    assert keys["hidden_size"] == 16 and type(keys["hidden_size"]) is int  # Mixtral has no scaling key


@pytest.mark.parametrize("model_type", sorted(ALL_RECORDS))
def test_family_layer_keys_read_back_as_the_layer_asked_for(model_type):
    family = ALL_RECORDS[model_type]
    keys = family_layer_keys(model_type, hidden_size=32, num_experts=8, top_k=2)
    hf = ({"model_type": model_type, "text_config": {"model_type": family.wraps, **keys}} if family.wraps
          else {"model_type": model_type, **keys})
    config = MoEConfig.from_hf_config(hf)
    assert (config.hidden_size, config.num_experts, config.top_k, config.num_moe_layers) == (32, 8, 2, 1)


# -- hf_reading_family of what is no mapping --------------------------------------------------------------------

@pytest.mark.parametrize("hf", [[1], None, "kimi_k3", 3])
def test_hf_reading_family_refuses_what_is_no_mapping_as_from_hf_config_does(hf):
    with pytest.raises(TypeError, match=rf"hf must be a mapping of Hugging Face config keys, got "
                                        rf"{type(hf).__name__}"):
        hf_reading_family(hf)
    with pytest.raises(TypeError, match=r"hf must be a mapping"):
        MoEConfig.from_hf_config(hf)


# -- MoEConfig's names given as NumPy strings -------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [("activation", "swiglu"), ("score_function", "softmax"),
                                        ("topk_method", "noaux_tc")])
def test_numpy_strings_are_stored_as_str(name, value):
    for given in (np.array(value), np.str_(value), np.array(np.str_(value))):
        config = MoEConfig.tiny(**{name: given})
        assert type(getattr(config, name)) is str and getattr(config, name) == value
        assert hash(config) == hash(MoEConfig.tiny(**{name: value})) and config == MoEConfig.tiny(**{name: value})


@pytest.mark.parametrize("name", ["activation", "score_function", "topk_method"])
@pytest.mark.parametrize("value", [np.array(["situ"]), b"situ", 1, None, ["sigmoid"], np.array(1)],
                         ids=lambda v: repr(v)[:20])
def test_a_name_that_is_no_string_is_a_type_error_naming_the_field(name, value):
    with pytest.raises(TypeError, match=rf"MoEConfig.{name} must be a string \(one of .*\), got "
                                        rf"{type(value).__name__} "):
        MoEConfig.tiny(**{name: value})


def test_every_field_of_a_config_is_hashable_after_construction():
    config = MoEConfig.tiny(activation=np.array("swiglu"), score_function=np.array("softmax"))
    assert all(hash(value) is not None for value in dataclasses.astuple(config))
