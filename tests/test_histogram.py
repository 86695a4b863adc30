"""Appendix D: the histogram estimator against an exact, sort-based Eq. (14) threshold.

The reference below is written independently of `refimpl.balancing.histogram`: it sorts
every column of required biases and picks the order statistics of Eq. (14)'s
rule (the (q+1)-th largest margin, interpolated between ranks floor(q)+1 and
floor(q)+2 when q is fractional).
"""

from __future__ import annotations

import array_api_strict
import numpy as np
import pytest
from conftest import load_example
from hypothesis import given
from hypothesis import strategies as st

from refimpl._lib.xp import to_numpy
from refimpl.balancing.histogram import (
    BiasHistogram,
    histogram_balancing_update,
    histogram_range,
    required_bias,
)

# ---------------------------------------------------------------------------
# The independent reference
# ---------------------------------------------------------------------------


def exact_thresholds(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Uncentred Eq. (14) thresholds by sorting: minus the (q+1)-th largest margin of each column."""
    m, n = scores.shape
    dtype = np.float64 if np.float64 in (scores.dtype, bias.dtype) else np.float32
    # The cutoff: the (k+1)-th largest biased score, formed in the routing dtype.
    biased = scores.astype(dtype) + bias.astype(dtype)
    alpha = np.sort(biased, axis=1)[:, n - top_k - 1].astype(np.float64)
    margins = scores.astype(np.float64) - alpha[:, None]  # [m, n]
    descending = -np.sort(-margins, axis=0)  # column j: largest margin first
    q_floor, remainder = divmod(m * top_k, n)
    f = remainder / n
    first = descending[q_floor]  # the (floor(q)+1)-th largest
    second = descending[q_floor + 1] if remainder else first  # the (floor(q)+2)-th largest
    return -((1 - f) * first + f * second)


def tolerance(scores: np.ndarray, bias: np.ndarray) -> float:
    """Rounding allowance on top of one bin width: float32 arithmetic moves a value by ~1e-7."""
    return 1e-12 if np.float64 in (scores.dtype, bias.dtype) else 1e-5


def router_batch(m: int, n: int, seed: int, dtype=np.float32, spread: float = 0.5) -> np.ndarray:
    """Sigmoid scores from a small seeded router whose experts have unequal popularity."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=8)
    weight = rng.normal(size=(n, 8)) * spread
    x = mean + rng.normal(size=(m, 8))
    return (1.0 / (1.0 + np.exp(-(x @ weight.T)))).astype(dtype)


def balanced_bias(scores: np.ndarray, top_k: int) -> np.ndarray:
    """A realistic current bias: one exact step from zero (it creates the atoms at b_j)."""
    b = exact_thresholds(scores, np.zeros(scores.shape[1], scores.dtype), top_k)
    return (b - b.mean()).astype(scores.dtype)


def sigmoid_scores(rng: np.random.Generator, m: int, n: int, ties: bool) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-rng.normal(size=(m, n))))
    if ties:  # a coarse grid makes equal scores and equal margins common
        s = np.round(s * 8) / 8
    return s.astype(np.float32)


# ---------------------------------------------------------------------------
# The reference itself, on cases worked by hand
# ---------------------------------------------------------------------------

HAND_SCORES = np.array([[0.9, 0.5, 0.1],
                        [0.2, 0.7, 0.6],
                        [0.3, 0.4, 0.8],
                        [0.6, 0.1, 0.3]])


def test_reference_on_cases_worked_by_hand():
    # Three tokens, k = 1, zero bias: q = 1, so the threshold is the 2nd smallest r = alpha - s.
    # alpha = (0.5, 0.6, 0.4); r columns: (-0.4, 0.4, 0.1), (0, -0.1, 0), (0.4, 0, -0.4).
    np.testing.assert_allclose(exact_thresholds(HAND_SCORES[:3], np.zeros(3), 1), [0.1, 0.0, 0.0], atol=1e-15)
    # Four tokens: q = 4/3, between the 2nd and 3rd smallest with weight 1/3.
    # Column 0: (-0.4, -0.3, 0.1, 0.4) -> (2/3)(-0.3) + (1/3)(0.1) = -1/6.
    np.testing.assert_allclose(exact_thresholds(HAND_SCORES, np.zeros(3), 1), [-1 / 6, 0.0, 0.0], atol=1e-15)


