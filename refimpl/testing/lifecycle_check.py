r"""Balancing in the trainer's loop, checked: the lifecycle faults a correct Eq. (14) can still suffer.

A balancer can compute Eq. (14) or Appendix D exactly and still set the wrong
bias, because of the loop around it: an evaluation forward that is counted, a
micro-batch counted twice when activation checkpointing runs its forward again,
a step that saw no token, a frozen bias that still moves, a tensor-parallel
replica counted as data, a histogram that a checkpoint taken in the middle of a
step does not hold. `check_balancer_lifecycle(make)` drives scripted training
sequences through your balancer and holds each against its **metamorphic
twin**, the same step without the thing that must not matter, and, when you
declare the estimator, against refimpl's reference.

## The adapter

`make(num_experts, top_k)` returns your balancer behind an object with:

| member | what the check does with it |
|---|---|
| `observe(scores, *, training=True, grad=True, recomputing=False, rank=0, replica=False)` | one forward of a micro-batch: `scores` `[m, n]` float32 sigmoid scores (NumPy); route them with the bias you hold and count them as your trainer would. `training=False`: the module is in eval mode; `grad=False`: the forward runs under `torch.no_grad()`; `recomputing=True`: this is activation checkpointing running the forward of a micro-batch already observed once more; `rank`: the data-parallel rank whose forward it is; `replica=True`: the rank is a tensor-parallel replica of another that sees the same tokens |
| `update()` | the end of the step (the optimizer step): reduce over the ranks, compute the next bias, clear the step's counts |
| `bias` | the bias `[n]` that routes the next forward, added to the scores |
| `state_dict()` / `load_state_dict(state)` | a checkpoint: the check deep-copies what `state_dict()` returns and loads it into a fresh `make(num_experts, top_k)` |
| `frozen` (optional) | a switch the check sets to `True` and back to `False`; without it the frozen sequence is not run |

The adapter maps each keyword onto your code: for a PyTorch module,
`training` is `module.train(training)`, `grad` is `torch.set_grad_enabled(grad)`,
`recomputing=True` calls the forward again as `torch.utils.checkpoint` does in
the backward (in training mode, with grad enabled), and the ranks are one
module each whose counts `update()` sums (the all-reduce) before the bias is
read. A complete example, for a torch-style balancer that keeps its
histogram in a buffer:

```python
import copy
import numpy as np
import torch
from refimpl.testing import check_balancer_lifecycle

class TorchHistogramBalancer(torch.nn.Module):      # the user's balancer
    def __init__(self, n, k, bins=1000):
        super().__init__()
        self.k, self.bins = k, bins
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("counts", torch.zeros(n, bins, dtype=torch.int64))  # persistent: in checkpoints
        self.frozen = self.recomputing = False

    def forward(self, scores):                       # [m, n] sigmoid scores
        biased = scores + self.bias
        top = biased.topk(self.k + 1, dim=1).values
        if self.training and torch.is_grad_enabled() and not self.frozen and not self.recomputing:
            low = self.bias.min() - 1
            width = (self.bias.max() - self.bias.min() + 2) / self.bins
            r = top[:, -1:] - scores                 # the bias each expert needs, [m, n]
            idx = ((r - low) / width).floor().long().clamp(0, self.bins - 1)
            self.counts.scatter_add_(1, idx.T, torch.ones_like(idx.T))
        return biased.topk(self.k, dim=1).indices

class Adapter:
    def __init__(self, n, k):
        self.ranks = {}                              # one module per data-parallel rank
        self.n, self.k = n, k
        self.frozen = False
        self.bias = np.zeros(n, dtype=np.float32)

    def module(self, rank):
        if rank not in self.ranks:
            m = TorchHistogramBalancer(self.n, self.k)
            m.bias.copy_(torch.from_numpy(self.bias))
            self.ranks[rank] = m
        return self.ranks[rank]

    def observe(self, scores, *, training=True, grad=True, recomputing=False, rank=0, replica=False):
        if replica:                                  # a replica's tokens are counted by its original
            return
        m = self.module(rank)
        m.train(training)
        m.frozen, m.recomputing = self.frozen, recomputing
        with torch.set_grad_enabled(grad):
            m(torch.from_numpy(scores))

    def update(self):
        if not self.ranks or self.frozen:
            self.ranks = {}
            return
        counts = sum(m.counts for m in self.ranks.values())   # the all-reduce, [n, bins]
        cum = counts.cumsum(1)
        t = int(cum[0, -1]) * self.k // self.n + 1    # the (q+1)-th smallest (q whole here)
        h = (cum < t).sum(1, keepdim=True)            # the bin that holds it, [n, 1]
        c = counts.gather(1, h)
        u = t - (cum.gather(1, h) - c)                # its place inside the bin
        b = torch.from_numpy(self.bias)
        low, width = b.min() - 1, (b.max() - b.min() + 2) / counts.shape[1]
        new = (low + (h + (u - 0.5) / c) * width)[:, 0]
        self.bias = (new - new.mean()).float().numpy()
        self.ranks = {}

    def state_dict(self):
        return {"bias": self.bias.copy(), "ranks": {r: m.state_dict() for r, m in self.ranks.items()}}

    def load_state_dict(self, state):
        self.bias = state["bias"].copy()
        self.ranks = {}
        for r, s in state["ranks"].items():
            self.module(r).load_state_dict(s)

check_balancer_lifecycle(Adapter, estimator="histogram", bins=1000)
```

`ReferenceAdapter` below is the same protocol around refimpl's own
`quantile_balancing_update` (`estimator="exact"`) and `BiasHistogram`
(`estimator="histogram"`); `MegatronGlobalBatchAdapter` and
`TorchtitanAdapter` put the two trainers' balancers of
`refimpl.balancing.shipped` behind it, mapping each keyword onto the switch
their source reads.

## The sequences and the faults they name

Each invariant is one function, and its name is the fault it rules out:

| invariant | the sequence | its twin |
|---|---|---|
| matches the declared estimator | a step of micro-batches over ranks | `quantile_balancing_update` of the pooled batch (`"exact"`, within float32 rounding) or within two bin widths of it (`"histogram"`) |
| micro-batches and ranks pooled, not averaged | the step's blocks over micro-batches and ranks | the same tokens in one forward |
| not observed in eval or under no_grad | eval forwards (`training=False`) and `no_grad` forwards between the micro-batches | the step without them |
| counted once under recomputation | a recomputed forward of the first micro-batch | the step without it |
| no NaN and no move on an empty step | a step in which nothing is observed, then a normal step | the bias before it; the normal step alone |
| no move while frozen | a frozen step, then an unfrozen one | the bias before it; the unfrozen step alone |
| accumulator kept on resume | a checkpoint saved after the first micro-batch and loaded into a fresh balancer | the step uninterrupted |
| replicas not counted as data | rank 0's micro-batches observed again by a replica rank | the step without the replica |

Biases are compared within $10^{-5}$ (a balancer that counts the same tokens
in another order may round differently; every fault moves the bias by far
more on the drawn sequences). The data differ between micro-batches and
ranks (each block has its own skew over the experts), so a fault that counts
some tokens twice changes the quantile; the eval forwards favour one expert
heavily. Every failure prints a script you can paste below your `make`: the
calls of the sequence and of its twin, with the arrays written out.

## refimpl's balancers and the two trainers', through the check

Measured by the tests (`tests/test_lifecycle.py`):

* refimpl's exact pooled update and its histogram (`ReferenceAdapter`, which
  keeps the step's blocks or counts in its state) pass every invariant;
  on an empty step they keep the bias (`BiasHistogram.new_bias` refuses an
  empty histogram, so the adapter does not call it).
* Megatron-Core's `global_batch` mode (`MegatronGlobalBatchAdapter`) fails
  **counted once under recomputation**: its guard, `training and
  torch.is_grad_enabled() and not frozen_expert_bias`, cannot tell a forward
  that `torch.utils.checkpoint` runs again (in training mode, with grad
  enabled) from the first; and **accumulator kept on resume**: its histogram
  is a non-persistent buffer. On an empty step it keeps the bias and the range.
  It skips eval and `no_grad` forwards and a frozen router.
* torchtitan's `QuantileBalancer` (`TorchtitanAdapter`) fails **not observed
  in eval or under no_grad** (it consults `self.training` only, so a forward
  under `no_grad` in training mode is counted), **counted once under
  recomputation** and **accumulator kept on resume** for the same reasons,
  and **no NaN and no move on an empty step**: its estimate divides by the
  count of an empty bin, $0/0$, and every entry of the bias becomes NaN. It
  has no frozen switch.
* Both count a replica's histogram when the replica is in the group they
  reduce over: the adapters here add it, as an all-reduce over a group that
  holds it does, and the check names **replicas not counted as data**.
  Megatron-Core reduces over TP×DP×CP, right when the tensor-parallel ranks
  hold different tokens (sequence parallelism).
* Declared as histograms (`estimator="histogram"`), both shipped balancers
  also fail **matches the declared estimator**: they read the $\lceil q
  \rceil$-th smallest required bias where Eq. (14) reads the $(q+1)$-th, and
  on the check's steps of 16 to 144 tokens the two lie many bins apart
  (`docs/measure_lifecycle.py` prints the whole table).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.validation import check_int
from .._lib.values import switch_value
from .outputs import fmt, user_array
from .profiles import kit_settings
from .report import CheckResult, Invariant, Violation, call_user, format_array, run_check

__all__ = [
    "LifecycleCase",
    "MegatronGlobalBatchAdapter",
    "ReferenceAdapter",
    "TorchtitanAdapter",
    "check_balancer_lifecycle",
    "lifecycle_cases",
    "observe_switches",
]

#: How far two biases that must be equal may differ (float32 rounding of a different order of counting).
TOLERANCE = 1e-5


# ---------------------------------------------------------------------------
# The scripted sequences
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LifecycleCase:
    """One drawn training scenario: sizes, a warm-up step, the step under test, the next step, the eval data.

    `step[r]` is the list of micro-batches `[m, n]` of rank `r`; `warmup` and
    `next_step` are flat lists of micro-batches (rank 0); `eval_scores`
    favours expert 0 heavily, so counting it moves the quantile.
    """

    num_experts: int
    top_k: int
    warmup: list[np.ndarray]
    step: list[list[np.ndarray]]
    next_step: list[np.ndarray]
    eval_scores: np.ndarray


def _block(rng: np.random.Generator, m: int, n: int) -> np.ndarray:
    """Sigmoid scores `[m, n]` with a skew of the block's own over the experts."""
    skew = rng.normal(0.0, 1.5, n)  # [n], different for every block
    return (1.0 / (1.0 + np.exp(-(rng.normal(size=(m, n)) + skew)))).astype(np.float32)


