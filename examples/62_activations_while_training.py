r"""Activations while training: SwiGLU against SiTU-GLU, and what float16 and bfloat16 make of them

Appendix B bounds every coordinate of SiTU-GLU by $\beta_1\beta_2 = 100$;
SwiGLU has no bound. Whether that matters depends on whether the routed
experts' activations actually grow in training. This example trains the small
model of `refimpl.train` ($n = 64$, $k = 4$, two layers, latent norm on, QB)
with each activation at learning rates $3 \cdot 10^{-3}$ (the default),
$3 \cdot 10^{-2}$, $10^{-1}$ and $3 \cdot 10^{-1}$ for 300 steps, and logs every step the largest $|h|$
over all routed-expert activations, $h = \operatorname{GLU}(z G_e^\top, z U_e^\top)$,
and counts the loss spikes (steps whose loss exceeds 1.2 times the median of
the ten before). Every configuration is trained from seeds 0, 1 and 2 (the
seed sets the initial weights and the batches); the table gives the median
over the three seeds and, in brackets, the smallest and largest. A run has
diverged when its weights have grown until its forward pass overflows:
`refimpl.train` skips every step from then on (its loss is NaN) to the end.
The table gives, for each seed that diverged, the step from which its loss
is NaN, and the losses across seeds that finished.

Then the same two models at the largest rate in low precision. The forward
pass is rounded to float16 or bfloat16 (weights, block inputs and outputs,
the residual stream; see `refimpl.train`), and a step whose largest routed
activation exceeds float16's largest finite value, 65,504, counts as an
overflow: a kernel that stores $h$ in float16 would have produced an
infinity there, so the step is skipped, as dynamic loss scaling does.
bfloat16 has float32's range (about $3.4 \cdot 10^{38}$) and only 8 bits of
mantissa: it cannot overflow here, it only rounds.

The long run is recorded in `refimpl/results/62_activations_while_training.json` (shipped with the package);
this page prints and plots it, and replays a few steps as a live check.
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
    diverged_at,
    layer_field,
    load_record,
    per_step,
    record_runs,
    recorded_path,
    replay,
    show,
    show_finished,
    write_record,
)
from refimpl.train import TrainConfig, default_layer  # noqa: E402

RESULTS = recorded_path("62_activations_while_training.json")
COMMAND = "OPENBLAS_NUM_THREADS=1 python examples/62_activations_while_training.py --full"
SEEDS = (0, 1, 2)
STEPS = 300
RATES = (3e-3, 3e-2, 1e-1, 3e-1)
LOW_PRECISION_RATE = 1e-1
KEEP = ("step", "loss", "max_violation", "eval_loss", "activation_peak", "overflow", "skipped")

# %%


def grid() -> dict[str, TrainConfig]:
    """Every configuration of the experiment, by label (each is trained once per seed of `SEEDS`)."""
    common = dict(steps=STEPS, seed=SEEDS[0], stats_every=1, eval_every=50, balancer="qb")
    runs = {f"{act} lr {lr:g} float32": TrainConfig(moe=default_layer(activation=act), lr=lr, **common)
            for lr in RATES for act in ("swiglu", "situ")}
    for precision in ("float16", "bfloat16"):
        for act in ("swiglu", "situ"):
            runs[f"{act} lr {LOW_PRECISION_RATE:g} {precision}"] = TrainConfig(
                moe=default_layer(activation=act), lr=LOW_PRECISION_RATE, precision=precision, **common)
    return runs


def run_full(path: Path) -> None:
    """The long run: train every configuration of `grid()` for every seed and write the results JSON."""
    write_record(path, record_runs(COMMAND, grid(), SEEDS, KEEP))


# %%


def loss_spikes(loss: np.ndarray, factor: float = 1.2, window: int = 10) -> int:
    """Steps whose loss exceeds `factor` times the median of the `window` steps before it.

    A NaN loss (a skipped step, or the steps after a run diverged) compares false either way, so it is no spike.
    """
    return sum(1 for t in range(window, loss.size) if loss[t] > factor * np.median(loss[t - window:t]))


def peak_of(step: dict) -> float:
    """The step's largest routed activation over the layers; NaN on a step whose router scores were not finite."""
    return max(step["activation_peak"]) if step.get("activation_peak") else np.nan


