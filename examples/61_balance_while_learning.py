r"""Balance while the router learns: Quantile Balancing, the sign rule and no balancing

The earlier balancing examples route fixed routers or fresh batches of a
router that never changes. Here the router *learns*: the small byte-level
model of `refimpl.train` is trained, and each step every layer's selection
bias is the one its balancer computed from the previous step's batch. The
measure is the **max violation** $\max_j \text{load}_j / q - 1$ ($q = mk/n$)
of each step's own training batch, routed with the bias in use at that step,
the largest of the model's two layers.

Two sizes, both with $m = 1024$ tokens per step: $n = 64$ experts with
$k = 4$ ($f = 32$, $q = 64$) and $n = 512$ with $k = 8$ ($f = 16$, the same
activated expert width, $q = 16$). Balancers: exact Quantile Balancing
(`qb`), DeepSeek-V3's sign rule at $\gamma = 10^{-3}$ (its published step)
and none at both sizes; at $n = 64$ also QB's histogram estimate over 4
micro-batches (`qb-hist`) and the sign rule at $\gamma = 10^{-2}$.

Two floors put the numbers in scale. **Sampling noise**: the max violation of
$m$ tokens that each pick $k$ experts uniformly at random (every expected
load is exactly $q$; what is left is noise). **This data's floor**: QB with
a router that does not learn (learning rate $10^{-7}$), which measures what
a one-step-old bias can do on this text. Real text repeats itself (runs of
indentation spaces give many identical 16-byte contexts in one batch), and
identical tokens choose identical experts: no bias can split them.

The long run is recorded in `docs/results/61_balance_while_learning.json`;
this page plots it and replays the first steps of one recorded run to check
that the code still produces the same numbers.
"""

from __future__ import annotations

import os

# The recorded runs used one BLAS thread (faster for matrices this small); the same count makes the replay
# below bit for bit. This must come before NumPy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from recorded_runs import results_file  # noqa: E402

from refimpl.train import TrainConfig, load_corpus, noise_floor, train, train_many  # noqa: E402

RESULTS = results_file("61_balance_while_learning.json", globals().get("__file__"))
COMMAND = "OPENBLAS_NUM_THREADS=1 python examples/61_balance_while_learning.py --full"
SEED = 0
STEPS = 150
SIZES = {
    "n=64": dict(experts=64, top_k=4, intermediate=32, batch=1024),
    "n=512": dict(experts=512, top_k=8, intermediate=16, batch=1024),
}

# %%


def grid() -> dict[str, TrainConfig]:
    """Every run of the experiment, by label."""
    runs: dict[str, TrainConfig] = {}
    for size, sizes in SIZES.items():
        common = dict(steps=STEPS, seed=SEED, stats_every=STEPS, eval_every=50, **sizes)
        runs[f"{size} qb"] = TrainConfig(balancer="qb", **common)
        if size == "n=64":
            runs[f"{size} qb-hist"] = TrainConfig(balancer="qb-hist", **common)
        runs[f"{size} sign 1e-3"] = TrainConfig(balancer="sign", sign_rate=1e-3, **common)
        if size == "n=64":
            runs[f"{size} sign 1e-2"] = TrainConfig(balancer="sign", sign_rate=1e-2, **common)
        runs[f"{size} none"] = TrainConfig(balancer="none", **common)
        if size == "n=64":
            runs[f"{size} qb, router frozen"] = TrainConfig(balancer="qb", **{**common, "lr": 1e-7})
    return runs


