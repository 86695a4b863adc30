r"""The MoE families of transformers: their configurations, as their own classes read them, and their tensors.

K3's block descends from a line of MoE blocks that transformers now ships as
code, one record each in this module (the table below lists them; DeepSeek-V3
is also the language model of Kimi K2 and K2.5, and Nemotron-H is NVIDIA's
LatentMoE). Each spells the same quantities with its
own keys and fills an absent key with its own default, which is rarely K3's:
transformers' `KimiLinearConfig` scales the routed weights by 2.446 and builds
one shared expert when the keys are absent, where K3's own code scales by 1.0
and builds none. A porter who reads a DeepSeek-V3 file with K3's defaults
builds another layer than the one the checkpoint was trained as.

This module holds, for each `model_type`, what its configuration class and
its MoE block make of the keys (read from transformers 5.24 and tested
against it): the key of each quantity and its default, what the family fixes
(its score function, whether it renormalizes, whether it has a selection bias
or shared experts), and which decoder layers hold the MoE block.
`MoEConfig.from_hf_config` reads a file with these tables; the converters of
`refimpl.checkpoints` use the tensor layout named here.

| `model_type` | block | scores | shared experts | selection bias | MoE layers |
|---|---|---|---|---|---|
| `deepseek_v3` | `DeepseekV3MoE` | sigmoid, groups | `n_shared_experts` | yes | $L \ge$ `first_k_dense_replace` |
| `deepseek_v4` | `DeepseekV4SparseMoeBlock` | $\sqrt{\operatorname{softplus}}$, always renormalized | one, the routed width | yes (none in hash layers) | every layer; `mlp_layer_types[L] == "hash_moe"` routes by a table |
| `dots1` | `Dots1MoE` | sigmoid, groups (DeepSeek-V3's router) | `n_shared_experts` (required) | yes | $L \ge$ `first_k_dense_replace` |
| `glm4_moe` | `Glm4MoeMoE` | sigmoid, groups | `n_shared_experts` | yes | $L \ge$ `first_k_dense_replace` |
| `kimi_linear` | `KimiLinearMoE` | sigmoid, groups | `num_shared_experts` | yes | `mlp_layer_types[L] == "sparse"` |
| `qwen3_moe` | `Qwen3MoeSparseMoeBlock` | softmax | none | none | $L \notin$ `mlp_only_layers`, `decoder_sparse_step` divides $L + 1$ |
| `mixtral` | `MixtralSparseMoeBlock` | softmax, always renormalized | none | none | every layer |
| `nemotron_h` | `NemotronHMoE` | sigmoid, groups | one, `moe_shared_expert_intermediate_size` wide | yes | `layers_block_type[L] == "moe"` |

Nemotron-H is NVIDIA's LatentMoE as published: its routed experts are
ungated, $W_\downarrow \operatorname{relu}(W_\uparrow z)^2$, on a latent
$z = $ `fc1_latent_proj` $x$ of width `moe_latent_size` (no norm), brought
back by `fc2_latent_proj`; its shared expert is ungated too. This package
computes an ungated expert as the GLU $\max(a, 0)\,b$ with its gate and up
weights one matrix (`activation="relu2"`, since $\max(u, 0)\,u = \max(u, 0)^2$),
so the converters store `up_proj` as both `w1` and `w3`. Nemotron-H sums its
experts in float32 even in a float64 block, which the tests' tolerance
accounts for. A shared width of 0 falls back to the dense `intermediate_size`
in its code, and the reader does the same. `MoEConfig.nemotron_3_super()` is the
published layer (Nemotron 3 Super: $d = 4096$, a latent of 1024, 512 experts,
top-22), and a test reads the same layer from its keys through `NemotronHConfig`.

A porter of any of them starts from the model's own configuration and block:

```python
import refimpl, torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

hf = DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, n_group=4, topk_group=2)
block = DeepseekV3MoE(hf).double().eval()
for weight in block.parameters():                                # trained weights would be loaded here
    torch.nn.init.normal_(weight, std=0.1)
config = refimpl.MoEConfig.from_hf_config(hf.to_dict())          # read as DeepSeek-V3's class reads it
params = refimpl.params_from_hf_state_dict(block.state_dict(), config, model_type="deepseek_v3")
x = torch.randn(5, 64, dtype=torch.float64)
y = refimpl.stable_latent_moe(x.numpy(), params, config)          # equals block(x[None])[0]
```

The two agree to the rounding of the router, which transformers computes in
float32 even in a float64 block: `tests/test_families.py` holds every family's
forward to a bound derived from that rounding, on drawn configurations with
selection biases far from zero, and checks that the reader's defaults are the
classes' own and that its MoE-layer count is the number of blocks in the
real model.

**DeepSeek-V4** (`DeepseekV4SparseMoeBlock`) differs from DeepSeek-V3 in
four ways, each read and computed here. Its experts and its shared expert
clamp SwiGLU's branches before they meet, the gate to $\min(a, L)$ and the up
branch to $[-L, L]$ with $L$ = `swiglu_limit` (10 by default; the
`swiglu_limit` field of `MoEConfig`, whose backward passes no gradient through
a clamped entry). Its router scores with $\sqrt{\operatorname{softplus}}$ in
the block's own dtype, always renormalizes and scales by
`routed_scaling_factor` (1.5 by default). It has one shared expert of the
routed width whatever `n_shared_experts` says, and reads no `norm_topk_prob`:
the reader follows the block, not the keys it ignores. And its first layers
(`mlp_layer_types[L] == "hash_moe"`, the first 3 by default) take each
token's experts from a stored table `gate.tid2eid` `[vocab, k]` indexed by the
token id, with no selection bias: read such a layer with
`params_from_hf_state_dict(..., model_type="deepseek_v4", hash_layer=True)`,
its table with `hf_hash_table`, and route it with `route_by_table` (this
package's `hash_routing` hashes the id with a fixed function instead, for the
other-systems studies). `MoEConfig.from_hf_config` counts every layer as MoE
and the table-routed ones as `num_hash_layers`. `tests/test_deepseek_v4.py`
holds the real block against refimpl on both kinds of layer; since its router
computes in float64 in a float64 block, they agree to float64's rounding
(relative $10^{-11}$ is what the test asks).

How close, measured: `python benchmarks/families_agreement.py` builds each
block on a width of 64 with 16 experts, top-4 (groups where the family has
them, a latent of 32 for Nemotron-H), selection biases around $-20$, and 64
tokens in float64, five draws each. It printed, as the largest difference
relative to the largest output:

| `model_type` | largest relative difference |
|---|---|
| `deepseek_v3` | 1.24e-07 |
| `deepseek_v4` | 5.45e-16 |
| `dots1` | 1.24e-07 |
| `glm4_moe` | 1.24e-07 |
| `kimi_linear` | 1.24e-07 |
| `mixtral` | 9.98e-08 |
| `nemotron_h` | 1.21e-07 |
| `qwen3_moe` | 1.16e-07 |

float32's rounding, where float64's would be $10^{-16}$: the one place the two
differ is the precision of the router (and Nemotron-H's float32 sum of its
experts), which transformers fixes at float32 whatever the block's dtype.
DeepSeek-V4's router runs in the block's own dtype, and its row is float64's
rounding (that run clamps at `swiglu_limit = 1`, so the clamp is exercised).

The sigmoid families renormalize a single chosen weight too (DeepSeek-V3 with
`num_experts_per_tok = 1` gives every token weight `routed_scaling_factor`);
K3's code keeps the raw score of a single expert.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._lib.values import factor_value, integer_value, is_integer, same_json_value, shown

__all__ = ["ALL_RECORDS", "EXPERT_ROLES", "FAMILIES", "HFFamily", "HFFamilyKey", "K3_ONLY_KEYS", "LAYER_RULES",
           "MoELayerRule", "count_family_moe_layers", "family_activation", "family_of", "family_prefix",
           "is_family_moe_layer", "read_family_fields", "read_layer_keys", "record_of", "write_family_keys"]


class HFFamilyKey(NamedTuple):
    """One `MoEConfig` field as a family's configuration class reads it."""

    key: str  #: the key in `config.json` (what the class's `to_dict()` writes)
    #: what the class makes of an absent key; None: the key is required (the class leaves it `None` and its
    #: block cannot be built without it, as `Dots1Config` leaves its expert counts)
    default: Any
    kind: str  #: "integer", "count", "factor", "switch", "activation" or "score" (a score function)
    aliases: tuple[str, ...] = ()  #: other spellings the class accepts (its `attribute_map`)

    @property
    def required(self) -> bool:
        """Whether a file must give the key: the class has no default for it."""
        return self.default is None


