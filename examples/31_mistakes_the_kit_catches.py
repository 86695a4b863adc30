"""Mistakes the kit catches

Each function below is a small, deliberate copy of a mistake found in real
MoE routers and balancers, made by changing one line of the correct
implementations of [the previous example](30_test_your_router.md). The
script runs each one through its check of `refimpl.testing` and prints the
report exactly as a test suite would show it: which invariant broke, why it
must hold, what came back instead, and the simplest input Hypothesis found.

The output below is produced by running this script; nothing is written by
hand.
"""

# %%
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from refimpl.testing import (
    CheckFailure,
    check_balancer,
    check_balancing_update,
    check_forward,
    check_histogram_update,
    check_router,
)

# The correct implementations that example 30 checks; every mistake below changes one line of them.
from refimpl.testing import samples as good

# ---------------------------------------------------------------------------
# Router mistakes (Eq. 13)
# ---------------------------------------------------------------------------


# %%
def weights_from_biased_scores(scores, bias, top_k):
    """The mixture weights are taken from s + b instead of s."""
    biased = scores + bias
    index = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(biased, index, axis=1)  # should gather from `scores`
    return index, chosen / chosen.sum(axis=1, keepdims=True)


# %%
def bias_stored_in_bfloat16(scores, bias, top_k):
    """The bias is kept in bfloat16 (as a model's other parameters are), then used in float32."""
    stored = bias.astype(ml_dtypes.bfloat16)
    return good.router(scores, stored.astype(np.float32), top_k)


# %%
def sum_in_bfloat16(scores, bias, top_k):
    """Scores and bias are added in bfloat16, the activation dtype, before the top-k."""
    biased = (scores.astype(ml_dtypes.bfloat16) + bias.astype(ml_dtypes.bfloat16)).astype(np.float32)
    index = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
    raw = np.take_along_axis(scores, index, axis=1)
    return index, raw / raw.sum(axis=1, keepdims=True)


# %%
def bias_subtracted(scores, bias, top_k):
    """The bias is subtracted (a "beta" convention mixed up with b = -beta)."""
    return good.router(scores, -bias, top_k)


# %%
def tie_order_left_to_the_library(scores, bias, top_k):
    """A top-k whose order among equal scores is whatever the library does (here: higher id first)."""
    n = scores.shape[1]
    biased = (scores + bias)[:, ::-1]  # scanning the experts from the last one
    index = (n - 1) - np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
    raw = np.take_along_axis(scores, index, axis=1)
    return index, raw / raw.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------
# Balancing mistakes (Eq. 14, Appendix D)
# ---------------------------------------------------------------------------


# %%
def quantile_one_rank_off(scores, bias, top_k):
    """The q-th largest margin instead of the (q+1)-th: "q tokens should pass" read as "the q-th passes"."""
    s = scores.astype(np.float64)
    m, n = s.shape
    alpha = -np.sort(-(s + bias), axis=1)[:, top_k]
    b_tilde = -good.kth_largest_interpolated(s - alpha[:, None], m * top_k / n)
    return b_tilde - b_tilde.mean()


# %%
def average_of_rank_quantiles(blocks, bias, top_k):
    """Each block reads the bias from its own histogram and the biases are averaged, instead of the counts summed."""
    per_block = [good.histogram_update([block], bias, top_k) for block in blocks if block.shape[0] > 0]
    return np.mean(per_block, axis=0).astype(np.float32)


# %%
def histogram_read_at_rank_q(blocks, bias, top_k):
    """The histogram threshold read where the cumulative count reaches q instead of q + 1."""
    return good.histogram_update(blocks, bias, top_k, rank_offset=0)


# %%
def make_look_ahead_balancer(initial_bias, top_k):
    """Computes the bias from the batch, then routes that same batch with it."""
    state = {"bias": initial_bias.astype(np.float32)}

    def step(scores):
        state["bias"] = good.qb_update(scores, state["bias"], top_k)  # updated first ...
        index, _ = good.router(scores, state["bias"], top_k)  # ... then used on the same batch
        return index

    return step


# ---------------------------------------------------------------------------
# Forward-pass mistake (Eq. 11)
# ---------------------------------------------------------------------------


# %%
def norm_before_reduce(x, params, config):
    """Experts split over two ranks; each rank normalizes its partial latent sum before the all-reduce."""
    return good.forward(x, params, config, ranks=2, norm_before_reduce=True)


# ---------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------


