"""This project's NumPy code against PyTorch on the CPU, in one run, same machine, same thread count.

Two measurements:

1. **The forward pass** of Eq. (11) at d = 1024, l = 512, n = 128, k = 8,
   f = 384, shared width 768, m = 4096, float32:
   * `refimpl.layer.latent_moe.stable_latent_moe` (NumPy);
   * the same grouped algorithm written in PyTorch (sort the token-slots by
     expert, one GLU per expert on its contiguous slice, scatter-add back with
     `index_add_`), the way a PyTorch user would write it;
   * the per-token gather loop found in tutorials: for each token, gather its
     k experts' weight matrices and apply them. It is too slow to run on every
     token, so it is timed on a subset and the time is **extrapolated**
     linearly to m tokens (its cost is the same for every token).
2. **The exact Quantile Balancing update** (Eq. 14) at n = 896, k = 16,
   m = 131,072: `refimpl.balancing.quantile_balancing_update` against the
   formulation PyTorch code uses, `torch.topk` for the cutoffs and again for
   each expert's (q+1)-th largest margin (with this project's rule for a
   fractional q, so both compute the same bias).

Each PyTorch result is checked against the NumPy one before it is timed. The
timings take turns (NumPy, PyTorch, NumPy, ...) so a change of load on a
shared machine touches both alike. PyTorch is optional (`pip install
'.[bench]'`); without it the script times the NumPy side and says so.

Run: `python benchmarks/torch_compare.py` (writes `docs/benchmarks/torch_compare.{json,md}`).
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

from refimpl.config import MoEConfig
from refimpl.layer.latent_moe import init_params, stable_latent_moe

try:
    import torch
except ImportError:  # PyTorch is an optional, benchmark-only dependency
    torch = None


# ---------------------------------------------------------------------------
# The PyTorch versions
# ---------------------------------------------------------------------------

def torch_situ_glu(a, b, config: MoEConfig):
    """SiTU-GLU (or SwiGLU) in PyTorch."""
    if config.activation == "situ":
        capped_gate = config.situ_beta * torch.tanh(a / config.situ_beta) * torch.sigmoid(a)
        return capped_gate * (config.situ_linear_beta * torch.tanh(b / config.situ_linear_beta))
    return torch.nn.functional.silu(a) * b


def torch_route(x, p, config: MoEConfig):
    """Sigmoid scores, top-k of the biased scores, renormalized raw-score weights."""
    scores = torch.sigmoid(x @ p["gate.weight"].T)  # [m, n]
    _, index = torch.topk(scores + p["gate.e_score_correction_bias"], config.k, dim=-1)  # [m, k]
    weights = torch.gather(scores, 1, index)  # [m, k]
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return index, weights * config.routed_scaling_factor


def torch_finish(x, u, p, config: MoEConfig):
    """RMSNorm of the latent sum, up-projection, plus the shared experts."""
    v = u * torch.rsqrt(u.pow(2).mean(dim=-1, keepdim=True) + config.rms_norm_eps)
    v = v * p["routed_expert_norm.weight"]
    shared = torch_situ_glu(x @ p["shared_experts.gate_proj.weight"].T,
                            x @ p["shared_experts.up_proj.weight"].T, config)
    return v @ p["routed_expert_up_proj.weight"].T + shared @ p["shared_experts.down_proj.weight"].T


def torch_grouped_forward(x, p, config: MoEConfig):
    """Eq. (11) in PyTorch with the grouped algorithm: sort by expert, one GLU per expert, scatter-add."""
    m, k = x.shape[0], config.k
    index, weights = torch_route(x, p, config)
    z = x @ p["routed_expert_down_proj.weight"].T  # [m, l]
    slot_expert = index.reshape(-1)  # [m*k]
    order = torch.argsort(slot_expert, stable=True)  # [m*k]
    slot_token = order // k
    z_sorted = z[slot_token]  # [m*k, l]
    p_sorted = weights.reshape(-1)[order].unsqueeze(1)  # [m*k, 1]
    counts = torch.bincount(slot_expert, minlength=config.n).tolist()
    out_sorted = torch.empty_like(z_sorted)  # [m*k, l]
    w1, w3, w2 = p["experts.w1"], p["experts.w3"], p["experts.w2"]
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        z_e = z_sorted[rows]
        h = torch_situ_glu(z_e @ w1[e].T, z_e @ w3[e].T, config)
        torch.matmul(p_sorted[rows] * h, w2[e].T, out=out_sorted[rows])
        start += count
    u = torch.zeros(m, z.shape[1], dtype=z.dtype).index_add_(0, slot_token, out_sorted)  # [m, l]
    return torch_finish(x, u, p, config)


def torch_per_token_forward(x, p, config: MoEConfig):
    """The tutorial loop: for each token, gather the weights of its k experts and apply them."""
    index, weights = torch_route(x, p, config)
    z = x @ p["routed_expert_down_proj.weight"].T  # [m, l]
    u = torch.empty_like(z)
    for i in range(x.shape[0]):
        experts = index[i]  # [k]
        w1, w3, w2 = p["experts.w1"][experts], p["experts.w3"][experts], p["experts.w2"][experts]  # [k, f, l] ...
        h = torch_situ_glu(w1 @ z[i], w3 @ z[i], config)  # [k, f]
        u[i] = weights[i] @ torch.bmm(w2, h.unsqueeze(2)).squeeze(2)  # [l]
    return torch_finish(x, u, p, config)


def torch_quantile_balancing(scores, bias, top_k: int):
    """Eq. (14) the way PyTorch code writes it: `topk` for the cutoffs and for each expert's quantile."""
    m, n = scores.shape
    values, _ = torch.topk(scores + bias, top_k + 1, dim=1)  # [m, k+1]
    alpha = values[:, top_k]  # [m]
    margins = scores - alpha[:, None]  # [m, n]
    whole, rest = divmod(m * top_k, n)  # q = whole + rest/n
    frac = rest / n
    top = torch.topk(margins, whole + 2, dim=0).values  # [whole+2, n], largest first
    # Rank q+1 (1-based), interpolated between the (whole+1)-th and (whole+2)-th largest.
    threshold = top[whole] + frac * (top[whole + 1] - top[whole])
    new_bias = -threshold
    return new_bias - new_bias.mean()


