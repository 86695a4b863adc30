r"""The exchange between ranks: who holds which expert, the dispatch plan, the all-to-all, and what the ranks agree on first."""

from __future__ import annotations

import builtins
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._lib.validation import check_finite, check_float_array, check_int
from .._lib.xp import Array, array_namespace, to_numpy
from ..config import MoEConfig
from ..layer.latent_moe import (
    RoutedActivations,
    dispatch_by_expert,
    parameter_shapes,
    routed_experts,
)
from .padded import padded_routed_experts

#: The parameters a rank holds only its block of: the three stacks of routed experts.
EXPERT_STACKS = ("experts.w1", "experts.w3", "experts.w2")

# ---------------------------------------------------------------------------
# Who holds which expert
# ---------------------------------------------------------------------------

def _check_ranks(n: int, size: int) -> int:
    """`size` ranks must split `n` experts into equal blocks; returns the block size n/P."""
    size = check_int("size (ranks in the communicator)", size, low=1)
    if n % size:
        raise ValueError(f"the number of ranks P={size} must divide the number of experts n={n} "
                         f"(each rank holds a block of n/P experts)")
    return n // size


__all__ = ["EXPERT_STACKS", "LocalSlots", "Plan", "alltoallv", "check_comm", "check_ep_inputs",
           "check_ranks_agree", "digest", "dispatch_plan", "exchange_counts", "expected_remote_ranks",
           "expert_block", "local_experts", "shard_params", "sum_rows"]

def expert_block(n: int, size: int, rank: int) -> tuple[int, int]:
    r"""The experts rank `rank` of `size` holds: $[r\,n/P,\ (r+1)\,n/P)$, as `(start, stop)`."""
    n = check_int("n", n, low=1)
    per_rank = _check_ranks(n, size)
    rank = check_int("rank", rank, low=0, high=size - 1)
    return rank * per_rank, (rank + 1) * per_rank


def expected_remote_ranks(n: int, k: int, size: int) -> float:
    r"""How many *other* ranks a token is sent to, on average, when its $k$ experts are uniformly random.

    With $P$ ranks of $n/P$ experts, a token's $k$ distinct experts miss a
    given rank with probability $\binom{n - n/P}{k} / \binom{n}{k}$, so they
    occupy on average

    $$\mathbb{E}[R] = P \left(1 - \binom{n - n/P}{k} \Big/ \binom{n}{k}\right)$$

    ranks, and the token's own rank is one of them with probability
    $\mathbb{E}[R]/P$. Each exchange then carries $\mathbb{E}[R](1 - 1/P)$
    latents per token, between 0 ($P = 1$) and $k$. A planning number: a
    balanced router is close to uniform on average, but real routing is
    correlated, and the measured bytes (`EPStats`) are the truth.
    """
    n = check_int("n", n, low=1)
    k = check_int("k", k, low=1, high=n)
    per_rank = _check_ranks(n, size)
    # $$\Pr[\text{no expert of the token on a given rank}] = \binom{n - n/P}{k} / \binom{n}{k}$$
    miss = math.comb(n - per_rank, k) / math.comb(n, k)
    occupied = size * (1.0 - miss)
    # $$\mathbb{E}[\text{remote}] = \mathbb{E}[R]\,(1 - 1/P)$$
    return occupied * (1.0 - 1.0 / size)


