r"""Eq. (14): Quantile Balancing, and the balancer that applies it step by step.

$$
\tilde b_j^{(t+1)} = -\operatorname{quantile}_{1-k/n}\!\bigl(s_{:,j} - \alpha^{(t)}\bigr),
\qquad
b^{(t+1)} = \tilde b^{(t+1)} - \operatorname{mean}\bigl(\tilde b^{(t+1)}\bigr)\,\mathbf 1 .
$$

A batch holds $m$ tokens, each routed to $k$ of $n$ experts, so a perfectly
balanced batch gives every expert the **target load** $q = mk/n$ tokens. The
selection bias $b$ of Eq. (13) is the knob: expert $j$ is picked more often
when $b_j$ rises. Quantile Balancing (QB) reads the bias off the batch instead
of nudging it:

1. **Cutoffs.** Route with the top-$(k+1)$ of $s_i + b^{(t)}$. The first $k$
   are the route; the $(k+1)$-th biased score is the token's cutoff
   $\alpha_i$, the score an expert must beat to enter token $i$'s top-$k$.
2. **Margins.** $M_{i,j} = s_{i,j} - \alpha_i$. With the cutoffs held, token
   $i$ picks expert $j$ under a bias $\tilde b$ exactly when
   $s_{i,j} + \tilde b_j > \alpha_i$, i.e. when $M_{i,j} > -\tilde b_j$. For
   exactly $q$ tokens to clear that bar, $-\tilde b_j$ must be the
   $(q+1)$-th largest margin of column $j$ (the $(1-k/n)$ quantile).
3. **Centering.** Adding the same constant to every $b_j$ changes no top-$k$,
   so the mean is removed; this keeps the bias near zero, where float32 is
   finest (see the bfloat16 pitfall in `refimpl.routing`).
4. **Next step.** $b^{(t+1)}$ routes the *next* batch. A batch is never
   routed with a bias computed from itself; `QuantileBalancer` enforces this
   order. At inference the last bias is frozen and no quantile is computed.

Step 1 is `refimpl.routing.selection_cutoff`. One QB update is exactly one
$\alpha$-step followed by one $\beta$-step of coordinate descent on the dual of
the balanced-assignment LP, with $b = -\beta$; `refimpl.dual` derives this and
checks it against SciPy's HiGHS.

## The rule for a fractional target

K3's own numbers rarely give an integer $q$ (4,096 tokens give
$q = 4096 \cdot 16 / 896 \approx 73.14$). This module reads "the $(q+1)$-th
largest" with a fractional rank $\rho = q + 1$ by linear interpolation between
the two neighbouring order statistics:

$$
M_{(\rho)} = M_{(\lfloor\rho\rfloor)} + (\rho - \lfloor\rho\rfloor)\,
\bigl(M_{(\lfloor\rho\rfloor + 1)} - M_{(\lfloor\rho\rfloor)}\bigr),
$$

where $M_{(r)}$ is the $r$-th largest. With $\lfloor\rho\rfloor = \lfloor q \rfloor + 1$
this moves from the $(\lfloor q\rfloor + 1)$-th towards the
$(\lfloor q\rfloor + 2)$-th largest margin with weight $q - \lfloor q \rfloor$,
and is the plain $(q+1)$-th largest when $q$ is an integer. No library's
quantile convention is involved: `interpolated_kth_largest` spells it out, and
the histogram estimator of Appendix D is compared against it.

## Edge cases, decided

* **$k = n$.** Every token takes every expert; each load is $m = q$ whatever
  the bias, and no $(k+1)$-th score exists. The update returns the input bias,
  centered: there is nothing to learn, and the zero-mean invariant holds.
* **Too few tokens.** The rule needs the $(\lceil q \rceil + 1)$-th largest
  margin of each column, so it needs $\lceil q \rceil + 1 \le m$, i.e.
  $m \ge n/(n-k)$ tokens. A smaller batch is a `ValueError`. With $k < n$
  the target $q = mk/n$ is always below $m$, so "$q > m$" cannot arise here;
  it can in the LP of `refimpl.dual`, which reports it as infeasible.
* **Ties among margins** are order statistics like any others: a value that
  occurs $c$ times occupies $c$ consecutive ranks. The threshold is therefore
  always one of the margins (or between two of them), never invented.

## The atom of ties at $-b_j$

Ties are not rare here, they are built in. For a token whose $(k+1)$-th biased
choice is expert $j$, the cutoff is that very score, $\alpha_i = s_{i,j} + b_j$,
so its margin is exactly $M_{i,j} = -b_j$. Each column therefore carries an
atom of about $m/n$ equal margins at $-b_j$, separating the tokens that chose
$j$ (above) from those that did not (below). In floating point the atom's
members differ from $-b_j$ only by the rounding of $(s + b) - s$, a unit in the
last place.

Consider an **under-loaded** expert, $\text{load}_j < q$. Its top
$\text{load}_j$ margins lie above the atom; if the atom holds at least
$q + 1 - \text{load}_j$ tokens, the $(q+1)$-th largest margin *is* the atom,
$\tilde b_j = b_j$, and the expert's bias does not move (apart from the common
shift of centering). Here the margin model itself is wrong. It treats an atom
token as sitting exactly on its bar, so that any raise of $b_j$, however
small, would seem to bring in the whole atom at once, overshooting $q$; the
exact quantile therefore stays where it is. In truth $j$ is that token's
$(k+1)$-th choice and must overtake its $k$-th, which lies $\kappa_i - \alpha_i$
higher, so a small raise brings in nobody. The exact rule (the default) keeps
the paper's definition and lands on the atom; which of its members count as
"above" is decided by rounding. An over-loaded expert always moves, since its
$(q+1)$-th margin lies above the atom. In the dual of `refimpl.dual` the atom
is a kink of $D$ in $\beta_j$ at which the $\beta$-step is exactly minimal,
although a joint move of $\beta_j$ and of the atom tokens' $\alpha_i$ would
lower $D$: this is where repeated updates on one batch stall.

**Extension (not in the paper): leave-one-out cutoffs.** The atom exists
because expert $j$ is compared with a cutoff that $j$ itself set. The cutoff
that $j$ really has to beat in token $i$ is the $k$-th largest biased score
*among the other experts*:

$$
c_{i,j} = \begin{cases} \alpha_i & j \in \mathcal{T}_i \ (\text{the other experts' } k\text{-th is the overall } (k{+}1)\text{-th}),\\
\kappa_i & j \notin \mathcal{T}_i \ (\kappa_i = \text{the overall } k\text{-th largest}).\end{cases}
$$

With margins $s_{i,j} - c_{i,j}$ the count of tokens clearing
$-\tilde b_j$ is the load expert $j$ would get if *only its own* bias moved,
exactly, and the atom is gone (an atom token's margin becomes
$s_{i,j} - \kappa_i < -b_j$). In the language of `refimpl.dual` this is an
exact coordinate step on $\min_\alpha D(\alpha, \beta)$ rather than on
$D(\alpha, \beta)$ with $\alpha$ frozen. `quantile_balancing_update(...,
leave_one_out=True)` computes it from the same top-$(k+1)$. Taken for all
experts at once the steps can overshoot (two under-loaded experts may chase
the same tokens), so for repeated steps on one batch `QuantileBalancer` also
offers a `damping` $\eta$: $b \leftarrow b + \eta\,(b^{\text{QB}} - b)$. The
examples measure what each change does.

## The sign rule

DeepSeek-V3's auxiliary-loss-free update moves every bias by a fixed step in
the direction that reduces its load error,
$b_j \leftarrow b_j + \gamma\,\operatorname{sign}(q - \text{load}_j)$.
`sign_balancing_update` implements it with the same array conventions, and
`SignBalancer` gives it the same step interface as `QuantileBalancer`, so the
two are compared like for like. The sign rule keeps only the direction of the
error and needs a step size $\gamma$; QB jumps to the quantile and has none.
"""

