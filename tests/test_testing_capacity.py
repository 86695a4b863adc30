"""`check_capacity` passes correct code and catches the real mistakes it is meant to catch."""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import capacity_keep
from refimpl.testing import CheckFailure, check_capacity


def correct(index, weights, num_experts, capacity):
    """The sketch's rule written with loops over slots and experts, as the seed does."""
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
        for r in range(k):
            if load[index[i, r]] < capacity:
                kept[i, r] = True
                load[index[i, r]] += 1
    return kept, weights * kept


def renormalized_after_drop(index, weights, num_experts, capacity):
    """Mistake: the surviving gates are renormalized to sum to one."""
    kept, w = correct(index, weights, num_experts, capacity)
    total = w.sum(axis=1, keepdims=True)
    return kept, np.where(total > 0, w / np.where(total > 0, total, 1), 0.0)


def off_by_one(index, weights, num_experts, capacity):
    """Mistake: an expert takes one assignment more than its capacity (`<=` for `<`)."""
    return correct(index, weights, num_experts, capacity + 1)


def test_reference_and_loops_pass():
    check_capacity(correct)
    check_capacity(lambda i, w, n, c: (kept := np.asarray(capacity_keep(i, n, c)), w * kept))


def test_catches_token_order_priority():
    with pytest.raises(CheckFailure) as info:
        check_capacity(token_order_priority)
    assert "rank order" in info.value.failed
    assert "capacity never exceeded" not in info.value.failed
    assert "every token's first choice before any" in str(info.value)


def test_catches_renormalization_after_a_drop():
    with pytest.raises(CheckFailure) as info:
        check_capacity(renormalized_after_drop)
    assert info.value.failed == ["dropped weights zero, kept weights unchanged"]
    assert "renormalized after a drop" in str(info.value)


def test_catches_an_overfull_expert():
    with pytest.raises(CheckFailure) as info:
        check_capacity(off_by_one)
    assert "capacity never exceeded" in info.value.failed