@st.composite
def lifecycle_cases(draw: st.DrawFn) -> LifecycleCase:
    """Small scenarios: 4-8 experts, 1-3 ranks of 2-3 micro-batches of 8-16 tokens, fixed by a drawn seed."""
    n = draw(st.integers(4, 8))
    k = draw(st.integers(1, n - 2))
    ranks, micro = draw(st.integers(1, 3)), draw(st.integers(2, 3))
    m = draw(st.integers(8, 16))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    warmup = [_block(rng, m, n) for _ in range(micro)]
    step = [[_block(rng, m, n) for _ in range(micro)] for _ in range(ranks)]
    next_step = [_block(rng, m, n) for _ in range(micro)]
    eval_scores = _block(rng, m, n)
    eval_scores[:, 0] = np.float32(0.999)  # every eval token wants expert 0
    return LifecycleCase(n, k, warmup, step, next_step, eval_scores)


class _Run:
    """One balancer driven through calls that are also written down as a script to paste."""

    def __init__(self, make: Callable[[int, int], Any], case: LifecycleCase, name: str, lines: list[str]) -> None:
        self.make, self.case, self.name, self.lines = make, case, name, lines
        lines.append(f"{name} = make({case.num_experts}, {case.top_k})")
        self.balancer = adapter_of(make, case.num_experts, case.top_k)

    def observe(self, scores: np.ndarray, **flags: Any) -> None:
        shown = "".join(f", {key}={value!r}" for key, value in flags.items())
        self.lines.append(f"{self.name}.observe({format_array(scores, prefix=f'{self.name}.observe(')}{shown})")
        call_user(self.balancer.observe, scores, **flags)

    def update(self) -> None:
        self.lines.append(f"{self.name}.update()")
        call_user(self.balancer.update)

    def set_frozen(self, frozen: bool) -> None:
        self.lines.append(f"{self.name}.frozen = {frozen}")
        try:
            self.balancer.frozen = frozen
        except Exception as exc:  # a read-only or failing `frozen` of the user's adapter
            raise Violation(f"setting the adapter's frozen = {frozen} raised {type(exc).__name__}: {exc}") from exc

    def resume(self) -> None:
        """Checkpoint now and continue in a fresh balancer loaded from it."""
        self.lines.append(f"state = copy.deepcopy({self.name}.state_dict())")
        self.lines.append(f"{self.name} = make({self.case.num_experts}, {self.case.top_k})")
        self.lines.append(f"{self.name}.load_state_dict(state)")
        state = copy.deepcopy(call_user(self.balancer.state_dict))
        self.balancer = adapter_of(self.make, self.case.num_experts, self.case.top_k)
        call_user(self.balancer.load_state_dict, state)

    def bias(self) -> np.ndarray:
        value = user_array(f"{self.name}.bias", getattr(self.balancer, "bias", None), dtype=np.float64)
        if value.shape != (self.case.num_experts,):
            raise Violation(f"{self.name}.bias must have shape [{self.case.num_experts}], got {list(value.shape)}")
        return value

    def step(self, blocks: list[np.ndarray]) -> None:
        for block in blocks:
            self.observe(block)
        self.update()

    def ranked_step(self, step: list[list[np.ndarray]], between: Callable[[int, int], None] | None = None) -> None:
        """The step under test: micro-batch i of every rank, then i + 1; `between(rank, i)` after each forward."""
        for i in range(len(step[0])):
            for rank, blocks in enumerate(step):
                self.observe(blocks[i], rank=rank)
                if between is not None:
                    between(rank, i)
        self.update()


