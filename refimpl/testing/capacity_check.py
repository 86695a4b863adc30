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
from functools import partial
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.validation import check_int
from ..layer.baselines import capacity_keep
from .outputs import user_array
from .profiles import kit_settings
from .report import CheckResult, Invariant, Violation, call_user, errors, run_check
from .router_check import tolerance_value

__all__ = ["CAPACITY_ORDERS", "CapacityCase", "capacity_cases", "check_capacity", "token_major_keep"]


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


#: The orders in which a port may serve the assignments of a batch, by the name it declares.
CAPACITY_ORDERS = {
    "rank_major": "rank by rank (every token's first choice before any token's second), tokens in order within "
                  "a rank: Switch Transformer's dispatch, refimpl.layer.baselines.capacity_keep",
    "token_major": "token by token, each token's k choices together in rank order: MaxText's documented order "
                   "(a convention of its own, not a mistake, when a port declares it)",
}


def token_major_keep(index: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """`kept` `[m, k]` when a port serves each token's choices together, token after token (MaxText's order)."""
    load = np.zeros(num_experts, dtype=np.int64)
    kept = np.zeros(index.shape, dtype=bool)
    for i in range(index.shape[0]):  # token by token
        for r in range(index.shape[1]):  # its choices in rank order
            e = index[i, r]
            if load[e] < capacity:
                kept[i, r], load[e] = True, load[e] + 1
    return kept


def _expected_keep(case: CapacityCase, order: str) -> np.ndarray:
    if order == "token_major":
        return token_major_keep(case.index, case.num_experts, case.capacity)
    return np.asarray(capacity_keep(case.index, case.num_experts, case.capacity))


@dataclass(frozen=True)
class _Capacity:
    """The user's function and what it declared: its serving order and the tolerance on the weights."""

    fn: Callable[..., Any]
    order: str = "rank_major"
    rtol: float = 1e-12
    atol: float = 0.0

    def run(self, case: CapacityCase) -> tuple[np.ndarray, np.ndarray]:
        return _output(call_user(self.fn, case.index, case.weights, case.num_experts, case.capacity), case)


# ---------------------------------------------------------------------------
# The invariants, one function each
# ---------------------------------------------------------------------------

def output_form(port: _Capacity, case: CapacityCase) -> None:
    """kept [m, k] bool and new_weights [m, k] finite floats."""
    port.run(case)


def not_exceeded(port: _Capacity, case: CapacityCase) -> None:
    """An expert of capacity C serves at most C assignments."""
    kept, _ = port.run(case)
    load = _loads(case.index, kept, case.num_experts)
    over = np.flatnonzero(load > case.capacity)
    if over.size:
        raise Violation(f"{over.size} of {case.num_experts} experts serve more than the capacity {case.capacity}",
                        [f"loads of the kept assignments: {load.tolist()}"], case.inputs())


def nothing_dropped(port: _Capacity, case: CapacityCase) -> None:
    """An expert receives at most m assignments (one per token): with C >= m nothing is dropped."""
    kept, _ = port.run(case)
    if not kept.all():
        raise Violation(f"{int((~kept).sum())} assignments dropped with capacity {case.capacity} >= m = "
                        f"{case.m}, where no expert can overflow", [], case.inputs())


def work_conserving(port: _Capacity, case: CapacityCase) -> None:
    r"""An assignment is kept while its expert has room: $\neg\text{kept}_{i,r} \Rightarrow L_e = C$."""
    kept, _ = port.run(case)
    load = _loads(case.index, kept, case.num_experts)
    needless = ~kept & (load[case.index] < case.capacity)
    if needless.any():
        i, r = np.argwhere(needless)[0]
        raise Violation(f"{int(needless.sum())} assignments were dropped although their expert had room",
                        [f"token {i}, rank {r + 1}: expert {case.index[i, r]} serves {load[case.index[i, r]]} "
                         f"< capacity {case.capacity}"], case.inputs())


def rank_order(port: _Capacity, case: CapacityCase) -> None:
    """Rank-major order: every token's first choice is served before any token's second choice."""
    kept, _ = port.run(case)
    for e in range(case.num_experts):  # loop over experts; the tokens are compared at once
        at = case.index == e  # [m, k]
        ranks = np.nonzero(at)[1]
        served_rank, dropped_rank = ranks[kept[at]], ranks[~kept[at]]
        if served_rank.size and dropped_rank.size and dropped_rank.min() < served_rank.max():
            details = ["slots must be served rank by rank: every token's first choice before any token's second "
                       "choice (serving each token's k choices together, token after token, gives this)"]
            if np.array_equal(kept, token_major_keep(case.index, case.num_experts, case.capacity)):
                details.append("the port serves token-major, MaxText's documented order: if that is its "
                               "convention, declare it with check_capacity(fn, order='token_major')")
            raise Violation(f"expert {e} served a choice of rank {served_rank.max() + 1} while it dropped a choice "
                            f"of rank {dropped_rank.min() + 1} (rank 1 = a token's first choice)", details,
                            case.inputs())


def token_order(port: _Capacity, case: CapacityCase) -> None:
    """Within a rank (rank-major) or at all (token-major), an earlier token is served before a later one."""
    kept, _ = port.run(case)
    if port.order == "token_major":  # every assignment of one expert, in token order
        for e in range(case.num_experts):
            tokens, ranks = np.nonzero(case.index == e)
            served, dropped = tokens[kept[tokens, ranks]], tokens[~kept[tokens, ranks]]
            if served.size and dropped.size and dropped.min() < served.max():
                raise Violation(f"expert {e} served token {served.max()} but dropped the earlier token "
                                f"{dropped.min()}", ["token-major order serves tokens in input order, each with "
                                                     "its k choices together"], case.inputs())
        return
    for r in range(case.k):
        for e in range(case.num_experts):
            tokens = np.flatnonzero(case.index[:, r] == e)
            served, dropped = tokens[kept[tokens, r]], tokens[~kept[tokens, r]]
            if served.size and dropped.size and dropped.min() < served.max():
                raise Violation(f"at rank {r + 1}, expert {e} served token {served.max()} but dropped the earlier "
                                f"token {dropped.min()}", ["within a rank, tokens are served in input order"],
                                case.inputs())


def weights_kept(port: _Capacity, case: CapacityCase) -> None:
    r"""No renormalization after a drop: $p'_{i,r} = p_{i,r}\,\text{kept}_{i,r}$."""
    kept, w = port.run(case)
    expected = case.weights * kept
    bad = ~(np.abs(w - expected) <= port.atol + port.rtol * np.abs(expected))
    if not bad.any():
        return
    rows = np.flatnonzero(bad.any(axis=1))
    details = [f"token {i}: kept {kept[i].tolist()}, weights in {np.round(case.weights[i], 6).tolist()}, "
               f"expected {np.round(expected[i], 6).tolist()}, got {np.round(w[i], 6).tolist()}" for i in rows[:3]]
    abs_err, _ = errors(w, expected)
    details.append(f"max abs error {abs_err:.3g}")
    partial = rows[(kept[rows].any(axis=1)) & (~kept[rows].all(axis=1))]
    survivors = expected[partial].sum(axis=1, keepdims=True)
    if partial.size and np.allclose(w[partial], expected[partial] / survivors, rtol=1e-9, atol=1e-12):
        details.append("the kept weights were renormalized after a drop: the sketch keeps them as they were, so "
                       "a token that lost an expert gets a smaller routed output")
    raise Violation(f"{rows.size} of {case.m} tokens have weights other than the input weights with the dropped "
                    "ones set to zero", details, case.inputs())


def same_as_reference(port: _Capacity, case: CapacityCase) -> None:
    """The overflow rule of the declared order: capacity_keep (rank-major) or token_major_keep."""
    kept, _ = port.run(case)
    expected = _expected_keep(case, port.order)
    if not np.array_equal(kept, expected):
        rows = np.flatnonzero(np.any(kept != expected, axis=1))
        name = "capacity_keep" if port.order == "rank_major" else "token_major_keep"
        raise Violation(f"{rows.size} of {case.m} tokens keep other assignments than {name}",
                        [f"token {i}: experts {case.index[i].tolist()}, expected kept {expected[i].tolist()}, "
                         f"got {kept[i].tolist()}" for i in rows[:3]], case.inputs())


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------

def check_capacity(fn: Callable[[np.ndarray, np.ndarray, int, int], Any], *, rtol: float = 1e-12,
                   atol: float = 0.0, max_tokens: int = 10, max_experts: int = 6,
                   settings: str | Settings | None = None, order: str = "rank_major") -> CheckResult:
    r"""Check `fn(index, weights, num_experts, capacity) -> (kept, new_weights)` against the sketch's rule.

    `order` is the serving order the port declares (`CAPACITY_ORDERS`): `"rank_major"` (the default, the
    sketch's: every token's first choice before any second) or `"token_major"` (each token's $k$ choices
    together, token after token: MaxText's documented order, a convention of its own). A rank-major check
    that meets a token-major port says so and names the declaration.

    Invariants, in the order they run (each a function of this module):

    1. **output shape and dtype** (`output_form`): `kept` `[m, k]` bool, `new_weights` `[m, k]` finite floats;
    2. **capacity never exceeded** (`not_exceeded`): every expert serves at most `capacity` assignments;
    3. **nothing dropped when capacity >= m** (`nothing_dropped`);
    4. **nothing dropped without need** (`work_conserving`): an assignment is dropped only when its expert
       is full;
    5. **rank order** (`rank_order`, rank-major only): no assignment of rank $r$ is served while an assignment
       of a lower rank to the same expert is dropped;
    6. **token order** (`token_order`): among assignments of equal rank to one expert (of any rank, for
       token-major), an earlier token is never dropped while a later one is served;
    7. **dropped weights zero, kept weights unchanged** (`weights_kept`): no renormalization after a drop;
    8. **the same as the reference** (`same_as_reference`): `refimpl.layer.baselines.capacity_keep`, or
       `token_major_keep` for token-major.

    `rtol`, `atol` apply to the weights (the kept ones must come back as they went in). Bad arguments are a
    `TypeError` or `ValueError` naming them.
    """
    if not callable(fn):
        raise TypeError(f"fn must be the capacity rule, a function, got {type(fn).__name__} {fn!r:.60}")
    if not isinstance(order, str) or order not in CAPACITY_ORDERS:
        raise ValueError(f"order must be one of {sorted(CAPACITY_ORDERS)}, got {order!r}")
    rtol, atol = tolerance_value("rtol", rtol), tolerance_value("atol", atol)
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    max_experts = check_int("max_experts", max_experts, low=1)
    resolved = kit_settings(settings)  # a bad profile name is an error before anything runs
    port = _Capacity(fn, order, rtol, atol)
    cases = capacity_cases(max_tokens=max_tokens, max_experts=max_experts)
    ample = st.integers(1, max_tokens).flatmap(
        lambda m: capacity_cases(max_tokens=max_tokens, max_experts=max_experts, capacity=max_tokens + m))

    def named(name: str, strategy: st.SearchStrategy, body: Callable[..., None], basic: bool = False) -> Invariant:
        why = (body.__doc__ or "").strip().split("\n")[0]
        return Invariant(name, why, strategy, partial(body, port), basic=basic, describe=CapacityCase.inputs)

    invariants = [
        named("output shape and dtype", cases, output_form, basic=True),
        named("capacity never exceeded", cases, not_exceeded),
        named("nothing dropped when capacity >= m", ample, nothing_dropped),
        named("nothing dropped without need", cases, work_conserving),
    ]
    if order == "rank_major":
        invariants.append(named("rank order", cases, rank_order))
        invariants.append(named("token order within a rank", cases, token_order))
    else:
        invariants.append(named("token order", cases, token_order))
    invariants += [
        named("dropped weights zero, kept weights unchanged", cases, weights_kept),
        named("same as capacity_keep" if order == "rank_major" else "same as token_major_keep", cases,
              same_as_reference),
    ]
    return run_check("check_capacity", invariants, resolved)
