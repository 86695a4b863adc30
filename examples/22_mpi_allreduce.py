r"""Appendix D over MPI: one integer all-reduce per step

The histogram estimator run the way a training job runs it. Every rank of an
MPI job draws its own tokens from the same seeded router, takes several
micro-batches one after another, and adds each one's required biases
$r_{i,j} = \alpha_i - s_{i,j}$ to its own $n \times B$ count matrix, with no
communication. At the end of the step a single `Allreduce` (a sum) of those
integer counts gives every rank the histogram of the global batch, and each
rank reads the new bias from it on its own.

Each rank's report (its token count, its local counts and the first values of
the bias it derived) is gathered to rank 0 and printed there, so the
lines do not interleave. The script then checks that every rank holds the same
bias bit for bit, and that it equals the bias of a single process holding the
union of all tokens in one block, and prints the bytes the all-reduce moved
($nB$ int64 counts) against the bytes needed to gather the raw margins
($mn$ float32 values).

Launch it with MPI (`mpi4py` and the MPICH wheel from PyPI supply `mpiexec`):

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py examples/22_mpi_allreduce.py

Without `mpiexec` the ranks are simulated one after another in a single
process (`--ranks`, default 4), the all-reduce becomes a sum of the count
matrices, and the numbers printed are the same: that is the run shown below.
"""

# %%
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from refimpl.balancing.histogram import BiasHistogram, histogram_balancing_update
from refimpl.layer.routing import router_scores


# %%
def launched_by_mpiexec() -> bool:
    """True when an MPI launcher started this process (MPICH/Hydra, Open MPI or PMIx set these)."""
    return any(name in os.environ for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))


# %%
def router(n: int, seed: int, width: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """The router every rank shares: weights `[n, width]` and a mean token that makes some experts popular."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, width)) / np.sqrt(width)).astype(np.float32)
    mean = (0.5 * rng.standard_normal(width)).astype(np.float32)
    return weight, mean


# %%
def micro_batch_scores(n: int, seed: int, rank: int, micro_batch: int, tokens: int) -> np.ndarray:
    """Scores `[tokens, n]` of one rank's micro-batch: its own tokens, the shared router."""
    weight, mean = router(n, seed)
    x = np.random.default_rng([seed, 1 + rank, micro_batch]).standard_normal((tokens, weight.shape[1]))
    return router_scores((x + mean).astype(np.float32), weight)


# %%
def current_bias(n: int, seed: int) -> np.ndarray:
    """The bias $b^{(t)}$ that routes this step (left by the previous one), float32."""
    return (0.05 * np.random.default_rng([seed, 0]).standard_normal(n)).astype(np.float32)


# %%
def rank_step(rank: int, args: argparse.Namespace) -> BiasHistogram:
    """What one rank does during the step: count its micro-batches, no communication."""
    bias = current_bias(args.experts, args.seed)
    histogram = BiasHistogram(bias, args.top_k, args.bins)
    for micro_batch in range(args.micro_batches):
        histogram.add(micro_batch_scores(args.experts, args.seed, rank, micro_batch, args.tokens))
    return histogram


# %%
def report_line(rank: int, local_tokens: int, local_counts: int, bias: np.ndarray) -> str:
    head = " ".join(f"{v:+.5f}" for v in bias[:3])
    return f"{rank:>4} {local_tokens:>8,} {local_counts:>14,}  {head}"


# %%
def union_bias(ranks: int, args: argparse.Namespace) -> np.ndarray:
    """A single process holding every rank's tokens as one block."""
    union = np.concatenate([micro_batch_scores(args.experts, args.seed, rank, micro_batch, args.tokens)
                            for rank in range(ranks) for micro_batch in range(args.micro_batches)])
    return histogram_balancing_update([union], current_bias(args.experts, args.seed), args.top_k, args.bins)


# %%
def summary(ranks: int, mode: str, lines: list[str], biases: list[np.ndarray], total: BiasHistogram,
            args: argparse.Namespace) -> bool:
    """Print the gathered reports and the checks; True when every check holds."""
    n, bins = args.experts, args.bins
    m = total.tokens
    margins = m * n
    print(f"{ranks} ranks ({mode}), {args.micro_batches} micro-batches of {args.tokens:,} tokens per rank")
    print(f"n = {n} experts, k = {args.top_k}, B = {bins} bins over [{total.low:.4f}, {total.high:.4f}], "
          f"bin width {total.width:.5f}")
    print()
    print("each rank's report (gathered to rank 0):")
    # The bits of the bias depend on the machine's arithmetic; that every rank holds the same bits does not.
    print(f"{'rank':>4} {'tokens':>8} {'local counts':>14}  b[0], b[1], b[2]             same bits as rank 0")
    for line, bias in zip(lines, biases, strict=True):
        print(f"{line}  {'yes' if bias.tobytes() == biases[0].tobytes() else 'NO'}")
    print()
    counts_bytes = n * bins * np.dtype(np.int64).itemsize
    print(f"all-reduce: one sum of {n} x {bins} int64 counts = {counts_bytes:,} bytes")
    print(f"gathering the raw margins instead: {m:,} tokens x {n} experts x 4 bytes = {margins * 4:,} bytes "
          f"({margins * 4 / counts_bytes:.1f}x the histogram)")
    print(f"global tokens, read from the summed counts: {m:,}; q = m k / n = {m * args.top_k / n:.2f}")
    identical = all(b.tobytes() == biases[0].tobytes() for b in biases)
    print(f"identical bias on every rank: {'yes' if identical else 'NO'}")
    single = union_bias(ranks, args)
    same = single.tobytes() == biases[0].tobytes()
    print(f"equal to one process holding the union of all tokens: {'yes, bit for bit' if same else 'NO'}")
    spread = biases[0].max() - biases[0].min()
    print(f"new bias: mean {float(biases[0].mean()):+.1e}, spread {float(spread):.4f}")
    if args.save_bias is not None:
        np.save(args.save_bias, biases[0])
    return identical and same


# %%
def run_mpi(args: argparse.Namespace) -> bool:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    histogram = rank_step(rank, args)
    local_tokens = histogram.tokens
    local_counts = int(histogram.counts.sum())
    # The only communication of the step: sum the integer counts of every rank, in place.
    comm.Allreduce(MPI.IN_PLACE, histogram.counts, op=MPI.SUM)
    bias = histogram.new_bias()
    lines = comm.gather(report_line(rank, local_tokens, local_counts, bias), root=0)
    biases = comm.gather(bias, root=0)
    ok = True
    if rank == 0:
        ok = summary(size, "mpiexec", lines, biases, histogram, args)
    # The other ranks wait for rank 0's checks by polling with naps: MPICH's blocking calls spin,
    # which on a machine with fewer cores than ranks would take the CPU from rank 0.
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)
    return bool(comm.bcast(ok, root=0))


