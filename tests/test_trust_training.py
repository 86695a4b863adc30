"""Hostile inputs to training and balancing, third round: what is refused before it can cost a run.

Each case here failed on the release before this one: it was accepted and failed later (a `--batch` that
`qb-hist` cannot balance, a `--bins` whose histogram does not fit in memory, a checkpoint folder inside the
log's name), gave a raw error from below (a name the operating system refuses, a missing moment in
`adam.npz`, a 1-D histogram), hung an MPI job (a rank that stopped before the ranks' agreement check), or
trained on what it should have refused (a negative second moment, a NaN bias loaded into a shipped router,
a balancer history whose next `save` fails). A case that could hang runs under `mpiexec` with a timeout,
so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, run_mpiexec

import refimpl.train.loop as loop
from refimpl.balancing import (
    Balancer,
    HistogramBalancer,
    MegatronGlobalBatchQB,
    QuantileBalancer,
    TorchtitanQuantileBalancer,
    load_ratio,
    megatron_global_batch_update,
    megatron_qb_update,
    torchtitan_estimate,
    torchtitan_qb_update,
)
from refimpl.train import (
    TrainConfig,
    TrainConfigError,
    check_resources,
    default_layer,
    load_corpus,
    main,
    train,
)
from refimpl.train.checkpoints import check_checkpoint_folder, read_checkpoint

#: A model small enough for a step in a few milliseconds (the flags of `tests/test_trust_second.py`).
FLAGS = ["--d", "16", "--latent", "8", "--experts", "8", "--top-k", "2", "--intermediate", "8", "--layers", "2",
         "--context", "4", "--embed", "4", "--batch", "64", "--eval-every", "4", "--stats-every", "3", "--quiet",
         "--seed", "3", "--balancer", "qb"]
#: A name longer than any file system allows for one component (255 bytes on Linux): `stat` fails.
LONG_NAME = "a" * 300
#: One BLAS thread per rank: the ranks share the machine's cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def refused(argv: list[str], capsys) -> str:
    """Run the command with `argv`; it must stop with status 2. Its stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    error = capsys.readouterr().err
    assert exc.value.code == 2, error
    return error


def nothing_runs(monkeypatch) -> None:
    """Fail the test if the command reads the corpus or starts training: a refusal comes before both."""
    monkeypatch.setattr("refimpl.train.cli.load_corpus", lambda: pytest.fail("the corpus was read"))
    monkeypatch.setattr("refimpl.train.cli.train", lambda *a, **k: pytest.fail("training started"))


# ---------------------------------------------------------------------------
# qb-hist: a batch too small for its rule is refused before the first step
# ---------------------------------------------------------------------------

def test_qb_hist_refuses_a_batch_too_small_for_its_rule_as_qb_does(capsys, monkeypatch):
    layer = default_layer(num_experts=4, top_k=3)
    for balancer in ("qb", "qb-hist"):
        with pytest.raises(ValueError, match=rf"batch does not suit the balancer '{balancer}': a batch of 3 tokens "
                                             r"is too small"):
            TrainConfig(balancer=balancer, batch=3, micro_batches=1, moe=layer)
    nothing_runs(monkeypatch)
    error = refused(["--balancer", "qb-hist", "--experts", "4", "--top-k", "3", "--batch", "3", "--micro-batches",
                     "1", "--steps", "2", "--quiet"], capsys)
    assert "argument --batch: batch does not suit the balancer 'qb-hist'" in error
    assert "use at least n/(n-k) = 4 tokens" in error


def test_a_batch_qb_hist_accepts_is_a_batch_it_can_step_on():
    """`check_batch` is a promise: every batch it accepts steps, every one it refuses is one Eq. (14) refuses."""
    rng = np.random.default_rng(0)
    for n in (4, 5, 8):
        for k in range(1, n):
            for m in range(1, 12):
                histogram = HistogramBalancer(n, k, micro_batches=1, bins=64)
                try:
                    histogram.check_batch(m)
                except ValueError:
                    with pytest.raises(ValueError):
                        QuantileBalancer(n, k).check_batch(m)
                    continue
                QuantileBalancer(n, k).check_batch(m)
                histogram.step(rng.random((m, n)).astype(np.float32))  # the step that failed mid-run before


# ---------------------------------------------------------------------------
# --bins is part of the memory a run is checked for
# ---------------------------------------------------------------------------

