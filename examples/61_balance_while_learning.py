r"""Balance while the router learns: Quantile Balancing, the sign rule and no balancing

The earlier balancing examples route fixed routers or fresh batches of a
router that never changes. Here the router *learns*: the small byte-level
model of `refimpl.train` is trained, and each step every layer's selection
bias is the one its balancer computed from the previous step's batch. The
measure is the **max violation** $\max_j \text{load}_j / q - 1$ ($q = mk/n$)
of each step's own training batch, routed with the bias in use at that step,
the largest of the model's two layers.

Three sizes, all with $m = 1024$ tokens per step: $n = 64$ experts with
$k = 4$ ($f = 32$, $q = 64$), $n = 256$ with $k = 8$ ($f = 16$, $q = 32$) and
$n = 512$ with $k = 8$ ($f = 16$, the same activated expert width, $q = 16$).
Balancers, at every size: exact Quantile Balancing (`qb`), DeepSeek-V3's sign
rule at $\gamma = 10^{-3}$ (its published step) and at $\gamma = 10^{-2}$, and
none; at $n = 64$ also QB's histogram estimate over 4 micro-batches
(`qb-hist`). Every configuration is trained for 300 steps from seeds 0, 1
and 2 (each seed sets the initial weights and the batches); the tables give
the median over the three seeds and, in brackets, the smallest and largest.

Two floors put the numbers in scale. **Sampling noise**: the max violation of
$m$ tokens that each pick $k$ experts uniformly at random (every expected
load is exactly $q$; what is left is noise). **This data's floor**: QB with
a router that does not learn (learning rate $10^{-7}$), which measures what
a one-step-old bias can do on this text. Real text repeats itself (runs of
indentation spaces give many identical 16-byte contexts in one batch), and
identical tokens choose identical experts: no bias can split them.

A fourth size is K3's own routing: $n = 896$ experts with $k = 16$ ($f = 8$,
keeping the model small), at $m = 4096$ tokens per step ($q \approx 73$, about
the load per expert of the smaller sizes), with the same balancers but the
histogram estimate. It takes about an hour and a half on two cores, so it is a run and a
record of its own (`--full-k3`).

The long runs are recorded in `refimpl/results/61_balance_while_learning.json`
and `refimpl/results/61_balance_at_k3_scale.json` (shipped with the package);
this page plots them and replays the first steps of one recorded run to check
that the code still produces the same numbers.
"""

from __future__ import annotations

import os

# The recorded runs used one BLAS thread (faster for matrices this small); the same count makes the replay
# below bit for bit. This must come before NumPy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from refimpl.studies.figures import figures_wanted, show_figure  # noqa: E402
from refimpl.studies.recorded import (  # noqa: E402
    band,
    load_record,
    per_step,
    record_runs,
    recorded_path,
    replay,
    show,
    write_record,
)
from refimpl.train import TrainConfig, default_layer, load_corpus, noise_floor, train  # noqa: E402

RESULTS = recorded_path("61_balance_while_learning.json")
COMMAND = "OPENBLAS_NUM_THREADS=1 python examples/61_balance_while_learning.py --full"
K3_RESULTS = recorded_path("61_balance_at_k3_scale.json")
K3_COMMAND = "OPENBLAS_NUM_THREADS=1 python examples/61_balance_while_learning.py --full-k3"
SEEDS = (0, 1, 2)
STEPS = 300
SIZES = {
    "n=64": dict(experts=64, top_k=4, intermediate=32, batch=1024),
    "n=256": dict(experts=256, top_k=8, intermediate=16, batch=1024),
    "n=512": dict(experts=512, top_k=8, intermediate=16, batch=1024),
}
#: K3's routing, n = 896 and k = 16, with the model kept small (f = 8) and q = mk/n about 73.
K3_SIZES = {"n=896": dict(experts=896, top_k=16, intermediate=8, batch=4096)}
KEEP = ("step", "loss", "max_violation", "eval_loss")
K3_CAPTION = ("At K3's own routing, 896 experts and 16 per token (q = 73): Quantile Balancing settles within about "
              "sixty steps at 1.5 times the line of a router that does not learn; the sign rule at 1e-2 settles only "
              "after about 110 steps, at three times QB's violation, and at 1e-3 it is still falling at step 300.")

