r"""The latent norm while training: LatentMoE (norm off) against Stable LatentMoE (norm on)

Eq. (11)'s Stable addition is one RMSNorm on the routed latent sum,
$v = \operatorname{RMSNorm}(u) \odot g$, before the up-projection. Without it
(the original LatentMoE) the scale of $u = \sum_e p_{i,e} E_e(z_i)$ reaches
$W_\uparrow$ directly, and it depends on which experts were chosen and how
their weights have grown. This example trains the small model of
`refimpl.train` ($n = 64$, $k = 4$, two layers, SiTU-GLU, QB) with the norm
off and on, at learning rates $10^{-3}$, $3 \cdot 10^{-3}$ (the default),
$10^{-2}$ and $3 \cdot 10^{-2}$ for 100 steps, and logs every other step:

* the RMS of the routed sum $u$ (before the norm), per layer;
* the norms of the gradients of the two latent projections, $W_\downarrow$
  and $W_\uparrow$;
* the training loss, and the held-out loss at the end (the sensitivity to
  the learning rate).

The long run is recorded in `docs/results/63_latent_norm_while_training.json`;
this page prints and plots it, and replays a few steps as a live check.
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

from refimpl.train import TrainConfig, load_corpus, train, train_many  # noqa: E402

RESULTS = results_file("63_latent_norm_while_training.json", globals().get("__file__"))
COMMAND = "OPENBLAS_NUM_THREADS=1 python examples/63_latent_norm_while_training.py --full"
SEED = 0
STEPS = 100
RATES = (1e-3, 3e-3, 1e-2, 3e-2)

# %%


def grid() -> dict[str, TrainConfig]:
    """Every run of the experiment, by label."""
    common = dict(steps=STEPS, seed=SEED, stats_every=2, eval_every=50, balancer="qb")
    return {f"norm {'on' if norm else 'off'} lr {lr:g}": TrainConfig(latent_norm=norm, lr=lr, **common)
            for lr in RATES for norm in (False, True)}


def run_full(path: Path) -> None:
    """The long run: train every configuration of `grid()` and write the results JSON."""
    runs = grid()
    logs = train_many(list(runs.values()), processes=2)
    keep = ("step", "loss", "eval_loss", "routed_rms", "grad_norm_down", "grad_norm_up", "grad_norm", "skipped")
    result = {"command": COMMAND, "seed": SEED,
              "runs": {label: {"config": log["config"], "summary": log["summary"],
                               "steps": [{key: record[key] for key in keep if key in record}
                                         for record in log["steps"]]}
                       for label, log in zip(runs, logs, strict=True)},
              "corpus": logs[0]["corpus"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(f"wrote {path}")


# %%


def series(run: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the per-step largest-over-layers value of a statistic logged every other step."""
    rows = [r for r in run["steps"] if key in r]
    return np.array([r["step"] for r in rows]), np.array([max(r[key]) for r in rows])


def summarize(results: dict) -> dict[str, dict]:
    table = {}
    for label, run in results["runs"].items():
        _, rms = series(run, "routed_rms")
        _, down = series(run, "grad_norm_down")
        _, up = series(run, "grad_norm_up")
        loss = np.array([r["loss"] for r in run["steps"]])
        table[label] = {"rms_first": float(rms[0]), "rms_last": float(rms[-1]), "rms_max": float(rms.max()),
                        "down_median": float(np.median(down)), "up_median": float(np.median(up)),
                        "down_max": float(down.max()), "up_max": float(up.max()),
                        "loss": float(np.mean(loss[-10:])), "eval": float(run["summary"]["final_eval_loss"])}
    return table


def print_results(results: dict) -> dict[str, dict]:
    table = summarize(results)
    print(f"Recorded run ({results['command']}), seed {results['seed']}, {STEPS} steps; n = 64, k = 4, f = 32, "
          f"d = 64, l = 32, two layers, SiTU-GLU, QB, m = 1024, Adam without clipping.")
    print("RMS of u = root mean square of the routed latent sum before the norm (larger of the two layers); "
          "gradient norms: Frobenius, larger layer, median and max over the logged steps")
    print(f"  {'run':<22}{'RMS u, step 1':>14}{'last':>9}{'max':>9}{'|dW_down| med':>15}{'max':>9}"
          f"{'|dW_up| med':>13}{'max':>9}{'train loss':>12}{'held-out':>10}")
    for label, row in table.items():
        print(f"  {label:<22}{row['rms_first']:>14.3f}{row['rms_last']:>9.3f}{row['rms_max']:>9.3f}"
              f"{row['down_median']:>15.4f}{row['down_max']:>9.4f}{row['up_median']:>13.4f}{row['up_max']:>9.4f}"
              f"{row['loss']:>12.4f}{row['eval']:>10.4f}")
    print("\nheld-out loss against the learning rate:")
    for norm in ("off", "on"):
        cells = "  ".join(f"lr {lr:g}: {table[f'norm {norm} lr {lr:g}']['eval']:.4f}" for lr in RATES)
        print(f"  norm {norm:<4}{cells}")
    return table


# %%


def live_check(results: dict) -> dict[str, float]:
    """Replay the first steps of the recorded norm-off run at the default rate."""
    label = "norm off lr 0.003"
    recorded = results["runs"][label]
    config = TrainConfig(**{**recorded["config"], "betas": tuple(recorded["config"]["betas"]), "steps": 4,
                            "eval_every": 1000})
    replay = train(config, corpus=load_corpus())
    # Bit for bit with the recorded BLAS thread count; another count sums the products in another order.
    drift = max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
                for a, b in zip(replay["steps"], recorded["steps"][:4], strict=True))
    same = drift <= 1e-5
    print(f"\nLive check: the first 4 steps of '{label}', replayed: "
          f"{'losses within ' + f'{drift:.1e}' + ' relative' if same else 'DIFFERENT from the record'}")
    return {"replay_identical": float(same)}


def plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4), constrained_layout=True)
    shade = dict(zip(RATES, (0.35, 0.55, 0.75, 1.0), strict=True))
    for label, run in results["runs"].items():
        config = run["config"]
        colour = (1.0 - shade[config["lr"]], 0.3, shade[config["lr"]]) if config["latent_norm"] else \
            (shade[config["lr"]], 0.35, 0.1)
        style = "-" if config["latent_norm"] else "--"
        for ax, key in zip(axes[:3], ("routed_rms", "grad_norm_down", "grad_norm_up"), strict=True):
            steps, values = series(run, key)
            ax.plot(steps, values, style, color=colour, linewidth=1, label=label)
        loss = np.array([r["loss"] for r in run["steps"]])
        axes[3].plot(np.arange(10, loss.size + 1), np.convolve(loss, np.ones(10) / 10, mode="valid"), style,
                     color=colour, linewidth=1, label=label)
    titles = ("RMS of the routed sum u", "|grad W_down|", "|grad W_up|", "training loss (mean of 10 steps)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("step")
        ax.set_title(f"{title}, seed {results['seed']}", fontsize=10)
    for ax in axes[:3]:
        ax.set_yscale("log")
    axes[3].set_ylim(1.5, 4.0)
    axes[0].legend(fontsize=7, ncol=2)
    fig.savefig(out / "latent_norm_while_training.png", dpi=110)
    plt.close(fig)


# %%


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--full", action="store_true",
                        help=f"rerun the long experiment (about 3 min of CPU time) and rewrite {RESULTS.name}")
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
