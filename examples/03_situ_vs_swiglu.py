r"""SiTU-GLU against SwiGLU and a hard clamp.

Appendix B makes three claims about K3's activation
$\operatorname{SiTU\text{-}GLU}(a, b) = [\operatorname{softcap}(a,\beta_1)\,\sigma(a)]
\odot \operatorname{softcap}(b,\beta_2)$, with $\beta_1 = 4$, $\beta_2 = 25$ and
$\operatorname{softcap}(z, \beta) = \beta\tanh(z/\beta)$. This example measures
each one, and sets the smooth cap beside the obvious alternative, a hard
clamp $\min(\max(z, -\beta), \beta)$ in the same two places:

1. **bounded output**: $|\operatorname{SiTU\text{-}GLU}| < \beta_1\beta_2 = 100$ for every
   finite input, in every precision, where SwiGLU overflows;
2. **first-order equivalence**: $\operatorname{softcap}(z,\beta) = z - z^3/(3\beta^2) + \dots$,
   so near 0 SiTU-GLU is SwiGLU, and as $\beta_1, \beta_2 \to \infty$ it becomes
   SwiGLU everywhere;
3. **smooth saturation**: the softcap's derivative never vanishes, while the
   clamp's is exactly 0 past the bound, so a saturated unit of the clamped
   GLU passes no gradient at all.

With `--out DIR` it draws the functions, their derivatives, the bound and the
convergence.
"""

# %%
from __future__ import annotations

import argparse
from pathlib import Path

import ml_dtypes
import numpy as np

from refimpl.layer.activations import (
    hard_clamp,
    hard_clamp_grad,
    situ_glu,
    situ_glu_grad,
    softcap,
    softcap_grad,
    swiglu,
    swiglu_grad,
)
from refimpl.studies.figures import figures_wanted, show_figure

