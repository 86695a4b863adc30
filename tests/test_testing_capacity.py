"""`check_capacity` passes correct code and catches the real mistakes of example 72."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_example

from refimpl import capacity_keep
from refimpl.testing import CheckFailure, check_capacity
from refimpl.testing.capacity_check import token_major_keep

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


def test_token_major_order_is_a_convention_a_port_declares():
    """MaxText's documented order: declared, it passes; undeclared, the report names the declaration."""
    result = check_capacity(example.token_order_priority, order="token_major")
    assert "token order" in result.passed and "same as token_major_keep" in result.passed
    with pytest.raises(CheckFailure) as info:
        check_capacity(example.token_order_priority)
    assert "order='token_major'" in str(info.value)
    with pytest.raises(CheckFailure) as info:  # a rank-major port is not token-major
        check_capacity(example.correct, order="token_major")
    assert "same as token_major_keep" in info.value.failed


def test_token_major_keep_is_the_loop_it_names():
    index = np.array([[0, 1], [0, 2], [1, 0]])
    # Capacity 1, token by token: token 0 fills experts 0 and 1; token 1 finds 0 full and takes 2; token 2 finds
    # 1 and 0 full. Rank-major serves the first choices first: 0, 0 (full), 1; then the second choices.
    kept = np.asarray(token_major_keep(index, 3, 1))
    assert kept.tolist() == [[True, True], [False, True], [False, False]]
    assert np.asarray(capacity_keep(index, 3, 1)).tolist() == [[True, False], [False, True], [True, False]]


@pytest.mark.parametrize("order", ["token-major", "", None, "rank"])
def test_an_unknown_order_is_refused(order):
    with pytest.raises(ValueError, match="order"):
        check_capacity(example.correct, order=order)
