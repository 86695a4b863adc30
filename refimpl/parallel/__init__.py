r"""Expert parallelism: the layer's experts split between the ranks of an MPI job.

| module | what it holds |
|---|---|
| `refimpl.parallel.expert_parallel` | `ep_forward` and its backward `ep_vjp`: the layer of Eq. (11) with the latent all-to-all between ranks, and the Appendix D balancer across ranks |
| `refimpl.parallel.exchange` | who holds which expert, the dispatch plan, the all-to-all itself, and the agreement the ranks reach before they exchange anything |
| `refimpl.parallel.padded` | the fast path for one device: every expert in one padded batched product |

Every rank computes the stages of the one layer (`refimpl.layer.latent_moe`);
only the routed experts' part is split, and only latent vectors travel.
"""

from __future__ import annotations

from .exchange import EXPERT_STACKS, check_ranks_agree, expected_remote_ranks, expert_block, shard_params
from .expert_parallel import EPStats, ep_balance_update, ep_forward, ep_vjp
from .padded import padded_routed_experts, padding_waste

__all__ = [
    "EPStats",
    "EXPERT_STACKS",
    "check_ranks_agree",
    "ep_balance_update",
    "ep_forward",
    "ep_vjp",
    "expected_remote_ranks",
    "expert_block",
    "padded_routed_experts",
    "padding_waste",
    "shard_params",
]
