r"""The K3 accounting table, computed from the configuration.

Every number below comes from `MoEConfig.k3()` through
`refimpl.layer.accounting`; none is typed in. Only K3's published totals (2.78T
parameters, 104.2B activated) are constants here, as the yardstick the
computed counts are compared with.

Three tables:

* **parameters** of one layer and of the 92 MoE layers: a routed expert is a
  three-matrix GLU on the latent, $3\ell f$ weights; the two shared experts
  form one GLU of width $N_s f$ on the full width, $3 d N_s f$; the latent
  projections are $2 d\ell$;
* **dispatch payload**: under expert parallelism each token travels to its
  $k$ experts and back; the latent makes that $k\ell$ values each way instead
  of $kd$, and it is exactly what the full-width layer with $n/\alpha$ experts
  and top-$k/\alpha$ sent;
* **combinatorial sparsity**: how many expert sets a token can choose,
  $\binom{n}{k}$, against the $\binom{n/\alpha}{k/\alpha}^\alpha$ of that layer.

With `--out DIR` the script draws where a layer's parameters sit and how the
number of combinations grows with $\alpha$.
"""

# %%
from __future__ import annotations

import argparse
import math
from pathlib import Path

from refimpl.config import MoEConfig
from refimpl.layer.accounting import (
    combinatorial_sparsity,
    dispatch_payload,
    log10_binomial,
    parameter_counts,
)
from refimpl.studies.figures import figures_wanted, show_figure

#: K3's published totals, the yardstick for the computed counts.
K3_TOTAL_PARAMETERS = 2.78e12
K3_ACTIVATED_PARAMETERS = 104.2e9


# %%
def table(rows: list[tuple[str, str, int | float | str]], header: tuple[str, str, str]) -> None:
    """Print rows of (what, formula, value) as an aligned text table."""
    cells = [header] + [(a, b, f"{c:,}" if isinstance(c, int) else str(c)) for a, b, c in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(3)]
    for n, (a, b, c) in enumerate(cells):
        print(f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}")
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


