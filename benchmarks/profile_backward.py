"""Where the time of `stable_latent_moe_vjp` goes: each stage of the forward and backward, and its GEMMs alone.

At the benchmark size (d = 1024, l = 512, n = 128, k = 8, f = 384, shared
768, m = 4096, float32), the script first runs each stage of one training
step as the VJP runs it (the module's own functions, fast paths on) and,
beside it, only that stage's matrix products, with the same shapes and
operand layouts, written into arrays made beforehand. The difference is
what the stage spends beyond its GEMMs: gathers, elementwise work, copies,
the allocator and the kernel's page faults. A 4096² float32 product gives the
machine's own speed. Every figure is the fastest of `--repeats` runs (the
machine may be shared). Then it splits the routed experts' backward loop
into its operations (summed over experts), times whole steps with and
without `out=`, times whole steps with one choice undone (in turns here, and
the pool of workspaces also in processes of their own), and times each
product shape of the routed loops with NumPy's BLAS and with PyTorch's
(when PyTorch is installed). A diagnostic for `bench_backward.py`, not a
benchmark: it writes no results.

Run: `python benchmarks/profile_backward.py --threads 1` (or `--threads 2`).
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from unittest import mock

import numpy as np
from common import base_parser, forward_flops, gemm_work, set_blas_threads

from refimpl._lib import fast as _fast
from refimpl.config import MoEConfig
from refimpl.layer import backward as bw
from refimpl.layer.activations import expert_glu_and_grad, rms_norm_backward
from refimpl.layer.latent_moe import (
    combine,
    dispatch_by_expert,
    init_params,
    latent_output,
    routed_experts,
    shared_experts,
)
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


def step_variants(x, params, config, dy, *, repeats: int, threads: int) -> None:
    """Whole steps as shipped and with one fast-path choice undone, in turns: what each choice is worth.

    * the activation in chunks of 16,384 entries (`GLU_CHUNK` before it was raised);
    * the results of the large products as new arrays instead of from the pool (in this process, whose
      allocator has by now seen many large arrays freed and may hand new ones out of memory it holds:
      `pool_in_fresh_processes` measures the pool where a training loop's process stands);
    * the large products on the BLAS's own `threads` threads (and the loops on theirs), as before the
      layer held the BLAS at one thread for a whole step: each product then leaves OpenBLAS's threads
      spinning for some 0.1 s beside the loop that follows.
    """
    from threadpoolctl import threadpool_limits

    from refimpl.layer import latent_moe as layer
    from refimpl.layer import routing

    def on_blas_threads(a, b):
        with threadpool_limits(limits=threads, user_api="blas"):
            return a @ b

    products_on_blas = [mock.patch.object(module, "matmul", on_blas_threads) for module in (_fast, layer, bw, routing)]
    variants = {
        "as shipped": [],
        "activation in chunks of 16,384 entries": [mock.patch.object(_fast, "GLU_CHUNK", 1 << 14)],
        "large products' results new arrays, not from the pool": [mock.patch.object(_fast, "POOLED_PRODUCT", 1 << 62)],
        "large products on the BLAS's own threads": products_on_blas,
    }
    runs: dict[str, list[float]] = {name: [] for name in variants}
    faults = dict.fromkeys(variants, 0)
    kernel = dict.fromkeys(variants, 0.0)
    grads: dict = {}

    def step():
        grads["out"] = backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy, out=grads.get("out"))[1]

    for round_ in range(repeats + 1):  # the first round warms each variant up and is not counted
        for name, patches in variants.items():
            for patch in patches:
                patch.start()
            try:
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                step()
                t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            finally:
                for patch in patches:
                    patch.stop()
            if round_:
                runs[name].append(t)
                faults[name] += r1.ru_minflt - r0.ru_minflt
                kernel[name] += r1.ru_stime - r0.ru_stime
    print(f"one whole step (forward + backward(dy, out=)) as shipped and with one choice undone, in turns, "
          f"{threads} thread(s), median of {repeats} (seconds; minor page faults and kernel seconds per step):")
    for name in variants:
        print(f"  {statistics.median(runs[name]):7.3f} s, {faults[name] / repeats:6.0f} faults, "
              f"{kernel[name] / repeats:5.2f} s kernel  {name}")


def steps_in_this_process(config, m: int, *, steps: int, pooled: bool) -> str:
    """Warm-up and `steps` timed whole steps (`out=`) of a layer made here: median, fastest, faults per step.

    Run by `pool_in_fresh_processes` in a process of its own, so that nothing
    timed before has shaped its allocator. With `pooled=False` the large
    products' results are new arrays (`POOLED_PRODUCT` out of reach).
    """
    if not pooled:
        _fast.POOLED_PRODUCT = 1 << 62
    rng = np.random.default_rng(0)
    params = init_params(config, rng, dtype=np.float32)
    x = rng.standard_normal((m, config.d), dtype=np.float32)
    dy = rng.standard_normal((m, config.d), dtype=np.float32)
    grads: dict = {}

    def step():
        grads["out"] = backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy, out=grads.get("out"))[1]

    for _ in range(5):  # the allocator's state settles over the first steps
        step()
    runs, faults = [], 0
    for _ in range(steps):
        time.sleep(0.3)  # no BLAS thread left spinning by the last step
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step()
        runs.append(time.perf_counter() - t0)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0.ru_minflt
    return (f"{statistics.median(runs):7.3f} s median, {min(runs):7.3f} s fastest, "
            f"{faults / steps:6.0f} faults per step")


def pool_in_fresh_processes(threads: int, steps: int, smoke: bool) -> None:
    """The pool's worth where it matters: each variant in processes of their own, two of each, in turns.

    In this script's own process the allocator has by then seen many large
    arrays freed, and hands new ones out of memory it already has; a
    training loop's process (and the benchmark's) is in the state measured here.
    """
    print(f"one whole step (forward + backward(dy, out=)), {threads} thread(s), each variant in a process of its "
          f"own after five untimed steps, {steps} timed steps each:")
    for _ in range(2):
        for variant in ("pooled", "new"):
            command = [sys.executable, __file__, "--threads", str(threads), "--steps-in-own-process", variant,
                       "--repeats", str(steps), *(["--smoke"] if smoke else [])]
            child = subprocess.run(command, capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed with exit status {child.returncode}:\n{child.stderr}")
            line = child.stdout.strip()
            label = "large products' results from the pool (as shipped)" if variant == "pooled" \
                else "large products' results new arrays"
            print(f"  {line}  {label}")


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


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` runs after one warm-up (on a shared machine the fastest is the least disturbed)."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return min(runs)


class Products:
    """The matrix products of a stage, replayed alone: `add(a, b)` records `a @ b` with an output made once."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.flops = 0.0

    def add(self, a, b) -> None:
        out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
        self.calls.append((a, b, out))
        self.flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]

    def run(self) -> None:
        for a, b, out in self.calls:
            np.matmul(a, b, out=out)