#: The three matrices of a gated routed expert, by role, and the K3 module each is (`w1` gate, `w3` up, `w2` down).
EXPERT_ROLES: dict[str, str] = {"gate": "w1", "up": "w3", "down": "w2"}
# A block's per-expert (and shared) module names by role: transformers' own spelling, and the w1/w3/w2 of
# Mixtral's, Kimi's and DeepSeek-V4's original checkpoints.
_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_W132 = {"gate": "w1", "up": "w3", "down": "w2"}


@dataclass(frozen=True, kw_only=True)
class HFFamily:
    r"""Everything this package knows of one `model_type`: its configuration, its MoE layers and its tensors.

    The names are block-relative (`gate.weight`, `experts.gate_up_proj`); `block` and `block_on_disk` say where
    decoder layer $L$'s block sits in a whole model (`{L}` stands for the layer), in memory (and in the files
    `save_pretrained(..., save_original_format=False)` writes) and in the files `save_pretrained` writes by
    default, one module per expert under the original checkpoint's names.
    """

    model_type: str
    config_class: str  #: the transformers configuration class (of the text model, for a wrapped one)
    block_class: str  #: the transformers MoE block
    model_class: str  #: the whole model whose `save_pretrained` writes the family's folder
    module: str  #: the transformers module that defines `block_class`
    keys: dict[str, HFFamilyKey]  #: `MoEConfig` field -> how the class reads it
    fixed: dict[str, Any]  #: `MoEConfig` fields the family does not configure
    #: the name of the family's MoE-layer rule in `LAYER_RULES` ("first_k_dense", "sparse_step", "every",
    #: "mlp_layer_types", "layers_block_type" or "hash_mlp_layer_types")
    layers: str
    num_hidden_layers: int  #: the class's default layer count
    layer_defaults: dict[str, Any]  #: the class's defaults for the layer-choosing keys
    activation: str = "swiglu"  #: this package's name of the experts' activation ("swiglu", "relu2", "situ")
    #: the block of layer {L} in memory (and with `save_original_format=False`)
    block: str = "model.layers.{L}.mlp."
    block_on_disk: str = "model.layers.{L}.mlp."  #: the block of layer {L} as `save_pretrained` writes it
    #: per-expert modules on disk by role, `experts.{e}.{module}.weight` (no "gate" for ungated experts)
    expert_modules: dict[str, str] = field(default_factory=lambda: dict(_PROJ))
    #: the shared MLP's modules on disk by role, `shared_experts.{module}.weight` (in memory always
    #: `gate_proj/up_proj/down_proj`); None: the block has no shared experts
    shared_modules: dict[str, str] | None = field(default_factory=lambda: dict(_PROJ))
    bias: str | None = "gate.e_score_correction_bias"  #: the selection bias in memory; None: the router has none
    bias_on_disk: str | None = "gate.e_score_correction_bias"  #: the selection bias as `save_pretrained` writes it
    hash_table: str | None = None  #: a hash layer's table of expert ids per token id (DeepSeek-V4)
    #: the latent projections (down to the latent, back up), block-relative; None: the experts see the full width
    latent_projections: tuple[str, str] | None = None
    latent_norm: str | None = None  #: the latent RMSNorm's gain; None: no norm
    #: the wrapped text model of a multimodal model (Kimi K2.5 wraps DeepSeek-V3); None for a text model
    wraps: str | None = None
    #: where the block's code is when the pinned transformers does not ship it (a draft); None: it ships
    draft: str | None = None
    #: the configuration class of a draft, when it extends a shipped family's: that family's `model_type` (whose
    #: keys and defaults it takes) and the `MoEConfig` fields it adds under K3's own keys (`HF_KEYS`)
    draft_config: tuple[str, tuple[str, ...]] | None = None
    #: reads the family's own extra keys (Nemotron-H's latent and shared width) into `MoEConfig` fields
    extra_fields: Callable[[Mapping[str, Any], str, Mapping[str, Any]], dict[str, Any]] | None = None
    #: writes the family's own extra keys from `MoEConfig` fields (a mapping): the inverse of `extra_fields`
    extra_keys: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    #: the block's constructor takes the decoder layer's index (Nemotron-H, DeepSeek-V4)
    block_takes_layer: bool = False
    #: the expert layout of the family's folder as `save_pretrained` writes it by default: "per_expert" (the
    #: original checkpoint's modules) or "fused" (the in-memory names, for a draft whose conversion is unknown)
    saved_layout: str = "per_expert"
    #: a small configuration of the whole model in the family's own keys, for the tests (hidden 64, 8 experts)
    test_keys: dict[str, Any] = field(default_factory=dict)
    #: a file of this `model_type` that names remote code (`auto_map`) or holds a key of `K3_ONLY_KEYS` was
    #: written for K3's own modeling code, which reads it with K3's defaults (Kimi's `kimi_linear` files)
    read_by_k3_code_when_remote: bool = False

    @property
    def has_bias(self) -> bool:
        """Whether the router holds a selection bias."""
        return self.bias is not None

    @property
    def has_shared(self) -> bool:
        """Whether the block holds `shared_experts`."""
        return self.shared_modules is not None

    @property
    def gated(self) -> bool:
        """Whether each expert has a gate matrix (SwiGLU, SiTU-GLU) or only an up matrix (Nemotron-H's ReLU²)."""
        return "gate" in self.expert_modules

    @property
    def k3_configuration(self) -> bool:
        """Whether the configuration is K3's own (`MoEConfig.to_hf_config`), not keys of a transformers class."""
        return not self.keys

    @property
    def rule(self) -> MoELayerRule:
        """The family's MoE-layer rule."""
        return LAYER_RULES[self.layers]


