"""The fast paths of `refimpl._lib.fast`, each held against the readable code it replaces.

Every function of `refimpl._lib.fast` is a NumPy (or CuPy) arrangement of a
computation that a teaching module writes plainly. Each test here runs both
on the same drawn input: the readable one either called directly (a
function of the teaching module that does not dispatch) or with the fast
path switched off (`_fast.ENABLED` set to False), and compares bit for
bit where the operations are the same and to rounding where the order of a
sum or of the operations changes.
"""

from __future__ import annotations

import hashlib
import re
import sys
import warnings
from types import SimpleNamespace
from unittest import mock

import array_api_strict
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl._lib import fast as _fast
from refimpl._lib.xp import to_numpy, topk
from refimpl.balancing import cutoff_values, expert_major_margins, kth_largest
from refimpl.balancing.histogram import BiasHistogram
from refimpl.config import MoEConfig
from refimpl.layer.activations import glu_and_grad, situ_glu, swiglu
from refimpl.layer.backward import routed_experts_backward
from refimpl.layer.latent_moe import combine, dispatch_by_expert, init_params, routed_experts
from refimpl.layer.routing import route, router_scores

#: The readable paths, forced: with the fast paths off every teaching module takes its portable code.
readable = mock.patch.object(_fast, "ENABLED", False)


def on_threads(threads):
    """The loops forced onto `threads` threads of their own (1: in order on the caller's thread)."""
    return mock.patch.object(_fast, "LOOP_THREADS", threads)


def close(have, want, dtype):
    rtol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(have, want, rtol=rtol, atol=rtol * max(1.0, float(np.max(np.abs(want)))))


# ---------------------------------------------------------------------------
# The expert activation
# ---------------------------------------------------------------------------

blocks = st.tuples(st.integers(1, 40), st.integers(1, 9), st.sampled_from(["situ", "swiglu"]),
                   st.sampled_from([25.0, 2.0, None]), st.sampled_from([np.float32, np.float64]),
                   st.integers(0, 2**32 - 1))


def drawn_block(rows, width, dtype, seed):
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((rows, width)) * rng.choice([0.1, 3.0, 40.0]) for _ in range(2))
    return a.astype(dtype), b.astype(dtype)


@given(blocks)
def test_glu_in_place_equals_situ_glu_and_swiglu(block):
    rows, width, activation, linear_beta, dtype, seed = block
    a, b = drawn_block(rows, width, dtype, seed)
    want = situ_glu(a, b, 4.0, linear_beta) if activation == "situ" else swiglu(a, b)
    have = _fast.glu_in_place(a.copy(), b.copy(), activation, 4.0, linear_beta)
    assert have.dtype == dtype
    close(have, want, dtype)


