"""Tests of training over MPI (`refimpl.train.expert_parallel`, `python -m refimpl.train --expert-parallel`).

The reference is the one-process run: the same command without
`--expert-parallel`, with the same seed and batch. An expert-parallel run adds
the same numbers in other orders (products over a slice of the batch, the
combine's partial sums, the rank-ordered sums of the loss and the gradients),
so its losses agree to float32 rounding, some 1e-7 relative per step here,
growing slowly with the steps; the contract is 1e-5 relative over the 10 steps
of the runs below. Between ranks, the balancers' biases and the replicated
parameters must agree bit for bit. The tests under `mpiexec` are marked slow.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_mpiexec, run_under_mpiexec

import refimpl.train as train_module
from refimpl.balancing import Balancer, QuantileBalancer
from refimpl.config import MoEConfig
from refimpl.layer.backward import stable_latent_moe_vjp
from refimpl.layer.latent_moe import init_params
from refimpl.parallel import ep_vjp, shard_params
from refimpl.train import BALANCERS, BIAS, TrainConfig, default_layer, main, train
from refimpl.train.expert_parallel import (
    BALANCE_ACROSS_RANKS,
    STAGES,
    ExpertParallel,
    batch_rows,
    check_expert_parallel,
    train_expert_parallel,
)

MPI = pytest.importorskip("mpi4py.MPI")

#: The run of the issue's check: 10 steps, small sizes, 8 experts, 3 layers.
RUN = ["--steps", "10", "--experts", "8", "--layers", "3", "--d", "16", "--latent", "8", "--intermediate", "8",
       "--top-k", "2", "--context", "4", "--embed", "4", "--eval-every", "5", "--stats-every", "3", "--seed", "0",
       "--quiet"]
RTOL = 1e-5
ROOT_TESTS = Path(__file__).resolve().parent
#: One BLAS thread per rank: the ranks share two cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def tiny(balancer: str = "qb", **changes) -> TrainConfig:
    layer = dict(hidden_size=16, latent_size=8, num_experts=8, top_k=2, intermediate_size=8, num_moe_layers=3)
    return TrainConfig(moe=default_layer(**layer), balancer=balancer,
                       **{**dict(context=4, embed=4, batch=128, eval_batch=64, stats_every=3, eval_every=5,
                                 steps=6), **changes})


def relative(have: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(have) - np.asarray(want)) / np.abs(np.asarray(want))))


def strict_json(path) -> dict:
    """The log, read as strict JSON: a NaN or Infinity token is an error."""
    def refuse(token):
        raise ValueError(f"{path} holds the non-JSON token {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def one_process_log(args: list[str], out) -> dict:
    """The one-process command's log (run in this process: `main` is the command)."""
    main([*args, "--out", str(out)])
    return strict_json(out)


def check_against_one_process(ep: dict, one: dict, size: int) -> None:
    """An expert-parallel log against the one-process log of the same run, and the fields it adds."""
    assert ep["config"] == one["config"] and ep["corpus"] == one["corpus"]
    for key in ("loss", "eval_loss"):
        have = [record[key] for record in ep["steps"] if key in record]
        want = [record[key] for record in one["steps"] if key in record]
        assert len(have) == len(want) > 0
        assert relative(have, want) <= RTOL, key
    config = TrainConfig.from_record(one["config"])
    slots = config.batch * config.moe.top_k
    for record in ep["steps"]:
        # Every (token, expert) slot of the batch is computed once, on the rank that holds the expert.
        assert len(record["rank_load"]) == config.moe.num_moe_layers
        assert all(len(loads) == size and sum(loads) == slots for loads in record["rank_load"])
        assert sorted(record["rank_seconds"]) == sorted(STAGES)
        assert all(len(times) == size and min(times) >= 0 for times in record["rank_seconds"].values())
    summary = ep["expert_parallel"]
    assert summary["ranks"] == size
    assert summary["batch_rows"] == [len(part) for part in np.array_split(np.arange(config.batch), size)]
    assert sum(summary["rank_load"]) == slots * config.moe.num_moe_layers * config.steps
    assert ep["command"].startswith(f"mpiexec -n {size} python -m refimpl.train --expert-parallel")


