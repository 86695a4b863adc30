"""Ranks that disagree, or fail: `mpiexec -n 2 python -m mpi4py tests/disagree_worker.py CASE`.

Rank 1 departs from rank 0 in the way CASE names (the bias, `top_k`, the
number of experts, the dtype, the width of its tokens, the bias of the
balancer update, one replicated weight); or fails in the check before the first exchange with
an error of another class (`memory`, `zero`, `own`: a class of the user's own); both ranks call the function and print the error they get,
one line each, `rank R: TYPE: MESSAGE` (gathered to rank 0, which prints them,
so that the lines of two processes cannot interleave). The case `crash` makes rank 1 raise
in its own code before the exchange: the job must end (nonzero exit) instead
of rank 0 waiting for ever.
"""

from __future__ import annotations

import sys

import numpy as np

from refimpl import MoEConfig, init_params
from refimpl.parallel import ep_balance_update, ep_forward, ep_vjp, shard_params


def main(case: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    config = MoEConfig.tiny(num_experts=8, top_k=2)
    params = dict(init_params(config, 3, dtype=np.float64, bias_scale=0.1))
    x = np.random.default_rng(rank).standard_normal((5, config.d))
    if rank == 1:
        if case == "bias":
            params["gate.e_score_correction_bias"] = params["gate.e_score_correction_bias"] + 1e-9
        elif case == "top_k":
            config = config.replace(top_k=3)
        elif case == "experts":
            config = config.replace(num_experts=4)
            params = dict(init_params(config, 3, dtype=np.float64))
        elif case == "dtype":
            x = x.astype(np.float32)
        elif case == "width":
            x = x[:, :5]
        elif case == "crash":
            raise RuntimeError("rank 1 fails in its own code")
        elif case == "weights":
            params["gate.weight"] = params["gate.weight"].copy()
            params["gate.weight"][0, 0] += 1e-12
        elif case in ("memory", "zero", "own"):
            import refimpl.parallel.expert_parallel as ep

            error = {"memory": MemoryError("no room for the histogram"),
                     "zero": ZeroDivisionError("float division by zero"),
                     "own": type("PortError", (Exception,), {})("a class of the user's own")}[case]

            def failing(*args, **kwargs):
                raise error

            ep.BiasHistogram = failing if case == "memory" else ep.BiasHistogram
            ep.check_ep_inputs = failing if case != "memory" else ep.check_ep_inputs
    try:
        if case in ("balance", "memory"):
            bias = np.zeros(8) if rank == 0 else np.full(8, 0.5)
            ep_balance_update(np.random.default_rng(rank).random((20, 8)), bias, 2, comm, bins=50)
        elif case == "vjp":
            x = x if rank == 0 else x[:, :5]
            ep_vjp(x, shard_params(params, config, rank, size), config, comm)
        else:
            ep_forward(x, shard_params(params, config, rank, size), config, comm)
        line = f"rank {rank}: no error"
    except Exception as exc:  # noqa: BLE001 - every class of error is reported the same way on every rank
        line = f"rank {rank}: {type(exc).__name__}: {exc}"
    lines = comm.gather(line, root=0)
    if rank == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