def routed_products(z, slots, w1, w3, w2, saved, du, *, backward: bool) -> Products:
    """The routed experts' products per expert, with the operands' layouts of the fast paths."""
    gemms = Products()
    for e in slots.experts():
        rows = slots.rows(e)
        z_e = np.ascontiguousarray(z[slots.token[rows]])  # [m_e, l]
        h = saved.hidden[e][0] if saved is not None else np.ones((z_e.shape[0], w1.shape[1]), z.dtype)
        if not backward:
            gemms.add(z_e, w1[e].T), gemms.add(z_e, w3[e].T), gemms.add(h, w2[e].T)
            continue
        du_e = np.ascontiguousarray(du[slots.token[rows]])  # [m_e, l]
        gemms.add(du_e, w2[e]), gemms.add(du_e.T, h)  # o_bar, dD_e
        gemms.add(h.T, z_e), gemms.add(h.T, z_e)  # dG_e, dU_e
        gemms.add(h, w1[e]), gemms.add(h, w3[e])  # dz
    return gemms


def stage_table(config, x, dy, p, params, repeats: int) -> None:
    """Each stage of a step as the VJP runs it, its products alone, and the rest, in seconds (fastest run)."""
    m = x.shape[0]
    gemm, gemm_flops = gemm_work(4096 if m >= 1024 else 256)
    peak = gemm_flops / best_time(gemm, repeats) / 1e9
    fwd = bw.stable_latent_moe(x, params, config, save_for_backward=True)
    slots, saved = fwd.routed.dispatch, fwd.routed
    w1, w3, w2 = p["experts.w1"], p["experts.w3"], p["experts.w2"]
    weight = p.__getitem__
    u_bar, grads = bw.latent_output_backward(dy, fwd.u, fwd.v, weight, config)
    z_bar, p_bar, *_ = bw.routed_experts_backward(fwd.z, saved, w1, w3, w2, u_bar)
    hs = fwd.shared[0]
    gs, us, ds = (p[f"shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))

    def products(*pairs) -> Products:
        gemms = Products()
        for a, b in pairs:
            gemms.add(a, b)
        return gemms

    left = np.ones((m, config.n + config.ell + 2 * gs.shape[0]), np.float32)
    right = np.ones((left.shape[1], config.d), np.float32)
    stages = [
        ("fwd 1-3: scores, route, dispatch, down-projection", lambda: scores_route_down(x, p, config),
         products((x, p["gate.weight"].T), (x, p["routed_expert_down_proj.weight"].T))),
        ("fwd 4-5: routed experts (fast path, saving)",
         lambda: routed_experts(fwd.z, fwd.index, fwd.weights, w1, w3, w2, config, save=True),
         routed_products(fwd.z, slots, w1, w3, w2, saved, None, backward=False)),
        ("fwd 6-7: latent norm, up-projection", lambda: latent_output(fwd.u, weight, config),
         products((fwd.v, p["routed_expert_up_proj.weight"].T))),
        ("fwd 8: shared experts (saving)", lambda: shared_experts(x, gs, us, ds, config, save=True),
         products((x, gs.T), (x, us.T), (hs, ds.T))),
        ("bwd 9-6: up-projection, latent norm",
         lambda: bw.latent_output_backward(dy, fwd.u, fwd.v, weight, config),
         products((dy.T, fwd.v), (dy, p["routed_expert_up_proj.weight"]))),
        ("bwd 4-5: routed experts (fast path)",
         lambda: bw.routed_experts_backward(fwd.z, saved, w1, w3, w2, u_bar),
         routed_products(fwd.z, slots, w1, w3, w2, saved, u_bar, backward=True)),
        ("bwd 2-1-3-8: router, down-projection, shared, x_bar",
         lambda: bw.router_and_input_backward(x, dy, fwd.scores, fwd.index, fwd.kept, p_bar, z_bar, fwd.shared,
                                              weight, params, config),
         products((left[:, :config.n].T, x), (left[:, config.n:config.n + config.ell].T, x), (dy, ds),
                  (left[:, -2 * gs.shape[0]:-gs.shape[0]].T, x), (left[:, -gs.shape[0]:].T, x), (dy.T, hs),
                  (left, right))),
    ]
    stages.append(("trust: 2 weight fingerprints, x kept, finite checks",
                   lambda: (bw.weight_fingerprints(params), bw.weight_fingerprints(params), x.astype(x.dtype),
                            np.isfinite(x).all(), np.isfinite(dy).all()), Products()))
    everything = Products()
    for _, _, gemms in stages:
        everything.calls += gemms.calls
        everything.flops += gemms.flops
    stages.append(("whole step: forward + backward(dy)",
                   lambda: bw.stable_latent_moe_vjp(x, params, config)[1](dy), everything))
    flops = 3 * sum(forward_flops(config, m).values())
    print(f"float32 GEMM {int(round((gemm_flops / 2) ** (1 / 3)))}^2: {peak:.1f} GFLOP/s (the machine's own speed); "
          f"a step's products are {flops / 1e9:.1f} GFLOP, {flops / peak / 1e9:.3f} s at that speed")
    print(f"each stage, fastest of {repeats} runs, seconds:")
    print(f"  {'stage':52s} {'stage':>7s} {'GEMMs':>7s} {'beyond':>7s} {'GFLOP':>6s} {'GEMM GFLOP/s':>12s}")
    for name, stage, gemms in stages:
        t_stage, t_gemm = best_time(stage, repeats), best_time(gemms.run, repeats)
        speed = f"{gemms.flops / t_gemm / 1e9:12.1f}" if gemms.flops else f"{'-':>12s}"
        print(f"  {name:52s} {t_stage:7.3f} {t_gemm:7.3f} {t_stage - t_gemm:7.3f} {gemms.flops / 1e9:6.1f} {speed}")


def expert_products_against_torch(w1, w2, rows: int, repeats: int, threads: int) -> None:
    """Each product of the routed experts' loops at `rows` tokens per expert, NumPy's BLAS against PyTorch's.

    Each product is timed twice on both sides: over every expert's own
    matrices in turn, so that the weights come from memory and the weight
    gradients go to it as in a step, and over the first expert's again and
    again, so that they stay in cache. The second separates the libraries'
    kernels at this shape from the cost of moving the matrices. The same
    threads on both sides. Skipped without PyTorch.
    """
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: the products are not compared with its BLAS")
        return
    torch.set_num_threads(threads)
    n, f, ell = w1.shape
    rng = np.random.default_rng(1)
    z_e = rng.standard_normal((rows, ell), dtype=np.float32)  # [rows, l]: a gathered latent, or du_e
    a_e = rng.standard_normal((rows, f), dtype=np.float32)  # [rows, f]: p h, a_bar or b_bar
    out_f, out_l = np.empty((rows, f), np.float32), np.empty((rows, ell), np.float32)
    g1, g2 = np.array(w1), np.array(w2)  # [n, f, l], [n, l, f]: the weight gradients' stacks, pages mapped
    tz, ta = torch.from_numpy(z_e), torch.from_numpy(a_e)
    tw1, tw2, tg1, tg2 = (torch.from_numpy(np.asarray(w)) for w in (w1, w2, g1, g2))
    shapes = [  # name, NumPy call, PyTorch call
        ("fwd gate/up: z_e G_e^T", lambda e: np.matmul(z_e, w1[e].T, out=out_f), lambda e: tz @ tw1[e].T),
        ("fwd down: (p h) D_e^T", lambda e: np.matmul(a_e, w2[e].T, out=out_l), lambda e: ta @ tw2[e].T),
        ("bwd o_bar = du_e D_e", lambda e: np.matmul(z_e, w2[e], out=out_f), lambda e: tz @ tw2[e]),
        ("bwd dD_e = du_e^T (p h)", lambda e: np.matmul(z_e.T, a_e, out=g2[e]),
         lambda e: torch.matmul(tz.T, ta, out=tg2[e])),
        ("bwd dG_e = a_bar^T z_e", lambda e: np.matmul(a_e.T, z_e, out=g1[e]),
         lambda e: torch.matmul(ta.T, tz, out=tg1[e])),
        ("bwd dz: a_bar G_e", lambda e: np.matmul(a_e, w1[e], out=out_l), lambda e: ta @ tw1[e]),
    ]
    flops = 2 * rows * f * ell * n
    print(f"each product of the routed loops, {rows} rows, {threads} thread(s), GFLOP/s (fastest of {repeats}), "
          f"with every one of the {n} experts' weights or weight gradients in turn (in memory) and with the "
          f"first expert's each time (in cache):")
    print(f"  {'product':28s} {'NumPy':>7s} {'PyTorch':>8s} {'NumPy, in cache':>16s} {'PyTorch, in cache':>18s}")
    for name, ours, theirs in shapes:
        speeds = []
        for experts in (range(n), [0] * n):
            for call in (ours, theirs):
                best = min(_timed(lambda: [call(e) for e in experts]) for _ in range(repeats))  # noqa: B023
                speeds.append(flops / best / 1e9)
        print(f"  {name:28s} {speeds[0]:7.1f} {speeds[1]:8.1f} {speeds[2]:16.1f} {speeds[3]:18.1f}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def scores_route_down(x, p, config):
    """Steps 1-3 of the forward as the layer runs them: scores, the route and its dispatch, the latent."""
    scores = router_scores(x, p["gate.weight"])
    index, weights = route(scores, p["gate.e_score_correction_bias"], config.k)
    return dispatch_by_expert(index, weights, config.n), x @ p["routed_expert_down_proj.weight"].T


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps-in-own-process", choices=("pooled", "new"), default=None,
                        help="internal: time --repeats whole steps in this process alone, with the large "
                             "products' results pooled or new, print one line and stop")
    args = parser.parse_args(argv)
    set_blas_threads(args.threads or 1)
    repeats = args.repeats or 3
    config, m = MoEConfig.small(), 4096
    if args.smoke:
        config, m = MoEConfig.small(hidden_size=64, latent_size=32, num_experts=8, top_k=2,
                                    intermediate_size=16), 64
    if args.steps_in_own_process is not None:
        print(steps_in_this_process(config, m, steps=repeats, pooled=args.steps_in_own_process == "pooled"))
        return
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
    stage_table(config, x, dy, p, params, repeats)
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
    print("one whole step (forward + backward), three times: with new gradient arrays, with out=, and with new "
          "arrays after emptying the pool of workspaces (what every step would cost without it):")
    grads = backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy)[1]

    def without_pool():
        bw.release_workspaces()
        return backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy)

    for _ in range(3):
        print(f"  {kernel_time(lambda: backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy))}  step")
        print(f"  {kernel_time(lambda: backward_of(bw.stable_latent_moe_vjp(x, params, config))(dy, out=grads))}"
              f"  step, backward(dy, out=grads)")
        print(f"  {kernel_time(without_pool)}  step, pool emptied first")
    step_variants(x, params, config, dy, repeats=5 if not args.smoke else 1, threads=args.threads or 1)
    pool_in_fresh_processes(args.threads or 1, 8 if not args.smoke else 1, args.smoke)
    a_bar = rng.standard_normal((256, config.f), dtype=np.float32)
    z_e = rng.standard_normal((256, config.ell), dtype=np.float32)
    a_bar_t = np.ascontiguousarray(a_bar.T)
    print("one weight-gradient product alone, [256, f]^T [256, l], 128 times:")
    print(f"  {median_time(lambda: [a_bar.T @ z_e for _ in range(128)], repeats):7.3f}  a.T @ z (transposed view)")
    print(f"  {median_time(lambda: [a_bar_t @ z_e for _ in range(128)], repeats):7.3f}  contiguous a^T @ z")
    print("the activation with its partials (in place), 128 blocks [256, f], whole or by row chunks:")
    block = rng.standard_normal((256, config.f), dtype=np.float32)
    for chunk in (block.size, 1 << 14):
        with mock.patch.object(_fast, "GLU_CHUNK", chunk):
            seconds = median_time(lambda: [expert_glu_and_grad(block.copy(), block.copy(), config)
                                           for _ in range(128)], repeats)
        print(f"  {seconds:7.3f}  chunks of {min(chunk, block.size)} entries")
    expert_products_against_torch(p["experts.w1"], p["experts.w2"], 256 if not args.smoke else 8,
                                  repeats, args.threads or 1)
    print("the readable routed_experts_backward, by operation (one run, summed over experts):")
    for name, t in routed_loop_breakdown(z, routed, p["experts.w1"], p["experts.w3"], p["experts.w2"],
                                         u_bar).items():
        print(f"  {t:7.3f}  {name}")


if __name__ == "__main__":
    main()