#: The methods every adapter has (`bias` is read as an attribute, `frozen` is optional).
PROTOCOL = ("observe", "update", "state_dict", "load_state_dict")


def adapter_of(make: Callable[[int, int], Any], num_experts: int, top_k: int) -> Any:
    """`make(num_experts, top_k)`, checked to hold every method of the protocol; a `Violation` naming those missing.

    An adapter without `observe` (or any other method) would otherwise fail with an `AttributeError` from
    inside the check, far from the cause.
    """
    balancer = call_user(make, num_experts, top_k)
    missing = []
    for method in PROTOCOL:
        try:
            found = callable(getattr(balancer, method, None))
        except Exception:  # a property of the user's adapter that raises
            found = False
        if not found:
            missing.append(method)
    if missing:
        raise Violation(f"make({num_experts}, {top_k}) returned a {type(balancer).__name__} without the method"
                        f"{'s' if len(missing) > 1 else ''} {', '.join(f'{m}()' for m in missing)} of the adapter "
                        f"protocol ({', '.join(f'{m}()' for m in PROTOCOL)} and the attribute bias)")
    return balancer


def _script(lines: list[str], first: str, second: str) -> list[str]:
    """The report's script: imports, the calls, and the print that shows the two biases."""
    return ["reproduce it (paste below your make):", "    import copy", "    import numpy as np",
            *[f"    {piece}" for line in lines for piece in line.split("\n")],
            f"    print(np.asarray({first}.bias), np.asarray({second}.bias))"]


