r"""Quantile Balancing as others ship it: the bias's sign, Megatron-Core's updates, torchtitan's histograms

Eq. (14) reaches users through other code too, and that code makes choices
the report does not (`refimpl.balancing.shipped` says where each comes from):

* **Megatron-Core** reads the router's raw logits $z$, not the scores
  $s = \sigma(z)$; it keeps $\beta = -b$ and selects from $z - \beta$; it
  needs $mk/n$ to be whole in every micro-batch; and it averages one quantile
  per micro-batch (over the data-parallel ranks too) instead of reading one
  quantile of the pooled batch.
* **torchtitan's K3 balancer** bins the fixed range
  $[-1, 1]$ into 512 bins, where Appendix D bins $[\min b - 1, \max b + 1]$
  into 1000.
* **Megatron-Core's `global_batch` mode and torchtitan's `QuantileBalancer`**
  ship Appendix D itself: an added bias on the sigmoid scores, one histogram
  of 1000 bins over $[\min b - 1, \max b + 1]$ pooled over the micro-batches,
  float32 throughout, but they read the $\lceil q \rceil$-th smallest required
  bias where Eq. (14) reads the $(q+1)$-th, and they differ on a step that saw
  no token: Megatron-Core keeps the bias, torchtitan divides zero by zero.
* **The sign.** The report adds $b$; the dual subtracts $\beta$. A port that
  mixes the two routes with $s - b$ while updating $b$ for $s + b$.

Each is run here on the same stream of fresh batches from a skewed router
($n = 96$ experts, $k = 8$, 4,224 tokens a step as 8 micro-batches of 528,
so that $mk/n$ is whole in each, 40 steps), and measured by the **max
violation** of each step's batch, routed with the bias held before the batch
was seen: $\max_j \text{load}_j / q - 1$, with $q = mk/n$ the load of a
perfectly balanced batch (0 is perfect; 0.5 means the busiest expert got half
as much again as its share).
"""

# %%
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from refimpl.balancing import (
    histogram_balancing_update,
    megatron_qb_update,
    quantile_balancing_update,
    torchtitan_qb_update,
)
from refimpl.layer.routing import expert_load, route
from refimpl.studies.figures import figures_wanted, show_figure
from refimpl.studies.workloads import skewed_batch, skewed_router
from refimpl.testing.qb_conventions import HISTOGRAM_CONVENTIONS

N, K, WIDTH, SEED = 96, 8, 64, 15
MICRO_BATCHES, MICRO_TOKENS = 8, 528  # 528 * 8 / 96 = 44: whole in every micro-batch


# %%
def logits_of(weight: np.ndarray, mean: np.ndarray, tokens: int, step: int) -> np.ndarray:
    """One step's router logits $z = x W_r^\\top$, `[tokens, n]`, float64."""
    return skewed_batch(weight, mean, tokens, SEED, step).astype(np.float64) @ weight.T.astype(np.float64)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def max_violation(index: np.ndarray, m: int) -> float:
    """$\\max_j \\text{load}_j / q - 1$ for the route `index` `[m, k]` of a batch of `m` tokens."""
    return float(expert_load(index, N).max() / (m * K / N) - 1.0)


# %%
class Convention:
    """A balancing rule as some code ships it: `route(z)` with the bias held, then `update(z)` for the next batch."""

    def __init__(self, name: str, select, update) -> None:
        self.name, self.select, self.update = name, select, update
        self.bias = np.zeros(N)
        self.violations: list[float] = []

    def step(self, z: np.ndarray) -> None:
        index = self.select(z, self.bias)
        self.violations.append(max_violation(index, z.shape[0]))
        self.bias = self.update(z, self.bias)


def topk(values: np.ndarray) -> np.ndarray:
    """The top-k expert ids of each row, `[m, k]`."""
    return np.argpartition(-values, K - 1, axis=1)[:, :K]


