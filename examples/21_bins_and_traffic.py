r"""Error against the number of bins, and bytes against the batch size

Two numbers decide whether the histogram is worth it: how far its bias lands
from the exact Eq. (14) bias, and how much less it costs to communicate.

**Error.** On one batch (32,768 tokens, $n = 128$ experts, $k = 8$, so an
integer target load $q = mk/n = 2048$) the uncentred thresholds are read with
$B$ from 10 to 10,000 bins and compared with the thresholds from sorting each
column. The bound is one bin width
$w = (\max b - \min b + 2)/B$; the cutoffs are computed once and passed to
every histogram, so only the counting is repeated. The second sweep takes another
batch of 32,771 tokens, which makes $q$ fractional (2048.19): the read-out
then interpolates between two ranks, and the same bound holds.

**Traffic.** Per layer and step the histogram all-reduce moves $nB$ integers,
whatever the number of tokens; gathering the raw margins moves $mn$ floats.
The table and the figure use the K3 sizes ($n = 896$, $B = 1000$, int64 counts
against float32 margins): the two cost the same at $m = 2B = 2000$ tokens, and
at K3's global batch of four million tokens the histogram is over two thousand
times smaller. (A ring all-reduce sends and receives about twice the payload
per rank, $2(p-1)/p \cdot nB$ integers, still independent of $m$; int32 counts,
enough below $2^{31}$ tokens, would halve it.)
"""

# %%
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from refimpl.balancing.histogram import BiasHistogram, required_bias
from refimpl.layer.routing import router_scores, selection_cutoff
from refimpl.studies.figures import figures_wanted, show_figure

N, K, SEED = 128, 8, 21
BINS = [10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000]
K3_N, K3_BINS = 896, 1000


# %%
def batch(m: int, step: int) -> np.ndarray:
    """Scores from a fixed router with unequal expert popularity."""
    rng = np.random.default_rng(SEED)
    weight = rng.standard_normal((N, 16)).astype(np.float32) / 4
    mean = rng.standard_normal(16).astype(np.float32)
    x = mean + np.random.default_rng([SEED, step]).standard_normal((m, 16)).astype(np.float32)
    return router_scores(x, weight)


# %%
def exact_thresholds(r: np.ndarray, m: int) -> np.ndarray:
    """Eq. (14) by sorting: the (q+1)-th smallest r of each column, interpolated for fractional q."""
    q_floor, rest = divmod(m * K, N)
    ordered = np.sort(r.astype(np.float64), axis=0)
    return (1 - rest / N) * ordered[q_floor] + rest / N * ordered[q_floor + 1]


# %%
def error_sweep(m: int, step: int, bias: np.ndarray) -> list[tuple[int, float, float, float]]:
    """(B, w, largest uncentred error, largest centred error) for every B."""
    scores = batch(m, step)
    exact = exact_thresholds(required_bias(scores, bias, K), m)
    _, alpha = selection_cutoff(scores, bias, K)  # the cutoffs, once for every B
    rows = []
    for bins in BINS:
        histogram = BiasHistogram(bias, K, bins).add(scores, cutoff=alpha)
        error = np.abs(histogram.thresholds() - exact).max()
        centred = np.abs(np.asarray(histogram.new_bias(), np.float64) - (exact - exact.mean())).max()
        rows.append((bins, histogram.width, float(error), float(centred)))
    return rows


