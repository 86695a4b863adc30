r"""Training over MPI: the experts and the batch split between the ranks of a job.

$$
\mathcal L = \frac1m \sum_{p=0}^{P-1} \sum_{i \in \mathcal B_p} \ell_i,
\qquad
\nabla_\theta \mathcal L = \sum_{p=0}^{P-1} \nabla_\theta \mathcal L^{(p)}
\quad\text{(replicated } \theta\text{)},
\qquad
\nabla_{W_e} \mathcal L \text{ whole on the rank that holds } e .
$$

`mpiexec -n P python -m refimpl.train --expert-parallel ...` trains the
model of `refimpl.train` with $P$ ranks, and computes the same run: the
same weights drawn from the same seed, the same batches, the same losses to
rounding. What changes is where each number is computed.

**The layout.** Every rank draws the whole model from the run's seed and
keeps its part: the experts $[r\,n/P, (r+1)\,n/P)$ of every MoE layer (the
expert stacks), and everything else whole, replicated (the byte embedding,
the mixing matrix, the norms, the output layer, and in every MoE layer the
router, the two latent projections, the latent norm and the shared experts).
Every rank draws the whole batch of $m$ positions from the same generator
and keeps its rows $\mathcal B_p$, consecutive, $\lceil m/P \rceil$ or
$\lfloor m/P \rfloor$ of them (uneven slices are fine).

**One step.** The step is the one-process step, `refimpl.train.forward_backward`,
unchanged: it asks a `refimpl.train.Ranks` object every question whose
answer depends on more than one process holds, and `ExpertParallel`
answers them across the ranks:

| the step asks | one process | `ExpertParallel` |
|---|---|---|
| the layer, forward and backward | `stable_latent_moe_vjp` | `refimpl.parallel.expert_parallel.ep_vjp`: the tokens' latents travel to the experts' ranks and back (two `Alltoallv`), the gradients the same way transposed |
| the loss and $\partial\mathcal L/\partial\,\text{logits}$ | the batch mean | each rank's sum, added in rank order, over $m$ |
| the replicated parameters' gradients | those of the batch | each rank's share, summed: `Reduce` to rank 0, then `Bcast` |
| the experts' gradients | those of the batch | each rank's own block, already whole |
| the balancer's step | `balancer.step` | the statistics of the whole batch (below), then `balancer.advance` |
| an auxiliary loss | of the batch | of the whole batch, gathered; each rank keeps its rows of the gradient |
| "is it finite?", the largest activation, the means | of the batch | over every rank (`allgather`) |

Adam then runs on every rank over what the rank holds: the replicated
parameters, whose gradients are the same bits on every rank (rank 0's sum,
broadcast), so their updates are the same bits too; and the rank's own
experts, which no other rank has.

**The balancer, across ranks.** The bias routes every rank's tokens, so it
must be the same on every rank, bit for bit: each layer's `ep_vjp` checks
it (a digest of the bias is part of what the ranks agree on before the
first exchange) and stops the job the step it is not. Each balancer's rule
is computed from statistics of the *whole* batch that every rank receives
identically, so every rank computes the same next bias from the same
numbers:

| balancer | what the ranks share | then every rank computes |
|---|---|---|
| `qb` | every score and route, gathered in rank order ($m \times n$ numbers) | Eq. (14), the exact quantiles of the whole batch |
| `qb-hist` | the $n \times B$ histogram counts, one integer `Allreduce` (`ep_balance_update`) | the quantiles of Appendix D |
| `sign`, `seq` | the loads, one integer `Allreduce` | the sign rule |
| `none`, `aux`, `capacity-*`, `hash` | nothing | the bias they hold (it does not follow the batch) |

Integer sums do not depend on the order of addition, and the gathered
scores reach every rank in the same order, so no floating-point reduction
stands between two ranks' biases. The loads every balancer records (and the
log's violations) are those of the whole batch, one more integer
`Allreduce`. The auxiliary losses (`aux`, `seq`) gather the scores and
routes too, since DeepSeek's sequences are consecutive positions of the
whole batch; each rank keeps its rows of the loss's gradient. A capacity
already serves in the order of the whole batch (`ep_forward` gathers the
routes); hash routing needs only each rank's own token ids. A balancer
whose kind has no rule here is refused by name before the first step.

**The same run as one process.** The losses equal those of the one-process
run with the same seed and batch to rounding: the ranks add the same
numbers in other orders (a matrix product over a slice of the batch, the
partial sums of the combine, the rank-ordered sum of the loss and the
gradients), some $10^{-7}$ relative in float32 per step. A balancer's route
flips only where two experts' biased scores tie to that rounding; the tests
hold the logged losses of two and four ranks (uneven slices) to the
one-process log to $10^{-5}$ relative, and every rank's bias to every
other's, bit for bit.

**What the log adds.** Rank 0 writes the log, in the one-process format and
with the same atomic, strict-JSON writer. Each step's record adds
`rank_load`, per layer, the slots each rank's experts computed (its $L_p$),
and `rank_seconds`, per stage, each rank's time summed over the layers:
`dispatch` (the counts and the three dispatch exchanges, waiting for the
slowest rank included), `experts` (and `experts cpu`, the processor time
they took, which other jobs on a shared machine do not inflate), `combine`
(where a rank that finished its experts early waits for the others),
`backward experts`, `backward exchanges`. The log's `expert_parallel` says how the run was split and sums
them over the run: this is "balance is speed" measured in a training step,
where the most loaded rank sets the pace of the step and the others wait in
the next exchange.

**What the ranks check.** Before the first exchange the ranks agree (one
`allgather`, `refimpl.parallel.exchange.check_ranks_agree`) on the whole
configuration (seed included), the corpus and the number of ranks, and
share any error a rank met checking its own arguments; every rank then
raises the same error, naming the rank and the values, rather than some
ranks waiting for others that have stopped. $P$ must divide $n$, and the
training and held-out batches must give every rank at least one token. A
rank that fails during the run ends the job: the command calls `Abort`, so
no rank waits for ever in an exchange (a script of your own that calls
`train_expert_parallel` gets the same from `python -m mpi4py script.py`).

**What is not here.** Checkpoints: `--checkpoint` and `--resume` are for a
run on one process, and `--expert-parallel` refuses them by name. A router
that diverges until its scores underflow to zero (the one-process loop skips
such steps) ends an expert-parallel job with the layer's error, since the
other ranks are already in the exchange. The exchanges run on host buffers,
without overlap with computation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..balancing import Balancer, BalanceStep, sign_balancing_update
from ..config import MoEConfig
from ..layer.latent_moe import MoEOutput
from ..layer.routing import expert_load
from ..parallel import (
    EXPERT_STACKS,
    EPStats,
    check_ranks_agree,
    ep_balance_update,
    ep_forward,
    ep_vjp,
    expert_block,
)
from .config import BALANCERS, TrainConfig
from .data import Corpus, load_corpus
from .loop import train
from .model import cross_entropy
from .step import Ranks

__all__ = ["BALANCE_ACROSS_RANKS", "ExpertParallel", "batch_rows", "check_expert_parallel", "train_expert_parallel",
           "world"]

#: The times a step's record reports, per rank and summed over the layers: the stages of `EPStats.seconds`
#: (forward, then backward), and `experts cpu`, the processor time of the forward's experts
#: (`EPStats.expert_cpu_seconds`), which other jobs on a shared machine do not inflate.
STAGES = ("dispatch", "experts", "experts cpu", "combine", "backward experts", "backward exchanges")


def _seconds(stats: EPStats, stage: str) -> float:
    return stats.expert_cpu_seconds if stage == "experts cpu" else stats.seconds.get(stage, 0.0)


def world() -> Any:
    """`MPI.COMM_WORLD` (importing mpi4py starts MPI; a process started without `mpiexec` is one rank)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


