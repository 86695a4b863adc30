r"""One forward pass through a tiny layer, by hand.

Eq. (11) on a layer small enough to print whole: $m = 4$ tokens of width
$d = 8$, a latent of width $\ell = 4$ ($\alpha = 2$), $n = 6$ routed experts
of which each token uses $k = 2$, expert width $f = 6$, and one shared
expert. Every stage is printed with its shape and its values:

1. the router scores on the full-width tokens, $s = \sigma(x W_r^\top)$;
2. the routing decision of each token, expert by expert: the biased score
   $s + b$ that ranks it, which $k$ win, their weights from the **raw**
   scores, and whether the bias changed the choice;
3. the shared down-projection to the latent, $z = x W_\downarrow^\top$;
4. the dispatch: the $mk$ token-slots sorted by expert, so each expert owns
   one contiguous slice;
5. each expert's SiTU-GLU on its slice;
6. the combine in the latent space, $u_i = \sum_e p_{i,e} E_e(z_i)$;
7. RMSNorm, the up-projection, the shared expert and the sum.

The last lines compare the hand computation with the package's grouped
`stable_latent_moe` and its per-token `stable_latent_moe_reference`.
With `--out DIR` the script also draws the router scores with the chosen
experts marked.
"""

# %%
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from refimpl.config import MoEConfig
from refimpl.layer.activations import situ_glu
from refimpl.layer.latent_moe import init_params, stable_latent_moe, stable_latent_moe_reference
from refimpl.layer.routing import route, router_scores
from refimpl.studies.figures import figures_wanted, show_figure

#: The seed of the weights and tokens. With it the bias changes one token's choice
#: and one expert receives no token, two cases worth seeing.
SEED = 8


# %%
def show(name: str, array: np.ndarray, note: str = "") -> None:
    """Print an array under a header giving its name and shape."""
    shape = "[" + ", ".join(str(s) for s in array.shape) + "]"
    print(f"{name}  {shape}{'  ' + note if note else ''}")
    text = np.array2string(array, precision=3, floatmode="fixed", suppress_small=True, max_line_width=100)
    print("    " + text.replace("\n", "\n    "))


# %%
def step(title: str) -> None:
    print()
    print(title)
    print("-" * len(title))


