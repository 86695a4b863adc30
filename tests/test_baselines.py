"""The other routers and balancers: capacity, Switch's and DeepSeek's losses, hash routing, score functions.

Each rule is compared with an independent computation: the textbook sketch's
own loops (transcribed with PyTorch for its own case, and as plain Python
loops for Hypothesis), closed forms, SciPy, and PyTorch autograd for the
hand-written gradients.
"""

from __future__ import annotations

import math
from fractions import Fraction

import array_api_strict
import numpy as np
import pytest
import scipy.special
import torch
from hypothesis import given
from hypothesis import strategies as st

from refimpl import (
    MoEConfig,
    capacity_keep,
    expert_capacity,
    expert_load,
    hash_route,
    init_params,
    route,
    route_by_hash,
    router_scores,
    score_function_vjp,
    sequence_balance_loss,
    sequence_balance_loss_grad,
    softplus,
    stable_latent_moe,
    stable_latent_moe_reference,
    switch_balance_loss,
    switch_balance_loss_grad,
)
from refimpl._lib.xp import to_numpy


def _reference_hash(token_id: int, n: int, k: int, seed: int = 0) -> list[int]:
    """Hash routing by hand, with Python integers: the `k` experts of largest splitmix64 key."""
    mask = 2**64 - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    v = mix(token_id + (seed << 32))
    key = [mix((v + (e + 1) * 0x9E3779B97F4A7C15) & mask) >> 1 for e in range(n)]
    return sorted(range(n), key=lambda e: (-key[e], e))[:k]


# ---------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------


def sketch_sparse_moe(x, router, experts, top_k=2, capacity=None):
    """The teaching sketch `sparse_moe`, transcribed line for line (PyTorch, loops over slots and experts)."""
    score, index = torch.nn.functional.linear(x, router).float().topk(top_k, dim=-1)
    gate = score.softmax(-1).to(x.dtype)
    output, load = torch.zeros_like(x), torch.zeros(experts.shape[0], dtype=torch.long)
    kept = torch.zeros_like(index, dtype=torch.bool)
    for slot in range(top_k):
        for expert_id, expert in enumerate(experts):
            token = torch.where(index[:, slot] == expert_id)[0]
            if capacity is not None:
                token = token[:max(capacity - load[expert_id].item(), 0)]
            if token.numel():
                output[token] += gate[token, slot, None] * torch.nn.functional.linear(x[token], expert)
                load[expert_id] += token.numel()
                kept[token, slot] = True
    return output, load, index, kept


def naive_capacity_keep(index: np.ndarray, n: int, capacity: int) -> np.ndarray:
    """The sketch's rule with plain loops: slot by slot, token by token, a running load per expert."""
    m, k = index.shape
    kept = np.zeros((m, k), dtype=bool)
    load = [0] * n
    for r in range(k):
        for i in range(m):
            e = int(index[i, r])
            if load[e] < capacity:
                kept[i, r] = True
                load[e] += 1
    return kept


@st.composite
def routes(draw, max_tokens=12, max_experts=6):
    """`index` [m, k] with distinct experts per row (shrinks towards crowded low ids), and n."""
    n = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, n))
    m = draw(st.integers(1, max_tokens))
    rows = draw(st.lists(st.permutations(range(n)), min_size=m, max_size=m))
    return np.array([row[:k] for row in rows], dtype=np.int64).reshape(m, k), n


# ---------------------------------------------------------------------------
# The sketch's own case
# ---------------------------------------------------------------------------


