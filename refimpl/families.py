r"""The MoE families of transformers: their configurations, as their own classes read them, and their tensors.

K3's block descends from a line of MoE blocks that transformers now ships as
code: DeepSeek-V3 (also the language model of Kimi K2 and K2.5), DeepSeek-V4,
GLM-4 MoE, Kimi Linear, Qwen3-MoE and Mixtral, and NVIDIA's LatentMoE (Nemotron-H). Each spells the same quantities with its
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
| `deepseek_v4` | 5.08e-16 |
| `glm4_moe` | 1.24e-07 |
| `kimi_linear` | 1.10e-07 |
| `qwen3_moe` | 1.16e-07 |
| `mixtral` | 9.98e-08 |
| `nemotron_h` | 8.13e-08 |

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

from collections.abc import Mapping
from typing import Any, NamedTuple

from ._lib.values import factor_value, integer_value, is_integer, same_json_value, shown

__all__ = ["FAMILIES", "HFFamily", "HFFamilyKey", "K3_ONLY_KEYS", "count_family_moe_layers", "family_activation",
           "family_of",
           "read_family_fields"]


class HFFamilyKey(NamedTuple):
    """One `MoEConfig` field as a family's configuration class reads it."""

    key: str  #: the key in `config.json` (what the class's `to_dict()` writes)
    default: Any  #: what the class makes of an absent key
    kind: str  #: "integer", "count", "factor", "switch", "activation" or "score" (a score function)
    aliases: tuple[str, ...] = ()  #: other spellings the class accepts (its `attribute_map`)


class HFFamily(NamedTuple):
    """What one transformers `model_type` reads from a configuration, and the layout of its block."""

    model_type: str
    config_class: str  #: the transformers configuration class
    block_class: str  #: the transformers MoE block
    keys: dict[str, HFFamilyKey]  #: `MoEConfig` field -> how the class reads it
    fixed: dict[str, Any]  #: `MoEConfig` fields the family does not configure
    has_bias: bool  #: whether the router holds `gate.e_score_correction_bias`
    has_shared: bool  #: whether the block holds `shared_experts`
    #: how the MoE layers are chosen: "first_k_dense", "sparse_step", "every", "mlp_layer_types",
    #: "layers_block_type" (Nemotron-H) or "hash_mlp_layer_types" (DeepSeek-V4)
    layers: str
    num_hidden_layers: int  #: the class's default layer count
    layer_defaults: dict[str, Any]  #: the class's defaults for the layer-choosing keys


# Every family here is a plain MoE: the experts see the full width (no latent, no norm) and are SwiGLU.
_PLAIN = {"use_latent_projection": False, "use_latent_norm": False, "situ_linear_beta": None}


def _sigmoid_keys(experts: str, per_token: str, shared: str, group: str, renormalize: str, *, hidden: int,
                  n: int, k: int, f: int, shared_count: int, scale: float, groups: int, chosen_groups: int,
                  eps: float, aliases: Mapping[str, tuple[str, ...]]) -> dict[str, HFFamilyKey]:
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
        "renormalize": key(renormalize, True, "switch"),
        "rms_norm_eps": key("rms_norm_eps", eps, "factor"),
        "activation": key("hidden_act", "silu", "activation"),
    }


_DEEPSEEK_ALIASES = {"n_routed_experts": ("num_local_experts",)}

