"""`save_hf_layer(..., model_type=...)`: one layer written as a family's folder, read back equal, or refused.

For every record of `refimpl.families.ALL_RECORDS` (each small test configuration), in the family's per-expert
layout, its fused names, and sharded:

* `load_hf_layer` reads the written layer back: the same `MoEConfig`, the same tensors, a hash layer's table;
* the written `config.json` builds the family's own configuration class (transformers 5.24's; the wrapper's
  for Kimi K2.5), whose `to_dict()` reads as the same layer, and whose block, built from it, loads the
  layer's fused tensors with `strict=True` (K3's: the draft's block, `tests/k3_draft_block.py`);
* what the family cannot express is refused by name, and nothing is written.
"""

from __future__ import annotations

import importlib
import json
import warnings

import numpy as np
import pytest
import torch
import transformers
from k3_draft_block import draft_block

import refimpl
from refimpl.checkpoints import save_hf_layer
from refimpl.families import ALL_RECORDS, HFFamily

LAYOUTS = {"per_expert": ("per_expert", None), "fused": ("fused", None), "sharded": (None, 4096)}


def _layer(family: HFFamily, seed: int = 0) -> tuple[refimpl.MoEConfig, refimpl.MoEParams]:
    """The family's test configuration and weights for it (a nonzero bias where the router has one)."""
    config = refimpl.MoEConfig.from_hf_config({"model_type": family.model_type, **family.test_keys})
    params = refimpl.init_params(config, seed, dtype=np.float64, bias_scale=0.5 if family.has_bias else 0.0)
    return config, params


def _table(config: refimpl.MoEConfig, vocab: int = 32) -> np.ndarray:
    """A hash layer's table: k distinct experts for each of `vocab` token ids."""
    rng = np.random.default_rng(0)
    return np.stack([rng.permutation(config.num_experts)[:config.top_k] for _ in range(vocab)])


def _hf_block(family: HFFamily, config: refimpl.MoEConfig, hf: dict, layer: int) -> torch.nn.Module:
    """The family's own block built from the written `config.json` (the draft's for K3)."""
    if family.draft is not None:
        return draft_block(config)
    text = hf.get("text_config", hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_config = getattr(transformers, family.config_class)(**text)
    block_class = getattr(importlib.import_module(family.module), family.block_class)
    block = block_class(hf_config, layer) if family.block_takes_layer else block_class(hf_config)
    return block.double()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model_type", sorted(ALL_RECORDS))
def test_a_layer_saved_in_a_familys_layout_reads_back_equal_and_loads_into_its_block(model_type, layout, tmp_path):
    family = ALL_RECORDS[model_type]
    config, params = _layer(family)
    expert_layout, shard_size = LAYOUTS[layout]
    for layer in (1, 2):
        if family.saved_layout == "fused" and expert_layout == "per_expert":
            continue  # no per-expert names are known for it: refused, below
        hashed = family.hash_table is not None and layer < config.num_hash_layers
        table = _table(config) if hashed else None
        if hashed:  # a hash layer routes by its table: it has no selection bias
            params = refimpl.MoEParams(params)
            params["gate.e_score_correction_bias"] = np.zeros(config.num_experts)
        folder = save_hf_layer(tmp_path / str(layer), config, params, layer, model_type=model_type,
                               expert_layout=expert_layout, shard_size=shard_size, tid2eid=table)
        if shard_size is not None:
            assert (folder / "model.safetensors.index.json").exists()
        read_config, read = refimpl.load_hf_layer(folder, layer, dtype=np.float64)
        assert read_config == config
        for name, value in params.items():
            got = np.stack(list(read[name])) if name.startswith("experts.") else read[name]
            np.testing.assert_array_equal(got, value, err_msg=f"{model_type} layer {layer}: {name}")
        if hashed:
            np.testing.assert_array_equal(read.tid2eid, table)
        else:
            assert read.tid2eid is None

        hf = json.loads((folder / "config.json").read_text())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if family.wraps is not None:  # the wrapper's own class builds from the whole file
                type(transformers.AutoConfig.for_model(model_type))(**hf)
            if family.draft is None:  # the family's class reads the keys as refimpl does
                text = hf.get("text_config", hf)
                built = getattr(transformers, family.config_class)(**text).to_dict()
                assert refimpl.MoEConfig.from_hf_config(built) == config
        if expert_layout == "fused":
            from safetensors.numpy import load_file

            base = family.block.format(L=layer)
            state = load_file(folder / "model.safetensors")
            assert all(name.startswith(base) for name in state)
            block = _hf_block(family, config, hf, layer)
            block.load_state_dict({name[len(base):]: torch.from_numpy(value) for name, value in state.items()},
                                  strict=True)


def _refused(tmp_path, match: str, config, params, layer=1, **kwargs) -> None:
    folder = tmp_path / "refused"
    with pytest.raises(ValueError, match=match):
        save_hf_layer(folder, config, params, layer, **kwargs)
    assert not folder.exists()  # nothing written


@pytest.mark.parametrize("model_type", sorted(name for name, f in ALL_RECORDS.items() if f.saved_layout == "fused"))
def test_per_expert_names_of_a_fused_only_family_are_refused_in_memory_as_on_disk(model_type):
    """The state-dict writer, its reader and the list of names refuse what the folder writer refuses.

    The writer made per-expert names for K3 in transformers' draft (no checkpoint has them), which
    `save_hf_layer` then refused to write: the same names were offered in memory and refused on disk.
    """
    from refimpl.checkpoints import family_tensor_shapes, hf_state_dict_from_params, params_from_hf_state_dict

    config, params = _layer(ALL_RECORDS[model_type])
    refusal = rf"expert_layout='per_expert': {model_type}'s folders hold its fused names only"
    with pytest.raises(ValueError, match=refusal):
        hf_state_dict_from_params(params, config, model_type=model_type, expert_layout="per_expert", layer=1)
    with pytest.raises(ValueError, match=refusal):
        family_tensor_shapes(config, model_type, "per_expert")
    fused = hf_state_dict_from_params(params, config, model_type=model_type)
    with pytest.raises(ValueError, match=refusal):
        params_from_hf_state_dict(fused, config, model_type=model_type, expert_layout="per_expert")
    again = params_from_hf_state_dict(fused, config, model_type=model_type)  # the fused names read as before
    for name in params:
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(params[name]), err_msg=name)