# %%
def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figures in this folder")
    args = parser.parse_args(argv)

    config = MoEConfig.k3()
    d, ell, n, k, f, ns = config.d, config.ell, config.n, config.k, config.f, config.num_shared_experts
    layers = config.num_moe_layers
    counts = parameter_counts(config)
    payload = dispatch_payload(config, bytes_per_value=2)
    sparsity = combinatorial_sparsity(config)

    print(f"K3 layer (MoEConfig.k3()): d={d}, l={ell} (alpha={config.alpha:g}), n={n}, k={k}, f={f}, "
          f"N_s={ns} (shared width {config.shared_size}), {layers} MoE layers")

    # Step: Parameters of one layer
    print("\nParameters of one layer")
    table([
        ("one routed expert", "3 l f", counts["routed_expert"]),
        ("all routed experts", "n 3 l f", counts["routed"]),
        ("shared experts, merged", "3 d N_s f", counts["shared"]),
        ("latent projections", "2 d l", counts["projections"]),
        ("latent RMSNorm gain", "l", counts["norm"]),
        ("router weight and bias", "n d + n", counts["router"]),
        ("layer total", "", counts["total"]),
    ], ("part", "formula", "parameters"))
    print(f"  routed experts hold {counts['routed'] / counts['total']:.1%} of the layer")

    # What to see: one routed expert is small (33,030,144 weights, three l-by-f matrices on the latent), but
    # there are 896 of them, so the routed experts hold 99.4% of the layer. The shared experts work on the
    # full width d, twice l, with twice the hidden width f, so their one GLU is worth only a handful of
    # routed experts; the projections, the norm and the router are smaller still.

    # Step: Activated per token
    print("\nActivated per token, per layer")
    table([
        (f"{k} routed experts", "k 3 l f", counts["activated_routed"]),
        ("shared experts", "3 d N_s f", counts["shared"]),
        ("latent projections", "2 d l", counts["projections"]),
        ("activated", "", counts["activated"]),
        ("router, on top", "n d", counts["router_weight"]),
        ("activated with the router", "", counts["activated_with_router"]),
    ], ("part", "formula", "parameters"))

    # What to see: a token uses 16 of the 896 routed experts, 528,482,304 of their 29,595,009,024 weights,
    # while the shared experts and the latent projections serve every token whole. The routed share of what a
    # token uses is therefore far below its 99.4% of what the layer holds. The router is listed on top: every
    # token is scored against all 896 experts, so its whole n d weight is read for every token too.

    # Step: Over the whole model
    routed_all = counts["routed_all_layers"]
    activated_all = counts["activated_all_layers"]
    print(f"\nOver the {layers} MoE layers")
    table([
        ("routed experts", f"{layers} n 3 l f", routed_all),
        ("  in units of 10^12", "", f"{routed_all / 1e12:.2f}T"),
        ("  share of K3's 2.78T", "", f"{routed_all / K3_TOTAL_PARAMETERS:.1%}"),
        ("activated per token", f"{layers} x activated", activated_all),
        ("  in units of 10^9", "", f"{activated_all / 1e9:.1f}B"),
        ("  share of K3's 104.2B", "", f"{activated_all / K3_ACTIVATED_PARAMETERS:.1%}"),
    ], ("quantity", "formula", "value"))
    # MXFP4: blocks of 32 four-bit E2M1 values sharing one eight-bit E8M0 scale.
    bits_mxfp4 = 4 + 8 / 32
    print(f"  the routed experts in MXFP4 ({bits_mxfp4:g} bits per weight): {routed_all * bits_mxfp4 / 8 / 1e12:.2f} TB, "
          f"against {routed_all * 2 / 1e12:.2f} TB in bf16")

    # What to see: the routed experts of the 92 MoE layers make up 97.9% of K3's 2.78T parameters, but what
    # a token activates in those layers is only 62.9% of K3's 104.2B: the parts outside the MoE layers are
    # small in count, yet every token uses all of them, while it uses a sliver of the experts. Stored in
    # MXFP4 at 4.25 bits per weight (four-bit values, plus a quarter bit each for the scale a block of them
    # shares), the experts take 1.45 TB instead of 5.45 TB in bf16.

    # Step: Dispatch and combine payload
    base_k, base_d = k // round(config.alpha), d
    base_values = base_k * base_d
    print("\nDispatch and combine payload per token, each way")
    table([
        ("this layer (latent)", "k l", payload["latent_values"]),
        ("full width, same k", "k d", payload["full_width_values"]),
        ("ratio", "l / d = 1 / alpha", f"{payload['ratio']:g}"),
        (f"full width, n/alpha = {n // round(config.alpha)} experts, top-{base_k}", "(k/alpha) d", base_values),
        ("this layer in bf16 bytes", "2 k l", int(payload["latent_bytes"])),
    ], ("layer", "formula", "values"))
    same = "the same" if base_values == payload["latent_values"] else "different"
    print(f"  twice the experts and twice the k at half the width: {same} traffic as the layer it replaces")

    # What to see: a token sends its latent, l = 3584 values, to each of its 16 experts: 57,344 values, half
    # the 114,688 of a full-width layer with the same k. That is exactly the traffic of the full-width layer
    # with 448 experts and top-8, since 16 times l equals 8 times d. (In bf16, at 2 bytes a value, the latent
    # payload is 114,688 bytes: the same figure as the full-width value count, by the same identity.)

    # Step: Combinatorial sparsity
    a = round(sparsity["alpha"])
    ratio_digits = sparsity["log10_ratio"]
    print("\nCombinatorial sparsity: how many expert sets a token can choose")
    table([
        (f"C({n}, {k})", "log10", f"{sparsity['log10_latent']:.2f}"),
        (f"C({n // a}, {k // a})^{a}", f"{a} log10", f"{sparsity['log10_base_power_alpha']:.2f}"),
        ("ratio", "log10", f"{ratio_digits:.2f}"),
    ], ("combinations", "", "value"))
    print(f"  C({n}, {k}) is {10 ** ratio_digits:.1f} times C({n // a}, {k // a})^{a}, "
          f"and C({n // a}, {k // a}) itself is 10^{log10_binomial(n // a, k // a):.2f}")

    # What to see: the latent layer offers C(896, 16) = 10^33.86 expert sets, 5.0 times the 10^33.15 of two
    # independent top-8 choices over 448 experts each. The second count holds only the sets with exactly 8
    # experts in each half of the 896; the first also counts every uneven split, hence the surplus.

    # Step: The figures
    if figures_wanted(args.out):
        save_figures(args.out, config, counts)
    return dict(counts=counts, payload=payload, sparsity=sparsity)


