"""Expert parallelism: `ep_forward` under `mpiexec -n 2` and `-n 4`, and the padded batched product.

The MPI tests start `tests/ep_worker.py` with the MPICH wheel's `mpiexec`
(uneven token shards, one rank with no tokens, two or four experts per rank).
Rank 0 saves what every rank returned; this file then computes, in one
process and without the expert-parallel code, what each rank should have
returned and sent: the single-process layer on the union of the tokens, the
(token, rank) pairs its routing sends across ranks, the loads, the bias of the
histogram estimator on the union. The in-process tests cover the padded
product against the grouped loop (on every array backend), the helpers, the
one-rank communicator and the error messages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script, run_under_mpiexec
from hypothesis import given
from hypothesis import strategies as st

from refimpl import MoEConfig, init_params, stable_latent_moe
from refimpl._lib.xp import to_numpy
from refimpl.balancing.histogram import histogram_balancing_update
from refimpl.layer.latent_moe import routed_experts
from refimpl.layer.routing import router_scores
from refimpl.parallel import (
    EPStats,
    ep_balance_update,
    ep_forward,
    expected_remote_ranks,
    expert_block,
    padded_routed_experts,
    padding_waste,
    shard_params,
)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ep_worker.py"
TIMEOUT = 120


def worker():
    return load_script(WORKER, "ep_worker")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def test_expert_blocks_are_contiguous_and_cover_every_expert():
    for n, size in ((8, 1), (8, 2), (8, 4), (896, 8), (896, 64)):
        blocks = [expert_block(n, size, r) for r in range(size)]
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        assert all(stop == start for (_, stop), (start, _) in zip(blocks, blocks[1:], strict=False))
        assert {stop - start for start, stop in blocks} == {n // size}


def test_expert_block_refuses_a_rank_count_that_does_not_divide_n():
    with pytest.raises(ValueError, match=r"P=3 must divide the number of experts n=8"):
        expert_block(8, 3, 0)
    with pytest.raises(ValueError, match="rank must be <= 3"):
        expert_block(8, 4, 4)


def test_shard_params_cuts_only_the_expert_stacks():
    config = MoEConfig.tiny(num_experts=6)
    params = init_params(config, 0)
    shard = shard_params(params, config, 1, 3)
    for name, value in params.items():
        if name.startswith("experts."):
            np.testing.assert_array_equal(shard[name], value[2:4])
        else:
            assert shard[name] is value


@pytest.mark.parametrize(("n", "k", "size"), [(8, 3, 2), (8, 3, 4), (12, 4, 3), (12, 1, 6), (6, 6, 3), (8, 2, 1)])
def test_expected_remote_ranks_by_enumerating_every_route(n, k, size):
    from itertools import combinations

    per_rank = n // size
    total = 0
    routes = list(combinations(range(n), k))
    for route_ in routes:
        ranks = {e // per_rank for e in route_}
        # A token on rank r sends to every occupied rank but its own; average over the P home ranks.
        total += sum(len(ranks - {r}) for r in range(size)) / size
    assert expected_remote_ranks(n, k, size) == pytest.approx(total / len(routes), rel=1e-12)


def test_expected_remote_ranks_limits():
    assert expected_remote_ranks(896, 16, 1) == 0.0
    assert expected_remote_ranks(896, 16, 896) == pytest.approx(16 * (1 - 1 / 896))  # one expert per rank
    with pytest.raises(ValueError, match="P=5 must divide"):
        expected_remote_ranks(896, 16, 5)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=20))
def test_padding_waste_is_max_over_mean_minus_one(load):
    load = np.array(load)
    waste = padding_waste(load)
    if load.sum() == 0:
        assert waste == 0.0
        return
    # Padded rows over useful rows: every expert padded to the largest load.
    padded_rows = load.max() * load.size
    assert waste == pytest.approx(padded_rows / load.sum() - 1.0)
    assert (waste == 0.0) == (load.min() == load.max())


def test_padding_waste_by_hand():
    assert padding_waste(np.array([4, 0, 2, 2])) == 1.0  # 16 rows computed for 8 slots
    assert padding_waste(np.array([3, 3, 3])) == 0.0
    with pytest.raises(ValueError, match="non-empty 1-D"):
        padding_waste(np.zeros((2, 2)))


# ---------------------------------------------------------------------------
# The padded batched product
# ---------------------------------------------------------------------------

def _routed_inputs(m: int, n: int, k: int, ell: int, f: int, seed: int, skew: float = 0.0):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((m, ell))
    # Distinct experts per token, skewed towards low ids when skew > 0.
    logits = rng.standard_normal((m, n)) - skew * np.arange(n) / n
    index = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    weights = rng.random((m, k))
    w1, w3 = rng.standard_normal((2, n, f, ell)) / np.sqrt(ell)
    w2 = rng.standard_normal((n, ell, f)) / np.sqrt(f)
    return z, index, weights, w1, w3, w2


@pytest.mark.parametrize("skew", [0.0, 4.0])
def test_padded_product_equals_the_grouped_loop(xp, skew):
    config = MoEConfig.tiny(hidden_size=12, latent_size=6, num_experts=7, top_k=3, intermediate_size=5)
    arrays = _routed_inputs(40, 7, 3, 6, 5, seed=3, skew=skew)
    z, index, weights, w1, w3, w2 = (xp.asarray(a) for a in arrays)
    grouped = to_numpy(routed_experts(z, index, weights, w1, w3, w2, config))
    padded = to_numpy(padded_routed_experts(z, index, weights, w1, w3, w2, config))
    np.testing.assert_allclose(padded, grouped, rtol=1e-12, atol=1e-12)
    # A larger fixed capacity (static shapes) adds padding, not a different answer.
    load = np.bincount(arrays[1].ravel(), minlength=7)
    wider = to_numpy(padded_routed_experts(z, index, weights, w1, w3, w2, config, capacity=int(load.max()) + 5))
    np.testing.assert_allclose(wider, grouped, rtol=1e-12, atol=1e-12)


def test_padded_product_against_a_naive_loop_over_tokens():
    config = MoEConfig.tiny(hidden_size=10, latent_size=5, num_experts=5, top_k=2, intermediate_size=4,
                            activation="swiglu")
    z, index, weights, w1, w3, w2 = _routed_inputs(9, 5, 2, 5, 4, seed=8, skew=2.0)
    u = padded_routed_experts(z, index, weights, w1, w3, w2, config)
    for i in range(9):
        expected = np.zeros(5)
        for r in range(2):
            e = index[i, r]
            a, b = w1[e] @ z[i], w3[e] @ z[i]
            expected += weights[i, r] * (w2[e] @ (a / (1 + np.exp(-a)) * b))
        np.testing.assert_allclose(u[i], expected, rtol=1e-12, atol=1e-12)


def test_padded_product_refuses_a_capacity_below_the_largest_load():
    config = MoEConfig.tiny(hidden_size=12, latent_size=6, num_experts=7, top_k=3, intermediate_size=5)
    z, index, weights, w1, w3, w2 = _routed_inputs(40, 7, 3, 6, 5, seed=3, skew=4.0)
    largest = int(np.bincount(index.ravel()).max())
    with pytest.raises(ValueError, match=f"capacity must be >= {largest}"):
        padded_routed_experts(z, index, weights, w1, w3, w2, config, capacity=largest - 1)


def test_padded_product_of_no_tokens_is_empty():
    config = MoEConfig.tiny(hidden_size=12, latent_size=6, num_experts=7, top_k=3, intermediate_size=5)
    z, index, weights, w1, w3, w2 = _routed_inputs(0, 7, 3, 6, 5, seed=3)
    assert padded_routed_experts(z, index.reshape(0, 3), weights, w1, w3, w2, config).shape == (0, 6)


# ---------------------------------------------------------------------------
# One rank (MPI.COMM_SELF): the whole path in this process
# ---------------------------------------------------------------------------

def test_one_rank_equals_the_single_process_layer(xp):
    from mpi4py import MPI

    config = MoEConfig.tiny(num_experts=6, top_k=2)
    params = {name: xp.asarray(a) for name, a in init_params(config, 4, dtype=np.float64, bias_scale=0.1).items()}
    x = xp.asarray(np.random.default_rng(4).standard_normal((13, config.d)))
    for padded in (False, True):
        y, stats = ep_forward(x, params, config, MPI.COMM_SELF, padded=padded)
        np.testing.assert_allclose(to_numpy(y), to_numpy(stable_latent_moe(x, params, config)),
                                   rtol=1e-12, atol=1e-12)
        # Nothing leaves a single rank; every slot is computed here.
        assert (stats.dispatch_bytes, stats.combine_bytes, stats["routing_bytes"]) == (0, 0, 0)
        assert stats.load == 13 * config.k
        assert stats.pairs_sent.tolist() == [13] == stats.pairs_received.tolist()


def test_one_rank_with_no_tokens():
    from mpi4py import MPI

    config = MoEConfig.tiny()
    y, stats = ep_forward(np.zeros((0, config.d)), init_params(config, 1), config, MPI.COMM_SELF)
    assert y.shape == (0, config.d) and stats.load == 0


def test_one_rank_balancer_equals_the_histogram_update():
    from mpi4py import MPI

    rng = np.random.default_rng(2)
    scores = 1 / (1 + np.exp(-rng.standard_normal((300, 16))))
    bias = (0.1 * rng.standard_normal(16)).astype(np.float32)
    mine = ep_balance_update(scores, bias, 4, MPI.COMM_SELF, bins=100)
    assert mine.tobytes() == histogram_balancing_update([scores], bias, 4, 100).tobytes()


class _FakeComm:
    """Enough of a communicator to reach the input checks (which run before any exchange)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def Get_size(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.size

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def allgather(self, obj):
        """Every rank's report, as if all ranks had met the same input: the agreement check runs as in a job."""
        return [obj] * self.size

    def Alltoall(self, *args) -> None:  # noqa: N802
        raise AssertionError("no exchange may start before the inputs are checked")

    Alltoallv = Alltoall


def test_bad_inputs_are_named():
    config = MoEConfig.tiny(num_experts=6)
    whole = init_params(config, 0)
    x = np.zeros((3, config.d), dtype=np.float32)
    with pytest.raises(ValueError, match=r"P=4 must divide the number of experts n=6"):
        ep_forward(x, whole, config, _FakeComm(4))
    with pytest.raises(ValueError, match=r"experts.w1'\] must hold this rank's block of n/P = 6/2 = 3"):
        ep_forward(x, whole, config, _FakeComm(2))  # the whole stack instead of the block
    shard = shard_params(whole, config, 0, 2)
    with pytest.raises(ValueError, match=r"x must have shape \[m, 8\]"):
        ep_forward(np.zeros((3, 5)), shard, config, _FakeComm(2))
    bad = dict(shard, **{"routed_expert_up_proj.weight": np.zeros((8, 3), np.float32)})
    with pytest.raises(ValueError, match="replicated on every rank"):
        ep_forward(x, bad, config, _FakeComm(2))
    with pytest.raises(ValueError, match="missing"):
        ep_forward(x, {k: v for k, v in shard.items() if k != "experts.w2"}, config, _FakeComm(2))
    with pytest.raises(TypeError, match="mpi4py communicator"):
        ep_forward(x, shard, config, object())
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        ep_forward(x, shard, "K3", _FakeComm(2))
    with pytest.raises(ValueError, match="must hold all n=6 experts to be sharded"):
        shard_params(shard, config, 0, 2)


def test_stats_reads_as_a_mapping():
    stats = EPStats(1, 2, 3, np.zeros(2), np.zeros(2), np.array([4, 5]))
    assert stats["combine_bytes"] == 2 and stats.load == 9
    with pytest.raises(KeyError):
        stats["load_bytes"]


# ---------------------------------------------------------------------------
# Under mpiexec
# ---------------------------------------------------------------------------

def run_worker(ranks: int, out: Path) -> dict[str, np.ndarray]:
    result = run_under_mpiexec(ranks, [str(WORKER), str(out)], timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    with np.load(out) as data:
        return {name: data[name] for name in data.files}


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def mpi_run(request, tmp_path_factory):
    ranks = request.param
    return ranks, run_worker(ranks, tmp_path_factory.mktemp(f"ep{ranks}") / "out.npz")


def _single_process(plain: bool = False):
    """The whole layer every rank builds (the plain full-width MoE with `plain`)."""
    w = worker()
    return w.config(plain), w.whole_params(plain)


def _union_route(size: int):
    """The layer, the union of every rank's tokens, and its route `[m, k]` in one process."""
    config, params = _single_process()
    union = np.concatenate(worker().tokens(size))
    return config, params, union, stable_latent_moe(union, params, config, return_intermediates=True).index


def _owners(size: int) -> list[int]:
    """The rank that holds each token of the union."""
    return [r for r, count in enumerate(worker().SHARDS[size]) for _ in range(count)]


@pytest.mark.slow
def test_mpi_result_equals_the_single_process_layer(mpi_run):
    size, out = mpi_run
    assert int(out["size"]) == size  # really P ranks under mpiexec
    config, params = _single_process()
    x = worker().tokens(size)
    expected = stable_latent_moe(np.concatenate(x), params, config)
    for name in ("latent", "padded"):
        got = np.concatenate([out[f"{name}_y_{r}"] for r in range(size)])
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-13)
    empty = [len(part) for part in x].index(0)  # one rank had no tokens at all
    assert out[f"latent_y_{empty}"].shape == (0, config.d)
    plain_config, plain_params = _single_process(plain=True)
    got = np.concatenate([out[f"plain_y_{r}"] for r in range(size)])
    np.testing.assert_allclose(got, stable_latent_moe(np.concatenate(x), plain_params, plain_config),
                               rtol=1e-13, atol=1e-13)


@pytest.mark.slow
def test_mpi_bytes_are_what_the_routing_sends_across_ranks(mpi_run):
    size, out = mpi_run
    config, params, union, index = _union_route(size)
    per_rank = config.n // size
    owners = _owners(size)
    # By hand: token i goes once to every other rank holding one of its experts, and comes back from it.
    sent = np.zeros(size, dtype=np.int64)
    returned = np.zeros(size, dtype=np.int64)
    pairs = np.zeros((size, size), dtype=np.int64)
    for i, own in enumerate(owners):
        for p in {int(e) // per_rank for e in index[i]}:
            pairs[own, p] += 1
            if p != own:
                sent[own] += 1
                returned[p] += 1
    latent_row = config.ell * 8  # float64
    for r in range(size):
        dispatch, combine, routing = out[f"latent_bytes_{r}"]
        assert dispatch == sent[r] * latent_row
        assert combine == returned[r] * latent_row
        assert routing == sent[r] * config.k * (8 + 8)  # an int64 id and a float64 weight per slot
        assert out[f"latent_sent_{r}"].tolist() == pairs[r].tolist()
        assert out[f"latent_received_{r}"].tolist() == pairs[:, r].tolist()
    assert sent.sum() > 0


@pytest.mark.slow
def test_mpi_latent_layer_sends_l_over_d_of_the_plain_moe(mpi_run):
    size, out = mpi_run
    config, _ = _single_process()
    plain_config, _ = _single_process(plain=True)
    latent = sum(out[f"latent_bytes_{r}"][:2].sum() for r in range(size))
    plain = sum(out[f"plain_bytes_{r}"][:2].sum() for r in range(size))
    assert plain > 0
    # Same router, same pairs: the vectors are l wide instead of d wide.
    assert latent / plain == config.ell / plain_config.d == 0.5


@pytest.mark.slow
def test_mpi_loads_are_the_routing_counts(mpi_run):
    size, out = mpi_run
    config, params, union, index = _union_route(size)
    loads = np.concatenate([out[f"latent_load_{r}"] for r in range(size)])
    assert loads.tolist() == np.bincount(index.ravel(), minlength=config.n).tolist()
    assert loads.tolist() == np.concatenate([out[f"padded_load_{r}"] for r in range(size)]).tolist()


@pytest.mark.slow
def test_mpi_norm_of_partial_sums_is_wrong_exactly_where_experts_span_ranks(mpi_run):
    size, out = mpi_run
    config, params, union, index = _union_route(size)
    right = np.concatenate([out[f"latent_y_{r}"] for r in range(size)])
    wrong = np.concatenate([out[f"pitfall_y_{r}"] for r in range(size)])
    error = np.abs(wrong - right).max(axis=1) / np.abs(right).max()
    per_rank = config.n // size
    spans = np.array([len({int(e) // per_rank for e in row}) > 1 for row in index])
    assert spans.any()
    if per_rank >= config.k:  # (at P = 4 a rank holds 2 experts, fewer than k = 3: every token spans)
        assert (~spans).any()
        assert error[~spans].max() < 1e-12  # one partial sum: its norm is the norm of the whole
    assert error[spans].min() > 1e-3


@pytest.mark.slow
def test_mpi_balancer_gives_every_rank_the_union_bias_bit_for_bit(mpi_run):
    size, out = mpi_run
    config, params = _single_process()
    union = np.concatenate(worker().tokens(size))
    expected = histogram_balancing_update([router_scores(union, params["gate.weight"])],
                                          params["gate.e_score_correction_bias"], config.k, worker().BINS)
    for r in range(size):
        assert out[f"bias_{r}"].dtype == expected.dtype
        assert out[f"bias_{r}"].tobytes() == expected.tobytes()


# ---------------------------------------------------------------------------
# The worked examples, at small sizes
# ---------------------------------------------------------------------------

def test_example_80_padded_product_follows_the_balance(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    example = load_script(ROOT / "examples" / "80_balance_is_speed.py", "example_80_balance_is_speed")
    rows = example.main(["--experts", "16", "--tokens", "512", "--latent", "16", "--intermediate", "16",
                         "--steps", "8", "--repeats", "1"])
    by_case = {row["case"].split(" (")[0]: row for row in rows}
    assert set(by_case) == {"zero bias", "sign rule", "Quantile Balancing"}
    assert all(row["difference"] < 1e-5 for row in rows)  # float32: the same u either way
    # The skewed router is unbalanced without a bias; Quantile Balancing brings the largest load down.
    assert by_case["zero bias"]["max_over_mean"] > 1.5 > by_case["Quantile Balancing"]["max_over_mean"]


@pytest.mark.slow
def test_example_81_relaunches_itself_under_mpiexec(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    args = ["--ranks", "2", "--experts", "8", "--width", "32", "--intermediate", "16", "--tokens", "128",
            "--train-tokens", "128", "--steps", "3", "--repeats", "1", "--bins", "100", "--timeout", "100",
            "--out", str(tmp_path)]
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "81_expert_parallel_mpi.py"), *args],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "2 ranks under mpiexec" in out
    assert "the same bits on every rank: yes; equal to one process on the union of the ranks' scores: yes" in out
    assert "= 0.500 of the full-width MoE's" in out
    assert (tmp_path / "ep_step_time.png").is_file()


# ---------------------------------------------------------------------------
# The GPU check's padded-product step, on the host
# ---------------------------------------------------------------------------





# ---------------------------------------------------------------------------
# Ranks that disagree, or fail, end the job with one error instead of a hang
# ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("case", "expected"), [
    ("bias", r"ValueError: ep_forward: the 2 ranks must agree on bias"),
    ("top_k", r"ValueError: ep_forward: the 2 ranks must agree on config.top_k, got rank 0: 2, rank 1: 3"),
    ("experts", r"ValueError: ep_forward: the 2 ranks must agree on config.num_experts, got rank 0: 8, rank 1: 4"),
    ("dtype", r"ValueError: ep_forward: the 2 ranks must agree on dtype, got rank 0: 'float64', rank 1: 'float32'"),
    ("width", r"ValueError: ep_forward: rank 1 of 2: x must have shape \[m, 8\]"),
    ("balance", r"ValueError: ep_balance_update: the 2 ranks must agree on bias"),
    ("vjp", r"ValueError: ep_vjp: rank 1 of 2: x must have shape \[m, 8\]"),
    ("weights", r"ValueError: ep_forward: the 2 ranks must agree on weight gate.weight"),
    ("memory", r"MemoryError: ep_balance_update: rank 1 of 2: no room for the histogram"),
    ("zero", r"ZeroDivisionError: ep_forward: rank 1 of 2: float division by zero"),
    ("own", r"RuntimeError: ep_forward: rank 1 of 2: PortError: a class of the user's own"),
])
def test_ranks_that_disagree_get_the_same_error(case, expected):
    import re

    proc = run_under_mpiexec(2, ["tests/disagree_worker.py", case], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, proc.stdout
    messages = [line.split(": ", 1)[1] for line in lines]
    assert messages[0] == messages[1], messages  # the same error on every rank
    assert re.search(expected, messages[0]), messages[0]


@pytest.mark.slow
def test_a_rank_that_fails_ends_the_job():
    """An uncaught exception on rank 1, before its first exchange, ends the job within the timeout (nonzero exit)."""
    import time

    started = time.perf_counter()
    proc = run_under_mpiexec(2, ["tests/disagree_worker.py", "crash"], timeout=60)
    assert proc.returncode != 0
    assert "rank 1 fails in its own code" in proc.stderr
    assert time.perf_counter() - started < 60
