r"""Golden vectors: fixed inputs and expected outputs, stage by stage, for ports in any language.

A port written in C++, CUDA, Rust or a JAX stack of its own cannot call the
conformance kit, which drives a Python function. It can read files. This
module writes them:

```bash
python -m refimpl.goldens goldens/                                  # the small cases: about 350 kilobytes
python -m refimpl.goldens goldens/ --sizes published --model-type qwen3_moe   # one family's published widths
```

For Kimi K3 and for every MoE family of transformers this package reads
(`refimpl.families.FAMILIES`), one [safetensors](https://huggingface.co/docs/safetensors) file per case, at
test sizes and at the published configuration's widths, and `manifest.json`,
which says what each file holds and how closely a port must match it. Every
file comes from fixed seeds: two runs write the same bytes. Before anything
is written, every file the run would write (each case's `.safetensors` and
the manifest) is checked: one that exists already is refused unless
`--overwrite` is given, and one that exists and is not a regular file (a
folder, a link) is refused even then. Every file is written under a
temporary name and renamed once complete.

## The manifest

```json
{
  "refimpl_version": "0.1.0",
  "reference": "float64",
  "tolerance_rule": "max |actual - expected| <= rtol * max |expected|, both maxima over the whole tensor; ...",
  "files": [
    {"file": "qwen3_moe.test.safetensors", "model_type": "qwen3_moe",
     "text_config": {"model_type": "qwen3_moe", "hidden_size": 16, "num_local_experts": 8, ...},
     "dtype": "float32", "tokens": 6, "widths": "test",
     "tolerance": {"x": 0.0, "stage.route_index": 0.0, "stage.logits": 0.0, "y": 7.62939453125e-06, ...},
     "capped": {}, "route_margin": 0.0123, "route_margin_required": 0.00098, "balancing": {"top_k": 2, "bins": 1000}}
  ]
}
```

* `model_type` is the family's (`kimi_k3` for K3), and `text_config` its
  configuration in that family's own keys: transformers'
  `ConfigClass(**text_config)` builds the block (for K3, the keys of K3's own
  modeling code, which `MoEConfig.from_hf_config` reads as K3).
* `dtype` is the type the inputs and weights are stored in (`float32` at test
  sizes, `bfloat16` at the published widths). They are the exact inputs: the
  expected values were computed from exactly these numbers, in float64, by
  `stable_latent_moe` and `stable_latent_moe_vjp`.
* `tolerance` gives, for each tensor, the relative error a correct port that
  computes in float32 stays within: $\max |a - e| \le \text{rtol} \cdot \max |e|$,
  both maxima over the whole tensor (the expected values $e$ of a file are all
  of one scale, so one maximum per tensor is all a test needs). It is
  0.0 for what must match exactly: the inputs, the weights, the route and the
  router's logits. The others are $G u$ with $u = 2^{-24}$ (float32's unit
  roundoff) and $G = 2^7$ the kit's error growth for the forward, $2^8$ for
  the gradients; each file is drawn again until this package's own float32
  evaluation of every tensor is within an eighth of it.
* `capped` names what a published-width case reduces, `{key: [published,
  written]}`: the widths $d$, $\ell$, $f$ and the shared experts are the
  published ones, the routed experts are cut to $k + 1$ (with $k \le 2$, no
  groups). Even so a published-width file is large: its shared experts and
  its $k + 1$ experts at full width run to hundreds of megabytes, and Mixtral's
  (experts 14336 wide) to about a gigabyte. A family whose configuration class
  leaves some widths without a default (dots1 leaves its expert counts `None`)
  has no published layer to write, and gets test-size files only.
* `route_margin` is the smallest gap, over the tokens, between two
  consecutive biased scores among each token's top $k + 1$ (and between the
  chosen and the first unchosen group score where the family has groups);
  `route_margin_required` is what the draw demanded, $2^{-10}(1 + \max_j |b_j|)$.

## The tensors of one file

| name | shape | what |
|---|---|---|
| `x` | `[m, d]` | the tokens |
| the block's own names | | the weights, under the names of the family's block `state_dict()`, block-relative (`gate.weight`, `experts.gate_up_proj`, ...; for K3 `experts.E.w1.weight`, ...) |
| `stage.logits` | `[m, n]` | $x W_r^\top$ |
| `stage.scores` | `[m, n]` | $s$, the family's score function of the logits |
| `stage.biased_scores` | `[m, n]` | $s + b$ (equal to $s$ for a family without a bias) |
| `stage.route_index` | `[m, k]` int64 | the chosen experts, by biased score descending |
| `stage.route_weights` | `[m, k]` | their mixture weights $p$ (renormalized and scaled as the family does) |
| `stage.latent` | `[m, ℓ]` | $z = x W_\downarrow^\top$ (only with a latent projection) |
| `stage.expert_outputs` | `[m, k, ℓ]` | $E_e(z_i)$ of each chosen expert, unweighted, in the order of `route_index` |
| `stage.latent_sum` | `[m, ℓ]` | $u_i = \sum_r p_{i,r} E_{e_r}(z_i)$ (ℓ = d without a latent projection) |
| `stage.normed` | `[m, ℓ]` | $v = \operatorname{RMSNorm}(u) \odot g$ (only with the latent norm) |
| `stage.routed_output` | `[m, d]` | $v W_\uparrow^\top$ (or $u$ without a latent projection) |
| `stage.shared_output` | `[m, d]` | the shared experts' output (only with shared experts) |
| `stage.output`, `y` | `[m, d]` | the block's output |
| `dy` | `[m, d]` | a fixed upstream gradient |
| `grad.x`, `grad.<weight name>` | | $\partial (\sum dy \odot y) / \partial \cdot$ (test sizes only; no entry for the selection bias, which only selects) |
| `balancing.scores`, `balancing.bias` | `[M, n]`, `[n]` | a batch of scores and the bias that routes it |
| `balancing.eq14` | `[n]` | `quantile_balancing_update(scores, bias, top_k)`: Eq. (14), exact |
| `balancing.appendix_d` | `[n]` | `histogram_balancing_update(scores, bias, top_k, bins)`: Appendix D |

Expected values are float64. The published-width files hold no gradients
(the weight gradients would double files that are already hundreds of
megabytes); the test-size files hold them all.

## Why float32 cannot flip a route

transformers' routers, and most ports, compute the gate in float32. The
tokens are multiples of $1/32$ in $[-8, 8]$ and the router's weights are
$0$ or $\pm 2^{-e}$: every product is a multiple of $2^{-5-e}$ and no partial
sum of a dot product of width below 65536 needs more than 24 bits, so a
float32 router computes exactly the float64 logits, in any summation order
(the tolerance of `stage.logits` is 0). What is left to round is the score
function and the addition of the bias, a few units of float32's roundoff, and
every token's consecutive biased scores among its top $k + 1$ are at least
`route_margin_required` apart, thousands of times that. The Appendix D batch
is drawn so that no required bias $r_{i,j}$ lies within $2^{-8}$ of a bin
width of a bin edge: a float32 port counts every value in the same bin.

## A C++ test that reads one file

safetensors is an 8-byte little-endian header length, a JSON header (`{name:
{"dtype", "shape", "data_offsets": [begin, end]}}`), then the bytes. This test
needs nothing but the C++ standard library and [nlohmann/json](https://github.com/nlohmann/json):

```cpp
#include <nlohmann/json.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <vector>

struct File {
  nlohmann::json header; std::vector<char> data;
  explicit File(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    uint64_t n = 0; in.read(reinterpret_cast<char*>(&n), 8);
    std::string text(n, ' '); in.read(text.data(), n);
    header = nlohmann::json::parse(text);
    data.assign(std::istreambuf_iterator<char>(in), {});
  }
  template <class T> std::vector<T> get(const std::string& name) const {  // F32 -> float, F64 -> double
    auto off = header.at(name).at("data_offsets");
    size_t begin = off[0], end = off[1];
    std::vector<T> out((end - begin) / sizeof(T));
    std::memcpy(out.data(), data.data() + begin, end - begin);
    return out;
  }
};

int main() {
  auto manifest = nlohmann::json::parse(std::ifstream("goldens/manifest.json"));
  for (auto& entry : manifest["files"]) {
    if (entry["file"] != "qwen3_moe.test.safetensors") continue;
    File f("goldens/" + entry["file"].get<std::string>());
    size_t m = f.header["x"]["shape"][0], n = f.header["stage.scores"]["shape"][1];
    std::vector<float> x = f.get<float>("x"), w = f.get<float>("gate.weight");  // [m, d], [n, d]
    std::vector<double> expected = f.get<double>("stage.scores");               // [m, n]
    std::vector<float> scores = my_router_scores(x, w, m, n);                   // the port under test
    double rtol = entry["tolerance"]["stage.scores"], scale = 0, error = 0;
    for (size_t i = 0; i < m * n; ++i) {
      scale = std::max(scale, std::abs(expected[i]));
      error = std::max(error, std::abs(scores[i] - expected[i]));
    }
    if (error > rtol * scale) { std::cerr << "stage.scores off by " << error / scale << "\n"; return 1; }
  }
  return 0;
}
```

The same loop holds every other stage; `stage.route_index` (dtype `I64`)
must be equal, and a CUDA test copies the inputs to the device and the
outputs back before the same comparison. `tests/test_goldens.py` reads the
files with safetensors' PyTorch reader and holds each family's files against
transformers' own block and K3's against a PyTorch transcription of its code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ._lib.files import write_atomically
from .balancing import histogram_balancing_update, quantile_balancing_update, required_bias
from .checkpoints import hf_state_dict_from_params
from .config import HF_KEYS, MoEConfig
from .families import ALL_RECORDS, FAMILIES, HFFamily
from .layer.activations import expert_glu
from .layer.backward import stable_latent_moe_vjp
from .layer.latent_moe import MoEParams, parameter_shapes, stable_latent_moe

__all__ = ["GRAD_TOLERANCE", "MANIFEST", "STAGE_TOLERANCE", "GoldenCase", "family_text_config", "golden_cases",
           "golden_tensors", "main", "relative_error", "route_margin",
           "write_goldens"]

#: The name of the manifest in the folder.
MANIFEST = "manifest.json"

U32 = 2.0**-24  # float32's unit roundoff
#: The relative tolerance of a forward stage for a port computing in float32: $G u$, $G = 2^7$.
STAGE_TOLERANCE = 2.0**7 * U32
#: The relative tolerance of a gradient: $2^8 u$ (the backward is a longer chain of products).
GRAD_TOLERANCE = 2.0**8 * U32
#: This package's own float32 evaluation must be within this fraction of the tolerance, or the case is redrawn.
CONDITIONING = 1 / 8

GRID = 32  # tokens are integers / GRID ...
GRID_LIMIT = 256  # ... of magnitude at most GRID_LIMIT (8.0): eight significant bits, exact in bfloat16
TEST_TOKENS, PUBLISHED_TOKENS, BALANCING_TOKENS = 6, 4, 16
BINS = 1000  # K3's histogram
SEED = 2026
ATTEMPTS = 64

TOLERANCE_RULE = ("max |actual - expected| <= rtol * max |expected|, both maxima over the whole tensor; rtol 0 "
                  "means equal. Expected values are float64, computed from exactly the stored inputs; "
                  "rtol is what a correct port computing in float32 stays within.")


# ---------------------------------------------------------------------------
# The cases: K3 and every family, at test sizes and at published widths
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GoldenCase:
    """One file: a layer, in its family's keys, with its storage dtype and token count."""

    name: str  #: the file's stem
    model_type: str  #: a family of `FAMILIES`, or "kimi_k3"
    text_config: dict[str, Any]  #: the family's own keys
    config: MoEConfig  #: what `MoEConfig.from_hf_config` reads from them
    dtype: str  #: "float32" or "bfloat16": the stored inputs and weights
    tokens: int
    published: bool
    capped: dict[str, list[Any]] = field(default_factory=dict)  #: key -> [published value, written value]
    activation_scale: float = 1.0  #: gate and up weights scaled by this (large pre-activations reach SiTU's caps)


