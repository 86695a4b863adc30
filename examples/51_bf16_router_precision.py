r"""A router in bfloat16: how many of K3's tokens change experts

The reference modeling code computes K3's router logits $z = x W_r^\top$ in
float32, whatever the model's dtype. An inference engine that runs the gate
as an ordinary bfloat16 linear layer rounds each logit to bfloat16's 8
significant bits (SGLang's pull request #33764 measured that this changes the
top-16 set of 5.27% of K3's tokens, and moved its router to float32). This
example measures the same thing at K3's shapes, $d = 7168$, $n = 896$,
$k = 16$: the bfloat16 path is the float32 product rounded to bfloat16 (what a
bfloat16 GEMM with float32 accumulation returns), everything after it
(sigmoid, bias, top-$k$, weights) stays in float32, exactly as the catalogue
entry `bf16_router` of the conformance kit computes it.

**What is assumed.** Tokens: the block's input is the output of an RMSNorm,
so each token is drawn with unit root-mean-square, $x \sim \mathcal N(0, 1)$,
and stored in bfloat16, as the model holds it. Router weights: bfloat16, as
the checkpoint stores them, at two initialization scales: Hugging Face's
`_init_weights` for this model family draws the router from
$\mathcal N(0, 0.02^2)$ (`initializer_range`, read in transformers 5.24's
`KimiLinearPreTrainedModel`), which gives logits of standard deviation
$0.02\sqrt d \approx 1.69$; the DeepSeek-style gate module's own
`reset_parameters` uses `kaiming_uniform_(a=sqrt(5))`, a uniform law of
standard deviation $1/\sqrt{3d}$ and logits of standard deviation $0.58$
(this is an assumption about K3's modeling code, which is not read here). The
selection bias is drawn $\mathcal N(0, \sigma_b^2)$ for a few spreads
$\sigma_b$, zero being its value at initialization. **What is not known
here**: the released checkpoint's router statistics (the scale of its
logits, the spread of its trained bias, the heavy channels of real hidden
states). So the example sweeps the logit scale and the bias spread, and says
how the fraction depends on them, instead of claiming one number for the
checkpoint.

**The output error.** A K3 layer's experts take 118 GB in float32. The
router is the part that decides, so it runs at full K3 shape; the experts run
at a narrow width ($\ell = f = 64$, two shared experts), all 896 of them,
randomly initialized. Both routes then go through the same layer
(`stable_latent_moe(..., routing=...)`) and the relative difference of the
outputs is measured. With random experts, the outputs of two different
experts are uncorrelated, so a swapped expert costs the full size of both
outputs: the figure is the error when the experts a token hesitates between
are unrelated, an upper range for trained experts, which are likely to be
more alike. The example also prints the prediction of that model from the
router alone, $\sqrt{\sum_e \Delta p_e^2 / \sum_e p_e^2}$, which holds at any
expert width.
"""

# %%
from __future__ import annotations

import argparse
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from refimpl import MoEConfig, init_params, route, stable_latent_moe
from refimpl.layer.activations import sigmoid
from refimpl.studies.figures import figures_wanted, show_figure
from refimpl.studies.recorded import load_record, recorded_path, write_record

D, N, K = 7168, 896, 16
SEED = 51
BF16 = ml_dtypes.bfloat16
RESULTS = "51_bf16_router_precision.json"

#: The two initialization scales of the router weight (standard deviation of each entry).
INIT_SCALES = {"N(0, 0.02^2), initializer_range": 0.02, "kaiming uniform, 1/sqrt(3d)": 1.0 / np.sqrt(3 * D)}


# %%
def bf16(a: np.ndarray) -> np.ndarray:
    """`a` rounded to bfloat16 (nearest, ties to even) and widened back to float32."""
    return np.asarray(a, dtype=np.float32).astype(BF16).astype(np.float32)


def tokens(rng: np.random.Generator, m: int) -> np.ndarray:
    """`m` tokens of unit root-mean-square (an RMSNorm's output), stored in bfloat16, `[m, d]`."""
    return bf16(rng.standard_normal((m, D), dtype=np.float32))


def router_weight(base: np.ndarray, std: float) -> np.ndarray:
    """The router `[n, d]` with entries of standard deviation `std`: `std` times a standard draw, in bfloat16."""
    return bf16(std * base)


