r"""Quantile Balancing as other code ships it: the sign of the bias, Megatron-Core's update, a fixed histogram range.

Eq. (14) can be written down in more than one way that a port may copy, and
three of them differ from the report's in ways that change the numbers:

1. **The sign of the bias.** The report adds its bias, $\mathcal T_i =
   \operatorname{argtopk}(s_i + b)$; the dual of Appendix C subtracts its
   variable, $s_i - \beta$, so $b = -\beta$. Megatron-Core keeps $\beta$
   (`qb_beta`) and selects from `scores - beta`. The two are the same rule as
   long as each is read in its own sign; a port that hands one to code written
   for the other routes every token with the bias reversed, and the loads run
   away instead of settling (Example 15 measures it).
2. **Megatron-Core's update** (`qb_dual_update` in
   `megatron/core/transformer/moe/moe_utils.py` and `_update_router_qb_beta` in
   `megatron/core/distributed/finalize_model_grads.py`, NVIDIA/Megatron-LM at
   commit `d98e8a6`, 2026-08-22, and the release megatron-core 0.19.2, which
   needs Python 3.12), computed here by `megatron_qb_update`:
    * it reads the router's **raw logits**, not the sigmoid scores: its bias
      lives in the logits' units, and so does its selection
      (`(logits - beta).topk(k)`);
    * it asserts that $mk/n$ is a **whole number** in every micro-batch, and
      reads the $(mk/n + 1)$-th largest margin (Eq. 14 interpolates a
      fractional $q$);
    * it takes one quantile **per micro-batch**, averages them over the
      micro-batches and the data-parallel ranks, and centres the average
      (with an optional moving average, `moe_router_quantile_balancing_ema`),
      where Eq. (14) and Appendix D read one quantile of the pooled batch.
3. **A fixed histogram range.** Appendix D bins $[\min b - 1, \max b + 1]$
   into $B = 1000$ bins. torchtitan's K3 balancer (`pytorch/torchtitan` at
   `7eb2dcb`, `torchtitan/models/kimi_k3/quantile_balance.py`) bins the fixed
   range $[-1, 1]$ into 512, clamping margins outside it into the end bins.
   `histogram_balancing_update(..., bins=512, value_range=(-1.0, 1.0))` bins
   the same way; inside the bin it reads the $(q+1)$-th largest margin, where
   torchtitan reads the point at which the cumulative fraction reaches
   $1 - k/n$, so the two agree to within two bin widths. A threshold beyond $\pm 1$, which a bias far from zero
   calls for, is read at the edge by both.

With one micro-batch, scores for logits and a whole $mk/n$,
`megatron_qb_update([s], -b, k)` is $-$`quantile_balancing_update(s, b, k)`
exactly: the same order statistic in the other sign. The kit's update checks
name each of these when a port's update reproduces it.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._lib.validation import check_bias, check_finite, check_float_array, check_int
from .._lib.values import is_real
from .._lib.xp import Array, array_namespace, compute_dtype, is_array
from .quantile import cutoff_values, expert_major_margins, kth_largest

__all__ = ["megatron_qb_update", "megatron_quantile"]


def megatron_quantile(logits: Array, beta: Array, top_k: int) -> Array:
    r"""One micro-batch's column quantile, as Megatron-Core's `qb_dual_update` returns it, `[n]`.

    With $\alpha_i$ the $(k+1)$-th largest of $z_i - \beta$ (token $i$'s
    cutoff, in the subtracted sign) and $q = mk/n$, a whole number:
    $$\beta^{\text{local}}_j = \text{the } (q+1)\text{-th largest of } z_{i,j} - \alpha_i \text{ over } i.$$
    `logits` is `[m, n]` (raw logits in Megatron-Core; any scores here),
    `beta` `[n]` the subtracted bias. A fractional $mk/n$ is a `ValueError`,
    as Megatron-Core's assertion is.
    """
    check_float_array("logits", logits, ndim=2)
    check_bias(beta, logits.shape[1], context=f"to match logits {list(logits.shape)}", name="beta")
    m, n = logits.shape
    top_k = check_int("top_k", top_k, low=1, high=n - 1)
    check_finite("logits", logits)
    check_finite("beta", beta)
    if (m * top_k) % n:
        raise ValueError(f"Megatron-Core's quantile needs m*k/n to be a whole number in every micro-batch, got "
                         f"m={m}, k={top_k}, n={n}: m*k/n = {m * top_k / n:.6g}")
    q = m * top_k // n
    if q + 1 > m:
        raise ValueError(f"a micro-batch of m={m} tokens has no ({q + 1})-th largest margin (q = m*k/n = {q})")
    xp = array_namespace(logits, beta)
    # $$\alpha_i = (z_i - \beta)_{(k+1)}$$: the same values as the cutoff with the added bias $b = -\beta$.
    alpha = cutoff_values(logits, -beta, top_k)  # [m]
    margins_t = expert_major_margins(logits, xp.astype(alpha, compute_dtype(xp, logits, beta)))  # [n, m]
    # $$\beta^{\text{local}}_j = (z_{:,j} - \alpha)_{(q+1)}$$
    return kth_largest(margins_t, q + 1, overwrite=True)  # [n]


def megatron_qb_update(blocks: Iterable[Array] | Array, beta: Array, top_k: int, *, ema: float = 0.0) -> Array:
    r"""Megatron-Core's Quantile Balancing update: the next `qb_beta` `[n]`, in the subtracted sign.

    `blocks` are the micro-batches' logits `[m_i, n]` of every data-parallel
    rank, each rank with the same number of micro-batches as in Megatron-Core's
    training loop (a single `[m, n]` array is one block), `beta` the current `qb_beta`,
    `ema` the moving-average coefficient (`moe_router_quantile_balancing_ema`,
    default 0: no memory). Each block gives `megatron_quantile`; then
    $$\bar\beta = \tfrac1B \textstyle\sum_b \beta^{\text{local}}_b, \qquad
    \beta' = \text{ema}\,\beta + (1 - \text{ema})\,\bar\beta, \qquad
    \beta^{\text{new}} = \beta' - \operatorname{mean}(\beta').$$
    The caller routes the next batch with `(logits - beta_new).topk(k)`.
    """
    if is_array(blocks):
        blocks = [blocks]
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks must hold at least one micro-batch of logits")
    if not is_real(ema) or not 0.0 <= float(ema) <= 1.0:
        raise ValueError(f"ema must be a real number in [0, 1], got {ema!r}")
    quantiles = [megatron_quantile(block, beta, top_k) for block in blocks]  # B x [n]; checks beta and k too
    xp = array_namespace(beta)
    # $$\bar\beta = \frac1B \sum_b \beta^{\text{local}}_b$$ (the all-reduce AVG over data-parallel ranks)
    average = sum(quantiles[1:], quantiles[0]) / len(quantiles)  # [n]
    blended = float(ema) * xp.astype(beta, average.dtype) + (1.0 - float(ema)) * average  # [n]
    return blended - xp.mean(blended)
