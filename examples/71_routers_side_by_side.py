r"""The routers side by side: one batch, nine ways to route it

One batch of $m = 1024$ tokens (16 sequences of 64) meets one router of
$n = 32$ experts with top-$k = 4$, target load $q = mk/n = 128$. The router
is deliberately skewed, as a router early in training is: a few experts
attract most tokens. The token ids follow a Zipf law over a vocabulary of
5,000, as words in text do.

The same logits $z = x W_r^\top$ are then routed nine ways:

* **sigmoid** (K3 without its bias), **softmax** (Switch Transformer,
  DeepSeek-V2) and **sqrt-softplus** (DeepSeek-V4), each a plain top-$k$;
* **sigmoid + Quantile Balancing**: the bias after five Eq. (14) updates,
  each computed on an earlier batch from the same distribution (this batch
  is never routed with a bias computed from itself);
* **sigmoid + sign rule** (DeepSeek-V3) after the same five batches, at
  $\gamma = 10^{-3}$ and, to show what the step size does, at $\gamma = 10^{-2}$;
* **softmax + capacity** $c = 1.0$ and $c = 1.25$: the Switch overflow
  rule, with the share of assignments dropped;
* **hash routing** (DeepSeek-V4's first layers) on the token ids.

For each, the table gives the worst overload $\max_j L_j / q - 1$ (the
`max_violation` of the training loop), the lightest expert's load
$\min_j L_j / q$, the share of assignments dropped, Switch's auxiliary loss
$n\sum_i f_i P_i$ (with $P$ the softmax of the same logits, so that the
column compares the assignments) and DeepSeek's sequence-wise loss on the
router's own scores (with the scores normalized to sum to one). Both losses
are 1 for a perfectly even batch.

Three things to read in the numbers. The three score functions choose
**the same experts**: each is increasing in the logit, so without a bias a
token's top-$k$ is the top-$k$ of its logits whatever the function; they
differ in the weights, and in what a bias added to them means. Hash routing is balanced over **ids**,
not over **tokens**: with a Zipfian vocabulary the few most frequent ids carry
a large share of the tokens, and the experts they hash to are overloaded
whatever the router does. And capacity does not balance anything: it cuts the
overload off at $c$ and drops what was above it; the drop rate is the price.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from refimpl import (
    capacity_keep,
    expert_capacity,
    hash_route,
    quantile_balancing_update,
    route,
    sequence_balance_loss,
    sign_balancing_update,
    switch_balance_loss,
)
from refimpl.layer.routing import score_function_values, softmax
from refimpl.studies.figures import figures_wanted, show_figure

# %%
M, SEQ, N, K, D, VOCAB, SEED = 1024, 64, 32, 4, 48, 5000, 0
WARMUP = 5  # earlier batches the biases are computed on


def make_router(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A skewed router: expert j's weight leans on a shared direction by an amount falling with j."""
    w = rng.standard_normal((N, D)) / np.sqrt(D)  # [n, d]
    common = rng.standard_normal(D)
    common /= np.linalg.norm(common)
    lean = 2.0 * np.exp(-np.arange(N) / 6.0)  # [n], experts 0, 1, 2 ... are the popular ones
    return w + lean[:, None] * common[None, :], common


def batch_logits(rng: np.random.Generator, w: np.ndarray, common: np.ndarray) -> np.ndarray:
    """Logits of a fresh batch: tokens with a component along the shared direction."""
    x = rng.standard_normal((M, D)) + 1.0 * common[None, :]  # [m, d]
    return x @ w.T  # [m, n]


def zipf_ids(rng: np.random.Generator) -> np.ndarray:
    """Token ids with Zipf frequencies (rank r has weight 1/r) over the vocabulary."""
    p = 1.0 / np.arange(1, VOCAB + 1)
    return rng.choice(VOCAB, size=M, p=p / p.sum())


# %%
def learned_biases(rng: np.random.Generator, w: np.ndarray, common: np.ndarray) -> dict[str, np.ndarray]:
    """The QB and sign-rule biases after WARMUP earlier batches (sigmoid scores)."""
    b_qb, b_sign_small, b_sign_big = np.zeros(N), np.zeros(N), np.zeros(N)
    for _ in range(WARMUP):
        s = score_function_values(batch_logits(rng, w, common), "sigmoid")
        b_qb = quantile_balancing_update(s, b_qb, K)
        for b, rate in ((b_sign_small, 1e-3), (b_sign_big, 1e-2)):
            index, _ = route(s, b, K)
            b[:] = sign_balancing_update(np.bincount(index.ravel(), minlength=N), b, rate)
    return {"qb": b_qb, "sign 1e-3": b_sign_small, "sign 1e-2": b_sign_big}


def measure(name: str, index: np.ndarray, kept: np.ndarray, logits: np.ndarray, scores: np.ndarray) -> dict:
    """The columns of the table for one router."""
    q = M * K / N
    load = np.bincount(index[kept], minlength=N)
    return {
        "router": name,
        "max_violation": load.max() / q - 1,
        "min_load": load.min() / q,
        "dropped": 1 - kept.mean(),
        "switch_loss": switch_balance_loss(softmax(logits), index, N),
        "sequence_loss": sequence_balance_loss(scores, index, N, SEQ),
        "sorted_load": np.sort(load)[::-1] / q,
    }