def _layer_keys(family: HFFamily) -> dict[str, Any]:
    """Keys that make layer 0 of a one-layer model the family's MoE block (its own layer rule)."""
    if family.layers == "layers_block_type":
        return {"layers_block_type": ["moe"]}
    keys: dict[str, Any] = {"num_hidden_layers": 1}
    if family.layers in ("first_k_dense", "mlp_layer_types"):
        keys["first_k_dense_replace"] = 0
    if family.layers == "hash_mlp_layer_types":  # a learned top-k layer, not a hash-table one
        keys["mlp_layer_types"] = ["moe"]
    return keys


def family_text_config(config: MoEConfig, family: HFFamily) -> dict[str, Any]:
    """`config` in `family`'s own keys; a `ValueError` if those keys read back as another layer.

    Every field the family configures is written under its key (the activation and score function by
    transformers' names); a latent projection, where the family can have one, as `moe_latent_size`.
    """
    text: dict[str, Any] = {"model_type": family.model_type, **_layer_keys(family)}
    values = {name: getattr(config, name) for name in family.keys}
    for name, spec in family.keys.items():
        value = values[name]
        if spec.kind == "activation":
            value = spec.default  # the family's one activation, by its transformers name
        elif spec.kind == "score":
            value = {"sqrtsoftplus": "sqrtsoftplus", "sigmoid": "sigmoid"}[value]
        text[spec.key] = value
    if "shared_intermediate_size" in family.keys:
        text[family.keys["shared_intermediate_size"].key] = config.shared_size
    if "use_latent_projection" not in family.fixed and config.use_latent_projection:
        text["moe_latent_size"] = config.latent_size
    read = MoEConfig.from_hf_config(text, code="transformers")
    if read.replace(num_moe_layers=config.num_moe_layers) != config:
        raise ValueError(f"{family.model_type}'s keys cannot express {config}: they read as {read}")
    return text