#: The families `MoEConfig.from_hf_config` reads, by `model_type` (transformers 5.24).
FAMILIES: dict[str, HFFamily] = {
    "deepseek_v3": HFFamily(
        "deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE",
        _sigmoid_keys("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "norm_topk_prob",
                      hidden=7168, n=256, k=8, f=2048, shared_count=1, scale=2.5, groups=8, chosen_groups=4,
                      eps=1e-6, aliases=_DEEPSEEK_ALIASES),
        {**_PLAIN, "score_function": "sigmoid"}, True, True, "first_k_dense", 61, {"first_k_dense_replace": 3}),
    "glm4_moe": HFFamily(
        "glm4_moe", "Glm4MoeConfig", "Glm4MoeMoE",
        _sigmoid_keys("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "norm_topk_prob",
                      hidden=4096, n=128, k=8, f=1408, shared_count=1, scale=1.0, groups=1, chosen_groups=1,
                      eps=1e-5, aliases=_DEEPSEEK_ALIASES),
        {**_PLAIN, "score_function": "sigmoid"}, True, True, "first_k_dense", 46, {"first_k_dense_replace": 1}),
    "kimi_linear": HFFamily(
        "kimi_linear", "KimiLinearConfig", "KimiLinearMoE",
        _sigmoid_keys("num_experts", "num_experts_per_token", "num_shared_experts", "num_expert_group",
                      "moe_renormalize", hidden=2304, n=256, k=8, f=1024, shared_count=1, scale=2.446, groups=1,
                      chosen_groups=1, eps=1e-5,
                      aliases={"num_experts": ("num_local_experts",), "num_experts_per_token": ("num_experts_per_tok",),
                               "num_shared_experts": ("n_shared_experts",), "num_expert_group": ("n_group",),
                               "moe_renormalize": ("norm_topk_prob",)}),
        {**_PLAIN, "score_function": "sigmoid"}, True, True, "mlp_layer_types", 27, {"first_k_dense_replace": 1}),
    "qwen3_moe": HFFamily(
        "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
        {"hidden_size": HFFamilyKey("hidden_size", 2048, "integer"),
         "num_experts": HFFamilyKey("num_local_experts", 128, "integer", ("num_experts",)),
         "top_k": HFFamilyKey("num_experts_per_tok", 8, "integer"),
         "intermediate_size": HFFamilyKey("moe_intermediate_size", 768, "integer"),
         "renormalize": HFFamilyKey("norm_topk_prob", False, "switch"),
         "rms_norm_eps": HFFamilyKey("rms_norm_eps", 1e-6, "factor"),
         "activation": HFFamilyKey("hidden_act", "silu", "activation")},
        {**_PLAIN, "score_function": "softmax", "num_shared_experts": 0}, False, False, "sparse_step", 24,
        {"decoder_sparse_step": 1, "mlp_only_layers": []}),
    "nemotron_h": HFFamily(
        "nemotron_h", "NemotronHConfig", "NemotronHMoE",
        {"hidden_size": HFFamilyKey("hidden_size", 4096, "integer"),
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
        {"use_latent_norm": False, "situ_linear_beta": None, "score_function": "sigmoid"}, True, True,
        "layers_block_type", 4, {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]}),
    "deepseek_v4": HFFamily(
        "deepseek_v4", "DeepseekV4Config", "DeepseekV4SparseMoeBlock",
        {"hidden_size": HFFamilyKey("hidden_size", 4096, "integer"),
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
        {**_PLAIN, "num_shared_experts": 1, "renormalize": True, "n_group": 1, "topk_group": 1}, True, True,
        "hash_mlp_layer_types", 43, {"num_hash_layers": 3}),
    "mixtral": HFFamily(
        "mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
        {"hidden_size": HFFamilyKey("hidden_size", 4096, "integer"),
         "num_experts": HFFamilyKey("num_local_experts", 8, "integer", ("num_experts",)),
         "top_k": HFFamilyKey("num_experts_per_tok", 2, "integer"),
         "intermediate_size": HFFamilyKey("intermediate_size", 14336, "integer"),
         "rms_norm_eps": HFFamilyKey("rms_norm_eps", 1e-5, "factor"),
         "activation": HFFamilyKey("hidden_act", "silu", "activation")},
        {**_PLAIN, "score_function": "softmax", "num_shared_experts": 0, "renormalize": True}, False, False,
        "every", 32, {}),
}

#: Keys that only K3's own modeling code reads (transformers' `KimiLinearConfig` ignores them): a `kimi_linear`
#: file that holds one was written for that code.
K3_ONLY_KEYS = ("routed_expert_hidden_size", "latent_moe_use_norm", "activation_situ_beta",
                "activation_situ_linear_beta", "moe_router_activation_func")


def family_activation(family: HFFamily) -> str:
    """This package's name of the family's expert activation: "swiglu" or (Nemotron-H) "relu2"."""
    return _ACTIVATION_OF[family.keys["activation"].default]


def family_of(model_type: Any) -> HFFamily:
    """The family of a transformers `model_type`; a `ValueError` naming it and the known ones otherwise."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {sorted(FAMILIES)} (the MoE families of transformers this "
                         f"package reads), got {model_type!r}")
    return FAMILIES[model_type]


def count_family_moe_layers(family: HFFamily, num_hidden_layers: int, layer_keys: Mapping[str, Any]) -> int:
    """How many of the `num_hidden_layers` decoder layers hold the family's MoE block (its code's rule).

    `layer_keys` holds the already checked layer-choosing keys: `first_k_dense_replace`; `decoder_sparse_step`
    and `mlp_only_layers` (a set of ints); or `mlp_layer_types` (a list of "dense" and "sparse").
    """
    N = num_hidden_layers
    if family.layers == "every":
        return N
    if family.layers == "first_k_dense":
        # $$\#\{L < N : L \ge f\}$$
        return max(0, N - layer_keys["first_k_dense_replace"])
    if family.layers == "mlp_layer_types":
        return sum(kind == "sparse" for kind in layer_keys["mlp_layer_types"])
    if family.layers == "layers_block_type":
        return sum(kind == "moe" for kind in layer_keys["layers_block_type"])
    if family.layers == "hash_mlp_layer_types":  # DeepSeek-V4: every layer is MoE, hash-routed or not
        return len(layer_keys["mlp_layer_types"])
    # Qwen3-MoE: layer L is MoE when it is not listed and the step divides L + 1, counted in closed form.
    step, listed = layer_keys["decoder_sparse_step"], layer_keys["mlp_only_layers"]
    # $$\#\{L < N : s \mid L + 1\} - \#\{L \in \text{listed} : L < N,\ s \mid L + 1\}$$
    return N // step - sum(1 for L in listed if 0 <= L < N and (L + 1) % step == 0)


def _value(text: Mapping[str, Any], where: str, spec: HFFamilyKey) -> Any:
    """The checked value of one key (or of one of its aliases), its class's default when absent."""
    present = [name for name in (spec.key, *spec.aliases) if name in text]
    if not present:
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
        if value not in _SCORES_OF:
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