@given(blocks)
def test_glu_and_grad_in_place_and_by_chunks_equal_the_readable_version(block):
    rows, width, activation, linear_beta, dtype, seed = block
    a, b = drawn_block(rows, width, dtype, seed)
    expected = glu_and_grad(a, b, activation, 4.0, linear_beta)
    whole = _fast.glu_and_grad_in_place(a.copy(), b.copy(), activation, 4.0, linear_beta)
    # By row chunks of at most 3 rows, as the layer runs it (a chunk boundary inside the block).
    with mock.patch.object(_fast, "GLU_CHUNK", 3 * width):
        chunked = _fast.glu_and_grad_by_chunks(a.copy(), b.copy(), activation, 4.0, linear_beta)
    for want, have in [*zip(expected, whole, strict=True), *zip(expected, chunked, strict=True)]:
        assert have.dtype == dtype
        # gamma' is a sum whose terms can cancel: either version's last-bit rounding may be amplified.
        close(have, want, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_glu_and_grad_in_place_far_past_the_caps(dtype):
    """cosh overflows to infinity past |u| ~ 89 (float32) or 710: the partials are then 0, with no warning."""
    a = np.array([[-1e4, -800, -400, -100, -30, -1, 0, 1, 30, 100, 400, 800, 1e4, 3e38]], dtype)  # [1, 14]
    b = a[:, ::-1].copy()
    with np.errstate(all="ignore"):
        want = glu_and_grad(a.astype(np.float64), b.astype(np.float64), "situ", 4.0, 25.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        have = _fast.glu_and_grad_in_place(a.copy(), b.copy(), "situ", 4.0, 25.0)
    for h, w in zip(have, want, strict=True):
        assert np.all(np.isfinite(h))
        close(h, w.astype(dtype), dtype)


# ---------------------------------------------------------------------------
# RMSNorm by rows
# ---------------------------------------------------------------------------

@given(st.integers(1, 70), st.integers(1, 9), st.sampled_from([np.float32, np.float64]),
       st.sampled_from([1, 3]), st.integers(0, 2**32 - 1))
@settings(max_examples=40)
def test_rms_norm_by_chunks_is_the_readable_norm(rows, width, dtype, threads, seed):
    """The norm and its backward by chunks of two rows (many chunks, on threads) against the readable code."""
    from refimpl.layer.activations import rms_norm, rms_norm_backward

    rng = np.random.default_rng(seed)
    u, dv = (rng.standard_normal((rows, width)).astype(dtype) * rng.choice([1e-3, 1.0, 50.0]) for _ in range(2))
    gain = rng.standard_normal(width).astype(dtype)
    with readable:
        want, (want_du, want_dg) = rms_norm(u, gain, 1e-5), rms_norm_backward(u, gain, dv, 1e-5)
    with mock.patch.object(_fast, "GLU_CHUNK", 2 * width), on_threads(threads):
        have, (have_du, have_dg) = rms_norm(u, gain, 1e-5), rms_norm_backward(u, gain, dv, 1e-5)
        again = rms_norm_backward(u, gain, dv, 1e-5)[1]
    np.testing.assert_array_equal(have, want)  # the same operations on every entry
    np.testing.assert_array_equal(have_du, want_du)
    # The gain's gradient sums the same m terms per entry in another order: within m units of its rounding.
    terms = np.abs(dv * (u / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + 1e-5)))
    np.testing.assert_array_less(np.abs(have_dg - want_dg),
                                 2 * rows * np.finfo(dtype).eps * np.sum(terms, axis=0) + np.finfo(dtype).tiny)
    with mock.patch.object(_fast, "GLU_CHUNK", 2 * width), on_threads(1):
        np.testing.assert_array_equal(rms_norm_backward(u, gain, dv, 1e-5)[1], again)  # whatever the threads


def test_rms_norm_fast_path_only_takes_numpy_matrices():
    """Stacks, other layouts and other array libraries keep the readable code; the values are the same."""
    from refimpl.layer.activations import rms_norm

    rng = np.random.default_rng(1)
    x, gain = rng.standard_normal((3, 4, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    with readable:
        want = rms_norm(x, gain)
    np.testing.assert_array_equal(rms_norm(x, gain), want)
    np.testing.assert_array_equal(rms_norm(np.asfortranarray(x[0]), gain), want[0])
    np.testing.assert_array_equal(to_numpy(rms_norm(array_api_strict.asarray(x[0]), array_api_strict.asarray(gain))),
                                  want[0])


# ---------------------------------------------------------------------------
# The routed experts
# ---------------------------------------------------------------------------

@st.composite
def routed_cases(draw):
    config = MoEConfig.tiny(
        hidden_size=draw(st.integers(3, 7)), latent_size=3, num_experts=draw(st.integers(3, 7)),
        top_k=draw(st.integers(1, 3)), intermediate_size=draw(st.integers(2, 5)),
        activation=draw(st.sampled_from(["situ", "swiglu"])),
        situ_linear_beta=draw(st.sampled_from([25.0, None])))
    return config, draw(st.integers(0, 2**32 - 1)), draw(st.integers(1, 12)), \
        draw(st.sampled_from([np.float32, np.float64]))


def route_of(config, seed, m, dtype):
    rng = np.random.default_rng(seed)
    p = {name: a.astype(dtype) for name, a in init_params(config, rng, dtype=np.float64, bias_scale=0.3).items()}
    x = rng.standard_normal((m, config.d)).astype(dtype)
    z = rng.standard_normal((m, config.ell)).astype(dtype)
    du = rng.standard_normal((m, config.ell)).astype(dtype)
    index, weights = route(router_scores(x, p["gate.weight"]), p["gate.e_score_correction_bias"], config.k)
    return p, z, du, index, weights.astype(dtype)


@given(routed_cases())
@settings(max_examples=40)
def test_routed_experts_fast_path_equals_the_readable_loop(case):
    """Forward (with and without saving), saved activations and the backward, fast against readable."""
    config, seed, m, dtype = case
    p, z, du, index, weights = route_of(config, seed, m, dtype)
    stacks = p["experts.w1"], p["experts.w3"], p["experts.w2"]
    u_fast = routed_experts(z, index, weights, *stacks, config)
    u_fast_saved, saved_fast = routed_experts(z, index, weights, *stacks, config, save=True)
    with readable:
        u = routed_experts(z, index, weights, *stacks, config)
        u_saved, saved = routed_experts(z, index, weights, *stacks, config, save=True)
        expected = routed_experts_backward(z, saved, *stacks, du)
    close(u_fast, u, dtype)
    close(u_fast_saved, u_saved, dtype)
    assert saved_fast.hidden.keys() == saved.hidden.keys()
    for e, kept in saved.hidden.items():
        for want, have in zip(kept, saved_fast.hidden[e], strict=True):
            close(have, want, dtype)
    got = routed_experts_backward(z, saved_fast, *stacks, du)
    for want, have in zip(expected, got, strict=True):
        assert have.dtype == dtype and have.shape == want.shape
        close(have, want, dtype)


@pytest.mark.parametrize(("block", "threads"), [(1 << 16, 1), (10, 1), (10, 3)])
def test_combine_fast_path_is_the_readable_sum_bit_for_bit(block, threads):
    """Whole, by blocks of two tokens (one left over), and those blocks on three threads: the same sums."""
    rng = np.random.default_rng(4)
    index = np.stack([rng.permutation(9)[:4] for _ in range(11)])  # [11, 4], distinct experts per token
    dispatch = dispatch_by_expert(index, rng.random((11, 4)), 9)
    rows = rng.standard_normal((44, 5))
    with readable:
        want = combine(rows, dispatch)
    with mock.patch.object(_fast, "COMBINE_BLOCK", block), on_threads(threads):
        np.testing.assert_array_equal(_fast.combine_in_buffers(rows, dispatch.position), want)


# ---------------------------------------------------------------------------
# Top-k and order statistics
# ---------------------------------------------------------------------------

@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 7), ties=st.booleans())
def test_topk_fast_path_equals_the_portable_sort(seed, k, ties):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 3, size=(6, 8)).astype(np.float64) if ties else rng.standard_normal((6, 8))
    values, index = _fast.topk_by_partition(x, k)
    strict_values, strict_index = topk(array_api_strict.asarray(x), k)
    np.testing.assert_array_equal(index, to_numpy(strict_index))
    np.testing.assert_array_equal(values, to_numpy(strict_values))


