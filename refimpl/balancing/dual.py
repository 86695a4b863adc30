r"""Appendix C: the balanced-assignment LP, its dual, and why Eq. (14) solves it.

$$
D(\alpha, \beta) = k \sum_i \alpha_i + q \sum_j \beta_j
+ \sum_{i,j} \max\bigl(0,\; s_{i,j} - \alpha_i - \beta_j\bigr)
$$

**The primal.** Perfect balance asks for the assignment of tokens to experts
with the largest total score such that every token gets $k$ experts and every
expert gets $q = mk/n$ tokens:

$$
\max_x \sum_{i,j} s_{i,j} x_{i,j}
\quad\text{s.t.}\quad \sum_j x_{i,j} = k,\;\; \sum_i x_{i,j} = q,\;\; x_{i,j} \in \{0, 1\}.
$$

Relaxing $x \in \{0,1\}$ to $0 \le x \le 1$ costs nothing when $q$ is an
integer: the constraint matrix is the incidence matrix of a bipartite graph,
which is totally unimodular, so the LP has an integral optimal vertex.
`solve_assignment_lp` builds this LP with sparse constraints and solves it with
HiGHS, the reference every other number on this page is checked against.

**The dual.** Put a multiplier $\alpha_i$ on each token's constraint and
$\beta_j$ on each expert's. For fixed multipliers the Lagrangian separates over
the entries: $x_{i,j} = 1$ pays off exactly when $s_{i,j} - \alpha_i - \beta_j > 0$,
which gives $D$ above: convex, piecewise linear, and by weak duality
$\sum s \cdot x \le D(\alpha, \beta)$ for every feasible $x$. At the optimum
the two are equal, and $x^*_{i,j} = 1$ iff $s_{i,j} - \alpha^*_i - \beta^*_j > 0$:
each token takes its top-$k$ of $s_i - \beta^*$. **Routing needs only the expert
side**, $b = -\beta$; $\alpha$ is a per-batch by-product.

**Coordinate descent has closed forms.** With $\beta$ fixed, $D$ in
$\alpha_i$ has slope $k - \#\{j : s_{i,j} - \beta_j > \alpha_i\}$, which
changes sign where exactly $k$ entries lie above: $\alpha_i$ is the
$(k+1)$-th largest of $s_i - \beta$ (`alpha_step`). Symmetrically, with $\alpha$
fixed, $\beta_j$ is the $(q+1)$-th largest of $s_{:,j} - \alpha$
(`beta_step`). With $\beta = -b$ the $\alpha$-step is the cutoff of Eq. (14)
and the $\beta$-step is its quantile, so **one Quantile Balancing update is one
$\alpha$-step followed by one $\beta$-step** (then a common shift
$(\alpha - c, \beta + c)$, which leaves $D$ unchanged; that is the centering).
`coordinate_descent` iterates the pair on one batch and records $D$, the loads
and the selection after every step.

**The sign rule is SignSGD on the same function.** The subgradient of $D$ in
$\beta_j$ is $q - \#\{i : s_{i,j} - \alpha_i - \beta_j > 0\}$, which at the
$\alpha$-step's $\alpha$ is $q - \text{load}_j$. DeepSeek-V3's
$b_j \leftarrow b_j + \gamma\,\operatorname{sign}(q - \text{load}_j)$ is,
with $b = -\beta$, $\beta_j \leftarrow \beta_j - \gamma\,\operatorname{sign}(\partial_{\beta_j} D)$.
`subgradient_check` shows it numerically.

**Sign conventions.** Here $b$ is *added* to the sigmoid scores and
$\beta = -b$. Code that subtracts a "$\beta$" from the scores uses $\beta$
directly. HiGHS minimizes, so the LP is given to it as
$\min\, (-s) \cdot x$ and its equality marginals (the derivatives of *its*
optimum with respect to the right-hand sides $k$ and $q$) come out negated;
`solve_assignment_lp` flips them so that
`dual_objective(scores, r.alpha, r.beta, k)` equals `r.objective`.

**Where coordinate descent stops short.** $D$ is not smooth, and exact
coordinate descent on a non-smooth convex function can stop at a point where
no single block ($\alpha$ or $\beta$) can improve although a joint move could.
Iterating Eq. (14) on one fixed batch does this: it can settle above the LP
optimum with some experts still off target. The examples measure how often and
by how much, and why it does not matter in training, where each update sees a
fresh batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.optimize
import scipy.sparse

from .._lib.validation import check_finite, check_float_array, check_int, check_positive, check_shape
from .._lib.xp import Array, array_namespace, compute_dtype, to_numpy
from ..layer.routing import expert_load, route
from .quantile import kth_largest, quantile_rank, quantile_thresholds, sign_balancing_update

__all__ = [
    "AssignmentLP",
    "DescentTrace",
    "SeparatingDual",
    "SubgradientCheck",
    "alpha_step",
    "beta_step",
    "beta_subgradient",
    "coordinate_descent",
    "dual_objective",
    "separating_dual",
    "solve_assignment_lp",
    "subgradient_check",
]


def _check_scores(scores: Array) -> tuple[int, int]:
    check_float_array("scores", scores, ndim=2)
    check_finite("scores", scores)
    return scores.shape


def _check_vector(name: str, v: Array, size: int) -> None:
    check_float_array(name, v, ndim=1)
    check_shape(name, v, (size,))
    check_finite(name, v)


def _dual_inputs(scores: Array, alpha: Array, beta: Array, top_k: int) -> tuple[Any, int, Array, Array, Array]:
    r"""Check a point $(\alpha, \beta)$ of the dual for `scores`; return the namespace, $k$ and the three in float64."""
    m, n = _check_scores(scores)
    top_k = check_int("top_k", top_k, low=1, high=n)
    _check_vector("alpha", alpha, m)
    _check_vector("beta", beta, n)
    xp = array_namespace(scores, alpha, beta)
    return (xp, top_k, *(xp.astype(v, xp.float64) for v in (scores, alpha, beta)))


def dual_objective(scores: Array, alpha: Array, beta: Array, top_k: int) -> float:
    r"""$D(\alpha, \beta) = k\sum_i \alpha_i + q\sum_j \beta_j + \sum_{i,j}\max(0, s_{i,j} - \alpha_i - \beta_j)$.

    `scores` is `[m, n]`, `alpha` `[m]` (token side), `beta` `[n]` (expert
    side), and $q = mk/n$ (fractional $q$ is allowed: the relaxed LP is still
    defined). Computed in float64 whatever the input dtype, so that duality
    gaps of order $10^{-9}$ stay visible. By weak duality the value bounds the
    score of every balanced assignment from above.
    """
    xp, top_k, s, a, b = _dual_inputs(scores, alpha, beta, top_k)
    m, n = s.shape
    q = m * top_k / n
    # $$\sum_{i,j} \max(0,\; s_{i,j} - \alpha_i - \beta_j)$$
    excess = xp.sum(xp.maximum(s - a[:, None] - b[None, :], 0.0))
    # $$D = k \sum_i \alpha_i + q \sum_j \beta_j + \text{excess}$$
    return float(top_k * xp.sum(a) + q * xp.sum(b) + excess)


def alpha_step(scores: Array, beta: Array, top_k: int) -> Array:
    r"""The exact minimizer of $D$ over $\alpha$ for fixed $\beta$: $\alpha_i = (k{+}1)$-th largest of $s_i - \beta$.

    Returns `[m]`. This is Eq. (14)'s cutoff with $b = -\beta$. Needs $k < n$.
    """
    m, n = _check_scores(scores)
    top_k = check_int("top_k", top_k, low=1, high=n - 1)
    _check_vector("beta", beta, n)
    xp = array_namespace(scores, beta)
    dtype = compute_dtype(xp, scores, beta)
    # $$\alpha_i = (s_i - \beta)_{(k+1)}$$
    shifted = xp.astype(scores, dtype) - xp.astype(beta, dtype)[None, :]  # [m, n]
    return kth_largest(shifted, top_k + 1, overwrite=True)


def beta_step(scores: Array, alpha: Array, top_k: int) -> Array:
    r"""The exact minimizer of $D$ over $\beta$ for fixed $\alpha$: $\beta_j = (q{+}1)$-th largest of $s_{:,j} - \alpha$.

    Returns `[n]`. A fractional $q$ uses the interpolation rule of
    `refimpl.balancing` (between the $(\lfloor q\rfloor+1)$-th and
    $(\lfloor q\rfloor+2)$-th largest with weight $q - \lfloor q \rfloor$).
    This is Eq. (14)'s quantile before centering, $\beta = -\tilde b$.
    """
    m, n = _check_scores(scores)
    whole, frac = quantile_rank(m, n, top_k)
    _check_vector("alpha", alpha, m)
    xp = array_namespace(scores, alpha)
    dtype = compute_dtype(xp, scores, alpha)
    # $$\beta_j = (s_{:,j} - \alpha)_{(q+1)}$$
    return quantile_thresholds(xp.astype(scores, dtype), xp.astype(alpha, dtype), whole, frac)


def beta_subgradient(scores: Array, alpha: Array, beta: Array, top_k: int) -> Array:
    r"""The right derivative of $D$ in each $\beta_j$: $q - \#\{i : s_{i,j} - \alpha_i - \beta_j > 0\}$.

    Returns `[n]` (float64). At $\alpha$ = `alpha_step(scores, beta, k)` the
    count is the load of expert $j$ when routing with $b = -\beta$, so this is
    $q - \text{load}$, the quantity whose sign the sign rule follows.
    """
    xp, top_k, s, a, b = _dual_inputs(scores, alpha, beta, top_k)
    m, n = s.shape
    # beta is subtracted first, as in the alpha-step, so that a token's (k+1)-th entry compares exactly
    # equal to its own cutoff; the other order can round it a unit above and count it.
    above = ((s - b[None, :]) - a[:, None]) > 0.0  # [m, n]
    # $$\partial_{\beta_j} D = q - \#\{i : s_{i,j} - \alpha_i - \beta_j > 0\}$$
    return m * top_k / n - xp.sum(xp.astype(above, xp.float64), axis=0)


# ---------------------------------------------------------------------------
# Coordinate descent on one fixed batch
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DescentTrace:
    r"""The record of `coordinate_descent`, one row per iteration $t = 0, \dots, T$.

    Row 0 is the start: $\beta_0 = -b$ and $\alpha_0$ its $\alpha$-step. Row
    $t \ge 1$ holds $\alpha_t$ = `alpha_step`$(\beta_{t-1})$ and
    $\beta_t$ = `beta_step`$(\alpha_t)$: one Eq. (14) update per row.

    * `objective` `[T+1]`: $D(\alpha_t, \beta_t)$, non-increasing.
    * `primal` `[T+1]`: $\sum s \cdot x$ of the routing with $b = -\beta_t$
      (each token's top-$k$ of $s_i - \beta_t$; balanced only at the optimum).
    * `loads` `[T+1, n]`, `index` `[T+1, m, k]`: that routing.
    * `alpha` `[T+1, m]`, `beta` `[T+1, n]`: the multipliers (not centered).
    * `fixed_point`: the first $t$ with $\beta_t = \beta_{t-1}$ exactly, after
      which nothing can change (the run stops there), or `None`.
    """

    objective: np.ndarray
    primal: np.ndarray
    loads: np.ndarray
    index: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    fixed_point: int | None
    q: float

    @property
    def bias(self) -> np.ndarray:
        """The final routing bias, $b = -\\beta_T$, centered."""
        b = -self.beta[-1]
        return b - b.mean()


def _routing_record(scores: Array, beta: Array, top_k: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Route with b = -beta: (index [m, k], load [n], total raw score of the selection)."""
    xp = array_namespace(scores, beta)
    index, _ = route(scores, -beta, top_k)  # [m, k]
    chosen = xp.take_along_axis(xp.astype(scores, xp.float64), index, axis=-1)  # [m, k]
    return to_numpy(index), to_numpy(expert_load(index, scores.shape[1])), float(xp.sum(chosen))


def coordinate_descent(scores: Array, top_k: int, *, bias: Array | None = None,
                       iterations: int = 50) -> DescentTrace:
    r"""Iterate Eq. (14) on one fixed batch: alternate exact $\alpha$- and $\beta$-steps on $D$.

    Parameters
    ----------
    scores
        `[m, n]` router scores of the batch, held fixed throughout.
    top_k
        $k$, with $k < n$ and at least $n/(n-k)$ tokens.
    bias
        `[n]` starting bias $b$ ($\beta_0 = -b$); zeros by default.
    iterations
        The most updates to make; the run stops early at an exact fixed point.

    Returns
    -------
    A `DescentTrace`. Its `objective` never increases; whether it reaches
    the LP optimum (`solve_assignment_lp`) is exactly the question the
    examples study.
    """
    m, n = _check_scores(scores)
    top_k = check_int("top_k", top_k, low=1, high=n - 1)
    quantile_rank(m, n, top_k)
    iterations = check_int("iterations", iterations, low=0)
    xp = array_namespace(scores)
    dtype = compute_dtype(xp, scores)
    if bias is None:
        beta = xp.zeros(n, dtype=dtype)
    else:
        _check_vector("bias", bias, n)
        beta = -xp.astype(xp.asarray(bias), dtype)
    alpha = alpha_step(scores, beta, top_k)
    objectives, primals, loads, indices, alphas, betas = [], [], [], [], [], []

    def record(a: Array, b: Array) -> None:
        index, load, total = _routing_record(scores, b, top_k)
        objectives.append(dual_objective(scores, a, b, top_k))
        primals.append(total)
        loads.append(load)
        indices.append(index)
        alphas.append(to_numpy(a))
        betas.append(to_numpy(b))

    record(alpha, beta)
    fixed_point = None
    for t in range(1, iterations + 1):
        # One Eq. (14) update: the alpha-step (cutoffs), then the beta-step (quantiles).
        alpha = alpha_step(scores, beta, top_k)  # [m]
        new_beta = beta_step(scores, alpha, top_k)  # [n]
        record(alpha, new_beta)
        if bool(xp.all(new_beta == beta)):
            fixed_point = t
            break
        beta = new_beta
    return DescentTrace(
        objective=np.array(objectives), primal=np.array(primals), loads=np.stack(loads),
        index=np.stack(indices), alpha=np.stack(alphas), beta=np.stack(betas),
        fixed_point=fixed_point, q=m * top_k / n)


# ---------------------------------------------------------------------------
# The LP itself, solved by HiGHS
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class AssignmentLP:
    r"""The balanced-assignment LP solved by HiGHS.

    * `x` `[m, n]`: the primal solution (integral up to solver tolerance for integer $q$).
    * `objective`: $\max \sum s \cdot x$.
    * `alpha` `[m]`, `beta` `[n]`: an optimal dual, in the convention of
      `dual_objective` (so $D(\alpha, \beta)$ equals `objective`).
    * `integrality`: $\max |x - \operatorname{round}(x)|$, 0 for an integral solution.
    * `q`, `iterations`, `message`: the target load and HiGHS's own report.
    """

    x: np.ndarray
    objective: float
    alpha: np.ndarray
    beta: np.ndarray
    integrality: float
    q: int
    iterations: int
    message: str

    @property
    def index(self) -> np.ndarray:
        """The $k$ experts each token gets in `x`, `[m, k]`, in increasing id (from the rounded solution)."""
        k = int(round(self.x[0].sum()))
        return np.sort(np.argsort(-np.round(self.x), axis=1, kind="stable")[:, :k], axis=1)


def _assignment_constraints(m: int, n: int) -> scipy.sparse.csr_array:
    r"""The $(m + n) \times mn$ equality matrix: rows $i < m$ sum token $i$'s row of $x$, rows $m + j$ its column $j$.

    $x$ is flattened row-major, so $x_{i,j}$ is variable $i n + j$.
    """
    variable = np.arange(m * n)  # [m*n]
    token_row = variable // n  # the token of each variable
    expert_row = m + variable % n  # the expert of each variable, after the m token rows
    rows = np.concatenate([token_row, expert_row])  # [2mn]
    cols = np.concatenate([variable, variable])  # [2mn]
    ones = np.ones(2 * m * n)
    return scipy.sparse.csr_array((ones, (rows, cols)), shape=(m + n, m * n))


def solve_assignment_lp(scores: Array, top_k: int, *, options: dict[str, Any] | None = None) -> AssignmentLP:
    r"""Solve the balanced-assignment LP with HiGHS and recover its dual.

    $$
    \max_x \sum_{i,j} s_{i,j} x_{i,j}
    \quad\text{s.t.}\quad \sum_j x_{i,j} = k,\; \sum_i x_{i,j} = q,\; 0 \le x \le 1
    $$

    Parameters
    ----------
    scores
        `[m, n]` scores (any array namespace; converted to NumPy float64).
    top_k
        $k \ge 1$. $q = mk/n$ must be an integer: the project only compares the
        LP with Eq. (14) where the integral problem exists.
    options
        Passed to `scipy.optimize.linprog` (for example `{"time_limit": 10}`).
        Presolve is off unless `{"presolve": True}` is given: on this problem
        it costs HiGHS more than the solve (4 s against 0.07 s at
        $m = 512$, $n = 32$ on the project's 2-core machine).

    Returns
    -------
    An `AssignmentLP`.

    Raises
    ------
    ValueError
        Non-finite scores; $q$ not an integer; $k > n$ (then $q > m$ and no
        assignment exists); or HiGHS not reaching an optimum (the message
        carries HiGHS's own words).
    """
    m, n = _check_scores(scores)
    if m == 0:
        raise ValueError("scores must hold at least one token (got m=0): the assignment LP of no tokens is empty")
    top_k = check_int("top_k", top_k, low=1)
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict of HiGHS settings for scipy.optimize.linprog, got "
                        f"{type(options).__name__}")
    if top_k > n:
        raise ValueError(
            f"the assignment LP is infeasible: top_k={top_k} > n={n} asks each token for more distinct "
            f"experts than exist (equivalently q = mk/n = {m * top_k / n:g} > m = {m})")
    if (m * top_k) % n:
        raise ValueError(
            f"the assignment LP needs an integer target load q = mk/n, got m*k/n = {m}*{top_k}/{n} = "
            f"{m * top_k / n:.6g}; choose m a multiple of n/gcd(n, k) = {n // math.gcd(n, top_k)}")
    q = m * top_k // n
    s = np.asarray(to_numpy(scores), dtype=np.float64)
    # HiGHS minimizes, so the objective is the negated score: min (-s) . x
    cost = -s.reshape(-1)  # [m*n]
    rhs = np.concatenate([np.full(m, float(top_k)), np.full(n, float(q))])  # [m + n]
    # HiGHS's presolve spends far longer on this problem than the simplex itself, so it is off by default.
    settings = {"presolve": False, **(options or {})}
    result = scipy.optimize.linprog(cost, A_eq=_assignment_constraints(m, n), b_eq=rhs, bounds=(0.0, 1.0),
                                    method="highs", options=settings)
    if result.status != 0:
        raise ValueError(f"HiGHS did not solve the assignment LP (status {result.status}): {result.message}")
    x = result.x.reshape(m, n)  # [m, n]
    # `eqlin.marginals` are d(min of -s.x)/d(rhs). The maximum is -(that minimum), so the dual of the
    # maximization, the alpha and beta of D, is the negated marginals:
    # $$\alpha_i = \partial\,\text{opt} / \partial k_i, \qquad \beta_j = \partial\,\text{opt} / \partial q_j$$
    duals = -np.asarray(result.eqlin.marginals, dtype=np.float64)  # [m + n]
    return AssignmentLP(
        x=x, objective=float(-result.fun), alpha=duals[:m], beta=duals[m:],
        integrality=float(np.max(np.abs(x - np.round(x)))), q=q,
        iterations=int(result.nit), message=str(result.message))


