r"""Configuration: the numbers that define one Stable LatentMoE layer.

| symbol | field | meaning | K3 |
|---|---|---|---|
| $d$ | `hidden_size` | model width | 7168 |
| $\ell$ | `latent_size` | latent width of the routed path, $\ell = d/\alpha$ | 3584 |
| $n$ | `num_experts` | routed experts | 896 |
| $k$ | `top_k` | routed experts per token | 16 |
| $f$ | `intermediate_size` | routed expert intermediate size | 3072 |
| $N_s$ | `num_shared_experts` | shared experts, merged into one MLP of width $N_s f$ | 2 |
| $\beta_1$ | `situ_beta` | SiTU gate cap | 4.0 |
| $\beta_2$ | `situ_linear_beta` | SiTU linear (up) cap; `None` leaves the up branch uncapped | 25.0 |
| $\varepsilon$ | `rms_norm_eps` | RMSNorm epsilon | 1e-5 |

The width reduction factor is $\alpha = d/\ell$; LatentMoE recommends 4 and K3
uses 2. K3 has 93 layers; the first has a dense FFN and the other 92 use this
block.

**The notation of the whole site.** Every page uses the symbols below. Three
letters carry two meanings in the sources, and are told apart by their
subscripts: $\alpha$ alone is the width factor $d/\ell$, $\alpha_i$ (one per
token) the cutoff of Eq. (14); $\beta_1, \beta_2$ are SiTU's caps, $\beta_j$
(one per expert) the dual variable of Appendix C; the bins of Appendix D are
numbered $h$, not $\beta$.
{: #notation }

| symbol | meaning | where |
|---|---|---|
| $x_i$, $z_i$, $u_i$, $v_i$, $y_i$ | token $i$'s input, latent, routed latent sum, its normalized form, output | Eq. (11) |
| $m$ | tokens in a batch | everywhere |
| $\alpha = d/\ell$ | width reduction factor (no subscript) | configuration, LatentMoE |
| $W_r$, $s_{i,j}$ | router weight, score of expert $j$ for token $i$ | Eq. (13) |
| $b_j$ | selection bias of expert $j$, added to the scores for the choice only | Eqs. (13), (14) |
| $\mathcal T_i$, $p_{i,j}$ | token $i$'s chosen experts and their mixture weights | Eq. (13) |
| $\beta_1$, $\beta_2$ | SiTU's gate and up caps | Eq. (12), App. B |
| $q = mk/n$ | the load of a perfectly balanced batch | Eq. (14) |
| $\alpha_i$ | token $i$'s cutoff, the $(k+1)$-th largest of $s_i + b$ (subscripted) | Eq. (14), App. C |
| $M_{i,j} = s_{i,j} - \alpha_i$ | margin of expert $j$ for token $i$ | Eq. (14) |
| $\beta_j = -b_j$ | the dual variable of expert $j$ (subscripted) | App. C |
| $r_{i,j} = \alpha_i - s_{i,j}$ | the bias expert $j$ would need to enter token $i$'s top-$k$ | App. D |
| $B$, $w$, $h$ | number of bins, bin width, bin index | App. D |
| $\gamma$ | the sign rule's step size | DeepSeek-V3's balancer |
| $L$ | DeepSeek-V4's SwiGLU clamp, `swiglu_limit` | the other families |
| max violation | $\max_j \text{load}_j / q - 1$ of a batch, routed with the bias held before it | the studies |

Two switches turn the block back into its ancestors, so the three can be
compared on the same inputs:

* `use_latent_norm=False` drops the RMSNorm on the latent sum: the original
  LatentMoE.
* `use_latent_projection=False` (which needs $\ell = d$, i.e. $\alpha = 1$)
  drops the shared down- and up-projections: an ordinary DeepSeek-style MoE
  whose experts see the full width.

Three further switches run the systems K3 is compared with (the page "The
other routers and balancers"): `score_function` (`"sigmoid"`, `"softmax"` or
DeepSeek-V4's `"sqrtsoftplus"`), `capacity_factor` (None: every assignment
is served; a number $c$: each expert serves at most $\lceil c\,mk/n \rceil$ and
drops the rest) and `hash_routing` (the layer picks its experts by a fixed
hash of the token id, DeepSeek-V4's first layers; `num_hash_layers` records how
many of a model's MoE layers do). Presets give DeepSeek-V3 and, as far as the
sources go, DeepSeek-V4 Flash and Pro, and NVIDIA's published LatentMoE
(`nemotron_3_super`).

Two more fields run NVIDIA's LatentMoE as published (Nemotron-H):
`activation="relu2"`, ungated experts $W_\downarrow \operatorname{relu}(W_\uparrow z)^2$
(computed as the GLU $\max(a, 0)\,b$ with the gate and up weights one matrix),
and `shared_intermediate_size`, a shared-expert width of its own instead of
$N_s f$. One more runs DeepSeek-V4's experts as transformers computes them:
`swiglu_limit` $L$ clamps SwiGLU's branches before they meet, the gate to
$\min(a, L)$ and the up branch to $[-L, L]$, in the routed and the shared
experts alike.

`MoEConfig.from_hf_config` reads the Hugging Face configuration of the
released checkpoint, so a user can build the layer from a `config.json`. It
gives each key the meaning the reference modeling code gives it, including
when the key is **absent**, which is not K3's value: a configuration written
for another model of the family (Kimi Linear has no latent and no SiTU caps)
then builds the layer that code would build. Every value is checked, and a
key that another MoE family spells differently (DeepSeek's
`n_routed_experts`, listed in `HF_SYNONYMS`) is an error naming both
spellings, never a silent default. The reference part of this page lists
every key, its meaning, K3's value, what its absence means and how it is
checked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from ._lib.values import (
    FLOAT32_RANGE,
    factor_value,
    integer_value,
    is_integer,
    is_real,
    same_json_value,
    shown,
    switch_value,
)
from .families import (
    ALL_RECORDS,
    FAMILIES,
    K3_ONLY_KEYS,
    HFFamily,
    family_of,
    read_family_fields,
    read_layer_keys,
    record_of,
    write_family_keys,
)

__all__ = ["ACTIVATIONS", "FLOAT32_RANGE", "HF_ABSENT", "HF_CODES", "HF_KEYS", "HF_SYNONYMS",
           "SCORE_FUNCTIONS", "TOPK_METHODS", "HFSynonym", "MoEConfig", "count_moe_layers",
           "family_hf_config", "family_layer_keys", "hf_reading_family", "is_moe_layer"]

#: Activations the experts may use: K3's SiTU-GLU, the SwiGLU it replaces, and the ungated squared ReLU of
#: NVIDIA's LatentMoE (Nemotron-H), computed as the GLU relu(a) b with tied gate and up weights.
ACTIVATIONS = ("situ", "swiglu", "relu2")

#: Router score functions (see `refimpl.layer.routing.router_scores`): K3's sigmoid, the
#: softmax of Switch Transformer and DeepSeek-V2, DeepSeek-V4's square root of softplus.
SCORE_FUNCTIONS = ("sigmoid", "softmax", "sqrtsoftplus")

#: Top-k methods implemented by `refimpl.layer.routing.route`: DeepSeek-V3's `noaux_tc`
#: (bias-corrected selection, optionally group-limited), which K3 uses. Other
#: methods (`greedy`, `group_limited_greedy`) select without the bias, so
#: accepting their names would silently compute something else.
TOPK_METHODS = ("noaux_tc",)

# The names each of `MoEConfig`'s named fields may hold.
_NAMES_OF: dict[str, tuple[str, ...]] = {"score_function": SCORE_FUNCTIONS, "activation": ACTIVATIONS,
                                         "topk_method": TOPK_METHODS}


def _name_value(value: Any, label: str, names: tuple[str, ...]) -> str:
    """`value` as a plain `str` if it is a string: a `str`, a NumPy string scalar (`np.str_`) or a 0-d NumPy
    string array (`np.array("situ")`, what indexing a string array or loading one from a file gives). A
    `TypeError` naming `label` for anything else: an array or a non-string stored in a frozen, hashed
    config would make it unhashable, and `b"situ"` or `["situ"]` is no name. Whether it is one of `names`
    is the caller's check."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind == "U":
        value = value.item()
    if not isinstance(value, str):
        raise TypeError(f"{label} must be a string (one of {names}), got {type(value).__name__} {shown(value)}")
    return str(value)  # a str subclass (np.str_) becomes a str