def _compare(fault: str, got: np.ndarray, expected: np.ndarray, what: str, lines: list[str], first: str,
             second: str, tolerance: float = TOLERANCE) -> None:
    """Raise the fault when `got` is not finite or differs from `expected` by more than `tolerance`."""
    if np.isfinite(got).all() and np.abs(got - expected).max() <= tolerance:
        return
    how = "is not finite" if not np.isfinite(got).all() else \
        f"differs by up to {np.abs(got - expected).max():.3g} (tolerance {tolerance:.3g})"
    raise Violation(f"{fault}: the bias {how} {what}",
                    [f"expected {fmt(expected)}", f"got      {fmt(got)}", *_script(lines, first, second)])


# ---------------------------------------------------------------------------
# The invariants, one function each
# ---------------------------------------------------------------------------

def _warm(make: Callable[[int, int], Any], case: LifecycleCase, name: str, lines: list[str]) -> _Run:
    """A fresh balancer after one ordinary step, so that the bias under test is not the zero it starts with."""
    run = _Run(make, case, name, lines)
    run.step(case.warmup)
    return run


def pooled_not_averaged(make: Callable[[int, int], Any], case: LifecycleCase) -> None:
    lines: list[str] = []
    spread, one = _warm(make, case, "balancer", lines), _warm(make, case, "twin", lines)
    spread.ranked_step(case.step)
    one.step([np.concatenate([b for blocks in case.step for b in blocks])])
    _compare("micro-batches or ranks averaged, not pooled", spread.bias(), one.bias(),
             "after a step split over micro-batches and ranks, against the same tokens in one forward",
             lines, "balancer", "twin")