def family_prefix(family: HFFamily, layer: int, expert_layout: str = "fused") -> str:
    """The full name of decoder layer `layer`'s block: in memory (`"fused"`) or on disk (`"per_expert"`)."""
    return (family.block if expert_layout == "fused" else family.block_on_disk).format(L=layer)


# ---------------------------------------------------------------------------
# The MoE-layer rules: which decoder layers hold the block, always in closed form
# ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class MoELayerRule:
    r"""Which decoder layers hold a family's MoE block, from the configuration's layer keys.

    `read(text, where, family, total)` checks the rule's keys and returns them; `count(total, keys)` is the
    number of MoE layers and `is_moe(layer, keys)` the rule at one layer, both in closed form (a file that says
    $10^{12}$ layers and no list is answered in constant time and memory). `hashed(layer, keys)` says whether
    an MoE layer routes by a table.
    """

    name: str
    keys: tuple[str, ...]  #: the configuration keys the rule reads
    read: Callable[[Mapping[str, Any], str, HFFamily, int], dict[str, Any]]
    count: Callable[[int, Mapping[str, Any]], int]
    is_moe: Callable[[int, Mapping[str, Any]], bool]
    hashed: Callable[[int, Mapping[str, Any]], bool] = lambda layer, keys: False
    #: the layer count is the length of a list of layer kinds (Nemotron-H), not `num_hidden_layers`
    counts_by_list: bool = False
    #: `write(layer, num_moe_layers, num_hash_layers)`: the layer keys of a file whose layer `layer` is an MoE
    #: layer and that has `num_moe_layers` of them (the first `num_hash_layers` routed by a table); a
    #: `ValueError` naming `layer` when the rule has no such file
    write: Callable[[int, int, int], dict[str, Any]] = lambda layer, n, hashed: {}
    #: `write` lists the decoder layers one by one (a kind per layer, or the dense ones), so a file for layer
    #: `layer` grows with it: `write_family_keys` refuses more than `MAX_LISTED_LAYERS` entries
    lists_layers: bool = False


#: The most layers a written configuration lists one by one: far beyond any model's few hundred layers, and a
#: `config.json` of about a megabyte. A `layer` index of $10^9$ would otherwise build a list of $10^9$ entries.
MAX_LISTED_LAYERS = 100_000


def _first_k_dense_keys(text: Mapping[str, Any], where: str, family: HFFamily, total: int) -> dict[str, Any]:
    first = text.get("first_k_dense_replace", family.layer_defaults["first_k_dense_replace"])
    return {"first_k_dense_replace": integer_value(first, f"{where}['first_k_dense_replace']", low=0)}


def _kinds_list(text: Mapping[str, Any], where: str, key: str, allowed: tuple[str, ...], total: int | None,
                kinds: Any) -> list[str]:
    """A list of layer kinds, checked: one of `allowed` per layer (`total` of them, when given)."""
    if (not isinstance(kinds, list) or (total is not None and len(kinds) != total) or not kinds
            or any(kind not in allowed for kind in kinds)):
        count = f"each of the num_hidden_layers = {total} layers" if total is not None else "each layer"
        raise ValueError(f"{where}[{key!r}] must list one of {allowed} for {count}, got {shown(kinds)}")
    return kinds


def _mlp_layer_types_keys(text: Mapping[str, Any], where: str, family: HFFamily, total: int) -> dict[str, Any]:
    """Kimi Linear: `mlp_layer_types`, or (absent) the first `first_k_dense_replace` layers dense, the rest MoE."""
    keys = _first_k_dense_keys(text, where, family, total)
    kinds = text.get("mlp_layer_types")
    keys["mlp_layer_types"] = None if kinds is None else _kinds_list(text, where, "mlp_layer_types",
                                                                     ("dense", "sparse"), total, kinds)
    return keys


def _mlp_layer_types_count(total: int, keys: Mapping[str, Any]) -> int:
    if keys["mlp_layer_types"] is None:  # $$\#\{L < N : L \ge f\}$$
        return max(0, total - keys["first_k_dense_replace"])
    return sum(kind == "sparse" for kind in keys["mlp_layer_types"])


def _mlp_layer_types_is_moe(layer: int, keys: Mapping[str, Any]) -> bool:
    kinds = keys["mlp_layer_types"]
    return layer >= keys["first_k_dense_replace"] if kinds is None else kinds[layer] == "sparse"


