"""Speed and memory of the Appendix D histogram estimator at a global batch of 4,194,304 tokens.

The global batch (n = 896 experts, k = 16, B = 1000 bins, float32 scores) is
streamed through 8 simulated ranks, each taking 4 micro-batches of scores from
a seeded router. Each rank keeps one `BiasHistogram`; at the end the 8 count
matrices are summed (the all-reduce) and the bias is read out. Every micro-batch
is cut into chunks of rows; for each chunk the script times the cutoff pass
(`refimpl.balancing.cutoffs`, the values-only (k+1)-th largest biased score that
`BiasHistogram.add` uses by itself) and the histogram pass (`BiasHistogram.add`
with those cutoffs) separately, and it reports:

* wall time of each phase and end to end, and nanoseconds per margin
  (one margin = one token-expert pair; 3,758,096,384 of them);
* the CPU time of this process for the same phases (less inflated by other
  programs on a shared machine);
* the peak resident memory;
* two side measurements on the first rank's micro-batches, taken in the same
  rounds and not counted in the streamed run: the cutoff pass through
  routing's `selection_cutoff` instead, which also ranks the expert ids of the
  route (bitwise the same cutoffs, checked), and a
  straightforward histogram pass (whole-chunk array expressions and one
  `np.bincount`, the same counts, checked).

Targets: under 60 s end to end, under 2 GB peak resident memory, at most 4 ns
per margin for the histogram pass.

Run: `python benchmarks/bench_histogram.py` (writes
`docs/benchmarks/histogram.{json,md}`); `--smoke` runs tiny sizes and writes
nothing; `--tokens` changes the global batch.
"""

from __future__ import annotations

import resource
import sys
import time

import numpy as np
from common import (
    base_parser,
    command_line,
    machine_info,
    markdown_table,
    output_dir,
    set_blas_threads,
    write_results,
)

from refimpl.balancing import cutoffs
from refimpl.balancing.histogram import BiasHistogram
from refimpl.layer.routing import selection_cutoff

TARGET_SECONDS, TARGET_MB, TARGET_NS = 60.0, 2048.0, 4.0


