r"""The checks: run a user's router, balancer or layer against the reference and the paper's invariants.

Each `check_*` function takes the user's callable, draws many small inputs
with Hypothesis, and asserts two kinds of facts about what comes back:

* **agreement with the reference**: the same answer as `route`,
  `quantile_balancing_update`, `histogram_balancing_update` or
  `stable_latent_moe` on the same input, within a tolerance the user sets;
* **invariants** of Eq. (11)-(14) and Appendix D that hold whatever the
  implementation: a common shift of the bias changes no top-$k$, the update
  ignores the order of tokens, the histogram does not care how the batch was
  split over ranks, and so on. An invariant often names the mistake more
  precisely than a bare disagreement does.

A check returns a `CheckResult` when everything holds and raises
`CheckFailure` (an `AssertionError`) otherwise. Every invariant runs as its
own Hypothesis property, so each broken one is reported with the simplest
input that breaks it, the expected and actual values and the size of the
error.

The callable works on NumPy arrays: a PyTorch, JAX or CuPy implementation
is wrapped in a few lines that convert the inputs and the outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.xp import dtype_name
from ..config import MoEConfig
from ..layer.activations import sigmoid
from ..layer.latent_moe import routed_experts, stable_latent_moe
from ..layer.routing import route
from . import strategies as rst
from .report import (
    COMMON_SETTINGS,
    CheckFailure,
    CheckResult,
    Code,
    Invariant,
    Violation,
    call_user,
    errors,
    resolved_settings,
    run_check,
)

__all__ = [
    "PROFILES",
    "QUICK",
    "THOROUGH",
    "CheckFailure",
    "CheckResult",
    "check_balancer",
    "check_balancing_update",
    "check_forward",
    "check_histogram_update",
    "check_router",
    "profile",
]

# ---------------------------------------------------------------------------
# Settings profiles
# ---------------------------------------------------------------------------

#: Quick local runs: 50 examples per invariant, the same examples every run.
QUICK = Settings(max_examples=50, derandomize=True, **COMMON_SETTINGS)
#: Thorough runs (CI, before a release): 300 random examples per invariant.
THOROUGH = Settings(max_examples=300, derandomize=False, **COMMON_SETTINGS)
#: The profiles by name; `REFIMPL_TESTING_PROFILE` picks the default one.
PROFILES = {"quick": QUICK, "thorough": THOROUGH}

Settings.register_profile("refimpl-quick", QUICK)
Settings.register_profile("refimpl-thorough", THOROUGH)


def profile(name: str | Settings | None = None) -> Settings:
    """The Hypothesis settings a check runs with.

    `name` is `"quick"`, `"thorough"` or a `hypothesis.settings` object;
    `None` reads the environment variable `REFIMPL_TESTING_PROFILE`
    (default `"quick"`).
    """
    if isinstance(name, Settings):
        return name
    if name is None:
        name = os.environ.get("REFIMPL_TESTING_PROFILE", "quick")
    if name not in PROFILES:
        raise ValueError(f"settings must be one of {sorted(PROFILES)} or a hypothesis.settings, got {name!r}")
    return PROFILES[name]


def kit_settings(settings: str | Settings | None) -> Settings:
    """The Hypothesis settings a check runs with: a profile's name, your own `settings`, or the quick default."""
    return resolved_settings(profile(settings), QUICK)


# ---------------------------------------------------------------------------
# Small helpers shared by the checks
# ---------------------------------------------------------------------------

def _is_float(a: np.ndarray) -> bool:
    return dtype_name(a.dtype) in ("float16", "bfloat16", "float32", "float64")


