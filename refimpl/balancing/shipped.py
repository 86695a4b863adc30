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

**The histogram modes, round two.** Two trainers now ship Appendix D itself:

4. **Megatron-Core's `estimation_scope="global_batch"`** (NVIDIA/Megatron-LM PR
   #6638, read at its head `fe35272`, 2026-08-19: `get_updated_expert_bias_with_quantile`
   and the histogram branch of `topk_routing_with_score_function` in
   `moe_utils.py`, `_update_router_qb_histogram` in `finalize_model_grads.py`,
   the router's buffers in `router.py`), computed here by `MegatronGlobalBatchQB`
   and `megatron_qb_update(..., estimation_scope="global_batch", num_bins=1000)`.
   Its conventions: an **added** bias `qb_bias` ($b$, not $\beta$) on the
   **sigmoid scores** (`torch.sigmoid(logits.float())`; the micro-batch mode
   subtracts $\beta$ from raw logits); an int32 histogram `[E, bins]` of
   `cutoff - score` **pooled** over micro-batches and summed over TP×DP×CP;
   the range $[\min b - 1, \max b + 1]$ kept as a buffer `qb_bin_bounds`
   (`[-1, 1]` at the start, recomputed from each new bias); the
   $\lceil mk/E \rceil$-th smallest required bias (Eq. 14 reads the
   $(q+1)$-th), interpolated at $(q - \text{before})/c$ in its bin; centred.
   It counts a forward only when `training and torch.is_grad_enabled() and
   not frozen_expert_bias`, and a frozen router is not updated. **On a step
   with nothing counted** it keeps the bias and the range
   (`torch.where(has_tokens, ...)`). Its histogram is a non-persistent buffer:
   a checkpoint holds `qb_bias` and `qb_bin_bounds`, not the counts of a step
   in progress. The tests of PR #6638's later commit `17c811a` are not in the
   store this module was written from; the head's are.
5. **torchtitan's `QuantileBalancer`** (pytorch/torchtitan PR #4577:
   `QuantileBalancedTopKRouter`, `QuantileBalancer` and
   `register_moe_quantile_balancing_hook`; read from the code index, which
   holds the file's text but not its commit, and which the newest stored
   snapshot of the repository, `b5bcd76`, does not yet contain), computed here
   by `TorchtitanQuantileBalancer` and `torchtitan_qb_update`. The same added
   bias on sigmoid scores, 1000 bins over $[\min b - 1, \max b + 1]$ recomputed
   from the bias at each forward, the $\lceil q \rceil$ rank, pooled, centred.
   It observes only when the module is in training mode (`self.training`;
   grad mode is not consulted). **On a step with nothing counted** its
   estimate divides the target bin's count into zero: $0/0$, and the bias it
   writes is NaN on every expert (measured in the tests).