def eval_not_observed(make: Callable[[int, int], Any], case: LifecycleCase) -> None:
    lines: list[str] = []
    with_eval, twin = _warm(make, case, "balancer", lines), _warm(make, case, "twin", lines)

    def evaluate(rank: int, i: int) -> None:
        with_eval.observe(case.eval_scores, training=False, rank=rank)
        with_eval.observe(case.eval_scores, grad=False, rank=rank)

    with_eval.ranked_step(case.step, evaluate)
    twin.ranked_step(case.step)
    _compare("observed in eval or under no_grad", with_eval.bias(), twin.bias(),
             "when eval forwards (training=False) and no_grad forwards run between the micro-batches",
             lines, "balancer", "twin")


def recomputation_counted_once(make: Callable[[int, int], Any], case: LifecycleCase) -> None:
    lines: list[str] = []
    recomputed, twin = _warm(make, case, "balancer", lines), _warm(make, case, "twin", lines)

    def recompute(rank: int, i: int) -> None:
        if i == 0:  # the backward of the first micro-batch runs its forward again
            recomputed.observe(case.step[rank][0], recomputing=True, rank=rank)

    recomputed.ranked_step(case.step, recompute)
    twin.ranked_step(case.step)
    _compare("counted twice under recomputation", recomputed.bias(), twin.bias(),
             "when the first micro-batch's forward is recomputed (activation checkpointing)",
             lines, "balancer", "twin")


def empty_step_moves_nothing(make: Callable[[int, int], Any], case: LifecycleCase) -> None:
    lines: list[str] = []
    empty, twin = _warm(make, case, "balancer", lines), _warm(make, case, "twin", lines)
    before = empty.bias()
    empty.update()
    _compare("NaN or a move on an empty step", empty.bias(), before,
             "after a step in which nothing was observed (it must stay as it was)", lines, "balancer", "twin")
    empty.step(case.next_step)
    twin.step(case.next_step)
    _compare("NaN or a move on an empty step", empty.bias(), twin.bias(),
             "in the step after an empty one, against the same step without the empty one", lines,
             "balancer", "twin")


def frozen_does_not_move(make: Callable[[int, int], Any], case: LifecycleCase) -> None:
    lines: list[str] = []
    frozen, twin = _warm(make, case, "balancer", lines), _warm(make, case, "twin", lines)
    before = frozen.bias()
    frozen.set_frozen(True)
    frozen.ranked_step(case.step)
    _compare("moved while frozen", frozen.bias(), before, "after a frozen step (it must stay as it was)",
             lines, "balancer", "twin")
    frozen.set_frozen(False)
    frozen.step(case.next_step)
    twin.step(case.next_step)
    _compare("moved while frozen", frozen.bias(), twin.bias(),
             "in the step after a frozen one (what was seen while frozen must not count later)", lines,
             "balancer", "twin")


def resume_keeps_accumulator(make: Callable[[int, int], Any], case: LifecycleCase) -> None:
    lines: list[str] = []
    resumed, twin = _warm(make, case, "balancer", lines), _warm(make, case, "twin", lines)
    done = [False]

    def checkpoint(rank: int, i: int) -> None:
        if i == 0 and rank == len(case.step) - 1 and not done[0]:  # after every rank's first micro-batch
            done[0] = True
            resumed.resume()

    resumed.ranked_step(case.step, checkpoint)
    twin.ranked_step(case.step)
    _compare("accumulator lost on resume", resumed.bias(), twin.bias(),
             "when the step is saved after its first micro-batch and resumed in a fresh balancer",
             lines, "balancer", "twin")


