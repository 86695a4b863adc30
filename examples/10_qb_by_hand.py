r"""Quantile Balancing by hand: twelve tokens, four experts

One Eq. (14) update on a batch small enough to print every number. Twelve
tokens choose $k = 2$ of $n = 4$ experts, so the target load is
$q = mk/n = 6$. The router is skewed (expert 0 is popular, expert 3 is not)
and the bias starts at zero.

The steps, in the order the paper gives them:

1. **Route and cut off.** Each token ranks $s_i + b$; the first $k = 2$ are its
   route and the third biased score is its cutoff $\alpha_i$.
2. **Margins.** $M_{i,j} = s_{i,j} - \alpha_i$. Expert $j$ is in token $i$'s
   route exactly when $M_{i,j} > -b_j$. In the table a `*` marks the chosen
   experts and a `=` the token's third choice, whose margin is exactly $-b_j$
   (the atom of ties of Eq. 14).
3. **Quantile.** For each expert, $\tilde b_j = -$ the $(q+1)$-th $= 7$th
   largest margin of its column: with the cutoffs held, exactly $q$ margins
   clear $-\tilde b_j$.
4. **Center.** $b^{\text{new}} = \tilde b - \operatorname{mean}(\tilde b)$.

The loads are then counted three ways: with the cutoffs held (what step 3
aims at), on the same batch routed again (the cutoffs move, because moving
$b$ moves every $\alpha_i$), and on a fresh batch from the same router, which
is how the new bias is used in training.
"""

# %%
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from refimpl.balancing import margins, quantile_balancing_update
from refimpl.layer.routing import expert_load, route, selection_cutoff
from refimpl.studies.figures import figures_wanted, show_figure

M, N, K, SEED = 12, 4, 2, 4
OFFSETS = np.array([1.0, 0.3, 0.0, -0.6])  # expert 0 popular, expert 3 not


# %%
def batch(rng: np.random.Generator, m: int = M) -> np.ndarray:
    """Sigmoid scores of a skewed router, rounded to 3 decimals so the tables show them exactly."""
    logits = rng.normal(size=(m, N)) + OFFSETS
    return np.round(1.0 / (1.0 + np.exp(-logits)), 3)


# %%
def table(title: str, rows: list[str]) -> None:
    print(title)
    for row in rows:
        print("  " + row)
    print()