from __future__ import annotations

import json
import math
import numbers
import zipfile
from dataclasses import dataclass
from importlib import import_module
from os import PathLike
from typing import Any, ClassVar

import numpy as np

from ._fast import (
    cutoffs_by_blocks,
    expert_major_margins_by_blocks,
    kth_largest_by_sampling,
    kth_largest_cupy,
)
from ._files import write_atomically
from ._xp import Array, array_namespace, compute_dtype, is_cupy, is_numpy, to_numpy
from .config import MoEConfig
from .routing import expert_load, route, selection_cutoff
from .validation import check_bias, check_finite, check_float_array, check_int, check_positive, check_shape

__all__ = [
    "BalanceStep",
    "Balancer",
    "FrozenBalancer",
    "QuantileBalancer",
    "SignBalancer",
    "cutoff_values",
    "cutoffs",
    "expert_major_margins",
    "interpolated_kth_largest",
    "kth_largest",
    "load_ratio",
    "margins",
    "quantile_balancing_update",
    "quantile_rank",
    "quantile_thresholds",
    "sign_balancing_update",
    "target_load",
]


# ---------------------------------------------------------------------------
# Order statistics: the one primitive Eq. (14) needs
# ---------------------------------------------------------------------------

def kth_largest(x: Array, r: int, *, previous: bool = False, overwrite: bool = False) -> Array | tuple:
    r"""The $r$-th largest entry of each row of `x` (`[p, L]`, $1 \le r \le L$), the one primitive Eq. (14) needs.

    With `previous=True` also returns the $(r-1)$-th largest (needs $r \ge 2$),
    as `(r_th, previous_th)`. Ranks count equal values separately, as order
    statistics do. `overwrite=True` allows reordering `x` in place (the
    caller's scratch array), which saves a copy of the whole matrix.

    The readable definition sorts each row. On NumPy and CuPy a selection does
    the same in $O(L)$ per row (`refimpl._fast.kth_largest_by_sampling`, a sample that
    discards most entries first, and CuPy's selection kernel).
    """
    xp = array_namespace(x)
    length = x.shape[-1]
    if is_numpy(xp):
        part = x if overwrite and x.flags.c_contiguous else np.array(x, order="C", copy=True)
        return kth_largest_by_sampling(part, r, previous)
    if is_cupy(xp):
        return kth_largest_cupy(x, r, previous)
    # $$x_{(r)} = \text{sort}(x)_{L - r}$$ (ascending: the r-th largest sits at position L - r)
    ordered = xp.sort(x, axis=-1)  # [p, L]
    if previous:
        return ordered[:, length - r], ordered[:, length - r + 1]
    return ordered[:, length - r]


