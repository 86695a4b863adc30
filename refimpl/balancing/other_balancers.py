r"""The other balancers in the training loop: auxiliary losses, capacity with dropping, hash routing.

`refimpl.train` keeps a table of balancers, each a `refimpl.balancing.Balancer`
that holds a layer's bias from step to step. The rules of the page "The other routers and balancers" join that
table here, so that they train the same model on the same data as Quantile
Balancing and the sign rule:

| name | rule | bias |
|---|---|---|
| `aux` | the expert-level auxiliary loss $a \cdot n\sum_i f_i P_i$ over the batch, $a = 10^{-2}$ (Switch's coefficient) | stays zero |
| `seq` | DeepSeek-V3: the sign rule **and** the sequence-wise loss at $10^{-4}$ | sign rule, $\gamma = 10^{-3}$ |
| `capacity-1.0`, `capacity-1.25` | capacity $C = \lceil c\,mk/n \rceil$, overflow dropped (no other balancing) | stays zero |
| `hash` | DeepSeek-V4's hash routing on the token being read, in every layer | unused |

Each is a `refimpl.balancing.Balancer` and declares, through that one
interface, what it changes in the training step:

* `layer_config(config)`: the layer it balances (the capacity rules set
  `capacity_factor`, the hash rule `hash_routing`), computed once per step
  by the loop and run by the layer's own forward and backward;
* `needs_token_ids`: the hash rule routes by the token being read (the last
  byte of each context), so the loop hands those ids to the layer;
* `coefficient` and `auxiliary(scores, index) -> (value, dscores)`: an
  auxiliary loss and its gradient in the router scores; the step adds
  `coefficient * value` to the objective and hands `coefficient * dscores`
  to the layer's backward (`backward(dy, dscores=...)`), which carries it to
  the router's weight and the layer's input.

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

from .._lib.validation import check_int, check_positive
from .._lib.xp import Array
from ..config import MoEConfig
from ..layer.baselines import hash_route, sequence_balance_loss, sequence_balance_loss_grad
from .balancer import Balancer
from .quantile import SignBalancer

__all__ = ["AuxLossBalancer", "CapacityBalancer", "HashBalancer", "SequenceLossBalancer"]

#: Switch Transformer's auxiliary-loss coefficient.
AUX_COEFFICIENT = 1e-2
#: DeepSeek-V3's sequence-wise balance factor.
SEQUENCE_COEFFICIENT = 1e-4
#: Positions per "sequence" of the sequence-wise loss.
SEQUENCE_LENGTH = 64


def _check_sequences(m: int, seq_len: int | None) -> None:
    if seq_len is not None and m % seq_len:
        raise ValueError(f"a batch of {m} positions is not a whole number of sequences of seq_len={seq_len}")


def _sequence_loss(scores: Array, index: Array, num_experts: int, seq_len: int | None) -> tuple[float, np.ndarray]:
    r"""$\sum_i f_i P_i$ averaged over groups of `seq_len` positions (None: the whole batch), and its gradient `[m, n]`.

    Computed in float64 from the layer's scores, whatever their dtype.
    """
    scores = np.asarray(scores, dtype=np.float64)  # [m, n]
    index = np.asarray(index)  # [m, k]
    m = scores.shape[0]
    _check_sequences(m, seq_len)
    seq_len = m if seq_len is None else seq_len
    value = sequence_balance_loss(scores, index, num_experts, seq_len)
    return value, sequence_balance_loss_grad(scores, index, num_experts, seq_len)


class AuxLossBalancer(Balancer):
    """Balancing by an auxiliary loss alone: the bias stays zero, the router's gradient does the work."""

    kind = "aux"

    def __init__(self, num_experts: int, top_k: int, *, coefficient: float = AUX_COEFFICIENT,
                 seq_len: int | None = None, bias: Array | None = None, dtype: Any = np.float32) -> None:
        super().__init__(num_experts, top_k, bias=bias, dtype=dtype)
        self.coefficient = check_positive("coefficient", coefficient)
        self.seq_len = None if seq_len is None else check_int("seq_len", seq_len, low=1)  # None: one group

    def options(self) -> dict[str, Any]:
        return {"coefficient": self.coefficient, "seq_len": self.seq_len}

    def check_batch(self, m: int) -> None:
        super().check_batch(m)
        _check_sequences(m, self.seq_len)

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        return bias

    def auxiliary(self, scores: Array, index: Array) -> tuple[float, np.ndarray]:
        r"""$\sum_i f_i P_i$ (averaged over groups) and its gradient in the scores, `[m, n]`."""
        return _sequence_loss(scores, index, self.num_experts, self.seq_len)


class SequenceLossBalancer(SignBalancer):
    """DeepSeek-V3's recipe: the sign rule moves the bias, a tiny sequence-wise loss acts inside sequences."""

    kind = "seq"

    def __init__(self, num_experts: int, top_k: int, *, rate: float = 1e-3,
                 coefficient: float = SEQUENCE_COEFFICIENT, seq_len: int = SEQUENCE_LENGTH,
                 bias: Array | None = None, dtype: Any = np.float32) -> None:
        super().__init__(num_experts, top_k, rate=rate, bias=bias, dtype=dtype)
        self.coefficient = check_positive("coefficient", coefficient)
        self.seq_len = check_int("seq_len", seq_len, low=1)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "coefficient": self.coefficient, "seq_len": self.seq_len}

    def check_batch(self, m: int) -> None:
        super().check_batch(m)
        _check_sequences(m, self.seq_len)

    def auxiliary(self, scores: Array, index: Array) -> tuple[float, np.ndarray]:
        r"""The sequence-wise $\sum_i f_i P_i$, averaged over sequences, and its gradient in the scores, `[m, n]`."""
        return _sequence_loss(scores, index, self.num_experts, self.seq_len)


class CapacityBalancer(Balancer):
    """No bias; the layer serves at most $C = \\lceil c\\,mk/n \\rceil$ assignments per expert and drops the rest."""

    kind = "capacity"

    def __init__(self, num_experts: int, top_k: int, *, capacity_factor: float, bias: Array | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__(num_experts, top_k, bias=bias, dtype=dtype)
        self.capacity_factor = check_positive("capacity_factor", capacity_factor)

    def options(self) -> dict[str, Any]:
        return {"capacity_factor": self.capacity_factor}

    def layer_config(self, config: MoEConfig) -> MoEConfig:
        """The layer with this capacity factor: each expert drops what it has no room for."""
        return super().layer_config(config).replace(capacity_factor=self.capacity_factor)

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        return bias


class HashBalancer(Balancer):
    """Hash routing: the experts are a fixed function of the token id; nothing is balanced or learned."""

    kind = "hash"
    needs_token_ids = True

    def layer_config(self, config: MoEConfig) -> MoEConfig:
        """The layer routed by the hash of each token id (its router still weights the chosen experts)."""
        return super().layer_config(config).replace(hash_routing=True)

    def choose(self, scores: Array, bias: Array, token_ids: Array | None) -> Array:
        return hash_route(token_ids, self.num_experts, self.top_k)

    def next_bias(self, scores: Array, bias: Array, index: Array) -> Array:
        return bias
