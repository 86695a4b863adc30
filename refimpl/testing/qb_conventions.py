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
| `read_on_logits` | reads the logits $z = \log\frac{s}{1 - s}$ of the scores it is handed (its bias in the logits' units), where Eq. (14) reads the scores | Megatron-Core's micro-batch mode: `qb_dual_update` on the router's raw logits, selection by `logits - beta` |
| `whole_target_rounded_down` | reads the $(\lfloor mk/n\rfloor + 1)$-th largest margin, where Eq. (14) interpolates a fractional $q = mk/n$ | Megatron-Core asserts that $mk/n$ is whole |
| `ceil_q_rank` | reads the $\lceil q \rceil$-th smallest required bias $\alpha_i - s_{i,j}$ ($q = mk/n$ in float32, at least 1), where Eq. (14) reads the $(q+1)$-th | Megatron-Core's `global_batch` mode and torchtitan's `QuantileBalancer`, each within a bin of it |
| `fixed_histogram_range` | bins the fixed range $[-1, 1]$ into 512 bins, where Appendix D bins $[\min b - 1, \max b + 1]$ into $B$ | torchtitan's K3 balancer (`quantile_balance.py`) |
| `quantiles_averaged` | averages one quantile per block (rank and micro-batch), where Appendix D adds the counts and reads one quantile | Megatron-Core averages per-micro-batch quantiles over data-parallel ranks |

The first five are tried by both checks, the last two by the histogram
check (the only one whose function sees the blocks and bins them). Between
them they name each way the shipped updates part from Eq. (14): the sign of
the bias, logits or scores, the rank read, the bins and their range, pooled
or averaged. `refimpl.balancing.shipped` computes Megatron-Core's and
torchtitan's updates and says where each comes from.

For a fractional $q$, $\lceil q \rceil = \lfloor q \rfloor + 1$, so
`whole_target_rounded_down` and `ceil_q_rank` read the same order statistic;
they part where $q$ is whole (Eq. (14)'s $(q+1)$-th against the $q$-th), and a
fractional failing case is confirmed on relatives of both kinds, so that only
the one that holds on both is named. The shipped code computes $q$ in float32,
and so does `ceil_q_rank`: $25 \cdot \text{float32}(3/5) = 15.000001$, whose
ceiling is 16, Eq. (14)'s rank.
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


def _read_on_logits(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    # Eq. (14) on $$z = \log s - \log(1 - s)$$, the logits whose sigmoid is the scores handed in
    return _exact([np.log(b) - np.log1p(-b) for b in (np.asarray(x, dtype=np.float64) for x in blocks)], bias, top_k)


def _whole_target_rounded_down(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    s = _pooled(blocks)
    m, n = s.shape
    # Eq. (14) with $q$ replaced by $\lfloor mk/n \rfloor$: the batch minus the tokens that make $q$ fractional
    # does not give it, so the order statistic is read directly.
    alpha = np.asarray(cutoffs(s, bias.astype(np.float64), top_k))  # [m]
    b_tilde = -np.asarray(kth_largest((s - alpha[:, None]).T.copy(), m * top_k // n + 1))  # [n]
    return b_tilde - b_tilde.mean()


def _ceil_q_rank(blocks: Blocks, bias: np.ndarray, top_k: int) -> np.ndarray:
    s = _pooled(blocks)
    m, n = s.shape
    # $$t = \max(1, \lceil q \rceil)$$, with $q = m \cdot (k/n)$ in float32, as both trainers compute it
    rank = max(1, math.ceil(np.float32(m) * np.float32(top_k / n)))
    alpha = np.asarray(cutoffs(s, bias.astype(np.float64), top_k))  # [m]
    # The $t$-th smallest required bias $\alpha_i - s_{i,j}$ is minus the $t$-th largest margin.
    b_tilde = -np.asarray(kth_largest((s - alpha[:, None]).T.copy(), rank))  # [n]
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


_EITHER_CHECK = (
    UpdateConvention("beta_returned", "returns beta = -b, the bias to subtract, where the kit's convention adds "
                     "the bias it is given", "Megatron-Core's qb_beta, selection by scores - beta", _beta_returned),
    UpdateConvention("beta_sign_throughout", "reads the bias it is given as beta in s - beta and returns the next "
                     "beta: Eq. (14) in the dual's sign throughout",
                     "Megatron-Core's qb_dual_update called with the kit's bias", _beta_sign_throughout),
    UpdateConvention("read_on_logits", "reads the logits z = log(s / (1 - s)) of the scores it is handed (its bias "
                     "in the logits' units), where Eq. (14) reads the scores",
                     "Megatron-Core's micro-batch mode: qb_dual_update on the router's raw logits, selection by "
                     "logits - beta", _read_on_logits),
    UpdateConvention("whole_target_rounded_down", "reads the (floor(mk/n) + 1)-th largest margin, where Eq. (14) "
                     "interpolates a fractional q = mk/n", "Megatron-Core asserts that mk/n is whole",
                     _whole_target_rounded_down),
    UpdateConvention("ceil_q_rank", "reads the ceil(q)-th smallest required bias alpha - s (q = mk/n in float32, "
                     "at least 1), where Eq. (14) reads the (q+1)-th",
                     "Megatron-Core's global_batch mode and torchtitan's QuantileBalancer, each within a bin of it",
                     _ceil_q_rank),
)

#: The conventions `check_balancing_update` names.
UPDATE_CONVENTIONS: tuple[UpdateConvention, ...] = _EITHER_CHECK

#: The conventions `check_histogram_update` names.
HISTOGRAM_CONVENTIONS: tuple[UpdateConvention, ...] = (
    *_EITHER_CHECK,
    UpdateConvention("fixed_histogram_range", "bins the fixed range [-1, 1] into 512 bins, where Appendix D bins "
                     "[min b - 1, max b + 1] into B", "torchtitan's K3 balancer (quantile_balance.py)",
                     _fixed_histogram_range),
    UpdateConvention("quantiles_averaged", "averages one quantile per block (rank and micro-batch), where "
                     "Appendix D adds the counts and reads one quantile",
                     "Megatron-Core averages per-micro-batch quantiles over data-parallel ranks",
                     _quantiles_averaged, _several_blocks, per_block=True),
)


def _relatives(case: rst.RoutingCase, blocks: int, dtype: np.dtype) -> list[tuple[list[np.ndarray], np.ndarray]]:
    r"""Larger cases of the same shape: fresh scores in (0, 1), the case's bias moved a little, more tokens.

    A case whose target $q = mk/n$ is whole gets relatives whose target is whole too (an update written for
    whole targets only is still confirmed on them); a fractional one gets fractional and whole ones in turn,
    since two rules that read the same rank for a fractional $q$ (the $(\lfloor q \rfloor + 1)$-th and the
    $\lceil q \rceil$-th) part only where $q$ is whole.
    """
    seed = int.from_bytes(case.scores.tobytes()[:8].ljust(8, b"\0"), "little") ^ case.top_k
    rng = np.random.default_rng(seed)
    unit = case.n // math.gcd(case.n, case.top_k)  # the smallest m with a whole m*k/n (at least 2, as k < n)
    whole = (case.m * case.top_k) % case.n == 0
    base = -(-case.m // unit) * unit  # the case's m rounded up to a whole q
    out = []
    for r in range(1, RELATIVES + 1):
        # More tokens: m a multiple of `unit` (q whole), or one token more (q fractional: k/n is)
        m = base + r * unit * 2 + (0 if whole or r % 2 == 0 else 1)
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