# %%
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    args = parser.parse_args(argv)

    # Step: the batch
    # Twelve tokens' sigmoid scores from the skewed router; the bias starts at zero.
    rng = np.random.default_rng(SEED)
    s = batch(rng)  # [12, 4]
    b = np.zeros(N)
    q = M * K // N
    print(f"m = {M} tokens, n = {N} experts, k = {K}: target load q = mk/n = {q}; starting bias b = 0")
    print()

    # What to see: twelve tokens make 24 choices, so an even split gives each of the four experts q = 6. The
    # update below moves the bias until each expert's load is measured against that number.

    # Step 1: route with the top-(k+1)
    # Each token keeps its top-2 experts by $s + b$; its third biased score is the cutoff $\alpha_i$.
    index, alpha = selection_cutoff(s, b, K)  # [12, 2], [12]
    load = expert_load(index, N)
    third = np.argsort(-(s + b), axis=1, kind="stable")[:, K]  # each token's (k+1)-th choice
    head = "token  " + "".join(f"   s_{j}  " for j in range(N)) + "   route   alpha_i"
    rows = [f"{i:>5}  " + "".join(f"{s[i, j]:7.3f} " for j in range(N))
            + f"   {sorted(index[i].tolist())!s:<8}{alpha[i]:7.3f}" for i in range(M)]
    table("Step 1: scores s (= s + b, since b = 0), the route (top-2) and the cutoff alpha_i (3rd largest)",
          [head, *rows])

    # What to see: each route is the token's two largest scores, and alpha_i is its third, the bar an
    # unchosen expert has to clear. Expert 0 is in 8 routes and expert 3 in 4, against q = 6.

    # Step 2: margins
    # $M_{i,j} = s_{i,j} - \alpha_i$; expert $j$ is chosen exactly when $M_{i,j} > -b_j$.
    margin = margins(s, b, K)  # [12, 4]

    def cell(i: int, j: int) -> str:
        mark = "*" if j in index[i] else ("=" if j == third[i] else " ")
        return f"{margin[i, j]:+7.3f}{mark}"

    rows = [f"{i:>5}  " + "".join(cell(i, j) + " " for j in range(N)) for i in range(M)]
    rows.append("load   " + "".join(f"{int(load[j]):>7}  " for j in range(N)) + f"  (q = {q})")
    table("Step 2: margins M = s - alpha   (* chosen: M > -b_j;  = the token's 3rd choice: M = -b_j)",
          ["token  " + "".join(f"    M_{j}  " for j in range(N)), *rows])

    # What to see: a chosen expert's margin is positive (*), and each token's third choice sits exactly at 0
    # (=): the atom of ties at -b_j. The loads 8, 6, 6, 4 count the stars of each column.

    # Step 3: the quantile
    # Each expert's new threshold is minus the $(q+1)$-th largest margin of its column.
    b_tilde = quantile_balancing_update(s, b, K, center=False)
    ordered = -np.sort(-margin, axis=0)  # each column descending
    rows = []
    for j in range(N):
        column = " ".join(f"{v:+.3f}" for v in ordered[:, j])
        rows.append(f"expert {j}: {column}")
    rows.append("")
    for j in range(N):
        in_atom = np.isclose(ordered[q, j], -b[j], rtol=0, atol=1e-12)
        rows.append(f"expert {j}: {q + 1}th largest margin {ordered[q, j] + 0.0:+.3f} -> "
                    f"b~_{j} = {b_tilde[j] + 0.0:+.3f}"
                    + ("   (inside the atom at -b_j: the bias stays)" if in_atom else ""))
    table(f"Step 3: each column sorted, largest first; the {q + 1}th entry is minus the new threshold", rows)

    # What to see: expert 0 has 8 positive margins, so its bar rises to its 7th, and its bias drops to -0.097.
    # Experts 1 and 2 find their 7th margin inside the atom at 0, so their bias does not move: the atom holds them.

    # Step 4: center
    # Only differences of the bias matter for selection; centering removes their common offset.
    b_new = quantile_balancing_update(s, b, K)
    print(f"Step 4: mean(b~) = {b_tilde.mean():+.4f};  new bias b = b~ - mean = "
          + "[" + ", ".join(f"{v:+.4f}" for v in b_new) + "]")
    print()

    # What to see: the mean is taken off the bias, which changes no route and keeps the bias near zero.

    # Step 5: what the new bias does, on this batch and on a fresh one
    held = (margin > -b_tilde[None, :]).sum(axis=0)  # cutoffs held: M > -b~
    again = expert_load(route(s, b_new, K)[0], N)
    fresh_scores = batch(rng, 4000)
    fresh_q = 4000 * K // N
    fresh_old = expert_load(route(fresh_scores, b, K)[0], N)
    fresh_new = expert_load(route(fresh_scores, b_new, K)[0], N)
    lines = [("this batch, old bias", load), ("this batch, cutoffs held, new threshold", held),
             ("this batch routed again with the new bias", again),
             (f"fresh batch of 4,000 tokens (q = {fresh_q}), old bias", fresh_old),
             (f"fresh batch of 4,000 tokens (q = {fresh_q}), new bias", fresh_new)]
    print(f"{'loads per expert':<52}" + "".join(f"{j:>7}" for j in range(N)))
    for label, values in lines:
        print(f"{label:<52}" + "".join(f"{v:>7}" for v in values))
    print()

    # What to see: with every token's cutoff held, the new bars let exactly q = 6 tokens through for every
    # expert. Routed again, the cutoffs move with the bias, and the loads are 7, 7, 6, 4: closer, not exact. On
    # a fresh batch of 4,000 tokens, the busiest expert's excess over q falls from 1288 to 843. One update
    # does part of the work, and the next batches do the rest.

    # Step 6: the leave-one-out extension
    # Each expert measured against the cutoff it really has to beat.
    b_loo = quantile_balancing_update(s, b, K, leave_one_out=True)
    again_loo = expert_load(route(s, b_loo, K)[0], N)
    fresh_loo = expert_load(route(fresh_scores, b_loo, K)[0], N)
    print("extension, leave-one-out cutoffs: new bias [" + ", ".join(f"{v:+.4f}" for v in b_loo) + "]")
    for label, values in (("this batch routed again", again_loo), ("fresh batch of 4,000 tokens", fresh_loo)):
        print(f"{label:<52}" + "".join(f"{v:>7}" for v in values))

    # What to see: measured against the cutoff it really has to beat, no expert is held by the atom, and every
    # bias moves. The loads come closer to q than with the paper's rule, on this batch (6, 6, 5, 7) and on the
    # fresh one (1174 to 2663, against 907 to 2843); still, neither rule balances a skewed router in one step.

    # Step: the figure
    if figures_wanted(args.out):
        show_figure(plot(margin, index, third, b, b_tilde, load, held, again), args.out, "margins_and_loads.png",
                    caption="Left: in every column the 7th largest margin sets the new bar, which exactly q = 6 "
                            "margins clear. Right: the loads before the update, with the cutoffs held (all equal "
                            "to q) and with the batch routed again.",
                    alt="Scatter of the twelve margins per expert with the old and new thresholds as lines, "
                        "beside a bar chart of the four experts' loads under the old and new bias")
    return {"load": load.tolist(), "held": held.tolist(), "again": again.tolist(), "b_new": b_new.tolist(),
            "fresh_old": fresh_old.tolist(), "fresh_new": fresh_new.tolist(), "again_loo": again_loo.tolist()}


