"""The GPU check: one command that runs this library on CuPy, from the test suite to a full-size K3 layer.

    python benchmarks/gpu.py                 # CuPy on the first GPU, full sizes (meant to take under 5 min on an H200)
    python benchmarks/gpu.py --cpu           # the same steps with NumPy at reduced sizes
    python benchmarks/gpu.py --cpu --smoke   # tiny sizes: what the test suite runs, so the script cannot rot

The numerical code is the library's own, unchanged: every function takes its
array namespace from its inputs, so handing it CuPy arrays runs it on the GPU.
The steps, each printed with its time:

1. **Tests on CuPy**: pytest with the CuPy backend (`-k cupy`), before anything
   large is allocated on the device.
2. **Scaled forward pass**: `MoEConfig.small()` (d = 1024, l = 512, n = 128,
   k = 8, f = 384, shared 768) on 4,096 tokens in float32: time, GFLOP/s and
   agreement with the NumPy result on the host.
3. **Balancing at n = 896, k = 16 on 1,048,576 tokens**: the exact update of
   Eq. (14) and the histogram estimate of Appendix D (eight blocks, 1000 bins):
   times, the histogram's error against its bound of one bin width, and the
   exact update on the device against NumPy on a subset of the tokens.
4. **A full-size K3 layer**: d = 7168, l = 3584, n = 896, k = 16, f = 3072,
   shared width 6144; 29.6 B routed parameters, about 59 GB in float16, made
   directly on the device. The forward pass on 4,096 float16 tokens: time,
   achieved bandwidth (weight bytes over time) against the device's memory
   bandwidth (its specification and a measured copy), the arithmetic rate
   against a float32 matrix product on the same device (the layer computes
   in float32), the time of each stage alone (timed in turns with the whole
   pass), one expert's turn in the routed experts piece by piece (the host's
   time to issue each piece and the device's time to run it), and a check of
   a sample of tokens against a float64 computation on the host.

5. **Balance is speed, on the device**: the routed experts at the sizes of
   step 4, in float16 as stored (float32 with `--cpu`), as one padded batched product
   (`padded_routed_experts`: every expert padded to the largest load, three
   `matmul` calls over `[n, C, l]` blocks) against the grouped loop, for a
   skewed router with zero bias and with a Quantile Balancing bias computed
   from an earlier batch: times, the padding waste (max load / mean - 1),
   the useful TFLOP/s and the rate at which each reads the expert weights.

Step 4 calls the stages of Eq. (11) one by one (`forward_by_stages`) instead
of `stable_latent_moe`, which casts every weight to the compute dtype (float32)
before it starts: for K3 that cast alone would need 118 GB next to the 59 GB of
float16 expert weights, more than one H200 holds. `routed_experts` casts one
expert at a time instead. Step 2 checks that the two paths agree.

Results go to `docs/benchmarks/gpu.{json,md}` on a GPU run; a `--cpu` run
writes only where `--out` says.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    REPO,
    RESULTS_DIR,
    Timing,
    command_line,
    fmt_seconds,
    forward_flops,
    load_average,
    machine_info,
    markdown_table,
    time_call,
    time_round_robin,
    write_results,
)

from refimpl._lib.xp import array_namespace, compute_dtype, to_numpy
from refimpl.config import MoEConfig
from refimpl.layer.activations import rms_norm, sigmoid, situ_glu
from refimpl.layer.latent_moe import (
    init_params,
    parameter_shapes,
    routed_experts,
    shared_experts,
    stable_latent_moe,
)
from refimpl.layer.routing import route, router_scores
from refimpl.parallel import padded_routed_experts, padding_waste

FLOAT16_EPS = float(np.finfo(np.float16).eps)  # 2^-10


# ---------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------

def sizes(cpu: bool, smoke: bool) -> dict[str, Any]:
    """Every size the steps use: the full GPU run, the reduced CPU run, or the tiny smoke run."""
    if smoke:
        return dict(forward=MoEConfig.small(hidden_size=64, latent_size=32, num_experts=8, top_k=2,
                                            intermediate_size=16), forward_m=64,
                    balance=(32, 4, 2048), balance_check_m=512, blocks=4,
                    k3=MoEConfig.k3().replace(hidden_size=64, latent_size=32, num_experts=16, top_k=4,
                                              intermediate_size=24, num_shared_experts=2),
                    k3_m=64, sample=2, repeats=1, copy_bytes=1 << 22, gemm=64, padded_m=64)
    if cpu:
        return dict(forward=MoEConfig.small(), forward_m=1024,
                    balance=(896, 16, 65_536), balance_check_m=16_384, blocks=8,
                    k3=MoEConfig.k3().replace(hidden_size=896, latent_size=448, num_experts=112,
                                              intermediate_size=384),
                    k3_m=512, sample=4, repeats=3, copy_bytes=1 << 28, gemm=1024, padded_m=128)
    return dict(forward=MoEConfig.small(), forward_m=4096,
                balance=(896, 16, 1_048_576), balance_check_m=131_072, blocks=8,
                k3=MoEConfig.k3(), k3_m=4096, sample=4, repeats=3, copy_bytes=1 << 32, gemm=8192,
                padded_m=4096)


# ---------------------------------------------------------------------------
# The array library the run uses
# ---------------------------------------------------------------------------

class NoGPU(Exception):
    """CuPy is missing or sees no usable GPU."""


class Backend:
    """NumPy on the host or CuPy on the first GPU, with what the steps need from either."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        if cpu:
            self.mod = np
            self.name = "numpy"
            self.device = machine_info()["cpu"]
            self.spec_bandwidth = None
            return
        try:
            import cupy
        except ImportError as exc:
            raise NoGPU(f"CuPy is not installed ({exc}); install the gpu extra: pip install '.[gpu]'") from None
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
            if int((cupy.arange(3) + 1).sum().item()) != 6:
                raise RuntimeError("a test kernel returned a wrong result")
        except Exception as exc:
            raise NoGPU(f"CuPy cannot use a GPU here ({type(exc).__name__}: {exc})") from None
        self.mod = cupy
        self.name = f"cupy {cupy.__version__}"
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        self.device = name.decode() if isinstance(name, bytes) else str(name)
        self.total_memory = int(props.get("totalGlobalMem", 0))
        # Theoretical bandwidth: double data rate x memory clock x bus width.
        clock_khz, bus_bits = int(props.get("memoryClockRate", 0)), int(props.get("memoryBusWidth", 0))
        self.spec_bandwidth = 2.0 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None

    def asarray(self, a: Any) -> Any:
        return self.mod.asarray(a)

    def free_memory(self) -> int | None:
        """Bytes free on the device (after returning the pool's cached blocks), or None on the host."""
        if self.cpu:
            return None
        self.free()
        return int(self.mod.cuda.runtime.memGetInfo()[0])

    def sync(self) -> None:
        if not self.cpu:
            self.mod.cuda.Device().synchronize()

    def normal(self, shape: tuple[int, ...], seed: int) -> Any:
        """Standard normal float32 samples, made where the arrays live."""
        if self.cpu:
            return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        return self.mod.random.RandomState(seed).standard_normal(shape, dtype=self.mod.float32)

    def free(self) -> None:
        if not self.cpu:
            self.mod.get_default_memory_pool().free_all_blocks()

    def gemm_rate(self, size: int, repeats: int) -> float:
        """FLOP/s of a square float32 matrix product: the ceiling for the layer's float32 arithmetic."""
        a, b = self.normal((size, size), 11), self.normal((size, size), 12)
        t = time_call("float32 GEMM", lambda: a @ b, repeats=repeats, sync=self.sync)
        return 2.0 * size**3 / t.median

    def copy_bandwidth(self, nbytes: int, repeats: int) -> float:
        """Bytes per second of a plain copy (each byte read once and written once)."""
        a = self.mod.ones(nbytes // 4, dtype=self.mod.float32)
        b = self.mod.empty_like(a)

        def copy() -> None:
            b[...] = a

        t = time_call("copy", copy, repeats=repeats, sync=self.sync)
        return 2.0 * nbytes / t.median


# ---------------------------------------------------------------------------
# Step 1: the test suite
# ---------------------------------------------------------------------------

def run_tests(pytest_args: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", *shlex.split(pytest_args)]
    env = dict(os.environ)
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    print(f"$ {shlex.join(cmd)}  (HYPOTHESIS_PROFILE={env['HYPOTHESIS_PROFILE']})", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": shlex.join(cmd), "ok": False, "summary": f"timed out after {timeout:.0f} s",
                "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((line.strip("= ") for line in reversed(lines)
                    if re.search(r"\d+ (passed|failed|error|skipped|deselected)", line)), "no summary")
    # All of it when something failed (every failure's report), else the summary and the skips' reasons.
    print("\n".join(lines if proc.returncode != 0 else
                    [line for line in lines[-40:] if "SKIPPED" in line] + lines[-2:]))
    counts = {word: int(num) for num, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)",
                                                          summary)}
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    return {"command": shlex.join(cmd), "returncode": proc.returncode, "summary": summary, "counts": counts,
            "ok": ok, "seconds": seconds}