# %%
def two_routes(z: np.ndarray, bias: np.ndarray) -> dict[str, np.ndarray]:
    """The float32 route and the bfloat16-logit route from the float32 logits `z` `[m, n]`: (index, weights) each."""
    out = {}
    for name, logits in (("float32", z), ("bfloat16", bf16(z))):
        # $$s = \sigma(z)$$, then Eq. (13): top-k of s + b, weights from the raw s
        index, weights = route(sigmoid(logits), bias, K)
        out[name] = (index, weights)
    # Rounded logits tie: the k-th and (k+1)-th biased scores equal, where only the tie order decides.
    biased = sigmoid(bf16(z)) + bias  # [m, n]
    top = -np.sort(-np.partition(biased, N - K - 1, axis=1)[:, N - K - 1:], axis=1)  # [m, k+1], descending
    out["tied"] = top[:, K - 1] == top[:, K]  # [m]
    return out


def changed_tokens(routes: dict) -> np.ndarray:
    """Which tokens' selected sets differ between the two routes, `[m]` bool."""
    a, b = (np.sort(routes[name][0], axis=1) for name in ("float32", "bfloat16"))
    return np.any(a != b, axis=1)


def swapped_experts(routes: dict) -> np.ndarray:
    """How many of each token's k experts the bfloat16 route replaced, `[m]`."""
    a, b = routes["float32"][0], routes["bfloat16"][0]
    return np.array([K - np.intersect1d(ra, rb).size for ra, rb in zip(a, b, strict=True)])


def weight_change(routes: dict) -> np.ndarray:
    r"""The uncorrelated-experts prediction of the routed error: $\sqrt{\sum_e \Delta p_e^2 / \sum_e p_e^2}$, `[m]`."""
    m = routes["float32"][0].shape[0]
    dense = {}
    for name in ("float32", "bfloat16"):
        index, weights = routes[name]
        p = np.zeros((m, N))
        np.put_along_axis(p, index, weights, axis=1)
        dense[name] = p
    return np.sqrt(np.sum((dense["bfloat16"] - dense["float32"]) ** 2, axis=1) / np.sum(dense["float32"] ** 2, axis=1))


# %%
def flip_fraction(z: np.ndarray, bias: np.ndarray) -> dict[str, float]:
    """One measurement from float32 logits `z` `[m, n]` and a bias: the fraction of tokens that change experts."""
    routes = two_routes(z, bias)
    changed = changed_tokens(routes)
    swaps = swapped_experts(routes)
    p, m = changed.mean(), z.shape[0]
    return {"logit_std": float(z.std()), "changed": float(p), "error": float(np.sqrt(p * (1 - p) / m)),
            "swaps_per_changed": float(swaps[changed].mean()) if changed.any() else 0.0,
            "tied": float(routes["tied"].mean())}


def sweep(x: np.ndarray, base: np.ndarray, bias0: np.ndarray, stds: dict[str, float],
          bias_spreads: list[float]) -> list[dict]:
    """`flip_fraction` for every router scale of `stds` and every bias spread (one product per scale)."""
    rows = []
    for init, std in stds.items():
        # $$z = x W_r^\top$$ in float32 (the inputs are bfloat16 values, so every product is exact)
        z = x @ router_weight(base, std).T  # [m, n]
        for bias_std in bias_spreads:
            rows.append({"init": init, "bias_std": bias_std, **flip_fraction(z, bias_std * bias0)})
    return rows


def output_error(rng: np.random.Generator, x: np.ndarray, base: np.ndarray, bias: np.ndarray,
                 std: float) -> dict[str, float]:
    """Both routes through one layer with K3's router and narrow experts: the relative output difference."""
    config = MoEConfig(hidden_size=D, latent_size=64, num_experts=N, top_k=K, intermediate_size=64,
                       num_shared_experts=2, num_moe_layers=1)
    params = init_params(config, rng)
    params["gate.weight"] = router_weight(base, std)
    params["gate.e_score_correction_bias"] = bias
    routes = two_routes(x @ params["gate.weight"].T, bias)
    out = {name: stable_latent_moe(x, params, config, routing=routes[name], return_intermediates=True)
           for name in ("float32", "bfloat16")}

    def relative(field: str) -> np.ndarray:
        a, b = (np.asarray(getattr(out[name], field), dtype=np.float64) for name in ("float32", "bfloat16"))
        return np.linalg.norm(b - a, axis=1) / np.linalg.norm(a, axis=1)  # [m]

    changed = changed_tokens(routes)
    routed, whole, u = relative("y_routed"), relative("y"), relative("u")
    return {"changed": float(changed.mean()), "routed_mean": float(routed.mean()),
            "routed_changed": float(routed[changed].mean()) if changed.any() else 0.0,
            "routed_unchanged": float(routed[~changed].mean()) if (~changed).any() else 0.0,
            "u_mean": float(u.mean()), "model_mean": float(weight_change(routes).mean()),
            "y_mean": float(whole.mean())}