# %%
def plot(margin, index, third, b, b_tilde, load, held, again):
    """The margins with the old and new bars, and the loads before and after: a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.3), constrained_layout=True,
                                 gridspec_kw={"width_ratios": [1.4, 1]})
    rng = np.random.default_rng(0)
    for j in range(N):
        chosen = np.array([j in index[i] for i in range(M)])
        atom = third == j
        x = j + rng.uniform(-0.18, 0.18, size=M)
        ax.scatter(x[chosen], margin[chosen, j], color="#1f77b4", s=28, label="chosen" if j == 0 else None)
        ax.scatter(x[atom], margin[atom, j], color="#ff7f0e", marker="D", s=28,
                   label="3rd choice (the atom at $-b_j$)" if j == 0 else None)
        rest = ~chosen & ~atom
        ax.scatter(x[rest], margin[rest, j], color="0.6", s=20, label="not chosen" if j == 0 else None)
        ax.hlines(-b[j], j - 0.3, j + 0.3, color="0.3", linestyle=":", label="$-b_j$ (old bar)" if j == 0 else None)
        ax.hlines(-b_tilde[j], j - 0.3, j + 0.3, color="#d62728", label="$-\\tilde b_j$ (new bar)" if j == 0 else None)
    ax.set_xticks(range(N), [f"expert {j}" for j in range(N)])
    ax.set_ylabel("margin $M_{i,j} = s_{i,j} - \\alpha_i$")
    ax.set_title("Each column's 7th largest margin sets the new bar")
    ax.legend(fontsize=8, loc="lower left")
    width = 0.27
    for shift, values, label in ((-width, load, "old bias"), (0.0, held, "cutoffs held, new bias"),
                                 (width, again, "routed again, new bias")):
        bx.bar(np.arange(N) + shift, values, width=width, label=label)
    bx.axhline(M * K / N, color="black", linestyle="--", label="q = 6")
    bx.set_xticks(range(N), [f"expert {j}" for j in range(N)])
    bx.set_ylabel("tokens")
    bx.set_title("Loads on this batch")
    bx.legend(fontsize=8)
    return fig


# %%
if __name__ == "__main__":
    main()
