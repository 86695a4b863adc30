"""Forward plus backward of one layer: the hand-written VJP against PyTorch autograd, same threads, in turns.

The layer is the benchmark configuration (d = 1024, l = 512, n = 128, k = 8,
f = 384, shared width 768), m = 4096 tokens, float32. One "step" is the
forward pass and the gradient of `sum(y * dy)` in the input and in every
weight. Three implementations of the same grouped algorithm (sort the
token-slots by expert, one GLU per expert on its slice, combine back):

* `refimpl.stable_latent_moe_vjp` (NumPy), the forward then `backward(dy)`;
* **PyTorch, careful**: autograd of the grouped forward with one leaf tensor
  per expert matrix and the sorted latents cut with `z.split(counts)`;
* **PyTorch, naive**: the same code with one stacked leaf per expert matrix
  (`w1[e]`) and the sorted latents sliced (`z[start:stop]`). Autograd then
  builds, for every expert, a zero gradient of the whole stack (or the whole
  sorted array) to hold one expert's slice, and adds them up: n full-size
  buffers where one would do. It is timed with fewer repeats.

Each PyTorch result is checked against the NumPy one before it is timed.
The forward pass alone (`stable_latent_moe`) is timed in the same rounds, to
show what the backward adds, and so is one float32 matrix product of 4096²
(`a @ b`, NumPy's BLAS with the same threads): the machine's own speed, the
yardstick for the fraction of it that each step reaches. Rounds take turns
(NumPy, PyTorch, the product, ...) so a change of load on a shared machine
touches all alike; the ratios are given for the medians and for the fastest
runs. Each timed run starts after `SETTLE` seconds of rest: NumPy's OpenBLAS
leaves its threads spinning for some 0.1 s after a threaded product (the
4096² product, or a step's own), and without the rest the piece timed next
(PyTorch's step, in these rounds) would share the cores with them.

Run: `python benchmarks/bench_backward.py` (writes `docs/benchmarks/backward.{json,md}`).
"""

from __future__ import annotations

import sys

import numpy as np
from common import (
    available_cpus,
    base_parser,
    command_line,
    fmt_seconds,
    forward_flops,
    gemm_work,
    load_average,
    machine_info,
    markdown_table,
    output_dir,
    set_blas_threads,
    time_call,
    time_round_robin,
    write_results,
)
from torch_compare import relative_error, torch_finish, torch_route, torch_situ_glu

from refimpl.config import MoEConfig
from refimpl.layer.backward import stable_latent_moe_vjp
from refimpl.layer.latent_moe import init_params, stable_latent_moe

try:
    import torch
except ImportError:  # PyTorch is an optional, benchmark-only dependency
    torch = None


# ---------------------------------------------------------------------------
# The PyTorch versions
# ---------------------------------------------------------------------------

#: The side of the square float32 product timed in the same rounds as the machine's own speed.
GEMM_SIZE = 4096
#: Seconds of rest before each timed run, untimed: long enough for a spinning OpenBLAS thread to fall asleep.
SETTLE = 0.3


def torch_step(x, p, experts, dy, config: MoEConfig, *, careful: bool):
    """Forward and backward of the grouped algorithm; gradients land in `.grad` of `x`, `p` and `experts`.

    `experts` is a list of `(w1_e, w3_e, w2_e)` leaves (careful) or the
    stacked leaves `(w1, w3, w2)` (naive).
    """
    m, k = x.shape[0], config.k
    index, weights = torch_route(x, p, config)  # [m, k] each; the selection carries no gradient
    z = x @ p["routed_expert_down_proj.weight"].T  # [m, l]
    slot_expert = index.reshape(-1)  # [m*k]
    order = torch.argsort(slot_expert, stable=True)  # [m*k]
    slot_token = order // k
    z_sorted = z[slot_token]  # [m*k, l]
    p_sorted = weights.reshape(-1)[order].unsqueeze(1)  # [m*k, 1]
    counts = torch.bincount(slot_expert, minlength=config.n).tolist()
    outs = []
    if careful:
        # One leaf per expert matrix, and `split` hands each expert a view autograd can stitch back cheaply.
        for (w1, w3, w2), z_e, p_e in zip(experts, z_sorted.split(counts), p_sorted.split(counts), strict=True):
            if z_e.shape[0]:
                outs.append((p_e * torch_situ_glu(z_e @ w1.T, z_e @ w3.T, config)) @ w2.T)
    else:
        # The pitfall: slicing one stacked leaf and one big tensor per expert.
        w1, w3, w2 = experts
        start = 0
        for e, count in enumerate(counts):
            if count:
                z_e, p_e = z_sorted[start:start + count], p_sorted[start:start + count]
                outs.append((p_e * torch_situ_glu(z_e @ w1[e].T, z_e @ w3[e].T, config)) @ w2[e].T)
                start += count
    u = torch.zeros(m, z.shape[1], dtype=z.dtype).index_add(0, slot_token, torch.cat(outs))  # [m, l]
    y = torch_finish(x, u, p, config)
    y.backward(dy)
    return y


