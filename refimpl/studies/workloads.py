"""A skewed router and fresh batches for it: the workload of the "Balance is speed" examples.

Examples 80 and 81 measure what an imbalanced batch costs in time. They need
a router whose experts are not equally popular, batches that change every
step, and the biases that balancing rules would hold after some steps on
such batches. All three are here, so that the examples (and their notebooks,
run anywhere) draw exactly the same workload:

* `skewed_router(n, width, seed)`: router weights `[n, width]` under which
  expert $e$ leans towards a common mean token by $1 - e/n$, so the first
  experts are popular, and that mean token;
* `skewed_batch(weight, mean, tokens, seed, step)`: the router inputs of one
  step, a fresh draw around the mean token;
* `trained_biases(...)`: the bias the sign rule and Quantile Balancing hold
  after the same `steps` earlier batches, next to the zero bias.
"""

from __future__ import annotations

import numpy as np

# The public names, as every user imports them (the package's own modules may move them around).
from .. import QuantileBalancer, SignBalancer, router_scores
from .._lib.values import seed_value

__all__ = ["skewed_batch", "skewed_router", "trained_biases"]


def skewed_router(n: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Router weights `[n, width]` and a mean token that the first experts agree with: a few experts are popular."""
    rng = np.random.default_rng(seed_value(seed, "seed"))
    weight = rng.standard_normal((n, width)) / np.sqrt(width)
    mean = rng.standard_normal(width)
    # Popularity falls with the expert id: expert e leans towards the mean token by (1 - e/n).
    weight += np.outer(1.0 - np.arange(n) / n, mean) / width
    return weight.astype(np.float32), (0.6 * mean).astype(np.float32)


def skewed_batch(weight: np.ndarray, mean: np.ndarray, tokens: int, seed: int, step: int) -> np.ndarray:
    """Router inputs of one batch `[tokens, width]`, a fresh draw for each step."""
    x = np.random.default_rng([seed_value(seed, "seed"), seed_value(step, "step")]).standard_normal((tokens, weight.shape[1]))
    return (x + mean).astype(np.float32)


def trained_biases(weight: np.ndarray, mean: np.ndarray, k: int, steps: int, tokens: int, rate: float,
                   seed: int) -> dict[str, np.ndarray]:
    """The bias each rule holds after `steps` earlier batches (the same batches for both rules)."""
    n = weight.shape[0]
    sign, quantile = SignBalancer(n, k, rate=rate), QuantileBalancer(n, k)
    for step in range(steps):
        scores = router_scores(skewed_batch(weight, mean, tokens, seed, step), weight)
        sign.step(scores)
        quantile.step(scores)
    return {"zero bias": np.zeros(n, np.float32), f"sign rule ({steps} steps)": sign.bias,
            f"Quantile Balancing ({steps} steps)": quantile.bias}
