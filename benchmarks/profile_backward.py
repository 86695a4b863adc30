"""Where the time of `stable_latent_moe_vjp` goes: each stage of the forward and backward, timed alone.

At the benchmark size (d = 1024, l = 512, n = 128, k = 8, f = 384, shared
768, m = 4096, float32), the script runs the VJP's stages one by one with the
module's own functions and prints the median seconds of each, then splits the
routed experts' backward loop into its operations (summed over experts). A
diagnostic for `bench_backward.py`, not a benchmark: it writes no results.

Run: `OPENBLAS_NUM_THREADS=1 python benchmarks/profile_backward.py --threads 1`.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections import defaultdict
from unittest import mock

import numpy as np
from common import base_parser, set_blas_threads

from refimpl._lib import fast as _fast
from refimpl.config import MoEConfig
from refimpl.layer import backward as bw
from refimpl.layer.activations import expert_glu_and_grad, rms_norm_backward
from refimpl.layer.latent_moe import combine, init_params, routed_experts, shared_experts
from refimpl.layer.routing import route, router_scores


def median_time(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def backward_of(pair):
    return pair[1]


def kernel_time(fn) -> str:
    """Wall seconds, minor page faults and kernel (system) seconds of one call."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return f"{t:7.3f} s, {r1.ru_minflt - r0.ru_minflt:6d} faults, {r1.ru_stime - r0.ru_stime:5.2f} s kernel"