def _test_config(family: HFFamily) -> MoEConfig:
    """A small layer of the family: d = 16, 8 experts, groups and shared experts where it has them."""
    keys = family.keys
    fields: dict[str, Any] = {**family.fixed, "hidden_size": 16, "latent_size": 16, "num_experts": 8,
                              "intermediate_size": 6, "num_moe_layers": 1, "top_k": 2,
                              "rms_norm_eps": keys["rms_norm_eps"].default}
    fields["activation"] = "relu2" if keys["activation"].default == "relu2" else "swiglu"
    fields.setdefault("situ_linear_beta", None)
    if "n_group" in keys:  # group-limited routing: 4 groups of 2, the best 2 kept, top-3
        fields.update(n_group=4, topk_group=2, top_k=3)
    if "num_shared_experts" in keys:
        fields["num_shared_experts"] = 1
    if "shared_intermediate_size" in keys:
        fields["shared_intermediate_size"] = 12
    if "routed_scaling_factor" in keys:
        fields["routed_scaling_factor"] = 2.5
    if "renormalize" in keys:
        fields["renormalize"] = keys["renormalize"].default
    if "score_function" in keys:
        fields["score_function"] = {"sqrtsoftplus": "sqrtsoftplus", "sigmoid": "sigmoid"}[keys["score_function"].default]
    if "swiglu_limit" in keys:
        fields["swiglu_limit"] = 1.0  # small, so that the clamp cuts
    if "use_latent_projection" not in family.fixed:  # a family with an optional latent: use it
        fields.update(use_latent_projection=True, latent_size=8)
    return MoEConfig(**fields)