def replicas_not_data(make: Callable[[int, int], Any], case: LifecycleCase) -> None:
    lines: list[str] = []
    replicated, twin = _warm(make, case, "balancer", lines), _warm(make, case, "twin", lines)
    replica_rank = len(case.step)  # a rank of its own, holding rank 0's tokens

    def replica(rank: int, i: int) -> None:
        if rank == 0:
            replicated.observe(case.step[0][i], rank=replica_rank, replica=True)

    replicated.ranked_step(case.step, replica)
    twin.ranked_step(case.step)
    _compare("replicas counted as data", replicated.bias(), twin.bias(),
             "when a tensor-parallel replica of rank 0 observes rank 0's micro-batches too", lines,
             "balancer", "twin")


def matches_estimator(make: Callable[[int, int], Any], case: LifecycleCase, estimator: str, bins: int) -> None:
    from ..balancing import quantile_balancing_update  # imported here: the kit loads without it

    lines: list[str] = []
    run = _warm(make, case, "balancer", lines)
    before = run.bias().astype(np.float32)
    run.ranked_step(case.step)
    pooled = np.concatenate([b for blocks in case.step for b in blocks])  # [m, n]
    exact = np.asarray(quantile_balancing_update(pooled, before, case.top_k), dtype=np.float64)
    if estimator == "exact":
        bound, what = TOLERANCE, "against quantile_balancing_update of the pooled step (Eq. 14)"
    else:
        width = (float(before.max()) - float(before.min()) + 2.0) / bins
        bound = 2 * width + TOLERANCE
        what = f"against Eq. (14) of the pooled step, beyond two bin widths ({bins} bins)"
    lines.append("# the reference: refimpl.balancing.quantile_balancing_update(np.concatenate(step), bias, top_k)")
    _compare("does not match the declared estimator", run.bias(), exact, what, lines, "balancer", "balancer",
             bound)


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------

def check_balancer_lifecycle(make: Callable[[int, int], Any], *, estimator: str | None = None, bins: int = 1000,
                             settings: str | Settings | None = None) -> CheckResult:
    """Check a balancer in the trainer's loop: eval, recomputation, empty and frozen steps, resume, replicas.

    `make(num_experts, top_k)` returns the adapter that the module
    `refimpl.testing.lifecycle_check` describes (`observe`, `update`, `bias`,
    `state_dict`, `load_state_dict`, optionally `frozen`).
    `estimator` declares what the balancer computes, so that the step is held
    against refimpl's reference too: `"exact"` (Eq. 14 on the pooled step),
    `"histogram"` (Appendix D with `bins` bins over $[\\min b - 1, \\max b + 1]$,
    within two bin widths of Eq. 14), or `None` (the lifecycle invariants
    only). Raises `CheckFailure` naming every fault found, each with a script
    that reproduces it; returns a `CheckResult` otherwise. Derandomized, and
    writes nothing.
    """
    if not callable(make):
        raise TypeError(f"make must be a function make(num_experts, top_k) returning the adapter, got "
                        f"{type(make).__name__} {make!r:.60}")
    if estimator not in (None, "exact", "histogram"):
        raise ValueError(f"estimator must be None, 'exact' or 'histogram', got {estimator!r}")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    cases = lifecycle_cases()

    def invariant(name: str, why: str, body: Callable[..., None], *extra: Any) -> Invariant:
        return Invariant(name, why, cases, lambda case: body(make, case, *extra))

    invariants = []
    if estimator is not None:
        invariants.append(invariant("matches the declared estimator", "Eq. (14) / Appendix D on the pooled step",
                                    matches_estimator, estimator, bins))
    invariants += [
        invariant("micro-batches and ranks pooled, not averaged",
                  "Appendix D: the quantile of the global batch, not an average of per-block quantiles",
                  pooled_not_averaged),
        invariant("not observed in eval or under no_grad",
                  "only the training forwards of the step are its data", eval_not_observed),
        invariant("counted once under recomputation",
                  "a recomputed forward is the same tokens again, not new data", recomputation_counted_once),
        invariant("no NaN and no move on an empty step",
                  "a step that saw no token has no quantile to read: the bias stays", empty_step_moves_nothing),
        invariant("accumulator kept on resume",
                  "a checkpoint taken mid-step holds the step's counts", resume_keeps_accumulator),
        invariant("replicas not counted as data",
                  "a tensor-parallel replica sees the same tokens as its original", replicas_not_data),
    ]
    try:
        probe = call_user(make, 4, 1)
        frozen = hasattr(probe, "frozen")
    except Exception:  # make (or its adapter's frozen) fails: every invariant reports it, with the call that failed
        frozen = False
    if frozen:
        invariants.insert(len(invariants) - 2, invariant(
            "no move while frozen", "a frozen bias neither moves nor gathers data for later", frozen_does_not_move))
    return run_check("check_balancer_lifecycle", invariants, kit_settings(settings))