def summarize(results: dict) -> dict[str, dict]:
    """Per configuration, one entry per seed: the routed activation's peaks, overflows, skips, spikes, losses."""
    table = {}
    for label, by_seed in results["runs"].items():
        peak = per_step(by_seed, peak_of)  # [seeds, steps]
        loss = per_step(by_seed, lambda r: r["loss"])  # [seeds, steps]
        table[label] = {"peak_first": peak[:, 0].tolist(), "peak_max": np.nanmax(peak, axis=1).tolist(),
                        "peak_last": [row[np.isfinite(row)][-1] for row in peak],
                        "over_fp16": np.sum(peak > 65504.0, axis=1).tolist(),
                        "skipped": [run["summary"]["skipped_steps"] for run in by_seed.values()],
                        "spikes": [loss_spikes(row) for row in loss],
                        # The mean of the last 10 steps that were not skipped; NaN for a seed that diverged.
                        "loss": [np.nan if seed in diverged_at(by_seed) else float(np.mean(row[np.isfinite(row)][-10:]))
                                 for seed, row in zip(by_seed, loss, strict=True)],
                        "eval": [run["summary"]["final_eval_loss"] for run in by_seed.values()],
                        "diverged": diverged_at(by_seed)}
    return table


def print_results(results: dict) -> dict[str, dict]:
    table = summarize(results)
    seeds = ", ".join(map(str, results["seeds"]))
    print(f"Recorded run ({results['command']}): seeds {seeds}, {STEPS} steps; n = 64, k = 4, f = 32, "
          f"d = 64, l = 32, two layers, latent norm on, QB, m = 1024, Adam without clipping.")
    print("peak = largest |h| over all routed-expert activations of a step (both layers); "
          "spikes = steps with loss > 1.2 x the median of the 10 before;")
    print("each entry: median across seeds [smallest-largest]; losses across seeds that finished; "
          "diverged: seed at step")
    print(f"  {'run':<25}{'peak step 1':<20}{'max peak':<33}{'steps > 65504':<16}{'skipped':<16}"
          f"{'spikes':<12}{'train loss':<34}{'held-out loss':<34}{'diverged'}")
    for label, row in table.items():
        diverged = ", ".join(f"{seed} at {step}" for seed, step in row["diverged"].items()) or "-"
        print(f"  {label:<25}{show(row['peak_first'], '.1f'):<20}{show(row['peak_max'], '.4g'):<33}"
              f"{show(row['over_fp16'], 'g'):<16}{show(row['skipped'], 'g'):<16}{show(row['spikes'], 'g'):<12}"
              f"{show_finished(row['loss']):<34}{show_finished(row['eval']):<34}{diverged}")
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
    """Replay the first steps of a recorded SwiGLU run at the largest rate: the same peaks and losses."""
    label = f"swiglu lr {LOW_PRECISION_RATE:g} float32"
    seed = str(results["seeds"][0])
    recorded = results["runs"][label][seed]
    steps = replay(recorded, REPLAY_STEPS)
    pairs = list(zip(steps, recorded["steps"][:REPLAY_STEPS], strict=True))
    # Bit for bit on the machine that recorded the run, with its BLAS thread count; elsewhere within the tolerance.
    drift = max(max(abs(a["loss"] - b["loss"]) / abs(b["loss"]),
                    max(abs(x - y) / abs(y) for x, y in zip(a["activation_peak"], b["activation_peak"], strict=True)))
                for a, b in pairs)
    same = drift <= REPLAY_TOLERANCE
    # How fast the peak grows, read from the record (its first four steps).
    peaks = [max(r["activation_peak"]) for r in recorded["steps"][:4]]
    # The bound is printed, not the drift itself: the drift depends on the machine's BLAS and thread count.
    print(f"\nLive check: the first {REPLAY_STEPS} steps of '{label}', seed {seed}, replayed: "
          + (f"losses and peaks within {REPLAY_TOLERANCE:.0e} relative" if same
             else f"DIFFERENT from the record ({drift:.1e} relative apart)")
          + f"; the recorded peaks of its first 4 steps: {', '.join(f'{p:.1f}' for p in peaks)}")
    return {"replay_identical": float(same), "peak_step_4": peaks[-1]}