# ---------------------------------------------------------------------------
# Step 2: the scaled forward pass
# ---------------------------------------------------------------------------

def forward_by_stages(x: Any, params: Any, config: MoEConfig,
                      stage: Callable[[str, Callable[[], Any]], Any] | None = None) -> Any:
    """Eq. (11) stage by stage with the library's functions, leaving the expert stacks in their stored dtype.

    The same computation as `stable_latent_moe` (step 2 checks it), except
    that `experts.w1/w3/w2` are handed to `routed_experts` as stored, which
    casts one expert at a time; the other weights, a few hundred MB even for
    K3, are cast as `stable_latent_moe` casts them. `stage(name, work)` runs
    each stage (a `StageClock` times them); by default they simply run.
    Returns `(y, index)`.
    """
    xp = array_namespace(x)
    dtype = compute_dtype(xp, x)
    run = stage if stage is not None else (lambda name, work: work())

    def weight(name: str) -> Any:
        return xp.astype(params[name], dtype, copy=False)

    h = xp.astype(x, dtype, copy=False)  # [m, d]
    scores = run("router", lambda: router_scores(h, weight("gate.weight")))  # [m, n]
    index, weights = run("route (top-k, weights)", lambda: route(
        scores, params["gate.e_score_correction_bias"], config.k, renormalize=config.renormalize,
        scaling_factor=config.routed_scaling_factor, n_group=config.n_group,
        topk_group=config.topk_group))  # [m, k]
    weights = xp.astype(weights, dtype)
    z = run("down_projection", lambda: h @ weight("routed_expert_down_proj.weight").T)  # [m, l]
    u = run("routed_experts", lambda: routed_experts(z, index, weights, params["experts.w1"], params["experts.w3"],
                                                     params["experts.w2"], config))  # [m, l]
    v = (run("rms_norm", lambda: rms_norm(u, weight("routed_expert_norm.weight"), config.rms_norm_eps))
         if config.use_latent_norm else u)  # [m, l]
    y_routed = run("up_projection", lambda: v @ weight("routed_expert_up_proj.weight").T)  # [m, d]
    y_shared = run("shared_experts", lambda: shared_experts(
        h, weight("shared_experts.gate_proj.weight"), weight("shared_experts.up_proj.weight"),
        weight("shared_experts.down_proj.weight"), config))  # [m, d]
    y = run("output sum", lambda: xp.astype(y_shared + y_routed, x.dtype))  # [m, d]
    return y, index