# ---------------------------------------------------------------------------
# Adapters: refimpl's own balancers and the two trainers'
# ---------------------------------------------------------------------------

class ReferenceAdapter:
    """refimpl's Eq. (14) (`estimator="exact"`) or Appendix D (`"histogram"`) behind the lifecycle protocol.

    It keeps the step's blocks (or its `BiasHistogram`) in its state, counts
    only training forwards that are not recomputations or replicas, leaves
    the bias as it is on an empty or frozen step, and pools every rank.
    """

    def __init__(self, num_experts: int, top_k: int, *, estimator: str = "exact", bins: int = 1000) -> None:
        if estimator not in ("exact", "histogram"):
            raise ValueError(f"estimator must be 'exact' or 'histogram', got {estimator!r}")
        self.num_experts = check_int("num_experts", num_experts, low=1)
        self.top_k = check_int("top_k", top_k, low=1, high=self.num_experts)
        self.estimator, self.bins = estimator, bins
        self.bias = np.zeros(num_experts, dtype=np.float32)
        self.frozen = False
        self.blocks: list[np.ndarray] = []  # the step's counted forwards

    def observe(self, scores: np.ndarray, *, training: bool = True, grad: bool = True, recomputing: bool = False,
                rank: int = 0, replica: bool = False) -> None:
        training, grad, recomputing, replica = observe_switches(training, grad, recomputing, replica)
        if training and grad and not recomputing and not replica and not self.frozen:
            self.blocks.append(np.array(scores, dtype=np.float32))

    def update(self) -> None:
        from ..balancing import histogram_balancing_update, quantile_balancing_update

        blocks, self.blocks = self.blocks, []
        if self.frozen or not blocks or sum(b.shape[0] for b in blocks) == 0:
            return
        if self.estimator == "exact":
            self.bias = np.asarray(quantile_balancing_update(np.concatenate(blocks), self.bias, self.top_k))
        else:
            self.bias = np.asarray(histogram_balancing_update(blocks, self.bias, self.top_k, self.bins))

    def state_dict(self) -> dict[str, Any]:
        return {"bias": self.bias.copy(), "blocks": [b.copy() for b in self.blocks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take `state_dict()`'s output back, checked: exactly `bias` (`[n]`, finite) and `blocks` (a list of
        `[m, n]` score arrays), each refused by name otherwise; nothing changes unless all of it checks."""
        if not isinstance(state, dict) or set(state) != {"bias", "blocks"}:
            shown = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must be a dict with exactly the keys ['bias', 'blocks'], got {shown}")
        bias = np.array(state["bias"], dtype=np.float32)
        if bias.shape != (self.num_experts,) or not np.all(np.isfinite(bias)):
            raise ValueError(f"state['bias'] must be {self.num_experts} finite values (one per expert), got shape "
                             f"{list(bias.shape)}" + ("" if bias.shape != (self.num_experts,) else " with NaN or inf"))
        if not isinstance(state["blocks"], list | tuple):
            raise ValueError(f"state['blocks'] must be a list of [m, {self.num_experts}] score arrays, got "
                             f"{type(state['blocks']).__name__}")
        blocks = [np.array(b, dtype=np.float32) for b in state["blocks"]]
        for i, block in enumerate(blocks):
            if block.ndim != 2 or block.shape[1] != self.num_experts:
                raise ValueError(f"state['blocks'][{i}] must be [m, {self.num_experts}] scores, got shape "
                                 f"{list(block.shape)}")
        self.bias, self.blocks = bias, blocks


def observe_switches(training: Any, grad: Any, recomputing: Any, replica: Any) -> tuple[bool, bool, bool, bool]:
    """The switches of an adapter's `observe`, each a real boolean (the string "false" is not read as true)."""
    return (switch_value(training, "training"), switch_value(grad, "grad"),
            switch_value(recomputing, "recomputing"), switch_value(replica, "replica"))


class _RanksOf:
    """One shipped balancer per rank, made lazily with the bias every rank holds."""

    def __init__(self, build: Callable[[np.ndarray], Any]) -> None:
        self.build = build
        self.ranks: dict[int, Any] = {}

    def at(self, rank: int, bias: np.ndarray) -> Any:
        if rank not in self.ranks:
            self.ranks[rank] = self.build(bias)
        return self.ranks[rank]


class MegatronGlobalBatchAdapter:
    """`refimpl.balancing.MegatronGlobalBatchQB` behind the lifecycle protocol, one router per rank.

    `training` and `grad` are the router's `training` and
    `torch.is_grad_enabled()`; a recomputed forward is a forward in training
    mode with grad enabled (as `torch.utils.checkpoint` runs it); a replica is
    a rank of the reduction group; `frozen` is `frozen_expert_bias`;
    `update()` is `finalize_model_grads`'s `_update_router_qb_histogram` over
    the ranks and the reset; the state is the router's `state_dict()`.
    """

    def __init__(self, num_experts: int, top_k: int, *, num_bins: int = 1000) -> None:
        from ..balancing import MegatronGlobalBatchQB

        self.num_experts, self.top_k, self.num_bins = num_experts, top_k, num_bins
        self.main = MegatronGlobalBatchQB(num_experts, top_k, num_bins=num_bins)
        self.others = _RanksOf(self._rank)
        self.frozen = False

    def _rank(self, bias: np.ndarray) -> Any:
        from ..balancing import MegatronGlobalBatchQB

        router = MegatronGlobalBatchQB(self.num_experts, self.top_k, num_bins=self.num_bins)
        router.load_state_dict(self.main.state_dict())
        return router

    @property
    def bias(self) -> np.ndarray:
        return self.main.qb_bias.copy()

    def observe(self, scores: np.ndarray, *, training: bool = True, grad: bool = True, recomputing: bool = False,
                rank: int = 0, replica: bool = False) -> None:
        training, grad, recomputing, replica = observe_switches(training, grad, recomputing, replica)
        router = self.main if rank == 0 else self.others.at(rank, self.main.qb_bias)
        router.training, router.frozen_expert_bias = training, self.frozen
        router.route(scores, grad_enabled=grad)
        router.training = True

    def update(self) -> None:
        self.main.frozen_expert_bias = self.frozen
        self.main.finalize(*self.others.ranks.values())
        self.others.ranks = {}

    def state_dict(self) -> dict[str, Any]:
        return self.main.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state)


