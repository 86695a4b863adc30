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
   finest (see the bfloat16 pitfall in `refimpl.layer.routing`).
4. **Next step.** $b^{(t+1)}$ routes the *next* batch. A batch is never
   routed with a bias computed from itself; `QuantileBalancer` enforces this
   order. At inference the last bias is frozen and no quantile is computed.

Step 1 is `refimpl.layer.routing.selection_cutoff`. One QB update is exactly one
$\alpha$-step followed by one $\beta$-step of coordinate descent on the dual of
the balanced-assignment LP, with $b = -\beta$; `refimpl.balancing.dual` derives this and
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
  it can in the LP of `refimpl.balancing.dual`, which reports it as infeasible.
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
$(q+1)$-th margin lies above the atom. In the dual of `refimpl.balancing.dual` the atom
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
$s_{i,j} - \kappa_i < -b_j$). In the language of `refimpl.balancing.dual` this is an
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

import math
import numbers
from typing import Any

import numpy as np

from .._lib.fast import (
    cutoffs_by_blocks,
    enabled,
    expert_major_margins_by_blocks,
    kth_largest_by_sampling,
    kth_largest_cupy,
)
from .._lib.validation import (
    check_bias,
    check_finite,
    check_float_array,
    check_int,
    check_positive,
    check_shape,
)
from .._lib.values import switch_value
from .._lib.xp import Array, array_namespace, compute_dtype, dtype_name, is_cupy, is_numpy
from ..layer.routing import expert_load, selection_cutoff
from .balancer import Balancer

__all__ = [
    "FrozenBalancer",
    "QuantileBalancer",
    "SignBalancer",
    "cutoff_values",
    "cutoffs",
    "expert_major_margins",
    "interpolated_kth_largest",
    "kth_largest",
    "margins",
    "quantile_balancing_update",
    "quantile_rank",
    "quantile_thresholds",
    "sign_balancing_update",
    "target_load",
]


# ---------------------------------------------------------------------------
# Eq. (14)
# ---------------------------------------------------------------------------

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
    center = switch_value(center, "center")
    leave_one_out = switch_value(leave_one_out, "leave_one_out")
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
    r"""$s + b$, `[m, n]`: the same values as `refimpl.layer.routing.biased_scores`, for already-checked inputs.

    It skips the second validation and the extra copy of `scores` (at
    $m = 131{,}072$ tokens each copy is half a gigabyte).
    """
    xp = array_namespace(scores, bias)
    dtype = compute_dtype(xp, scores, bias)
    # $$s_i + b$$
    return xp.astype(scores, dtype, copy=False) + xp.astype(bias, dtype, copy=False)[None, :]


def cutoff_values(scores: Array, bias: Array, top_k: int, *, with_kth: bool = False) -> Array | tuple:
    r"""$\alpha_i$, the $(k+1)$-th largest biased score of each token (and the $k$-th, $\kappa_i$, if asked), unchecked.

    The values of `refimpl.layer.routing.selection_cutoff` (a test checks it bit
    for bit) without ranking expert ids: each row is selected, not sorted.
    For inputs the caller has validated (`cutoffs` is the checked form); on
    NumPy it runs by blocks of tokens (`refimpl._lib.fast.cutoffs_by_blocks`),
    so the whole `[m, n]` matrix of biased scores is never allocated.
    """
    with_kth = switch_value(with_kth, "with_kth")  # the one check it makes: a switch is never read as truthy
    if enabled() and is_numpy(array_namespace(scores, bias)):
        return cutoffs_by_blocks(np.asarray(scores), np.asarray(bias), top_k, with_kth=with_kth)
    # $$\alpha_i = (s_i + b)_{(k+1)}, \qquad \kappa_i = (s_i + b)_{(k)}$$
    return _kth_largest(_biased(scores, bias), top_k + 1, previous=with_kth, overwrite=True)


