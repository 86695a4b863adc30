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
sources go, DeepSeek-V4 Flash and Pro.

`MoEConfig.from_hf_config` reads the Hugging Face configuration of the
released checkpoint, so a user can build the layer from a `config.json`. It
gives each key the meaning the reference modeling code gives it, including
when the key is **absent**, which is not K3's value: a configuration written
for another model of the family (Kimi Linear has no latent and no SiTU caps)
then builds the layer that code would build. The table on this page lists
every key, its meaning, K3's value and what its absence means.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as fields_of
from typing import Any

__all__ = ["ACTIVATIONS", "HF_ABSENT", "HF_KEYS", "SCORE_FUNCTIONS", "TOPK_METHODS", "MoEConfig",
           "is_moe_layer"]

#: Activations the experts may use: K3's SiTU-GLU and the SwiGLU it replaces.
ACTIVATIONS = ("situ", "swiglu")

#: Router score functions (see `refimpl.routing.router_scores`): K3's sigmoid, the
#: softmax of Switch Transformer and DeepSeek-V2, DeepSeek-V4's square root of softplus.
SCORE_FUNCTIONS = ("sigmoid", "softmax", "sqrtsoftplus")

#: Top-k methods implemented by `refimpl.routing.route`: DeepSeek-V3's `noaux_tc`
#: (bias-corrected selection, optionally group-limited), which K3 uses. Other
#: methods (`greedy`, `group_limited_greedy`) select without the bias, so
#: accepting their names would silently compute something else.
TOPK_METHODS = ("noaux_tc",)

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