def _layer_keys(text: Mapping[str, Any], where: str, family: HFFamily, total: int) -> dict[str, Any]:
    """The family's layer-choosing keys, checked, with its class's defaults."""
    keys: dict[str, Any] = {}
    if family.layers in ("first_k_dense", "mlp_layer_types"):
        first = text.get("first_k_dense_replace", family.layer_defaults["first_k_dense_replace"])
        keys["first_k_dense_replace"] = integer_value(first, f"{where}['first_k_dense_replace']", low=0)
    if family.layers == "mlp_layer_types":
        kinds = text.get("mlp_layer_types")
        if kinds is None:  # the class's rule: the first `first_k_dense_replace` layers are dense
            kinds = ["dense" if i < keys["first_k_dense_replace"] else "sparse" for i in range(total)]
        if (not isinstance(kinds, list) or len(kinds) != total
                or any(kind not in ("dense", "sparse") for kind in kinds)):
            raise ValueError(f"{where}['mlp_layer_types'] must list 'dense' or 'sparse' for each of the "
                             f"num_hidden_layers = {total} layers, got {shown(kinds)}")
        keys["mlp_layer_types"] = kinds
    if family.layers == "layers_block_type":
        kinds = text.get("layers_block_type", text.get("layer_types"))
        pattern = text.get("hybrid_override_pattern")
        if kinds is None and isinstance(pattern, str):  # the older spelling: one letter per layer, E for MoE
            letters = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
            kinds = [letters.get(char, char) for char in pattern]
        if kinds is None:
            kinds = family.layer_defaults["layers_block_type"]
        allowed = ("linear_attention", "moe", "full_attention", "mlp")
        if not isinstance(kinds, list) or not kinds or any(kind not in allowed for kind in kinds):
            raise ValueError(f"{where}['layers_block_type'] must list one of {allowed} per layer, got {shown(kinds)}")
        keys["layers_block_type"] = kinds
    if family.layers == "hash_mlp_layer_types":
        keys.update(_hash_layer_kinds(text, where, family, total))
    if family.layers == "sparse_step":
        step = text.get("decoder_sparse_step", family.layer_defaults["decoder_sparse_step"])
        keys["decoder_sparse_step"] = integer_value(step, f"{where}['decoder_sparse_step']", low=1)
        listed = text.get("mlp_only_layers")
        listed = [] if listed is None else listed
        if not isinstance(listed, list) or not all(is_integer(L) and L >= 0 for L in listed):
            raise ValueError(f"{where}['mlp_only_layers'] must be a list of layer indices >= 0, got {shown(listed)}")
        keys["mlp_only_layers"] = {int(L) for L in listed}
    return keys


