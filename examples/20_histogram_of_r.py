r"""Where the histogram reads the threshold

One batch of 16,384 tokens routed to $k = 4$ of $n = 64$ experts (target load
$q = mk/n = 1024$), with the bias left by the previous step. For every pair of
token and expert the script forms the required bias
$r_{i,j} = \alpha_i - s_{i,j}$ (expert $j$ enters token $i$'s top-$k$ exactly
when $b_j > r_{i,j}$), counts the values of each expert in $B = 1000$ bins,
and reads the threshold from the cumulative counts. The exact Eq. (14)
threshold, the $(q+1)$-th smallest $r_{:,j}$, comes from sorting each column.

The table compares the two for four experts (the most and least loaded under
the current bias, and two in between) and then over all 64. The figure shows
the four histograms: the full range above, a zoom of a few bins around the
threshold below, with the exact threshold, the histogram's and the old bias
$b_j$ marked. The pile of counts at $b_j$ is the structural atom of Eq. (14):
every token whose $(k+1)$-th biased choice is expert $j$ has $r_{i,j} = b_j$.

The last lines apply both new biases to the *next* batch of the same router,
which is how the bias is used: the loads they give are the same to within a
few tokens.
"""

# %%
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from refimpl.balancing.histogram import BiasHistogram, required_bias
from refimpl.layer.routing import expert_load, route, router_scores
from refimpl.studies.figures import figures_wanted, show_figure

M, N, K, BINS, SEED = 16_384, 64, 4, 1000, 20


# %%
def batch(step: int, m: int = M) -> np.ndarray:
    """Scores of one batch from a fixed router in which some experts are more popular than others."""
    rng = np.random.default_rng(SEED)
    weight = rng.standard_normal((N, 16)).astype(np.float32) / 4
    mean = rng.standard_normal(16).astype(np.float32)
    x = mean + np.random.default_rng([SEED, step]).standard_normal((m, 16)).astype(np.float32)
    return router_scores(x, weight)


# %%
def exact_thresholds(r: np.ndarray, q_floor: int, f: float) -> np.ndarray:
    """Eq. (14) by sorting: the (q+1)-th smallest of each column, interpolated when q is fractional."""
    ordered = np.sort(r.astype(np.float64), axis=0)  # [m, n], column j ascending
    return (1 - f) * ordered[q_floor] + f * ordered[min(q_floor + 1, len(ordered) - 1)]