# %%


def grid(sizes_by_label: dict[str, dict[str, int]] = SIZES) -> dict[str, TrainConfig]:
    """Every configuration of the experiment, by label (each is trained once per seed of `SEEDS`).

    Every size trains QB, the sign rule at two rates and no balancing; n = 64 also the histogram estimate,
    and n = 64 and n = 896 the floor of a router that does not learn."""
    runs: dict[str, TrainConfig] = {}
    for size, sizes in sizes_by_label.items():
        common = dict(steps=STEPS, seed=SEEDS[0], stats_every=STEPS, eval_every=50, batch=sizes["batch"],
                      moe=default_layer(num_experts=sizes["experts"], top_k=sizes["top_k"],
                                        intermediate_size=sizes["intermediate"]))
        runs[f"{size} qb"] = TrainConfig(balancer="qb", **common)
        if size == "n=64":
            runs[f"{size} qb-hist"] = TrainConfig(balancer="qb-hist", **common)
        runs[f"{size} sign 1e-3"] = TrainConfig(balancer="sign", sign_rate=1e-3, **common)
        runs[f"{size} sign 1e-2"] = TrainConfig(balancer="sign", sign_rate=1e-2, **common)
        runs[f"{size} none"] = TrainConfig(balancer="none", **common)
        if size in ("n=64", "n=896"):
            runs[f"{size} qb, router frozen"] = TrainConfig(balancer="qb", **{**common, "lr": 1e-7})
    return runs


def run_full(path: Path, sizes_by_label: dict[str, dict[str, int]], command: str) -> None:
    """A long run: train every configuration of `grid(sizes_by_label)` for every seed and write the record."""
    started = time.perf_counter()
    record = record_runs(command, grid(sizes_by_label), SEEDS, KEEP)
    # The sampling-noise floor depends only on m, n and k (its draws have their own fixed seed).
    record["floors"] = {size: noise_floor(s["batch"], s["experts"], s["top_k"], draws=200, seed=0).tolist()
                        for size, s in sizes_by_label.items()}
    record["wall_seconds"] = time.perf_counter() - started
    write_record(path, record)


# %%


def running_median(values: np.ndarray, width: int = 10) -> np.ndarray:
    """The median of each window of `width` consecutive steps (the window starting at each step)."""
    return np.array([np.median(values[t:t + width]) for t in range(values.size - width + 1)])


def steps_to_reach(values: np.ndarray, level: float, width: int = 10) -> int | None:
    """The first step from which the running median of `width` steps is at most `level` (None: never)."""
    below = np.flatnonzero(running_median(values, width) <= level)
    return int(below[0]) + 1 if below.size else None


def summarize(results: dict) -> dict[str, dict]:
    """Per configuration and seed: violations at a few steps, the settled level, the steps to QB's band, the
    losses. QB's band is that of the same seed: 1.2 times QB's own median violation over its last 50 steps."""
    table = {}
    for label, by_seed in results["runs"].items():
        size = label.split()[0]
        violation = per_step(by_seed, lambda r: r["max_violation"])  # [seeds, steps]
        qb = per_step(results["runs"][f"{size} qb"], lambda r: r["max_violation"])  # [seeds, steps]
        bands = 1.2 * np.median(qb[:, -50:], axis=1)  # [seeds]
        loss = per_step(by_seed, lambda r: r["loss"])  # [seeds, steps]
        table[label] = {"early": {t: violation[:, t - 1].tolist() for t in (1, 2, 5, 10, 50)},
                        "settled": np.median(violation[:, -50:], axis=1).tolist(),
                        "reach": [steps_to_reach(v, level) for v, level in zip(violation, bands, strict=True)],
                        "band": bands.tolist(),
                        "loss": np.mean(loss[:, -20:], axis=1).tolist(),
                        "eval": [run["summary"]["final_eval_loss"] for run in by_seed.values()]}
    return table


