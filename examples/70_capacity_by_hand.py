r"""Capacity and token dropping by hand: three tokens, one slot per expert

A common sketch of capacity with token dropping pins its rule down with a
three-token case and two asserts. Tokens with logits $[3, 0]$, $[2, 0]$ and $[0, 3]$ (the router is the
identity) each choose both of the two experts, top-2, softmax weights; every
expert may serve **one** assignment. The sketch asserts

```python
kept == [[True, False], [False, False], [True, False]]
load == [1, 1]
```

This script replays the rule one assignment at a time, in the order the
sketch serves them (every token's first choice before any token's second
choice, tokens in input order within a rank), prints what each step decides,
and checks the result against `refimpl.capacity_keep` and against the
sketch's asserts. It then shows what dropping does to the weights (nothing is
renormalized: token 1 loses its whole routed output, token 0 keeps only
$p = 0.953$ of it) and what the capacity becomes with the usual formula
$C = \lceil c\,mk/n \rceil$ at a few capacity factors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from refimpl import capacity_keep, expert_capacity, route, router_scores

# %%
X = np.array([[3.0, 0.0], [2.0, 0.0], [0.0, 3.0]])  # [m, d], the sketch's tokens
ROUTER = np.eye(2)  # [n, d], so the logits are the tokens themselves
TOP_K, CAPACITY = 2, 1


def serve_by_hand(index: np.ndarray, capacity: int) -> tuple[np.ndarray, list[str]]:
    """The sketch's loops, one assignment at a time, with a line of explanation per decision."""
    m, k = index.shape
    load = [0] * int(index.max() + 1)
    kept = np.zeros((m, k), dtype=bool)
    lines = []
    for r in range(k):  # rank by rank ...
        for i in range(m):  # ... and token by token within a rank
            e = int(index[i, r])
            kept[i, r] = load[e] < capacity
            verdict = "kept" if kept[i, r] else "DROPPED (expert full)"
            lines.append(f"rank {r + 1}, token {i} -> expert {e}: load {load[e]} of {capacity}, {verdict}")
            load[e] += int(kept[i, r])
    return kept, lines


# %%
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="unused: this example makes no figure")
    parser.parse_args(argv)

    # Step: Route the three tokens
    # Softmax scores, top-2, weights = softmax over the chosen logits (as the sketch's `score.softmax`).
    scores = router_scores(X, ROUTER, "softmax")  # [3, 2]
    index, weights = route(scores, np.zeros(2), TOP_K)  # [3, 2] each
    print("Routes (best first) and softmax weights:")
    for i in range(len(X)):
        print(f"  token {i}: logits {X[i].tolist()}, experts {index[i].tolist()}, "
              f"weights {np.round(weights[i], 3).tolist()}")
    print()

    # What to see: with two experts and top-2, every token is routed to both, and the route only orders them:
    # tokens 0 and 1 put expert 0 first, token 2 puts expert 1 first. A weight is the softmax of the two
    # logits, so a gap of 3 gives 0.953 and 0.047, and token 1's gap of 2 gives 0.881 and 0.119.

    # Step: Serve, by hand and with refimpl
    print(f"Serving with capacity C = {CAPACITY}:")
    kept_by_hand, lines = serve_by_hand(index, CAPACITY)
    for line in lines:
        print("  " + line)
    kept = capacity_keep(index, 2, CAPACITY)
    load = np.bincount(index[kept], minlength=2)
    print()
    print(f"kept = {kept.tolist()}")
    print(f"load = {load.tolist()}")
    assert np.array_equal(kept, kept_by_hand)
    assert kept.tolist() == [[True, False], [False, False], [True, False]]  # the sketch's assert
    assert load.tolist() == [1, 1]  # the sketch's assert
    print("Both of the sketch's asserts hold, and capacity_keep agrees with the loops.")
    print()

    # What to see: all first choices are served before any second choice, so the three rank-1 assignments take
    # the two slots in input order: token 0 fills expert 0, token 1 comes later and finds it full, and token 2
    # fills expert 1. With C = 1 both experts are then full and every second choice is dropped. The rule looks
    # at position, not weight: token 1 loses its 0.881 only because token 0 came first.

    # Step: What the combine sees
    # Dropped weights become zero, the rest are not renormalized.
    served = weights * kept
    print("Weights that reach the combine (dropped = 0, no renormalization):")
    for i in range(len(X)):
        print(f"  token {i}: {np.round(served[i], 3).tolist()}  (sum {served[i].sum():.3f})")
    print()

    # What to see: the combine multiplies each weight by its kept flag and rescales nothing, so tokens 0 and 2
    # keep 0.953 of their routed output (the sum is 0.953, not 1) and token 1 gets no routed output at all
    # (sum 0.000). A dropped token is not rerouted to another expert; it just loses that expert's share.

    # Step: The capacity formula
    # At a few capacity factors, for this batch and for a K3-sized one.
    print("C = ceil(c * m * k / n) (the sketch's C = 1 is a capacity factor of 1/3 on its batch):")
    for c in (0.5, 1.0, 1.25, 2.0):
        small = expert_capacity(3, 2, TOP_K, c)
        k3 = expert_capacity(4096, 896, 16, c)
        print(f"  c = {c:<4}: this batch (m=3, n=2, k=2) C = {small}; m=4096 tokens at K3's n=896, k=16: C = {k3}")

    # What to see: on this batch mk/n = 3, so c = 1.0 gives C = 3, room for a perfectly even split, and even
    # c = 0.5 gives C = 2: the sketch's C = 1 is a factor of 1/3, below any of these. At K3's sizes mk/n is
    # not a whole number and the ceiling rounds it up (C = 74 at c = 1.0); a factor above 1, such as 1.25
    # (C = 92), lets the busiest experts take more than their even share before anything is dropped.

    return {"kept": kept.tolist(), "load": load.tolist()}


# %%
if __name__ == "__main__":
    main()
