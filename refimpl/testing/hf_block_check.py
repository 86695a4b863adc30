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

## A port of another model: `model_type`

A port of DeepSeek-V3, GLM-4 MoE, Kimi Linear, Qwen3-MoE, Mixtral or Nemotron-H is checked
against that model's rules, not K3's. With `model_type`, the check draws
configurations in the model's own keys (so its configuration class builds them),
hands the tensors of that block's `state_dict()` (fused experts
`experts.gate_up_proj` and `experts.down_proj`; no selection bias or shared
experts where the block has none; in some cases a bias far from zero, where
trained checkpoints hold it) and computes the expected output as that model
does: DeepSeek-V3 renormalizes a single chosen weight where K3 keeps it raw,
Mixtral always renormalizes, Qwen3-MoE only with `norm_topk_prob`. K3 in
transformers' draft (`model_type="kimi_k3"`) gets the draft's keys and fused
tensors and is held to K3's code: its one difference, a renormalized single
weight, is named `top1_renormalized`. The ten
lines a porter pastes, here with transformers' own block standing in for the port:

```python
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from refimpl.testing import check_hf_moe_block

def build(text_config, state_dict):            # DeepSeek-V3's keys, its block's tensor names
    block = DeepseekV3MoE(DeepseekV3Config(**text_config)).eval()   # your port here
    block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
    return lambda x: block(torch.from_numpy(x)[None])[0].detach().numpy()

check_hf_moe_block(build, model_type="deepseek_v3")
```

A port that does not cover every configuration (no group-limited routing,
say) raises `refimpl.testing.Unsupported("why")` from `build` for the ones
it declines; the check draws others, and fails with a clear message when too
few were covered to mean anything. There is no MXFP4 invariant for these
models: their checkpoints store float experts.

## The tolerance, and what float64 asks

A token passes when its largest error is within

$$
|y_{i,j} - y^{\text{ref}}_{i,j}| \le G \cdot u \cdot \max_j \bigl(|y^{\text{shared}}_{i,j}| + |y^{\text{routed}}_{i,j}|\bigr),
\qquad G = 2^{7},
$$

where $u$ is the unit roundoff of `dtype` ($2^{-53}$ for float64, $2^{-24}$
for float32, $2^{-11}$ for float16, $2^{-8}$ for bfloat16) and the token's size is taken before its
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