def print_sweep(rows: list[dict], m: int) -> None:
    print(f"   {'router init':<34}{'logit std':>10}{'bias spread':>13}{'tokens changed':>17}{'+-':>7}"
          f"{'experts swapped':>17}{'tied at k':>11}")
    for row in rows:
        print(f"   {row['init']:<34}{row['logit_std']:>10.3f}{row['bias_std']:>13.2f}"
              f"{100 * row['changed']:>16.2f}%{100 * row['error']:>6.2f}%{row['swaps_per_changed']:>17.2f}"
              f"{100 * row['tied']:>10.2f}%")
    print(f"   ({m:,} tokens each; +- is one binomial standard error; 'experts swapped' counts, per changed "
          f"token, how many of its {K} experts differ; 'tied at k': tokens whose k-th and (k+1)-th rounded "
          "scores are equal)")


# %%
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per measurement")
    parser.add_argument("--full", action="store_true",
                        help=f"32,768 tokens per measurement and a finer sweep; record the result in refimpl/results/{RESULTS}")
    args = parser.parse_args(argv)
    m = 32768 if args.full else args.tokens
    start = time.perf_counter()
    rng = np.random.default_rng(SEED)

    # Step 1: one batch, one standard router draw, one standard bias draw; the scales vary
    x = tokens(rng, m)  # [m, d]
    base = rng.standard_normal((N, D), dtype=np.float32)  # [n, d]
    bias0 = rng.standard_normal(N).astype(np.float32)  # [n]
    print(f"1. tokens whose top-{K} set changes when the logits are rounded to bfloat16 (d = {D}, n = {N})")
    rows = sweep(x, base, bias0, INIT_SCALES, [0.0, 0.01, 0.05, 0.1] if args.full else [0.0, 0.05])
    print_sweep(rows, m)
    print()

    # What to see: rounded to 8 significant bits, a logit often lands on the same value as its neighbour's:
    # with a zero bias 16.99% of the tokens have their 16th and 17th scores tied, and the tie rule (the lower
    # id wins), blind to which was larger in float32, picks the other expert for about half of them, most of
    # the 9.42% that change. A bias of spread 0.05, added in float32 after the rounding, separates the tied
    # scores (0.00% tied), and the changes fall to 4.69%. A changed token swaps 1.00 expert: only the boundary
    # between the 16th and the 17th choice is close enough to move.

    # Step 2: the logit scale, swept
    print("2. the same at other logit scales (router entries of standard deviation c / sqrt(d))")
    scales = [0.25, 0.5, 1.0, 1.7, 3.0, 6.0, 12.0] if args.full else [0.5, 1.7, 6.0]
    scaled = sweep(x, base, bias0, {f"c = {c:g}": c / np.sqrt(D) for c in scales}, [0.0, 0.05])
    print_sweep(scaled, m)
    print()

    # What to see: with a zero bias the selection follows the order of the logits, and bfloat16 keeps the
    # same number of bits at every size, so larger logits do not help much (14.11% at 0.500, 7.76% at 5.999).
    # With a bias they do, from 6.40% to 1.90%: the sigmoid flattens the largest logits towards 1, which
    # shrinks the rounding error of their scores, while the bias, the same on both routes, keeps its spread.

    # Step 3: what it does to the output
    print("3. the output, both routes through one layer (K3's router, experts of width l = f = 64)")
    error = output_error(rng, x, base, 0.05 * bias0, INIT_SCALES["N(0, 0.02^2), initializer_range"])
    print(f"   router N(0, 0.02^2), bias spread 0.05: {100 * error['changed']:.2f}% of tokens change experts")
    print(f"   relative error of the routed output:   {error['routed_mean']:.2e} on average; "
          f"{error['routed_changed']:.2e} on the changed tokens, {error['routed_unchanged']:.2e} on the others")
    print(f"   relative error of the latent sum u:    {error['u_mean']:.2e}  (uncorrelated-experts prediction from "
          f"the weights alone: {error['model_mean']:.2e})")
    print(f"   relative error of y (with the shared experts): {error['y_mean']:.2e}")
    print()

    # What to see: a token that keeps its 16 experts has an error of only 1.95e-04, from weights computed on
    # rounded logits; one that swaps an expert loses one output and gains an unrelated one, 3.40e-01, near the
    # square root of 2/16 that 16 outputs of similar weight predict. The 4.69% of changed tokens thus make
    # nearly all of the 1.61e-02 average, as the weights alone predict (1.65e-02, against 1.63e-02 measured on
    # u). The shared experts, the same on both routes, dilute it to 1.42e-02 in y.

    # Step 4: the recorded full run
    record = {"command": "python examples/51_bf16_router_precision.py --full", "tokens": m, "init": rows,
              "sweep": scaled, "output": error}
    if args.full:
        write_record(recorded_path(RESULTS), record, indent=1)
    else:
        recorded = load_record(RESULTS)
        print(f"4. the recorded run ({recorded['command']}, {recorded['tokens']:,} tokens per measurement):")
        print_sweep(recorded["init"], recorded["tokens"])
        print_sweep(recorded["sweep"], recorded["tokens"])
        out = recorded["output"]
        print(f"   output: {100 * out['changed']:.2f}% changed; routed relative error {out['routed_mean']:.2e} on "
              f"average, {out['routed_changed']:.2e} on changed tokens; y {out['y_mean']:.2e}")
    print(f"run time {time.perf_counter() - start:.1f} s")

    # What to see: with 32,768 tokens the binomial error falls to 0.19% or less. The larger the bias spread,
    # the fewer tokens change (8.71%, 6.23%, 5.21%, 3.88% for the N(0, 0.02^2) router); at spread 0.05 that
    # router gives 5.21%, close to SGLang's 5.27%, though the checkpoint's own logits and bias are not known
    # here. At zero bias, c = 0.25, 0.5 and 1 give the same 13.13%: scaling by a power of two leaves every
    # rounding and every order unchanged. At c = 12 every token has a tie (100.00%), because the largest
    # sigmoids round to exactly 1 in float32.

    # Step: the figure
    if figures_wanted(args.out):
        plot(args.out, scaled)
    return {"init": rows, "sweep": scaled, "output": error}