def micro(z: np.ndarray, tokens: int = MICRO_TOKENS) -> list[np.ndarray]:
    """The batch as micro-batches of `tokens` tokens each."""
    return np.split(z, z.shape[0] // tokens)


def megatron_global_batch(z: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Megatron-Core's `global_batch` update: float32 sigmoid scores of every micro-batch in one histogram."""
    scores = [block.astype(np.float32) for block in micro(sigmoid(z))]
    return np.asarray(megatron_qb_update(scores, b.astype(np.float32), K, estimation_scope="global_batch"))


def torchtitan(z: np.ndarray, b: np.ndarray) -> np.ndarray:
    """torchtitan's `QuantileBalancer`: observed micro-batch by micro-batch, estimated at the optimizer step."""
    scores = [block.astype(np.float32) for block in micro(sigmoid(z))]
    return np.asarray(torchtitan_qb_update(scores, b.astype(np.float32), K))


def conventions() -> list[Convention]:
    """The rules compared, each with its own selection and update."""

    def report_select(z, b):
        return np.asarray(route(sigmoid(z), b, K)[0])  # top-k of s + b

    def report_update(z, b):
        return np.asarray(quantile_balancing_update(sigmoid(z), b, K))  # one quantile of the pooled batch

    return [
        Convention("Eq. (14): scores, pooled quantile", report_select, report_update),
        Convention("Megatron-Core: logits, averaged quantiles", lambda z, beta: topk(z - beta),
                   lambda z, beta: np.asarray(megatron_qb_update(micro(z), beta, K))),
        Convention("scores, averaged quantiles", report_select,
                   lambda z, b: -np.asarray(megatron_qb_update(micro(sigmoid(z)), -b, K))),
        Convention("histogram, adaptive range, 1000 bins", report_select,
                   lambda z, b: np.asarray(histogram_balancing_update(micro(sigmoid(z)), b, K, 1000))),
        Convention("histogram, fixed [-1, 1], 512 bins", report_select,
                   lambda z, b: np.asarray(histogram_balancing_update(micro(sigmoid(z)), b, K, 512,
                                                                      value_range=(-1.0, 1.0)))),
        Convention("Megatron-Core global_batch: ceil(q) rank", report_select, megatron_global_batch),
        Convention("torchtitan QuantileBalancer: ceil(q) rank", report_select, torchtitan),
        Convention("Megatron-Core's bias on the scores", lambda z, beta: topk(sigmoid(z) - beta),
                   lambda z, beta: np.asarray(megatron_qb_update(micro(z), beta, K))),
        Convention("s - b routed, b updated for s + b", lambda z, b: topk(sigmoid(z) - b), report_update),
    ]


# %%
def run(steps: int) -> tuple[list[Convention], np.ndarray]:
    weight, mean = skewed_router(N, WIDTH, SEED)
    rules = conventions()
    floor = []
    rng = np.random.default_rng(SEED)
    for step in range(steps):
        z = logits_of(weight, mean, MICRO_BATCHES * MICRO_TOKENS, step)  # [m, n]
        for rule in rules:
            rule.step(z)
        # The floor: a router with no preference at all, routed without a bias (sampling noise only).
        floor.append(max_violation(topk(rng.random(z.shape)), z.shape[0]))
    return rules, np.array(floor)


def micro_batch_sweep(steps: int, sizes: list[int]) -> dict[int, float]:
    """Averaged per-micro-batch quantiles (in the report's sign, on scores) for micro-batches of each size."""
    weight, mean = skewed_router(N, WIDTH, SEED)
    rules = {size: Convention(f"{size} tokens", lambda z, b: np.asarray(route(sigmoid(z), b, K)[0]),
                              lambda z, b, size=size: -np.asarray(megatron_qb_update(micro(sigmoid(z), size), -b,
                                                                                       K)))
             for size in sizes}
    for step in range(steps):
        z = logits_of(weight, mean, MICRO_BATCHES * MICRO_TOKENS, step)
        for rule in rules.values():
            rule.step(z)
    return {size: float(np.median(rule.violations[steps // 2:])) for size, rule in rules.items()}


def whole_target_effect(steps: int, tokens: int) -> dict[str, float]:
    """Eq. (14) against the same rule with q = mk/n rounded down, on batches whose q is fractional."""
    weight, mean = skewed_router(N, WIDTH, SEED)
    rules = {"interpolated q (Eq. 14)": np.zeros(N), "q rounded down": np.zeros(N)}
    violations: dict[str, list[float]] = {name: [] for name in rules}
    for step in range(steps):
        s = sigmoid(logits_of(weight, mean, tokens, step))
        for name, b in rules.items():
            violations[name].append(max_violation(np.asarray(route(s, b, K)[0]), tokens))
            if name == "q rounded down":  # the kit's catalogued convention, computed by the kit itself
                rules[name] = np.asarray(convention_output("whole_target_rounded_down", [s], b))
            else:
                rules[name] = np.asarray(quantile_balancing_update(s, b, K))
    return {name: float(np.median(v[steps // 2:])) for name, v in violations.items()}


def read_gaps(bias: np.ndarray, step: int) -> dict[str, object]:
    """Each histogram update of one fresh batch against Eq. (14)'s, from `bias`: (largest, median) in bins."""
    weight, mean = skewed_router(N, WIDTH, SEED)
    z = logits_of(weight, mean, MICRO_BATCHES * MICRO_TOKENS, step)  # [m, n], a batch the run has not seen
    exact = np.asarray(quantile_balancing_update(sigmoid(z), bias, K))  # [n]
    width = (bias.max() - bias.min() + 2.0) / 1000
    updates = {
        "refimpl's Appendix D: (q+1)-th, 1000 bins": np.asarray(
            histogram_balancing_update(micro(sigmoid(z)), bias, K, 1000)),
        "Megatron-Core global_batch: ceil(q)-th": megatron_global_batch(z, bias),
        "torchtitan QuantileBalancer: ceil(q)-th": torchtitan(z, bias),
    }
    in_bins = {name: (float(np.abs(new - exact).max() / width), float(np.median(np.abs(new - exact)) / width))
               for name, new in updates.items()}
    return {"bin width": float(width), "in bins": in_bins}


def empty_step(bias: np.ndarray) -> dict[str, str]:
    """What each update does with a step whose micro-batches hold no token."""
    nothing = [np.zeros((0, N), dtype=np.float32)] * MICRO_BATCHES  # [0, n] each
    held = bias.astype(np.float32)

    def outcome(update) -> str:
        try:
            new = np.asarray(update())
        except ValueError as error:
            return f"refuses it: ValueError({str(error).split(':')[0]!r})"
        if np.isnan(new).any():
            return f"NaN in {int(np.isnan(new).sum())} of {N} entries"
        return "keeps the bias" if np.array_equal(new, held) else f"moves it by {np.abs(new - held).max():.3g}"

    return {
        "Eq. (14), quantile_balancing_update": outcome(lambda: quantile_balancing_update(
            np.concatenate(nothing), held, K)),
        "Appendix D, histogram_balancing_update": outcome(lambda: histogram_balancing_update(
            nothing, held, K, 1000)),
        "Megatron-Core global_batch": outcome(lambda: megatron_qb_update(nothing, held, K,
                                                                          estimation_scope="global_batch")),
        "torchtitan QuantileBalancer": outcome(lambda: torchtitan_qb_update(nothing, held, K)),
    }


def convention_output(name: str, blocks: list[np.ndarray], b: np.ndarray) -> np.ndarray:
    """The new bias of one of the kit's catalogued ways of shipping Eq. (14) (`refimpl.testing.qb_conventions`)."""
    entry = next(e for e in HISTOGRAM_CONVENTIONS if e.name == name)
    return entry.output(blocks, b, K)


# %%
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)

    # Step 1: Every convention on the same stream of batches
    rules, floor = run(args.steps)
    settle = args.steps // 2
    print(f"n = {N}, k = {K}, {MICRO_BATCHES} micro-batches of {MICRO_TOKENS} tokens a step (q = "
          f"{MICRO_BATCHES * MICRO_TOKENS * K // N}), {args.steps} steps; max violation = max load / q - 1")
    print(f"   {'rule':<44}{'step 1':>8}{'step 2':>8}{'step 5':>8}{f'median of steps {settle + 1}-{args.steps}':>24}")
    summary = {}
    for rule in rules:
        v = np.array(rule.violations)
        summary[rule.name] = float(np.median(v[settle:]))
        print(f"   {rule.name:<44}{v[0]:>8.3f}{v[1]:>8.3f}{v[4]:>8.3f}{summary[rule.name]:>24.3f}")
    print(f"   {'no preference, no bias (the noise floor)':<44}{'':>24}{np.median(floor[settle:]):>24.3f}")

    # What to see: every rule read in its own sign settles within a few steps near 0.17, a little above the
    # noise floor, whether it works on logits or scores, pooled or averaged, exact or binned; Megatron-Core's
    # global_batch mode and torchtitan's QuantileBalancer, with their ceil(q) rank, among them. The two rows
    # that mix conventions never settle: 11 = n/k - 1 means one set of k experts takes every token.

    # Step 2: How small the micro-batches may be
    # The same batches split into smaller micro-batches, one quantile per micro-batch averaged.
    sizes = [528, 192, 48, 12]
    sweep = micro_batch_sweep(args.steps, sizes)
    print(f"averaged quantiles of micro-batches, the same {MICRO_BATCHES * MICRO_TOKENS:,} tokens a step:")
    for size, value in sweep.items():
        print(f"   {MICRO_BATCHES * MICRO_TOKENS // size:>4} micro-batches of {size:>3} tokens (q = {size * K // N:>2} "
              f"each): median max violation {value:.3f}")
    print(f"   one pooled quantile (Eq. 14):                         median max violation "
          f"{summary[rules[0].name]:.3f}")

    # What to see: averaging costs nothing down to 192 tokens a micro-batch, and balance worsens below that.
    # The (q+1)-th largest of m margins sits near the (q+1)/(m+1) quantile, not q/m: a bias that averaging
    # does not remove.

    # Step 3: A target rounded down
    # Megatron-Core asserts that mk/n is whole; a port that relaxes the assertion by rounding q down reads
    # the (floor(q)+1)-th margin on a fractional target instead of interpolating.
    tokens = MICRO_BATCHES * MICRO_TOKENS + 5
    rounded = whole_target_effect(args.steps, tokens)
    print(f"{tokens:,} tokens a step (q = {tokens * K / N:.2f}):")
    for name, value in rounded.items():
        print(f"   {name:<44}median max violation {value:.3f}")

    # What to see: rounding q down moves each threshold by less than one token's margin, far below the noise
    # of a fresh batch, so the two rules balance alike.

    # Step 4: Where the shipped histograms read
    # From the bias Eq. (14) holds after the run, one fresh batch, and each histogram update beside Eq. (14)'s,
    # in bins of the adaptive range: refimpl's Appendix D reads the (q+1)-th smallest required bias in its bin,
    # Megatron-Core's global_batch mode and torchtitan the ceil(q)-th.
    gaps = read_gaps(rules[0].bias, args.steps)
    print(f"one fresh batch from the settled bias (q = {MICRO_BATCHES * MICRO_TOKENS * K // N}, 1000 bins of "
          f"{gaps['bin width']:.2e}); |update - Eq. (14)| in bins:")
    for name, (largest, median) in gaps["in bins"].items():
        print(f"   {name:<44}largest {largest:>6.2f}   median {median:>5.2f}")

    # What to see: all three read within a bin of Eq. (14), and the two shipped ones as close as refimpl's: the
    # ceil(q)-th and the (q+1)-th smallest required bias are neighbours in the column, here in the same bin, so
    # the rank costs nothing on batches of this size. Neighbours lie further apart as the batch shrinks: on steps
    # of a few dozen tokens the two ranks read many bins apart.

    # Step 5: A step with nothing counted
    # Every micro-batch of the step is empty (a pipeline stage that received no token, or every forward of
    # the step in eval): what each update does with the bias Eq. (14) holds.
    empty = empty_step(rules[0].bias)
    print("an update from a step with no token:")
    for name, what in empty.items():
        print(f"   {name:<44}{what}")

    # What to see: Megatron-Core keeps the bias (its update is guarded by `has_tokens`); torchtitan's estimate
    # divides an empty bin's count into zero and writes NaN on every expert, which routes every later token by
    # NaN; refimpl's updates refuse the empty step, so the trainer keeps the bias it has.

    # Step: The figure
    # Step 1's rules, step by step.
    if figures_wanted(args.out):
        plot(args.out, rules, floor)
    return {"median_max_violation": summary, "floor": float(np.median(floor[settle:])), "micro_batches": sweep,
            "rounded": rounded, "read_gaps": gaps["in bins"], "empty_step": empty}


# %%
def plot(out: Path, rules: list[Convention], floor: np.ndarray) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.6), constrained_layout=True)
    steps = np.arange(1, floor.size + 1)
    for rule in rules:
        ax.plot(steps, np.array(rule.violations), label=rule.name)
    ax.plot(steps, floor, color="0.5", linestyle="--", label="noise floor")
    ax.set_yscale("log")
    ax.set_xlabel("step (a fresh batch each)")
    ax.set_ylabel("max violation (max load / q - 1)")
    ax.legend(fontsize=8, ncol=2)
    show_figure(fig, out, "qb_as_shipped.png",
                caption="Every rule read in its own sign settles near the noise floor within a few steps; "
                        "the bias read in the other sign, or a logit-space bias added to the scores, does not.",
                alt="Max violation per step on a log scale for nine balancing rules and the noise floor")


# %%
if __name__ == "__main__":
    main()
