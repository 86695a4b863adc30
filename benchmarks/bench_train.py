"""Training throughput of the default `python -m refimpl.train` model, with one BLAS thread and with all of them.

Each timed call trains the default configuration (`TrainConfig()`: d = 64,
l = 32, n = 64, k = 4, f = 32, two layers, m = 1024 tokens per step, QB,
SiTU-GLU, latent norm on, float32) for `--steps` steps from a fresh start:
initialization, every step's forward and backward passes, the balancers and
Adam, the statistics of step 1 and one held-out evaluation at the end. The
two thread settings take turns (round-robin), so a change in the machine's
load falls on both alike. The result is tokens per second (m times the
steps, over the median wall time) and the CPU seconds per step.

Run: `python benchmarks/bench_train.py` (writes `docs/benchmarks/train.{json,md}`);
`--smoke` trains a tiny model for two steps and writes nothing.
"""

from __future__ import annotations

import time

from common import (
    available_cpus,
    base_parser,
    command_line,
    machine_info,
    markdown_table,
    output_dir,
    set_blas_threads,
    time_round_robin,
    write_results,
)

from refimpl.train import TrainConfig, default_layer, load_corpus, train


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per timed call")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.smoke else 3)
    steps = 2 if args.smoke else args.steps
    sizes = dict(batch=64, eval_batch=64, moe=default_layer(hidden_size=16, latent_size=8, num_experts=8, top_k=2,
                                                            intermediate_size=8)) if args.smoke else {}
    config = TrainConfig(steps=steps, eval_every=10**6, stats_every=10**6, **sizes)
    corpus = load_corpus()
    thread_counts = sorted({1, args.threads or available_cpus()})
    cpu: dict[int, list[float]] = {n: [] for n in thread_counts}

    def work(threads: int):
        def run() -> None:
            set_blas_threads(threads)
            start = time.process_time()
            train(config, corpus=corpus)
            cpu[threads].append(time.process_time() - start)
        return run

    timings = time_round_robin({f"{n} BLAS thread(s)": work(n) for n in thread_counts}, repeats=repeats)
    rows, results = [], {"command": command_line(), "machine": machine_info(), "config": config.to_record(),
                         "steps_per_call": steps, "runs": {}}
    for n, (label, timing) in zip(thread_counts, timings.items(), strict=True):
        tokens_per_second = config.batch * steps / timing.median
        cpu_per_step = min(cpu[n][-repeats:]) / steps
        results["runs"][label] = {"timing": timing.as_dict(), "tokens_per_second": tokens_per_second,
                                  "cpu_seconds_per_step": cpu_per_step}
        rows.append([label, f"{timing.median:.2f}", f"{timing.spread:.0%}", f"{tokens_per_second:,.0f}",
                     f"{1000 * timing.median / steps:.0f}", f"{1000 * cpu_per_step:.0f}"])
        print(f"{label}: {steps} steps in {timing.median:.2f} s (median of {repeats}, spread {timing.spread:.0%}): "
              f"{tokens_per_second:,.0f} tokens/s, CPU {1000 * cpu_per_step:.0f} ms per step")
    table = markdown_table(["setting", "seconds per call (median)", "spread", "tokens/s", "ms per step (wall)",
                            "CPU ms per step (best)"], rows)
    write_results("train", "Training throughput of the default model", results,
                  [(f"{steps} steps of {config.batch} tokens per timed call", table)], output_dir(args),
                  notes=["Each call trains the default `python -m refimpl.train` model from a fresh start; the "
                         "settings take turns. CPU time counts this process's threads only."])
    return results


if __name__ == "__main__":
    main()
