r"""Compare the variants: plain MoE, LatentMoE and Stable LatentMoE on the same inputs

Three layers that differ only in the two switches of `MoEConfig`:

| variant | `use_latent_projection` | `use_latent_norm` | the routed experts see |
|---|---|---|---|
| plain MoE (DeepSeek style) | `False` ($\alpha = 1$) | `False` | the token, width $d$ |
| LatentMoE | `True` | `False` | the latent $z = x W_\downarrow^\top$, width $\ell = d/\alpha$ |
| Stable LatentMoE (K3) | `True` | `True` | the latent, and their sum is normalized |

The three layers share the tokens, the router weights and the bias, and the
router always reads the full-width token, so every token chooses the same
experts in all three. What differs is what happens after the choice.

1. **Output scale as the selection changes.** Trained experts do not all
   answer at the same volume. Here expert $e$'s output is multiplied by a
   gain between 1/4 and 4, and a bias sweep moves the tokens from the quiet
   experts to the loud ones, the way a balancing bias moves load. The size of
   the routed output follows the gains in the plain MoE and in LatentMoE; after
   the RMSNorm it does not move. The routed scaling factor, a constant
   multiplier on every mixture weight, shows the same thing in its simplest form.
2. **Activation magnitudes in half precision.** A mixed-precision kernel
   stores the expert's gate and up pre-activations, and the activation it
   computes from them, in 16 bits. As the inputs grow (an activation blow-up),
   SwiGLU's output grows with the product of the two, and float16 (largest
   finite value 65,504) overflows to infinity; SiTU-GLU's output never exceeds
   $\beta_1\beta_2 = 100$ whatever comes in (in floating point it reaches the
   bound itself once $\tanh$ rounds to 1). bfloat16 has float32's exponent
   range, so it does not overflow at these sizes, but it carries the same huge
   values into the next matrix product.
3. **Payload per token.** Under expert parallelism each token is sent to its
   $k$ experts and the results come back. The plain MoE sends $k$ vectors of
   width $d$ each way, the two latent variants $k$ vectors of width $\ell$: at
   K3's sizes, half the bytes, or the same bytes as a full-width MoE with half
   the experts and half the top-$k$.
"""

# %%
from __future__ import annotations

import argparse
from pathlib import Path

import ml_dtypes
import numpy as np

from refimpl.config import MoEConfig
from refimpl.layer.accounting import dispatch_payload
from refimpl.layer.activations import situ_glu, swiglu
from refimpl.layer.latent_moe import init_params, stable_latent_moe
from refimpl.studies.figures import figures_wanted, show_figure

#: Largest finite float16 value: SwiGLU outputs beyond it become infinity.
FLOAT16_MAX = float(np.finfo(np.float16).max)


# %%
def variants(d: int, ell: int, n: int, k: int, f: int) -> dict[str, MoEConfig]:
    """The three layers, identical except for the latent projection and the norm."""
    common = dict(hidden_size=d, num_experts=n, top_k=k, intermediate_size=f, num_shared_experts=1,
                  num_moe_layers=1)
    return {
        "plain MoE": MoEConfig(latent_size=d, use_latent_projection=False, use_latent_norm=False, **common),
        "LatentMoE": MoEConfig(latent_size=ell, use_latent_projection=True, use_latent_norm=False, **common),
        "Stable LatentMoE": MoEConfig(latent_size=ell, use_latent_projection=True, use_latent_norm=True, **common),
    }


# %%
def shared_router_params(configs: dict[str, MoEConfig], gains: np.ndarray, seed: int) -> dict[str, dict]:
    """Weights for each variant, with one router for all and expert e's output scaled by `gains[e]`."""
    params = {name: dict(init_params(config, seed + i)) for i, (name, config) in enumerate(configs.items())}
    router = params["Stable LatentMoE"]["gate.weight"]
    for p in params.values():
        p["gate.weight"] = router  # [n, d], the same router reading the same full-width x
        p["experts.w2"] = p["experts.w2"] * gains[:, None, None].astype(np.float32)  # [n, l, f]
    return params


# %%
def rms(a: np.ndarray) -> np.ndarray:
    """Root mean square over the last axis: one number per token."""
    return np.sqrt(np.mean(np.asarray(a, dtype=np.float64) ** 2, axis=-1))