class TorchtitanAdapter:
    """`refimpl.balancing.TorchtitanQuantileBalancer` behind the lifecycle protocol, one balancer per rank.

    `training` is the module's `training`; `grad` is not consulted (the
    source does not); a recomputed forward is a forward in training mode; a
    replica is a rank of the group the hook reduces over; `update()` is the
    optimizer's pre-hook; there is no frozen switch; the state is the bias.
    """

    def __init__(self, num_experts: int, top_k: int, *, num_bins: int = 1000) -> None:
        from ..balancing import TorchtitanQuantileBalancer

        self.num_experts, self.top_k, self.num_bins = num_experts, top_k, num_bins
        self.main = TorchtitanQuantileBalancer(num_experts, top_k, num_bins=num_bins)
        self.others = _RanksOf(self._rank)

    def _rank(self, bias: np.ndarray) -> Any:
        from ..balancing import TorchtitanQuantileBalancer

        return TorchtitanQuantileBalancer(self.num_experts, self.top_k, num_bins=self.num_bins, bias=bias)

    @property
    def bias(self) -> np.ndarray:
        return self.main.expert_bias.copy()

    def observe(self, scores: np.ndarray, *, training: bool = True, grad: bool = True, recomputing: bool = False,
                rank: int = 0, replica: bool = False) -> None:
        training, grad, recomputing, replica = observe_switches(training, grad, recomputing, replica)
        balancer = self.main if rank == 0 else self.others.at(rank, self.main.expert_bias)
        balancer.training = training
        balancer.route(scores)
        balancer.training = True

    def update(self) -> None:
        self.main.step(*self.others.ranks.values())
        self.others.ranks = {}

    def state_dict(self) -> dict[str, Any]:
        return self.main.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state)
