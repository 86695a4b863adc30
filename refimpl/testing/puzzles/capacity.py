"""Puzzle 10: capacity with the drop priority of the textbook sketch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

from refimpl import (
    capacity_keep,
)
from refimpl.testing import check_capacity
from refimpl.testing.puzzles.core import (
    Case,
    Mistake,
    Puzzle,
    Trial,
    _array_output,
    _differ_arrays,
    _eps_close,
    _Malformed,
    _run_kit,
    _settings,
    _show_array,
)

# ---------------------------------------------------------------------------
# 10. Capacity with the drop priority of the textbook sketch
# ---------------------------------------------------------------------------

def serve_with_capacity(index: np.ndarray, weights: np.ndarray, num_experts: int,
                        capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep at most `capacity` assignments per expert: first choices first, then token order.

    index [m, k] int (best first), weights [m, k], num_experts n, capacity C
    ->  (kept [m, k] bool, new_weights [m, k])
    """
    m, k = index.shape
    served = np.zeros(num_experts, dtype=np.int64)
    kept = np.zeros((m, k), dtype=bool)
    # Rank by rank: every token's first choice, then every second choice, ...
    for r in range(k):
        # Within a rank, in token order
        for i in range(m):
            e = index[i, r]
            if served[e] < capacity:
                kept[i, r] = True
                served[e] += 1
    # A dropped assignment's weight becomes 0; the others stay as they were (no renormalization)
    return kept, weights * kept


def _capacity_reference(index: np.ndarray, weights: np.ndarray, num_experts: int,
                        capacity: int) -> tuple[np.ndarray, np.ndarray]:
    kept = np.asarray(capacity_keep(index, num_experts, capacity))
    return kept, weights * kept


@st.composite
def _capacity_cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, 6), label="num_experts")
    k = draw(st.integers(1, n), label="top_k")
    m = draw(st.integers(1, 8), label="m")
    rows = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True),
                         min_size=m, max_size=m), label="routes")
    raw = draw(st.lists(st.lists(st.integers(1, 16), min_size=k, max_size=k), min_size=m, max_size=m),
               label="weights")
    w = np.array(raw, dtype=np.float64)
    capacity = draw(st.integers(0, m + 1), label="capacity")
    return Case((np.array(rows, dtype=np.int64).reshape(m, k), w / w.sum(axis=1, keepdims=True), n, capacity))


def _capacity_output(value: Any, case: Case) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise _Malformed(f"it returned {type(value).__name__}; return the pair (kept, new_weights)")
    shape = case.args[0].shape
    kept = _array_output("kept", lambda c: shape, "bool")(value[0], case)
    weights = _array_output("new_weights", lambda c: shape, "float")(value[1], case)
    return kept, weights


def _capacity_variant(*, token_major: bool = False, renormalize: bool = False, slack: int = 0,
                      restart: bool = False, reverse_tokens: bool = False, zero_dropped: bool = True
                      ) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    def answer(index: np.ndarray, weights: np.ndarray, num_experts: int,
               capacity: int) -> tuple[np.ndarray, np.ndarray]:
        m, k = index.shape
        served = np.zeros(num_experts, dtype=np.int64)
        kept = np.zeros((m, k), dtype=bool)
        tokens = range(m - 1, -1, -1) if reverse_tokens else range(m)
        order = [(i, r) for i in tokens for r in range(k)] if token_major else \
            [(i, r) for r in range(k) for i in tokens]
        for i, r in order:
            if restart and i == tokens[0]:
                served[:] = 0  # the count started again at each rank
            if served[index[i, r]] < capacity + slack:
                kept[i, r] = True
                served[index[i, r]] += 1
        new = weights * kept if zero_dropped else weights.copy()
        if renormalize:
            total = new.sum(axis=1, keepdims=True)
            new = np.where(total > 0, new / np.where(total > 0, total, 1.0), 0.0)
        return kept, new
    return answer


def _capacity_differ(case: Case, expected: tuple[np.ndarray, np.ndarray],
                     got: tuple[np.ndarray, np.ndarray]) -> list[str]:
    """What differs, in plain words: the assignments kept that the sketch drops and the other way round
    (`index[i, r]`: token i's choice r), then new_weights where they are not what the kept ones make."""
    index, weights = case.args[0], case.args[1]

    def listed(mask: np.ndarray) -> str:
        at = [f"index[{i}, {r}] (expert {index[i, r]})" for i, r in np.argwhere(mask).tolist()]
        return ", ".join(at[:4]) + (f" and {len(at) - 4} more" if len(at) > 4 else "")

    lines = []
    extra, lost = got[0] & ~expected[0], expected[0] & ~got[0]
    if extra.any():
        lines.append(f"What differs: kept where the sketch drops: {listed(extra)}.")
    if lost.any():
        lines.append(f"What differs: dropped where the sketch keeps: {listed(lost)}.")
    if not lines:
        lines += _differ_arrays(case, expected[1], got[1], "new_weights (the kept assignments are right)")
    elif not _eps_close(got[1], weights * got[0], scale=1.0):
        lines += _differ_arrays(case, weights * got[0], got[1], "new_weights, next to weights * (your kept)")
    return lines