# %%
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)

    config = MoEConfig.tiny()  # d=8, l=4, n=6, k=2, f=6, one shared expert
    m, d, ell, n, k, f = 4, config.d, config.ell, config.n, config.k, config.f
    rng = np.random.default_rng(args.seed)
    params = init_params(config, rng, dtype=np.float64, bias_scale=0.1)
    x = rng.standard_normal((m, d))
    b = params["gate.e_score_correction_bias"]

    print(f"Layer: m={m} tokens, d={d}, l={ell} (alpha={config.alpha:g}), n={n} experts, k={k}, f={f}, "
          f"{config.num_shared_experts} shared expert of width {config.shared_size}")
    print(f"SiTU-GLU caps: beta1={config.situ_beta:g}, beta2={config.situ_linear_beta:g}; "
          f"RMSNorm eps={config.rms_norm_eps:g}")
    show("x", x, "the tokens, full width d")

    # Step 1: Scores on the full width.
    step("1. Router scores on the full-width tokens: s = sigmoid(x W_r^T)")
    show("W_r = gate.weight", params["gate.weight"], "[n, d]")
    s = router_scores(x, params["gate.weight"])
    show("s", s, "one score in (0, 1) per token and expert; a sigmoid, so they do not sum to 1")

    # What to see: each score is the sigmoid of one token's dot product with one row of W_r, so it lies in
    # (0, 1) on its own, whatever the other scores are: token 0 scores 0.810 for e0 and 0.793 for e5 at once,
    # and no row sums to 1. A token can like several experts strongly, or none.

    # Step 2: Selection by s + b, weights by raw s.
    step("2. Routing: choose by s + b, weigh by the raw s (Eq. 13)")
    show("b = gate.e_score_correction_bias", b, "the balancing bias")
    biased = s + b
    show("s + b", biased, "the selection scores")
    index, weights = route(s, b, k)
    raw_index, _ = route(s, np.zeros_like(b), k)
    changed = []
    for i in range(m):
        ranking = sorted(range(n), key=lambda j, i=i: (-biased[i, j], j))
        print(f"token {i}: experts ranked by s + b (ties would go to the lower id):")
        for place, j in enumerate(ranking):
            mark = "chosen" if place < k else ""
            print(f"    e{j}: s + b = {s[i, j]:.3f} {b[j]:+.3f} = {biased[i, j]:.3f}  {mark}")
        chosen = index[i].tolist()
        total = sum(s[i, j] for j in chosen)
        terms = " + ".join(f"{s[i, j]:.3f}" for j in chosen)
        parts = ", ".join(f"p(e{j}) = {s[i, j]:.3f} / {total:.3f} = {w:.3f}"
                          for j, w in zip(chosen, weights[i], strict=True))
        print(f"  T_{i} = {{{', '.join(f'e{j}' for j in chosen)}}}; the raw scores sum to {terms} = {total:.3f}")
        print(f"  weights from the raw scores: {parts}; they sum to {weights[i].sum():.3f}")
        if set(chosen) != set(raw_index[i].tolist()):
            changed.append(i)
            dropped = sorted(set(raw_index[i].tolist()) - set(chosen))
            added = sorted(set(chosen) - set(raw_index[i].tolist()))
            print(f"  the bias changed this choice: without it token {i} would take "
                  f"{{{', '.join(f'e{j}' for j in raw_index[i].tolist())}}}; "
                  f"{', '.join(f'e{j}' for j in added)} replaces {', '.join(f'e{j}' for j in dropped)}")
        else:
            print("  the bias did not change this choice")
    show("index", index, "T_i, k expert ids per token")
    show("weights", weights, "p_i, from raw scores, renormalized")
    load = np.bincount(index.ravel(), minlength=n)
    print(f"tokens per expert: {load.tolist()} (total m*k = {load.sum()})")

    # What to see: the bias changes one choice only. Token 1's raw scores for e0 and e3 (0.384 and 0.340)
    # are closer together than their biases (-0.093 and +0.007) are apart, so by s + b e3 ranks above e0
    # (0.347 against 0.291). The bias only ranks: e3's weight comes from its raw score, 0.340 / 1.105 = 0.308,
    # and each token's weights sum to 1.000. Four tokens fill m*k = 8 slots over six experts, and experts 1
    # and 2, which are never in a token's top 2, get no token.

    # Step 3: One down-projection for every routed expert.
    step("3. Down-projection to the latent: z = x W_down^T")
    z = x @ params["routed_expert_down_proj.weight"].T
    show("z", z, f"[m, l]: {d} -> {ell} values per token; this is what dispatch sends")

    # What to see: each token leaves the full width d = 8 for the latent width l = 4 before it is sent, and
    # this happens once per token, not once per chosen expert, because all routed experts share W_down. The
    # dispatch therefore carries 4 values per token instead of 8.

    # Step 4: Dispatch: sort the m*k token-slots by expert.
    step("4. Dispatch: sort the m*k token-slots by expert")
    slot_expert = index.reshape(-1)  # slot t = i*k + r
    slot_token = np.repeat(np.arange(m), k)
    print("slot t = i*k + r holds the r-th expert of token i:")
    print("    slot:   " + " ".join(f"{t:2d}" for t in range(m * k)))
    print("    token:  " + " ".join(f"{i:2d}" for i in slot_token))
    print("    expert: " + " ".join(f"{e:2d}" for e in slot_expert))
    order = np.argsort(slot_expert, kind="stable")
    print("sorted by expert (stable, so tokens keep their order inside an expert):")
    print("    slot:   " + " ".join(f"{t:2d}" for t in order))
    print("    expert: " + " ".join(f"{e:2d}" for e in slot_expert[order]))
    starts = np.concatenate(([0], np.cumsum(load)))
    for e in range(n):
        tokens = slot_token[order[starts[e]:starts[e + 1]]]
        print(f"    expert {e}: sorted slots {starts[e]}:{starts[e + 1]} -> tokens {tokens.tolist()}"
              + ("  (no token: this expert does no work in this batch)" if load[e] == 0 else ""))

    # What to see: sorting the 8 slots by expert id puts each expert's tokens side by side: expert 3's slots
    # 3, 5 and 6 (tokens 1, 2, 3) become sorted positions 2:5. The slice boundaries are the running sums of
    # the loads [2, 0, 0, 3, 1, 2], so experts 1 and 2 get the empty slice 2:2 and do no work.

    # Step 5: Each expert runs one GLU on its contiguous slice.
    step("5. Each expert's SiTU-GLU on its slice: E_e(z) = SiTU-GLU(z G_e^T, z U_e^T) D_e^T")
    out_sorted = np.zeros((m * k, ell))
    for e in np.flatnonzero(load):
        rows = order[starts[e]:starts[e + 1]]
        z_e = z[slot_token[rows]]  # [m_e, l]
        gate = z_e @ params["experts.w1"][e].T  # [m_e, f]
        up = z_e @ params["experts.w3"][e].T  # [m_e, f]
        h = situ_glu(gate, up, config.situ_beta, config.situ_linear_beta)  # [m_e, f]
        out_sorted[starts[e]:starts[e + 1]] = h @ params["experts.w2"][e].T  # [m_e, l]
        print(f"expert {e} on tokens {slot_token[rows].tolist()}:")
        show("    gate pre-activation a = z_e G_e^T", gate)
        show("    up pre-activation   b = z_e U_e^T", up)
        show("    h = SiTU-GLU(a, b)", h, f"|h| <= beta1*beta2 = {config.situ_beta * config.situ_linear_beta:g}")
        show("    E_e(z_e) = h D_e^T", out_sorted[starts[e]:starts[e + 1]], "back to the latent width")

    # What to see: every |h| stays far under the bound of 100; the largest, 6.201, is expert 3's on token 1,
    # where the gate a = 3.141 and the up b = 2.475 are both large and positive. Where a is well below 0,
    # sigmoid(a) is small and so is h, whatever b is: expert 3's token 3 has a = -2.425 and h = 0.114. Each
    # expert runs one matrix product on its whole slice, and its output is back at the latent width 4.

    # Step 6: Combine: undo the sort and mix each token's k outputs in the latent space.
    step("6. Combine in the latent space: u_i = sum_e p_(i,e) E_e(z_i)")
    expert_out = np.empty_like(out_sorted)
    expert_out[order] = out_sorted  # back to slot order
    expert_out = expert_out.reshape(m, k, ell)  # [m, k, l]
    u = np.einsum("mk,mkl->ml", weights, expert_out)
    show("u", u, "[m, l]; what combine sends back, still l wide")

    # What to see: each row of u is its token's two expert outputs mixed by its weights: token 3's row,
    # [-0.003 -0.094 -0.038 -0.072], is 0.547 times expert 3's output for it plus 0.453 times expert 0's. The
    # sum is taken at the latent width, so combine also carries 4 values per token. Token 3's row is much
    # smaller than the others because both of its experts returned small outputs.

    # Step 7: The Stable addition, then the single up-projection.
    step("7. RMSNorm on the latent sum, then one up-projection")
    rms = np.sqrt(np.mean(u * u, axis=1, keepdims=True) + config.rms_norm_eps)
    show("rms(u_i) = sqrt(mean(u_i^2) + eps)", rms[:, 0])
    v = u / rms * params["routed_expert_norm.weight"]
    show("v = u / rms(u) * g", v, "g = routed_expert_norm.weight, all ones at initialization")
    rms_u = np.sqrt(np.mean(u * u, axis=1))
    rms_v = np.sqrt(np.mean(v * v, axis=1))
    print(f"root mean square of u per token: {rms_u.min():.3f} .. {rms_u.max():.3f} "
          f"(a factor {rms_u.max() / rms_u.min():.1f}); of v: {rms_v.min():.3f} .. {rms_v.max():.3f}")
    y_routed = v @ params["routed_expert_up_proj.weight"].T
    show("y_routed = v W_up^T", y_routed, f"[m, d]: {ell} -> {d}, once per token after the combine")

    # What to see: the root mean square of u varies by a factor 12.1 across tokens (0.062 for token 3, 0.748
    # for token 1); dividing by it brings every row of v to 1 (0.999 for token 3, where the eps of 1e-05 is
    # not negligible next to its mean square). Token 3's routed output therefore enters the up-projection at
    # the same size as the others', whatever the scale its experts gave it.

    # Step 8: The shared expert on the full width, and the output
    step("8. Shared expert on the full width, and the output")
    gate_s = x @ params["shared_experts.gate_proj.weight"].T
    up_s = x @ params["shared_experts.up_proj.weight"].T
    y_shared = situ_glu(gate_s, up_s, config.situ_beta, config.situ_linear_beta) \
        @ params["shared_experts.down_proj.weight"].T
    show("y_shared = SiTU-GLU(x G_s^T, x U_s^T) D_s^T", y_shared)
    y = y_shared + y_routed
    show("y = y_shared + y_routed", y)

    # What to see: the shared expert sees every token at full width, with no router and no norm; its entries
    # here stay within 0.689 in size, while the normalized routed branch reaches 1.854. The output y is the
    # plain sum of the two.

    # Step: The hand computation against the package
    step("Check against the package")
    y_fast = stable_latent_moe(x, params, config)
    y_ref = stable_latent_moe_reference(x, params, config)
    diff_fast = float(np.max(np.abs(y - y_fast)))
    diff_ref = float(np.max(np.abs(y - y_ref)))
    print(f"max |y_by_hand - stable_latent_moe(x)|           = {diff_fast:.1e}")
    print(f"max |y_by_hand - stable_latent_moe_reference(x)| = {diff_ref:.1e}")
    print(f"tokens whose choice the bias changed: {changed}")
    print(f"experts with no token: {np.flatnonzero(load == 0).tolist()}")

    # What to see: the hand computation agrees with both package functions to 4.4e-16 and 8.9e-16, a few
    # rounding errors of float64: the same sums, grouped differently (all tokens of an expert at once, or one
    # token at a time), round differently in the last bits. Token 1 is the one whose choice the bias changed,
    # and experts 1 and 2 stay idle.

    # Step: The figure
    if figures_wanted(args.out):
        save_figure(args.out, s, b, index)
    return dict(config=config, params=params, x=x, scores=s, bias=b, index=index, weights=weights, z=z, u=u,
                v=v, y=y, y_fast=y_fast, y_ref=y_ref, changed=changed, load=load)