def shard_params(params: Mapping[str, Array], config: MoEConfig, rank: int, size: int) -> dict[str, Array]:
    """What rank `rank` of `size` holds: every parameter whole, except the expert stacks cut to its block.

    `params` has the full shapes of `parameter_shapes(config)`. The expert
    stacks are sliced (views for NumPy), the rest is passed through.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    start, stop = expert_block(config.num_experts, size, rank)
    shard = dict(params)
    for name in EXPERT_STACKS:
        if name not in params:
            raise ValueError(f"params must contain {name!r}, the stacked expert weights")
        if params[name].shape[0] != config.num_experts:
            raise ValueError(f"params[{name!r}] must hold all n={config.num_experts} experts to be sharded, "
                             f"got shape {list(params[name].shape)}")
        shard[name] = params[name][start:stop, ...]
    return shard


def check_ep_inputs(x: Array, params: Mapping[str, Array], config: MoEConfig, size: int) -> int:
    """Raise a readable error for a bad input of `ep_forward`; returns n/P."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    per_rank = _check_ranks(config.num_experts, size)
    check_float_array("x", x, ndim=2)
    if x.shape[1] != config.hidden_size:
        raise ValueError(f"x must have shape [m, {config.hidden_size}] (hidden_size), got {list(x.shape)}")
    check_finite("x", x)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping from parameter names to arrays, got {type(params).__name__}")
    shapes = parameter_shapes(config)
    missing, extra = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    if missing or extra:
        raise ValueError(f"params must have exactly the names {sorted(shapes)}; missing {missing}, extra {extra}")
    for name, shape in shapes.items():
        check_float_array(f"params[{name!r}]", params[name])
        if name in EXPERT_STACKS:
            # This rank's block only: [n/P, ...] instead of [n, ...].
            shape = (per_rank, *shape[1:])
            if tuple(params[name].shape) != shape:
                raise ValueError(
                    f"params[{name!r}] must hold this rank's block of n/P = {config.num_experts}/{size} = {per_rank} "
                    f"experts, shape {list(shape)}, got {list(params[name].shape)} (shard_params cuts a "
                    f"whole stack)")
        elif tuple(params[name].shape) != shape:
            raise ValueError(f"params[{name!r}] must have shape {list(shape)} (replicated on every rank), "
                             f"got {list(params[name].shape)}")
    check_finite("params['gate.e_score_correction_bias']", params["gate.e_score_correction_bias"])
    return per_rank


def check_comm(comm: Any) -> tuple[int, int]:
    if not all(hasattr(comm, name) for name in ("Get_size", "Get_rank", "Alltoall", "Alltoallv", "allgather")):
        raise TypeError(f"comm must be an mpi4py communicator (Get_size, Get_rank, Alltoall, Alltoallv, "
                        f"allgather), got {type(comm).__name__}")
    return int(comm.Get_size()), int(comm.Get_rank())


def digest(a: Array | None) -> str | None:
    """A short SHA-256 of an array's dtype, shape and bytes: what ranks compare to agree on a bias."""
    if a is None:
        return None
    values = np.ascontiguousarray(to_numpy(a))
    head = f"{values.dtype.str}{values.shape}".encode()
    return hashlib.sha256(head + values.tobytes()).hexdigest()[:16]


def _error_class(kind: str) -> type[Exception]:
    """The built-in exception class named `kind` (`MemoryError`, `ZeroDivisionError`, ...), or `RuntimeError`
    for a class of the user's own, which another rank may not be able to import."""
    found = getattr(builtins, kind, None)
    return found if isinstance(found, type) and issubclass(found, Exception) else RuntimeError


def check_ranks_agree(comm: Any, what: str, fingerprint: Mapping[str, Any],
                      error: BaseException | None = None) -> None:
    r"""Before any exchange: one `allgather` of what must agree, and the same error on every rank if it does not.

    `fingerprint` maps names to plain values that must be equal on every
    rank (sizes, a dtype name, a digest of the bias); `error` is what this
    rank met while checking its own inputs (None if nothing). Every rank
    receives every rank's pair, so every rank can tell, identically, whether
    some rank failed (its error is raised everywhere, naming the rank) or
    two ranks disagree (a `ValueError` naming the field and each rank's
    value). Called by every rank of `comm`, like any collective; it never
    hangs the others, because it is the first exchange and every rank reaches it.
    """
    size = int(comm.Get_size())
    report = None if error is None else (type(error).__name__, str(error))
    entries = comm.allgather((dict(fingerprint), report))
    failed = [(rank, entry[1]) for rank, entry in enumerate(entries) if entry[1] is not None]
    if failed:
        rank, (kind, text) = failed[0]
        others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        cls = _error_class(kind)
        named = "" if cls.__name__ == kind else f"{kind}: "  # a class of the user's own, raised as RuntimeError
        raise cls(f"{what}: rank {rank} of {size}{others}: {named}{text}") from error
    for key in fingerprint:
        values = [entry[0].get(key) for entry in entries]
        if any(v != values[0] for v in values[1:]):
            listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{what}: the {size} ranks must agree on {key}, got {listed}")


