"""A packed MXFP4 layer at K3's true widths: forward time, memory when loading, decode speed, deployment precision.

The layer has K3's widths (d = 7168, l = 3584, f = 3072, shared width 6144) with 16 experts and top-4,
and a batch of m = 512 tokens. It is written with `save_hf_layer` (MXFP4 experts, the released layout)
to a temporary folder and read back with `load_hf_layer`, which keeps the experts packed.

* **Forward time**, in turns in one run: the packed layer (each expert decoded when its turn comes)
  against the same layer held as float32 arrays (the decoded weights, so the routing and the
  arithmetic are identical). Target: at most 1.5x.
* **Memory**: resident-set growth of `load_hf_layer`, and the peak while the packed forward runs,
  against the budget "the layer's size in the file plus two experts in float32".
* **Decode throughput**: parameters per second of `mxfp4_decode` over the layer's experts (warm).
* **Deployment precision**: the relative output error against float32 weights when the routed
  experts are bfloat16, MXFP4, and MXFP4 with MXFP8 inputs to each expert product; and how often a
  token's expert set changes when the router runs in bfloat16, at K3's full router (n = 896, k = 16).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from common import (
    base_parser,
    command_line,
    fmt_seconds,
    load_average,
    machine_info,
    markdown_table,
    output_dir,
    set_blas_threads,
    time_round_robin,
    write_results,
)

from refimpl.checkpoints import load_hf_layer, save_hf_layer
from refimpl.config import MoEConfig
from refimpl.layer.latent_moe import MoEParams, init_params, stable_latent_moe
from refimpl.layer.routing import route
from refimpl.mx import mxfp4_decode

TARGET_RATIO = 1.5
BF16 = ml_dtypes.bfloat16


def sizes(smoke: bool) -> tuple[MoEConfig, int, int, int, int]:
    """(config, tokens, repeats, router experts, router top-k) for a full or a smoke run."""
    if smoke:
        config = MoEConfig(hidden_size=256, latent_size=128, num_experts=4, top_k=2, intermediate_size=128,
                           num_shared_experts=1, num_moe_layers=1)
        return config, 32, 1, 64, 4
    config = MoEConfig.k3().replace(num_experts=16, top_k=4, num_moe_layers=1)
    return config, 512, 3, 896, 16


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def router_bf16_changes(d: int, n: int, k: int, m: int, seed: int) -> dict[str, float]:
    """Fraction of tokens whose top-k expert set changes when the router's inputs, weights and logits are bf16."""
    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((n, d)) / np.sqrt(d)).astype(np.float32)  # [n, d]
    x = rng.standard_normal((m, d)).astype(np.float32)  # [m, d]
    bias = np.zeros(n, np.float32)
    logits = x @ W.T  # [m, n], float32
    logits_bf16 = (x.astype(BF16).astype(np.float32) @ W.astype(BF16).astype(np.float32).T).astype(BF16)
    sets = []
    for z in (logits, logits_bf16.astype(np.float32)):
        scores = 1.0 / (1.0 + np.exp(-z.astype(np.float64)))
        index, _ = route(scores, bias.astype(np.float64), k)
        sets.append(np.sort(index, axis=-1))
    changed = np.any(sets[0] != sets[1], axis=-1)  # [m]
    swapped = np.array([len(set(a) - set(b)) for a, b in zip(sets[0], sets[1], strict=True)])
    return {"tokens": m, "changed_fraction": float(changed.mean()), "mean_experts_swapped": float(swapped.mean()),
            "experts_swapped_when_changed": float(swapped[changed].mean()) if changed.any() else 0.0}


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config, m, repeats, router_n, router_k = sizes(args.smoke)
    repeats = args.repeats or repeats
    if args.threads:
        set_blas_threads(args.threads)
    machine = machine_info()
    one_expert = 3 * config.ell * config.f  # parameters
    print(f"layer d={config.d} l={config.ell} f={config.f} n={config.n} k={config.k} shared={config.shared_size} "
          f"m={m}; one expert {one_expert:,} parameters")

    params = init_params(config, args.seed, dtype=np.float32, bias_scale=0.01)
    x = np.random.default_rng(args.seed + 1).standard_normal((m, config.d)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="refimpl-bench-ckpt-") as tmp:
        start = time.perf_counter()
        save_hf_layer(tmp, config, params, layer=1)
        save_s = time.perf_counter() - start
        file_bytes = sum(p.stat().st_size for p in Path(tmp).glob("*.safetensors"))

        # -- memory: what loading adds, and the peak of a packed forward pass -------------------
        before = rss_bytes()
        loaded_config, packed = load_hf_layer(tmp, 1)
        after_load = rss_bytes()
        assert loaded_config == config
        reset_ok = reset_peak_rss()
        stable_latent_moe(x, packed, config)
        after_forward, peak_forward = rss_bytes(), peak_rss_bytes()
        budget = file_bytes + 2 * one_expert * 4
        load_growth, peak_growth = after_load - before, (peak_forward if reset_ok else after_forward) - before
        packed_bytes = sum(packed[name].nbytes for name in ("experts.w1", "experts.w3", "experts.w2"))
        print(f"file {file_bytes / 1e6:.0f} MB (packed experts {packed_bytes / 1e6:.0f} MB); budget = file + 2 "
              f"float32 experts = {budget / 1e6:.0f} MB")
        print(f"resident growth: after load {load_growth / 1e6:.0f} MB, peak during the packed forward "
              f"{peak_growth / 1e6:.0f} MB ({'peak' if reset_ok else 'after the pass; peak counter unavailable'})")

        # -- deployment precision against float32 weights ---------------------------------------
        ref = stable_latent_moe(x, params, config, return_intermediates=True)
        variants = {}
        for name in ("experts.w1", "experts.w3", "experts.w2"):  # one stack at a time, to keep the peak low
            params[name] = params[name].astype(BF16)
        variants["routed experts in bfloat16"] = stable_latent_moe(x, params, config, return_intermediates=True)
        del params
        variants["routed experts in MXFP4"] = stable_latent_moe(x, packed, config, return_intermediates=True)
        variants["MXFP4 weights, MXFP8 expert inputs"] = stable_latent_moe(x, packed, config,
                                                                           return_intermediates=True,
                                                                           mxfp8_inputs=True)
        precision_rows, precision = [], {}
        for label, out in variants.items():
            err_y, err_u = relative_error(out.y, ref.y), relative_error(out.u, ref.u)
            precision[label] = {"y": err_y, "u": err_u}
            precision_rows.append([label, f"{err_u:.2e}", f"{err_y:.2e}"])
            print(f"{label:40s} relative error: routed sum u {err_u:.2e}, output y {err_y:.2e}")
        # MXFP8 alone: the same MXFP4 weights with and without MXFP8 inputs (K3's own experts are MXFP4).
        base, low = variants["routed experts in MXFP4"], variants["MXFP4 weights, MXFP8 expert inputs"]
        err_y, err_u = relative_error(low.y, base.y), relative_error(low.u, base.u)
        label = "MXFP8 inputs alone (against MXFP4 weights in float32)"
        precision[label] = {"y": err_y, "u": err_u}
        precision_rows.append([label, f"{err_u:.2e}", f"{err_y:.2e}"])
        print(f"{label:40s} relative error: routed sum u {err_u:.2e}, output y {err_y:.2e}")
        # -- the same layer as float32 arrays: the decoded MXFP4 weights ------------------------
        arrays = MoEParams(packed)
        for name in ("experts.w1", "experts.w3", "experts.w2"):
            arrays[name] = np.stack([packed[name][e] for e in range(config.n)])

        def decode_all() -> None:
            for name in ("experts.w1", "experts.w3", "experts.w2"):
                stack = packed[name]
                for e in range(config.n):
                    mxfp4_decode(*stack.parts[e])

        timings = time_round_robin({
            "float32 arrays": lambda: stable_latent_moe(x, arrays, config),
            "packed MXFP4": lambda: stable_latent_moe(x, packed, config),
            "packed MXFP4, MXFP8 inputs": lambda: stable_latent_moe(x, packed, config, mxfp8_inputs=True),
            "decode all experts": decode_all,
        }, repeats=repeats)
        ratio = timings["packed MXFP4"].median / timings["float32 arrays"].median
        decode_rate = config.n * one_expert / timings["decode all experts"].median
        arrays.clear()  # free the float32 copy of the experts
        for t in timings.values():
            print(t)
        verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
        memory_verdict = "met" if max(load_growth, peak_growth) <= budget else "NOT met"
        if args.smoke:
            verdict = memory_verdict = "not judged (smoke sizes)"
        print(f"packed / float32 arrays: {ratio:.2f}x (target <= {TARGET_RATIO}x: {verdict})")
        print(f"memory target (growth <= file + 2 float32 experts): {memory_verdict}")
        print(f"decode: {decode_rate / 1e9:.2f} G parameters/s")

    router = router_bf16_changes(config.d, router_n, router_k, 4 * m if not args.smoke else m, args.seed + 2)
    print(f"router in bf16 (n={router_n}, k={router_k}, {router['tokens']} tokens, random weights): "
          f"{100 * router['changed_fraction']:.1f} % of tokens change their expert set, "
          f"{router['experts_swapped_when_changed']:.2f} experts swapped when they do")
    machine.update(load_average_at_end=load_average())

    results = {
        "command": command_line(), "machine": machine, "smoke": args.smoke, "seed": args.seed,
        "config": {"d": config.d, "l": config.ell, "n": config.n, "k": config.k, "f": config.f,
                   "shared": config.shared_size, "m": m},
        "file_bytes": file_bytes, "packed_expert_bytes": packed_bytes, "save_seconds": save_s,
        "memory": {"load_growth_bytes": load_growth, "peak_growth_bytes": peak_growth,
                   "peak_counter_reset": reset_ok, "budget_bytes": budget, "target": memory_verdict},
        "timings": timings, "ratio_packed_to_float32": ratio, "target_ratio": TARGET_RATIO, "target": verdict,
        "decode_parameters_per_second": decode_rate,
        "precision": precision, "router_bf16": {"n": router_n, "k": router_k, **router},
    }
    speed = markdown_table(["measure", "value"], [
        ["float32 arrays, median", f"{fmt_seconds(timings['float32 arrays'].median)} "
                                   f"(spread {100 * timings['float32 arrays'].spread:.1f} %)"],
        ["packed MXFP4, median", f"{fmt_seconds(timings['packed MXFP4'].median)} "
                                 f"(spread {100 * timings['packed MXFP4'].spread:.1f} %)"],
        ["packed MXFP4 with MXFP8 inputs, median", fmt_seconds(timings["packed MXFP4, MXFP8 inputs"].median)],
        [f"ratio packed / float32 (target <= {TARGET_RATIO}x)", f"{ratio:.2f}x ({verdict})"],
        ["decode throughput", f"{decode_rate / 1e9:.2f} G parameters/s"],
    ])
    memory = markdown_table(["measure", "MB"], [
        ["layer in the file (MXFP4 experts, float32 rest)", f"{file_bytes / 1e6:.0f}"],
        ["of which packed experts", f"{packed_bytes / 1e6:.0f}"],
        ["budget: file + two float32 experts", f"{budget / 1e6:.0f}"],
        ["resident growth after load_hf_layer", f"{load_growth / 1e6:.0f}"],
        ["resident growth, peak of a packed forward", f"{peak_growth / 1e6:.0f}"],
        ["target", memory_verdict],
    ])
    precision_table = markdown_table(["routed experts", "relative error of u", "relative error of y"],
                                     precision_rows)
    router_table = markdown_table(["router", "value"], [
        ["experts n, top-k", f"{router_n}, {router_k}"], ["tokens", router["tokens"]],
        ["tokens whose expert set changes", f"{100 * router['changed_fraction']:.1f} %"],
        ["experts swapped, when it changes", f"{router['experts_swapped_when_changed']:.2f}"],
    ])
    write_results(
        "checkpoint", f"A packed MXFP4 layer at K3's widths, {config.n} experts, m = {m}", results,
        [("Forward time and decode speed", speed), ("Memory", memory),
         ("Deployment precision against float32 weights", precision_table),
         ("Router in bfloat16 instead of float32", router_table)], output_dir(args),
        notes=[f"Layer d = {config.d}, l = {config.ell}, f = {config.f}, n = {config.n}, k = {config.k}, shared "
               f"width {config.shared_size}, random weights (seed {args.seed}). The float32 layer holds the decoded "
               "MXFP4 weights, so both passes route and compute alike. The router's bf16 test uses random "
               "Gaussian weights and inputs (logits of unit scale), not K3's trained router."])
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
