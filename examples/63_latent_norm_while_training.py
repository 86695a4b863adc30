r"""The latent norm while training: LatentMoE (norm off) against Stable LatentMoE (norm on)

Eq. (11)'s Stable addition is one RMSNorm on the routed latent sum,
$v = \operatorname{RMSNorm}(u) \odot g$, before the up-projection. Without it
(the original LatentMoE) the scale of $u = \sum_e p_{i,e} E_e(z_i)$ reaches
$W_\uparrow$ directly, and it depends on which experts were chosen and how
their weights have grown. This example trains the small model of
`refimpl.train` ($n = 64$, $k = 4$, two layers, SiTU-GLU, QB) with the norm
off and on, at learning rates $10^{-3}$, $3 \cdot 10^{-3}$ (the default),
$10^{-2}$, $3 \cdot 10^{-2}$, $10^{-1}$ and $3 \cdot 10^{-1}$ for 300 steps,
each from seeds 0, 1 and 2 (each seed sets the initial weights and the
batches), and logs every other step:

* the RMS of the routed sum $u$ (before the norm), per layer;
* the norms of the gradients of the two latent projections, $W_\downarrow$
  and $W_\uparrow$;
* the training loss, and the held-out loss at the end (the sensitivity to
  the learning rate).

The tables give the median over the three seeds and, in brackets, the
smallest and largest. At the largest rates some runs diverge: their weights
grow until the forward pass overflows, and `refimpl.train` skips every step
from then on (its loss is NaN) to the end. The table gives, for each seed
that diverged, the step from which its loss is NaN, and the losses over the
seeds that finished.

The long run is recorded in `refimpl/results/63_latent_norm_while_training.json` (shipped with the package);
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
    finished,
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

RESULTS = recorded_path("63_latent_norm_while_training.json")
COMMAND = "OPENBLAS_NUM_THREADS=1 python examples/63_latent_norm_while_training.py --full"
SEEDS = (0, 1, 2)
STEPS = 300
RATES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
KEEP = ("step", "loss", "eval_loss", "routed_rms", "grad_norm_down", "grad_norm_up", "grad_norm", "skipped")

# %%


def grid() -> dict[str, TrainConfig]:
    """Every configuration of the experiment, by label (each is trained once per seed of `SEEDS`)."""
    common = dict(steps=STEPS, seed=SEEDS[0], stats_every=2, eval_every=50, balancer="qb")
    return {f"norm {'on' if norm else 'off'} lr {lr:g}": TrainConfig(moe=default_layer(use_latent_norm=norm), lr=lr,
                                                                      **common)
            for lr in RATES for norm in (False, True)}


def run_full(path: Path) -> None:
    """The long run: train every configuration of `grid()` for every seed and write the results JSON."""
    write_record(path, record_runs(COMMAND, grid(), SEEDS, KEEP))


# %%


def series(by_seed: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the per-step largest-over-layers value of a statistic logged every other step, `[seeds, steps]`.

    NaN where a seed has no value: after it diverged, or on a step whose router scores were not finite.
    """
    logged = [{r["step"]: max(r[key]) for r in run["steps"] if r.get(key)} for run in by_seed.values()]
    steps = np.array(sorted(set().union(*logged)))
    return steps, np.array([[row.get(t, np.nan) for t in steps] for row in logged])


def summarize(results: dict) -> dict[str, dict]:
    """Per configuration, one entry per seed: the scale of u, the projections' gradients, the losses."""
    table = {}
    for label, by_seed in results["runs"].items():
        _, rms = series(by_seed, "routed_rms")  # [seeds, logged steps]
        _, down = series(by_seed, "grad_norm_down")
        _, up = series(by_seed, "grad_norm_up")
        loss = per_step(by_seed, lambda r: r["loss"])  # [seeds, steps]
        last = [row[np.isfinite(row)][-1] for row in rms]  # the last logged value, before any divergence
        table[label] = {"rms_first": rms[:, 0].tolist(), "rms_last": last,
                        "rms_max": np.nanmax(rms, axis=1).tolist(),
                        "down_median": np.nanmedian(down, axis=1).tolist(),
                        "up_median": np.nanmedian(up, axis=1).tolist(),
                        "down_max": np.nanmax(down, axis=1).tolist(), "up_max": np.nanmax(up, axis=1).tolist(),
                        # The mean of the last 10 steps that were not skipped; NaN for a seed that diverged.
                        "loss": [np.nan if seed in diverged_at(by_seed) else float(np.mean(row[np.isfinite(row)][-10:]))
                                 for seed, row in zip(by_seed, loss, strict=True)],
                        "eval": [run["summary"]["final_eval_loss"] for run in by_seed.values()],
                        "skipped": [run["summary"]["skipped_steps"] for run in by_seed.values()],
                        "diverged": {**{seed: "NaN at the end" for seed, run in by_seed.items()
                                        if not np.isfinite(run["summary"]["final_eval_loss"])},
                                     **{seed: f"at {step}" for seed, step in diverged_at(by_seed).items()}}}
    return table