#: Hugging Face configuration key for each field of `MoEConfig`.
HF_KEYS: dict[str, str] = {
    "hidden_size": "hidden_size",
    "latent_size": "routed_expert_hidden_size",
    "num_experts": "num_experts",
    "top_k": "num_experts_per_token",
    "intermediate_size": "moe_intermediate_size",
    "num_shared_experts": "num_shared_experts",
    "situ_beta": "activation_situ_beta",
    "situ_linear_beta": "activation_situ_linear_beta",
    "rms_norm_eps": "rms_norm_eps",
    "score_function": "moe_router_activation_func",
    "renormalize": "moe_renormalize",
    "routed_scaling_factor": "routed_scaling_factor",
    "use_latent_norm": "latent_moe_use_norm",
    "topk_method": "topk_method",
    "n_group": "num_expert_group",
    "topk_group": "topk_group",
    "activation": "hidden_act",
}

# HF spells SwiGLU's activation "silu" (the GLU is implied by the gate/up pair).
_HF_ACTIVATION = {"situ": "situ", "silu": "swiglu", "swiglu": "swiglu"}


class HFSynonym(NamedTuple):
    """A key other MoE configurations use for something `from_hf_config` reads under another name."""

    expected: str  #: the key this package reads
    used_by: str  #: the configurations that spell it this way (their Hugging Face config classes)
    refused_when: str  #: when finding it is an error (see `HF_SYNONYMS`)


# When a synonym is refused: the expected key is absent, or holds another value; or only when it is absent
# (the synonym may legitimately mean something else next to it); or, for Qwen2-MoE's shared width, when
# the expected keys are absent or their product disagrees.
_ABSENT_OR_DIFFERENT = "the expected key is absent or holds another value"
_ABSENT = "the expected key is absent"
_SHARED_WIDTH = ("num_shared_experts is absent, or num_shared_experts x moe_intermediate_size differs (a null "
                 "num_shared_experts counts as 0, its meaning)")

#: Keys of other MoE configurations that name a quantity `from_hf_config` reads under its Kimi name.
#: Meeting one is a `ValueError` naming both keys (when `refused_when` holds), never a silent default.
#: Read from the configuration classes of transformers 5.24 (DeepSeek-V2/V3/V4, GLM-4.5 MoE, dots.llm1,
#: Qwen2/Qwen3-MoE, Mixtral, OLMoE, Phi-MoE, Granite-MoE, MiniMax, Llama 4, ERNIE 4.5 MoE, Hunyuan MoE)
#: and from DeepSeek-V3's released config.json (`scoring_func`).
HF_SYNONYMS: dict[str, HFSynonym] = {
    "n_routed_experts": HFSynonym("num_experts", "DeepSeek-V2/V3/V4, GLM-4.5 MoE, dots.llm1", _ABSENT_OR_DIFFERENT),
    "num_local_experts": HFSynonym("num_experts", "Mixtral, Phi-MoE, Granite-MoE, MiniMax, Llama 4",
                                   _ABSENT_OR_DIFFERENT),
    "moe_num_experts": HFSynonym("num_experts", "ERNIE 4.5 MoE", _ABSENT_OR_DIFFERENT),
    "num_experts_per_tok": HFSynonym("num_experts_per_token", "DeepSeek, Qwen-MoE, Mixtral, OLMoE, GLM-4.5 MoE, "
                                     "Llama 4 and most others", _ABSENT_OR_DIFFERENT),
    "moe_k": HFSynonym("num_experts_per_token", "ERNIE 4.5 MoE", _ABSENT_OR_DIFFERENT),
    "moe_topk": HFSynonym("num_experts_per_token", "Hunyuan MoE", _ABSENT_OR_DIFFERENT),
    "n_shared_experts": HFSynonym("num_shared_experts", "DeepSeek-V2/V3/V4, GLM-4.5 MoE, dots.llm1",
                                  _ABSENT_OR_DIFFERENT),
    "moe_num_shared_experts": HFSynonym("num_shared_experts", "ERNIE 4.5 MoE", _ABSENT_OR_DIFFERENT),
    "shared_expert_intermediate_size": HFSynonym(
        "num_shared_experts", "Qwen2-MoE (one shared expert of this width)", _SHARED_WIDTH),
    "intermediate_size": HFSynonym(
        "moe_intermediate_size", "Mixtral, OLMoE, Phi-MoE, Granite-MoE, MiniMax (each expert's width; in Kimi "
        "and DeepSeek configurations it is the dense FFN's width, and K3's file has both)", _ABSENT),
    "scoring_func": HFSynonym("moe_router_activation_func", "DeepSeek-V3 and V4", _ABSENT_OR_DIFFERENT),
    "norm_topk_prob": HFSynonym("moe_renormalize", "DeepSeek, Qwen-MoE, OLMoE, GLM-4.5 MoE, dots.llm1",
                                _ABSENT_OR_DIFFERENT),
    "n_group": HFSynonym("num_expert_group", "DeepSeek-V2/V3, GLM-4.5 MoE, dots.llm1", _ABSENT_OR_DIFFERENT),
    "decoder_sparse_step": HFSynonym(
        "moe_layer_freq", "Qwen2/Qwen3-MoE (there layer L is MoE when L + 1 is a multiple of it)",
        _ABSENT_OR_DIFFERENT),
}