# ---------------------------------------------------------------------------
# On one process: the pieces
# ---------------------------------------------------------------------------

def test_batch_rows_are_the_batch_in_rank_order():
    for m in (1, 5, 126, 128):
        for size in (1, 2, 3, 4):
            if m < size:
                continue
            parts = [batch_rows(m, size, rank) for rank in range(size)]
            want = np.array_split(np.arange(m), size)
            assert [list(range(m))[part] for part in parts] == [list(w) for w in want]


def test_every_training_balancer_has_a_rule_across_ranks():
    config = tiny()
    assert {BALANCERS[name](config).kind for name in BALANCERS} <= set(BALANCE_ACROSS_RANKS)


def test_advance_is_how_a_step_ends():
    rng = np.random.default_rng(0)
    scores = rng.random((40, 8)).astype(np.float32)
    stepped, advanced = QuantileBalancer(8, 2), QuantileBalancer(8, 2)
    step = stepped.step(scores)
    again = advanced.advance(step.index, step.load, advanced.next_bias(scores, advanced.bias, step.index))
    assert np.array_equal(stepped.bias, advanced.bias) and np.array_equal(again.load, step.load)
    assert (stepped.step_count, stepped.ratios) == (advanced.step_count, advanced.ratios)
    with pytest.raises(ValueError, match=r"load must be \[8\]"):
        advanced.advance(step.index, step.load[:4], advanced.bias)
    with pytest.raises(ValueError, match=r"next_bias must have shape \[8\]"):
        advanced.advance(step.index, step.load, np.zeros(3))


def test_ep_vjp_gives_the_layers_intermediates_and_carries_dscores_on_one_rank():
    config = MoEConfig(hidden_size=12, latent_size=6, num_experts=8, top_k=3, intermediate_size=5)
    rng = np.random.default_rng(2)
    params = {name: value.astype(np.float64) for name, value in init_params(config, rng).items()}
    params[BIAS] = rng.standard_normal(8) * 0.1
    x, dy, dscores = rng.standard_normal((17, 12)), rng.standard_normal((17, 12)), rng.standard_normal((17, 8))
    want, back = stable_latent_moe_vjp(x, params, config, return_intermediates=True)
    have, _, ep_back = ep_vjp(x, shard_params(params, config, 0, 1), config, MPI.COMM_SELF,
                              return_intermediates=True)
    for name in ("y", "scores", "u", "v", "z", "y_routed", "y_shared", "weights"):
        assert relative(getattr(have, name), getattr(want, name)) <= 1e-10, name
    assert np.array_equal(have.index, want.index)
    assert have.routed.peak() == pytest.approx(want.routed.peak(), rel=1e-12)
    dx_want, grads_want = back(dy, dscores=dscores)
    dx_have, grads_have = ep_back(dy, dscores=dscores)
    assert relative(dx_have, dx_want) <= 1e-10
    for name, value in grads_want.items():
        if np.any(value):
            assert relative(grads_have[name], value) <= 1e-10, name
    with pytest.raises(ValueError, match="dscores must have the shape"):
        ep_back(dy, dscores=dscores[:3])


@pytest.mark.parametrize("balancer", ["qb", "aux", "capacity-1.0", "hash"])
def test_one_rank_trains_the_one_process_run(balancer):
    """`MPI.COMM_SELF`: the expert-parallel path, every collective over one rank."""
    config = tiny(balancer)
    one = train(config)
    ep = train_expert_parallel(config, MPI.COMM_SELF)
    for key in ("loss", "eval_loss"):
        have = [record[key] for record in ep["steps"] if key in record]
        assert relative(have, [record[key] for record in one["steps"] if key in record]) <= RTOL
    if balancer == "aux":
        assert relative([r["aux_loss"] for r in ep["steps"]], [r["aux_loss"] for r in one["steps"]]) <= RTOL


class _Unsplittable(Balancer):
    kind = "test-unsplittable"

    def next_bias(self, scores, bias, index):
        return bias