# %%
def run_simulated(args: argparse.Namespace) -> bool:
    histograms = [rank_step(rank, args) for rank in range(args.ranks)]
    local = [(h.tokens, int(h.counts.sum())) for h in histograms]
    # The all-reduce, in one process: every rank ends up holding the sum.
    total = sum(h.counts for h in histograms)
    for histogram in histograms:
        histogram.counts = total.copy()
    biases = [h.new_bias() for h in histograms]
    lines = [report_line(rank, *local[rank], biases[rank]) for rank in range(args.ranks)]
    return summary(args.ranks, "simulated in one process", lines, biases, histograms[0], args)


# %%
def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks to simulate when not launched by mpiexec")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--bins", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--save-bias", type=Path, default=None, help="rank 0 saves the new bias here (.npy)")
    parser.add_argument("--out", type=Path, default=None, help="accepted and unused: this example draws no figures")
    args = parser.parse_args(argv)

    # Step: One balancing step over the ranks
    # Each rank counts its micro-batches, one sum of the counts is the only communication, and each rank then
    # reads the new bias on its own.
    ok = run_mpi(args) if launched_by_mpiexec() else run_simulated(args)
    if not ok:
        raise SystemExit("the ranks disagree, or differ from the single-process result")

    # What to see: each rank counts its own 16,384 tokens, one count per token and expert: 14,680,064 = 16,384
    # x 896. After the sum every rank holds the same counts and reads the same bias bit for bit, equal to that
    # of one process holding all 65,536 tokens, because a sum of integers is exact in any order. The
    # all-reduce moves 7,168,000 bytes whatever the batch, 32.8x less than the raw margins of these tokens,
    # and the new bias is centred: its mean, -1.3e-10, is float32 rounding.

    return ok


# %%
if __name__ == "__main__":
    main()