# %%
def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    args = parser.parse_args(argv)

    # Step: One batch, routed nine ways
    # A skewed router, the biases two balancers reach on five earlier batches, and the batch all routers see;
    # each router's loads, drops and losses on the same logits, one row per router.
    rng = np.random.default_rng(SEED)
    w, common = make_router(rng)
    biases = learned_biases(rng, w, common)
    logits = batch_logits(rng, w, common)  # [m, n], the batch all routers see
    ids = zipf_ids(rng)  # [m]
    every = np.ones((M, K), dtype=bool)

    rows = []
    for function in ("sigmoid", "softmax", "sqrtsoftplus"):
        s = score_function_values(logits, function)
        index, _ = route(s, np.zeros(N), K)
        rows.append(measure(function, index, every, logits, s))
    s = score_function_values(logits, "sigmoid")
    for label, key in (("sigmoid + QB bias", "qb"), ("sigmoid + sign 1e-3", "sign 1e-3"),
                       ("sigmoid + sign 1e-2", "sign 1e-2")):
        index, _ = route(s, biases[key], K)
        rows.append(measure(label, index, every, logits, s))
    p = score_function_values(logits, "softmax")
    index, _ = route(p, np.zeros(N), K)
    for c in (1.0, 1.25):
        kept = capacity_keep(index, N, expert_capacity(M, N, K, c))
        rows.append(measure(f"softmax + capacity {c}", index, kept, logits, p))
    rows.append(measure("hash (Zipf ids)", hash_route(ids, N, K), every, logits, s))

    print(f"m = {M} tokens ({M // SEQ} sequences of {SEQ}), n = {N}, k = {K}, q = {M * K // N}; "
          f"biases from {WARMUP} earlier batches")
    print()
    print(f"{'router':<24} {'max L/q - 1':>11} {'min L/q':>8} {'dropped':>8} {'Switch loss':>11} {'seq. loss':>9}")
    for r in rows:
        print(f"{r['router']:<24} {r['max_violation']:>11.2f} {r['min_load']:>8.2f} {r['dropped']:>8.1%} "
              f"{r['switch_loss']:>11.3f} {r['sequence_loss']:>9.3f}")

    # What to see: the three score functions give the same loads (worst overload 3.62, lightest expert at 0.22
    # of q): each is increasing in the logit, so a token's top 4 are its 4 largest logits whatever the
    # function. Only the sequence-wise loss tells them apart, because it reads the normalized scores, which
    # under sigmoid and sqrt-softplus are much flatter than under softmax (1.135 and 1.163 against 1.954).
    # Quantile Balancing's bias brings the overload down to 0.32, while the sign rule, which moves each bias
    # by at most its step per batch, leaves it at 3.53 with a step of 1e-3 and at 2.18 with 1e-2. A capacity
    # of 1.0 cuts the overload to 0.00 by dropping 35.9% of the assignments, leaves the lightest expert at
    # 0.22 and the losses as they were, since both losses are computed on the route before any drop.

    # Step: Hash routing and the most frequent ids
    top = np.bincount(ids, minlength=VOCAB)
    print()
    print(f"The 10 most frequent ids carry {np.sort(top)[::-1][:10].sum() / M:.0%} of the tokens.")

    # What to see: hash routing spreads the ids evenly, but the 10 most frequent ids carry 33% of the tokens,
    # and every token of one id goes to the same 4 experts: the worst overload is still 1.55. Both losses read
    # about 1 for it (0.992 and 1.001), as for an even batch, because they weigh each expert's load by the
    # router's scores, and the experts the hash overloads are not the ones the scores favor.

    # Step: The figure
    if figures_wanted(args.out):
        plot(rows, args.out)

    # What to see: the three score functions draw one line, and the capacity lines follow it except at the
    # top, where they are cut flat at 1 and 1.25: capacity trims the busiest experts and leaves the light ones
    # as light. The sign rule's lines keep the skewed shape, lowered at the top; Quantile Balancing's stays
    # closest to 1 from the busiest expert to the lightest.

    return rows


# %%
def plot(rows: list[dict], out: Path) -> None:
    """Sorted loads relative to q, one line per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for r in rows:
        ax.plot(np.arange(1, N + 1), r["sorted_load"], marker=".", label=r["router"])
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xlabel("experts, busiest first")
    ax.set_ylabel("load / q")
    ax.set_title("One batch, nine routers: expert loads (served assignments)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    show_figure(fig, out, "loads.png",
                caption="The same batch under nine routers, experts sorted busiest first: the flatter a line "
                        "stays near 1, the more evenly that router spreads its tokens.",
                alt="Line plot of load over q for the experts of one batch sorted busiest first, one line for"
                    " each of nine routers")


# %%
if __name__ == "__main__":
    main()
