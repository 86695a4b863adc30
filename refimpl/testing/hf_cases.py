r"""The cases of the block check: a reference configuration and a seed, and every tensor rebuilt from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from hypothesis import strategies as st

from .._lib.xp import dtype_name
from ..checkpoints import ExpertStack
from ..checkpoints.state_dict import hf_state_dict_from_params
from ..config import MoEConfig
from ..families import FAMILIES, family_of
from ..layer.latent_moe import MoEParams, init_params, stable_latent_moe
from ..mx import mxfp4_decode, mxfp4_encode

__all__ = ["CONDITIONING", "GROWTH", "ROUTING_RESOLUTION", "UNIT_ROUNDOFF", "HFBlockCase", "hf_block_case",
           "hf_block_cases", "hf_family_text_configs", "hf_text_configs", "tolerance"]

#: The error growth $G$ of the block: the tolerance is $G u$ times a token's size.
GROWTH = 2.0**7

#: Tokens on which this package's own float32 evaluation is off by more than this many units of float32
#: roundoff (times the token's size) are ill-conditioned and not compared.
CONDITIONING = GROWTH / 8

#: Tokens whose selection (or group) scores are closer than this are not compared.
ROUTING_RESOLUTION = 2.0**-14

# Unit roundoff of each dtype the check accepts; float64 is held to float32's (the reference's ceiling).
UNIT_ROUNDOFF = {"float64": 2.0**-24, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def tolerance(dtype: Any) -> float:
    """The relative tolerance $G u$ for `dtype` (float64 gets float32's: the reference computes in float32)."""
    name = dtype_name(np.dtype(dtype))
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype must be one of {sorted(UNIT_ROUNDOFF)}, got {name}")
    return GROWTH * UNIT_ROUNDOFF[name]


# ---------------------------------------------------------------------------
# A case: a config, a seed, and everything rebuilt from them
# ---------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class HFBlockCase:
    """One input of `check_hf_moe_block`: the reference's config keys and a seed for weights and tokens.

    Everything else is rebuilt from these fields, so a case pasted from a
    report reproduces the exact tensors. `state_dict` is what `build`
    receives (NumPy arrays of `dtype` under the reference block's names; the
    bias in float32; the routed experts as MXFP4 pairs when `mxfp4`), `x`
    the tokens `[tokens, d]` of `dtype`, and `expected()` this package's
    answer in float64 on the same rounded values.
    """

    text_config: dict[str, Any]
    seed: int
    tokens: int = 4
    activation_scale: float = 1.0
    mxfp4: bool = False
    dtype: Any = field(default=np.float32)
    model_type: str | None = None  #: None: K3's block; else a transformers family's (`refimpl.families`)
    bias_offset: float = 0.0  #: added to every expert's selection bias (trained biases sit far from zero)

    @cached_property
    def config(self) -> MoEConfig:
        """The `MoEConfig` the reference code builds from `text_config` (K3's code, or the family's class)."""
        return MoEConfig.from_hf_config(self.text_config, code="transformers" if self.model_type else "k3")

    @cached_property
    def _drawn(self) -> tuple[MoEParams, MoEParams, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """(weights as handed over, the same in float64, tokens in `dtype`, the MXFP4 bytes of each stack)."""
        config, dtype = self.config, np.dtype(self.dtype)
        rng = np.random.default_rng(self.seed)
        # Matrices N(0, 1/fan_in), so every product keeps unit scale; a nonzero bias, on the scale of the
        # scores (sigmoid scores spread over about 0.2, softmax scores over about 1/n).
        spread = 0.2 if config.score_function == "sigmoid" else 0.2 / config.num_experts
        p = init_params(config, rng, dtype=np.float64, bias_scale=spread)
        if self.model_type is not None and not FAMILIES[self.model_type].has_bias:
            p["gate.e_score_correction_bias"] = np.zeros(config.num_experts)  # the block's router has none
        else:
            p["gate.e_score_correction_bias"] = p["gate.e_score_correction_bias"] + self.bias_offset
        if config.use_latent_norm:
            p["routed_expert_norm.weight"] = rng.uniform(0.5, 1.5, config.latent_size)  # a gain that is not all ones
        # Larger gate and up pre-activations reach the SiTU caps.
        for name in ("experts.w1", "experts.w3", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"):
            p[name] = p[name] * self.activation_scale
        x = rng.standard_normal((self.tokens, config.hidden_size)).astype(dtype)  # [m, d]
        given, exact = MoEParams(), MoEParams()
        expert_bytes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, value in p.items():
            if self.mxfp4 and name.startswith("experts."):
                packed, scale = mxfp4_encode(value)  # [n, out, in/2], [n, out, in/32]
                expert_bytes[name] = (packed, scale)
                given[name] = ExpertStack("mxfp4", tuple(zip(packed, scale, strict=True)), value.shape,
                                           np.dtype(np.float32))
                exact[name] = mxfp4_decode(packed, scale, dtype=np.float64)
                continue
            kept = np.float32 if name == "gate.e_score_correction_bias" and dtype.itemsize < 4 else dtype
            given[name] = value.astype(kept)
            exact[name] = given[name].astype(np.float64)
        return given, exact, x, expert_bytes

    @property
    def params64(self) -> MoEParams:
        """The weights as float64 `MoEParams` (MXFP4 experts decoded), exactly the values handed over."""
        return self._drawn[1]

    @property
    def x(self) -> np.ndarray:
        """The tokens `[m, d]`, in `dtype`."""
        return self._drawn[2]

    @property
    def x64(self) -> np.ndarray:
        """The tokens in float64."""
        return self._drawn[2].astype(np.float64)

    @property
    def expert_bytes(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """For MXFP4 cases, each expert stack's `(packed [n, out, in/2], scale [n, out, in/32])` bytes."""
        return self._drawn[3]

    @cached_property
    def state_dict(self) -> dict[str, np.ndarray]:
        """What `build` receives: the reference block's tensor names, NumPy arrays."""
        if self.model_type is not None:
            return hf_state_dict_from_params(self._drawn[0], self.config, model_type=self.model_type)
        return hf_state_dict_from_params(self._drawn[0], self.config, mxfp4=self.mxfp4)

    def expected(self) -> np.ndarray:
        """This package's `y` `[m, d]`, float64, on exactly the values handed over."""
        return np.asarray(stable_latent_moe(self.x64, self.params64, self.config))

    def code(self, name: str = "text_config") -> str:
        """The call that rebuilds this case, given its text config under `name`."""
        dtype = dtype_name(np.dtype(self.dtype))
        dtype = "ml_dtypes.bfloat16" if dtype == "bfloat16" else f"np.{dtype}"
        family = "" if self.model_type is None else f", model_type={self.model_type!r}"
        offset = "" if self.bias_offset == 0 else f", bias_offset={self.bias_offset}"
        return (f"refimpl.testing.hf_block_case({name}, seed={self.seed}, tokens={self.tokens}, "
                f"activation_scale={self.activation_scale}, mxfp4={self.mxfp4}, dtype={dtype}{family}{offset})")


def hf_block_case(text_config: Mapping[str, Any], seed: int, *, tokens: int = 4, activation_scale: float = 1.0,
                  mxfp4: bool = False, dtype: Any = np.float32, model_type: str | None = None,
                  bias_offset: float = 0.0) -> HFBlockCase:
    """The case a report printed: weights and tokens rebuilt from `text_config` and `seed`."""
    if not isinstance(text_config, Mapping):
        raise TypeError(f"text_config must be a mapping of config keys, got {type(text_config).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    if not (isinstance(bias_offset, int | float | np.floating | np.integer) and not isinstance(bias_offset, bool)
            and np.isfinite(bias_offset)):
        raise ValueError(f"bias_offset must be a finite number, got {bias_offset!r}")
    if model_type is not None:
        family_of(model_type)
        if mxfp4:
            raise ValueError(f"mxfp4=True is K3's packed layout; model_type={model_type!r} stores float experts")
    case = HFBlockCase(dict(text_config), int(seed), tokens, float(activation_scale), bool(mxfp4), np.dtype(dtype),
                       model_type, float(bias_offset))
    tolerance(case.dtype)  # an unsupported dtype is an error now, not at the first use
    case.config  # noqa: B018  (a config the reference cannot build is an error now)
    return case


# ---------------------------------------------------------------------------
# Strategies: the reference code's configurations
# ---------------------------------------------------------------------------

_ABSENT = object()  # a key left out of the config, which has the reference code's meaning


@st.composite
def hf_text_configs(draw: st.DrawFn, *, mxfp4: bool = False, max_experts: int = 8) -> dict[str, Any]:
    """`text_config` mappings the reference modeling code accepts, small, absent keys included.

    With `mxfp4=True` the latent and the expert width are 32 (MXFP4 blocks
    need multiples of 32) and the model width is 32 or 64.
    """
    n = draw(st.integers(2, max_experts), label="num_experts")
    # The reference scores a group by its two best experts (a top-2 that fails on a group of one).
    n_group = draw(st.sampled_from([g for g in (1, 2, 4) if n % g == 0 and n // g >= 2]), label="num_expert_group")
    topk_group = draw(st.integers(1, n_group), label="topk_group")
    k = draw(st.integers(1, min(4, topk_group * (n // n_group))), label="num_experts_per_token")
    latent = draw(st.booleans(), label="latent")
    if mxfp4:
        ell = f = 32
        d = draw(st.sampled_from([64, 32]), label="hidden_size") if latent else 32
    else:
        d = draw(st.integers(2, 10), label="hidden_size")
        ell = draw(st.integers(2, d), label="routed_expert_hidden_size") if latent else d
        f = draw(st.integers(2, 6), label="moe_intermediate_size")
    text: dict[str, Any] = {"model_type": "kimi_linear", "hidden_size": d, "num_experts": n,
                            "num_experts_per_token": k, "moe_intermediate_size": f}

    def maybe(key: str, values: list[Any]) -> None:
        value = draw(st.sampled_from([_ABSENT, *values]), label=key)
        if value is not _ABSENT:
            text[key] = value

    if latent:
        text["routed_expert_hidden_size"] = ell
        maybe("latent_moe_use_norm", [True, False])
        maybe("rms_norm_eps", [1e-5])
    maybe("hidden_act", ["situ", "silu"])
    if text.get("hidden_act") == "situ":
        maybe("activation_situ_beta", [4.0, 2.0, None])
        maybe("activation_situ_linear_beta", [25.0, 3.0, None])
    maybe("num_shared_experts", [1, 2, None, 0])
    maybe("moe_router_activation_func", ["sigmoid", "softmax"])
    maybe("moe_renormalize", [True, False])
    maybe("routed_scaling_factor", [2.5, 1.0, 0.5])
    if n_group > 1:
        text["num_expert_group"], text["topk_group"] = n_group, topk_group
    maybe("topk_method", ["noaux_tc"])
    return text


@st.composite
def hf_family_text_configs(draw: st.DrawFn, model_type: str, *, max_experts: int = 8) -> dict[str, Any]:
    """`config.json` mappings of a transformers family, in its own keys, for one small MoE layer.

    `ConfigClass(**text_config)` builds it (transformers' class of `model_type`) and its layer 0 is the MoE
    block. Optional keys are sometimes left out, to take the class's defaults: the routed scaling factor, the
    renormalization switch, the shared experts, the groups (when the class's default fits the drawn experts),
    DeepSeek-V4's `swiglu_limit`. DeepSeek-V4's layer is a top-k layer: its hash layers route by a stored table,
    which the reference of the kit does not draw.
    """
    family = family_of(model_type)
    spelled = {field: spec.key for field, spec in family.keys.items()}
    n = draw(st.integers(2, max_experts), label=spelled["num_experts"])
    d = draw(st.integers(2, 10), label="hidden_size")
    text: dict[str, Any] = {"model_type": model_type, "hidden_size": d, spelled["num_experts"]: n,
                            spelled["intermediate_size"]: draw(st.integers(2, 6))}
    if family.layers == "layers_block_type":  # Nemotron-H: one MoE layer, a latent path or none
        text["layers_block_type"] = ["moe"]
        if draw(st.booleans(), label="latent"):
            text["moe_latent_size"] = draw(st.integers(2, d), label="moe_latent_size")
    else:
        text["num_hidden_layers"] = 1
    if family.layers in ("first_k_dense", "mlp_layer_types"):
        text["first_k_dense_replace"] = 0  # layer 0 holds the MoE block
    if family.layers == "hash_mlp_layer_types":  # DeepSeek-V4: layer 0 a top-k layer (its hash layers use a table)
        text["mlp_layer_types"] = ["moe"]
    reachable = n

    def maybe(field: str, values: list[Any]) -> None:
        if field in spelled:
            absent = [] if family.keys[field].required else [_ABSENT]  # a key the class leaves None is written
            value = draw(st.sampled_from([*absent, *values]), label=spelled[field])
            if value is not _ABSENT:
                text[spelled[field]] = value

    if "n_group" in spelled:
        n_group = draw(st.sampled_from([g for g in (1, 2, 4) if n % g == 0 and n // g >= 2]), label="n_group")
        topk_group = draw(st.integers(1, n_group), label="topk_group")
        defaults = (family.keys["n_group"].default, family.keys["topk_group"].default)
        if (n_group, topk_group) != defaults or draw(st.booleans(), label="groups written"):
            text[spelled["n_group"]], text["topk_group"] = n_group, topk_group
        reachable = topk_group * (n // n_group)
    text[spelled["top_k"]] = draw(st.integers(1, min(4, reachable)), label=spelled["top_k"])
    if model_type == "nemotron_h":  # its shared expert has a width of its own; 0 means the dense width
        maybe("shared_intermediate_size", [0, 3, 6])
        text["intermediate_size"] = draw(st.integers(1, 6), label="intermediate_size")
    else:
        maybe("num_shared_experts", [0, 1, 2])
    maybe("renormalize", [True, False])
    maybe("routed_scaling_factor", [2.5, 1.0, 0.5])
    maybe("swiglu_limit", [0.5, 3.0])  # DeepSeek-V4's clamp; small, so that it cuts
    return text


@st.composite
def hf_block_cases(draw: st.DrawFn, *, mxfp4: bool = False, dtype: Any = np.float32, max_tokens: int = 6,
                   max_experts: int = 8, model_type: str | None = None) -> HFBlockCase:
    """`HFBlockCase`s: a config of `hf_text_configs`, a seed, a few tokens, sometimes large activations.

    With a transformers `model_type`, the config is that family's (`hf_family_text_configs`), and the
    selection bias, when the family has one, sits far from zero in some cases, as trained biases do.
    """
    if model_type is None:
        text = draw(hf_text_configs(mxfp4=mxfp4, max_experts=max_experts))
        offset = 0.0
    else:
        text = draw(hf_family_text_configs(model_type, max_experts=max_experts))
        offset = draw(st.sampled_from([0.0, 3.0, -20.0]), label="bias_offset") if FAMILIES[model_type].has_bias else 0.0
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    tokens = draw(st.integers(1, max_tokens), label="tokens")
    scale = draw(st.sampled_from([1.0, 6.0]), label="activation_scale")
    return HFBlockCase(text, seed, tokens, scale, mxfp4, np.dtype(dtype), model_type, offset)