def print_results(results: dict) -> dict[str, dict]:
    table = summarize(results)
    seeds = ", ".join(map(str, results["seeds"]))
    print(f"Recorded run ({results['command']}): seeds {seeds}, {STEPS} steps; n = 64, k = 4, f = 32, "
          f"d = 64, l = 32, two layers, SiTU-GLU, QB, m = 1024, Adam without clipping.")
    print("RMS of u = root mean square of the routed latent sum before the norm (larger of the two layers); "
          "gradient norms: Frobenius, larger layer, median over the logged steps;")
    print("each entry: median across seeds [smallest-largest]")
    print("RMS u, last: at the last logged step (before the divergence for a run that diverged); "
          "skipped: steps with a non-finite loss or gradient;")
    print("losses across seeds that finished with a finite held-out loss; diverged: those seeds whose loss is "
          "NaN from a step on (at that step) or that ended with a NaN held-out loss")
    print(f"  {'run':<19}{'RMS u, step 1':<21}{'RMS u, last':<33}{'|dW_down| median':<26}"
          f"{'|dW_up| median':<26}{'skipped':<16}{'train loss':<34}{'held-out loss':<34}{'diverged'}")
    for label, row in table.items():
        diverged = ", ".join(f"{seed} {what}" for seed, what in sorted(row["diverged"].items())) or "-"
        print(f"  {label:<19}{show(row['rms_first']):<21}{show(row['rms_last']):<33}"
              f"{show(row['down_median'], '.4f'):<26}{show(row['up_median'], '.4f'):<26}"
              f"{show(row['skipped'], 'g'):<16}{show_finished(row['loss']):<34}{show_finished(row['eval']):<34}{diverged}")
    print("\nheld-out loss against the learning rate (median [smallest-largest] across seeds that finished):")
    print((f"  {'':<10}" + "".join(f"{'lr ' + format(lr, 'g'):<34}" for lr in RATES)).rstrip())
    for norm in ("off", "on"):
        cells = "".join(f"{show_finished(table[f'norm {norm} lr {lr:g}']['eval']):<34}" for lr in RATES)
        print(f"  norm {norm:<5}{cells}".rstrip())
    print("norm on minus norm off, same seed (same batches), smallest to largest across seeds where both finished:")
    for key, name in (("eval", "held-out"), ("loss", "training")):
        gaps = [finished(np.subtract(table[f"norm on lr {lr:g}"][key], table[f"norm off lr {lr:g}"][key]).tolist())
                for lr in RATES]
        cells = [f"{min(g):+.4f} to {max(g):+.4f}" if g else "-" for g in gaps]
        print((f"  {name:<10}" + "".join(f"{cell:<34}" for cell in cells)).rstrip())
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
    """Replay the first steps of a recorded norm-off run at the default rate."""
    label = "norm off lr 0.003"
    seed = str(results["seeds"][0])
    recorded = results["runs"][label][seed]
    # Bit for bit on the machine that recorded the run, with its BLAS thread count; elsewhere within the tolerance.
    drift = max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
                for a, b in zip(replay(recorded, REPLAY_STEPS), recorded["steps"][:REPLAY_STEPS], strict=True))
    same = drift <= REPLAY_TOLERANCE
    # The bound is printed, not the drift itself: the drift depends on the machine's BLAS and thread count.
    print(f"\nLive check: the first {REPLAY_STEPS} steps of '{label}', seed {seed}, replayed: "
          + (f"losses within {REPLAY_TOLERANCE:.0e} relative" if same
             else f"DIFFERENT from the record (losses {drift:.1e} relative apart)"))
    return {"replay_identical": float(same)}


def colour_and_style(config: dict) -> tuple[tuple[float, float, float], str]:
    """A run's line: blue and solid with the norm, brown and dashed without; darker at a larger learning rate."""
    shade = dict(zip(RATES, np.linspace(0.3, 1.0, len(RATES)).tolist(), strict=True))[config["lr"]]
    if layer_field(config, "use_latent_norm"):
        return (1.0 - shade, 0.3, shade), "-"
    return (shade, 0.35, 0.1), "--"


