"""The Appendix D example under a real MPI launcher, against a single process on the union.

`examples/22_mpi_allreduce.py` is started with `mpiexec -n 2` and `-n 4`
(the MPICH wheel's launcher, next to the test interpreter), each rank counting
its own micro-batches and summing the counts with one `Allreduce`. The bias
rank 0 saves must equal, bit for bit, the bias this test computes in one
process from the union of every rank's tokens; the example itself also
checks that all ranks agree and exits non-zero otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import load_script, run_under_mpiexec

from refimpl.balancing.histogram import histogram_balancing_update

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "22_mpi_allreduce.py"
SIZES = {"experts": 96, "top_k": 6, "bins": 500, "tokens": 700, "micro_batches": 3, "seed": 11}
TIMEOUT = 180


def load_example():
    return load_script(EXAMPLE, "mpi_allreduce_example")


def example_args() -> list[str]:
    return [f"--{key.replace('_', '-')}={value}" for key, value in SIZES.items()]


def single_process_bias(ranks: int) -> np.ndarray:
    """The union of every rank's tokens, in one block, in this process."""
    example = load_example()
    n = SIZES["experts"]
    blocks = [example.micro_batch_scores(n, SIZES["seed"], rank, micro_batch, SIZES["tokens"])
              for rank in range(ranks) for micro_batch in range(SIZES["micro_batches"])]
    bias = example.current_bias(n, SIZES["seed"])
    return histogram_balancing_update([np.concatenate(blocks)], bias, SIZES["top_k"], SIZES["bins"])


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_mpi_run_equals_one_process_on_the_union(ranks, tmp_path):
    save = tmp_path / "bias.npy"
    result = run_under_mpiexec(ranks, [str(EXAMPLE), *example_args(), f"--save-bias={save}"], timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"{ranks} ranks (mpiexec)" in out, out  # really launched by MPI, not simulated
    assert "identical bias on every rank: yes" in out
    assert "equal to one process holding the union of all tokens: yes, bit for bit" in out
    # One report line per rank, each holding the same bits as rank 0.
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [int(row[0]) for row in rows] == list(range(ranks))
    assert all(row[-1] == "yes" for row in rows)
    tokens = SIZES["tokens"] * SIZES["micro_batches"]
    assert all(row[1] == f"{tokens:,}" and row[2] == f"{tokens * SIZES['experts']:,}" for row in rows)
    # The saved bias against this test's own single-process computation.
    mpi_bias = np.load(save)
    expected = single_process_bias(ranks)
    assert mpi_bias.dtype == expected.dtype
    assert mpi_bias.tobytes() == expected.tobytes()


def test_simulated_run_equals_one_process_on_the_union(tmp_path, capsys):
    save = tmp_path / "bias.npy"
    example = load_example()
    assert example.main([*example_args(), "--ranks=3", f"--save-bias={save}"])
    out = capsys.readouterr().out
    assert "3 ranks (simulated in one process)" in out
    assert np.load(save).tobytes() == single_process_bias(3).tobytes()
