r"""Appendix D, checked: the histogram update within one bin of Eq. (14), whatever the split of the batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.validation import check_int
from . import strategies as rst
from .outputs import bias_output, count, error_sizes, fmt
from .profiles import kit_settings
from .report import (
    CheckResult,
    Invariant,
    Violation,
    call_user,
    run_check,
)
from .update_check import bias_invariants, update_arguments

__all__ = ["check_histogram_update"]


# ---------------------------------------------------------------------------
# The user's update and the tolerances it is held to
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Histogram:
    """The user's histogram update, the number of bins it declares, its dtype and the float tolerance."""

    fn: Callable[..., Any]
    bins: int = 1000
    dtype: Any = np.float32
    rtol: float = 1e-5
    atol: float = 1e-6

    def width(self, bias: np.ndarray) -> float:
        r"""The bin width $w = (\max b - \min b + 2) / B$."""
        b = bias.astype(np.float64)
        return float(b.max() - b.min() + 2.0) / self.bins

    def new_bias(self, case: rst.RoutingCase, bias: np.ndarray | None,
                 blocks: list[np.ndarray] | None = None) -> np.ndarray:
        """The user's new bias on `case` (its bias or `bias`; the batch whole, or split into `blocks`)."""
        b = case.bias.astype(self.dtype) if bias is None else bias
        blocks = [case.scores.astype(self.dtype)] if blocks is None else blocks
        return bias_output(call_user(self.fn, blocks, b, case.top_k), case.n)

    def reference(self, case: rst.RoutingCase) -> np.ndarray:
        """Eq. (14) on the values the update received."""
        from ..balancing import quantile_balancing_update  # imported here: the kit loads without it

        return np.asarray(quantile_balancing_update(case.scores.astype(self.dtype).astype(np.float64),
                                                    case.bias.astype(self.dtype).astype(np.float64), case.top_k))

    def float_tol(self, case: rst.RoutingCase, other_bias: np.ndarray | None = None) -> float:
        scale = 1.0 + float(np.max(np.abs(case.bias)))
        if other_bias is not None:
            scale = max(scale, 1.0 + float(np.max(np.abs(other_bias))))
        return self.atol + self.rtol * scale

    def close(self, actual: np.ndarray, expected: np.ndarray, case: rst.RoutingCase,
              other_bias: np.ndarray | None = None) -> np.ndarray:
        """Within a bin: two histogram readings of one batch may differ by a bin (a value crossing an edge)."""
        return np.abs(actual - expected) <= self.width(case.bias) + self.float_tol(case, other_bias)

    def close_exact(self, actual: np.ndarray, expected: np.ndarray, case: rst.RoutingCase,
                    other_bias: np.ndarray | None = None) -> np.ndarray:
        return np.abs(actual - expected) <= self.float_tol(case, other_bias)

    def diagnose(self, case: rst.RoutingCase, new: np.ndarray, blocks: list[np.ndarray] | None = None
                 ) -> tuple[list[str], list[str]]:
        """The known ways of shipping the update that reproduce `new` (on `blocks`, or the batch whole)."""
        blocks = [case.scores.astype(self.dtype)] if blocks is None else blocks
        from .qb_conventions import HISTOGRAM_CONVENTIONS, name_conventions

        def call(on: list[np.ndarray], bias: np.ndarray) -> np.ndarray:
            return bias_output(call_user(self.fn, on, bias, case.top_k), case.n)

        def agree(actual: np.ndarray, expected: np.ndarray, bias: np.ndarray) -> bool:
            # Two histogram readings agree up to a common shift and a bin of either reading.
            d = actual - expected
            return float(d.max() - d.min()) <= 2.0 * max(self.width(bias), 2.0 / 512) + 2.0 * self.float_tol(case, bias)

        return name_conventions(HISTOGRAM_CONVENTIONS, call, case, blocks, new, agree, np.dtype(self.dtype))


# ---------------------------------------------------------------------------
# The invariants of Appendix D's own (the others are the exact update's: `update_check.bias_invariants`)
# ---------------------------------------------------------------------------

def within_bin(update: _Histogram, case: rst.RoutingCase) -> None:
    r"""Appendix D: each threshold within a bin width of Eq. (14), up to a shift: $\max_j d_j - \min_j d_j \le 2w$."""
    new, exact = update.new_bias(case, None), update.reference(case)
    d = new - exact
    w = update.width(case.bias.astype(update.dtype))
    spread = float(d.max() - d.min())
    if spread <= 2.0 * w + 2.0 * update.float_tol(case):
        return
    names, lines = update.diagnose(case, new)
    v = Violation(f"no common shift brings every expert within one bin width (w = {w:.4g}) of Eq. (14)",
                  [f"exact (Eq. 14) {fmt(exact)}", f"histogram      {fmt(new)}",
                   f"differences    {fmt(d)}: spread {spread:.4g} > 2w = {2 * w:.4g}",
                   "read each threshold in the bin holding the (q+1)-th smallest required bias r = alpha - s; the "
                   "q-th can lie many bins away, behind the atom of the old bias", *lines],
                  {"scores": case.scores.astype(update.dtype), "bias": case.bias.astype(update.dtype),
                   "top_k": case.top_k, "bins": update.bins})
    v.conventions = names
    raise v