def test_the_histogram_of_bins_is_counted_in_the_memory_check(capsys, monkeypatch):
    monkeypatch.setattr("refimpl.train.loop._physical_memory", lambda: 64 << 30)  # any machine: 64 GiB
    big = TrainConfig(balancer="qb-hist", bins=10**7, moe=default_layer(num_experts=1024), batch=256, steps=1)
    check_resources(dataclasses.replace(big, bins=1000))  # the rest of the run fits: the bins alone do not
    with pytest.raises(TrainConfigError, match=r"the histogram of qb-hist \(--experts 1024 x --bins 10,000,000") \
            as exc:
        check_resources(big)
    assert exc.value.field == "bins"
    nothing_runs(monkeypatch)
    error = refused(["--balancer", "qb-hist", "--experts", "1024", "--bins", "10000000", "--batch", "256", "--steps",
                     "1", "--quiet"], capsys)
    assert "argument --bins: the run would need about" in error
    # A balancer without a histogram does not pay for one.
    check_resources(dataclasses.replace(big, balancer="qb"))


def test_the_histogram_estimate_covers_what_a_step_allocates():
    n, bins, m = 64, 50_000, 256
    config = TrainConfig(balancer="qb-hist", bins=bins, micro_batches=4, moe=default_layer(num_experts=n, top_k=2),
                         batch=m)
    (estimate,) = [size for name, _, size in loop._memory_parts(config) if name == "bins"]
    assert estimate == loop.HISTOGRAM_BYTES_PER_COUNT * n * bins
    scores = np.random.default_rng(0).random((m, n)).astype(np.float32)
    balancer = HistogramBalancer(n, 2, bins=bins, micro_batches=4)
    tracemalloc.start()
    try:
        balancer.step(scores)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak > 0.8 * estimate, (peak, estimate)  # the histogram is what a step allocates at this size
    assert peak <= 1.05 * estimate, (peak, estimate)


# ---------------------------------------------------------------------------
# A path the operating system refuses is a one-line refusal naming the flag, on one process and on many
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--out", "--checkpoint", "--resume"])
def test_a_name_too_long_is_refused_naming_the_flag(tmp_path, flag, capsys, monkeypatch):
    nothing_runs(monkeypatch)
    error = refused([*FLAGS, "--steps", "1", flag, str(tmp_path / LONG_NAME)], capsys)
    assert re.search(rf"argument {flag}: .*\(\d+ characters\) cannot .*: File name too long", error), error
    assert "Traceback" not in error


@pytest.mark.parametrize("flag", ["--out", "--checkpoint", "--resume"])
def test_a_folder_this_process_may_not_enter_is_refused_naming_the_flag(tmp_path, flag, capsys, monkeypatch):
    """`EACCES` from `stat`: simulated, so that it is met also when the tests run as root."""
    locked = tmp_path / "locked"
    real_stat = Path.stat

    def stat(self: Path, *args: Any, **kwargs: Any) -> Any:
        if locked in self.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    nothing_runs(monkeypatch)
    error = refused([*FLAGS, "--steps", "1", flag, str(locked / "inner" / "x")], capsys)
    assert f"argument {flag}: " in error and "Permission denied" in error, error


def test_the_checkpoint_functions_refuse_a_name_too_long_by_name(tmp_path):
    long = tmp_path / LONG_NAME
    with pytest.raises(ValueError, match=r"checkpoint: .*\(\d+ characters\) cannot be checked: File name too long"):
        check_checkpoint_folder(long)
    with pytest.raises(ValueError, match=r"cannot be read as a training checkpoint: File name too long"):
        read_checkpoint(long)


def test_a_name_too_long_is_refused_as_a_user_meets_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "refimpl.train", "--steps", "1", "--quiet", "--out",
                           str(tmp_path / LONG_NAME)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **ONE_THREAD})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("python -m refimpl.train: error: argument --out:")


#: The flags of a small expert-parallel run.
EP_FLAGS = ["--expert-parallel", "--experts", "8", "--top-k", "2", "--batch", "64", "--steps", "1", "--quiet"]


def ep_command(args: list[str]) -> list[str]:
    """`mpiexec -n 2 python -m refimpl.train EP_FLAGS ARGS`, as the training page says to run it."""
    return ["-n", "2", sys.executable, "-m", "refimpl.train", *EP_FLAGS, *args]


