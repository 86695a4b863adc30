"""Puzzles 1-4, the layer: routing with a selection-only bias and the mixture weights (Eq. 13), SiTU-GLU
(Eq. 12) and the latent forward (Eq. 11)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

from refimpl import (
    MoEConfig,
    route,
    router_scores,
    sigmoid,
    stable_latent_moe,
)
from refimpl import situ_glu as reference_situ_glu
from refimpl.testing import check_forward
from refimpl.testing import strategies as rst
from refimpl.testing.puzzles.core import (
    Case,
    Mistake,
    Puzzle,
    Trial,
    _array_output,
    _code,
    _eps_close,
    _float32_like,
    _run_kit,
    _settings,
    _show_array,
)

# ---------------------------------------------------------------------------
# 1. Sigmoid routing with a selection-only bias (Eq. 13)
# ---------------------------------------------------------------------------

def route_with_bias(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Each token's top_k experts by sigmoid score plus bias, best first; ties to the lower id.

    logits [m, n] float, bias [n] float, top_k int  ->  index [m, top_k] int
    """
    # s = sigma(z): each expert scored on its own, in (0, 1)
    scores = 1.0 / (1.0 + np.exp(-logits))
    # Selection by the biased scores s + b
    biased = scores + bias[None, :]
    # Largest first; a stable sort keeps the lower id first among equal values
    order = np.argsort(-biased, axis=1, kind="stable")
    return order[:, :top_k]