# %%
@dataclass(frozen=True)
class Mistake:
    """One deliberate mistake, the check that runs it and the invariant expected to catch it."""

    slug: str
    title: str
    fn: Callable[..., Any]
    check: Callable[..., Any]
    caught_by: str
    options: dict[str, Any] = field(default_factory=dict)

    def run(self) -> CheckFailure | None:
        """The failure the check raises, or None if (unexpectedly) every invariant held."""
        try:
            self.check(self.fn, **self.options)
        except CheckFailure as failure:
            return failure
        return None


# %%
MISTAKES = [
    Mistake("weights-from-biased-scores", "Mixture weights from the biased scores", weights_from_biased_scores,
            check_router, "weights from raw scores"),
    Mistake("bias-in-bfloat16", "The bias stored in bfloat16", bias_stored_in_bfloat16,
            check_router, "bias-shift invariance"),
    Mistake("sum-in-bfloat16", "Score plus bias added in bfloat16", sum_in_bfloat16,
            check_router, "selection is the top-k of s + b"),
    Mistake("bias-subtracted", "The bias subtracted instead of added", bias_subtracted,
            check_router, "selection is the top-k of s + b"),
    Mistake("tie-order", "Tie order left to the library", tie_order_left_to_the_library,
            check_router, "tie order: lower id first", {"tie_order": "lower_id"}),
    Mistake("quantile-one-rank-off", "The q-th margin instead of the (q+1)-th", quantile_one_rank_off,
            check_balancing_update, "matches Eq. (14)"),
    Mistake("average-of-rank-quantiles", "Per-block quantiles averaged", average_of_rank_quantiles,
            check_histogram_update, "partition invariance"),
    Mistake("histogram-rank-q", "Histogram read at rank q", histogram_read_at_rank_q,
            check_histogram_update, "within one bin of Eq. (14)"),
    Mistake("look-ahead", "A batch routed with the bias computed from itself", make_look_ahead_balancer,
            check_balancer, "no look-ahead"),
    Mistake("norm-before-reduce", "RMSNorm on partial sums before the all-reduce", norm_before_reduce,
            check_forward, "matches stable_latent_moe"),
]


# %%
def report(slug: str) -> str:
    """The report of one mistake, as the kit prints it."""
    mistake = next(m for m in MISTAKES if m.slug == slug)
    failure = mistake.run()
    return str(failure) if failure is not None else f"{mistake.check.__name__}: every invariant held"


# %%
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="output directory (this example draws no figures)")
    parser.parse_args(argv)

    # Step: Run each mistake through its check
    failures = {m.slug: m.run() for m in MISTAKES}
    print(f"{'mistake':52s} {'check':24s} caught by")
    for m in MISTAKES:
        failure = failures[m.slug]
        caught = "; ".join(failure.failed) if failure is not None else "NOT CAUGHT"
        print(f"{m.title:52s} {m.check.__name__:24s} {caught}")

    # What to see: every mistake is caught (no line reads NOT CAUGHT), and several break two invariants at
    # once. Weights taken from s + b also break bias-shift invariance, since a common shift of the bias then
    # changes the weights; the look-ahead balancer breaks both invariants of check_balancer.

    # Step: The reports, one by one
    # Each report names the invariant, why it must hold, what came back and the simplest input found.
    for m in MISTAKES:
        print("\n" + "=" * 100)
        print(f"{m.title}: {m.fn.__doc__.strip()}")
        print("=" * 100)
        failure = failures[m.slug]
        print(failure if failure is not None else "every invariant held")

    # What to see: stored in bfloat16, the shifted biases 100.01 to 100.09 and 99.87 all round to 100, so
    # expert 6 loses its -0.13 handicap and the top-3 becomes [6, 7, 8] instead of [5, 7, 8]. Both rank-q
    # mistakes fail on two tokens that already give each expert one token: Eq. (14) leaves the bias at 0, and
    # the q-th margin moves it by 0.0625 (0.06275 from the histogram). Both are named ceil_q_rank: with a whole
    # q, the q-th is the rank Megatron-Core's global_batch mode and torchtitan's QuantileBalancer read, so the
    # same report tells a port of either why it differs. Per-block biases averaged pass "within
    # one bin", which runs on one block, and only "partition invariance", which splits the batch, catches
    # them. RMSNorm is not linear, so normalizing each rank's partial sum before adding gives 0.13604, not
    # 0.359.


# %%
if __name__ == "__main__":
    main()