# %%
def save_figure(out: Path, s: np.ndarray, b: np.ndarray, index: np.ndarray) -> None:
    """The router scores, with each token's chosen experts outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, n = s.shape
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [n, 1.4]})
    image = axes[0].imshow(s, cmap="Blues", vmin=0, vmax=1)
    for i in range(m):
        for j in range(n):
            axes[0].text(j, i, f"{s[i, j]:.2f}", ha="center", va="center", fontsize=8,
                         color="white" if s[i, j] > 0.6 else "black")
        for j in index[i]:
            axes[0].add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.2, ec="tab:orange"))
    axes[0].set_xticks(range(n), [f"e{j}" for j in range(n)])
    axes[0].set_yticks(range(m), [f"token {i}" for i in range(m)])
    axes[0].set_title("raw scores s; orange: chosen by s + b")
    fig.colorbar(image, ax=axes[0], fraction=0.04)
    axes[1].barh(range(n), b, color=["tab:green" if v > 0 else "tab:red" for v in b])
    axes[1].set_yticks(range(n), [f"e{j}" for j in range(n)])
    axes[1].invert_yaxis()
    axes[1].axvline(0, color="k", lw=0.8)
    axes[1].set_title("bias b")
    fig.tight_layout()
    show_figure(fig, out, "routing.png",
                caption="Each token's two experts (outlined) are the top 2 of s + b, not always of the raw scores"
                        " s: where two scores are close, the bias on the right decides.",
                alt="Heat map of the router scores of four tokens over six experts with the chosen experts "
                    "outlined in orange, beside a bar chart of the six experts' biases")


# %%
if __name__ == "__main__":
    main()