class StageClock:
    """A `stage` runner for `forward_by_stages` that times each stage, waiting for the device around it.

    `timings` holds each stage's time until the device has finished it;
    `issued` the host's time until the stage's Python code returned, having
    queued its work on the device (including any wait inside the stage, such as
    a copy of counts to the host). When the two are close, the device was
    waiting for the host: issuing the work, not running it, set the pace.
    On NumPy they are the same.
    """

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.timings: dict[str, Timing] = {}
        self.issued: dict[str, Timing] = {}

    def __call__(self, name: str, work: Callable[[], Any]) -> Any:
        self.sync()
        start = time.perf_counter()
        out = work()
        issued = time.perf_counter()
        self.sync()
        self.timings.setdefault(name, Timing(name)).runs.append(time.perf_counter() - start)
        self.issued.setdefault(name, Timing(name)).runs.append(issued - start)
        return out


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| over max |b| (0 for two empty arrays)."""
    if b.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def step_forward(backend: Backend, config: MoEConfig, m: int, repeats: int) -> dict[str, Any]:
    params = init_params(config, 0, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((m, config.d)).astype(np.float32)
    host = stable_latent_moe(x, params, config, return_intermediates=True)  # NumPy, on the host
    dev_params = {name: backend.asarray(a) for name, a in params.items()}
    dev_x = backend.asarray(x)
    timing = time_call("forward", lambda: stable_latent_moe(dev_x, dev_params, config), repeats=repeats,
                       sync=backend.sync)
    out = stable_latent_moe(dev_x, dev_params, config, return_intermediates=True)
    staged, _ = forward_by_stages(dev_x, dev_params, config)
    y, index = to_numpy(out.y), to_numpy(out.index)
    # A token whose float32 scores nearly tie may pick another expert on another device; compare the rest.
    same = np.all(index == host.index, axis=1)  # [m]
    flops = sum(forward_flops(config, m).values())
    result = {"m": m, "timing": timing, "gflops": flops / timing.median / 1e9,
              "routing_differs_tokens": int(m - same.sum()),
              "rel_error_vs_numpy": relative_error(y[same], host.y[same]),
              "stages_vs_whole": relative_error(to_numpy(staged), y)}
    result["ok"] = result["rel_error_vs_numpy"] <= 1e-4 and result["stages_vs_whole"] <= 1e-6
    print(f"  {timing}")
    print(f"  {flops / 1e9:.1f} GFLOP necessary -> {result['gflops']:.1f} GFLOP/s; agrees with NumPy to "
          f"{result['rel_error_vs_numpy']:.1e} (tolerance 1e-4; {result['routing_differs_tokens']} of {m} tokens "
          f"routed differently by near ties, left out); stage-by-stage path agrees to "
          f"{result['stages_vs_whole']:.1e}")
    return result


# ---------------------------------------------------------------------------
# Step 3: the balancing updates
# ---------------------------------------------------------------------------

def balancing_scores(backend: Backend, m: int, n: int, seed: int = 2) -> tuple[Any, Any]:
    """Sigmoid scores with uneven expert popularity, and a small bias, float32, on the backend."""
    logits = backend.normal((m, n), seed)
    logits += 0.5 * backend.normal((n,), seed + 1)  # some experts more popular than others
    scores = sigmoid(logits)
    del logits
    bias = 0.01 * backend.normal((n,), seed + 2)
    return scores, bias


def step_balancing(backend: Backend, n: int, k: int, m: int, check_m: int, n_blocks: int,
                   repeats: int) -> dict[str, Any]:
    try:
        from refimpl.balancing import quantile_balancing_update
        from refimpl.balancing.histogram import histogram_balancing_update
    except ImportError as exc:
        print(f"  skipped: {exc}")
        return {"skipped": str(exc), "ok": True}
    scores, bias = balancing_scores(backend, m, n)
    bins = 1000
    rows = -(-m // n_blocks)
    blocks = [scores[i:i + rows, :] for i in range(0, m, rows)]
    exact_t = time_call("exact update (Eq. 14)", lambda: quantile_balancing_update(scores, bias, k),
                        repeats=repeats, sync=backend.sync)
    hist_t = time_call(f"histogram update (App. D, {len(blocks)} blocks, {bins} bins)",
                       lambda: histogram_balancing_update(blocks, bias, k, bins=bins), repeats=repeats,
                       sync=backend.sync)
    b_exact = to_numpy(quantile_balancing_update(scores, bias, k))
    b_hist = to_numpy(histogram_balancing_update(blocks, bias, k, bins=bins))
    b_now = to_numpy(bias)
    width = (float(b_now.max() - b_now.min()) + 2.0) / bins
    hist_error = float(np.max(np.abs(b_hist - b_exact)))
    # The device's exact update against NumPy's on the first check_m tokens.
    sub = scores[:check_m, :]
    on_device = to_numpy(quantile_balancing_update(sub, bias, k))
    on_host = quantile_balancing_update(to_numpy(sub), b_now, k)
    host_diff = float(np.max(np.abs(on_device - on_host)))
    result = {"n": n, "k": k, "m": m, "q": m * k / n, "exact": exact_t, "histogram": hist_t, "bins": bins,
              "bin_width": width, "histogram_max_error": hist_error, "check_m": check_m,
              "device_vs_numpy_max_diff": host_diff}
    # Each threshold is within one bin of the exact one; centring can add the mean error once more.
    result["ok"] = hist_error <= 2 * width and host_diff <= 1e-5
    print(f"  {exact_t}")
    print(f"  {hist_t}")
    print(f"  histogram vs exact: max |difference| {hist_error:.2e} = {hist_error / width:.2f} bin widths "
          f"(bin width {width:.2e}); exact update on the first {check_m:,} tokens, device vs NumPy: "
          f"max |difference| {host_diff:.1e}")
    return result


# ---------------------------------------------------------------------------
# Step 4: a full-size K3 layer
# ---------------------------------------------------------------------------

def device_params(backend: Backend, config: MoEConfig, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """Random weights made where they will be used, a slab at a time (`init_params` makes them on the host).

    Matrices are N(0, 1/fan_in) like `init_params`; the norm gain is one and the bias N(0, 0.01^2), float32.
    """
    xp = backend.mod
    params: dict[str, Any] = {}
    for number, (name, shape) in enumerate(parameter_shapes(config).items()):
        if name == "routed_expert_norm.weight":
            params[name] = xp.ones(shape, dtype=dtype)
            continue
        if name == "gate.e_score_correction_bias":
            params[name] = 0.01 * backend.normal(shape, seed + 1000 * number)
            continue
        scale = 1.0 / math.sqrt(shape[-1])
        out = xp.empty(shape, dtype=dtype)
        per_row = math.prod(shape[1:])
        step = max(1, (1 << 28) // per_row)  # at most 2^28 float32 samples (1 GiB) at once
        for lo in range(0, shape[0], step):
            hi = min(lo + step, shape[0])
            out[lo:hi] = (scale * backend.normal((hi - lo, *shape[1:]), seed + 1000 * number + lo)).astype(dtype)
        params[name] = out
    return params


def host_reference(x: np.ndarray, params: dict[str, Any], config: MoEConfig) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (11) in float64 on the host for a few tokens `x` `[t, d]`, fetching only the experts they use.

    Independent of the library's forward pass: its own sigmoid, top-k (ties to
    the lower id), SiTU-GLU and RMSNorm. Returns `y` `[t, d]` and the chosen
    experts `[t, k]`.
    """
    def host(name: str) -> np.ndarray:
        return to_numpy(params[name]).astype(np.float64)

    b1, b2 = config.situ_beta, config.situ_linear_beta

    def glu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        sig = np.exp(np.minimum(a, 0.0)) / (1.0 + np.exp(-np.abs(a)))
        return b1 * np.tanh(a / b1) * sig * (b2 * np.tanh(b / b2))

    xs = x.astype(np.float64)  # [t, d]
    logits = xs @ host("gate.weight").T  # [t, n]
    s = np.exp(np.minimum(logits, 0.0)) / (1.0 + np.exp(-np.abs(logits)))
    biased = s + host("gate.e_score_correction_bias")
    chosen = np.argsort(-biased, axis=1, kind="stable")[:, :config.k]  # [t, k], ties to the lower id
    p = np.take_along_axis(s, chosen, axis=1)
    p = p / p.sum(axis=1, keepdims=True) * config.routed_scaling_factor  # [t, k]
    z = xs @ host("routed_expert_down_proj.weight").T  # [t, l]
    u = np.zeros_like(z)
    for e in np.unique(chosen).tolist():  # one expert at a time: each is fetched once
        g, up, down = (to_numpy(params[name][e]).astype(np.float64) for name in ("experts.w1", "experts.w3",
                                                                               "experts.w2"))
        for t, r in zip(*np.nonzero(chosen == e), strict=True):
            u[t] += p[t, r] * (down @ glu(g @ z[t], up @ z[t]))
    v = u / np.sqrt(np.mean(u * u, axis=1, keepdims=True) + config.rms_norm_eps) * host("routed_expert_norm.weight")
    y_routed = v @ host("routed_expert_up_proj.weight").T
    hidden = glu(xs @ host("shared_experts.gate_proj.weight").T, xs @ host("shared_experts.up_proj.weight").T)
    y_shared = hidden @ host("shared_experts.down_proj.weight").T
    return y_shared + y_routed, chosen


