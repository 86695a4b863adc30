"""Speed of the Stable LatentMoE forward pass (Eq. 11) in float32 on the CPU.

The layer is `MoEConfig.small()`: d = 1024, l = 512, n = 128, k = 8, f = 384,
shared width 768, on m = 4096 tokens. The script times `stable_latent_moe`
as a whole (the median of several runs after a warm-up), then each stage of
Eq. (11) on its own with the same inputs, and reports

* the effective speed: the FLOPs the layer cannot avoid (matrix products
  only, see `common.forward_flops`) over the median wall time;
* the share of the time spent in each stage;
* the ratio to the machine's own float32 GEMM peak, measured in the same run.

The measurements take turns (GEMM, whole pass, each stage; then again), so a
change of load on a shared machine touches them all alike.

Run: `python benchmarks/bench_forward.py` (writes `docs/benchmarks/forward.{json,md}`);
`--smoke` runs tiny sizes and writes nothing.
"""

from __future__ import annotations

import sys

import numpy as np
from common import (
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
    time_round_robin,
    write_results,
)

from refimpl.config import MoEConfig
from refimpl.layer.activations import rms_norm
from refimpl.layer.latent_moe import init_params, routed_experts, shared_experts, stable_latent_moe
from refimpl.layer.routing import route, router_scores

TARGET_GFLOPS = 120.0


def sizes(smoke: bool) -> tuple[MoEConfig, int, int, int]:
    """(config, tokens, timed repeats, GEMM size) for a full or a smoke run."""
    if smoke:
        config = MoEConfig.small(hidden_size=64, latent_size=32, num_experts=8, top_k=2, intermediate_size=16)
        return config, 64, 1, 128
    return MoEConfig.small(), 4096, 7, 2048