# ---------------------------------------------------------------------------
# The measurements
# ---------------------------------------------------------------------------

def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| over max |b|."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def compare_forward(config: MoEConfig, m: int, subset: int, repeats: int) -> dict:
    params = init_params(config, 0, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((m, config.d)).astype(np.float32)
    flops = sum(forward_flops(config, m).values())
    gemm, gemm_flops = gemm_work(2048 if m >= 1024 else 128)
    work = {"GEMM": gemm, "numpy": lambda: stable_latent_moe(x, params, config)}
    result: dict = {"m": m, "flops": flops}
    y_numpy = stable_latent_moe(x, params, config)
    if torch is not None:
        tp = {name: torch.from_numpy(a) for name, a in params.items()}
        tx = torch.from_numpy(x)
        with torch.inference_mode():
            y_torch = torch_grouped_forward(tx, tp, config).numpy()
            result["torch_grouped_rel_error"] = relative_error(y_torch, y_numpy)
            work["torch_grouped"] = lambda: torch_grouped_forward(tx, tp, config)
            timings = time_round_robin(work, repeats=repeats)
            # The per-token loop, on the first `subset` tokens only, then scaled to m.
            sub = tx[:subset]
            y_loop = torch_per_token_forward(sub, tp, config).numpy()
            result["torch_per_token_rel_error"] = relative_error(y_loop, y_numpy[:subset])
            loop = time_call("torch_per_token", lambda: torch_per_token_forward(sub, tp, config),
                             repeats=min(repeats, 3), warmup=0)
        result["per_token_subset"] = subset
        result["per_token_subset_timing"] = loop
        result["per_token_subset_s"] = loop.median
        result["per_token_extrapolated_s"] = loop.median * m / subset
    else:
        timings = time_round_robin(work, repeats=repeats)
    result["gemm_gflops"] = gemm_flops / timings.pop("GEMM").median / 1e9
    result["timings"] = timings
    return result


def balancing_scores(m: int, n: int, seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid scores with uneven expert popularity, and a small random bias, float32."""
    rng = np.random.default_rng(seed)
    popularity = 0.5 * rng.standard_normal(n).astype(np.float32)  # [n]
    logits = rng.standard_normal((m, n), dtype=np.float32)
    logits += popularity
    scores = 1.0 / (1.0 + np.exp(-logits))  # [m, n]
    bias = (0.01 * rng.standard_normal(n)).astype(np.float32)  # [n]
    return scores.astype(np.float32, copy=False), bias


def compare_balancing(n: int, k: int, m: int, repeats: int) -> dict:
    try:
        from refimpl.balancing import quantile_balancing_update
    except ImportError as exc:
        return {"skipped": f"refimpl.balancing is not available ({exc})"}
    scores, bias = balancing_scores(m, n)
    work = {"numpy": lambda: quantile_balancing_update(scores, bias, k)}
    result: dict = {"n": n, "k": k, "m": m, "q": m * k / n}
    b_numpy = quantile_balancing_update(scores, bias, k)
    if torch is not None:
        ts, tb = torch.from_numpy(scores), torch.from_numpy(bias)
        with torch.inference_mode():
            b_torch = torch_quantile_balancing(ts, tb, k).numpy()
            result["max_abs_difference"] = float(np.max(np.abs(b_torch - b_numpy)))
            result["bias_range"] = float(np.max(b_numpy) - np.min(b_numpy))
            work["torch_topk"] = lambda: torch_quantile_balancing(ts, tb, k)
            result["timings"] = time_round_robin(work, repeats=repeats)
    else:
        result["timings"] = time_round_robin(work, repeats=repeats)
    return result


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

def _row(label: str, t, baseline, extra: str = "") -> list:
    ratio = t.median / baseline.median
    return [label, fmt_seconds(t.median), fmt_seconds(t.best), fmt_seconds(t.worst), f"{100 * t.spread:.1f} %",
            f"{ratio:.2f}", extra]


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--per-token-subset", type=int, default=None,
                        help="tokens on which the per-token loop is timed before extrapolating (default 128)")
    parser.add_argument("--skip-balancing", action="store_true", help="only the forward pass")
    args = parser.parse_args(argv)
    threads = args.threads or available_cpus()
    set_blas_threads(threads)
    if torch is not None:
        torch.set_num_threads(threads)
    if args.smoke:
        config = MoEConfig.small(hidden_size=64, latent_size=32, num_experts=8, top_k=2, intermediate_size=16)
        m, subset, repeats = 64, 8, args.repeats or 1
        n_b, k_b, m_b = 32, 4, 512
    else:
        config, m, subset, repeats = MoEConfig.small(), 4096, 128, args.repeats or 5
        n_b, k_b, m_b = 896, 16, 131_072
    subset = min(args.per_token_subset or subset, m)

    torch_version = torch.__version__ if torch is not None else "not installed"
    machine = machine_info(threads=threads, torch=torch_version,
                           torch_threads=torch.get_num_threads() if torch is not None else None)
    print(f"NumPy against PyTorch on the CPU, {threads} threads each")
    print(f"machine: {machine}")
    if torch is None:
        print("PyTorch is not installed: only the NumPy side is timed (pip install '.[bench]').")

    fwd = compare_forward(config, m, subset, repeats)
    t = fwd["timings"]
    numpy_t = t["numpy"]
    print(f"\nforward pass, float32, d={config.d} l={config.ell} n={config.n} k={config.k} f={config.f} "
          f"shared={config.shared_size} m={m}; float32 GEMM in the same rounds {fwd['gemm_gflops']:.1f} GFLOP/s")
    print(f"  {numpy_t}  -> {fwd['flops'] / numpy_t.median / 1e9:.1f} GFLOP/s effective")
    fwd_rows = [_row("this project (NumPy)", numpy_t, numpy_t,
                     f"{fwd['flops'] / numpy_t.median / 1e9:.1f} GFLOP/s")]
    if "torch_grouped" in t:
        tg = t["torch_grouped"]
        ratio = numpy_t.median / tg.median
        print(f"  {tg}  -> {fwd['flops'] / tg.median / 1e9:.1f} GFLOP/s effective; "
              f"agrees with NumPy to {fwd['torch_grouped_rel_error']:.1e} (relative)")
        print(f"  time ratio NumPy / PyTorch grouped = {ratio:.2f} (target <= 1.0: "
              f"{'met' if ratio <= 1.0 else 'NOT met'})")
        fwd_rows.append(_row("PyTorch, same grouped algorithm", tg, numpy_t,
                             f"{fwd['flops'] / tg.median / 1e9:.1f} GFLOP/s"))
        loop = fwd["per_token_extrapolated_s"]
        print(f"  per-token gather loop (PyTorch): median {fmt_seconds(fwd['per_token_subset_s'])} for {subset} tokens, "
              f"extrapolated to {m} tokens: {fmt_seconds(loop)} ({loop / numpy_t.median:.0f}x NumPy); "
              f"agrees to {fwd['torch_per_token_rel_error']:.1e}")
        fwd_rows.append(["per-token gather loop (PyTorch), extrapolated", fmt_seconds(loop), "-", "-", "-",
                         f"{loop / numpy_t.median:.1f}",
                         f"median of {len(fwd['per_token_subset_timing'].runs)} runs on {subset} tokens "
                         f"({fmt_seconds(fwd['per_token_subset_s'])}), times {m}/{subset}"])

    bal = {"skipped": "--skip-balancing"} if args.skip_balancing else compare_balancing(n_b, k_b, m_b, repeats)
    bal_rows = []
    if "skipped" in bal:
        print(f"\nbalancing update skipped: {bal['skipped']}")
    else:
        bt = bal["timings"]
        print(f"\nexact Quantile Balancing update, n={n_b} k={k_b} m={m_b} (q = {bal['q']:.2f})")
        print(f"  {bt['numpy']}")
        bal_rows.append(_row("this project (NumPy)", bt["numpy"], bt["numpy"]))
        if "torch_topk" in bt:
            ratio = bt["numpy"].median / bt["torch_topk"].median
            print(f"  {bt['torch_topk']}; same bias to {bal['max_abs_difference']:.1e} "
                  f"(the bias spans {bal['bias_range']:.3f})")
            print(f"  time ratio NumPy / PyTorch topk = {ratio:.2f}")
            bal_rows.append(_row("PyTorch topk formulation", bt["torch_topk"], bt["numpy"],
                                 f"max |difference| {bal['max_abs_difference']:.1e}"))

    machine["load_average_at_end"] = load_average()
    results = {"command": command_line(), "machine": machine, "threads": threads,
               "forward": {"config": {"d": config.d, "l": config.ell, "n": config.n, "k": config.k,
                                      "f": config.f, "shared": config.shared_size, "m": m}, **fwd},
               "balancing": bal, "smoke": args.smoke}
    headers = ["implementation", "median", "best", "worst", "spread", "time / NumPy", "notes"]
    tables = [(f"Forward pass, float32, m = {m}", markdown_table(headers, fwd_rows))]
    if bal_rows:
        tables.append((f"Exact Quantile Balancing update, n = {n_b}, k = {k_b}, m = {m_b:,}",
                       markdown_table(headers, bal_rows)))
    notes = [f"Same process, {threads} threads for NumPy's BLAS and for PyTorch; timings take turns. "
             "NumPy's element-wise functions run on one thread, PyTorch's on all of them. "
             f"Float32 GEMM peak in the same rounds: {fwd['gemm_gflops']:.1f} GFLOP/s."]
    write_results("torch_compare", "NumPy against PyTorch (CPU)", results, tables, output_dir(args), notes=notes)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
