r"""Check a whole MoE block from another framework against the reference: `check_hf_moe_block`.

A port of K3's block (into an inference engine, a training stack, a fused
kernel) is usually an `nn.Module` that loads the checkpoint's tensors by name.
`check_hf_moe_block` holds such a block, whole, against this package:

```python
import numpy as np
import torch
from refimpl.testing import check_hf_moe_block

def build(text_config, state_dict):            # the reference's config keys, NumPy tensors by HF name
    block = MyK3Block(text_config)
    block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
    return lambda x: block(torch.from_numpy(x)).detach().numpy()   # [m, d] -> [m, d]

check_hf_moe_block(build)                       # raises CheckFailure with a report if it disagrees
```

Hypothesis draws configurations the reference modeling code accepts, written
as its `text_config` keys with its meaning of absent keys: the latent on
(`routed_expert_hidden_size`) and off, the latent norm on and off, SiTU with
several $\beta_1$ and a capped or uncapped up branch, SwiGLU (`silu`), sigmoid
and softmax scores, top-1 and top-$k$, grouped routing, a routed scaling
factor other than 1, zero, one or two shared experts, and always a nonzero
selection bias. For each it draws weights and tokens from a seed, hands the
block the tensors under the names of the reference block's `state_dict()`
(`hf_tensor_shapes`) in `dtype` (the selection bias in float32, as the
reference keeps it), calls `build(text_config, state_dict)` and then
`forward(x)`, and compares `y` with `stable_latent_moe` evaluated in float64
on the very same (rounded) values. A third property hands the routed experts
as MXFP4 pairs, `weight_packed` and `weight_scale`, the way K3's checkpoint
ships them (pass `mxfp4=False` if your block does not read that format).

## The tolerance, and the float32 ceiling

A token passes when its largest error is within

$$
|y_{i,j} - y^{\text{ref}}_{i,j}| \le G \cdot u \cdot \max_j \bigl(|y^{\text{shared}}_{i,j}| + |y^{\text{routed}}_{i,j}|\bigr),
\qquad G = 2^{7},
$$

where $u$ is the unit roundoff of `dtype` ($2^{-24}$ for float32, $2^{-11}$
for float16, $2^{-8}$ for bfloat16) and the token's size is taken before its
shared and routed parts are added, since that sum may cancel. $G$ is the
error growth of the block: about eight rounded stages (router,
down-projection, two expert products, the activation, the weighted sum, the
norm, the up-projection), each adding errors that grow with the square root of
the width summed over, plus room. The tests run the reference PyTorch block on
the cases the default settings draw and require it to stay within half of
this bound, in float32 and in bfloat16 (it stays within a quarter).

In bfloat16 the bound is half of a token's size: only differences as large
as the output itself show. Conventions are the same in every dtype, so check
them in float32, where the tolerance is $2^{16}$ times finer, and use
bfloat16 for what only a bfloat16 path does.

**The float32 ceiling.** `dtype=np.float64` is held to float32's $u$, not
float64's: the reference code computes its router in float32 (it casts the
input and the gate weight up, whatever the block's dtype) and accumulates
the routed experts in float32. A port that follows it exactly is therefore a
float32 computation, even when handed float64 tensors, and agrees with a
float64 evaluation only to float32 rounding. Asking for more would fail the
reference itself.

**Tokens that are not compared.** Two correct float32 blocks may route a token
differently when two of its biased scores (or two group scores) are closer
than float32 can tell apart, and the RMSNorm magnifies rounding when the $k$
expert outputs nearly cancel in the latent sum. A token is left out when its
$k$-th and $(k+1)$-th selection scores, or its last kept and first dropped
group scores, are closer than $2^{-14}$, or when this package's own float32
evaluation of the token is off its float64 evaluation by more than an eighth
of the float32 tolerance ($2^4 u$ of the token's size). Weights and tokens come from a seed, so such tokens
are rare; the report says how many were left out.

## When the block disagrees

The report (a `CheckFailure`, like every check of the kit) gives, for the
simplest case Hypothesis found:

* the tokens that differ, expected against actual, and the error against the
  tolerance;
* **which catalogued convention differences reproduce the block's output**:
  every entry of `refimpl.testing.conventions.CATALOGUE` that applies to the
  case is run on it, and those whose output matches the block's to the same
  tolerance (while differing from the reference's) are named, with the public
  issue where that mistake shipped; when none matches, the closest is named
  with its distance;
* a **pasteable case**: the `text_config` as JSON, the random seed and the call to
  `hf_block_case` that rebuilds the exact weights and tokens, and the shapes.

```python
import json, numpy as np, refimpl.testing
text_config = json.loads('{"hidden_size": 4, "num_experts": 2, ...}')   # from the report
case = refimpl.testing.hf_block_case(text_config, seed=0, tokens=1)
y = build(text_config, case.state_dict)(case.x)
print(y - case.expected())
```

Each failed property's violation also carries the names it matched, as
`violation.conventions`, for a test that wants to assert on them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.xp import dtype_name
from ..checkpoints import ExpertStack
from ..checkpoints.state_dict import hf_state_dict_from_params
from ..config import MoEConfig
from ..layer.latent_moe import MoEParams, init_params, stable_latent_moe
from ..layer.routing import biased_scores
from ..mx import mxfp4_decode, mxfp4_encode
from .checks import kit_settings
from .conventions import CATALOGUE, Convention
from .report import CheckFailure, CheckResult, Code, Invariant, Violation, call_user, run_check

__all__ = [
    "CONDITIONING",
    "GROWTH",
    "ROUTING_RESOLUTION",
    "HFBlockCase",
    "ReferenceOutput",
    "check_hf_moe_block",
    "hf_block_case",
    "hf_block_cases",
    "hf_text_configs",
    "reference_output",
    "tolerance",
]

#: The error growth $G$ of the block: the tolerance is $G u$ times a token's size.
GROWTH = 2.0**7

#: Tokens on which this package's own float32 evaluation is off by more than this many units of float32
#: roundoff (times the token's size) are ill-conditioned and not compared.
CONDITIONING = GROWTH / 8

#: Tokens whose selection (or group) scores are closer than this are not compared.
ROUTING_RESOLUTION = 2.0**-14

# Unit roundoff of each dtype the check accepts; float64 is held to float32's (the reference's ceiling).
_UNIT_ROUNDOFF = {"float64": 2.0**-24, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def tolerance(dtype: Any) -> float:
    """The relative tolerance $G u$ for `dtype` (float64 gets float32's: the reference computes in float32)."""
    name = dtype_name(np.dtype(dtype))
    if name not in _UNIT_ROUNDOFF:
        raise ValueError(f"dtype must be one of {sorted(_UNIT_ROUNDOFF)}, got {name}")
    return GROWTH * _UNIT_ROUNDOFF[name]


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

    @cached_property
    def config(self) -> MoEConfig:
        """The `MoEConfig` the reference code builds from `text_config`."""
        return MoEConfig.from_hf_config(self.text_config)

    @cached_property
    def _drawn(self) -> tuple[MoEParams, MoEParams, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """(weights as handed over, the same in float64, tokens in `dtype`, the MXFP4 bytes of each stack)."""
        config, dtype = self.config, np.dtype(self.dtype)
        rng = np.random.default_rng(self.seed)
        # Matrices N(0, 1/fan_in), so every product keeps unit scale; a nonzero bias, on the scale of the
        # scores (sigmoid scores spread over about 0.2, softmax scores over about 1/n).
        spread = 0.2 if config.score_function == "sigmoid" else 0.2 / config.n
        p = init_params(config, rng, dtype=np.float64, bias_scale=spread)
        if config.use_latent_norm:
            p["routed_expert_norm.weight"] = rng.uniform(0.5, 1.5, config.ell)  # a gain that is not all ones
        # Larger gate and up pre-activations reach the SiTU caps.
        for name in ("experts.w1", "experts.w3", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"):
            p[name] = p[name] * self.activation_scale
        x = rng.standard_normal((self.tokens, config.d)).astype(dtype)  # [m, d]
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
        return hf_state_dict_from_params(self._drawn[0], self.config, mxfp4=self.mxfp4)

    def expected(self) -> np.ndarray:
        """This package's `y` `[m, d]`, float64, on exactly the values handed over."""
        return np.asarray(stable_latent_moe(self.x64, self.params64, self.config))

    def code(self, name: str = "text_config") -> str:
        """The call that rebuilds this case, given its text config under `name`."""
        dtype = dtype_name(np.dtype(self.dtype))
        dtype = "ml_dtypes.bfloat16" if dtype == "bfloat16" else f"np.{dtype}"
        return (f"refimpl.testing.hf_block_case({name}, seed={self.seed}, tokens={self.tokens}, "
                f"activation_scale={self.activation_scale}, mxfp4={self.mxfp4}, dtype={dtype})")


def hf_block_case(text_config: Mapping[str, Any], seed: int, *, tokens: int = 4, activation_scale: float = 1.0,
                  mxfp4: bool = False, dtype: Any = np.float32) -> HFBlockCase:
    """The case a report printed: weights and tokens rebuilt from `text_config` and `seed`."""
    if not isinstance(text_config, Mapping):
        raise TypeError(f"text_config must be a mapping of config keys, got {type(text_config).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    case = HFBlockCase(dict(text_config), int(seed), tokens, float(activation_scale), bool(mxfp4), np.dtype(dtype))
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
def hf_block_cases(draw: st.DrawFn, *, mxfp4: bool = False, dtype: Any = np.float32, max_tokens: int = 6,
                   max_experts: int = 8) -> HFBlockCase:
    """`HFBlockCase`s: a config of `hf_text_configs`, a seed, a few tokens, sometimes large activations."""
    text = draw(hf_text_configs(mxfp4=mxfp4, max_experts=max_experts))
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    tokens = draw(st.integers(1, max_tokens), label="tokens")
    scale = draw(st.sampled_from([1.0, 6.0]), label="activation_scale")
    return HFBlockCase(text, seed, tokens, scale, mxfp4, np.dtype(dtype))


# ---------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------

def _routing_margin(case: HFBlockCase, scores: np.ndarray) -> np.ndarray:
    """Each token's smallest gap between a kept and a dropped selection score (or group score), `[m]`."""
    config = case.config
    biased = np.asarray(biased_scores(scores, case.params64["gate.e_score_correction_bias"]))  # [m, n]
    m, n = biased.shape
    margin = np.full(m, np.inf)
    if config.n_group > 1 and config.topk_group < config.n_group:
        grouped = biased.reshape(m, config.n_group, n // config.n_group)  # [m, G, n/G]
        top_two = -np.sort(-grouped, axis=2)[:, :, :2].sum(axis=2)  # [m, G], sum of the two best
        ordered = -np.sort(-top_two, axis=1)
        margin = ordered[:, config.topk_group - 1] - ordered[:, config.topk_group]
        kept = np.argsort(-top_two, axis=1, kind="stable")[:, : config.topk_group]
        allowed = np.zeros((m, config.n_group), dtype=bool)
        np.put_along_axis(allowed, kept, True, axis=1)
        biased = np.where(allowed[:, :, None], grouped, -np.inf).reshape(m, n)
    if config.k < n:
        ordered = -np.sort(-biased, axis=1)
        margin = np.minimum(margin, ordered[:, config.k - 1] - ordered[:, config.k])
    return margin


@dataclass(frozen=True)
class ReferenceOutput:
    """What a block is compared with on a case: the float64 `y`, the tolerance per token, the tokens compared."""

    y: np.ndarray  # [m, d]
    tol: np.ndarray  # [m, 1], absolute tolerance per token
    compared: np.ndarray  # [m] bool
    relative: float  # the relative tolerance G u


def reference_output(case: HFBlockCase) -> ReferenceOutput:
    """The reference's answer on `case` and how closely a block must match it (see the page)."""
    out = stable_latent_moe(case.x64, case.params64, case.config, return_intermediates=True)
    y = np.asarray(out.y)
    # A token's size: its largest output before the shared and routed parts are added (which may cancel).
    size = np.max(np.abs(np.asarray(out.y_shared)) + np.abs(np.asarray(out.y_routed)), axis=1, keepdims=True)
    size = np.where(size > 0, size, 1.0)  # [m, 1]
    tol = tolerance(case.dtype) * size
    compared = _routing_margin(case, np.asarray(out.scores)) >= ROUTING_RESOLUTION
    # This package's own float32 evaluation: a token it cannot get right in float32 is ill-conditioned there.
    params32 = {name: value.astype(np.float32) for name, value in case.params64.items()}
    y32 = np.asarray(stable_latent_moe(case.x64.astype(np.float32), params32, case.config), dtype=np.float64)
    compared &= np.max(np.abs(y32 - y), axis=1) <= CONDITIONING * _UNIT_ROUNDOFF["float32"] * size[:, 0]
    return ReferenceOutput(y, tol, compared, tolerance(case.dtype))


def _distance(actual: np.ndarray, expected: np.ndarray, ref: ReferenceOutput) -> float:
    """The largest error over the compared tokens, in units of their tolerance (non-finite equal to itself).

    The tolerance is the reference's, or the same relative tolerance of `expected`'s own size when that is
    larger (a variant whose output is a hundred times the reference's is matched to its own scale).
    """
    same = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
    error = np.where(same, 0.0, np.abs(actual - expected))
    error = np.where(np.isnan(error), np.inf, error)
    finite = np.where(np.isfinite(expected), np.abs(expected), 0.0)
    tol = np.maximum(ref.tol[:, 0], ref.relative * np.max(finite, axis=1))  # [m]
    ratio = np.max(error, axis=1) / tol  # [m]
    return float(np.max(ratio[ref.compared], initial=0.0))


class _Mismatch(Violation):
    """The block's `y` differs from the reference: carries the case so the report can diagnose it."""

    def __init__(self, summary: str, details: list[str], inputs: dict[str, Any], case: HFBlockCase,
                 y: np.ndarray, ref: ReferenceOutput):
        super().__init__(summary, details, inputs)
        self.case, self.y, self.ref = case, y, ref
        self.conventions: list[str] = []


def _diagnose(v: _Mismatch) -> None:
    """Run every catalogued variant that applies; add to the report those that reproduce the block's output."""
    matches: list[Convention] = []
    closest: tuple[float, Convention] | None = None
    tried = 0
    for entry in CATALOGUE:
        if not entry.applies(v.case):
            continue
        try:
            variant = np.asarray(entry.output(v.case), dtype=np.float64)
        except Exception:  # a variant that cannot run on this case explains nothing
            continue
        if _distance(variant, v.ref.y, v.ref) <= 1.0:
            continue  # on this case the variant is indistinguishable from the reference
        tried += 1
        off = _distance(v.y, variant, v.ref)
        if off <= 1.0:
            matches.append(entry)
        elif closest is None or off < closest[0]:
            closest = (off, entry)
    v.conventions = [entry.name for entry in matches]
    if matches:
        v.details.append("known convention differences that reproduce this output (to the same tolerance):")
        v.details += [f"  - {entry.describe()}" for entry in matches]
    else:
        line = (f"none of the {tried} catalogued convention differences that change this case's output "
                "reproduces it")
        if closest is not None:
            line += f"; the closest, {closest[1].name}, is off by {closest[0]:.3g} x the tolerance"
        v.details.append(line)


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------

def _shapes(case: HFBlockCase) -> str:
    c = case.config
    latent = f"l = {c.ell}" if c.use_latent_projection else "no latent (l = d)"
    experts = ("MXFP4 pairs weight_packed/weight_scale" if case.mxfp4 else "weight")
    return (f"shapes: x [{case.tokens}, {c.d}]; d = {c.d}, {latent}, n = {c.n}, k = {c.k}, f = {c.f}, "
            f"shared width N_s f = {c.shared_size}; experts.{{e}}.w1/w3/w2 as {experts}")


def _inputs(case: HFBlockCase) -> dict[str, Any]:
    return {"text_config": Code(f"json.loads({json.dumps(case.text_config)!r})"),
            "case": Code(case.code()),
            "y": Code("build(text_config, case.state_dict)(case.x)  # compare with case.expected()")}


def _float_output(out: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The block's output as float64, after checking it is a real floating array of the right shape."""
    if not (hasattr(out, "shape") and hasattr(out, "dtype")):
        raise Violation(f"forward(x) must return an array y [m, d], got {type(out).__name__}")
    out = np.asarray(out)
    if tuple(out.shape) != shape:
        raise Violation(f"y must have the shape [m, d] = {list(shape)} of x, got {list(out.shape)}")
    if dtype_name(out.dtype) not in _UNIT_ROUNDOFF:
        raise Violation(f"y must be a real floating array, got dtype {out.dtype}")
    return out.astype(np.float64)


def check_hf_moe_block(build: Callable[[dict[str, Any], dict[str, np.ndarray]], Callable[[np.ndarray], Any]], *,
                       dtype: Any = np.float32, settings: str | Settings | None = None, mxfp4: bool = True,
                       max_tokens: int = 6, max_experts: int = 8) -> CheckResult:
    r"""Check a whole MoE block, built from Hugging Face config keys and tensor names, against the reference.

    `build(text_config, state_dict)` gets the reference's `text_config` keys
    (a `dict`, absent keys meaning what the reference code makes of them) and
    the block's tensors (`dict` of NumPy arrays of `dtype` under the names of
    the reference block's `state_dict()`, see `refimpl.checkpoints.state_dict`), and
    returns `forward`, with `forward(x)` taking `x` `[m, d]` (NumPy, `dtype`)
    and returning `y` `[m, d]`. The tolerance follows from `dtype` (see the
    page: float64 is held to float32's, the reference's own precision).

    Invariants:

    1. **builds and runs**: `build` accepts the tensors and `forward` returns
       a finite real `[m, d]` array;
    2. **matches the reference block** on every compared token;
    3. **matches the reference block with MXFP4 experts** (unless
       `mxfp4=False`): the routed experts arrive as `weight_packed` /
       `weight_scale` uint8 pairs (compressed-tensors' layout) instead of
       `weight`.

    A failure names the catalogued convention differences that reproduce the
    block's output (`refimpl.testing.conventions`) and prints a case to paste
    into `hf_block_case`. `settings` is a profile name or a
    `hypothesis.settings` (default: 50 examples per invariant, the same every run).
    """
    tolerance(dtype)  # an unsupported dtype is an error before anything runs
    dense = hf_block_cases(dtype=dtype, max_tokens=max_tokens, max_experts=max_experts)
    packed = hf_block_cases(mxfp4=True, dtype=dtype, max_tokens=max_tokens, max_experts=max_experts)

    def run(case: HFBlockCase) -> np.ndarray:
        forward = call_user(build, dict(case.text_config), case.state_dict)
        if not callable(forward):
            raise Violation(f"build(text_config, state_dict) must return a function forward(x), got "
                            f"{type(forward).__name__}")
        return _float_output(call_user(forward, case.x), case.x.shape)

    def output_form(case: HFBlockCase) -> None:
        y = run(case)
        if not np.all(np.isfinite(y)):
            raise Violation(f"y must be finite, got {int(np.sum(~np.isfinite(y)))} NaN or inf entries",
                            [_shapes(case)])

    def matches(case: HFBlockCase) -> None:
        y = run(case)
        ref = reference_output(case)
        error = np.where(np.isfinite(y), np.abs(y - ref.y), np.inf)  # [m, d]
        bad = np.flatnonzero(ref.compared & np.any(error > ref.tol, axis=1))
        if not bad.size:
            return
        details = [f"token {i}: expected y {_fmt(ref.y[i])}, got {_fmt(y[i])}" for i in bad[:3]]
        if bad.size > 3:
            details.append(f"... and {bad.size - 3} more tokens")
        worst = float(np.max(np.max(error, axis=1)[ref.compared] / ref.tol[ref.compared, 0]))
        details.append(f"largest error {worst:.3g} x the tolerance (per token: {tolerance(case.dtype):.3g} x its "
                       f"largest |y|, for {dtype_name(np.dtype(case.dtype))})")
        if (~ref.compared).any():
            details.append(f"{int((~ref.compared).sum())} tokens with near-tied routing or an ill-conditioned "
                           "latent sum were not compared")
        details.append(_shapes(case))
        raise _Mismatch(f"{bad.size} of {case.tokens} tokens differ from the reference block", details,
                        _inputs(case), case, y, ref)

    why = ("the reference KimiSparseMoeBlock: float32 gate, top-k of s + b (groups by their two best), weights "
           "from the raw s, renormalized when top_k > 1 and moe_renormalize, times routed_scaling_factor; "
           "SiTU-GLU experts on the latent, summed in float32, RMSNorm, up-projection, plus the shared experts")
    invariants = [
        Invariant("builds and runs", "build(text_config, state_dict) returns forward, and forward(x) is a finite "
                  "[m, d] array", dense, output_form, basic=True, describe=_inputs),
        Invariant("matches the reference block", why, dense, matches, describe=_inputs),
    ]
    if mxfp4:
        invariants.append(Invariant(
            "matches the reference block with MXFP4 experts",
            "the checkpoint's experts are MXFP4: low nibble = even column, E8M0 scale 2^(s - 127) per 32 columns",
            packed, matches, describe=_inputs))
    try:
        return run_check("check_hf_moe_block", invariants, kit_settings(settings))
    except CheckFailure as failure:
        for v in failure.violations:
            if isinstance(v, _Mismatch):
                _diagnose(v)
        raise CheckFailure(failure.check, failure.violations, failure.passed, failure.skipped) from None


def _fmt(values: np.ndarray) -> str:
    return np.array2string(np.asarray(values, dtype=np.float64) + 0.0, precision=5, separator=", ",
                           max_line_width=200, threshold=12, edgeitems=4)
