r"""Eq. (14), checked: the exact update against the reference, and the invariants any correct update keeps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.validation import check_float_dtype, check_int
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
from .router_check import dtype_tolerances

__all__ = [
    "BiasUpdate",
    "ExactUpdate",
    "bias_invariants",
    "centred",
    "check_balancing_update",
    "expert_permutation_equivariance",
    "matches_reference",
    "output_form",
    "shift_invariance",
    "token_permutation_invariance",
    "update_cases",
    "update_inputs",
]


# ---------------------------------------------------------------------------
# Eq. (14): the exact update
# ---------------------------------------------------------------------------

def update_cases(integer_q: bool, max_tokens: int, max_experts: int) -> st.SearchStrategy[rst.RoutingCase]:
    """Batches valid for Eq. (14): tie-free grids and tie-heavy eighths, `k < n`, enough tokens."""
    integer_q = switch_value(integer_q, "integer_q")
    sizes = dict(max_tokens=max_tokens, max_experts=max_experts, integer_q=integer_q, for_update=True)
    return st.one_of(rst.routing_cases(distinct=True, **sizes), rst.routing_cases(ties=True, **sizes))


class BiasUpdate(Protocol):
    """What the shared invariants need of an update under check (`ExactUpdate`, or the histogram check's)."""

    dtype: Any

    def new_bias(self, case: rst.RoutingCase, bias: np.ndarray | None) -> np.ndarray:
        """The user's new bias `[n]` on `case` (with its own bias, or `bias`)."""

    def reference(self, case: rst.RoutingCase) -> np.ndarray:
        """Eq. (14) on the values the update received, `[n]`."""

    def close(self, actual: np.ndarray, expected: np.ndarray, case: rst.RoutingCase,
              other_bias: np.ndarray | None = None) -> np.ndarray:
        """Which entries of two new biases agree within the check's tolerance, `[n]` bool."""

    def diagnose(self, case: rst.RoutingCase, new: np.ndarray) -> tuple[list[str], list[str]]:
        """The names and report lines of the known conventions that reproduce `new`, a bias that is not Eq. (14)."""


@dataclass(frozen=True)
class ExactUpdate:
    """The user's exact update `fn(scores, bias, top_k)`, its dtype and the float tolerance it is held to."""

    fn: Callable[..., Any]
    dtype: Any = np.float32
    rtol: float = 1e-5
    atol: float = 1e-6

    def new_bias(self, case: rst.RoutingCase, bias: np.ndarray | None) -> np.ndarray:
        b = case.bias.astype(self.dtype) if bias is None else bias
        return bias_output(call_user(self.fn, case.scores.astype(self.dtype), b, case.top_k), case.n)

    def reference(self, case: rst.RoutingCase) -> np.ndarray:
        from ..balancing import quantile_balancing_update  # imported here: the kit loads without it

        return np.asarray(quantile_balancing_update(case.scores.astype(self.dtype).astype(np.float64),
                                                    case.bias.astype(self.dtype).astype(np.float64), case.top_k))

    def close(self, actual: np.ndarray, expected: np.ndarray, case: rst.RoutingCase,
              other_bias: np.ndarray | None = None) -> np.ndarray:
        """Within `atol + rtol * (1 + max|b|)`: float32 arithmetic on a bias near 10 is good to about 1e-6."""
        scale = 1.0 + float(np.max(np.abs(case.bias)))
        if other_bias is not None:
            scale = max(scale, 1.0 + float(np.max(np.abs(other_bias))))
        return np.abs(actual - expected) <= self.atol + self.rtol * scale

    def diagnose(self, case: rst.RoutingCase, new: np.ndarray) -> tuple[list[str], list[str]]:
        from .qb_conventions import UPDATE_CONVENTIONS, name_conventions

        def call(blocks: list[np.ndarray], bias: np.ndarray) -> np.ndarray:
            return bias_output(call_user(self.fn, np.concatenate(blocks), bias, case.top_k), case.n)

        def agree(actual: np.ndarray, expected: np.ndarray, bias: np.ndarray) -> bool:
            return bool(self.close(actual, expected, case, bias).all())

        return name_conventions(UPDATE_CONVENTIONS, call, case, [case.scores.astype(self.dtype)], new, agree,
                                np.dtype(self.dtype))


# ---------------------------------------------------------------------------
# The invariants any correct update keeps (the histogram check runs them too)
# ---------------------------------------------------------------------------

def update_inputs(update: BiasUpdate, case: rst.RoutingCase, **extra: Any) -> dict[str, Any]:
    """The inputs a report prints for `case`, in the update's dtype, and any `extra` ones."""
    return {"scores": case.scores.astype(update.dtype), "bias": case.bias.astype(update.dtype),
            "top_k": case.top_k, **extra}


def output_form(update: BiasUpdate, case: rst.RoutingCase) -> None:
    """the new bias is a finite float array of shape [n]"""
    update.new_bias(case, None)


def centred(update: BiasUpdate, case: rst.RoutingCase) -> None:
    """Eq. (14) step 3: b(t+1) = b~ - mean(b~)"""
    new = update.new_bias(case, None)
    mean = float(new.mean())
    if not update.close(np.array([mean]), np.array([0.0]), case).all():
        raise Violation(f"the new bias has mean {mean:.6g}, not 0",
                        [f"new bias {fmt(new)}", "Eq. (14) step 3 subtracts the mean, which changes no "
                         "top-k and keeps the bias near zero where float32 is finest"], update_inputs(update, case))


def matches_reference(update: BiasUpdate, case: rst.RoutingCase) -> None:
    """The new bias is Eq. (14)'s, to the tolerance; when it is not, the known conventions that give it are named."""
    new = update.new_bias(case, None)
    expected = update.reference(case)
    if not update.close(new, expected, case).all():
        names, lines = update.diagnose(case, new)
        v = Violation("the new bias differs from the exact update of Eq. (14) "
                      "(refimpl.balancing.quantile_balancing_update)",
                      [f"expected {fmt(expected)}", f"got      {fmt(new)}", error_sizes(new, expected), *lines],
                      update_inputs(update, case))
        v.conventions = names
        raise v


def shift_invariance(update: BiasUpdate, drawn: tuple[rst.RoutingCase, float]) -> None:
    """a shift c of b moves every cutoff and threshold by c; centring removes it"""
    case, c = drawn
    shifted = (case.bias.astype(np.float64) + c).astype(update.dtype)
    new = update.new_bias(case, None)
    new_c = update.new_bias(case, shifted)
    if not update.close(new_c, new, case, shifted).all():
        names, lines = update.diagnose(rst.RoutingCase(case.scores, shifted, case.top_k), new_c)
        v = Violation(f"adding c = {c:g} to the current bias changed the new bias",
                      [f"from b     {fmt(new)}", f"from b + c {fmt(new_c)}",
                       "the cutoffs alpha move with b, the margins s - alpha move against it, and "
                       "centring removes the rest: the update must not depend on a common shift", *lines],
                      update_inputs(update, case, shift_c=c))
        v.conventions = names
        raise v


def token_permutation_invariance(update: BiasUpdate, drawn: tuple[rst.RoutingCase, list[int]]) -> None:
    """a quantile does not depend on the order of the tokens"""
    case, perm = drawn
    permuted = rst.RoutingCase(case.scores[perm], case.bias, case.top_k)
    new = update.new_bias(case, None)
    new_p = update.new_bias(permuted, None)
    if not update.close(new_p, new, case).all():
        raise Violation("reordering the tokens of the batch changed the new bias",
                        [f"original order {fmt(new)}", f"token order {perm} {fmt(new_p)}"],
                        update_inputs(update, case, token_order=perm))


def expert_permutation_equivariance(update: BiasUpdate, drawn: tuple[rst.RoutingCase, list[int]]) -> None:
    """each expert's bias depends on its own column only (and on the cutoffs, which ignore labels)"""
    case, perm = drawn
    permuted = rst.RoutingCase(case.scores[:, perm], case.bias[perm], case.top_k)
    new = update.new_bias(case, None)
    new_p = update.new_bias(permuted, None)
    if not update.close(new_p, new[perm], case).all():
        raise Violation("relabelling the experts did not relabel the new bias the same way",
                        [f"expected new_bias[perm] = {fmt(new[perm])}",
                         f"got                      {fmt(new_p)}"],
                        update_inputs(update, case, expert_order=perm))


def _token_perms(case: rst.RoutingCase) -> st.SearchStrategy:
    return st.tuples(st.just(case), st.permutations(range(case.m)).map(list))


def _expert_perms(case: rst.RoutingCase) -> st.SearchStrategy:
    return st.tuples(st.just(case), st.permutations(range(case.n)).map(list))


def bias_invariants(update: BiasUpdate, cases: st.SearchStrategy, reference_name: str, reference_why: str,
                    reference_body: Callable[[rst.RoutingCase], None] | None = None) -> list[Invariant]:
    """The invariants shared by the exact and the histogram update, in the order they run, each named.

    Form, centring, the reference (`matches_reference`, or the histogram's `reference_body`), then the
    symmetries: a common shift of the bias, the order of the tokens, the labels of the experts.
    """

    def why(body: Callable[..., None]) -> str:
        return (body.__doc__ or "").strip().split("\n")[0]

    def with_extra(name: str) -> Callable[[tuple[rst.RoutingCase, Any]], dict[str, Any]]:
        return lambda drawn: update_inputs(update, drawn[0], **{name: drawn[1]})

    inputs = partial(update_inputs, update)
    return [
        Invariant("output shape and dtype", why(output_form), cases, partial(output_form, update), basic=True,
                  describe=inputs),
        Invariant("centred", why(centred), cases, partial(centred, update), describe=inputs),
        Invariant(reference_name, reference_why, cases, reference_body or partial(matches_reference, update),
                  describe=inputs),
        Invariant("bias-shift invariance", why(shift_invariance), st.tuples(cases, rst.bias_shifts(max_abs=10.0)),
                  partial(shift_invariance, update), describe=with_extra("shift_c")),
        Invariant("token-permutation invariance", why(token_permutation_invariance), cases.flatmap(_token_perms),
                  partial(token_permutation_invariance, update), describe=with_extra("token_order")),
        Invariant("expert-permutation equivariance", why(expert_permutation_equivariance),
                  cases.flatmap(_expert_perms), partial(expert_permutation_equivariance, update),
                  describe=with_extra("expert_order")),
    ]


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------

def update_arguments(fn: Any, dtype: Any, rtol: Any, atol: Any, max_tokens: Any,
                     max_experts: Any) -> tuple[np.dtype, float, float, int, int]:
    """The arguments an update check shares, checked before anything runs (each error names its argument).

    `dtype` a float dtype (an integer one would round every bias to whole numbers and test nothing), the
    tolerances those of `router_check.dtype_tolerances`, at least one token and two experts (Eq. 14 needs
    $k < n$).
    """
    if not callable(fn):
        raise TypeError(f"fn must be the update, a function, got {type(fn).__name__} {fn!r:.60}")
    dtype = check_float_dtype(dtype, "dtype")
    rtol, atol = dtype_tolerances(dtype, rtol, atol, 1e-5, 1e-6)
    return (dtype, rtol, atol, check_int("max_tokens", max_tokens, low=1),
            check_int("max_experts", max_experts, low=2))


def check_balancing_update(fn: Callable[[np.ndarray, np.ndarray, int], Any], *, dtype: Any = np.float32,
                           rtol: float | None = None, atol: float | None = None, integer_q_only: bool = False,
                           max_tokens: int = 12, max_experts: int = 8,
                           settings: str | Settings | None = None) -> CheckResult:
    r"""Check an exact Quantile Balancing update `fn(scores, bias, top_k) -> new_bias` against Eq. (14).

    `scores` `[m, n]` and `bias` `[n]` arrive as NumPy arrays of `dtype`
    with $k < n$ and at least `min_tokens_for_update(n, k)` tokens. Values are
    compared within `atol + rtol * (1 + max|b|)`: float32 arithmetic on a
    bias near 10 is only good to about 1e-6. By default (`None`) `rtol` and `atol` are 1e-5 and 1e-6, and
    $2^{-29}$ times those for float64 (`router_check.dtype_tolerances`): an update that computes or returns
    float32 fails a float64 check.

    Invariants, in the order they run (each a function of this module, named in the report):

    1. **output shape and dtype** (`output_form`): a finite float array `[n]`;
    2. **centred** (`centred`): mean zero;
    3. **matches Eq. (14)** (`matches_reference`): `refimpl.balancing.quantile_balancing_update`;
    4. **bias-shift invariance** (`shift_invariance`): a common shift of the current bias gives the same
       new bias;
    5. **token-permutation invariance** (`token_permutation_invariance`);
    6. **expert-permutation equivariance** (`expert_permutation_equivariance`).

    The reference reads the $(q+1)$-th largest margin with linear
    interpolation when $q = mk/n$ is fractional. An implementation with
    another rule for a fractional $q$ can still be checked on integer targets
    with `integer_q_only=True`.

    When the update is not Eq. (14), the report names the known ways of
    shipping it that reproduce its output (`refimpl.testing.qb_conventions`):
    the bias returned or read in the other sign, as Megatron-Core keeps it,
    the logits read for the scores, a fractional target rounded down, and the
    $\lceil q \rceil$-th required bias read for the $(q+1)$-th.
    """
    dtype, rtol, atol, max_tokens, max_experts = update_arguments(fn, dtype, rtol, atol, max_tokens, max_experts)
    resolved = kit_settings(settings)  # a bad profile name is an error before anything runs
    update = ExactUpdate(fn, dtype, rtol, atol)
    cases = update_cases(switch_value(integer_q_only, "integer_q_only"), max_tokens, max_experts)
    invariants = bias_invariants(
        update, cases, "matches Eq. (14)",
        "b~_j = -(the (q+1)-th largest margin s_ij - alpha_i of expert j), alpha_i the (k+1)-th of s_i + b")
    return run_check("check_balancing_update", invariants, resolved)
