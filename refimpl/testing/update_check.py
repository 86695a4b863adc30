r"""Eq. (14), checked: the exact update against the reference, and the invariants any correct update keeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.values import switch_value
from . import strategies as rst
from .outputs import bias_output, error_sizes, fmt
from .profiles import kit_settings
from .report import (
    CheckResult,
    Invariant,
    Violation,
    call_user,
    run_check,
)

__all__ = ["bias_invariants", "check_balancing_update", "update_cases"]


# ---------------------------------------------------------------------------
# Eq. (14): the exact update
# ---------------------------------------------------------------------------

def update_cases(integer_q: bool, max_tokens: int, max_experts: int) -> st.SearchStrategy[rst.RoutingCase]:
    """Batches valid for Eq. (14): tie-free grids and tie-heavy eighths, `k < n`, enough tokens."""
    integer_q = switch_value(integer_q, "integer_q")
    sizes = dict(max_tokens=max_tokens, max_experts=max_experts, integer_q=integer_q, for_update=True)
    return st.one_of(rst.routing_cases(distinct=True, **sizes), rst.routing_cases(ties=True, **sizes))


def bias_invariants(new_bias: Callable[[rst.RoutingCase, np.ndarray | None], np.ndarray],
                     reference: Callable[[rst.RoutingCase], np.ndarray], close: Callable[..., np.ndarray],
                     cases: st.SearchStrategy, dtype: Any, reference_name: str, reference_why: str,
                     reference_body: Callable[[rst.RoutingCase], None] | None = None,
                     diagnose: Callable[[rst.RoutingCase, np.ndarray], tuple[list[str], list[str]]] | None = None
                     ) -> list[Invariant]:
    """The invariants shared by the exact and the histogram update: form, centring, reference, symmetries.

    `diagnose(case, new)`, when given, returns the names and report lines of the known conventions that
    reproduce a new bias that is not the reference's.
    """

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
                            [f"new bias {fmt(new)}", "Eq. (14) step 3 subtracts the mean, which changes no "
                             "top-k and keeps the bias near zero where float32 is finest"], inputs(case))

    def matches(case: rst.RoutingCase) -> None:
        new = new_bias(case, None)
        expected = reference(case)
        if not close(new, expected, case).all():
            names, lines = diagnose(case, new) if diagnose is not None else ([], [])
            v = Violation("the new bias differs from the exact update of Eq. (14) "
                          "(refimpl.balancing.quantile_balancing_update)",
                          [f"expected {fmt(expected)}", f"got      {fmt(new)}", error_sizes(new, expected), *lines],
                          inputs(case))
            v.conventions = names
            raise v

    def shift(drawn: tuple[rst.RoutingCase, float]) -> None:
        case, c = drawn
        shifted = (case.bias.astype(np.float64) + c).astype(dtype)
        new = new_bias(case, None)
        new_c = new_bias(case, shifted)
        if not close(new_c, new, case, shifted).all():
            names, lines = (diagnose(rst.RoutingCase(case.scores, shifted, case.top_k), new_c)
                            if diagnose is not None else ([], []))
            v = Violation(f"adding c = {c:g} to the current bias changed the new bias",
                          [f"from b     {fmt(new)}", f"from b + c {fmt(new_c)}",
                           "the cutoffs alpha move with b, the margins s - alpha move against it, and "
                           "centring removes the rest: the update must not depend on a common shift", *lines],
                          inputs(case, shift_c=c))
            v.conventions = names
            raise v

    def tokens(drawn: tuple[rst.RoutingCase, list[int]]) -> None:
        case, perm = drawn
        permuted = rst.RoutingCase(case.scores[perm], case.bias, case.top_k)
        new = new_bias(case, None)
        new_p = new_bias(permuted, None)
        if not close(new_p, new, case).all():
            raise Violation("reordering the tokens of the batch changed the new bias",
                            [f"original order {fmt(new)}", f"token order {perm} {fmt(new_p)}"],
                            inputs(case, token_order=perm))

    def experts(drawn: tuple[rst.RoutingCase, list[int]]) -> None:
        case, perm = drawn
        permuted = rst.RoutingCase(case.scores[:, perm], case.bias[perm], case.top_k)
        new = new_bias(case, None)
        new_p = new_bias(permuted, None)
        if not close(new_p, new[perm], case).all():
            raise Violation("relabelling the experts did not relabel the new bias the same way",
                            [f"expected new_bias[perm] = {fmt(new[perm])}",
                             f"got                      {fmt(new_p)}"],
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

    When the update is not Eq. (14), the report names the known ways of
    shipping it that reproduce its output (`refimpl.testing.qb_conventions`):
    the bias returned or read in the other sign, as Megatron-Core keeps it,
    and a fractional target rounded down.
    """
    from ..balancing import quantile_balancing_update  # imported here: the kit loads without it

    def new_bias(case: rst.RoutingCase, bias: np.ndarray | None) -> np.ndarray:
        b = case.bias.astype(dtype) if bias is None else bias
        return bias_output(call_user(fn, case.scores.astype(dtype), b, case.top_k), case.n)

    def reference(case: rst.RoutingCase) -> np.ndarray:
        return np.asarray(quantile_balancing_update(case.scores.astype(dtype).astype(np.float64),
                                                    case.bias.astype(dtype).astype(np.float64), case.top_k))

    def close(actual: np.ndarray, expected: np.ndarray, case: rst.RoutingCase,
              other_bias: np.ndarray | None = None) -> np.ndarray:
        scale = 1.0 + float(np.max(np.abs(case.bias)))
        if other_bias is not None:
            scale = max(scale, 1.0 + float(np.max(np.abs(other_bias))))
        return np.abs(actual - expected) <= atol + rtol * scale

    def diagnose(case: rst.RoutingCase, new: np.ndarray) -> tuple[list[str], list[str]]:
        from .qb_conventions import UPDATE_CONVENTIONS, name_conventions

        def call(blocks: list[np.ndarray], bias: np.ndarray) -> np.ndarray:
            return bias_output(call_user(fn, np.concatenate(blocks), bias, case.top_k), case.n)

        def agree(actual: np.ndarray, expected: np.ndarray, bias: np.ndarray) -> bool:
            return bool(close(actual, expected, case, bias).all())

        return name_conventions(UPDATE_CONVENTIONS, call, case, [case.scores.astype(dtype)], new, agree,
                                np.dtype(dtype))

    cases = update_cases(switch_value(integer_q_only, "integer_q_only"), max_tokens, max_experts)
    invariants = bias_invariants(
        new_bias, reference, close, cases, dtype, "matches Eq. (14)",
        "b~_j = -(the (q+1)-th largest margin s_ij - alpha_i of expert j), alpha_i the (k+1)-th of s_i + b",
        diagnose=diagnose)
    return run_check("check_balancing_update", invariants, kit_settings(settings))