def stage_work(x: np.ndarray, params: dict, config: MoEConfig) -> dict:
    """Each stage of Eq. (11) as a callable of its own, fed with the same arrays the full pass makes."""
    p = params
    scores = router_scores(x, p["gate.weight"])
    index, weights = route(scores, p["gate.e_score_correction_bias"], config.k)
    z = x @ p["routed_expert_down_proj.weight"].T
    u = routed_experts(z, index, weights, p["experts.w1"], p["experts.w3"], p["experts.w2"], config)
    v = rms_norm(u, p["routed_expert_norm.weight"], config.rms_norm_eps)
    y_routed = v @ p["routed_expert_up_proj.weight"].T
    y_shared = shared_experts(x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"],
                              p["shared_experts.down_proj.weight"], config)
    return {
        "router": lambda: router_scores(x, p["gate.weight"]),
        "route (top-k, weights)": lambda: route(scores, p["gate.e_score_correction_bias"], config.k),
        "down_projection": lambda: x @ p["routed_expert_down_proj.weight"].T,
        "routed_experts": lambda: routed_experts(z, index, weights, p["experts.w1"], p["experts.w3"],
                                                 p["experts.w2"], config),
        "rms_norm": lambda: rms_norm(u, p["routed_expert_norm.weight"], config.rms_norm_eps),
        "up_projection": lambda: v @ p["routed_expert_up_proj.weight"].T,
        "shared_experts": lambda: shared_experts(x, p["shared_experts.gate_proj.weight"],
                                                 p["shared_experts.up_proj.weight"],
                                                 p["shared_experts.down_proj.weight"], config),
        "output sum": lambda: y_shared + y_routed,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="m, tokens in the batch (default 4096)")
    args = parser.parse_args(argv)
    config, m, repeats, gemm_size = sizes(args.smoke)
    m = args.tokens or m
    repeats = args.repeats or repeats
    if args.threads:
        set_blas_threads(args.threads)

    machine = machine_info()
    params = init_params(config, 0, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((m, config.d)).astype(np.float32)
    flops = forward_flops(config, m)
    total_flops = sum(flops.values())

    # One round = the GEMM yardstick, the whole pass, then every stage alone; rounds repeat.
    gemm, gemm_flops = gemm_work(gemm_size)
    work = {"GEMM": gemm, "forward": lambda: stable_latent_moe(x, params, config),
            **stage_work(x, params, config)}
    timings = time_round_robin(work, repeats=repeats)
    forward = timings.pop("forward")
    gemm_timing = timings.pop("GEMM")
    stages = timings

    peak = gemm_flops / gemm_timing.median / 1e9
    effective = total_flops / forward.median / 1e9
    effective_best = total_flops / forward.best / 1e9
    stage_sum = sum(t.median for t in stages.values())

    print(f"Stable LatentMoE forward, float32: d={config.d} l={config.ell} n={config.n} k={config.k} "
          f"f={config.f} shared={config.shared_size} m={m}")
    machine.update(load_average_at_end=load_average(), float32_gemm_gflops=round(peak, 1))
    print(f"machine: {machine}")
    print(f"float32 GEMM {gemm_size}^3 in the same rounds: median {peak:.1f} GFLOP/s "
          f"(best {gemm_flops / gemm_timing.best / 1e9:.1f}, spread {100 * gemm_timing.spread:.1f} %)")
    print(forward)
    print(f"necessary FLOPs {total_flops / 1e9:.2f} G -> effective {effective:.1f} GFLOP/s "
          f"(best run {effective_best:.1f}); {100 * effective / peak:.0f} % of the measured GEMM peak")
    verdict = "met" if effective >= TARGET_GFLOPS else "NOT met"
    if args.smoke:
        verdict = "not judged (smoke sizes)"
    print(f"target >= {TARGET_GFLOPS:.0f} GFLOP/s effective: {verdict}")
    rows = []
    print(f"{'stage':24s} {'median':>10s} {'share':>7s} {'GFLOP/s':>8s}")
    for name, t in stages.items():
        stage_flops = flops.get(name.split(" ")[0], 0.0)
        rate = f"{stage_flops / t.median / 1e9:.1f}" if stage_flops else "-"
        share = 100 * t.median / stage_sum
        print(f"{name:24s} {fmt_seconds(t.median):>10s} {share:6.1f}% {rate:>8s}")
        rows.append([name, fmt_seconds(t.median), f"{share:.1f} %", rate, f"{100 * t.spread:.1f} %"])
    print(f"sum of stage medians {fmt_seconds(stage_sum)} vs whole pass {fmt_seconds(forward.median)} "
          f"(the difference is input checks, casts and call overhead)")

    results = {
        "command": command_line(),
        "machine": machine,
        "config": {"d": config.d, "l": config.ell, "n": config.n, "k": config.k, "f": config.f,
                   "shared": config.shared_size, "m": m, "dtype": "float32"},
        "flops": flops,
        "forward": forward,
        "effective_gflops_median": effective,
        "effective_gflops_best": effective_best,
        "gemm": gemm_timing,
        "gemm_size": gemm_size,
        "gemm_peak_gflops": peak,
        "ratio_to_gemm_peak": effective / peak,
        "target_gflops": TARGET_GFLOPS,
        "target_met": effective >= TARGET_GFLOPS,
        "stages": stages,
        "smoke": args.smoke,
    }
    summary = markdown_table(
        ["measure", "value"],
        [["forward pass, median", f"{fmt_seconds(forward.median)} (spread {100 * forward.spread:.1f} %, "
                                  f"{len(forward.runs)} runs)"],
         ["best run", fmt_seconds(forward.best)],
         ["necessary FLOPs", f"{total_flops / 1e9:.2f} GFLOP"],
         ["effective speed (median)", f"{effective:.1f} GFLOP/s"],
         ["float32 GEMM peak, same run", f"{peak:.1f} GFLOP/s"],
         ["ratio to GEMM peak", f"{100 * effective / peak:.0f} %"],
         [f"target >= {TARGET_GFLOPS:.0f} GFLOP/s", verdict]])
    stage_table = markdown_table(["stage", "median", "share", "GFLOP/s", "spread"], rows)
    write_results(
        "forward", f"Forward pass, float32, m = {m}", results,
        [("Whole pass", summary), ("Time per stage (each timed alone)", stage_table)], output_dir(args),
        notes=[f"Layer d = {config.d}, l = {config.ell}, n = {config.n}, k = {config.k}, f = {config.f}, "
               f"shared width {config.shared_size}. Only matrix products count as necessary FLOPs."])
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