def expert_major_margins(scores: Array, alpha: Array, *, bias: Array | None = None,
                         kappa: Array | None = None) -> Array:
    r"""The margins transposed, `[n, m]`: one row per expert, so that each expert's quantile is a row operation.

    $M_{i,j} = s_{i,j} - \alpha_i$; with `bias` and `kappa` given, the
    leave-one-out margins of the extension. On NumPy by blocks of tokens
    (`refimpl._lib.fast.expert_major_margins_by_blocks`: NumPy transposes element
    by element, and blocks keep both sides in cache).
    """
    xp = array_namespace(scores, alpha)
    if enabled() and is_numpy(xp):
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
    `refimpl.balancing.dual` is this value itself.
    """
    margins_t = expert_major_margins(scores, alpha, bias=bias, kappa=kappa)  # [n, m]
    # $$M_{(q+1),j}$$, with the interpolation rule for a fractional q
    return _interpolated_rows(margins_t, whole + 1, frac, overwrite=True)  # [n]


def cutoffs(scores: Array, bias: Array, top_k: int) -> Array:
    r"""Each token's cutoff $\alpha_i$, `[m]`: the $(k+1)$-th largest of $s_i + b$, values only.

    The same values as `refimpl.layer.routing.selection_cutoff(scores, bias, top_k)[1]`,
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
    (from `refimpl.layer.routing.selection_cutoff`). Expert $j$ is in token $i$'s
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
    the same in $O(L)$ per row (`refimpl._lib.fast.kth_largest_by_sampling`, a sample that
    discards most entries first, and CuPy's selection kernel).

    `x` must be a 2-D real floating array without NaN (NaN has no place in an order: a sort puts it last,
    a selection anywhere) and $r$ an integer in $[1, L]$ ($[2, L]$ with `previous`); anything else is a
    `TypeError` or `ValueError` naming it. Infinities are ordered as usual.
    """
    check_float_array("x", x, ndim=2)
    previous, overwrite = switch_value(previous, "previous"), switch_value(overwrite, "overwrite")
    r = check_int("r", r, low=2 if previous else 1, high=x.shape[-1])
    _check_no_nan("x", x)
    return _kth_largest(x, r, previous=previous, overwrite=overwrite)


def _check_no_nan(name: str, x: Array) -> None:
    """A `ValueError` naming `x` when it holds NaN; one sum, and the count only when the sum is NaN."""
    xp = array_namespace(x)
    with np.errstate(invalid="ignore"):  # +inf and -inf sum to NaN: then the count decides
        total = float(xp.sum(xp.astype(x, compute_dtype(xp, x), copy=False))) if x.size else 0.0
    if math.isnan(total):
        count = int(xp.sum(xp.astype(xp.isnan(x), xp.int64)))
        if count:  # a sum of +inf and -inf is NaN too, without a NaN in x
            raise ValueError(f"{name} must hold no NaN (it has no place in an order), got {count} NaN entries")


def _kth_largest(x: Array, r: int, *, previous: bool = False, overwrite: bool = False) -> Array | tuple:
    """`kth_largest` for inputs the caller has checked (finite scores and margins, a rank in range)."""
    xp = array_namespace(x)
    length = x.shape[-1]
    if enabled() and is_numpy(xp):
        part = x if overwrite and x.flags.c_contiguous else np.array(x, order="C", copy=True)
        return kth_largest_by_sampling(part, r, previous)
    if enabled() and is_cupy(xp):
        return kth_largest_cupy(x, r, previous)
    # $$x_{(r)} = \text{sort}(x)_{L - r}$$ (ascending: the r-th largest sits at position L - r)
    ordered = xp.sort(x, axis=-1)  # [p, L]
    if previous:
        return ordered[:, length - r], ordered[:, length - r + 1]
    return ordered[:, length - r]


def _interpolated_rows(x: Array, whole: int, frac: float, *, overwrite: bool = False) -> Array:
    r"""Row-wise $x_{(\rho)}$ for the rank $\rho = $ `whole + frac` ($0 \le$ `frac` $< 1$)."""
    if frac == 0.0:
        return _kth_largest(x, whole, overwrite=overwrite)
    # The (whole+1)-th largest and, from the same partition, the whole-th largest.
    lower, upper = _kth_largest(x, whole + 1, previous=True, overwrite=overwrite)  # [p], [p]
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
    _check_no_nan("values", values)
    result = _interpolated_rows(rows, whole, frac)  # [p]
    return result[0] if values.ndim == 1 else result


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
        `[n]` integer token counts of the batch just routed (`refimpl.layer.routing.expert_load`).
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
    if n and int(xp.min(counts)) < 0:
        raise ValueError(f"load must hold token counts, which are never negative, got {int(xp.min(counts))}")
    # $$\operatorname{sign}(q - \text{load}_j) = \operatorname{sign}\bigl(\textstyle\sum_r \text{load}_r - n\,\text{load}_j\bigr)$$
    direction = xp.sign(xp.sum(counts) - n * counts)  # [n] in {-1, 0, 1}
    # $$b_j \leftarrow b_j + \gamma\,\operatorname{sign}(q - \text{load}_j)$$
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, by name
        new = bias + xp.astype(rate * xp.astype(direction, xp.float64), bias.dtype)  # [n]
    if not bool(xp.all(xp.isfinite(new))):
        raise ValueError(f"rate={rate:g} moves the bias beyond what {dtype_name(bias.dtype)} holds (the new bias "
                         "is not finite); the step is meant to be small (Megatron-Core's default is 1e-3)")
    return new


# ---------------------------------------------------------------------------
# The balancer: route with the bias held, then compute the next one
# ---------------------------------------------------------------------------

class QuantileBalancer(Balancer):
    r"""Eq. (14) step by step: route with the held bias, then jump to the quantile bias of this batch.

    Two options belong to the extension, not to the paper (both off by
    default): `leave_one_out=True` uses the leave-one-out cutoffs described in
    the module text, and `damping` $\eta < 1$ moves only a fraction $\eta$ of
    the way to the new bias. Together they let repeated steps on one fixed
    batch reach the LP optimum, which the plain rule does not (see
    `refimpl.balancing.dual`).
    """

    kind = "qb"

    def __init__(self, num_experts: int, top_k: int, *, bias: Array | None = None,
                 dtype: Any = np.float32, leave_one_out: bool = False, damping: float = 1.0) -> None:
        super().__init__(num_experts, top_k, bias=bias, dtype=dtype)
        self.leave_one_out = switch_value(leave_one_out, "leave_one_out")
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