def _interpolated_rows(x: Array, whole: int, frac: float, *, overwrite: bool = False) -> Array:
    r"""Row-wise $x_{(\rho)}$ for the rank $\rho = $ `whole + frac` ($0 \le$ `frac` $< 1$)."""
    if frac == 0.0:
        return kth_largest(x, whole, overwrite=overwrite)
    # The (whole+1)-th largest and, from the same partition, the whole-th largest.
    lower, upper = kth_largest(x, whole + 1, previous=True, overwrite=overwrite)  # [p], [p]
    # $$x_{(\rho)} = x_{(\lfloor\rho\rfloor)} + (\rho - \lfloor\rho\rfloor)\,(x_{(\lfloor\rho\rfloor+1)} - x_{(\lfloor\rho\rfloor)})$$
    return upper + frac * (lower - upper)


def interpolated_kth_largest(values: Array, rank: float, *, axis: int = 0) -> Array:
    r"""The `rank`-th largest entry along `axis`, for a real `rank` $\rho \ge 1$.

    $$
    x_{(\rho)} = x_{(\lfloor\rho\rfloor)} + (\rho - \lfloor\rho\rfloor)\,
    \bigl(x_{(\lfloor\rho\rfloor+1)} - x_{(\lfloor\rho\rfloor)}\bigr),
    $$

    where $x_{(r)}$ is the $r$-th largest (equal values counted separately).
    An integer rank gives the order statistic itself. Eq. (14) takes
    $\rho = q + 1$ on each column of the margin matrix (`axis=0`), which is the
    rule this project uses for a fractional target load $q$.

    Parameters
    ----------
    values
        A 1-D or 2-D real floating array.
    rank
        $\rho$, with $1 \le \rho \le L$ (the length along `axis`); when $\rho$ is
        not an integer, $\lfloor\rho\rfloor + 1 \le L$ as well.
    axis
        The axis to rank along (0 or 1 for a 2-D array, ignored for 1-D).

    Returns
    -------
    The order statistic, one per column (`axis=0`) or row (`axis=1`), in the
    dtype of `values`.
    """
    check_float_array("values", values)
    if values.ndim not in (1, 2):
        raise ValueError(f"values must be 1-D or 2-D, got shape {list(values.shape)}")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Real) or not math.isfinite(rank):
        raise TypeError(f"rank must be a finite real number, got {rank!r}")
    if values.ndim == 2 and axis not in (0, 1, -1, -2):
        raise ValueError(f"axis must be 0 or 1 for a 2-D array, got {axis}")
    xp = array_namespace(values)
    rows = xp.reshape(values, (1, -1)) if values.ndim == 1 else (values.T if axis in (0, -2) else values)
    length = rows.shape[-1]
    whole = math.floor(rank)
    frac = float(rank) - whole
    needed = whole + (1 if frac > 0 else 0)
    if whole < 1 or needed > length:
        raise ValueError(
            f"rank must lie in [1, {length}] (and its ceiling must too) for {length} values along the axis, "
            f"got rank={rank}")
    result = _interpolated_rows(rows, whole, frac)  # [p]
    return result[0] if values.ndim == 1 else result


# ---------------------------------------------------------------------------
# Eq. (14)
# ---------------------------------------------------------------------------

def target_load(m: int, n: int, top_k: int) -> float:
    r"""The target load $q = mk/n$: tokens per expert in a perfectly balanced batch."""
    m = check_int("m", m, low=0)
    n = check_int("n", n, low=1)
    top_k = check_int("top_k", top_k, low=1, high=n)
    return m * top_k / n


def quantile_rank(m: int, n: int, top_k: int) -> tuple[int, float]:
    r"""The target load $q = mk/n$ as $(\lfloor q \rfloor, q - \lfloor q \rfloor)$, exactly, after checking that the batch can give it.

    Eq. (14) reads the $(q+1)$-th largest margin of each expert (interpolated
    for a fractional $q$), which exists only when $m$ is large enough: at
    least $n/(n-k)$ tokens.
    """
    if m < 1:
        raise ValueError("scores must hold at least one token (got m=0)")
    top_k = check_int("top_k", top_k, low=1, high=n)
    # $q = mk/n$ as an integer part and a fraction, without rounding.
    whole, rest = divmod(m * top_k, n)
    if top_k < n and whole + (1 if rest else 0) + 1 > m:
        raise ValueError(
            f"scores holds too few tokens for Eq. (14): the target load q = m*k/n = {m * top_k / n:.4g} needs "
            f"the ({whole + (1 if rest else 0) + 1})-th largest margin of each expert, but m={m}; "
            f"use at least n/(n-k) = {n / (n - top_k):.4g} tokens")
    return whole, rest / n