def torch_leaves(params: dict, x: np.ndarray, *, careful: bool):
    """Leaf tensors for PyTorch: the layer's weights, the input, and the expert weights in the chosen layout."""
    tp = {name: torch.tensor(a, requires_grad=not name.startswith("experts.")) for name, a in params.items()}
    tx = torch.tensor(x, requires_grad=True)
    if careful:
        n = params["experts.w1"].shape[0]
        experts = [tuple(torch.tensor(params[name][e], requires_grad=True)
                         for name in ("experts.w1", "experts.w3", "experts.w2")) for e in range(n)]
    else:
        experts = tuple(torch.tensor(params[name], requires_grad=True)
                        for name in ("experts.w1", "experts.w3", "experts.w2"))
    return tp, tx, experts


def torch_gradients(tp, tx, experts, *, careful: bool) -> dict[str, np.ndarray]:
    """The gradients PyTorch accumulated, with the names of `stable_latent_moe_vjp`'s `dparams`."""
    grads = {"x": tx.grad.numpy()}
    grads.update({name: t.grad.numpy() for name, t in tp.items() if t.grad is not None})
    for i, name in enumerate(("experts.w1", "experts.w3", "experts.w2")):
        if careful:
            grads[name] = np.stack([leaves[i].grad.numpy() for leaves in experts])
        else:
            grads[name] = experts[i].grad.numpy()
    return grads


def clear_grads(tp, tx, experts, *, careful: bool) -> None:
    tensors = [tx, *tp.values(), *(w for leaves in experts for w in leaves)] if careful \
        else [tx, *tp.values(), *experts]
    for t in tensors:
        t.grad = None


# ---------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------