@pytest.mark.slow
def test_a_path_rank_0_cannot_check_ends_every_rank(tmp_path):
    """Before, rank 0 died of the `OSError` and rank 1 waited in the agreement check for ever."""
    pytest.importorskip("mpi4py.MPI")
    job = run_mpiexec(ep_command(["--out", str(tmp_path / (LONG_NAME + ".json"))]), timeout=90, env=ONE_THREAD)
    assert job.returncode == 2, job.stderr
    assert job.stderr.count("rank 0 of 2: argument --out: ") == 2, job.stderr
    assert "File name too long" in job.stderr and "Traceback" not in job.stderr


#: The command on every rank, with rank 0's corpus unreadable: an exception that is not an argument error.
FAILING_RANK = """
import sys
from mpi4py import MPI
import refimpl.train.cli as cli

def unreadable():
    raise OSError(5, "the corpus cannot be read (on purpose, rank 0 only)")

if MPI.COMM_WORLD.Get_rank() == 0:
    cli.load_corpus = unreadable
cli.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_any_exception_before_the_agreement_check_ends_every_rank():
    pytest.importorskip("mpi4py.MPI")
    job = run_mpiexec(["-n", "2", sys.executable, "-c", FAILING_RANK, *EP_FLAGS], timeout=90, env=ONE_THREAD)
    assert job.returncode != 0
    assert job.stderr.count("rank 0 of 2: [Errno 5] the corpus cannot be read (on purpose") == 2, job.stderr


# ---------------------------------------------------------------------------
# --out and --checkpoint may not lie inside one another
# ---------------------------------------------------------------------------

def test_a_checkpoint_folder_inside_out_is_refused_before_the_first_step(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nothing_runs(monkeypatch)
    error = refused([*FLAGS, "--steps", "3", "--out", "x.json", "--checkpoint", "x.json/ck"], capsys)
    assert "argument --checkpoint: x.json/ck lies inside --out x.json" in error, error
    # Through a symbolic link, and with the log's name given another way: both paths are resolved.
    (tmp_path / "alias").symlink_to(tmp_path / "run.json")
    error = refused([*FLAGS, "--steps", "3", "--out", "./sub/../run.json", "--checkpoint", "alias/ck"], capsys)
    assert "argument --checkpoint: alias/ck lies inside --out" in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias"]  # nothing was created
    # The other way round is refused as before.
    error = refused([*FLAGS, "--steps", "3", "--out", "ck/run.json", "--checkpoint", "ck"], capsys)
    assert "argument --out: ck/run.json lies inside the checkpoint folder ck" in error


def test_a_log_beside_its_checkpoint_folder_is_fine(tmp_path):
    main([*FLAGS, "--steps", "1", "--out", str(tmp_path / "x.json"), "--checkpoint", str(tmp_path / "x.json.ck")])
    assert json.loads((tmp_path / "x.json").read_text())["steps"][0]["step"] == 1
    assert read_checkpoint(tmp_path / "x.json.ck").step == 1


# ---------------------------------------------------------------------------
# Balancer.restore checks the history it reads
# ---------------------------------------------------------------------------

def saved_balancer(tmp_path: Path) -> Path:
    """A QuantileBalancer of 8 experts after two steps, saved."""
    scores = np.random.default_rng(0).random((64, 8)).astype(np.float32)
    balancer = QuantileBalancer(8, 2)
    balancer.step(scores)
    balancer.step(scores)
    path = tmp_path / "good.npz"
    balancer.save(path)
    return path


def edited_npz(good: Path, where: Path, **changes: np.ndarray) -> Path:
    with np.load(good) as data:
        fields = {name: data[name] for name in data.files}
    fields.update(changes)
    np.savez(where, **fields)
    return where


@pytest.mark.parametrize(("changes", "pattern"), [
    (dict(loads=np.zeros((2, 3), np.int64)), r"'loads' must be integer counts \[s, 8\] .*got int64 of shape \[2, 3\]"),
    (dict(loads=-np.ones((2, 8), np.int64)), r"'loads' must hold token counts from 0 .*got values from -1"),
    (dict(loads=np.full((2, 8), 0.5)), r"'loads' must be integer counts \[s, 8\] .*got float64 of shape \[2, 8\]"),
    (dict(loads=np.ones((2, 8), bool)), r"'loads' must be integer counts .*got bool"),
    (dict(biases=np.zeros((5, 3), np.float32)), r"'biases' must be float32 \[2, 8\] .*got float32 of shape \[5, 3\]"),
    (dict(biases=np.zeros((2, 8), np.float64)), r"'biases' must be float32 \[2, 8\] .*got float64 of shape \[2, 8\]"),
    (dict(step_count=np.int64(-3)), r"'step_count' must be the number of steps in the history \(2, .*got -3"),
    (dict(step_count=np.int64(5)), r"'step_count' must be the number of steps in the history \(2, .*got 5"),
    (dict(ratios=np.zeros((2, 2))), r"'ratios' must be floats \[2\] .*got float64 of shape \[2, 2\]"),
    (dict(ratios=np.ones(2, np.int64)), r"'ratios' must be floats \[2\] .*got int64 of shape \[2\]"),
    (dict(ratios=np.array([1.5, np.nan])), r"'ratios' must hold max/min load ratios \(at least 1, or infinity\), "
                                           r"got nan"),
    (dict(ratios=np.array([1.5, 0.5])), r"'ratios' must hold max/min load ratios .*got 0.5"),
])
def test_restore_refuses_a_history_save_could_not_have_written(tmp_path, changes, pattern):
    path = edited_npz(saved_balancer(tmp_path), tmp_path / "edited.npz", **changes)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: the field {pattern}"):
        Balancer.restore(path)


def test_restore_still_reads_what_save_writes_and_the_next_save_works(tmp_path):
    good = saved_balancer(tmp_path)
    restored = Balancer.restore(good)
    assert restored.step_count == 2 and len(restored.loads) == len(restored.ratios) == len(restored.biases) == 2
    assert all(row.dtype == np.int64 for row in restored.loads)
    restored.save(tmp_path / "again.npz")
    with np.load(good) as before, np.load(tmp_path / "again.npz") as after:
        assert before.files == after.files
        for name in before.files:
            assert before[name].tobytes() == after[name].tobytes(), name
    # A balancer that never stepped: an empty history of s = 0 steps.
    QuantileBalancer(8, 2).save(tmp_path / "fresh.npz")
    assert Balancer.restore(tmp_path / "fresh.npz").step_count == 0


# ---------------------------------------------------------------------------
# The shipped balancers: load_state_dict, the bias's length, the grad switch
# ---------------------------------------------------------------------------

SCORES = np.random.default_rng(0).random((64, 8)).astype(np.float32)


@pytest.mark.parametrize(("state", "error", "pattern"), [
    ({"qb_bias": np.zeros(3), "qb_bin_bounds": np.array([-1.0, 1.0])}, ValueError,
     r"state\['qb_bias'\] must have shape \[8\] .*got \[3\]"),
    ({"qb_bias": np.zeros(8), "qb_bin_bounds": np.zeros(5)}, ValueError,
     r"state\['qb_bin_bounds'\] must have shape \[2\] .*got \[5\]"),
    ({"qb_bias": np.zeros(8)}, ValueError, r"exactly the keys \['qb_bias', 'qb_bin_bounds'\]; missing "
                                           r"\['qb_bin_bounds'\]"),
    ({"qb_bias": np.zeros(8), "qb_bin_bounds": np.array([-1.0, 1.0]), "qb_histogram": np.zeros((8, 10))},
     ValueError, r"unexpected \['qb_histogram'\]"),
    ({"qb_bias": np.full(8, np.nan), "qb_bin_bounds": np.array([-1.0, 1.0])}, ValueError,
     r"state\['qb_bias'\] must be finite"),
    ({"qb_bias": np.full(8, 1e300), "qb_bin_bounds": np.array([-1.0, 1.0])}, ValueError,
     r"state\['qb_bias'\] in float32 must be finite"),
    ({"qb_bias": np.zeros(8), "qb_bin_bounds": np.array([1.0, -1.0])}, ValueError,
     r"state\['qb_bin_bounds'\] must be a range \(low, high\) with low < high.*got \(1, -1\)"),
    ({"qb_bias": np.zeros(8), "qb_bin_bounds": np.array([np.nan, 1.0])}, ValueError,
     r"state\['qb_bin_bounds'\] must be finite"),
    ({"qb_bias": np.zeros(8, np.int64), "qb_bin_bounds": np.array([-1.0, 1.0])}, TypeError,
     r"state\['qb_bias'\] must be a real floating array"),
    ([("qb_bias", np.zeros(8))], TypeError, r"state must be a dict"),
])
def test_megatron_load_state_dict_refuses_what_torch_strict_would(state, error, pattern):
    router = MegatronGlobalBatchQB(8, 2)
    router.finalize()  # nothing counted: the bias and the range stay
    router.route(SCORES)
    router.finalize()
    before = router.state_dict()
    with pytest.raises(error, match=pattern):
        router.load_state_dict(state)
    after = router.state_dict()  # left as it was, and still routes
    assert all(np.array_equal(before[key], after[key]) for key in before)
    assert router.route(SCORES).shape == (64, 2)


@pytest.mark.parametrize(("state", "error", "pattern"), [
    ({"expert_bias_E": np.zeros(3)}, ValueError, r"state\['expert_bias_E'\] must have shape \[8\] .*got \[3\]"),
    ({}, ValueError, r"exactly the keys \['expert_bias_E'\]; missing \['expert_bias_E'\]"),
    ({"expert_bias_E": np.zeros(8), "bias": np.zeros(8)}, ValueError, r"unexpected \['bias'\]"),
    ({"expert_bias_E": np.full(8, np.inf)}, ValueError, r"state\['expert_bias_E'\] must be finite"),
    ({"expert_bias_E": [0.0] * 8}, TypeError, r"state\['expert_bias_E'\] must be an array"),
])
def test_torchtitan_load_state_dict_refuses_what_torch_strict_would(state, error, pattern):
    balancer = TorchtitanQuantileBalancer(8, 2)
    balancer.route(SCORES)
    balancer.step()
    before = balancer.state_dict()["expert_bias_E"]
    with pytest.raises(error, match=pattern):
        balancer.load_state_dict(state)
    assert np.array_equal(balancer.expert_bias, before) and balancer.route(SCORES).shape == (64, 2)


def test_the_shipped_state_dicts_round_trip():
    router, twin = MegatronGlobalBatchQB(8, 2), MegatronGlobalBatchQB(8, 2)
    router.route(SCORES)
    router.finalize()
    twin.load_state_dict(router.state_dict())
    assert np.array_equal(twin.route(SCORES), router.route(SCORES))
    balancer, other = TorchtitanQuantileBalancer(8, 2), TorchtitanQuantileBalancer(8, 2)
    balancer.route(SCORES)
    balancer.step()
    other.load_state_dict({"expert_bias_E": balancer.state_dict()["expert_bias_E"].astype(np.float64)})
    assert other.expert_bias.dtype == np.float32 and np.array_equal(other.expert_bias, balancer.expert_bias)


@pytest.mark.parametrize("cls", [MegatronGlobalBatchQB, TorchtitanQuantileBalancer])
def test_a_bias_of_another_length_does_not_change_num_experts(cls):
    with pytest.raises(ValueError, match=r"bias must have shape \[8\] \(one entry per expert: num_experts=8\), got "
                                         r"\[4\]"):
        cls(8, 2, bias=np.zeros(4, np.float32))
    assert cls(8, 2, bias=np.zeros(8, np.float32)).num_experts == 8


def test_the_update_functions_still_take_their_experts_from_the_bias():
    bias = np.zeros(8, np.float32)
    assert megatron_qb_update([SCORES], bias, 2, estimation_scope="global_batch").shape == (8,)
    assert torchtitan_qb_update([SCORES], bias, 2).shape == (8,)
    with pytest.raises(TypeError, match=r"bias must be an array"):
        torchtitan_qb_update([SCORES], [0.0] * 8, 2)


@pytest.mark.parametrize("value", ["no", 0, 1, None, "False"])
def test_grad_enabled_is_a_real_boolean(value):
    router = MegatronGlobalBatchQB(8, 2)
    with pytest.raises(TypeError, match=rf"grad_enabled must be True or False, got {type(value).__name__}"):
        router.route(SCORES, grad_enabled=value)
    assert int(router.qb_histogram.sum()) == 0


def test_grad_enabled_and_the_router_switches_decide_what_is_counted():
    for grad, counted in ((True, 64), (False, 0), (np.True_, 64), (np.False_, 0)):
        router = MegatronGlobalBatchQB(8, 2)
        router.route(SCORES, grad_enabled=grad)
        assert int(router.qb_histogram[0].sum()) == counted
    router = MegatronGlobalBatchQB(8, 2)
    router.frozen_expert_bias = "no"
    with pytest.raises(TypeError, match=r"MegatronGlobalBatchQB.frozen_expert_bias must be True or False"):
        router.route(SCORES)
    balancer = TorchtitanQuantileBalancer(8, 2)
    balancer.training = 0
    with pytest.raises(TypeError, match=r"TorchtitanQuantileBalancer.training must be True or False"):
        balancer.route(SCORES)


# ---------------------------------------------------------------------------
# The shipped update functions and load_ratio check their arguments
# ---------------------------------------------------------------------------

HISTOGRAM = np.ones((8, 10), np.int64)
ZERO8 = np.zeros(8, np.float32)
BOUNDS = np.array([-1.0, 1.0])


@pytest.mark.parametrize(("call", "error", "pattern"), [
    (lambda: torchtitan_estimate(np.ones(8, np.int64), ZERO8, 2), ValueError,
     r"histogram must be integer counts \[E, bins\] .*got int64 of shape \[8\]"),
    (lambda: torchtitan_estimate(HISTOGRAM, np.zeros(3, np.float32), 2), ValueError,
     r"bias must have shape \[8\] .*got \[3\]"),
    (lambda: torchtitan_estimate(np.full((8, 10), 0.5), ZERO8, 2), ValueError,
     r"histogram must be integer counts .*got float64"),
    (lambda: torchtitan_estimate(-HISTOGRAM, ZERO8, 2), ValueError,
     r"histogram must hold non-negative counts, got a smallest count of -1"),
    (lambda: torchtitan_estimate(HISTOGRAM, np.full(8, np.nan, np.float32), 2), ValueError, r"bias must be finite"),
    (lambda: megatron_global_batch_update(HISTOGRAM, np.array([np.nan, 1.0]), ZERO8, 2), ValueError,
     r"bin_bounds must be finite"),
    (lambda: megatron_global_batch_update(HISTOGRAM, np.array([1.0, -1.0]), ZERO8, 2), ValueError,
     r"bin_bounds must be a range \(low, high\) with low < high.*got \(1, -1\)"),
    (lambda: megatron_global_batch_update(HISTOGRAM, np.array([1.0, 1.0]), ZERO8, 2), ValueError,
     r"bin_bounds must be a range \(low, high\) with low < high"),
    (lambda: megatron_global_batch_update(HISTOGRAM, np.array([-1.0, 0.0, 1.0]), ZERO8, 2), ValueError,
     r"bin_bounds must have shape \[2\]"),
    (lambda: megatron_global_batch_update(-HISTOGRAM, BOUNDS, ZERO8, 2), ValueError,
     r"histogram must hold non-negative counts"),
    (lambda: megatron_global_batch_update(HISTOGRAM, BOUNDS, np.zeros(3), 2), ValueError,
     r"bias must have shape \[8\]"),
    (lambda: load_ratio(np.zeros(0, np.int64)), ValueError, r"load must be token counts \[n\] .*got int64 of shape "
                                                            r"\[0\]"),
    (lambda: load_ratio(np.ones((2, 4), np.int64)), ValueError, r"load must be token counts \[n\]"),
    (lambda: load_ratio(np.array([2.5, 4.0])), ValueError, r"load must be token counts \[n\] .*got float64"),
    (lambda: load_ratio(np.array([-1, 4])), ValueError, r"load must hold non-negative token counts, got a smallest "
                                                        r"count of -1"),
    (lambda: load_ratio([2, 4]), TypeError, r"load must be an array of token counts \[n\], got list"),
])
def test_the_shipped_updates_and_load_ratio_refuse_bad_arguments_by_name(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_the_shipped_updates_keep_their_shipped_answers():
    # torchtitan's documented NaN on a step with no token stays; Megatron-Core keeps the bias and the range.
    assert np.isnan(torchtitan_estimate(np.zeros((8, 10), np.int32), ZERO8, 2)).all()
    bias, bounds = megatron_global_batch_update(np.zeros((8, 10), np.int32), BOUNDS, ZERO8, 2)
    assert np.array_equal(bias, ZERO8) and np.array_equal(bounds, BOUNDS.astype(np.float32))
    assert load_ratio(np.array([2, 4, 3])) == 2.0 and load_ratio(np.array([0, 4], np.uint8)) == np.inf


# ---------------------------------------------------------------------------
# adam.npz is checked on resume, as params.npz is
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of three steps, written by the command; each test edits a copy."""
    folder = tmp_path_factory.mktemp("adam") / "ck"
    main([*FLAGS, "--steps", "3", "--checkpoint", str(folder)])
    return folder


