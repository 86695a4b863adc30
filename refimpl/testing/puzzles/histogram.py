"""Puzzle 9: the histogram quantile within one bin (Appendix D)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

from refimpl import (
    BiasHistogram,
)
from refimpl.testing import strategies as rst
from refimpl.testing.puzzles.core import (
    Case,
    Mistake,
    Puzzle,
    Trial,
    _array_output,
    _eps_close,
    _show_array,
)

# ---------------------------------------------------------------------------
# 9. The histogram quantile within one bin (Appendix D)
# ---------------------------------------------------------------------------

def histogram_thresholds(counts: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Each expert's threshold b~_j, the (q+1)-th smallest required bias, from its histogram row.

    counts [n, B] int (row j: expert j's required biases r binned), bias [n] (it fixed the range),
    top_k (q = m k / n whole, m = the row sum)  ->  thresholds [n] (not centred)
    """
    n, bins = counts.shape
    m = int(counts[0].sum())
    q = m * top_k // n
    t = q + 1  # the rank to read
    # The range [min b - 1, max b + 1], split into B equal bins
    low, high = bias.min() - 1.0, bias.max() + 1.0
    width = (high - low) / bins
    cumulative = np.cumsum(counts, axis=1)
    # The first bin h whose cumulative count reaches t
    h = np.argmax(cumulative >= t, axis=1)
    rows = np.arange(n)
    inside = counts[rows, h]
    before = cumulative[rows, h] - inside
    # The value of rank t is the u-th of the c values in its bin, taken as evenly spread:
    # the middle of the u-th of c equal slices
    u = t - before
    return low + (h + (u - 0.5) / inside) * width