def _routing_reference(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    return np.asarray(route(sigmoid(logits), bias, top_k)[0])


def _logits_of(scores: np.ndarray) -> np.ndarray:
    """The logits whose sigmoids are `scores`: $z = \\log s - \\log(1 - s)$."""
    return np.log(scores) - np.log1p(-scores)


@st.composite
def _separated_logits(draw: st.DrawFn) -> Case:
    # The kit's tie-free grid: no two biased scores of a token closer than 2^-14.
    case = draw(rst.routing_cases(distinct=True, max_tokens=6, max_experts=8))
    return Case((_logits_of(case.scores), case.bias, case.top_k))


#: Logits and biases whose biased scores either tie exactly or differ by more than 0.01.
_TIE_LOGITS = (0.0, 1.0, -1.0)
_TIE_BIASES = (0.0, 0.125, -0.125)


@st.composite
def _tied_logits(draw: st.DrawFn, min_experts: int = 2, max_experts: int = 8) -> Case:
    m, n, k = draw(rst.routing_sizes(max_tokens=6, min_experts=min_experts, max_experts=max_experts,
                                     allow_all_experts=True))
    z = draw(st.lists(st.sampled_from(_TIE_LOGITS), min_size=m * n, max_size=m * n))
    b = draw(st.lists(st.sampled_from(_TIE_BIASES), min_size=n, max_size=n))
    return Case((np.array(z, dtype=np.float64).reshape(m, n), np.array(b, dtype=np.float64), k))


def _softmax_routing(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    scores = e / e.sum(axis=1, keepdims=True)
    return np.argsort(-(scores + bias), axis=1, kind="stable")[:, :top_k]


def _routing_by(select: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    """A router that ranks by `select(s, z, b)` (stable, largest first)."""
    def answer(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        s = 1.0 / (1.0 + np.exp(-logits))
        return np.argsort(-select(s, logits, bias), axis=1, kind="stable")[:, :top_k]
    return answer


def _ties_to_higher_id(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-logits))
    return np.argsort(s + bias, axis=1, kind="stable")[:, ::-1][:, :top_k]


def _ids_in_order(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    return np.sort(route_with_bias(logits, bias, top_k), axis=1)


def _routing_from(pick: Callable[[np.ndarray, int], np.ndarray]) -> Callable[..., np.ndarray]:
    """A router that ranks the biased scores s + b with `pick(values, top_k)`."""
    def answer(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        return pick(1.0 / (1.0 + np.exp(-logits)) + bias[None, :], top_k)
    return answer


def _biased_scores(case: Case) -> np.ndarray:
    """The biased scores s + b of a routing input, as the reference computes them, `[m, n]`."""
    logits, bias, _ = case.args
    with np.errstate(all="ignore"):
        return np.asarray(sigmoid(logits)) + bias[None, :]


def _has_ties(case: Case) -> bool:
    """Whether some token of the input has two experts with equal biased scores."""
    biased = _biased_scores(case)
    return any(len(np.unique(row)) < len(row) for row in biased)


def _valid_routes(index: np.ndarray, n: int) -> bool:
    """Every row a list of distinct expert ids in `range(n)`."""
    return bool(np.all((index >= 0) & (index < n))) and all(len(set(row)) == len(row) for row in index.tolist())


def _up_to_ties(values: Callable[[Case], np.ndarray]) -> Callable[[np.ndarray, np.ndarray, Case], bool]:
    """`like` for a routing mistake that an answer may make with any sort: the answer's route equals the
    mistake's, or differs from it only by the order of experts whose ranking values `values(case)` tie (an
    answer that makes the mistake with np.argsort's default, unstable kind)."""

    def like(got: np.ndarray, wrong: np.ndarray, case: Case) -> bool:
        if np.array_equal(got, wrong):
            return True
        ranked = values(case)
        n = ranked.shape[1]
        if got.shape != wrong.shape or not (_valid_routes(got, n) and _valid_routes(wrong, n)):
            return False
        return bool(np.array_equal(np.take_along_axis(ranked, got, axis=1),
                                   np.take_along_axis(ranked, wrong, axis=1)))

    return like


def _values_by(select: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
               ) -> Callable[[Case], np.ndarray]:
    """The values a router ranks, `select(s, z, b)`, on a routing input."""
    def values(case: Case) -> np.ndarray:
        logits, bias, _ = case.args
        with np.errstate(all="ignore"):
            return select(np.asarray(sigmoid(logits)), logits, bias[None, :])
    return values


def _softmax_values(case: Case) -> np.ndarray:
    logits, bias, _ = case.args
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True) + bias[None, :]


_BY_BIASED = _up_to_ties(_biased_scores)


def _same_set_by_id(got: np.ndarray, wrong: np.ndarray, case: Case) -> bool:
    """`like` for the chosen experts listed by id: each row of the answer in increasing id order, holding
    experts of the same biased scores as the mistake's (an unstable sort may choose another of tied ones)."""
    biased = _biased_scores(case)
    if got.shape != wrong.shape or not _valid_routes(got, biased.shape[1]):
        return False
    return bool(np.all(np.diff(got, axis=1) > 0)) and bool(np.array_equal(
        np.sort(np.take_along_axis(biased, got, axis=1), axis=1),
        np.sort(np.take_along_axis(biased, wrong, axis=1), axis=1)))


def _same_by_token_order(got: np.ndarray, wrong: np.ndarray, case: Case) -> bool:
    """`like` for a router that sorts along axis 0 (each expert's tokens) with any sort: column j of the
    answer lists token ids, each token once, whose biased scores s_:,j + b_j are the mistake's in the same
    order (an unstable sort may order tokens with equal values differently)."""
    if np.array_equal(got, wrong):
        return True
    biased = _biased_scores(case)
    m, n = biased.shape
    if got.shape != wrong.shape or got.ndim != 2 or got.shape[0] != m or got.shape[1] > n:
        return False
    if not (_valid_routes(got.T, m) and _valid_routes(wrong.T, m)):
        return False
    columns = biased[:, :got.shape[1]]
    return bool(np.array_equal(np.take_along_axis(columns, got, axis=0),
                               np.take_along_axis(columns, wrong, axis=0)))


def _differs_only_on_ties(results: list[tuple[Case, np.ndarray, np.ndarray]]) -> bool:
    """An unstable sort's signature: on every input without ties the answer is the reference's route; on
    the others it differs from it, somewhere, only by the order of experts with equal s + b."""
    tie_free = [(c, g, e) for c, g, e in results if not _has_ties(c)]
    return (bool(tie_free) and all(np.array_equal(g, e) for _, g, e in tie_free)
            and all(_BY_BIASED(g, e, c) for c, g, e in results)
            and any(not np.array_equal(g, e) for _, g, e in results))


def _right_set_unsorted(results: list[tuple[Case, np.ndarray, np.ndarray]]) -> bool:
    """np.argpartition's signature: every token gets the right experts (up to equal s + b at the boundary),
    and on some input without ties they come in another order than best first."""
    def same_set(c: Case, g: np.ndarray, e: np.ndarray) -> bool:
        biased = _biased_scores(c)
        return _valid_routes(g, biased.shape[1]) and bool(np.array_equal(
            np.sort(np.take_along_axis(biased, g, axis=1), axis=1),
            np.sort(np.take_along_axis(biased, e, axis=1), axis=1)))

    return (all(same_set(c, g, e) for c, g, e in results)
            and any(not _has_ties(c) and not np.array_equal(g, e) for c, g, e in results))


def _routing_differ(case: Case, expected: np.ndarray, got: np.ndarray) -> list[str]:
    """The first token whose route differs, in plain words: the right set in another order, or which
    experts came in place of which (and whether they tie with them at s + b)."""
    logits, bias, _ = case.args
    with np.errstate(all="ignore"):
        biased = 1.0 / (1.0 + np.exp(-logits)) + bias[None, :]
    tokens = [i for i in range(expected.shape[0]) if not np.array_equal(expected[i], got[i])]
    if not tokens:
        return []
    i = tokens[0]
    e, g = expected[i].tolist(), got[i].tolist()
    where = f"token {i}" + (f" (and {len(tokens) - 1} more)" if len(tokens) > 1 else "")
    if sorted(e) == sorted(g) and len(set(g)) == len(g):
        how = "in reverse order, best last" if g == e[::-1] else "in another order"
        return [f"What differs: {where} gets the right experts {how}: {e} expected (largest s + b first), "
                f"{g} got."]
    if len(set(g)) < len(g):
        return [f"What differs: {where} lists an expert twice: {g} got, {e} expected."]
    missing, extra = [j for j in e if j not in g], [j for j in g if j not in e]
    values = ", ".join(f"{j}: {biased[i, j]:.6g}" for j in sorted(set(missing) | set(extra))
                       if 0 <= j < biased.shape[1])
    text = (f"What differs: {where} gets expert{'s' if len(extra) > 1 else ''} {extra} in place of {missing} "
            f"({e} expected, {g} got; s + b of these experts: {values}).")
    if any(0 <= j < biased.shape[1] and any(biased[i, j] == biased[i, r] for r in missing) for j in extra):
        text += " They tie at s + b: on a tie the lower id is chosen."
    return [text]


#: Inputs that tell the routing mistakes apart, with and without ties: four experts of distinct biased
#: scores (k = 2 and 3, so that an order reversed, listed by id or left unsorted differ), and ties among
#: the chosen experts and across the k-th place.
_ROUTING_PROBES = (
    Case((np.array([[0.0, 2.0, -1.0, 1.0], [1.5, -0.5, 0.5, -2.0]]), np.array([0.0, 0.0, 0.0, 0.0]), 3)),
    Case((np.array([[0.25, -1.0, 2.0, 1.0, -2.0]]), np.array([0.0, 0.125, -0.25, 0.0, 0.5]), 2)),
    Case((np.array([[1.0, 1.0, 0.0, 1.0], [0.0, -1.0, 0.0, 1.0]]), np.array([0.0, 0.0, 0.0, 0.0]), 2)),
    Case((np.array([[1.0, 0.0, 1.0, 1.0, -1.0]]), np.array([0.0, 0.0, 0.0, 0.0, 0.0]), 3)),
)


ROUTING = Puzzle(
    number=1, name="routing", title="Sigmoid routing with a selection-only bias",
    spec=r"""The router of a K3 layer scores every expert for every token with a **sigmoid** of the router
logits $z = x W_r^\top$, and chooses each token's $k$ experts by the scores **plus a bias** $b$, one number
per expert (`e_score_correction_bias`):

$$
s_{i,j} = \sigma(z_{i,j}) = \frac{1}{1 + e^{-z_{i,j}}},
$$

$$
\mathcal{T}_i = \operatorname{argtopk}_k\,(s_i + b).
$$

The sigmoid scores each expert on its own, in $(0, 1)$; the experts do not compete for one unit of
probability as they would under a softmax. The bias is the balancer's knob (puzzles 5 to 9 set it): it
decides which experts a token visits, and nothing else (puzzle 2).

Write `route_with_bias(logits, bias, top_k)`:

* `logits`: `[m, n]` floats, one row per token; `bias`: `[n]` floats; `top_k`: $k$, with $1 \le k \le n$;
* return `index`, `[m, k]` integers: each token's $k$ experts with the largest $s + b$, **best first**;
  when two experts tie, the **lower id** comes first (refimpl's rule: `torch.topk` leaves it open).""",
    hint=r"""Compute the scores, add the bias to every row (broadcasting `bias[None, :]`), and sort each row
from the largest: `np.argsort(-values, axis=1, kind="stable")` keeps equal values in id order, so the lower id
comes first among ties. The first `top_k` columns are the route.""",
    solution=route_with_bias,
    reference=_routing_reference,
    reference_name="refimpl.route(sigmoid(logits), bias, top_k)[0]",
    trials=(Trial("inputs whose biased scores are well separated", _separated_logits()),
            Trial("inputs with exact ties among the biased scores", _tied_logits()),
            # NumPy sorts rows of up to 16 values by insertion, which keeps equal values in id order: without
            # a vectorized sort (not every CPU has one) an unstable sort shows itself only on longer rows.
            Trial("inputs with exact ties among more than 16 experts", _tied_logits(17, 24))),
    output=_array_output("index", lambda c: (c.args[0].shape[0], c.args[2]), "int"),
    agree=lambda got, expected, case: bool(np.array_equal(got, expected)),
    show=_show_array,
    differ=_routing_differ,
    probes=_ROUTING_PROBES,
    mistakes=(
        Mistake("softmax_scores", "a softmax instead of the sigmoid",
                "A softmax makes the experts of a token compete for one unit of probability, so its scores live "
                "on another scale than the one the bias was set for, and s + b picks other experts. K3 scores "
                "each expert on its own: s = 1 / (1 + exp(-z)).", _softmax_routing,
                like=_up_to_ties(_softmax_values)),
        Mistake("bias_ignored", "the bias left out of the selection",
                "The bias exists to change which experts are chosen: the top-k is taken over s + b, not over s.",
                _routing_by(lambda s, z, b: s), like=_up_to_ties(_values_by(lambda s, z, b: s))),
        Mistake("bias_subtracted", "the bias subtracted instead of added",
                "Some code keeps a correction beta = -b and subtracts it; here b itself is added: s + b.",
                _routing_by(lambda s, z, b: s - b), like=_up_to_ties(_values_by(lambda s, z, b: s - b))),
        Mistake("bias_on_logits", "the bias added to the logits, inside the sigmoid",
                "sigma(z + b) is not sigma(z) + b: the bias is added to the sigmoid scores, after the sigmoid.",
                _routing_by(lambda s, z, b: 1.0 / (1.0 + np.exp(-(z + b)))),
                like=_up_to_ties(_values_by(lambda s, z, b: 1.0 / (1.0 + np.exp(-(z + b)))))),
        Mistake("ties_to_higher_id", "ties broken toward the higher expert id",
                "Reversing an ascending sort puts the higher id first among equal values; the rule here is the "
                "lower id first (a stable sort of the negated values).", _ties_to_higher_id),
        Mistake("ids_in_id_order", "the chosen experts listed by id, not best first",
                "The set is right but the order is not: the route lists each token's experts from the largest "
                "s + b down (sorting the chosen ids loses that order; capacity in puzzle 10 serves first "
                "choices first).", _ids_in_order, like=_same_set_by_id),
        Mistake("smallest_first", "the k smallest biased scores instead of the k largest (an ascending sort's "
                "first k columns)",
                "np.argsort sorts ascending: its first k columns are the experts a token wants least. Sort the "
                "negated values (or take the last k columns, reversed).",
                _routing_from(lambda v, k: np.argsort(v, axis=1, kind="stable")[:, :k]), like=_BY_BIASED),
        Mistake("best_last", "the right experts in reverse order, best last (an ascending sort's last k columns)",
                "np.argsort(v)[:, -k:] holds the k largest, but in ascending order: from the k-th best up to the "
                "best. The route lists the best first: reverse those columns, or better sort the negated values "
                "with a stable sort, np.argsort(-v, axis=1, kind=\"stable\")[:, :k], which also puts the lower "
                "id first on a tie.",
                _routing_from(lambda v, k: np.argsort(v, axis=1, kind="stable")[:, v.shape[1] - k:]),
                like=_BY_BIASED),
        Mistake("unstable_on_ties", "equal values put in any order (an unstable sort, or np.argpartition)",
                "Your answer is right on every input without ties and differs only where biased scores tie. "
                "np.argsort's default kind (quicksort, or a vectorized sort on CPUs that have one), heapsort "
                "and np.argpartition may leave equal values in any order, so a tie goes to whichever expert "
                "they happen to leave first. The route puts the lower id first on a tie: np.argsort(-values, axis=1, kind=\"stable\").",
                _routing_from(lambda v, k: np.argsort(-v, axis=1, kind="heapsort")[:, :k]),
                also=(_routing_from(lambda v, k: np.argsort(-v, axis=1)[:, :k]),),
                shows=_differs_only_on_ties),
        Mistake("unsorted_choice", "the right experts, not sorted best first (as np.argpartition leaves them)",
                "Every token gets the right experts, but on inputs without ties they do not come best first, "
                "nor in another order the check knows. np.argpartition, for one, only splits each row "
                "at the k-th value: the chosen experts come back in no particular order. The route lists them "
                "from the largest s + b down: sort them (np.argsort(-values, axis=1, kind=\"stable\")[:, :k]).",
                _routing_from(lambda v, k: np.roll(np.argsort(-v, axis=1, kind="stable")[:, :k], 1, axis=1)),
                shows=_right_set_unsorted),
        Mistake("wrong_axis", "each expert's tokens sorted (axis 0) instead of each token's experts (axis 1)",
                "logits has one row per token: a token's experts are along axis 1. Sorting along axis 0 ranks "
                "the tokens of each expert, and its first k columns are token ids, not expert ids.",
                _routing_from(lambda v, k: np.argsort(-v, axis=0, kind="stable")[:, :k]),
                like=_same_by_token_order),
    ),
)


# ---------------------------------------------------------------------------
# 2. The mixture weights and the top-1 rule
# ---------------------------------------------------------------------------

def mixture_weights(scores: np.ndarray, bias: np.ndarray, index: np.ndarray,
                    scaling_factor: float) -> np.ndarray:
    """The weights of each token's chosen experts, from the raw scores (never s + b).

    scores [m, n], bias [n], index [m, k] (the route, best first), scaling_factor c
    ->  weights [m, k]
    """
    # The raw scores of the chosen experts; the bias only chose them
    raw = np.take_along_axis(scores, index, axis=1)
    top_k = index.shape[1]
    if top_k > 1:
        # p = s / (sum of the chosen s): renormalized over the k chosen experts
        raw = raw / raw.sum(axis=1, keepdims=True)
    # A single expert keeps its raw score; every weight is then scaled by c
    return scaling_factor * raw


def _weights_reference(scores: np.ndarray, bias: np.ndarray, index: np.ndarray,
                       scaling_factor: float) -> np.ndarray:
    top_k = index.shape[1]
    # `moe_renormalize: true` as the reference gate reads it (`MoEConfig.from_hf_config`): only when top_k > 1.
    return np.asarray(route(scores, bias, top_k, renormalize=top_k > 1, scaling_factor=scaling_factor)[1])


@st.composite
def _weight_cases(draw: st.DrawFn, top1: bool) -> Case:
    n = draw(st.integers(2, 8), label="n")
    k = 1 if top1 else draw(st.integers(2, n), label="k")
    m = draw(st.integers(1, 6), label="m")
    s = draw(rst.scores(m, n))
    b = draw(rst.biases(n, scale=0.5))
    c = draw(st.sampled_from([1.0, 2.5]), label="scaling_factor")
    return Case((s, b, np.asarray(route(s, b, k)[0]), c))


def _weights_from(transform: Callable[[np.ndarray, np.ndarray, np.ndarray, int, float], np.ndarray]
                  ) -> Callable[..., np.ndarray]:
    def answer(scores: np.ndarray, bias: np.ndarray, index: np.ndarray, scaling_factor: float) -> np.ndarray:
        raw = np.take_along_axis(scores, index, axis=1)
        return transform(raw, scores, bias[index], index.shape[1], scaling_factor)
    return answer


def _renormalized(raw: np.ndarray) -> np.ndarray:
    return raw / raw.sum(axis=1, keepdims=True)


def _weights_in_id_order(scores: np.ndarray, bias: np.ndarray, index: np.ndarray,
                         scaling_factor: float) -> np.ndarray:
    return mixture_weights(scores, bias, np.sort(index, axis=1), scaling_factor)


def _weights_in_float32(scores: np.ndarray, bias: np.ndarray, index: np.ndarray,
                        scaling_factor: float) -> np.ndarray:
    return mixture_weights(scores.astype(np.float32), bias.astype(np.float32), index, np.float32(scaling_factor))


MIXTURE_WEIGHTS = Puzzle(
    number=2, name="mixture_weights", title="The mixture weights and the top-1 rule",
    spec=r"""Once the route $\mathcal{T}_i$ is chosen by $s + b$ (puzzle 1), each chosen expert's output is
weighted by its **raw** score, renormalized over the chosen set and multiplied by the routed scaling factor
$c$ (1.0 in K3):

$$
p_{i,j} = c\,\frac{s_{i,j}}{\sum_{r \in \mathcal{T}_i} s_{i,r}} \qquad (j \in \mathcal{T}_i).
$$

The bias is not in $p$: it decides which experts are chosen, never how much each contributes, and it
carries no gradient from the language-model loss.

**The top-1 rule.** K3's configuration says `moe_renormalize: true`, and the reference gate renormalizes
only when $k > 1$: with a single expert per token, the weight stays the raw score, $p_{i,j} = c\,s_{i,j}$,
not $c \cdot 1$ (a top-1 sigmoid router whose weight were always 1 would pass no gradient to the router).

Write `mixture_weights(scores, bias, index, scaling_factor)`:

* `scores`: `[m, n]` sigmoid scores $s$; `bias`: `[n]`; `index`: `[m, k]` each token's route, best first
  (what puzzle 1 returns); `scaling_factor`: $c$;
* return `weights`, `[m, k]` floats: `weights[i, r]` belongs to expert `index[i, r]`.""",
    hint=r"""`np.take_along_axis(scores, index, axis=1)` gathers each token's chosen raw scores in route
order. Divide by their row sum only when `index.shape[1] > 1`, then multiply everything by the scaling factor.
The bias is an argument only so that you can leave it out.""",
    solution=mixture_weights,
    reference=_weights_reference,
    reference_name="refimpl.route(scores, bias, k, renormalize=k > 1, scaling_factor=c)[1]",
    trials=(Trial("routes of two or more experts per token", _weight_cases(top1=False)),
            Trial("top-1 routes (one expert per token)", _weight_cases(top1=True))),
    output=_array_output("weights", lambda c: c.args[2].shape, "float"),
    agree=lambda got, expected, case: _eps_close(got, expected, scale=case.args[3]),
    show=_show_array,
    mistakes=(
        Mistake("bias_in_weights", "the bias added into the mixture weights",
                "The weights come from the raw scores s; the bias b only chooses the experts. With s + b in the "
                "weights the balancer leaks into the forward pass and moves every token's output whenever it "
                "rebalances.",
                _weights_from(lambda raw, s, b, k, c: c * (_renormalized(raw + b) if k > 1 else raw + b))),
        Mistake("top1_renormalized", "a single top-1 weight renormalized to 1",
                "With k = 1 the reference gate does not renormalize: the weight is the raw score s (times c). "
                "Renormalizing makes it exactly 1 for every token, so the router's score no longer scales the "
                "expert's output and the router learns nothing from the loss.",
                _weights_from(lambda raw, s, b, k, c: c * _renormalized(raw))),
        Mistake("scale_skipped_without_renormalization",
                "the scaling factor dropped on the path that does not renormalize",
                "The routed scaling factor c multiplies the weights whether or not they are renormalized; code "
                "that applies it inside the renormalizing branch forgets it for top-1 routes.",
                _weights_from(lambda raw, s, b, k, c: c * _renormalized(raw) if k > 1 else raw)),
        Mistake("normalized_over_all_experts", "the scores divided by their sum over all n experts",
                "The sum runs over the chosen set T_i only, so that the k weights of a token sum to c; a sum "
                "over every expert makes them small and depend on the experts that were not chosen.",
                _weights_from(lambda raw, s, b, k, c: c * (raw / s.sum(axis=1, keepdims=True) if k > 1 else raw))),
        Mistake("scaled_twice", "the scaling factor applied twice",
                "c multiplies the weights once, p = c s / sum s. Applied twice after the renormalization (in "
                "the gate and again in the layer), it makes every weight c^2 times too large. Applied before "
                "and after it, the first factor cancels wherever the weights are renormalized (c s / sum c s "
                "= s / sum s), so k > 1 comes out right and c^2 shows only where nothing renormalizes: a "
                "top-1 weight becomes c^2 s instead of c s.",
                _weights_from(lambda raw, s, b, k, c: c * c * (_renormalized(raw) if k > 1 else raw)),
                also=(_weights_from(lambda raw, s, b, k, c: c * (_renormalized(c * raw) if k > 1 else c * raw)),)),
        Mistake("scaled_before_renormalizing", "the scaling factor applied before renormalizing, where it cancels",
                "(c s) / sum(c s) = s / sum s: a factor applied before the division cancels out. Multiply by c "
                "after renormalizing.",
                _weights_from(lambda raw, s, b, k, c: _renormalized(c * raw) if k > 1 else c * raw)),
        Mistake("summed_over_tokens", "the chosen scores divided by their sum over the tokens (axis 0)",
                "Each token's weights are renormalized over its own k chosen experts: the sum runs along axis 1 "
                "of the [m, k] gathered scores, not down the tokens.",
                _weights_from(lambda raw, s, b, k, c: c * (raw / raw.sum(axis=0, keepdims=True) if k > 1 else raw))),
        Mistake("softmax_of_chosen", "a softmax over the chosen scores instead of dividing by their sum",
                "K3's weights are the sigmoid scores themselves, renormalized: s / sum s. exp(s) / sum exp(s) "
                "flattens them (every s lies in (0, 1)) and is another model's gate.",
                _weights_from(lambda raw, s, b, k, c: c * (np.exp(raw) / np.exp(raw).sum(axis=1, keepdims=True)
                                                           if k > 1 else raw))),
        Mistake("id_order", "the weights listed in expert-id order instead of the route's order",
                "weights[i, r] belongs to expert index[i, r]: gather the scores in the route's order "
                "(np.take_along_axis(scores, index, axis=1)), without sorting the ids.", _weights_in_id_order),
        Mistake("float32", "the weights computed in float32",
                "The scores arrive in float64 and the expected weights are computed in float64; float32 "
                "arithmetic keeps about 7 significant digits instead of 16. Keep the arguments' type.",
                _weights_in_float32, like=_float32_like, narrow=True),
    ),
)


# ---------------------------------------------------------------------------
# 3. SiTU-GLU and its bound (Eq. 12)
# ---------------------------------------------------------------------------

def situ_glu(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    """Eq. (12): [softcap(a, beta) * sigmoid(a)] * softcap(b, linear_beta), elementwise.

    gate (a), up (b): arrays of one shape; beta (K3: 4.0), linear_beta (K3: 25.0)
    ->  an array of that shape
    """
    # softcap(a, beta) = beta * tanh(a / beta), a smooth cap to (-beta, beta)
    capped_gate = beta * np.tanh(gate / beta)
    # sigmoid(a), written so that exp never overflows
    sig = np.exp(-np.logaddexp(0.0, -gate))
    # The up branch gets its own, wider cap
    capped_up = linear_beta * np.tanh(up / linear_beta)
    return capped_gate * sig * capped_up


def _situ_reference(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    return np.asarray(reference_situ_glu(gate, up, beta=beta, linear_beta=linear_beta))


@st.composite
def _glu_cases(draw: st.DrawFn, limit: float) -> Case:
    rows, cols = draw(st.integers(1, 3), label="rows"), draw(st.integers(1, 4), label="cols")
    values = st.floats(-limit, limit, allow_nan=False, allow_infinity=False)
    a = np.array(draw(st.lists(values, min_size=rows * cols, max_size=rows * cols), label="gate"))
    b = np.array(draw(st.lists(values, min_size=rows * cols, max_size=rows * cols), label="up"))
    beta = draw(st.sampled_from([4.0, 1.0, 2.5]), label="beta")
    linear_beta = draw(st.sampled_from([25.0, 10.0, 3.0]), label="linear_beta")
    return Case((a.reshape(rows, cols), b.reshape(rows, cols), beta, linear_beta))


def _glu_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    # Each factor is good to a few units in the last place of itself, or (a sigmoid written with tanh) of 1;
    # the product is bounded by beta * linear_beta, so a relative plus a bound-sized absolute tolerance.
    eps = np.finfo(np.float64).eps
    bound = case.args[2] * case.args[3]
    return bool(np.all(np.abs(got - expected) <= 64 * eps * (np.abs(expected) + bound)))


def _sig(a: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -a))


SITU_GLU = Puzzle(
    number=3, name="situ_glu", title="SiTU-GLU and its bound",
    spec=r"""Every expert of a K3 layer is a gated linear unit whose activation is **SiTU-GLU**, a SwiGLU
with both branches smoothly capped by a scaled $\tanh$:

$$
\operatorname{softcap}(z, \beta) = \beta \tanh(z / \beta),
$$

$$
\begin{aligned}
\operatorname{SiTU\text{-}GLU}(a, b) = {}& \bigl[\operatorname{softcap}(a, \beta_1)\,\sigma(a)\bigr] \\
&\odot \operatorname{softcap}(b, \beta_2),
\end{aligned}
$$

with $a$ the gate pre-activation, $b$ the up pre-activation, $\beta_1 = 4$ (`activation_situ_beta`) and
$\beta_2 = 25$ (`activation_situ_linear_beta`). SwiGLU is $[a\,\sigma(a)] \odot b$: near zero the two agree
($\operatorname{softcap}(z, \beta) = z - z^3/(3\beta^2) + \dots$), but SwiGLU is unbounded while every
coordinate of SiTU-GLU obeys

$$|\operatorname{SiTU\text{-}GLU}(a, b)| < \beta_1 \beta_2 = 100,$$

since $|\operatorname{softcap}(a, \beta_1)| < \beta_1$, $0 < \sigma(a) < 1$ and
$|\operatorname{softcap}(b, \beta_2)| < \beta_2$. The caps are smooth: the derivative is never zero, unlike
that of a hard clamp past its bound.

Write `situ_glu(gate, up, beta, linear_beta)` for arrays `gate`, `up` of one shape, elementwise. The check
also feeds pre-activations in the thousands, where the bound is what keeps the output finite and small.""",
    hint=r"""Three factors, multiplied: `beta * np.tanh(gate / beta)`, the sigmoid of `gate`, and
`linear_beta * np.tanh(up / linear_beta)`. For very negative `gate`, `1 / (1 + np.exp(-gate))` overflows to
`inf` in the exponential (harmlessly giving 0, with a warning); `np.exp(-np.logaddexp(0, -gate))` is the
same sigmoid without the overflow.""",
    solution=situ_glu,
    reference=_situ_reference,
    reference_name="refimpl.situ_glu(gate, up, beta, linear_beta)",
    trials=(Trial("pre-activations between -40 and 40", _glu_cases(40.0)),
            Trial("pre-activations in the thousands, where the caps bind", _glu_cases(1e4))),
    output=_array_output("the output", lambda c: c.args[0].shape, "float"),
    agree=_glu_agree,
    show=_show_array,
    mistakes=(
        Mistake("swiglu", "SwiGLU in place of SiTU-GLU (no caps)",
                "[a sigma(a)] * b has no bound: one large pre-activation gives an output as large. SiTU-GLU caps "
                "the gate factor with softcap(a, beta_1) and the up branch with softcap(b, beta_2).",
                lambda a, b, beta, lb: a * _sig(a) * b),
        Mistake("caps_swapped", "the caps applied to the wrong branches",
                "beta_1 = 4 (activation_situ_beta) caps the gate a; beta_2 = 25 (activation_situ_linear_beta) "
                "caps the up branch b. Swapped, the gate saturates at 25 and the up branch at 4.",
                lambda a, b, beta, lb: lb * np.tanh(a / lb) * _sig(a) * beta * np.tanh(b / beta)),
        Mistake("up_uncapped", "only the gate capped, the up branch left linear",
                "Both branches are capped; with b uncapped the output is unbounded in b (this is the reference "
                "code's form when activation_situ_linear_beta is absent, not K3's).",
                lambda a, b, beta, lb: beta * np.tanh(a / beta) * _sig(a) * b),
        Mistake("hard_clamp", "a hard clamp instead of the tanh softcap",
                "np.clip(z, -beta, beta) has the same bound but a kink, and its derivative is exactly 0 past the "
                "bound, so a saturated unit stops learning; softcap(z, beta) = beta tanh(z / beta) is smooth.",
                lambda a, b, beta, lb: np.clip(a, -beta, beta) * _sig(a) * np.clip(b, -lb, lb)),
        Mistake("tanh_without_beta", "softcap written as tanh(z / beta), without the factor beta",
                "softcap(z, beta) = beta tanh(z / beta): the factor beta makes it z to first order near 0 "
                "(so SiTU-GLU matches SwiGLU there) and sets the bound beta_1 beta_2.",
                lambda a, b, beta, lb: np.tanh(a / beta) * _sig(a) * np.tanh(b / lb)),
        Mistake("tanh_not_divided", "softcap written as beta tanh(z), without dividing z by beta",
                "softcap(z, beta) = beta tanh(z / beta): inside the tanh z is divided by beta, so that the cap "
                "is z to first order near 0; beta tanh(z) saturates at |z| of about 1 whatever beta is.",
                lambda a, b, beta, lb: beta * np.tanh(a) * _sig(a) * lb * np.tanh(b)),
        Mistake("sigmoid_of_capped_gate", "the sigmoid taken of the capped gate, sigma(softcap(a)), not of a",
                "The gate factor is softcap(a, beta_1) sigma(a): the sigmoid sees the raw pre-activation a, "
                "only the first factor is capped.",
                lambda a, b, beta, lb: beta * np.tanh(a / beta) * _sig(beta * np.tanh(a / beta))
                * lb * np.tanh(b / lb)),
        Mistake("cap_after_sigmoid", "the cap applied to a sigma(a), after the sigmoid, instead of to a",
                "SiTU caps the gate pre-activation and then multiplies by sigma(a): softcap(a, beta_1) sigma(a), "
                "not softcap(a sigma(a), beta_1). The two differ wherever sigma(a) is not close to 1.",
                lambda a, b, beta, lb: beta * np.tanh(a * _sig(a) / beta) * lb * np.tanh(b / lb)),
        Mistake("float32", "SiTU-GLU computed in float32",
                "The pre-activations arrive in float64 and the expected values are computed in float64; float32 "
                "arithmetic keeps about 7 significant digits instead of 16. Keep the arguments' type.",
                lambda a, b, beta, lb: situ_glu(a.astype(np.float32), b.astype(np.float32), np.float32(beta),
                                                np.float32(lb)),
                like=_float32_like, narrow=True),
    ),
)


# ---------------------------------------------------------------------------
# 4. The latent forward (Eq. 11)
# ---------------------------------------------------------------------------

def latent_moe(x: np.ndarray, index: np.ndarray, weights: np.ndarray, params: dict,
               config: object) -> np.ndarray:
    """Eq. (11) with the route given: y = shared(x) + W_up RMSNorm(sum_e p_e E_e(W_down x)).

    x [m, d]; index, weights [m, k] (the route); params: the layer's arrays by HF name;
    config: beta_1 = config.situ_beta, beta_2 = config.situ_linear_beta, eps = config.rms_norm_eps
    ->  y [m, d]
    """
    def glu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # SiTU-GLU (puzzle 3)
        beta, linear_beta = config.situ_beta, config.situ_linear_beta
        sig = np.exp(-np.logaddexp(0.0, -a))
        return beta * np.tanh(a / beta) * sig * linear_beta * np.tanh(b / linear_beta)

    # Down-projection, one matrix for all routed experts: z = x W_down^T, [m, l]
    z = x @ params["routed_expert_down_proj.weight"].T
    # The weighted sum of the chosen experts, in the latent space: u_i = sum_e p_ie E_e(z_i), [m, l]
    u = np.zeros_like(z)
    for i in range(x.shape[0]):
        for e, p in zip(index[i], weights[i], strict=True):
            hidden = glu(params["experts.w1"][e] @ z[i], params["experts.w3"][e] @ z[i])  # [f]
            u[i] += p * (params["experts.w2"][e] @ hidden)  # [l]
    # RMSNorm of the sum, once per token, times the gain g: v = u / sqrt(mean(u^2) + eps) * g
    rms = np.sqrt(np.mean(u * u, axis=1, keepdims=True) + config.rms_norm_eps)
    v = u / rms * params["routed_expert_norm.weight"]
    # Up-projection, once per token after the sum: [m, d]
    y_routed = v @ params["routed_expert_up_proj.weight"].T
    # The shared experts: one GLU on the full-width input
    gate_s = x @ params["shared_experts.gate_proj.weight"].T
    up_s = x @ params["shared_experts.up_proj.weight"].T
    y_shared = glu(gate_s, up_s) @ params["shared_experts.down_proj.weight"].T
    return y_shared + y_routed


def _latent_reference(x: np.ndarray, index: np.ndarray, weights: np.ndarray, params: dict,
                      config: MoEConfig) -> np.ndarray:
    return np.asarray(stable_latent_moe(x, params, config, routing=(index, weights)))


_WEIGHT_PALETTE = (0.5, 0.25, 1.0, 0.75, 0.125)
_GAIN_PALETTE = (1.0, 0.5, 2.0, 1.5)


@st.composite
def _latent_cases(draw: st.DrawFn) -> Case:
    # The kit's small layers (K3's switches) and token batches, with a route drawn on top.
    case = draw(rst.forward_cases(config=rst.configs(max_experts=6, max_width=8), max_tokens=4))
    config = case.config
    m, n, k = case.x.shape[0], config.n, config.k
    rows = [draw(st.permutations(range(n)), label=f"experts of token {i}")[:k] for i in range(m)]
    index = np.array(rows, dtype=np.int64).reshape(m, k)
    p = draw(st.lists(st.sampled_from(_WEIGHT_PALETTE), min_size=m * k, max_size=m * k), label="weights")
    weights = np.array(p, dtype=np.float64).reshape(m, k)
    params = dict(case.params(np.float64))
    # A trained norm's gain is not all ones (init_params starts it there): draw it.
    gain = draw(st.lists(st.sampled_from(_GAIN_PALETTE), min_size=config.ell, max_size=config.ell), label="gain")
    params["routed_expert_norm.weight"] = np.array(gain, dtype=np.float64)
    shown = {"params": f"{{**refimpl.testing.strategies.ForwardCase(config, x, param_seed={case.param_seed}, "
                       f"bias_scale={case.bias_scale}).params(np.float64),\n"
                       f"          'routed_expert_norm.weight': {_code(params['routed_expert_norm.weight'])}}}"}
    return Case((case.x, index, weights, params, config), shown)


def _latent_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    # float64 throughout; the RMSNorm can magnify the rounding of a cancelling sum by at most 1/sqrt(eps) ~ 316.
    return bool(np.all(np.abs(got - expected) <= 1e-9 * (1.0 + np.max(np.abs(expected), initial=0.0))))


def _latent_variant(*, norm: str = "sum", shared: bool = True, activation: str = "situ",
                    gain: bool = True, weighted: bool = True, eps: str = "inside", axis: int = -1,
                    dtype: type = np.float64) -> Callable[..., np.ndarray]:
    """The latent forward with one stage changed, for the catalogue of mistakes."""

    def answer(x: np.ndarray, index: np.ndarray, weights: np.ndarray, params: dict,
               config: MoEConfig) -> np.ndarray:
        x = x.astype(dtype)
        params = {key: np.asarray(value).astype(dtype) for key, value in params.items()}
        weights = weights.astype(dtype) if weighted else np.ones_like(weights, dtype=dtype)

        def glu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            if activation == "swiglu":
                return a * _sig(a) * b
            return situ_glu(a, b, dtype(config.situ_beta), dtype(config.situ_linear_beta))

        g = params["routed_expert_norm.weight"] if gain else np.ones(config.ell, dtype=dtype)

        def normed(t: np.ndarray) -> np.ndarray:
            mean_square = np.mean(t * t, axis=axis if t.ndim > 1 else -1, keepdims=True)
            if eps == "outside":
                return t / (np.sqrt(mean_square) + dtype(config.rms_norm_eps)) * g
            return t / np.sqrt(mean_square + dtype(config.rms_norm_eps)) * g

        z = x @ params["routed_expert_down_proj.weight"].T
        u = np.zeros_like(z)
        for i in range(x.shape[0]):
            for e, p in zip(index[i], weights[i], strict=True):
                out = params["experts.w2"][e] @ glu(params["experts.w1"][e] @ z[i], params["experts.w3"][e] @ z[i])
                u[i] += p * (normed(out) if norm == "per_expert" else out)
        v = normed(u) if norm == "sum" else u
        y = v @ params["routed_expert_up_proj.weight"].T
        if shared:
            h = glu(x @ params["shared_experts.gate_proj.weight"].T, x @ params["shared_experts.up_proj.weight"].T)
            y = y + h @ params["shared_experts.down_proj.weight"].T
        return y

    return answer


def _kit_forward(fn: Callable[..., Any]) -> str:
    """The kit's `check_forward` on the answer, with the route computed by refimpl from the layer's router."""

    def layer(x: np.ndarray, params: dict, config: MoEConfig) -> np.ndarray:
        scores = router_scores(x, params["gate.weight"])
        index, weights = route(scores, params["gate.e_score_correction_bias"], config.k,
                               renormalize=config.renormalize, scaling_factor=config.routed_scaling_factor)
        return fn(x, np.asarray(index), np.asarray(weights), params, config)

    return _run_kit("check_forward", lambda: check_forward(
        layer, dtype=np.float64, rtol=1e-9, atol=1e-9, configs=rst.configs(max_experts=6, max_width=8),
        max_tokens=4, settings=_settings(30)))


LATENT_FORWARD = Puzzle(
    number=4, name="latent_forward", title="The latent forward",
    spec=r"""The Stable LatentMoE layer runs its routed experts on a **latent** of width $\ell = d/\alpha$
(K3: $\alpha = 2$), sums them there, normalizes the sum once, and projects it back:

$$
u = \sum_{e \in \mathcal{T}(x)} p_e\, E_e\bigl(W_\downarrow x\bigr),
$$

$$
y = \sum_j E^{\text{shared}}_j(x) + W_\uparrow\,\operatorname{RMSNorm}(u).
$$

Stage by stage, for a batch `x` of shape `[m, d]` and its route (`index`, `weights`, puzzles 1 and 2):

1. $z = x W_\downarrow^\top$, `[m, l]`, with $W_\downarrow$ = `routed_expert_down_proj.weight` `[l, d]`;
2. each routed expert $e$ is a GLU on the latent, $E_e(z) = \operatorname{SiTU\text{-}GLU}(z G_e^\top, z U_e^\top)\,D_e^\top$
   with $G_e$ = `experts.w1[e]` `[f, l]`, $U_e$ = `experts.w3[e]` `[f, l]`, $D_e$ = `experts.w2[e]` `[l, f]`;
3. the weighted sum **in the latent**: $u_i = \sum_{e \in \mathcal{T}_i} p_{i,e} E_e(z_i)$, `[m, l]`;
4. the Stable addition, **one** RMSNorm of the sum: $v = \dfrac{u}{\sqrt{\operatorname{mean}(u^2) + \varepsilon}}
   \odot g$ (mean over the $\ell$ coordinates of a token, $g$ = `routed_expert_norm.weight`);
5. $y_{\text{routed}} = v W_\uparrow^\top$ with $W_\uparrow$ = `routed_expert_up_proj.weight` `[d, l]`;
6. the shared experts, one GLU on the full width: $y_{\text{shared}} =
   \operatorname{SiTU\text{-}GLU}(x G_s^\top, x U_s^\top)\,D_s^\top$ with `shared_experts.gate_proj.weight`,
   `shared_experts.up_proj.weight` `[N_s f, d]` and `shared_experts.down_proj.weight` `[d, N_s f]`
   (possibly with $N_s f = 0$ rows: no shared expert);
7. $y = y_{\text{shared}} + y_{\text{routed}}$, `[m, d]`.

The norm sees the **sum**: the sum of normalized outputs is not the norm of the sum, which is why, split
over devices, the partial sums of $u$ are reduced before the norm.

Write `latent_moe(x, index, weights, params, config)`. `params` is a `dict` of arrays named as above (it
also holds the router's `gate.weight` and `gate.e_score_correction_bias`, which the route already used);
from `config` read $\beta_1$ = `config.situ_beta`, $\beta_2$ = `config.situ_linear_beta` and
$\varepsilon$ = `config.rms_norm_eps`.""",
    hint=r"""Loop over tokens and their $k$ experts if it helps (the sizes are tiny): `experts.w1[e] @ z[i]`
is expert `e`'s gate pre-activation for token `i`. Accumulate $p \cdot E_e(z_i)$ into a zero `[m, l]` array,
then normalize each row of the sum (`np.mean(u * u, axis=1, keepdims=True)`), multiply by the gain, and
project up. Write SiTU-GLU as a small helper inside the function.""",
    solution=latent_moe,
    reference=_latent_reference,
    reference_name="refimpl.stable_latent_moe(x, params, config, routing=(index, weights))",
    trials=(Trial("small layers with K3's switches and a drawn route", _latent_cases()),),
    output=_array_output("y", lambda c: c.args[0].shape, "float"),
    agree=_latent_agree,
    show=lambda value: _show_array(value, precision=6),
    mistakes=(
        Mistake("norm_skipped", "the RMSNorm of the sum skipped",
                "Without step 4 the layer is the original LatentMoE, not the Stable one: the routed branch then "
                "grows with the size of u, which is what the norm exists to stop.", _latent_variant(norm="none")),
        Mistake("norm_per_expert", "the norm applied to each expert's output instead of to the sum",
                "The norm is taken once, of the weighted sum u: a sum of normalized outputs is not the norm of "
                "the sum (under expert parallelism the partial sums are reduced before the norm for this "
                "reason).", _latent_variant(norm="per_expert")),
        Mistake("shared_left_out", "the shared experts left out",
                "y is the routed branch plus the shared experts, a GLU of width N_s f on the full-width x.",
                _latent_variant(shared=False)),
        Mistake("swiglu_experts", "SwiGLU in place of SiTU-GLU in the experts",
                "Every expert (routed and shared) uses the capped activation of Eq. (12), with the betas of the "
                "config.", _latent_variant(activation="swiglu")),
        Mistake("gain_left_out", "the norm's gain g left out",
                "RMSNorm multiplies by its learned gain routed_expert_norm.weight after dividing by the root "
                "mean square.", _latent_variant(gain=False)),
        Mistake("weights_left_out", "the mixture weights p left out of the sum",
                "u sums the chosen experts' outputs weighted by p: without the weights every chosen expert "
                "counts the same (the norm removes a common factor of a token's weights, not their ratios).",
                _latent_variant(weighted=False)),
        Mistake("eps_outside_root", "epsilon added outside the square root",
                "RMSNorm divides by sqrt(mean(u^2) + eps), with eps inside the root: sqrt(mean(u^2)) + eps is "
                "another function, and differs most for small u.", _latent_variant(eps="outside")),
        Mistake("norm_over_tokens", "the mean square taken over the tokens (axis 0) instead of over a token's "
                "latent coordinates",
                "Each token is normalized on its own: the mean of u^2 runs over the l coordinates of one row "
                "(axis 1 of the [m, l] sum), never across tokens, which would make a token's output depend on "
                "the others in its batch.", _latent_variant(axis=0)),
        Mistake("float32", "the layer computed in float32",
                "The input and weights arrive in float64 and the expected output is computed in float64; float32 "
                "arithmetic keeps about 7 significant digits instead of 16. Keep the arguments' type.",
                _latent_variant(dtype=np.float32), like=_float32_like, narrow=True),
    ),
    kit=_kit_forward,
)