# The letters of Nemotron-H's `hybrid_override_pattern`, one per layer, and the layer kind each stands for.
_PATTERN_LETTERS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def _block_type_keys(text: Mapping[str, Any], where: str, family: HFFamily, total: int) -> dict[str, Any]:
    """Nemotron-H: `layers_block_type` (or `layer_types`, or the letters of `hybrid_override_pattern`).

    As `NemotronHConfig` reads them: the pattern, the older spelling, only when no list is given (next to a
    list the class ignores it); present without a list, it must be a non-empty string of the letters M, E, *
    and - (the class would crash on anything else), never passed over for the class's default layout.
    """
    kinds = text.get("layers_block_type", text.get("layer_types"))
    if kinds is None and "hybrid_override_pattern" in text:
        pattern = text["hybrid_override_pattern"]
        if not isinstance(pattern, str) or not pattern or any(char not in _PATTERN_LETTERS for char in pattern):
            raise ValueError(f"{where}['hybrid_override_pattern'] must be a string of one letter per layer "
                             f"({', '.join(_PATTERN_LETTERS)}; E for an MoE layer), got {type(pattern).__name__} "
                             f"{shown(pattern)}")
        kinds = [_PATTERN_LETTERS[char] for char in pattern]
    if kinds is None:
        kinds = family.layer_defaults["layers_block_type"]
    allowed = ("linear_attention", "moe", "full_attention", "mlp")
    return {"layers_block_type": _kinds_list(text, where, "layers_block_type", allowed, None, kinds)}


def _hash_keys(text: Mapping[str, Any], where: str, family: HFFamily, total: int) -> dict[str, Any]:
    """DeepSeek-V4's `mlp_layer_types`: every layer is MoE, the first ones (3 by default) routed by a hash table.

    As `DeepseekV4Config` builds them: an absent list is `num_hash_layers` (the older key, default 3) times
    "hash_moe", then "moe" (held here as the count alone); a longer list is cut to the layer count, a shorter
    one refused.
    """
    kinds = text.get("mlp_layer_types")
    if kinds is None:
        hashed = text.get("num_hash_layers", family.layer_defaults["num_hash_layers"])
        return {"mlp_layer_types": None,
                "num_hash_layers": min(total, integer_value(hashed, f"{where}['num_hash_layers']", low=0))}
    if (not isinstance(kinds, list) or len(kinds) < total
            or any(kind not in ("hash_moe", "moe") for kind in kinds[:total])):
        raise ValueError(f"{where}['mlp_layer_types'] must list 'hash_moe' or 'moe' for each of the "
                         f"num_hidden_layers = {total} layers, got {shown(kinds)}")
    kinds = list(kinds[:total])
    return {"mlp_layer_types": kinds, "num_hash_layers": sum(kind == "hash_moe" for kind in kinds)}


def _hash_is_hashed(layer: int, keys: Mapping[str, Any]) -> bool:
    kinds = keys["mlp_layer_types"]
    return layer < keys["num_hash_layers"] if kinds is None else kinds[layer] == "hash_moe"


def _sparse_step_keys(text: Mapping[str, Any], where: str, family: HFFamily, total: int) -> dict[str, Any]:
    step = text.get("decoder_sparse_step", family.layer_defaults["decoder_sparse_step"])
    listed = text.get("mlp_only_layers")
    listed = [] if listed is None else listed
    if not isinstance(listed, list) or not all(is_integer(L) and L >= 0 for L in listed):
        raise ValueError(f"{where}['mlp_only_layers'] must be a list of layer indices >= 0, got {shown(listed)}")
    return {"decoder_sparse_step": integer_value(step, f"{where}['decoder_sparse_step']", low=1),
            "mlp_only_layers": {int(L) for L in listed}}


def _sparse_step_count(total: int, keys: Mapping[str, Any]) -> int:
    # Layer L is MoE when it is not listed and the step divides L + 1, counted in closed form:
    # $$\#\{L < N : s \mid L + 1\} - \#\{L \in \text{listed} : L < N,\ s \mid L + 1\}$$
    step, listed = keys["decoder_sparse_step"], keys["mlp_only_layers"]
    return total // step - sum(1 for L in listed if 0 <= L < total and (L + 1) % step == 0)


def _write_every(layer: int, n: int, hashed: int) -> dict[str, Any]:
    """Every layer is MoE: a file of `n` layers, layer `layer` among them."""
    if layer >= n:
        raise ValueError(f"layer must be in [0, {n - 1}]: every layer of this family is an MoE layer, and the "
                         f"configuration has num_moe_layers = {n}, got layer {layer}")
    return {"num_hidden_layers": n}


def _write_hash(layer: int, n: int, hashed: int) -> dict[str, Any]:
    """DeepSeek-V4: every layer is MoE, the first `hashed` routed by a table."""
    return {**_write_every(layer, n, hashed), "mlp_layer_types": ["hash_moe"] * hashed + ["moe"] * (n - hashed)}


#: The MoE-layer rules of the families, by name (`HFFamily.layers`). Each writes its keys with the layers
#: before `layer` dense and `layer` the first of the `n` MoE layers (as K3's own files do from layer 1).
LAYER_RULES: dict[str, MoELayerRule] = {rule.name: rule for rule in (
    MoELayerRule(name="every", keys=(), read=lambda text, where, family, total: {},
                 count=lambda total, keys: total, is_moe=lambda layer, keys: True, write=_write_every),
    MoELayerRule(name="first_k_dense", keys=("first_k_dense_replace",), read=_first_k_dense_keys,
                 count=lambda total, keys: max(0, total - keys["first_k_dense_replace"]),  # #{L < N : L >= f}
                 is_moe=lambda layer, keys: layer >= keys["first_k_dense_replace"],
                 write=lambda layer, n, hashed: {"num_hidden_layers": layer + n, "first_k_dense_replace": layer}),
    MoELayerRule(name="mlp_layer_types", keys=("mlp_layer_types", "first_k_dense_replace"),
                 lists_layers=True,
                 read=_mlp_layer_types_keys, count=_mlp_layer_types_count, is_moe=_mlp_layer_types_is_moe,
                 write=lambda layer, n, hashed: {"num_hidden_layers": layer + n, "first_k_dense_replace": layer,
                                                 "mlp_layer_types": ["dense"] * layer + ["sparse"] * n}),
    MoELayerRule(name="layers_block_type", keys=("layers_block_type", "hybrid_override_pattern"),
                 lists_layers=True,
                 read=_block_type_keys, counts_by_list=True,
                 count=lambda total, keys: sum(kind == "moe" for kind in keys["layers_block_type"]),
                 is_moe=lambda layer, keys: keys["layers_block_type"][layer] == "moe",
                 write=lambda layer, n, hashed: {"layers_block_type": ["mlp"] * layer + ["moe"] * n}),
    MoELayerRule(name="hash_mlp_layer_types", keys=("mlp_layer_types", "num_hash_layers"), read=_hash_keys,
                 lists_layers=True,
                 count=lambda total, keys: total, is_moe=lambda layer, keys: True, hashed=_hash_is_hashed,
                 write=_write_hash),
    MoELayerRule(name="sparse_step", keys=("decoder_sparse_step", "mlp_only_layers"), read=_sparse_step_keys,
                 lists_layers=True,
                 count=_sparse_step_count,
                 is_moe=lambda layer, keys: layer not in keys["mlp_only_layers"]
                 and (layer + 1) % keys["decoder_sparse_step"] == 0,
                 write=lambda layer, n, hashed: {"num_hidden_layers": layer + n, "decoder_sparse_step": 1,
                                                 "mlp_only_layers": list(range(layer))}),
)}


