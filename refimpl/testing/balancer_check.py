r"""The stateful balancer, checked: no look-ahead, and the biases of Eq. (14) step by step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.validation import check_float_dtype, check_int
from ..layer.routing import route
from . import strategies as rst
from .outputs import fmt, token_lines, user_array
from .profiles import kit_settings
from .report import (
    CheckResult,
    Invariant,
    Violation,
    call_user,
    call_user_keeping_inputs,
    run_check,
    written_inputs,
)
from .router_check import tolerance_value

__all__ = ["check_balancer"]


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

    The initial bias is drawn (centred, nonzero), so a balancer that ignores
    or negates it fails 2. A write into the initial bias or a batch is
    reported, naming it, also when it comes from a later step. Bad arguments
    are a `TypeError` or `ValueError` naming them.
    """
    if not callable(make_balancer):
        raise TypeError(f"make_balancer must be a function (initial_bias, top_k) -> step, got "
                        f"{type(make_balancer).__name__} {make_balancer!r:.60}")
    if isinstance(follows, str) and follows == "exact":
        from ..balancing import quantile_balancing_update  # imported here: the kit loads without it

        follows = quantile_balancing_update
    elif isinstance(follows, str):
        raise ValueError(f"follows must be 'exact', None or a function (scores, bias, top_k) -> new_bias, "
                         f"got {follows!r}")
    elif follows is not None and not callable(follows):
        raise TypeError(f"follows must be 'exact', None or a function (scores, bias, top_k) -> new_bias, "
                        f"got {type(follows).__name__} {follows!r:.60}")
    dtype = check_float_dtype(dtype, "dtype")
    steps = check_int("steps", steps, low=1)  # a history of at least one batch, and one batch after it
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    max_experts = check_int("max_experts", max_experts, low=2)  # k < n needs two experts
    margin = tolerance_value("margin", margin)
    resolved = kit_settings(settings)  # a bad profile name is an error before anything runs
    update = follows
    cases = rst.balancer_cases(max_experts=max_experts, steps=steps + 1, max_tokens=max_tokens)

    def feed(case: rst.BalancerCase, history: int, last: np.ndarray) -> np.ndarray:
        """A fresh balancer fed `history` batches then `last`; returns the route of `last` `[m, k]`."""
        step, given, kept = call_user_keeping_inputs(make_balancer, case.initial_bias.astype(dtype), case.top_k)
        calls = []
        for batch in case.batches[:history]:
            calls.append(call_user_keeping_inputs(step, batch.astype(dtype))[1:])
        out, *handed = call_user_keeping_inputs(step, last.astype(dtype))
        calls.append(tuple(handed))
        # A balancer may keep what it was handed and write into it later, from a step: checked after the steps.
        written = written_inputs(make_balancer, kept, given)
        written += [f"scores (of step {t})" for t, (g, k) in enumerate(calls) if written_inputs(step, k, g)]
        if written:
            raise Violation(f"the balancer wrote into its inputs {', '.join(written)} after they were handed to "
                            "it: the caller keeps them (the initial bias is the checkpoint's, the scores weigh "
                            "the experts)")
        index = user_array("the ids step(scores) returned", out[0] if isinstance(out, tuple | list) else out)
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
                token_lines(moved, lambda i: f"token {i}: alone {alone[i].tolist()}, with the others "
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
            bias = user_array("the bias of the rule `follows`", call_user(
                update, batch.astype(dtype).astype(np.float64), bias, case.top_k), dtype=np.float64)
        s = probe.astype(dtype).astype(np.float64)
        expected = np.sort(np.asarray(route(s, bias, case.top_k)[0]), axis=1)
        ordered = np.sort(s + bias, axis=1)[:, ::-1]
        clear = (ordered[:, case.top_k - 1] - ordered[:, case.top_k]) > margin
        wrong = np.flatnonzero(clear & np.any(got != expected, axis=1))
        if wrong.size:
            looked_ahead = np.sort(np.asarray(route(s, np.asarray(update(s, bias, case.top_k), dtype=np.float64),
                                                    case.top_k)[0]), axis=1)
            # Look-ahead is named only when it explains every compared token, and more than the wrong ones
            # alone: a bias that is merely off (one batch behind, say) agrees with it on a few wrong rows.
            explained = np.array_equal(got[clear], looked_ahead[clear])
            hint = ("these are the experts chosen with the bias computed from this very batch (look-ahead)"
                    if explained and np.count_nonzero(clear) > wrong.size else
                    "the bias that routed the batch is not the one the update rule gives")
            raise Violation(
                f"{wrong.size} of {probe.shape[0]} tokens of batch {history} were not routed with the bias "
                f"b({history}) of the update rule",
                [f"expected bias b({history}) = {fmt(bias)}"]
                + token_lines(wrong, lambda i: f"token {i}: expected {expected[i].tolist()}, got {got[i].tolist()}")
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
    return run_check("check_balancer", invariants, resolved)
