"""What each MPI rank runs for `tests/test_train_parallel.py`.

Run as `mpiexec -n P python -m mpi4py tests/train_parallel_worker.py MODE OUT`:

* `biases`: every balancer of `BALANCERS` trains a tiny model for a few steps
  expert-parallel (an uneven batch of 126 tokens); each rank reports a digest
  of every replicated parameter it ends with and of every layer's next bias
  and load history, and rank 0 writes all ranks' reports to `OUT` (JSON).
* `vjp`: `ep_vjp` with `return_intermediates=True` and `backward(dy,
  dscores=...)` on uneven shards of 23 float64 tokens; rank 0 saves every
  rank's intermediates and gradients to `OUT` (`.npz`), for the test to hold
  against the one-process `stable_latent_moe_vjp` of the union.

Run as `mpiexec -n 2 python tests/train_parallel_worker.py fail` (no `-m
mpi4py`): the command `python -m refimpl.train --expert-parallel` trains, and
rank 1 raises at its third balancer step; the command must end the job.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
from mpi4py import MPI

from refimpl import MoEConfig, init_params
from refimpl.parallel import EXPERT_STACKS, ep_vjp, shard_params
from refimpl.train import BALANCERS, BIAS, TrainConfig, default_layer, main
from refimpl.train import expert_parallel as tp

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()

#: The tiny run of the `biases` mode.
TINY = dict(context=4, embed=4, batch=126, eval_batch=66, stats_every=2, eval_every=3, steps=4)
LAYER = dict(hidden_size=16, latent_size=8, num_experts=8, top_k=2, intermediate_size=8, num_moe_layers=2)
#: The command of the `fail` mode.
COMMAND = ["--expert-parallel", "--steps", "6", "--experts", "8", "--layers", "2", "--d", "16", "--latent", "8",
           "--intermediate", "8", "--top-k", "2", "--batch", "64", "--context", "4", "--embed", "4", "--quiet"]
#: Tokens per rank in the `vjp` mode.
SHARDS = {1: [23], 2: [9, 14], 4: [7, 3, 8, 5]}


def digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()


ORIGINAL_BALANCE = tp.ExpertParallel.balance


def recording_balance() -> dict[int, object]:
    """Wrap `ExpertParallel.balance` so that the balancers it steps are kept, in the order of the layers."""
    seen: dict[int, object] = {}

    def balance(self, balancer, scores, index, token_ids):
        seen.setdefault(id(balancer), balancer)
        return ORIGINAL_BALANCE(self, balancer, scores, index, token_ids)

    tp.ExpertParallel.balance = balance
    return seen


def replicated(name: str) -> bool:
    return not name.endswith(EXPERT_STACKS)


def biases(out: str) -> None:
    reports = {}
    for name in sorted(BALANCERS):
        batch = 128 if name == "seq" else TINY["batch"]  # the sequence-wise loss needs whole sequences of 64
        config = TrainConfig(moe=default_layer(**LAYER), balancer=name, **{**TINY, "batch": batch})
        seen = recording_balance()
        final: dict[str, np.ndarray] = {}
        log = tp.train_expert_parallel(config, COMM, final_params=final)
        held = list(seen.values())
        reports[name] = {
            "replicated": {key: digest(value) for key, value in final.items() if replicated(key)},
            "next_bias": [digest(balancer.bias) for balancer in held],
            "next_bias_values": [balancer.bias.tolist() for balancer in held],
            "loads": [digest(np.array(balancer.loads)) for balancer in held],
            "routed_bias": [digest(final[f"layers.{layer}.moe.{BIAS}"]) for layer in range(2)],
            "losses": [record["loss"] for record in log["steps"]],
        }
    everyone = COMM.gather(reports, root=0)
    if RANK == 0:
        with open(out, "w") as handle:
            json.dump(everyone, handle)


def vjp(out: str) -> None:
    config = MoEConfig(hidden_size=12, latent_size=6, num_experts=8, top_k=3, intermediate_size=5,
                       num_shared_experts=1)
    rng = np.random.default_rng(5)
    params = {name: value.astype(np.float64) for name, value in init_params(config, rng).items()}
    params[BIAS] = rng.standard_normal(config.n) * 0.1
    sizes = SHARDS[SIZE]
    x = rng.standard_normal((sum(sizes), config.d))  # [m, d], every rank draws the whole batch
    dy = rng.standard_normal((sum(sizes), config.d))
    dscores = rng.standard_normal((sum(sizes), config.n))
    first = sum(sizes[:RANK])
    mine = slice(first, first + sizes[RANK])
    result, _, backward = ep_vjp(x[mine], shard_params(params, config, RANK, SIZE), config, COMM,
                                 return_intermediates=True)
    dx, dparams = backward(dy[mine], dscores=dscores[mine])
    arrays = {"y": result.y, "scores": result.scores, "index": result.index, "u": result.u, "dx": dx,
              **{f"d:{name}": np.asarray(value) for name, value in dparams.items()}}
    everyone = COMM.gather(arrays, root=0)
    if RANK == 0:
        np.savez(out, sizes=np.array(sizes), x=x, dy=dy, dscores=dscores,
                 **{f"{rank}/{key}": value for rank, part in enumerate(everyone) for key, value in part.items()},
                 **{f"param:{name}": value for name, value in params.items()})


def fail() -> None:
    calls = []

    def balance(self, balancer, scores, index, token_ids):
        calls.append(1)
        if self.rank == 1 and len(calls) == 3:
            message = "rank 1 fails on purpose at its third balancer step"
            # Said before raising: the abort that ends the job can cut the traceback's last line from stderr.
            print(f"RuntimeError: {message}", file=sys.stderr, flush=True)
            raise RuntimeError(message)
        return ORIGINAL_BALANCE(self, balancer, scores, index, token_ids)

    tp.ExpertParallel.balance = balance
    main(COMMAND)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "biases":
        biases(sys.argv[2])
    elif mode == "vjp":
        vjp(sys.argv[2])
    elif mode == "fail":
        fail()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