# %%
def plot(out: Path | None, sweep: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
    for bias_std, colour in ((0.0, "#1f77b4"), (0.05, "#d62728")):
        rows = [r for r in sweep if r["bias_std"] == bias_std]
        ax.errorbar([r["logit_std"] for r in rows], [100 * r["changed"] for r in rows],
                    yerr=[100 * r["error"] for r in rows], marker="o", color=colour, capsize=3,
                    label=f"bias spread {bias_std:g}")
    ax.axhline(5.27, color="0.4", linestyle="--", linewidth=1, label="SGLang #33764: 5.27%")
    for std in INIT_SCALES.values():
        ax.axvline(std * np.sqrt(D), color="0.7", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xticks([0.5, 1, 2, 4, 8], labels=["0.5", "1", "2", "4", "8"])
    ax.minorticks_off()
    ax.set_xlabel("standard deviation of the router logits (dotted: the two initializations)")
    ax.set_ylabel(f"tokens whose top-{K} set changes (%)")
    ax.set_title("bfloat16 logits at K3's shape: a bias breaks the ties")
    ax.legend(fontsize=8)
    show_figure(fig, out, "bf16_router_flips.png",
                caption="With a zero bias (blue) the rounded logits tie and the tie rule picks the boundary "
                        "expert; a bias (red) separates the scores again, and the larger the logits the fewer "
                        "tokens change.",
                alt="Percentage of tokens whose top-16 set changes when the router logits are rounded to "
                    "bfloat16, against the logits' standard deviation, for a zero bias and a bias of spread 0.05, "
                    "with SGLang's 5.27% as a dashed line")


# %%
if __name__ == "__main__":
    main()