@pytest.mark.parametrize("previous", [False, True])
def test_sampled_selection_equals_sort_on_long_rows(previous):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(6, 5000)).astype(np.float32)
    x[1] = np.round(x[1])  # heavy ties
    x[2] = np.sort(x[2])  # sorted rows: the strided sample is spread evenly
    x[3, ::16] = 100.0  # an unlucky sample: every sampled entry is huge, so the bound keeps too few entries
    x[4] = 0.5  # one value only
    desc = -np.sort(-x, axis=1)
    for r in (2, 40, 301):
        got = _fast.kth_largest_by_sampling(x.copy(), r, previous)
        portable = kth_largest(array_api_strict.asarray(x), r, previous=previous)
        if previous:
            np.testing.assert_array_equal(got[0], desc[:, r - 1])
            np.testing.assert_array_equal(got[1], desc[:, r - 2])
            np.testing.assert_array_equal(got[0], to_numpy(portable[0]))
        else:
            np.testing.assert_array_equal(got, desc[:, r - 1])
            np.testing.assert_array_equal(got, to_numpy(portable))


def test_sampled_selection_when_every_row_is_unlucky():
    x = np.zeros((3, 4096))
    x[:, ::16] = 1.0  # the sample sees only the 256 ones; the bound is 1.0 and keeps 256 < 300 entries
    for previous in (False, True):
        got = _fast.kth_largest_by_sampling(x.copy(), 300, previous)
        np.testing.assert_array_equal(got[0] if previous else got, np.zeros(3))


def test_cupy_selection_with_numpy_standing_in(monkeypatch):
    """`kth_largest_cupy` without a GPU: NumPy's `partition`, which has CuPy's contract, stands in for CuPy's."""
    import sys

    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(partition=np.partition))
    x = np.random.default_rng(3).normal(size=(5, 300))
    desc = -np.sort(-x, axis=1)
    kth, prev = _fast.kth_largest_cupy(x, 17, previous=True)
    np.testing.assert_array_equal(kth, desc[:, 16])
    np.testing.assert_array_equal(prev, desc[:, 15])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blocked_cutoffs_and_margins_equal_the_whole_array_computation(dtype, monkeypatch):
    """More tokens than one block of each: the blocked passes give exactly the unblocked values."""
    rng = np.random.default_rng(9)
    m, n, k = 2 * _fast.CUTOFF_BLOCK + 37, 12, 3
    s = rng.random((m, n)).astype(dtype)
    b = (0.1 * rng.standard_normal(n)).astype(dtype)
    alpha, kappa = _fast.cutoffs_by_blocks(s, b, k, with_kth=True)
    strict = array_api_strict.asarray
    want_alpha, want_kappa = cutoff_values(strict(s), strict(b), k, with_kth=True)
    np.testing.assert_array_equal(alpha, to_numpy(want_alpha))
    np.testing.assert_array_equal(kappa, to_numpy(want_kappa))
    margins_t = _fast.expert_major_margins_by_blocks(s, alpha, b, kappa)
    want = expert_major_margins(strict(s), strict(alpha), bias=strict(b), kappa=strict(kappa))
    np.testing.assert_array_equal(margins_t, to_numpy(want))


def test_histogram_count_equals_the_portable_scatter_add():
    rng = np.random.default_rng(12)
    s = rng.random((700, 9))
    bias = 0.2 * rng.standard_normal(9)
    fast = BiasHistogram(bias, 2, bins=50).add(s)
    portable = BiasHistogram(array_api_strict.asarray(bias), 2, bins=50).add(array_api_strict.asarray(s))
    np.testing.assert_array_equal(fast.counts, to_numpy(portable.counts))


# ---------------------------------------------------------------------------
# The pool of workspaces
# ---------------------------------------------------------------------------

def test_pool_hands_out_an_array_again_only_once_nothing_refers_to_it():
    """Held, viewed or wrapped arrays are never handed out; dropped ones are, by kind; the bounds hold."""
    pool = _fast.WorkspacePool(keep=2, kinds=2)
    a = pool.empty((3, 4), np.float32)
    b = pool.empty((3, 4), np.float32)
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.flags.c_contiguous
    assert not np.shares_memory(a, b)
    view, window = a[1:], memoryview(b)
    del a, b
    assert pool.held_bytes() == 0  # a view holds a, a memoryview holds b
    c = pool.empty((3, 4), np.float32)
    assert not np.shares_memory(c, view) and not np.shares_memory(c, np.asarray(window))
    assert len(pool._arrays[((3, 4), "<f4")]) == 2  # keep=2: the third made it forget the first (a)
    del view, window, c
    assert pool.held_bytes() == 2 * 3 * 4 * 4  # b and c; a is gone with its view
    wide = pool.empty((3, 4), np.float64)
    assert wide.dtype == np.float64 and pool.held_bytes() == 2 * 3 * 4 * 4  # another kind, made new
    assert pool.release() == 2 * 3 * 4 * 4 and pool.held_bytes() == 0
    kept = [pool.empty((size,), np.float32) for size in (1, 2, 3)]
    assert len(pool._arrays) == 2 and ((1,), "<f4") not in pool._arrays  # kinds=2: the oldest kind forgotten
    assert [k.shape for k in kept] == [(1,), (2,), (3,)]


