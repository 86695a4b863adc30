"""What every rank runs in the expert-parallel MPI tests: `mpiexec -n P python -m mpi4py tests/ep_worker.py OUT`.

All ranks build the same whole layer from one seed; rank r keeps its own
uneven shard of the tokens (`SHARDS[P]`, an empty one included) and its block
of experts. Each rank runs `ep_forward` (the right way, the padded way, the
reduce-before-norm pitfall, and a plain full-width MoE sharing the same
router) and `ep_balance_update`, and rank 0 saves what every rank returned to
`OUT` (`.npz`). The test file computes what the answers should be, in one
process and independently, and compares.
"""

from __future__ import annotations

import sys

import numpy as np

from refimpl import MoEConfig, init_params
from refimpl.layer.routing import router_scores
from refimpl.parallel import ep_balance_update, ep_forward, shard_params

#: Tokens held by each rank, by number of ranks: uneven, one rank with none.
SHARDS = {1: [61], 2: [0, 61], 4: [17, 0, 29, 15]}
SEED = 15
BINS = 200


def config(plain: bool = False) -> MoEConfig:
    """A layer with several experts per rank (n = 8: four per rank at P = 2, two at P = 4)."""
    if plain:  # a full-width MoE: no projections (l = d), no latent norm
        return MoEConfig(hidden_size=16, latent_size=16, num_experts=8, top_k=3, intermediate_size=12,
                         num_shared_experts=1, use_latent_projection=False, use_latent_norm=False)
    return MoEConfig(hidden_size=16, latent_size=8, num_experts=8, top_k=3, intermediate_size=12,
                     num_shared_experts=1)


def whole_params(plain: bool = False) -> dict[str, np.ndarray]:
    """The whole layer in float64, with a bias that makes routing uneven; the plain MoE shares the router."""
    params = dict(init_params(config(), SEED, dtype=np.float64, bias_scale=0.05))
    if plain:
        other = dict(init_params(config(plain=True), SEED + 1, dtype=np.float64))
        other["gate.weight"] = params["gate.weight"]
        other["gate.e_score_correction_bias"] = params["gate.e_score_correction_bias"]
        return other
    return params


def tokens(size: int) -> list[np.ndarray]:
    """Each rank's tokens `[m_r, d]` (float64), drawn from one stream so their union is fixed."""
    counts = SHARDS[size]
    x = np.random.default_rng(SEED).standard_normal((sum(counts), config().d))
    return np.split(x, np.cumsum(counts)[:-1])


def main(out: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x = tokens(size)[rank]
    results: dict[str, object] = {}
    for name, plain, options in (("latent", False, {}), ("padded", False, {"padded": True}),
                                 ("pitfall", False, {"reduce_before_norm": False}), ("plain", True, {})):
        params = shard_params(whole_params(plain), config(plain), rank, size)
        y, stats = ep_forward(x, params, config(plain), comm, **options)
        results[name] = (y, stats.dispatch_bytes, stats.combine_bytes, stats.routing_bytes,
                         stats.pairs_sent, stats.pairs_received, stats.expert_load)
    params = whole_params()
    scores = router_scores(x, params["gate.weight"])
    bias = ep_balance_update(scores, params["gate.e_score_correction_bias"], config().k, comm, bins=BINS)
    gathered = comm.gather((results, bias), root=0)
    if rank == 0:
        arrays: dict[str, np.ndarray] = {}
        for r, (per_rank, new_bias) in enumerate(gathered):
            arrays[f"bias_{r}"] = new_bias
            for name, (y, dispatch, combine, routing, sent, received, load) in per_rank.items():
                arrays[f"{name}_y_{r}"] = y
                arrays[f"{name}_bytes_{r}"] = np.array([dispatch, combine, routing])
                arrays[f"{name}_sent_{r}"] = sent
                arrays[f"{name}_received_{r}"] = received
                arrays[f"{name}_load_{r}"] = load
        np.savez(out, size=size, **arrays)
    comm.Barrier()


if __name__ == "__main__":
    main(sys.argv[1])
