"""The layers every path must compute alike, and what each MPI rank runs of them.

`LAYERS` names one small float64 layer per configuration that the forward
accepts and that the expert-parallel, backward and training paths must
reproduce: the three score functions, renormalization off, two capacity
factors, hash routing, expert groups, top-1 with a scale and no norm, a
plain MoE with SwiGLU, no shared expert with the up branch uncapped,
Nemotron-H's ungated squared ReLU on a latent with its own shared width, and
every preset of `MoEConfig` at a small width.

Run as `mpiexec -n P python -m mpi4py tests/one_layer_worker.py OUT`: every
rank builds the same whole layers from one seed, keeps its uneven shard of
the tokens (`SHARDS[P]`, an empty one included) and its block of experts,
runs `ep_forward` grouped and padded and `ep_vjp` with its backward, and
rank 0 saves every rank's results to `OUT` (`.npz`). `tests/test_one_layer.py` computes the single-process
layer on the union of the tokens and compares.
"""

from __future__ import annotations

import sys

import numpy as np

from refimpl import MoEConfig, init_params

#: Tokens held by each rank, by number of ranks: uneven, one rank with none.
SHARDS = {1: [23], 2: [0, 23], 4: [7, 0, 11, 5]}
SEED = 31

# Small sizes shared by every layer: eight experts, so that 1, 2 and 4 ranks all divide them.
_SMALL = dict(hidden_size=12, latent_size=6, num_experts=8, top_k=3, intermediate_size=5, num_shared_experts=1,
              num_moe_layers=1)


# The DeepSeek-V4 presets count three MoE layers (their three hash-routed layers) and have no latent.
_PLAIN = {key: value for key, value in _SMALL.items() if key != "num_moe_layers"} | {"latent_size": 12}


#: name -> layer configuration (the presets with their own switches, at the small sizes).
LAYERS: dict[str, MoEConfig] = {
    "sigmoid": MoEConfig(**_SMALL),
    "softmax": MoEConfig(**_SMALL, score_function="softmax"),
    "sqrtsoftplus": MoEConfig(**_SMALL, score_function="sqrtsoftplus"),
    "softmax, not renormalized": MoEConfig(**_SMALL, score_function="softmax", renormalize=False),
    "capacity 0.5": MoEConfig(**_SMALL, capacity_factor=0.5),
    "capacity 1.25": MoEConfig(**_SMALL, capacity_factor=1.25),
    "hash routing": MoEConfig(**_SMALL, hash_routing=True),
    "4 groups, best 2": MoEConfig(**_SMALL, n_group=4, topk_group=2),
    "top-1, scale 2.5, no norm": MoEConfig(**{**_SMALL, "top_k": 1}, renormalize=False, routed_scaling_factor=2.5,
                                           use_latent_norm=False),
    "no latent, SwiGLU": MoEConfig(**{**_SMALL, "latent_size": 12}, use_latent_projection=False,
                                   use_latent_norm=False, activation="swiglu"),
    "no shared expert, uncapped up branch": MoEConfig(**{**_SMALL, "num_shared_experts": 0},
                                                      situ_linear_beta=None),
    "Nemotron-H: relu2, latent without norm, own shared width": MoEConfig(
        **_SMALL, activation="relu2", use_latent_norm=False, situ_linear_beta=None, shared_intermediate_size=7),
    "DeepSeek-V4: SwiGLU clamped at 0.5, sqrt-softplus": MoEConfig(
        **{**_SMALL, "latent_size": 12}, use_latent_projection=False, use_latent_norm=False, activation="swiglu",
        situ_linear_beta=None, swiglu_limit=0.5, score_function="sqrtsoftplus", routed_scaling_factor=1.5),
    "preset k3": MoEConfig.k3().replace(**_SMALL),
    "preset tiny": MoEConfig.tiny(num_experts=8),
    "preset small": MoEConfig.small(**_SMALL),
    "preset deepseek_v3": MoEConfig.deepseek_v3(**{**_SMALL, "latent_size": 12}, n_group=4, topk_group=2),
    "preset deepseek_v4_flash": MoEConfig.deepseek_v4_flash(**_PLAIN),
    "preset deepseek_v4_flash, hash layer": MoEConfig.deepseek_v4_flash(**_PLAIN, hash_routing=True),
    "preset deepseek_v4_pro": MoEConfig.deepseek_v4_pro(**_PLAIN),
}


def layer(name: str) -> tuple[MoEConfig, dict[str, np.ndarray]]:
    """The configuration and whole float64 weights of a layer, with a bias that makes routing uneven."""
    config = LAYERS[name]
    params = dict(init_params(config, SEED, dtype=np.float64, bias_scale=0.05))
    return config, params


def tokens(size: int, d: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each rank's tokens `[m_r, d]` and token ids `[m_r]`, drawn from one stream so their union is fixed."""
    counts = SHARDS[size]
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((sum(counts), d))
    ids = rng.integers(0, 256, size=sum(counts))
    cut = np.cumsum(counts)[:-1]
    return np.split(x, cut), np.split(ids, cut)


def upstream(size: int, d: int) -> list[np.ndarray]:
    """Each rank's upstream gradient `[m_r, d]`, from one stream like the tokens."""
    counts = SHARDS[size]
    dy = np.random.default_rng(SEED + 1).standard_normal((sum(counts), d))
    return np.split(dy, np.cumsum(counts)[:-1])


def main(out: str) -> None:
    from mpi4py import MPI

    from refimpl.parallel import ep_forward, ep_vjp, shard_params

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    results: dict[str, np.ndarray] = {}
    for number, name in enumerate(LAYERS):
        config, params = layer(name)
        xs, ids = tokens(size, config.d)
        mine = shard_params(params, config, rank, size)
        token_ids = ids[rank] if config.hash_routing else None
        for padded in (False, True):
            y, _ = ep_forward(xs[rank], mine, config, comm, padded=padded, token_ids=token_ids)
            results[f"{number}_{int(padded)}"] = y
        # The backward: an upstream gradient drawn from one stream too, this rank's rows of it.
        y, _, backward = ep_vjp(xs[rank], mine, config, comm, token_ids=token_ids)
        dy = upstream(size, config.d)[rank]
        dx, dparams = backward(dy)
        results[f"{number}_vjp_y"] = y
        results[f"{number}_vjp_dx"] = dx
        for key, grad in dparams.items():
            results[f"{number}_vjp_d:{key}"] = np.asarray(grad)
    gathered = comm.gather(results, root=0)
    if rank == 0:
        np.savez(out, size=size, **{f"{key}_{r}": y for r, per_rank in enumerate(gathered)
                                    for key, y in per_rank.items()})
    comm.Barrier()


if __name__ == "__main__":
    main(sys.argv[1])