def _biased(scores: Array, bias: Array) -> Array:
    r"""$s + b$, `[m, n]`: the same values as `refimpl.routing.biased_scores`, for already-checked inputs.

    It skips the second validation and the extra copy of `scores` (at
    $m = 131{,}072$ tokens each copy is half a gigabyte).
    """
    xp = array_namespace(scores, bias)
    dtype = compute_dtype(xp, scores, bias)
    # $$s_i + b$$
    return xp.astype(scores, dtype, copy=False) + xp.astype(bias, dtype, copy=False)[None, :]


def cutoff_values(scores: Array, bias: Array, top_k: int, *, with_kth: bool = False) -> Array | tuple:
    r"""$\alpha_i$, the $(k+1)$-th largest biased score of each token (and the $k$-th, $\kappa_i$, if asked), unchecked.

    The values of `refimpl.routing.selection_cutoff` (a test checks it bit
    for bit) without ranking expert ids: each row is selected, not sorted.
    For inputs the caller has validated (`cutoffs` is the checked form); on
    NumPy it runs by blocks of tokens (`refimpl._fast.cutoffs_by_blocks`),
    so the whole `[m, n]` matrix of biased scores is never allocated.
    """
    if is_numpy(array_namespace(scores, bias)):
        return cutoffs_by_blocks(np.asarray(scores), np.asarray(bias), top_k, with_kth=with_kth)
    # $$\alpha_i = (s_i + b)_{(k+1)}, \qquad \kappa_i = (s_i + b)_{(k)}$$
    return kth_largest(_biased(scores, bias), top_k + 1, previous=with_kth, overwrite=True)


def expert_major_margins(scores: Array, alpha: Array, *, bias: Array | None = None,
                         kappa: Array | None = None) -> Array:
    r"""The margins transposed, `[n, m]`: one row per expert, so that each expert's quantile is a row operation.

    $M_{i,j} = s_{i,j} - \alpha_i$; with `bias` and `kappa` given, the
    leave-one-out margins of the extension. On NumPy by blocks of tokens
    (`refimpl._fast.expert_major_margins_by_blocks`: NumPy transposes element
    by element, and blocks keep both sides in cache).
    """
    xp = array_namespace(scores, alpha)
    if is_numpy(xp):
        return expert_major_margins_by_blocks(np.asarray(scores), np.asarray(alpha),
                                                    None if bias is None else np.asarray(bias), kappa)
    s_t = xp.astype(scores, alpha.dtype).T  # [n, m]
    # $$M_{i,j} = s_{i,j} - \alpha_i$$
    margin_t = s_t - alpha[None, :]  # [n, m]
    if kappa is None:
        return margin_t
    # Leave-one-out: an expert outside token i's top-k must beat the k-th score, kappa_i, not alpha_i.
    # $$c_{i,j} = \alpha_i \text{ if } s_{i,j} + b_j > \alpha_i \text{ else } \kappa_i$$
    chosen_t = (s_t + xp.astype(bias, alpha.dtype)[:, None]) > alpha[None, :]  # [n, m]
    return xp.where(chosen_t, margin_t, s_t - kappa[None, :])


def quantile_thresholds(scores: Array, alpha: Array, whole: int, frac: float, *,
                        bias: Array | None = None, kappa: Array | None = None) -> Array:
    r"""$M_{(q+1), j}$ for every expert: the interpolated $(q+1)$-th largest margin of each column, `[n]`.

    `whole`, `frac` are $\lfloor q \rfloor$ and $q - \lfloor q \rfloor$
    (`quantile_rank`). Eq. (14) negates it; the $\beta$-step of
    `refimpl.dual` is this value itself.
    """
    margins_t = expert_major_margins(scores, alpha, bias=bias, kappa=kappa)  # [n, m]
    # $$M_{(q+1),j}$$, with the interpolation rule for a fractional q
    return _interpolated_rows(margins_t, whole + 1, frac, overwrite=True)  # [n]


def cutoffs(scores: Array, bias: Array, top_k: int) -> Array:
    r"""Each token's cutoff $\alpha_i$, `[m]`: the $(k+1)$-th largest of $s_i + b$, values only.

    The same values as `refimpl.routing.selection_cutoff(scores, bias, top_k)[1]`,
    bit for bit, without ranking expert ids: the cheaper pass that Eq. (14) and
    the histogram estimator (Appendix D) need when the route itself is not.
    """
    check_float_array("scores", scores, ndim=2)
    check_bias(bias, scores.shape[1], context=f"to match scores {list(scores.shape)}")
    n = scores.shape[1]
    top_k = check_int("top_k", top_k, low=1, high=n - 1)
    check_finite("scores", scores)
    check_finite("bias", bias)
    return cutoff_values(scores, bias, top_k)  # [m]