def _published_config(family: HFFamily) -> MoEConfig:
    """The layer the family's configuration class builds from no keys: the checkpoint its defaults are."""
    return MoEConfig.from_hf_config({"model_type": family.model_type, **_layer_keys(family)}, code="transformers")


#: Published layers whose family's configuration class defaults to another model: each is written in the one
#: family whose keys express it (NVIDIA's LatentMoE as published, a Nemotron-H layer).
EXTRA_PUBLISHED = (MoEConfig.nemotron_3_super,)


def _capped(config: MoEConfig) -> tuple[MoEConfig, dict[str, str]]:
    """The published widths with k + 1 routed experts (k <= 2) and no groups; field -> [published, written]."""
    k = min(config.top_k, 2)
    changes = {"top_k": k, "num_experts": min(config.num_experts, k + 1), "n_group": 1, "topk_group": 1}
    changed = {name: [getattr(config, name), value] for name, value in changes.items()
               if getattr(config, name) != value}
    return config.replace(**changes), changed


def _spelled(changed: Mapping[str, list[Any]], family: HFFamily | None) -> dict[str, list[Any]]:
    """The capped fields under the family's keys (K3's keys for K3)."""
    keys = HF_KEYS if family is None else {name: spec.key for name, spec in family.keys.items()}
    return {keys.get(name, name): value for name, value in changed.items()}


def golden_cases(sizes: str = "test", model_types: Sequence[str] | None = None) -> list[GoldenCase]:
    """The cases `write_goldens` writes: `sizes` is "test", "published" or "all"; `model_types` keeps only
    those families' cases ("kimi_k3" for K3's), all of them when None."""
    if sizes not in ("test", "published", "all"):
        raise ValueError(f"sizes must be 'test', 'published' or 'all', got {sizes!r}")
    known = ["kimi_k3", *FAMILIES]
    if model_types is not None:
        unknown = [name for name in model_types if name not in known]
        if isinstance(model_types, str) or unknown or not model_types:
            raise ValueError(f"model_types must be a non-empty list of {known}, got {model_types!r}")
    cases = _all_cases(sizes)
    return [case for case in cases if model_types is None or case.model_type in model_types]


