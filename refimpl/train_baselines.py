r"""The other balancers in the training loop: auxiliary losses, capacity with dropping, hash routing.

`refimpl.train` keeps a table of balancers, each an object with
`Balancer.step(scores) -> BalanceStep` that routes a layer's batch and holds
its bias. The rules of the page "The other routers and balancers" join that
table here, so that they train the same model on the same data as Quantile
Balancing and the sign rule:

| name | rule | bias |
|---|---|---|
| `aux` | the expert-level auxiliary loss $a \cdot n\sum_i f_i P_i$ over the batch, $a = 10^{-2}$ (Switch's coefficient) | stays zero |
| `seq` | DeepSeek-V3: the sign rule **and** the sequence-wise loss at $10^{-4}$ | sign rule, $\gamma = 10^{-3}$ |
| `capacity-1.0`, `capacity-1.25` | capacity $C = \lceil c\,mk/n \rceil$, overflow dropped (no other balancing) | stays zero |
| `hash` | DeepSeek-V4's hash routing on the token being read, in every layer | unused |

Three hooks of the training step serve them, and each is a plain attribute
of the balancer object, absent from the original four:

* `layer_changes`: fields of `MoEConfig` the layer runs with (the capacity
  factor, hash routing);
* `needs_token_ids`: the step hands the layer's token ids (the last byte of
  each context, the token the position reads) to the balancer and the layer;
* `auxiliary(scores, index) -> (value, dscores)`: an auxiliary loss and its
  gradient in the router scores; the step adds `coefficient * value` to the
  objective and carries `coefficient * dscores` into the router's weight and
  the layer's input.

In the auxiliary losses $f$ counts the chosen experts (no gradient) and
$P$ averages the router's sigmoid scores normalized per token to sum to one,
the form DeepSeek uses; with one "sequence" spanning the batch it is the
batch-level expert balance loss. The training batch holds $m$ positions
drawn independently from the corpus, so the "sequences" of the sequence-wise
loss are consecutive groups of `seq_len` positions of the batch, not
sentences: a limitation of this comparison, which makes the sequence-wise
loss a noisier batch loss.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .balancing import Balancer, SignBalancer
from .baselines import hash_route, sequence_balance_loss, sequence_balance_loss_grad
from .routing import route

__all__ = ["AuxLossBalancer", "CapacityBalancer", "HashBalancer", "SequenceLossBalancer"]

#: Switch Transformer's auxiliary-loss coefficient.
AUX_COEFFICIENT = 1e-2
#: DeepSeek-V3's sequence-wise balance factor.
SEQUENCE_COEFFICIENT = 1e-4
#: Positions per "sequence" of the sequence-wise loss.
SEQUENCE_LENGTH = 64


class AuxLossBalancer(Balancer):
    """Balancing by an auxiliary loss alone: the bias stays zero, the router's gradient does the work."""

    kind = "aux"

    def __init__(self, num_experts: int, top_k: int, *, coefficient: float = AUX_COEFFICIENT,
                 seq_len: int | None = None, bias: Any = None) -> None:
        super().__init__(num_experts, top_k, bias=bias)
        self.coefficient = coefficient
        self.seq_len = seq_len  # None: the whole batch is one group

    def _route_and_update(self, scores: Any, bias: Any) -> tuple[Any, Any]:
        index, _ = route(scores, bias, self.top_k)  # [m, k]
        return index, bias

    def auxiliary(self, scores: np.ndarray, index: np.ndarray) -> tuple[float, np.ndarray]:
        r"""$\sum_i f_i P_i$ (averaged over groups) and its gradient in the scores, `[m, n]`."""
        m = scores.shape[0]
        seq_len = m if self.seq_len is None else self.seq_len
        if m % seq_len:
            raise ValueError(f"seq_len={seq_len} must divide the batch of {m} positions")
        value = sequence_balance_loss(scores, index, self.num_experts, seq_len)
        return value, sequence_balance_loss_grad(scores, index, self.num_experts, seq_len)


class SequenceLossBalancer(SignBalancer):
    """DeepSeek-V3's recipe: the sign rule moves the bias, a tiny sequence-wise loss acts inside sequences."""

    kind = "seq"

    def __init__(self, num_experts: int, top_k: int, *, rate: float = 1e-3,
                 coefficient: float = SEQUENCE_COEFFICIENT, seq_len: int = SEQUENCE_LENGTH,
                 bias: Any = None) -> None:
        super().__init__(num_experts, top_k, rate=rate, bias=bias)
        self.coefficient = coefficient
        self.seq_len = seq_len

    auxiliary = AuxLossBalancer.auxiliary


class CapacityBalancer(Balancer):
    """No bias; the layer serves at most $C = \\lceil c\\,mk/n \\rceil$ assignments per expert and drops the rest."""

    kind = "capacity"

    def __init__(self, num_experts: int, top_k: int, *, capacity_factor: float, bias: Any = None) -> None:
        super().__init__(num_experts, top_k, bias=bias)
        self.layer_changes = {"capacity_factor": capacity_factor}

    def _route_and_update(self, scores: Any, bias: Any) -> tuple[Any, Any]:
        index, _ = route(scores, bias, self.top_k)  # [m, k]
        return index, bias


class HashBalancer(Balancer):
    """Hash routing: the experts are a fixed function of the token id; nothing is balanced or learned."""

    kind = "hash"
    needs_token_ids = True

    def __init__(self, num_experts: int, top_k: int, *, bias: Any = None) -> None:
        super().__init__(num_experts, top_k, bias=bias)
        self.layer_changes = {"hash_routing": True}
        self.token_ids: np.ndarray | None = None

    def _route_and_update(self, scores: Any, bias: Any) -> tuple[Any, Any]:
        if self.token_ids is None:
            raise ValueError("HashBalancer needs the batch's token_ids before step()")
        return hash_route(self.token_ids, self.num_experts, self.top_k), bias
