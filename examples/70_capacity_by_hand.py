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

    # Route: softmax scores, top-2, weights = softmax over the chosen logits (as the sketch's `score.softmax`).
    scores = router_scores(X, ROUTER, "softmax")  # [3, 2]
    index, weights = route(scores, np.zeros(2), TOP_K)  # [3, 2] each
    print("Routes (best first) and softmax weights:")
    for i in range(len(X)):
        print(f"  token {i}: logits {X[i].tolist()}, experts {index[i].tolist()}, "
              f"weights {np.round(weights[i], 3).tolist()}")
    print()

    # Serve, by hand and with refimpl.
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

    # What the combine sees: dropped weights become zero, the rest are not renormalized.
    served = weights * kept
    print("Weights that reach the combine (dropped = 0, no renormalization):")
    for i in range(len(X)):
        print(f"  token {i}: {np.round(served[i], 3).tolist()}  (sum {served[i].sum():.3f})")
    print()

    # The capacity formula at a few capacity factors, for this batch and for a K3-sized one.
    print("C = ceil(c * m * k / n) (the sketch's C = 1 is a capacity factor of 1/3 on its batch):")
    for c in (0.5, 1.0, 1.25, 2.0):
        small = expert_capacity(3, 2, TOP_K, c)
        k3 = expert_capacity(4096, 896, 16, c)
        print(f"  c = {c:<4}: this batch (m=3, n=2, k=2) C = {small}; m=4096 tokens at K3's n=896, k=16: C = {k3}")
    return {"kept": kept.tolist(), "load": load.tolist()}


# %%
if __name__ == "__main__":
    main()
