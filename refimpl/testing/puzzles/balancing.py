r"""Puzzles 5-8, balancing: the cutoffs and the Quantile Balancing update (Eq. 14), the dual coordinate step
(Appendix C) and the sign rule as SignSGD on the dual."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

from refimpl import (
    alpha_step,
    beta_step,
    dual_objective,
    quantile_balancing_update,
    sign_balancing_update,
)
from refimpl import cutoffs as reference_cutoffs
from refimpl.testing import check_balancing_update
from refimpl.testing import strategies as rst
from refimpl.testing.puzzles.core import (
    Case,
    Mistake,
    Puzzle,
    Trial,
    _array_output,
    _differ_arrays,
    _eps_close,
    _float32_like,
    _float32_valued,
    _Malformed,
    _run_kit,
    _settings,
    _show_array,
)

# ---------------------------------------------------------------------------
# 5. The cutoffs (Eq. 14, step 1)
# ---------------------------------------------------------------------------

def cutoffs(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Each token's cutoff alpha_i: the (k+1)-th largest biased score s_i + b.

    scores [m, n], bias [n], top_k (k < n)  ->  alpha [m]
    """
    biased = scores + bias[None, :]
    # Each row from the largest down; position top_k (counting from 0) is the (k+1)-th largest
    ordered = -np.sort(-biased, axis=1)
    return ordered[:, top_k]


@st.composite
def _cutoff_cases(draw: st.DrawFn, ties: bool) -> Case:
    case = draw(rst.routing_cases(distinct=not ties, ties=ties, max_tokens=6, max_experts=8,
                                  allow_all_experts=False))
    return Case((case.scores, case.bias, case.top_k))