def test_what_a_family_cannot_express_is_refused_by_name_and_nothing_is_written(tmp_path):
    k3 = refimpl.MoEConfig.tiny(num_moe_layers=3)
    k3_params = refimpl.init_params(k3, 0)
    mixtral, mixtral_params = _layer(ALL_RECORDS["mixtral"])
    shared = mixtral.replace(num_shared_experts=1)
    _refused(tmp_path, r"num_shared_experts=1", shared, refimpl.init_params(shared, 0), model_type="mixtral")
    _refused(tmp_path, r"DeepseekV3Config \(deepseek_v3\) can hold: .*'hidden_act'.*got 'situ'", k3, k3_params,
             model_type="deepseek_v3")
    _refused(tmp_path, r"expert_layout='per_expert': kimi_k3's folders hold its fused names only", k3, k3_params,
             model_type="kimi_k3", expert_layout="per_expert")
    _refused(tmp_path, r"layer must be in \[0, 2\]: every layer of this family is an MoE layer", mixtral,
             mixtral_params, layer=3, model_type="mixtral")
    qwen, qwen_params = _layer(ALL_RECORDS["qwen3_moe"])
    qwen_params["gate.e_score_correction_bias"] = qwen_params["gate.e_score_correction_bias"] + 1.0
    _refused(tmp_path, r"nonzero values.*no selection bias", qwen, qwen_params, model_type="qwen3_moe")
    v4, v4_params = _layer(ALL_RECORDS["deepseek_v4"])
    _refused(tmp_path, r"layer 0 of this deepseek_v4 configuration routes by a table.*pass its table as tid2eid",
             v4, v4_params, layer=0, model_type="deepseek_v4")
    _refused(tmp_path, r"routes by its scores.*writing would lose it", v4, v4_params, layer=3,
             model_type="deepseek_v4", tid2eid=_table(v4))
    _refused(tmp_path, r"mxfp4=True writes K3's released packed experts", mixtral, mixtral_params,
             model_type="mixtral", mxfp4=True)
    _refused(tmp_path, r"prefix='language_model\.' places K3's released block", mixtral, mixtral_params,
             model_type="mixtral", prefix="language_model.")
    _refused(tmp_path, r"expert_layout must be None .* got 'packed'", mixtral, mixtral_params,
             model_type="mixtral", expert_layout="packed")
    _refused(tmp_path, r"model_type must be one of", mixtral, mixtral_params, model_type="gpt_oss")
    _refused(tmp_path, r"layer must be an MoE layer in \[1, 3\] \(K3's layer 0 is dense\)", k3, k3_params,
             layer=0, model_type="kimi_k3")


def test_k3s_released_layout_is_still_the_default(tmp_path):
    """Without `model_type`, K3's nested configuration and its MXFP4 experts under `block_sparse_moe.`."""
    config = refimpl.MoEConfig.tiny(hidden_size=64, latent_size=32, intermediate_size=32, num_moe_layers=2)
    params = refimpl.init_params(config, 0)
    folder = save_hf_layer(tmp_path, config, params, 1)
    hf = json.loads((folder / "config.json").read_text())
    assert hf["model_type"] == "kimi_k3" and "quantization_config" in hf["text_config"]
    from safetensors.numpy import load_file

    names = set(load_file(folder / "model.safetensors"))
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
