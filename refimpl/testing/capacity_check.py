r"""`check_capacity`: test your own capacity limit and token dropping.

A layer with a capacity factor serves at most $C = \lceil c\,mk/n \rceil$
assignments per expert and drops the rest. The usual capacity sketch (Switch
Transformer's dispatch, as `refimpl.layer.baselines.capacity_keep` implements it)
fixes the overflow rule exactly:

* assignments are served **rank by rank**, every token's first choice before
  any token's second choice, and within a rank **in token order**;
* an assignment is kept while its expert holds fewer than $C$;
* a dropped assignment's weight becomes zero and the token's other weights
  are **not renormalized**.

Two mistakes are easy to make and invisible in a loss curve. Serving each
token's $k$ choices together, token after token (token-order priority), lets
the first tokens of a batch take all the room, so late tokens lose even their
first choice while early ones keep their $k$-th. Renormalizing the surviving
weights after a drop changes the scale of a token's output exactly when its
experts were busy. `check_capacity` catches both, and says which it is.

The user's callable has the signature

```python
fn(index, weights, num_experts, capacity) -> (kept, new_weights)
```

with `index` `[m, k]` int64 (each row: a token's distinct experts, best
first), `weights` `[m, k]` float64, and `kept` `[m, k]` bool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from ..layer.baselines import capacity_keep
from .outputs import user_array
from .profiles import kit_settings
from .report import CheckResult, Invariant, Violation, call_user, errors, run_check

__all__ = ["CapacityCase", "capacity_cases", "check_capacity"]


@dataclass(frozen=True)
class CapacityCase:
    """One input of a capacity check: routes `index`, their `weights`, `num_experts` and `capacity`."""

    index: np.ndarray  # [m, k] int64, distinct ids per row
    weights: np.ndarray  # [m, k] float64, positive, each row sums to 1
    num_experts: int
    capacity: int

    @property
    def m(self) -> int:
        """Tokens."""
        return int(self.index.shape[0])

    @property
    def k(self) -> int:
        """Experts per token."""
        return int(self.index.shape[1])

    def inputs(self) -> dict[str, Any]:
        """The arguments as printed in a report."""
        return {"index": self.index, "weights": self.weights, "num_experts": self.num_experts,
                "capacity": self.capacity}


@st.composite
def capacity_cases(draw: st.DrawFn, max_tokens: int = 10, max_experts: int = 6,
                   capacity: int | None = None) -> CapacityCase:
    """Routes of a few tokens over a few experts, and a capacity from 0 to m + 1.

    Each token's experts are distinct; Hypothesis shrinks towards every token
    choosing the low ids, which is where experts overflow. `capacity` fixes
    the capacity instead of drawing it.
    """
    n = draw(st.integers(1, max_experts), label="num_experts")
    k = draw(st.integers(1, n), label="top_k")
    m = draw(st.integers(1, max_tokens), label="m")
    rows = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True),
                         min_size=m, max_size=m), label="routes")
    raw = draw(st.lists(st.lists(st.integers(1, 16), min_size=k, max_size=k), min_size=m, max_size=m),
               label="weights")
    w = np.array(raw, dtype=np.float64)
    w = w / w.sum(axis=1, keepdims=True)
    c = draw(st.integers(0, m + 1), label="capacity") if capacity is None else capacity
    return CapacityCase(np.array(rows, dtype=np.int64).reshape(m, k), w, n, c)


def _output(out: Any, case: CapacityCase) -> tuple[np.ndarray, np.ndarray]:
    """Validate `(kept, new_weights)` and return them as bool and float64 arrays."""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise Violation(f"the function must return a pair (kept, new_weights), got {type(out).__name__}")
    kept, weights = user_array("kept", out[0]), user_array("new_weights", out[1])
    shape = (case.m, case.k)
    if kept.shape != shape or weights.shape != shape:
        raise Violation(f"kept and new_weights must both have shape [m, k] = {list(shape)}, "
                        f"got {list(kept.shape)} and {list(weights.shape)}")
    if kept.dtype != np.bool_:
        raise Violation(f"kept must be a boolean array, got dtype {kept.dtype}")
    if not np.issubdtype(weights.dtype, np.floating) or not np.all(np.isfinite(weights)):
        raise Violation(f"new_weights must be finite floats, got dtype {weights.dtype}")
    return kept, weights.astype(np.float64)


def _loads(index: np.ndarray, kept: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(index[kept], minlength=n)[:n]


def check_capacity(fn: Callable[[np.ndarray, np.ndarray, int, int], Any], *, rtol: float = 1e-12,
                   atol: float = 0.0, max_tokens: int = 10, max_experts: int = 6,
                   settings: str | Settings | None = None) -> CheckResult:
    r"""Check `fn(index, weights, num_experts, capacity) -> (kept, new_weights)` against the sketch's rule.

    Invariants, in the order they run:

    1. **output shape and dtype**: `kept` `[m, k]` bool, `new_weights` `[m, k]` finite floats;
    2. **capacity never exceeded**: every expert serves at most `capacity` assignments;
    3. **nothing dropped without need**: an assignment is dropped only when its expert is full,
       and nothing at all when `capacity >= m`;
    4. **rank order**: no assignment of rank $r$ is served while an assignment of a lower rank
       to the same expert is dropped (every first choice before any second);
    5. **token order within a rank**: among assignments of equal rank to one expert, an earlier
       token is never dropped while a later one is served;
    6. **dropped weights are zero, kept weights unchanged**: no renormalization after a drop;
    7. **the same as the reference** `refimpl.layer.baselines.capacity_keep`.

    `rtol`, `atol` apply to the weights (the kept ones must come back as they went in).
    """
    cases = capacity_cases(max_tokens=max_tokens, max_experts=max_experts)
    ample = st.integers(1, max_tokens).flatmap(
        lambda m: capacity_cases(max_tokens=max_tokens, max_experts=max_experts, capacity=max_tokens + m))

    def run(case: CapacityCase) -> tuple[np.ndarray, np.ndarray]:
        out = call_user(fn, case.index, case.weights, case.num_experts, case.capacity)
        return _output(out, case)

    def describe(case: CapacityCase) -> dict[str, Any]:
        return case.inputs()

    def form(case: CapacityCase) -> None:
        run(case)

    def not_exceeded(case: CapacityCase) -> None:
        kept, _ = run(case)
        load = _loads(case.index, kept, case.num_experts)
        over = np.flatnonzero(load > case.capacity)
        if over.size:
            raise Violation(f"{over.size} of {case.num_experts} experts serve more than the capacity {case.capacity}",
                            [f"loads of the kept assignments: {load.tolist()}"], case.inputs())

    def work_conserving(case: CapacityCase) -> None:
        kept, _ = run(case)
        load = _loads(case.index, kept, case.num_experts)
        # A dropped assignment must find its expert full: $$\neg\text{kept}_{i,r} \Rightarrow L_{e} = C$$
        needless = ~kept & (load[case.index] < case.capacity)
        if needless.any():
            i, r = np.argwhere(needless)[0]
            raise Violation(
                f"{int(needless.sum())} assignments were dropped although their expert had room",
                [f"token {i}, rank {r + 1}: expert {case.index[i, r]} serves {load[case.index[i, r]]} "
                 f"< capacity {case.capacity}"], case.inputs())

    def rank_order(case: CapacityCase) -> None:
        kept, _ = run(case)
        for e in range(case.num_experts):  # loop over experts; the tokens are compared at once
            at = case.index == e  # [m, k]
            ranks = np.nonzero(at)[1]
            served_rank = ranks[kept[at]]
            dropped_rank = ranks[~kept[at]]
            if served_rank.size and dropped_rank.size and dropped_rank.min() < served_rank.max():
                raise Violation(
                    f"expert {e} served a choice of rank {served_rank.max() + 1} while it dropped a choice "
                    f"of rank {dropped_rank.min() + 1} (rank 1 = a token's first choice)",
                    ["slots must be served rank by rank: every token's first choice before any "
                     "token's second choice (serving each token's k choices together, token after "
                     "token, gives this)"], case.inputs())

    def token_order(case: CapacityCase) -> None:
        kept, _ = run(case)
        for r in range(case.k):
            for e in range(case.num_experts):
                tokens = np.flatnonzero(case.index[:, r] == e)
                served, dropped = tokens[kept[tokens, r]], tokens[~kept[tokens, r]]
                if served.size and dropped.size and dropped.min() < served.max():
                    raise Violation(
                        f"at rank {r + 1}, expert {e} served token {served.max()} but dropped the earlier "
                        f"token {dropped.min()}", ["within a rank, tokens are served in input order"],
                        case.inputs())

    def weights_kept(case: CapacityCase) -> None:
        kept, w = run(case)
        # $$p'_{i,r} = p_{i,r}\,\text{kept}_{i,r}$$
        expected = case.weights * kept
        bad = ~(np.abs(w - expected) <= atol + rtol * np.abs(expected))
        if bad.any():
            rows = np.flatnonzero(bad.any(axis=1))
            details = [f"token {i}: kept {kept[i].tolist()}, weights in {np.round(case.weights[i], 6).tolist()}, "
                       f"expected {np.round(expected[i], 6).tolist()}, got {np.round(w[i], 6).tolist()}"
                       for i in rows[:3]]
            abs_err, _ = errors(w, expected)
            details.append(f"max abs error {abs_err:.3g}")
            partial = rows[(kept[rows].any(axis=1)) & (~kept[rows].all(axis=1))]
            survivors = expected[partial].sum(axis=1, keepdims=True)
            if partial.size and np.allclose(w[partial], expected[partial] / survivors, rtol=1e-9, atol=1e-12):
                details.append("the kept weights were renormalized after a drop: the sketch keeps them as they "
                               "were, so a token that lost an expert gets a smaller routed output")
            raise Violation(f"{rows.size} of {case.m} tokens have weights other than the input weights "
                            "with the dropped ones set to zero", details, case.inputs())

    def reference(case: CapacityCase) -> None:
        kept, _ = run(case)
        expected = np.asarray(capacity_keep(case.index, case.num_experts, case.capacity))
        if not np.array_equal(kept, expected):
            rows = np.flatnonzero(np.any(kept != expected, axis=1))
            raise Violation(
                f"{rows.size} of {case.m} tokens keep other assignments than capacity_keep",
                [f"token {i}: experts {case.index[i].tolist()}, expected kept {expected[i].tolist()}, "
                 f"got {kept[i].tolist()}" for i in rows[:3]], case.inputs())

    def nothing_dropped(case: CapacityCase) -> None:
        kept, _ = run(case)
        if not kept.all():
            raise Violation(f"{int((~kept).sum())} assignments dropped with capacity {case.capacity} >= m = "
                            f"{case.m}, where no expert can overflow", [], case.inputs())

    invariants = [
        Invariant("output shape and dtype", "kept [m, k] bool and new_weights [m, k] finite floats",
                  cases, form, basic=True, describe=describe),
        Invariant("capacity never exceeded", "an expert of capacity C serves at most C assignments",
                  cases, not_exceeded, describe=describe),
        Invariant("nothing dropped when capacity >= m", "an expert receives at most m assignments (one per token)",
                  ample, nothing_dropped, describe=describe),
        Invariant("nothing dropped without need", "the sketch keeps an assignment while its expert has room",
                  cases, work_conserving, describe=describe),
        Invariant("rank order", "the sketch serves every token's first choice before any second choice",
                  cases, rank_order, describe=describe),
        Invariant("token order within a rank", "the sketch serves tokens of one rank in input order",
                  cases, token_order, describe=describe),
        Invariant("dropped weights zero, kept weights unchanged",
                  "the sketch does not renormalize the remaining gates after a drop", cases, weights_kept,
                  describe=describe),
        Invariant("same as capacity_keep", "the sketch's overflow rule, as refimpl.layer.baselines implements it",
                  cases, reference, describe=describe),
    ]
    return run_check("check_capacity", invariants, kit_settings(settings))
