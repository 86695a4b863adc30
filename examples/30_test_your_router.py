"""Test your own router

This script plays the part of a user with their own implementation of the
K3 layer: a router, the exact Quantile Balancing update, the histogram
estimator, a stateful balancer and a forward pass whose experts are split
over two "ranks". None of it calls the reference; it is written the way a
production port would be, in float32 NumPy, and ships with the kit as
`refimpl.testing.samples` (its code is on [the kit's page](../paper/testing.md)).
If PyTorch is installed, a PyTorch router is checked too, behind an adapter
that turns the NumPy inputs into tensors and the tensors it returns back into
NumPy arrays.

Each implementation goes through its check of `refimpl.testing`, and every
check passes. The companion example,
[mistakes the kit catches](31_mistakes_the_kit_catches.md), breaks these
implementations in the ways real ones break and shows the reports.
"""

# %%
from __future__ import annotations

import argparse
import time

import numpy as np

from refimpl.testing import (
    check_balancer,
    check_balancing_update,
    check_forward,
    check_histogram_update,
    check_router,
)

# The implementations under test, written the way a port is written, without calling the reference (read
# them on the kit's page). Example 31 breaks them in the ways real ports break.
from refimpl.testing.samples import forward, histogram_update, make_balancer, qb_update, router

# ---------------------------------------------------------------------------
# Eq. (13) in PyTorch, behind an adapter
# ---------------------------------------------------------------------------


# %%
def torch_router(scores: np.ndarray, bias: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The same router in PyTorch, behind a NumPy adapter (the first and last two lines)."""
    import torch

    s = torch.from_numpy(scores).float()
    b = torch.from_numpy(bias).float()
    biased = s + b  # [m, n]
    # torch.topk leaves the order of ties unspecified; a stable sort pins it to the lower id.
    index = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [m, k]
    raw = torch.gather(s, 1, index)  # [m, k]
    weights = raw / raw.sum(dim=-1, keepdim=True)
    return index.numpy(), weights.numpy()


# ---------------------------------------------------------------------------
# Running the checks
# ---------------------------------------------------------------------------


# %%
def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# %%
def checks() -> list[tuple[str, object]]:
    """(label, zero-argument call) for every check this example runs."""
    runs = [
        ("NumPy router", lambda: check_router(router, tie_order="lower_id")),
        ("exact update", lambda: check_balancing_update(qb_update)),
        ("histogram update", lambda: check_histogram_update(histogram_update)),
        ("balancer", lambda: check_balancer(make_balancer)),
        ("forward, two ranks", lambda: check_forward(forward, rtol=1e-4, atol=1e-5)),
    ]
    if torch_available():
        runs.insert(1, ("PyTorch router", lambda: check_router(torch_router, tie_order="lower_id")))
    return runs


# %%
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="output directory (this example draws no figures)")
    parser.parse_args(argv)

    # Step: Run every check
    # Each check draws its inputs with Hypothesis and prints which invariants held.
    if not torch_available():
        print("PyTorch is not installed: the PyTorch router is skipped.\n")
    for label, run in checks():
        start = time.perf_counter()
        result = run()
        print(f"--- {label} ({time.perf_counter() - start:.1f} s)")
        print(result)
        print()

    # What to see: every invariant holds for every implementation, each tried on up to 50 inputs. The PyTorch
    # router passes "tie order: lower id first" too, because it sorts stably instead of calling torch.topk,
    # whose order among equal scores is unspecified. The histogram update is held to "within one bin of Eq.
    # (14)", not to an exact match, since it reads each threshold from binned counts.


# %%
if __name__ == "__main__":
    main()