def margins(scores: Array, bias: Array, top_k: int) -> Array:
    r"""The margin matrix $M_{i,j} = s_{i,j} - \alpha_i$, `[m, n]`, of Eq. (14).

    $\alpha_i$ is token $i$'s cutoff, the $(k+1)$-th largest of $s_i + b$
    (from `refimpl.routing.selection_cutoff`). Expert $j$ is in token $i$'s
    top-$k$ exactly when $M_{i,j} > -b_j$; the tokens whose $(k+1)$-th choice
    is $j$ have $M_{i,j} = -b_j$ up to rounding (the atom).
    """
    _, alpha = selection_cutoff(scores, bias, top_k)  # [m]
    xp = array_namespace(scores, bias)
    s = xp.astype(scores, alpha.dtype, copy=False)
    # $$M_{i,j} = s_{i,j} - \alpha_i$$
    return s - alpha[:, None]  # [m, n]


def _center(b: Array) -> Array:
    xp = array_namespace(b)
    # $$b^{(t+1)} = \tilde b - \operatorname{mean}(\tilde b)\,\mathbf 1$$
    return b - xp.mean(b)


def quantile_balancing_update(scores: Array, bias: Array, top_k: int, *, center: bool = True,
                              leave_one_out: bool = False) -> Array:
    r"""Eq. (14), exact: the bias for the next batch, computed from this batch.

    Parameters
    ----------
    scores
        `[m, n]` sigmoid router scores of the current batch.
    bias
        `[n]` the bias that routes the current batch, float32 or float64.
    top_k
        $k$, experts per token, $1 \le k \le n$.
    center
        Subtract the mean (the paper's step 3). `False` returns $\tilde b$
        itself, the threshold that makes $q$ margins clear the bar with the
        cutoffs held; useful for checking the rule.
    leave_one_out
        Extension, not the paper's rule: compare each expert with the
        cutoff of the *other* experts (see the module text), which removes the
        atom of ties at $-b_j$.

    Returns
    -------
    `[n]` new bias, in the dtype of the biased scores (float32, or float64 if
    either input is float64). With $k = n$ it is the centered input bias.

    Raises
    ------
    ValueError
        Non-finite scores or bias, mismatched shapes, $k > n$, or fewer than
        $n/(n-k)$ tokens (the needed order statistic does not exist).
    """
    check_float_array("scores", scores, ndim=2)
    check_bias(bias, scores.shape[1], context=f"to match scores {list(scores.shape)}")
    m, n = scores.shape
    whole, frac = quantile_rank(m, n, top_k)
    check_finite("scores", scores)
    check_finite("bias", bias)
    xp = array_namespace(scores, bias)
    if top_k == n:
        # Every expert is always chosen: the bias cannot change any load, so it is kept (centered).
        b = xp.astype(bias, compute_dtype(xp, scores, bias))
        return _center(b) if center else b
    # Step 1: the cutoffs, from the top-(k+1) of the biased scores.
    cut = cutoff_values(scores, bias, top_k, with_kth=leave_one_out)
    alpha, kappa = cut if leave_one_out else (cut, None)  # [m], [m] or None
    # Step 2: the interpolated (q+1)-th largest margin of each expert, negated.
    # $$\tilde b_j = -M_{(q+1),j}$$
    b_tilde = -quantile_thresholds(scores, alpha, whole, frac, bias=bias, kappa=kappa)  # [n]
    # Step 3: remove the mean, which changes no top-k.
    return _center(b_tilde) if center else b_tilde


# ---------------------------------------------------------------------------
# The sign rule (DeepSeek-V3)
# ---------------------------------------------------------------------------

def sign_balancing_update(load: Array, bias: Array, rate: float) -> Array:
    r"""DeepSeek-V3's auxiliary-loss-free step: $b_j \leftarrow b_j + \gamma\,\operatorname{sign}(q - \text{load}_j)$.

    $q$ is the mean load, $\sum_j \text{load}_j / n = mk/n$. The sign is
    computed in integers, as $\operatorname{sign}(\sum_r \text{load}_r - n\,\text{load}_j)$,
    so an expert exactly on target does not move. The result is not centered
    (the original rule is not); a common shift changes no top-$k$ anyway.

    Parameters
    ----------
    load
        `[n]` integer token counts of the batch just routed (`refimpl.routing.expert_load`).
    bias
        `[n]` the bias that routed it, float32 or float64.
    rate
        $\gamma > 0$, the step size (Megatron-Core's default is 1e-3).

    Returns
    -------
    `[n]` new bias in the dtype of `bias`.
    """
    check_bias(bias)
    rate = check_positive("rate", rate)
    xp = array_namespace(load, bias)
    if not xp.isdtype(load.dtype, "integral"):
        raise TypeError(f"load must be an integer array of token counts, got dtype {load.dtype}")
    check_shape("load", load, tuple(bias.shape))
    n = load.shape[0]
    counts = xp.astype(load, xp.int64)  # [n]
    # $$\operatorname{sign}(q - \text{load}_j) = \operatorname{sign}\bigl(\textstyle\sum_r \text{load}_r - n\,\text{load}_j\bigr)$$
    direction = xp.sign(xp.sum(counts) - n * counts)  # [n] in {-1, 0, 1}
    # $$b_j \leftarrow b_j + \gamma\,\operatorname{sign}(q - \text{load}_j)$$
    return bias + rate * xp.astype(direction, bias.dtype)