def test_pool_reuses_the_memory_of_a_dropped_array():
    pool = _fast.WorkspacePool()
    a = pool.empty((5,), np.float64)
    address = a.__array_interface__["data"][0]
    del a
    assert pool.empty((5,), np.float64).__array_interface__["data"][0] == address


def test_pool_without_exact_reference_counts_makes_new_arrays():
    pool = _fast.WorkspacePool()
    pool._exact = False  # what a free-threaded interpreter gets
    pool.empty((5,), np.float64)  # dropped at once
    b = pool.empty((5,), np.float64)
    assert pool.held_bytes() == 0 and b.shape == (5,) and not pool._arrays


# ---------------------------------------------------------------------------
# The weights' fingerprints
# ---------------------------------------------------------------------------

def fingerprint_by_hand(value, columns=_fast.FINGERPRINT_COLUMNS, rows_per_block=_fast.FINGERPRINT_ROWS):
    """`fingerprint` in Python integers: rows of `columns` little words, blocks of `rows_per_block` rows, each
    block's column and row sums modulo 2**64 hashed, then the blocks' hashes with the dtype and shape."""
    raw = np.ascontiguousarray(value).tobytes()
    row_bytes = 8 * columns
    raw += bytes(-len(raw) % row_bytes)  # zero bytes pad the last row
    rows = [[int.from_bytes(raw[r + 8 * c:r + 8 * c + 8], sys.byteorder) for c in range(columns)]
            for r in range(0, len(raw), row_bytes)]
    whole = hashlib.sha256(f"{np.dtype(value.dtype).str} {tuple(value.shape)}".encode())
    for start in range(0, len(rows), rows_per_block):
        block = rows[start:start + rows_per_block]
        column_sums = [sum(row[c] for row in block) % 2**64 for c in range(columns)]
        row_sums = [sum(row) % 2**64 for row in block]
        digest = hashlib.sha256(np.array(column_sums, dtype=np.uint64).tobytes())
        digest.update(np.array(row_sums, dtype=np.uint64).tobytes())
        whole.update(digest.digest())
    return whole.digest()


@pytest.mark.parametrize("value", [
    np.arange(7, dtype=np.float32) - 3.5,  # 28 bytes: one padded row
    np.linspace(-1, 1, 12).reshape(3, 4)[:, ::2],  # not contiguous
    np.full(5, -1.0, dtype=np.float64),  # every word large: the sums wrap around
    np.arange(9, dtype=np.float32).astype(ml_dtypes.bfloat16),
    np.zeros(0, dtype=np.float32),
])
def test_fingerprint_is_the_hash_of_the_row_and_column_sums(value):
    assert _fast.fingerprint(value) == fingerprint_by_hand(value)


def test_fingerprint_moves_with_the_smallest_change_and_not_with_the_thread_count():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 330)).astype(np.float32)  # 21120 entries: 10560 words, 21 rows of 509
    with mock.patch.object(_fast, "FINGERPRINT_ROWS", 2), on_threads(1):  # 11 blocks in order
        in_order = _fast.fingerprint(w)
    with mock.patch.object(_fast, "FINGERPRINT_ROWS", 2), on_threads(3):  # the same blocks on three threads
        assert _fast.fingerprint(w) == in_order == fingerprint_by_hand(w, rows_per_block=2)
        w.flat[1000] = np.nextafter(w.flat[1000], np.float32(np.inf))  # one entry, by one unit in the last place
        assert _fast.fingerprint(w) != in_order


# ---------------------------------------------------------------------------
# The input's gradient as one product
# ---------------------------------------------------------------------------

@given(st.integers(0, 2), st.sampled_from([np.float32, np.float64]), st.integers(1, 30),
       st.integers(0, 2**32 - 1))
@settings(max_examples=20)
def test_input_backward_in_one_product_equals_the_readable_stages(shared_experts, dtype, m, seed):
    """`router_and_input_backward` with the fused product against its readable code: x_bar and every gradient."""
    from refimpl.layer.backward import router_and_input_backward
    from refimpl.layer.latent_moe import stable_latent_moe

    config = MoEConfig.small(hidden_size=24, latent_size=12, num_experts=6, top_k=2, intermediate_size=8,
                             num_shared_experts=shared_experts)
    rng = np.random.default_rng(seed)
    params = init_params(config, rng, dtype=dtype)
    x = rng.standard_normal((m, config.d)).astype(dtype)
    y_bar = rng.standard_normal((m, config.d)).astype(dtype)
    p_bar = rng.standard_normal((m, config.k)).astype(dtype)
    z_bar = rng.standard_normal((m, config.ell)).astype(dtype)
    fwd = stable_latent_moe(x, params, config, save_for_backward=True)

    def run():
        return router_and_input_backward(x, y_bar, fwd.scores, fwd.index, fwd.kept, p_bar, z_bar, fwd.shared,
                                         lambda name: params[name], params, config)

    x_bar, grads = run()
    with readable:
        x_bar_want, want = run()
    close(x_bar, x_bar_want, dtype)
    assert grads.keys() == want.keys()
    for name, g in want.items():
        assert grads[name].dtype == g.dtype and grads[name].shape == g.shape, name
        if g.size:  # without shared experts their gradients are empty
            close(grads[name], g, dtype)


