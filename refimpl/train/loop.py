r"""The training run: steps, the optimizer, logging, evaluation, checkpoints on a schedule.

`train(config)` draws the weights and the balancers from the run's random seed (`config.seed`), then
repeats the step of `refimpl.train.step` with Adam, logging every step's
loss and max violation and, on a schedule, the statistics and the held-out
loss; `train_many` runs several configurations and `noise_floor` measures
how much the loss moves between random seeds. `check_resources` refuses a run that
could not fit in this machine's memory before anything is allocated, and
`write_log` writes the log as strict JSON, atomically.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .._lib.files import write_atomically
from .._lib.values import seed_value, switch_value
from ..balancing import Balancer, HistogramBalancer
from ..layer.routing import route
from .checkpoints import (
    RunState,
    check_checkpoint_folder,
    checkpoint_lock,
    json_safe,
    load_run,
    write_checkpoint,
)
from .config import BALANCERS, PRECISIONS, TrainConfig, TrainConfigError
from .data import VOCAB, Corpus, load_corpus, sample_batch
from .model import BIAS, model_shapes, moe_prefix
from .step import ONE_PROCESS, Ranks, evaluate, forward_backward

# ---------------------------------------------------------------------------
# What a run needs: text longer than its context, memory for its arrays
# ---------------------------------------------------------------------------

#: The bytes per count of one `qb-hist` histogram at its peak (the int64 counts, their int64 cumulative sum, the
#: comparison with the rank as bool and as int64), measured with `tracemalloc` around `HistogramBalancer.step`.
HISTOGRAM_BYTES_PER_COUNT = 25


def _memory_parts(config: TrainConfig) -> list[tuple[str, str, int]]:
    """The largest arrays of a run, roughly: `(field to blame, what they are, bytes)`."""
    moe = config.moe
    m, c, e, layers = config.batch, config.context, config.embed, moe.num_moe_layers
    count = sum(math.prod(shape) for shape in model_shapes(config).values())
    # Per token: the window (int64, twice), its embeddings and their gradient (float32).
    window = c * (16 + 8 * e)
    # Per token and layer: a dozen [d] vectors, a few [n] score rows, the k slots' expert activations.
    activations = layers * 4 * (12 * moe.hidden_size + 6 * moe.num_experts
                                + 3 * moe.top_k * (3 * moe.intermediate_size + 2 * moe.latent_size)) + 4 * 4 * VOCAB
    parts = [
        ("context", f"the context windows of the batches ((--batch {m} + {config.eval_batch} held out) x --context "
                    f"{c}, with --embed {e})", (m + config.eval_batch) * window),
        ("batch", f"a batch's activations (--batch {m} tokens through {layers} layers)", m * activations),
        ("moe.num_experts", f"the model's {count:,} parameters, their gradients and Adam's moments", 20 * count),
    ]
    if isinstance(BALANCERS[config.balancer](config), HistogramBalancer):
        # One layer's histogram at a time: its [n, B] counts and, while the threshold is read, their cumulative
        # sum and the comparison with the rank (as bool, then int64): 8 + 8 + 1 + 8 bytes per count.
        cells = moe.num_experts * config.bins
        parts.append(("bins", f"the histogram of qb-hist (--experts {moe.num_experts} x --bins {config.bins:,} "
                              "counts, with the arrays its read-out makes)", HISTOGRAM_BYTES_PER_COUNT * cells))
    return parts


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_resources(config: TrainConfig, corpus: Corpus | None = None) -> None:
    """Raise `TrainConfigError` naming the field if the run cannot be trained here, before anything is allocated.

    The held-out text must be longer than the context, and the run's arrays
    (estimated from the sizes) must fit in this machine's memory.
    """
    parts = _memory_parts(config)
    total = sum(size for _, _, size in parts)
    memory = _physical_memory()
    if memory is not None and total > memory:
        name, what, size = max(parts, key=lambda part: part[2])
        raise TrainConfigError(name, f"the run would need about {_gib(total)} of memory, more than this machine's "
                                     f"{_gib(memory)}; the largest part is {what}: {_gib(size)}")
    if corpus is not None and config.context >= corpus.data.size - corpus.split:
        raise TrainConfigError("context", f"context must be shorter than the held-out text "
                                          f"({corpus.data.size - corpus.split:,} bytes), got {config.context:,}")


def _gib(size: float) -> str:
    return f"{size / 2**40:,.2f} TiB" if size >= 2**40 else f"{size / 2**30:,.2f} GiB"

# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------

def _clip(grads: dict[str, np.ndarray], max_norm: float, ranks: Ranks = ONE_PROCESS) -> float:
    """Scale all gradients so their global norm is at most `max_norm` (0: no clipping); returns the norm before."""
    total = math.sqrt(ranks.sum_of_squares(grads))
    if max_norm > 0 and total > max_norm:
        for name in grads:
            grads[name] = (grads[name] * (max_norm / total)).astype(np.float32)
    return total


def routing_biases(balancers: Sequence[Balancer]) -> list[np.ndarray]:
    """Each block's bias as its balancer holds it now: the bias the evaluation and the final parameters use.

    The bias lives in the balancer only; at inference the last bias is frozen, and so it is here.
    """
    return [balancer.bias for balancer in balancers]


def train(config: TrainConfig, *, corpus: Corpus | None = None, progress: bool = False,
          log: Callable[[str], None] | None = None, final_params: dict[str, np.ndarray] | None = None,
          checkpoint: str | Path | None = None, checkpoint_every: int = 0,
          resume: str | Path | None = None, ranks: Ranks = ONE_PROCESS, overwrite: bool = False) -> dict[str, Any]:
    """Train the model of `config` and return the log `{"config", "corpus", "steps", "summary"}`.

    `steps` holds one record per step: `step` (from 1), `loss`,
    `max_violation` (largest over layers), `max_violation_layers` and
    `grad_norm` (global, before clipping; absent on a skipped step); on every
    `stats_every`-th step (and step 1; every step in a low-precision run) the per-layer
    `activation_peak`, `routed_rms`, `grad_norm_down` and `grad_norm_up`; on every `eval_every`-th step
    (and the last) `eval_loss`; `overflow: true` where the largest routed activation lies
    beyond the precision's range, and `skipped: true` where the update was
    skipped (an overflow, or a loss or gradient that is not finite); with an
    auxiliary loss `aux_loss` (per layer) and `objective`; with a capacity
    `drop_rate` (per layer). A run
    whose weights grow until its forward pass overflows has diverged: it goes
    on to the end with every step skipped and its loss NaN, and its held-out
    loss is NaN. `summary` has the
    wall time, the throughput in tokens per second and `sessions` (the steps
    and seconds of each process that trained the run). If `final_params` is
    a dict, it receives the trained weights.

    `checkpoint` is a folder to write the complete state into every
    `checkpoint_every` steps (0: only at the end) and at the end; `resume`
    a checkpoint folder to continue from, written by the same configuration
    (its `steps` may differ). A resumed run's log equals that of the run
    never interrupted, every number but the timings. The checkpoint folder
    is guarded as the command guards it (`check_checkpoint_folder`): one
    holding another run's checkpoint is refused unless it is the one being
    resumed or `overwrite=True`; one holding other files is refused; and the
    run holds the folder's lock, so a second run on it is refused.

    `ranks` is where the steps run (`forward_backward`): one process by
    default; `refimpl.train.expert_parallel.train_expert_parallel` passes its
    ranks, and each step's record then adds what `ranks.step_record()`
    gives. Checkpoints are written and resumed by one process only.
    """
    progress, overwrite = switch_value(progress, "progress"), switch_value(overwrite, "overwrite")
    corpus = load_corpus() if corpus is None else corpus
    check_resources(config, corpus)
    if type(ranks) is not Ranks and (checkpoint is not None or resume is not None):
        raise ValueError(f"checkpoint= and resume= are for a run on one process; this one runs on "
                         f"{type(ranks).__name__} ({ranks.size} ranks)")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, numbers.Integral) \
            or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be a non-negative integer (0: only at the end), "
                         f"got {checkpoint_every!r}")
    if checkpoint is None:
        return _train(config, corpus, progress, log, final_params, None, checkpoint_every, resume, ranks)
    check_checkpoint_folder(checkpoint, resume=resume, overwrite=overwrite)
    with checkpoint_lock(checkpoint):
        return _train(config, corpus, progress, log, final_params, Path(checkpoint), checkpoint_every, resume,
                      ranks)


def _train(config: TrainConfig, corpus: Corpus, progress: bool, log: Callable[[str], None] | None,
           final_params: dict[str, np.ndarray] | None, checkpoint: Path | None, checkpoint_every: int,
           resume: str | Path | None, ranks: Ranks) -> dict[str, Any]:
    """`train`, its arguments checked (and the checkpoint folder's lock held): the steps, then the summary."""
    run = RunState.start(config, ranks) if resume is None else load_run(resume, config, corpus)
    evaluation = _Evaluation(config, corpus, run, ranks)
    steps: Iterable[int] = range(run.step + 1, config.steps + 1)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"train {config.balancer}", unit="step", file=sys.stderr, leave=False,
                     initial=run.step, total=config.steps)
    session = {"first_step": run.step + 1, "last_step": run.step, "seconds": 0.0}
    if run.step < config.steps:
        run.sessions.append(session)
    start = time.perf_counter()
    train_data, mine = corpus.data[:corpus.split], ranks.rows(config.batch)
    for t in steps:
        tokens, targets = sample_batch(train_data, run.rng, config.batch, config.context)
        record = _step(run, tokens[mine], targets[mine], t, config, evaluation, ranks)
        run.records.append(record)
        run.step = session["last_step"] = t
        session["seconds"] = time.perf_counter() - start
        if checkpoint is not None and ((checkpoint_every and t % checkpoint_every == 0) or t == config.steps):
            write_checkpoint(checkpoint, run, config, corpus)
        if progress:
            steps.set_postfix(loss=f"{record['loss']:.3f}", viol=f"{record['max_violation']:.2f}")
    session["seconds"] = time.perf_counter() - start
    if "eval_loss" not in run.records[-1]:  # resumed at its last step from a checkpoint between evaluations
        run.records[-1]["eval_loss"] = evaluation(run)
    if final_params is not None:
        final_params.update(run.params)
        final_params.update({moe_prefix(number) + BIAS: bias for number, bias in enumerate(routing_biases(run.balancers))})
    return _result(config, corpus, run, log)