# ---------------------------------------------------------------------------
# The records
# ---------------------------------------------------------------------------

# Every family here but Nemotron-H is a plain MoE: the experts see the full width (no latent, no norm).
_PLAIN = {"use_latent_projection": False, "use_latent_norm": False, "situ_linear_beta": None}


def _sigmoid_keys(experts: str, per_token: str, shared: str, group: str, renormalize: str, *, hidden: Any,
                  n: Any, k: Any, f: int, shared_count: Any, scale: float, groups: int, chosen_groups: int,
                  eps: float, aliases: Mapping[str, tuple[str, ...]], renormalizes: bool = True
                  ) -> dict[str, HFFamilyKey]:
    """The keys of a sigmoid family (DeepSeek-V3's router), with its spellings and its class's defaults."""
    def key(name: str, default: Any, kind: str) -> HFFamilyKey:
        return HFFamilyKey(name, default, kind, aliases.get(name, ()))
    return {
        "hidden_size": key("hidden_size", hidden, "integer"),
        "num_experts": key(experts, n, "integer"),
        "top_k": key(per_token, k, "integer"),
        "intermediate_size": key("moe_intermediate_size", f, "integer"),
        "num_shared_experts": key(shared, shared_count, "count"),
        "routed_scaling_factor": key("routed_scaling_factor", scale, "factor"),
        "n_group": key(group, groups, "integer"),
        "topk_group": key("topk_group", chosen_groups, "integer"),
        "renormalize": key(renormalize, renormalizes, "switch"),
        "rms_norm_eps": key("rms_norm_eps", eps, "factor"),
        "activation": key("hidden_act", "silu", "activation"),
    }