def _all_cases(sizes: str) -> list[GoldenCase]:
    """Every case of `sizes`, K3's first and then one per family record."""
    cases: list[GoldenCase] = []
    if sizes in ("test", "all"):
        k3 = MoEConfig.tiny(hidden_size=16, latent_size=8, num_experts=8, top_k=3, intermediate_size=6,
                            num_shared_experts=1, situ_beta=2.0, situ_linear_beta=3.0)
        cases.append(GoldenCase("kimi_k3.test", "kimi_k3", k3.to_hf_config(), k3, "float32", TEST_TOKENS, False,
                                activation_scale=3.0))
        for model_type, family in FAMILIES.items():
            config = _test_config(family)
            cases.append(GoldenCase(f"{model_type}.test", model_type, family_text_config(config, family), config,
                                    "float32", TEST_TOKENS, False))
    if sizes in ("published", "all"):
        k3, changed = _capped(MoEConfig.k3())
        cases.append(GoldenCase("kimi_k3.published", "kimi_k3", k3.to_hf_config(), k3, "bfloat16",
                                PUBLISHED_TOKENS, True, _spelled(changed, None)))
        for model_type, family in FAMILIES.items():
            if any(spec.required for spec in family.keys.values()):
                continue  # its configuration class has no defaults for some widths: no published layer to write
            config, changed = _capped(_published_config(family))
            cases.append(GoldenCase(f"{model_type}.published", model_type, family_text_config(config, family),
                                    config, "bfloat16", PUBLISHED_TOKENS, True, _spelled(changed, family)))
        for preset in EXTRA_PUBLISHED:
            config, changed = _capped(preset())
            for model_type, family in FAMILIES.items():
                try:
                    text = family_text_config(config, family)
                except ValueError:
                    continue
                cases.append(GoldenCase(f"{model_type}.{preset.__name__}", model_type, text, config, "bfloat16",
                                        PUBLISHED_TOKENS, True, _spelled(changed, family)))
    return cases


# ---------------------------------------------------------------------------
# Drawing: tokens and a router whose float32 dot products are exact
# ---------------------------------------------------------------------------

_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _router_exponent(d: int) -> int:
    r"""$e$ with $2^{-e} \approx 1/\sqrt{d/2}$: logits of about unit size from half the weights nonzero."""
    return max(0, round(math.log2(math.sqrt(d / 2))))


