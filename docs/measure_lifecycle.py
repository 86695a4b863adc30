"""The balancing page's lifecycle table, measured: refimpl's balancers and the two shipped ones through the check.

Each balancer goes through `refimpl.testing.check_balancer_lifecycle` behind
its adapter (`refimpl.testing.lifecycle_check`), and through one step in
which nothing is observed, after a warm-up step. A cell says whether the
invariant held or names the fault the check reported; the last column says
what the empty step did to the bias. The check takes about half a minute on
two cores, too long for every site build, so the page renders the record:

    .venv/bin/python docs/measure_lifecycle.py          # prints the table
    .venv/bin/python docs/measure_lifecycle.py write    # refreshes docs/pages/lifecycle_measured.json

`tests/test_lifecycle.py` measures again and fails when the record no longer
says what the balancers do.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

RECORD = Path(__file__).resolve().parent / "pages" / "lifecycle_measured.json"
#: The warm-up step of the empty-step probe: 6 experts, top-2, two micro-batches of 24 tokens.
EXPERTS, TOP_K, TOKENS, SEED = 6, 2, 24, 44


def balancers() -> dict[str, tuple[Any, str | None]]:
    """The balancers measured, each as its adapter's `make` and the estimator it declares."""
    from refimpl.testing.lifecycle_check import (
        MegatronGlobalBatchAdapter,
        ReferenceAdapter,
        TorchtitanAdapter,
    )

    return {
        "refimpl, Eq. (14) pooled (exact)": (partial(ReferenceAdapter, estimator="exact"), "exact"),
        "refimpl, Appendix D histogram": (partial(ReferenceAdapter, estimator="histogram"), "histogram"),
        "Megatron-Core, global_batch": (MegatronGlobalBatchAdapter, "histogram"),
        "torchtitan, QuantileBalancer": (TorchtitanAdapter, "histogram"),
    }


def empty_step(make: Any) -> str:
    """What one `update()` with nothing observed does to the bias a warm-up step left."""
    rng = np.random.default_rng(SEED)
    balancer = make(EXPERTS, TOP_K)
    for _ in range(2):
        balancer.observe((1.0 / (1.0 + np.exp(-rng.normal(size=(TOKENS, EXPERTS))))).astype(np.float32))
    balancer.update()
    before = np.array(balancer.bias, dtype=np.float64)
    balancer.update()
    after = np.array(balancer.bias, dtype=np.float64)
    if np.isnan(after).any():
        return f"NaN in {int(np.isnan(after).sum())} of {EXPERTS} entries"
    return "keeps the bias" if np.array_equal(after, before) else f"moves it by {np.abs(after - before).max():.3g}"


def measure() -> dict[str, Any]:
    """Every balancer's verdict on every invariant, and its empty step."""
    from refimpl.testing import CheckFailure, check_balancer_lifecycle

    results: dict[str, Any] = {}
    invariants: list[str] = []
    for name, (make, estimator) in balancers().items():
        try:
            result = check_balancer_lifecycle(make, estimator=estimator)
            verdicts = {invariant: "holds" for invariant in result.passed}
        except CheckFailure as failure:
            verdicts = {invariant: "holds" for invariant in failure.passed}
            verdicts.update({invariant: "fails" for invariant in failure.failed})
        for invariant in verdicts:
            if invariant not in invariants:
                invariants.append(invariant)
        results[name] = {"invariants": verdicts, "empty step": empty_step(make)}
    return {"invariants": invariants, "balancers": results}


def markdown(record: dict[str, Any]) -> str:
    """The record as a table: one row per invariant, one column per balancer, the empty step last."""
    names = list(record["balancers"])
    marks = {"holds": "holds", "fails": "**fails**"}
    lines = ["| invariant | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for invariant in record["invariants"]:
        cells = [marks.get(record["balancers"][n]["invariants"].get(invariant, ""), "not run") for n in names]
        lines.append(f"| {invariant} | " + " | ".join(cells) + " |")
    lines.append("| **the bias after an empty step** | " + " | ".join(
        record["balancers"][n]["empty step"] for n in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    measured = measure()
    if sys.argv[1:] == ["write"]:
        RECORD.write_text(json.dumps(measured, indent=1) + "\n", encoding="utf-8")
    print(markdown(measured))
