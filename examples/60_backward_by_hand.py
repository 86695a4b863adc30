r"""One backward pass through a tiny layer, checked by difference quotients.

The layer of the forward example (m = 4 tokens, d = 8, $\ell = 4$, n = 6
experts, k = 2, f = 6, one shared expert), in float64. The loss is
$L = \sum_{i,c} y_{i,c}\,\bar y_{i,c}$ for a fixed random $\bar y$, so the
gradient of $L$ is exactly what `backward(dy)` returns.

1. `stable_latent_moe_vjp` gives `y` and `backward`; `backward(dy)` gives the
   gradient in the input and in all eleven parameters.
2. For one entry of every parameter (the one with the largest gradient), the
   central difference quotient $(L(\theta + \varepsilon e) - L(\theta - \varepsilon e)) / 2\varepsilon$
   is set beside the hand-derived value.
3. The bias: its gradient is zero, and its difference quotient is exactly
   zero too, because moving the bias a little changes no chosen set and the
   weights never see it.
4. What the router learns from: only the rows of $W_r$ of experts some token
   chose receive gradient.

With `--out DIR` the script also draws the error of the difference quotient
against the step $\varepsilon$: truncation error falls as $\varepsilon^2$, rounding
error grows as $1/\varepsilon$, and in between the two computations agree to
about ten digits.
"""

from __future__ import annotations

# %%
import argparse
from pathlib import Path

import numpy as np

from refimpl.config import MoEConfig
from refimpl.layer.backward import stable_latent_moe_vjp
from refimpl.layer.latent_moe import init_params, stable_latent_moe
from refimpl.layer.routing import route, router_scores
from refimpl.studies.figures import figures_wanted, show_figure

#: The seed of the weights, the tokens and the upstream gradient.
SEED = 8


# %%
def loss(x: np.ndarray, params: dict, config: MoEConfig, dy: np.ndarray) -> float:
    """$L = \\sum y \\odot \\bar y$, the loss whose gradient `backward(dy)` is."""
    return float(np.sum(stable_latent_moe(x, params, config) * dy))


def difference_quotient(x: np.ndarray, params: dict, config: MoEConfig, dy: np.ndarray, name: str,
                        entry: tuple[int, ...], eps: float) -> float:
    """Central difference of the loss along one entry of `x` (name "x") or of a parameter."""
    def moved(sign: float) -> float:
        value = (x if name == "x" else params[name]).copy()
        value[entry] += sign * eps
        if name == "x":
            return loss(value, params, config, dy)
        return loss(x, {**params, name: value}, config, dy)

    return (moved(+1.0) - moved(-1.0)) / (2 * eps)


