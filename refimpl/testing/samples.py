r"""Sample implementations: the layer's pieces written the way a port writes them, for the kit to check.

A conformance kit is easiest to trust when one has seen it pass correct code
that was not written by the same hand as the reference, and fail code that
is wrong in the ways real ports are. This module is that correct code. None
of it calls the reference implementation: it is written as a production
port would be, in float32 NumPy, with full sorts where the reference uses
partitions, `np.add.at` where it uses a segment sum, and a forward pass
whose routed experts are split over two "ranks" that add their partial sums
before the norm:

* `router(scores, bias, top_k)`: Eq. (13), the top-$k$ of $s + b$ with ties to
  the lower id, weights from the raw scores;
* `qb_update(scores, bias, top_k)`: Eq. (14), the exact update from a full
  sort of each column (`kth_largest_interpolated`);
* `histogram_update(blocks, bias, top_k)`: Appendix D, counts block by block,
  then the rank $q + 1$ read per expert;
* `make_balancer(initial_bias, top_k)`: a balancer that routes each batch
  with the bias it held before the batch, then updates it;
* `forward(x, params, config)`: the whole layer, experts on two ranks.

[Example 30](../examples/30_test_your_router.md) runs each through its check
of the kit (and adds a PyTorch router behind an adapter);
[example 31](../examples/31_mistakes_the_kit_catches.md) breaks them in one
line each and shows the reports. Some functions take an extra keyword
(`rank_offset`, `norm_before_reduce`) that only those mistakes use.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Balancer", "forward", "histogram_update", "kth_largest_interpolated", "make_balancer", "qb_update",
           "rms_norm", "router", "situ_glu"]

# ---------------------------------------------------------------------------
# Eq. (13): the router
# ---------------------------------------------------------------------------

def router(scores: np.ndarray, bias: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of s + b in float32 (ties to the lower id), weights from the raw scores."""
    s = scores.astype(np.float32)
    biased = s + bias.astype(np.float32)  # [m, n]
    # A stable sort of -biased keeps the lower id first among equal scores.
    index = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]  # [m, k]
    raw = np.take_along_axis(s, index, axis=1)  # [m, k]
    return index, raw / raw.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------
# Eq. (14): the exact update, written with a full sort of each column
# ---------------------------------------------------------------------------


def kth_largest_interpolated(columns: np.ndarray, rank: float) -> np.ndarray:
    """Per column, the `rank`-th largest value (1-based), linear between neighbours for a fractional rank."""
    ordered = -np.sort(-columns, axis=0)  # [m, n], descending
    whole = int(np.floor(rank))
    frac = rank - whole
    value = ordered[whole - 1]
    if frac > 0:
        value = value + frac * (ordered[whole] - ordered[whole - 1])
    return value


