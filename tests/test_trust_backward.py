"""Trust in the backward pass: it differentiates the forward that ran, or refuses, whatever the caller does.

Each case below gave wrong gradients, or a crash, on the release before this one:

* a weight changed between the forward and `backward` in a way the weights' fingerprint (a plain sum of the
  bytes as 64-bit words) could not see: doubled (float64), negated, two signs flipped, two experts' matrices
  or two rows swapped. The fingerprint is now `refimpl._lib.fast.fingerprint`, sums by rows and columns;
* a layer read by `load_hf_layer` (packed MXFP4 or dense `ExpertStack`s) crashed in `stable_latent_moe_vjp`;
* without a latent projection the backward read the caller's input array, which the caller may have changed;
* two threads calling the same `backward` wrote the same scratch buffer (the forward's spent workspace);
* `out=` arrays sharing memory with `dscores` were accepted, and the router's gradients came out wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from unittest import mock

import numpy as np
import pytest
from test_backward import all_gradients, benchmark_like_layer, make_layer
from test_fast import on_threads

from refimpl import MoEConfig, init_params, load_hf_layer, save_hf_layer, stable_latent_moe_vjp
from refimpl._lib import fast as _fast
from refimpl.layer.backward import weight_fingerprints
from refimpl.layer.latent_moe import is_packed_stack, stable_latent_moe

CHANGED = r"changed between the forward pass and backward\(\)"


def fingerprint_of(array: np.ndarray):
    """The layer's fingerprint of one weight (`weight_fingerprints`, whatever function it calls)."""
    return weight_fingerprints({"w": array})["w"]


# ---------------------------------------------------------------------------
# 1. A weight changed after the forward is refused, however it changed
# ---------------------------------------------------------------------------

#: The auditor's layer: experts.w1 is [4, 64, 16], 4096 entries (4 experts of 64 rows of 16).
STALE_CONFIG = MoEConfig.tiny(hidden_size=16, latent_size=16, num_experts=4, top_k=2, intermediate_size=64)


def _negate_two(w):
    w.flat[1] *= -1  # two entries at odd positions: each moves the float32 bit sum by 2^63
    w.flat[3] *= -1


def _negate_three(w):
    w.flat[[5, 700, 2001]] *= -1


def _negate_one_expert(w):
    w[2] *= -1


def _double_one_expert(w):
    w[1] *= 2


def _swap_experts(w):
    w[[0, 3]] = w[[3, 0]]


def _swap_rows(w):
    w[1, [5, 40]] = w[1, [40, 5]]


def _one_unit_in_the_last_place(w):
    w.flat[2047] = np.nextafter(w.flat[2047], np.inf)


STACK_CHANGES = {
    "doubled": lambda w: w.__imul__(2),
    "halved": lambda w: w.__imul__(0.5),
    "times 2^-30": lambda w: w.__imul__(2.0 ** -30),
    "times 3": lambda w: w.__imul__(3),
    "negated": lambda w: w.__imul__(-1),
    "two signs flipped": _negate_two,
    "three signs flipped": _negate_three,
    "one expert negated": _negate_one_expert,
    "one expert doubled": _double_one_expert,
    "two experts swapped": _swap_experts,
    "two rows swapped": _swap_rows,
    "one entry by one ulp": _one_unit_in_the_last_place,
}


def _refused(dtype, name: str, change) -> None:
    params = init_params(STALE_CONFIG, 0, dtype=dtype)
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((8, 16)).astype(dtype) for _ in range(2))
    _, backward = stable_latent_moe_vjp(x, params, STALE_CONFIG)
    before = params[name].copy()
    change(params[name])
    assert not np.array_equal(params[name], before)  # the change is real
    with pytest.raises(ValueError, match=rf"params\['{name}'\] {CHANGED}"):
        backward(dy)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("change", list(STACK_CHANGES), ids=list(STACK_CHANGES))
def test_an_expert_stack_changed_after_the_forward_is_refused(dtype, change):
    _refused(dtype, "experts.w1", STACK_CHANGES[change])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["gate.weight", "routed_expert_down_proj.weight",
                                  "shared_experts.down_proj.weight"])
@pytest.mark.parametrize("change", ["negated", "doubled", "two signs flipped"])
def test_any_weight_negated_doubled_or_with_two_signs_flipped_is_refused(dtype, name, change):
    """The auditor's `gate.weight *= -1` (float64) among them: 64 words, each moved by 2^63."""
    _refused(dtype, name, STACK_CHANGES[change])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_unchanged_weight_and_a_change_undone_pass(dtype):
    """The check compares values, not identities: a weight changed and changed back is accepted."""
    params = init_params(STALE_CONFIG, 0, dtype=dtype)
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(dtype)
    _, backward = stable_latent_moe_vjp(x, params, STALE_CONFIG)
    want = backward(x)[0].copy()
    params["experts.w1"] *= -2
    params["experts.w1"] /= -2  # exact: a power of two
    params["gate.weight"] = params["gate.weight"].copy()  # a new array with the same bytes
    np.testing.assert_array_equal(backward(x)[0], want)


