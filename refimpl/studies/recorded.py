r"""Recorded long runs: the training experiments the worked examples print, plot and replay.

Some claims of this site need hours of training: examples 61, 62 and 63 train
the small model of `refimpl.train` in dozens of configurations, each from
three seeds, and example 73 trains seven balancers side by side. Those runs
are made once, with the command written inside each record, and shipped
with the package in `refimpl/results/`:

| record | made by |
|---|---|
| `61_balance_while_learning.json` | `python examples/61_balance_while_learning.py --full` |
| `61_balance_at_k3_scale.json` | `python examples/61_balance_while_learning.py --full-k3` (n = 896, k = 16) |
| `62_activations_while_training.json` | `python examples/62_activations_while_training.py --full` |
| `63_latent_norm_while_training.json` | `python examples/63_latent_norm_while_training.py --full` |
| `balancers_training.json` | `python examples/73_balancers_in_training.py --full` |
| `default_run.json` | `python -m refimpl.train --out run.json` (the "Why Stable" page quotes it) |

Because the records are package data, an example (or its notebook, run in
an empty folder) finds them with `recorded_path(name)` wherever refimpl is
installed. Each example then replays the first steps of one recorded run
with today's code, so a record that no longer matches the code is noticed.

A multi-seed record is `{"command", "seeds", "runs": {label: {seed: run}}}`;
the helpers below summarize a quantity across seeds as the median with the
smallest and largest value, which is how every table of those examples reads.
A run that diverges goes on to its end: `refimpl.train` skips every step whose
loss or gradient is not finite, so a diverged run's loss is NaN from some
step on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .._lib.files import write_atomically

__all__ = ["RESULTS", "band", "diverged_at", "finished", "layer_field", "load_record", "per_step", "record_runs",
           "recorded_path", "replay", "show", "show_finished", "spread", "write_record"]

#: The folder of the recorded runs, inside the installed package.
RESULTS = Path(__file__).resolve().parents[1] / "results"


# ---------------------------------------------------------------------------
# Where the records are
# ---------------------------------------------------------------------------

def recorded_path(name: str) -> Path:
    """The path of the record `name` (e.g. `"61_balance_while_learning.json"`) in `refimpl/results/`.

    The path is returned whether or not the file exists, so that a `--full` run can write it;
    `load_record` reads it and says what to run when it is missing.
    """
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise ValueError(f"name must be a file name inside refimpl/results/, got {name!r}")
    return RESULTS / name


def load_record(name: str) -> dict[str, Any]:
    """The record `name`, parsed; a missing or malformed file is an error that names it."""
    path = recorded_path(name)
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in RESULTS.glob("*.json"))) or "none"
        raise FileNotFoundError(f"no recorded run {name!r} in {RESULTS} (recorded runs: {known})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def write_record(path: Path, record: Mapping[str, Any], indent: int | None = None) -> None:
    """Write a record as JSON, atomically (`refimpl._lib.files.write_atomically`), creating its folder.

    Compact (one line) by default; `indent` spreads it over lines as `json.dumps` does.
    """
    separators = (",", ":") if indent is None else None
    write_atomically(Path(path), json.dumps(record, separators=separators, indent=indent) + "\n", make_folder=True)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------
# Recording a grid of configurations, each from several seeds
# ---------------------------------------------------------------------------

def record_runs(command: str, runs: Mapping[str, Any], seeds: Sequence[int],
                keep: Sequence[str]) -> dict[str, Any]:
    """Train every configuration of `runs` (label -> `TrainConfig`) once per seed, two processes at a time.

    The record is `{"command", "seeds", "runs": {label: {seed: {"config", "summary", "steps"}}}, "corpus"}`,
    each step keeping only the keys in `keep`. The most expensive runs (most experts, most steps) start
    first, so the two processes finish close together.
    """
    from ..train.loop import train_many

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


def replay(recorded: Mapping[str, Any], steps: int) -> list[dict[str, Any]]:
    """Train the first `steps` steps of a recorded run again with today's code and return their records.

    The recorded configuration is read by `TrainConfig.from_record`, which knows both the layout of
    today's logs (the layer's fields under `moe`) and that of the earlier flat ones.
    """
    from ..train import TrainConfig, load_corpus, train

    config = replace(TrainConfig.from_record(recorded["config"]), steps=steps, eval_every=1000)
    return train(config, corpus=load_corpus())["steps"]


# ---------------------------------------------------------------------------
# Summaries across seeds
# ---------------------------------------------------------------------------

def layer_field(config: Mapping[str, Any], name: str) -> Any:
    """A field of a recorded run's layer (`activation`, `use_latent_norm`, ...), in either log layout."""
    from ..train import TrainConfig

    return getattr(TrainConfig.from_record(config).moe, name)


def per_step(by_seed: Mapping[str, Mapping[str, Any]], value: Callable[[dict], float]) -> np.ndarray:
    """`value(step record)` for every step of every seed's run, `[seeds, steps]` (NaN after a run ended early)."""
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
    """The values of those seeds whose run finished (a diverged run's loss is NaN)."""
    return [v for v in values if np.isfinite(v)]


def show_finished(values: Sequence[float], fmt: str = ".4f") -> str:
    """`show` across seeds that finished, with how many they are when not all."""
    kept = finished(values)
    if not kept:
        return "none finished"
    return show(kept, fmt) + ("" if len(kept) == len(values) else f" ({len(kept)} seeds)")


def diverged_at(by_seed: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """The step from which each seed's loss is NaN to the end (the model has diverged), for those seeds that did."""
    steps = {}
    for seed, run in by_seed.items():
        finite = np.isfinite(np.array([step["loss"] for step in run["steps"]], dtype=float))
        if not finite[-1]:
            steps[seed] = int(run["steps"][int(np.flatnonzero(finite)[-1]) + 1]["step"]) if finite.any() else 1
    return steps


def band(ax: Any, steps: np.ndarray, values: np.ndarray, colour: str, label: str, style: str = "-") -> None:
    """Plot the median over seeds of `values` `[seeds, steps]` as a line, with the min-max range shaded."""
    ax.plot(steps, np.median(values, axis=0), style, color=colour, linewidth=1, label=label)
    if values.shape[0] > 1:
        ax.fill_between(steps, values.min(axis=0), values.max(axis=0), color=colour, alpha=0.18, linewidth=0)
