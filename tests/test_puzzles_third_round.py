"""The puzzles' checks, third round: answers that the catalogue must name, or must not.

* an answer returned as a torch tensor is read as NumPy reads it: a wrong one is named for its mistake
  (not a crash of the check), and a float32 tensor counts as a result narrower than float64;
* the routing puzzle's `wrong_axis` is named whatever sort orders the tokens that tie (np.argsort's default
  kind included), and an answer that sorts along axis 0 in another way is not;
* the mixture weights' `scaled_twice` is named when c is applied before and after the renormalization (c^2
  only on top-1 routes, where nothing renormalizes), and its text says so;
* the sign rule's `float32` is named for answers whose values are float32 numbers, never for a float64
  answer that differs by float32-sized amounts for another reason (a smoothed sign, a rounded result);
* the histogram puzzle's hint calls the bin h, as the page does (beta is the dual multiplier).
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl.testing.puzzles import PUZZLES, NotWrittenYet, PuzzleFailure
from refimpl.testing.puzzles.core import _float32_valued, _narrow_floats

torch = pytest.importorskip("torch")


def named(puzzle: str, answer) -> PuzzleFailure:
    """The failure the check of `puzzle` raises for `answer` (which must fail, and not as a stub)."""
    with pytest.raises(PuzzleFailure) as caught:
        PUZZLES[puzzle].check(answer)
    assert not isinstance(caught.value, NotWrittenYet)
    assert str(caught.value).startswith("Not yet: on "), str(caught.value)
    return caught.value


def mistake_of(failure: PuzzleFailure) -> str | None:
    return failure.mistake.name if failure.mistake is not None else None


# ---------------------------------------------------------------------------
# Answers returned as torch tensors
# ---------------------------------------------------------------------------

def weights_renormalized_in_torch(scores, bias, index, scaling_factor):
    """A port from PyTorch that renormalizes a top-1 weight too, returning a float64 tensor."""
    raw = torch.gather(torch.from_numpy(scores), 1, torch.from_numpy(index))
    return scaling_factor * raw / raw.sum(dim=1, keepdim=True)


def weights_in_torch_float32(scores, bias, index, scaling_factor):
    """The right weights, computed and returned as a torch float32 tensor."""
    raw = torch.gather(torch.from_numpy(scores).float(), 1, torch.from_numpy(index))
    if index.shape[1] > 1:
        raw = raw / raw.sum(dim=1, keepdim=True)
    return scaling_factor * raw


def test_a_wrong_torch_answer_is_named_not_a_crash_of_the_check(capsys):
    failure = named("mixture_weights", weights_renormalized_in_torch)
    assert mistake_of(failure) == "top1_renormalized", str(failure)
    PUZZLES["mixture_weights"].run(weights_renormalized_in_torch)
    out = capsys.readouterr().out
    assert out == str(failure) + "\n"
    assert "could not run" not in out and "The mistake: a single top-1 weight renormalized to 1." in out


def test_a_torch_float32_answer_counts_as_narrow():
    assert _narrow_floats(torch.zeros(3, dtype=torch.float32)) == ["float32"]
    assert _narrow_floats((torch.zeros(2, dtype=torch.float16), np.zeros(2))) == ["float16"]
    assert _narrow_floats(torch.zeros(3, dtype=torch.float64)) == []

    class Unreadable:  # a dtype NumPy cannot interpret, on an object NumPy cannot convert
        dtype = object()

        def __array__(self, *args, **kwargs):
            raise TypeError("no")

    assert _narrow_floats(Unreadable()) == []
    failure = named("mixture_weights", weights_in_torch_float32)
    assert mistake_of(failure) == "float32", str(failure)
    assert "Your answer came back as float32" in str(failure)


# ---------------------------------------------------------------------------
# Routing: the wrong axis, whatever sort orders the tied tokens
# ---------------------------------------------------------------------------

def biased_scores(logits, bias):
    return 1.0 / (1.0 + np.exp(-logits)) + bias[None, :]


def route_down_the_tokens_default_sort(logits, bias, top_k):
    """`wrong_axis` written with np.argsort's default kind (equal values in any order)."""
    return np.argsort(-biased_scores(logits, bias), axis=0)[:, :top_k]


def route_down_the_tokens_ties_to_the_last(logits, bias, top_k):
    """`wrong_axis` with tied tokens put last id first, on every machine alike (a stable sort of the rows
    reversed, mapped back): differs from the catalogued form exactly where tokens tie."""
    values = biased_scores(logits, bias)
    m = values.shape[0]
    return (m - 1 - np.argsort(-values[::-1], axis=0, kind="stable"))[:, :top_k]


def route_down_the_tokens_ascending(logits, bias, top_k):
    """Sorted along axis 0 from the smallest: another answer, not the catalogued mistake."""
    return np.argsort(biased_scores(logits, bias), axis=0, kind="stable")[:, :top_k]


def route_down_the_tokens_one_column_late(logits, bias, top_k):
    values = biased_scores(logits, bias)
    order = np.argsort(-values, axis=0, kind="stable")
    return np.roll(order, -1, axis=1)[:, :top_k]