# ---------------------------------------------------------------------------
# The dispatch plan: which (token, rank) pairs travel
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Which of this rank's tokens go to which rank, in the order they are sent.

    `present` `[m, P]`: token i has an expert on rank p. The pairs are sent
    rank by rank, tokens in order within a rank: pair s is token
    `pair_token[s]` for rank `pair_rank[s]`, and `position[i, p]` is the pair
    number of (i, p) where `present[i, p]`. `send_rows` `[P]` counts the pairs
    per destination. `local_id` and `weight` `[S, k]` are what travels with
    each pair: the id, within the destination's block, and the weight of each
    of the token's experts held there (-1 and 0 for the others).
    """

    present: Array
    position: Array
    pair_token: Array
    send_rows: np.ndarray
    local_id: Array
    weight: Array


def sum_rows(values: Array, position: Array, mask: Array) -> Array:
    r"""Row sums by groups: $\text{out}_g = \sum_c [\text{mask}_{g,c}]\, \text{values}_{\text{position}_{g,c}}$.

    `values` `[S, w]`, `position` and `mask` `[G, c]`; returns `[G, w]`. The
    portable scatter-add of this module, in the style of `routed_experts`'
    combine: one gather per column $c$, never an unsorted copy.
    """
    xp = array_namespace(values, position, mask)
    out = xp.zeros((position.shape[0], values.shape[1]), dtype=values.dtype)  # [G, w]
    for c in range(position.shape[1]):
        rows = xp.take(values, xp.where(mask[:, c], position[:, c], xp.zeros((), dtype=position.dtype)),
                       axis=0)  # [G, w]
        out += xp.where(mask[:, c:c + 1], rows, xp.zeros((), dtype=values.dtype))
    return out


def dispatch_plan(index: Array, weights: Array, per_rank: int, size: int) -> Plan:
    """The pairs this rank sends, from its route `index`, `weights` `[m, k]`."""
    xp = array_namespace(index, weights)
    # The rank that holds each chosen expert: $$\text{owner}_{i,r} = \lfloor \mathcal{T}_{i,r} / (n/P) \rfloor$$
    owner = index // per_rank  # [m, k]
    ranks = xp.arange(size, dtype=owner.dtype)  # [P]
    present = xp.any(owner[:, :, None] == ranks[None, None, :], axis=1)  # [m, P]
    # Pairs rank by rank, tokens in order: the non-zeros of present^T in row-major order.
    pair_rank, pair_token = xp.nonzero(xp.matrix_transpose(present))  # [S], [S]
    per_column = xp.astype(present, xp.int64)  # [m, P]
    send_rows = to_numpy(xp.sum(per_column, axis=0)).astype(np.int64)  # [P]
    # Pair number of (i, p): the pairs for ranks before p, plus token i's place among rank p's tokens.
    first = xp.asarray(np.concatenate(([0], np.cumsum(send_rows)[:-1])), dtype=xp.int64)  # [P]
    position = xp.cumulative_sum(per_column, axis=0) - 1 + first[None, :]  # [m, P], valid where present
    # What travels with pair s: the token's experts held by the destination, as ids within its block.
    token_index = xp.take(index, pair_token, axis=0)  # [S, k]
    mine = (token_index // per_rank) == xp.astype(pair_rank, token_index.dtype)[:, None]  # [S, k]
    local_id = xp.where(mine, token_index - xp.astype(pair_rank, token_index.dtype)[:, None] * per_rank,
                        xp.full((), -1, dtype=token_index.dtype))  # [S, k]
    weight = xp.where(mine, xp.take(weights, pair_token, axis=0), xp.zeros((), dtype=weights.dtype))  # [S, k]
    return Plan(present, position, pair_token, send_rows, local_id, weight)


# ---------------------------------------------------------------------------
# The exchange
# ---------------------------------------------------------------------------

def alltoallv(comm: Any, send: Array, send_rows: np.ndarray, recv_rows: np.ndarray) -> Array:
    """Send rows `send` `[S, w]` (`send_rows[p]` of them to rank p); returns the `[R, w]` rows received.

    The buffers are NumPy arrays on the host (MPI reads memory); other array
    libraries are copied there and back.
    """
    xp = array_namespace(send)
    width = int(send.shape[1])
    buffer = np.ascontiguousarray(to_numpy(send))  # [S, w]
    received = np.empty((int(recv_rows.sum()), width), dtype=buffer.dtype)  # [R, w]

    def spec(rows: np.ndarray) -> tuple[list[int], list[int]]:
        counts = (rows * width).astype(np.int64)
        return counts.tolist(), np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64).tolist()

    comm.Alltoallv([buffer, spec(send_rows)], [received, spec(recv_rows)])
    return received if isinstance(send, np.ndarray) else xp.asarray(received)


def exchange_counts(comm: Any, send_rows: np.ndarray) -> np.ndarray:
    """Every rank learns how many pairs each other rank will send it (one `Alltoall` of P integers)."""
    recv_rows = np.empty_like(send_rows)
    comm.Alltoall(send_rows, recv_rows)
    return recv_rows


# ---------------------------------------------------------------------------
# The experts of this rank, on what arrived
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LocalSlots:
    """The slots of the pairs that arrived, one row per (pair, local expert), and what their backward reads."""

    valid: Array  # [R, k] bool, which entries of each pair are experts of this rank
    slot_pair: Array  # [T], the pair of each slot (row-major: pair by pair)
    slot_position: Array  # [R, k], the slot number of (pair, r) where valid
    z_slots: Array  # [T, l], each slot's latent
    routed: RoutedActivations | None  # what `routed_experts(..., save=True)` kept


def local_experts(z: Array, local_id: Array, weight: Array, w1: Array, w3: Array, w2: Array,
                   config: MoEConfig, padded: bool, mxfp8_inputs: bool = False,
                   save: bool = False) -> tuple[Array, Array, LocalSlots]:
    r"""Each arrived pair's partial sum $\sum_{e \text{ here}} p_{i,e} E_e(z_i)$, `[R, l]`, and the local loads `[n/P]`.

    The pairs' slots (those with `local_id >= 0`) are laid out one per row,
    the grouped loop of `routed_experts` (or the padded product) runs on them
    with one expert each, and each pair's rows are added back together.
    With `save`, the routed activations are kept for the backward.
    """
    xp = array_namespace(z, local_id, weight)
    valid = local_id >= 0  # [R, k]
    slot_pair, _ = xp.nonzero(valid)  # [T], row-major: pair by pair
    slot_expert = local_id[valid][:, None]  # [T, 1]
    slot_weight = weight[valid][:, None]  # [T, 1]
    z_slots = xp.take(z, slot_pair, axis=0)  # [T, l]
    routed = None
    # $$o_t = p_{i,e}\, E_e(z_i)$$ for every slot $t = (i, e)$ computed here
    if padded:
        out = padded_routed_experts(z_slots, slot_expert, slot_weight, w1, w3, w2, config)  # [T, l]
    elif save:
        out, routed = routed_experts(z_slots, slot_expert, slot_weight, w1, w3, w2, config, save=True)
    else:
        out = routed_experts(z_slots, slot_expert, slot_weight, w1, w3, w2, config, mxfp8_inputs=mxfp8_inputs)
    # Slot number of (pair, r), valid where `valid`.
    slot_position = xp.reshape(xp.cumulative_sum(xp.reshape(xp.astype(valid, xp.int64), (-1,))) - 1,
                               valid.shape)  # [R, k]
    # $$u^{(p)}_i = \sum_{e \in \mathcal{T}_i \cap \mathcal{E}_p} o_{(i, e)}$$
    partial = sum_rows(out, slot_position, valid)  # [R, l]
    load = dispatch_by_expert(slot_expert, slot_weight, w1.shape[0]).load  # [n/P]
    return partial, load, LocalSlots(valid, slot_pair, slot_position, z_slots, routed)