# %%
def output_scale(x: np.ndarray, configs: dict[str, MoEConfig], params: dict[str, dict], gains: np.ndarray,
                 shifts: list[float]) -> list[dict]:
    """RMS of the routed output per variant while the bias moves tokens toward loud experts.

    The bias is `shift * t_e`, with `t_e` running from -1 for the quietest
    expert to +1 for the loudest: a positive shift favours loud experts.
    """
    n = len(gains)
    tilt = np.linspace(-1.0, 1.0, n)  # gains are increasing in e, so the tilt follows them
    rows = []
    for shift in shifts:
        row: dict = {"shift": shift}
        for name, config in configs.items():
            p = dict(params[name])
            p["gate.e_score_correction_bias"] = (shift * tilt).astype(np.float32)  # [n]
            out = stable_latent_moe(x, p, config, return_intermediates=True)
            per_token = rms(out.y_routed)  # [m]
            row[name] = float(per_token.mean())
            row[f"{name} spread"] = float(per_token.std() / per_token.mean())
            row["mean gain"] = float(gains[out.index].mean())  # the same selection in every variant
        rows.append(row)
    return rows


# %%
def scaling_factor_effect(x: np.ndarray, configs: dict[str, MoEConfig], params: dict[str, dict],
                          factors: list[float]) -> list[dict]:
    """RMS of the routed output per variant for several routed scaling factors."""
    rows = []
    for factor in factors:
        row: dict = {"factor": factor}
        for name, config in configs.items():
            out = stable_latent_moe(x, params[name], config.replace(routed_scaling_factor=factor),
                                    return_intermediates=True)
            row[name] = float(rms(out.y_routed).mean())
        rows.append(row)
    return rows


# %%
def activation_magnitudes(gate: np.ndarray, up: np.ndarray, dtype) -> dict[str, dict]:
    """Store the pre-activations in `dtype`, apply each activation, and measure what comes out.

    The activations compute in float32 and return `dtype`, as a fused kernel
    would write them. Returns, per activation, the share of outputs that are
    not finite, the largest finite magnitude and the share above 100.
    """
    a = gate.astype(dtype)  # [..., f] in 16 bits
    b = up.astype(dtype)
    result = {}
    for name, fn in (("SwiGLU", swiglu), ("SiTU-GLU", situ_glu)):
        with np.errstate(over="ignore"):  # overflowing to infinity is what is being counted
            h = np.asarray(fn(a, b), dtype=np.float64)
        finite = np.isfinite(h)
        result[name] = {
            "overflow": float(1.0 - finite.mean()),
            "max": float(np.abs(h[finite]).max()) if finite.any() else float("nan"),
            "above 100": float((np.abs(h) > 100).mean()),
        }
    return result


# %%
def half_precision(x: np.ndarray, config: MoEConfig, params: dict, scales: list[float]) -> list[dict]:
    """Activation magnitudes of every expert on every token, as the input scale grows."""
    w_down = params["routed_expert_down_proj.weight"]  # [l, d]
    w1, w3 = params["experts.w1"], params["experts.w3"]  # [n, f, l] each
    rows = []
    for scale in scales:
        z = (scale * x) @ w_down.T  # [m, l], the latent of inputs grown by `scale`
        gate = np.einsum("ml,nfl->mnf", z, w1)  # [m, n, f], every expert's gate pre-activation
        up = np.einsum("ml,nfl->mnf", z, w3)  # [m, n, f]
        row: dict = {"scale": scale, "gate rms": float(np.sqrt(np.mean(gate**2)))}
        for label, dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
            row[label] = activation_magnitudes(gate, up, dtype)
        rows.append(row)
    return rows