def _within(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Elementwise `|actual - expected| <= atol + rtol |expected|` (NaN never passes)."""
    return np.abs(actual - expected) <= atol + rtol * np.abs(expected)


def _error_sizes(actual: np.ndarray, expected: np.ndarray) -> str:
    abs_err, rel_err = errors(actual, expected)
    return f"max abs error {abs_err:.3g}, max rel error {rel_err:.3g} (relative to the largest |expected|)"


def _error_line(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> str:
    return f"{_error_sizes(actual, expected)}; tolerance: atol {atol:g} + rtol {rtol:g} x |expected|"


def _fmt(values: np.ndarray, digits: int = 6) -> str:
    return np.array2string(np.asarray(values, dtype=np.float64) + 0.0, precision=digits, separator=", ",
                           max_line_width=200, suppress_small=False)


def _sorted_route(index: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's experts in increasing id order, with their weights: routes compared as sets."""
    order = np.argsort(index, axis=1, kind="stable")
    return np.take_along_axis(index, order, axis=1), np.take_along_axis(weights, order, axis=1)


def _float_output(name: str, out: Any, shape: tuple[int, ...], shape_text: str) -> np.ndarray:
    """Validate a user's floating output (its shape, a real floating dtype, finite) and return it as float64.

    `shape_text` names the expected shape in symbols, e.g. `"[m, d]"`, for the report.
    """
    out = np.asarray(out)
    if out.shape != shape:
        raise Violation(f"{name} must have shape {shape_text} = {list(shape)}, got {list(out.shape)}")
    if not _is_float(out):
        raise Violation(f"{name} must be a real floating array, got dtype {out.dtype}")
    out = out.astype(np.float64)
    if not np.all(np.isfinite(out)):
        raise Violation(f"{name} must be finite, got {int(np.sum(~np.isfinite(out)))} NaN or inf entries")
    return out


def _route_output(out: Any, m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a router's `(index, weights)` and return them as int64 and float64 arrays."""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise Violation(f"the router must return a pair (index, weights), got {type(out).__name__}")
    index, weights = np.asarray(out[0]), np.asarray(out[1])
    if index.shape != (m, k) or weights.shape != (m, k):
        raise Violation(f"index and weights must both have shape [m, k] = [{m}, {k}], "
                        f"got {list(index.shape)} and {list(weights.shape)}")
    if not np.issubdtype(index.dtype, np.integer):
        raise Violation(f"index must be an integer array, got dtype {index.dtype}")
    weights = _float_output("weights", weights, (m, k), "[m, k]")
    if index.size and (index.min() < 0 or index.max() >= n):
        raise Violation(f"expert ids must lie in [0, {n - 1}], got values in [{index.min()}, {index.max()}]")
    return index.astype(np.int64), weights


def _bias_output(out: Any, n: int) -> np.ndarray:
    """Validate an update's new bias `[n]` and return it as float64."""
    return _float_output("the new bias", out, (n,), "[n]")


def _count(number: int, one: str, many: str | None = None) -> str:
    return f"{number} {one if number == 1 else (many or one + 's')}"


def _token_lines(rows: np.ndarray, what: Callable[[int], str], limit: int = 3) -> list[str]:
    lines = [what(int(i)) for i in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"... and {len(rows) - limit} more tokens")
    return lines


# ---------------------------------------------------------------------------
# Eq. (13): the router
# ---------------------------------------------------------------------------

def check_router(fn: Callable[[np.ndarray, np.ndarray, int], tuple[Any, Any]], *,
                 renormalize: bool = True, scaling_factor: float = 1.0, tie_order: str | None = None,
                 dtype: Any = np.float32, rtol: float = 1e-5, atol: float = 1e-6,
                 max_tokens: int = 12, max_experts: int = 10,
                 settings: str | Settings | None = None) -> CheckResult:
    r"""Check a router `fn(scores, bias, top_k) -> (index, weights)` against Eq. (13).

    `scores` `[m, n]` and `bias` `[n]` arrive as NumPy arrays of `dtype`;
    `index` and `weights` `[m, k]` must come back as arrays NumPy can read.
    Routes are compared as sets: the order of a token's $k$ experts is free.

    Invariants, in the order they run:

    1. **output shape and dtype**: `[m, k]` integer ids in `[0, n)`, finite float weights;
    2. **distinct experts per token**;
    3. **weights from raw scores**: $p_{i,j} = c\,s_{i,j}/\sum_{r\in T_i} s_{i,r}$
       over the router's own choice $T_i$, with $c$ = `scaling_factor`
       (no division when `renormalize=False`);
    4. **weights sum to the scaling factor** (when `renormalize`);
    5. **bias-shift invariance**: `fn(scores, bias + c)` chooses the same experts
       with the same weights, for shifts $c$ up to 100;
    6. **selection is the top-k of s + b**: the same experts as `route`;
    7. **ties give a valid top-k**: on inputs with exact ties, every chosen
       biased score is at least every unchosen one;
    8. **tie order: lower id first**, only when `tie_order="lower_id"`: on
       ties, the same experts as `route`, which prefers the lower id.

    Inputs for 3-6 have no two equal or nearly equal biased scores in a token
    (see `strategies.routing_cases`), so any correct float32 router agrees.
    `rtol` and `atol` apply to the weights. `settings` is a profile name or
    a `hypothesis.settings`.
    """
    if tie_order not in (None, "lower_id"):
        raise ValueError(f"tie_order must be None or 'lower_id', got {tie_order!r}")
    sizes = dict(max_tokens=max_tokens, max_experts=max_experts)
    distinct = rst.routing_cases(distinct=True, **sizes)
    tied = rst.routing_cases(ties=True, **sizes)

    def run(case: rst.RoutingCase, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        b = case.bias if bias is None else bias
        out = call_user(fn, case.scores.astype(dtype), b.astype(dtype), case.top_k)
        return _route_output(out, case.m, case.n, case.top_k)

    def inputs(case: rst.RoutingCase, **extra: Any) -> dict[str, Any]:
        return {"scores": case.scores.astype(dtype), "bias": case.bias.astype(dtype),
                "top_k": case.top_k, **extra}

    def biased(case: rst.RoutingCase) -> np.ndarray:
        return case.scores.astype(dtype).astype(np.float64) + case.bias.astype(dtype).astype(np.float64)

    def output_form(case: rst.RoutingCase) -> None:
        run(case)

    def shifted_inputs(drawn: tuple[rst.RoutingCase, float]) -> dict[str, Any]:
        return inputs(drawn[0], shift_c=drawn[1])

    def distinct_ids(case: rst.RoutingCase) -> None:
        index, _ = run(case)
        repeated = np.flatnonzero(np.any(np.diff(np.sort(index, axis=1), axis=1) == 0, axis=1))
        if repeated.size:
            raise Violation(
                f"{repeated.size} of {case.m} tokens list the same expert more than once",
                _token_lines(repeated, lambda i: f"token {i}: experts {index[i].tolist()}"), inputs(case))

    def raw_weights(case: rst.RoutingCase) -> None:
        index, weights = run(case)
        s = case.scores.astype(dtype).astype(np.float64)
        raw = np.take_along_axis(s, index, axis=1)  # [m, k]
        # $$p_{i,j} = c\, s_{i,j} \big/ \textstyle\sum_{r \in T_i} s_{i,r}$$ over the router's own choice $T_i$
        expected = raw / raw.sum(axis=1, keepdims=True) if renormalize else raw
        expected = expected * scaling_factor
        bad = np.flatnonzero(~np.all(_within(weights, expected, rtol, atol), axis=1))
        if bad.size:
            sb = np.take_along_axis(biased(case), index, axis=1)
            from_biased = sb / sb.sum(axis=1, keepdims=True) * scaling_factor if renormalize else sb
            details = _token_lines(bad, lambda i: (
                f"token {i}: experts {index[i].tolist()}, raw scores {_fmt(raw[i])}, "
                f"expected weights {_fmt(expected[i])}, got {_fmt(weights[i])}"))
            details.append(_error_line(weights, expected, rtol, atol))
            if np.allclose(weights, from_biased, rtol=max(rtol, 1e-5), atol=max(atol, 1e-6)):
                details.append("the weights returned are those of the BIASED scores s + b: "
                               "the bias must choose the experts, never weigh them")
            raise Violation(f"{bad.size} of {case.m} tokens have weights that are not their raw scores"
                            + (" renormalized" if renormalize else "") + f" times {scaling_factor:g}",
                            details, inputs(case))

    def weight_sums(case: rst.RoutingCase) -> None:
        _, weights = run(case)
        total = weights.sum(axis=1)  # [m]
        bad = np.flatnonzero(~_within(total, np.full_like(total, scaling_factor), rtol, atol))
        if bad.size:
            raise Violation(
                f"{bad.size} of {case.m} tokens have weights that do not sum to the scaling factor "
                f"{scaling_factor:g}",
                _token_lines(bad, lambda i: f"token {i}: weights {_fmt(weights[i])} sum to {total[i]:.8g}"),
                inputs(case))

    def shift_invariance(drawn: tuple[rst.RoutingCase, float]) -> None:
        case, c = drawn
        # $$\operatorname{argtopk}_k(s_i + b + c) = \operatorname{argtopk}_k(s_i + b)$$
        shifted_bias = (case.bias.astype(np.float64) + c).astype(dtype)
        ids, w = _sorted_route(*run(case))
        ids_c, w_c = _sorted_route(*run(case, shifted_bias))
        moved = np.flatnonzero(np.any(ids != ids_c, axis=1))
        if moved.size:
            raise Violation(
                f"adding c = {c:g} to every bias changed the experts of {moved.size} of {case.m} tokens "
                "(a common shift of b changes no top-k)",
                _token_lines(moved, lambda i: f"token {i}: with b {ids[i].tolist()}, with b + c {ids_c[i].tolist()}")
                + ["a bias held or added in low precision loses its small differences when it sits far "
                   "from zero: keep b and s + b in float32 or wider"],
                inputs(case, shift_c=c, shifted_bias=shifted_bias))
        bad = np.flatnonzero(~np.all(_within(w_c, w, rtol, atol), axis=1))
        if bad.size:
            raise Violation(
                f"adding c = {c:g} to every bias changed the weights of {bad.size} of {case.m} tokens "
                "(the bias must not enter the weights)",
                _token_lines(bad, lambda i: f"token {i}: weights with b {_fmt(w[i])}, with b + c {_fmt(w_c[i])}")
                + [_error_line(w_c, w, rtol, atol)], inputs(case, shift_c=c))

    def chosen_against(case: rst.RoutingCase, scores: np.ndarray, bias: np.ndarray) -> tuple:
        """The user's sorted expert ids, the reference's for these scores and bias, and the tokens that differ."""
        ids, _ = _sorted_route(*run(case))
        expected = np.sort(route(scores, bias, case.top_k)[0], axis=1)
        return ids, expected, np.flatnonzero(np.any(ids != expected, axis=1))

    def selection(case: rst.RoutingCase) -> None:
        ids, expected, wrong = chosen_against(case, case.scores.astype(dtype).astype(np.float64),
                                              case.bias.astype(dtype).astype(np.float64))
        if wrong.size:
            sb = biased(case)
            raise Violation(
                f"{wrong.size} of {case.m} tokens chose other experts than the top-{case.top_k} of s + b",
                _token_lines(wrong, lambda i: (
                    f"token {i}: expected experts {expected[i].tolist()} (s + b = {_fmt(sb[i, expected[i]])}), "
                    f"got {ids[i].tolist()} (s + b = {_fmt(sb[i, ids[i]])})")),
                inputs(case))

    def valid_topk_with_ties(case: rst.RoutingCase) -> None:
        index, _ = run(case)
        sb = biased(case)
        chosen = np.zeros(sb.shape, dtype=bool)
        np.put_along_axis(chosen, index, True, axis=1)
        # $$\min_{j \in T_i} (s_{i,j} + b_j) \ge \max_{j \notin T_i} (s_{i,j} + b_j)$$
        low = np.where(chosen, sb, np.inf).min(axis=1)  # lowest chosen biased score, [m]
        high = np.where(chosen, -np.inf, sb).max(axis=1)  # highest unchosen one, [m]
        bad = np.flatnonzero(low < high)
        if bad.size:
            raise Violation(
                f"{bad.size} of {case.m} tokens chose an expert whose biased score is below an unchosen one",
                _token_lines(bad, lambda i: f"token {i}: chose {np.sort(index[i]).tolist()}, s + b = {_fmt(sb[i])}"),
                inputs(case))

    def lower_id_ties(case: rst.RoutingCase) -> None:
        ids, expected, wrong = chosen_against(case, case.scores.astype(np.float64), case.bias.astype(np.float64))
        if wrong.size:
            sb = biased(case)
            raise Violation(
                f"{wrong.size} of {case.m} tokens broke a tie in favour of a higher expert id",
                _token_lines(wrong, lambda i: (f"token {i}: s + b = {_fmt(sb[i])}, expected experts "
                                               f"{expected[i].tolist()}, got {ids[i].tolist()}")),
                inputs(case))

    invariants = [
        Invariant("output shape and dtype", "index [m, k] integer ids in [0, n), weights [m, k] finite floats",
                  distinct, output_form, basic=True, describe=inputs),
        Invariant("distinct experts per token", "Eq. (13): T_i is a set of k different experts",
                  distinct, distinct_ids, basic=True, describe=inputs),
        Invariant("weights from raw scores",
                  "Eq. (13): the weights come from the raw scores s of the chosen experts, never from s + b",
                  distinct, raw_weights, describe=inputs),
    ]
    if renormalize:
        invariants.append(Invariant(
            "weights sum to the scaling factor",
            "Eq. (13): the k weights are renormalized to sum to one, then scaled by the routed scaling factor", distinct, weight_sums,
            describe=inputs))
    invariants += [
        Invariant("bias-shift invariance",
                  "Eq. (13)-(14): adding one constant c to every bias changes no top-k of s + b",
                  st.tuples(distinct, rst.bias_shifts()), shift_invariance, describe=shifted_inputs),
        Invariant("selection is the top-k of s + b",
                  "Eq. (13): T_i = argtopk_k(s_i + b), the bias added to the scores", distinct, selection,
                  describe=inputs),
        Invariant("ties give a valid top-k",
                  "Eq. (13) with ties: any chosen biased score >= any unchosen one", tied, valid_topk_with_ties,
                  describe=inputs),
    ]
    if tie_order == "lower_id":
        invariants.append(Invariant(
            "tie order: lower id first", "the tie order you declared: among equal biased scores the lower expert id is chosen", tied, lower_id_ties,
            describe=inputs))
    return run_check("check_router", invariants, kit_settings(settings))


# ---------------------------------------------------------------------------
# Eq. (11): the forward pass
# ---------------------------------------------------------------------------

def _reference_forward(case: rst.ForwardCase, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference on the inputs the user receives, and a mask of tokens fit to compare.

    A token is left out when its routing is ambiguous at the user's precision
    (its $k$-th and $(k+1)$-th biased scores are closer than 1e-4) or when
    its latent sum cancels so strongly that the RMSNorm magnifies rounding
    (the terms are over 100 times larger than their sum).
    """
    config = case.config
    x64 = case.x.astype(dtype).astype(np.float64)
    params64 = {name: value.astype(np.float64) for name, value in case.params(dtype).items()}
    out = stable_latent_moe(x64, params64, config, return_intermediates=True)
    keep = np.ones(x64.shape[0], dtype=bool)
    if config.k < config.n:
        s = sigmoid(x64 @ params64["gate.weight"].T)  # [m, n]
        sb = np.sort(s + params64["gate.e_score_correction_bias"], axis=1)[:, ::-1]
        keep &= (sb[:, config.k - 1] - sb[:, config.k]) > 1e-4
    if config.use_latent_norm:
        terms = np.zeros_like(out.u)
        for r in range(config.k):  # |p_r E_r(z)| of each slot, summed: the size before cancellation
            terms += np.abs(routed_experts(out.z, out.index[:, r:r + 1], out.weights[:, r:r + 1],
                                           params64["experts.w1"], params64["experts.w3"],
                                           params64["experts.w2"], config))
        size = np.sqrt(np.mean(terms**2, axis=1))
        rms = np.sqrt(np.mean(out.u**2, axis=1) + config.rms_norm_eps)
        keep &= size <= 100.0 * rms
    return np.asarray(out.y), keep


def check_forward(fn: Callable[[np.ndarray, dict[str, np.ndarray], MoEConfig], Any], *,
                  rtol: float = 1e-4, atol: float = 1e-5, dtype: Any = np.float32,
                  configs: st.SearchStrategy[MoEConfig] | MoEConfig | None = None, max_tokens: int = 6,
                  settings: str | Settings | None = None) -> CheckResult:
    r"""Check a layer `fn(x, params, config) -> y` against `stable_latent_moe` (Eq. 11).

    `x` `[m, d]` and every parameter (a `dict` with the HF names of
    `parameter_shapes`) arrive as NumPy arrays of `dtype`; `y` `[m, d]` must
    come back. The reference is computed in float64 from the very same
    (rounded) inputs, so `rtol`/`atol` measure only the error of the user's
    arithmetic: about 1e-4 suits float32, a few 1e-2 bfloat16.

    `configs` is a strategy of `MoEConfig` (default: small layers with K3's
    switches, see `strategies.configs`) or one fixed config.

    Invariants: **output shape and dtype** (`[m, d]`, finite), and **matches
    stable_latent_moe** on every token whose routing is unambiguous at that
    precision (see `_reference_forward`).
    """
    if configs is None:
        configs = rst.configs()
    cases = rst.forward_cases(config=configs, max_tokens=max_tokens)

    def run(case: rst.ForwardCase) -> np.ndarray:
        out = call_user(fn, case.x.astype(dtype), case.params(dtype), case.config)
        return _float_output("y", out, case.x.shape, "[m, d]")

    def inputs(case: rst.ForwardCase) -> dict[str, Any]:
        return {"config": _ConfigRepr(case.config), "x": case.x.astype(dtype),
                "params": Code(f"refimpl.testing.strategies.ForwardCase(config, x, param_seed={case.param_seed}, "
                               f"bias_scale={case.bias_scale}).params({_dtype_expr(dtype)})")}

    def output_form(case: rst.ForwardCase) -> None:
        run(case)

    def matches(case: rst.ForwardCase) -> None:
        y = run(case)
        expected, keep = _reference_forward(case, dtype)
        bad = np.flatnonzero(keep & ~np.all(_within(y, expected, rtol, atol), axis=1))
        if bad.size:
            details = _token_lines(bad, lambda i: (
                f"token {i}: expected y {_fmt(expected[i], 5)}, got {_fmt(y[i], 5)}"))
            details.append(_error_line(y[keep], expected[keep], rtol, atol))
            if (~keep).any():
                details.append(f"{int((~keep).sum())} tokens with ambiguous routing or a cancelling "
                               "latent sum were not compared")
            raise Violation(f"{bad.size} of {case.x.shape[0]} tokens differ from stable_latent_moe",
                            details, inputs(case))

    invariants = [
        Invariant("output shape and dtype", "y has the shape [m, d] of x and is finite", cases,
                  output_form, basic=True, describe=inputs),
        Invariant("matches stable_latent_moe",
                  "Eq. (11): y = shared(x) + W_up RMSNorm(sum_e p_e E_e(W_down x)), reduced before the norm",
                  cases, matches, describe=inputs),
    ]
    return run_check("check_forward", invariants, kit_settings(settings))


class _ConfigRepr:
    """Prints a `MoEConfig` by the fields that differ from K3's, so a report stays short."""

    def __init__(self, config: MoEConfig):
        self.config = config

    def __repr__(self) -> str:
        k3 = MoEConfig.k3()
        changed = [f"{name}={getattr(self.config, name)!r}" for name in self.config.__dataclass_fields__
                   if getattr(self.config, name) != getattr(k3, name)]
        return f"MoEConfig({', '.join(changed)})"


def _dtype_expr(dtype: Any) -> str:
    name = dtype_name(np.dtype(dtype))
    return "ml_dtypes.bfloat16" if name == "bfloat16" else f"np.{name}"


# ---------------------------------------------------------------------------
# Eq. (14): the exact update
# ---------------------------------------------------------------------------

def _update_cases(integer_q: bool, max_tokens: int, max_experts: int) -> st.SearchStrategy[rst.RoutingCase]:
    """Batches valid for Eq. (14): tie-free grids and tie-heavy eighths, `k < n`, enough tokens."""
    sizes = dict(max_tokens=max_tokens, max_experts=max_experts, integer_q=integer_q, for_update=True)
    return st.one_of(rst.routing_cases(distinct=True, **sizes), rst.routing_cases(ties=True, **sizes))


def _bias_invariants(new_bias: Callable[[rst.RoutingCase, np.ndarray | None], np.ndarray],
                     reference: Callable[[rst.RoutingCase], np.ndarray], close: Callable[..., np.ndarray],
                     cases: st.SearchStrategy, dtype: Any, reference_name: str, reference_why: str,
                     reference_body: Callable[[rst.RoutingCase], None] | None = None) -> list[Invariant]:
    """The invariants shared by the exact and the histogram update: form, centring, reference, symmetries."""

    def inputs(case: rst.RoutingCase, **extra: Any) -> dict[str, Any]:
        return {"scores": case.scores.astype(dtype), "bias": case.bias.astype(dtype), "top_k": case.top_k,
                **extra}

    def output_form(case: rst.RoutingCase) -> None:
        new_bias(case, None)

    def with_extra(name: str) -> Callable[[tuple[rst.RoutingCase, Any]], dict[str, Any]]:
        return lambda drawn: inputs(drawn[0], **{name: drawn[1]})

    def centred(case: rst.RoutingCase) -> None:
        new = new_bias(case, None)
        mean = float(new.mean())
        if not close(np.array([mean]), np.array([0.0]), case).all():
            raise Violation(f"the new bias has mean {mean:.6g}, not 0",
                            [f"new bias {_fmt(new)}", "Eq. (14) step 3 subtracts the mean, which changes no "
                             "top-k and keeps the bias near zero where float32 is finest"], inputs(case))

    def matches(case: rst.RoutingCase) -> None:
        new = new_bias(case, None)
        expected = reference(case)
        if not close(new, expected, case).all():
            raise Violation("the new bias differs from the exact update of Eq. (14) "
                            "(refimpl.balancing.quantile_balancing_update)",
                            [f"expected {_fmt(expected)}", f"got      {_fmt(new)}",
                             _error_sizes(new, expected)], inputs(case))

    def shift(drawn: tuple[rst.RoutingCase, float]) -> None:
        case, c = drawn
        shifted = (case.bias.astype(np.float64) + c).astype(dtype)
        new = new_bias(case, None)
        new_c = new_bias(case, shifted)
        if not close(new_c, new, case, shifted).all():
            raise Violation(f"adding c = {c:g} to the current bias changed the new bias",
                            [f"from b     {_fmt(new)}", f"from b + c {_fmt(new_c)}",
                             "the cutoffs alpha move with b, the margins s - alpha move against it, and "
                             "centring removes the rest: the update must not depend on a common shift"],
                            inputs(case, shift_c=c))

    def tokens(drawn: tuple[rst.RoutingCase, list[int]]) -> None:
        case, perm = drawn
        permuted = rst.RoutingCase(case.scores[perm], case.bias, case.top_k)
        new = new_bias(case, None)
        new_p = new_bias(permuted, None)
        if not close(new_p, new, case).all():
            raise Violation("reordering the tokens of the batch changed the new bias",
                            [f"original order {_fmt(new)}", f"token order {perm} {_fmt(new_p)}"],
                            inputs(case, token_order=perm))

    def experts(drawn: tuple[rst.RoutingCase, list[int]]) -> None:
        case, perm = drawn
        permuted = rst.RoutingCase(case.scores[:, perm], case.bias[perm], case.top_k)
        new = new_bias(case, None)
        new_p = new_bias(permuted, None)
        if not close(new_p, new[perm], case).all():
            raise Violation("relabelling the experts did not relabel the new bias the same way",
                            [f"expected new_bias[perm] = {_fmt(new[perm])}",
                             f"got                      {_fmt(new_p)}"],
                            inputs(case, expert_order=perm))

    def token_perms(case: rst.RoutingCase) -> st.SearchStrategy:
        return st.tuples(st.just(case), st.permutations(range(case.m)).map(list))

    def expert_perms(case: rst.RoutingCase) -> st.SearchStrategy:
        return st.tuples(st.just(case), st.permutations(range(case.n)).map(list))

    return [
        Invariant("output shape and dtype", "the new bias is a finite float array of shape [n]", cases,
                  output_form, basic=True, describe=inputs),
        Invariant("centred", "Eq. (14) step 3: b(t+1) = b~ - mean(b~)", cases, centred, describe=inputs),
        Invariant(reference_name, reference_why, cases, reference_body or matches, describe=inputs),
        Invariant("bias-shift invariance", "a shift c of b moves every cutoff and threshold by c; centring removes it",
                  st.tuples(cases, rst.bias_shifts(max_abs=10.0)), shift, describe=with_extra("shift_c")),
        Invariant("token-permutation invariance", "a quantile does not depend on the order of the tokens",
                  cases.flatmap(token_perms), tokens, describe=with_extra("token_order")),
        Invariant("expert-permutation equivariance", "each expert's bias depends on its own column only "
                  "(and on the cutoffs, which ignore labels)", cases.flatmap(expert_perms), experts,
                  describe=with_extra("expert_order")),
    ]


def check_balancing_update(fn: Callable[[np.ndarray, np.ndarray, int], Any], *, dtype: Any = np.float32,
                           rtol: float = 1e-5, atol: float = 1e-6, integer_q_only: bool = False,
                           max_tokens: int = 12, max_experts: int = 8,
                           settings: str | Settings | None = None) -> CheckResult:
    r"""Check an exact Quantile Balancing update `fn(scores, bias, top_k) -> new_bias` against Eq. (14).

    `scores` `[m, n]` and `bias` `[n]` arrive as NumPy arrays of `dtype`
    with $k < n$ and at least `min_tokens_for_update(n, k)` tokens. Values are
    compared within `atol + rtol * (1 + max|b|)`: float32 arithmetic on a
    bias near 10 is only good to about 1e-6.

    Invariants: **output shape and dtype**; **centred** (mean zero);
    **matches Eq. (14)** (`refimpl.balancing.quantile_balancing_update`);
    **bias-shift invariance** (a common shift of the current bias gives the
    same new bias); **token-permutation invariance**; **expert-permutation
    equivariance**.

    The reference reads the $(q+1)$-th largest margin with linear
    interpolation when $q = mk/n$ is fractional. An implementation with
    another rule for a fractional $q$ can still be checked on integer targets
    with `integer_q_only=True`.
    """
    from ..balancing import quantile_balancing_update  # imported here: the kit loads without it

    def new_bias(case: rst.RoutingCase, bias: np.ndarray | None) -> np.ndarray:
        b = case.bias.astype(dtype) if bias is None else bias
        return _bias_output(call_user(fn, case.scores.astype(dtype), b, case.top_k), case.n)

    def reference(case: rst.RoutingCase) -> np.ndarray:
        return np.asarray(quantile_balancing_update(case.scores.astype(dtype).astype(np.float64),
                                                    case.bias.astype(dtype).astype(np.float64), case.top_k))

    def close(actual: np.ndarray, expected: np.ndarray, case: rst.RoutingCase,
              other_bias: np.ndarray | None = None) -> np.ndarray:
        scale = 1.0 + float(np.max(np.abs(case.bias)))
        if other_bias is not None:
            scale = max(scale, 1.0 + float(np.max(np.abs(other_bias))))
        return np.abs(actual - expected) <= atol + rtol * scale

    cases = _update_cases(integer_q_only, max_tokens, max_experts)
    invariants = _bias_invariants(
        new_bias, reference, close, cases, dtype, "matches Eq. (14)",
        "b~_j = -(the (q+1)-th largest margin s_ij - alpha_i of expert j), alpha_i the (k+1)-th of s_i + b")
    return run_check("check_balancing_update", invariants, kit_settings(settings))


# ---------------------------------------------------------------------------
# Appendix D: the histogram update
# ---------------------------------------------------------------------------

def check_histogram_update(fn: Callable[[list[np.ndarray], np.ndarray, int], Any], *, bins: int = 1000,
                           dtype: Any = np.float32, rtol: float = 1e-5, atol: float = 1e-6,
                           max_tokens: int = 12, max_experts: int = 8, max_ranks: int = 4,
                           max_micro_batches: int = 3, settings: str | Settings | None = None) -> CheckResult:
    r"""Check a histogram update `fn(blocks, bias, top_k) -> new_bias` against Appendix D.

    `blocks` is a list of `[m_i, n]` NumPy score arrays of `dtype` (one per
    rank and micro-batch, some possibly empty) whose rows together are the
    batch; `bins` is the number of bins $B$ the function uses (bind it with
    `functools.partial` if the function takes it as an argument).

    Invariants:

    * **output shape and dtype**, **centred**;
    * **within one bin of Eq. (14)**: up to a common shift (which changes no
      route), every expert's bias is within one bin width
      $w = (\max b - \min b + 2)/B$ of the exact update, i.e. the spread
      $\max_j d_j - \min_j d_j$ of the differences $d$ is at most $2w$;
    * **partition invariance**: the same tokens split differently over ranks
      and micro-batches give the same bias (counts add, so the result is the
      quantile of the global batch, not an average of per-rank quantiles);
    * bias-shift, token-permutation and expert-permutation behaviour as for
      the exact update (the first two within one bin width: a shift moves the
      bin edges with it, but rounding may move a value across an edge).
    """
    from ..balancing import quantile_balancing_update  # imported here: the kit loads without it

    sizes = dict(max_tokens=max_tokens, max_experts=max_experts, for_update=True)
    cases = st.one_of(rst.routing_cases(distinct=True, **sizes), rst.routing_cases(ties=True, **sizes))

    def width(bias: np.ndarray) -> float:
        b = bias.astype(np.float64)
        return float(b.max() - b.min() + 2.0) / bins

    def new_bias(case: rst.RoutingCase, bias: np.ndarray | None, blocks: list[np.ndarray] | None = None
                 ) -> np.ndarray:
        b = case.bias.astype(dtype) if bias is None else bias
        blocks = [case.scores.astype(dtype)] if blocks is None else blocks
        return _bias_output(call_user(fn, blocks, b, case.top_k), case.n)

    def reference(case: rst.RoutingCase) -> np.ndarray:
        return np.asarray(quantile_balancing_update(case.scores.astype(dtype).astype(np.float64),
                                                    case.bias.astype(dtype).astype(np.float64), case.top_k))

    def float_tol(case: rst.RoutingCase, other_bias: np.ndarray | None = None) -> float:
        scale = 1.0 + float(np.max(np.abs(case.bias)))
        if other_bias is not None:
            scale = max(scale, 1.0 + float(np.max(np.abs(other_bias))))
        return atol + rtol * scale

    def close(actual: np.ndarray, expected: np.ndarray, case: rst.RoutingCase,
              other_bias: np.ndarray | None = None) -> np.ndarray:
        # Two histogram readings of the same batch may differ by a bin (a value crossing an edge).
        return np.abs(actual - expected) <= width(case.bias) + float_tol(case, other_bias)

    def close_exact(actual: np.ndarray, expected: np.ndarray, case: rst.RoutingCase,
                    other_bias: np.ndarray | None = None) -> np.ndarray:
        return np.abs(actual - expected) <= float_tol(case, other_bias)

    def within_bin(case: rst.RoutingCase) -> None:
        new = new_bias(case, None)
        exact = reference(case)
        # Each threshold within w of the exact one, up to a common shift: $$\max_j d_j - \min_j d_j \le 2w$$
        d = new - exact
        w = width(case.bias.astype(dtype))
        spread = float(d.max() - d.min())
        if spread > 2.0 * w + 2.0 * float_tol(case):
            raise Violation(
                f"no common shift brings every expert within one bin width (w = {w:.4g}) of Eq. (14)",
                [f"exact (Eq. 14) {_fmt(exact)}", f"histogram      {_fmt(new)}",
                 f"differences    {_fmt(d)}: spread {spread:.4g} > 2w = {2 * w:.4g}",
                 "read each threshold in the bin holding the (q+1)-th smallest required bias r = alpha - s; "
                 "the q-th can lie many bins away, behind the atom of the old bias"],
                {"scores": case.scores.astype(dtype), "bias": case.bias.astype(dtype), "top_k": case.top_k,
                 "bins": bins})

    def partition(drawn: tuple[rst.RoutingCase, rst.Partition]) -> None:
        case, part = drawn
        s = case.scores.astype(dtype)
        whole = new_bias(case, None)
        split = new_bias(case, None, part.split(s))
        if not close_exact(split, whole, case).all():
            raise Violation(
                f"splitting the batch over {_count(part.ranks, 'rank')} x "
                f"{_count(part.micro_batches, 'micro-batch', 'micro-batches')} changed the new bias",
                [f"one block      {_fmt(whole)}", f"split blocks   {_fmt(split)}",
                 f"the split, rank by rank (micro-batches separated by |): {part}",
                 _error_sizes(split, whole),
                 "sum the integer counts of all blocks, then read the quantile once: an average of per-rank "
                 "quantiles is not the quantile of the global batch"],
                {"scores": s, "bias": case.bias.astype(dtype), "top_k": case.top_k, "blocks": part.split(s)})

    def partition_inputs(drawn: tuple[rst.RoutingCase, rst.Partition]) -> dict[str, Any]:
        case, part = drawn
        s = case.scores.astype(dtype)
        return {"scores": s, "bias": case.bias.astype(dtype), "top_k": case.top_k, "blocks": part.split(s)}

    def with_partition(case: rst.RoutingCase) -> st.SearchStrategy:
        return st.tuples(st.just(case), rst.partitions(case.m, max_ranks=max_ranks,
                                                       max_micro_batches=max_micro_batches))

    invariants = _bias_invariants(
        new_bias, reference, close, cases, dtype, "within one bin of Eq. (14)",
        "Appendix D: each threshold is read inside the bin holding the exact one; centring adds a common shift",
        reference_body=within_bin)
    invariants.insert(3, Invariant(
        "partition invariance",
        "Appendix D: counts add, so any split over ranks and micro-batches gives the same bias",
        cases.flatmap(with_partition), partition, describe=partition_inputs))
    return run_check("check_histogram_update", invariants, kit_settings(settings))


# ---------------------------------------------------------------------------
# Eq. (14) step 4: the stateful balancer
# ---------------------------------------------------------------------------

def check_balancer(make_balancer: Callable[[np.ndarray, int], Callable[[np.ndarray], Any]], *,
                   follows: Callable[[np.ndarray, np.ndarray, int], Any] | None | str = "exact",
                   dtype: Any = np.float32, steps: int = 3, max_tokens: int = 8, max_experts: int = 8,
                   margin: float = 1e-5, settings: str | Settings | None = None) -> CheckResult:
    r"""Check a stateful balancer: each batch is routed with a bias fixed **before** the batch was seen.

    `make_balancer(initial_bias, top_k)` must return a fresh balancer: a
    callable `step(scores) -> index` (or `-> (index, weights)`) that routes
    the batch `scores` `[m, n]` (NumPy, `dtype`) with the bias it holds and
    then updates that bias from the batch, for the next one.

    Invariants:

    1. **no look-ahead**: two balancers with the same history route a token
       of the next batch the same way whether or not other tokens come with
       it. A balancer that computes the bias from the batch and then routes
       that same batch with it fails: the extra tokens move the bias.
    2. **follows the update rule** (unless `follows=None`): after the history
       $s^{(0)}, \dots, s^{(T-1)}$, the next batch is routed as `route` does
       with the bias $b^{(T)}$ obtained by applying `follows` (default
       `"exact"`: `quantile_balancing_update`) $T$ times from the initial bias.
       Tokens whose $k$-th and $(k+1)$-th biased scores are within `margin`
       are not compared.
    """
    if follows == "exact":
        from ..balancing import quantile_balancing_update  # imported here: the kit loads without it

        follows = quantile_balancing_update
    elif isinstance(follows, str):
        raise ValueError(f"follows must be 'exact', None or a function (scores, bias, top_k) -> new_bias, "
                         f"got {follows!r}")
    update = follows
    cases = rst.balancer_cases(max_experts=max_experts, steps=steps + 1, max_tokens=max_tokens)

    def feed(case: rst.BalancerCase, history: int, last: np.ndarray) -> np.ndarray:
        """A fresh balancer fed `history` batches then `last`; returns the route of `last` `[m, k]`."""
        step = call_user(make_balancer, case.initial_bias.astype(dtype), case.top_k)
        for batch in case.batches[:history]:
            call_user(step, batch.astype(dtype))
        out = call_user(step, last.astype(dtype))
        index = np.asarray(out[0] if isinstance(out, tuple | list) else out)
        if index.shape != (last.shape[0], case.top_k) or not np.issubdtype(index.dtype, np.integer):
            raise Violation(f"step(scores) must return integer ids [m, k] = [{last.shape[0]}, {case.top_k}] "
                            f"(or a pair whose first item they are), got {index.dtype} {list(index.shape)}")
        return np.sort(index.astype(np.int64), axis=1)

    def inputs(case: rst.BalancerCase, history: int, **extra: Any) -> dict[str, Any]:
        return {"initial_bias": case.initial_bias.astype(dtype), "top_k": case.top_k,
                "history": [b.astype(dtype) for b in case.batches[:history]], **extra}

    def no_look_ahead(drawn: tuple[rst.BalancerCase, int]) -> None:
        case, history = drawn
        probe, extra = case.batches[history], case.batches[history + 1]
        alone = feed(case, history, probe)
        joined = feed(case, history, np.concatenate([probe, extra]))[: probe.shape[0]]
        moved = np.flatnonzero(np.any(alone != joined, axis=1))
        if moved.size:
            raise Violation(
                f"{moved.size} of {probe.shape[0]} tokens were routed differently when {extra.shape[0]} other "
                "tokens joined their batch: the batch was routed with a bias computed from itself",
                _token_lines(moved, lambda i: f"token {i}: alone {alone[i].tolist()}, with the others "
                                              f"{joined[i].tolist()}")
                + ["Eq. (14) step 4: route the batch with the bias you hold, then compute the next bias "
                   "from it; the new bias routes the NEXT batch"],
                inputs(case, history, batch=probe.astype(dtype), other_tokens=extra.astype(dtype)))

    def follows_rule(drawn: tuple[rst.BalancerCase, int]) -> None:
        case, history = drawn
        probe = case.batches[history]
        got = feed(case, history, probe)
        bias = case.initial_bias.astype(dtype).astype(np.float64)
        for batch in case.batches[:history]:
            bias = np.asarray(update(batch.astype(dtype).astype(np.float64), bias, case.top_k), dtype=np.float64)
        s = probe.astype(dtype).astype(np.float64)
        expected = np.sort(np.asarray(route(s, bias, case.top_k)[0]), axis=1)
        ordered = np.sort(s + bias, axis=1)[:, ::-1]
        clear = (ordered[:, case.top_k - 1] - ordered[:, case.top_k]) > margin
        wrong = np.flatnonzero(clear & np.any(got != expected, axis=1))
        if wrong.size:
            looked_ahead = np.sort(np.asarray(route(s, np.asarray(update(s, bias, case.top_k), dtype=np.float64),
                                                    case.top_k)[0]), axis=1)
            hint = ("these are the experts chosen with the bias computed from this very batch (look-ahead)"
                    if np.array_equal(got[wrong], looked_ahead[wrong]) else
                    "the bias that routed the batch is not the one the update rule gives")
            raise Violation(
                f"{wrong.size} of {probe.shape[0]} tokens of batch {history} were not routed with the bias "
                f"b({history}) of the update rule",
                [f"expected bias b({history}) = {_fmt(bias)}"]
                + _token_lines(wrong, lambda i: f"token {i}: expected {expected[i].tolist()}, got {got[i].tolist()}")
                + [hint], inputs(case, history, batch=probe.astype(dtype)))

    def drawn_inputs(drawn: tuple[rst.BalancerCase, int]) -> dict[str, Any]:
        case, history = drawn
        return inputs(case, history, batch=case.batches[history].astype(dtype),
                      other_tokens=case.batches[history + 1].astype(dtype))

    def with_history(case: rst.BalancerCase) -> st.SearchStrategy:
        return st.tuples(st.just(case), st.integers(0, len(case.batches) - 2))

    drawn = cases.flatmap(with_history)
    invariants = [Invariant(
        "no look-ahead", "Eq. (14) step 4: a batch is never routed with a bias computed from itself",
        drawn, no_look_ahead, describe=drawn_inputs)]
    if update is not None:
        invariants.append(Invariant(
            "follows the update rule", "batch t is routed by top-k of s + b(t), b(t+1) = update(s(t), b(t))",
            drawn, follows_rule, describe=drawn_inputs))
    return run_check("check_balancer", invariants, kit_settings(settings))