# %%
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figures in this folder")
    args = parser.parse_args(argv)

    # Step: The current bias: one exact step on an earlier batch, so the columns carry their atoms.
    previous = batch(32_768, step=0)
    b_tilde = exact_thresholds(required_bias(previous, np.zeros(N, np.float32), K), 32_768)
    bias = (b_tilde - b_tilde.mean()).astype(np.float32)

    sweeps = {}
    for step, m in ((1, 32_768), (2, 32_771)):
        q = m * K / N
        print(f"error against B: m = {m:,} tokens, n = {N}, k = {K}, q = {q:g}")
        print(f"{'B':>7} {'bin width w':>12} {'max |error|':>12} {'/ w':>6} {'centred':>10} {'/ w':>6}")
        sweeps[m] = error_sweep(m, step, bias)
        for bins, w, error, centred in sweeps[m]:
            print(f"{bins:>7,} {w:>12.3e} {error:>12.3e} {error / w:>6.3f} {centred:>10.3e} {centred / w:>6.3f}")
        first, last = sweeps[m][0], sweeps[m][-1]
        print(f"from B = {first[0]:,} to {last[0]:,} the error falls {first[2] / last[2]:,.0f}-fold "
              f"(the bin width {first[1] / last[1]:,.0f}-fold)")
        print()

    # What to see: at every B the largest error stays under one bin width, at most 0.774 w, so it shrinks with
    # w: 925-fold while w shrinks 1,000-fold. Its ratio to w does not shrink, because the read-out takes the
    # values inside a bin as evenly spread, and the exact value may sit anywhere in its bin. With q = 2048.19
    # the read-out interpolates between two ranks, each read within one bin, and the bound holds just as well.

    # Step: The traffic
    print(f"bytes per layer and step at K3 sizes (n = {K3_N}, B = {K3_BINS}):")
    histogram_bytes = K3_N * K3_BINS * 8
    print(f"{'tokens m':>12} {'raw margins (float32)':>22} {'histogram (int64)':>18} {'ratio':>8}")
    for m in (512, 2000, 4096, 65_536, 1_048_576, 4_194_304, 16_777_216):
        raw = m * K3_N * 4
        print(f"{m:>12,} {raw:>22,} {histogram_bytes:>18,} {raw / histogram_bytes:>8,.2f}")
    print(f"equal cost at m = 2B = {2 * K3_BINS:,} tokens; above it the histogram is cheaper by m / (2B)")

    # What to see: the histogram costs 7,168,000 bytes (896 x 1000 int64 counts) at any batch size, while the
    # raw margins grow with m. Below m = 2,000 gathering the margins is cheaper (a ratio of 0.26 at 512
    # tokens); at K3's global batch of 4,194,304 tokens the histogram is 2,097.15 times smaller.

    # Step: The figure
    if figures_wanted(args.out):
        plot(args.out, sweeps, histogram_bytes)
    return {"sweeps": sweeps}


# %%
def plot(out: Path, sweeps, histogram_bytes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), constrained_layout=True)
    widths = np.array([w for _, w, _, _ in next(iter(sweeps.values()))])
    bins = np.array(BINS)
    ax.loglog(bins, widths, color="black", label="one bin width $w$ (the bound)")
    for (m, rows), marker in zip(sweeps.items(), ("o", "s"), strict=True):
        q = m * K / N
        ax.loglog(bins, [e for _, _, e, _ in rows], marker=marker, linestyle="--",
                  label=f"largest |error|, m = {m:,} (q = {q:g})")
    ax.set_xlabel("bins B")
    ax.set_ylabel("threshold error")
    ax.set_title(f"Histogram threshold against the exact Eq. (14), n = {N}, k = {K}")
    ax.legend(fontsize=8)
    show_figure(fig, out, "error_vs_bins.png",
                caption="The histogram's threshold error stays within one bin width, so it falls as the number of"
                        " bins B grows.",
                alt="Log-log plot of the largest threshold error against the number of bins for several batch"
                    " sizes, below the line of one bin width")

    fig, ax = plt.subplots(figsize=(6.4, 4.4), constrained_layout=True)
    m = np.geomspace(256, 3.4e7, 200)
    ax.loglog(m, m * K3_N * 4, label="gather raw margins: $m n$ float32")
    ax.loglog(m, np.full_like(m, histogram_bytes), label="all-reduce the histogram: $n B$ int64")
    ax.axvline(4_194_304, color="0.5", linestyle=":", label="K3 global batch, 4,194,304 tokens")
    ax.axvline(2 * K3_BINS, color="0.7", linestyle="--", label="break-even, m = 2B")
    ax.set_xlabel("tokens per step m")
    ax.set_ylabel("bytes per layer and step")
    ax.set_title(f"Communication, n = {K3_N}, B = {K3_BINS}")
    ax.legend(fontsize=8)
    show_figure(fig, out, "bytes_vs_tokens.png",
                caption="Gathering every margin costs bytes in proportion to the batch; all-reducing the "
                        "histogram costs the same at any batch size, far less at K3's global batch.",
                alt="Log-log plot of bytes per layer and step against tokens per step: a rising line for "
                    "gathering the margins and a flat one for the histogram, with K3's batch and the break-"
                    "even point marked")


# %%
if __name__ == "__main__":
    main()