def test_a_balancer_without_a_rule_across_ranks_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(BALANCERS, "mine", lambda config: _Unsplittable(config.moe.num_experts, config.moe.top_k))
    config = tiny("mine")
    with pytest.raises(ValueError, match=r"the balancer 'mine' \(a 'test-unsplittable' balancer\) has no rule "
                                         r"across ranks.*'qb'"):
        train_expert_parallel(config, MPI.COMM_SELF)


class _Alike:
    """A communicator of `size` ranks that all hold what this one holds: its allgather repeats this rank's entry."""

    def __init__(self, size: int) -> None:
        self.size = size

    def Get_size(self) -> int:
        return self.size

    def allgather(self, value):
        return [value] * self.size


def test_the_run_must_split_over_the_ranks():
    """What each rank checks alone before the ranks agree (their agreement is tested under mpiexec)."""
    with pytest.raises(ValueError, match=r"rank 0 of 3 \(and 2 other rank\(s\)\): the number of ranks P=3 must "
                                         r"divide the number of experts n=8 \(--experts\)"):
        check_expert_parallel(tiny(), _Alike(3))
    with pytest.raises(ValueError, match=r"--batch \(3 tokens\) must give each of the 4 ranks at least one"):
        check_expert_parallel(tiny(batch=3, balancer="none"), _Alike(4))
    with pytest.raises(ValueError, match=r"the held-out batch \(2 tokens\) must give each of the 4 ranks"):
        check_expert_parallel(tiny(eval_batch=2), _Alike(4))
    check_expert_parallel(tiny(batch=126), _Alike(4))  # uneven slices are fine


def test_checkpoints_are_refused_with_expert_parallel(tmp_path, capsys):
    config = tiny()
    with pytest.raises(ValueError, match="checkpoint= and resume= are for a run on one process"):
        train(config, checkpoint=tmp_path / "ck", ranks=ExpertParallel(MPI.COMM_SELF, config))
    with pytest.raises(SystemExit) as stopped:
        main(["--expert-parallel", *RUN, "--checkpoint", str(tmp_path / "ck")])
    assert stopped.value.code == 2
    assert "argument --checkpoint: not available with --expert-parallel" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_without_mpi4py_the_flag_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(SystemExit) as stopped:
        main(["--expert-parallel", *RUN])
    assert stopped.value.code == 2
    assert "argument --expert-parallel: needs mpi4py" in capsys.readouterr().err


def test_the_one_process_seam_answers_with_the_plain_computations():
    """On one process every question of the step has the answer of a computation written out here."""
    one = train_module.ONE_PROCESS
    rng = np.random.default_rng(5)
    logits, targets = rng.standard_normal((7, 256)), rng.integers(0, 256, size=7)
    loss, dlogits = one.cross_entropy(logits, targets)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))  # log softmax, [7, 256]
    assert loss == pytest.approx(-np.mean(log_p[np.arange(7), targets]), rel=1e-12)
    expected = np.exp(log_p)
    expected[np.arange(7), targets] -= 1.0
    np.testing.assert_allclose(dlogits, expected / 7, rtol=1e-10, atol=1e-15)
    grads = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    assert one.sum_of_squares(grads) == pytest.approx(sum(float(v.astype(np.float64) @ v.astype(np.float64))
                                                          for g in grads.values() for v in g.reshape(1, -1)))
    assert list(range(11))[one.rows(11)] == list(range(11)) and (one.rank, one.size) == (0, 1)
    values = rng.standard_normal(9)
    assert one.mean(values) == pytest.approx(sum(values.tolist()) / 9) and one.max(2.5) == 2.5
    assert one.all(True) and not one.all(False)


# ---------------------------------------------------------------------------
# Under mpiexec: what users run
# ---------------------------------------------------------------------------

def command(size: int, args: list[str]) -> list[str]:
    """`mpiexec -n P python -m refimpl.train ARGS`, as the training page says to run it."""
    return ["-n", str(size), sys.executable, "-m", "refimpl.train", *args]


