"""How closely refimpl agrees with transformers' own MoE blocks, family by family, in float64.

For each family of `refimpl.families` this builds transformers' block (float64, inference mode) on a few
small configurations drawn from a seed, fills it with random weights (selection biases far from zero where
the router has one), reads the configuration with `MoEConfig.from_hf_config` and the tensors with
`params_from_hf_state_dict(..., model_type=...)`, runs both on the same tokens, and prints the largest
difference relative to the largest output. transformers computes every router but DeepSeek-V4's in float32
(and Nemotron-H sums its experts in float32) even in a float64 block, so the differences are float32's
rounding, not float64's (DeepSeek-V4's router runs in the block's dtype); a token whose two candidate experts are closer than that rounding could route differently.

    python benchmarks/families_agreement.py            # needs torch and transformers (the test extra)
"""

from __future__ import annotations

import argparse
import importlib
import warnings

import numpy as np
import torch
import transformers

import refimpl
from refimpl.config import family_layer_keys
from refimpl.families import FAMILIES

#: The measured layer, in `MoEConfig` field names, applied to each family's record where it has the key:
#: width 64, 16 experts, top-4, groups where the family has them, a clamp that cuts (DeepSeek-V4), a latent
#: of 32 (Nemotron-H).
LAYER = dict(hidden_size=64, num_experts=16, top_k=4, intermediate_size=32, n_group=4, topk_group=2,
             num_shared_experts=1, renormalize=True, routed_scaling_factor=2.5, swiglu_limit=1.0, latent_size=32,
             shared_intermediate_size=48)


def agreement(model_type: str, seed: int, tokens: int = 64) -> float:
    """max |y_transformers - y_refimpl| / max |y| on one draw, float64."""
    family = FAMILIES[model_type]
    hf = getattr(transformers, family.config_class)(num_attention_heads=2, num_key_value_heads=2,
                                                     **family_layer_keys(model_type, **LAYER))
    block_class = getattr(importlib.import_module(family.module), family.block_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = (block_class(hf, 0) if family.block_takes_layer else block_class(hf)).double().eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
            value = (rng.uniform(-0.5, 0.5, tensor.shape) - 20.0 if name == "gate.e_score_correction_bias"
                     else rng.standard_normal(tensor.shape) * 0.2)
            tensor.copy_(torch.from_numpy(value))
    config = refimpl.MoEConfig.from_hf_config(hf.to_dict())
    params = refimpl.params_from_hf_state_dict(block.state_dict(), config, model_type=model_type)
    x = rng.standard_normal((tokens, 64))
    with torch.no_grad():
        y_block = block(torch.from_numpy(x)[None]).numpy()[0]
    y = refimpl.stable_latent_moe(x, params, config)
    return float(np.max(np.abs(y - y_block)) / np.max(np.abs(y_block)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="draws per family (default 5)")
    args = parser.parse_args(argv)
    # A block built on its own, outside a model, makes transformers log a notice that says this is expected
    # of a standalone expert module; it is not part of the table.
    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, refimpl against each block in float64, 64 tokens, "
          f"{args.seeds} draws; selection biases around -20")
    print(f"{'model_type':<12} {'largest relative difference':>28}")
    for model_type in FAMILIES:
        worst = max(agreement(model_type, seed) for seed in range(args.seeds))
        print(f"{model_type:<12} {worst:>28.2e}")


if __name__ == "__main__":
    main()
