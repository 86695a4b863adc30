r"""Expert parallelism: the latent all-to-all, run for real over MPI.

$$
y_i \;=\; E^{\text{shared}}(x_i) \;+\; W_\uparrow\,\operatorname{RMSNorm}\!\Bigl(
\sum_{p=0}^{P-1}\; \underbrace{\sum_{e \in \mathcal{T}_i \cap \mathcal{E}_p} p_{i,e}\,E_e(W_\downarrow x_i)}_{
\text{computed on rank } p}\Bigr)
$$

A K3 layer holds 896 routed experts, 29.6 B parameters; no single device
keeps them all. Under **expert parallelism** each of $P$ ranks holds a
contiguous block of $n/P$ experts, $\mathcal{E}_p = [p\,n/P,\ (p+1)\,n/P)$,
while the router, its bias, the two latent projections, the norm and the
shared experts are replicated on every rank. A rank also holds its own
tokens, any number of them. One layer is then three local steps joined by two
all-to-all exchanges:

1. **Route locally.** Each rank scores its tokens with the replicated router
   and bias (Eq. 13) and projects them once, $z = W_\downarrow x$.
2. **Dispatch.** Every token's latent $z_i$ is sent to each rank that holds
   at least one of its $k$ experts (`Alltoallv`), with the local ids and
   weights of those experts. A token is sent **once per rank**, not once per
   expert: two of its experts on the same rank share one copy.
3. **Run the local experts** on what arrived, and reduce on the spot: the
   destination rank sums the weighted outputs of *its* experts for each
   token into one $\ell$-wide partial sum.
4. **Combine.** The partial sums go back to the token's own rank (a second
   `Alltoallv`, the first one's counts reversed), which adds them in latent
   space, **then** applies the norm, **then** $W_\uparrow$, once per token,
   and adds the shared experts.

Because $W_\downarrow$ comes before the dispatch and $W_\uparrow$ after the
combine, both exchanges carry $\ell$-wide vectors. For a token whose experts
live on $R_i$ other ranks, each exchange moves $R_i\,\ell$ values, at most
$k\ell$ (when its $k$ experts sit on $k$ different ranks), against $R_i\,d$ for a
full-width MoE with the same router: the ratio is exactly $\ell/d = 1/\alpha$,
and the tests measure it. `expected_remote_ranks` gives the average $R_i$
under uniform routing, the number to plan a deployment with (for K3 at 64
ranks, 14.14 other ranks per token against $k = 16$; worked example 81 prints
the table). `stats.dispatch_bytes` and `stats.combine_bytes`
count exactly those vectors (bytes sent to *other* ranks; the rank's share
for itself is a local copy); the expert ids and weights that travel with the
dispatch are counted apart, in `stats.routing_bytes` ($k$ ids and $k$
weights per (token, rank) pair, small next to $\ell$ values when $\ell \gg k$).

**Reduce before the norm.** RMSNorm is not additive:
$\operatorname{RMSNorm}(a + b) \ne \operatorname{RMSNorm}(a) + \operatorname{RMSNorm}(b)$.
The partial sums of step 3 must therefore travel back *unnormalized*, and the
norm waits until the token's own rank holds the whole $u_i$. A rank that
normalizes its partial sum before sending it (an easy mistake when the norm is
thought of as "part of the routed branch") computes a different layer, and
only for some tokens: those whose experts all live on one rank come out right,
which makes the bug easy to miss on small tests. `ep_forward(...,
reduce_before_norm=False)` runs that mistake on purpose so its error can be
measured (worked example 81 prints it).

**The balancer across ranks.** Quantile Balancing needs each expert's margin
quantile over the *global* batch. `ep_balance_update` is Appendix D as it runs
in a job: every rank counts its own scores into the $n \times B$ integer
histogram of `refimpl.balancing.histogram`, one integer `Allreduce` (a sum) gives every
rank the global counts, and each rank reads the new bias from them. Integer
sums do not depend on the order of addition, so every rank holds the same
bias **bit for bit**, without a broadcast.

**Balance is speed.** The dispatch is a barrier: no rank finishes the layer
before the slowest rank has run its experts, so a step costs what the most
loaded rank costs. With $L_p$ the slots (token, expert pairs) rank $p$
computes, a step takes time proportional to $\max_p L_p$ while the useful work
is proportional to the mean, and the fraction of the machine left idle is
$1 - \bar L / \max_p L_p$. The same arithmetic governs one device: a kernel
that runs all experts as one batched product pads every expert to the largest
load $C = \max_e \text{load}_e$, computes $nC$ rows for the $mk$ that matter,
and wastes

$$\frac{nC}{mk} - 1 = \frac{\max_e \text{load}_e}{\overline{\text{load}}} - 1 .$$

`padded_routed_experts` is that product, written with one array-API `matmul`
per weight over `[n, C, l]` blocks; `padding_waste` is the formula. The page
"Balance is speed" measures both against the balance that zero bias, the sign
rule and Quantile Balancing reach.

**One layer on every rank count.** `ep_forward` does not write the layer
again: it calls the functions of the forward page (`router_scores`,
`select_experts`, `routed_experts`, `rms_norm`, `shared_experts`) and only
moves their inputs and outputs between ranks, so every configuration the
single-process layer accepts (any score function, groups, hash routing with
`token_ids`, a capacity) computes the same layer here, and the tests hold
the two side by side under `mpiexec -n 1`, `-n 2` and `-n 4`. A capacity
is the one rule that needs to see other ranks' tokens: an expert serves its
first $C$ assignments in the order of the whole batch (every token's first
choice before any second choice, tokens in rank order), so the ranks
exchange their routes (`allgather`, $mk$ integers) and each applies the
serving rule to the whole batch and keeps its own rows.

**The backward, through the same exchanges transposed.** `ep_vjp` runs
the layer and returns its vector–Jacobian product. Read backwards, the
combine sent each pair's partial sum $u^{(p)}_i$ from rank $p$ to the token's
rank; its transpose sends $\bar u_i$ (after the norm's and the
up-projection's backward, on the token's rank) to every rank that holds
one of the token's experts. There the experts' backward gives each slot's
$\bar z$ and $\bar p$ and the gradients of the rank's own expert block, and the
transposed dispatch sends $\bar z$ and $\bar p$ home, where they are summed per
token and carried to the router and the input as in one process. Each
rank's gradient of a replicated weight (the router, the projections, the
norm, the shared experts) is its share, from its own tokens; the sum over
the ranks, one `Allreduce` as in data parallelism, is the gradient of the
whole batch. The exchanges of the backward carry $\ell$-wide vectors too.

**Ranks that disagree.** Before its first exchange, every function here
gathers from every rank what must be the same everywhere (the
configuration, the dtype, the shard layout, a digest of the bias and of
every replicated weight) together with any error a rank met while checking
its own inputs, in one small `allgather`. A rank's own inputs include its
`token_ids` (required by a hash-routed layer, integers, one per token) and
what is computed from its tokens alone before the first exchange: its
router scores and its choice of experts (scores that underflow to zero
under hash routing, say), and the one array library of `x` and `params`. If a rank failed or two ranks
disagree, every rank raises the same error, naming the rank and the values,
instead of some ranks waiting in an exchange for ever. An error of any
class counts: a `MemoryError` or a `ZeroDivisionError` on one rank is
raised as such on every rank, with its message, and a class of the user's
own (which another rank may not know) as a `RuntimeError` that names it. A
replicated weight that differs by one bit on one rank (another checkpoint,
an update applied twice) is named ("the 2 ranks must agree on weight
gate.weight"). An error after the agreement, in the middle of the
exchanges, cannot be shared this way: the command ends the whole job with
`Abort`, as `python -m mpi4py script.py` does for a script.

**What is and is not here.** The exchange is MPI (mpi4py), on host buffers:
arrays from any array-API library are copied to NumPy for the two
`Alltoallv` calls and back. There is no overlap of communication with
computation and no node-limited routing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .._lib.values import switch_value
from .._lib.xp import Array, array_namespace, compute_dtype, dtype_name, to_numpy
from ..balancing.histogram import BiasHistogram
from ..config import MoEConfig
from ..layer.activations import rms_norm
from ..layer.backward import (
    check_upstream,
    check_weights_unchanged,
    latent_output_backward,
    routed_experts_backward,
    router_and_input_backward,
    weight_fingerprints,
)
from ..layer.latent_moe import (
    MoEOutput,
    MoEParams,
    down_project,
    latent_output,
    shared_experts,
)
from ..layer.routing import router_scores
from ..layer.selection import Selection, check_token_ids, select_experts, serving_rule
from .exchange import (
    EXPERT_STACKS,
    LocalSlots,
    Plan,
    alltoallv,
    check_comm,
    check_ep_inputs,
    check_ranks_agree,
    digest,
    dispatch_plan,
    exchange_counts,
    local_experts,
    sum_rows,
)
from .padded import padded_routed_experts, padding_waste

__all__ = [
    "EPStats",
    "ep_balance_update",
    "ep_forward",
    "ep_vjp",
    "padded_routed_experts",
    "padding_waste",
]



# ---------------------------------------------------------------------------
# The forward pass
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class EPStats:
    """What one rank sent and computed in one `ep_forward` call.

    * `dispatch_bytes`, `combine_bytes`: bytes of latent vectors this rank
      sent to *other* ranks in the dispatch and in the combine all-to-all.
    * `routing_bytes`: bytes of expert ids and weights sent to other ranks
      with the dispatch.
    * `pairs_sent`, `pairs_received` `[P]`: (token, rank) pairs per peer, this
      rank's own share included (it is copied, not sent).
    * `expert_load` `[n/P]`: slots each local expert computed; its sum is the
      rank's load $L_p$, the work that sets the step time when it is the
      largest.
    * `expert_seconds`: wall time this rank spent running its experts (step
      3), the part of the step that grows with its load; `expert_cpu_seconds`
      the processor time the process used meanwhile, which other jobs on a
      shared machine do not inflate (with one BLAS thread per rank, it is the
      rank's own work).
    * `seconds`: wall time by stage: `"dispatch"` (the counts and the three
      dispatch exchanges, waiting for the other ranks included), `"experts"`,
      `"combine"` (the combine exchange); `ep_vjp`'s backward adds
      `"backward exchanges"` (the two transposed exchanges) and
      `"backward experts"`.

    Also readable as a mapping: `stats["dispatch_bytes"]`.
    """

    dispatch_bytes: int
    combine_bytes: int
    routing_bytes: int
    pairs_sent: np.ndarray
    pairs_received: np.ndarray
    expert_load: np.ndarray
    expert_seconds: float = 0.0
    expert_cpu_seconds: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    @property
    def load(self) -> int:
        """Slots computed on this rank, $L_p$."""
        return int(self.expert_load.sum())


def ep_forward(x: Array, params: Mapping[str, Array], config: MoEConfig, comm: Any, *,
               padded: bool = False, reduce_before_norm: bool = True, token_ids: Array | None = None,
               mxfp8_inputs: bool = False) -> tuple[Array, EPStats]:
    r"""Eq. (11) with the routed experts spread over the ranks of `comm`; call it on every rank.

    Parameters
    ----------
    x
        `[m_r, d]` this rank's own tokens; `m_r` may differ between ranks and
        may be zero.
    params
        The names of `parameter_shapes(config)`. The router, bias,
        projections, norm and shared experts are whole (and the same on every
        rank); `experts.w1`, `experts.w3` `[n/P, f, l]` and `experts.w2`
        `[n/P, l, f]` hold only this rank's block of experts,
        $[r\,n/P, (r+1)\,n/P)$ (see `shard_params`).
    config
        The layer's `MoEConfig`; $P$ must divide $n$. Every configuration of
        `stable_latent_moe` runs: any score function, groups, a capacity
        (served in the order of the whole batch, tokens in rank order), hash routing.
    comm
        An mpi4py communicator of $P$ ranks (`MPI.COMM_WORLD`; `MPI.COMM_SELF`
        runs the whole layer in one process through the same code).
    padded
        Run the local experts as one padded batched product
        (`padded_routed_experts`) instead of the grouped loop. Same result.
    reduce_before_norm
        `False` demonstrates the pitfall: each rank normalizes its partial
        sum before sending it back. Wrong on purpose; for measuring the error.
    token_ids
        `[m_r]` integers, this rank's tokens' ids: needed by a hash-routed layer.
    mxfp8_inputs
        Round each local expert product's input to MXFP8, as `stable_latent_moe` does.

    Returns
    -------
    y
        `[m_r, d]` the layer's output for this rank's tokens, in the dtype of
        `x`; equal to `stable_latent_moe` of the union of all ranks' tokens
        (in rank order), restricted to these, up to rounding (the partial
        sums are added in another order).
    stats
        An `EPStats`: bytes sent to other ranks in each exchange, pairs per
        peer, the loads of the local experts.

    Raises the same error on every rank when a rank's inputs are malformed or
    the ranks disagree on the configuration, dtype, shard layout or bias.
    """
    y, stats, _ = _ep_layer(x, params, config, comm, padded=padded, reduce_before_norm=reduce_before_norm,
                            token_ids=token_ids, mxfp8_inputs=mxfp8_inputs, save=False, what="ep_forward")
    return y, stats


@dataclass(frozen=True)
class _EPSaved:
    """What the expert-parallel forward keeps for `ep_vjp`'s backward."""

    h: Array  # [m, d] the tokens in the compute dtype
    scores: Array  # [m, n]
    selection: Selection
    z: Array  # [m, l]
    u: Array  # [m, l]
    v: Array  # [m, l]
    plan: Plan
    recv_rows: np.ndarray  # [P]
    slots: LocalSlots
    shared: tuple[Array, Array, Array] | None
    y_routed: Array  # [m, d]
    y_shared: Array  # [m, d]


def _ep_layer(x: Array, params: Mapping[str, Array], config: MoEConfig, comm: Any, *, padded: bool,
              reduce_before_norm: bool, token_ids: Array | None, mxfp8_inputs: bool, save: bool,
              what: str, return_intermediates: bool = False) -> tuple[Array, EPStats, _EPSaved | None]:
    """The expert-parallel layer, for `ep_forward` and `ep_vjp`: `(y, stats, saved)`.

    Everything that depends on one rank's own data (its inputs, its token ids,
    its router scores and its local choice of experts) is checked or computed
    inside the checked block, so a rank that fails there reports it through
    `check_ranks_agree` and every rank raises, instead of some waiting in an
    exchange for ever. `return_intermediates` is `ep_vjp`'s switch, checked
    there for the same reason.
    """
    size, rank = check_comm(comm)
    error: Exception | None = None
    try:
        per_rank = check_ep_inputs(x, params, config, size)
        padded, mxfp8_inputs = switch_value(padded, "padded"), switch_value(mxfp8_inputs, "mxfp8_inputs")
        reduce_before_norm = switch_value(reduce_before_norm, "reduce_before_norm")
        switch_value(return_intermediates, "return_intermediates")
        if mxfp8_inputs and padded:
            raise ValueError("mxfp8_inputs=True runs the grouped expert loop: pass padded=False")
        xp = _one_namespace(x, params)
        check_token_ids(token_ids, int(x.shape[0]), config)
        dtype = compute_dtype(xp, x)
        h = xp.astype(x, dtype, copy=save)  # [m, d]; a copy when kept for the backward (the caller may reuse x)
        # 1. Route locally, with the replicated router and bias: the layer's own selection (Eq. 13).
        # $$s = \sigma(x W_r^\top), \qquad \mathcal{T}_i = \operatorname{argtopk}_k(s_i + b)$$
        # The scores and this rank's choice depend on its own tokens only (a score that overflows, a
        # hash-routed token whose experts all scored 0): computed here, where an error reaches every rank.
        scores = router_scores(h, xp.astype(params["gate.weight"], dtype, copy=False),
                               config.score_function)  # [m, n]
        choice = select_experts(scores, params["gate.e_score_correction_bias"],
                                config if config.capacity_factor is None else config.replace(capacity_factor=None),
                                token_ids=token_ids)  # [m, k] each, before any capacity
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the first exchange
        error = exc
    fingerprint = {} if error is not None else {
        **{f"config.{key}": value for key, value in asdict(config).items()}, "dtype": dtype_name(x.dtype),
        "ranks": size,
        "expert block shape": [list(params[name].shape) for name in EXPERT_STACKS],
        "bias": digest(params["gate.e_score_correction_bias"]),
        # The replicated weights must be the same on every rank, byte for byte: a rank that loaded another
        # checkpoint (or updated its copy differently) would give its tokens another layer, silently.
        **{f"weight {name}": digest(params[name]) for name in sorted(params)
           if name not in EXPERT_STACKS and name != "gate.e_score_correction_bias"},
        "token_ids given": token_ids is not None, "reduce_before_norm": bool(reduce_before_norm),
        "mxfp8_inputs": bool(mxfp8_inputs)}
    check_ranks_agree(comm, what, fingerprint, error)
    seconds: dict[str, float] = {}

    def weight(name: str) -> Array:
        return xp.astype(params[name], dtype, copy=False)

    selection = _select_across_ranks(comm, choice, config, int(scores.shape[0]))
    weights = xp.astype(selection.weights, dtype)  # [m, k]
    # The latent, once per token, before anything is sent: $$z = x W_\downarrow^\top$$
    z = down_project(h, weight, config)  # [m, l]

    # 2. Dispatch: each token's latent to every rank that holds one of its experts, once per rank.
    started = time.perf_counter()
    plan = dispatch_plan(selection.index, weights, per_rank, size)
    recv_rows = exchange_counts(comm, plan.send_rows)  # [P], pairs each rank sends here
    z_arrived = alltoallv(comm, xp.take(z, plan.pair_token, axis=0), plan.send_rows, recv_rows)  # [R, l]
    id_arrived = alltoallv(comm, plan.local_id, plan.send_rows, recv_rows)  # [R, k]
    weight_arrived = alltoallv(comm, plan.weight, plan.send_rows, recv_rows)  # [R, k]
    seconds["dispatch"] = time.perf_counter() - started

    # 3. This rank's experts on what arrived, reduced per pair: one l-vector per (token, rank).
    started, started_cpu = time.perf_counter(), time.process_time()
    partial, load, slots = local_experts(z_arrived, id_arrived, weight_arrived, params["experts.w1"],
                                          params["experts.w3"], params["experts.w2"], config, padded,
                                          mxfp8_inputs, save=save)  # [R, l]
    expert_seconds, expert_cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
    seconds["experts"] = expert_seconds
    if not reduce_before_norm and config.use_latent_norm:
        # THE PITFALL, on purpose: normalizing a partial sum, $$\operatorname{RMSNorm}(u^{(p)}_i) \odot g$$
        partial = rms_norm(partial, weight("routed_expert_norm.weight"), config.rms_norm_eps)

    # 4. Combine: the partial sums travel back (the dispatch's counts reversed) and add up per token.
    started = time.perf_counter()
    returned = alltoallv(comm, partial, recv_rows, plan.send_rows)  # [S, l], in the order sent
    seconds["combine"] = time.perf_counter() - started
    # $$u_i = \sum_{p} u^{(p)}_i$$, in rank order
    u = sum_rows(returned, plan.position, plan.present)  # [m, l]
    # Then, and only then, the layer's steps 6-7 on the whole sum (the norm already ran on the partial sums
    # when the pitfall is asked for): $$v = \operatorname{RMSNorm}(u) \odot g, \quad y_{\text{routed}} = v W_\uparrow^\top$$
    after_combine = config if reduce_before_norm else config.replace(use_latent_norm=False)
    v, y_routed = latent_output(u, weight, after_combine)  # [m, l], [m, d]
    shared = shared_experts(h, weight("shared_experts.gate_proj.weight"), weight("shared_experts.up_proj.weight"),
                            weight("shared_experts.down_proj.weight"), config, save=save)  # [m, d]
    y_shared, shared_saved = shared if save else (shared, None)
    y = xp.astype(y_shared + y_routed, x.dtype)

    # What went to other ranks: every pair except those this rank sent to itself.
    itemsize = np.dtype(dtype_name(z.dtype)).itemsize  # bytes per latent value
    remote_sent = int(plan.send_rows.sum() - plan.send_rows[rank])
    remote_returned = int(recv_rows.sum() - recv_rows[rank])
    routing_item = np.dtype(dtype_name(plan.local_id.dtype)).itemsize + itemsize  # an id and a weight
    stats = EPStats(
        dispatch_bytes=remote_sent * int(z.shape[1]) * itemsize,
        combine_bytes=remote_returned * int(z.shape[1]) * itemsize,
        routing_bytes=remote_sent * config.top_k * routing_item,
        pairs_sent=plan.send_rows.copy(),
        pairs_received=recv_rows,
        expert_load=to_numpy(load).astype(np.int64),
        expert_seconds=expert_seconds,
        expert_cpu_seconds=expert_cpu_seconds,
        seconds=seconds,
    )
    saved = _EPSaved(h, scores, selection, z, u, v, plan, recv_rows, slots, shared_saved, y_routed,
                     y_shared) if save else None
    return y, stats, saved


def _select_across_ranks(comm: Any, choice: Selection, config: MoEConfig, m: int) -> Selection:
    """The layer's selection of this rank's `m` tokens, as the single-process layer makes it for the whole batch.

    `choice` is this rank's `select_experts` without a capacity. Every rule
    but a capacity looks at one token at a time, so it is already the right
    one. A capacity serves assignments in the order of the whole batch: the
    ranks gather their routes (in rank order, the order of the union of their
    tokens), each applies the serving rule to the whole batch, and keeps its
    own rows.
    """
    if config.capacity_factor is None:
        return choice
    xp = array_namespace(choice.weights)
    routes = comm.allgather(np.asarray(to_numpy(choice.index), dtype=np.int64))  # P arrays [m_p, k]
    whole = np.concatenate(routes, axis=0)  # [m, k], the whole batch in rank order
    first = sum(route.shape[0] for route in routes[:int(comm.Get_rank())])
    _, kept = serving_rule("capacity")(whole, np.ones(whole.shape, dtype=np.float64), config)  # [m, k] bool
    mine = xp.asarray(np.asarray(kept[first:first + m]))  # [m_r, k]
    # Dropped assignments contribute nothing (no renormalization), as in the single-process layer.
    return Selection(choice.index, choice.weights * xp.astype(mine, choice.weights.dtype), mine)


def _one_namespace(x: Array, params: Mapping[str, Array]) -> Any:
    """The one array library of `x` and every entry of `params`, or a `TypeError` naming those that differ."""
    try:
        return array_namespace(x, *params.values())
    except TypeError:
        pass
    libraries = {name: type(value).__module__.split(".")[0] for name, value in {"x": x, **params}.items()}
    others = ", ".join(f"params[{name!r}] is a {library} {type(params[name]).__name__}"
                       for name, library in libraries.items() if name != "x" and library != libraries["x"])
    raise TypeError(f"x and params must come from one array library: x is a {libraries['x']} "
                    f"{type(x).__name__}, but {others or 'their libraries do not mix'}")


# ---------------------------------------------------------------------------
# The backward pass across ranks
# ---------------------------------------------------------------------------

def ep_vjp(x: Array, params: Mapping[str, Array], config: MoEConfig, comm: Any, *,
           token_ids: Array | None = None, return_intermediates: bool = False,
           ) -> tuple[Array | MoEOutput, EPStats, Callable[..., tuple[Array, MoEParams]]]:
    r"""`ep_forward` and its vector–Jacobian product, through the transposed exchanges: `(y, stats, backward)`.

    Call it on every rank, as `ep_forward` (same arguments; the grouped expert
    loop). With `return_intermediates=True` the first value is this rank's
    `MoEOutput` instead of `y`: its tokens' scores, route, weights, latents
    and outputs, as the single-process layer gives them, except `routed`, which
    holds the activations of the slots **this rank's experts** computed
    (other ranks' tokens among them), the values whose largest magnitude a
    training loop reports (the largest over the ranks is that of the whole
    batch). `backward(dy)` (every rank, collectively) takes this rank's
    upstream gradient `[m_r, d]` and returns `(dx, dparams)`:

    * `dx` `[m_r, d]`: the gradient in this rank's tokens;
    * for the expert stacks, `dparams` holds the gradient of **this rank's
      block** `[n/P, ...]`, complete: every slot any rank routed to these
      experts was computed here;
    * for the replicated parameters (router, projections, norm, shared
      experts) it holds **this rank's share**, the gradient of its own
      tokens; summed over the ranks (one `Allreduce`, as data parallelism
      would), it is the single-process gradient of the union of all ranks'
      tokens. The bias entry is zeros (the bias only selects).

    `backward(dy, dscores=g)` adds a gradient `g` `[m_r, n]` in this rank's
    router scores (an auxiliary balance loss), carried to the router and the
    input as in `stable_latent_moe_vjp`.

    The backward runs the forward's two exchanges transposed. The combine
    sent each pair's partial sum $u^{(p)}_i$ back to the token's rank, so
    its transpose sends $\bar u_i$ to each rank that computed a part of it;
    the experts' backward then gives each slot's $\bar z$ and $\bar p$, and the
    transpose of the dispatch sends them back, to be summed per token. As in
    the forward, every arithmetic step is a function of the one-process
    layer (`routed_experts_backward`, `rms_norm_backward`, `route_backward`,
    `router_backward`, `shared_experts_backward`).
    """
    y, stats, saved = _ep_layer(x, params, config, comm, padded=False, reduce_before_norm=True,
                                token_ids=token_ids, mxfp8_inputs=False, save=True, what="ep_vjp",
                                return_intermediates=return_intermediates)
    xp = array_namespace(x, *params.values())
    dtype = compute_dtype(xp, x)
    m, d = x.shape
    prints = weight_fingerprints(params)  # as in stable_latent_moe_vjp: weights changed since are refused

    def weight(name: str) -> Array:
        return xp.astype(params[name], dtype, copy=False)

    def backward(dy: Array, *, dscores: Array | None = None) -> tuple[Array, MoEParams]:
        error: Exception | None = None
        try:
            check_upstream(dy, (m, d), dscores, tuple(saved.scores.shape), whose="this rank's ")
            check_weights_unchanged(params, prints)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the first exchange
            error = exc
        check_ranks_agree(comm, "ep_vjp's backward", {"dtype": dtype_name(dtype),
                                                       "dscores given": dscores is not None}, error)
        h, plan = saved.h, saved.plan
        y_bar = xp.astype(dy, dtype, copy=False)  # [m, d]
        # 9-6. The up-projection and the norm of the whole sum, on the token's own rank (this rank's share).
        u_bar, grads = latent_output_backward(y_bar, saved.u, saved.v, weight, config)  # [m, l]
        # The combine, transposed: each pair's partial sum receives its token's $\bar u_i$.
        started = time.perf_counter()
        partial_bar = alltoallv(comm, xp.take(u_bar, plan.pair_token, axis=0), plan.send_rows,
                                 saved.recv_rows)  # [R, l]
        exchange = time.perf_counter() - started
        # 4-5. This rank's experts: each slot's $\bar o_t = \bar u^{(p)}_{\text{pair}(t)}$.
        started = time.perf_counter()
        slots = saved.slots
        out_bar = xp.take(partial_bar, slots.slot_pair, axis=0)  # [T, l]
        dz_slots, dp_slots, grads["experts.w1"], grads["experts.w3"], grads["experts.w2"] = routed_experts_backward(
            slots.z_slots, slots.routed, params["experts.w1"], params["experts.w3"], params["experts.w2"],
            out_bar)  # [T, l], [T, 1], this rank's block
        # Per pair: the latent gradients of its slots summed, the weight gradients in their columns.
        dz_arrived = sum_rows(dz_slots, slots.slot_position, slots.valid)  # [R, l]
        dp_arrived = xp.where(slots.valid, xp.take(xp.reshape(dp_slots, (-1,)), xp.where(
            slots.valid, slots.slot_position, xp.zeros((), dtype=slots.slot_position.dtype))),
            xp.zeros((), dtype=dp_slots.dtype))  # [R, k]
        seconds_experts = time.perf_counter() - started
        # The dispatch, transposed: the pairs' gradients travel back to the tokens' ranks.
        started = time.perf_counter()
        dz_pairs = alltoallv(comm, dz_arrived, saved.recv_rows, plan.send_rows)  # [S, l]
        dp_pairs = alltoallv(comm, dp_arrived, saved.recv_rows, plan.send_rows)  # [S, k]
        exchange += time.perf_counter() - started
        stats.seconds["backward exchanges"] = exchange
        stats.seconds["backward experts"] = seconds_experts
        # $$\bar z_i = \sum_p \bar z^{(p)}_i, \qquad \bar p_{i,r}$$ from the rank that holds expert $\mathcal{T}_{i,r}$
        z_bar = sum_rows(dz_pairs, plan.position, plan.present)  # [m, l]
        p_bar = sum_rows(dp_pairs, plan.position, plan.present)  # [m, k]
        # 2, 1, 3, 8. To the router, the input and the shared experts, as in one process (this rank's share).
        selection = saved.selection
        x_bar, more = router_and_input_backward(h, y_bar, saved.scores, selection.index, selection.kept, p_bar,
                                                z_bar, saved.shared, weight, params, config, dscores=dscores)
        grads.update(more)
        x_bar = xp.astype(x_bar, x.dtype, copy=False)  # [m, d]
        return x_bar, MoEParams((name, grads[name]) for name in params)

    if not switch_value(return_intermediates, "return_intermediates"):  # checked on every rank by _ep_layer
        return y, stats, backward
    selection = saved.selection
    out = MoEOutput(y=y, scores=saved.scores, index=selection.index, weights=xp.astype(selection.weights, dtype),
                    z=saved.z, u=saved.u, v=saved.v, y_routed=saved.y_routed, y_shared=saved.y_shared,
                    kept=selection.kept, routed=saved.slots.routed, shared=saved.shared)
    return out, stats, backward


# ---------------------------------------------------------------------------
# The balancer across ranks
# ---------------------------------------------------------------------------

def ep_balance_update(scores: Array, bias: Array, top_k: int, comm: Any, *, bins: int = 1000) -> Array:
    r"""Appendix D across the ranks of `comm`: the next bias, identical on every rank bit for bit.

    `scores` `[m_r, n]` are this rank's sigmoid router scores for the step
    (any `m_r`, zero included), `bias` `[n]` the bias that routed it (the same
    on every rank: checked first). Each rank counts its required biases into
    the $n \times B$ histogram, one integer `Allreduce` sums the counts, and
    each rank reads the new, centred bias from the global histogram: the
    quantile of the union of all ranks' tokens, within one bin width of the
    exact Eq. (14) update.
    """
    if not all(hasattr(comm, name) for name in ("Get_size", "allgather", "Allreduce")):
        raise TypeError(f"comm must be an mpi4py communicator (Get_size, allgather, Allreduce), "
                        f"got {type(comm).__name__}")
    error: Exception | None = None
    histogram = None
    try:
        histogram = BiasHistogram(bias, top_k, bins)
        histogram.add(scores)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the first exchange
        error = exc
    fingerprint = {} if error is not None else {
        "experts": int(bias.shape[0]), "top_k": int(top_k), "bins": int(bins),
        "bias dtype": dtype_name(bias.dtype), "bias": digest(bias)}
    check_ranks_agree(comm, "ep_balance_update", fingerprint, error)
    counts = np.ascontiguousarray(to_numpy(histogram.counts))  # [n, B] int64
    from mpi4py import MPI

    # The one exchange of the step: $$\text{counts} \leftarrow \sum_{\text{ranks}} \text{counts}$$
    comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    xp = array_namespace(bias)
    histogram.counts = counts if isinstance(bias, np.ndarray) else xp.asarray(counts)
    return histogram.new_bias()