def qb_update(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Eq. (14): -(the (q+1)-th largest margin) per expert, centred."""
    s = scores.astype(np.float64)
    m, n = s.shape
    biased = s + bias.astype(np.float64)  # [m, n]
    alpha = -np.sort(-biased, axis=1)[:, top_k]  # [m], the (k+1)-th largest
    margin = s - alpha[:, None]  # [m, n]
    q = m * top_k / n
    b_tilde = -kth_largest_interpolated(margin, q + 1)  # [n]
    return (b_tilde - b_tilde.mean()).astype(np.float32)


# ---------------------------------------------------------------------------
# Appendix D: the histogram estimator
# ---------------------------------------------------------------------------


def histogram_update(blocks: list[np.ndarray], bias: np.ndarray, top_k: int, bins: int = 1000,
                     rank_offset: int = 1) -> np.ndarray:
    """Count r = alpha - s into [n, B] bins block by block, then read rank q + 1 per expert.

    `rank_offset` is 1 for the rank q + 1 of Eq. (14); the mistakes example
    sets it to 0.
    """
    b = bias.astype(np.float64)
    n = b.shape[0]
    low, high = b.min() - 1.0, b.max() + 1.0
    width = (high - low) / bins
    counts = np.zeros((n, bins), dtype=np.int64)
    for block in blocks:  # one per rank and micro-batch; no communication until the end
        s = block.astype(np.float64)
        if s.shape[0] == 0:
            continue
        alpha = -np.sort(-(s + b), axis=1)[:, top_k]  # [m_i]
        r = alpha[:, None] - s  # [m_i, n]
        cell = np.clip(((r - low) / width).astype(np.int64), 0, bins - 1)  # [m_i, n]
        np.add.at(counts, (np.broadcast_to(np.arange(n), cell.shape), cell), 1)
    # The all-reduce would sum `counts` over ranks here.
    m = int(counts[0].sum())
    cumulative = np.cumsum(counts, axis=1)  # [n, B]

    def read(rank: int) -> np.ndarray:
        beta = (cumulative < rank).sum(axis=1)  # [n], first bin reaching the rank
        inside = counts[np.arange(n), beta]
        before = cumulative[np.arange(n), beta] - inside
        return low + (beta + (rank - before - 0.5) / inside) * width

    q_floor, remainder = divmod(m * top_k, n)
    b_tilde = read(min(max(q_floor + rank_offset, 1), m))
    if remainder:
        f = remainder / n
        b_tilde = (1 - f) * b_tilde + f * read(min(q_floor + rank_offset + 1, m))
    return (b_tilde - b_tilde.mean()).astype(np.float32)


# ---------------------------------------------------------------------------
# Eq. (14) step 4: the balancer
# ---------------------------------------------------------------------------


class Balancer:
    """Holds the bias between steps: route the batch with it, then update it for the next batch."""

    def __init__(self, initial_bias: np.ndarray, top_k: int):
        self.bias = initial_bias.astype(np.float32)
        self.top_k = top_k

    def step(self, scores: np.ndarray) -> np.ndarray:
        index, _ = router(scores, self.bias, self.top_k)  # routed with the bias held BEFORE this batch
        self.bias = qb_update(scores, self.bias, self.top_k)  # ... which then moves, for the next batch
        return index


def make_balancer(initial_bias: np.ndarray, top_k: int):
    """The factory `check_balancer` calls: a fresh balancer's `step`."""
    return Balancer(initial_bias, top_k).step


# ---------------------------------------------------------------------------
# Eq. (11): the forward pass, experts split over two ranks
# ---------------------------------------------------------------------------


def situ_glu(a: np.ndarray, b: np.ndarray, beta1: float, beta2: float) -> np.ndarray:
    return beta1 * np.tanh(a / beta1) / (1.0 + np.exp(-a)) * (beta2 * np.tanh(b / beta2))


def rms_norm(u: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return u / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + eps) * gain


def forward(x: np.ndarray, params: dict, config, *, ranks: int = 2, norm_before_reduce: bool = False) -> np.ndarray:
    """One Stable LatentMoE layer in float32, its routed experts split over `ranks` ranks.

    Each rank sums the contributions of its own experts into a partial latent
    sum; the partial sums are added (the all-reduce) and only then
    normalized. `norm_before_reduce=True` is the mistake of normalizing each
    partial sum. Supports K3's switches (SiTU-GLU, latent norm on).
    """
    p = {name: np.asarray(value, dtype=np.float32) for name, value in params.items()}
    h = np.asarray(x, dtype=np.float32)  # [m, d]
    n, beta1, beta2 = config.num_experts, config.situ_beta, config.situ_linear_beta
    scores = 1.0 / (1.0 + np.exp(-(h @ p["gate.weight"].T)))  # [m, n]
    index, weights = router(scores, p["gate.e_score_correction_bias"], config.top_k)  # [m, k]
    weights = weights * config.routed_scaling_factor
    z = h @ p["routed_expert_down_proj.weight"].T  # [m, l]
    owner = np.arange(n) * ranks // n  # the rank that holds each expert
    partial = []
    for rank in range(ranks):
        u_rank = np.zeros_like(z)  # [m, l]
        for e in np.flatnonzero(owner == rank):
            rows, slots = np.nonzero(index == e)  # the tokens routed to expert e
            hidden = situ_glu(z[rows] @ p["experts.w1"][e].T, z[rows] @ p["experts.w3"][e].T, beta1, beta2)
            u_rank[rows] += weights[rows, slots, None] * (hidden @ p["experts.w2"][e].T)
        partial.append(u_rank)
    gain, up, eps = p["routed_expert_norm.weight"], p["routed_expert_up_proj.weight"], config.rms_norm_eps
    if norm_before_reduce:
        y_routed = sum(rms_norm(u_rank, gain, eps) for u_rank in partial) @ up.T
    else:
        u = sum(partial)  # the all-reduce of the partial sums, before the norm
        y_routed = rms_norm(u, gain, eps) @ up.T  # [m, d]
    shared = situ_glu(h @ p["shared_experts.gate_proj.weight"].T, h @ p["shared_experts.up_proj.weight"].T,
                      beta1, beta2) @ p["shared_experts.down_proj.weight"].T  # [m, d]
    return (shared + y_routed).astype(x.dtype)
