"""The transformers columns of the conventions page, measured: each cell is what the real block was seen to do.

For every MoE family `MoEConfig.from_hf_config` reads, this script builds
transformers' own block (the version pinned in the `test` extra) on a small
configuration in float64, fills it with random weights and a selection bias
far from zero, and runs it on 32 random tokens. Each convention is then
*measured*: refimpl's layer is computed once per way the convention could go
(sigmoid, softmax or sqrt(softplus) scores; selection by s + b, s - b or s;
mixture weights from s or s + b; a single weight kept or renormalized; dropped
groups masked with -inf or not), and the cell names the way whose output
equals the block's. No cell is typed by hand.

    .venv/bin/python docs/measure_conventions.py          # prints the table
    .venv/bin/python docs/measure_conventions.py write    # refreshes docs/pages/conventions_measured.json

The page renders the JSON; `tests/test_conventions_measured.py` measures again
and fails when the JSON no longer says what the pinned transformers does.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

RECORD = Path(__file__).resolve().parent / "pages" / "conventions_measured.json"
TOKENS, SEED = 32, 2026
#: Relative agreement that counts as "the same output": float32 routers are off by about 1e-7.
SAME = 1e-5

#: The measured layer, in `MoEConfig` field names, applied to each family's record where it has the key
#: (`refimpl.config.family_layer_keys`): 8 experts, top-2 (4 groups of 2, the best 2, where the family has
#: groups), one shared expert where it has them, layer 0 its one MoE layer.
LAYER: dict[str, Any] = dict(hidden_size=16, num_experts=8, top_k=2, intermediate_size=8, n_group=4, topk_group=2,
                             num_shared_experts=1, routed_scaling_factor=2.5, renormalize=True, swiglu_limit=0.7,
                             latent_size=8, shared_intermediate_size=8)
ATTENTION = dict(num_attention_heads=2, vocab_size=32)

#: The rows of the measured table, in order, with what each measures.
ROWS = {
    "scores": "the score function whose layer reproduces the block (top-k of all experts, so the choice is moot)",
    "selection": "the selection rule that reproduces the block, with biases spread over [-2, 2]",
    "weights": "what the chosen experts' weights are gathered from",
    "top-1 weight": "with num_experts_per_tok = 1: the single weight renormalized to 1, or kept raw",
    "dropped groups": "with biases near -20 (every biased score negative): whether dropped groups are masked with -inf",
    "float64 block": "the largest difference from refimpl's float64 layer, relative to the largest output",
}


def _block(model_type: str, keys: dict[str, Any]) -> Any:
    """transformers' block of `model_type` for `keys`, in float64, inference mode."""
    import transformers

    from refimpl.families import family_of

    family = family_of(model_type)
    config = getattr(transformers, family.config_class)(**{**ATTENTION, **keys})
    block_class = getattr(importlib.import_module(family.module), family.block_class)
    block = block_class(config, 0) if family.block_takes_layer else block_class(config)
    return block.double().eval(), config


def _filled(model_type: str, keys: dict[str, Any], bias: np.ndarray | None, rng: np.random.Generator) -> Any:
    import torch

    block, config = _block(model_type, keys)
    with torch.no_grad():
        for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
            if name == "gate.e_score_correction_bias":
                tensor.copy_(torch.from_numpy(bias if bias is not None else np.zeros(tensor.shape)))
            else:
                tensor.copy_(torch.from_numpy(rng.standard_normal(tensor.shape) * (1.0 if name == "gate.weight"
                                                                                   else 0.5)))
    return block, config