**What float64 asks.** `dtype=np.float64` holds float64's $u$: a port
checked in float64 must compute in float64. The reference modeling code (and
transformers' blocks) compute the router in float32 and accumulate the routed
experts in float32 whatever the block's dtype, and a JAX client without
`jax_enable_x64` computes in float32 too: such a port fails the float64 check,
and the report says so ("the block computes in float32, not in the float64
it was asked for") with the precision it achieved, the largest error as a
multiple of a token's size and the narrowest dtype whose tolerance holds it.
Check such a port with `dtype=np.float32`.

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
* a name is printed only when the entry also reproduces the block on every
  one of six larger relatives of the case (the same configuration, other seeds,
  six tokens or more) where the block differs from the reference: a one-token,
  four-expert case is often reproduced by several wrong routes at once;
* when the block's output is $c$ times the reference's on every token, the
  report says so, with $c$;
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

**Every difference, not the first.** A named difference is then assumed: the
comparison runs again against the reference computed with it
(`conventions.assume`), on every case, and a remaining difference is named
against variants that have both, so a second difference behind one that
changes every output is still found, with its own case (the report's
expected output is `refimpl.testing.conventions.assume(case, [...]).expected()`).
An entry that is not a change of the config or weights is scoped out instead:
the next round leaves out the cases on which it shows, and fails, saying so,
when that leaves too few. The round names say which: `matches the reference
block, with gate_up_swapped assumed`, `..., with bias_in_weights scoped out`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.validation import check_int
from .._lib.values import switch_value
from .._lib.xp import dtype_name
from ..layer.latent_moe import stable_latent_moe
from ..layer.routing import biased_scores
from .conventions import CATALOGUE, Convention, assume, convention
from .hf_cases import (
    CONDITIONING,
    GROWTH,
    ROUTING_RESOLUTION,
    UNIT_ROUNDOFF,
    HFBlockCase,
    hf_block_cases,
    kit_family,
    pinned_keys,
    tolerance,
)
from .outputs import float_output, fmt
from .profiles import kit_settings
from .report import (
    CheckResult,
    Code,
    Invariant,
    Outcome,
    OutOfScope,
    Violation,
    call_user,
    call_user_keeping_inputs,
    kit_storage,
    outcome_of,
    run_invariant,
    written_inputs,
)

__all__ = ["ReferenceOutput", "check_hf_moe_block", "reference_output"]


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
    if config.top_k < n:
        ordered = -np.sort(-biased, axis=1)
        margin = np.minimum(margin, ordered[:, config.top_k - 1] - ordered[:, config.top_k])
    return margin


@dataclass(frozen=True)
class ReferenceOutput:
    """What a block is compared with on a case: the float64 `y`, the tolerance per token, the tokens compared."""

    y: np.ndarray  # [m, d]
    tol: np.ndarray  # [m, 1], absolute tolerance per token
    compared: np.ndarray  # [m] bool
    relative: float  # the relative tolerance G u


def reference_output(case: HFBlockCase, relative: float | None = None) -> ReferenceOutput:
    """The reference's answer on `case` and how closely a block must match it (see the page).

    `relative` replaces the relative tolerance of `case.dtype` (a float64 check that goes on at float32's).
    """
    out = stable_latent_moe(case.x64, case.params64, case.config, return_intermediates=True)
    y = np.asarray(out.y)
    # A token's size: its largest output before the shared and routed parts are added (which may cancel).
    size = np.max(np.abs(np.asarray(out.y_shared)) + np.abs(np.asarray(out.y_routed)), axis=1, keepdims=True)
    size = np.where(size > 0, size, 1.0)  # [m, 1]
    relative = tolerance(case.dtype) if relative is None else relative
    tol = relative * size
    compared = _routing_margin(case, np.asarray(out.scores)) >= ROUTING_RESOLUTION
    # This package's own float32 evaluation: a token it cannot get right in float32 is ill-conditioned there.
    params32 = {name: value.astype(np.float32) for name, value in case.params64.items()}
    y32 = np.asarray(stable_latent_moe(case.x64.astype(np.float32), params32, case.config), dtype=np.float64)
    compared &= np.max(np.abs(y32 - y), axis=1) <= CONDITIONING * UNIT_ROUNDOFF["float32"] * size[:, 0]
    return ReferenceOutput(y, tol, compared, relative)


def _token_ratios(actual: np.ndarray, expected: np.ndarray, ref: ReferenceOutput) -> np.ndarray:
    """Each token's largest error, in units of its tolerance (non-finite equal to itself), `[m]`.

    The tolerance is the reference's, or the same relative tolerance of `expected`'s own size when that is
    larger (a variant whose output is a hundred times the reference's is matched to its own scale).
    """
    same = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
    error = np.where(same, 0.0, np.abs(actual - expected))
    error = np.where(np.isnan(error), np.inf, error)
    finite = np.where(np.isfinite(expected), np.abs(expected), 0.0)
    tol = np.maximum(ref.tol[:, 0], ref.relative * np.max(finite, axis=1))  # [m]
    return np.max(error, axis=1) / tol  # [m]


def _distance(actual: np.ndarray, expected: np.ndarray, ref: ReferenceOutput) -> float:
    """The largest error over the compared tokens, in units of their tolerance (`_token_ratios`)."""
    return float(np.max(_token_ratios(actual, expected, ref)[ref.compared], initial=0.0))


def _variant_distance(y: np.ndarray, entry: Convention, case: HFBlockCase, ref: ReferenceOutput) -> float:
    """How far `y` is from `entry`'s output on `case` (from the nearest tie order, for entries that have several)."""
    if entry.resolutions is None:
        return _distance(y, np.asarray(entry.output(case), dtype=np.float64), ref)
    outputs = np.asarray(entry.resolutions(case), dtype=np.float64)  # [c, m, d]
    per_token = np.min([_token_ratios(y, out, ref) for out in outputs], axis=0)  # [m]: each token's nearest
    return float(np.max(per_token[ref.compared], initial=0.0))


class _Mismatch(Violation):
    """The block's `y` differs from the reference: carries the case so the report can diagnose it."""

    def __init__(self, summary: str, details: list[str], inputs: dict[str, Any], case: HFBlockCase,
                 y: np.ndarray, ref: ReferenceOutput):
        super().__init__(summary, details, inputs)
        self.case, self.y, self.ref = case, y, ref
        self.conventions: list[str] = []


#: Cases besides the failing one on which a catalogue entry must also reproduce the block before it is named.
CONFIRMING_CASES = 6


def _matching_entries(case: HFBlockCase, y: np.ndarray, ref: ReferenceOutput
                      ) -> tuple[list[Convention], tuple[float, Convention] | None, int]:
    """The entries that reproduce `y` on `case` (and change its output), the closest other one, how many tried."""
    matches: list[Convention] = []
    closest: tuple[float, Convention] | None = None
    tried = 0
    for entry in CATALOGUE:
        if not entry.applies(case):
            continue
        try:
            if _variant_distance(ref.y, entry, case, ref) <= 1.0:
                continue  # on this case the variant is indistinguishable from the reference
            off = _variant_distance(y, entry, case, ref)
        except Exception:  # a variant that cannot run on this case explains nothing
            continue
        tried += 1
        if off <= 1.0:
            matches.append(entry)
        elif closest is None or off < closest[0]:
            closest = (off, entry)
    return matches, closest, tried


def _confirming_cases(case: HFBlockCase) -> list[HFBlockCase]:
    """Unshrunk relatives of a failing case: the same configuration, other seeds, more tokens."""
    tokens = max(case.tokens, 6)
    return [replace(case, seed=(case.seed + 7919 * r) % 2**32, tokens=tokens) for r in range(1, CONFIRMING_CASES + 1)]


def _scale_factor(y: np.ndarray, ref: ReferenceOutput) -> float | None:
    """c when the block's output is c times the reference's (c not 1) on every compared token, else None."""
    expected = ref.y[ref.compared]
    actual = y[ref.compared]
    norm = float(np.sum(expected * expected))
    if not norm or not np.all(np.isfinite(actual)):
        return None
    c = float(np.sum(actual * expected)) / norm
    if abs(c - 1) <= 8 * ref.relative or _distance(y, c * ref.y, ref) > 1.0:
        return None
    return c


def _diagnose(v: _Mismatch, run: Callable[[HFBlockCase], np.ndarray],
              in_scope: Callable[[HFBlockCase], bool] = lambda case: True) -> None:
    """Name the catalogued variants that reproduce the block, confirmed on several unshrunk cases.

    The simplest failing case (one token, four experts) is often reproduced by several wrong routes at once,
    so a name is printed only when it also reproduces the block on every confirming case where the block
    differs from the reference (`CONFIRMING_CASES` relatives of the case: other seeds, more tokens), among
    those `in_scope` (where no difference named before shows).
    """
    matches, closest, tried = _matching_entries(v.case, v.y, v.ref)
    scale = _scale_factor(v.y, v.ref)
    confirmed, differing, scoped, scale_holds = list(matches), 0, 0, []
    for other in _confirming_cases(v.case) if matches or scale is not None else []:
        if not in_scope(other):
            scoped += 1
            continue
        try:
            y = run(other)
        except Exception:  # the build declined or failed on a relative: it confirms nothing
            continue
        ref = reference_output(other)
        if _distance(y, ref.y, ref) <= 1.0:
            continue  # the block agrees with the reference here
        differing += 1
        confirmed = [entry for entry in confirmed if _variant_distance(y, entry, other, ref) <= 1.0]
        # One token is c x the reference for some c whenever only its size is wrong: a scale is confirmed on
        # the relatives, which have six tokens or more, with the same c.
        if scale is not None and ref.compared.sum() >= 2:
            scale_holds.append(_distance(y, scale * ref.y, ref) <= 1.0)
    v.conventions = [entry.name for entry in confirmed]
    if scale is not None and scale_holds and all(scale_holds):
        v.details.append(f"the block's output is {scale:.6g} x the reference's on every compared token: a "
                         "scaling factor applied where it should not be, or missed")
    if confirmed:
        seen = (f"confirmed on {differing} more cases of this configuration" if differing
                else f"on this case only: of the other seeds tried, {scoped} were scoped out (a difference named "
                     "before shows on them) and the block agreed with the reference on the rest" if scoped
                else "on this case only: the block agreed with the reference on the other seeds tried")
        v.details.append(f"known convention differences that reproduce this output (to the same tolerance; {seen}):")
        v.details += [f"  - {entry.describe()}" for entry in confirmed]
    else:
        line = (f"none of the {tried} catalogued convention differences that change this case's output "
                "reproduces it")
        if matches:
            line += (f" on every case: {', '.join(entry.name for entry in matches)} reproduced the simplest case but "
                     f"not all of {differing} larger ones")
        elif closest is not None:
            line += f"; the closest, {closest[1].name}, is off by {closest[0]:.3g} x the tolerance"
        v.details.append(line)


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------

def _shapes(case: HFBlockCase) -> str:
    c = case.drawn_config
    if case.model_type is not None:
        w = "l" if c.use_latent_projection else "d"  # the width the experts see
        fused = (f"experts.up_proj [n, f, {w}] and experts.down_proj [n, {w}, f] (ungated)" if c.activation == "relu2"
                 else f"experts.gate_up_proj [n, 2f, {w}] (gate rows first) and experts.down_proj [n, {w}, f]")
        latent = f", l = {c.latent_size}" if c.use_latent_projection else ""
        return (f"shapes: x [{case.tokens}, {c.hidden_size}]; d = {c.hidden_size}{latent}, n = {c.num_experts}, "
                f"k = {c.top_k}, f = {c.intermediate_size}, shared width {c.shared_size}; experts fused as {fused}")
    latent = f"l = {c.latent_size}" if c.use_latent_projection else "no latent (l = d)"
    experts = ("MXFP4 pairs weight_packed/weight_scale" if case.mxfp4 else "weight")
    return (f"shapes: x [{case.tokens}, {c.hidden_size}]; d = {c.hidden_size}, {latent}, n = {c.num_experts}, k = {c.top_k}, f = {c.intermediate_size}, "
            f"shared width N_s f = {c.shared_size}; experts.{{e}}.w1/w3/w2 as {experts}")


def _inputs(case: HFBlockCase) -> dict[str, Any]:
    """The pasteable case; for a round with differences assumed, the expected output names them."""
    expected = "case.expected()"
    if case.assumed:
        expected = f"refimpl.testing.conventions.assume(case, {[entry.name for entry in case.assumed]!r}).expected()"
    return {"text_config": Code(f"json.loads({json.dumps(case.text_config)!r})"),
            "case": Code(case.code()),
            "y": Code(f"build(text_config, case.state_dict)(case.x)  # compare with {expected}")}


def _family_semantics(model_type: str) -> str:
    """What transformers' block of `model_type` computes, for the report."""
    family = kit_family(model_type)
    if family.draft_config is not None:
        return (f"transformers' draft {family.block_class} held to K3's code: float32 gate, sigmoid scores, top-k of "
                "s + b (groups by their two best, the others masked with -inf), weights from the raw s, renormalized "
                "when top_k > 1 and norm_topk_prob (a single weight stays the raw score: the draft's DeepSeek-V3 "
                "router renormalizes it, named top1_renormalized), times routed_scaling_factor; SiTU-GLU experts on "
                "the latent routed_expert_down_proj x, summed in float32, the latent RMSNorm (rms_norm_eps), "
                "routed_expert_up_proj, plus the shared experts")
    if not family.gated:  # ungated experts on a latent: NVIDIA's LatentMoE
        return ("transformers' NemotronHMoE (NVIDIA's LatentMoE): float32 gate, sigmoid scores, top-k of s + b "
                "(groups by their two best, the others masked with -inf), weights from the raw s, renormalized when "
                "norm_topk_prob, times routed_scaling_factor; ungated relu(W z)^2 experts on the latent "
                "fc1_latent_proj x (no norm), summed in float32, then fc2_latent_proj; plus the ungated shared expert")
    if "score_function" in family.keys:  # a router that reads its score function from the config
        return ("transformers' DeepseekV4SparseMoeBlock (a top-k layer): the gate in the block's dtype, "
                "sqrt(softplus) scores, top-k of s + b (no groups), weights from the raw s, always renormalized (a "
                "single weight too), times routed_scaling_factor; SwiGLU experts with the gate clamped to "
                "min(a, swiglu_limit) and the up branch to [-swiglu_limit, swiglu_limit], plus one shared expert "
                "clamped alike")
    if family.keys.get("n_group") is not None:
        renormalize = family.keys["renormalize"].key
        return (f"transformers' {family.block_class}: float32 gate, sigmoid scores, top-k of s + b (groups by "
                f"their two best, the others masked with -inf), weights from the raw s, renormalized when "
                f"{renormalize} (a single weight too), times routed_scaling_factor; SwiGLU experts on the full "
                "width, plus the shared experts")
    if family.fixed.get("renormalize") is True:  # a softmax router that always renormalizes
        return (f"transformers' {family.block_class}: softmax of the logits in float32, top-k, always "
                "renormalized; SwiGLU experts, no shared experts")
    return (f"transformers' {family.block_class}: softmax of the logits in float32, top-k, renormalized only "
            "when norm_topk_prob; SwiGLU experts, no shared experts")


#: At most this many further rounds of "matches the reference block", each with the differences named so far
#: assumed (or scoped out), look for more differences after the first.
MAX_DIFFERENCES = 4

#: The invariant that compares the block with the reference, and its rounds.
MATCHES = "matches the reference block"


def _precision_achieved(y: np.ndarray, ref: ReferenceOutput) -> tuple[float, str | None]:
    """The block's largest error relative to a token's size, and the narrowest dtype whose tolerance holds it."""
    size = ref.tol[:, 0] / ref.relative  # [m], each token's size
    error = np.where(np.isfinite(y), np.abs(y - ref.y), np.inf).max(axis=1) / size  # [m]
    worst = float(np.max(error[ref.compared], initial=0.0))
    for name in ("float64", "float32", "float16", "bfloat16"):  # finest first
        if worst <= GROWTH * UNIT_ROUNDOFF[name]:
            return worst, name
    return worst, None


def _precision_line(worst: float, achieved: str | None) -> str:
    where = (f"within {achieved}'s tolerance ({GROWTH * UNIT_ROUNDOFF[achieved]:.3g})" if achieved
             else "beyond even bfloat16's tolerance: a difference of convention, not of precision")
    return f"precision achieved: largest error {worst:.3g} x a token's size, {where}"


def _visible(entry: Convention, case: HFBlockCase, ref: ReferenceOutput) -> bool:
    """Whether the difference `entry` changes the output of `case` (so a port that has it differs here)."""
    if not entry.applies(case):
        return False
    try:
        return _variant_distance(ref.y, entry, case, ref) > 1.0
    except Exception:  # a variant that cannot run on this case cannot show on it
        return False


def check_hf_moe_block(build: Callable[[dict[str, Any], dict[str, np.ndarray]], Callable[[np.ndarray], Any]], *,
                       dtype: Any = np.float32, settings: str | Settings | None = None, mxfp4: bool = True,
                       max_tokens: int = 6, max_experts: int = 8, model_type: str | None = None,
                       pinned: Mapping[str, Any] | None = None) -> CheckResult:
    r"""Check a whole MoE block, built from Hugging Face config keys and tensor names, against the reference.

    `build(text_config, state_dict)` gets the reference's `text_config` keys
    (a `dict`, absent keys meaning what the reference code makes of them) and
    the block's tensors (`dict` of NumPy arrays of `dtype` under the names of
    the reference block's `state_dict()`, see `refimpl.checkpoints.state_dict`), and
    returns `forward`, with `forward(x)` taking `x` `[m, d]` (NumPy, `dtype`)
    and returning `y` `[m, d]`. The tolerance follows from `dtype` (see the
    page: float64 is held to float64's, and a port that computes in float32
    fails it, saying so).

    Invariants:

    1. **builds and runs**: `build` accepts the tensors and `forward` returns
       a finite real `[m, d]` array;
    2. **one build answers every input**: one build is asked three batches,
       `x`, another `x'` and `x` again: each answer matches the reference, a
       forward that returns an earlier answer for a new input (the first one's,
       or the previous call's), or one buffer that its next call writes over
       (the array returned for `x` is read again after `x'`), is a *stale
       output*, one whose answer to the same input changes otherwise is a
       *drift*, and
       a build that writes into the `state_dict` or `text_config` it was
       handed (then, or later from `forward`) fails, naming it;
    3. **matches the reference block** on every compared token; when a
       catalogued difference is named, the invariant runs again with that
       difference assumed: the port is compared with the reference computed
       with it (`conventions.assume`), and a further difference is named
       against variants that have both. So every distinct difference is
       reported, each named and with its own case, even behind one that
       changes every output. The entries that are not a change of the config
       or weights (a route or output computed another way) cannot be assumed:
       the round leaves out the cases on which they show, and when that
       leaves too few cases it fails, saying it could check nothing beyond
       them. At most `MAX_DIFFERENCES` further rounds run;
    4. **unchanged when every bias shifts by one constant** (for blocks with
       a selection bias): the same case with every expert's bias moved by 8
       or by -40 gives the same output. Trained biases sit far from zero; a
       bias kept in bfloat16, or dropped groups masked with 0 instead of
       -inf, change the routes there and fail;
    5. **matches the reference block with MXFP4 experts** (unless
       `mxfp4=False`): the routed experts arrive as `weight_packed` /
       `weight_scale` uint8 pairs (compressed-tensors' layout) instead of
       `weight`.

    A failure names the catalogued convention differences that reproduce the
    block's output (`refimpl.testing.conventions`) and prints a case to paste
    into `hf_block_case`. `settings` is a profile name or a
    `hypothesis.settings` (default: 50 examples per invariant, the same every run).

    `pinned` maps config keys to the values the port fixes (`{"hidden_act":
    "situ", "latent_moe_use_norm": True}`): every draw keeps them, so the
    draws are spent on what the port covers. A key the block's reader does not
    read (a misspelling) and pins no configuration can take (`{"num_experts":
    0}`) are a `ValueError` before anything runs (`hf_cases.pinned_keys`).
    Every report, and the returned `CheckResult` of a pass, says how many
    cases each invariant covered and how many the build declined with
    `refimpl.testing.Unsupported`; an invariant that covered fewer than
    `MIN_COVERED` cases fails, whatever kept them out.

    `model_type` names a transformers family instead of K3 (`"deepseek_v3"`,
    `"glm4_moe"`, `"kimi_linear"`, `"qwen3_moe"`, `"mixtral"`, `"nemotron_h"`), or
    K3 in transformers' draft (`"kimi_k3"`: DeepSeek-V3's keys plus the draft's
    latent and SiTU keys, its fused tensors, K3's code's rules): the check
    then draws that model's own configuration keys (`ConfigClass(**text_config)`
    builds them), hands the tensors of that block's `state_dict()` (fused
    experts; no bias or shared experts where the block has none; selection
    biases far from zero in some cases) and holds the output to that model's
    rules (DeepSeek-V3 renormalizes a single weight, K3 does not). There is no
    MXFP4 invariant then. A build may decline a configuration its port does not
    cover by raising `refimpl.testing.Unsupported`.
    """
    if not callable(build):
        raise TypeError(f"build must be a function build(text_config, state_dict) -> forward, got "
                        f"{type(build).__name__}")
    tolerance(dtype)  # an unsupported dtype is an error before anything runs
    mxfp4 = switch_value(mxfp4, "mxfp4")
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    max_experts = check_int("max_experts", max_experts, low=2)  # the fewest experts a routing choice needs
    if model_type is not None:
        kit_family(model_type)  # an unknown family is an error before anything runs
        mxfp4 = False
    with kit_storage():
        pinned = pinned_keys(pinned, model_type=model_type, mxfp4=mxfp4, max_experts=max_experts)
    dense = hf_block_cases(dtype=dtype, max_tokens=max_tokens, max_experts=max_experts, model_type=model_type,
                           pinned=pinned)
    packed = hf_block_cases(mxfp4=True, dtype=dtype, max_tokens=max_tokens, max_experts=max_experts, pinned=pinned)
    why = _family_semantics(model_type) if model_type is not None else _K3_SEMANTICS
    port = _Port(build)

    invariants = [
        Invariant("builds and runs", "build(text_config, state_dict) returns forward, and forward(x) is a finite "
                  "[m, d] array", dense, port.output_form, basic=True, describe=_inputs),
        Invariant("one build answers every input", "forward(x) is a function of x: one build asked x, another "
                  "batch x' and x again answers each as the reference does, and leaves what it was handed as it was",
                  dense, port.several_inputs, describe=_inputs),
    ]
    if model_type is None or kit_family(model_type).has_bias:
        invariants.append(Invariant(
            "unchanged when every bias shifts by one constant",
            "the selection ranks s + b per token, so adding one constant to every expert's bias, however far "
            "from zero, changes no route and no weight", st.tuples(dense, st.sampled_from([8.0, -40.0])),
            port.shift_unchanged,
            describe=lambda drawn: _inputs(replace(drawn[0], bias_offset=drawn[0].bias_offset + drawn[1]))))
    if mxfp4:
        invariants.append(Invariant(
            "matches the reference block with MXFP4 experts",
            "the checkpoint's experts are MXFP4: low nibble = even column, E8M0 scale 2^(s - 127) per 32 columns",
            packed, port.matches(), describe=_inputs))
    resolved = kit_settings(settings)
    with kit_storage():
        outcomes = [run_invariant(invariants[0], resolved)]
        if outcomes[0].violation is not None:
            skipped = [invariants[1].name, MATCHES, *(i.name for i in invariants[2:])]
            return outcome_of("check_hf_moe_block", outcomes, skipped, resolved)
        outcomes.append(run_invariant(invariants[1], resolved))
        differences = _every_difference(port, dense, why, resolved)
        outcomes += differences
        for invariant in invariants[2:]:
            outcome = run_invariant(invariant, resolved)
            if (isinstance(outcome.violation, _Mismatch)
                    and "computed_in_float32" not in outcome.violation.conventions):
                _diagnose(outcome.violation, port.run)
            outcomes.append(outcome)
    named = [name for o in differences if o.violation is not None for name in o.violation.conventions]
    notes = ([f"Distinct differences named: {', '.join(named)} (each with its own case below)."]
             if len(named) > 1 else [])
    if differences[0].violation is None:
        notes += single_weight_note(**port.single_weight)
    return outcome_of("check_hf_moe_block", outcomes, [], resolved, notes)


def single_weight_note(covered: int, visible: int) -> list[str]:
    """What the passing cases said of a single weight: kept raw (K3's code) or renormalized (DeepSeek-V3's router).

    With `top_k = 1` K3's code keeps the raw score; a port routing with DeepSeek-V3's router (transformers'
    draft of K3) renormalizes it to `routed_scaling_factor`. K3's latent RMSNorm divides a token's one weight
    out again but for its epsilon, so the two differ only where the latent sum is small against the epsilon:
    `visible` of the `covered` top-1 cases (those whose renormalization key says true) could tell them apart.
    """
    if not covered:
        return []
    if not visible:
        return [f"the check could not tell whether the block renormalizes a single weight: on none of the {covered} "
                "top-1 cases covered would renormalizing it (top1_renormalized) change the output beyond the "
                "tolerance (K3's latent norm divides a single weight out again but for its epsilon, rms_norm_eps: "
                "the two differ only where a token's latent sum is small against it)"]
    return [f"a single weight kept raw, as K3's code does, was told apart from a renormalized one "
            f"(top1_renormalized) on {visible} of the {covered} top-1 cases covered (on the others K3's latent norm "
            "divides a single weight out again but for its epsilon)"]


_K3_SEMANTICS = ("the reference KimiSparseMoeBlock: float32 gate, top-k of s + b (groups by their two best), weights "
                 "from the raw s, renormalized when top_k > 1 and moe_renormalize, times routed_scaling_factor; "
                 "SiTU-GLU experts on the latent, summed in float32, RMSNorm, up-projection, plus the shared experts")


@dataclass(frozen=True)
class _Round:
    """What one round of "matches the reference block" takes as given: the differences named before it.

    `assumed`: differences that are a change of the config or the weights (`Convention.composable`); the
    round compares the port with the reference computed with them (`conventions.assume`), on every case, so a
    further difference shows wherever it changes the output and is named against variants that have the
    assumed ones too. `scoped`: the others, which do not compose; the round leaves out the cases on which they
    show. `relative`: float32's tolerance, for a port computing in float32 checked at float64.
    """

    assumed: tuple[Convention, ...] = ()
    scoped: tuple[Convention, ...] = ()
    relative: float | None = None

    @property
    def first(self) -> bool:
        """Whether this is the first round: nothing assumed, nothing left out, the tolerance of the dtype."""
        return not self.assumed and not self.scoped and self.relative is None

    @property
    def named(self) -> tuple[Convention, ...]:
        """Every difference named before this round, assumed or scoped out."""
        return self.assumed + self.scoped

    @property
    def name(self) -> str:
        """The round's invariant name: `MATCHES`, then what it assumed and what it scoped out."""
        parts = []
        if self.assumed:
            parts.append(f"{_names(self.assumed)} assumed")
        scoped = [entry.name for entry in self.scoped] + (["float32 precision"] if self.relative is not None else [])
        if scoped:
            parts.append(f"{', '.join(scoped)} scoped out")
        return f"{MATCHES}, with {' and '.join(parts)}" if parts else MATCHES

    def after(self, named: Sequence[Convention]) -> _Round:
        """The next round, once `named` (the entries that reproduce this round's failure) are taken as given.

        Several entries named at once are alternatives for one difference (`scale_never_applied` and
        `scale_skipped_without_renormalization` on a case that does not renormalize), not several differences:
        the first composable one is assumed and the others are scoped out, so that the cases on which the
        alternatives still disagree are left out instead of being compared with a guess. When none is
        composable, all are scoped out.
        """
        new = [entry for entry in named if entry not in self.named]
        chosen = next((entry for entry in new if entry.composable), None)
        assumed = self.assumed + ((chosen,) if chosen is not None else ())
        return replace(self, assumed=assumed, scoped=self.scoped + tuple(e for e in new if e is not chosen))


def _names(entries: Sequence[Convention]) -> str:
    return ", ".join(entry.name for entry in entries)


def _every_difference(port: _Port, cases: st.SearchStrategy, why: str, settings: Settings) -> list[Outcome]:
    """"matches the reference block", then again with each named difference assumed (or scoped out).

    A round whose failure is named (a catalogue entry reproduces the port) is followed by one that takes that
    difference as given (`_Round.after`): assumed where it composes, so the next round checks every case and
    can name a second difference even when the first changes every output; scoped out where it does not. A
    port computing in float32 checked at float64 is held at float32's tolerance in the next round. The rounds
    stop at a pass, at a failure no new entry names, at a round left too few cases to check anything (it
    fails, `_nothing_left`), or after `MAX_DIFFERENCES` further rounds.
    """
    outcomes: list[Outcome] = []
    given = _Round()
    for _ in range(MAX_DIFFERENCES + 1):
        outcome = run_invariant(Invariant(given.name, why, cases, port.matches(given), describe=_inputs), settings)
        outcomes.append(outcome)
        v = outcome.violation
        if v is not None and not isinstance(v, _Mismatch) and outcome.coverage.scoped_out and given.named:
            _nothing_left(v, outcome, given)
        if not isinstance(v, _Mismatch):
            break
        if "computed_in_float32" in v.conventions:
            given = replace(given, relative=tolerance(np.float32))
            continue
        _diagnose(v, port.run, in_scope=_outside(given.scoped))
        following = given.after([entry for entry in CATALOGUE if entry.name in v.conventions])
        if following.named == given.named:
            break
        given = following
    return outcomes


def _nothing_left(v: Violation, outcome: Outcome, given: _Round) -> None:
    """Say why a round covered too few cases: differences that cannot be assumed show on nearly every case."""
    assumed = f" (with {_names(given.assumed)} assumed)" if given.assumed else ""
    v.summary = (f"could not check anything beyond {_names(given.named)}: {_names(given.scoped)} cannot be "
                 f"assumed (a route or an output computed another way, not a change of the config or the weights), "
                 f"so the cases on which it shows were scoped out{assumed}: {outcome.coverage.scoped_out} of those "
                 f"drawn ({outcome.coverage.covered} covered); a further difference would not show here")
    v.args = (v.summary,)
    v.details.append(f"correct {_names(given.scoped)} (or pin config keys on which it does not show) and run the "
                     "check again to look for other differences")


def _outside(scope: tuple[Convention, ...]) -> Callable[[HFBlockCase], bool]:
    """Whether a case (with the round's differences assumed) is one on which none of those in `scope` shows."""
    def in_scope(case: HFBlockCase) -> bool:
        ref = reference_output(case)
        return not any(_visible(entry, case, ref) for entry in scope)
    return in_scope


class _Port:
    """The user's `build`, called the ways the invariants need."""

    def __init__(self, build: Callable[..., Any]):
        self.build = build
        #: In the first round of "matches the reference block": the covered cases on which K3's code keeps a
        #: single weight raw where renormalizing it is plausible (`top1_renormalized` applies), and how many of
        #: them a renormalized single weight would change (`single_weight_note`).
        self.single_weight = {"covered": 0, "visible": 0}

    def forward_of(self, case: HFBlockCase) -> tuple[Callable[[np.ndarray], Any], tuple, tuple]:
        """`build(text_config, state_dict)`'s forward, the copies it was handed, and copies of them as they were."""
        try:
            forward, given, kept = call_user_keeping_inputs(self.build, dict(case.text_config), case.state_dict)
        except Violation as v:
            if case.mxfp4 and isinstance(v.__cause__, KeyError) and ".weight" in str(v.__cause__):
                v.details.append("in this case the routed experts arrive as MXFP4 pairs, weight_packed and "
                                 "weight_scale, not weight: a build that reads float experts only is checked "
                                 "with mxfp4=False")
            raise
        if not callable(forward):
            raise Violation(f"build(text_config, state_dict) must return a function forward(x), got "
                            f"{type(forward).__name__}")
        return forward, given, kept

    @staticmethod
    def answer(forward: Callable[[np.ndarray], Any], x: np.ndarray) -> np.ndarray:
        return float_output("y", call_user(forward, x), x.shape, "[m, d]", finite=False)

    def run(self, case: HFBlockCase) -> np.ndarray:
        """A fresh build's `y` on `case.x`."""
        return self.answer(self.forward_of(case)[0], case.x)

    def output_form(self, case: HFBlockCase) -> None:
        y = self.run(case)
        if not np.all(np.isfinite(y)):
            raise Violation(f"y must be finite, got {int(np.sum(~np.isfinite(y)))} NaN or inf entries",
                            [_shapes(case)])

    def matches(self, given: _Round = _Round()) -> Callable[[HFBlockCase], None]:
        """The body of "matches the reference block": the port against the reference with `given.assumed`
        applied, on the cases where none of `given.scoped` shows."""
        top1 = convention("top1_renormalized")

        def body(case: HFBlockCase) -> None:
            case = assume(case, given.assumed)
            ref = reference_output(case, given.relative)
            if any(_visible(entry, case, ref) for entry in given.scoped):
                raise OutOfScope
            _compare(self.run(case), case, ref)
            if given.first and top1.applies(case):
                self.single_weight["covered"] += 1
                self.single_weight["visible"] += _visible(top1, case, ref)
        return body

    def several_inputs(self, case: HFBlockCase) -> None:
        """One build asked x, x' and x again answers as fresh builds do: no stale output, no drift, no writes."""
        forward, given, kept = self.forward_of(case)
        other = replace(case, batch=1)
        ref, ref_other = reference_output(case), reference_output(other)
        returned = call_user(forward, case.x)  # kept as returned: a later call must not change it
        y_first = float_output("y", returned, case.x.shape, "[m, d]", finite=False)
        y_other = self.answer(forward, other.x)
        reread = float_output("y", returned, case.x.shape, "[m, d]", finite=False)  # before x is asked again
        y_again = self.answer(forward, case.x)
        written = written_inputs(self.build, kept, given)
        inputs = {**_inputs(case), "x_other": Code(other.code("text_config") + ".x")}
        if written:
            raise Violation(f"build kept what it was handed and wrote into {', '.join(written)} later, when "
                            "forward ran: a build must leave its inputs as they were (the caller loads the "
                            "same state dict into other blocks)", [_shapes(case)], inputs)
        if _distance(reread, y_first, ref) > 1.0 or not np.array_equal(np.isfinite(reread), np.isfinite(y_first)):
            raise Violation("stale output: forward returned a buffer that its later calls write over",
                            ["asked x and then another batch x', the array it returned for x changed under "
                             "the caller: a forward that returns one output buffer and refills it on each "
                             "call (the caller's earlier answers change; keep a fresh output per call)",
                             _shapes(case)], inputs)
        both = replace(ref_other, compared=ref_other.compared & ref.compared)
        drift = _distance(y_again, y_first, ref)
        if drift > 1.0 or (np.isfinite(y_first).all() and not np.isfinite(y_again).all()):
            # A forward one call behind answers x again with its answer to x', the input before: stale, not drift.
            fresh = self.run(other)
            if both.compared.any() and _distance(y_again, fresh, both) <= 1.0 < _distance(fresh, y_first, both):
                raise Violation("stale output: forward returned its answer to an earlier input for a new one",
                                ["asked x, another batch x' and x again, it answered x the second time with what "
                                 "a fresh build answers x': a forward that returns the previous call's output "
                                 "(a pipeline one call behind, or a buffer returned before it is refilled)",
                                 _shapes(case)], inputs)
            scale = _scale_factor(y_again, replace(ref, y=y_first))
            details = [f"the third call (x again) is off the first by {drift:.3g} x the tolerance"]
            if scale is not None:
                details.append(f"its answer is {scale:.6g} x the first one's: the forward's state changes from "
                               "call to call")
            raise Violation("drift: forward answered the same input differently on a later call",
                            [*details, _shapes(case)], inputs)
        fresh = self.run(other)  # what a build answers x' on its first call
        off = _distance(y_other, fresh, ref_other)
        if off <= 1.0:
            return
        if both.compared.any() and _distance(y_other, y_first, both) <= 1.0 < _distance(fresh, y_first, both):
            raise Violation("stale output: forward returned its answer to an earlier input for a new one",
                            ["asked x and then another batch x' of the same shape, it answered x' with what it "
                             "answered x: a cached output, or a buffer returned before it is refilled",
                             _shapes(case)], inputs)
        scale = _scale_factor(y_other, replace(ref_other, y=fresh))
        details = [f"its answer to x' is off a fresh build's by {off:.3g} x the tolerance"]
        if scale is not None:
            details.append(f"it is {scale:.6g} x a fresh build's answer: the forward's state changes from call "
                           "to call")
        raise Violation("drift: forward's second call answers otherwise than a fresh build's first",
                        [*details, _shapes(case)], inputs)

    def shift_unchanged(self, drawn: tuple[HFBlockCase, float]) -> None:
        case, shift = drawn
        shifted = replace(case, bias_offset=case.bias_offset + shift)
        y, y_shifted = self.run(case), self.run(shifted)
        ref, ref_shifted = reference_output(case), reference_output(shifted)
        compared = ref.compared & ref_shifted.compared
        error = np.where(np.isfinite(y_shifted), np.abs(y_shifted - y), np.inf)  # [m, d]
        bad = np.flatnonzero(compared & np.any(error > 2 * ref.tol, axis=1))
        if not bad.size:
            return
        details = [f"token {i}: y {fmt(y[i], 5, longest=12)}, with every bias + {shift:g}: "
                   f"{fmt(y_shifted[i], 5, longest=12)}" for i in bad[:3]]
        details.append("a common shift of the bias leaves every token's ranking of s + b, and so the output, "
                       "unchanged; a bias kept in a narrow dtype or dropped groups masked with 0 instead of -inf "
                       "change the routes when the biases sit far from zero, as trained ones do")
        details.append(_shapes(shifted))
        raise _Mismatch(f"{bad.size} of {case.tokens} tokens change when every expert's bias shifts by {shift:g}",
                        details, _inputs(shifted), shifted, y_shifted, ref_shifted)


def _compare(y: np.ndarray, case: HFBlockCase, ref: ReferenceOutput, which: str = "") -> None:
    """Raise `_Mismatch` unless `y` matches the reference on every compared token of `case`."""
    error = np.where(np.isfinite(y), np.abs(y - ref.y), np.inf)  # [m, d]
    bad = np.flatnonzero(ref.compared & np.any(error > ref.tol, axis=1))
    if not bad.size:
        return
    details = [f"token {i}: expected y {fmt(ref.y[i], 5, longest=12)}, got {fmt(y[i], 5, longest=12)}" for i in bad[:3]]
    if bad.size > 3:
        details.append(f"... and {bad.size - 3} more tokens")
    worst = float(np.max(np.max(error, axis=1)[ref.compared] / ref.tol[ref.compared, 0]))
    details.append(f"largest error {worst:.3g} x the tolerance (per token: {ref.relative:.3g} x its "
                   f"largest |y|, for {dtype_name(np.dtype(case.dtype))})")
    precision, achieved = _precision_achieved(y, ref)
    details.append(_precision_line(precision, achieved))
    if (~ref.compared).any():
        details.append(f"{int((~ref.compared).sum())} tokens with near-tied routing or an ill-conditioned "
                       "latent sum were not compared")
    details.append(_shapes(case))
    summary = f"{which}{bad.size} of {case.tokens} tokens differ from the reference block"
    if case.assumed:
        summary += f" with {_names(case.assumed)} assumed"
    float32 = (achieved == "float32" and ref.relative < tolerance(np.float32))
    if float32:
        summary += (": the block computes in float32, not in the float64 it was asked for (its error fits "
                    "float32's tolerance, not float64's)")
    v = _Mismatch(summary, details, _inputs(case), case, y, ref)
    if float32:
        v.conventions = ["computed_in_float32"]
    raise v