def print_results(results: dict, sizes_by_label: dict[str, dict[str, int]] = SIZES) -> dict[str, dict]:
    """Print the table of one record (its sizes are `sizes_by_label`) and return `summarize`'s table."""
    table = summarize(results)
    seeds = ", ".join(map(str, results["seeds"]))
    took = f", {results['wall_seconds'] / 60:.0f} min on two cores" if "wall_seconds" in results else ""
    print(f"Recorded run ({results['command']}{took}): seeds {seeds}, {STEPS} steps, two MoE layers, "
          f"d = 64, l = 32, SiTU-GLU, latent norm on, Adam lr 3e-3.")
    print("max violation = max_j load_j / q - 1 on each step's batch with the bias in use (largest of the layers);")
    print("each entry: median across seeds [smallest-largest]; steps 1 to 50: the median only")
    for size, s in sizes_by_label.items():
        floor = np.array(results["floors"][size])
        q = s["batch"] * s["top_k"] / s["experts"]
        print(f"\n{size}, k = {s['top_k']}, f = {s['intermediate']}, m = {s['batch']} (q = {q:g}); sampling-noise "
              f"floor: median {np.median(floor):.3f} (90% of draws below {np.quantile(floor, 0.9):.3f})")
        print(f"  {'balancer':<19}{'step 1':>7}{'2':>7}{'5':>7}{'10':>7}{'50':>7}  {'last 50 steps':<25}"
              f"{'steps to QB band':<19}{'train loss':<24}{'held-out loss'}")
        for label, row in table.items():
            if not label.startswith(size + " "):
                continue
            early = "".join(f"{np.median(v):>7.2f}" for v in row["early"].values())
            print(f"  {label[len(size) + 1:]:<19}{early}  {show(row['settled']):<25}"
                  f"{show(row['reach'], 'g'):<19}{show(row['loss'], '.4f'):<24}{show(row['eval'], '.4f')}")
        print(f"  (QB band: running median of 10 steps <= 1.2 x QB's own median of its last 50 steps, per seed: "
              f"{show(table[size + ' qb']['band'])})")
        print("  loss minus QB's loss of the same seed (same batches), smallest to largest across seeds:")
        qb = table[size + " qb"]
        for label, row in table.items():
            if label.startswith(size + " ") and "qb" not in label:
                train_gap = np.subtract(row["loss"], qb["loss"])
                eval_gap = np.subtract(row["eval"], qb["eval"])
                print(f"    {label[len(size) + 1:]:<11} training {train_gap.min():+.4f} to {train_gap.max():+.4f}, "
                      f"held-out {eval_gap.min():+.4f} to {eval_gap.max():+.4f}")
    return table


# %%


REPLAY_TOLERANCE = 1e-4  # relative: float32 sums in another order stay far inside, and so does a token
# that sits within rounding of a tie and routes differently on another machine (it moves the mean loss of
# the batch by its own change over the batch's size; the second step of one recorded run came out 1.3e-5
# apart on a machine other than the one that recorded it).
# Two steps: the forward, one gradient and one Adam update, compared within that tolerance. Later steps can
# differ across processors by far more (on one machine the fourth step of a recorded run came out 2e-4 apart):
# once a token sits within rounding of a tie it routes differently, and the weights move apart from there.
REPLAY_STEPS = 2


def live_check(results: dict) -> dict[str, float]:
    """Replay the first steps of a recorded n = 64 QB run, then a short fresh comparison, QB against none."""
    seed = str(results["seeds"][0])
    recorded = results["runs"]["n=64 qb"][seed]
    pairs = list(zip(replay(recorded, REPLAY_STEPS), recorded["steps"][:REPLAY_STEPS], strict=True))
    # Bit for bit on the machine that recorded the run, with its BLAS thread count; elsewhere within the tolerance.
    drift = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs)
    same = drift <= REPLAY_TOLERANCE and all(a["max_violation"] == b["max_violation"] for a, b in pairs)
    # The bound is printed, not the drift itself: the drift depends on the machine's BLAS and thread count.
    print(f"\nLive check 1: the first {REPLAY_STEPS} steps of the recorded 'n=64 qb' run of seed {seed}, replayed: "
          + (f"the same violations, losses within {REPLAY_TOLERANCE:.0e} relative" if same
             else f"DIFFERENT from the record (losses {drift:.1e} relative apart)"))
    corpus = load_corpus()
    short = {}
    for balancer in ("qb", "none"):
        log = train(TrainConfig(balancer=balancer, steps=25, batch=512, stats_every=100, eval_every=100,
                                moe=default_layer(hidden_size=32, latent_size=16, num_experts=32, top_k=2,
                                                  intermediate_size=16, num_moe_layers=1)),
                    corpus=corpus)
        short[balancer] = float(np.median([r["max_violation"] for r in log["steps"][-10:]]))
    print(f"Live check 2: 25 steps, n = 32, k = 2, m = 512, one layer, seed 0; median max violation of steps "
          f"16-25: QB {short['qb']:.3f}, none {short['none']:.3f}")
    return {"replay_identical": float(same), **short}