# %%
def payload_table() -> list[dict]:
    """Bytes per token per all-to-all pass at K3's sizes, from `dispatch_payload`."""
    k3 = MoEConfig.k3()
    full = k3.replace(latent_size=k3.d, use_latent_projection=False, use_latent_norm=False)
    half = full.replace(num_experts=k3.n // 2, top_k=k3.k // 2)
    rows = []
    for name, config in (("plain MoE, K3's n and k", full),
                         ("plain MoE, n/2 and k/2", half),
                         ("LatentMoE", k3.replace(use_latent_norm=False)),
                         ("Stable LatentMoE (K3)", k3)):
        bf16 = dispatch_payload(config, bytes_per_value=2)
        fp8 = dispatch_payload(config, bytes_per_value=1)
        rows.append({"variant": name, "n": config.n, "k": config.k, "width": config.ell,
                     "values": int(bf16["latent_values"]), "bf16 bytes": bf16["latent_bytes"],
                     "fp8 bytes": fp8["latent_bytes"]})
    return rows


# %%
def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Print a plain aligned table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


# %%
def plot(results: dict, out: Path) -> None:
    """Save `output_scale.png` and `half_precision.png` into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["variants"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    gains = [row["mean gain"] for row in results["output_scale"]]
    for name in names:
        axes[0].plot(gains, [row[name] for row in results["output_scale"]], marker="o", label=name)
        axes[1].plot(gains, [row[f"{name} spread"] for row in results["output_scale"]], marker="o", label=name)
    axes[0].set(xlabel="mean gain of the selected experts", ylabel="mean RMS of the routed output",
                title="Output scale follows the selection...")
    axes[1].set(xlabel="mean gain of the selected experts", ylabel="spread across tokens (std / mean)",
                title="...and varies from token to token")
    axes[0].legend()
    fig.tight_layout()
    show_figure(fig, out, "output_scale.png",
                caption="Without the latent norm the routed output's scale follows the gains of the experts that "
                        "happen to be chosen, and varies from token to token; with it (Stable LatentMoE) the "
                        "scale is flat.",
                alt="Two line plots against the mean gain of the selected experts: the mean RMS of the routed"
                    " output and its spread across tokens, for plain MoE, LatentMoE and Stable LatentMoE")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    scales = [row["scale"] for row in results["half_precision"]]
    for dtype, style in (("float16", "-"), ("bfloat16", "--")):
        for act, color in (("SwiGLU", "tab:red"), ("SiTU-GLU", "tab:green")):
            rows = results["half_precision"]
            axes[0].plot(scales, [100 * r[dtype][act]["overflow"] for r in rows], style, color=color,
                         marker="o", label=f"{act}, {dtype}")
            axes[1].plot(scales, [r[dtype][act]["max"] for r in rows], style, color=color, marker="o",
                         label=f"{act}, {dtype}")
    axes[0].set(xscale="log", xlabel="input scale", ylabel="outputs that overflow (%)",
                title="Overflow to infinity")
    axes[1].axhline(FLOAT16_MAX, color="gray", lw=0.8)
    axes[1].axhline(100, color="gray", lw=0.8, ls=":")
    axes[1].set(xscale="log", yscale="log", xlabel="input scale", ylabel="largest finite |activation|",
                title="Largest activation (lines: 65,504 and 100)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    show_figure(fig, out, "half_precision.png",
                caption="As the inputs grow, SwiGLU's outputs overflow in float16 and its largest activation "
                        "passes 65,504, while SiTU-GLU never passes 100 in either half precision.",
                alt="Two log-scale line plots against the input scale: the share of outputs that overflow, "
                    "and the largest finite activation, for SwiGLU and SiTU-GLU in float16 and bfloat16")


# %%
def main(argv: list[str] | None = None) -> dict:
    """Run the three comparisons, print them, and save the figures when `--out` is given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for the PNG figures")
    parser.add_argument("--quick", action="store_true", help="fewer tokens, for the tests")
    args = parser.parse_args(argv)

    d, ell, n, k, f = 64, 32, 16, 4, 32
    m = 256 if args.quick else 2048
    rng = np.random.default_rng(40)
    x = rng.standard_normal((m, d)).astype(np.float32)  # [m, d], the same tokens for every variant
    gains = np.geomspace(0.25, 4.0, n)  # [n], expert e answers gains[e] times louder than usual
    configs = variants(d, ell, n, k, f)
    params = shared_router_params(configs, gains, seed=7)

    print(f"Layers: d = {d}, l = {ell} (plain MoE: l = d), n = {n}, k = {k}, f = {f}; {m} tokens.")
    print("Router, bias and tokens are shared, so every variant picks the same experts.\n")

    # Step 1: Output scale
    print("1. Routed output scale while the bias moves tokens toward loud experts")
    print("   (mean over tokens of RMS(y_routed); in brackets the spread")
    print("   across tokens, std / mean)")
    scale_rows = output_scale(x, configs, params, gains, [-0.4, -0.2, 0.0, 0.2, 0.4])
    print_table(["bias shift", "mean gain", *configs],
                [[f"{r['shift']:+.1f}", f"{r['mean gain']:.2f}",
                  *(f"{r[name]:.3f} ({r[f'{name} spread']:.2f})" for name in configs)] for r in scale_rows])
    for name in configs:
        values = [r[name] for r in scale_rows]
        print(f"   {name}: largest / smallest over the sweep = {max(values) / min(values):.3f}")

    print("\n   The same with the routed scaling factor instead of the bias:")
    factor_rows = scaling_factor_effect(x, configs, params, [0.5, 1.0, 2.5])
    print_table(["factor", *configs], [[f"{r['factor']:g}", *(f"{r[name]:.3f}" for name in configs)]
                                       for r in factor_rows])

    # What to see: as the bias moves tokens from the quiet experts to the loud ones, the routed output of the
    # plain MoE and of LatentMoE grows with the gains (about 4.4 and 4.2 times over the sweep), and so does its
    # spread across tokens; Stable LatentMoE's stays at 1.01 with a spread of 0.08, because the RMSNorm
    # divides out the scale that the choice of experts brings. The routed scaling factor shows it plainly: it
    # multiplies the first two outputs and leaves the third where it was.

    # Step 2: Half precision
    print("\n2. Expert activations stored in 16 bits, as the inputs grow (every expert on every token)")
    stable = configs["Stable LatentMoE"]
    half_rows = half_precision(x, stable, params["Stable LatentMoE"], [1, 4, 16, 64, 256, 1024])
    table = []
    for r in half_rows:
        cells = [f"{r['scale']:g}", f"{r['gate rms']:.3g}"]
        for dtype in ("float16", "bfloat16"):
            for act in ("SwiGLU", "SiTU-GLU"):
                cells.append(f"{100 * r[dtype][act]['overflow']:.3f}% / {r[dtype][act]['max']:.3g}")
        table.append(cells)
    print("   cells: share of outputs that overflow to inf / largest finite |output|")
    print_table(["scale", "gate rms", "SwiGLU f16", "SiTU f16", "SwiGLU bf16", "SiTU bf16"], table)
    worst = max(r["float16"]["SwiGLU"]["overflow"] for r in half_rows)
    situ_max = max(r[dt]["SiTU-GLU"]["max"] for r in half_rows for dt in ("float16", "bfloat16"))
    situ_overflow = max(r[dt]["SiTU-GLU"]["overflow"] for r in half_rows for dt in ("float16", "bfloat16"))
    bf16_overflow = max(r["bfloat16"]["SwiGLU"]["overflow"] for r in half_rows)
    print(f"   SwiGLU in float16 overflows on up to {100 * worst:.2f}% of outputs; "
          f"in bfloat16 on {100 * bf16_overflow:.2f}%.")
    print(f"   SiTU-GLU: {100 * situ_overflow:.2f}% overflow, largest |output| {situ_max:.2f} (bound 100).")

    # What to see: SwiGLU's largest output grows with the square of the input scale (16.8 at scale 1, 62,300
    # at 64), and from scale 256 float16 overflows (10% of the outputs become inf, then 42%); bfloat16 does not
    # overflow but hands values of a million and more to the next product. SiTU-GLU stays at or under its
    # bound of 100 in both formats, at every scale.

    # Step 3: Payload
    print("\n3. Payload per token per all-to-all pass (dispatch, and again for the combine), K3 sizes")
    pay_rows = payload_table()
    print_table(["variant", "n", "k", "width", "values", "bf16 bytes", "fp8 bytes"],
                [[r["variant"], str(r["n"]), str(r["k"]), str(r["width"]), f"{r['values']:,}",
                  f"{r['bf16 bytes']:,.0f}", f"{r['fp8 bytes']:,.0f}"] for r in pay_rows])

    # What to see: the latent variants send vectors of width l = 3584 instead of d = 7168: 114,688 bytes
    # per token and pass in bfloat16, half the plain MoE's 229,376, the same as a full-width MoE with half the
    # experts and half the top-k. The norm costs no bytes: Stable LatentMoE sends what LatentMoE sends.

    # Step: The figures
    results = {"variants": configs, "output_scale": scale_rows, "scaling_factor": factor_rows,
               "half_precision": half_rows, "payload": pay_rows}
    if figures_wanted(args.out):
        plot(results, args.out)
    return results


# %%
if __name__ == "__main__":
    main()
