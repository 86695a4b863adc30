"""Where the recorded long runs live: the repository's `docs/results/` folder.

Examples 61–63 and 73 print and plot training runs recorded with their `--full`
flag. A script finds the repository above its own file; a notebook, which has
no `__file__`, above its working folder, so open the notebooks from a clone's
`examples/` folder (where this helper sits too).

Examples 61–63 record every configuration once per seed; the helpers below
train and record such a grid, summarize a quantity over the seeds (median and
range) and replay the first steps of a recorded run. A run that diverges
goes on to the end: `refimpl.train` skips every step whose loss or gradient
is not finite, so a diverged run's loss is NaN from some step on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from refimpl.train import TrainConfig, load_corpus, train, train_many


def results_file(name: str, script: str | None) -> Path:
    """The path of `docs/results/<name>`, found above `script` (an example's `__file__`) or the working folder."""
    here = Path(script).resolve().parent if script else Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "docs" / "results").is_dir():
            return folder / "docs" / "results" / name
    raise FileNotFoundError(f"no docs/results/ folder above {here}: run the example from a clone of the repository")


# Several seeds per configuration: the record, the spread over seeds, the replay.


def record_runs(command: str, runs: Mapping[str, TrainConfig], seeds: Sequence[int],
                keep: Sequence[str]) -> dict[str, Any]:
    """Train every configuration of `runs` once per seed (two processes) and return the record to write.

    The record is `{"command", "seeds", "runs": {label: {seed: {"config", "summary", "steps"}}}, "corpus"}`,
    each step keeping only the keys in `keep`. The most expensive runs (most experts, most steps) start first,
    so the two processes finish close together.
    """
    jobs = sorted(((label, seed) for label in runs for seed in seeds),
                  key=lambda job: -runs[job[0]].moe.num_experts * runs[job[0]].steps)
    logs = train_many([replace(runs[label], seed=seed) for label, seed in jobs], processes=2)
    record: dict[str, Any] = {"command": command, "seeds": list(seeds), "runs": {label: {} for label in runs}}
    for (label, seed), log in zip(jobs, logs, strict=True):
        record["runs"][label][str(seed)] = {
            "config": log["config"], "summary": log["summary"],
            "steps": [{key: step[key] for key in keep if key in step} for step in log["steps"]]}
    record["runs"] = {label: dict(sorted(by_seed.items(), key=lambda item: int(item[0])))
                      for label, by_seed in record["runs"].items()}
    record["corpus"] = next(log["corpus"] for log in logs if "corpus" in log)
    return record


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """Write a record as compact JSON (one line), creating `docs/results/` if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"wrote {path}")


def per_step(by_seed: Mapping[str, Mapping[str, Any]], value: Callable[[dict], float]) -> np.ndarray:
    """`value(step record)` for every step of every seed's run, `[seeds, steps]` (NaN after a run diverged)."""
    rows = [[value(step) for step in run["steps"]] for run in by_seed.values()]
    longest = max(len(row) for row in rows)
    return np.array([row + [np.nan] * (longest - len(row)) for row in rows], dtype=float)


def spread(values: Sequence[float | None]) -> tuple[float, float, float]:
    """Median, smallest and largest over seeds; None (a level never reached) counts as infinity."""
    finite = np.array([np.inf if v is None else v for v in values], dtype=float)
    return float(np.median(finite)), float(finite.min()), float(finite.max())


def show(values: Sequence[float | None], fmt: str = ".3f") -> str:
    """`median [min-max]` over seeds, or just the value when every seed gave the same one."""
    def one(v: float) -> str:
        return "never" if np.isinf(v) else format(v, fmt)

    middle, low, high = spread(values)
    return one(middle) if low == high else f"{one(middle)} [{one(low)}-{one(high)}]"


def finished(values: Sequence[float]) -> list[float]:
    """The values of the seeds whose run finished (a diverged run's loss is NaN)."""
    return [v for v in values if np.isfinite(v)]


def show_finished(values: Sequence[float], fmt: str = ".4f") -> str:
    """`show` over the seeds that finished, with how many they are when not all."""
    kept = finished(values)
    if not kept:
        return "none finished"
    return show(kept, fmt) + ("" if len(kept) == len(values) else f" ({len(kept)} seeds)")


def diverged_at(by_seed: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """The step from which each seed's loss is NaN to the end (the model has diverged), for the seeds that did."""
    steps = {}
    for seed, run in by_seed.items():
        finite = np.isfinite(np.array([step["loss"] for step in run["steps"]], dtype=float))
        if not finite[-1]:
            steps[seed] = int(run["steps"][int(np.flatnonzero(finite)[-1]) + 1]["step"]) if finite.any() else 1
    return steps


def replay(recorded: Mapping[str, Any], steps: int) -> list[dict[str, Any]]:
    """Train the first `steps` steps of a recorded run again with today's code and return their records."""
    config = replace(TrainConfig.from_record(recorded["config"]), steps=steps, eval_every=1000)
    return train(config, corpus=load_corpus())["steps"]


def band(ax: Any, steps: np.ndarray, values: np.ndarray, colour: str, label: str, style: str = "-") -> None:
    """Plot the median over seeds of `values` `[seeds, steps]` as a line, with the min-max range shaded."""
    ax.plot(steps, np.median(values, axis=0), style, color=colour, linewidth=1, label=label)
    if values.shape[0] > 1:
        ax.fill_between(steps, values.min(axis=0), values.max(axis=0), color=colour, alpha=0.18, linewidth=0)