def _kth_of(values: Callable[[np.ndarray, np.ndarray], np.ndarray], rank: Callable[[int], int]
            ) -> Callable[..., np.ndarray]:
    def answer(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        return -np.sort(-values(scores, bias), axis=1)[:, rank(top_k)]
    return answer


def _raw_score_at_cutoff(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    order = np.argsort(-(scores + bias), axis=1, kind="stable")
    return np.take_along_axis(scores, order[:, top_k: top_k + 1], axis=1)[:, 0]


def _raw_score_of_a_cutoff_expert(got: np.ndarray, wrong: np.ndarray, case: Case) -> bool:
    """`like` for the raw score read at the cutoff: each token's answer is the raw score s_ij of an expert
    whose biased score is the (k+1)-th largest. With ties there the expert depends on how the sort orders
    equal values (np.argsort's default kind), so any of the tied experts' raw scores is this mistake."""
    scores, bias, top_k = case.args
    biased = scores + bias[None, :]
    alpha = -np.sort(-biased, axis=1)[:, top_k]  # [m]
    for i in range(scores.shape[0]):
        candidates = scores[i, biased[i] == alpha[i]]
        if not np.any(np.abs(candidates - got[i]) <= 64 * np.finfo(np.float64).eps * (1.0 + abs(got[i]))):
            return False
    return True


def _biased(scores: np.ndarray, bias: np.ndarray) -> np.ndarray:
    return scores + bias[None, :]


def _distinct_kth(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    return np.array([-np.unique(-row)[top_k] for row in scores + bias[None, :]])


FLOAT32_WHY = ("The arguments arrive in float64 and the expected values are computed in float64; float32 arithmetic "
               "keeps about 7 significant digits instead of 16. Keep the arguments' type.")


CUTOFFS = Puzzle(
    number=5, name="cutoffs", title="The cutoffs",
    spec=r"""Quantile Balancing (Eq. 14) starts by routing each token with the top-$(k{+}1)$ of its biased
scores instead of the top-$k$. The first $k$ are the route; the $(k{+}1)$-th biased score is the token's
**cutoff**, the $(k{+}1)$-th largest of $s_{i,1} + b_1, \dots, s_{i,n} + b_n$:

$$
\alpha_i = \bigl(s_i + b\bigr)_{(k+1)},
$$

the value an expert outside the route must beat to enter token $i$'s top-$k$: expert $j$ is chosen exactly
when $s_{i,j} + b_j > \alpha_i$ (with the lower id first on a tie, puzzle 1). The cutoffs turn selection into
a threshold per token, which is what lets Eq. (14) count, for each expert, how many tokens a new bias would
bring it.

Write `cutoffs(scores, bias, top_k)`: `scores` `[m, n]`, `bias` `[n]`, $1 \le k < n$; return `alpha`, `[m]`.
Ties do not matter here: the $(k{+}1)$-th largest value is one number however equal values are ordered.""",
    hint=r"""Sort each row of `scores + bias` from the largest (`-np.sort(-values, axis=1)`): column 0 is the
largest, so column `top_k` is the $(k{+}1)$-th largest.""",
    solution=cutoffs,
    reference=lambda s, b, k: np.asarray(reference_cutoffs(s, b, k)),
    reference_name="refimpl.cutoffs(scores, bias, top_k)",
    trials=(Trial("inputs whose biased scores are well separated", _cutoff_cases(ties=False)),
            Trial("inputs with exact ties among the biased scores", _cutoff_cases(ties=True))),
    output=_array_output("alpha", lambda c: (c.args[0].shape[0],), "float"),
    agree=lambda got, expected, case: _eps_close(got, expected, scale=2.0 + np.max(np.abs(case.args[1]))),
    show=_show_array,
    mistakes=(
        Mistake("kth_not_k_plus_1th", "the k-th largest biased score instead of the (k+1)-th",
                "The k-th largest is the last expert inside the route; the cutoff is the best expert outside it, "
                "the (k+1)-th, the score an outsider has to beat.", _kth_of(_biased, lambda k: k - 1)),
        Mistake("bias_left_out", "the cutoff read from the raw scores s, without the bias",
                "Selection is by s + b, so the cutoff, the value to beat in that selection, is a biased score.",
                _kth_of(lambda s, b: s, lambda k: k)),
        Mistake("raw_score_of_the_cutoff_expert", "the raw score of the (k+1)-th expert instead of its biased score",
                "alpha_i is compared with s_ij + b_j, so it is itself the biased value s + b of the (k+1)-th "
                "expert, not that expert's raw score.", _raw_score_at_cutoff, like=_raw_score_of_a_cutoff_expert),
        Mistake("counted_from_the_bottom", "the (k+1)-th smallest instead of the (k+1)-th largest",
                "An ascending sort puts the smallest first: position k of the descending order is the one wanted.",
                lambda s, b, k: np.sort(s + b, axis=1)[:, k]),
        Mistake("bias_subtracted", "the bias subtracted from the scores instead of added",
                "Selection, and so the cutoff, is by s + b: the bias is added.",
                _kth_of(lambda s, b: s - b[None, :], lambda k: k)),
        Mistake("distinct_values", "the (k+1)-th largest distinct value (np.unique), not counting ties",
                "Equal biased scores each take a rank: with two experts tied for first, the second largest is "
                "that same value. np.unique keeps one of each value and reads past the ties.", _distinct_kth),
        Mistake("midpoint", "the midpoint of the k-th and (k+1)-th biased scores",
                "The cutoff is the (k+1)-th biased score itself, the best score outside the route, not a value "
                "halfway to the last one inside it.",
                lambda s, b, k: 0.5 * (-np.sort(-(s + b), axis=1)[:, k - 1] - np.sort(-(s + b), axis=1)[:, k])),
        Mistake("float32", "the cutoffs computed in float32", FLOAT32_WHY,
                lambda s, b, k: cutoffs(s.astype(np.float32), b.astype(np.float32), k),
                like=_float32_like, narrow=True),
    ),
)


# ---------------------------------------------------------------------------
# 6. The Quantile Balancing update, with ties (Eq. 14)
# ---------------------------------------------------------------------------

def qb_update(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Eq. (14): b~_j = -(the (q+1)-th largest margin s_ij - alpha_i of expert j), then centred.

    scores [m, n], bias [n], top_k (k < n; q = m k / n a whole number)  ->  new bias [n]
    """
    m, n = scores.shape
    q = m * top_k // n
    # Step 1: each token's cutoff, the (k+1)-th largest biased score
    alpha = -np.sort(-(scores + bias[None, :]), axis=1)[:, top_k]
    # Step 2: the margins M_ij = s_ij - alpha_i; each column from the largest down
    margins = -np.sort(-(scores - alpha[:, None]), axis=0)
    # The (q+1)-th largest of each column (equal values counted one by one), negated
    b_tilde = -margins[q]
    # Step 3: remove the mean, which changes no top-k
    return b_tilde - b_tilde.mean()


@st.composite
def _update_cases(draw: st.DrawFn, ties: bool) -> Case:
    case = draw(rst.routing_cases(distinct=not ties, ties=ties, max_tokens=12, max_experts=6, integer_q=True,
                                  for_update=True))
    return Case((case.scores, case.bias, case.top_k))


def _update_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    return _eps_close(got, expected, scale=2.0 + np.max(np.abs(case.args[1])))


def _qb_variant(*, rank_shift: int = 0, center: str = "mean", sign: float = -1.0, alpha_rank_shift: int = 0,
                distinct: bool = False, quantile: bool = False, ascending: bool = False, axis: int = 0,
                biased_margins: bool = False, alpha_bias: bool = True, dtype: type = np.float64
                ) -> Callable[..., np.ndarray]:
    """The exact update with one rule changed, for the catalogue of mistakes."""

    def answer(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        scores, bias = scores.astype(dtype), bias.astype(dtype)
        m, n = scores.shape
        q = m * top_k // n
        alpha = -np.sort(-(scores + (bias[None, :] if alpha_bias else 0)), axis=1)[:, top_k + alpha_rank_shift]
        margin = (scores + bias[None, :] if biased_margins else scores) - alpha[:, None]
        if quantile:
            threshold = np.quantile(margin, 1.0 - top_k / n, axis=0)
        elif distinct:
            threshold = np.array([-np.unique(-margin[:, j])[q] for j in range(n)])
        elif ascending:
            threshold = np.sort(margin, axis=0)[q]
        else:
            threshold = -np.sort(-margin, axis=axis)[q + rank_shift]
        b_tilde = sign * threshold
        if center == "median":
            return b_tilde - np.median(b_tilde)
        return b_tilde - b_tilde.mean() if center == "mean" else b_tilde

    return answer


def _kit_balancing(fn: Callable[..., Any]) -> str:
    return _run_kit("check_balancing_update", lambda: check_balancing_update(
        fn, dtype=np.float64, rtol=1e-12, atol=1e-12, integer_q_only=True, max_experts=6,
        settings=_settings(30)))


QB_UPDATE = Puzzle(
    number=6, name="qb_update", title="The Quantile Balancing update, with ties",
    spec=r"""A batch of $m$ tokens, each routed to $k$ of $n$ experts, is balanced when every expert gets
the **target load** $q = mk/n$. Quantile Balancing reads the bias that would give each expert exactly $q$
tokens off the batch, with no step size:

1. the cutoffs $\alpha_i$ = the $(k{+}1)$-th largest of $s_i + b$ (puzzle 5);
2. the **margins** $M_{i,j} = s_{i,j} - \alpha_i$: with the cutoffs held, token $i$ takes expert $j$ under a
   new bias $\tilde b$ when $s_{i,j} + \tilde b_j > \alpha_i$, that is when $M_{i,j} > -\tilde b_j$. For
   exactly $q$ margins of column $j$ to clear the bar, the bar is the $(q{+}1)$-th largest margin of the column;
3. **centre**: $b^{(t+1)} = \tilde b - \operatorname{mean}(\tilde b)$. A common shift changes no top-$k$,
   and keeping the bias near zero keeps float32 fine enough to separate the experts.

$$
\tilde b_j = -\bigl(M_{:,j}\bigr)_{(q+1)},
$$

$$
b^{(t+1)} = \tilde b - \operatorname{mean}(\tilde b).
$$

**Ties.** Equal margins are order statistics like any others: a value that occurs $c$ times takes $c$
consecutive ranks. Ties are not rare here, they are built in: for every token whose $(k{+}1)$-th choice is
expert $j$, $\alpha_i = s_{i,j} + b_j$ and so $M_{i,j} = -b_j$ exactly. Each column has this **atom** of equal
margins at $-b_j$, between the tokens that chose $j$ (above) and those that did not (below); when the
$(q{+}1)$-th largest falls inside it, $\tilde b_j = b_j$ and the expert's bias does not move. The check
draws batches with many exact ties (scores and biases on a grid of eighths).

Write `qb_update(scores, bias, top_k)`: `scores` `[m, n]`, `bias` `[n]`, $1 \le k < n$, and $m$ a multiple of
$n / \gcd(n, k)$ so that $q = mk/n$ is a whole number (refimpl interpolates between two ranks for a
fractional $q$; the page on Eq. (14) has that rule). Return the new bias, `[n]`.""",
    hint=r"""`alpha = -np.sort(-(scores + bias), axis=1)[:, top_k]`. Then sort each **column** of
`scores - alpha[:, None]` from the largest (`axis=0`): row `q` of the sorted margins (counting from 0) is the
$(q{+}1)$-th largest of every column. A sort counts equal values one by one, which is what the rule wants.""",
    solution=qb_update,
    reference=lambda s, b, k: np.asarray(quantile_balancing_update(s, b, k)),
    reference_name="refimpl.quantile_balancing_update(scores, bias, top_k)",
    trials=(Trial("batches whose biased scores are well separated", _update_cases(ties=False)),
            Trial("batches with many exact ties (scores and biases in eighths)", _update_cases(ties=True))),
    output=_array_output("the new bias", lambda c: (c.args[0].shape[1],), "float"),
    agree=_update_agree,
    show=_show_array,
    mistakes=(
        Mistake("qth_not_q_plus_1th", "the q-th largest margin instead of the (q+1)-th",
                "With the bar at the q-th largest margin only q - 1 margins clear it (the q-th sits on it, and "
                "must be strictly above): the bar is the (q+1)-th, so that exactly q lie above.",
                _qb_variant(rank_shift=-1)),
        Mistake("not_centred", "the new bias not centred",
                "Step 3 subtracts the mean: it changes no route, and without it the bias drifts from update to "
                "update to where float32 (and bfloat16 far worse) can no longer tell the experts apart.",
                _qb_variant(center="none")),
        Mistake("sign_flipped", "the sign of the update flipped",
                "b~_j = -(the (q+1)-th largest margin): an over-loaded expert has many large margins, so its bar "
                "rises and its bias falls. Without the minus sign the busiest experts are pushed up.",
                _qb_variant(sign=1.0)),
        Mistake("numpy_quantile", "np.quantile(margins, 1 - k/n) with its default interpolation",
                "A library quantile interpolates between order statistics with its own convention (NumPy's "
                "default puts the (1 - k/n) quantile at position (m - 1)(1 - k/n)); the rule is the (q+1)-th "
                "largest margin itself.", _qb_variant(quantile=True)),
        Mistake("alpha_is_kth", "the cutoff taken as the k-th biased score instead of the (k+1)-th",
                "alpha_i is the best score outside the route, the (k+1)-th; the k-th is inside it, and the "
                "margins measured from it are all shifted.", _qb_variant(alpha_rank_shift=-1)),
        Mistake("ties_counted_once", "equal margins counted once (distinct values ranked)",
                "The (q+1)-th largest counts equal values one by one: the atom of tokens whose margin is exactly "
                "-b_j holds many ranks, and ranking only distinct values (np.unique) skips past them.",
                _qb_variant(distinct=True)),
        Mistake("counted_from_the_bottom", "the (q+1)-th smallest margin instead of the (q+1)-th largest",
                "np.sort sorts ascending, so its row q is the (q+1)-th smallest of each column; the bar is the "
                "(q+1)-th largest margin, row q of the column sorted from the largest.",
                _qb_variant(ascending=True)),
        Mistake("margins_from_biased_scores", "the margins taken from s + b instead of s",
                "M_ij = s_ij - alpha_i uses the raw score: the new bias replaces the old one, it is not added to "
                "it. Margins from s + b give b~ - b, the new bias minus the old.",
                _qb_variant(biased_margins=True)),
        Mistake("cutoff_without_bias", "the cutoffs taken from the raw scores s instead of s + b",
                "alpha_i is the (k+1)-th largest biased score s_i + b: the cutoff of the route the old bias chose.",
                _qb_variant(alpha_bias=False)),
        Mistake("centred_on_the_median", "the new bias centred on its median instead of its mean",
                "Step 3 subtracts the mean of b~: any common shift leaves the routes as they are, but the rule "
                "fixes this one, so that the bias sums to zero.", _qb_variant(center="median")),
        Mistake("wrong_axis", "the margins sorted along each token's experts (axis 1) instead of each expert's "
                "tokens (axis 0)",
                "The bar of expert j is an order statistic of column j, its margins over the m tokens: sort "
                "along axis 0 of the [m, n] margins.", _qb_variant(axis=1)),
        Mistake("float32", "the update computed in float32", FLOAT32_WHY,
                _qb_variant(dtype=np.float32), like=_float32_like, narrow=True),
    ),
    kit=_kit_balancing,
)


# ---------------------------------------------------------------------------
# 7. The dual coordinate step (Appendix C)
# ---------------------------------------------------------------------------

def dual_step(scores: np.ndarray, beta: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """One exact coordinate step on the dual: alpha from beta, then the new beta from that alpha.

    scores [m, n], beta [n], top_k (k < n; q = m k / n whole)  ->  (alpha [m], new_beta [n])
    """
    m, n = scores.shape
    q = m * top_k // n
    # alpha-step: alpha_i = the (k+1)-th largest of s_i - beta
    alpha = -np.sort(-(scores - beta[None, :]), axis=1)[:, top_k]
    # beta-step: beta_j = the (q+1)-th largest of s_:,j - alpha
    new_beta = -np.sort(-(scores - alpha[:, None]), axis=0)[q]
    return alpha, new_beta


def _dual_reference(scores: np.ndarray, beta: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    alpha = np.asarray(alpha_step(scores, beta, top_k))
    return alpha, np.asarray(beta_step(scores, alpha, top_k))


@st.composite
def _dual_cases(draw: st.DrawFn, ties: bool) -> Case:
    case = draw(_update_cases(ties))
    scores, bias, k = case.args
    return Case((scores, -bias, k))


def _dual_output(value: Any, case: Case) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise _Malformed(f"it returned {type(value).__name__}; return the pair (alpha, new_beta)")
    m, n = case.args[0].shape
    alpha = _array_output("alpha", lambda c: (m,), "float")(value[0], case)
    beta = _array_output("new_beta", lambda c: (n,), "float")(value[1], case)
    return alpha, beta


def _dual_agree(got: tuple, expected: tuple, case: Case) -> bool:
    scale = 2.0 + np.max(np.abs(case.args[1]))
    return _eps_close(got[0], expected[0], scale) and _eps_close(got[1], expected[1], scale)


def _dual_show(value: tuple) -> str:
    return _show_array(value[0], prefix="alpha    = ") + "\n" + _show_array(value[1], prefix="new_beta = ")


def _dual_differ(case: Case, expected: tuple, got: tuple) -> list[str]:
    """What differs, alpha and new_beta each on its own."""
    return [*_differ_arrays(case, expected[0], got[0], "alpha"), *_differ_arrays(case, expected[1], got[1],
                                                                                  "new_beta")]


def _dual_explain(case: Case, expected: tuple, got: tuple) -> list[str]:
    """The dual objective before the step, after the exact step and after the learner's."""
    scores, beta, k = case.args
    before = dual_objective(scores, expected[0], beta, k)
    exact = dual_objective(scores, *expected, k)
    yours = dual_objective(scores, *got, k)
    return [f"D(alpha, beta) after the alpha-step: {before:.10g}; after the exact beta-step: {exact:.10g}; "
            f"at your (alpha, new_beta): {yours:.10g}" + (" (higher than the exact step's)" if yours > exact else "")]


def _dual_variant(*, alpha_shift: int = 0, beta_shift: int = 0, beta_sign: float = -1.0,
                  centre: bool = False, ascending: bool = False, negated: bool = False, axis: int = 0,
                  dtype: type = np.float64) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    def answer(scores: np.ndarray, beta: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, beta = scores.astype(dtype), beta.astype(dtype)
        m, n = scores.shape
        q = m * top_k // n
        alpha = -np.sort(-(scores + beta_sign * beta[None, :]), axis=1)[:, top_k + alpha_shift]
        if ascending:
            new_beta = np.sort(scores - alpha[:, None], axis=0)[q]
        else:
            new_beta = -np.sort(-(scores - alpha[:, None]), axis=axis)[q + beta_shift]
        if negated:
            new_beta = -new_beta
        return alpha, (new_beta - new_beta.mean() if centre else new_beta)
    return answer


DUAL_STEP = Puzzle(
    number=7, name="dual_step", title="The dual coordinate step",
    spec=r"""Why is Eq. (14) right? Perfect balance is an assignment problem: give each token $k$ experts
and each expert $q = mk/n$ tokens with the largest total score. Its LP dual, with a multiplier $\alpha_i$ per
token and $\beta_j$ per expert, is

$$
\begin{aligned}
D(\alpha, \beta) = {}& k \sum_i \alpha_i + q \sum_j \beta_j \\
&+ \sum_{i,j} \max\bigl(0,\; s_{i,j} - \alpha_i - \beta_j\bigr),
\end{aligned}
$$

convex and piecewise linear; its minimum equals the best balanced score, and at the minimum each token takes
its top-$k$ of $s_i - \beta$: routing needs only the expert side, with **$b = -\beta$**.

**Coordinate descent has closed forms.** With $\beta$ fixed, $D$ in $\alpha_i$ has slope
$k - \#\{j : s_{i,j} - \beta_j > \alpha_i\}$, which changes sign where exactly $k$ values lie above: $\alpha_i$ is
the $(k{+}1)$-th largest of $s_i - \beta$. Symmetrically, with $\alpha$ fixed, $\beta_j$ is the $(q{+}1)$-th
largest of column $j$ of $s - \alpha$:

$$
\alpha_i = \bigl(s_i - \beta\bigr)_{(k+1)},
$$

$$
\beta_j = \bigl(s_{:,j} - \alpha\bigr)_{(q+1)}.
$$

The $\alpha$-step is the cutoff of puzzle 5 (with $b = -\beta$) and the $\beta$-step is the quantile of
puzzle 6 before centring: one Quantile Balancing update **is** one $\alpha$-step followed by one $\beta$-step.
Each exact step can only lower $D$.

Write `dual_step(scores, beta, top_k)`: `scores` `[m, n]`, `beta` `[n]`, $1 \le k < n$, $q = mk/n$ whole.
Return the pair `(alpha, new_beta)`: the $\alpha$-step from `beta`, `[m]`, then the $\beta$-step from that
$\alpha$, `[n]`. Do not centre: the dual's own coordinates are wanted.""",
    hint=r"""Puzzle 5 with `-beta` in place of `bias` gives alpha; puzzle 6's step 2 without the minus sign
and without centring gives the new beta: row `q` of the columns of `scores - alpha[:, None]` sorted from the
largest.""",
    solution=dual_step,
    reference=_dual_reference,
    reference_name="refimpl.alpha_step(scores, beta, top_k), then refimpl.beta_step(scores, alpha, top_k)",
    trials=(Trial("batches whose scores are well separated", _dual_cases(ties=False)),
            Trial("batches with many exact ties (scores and multipliers in eighths)", _dual_cases(ties=True))),
    output=_dual_output,
    agree=_dual_agree,
    show=_dual_show,
    explain=_dual_explain,
    differ=_dual_differ,
    mistakes=(
        Mistake("beta_qth", "the beta-step at the q-th largest instead of the (q+1)-th",
                "D in beta_j has slope q - #{i : s_ij - alpha_i > beta_j}: it turns from negative to positive "
                "where exactly q values lie above, at the (q+1)-th largest.", _dual_variant(beta_shift=-1)),
        Mistake("alpha_kth", "the alpha-step at the k-th largest instead of the (k+1)-th",
                "D in alpha_i has slope k - #{j : s_ij - beta_j > alpha_i}: its minimum has exactly k values "
                "above, at the (k+1)-th largest.", _dual_variant(alpha_shift=-1)),
        Mistake("beta_added", "beta added to the scores instead of subtracted",
                "The dual's margins are s - alpha - beta: the alpha-step ranks s_i - beta (and routing uses "
                "b = -beta, added).", _dual_variant(beta_sign=1.0)),
        Mistake("beta_centred", "the new beta centred, as the bias is",
                "Centring is harmless for the bias (a common shift changes no route) but not for one multiplier "
                "alone: D changes unless alpha moves the other way, (alpha - c, beta + c). The coordinate step "
                "is the minimizer itself.", _dual_variant(centre=True)),
        Mistake("beta_from_the_bottom", "the beta-step at the (q+1)-th smallest instead of the (q+1)-th largest",
                "np.sort sorts ascending: row q of each column is its (q+1)-th smallest. beta_j is the (q+1)-th "
                "largest of s_:,j - alpha, where exactly q values lie above.", _dual_variant(ascending=True)),
        Mistake("beta_negated", "the new beta returned with the bias's sign, -(the (q+1)-th largest)",
                "Puzzle 6's bias is b = -beta, hence its minus sign; the dual's own coordinate is beta_j = "
                "(s_:,j - alpha)_(q+1), without it.", _dual_variant(negated=True)),
        Mistake("beta_wrong_axis", "the beta-step sorted along each token's experts (axis 1) instead of each "
                "expert's tokens (axis 0)",
                "beta_j is an order statistic of column j of s - alpha, over the m tokens: sort along axis 0.",
                _dual_variant(axis=1)),
        Mistake("float32", "the step computed in float32", FLOAT32_WHY,
                _dual_variant(dtype=np.float32), like=_float32_like, narrow=True),
    ),
)


# ---------------------------------------------------------------------------
# 8. The sign rule as SignSGD on the dual
# ---------------------------------------------------------------------------

def sign_update(load: np.ndarray, bias: np.ndarray, rate: float) -> np.ndarray:
    """DeepSeek-V3's rule: b_j <- b_j + rate * sign(q - load_j), q the mean load.

    load [n] int (tokens per expert), bias [n], rate (gamma > 0)  ->  new bias [n]
    """
    n = load.shape[0]
    # sign(q - load_j) with q = sum(load) / n, in integers: sign(sum(load) - n load_j),
    # exactly 0 on target
    direction = np.sign(load.sum() - n * load)
    return bias + rate * direction


@st.composite
def _sign_cases(draw: st.DrawFn, on_target: bool) -> Case:
    n = draw(st.integers(2, 8), label="n")
    if on_target:
        # A whole target q and loads around it: deltas in {-1, 0, 1}, the last expert absorbing the rest.
        q = draw(st.integers(n, n + 6), label="q")
        deltas = draw(st.lists(st.sampled_from([0, 1, -1]), min_size=n - 1, max_size=n - 1), label="deltas")
        load = np.array([q + d for d in deltas] + [q - sum(deltas)], dtype=np.int64)
    else:
        load = np.array(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n), label="load"), dtype=np.int64)
    bias = draw(rst.biases(n, scale=0.5))
    rate = draw(st.sampled_from([1e-3, 1e-2, 0.5]), label="rate")
    return Case((load, bias, rate))


def _sign_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    """The new biases agree to float64's rounding at the size of the bias."""
    return _eps_close(got, expected, scale=1.0 + np.max(np.abs(case.args[1])))


def _sign_float32_like(got: np.ndarray, wrong: np.ndarray, case: Case) -> bool:
    """`like` for the sign rule's float32 mistake, whose first form rounds the bias to float32 and returns
    float64 (so `narrow`, which asks for a narrower result, would refuse the form itself).

    An answer makes this mistake when it agrees with a form as tightly as the check agrees with the
    reference, or to float32's rounding, but then only when every value it returns is a float32 number (a
    float32 result). A float64 answer that is off by float32-sized amounts for another reason (a smoothed
    sign, a result rounded to decimals) is not called float32."""
    return _sign_agree(got, wrong, case) or (_float32_valued(got) and _float32_like(got, wrong, case))


SIGN_RULE = Puzzle(
    number=8, name="sign_rule", title="The sign rule as SignSGD on the dual",
    spec=r"""DeepSeek-V3 balances without an auxiliary loss by nudging each bias after every batch:

$$
b_j \leftarrow b_j + \gamma\,\operatorname{sign}\bigl(q - \text{load}_j\bigr),
$$

with $\text{load}_j$ the tokens expert $j$ received, $q = \frac1n \sum_r \text{load}_r = mk/n$ the mean load
and $\gamma$ a step size (Megatron-Core's default is $10^{-3}$). An under-loaded expert's bias rises, an
over-loaded one's falls, and one exactly on target stays where it is.

**It is SignSGD on the dual of puzzle 7.** The derivative of $D(\alpha, \beta)$ in $\beta_j$ is
$q - \#\{i : s_{i,j} - \alpha_i - \beta_j > 0\}$, which at the $\alpha$-step's $\alpha$ is $q - \text{load}_j$.
A signed gradient step on $\beta$ is $\beta_j \leftarrow \beta_j - \gamma \operatorname{sign}(q - \text{load}_j)$,
and with $b = -\beta$ that is the rule above. It keeps only the direction of the load error and needs a step
size; Quantile Balancing jumps to the coordinate minimum and has none. The rule is not centred (a common shift
changes no route anyway).

Write `sign_update(load, bias, rate)`: `load` `[n]` integer counts, `bias` `[n]` floats, `rate` $\gamma > 0$;
return the new bias, `[n]`. Mind the expert exactly on target: its sign is 0.""",
    hint=r"""`q = load.sum() / n` can be fractional, and comparing a float with an integer load is exact here;
or stay in integers: $\operatorname{sign}(q - \text{load}_j) = \operatorname{sign}(\sum_r \text{load}_r - n\,\text{load}_j)$.
`np.sign` returns 0 for 0.""",
    solution=sign_update,
    reference=lambda load, bias, rate: np.asarray(sign_balancing_update(load, bias, rate)),
    reference_name="refimpl.sign_balancing_update(load, bias, rate)",
    trials=(Trial("loads around a whole target, some exactly on it", _sign_cases(on_target=True)),
            Trial("any loads", _sign_cases(on_target=False))),
    output=_array_output("the new bias", lambda c: c.args[1].shape, "float"),
    agree=_sign_agree,
    show=_show_array,
    mistakes=(
        Mistake("sign_flipped", "the sign of the update flipped",
                "An under-loaded expert (load below q) must become more attractive: its bias rises, "
                "b + gamma sign(q - load). The flipped rule starves the idle experts further.",
                lambda load, b, rate: b - rate * np.sign(load.mean() - load)),
        Mistake("gradient_not_sign", "a gradient step gamma (q - load) instead of its sign",
                "SignSGD keeps only the direction of the load error: every expert off target moves by exactly "
                "gamma, whatever the size of its error.",
                lambda load, b, rate: b + rate * (load.mean() - load)),
        Mistake("on_target_moved", "an expert exactly on target moved",
                "sign(0) = 0: an expert whose load equals q keeps its bias. Writing the rule as "
                "'up if below q, else down' (or 'down if above q, else up') moves it.",
                lambda load, b, rate: b + np.where(load < load.mean(), rate, -rate),
                also=(lambda load, b, rate: b + np.where(load > load.mean(), -rate, rate),)),
        Mistake("target_floored", "the target q rounded down (integer division)",
                "q = sum(load) / n need not be a whole number: with sum(load) // n an expert just below the true "
                "mean can count as on target (or above it), and keeps or lowers a bias it should raise.",
                lambda load, b, rate: b + rate * np.sign(load.sum() // load.shape[0] - load)),
        Mistake("target_median", "the median load as the target instead of the mean",
                "The target is q = mk/n, the mean load: every expert balanced means every expert at the mean. "
                "The median is another number whenever the loads are skewed.",
                lambda load, b, rate: b + rate * np.sign(np.median(load) - load)),
        Mistake("float32", "the bias rounded to float32", FLOAT32_WHY,
                lambda load, b, rate: b.astype(np.float32) + rate * np.sign(load.mean() - load),
                also=(lambda load, b, rate: (b.astype(np.float32) + np.float32(rate)
                                             * np.sign(load.mean() - load).astype(np.float32)),),
                like=_sign_float32_like),
    ),
)