def _nemotron_h_fields(text: Mapping[str, Any], where: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Nemotron-H's latent path and shared width, as `NemotronHMoE` builds them."""
    out: dict[str, Any] = {}
    latent = text.get("moe_latent_size")
    if latent is None:  # no latent projections: the experts see the full width
        out["use_latent_projection"] = False
    else:
        out["latent_size"] = integer_value(latent, f"{where}['moe_latent_size']", low=1)
        out["use_latent_projection"] = True
    if text.get("mlp_bias", False) is not False:
        raise ValueError(f"{where}['mlp_bias'] must be false: this package's layer has no biases on the latent "
                         f"projections and the shared expert, got {shown(text['mlp_bias'])}")
    if fields["shared_intermediate_size"] == 0:  # NemotronHMLP's `intermediate_size or config.intermediate_size`
        out["shared_intermediate_size"] = integer_value(text.get("intermediate_size", 21504),
                                                        f"{where}['intermediate_size']", low=1)
    return out


def _nemotron_h_keys(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Nemotron-H's latent width (none without projections) and its unbiased MLPs, as `NemotronHConfig` keys."""
    return {"moe_latent_size": fields["latent_size"] if fields["use_latent_projection"] else None, "mlp_bias": False}


_DEEPSEEK_ALIASES = {"n_routed_experts": ("num_local_experts",)}
# The attention and vocabulary sizes every test configuration needs to build its whole model.
_TINY = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32}

_RECORDS: tuple[HFFamily, ...] = (
    HFFamily(
        model_type="deepseek_v3", config_class="DeepseekV3Config", block_class="DeepseekV3MoE",
        model_class="DeepseekV3ForCausalLM", module="transformers.models.deepseek_v3.modeling_deepseek_v3",
        keys=_sigmoid_keys("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "norm_topk_prob",
                           hidden=7168, n=256, k=8, f=2048, shared_count=1, scale=2.5, groups=8, chosen_groups=4,
                           eps=1e-6, aliases=_DEEPSEEK_ALIASES),
        fixed={**_PLAIN, "score_function": "sigmoid"}, layers="first_k_dense", num_hidden_layers=61,
        layer_defaults={"first_k_dense_replace": 3},
        test_keys={**_TINY, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "intermediate_size": 48, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_group": 2,
                   "topk_group": 1, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                   "qk_nope_head_dim": 8, "v_head_dim": 8}),
    HFFamily(
        model_type="deepseek_v4", config_class="DeepseekV4Config", block_class="DeepseekV4SparseMoeBlock",
        model_class="DeepseekV4ForCausalLM", module="transformers.models.deepseek_v4.modeling_deepseek_v4",
        keys={"hidden_size": HFFamilyKey("hidden_size", 4096, "integer"),
              "num_experts": HFFamilyKey("n_routed_experts", 256, "integer", ("num_local_experts",)),
              "top_k": HFFamilyKey("num_experts_per_tok", 6, "integer"),
              "intermediate_size": HFFamilyKey("moe_intermediate_size", 2048, "integer", ("intermediate_size",)),
              "routed_scaling_factor": HFFamilyKey("routed_scaling_factor", 1.5, "factor"),
              "score_function": HFFamilyKey("scoring_func", "sqrtsoftplus", "score"),
              "swiglu_limit": HFFamilyKey("swiglu_limit", 10.0, "factor"),
              "rms_norm_eps": HFFamilyKey("rms_norm_eps", 1e-6, "factor"),
              "activation": HFFamilyKey("hidden_act", "silu", "activation")},
        # One shared expert of the routed width and weights always renormalized, whatever n_shared_experts and
        # norm_topk_prob say: DeepseekV4SparseMoeBlock reads neither. No groups.
        fixed={**_PLAIN, "num_shared_experts": 1, "renormalize": True, "n_group": 1, "topk_group": 1},
        layers="hash_mlp_layer_types", num_hidden_layers=43, layer_defaults={"num_hash_layers": 3},
        block_on_disk="model.layers.{L}.ffn.", expert_modules=dict(_W132), shared_modules=dict(_W132),
        bias_on_disk="gate.bias", hash_table="gate.tid2eid", block_takes_layer=True,
        test_keys={**_TINY, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "num_hidden_layers": 4, "mlp_layer_types": ["hash_moe", "moe", "hash_moe", "moe"]}),
    HFFamily(
        model_type="dots1", config_class="Dots1Config", block_class="Dots1MoE", model_class="Dots1ForCausalLM",
        module="transformers.models.dots1.modeling_dots1",
        keys=_sigmoid_keys("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "norm_topk_prob",
                           hidden=4608, n=None, k=None, f=1408, shared_count=None, scale=1.0, groups=1,
                           chosen_groups=1, eps=1e-6, aliases=_DEEPSEEK_ALIASES, renormalizes=False),
        fixed={**_PLAIN, "score_function": "sigmoid"}, layers="first_k_dense", num_hidden_layers=62,
        layer_defaults={"first_k_dense_replace": 0},
        test_keys={**_TINY, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                   "moe_intermediate_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
                   "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "head_dim": 32}),
    HFFamily(
        model_type="glm4_moe", config_class="Glm4MoeConfig", block_class="Glm4MoeMoE", model_class="Glm4MoeForCausalLM",
        module="transformers.models.glm4_moe.modeling_glm4_moe",
        keys=_sigmoid_keys("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "norm_topk_prob",
                           hidden=4096, n=128, k=8, f=1408, shared_count=1, scale=1.0, groups=1, chosen_groups=1,
                           eps=1e-5, aliases=_DEEPSEEK_ALIASES),
        fixed={**_PLAIN, "score_function": "sigmoid"}, layers="first_k_dense", num_hidden_layers=46,
        layer_defaults={"first_k_dense_replace": 1},
        test_keys={**_TINY, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "intermediate_size": 48, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_group": 2,
                   "topk_group": 1, "head_dim": 32}),
    HFFamily(
        model_type="kimi_linear", config_class="KimiLinearConfig", block_class="KimiLinearMoE",
        model_class="KimiLinearForCausalLM", module="transformers.models.kimi_linear.modeling_kimi_linear",
        keys=_sigmoid_keys("num_experts", "num_experts_per_token", "num_shared_experts", "num_expert_group",
                           "moe_renormalize", hidden=2304, n=256, k=8, f=1024, shared_count=1, scale=2.446, groups=1,
                           chosen_groups=1, eps=1e-5,
                           aliases={"num_experts": ("num_local_experts",),
                                    "num_experts_per_token": ("num_experts_per_tok",),
                                    "num_shared_experts": ("n_shared_experts",), "num_expert_group": ("n_group",),
                                    "moe_renormalize": ("norm_topk_prob",)}),
        fixed={**_PLAIN, "score_function": "sigmoid"}, layers="mlp_layer_types", num_hidden_layers=27,
        layer_defaults={"first_k_dense_replace": 1},
        block_on_disk="model.layers.{L}.block_sparse_moe.", expert_modules=dict(_W132),
        read_by_k3_code_when_remote=True,
        test_keys={**_TINY, "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
                   "intermediate_size": 48, "num_hidden_layers": 3, "mlp_layer_types": ["sparse", "dense", "sparse"],
                   "num_expert_group": 2, "topk_group": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                   "head_dim": 16,
                   "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2], "short_conv_kernel_size": 4,
                                          "head_dim": 16, "num_heads": 2}}),
    HFFamily(
        model_type="mixtral", config_class="MixtralConfig", block_class="MixtralSparseMoeBlock",
        model_class="MixtralForCausalLM", module="transformers.models.mixtral.modeling_mixtral",
        keys={"hidden_size": HFFamilyKey("hidden_size", 4096, "integer"),
              "num_experts": HFFamilyKey("num_local_experts", 8, "integer", ("num_experts",)),
              "top_k": HFFamilyKey("num_experts_per_tok", 2, "integer"),
              "intermediate_size": HFFamilyKey("intermediate_size", 14336, "integer"),
              "rms_norm_eps": HFFamilyKey("rms_norm_eps", 1e-5, "factor"),
              "activation": HFFamilyKey("hidden_act", "silu", "activation")},
        fixed={**_PLAIN, "score_function": "softmax", "num_shared_experts": 0, "renormalize": True},
        layers="every", num_hidden_layers=32, layer_defaults={},
        block_on_disk="model.layers.{L}.block_sparse_moe.", expert_modules=dict(_W132), shared_modules=None,
        bias=None, bias_on_disk=None,
        test_keys={**_TINY, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                   "num_hidden_layers": 3}),
    HFFamily(
        model_type="nemotron_h", config_class="NemotronHConfig", block_class="NemotronHMoE",
        model_class="NemotronHForCausalLM", module="transformers.models.nemotron_h.modeling_nemotron_h",
        keys={"hidden_size": HFFamilyKey("hidden_size", 4096, "integer"),
              "num_experts": HFFamilyKey("n_routed_experts", 8, "integer", ("num_local_experts",)),
              "top_k": HFFamilyKey("num_experts_per_tok", 2, "integer"),
              "intermediate_size": HFFamilyKey("moe_intermediate_size", 7688, "integer"),
              "num_shared_experts": HFFamilyKey("n_shared_experts", 1, "count"),
              "shared_intermediate_size": HFFamilyKey("moe_shared_expert_intermediate_size", 7688, "count"),
              "routed_scaling_factor": HFFamilyKey("routed_scaling_factor", 1.0, "factor"),
              "n_group": HFFamilyKey("n_group", 1, "integer"),
              "topk_group": HFFamilyKey("topk_group", 1, "integer"),
              "renormalize": HFFamilyKey("norm_topk_prob", True, "switch"),
              "rms_norm_eps": HFFamilyKey("layer_norm_epsilon", 1e-5, "factor"),
              "activation": HFFamilyKey("mlp_hidden_act", "relu2", "activation")},
        fixed={"use_latent_norm": False, "situ_linear_beta": None, "score_function": "sigmoid"},
        layers="layers_block_type", num_hidden_layers=4,
        layer_defaults={"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]},
        activation="relu2", block="model.layers.{L}.mixer.", block_on_disk="backbone.layers.{L}.mixer.",
        expert_modules={"up": "up_proj", "down": "down_proj"},
        shared_modules={"up": "up_proj", "down": "down_proj"},
        latent_projections=("fc1_latent_proj.weight", "fc2_latent_proj.weight"),
        extra_fields=_nemotron_h_fields, extra_keys=_nemotron_h_keys, block_takes_layer=True,
        test_keys={**_TINY, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "moe_shared_expert_intermediate_size": 32, "intermediate_size": 48, "moe_latent_size": 32,
                   "n_group": 2, "topk_group": 1, "layers_block_type": ["moe", "mlp", "full_attention", "moe"]}),
    HFFamily(
        model_type="qwen3_moe", config_class="Qwen3MoeConfig", block_class="Qwen3MoeSparseMoeBlock",
        model_class="Qwen3MoeForCausalLM", module="transformers.models.qwen3_moe.modeling_qwen3_moe",
        keys={"hidden_size": HFFamilyKey("hidden_size", 2048, "integer"),
              "num_experts": HFFamilyKey("num_local_experts", 128, "integer", ("num_experts",)),
              "top_k": HFFamilyKey("num_experts_per_tok", 8, "integer"),
              "intermediate_size": HFFamilyKey("moe_intermediate_size", 768, "integer"),
              "renormalize": HFFamilyKey("norm_topk_prob", False, "switch"),
              "rms_norm_eps": HFFamilyKey("rms_norm_eps", 1e-6, "factor"),
              "activation": HFFamilyKey("hidden_act", "silu", "activation")},
        fixed={**_PLAIN, "score_function": "softmax", "num_shared_experts": 0}, layers="sparse_step",
        num_hidden_layers=24, layer_defaults={"decoder_sparse_step": 1, "mlp_only_layers": []},
        shared_modules=None, bias=None, bias_on_disk=None,
        test_keys={**_TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "intermediate_size": 48, "num_hidden_layers": 4, "mlp_only_layers": [0, 2], "head_dim": 32,
                   "norm_topk_prob": True}),
)

#: The MoE families of transformers 5.24 that `MoEConfig.from_hf_config` reads, by `model_type`: each a text
#: model whose block ships in the pinned transformers.
FAMILIES: dict[str, HFFamily] = {family.model_type: family for family in _RECORDS}

#: Every layout the converters and `load_hf_layer` know beyond `FAMILIES`: a multimodal model that wraps one
#: of them (Kimi K2.5 holds DeepSeek-V3 under `language_model`), and K3 in transformers' draft (`kimi_k3`,
#: its block fused under `mlp.` on K3's latent, its configuration read by K3's own code).
ALL_RECORDS: dict[str, HFFamily] = {
    **FAMILIES,
    "kimi_k25": HFFamily(
        **{**{name: getattr(FAMILIES["deepseek_v3"], name) for name in HFFamily.__dataclass_fields__},
           "model_type": "kimi_k25", "model_class": "Kimi_K25ForConditionalGeneration",
           "block": "model.language_model.layers.{L}.mlp.", "block_on_disk": "language_model.model.blocks.{L}.mlp.",
           "wraps": "deepseek_v3",
           "test_keys": {"text_config": {"model_type": "deepseek_v3", **FAMILIES["deepseek_v3"].test_keys},
                         "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                           "intermediate_size": 32, "patch_size": 4, "pos_emb_height": 4,
                                           "pos_emb_width": 4},
                         "projection_hidden_size": 32}}),
    "kimi_k3": HFFamily(
        model_type="kimi_k3", config_class="KimiK3TextConfig", block_class="KimiK3MoE", model_class="KimiK3ForCausalLM",
        module="transformers.models.kimi_k3.modeling_kimi_k3", keys={}, fixed={"use_latent_projection": True,
                                                                            "use_latent_norm": True},
        layers="mlp_layer_types", num_hidden_layers=93, layer_defaults={"first_k_dense_replace": 1},
        activation="situ", latent_projections=("routed_expert_down_proj.weight", "routed_expert_up_proj.weight"),
        latent_norm="routed_expert_norm.weight", saved_layout="fused",
        test_keys={"text_config": {"model_type": "kimi_linear", "hidden_size": 64, "routed_expert_hidden_size": 32,
                                   "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
                                   "num_shared_experts": 1, "num_expert_group": 2, "topk_group": 1,
                                   "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
                                   "latent_moe_use_norm": True, "hidden_act": "situ", "num_hidden_layers": 3,
                                   "first_k_dense_replace": 1, "moe_layer_freq": 1}},
        draft="huggingface/transformers PR #47670, "
        "src/transformers/models/kimi_k3/modular_kimi_k3.py at aa83b548",
        draft_config=("deepseek_v3", ("latent_size", "situ_beta", "situ_linear_beta"))),
}

#: Keys that only K3's own modeling code reads (transformers' `KimiLinearConfig` ignores them): a `kimi_linear`
#: file that holds one was written for that code.
K3_ONLY_KEYS = ("routed_expert_hidden_size", "latent_moe_use_norm", "activation_situ_beta",
                "activation_situ_linear_beta", "moe_router_activation_func")


def family_activation(family: HFFamily) -> str:
    """This package's name of the family's expert activation: "swiglu", "relu2" (Nemotron-H) or "situ" (K3)."""
    return family.activation


def family_of(model_type: Any) -> HFFamily:
    """The family of a transformers `model_type`; a `ValueError` naming it and the known ones otherwise."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {sorted(FAMILIES)} (the MoE families of transformers this "
                         f"package reads), got {model_type!r}")
    return FAMILIES[model_type]


def record_of(model_type: Any) -> HFFamily:
    """The record of any layout the converters know (`ALL_RECORDS`); a `ValueError` naming the known ones."""
    if not isinstance(model_type, str) or model_type not in ALL_RECORDS:
        raise ValueError(f"model_type must be one of {sorted(ALL_RECORDS)} (the MoE blocks whose tensors this "
                         f"package reads and writes), got {model_type!r}")
    return ALL_RECORDS[model_type]


def count_family_moe_layers(family: HFFamily, num_hidden_layers: int, layer_keys: Mapping[str, Any]) -> int:
    """How many of the `num_hidden_layers` decoder layers hold the family's MoE block (its code's rule).

    `layer_keys` holds the already checked layer-choosing keys (`read_layer_keys`); the count is in closed form.
    """
    return family.rule.count(num_hidden_layers, layer_keys)


def is_family_moe_layer(family: HFFamily, layer: int, layer_keys: Mapping[str, Any]) -> bool:
    """Whether decoder layer `layer` holds the family's MoE block (`layer_keys` from `read_layer_keys`)."""
    return family.rule.is_moe(layer, layer_keys)


def _value(text: Mapping[str, Any], where: str, spec: HFFamilyKey) -> Any:
    """The checked value of one key (or of one of its aliases), its class's default when absent."""
    present = [name for name in (spec.key, *spec.aliases) if name in text]
    if spec.required:  # the class writes an unset required key as null: as absent
        present = [name for name in present if text[name] is not None]
    if not present:
        if spec.required:
            raise ValueError(f"{where}[{spec.key!r}] is required: the configuration class has no default for it "
                             f"(it leaves the key None, and its block cannot be built without it)")
        return _ACTIVATION_OF[spec.default] if spec.kind == "activation" else spec.default
    values = {name: text[name] for name in present}
    first = present[0]
    if any(not same_json_value(values[name], values[first]) for name in present[1:]):
        raise ValueError(f"{where} gives one quantity two values: " +
                         ", ".join(f"{where}[{name!r}] = {shown(values[name])}" for name in present))
    label, value = f"{where}[{first!r}]", values[first]
    if value is None:
        raise ValueError(f"{label} must not be null: write its value, or leave the key out (meaning {spec.default!r})")
    if spec.kind in ("integer", "count"):
        return integer_value(value, label, low=1 if spec.kind == "integer" else 0)
    if spec.kind == "factor":
        return factor_value(value, label)
    if spec.kind == "score":  # the router's score function, by its transformers activation name
        if not isinstance(value, str) or value not in _SCORES_OF:  # a list or a mapping is no name (nor hashable)
            raise ValueError(f"{label} must be one of {sorted(_SCORES_OF)} (the score functions of this family "
                             f"this package computes), got {shown(value)}")
        return _SCORES_OF[value]
    if spec.kind == "switch":
        if not isinstance(value, bool):
            raise ValueError(f"{label} must be true or false, got {type(value).__name__} {shown(value)}")
        return value
    if value != spec.default:  # "activation": the one expert activation of the family, SwiGLU or squared ReLU
        raise ValueError(f"{label} must be {spec.default!r} (the only expert activation of this family this "
                         f"package computes), got {shown(value)}")
    return _ACTIVATION_OF[value]


# transformers' name of an expert activation -> this package's: "silu" with a gate is SwiGLU; "relu2" is ungated.
_ACTIVATION_OF = {"silu": "swiglu", "relu2": "relu2"}
# transformers' activation names a router may use as its score function -> this package's score functions.
_SCORES_OF = {"sqrtsoftplus": "sqrtsoftplus", "sigmoid": "sigmoid"}


def read_layer_keys(text: Mapping[str, Any], where: str, family: HFFamily) -> tuple[int, dict[str, Any]]:
    """`(num_hidden_layers, layer_keys)` of a configuration, checked, by the family's rule (closed form).

    The layer keys are what `count_family_moe_layers` and `is_family_moe_layer` take. No per-layer list is
    built from a count: a file of $10^{12}$ layers reads as quickly as one of 4.
    """
    rule = family.rule
    if rule.counts_by_list:  # Nemotron-H: the list's length is the layer count
        keys = rule.read(text, where, family, 0)
        return len(keys["layers_block_type"]), keys
    total = integer_value(text.get("num_hidden_layers", family.num_hidden_layers), f"{where}['num_hidden_layers']",
                          low=1)
    return total, rule.read(text, where, family, total)


def read_family_fields(text: Mapping[str, Any], where: str, family: HFFamily) -> dict[str, Any]:
    """The `MoEConfig` fields `family`'s code builds from the keys in `text`, every value checked.

    Absent keys take the family's configuration-class defaults (a key the class leaves `None` is required);
    the number of MoE layers follows the family's own rule. A `ValueError` names the key and its value for
    anything the class would not build, or that builds no MoE layer.
    """
    fields = {name: _value(text, where, spec) for name, spec in family.keys.items()}
    fields.update(family.fixed)
    fields["latent_size"] = fields["hidden_size"]
    if family.extra_fields is not None:
        fields.update(family.extra_fields(text, where, fields))
    total, layer_keys = read_layer_keys(text, where, family)
    count = count_family_moe_layers(family, total, layer_keys)
    if "num_hash_layers" in layer_keys:
        fields["num_hash_layers"] = layer_keys["num_hash_layers"]
    if count == 0:
        raise ValueError(f"{where} has no MoE layer: of its num_hidden_layers = {total} layers, none holds "
                         f"{family.block_class} by {family.config_class}'s layer keys")
    fields["num_moe_layers"] = count
    return fields


def write_family_keys(fields: Mapping[str, Any], family: HFFamily, layer: int) -> dict[str, Any]:
    """The keys of `family`'s configuration class for a layer with `fields` (`MoEConfig` fields, as a mapping).

    The inverse of `read_family_fields`: each quantity under the family's own key, the family's extra keys,
    and the layer keys of its rule (`MoELayerRule.write`) that make decoder layer `layer` the first of
    `num_moe_layers` MoE layers. A quantity the family's keys cannot hold (a `None` where the class needs a
    value) is a `ValueError` naming the field; whether the whole layer is expressed is for the caller to
    check by reading the keys back.
    """
    activation_name = {ours: theirs for theirs, ours in _ACTIVATION_OF.items()}
    score_name = {ours: theirs for theirs, ours in _SCORES_OF.items()}
    keys: dict[str, Any] = {}
    for name, spec in family.keys.items():
        value = fields[name]
        if name == "shared_intermediate_size" and value is None:  # None: num_shared_experts x intermediate_size
            value = fields["num_shared_experts"] * fields["intermediate_size"]
        if spec.kind == "activation":
            value = activation_name.get(value, value)
        elif spec.kind == "score":
            value = score_name.get(value, value)
        if value is None:
            raise ValueError(f"{name}=None has no {family.config_class} key: {spec.key!r} needs a value "
                             f"(the class's default is {spec.default!r})")
        keys[spec.key] = value
    if family.extra_keys is not None:
        keys.update(family.extra_keys(fields))
    listed = layer + fields["num_moe_layers"]
    if family.rule.lists_layers and listed > MAX_LISTED_LAYERS:
        raise ValueError(f"layer {layer} with num_moe_layers = {fields['num_moe_layers']}: a {family.config_class} "
                         f"file lists its layers one by one ({', '.join(family.rule.keys)}), and one for this layer "
                         f"would list {listed} of them, more than the {MAX_LISTED_LAYERS} this writer makes")
    keys.update(family.rule.write(layer, fields["num_moe_layers"], fields["num_hash_layers"]))
    return keys