# %%
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)

    config = MoEConfig.tiny()  # d=8, l=4, n=6, k=2, f=6, one shared expert
    m = 4
    rng = np.random.default_rng(args.seed)
    params = init_params(config, rng, dtype=np.float64, bias_scale=0.1)
    x = rng.standard_normal((m, config.d))
    dy = rng.standard_normal((m, config.d))
    print(f"Layer: m={m}, d={config.d}, l={config.ell}, n={config.n}, k={config.k}, f={config.f}, "
          f"{config.num_shared_experts} shared expert; float64; loss L = sum(y * dy)")

    # Step 1: the forward pass and the backward pass
    y, backward = stable_latent_moe_vjp(x, params, config)
    dx, dparams = backward(dy)
    print("\n1. y, backward = stable_latent_moe_vjp(x, params, config); dx, dparams = backward(dy)")
    print(f"   L = {float(np.sum(y * dy)):.6f}; dparams has the {len(dparams)} names of params")

    # What to see: one call runs the layer forward and keeps what the backward pass needs; backward(dy) then
    # returns the gradient of L = 3.613248 in the input and in each of the 11 parameter arrays, with the same
    # names as params. Because L is the sum of y times dy, dy is exactly the gradient of L in y, the starting
    # point of the backward pass.

    # Step 2: one entry per array against its difference quotient
    eps = 1e-6
    print(f"\n2. The largest entry of each gradient against a central difference quotient, eps = {eps:g}")
    print(f"   {'array':34s} {'entry':>10s} {'by hand':>14s} {'quotient':>14s} {'|difference|':>12s}")
    worst = 0.0
    for name, grad in [("x", dx), *dparams.items()]:
        if name == "gate.e_score_correction_bias":
            continue
        entry = np.unravel_index(int(np.argmax(np.abs(grad))), grad.shape)
        quotient = difference_quotient(x, params, config, dy, name, entry, eps)
        difference = abs(float(grad[entry]) - quotient)
        worst = max(worst, difference / max(abs(quotient), 1e-300))
        print(f"   {name:34s} {str(tuple(int(i) for i in entry)):>10s} {float(grad[entry]):14.9f} "
              f"{quotient:14.9f} {difference:12.1e}")
    print(f"   largest relative difference: {worst:.1e}")

    # What to see: every hand-derived entry agrees with its quotient to nine digits or more: the largest
    # relative difference is below 1e-9. That is the accuracy of the quotient itself at eps = 1e-06, whose
    # rounding error is about the float64 precision of L divided by eps, so the differences point to no error
    # in the hand-derived gradients. Their last digits are rounding, and move a little from one machine to
    # another. The bias is left out here; the next step takes it up.

    # Step 3: the bias
    # The bias receives no gradient, and the difference quotient agrees exactly.
    bias_grad = dparams["gate.e_score_correction_bias"]
    bias_quotients = [difference_quotient(x, params, config, dy, "gate.e_score_correction_bias", (j,), eps)
                      for j in range(config.n)]
    print("\n3. The bias only selects:")
    print(f"   dparams['gate.e_score_correction_bias'] = {bias_grad.tolist()}")
    print(f"   difference quotients along each bias entry  = {bias_quotients}")

    # What to see: both lists are exactly 0.0, not merely small. The bias only decides which experts are
    # chosen, and the weights come from the raw scores without it; moving one bias entry by 1e-06 changes no
    # token's choice, so L comes out bit for bit the same on both sides and the quotient is exactly zero.

    # Step 4: which rows of the router learn
    chosen, _ = route(router_scores(x, params["gate.weight"]), params["gate.e_score_correction_bias"], config.k)
    used = sorted(set(chosen.ravel().tolist()))
    row_norm = np.linalg.norm(dparams["gate.weight"], axis=1)
    print("\n4. The router learns only through the weights of the chosen experts:")
    print(f"   experts chosen by some token: {used}")
    print(f"   |d gate.weight| per expert row: {np.array2string(row_norm, precision=3)}")
    unused = [j for j in range(config.n) if j not in used]
    print(f"   rows of the unchosen experts {unused} are zero: {bool(np.all(row_norm[unused] == 0))}")

    # What to see: no token chose experts 1 and 2, so their rows of gate.weight get exactly zero gradient: an
    # unchosen expert's score enters neither the selection's outcome nor any weight, so a small change to it
    # changes nothing. Row 3, at 2.566, is also where step 2 found the largest entry of the router's gradient.

    # Step 5: the step of the difference quotient
    steps = np.logspace(-12, -1, 23)
    name, grad = "experts.w1", dparams["experts.w1"]
    entry = np.unravel_index(int(np.argmax(np.abs(grad))), grad.shape)
    errors = [abs(difference_quotient(x, params, config, dy, name, entry, h) - float(grad[entry]))
              for h in steps]
    # Three steps of the figure: rounding dominates the smallest (the loss's own rounding, about u |L|, divided
    # by eps), the truncated Taylor series the largest (terms in eps^2), and in between both are small.
    print(f"\nDifference quotient of {name}{tuple(int(i) for i in entry)} against its step eps:")
    for h, kind in ((1e-12, " (rounding: about u |L| / eps)"), (1e-6, ""), (1e-1, " (truncation: about eps^2)")):
        at = int(np.argmin(np.abs(np.log10(steps) - np.log10(h))))
        print(f"   eps = {steps[at]:.0e}: error {errors[at]:.1e}{kind}")

    # What to see: the error is of order 1e-4 at eps = 1e-12, 1e-10 at 1e-06 (the difference step 2 found for
    # experts.w1) and 5.2e-02 at 1e-01. At the smallest step the two losses differ only in their last digits,
    # and dividing that rounding by eps magnifies it; at the largest, the terms of order eps^2 that the
    # central difference leaves out dominate. The middle step, the one step 2 uses, keeps both small.

    # Step: the figure
    if figures_wanted(args.out):
        save_figure(args.out, steps, np.array(errors), name, entry)
    return dict(config=config, params=params, x=x, dy=dy, y=y, dx=dx, dparams=dparams, worst=worst,
                bias_quotients=bias_quotients, used=used, row_norm=row_norm, steps=steps, errors=errors)


# %%
def save_figure(out: Path, steps: np.ndarray, errors: np.ndarray, name: str, entry: tuple) -> None:
    """The error of the central difference quotient against its step, on log-log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.loglog(steps, np.maximum(errors, 1e-18), "o-", ms=3)
    ax.set_xlabel("step eps")
    ax.set_ylabel("|difference quotient - by hand|")
    ax.set_title(f"{name}{tuple(int(i) for i in entry)}, float64, seed {SEED}")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    show_figure(fig, out, "step_size.png",
                caption="The difference quotient agrees best with the hand-derived gradient at a middle step: "
                        "larger steps add truncation error, smaller ones rounding error.",
                alt="Log-log plot of the error of a difference quotient against its step, falling and then "
                    "rising again, with its minimum at a middle step")


# %%
if __name__ == "__main__":
    main()