# ---------------------------------------------------------------------------
# The loops on several threads
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_expert_loops_give_the_same_values_on_one_and_on_three_threads(dtype):
    """Forward, saved activations and backward of the routed experts: each expert's products are the same calls."""
    config = MoEConfig.tiny(hidden_size=6, latent_size=5, num_experts=11, top_k=3, intermediate_size=7)
    p, z, du, index, weights = route_of(config, 5, 40, dtype)
    stacks = p["experts.w1"], p["experts.w3"], p["experts.w2"]
    results = []
    for threads in (1, 3):
        with on_threads(threads):
            u, saved = routed_experts(z, index, weights, *stacks, config, save=True)
            results.append([u, *routed_experts_backward(z, saved, *stacks, du)])
    # On one thread the products may run on the BLAS's own threads, which can sum in another order.
    for have, want in zip(*results, strict=True):
        close(have, want, dtype)


@pytest.mark.parametrize("activation", ["situ", "swiglu", "relu2"])
def test_activation_chunks_on_threads_are_the_whole_block_bit_for_bit(activation):
    """Every entry goes through the same operations whatever its chunk and thread."""
    a, b = drawn_block(64, 5, np.float32, 3)
    whole = _fast.glu_in_place(a.copy(), b.copy(), activation, 4.0, 2.0)
    whole_grad = _fast.glu_and_grad_in_place(a.copy(), b.copy(), activation, 4.0, 2.0)
    with mock.patch.object(_fast, "GLU_CHUNK", 2 * 5), on_threads(3):  # 32 chunks of two rows, on three threads
        assert len(_fast._row_chunks(a)) >= _fast.THREADED_CHUNKS
        np.testing.assert_array_equal(_fast.glu_by_chunks(a.copy(), b.copy(), activation, 4.0, 2.0), whole)
        for have, want in zip(_fast.glu_and_grad_by_chunks(a.copy(), b.copy(), activation, 4.0, 2.0), whole_grad,
                              strict=True):
            np.testing.assert_array_equal(have, want)


def test_tasks_run_on_as_many_threads_as_asked_at_once():
    """Three tasks that each wait for the other two finish only if three threads run them together."""
    import threading

    barrier, seen = threading.Barrier(3, timeout=60), set()

    def work(task, buffers):
        seen.add((task, threading.get_ident(), id(buffers)))
        barrier.wait()

    with on_threads(3):
        _fast.for_each_on_threads([0, 1, 2], work, buffers=lambda: [])
    assert {task for task, _, _ in seen} == {0, 1, 2}
    assert len({thread for _, thread, _ in seen}) == 3 and len({buf for _, _, buf in seen}) == 3


def test_the_blas_runs_on_one_thread_inside_the_loops_and_as_before_after():
    from threadpoolctl import threadpool_limits

    libraries = _fast._BLAS.libraries()
    if not libraries:
        pytest.skip("threadpoolctl sees no BLAS in this NumPy")
    inside = []
    with threadpool_limits(limits=2, user_api="blas"), on_threads(2):
        before = [lib.num_threads for lib in libraries]
        _fast.for_each_on_threads(list(range(6)), lambda task, _: inside.append([lib.num_threads for lib in libraries]))
        assert [lib.num_threads for lib in libraries] == before
    assert inside and all(counts == [1] * len(libraries) for counts in inside)


def test_loop_threads_follow_the_blas_unless_set():
    from threadpoolctl import threadpool_limits

    if not _fast._BLAS.libraries():
        pytest.skip("threadpoolctl sees no BLAS in this NumPy")
    with on_threads(None):
        with threadpool_limits(limits=1, user_api="blas"):
            assert _fast.loop_threads(10) == 1
        with threadpool_limits(limits=2, user_api="blas"):
            assert _fast.loop_threads(10) == min(2, _fast._BLAS.count()) and _fast.loop_threads(1) == 1
    with on_threads(5):
        assert _fast.loop_threads(3) == 3 and _fast.loop_threads(10) == 5



def product_bound(a, b):
    r"""The classical bound on a float product's error: $|\hat c - c| \le \gamma_k\,|a|\,|b|$, $\gamma_k = k u/(1 - k u)$."""
    k, unit = a.shape[1], np.finfo(a.dtype).eps / 2
    return k * unit / (1 - k * unit) * (np.abs(a).astype(np.longdouble) @ np.abs(b).astype(np.longdouble))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("m", "k", "n", "split"), [(300, 64, 40, "rows"), (40, 64, 300, "columns"),
                                                    (200, 7, 130, "rows"), (5, 9, 4, None)])