@pytest.mark.parametrize("wrong", [route_down_the_tokens_default_sort, route_down_the_tokens_ties_to_the_last])
def test_wrong_axis_is_named_whatever_sort_orders_tied_tokens(wrong):
    failure = named("routing", wrong)
    assert mistake_of(failure) == "wrong_axis", str(failure)


@pytest.mark.parametrize("wrong", [route_down_the_tokens_ascending, route_down_the_tokens_one_column_late])
def test_an_answer_along_axis_0_that_differs_is_not_named_wrong_axis(wrong):
    failure = named("routing", wrong)
    assert mistake_of(failure) != "wrong_axis", str(failure)


def test_wrong_axis_like_refuses_what_differs_beyond_ties():
    """The comparison itself: token ids listed twice in a column, ids out of range, or another order of
    tokens that do not tie are not the mistake's answer."""
    from refimpl.testing.puzzles.core import Case

    entry = next(m for m in PUZZLES["routing"].mistakes if m.name == "wrong_axis")
    logits = np.array([[0.0, 1.0, 0.0], [0.0, -1.0, 1.0], [1.0, 0.0, 0.0]])
    bias = np.zeros(3)
    case = Case((logits, bias, 2))
    wrong = entry.answer(*case.args)
    assert entry.like(wrong, wrong, case)
    tied = wrong.copy()
    assert wrong[:, 0].tolist() == [2, 0, 1]  # column 0: token 2 first, then tokens 0 and 1, which tie
    tied[[1, 2], 0] = tied[[2, 1], 0]  # either order of the tied tokens is the mistake
    assert entry.like(tied, wrong, case)
    untied = wrong.copy()
    untied[[0, 2], 1] = untied[[2, 0], 1]  # column 1 has no ties
    assert not entry.like(untied, wrong, case)
    twice = wrong.copy()
    twice[1, 0] = twice[0, 0]
    assert not entry.like(twice, wrong, case)
    outside = wrong.copy()
    outside[0, 0] = 3
    assert not entry.like(outside, wrong, case)


# ---------------------------------------------------------------------------
# Mixture weights: c before and after the renormalization
# ---------------------------------------------------------------------------

def weights_scaled_before_and_after(scores, bias, index, scaling_factor):
    """c applied to the gathered scores and again to the weights: it cancels where they are renormalized."""
    raw = scaling_factor * np.take_along_axis(scores, index, axis=1)
    if index.shape[1] > 1:
        raw = raw / raw.sum(axis=1, keepdims=True)
    return scaling_factor * raw


def test_scaled_twice_is_named_when_c_comes_before_and_after_renormalizing():
    failure = named("mixture_weights", weights_scaled_before_and_after)
    assert mistake_of(failure) == "scaled_twice", str(failure)
    assert "top-1 routes" in str(failure).splitlines()[0]
    why = " ".join(failure.mistake.why.split())
    assert "nothing renormalizes" in why and "c^2 s instead of c s" in why


# ---------------------------------------------------------------------------
# The sign rule: float32 named from the values, never for a float64 answer off by a little
# ---------------------------------------------------------------------------

def sign_smoothed(load, bias, rate):
    """A smooth sign (tanh), in float64 throughout: wrong where the load is off target by a fraction."""
    return bias + rate * np.tanh(50.0 * (load.mean() - load))


def sign_rounded_to_decimals(load, bias, rate):
    """In float64 throughout, rounded to 6 decimals."""
    return np.round(bias + rate * np.sign(load.mean() - load), 6)


def sign_all_in_float32(load, bias, rate):
    n = load.shape[0]
    return bias.astype(np.float32) + np.float32(rate) * np.sign(load.sum() - n * load).astype(np.float32)


def sign_rounded_to_float32_at_the_end(load, bias, rate):
    return (bias + rate * np.sign(load.mean() - load)).astype(np.float32).astype(np.float64)


def sign_float32_bias_other_order(load, bias, rate):
    return rate * np.sign(load.mean() - load) + bias.astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("wrong", [sign_smoothed, sign_rounded_to_decimals])
def test_a_float64_answer_is_not_called_float32(wrong):
    failure = named("sign_rule", wrong)
    assert mistake_of(failure) != "float32", str(failure)
    assert wrong(*failure.case.args).dtype == np.float64


@pytest.mark.parametrize("wrong", [sign_all_in_float32, sign_rounded_to_float32_at_the_end,
                                   sign_float32_bias_other_order])
def test_a_float32_answer_of_the_sign_rule_is_still_named(wrong):
    failure = named("sign_rule", wrong)
    assert mistake_of(failure) == "float32", str(failure)


def test_float32_values_are_told_from_float64_ones():
    assert _float32_valued(np.array([0.5, np.float32(0.1), -3.0]))
    assert _float32_valued((np.array([1.0]), np.array([2, 3])))
    assert not _float32_valued(np.array([0.5, 0.1]))
    assert not _float32_valued((np.array([1.0]), np.array([0.123456])))


# ---------------------------------------------------------------------------
# The histogram puzzle's notation
# ---------------------------------------------------------------------------

def test_the_histogram_hint_calls_the_bin_h():
    hint = PUZZLES["histogram_quantile"].hint
    assert "counts[np.arange(n), h]" in hint and "beta" not in hint