class _Evaluation:
    """The held-out loss of a run: the same held-out batch at every evaluation, each process its rows."""

    def __init__(self, config: TrainConfig, corpus: Corpus, run: RunState, ranks: Ranks):
        eval_rng = np.random.default_rng([config.seed, 1])
        tokens, targets = sample_batch(corpus.data[corpus.split:], eval_rng, config.eval_batch, config.context)
        # Every process draws the whole batch from the same generator and keeps its rows.
        mine = ranks.rows(config.eval_batch)
        self.tokens, self.targets = tokens[mine], targets[mine]
        self.layers = [balancer.layer_config(config.moe) for balancer in run.balancers]
        self.config, self.ranks = config, ranks

    def __call__(self, run: RunState) -> float:
        return evaluate(run.params, self.tokens, self.targets, self.config, self.layers,
                        biases=routing_biases(run.balancers), ranks=self.ranks)


def _step(run: RunState, tokens: np.ndarray, targets: np.ndarray, t: int, config: TrainConfig,
          evaluation: _Evaluation, ranks: Ranks) -> dict[str, Any]:
    """Step `t` of the run: forward, backward, the update unless it must be skipped; its record."""
    # A low-precision run needs the peak every step: it decides whether the step overflowed.
    with_stats = t % config.stats_every == 0 or t == 1 or config.precision != "float32"
    result = forward_backward(run.params, tokens, targets, run.balancers, config, with_stats=with_stats,
                              ranks=ranks)
    record: dict[str, Any] = {"step": t, "loss": result.loss, "max_violation": max(result.violations),
                              "max_violation_layers": result.violations, **result.balancing}
    peak_limit = float(ml_dtypes.finfo(PRECISIONS[config.precision]).max)
    overflow = bool(result.stats.get("activation_peak")) and max(result.stats["activation_peak"]) > peak_limit
    run.overflow_steps += overflow
    finite = bool(result.grads) and ranks.all(all(np.all(np.isfinite(g)) for g in result.grads.values()))
    if overflow:
        record["overflow"] = True
    if finite and not overflow:
        record["grad_norm"] = _clip(result.grads, config.grad_clip, ranks)
        run.adam.step(run.params, result.grads)
    else:
        record["skipped"] = True
        run.skipped += 1
    if with_stats:
        record.update(result.stats)
    if t % config.eval_every == 0 or t == config.steps:
        record["eval_loss"] = evaluation(run)
    record.update(ranks.step_record())
    return record