@pytest.mark.slow
def test_two_ranks_log_the_one_process_losses(tmp_path):
    """The issue's check: `mpiexec -n 2 ... --expert-parallel --balancer qb`, 10 steps, 8 experts, 3 layers."""
    args = ["--balancer", "qb", "--batch", "128", *RUN]
    one = one_process_log(args, tmp_path / "one.json")
    loud = [arg for arg in args if arg != "--quiet"]
    job = run_mpiexec(command(2, ["--expert-parallel", *loud, "--out", str(tmp_path / "ep.json")]), timeout=180,
                      env=ONE_THREAD)
    assert job.returncode == 0, job.stdout + job.stderr
    ep = strict_json(tmp_path / "ep.json")
    check_against_one_process(ep, one, 2)
    # Rank 0 alone prints: what it read, how the run is split, each rank's slots and seconds per stage.
    assert job.stdout.count("corpus: ") == 1 and "expert parallel: 2 ranks, 4 experts of each layer" in job.stdout
    table = job.stdout[job.stdout.index("rank   experts   rows"):]
    assert "\n   0       0-3     64" in table and "\n   1       4-7     64" in table
    assert "most loaded rank over the mean" in table


@pytest.mark.slow
@pytest.mark.parametrize("balancer", ["qb-hist", "sign"])
def test_four_ranks_with_uneven_slices_log_the_one_process_losses(balancer, tmp_path):
    args = ["--balancer", balancer, "--batch", "126", *RUN]  # 32, 32, 31 and 31 rows
    one = one_process_log(args, tmp_path / "one.json")
    job = run_mpiexec(command(4, ["--expert-parallel", *args, "--out", str(tmp_path / "ep.json")]), timeout=240,
                      env=ONE_THREAD)
    assert job.returncode == 0, job.stdout + job.stderr
    check_against_one_process(strict_json(tmp_path / "ep.json"), one, 4)


def _held_biases(config: TrainConfig, monkeypatch) -> list[tuple[np.ndarray, np.ndarray]]:
    """The one-process run's (bias that routed the last step, next bias) of each layer."""
    last: dict[int, tuple] = {}
    original = train_module.Ranks.balance

    def balance(self, balancer, scores, index, token_ids):
        step = original(self, balancer, scores, index, token_ids)
        last[id(balancer)] = (step.bias, step.next_bias)
        return step

    monkeypatch.setattr(train_module.Ranks, "balance", balance)
    train(config)
    monkeypatch.undo()
    return list(last.values())