def test_matmul_shares_its_rows_or_columns_among_threads_and_is_the_product(dtype, m, k, n, split):
    """Each block is one product of the BLAS on one thread, written into its part: the whole is `a @ b`."""
    rng = np.random.default_rng(m * n + k)
    a, b = (rng.standard_normal(shape).astype(dtype) for shape in ((m, k), (k, n)))
    exact = a.astype(np.longdouble) @ b.astype(np.longdouble)  # [m, n], to within long double's rounding
    tasks, run = [], _fast.for_each_on_threads

    def spy(blocks, work, *rest):
        tasks.append(blocks)
        run(blocks, work, *rest)

    with mock.patch.object(_fast, "for_each_on_threads", spy), on_threads(3), \
            mock.patch.object(_fast, "THREADED_PRODUCT", 1 if split else 10**9):
        have = _fast.matmul(a, b)
        have_transposed = _fast.matmul(b.T, a.T)  # strided operands: the BLAS reads them transposed
    assert have.dtype == dtype and have.shape == (m, n)
    np.testing.assert_array_less(np.abs(have - exact), product_bound(a, b) + np.finfo(dtype).tiny)
    np.testing.assert_array_less(np.abs(have_transposed - exact.T), product_bound(b.T, a.T) + np.finfo(dtype).tiny)
    if split is None:
        assert tasks == []
        return
    blocks = tasks[0]
    size = m if split == "rows" else n
    assert 1 < len(blocks) <= 3 and blocks[0].start == 0 and blocks[-1].stop == size
    assert all(one.stop == two.start and (one.stop - one.start) % 16 == 0
               for one, two in zip(blocks[:-1], blocks[1:], strict=True))



@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_product_s_result_comes_from_the_pool_and_stays_the_caller_s(threads):
    """A result still held is never handed out again; once let go of, its memory serves the next product."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((256, 64)).astype(np.float32), rng.standard_normal((64, 256)).astype(np.float32)
    pool = _fast.WorkspacePool()
    with mock.patch.object(_fast, "WORKSPACES", pool), on_threads(threads), \
            mock.patch.object(_fast, "THREADED_PRODUCT", 1):
        first = _fast.matmul(a, b)
        second = _fast.matmul(2 * a, b)
        assert not np.shares_memory(first, second)
        np.testing.assert_array_equal(first, a @ b)  # not overwritten by the second product
        address = first.__array_interface__["data"][0]
        del first
        third = _fast.matmul(a, b)
        assert third.__array_interface__["data"][0] == address
        with mock.patch.object(_fast, "POOLED_PRODUCT", third.nbytes + 1):  # a smaller result: a new array
            assert _fast.matmul(a, b).__array_interface__["data"][0] not in {
                address, second.__array_interface__["data"][0]}

def _matmul_warnings(calls):
    """The RuntimeWarnings `calls()` raises, as text (every one recorded, none shown)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("split", [False, True])
def test_matmul_ignores_the_invalid_flag_but_keeps_the_nan_and_the_overflow_warning(split):
    """The BLAS's "invalid" flag is not reported (some OpenBLAS builds leave it after finite products), the result is.

    inf times 0 is a NaN in the result whether or not NumPy warns; an overflow of finite operands still warns.
    """
    a = np.ones((4, 3), dtype=np.float32)
    a[1, 0] = np.inf  # row 1 meets a zero below: inf * 0
    b = np.ones((3, 5), dtype=np.float32)
    b[0, 2] = 0.0
    with on_threads(2 if split else 1), mock.patch.object(_fast, "THREADED_PRODUCT", 1 if split else 10**9):
        assert _matmul_warnings(lambda: _fast.matmul(a, b)) == []
        got = _fast.matmul(a, b)
        assert np.isnan(got[1, 2]) and np.isinf(got[1, 0]) and np.isfinite(np.delete(got, 1, axis=0)).all()
        huge = np.full((2, 2), 3e38, dtype=np.float32)  # 3e38 * 3e38: no float32 holds it
        assert any("overflow" in text for text in _matmul_warnings(lambda: _fast.matmul(huge, huge)))


@pytest.mark.parametrize("threads", [1, 3])
def test_routed_expert_loops_ignore_the_invalid_flag_and_keep_the_nan(threads):
    """A latent entry at infinity meets a zero weight: NaN in that token's output and gradients, and no warning."""
    config = MoEConfig.small(hidden_size=16, latent_size=8, num_experts=4, top_k=2, intermediate_size=6)
    p, z, du, index, weights = route_of(config, 3, 7, np.float32)
    stacks = [p["experts.w1"].copy(), p["experts.w3"].copy(), p["experts.w2"]]
    stacks[0][:, :, 0] = 0.0  # every expert's gate and up rows ignore latent entry 0 ...
    stacks[1][:, :, 0] = 0.0
    z[2, 0] = np.inf  # ... which is infinite for token 2: inf * 0 in both products
    with on_threads(threads):
        seen = _matmul_warnings(lambda: routed_experts(z, index, weights, *stacks, config, save=True))
        u, saved = routed_experts(z, index, weights, *stacks, config, save=True)
        seen += _matmul_warnings(lambda: routed_experts_backward(z, saved, *stacks, du))
        dz = routed_experts_backward(z, saved, *stacks, du)[0]
    assert [text for text in seen if "invalid" in text] == []
    assert np.isnan(u[2]).all() and np.isfinite(np.delete(u, 2, axis=0)).all()
    assert np.isnan(dz[2]).any()