Both read the $\lceil q\rceil$-th smallest required bias where Eq. (14) reads
the $(q+1)$-th. The two are neighbours in each column, so how far apart they
read depends on the batch: on Example 15's steps of 4,224 tokens both shipped
updates read within a bin of Eq. (14), as close as refimpl's own histogram, and
balance as well; on the lifecycle check's steps of 16 to 144 tokens they read
many bins away from it (`docs/measure_lifecycle.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .._lib.validation import check_bias, check_finite, check_float_array, check_int
from .._lib.values import is_integer, is_real, shown, switch_value
from .._lib.xp import Array, array_namespace, compute_dtype, is_array, to_numpy
from .quantile import cutoff_values, expert_major_margins, kth_largest

__all__ = [
    "MegatronGlobalBatchQB",
    "TorchtitanQuantileBalancer",
    "megatron_global_batch_update",
    "megatron_qb_update",
    "megatron_quantile",
    "torchtitan_estimate",
    "torchtitan_qb_update",
]


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


def megatron_qb_update(blocks: Iterable[Array] | Array, beta: Array, top_k: int, *, ema: float = 0.0,
                       estimation_scope: str = "micro_batch", num_bins: int = 1000) -> Array:
    r"""Megatron-Core's Quantile Balancing update: the next `qb_beta` `[n]`, in the subtracted sign.

    With `estimation_scope="global_batch"` it is the other mode instead: `blocks`
    are **sigmoid scores** `[m_i, n]` (Megatron-Core's `torch.sigmoid(logits.float())`),
    `beta` is its `qb_bias`, **added** to them, and the result is
    `MegatronGlobalBatchQB`'s next `qb_bias` from one histogram of `num_bins`
    bins pooled over every block (`ema` must be 0, as Megatron-Core requires).
    The rest of this paragraph is the micro-batch mode.

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
    if estimation_scope not in ("micro_batch", "global_batch"):
        raise ValueError(f"estimation_scope must be 'micro_batch' or 'global_batch', got {estimation_scope!r}")
    check_int("num_bins", num_bins, low=2)  # read by the global_batch mode only, refused in both when wrong
    if not blocks:
        raise ValueError("blocks must hold at least one micro-batch of logits")
    if not is_real(ema) or not 0.0 <= float(ema) <= 1.0:
        raise ValueError(f"ema must be a real number in [0, 1], got {ema!r}")
    if estimation_scope == "global_batch":
        if float(ema) != 0.0:
            raise ValueError(f"the global_batch mode derives the bias directly and needs ema=0, got {ema!r}")
        router = MegatronGlobalBatchQB(_FROM_BIAS, top_k, num_bins=num_bins, bias=beta)
        for block in blocks:
            router.route(block)
        router.finalize()
        return router.qb_bias.copy()
    quantiles = [megatron_quantile(block, beta, top_k) for block in blocks]  # B x [n]; checks beta and k too
    xp = array_namespace(beta)
    # $$\bar\beta = \frac1B \sum_b \beta^{\text{local}}_b$$ (the all-reduce AVG over data-parallel ranks)
    average = sum(quantiles[1:], quantiles[0]) / len(quantiles)  # [n]
    blended = float(ema) * xp.astype(beta, average.dtype) + (1.0 - float(ema)) * average  # [n]
    return blended - xp.mean(blended)


# ---------------------------------------------------------------------------
# The histogram modes: Megatron-Core's global_batch scope and torchtitan's QuantileBalancer
# ---------------------------------------------------------------------------

#: The `num_experts` this module's own update functions pass (`megatron_qb_update`, `torchtitan_qb_update`):
#: the experts are those of the `bias` they are given, whose length is checked there.
_FROM_BIAS = -1


def _checked_sizes(num_experts: int, top_k: int, num_bins: int, bias: Any) -> np.ndarray:
    """The sizes both histogram modes accept (0 < k < n, at least two bins), and the starting bias, float32 `[n]`.

    A `bias` must have `num_experts` entries: a bias of 4 for `num_experts=8` is refused, not taken as the
    number of experts. Only `num_experts=_FROM_BIAS` (-1, what this module's update functions pass) reads
    the number from the bias.
    """
    if bias is not None and is_integer(num_experts) and num_experts == _FROM_BIAS:
        check_bias(bias)
        num_experts = bias.shape[0]
    num_experts = check_int("num_experts", num_experts, low=2)
    check_int("top_k", top_k, low=1, high=num_experts - 1)
    check_int("num_bins", num_bins, low=2)
    if bias is None:
        return np.zeros(num_experts, dtype=np.float32)
    check_bias(bias, num_experts, context=f"(one entry per expert: num_experts={num_experts})")
    return _as_float32("bias", bias)


def _as_float32(name: str, values: Any) -> np.ndarray:
    """`values` as a float32 NumPy array, which must stay finite: a float64 beyond float32's range is refused
    (naming `name`), not made infinite."""
    with np.errstate(over="ignore"):
        held = np.array(to_numpy(values), dtype=np.float32)
    check_finite(name, held)
    return held


def _checked_counts(name: str, histogram: Any) -> np.ndarray:
    """A histogram of counts `[E, bins]`: a 2-D array of non-negative integers (what every rank adds up)."""
    counts = to_numpy(histogram) if is_array(histogram) else histogram
    if not isinstance(counts, np.ndarray) or counts.ndim != 2 or counts.dtype.kind not in "iu":
        what = (f"{counts.dtype} of shape {list(counts.shape)}" if isinstance(counts, np.ndarray)
                else f"{type(histogram).__name__} {shown(histogram)}")
        raise ValueError(f"{name} must be integer counts [E, bins] (one row of bins per expert), got {what}")
    if counts.size and int(counts.min()) < 0:
        raise ValueError(f"{name} must hold non-negative counts, got a smallest count of {int(counts.min())}")
    return counts


def _checked_bounds(name: str, bounds: Any, num_bins: int) -> np.ndarray:
    """The histogram's range `[2]` as float32: finite, low < high, and a bin width float32 can divide by."""
    check_float_array(name, bounds, ndim=1)
    if tuple(bounds.shape) != (2,):
        raise ValueError(f"{name} must have shape [2] (the low and the high end of the range), got "
                         f"{list(bounds.shape)}")
    held = _as_float32(name, bounds)
    lower, upper = held[0], held[1]
    with np.errstate(over="ignore", divide="ignore"):
        span = upper - lower
        scale = np.float32(num_bins) / span if span > 0 else np.float32(np.inf)
    if not (lower < upper and np.isfinite(span) and np.isfinite(scale)):
        raise ValueError(f"{name} must be a range (low, high) with low < high, whose width float32 holds and "
                         f"divides into {num_bins} bins, got ({float(lower):g}, {float(upper):g})")
    return held


def _checked_state(owner: str, state: Any, expected: tuple[str, ...]) -> None:
    """`state` must be a mapping with exactly the keys `expected`, as torch's `load_state_dict(strict=True)` requires."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{owner}.load_state_dict: state must be a dict of {list(expected)}, got "
                        f"{type(state).__name__}")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected), key=str)
    if missing or unexpected:
        raise ValueError(f"{owner}.load_state_dict: state must hold exactly the keys {list(expected)}; missing "
                         f"{missing}, unexpected {unexpected}")


def _checked_scores(scores: Any, n: int) -> np.ndarray:
    """A block of sigmoid scores `[m, n]`, as float32 (both trainers compute their scores in float32)."""
    check_float_array("scores", scores, ndim=2)
    if scores.shape[1] != n:
        raise ValueError(f"scores must have shape [m, {n}], got {list(scores.shape)}")
    check_finite("scores", scores)
    return np.asarray(scores, dtype=np.float32)


def _biased_cutoff(scores: np.ndarray, bias: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Biased top-(k+1), as both trainers take it: the k routed ids `[m, k]` and the cutoff `[m, 1]`, float32."""
    biased = scores + bias  # [m, n], float32
    order = np.argsort(-biased, axis=1, kind="stable")[:, : top_k + 1]  # [m, k+1]
    cutoff = np.take_along_axis(biased, order[:, top_k:], axis=1)  # [m, 1], the (k+1)-th biased score
    return order[:, :top_k], cutoff


def megatron_global_batch_update(histogram: Array, bin_bounds: Array, bias: Array,
                                 top_k: int) -> tuple[np.ndarray, np.ndarray]:
    r"""Megatron-Core's `get_updated_expert_bias_with_quantile`: the next `qb_bias` `[E]` and `qb_bin_bounds` `[2]`.

    From the pooled int32 `histogram` `[E, B]` of required biases
    $r = \alpha_i - s_{i,j}$ over the range `bin_bounds` $= (\ell, u)$, with
    $m$ the tokens counted, $q = mk/E$ (float32) and $t = \max(1, \lceil q
    \rceil)$: the first bin $h$ whose cumulative count reaches $t$, then
    $$\tilde b_j = \ell + \Bigl(h + \operatorname{clip}\bigl(\tfrac{q -
    \text{before}}{\max(c, 1)}, 0, 1\bigr)\Bigr) w, \qquad
    b = \tilde b - \operatorname{mean}(\tilde b),$$
    and the new range $[\min b - 1, \max b + 1]$. A histogram with no token
    returns the bias and the range unchanged. All in float32, as shipped.
    """
    counts = _checked_counts("histogram", histogram)
    num_experts, num_bins = counts.shape
    check_int("top_k", top_k, low=1, high=num_experts - 1)
    bounds = _checked_bounds("bin_bounds", bin_bounds, num_bins)
    check_bias(bias, num_experts, context=f"(one entry per expert of the histogram {list(counts.shape)})")
    old = _as_float32("bias", bias)
    cumulative = np.cumsum(counts, axis=1, dtype=np.int64)  # [E, B]
    total_tokens = cumulative[0, -1]  # every token adds one count to every expert's row
    # $$q = m k / E$$ in float32, and the rank $$t = \max(1, \lceil q \rceil)$$
    target_quantile = np.float32(total_tokens) * np.float32(top_k / num_experts)
    target_rank = max(1, int(math.ceil(target_quantile)))
    selected = np.argmax(cumulative >= target_rank, axis=1)  # [E], the first bin reaching the rank
    selected_counts = np.take_along_axis(counts, selected[:, None], axis=1)[:, 0]  # [E], c
    before = np.where(selected == 0, 0, np.take_along_axis(cumulative, np.maximum(selected - 1, 0)[:, None],
                                                           axis=1)[:, 0])  # [E]
    interpolation = np.clip((target_quantile - before.astype(np.float32))
                            / np.maximum(selected_counts, 1).astype(np.float32), 0.0, 1.0).astype(np.float32)
    lower, upper = bounds[0], bounds[1]
    width = (upper - lower) / np.float32(num_bins)
    new = lower + (selected.astype(np.float32) + interpolation) * width  # [E]
    new = (new - new.mean(dtype=np.float32)).astype(np.float32)
    if total_tokens == 0:  # torch.where(has_tokens, ...): nothing counted, nothing moves
        return old.copy(), bounds.copy()
    return new, np.array([new.min() - np.float32(1.0), new.max() + np.float32(1.0)], dtype=np.float32)


class MegatronGlobalBatchQB:
    r"""Megatron-Core's router in `estimation_scope="global_batch"`: its buffers and the two places that touch them.

    `qb_bias` `[E]` (float32, added to the sigmoid scores), `qb_histogram`
    `[E, B]` (int32, non-persistent), `qb_bin_bounds` `[2]` (float32, `[-1, 1]`
    at the start), and the switches `training` and `frozen_expert_bias`.
    `route(scores, grad_enabled=)` is the histogram branch of
    `topk_routing_with_score_function` (it counts only when `training and
    grad_enabled and not frozen_expert_bias`); `finalize(*other_ranks)` is
    `_update_router_qb_histogram` (the all-reduce is the sum of the ranks'
    histograms; a router not in training or frozen is skipped) followed by
    `reset_model_temporary_tensors`, which zeroes every histogram.
    `state_dict()` holds the persistent buffers only, as Megatron-Core's does.
    """

    def __init__(self, num_experts: int, top_k: int, *, num_bins: int = 1000, bias: Array | None = None) -> None:
        self.qb_bias = _checked_sizes(num_experts, top_k, num_bins, bias)  # [E]
        self.num_experts, self.top_k, self.num_bins = self.qb_bias.shape[0], top_k, num_bins
        self.qb_histogram = np.zeros((self.num_experts, num_bins), dtype=np.int32)  # [E, B]
        # The range of the bias it holds; [-1, 1] for the zero bias a router starts with.
        self.qb_bin_bounds = np.array([self.qb_bias.min() - np.float32(1.0), self.qb_bias.max() + np.float32(1.0)],
                                      dtype=np.float32)
        self.training = True
        self.frozen_expert_bias = False

    def route(self, scores: Array, *, grad_enabled: bool = True) -> np.ndarray:
        """Route one micro-batch of sigmoid scores `[m, E]` with `qb_bias`; count it when the switches allow. Ids `[m, k]`."""
        grad_enabled = switch_value(grad_enabled, "grad_enabled")
        counting = (switch_value(self.training, "MegatronGlobalBatchQB.training")
                    and not switch_value(self.frozen_expert_bias, "MegatronGlobalBatchQB.frozen_expert_bias"))
        s = _checked_scores(scores, self.num_experts)  # [m, E]
        top_indices, cutoff = _biased_cutoff(s, self.qb_bias, self.top_k)
        if counting and grad_enabled:
            lower, upper = self.qb_bin_bounds[0], self.qb_bin_bounds[1]
            # floor((cutoff - scores - lower) * (num_bins / (upper - lower))), clamped into the end bins
            scale = np.float32(self.num_bins) / (upper - lower)
            bins = np.floor((cutoff - s - lower) * scale).astype(np.int64)  # [m, E]
            np.clip(bins, 0, self.num_bins - 1, out=bins)
            flat = (bins + np.arange(self.num_experts, dtype=np.int64) * self.num_bins).reshape(-1)
            self.qb_histogram += np.bincount(flat, minlength=self.qb_histogram.size).reshape(
                self.qb_histogram.shape).astype(np.int32)
        return top_indices

    def finalize(self, *other_ranks: MegatronGlobalBatchQB) -> None:
        """The end of a global batch: pool the ranks' histograms, update the bias once, zero every histogram."""
        routers = (self, *other_ranks)
        if switch_value(self.training, "MegatronGlobalBatchQB.training") and \
                not switch_value(self.frozen_expert_bias, "MegatronGlobalBatchQB.frozen_expert_bias"):
            pooled = sum((r.qb_histogram.astype(np.int64) for r in routers[1:]), self.qb_histogram.astype(np.int64))
            new_bias, new_bounds = megatron_global_batch_update(pooled.astype(np.int32), self.qb_bin_bounds,
                                                                self.qb_bias, self.top_k)
            for router in routers:
                router.qb_bias, router.qb_bin_bounds = new_bias.copy(), new_bounds.copy()
        for router in routers:
            router.qb_histogram[...] = 0

    def state_dict(self) -> dict[str, np.ndarray]:
        """The persistent buffers, `qb_bias` and `qb_bin_bounds` (the histogram is registered `persistent=False`)."""
        return {"qb_bias": self.qb_bias.copy(), "qb_bin_bounds": self.qb_bin_bounds.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `qb_bias` `[E]` and `qb_bin_bounds` `[2]`, checked first, as torch's `strict=True` load checks.

        Exactly those two keys; each a floating array of its shape, finite in float32; the range with
        low < high. Anything else is a `ValueError` naming the key, and the router is left as it was
        (torch refuses a size mismatch or a missing key the same way, before copying anything).
        """
        _checked_state("MegatronGlobalBatchQB", state, ("qb_bias", "qb_bin_bounds"))
        check_bias(state["qb_bias"], self.num_experts, name="state['qb_bias']",
                   context=f"(one entry per expert: num_experts={self.num_experts})")
        bias = _as_float32("state['qb_bias'] in float32", state["qb_bias"])
        bounds = _checked_bounds("state['qb_bin_bounds']", state["qb_bin_bounds"], self.num_bins)
        self.qb_bias, self.qb_bin_bounds = bias, bounds


def torchtitan_estimate(histogram: Array, bias: Array, top_k: int) -> np.ndarray:
    r"""torchtitan's `QuantileBalancer.estimate_expert_bias`: the next centred bias `[E]` from a pooled histogram.

    With $q = c_j k / E$ (float32, $c_j$ the expert's count), $t = \lceil q
    \rceil$, $h$ the first bin whose cumulative count reaches $t$ and $c$ its
    count: $p_j = h + (q - \text{before})/c$ and $b = (p - \operatorname{mean}
    p)\, w$, $w = (\max b - \min b + 2)/B$. The division is unguarded, as
    shipped: a histogram with no token gives $0/0$ and a NaN bias.
    """
    counts = _checked_counts("histogram", histogram)
    num_experts, num_bins = counts.shape
    check_int("top_k", top_k, low=1, high=num_experts - 1)
    check_bias(bias, num_experts, context=f"(one entry per expert of the histogram {list(counts.shape)})")
    old = _as_float32("bias", bias)
    counts_e = counts.sum(axis=-1, dtype=np.int64)  # [E]
    target_count = counts_e.astype(np.float32) * np.float32(top_k / num_experts)  # [E]
    cumulative = np.cumsum(counts, axis=-1, dtype=np.int64)  # [E, B]
    target_rank = np.ceil(target_count).astype(np.int64)  # [E]
    target_bin = (cumulative < target_rank[:, None]).sum(axis=-1)  # [E]
    in_bin = np.take_along_axis(counts, target_bin[:, None], axis=-1)[:, 0]  # [E]
    before = np.take_along_axis(cumulative, target_bin[:, None], axis=-1)[:, 0] - in_bin  # [E]
    with np.errstate(invalid="ignore", divide="ignore"):  # 0/0 on an empty histogram, as shipped
        fraction = (target_count - before.astype(np.float32)) / in_bin.astype(np.float32)
    width = (old.max() - old.min() + np.float32(2.0)) / np.float32(num_bins)
    position = target_bin.astype(np.float32) + fraction  # [E]
    return ((position - position.mean(dtype=np.float32)) * width).astype(np.float32)


class TorchtitanQuantileBalancer:
    r"""torchtitan's `QuantileBalancedTopKRouter` and `QuantileBalancer`, with the optimizer hook that reads them.

    `expert_bias` `[E]` (float32, the MoE's `expert_bias_E`),
    `required_bias_histogram` `[E, B]` (int32, non-persistent) and `training`.
    `route(scores)` takes the biased top-(k+1) and, in training mode only,
    `observe`s the micro-batch: bins of width $(\max b - \min b + 2)/B$ from
    $\min b - 1$, clamped into the end bins. `step(*other_ranks)` is the
    optimizer's pre-hook: the histograms summed over the ranks (the
    all-reduce), `torchtitan_estimate` copied into the bias, every histogram
    zeroed. It has no frozen switch. `state_dict()` holds the bias only.
    """

    def __init__(self, num_experts: int, top_k: int, *, num_bins: int = 1000, bias: Array | None = None) -> None:
        self.expert_bias = _checked_sizes(num_experts, top_k, num_bins, bias)  # [E]
        self.num_experts, self.top_k, self.num_bins = self.expert_bias.shape[0], top_k, num_bins
        self.required_bias_histogram = np.zeros((self.num_experts, num_bins), dtype=np.int32)  # [E, B]
        self.training = True

    def route(self, scores: Array) -> np.ndarray:
        """Route one micro-batch of sigmoid scores `[m, E]`; observe it in training mode. Ids `[m, k]`."""
        s = _checked_scores(scores, self.num_experts)
        top_indices, cutoff = _biased_cutoff(s, self.expert_bias, self.top_k)
        self.observe(s, cutoff)
        return top_indices

    def observe(self, scores: np.ndarray, cutoff: np.ndarray) -> None:
        """Add one micro-batch's required biases `cutoff - scores` to the histogram (nothing outside training)."""
        if not switch_value(self.training, "TorchtitanQuantileBalancer.training"):
            return
        b = self.expert_bias
        lower_bound = b.min() - np.float32(1.0)
        bin_width = (b.max() - b.min() + np.float32(2.0)) / np.float32(self.num_bins)
        required_bias = cutoff - scores  # [m, E]
        bins = np.floor((required_bias - lower_bound) / bin_width).astype(np.int64)
        np.clip(bins, 0, self.num_bins - 1, out=bins)
        flat = (bins + np.arange(self.num_experts, dtype=np.int64) * self.num_bins).reshape(-1)
        self.required_bias_histogram += np.bincount(flat, minlength=self.required_bias_histogram.size).reshape(
            self.required_bias_histogram.shape).astype(np.int32)

    def step(self, *other_ranks: TorchtitanQuantileBalancer) -> None:
        """The optimizer's pre-hook: pool the ranks' histograms, write the estimate into the bias, zero them."""
        balancers = (self, *other_ranks)
        pooled = sum((b.required_bias_histogram.astype(np.int64) for b in balancers[1:]),
                     self.required_bias_histogram.astype(np.int64))
        new = torchtitan_estimate(pooled, self.expert_bias, self.top_k)
        for balancer in balancers:
            balancer.expert_bias = new.copy()
            balancer.required_bias_histogram[...] = 0

    def state_dict(self) -> dict[str, np.ndarray]:
        """The bias; the histogram is registered `persistent=False`."""
        return {"expert_bias_E": self.expert_bias.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `expert_bias_E` `[E]`, checked first: the one key, a finite floating array of the experts' size.

        Anything else is a `ValueError` naming the key, and the balancer is left as it was (as torch's
        `strict=True` load refuses a size mismatch or a missing key).
        """
        _checked_state("TorchtitanQuantileBalancer", state, ("expert_bias_E",))
        check_bias(state["expert_bias_E"], self.num_experts, name="state['expert_bias_E']",
                   context=f"(one entry per expert: num_experts={self.num_experts})")
        bias = _as_float32("state['expert_bias_E'] in float32", state["expert_bias_E"])
        self.expert_bias = bias


def torchtitan_qb_update(blocks: Iterable[Array] | Array, bias: Array, top_k: int, *,
                         num_bins: int = 1000) -> np.ndarray:
    """torchtitan's next bias `[E]` from one step whose micro-batches of sigmoid scores are `blocks` (NaN when all are empty)."""
    balancer = TorchtitanQuantileBalancer(_FROM_BIAS, top_k, num_bins=num_bins, bias=bias)
    for block in [blocks] if is_array(blocks) else list(blocks):
        balancer.route(block)
    balancer.step()
    return balancer.expert_bias.copy()