class SeededRouter:
    """Sigmoid scores from a fixed random router; each (rank, micro-batch) draws its own tokens."""

    def __init__(self, n: int, width: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        weight = (rng.standard_normal((n, width)) / np.sqrt(width)).astype(np.float32)  # [n, d]
        self.negated_weight = -weight  # so that one product gives -z directly
        self.mean = (0.5 * rng.standard_normal(width)).astype(np.float32)  # makes some experts popular
        self.seed = seed

    def scores(self, rank: int, micro_batch: int, out: np.ndarray, rows: int = 8192) -> np.ndarray:
        """Fill `out` `[m_b, n]` with the scores of one micro-batch, a slab of rows at a time."""
        rng = np.random.default_rng([self.seed, rank, micro_batch])
        width = self.negated_weight.shape[1]
        for start in range(0, out.shape[0], rows):
            slab = out[start:start + rows]
            x = rng.standard_normal((slab.shape[0], width), dtype=np.float32) + self.mean
            np.matmul(x, self.negated_weight.T, out=slab)  # -z
            # $$s = \sigma(z) = 1 / (1 + e^{-z})$$, in place
            np.exp(slab, out=slab)
            slab += 1.0
            np.reciprocal(slab, out=slab)
        return out


def routing_cutoff(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """The same cutoffs through routing's top-(k+1), which also ranks the route's expert ids."""
    _, alpha = selection_cutoff(scores, bias, top_k)
    return alpha


def straightforward_counts(chunk: np.ndarray, alpha: np.ndarray, low: float, high: float, bins: int) -> np.ndarray:
    """The baseline: the same bins in whole-chunk array expressions and one `np.bincount`, `[n, B]`."""
    n = chunk.shape[1]
    scale = np.float32(bins / (high - low))
    t = np.clip(((alpha - np.float32(low))[:, None] - chunk) * scale, 0, bins - 1)  # [c, n]
    ids = t.astype(np.int64) + np.arange(n, dtype=np.int64) * bins  # [c, n]
    return np.bincount(ids.ravel(), minlength=n * bins).reshape(n, bins)


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="global batch m (default 4,194,304)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=1 << 22, help="margins per chunk")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        set_blas_threads(args.threads)
    n, k, bins = (64, 4, 100) if args.smoke else (896, 16, 1000)
    m = args.tokens or (2048 if args.smoke else 4_194_304)
    blocks = args.ranks * args.micro_batches
    if m % blocks:
        parser.error(f"--tokens must be a multiple of ranks x micro-batches = {blocks}")
    per_block = m // blocks
    margins = m * n
    router = SeededRouter(n, 32, args.seed)
    bias = (0.02 * np.random.default_rng(args.seed + 1).standard_normal(n)).astype(np.float32)
    rows = max(1, args.chunk_size // n)

    print(f"global batch {m:,} tokens x {n} experts = {margins:,} margins; k = {k}, B = {bins}")
    print(f"{args.ranks} ranks x {args.micro_batches} micro-batches of {per_block:,} tokens; chunks of {rows:,} rows")

    start, start_cpu = time.perf_counter(), time.process_time()
    wall = {"generate scores": 0.0, "cutoff pass": 0.0, "histogram pass": 0.0}
    cpu = dict.fromkeys(wall, 0.0)
    alternative = {"seconds": 0.0, "cpu": 0.0, "margins": 0}
    baseline = {"seconds": 0.0, "cpu": 0.0}
    check_seconds = check_cpu = 0.0
    block = np.empty((per_block, n), dtype=np.float32)  # one micro-batch of scores, reused
    histograms = []
    for rank in range(args.ranks):
        histogram = BiasHistogram(bias, k, bins, chunk_size=args.chunk_size)
        for micro_batch in range(args.micro_batches):
            t0, c0 = time.perf_counter(), time.process_time()
            router.scores(rank, micro_batch, out=block)
            wall["generate scores"] += time.perf_counter() - t0
            cpu["generate scores"] += time.process_time() - c0
            for first in range(0, per_block, rows):
                chunk = block[first:first + rows]
                t0, c0 = time.perf_counter(), time.process_time()
                alpha = cutoffs(chunk, bias, k)
                t1, c1 = time.perf_counter(), time.process_time()
                histogram.add(chunk, cutoff=alpha)
                t2, c2 = time.perf_counter(), time.process_time()
                wall["cutoff pass"] += t1 - t0
                wall["histogram pass"] += t2 - t1
                cpu["cutoff pass"] += c1 - c0
                cpu["histogram pass"] += c2 - c1
                if rank == 0:  # routing's index-returning top-(k+1), on the first rank's micro-batches
                    t3, c3 = time.perf_counter(), time.process_time()
                    other = routing_cutoff(chunk, bias, k)
                    alternative["seconds"] += time.perf_counter() - t3
                    alternative["cpu"] += time.process_time() - c3
                    alternative["margins"] += chunk.size
                    assert np.array_equal(alpha, other), "the two cutoffs disagree"
                    t4, c4 = time.perf_counter(), time.process_time()
                    plain = straightforward_counts(chunk, alpha, histogram.low, histogram.high, bins)
                    baseline["seconds"] += time.perf_counter() - t4
                    baseline["cpu"] += time.process_time() - c4
                    t5, c5 = time.perf_counter(), time.process_time()
                    reference = BiasHistogram(bias, k, bins).add(chunk, cutoff=alpha).counts
                    assert np.array_equal(plain, reference), "the baseline counts differently"
                    check_seconds += time.perf_counter() - t5
                    check_cpu += time.process_time() - c5
        histograms.append(histogram)

    t0, c0 = time.perf_counter(), time.process_time()
    total = histograms[0].counts.copy()
    for histogram in histograms[1:]:
        total += histogram.counts  # the all-reduce: one integer sum
    wall["all-reduce (sum)"] = time.perf_counter() - t0
    cpu["all-reduce (sum)"] = time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    histograms[0].counts = total
    new_bias = histograms[0].new_bias()
    wall["read-out"] = time.perf_counter() - t0
    cpu["read-out"] = time.process_time() - c0
    alternative_wall_rate = alternative["seconds"] / alternative["margins"]
    alternative_cpu_rate = alternative["cpu"] / alternative["margins"]
    baseline_wall_rate = baseline["seconds"] / alternative["margins"]
    baseline_cpu_rate = baseline["cpu"] / alternative["margins"]
    side = [alternative, baseline]  # side measurements, not part of the streamed run
    elapsed = time.perf_counter() - start - sum(x["seconds"] for x in side) - check_seconds
    elapsed_cpu = time.process_time() - start_cpu - sum(x["cpu"] for x in side) - check_cpu
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert int(total.sum()) == margins and (total.sum(axis=1) == m).all()

    def ns(seconds: float) -> float:
        return seconds / margins * 1e9

    print()
    print(f"{'phase':>20} {'wall s':>8} {'ns/margin':>10} {'CPU s':>8} {'ns/margin':>10}")
    table = []
    for name in wall:
        print(f"{name:>20} {wall[name]:8.2f} {ns(wall[name]):10.2f} {cpu[name]:8.2f} {ns(cpu[name]):10.2f}")
        table.append([name, f"{wall[name]:.2f}", f"{ns(wall[name]):.2f}", f"{cpu[name]:.2f}", f"{ns(cpu[name]):.2f}"])
    print(f"{'end to end':>20} {elapsed:8.2f} {ns(elapsed):10.2f} {elapsed_cpu:8.2f} {ns(elapsed_cpu):10.2f}")
    table.append(["end to end", f"{elapsed:.2f}", f"{ns(elapsed):.2f}", f"{elapsed_cpu:.2f}", f"{ns(elapsed_cpu):.2f}"])
    print(f"(routing's index-returning cutoff, measured on rank 0's {alternative['margins']:,} margins and not counted above: "
          f"{alternative_wall_rate * 1e9:.2f} ns/margin wall, {alternative_cpu_rate * 1e9:.2f} CPU)")
    print(f"(straightforward histogram, whole-chunk expressions and one np.bincount, same margins: "
          f"{baseline_wall_rate * 1e9:.2f} ns/margin wall, {baseline_cpu_rate * 1e9:.2f} CPU)")
    projected = elapsed - wall["cutoff pass"] + alternative_wall_rate * margins
    projected_cpu = elapsed_cpu - cpu["cutoff pass"] + alternative_cpu_rate * margins
    print(f"end to end with routing's cutoff instead, projected: {projected:.1f} s wall, "
          f"{projected_cpu:.1f} s CPU")
    print()
    print(f"peak resident memory: {peak_mb:,.0f} MB")
    print(f"all-reduce payload: n*B int64 = {n * bins * 8:,} bytes; "
          f"raw float32 margins would be {margins * 4:,} bytes ({margins * 4 / (n * bins * 8):,.0f}x)")
    print(f"new bias: spread {float(new_bias.max() - new_bias.min()):.4f}, bin width {histograms[0].width:.2e}")
    targets = {f"end to end < {TARGET_SECONDS:.0f} s": elapsed < TARGET_SECONDS,
               f"peak RSS < {TARGET_MB / 1024:.0f} GB": peak_mb < TARGET_MB,
               f"histogram pass <= {TARGET_NS:.0f} ns/margin (wall)": ns(wall["histogram pass"]) <= TARGET_NS}
    if args.smoke:
        print("targets: not judged (smoke sizes)")
    else:
        print("targets: " + "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in targets.items()))

    results = {
        "command": command_line(),
        "machine": machine_info(),
        "config": {"tokens": m, "experts": n, "top_k": k, "bins": bins, "ranks": args.ranks,
                   "micro_batches": args.micro_batches, "chunk_rows": rows, "margins": margins},
        "wall_seconds": wall, "cpu_seconds": cpu, "end_to_end_seconds": elapsed, "end_to_end_cpu_seconds": elapsed_cpu,
        "ns_per_margin_wall": {name: ns(v) for name, v in wall.items()},
        "ns_per_margin_cpu": {name: ns(v) for name, v in cpu.items()},
        "routing_cutoff_ns_per_margin": {"wall": alternative_wall_rate * 1e9, "cpu": alternative_cpu_rate * 1e9,
                                             "margins": alternative["margins"]},
        "projected_end_to_end_with_routing_cutoff": projected,
        "projected_end_to_end_cpu_with_routing_cutoff": projected_cpu,
        "straightforward_histogram_ns_per_margin": {"wall": baseline_wall_rate * 1e9, "cpu": baseline_cpu_rate * 1e9,
                                                    "margins": alternative["margins"]},
        "peak_rss_mb": peak_mb,
        "allreduce_bytes": n * bins * 8, "raw_margin_bytes": margins * 4,
        "targets": targets, "smoke": args.smoke,
    }
    summary = markdown_table(["measure", "value"], [
        ["end to end", f"{elapsed:.1f} s"],
        ["peak resident memory", f"{peak_mb:,.0f} MB"],
        ["histogram pass", f"{ns(wall['histogram pass']):.2f} ns/margin"],
        ["straightforward np.bincount histogram (first rank)", f"{baseline_wall_rate * 1e9:.2f} ns/margin"],
        ["cutoff pass (values-only, refimpl.balancing.cutoffs)", f"{ns(wall['cutoff pass']):.2f} ns/margin"],
        ["cutoff pass through routing's selection_cutoff", f"{alternative_wall_rate * 1e9:.2f} ns/margin"],
        ["end to end with routing's cutoff (projected)", f"{projected:.1f} s ({projected_cpu:.1f} s CPU)"],
        *[[name, "met" if ok else "missed"] for name, ok in targets.items()]])
    write_results(
        "histogram", f"Histogram estimator, {m:,} tokens", results,
        [("Summary", summary),
         ("Phases", markdown_table(["phase", "wall s", "ns/margin", "CPU s", "ns/margin (CPU)"], table))],
        output_dir(args),
        notes=[f"n = {n}, k = {k}, B = {bins}; {args.ranks} simulated ranks x {args.micro_batches} micro-batches; "
               f"{margins:,} margins. Wall time is what the targets refer to."])
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