def _kit_capacity(fn: Callable[..., Any]) -> str:
    return _run_kit("check_capacity", lambda: check_capacity(fn, settings=_settings(30)))


CAPACITY = Puzzle(
    number=10, name="capacity", title="Capacity with the drop priority of the textbook sketch",
    spec=r"""K3 serves every assignment its router makes. The systems it is compared with (Switch Transformer
and the textbook MoE sketch) give each expert a **capacity** $C = \lceil c\,mk/n \rceil$ and drop what does not
fit. Which assignments are dropped is fixed by a priority:

* assignments are served **rank by rank**: every token's first choice before any token's second choice;
* within a rank, **in token order**;
* an assignment is kept while its expert has served fewer than $C$; a dropped assignment's weight becomes 0,
  and the token's other weights are **not renormalized**.

With $\text{position}_{i,r}$ the number of assignments to expert `index[i, r]` served before $(i, r)$:

$$
\text{kept}_{i,r} = \bigl[\,\text{position}_{i,r} < C\,\bigr],
$$

$$
p'_{i,r} = p_{i,r}\,\text{kept}_{i,r}.
$$

Serving each token's $k$ choices together, token after token, would let the first tokens of a batch take all
the room: late tokens would lose even their first choice while early ones keep their $k$-th.

Write `serve_with_capacity(index, weights, num_experts, capacity)`: `index` `[m, k]` integers (each row a
token's distinct experts, best first), `weights` `[m, k]`, `num_experts` $n$, `capacity` $C \ge 0$. Return the
pair `(kept, new_weights)`: `kept` `[m, k]` booleans, `new_weights` `[m, k]`.""",
    hint=r"""Two loops in serving order, ranks outside and tokens inside, with a counter per expert: keep
`(i, r)` while `served[index[i, r]] < capacity`. Then `weights * kept`.""",
    solution=serve_with_capacity,
    reference=_capacity_reference,
    reference_name="refimpl.capacity_keep(index, num_experts, capacity), and weights * kept",
    trials=(Trial("routes of a few tokens over a few experts, capacities from 0 to m + 1", _capacity_cases()),),
    output=_capacity_output,
    agree=lambda got, expected, case: bool(np.array_equal(got[0], expected[0]))
    and _eps_close(got[1], expected[1], scale=1.0),
    show=lambda value: (_show_array(value[0], prefix="kept        = ") + "\n"
                        + _show_array(value[1], 4, prefix="new_weights = ")),
    differ=_capacity_differ,
    mistakes=(
        Mistake("token_major", "capacity served token by token instead of rank by rank",
                "Serving each token's k choices together lets the first tokens of the batch fill the experts: "
                "later tokens lose even their first choice while early ones keep their k-th. The sketch serves "
                "every first choice before any second choice.", _capacity_variant(token_major=True)),
        Mistake("renormalized_after_drop", "the kept weights renormalized after a drop",
                "The sketch sets a dropped weight to 0 and leaves the others as they were, so a token that lost "
                "an expert gets a smaller routed output; renormalizing changes its scale exactly when its experts "
                "were busy.", _capacity_variant(renormalize=True)),
        Mistake("capacity_plus_one", "one assignment more than the capacity kept",
                "An expert of capacity C serves C assignments: keep while fewer than C were served (< C, not "
                "<= C).", _capacity_variant(slack=1)),
        Mistake("capacity_minus_one", "one assignment fewer than the capacity kept",
                "An expert of capacity C serves C assignments: keep while fewer than C were served, which "
                "keeps the C-th too (served < C, not served < C - 1 or served + 1 < C).",
                _capacity_variant(slack=-1)),
        Mistake("dropped_weight_kept", "a dropped assignment's weight left in new_weights",
                "A dropped assignment contributes nothing: its weight becomes 0 (weights * kept), while the kept "
                "ones stay as they were.", _capacity_variant(zero_dropped=False)),
        Mistake("count_restarted_per_rank", "each expert's count started again at every rank",
                "Capacity bounds all the assignments an expert serves in the batch, first choices and later "
                "ones together: the count carries over from one rank to the next.",
                _capacity_variant(restart=True)),
        Mistake("tokens_from_the_end", "the tokens of a rank served from the last to the first",
                "Within a rank the sketch serves the tokens in their order in the batch, token 0 first.",
                _capacity_variant(reverse_tokens=True)),
    ),
    kit=_kit_capacity,
)