def _run(block: Any, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return block(torch.from_numpy(x)[None]).numpy()[0]


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def _layer(model_type: str, keys: dict[str, Any], bias: np.ndarray | None, seed: int) -> tuple:
    """The block's output on fixed tokens, with refimpl's config, parameters and those tokens."""
    from refimpl import MoEConfig
    from refimpl.checkpoints import params_from_hf_state_dict

    rng = np.random.default_rng(seed)
    block, hf = _filled(model_type, keys, bias, rng)
    config = MoEConfig.from_hf_config(hf.to_dict())
    params = params_from_hf_state_dict({n: t.numpy() for n, t in block.state_dict().items()}, config,
                                       model_type=model_type, dtype=np.float64)
    x = rng.standard_normal((TOKENS, config.hidden_size))
    return _run(block, x), config, params, x


def _which(y_block: np.ndarray, variants: dict[str, np.ndarray]) -> str:
    """The names of the variants whose output is the block's (joined), or "none of them"."""
    same = [name for name, y in variants.items() if _distance(y, y_block) <= SAME]
    return " = ".join(same) if same else "none of them"


def measure_family(model_type: str) -> dict[str, str]:
    """Every row of the table for one family, measured on transformers' block."""
    import refimpl
    from refimpl.families import family_of

    family = family_of(model_type)
    from refimpl.config import family_layer_keys

    keys = family_layer_keys(model_type, **LAYER)
    n = 8
    spread = np.linspace(-2.0, 2.0, n)[np.random.default_rng(SEED).permutation(n)]
    bias = spread if family.has_bias else None
    y, config, params, x = _layer(model_type, keys, bias, SEED)
    out: dict[str, str] = {}
    everyone = dict(keys, **{family.keys["top_k"].key: n})
    if "n_group" in family.keys:  # every group kept, so that every expert can be chosen
        everyone[family.keys["topk_group"].key] = everyone.get(family.keys["n_group"].key, 1)
    y_all, c_all, p_all, x_all = _layer(model_type, everyone, bias, SEED + 1)
    out["scores"] = _which(y_all, {name: refimpl.stable_latent_moe(x_all, p_all, c_all.replace(score_function=name))
                                   for name in ("sigmoid", "softmax", "sqrtsoftplus")})
    s = np.asarray(refimpl.router_scores(x, params["gate.weight"], config.score_function))
    b = params["gate.e_score_correction_bias"]

    def routed(select: np.ndarray, gather: np.ndarray) -> np.ndarray:
        index, _ = refimpl.route(select, np.zeros(n), config.top_k, renormalize=False, n_group=config.n_group,
                                 topk_group=config.topk_group)
        raw = np.take_along_axis(gather, np.asarray(index), axis=1)
        weights = (raw / raw.sum(1, keepdims=True) if config.renormalize else raw) * config.routed_scaling_factor
        return refimpl.stable_latent_moe(x, params, config, routing=(index, weights))

    if family.has_bias:
        out["selection"] = _which(y, {"s + b": routed(s + b, s), "s - b": routed(s - b, s), "s": routed(s, s)})
        out["weights"] = _which(y, {"raw s": routed(s + b, s), "s + b": routed(s + b, s + b)})
    else:
        out["selection"] = "s (no selection bias)"
        out["weights"] = _which(y, {"raw s": routed(s, s)})
    one = dict(keys, **{family.keys["top_k"].key: 1})
    y1, c1, p1, x1 = _layer(model_type, one, bias, SEED + 2)
    out["top-1 weight"] = _which(y1, {"renormalized to 1": refimpl.stable_latent_moe(x1, p1, c1.replace(
        renormalize=True)), "raw score": refimpl.stable_latent_moe(x1, p1, c1.replace(renormalize=False))})
    if config.n_group > 1:
        y_neg, c_neg, p_neg, x_neg = _layer(model_type, keys, spread * 0.1 - 20.0, SEED + 3)
        masked = _distance(refimpl.stable_latent_moe(x_neg, p_neg, c_neg), y_neg) <= SAME
        out["dropped groups"] = "-inf" if masked else "not -inf: a dropped group's expert is chosen"
    else:
        out["dropped groups"] = "no groups"
    # A bound, not the number itself: the last digits of a float32 product differ between CPUs.
    off = _distance(refimpl.stable_latent_moe(x, params, config), y)
    out["float64 block"] = next(text for limit, text in ((1e-13, "below 1e-13: float64 throughout"),
                                                         (1e-6, "below 1e-6: a float32 router"),
                                                         (np.inf, f"{off:.1e}: more than a float32 router"))
                                if off < limit)
    return out


def measure() -> dict[str, Any]:
    """The whole table: transformers' version, and each family's measured cells."""
    import transformers

    from refimpl.families import FAMILIES

    transformers.logging.set_verbosity_error()  # the small vocabulary draws warnings about token ids

    return {"transformers": transformers.__version__, "rows": ROWS,
            "families": {model_type: measure_family(model_type) for model_type in FAMILIES}}


def markdown(record: dict[str, Any]) -> str:
    """The record as the page's table: a row per family, a column per convention (the conventions are
    few and their cells short, so the table fits the page's width; the families may grow)."""
    rows = list(record["rows"])
    lines = ["| family | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for name, cells in record["families"].items():
        lines.append(f"| `{name}` | " + " | ".join(cells[row] for row in rows) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    measured = measure()
    if sys.argv[1:] == ["write"]:
        RECORD.write_text(json.dumps(measured, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {RECORD}")
    print(markdown(measured))