def plot(out: Path | None, results: dict) -> None:
    """Four figures, one point each: the scale of u, the projections' gradients, the loss, the rate sensitivity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = ", ".join(map(str, results["seeds"]))
    (scale_fig, ax), (grad_fig, (gx, hx)), (loss_fig, lx) = (
        plt.subplots(figsize=(7, 4.4), constrained_layout=True),
        plt.subplots(1, 2, figsize=(10.5, 4), constrained_layout=True),
        plt.subplots(figsize=(7, 4), constrained_layout=True))
    for label, by_seed in results["runs"].items():
        colour, style = colour_and_style(next(iter(by_seed.values()))["config"])
        for axis, key in ((ax, "routed_rms"), (gx, "grad_norm_down"), (hx, "grad_norm_up")):
            band(axis, *series(by_seed, key), colour, label, style)
        loss = per_step(by_seed, lambda r: r["loss"])  # [seeds, steps]
        smooth = np.array([np.convolve(row, np.ones(10) / 10, mode="valid") for row in loss])
        band(lx, np.arange(10, loss.shape[1] + 1), smooth, colour, label, style)
    for axis in (ax, gx, hx, lx):
        axis.set_xlabel("step")
    for axis in (ax, gx, hx):
        axis.set_yscale("log")
    ax.set_ylabel("RMS of the routed sum u")
    ax.legend(fontsize=7, ncol=2)
    show_figure(scale_fig, out, "latent_norm_while_training.png",
                caption=f"The scale of the routed sum u before the norm (median of seeds {seeds}, the band their "
                        "range): with the norm on (solid) it is free to drift, by orders of magnitude at the "
                        "larger rates, because the norm rescales it before W_up; without the norm (dashed) it "
                        "drifts less, but all of the drift reaches W_up.",
                alt="Line plot on a log scale of the root mean square of the routed latent sum per training "
                    "step, for the norm off (dashed) and on (solid) at six learning rates")
    gx.set_title("|grad W_down|", fontsize=10)
    hx.set_title("|grad W_up|", fontsize=10)
    show_figure(grad_fig, out, "projection_gradients.png",
                caption="The gradient norms of the two latent projections, W_down and W_up, per step, with the "
                        "norm off (dashed) and on (solid) at each learning rate.",
                alt="Two line plots on a log scale of the Frobenius norm of the gradients of the down- and "
                    "up-projections per training step, for the norm off and on at six learning rates")
    lx.set_ylabel("training loss (mean of 10 steps), nats/byte")
    lx.set_ylim(1.5, 4.0)
    show_figure(loss_fig, out, "loss_with_and_without_the_norm.png",
                caption="The training loss with the norm off (dashed) and on (solid) at each learning rate: at "
                        "the largest rate one seed without the norm diverges, and its line ends.",
                alt="Line plot of the training loss per step for the norm off and on at six learning rates")
    fig, cx = plt.subplots(figsize=(6.5, 4), constrained_layout=True)
    for norm, colour in ((False, "#a6501a"), (True, "#2b4c9a")):
        evals = np.array([[run["summary"]["final_eval_loss"] for run in results["runs"][
            f"norm {'on' if norm else 'off'} lr {lr:g}"].values()] for lr in RATES])  # [rates, seeds], NaN: diverged
        done = np.isfinite(evals).any(axis=1)  # rates where at least one seed finished
        middle = np.nanmedian(evals[done], axis=1)
        cx.errorbar(np.array(RATES)[done], middle,
                    yerr=[middle - np.nanmin(evals[done], axis=1), np.nanmax(evals[done], axis=1) - middle],
                    capsize=3, marker="o", color=colour, label=f"norm {'on' if norm else 'off'}")
    cx.set_xscale("log")
    cx.set_xlabel("learning rate")
    cx.set_ylabel("held-out loss at the end, nats/byte")
    cx.legend(fontsize=8)
    show_figure(fig, out, "held_out_against_rate.png",
                caption="The held-out loss at the end against the learning rate (median across seeds that "
                        "finished, bars their range): up to 3e-2 both curves have the same shape; from 1e-1 on only "
                        "the model with the norm still learns well.",
                alt="Plot of the final held-out loss against the learning rate on a log axis, with error bars, "
                    "one line for the norm off and one for the norm on")


# %%


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--full", action="store_true",
                        help=f"rerun the long experiment (about 16 min of CPU time, 8 min on two cores) and rewrite "
                             f"{RESULTS.name}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.full:
        run_full(RESULTS)

    # Step 1: the recorded runs
    results = load_record(RESULTS.name)
    table = print_results(results)

    # What to see: at step 1 the learning rate has not acted yet, so RMS u is the same at every rate (0.288
    # off, 0.298 on; the first layer's u is the same with and without the norm, but the second layer's input
    # already depends on whether the first normalizes). With the norm on, the scale of u is divided out before
    # W_up, so nothing holds it back and it grows with the rate (97.155 at 0.03, against 16.417 off), while
    # the gradient reaching W_down shrinks (0.0074 against 0.0746), since the gradient through a normalization
    # scales as one over the size of what it normalizes. Up to 0.03 the two stay within a few hundredths of
    # each other, both best at 0.01 (held-out 1.8276 off, 1.8410 on), the norm costing a little at the
    # smallest rate (+0.0239 to +0.0404). From 0.1 on, a u of 1110.582 reaches W_up directly without the norm,
    # and the norm wins by 0.6374 to 0.8442 held-out; at 0.3 one of the three runs without it diverges, at
    # step 94.

    # Step 2: a live check
    check = live_check(results)
    print(f"run time {time.perf_counter() - start:.1f} s")

    # What to see: the replayed steps of a run without the norm match the record, so the tables above are what
    # this code computes.

    # Step: the figures
    if figures_wanted(args.out):
        plot(args.out, results)
    return {"table": table, "check": check}


if __name__ == "__main__":
    main()
