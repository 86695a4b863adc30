r"""Appendix D: Quantile Balancing from a histogram, across ranks and micro-batches.

$$
r_{i,j} = \alpha_i - s_{i,j},
\qquad
j \in \mathcal{T}_i \iff b_j > r_{i,j},
\qquad
\tilde b_j = r_{(q+1),\,j} \;\approx\; \text{read from } \operatorname{hist}(r_{:,j}).
$$

The exact update of Eq. (14) needs, for every expert $j$, one order
statistic of its column of margins $M_{:,j} = s_{:,j} - \alpha$ over the
**global** batch. In training that batch is millions of tokens spread over
data-parallel ranks and gradient-accumulation micro-batches; gathering
$m \cdot n$ margins in one place and sorting them is not an option
(4,194,304 tokens and 896 experts make 3.8 billion margins, 15 GB in float32).
The update needs only each expert's *distribution* of margins, and a histogram
of a distribution can be built in pieces and added up.

**What is counted.** Write the margin with the opposite sign, as the bias an
expert *would need*:

$$r_{i,j} = \alpha_i - s_{i,j}.$$

Token $i$ selects expert $j$ exactly when $s_{i,j} + b_j > \alpha_i$, that
is when $b_j > r_{i,j}$. So expert $j$'s load under a bias $b_j$ is the number
of its $r$ values below $b_j$, and the exact Eq. (14) bias
$\tilde b_j = -M_{(q+1)\text{-th largest},\,j}$ is the $(q+1)$-th **smallest**
$r_{:,j}$, written $r_{(q+1),j}$: exactly $q$ values lie below it.

**The range is known in advance.** Sigmoid scores lie in $(0, 1)$ and
$\alpha_i = s_{i,l} + b_l$ for some expert $l$, so

$$\min_j b_j - 1 \;<\; r_{i,j} \;<\; \max_j b_j + 1 .$$

The histogram uses that interval, recomputed from the current bias at every
step, split into $B$ equal bins of width $w = (\max b - \min b + 2)/B$
(K3: $B = 1000$). Every rank computes the same edges from the same bias, with
no communication.

**Counting and merging.** Each rank takes its score blocks one at a time (one
per micro-batch), finds each token's cutoff $\alpha_i$ with the same top-$(k+1)$
as routing (`selection_cutoff`), and adds one count per $(i, j)$ to an
$n \times B$ integer matrix. Nothing leaves the rank until the end of the step;
then **one integer all-reduce (a sum)** gives every rank the histogram of the
global batch. Counts are integers, so the sum is exact and independent of the
order of addition, and every row $j$ sums to the global token count $m$: the
all-reduce carries $m$ as well, and hence $q = mk/n$. The bias read from the
summed counts is therefore the quantile of the global batch, not an average of
per-rank quantiles, and any split of the same tokens over ranks, micro-batches
and chunks gives a **bitwise-identical** bias (the bin of each $r_{i,j}$ is an
elementwise computation on token $i$'s own row).

**Reading the threshold.** To find the $t$-th smallest value of a column,
take the first bin whose cumulative count reaches $t$: the value is in that
bin. Inside it, the $c$ values it holds are taken as evenly spread, so the one
of rank $t$, the $u$-th of the bin, sits at the centre of the $u$-th of $c$
equal slices:

$$\hat r_{(t)} = e_h + \frac{u - \tfrac12}{c}\, w,
\qquad u = t - (\text{count before bin } h),$$

with $e_h$ the lower edge of bin $h$ (the letter $\beta$ is kept for the
SiTU caps and the dual variables).

The target rank is $t = q + 1$, not $q$, because the exact bias is the
$(q+1)$-th smallest $r$ (the value the $(q+1)$-th token needs, so that $q$
tokens clear it). The choice matters more than the one-rank difference
suggests: the $q$-th and $(q+1)$-th values can sit many bins apart (the
histogram of $r$ is far from smooth: each column has an atom of about $m/n$
equal values at the old $b_j$, see below), and reading the bin of rank $q$
can then miss the exact bias by many bin widths. Reading the bin that holds
rank $q+1$ keeps the estimate inside the bin that holds the exact value, so
the error is **less than one bin width**.

When $q = mk/n$ is not an integer the exact rule interpolates linearly between
the $(\lfloor q\rfloor+1)$-th and $(\lfloor q\rfloor+2)$-th smallest with
weight $f = q - \lfloor q \rfloor$. The read-out does the same with the two
estimates,

$$\tilde b_j = (1 - f)\,\hat r_{(\lfloor q\rfloor+1),j} + f\,\hat r_{(\lfloor q\rfloor+2),j},$$

so each term is within one bin width of its exact counterpart and so is the
mix. (Interpolating the cumulative count directly at the fractional target
$q + 1$ would be off by up to the gap between the two order statistics when they fall in
different bins.) Then, as in Eq. (14), the bias is
mean-centred: $b^{(t+1)} = \tilde b - \operatorname{mean}(\tilde b)$.

**The error bound, and what centring does to it.** Each $\tilde b_j$ is within
one bin width of the exact threshold (plus float32 rounding, about $10^{-7}$, when
the scores are float32): a few $10^{-3}$ at $B = 1000$. Centring subtracts the
mean error from every expert, a common shift that changes no route; compared
expert by expert, the centred biases can differ from the exact centred ones by
up to twice the bin width in the worst case (in practice the mean error is tiny
and they agree within one).

**The cost.** Communication is $nB$ integers per layer per step, whatever
$m$ is: 896,000 int64 (7.2 MB) in K3, against $mn$ float32 margins to gather
the raw values (15 GB at 4,194,304 tokens). Memory is the $n \times B$ counts
plus one chunk of work arrays: a block of any size is processed in chunks of
rows, so the global batch is never materialised.

**Edge cases, defined.**

* *Values outside the range* (scores outside $[0, 1]$, or rounding at the very
  ends) are counted in the first or last bin, so every $(i, j)$ is counted once
  and rows still sum to $m$. A threshold read from an edge bin is then only
  known to lie at or beyond that bin.
* *$k = n$*: every expert is in every route and no $(k+1)$-th score exists.
  The cutoff is taken as $\alpha_i = -\infty$, so every $r$ lands in the first
  bin and every token is still counted; the update returns the current bias,
  centred, as the exact update does: no bias can change any route.
* *Too few tokens*: the rule needs the $(\lceil q\rceil + 1)$-th smallest
  value of each column, which exists only when $m \ge n/(n-k)$. A smaller
  global batch is a `ValueError` at read-out, as in the exact update.
* *$B = 1$*: one bin spanning the whole range; the read-out interpolates
  inside it, and the bound (one bin width, $\max b - \min b + 2$) is loose but holds.
* *Empty blocks* (a rank with no tokens in a micro-batch) add nothing. Reading
  a threshold from a histogram that holds no tokens at all is an error.
* Blocks whose number of experts differs from the bias, NaN or infinite
  scores, $B < 1$ and $k$ outside $[1, n]$ raise a `ValueError` (or
  `TypeError`) that says which argument is wrong.

The structural atom of Eq. (14) is visible here too: for every token whose
$(k+1)$-th biased choice is expert $j$, $r_{i,j} = s_{i,j} + b_j - s_{i,j} =
b_j$ exactly, so about $m/n$ counts of column $j$ pile up in the bin of the
old $b_j$. If the rank $q+1$ falls inside that pile, both the exact rule and
the histogram return (nearly) the old bias.

**The computation.** `BiasHistogram` is the accumulator for one layer and
one step; `histogram_balancing_update` runs it over a sequence of blocks. The
counting has a NumPy fast path (a few expert columns at a time, with work
arrays reused so they stay in cache, and `np.bincount` on flat
$(\text{expert}, \text{bin})$ ids) and a portable path for any array-API
library (sort plus `searchsorted` counting, through `refimpl._lib.xp.bincount`);
both compute every bin with the same floating-point operations in the same
order, so they give identical counts. `HistogramBalancer`, at the end of the
page, is the estimator as a balancer of the training loop (`qb-hist`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._lib.fast import fast_path_applies, histogram_count_by_experts
from .._lib.validation import check_bias, check_finite, check_float_array, check_int
from .._lib.values import is_real, shown
from .._lib.xp import Array, array_namespace, bincount, compute_dtype, dtype_name, is_array
from .balancer import Balancer
from .quantile import cutoff_values, quantile_rank

__all__ = [
    "BiasHistogram",
    "HistogramBalancer",
    "histogram_balancing_update",
    "histogram_range",
    "required_bias",
]

# ---------------------------------------------------------------------------
# The accumulator
# ---------------------------------------------------------------------------


class BiasHistogram:
    r"""Histogram of the required biases $r_{i,j} = \alpha_i - s_{i,j}$ for one layer and one step.

    Build one per rank from the current bias, `add` every score block the rank
    sees (one per micro-batch), sum the `counts` of all ranks (one integer
    all-reduce, or `merge` in one process), then read the new bias with
    `new_bias`.

    Parameters
    ----------
    bias
        `[n]` current bias $b^{(t)}$, float32 or float64. It fixes the range
        $[\min b - 1, \max b + 1]$ and the bins, and is the bias the cutoffs
        are computed with.
    top_k
        $k$, experts per token, `1 <= top_k <= n`.
    bins
        $B$, the number of equal bins (K3: 1000), at least 1.
    chunk_size
        Margins (rows times experts) processed at once. Memory is
        $O(nB + \text{chunk\_size})$ whatever the size of a block; the result
        does not depend on this value.
    value_range
        `None` (the report's rule): the range $[\min b - 1, \max b + 1]$, which
        holds every required bias. A pair `(low, high)` fixes the range
        instead, as a port may do (torchtitan's K3 balancer bins $[-1, 1]$
        into 512 bins). Values outside a fixed range land in
        its edge bins, so a threshold beyond it cannot be read: the bias
        stops moving there.

    Attributes
    ----------
    counts
        `[n, B]` int64 counts, in the array namespace of `bias`. This is the
        buffer to all-reduce (sum) across ranks; row $j$ sums to the number of
        tokens seen.
    low, high, width
        The range and the bin width $w = (\text{high} - \text{low}) / B$, as floats.
    """

    def __init__(self, bias: Array, top_k: int, bins: int = 1000, *, chunk_size: int = 1 << 22,
                 value_range: tuple[float, float] | None = None) -> None:
        check_bias(bias)
        n = bias.shape[0]
        self.top_k = check_int("top_k", top_k, low=1, high=n)
        self.bins = check_int("bins", bins, low=1)
        self.chunk_size = check_int("chunk_size", chunk_size, low=1)
        self.bias = bias
        self.n = n
        self.low, self.high = (histogram_range(bias) if value_range is None
                               else _fixed_range(value_range, self.bins, bias))
        # $$w = \frac{(\max b + 1) - (\min b - 1)}{B}$$
        self.width = (self.high - self.low) / self.bins
        xp = array_namespace(bias)
        self.counts = xp.zeros((n, self.bins), dtype=xp.int64)

    def __repr__(self) -> str:
        return (f"BiasHistogram(n={self.n}, top_k={self.top_k}, bins={self.bins}, "
                f"range=[{self.low:.6g}, {self.high:.6g}], tokens={self.tokens})")

    @property
    def tokens(self) -> int:
        """Tokens counted so far, $m$: every token adds exactly one count to each expert's row."""
        xp = array_namespace(self.counts)
        return int(xp.sum(self.counts[0, :]))

    @property
    def edges(self) -> Array:
        """The `B + 1` bin edges, float64, from `low` to `high`."""
        xp = array_namespace(self.counts)
        # $$e_h = \text{low} + h w$$
        return self.low + xp.arange(self.bins + 1, dtype=xp.float64) * self.width

    def add(self, scores: Array, cutoff: Array | None = None) -> BiasHistogram:
        r"""Count one block of scores `[m_i, n]` (one rank's micro-batch); returns `self`.

        The block is processed in chunks of rows. For each chunk the cutoffs
        $\alpha_i$ come from `selection_cutoff` with the current bias, unless
        `cutoff` `[m_i]` is given: a training step that already took the
        top-$(k+1)$ while routing can pass its $\alpha$ and skip that pass.
        An empty block (`m_i = 0`) adds nothing. The whole block is checked
        before anything is counted, so a bad block leaves the counts as they were.
        """
        check_float_array("scores", scores, ndim=2)
        if scores.shape[1] != self.n:
            raise ValueError(f"scores must have shape [m, {self.n}] to match the bias of {self.n} experts, "
                             f"got {list(scores.shape)}")
        try:
            xp = array_namespace(scores, self.bias)
        except TypeError:
            raise TypeError(f"scores ({type(scores).__name__}) must come from the same array library as the "
                            f"bias ({type(self.bias).__name__})") from None
        m = scores.shape[0]
        dtype = compute_dtype(xp, scores, self.bias)
        if cutoff is not None:
            check_float_array("cutoff", cutoff, ndim=1)
            if cutoff.shape[0] != m:
                raise ValueError(f"cutoff must have shape [{m}] to match scores {list(scores.shape)}, "
                                 f"got {list(cutoff.shape)}")
            if bool(xp.any(xp.isnan(cutoff))):
                raise ValueError("cutoff must not contain NaN")
            dtype = xp.float64 if dtype_name(cutoff.dtype) == "float64" else dtype
        rows = max(1, self.chunk_size // self.n)
        # The array API does not clip out-of-range slice ends, hence the min.
        chunks = [(start, min(start + rows, m)) for start in range(0, m, rows)]
        for start, stop in chunks:
            _check_finite_chunk(scores[start:stop, :])
        # The range in the dtype of the arithmetic, converted once: every chunk bins with the same numbers.
        low = xp.asarray(self.low, dtype=dtype)
        scale = xp.asarray(self.bins / (self.high - self.low), dtype=dtype)
        for start, stop in chunks:
            s = scores[start:stop, :]  # [c, n]
            alpha = _cutoff(s, self.bias, self.top_k) if cutoff is None else cutoff[start:stop]  # [c]
            s = xp.astype(s, dtype)
            alpha = xp.astype(alpha, dtype)
            if fast_path_applies(s, alpha) and isinstance(self.counts, np.ndarray):
                histogram_count_by_experts(self.counts, s, alpha, np.asarray(low)[()], np.asarray(scale)[()])
            else:
                self.counts = _count_portable(self.counts, s, alpha, low, scale)
        return self

    def _check_compatible(self, other: BiasHistogram) -> None:
        if not isinstance(other, BiasHistogram):
            raise TypeError(f"can only merge a BiasHistogram, got {type(other).__name__}")
        mine = (self.n, self.top_k, self.bins, self.low, self.high)
        theirs = (other.n, other.top_k, other.bins, other.low, other.high)
        if mine != theirs:
            raise ValueError("histograms must share n, top_k, bins and the range (the same bias) to be merged, "
                             f"got (n, top_k, bins, low, high) = {mine} and {theirs}")

    def merge(self, *others: BiasHistogram) -> BiasHistogram:
        """Add the counts of other accumulators built from the same bias (the all-reduce, in one process)."""
        for other in others:
            self._check_compatible(other)
            self.counts = self.counts + other.counts
        return self

    def thresholds(self) -> Array:
        r"""The uncentred thresholds $\tilde b_j$, `[n]` float64: the read-out before mean-centring.

        $\tilde b_j$ estimates the $(q+1)$-th smallest $r_{:,j}$ (interpolated
        between ranks $\lfloor q\rfloor+1$ and $\lfloor q\rfloor+2$ when $q$ is
        fractional), within one bin width of the exact value.
        """
        m = self.tokens
        if m == 0:
            raise ValueError("the histogram holds no tokens: add at least one non-empty block (after the "
                             "all-reduce, on some rank) before reading a threshold")
        # $$q = mk/n = \lfloor q \rfloor + f$$, in exact integer arithmetic.
        q_floor, remainder = divmod(m * self.top_k, self.n)
        f = remainder / self.n
        needed = q_floor + (2 if remainder else 1)  # the highest rank the rule reads
        if self.top_k < self.n and needed > m:
            raise ValueError(f"the histogram holds too few tokens: q = m*k/n = {m * self.top_k / self.n:.4g} "
                             f"needs the {needed}-th smallest required bias of each expert, but m={m}; "
                             f"use at least n/(n-k) = {self.n / (self.n - self.top_k):.4g} tokens")
        # (With k = n, q = m and the rank is clamped to m; the thresholds are then all alike and unused.)
        lower = _order_statistic(self.counts, min(q_floor + 1, m), self.low, self.width)  # [n]
        if remainder == 0:
            # $$\tilde b_j = \hat r_{(q+1),j}$$
            return lower
        upper = _order_statistic(self.counts, q_floor + 2, self.low, self.width)  # [n]
        # $$\tilde b_j = (1-f)\,\hat r_{(\lfloor q\rfloor+1),j} + f\,\hat r_{(\lfloor q\rfloor+2),j}$$
        return (1.0 - f) * lower + f * upper

    def new_bias(self) -> Array:
        r"""The next bias $b^{(t+1)} = \tilde b - \operatorname{mean}(\tilde b)$, `[n]`, in the dtype of the bias.

        With $k = n$ every expert is in every route and no bias changes any
        route: the current bias is returned, centred.
        """
        xp = array_namespace(self.counts)
        b_tilde = self.thresholds()  # [n]; raises when no token was counted
        if self.top_k == self.n:
            b_tilde = xp.astype(self.bias, xp.float64)
        # $$b^{(t+1)} = \tilde b - \tfrac{1}{n}\textstyle\sum_j \tilde b_j$$
        new = xp.astype(b_tilde - xp.mean(b_tilde), self.bias.dtype)  # [n]
        if not bool(xp.all(xp.isfinite(xp.astype(new, xp.float64)))):
            raise ValueError(f"the new bias does not fit in {dtype_name(self.bias.dtype)} (the current bias spans "
                             f"[{self.low + 1:.6g}, {self.high - 1:.6g}]): pass the bias in float64")
        return new


def histogram_balancing_update(blocks: Iterable[Array] | Array, bias: Array, top_k: int, bins: int = 1000, *,
                               chunk_size: int = 1 << 22, value_range: tuple[float, float] | None = None) -> Array:
    r"""Appendix D: the Quantile Balancing update (Eq. 14) estimated from an $n \times B$ histogram.

    Parameters
    ----------
    blocks
        An iterable of `[m_i, n]` sigmoid score arrays, one per rank and
        micro-batch, whose union is the global batch. A single `[m, n]` array
        is taken as one block. Empty blocks are allowed.
    bias
        `[n]` current bias $b^{(t)}$ (float32 or float64), used for the
        cutoffs and to fix the range of the bins.
    top_k
        $k$, experts per token.
    bins
        $B$, the number of bins (K3: 1000).
    chunk_size
        Margins processed at once (memory bound); does not change the result.
    value_range
        `None` (the report's adaptive range) or a fixed `(low, high)`; see
        `BiasHistogram`.

    Returns
    -------
    new_bias
        `[n]` centred bias, in the dtype of `bias` (with $k = n$, the current
        bias centred). Each uncentred threshold is
        within one bin width $w = (\max b - \min b + 2)/B$ of the exact Eq. (14)
        threshold of the concatenated blocks, and the result is bitwise the same
        for any split of the same tokens into blocks.
    """
    histogram = BiasHistogram(bias, top_k, bins, chunk_size=chunk_size, value_range=value_range)
    if is_array(blocks):
        blocks = [blocks]
    for number, block in enumerate(blocks):
        if hasattr(block, "shape") and len(block.shape) == 2 and block.shape[1] != histogram.n:
            raise ValueError(f"block {number} must have shape [m, {histogram.n}] to match the bias of "
                             f"{histogram.n} experts, got {list(block.shape)}")
        histogram.add(block)
    return histogram.new_bias()


# ---------------------------------------------------------------------------
# The range and the values that are counted
# ---------------------------------------------------------------------------


def histogram_range(bias: Array) -> tuple[float, float]:
    r"""The interval $[\min_j b_j - 1,\ \max_j b_j + 1]$ that holds every required bias $r_{i,j}$.

    Returned as two Python floats (computed in float64). Every rank derives
    the same interval from the same bias, so no communication is needed to
    agree on the bin edges.
    """
    check_bias(bias)
    xp = array_namespace(bias)
    # $$r_{i,j} \in [\min_j b_j - 1,\ \max_j b_j + 1]$$
    low, high = float(xp.min(bias)) - 1.0, float(xp.max(bias)) + 1.0
    # Its width is at least 2 on paper. A bias so large that float64 loses the margins of 1 (beyond $2^{52}$),
    # or whose spread overflows, leaves no interval to divide into bins: refused, not divided by zero.
    if not (math.isfinite(high - low) and high - low >= 1.0):
        raise ValueError(f"bias must span an interval the histogram's bins can divide: [min b - 1, max b + 1] is "
                         f"[{low:.6g}, {high:.6g}], of width {high - low:.6g} in float64 (a bias of order "
                         f"{max(abs(low), abs(high)):.3g}, where the scores lie in (0, 1))")
    return low, high


def _fixed_range(value_range: Any, bins: int, bias: Array) -> tuple[float, float]:
    r"""A range `(low, high)` given by the caller, as two floats with `low < high`, that the counting can bin.

    The margins are binned in the dtype of the arithmetic, float32 unless the bias is float64:
    $h = \lfloor (r - \text{low}) \cdot B / (\text{high} - \text{low}) \rfloor$. A range whose ends or
    whose bins per unit that dtype cannot hold (ends of $\pm 10^{308}$ are infinite in float32; a range
    of width $10^{-40}$ has $10^{43}$ bins per unit) would turn every index into NaN or infinity, so it is
    refused by name, and so is a number beyond float64 ($10^{400}$).
    """
    if not isinstance(value_range, tuple | list) or len(value_range) != 2:
        raise TypeError(f"value_range must be a pair (low, high) or None, got {shown(value_range)}")
    if not all(is_real(v) for v in value_range):
        raise TypeError(f"value_range must hold two real numbers, got {shown(value_range)}")
    try:
        low, high = float(value_range[0]), float(value_range[1])
    except OverflowError:  # an integer beyond float64
        raise ValueError(f"value_range must be finite with low < high, got {shown(value_range)} "
                         "(beyond float64)") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"value_range must be finite with low < high, got ({low:g}, {high:g})")
    work = np.float64 if dtype_name(bias.dtype) == "float64" else np.float32
    with np.errstate(over="ignore"):
        ends = np.array([low, high]).astype(work)
        per_unit = np.float64(bins) / (high - low)  # bins per unit of the margin
    largest = float(np.finfo(work).max)
    if not (np.all(np.isfinite(ends)) and ends[0] < ends[1] and math.isfinite(per_unit) and per_unit <= largest):
        raise ValueError(f"value_range must be a range {np.dtype(work).name} (the histogram's arithmetic) can "
                         f"divide into {bins} bins: ends within +-{largest:.4g}, distinct in "
                         f"{np.dtype(work).name}, and high - low >= {bins / largest:.3g}; got ({low:g}, {high:g})")
    return low, high


def _cutoff(scores: Array, bias: Array, top_k: int) -> Array:
    """Each token's cutoff alpha_i, `[m]`; with k = n no cutoff exists and alpha = -inf."""
    xp = array_namespace(scores, bias)
    m, n = scores.shape
    if top_k == n:
        return xp.full((m,), -xp.inf, dtype=compute_dtype(xp, scores, bias))
    # The same values as `selection_cutoff`, from Eq. (14)'s values-only selection (no ranking of ids).
    return cutoff_values(scores, bias, top_k)  # [m]


def required_bias(scores: Array, bias: Array, top_k: int) -> Array:
    r"""The bias each expert would need to enter each token's top-$k$: $r_{i,j} = \alpha_i - s_{i,j}$.

    `scores` is `[m, n]`, `bias` `[n]`; returns `[m, n]` in the dtype of the
    biased scores (float32 or float64). Token $i$ selects expert $j$ under a
    bias $b$ exactly when $b_j > r_{i,j}$. This materialises all $mn$ values
    and is meant for small batches (plots, tests); `BiasHistogram` never forms
    more than a chunk of them.
    """
    check_bias(bias)
    check_float_array("scores", scores, ndim=2)
    n = bias.shape[0]
    if scores.shape[1] != n:
        raise ValueError(f"scores must have shape [m, {n}] to match bias {list(bias.shape)}, "
                         f"got {list(scores.shape)}")
    top_k = check_int("top_k", top_k, low=1, high=n)
    check_finite("scores", scores)
    xp = array_namespace(scores, bias)
    alpha = _cutoff(scores, bias, top_k)  # [m]
    # $$r_{i,j} = \alpha_i - s_{i,j}$$
    return alpha[:, None] - xp.astype(scores, alpha.dtype)


# ---------------------------------------------------------------------------
# Counting: the scatter-add of one chunk into the [n, B] matrix
# ---------------------------------------------------------------------------


def _count_portable(counts: Array, s: Array, alpha: Array, low: Array, scale: Array) -> Array:
    """`counts` plus the histogram of one chunk, with array-API calls only."""
    xp = array_namespace(counts, s, alpha)
    n, bins = counts.shape
    # Position of each required bias in units of bins, measured from the low end of the range:
    # $$t_{i,j} = \frac{r_{i,j} - \text{low}}{w} = \bigl((\alpha_i - \text{low}) - s_{i,j}\bigr)\,\frac{B}{\text{high} - \text{low}}$$
    t = ((alpha - low)[:, None] - s) * scale  # [c, n]
    # Values outside the range land in the edge bins.
    t = xp.clip(t, 0.0, float(bins - 1))  # [c, n]
    bin_ = xp.astype(xp.floor(t), xp.int64)  # [c, n], in [0, B-1]
    # One id per (expert, bin), expert-major: $$\text{id}_{i,j} = jB + \lfloor t_{i,j} \rfloor$$
    flat = bin_ + xp.arange(n, dtype=xp.int64)[None, :] * bins  # [c, n]
    added = xp.reshape(bincount(flat, n * bins), (n, bins))  # [n, B]
    return counts + xp.astype(added, counts.dtype)


# ---------------------------------------------------------------------------
# The read-out: order statistics from cumulative counts
# ---------------------------------------------------------------------------


def _order_statistic(counts: Array, rank: int, low: float, width: float) -> Array:
    r"""Estimate, per row of `counts` `[n, B]`, the `rank`-th smallest counted value (1-based).

    The value lies in the first bin $h$ whose cumulative count reaches
    `rank`; inside it, the $c$ values are taken as evenly spread.
    """
    xp = array_namespace(counts)
    cumulative = xp.cumulative_sum(counts, axis=1)  # [n, B]
    # The first bin whose cumulative count reaches the rank: the number of bins that fall short of it.
    h = xp.sum(xp.astype(cumulative < rank, xp.int64), axis=1)  # [n], the bin index
    inside = xp.take_along_axis(counts, h[:, None], axis=1)[:, 0]  # [n], c
    before = xp.take_along_axis(cumulative, h[:, None], axis=1)[:, 0] - inside  # [n]
    u = xp.astype(rank - before, xp.float64)  # [n], the value's place inside its bin, 1..c
    # $$\hat r_{(t)} = e_h + \frac{u - 1/2}{c}\, w, \qquad e_h = \text{low} + h w$$
    return low + (xp.astype(h, xp.float64) + (u - 0.5) / xp.astype(inside, xp.float64)) * width


def _check_finite_chunk(scores: Array) -> None:
    """NaN or infinite scores raise; one sum over the chunk, the exact check only when that sum is not finite."""
    xp = array_namespace(scores)
    # A sum is finite only when every term is; an overflowing sum of finite terms passes the exact check.
    if scores.shape[0] and not math.isfinite(float(xp.sum(scores))):
        check_finite("scores", scores)


# ---------------------------------------------------------------------------
# The estimator as a balancer
# ---------------------------------------------------------------------------

class HistogramBalancer(Balancer):
    """Appendix D inside a training step: the batch is split into `micro_batches`, each counted into one histogram.

    The result is the bias of `histogram_balancing_update` on the blocks, the
    same as one histogram of the whole batch (counts add), within one bin
    width of exact Quantile Balancing. The training loop's `qb-hist`.
    """

    kind = "qb-hist"

    def __init__(self, num_experts: int, top_k: int, *, bins: int = 1000, micro_batches: int = 4,
                 bias: Array | None = None, dtype: Any = np.float32) -> None:
        super().__init__(num_experts, top_k, bias=bias, dtype=dtype)
        self.bins = check_int("bins", bins, low=1)
        self.micro_batches = check_int("micro_batches", micro_batches, low=1)

    def options(self) -> dict[str, Any]:
        return {"bins": self.bins, "micro_batches": self.micro_batches}

    def check_batch(self, m: int) -> None:
        """Raise `ValueError` if a batch of `m` tokens cannot be split into the micro-batches or is too small for the rule.

        The histogram reads the same order statistic as Eq. (14) (the $(q+1)$-th smallest required bias,
        $q = mk/n$), which exists only in a batch of at least $n/(n-k)$ tokens: a smaller one is refused
        here, before the first step, not by `BiasHistogram.thresholds` in the middle of the run.
        """
        super().check_batch(m)
        if m < self.micro_batches:
            raise ValueError(f"a batch of {m} tokens cannot be split into micro_batches={self.micro_batches}")
        try:
            quantile_rank(m, self.num_experts, self.top_k)
        except ValueError as exc:
            raise ValueError(f"a batch of {m} tokens is too small for the histogram's Quantile Balancing of "
                             f"{self.num_experts} experts with top_k={self.top_k}: {exc}") from None

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        self.check_batch(scores.shape[0])
        blocks = np.array_split(np.asarray(scores), self.micro_batches, axis=0)  # micro-batches [m_i, n]
        return histogram_balancing_update(blocks, bias, self.top_k, self.bins)