def host_and_device_time(backend: Backend, fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds (host, device) of `fn`: the host's time to issue it and the device's time to run it.

    On CuPy, `cupyx.profiler.benchmark` reads the host's clock around the call
    and CUDA events around its work; the device time includes any wait for the
    host to issue the next kernel, so when the two are close, issuing sets the
    pace. On NumPy both are the wall time.
    """
    if backend.cpu:
        t = time_call("piece", fn, repeats=repeats).median
        return t, t
    from cupyx.profiler import benchmark

    result = benchmark(fn, n_repeat=repeats, n_warmup=3)
    return float(np.median(result.cpu_times)), float(np.median(result.gpu_times[0]))


def expert_pieces(backend: Backend, params: dict[str, Any], config: MoEConfig, m: int,
                  repeats: int) -> dict[str, Any]:
    """One expert's turn in `routed_experts`, piece by piece, on its average share of tokens `mk/n`.

    The same operations as the loop body of `routed_experts` on expert 0's
    float16 matrices: cast them to float32, gather the tokens' latents, the
    gate and up products, SiTU-GLU, and the weighted down product written to
    the sorted outputs. Each piece is timed alone, many times.
    """
    xp = backend.mod
    m_e = max(1, round(m * config.k / config.n))
    stored = [params[name][0] for name in ("experts.w1", "experts.w3", "experts.w2")]  # float16 [f,l] [f,l] [l,f]
    g, u, d = (w.astype(xp.float32) for w in stored)
    z = backend.normal((m, config.ell), 21)  # [m, l]
    rows = xp.asarray(np.random.default_rng(22).choice(m, m_e, replace=False))  # [m_e]
    z_e = xp.take(z, rows, axis=0)  # [m_e, l]
    p = xp.full((m_e, 1), 1.0 / config.k, dtype=xp.float32)  # [m_e, 1]
    a, b = z_e @ g.T, z_e @ u.T  # [m_e, f]
    h = situ_glu(a, b, config.situ_beta, config.situ_linear_beta)  # [m_e, f]
    out = xp.empty((m_e, config.ell), dtype=xp.float32)

    def down() -> None:
        out[...] = (p * h) @ d.T

    gemm_flops = 2.0 * m_e * config.ell * config.f
    pieces = {
        "cast 3 matrices to float32": (lambda: [w.astype(xp.float32) for w in stored], 0.0),
        "gather latents": (lambda: xp.take(z, rows, axis=0), 0.0),
        "gate and up products": (lambda: (z_e @ g.T, z_e @ u.T), 2 * gemm_flops),
        "SiTU-GLU": (lambda: situ_glu(a, b, config.situ_beta, config.situ_linear_beta), 0.0),
        "weighted down product": (down, gemm_flops),
    }
    timed = {}
    for name, (fn, flops) in pieces.items():
        host_s, device_s = host_and_device_time(backend, fn, repeats)
        timed[name] = {"host_s": host_s, "device_s": device_s, "flops": flops}
    return {"tokens_per_expert": m_e, "pieces": timed,
            "host_s": sum(t["host_s"] for t in timed.values()),
            "device_s": sum(t["device_s"] for t in timed.values())}


def k3_memory_needed(config: MoEConfig, m: int) -> dict[str, int]:
    """Device bytes the K3 step needs: float16 weights, and the float32 work of a forward pass on `m` tokens.

    The work is the largest set of arrays alive at once: the float32 copies of
    the non-expert weights, the routed path's `[mk, l]` sorted outputs with a
    gather of the same size, one expert's matrices in float32, the shared
    GLU's three `[m, N_s f]` arrays, and a few `[m, d]` activations.
    """
    shapes = parameter_shapes(config)
    weights = 2 * sum(math.prod(shape) for shape in shapes.values())
    non_expert = sum(math.prod(shape) for name, shape in shapes.items() if not name.startswith("experts."))
    d, ell, f, k, shared = config.d, config.ell, config.f, config.k, config.shared_size
    work = 4 * (non_expert + 2 * m * k * ell + 3 * f * ell + 3 * m * shared + 4 * m * d)
    return {"weights": weights, "work": work, "total": weights + work}


def step_k3(backend: Backend, config: MoEConfig, m: int, sample: int, repeats: int,
            copy_bytes: int, gemm_size: int) -> dict[str, Any]:
    need = k3_memory_needed(config, m)
    free = backend.free_memory()
    print(f"  needs about {need['total'] / 1e9:.1f} GB on the device ({need['weights'] / 1e9:.1f} GB of float16 "
          f"weights, {need['work'] / 1e9:.1f} GB of float32 work)"
          + (f"; {free / 1e9:.1f} GB are free" if free is not None else ""))
    if free is not None and need["total"] > 0.95 * free:
        reason = (f"the layer needs about {need['total'] / 1e9:.1f} GB and the device has {free / 1e9:.1f} GB free; "
                  "an 80 GB or larger GPU holds it")
        print(f"  skipped: {reason}")
        return {"skipped": reason, "ok": True, "memory_needed": need}
    # The yardsticks first, while the device is empty: a plain copy and a float32 matrix product.
    copy = backend.copy_bandwidth(copy_bytes, repeats=max(repeats, 3))
    gemm = backend.gemm_rate(gemm_size, repeats=max(repeats, 3))
    backend.free()
    dtype = backend.mod.float16
    start = time.perf_counter()
    params = device_params(backend, config, dtype)
    x = backend.normal((m, config.d), 7).astype(dtype)
    backend.sync()
    made_s = time.perf_counter() - start
    weight_bytes = sum(int(a.nbytes) for a in params.values())
    routed = sum(int(params[name].size) for name in ("experts.w1", "experts.w3", "experts.w2"))
    print(f"  weights made on the device in {fmt_seconds(made_s)}: {routed / 1e9:.2f} B routed parameters, "
          f"{weight_bytes / 1e9:.1f} GB in all ({weight_bytes / 2**30:.1f} GiB)")
    y, index = forward_by_stages(x, params, config)  # also the warm-up
    # The whole pass, and the pass with each stage timed alone (the device waited for before and after
    # it), in turns: a drift in the device's speed touches both alike.
    clock = StageClock(backend.sync)
    turns = time_round_robin({"K3 layer forward": lambda: forward_by_stages(x, params, config),
                              "stage by stage": lambda: forward_by_stages(x, params, config, stage=clock)},
                             repeats=repeats, warmup=0, sync=backend.sync)
    timing, staged = turns["K3 layer forward"], turns["stage by stage"]
    stage_flops = forward_flops(config, m)
    flops = sum(stage_flops.values())
    bandwidth = weight_bytes / timing.median
    stages = {name: {"timing": t, "issued": clock.issued[name], "flops": stage_flops.get(name, 0.0)}
              for name, t in clock.timings.items()}
    # Inside the routed experts: one expert's turn, piece by piece.
    pieces = expert_pieces(backend, params, config, m, repeats=max(20, repeats))
    active = int(np.unique(to_numpy(index)).size)  # experts that received tokens
    # The float64 check on the host, for a sample of tokens spread over the batch.
    rows = np.linspace(0, m - 1, sample).astype(int)
    x_host = to_numpy(x)[rows]
    y_ref, chosen = host_reference(x_host, params, config)
    y_dev = to_numpy(y)[rows].astype(np.float64)
    same = np.all(np.sort(chosen, axis=1) == np.sort(to_numpy(index)[rows], axis=1), axis=1)
    error = relative_error(y_dev[same], y_ref[same])
    result = {"m": m, "dtype": "float16", "memory_needed": need, "weights_made_s": made_s,
              "weight_bytes": weight_bytes,
              "routed_parameters": routed, "timing": timing, "gflops": flops / timing.median / 1e9,
              "achieved_bandwidth": bandwidth, "copy_bandwidth": copy, "spec_bandwidth": backend.spec_bandwidth,
              "gemm_size": gemm_size, "gemm_flops": gemm, "stages": stages, "stage_by_stage": staged,
              "expert_pieces": pieces, "active_experts": active,
              "sample_tokens": int(sample), "sample_routing_differs": int(sample - same.sum()),
              "rel_error_vs_float64": error, "tolerance": 2 * FLOAT16_EPS}
    result["ok"] = error <= 2 * FLOAT16_EPS and same.sum() > 0
    print(f"  {timing}")
    spec = f", {100 * bandwidth / backend.spec_bandwidth:.1f} % of the specified " \
           f"{backend.spec_bandwidth / 1e9:.0f} GB/s" if backend.spec_bandwidth else ""
    print(f"  {flops / 1e12:.2f} TFLOP necessary -> {result['gflops'] / 1e3:.2f} TFLOP/s; weights read at "
          f"{bandwidth / 1e9:.1f} GB/s = {100 * bandwidth / copy:.1f} % of a measured copy "
          f"({copy / 1e9:.0f} GB/s){spec}")
    print(f"  the arithmetic runs in float32: {100 * flops / timing.median / gemm:.1f} % of a {gemm_size}^3 "
          f"float32 matrix product's {gemm / 1e12:.2f} TFLOP/s on the same device")
    stage_sum = sum(s["timing"].median for s in stages.values())
    for name, s in stages.items():
        rate = f"{s['flops'] / s['timing'].median / 1e12:8.2f} TFLOP/s" if s["flops"] else ""
        print(f"    {name:24s} {fmt_seconds(s['timing'].median):>10s} {100 * s['timing'].median / stage_sum:5.1f} %"
              f"  host issued it in {fmt_seconds(s['issued'].median):>10s} {rate}")
    print(f"  stage by stage, in turns with the whole pass: {staged}")
    print(f"  one expert's turn on {pieces['tokens_per_expert']} tokens (host time to issue, device time to run):")
    for name, t in pieces["pieces"].items():
        rate = f"{t['flops'] / t['device_s'] / 1e12:8.2f} TFLOP/s" if t["flops"] else ""
        print(f"    {name:28s} {fmt_seconds(t['host_s']):>10s} {fmt_seconds(t['device_s']):>10s} {rate}")
    print(f"    {'sum':28s} {fmt_seconds(pieces['host_s']):>10s} {fmt_seconds(pieces['device_s']):>10s}; "
          f"x {active} experts used = {fmt_seconds(active * pieces['device_s'])} of device time, against "
          f"{fmt_seconds(stages['routed_experts']['timing'].median)} for routed_experts")
    print(f"  {sample} sampled tokens against float64 on the host: max relative error {error:.1e} "
          f"(tolerance 2 float16 eps = {2 * FLOAT16_EPS:.1e}); {result['sample_routing_differs']} routed "
          "differently by near ties")
    return result


# ---------------------------------------------------------------------------
# Step 5: the padded batched product against the grouped loop
# ---------------------------------------------------------------------------

def skewed_scores(backend: Backend, m: int, n: int, seed: int) -> Any:
    """Sigmoid scores `[m, n]` (float32) of a router that favours low expert ids: zero bias is unbalanced."""
    xp = backend.mod
    # Expert e's logit is raised by 1.5 (1 - 2e/n): the first experts are popular, the last ones rare.
    lean = 1.5 * (1.0 - 2.0 * xp.arange(n, dtype=xp.float32) / n)
    return sigmoid(backend.normal((m, n), seed) + lean[None, :])


def step_padded(backend: Backend, config: MoEConfig, m: int, repeats: int) -> dict[str, Any]:
    from refimpl.balancing import quantile_balancing_update

    xp = backend.mod
    n, k, ell, f = config.n, config.k, config.ell, config.f
    # The stored precision on the device; NumPy has no fast float16 product, so the host runs float32.
    dtype = xp.float32 if backend.cpu else xp.float16
    params = device_params(backend, config, dtype)
    w1, w3, w2 = params["experts.w1"], params["experts.w3"], params["experts.w2"]
    del params  # only the expert stacks are used here
    backend.free()
    weight_bytes = int(w1.nbytes + w3.nbytes + w2.nbytes)
    z = backend.normal((m, ell), 21).astype(dtype)
    scores = skewed_scores(backend, m, n, 22)
    zero = xp.zeros(n, dtype=xp.float32)
    # Quantile Balancing's bias from an earlier batch of the same router: the next batch is routed with it.
    biases = {"zero bias": zero, "Quantile Balancing": quantile_balancing_update(skewed_scores(backend, m, n, 23),
                                                                                 zero, k)}
    free = backend.free_memory()
    cases: dict[str, Any] = {}
    ok = True
    for name, bias in biases.items():
        index, p = route(scores, bias, k)
        p = p.astype(dtype)
        load = to_numpy(xp.bincount(xp.reshape(index, (-1,)), minlength=n))
        largest = int(load.max())
        # The padded product's work arrays: [n, C, l] latents, and [n, C, f] products in float16 plus the
        # activation's float32 temporaries.
        need = n * largest * (ell * 2 * 2 + f * (2 * 3 + 4 * 4))
        case: dict[str, Any] = {"max_over_mean": float(largest / load.mean()), "waste": padding_waste(load),
                                "largest_load": largest, "work_bytes_needed": need}
        if free is not None and need > 0.8 * free:
            case["skipped"] = f"needs about {need / 1e9:.1f} GB of work arrays, {free / 1e9:.1f} GB free"
            print(f"  {name}: skipped, {case['skipped']}")
            cases[name] = case
            continue
        turns = time_round_robin(
            {"grouped loop": lambda index=index, p=p: routed_experts(z, index, p, w1, w3, w2, config),
             "padded product": lambda index=index, p=p: padded_routed_experts(z, index, p, w1, w3, w2, config)},
            repeats=repeats, warmup=1, sync=backend.sync)
        grouped = to_numpy(routed_experts(z, index, p, w1, w3, w2, config)).astype(np.float64)
        padded = to_numpy(padded_routed_experts(z, index, p, w1, w3, w2, config)).astype(np.float64)
        difference = relative_error(padded, grouped)
        useful = 2.0 * m * k * 3 * ell * f
        case.update({"grouped": turns["grouped loop"], "padded": turns["padded product"],
                     "padded_vs_grouped": difference,
                     "useful_tflops_grouped": useful / turns["grouped loop"].median / 1e12,
                     "useful_tflops_padded": useful / turns["padded product"].median / 1e12,
                     "weights_read_grouped": weight_bytes / turns["grouped loop"].median,
                     "weights_read_padded": weight_bytes / turns["padded product"].median})
        ok = ok and difference <= 8 * FLOAT16_EPS
        cases[name] = case
        print(f"  {name}: max/mean load {case['max_over_mean']:.2f} (waste {100 * case['waste']:.0f} %); "
              f"grouped {fmt_seconds(turns['grouped loop'].median)} "
              f"({case['useful_tflops_grouped']:.3f} useful TFLOP/s, weights read at "
              f"{case['weights_read_grouped'] / 1e9:.0f} GB/s); padded {fmt_seconds(turns['padded product'].median)} "
              f"({case['useful_tflops_padded']:.3f} useful TFLOP/s, {case['weights_read_padded'] / 1e9:.0f} GB/s); "
              f"padded vs grouped {difference:.1e}")
    return {"m": m, "dtype": "float32" if backend.cpu else "float16", "weight_bytes": weight_bytes,
            "cases": cases, "ok": ok,
            "tolerance": 8 * FLOAT16_EPS}


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="NumPy on the host at reduced sizes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (for the test suite)")
    parser.add_argument("--repeats", type=_positive_int, default=None, help="timed runs per measurement")
    parser.add_argument("--pytest-args", default=None,
                        help="arguments for the pytest step (default: the CuPy backend of the whole suite, "
                             "or the NumPy backend of the fast tests with --cpu)")
    parser.add_argument("--pytest-timeout", type=float, default=180.0, help="seconds before the tests are stopped")
    parser.add_argument("--skip", action="append", default=[], choices=["tests", "forward", "balancing", "k3", "padded"],
                        help="leave a step out (may be repeated)")
    parser.add_argument("--require-gpu", action="store_true",
                        help="exit with an error (instead of skipping) when no GPU is usable")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for gpu.json and gpu.md (default docs/benchmarks on a GPU run; "
                             "a --cpu run writes only where --out says)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run_start = time.perf_counter()
    size = sizes(args.cpu, args.smoke)
    repeats = args.repeats or size["repeats"]
    try:
        backend = Backend(args.cpu)
    except NoGPU as exc:
        # `make bench` runs every script; on a machine without a GPU this one has nothing to measure.
        # `make gpu` asks for a GPU (--require-gpu), so there its absence is an error.
        outcome = "GPU check failed" if args.require_gpu else "GPU check skipped"
        print(f"{outcome}: {exc}. Nothing was measured or written; `--cpu` runs the same steps with NumPy.",
              file=sys.stderr if args.require_gpu else sys.stdout)
        return 1 if args.require_gpu else 0
    machine = machine_info(backend=backend.name, device=backend.device)
    if not args.cpu:
        machine["device_memory_gib"] = round(backend.total_memory / 2**30, 1)
        machine["spec_bandwidth_gb_s"] = round(backend.spec_bandwidth / 1e9) if backend.spec_bandwidth else None
    print(f"GPU check on {backend.device} with {backend.name}" + (" (reduced sizes)" if args.cpu else ""))
    print(f"machine: {machine}")
    results: dict[str, Any] = {"command": command_line(), "machine": machine, "cpu": args.cpu, "smoke": args.smoke}
    step_time: dict[str, float] = {}

    def run(name: str, title: str, fn) -> None:
        if name in args.skip:
            print(f"\n[{name}] skipped (--skip {name})")
            return
        print(f"\n[{name}] {title}", flush=True)
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # one broken step must not cost the others their numbers
            traceback.print_exc()
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        backend.free()  # the step's device arrays are gone with its frame; return their memory
        step_time[name] = time.perf_counter() - start
        print(f"  step time {fmt_seconds(step_time[name])}", flush=True)

    default_tests = ("tests -q -rfEs -k cupy -p no:cacheprovider" if not args.cpu
                     else "tests -q -x -k numpy -m 'not slow' -p no:cacheprovider")
    run("tests", "test suite", lambda: run_tests(args.pytest_args or default_tests, args.pytest_timeout))
    fc, fm = size["forward"], size["forward_m"]
    run("forward", f"forward pass, float32, d={fc.d} l={fc.ell} n={fc.n} k={fc.k} f={fc.f} "
                   f"shared={fc.shared_size}, m={fm:,}",
        lambda: step_forward(backend, fc, fm, repeats))
    n, k, m = size["balance"]
    run("balancing", f"balancing updates, n={n} k={k}, m={m:,} tokens",
        lambda: step_balancing(backend, n, k, m, size["balance_check_m"], size["blocks"], repeats))
    kc, km = size["k3"], size["k3_m"]
    run("k3", f"K3-shaped layer, float16, d={kc.d} l={kc.ell} n={kc.n} k={kc.k} f={kc.f} "
              f"shared={kc.shared_size}, m={km:,}",
        lambda: step_k3(backend, kc, km, size["sample"], repeats, size["copy_bytes"], size["gemm"]))
    run("padded", f"padded batched product vs grouped loop, {'float32' if args.cpu else 'float16'}, n={kc.n} k={kc.k} l={kc.ell} f={kc.f}, "
                  f"m={size['padded_m']:,}",
        lambda: step_padded(backend, kc, size["padded_m"], repeats))

    total = time.perf_counter() - run_start
    results["step_seconds"] = step_time
    results["total_seconds"] = total
    machine["load_average_at_end"] = load_average()
    failed = [name for name in ("tests", "forward", "balancing", "k3", "padded")
              if name in results and not results[name].get("ok", False)]
    results["failed"] = failed
    print(f"\ntotal {fmt_seconds(total)}; " + ("all checks passed" if not failed else f"FAILED: {', '.join(failed)}"))

    out = args.out if args.out is not None else (None if args.cpu else RESULTS_DIR)
    write_results("gpu", f"GPU check on {backend.device}", results, _tables(results), out)
    return 1 if failed else 0


def _tables(results: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if "tests" in results and "summary" in results["tests"]:
        r = results["tests"]
        rows.append(["tests", r["summary"], fmt_seconds(r["seconds"]), "ok" if r["ok"] else "FAILED"])
    if "forward" in results and "timing" in results["forward"]:
        r = results["forward"]
        rows.append([f"forward pass, small layer, m = {r['m']:,}, float32",
                     f"{r['gflops']:.1f} GFLOP/s; vs NumPy {r['rel_error_vs_numpy']:.1e}",
                     fmt_seconds(r["timing"].median), "ok" if r["ok"] else "FAILED"])
    if "balancing" in results and "exact" in results["balancing"]:
        r = results["balancing"]
        rows.append([f"exact update (Eq. 14), n = {r['n']}, k = {r['k']}, m = {r['m']:,}",
                     f"device vs NumPy on {r['check_m']:,} tokens: {r['device_vs_numpy_max_diff']:.1e}",
                     fmt_seconds(r["exact"].median), "ok" if r["ok"] else "FAILED"])
        rows.append([f"histogram update (App. D), {r['bins']} bins",
                     f"vs exact: {r['histogram_max_error'] / r['bin_width']:.2f} bin widths",
                     fmt_seconds(r["histogram"].median), "ok" if r["ok"] else "FAILED"])
    for name, r in results.items():
        if isinstance(r, dict) and ("error" in r or "skipped" in r) and name in ("tests", "forward", "balancing", "k3", "padded"):
            rows.append([name, r.get("error") or f"skipped: {r['skipped']}", "-",
                         "FAILED" if "error" in r else "skipped"])
    if "k3" in results and "timing" in results["k3"]:
        r = results["k3"]
        spec = r["spec_bandwidth"]
        bw = f"{r['achieved_bandwidth'] / 1e9:.0f} GB/s of weights ({100 * r['achieved_bandwidth'] / r['copy_bandwidth']:.1f} % of copy" + \
             (f", {100 * r['achieved_bandwidth'] / spec:.1f} % of spec)" if spec else ")")
        rows.append([f"K3-shaped layer, float16, m = {r['m']:,}, {r['weight_bytes'] / 1e9:.1f} GB of weights",
                     f"{bw}; {100 * r['gflops'] * 1e9 / r['gemm_flops']:.1f} % of a float32 GEMM; "
                     f"vs float64 {r['rel_error_vs_float64']:.1e}",
                     fmt_seconds(r["timing"].median), "ok" if r["ok"] else "FAILED"])
    tables = [("Steps", markdown_table(["step", "result", "median time", "check"], rows))]
    if "padded" in results and "cases" in results["padded"]:
        r = results["padded"]
        padded_rows = []
        for name, case in r["cases"].items():
            if "skipped" in case:
                padded_rows.append([name, f"{case['max_over_mean']:.2f}", f"{100 * case['waste']:.0f} %",
                                    f"skipped: {case['skipped']}", "", "", ""])
                continue
            padded_rows.append([name, f"{case['max_over_mean']:.2f}", f"{100 * case['waste']:.0f} %",
                                fmt_seconds(case["grouped"].median), fmt_seconds(case["padded"].median),
                                f"{case['weights_read_grouped'] / 1e9:.0f} / {case['weights_read_padded'] / 1e9:.0f}",
                                f"{case['padded_vs_grouped']:.1e}"])
        tables.append((f"Routed experts as one padded batched product, {r['dtype']}, m = {r['m']:,}",
                       markdown_table(["bias", "max/mean load", "padding", "grouped loop", "padded product",
                                       "weights read GB/s (grouped / padded)", "padded vs grouped"],
                                      padded_rows)))
    if "k3" in results and "timing" in results["k3"]:
        r = results["k3"]
        stage_sum = sum(s["timing"].median for s in r["stages"].values())
        stage_rows = [[name, fmt_seconds(s["timing"].median),
                       fmt_seconds(s["issued"].median) if "issued" in s else "-",
                       f"{100 * s['timing'].median / stage_sum:.1f} %",
                       f"{s['flops'] / s['timing'].median / 1e12:.2f}" if s["flops"] else "-"]
                      for name, s in r["stages"].items()]
        stage_rows.append(["float32 GEMM yardstick", f"{r['gemm_size']}^3", "", "",
                           f"{r['gemm_flops'] / 1e12:.2f}"])
        if "stage_by_stage" in r:
            stage_rows.append(["whole pass, stages timed alone", fmt_seconds(r["stage_by_stage"].median), "", "", ""])
            stage_rows.append(["whole pass, in turns with the above", fmt_seconds(r["timing"].median), "", "", ""])
        tables.append(("K3-shaped layer, time per stage (each timed alone)",
                       markdown_table(["stage", "median", "host issued it in", "share", "TFLOP/s"], stage_rows)))
    if "k3" in results and "expert_pieces" in results["k3"]:
        r = results["k3"]
        pieces = r["expert_pieces"]
        piece_rows = [[name, fmt_seconds(t["host_s"]), fmt_seconds(t["device_s"]),
                       f"{t['flops'] / t['device_s'] / 1e12:.2f}" if t["flops"] else "-"]
                      for name, t in pieces["pieces"].items()]
        piece_rows.append(["one expert's turn", fmt_seconds(pieces["host_s"]), fmt_seconds(pieces["device_s"]), ""])
        piece_rows.append([f"x {r['active_experts']} experts used", "",
                           fmt_seconds(r["active_experts"] * pieces["device_s"]), ""])
        piece_rows.append(["routed_experts, measured", "", fmt_seconds(r["stages"]["routed_experts"]["timing"].median),
                           ""])
        tables.append((f"K3-shaped layer, one expert's turn on {pieces['tokens_per_expert']} tokens (mk/n)",
                       markdown_table(["piece", "host (issue)", "device (run)", "TFLOP/s"], piece_rows)))
    return tables


if __name__ == "__main__":
    sys.exit(main())