def plot(out: Path | None, results: dict) -> None:
    """Three figures, one point each: the activation peaks in float32, the loss in low precision, the lost steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shades = dict(zip(RATES, ("#9ecae1", "#4292c6", "#08519c", "#08306b"), strict=True))
    warm = dict(zip(RATES, ("#fdae6b", "#f16913", "#d94801", "#7f2704"), strict=True))
    seeds = ", ".join(map(str, results["seeds"]))
    peaks, (loss_fig, bx), (lost_fig, cx) = plt.subplots(figsize=(7, 4.4), constrained_layout=True), \
        plt.subplots(figsize=(7, 4), constrained_layout=True), plt.subplots(figsize=(7, 4), constrained_layout=True)
    fig, ax = peaks
    for label, by_seed in results["runs"].items():
        config = next(iter(by_seed.values()))["config"]
        steps = np.array([r["step"] for r in max((run["steps"] for run in by_seed.values()), key=len)])
        style = {"float32": "-", "float16": "--", "bfloat16": ":"}[config["precision"]]
        if config["precision"] == "float32":
            colour = (warm if layer_field(config, "activation") == "swiglu" else shades)[config["lr"]]
            band(ax, steps, per_step(by_seed, peak_of), colour, label.replace(" float32", ""))
        if config["lr"] == LOW_PRECISION_RATE:
            colour = "#d94801" if layer_field(config, "activation") == "swiglu" else "#2171b5"
            loss = per_step(by_seed, lambda r: r["loss"])  # [seeds, steps]
            smooth = np.array([np.convolve(row, np.ones(10) / 10, mode="valid") for row in loss])
            band(bx, steps[9:], smooth, colour, label, style)
            skipped = np.cumsum(per_step(by_seed, lambda r: float(bool(r.get("skipped")))), axis=1)  # [seeds, steps]
            if skipped[:, -1].max() > 0:
                band(cx, steps, skipped, colour, label, style)
    ax.axhline(65504, color="red", linestyle="--", linewidth=0.8, label="float16 max 65,504")
    ax.axhline(100, color="black", linestyle=":", linewidth=0.8, label="SiTU bound 100")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("largest routed activation |h|")
    ax.legend(fontsize=7, ncol=2)
    show_figure(fig, out, "activations_while_training.png",
                caption=f"The largest routed activation per step in float32 (median of seeds {seeds}, the band "
                        "their range): SwiGLU's grows with the learning rate, past float16's largest value at "
                        "1e-1, while SiTU-GLU's stops at its bound of 100.",
                alt="Line plot on a log scale of the largest routed activation per training step for SwiGLU "
                    "and SiTU-GLU at four learning rates, with the float16 limit and the bound 100 marked")
    bx.set_xlabel("step")
    bx.set_ylabel("training loss (mean of 10 steps), nats/byte")
    bx.set_ylim(1.5, 4.0)
    bx.legend(fontsize=7)
    show_figure(loss_fig, out, "loss_in_low_precision.png",
                caption=f"At learning rate {LOW_PRECISION_RATE:g}, the training loss in each precision: SwiGLU "
                        "in float16 falls behind, because most of its steps overflow and are skipped; SiTU-GLU "
                        "trains alike in all three.",
                alt="Line plot of the training loss per step for SwiGLU and SiTU-GLU in float32, float16 and "
                    "bfloat16, where one line, SwiGLU in float16, stays well above the others")
    cx.set_xlabel("step")
    cx.set_ylabel("steps skipped so far (overflow)")
    if cx.lines:
        cx.legend(fontsize=7)
    show_figure(lost_fig, out, "float16_steps_lost.png",
                caption="The steps lost to overflow in float16, counted as training goes on: SwiGLU loses most "
                        "of its updates, SiTU-GLU none.",
                alt="Line plot of the cumulative number of skipped steps against the training step in float16, "
                    "rising almost linearly for SwiGLU")


# %%


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--full", action="store_true",
                        help=f"rerun the long experiment (about 18 min of CPU time, 9 min on two cores) and rewrite "
                             f"{RESULTS.name}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.full:
        run_full(RESULTS)

    # Step 1: the recorded runs
    results = load_record(RESULTS.name)
    table = print_results(results)

    # What to see: before the first update the learning rate plays no part, so the peak at step 1 is the same
    # at every rate (11.4 for SwiGLU, 9.4 for SiTU-GLU). In float32, SwiGLU's largest activation grows with
    # the rate, from 40.13 to 7010, 5.05e+06 and 8.916e+07, because it is the product of two projections whose
    # weights grow together, while SiTU-GLU's stops at its bound of 100. In float16 every step past 65504 is
    # skipped (282 of 300 for SwiGLU at 0.1), so SwiGLU falls far behind (loss 3.1388 against 2.0594 in
    # float32) while SiTU-GLU loses no step (2.0410); in bfloat16 SwiGLU passes 65504 as often (284) but
    # cannot overflow, and trains as in float32 (2.0640). In float32 the bound does not change the loss
    # (2.0717 for SiTU-GLU at 0.1); at 0.3 both runs skip a few steps (15 for SiTU-GLU, whose activations stay
    # at 100): something else in the model is no longer finite on those steps.

    # Step 2: a live check
    check = live_check(results)
    print(f"run time {time.perf_counter() - start:.1f} s")

    # What to see: the replayed steps match the record. The recorded peaks of SwiGLU at rate 0.1 grow from
    # 14.7 to 559.7 in three updates: Adam moves each weight by about the learning rate per step, whatever the
    # size of its gradient, and a product of two growing projections grows faster still.

    # Step: the figures
    if figures_wanted(args.out):
        plot(args.out, results)
    return {"table": table, "check": check}


if __name__ == "__main__":
    main()