def _histogram_reference(counts: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    histogram = BiasHistogram(bias, top_k, counts.shape[1])
    histogram.counts = counts.astype(np.int64)  # the counts after the all-reduce
    return np.asarray(histogram.thresholds())


@st.composite
def _histogram_cases(draw: st.DrawFn, piled: bool) -> Case:
    n = draw(st.integers(2, 6), label="n")
    k = draw(st.integers(1, n - 1), label="k")
    step = n // math.gcd(n, k)
    m = rst.min_tokens_for_update(n, k, integer_q=True) + step * draw(st.integers(0, 2), label="more tokens")
    bins = draw(st.integers(1, 10), label="bins")
    eighths = draw(st.lists(st.integers(-8, 8), min_size=n, max_size=n), label="bias eighths")
    bias = np.array(eighths, dtype=np.float64) / 8.0
    rows = []
    for j in range(n):
        if piled:
            # Most of the column in a few bins: the atom of ties at the old bias makes columns like this.
            where = st.sampled_from(sorted({0, bins // 2, bins - 1}))
        else:
            where = st.integers(0, bins - 1)
        ids = draw(st.lists(where, min_size=m, max_size=m), label=f"bins of expert {j}")
        rows.append(np.bincount(np.array(ids, dtype=np.int64), minlength=bins))
    return Case((np.array(rows, dtype=np.int64), bias, k))


def _histogram_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    bias = case.args[1]
    return _eps_close(got, expected, scale=2.0 + np.max(np.abs(bias)))


def _histogram_variant(*, rank_shift: int = 0, place: str = "slice", fixed_range: bool = False,
                       margin: float = 1.0, divisions: int = 0, side: str = "left", centred: bool = False
                       ) -> Callable[..., np.ndarray]:
    def answer(counts: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        n, bins = counts.shape
        m = int(counts[0].sum())
        t = m * top_k // n + 1 + rank_shift
        low, high = (-1.0, 1.0) if fixed_range else (bias.min() - margin, bias.max() + margin)
        width = (high - low) / (bins + divisions)
        cumulative = np.cumsum(counts, axis=1)
        # searchsorted's side="left" finds the first bin reaching t; "right" the first exceeding it
        h = np.array([np.searchsorted(cumulative[j], t, side=side) for j in range(n)])
        inside = counts[np.arange(n), h]
        u = t - (cumulative[np.arange(n), h] - inside)
        offset = {"slice": (u - 0.5) / np.maximum(inside, 1), "edge": 0.0 * u, "centre": 0.5 + 0.0 * u,
                  "cdf": u / np.maximum(inside, 1), "upper": 1.0 + 0.0 * u}[place]
        thresholds = low + (h + offset) * width
        return thresholds - thresholds.mean() if centred else thresholds

    return answer


HISTOGRAM_QUANTILE = Puzzle(
    number=9, name="histogram_quantile", title="The histogram quantile within one bin",
    spec=r"""At K3's scale the margins of Eq. (14) are billions of numbers spread over ranks and
micro-batches: they cannot be gathered and sorted. Appendix D histograms them instead. Written as the bias an
expert *would need*, $r_{i,j} = \alpha_i - s_{i,j}$ (token $i$ takes expert $j$ exactly when $b_j > r_{i,j}$),
the exact threshold of puzzle 6, before centring, is the **$(q{+}1)$-th smallest** $r_{:,j}$: exactly $q$ values
lie below it.

Since scores lie in $(0, 1)$ and $\alpha_i$ is some expert's biased score, every $r_{i,j}$ lies in
$[\min_j b_j - 1,\ \max_j b_j + 1]$. That range, recomputed from the current bias, is split into $B$ equal bins
of width $w$ (K3: $B = 1000$), and each expert's $r$ values are counted into its row of an $n \times B$ integer
matrix; one all-reduce (a sum) of the counts gives every rank the histogram of the global batch.

**Reading a threshold.** The value of rank $t = q + 1$ lies in the first bin $h$ whose cumulative count
reaches $t$. Inside it, the $c$ values it holds are taken as **evenly spread**, so the one of rank $t$, the
$u$-th of the bin, sits at the middle of the $u$-th of $c$ equal slices:

$$
\hat r_{(t)} = e_h + \frac{u - \tfrac12}{c}\, w,
$$

where $u = t - (\text{the count before bin } h)$ and $e_h = \text{low} + h w$ is the bin's lower edge.

The exact value is inside that bin, so the estimate is **within one bin width** of it.

Write `histogram_thresholds(counts, bias, top_k)`: `counts` `[n, B]` integers whose rows all sum to the number
of tokens $m$; `bias` `[n]`, the bias the histogram was built with (it fixed the range); $1 \le k < n$, with
$q = mk/n$ whole. Return the thresholds $\tilde b_j$, `[n]`, not centred.""",
    hint=r"""`np.cumsum(counts, axis=1)`; the first bin reaching `t` in every row is
`np.argmax(cumulative >= t, axis=1)`. Read the bin's count and the count before it with fancy indexing
(`counts[np.arange(n), h]`). The bin width is `(high - low) / B`.""",
    solution=histogram_thresholds,
    reference=_histogram_reference,
    reference_name="refimpl.BiasHistogram(bias, top_k, B) with these counts, .thresholds()",
    trials=(Trial("histograms spread over all the bins", _histogram_cases(piled=False)),
            Trial("histograms piled up in a few bins", _histogram_cases(piled=True))),
    output=_array_output("the thresholds", lambda c: (c.args[0].shape[0],), "float"),
    agree=_histogram_agree,
    show=_show_array,
    mistakes=(
        Mistake("bin_edge", "the bin's lower edge, without interpolating inside the bin",
                "Reading the edge e_h throws away where the value sits in its bin: the estimate is then off "
                "by up to a whole bin width even when the bin holds many values. Spread the bin's c values evenly "
                "and read the middle of the u-th slice.", _histogram_variant(place="edge")),
        Mistake("rank_q", "the q-th smallest value instead of the (q+1)-th",
                "The threshold is the value the (q+1)-th token needs, so that exactly q tokens lie below it. The "
                "q-th and (q+1)-th can sit many bins apart (the atom of ties at the old bias), so the q-th can "
                "miss by many bin widths.", _histogram_variant(rank_shift=-1)),
        Mistake("cdf_interpolation", "(u / c) w instead of ((u - 1/2) / c) w inside the bin",
                "Interpolating the cumulative count linearly puts the u-th of c values at the end of its slice; "
                "the reading here puts it at the middle of its slice, e_h + (u - 1/2) w / c.",
                _histogram_variant(place="cdf")),
        Mistake("bin_centre", "the centre of the bin, whatever the rank inside it",
                "The middle of the bin is right only when the bin holds one value; with c values the rank's "
                "place inside the bin, (u - 1/2) / c, decides.", _histogram_variant(place="centre")),
        Mistake("fixed_range", "the range taken as [-1, 1] instead of [min b - 1, max b + 1]",
                "r = alpha - s moves with the bias (alpha is a biased score), so the range is recomputed from "
                "the current bias at every step; every rank gets the same edges from the same bias.",
                _histogram_variant(fixed_range=True)),
        Mistake("width_over_b_minus_1", "the bin width (high - low) / (B - 1) instead of (high - low) / B",
                "B bins of width w cover the range exactly when w = (high - low) / B; dividing by B - 1 (the "
                "count of the gaps between B points, as np.linspace's step) makes every bin too wide.",
                _histogram_variant(divisions=-1)),
        Mistake("searchsorted_right", "np.searchsorted with side=\"right\": the first bin whose cumulative count "
                "exceeds t, not the first that reaches it",
                "The value of rank t lies in the first bin h whose cumulative count is at least t. With "
                "side=\"right\" a bin whose cumulative count equals t exactly is skipped, and when that is the "
                "last bin the index runs past the end (IndexError).",
                _histogram_variant(side="right")),
        Mistake("range_without_margin", "the range taken as [min b, max b], without the margin of 1",
                "r = alpha - s lies within [min b - 1, max b + 1] since scores lie in (0, 1): the range keeps "
                "that margin of 1 on each side, so that every r falls in a bin.",
                _histogram_variant(margin=0.0)),
        Mistake("upper_edge", "the bin's upper edge e_h + w, without interpolating inside the bin",
                "The upper edge is as far from the value as the lower one can be: spread the bin's c values "
                "evenly and read the middle of the u-th slice, e_h + (u - 1/2) w / c.",
                _histogram_variant(place="upper")),
        Mistake("centred", "the thresholds centred",
                "This function returns the thresholds themselves; the centring of Eq. (14) is the balancer's "
                "next step, done after the thresholds are read.", _histogram_variant(centred=True)),
    ),
)