@dataclass(frozen=True)
class MoEConfig:
    """Sizes and switches of one Stable LatentMoE layer (defaults: Kimi K3).

    Construct with keywords, or with `MoEConfig.k3()`, `MoEConfig.tiny()` or
    `MoEConfig.from_hf_config(...)`. The instance is frozen and validated on
    construction: sizes are positive integers of any integral type (NumPy's
    included, not bool) and are stored as Python ints; factors are positive
    reals of any type that float32 holds, stored as Python floats;
    `top_k <= num_experts`, `latent_size <= hidden_size`, and the activation,
    score function and top-k method are ones this package implements, given
    as strings (a NumPy string scalar or 0-d string array is stored as a
    `str`; any other type is a `TypeError`).
    """

    hidden_size: int = 7168
    latent_size: int = 3584
    num_experts: int = 896
    top_k: int = 16
    intermediate_size: int = 3072
    num_shared_experts: int = 2
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    rms_norm_eps: float = 1e-5
    score_function: str = "sigmoid"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_latent_norm: bool = True
    use_latent_projection: bool = True
    activation: str = "situ"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    num_moe_layers: int = 92
    capacity_factor: float | None = None
    hash_routing: bool = False
    num_hash_layers: int = 0
    shared_intermediate_size: int | None = None
    swiglu_limit: float | None = None

    # -- the paper's symbols -------------------------------------------------
    # Read-only aliases, for code that reads like the paper (`config.n`); the fields above are the one name
    # each quantity is stored and set under (the Hugging Face key), and the package itself uses only them.
    @property
    def d(self) -> int:
        """Model width $d$."""
        return self.hidden_size

    @property
    def ell(self) -> int:
        r"""Latent width $\ell$ of the routed path."""
        return self.latent_size

    @property
    def n(self) -> int:
        """Number of routed experts $n$."""
        return self.num_experts

    @property
    def k(self) -> int:
        """Routed experts per token $k$."""
        return self.top_k

    @property
    def f(self) -> int:
        """Routed expert intermediate size $f$."""
        return self.intermediate_size

    @property
    def alpha(self) -> float:
        r"""Width reduction factor $\alpha = d / \ell$."""
        return self.hidden_size / self.latent_size

    @property
    def shared_size(self) -> int:
        r"""Width of the merged shared-expert MLP: $N_s f$, or `shared_intermediate_size` when set.

        Nemotron-H sizes its shared expert on its own (`moe_shared_expert_intermediate_size`), not as a
        multiple of the routed experts' width.
        """
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.num_shared_experts * self.intermediate_size

    # -- validation ----------------------------------------------------------
    def __post_init__(self) -> None:
        # Sizes: any integral type (int, np.int64, ...; not bool), stored as a Python int.
        for name in ("hidden_size", "latent_size", "num_experts", "top_k", "intermediate_size",
                     "n_group", "topk_group", "num_moe_layers"):
            self._store(name, integer_value(getattr(self, name), f"MoEConfig.{name}", low=1))
        self._store("num_shared_experts", integer_value(self.num_shared_experts, "MoEConfig.num_shared_experts", low=0))
        if self.shared_intermediate_size is not None:  # None: the shared width is num_shared_experts x f
            self._store("shared_intermediate_size", integer_value(
                self.shared_intermediate_size, "MoEConfig.shared_intermediate_size", low=0))
        # Factors: any real type (float, np.float32, Fraction, ...), stored as a Python float.
        for name in ("situ_beta", "situ_linear_beta", "rms_norm_eps", "routed_scaling_factor", "capacity_factor"):
            value = getattr(self, name)
            if value is None and name in ("situ_linear_beta", "capacity_factor"):
                continue  # None: the up branch is not capped / every assignment is served
            allowed = {"situ_linear_beta": " or None", "capacity_factor": " or None (no dropping)"}.get(name, "")
            self._store(name, factor_value(value, f"MoEConfig.{name}", allowed=allowed))
        # Switches must be real booleans: a JSON string "false" is truthy and would turn the norm on.
        for name in ("renormalize", "use_latent_norm", "use_latent_projection", "hash_routing"):
            self._store(name, switch_value(getattr(self, name), f"MoEConfig.{name}"))
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k must be <= num_experts={self.num_experts}, got {self.top_k}")
        if self.latent_size > self.hidden_size:
            raise ValueError(
                f"MoEConfig.latent_size must be <= hidden_size={self.hidden_size}, got {self.latent_size}")
        if not self.use_latent_projection and self.latent_size != self.hidden_size:
            raise ValueError(
                "MoEConfig.use_latent_projection=False needs latent_size == hidden_size (alpha = 1), "
                f"got latent_size={self.latent_size}, hidden_size={self.hidden_size}")
        for name in ("score_function", "activation", "topk_method"):
            self._store(name, _name_value(getattr(self, name), f"MoEConfig.{name}", _NAMES_OF[name]))
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"MoEConfig.topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"MoEConfig.score_function must be one of {SCORE_FUNCTIONS}, got {self.score_function!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.num_experts % self.n_group != 0:
            raise ValueError(
                f"MoEConfig.n_group must divide num_experts={self.num_experts}, got {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"MoEConfig.topk_group must be <= n_group={self.n_group}, got {self.topk_group}")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} exceeds the {self.topk_group} x "
                f"{self.num_experts // self.n_group} experts that group-limited routing can reach")
        if self.swiglu_limit is not None:  # None: SwiGLU's branches are not clamped
            self._store("swiglu_limit", factor_value(self.swiglu_limit, "MoEConfig.swiglu_limit", allowed=" or None"))
            if self.activation != "swiglu":
                raise ValueError("MoEConfig.swiglu_limit clamps SwiGLU's gate and up branches (DeepSeek-V4's "
                                 f"experts) and needs activation='swiglu', got activation={self.activation!r}")
        # The hash-routed layers of the other systems (the page "The other routers and balancers").
        hashed = self.num_hash_layers
        if not is_integer(hashed) or not 0 <= hashed <= self.num_moe_layers:
            raise ValueError(f"MoEConfig.num_hash_layers must be an integer in [0, num_moe_layers="
                             f"{self.num_moe_layers}], got {hashed!r}")
        self._store("num_hash_layers", int(hashed))

    def _store(self, name: str, value: Any) -> None:
        """Set field `name` of this frozen instance to its normalized value (validation only)."""
        object.__setattr__(self, name, value)

    # -- presets -------------------------------------------------------------
    @classmethod
    def k3(cls) -> MoEConfig:
        """The Kimi K3 layer: d=7168, l=3584, n=896, k=16, f=3072, two shared experts."""
        return cls()

    @classmethod
    def tiny(cls, **overrides: Any) -> MoEConfig:
        """A layer small enough to print: d=8, l=4, n=6, k=2, f=6, one shared expert.

        Any field may be overridden by keyword.
        """
        fields: dict[str, Any] = dict(hidden_size=8, latent_size=4, num_experts=6, top_k=2,
                                      intermediate_size=6, num_shared_experts=1, num_moe_layers=1)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def small(cls, **overrides: Any) -> MoEConfig:
        """The benchmark layer: d=1024, l=512, n=128, k=8, f=384, shared width 768."""
        fields: dict[str, Any] = dict(hidden_size=1024, latent_size=512, num_experts=128, top_k=8,
                                      intermediate_size=384, num_shared_experts=2, num_moe_layers=1)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def deepseek_v3(cls, **overrides: Any) -> MoEConfig:
        r"""A DeepSeek-V3 MoE layer, from its published `config.json`.

        d=7168, 256 routed experts of hidden size 2048, one shared expert,
        top-8, sigmoid scores with the `noaux_tc` bias, group-limited routing
        (8 groups, the best 4), routed scaling factor 2.5, SwiGLU experts, 58
        MoE layers (61 layers, the first 3 dense), $\varepsilon = 10^{-6}$. No
        latent projection and no latent norm: a plain DeepSeekMoE layer. The
        file reads back as this preset (`MoEConfig.from_hf_config`), and the
        preset writes as the file (`family_hf_config`): SiTU's caps, which the
        file cannot hold, are left unset (`situ_linear_beta=None`).
        """
        fields: dict[str, Any] = dict(
            hidden_size=7168, latent_size=7168, use_latent_projection=False, use_latent_norm=False,
            num_experts=256, top_k=8, intermediate_size=2048, num_shared_experts=1, activation="swiglu",
            n_group=8, topk_group=4, routed_scaling_factor=2.5, num_moe_layers=58, rms_norm_eps=1e-6,
            situ_linear_beta=None)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def nemotron_3_super(cls, **overrides: Any) -> MoEConfig:
        r"""NVIDIA's LatentMoE as published: a MoE layer of Nemotron 3 Super (120B total, 12B active).

        From the `config.json` of `nvidia/NVIDIA-Nemotron-3-Super-120B-A12B`
        (model type `nemotron_h`), as public ports reproduce it: $d = 4096$, a
        latent of `moe_latent_size` = 1024 ($\alpha = 4$, LatentMoE's
        recommendation) without a norm, 512 routed experts of width 2688, top-22,
        one shared expert of width 5376 on the full width, ungated ReLU$^2$
        experts (`relu2`), sigmoid scores with the selection bias, weights
        renormalized and scaled by 5.0, no groups, $\varepsilon = 10^{-5}$.
        Not given here: how many of its 88 layers are MoE layers (its
        `hybrid_override_pattern` says); `num_moe_layers` is left at 1, so set
        it, or read the file with `MoEConfig.from_hf_config`, which counts them.
        """
        fields: dict[str, Any] = dict(
            hidden_size=4096, latent_size=1024, use_latent_projection=True, use_latent_norm=False,
            num_experts=512, top_k=22, intermediate_size=2688, num_shared_experts=1,
            shared_intermediate_size=5376, activation="relu2", situ_linear_beta=None, score_function="sigmoid",
            renormalize=True, routed_scaling_factor=5.0, rms_norm_eps=1e-5, num_moe_layers=1)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def deepseek_v4_flash(cls, **overrides: Any) -> MoEConfig:
        r"""A DeepSeek-V4 Flash MoE layer, as transformers 5.24's `DeepseekV4Config` gives it by default.

        The class's defaults are those of `deepseek-ai/DeepSeek-V4-Flash-Base`
        (its docstring's checkpoint): $d = 4096$, 256 routed experts of hidden
        size 2048, top-6, one shared expert of the same width, the
        $\sqrt{\operatorname{softplus}}$ affinity with the selection bias, weights
        always renormalized and scaled by 1.5, SwiGLU clamped at
        `swiglu_limit = 10`, no groups, 43 layers, all MoE, of which the first
        three route by a stored table (`num_hash_layers=3`; the preset is a
        learned layer, `hash_routing=False`). No latent projection and no latent
        norm: a plain MoE, $\ell = d$. `MoEConfig.from_hf_config` reads the same
        layer from that class's `to_dict()`, which the tests check.
        """
        fields: dict[str, Any] = dict(hidden_size=4096, routed_scaling_factor=1.5, swiglu_limit=10.0,
                                      num_moe_layers=43, rms_norm_eps=1e-6, situ_linear_beta=None)
        fields.update(overrides)
        hidden = fields.pop("hidden_size")
        return cls._deepseek_v4(hidden, 256, 2048, fields)

    @classmethod
    def deepseek_v4_pro(cls, *, hidden_size: int, **overrides: Any) -> MoEConfig:
        r"""A DeepSeek-V4 Pro MoE layer, as far as the sources give it; `hidden_size` is yours to choose.

        As DeepSeek-V4 is described: 384 routed experts of hidden size 3072,
        top-6, one shared expert, the $\sqrt{\operatorname{softplus}}$ affinity,
        bias balancing, no groups, hash routing in the first three MoE layers.
        Not given, so not invented: the width $d$ (a required argument), the
        layer count (`num_moe_layers` is 3, the fewest that hold the hash
        layers), the routed scaling factor (1.0) and the SwiGLU clamp (none);
        set them from the model's `config.json`, or read that file with
        `MoEConfig.from_hf_config`.
        """
        return cls._deepseek_v4(hidden_size, 384, 3072, overrides)

    @classmethod
    def _deepseek_v4(cls, hidden_size: int, num_experts: int, intermediate_size: int,
                     overrides: dict[str, Any]) -> MoEConfig:
        fields: dict[str, Any] = dict(
            hidden_size=hidden_size, latent_size=hidden_size, use_latent_projection=False,
            use_latent_norm=False, num_experts=num_experts, top_k=6, intermediate_size=intermediate_size,
            num_shared_experts=1, activation="swiglu", score_function="sqrtsoftplus", num_moe_layers=3,
            num_hash_layers=3)
        fields.update(overrides)
        return cls(**fields)

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    # -- Hugging Face keys ---------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, code: str | None = None) -> MoEConfig:
        """Build a config from a Hugging Face `config.json` mapping, with the semantics of the code that reads it.

        **Which code.** A file is read as the modeling code it was written for
        would read it (`code=None`): K3's own code for a top-level
        `"model_type": "kimi_k3"`, for a mapping with no `model_type`, and for
        a `"kimi_linear"` mapping that names remote code in `auto_map` or holds
        a key only K3's code reads (`K3_ONLY_KEYS`: `routed_expert_hidden_size`,
        `activation_situ_beta`, ...); transformers' class of that `model_type`
        for every other family in `refimpl.families.FAMILIES` (the families page
        lists them), with that class's
        keys, defaults and MoE-layer rule. `code="k3"` or
        `code="transformers"` overrides the choice: the same `kimi_linear` file
        means a different layer to each (transformers' `KimiLinearConfig`
        scales the routed weights by 2.446 and builds one shared expert when
        the keys are absent; K3's code by 1.0 and none). Another `model_type`
        is a `ValueError` naming it and the known ones.

        **K3's keys** are read as follows.

        `hf` is the whole file: when it has a `text_config` (K3's multimodal
        checkpoint nests the language model's keys there) that mapping is
        read, otherwise `hf` itself. Each key means what the reference
        modeling code makes of it, absent keys included (see `HF_ABSENT` and
        the table on this page): no `routed_expert_hidden_size` means no
        latent (no projections and no norm), an absent `latent_moe_use_norm`
        means no norm, an absent or null `activation_situ_beta` means 1.0,
        an absent or null `activation_situ_linear_beta` leaves the up branch
        uncapped, `num_shared_experts: null` means none, and with `top_k = 1`
        the single weight is not renormalized. The dense layers
        (`first_k_dense_replace`, `moe_layer_freq`) are left out of
        `num_moe_layers`, counted in closed form.

        Every value is checked before it is used, and each error names the
        key and the value: sizes must be integers (not booleans, floats or
        strings), factors positive numbers that float32 holds, switches JSON
        booleans, names one of those this package implements. A key that
        other MoE configurations spell differently (`HF_SYNONYMS`:
        DeepSeek's `n_routed_experts`, Mixtral's `num_local_experts`, ...)
        is refused, naming the key found and the key expected, unless the
        expected key is there too with the same value; it is never silently
        replaced by a default. `TypeError` when `hf` is not a mapping;
        `ValueError` for anything wrong inside it.
        """
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf must be a mapping of Hugging Face config keys, got {type(hf).__name__}")
        if "text_config" in hf:
            text, where = hf["text_config"], "hf['text_config']"
            if not isinstance(text, Mapping):
                raise ValueError(f"hf['text_config'] must be a mapping of the language model's keys, got "
                                 f"{type(text).__name__} {shown(text)}")
        else:
            text, where = hf, "hf"
        family = _reading_code(hf, text, where, code)
        if family is not None:
            fields = read_family_fields(text, where, family)
            try:
                return cls(**fields)
            except (TypeError, ValueError) as exc:  # a combination of keys no layer has (top_k > num_experts, ...)
                spelled = {field: spec.key for field, spec in family.keys.items()}
                raise ValueError(f"{where} describes no layer this package computes: {exc}"
                                 f"{_keys_of_fields_in(str(exc), spelled)}") from None
        _refuse_synonyms(text, where)
        for key in _HF_REQUIRED:
            if text.get(key) is None:
                raise ValueError(f"{where}[{key!r}] is required (an MoE layer needs it), got "
                                 f"{'no such key' if key not in text else 'null'}")
        fields: dict[str, Any] = {field: _read_hf_key(text, key, where) for field, key in HF_KEYS.items()}
        fields["activation"] = _HF_ACTIVATION[fields["activation"]]
        # No latent width: the reference code builds no projections and no norm (alpha = 1).
        if fields["latent_size"] is None:
            fields["latent_size"] = fields["hidden_size"]
            fields["use_latent_projection"] = False
            fields["use_latent_norm"] = False
        # `beta or 1.0` in the reference: absent, null and 0 all mean 1.0.
        if fields["situ_beta"] is None:
            fields["situ_beta"] = 1.0
        # The reference gate renormalizes only when top_k > 1: one weight stays the raw score.
        if fields["top_k"] == 1:
            fields["renormalize"] = False
        fields["num_moe_layers"] = _count_hf_moe_layers(text, where)
        try:
            return cls(**fields)
        except (TypeError, ValueError) as exc:  # a combination of keys no layer has (top_k > num_experts, ...)
            raise ValueError(f"{where} describes no layer this package computes: {exc}"
                             f"{_keys_of_fields_in(str(exc), HF_KEYS)}") from None

    def to_hf_config(self, *, nested: bool = False) -> dict[str, Any]:
        """The Hugging Face keys for this config, the inverse of `from_hf_config`.

        Every key is written explicitly (an absent key would mean something
        else to the reference code). With `nested=True` the keys go into a
        `text_config` of a top-level `{"model_type": "kimi_k3", ...}` mapping,
        the layout of K3's own `config.json`. Raises `ValueError` for a
        config the reference code cannot express: a latent norm without the
        latent projections, `top_k = 1` with renormalization (the
        reference keeps the raw score of a single expert), and fields K3's
        keys have no place for: ungated relu2 experts, a shared width of its
        own, `swiglu_limit`, `capacity_factor`, `hash_routing` and
        `num_hash_layers` (each would read back as a different layer).
        """
        nested = switch_value(nested, "nested")
        if self.use_latent_norm and not self.use_latent_projection:
            raise ValueError("a latent norm without the latent projections (use_latent_norm=True, "
                             "use_latent_projection=False) has no Hugging Face configuration: the "
                             "reference code applies the norm only with routed_expert_hidden_size")
        if self.top_k == 1 and self.renormalize:
            raise ValueError("top_k=1 with renormalize=True has no Hugging Face configuration: the "
                             "reference gate renormalizes only when top_k > 1 (use renormalize=False)")
        if self.activation == "relu2" or (self.shared_intermediate_size is not None
                                          and self.shared_intermediate_size != self.num_shared_experts
                                          * self.intermediate_size):
            raise ValueError("K3's configuration keys cannot express ungated relu2 experts or a shared width "
                             "other than num_shared_experts x intermediate_size (Nemotron-H's layers: read "
                             "them with model_type 'nemotron_h')")
        if self.swiglu_limit is not None:
            raise ValueError(f"K3's configuration keys cannot express swiglu_limit={self.swiglu_limit} (DeepSeek-V4's "
                             "clamped experts: read them with model_type 'deepseek_v4')")
        self._check_k3_has_no_baseline_switches()
        values = asdict(self)
        out: dict[str, Any] = {"model_type": "kimi_linear"}
        out.update({key: values[field] for field, key in HF_KEYS.items()})
        out["hidden_act"] = "situ" if self.activation == "situ" else "silu"
        if not self.use_latent_projection:
            del out["routed_expert_hidden_size"]
        if self.num_shared_experts == 0:
            out["num_shared_experts"] = None  # the reference code's "no shared-expert module"
        out["num_hidden_layers"] = self.num_moe_layers + 1
        out["first_k_dense_replace"] = 1
        out["moe_layer_freq"] = 1
        if not nested:
            return out
        return {"model_type": "kimi_k3", "text_config": out}

    def _check_k3_has_no_baseline_switches(self) -> None:
        """Refuse the other systems' switches, which K3's configuration has no key for.

        `from_hf_config` reads a K3 file back with `capacity_factor=None`, `hash_routing=False` and
        `num_hash_layers=0` (K3 serves every assignment and routes every layer by its scores), so writing
        any other value would return a different layer from the round trip, silently.
        """
        if self.capacity_factor is not None:
            raise ValueError(f"MoEConfig.capacity_factor must be None to write K3's configuration, got "
                             f"{self.capacity_factor}: K3's keys have no expert capacity (its layer serves every "
                             "assignment), so the file would read back as a layer that drops no token")
        if self.hash_routing:
            raise ValueError("MoEConfig.hash_routing must be False to write K3's configuration, got True: K3's keys "
                             "have no hash routing (its layers route by their scores), so the file would read back "
                             "as a layer that routes by its scores")
        if self.num_hash_layers != 0:
            raise ValueError(f"MoEConfig.num_hash_layers must be 0 to write K3's configuration, got "
                             f"{self.num_hash_layers}: K3's keys have no table-routed layers (DeepSeek-V4's "
                             "num_hash_layers: write them with model_type 'deepseek_v4')")


#: What the reference modeling code makes of an absent key (`None`: see `from_hf_config`).
#: These are the defaults of its configuration class, not K3's values.
HF_ABSENT: dict[str, Any] = {
    "hidden_size": None,
    "routed_expert_hidden_size": None,
    "num_experts": None,
    "num_experts_per_token": None,
    "moe_intermediate_size": None,
    "num_shared_experts": 0,
    "activation_situ_beta": None,
    "activation_situ_linear_beta": None,
    "rms_norm_eps": 1e-6,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "latent_moe_use_norm": False,
    "topk_method": "noaux_tc",
    "num_expert_group": 1,
    "topk_group": 1,
    "hidden_act": "silu",
}

# Keys without which there is no MoE layer to build.
_HF_REQUIRED = ("hidden_size", "num_experts", "num_experts_per_token", "moe_intermediate_size")


# What a null value means, for the keys where the reference code gives null a meaning; elsewhere it is an error.
_HF_NULL: dict[str, Any] = {
    "routed_expert_hidden_size": None,  # no latent
    "num_shared_experts": 0,
    "activation_situ_beta": 1.0,
    "activation_situ_linear_beta": None,  # the up branch is not capped
    "num_expert_group": 1,
    "topk_group": 1,
}

# What leaving a key out means, in words, where the value that stands for it (None) would not say it.
_HF_ABSENT_MEANS: dict[str, str] = {"num_hidden_layers": "one MoE layer, described on its own"}

# How each key's value is checked: ("integer", lower bound), ("factor", None), ("switch", None) or
# ("choice", the names allowed).
_HF_KINDS: dict[str, tuple[str, Any]] = {
    "hidden_size": ("integer", 1),
    "routed_expert_hidden_size": ("integer", 1),
    "num_experts": ("integer", 1),
    "num_experts_per_token": ("integer", 1),
    "moe_intermediate_size": ("integer", 1),
    "num_shared_experts": ("integer", 0),
    "activation_situ_beta": ("factor", None),
    "activation_situ_linear_beta": ("factor", None),
    "rms_norm_eps": ("factor", None),
    "moe_router_activation_func": ("choice", SCORE_FUNCTIONS),
    "moe_renormalize": ("switch", None),
    "routed_scaling_factor": ("factor", None),
    "latent_moe_use_norm": ("switch", None),
    "topk_method": ("choice", TOPK_METHODS),
    "num_expert_group": ("integer", 1),
    "topk_group": ("integer", 1),
    "hidden_act": ("choice", tuple(_HF_ACTIVATION)),
    "num_hidden_layers": ("integer", 1),
    "first_k_dense_replace": ("integer", 0),
    "moe_layer_freq": ("integer", 1),
}


def _read_hf_key(text: Mapping[str, Any], key: str, where: str, absent: Any = None) -> Any:
    """The value of `key` in `text`, checked by its kind, with the meaning of an absent or null key.

    An absent key means `HF_ABSENT[key]` (or `absent` for a key that table
    does not hold); null means `_HF_NULL[key]`, or is an error.
    """
    label = f"{where}[{key!r}]"
    if key not in text:
        return HF_ABSENT.get(key, absent)
    value = text[key]
    if value is None:
        if key in _HF_NULL:
            return _HF_NULL[key]
        meaning = _HF_ABSENT_MEANS.get(key, repr(HF_ABSENT.get(key, absent)))
        raise ValueError(f"{label} must not be null: write its value, or leave the key out (meaning {meaning})")
    kind, option = _HF_KINDS[key]
    if kind == "integer":
        return integer_value(value, label, low=option)
    if kind == "factor":
        if key == "activation_situ_beta" and is_real(value) and value == 0:
            return 1.0  # the reference's `beta or 1.0`: 0 means 1.0, as null does
        return factor_value(value, label, allowed=" or null" if key in _HF_NULL else "")
    if kind == "switch":
        if not isinstance(value, bool):
            raise ValueError(f"{label} must be true or false, got {type(value).__name__} {shown(value)}")
        return value
    if not isinstance(value, str) or value not in option:
        raise ValueError(f"{label} must be one of {sorted(option)}, got {shown(value)}")
    return value


def _keys_of_fields_in(message: str, keys: Mapping[str, str]) -> str:
    """' (in config.json: top_k is 'num_experts_per_token', ...)' for the fields a message names."""
    named = [field for field in keys if re.search(rf"\b{field}\b", message)]
    if not named:
        return ""
    return " (in config.json: " + ", ".join(f"{field} is {keys[field]!r}" for field in named) + ")"


#: The codes `MoEConfig.from_hf_config` can read a file as (its `code=` keyword).
HF_CODES = ("k3", "transformers")


def hf_reading_family(hf: Mapping[str, Any], *, code: str | None = None) -> HFFamily | None:
    """The family record whose code reads the configuration `hf` (`MoEConfig.from_hf_config`'s choice), or None
    for K3's own modeling code. A multimodal model's record (Kimi K2.5) when `hf` is one that wraps the family.

    As `from_hf_config`: a `TypeError` when `hf` is not a mapping, a `ValueError` naming the key for a
    `text_config` that is not one, a `model_type` that is not a string, or a `code` it does not know.
    """
    if not isinstance(hf, Mapping):
        raise TypeError(f"hf must be a mapping of Hugging Face config keys, got {type(hf).__name__}")
    text = hf.get("text_config", hf)
    if not isinstance(text, Mapping):
        raise ValueError(f"hf['text_config'] must be a mapping of the language model's keys, got "
                         f"{type(text).__name__} {shown(text)}")
    family = _reading_code(hf, text, "hf['text_config']" if text is not hf else "hf", code)
    wrapper = _record_named(hf.get("model_type")) if "text_config" in hf else None
    if family is not None and wrapper is not None and wrapper.wraps == family.model_type:
        return wrapper
    return family


def _reading_code(hf: Mapping[str, Any], text: Mapping[str, Any], where: str, code: str | None) -> HFFamily | None:
    """The transformers family that reads `text`, or None for K3's own code (see `MoEConfig.from_hf_config`)."""
    if code is not None and code not in HF_CODES:
        raise ValueError(f"code must be None (the code the file names), 'k3' (K3's own modeling code) or "
                         f"'transformers' (transformers' class of its model_type), got {shown(code)}")
    for holder, name in ((hf, "hf"), (text, where)):
        if holder.get("model_type") is not None and not isinstance(holder.get("model_type"), str):
            raise ValueError(f"{name}['model_type'] must be a string naming the model, got "
                             f"{shown(holder.get('model_type'))}")
    if code == "k3":
        return None
    model_type = text.get("model_type")
    if code == "transformers":
        if model_type not in FAMILIES:
            raise ValueError(f"code='transformers' reads {where}['model_type'] with that model's class: it must "
                             f"be one of {sorted(FAMILIES)}, got {shown(model_type)}")
        return FAMILIES[model_type]
    if model_type is None or any(record is not None and record.k3_configuration
                                 for record in (_record_named(hf.get("model_type")), _record_named(model_type))):
        return None  # K3's own configuration, at the top or in text_config
    record = _record_named(model_type)
    if record is not None and record.read_by_k3_code_when_remote and (
            "auto_map" in text or "auto_map" in hf or any(key in text for key in K3_ONLY_KEYS)):
        return None  # written for Kimi's own modeling code, not for transformers' class
    return family_of(model_type)


def _record_named(model_type: Any) -> HFFamily | None:
    """The record of `model_type` when it names one (`refimpl.families.ALL_RECORDS`), else None."""
    return ALL_RECORDS.get(model_type) if isinstance(model_type, str) else None


def _refuse_synonyms(text: Mapping[str, Any], where: str) -> None:
    """Raise one `ValueError` listing every key of `HF_SYNONYMS` in `text` that its rule refuses."""
    problems = []
    for found, synonym in HF_SYNONYMS.items():
        if found not in text:
            continue
        expected, value = synonym.expected, text[found]
        spelled = f"{where}[{found!r}] = {shown(value)} (the spelling of {synonym.used_by})"
        if expected not in text:
            problems.append(f"{spelled}, but no {expected!r}, the key this package reads: rename the key, "
                            f"or add {expected!r} with the value meant")
        elif synonym.refused_when == _ABSENT_OR_DIFFERENT and not same_json_value(value, text[expected]):
            problems.append(f"{spelled} disagrees with {where}[{expected!r}] = {shown(text[expected])}")
        elif synonym.refused_when == _SHARED_WIDTH:
            # A null num_shared_experts is compared by its meaning (none, `_HF_NULL`), as 0 is.
            shared = _HF_NULL[expected] if text[expected] is None else text[expected]
            width = text.get("moe_intermediate_size")
            if is_integer(shared) and is_integer(width) and not same_json_value(value, shared * width):
                given = "null (meaning 0)" if text[expected] is None else shared
                problems.append(f"{spelled} is not num_shared_experts x moe_intermediate_size = "
                                f"{given} x {width} = {shared * width}")
    if problems:
        raise ValueError(f"{where} uses keys of other MoE configurations: " + "; ".join(problems))


def _count_hf_moe_layers(text: Mapping[str, Any], where: str) -> int:
    """`count_moe_layers` of the keys in `text`, each checked; 1 when `num_hidden_layers` is absent.

    An absent `num_hidden_layers` describes one MoE layer on its own; null is refused (`_read_hf_key`), since
    the reference code has no meaning for it.
    """
    total = _read_hf_key(text, "num_hidden_layers", where)
    first_dense = _read_hf_key(text, "first_k_dense_replace", where, absent=0)
    freq = _read_hf_key(text, "moe_layer_freq", where, absent=1)
    if total is None:
        return 1  # a single layer described on its own
    count = count_moe_layers(total, first_dense, freq)
    if count == 0:
        raise ValueError(f"{where} has no MoE layer: {where}['num_hidden_layers'] = {total}, "
                         f"{where}['first_k_dense_replace'] = {first_dense} and {where}['moe_layer_freq'] = {freq} "
                         "leave no layer L >= first_k_dense_replace that is a multiple of moe_layer_freq")
    return count


def _layer_number(value: Any, name: str, low: int) -> int:
    """`value` as a Python int if it is an integer >= `low` (NumPy's integers included, not bool): a `TypeError`
    naming `name` for what is not an integer (10.5 is not rounded, "10" not parsed), a `ValueError` below `low`."""
    if not is_integer(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {shown(value)}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    return int(value)


def count_moe_layers(num_hidden_layers: int, first_k_dense_replace: int = 0, moe_layer_freq: int = 1) -> int:
    r"""How many of the layers $0, \dots, N - 1$ are MoE layers (`is_moe_layer`), in closed form.

    Layer $L$ is MoE when $L \ge f$ (`first_k_dense_replace`) and $q$
    (`moe_layer_freq`) divides $L$: the multiples of $q$ in $[f, N - 1]$.
    Counting them instead of looping keeps a configuration with $10^{18}$
    layers as quick to read as K3's 93.

    The arguments are checked as the keys of a `config.json` are: integers of any integral type (not bool),
    $N \ge 1$, $f \ge 0$ and $q \ge 1$; a `TypeError` for what is not an integer, a `ValueError` for one out of
    range, each naming the argument. The count is a Python int.
    """
    N = _layer_number(num_hidden_layers, "num_hidden_layers", 1)
    f = _layer_number(first_k_dense_replace, "first_k_dense_replace", 0)
    q = _layer_number(moe_layer_freq, "moe_layer_freq", 1)
    # $$\#\{L < N : L \ge f,\ q \mid L\} = \max\left(0,\ \lfloor (N-1)/q \rfloor - \lceil f/q \rceil + 1\right)$$
    return max(0, (N - 1) // q - (-(-f // q)) + 1)


def is_moe_layer(layer: int, first_k_dense_replace: int = 0, moe_layer_freq: int = 1) -> bool:
    """Whether decoder layer `layer` holds an MoE block (the reference code's rule); the others are dense.

    Checked as `count_moe_layers`: integers (not bool), `layer >= 0`, `first_k_dense_replace >= 0` and
    `moe_layer_freq >= 1`, else a `TypeError` or `ValueError` naming the argument.
    """
    layer = _layer_number(layer, "layer", 0)
    first = _layer_number(first_k_dense_replace, "first_k_dense_replace", 0)
    freq = _layer_number(moe_layer_freq, "moe_layer_freq", 1)
    return layer >= first and layer % freq == 0


def family_hf_config(config: MoEConfig, model_type: str, layer: int) -> dict[str, Any]:
    """The `config.json` of a `model_type` model whose decoder layer `layer` is `config`'s MoE layer.

    For a transformers family (`refimpl.families.ALL_RECORDS`): the family's own keys, which its configuration
    class reads back to `config` (every quantity, the MoE-layer count), with the layer keys of its rule making
    `layer` the first MoE layer; a wrapped family's keys go into the wrapper's `text_config`. For K3
    (`"kimi_k3"`): `config.to_hf_config(nested=True)`, whose MoE layers are 1 to `num_moe_layers`.

    A layer the family cannot express is a `ValueError` naming each field its keys give otherwise (shared
    experts for Mixtral, a latent for DeepSeek-V3, SiTU for any of them, ...), or the layer.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    family = record_of(model_type)
    if not is_integer(layer) or layer < 0:
        raise ValueError(f"layer must be a decoder layer index >= 0, got {layer!r}")
    layer = int(layer)
    if family.k3_configuration:
        if not 1 <= layer <= config.num_moe_layers:
            raise ValueError(f"layer must be an MoE layer in [1, {config.num_moe_layers}] (K3's layer 0 is dense), "
                             f"got {layer}")
        return config.to_hf_config(nested=True)
    fields = asdict(config)
    text = {"model_type": family.wraps or family.model_type, **write_family_keys(fields, family, layer)}
    hf = text if family.wraps is None else {"model_type": family.model_type, "text_config": text}
    try:
        read = MoEConfig.from_hf_config(hf)
    except ValueError as exc:
        raise ValueError(f"config is not a layer {family.config_class} ({model_type}) can hold: {exc}") from None
    differ = [name for name in fields if name != "shared_intermediate_size" and fields[name] != getattr(read, name)]
    if read.shared_size != config.shared_size:
        differ.append("shared_intermediate_size")
    if differ:
        raise ValueError(f"config is not a layer {family.config_class} ({model_type}) can hold: " + ", ".join(
            f"{name}={fields[name]!r} (its keys give {getattr(read, name)!r})" for name in differ))
    total, layer_keys = read_layer_keys(text, "config", family)
    assert family.rule.is_moe(layer, layer_keys) and layer < total, (model_type, layer)  # the rule's own writer
    return hf


def family_layer_keys(model_type: str, **fields: Any) -> dict[str, Any]:
    """A one-layer configuration of `model_type` in the family's own keys, its layer 0 the MoE layer.

    The record's small test configuration (`HFFamily.test_keys`), with `fields` (`MoEConfig` field names:
    `hidden_size=16`, `n_group=4`, ...) applied wherever the family has a key for them (and `latent_size`
    where it has a latent); the rest is left as the family has it. This is how the measurements choose one
    configuration for every family without a list of families: Qwen3-MoE simply has no key for `n_group`.

    The keys are those of the family's configuration class (`HFFamily.config_class`; a wrapper's are its
    text model's), without `model_type`: `MoEConfig.from_hf_config({"model_type": model_type, **keys})`
    reads them back as the layer asked for (Kimi K2.5's go in its `text_config`, beside the wrapped model's
    `model_type`). K3 (`"kimi_k3"`), whose configuration K3's own code reads, has a key for every field of
    `HF_KEYS`: its keys are `MoEConfig.to_hf_config`'s, with layer 0 the one MoE layer.

    Nothing is written unchecked. A name that is no `MoEConfig` field (`hiddn_size`) is a `TypeError`
    listing the fields; the values applied are checked by `MoEConfig` itself, as the layer is built (a
    `hidden_size="16"` is refused, an `np.int64` written as an int); and a layer the family's keys would
    read back as another (`family_hf_config`'s check) is a `ValueError` naming the fields. A field the family
    has no key for is not written, and so not checked beyond its name.
    """
    family = record_of(model_type)
    known = list(MoEConfig.__dataclass_fields__)
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise TypeError(f"family_layer_keys() got fields MoEConfig has not: {unknown} (the fields are {known})")
    if family.k3_configuration:
        held = set(HF_KEYS)
    else:
        held = set(family.keys) | ({"latent_size"} if family.latent_projections is not None else set())
    applied = {name: value for name, value in fields.items() if name in held}
    config = MoEConfig.from_hf_config({"model_type": model_type, **family.test_keys})
    if not config.use_latent_projection:  # a plain MoE: its experts see the full width, whatever it is set to
        applied["latent_size"] = applied.get("hidden_size", config.hidden_size)
    config = config.replace(**applied, num_moe_layers=1, num_hash_layers=0)
    if family.k3_configuration:
        keys = config.to_hf_config()  # refuses, by name, what K3's keys cannot hold
        del keys["model_type"]
        keys.update(num_hidden_layers=1, first_k_dense_replace=0, moe_layer_freq=1)
        return keys
    try:
        hf = family_hf_config(config, model_type, 0)
    except ValueError as exc:
        raise ValueError(f"family_layer_keys({model_type!r}, ...): {exc}") from None
    text = hf if family.wraps is None else hf["text_config"]
    return {key: value for key, value in text.items() if key != "model_type"}