@dataclass(frozen=True)
class SeparatingDual:
    r"""An optimal dual that separates the LP's assignment strictly, if one exists.

    `alpha` `[m]`, `beta` `[n]`: dual optimal for the assignment `x` it was
    built from; `margin`: the largest $t$ with
    $s_{i,j} - \alpha_i - \beta_j \ge t$ where $x_{i,j} = 1$ and $\le -t$ where
    $x_{i,j} = 0$. `margin > 0` means `x` is the *unique* optimum and routing
    with $b = -\beta$ reproduces it exactly.
    """

    alpha: np.ndarray
    beta: np.ndarray
    margin: float


def separating_dual(scores: Array, x: Array) -> SeparatingDual:
    r"""The optimal dual of largest separation for an optimal assignment `x` (a second, small LP).

    A simplex solver returns a *vertex* of the dual optimal set, and a vertex
    sits on its boundary: some entries have $s_{i,j} - \alpha_i - \beta_j = 0$
    exactly, so the top-$k$ of $s_i - \beta^*$ has ties at its edge, and the
    tie rule (lower id first), not the LP, decides those tokens. Any $(\alpha,
    \beta)$ with $s - \alpha - \beta \ge 0$ on the chosen entries and $\le 0$ on
    the others is also optimal (then $D(\alpha, \beta) = \sum s \cdot x$). This
    function asks HiGHS for the one that maximizes the smallest gap $t$:

    $$
    \max_{\alpha, \beta, t \le 1} t \quad\text{s.t.}\quad
    \alpha_i + \beta_j + t \le s_{i,j} \;(x_{i,j} = 1), \qquad
    -\alpha_i - \beta_j + t \le -s_{i,j} \;(x_{i,j} = 0).
    $$

    It has $mn$ inequality rows, so it is meant for the cross-check sizes
    (hundreds of tokens), not for K3 scale.
    """
    m, n = _check_scores(scores)
    s = np.asarray(to_numpy(scores), dtype=np.float64)
    chosen = np.round(np.asarray(to_numpy(x), dtype=np.float64)) == 1.0  # [m, n]
    if chosen.shape != (m, n):
        raise ValueError(f"x must have shape [{m}, {n}] like scores, got {list(chosen.shape)}")
    sign = np.where(chosen, 1.0, -1.0).reshape(-1)  # +1 on chosen entries, -1 elsewhere
    variable = np.arange(m * n)
    # Row (i, j): sign * (alpha_i + beta_j) + t <= sign * s_ij; columns: alpha [m], beta [n], t [1].
    rows = np.concatenate([variable, variable, variable])
    cols = np.concatenate([variable // n, m + variable % n, np.full(m * n, m + n)])
    data = np.concatenate([sign, sign, np.ones(m * n)])
    a_ub = scipy.sparse.csr_array((data, (rows, cols)), shape=(m * n, m + n + 1))
    cost = np.zeros(m + n + 1)
    cost[-1] = -1.0  # maximize t
    bounds = [(None, None)] * (m + n) + [(None, 1.0)]
    bounds[m] = (0.0, 0.0)  # beta_0 = 0 fixes the common shift (alpha - c, beta + c)
    result = scipy.optimize.linprog(cost, A_ub=a_ub, b_ub=sign * s.reshape(-1), bounds=bounds,
                                    method="highs", options={"presolve": False})
    if result.status != 0:
        raise ValueError(f"HiGHS did not solve the separation LP (status {result.status}): {result.message}")
    return SeparatingDual(alpha=result.x[:m], beta=result.x[m:m + n], margin=float(result.x[-1]))


# ---------------------------------------------------------------------------
# The sign rule as SignSGD
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SubgradientCheck:
    r"""Numbers showing that the sign rule follows the sign of $-\partial_\beta D$.

    * `load` `[n]`: the loads when routing with the bias $b = -\beta$.
    * `q_minus_load` `[n]`: the subgradient formula $q - \text{load}$.
    * `finite_difference` `[n]`: $(D(\alpha, \beta + h e_j) - D(\alpha, \beta)) / h$, measured.
    * `sign_rule_step` `[n]`: the change of $\beta = -b$ made by one sign-rule
      step with $\gamma = 1$, which equals $-\operatorname{sign}(\partial_\beta D)$.
    """

    load: np.ndarray
    q_minus_load: np.ndarray
    finite_difference: np.ndarray
    sign_rule_step: np.ndarray


def subgradient_check(scores: Array, bias: Array, top_k: int, *, step: float = 1e-6) -> SubgradientCheck:
    r"""Measure $\partial_{\beta_j} D$ by finite differences and compare it with $q - \text{load}_j$.

    $\alpha$ is the $\alpha$-step of $\beta = -b$ (the cutoffs of the routing
    with `bias`). Each $\beta_j$ is moved by `step` in turn and $D$ is
    recomputed with `dual_objective` (a loop over experts; meant for small
    batches). The right derivative is exact unless some $s_{i,j} - \alpha_i - \beta_j$
    lies in $(0, h)$, which for a small `step` is rounding-level.
    """
    m, n = _check_scores(scores)
    top_k = check_int("top_k", top_k, low=1, high=n - 1)
    _check_vector("bias", bias, n)
    step = check_positive("step", step)
    xp = array_namespace(scores, bias)
    s = xp.astype(scores, xp.float64)
    beta = -xp.astype(bias, xp.float64)  # [n]
    if bool(xp.any(beta + step == beta)):  # a step below float64's spacing at beta_j measures nothing
        raise ValueError(f"step must move every beta_j = -b_j in float64, got {step:g}, which is below the "
                         f"spacing of float64 at max |b| = {float(xp.max(xp.abs(beta))):.6g}")
    alpha = alpha_step(s, beta, top_k)  # [m]
    base = dual_objective(s, alpha, beta, top_k)
    finite_difference = np.empty(n)
    for j in range(n):
        moved = xp.where(xp.arange(n) == j, beta + step, beta)  # beta + h e_j
        finite_difference[j] = (dual_objective(s, alpha, moved, top_k) - base) / step
    index, _ = route(s, -beta, top_k)
    load = expert_load(index, n)
    # The sign rule's step does not depend on b; applied to b = 0 it is the step itself. With b = -beta
    # the change of beta is minus the change of b.
    sign_step = -sign_balancing_update(load, xp.zeros_like(beta), 1.0)
    return SubgradientCheck(
        load=to_numpy(load), q_minus_load=to_numpy(beta_subgradient(s, alpha, beta, top_k)),
        finite_difference=finite_difference, sign_rule_step=to_numpy(sign_step))