def worst_relative_error(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> tuple[str, float]:
    """The gradient that differs most, relative to its largest entry."""
    errors = {name: relative_error(ours[name], theirs[name]) for name in theirs}
    name = max(errors, key=errors.get)
    return name, errors[name]


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--naive-repeats", type=int, default=None,
                        help="timed runs of the naive PyTorch version (default 1; it is slow)")
    parser.add_argument("--skip-naive", action="store_true", help="do not time the naive PyTorch version")
    args = parser.parse_args(argv)
    threads = args.threads or available_cpus()
    set_blas_threads(threads)
    if torch is not None:
        torch.set_num_threads(threads)
    if args.smoke:
        config = MoEConfig.small(hidden_size=64, latent_size=32, num_experts=8, top_k=2, intermediate_size=16)
        m, repeats = 64, args.repeats or 1
    else:
        config, m, repeats = MoEConfig.small(), 4096, args.repeats or 5
    naive_repeats = args.naive_repeats or 1

    rng = np.random.default_rng(0)
    params = init_params(config, rng, dtype=np.float32)
    x = rng.standard_normal((m, config.d), dtype=np.float32)
    dy = rng.standard_normal((m, config.d), dtype=np.float32)
    flops_forward = sum(forward_flops(config, m).values())
    # Every product Y = X W^T has two more in the backward (for X and W): three times the forward in all.
    flops_step = 3 * flops_forward

    def refimpl_step():
        _, backward = stable_latent_moe_vjp(x, params, config)
        return backward(dy)

    # A training loop's step: the gradients of the last step are written over (`out=`), as PyTorch's
    # allocator hands the freed gradient memory of the last step back to the next one.
    reused: dict = {}

    def refimpl_step_reusing():
        _, backward = stable_latent_moe_vjp(x, params, config)
        dx, reused["grads"] = backward(dy, out=reused.get("grads"))
        return dx, reused["grads"]

    torch_version = torch.__version__ if torch is not None else "not installed"
    machine = machine_info(threads=threads, torch=torch_version,
                           torch_threads=torch.get_num_threads() if torch is not None else None)
    print(f"Forward + backward, float32, d={config.d} l={config.ell} n={config.n} k={config.k} f={config.f} "
          f"shared={config.shared_size} m={m}; {threads} threads for NumPy's BLAS and for PyTorch")
    print(f"machine: {machine}")
    gemm, gemm_flops = gemm_work(64 if args.smoke else GEMM_SIZE)
    work = {"refimpl_forward": lambda: stable_latent_moe(x, params, config), "refimpl_step": refimpl_step,
            "refimpl_step_out": refimpl_step_reusing, "gemm": gemm}
    result: dict = {"m": m, "flops_forward": flops_forward, "flops_step": flops_step}
    naive = None
    if torch is None:
        print("PyTorch is not installed: only the NumPy side is timed (pip install '.[bench]').")
    else:
        dx, dparams = refimpl_step()
        ours = {"x": dx, **dparams}
        # The step that writes into the last step's gradients must give the same numbers: run it twice.
        refimpl_step_reusing()
        dx_out, grads_out = refimpl_step_reusing()
        for name, g in {"x": dx_out, **grads_out}.items():
            np.testing.assert_array_equal(g, ours[name], err_msg=f"out= changed the gradient of {name}")
        tdy = torch.tensor(dy)
        careful = torch_leaves(params, x, careful=True)
        torch_step(careful[1], careful[0], careful[2], tdy, config, careful=True)
        name, error = worst_relative_error(ours, torch_gradients(*careful, careful=True))
        result["careful_worst_gradient"], result["careful_rel_error"] = name, error
        print(f"PyTorch careful agrees with the hand-written backward: worst gradient {name}, "
              f"relative error {error:.1e}")

        def careful_step():
            clear_grads(*careful, careful=True)
            torch_step(careful[1], careful[0], careful[2], tdy, config, careful=True)

        work["torch_careful"] = careful_step
        if not args.skip_naive:
            naive = torch_leaves(params, x, careful=False)
    timings = time_round_robin(work, repeats=repeats, settle=0.0 if args.smoke else SETTLE)
    gemm_timing = timings.pop("gemm")
    peak = gemm_flops / gemm_timing.median / 1e9  # GFLOP/s of the machine's own product, this run
    peak_best = gemm_flops / gemm_timing.best / 1e9
    result.update(gemm=gemm_timing, gemm_size=int(round((gemm_flops / 2) ** (1 / 3))), gemm_peak_gflops=peak,
                  gemm_peak_gflops_best=peak_best)
    print(f"float32 GEMM {result['gemm_size']}^2 in the same rounds: median {peak:.1f} GFLOP/s "
          f"(best {peak_best:.1f}): the machine's own speed")
    if naive is not None:
        def naive_step():
            clear_grads(*naive, careful=False)
            torch_step(naive[1], naive[0], naive[2], tdy, config, careful=False)

        # Slow, so no warm-up run: the careful version has warmed PyTorch up. Its last run's gradients are checked.
        timings["torch_naive"] = time_call("torch_naive", naive_step, repeats=naive_repeats, warmup=0)
        name, error = worst_relative_error(ours, torch_gradients(*naive, careful=False))
        result["naive_worst_gradient"], result["naive_rel_error"] = name, error
        print(f"PyTorch naive agrees too: worst gradient {name}, relative error {error:.1e}")
    result["timings"] = timings

    step = timings["refimpl_step_out"]
    rows = []
    labels = {"refimpl_step_out": "this project: stable_latent_moe_vjp, forward + backward(dy, out=) (NumPy)",
              "refimpl_step": "this project: the same, new gradient arrays each step",
              "torch_careful": "PyTorch autograd, one leaf per expert, split",
              "torch_naive": "PyTorch autograd, stacked leaves, slices (naive)",
              "refimpl_forward": "this project: forward only, stable_latent_moe (NumPy)"}
    fractions = {}
    for key in ("refimpl_step_out", "refimpl_step", "torch_careful", "torch_naive", "refimpl_forward"):
        if key not in timings:
            continue
        t = timings[key]
        flops = flops_forward if key == "refimpl_forward" else flops_step
        fractions[key] = flops / t.median / 1e9 / peak
        print(f"  {t}  -> {flops / t.median / 1e9:.1f} GFLOP/s effective, {100 * fractions[key]:.0f} % of the "
              f"machine's GEMM")
        rows.append([labels[key], fmt_seconds(t.median), fmt_seconds(t.best), fmt_seconds(t.worst),
                     f"{100 * t.spread:.1f} %", len(t.runs), f"{t.median / step.median:.2f}",
                     f"{flops / t.median / 1e9:.1f}", f"{100 * fractions[key]:.0f} %"])
    result["fraction_of_gemm_peak"] = fractions
    if "torch_careful" in timings:
        ratio = step.median / timings["torch_careful"].median
        result["ratio_to_careful"] = ratio
        result["ratio_to_careful_new_arrays"] = timings["refimpl_step"].median / timings["torch_careful"].median
        best = timings["torch_careful"].best
        result["ratio_to_careful_best"] = step.best / best
        result["ratio_to_careful_new_arrays_best"] = timings["refimpl_step"].best / best
        print(f"  time ratio refimpl (out=) / PyTorch careful = {ratio:.2f} (target <= 1.0: "
              f"{'met' if ratio <= 1.0 else 'NOT met'}); with new gradient arrays each step: "
              f"{result['ratio_to_careful_new_arrays']:.2f}; fastest runs: {result['ratio_to_careful_best']:.2f} "
              f"and {result['ratio_to_careful_new_arrays_best']:.2f}")
    if "torch_naive" in timings:
        result["naive_over_careful"] = timings["torch_naive"].median / timings["torch_careful"].median
        print(f"  naive / careful PyTorch = {result['naive_over_careful']:.1f}")
    result["backward_over_forward"] = step.median / timings["refimpl_forward"].median
    print(f"  forward + backward / forward = {result['backward_over_forward']:.2f}")

    machine["load_average_at_end"] = load_average()
    results = {"command": command_line(), "machine": machine, "threads": threads, "smoke": args.smoke,
               "config": {"d": config.d, "l": config.ell, "n": config.n, "k": config.k, "f": config.f,
                          "shared": config.shared_size, "m": m, "dtype": "float32"}, **result}
    headers = ["implementation", "median", "best", "worst", "spread", "runs", "time / this project",
               "GFLOP/s", "of the machine"]
    notes = [f"Same process, {threads} threads for NumPy's BLAS and for PyTorch; the NumPy and careful PyTorch "
             "steps (and the forward alone) take turns, the naive PyTorch step is timed after them; "
             f"each timed run starts after {SETTLE} s of rest, so that no BLAS thread left spinning by the run "
             "before shares the cores with it. "
             "The first row writes each step's gradients into the last step's arrays (`backward(dy, out=grads)`), "
             "as a training loop does and as PyTorch's allocator does by reusing freed memory; the second "
             "returns new gradient arrays (300 MB of expert gradients), which the layer's pool of workspaces "
             "makes from the memory of the last step's once they are let go of. "
             "GFLOP/s counts only the matrix products: "
             f"{flops_step / 1e9:.1f} GFLOP per step, three times the forward's {flops_forward / 1e9:.1f}. "
             f"\"Of the machine\" divides it by the speed of one float32 product of {result['gemm_size']}² "
             f"timed in the same rounds, {peak:.1f} GFLOP/s (median; {peak_best:.1f} at best): the fraction of "
             "this CPU's own matrix-product speed that the step reaches."]
    tables = [(f"Forward + backward, float32, m = {m}", markdown_table(headers, rows))]
    # The rounds side by side: on a shared machine a round's load touches both alike.
    turns = [key for key in work if key in timings]
    timings_with_gemm = {**timings, "gemm": gemm_timing}
    turns.append("gemm")
    round_rows = [[r + 1, *(fmt_seconds(timings_with_gemm[key].runs[r]) for key in turns)]
                  + ([f"{timings['refimpl_step_out'].runs[r] / timings['torch_careful'].runs[r]:.2f}"]
                     if "torch_careful" in timings else [])
                  for r in range(repeats)]
    round_headers = ["round", *turns] + (["step (out=) / careful"] if "torch_careful" in timings else [])
    tables.append(("Round by round", markdown_table(round_headers, round_rows)))
    write_results("backward", "Forward + backward: by hand against PyTorch autograd (CPU)", results, tables,
                  output_dir(args), notes=notes)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