# %%
def save_figures(out: Path, config: MoEConfig, counts: dict[str, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Where one layer's parameters sit, and which of them a token uses.
    parts = [("routed experts", counts["routed"], counts["activated_routed"]),
             ("shared experts", counts["shared"], counts["shared"]),
             ("latent projections", counts["projections"], counts["projections"]),
             ("router", counts["router"], counts["router_weight"])]
    fig, ax = plt.subplots(figsize=(7.5, 3.0))
    names = [p[0] for p in parts]
    ax.barh(names, [p[1] for p in parts], color="tab:blue", label="held by the layer")
    ax.barh(names, [p[2] for p in parts], color="tab:orange", label="used by one token")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("parameters per layer (log scale)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("K3: one layer's parameters")
    fig.tight_layout()
    show_figure(fig, out, "parameters.png",
                caption="Almost all of a K3 layer's parameters sit in its routed experts, and one token uses only"
                        " a small share of them (note the log scale).",
                alt="Horizontal bars on a log scale of the parameters one layer holds and those one token "
                    "uses, for the routed experts, the shared experts, the latent projections and the router")

    # C(alpha N, alpha k) against C(N, k)^alpha for the layer LatentMoE starts from.
    a = round(config.alpha)
    base_n, base_k = config.n // a, config.k // a
    alphas = [1, 2, 3, 4]
    latent = [log10_binomial(s * base_n, s * base_k) for s in alphas]
    power = [s * log10_binomial(base_n, base_k) for s in alphas]
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax.plot(alphas, latent, "o-", label=rf"$\log_{{10}}\binom{{\alpha\,{base_n}}}{{\alpha\,{base_k}}}$")
    ax.plot(alphas, power, "s--", label=rf"$\alpha\,\log_{{10}}\binom{{{base_n}}}{{{base_k}}}$")
    ax.annotate("K3", (a, latent[a - 1]), textcoords="offset points", xytext=(8, -12))
    ax.set_xticks(alphas)
    ax.set_xlabel(r"$\alpha$ (experts and top-$k$ both scaled by $\alpha$)")
    ax.set_ylabel("log10 of the number of expert sets")
    ax.legend()
    ax.set_title("Combinatorial sparsity")
    gap.bar(alphas, [x - y for x, y in zip(latent, power, strict=True)], color="tab:green")
    gap.set_xticks(alphas)
    gap.set_xlabel(r"$\alpha$")
    gap.set_ylabel("difference of the two (log10)")
    gap.set_title(r"$\binom{\alpha N}{\alpha k}$ over $\binom{N}{k}^{\alpha}$")
    fig.tight_layout()
    show_figure(fig, out, "combinations.png",
                caption="Scaling the experts and the top-k together by alpha gives more expert sets than the "
                        "alpha-th power of the base layer's count, and the surplus grows with alpha.",
                alt="Line plot of the log10 number of expert sets against alpha for the latent layer and for "
                    "the power of the base layer, beside bars of their difference")
    assert all(x >= y for x, y in zip(latent, power, strict=True)), "C(aN, ak) >= C(N, k)^a failed"
    assert math.isclose(latent[0], power[0])


# %%
if __name__ == "__main__":
    main()