def _result(config: TrainConfig, corpus: Corpus, run: RunState, log: Callable[[str], None] | None) -> dict[str, Any]:
    """The run's log: the configuration, the corpus, every step's record and the summary (said to `log`)."""
    seconds = sum(part["seconds"] for part in run.sessions)
    records = run.records
    summary = {"seconds": seconds, "tokens_per_second": config.batch * config.steps / seconds if seconds else 0.0,
               "skipped_steps": run.skipped, "activation_overflow_steps": run.overflow_steps,
               "final_eval_loss": records[-1]["eval_loss"], "sessions": run.sessions}
    if log is not None:
        log(f"{config.steps} steps of {config.batch} tokens in {seconds:.1f} s: "
            f"{summary['tokens_per_second']:,.0f} tokens/s; final loss {records[-1]['loss']:.4f}, "
            f"held-out loss {summary['final_eval_loss']:.4f}, last max violation {records[-1]['max_violation']:.3f}")
    return {"config": config.to_record(), "corpus": corpus.record(), "steps": records, "summary": summary}


def _train_quietly(config: TrainConfig) -> dict[str, Any]:
    return train(config)


def train_many(configs: Sequence[TrainConfig], processes: int = 2) -> list[dict[str, Any]]:
    """Train several configurations, `processes` at a time (one process each), and return their logs in order.

    The experiments' long runs use it; each run is as deterministic as a
    single `train` call, whatever the order the processes finish in.
    """
    configs = list(configs)
    if processes <= 1 or len(configs) <= 1:
        return [train(config) for config in configs]
    from multiprocessing import get_context

    with get_context("fork").Pool(processes) as pool:
        return pool.map(_train_quietly, configs, chunksize=1)