@dataclass(frozen=True)
class MoEConfig:
    """Sizes and switches of one Stable LatentMoE layer (defaults: Kimi K3).

    Construct with keywords, or with `MoEConfig.k3()`, `MoEConfig.tiny()` or
    `MoEConfig.from_hf_config(...)`. The instance is frozen and validated on
    construction: sizes are positive integers, `top_k <= num_experts`,
    `latent_size <= hidden_size`, and the activation and score function are
    ones this package implements.
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

    # -- the paper's symbols -------------------------------------------------
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
        r"""Width $N_s f$ of the merged shared-expert MLP."""
        return self.num_shared_experts * self.intermediate_size

    # -- validation ----------------------------------------------------------
    def __post_init__(self) -> None:
        for name in ("hidden_size", "latent_size", "num_experts", "top_k", "intermediate_size",
                     "n_group", "topk_group", "num_moe_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive integer, got {value!r}")
        shared = self.num_shared_experts
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"MoEConfig.num_shared_experts must be a non-negative integer, got {shared!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k must be <= num_experts={self.num_experts}, got {self.top_k}")
        if self.latent_size > self.hidden_size:
            raise ValueError(
                f"MoEConfig.latent_size must be <= hidden_size={self.hidden_size}, got {self.latent_size}")
        if not self.use_latent_projection and self.latent_size != self.hidden_size:
            raise ValueError(
                "MoEConfig.use_latent_projection=False needs latent_size == hidden_size (alpha = 1), "
                f"got latent_size={self.latent_size}, hidden_size={self.hidden_size}")
        for name in ("situ_beta", "situ_linear_beta", "rms_norm_eps", "routed_scaling_factor"):
            value = getattr(self, name)
            if name == "situ_linear_beta" and value is None:
                continue  # the up branch is not capped (the reference code's meaning of an absent key)
            is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not (is_number and math.isfinite(value) and value > 0):
                allowed = " or None" if name == "situ_linear_beta" else ""
                raise ValueError(f"MoEConfig.{name} must be a positive finite number{allowed}, got {value!r}")
        # Switches must be real booleans: a JSON string "false" is truthy and would turn the norm on.
        for name in ("renormalize", "use_latent_norm", "use_latent_projection"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"MoEConfig.{name} must be True or False, got {type(value).__name__} {value!r}")
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
        # The switches of the other systems (the page "The other routers and balancers").
        if self.capacity_factor is not None:
            c = self.capacity_factor
            if isinstance(c, bool) or not isinstance(c, numbers.Real) or not (math.isfinite(c) and c > 0):
                raise ValueError(
                    f"MoEConfig.capacity_factor must be None (no dropping) or a positive finite number, got {c!r}")
        if not isinstance(self.hash_routing, bool):
            raise TypeError(f"MoEConfig.hash_routing must be True or False, got "
                            f"{type(self.hash_routing).__name__} {self.hash_routing!r}")
        hashed = self.num_hash_layers
        if isinstance(hashed, bool) or not isinstance(hashed, int) or not 0 <= hashed <= self.num_moe_layers:
            raise ValueError(f"MoEConfig.num_hash_layers must be an integer in [0, num_moe_layers="
                             f"{self.num_moe_layers}], got {hashed!r}")

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
        """A DeepSeek-V3 MoE layer, from its published `config.json`.

        d=7168, 256 routed experts of hidden size 2048, one shared expert,
        top-8, sigmoid scores with the `noaux_tc` bias, group-limited routing
        (8 groups, the best 4), routed scaling factor 2.5, SwiGLU experts, 58
        MoE layers (61 layers, the first 3 dense). No latent projection and no
        latent norm: a plain DeepSeekMoE layer.
        """
        fields: dict[str, Any] = dict(
            hidden_size=7168, latent_size=7168, use_latent_projection=False, use_latent_norm=False,
            num_experts=256, top_k=8, intermediate_size=2048, num_shared_experts=1, activation="swiglu",
            n_group=8, topk_group=4, routed_scaling_factor=2.5, num_moe_layers=58)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def deepseek_v4_flash(cls, *, hidden_size: int, **overrides: Any) -> MoEConfig:
        r"""A DeepSeek-V4 Flash MoE layer, as far as the sources give it; `hidden_size` is yours to choose.

        Given by the textbook seed: one shared expert, 256 routed experts,
        top-6, expert hidden size 2048, the $\sqrt{\operatorname{softplus}}$
        affinity, bias balancing (plus a small sequence-wise loss, which is
        training, not configuration), no node limit on routing (one group),
        and hash routing in the first three MoE layers (`num_hash_layers=3`;
        the preset is a learned layer, `hash_routing=False`).

        Not given, so not invented: the model width $d$ (a required argument),
        the number of layers (`num_moe_layers` is 3, the fewest that hold the
        three hash-routed layers; set the real count yourself), the routed scaling factor (left at 1.0) and whether the weights
        are renormalized (left at True, as in DeepSeek-V3). DeepSeek-V4 has
        no latent projection and no latent norm (a plain MoE, $\ell = d$), and
        its experts are SwiGLU.
        """
        return cls._deepseek_v4(hidden_size, 256, 2048, overrides)

    @classmethod
    def deepseek_v4_pro(cls, *, hidden_size: int, **overrides: Any) -> MoEConfig:
        """A DeepSeek-V4 Pro MoE layer: as `deepseek_v4_flash`, with 384 routed experts of hidden size 3072."""
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
    def from_hf_config(cls, hf: Mapping[str, Any]) -> MoEConfig:
        """Build a config from a Hugging Face `config.json` mapping, with the reference code's semantics.

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
        `num_moe_layers`. A configuration this package cannot compute is a
        `ValueError` naming the key.
        """
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf must be a mapping of Hugging Face config keys, got {type(hf).__name__}")
        text = hf.get("text_config", hf)
        if not isinstance(text, Mapping):
            raise TypeError(f"hf['text_config'] must be a mapping, got {type(text).__name__}")
        where = "hf['text_config']" if text is not hf else "hf"

        defaults = {f.name: f.default for f in fields_of(cls)}

        def get(field: str, key: str) -> Any:
            # Present: as written. Absent: the reference code's meaning, or this class's default
            # for a key the reference code does not have.
            if key in text:
                return text[key]
            return HF_ABSENT[key] if key in HF_ABSENT else defaults[field]

        for key in _HF_REQUIRED:
            if text.get(key) is None:
                raise ValueError(f"{where}[{key!r}] is required (an MoE layer needs it), got "
                                 f"{'no such key' if key not in text else 'null'}")
        act = get("activation", "hidden_act")
        if not isinstance(act, str) or act not in _HF_ACTIVATION:
            raise ValueError(f"{where}['hidden_act'] must be one of {sorted(_HF_ACTIVATION)}, got {act!r}")
        fields: dict[str, Any] = {field: get(field, key) for field, key in HF_KEYS.items()}
        fields["activation"] = _HF_ACTIVATION[act]
        # No latent width: the reference code builds no projections and no norm (alpha = 1).
        if fields["latent_size"] is None:
            fields["latent_size"] = fields["hidden_size"]
            fields["use_latent_projection"] = False
            fields["use_latent_norm"] = False
        # `beta or 1.0` in the reference: absent, null (and 0) all mean 1.0.
        fields["situ_beta"] = fields["situ_beta"] or 1.0
        # `num_shared_experts: null` means no shared-expert module at all.
        if fields["num_shared_experts"] is None:
            fields["num_shared_experts"] = 0
        for field in ("n_group", "topk_group"):
            if fields[field] is None:
                fields[field] = 1
        # The reference gate renormalizes only when top_k > 1: one weight stays the raw score.
        if fields["top_k"] == 1:
            fields["renormalize"] = False
        fields["num_moe_layers"] = _count_moe_layers(text, where)
        return cls(**fields)

    def to_hf_config(self, *, nested: bool = False) -> dict[str, Any]:
        """The Hugging Face keys for this config, the inverse of `from_hf_config`.

        Every key is written explicitly (an absent key would mean something
        else to the reference code). With `nested=True` the keys go into a
        `text_config` of a top-level `{"model_type": "kimi_k3", ...}` mapping,
        the layout of K3's own `config.json`. Raises `ValueError` for a
        config the reference code cannot express: a latent norm without the
        latent projections, or `top_k = 1` with renormalization (the
        reference keeps the raw score of a single expert).
        """
        if self.use_latent_norm and not self.use_latent_projection:
            raise ValueError("a latent norm without the latent projections (use_latent_norm=True, "
                             "use_latent_projection=False) has no Hugging Face configuration: the "
                             "reference code applies the norm only with routed_expert_hidden_size")
        if self.top_k == 1 and self.renormalize:
            raise ValueError("top_k=1 with renormalize=True has no Hugging Face configuration: the "
                             "reference gate renormalizes only when top_k > 1 (use renormalize=False)")
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


def _count_moe_layers(text: Mapping[str, Any], where: str) -> int:
    """The MoE layers among `num_hidden_layers`: layer L is MoE iff L >= first_k_dense_replace and L % freq == 0."""
    total = text.get("num_hidden_layers")
    first_dense = text.get("first_k_dense_replace", 0)
    freq = text.get("moe_layer_freq", 1)
    if total is None:
        return 1  # a single layer described on its own
    for key, value, low in (("num_hidden_layers", total, 1), ("first_k_dense_replace", first_dense, 0),
                            ("moe_layer_freq", freq, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{where}[{key!r}] must be an integer >= {low}, got {value!r}")
    count = sum(1 for layer in range(total) if is_moe_layer(layer, first_dense, freq))
    if count == 0:
        raise ValueError(f"{where} has no MoE layer: num_hidden_layers={total}, "
                         f"first_k_dense_replace={first_dense}, moe_layer_freq={freq}")
    return count


def is_moe_layer(layer: int, first_k_dense_replace: int = 0, moe_layer_freq: int = 1) -> bool:
    """Whether decoder layer `layer` holds an MoE block (the reference code's rule); the others are dense."""
    return layer >= first_k_dense_replace and layer % moe_layer_freq == 0
