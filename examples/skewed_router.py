"""Helpers shared by the "balance is speed" examples (80, 81): a skewed router and fresh batches for it.

Not an example itself (no number): the numbered scripts import it.
"""

from __future__ import annotations

import numpy as np

from refimpl import QuantileBalancer, SignBalancer, router_scores


def skewed_router(n: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Router weights `[n, width]` and a mean token that the first experts agree with: a few experts are popular."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((n, width)) / np.sqrt(width)
    mean = rng.standard_normal(width)
    # Popularity falls with the expert id: expert e leans towards the mean token by (1 - e/n).
    weight += np.outer(1.0 - np.arange(n) / n, mean) / width
    return weight.astype(np.float32), (0.6 * mean).astype(np.float32)


def batch(weight: np.ndarray, mean: np.ndarray, tokens: int, seed: int, step: int) -> np.ndarray:
    """Router inputs of one batch `[tokens, width]`, a fresh draw for each step."""
    x = np.random.default_rng([seed, step]).standard_normal((tokens, weight.shape[1]))
    return (x + mean).astype(np.float32)


def trained_biases(weight: np.ndarray, mean: np.ndarray, k: int, steps: int, tokens: int, rate: float,
                   seed: int) -> dict[str, np.ndarray]:
    """The bias each rule holds after `steps` earlier batches (the same batches for both rules)."""
    n = weight.shape[0]
    sign, quantile = SignBalancer(n, k, rate=rate), QuantileBalancer(n, k)
    for step in range(steps):
        scores = router_scores(batch(weight, mean, tokens, seed, step), weight)
        sign.step(scores)
        quantile.step(scores)
    return {"zero bias": np.zeros(n, np.float32), f"sign rule ({steps} steps)": sign.bias,
            f"Quantile Balancing ({steps} steps)": quantile.bias}