# %%
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    args = parser.parse_args(argv)

    # Step: The histogram's thresholds against the exact ones
    # The bias in use is the one the previous step left: one exact update computed on the previous batch.
    previous = batch(step=0)
    r_previous = required_bias(previous, np.zeros(N, np.float32), K)
    b_tilde = exact_thresholds(r_previous, *divmod(M * K, N))
    bias = (b_tilde - b_tilde.mean()).astype(np.float32)

    scores = batch(step=1)
    q_floor, rest = divmod(M * K, N)
    q = M * K / N
    r = required_bias(scores, bias, K)  # [m, n]
    exact = exact_thresholds(r, q_floor, rest / N)
    histogram = BiasHistogram(bias, K, BINS).add(scores)
    estimate = histogram.thresholds()
    w = histogram.width
    index, _ = route(scores, bias, K)
    load = expert_load(index, N)

    print(f"batch m = {M:,} tokens, n = {N} experts, k = {K}: target load q = {q:g}")
    print(f"bins: B = {BINS} over [min b - 1, max b + 1] = [{histogram.low:.4f}, {histogram.high:.4f}], "
          f"width w = {w:.5f}")
    print()
    order = np.argsort(load, kind="stable")
    chosen = [int(order[-1]), int(order[N // 2]), int(order[N // 4]), int(order[0])]
    print(f"{'expert':>6} {'load':>5} {'old b_j':>9} {'exact':>9} {'histogram':>10} {'error':>9} {'error/w':>8}")
    for j in chosen:
        err = estimate[j] - exact[j]
        print(f"{j:>6} {int(load[j]):>5} {bias[j]:>+9.5f} {exact[j]:>+9.5f} {estimate[j]:>+10.5f} "
              f"{err:>+9.2e} {abs(err) / w:>8.3f}")
    error = np.abs(estimate - exact)
    new_exact = exact - exact.mean()
    new_hist = np.asarray(histogram.new_bias(), dtype=np.float64)
    centred_error = np.abs(new_hist - new_exact)
    print()
    print(f"all {N} experts: largest |error| = {error.max():.2e} = {error.max() / w:.3f} w "
          f"(mean {error.mean() / w:.3f} w); after centring {centred_error.max() / w:.3f} w")
    atom = np.abs(r - bias[None, :]) <= 1e-6
    print(f"tokens in each expert's atom at r = b_j: {int(atom.sum(0).min())} to {int(atom.sum(0).max())} "
          f"(m/n = {M / N:g})")

    # What to see: the histogram's threshold lands within a fraction of a bin width of the exact one, at most
    # 0.715 w over all 64 experts and 0.122 w on average, because it is read inside the bin that holds the
    # exact (q+1)-th value. The busiest expert, 50 (load 1928), gets a lower threshold than its old bias and
    # the quietest, 57 (load 578), a higher one. Each expert's atom holds 85 to 915 tokens, those whose
    # (k+1)-th choice it is; every token has one such choice, so the atoms average m/n = 256.

    # Step: Cutoffs held fixed, a bias b gives expert j the load #{i : r_ij < b_j}.
    held_exact = (r < exact[None, :]).sum(0)
    held_hist = (r < estimate[None, :]).sum(0)
    in_atom = np.abs(exact - bias) <= 1e-6
    print(f"loads on this batch with the cutoffs held (q = {q:g}):")
    print(f"  all experts:        exact {held_exact.min()}..{held_exact.max()}, "
          f"histogram {held_hist.min()}..{held_hist.max()}")
    print(f"  {int((~in_atom).sum())} experts off the atom: exact {held_exact[~in_atom].min()}.."
          f"{held_exact[~in_atom].max()}, histogram {held_hist[~in_atom].min()}..{held_hist[~in_atom].max()}")
    print(f"  {int(in_atom.sum())} experts whose (q+1)-th value is in the atom: exact {held_exact[in_atom].min()}.."
          f"{held_exact[in_atom].max()}, histogram {held_hist[in_atom].min()}..{held_hist[in_atom].max()}")
    print("  (there the exact threshold is b_j itself and the tied tokens stay out; the histogram knows")
    print("  only the atom's bin, and the point it reads inside it lets the whole atom in or not)")

    # What to see: with the cutoffs held, the exact threshold gives each of the 47 experts off the atom
    # exactly q = 1024 tokens, and the histogram's gives 1016 to 1031: it is off only by the few tokens whose
    # r lies between the two thresholds, inside one bin. For the 17 experts whose (q+1)-th value is in the
    # atom, the exact threshold is b_j itself, and the tied tokens, which need a bias strictly above b_j, stay
    # out: 810 to 1004. The histogram's point inside the atom's bin can let the whole atom in, hence loads up
    # to 1161.

    # Step: What the all-reduce of counts avoids: averaging quantiles computed separately on each rank.
    ranks = 8
    per_rank = [exact_thresholds(part, *divmod(len(part) * K, N)) for part in np.split(r, ranks)]
    averaged = np.mean(per_rank, axis=0)
    print(f"averaging the exact thresholds of {ranks} ranks ({M // ranks:,} tokens each) instead: "
          f"largest |error| = {np.abs(averaged - exact).max():.2e} = {np.abs(averaged - exact).max() / w:.2f} w")

    following = batch(step=2)
    print()

    # What to see: averaged over the ranks, the thresholds miss the exact ones by up to 1.51 w, more than
    # twice the histogram's worst error of 0.715 w. Each rank's threshold is an order statistic of only 2,048
    # tokens, and the mean of the parts' order statistics is not the order statistic of the whole batch.
    # Summed integer counts are exactly the histogram of all 16,384 tokens, read to within a bin width.

    # Step: The next batch
    print("the next batch, routed with each bias (the cutoffs move, so neither is exactly q):")
    loads = {}
    for name, b in (("old bias", bias), ("exact Eq. (14)", new_exact.astype(np.float32)),
                    ("histogram, B = 1000", new_hist.astype(np.float32))):
        idx, _ = route(following, b, K)
        loads[name] = expert_load(idx, N)
        print(f"  {name:<20} min load {int(loads[name].min()):>5}, max load {int(loads[name].max()):>5}, "
              f"max/q = {loads[name].max() / q:.3f}")
    gap = np.abs(loads["exact Eq. (14)"].astype(int) - loads["histogram, B = 1000"].astype(int))
    print(f"  per expert, exact and histogram loads differ by at most {gap.max()} tokens")

    # What to see: on the next batch both new biases bring the busiest expert down from 1932 tokens to 1430
    # and 1428 (max/q from 1.887 to 1.396 and 1.395), but not to q = 1024: moving the bias moves every token's
    # cutoff, and the tokens are new. The exact and histogram biases give loads that differ by at most 47
    # tokens per expert, small beside the imbalance both leave.

    # Step: The figure
    if figures_wanted(args.out):
        plot(args.out, r, chosen, bias, exact, estimate, histogram, load)
    return {"error_over_width": float(error.max() / w), "centred_error_over_width": float(centred_error.max() / w),
            "load_gap": int(gap.max())}


# %%
def plot(out: Path, r, chosen, bias, exact, estimate, histogram, load) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = np.asarray(histogram.edges)
    w = histogram.width
    fig, axes = plt.subplots(2, len(chosen), figsize=(10.5, 5.6), constrained_layout=True)
    for col, j in enumerate(chosen):
        counts = np.asarray(histogram.counts[j])
        for row, (lo, hi) in enumerate(((edges[0], edges[-1]), (exact[j] - 12 * w, exact[j] + 12 * w))):
            ax = axes[row, col]
            keep = (edges[1:] > lo) & (edges[:-1] < hi)
            ax.bar(edges[:-1][keep], counts[keep], width=w, align="edge", color="#9bb7d4",
                   edgecolor="#4a6f96" if row else "none", linewidth=0.4)
            ax.axvline(bias[j], color="0.4", linestyle=":", label="old $b_j$ (the atom)")
            ax.axvline(exact[j], color="black", label="exact threshold")
            ax.axvline(estimate[j], color="#c0392b", linestyle="--", label="histogram threshold")
            ax.set_xlim(lo, hi)
            if row == 0:
                ax.set_yscale("log")
                ax.set_title(f"expert {j}: load {int(load[j])}")
            else:
                ax.set_xlabel("required bias $r_{i,j}$")
        axes[0, col].set_xlim(float(np.min(r[:, j])) - 0.02, float(np.max(r[:, j])) + 0.02)
    axes[0, 0].set_ylabel("tokens per bin (log)")
    axes[1, 0].set_ylabel("tokens per bin (±12 bins around the exact)")
    axes[0, 0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"Histograms of $r = \\alpha - s$, B = {histogram.bins}, bin width {w:.4f}")
    show_figure(fig, out, "r_histograms.png",
                caption="For four experts, the histogram of the bias each token would need: the exact threshold "
                        "(black) and the histogram's estimate (red dashes) fall in the same bin; the atom sits at"
                        " the old bias.",
                alt="Eight histograms in two rows: the full range of required biases for four experts on a "
                    "log scale, and twelve bins either side of the threshold, with the old bias and both "
                    "thresholds marked")


# %%
if __name__ == "__main__":
    main()