def load_ratio(load: Array) -> float:
    """The max/min load of a step (1.0 is perfect balance; infinity when some expert got no token)."""
    values = to_numpy(load)
    low, high = int(values.min()), int(values.max())
    return math.inf if low == 0 else high / low


# ---------------------------------------------------------------------------
# The balancer: route with the bias held, then compute the next one
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BalanceStep:
    """What one balancer step did.

    `index` `[m, k]` is the route of the batch, made with `bias` `[n]` (the
    bias held *before* the batch was seen); `load` `[n]` counts its tokens per
    expert and `ratio` is max/min of `load`; `next_bias` `[n]` is the bias
    computed from this batch, which will route the next one.
    """

    step: int
    index: Array
    load: np.ndarray
    ratio: float
    bias: np.ndarray
    next_bias: np.ndarray


class Balancer:
    r"""The one interface of every balancer: the place where a layer's bias lives between steps.

    A balancer holds the bias that will route the next batch. `step(scores)`
    routes the batch with that bias, records the loads, and only then
    computes the bias for the next batch from this one. In a training step
    the layer routes the batch itself (with the held bias) and hands its own
    route over, `step(scores, index=layer_route)`, so the loads recorded are
    those of the layer that ran. The bias is kept as a NumPy array in float32
    (or the `dtype` given), as K3 keeps it; each batch may come from any
    array namespace.

    What every balancer declares, so that a training loop needs to know
    nothing else about it:

    * `kind`, a class attribute: the name it is saved under (every subclass
      sets its own and is registered under it when the class is defined);
    * `layer_config(config)`: the layer it balances, the `MoEConfig` with the
      switches it changes (a capacity that drops, hash routing); most change
      nothing;
    * `needs_token_ids`: whether it routes by token id, so that `step` must
      be given `token_ids` when the layer's route is not;
    * `coefficient` and `auxiliary(scores, index)`: the weight of its
      auxiliary balance loss in the objective (0: it has none) and the loss
      with its gradient in the scores;
    * `options()`: its settings, the keywords that build it again;
    * the two rules a subclass writes: `choose(scores, bias, token_ids)`, its
      route when it routes a batch alone (default: the biased top-$k$ of
      Eq. 13), and `next_bias(scores, bias, index)`, the bias for the next
      batch.

    `save` writes the whole state (kind, options, bias, step count, history)
    to an `.npz` file atomically, and `Balancer.restore` reads it back bit for
    bit, whatever the kind, so a resumed run routes exactly as an
    uninterrupted one.

    History: `loads` (one `[n]` array per step), `ratios` (max/min per step)
    and `biases` (the bias that routed each step).

    The rules: `QuantileBalancer` (Eq. 14), `SignBalancer` (DeepSeek-V3),
    `FrozenBalancer` (no balancing), `refimpl.histogram.HistogramBalancer`
    (Appendix D) and, on the page "The other balancers in the training
    loop", auxiliary losses, capacity and hash routing.
    """

    kind: ClassVar[str] = ""
    needs_token_ids: ClassVar[bool] = False
    #: The weight of the auxiliary balance loss in the training objective (0: the balancer has none).
    coefficient: float = 0.0
    #: Every kind, by name: filled as the subclasses are defined.
    kinds: ClassVar[dict[str, type[Balancer]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if not isinstance(kind, str) or not kind:
            raise TypeError(f"{cls.__name__} must set its own kind (the name it is saved under), as a class "
                            "attribute")
        known = Balancer.kinds.get(kind)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"the balancer kind {kind!r} is taken by {known.__module__}.{known.__qualname__}")
        Balancer.kinds[kind] = cls

    def __init__(self, num_experts: int, top_k: int, *, bias: Array | None = None,
                 dtype: Any = np.float32) -> None:
        self.num_experts = check_int("num_experts", num_experts, low=1)
        self.top_k = check_int("top_k", top_k, low=1, high=self.num_experts)
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        if bias is None:
            self._bias = np.zeros(self.num_experts, dtype=dtype)
        else:
            held = np.array(to_numpy(bias), dtype=dtype, copy=True)
            if held.shape != (self.num_experts,):
                raise ValueError(f"bias must have shape [{self.num_experts}], got {list(held.shape)}")
            if not np.isfinite(held).all():
                raise ValueError("bias must be finite")
            self._bias = held
        self.step_count = 0
        self.loads: list[np.ndarray] = []
        self.ratios: list[float] = []
        self.biases: list[np.ndarray] = []

    # -- what it declares ------------------------------------------------------

    @property
    def bias(self) -> np.ndarray:
        """A copy of the bias that will route the next batch."""
        return self._bias.copy()

    def options(self) -> dict[str, Any]:
        """The settings of this balancer: the keywords (besides sizes, bias and dtype) that build it again."""
        return {}

    def layer_config(self, config: MoEConfig) -> MoEConfig:
        """The layer this balancer balances: `config` with the switches it changes (here: none)."""
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if (config.num_experts, config.top_k) != (self.num_experts, self.top_k):
            raise ValueError(f"the layer has num_experts={config.num_experts}, top_k={config.top_k}; this "
                             f"balancer was built for {self.num_experts} and {self.top_k}")
        return config

    def auxiliary(self, scores: Array, index: Array) -> tuple[float, np.ndarray]:
        """The auxiliary balance loss of a routed batch and its gradient in the scores `[m, n]` (none here: zeros)."""
        return 0.0, np.zeros(tuple(scores.shape))

    def check_batch(self, m: int) -> None:
        """Raise `ValueError` if this rule cannot balance batches of `m` tokens (a run checks before its first step)."""
        check_int("m", m, low=1)

    # -- the two rules a subclass writes --------------------------------------

    def choose(self, scores: Array, bias: Array, token_ids: Array | None) -> Array:
        """The route `[m, k]` of a batch this balancer routes alone: the top-$k$ of $s + b$ (Eq. 13)."""
        index, _ = route(scores, bias, self.top_k)
        return index

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        """The bias `[n]` for the next batch, from this batch's `scores` `[m, n]`, the `bias` that routed it and its route."""
        raise NotImplementedError(f"{type(self).__name__} must define next_bias(scores, bias, index)")

    # -- the step --------------------------------------------------------------

    def step(self, scores: Array, *, index: Array | None = None, token_ids: Array | None = None) -> BalanceStep:
        """Route `scores` (`[m, n]`) with the held bias, then compute the next bias from them.

        `index` (`[m, k]`), if given, is the route the layer itself made of
        this batch with the held bias (a training step passes it, so that the
        loads are those of the layer that ran); otherwise the balancer routes
        the batch with `choose`, reading `token_ids` (`[m]`) when it
        `needs_token_ids`.
        """
        check_float_array("scores", scores, ndim=2)
        check_shape("scores", scores, (None, self.num_experts))
        xp = array_namespace(scores)
        used = self._bias.copy()  # fixed before the batch is looked at
        if index is None:
            if self.needs_token_ids and token_ids is None:
                raise ValueError(f"a {self.kind} balancer routes by token id: step() needs token_ids, an [m] "
                                 "integer array (or the layer's route as index=)")
            index = self.choose(scores, xp.asarray(used), token_ids)
        else:
            check_shape("index", index, (scores.shape[0], self.top_k))
        new_bias = self.next_bias(scores, xp.asarray(used), index)
        return self.advance(index, expert_load(index, self.num_experts), new_bias)

    def advance(self, index: Array, load: Array, next_bias: Array) -> BalanceStep:
        """The end of a step: record the batch's route `index` and `load` `[n]`, then hold `next_bias` `[n]`.

        `step` ends here. A step whose load and next bias are computed
        elsewhere calls it directly: an expert-parallel training step, where
        each rank routed only its own tokens (`index`) and the load and the
        next bias are those of the whole batch, gathered over the ranks.
        """
        load = to_numpy(load)
        if tuple(load.shape) != (self.num_experts,) or not np.issubdtype(load.dtype, np.integer) \
                or (load < 0).any():
            raise ValueError(f"load must be [{self.num_experts}] non-negative integer counts, got "
                             f"{load.dtype} of shape {list(load.shape)}")
        next_bias = to_numpy(next_bias)
        if tuple(next_bias.shape) != (self.num_experts,):
            raise ValueError(f"next_bias must have shape [{self.num_experts}], got {list(next_bias.shape)}")
        used = self._bias.copy()  # the bias that routed the batch
        load = load.astype(np.int64)
        ratio = load_ratio(load)
        self._bias = next_bias.astype(self._bias.dtype)
        self.step_count += 1
        self.loads.append(load)
        self.ratios.append(ratio)
        self.biases.append(used)
        return BalanceStep(self.step_count, index, load, ratio, used, self._bias.copy())

    # -- saving and restoring ----------------------------------------------------

    def save(self, path: str | PathLike) -> None:
        """Write the whole state to the `.npz` file `path`, atomically: kind, options, bias, step count, history.

        The file is written under a temporary name in the same folder and
        renamed into place, so `path` holds the old state or the new one,
        never a part. It needs no pickle: arrays, and the options as JSON.
        """
        n = self.num_experts
        arrays = {
            "kind": np.array(self.kind),
            "module": np.array(type(self).__module__),
            "options": np.array(json.dumps(self.options(), allow_nan=False)),
            "num_experts": np.int64(n),
            "top_k": np.int64(self.top_k),
            "step_count": np.int64(self.step_count),
            "bias": self._bias,
            "loads": np.array(self.loads, dtype=np.int64).reshape(-1, n),
            "ratios": np.array(self.ratios, dtype=np.float64),
            "biases": np.array(self.biases, dtype=self._bias.dtype).reshape(-1, n),
        }
        write_atomically(path, lambda handle: np.savez(handle, **arrays))

    @classmethod
    def restore(cls, path: str | PathLike) -> Balancer:
        """Read a balancer written by `save`, of any kind; the result continues the run bit for bit.

        A kind defined in a module of this package that is not imported yet
        (the training balancers) is imported from the module the file names;
        a kind of your own must be defined (its module imported) first.
        """
        try:
            with np.load(path, allow_pickle=False) as data:
                fields = {name: data[name] for name in data.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise ValueError(f"{path} is not a balancer state written by Balancer.save: {exc}") from None
        if "kind" in fields and "options" not in fields:  # written before the options were kept as JSON
            fields["module"] = np.array("refimpl.balancing")
            fields["options"] = np.array(json.dumps({name: fields.pop(name).item() for name in
                                                     ("leave_one_out", "damping", "rate") if name in fields}))
        missing = sorted({"kind", "module", "options", "num_experts", "top_k", "step_count", "bias", "loads",
                          "ratios", "biases"} - set(fields))
        if missing:
            raise ValueError(f"{path} is not a balancer state written by Balancer.save: it lacks {missing}")
        kind, module = str(fields["kind"]), str(fields["module"])
        if kind not in Balancer.kinds and module.startswith("refimpl."):
            import_module(module)  # a kind of this package whose module was not imported yet
        if kind not in Balancer.kinds:
            raise ValueError(f"{path} holds an unknown balancer kind {kind!r} (defined in {module!r}); known kinds: "
                             f"{sorted(Balancer.kinds)}")
        options = json.loads(str(fields["options"]))
        balancer = Balancer.kinds[kind](int(fields["num_experts"]), int(fields["top_k"]), bias=fields["bias"],
                                        dtype=fields["bias"].dtype, **options)
        balancer.step_count = int(fields["step_count"])
        balancer.loads = [row.copy() for row in fields["loads"]]
        balancer.ratios = [float(r) for r in fields["ratios"]]
        balancer.biases = [row.copy() for row in fields["biases"]]
        return balancer


class QuantileBalancer(Balancer):
    r"""Eq. (14) step by step: route with the held bias, then jump to the quantile bias of this batch.

    Two options belong to the extension, not to the paper (both off by
    default): `leave_one_out=True` uses the leave-one-out cutoffs described in
    the module text, and `damping` $\eta < 1$ moves only a fraction $\eta$ of
    the way to the new bias. Together they let repeated steps on one fixed
    batch reach the LP optimum, which the plain rule does not (see
    `refimpl.dual`).
    """

    kind = "quantile"

    def __init__(self, num_experts: int, top_k: int, *, bias: Array | None = None,
                 dtype: Any = np.float32, leave_one_out: bool = False, damping: float = 1.0) -> None:
        super().__init__(num_experts, top_k, bias=bias, dtype=dtype)
        self.leave_one_out = bool(leave_one_out)
        self.damping = check_positive("damping", damping)
        if self.damping > 1.0:
            raise ValueError(f"damping must be in (0, 1], got {self.damping}")

    def options(self) -> dict[str, Any]:
        return {"leave_one_out": self.leave_one_out, "damping": self.damping}

    def check_batch(self, m: int) -> None:
        super().check_batch(m)
        try:
            quantile_rank(m, self.num_experts, self.top_k)
        except ValueError as exc:
            raise ValueError(f"a batch of {m} tokens is too small for Quantile Balancing of {self.num_experts} "
                             f"experts with top_k={self.top_k}: {exc}") from None

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        # Steps 1-3 of Eq. (14) on this batch: cutoffs, the (q+1)-th margin of each expert, centering.
        jump = quantile_balancing_update(scores, bias, self.top_k, leave_one_out=self.leave_one_out)
        if self.damping == 1.0:
            return jump
        # Extension: move only part of the way, $$b \leftarrow b + \eta\,(b^{\text{QB}} - b)$$, then center.
        xp = array_namespace(jump)
        return _center(bias + self.damping * (jump - xp.astype(bias, jump.dtype)))


class SignBalancer(Balancer):
    r"""DeepSeek-V3's sign rule with the same step interface: $b \leftarrow b + \gamma\,\operatorname{sign}(q - \text{load})$."""

    kind = "sign"

    def __init__(self, num_experts: int, top_k: int, *, rate: float = 1e-3, bias: Array | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__(num_experts, top_k, bias=bias, dtype=dtype)
        self.rate = check_positive("rate", rate)

    def options(self) -> dict[str, Any]:
        return {"rate": self.rate}

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        load = expert_load(index, self.num_experts)  # [n]
        return sign_balancing_update(load, bias, self.rate)


class FrozenBalancer(Balancer):
    """No balancing: routes with the bias it was given (zero by default) and never changes it."""

    kind = "none"

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        return bias
