r"""Activations while training: SwiGLU against SiTU-GLU, and what float16 and bfloat16 make of them

Appendix B bounds every coordinate of SiTU-GLU by $\beta_1\beta_2 = 100$;
SwiGLU has no bound. Whether that matters depends on whether the routed
experts' activations actually grow in training. This example trains the small
model of `refimpl.train` ($n = 64$, $k = 4$, two layers, latent norm on, QB)
with each activation at learning rates $3 \cdot 10^{-3}$ (the default),
$3 \cdot 10^{-2}$ and $10^{-1}$ for 100 steps, and logs every step the largest $|h|$ over
all routed-expert activations, $h = \operatorname{GLU}(z G_e^\top, z U_e^\top)$.

Then the same two models at the largest rate in low precision. The forward
pass is rounded to float16 or bfloat16 (weights, block inputs and outputs,
the residual stream; see `refimpl.train`), and a step whose largest routed
activation exceeds float16's largest finite value, 65,504, counts as an
overflow: a kernel that stores $h$ in float16 would have produced an
infinity there, so the step is skipped, as dynamic loss scaling does.
bfloat16 has float32's range (about $3.4 \cdot 10^{38}$) and only 8 bits of
mantissa: it cannot overflow here, it only rounds.

The long run is recorded in `docs/results/62_activations_while_training.json`;
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

RESULTS = results_file("62_activations_while_training.json", globals().get("__file__"))
COMMAND = "OPENBLAS_NUM_THREADS=1 python examples/62_activations_while_training.py --full"
SEED = 0
STEPS = 100
RATES = (3e-3, 3e-2, 1e-1)
LOW_PRECISION_RATE = 1e-1

# %%


def grid() -> dict[str, TrainConfig]:
    """Every run of the experiment, by label."""
    common = dict(steps=STEPS, seed=SEED, stats_every=1, eval_every=50, balancer="qb")
    runs = {f"{act} lr {lr:g} float32": TrainConfig(activation=act, lr=lr, **common)
            for lr in RATES for act in ("swiglu", "situ")}
    for precision in ("float16", "bfloat16"):
        for act in ("swiglu", "situ"):
            runs[f"{act} lr {LOW_PRECISION_RATE:g} {precision}"] = TrainConfig(
                activation=act, lr=LOW_PRECISION_RATE, precision=precision, **common)
    return runs


def run_full(path: Path) -> None:
    """The long run: train every configuration of `grid()` and write the results JSON."""
    runs = grid()
    logs = train_many(list(runs.values()), processes=2)
    keep = ("step", "loss", "max_violation", "eval_loss", "activation_peak", "overflow", "skipped")
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


def loss_spikes(loss: np.ndarray, factor: float = 1.2, window: int = 10) -> int:
    """Steps whose loss exceeds `factor` times the median of the `window` steps before it."""
    return sum(1 for t in range(window, loss.size) if loss[t] > factor * np.median(loss[t - window:t]))


def summarize(results: dict) -> dict[str, dict]:
    table = {}
    for label, run in results["runs"].items():
        peak = np.array([max(r["activation_peak"]) for r in run["steps"]])
        loss = np.array([r["loss"] for r in run["steps"]])
        table[label] = {"peak_first": float(peak[0]), "peak_max": float(peak.max()), "peak_last": float(peak[-1]),
                        "over_fp16": int(np.sum(peak > 65504.0)), "skipped": run["summary"]["skipped_steps"],
                        "spikes": loss_spikes(loss), "loss": float(np.mean(loss[-10:])),
                        "eval": float(run["summary"]["final_eval_loss"])}
    return table


def print_results(results: dict) -> dict[str, dict]:
    table = summarize(results)
    print(f"Recorded run ({results['command']}), seed {results['seed']}, {STEPS} steps; n = 64, k = 4, f = 32, "
          f"d = 64, l = 32, two layers, latent norm on, QB, m = 1024, Adam without clipping.")
    print("peak = largest |h| over all routed-expert activations of a step (both layers); "
          "spikes = steps with loss > 1.2 x the median of the 10 before")
    print(f"  {'run':<30}{'peak step 1':>12}{'max peak':>12}{'last peak':>12}{'steps > 65504':>15}"
          f"{'skipped':>9}{'spikes':>8}{'train loss':>12}{'held-out':>10}")
    for label, row in table.items():
        print(f"  {label:<30}{row['peak_first']:>12.1f}{row['peak_max']:>12.4g}{row['peak_last']:>12.4g}"
              f"{row['over_fp16']:>15}{row['skipped']:>9}{row['spikes']:>8}{row['loss']:>12.4f}{row['eval']:>10.4f}")
    return table


# %%


def live_check(results: dict) -> dict[str, float]:
    """Replay the first steps of the recorded SwiGLU run at the largest rate: the same peaks and losses."""
    label = f"swiglu lr {LOW_PRECISION_RATE:g} float32"
    recorded = results["runs"][label]
    config = TrainConfig(**{**recorded["config"], "betas": tuple(recorded["config"]["betas"]), "steps": 4,
                            "eval_every": 1000})
    replay = train(config, corpus=load_corpus())
    pairs = list(zip(replay["steps"], recorded["steps"][:4], strict=True))
    # Bit for bit with the recorded BLAS thread count; another count sums the products in another order.
    drift = max(max(abs(a["loss"] - b["loss"]) / abs(b["loss"]),
                    max(abs(x - y) / abs(y) for x, y in zip(a["activation_peak"], b["activation_peak"], strict=True)))
                for a, b in pairs)
    same = drift <= 1e-4
    peaks = [max(r["activation_peak"]) for r in replay["steps"]]
    print(f"\nLive check: the first 4 steps of '{label}', replayed: "
          f"{'losses and peaks within ' + f'{drift:.1e}' + ' relative' if same else 'DIFFERENT from the record'}; "
          f"peaks {', '.join(f'{p:.1f}' for p in peaks)}")
    return {"replay_identical": float(same), "peak_step_4": peaks[-1]}


def plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(16, 4.6), constrained_layout=True)
    shades = dict(zip(RATES, ("#9ecae1", "#2171b5", "#08306b"), strict=True))
    warm = dict(zip(RATES, ("#fdae6b", "#d94801", "#7f2704"), strict=True))
    for label, run in results["runs"].items():
        config = run["config"]
        if config["precision"] != "float32":
            continue
        steps = [r["step"] for r in run["steps"]]
        peak = [max(r["activation_peak"]) for r in run["steps"]]
        colour = (warm if config["activation"] == "swiglu" else shades)[config["lr"]]
        ax.plot(steps, peak, color=colour, linewidth=1, label=label.replace(" float32", ""))
    ax.axhline(65504, color="red", linestyle="--", linewidth=0.8, label="float16 max 65,504")
    ax.axhline(100, color="black", linestyle=":", linewidth=0.8, label="SiTU bound 100")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("largest routed activation |h|")
    ax.set_title(f"float32, seed {results['seed']}: SwiGLU grows with the rate")
    ax.legend(fontsize=7, ncol=2)
    for label, run in results["runs"].items():
        config = run["config"]
        if config["lr"] != LOW_PRECISION_RATE:
            continue
        steps = np.array([r["step"] for r in run["steps"]])
        loss = np.array([r["loss"] for r in run["steps"]])
        style = {"float32": "-", "float16": "--", "bfloat16": ":"}[config["precision"]]
        colour = "#d94801" if config["activation"] == "swiglu" else "#2171b5"
        bx.plot(steps, loss, style, color=colour, linewidth=1, label=label)
        skipped = steps[[bool(r.get("skipped")) for r in run["steps"]]]
        if skipped.size:
            cx.plot(steps, np.cumsum([bool(r.get("skipped")) for r in run["steps"]]), style, color=colour,
                    label=label)
    bx.set_xlabel("step")
    bx.set_ylabel("training loss, nats/byte")
    bx.set_ylim(1.5, 4.0)
    bx.set_title(f"lr {LOW_PRECISION_RATE:g}: the loss in each precision")
    bx.legend(fontsize=7)
    cx.set_xlabel("step")
    cx.set_ylabel("steps skipped so far (overflow)")
    cx.set_title("float16: steps lost to overflow")
    if cx.lines:
        cx.legend(fontsize=7)
    fig.savefig(out / "activations_while_training.png", dpi=110)
    plt.close(fig)


# %%


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--full", action="store_true",
                        help=f"rerun the long experiment (about 4 min of CPU time) and rewrite {RESULTS.name}")
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
