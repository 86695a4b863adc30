r"""Capacity mistakes the kit catches

A capacity-limited layer is short to write and easy to get subtly wrong. This
script writes the usual sketch's overflow rule correctly, then three
versions with one real mistake each, and runs all four through
`refimpl.testing.check_capacity`:

* **token-order priority**: each token's $k$ choices are served together,
  token after token, instead of rank by rank. Early tokens keep even their
  $k$-th choice while late tokens lose their first;
* **renormalized after a drop**: the surviving weights of a token are
  divided by their sum, so a token that lost an expert gets a full-size
  routed output instead of a smaller one;
* **off by one**: an expert takes one assignment more than its capacity.

The user's function has the signature
`fn(index, weights, num_experts, capacity) -> (kept, new_weights)`. The
report printed for each mistake is the one a test suite shows: the broken
invariants, why each must hold, and the simplest input Hypothesis found.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from refimpl.testing import CheckFailure, check_capacity


# %%
def correct(index, weights, num_experts, capacity):
    """The sketch's rule, with its loops: rank by rank, then expert by expert, tokens in order."""
    m, k = index.shape
    kept = np.zeros((m, k), dtype=bool)
    load = np.zeros(num_experts, dtype=int)
    for r in range(k):
        for e in range(num_experts):
            tokens = np.flatnonzero(index[:, r] == e)[:max(capacity - load[e], 0)]
            kept[tokens, r] = True
            load[e] += tokens.size
    return kept, weights * kept


def token_order_priority(index, weights, num_experts, capacity):
    """Mistake: each token's k choices are served together, token after token."""
    m, k = index.shape
    kept = np.zeros((m, k), dtype=bool)
    load = np.zeros(num_experts, dtype=int)
    for i in range(m):
        for r, e in enumerate(index[i]):
            kept[i, r] = load[e] < capacity
            load[e] += kept[i, r]
    return kept, weights * kept


def renormalized_after_drop(index, weights, num_experts, capacity):
    """Mistake: the surviving weights are divided by their sum."""
    kept, w = correct(index, weights, num_experts, capacity)
    total = w.sum(axis=1, keepdims=True)
    return kept, np.divide(w, total, out=np.zeros_like(w), where=total > 0)


def off_by_one(index, weights, num_experts, capacity):
    """Mistake: `<=` for `<`, one assignment more than the capacity."""
    return correct(index, weights, num_experts, capacity + 1)


MISTAKES = {"token-order priority": token_order_priority, "renormalized after a drop": renormalized_after_drop,
            "off by one": off_by_one}


# %%
def main(argv: list[str] | None = None) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="unused: this example makes no figure")
    parser.parse_args(argv)

    # Step: The correct rule
    # The sketch's rule, written with its loops, through every invariant.
    print(check_capacity(correct))

    # What to see: all 8 invariants hold, each tried on up to 50 inputs that Hypothesis generates. Together
    # they pin the rule down: no expert serves more than its capacity, nothing is dropped while its expert has
    # room, first choices are served before second ones and earlier tokens before later ones, dropped weights
    # are zero and kept ones unchanged, and the last check compares the kept flags with `capacity_keep`
    # itself.

    # Step: The three mistakes
    # Each version breaks the rule in one place, and `check_capacity` reports what broke and on which input.
    failed = {}
    for name, fn in MISTAKES.items():
        print()
        print("=" * 100)
        print(f"Mistake: {name}")
        print("=" * 100)
        try:
            check_capacity(fn)
        except CheckFailure as failure:
            print(failure)
            failed[name] = failure.failed
        else:
            print("not caught")
            failed[name] = []

    # What to see: token-order priority fails on the smallest input that can show it: two tokens choosing the
    # same two experts in opposite order, with capacity 1, where token 0 takes both slots with its first and
    # second choice and token 1 loses even its first ([True, True] and [False, False] instead of [True, False]
    # for both). Renormalizing breaks only the weights invariant, since every other check reads the kept
    # flags, which are right: the surviving 0.5 becomes 1.0, so a token that lost an expert still gets a
    # full-size routed output. The off-by-one shows at capacity 0, where one expert serves the one assignment
    # it has no room for.

    return failed


# %%
if __name__ == "__main__":
    main()
