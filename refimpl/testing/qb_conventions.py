r"""Quantile Balancing as other code ships it, named when a balancing update reproduces it.

When `check_balancing_update` or `check_histogram_update` finds an update
that is not Eq. (14), it computes the conventions below on the failing case,
and names each one that gives the update's output there and on a few larger
relatives of the case (other scores and biases of the same shape, with more
tokens): one small case can be reproduced by more than one wrong rule, so a
name is printed only once the relatives agree.

| entry | what the update does | where it ships |
|---|---|---|
| `beta_returned` | returns $\beta = -b$, the bias to subtract, where the kit's convention adds the bias it is given | Megatron-Core's `qb_beta` (selection by `scores - beta`) |
| `beta_sign_throughout` | reads the bias it is given as $\beta$ in $s - \beta$ and returns the next $\beta$: Eq. (14) in the dual's sign throughout | Megatron-Core's `qb_dual_update` called with the kit's bias |
| `whole_target_rounded_down` | reads the $(\lfloor mk/n\rfloor + 1)$-th largest margin, where Eq. (14) interpolates a fractional $q = mk/n$ | Megatron-Core asserts that $mk/n$ is whole |
| `fixed_histogram_range` | bins the fixed range $[-1, 1]$ into 512 bins, where Appendix D bins $[\min b - 1, \max b + 1]$ into $B$ | torchtitan's K3 balancer (`quantile_balance.py`) |
| `quantiles_averaged` | averages one quantile per block (rank and micro-batch), where Appendix D adds the counts and reads one quantile | Megatron-Core averages per-micro-batch quantiles over data-parallel ranks |

The first three are tried by both checks, the last two by the histogram
check (the only one whose function sees the blocks). `refimpl.balancing.shipped`
computes Megatron-Core's update and says where each comes from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..balancing import cutoffs, histogram_balancing_update, kth_largest, quantile_balancing_update
from . import strategies as rst

__all__ = ["HISTOGRAM_CONVENTIONS", "UPDATE_CONVENTIONS", "UpdateConvention", "averaged_per_block", "name_conventions"]

#: Larger relatives of a failing case on which a convention must also reproduce the update before it is named.
RELATIVES = 4

Blocks = Sequence[np.ndarray]


@dataclass(frozen=True)
class UpdateConvention:
    """One way of shipping Eq. (14): `output(blocks, bias, top_k)` is its new bias `[n]` on the given blocks."""

    name: str
    summary: str
    source: str
    output: Callable[[Blocks, np.ndarray, int], np.ndarray]
    applies: Callable[[Blocks, np.ndarray, int], bool] = lambda blocks, bias, top_k: True
    #: Judged against the update's own outputs on each block (`averaged_per_block`), not against `output`: a
    #: histogram's reading of one block is only within a bin of Eq. (14), so its average is too.
    per_block: bool = False

    def describe(self) -> str:
        """`name: summary (source)`, one line of a report."""
        return f"{self.name}: {self.summary} ({self.source})"


def _pooled(blocks: Blocks) -> np.ndarray:
    return np.concatenate([np.asarray(block, dtype=np.float64) for block in blocks])  # [m, n]


def _exact(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    return np.asarray(quantile_balancing_update(_pooled(blocks), bias.astype(np.float64), top_k))


def _beta_returned(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    # $$\beta^{\text{new}} = -b^{\text{new}}$$
    return -_exact(blocks, bias, top_k)


def _beta_sign_throughout(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    # The bias read as $\beta = -b$, the result returned as $\beta$: $$-\text{Eq14}(s, -b)$$
    return -_exact(blocks, -bias, top_k)


def _fractional(blocks: Blocks, bias: np.ndarray, top_k: int) -> bool:
    return (_pooled(blocks).shape[0] * top_k) % bias.shape[0] != 0


def _whole_target_rounded_down(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    s = _pooled(blocks)
    m, n = s.shape
    # Eq. (14) with $q$ replaced by $\lfloor mk/n \rfloor$: the batch minus the tokens that make $q$ fractional
    # does not give it, so the order statistic is read directly.
    alpha = np.asarray(cutoffs(s, bias.astype(np.float64), top_k))  # [m]
    b_tilde = -np.asarray(kth_largest((s - alpha[:, None]).T.copy(), m * top_k // n + 1))  # [n]
    return b_tilde - b_tilde.mean()


def _fixed_histogram_range(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    return np.asarray(histogram_balancing_update([np.asarray(b, np.float64) for b in blocks],
                                                 bias.astype(np.float64), top_k, 512, value_range=(-1.0, 1.0)))


def _quantiles_averaged(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    # $$\frac1B \sum_b \text{Eq14}(s^{(b)}, b)$$ over the blocks that can give a quantile
    kept = [b for b in blocks if _has_quantile(b, top_k)]
    return np.mean([_exact([b], bias, top_k) for b in kept], axis=0)


def _has_quantile(block: np.ndarray, top_k: int) -> bool:
    m, n = block.shape
    return m >= 1 and top_k < n and (m * top_k) // n + (1 if (m * top_k) % n else 0) + 1 <= m


def _several_blocks(blocks: Blocks, bias: np.ndarray, top_k: int) -> bool:
    return sum(_has_quantile(b, top_k) for b in blocks) >= 2


_SIGNS = (
    UpdateConvention("beta_returned", "returns beta = -b, the bias to subtract, where the kit's convention adds "
                     "the bias it is given", "Megatron-Core's qb_beta, selection by scores - beta", _beta_returned),
    UpdateConvention("beta_sign_throughout", "reads the bias it is given as beta in s - beta and returns the next "
                     "beta: Eq. (14) in the dual's sign throughout",
                     "Megatron-Core's qb_dual_update called with the kit's bias", _beta_sign_throughout),
    UpdateConvention("whole_target_rounded_down", "reads the (floor(mk/n) + 1)-th largest margin, where Eq. (14) "
                     "interpolates a fractional q = mk/n", "Megatron-Core asserts that mk/n is whole",
                     _whole_target_rounded_down, _fractional),
)

#: The conventions `check_balancing_update` names.
UPDATE_CONVENTIONS: tuple[UpdateConvention, ...] = _SIGNS

#: The conventions `check_histogram_update` names.
HISTOGRAM_CONVENTIONS: tuple[UpdateConvention, ...] = (
    *_SIGNS,
    UpdateConvention("fixed_histogram_range", "bins the fixed range [-1, 1] into 512 bins, where Appendix D bins "
                     "[min b - 1, max b + 1] into B", "torchtitan's K3 balancer (quantile_balance.py)",
                     _fixed_histogram_range),
    UpdateConvention("quantiles_averaged", "averages one quantile per block (rank and micro-batch), where "
                     "Appendix D adds the counts and reads one quantile",
                     "Megatron-Core averages per-micro-batch quantiles over data-parallel ranks",
                     _quantiles_averaged, _several_blocks, per_block=True),
)


def _relatives(case: rst.RoutingCase, blocks: int, dtype: np.dtype) -> list[tuple[list[np.ndarray], np.ndarray]]:
    """Larger cases of the same shape: fresh scores in (0, 1), the case's bias moved a little, more tokens.

    A case whose target $q = mk/n$ is whole gets relatives whose target is whole too (an update written for
    whole targets only is still confirmed on them); a fractional one gets fractional ones where the shape allows.
    """
    seed = int.from_bytes(case.scores.tobytes()[:8].ljust(8, b"\0"), "little") ^ case.top_k
    rng = np.random.default_rng(seed)
    unit = case.n // math.gcd(case.n, case.top_k)  # the smallest m with a whole m*k/n
    whole = (case.m * case.top_k) % case.n == 0
    out = []
    for r in range(1, RELATIVES + 1):
        m = case.m + r * unit * 2 if whole else case.m + r * unit * 2 + 1  # more tokens, the same kind of q
        scores = rng.uniform(0.01, 0.99, size=(m, case.n)).astype(dtype)
        bias = (case.bias.astype(np.float64) + rng.normal(scale=0.1, size=case.n)).astype(dtype)
        out.append((np.array_split(scores, blocks), bias))
    return out


def name_conventions(entries: Sequence[UpdateConvention], call: Callable[[list[np.ndarray], np.ndarray], np.ndarray],
                     case: rst.RoutingCase, blocks: list[np.ndarray], got: np.ndarray,
                     close: Callable[[np.ndarray, np.ndarray, np.ndarray], bool], dtype: np.dtype
                     ) -> tuple[list[str], list[str]]:
    """The entries that reproduce the update's output `got` on `blocks` and on every relative, and report lines.

    `call(blocks, bias)` runs the user's update; `close(actual, expected, bias)`
    says whether two new biases agree to the check's tolerance. An entry is
    tried only where it differs from Eq. (14) itself.
    """
    bias = case.bias.astype(dtype)
    exact = _exact(blocks, bias, case.top_k)

    def reproduces(entry: UpdateConvention, on: list[np.ndarray], b: np.ndarray, out: np.ndarray) -> bool:
        try:
            variant = entry.output(on, b, case.top_k)
        except ValueError:  # a variant that cannot run here explains nothing
            return False
        return bool(close(out, variant, b))

    matches = [entry for entry in entries if not entry.per_block and entry.applies(blocks, bias, case.top_k)
               and not reproduces(entry, blocks, bias, exact) and reproduces(entry, blocks, bias, got)]
    confirmed_on = 0
    for on, b in _relatives(case, len(blocks), dtype) if matches else []:
        try:
            out = call(on, b)
        except Exception:  # noqa: BLE001 - the update failed on a relative: it confirms nothing
            continue
        confirmed_on += 1
        matches = [entry for entry in matches if not entry.applies(on, b, case.top_k) or reproduces(entry, on, b, out)]
    if not matches or not confirmed_on:
        return [], []
    lines = [f"known ways of shipping the update that reproduce this output (to the same tolerance; confirmed on "
             f"{confirmed_on} larger cases):"] + [f"  - {entry.describe()}" for entry in matches]
    return [entry.name for entry in matches], lines


def averaged_per_block(call: Callable[[list[np.ndarray], np.ndarray], np.ndarray], case: rst.RoutingCase,
                       blocks: list[np.ndarray], got: np.ndarray,
                       close: Callable[[np.ndarray, np.ndarray, np.ndarray], bool], dtype: np.dtype
                       ) -> tuple[list[str], list[str]]:
    """`quantiles_averaged`, if the update's output on `blocks` is the mean of its outputs on each block alone.

    Confirmed on larger relatives split into as many blocks, wherever the
    split changes the update's output there.
    """
    entry = next(e for e in HISTOGRAM_CONVENTIONS if e.name == "quantiles_averaged")

    def averaged(on: list[np.ndarray], bias: np.ndarray) -> np.ndarray | None:
        usable = [block for block in on if _has_quantile(block, case.top_k)]
        if len(usable) < 2:
            return None
        return np.mean([call([block], bias) for block in usable], axis=0)

    bias = case.bias.astype(dtype)
    try:
        mean = averaged(blocks, bias)
        if mean is None or not close(got, mean, bias):
            return [], []
        confirmed_on = 0
        for on, b in _relatives(case, max(len(blocks), 2), dtype):
            split, pooled, mean = call(on, b), call([np.concatenate(on)], b), averaged(on, b)
            if mean is None or close(split, pooled, b):
                continue  # the split changes nothing here: it confirms nothing
            if not close(split, mean, b):
                return [], []
            confirmed_on += 1
    except Exception:  # noqa: BLE001 - an update that fails on one block alone explains nothing
        return [], []
    if not confirmed_on:
        return [], []
    return [entry.name], [f"a known way of shipping the update reproduces this output (the mean of the update's "
                          f"own outputs on each block; confirmed on {confirmed_on} larger cases):",
                          f"  - {entry.describe()}"]
