r"""The other routers and balancers

Quantile Balancing replaces a line of earlier answers to one question: how do
$m k$ token-expert assignments spread over $n$ experts so that none is
swamped? This page writes each earlier answer as code next to its equation,
so that it can be run on the same batch as Eq. (13) and (14) and compared.

| rule | system | what it does about an overloaded expert |
|---|---|---|
| `capacity_keep` | GShard, Switch Transformer, the teaching `sparse_moe` sketch | serves at most $C$ assignments per expert and **drops** the rest |
| `switch_balance_loss` | Switch Transformer | adds $a \cdot n \sum_i f_i P_i$ to the loss, so the router's gradient pushes probability off busy experts |
| `sequence_balance_loss` | DeepSeek-V3, DeepSeek-V4 | the same product, taken within each sequence, at a tiny coefficient, next to the bias |
| `hash_route` | DeepSeek-V4's first MoE layers | ignores the router for selection: a fixed hash of the token id picks the experts |
| `sign_balancing_update` | DeepSeek-V3 | moves the bias by $\pm\gamma$ (see the Quantile Balancing page) |

The score functions the systems use (softmax, sigmoid, $\sqrt{\operatorname{softplus}}$)
are computed by `router_scores` on the routing page.

## Capacity and token dropping

With $N$ tokens in a batch, $E$ experts and $k$ experts per token, an expert
receives $\bar n = kN/E$ assignments on average. A training kernel with a fixed
buffer per expert serves at most

$$
C = \lceil c\,\bar n \rceil = \left\lceil c\,\frac{kN}{E} \right\rceil
$$

of them, $c$ being the **capacity factor** (Switch Transformer trained with
$c = 1$ and $1.25$). What happens to the rest is the overflow policy. The
`sparse_moe` sketch that textbooks of MoE use fixes one exactly, and `capacity_keep` follows
it:

* slots are served in **rank order**: every token's first choice before any
  token's second choice;
* within one rank, tokens are served in **input order**;
* an assignment is kept while its expert holds fewer than $C$, and a
  dropped assignment contributes nothing: the token's other weights are **not
  renormalized** (a token that loses every expert passes through the layer on
  its residual connection alone).

The sketch's own case, reproduced in the tests and in a worked example:
tokens with logits $[3, 0]$, $[2, 0]$, $[0, 3]$ on two experts, top-2,
capacity 1. Rank 1 serves token 0 on expert 0 and token 2 on expert 1;
token 1's first choice (expert 0) is full; all rank-2 choices find full
experts. Kept: `[[True, False], [False, False], [True, False]]`, loads
`[1, 1]`.

*Source:* the capacity-and-overflow rule of the `sparse_moe` teaching sketch
(its priority order and its own test case, transcribed in the tests); Fedus,
Zoph and Shazeer, *Switch Transformers* (JMLR 2022), section 2.2.

## Switch Transformer's auxiliary loss

$$
\mathcal{L}_{\text{aux}} = n \sum_{i=1}^{n} f_i P_i,
\qquad
f_i = \frac{1}{mk}\sum_{t=1}^{m} \mathbb{1}[i \in \mathcal{T}_t],
\qquad
P_i = \frac{1}{m}\sum_{t=1}^{m} p_{t,i},
$$

with $p_t$ the router's softmax probabilities. With $k = 1$ this is the
Switch loss exactly; for $k > 1$ the fraction $f_i$ counts assignments, so
the loss is 1 when both the assignments and the probabilities are uniform and
grows as they concentrate on the same experts. $f$ is a count and has no
gradient; the gradient reaches the router through $P$ only, and the model
adds $a\,\mathcal{L}_{\text{aux}}$ to its loss ($a = 10^{-2}$ in Switch).

## DeepSeek's sequence-wise balance loss

DeepSeek-V3 balances with the bias (the sign rule) and adds a tiny
**complementary** loss that keeps a single sequence from sending all its
tokens to a few experts. For each sequence of $T$ tokens,

$$
\mathcal{L}_{\text{seq}} = \sum_{i=1}^{n} f_i P_i,
\qquad
f_i = \frac{n}{kT}\sum_{t=1}^{T}\mathbb{1}[i \in \mathcal{T}_t],
\qquad
P_i = \frac{1}{T}\sum_{t=1}^{T} \frac{s_{t,i}}{\sum_{j} s_{t,j}},
$$

averaged over the sequences of the batch here, and multiplied by a balance
factor (DeepSeek-V3: $10^{-4}$). $s$ are the sigmoid (V3) or
$\sqrt{\operatorname{softplus}}$ (V4) scores, normalized per token to sum to
one; $\mathcal{T}_t$ is the top-$k$ **with** the bias. The
V4 report does not give the full reduction details of this loss; the
reduction above is the V3 report's.

## Hash routing

DeepSeek-V4 routes its first three MoE layers by a **fixed hash of the input
token id**: the same id always visits the same $k$ experts, and nothing is
learned about the choice. `hash_route` realises such a hash by rendezvous
(highest-random-weight) hashing: token id $v$ gives every expert $e$ a
pseudo-random 64-bit key $h(v, e)$, and the $k$ largest keys win. The $k$
experts are distinct by construction, every id sees a uniformly random
$k$-subset, and nothing depends on a vocabulary size. (DeepSeek-V4's own
table is not published; any fixed id-to-experts map has the properties the
V4 report states: fixed, and independent of what the router learns.) How
these layers weigh their experts is not published either;
`stable_latent_moe` uses the raw router scores of the hashed experts,
renormalized, as in a learned layer.

*Source:* the DeepSeek-V4 report's description of its routing changes; Thaler
and Ravishankar (1998) for rendezvous hashing; splitmix64 (Steele, Lea and
Flood, 2014) for the key mixing.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

from .._lib.validation import check_finite, check_float_array, check_int
from .._lib.values import seed_value
from .._lib.xp import Array, array_namespace, bincount, is_array, to_numpy, topk
from ..config import MoEConfig
from .routing import mixture_weights, score_function_vjp, weighting

__all__ = [
    "capacity_keep",
    "capacity_serving",
    "expert_capacity",
    "hash_choice",
    "hash_route",
    "route_by_hash",
    "route_by_table",
    "sequence_balance_loss",
    "sequence_balance_loss_grad",
    "switch_balance_loss",
    "switch_balance_loss_grad",
]


# ---------------------------------------------------------------------------
# Capacity and token dropping
# ---------------------------------------------------------------------------

def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    r"""The capacity $C = \lceil c\,kN/E \rceil$ of each expert, an integer.

    `capacity_factor` $c$ is read as the decimal number it prints as, so that
    $c = 1.1$ with $kN/E = 10$ gives $C = 11$ and not 12 (the binary float
    nearest 1.1 is a little above it, and a float product would round up).
    """
    num_tokens = check_int("num_tokens", num_tokens, low=0)
    num_experts = check_int("num_experts", num_experts, low=1)
    top_k = check_int("top_k", top_k, low=1, high=num_experts)
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
        raise TypeError(f"capacity_factor must be a real number, got {type(capacity_factor).__name__}")
    if not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be positive and finite, got {capacity_factor}")
    c = Fraction(str(capacity_factor))
    # $$C = \left\lceil c\,\frac{kN}{E} \right\rceil$$
    return math.ceil(c * top_k * num_tokens / num_experts)


def capacity_keep(index: Array, num_experts: int, capacity: int) -> Array:
    r"""Which assignments an expert of capacity $C$ serves: `kept` `[m, k]` bool.

    `index` `[m, k]` holds each token's experts in rank order (column 0 is its
    first choice). Assignments are served rank by rank, and within a rank in
    token order; one is kept while its expert has served fewer than
    `capacity` before it. Multiply the weights by `kept` to drop the others
    (without renormalizing them, as in the `sparse_moe` sketch).

    The rule, vectorized: list the assignments in serving order (rank-major),
    and give each the number of earlier assignments to the same expert, its
    **position in that expert's queue**. Since an expert serves everything
    until it is full and nothing after, an assignment is kept exactly when

    $$\text{position} < C.$$
    """
    num_experts = check_int("num_experts", num_experts, low=1)
    _check_index(index, num_experts)
    capacity = check_int("capacity", capacity, low=0)
    xp = array_namespace(index)
    m, k = index.shape
    # Serving order: every token's first choice, then every second choice, ...: $$t = r\,m + i$$
    queue = xp.reshape(index.mT, (k * m,))  # [k*m], expert of each assignment in serving order
    # Group the assignments by expert, keeping serving order inside each group (stable sort).
    order = xp.argsort(queue, stable=True)  # [k*m]
    grouped = xp.take(queue, order)  # [k*m], expert ids ascending
    # Expert e's group starts after all assignments to experts < e.
    start = xp.cumulative_sum(bincount(queue, num_experts), include_initial=True)  # [n + 1]
    # Position of each grouped assignment within its expert's queue.
    position_grouped = xp.arange(k * m, dtype=start.dtype) - xp.take(start, grouped)  # [k*m]
    # Back to serving order (the inverse permutation of `order`).
    position = xp.take(position_grouped, xp.argsort(order))  # [k*m]
    # $$\text{kept}_{i,r} = \bigl[\text{position}_{r m + i} < C\bigr]$$
    return xp.reshape(position < capacity, (k, m)).mT  # [m, k]


# ---------------------------------------------------------------------------
# Switch Transformer's auxiliary loss
# ---------------------------------------------------------------------------

def _assignment_fraction(index: Array, num_experts: int) -> Array:
    r"""$f_i = \frac{1}{mk}\sum_t \mathbb{1}[i \in \mathcal{T}_t]$, `[n]`, in float64."""
    xp = array_namespace(index)
    m, k = index.shape
    return xp.astype(bincount(index, num_experts), xp.float64) / (m * k)


def switch_balance_loss(probs: Array, index: Array, num_experts: int) -> float:
    r"""Switch Transformer's auxiliary loss $n \sum_i f_i P_i$ (1 when uniform).

    `probs` `[m, n]` are the router probabilities (softmax), `index` `[m, k]`
    the chosen experts. $f_i$ is the fraction of the $mk$ assignments that go
    to expert $i$, $P_i$ the mean probability of expert $i$.
    """
    num_experts = check_int("num_experts", num_experts, low=1)
    _check_index(index, num_experts)
    _check_probabilities("probs", probs, index, num_experts, kind="probabilities")
    if index.shape[0] == 0:
        raise ValueError("index must hold at least one token, got shape " + str(list(index.shape)))
    xp = array_namespace(probs, index)
    f = _assignment_fraction(index, num_experts)  # [n]
    # $$P_i = \frac{1}{m} \textstyle\sum_t p_{t,i}$$
    P = xp.mean(xp.astype(probs, xp.float64), axis=0)  # [n]
    # $$\mathcal{L}_{\text{aux}} = n \textstyle\sum_i f_i P_i$$
    return float(num_experts * xp.sum(f * P))


def switch_balance_loss_grad(logits: Array, index: Array, num_experts: int) -> Array:
    r"""The gradient of `switch_balance_loss(softmax(logits), index, n)` in the logits, `[m, n]`.

    $f$ is held fixed (a count has no gradient). With
    $g_i = \partial\mathcal{L}/\partial p_{t,i} = n f_i / m$, the softmax's
    Jacobian gives

    $$\frac{\partial \mathcal{L}}{\partial z_{t,j}} = p_{t,j}\Bigl(g_j - \sum_i p_{t,i}\, g_i\Bigr).$$
    """
    num_experts = check_int("num_experts", num_experts, low=1)
    _check_index(index, num_experts)
    _check_probabilities("logits", logits, index, num_experts)
    xp = array_namespace(logits, index)
    z = xp.astype(logits, xp.float64)  # [m, n]
    # $$g_i = \partial\mathcal{L} / \partial p_{t,i} = n f_i / m$$
    g = num_experts * _assignment_fraction(index, num_experts) / logits.shape[0]  # [n]
    # Through the softmax: $$\partial\mathcal{L}/\partial z_{t,j} = p_{t,j}\,(g_j - p_t \cdot g)$$
    return score_function_vjp(z, g[None, :] + xp.zeros_like(z), "softmax")  # [m, n]


# ---------------------------------------------------------------------------
# DeepSeek's sequence-wise balance loss
# ---------------------------------------------------------------------------

def _sequences(scores: Array, index: Array, num_experts: int, seq_len: int) -> tuple[int, int, int]:
    num_experts_checked = check_int("num_experts", num_experts, low=1)
    _check_index(index, num_experts_checked)
    _check_probabilities("scores", scores, index, num_experts_checked, kind="scores")
    seq_len = check_int("seq_len", seq_len, low=1)
    m, k = index.shape
    if m == 0 or m % seq_len:
        raise ValueError(f"seq_len must divide the number of tokens m={m} (m > 0), got seq_len={seq_len}")
    xp = array_namespace(scores)
    if bool(xp.any(scores < 0)):
        raise ValueError("scores must be non-negative (sigmoid or sqrt-softplus scores), got a negative entry")
    return m // seq_len, seq_len, k


def _sequence_terms(scores: Array, index: Array, num_experts: int, seq_len: int) -> tuple[Array, Array, Array]:
    """f `[S, n]`, the normalized scores `[S, T, n]` and their per-token sums `[S, T, 1]`."""
    xp = array_namespace(scores, index)
    S, T, k = _sequences(scores, index, num_experts, seq_len)
    n = num_experts
    s = xp.reshape(xp.astype(scores, xp.float64), (S, T, n))  # [S, T, n]
    total = xp.sum(s, axis=-1, keepdims=True)  # [S, T, 1]
    # Counts per sequence: a one-hot sum over the k slots, no loop over tokens.
    experts = xp.arange(n, dtype=index.dtype)
    chosen = xp.reshape(index, (S, T, k))[..., None] == experts  # [S, T, k, n]
    counts = xp.sum(xp.astype(chosen, xp.float64), axis=(1, 2))  # [S, n]
    # $$f_i = \frac{n}{kT} \textstyle\sum_t \mathbb{1}[i \in \mathcal{T}_t]$$
    f = n / (k * T) * counts  # [S, n]
    return f, s / total, total


def sequence_balance_loss(scores: Array, index: Array, num_experts: int, seq_len: int) -> float:
    r"""DeepSeek's sequence-wise balance loss $\sum_i f_i P_i$, averaged over sequences.

    `scores` `[m, n]` are the raw affinities $s$ (sigmoid or sqrt-softplus,
    non-negative), `index` `[m, k]` the chosen experts, and the batch is
    `m / seq_len` sequences of `seq_len` consecutive tokens. The loss is 1
    when each sequence spreads its assignments and its normalized scores
    evenly.
    """
    xp = array_namespace(scores, index)
    f, normalized, _ = _sequence_terms(scores, index, num_experts, seq_len)
    # $$P_i = \frac{1}{T} \textstyle\sum_t s_{t,i} / \sum_j s_{t,j}$$
    P = xp.mean(normalized, axis=1)  # [S, n]
    # $$\mathcal{L}_{\text{seq}} = \textstyle\sum_i f_i P_i$$, averaged over the S sequences
    return float(xp.mean(xp.sum(f * P, axis=1)))


def sequence_balance_loss_grad(scores: Array, index: Array, num_experts: int, seq_len: int) -> Array:
    r"""The gradient of `sequence_balance_loss` in the scores $s$, `[m, n]` ($f$ held fixed).

    With $\hat s_{t,i} = s_{t,i} / \sum_j s_{t,j}$ and
    $g_i = f_i / (S\,T)$ for the token's sequence,

    $$\frac{\partial \mathcal{L}}{\partial s_{t,j}} = \frac{g_j - \sum_i \hat s_{t,i}\, g_i}{\sum_r s_{t,r}}.$$

    Chain it with the score function's derivative to reach the logits.
    """
    xp = array_namespace(scores, index)
    f, normalized, total = _sequence_terms(scores, index, num_experts, seq_len)
    S, T = normalized.shape[0], normalized.shape[1]
    # $$g_i = f_i / (S T)$$
    g = f[:, None, :] / (S * T)  # [S, 1, n]
    # $$\partial\mathcal{L}/\partial s_{t,j} = (g_j - \hat s_t \cdot g) / \textstyle\sum_r s_{t,r}$$
    grad = (g - xp.sum(normalized * g, axis=-1, keepdims=True)) / total  # [S, T, n]
    return xp.reshape(grad, (S * T, num_experts))


# ---------------------------------------------------------------------------
# Hash routing
# ---------------------------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _mix64(z: Array) -> Array:
    r"""splitmix64's finalizer: a bijection of 64-bit integers that scrambles every bit.

    Arithmetic is modulo $2^{64}$ (unsigned overflow wraps).
    """
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


def hash_route(token_ids: Array, num_experts: int, top_k: int, seed: int = 0) -> Array:
    r"""DeepSeek-V4-style hash routing: `index` `[m, k]`, a fixed function of each token id.

    Rendezvous hashing: id $v$ gives expert $e$ the key
    $h(v, e) = \operatorname{mix}(\operatorname{mix}(v + \text{seed}\cdot 2^{32}) + (e + 1)\,\gamma)$
    (splitmix64's mixer, $\gamma$ its odd increment) and takes the `top_k`
    largest keys, best first. The same id gives the same experts on every
    call and every backend; the $k$ experts are distinct; over ids, every
    $k$-subset is equally likely. `token_ids` is a 1-D array of non-negative
    integers (below $2^{32}$); `seed` chooses another hash.
    """
    _check_integers("token_ids", token_ids, "[m]", 0, 2**32)
    num_experts = check_int("num_experts", num_experts, low=1)
    top_k = check_int("top_k", top_k, low=1, high=num_experts)
    seed = seed_value(seed, "seed", high=2**31)
    xp = array_namespace(token_ids)
    v = xp.astype(token_ids, xp.uint64) + xp.asarray(seed << 32, dtype=xp.uint64)  # [m]
    e = xp.arange(1, num_experts + 1, dtype=xp.uint64) * xp.asarray(_GOLDEN, dtype=xp.uint64)  # [n]
    # $$h(v, e) = \operatorname{mix}\bigl(\operatorname{mix}(v) + (e + 1)\gamma\bigr)$$
    keys = _mix64(_mix64(v)[:, None] + e[None, :])  # [m, n], uint64
    # The k largest keys, compared as non-negative int64 (the top 63 bits), never as floats.
    _, index = topk(xp.astype(keys >> 1, xp.int64), top_k)  # [m, k]
    return xp.astype(index, xp.int64)



def route_by_hash(scores: Array, token_ids: Array, top_k: int, *, renormalize: bool = True,
                  scaling_factor: float = 1.0, seed: int = 0) -> tuple[Array, Array]:
    r"""A hash-routed layer's `(index, weights)`: experts from `hash_route`, weights from the raw scores.

    The counterpart of `route` for DeepSeek-V4's first layers: the router
    still scores every expert, but only to weigh the $k$ experts the hash
    chose, $p_{i,j} = s_{i,j} / \sum_{r \in \mathcal{T}_i} s_{i,r}$ (times the
    scaling factor), renormalized as in a learned layer (how DeepSeek-V4's hash
    layers weigh their experts is not published).
    """
    check_float_array("scores", scores, ndim=2)
    check_finite("scores", scores)
    renormalize, scaling_factor = weighting(renormalize, scaling_factor)
    m, n = scores.shape
    index = hash_route(token_ids, n, top_k, seed)  # [m', k]
    if index.shape[0] != m:
        raise ValueError(f"token_ids must have shape [{m}] to match scores {list(scores.shape)}, "
                         f"got {list(token_ids.shape)}")
    xp = array_namespace(scores, index)
    raw = xp.take_along_axis(scores, index, axis=-1)  # [m, k]
    # The hash ignores the scores, so nothing keeps its experts' scores from being 0 (an underflowed
    # sqrt-softplus): `mixture_weights` refuses the 0/0 instead of returning NaN weights.
    return index, mixture_weights(raw, renormalize=renormalize, scaling_factor=scaling_factor)


def route_by_table(scores: Array, token_ids: Array, tid2eid: Array, *, renormalize: bool = True,
                   scaling_factor: float = 1.0) -> tuple[Array, Array]:
    r"""DeepSeek-V4's hash layers as transformers computes them: experts looked up in a stored table.

    `DeepseekV4HashRouter` holds `tid2eid` `[vocab, k]`, a frozen table of
    expert ids per token id, and routes token $i$ to the experts
    $\mathcal T_i = \text{tid2eid}[v_i]$. The router still scores every
    expert, but only to weigh those $k$: $p_{i,j} = s_{i,j} / \sum_{r \in
    \mathcal T_i} s_{i,r}$, times `scaling_factor` (transformers adds $10^{-20}$
    to the sum; it always renormalizes). Returns `(index, weights)`, `[m, k]`
    each, to pass to `stable_latent_moe(..., routing=(index, weights))`.

    `token_ids` `[m]` must index the table's rows; each row must hold $k$
    distinct expert ids in $[0, n)$ (an expert chosen twice has no place in the
    layer's route), else a `ValueError` names the row.
    """
    check_float_array("scores", scores, ndim=2)
    check_finite("scores", scores)
    renormalize, scaling_factor = weighting(renormalize, scaling_factor)
    m, n = scores.shape
    _check_integers("tid2eid", tid2eid, "[vocab, k]", 0, n)
    _check_integers("token_ids", token_ids, "[m]", 0, tid2eid.shape[0])
    if token_ids.shape[0] != m:
        raise ValueError(f"token_ids must have shape [{m}] to match scores {list(scores.shape)}, "
                         f"got {list(token_ids.shape)}")
    xp = array_namespace(scores, tid2eid)
    index = xp.astype(xp.take(tid2eid, xp.astype(token_ids, xp.int64), axis=0), xp.int64)  # [m, k]
    ordered = xp.sort(index, axis=1)
    repeated = xp.any(ordered[:, 1:] == ordered[:, :-1], axis=1)  # [m]
    if bool(xp.any(repeated)):
        first = int(xp.argmax(xp.astype(repeated, xp.int64)))
        raise ValueError(f"tid2eid[{int(token_ids[first])}] = {to_numpy(index[first]).tolist()} names an expert "
                         "twice: each token's k experts must be distinct")
    raw = xp.take_along_axis(scores, index, axis=-1)  # [m, k]
    return index, mixture_weights(raw, renormalize=renormalize, scaling_factor=scaling_factor)


# ---------------------------------------------------------------------------
# Input checks (used by every function above)
# ---------------------------------------------------------------------------

def _check_integers(name: str, a: Array, shape_text: str, low: int, high: int) -> None:
    """`a` must be an integer array of rank `len(shape_text)` with values in `[low, high)`."""
    rank = shape_text.count(",") + 1
    if not is_array(a):
        raise TypeError(f"{name} must be an integer array of shape {shape_text}, got {type(a).__name__}")
    xp = array_namespace(a)
    if not xp.isdtype(a.dtype, "integral"):
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.ndim != rank:
        raise ValueError(f"{name} must have shape {shape_text}, got shape {list(a.shape)}")
    if math.prod(a.shape) and (int(xp.min(a)) < low or int(xp.max(a)) >= high):
        raise ValueError(f"{name} must hold integers in [{low}, {high}), got values in "
                         f"[{int(xp.min(a))}, {int(xp.max(a))}]")


def _check_index(index: Array, num_experts: int) -> None:
    """`index` must be an `[m, k]` integer array of expert ids in `[0, num_experts)`, with `k >= 1`."""
    _check_integers("index (expert ids)", index, "[m, k]", 0, num_experts)
    if index.shape[1] < 1:
        raise ValueError(f"index must choose at least one expert per token (k >= 1), got shape {list(index.shape)}")


def _check_probabilities(name: str, probs: Array, index: Array, num_experts: int, *,
                         kind: str = "logits") -> None:
    """`probs` must be a finite `[m, n]` float array matching `index`; `kind` says what else it must be.

    * `"logits"`: any finite values;
    * `"scores"`: non-negative affinities with a positive sum per token (sigmoid or sqrt-softplus scores);
    * `"probabilities"`: non-negative, each row summing to 1 (a softmax), to the rounding of its dtype.
    """
    check_float_array(name, probs, ndim=2)
    if tuple(probs.shape) != (index.shape[0], num_experts):
        raise ValueError(
            f"{name} must have shape [m, n] = [{index.shape[0]}, {num_experts}] to match index "
            f"{list(index.shape)} and num_experts={num_experts}, got {list(probs.shape)}")
    check_finite(name, probs)
    if kind == "logits" or probs.shape[0] == 0:
        return
    xp = array_namespace(probs)
    if bool(xp.any(probs < 0)):
        raise ValueError(f"{name} must be non-negative ({kind}), got a minimum of {float(xp.min(probs)):.6g}")
    total = xp.sum(xp.astype(probs, xp.float64), axis=-1)  # [m]
    if kind == "scores":
        if bool(xp.any(total <= 0)):
            raise ValueError(f"{name} must have a positive sum for every token (the sum normalizes them), "
                             f"got {int(xp.sum(xp.astype(total <= 0, xp.int64)))} token(s) whose scores are all 0")
        return
    # A softmax in float32 over n experts sums to 1 within about n rounding errors.
    tolerance = 8 * num_experts * float(xp.finfo(probs.dtype).eps) if probs.dtype in (xp.float32, xp.float64) \
        else 1e-2
    worst = float(xp.max(xp.abs(total - 1.0)))
    if worst > tolerance:
        raise ValueError(f"{name} must be probabilities whose rows sum to 1 (a softmax over the experts), "
                         f"got a row sum off by {worst:.3g} (tolerance {tolerance:.1g})")


# ---------------------------------------------------------------------------
# The two extension points of the layer's selection
# ---------------------------------------------------------------------------

def hash_choice(scores: Array, bias: Array, config: MoEConfig, token_ids: Array | None) -> tuple[Array, Array]:
    """The choice rule `"hash"` of a layer with `config.hash_routing`: `route_by_hash` with the layer's switches."""
    if token_ids is None:
        raise ValueError("token_ids must be given (an [m] integer array) when config.hash_routing is True")
    return route_by_hash(scores, token_ids, config.top_k, renormalize=config.renormalize,
                         scaling_factor=config.routed_scaling_factor)


def capacity_serving(index: Array, weights: Array, config: MoEConfig) -> tuple[Array, Array]:
    r"""The serving rule `"capacity"` of a layer with `config.capacity_factor` $c$: `(weights, kept)`.

    Each expert serves at most $C = \lceil c\,mk/n \rceil$ assignments, rank
    by rank, then token by token (`capacity_keep`); a dropped assignment's
    weight becomes 0 and the others are **not** renormalized.
    """
    xp = array_namespace(index, weights)
    capacity = expert_capacity(index.shape[0], config.num_experts, config.top_k, config.capacity_factor)
    kept = capacity_keep(index, config.num_experts, capacity)  # [m, k] bool
    # Dropped assignments contribute nothing: $$p_{i,r} \leftarrow p_{i,r}\,\text{kept}_{i,r}$$
    return weights * xp.astype(kept, weights.dtype), kept
