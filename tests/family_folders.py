"""Tiny whole models of every family, saved by transformers' own `save_pretrained`, for the folder tests.

Shared by `tests/test_family_folders.py` and `benchmarks/family_folders.py`: each record of
`refimpl.families.ALL_RECORDS` whose code ships in the pinned transformers gives its model class and a small
configuration (`test_keys`: hidden 64, 8 experts, 3-4 layers); the model is built in float64 with weights drawn
at a scale where every expert matters, and saved in the three layouts a porter meets.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import numpy as np
import torch
import transformers

import refimpl
from refimpl.families import ALL_RECORDS, HFFamily

#: The layouts `save_pretrained` writes: one file, sharded with an index, and the fused in-memory names.
LAYOUTS = {"per_expert": {}, "per_expert_sharded": {"max_shard_size": "40KB"},
           "fused": {"save_original_format": False}}

#: Every record whose model ships in the pinned transformers (K3's draft does not).
SHIPPED = sorted(model_type for model_type, family in ALL_RECORDS.items() if family.draft is None)


def tiny_model(family: HFFamily, seed: int = 0) -> torch.nn.Module:
    """The family's whole model for its test configuration, float64, weights N(0, 0.2^2), biases far from 0."""
    if family.wraps is not None:  # a multimodal model: its configuration class is the wrapper's
        config_class = type(transformers.AutoConfig.for_model(family.model_type))
    else:
        config_class = getattr(transformers, family.config_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**family.test_keys)
        for part in (config, getattr(config, "text_config", None)):  # the experts as a loop, in any dtype
            if part is not None:
                part._experts_implementation = "eager"
        torch.manual_seed(seed)
        model = getattr(transformers, family.model_class)(config).double().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
                if name.endswith("e_score_correction_bias"):
                    tensor.add_(-20.0)  # a trained checkpoint's biases are far from zero
            elif family.hash_table is not None and name.endswith(family.hash_table):  # k distinct experts per id
                vocab, k = tensor.shape
                n = family_experts(model, family)
                rows = [torch.randperm(n, generator=generator)[:k] for _ in range(vocab)]
                tensor.copy_(torch.stack(rows))
    return model


def family_experts(model: torch.nn.Module, family: HFFamily) -> int:
    """The number of routed experts of the model's configuration, by the family's own key."""
    config = getattr(model.config, "text_config", model.config)
    return getattr(config, family.keys["num_experts"].key)


def save(model: torch.nn.Module, folder: Path, layout: str) -> Path:
    """`model.save_pretrained(folder, **LAYOUTS[layout])`, quietly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers.utils.logging as logging

        logging.set_verbosity_error()
        model.save_pretrained(folder, **LAYOUTS[layout])
    return folder


def moe_layers(folder: Path) -> list[int]:
    """The decoder layers `load_hf_layer` reads as MoE layers, by the family's own rule."""
    hf = json.loads((folder / "config.json").read_text())
    family = refimpl.config.hf_reading_family(hf)
    text = hf.get("text_config", hf)
    total, keys = refimpl.families.read_layer_keys(text, "config.json", family)
    return [layer for layer in range(total) if family.rule.is_moe(layer, keys)]


def block_of(model: torch.nn.Module, family: HFFamily, layer: int) -> torch.nn.Module:
    """The model's MoE block of decoder layer `layer`, found by its in-memory name."""
    name = family.block.format(L=layer).rstrip(".")
    block = model.get_submodule(name)
    block_class = getattr(importlib.import_module(family.module), family.block_class)
    assert isinstance(block, block_class), (name, type(block))
    return block


def block_output(block: torch.nn.Module, x: np.ndarray, token_ids: np.ndarray | None) -> np.ndarray:
    """The block's forward on hidden states `x` [m, d] (and, for a hash layer, the token ids)."""
    with torch.no_grad():
        hidden = torch.from_numpy(x)[None]  # [1, m, d]
        if token_ids is not None:
            out = block(hidden, input_ids=torch.from_numpy(token_ids)[None])
        else:
            out = block(hidden)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(x.shape).numpy()


def refimpl_output(config: refimpl.MoEConfig, params, x: np.ndarray, token_ids: np.ndarray | None) -> np.ndarray:
    """refimpl's layer on the same hidden states; a hash layer routed by its table."""
    if params.tid2eid is None:
        return refimpl.stable_latent_moe(x, params, config)
    scores = refimpl.router_scores(x, params["gate.weight"], score_function=config.score_function)
    routing = refimpl.route_by_table(scores, token_ids, params.tid2eid, renormalize=True,
                                     scaling_factor=config.routed_scaling_factor)
    return refimpl.stable_latent_moe(x, params, config, routing=routing)


def files_read(folder: Path, family: HFFamily, layer: int) -> list[str]:
    """The files of `folder` that hold a tensor of layer `layer`'s block (in either layout)."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return ["model.safetensors"]
    weight_map = json.loads(index.read_text())["weight_map"]
    bases = {family.block.format(L=layer), family.block_on_disk.format(L=layer)}
    return sorted({file for name, file in weight_map.items() if name.startswith(tuple(bases))})
