r"""Eq. (13): sigmoid scores, biased selection, raw-score weights.

$$
s_{i,j} = \sigma(x_i \cdot W_r[j]),
\qquad
\mathcal{T}_i = \operatorname{argtopk}_k\,(s_i + b),
\qquad
p_{i,j} = \frac{s_{i,j}}{\sum_{r \in \mathcal{T}_i} s_{i,r}} \quad (j \in \mathcal{T}_i).
$$

The router of a K3 layer scores every expert on the **full-width** input
$x_i$ (not on the latent) with a sigmoid, so each score lies in $(0, 1)$ and
does not compete with the others as a softmax would.

The **bias** $b \in \mathbb{R}^n$ (`e_score_correction_bias` in the checkpoint)
is the load-balancing knob. It takes part in *selection only*: the top-$k$ is
taken over $s_i + b$, but the mixture weights $p_{i,j}$ use the **raw** scores
$s_{i,j}$, renormalized over the chosen set and then multiplied by the routed
scaling factor (1.0 in K3). The bias therefore decides which experts a token
visits and never how much each contributes; it carries no gradient from the
language-model loss. Quantile Balancing (Eq. 14) is what sets it.

**Other score functions.** The systems K3 is compared with map the logits
$z = x W_r^\top$ to scores differently, and `router_scores` computes each of
them: the softmax of Switch Transformer and of the `sparse_moe` teaching
sketch (the experts compete for one unit of probability), and DeepSeek-V4's
$\sqrt{\operatorname{softplus}(z)}$ (positive and unbounded, written so that it
stays finite and exact at $z = \pm 80$). Selection and weights then follow the
same rule as above; with a softmax and `renormalize=True` the weights are
$e^{z_j} / \sum_{r \in \mathcal{T}_i} e^{z_r}$, the softmax over the chosen
logits, as in the sketch. The page "The other routers and balancers"
(`baselines`) puts these rules side by side.

**A layer's selection.** Step 2 of a layer with its switches (the other
systems' hash routing and capacity) is `refimpl.layer.selection.select_experts`,
which calls `route` for K3 and nothing else.

Pitfalls this module guards against, each a bug seen in real routers:

* **Weights from biased scores.** Using $s + b$ in $p$ leaks the balancer into
  the forward pass. Here the weights are gathered from `scores`, never from the
  biased array.
* **Tie order.** `torch.topk` leaves the order of equal values unspecified, so
  two implementations can disagree on a tie. This module resolves ties to the
  **lower expert id**, always, on every backend.
* **A low-precision bias.** The bias drifts far from zero during training. In
  bfloat16 (8 significant bits) values near, say, 10 are spaced 0.0625 apart,
  coarser than the score differences they must separate, so hundreds of
  distinct biases collapse onto a few and most tokens' top-$k$ changes. The
  biased scores here are formed in float32 or wider, and a bias in a half
  dtype is rejected. Mean-centering the bias (which changes no top-$k$) also
  keeps it near zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._lib.fast import matmul
from .._lib.validation import check_bias, check_finite, check_float_array, check_int, check_positive
from .._lib.values import switch_value
from .._lib.xp import (
    Array,
    array_namespace,
    bincount,
    compute_dtype,
    dtype_name,
    is_array,
    is_real_floating,
    topk,
)
from ..config import SCORE_FUNCTIONS
from .activations import sigmoid

__all__ = [
    "SCORE_FUNCTIONS",
    "biased_scores",
    "expert_load",
    "mixture_weights",
    "route",
    "router_scores",
    "score_function_grad",
    "score_function_values",
    "score_function_vjp",
    "selection_cutoff",
    "softmax",
    "softplus",
    "weighting",
]


# ---------------------------------------------------------------------------
# Eq. (13): the route, and what it is made of
# ---------------------------------------------------------------------------

def route(scores: Array, bias: Array, top_k: int, *, renormalize: bool = True,
          scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1) -> tuple[Array, Array]:
    r"""Eq. (13): choose `top_k` experts per token by $s + b$, weight them by raw $s$.

    Parameters
    ----------
    scores
        `[m, n]` sigmoid router scores $s$ (see `router_scores`).
    bias
        `[n]` selection bias $b$, float32 or float64.
    top_k
        $k$, experts per token, `1 <= top_k <= n`.
    renormalize
        Divide the $k$ raw scores of a token by their sum (K3: true).
    scaling_factor
        Multiply the weights by this (K3: 1.0).
    n_group, topk_group
        Optional group-limited routing: split the experts into `n_group` equal
        groups and select only from the best `topk_group` (K3: one group).

    Returns
    -------
    index
        `[m, k]` integer expert ids, ordered by biased score descending,
        ties to the lower id.
    weights
        `[m, k]` mixture weights $p_{i,j}$ from the raw scores, in the dtype of
        the biased scores (float32 or float64).
    """
    _check_scores_and_bias(scores, bias)
    m, n = scores.shape
    top_k = check_int("top_k", top_k, low=1, high=n)
    renormalize, scaling_factor = weighting(renormalize, scaling_factor)
    if renormalize:
        # Renormalized weights are shares of the chosen scores' sum: a negative score is no score (sigmoid,
        # softmax and sqrt-softplus give none), and a sum near 0 makes the shares huge (+-5000 from -0.4999).
        # Without renormalizing, p = c s is what the formula says; the testing kit's mistakes select by
        # logits that way.
        _check_nonnegative("scores", scores, "router scores: sigmoid, softmax and sqrtsoftplus give no negative "
                           "value")
    n_group = check_int("n_group", n_group, low=1, high=n)
    topk_group = check_int("topk_group", topk_group, low=1, high=n_group)
    if n % n_group:
        raise ValueError(f"n_group must divide the number of experts {n}, got {n_group}")
    # Group-limited routing can only reach the experts of `topk_group` groups;
    # asking for more would silently pick masked-out experts.
    reachable = topk_group * (n // n_group)
    if top_k > reachable:
        raise ValueError(
            f"top_k must be <= topk_group * n / n_group = {topk_group} * {n // n_group} = {reachable} "
            f"(the experts group-limited routing can reach), got top_k={top_k}")
    xp = array_namespace(scores, bias)
    # Selection uses the biased scores: $$\mathcal{T}_i = \operatorname{argtopk}_k(s_i + b)$$
    biased = biased_scores(scores, bias)  # [m, n]
    if n_group > 1:
        biased = _group_limited(biased, n_group, topk_group)
    _, index = topk(biased, top_k)  # [m, k]
    # The weights use the raw scores of the chosen experts, never the biased ones.
    raw = xp.take_along_axis(xp.astype(scores, biased.dtype), index, axis=-1)  # [m, k]
    return index, mixture_weights(raw, renormalize=renormalize, scaling_factor=scaling_factor)


def router_scores(x: Array, router_weight: Array, score_function: str = "sigmoid") -> Array:
    r"""Router scores $s = \sigma(x W_r^\top)$, `[m, n]`, in float32 or wider.

    `x` is `[m, d]` and `router_weight` ($W_r$, HF `gate.weight`) is `[n, d]`.
    The product is formed in float32 whatever the input dtype (float64 stays
    float64), as the K3 code does. `score_function` chooses the map from
    logits to scores: `"sigmoid"` (K3), `"softmax"` or `"sqrtsoftplus"`
    (see `score_function_values`).
    """
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    check_float_array("x", x, ndim=2)
    check_float_array("router_weight", router_weight, ndim=2)
    if router_weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"router_weight must have shape [n, {x.shape[1]}] to match x of width {x.shape[1]}, "
            f"got {list(router_weight.shape)}")
    xp = array_namespace(x, router_weight)
    dtype = compute_dtype(xp, x, router_weight)
    # $$z_{i,j} = x_i \cdot W_r[j]$$
    logits = matmul(xp.astype(x, dtype, copy=False), xp.astype(router_weight, dtype, copy=False).T)  # [m, n]
    # $$s_{i,j} = \sigma(z_{i,j})$$ (or softmax, or $\sqrt{\operatorname{softplus}}$)
    return score_function_values(logits, score_function)


def biased_scores(scores: Array, bias: Array) -> Array:
    r"""The selection scores $s_i + b$, `[m, n]`, formed in float32 or wider."""
    _check_scores_and_bias(scores, bias)
    xp = array_namespace(scores, bias)
    dtype = compute_dtype(xp, scores, bias)
    return xp.astype(scores, dtype) + xp.astype(bias, dtype)[None, :]


def mixture_weights(raw: Array, *, renormalize: bool = True, scaling_factor: float = 1.0) -> Array:
    r"""The mixture weights from the raw scores $\hat s$ `[m, k]` of each token's chosen experts.

    $$p_{i,r} = c\,\frac{\hat s_{i,r}}{\sum_{r'} \hat s_{i,r'}}$$ with `renormalize`, else
    $p_{i,r} = c\,\hat s_{i,r}$; $c$ is the scaling factor. Whatever rule chose
    the experts (the biased top-$k$, a hash), this is how they are weighed.
    Renormalizing scores that all underflowed to 0 (a sigmoid below $-103$ in
    float32, a $\sqrt{\operatorname{softplus}}$ below $-104$) would divide 0
    by 0 and let NaN flow into the layer: that is a `ValueError`.

    `raw` must be a `[m, k]` real floating array of finite scores, $\ge 0$ to
    be renormalized (what every score function gives): a `TypeError` or
    `ValueError` naming `raw` otherwise, since a NaN or an infinity would come
    out as NaN weights blamed on another argument, and a negative score as
    shares of a sum near 0, far outside $[0, c]$.
    """
    renormalize, scaling_factor = weighting(renormalize, scaling_factor)
    check_float_array("raw", raw, ndim=2)
    check_finite("raw", raw)
    xp = array_namespace(raw)
    if renormalize:
        _check_nonnegative("raw", raw, "the scores of each token's chosen experts")
        with np.errstate(over="ignore"):  # an overflow is refused below, by name
            total = xp.sum(raw, axis=-1, keepdims=True)  # [m, 1]
        if raw.shape[0] and not bool(xp.all(total > 0)):
            raise ValueError("scores of the chosen experts must have a positive sum for every token to be "
                             "renormalized, got a sum of 0 for "
                             f"{int(xp.sum(xp.astype(~(total > 0), xp.int64)))} token(s) (the scores underflowed)")
        if raw.shape[0] and not bool(xp.all(xp.isfinite(total))):
            raise ValueError(f"raw must have a sum within {dtype_name(raw.dtype)}'s range for every token to be "
                             "renormalized, got an infinite sum for "
                             f"{int(xp.sum(xp.astype(~xp.isfinite(total), xp.int64)))} token(s)")
    with np.errstate(over="ignore"):  # an overflow is refused below, by name
        # $$p_{i,r} = c\,\hat s_{i,r} / \textstyle\sum_{r'} \hat s_{i,r'}$$ (or $c\,\hat s_{i,r}$)
        weights = raw / total * scaling_factor if renormalize else raw * scaling_factor  # [m, k]
    if raw.shape[0] and not bool(xp.all(xp.isfinite(weights))):
        raise ValueError(f"scaling_factor must keep the weights within {dtype_name(weights.dtype)}'s range, got "
                         f"{scaling_factor:g}, which makes some weights infinite (the weights are computed in "
                         "the scores' dtype)")
    return weights


def weighting(renormalize: Any, scaling_factor: Any) -> tuple[bool, float]:
    """How every router weighs its chosen experts, checked once for all of them: `(renormalize, scaling_factor)`.

    `route`, `route_by_hash`, `route_by_table` and `mixture_weights` (and the backward of the weights) take
    the same two options and check them here, so that no router accepts what another refuses:
    `renormalize` must be a real boolean (the string "false" is not false, it is refused), and
    `scaling_factor` a positive finite real (NaN, infinity, 0 and negative factors are refused by name).
    """
    return switch_value(renormalize, "renormalize"), check_positive("scaling_factor", scaling_factor)


def selection_cutoff(scores: Array, bias: Array, top_k: int) -> tuple[Array, Array]:
    r"""The top-$k$ route and each token's cutoff $\alpha_i$, from one top-$(k+1)$ of $s + b$.

    $\alpha_i$ is the $(k+1)$-th largest biased score of token $i$: an expert
    $j$ outside the route enters it exactly when $s_{i,j} + b_j$ rises above
    $\alpha_i$. This is the first step of Quantile Balancing (Eq. 14) and of
    the histogram estimator (Appendix D).

    Returns `index` `[m, k]` (the same route as `route`) and `alpha` `[m]`, in
    the dtype of the biased scores. Needs `top_k < n`: with $k = n$ every
    expert is always chosen and no cutoff exists.
    """
    _check_scores_and_bias(scores, bias)
    n = scores.shape[1]
    top_k = check_int("top_k", top_k, low=1)
    if top_k >= n:
        raise ValueError(
            f"top_k must be < n={n} for a cutoff to exist (the (k+1)-th score), got top_k={top_k}")
    biased = biased_scores(scores, bias)  # [m, n]
    # $$\alpha_i = (k{+}1)\text{-th largest of } s_i + b$$
    values, index = topk(biased, top_k + 1)  # [m, k+1]
    return index[:, :top_k], values[:, top_k]


def expert_load(index: Array, n: int) -> Array:
    """Tokens routed to each expert: `[n]` integer counts of the ids in `index` (any shape)."""
    if not is_array(index):
        raise TypeError(f"index must be an integer array of expert ids, got {type(index).__name__}")
    xp = array_namespace(index)
    n = check_int("n", n, low=1)
    if not xp.isdtype(index.dtype, "integral"):
        raise TypeError(f"index must be an integer array, got dtype {index.dtype}")
    if index.size and (int(xp.min(index)) < 0 or int(xp.max(index)) >= n):
        raise ValueError(
            f"index must hold expert ids in [0, {n - 1}], got values in "
            f"[{int(xp.min(index))}, {int(xp.max(index))}]")
    return bincount(index, n)


# ---------------------------------------------------------------------------
# Group-limited routing and input checks
# ---------------------------------------------------------------------------

def _group_limited(biased: Array, n_group: int, topk_group: int) -> Array:
    """Mask out all but the best `topk_group` of `n_group` expert groups (DeepSeek-V3 style).

    A group's score is the sum of its two largest biased scores (its only
    score when a group holds one expert). Experts outside the chosen groups get
    $-\\infty$ and cannot be selected.
    """
    xp = array_namespace(biased)
    m, n = biased.shape
    per_group = n // n_group
    grouped = xp.reshape(biased, (m, n_group, per_group))  # [m, G, n/G]
    best_two, _ = topk(grouped, min(2, per_group))  # [m, G, 2]
    group_score = xp.sum(best_two, axis=-1)  # [m, G]
    _, chosen = topk(group_score, topk_group)  # [m, topk_group]
    groups = xp.arange(n_group, dtype=chosen.dtype)
    keep = xp.any(chosen[:, :, None] == groups[None, None, :], axis=1)  # [m, G]
    masked = xp.where(keep[:, :, None], grouped, -xp.inf)  # [m, G, n/G]
    return xp.reshape(masked, (m, n))


def _check_scores_and_bias(scores: Array, bias: Array) -> None:
    check_float_array("scores", scores, ndim=2)
    check_bias(bias, scores.shape[1], context=f"to match scores {list(scores.shape)}")
    check_finite("scores", scores)


def _check_nonnegative(name: str, values: Array, what: str) -> None:
    """Every entry of the finite array `values` must be >= 0 to be renormalized; else a `ValueError` naming `name`.

    Only renormalizing needs it: a share of a sum with a negative term is no weight. Selection
    (`biased_scores`, `selection_cutoff`) ranks any finite values, and `c s` scales them as they are.
    """
    xp = array_namespace(values)
    negative = values < 0
    if bool(xp.any(negative)):
        count = int(xp.sum(xp.astype(negative, xp.int64)))
        raise ValueError(f"{name} must be >= 0 to be renormalized ({what}), got {count} negative "
                         f"entr{'y' if count == 1 else 'ies'} (the smallest {float(xp.min(values)):g})")


# ---------------------------------------------------------------------------
# The score functions (step 1) and their derivative
# ---------------------------------------------------------------------------

def _floating(z: Array) -> Array:
    """`z` itself when floating; integers and booleans promoted to float32 (never computed in their own type,
    where a negation is an error for booleans and `exp` of int8 is only float16)."""
    return z if is_real_floating(z) else array_namespace(z).astype(z, compute_dtype(array_namespace(z), z))


def softplus(z: Array) -> Array:
    r"""$\operatorname{softplus}(z) = \log(1 + e^z)$, exact and finite for any finite $z$.

    Written as $\max(z, 0) + \log(1 + e^{-|z|})$: the exponent is never
    positive, so nothing overflows at large $z$, and for very negative $z$ the
    result is $e^{z}$ to full relative precision rather than a rounded zero.
    """
    z = _floating(z)
    xp = array_namespace(z)
    # $$\operatorname{softplus}(z) = \max(z, 0) + \log\bigl(1 + e^{-|z|}\bigr)$$
    return xp.maximum(z, 0.0) + xp.log1p(xp.exp(-xp.abs(z)))


def softmax(z: Array) -> Array:
    r"""Softmax over the last axis, $e^{z_j - \max z} / \sum_r e^{z_r - \max z}$ (the shift avoids overflow)."""
    z = _floating(z)
    xp = array_namespace(z)
    # $$p_j = \frac{e^{z_j - \max_r z_r}}{\sum_r e^{z_r - \max_r z_r}}$$
    e = xp.exp(z - xp.max(z, axis=-1, keepdims=True))  # [m, n]
    return e / xp.sum(e, axis=-1, keepdims=True)


def score_function_values(logits: Array, score_function: str = "sigmoid") -> Array:
    r"""Router scores from router logits $z = x W_r^\top$, `[m, n]`.

    * `"sigmoid"` (K3, DeepSeek-V3): $s_{i,j} = \sigma(z_{i,j})$, each score in $(0, 1)$ on its own;
    * `"softmax"` (Switch Transformer, the textbook sketch): $s_{i,j} = e^{z_{i,j}} / \sum_r e^{z_{i,r}}$,
      the experts compete and a token's scores sum to one;
    * `"sqrtsoftplus"` (DeepSeek-V4): $s_{i,j} = \sqrt{\operatorname{softplus}(z_{i,j})}$, positive,
      growing like $\sqrt{z}$ instead of saturating at one.
    """
    if score_function == "sigmoid":
        # $$s_{i,j} = \sigma(z_{i,j})$$
        return sigmoid(logits)
    if score_function == "softmax":
        # $$s_{i,j} = e^{z_{i,j}} \big/ \textstyle\sum_r e^{z_{i,r}}$$
        return softmax(logits)
    if score_function == "sqrtsoftplus":
        xp = array_namespace(logits)
        # $$s_{i,j} = \sqrt{\operatorname{softplus}(z_{i,j})}$$
        return xp.sqrt(softplus(logits))
    raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")


def score_function_grad(scores: Array, dscores: Array, score_function: str = "sigmoid") -> Array:
    r"""Carry a gradient in the scores back to the logits, $\partial\mathcal{L}/\partial z$ `[m, n]`, from the scores.

    The backward of each entry of the table above, written with the scores
    $s$ the forward produced (so the logits need not be kept):

    * sigmoid: $\partial s / \partial z = s (1 - s)$;
    * softmax: $\partial\mathcal{L}/\partial z_j = s_j (g_j - \sum_i s_i g_i)$ (every score depends on every logit);
    * $\sqrt{\operatorname{softplus}}$: $\partial s / \partial z = \sigma(z) / (2 s)$ with
      $\sigma(z) = 1 - e^{-\operatorname{softplus}(z)} = -\operatorname{expm1}(-s^2)$; as $z \to -\infty$
      the ratio tends to $s/2 \to 0$, and it is 0 where $s$ has underflowed to 0 (not $0/0$).

    `dscores` $g = \partial\mathcal{L}/\partial s$ has the shape of `scores`.
    """
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    xp = array_namespace(scores, dscores)
    if score_function == "sigmoid":
        # $$\partial s / \partial z = s\,(1 - s)$$
        return dscores * scores * (1.0 - scores)
    if score_function == "softmax":
        # $$\partial\mathcal{L}/\partial z_j = s_j\,(g_j - s \cdot g)$$
        return scores * (dscores - xp.sum(scores * dscores, axis=-1, keepdims=True))
    # $$\partial s / \partial z = \frac{\sigma(z)}{2 s} = \frac{-\operatorname{expm1}(-s^2)}{2 s}$$
    positive = scores > 0
    safe = xp.where(positive, scores, xp.ones_like(scores))
    return xp.where(positive, dscores * (-xp.expm1(-(safe * safe))) / (2.0 * safe), xp.zeros_like(scores))


def score_function_vjp(logits: Array, dscores: Array, score_function: str = "sigmoid") -> Array:
    r"""Carry a gradient in the scores back to the logits $z$, `[m, n]`: `score_function_grad` of the scores of `logits`.

    For the auxiliary losses of a training loop and for tests that hold the
    logits; the layer's backward uses `score_function_grad` on the scores it
    kept. `logits` and `dscores` are `[m, n]` float arrays, finite.
    """
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    check_float_array("logits", logits, ndim=2)
    check_float_array("dscores", dscores, ndim=2)
    if tuple(dscores.shape) != tuple(logits.shape):
        raise ValueError(f"dscores must have the shape of logits {list(logits.shape)}, got {list(dscores.shape)}")
    check_finite("logits", logits)
    check_finite("dscores", dscores)
    return score_function_grad(score_function_values(logits, score_function), dscores, score_function)