def test_sketch_case_as_the_sketch_runs_it():
    """The sketch's own asserts, on its own PyTorch code: kept [[T, F], [F, F], [T, F]] and loads [1, 1]."""
    x = torch.tensor([[3.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    _, load, _, kept = sketch_sparse_moe(x, torch.eye(2), torch.eye(2).repeat(2, 1, 1), top_k=2, capacity=1)
    assert kept.tolist() == [[True, False], [False, False], [True, False]]
    assert load.tolist() == [1, 1]


def test_sketch_case_with_refimpl(xp):
    """The same case through `router_scores` (softmax), `route` and `capacity_keep`, on every backend."""
    x = xp.asarray([[3.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    scores = router_scores(x, xp.eye(2), "softmax")
    index, weights = route(scores, xp.zeros(2), 2)
    kept = capacity_keep(index, 2, 1)
    assert to_numpy(kept).tolist() == [[True, False], [False, False], [True, False]]
    assert to_numpy(expert_load(to_numpy(index)[to_numpy(kept)], 2)).tolist() == [1, 1]
    # The weights are the softmax over the chosen logits, as the sketch's `score.softmax(-1)`.
    expected = scipy.special.softmax(np.array([[3.0, 0.0], [2.0, 0.0], [3.0, 0.0]]), axis=1)
    np.testing.assert_allclose(to_numpy(weights), expected, rtol=1e-6)


def test_sketch_output_matches_a_capacity_layer():
    """The sketch's output equals the gates times `kept` (not renormalized) times the expert outputs."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 4)).astype(np.float32)
    router, experts = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 4, 4)).astype(np.float32)
    out, load, index, kept = sketch_sparse_moe(torch.from_numpy(x), torch.from_numpy(router),
                                               torch.from_numpy(experts), top_k=2, capacity=2)
    logits = x.astype(np.float64) @ router.T.astype(np.float64)
    ours_index, gates = route(logits, np.zeros(5), 2, renormalize=False)
    gates = scipy.special.softmax(np.take_along_axis(logits, ours_index, axis=1), axis=1)
    ours_kept = capacity_keep(ours_index, 5, 2)
    np.testing.assert_array_equal(ours_index, index.numpy())
    np.testing.assert_array_equal(ours_kept, kept.numpy())
    expected = sum((gates[:, r] * ours_kept[:, r])[:, None] * np.einsum("mij,mj->mi", experts[ours_index[:, r]], x)
                   for r in range(2))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(load.numpy(), np.bincount(ours_index[ours_kept], minlength=5))


# ---------------------------------------------------------------------------
# Capacity: properties
# ---------------------------------------------------------------------------


@given(routes(), st.integers(0, 14))
def test_capacity_keep_matches_the_naive_loops(case, capacity):
    index, n = case
    np.testing.assert_array_equal(capacity_keep(index, n, capacity), naive_capacity_keep(index, n, capacity))


@given(routes(), st.integers(0, 14))
def test_capacity_never_exceeded(case, capacity):
    index, n = case
    kept = capacity_keep(index, n, capacity)
    load = np.bincount(index[kept], minlength=n)
    assert load.max(initial=0) <= capacity
    # ...and full where something was dropped: a drop only happens at a full expert.
    assert np.all(load[index[~kept]] == capacity)


@given(routes(), st.integers(0, 14))
def test_every_first_choice_served_before_any_second(case, capacity):
    index, n = case
    kept = capacity_keep(index, n, capacity)
    for e in range(n):
        ranks = np.nonzero(index == e)[1]
        served, dropped = ranks[kept[index == e]], ranks[~kept[index == e]]
        if served.size and dropped.size:
            assert dropped.min() >= served.max()


@given(routes())
def test_nothing_dropped_when_capacity_at_least_m(case):
    index, n = case
    assert capacity_keep(index, n, index.shape[0]).all()


@given(routes(), st.integers(0, 14))
def test_capacity_keep_array_api_strict_agrees(case, capacity):
    index, n = case
    kept = capacity_keep(array_api_strict.asarray(index), n, capacity)
    np.testing.assert_array_equal(np.from_dlpack(kept), naive_capacity_keep(index, n, capacity))


@pytest.mark.parametrize(("c", "m", "k", "n", "expected"),
                         [(1.0, 12, 2, 4, 6), (1.25, 12, 2, 4, 8), (1.1, 10, 1, 1, 11), (1.0, 7, 1, 3, 3),
                          (2.0, 0, 1, 3, 0)])
def test_expert_capacity_closed_form(c, m, k, n, expected):
    assert expert_capacity(m, n, k, c) == expected
    assert expected == math.ceil(Fraction(str(c)) * m * k / n)


# ---------------------------------------------------------------------------
# Switch Transformer's auxiliary loss
# ---------------------------------------------------------------------------


def naive_switch_loss(probs, index, n):
    m, k = index.shape
    f = [sum(1 for i in range(m) for r in range(k) if index[i, r] == e) / (m * k) for e in range(n)]
    P = [sum(probs[i, e] for i in range(m)) / m for e in range(n)]
    return n * sum(fe * pe for fe, pe in zip(f, P, strict=True))


def test_switch_loss_is_one_at_a_uniform_assignment(xp):
    n, k = 8, 2
    index = np.stack([np.arange(n), (np.arange(n) + 1) % n], axis=1)  # every expert twice
    probs = np.full((n, n), 1.0 / n)
    assert switch_balance_loss(xp.asarray(probs), xp.asarray(index), n) == pytest.approx(1.0, rel=1e-12)
    assert k == index.shape[1]


@given(routes(), st.integers(0, 2**31))
def test_switch_loss_matches_naive_loops(case, seed):
    index, n = case
    probs = scipy.special.softmax(np.random.default_rng(seed).standard_normal((index.shape[0], n)), axis=1)
    assert switch_balance_loss(probs, index, n) == pytest.approx(naive_switch_loss(probs, index, n), rel=1e-12)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=30))
def test_switch_loss_grows_with_imbalance(choices):
    """Top-1 with probabilities equal to the choice: the loss is n sum f^2, at least 1, 1 only when uniform,
    and it grows when a token moves from the least to the most loaded expert."""
    n = 5
    index = np.array(choices)[:, None]
    probs = np.eye(n)[index[:, 0]]
    loss = switch_balance_loss(probs, index, n)
    f = np.bincount(index[:, 0], minlength=n) / len(choices)
    assert loss == pytest.approx(n * np.sum(f**2))
    assert loss >= 1 - 1e-12
    load = np.bincount(index[:, 0], minlength=n)
    donor = int(np.flatnonzero(index[:, 0] == np.argmin(np.where(load > 0, load, 10**9)))[0])
    busiest = int(np.argmax(load))
    if index[donor, 0] != busiest:
        moved = index.copy()
        moved[donor, 0] = busiest
        assert switch_balance_loss(np.eye(n)[moved[:, 0]], moved, n) > loss


def test_switch_loss_gradient_matches_autograd():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 5))
    index = np.argsort(-logits, axis=1, kind="stable")[:, :2]
    z = torch.tensor(logits, requires_grad=True)
    f = torch.tensor(np.bincount(index.ravel(), minlength=5) / index.size)
    (5 * torch.sum(f * torch.softmax(z, dim=1).mean(dim=0))).backward()
    np.testing.assert_allclose(switch_balance_loss_grad(logits, index, 5), z.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("function", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_score_function_vjp_matches_autograd(function):
    rng = np.random.default_rng(5)
    logits, dscores = rng.normal(0, 4, (6, 5)), rng.standard_normal((6, 5))
    z = torch.tensor(logits, requires_grad=True)
    torch_scores = {"sigmoid": torch.sigmoid, "softmax": lambda t: torch.softmax(t, dim=1),
                    "sqrtsoftplus": lambda t: torch.sqrt(torch.nn.functional.softplus(t))}[function](z)
    torch_scores.backward(torch.tensor(dscores))
    np.testing.assert_allclose(score_function_vjp(logits, dscores, function), z.grad.numpy(), rtol=1e-10,
                               atol=1e-14)


# ---------------------------------------------------------------------------
# DeepSeek's sequence-wise loss
# ---------------------------------------------------------------------------


def naive_sequence_loss(scores, index, n, T):
    m, k = index.shape
    total = 0.0
    for start in range(0, m, T):
        loss = 0.0
        for e in range(n):
            f = n / (k * T) * sum(1 for t in range(start, start + T) if e in index[t])
            P = sum(scores[t, e] / scores[t].sum() for t in range(start, start + T)) / T
            loss += f * P
        total += loss
    return total / (m // T)


@given(st.integers(1, 3), st.integers(1, 5), st.integers(2, 6), st.integers(0, 2**31))
def test_sequence_loss_matches_naive_loops(sequences, T, n, seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, n + 1))
    scores = 1 / (1 + np.exp(-rng.standard_normal((sequences * T, n))))
    index = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    got = sequence_balance_loss(scores, index, n, T)
    assert got == pytest.approx(naive_sequence_loss(scores, index, n, T), rel=1e-12)


def test_sequence_loss_is_one_when_uniform(xp):
    n, T = 4, 4
    index = np.arange(T)[:, None] % n  # one token per expert
    scores = np.full((T, n), 0.5)
    assert sequence_balance_loss(xp.asarray(scores), xp.asarray(index), n, T) == pytest.approx(1.0)


def test_sequence_loss_gradient_matches_autograd():
    rng = np.random.default_rng(1)
    n, k, T, S = 6, 2, 5, 3
    scores = np.sqrt(np.logaddexp(0, rng.standard_normal((S * T, n))))
    index = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    s = torch.tensor(scores, requires_grad=True)
    counts = np.stack([np.bincount(index[q * T:(q + 1) * T].ravel(), minlength=n) for q in range(S)])
    f = torch.tensor(n / (k * T) * counts)  # [S, n]
    P = (s / s.sum(dim=1, keepdim=True)).reshape(S, T, n).mean(dim=1)
    (f * P).sum(dim=1).mean().backward()
    np.testing.assert_allclose(sequence_balance_loss_grad(scores, index, n, T), s.grad.numpy(), rtol=1e-10,
                               atol=1e-14)


# ---------------------------------------------------------------------------
# Hash routing
# ---------------------------------------------------------------------------


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20), st.integers(1, 12), st.data())
def test_hash_route_deterministic_distinct_and_as_by_hand(ids, n, data):
    k = data.draw(st.integers(1, n))
    token_ids = np.array(ids, dtype=np.int64)
    index = hash_route(token_ids, n, k)
    assert index.shape == (len(ids), k)
    assert np.array_equal(index, hash_route(token_ids[::-1].copy(), n, k)[::-1])  # a function of the id alone
    assert all(len(set(row)) == k for row in index.tolist())
    assert index.min() >= 0 and index.max() < n
    assert index.tolist() == [_reference_hash(v, n, k) for v in ids]


def test_hash_route_same_on_array_api_strict():
    ids = np.arange(0, 5000, 7, dtype=np.int64)
    got = hash_route(array_api_strict.asarray(ids), 16, 3)
    np.testing.assert_array_equal(np.from_dlpack(got), hash_route(ids, 16, 3))


def test_hash_route_spreads_ids_evenly_and_seed_changes_it():
    """40,000 ids over 64 experts, top-6: every expert within 10% of the mean load of 3,750."""
    ids = np.arange(40_000, dtype=np.int64)
    load = np.bincount(hash_route(ids, 64, 6).ravel(), minlength=64)
    assert np.all(np.abs(load / 3750 - 1) < 0.1), load
    assert not np.array_equal(hash_route(ids[:100], 64, 6, seed=1), hash_route(ids[:100], 64, 6))


def test_route_by_hash_weights_are_renormalized_raw_scores():
    rng = np.random.default_rng(2)
    scores = rng.uniform(0.1, 1, (6, 8))
    ids = np.array([5, 9, 5, 1, 0, 9])
    index, weights = route_by_hash(scores, ids, 3, scaling_factor=2.0)
    raw = np.take_along_axis(scores, np.array([_reference_hash(v, 8, 3) for v in ids.tolist()]), axis=1)
    np.testing.assert_allclose(weights, 2.0 * raw / raw.sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(index[0], index[2])


# ---------------------------------------------------------------------------
# Score functions
# ---------------------------------------------------------------------------


def test_sqrtsoftplus_finite_and_exact_at_80(xp):
    for dtype in (xp.float32, xp.float64):
        z = xp.asarray([[-80.0, -20.0, 0.0, 20.0, 80.0]], dtype=dtype)
        s = to_numpy(router_scores(z, xp.eye(5, dtype=dtype), "sqrtsoftplus"))
        assert np.all(np.isfinite(s)) and np.all(s > 0)
        # log1p(e^z) for z < 0 and z + log1p(e^-z) for z > 0: mpmath-free closed forms.
        expected = np.sqrt([math.exp(-80.0), math.log1p(math.exp(-20.0)), math.log(2.0),
                            20.0 + math.log1p(math.exp(-20.0)), 80.0])
        np.testing.assert_allclose(s[0], expected, rtol=1e-6 if dtype == xp.float32 else 1e-14)


def test_softplus_against_numpy_logaddexp():
    z = np.linspace(-700, 700, 2001)
    np.testing.assert_allclose(softplus(z), np.logaddexp(0.0, z), rtol=1e-14, atol=0)


def test_softmax_scores_against_scipy(xp):
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((5, 3)), rng.standard_normal((7, 3))
    s = to_numpy(router_scores(xp.asarray(x), xp.asarray(w), "softmax"))
    np.testing.assert_allclose(s, scipy.special.softmax(x @ w.T, axis=1), rtol=1e-12)
    big = to_numpy(router_scores(xp.asarray([[1000.0]]), xp.asarray([[1.0], [0.0]]), "softmax"))
    assert np.all(np.isfinite(big)) and big[0, 0] == 1.0


# ---------------------------------------------------------------------------
# The switches in the forward pass
# ---------------------------------------------------------------------------

SWITCHES = [
    dict(score_function="softmax"),
    dict(score_function="sqrtsoftplus"),
    dict(capacity_factor=1.0),
    dict(capacity_factor=0.5, use_latent_norm=False),
    dict(hash_routing=True),
    dict(hash_routing=True, capacity_factor=1.25, score_function="sqrtsoftplus"),
]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_forward_with_switches_matches_the_reference(switches):
    config = MoEConfig.tiny(**switches)
    params = init_params(config, 5, dtype=np.float64, bias_scale=0.1)
    x = np.random.default_rng(6).standard_normal((24, config.d))
    ids = np.random.default_rng(7).integers(0, 1000, 24)
    out = stable_latent_moe(x, params, config, return_intermediates=True, token_ids=ids)
    np.testing.assert_allclose(out.y, stable_latent_moe_reference(x, params, config, token_ids=ids),
                               rtol=1e-10, atol=1e-12)
    if config.capacity_factor is not None:
        capacity = expert_capacity(24, config.n, config.k, config.capacity_factor)
        assert np.bincount(out.index[out.kept], minlength=config.n).max() <= capacity
        assert np.all(out.weights[~out.kept] == 0)
        assert (~out.kept).any()  # these capacities do drop on this batch


def test_forward_with_capacity_and_hash_on_every_backend(xp):
    config = MoEConfig.tiny(hash_routing=True, capacity_factor=1.0, score_function="sqrtsoftplus")
    params = init_params(config, 11)
    x = np.random.default_rng(12).standard_normal((16, config.d)).astype(np.float32)
    ids = np.arange(100, 116) % 5
    y = stable_latent_moe(xp.asarray(x), {k: xp.asarray(v) for k, v in params.items()}, config,
                          token_ids=xp.asarray(ids))
    np.testing.assert_allclose(to_numpy(y), stable_latent_moe_reference(x, params, config, token_ids=ids),
                               rtol=2e-4, atol=2e-5)


def test_dropped_assignments_contribute_nothing():
    """A capacity layer equals the plain layer with the dropped experts' weights set to zero by hand."""
    config = MoEConfig.tiny(capacity_factor=1.0, use_latent_norm=False, num_shared_experts=0)
    params = init_params(config, 8, dtype=np.float64)
    x = np.random.default_rng(9).standard_normal((30, config.d))
    out = stable_latent_moe(x, params, config, return_intermediates=True)
    plain = stable_latent_moe(x, params, config.replace(capacity_factor=None), return_intermediates=True)
    np.testing.assert_array_equal(out.index, plain.index)
    # Without the norm the routed output is linear in the weights: each slot's share, computed alone.
    from refimpl.layer.latent_moe import routed_experts
    expected = sum(routed_experts(plain.z, plain.index[:, r:r + 1], plain.weights[:, r:r + 1] * out.kept[:, r:r + 1],
                                  params["experts.w1"], params["experts.w3"], params["experts.w2"], config)
                   for r in range(config.k))
    np.testing.assert_allclose(out.u, expected, rtol=1e-12, atol=1e-14)


def test_hash_routing_needs_token_ids():
    config = MoEConfig.tiny(hash_routing=True)
    params = init_params(config, 0)
    with pytest.raises(ValueError, match="token_ids"):
        stable_latent_moe(np.zeros((2, config.d), np.float32), params, config)


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def test_deepseek_presets_hold_the_seed_numbers():
    flash, pro = MoEConfig.deepseek_v4_flash(hidden_size=64), MoEConfig.deepseek_v4_pro(hidden_size=64)
    assert (flash.num_shared_experts, flash.n, flash.k, flash.f) == (1, 256, 6, 2048)
    assert (pro.num_shared_experts, pro.n, pro.k, pro.f) == (1, 384, 6, 3072)
    assert flash.score_function == pro.score_function == "sqrtsoftplus"
    assert flash.num_hash_layers == 3 and not flash.use_latent_projection
    v3 = MoEConfig.deepseek_v3()
    assert (v3.d, v3.n, v3.k, v3.f, v3.n_group, v3.topk_group) == (7168, 256, 8, 2048, 8, 4)
    assert flash.swiglu_limit == 10.0 and flash.routed_scaling_factor == 1.5  # transformers' DeepseekV4Config
    assert pro.swiglu_limit is None and pro.routed_scaling_factor == 1.0  # not in the sources: not invented
    with pytest.raises(TypeError):
        MoEConfig.deepseek_v4_pro()  # the width is not in the sources: it must be given


@pytest.mark.parametrize(("field", "value", "error"), [
    ("score_function", "tanh", ValueError), ("capacity_factor", 0.0, ValueError),
    ("capacity_factor", float("inf"), ValueError), ("capacity_factor", True, ValueError),
    ("hash_routing", "yes", TypeError), ("num_hash_layers", -1, ValueError), ("num_hash_layers", 2, ValueError),
])
def test_config_rejects_bad_switches(field, value, error):
    with pytest.raises(error, match=field):
        MoEConfig.tiny(**{field: value})


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def test_bad_inputs_name_the_argument():
    index = np.array([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"index \(expert ids\) must hold integers in \[0, 1\)"):
        capacity_keep(index, 1, 1)
    with pytest.raises(TypeError, match=r"index \(expert ids\) must be an integer array"):
        capacity_keep(index.astype(float), 2, 1)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        capacity_keep(index, 2, -1)
    with pytest.raises(ValueError, match=r"probs must have shape \[m, n\] = \[2, 3\]"):
        switch_balance_loss(np.ones((2, 2)) / 2, index, 3)
    with pytest.raises(ValueError, match="seq_len must divide"):
        sequence_balance_loss(np.ones((2, 2)), index, 2, 3)
    with pytest.raises(ValueError, match=r"token_ids must hold integers in \[0, 4294967296\)"):
        hash_route(np.array([-1]), 4, 2)
    with pytest.raises(ValueError, match="top_k must be <= 4"):
        hash_route(np.array([1]), 4, 5)
    with pytest.raises(ValueError, match="score_function must be one of"):
        router_scores(np.ones((1, 2)), np.ones((3, 2)), "relu")
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        expert_capacity(4, 2, 1, -1.0)


# ---------------------------------------------------------------------------
# The worked examples
# ---------------------------------------------------------------------------


def test_example_70_keeps_and_drops_the_hand_computed_slots(capsys):
    from conftest import load_example

    result = load_example("70_capacity_by_hand").main([])
    assert result == {"kept": [[True, False], [False, False], [True, False]], "load": [1, 1]}
    assert "DROPPED" in capsys.readouterr().out


def test_example_71_routes_nine_ways(tmp_path):
    from conftest import load_example

    rows = {r["router"]: r for r in load_example("71_routers_side_by_side").main(["--out", str(tmp_path)])}
    assert len(rows) == 9 and (tmp_path / "loads.png").is_file()
    # Monotone score functions select the same experts: identical loads without a bias.
    assert np.array_equal(rows["sigmoid"]["sorted_load"], rows["softmax"]["sorted_load"])
    assert np.array_equal(rows["sigmoid"]["sorted_load"], rows["sqrtsoftplus"]["sorted_load"])
    # A capacity factor c bounds the overload by c - 1 (up to the rounding of C) and drops the excess.
    q = 1024 * 4 / 32
    for c in (1.0, 1.25):
        row = rows[f"softmax + capacity {c}"]
        assert row["max_violation"] <= np.ceil(c * q) / q - 1 + 1e-12 and row["dropped"] > 0
    assert all(rows[name]["dropped"] == 0 for name in rows if "capacity" not in name)


# ---------------------------------------------------------------------------
# Gradients of the switched layer (the backward pass with a capacity or hash routing)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("switches", [dict(capacity_factor=0.75), dict(hash_routing=True, capacity_factor=1.0)],
                         ids=["capacity", "hash+capacity"])
def test_vjp_with_capacity_and_hash_matches_central_differences(switches):
    from refimpl.layer.backward import stable_latent_moe_vjp

    config = MoEConfig.tiny(**switches)
    params = init_params(config, 13, dtype=np.float64)
    rng = np.random.default_rng(14)
    x, dy = rng.standard_normal((12, config.d)), rng.standard_normal((12, config.d))
    ids = rng.integers(0, 50, 12)
    y, backward = stable_latent_moe_vjp(x, params, config, token_ids=ids)
    dx, dparams = backward(dy)

    def objective(x_, params_):
        return float(np.sum(stable_latent_moe(x_, params_, config, token_ids=ids) * dy))

    eps = 1e-6
    for name in ("gate.weight", "experts.w2"):
        flat = params[name].reshape(-1)
        for j in rng.choice(flat.size, 6, replace=False):
            plus, minus = dict(params), dict(params)
            plus[name] = (flat + eps * (np.arange(flat.size) == j)).reshape(params[name].shape)
            minus[name] = (flat - eps * (np.arange(flat.size) == j)).reshape(params[name].shape)
            numeric = (objective(x, plus) - objective(x, minus)) / (2 * eps)
            assert dparams[name].reshape(-1)[j] == pytest.approx(numeric, rel=1e-5, abs=1e-7)
    i, c = 3, 5
    step = np.zeros_like(x)
    step[i, c] = eps
    assert dx[i, c] == pytest.approx((objective(x + step, params) - objective(x - step, params)) / (2 * eps),
                                     rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------------------
# What the other systems' functions refuse: probabilities that are not, k = 0, 0/0
# ---------------------------------------------------------------------------

def test_losses_and_gradients_refuse_what_is_not_a_probability():
    """NaN, negative, unnormalized probabilities and an empty route are refused by name, never computed."""
    index = np.array([[0, 1], [2, 0]])
    probs = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    assert np.isfinite(switch_balance_loss(probs, index, 3))  # the valid case runs
    nan = probs.copy()
    nan[0, 0] = np.nan
    with pytest.raises(ValueError, match=r"probs must be finite, got 1 non-finite"):
        switch_balance_loss(nan, index, 3)
    with pytest.raises(ValueError, match=r"probs must be non-negative"):
        switch_balance_loss(np.array([[1.2, -0.3, 0.1], [0.1, 0.1, 0.8]]), index, 3)
    with pytest.raises(ValueError, match=r"rows sum to 1 .* off by 0.5"):
        switch_balance_loss(probs * 1.5, index, 3)
    with pytest.raises(ValueError, match=r"at least one expert per token \(k >= 1\)"):
        switch_balance_loss(probs, np.zeros((2, 0), dtype=np.int64), 3)
    scores = np.array([[0.5, 0.3, 0.2, 0.7], [0.1, 0.4, 0.8, 0.2]])
    index4 = np.array([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"scores must be non-negative"):
        sequence_balance_loss(-scores, index4, 4, 2)
    with pytest.raises(ValueError, match=r"positive sum for every token"):
        sequence_balance_loss(np.vstack([scores[:1], np.zeros((1, 4))]), index4, 4, 2)
    with pytest.raises(ValueError, match=r"scores must be finite"):
        sequence_balance_loss_grad(np.full((2, 4), np.inf), index4, 4, 2)
    with pytest.raises(ValueError, match=r"at least one expert per token"):
        sequence_balance_loss(scores, np.zeros((2, 0), dtype=np.int64), 4, 2)
    with pytest.raises(ValueError, match=r"logits must be finite"):
        switch_balance_loss_grad(np.full((2, 3), np.nan), index, 3)
    with pytest.raises(ValueError, match=r"logits must be finite"):
        score_function_vjp(np.array([[np.nan, 0.0]]), np.ones((1, 2)), "sqrtsoftplus")
    with pytest.raises(ValueError, match=r"dscores must be finite"):
        score_function_vjp(np.zeros((1, 2)), np.array([[np.inf, 0.0]]))


def test_hash_routing_refuses_scores_it_cannot_weigh():
    """Hashed experts whose scores are all 0 (an underflowed sqrt-softplus) would be weighted 0/0: refused."""
    ids = np.array([3, 7])
    zero = np.zeros((2, 6))
    with pytest.raises(ValueError, match=r"positive sum for every token .* 2 token\(s\)"):
        route_by_hash(zero, ids, 2)
    weights = route_by_hash(zero, ids, 2, renormalize=False)[1]  # without renormalization 0 is the weight
    assert np.all(weights == 0.0)
    with pytest.raises(ValueError, match=r"scores must be finite"):
        route_by_hash(np.full((2, 6), np.nan), ids, 2)
    with pytest.raises(ValueError, match=r"top_k must be >= 1"):
        route_by_hash(np.ones((2, 6)), ids, 0)
    # The learned router refuses the same 0/0 instead of returning NaN weights.
    with pytest.raises(ValueError, match=r"positive sum for every token"):
        route(zero, np.zeros(6), 2)


def test_sqrt_softplus_gradient_is_zero_where_the_score_underflowed():
    """The derivative sigma(z) / (2 s) tends to s / 2 -> 0: where s is exactly 0 it is 0, not 0/0 = NaN."""
    from refimpl.layer.routing import score_function_grad

    logits = np.array([[-800.0, -50.0, 0.0, 30.0]])
    s = np.sqrt(softplus(logits))
    assert s[0, 0] == 0.0
    grad = score_function_grad(s, np.ones_like(s), "sqrtsoftplus")
    assert np.all(np.isfinite(grad)) and grad[0, 0] == 0.0
    z = torch.tensor(logits[:, 1:], requires_grad=True)
    torch.sqrt(torch.nn.functional.softplus(z)).sum().backward()
    np.testing.assert_allclose(grad[0, 1:], z.grad.numpy()[0], rtol=1e-12)
