"""`check_capacity` passes correct code and catches the real mistakes of example 72."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_example

from refimpl import capacity_keep
from refimpl.testing import CheckFailure, check_capacity

example = load_example("72_capacity_mistakes")


def test_reference_and_loops_pass():
    check_capacity(example.correct)
    check_capacity(lambda i, w, n, c: (kept := np.asarray(capacity_keep(i, n, c)), w * kept))


def test_catches_token_order_priority():
    with pytest.raises(CheckFailure) as info:
        check_capacity(example.token_order_priority)
    assert info.value.failed == ["rank order", "same as capacity_keep"]
    assert "every token's first choice before any" in str(info.value)


def test_catches_renormalization_after_a_drop():
    with pytest.raises(CheckFailure) as info:
        check_capacity(example.renormalized_after_drop)
    assert info.value.failed == ["dropped weights zero, kept weights unchanged"]
    assert "renormalized after a drop" in str(info.value)


def test_catches_an_overfull_expert():
    with pytest.raises(CheckFailure) as info:
        check_capacity(example.off_by_one)
    assert "capacity never exceeded" in info.value.failed


def test_catches_needless_drops_and_token_order():
    """Two more mistakes: dropping at capacity - 1, and serving a rank's tokens last to first."""
    def early(index, weights, n, capacity):
        return example.correct(index, weights, n, max(capacity - 1, 0))

    def reversed_tokens(index, weights, n, capacity):
        kept, w = example.correct(index[::-1], weights[::-1], n, capacity)
        return kept[::-1], w[::-1]

    with pytest.raises(CheckFailure) as info:
        check_capacity(early)
    assert "nothing dropped without need" in info.value.failed
    with pytest.raises(CheckFailure) as info:
        check_capacity(reversed_tokens)
    assert "token order within a rank" in info.value.failed