def run_full(path: Path) -> None:
    """The long run: train every configuration of `grid()` and write the results JSON."""
    runs = grid()
    logs = train_many(list(runs.values()), processes=2)
    floors = {size: noise_floor(s["batch"], s["experts"], s["top_k"], draws=200, seed=SEED).tolist()
              for size, s in SIZES.items()}
    keep = ("step", "loss", "max_violation", "eval_loss")
    result = {"command": COMMAND, "seed": SEED, "floors": floors,
              "runs": {label: {"config": log["config"], "summary": log["summary"],
                               "steps": [{key: record[key] for key in keep if key in record}
                                         for record in log["steps"]]}
                       for label, log in zip(runs, logs, strict=True)},
              "corpus": logs[0]["corpus"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(f"wrote {path}")


# %%


def running_median(values: np.ndarray, width: int = 10) -> np.ndarray:
    """The median of each window of `width` consecutive steps (the window starting at each step)."""
    return np.array([np.median(values[t:t + width]) for t in range(values.size - width + 1)])


def steps_to_reach(values: np.ndarray, level: float, width: int = 10) -> int | None:
    """The first step from which the running median of `width` steps is at most `level` (None: never)."""
    below = np.flatnonzero(running_median(values, width) <= level)
    return int(below[0]) + 1 if below.size else None


def summarize(results: dict) -> dict[str, dict]:
    """Per run: violations at a few steps, the settled level, the steps to QB's band, the losses."""
    table = {}
    for label, run in results["runs"].items():
        size = label.split()[0]
        violation = np.array([r["max_violation"] for r in run["steps"]])
        qb = np.array([r["max_violation"] for r in results["runs"][f"{size} qb"]["steps"]])
        band = 1.2 * float(np.median(qb[-50:]))
        loss = np.array([r["loss"] for r in run["steps"]])
        table[label] = {"early": [float(violation[t - 1]) for t in (1, 2, 5, 10, 50)],
                        "settled": float(np.median(violation[-50:])),
                        "reach": steps_to_reach(violation, band), "band": band,
                        "loss": float(np.mean(loss[-20:])), "eval": float(run["summary"]["final_eval_loss"])}
    return table


def print_results(results: dict) -> dict[str, dict]:
    table = summarize(results)
    print(f"Recorded run ({results['command']}), seed {results['seed']}, {STEPS} steps, two MoE layers, "
          f"d = 64, l = 32, SiTU-GLU, latent norm on, Adam lr 3e-3.")
    print("max violation = max_j load_j / q - 1 on each step's batch with the bias in use (largest of the layers)")
    for size, s in SIZES.items():
        floor = np.array(results["floors"][size])
        q = s["batch"] * s["top_k"] / s["experts"]
        print(f"\n{size}, k = {s['top_k']}, f = {s['intermediate']}, m = {s['batch']} (q = {q:g}); sampling-noise "
              f"floor: median {np.median(floor):.3f} (90% of draws below {np.quantile(floor, 0.9):.3f})")
        print(f"  {'balancer':<22}{'step 1':>8}{'2':>7}{'5':>7}{'10':>7}{'50':>7}{'last 50':>9}"
              f"{'steps to QB band':>18}{'train loss':>12}{'held-out':>10}")
        for label, row in table.items():
            if not label.startswith(size + " "):
                continue
            reach = "never" if row["reach"] is None else str(row["reach"])
            early = "".join(f"{v:>7.2f}" for v in row["early"][1:])
            print(f"  {label[len(size) + 1:]:<22}{row['early'][0]:>8.2f}{early}{row['settled']:>9.3f}"
                  f"{reach:>18}{row['loss']:>12.4f}{row['eval']:>10.4f}")
        print(f"  (QB band: running median of 10 steps <= 1.2 x QB's own median of the last 50 steps "
              f"= {table[size + ' qb']['band']:.3f})")
    return table


# %%


def live_check(results: dict) -> dict[str, float]:
    """Replay the first steps of the recorded n = 64 QB run, then a short fresh comparison, QB against none."""
    corpus = load_corpus()
    recorded = results["runs"]["n=64 qb"]
    config = TrainConfig(**{**recorded["config"], "betas": tuple(recorded["config"]["betas"]), "steps": 3,
                            "eval_every": 1000})
    replay = train(config, corpus=corpus)
    pairs = list(zip(replay["steps"], recorded["steps"][:3], strict=True))
    # Bit for bit with the recorded BLAS thread count; another count sums the products in another order.
    drift = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs)
    same = drift <= 1e-5 and all(a["max_violation"] == b["max_violation"] for a, b in pairs)
    print(f"\nLive check 1: the first 3 steps of the recorded 'n=64 qb' run, replayed: "
          f"{'the same violations, losses within ' + f'{drift:.1e}' + ' relative' if same else 'DIFFERENT from the record'}")
    short = {}
    for balancer in ("qb", "none"):
        log = train(TrainConfig(balancer=balancer, steps=25, d=32, latent=16, experts=32, top_k=2,
                                intermediate=16, batch=512, layers=1, stats_every=100, eval_every=100),
                    corpus=corpus)
        short[balancer] = float(np.median([r["max_violation"] for r in log["steps"][-10:]]))
    print(f"Live check 2: 25 steps, n = 32, k = 2, m = 512, one layer; median max violation of steps 16-25: "
          f"QB {short['qb']:.3f}, none {short['none']:.3f}")
    return {"replay_identical": float(same), **short}


def plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    colours = {"qb": "#1f77b4", "qb-hist": "#17becf", "sign 1e-3": "#ff7f0e",
               "sign 1e-2": "#d62728", "none": "#7f7f7f", "qb, router frozen": "#2ca02c"}
    for column, (size, s) in enumerate(SIZES.items()):
        ax, bx = axes[0, column], axes[1, column]
        for label, run in results["runs"].items():
            if not label.startswith(size + " "):
                continue
            name = label[len(size) + 1:]
            steps = np.array([r["step"] for r in run["steps"]])
            violation = np.array([r["max_violation"] for r in run["steps"]])
            style = ":" if "frozen" in name else "-"
            ax.plot(steps, violation, style, color=colours[name], linewidth=0.9, label=name)
            if "frozen" not in name:
                loss = np.array([r["loss"] for r in run["steps"]])
                smooth = np.convolve(loss, np.ones(10) / 10, mode="valid")
                bx.plot(steps[9:], smooth, color=colours[name], linewidth=0.9, label=name)
        floor = np.array(results["floors"][size])
        ax.axhspan(np.quantile(floor, 0.05), np.quantile(floor, 0.95), color="0.85", label="sampling noise (5-95%)")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("max violation (max load / q - 1)")
        ax.set_title(f"{size}, k = {s['top_k']}, m = {s['batch']}, seed {results['seed']}")
        ax.legend(fontsize=7, ncol=2)
        bx.set_xlabel("step")
        bx.set_ylabel("training loss (mean of 10 steps), nats/byte")
        bx.set_title(f"{size}: the loss under each balancer")
        bx.set_ylim(top=3.0)
        bx.legend(fontsize=7)
    fig.savefig(out / "balance_while_learning.png", dpi=110)
    plt.close(fig)


# %%


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--full", action="store_true",
                        help=f"rerun the long experiment (about 10 min of CPU time) and rewrite {RESULTS.name}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.full:
        run_full(RESULTS)
    results = json.loads(RESULTS.read_text())
    table = print_results(results)
    check = live_check(results)
    print(f"run time {time.perf_counter() - start:.1f} s")
    if args.out is not None:
        plot(args.out, results)
    return {"table": table, "check": check}


if __name__ == "__main__":
    main()