def test_histogram_on_cases_worked_by_hand(xp):
    for rows, expected in ((3, [0.1, 0.0, 0.0]), (4, [-1 / 6, 0.0, 0.0])):
        h = BiasHistogram(xp.asarray(np.zeros(3)), 1, bins=10_000).add(xp.asarray(HAND_SCORES[:rows]))
        assert h.width == pytest.approx(2 / 10_000)
        np.testing.assert_allclose(to_numpy(h.thresholds()), expected, atol=h.width)
        centred = np.asarray(expected) - np.mean(expected)
        np.testing.assert_allclose(to_numpy(h.new_bias()), centred, atol=2 * h.width)


# ---------------------------------------------------------------------------
# Within one bin width of the exact update
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "k"), [(4096, 32, 4), (4099, 32, 5), (3000, 48, 7)],
                         ids=["integer q", "fractional q", "fractional q, k=7"])
@pytest.mark.parametrize("bins", [100, 1000])
def test_within_one_bin_width_of_the_exact_update(xp, m, n, k, bins):
    if xp is array_api_strict:
        m //= 4  # the portable counting sorts; keep it quick
    scores = router_batch(m, n, seed=m + n + k)
    bias = balanced_bias(scores, k)
    exact = exact_thresholds(scores, bias, k)
    h = BiasHistogram(xp.asarray(bias), k, bins, chunk_size=5000).add(xp.asarray(scores))
    error = np.abs(to_numpy(h.thresholds()) - exact)
    assert error.max() <= h.width + tolerance(scores, bias), (error.max(), h.width)
    # Centring subtracts the mean error from every expert, so the centred bias is within two widths.
    centred = to_numpy(h.new_bias())
    assert centred.dtype == bias.dtype
    assert abs(float(centred.mean())) < 1e-6
    assert np.abs(centred - (exact - exact.mean())).max() <= 2 * h.width + tolerance(scores, bias)


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 9), data=st.data(),
       bins=st.sampled_from([1, 2, 7, 100, 1000]), ties=st.booleans(), wide=st.booleans())
