r"""Eq. (13), checked: a user's router against the reference and the invariants of selection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from ..layer.routing import route
from . import strategies as rst
from .outputs import error_line, fmt, route_output, sorted_route, token_lines, within
from .profiles import kit_settings
from .report import (
    CheckResult,
    Invariant,
    Violation,
    call_user,
    run_check,
)

__all__ = ["check_router"]


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
        return route_output(out, case.m, case.n, case.top_k)

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
                token_lines(repeated, lambda i: f"token {i}: experts {index[i].tolist()}"), inputs(case))

    def raw_weights(case: rst.RoutingCase) -> None:
        index, weights = run(case)
        s = case.scores.astype(dtype).astype(np.float64)
        raw = np.take_along_axis(s, index, axis=1)  # [m, k]
        # $$p_{i,j} = c\, s_{i,j} \big/ \textstyle\sum_{r \in T_i} s_{i,r}$$ over the router's own choice $T_i$
        expected = raw / raw.sum(axis=1, keepdims=True) if renormalize else raw
        expected = expected * scaling_factor
        bad = np.flatnonzero(~np.all(within(weights, expected, rtol, atol), axis=1))
        if bad.size:
            sb = np.take_along_axis(biased(case), index, axis=1)
            from_biased = sb / sb.sum(axis=1, keepdims=True) * scaling_factor if renormalize else sb
            details = token_lines(bad, lambda i: (
                f"token {i}: experts {index[i].tolist()}, raw scores {fmt(raw[i])}, "
                f"expected weights {fmt(expected[i])}, got {fmt(weights[i])}"))
            details.append(error_line(weights, expected, rtol, atol))
            if np.allclose(weights, from_biased, rtol=max(rtol, 1e-5), atol=max(atol, 1e-6)):
                details.append("the weights returned are those of the BIASED scores s + b: "
                               "the bias must choose the experts, never weigh them")
            raise Violation(f"{bad.size} of {case.m} tokens have weights that are not their raw scores"
                            + (" renormalized" if renormalize else "") + f" times {scaling_factor:g}",
                            details, inputs(case))

    def weight_sums(case: rst.RoutingCase) -> None:
        _, weights = run(case)
        total = weights.sum(axis=1)  # [m]
        bad = np.flatnonzero(~within(total, np.full_like(total, scaling_factor), rtol, atol))
        if bad.size:
            raise Violation(
                f"{bad.size} of {case.m} tokens have weights that do not sum to the scaling factor "
                f"{scaling_factor:g}",
                token_lines(bad, lambda i: f"token {i}: weights {fmt(weights[i])} sum to {total[i]:.8g}"),
                inputs(case))

    def shift_invariance(drawn: tuple[rst.RoutingCase, float]) -> None:
        case, c = drawn
        # $$\operatorname{argtopk}_k(s_i + b + c) = \operatorname{argtopk}_k(s_i + b)$$
        shifted_bias = (case.bias.astype(np.float64) + c).astype(dtype)
        ids, w = sorted_route(*run(case))
        ids_c, w_c = sorted_route(*run(case, shifted_bias))
        moved = np.flatnonzero(np.any(ids != ids_c, axis=1))
        if moved.size:
            raise Violation(
                f"adding c = {c:g} to every bias changed the experts of {moved.size} of {case.m} tokens "
                "(a common shift of b changes no top-k)",
                token_lines(moved, lambda i: f"token {i}: with b {ids[i].tolist()}, with b + c {ids_c[i].tolist()}")
                + ["a bias held or added in low precision loses its small differences when it sits far "
                   "from zero: keep b and s + b in float32 or wider"],
                inputs(case, shift_c=c, shifted_bias=shifted_bias))
        bad = np.flatnonzero(~np.all(within(w_c, w, rtol, atol), axis=1))
        if bad.size:
            raise Violation(
                f"adding c = {c:g} to every bias changed the weights of {bad.size} of {case.m} tokens "
                "(the bias must not enter the weights)",
                token_lines(bad, lambda i: f"token {i}: weights with b {fmt(w[i])}, with b + c {fmt(w_c[i])}")
                + [error_line(w_c, w, rtol, atol)], inputs(case, shift_c=c))

    def chosen_against(case: rst.RoutingCase, scores: np.ndarray, bias: np.ndarray) -> tuple:
        """The user's sorted expert ids, the reference's for these scores and bias, and the tokens that differ."""
        ids, _ = sorted_route(*run(case))
        expected = np.sort(route(scores, bias, case.top_k)[0], axis=1)
        return ids, expected, np.flatnonzero(np.any(ids != expected, axis=1))

    def selection(case: rst.RoutingCase) -> None:
        ids, expected, wrong = chosen_against(case, case.scores.astype(dtype).astype(np.float64),
                                              case.bias.astype(dtype).astype(np.float64))
        if wrong.size:
            sb = biased(case)
            raise Violation(
                f"{wrong.size} of {case.m} tokens chose other experts than the top-{case.top_k} of s + b",
                token_lines(wrong, lambda i: (
                    f"token {i}: expected experts {expected[i].tolist()} (s + b = {fmt(sb[i, expected[i]])}), "
                    f"got {ids[i].tolist()} (s + b = {fmt(sb[i, ids[i]])})")),
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
                token_lines(bad, lambda i: f"token {i}: chose {np.sort(index[i]).tolist()}, s + b = {fmt(sb[i])}"),
                inputs(case))

    def lower_id_ties(case: rst.RoutingCase) -> None:
        ids, expected, wrong = chosen_against(case, case.scores.astype(np.float64), case.bias.astype(np.float64))
        if wrong.size:
            sb = biased(case)
            raise Violation(
                f"{wrong.size} of {case.m} tokens broke a tie in favour of a higher expert id",
                token_lines(wrong, lambda i: (f"token {i}: s + b = {fmt(sb[i])}, expected experts "
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