@pytest.mark.slow
def test_every_balancer_keeps_the_same_bias_on_every_rank(tmp_path, monkeypatch):
    """Four ranks, an uneven batch: each balancer's next bias, its loads and every replicated parameter."""
    worker = ROOT_TESTS / "train_parallel_worker.py"
    out = tmp_path / "reports.json"
    job = run_under_mpiexec(4, [str(worker), "biases", str(out)], timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    reports = json.loads(out.read_text())
    assert len(reports) == 4 and sorted(reports[0]) == sorted(BALANCERS)
    for name in BALANCERS:
        for rank in (1, 2, 3):
            assert reports[rank][name] == reports[0][name], (name, rank)
    # The biases that move moved, and are those of the one-process run, to rounding: the exact quantiles to
    # float32 rounding of the scores, the histogram's to one bin (a score that rounds across a bin's edge).
    for name in ("qb", "qb-hist"):
        config = TrainConfig(moe=default_layer(hidden_size=16, latent_size=8, num_experts=8, top_k=2,
                                               intermediate_size=8, num_moe_layers=2), balancer=name,
                             context=4, embed=4, batch=126, eval_batch=66, stats_every=2, eval_every=3, steps=4)
        for layer, (routed, held) in enumerate(_held_biases(config, monkeypatch)):
            have = np.array(reports[0][name]["next_bias_values"][layer])
            assert np.any(have != 0)
            width = (routed.max() - routed.min() + 2) / config.bins if name == "qb-hist" else 0.0
            assert np.max(np.abs(have - held)) <= width + 1e-5, (name, layer)


@pytest.mark.slow
def test_ep_vjp_carries_dscores_under_mpiexec(tmp_path):
    """Four ranks, uneven shards: intermediates, dx and gradients with `dscores` against the union's VJP."""
    out = tmp_path / "vjp.npz"
    job = run_under_mpiexec(4, [str(ROOT_TESTS / "train_parallel_worker.py"), "vjp", str(out)], timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    saved = np.load(out)
    config = MoEConfig(hidden_size=12, latent_size=6, num_experts=8, top_k=3, intermediate_size=5,
                       num_shared_experts=1)
    params = {key.removeprefix("param:"): saved[key] for key in saved.files if key.startswith("param:")}
    want, back = stable_latent_moe_vjp(saved["x"], params, config, return_intermediates=True)
    dx, grads = back(saved["dy"], dscores=saved["dscores"])
    first = np.concatenate([[0], np.cumsum(saved["sizes"])])
    per_rank = config.n // 4
    for rank in range(4):
        rows = slice(first[rank], first[rank + 1])
        for name in ("y", "scores", "u"):
            assert relative(saved[f"{rank}/{name}"], getattr(want, name)[rows]) <= 1e-10, (rank, name)
        assert relative(saved[f"{rank}/dx"], dx[rows]) <= 1e-10
        for stack in ("experts.w1", "experts.w3", "experts.w2"):
            block = grads[stack][rank * per_rank:(rank + 1) * per_rank]
            assert np.max(np.abs(saved[f"{rank}/d:{stack}"] - block)) <= 1e-10 * np.max(np.abs(grads[stack]))
    for name in ("gate.weight", "routed_expert_down_proj.weight", "shared_experts.up_proj.weight"):
        total = sum(saved[f"{rank}/d:{name}"] for rank in range(4))
        assert relative(total, grads[name]) <= 1e-10, name


@pytest.mark.slow
def test_ranks_that_disagree_end_with_the_same_error(tmp_path):
    args = ["--balancer", "sign", "--batch", "64", *RUN[:-3]]  # without the seed
    # Two programs in one job: the seeds differ.
    job = run_mpiexec([*command(1, ["--expert-parallel", *args, "--seed", "0", "--quiet"]), ":",
                       *command(1, ["--expert-parallel", *args, "--seed", "1", "--quiet"])], timeout=60,
                      env=ONE_THREAD)
    message = "error: expert-parallel training: the 2 ranks must agree on config.seed, got rank 0: 0, rank 1: 1"
    assert job.returncode == 2 and job.stderr.count(message) == 2, job.stderr
    # Three ranks cannot split eight experts: every rank says so.
    job = run_mpiexec(command(3, ["--expert-parallel", *args, "--quiet"]), timeout=60, env=ONE_THREAD)
    assert job.returncode == 2
    assert job.stderr.count("the number of ranks P=3 must divide the number of experts n=8") == 3, job.stderr
    # An argument only one rank refuses (its --out exists, and only rank 0 writes): both ranks stop.
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    job = run_mpiexec(command(2, ["--expert-parallel", *args, "--quiet", "--out", str(taken)]), timeout=60,
                      env=ONE_THREAD)
    assert job.returncode == 2 and job.stderr.count(f"rank 0 of 2: argument --out: {taken} already exists") == 2
    assert taken.read_text() == "{}"


@pytest.mark.slow
def test_a_rank_that_fails_ends_the_job(tmp_path):
    """Without `python -m mpi4py`: the command itself ends the job when one rank raises in the middle of a step."""
    job = run_mpiexec(["-n", "2", sys.executable, str(ROOT_TESTS / "train_parallel_worker.py"), "fail"],
                      timeout=60, env=ONE_THREAD)
    assert job.returncode != 0
    assert "rank 1 fails on purpose at its third balancer step" in job.stderr


@pytest.mark.slow
def test_expert_parallel_without_mpiexec_is_one_rank(tmp_path):
    import subprocess

    args = ["--balancer", "qb", "--batch", "64", *RUN]
    one = one_process_log(args, tmp_path / "one.json")
    done = subprocess.run([sys.executable, "-m", "refimpl.train", "--expert-parallel", *args, "--out",
                           str(tmp_path / "ep.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check_against_one_process(strict_json(tmp_path / "ep.json"), one, 1)