BETA1, BETA2 = 4.0, 25.0
BOUND = BETA1 * BETA2
DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# %%
def clamped_glu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The GLU with hard clamps where SiTU-GLU has softcaps: clamp(a, b1) sigma(a) clamp(b, b2)."""
    sig = 1.0 / (1.0 + np.exp(-np.clip(a, -700, 700)))
    return hard_clamp(a, BETA1) * sig * hard_clamp(b, BETA2)


# %%
def slope(x: np.ndarray, y: np.ndarray) -> float:
    """The slope of log|y| against log x, by least squares."""
    return float(np.polyfit(np.log(x), np.log(np.abs(y)), 1)[0])


# %%
def extreme_inputs(dtype) -> np.ndarray:
    """Large finite values of `dtype` (±1e30 where representable, ±max) and ordinary ones."""
    big = float(ml_dtypes.finfo(dtype).max)
    values = [0.0, 1.0, -1.0, 5.0, -5.0, 60.0, -60.0, 1e4, -1e4, big, -big]
    if big > 1e30:
        values += [1e30, -1e30]
    return np.array(values, dtype=dtype)


# %%
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figures in this folder")
    args = parser.parse_args(argv)
    results: dict[str, object] = {}

    # Step 1: The bound.
    print(f"1. The bound |SiTU-GLU| <= beta1 * beta2 = {BOUND:g}")
    print("   every pair (a, b) of large finite inputs, computed in float32 or wider and cast back:")
    print(f"   {'dtype':<9} {'largest input':>14} {'max |SiTU-GLU|':>15} {'max |SwiGLU|':>13}")
    bound_rows = {}
    for name, dtype in DTYPES.items():
        values = extreme_inputs(dtype)
        a, b = np.meshgrid(values, values)
        situ = np.abs(situ_glu(a, b).astype(np.float64))
        with np.errstate(over="ignore", invalid="ignore"):
            swi = np.abs(swiglu(a, b).astype(np.float64))
        bound_rows[name] = (float(situ.max()), float(np.nanmax(swi)))
        print(f"   {name:<9} {float(values.astype(np.float64).max()):>14.3g} {situ.max():>15g} "
              f"{np.nanmax(swi):>13.3g}")
    results["bound"] = bound_rows
    # In exact arithmetic the bound is strict; float64 shows it while tanh is still below 1.
    grid = np.linspace(-60.0, 60.0, 1201)
    a, b = np.meshgrid(grid, np.linspace(-300.0, 300.0, 1201))
    moderate = float(np.max(np.abs(situ_glu(a, b))))
    results["moderate_max"] = moderate
    print(f"   over |a| <= 60, |b| <= 300 in float64: max |SiTU-GLU| = {BOUND:g} - {BOUND - moderate:.1e}, "
          "strictly below the bound;")
    print("   further out tanh rounds to exactly 1 and the computed value saturates at the bound itself.")

    # What to see: SwiGLU multiplies its two inputs almost as they are, so two large finite values overflow
    # to inf in every format, float64 included. SiTU-GLU's factors are capped before they meet, at 4 and 25,
    # so its output never passes 100. It reaches exactly 100 only because tanh and the sigmoid round to 1 far
    # out; where they do not yet, as over |a| <= 60, |b| <= 300, it stays 7.6e-09 below.

    # Step 2: First-order equivalence near 0.
    print("\n2. First-order equivalence with SwiGLU near 0")
    t = np.geomspace(1e-3, 1e-1, 9)
    cap_err = softcap(t, BETA1) - t
    print(f"   softcap(t, 4) - t against the Taylor term -t^3 / (3 * 4^2) = -t^3 / {3 * BETA1**2:g}:")
    for ti, ei in zip(t[::4], cap_err[::4], strict=True):
        print(f"     t = {ti:.0e}: {ei:.4e}  vs  {-ti**3 / (3 * BETA1**2):.4e}")
    glu_err = situ_glu(t, t) - swiglu(t, t)
    cap_slope, glu_slope = slope(t, cap_err), slope(t, glu_err)
    results["softcap_slope"], results["glu_slope"] = cap_slope, glu_slope
    print(f"   log-log slope of |softcap(t) - t|: {cap_slope:.2f} (the error is third order)")
    print(f"   log-log slope of |SiTU-GLU(t, t) - SwiGLU(t, t)|: {glu_slope:.2f} "
          "(a product of two factors, each off at third order)")
    for point in [(0.0, 1.0), (1.0, 0.0), (0.1, 0.1)]:
        ga_s, gb_s = situ_glu_grad(np.array([point[0]]), np.array([point[1]]))
        ga_w, gb_w = swiglu_grad(np.array([point[0]]), np.array([point[1]]))
        print(f"   gradient (d/da, d/db) at (a, b) = {point}: SiTU-GLU ({ga_s[0]:.5f}, {gb_s[0]:.5f}), "
              f"SwiGLU ({ga_w[0]:.5f}, {gb_w[0]:.5f})")

    print("   convergence as the caps grow (max |SiTU-GLU - SwiGLU| over |a|, |b| <= 8):")
    grid = np.linspace(-8.0, 8.0, 161)
    a, b = np.meshgrid(grid, grid)
    reference = swiglu(a, b)
    scales = [1.0, 10.0, 100.0, 1000.0]
    gaps = []
    for scale in scales:
        gap = float(np.max(np.abs(situ_glu(a, b, BETA1 * scale, BETA2 * scale) - reference)))
        gaps.append(gap)
        print(f"     beta1 = {BETA1 * scale:>6g}, beta2 = {BETA2 * scale:>7g}: {gap:.3e}")
    results["convergence"] = gaps
    print(f"   each tenfold increase of the caps divides the gap by about "
          f"{np.exp(np.mean(np.diff(np.log(gaps[1:])) * -1)):.0f} (the 1/beta^2 of the Taylor term)")

    # What to see: near 0 the cap's error is the Taylor term -t^3 / 48 to five digits (slope 3.00); only at
    # t = 1e-01 does the next term show (-2.0828e-05 against -2.0833e-05). In the GLU one factor's third-order
    # error is multiplied by the other factor, itself of size t, so the gap has slope 4.01. The gradients
    # differ only where a cap bends its input: at b = 1 the up cap gives d/da 0.49973 for 0.50000, and at
    # a = 1 the gate cap gives d/db 0.71620 for 0.73106. With the real caps the gap over |a|, |b| <= 8 is
    # large (3.415e+01), since a = 8 is twice beta1; it shrinks as 1/beta^2, about 99 times per tenfold.

    # Step 3: Smooth saturation.
    print("\n3. Derivatives past the bound: softcap against a hard clamp (beta = 4)")
    print(f"   {'z':>6} {'softcap grad':>14} {'clamp grad':>11}")
    z = np.array([2.0, 4.5, 6.0, 12.0, 40.0, 400.0])
    soft, hard = softcap_grad(z, BETA1), hard_clamp_grad(z, BETA1)
    for zi, si, hi in zip(z, soft, hard, strict=True):
        print(f"   {zi:>6g} {si:>14.3e} {hi:>11g}")
    results["soft_grad"], results["hard_grad"] = soft, hard
    zz = np.linspace(-10 * BETA1, 10 * BETA1, 4001)
    print(f"   smallest softcap derivative over |z| <= 10 beta: {softcap_grad(zz, BETA1).min():.3e} (> 0); "
          f"the clamp's derivative is 0 on {np.mean(hard_clamp_grad(zz, BETA1) == 0):.0%} of that range")
    # In the GLU: the gradient that reaches the up projection when b is past beta2.
    a0, b0 = np.array([2.0]), np.array([40.0])
    _, up_grad = situ_glu_grad(a0, b0)
    clamp_up_grad = clamped_glu(a0, np.ones(1)) * hard_clamp_grad(b0, BETA2)
    print(f"   d/db at (a, b) = (2, 40): SiTU-GLU {up_grad[0]:.4f}, clamped GLU {clamp_up_grad[0]:g}, "
          f"SwiGLU {swiglu_grad(a0, b0)[1][0]:.4f}")

    # What to see: the softcap's derivative falls off exponentially past the cap (8.245e-09 at z = 40,
    # 5.536e-87 at z = 400) but is never 0, while the clamp's is exactly 0 as soon as |z| passes 4, which is
    # 90% of the range |z| <= 10 beta. In the GLU, with b = 40 past the up cap of 25, SiTU-GLU still passes a
    # gradient of 0.2451 to the up projection (SwiGLU: 1.7616); the clamped GLU passes 0, and a unit stuck
    # there stops learning.

    # Step 4: Where floating point gives out, and why the module avoids two textbook formulas.
    # 1 - tanh(z) = 2 / (e^{2z} + 1) falls below half the spacing of the floats just under 1, 2^-(p+1) for p
    # bits, once z > (p + 2) ln 2 / 2: from there a correctly rounded tanh is exactly 1. Where a given tanh
    # first returns 1 differs by a little between implementations (a vectorized one may stop early), so the
    # example prints the limit the format sets and checks NumPy's tanh a step on either side of it.
    print("\n4. Floating-point limits")
    limits = {}
    for name, dtype, p in (("float64", np.float64, 53), ("float32", np.float32, 24)):
        tanh_one = (p + 2) * np.log(2) / 2
        sigmoid_zero = -2 * tanh_one  # (1 + tanh(z/2)) / 2 is 0 once tanh(z/2) is -1
        with np.errstate(under="ignore"):
            below, beyond = np.tanh(dtype(tanh_one - 1)), np.tanh(dtype(tanh_one + 2))
        limits[name] = (tanh_one, sigmoid_zero)
        print(f"   {name}: tanh(z) rounds to 1 for z beyond {tanh_one:.2f} (NumPy's tanh: below 1 at z = "
              f"{tanh_one - 1:.2f}: {bool(below < 1)}, exactly 1 at z = {tanh_one + 2:.2f}: {bool(beyond == 1)}), "
              f"so 1 - tanh(z)^2 is 0 there; (1 + tanh(z/2)) / 2 is 0 for z below {sigmoid_zero:.2f}")
    results["limits"] = limits
    z = np.array([40.0])
    print(f"   at z = {z[0]:g} in float64: 1 - tanh(z)^2 = {1 - np.tanh(z[0]) ** 2:g}, "
          f"while softcap_grad(z, 1) = {softcap_grad(z, 1.0)[0]:.3e} (the sech^2 form)")

    # What to see: past z = 19.06 in float64 and 9.01 in float32, tanh(z) rounds to exactly 1, so a formula
    # that subtracts it from 1 returns 0 where the true value is tiny but positive: 1 - tanh(z)^2 at z = 40
    # gives 0, and a derivative computed that way would vanish like the clamp's. A sigmoid written with tanh
    # hits 0 below -38.12 (float64), and a router whose chosen scores are all 0 divides 0 by 0. The module
    # builds the small quantity from exp(-|z|) or exp(-2|z|) directly, with no subtraction: softcap_grad
    # gives 7.219e-35 at z = 40.

    # Step: The figures
    if figures_wanted(args.out):
        save_figures(args.out, gaps, scales)
    return results


# %%
def save_figures(out: Path, gaps: list[float], scales: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = dict(swiglu=dict(color="tab:gray", ls="--", label="SwiGLU"),
                  situ=dict(color="tab:blue", label="SiTU-GLU (softcap)"),
                  clamp=dict(color="tab:red", ls=":", label="hard clamp"))

    # The two factors and the product along the diagonal.
    a = np.linspace(-10, 16, 600)
    sig = 1.0 / (1.0 + np.exp(-a))
    b = np.linspace(-80, 80, 600)
    t = np.geomspace(0.1, 1e3, 400)
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.4))
    axes[0].plot(a, a * sig, **styles["swiglu"])
    axes[0].plot(a, softcap(a, BETA1) * sig, **styles["situ"])
    axes[0].plot(a, hard_clamp(a, BETA1) * sig, **styles["clamp"])
    axes[0].axhline(BETA1, color="k", lw=0.6)
    axes[0].set_title(r"gate factor $g(a)$, $\beta_1 = 4$")
    axes[1].plot(b, b, **styles["swiglu"])
    axes[1].plot(b, softcap(b, BETA2), **styles["situ"])
    axes[1].plot(b, hard_clamp(b, BETA2), **styles["clamp"])
    axes[1].set_title(r"up factor $h(b)$, $\beta_2 = 25$")
    axes[2].loglog(t, np.abs(swiglu(t, t)), **styles["swiglu"])
    axes[2].loglog(t, np.abs(situ_glu(t, t)), **styles["situ"])
    axes[2].loglog(t, np.abs(clamped_glu(t, t)), **styles["clamp"])
    axes[2].axhline(BOUND, color="k", lw=0.6)
    axes[2].set_title(r"output on the diagonal $a = b = t$")
    axes[2].set_xlabel("t")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    show_figure(fig, out, "functions.png",
                caption="SiTU-GLU follows SwiGLU near zero and bends smoothly to its caps (4 for the gate factor,"
                        " 25 for the up factor), so the output levels off at 100; the hard clamp bends with a "
                        "corner.",
                alt="Three line plots comparing SwiGLU, SiTU-GLU and a hard clamp: the gate factor, the up "
                    "factor, and their product along the diagonal on log axes")

    # Derivatives: linear, then log scale to show that the softcap's never reaches 0.
    z = np.linspace(-20, 20, 801)
    zl = np.linspace(0, 100, 801)
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.4))
    axes[0].plot(z, np.ones_like(z), **styles["swiglu"])
    axes[0].plot(z, softcap_grad(z, BETA1), **styles["situ"])
    axes[0].plot(z, hard_clamp_grad(z, BETA1), **styles["clamp"])
    axes[0].set_title(r"$d/dz$ of the cap, $\beta = 4$")
    axes[1].semilogy(zl, softcap_grad(zl, BETA1), **styles["situ"])
    axes[1].axvspan(BETA1, 100, color="tab:red", alpha=0.1, label="hard clamp: exactly 0")
    axes[1].set_title("the same, log scale")
    axes[1].set_xlabel("z")
    bb = np.linspace(-100, 100, 801)
    a0 = np.full_like(bb, 2.0)
    axes[2].plot(bb, swiglu_grad(a0, bb)[1], **styles["swiglu"])
    axes[2].plot(bb, situ_glu_grad(a0, bb)[1], **styles["situ"])
    axes[2].plot(bb, clamped_glu(a0, np.ones_like(bb)) * hard_clamp_grad(bb, BETA2), **styles["clamp"])
    axes[2].set_title(r"$\partial/\partial b$ of the GLU at $a = 2$")
    axes[2].set_xlabel("b")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    show_figure(fig, out, "derivatives.png",
                caption="The softcap's derivative decays but never reaches zero, so a capped unit still gets a "
                        "gradient; the hard clamp's derivative is exactly zero past its bound.",
                alt="Three line plots of derivatives: of the cap on a linear and on a log scale, with the "
                    "range where the clamp's derivative is zero shaded, and of the GLU with respect to its up"
                    " input")

    # The bound: the whole (a, b) plane, and the largest value within radius R.
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.8))
    ga = np.linspace(-20, 20, 401)
    gb = np.linspace(-100, 100, 401)
    A, B = np.meshgrid(ga, gb)
    image = axes[0].pcolormesh(A, B, situ_glu(A, B), cmap="RdBu_r", vmin=-BOUND, vmax=BOUND, shading="auto")
    fig.colorbar(image, ax=axes[0])
    axes[0].set_xlabel("a (gate)")
    axes[0].set_ylabel("b (up)")
    axes[0].set_title(r"SiTU-GLU$(a, b)$: within $\pm\beta_1\beta_2 = \pm 100$")
    radii = np.geomspace(1, 1e6, 25)
    situ_max, swi_max = [], []
    for radius in radii:
        edge = np.concatenate([-np.geomspace(radius, 1e-3, 40), [0.0], np.geomspace(1e-3, radius, 40)])
        EA, EB = np.meshgrid(edge, edge)
        situ_max.append(np.max(np.abs(situ_glu(EA, EB))))
        swi_max.append(np.max(np.abs(swiglu(EA, EB))))
    axes[1].loglog(radii, swi_max, **styles["swiglu"])
    axes[1].loglog(radii, situ_max, **styles["situ"])
    axes[1].axhline(BOUND, color="k", lw=0.6, label="bound 100")
    axes[1].set_xlabel("R")
    axes[1].set_title(r"largest $|\cdot|$ over $|a|, |b| \leq R$")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    show_figure(fig, out, "bound.png",
                caption="Over the whole input plane SiTU-GLU stays within plus or minus 100, while SwiGLU's "
                        "largest value grows without bound as the inputs grow.",
                alt="Colour map of SiTU-GLU over its gate and up inputs, beside a log-log plot of the largest"
                    " output within radius R for SwiGLU and for SiTU-GLU")

    # First-order agreement near 0, and convergence as the caps grow.
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    t = np.geomspace(1e-3, 1, 60)
    axes[0].loglog(t, np.abs(softcap(t, BETA1) - t), label=r"$|\mathrm{softcap}(t, 4) - t|$")
    axes[0].loglog(t, t**3 / (3 * BETA1**2), "k:", label=r"$t^3 / 48$")
    axes[0].loglog(t, np.abs(situ_glu(t, t) - swiglu(t, t)), label=r"$|$SiTU-GLU$-$SwiGLU$|$ at $a = b = t$")
    axes[0].set_xlabel("t")
    axes[0].set_title("near 0: third order and smaller")
    axes[0].legend(fontsize=8)
    axes[1].loglog(scales, gaps, "o-")
    axes[1].set_xlabel(r"scale of $(\beta_1, \beta_2)$")
    axes[1].set_title(r"max $|$SiTU-GLU$-$SwiGLU$|$ on $|a|, |b| \leq 8$")
    fig.tight_layout()
    show_figure(fig, out, "convergence.png",
                caption="Near zero the cap differs from the identity only at third order, and as the caps grow "
                        "SiTU-GLU converges to SwiGLU.",
                alt="Two log-log plots: the error of the cap near zero next to t cubed over 48, and the "
                    "largest gap between SiTU-GLU and SwiGLU against the scale of the caps")


# %%
if __name__ == "__main__":
    main()