def partition_invariance(update: _Histogram, drawn: tuple[rst.RoutingCase, rst.Partition]) -> None:
    """Appendix D: counts add, so any split over ranks and micro-batches gives the same bias."""
    case, part = drawn
    s = case.scores.astype(update.dtype)
    whole, split = update.new_bias(case, None), update.new_bias(case, None, part.split(s))
    if update.close_exact(split, whole, case).all():
        return
    from .qb_conventions import averaged_per_block  # imported here: the kit loads without refimpl.balancing

    names, lines = update.diagnose(case, split, part.split(s))
    if not names:
        names, lines = averaged_per_block(
            lambda on, bias: bias_output(call_user(update.fn, on, bias, case.top_k), case.n), case, part.split(s),
            split, lambda a, e, bias: bool(update.close_exact(a, e, case, bias).all()), np.dtype(update.dtype))
    v = Violation(f"splitting the batch over {count(part.ranks, 'rank')} x "
                  f"{count(part.micro_batches, 'micro-batch', 'micro-batches')} changed the new bias",
                  [f"one block      {fmt(whole)}", f"split blocks   {fmt(split)}",
                   f"the split, rank by rank (micro-batches separated by |): {part}", error_sizes(split, whole),
                   "sum the integer counts of all blocks, then read the quantile once: an average of per-rank "
                   "quantiles is not the quantile of the global batch", *lines], _partition_inputs(update, drawn))
    v.conventions = names
    raise v


def _partition_inputs(update: _Histogram, drawn: tuple[rst.RoutingCase, rst.Partition]) -> dict[str, Any]:
    case, part = drawn
    s = case.scores.astype(update.dtype)
    return {"scores": s, "bias": case.bias.astype(update.dtype), "top_k": case.top_k, "blocks": part.split(s)}


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------

def check_histogram_update(fn: Callable[[list[np.ndarray], np.ndarray, int], Any], *, bins: int = 1000,
                           dtype: Any = np.float32, rtol: float | None = None, atol: float | None = None,
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

    When the update is off, the report names the known ways of shipping it
    that reproduce its output (`refimpl.testing.qb_conventions`): the bias in
    the other sign, the logits read for the scores, a fractional target
    rounded down, the $\lceil q \rceil$-th required bias (Megatron-Core's
    `global_batch` mode and torchtitan's `QuantileBalancer`), a fixed range
    $[-1, 1]$ of 512 bins, quantiles averaged over the blocks.

    `rtol` and `atol` (the float part of the tolerance, beyond the bin) default as for
    `check_balancing_update`: 1e-5 and 1e-6, $2^{-29}$ times those for float64. Bad arguments are a
    `TypeError` or `ValueError` naming them.
    """
    dtype, rtol, atol, max_tokens, max_experts = update_arguments(fn, dtype, rtol, atol, max_tokens, max_experts)
    bins = check_int("bins", bins, low=1)
    max_ranks = check_int("max_ranks", max_ranks, low=1)
    max_micro_batches = check_int("max_micro_batches", max_micro_batches, low=1)
    resolved = kit_settings(settings)  # a bad profile name is an error before anything runs
    update = _Histogram(fn, bins, dtype, rtol, atol)
    sizes = dict(max_tokens=max_tokens, max_experts=max_experts, for_update=True)
    cases = st.one_of(rst.routing_cases(distinct=True, **sizes), rst.routing_cases(ties=True, **sizes))

    def with_partition(case: rst.RoutingCase) -> st.SearchStrategy:
        return st.tuples(st.just(case), rst.partitions(case.m, max_ranks=max_ranks,
                                                       max_micro_batches=max_micro_batches))

    invariants = bias_invariants(
        update, cases, "within one bin of Eq. (14)",
        "Appendix D: each threshold is read inside the bin holding the exact one; centring adds a common shift",
        reference_body=partial(within_bin, update))
    invariants.insert(3, Invariant("partition invariance", partition_invariance.__doc__.strip(),
                                   cases.flatmap(with_partition), partial(partition_invariance, update),
                                   describe=partial(_partition_inputs, update)))
    return run_check("check_histogram_update", invariants, resolved)