def test_within_one_bin_width_property(seed, n, data, bins, ties, wide):
    k = data.draw(st.integers(1, n - 1), label="k")
    # At least n/(n-k) tokens, so that the (ceil(q)+1)-th value exists.
    m = data.draw(st.integers(-(-n // (n - k)), 60), label="m")
    rng = np.random.default_rng(seed)
    scores = sigmoid_scores(rng, m, n, ties)
    bias = (rng.normal(size=n) * (2.0 if wide else 0.05)).astype(np.float32)
    exact = exact_thresholds(scores, bias, k)
    h = BiasHistogram(bias, k, bins, chunk_size=int(rng.integers(1, 4 * n))).add(scores)
    error = np.abs(h.thresholds() - exact)
    assert error.max() <= h.width + tolerance(scores, bias)


def test_reading_rank_q_instead_of_q_plus_1_would_break_the_bound():
    # One expert's r values with a gap: the q-th and (q+1)-th smallest are many bins apart.
    # n = 2, k = 1, m = 4: q = 2, so the exact threshold of expert 0 is its 3rd smallest r.
    scores = np.array([[0.95, 0.05], [0.90, 0.10], [0.10, 0.90], [0.05, 0.95]])
    bias = np.zeros(2)
    exact = exact_thresholds(scores, bias, 1)
    h = BiasHistogram(bias, 1, bins=1000).add(scores)
    r = np.sort(to_numpy(required_bias(scores, bias, 1))[:, 0])
    assert r[2] - r[1] > 100 * h.width  # the gap
    assert abs(h.thresholds()[0] - exact[0]) <= h.width
    assert abs(r[1] - exact[0]) > 100 * h.width  # rank q lands far away


def test_error_shrinks_with_the_bin_width():
    scores = router_batch(20_000, 64, seed=7)
    k = 6
    bias = balanced_bias(scores, k)
    exact = exact_thresholds(scores, bias, k)
    errors, widths = [], []
    for bins in (10, 100, 1000, 10_000):
        h = BiasHistogram(bias, k, bins).add(scores)
        errors.append(float(np.abs(h.thresholds() - exact).max()))
        widths.append(h.width)
    for error, width in zip(errors, widths, strict=True):
        assert error <= width + 1e-5
    for coarse, fine in zip(errors, errors[1:], strict=False):
        assert fine < coarse / 2, errors
    assert errors[-1] < errors[0] / 100, errors


# ---------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------


def test_counts_match_numpy_histogram_of_r():
    rng = np.random.default_rng(3)
    scores = rng.uniform(0.01, 0.99, size=(700, 12))
    bias = rng.normal(size=12) * 0.3
    h = BiasHistogram(bias, 3, bins=250, chunk_size=12 * 50).add(scores)
    low, high = histogram_range(bias)
    assert (low, high) == (bias.min() - 1, bias.max() + 1)
    alpha = np.sort(scores + bias, axis=1)[:, -4]
    r = alpha[:, None] - scores  # [m, n], float64
    for j in range(12):
        expected, _ = np.histogram(r[:, j], bins=250, range=(low, high))
        np.testing.assert_array_equal(h.counts[j], expected)
    assert h.counts.dtype == np.int64
    assert h.tokens == 700
    assert int(h.counts.sum()) == 700 * 12
    np.testing.assert_array_equal(h.counts.sum(axis=1), np.full(12, 700))
    np.testing.assert_allclose(to_numpy(h.edges), np.linspace(low, high, 251), atol=1e-12)


def test_numpy_and_portable_paths_count_identically():
    rng = np.random.default_rng(11)
    for ties in (False, True):
        scores = sigmoid_scores(rng, 333, 10, ties)
        bias = (rng.normal(size=10) * 0.2).astype(np.float32)
        fast = BiasHistogram(bias, 3, bins=97, chunk_size=10 * 40).add(scores)
        strict = BiasHistogram(array_api_strict.asarray(bias), 3, bins=97, chunk_size=10 * 7)
        strict.add(array_api_strict.asarray(scores))
        np.testing.assert_array_equal(to_numpy(strict.counts), fast.counts)
        assert to_numpy(strict.new_bias()).tobytes() == fast.new_bias().tobytes()


def test_values_outside_the_range_land_in_the_edge_bins():
    # Scores outside [0, 1] (logits, say) give required biases beyond [min b - 1, max b + 1].
    # (Five bins keep the atoms at r = b_j = 0 away from an edge, where rounding could move them.)
    scores = np.array([[1.8, 0.5, 0.2], [-0.7, 0.4, 0.65], [0.3, 2.5, -1.5]])
    bias = np.zeros(3)
    h = BiasHistogram(bias, 1, bins=5).add(scores)
    r = to_numpy(required_bias(scores, bias, 1))
    assert (r < h.low).any() and (r > h.high).any()
    for j in range(3):
        expected, _ = np.histogram(np.clip(r[:, j], h.low, h.high), bins=5, range=(h.low, h.high))
        np.testing.assert_array_equal(h.counts[j], expected)
    assert int(h.counts.sum()) == 9
    assert np.isfinite(h.new_bias()).all()


# ---------------------------------------------------------------------------
# Any split of the tokens gives the same bias, bitwise
# ---------------------------------------------------------------------------


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 10), data=st.data(),
       bins=st.sampled_from([1, 3, 64, 1000]), ties=st.booleans())
def test_any_partition_over_ranks_and_micro_batches_gives_the_identical_bias(seed, n, data, bins, ties):
    k = data.draw(st.integers(1, n), label="k")
    m = data.draw(st.integers(n, 80), label="m")  # m >= n is always enough tokens
    rng = np.random.default_rng(seed)
    scores = sigmoid_scores(rng, m, n, ties)
    bias = (rng.normal(size=n) * 0.1).astype(np.float32)
    whole = BiasHistogram(bias, k, bins).add(scores)

    # Cut the batch into blocks (some possibly empty), deal them to ranks in any order.
    cuts = sorted(data.draw(st.lists(st.integers(0, m), max_size=7), label="cuts"))
    edges = [0, *cuts, m]
    blocks = [scores[a:b] for a, b in zip(edges, edges[1:], strict=False)]
    order = data.draw(st.permutations(range(len(blocks))), label="order")
    ranks = data.draw(st.integers(1, 4), label="ranks")
    owner = data.draw(st.lists(st.integers(0, ranks - 1), min_size=len(blocks), max_size=len(blocks)),
                      label="owner")
    chunk = data.draw(st.integers(1, 6 * n), label="chunk_size")
    per_rank = [BiasHistogram(bias, k, bins, chunk_size=chunk) for _ in range(ranks)]
    for index in order:
        per_rank[owner[index]].add(blocks[index])

    # The all-reduce: a plain integer sum.
    summed = sum(h.counts for h in per_rank)
    np.testing.assert_array_equal(summed, whole.counts)
    assert int(summed.sum()) == m * n
    merged = per_rank[0].merge(*per_rank[1:])
    assert merged.new_bias().tobytes() == whole.new_bias().tobytes()
    streamed = histogram_balancing_update([blocks[i] for i in order], bias, k, bins, chunk_size=chunk)
    assert streamed.tobytes() == whole.new_bias().tobytes()


def test_partition_on_every_backend(xp):
    """Any split gives the same bias on each backend, bitwise, and the backends count identically."""
    rng = np.random.default_rng(5)
    scores = sigmoid_scores(rng, 90, 8, ties=True)
    bias = (rng.normal(size=8) * 0.1).astype(np.float32)
    xs, bs = xp.asarray(scores), xp.asarray(bias)
    whole = histogram_balancing_update(xs, bs, 3, 50)
    pieces = [xs[0:0, :], xs[0:31, :], xs[31:32, :], xs[32:90, :]]
    split = histogram_balancing_update(pieces[::-1], bs, 3, 50, chunk_size=8 * 5)
    assert to_numpy(split).tobytes() == to_numpy(whole).tobytes()
    counts = to_numpy(BiasHistogram(bs, 3, 50, chunk_size=8 * 5).add(xs).counts)
    np.testing.assert_array_equal(counts, BiasHistogram(bias, 3, 50).add(scores).counts)


# ---------------------------------------------------------------------------
# Edge cases with a defined answer
# ---------------------------------------------------------------------------


def test_k_equal_n_counts_every_token_and_keeps_the_bias_centred(xp):
    scores = xp.asarray(router_batch(20, 5, seed=1))
    bias = np.array([0.3, -0.1, 0.0, 0.2, -0.5], dtype=np.float32)
    h = BiasHistogram(xp.asarray(bias), 5, bins=10).add(scores)
    counts = to_numpy(h.counts)
    np.testing.assert_array_equal(counts[:, 0], np.full(5, 20))  # alpha = -inf: all in the first bin
    assert int(counts.sum()) == 100
    new = to_numpy(h.new_bias())
    assert new.dtype == np.float32
    np.testing.assert_allclose(new, bias + 0.02, atol=1e-7)  # the mean of bias is -0.02


def test_one_bin(xp):
    scores = router_batch(500, 6, seed=2)
    bias = balanced_bias(scores, 2)
    h = BiasHistogram(xp.asarray(bias), 2, bins=1).add(xp.asarray(scores))
    assert to_numpy(h.counts).tolist() == [[500]] * 6
    assert h.width == pytest.approx(float(bias.max() - bias.min()) + 2)
    error = np.abs(to_numpy(h.thresholds()) - exact_thresholds(scores, bias, 2))
    assert error.max() <= h.width


def test_empty_blocks_add_nothing(xp):
    scores = router_batch(64, 8, seed=4)
    bias = np.zeros(8, dtype=np.float32)
    empty = xp.asarray(np.zeros((0, 8), dtype=np.float32))
    with_empty = histogram_balancing_update([empty, xp.asarray(scores), empty], xp.asarray(bias), 2)
    without = histogram_balancing_update([xp.asarray(scores)], xp.asarray(bias), 2)
    assert to_numpy(with_empty).tobytes() == to_numpy(without).tobytes()


def test_no_tokens_at_all_is_an_error():
    bias = np.zeros(4)
    with pytest.raises(ValueError, match="no tokens"):
        histogram_balancing_update([np.zeros((0, 4))], bias, 1)
    with pytest.raises(ValueError, match="no tokens"):
        BiasHistogram(bias, 4).new_bias()


def test_too_few_tokens_is_an_error():
    # m = 3 < n/(n-k) = 4: q = 2.25 needs the 4th smallest value of each expert, which does not exist.
    scores = sigmoid_scores(np.random.default_rng(9), 4, 4, ties=False)
    bias = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match=r"too few tokens.*needs the 4-th smallest.*m=3"):
        BiasHistogram(bias, 3, bins=1000).add(scores[:3]).new_bias()
    # Four tokens are enough: q = 3 needs the 4th.
    h = BiasHistogram(bias, 3, bins=1000).add(scores)
    assert np.abs(h.thresholds() - exact_thresholds(scores, bias, 3)).max() <= h.width + 1e-5


