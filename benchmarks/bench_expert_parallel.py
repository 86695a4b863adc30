r"""Balance is speed: the padded expert product in one process, and `ep_forward` steps across ranks.

    python benchmarks/bench_expert_parallel.py            # one process, then P = 1, 2 and 4 ranks under mpiexec
    python benchmarks/bench_expert_parallel.py --smoke    # tiny sizes, one repeat: checks that it works

**One process.** Worked example 80 (`examples/80_balance_is_speed.py`) at
a larger size: the routed experts of one batch as one padded batched product
and as the grouped loop, for zero bias, the sign rule and Quantile Balancing,
timed in turns; the padded product's waste is max load / mean load - 1.

**Across ranks.** For each number of ranks $P$, worked example 81 (`examples/81_expert_parallel_mpi.py`)
is launched under the MPICH wheel's `mpiexec -n P`, one BLAS thread per rank.
Every rank holds $n/P$ experts and the same number of tokens from a skewed
router; the sign rule and Quantile Balancing are trained across the ranks on a
stream of earlier batches, and each of the three biases (zero, sign rule,
Quantile Balancing) routes a fresh batch. The table gives, per case, the
balance of the experts and of the ranks (max/mean load), the median step time
(all ranks, barrier to barrier) and each rank's time inside its experts. A
step cannot end before its slowest rank, so with one core per rank the step
time should follow the slowest rank's load; with more ranks than cores the
ranks share the cores and the step follows the *total* work instead, which
balancing does not change. Results go to `docs/benchmarks/expert_parallel.{md,json}`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import REPO, base_parser, command_line, machine_info, markdown_table, output_dir, write_results

EXAMPLE = REPO / "examples" / "81_expert_parallel_mpi.py"
PADDED_EXAMPLE = REPO / "examples" / "80_balance_is_speed.py"


def run_padded(sizes: list[str], repeats: int, timeout: float) -> dict[str, Any]:
    """Example 80 in a process of its own; its table as saved."""
    with tempfile.TemporaryDirectory() as tmp:
        save = Path(tmp) / "padded.json"
        command = [sys.executable, str(PADDED_EXAMPLE), "--repeats", str(repeats), "--save", str(save), *sizes]
        # One BLAS thread, as each rank of the MPI runs has.
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
        print(proc.stdout.strip())
        return json.loads(save.read_text())


def run(ranks: int, sizes: list[str], repeats: int, timeout: float) -> dict[str, Any]:
    """Example 81 under `mpiexec -n ranks`; its speed table as saved by rank 0."""
    with tempfile.TemporaryDirectory() as tmp:
        save = Path(tmp) / "speed.json"
        command = [sys.executable, str(EXAMPLE), "--ranks", str(ranks), "--repeats", str(repeats),
                   "--timeout", str(timeout), "--save", str(save), *sizes]
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout + 30)
        if proc.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
        print(proc.stdout.split("5. balance is speed")[-1].strip())
        return json.loads(save.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.smoke else 15)
    sizes = (["--experts", "8", "--width", "32", "--intermediate", "16", "--tokens", "128", "--train-tokens",
              "128", "--steps", "3", "--bins", "100"] if args.smoke
             else ["--tokens", "2048", "--steps", "30"])
    print("one process, padded product against the grouped loop:", flush=True)
    padded_sizes = (["--experts", "16", "--tokens", "256", "--latent", "16", "--intermediate", "16", "--steps", "3"]
                    if args.smoke else ["--experts", "64", "--tokens", "4096", "--steps", "30"])
    padded = run_padded(padded_sizes, repeats, args.timeout)
    base = padded["rows"][-1]
    padded_rows = [[row["case"], f"{row['max_over_mean']:.2f}", f"{100 * row['waste']:.0f} %",
                    f"{row['grouped_ms']:.1f} ({row['grouped_best_ms']:.1f})",
                    f"{row['padded_ms']:.1f} ({row['padded_best_ms']:.1f})",
                    f"{base['padded_best_ms'] * (1 + row['waste']) / (1 + base['waste']):.1f}",
                    f"{row['difference']:.1e}"]
                   for row in padded["rows"]]
    padded_table = markdown_table(["bias", "max/mean load", "padding", "grouped loop ms, median (best)",
                                   "padded product ms, median (best)", "padded best, predicted from the waste",
                                   "max diff / max u"], padded_rows)
    runs = {}
    for ranks in args.ranks:
        print(f"\n{ranks} rank{'s' if ranks > 1 else ''} under mpiexec:", flush=True)
        runs[ranks] = run(ranks, sizes, repeats, args.timeout)
    rows = []
    for ranks, result in runs.items():
        base = result["rows"][-1]
        for row in result["rows"]:
            rows.append([ranks, row["case"], f"{row['expert_max_over_mean']:.2f}", f"{row['rank_max_over_mean']:.2f}",
                         f"{row['step_ms']:.1f} ({row['best_ms']:.1f})",
                         f"{row['step_ms'] / base['step_ms']:.2f} ({row['best_ms'] / base['best_ms']:.2f})",
                         f"{row['rank_max_over_mean'] / base['rank_max_over_mean']:.2f}",
                         ", ".join(f"{t:.0f}" for t in row["expert_cpu_ms"]),
                         f"{max(row['expert_cpu_ms']) / max(base['expert_cpu_ms']):.2f}"])
    table = markdown_table(["ranks", "bias", "expert max/mean", "rank max/mean", "step ms, median (best)",
                            "step vs QB, median (best)", "slowest rank's load vs QB",
                            "processor ms in experts, per rank", "slowest rank's processor ms vs QB"], rows)
    print()
    print(table)
    machine = machine_info()
    results = {"command": command_line(), "machine": machine, "repeats": repeats, "padded": padded, "runs": runs}
    notes = ["Every process uses one BLAS thread. In one process the two products are timed in turns (median). "
             "Across ranks, each step is timed on every rank from one barrier to the next; the median and the best "
             "of the repeats are shown. With one rank the work is the same for every bias, so those rows show how "
             "much the machine's own noise moves a time. The processor time each rank spends in its experts "
             "(median over the repeats) is not inflated by other jobs on the machine. With more ranks than CPUs the ranks take turns on the "
             "cores, and MPICH's waiting ranks poll (they do not sleep), so those rows measure sharing, not the "
             "slowest rank."]
    settings = padded["settings"]
    padded_heading = (f"One process: the routed experts of {settings['tokens']:,} tokens, n = {settings['experts']}, "
                      f"k = {settings['top_k']}, l = {settings['latent']}, f = {settings['intermediate']}, float32")
    write_results("expert_parallel", "Balance is speed: padded expert products and expert-parallel steps", results,
                  [(padded_heading, padded_table), ("ep_forward step by number of ranks and bias", table)],
                  output_dir(args), notes=notes)
    return results


if __name__ == "__main__":
    main()
