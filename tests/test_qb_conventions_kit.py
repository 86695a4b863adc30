"""The update checks name Quantile Balancing as other code ships it, and name nothing on other mistakes.

Each planted update is that convention's own code: Megatron-Core's update
(`refimpl.balancing.megatron_qb_update`, held against a transcription of
Megatron-Core's source in `test_shipped_qb.py`) called the way a port would
call it, a fixed-range histogram, and an average of per-block quantiles.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import refimpl.testing as kit
from refimpl.balancing import (
    cutoffs,
    histogram_balancing_update,
    kth_largest,
    megatron_qb_update,
    quantile_balancing_update,
    torchtitan_qb_update,
)
from refimpl.testing.qb_conventions import HISTOGRAM_CONVENTIONS, UPDATE_CONVENTIONS

FEW = "quick"


def failure_of(check, fn, **options) -> kit.CheckFailure:
    with pytest.raises(kit.CheckFailure) as info:
        check(fn, settings=FEW, **options)
    return info.value


def named(failure: kit.CheckFailure) -> set[str]:
    return {name for v in failure.violations for name in v.conventions}


def beta_returned(scores, bias, top_k):
    """Eq. (14), returned as Megatron-Core's qb_beta = -b."""
    return -quantile_balancing_update(scores, bias, top_k)


def megatron_with_the_kits_bias(scores, bias, top_k):
    """Megatron-Core's update, handed the kit's bias as its qb_beta."""
    return megatron_qb_update([scores], bias, top_k)


def whole_target(scores, bias, top_k):
    """The (floor(mk/n) + 1)-th largest margin, no interpolation."""
    m, n = scores.shape
    alpha = np.asarray(cutoffs(scores, bias, top_k))
    b = -np.asarray(kth_largest((scores - alpha[:, None]).T.copy(), m * top_k // n + 1))
    return b - b.mean()


def test_returning_beta_is_named():
    failure = failure_of(kit.check_balancing_update, beta_returned)
    assert "matches Eq. (14)" in failure.failed
    assert named(failure) == {"beta_returned"}, str(failure)
    assert "Megatron-Core's qb_beta" in str(failure)


def test_megatron_cores_update_with_the_kits_bias_is_named():
    failure = failure_of(kit.check_balancing_update, megatron_with_the_kits_bias, integer_q_only=True)
    assert named(failure) == {"beta_sign_throughout"}, str(failure)


def test_a_target_rounded_down_is_named():
    failure = failure_of(kit.check_balancing_update, whole_target)
    assert failure.failed == ["matches Eq. (14)"]
    assert named(failure) == {"whole_target_rounded_down"}, str(failure)
    # and it passes where Megatron-Core runs at all: whole targets
    kit.check_balancing_update(whole_target, integer_q_only=True, settings=FEW)


def logit(scores):
    return np.log(scores) - np.log1p(-scores)


def megatron_on_logits(scores, bias, top_k):
    """Megatron-Core's micro-batch update, each sign read as its own, on the logits of the scores handed in."""
    return -megatron_qb_update([logit(scores)], -bias, top_k)


def ceil_q_rank(scores, bias, top_k):
    """The ceil(q)-th smallest required bias alpha - s, q = m * (k/n) in float32, as the two trainers read it."""
    m, n = scores.shape
    rank = max(1, math.ceil(np.float32(m) * np.float32(top_k / n)))
    alpha = np.asarray(cutoffs(scores, bias, top_k))
    b = -np.asarray(kth_largest((scores - alpha[:, None]).T.copy(), rank))
    return b - b.mean()


def test_reading_logits_is_named():
    failure = failure_of(kit.check_balancing_update, megatron_on_logits, integer_q_only=True)
    assert failure.failed == ["matches Eq. (14)"], str(failure)
    assert named(failure) == {"read_on_logits"}, str(failure)
    assert "qb_dual_update on the router's raw logits" in str(failure)


def test_the_ceil_q_rank_is_named_by_the_exact_check():
    failure = failure_of(kit.check_balancing_update, ceil_q_rank)
    assert failure.failed == ["matches Eq. (14)"], str(failure)
    assert named(failure) == {"ceil_q_rank"}, str(failure)


@pytest.mark.parametrize("shipped", ["torchtitan", "megatron_global_batch"])
def test_the_shipped_histogram_updates_are_named_for_their_ceil_q_rank(shipped):
    """torchtitan's QuantileBalancer and Megatron-Core's global_batch mode, as shipped, bin [min b - 1, max b + 1]
    into 1000 bins and pool the blocks, as Appendix D does: the rank they read is the one difference named."""
    update = {"torchtitan": torchtitan_qb_update,
              "megatron_global_batch": lambda blocks, bias, top_k: megatron_qb_update(
                  blocks, bias, top_k, estimation_scope="global_batch")}[shipped]
    failure = failure_of(kit.check_histogram_update, update)
    assert "within one bin of Eq. (14)" in failure.failed, str(failure)
    assert "partition invariance" not in failure.failed and "bias-shift invariance" not in failure.failed
    assert named(failure) == {"ceil_q_rank"}, str(failure)
    assert "Megatron-Core's global_batch mode and torchtitan's QuantileBalancer" in str(failure)


def test_a_fixed_histogram_range_fails_and_is_named():
    def fixed(blocks, bias, top_k):
        return histogram_balancing_update(blocks, bias, top_k, 512, value_range=(-1.0, 1.0))

    failure = failure_of(kit.check_histogram_update, fixed, bins=512)
    assert "bias-shift invariance" in failure.failed, str(failure)
    assert named(failure) == {"fixed_histogram_range"}, str(failure)


def test_averaged_per_block_quantiles_fail_partition_invariance_and_are_named():
    def averaged(blocks, bias, top_k):
        usable = [b for b in blocks if b.shape[0] * top_k // b.shape[1] + 2 <= b.shape[0]]
        if len(usable) < 2:
            return histogram_balancing_update(blocks, bias, top_k, 1000)
        return np.mean([histogram_balancing_update(b, bias, top_k, 1000) for b in usable], axis=0)

    failure = failure_of(kit.check_histogram_update, averaged)
    assert failure.failed == ["partition invariance"], str(failure)
    assert named(failure) == {"quantiles_averaged"}, str(failure)


def test_a_mistake_outside_these_conventions_is_named_nothing():
    def off(scores, bias, top_k):
        return quantile_balancing_update(scores, bias, top_k) * 1.5

    failure = failure_of(kit.check_balancing_update, off)
    assert named(failure) == set()
    assert "known ways of shipping" not in str(failure)


def test_each_convention_differs_from_eq14_somewhere_and_the_module_table_lists_them():
    import re

    from refimpl.testing import qb_conventions

    rng = np.random.default_rng(0)
    scores = rng.uniform(0.01, 0.99, size=(37, 8))
    bias = rng.normal(size=8) * 1.5
    blocks = np.array_split(scores, 3)
    exact = quantile_balancing_update(scores, bias, 3)
    for entry in HISTOGRAM_CONVENTIONS:
        assert entry.applies(blocks, bias, 3), entry.name
        assert np.max(np.abs(entry.output(blocks, bias, 3) - exact)) > 1e-3, entry.name
    rows = re.findall(r"^\| `(\w+)` \|", qb_conventions.__doc__, flags=re.MULTILINE)
    assert rows == [entry.name for entry in HISTOGRAM_CONVENTIONS]
    assert set(UPDATE_CONVENTIONS) < set(HISTOGRAM_CONVENTIONS)