def digest(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rewrite_adam(source: Path, folder: Path, change: Callable[[dict[str, np.ndarray]], None]) -> Path:
    """A copy of the checkpoint `source` in `folder` whose `adam.npz` is changed by `change`, with every digest
    repaired (the manifest's and the pointer's), as a tool that re-saved the state would; its `adam.npz`."""
    shutil.copytree(source, folder)
    pointer = json.loads((folder / "latest.json").read_text())
    step = folder / pointer["checkpoint"]
    with np.load(step / "adam.npz") as data:
        arrays = {name: data[name] for name in data.files}
    change(arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    (step / "adam.npz").write_bytes(buffer.getvalue())
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["adam.npz"] = digest(buffer.getvalue())
    text = json.dumps(manifest, indent=1).encode()
    (step / "manifest.json").write_bytes(text)
    pointer["manifest"] = digest(text)
    (folder / "latest.json").write_text(json.dumps(pointer, indent=1))
    return step / "adam.npz"


@pytest.mark.parametrize(("change", "pattern"), [
    (lambda a: a.pop("m.out.weight"), r" must hold exactly Adam's moments m.<name> and v.<name> of the 26 trained "
                                      r"parameters: missing \['m.out.weight'\]"),
    (lambda a: a.__setitem__("m.extra", np.zeros(3, np.float32)), r" must hold exactly .*: unexpected \['m.extra'\]"),
    (lambda a: a.__setitem__("m.out.weight", np.zeros((3, 3), np.float32)),
     r": m.out.weight must be float32 of shape \[256, 16\] \(its parameter's\), got float32 of shape \[3, 3\]"),
    (lambda a: a.__setitem__("v.out.weight", a["v.out.weight"].astype(np.float64)),
     r": v.out.weight must be float32 of shape \[256, 16\] .*got float64 of shape \[256, 16\]"),
    (lambda a: a["m.mix.weight"].__setitem__((0, 0), np.nan), r": m.mix.weight must be finite, got 1 entries"),
    (lambda a: a.__setitem__("v.out.weight", -np.ones_like(a["v.out.weight"])),
     r": v.out.weight must be non-negative \(a mean of squared gradients\), got a smallest entry of -1"),
])
def test_resume_refuses_an_adam_state_it_cannot_train_on(tmp_path, checkpoint, corpus, change, pattern):
    adam = rewrite_adam(checkpoint, tmp_path / "ck", change)
    config = dataclasses.replace(read_checkpoint(tmp_path / "ck").config, steps=5)
    with pytest.raises(ValueError, match=re.escape(str(adam)) + pattern):
        train(config, corpus=corpus, resume=tmp_path / "ck")


def test_a_negative_moment_ends_the_command_instead_of_training_on_nan(tmp_path, checkpoint, capsys):
    """Before, the run went on with a NaN update on every later step and exit status 0."""
    rewrite_adam(checkpoint, tmp_path / "ck",
                 lambda a: a.__setitem__("v.out.weight", -np.ones_like(a["v.out.weight"])))
    with pytest.raises(SystemExit) as exc:
        main(["--resume", str(tmp_path / "ck"), "--steps", "5", "--quiet"])
    assert exc.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "adam.npz: v.out.weight must be non-negative" in error[0]
    assert read_checkpoint(tmp_path / "ck").step == 3  # nothing was trained or written


def test_an_untouched_adam_state_resumes(tmp_path, checkpoint, corpus):
    rewrite_adam(checkpoint, tmp_path / "ck", lambda a: None)
    config = dataclasses.replace(read_checkpoint(tmp_path / "ck").config, steps=4)
    log = train(config, corpus=corpus, resume=tmp_path / "ck")
    assert [record["step"] for record in log["steps"]] == [1, 2, 3, 4]
    assert np.isfinite(log["steps"][-1]["loss"])