def routed_loop_breakdown(z, saved, w1, w3, w2, du) -> dict[str, float]:
    """The operations of `routed_experts_backward`'s loop, each timed and summed over experts."""
    acc: dict[str, float] = defaultdict(float)
    slots = saved.dispatch
    n, ell, f = w2.shape
    m, k = slots.position.shape

    def tick(name, t0):
        t = time.perf_counter()
        acc[name] += t - t0
        return t

    t = time.perf_counter()
    dz_sorted = np.empty((m * k, ell), dtype=z.dtype)
    dw1 = np.zeros((n, f, ell), dtype=z.dtype)
    dw3 = np.zeros((n, f, ell), dtype=z.dtype)
    dw2 = np.zeros((n, ell, f), dtype=z.dtype)
    t = tick("allocate", t)
    for e in slots.experts():
        rows = slots.rows(e)
        z_e = np.take(z, slots.token[rows], axis=0)
        du_e = np.take(du, slots.token[rows], axis=0)
        t = tick("gather z_e, du_e", t)
        p_e = slots.weight[rows, :]
        h, dh_da, dh_db = saved.hidden[e]
        g_e, u_e, d_e = w1[e], w3[e], w2[e]
        o_bar = du_e @ d_e
        t = tick("o_bar = du_e D_e", t)
        _ = np.sum(o_bar * h, axis=1)
        t = tick("dp", t)
        dw2[e] = du_e.T @ (p_e * h)
        t = tick("dD_e = du_e^T (p h)", t)
        h_bar = p_e * o_bar
        a_bar = h_bar * dh_da
        b_bar = h_bar * dh_db
        t = tick("a_bar, b_bar (elementwise)", t)
        dw1[e] = a_bar.T @ z_e
        dw3[e] = b_bar.T @ z_e
        t = tick("dG_e, dU_e = a_bar^T z_e, b_bar^T z_e", t)
        dz_sorted[rows] = a_bar @ g_e + b_bar @ u_e
        t = tick("dz = a_bar G_e + b_bar U_e", t)
    combine(dz_sorted, slots)
    tick("combine", t)
    return dict(acc)


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    set_blas_threads(args.threads or 1)
    repeats = args.repeats or 3
    config, m = MoEConfig.small(), 4096
    if args.smoke:
        config, m = MoEConfig.small(hidden_size=64, latent_size=32, num_experts=8, top_k=2,
                                    intermediate_size=16), 64
    rng = np.random.default_rng(0)
    params = init_params(config, rng, dtype=np.float32)
    x = rng.standard_normal((m, config.d), dtype=np.float32)
    dy = rng.standard_normal((m, config.d), dtype=np.float32)
    p = {name: np.asarray(a) for name, a in params.items()}

    scores = router_scores(x, p["gate.weight"])
    index, weights = route(scores, p["gate.e_score_correction_bias"], config.k, renormalize=config.renormalize,
                           scaling_factor=config.routed_scaling_factor, n_group=config.n_group,
                           topk_group=config.topk_group)
    weights = weights.astype(np.float32)
    z = x @ p["routed_expert_down_proj.weight"].T
    u, routed = routed_experts(z, index, weights, p["experts.w1"], p["experts.w3"], p["experts.w2"], config,
                               save=True)
    _, shared = shared_experts(x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"],
                               p["shared_experts.down_proj.weight"], config, save=True)
    v_bar = dy @ p["routed_expert_up_proj.weight"]
    u_bar, _ = rms_norm_backward(u, p["routed_expert_norm.weight"], v_bar, config.rms_norm_eps)
    z_bar, p_bar, *_ = bw.routed_experts_backward(z, routed, p["experts.w1"], p["experts.w3"], p["experts.w2"],
                                                  u_bar)
    s_bar = bw.route_backward(scores, index, p_bar, renormalize=config.renormalize,
                              scaling_factor=config.routed_scaling_factor)
    logit_bar = bw.router_backward(scores, index, s_bar)

    _, backward = bw.stable_latent_moe_vjp(x, params, config)
    stages = {
        "whole: forward (stable_latent_moe_vjp)": lambda: bw.stable_latent_moe_vjp(x, params, config),
        "whole: backward(dy)": lambda: backward(dy),
        "fwd: routed experts (fast path, glu_and_grad)": lambda: routed_experts(
            z, index, weights, p["experts.w1"], p["experts.w3"], p["experts.w2"], config, save=True),
        "fwd: shared experts": lambda: shared_experts(
            x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"],
            p["shared_experts.down_proj.weight"], config, save=True),
        "bwd 7: up-projection (2 GEMMs)": lambda: (dy.T @ u, dy @ p["routed_expert_up_proj.weight"]),
        "bwd 6: rms_norm_backward": lambda: rms_norm_backward(u, p["routed_expert_norm.weight"], v_bar,
                                                              config.rms_norm_eps),
        "bwd 4-5: routed experts (fast path)": lambda: bw.routed_experts_backward(
            z, routed, p["experts.w1"], p["experts.w3"], p["experts.w2"], u_bar),
        "bwd 2: route_backward": lambda: bw.route_backward(scores, index, p_bar, renormalize=config.renormalize,
                                                           scaling_factor=config.routed_scaling_factor),
        "bwd 1: router_backward": lambda: bw.router_backward(scores, index, s_bar),
        "bwd 1: router GEMMs": lambda: (logit_bar.T @ x, logit_bar @ p["gate.weight"]),
        "bwd 3: down-projection (2 GEMMs)": lambda: (z_bar.T @ x, z_bar @ p["routed_expert_down_proj.weight"]),
        "bwd 8: shared_experts_backward": lambda: bw.shared_experts_backward(
            x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"],
            p["shared_experts.down_proj.weight"], shared, dy),
    }
    print(f"m={m}, float32, median of {repeats} runs, seconds")
    for name, fn in stages.items():
        print(f"  {median_time(fn, repeats):7.3f}  {name}")
    print("routed experts' backward, readable loop and fast path, one run each, three times "
          "(seconds, minor page faults, kernel seconds):")
    stacks = p["experts.w1"], p["experts.w3"], p["experts.w2"]
    readable = mock.patch.object(_fast, "ENABLED", False)
    for _ in range(3):
        with readable:
            print(f"  {kernel_time(lambda: bw.routed_experts_backward(z, routed, *stacks, u_bar))}  readable loop")
        print(f"  {kernel_time(lambda: _fast.routed_experts_backward_in_buffers(z, routed, *stacks, u_bar))}  fast path")
    print("one whole step (forward + backward), three times, with new gradient arrays and with out=:")
    grads = backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy)[1]
    for _ in range(3):
        print(f"  {kernel_time(lambda: backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy))}  step")
        print(f"  {kernel_time(lambda: backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy, out=grads))}"
              f"  step, backward(dy, out=grads)")
    a_bar = rng.standard_normal((256, config.f), dtype=np.float32)
    z_e = rng.standard_normal((256, config.ell), dtype=np.float32)
    a_bar_t = np.ascontiguousarray(a_bar.T)
    print("one weight-gradient product alone, [256, f]^T [256, l], 128 times:")
    print(f"  {median_time(lambda: [a_bar.T @ z_e for _ in range(128)], repeats):7.3f}  a.T @ z (transposed view)")
    print(f"  {median_time(lambda: [a_bar_t @ z_e for _ in range(128)], repeats):7.3f}  contiguous a^T @ z")
    print("the activation with its partials (in place), 128 blocks [256, f], whole or by row chunks:")
    block = rng.standard_normal((256, config.f), dtype=np.float32)
    for chunk in (block.size, _fast.GLU_CHUNK):
        with mock.patch.object(_fast, "GLU_CHUNK", chunk):
            seconds = median_time(lambda: [expert_glu_and_grad(block.copy(), block.copy(), config)
                                           for _ in range(128)], repeats)
        print(f"  {seconds:7.3f}  chunks of {min(chunk, block.size)} entries")
    print("the readable routed_experts_backward, by operation (one run, summed over experts):")
    for name, t in routed_loop_breakdown(z, routed, p["experts.w1"], p["experts.w3"], p["experts.w2"],
                                         u_bar).items():
        print(f"  {t:7.3f}  {name}")


if __name__ == "__main__":
    main()