def _draw(case: GoldenCase, rng: np.random.Generator) -> tuple[np.ndarray, MoEParams]:
    """Tokens `[m, d]` and weights in the case's storage dtype (the bias in float32)."""
    config, dtype = case.config, _DTYPES[case.dtype]
    d = config.hidden_size
    if d >= 2**16:
        raise ValueError(f"hidden_size {d} is too wide for a float32 router to be exact on the grid")
    x = np.clip(np.rint(rng.standard_normal((case.tokens, d)) * GRID), -GRID_LIMIT, GRID_LIMIT) / GRID
    params = MoEParams()
    has_bias = ALL_RECORDS[case.model_type].has_bias
    for name, shape in parameter_shapes(config).items():
        if name == "gate.weight":  # 0 or +-2^-e, half of them nonzero
            sign = rng.integers(0, 2, shape) * 2.0 - 1.0
            value = sign * (rng.random(shape) < 0.5) * 2.0**-_router_exponent(d)
        elif name == "gate.e_score_correction_bias":
            spread = 0.2 if config.score_function != "softmax" else 0.0
            params[name] = (spread * rng.standard_normal(shape) if has_bias else np.zeros(shape)).astype(np.float32)
            continue
        elif name == "routed_expert_norm.weight":
            value = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        else:
            value = rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(max(shape[-1], 1)))
            if name in ("experts.w1", "experts.w3", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"):
                value *= np.float32(case.activation_scale)
        params[name] = value.astype(dtype)
    if config.activation == "relu2":  # ungated experts: the gate matrix is the up matrix
        params["experts.w1"] = params["experts.w3"]
        params["shared_experts.gate_proj.weight"] = params["shared_experts.up_proj.weight"]
    return x.astype(dtype), params


def _as64(params: Mapping[str, np.ndarray]) -> MoEParams:
    return MoEParams((name, np.asarray(value, dtype=np.float64)) for name, value in params.items())


def route_margin(biased: np.ndarray, config: MoEConfig) -> float:
    """The smallest gap between consecutive biased scores among each token's top k + 1 (and its groups')."""
    m, n = biased.shape
    gaps = [np.inf]
    if config.n_group > 1 and config.topk_group < config.n_group:
        grouped = np.sort(biased.reshape(m, config.n_group, -1), axis=-1)[:, :, ::-1]  # [m, G, n/G]
        group_score = grouped[:, :, :2].sum(-1)  # [m, G]
        ordered = np.sort(group_score, axis=-1)[:, ::-1]
        gaps.append(float((ordered[:, config.topk_group - 1] - ordered[:, config.topk_group]).min()))
        chosen = np.argsort(-group_score, axis=-1, kind="stable")[:, :config.topk_group]  # [m, tg]
        group_of = np.arange(n) // (n // config.n_group)
        kept = (group_of[None, :, None] == chosen[:, None, :]).any(-1)  # [m, n]
        biased = np.where(kept, biased, -np.inf)
    ordered = np.sort(biased, axis=-1)[:, ::-1][:, :config.top_k + 1]  # [m, k + 1]
    ordered = np.where(np.isfinite(ordered), ordered, np.nan)
    steps = ordered[:, :-1] - ordered[:, 1:]
    if np.isfinite(steps).any():
        gaps.append(float(np.nanmin(steps)))
    return min(gaps)


def _required_margin(bias: np.ndarray) -> float:
    return 2.0**-10 * (1 + float(np.abs(bias).max(initial=0.0)))


# ---------------------------------------------------------------------------
# The expected values
# ---------------------------------------------------------------------------

def _stages(x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig) -> dict[str, np.ndarray]:
    """Every intermediate of Eq. (11) for `x` (in the dtype of `x`: float64 for the reference)."""
    out = stable_latent_moe(x, params, config, return_intermediates=True)
    dtype = out.y.dtype
    w = {name: np.asarray(params[name], dtype=dtype) for name in ("gate.weight", "experts.w1", "experts.w3",
                                                                 "experts.w2")}
    bias = np.asarray(params["gate.e_score_correction_bias"], dtype=dtype)
    stages = {"stage.logits": x @ w["gate.weight"].T, "stage.scores": out.scores,
              "stage.biased_scores": out.scores + bias, "stage.route_index": out.index.astype(np.int64),
              "stage.route_weights": out.weights}
    if config.use_latent_projection:
        stages["stage.latent"] = out.z
    m, k = out.index.shape
    experts = np.zeros((m, k, out.z.shape[1]), dtype=dtype)  # [m, k, l]
    for i in range(m):
        for r, e in enumerate(out.index[i]):
            a, b = w["experts.w1"][e] @ out.z[i], w["experts.w3"][e] @ out.z[i]  # [f]
            experts[i, r] = w["experts.w2"][e] @ expert_glu(a, b, config)
    stages["stage.expert_outputs"] = experts
    stages["stage.latent_sum"] = out.u
    if config.use_latent_norm:
        stages["stage.normed"] = out.v
    stages["stage.routed_output"] = out.y_routed
    if config.shared_size > 0:
        stages["stage.shared_output"] = out.y_shared
    stages["stage.output"] = out.y
    return {name: np.ascontiguousarray(value) for name, value in stages.items()}


def _gradients(x: np.ndarray, params: Mapping[str, np.ndarray], dy: np.ndarray, config: MoEConfig,
               model_type: str | None) -> dict[str, np.ndarray]:
    """`grad.x` and each weight's gradient under the block's names (a tied matrix gets the sum of both uses)."""
    _, backward = stable_latent_moe_vjp(x, params, config)
    dx, dparams = backward(dy)
    dparams = MoEParams(dparams)
    if config.activation == "relu2":  # one matrix is both the gate and the up weight: its gradient is the sum
        for gate, up in (("experts.w1", "experts.w3"),
                         ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")):
            dparams[gate] = dparams[up] = dparams[gate] + dparams[up]
    named = hf_state_dict_from_params(dparams, config, model_type=model_type)
    grads = {"grad.x": dx}
    grads.update({f"grad.{name}": value for name, value in named.items() if not name.endswith("correction_bias")})
    return {name: np.ascontiguousarray(value) for name, value in grads.items()}


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected| (the manifest's rule; 0 for two empty or all-zero tensors)."""
    expected = np.asarray(expected, dtype=np.float64)
    diff = float(np.abs(np.asarray(actual, dtype=np.float64) - expected).max(initial=0.0))
    scale = float(np.abs(expected).max(initial=0.0))
    return diff / scale if scale > 0 else diff


def _balancing(config: MoEConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A batch of sigmoid scores and a bias (n of the layer's experts, its k), with the Eq. (14) and Appendix D
    updates.

    Redrawn until no required bias lies within 2^-8 of a bin width of a bin edge (so float32 counts the same)
    and this package's float32 evaluation of both updates is within `CONDITIONING` of their tolerance.
    A bias of zeros would put each token's cutoff expert exactly on an edge: the bias is drawn, N(0, 0.2^2).
    """
    n, k = config.num_experts, config.top_k
    for _ in range(ATTEMPTS):
        bias = (0.2 * rng.standard_normal(n)).astype(np.float32)
        bias64 = bias.astype(np.float64)
        low = float(bias64.min()) - 1.0
        width = (float(bias64.max()) + 1.0 - low) / BINS
        logits = 1.5 * rng.standard_normal((BALANCING_TOKENS, n))
        scores = (1 / (1 + np.exp(-logits))).astype(np.float32)  # [M, n]
        position = (required_bias(scores.astype(np.float64), bias64, k) - low) / width  # in bins
        if np.abs(position - np.rint(position)).min() < 2.0**-8:
            continue
        scores64 = scores.astype(np.float64)
        out = {"balancing.scores": scores, "balancing.bias": bias,
               "balancing.eq14": quantile_balancing_update(scores64, bias64, k),
               "balancing.appendix_d": histogram_balancing_update(scores64, bias64, k, BINS)}
        ours = {"balancing.eq14": quantile_balancing_update(scores, bias, k),  # float32, as a port computes
                "balancing.appendix_d": histogram_balancing_update(scores, bias, k, BINS)}
        if all(relative_error(ours[name], out[name]) <= CONDITIONING * STAGE_TOLERANCE for name in ours):
            return out
    raise RuntimeError(f"no balancing batch kept every required bias away from the bin edges (and float32 within "
                       f"its tolerance) in {ATTEMPTS} draws")


def golden_tensors(case: GoldenCase) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors of one case's file, and its manifest entry (without `file`).

    The draw is repeated with the next seed until the route margin holds and this package's float32
    evaluation of every stage (and gradient) is within `CONDITIONING` of its tolerance.
    """
    model_type = None if ALL_RECORDS[case.model_type].k3_configuration else case.model_type  # K3: its own names
    config = case.config
    seed = SEED + sum(case.name.encode())  # fixed per case
    for attempt in range(ATTEMPTS):
        rng = np.random.default_rng([seed, attempt])
        x, params = _draw(case, rng)
        x64, params64 = x.astype(np.float64), _as64(params)
        stages = _stages(x64, params64, config)
        bias = params64["gate.e_score_correction_bias"]
        margin, required = route_margin(stages["stage.biased_scores"], config), _required_margin(bias)
        if margin < required:
            continue
        tolerance: dict[str, float] = {"x": 0.0}
        tolerance.update({name: STAGE_TOLERANCE for name in stages})
        tolerance["stage.route_index"] = tolerance["stage.logits"] = 0.0
        tensors: dict[str, np.ndarray] = {"x": x}
        dy = None
        if not case.published:
            dy = rng.standard_normal(x.shape).astype(np.float32)
            grads = _gradients(x64, params64, dy.astype(np.float64), config, model_type)
            tolerance["dy"] = 0.0
            tolerance.update({name: GRAD_TOLERANCE for name in grads})
        if not _float32_agrees(x, params, config, stages, tolerance, dy, grads if dy is not None else {},
                               model_type):
            continue
        weights = hf_state_dict_from_params(params, config, model_type=model_type)
        tensors.update(weights)
        tolerance.update({name: 0.0 for name in weights})
        tensors.update(stages)
        tensors["y"] = stages["stage.output"]
        tolerance["y"] = STAGE_TOLERANCE
        if dy is not None:
            tensors["dy"] = dy
            tensors.update(grads)
        balancing = _balancing(config, rng)
        tensors.update(balancing)
        tolerance.update({"balancing.scores": 0.0, "balancing.bias": 0.0, "balancing.eq14": STAGE_TOLERANCE,
                          "balancing.appendix_d": STAGE_TOLERANCE})
        entry = {"model_type": case.model_type, "text_config": case.text_config, "dtype": case.dtype,
                 "tokens": case.tokens, "widths": "published" if case.published else "test",
                 "tolerance": {name: tolerance[name] for name in sorted(tensors)}, "capped": case.capped,
                 "route_margin": margin, "route_margin_required": required,
                 "balancing": {"top_k": config.top_k, "bins": BINS}}
        return {name: np.ascontiguousarray(value) for name, value in tensors.items()}, entry
    raise RuntimeError(f"{case.name}: no draw in {ATTEMPTS} met the route margin and the float32 conditioning")


def _float32_agrees(x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
                    stages: Mapping[str, np.ndarray], tolerance: Mapping[str, float], dy: np.ndarray | None,
                    grads: Mapping[str, np.ndarray], model_type: str | None) -> bool:
    """Whether this package's float32 evaluation is within `CONDITIONING` of every tolerance (the case's check)."""
    x32 = x.astype(np.float32)
    params32 = MoEParams((name, np.asarray(value, dtype=np.float32)) for name, value in params.items())
    ours = _stages(x32, params32, config)
    if not np.array_equal(ours["stage.route_index"], stages["stage.route_index"]):
        return False
    for name, expected in stages.items():
        if name != "stage.route_index" and relative_error(ours[name], expected) > CONDITIONING * max(tolerance[name], U32):
            return False
    if dy is not None:
        ours_grads = _gradients(x32, params32, dy, config, model_type)
        for name, expected in grads.items():
            if relative_error(ours_grads[name], expected) > CONDITIONING * tolerance[name]:
                return False
    return True


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------

def _safetensors_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save(dict(tensors), metadata={"format": "pt"})


def _check_targets(folder: Path, names: Sequence[str], overwrite: bool) -> None:
    """Refuse, before anything is written, a run that would replace what it was not asked to replace.

    Raises `FileExistsError` naming the first of `names` in `folder` that exists and is not a regular file
    (never replaced: a rename over a folder fails halfway through the run, and one over a link replaces the
    link), else the first that exists at all when `overwrite` is False.
    """
    present = [folder / name for name in names if os.path.lexists(folder / name)]
    for path in present:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a regular file: move it away (--overwrite replaces "
                                  "only regular files)")
    if present and not overwrite:
        raise FileExistsError(f"{present[0]} exists: pass --overwrite (overwrite=True) to replace it")


def write_goldens(folder: str | os.PathLike, *, sizes: str = "test", model_types: Sequence[str] | None = None,
                  overwrite: bool = False, log: Any = None) -> dict[str, Any]:
    """Write the golden files and `manifest.json` into `folder` (created if absent); returns the manifest.

    Every file the call would write (each case's `.safetensors` and the manifest) is checked before any is
    written: one that exists already is refused (`FileExistsError`, naming it) unless `overwrite`, and one
    that exists and is not a regular file (a folder, a symbolic link, a FIFO) is refused even with
    `overwrite`, so that a refused call leaves the folder as it was, and a user's own file of the same name
    is never replaced unasked. A path that is not a folder is a `NotADirectoryError`. Each file is written
    atomically, the manifest last.
    """
    from . import __version__

    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {type(overwrite).__name__} {overwrite!r}")
    cases = golden_cases(sizes, model_types)
    folder = Path(folder)
    if os.path.lexists(folder) and not folder.is_dir():
        raise NotADirectoryError(f"{folder} exists and is not a folder: the golden files need a folder")
    _check_targets(folder, [MANIFEST, *(f"{case.name}.safetensors" for case in cases)], overwrite)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for case in cases:
        tensors, entry = golden_tensors(case)
        name = f"{case.name}.safetensors"
        write_atomically(folder / name, _safetensors_bytes(tensors))
        files.append({"file": name, **entry})
        if log is not None:
            log(f"{name}: {(folder / name).stat().st_size:,} bytes")
    manifest = {"refimpl_version": __version__, "reference": "float64", "tolerance_rule": TOLERANCE_RULE,
                "files": files}
    write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m refimpl.goldens DIR [--sizes test|published|all] [--model-type NAME ...] [--overwrite]`."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.goldens",
                                     description="Write golden vectors (safetensors files and manifest.json).")
    parser.add_argument("folder", help="the folder to write into (created if absent)")
    parser.add_argument("--sizes", choices=("test", "published", "all"), default="test",
                        help="the small cases (default, about 350 kB), the published widths (hundreds of MB "
                             "a family, about 3 GB in all), or both")
    parser.add_argument("--model-type", action="append", dest="model_types", metavar="NAME",
                        choices=["kimi_k3", *FAMILIES],
                        help="only this family's cases (repeat for several; kimi_k3 for K3's); all by default")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace golden files and a manifest already in the folder (regular files only)")
    args = parser.parse_args(argv)
    try:
        manifest = write_goldens(args.folder, sizes=args.sizes, model_types=args.model_types,
                                 overwrite=args.overwrite,
                                 log=lambda line: print(line, flush=True))
    except (OSError, ValueError) as exc:
        print(f"python -m refimpl.goldens: {exc}", file=sys.stderr)
        return 2
    print(f"{len(manifest['files'])} files and {MANIFEST} in {args.folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