# ---------------------------------------------------------------------------
# The balancers' rules across ranks
# ---------------------------------------------------------------------------

#: A rule's signature: `(ranks, balancer, scores, bias, index, load) -> next bias [n]`, where `scores` `[m_r, n]`
#: and `index` `[m_r, k]` are this rank's rows, `bias` the bias that routed them, `load` `[n]` the whole batch's.
Rule = Callable[["ExpertParallel", Balancer, np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def _quantiles_of_the_whole_batch(ranks: ExpertParallel, balancer: Balancer, scores: np.ndarray, bias: np.ndarray,
                                  index: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Eq. (14) reads every expert's quantile of the whole batch: every score, gathered in rank order."""
    return balancer.next_bias(ranks.gather_rows(scores), bias, ranks.gather_rows(index))


def _histogram_counts(ranks: ExpertParallel, balancer: Balancer, scores: np.ndarray, bias: np.ndarray,
                      index: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Appendix D: each rank counts its own scores, one integer `Allreduce` of the $n \\times B$ histogram."""
    return ep_balance_update(scores, bias, balancer.top_k, ranks.comm, bins=balancer.bins)


def _signs_of_the_loads(ranks: ExpertParallel, balancer: Balancer, scores: np.ndarray, bias: np.ndarray,
                        index: np.ndarray, load: np.ndarray) -> np.ndarray:
    r"""The sign rule reads only the loads of the whole batch: $$b_j \leftarrow b_j + \gamma\,\operatorname{sign}(q - \text{load}_j)$$"""
    return sign_balancing_update(load, bias, balancer.rate)


def _held(ranks: ExpertParallel, balancer: Balancer, scores: np.ndarray, bias: np.ndarray,
          index: np.ndarray, load: np.ndarray) -> np.ndarray:
    """A bias that does not follow the batch: the balancer's own rule, on this rank's rows, gives it."""
    return balancer.next_bias(scores, bias, index)


#: How each kind of balancer computes its next bias across ranks, by `Balancer.kind`. A kind missing here
#: cannot train expert-parallel, and a run with it is refused before its first step.
BALANCE_ACROSS_RANKS: dict[str, Rule] = {
    "qb": _quantiles_of_the_whole_batch,
    "qb-hist": _histogram_counts,
    "sign": _signs_of_the_loads,
    "seq": _signs_of_the_loads,
    "none": _held,
    "aux": _held,
    "capacity": _held,
    "hash": _held,
}


# ---------------------------------------------------------------------------
# The step's questions, answered across ranks
# ---------------------------------------------------------------------------

class ExpertParallel(Ranks):
    """The ranks of `comm`, each holding its block of experts and its slice of every batch (see the module text).

    Every method is collective: every rank calls it, in the same order, as
    the training step does. `stats` holds the `EPStats` of the layers run
    since the last `step_record()`.
    """

    def __init__(self, comm: Any, config: TrainConfig) -> None:
        self.comm = comm
        self.size, self.rank = int(comm.Get_size()), int(comm.Get_rank())
        self.config = config
        self.experts = expert_block(config.moe.num_experts, self.size, self.rank)  # (start, stop)
        self.stats: list[EPStats] = []

    # -- what this rank holds -----------------------------------------------------

    def shard(self, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every parameter whole, except each layer's expert stacks, cut to this rank's block (copies)."""
        start, stop = self.experts
        return {name: value[start:stop].copy() if _is_expert_stack(name) else value
                for name, value in params.items()}

    def rows(self, m: int) -> slice:
        return batch_rows(m, self.size, self.rank)

    # -- the layer -------------------------------------------------------------------

    def layer_vjp(self, x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
                  token_ids: np.ndarray | None) -> tuple[MoEOutput, Callable]:
        """`ep_vjp` on this rank's rows and experts; its `EPStats` are kept for the step's record."""
        out, stats, backward = ep_vjp(x, params, config, self.comm, token_ids=token_ids, return_intermediates=True)
        self.stats.append(stats)
        return out, backward

    def layer(self, x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
              token_ids: np.ndarray | None) -> np.ndarray:
        return ep_forward(x, params, config, self.comm, token_ids=token_ids)[0]

    # -- the balancer ------------------------------------------------------------------

    def balance(self, balancer: Balancer, scores: np.ndarray, index: np.ndarray,
                token_ids: np.ndarray | None) -> BalanceStep:
        """The balancer's step on the whole batch: its loads (an integer sum), its rule across ranks, `advance`."""
        # $$\text{load}_j = \sum_p \text{load}^{(p)}_j$$, exact in integers
        load = self.sum_counts(np.asarray(expert_load(index, balancer.num_experts), dtype=np.int64))  # [n]
        rule = BALANCE_ACROSS_RANKS[balancer.kind]
        next_bias = rule(self, balancer, scores, balancer.bias, index, load)  # [n], the same bits on every rank
        return balancer.advance(index, load, next_bias)

    def auxiliary(self, balancer: Balancer, scores: np.ndarray, index: np.ndarray) -> tuple[float, np.ndarray]:
        """The auxiliary loss of the whole batch (gathered in rank order) and this rank's rows of its gradient."""
        whole_scores, whole_index = self.gather_rows(scores), self.gather_rows(index)  # [m, n], [m, k]
        value, grad = balancer.auxiliary(whole_scores, whole_index)
        return value, grad[self.rows(whole_scores.shape[0])]  # [m_r, n]

    # -- reductions over the whole batch -----------------------------------------------

    def gather_rows(self, x: np.ndarray) -> np.ndarray:
        """Every rank's rows of `x`, concatenated in rank order: the whole batch's, the same on every rank."""
        return np.concatenate(self.comm.allgather(np.ascontiguousarray(x)), axis=0)

    def sum_counts(self, counts: np.ndarray) -> np.ndarray:
        """Integer counts summed over the ranks (one `Allreduce`; integer sums do not depend on the order)."""
        from mpi4py import MPI

        total = np.ascontiguousarray(counts, dtype=np.int64).copy()
        self.comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return total

    def _ordered_sum(self, value: float) -> float:
        """A number summed over the ranks in rank order, on every rank alike."""
        return sum(self.comm.allgather(float(value)))

    def all(self, flag: bool) -> bool:
        return all(self.comm.allgather(bool(flag)))

    def max(self, value: float) -> float:
        return max(self.comm.allgather(float(value)))

    def mean(self, values: np.ndarray) -> float:
        """The mean of every rank's `values` together: the sums and the counts added in rank order."""
        parts = self.comm.allgather((float(np.sum(values, dtype=np.float64)), int(np.size(values))))
        return sum(total for total, _ in parts) / sum(count for _, count in parts)

    def cross_entropy(self, logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        r"""The mean loss over the whole batch, and this rank's rows of its gradient.

        $$\mathcal L = \frac1m \sum_p m_p\,\mathcal L^{(p)}, \qquad
        \frac{\partial \mathcal L}{\partial z_i} = \frac{m_p}{m}\,\frac{\partial \mathcal L^{(p)}}{\partial z_i}$$
        """
        loss, dlogits = cross_entropy(logits, targets)  # the mean over this rank's m_p rows
        m_p = logits.shape[0]
        parts = self.comm.allgather((loss * m_p, m_p))
        m = sum(count for _, count in parts)
        return sum(total for total, _ in parts) / m, dlogits * np.float32(m_p / m)

    def gradients(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        r"""The replicated parameters' gradients summed over the ranks; the expert blocks' as they are.

        $$\bar\theta = \sum_p \bar\theta^{(p)}$$ in float64, on rank 0 (`Reduce`), whose
        result every rank then receives (`Bcast`): the same bits on every rank, so
        Adam moves every copy of a replicated parameter alike.
        """
        from mpi4py import MPI

        shared = [name for name in sorted(grads) if not _is_expert_stack(name)]
        flat = np.concatenate([np.asarray(grads[name], dtype=np.float64).reshape(-1) for name in shared])
        if self.rank == 0:
            self.comm.Reduce(MPI.IN_PLACE, flat, op=MPI.SUM, root=0)
        else:
            self.comm.Reduce(flat, None, op=MPI.SUM, root=0)
        self.comm.Bcast(flat, root=0)
        summed = dict(grads)
        offset = 0
        for name in shared:
            value = np.asarray(grads[name])
            summed[name] = flat[offset:offset + value.size].reshape(value.shape).astype(value.dtype)
            offset += value.size
        return summed

    def sum_of_squares(self, grads: Mapping[str, np.ndarray]) -> float:
        """The squared norm of all gradients: the replicated ones once, every rank's expert blocks added in rank order."""
        def squares(names: list[str]) -> float:
            return sum(float(np.sum(grads[name].astype(np.float64) ** 2)) for name in names)

        replicated = squares([name for name in grads if not _is_expert_stack(name)])
        return replicated + self._ordered_sum(squares([name for name in grads if _is_expert_stack(name)]))

    # -- the log -------------------------------------------------------------------------

    def step_record(self) -> dict[str, Any]:
        """Each rank's load per layer and its time per stage (summed over the layers) for this step's record."""
        mine = ([stats.load for stats in self.stats],
                {stage: sum(_seconds(stats, stage) for stats in self.stats) for stage in STAGES})
        everyone = self.comm.allgather(mine)
        self.stats = []
        layers = len(everyone[0][0])
        return {"rank_load": [[loads[layer] for loads, _ in everyone] for layer in range(layers)],
                "rank_seconds": {stage: [seconds[stage] for _, seconds in everyone] for stage in STAGES}}


def batch_rows(m: int, size: int, rank: int) -> slice:
    """The consecutive rows of a batch of `m` that rank `rank` of `size` holds: the first `m mod P` hold one more."""
    base, extra = divmod(m, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def _is_expert_stack(name: str) -> bool:
    """Whether the model parameter `name` (`layers.3.moe.experts.w1`) is an expert stack, split between ranks."""
    return name.endswith(tuple(f".{stack}" for stack in EXPERT_STACKS))


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

def _flat(record: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """A nested configuration record as `{"config.moe.top_k": 2, ...}`."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_expert_parallel(config: TrainConfig | None, comm: Any, *, corpus: Corpus | None = None,
                          error: BaseException | None = None) -> None:
    """Before the first exchange: the ranks of `comm` must run the same run, one they can split.

    Checks on this rank that $P$ divides the number of experts, that the
    training and held-out batches give every rank a token, and that the
    balancer has a rule across ranks (`BALANCE_ACROSS_RANKS`); then one
    `allgather` of the whole configuration, the corpus's digest and the
    number of ranks, with this rank's `error` (one it met before, e.g. in its
    arguments; `config` may then be None). Every rank raises the same
    `ValueError` (or `TypeError`) when a rank failed or two ranks disagree.
    Call it on every rank.
    """
    size = int(comm.Get_size())
    fingerprint: dict[str, Any] = {}
    if error is None:
        try:
            if not isinstance(config, TrainConfig):
                raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
            n = config.moe.num_experts
            if n % size:
                raise ValueError(f"the number of ranks P={size} must divide the number of experts n={n} "
                                 f"(--experts): each rank holds a block of n/P experts")
            for name, flag in (("batch", "--batch"), ("eval_batch", "the held-out batch")):
                if getattr(config, name) < size:
                    raise ValueError(f"{flag} ({getattr(config, name)} tokens) must give each of the {size} ranks "
                                     "at least one token")
            kind = BALANCERS[config.balancer](config).kind
            if kind not in BALANCE_ACROSS_RANKS:
                able = sorted(name for name, build in BALANCERS.items() if build(config).kind in BALANCE_ACROSS_RANKS)
                raise ValueError(f"the balancer {config.balancer!r} (a {kind!r} balancer) has no rule across "
                                 f"ranks, so it cannot train expert-parallel; those that have one: {able}")
        except (TypeError, ValueError) as exc:
            error = exc
    if error is None:
        fingerprint = {**_flat(config.to_record(), "config."), "ranks": size,
                       "corpus sha256": None if corpus is None else corpus.sha256}
    check_ranks_agree(comm, "expert-parallel training", fingerprint, error)


def train_expert_parallel(config: TrainConfig, comm: Any = None, *, corpus: Corpus | None = None,
                          progress: bool = False, log: Callable[[str], None] | None = None,
                          final_params: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Train `config` over the ranks of `comm` (default `MPI.COMM_WORLD`); call it on every rank.

    Returns the log of `refimpl.train.train` on every rank, each step's
    record with `rank_load` and `rank_seconds`, and `expert_parallel`: the
    number of ranks, the experts and rows each holds, and the loads and
    times summed over the run. `progress` and `log` apply on rank 0 only;
    `final_params`, if a dict, receives this rank's parameters (its expert
    blocks, the rest whole). Raises the same error on every rank if the
    ranks disagree or cannot split the run (`check_expert_parallel`).
    """
    comm = world() if comm is None else comm
    corpus = load_corpus() if corpus is None else corpus
    check_expert_parallel(config, comm, corpus=corpus)
    ranks = ExpertParallel(comm, config)
    writer = ranks.rank == 0
    started = time.perf_counter()
    result = train(config, corpus=corpus, progress=progress and writer, log=log if writer else None,
                   final_params=final_params, ranks=ranks)
    result["expert_parallel"] = _run_summary(ranks, result["steps"], time.perf_counter() - started)
    return result


def _run_summary(ranks: ExpertParallel, records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """How the run was split, and each rank's load and time summed over its steps."""
    config, size = ranks.config, ranks.size
    per_rank = config.moe.num_experts // size
    loads = np.array([record["rank_load"] for record in records if record["rank_load"]],
                     dtype=np.float64)  # [steps, L, P]
    # How much longer the most loaded rank worked than the average one, per layer and step: $$\max_p L_p / \bar L$$
    ratio = loads.max(axis=2) / np.maximum(loads.mean(axis=2), 1e-300) if loads.size else np.zeros(0)
    rows = [batch_rows(config.batch, size, rank) for rank in range(size)]
    return {
        "ranks": size,
        "experts": [[rank * per_rank, (rank + 1) * per_rank] for rank in range(size)],
        "batch_rows": [part.stop - part.start for part in rows],
        "rank_load": loads.sum(axis=(0, 1)).astype(np.int64).tolist() if loads.size else [0] * size,
        "rank_seconds": {stage: [sum(record["rank_seconds"][stage][rank] for record in records)
                                 for rank in range(size)] for stage in STAGES},
        "mean_max_over_mean_load": float(ratio.mean()) if ratio.size else 1.0,
        "seconds": seconds,
    }
