r"""The cases of the block check: a reference configuration and a seed, and every tensor rebuilt from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
from hypothesis import HealthCheck, Phase, find, reject
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from .._lib.values import factor_value, integer_value, same_json_value, seed_value, switch_value
from .._lib.xp import dtype_name
from ..checkpoints import ExpertStack
from ..checkpoints.state_dict import hf_state_dict_from_params
from ..config import HF_KEYS, MoEConfig
from ..families import ALL_RECORDS, FAMILIES, HFFamily, read_family_fields
from ..layer.latent_moe import MoEParams, init_params, stable_latent_moe
from ..mx import mxfp4_decode, mxfp4_encode
from .strategies import checked_switches

if TYPE_CHECKING:
    from .conventions import Convention

__all__ = ["CONDITIONING", "GROWTH", "K3_AUTO_MAP", "ROUTING_RESOLUTION", "UNIT_ROUNDOFF", "HFBlockCase", "check_pinned",
           "draft_moe_config", "pinned_keys", "pinned_reader_keys", "hf_block_case", "hf_block_cases", "hf_family_text_configs", "hf_text_configs",
           "keys_family", "kit_family", "kit_model_types", "tolerance"]

#: The error growth $G$ of the block: the tolerance is $G u$ times a token's size.
GROWTH = 2.0**7

#: Tokens on which this package's own float32 evaluation is off by more than this many units of float32
#: roundoff (times the token's size) are ill-conditioned and not compared.
CONDITIONING = GROWTH / 8

#: Tokens whose selection (or group) scores are closer than this are not compared.
ROUTING_RESOLUTION = 2.0**-14

# Unit roundoff of each dtype the check accepts.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def tolerance(dtype: Any) -> float:
    """The relative tolerance $G u$ for `dtype`, $u$ its unit roundoff.

    What is no dtype at all (`"nonsense"`) is a `TypeError`, a dtype without a tolerance (int8) a `ValueError`;
    both name `dtype` and the dtypes accepted.
    """
    try:
        resolved = np.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"dtype must be one of {sorted(UNIT_ROUNDOFF)}, got {type(dtype).__name__} "
                        f"{dtype!r:.60}") from None
    name = dtype_name(resolved)
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype must be one of {sorted(UNIT_ROUNDOFF)}, got {name}")
    return GROWTH * UNIT_ROUNDOFF[name]


# ---------------------------------------------------------------------------
# The models the check draws for: transformers' families, and drafts built on one of them
# ---------------------------------------------------------------------------

def kit_model_types() -> list[str]:
    """The `model_type`s the block check draws: every family of `FAMILIES`, and every draft whose configuration
    class extends one of them (`HFFamily.draft_config`: K3's `kimi_k3`)."""
    return [*FAMILIES, *(name for name, record in ALL_RECORDS.items() if record.draft_config is not None)]


def kit_family(model_type: Any) -> HFFamily:
    """The record of a `model_type` the block check draws; a `ValueError` naming it and the known ones otherwise."""
    known = kit_model_types()
    if not isinstance(model_type, str) or model_type not in known:
        raise ValueError(f"model_type must be one of {sorted(known)} (the MoE blocks the check draws "
                         f"configurations of), got {model_type!r}")
    return ALL_RECORDS[model_type]


def keys_family(family: HFFamily) -> HFFamily:
    """The family whose configuration keys (and class defaults) `family`'s configuration holds: its own, or, for
    a draft, the shipped family whose class its configuration class extends."""
    return FAMILIES[family.draft_config[0]] if family.draft_config is not None else family


def draft_moe_config(text_config: Mapping[str, Any], family: HFFamily, where: str = "text_config") -> MoEConfig:
    """The layer a draft's configuration keys describe, computed by K3's code's rules.

    transformers' draft of K3 (`kimi_k3`) configures its block with DeepSeek-V3's keys (their class's defaults
    for absent ones) and three of K3's own, always written here: the latent width `routed_expert_hidden_size`
    and SiTU's `activation_situ_beta` and `activation_situ_linear_beta` (null: the up branch uncapped). Its
    block always has the latent, its norm and SiTU-GLU experts. The layer is K3's: with `top_k = 1` the single
    weight is the raw score, whatever `norm_topk_prob` says (K3's code renormalizes only when `top_k > 1`; the
    draft's DeepSeek-V3 router renormalizes a single weight too, a difference the check names).
    """
    if family.draft_config is None:
        raise ValueError(f"model_type {family.model_type!r} has no draft configuration class")
    base, added = family.draft_config
    fields = read_family_fields(text_config, where, FAMILIES[base])
    fields.update(family.fixed)
    fields["activation"] = family.activation
    for name in added:
        key = HF_KEYS[name]
        if key not in text_config:
            raise ValueError(f"{where}[{key!r}] is required (the draft's block reads it), got no such key")
        value, label = text_config[key], f"{where}[{key!r}]"
        if name == "latent_size":
            fields[name] = integer_value(value, label, low=1)
        elif value is None and name == "situ_linear_beta":
            fields[name] = None  # the draft leaves the up branch uncapped
        else:
            fields[name] = factor_value(value, label)
    if fields["top_k"] == 1:
        fields["renormalize"] = False  # K3's code renormalizes only when top_k > 1
    try:
        return MoEConfig(**fields)
    except (TypeError, ValueError) as exc:  # a combination of keys no layer has (top_k > num_experts, ...)
        raise ValueError(f"{where} describes no layer this package computes: {exc}") from None


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
    #: None: K3's block; else a transformers family's, or a draft's (`kit_model_types`, `refimpl.families`)
    model_type: str | None = None
    bias_offset: float = 0.0  #: added to every expert's selection bias (trained biases sit far from zero)
    #: which batch of tokens: 0 is drawn from `seed` after the weights, another from `(seed, batch)` (the same
    #: weights, other tokens: one build is asked several inputs)
    batch: int = 0
    #: Catalogued differences assumed, in order (`refimpl.testing.conventions.assume`): `config`, `params64`
    #: and `expected()` are then those of a block that has them, while `state_dict` and `x`, what a block is
    #: handed, stay the drawn ones. Empty for the reference itself.
    assumed: tuple[Convention, ...] = ()

    @cached_property
    def drawn_config(self) -> MoEConfig:
        """The `MoEConfig` the reference code builds from `text_config`: K3's code, the family's class, or, for a
        draft of K3 (`draft_moe_config`), its keys with K3's code's rules."""
        if self.model_type is not None and kit_family(self.model_type).draft_config is not None:
            return draft_moe_config(self.text_config, kit_family(self.model_type))
        return MoEConfig.from_hf_config(self.text_config, code="transformers" if self.model_type else "k3")

    @cached_property
    def _computed(self) -> tuple[MoEConfig, MoEParams]:
        """The config and float64 weights the layer is computed with: the drawn ones, changed by each difference
        of `assumed` in turn (each sees the case as the ones before it left it; one that does not apply to that
        case changes nothing)."""
        if not self.assumed:
            return self.drawn_config, self._drawn[1]
        before = replace(self, assumed=self.assumed[:-1])
        last = self.assumed[-1]
        if last.change is None:
            raise ValueError(f"{last.name} cannot be assumed: its variant is not a change of the config or weights")
        return last.change(before) if last.applies(before) else (before.config, before.params64)

    @property
    def config(self) -> MoEConfig:
        """The config of the layer computed on this case: `drawn_config`, with the `assumed` differences."""
        return self._computed[0] if self.assumed else self.drawn_config

    @property
    def k3_rules(self) -> bool:
        """Whether the expected output follows K3's code (K3's cases, and a draft of K3's), not a family's class."""
        return self.model_type is None or kit_family(self.model_type).k3_configuration

    @property
    def renormalize_key(self) -> tuple[str, bool]:
        """The key that switches renormalization in `text_config`, and what its absence means."""
        if self.model_type is None:
            return HF_KEYS["renormalize"], True
        spec = keys_family(kit_family(self.model_type)).keys.get("renormalize")
        return (spec.key, spec.default) if spec is not None else (HF_KEYS["renormalize"], self.drawn_config.renormalize)

    @cached_property
    def _drawn(self) -> tuple[MoEParams, MoEParams, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """(weights as handed over, the same in float64, tokens in `dtype`, the MXFP4 bytes of each stack)."""
        config, dtype = self.drawn_config, np.dtype(self.dtype)
        rng = np.random.default_rng(self.seed)
        # Matrices N(0, 1/fan_in), so every product keeps unit scale; a nonzero bias, on the scale of the
        # scores (sigmoid scores spread over about 0.2, softmax scores over about 1/n).
        spread = 0.2 if config.score_function == "sigmoid" else 0.2 / config.num_experts
        p = init_params(config, rng, dtype=np.float64, bias_scale=spread)
        if self.model_type is not None and not kit_family(self.model_type).has_bias:
            p["gate.e_score_correction_bias"] = np.zeros(config.num_experts)  # the block's router has none
        else:
            p["gate.e_score_correction_bias"] = p["gate.e_score_correction_bias"] + self.bias_offset
        if config.use_latent_norm:
            p["routed_expert_norm.weight"] = rng.uniform(0.5, 1.5, config.latent_size)  # a gain that is not all ones
        # Larger gate and up pre-activations reach the SiTU caps.
        for name in ("experts.w1", "experts.w3", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"):
            p[name] = p[name] * self.activation_scale
        x = rng.standard_normal((self.tokens, config.hidden_size)).astype(dtype)  # [m, d]
        if self.batch:
            x = np.random.default_rng([self.seed, self.batch]).standard_normal(x.shape).astype(dtype)  # [m, d]
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
        """The weights as float64 `MoEParams` (MXFP4 experts decoded), exactly the values handed over (changed by
        the `assumed` differences, if any)."""
        return self._computed[1] if self.assumed else self._drawn[1]

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
        """What `build` receives: the reference block's tensor names, NumPy arrays.

        K3's code builds no shared module when `num_shared_experts` is null (`if config.num_shared_experts is
        not None`), so such a case hands no `shared_experts.*` tensors; absent or 0, its shared module has
        width 0 and the tensors are zero-element, as that module's `state_dict()` holds them.
        """
        if self.model_type is not None:
            return hf_state_dict_from_params(self._drawn[0], self.drawn_config, model_type=self.model_type)
        tensors = hf_state_dict_from_params(self._drawn[0], self.drawn_config, mxfp4=self.mxfp4)
        if self.shared_module_absent:
            tensors = {name: value for name, value in tensors.items() if not name.startswith("shared_experts.")}
        return tensors

    @property
    def shared_module_absent(self) -> bool:
        """Whether K3's code builds no shared module for this case (`num_shared_experts` written as null)."""
        return (self.model_type is None and "num_shared_experts" in self.text_config
                and self.text_config["num_shared_experts"] is None)

    def expected(self) -> np.ndarray:
        """This package's `y` `[m, d]`, float64, on exactly the values handed over (with the `assumed` differences:
        the output of a block that has them)."""
        return np.asarray(stable_latent_moe(self.x64, self.params64, self.config))

    def code(self, name: str = "text_config") -> str:
        """The call that rebuilds this case, given its text config under `name` (the drawn case: `assume` adds the
        assumed differences back)."""
        dtype = dtype_name(np.dtype(self.dtype))
        dtype = "ml_dtypes.bfloat16" if dtype == "bfloat16" else f"np.{dtype}"
        family = "" if self.model_type is None else f", model_type={self.model_type!r}"
        offset = "" if self.bias_offset == 0 else f", bias_offset={self.bias_offset}"
        batch = "" if self.batch == 0 else f", batch={self.batch}"
        return (f"refimpl.testing.hf_block_case({name}, seed={self.seed}, tokens={self.tokens}, "
                f"activation_scale={self.activation_scale}, mxfp4={self.mxfp4}, dtype={dtype}{family}{offset}"
                f"{batch})")


def _integer(name: str, value: Any, low: int, high: int | None = None) -> int:
    """`value` as an int in `[low, high]`; anything else (a bool, a float such as 1.5, a string) is refused."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)


def hf_block_case(text_config: Mapping[str, Any], seed: int, *, tokens: int = 4, activation_scale: float = 1.0,
                  mxfp4: bool = False, dtype: Any = np.float32, model_type: str | None = None,
                  bias_offset: float = 0.0, batch: int = 0) -> HFBlockCase:
    """The case a report printed: weights and tokens rebuilt from `text_config` and `seed`.

    `seed` and `batch` are integers (a float seed such as 1.5 would silently mean another case) and `mxfp4` a
    real `bool` (the string `"false"` is truthy): anything else is refused, naming the argument.
    """
    if not isinstance(text_config, Mapping):
        raise TypeError(f"text_config must be a mapping of config keys, got {type(text_config).__name__}")
    seed = seed_value(seed, "seed", high=2**32)
    batch = _integer("batch", batch, 0)
    mxfp4 = switch_value(mxfp4, "mxfp4")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    if not (isinstance(bias_offset, int | float | np.floating | np.integer) and not isinstance(bias_offset, bool)
            and np.isfinite(bias_offset)):
        raise ValueError(f"bias_offset must be a finite number, got {bias_offset!r}")
    if model_type is not None:
        kit_family(model_type)
        if mxfp4:
            raise ValueError(f"mxfp4=True is K3's packed layout; model_type={model_type!r} stores float experts")
    case = HFBlockCase(dict(text_config), seed, tokens, float(activation_scale), bool(mxfp4), np.dtype(dtype),
                       model_type, float(bias_offset), batch)
    tolerance(case.dtype)  # an unsupported dtype is an error now, not at the first use
    case.config  # noqa: B018  (a config the reference cannot build is an error now)
    return case

# ---------------------------------------------------------------------------
# Strategies: the reference code's configurations
# ---------------------------------------------------------------------------

_ABSENT = object()  # a key left out of the config, which has the reference code's meaning

#: What a K3 case's `text_config` names as its modeling code. K3's released `text_config` says
#: `model_type: "kimi_linear"` and names Kimi's own modeling code in `auto_map`; that is what tells
#: `MoEConfig.from_hf_config` (and transformers) to read it with K3's code rather than transformers'
#: `KimiLinearConfig`, whose defaults differ (a routed scale of 2.446, one shared expert).
K3_AUTO_MAP = {"AutoConfig": "configuration_kimi.KimiLinearConfig",
               "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"}


def check_pinned(pinned: Mapping[str, Any] | None) -> dict[str, Any]:
    """`pinned` as a dict of config keys; anything but a mapping with string keys is a `TypeError`."""
    if pinned is None:
        return {}
    if not isinstance(pinned, Mapping):
        raise TypeError(f"pinned must be a mapping of config keys to values, got {type(pinned).__name__}")
    bad = [key for key in pinned if not isinstance(key, str)]
    if bad:
        raise TypeError(f"pinned must map config keys (strings) to values, got the keys {bad!r}")
    return dict(pinned)


def pinned_reader_keys(model_type: str | None) -> tuple[list[str], dict[str, str]]:
    """The config keys `pinned` may fix for `model_type` (K3's when None), and each alias with the key it means.

    They are the keys the reader of the block's configuration reads: K3's code's (`HF_KEYS`), or the family's
    configuration class's (its own spelling, `hidden_size`, Nemotron-H's latent and dense widths, a draft's
    own keys). A key outside them would pin nothing: the drawn configuration would carry it unread.
    """
    if model_type is None:
        return sorted(set(HF_KEYS.values())), {}
    family = kit_family(model_type)
    keys = keys_family(family)
    known = {spec.key for spec in keys.keys.values()} | {"hidden_size"}
    if keys.layers == "layers_block_type":  # Nemotron-H: a latent width and the dense width of its shared expert
        known |= {"moe_latent_size", "intermediate_size"}
    if family.draft_config is not None:
        known |= {HF_KEYS[name] for name in family.draft_config[1]}
    aliases = {alias: spec.key for spec in keys.keys.values() for alias in spec.aliases if alias not in known}
    return sorted(known), aliases


def pinned_keys(pinned: Mapping[str, Any] | None, *, model_type: str | None = None, mxfp4: bool = False,
                max_experts: int = 8) -> dict[str, Any]:
    """`pinned` checked before any case is drawn: keys the reader knows, values some configuration takes.

    A key the block's reader does not read (`"hiden_act"`) is a `ValueError` naming it and listing the known
    keys, since it would silently pin nothing; an alias of a family's key (Qwen3-MoE's `num_experts` for
    `num_local_experts`) is written under the key the strategy draws. Then one configuration is drawn with
    the pins (and one with MXFP4 experts, when `mxfp4`); when none can be built, within a few hundred draws,
    the pins are a `ValueError` saying why the last draw failed, rather than a check whose every draw is
    rejected and which therefore checks nothing.
    """
    pinned = check_pinned(pinned)
    known, aliases = pinned_reader_keys(model_type)
    reader = "K3's code" if model_type is None else f"{kit_family(model_type).config_class} ({model_type!r})"
    for alias in [key for key in pinned if key in aliases]:
        key = aliases[alias]
        if key in pinned and not same_json_value(pinned[key], pinned[alias]):
            raise ValueError(f"pinned gives one quantity two values: pinned[{alias!r}] = {pinned[alias]!r} and "
                             f"pinned[{key!r}] = {pinned[key]!r} ({reader} reads {alias!r} as {key!r})")
        pinned[key] = pinned.pop(alias)
    unknown = [key for key in pinned if key not in known]
    if unknown:
        raise ValueError(f"pinned has the key {unknown[0]!r}, which {reader} does not read (a misspelling?), so it "
                         f"would pin nothing; the keys it reads are {known}")
    if not pinned:
        return pinned
    attempts: list[tuple[bool, st.SearchStrategy]] = [
        (False, hf_text_configs(max_experts=max_experts, pinned=pinned) if model_type is None
         else hf_family_text_configs(model_type, max_experts=max_experts, pinned=pinned))]
    if mxfp4 and model_type is None:
        attempts.append((True, hf_text_configs(mxfp4=True, max_experts=max_experts, pinned=pinned)))
    for packed, strategy in attempts:
        failures: list[str] = []

        def builds(text: dict[str, Any], packed: bool = packed, failures: list[str] = failures) -> bool:
            try:
                case = HFBlockCase(text, 0, 1, mxfp4=packed, model_type=model_type)
                case.state_dict  # noqa: B018  (builds the config, the weights and, for MXFP4, their blocks)
            except (TypeError, ValueError, ZeroDivisionError) as exc:
                message = str(exc)
                for key in pinned:  # the reader names the mapping "hf": here the value is the pinned one
                    message = message.replace(f"hf[{key!r}]", f"pinned[{key!r}]")
                failures[:] = [message]
                return False
            return True

        quick = Settings(max_examples=300, derandomize=True, database=None, deadline=None,
                         phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
        try:
            find(strategy, builds, settings=quick)
        except NoSuchExample:
            where = " with MXFP4 experts (pass mxfp4=False for a port that reads float experts only)" if packed else ""
            why = f": the last one drawn failed with: {failures[0]}" if failures else ""
            raise ValueError(f"pinned = {pinned!r} leaves no configuration that {reader} builds{where}{why}") from None
        except (TypeError, ValueError, ZeroDivisionError) as exc:  # a pinned value the strategy cannot draw around
            raise ValueError(f"pinned = {pinned!r} leaves no configuration that {reader} builds: {exc}") from None
    return pinned


class _Keys:
    """Draws a `text_config` key by key, keeping the keys the porter pinned at their pinned values."""

    def __init__(self, draw: st.DrawFn, pinned: Mapping[str, Any]):
        self.draw, self.pinned = draw, pinned
        self.text: dict[str, Any] = {}

    def value(self, key: str, strategy: st.SearchStrategy) -> Any:
        """The pinned value of `key`, or one drawn from `strategy` (not written into the config)."""
        return self.pinned[key] if key in self.pinned else self.draw(strategy, label=key)

    def set(self, key: str, strategy: st.SearchStrategy) -> Any:
        """Write `key` (pinned, or drawn from `strategy`) into the config and return it."""
        self.text[key] = self.value(key, strategy)
        return self.text[key]

    def maybe(self, key: str, values: list[Any], *, required: bool = False) -> None:
        """Write `key` with one of `values`, or leave it out (its absent meaning) unless it is `required` (a key
        the family's class leaves None); a pinned key is written."""
        absent = [] if required else [_ABSENT]
        value = self.pinned[key] if key in self.pinned else self.draw(st.sampled_from([*absent, *values]), label=key)
        if value is not _ABSENT:
            self.text[key] = value

    def done(self) -> dict[str, Any]:
        """The config, with every pinned key (also those no draw asked for) at its pinned value."""
        return {**self.text, **self.pinned}


def _integer_at_most(limit: Any, low: int, high: int) -> st.SearchStrategy:
    """Integers in `[low, min(high, limit)]` (a pinned limit that is not an integer leaves `high`)."""
    top = min(high, limit) if isinstance(limit, int) and not isinstance(limit, bool) else high
    return st.integers(low, max(low, top))


@checked_switches("mxfp4")
@st.composite
def hf_text_configs(draw: st.DrawFn, *, mxfp4: bool = False, max_experts: int = 8,
                    pinned: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`text_config` mappings the reference modeling code accepts, small, absent keys included.

    With `mxfp4=True` the latent and the expert width are 32 (MXFP4 blocks
    need multiples of 32) and the model width is 32 or 64. Every key of
    `pinned` keeps its pinned value in every draw (the other draws adapt to
    it where they depend on it: groups divide a pinned expert count, a latent
    fits a pinned width). The config names K3's code in `auto_map`, so
    `MoEConfig.from_hf_config(text_config)` reads it as K3's code does.
    """
    keys = _Keys(draw, check_pinned(pinned))
    keys.text.update({"model_type": "kimi_linear", "auto_map": dict(K3_AUTO_MAP)})
    n = keys.set("num_experts", st.integers(2, max_experts))
    divisors = [g for g in (1, 2, 4) if isinstance(n, int) and n % g == 0 and n // g >= 2] or [1]
    # The reference scores a group by its two best experts (a top-2 that fails on a group of one).
    n_group = keys.value("num_expert_group", st.sampled_from(divisors))
    topk_group = keys.value("topk_group", _integer_at_most(n_group, 1, 4))
    reachable = topk_group * (n // n_group) if all(isinstance(v, int) and v for v in (n, n_group, topk_group)) else 4
    keys.set("num_experts_per_token", st.integers(1, max(1, min(4, reachable))))
    if "routed_expert_hidden_size" in keys.pinned:
        latent = keys.pinned["routed_expert_hidden_size"] is not None
    else:
        latent = draw(st.booleans(), label="latent")
    if mxfp4:
        keys.set("moe_intermediate_size", st.just(32))
        d = keys.set("hidden_size", st.sampled_from([64, 32]) if latent else st.just(32))
        if latent:
            keys.set("routed_expert_hidden_size", st.just(32))
    else:
        d = keys.set("hidden_size", st.integers(2, 10))
        if latent:
            keys.set("routed_expert_hidden_size", _integer_at_most(d, 2, 10))
        keys.set("moe_intermediate_size", st.integers(2, 6))
    if latent:
        keys.maybe("latent_moe_use_norm", [True, False])
        keys.maybe("rms_norm_eps", [1e-5])
    keys.maybe("hidden_act", ["situ", "silu"])
    if keys.text.get("hidden_act") == "situ":
        keys.maybe("activation_situ_beta", [4.0, 2.0, None])
        keys.maybe("activation_situ_linear_beta", [25.0, 3.0, None])
    keys.maybe("num_shared_experts", [1, 2, None, 0])
    keys.maybe("moe_router_activation_func", ["sigmoid", "softmax"])
    keys.maybe("moe_renormalize", [True, False])
    keys.maybe("routed_scaling_factor", [2.5, 1.0, 0.5])
    if n_group != 1 or "num_expert_group" in keys.pinned:
        keys.text["num_expert_group"], keys.text["topk_group"] = n_group, topk_group
    keys.maybe("topk_method", ["noaux_tc"])
    return keys.done()


@st.composite
def hf_family_text_configs(draw: st.DrawFn, model_type: str, *, max_experts: int = 8,
                           pinned: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`config.json` mappings of a transformers family, in its own keys, for one small MoE layer.

    `ConfigClass(**text_config)` builds it (transformers' class of `model_type`) and its layer 0 is the MoE
    block. Optional keys are sometimes left out, to take the class's defaults: the routed scaling factor, the
    renormalization switch, the shared experts, the groups (when the class's default fits the drawn experts),
    DeepSeek-V4's `swiglu_limit`. DeepSeek-V4's layer is a top-k layer: its hash layers route by a stored table,
    which the reference of the kit does not draw. Every key of `pinned` keeps its pinned value.

    A draft whose configuration class extends a family's (`kimi_k3`: DeepSeek-V3's keys) is drawn in that
    family's keys, plus the draft's own (`draft_moe_config`), which are always written.
    """
    family = keys_family(kit_family(model_type))
    keys = _Keys(draw, check_pinned(pinned))
    spelled = {field: spec.key for field, spec in family.keys.items()}
    keys.text["model_type"] = model_type
    n = keys.set(spelled["num_experts"], st.integers(2, max_experts))
    d = keys.set("hidden_size", st.integers(2, 10))
    keys.set(spelled["intermediate_size"], st.integers(2, 6))
    if family.layers == "layers_block_type":  # Nemotron-H: one MoE layer, a latent path or none
        keys.text["layers_block_type"] = ["moe"]
        if "moe_latent_size" in keys.pinned or draw(st.booleans(), label="latent"):
            keys.set("moe_latent_size", _integer_at_most(d, 2, 10))
    else:
        keys.text["num_hidden_layers"] = 1
    if family.layers in ("first_k_dense", "mlp_layer_types"):
        keys.text["first_k_dense_replace"] = 0  # layer 0 holds the MoE block
    if family.layers == "hash_mlp_layer_types":  # DeepSeek-V4: layer 0 a top-k layer (its hash layers use a table)
        keys.text["mlp_layer_types"] = ["moe"]
    reachable = n if isinstance(n, int) else 4

    def maybe(field: str, values: list[Any]) -> None:
        if field in spelled:
            keys.maybe(spelled[field], values, required=family.keys[field].required)

    if "n_group" in spelled:
        divisors = [g for g in (1, 2, 4) if isinstance(n, int) and n % g == 0 and n // g >= 2] or [1]
        n_group = keys.value(spelled["n_group"], st.sampled_from(divisors))
        topk_group = keys.value("topk_group", _integer_at_most(n_group, 1, 4))
        defaults = (family.keys["n_group"].default, family.keys["topk_group"].default)
        if ((n_group, topk_group) != defaults or spelled["n_group"] in keys.pinned or "topk_group" in keys.pinned
                or draw(st.booleans(), label="groups written")):
            keys.text[spelled["n_group"]], keys.text["topk_group"] = n_group, topk_group
        if all(isinstance(v, int) and v for v in (n, n_group, topk_group)):
            reachable = topk_group * (n // n_group)
    keys.set(spelled["top_k"], st.integers(1, max(1, min(4, reachable))))
    if "shared_intermediate_size" in spelled:  # a shared expert of its own width (Nemotron-H); 0: the dense width
        maybe("shared_intermediate_size", [0, 3, 6])
        keys.set("intermediate_size", st.integers(1, 6))
    else:
        maybe("num_shared_experts", [0, 1, 2])
    maybe("renormalize", [True, False])
    maybe("routed_scaling_factor", [2.5, 1.0, 0.5])
    maybe("swiglu_limit", [0.5, 3.0])  # DeepSeek-V4's clamp; small, so that it cuts
    draft = kit_family(model_type).draft_config
    for name in draft[1] if draft is not None else ():
        strategy = _integer_at_most(d, 2, 10) if name == "latent_size" else _DRAFT_VALUES[name]
        keys.set(HF_KEYS[name], strategy)
    return keys.done()


#: The values drawn for a draft's own keys beyond the latent width: SiTU's gate cap (always a number in the
#: draft's code), and the up branch's cap or none.
_DRAFT_VALUES = {"situ_beta": st.sampled_from([4.0, 1.5]), "situ_linear_beta": st.sampled_from([25.0, 3.0, None])}


@checked_switches("mxfp4")
@st.composite
def hf_block_cases(draw: st.DrawFn, *, mxfp4: bool = False, dtype: Any = np.float32, max_tokens: int = 6,
                   max_experts: int = 8, model_type: str | None = None,
                   pinned: Mapping[str, Any] | None = None) -> HFBlockCase:
    """`HFBlockCase`s: a config of `hf_text_configs`, a seed, a few tokens, sometimes large activations.

    With a transformers `model_type`, the config is that family's (`hf_family_text_configs`), and the
    selection bias, when the family has one, sits far from zero in some cases, as trained biases do. Keys of
    `pinned` keep their values; a draw whose pinned keys make a config the reference cannot build (a pinned
    `top_k` above a drawn expert count) is rejected, and Hypothesis draws another.
    """
    if model_type is None:
        text = draw(hf_text_configs(mxfp4=mxfp4, max_experts=max_experts, pinned=pinned))
        offset = 0.0
    else:
        text = draw(hf_family_text_configs(model_type, max_experts=max_experts, pinned=pinned))
        offset = draw(st.sampled_from([0.0, 3.0, -20.0]), label="bias_offset") if kit_family(model_type).has_bias else 0.0
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    tokens = draw(st.integers(1, max_tokens), label="tokens")
    scale = draw(st.sampled_from([1.0, 6.0]), label="activation_scale")
    case = HFBlockCase(text, seed, tokens, scale, mxfp4, np.dtype(dtype), model_type, offset)
    if pinned:
        try:
            case.config  # noqa: B018  (pinned keys may combine with drawn ones into no layer at all)
        except (TypeError, ValueError):
            reject()
    return case