def noise_floor(m: int, n: int, top_k: int, *, draws: int = 200, seed: int = 0) -> np.ndarray:
    r"""The max violation of perfectly fair random routing: `draws` samples, `[draws]`.

    Each of $m$ tokens picks $k$ distinct experts uniformly at random (the
    top-$k$ of i.i.d. uniform scores), so every expert's expected load is
    exactly $q = mk/n$; what remains is sampling noise. No bias computed from
    a past batch can do better on a fresh batch of independent tokens.
    """
    rng = np.random.default_rng(seed_value(seed, "seed"))
    q = m * top_k / n
    floor = np.empty(draws)
    for draw in range(draws):
        index, _ = route(rng.random((m, n), dtype=np.float32), np.zeros(n, np.float32), top_k)  # [m, k]
        load = np.bincount(index.reshape(-1), minlength=n)  # [n]
        floor[draw] = load.max() / q - 1.0
    return floor


# ---------------------------------------------------------------------------
# The log file
# ---------------------------------------------------------------------------

def write_log(path: str | Path, log: Mapping[str, Any]) -> None:
    """Write a training log to `path` as strict JSON (a non-finite number becomes `null`), atomically.

    The text goes to a temporary file in the same folder, is flushed to the
    disk and renamed over `path`: a write that fails leaves the previous
    file as it was.
    """
    text = json.dumps(json_safe(log, lambda x: None), indent=1, allow_nan=False) + "\n"
    write_atomically(path, text)