def _hash_layer_kinds(text: Mapping[str, Any], where: str, family: HFFamily, total: int) -> dict[str, Any]:
    """DeepSeek-V4's `mlp_layer_types`: every layer is MoE, the first ones (3 by default) routed by a hash table.

    As `DeepseekV4Config` builds them: an absent list is `num_hash_layers` (the older key, default 3) times
    "hash_moe", then "moe"; a longer list is cut to the layer count, a shorter one refused.
    """
    kinds = text.get("mlp_layer_types")
    if kinds is None:
        hashed = text.get("num_hash_layers", family.layer_defaults["num_hash_layers"])
        hashed = integer_value(hashed, f"{where}['num_hash_layers']", low=0)
        kinds = ["hash_moe"] * min(total, hashed) + ["moe"] * max(0, total - hashed)
    if (not isinstance(kinds, list) or len(kinds) < total
            or any(kind not in ("hash_moe", "moe") for kind in kinds[:total])):
        raise ValueError(f"{where}['mlp_layer_types'] must list 'hash_moe' or 'moe' for each of the "
                         f"num_hidden_layers = {total} layers, got {shown(kinds)}")
    return {"mlp_layer_types": list(kinds[:total])}


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


def read_family_fields(text: Mapping[str, Any], where: str, family: HFFamily) -> dict[str, Any]:
    """The `MoEConfig` fields `family`'s code builds from the keys in `text`, every value checked.

    Absent keys take the family's configuration-class defaults; the number of
    MoE layers follows the family's own rule. A `ValueError` names the key and
    its value for anything the class would not build, or that builds no MoE layer.
    """
    fields = {field: _value(text, where, spec) for field, spec in family.keys.items()}
    fields.update(family.fixed)
    fields["latent_size"] = fields["hidden_size"]
    if family.model_type == "nemotron_h":
        fields.update(_nemotron_h_fields(text, where, fields))
    if family.layers == "layers_block_type":  # Nemotron-H: the list's length is the layer count
        total = len(_layer_keys(text, where, family, 0)["layers_block_type"])
    else:
        total = integer_value(text.get("num_hidden_layers", family.num_hidden_layers),
                              f"{where}['num_hidden_layers']", low=1)
    layer_keys = _layer_keys(text, where, family, total)
    count = count_family_moe_layers(family, total, layer_keys)
    if family.layers == "hash_mlp_layer_types":
        fields["num_hash_layers"] = sum(kind == "hash_moe" for kind in layer_keys["mlp_layer_types"])
    if count == 0:
        raise ValueError(f"{where} has no MoE layer: of its num_hidden_layers = {total} layers, none holds "
                         f"{family.block_class} by {family.config_class}'s layer keys")
    fields["num_moe_layers"] = count
    return fields