def test_precomputed_cutoffs_give_the_same_counts():
    scores = router_batch(300, 16, seed=6)
    bias = balanced_bias(scores, 4)
    alpha = np.sort(scores + bias, axis=1)[:, -5]
    own = BiasHistogram(bias, 4).add(scores)
    given_cutoff = BiasHistogram(bias, 4).add(scores, cutoff=alpha)
    np.testing.assert_array_equal(own.counts, given_cutoff.counts)


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    scores = router_batch(10, 4, seed=0)
    bias = np.zeros(4, dtype=np.float32)
    nan_scores = scores.copy()
    nan_scores[3, 2] = np.nan
    with pytest.raises(ValueError, match="scores must be finite"):
        histogram_balancing_update([scores, nan_scores], bias, 1)
    inf_scores = scores.copy()
    inf_scores[0, 0] = np.inf
    with pytest.raises(ValueError, match="scores must be finite"):
        BiasHistogram(bias, 1).add(inf_scores)
    with pytest.raises(ValueError, match=r"block 1 must have shape \[m, 4\].*got \[10, 5\]"):
        histogram_balancing_update([scores, np.zeros((10, 5), np.float32)], bias, 1)
    with pytest.raises(ValueError, match=r"scores must have shape \[m, 4\]"):
        BiasHistogram(bias, 1).add(np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="bins must be >= 1, got 0"):
        histogram_balancing_update([scores], bias, 1, bins=0)
    with pytest.raises(TypeError, match="bins must be an integer"):
        BiasHistogram(bias, 1, bins=10.0)
    with pytest.raises(ValueError, match="top_k must be >= 1, got -1"):
        histogram_balancing_update([scores], bias, -1)
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        BiasHistogram(bias, 0)
    with pytest.raises(ValueError, match="top_k must be <= 4, got 5"):
        BiasHistogram(bias, 5)
    with pytest.raises(ValueError, match="bias must be finite"):
        BiasHistogram(np.array([0.0, np.nan, 0.0, 0.0]), 1)
    with pytest.raises(TypeError, match="bias must be float32 or float64"):
        BiasHistogram(bias.astype(np.float16), 1)
    with pytest.raises(TypeError, match="scores must be a real floating array"):
        BiasHistogram(bias, 1).add(np.ones((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match=r"cutoff must have shape \[10\]"):
        BiasHistogram(bias, 1).add(scores, cutoff=np.zeros(9, np.float32))
    with pytest.raises(TypeError, match="same array library"):
        BiasHistogram(bias, 1).add(array_api_strict.asarray(scores))


def test_failed_block_leaves_the_counts_unchanged():
    scores = router_batch(50, 4, seed=0)
    bias = np.zeros(4, dtype=np.float32)
    h = BiasHistogram(bias, 1, chunk_size=8).add(scores)
    before = h.counts.copy()
    bad = scores.copy()
    bad[-1, -1] = np.nan  # in the last chunk
    with pytest.raises(ValueError, match="finite"):
        h.add(bad)
    np.testing.assert_array_equal(h.counts, before)


def test_merging_histograms_of_different_steps_is_refused():
    a = BiasHistogram(np.zeros(4), 1)
    with pytest.raises(ValueError, match="same bias"):
        a.merge(BiasHistogram(np.array([0.0, 0.0, 0.0, 0.5]), 1))
    with pytest.raises(ValueError, match="same bias"):
        a.merge(BiasHistogram(np.zeros(4), 1, bins=10))
    with pytest.raises(TypeError, match="BiasHistogram"):
        a.merge(np.zeros((4, 1000), np.int64))


# ---------------------------------------------------------------------------
# The worked examples run and keep their claims
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_example_histogram_of_r(tmp_path, capsys):
    result = load_example("20_histogram_of_r").main(["--out", str(tmp_path)])
    assert result["error_over_width"] < 1.0
    assert result["centred_error_over_width"] < 2.0
    assert (tmp_path / "r_histograms.png").stat().st_size > 10_000
    assert "largest |error|" in capsys.readouterr().out


@pytest.mark.slow
def test_example_bins_and_traffic(tmp_path):
    sweeps = load_example("21_bins_and_traffic").main(["--out", str(tmp_path)])["sweeps"]
    for rows in sweeps.values():
        assert all(error <= width + 1e-5 for _, width, error, _ in rows)
        assert rows[-1][2] < rows[0][2] / 100
    assert {p.name for p in tmp_path.iterdir()} == {"error_vs_bins.png", "bytes_vs_tokens.png"}




# ---------------------------------------------------------------------------
# Against the package's exact update (refimpl.balancing)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "k"), [(4096, 32, 4), (4099, 32, 5), (700, 12, 12)])
def test_against_the_exact_quantile_balancing_update(m, n, k):
    from refimpl.balancing import quantile_balancing_update

    scores = router_batch(m, n, seed=3 * m + k)
    bias = balanced_bias(scores, min(k, n - 1))
    h = BiasHistogram(bias, k).add(scores)
    if k < n:
        uncentred = quantile_balancing_update(scores, bias, k, center=False)
        assert np.abs(h.thresholds() - uncentred).max() <= h.width + 1e-5
    exact = quantile_balancing_update(scores, bias, k)
    assert np.abs(h.new_bias() - exact).max() <= 2 * h.width + 1e-5
    if k == n:  # both keep the current bias, centred
        np.testing.assert_allclose(h.new_bias(), exact, atol=1e-7)
    too_few = scores[: -(-n // (n - k)) - 1] if k < n else scores[:0]
    with pytest.raises(ValueError):
        quantile_balancing_update(too_few, bias, k)
    with pytest.raises(ValueError):
        BiasHistogram(bias, k).add(too_few).new_bias()