@pytest.mark.parametrize("threads", [1, 3])
def test_routed_backward_warns_of_an_invalid_step_between_its_products_as_the_readable_loop_does(threads):
    """Only the products' "invalid" flag is ignored: inf times a zero weight in the steps between them still warns.

    Token 0's first slot carries a routing weight of exactly 0 and a saved hidden activation at infinity, so
    both loops form 0 * inf for it outside any product (the weighted activation of the down-projection's
    gradient), and the readable loop's NumPy warns of it; the fast loop must too, and give the same NaN where
    it lands.
    """
    config = MoEConfig.small(hidden_size=16, latent_size=8, num_experts=4, top_k=2, intermediate_size=6)
    p, z, du, index, weights = route_of(config, 5, 7, np.float32)
    weights[0, 0] = 0.0
    stacks = p["experts.w1"], p["experts.w3"], p["experts.w2"]
    with readable:
        _, saved = routed_experts(z, index, weights, *stacks, config, save=True)
    dispatch = saved.dispatch
    slot = int(dispatch.position[0, 0])  # token 0's first slot, in expert order
    expert = int(index[0, 0])
    saved.hidden[expert][0][slot - int(dispatch.start[expert])] = np.inf  # h of that slot
    results = []
    with readable:
        seen_readable = _matmul_warnings(lambda: results.append(routed_experts_backward(z, saved, *stacks, du)))
    with on_threads(threads):
        seen_fast = _matmul_warnings(lambda: results.append(routed_experts_backward(z, saved, *stacks, du)))
    expected, got = results
    assert any("invalid value encountered in multiply" in text for text in seen_readable)
    assert any("invalid value encountered in multiply" in text for text in seen_fast), seen_fast
    for have, want in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.isnan(have), np.isnan(want))  # the NaN lands in the same entries


def test_matmul_leaves_everything_but_two_numpy_matrices_to_the_operator():
    a = np.arange(6.0).reshape(2, 3)
    with on_threads(2), mock.patch.object(_fast, "THREADED_PRODUCT", 1):
        assert _fast.matmul(a, np.arange(3.0)).tolist() == (a @ np.arange(3.0)).tolist()  # a vector
        strict = array_api_strict.asarray(a)
        assert to_numpy(_fast.matmul(strict, strict.T)).tolist() == (a @ a.T).tolist()
        with pytest.raises(ValueError, match="matmul"):  # NumPy's own message for operands that do not fit
            _fast.matmul(a, a)


def test_on_own_threads_holds_the_blas_at_one_thread_for_the_whole_call():
    """Inside, the BLAS is on one thread and the loops keep the caller's count; after (even after an error), as before."""
    from threadpoolctl import threadpool_limits

    libraries = _fast._BLAS.libraries()
    if not libraries:
        pytest.skip("threadpoolctl sees no BLAS in this NumPy")
    seen = {}

    @_fast.on_own_threads
    def inside(x, fail=False):
        seen["blas"], seen["loops"] = [lib.num_threads for lib in libraries], _fast.loop_threads(10)
        if fail:
            raise RuntimeError("inside failed")
        return "done"

    large, small = np.zeros(_fast.HELD_FROM, np.float32), np.zeros(_fast.HELD_FROM - 1, np.float32)
    with threadpool_limits(limits=2, user_api="blas"):
        before = [lib.num_threads for lib in libraries]
        with on_threads(None):
            assert inside(large) == "done"
            assert seen == {"blas": [1] * len(libraries), "loops": min(2, max(before))}
            with pytest.raises(RuntimeError, match="inside failed"):
                inside(large, fail=True)
            assert [lib.num_threads for lib in libraries] == before and _fast._BLAS._active == 0
            inside(small)  # a small call keeps the BLAS's threads
            assert seen["blas"] == before
        with on_threads(1):  # the products then run on the BLAS's own threads: it keeps them
            inside(large)
            assert seen == {"blas": before, "loops": 1}
        with readable:
            inside(large)
            assert seen["blas"] == before


def test_a_layer_step_runs_its_products_with_the_blas_on_one_thread():
    """The layer's forward and backward never hand a product to the BLAS's threads when the loops have threads."""
    from threadpoolctl import threadpool_limits

    from refimpl.layer import backward as backward_module
    from refimpl.layer import latent_moe as layer_module

    libraries = _fast._BLAS.libraries()
    if not libraries:
        pytest.skip("threadpoolctl sees no BLAS in this NumPy")
    counts = []

    def counted(a, b):
        counts.append(max(lib.num_threads for lib in libraries))
        return _fast.matmul(a, b)

    config = MoEConfig.tiny()
    rng = np.random.default_rng(0)
    params = init_params(config, rng, dtype=np.float32)
    x, dy = (rng.standard_normal((24, config.d)).astype(np.float32) for _ in range(2))
    with threadpool_limits(limits=2, user_api="blas"), on_threads(None), mock.patch.object(_fast, "HELD_FROM", 1), \
            mock.patch.object(layer_module, "matmul", counted), mock.patch.object(backward_module, "matmul", counted):
        from refimpl.layer.backward import stable_latent_moe_vjp

        _, step_backward = stable_latent_moe_vjp(x, params, config)
        step_backward(dy)
    assert len(counts) >= 5 and set(counts) == {1}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_step_with_its_products_on_threads_is_the_step_on_one_thread(dtype):
    from refimpl.layer.backward import stable_latent_moe_vjp

    config = MoEConfig.tiny(hidden_size=40, latent_size=24, num_experts=6, top_k=2, intermediate_size=20)
    rng = np.random.default_rng(5)
    params = init_params(config, rng, dtype=dtype)
    x, dy = (rng.standard_normal((70, config.d)).astype(dtype) for _ in range(2))
    results = []
    for threads in (1, 3):
        with on_threads(threads), mock.patch.object(_fast, "THREADED_PRODUCT", 1):
            y, step_backward = stable_latent_moe_vjp(x, params, config)
            dx, grads = step_backward(dy)
            results.append([y, dx, *grads.values()])
    for have, want in zip(*results, strict=True):
        close(have, want, dtype)