COLOURS = {"qb": "#1f77b4", "qb-hist": "#17becf", "sign 1e-3": "#ff7f0e", "sign 1e-2": "#d62728",
           "none": "#7f7f7f", "qb, router frozen": "#2ca02c"}


def violation_panel(ax, results: dict, size: str) -> None:
    """The max violation per step at one size: every balancer's median across seeds, the min-max shaded."""
    for label, by_seed in results["runs"].items():
        if not label.startswith(size + " "):
            continue
        name = label[len(size) + 1:]
        steps = np.array([r["step"] for r in next(iter(by_seed.values()))["steps"]])
        violation = per_step(by_seed, lambda r: r["max_violation"])  # [seeds, steps]
        band(ax, steps, violation, COLOURS[name], name, ":" if "frozen" in name else "-")
    floor = np.array(results["floors"][size])
    ax.axhspan(np.quantile(floor, 0.05), np.quantile(floor, 0.95), color="0.8", zorder=0,
               label="sampling noise (5-95%)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    s = {**SIZES, **K3_SIZES}[size]
    ax.set_title(f"{size}, k = {s['top_k']}, m = {s['batch']}", fontsize=10)


def loss_panel(ax, results: dict, size: str) -> None:
    """The training loss (mean of 10 steps) per step at one size, under each balancer."""
    for label, by_seed in results["runs"].items():
        if not label.startswith(size + " ") or "frozen" in label:
            continue
        name = label[len(size) + 1:]
        steps = np.array([r["step"] for r in next(iter(by_seed.values()))["steps"]])
        loss = per_step(by_seed, lambda r: r["loss"])  # [seeds, steps]
        smooth = np.array([np.convolve(row, np.ones(10) / 10, mode="valid") for row in loss])
        band(ax, steps[9:], smooth, COLOURS[name], name)
    ax.set_xlabel("step")
    ax.set_title(size, fontsize=10)
    ax.set_ylim(1.5, 3.0)


def plot(out: Path | None, results: dict, k3: dict) -> None:
    """Four figures, one point each: the balance at n = 64, at n = 256 and 512, at n = 896; the losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = ", ".join(map(str, results["seeds"]))
    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    violation_panel(ax, results, "n=64")
    ax.set_ylabel("max violation (max load / q - 1)")
    ax.legend(fontsize=8, ncol=2)
    show_figure(fig, out, "balance_while_learning.png",
                caption=f"While the router learns (n = 64, median of seeds {seeds}, the band their range): "
                        "Quantile Balancing and its histogram estimate stay close to the grey sampling-noise band "
                        "from the second step on; the sign rule at 1e-3 tracks little better than no balancing, "
                        "and at 1e-2 it comes close only after about a hundred steps.",
                alt="Line plot on a log scale of the max violation per training step for each balancer at 64 "
                    "experts, with a grey band for the sampling noise")

    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4), constrained_layout=True, sharey=True)
    for ax, size in zip(axes, ("n=256", "n=512"), strict=True):
        violation_panel(ax, results, size)
    axes[0].set_ylabel("max violation (max load / q - 1)")
    axes[0].legend(fontsize=7, ncol=2)
    show_figure(fig, out, "balance_with_more_experts.png",
                caption="The same at 256 and 512 experts: without balancing a few experts take nearly every "
                        "token, and the sign rule's lag grows with the number of experts, while Quantile "
                        "Balancing stays about twice the sampling floor.",
                alt="Two line plots on a log scale of the max violation per training step for each balancer, "
                    "at 256 and at 512 experts, with grey sampling-noise bands")

    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    violation_panel(ax, k3, "n=896")
    ax.set_ylabel("max violation (max load / q - 1)")
    ax.legend(fontsize=8, ncol=2)
    show_figure(fig, out, "balance_at_k3_scale.png",
                caption=K3_CAPTION, alt="Line plot on a log scale of the max violation per training step for "
                "each balancer at 896 experts and 16 per token, with a grey band for the sampling noise")

    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.6), constrained_layout=True, sharey=True)
    for ax, size in zip(axes, SIZES, strict=True):
        loss_panel(ax, results, size)
    axes[0].set_ylabel("training loss, nats/byte")
    axes[0].legend(fontsize=7)
    show_figure(fig, out, "loss_under_each_balancer.png",
                caption="The training loss (mean of 10 steps) differs little between the balancers at 64 to 512 experts: "
                        "every token is computed on one device, so imbalance here costs time, not accuracy.",
                alt="Three line plots of the training loss per step under each balancer, at 64, 256 and 512 "
                    "experts, whose lines nearly coincide")


# %%


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--full", action="store_true",
                        help=f"rerun the long experiment (about 32 min of CPU time, 16 min on two cores) and rewrite "
                             f"{RESULTS.name}")
    parser.add_argument("--full-k3", action="store_true",
                        help=f"rerun the experiment at n = 896, k = 16 (about an hour and a half on two cores) and rewrite "
                             f"{K3_RESULTS.name}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.full:
        run_full(RESULTS, SIZES, COMMAND)
    if args.full_k3:
        run_full(K3_RESULTS, K3_SIZES, K3_COMMAND)

    # Step 1: the recorded runs at 64, 256 and 512 experts
    results = load_record(RESULTS.name)
    table = print_results(results)
    print()

    # What to see: every run starts from the same weights and a zero bias, so all share step 1 (3.61 at n=64).
    # Without balancing the learning router crowds tokens onto a few experts, 13.98 at step 50, near the most
    # possible (one expert chosen by all m tokens, n/k - 1); the sign rule, which moves each bias by a fixed
    # step per update, barely slows this at 1e-3 (12.59) and reaches QB's band only after 128 steps at 1e-2.
    # QB sets each bias from the quantiles of the previous batch and is at 1.81 from step 2. With a router
    # that does not learn (nor does the rest of the model: its loss stays at 5.9965) it holds 0.406, this
    # text's floor, above the sampling noise's 0.297 because identical contexts choose identical experts; with
    # a router that moves between batches it settles at 0.570, about twice the sampling floor at all three
    # sizes (1.031 against 0.500 at n=256). The losses differ little: every token is computed on one device,
    # so imbalance costs time here, not tokens.

    # Step 2: K3's routing, 896 experts and 16 per token
    k3 = load_record(K3_RESULTS.name)
    table.update(print_results(k3, K3_SIZES))

    # What to see: at K3's routing QB falls from 12.58 at step 1 to 7.24 at step 2 and settles at 1.734,
    # against 1.140 for the frozen router, this text's floor at this size, and 0.381 for the sampling noise.
    # Without balancing, 53.74 at step 50 is again close to the most possible, and the sign rule at 1e-2
    # settles at 4.954, about three times QB. Here the training loss without balancing is clearly worse than
    # QB's (+0.0760 to +0.0971), more than at the smaller sizes.

    # Step 3: a live check
    check = live_check(results)
    print(f"run time {time.perf_counter() - start:.1f} s")

    # What to see: the replayed steps match the record, so the tables above are what this code computes. The
    # short fresh run shows the same contrast in 25 steps: QB at 0.844, no balancing at 11.031, where one
    # expert already takes most of the 512 tokens.

    # Step: the figures
    if figures_wanted(args.out):
        plot(args.out, results, k3)
    return {"table": table, "check": check}


if __name__ == "__main__":
    main()
