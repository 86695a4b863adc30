"""The lifecycle check: a correct pooled balancer passes, each lifecycle fault fails by its own name (and only it),
and refimpl's balancers and the two shipped ones go through it with the faults the page states."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from refimpl.testing import CheckFailure, check_balancer_lifecycle
from refimpl.testing.lifecycle_check import MegatronGlobalBatchAdapter, ReferenceAdapter, TorchtitanAdapter

EVERY = ["matches the declared estimator", "micro-batches and ranks pooled, not averaged",
         "not observed in eval or under no_grad", "counted once under recomputation",
         "no NaN and no move on an empty step", "no move while frozen", "accumulator kept on resume",
         "replicas not counted as data"]


class ObservesInEval(ReferenceAdapter):
    def observe(self, scores, *, training=True, grad=True, recomputing=False, rank=0, replica=False):
        super().observe(scores, recomputing=recomputing, replica=replica)


class CountsRecomputation(ReferenceAdapter):
    def observe(self, scores, *, training=True, grad=True, recomputing=False, rank=0, replica=False):
        super().observe(scores, training=training, grad=grad, replica=replica)


class NaNOnEmpty(ReferenceAdapter):
    """Reads an empty histogram's 0/0 (a frozen step is skipped before the read, as a frozen router is)."""

    def update(self):
        if not self.blocks and not self.frozen:
            self.bias = np.full_like(self.bias, np.nan)
        super().update()


class DropsAccumulator(ReferenceAdapter):
    def state_dict(self):
        return {"bias": self.bias.copy(), "blocks": []}


class MovesWhileFrozen(ReferenceAdapter):
    """Reads the frozen switch nowhere: it counts and updates as if balancing were on."""

    def observe(self, scores, *, training=True, grad=True, recomputing=False, rank=0, replica=False):
        if training and grad and not recomputing and not replica:
            self.blocks.append(np.array(scores, dtype=np.float32))

    def update(self):
        frozen, self.frozen = self.frozen, False
        super().update()
        self.frozen = frozen


class GathersWhileFrozen(ReferenceAdapter):
    """Holds the bias while frozen but keeps what it saw for the next step (prime-rl #2953)."""

    def observe(self, scores, *, training=True, grad=True, recomputing=False, rank=0, replica=False):
        if training and grad and not recomputing and not replica:
            self.blocks.append(np.array(scores, dtype=np.float32))

    def update(self):
        if not self.frozen:
            super().update()


class CountsReplicas(ReferenceAdapter):
    def observe(self, scores, *, training=True, grad=True, recomputing=False, rank=0, replica=False):
        super().observe(scores, training=training, grad=grad, recomputing=recomputing)


def failed(make, estimator="exact") -> list[str]:
    with pytest.raises(CheckFailure) as info:
        check_balancer_lifecycle(make, estimator=estimator)
    return info.value.failed


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_a_correct_pooled_balancer_passes(estimator):
    result = check_balancer_lifecycle(partial(ReferenceAdapter, estimator=estimator), estimator=estimator)
    assert result.passed == EVERY


@pytest.mark.parametrize(("faulty", "fault"), [
    (ObservesInEval, "not observed in eval or under no_grad"),
    (CountsRecomputation, "counted once under recomputation"),
    (NaNOnEmpty, "no NaN and no move on an empty step"),
    (DropsAccumulator, "accumulator kept on resume"),
    (MovesWhileFrozen, "no move while frozen"),
    (GathersWhileFrozen, "no move while frozen"),
    (CountsReplicas, "replicas not counted as data"),
])
def test_each_fault_fails_by_its_own_name_and_only_it(faulty, fault):
    assert failed(faulty) == [fault]


def test_a_failure_names_the_fault_and_prints_a_script_to_paste():
    with pytest.raises(CheckFailure) as info:
        check_balancer_lifecycle(NaNOnEmpty)
    report = str(info.value)
    assert "NaN or a move on an empty step: the bias is not finite" in report
    script = report[report.index("reproduce it"):].splitlines()
    assert "import numpy as np" in [line.strip() for line in script] and any(line.strip() == "balancer.update()" for line in script)


def test_megatron_cores_global_batch_through_the_check():
    """Measured: it keeps its bias on an empty step, skips eval, no_grad and frozen forwards; it counts a
    recomputed forward again (its guard cannot tell it from the first), its checkpoint holds no histogram, and
    an all-reduce over a group holding a replica counts it."""
    assert failed(MegatronGlobalBatchAdapter, None) == [
        "counted once under recomputation", "accumulator kept on resume", "replicas not counted as data"]


def test_torchtitans_quantile_balancer_through_the_check():
    """Measured: it also counts no_grad forwards in training mode, and an empty step writes NaN."""
    assert failed(TorchtitanAdapter, None) == [
        "not observed in eval or under no_grad", "counted once under recomputation",
        "no NaN and no move on an empty step", "accumulator kept on resume", "replicas not counted as data"]


def test_what_each_does_on_an_empty_step():
    bias = np.array([0.1, -0.2, 0.05, 0.05], dtype=np.float32)
    empty = np.zeros((0, 4), dtype=np.float32)
    from refimpl.balancing import megatron_qb_update, torchtitan_qb_update

    assert np.array_equal(megatron_qb_update([empty], bias, 1, estimation_scope="global_batch"), bias)
    assert np.isnan(torchtitan_qb_update([empty], bias, 1)).all()
    reference = ReferenceAdapter(4, 1, estimator="histogram")
    reference.bias = bias.copy()
    reference.update()
    assert np.array_equal(reference.bias, bias)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="estimator must be None, 'exact' or 'histogram', got 'hist'"):
        check_balancer_lifecycle(ReferenceAdapter, estimator="hist")
    with pytest.raises(ValueError, match="bins must be a positive integer, got 0"):
        check_balancer_lifecycle(ReferenceAdapter, bins=0)


@pytest.mark.slow
def test_the_balancing_pages_lifecycle_record_is_what_the_balancers_do_now():
    import json
    import sys
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    sys.path.insert(0, str(docs))
    try:
        import measure_lifecycle
    finally:
        sys.path.remove(str(docs))
    committed = json.loads(measure_lifecycle.RECORD.read_text(encoding="utf-8"))
    assert measure_lifecycle.measure() == committed, (
        "the lifecycle table differs from docs/pages/lifecycle_measured.json: run "
        "`.venv/bin/python docs/measure_lifecycle.py write` and read the diff")
    table = measure_lifecycle.markdown(committed)
    assert "| no NaN and no move on an empty step | holds | holds | holds | **fails** |" in table
    assert table.splitlines()[-1].endswith("| keeps the bias | keeps the bias | keeps the bias | NaN in 6 of 6 entries |")