def test_an_error_in_one_task_is_raised_once_every_thread_has_stopped():
    import threading
    import time

    ran, lock = [], threading.Lock()

    def work(task, _):
        if task == 4:
            raise ValueError("task 4 failed")
        time.sleep(0.005)  # a task of some length: the failing thread gets its turn while the others wait
        with lock:
            ran.append(task)

    libraries = _fast._BLAS.libraries()
    before = [lib.num_threads for lib in libraries]
    with on_threads(3), pytest.raises(ValueError, match="task 4 failed"):
        _fast.for_each_on_threads(list(range(200)), work)
    assert len(ran) == len(set(ran)) and 4 not in ran and len(ran) < 100  # the others stopped early
    assert [lib.num_threads for lib in libraries] == before and _fast._BLAS._active == 0
    with on_threads(3):  # the pool is still usable
        _fast.for_each_on_threads(list(range(5)), lambda task, _: None)


def test_a_loop_inside_a_task_runs_in_order_on_that_task_s_thread():
    import threading

    threads = {}

    def inner(task, _):
        threads.setdefault(task[0], set()).add(threading.get_ident())
        assert _fast.loop_threads(10) == 1

    def outer(task, _):
        _fast.for_each_on_threads([(task, i) for i in range(20)], inner)

    with on_threads(2):
        _fast.for_each_on_threads([0, 1, 2, 3], outer)
    assert sorted(threads) == [0, 1, 2, 3] and all(len(ids) == 1 for ids in threads.values())


def _loop_in_a_forked_child() -> list[int]:
    import threading

    done, lock = [], threading.Lock()

    def work(task, _):
        with lock:
            done.append(task)

    with on_threads(2):
        _fast.for_each_on_threads(list(range(8)), work)
    return sorted(done)


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="no fork here")
def test_a_forked_child_runs_loops_on_threads_of_its_own():
    """The parent's pool has no threads in a child made by fork: the child must make its own, not wait forever."""
    import multiprocessing
    import threading

    all_three = threading.Barrier(3, timeout=60)
    with on_threads(3):  # the caller and two threads of the pool, which stay idle once the loop is over
        _fast.for_each_on_threads([0, 1, 2], lambda task, _: all_three.wait())
    assert _fast._WORKERS["pool"] is not None and len(_fast._WORKERS["pool"]._threads) >= 2
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(_loop_in_a_forked_child).get(timeout=60) == list(range(8))


@pytest.mark.parametrize("threads", [0, -2, 2.0, "2", True])
def test_a_thread_count_that_is_not_a_positive_integer_is_refused(threads):
    with on_threads(threads), pytest.raises(ValueError, match=r"LOOP_THREADS must be None .* or a positive integer, "
                                                              rf"got {re.escape(repr(threads))}"):
        _fast.for_each_on_threads([0, 1], lambda task, _: None)


@pytest.mark.parametrize("bad", ["shape", "dtype", "layout", "read-only", "type"])
def test_a_gate_partial_buffer_that_does_not_fit_is_refused(bad):
    """`expert_glu_and_grad(..., d_gate_out=)` writes into the buffer it is given, or says why it cannot."""
    from refimpl.layer.activations import expert_glu_and_grad

    config = MoEConfig.tiny()
    a, b = drawn_block(6, 4, np.float32, 1)
    buffer = {"shape": np.empty((6, 5), np.float32), "dtype": np.empty((6, 4), np.float64),
              "layout": np.empty((4, 6), np.float32).T, "read-only": np.empty((6, 4), np.float32),
              "type": [[0.0] * 4] * 6}[bad]
    if bad == "read-only":
        buffer.flags.writeable = False
    with pytest.raises(ValueError, match=r"d_gate_out\) must be a writeable C-contiguous NumPy array of shape "
                                         r"\[6, 4\] and dtype float32, got (an array of|a list)"):
        expert_glu_and_grad(a.copy(), b.copy(), config, d_gate_out=buffer)
    fits = np.empty((6, 4), np.float32)
    h, d_gate, d_up = expert_glu_and_grad(a.copy(), b.copy(), config, d_gate_out=fits)
    assert d_gate is fits
    close(fits, glu_and_grad(a, b, config.activation, config.situ_beta, config.situ_linear_beta)[1], np.float32)