# ---------------------------------------------------------------------------
# The fingerprint itself, on arrays of one row, several rows and several blocks
# ---------------------------------------------------------------------------

def _drawn(dtype, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size).astype(dtype)


#: Sizes in entries: shorter than one row of words, a few rows with a short last one, and (with blocks of three
#: rows, below) several blocks.
SIZES = {np.float32: (5, 48, 1200, 6003), np.float64: (5, 48, 600, 3003)}


@pytest.mark.parametrize("rows_per_block", [None, 3], ids=["blocks as shipped", "blocks of 3 rows"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_fingerprint_sees_every_listed_change(dtype, rows_per_block):
    """Each change the fingerprint's docstring promises to see, at drawn places, on every shape of array."""
    rng = np.random.default_rng(7)
    blocks = (contextlib.nullcontext() if rows_per_block is None
              else mock.patch.object(_fast, "FINGERPRINT_ROWS", rows_per_block))
    with blocks:
        for size in SIZES[dtype]:
            w = _drawn(dtype, size, size)
            before = fingerprint_of(w)

            def seen(changed, what, w=w, before=before, size=size):
                assert not np.array_equal(changed, w), what
                assert fingerprint_of(changed) != before, f"{what} unseen in {size} {np.dtype(dtype).name}"

            per_word = 8 // np.dtype(dtype).itemsize
            for start in rng.integers(0, size, 40):
                # Negated parts of every length up to the whole, and the lengths where the proof's cases meet.
                for length in {int(rng.integers(1, size - start + 1)), *(min(size - start, words * per_word)
                                                                        for words in (508, 509, 1017, 1018))}:
                    v = w.copy()
                    v[start:start + length] *= -1
                    seen(v, f"entries {start}:{start + length} negated")
            for j in (1, -1, 2, 12, -20, 32, 64):
                seen(w * dtype(2.0) ** j, f"times 2^{j}")
            for factor in (3.0, 0.999, 1 + 1e-6, -1.0, -2.0):
                seen((w * factor).astype(dtype), f"times {factor}")
            for _ in range(60):
                flips = rng.choice(size, int(rng.integers(1, 4)), replace=False)
                v = w.copy()
                v[flips] *= -1
                seen(v, f"signs of {flips} flipped")
                a, b = rng.choice(size, 2, replace=False)
                v = w.copy()
                v[[a, b]] = v[[b, a]]
                seen(v, f"entries {a} and {b} swapped")
                i = int(rng.integers(size))
                v = w.copy()
                v[i] = np.nextafter(v[i], dtype(np.inf))
                seen(v, f"entry {i} by one ulp")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_fingerprint_sees_rows_and_matrices_swapped_at_any_distance(dtype):
    """Rows of 64 entries swapped 509 rows apart (the same columns of a block) and whole matrices swapped."""
    w = np.random.default_rng(3).standard_normal((8, 128, 64)).astype(dtype)  # 1024 rows of 64 entries
    before = fingerprint_of(w)
    flat_rows = w.reshape(-1, 64)
    for a, b in [(0, 1), (3, 512), (10, 10 + 509), (0, 1023), (5, 5 + 2 * 509)]:
        v = flat_rows.copy()
        v[[a, b]] = v[[b, a]]
        assert fingerprint_of(v.reshape(w.shape)) != before, (a, b)
    for a, b in [(0, 1), (2, 7)]:
        v = w.copy()
        v[[a, b]] = v[[b, a]]
        assert fingerprint_of(v) != before, (a, b)


def test_what_the_fingerprint_cannot_see_is_what_its_docstring_says():
    """Four float64 signs at the corners of a rectangle of one block keep every row and column sum."""
    w = _drawn(np.float64, 4000, 5)
    corners = [100, 100 + 7, 100 + 509 * 2, 100 + 509 * 2 + 7]
    v = w.copy()
    v[corners] *= -1
    assert fingerprint_of(v) == fingerprint_of(w)
    v[corners[0]] *= -1  # three of them: seen
    assert fingerprint_of(v) != fingerprint_of(w)


def test_the_fingerprint_is_the_same_on_any_number_of_threads_and_of_any_layout():
    """Blocks on one or three threads, a non-contiguous array and its copy, a bfloat16 array's last byte."""
    import ml_dtypes

    w = _drawn(np.float32, 20_000, 9)
    with mock.patch.object(_fast, "FINGERPRINT_ROWS", 2):  # 20 blocks
        with on_threads(1):
            alone = _fast.fingerprint(w)
        with on_threads(3):
            assert _fast.fingerprint(w) == alone
    strided = w.reshape(100, 200)[:, ::3]
    assert _fast.fingerprint(strided) == _fast.fingerprint(strided.copy())
    assert _fast.fingerprint(w.reshape(100, 200)) != _fast.fingerprint(w.reshape(200, 100))  # shape counts
    half = w[:1001].astype(ml_dtypes.bfloat16)  # 2002 bytes: the last row of words is two bytes long
    changed = half.copy()
    changed[-1] = -changed[-1]
    assert _fast.fingerprint(changed) != _fast.fingerprint(half)


# ---------------------------------------------------------------------------
# 2. A layer read from a checkpoint: packed MXFP4 and dense ExpertStacks
# ---------------------------------------------------------------------------

K3_CONFIG = MoEConfig.tiny(hidden_size=64, latent_size=32, intermediate_size=32)


def _loaded_layer(tmp_path, mxfp4: bool):
    folder = tmp_path / ("mxfp4" if mxfp4 else "dense")
    save_hf_layer(folder, K3_CONFIG, init_params(K3_CONFIG, 0), mxfp4=mxfp4)
    config, params = load_hf_layer(folder, 1)
    assert is_packed_stack(params["experts.w1"])
    return config, params


def _decoded(params):
    return {name: (np.stack([w[e] for e in range(w.shape[0])]) if is_packed_stack(w) else w)
            for name, w in params.items()}


@pytest.mark.parametrize("mxfp4", [True, False])
def test_a_loaded_layer_gets_the_gradients_of_its_decoded_weights(tmp_path, mxfp4):
    config, params = _loaded_layer(tmp_path, mxfp4)
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((5, 64)).astype(np.float32) for _ in range(2))
    y, backward = stable_latent_moe_vjp(x, params, config)
    dense_y, dense_backward = stable_latent_moe_vjp(x, _decoded(params), config)
    np.testing.assert_array_equal(y, dense_y)
    got, want = all_gradients(*backward(dy)), all_gradients(*dense_backward(dy))
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("mxfp4", [True, False])
def test_a_loaded_stack_replaced_after_the_forward_is_refused(tmp_path, mxfp4):
    """Two experts' stored parts swapped (a new stack in the same params) change its fingerprint."""
    config, params = _loaded_layer(tmp_path, mxfp4)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    _, backward = stable_latent_moe_vjp(x, params, config)
    stack = params["experts.w3"]
    params["experts.w3"] = dataclasses.replace(stack, parts=(stack.parts[1], stack.parts[0], *stack.parts[2:]))
    with pytest.raises(ValueError, match=rf"params\['experts.w3'\] {CHANGED}"):
        backward(x)
    params["experts.w3"] = dataclasses.replace(stack)  # the same parts in a new stack: the same weights
    assert backward(x)[0].shape == x.shape


# ---------------------------------------------------------------------------
# 3. The input changed after the forward, without a latent projection
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("projection", [False, True], ids=["no projection", "projection"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_input_zeroed_after_the_forward_changes_no_gradient(projection, dtype):
    """Without a projection z is x itself; the backward reads the kept copy, not the caller's array."""
    config = (MoEConfig.tiny(latent_size=8, use_latent_projection=False, use_latent_norm=False) if not projection
              else MoEConfig.tiny())
    x, params, dy = make_layer(config, seed=2, m=5)
    params = {name: w.astype(dtype) for name, w in params.items()}
    x, dy = x.astype(dtype), dy.astype(dtype)
    _, untouched = stable_latent_moe_vjp(x.copy(), params, config)
    want = {name: g.copy() for name, g in all_gradients(*untouched(dy)).items()}
    mine = x.copy()
    _, backward = stable_latent_moe_vjp(mine, params, config)
    mine[...] = 0
    got = all_gradients(*backward(dy))
    for name, g in want.items():
        np.testing.assert_array_equal(got[name], g, err_msg=name)


def test_with_a_projection_the_latent_is_the_forwards_own_without_a_copy():
    from refimpl.layer.backward import latent_for_backward

    config = MoEConfig.tiny()
    x, params, _ = make_layer(config, seed=2, m=5)
    fwd = stable_latent_moe(x, params, config, save_for_backward=True)
    assert latent_for_backward(fwd, x.copy(), config) is fwd.z
    plain = MoEConfig.tiny(latent_size=8, use_latent_projection=False, use_latent_norm=False)
    fwd = stable_latent_moe(x, make_layer(plain, seed=2, m=5)[1], plain, save_for_backward=True)
    kept = x.copy()
    assert np.shares_memory(fwd.z, x) and latent_for_backward(fwd, kept, plain) is kept


# ---------------------------------------------------------------------------
# 4. The same backward called from two threads at once
# ---------------------------------------------------------------------------

def test_two_threads_calling_the_same_backward_at_once_get_their_own_answers():
    """Both calls finish writing their scratch rows before either combines them: a shared buffer would show.

    The closure is fresh, so one call may take the forward's spent buffer and the other must not; the
    answers alone come from another closure of the same forward.
    """
    config, params, x, _ = benchmark_like_layer()
    rng = np.random.default_rng(5)
    dys = [rng.standard_normal(x.shape).astype(np.float32) for _ in range(2)]
    _, reference = stable_latent_moe_vjp(x, params, config)
    alone = [{name: g.copy() for name, g in all_gradients(*reference(dy)).items()} for dy in dys]
    _, backward = stable_latent_moe_vjp(x, params, config)
    meet = threading.Barrier(2, timeout=60)
    combine = _fast.combine_in_buffers

    def combine_after_both_wrote(rows, position):
        if rows.shape[1] == config.ell and threading.current_thread() is not threading.main_thread():
            meet.wait()  # the routed backward's latent gradients, one call per thread
        return combine(rows, position)

    results: list = [None, None]

    def call(i: int) -> None:
        results[i] = {name: g.copy() for name, g in all_gradients(*backward(dys[i])).items()}

    with mock.patch.object(_fast, "combine_in_buffers", combine_after_both_wrote), on_threads(1):
        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for i in range(2):
        for name, want in alone[i].items():
            np.testing.assert_array_equal(results[i][name], want, err_msg=f"thread {i}: {name}")


def test_two_threads_calling_the_same_backward_many_times_get_the_answer_of_one_call():
    """The auditor's loop: each dx, in each of 20 calls on each thread, equals the one computed alone."""
    config, params, x, _ = benchmark_like_layer(m=256)
    rng = np.random.default_rng(6)
    dys = [rng.standard_normal(x.shape).astype(np.float32) for _ in range(2)]
    _, backward = stable_latent_moe_vjp(x, params, config)
    want = [backward(dy)[0].copy() for dy in dys]
    wrong = [0, 0]
    start = threading.Barrier(2, timeout=60)

    def run(i: int) -> None:
        start.wait()
        for _ in range(20):
            wrong[i] += not np.array_equal(backward(dys[i])[0], want[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == [0, 0]


def test_the_forwards_workspace_goes_to_one_backward_only():
    """The first call takes the forward's spent buffer (no new memory); later ones get none of it."""
    config, params, x, dy = benchmark_like_layer()
    fwd = stable_latent_moe(x, params, config, save_for_backward=True)
    saved = fwd.routed
    assert saved.workspace is not None
    assert _fast._take_saved_workspace(saved) is saved.workspace
    assert _fast._take_saved_workspace(saved) is None
    again = stable_latent_moe(x, params, config, save_for_backward=True).routed  # a new forward: its own
    assert _fast._take_saved_workspace(again) is again.workspace


# ---------------------------------------------------------------------------
# 5. out= sharing memory with dscores
# ---------------------------------------------------------------------------

def test_out_sharing_memory_with_dscores_is_refused():
    config = MoEConfig.tiny()  # experts.w1 is [6, 6, 4]: 144 entries, room for dscores [5, 6]
    params = init_params(config, 0)
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((5, 8)).astype(np.float32) for _ in range(2))
    dscores = rng.standard_normal((5, 6)).astype(np.float32)
    _, backward = stable_latent_moe_vjp(x, params, config)
    dx_want, grads = backward(dy, dscores=dscores)
    want = {name: g.copy() for name, g in grads.items()}
    out = {name: np.empty_like(g) for name, g in want.items()}
    arena = np.empty(6 * 6 * 4, np.float32)
    out["experts.w1"] = arena.reshape(6, 6, 4)
    shared = arena[:30].reshape(5, 6)
    shared[...] = dscores
    with pytest.raises(ValueError, match=r"out\['experts.w1'\] shares memory with dscores"):
        backward(dy, out=out, dscores=shared)
    np.testing.assert_array_equal(shared, dscores)  # refused before anything was written
    out["experts.w1"] = np.empty((6, 6, 4), np.float32)  # separate arrays: the gradients of the plain call
    dx, written = backward(dy, out=out, dscores=shared)
    np.testing.assert_array_equal(dx, dx_want)
    for name, g in want.items():
        np.testing.assert_array_equal(written[name], g, err_msg=name)
