r"""Eq. (11): the Stable LatentMoE forward pass.

$$
y \;=\; \sum_{j=1}^{N_s} E^{\text{shared}}_j(x)
\;+\; W_\uparrow\,\operatorname{RMSNorm}\!\Bigl(\sum_{i \in \mathcal{T}_k(x)} p_i\,
E^{\text{routed}}_i\bigl(W_\downarrow x\bigr)\Bigr)
$$

A K3 layer splits into two branches that see different widths.

* The **shared experts** (two in K3, merged into one GLU of width
  $N_s f = 6144$) and the **router** read the full-width token $x \in \mathbb{R}^d$.
* The **routed experts** never see $x$. One down-projection per layer,
  $W_\downarrow \in \mathbb{R}^{\ell \times d}$, shared by all 896 experts, maps
  the token to a latent $z = W_\downarrow x$ of width $\ell = d/\alpha$ (3584 in
  K3). Each expert is a three-matrix GLU on that latent,
  $E_e(z) = \operatorname{SiTU\text{-}GLU}(G_e z, U_e z)\,D_e$, and the $k$
  outputs are mixed **in the latent space**,
  $u_i = \sum_{e \in \mathcal{T}_i} p_{i,e} E_e(z_i)$.
* **Stable** addition: $v = \operatorname{RMSNorm}(u) \odot g$ before the single
  up-projection $W_\uparrow \in \mathbb{R}^{d \times \ell}$, applied once per token
  after the combine.

Why the latent: under expert parallelism a token is sent to the ranks holding
its $k$ experts (dispatch) and the results come back (combine). Because
$W_\downarrow$ comes before the dispatch and $W_\uparrow$ after the combine,
both all-to-all passes carry $\ell$-wide vectors: $k\ell$ values per token each
way instead of $kd$, which is what pays for doubling both $n$ and $k$.

Why the norm: without it (the original LatentMoE) the scale of $u$ depends
on which experts were chosen and on their weights, and $W_\uparrow$ sees that
scale directly. RMSNorm divides it out, so the routed branch is invariant to
any positive rescaling of $u$ (a routed scaling factor has no effect while the
norm is on). Under tensor or expert parallelism the partial sums of $u$ must be
**reduced before the norm**: the norm of a sum is not the sum of norms.

Switching the norm off gives the original LatentMoE; $\alpha = 1$ without the
projections gives an ordinary DeepSeek-style MoE (see `MoEConfig`).

**The computation.** `stable_latent_moe` sorts the $m k$ token-slots by
expert (`dispatch_by_expert`), runs one matrix product per expert on its
contiguous slice, and adds each token's $k$ results back together
(`combine`). Its loop runs over experts, never over tokens. Every other path
of this package (the backward pass, expert parallelism over MPI, the
training loop) calls these same functions: there is one layer, computed
once. `stable_latent_moe_reference` is the same equation written token by
token, independently of the rest of the package, for reading and for
testing; it is slow on purpose.

**After the layer: the extension points.** The K3 layer is what this page
computes first. The systems it is compared with (other score functions,
capacity with token dropping, hash routing) and K3's deployment precision
(MXFP8 activations) plug into named places of the same computation, which
the section "Extension points" at the end of the page lists: a table of
score functions, the choice rule and the serving rule of step 2 (the
routing page holds them, the page "The other routers and balancers"
registers its rules there), and a rounding hook on the experts' inputs. The
code of the layer does not branch on any of them.

Weights use the PyTorch `Linear` layout `[out, in]`, so a projection is
`x @ W.T`, and carry the Hugging Face names of the released checkpoint. The
large projections are written `matmul(x, W.T)`: that is `x @ W.T` on any
array library; on NumPy a large product's rows are shared among the
layer's own threads, which also run the expert loops, so that a large
step never wakes the BLAS's threads (the speed section of the backward
page says why).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import array_api_compat
import numpy as np

from .._lib.fast import (
    combine_in_buffers,
    fast_path_applies,
    matmul,
    on_own_threads,
    routed_experts_in_buffers,
)
from .._lib.validation import check_finite, check_float_array, check_float_dtype
from .._lib.values import generator_value, is_real, shown, switch_value
from .._lib.xp import Array, array_namespace, bincount, compute_dtype, is_numpy, to_numpy
from ..config import MoEConfig
from ..mx import MX_BLOCK, mxfp8_round
from .activations import expert_glu, expert_glu_and_grad, rms_norm
from .routing import router_scores
from .selection import Selection, select_experts

__all__ = [
    "EXPERT_INPUT_PRECISIONS",
    "Dispatch",
    "MoEOutput",
    "MoEParams",
    "RoutedActivations",
    "check_layer_inputs",
    "check_params",
    "combine",
    "down_project",
    "latent_output",
    "dispatch_by_expert",
    "init_params",
    "is_packed_stack",
    "parameter_shapes",
    "routed_experts",
    "shared_experts",
    "stable_latent_moe",
    "stable_latent_moe_reference",
]


# ---------------------------------------------------------------------------
# The forward pass
# ---------------------------------------------------------------------------

@on_own_threads
def stable_latent_moe(x: Array, params: Mapping[str, Array], config: MoEConfig, *,
                      return_intermediates: bool = False, mxfp8_inputs: bool = False,
                      token_ids: Array | None = None,
                      routing: tuple[Array, Array] | None = None,
                      save_for_backward: bool = False) -> Array | MoEOutput:
    r"""Eq. (11): one Stable LatentMoE layer on a batch `x` of shape `[m, d]`.

    `params` is any mapping with the names of `parameter_shapes(config)`; the
    expert stacks may be packed (`load_hf_layer` keeps MXFP4 experts packed
    and they are decoded one expert at a time). Returns `y`, `[m, d]`, in the
    dtype of `x` (computed in float32, or float64 for float64 input); with
    `return_intermediates=True`, a `MoEOutput` whose first field is `y`.

    The keywords are the extension points of the end of the page:
    `token_ids` (`[m]` integers) are read by a hash-routed layer
    (`config.hash_routing`), and checked whenever given; `mxfp8_inputs=True` runs the routed experts at
    K3's deployment precision for activations (each expert product's input
    rounded to MXFP8 and back, the arithmetic in float32; NumPy only, and
    `latent_size`, `intermediate_size` multiples of 32); `routing=(index,
    weights)` (both `[m, k]`) replaces step 2 with a given route (the seam the
    conformance kit uses to reproduce other routing conventions; a capacity is
    not applied to it); `save_for_backward=True` keeps what
    `refimpl.layer.backward.stable_latent_moe_vjp` reads (and implies
    `return_intermediates`).
    """
    check_layer_inputs(x, params, config)
    return_intermediates = switch_value(return_intermediates, "return_intermediates")
    mxfp8_inputs = switch_value(mxfp8_inputs, "mxfp8_inputs")
    save_for_backward = switch_value(save_for_backward, "save_for_backward")
    if mxfp8_inputs and (config.latent_size % MX_BLOCK or config.intermediate_size % MX_BLOCK):
        raise ValueError(f"mxfp8_inputs=True needs latent_size and intermediate_size that are multiples of "
                         f"{MX_BLOCK} (MXFP8 blocks), got {config.latent_size} and {config.intermediate_size}")
    xp = array_namespace(x, *(a for a in params.values() if not is_packed_stack(a)))
    if mxfp8_inputs and not is_numpy(xp):
        raise TypeError("mxfp8_inputs=True needs NumPy arrays (refimpl.mx is NumPy code)")
    dtype = compute_dtype(xp, x)

    def weight(name: str) -> Array:
        return xp.astype(params[name], dtype, copy=False)

    h = xp.astype(x, dtype, copy=False)  # [m, d]
    # 1. Router scores on the full width: $$s = \sigma(x W_r^\top)$$
    scores = router_scores(h, weight("gate.weight"), config.score_function)  # [m, n]
    # 2. Selection by $s + b$, weights from the raw $s$ (Eq. 13): $$\mathcal{T}_i = \operatorname{argtopk}_k(s_i + b)$$
    if routing is None:
        selection = select_experts(scores, params["gate.e_score_correction_bias"], config, token_ids=token_ids)
    else:
        selection = _given_routing(routing, x.shape[0], config)
    weights = xp.astype(selection.weights, dtype)  # [m, k]
    # 3. One down-projection for all routed experts: $$z = x W_\downarrow^\top$$
    z = down_project(h, weight, config)  # [m, l]
    # 4-5. Each token's k experts on the latent, mixed in the latent space:
    # $$u_i = \textstyle\sum_{e \in \mathcal{T}_i} p_{i,e} E_e(z_i)$$
    # The expert stacks go in as stored: `routed_experts` casts one expert at a time, so a
    # float16 checkpoint of K3's 896 experts is never copied whole.
    routed = routed_experts(z, selection.index, weights, params["experts.w1"], params["experts.w3"],
                            params["experts.w2"], config, mxfp8_inputs=mxfp8_inputs,
                            save=save_for_backward)
    u, routed_saved = routed if save_for_backward else (routed, None)  # [m, l]
    # 6-7. The Stable addition, then one up-projection per token after the combine:
    # $$v = \operatorname{RMSNorm}(u) \odot g, \qquad y_{\text{routed}} = v W_\uparrow^\top$$
    v, y_routed = latent_output(u, weight, config)  # [m, l], [m, d]
    # 8. Shared experts on the full width, one merged GLU of width $N_s f$.
    shared = shared_experts(h, weight("shared_experts.gate_proj.weight"), weight("shared_experts.up_proj.weight"),
                            weight("shared_experts.down_proj.weight"), config, save=save_for_backward)
    y_shared, shared_saved = shared if save_for_backward else (shared, None)  # [m, d]
    # 9. $$y = y_{\text{shared}} + y_{\text{routed}}$$
    y = xp.astype(y_shared + y_routed, x.dtype)
    if not (return_intermediates or save_for_backward):
        return y
    return MoEOutput(y=y, scores=scores, index=selection.index, weights=weights, z=z, u=u, v=v,
                     y_routed=y_routed, y_shared=y_shared, kept=selection.kept, routed=routed_saved,
                     shared=shared_saved)


@dataclass(frozen=True)
class MoEOutput:
    """The output `y` of a layer and every intermediate of Eq. (11), for teaching, tests and the backward.

    Shapes: `y`, `y_shared`, `y_routed` `[m, d]`; `scores` `[m, n]`; `index`,
    `weights` `[m, k]` (zero where a capacity dropped the assignment); `z`, `u`, `v` `[m, l]`;
    `kept` `[m, k]` bool, or None when the layer has no capacity. With
    `save_for_backward=True`, `routed` holds the `RoutedActivations` and
    `shared` the shared experts' $(h, \\partial_a\\phi, \\partial_b\\phi)$.
    """

    y: Array
    scores: Array
    index: Array
    weights: Array
    z: Array
    u: Array
    v: Array
    y_routed: Array
    y_shared: Array
    kept: Array | None = None  # [m, k] bool, which assignments a capacity served (None: no capacity)
    routed: RoutedActivations | None = None
    shared: tuple[Array, Array, Array] | None = None


def check_layer_inputs(x: Array, params: Mapping[str, Array], config: MoEConfig) -> None:
    """Raise a readable error unless `x` is a finite `[m, d]` float array and `params` fit `config`."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    check_float_array("x", x, ndim=2)
    if x.shape[1] != config.hidden_size:
        raise ValueError(f"x must have shape [m, {config.hidden_size}] (hidden_size), got {list(x.shape)}")
    check_finite("x", x)
    check_params(params, config)


# ---------------------------------------------------------------------------
# The two branches
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RoutedActivations:
    r"""What the routed experts' forward keeps for the backward: the dispatch and, per expert, $h$ and its partials.

    `hidden[e] = (h, da, db)`, each `[m_e, f]`: the GLU output of expert
    $e$'s slots and $\partial_a\phi$, $\partial_b\phi$ (from
    `expert_glu_and_grad`, the same exponentials as the value). `workspace`
    is the `[m*k, l]` buffer of the sorted outputs, spent once combined,
    which the backward may reuse (None when there is none to reuse).
    """

    dispatch: Dispatch
    hidden: dict[int, tuple[Array, Array, Array]]
    workspace: Array | None = None

    def peak(self) -> float:
        r"""The largest $|h|$ of any routed slot: what SiTU-GLU bounds by $\beta_1\beta_2$ and SwiGLU does not."""
        return max((float(to_numpy(array_namespace(h).max(array_namespace(h).abs(h))))
                    for h, _, _ in self.hidden.values() if h.shape[0]), default=0.0)


def routed_experts(z: Array, index: Array, weights: Array, w1: Array, w3: Array, w2: Array,
                   config: MoEConfig, *, mxfp8_inputs: bool = False,
                   expert_input: Callable[[Array], Array] | None = None,
                   save: bool = False) -> Array | tuple[Array, RoutedActivations]:
    r"""The routed sum $u_i = \sum_{e \in \mathcal{T}_i} p_{i,e}\,E_e(z_i)$, grouped by expert.

    `z` is the latent `[m, l]`, `index` and `weights` are `[m, k]`, and the
    expert weights are stacked: `w1`, `w3` `[n, f, l]`, `w2` `[n, l, f]`.
    Returns `u`, `[m, l]`, in the dtype of `z`. The stacks may be stored in
    a narrower dtype than `z` (a float16 checkpoint), or be packed stacks
    that decode one expert on `w[e]` (`refimpl.checkpoints.hf_checkpoint.ExpertStack`,
    MXFP4): each expert's matrices are cast or decoded when its turn comes
    and dropped before the next expert's, so at most one expert is ever held
    in the compute dtype.

    The $mk$ slots are sorted by expert (`dispatch_by_expert`), so each
    expert's tokens form one contiguous slice; each expert gathers its
    tokens' latents, runs one GLU on them and writes its outputs to its
    slice, and `combine` adds each token's $k$ results. The mixture weight
    $p_{i,e}$ multiplies the hidden activation (width $f$) before the
    down-projection rather than its output (width $\ell$), since
    $(p\,h) D^\top = p\,(h D^\top)$.

    Extension points (see the end of the page): `expert_input` rounds the
    input of each expert product (the latents before $G_e, U_e$ and the
    hidden activation before $D_e$), and the weight then multiplies the
    expert's output, as the deployment code does; `mxfp8_inputs=True` is
    `expert_input=EXPERT_INPUT_PRECISIONS["mxfp8"]`. `save=True` also returns
    the `RoutedActivations` the backward pass reads.
    """
    mxfp8_inputs, save = switch_value(mxfp8_inputs, "mxfp8_inputs"), switch_value(save, "save")
    if mxfp8_inputs:
        expert_input = EXPERT_INPUT_PRECISIONS["mxfp8"]
    xp = array_namespace(z, index, weights)
    dispatch = dispatch_by_expert(index, weights, w2.shape[0])
    if expert_input is None and fast_path_applies(z, weights):
        glus = (lambda a, b: expert_glu(a, b, config),
                lambda a, b, da: expert_glu_and_grad(a, b, config, d_gate_out=da))
        u, hidden, workspace = routed_experts_in_buffers(z, dispatch, w1, w3, w2, glus, save=save)
        return (u, RoutedActivations(dispatch, hidden, workspace)) if save else u
    out_sorted = xp.empty((index.shape[0] * index.shape[1], w2.shape[1]), dtype=z.dtype)  # [m*k, l]
    hidden: dict[int, tuple[Array, Array, Array]] = {}
    for e in dispatch.experts():
        rows = dispatch.rows(e)
        p_e = dispatch.weight[rows, :]  # [m_e, 1]
        z_e = xp.take(z, dispatch.token[rows], axis=0)  # [m_e, l], the latents of expert e's tokens
        # Expert $e$'s matrices in the dtype of `z` (free unless the stacks are stored narrower or packed).
        g_e, u_e, d_e = (xp.astype(w[e, ...], z.dtype, copy=False) for w in (w1, w3, w2))  # [f,l] [f,l] [l,f]
        if expert_input is not None:
            z_e = xp.astype(expert_input(z_e), z.dtype, copy=False)  # the rounded input, $Q(z)$
        # $$h = \operatorname{SiTU\text{-}GLU}(z G_e^\top, z U_e^\top)$$
        if save:
            hidden[e] = expert_glu_and_grad(z_e @ g_e.T, z_e @ u_e.T, config)  # [m_e, f] x3, with the partials
            h = hidden[e][0]
        else:
            h = expert_glu(z_e @ g_e.T, z_e @ u_e.T, config)  # [m_e, f]
        if expert_input is None:
            # $$p_{i,e}\, E_e(z_i) = (p_{i,e}\, h_i)\, D_e^\top$$
            out_sorted[rows, :] = (p_e * h) @ d_e.T  # [m_e, l]
        else:
            # $$p_{i,e}\, E_e(z_i) = p_{i,e}\,(Q(h_i)\, D_e^\top)$$: the weight cannot change what is rounded
            out_sorted[rows, :] = p_e * (xp.astype(expert_input(h), z.dtype, copy=False) @ d_e.T)  # [m_e, l]
        del g_e, u_e, d_e, h  # drop this expert before the next one is decoded
    u = combine(out_sorted, dispatch)  # [m, l]
    return (u, RoutedActivations(dispatch, hidden)) if save else u


def down_project(h: Array, weight: Callable[[str], Array], config: MoEConfig) -> Array:
    r"""Step 3: the latent of every token, $z = x W_\downarrow^\top$ `[m, l]` (the input itself without a latent path).

    `weight(name)` gives a parameter by its HF name, in the compute dtype.
    """
    return matmul(h, weight("routed_expert_down_proj.weight").T) if config.use_latent_projection else h


def latent_output(u: Array, weight: Callable[[str], Array], config: MoEConfig) -> tuple[Array, Array]:
    r"""Steps 6-7: $v = \operatorname{RMSNorm}(u) \odot g$ (when the norm is on) and $y_{\text{routed}} = v W_\uparrow^\top$.

    `u` `[m, l]` must be the **whole** routed sum of each token: the norm of a sum is not the sum of norms.
    `weight(name)` gives a parameter by its HF name, in the compute dtype. Returns `(v [m, l], y_routed [m, d])`.
    """
    if config.use_latent_norm:
        v = rms_norm(u, weight("routed_expert_norm.weight"), config.rms_norm_eps)  # [m, l]
    else:
        v = u
    y_routed = matmul(v, weight("routed_expert_up_proj.weight").T) if config.use_latent_projection else v  # [m, d]
    return v, y_routed


def shared_experts(x: Array, gate_proj: Array, up_proj: Array, down_proj: Array, config: MoEConfig, *,
                   save: bool = False) -> Array | tuple[Array, tuple[Array, Array, Array] | None]:
    r"""The shared experts on the full width: $\operatorname{SiTU\text{-}GLU}(x G_s^\top, x U_s^\top)\,D_s^\top$, `[m, d]`.

    $N_s$ shared experts of width $f$ summed are one GLU of width $N_s f$,
    which is how the checkpoint stores them. `save=True` also returns
    $(h, \partial_a\phi, \partial_b\phi)$ for the backward (None without shared experts).
    """
    save = switch_value(save, "save")
    xp = array_namespace(x)
    if gate_proj.shape[0] == 0:  # no shared experts
        zero = xp.zeros(x.shape, dtype=x.dtype)
        return (zero, None) if save else zero
    if save:
        hidden = expert_glu_and_grad(matmul(x, gate_proj.T), matmul(x, up_proj.T), config)  # [m, N_s f] x3
        return matmul(hidden[0], down_proj.T), hidden
    return matmul(expert_glu(matmul(x, gate_proj.T), matmul(x, up_proj.T), config), down_proj.T)


# ---------------------------------------------------------------------------
# The dispatch: token-slots sorted by expert, and the combine
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Dispatch:
    r"""The $mk$ token-slots of a route, sorted by expert: the dispatch and combine of an MoE kernel.

    Slot $t = i k + r$ is the $r$-th expert of token $i$. `token` `[m*k]`
    and `weight` `[m*k, 1]` are the sorted slots' token and mixture weight;
    expert $e$ owns sorted slots `start[e] : start[e + 1]` (`rows(e)`);
    `position[i, r]` is where slot $i k + r$ went (the inverse permutation),
    which is all the combine needs.
    """

    token: Array
    weight: Array
    start: np.ndarray
    position: Array

    def rows(self, e: int) -> slice:
        """The sorted slots of expert `e`."""
        return slice(int(self.start[e]), int(self.start[e + 1]))

    def experts(self) -> list[int]:
        """The experts that received at least one slot, in id order."""
        return np.flatnonzero(np.diff(self.start)).tolist()

    @property
    def load(self) -> np.ndarray:
        """Slots per expert, `[n]` (NumPy)."""
        return np.diff(self.start)


def dispatch_by_expert(index: Array, weights: Array, n: int) -> Dispatch:
    """Sort the token-slots of a route `index`, `weights` `[m, k]` by expert (stable: tokens keep their order)."""
    xp = array_namespace(index, weights)
    m, k = index.shape
    # Flatten the token-slots: slot $t = i k + r$ is the $r$-th expert of token $i$.
    slot_expert = xp.reshape(index, (m * k,))  # [m*k]
    order = xp.argsort(slot_expert, stable=True)  # [m*k]
    count = to_numpy(bincount(slot_expert, n))  # [n]
    return Dispatch(token=order // k,  # [m*k], the token of each sorted slot
                    weight=xp.take(xp.reshape(weights, (m * k,)), order)[:, None],  # [m*k, 1]
                    start=np.concatenate(([0], np.cumsum(count))),  # [n + 1]
                    position=xp.reshape(xp.argsort(order), (m, k)))  # [m, k]


def combine(sorted_rows: Array, dispatch: Dispatch) -> Array:
    r"""Each token's $k$ sorted rows added back into one row per token: $u_i = \sum_r o_{\text{position}[i, r]}$.

    `sorted_rows` is `[m*k, width]` in the order of the dispatch; returns
    `[m, width]`. The portable form of a scatter-add: one routing slot at a
    time, the $r$-th rows of all tokens are gathered and added, so no
    unsorted copy of the $mk$ rows is made.
    """
    if fast_path_applies(sorted_rows):
        return combine_in_buffers(sorted_rows, dispatch.position)
    xp = array_namespace(sorted_rows)
    m, k = dispatch.position.shape
    total = xp.zeros((m, sorted_rows.shape[1]), dtype=sorted_rows.dtype)  # [m, width]
    for r in range(k):
        # $$u_i \mathrel{+}= o_{\text{position}[i, r]}$$ for every token $i$ at once
        total += xp.take(sorted_rows, dispatch.position[:, r], axis=0)  # [m, width]
    return total


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------

def parameter_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every parameter of one layer, HF names, `[out, in]` layout.

    Projections are absent when `config.use_latent_projection` is false, and
    the norm gain when `config.use_latent_norm` is false.
    """
    d, ell, n, f, s = config.hidden_size, config.latent_size, config.num_experts, config.intermediate_size, config.shared_size
    shapes: dict[str, tuple[int, ...]] = {
        "gate.weight": (n, d),
        "gate.e_score_correction_bias": (n,),
    }
    if config.use_latent_projection:
        shapes["routed_expert_down_proj.weight"] = (ell, d)
    if config.use_latent_norm:
        shapes["routed_expert_norm.weight"] = (ell,)
    if config.use_latent_projection:
        shapes["routed_expert_up_proj.weight"] = (d, ell)
    shapes.update({
        "experts.w1": (n, f, ell),  # gate, per expert [f, l]
        "experts.w3": (n, f, ell),  # up,   per expert [f, l]
        "experts.w2": (n, ell, f),  # down, per expert [l, f]
        "shared_experts.gate_proj.weight": (s, d),
        "shared_experts.up_proj.weight": (s, d),
        "shared_experts.down_proj.weight": (d, s),
    })
    return shapes


class MoEParams(dict):
    """The weights of one layer: a `dict` from HF-style names to arrays.

    Any mapping with exactly the names of `parameter_shapes(config)` works
    wherever a `MoEParams` is expected; this class only adds a readable repr,
    and `tid2eid`: the table `[vocab, k]` of a layer that routes by token id
    (a DeepSeek-V4 hash layer read by `load_hf_layer`; pass it to
    `route_by_table`), None for every other layer.
    """

    tid2eid: np.ndarray | None = None

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}: {list(a.shape)}" for name, a in self.items())
        return f"MoEParams({parts})"


def init_params(config: MoEConfig, rng: np.random.Generator | int | None = None, *,
                dtype: Any = np.float32, bias_scale: float = 0.0) -> MoEParams:
    r"""Random weights for `config`, as NumPy arrays of `dtype`.

    Matrices are drawn from $\mathcal{N}(0, 1/\text{fan\_in})$ so activations
    keep unit scale through each product; the norm gain is one; the router
    bias is $\mathcal{N}(0, \text{bias\_scale}^2)$ (zero by default, as at the start of
    training). `rng` is a NumPy `Generator` or a seed. With `activation="relu2"` each gate matrix is a copy
    of its up matrix: the ungated expert $\operatorname{relu}(W z)^2$ as the GLU $\max(a, 0)\,b$.

    `bias_scale` must be a finite real number $\ge 0$ (not a bool, not a string: a `TypeError`), and the
    bias it scales must stay within the bias dtype (float32 for half weights, else `dtype`): a NaN or a
    scale of 1e300 would make the bias NaN or infinite, which every route then refuses; it is a
    `ValueError` naming `bias_scale` here instead.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    rng = generator_value(rng, "rng")
    dtype = check_float_dtype(dtype)
    scale = _bias_scale_value(bias_scale)
    params = MoEParams()
    for name, shape in parameter_shapes(config).items():
        if name == "routed_expert_norm.weight":
            value = np.ones(shape)
        elif name == "gate.e_score_correction_bias":
            params[name] = _scaled_bias(scale, rng.standard_normal(shape), dtype, bias_scale)
            continue
        else:
            fan_in = shape[-1]
            value = rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))
        params[name] = value.astype(dtype)
    if config.activation == "relu2":  # ungated experts: the GLU's gate is the up matrix itself
        params["experts.w1"] = params["experts.w3"].copy()
        params["shared_experts.gate_proj.weight"] = params["shared_experts.up_proj.weight"].copy()
    return params


def _bias_scale_value(bias_scale: Any) -> float:
    """`bias_scale` as a Python float if it is a finite real number >= 0; else an error naming it."""
    if not is_real(bias_scale):
        raise TypeError(f"bias_scale must be a real number >= 0 (the router bias's standard deviation), got "
                        f"{type(bias_scale).__name__} {shown(bias_scale)}")
    try:
        scale = float(bias_scale)
    except OverflowError:  # an int beyond float64
        scale = math.inf
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"bias_scale must be a finite number >= 0 (the router bias's standard deviation), got "
                         f"{shown(bias_scale)}")
    return scale


def _scaled_bias(scale: float, draws: np.ndarray, dtype: np.dtype, bias_scale: Any) -> np.ndarray:
    """The router bias `scale * draws` in its dtype (float32 for half weights: a half bias is refused by `route`).

    A product beyond the dtype's range would be an infinite bias: a `ValueError` naming `bias_scale`.
    """
    bias_dtype = np.dtype(np.float32) if dtype.itemsize < 4 else dtype
    with np.errstate(over="ignore"):  # an overflow is refused below, by name
        bias = (scale * draws).astype(bias_dtype)
    if not np.all(np.isfinite(bias)):
        raise ValueError(f"bias_scale must keep the router bias within {bias_dtype.name}'s range (at most "
                         f"{float(np.finfo(bias_dtype).max):.8g}), got {shown(bias_scale)}, which makes "
                         f"{int(np.sum(~np.isfinite(bias)))} of its {bias.size} entries infinite")
    return bias


def is_packed_stack(w: Any) -> bool:
    """True for an expert stack that is not an array but decodes one expert on `w[e]` (a packed MXFP4 stack)."""
    return not array_api_compat.is_array_api_obj(w) and hasattr(w, "__getitem__")


def check_params(params: Mapping[str, Array], config: MoEConfig) -> None:
    """Raise if `params` does not have exactly the names and shapes `config` needs.

    The expert stacks may be arrays or read-only stacks that decode one
    expert on `w[e]` (`refimpl.checkpoints.hf_checkpoint.ExpertStack`, e.g. MXFP4 weights
    as loaded by `load_hf_layer`); every other entry must be an array.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping from parameter names to arrays, got {type(params).__name__}")
    shapes = parameter_shapes(config)
    missing = sorted(set(shapes) - set(params))
    extra = sorted(set(params) - set(shapes))
    if missing or extra:
        raise ValueError(f"params must have exactly the names {sorted(shapes)}; missing {missing}, extra {extra}")
    for name, shape in shapes.items():
        if name.startswith("experts.") and is_packed_stack(params[name]):
            if not (hasattr(params[name], "shape") and hasattr(params[name], "dtype")):
                raise TypeError(f"params[{name!r}] must be an array or an expert stack with shape and dtype, "
                                f"got {type(params[name]).__name__}")
        check_float_array(f"params[{name!r}]", params[name])
        if tuple(params[name].shape) != shape:
            raise ValueError(f"params[{name!r}] must have shape {list(shape)}, got {list(params[name].shape)}")
    check_finite("params['gate.e_score_correction_bias']", params["gate.e_score_correction_bias"])


# ---------------------------------------------------------------------------
# Extension points
# ---------------------------------------------------------------------------

# Everything above is K3's layer. The systems it is compared with, and the precision it is deployed in,
# change the layer only at these named places; the code above calls them and never branches on a system:
#
# * **The score function** (step 1): `config.score_function` names an entry of the routing page's table
#   of score functions: K3's sigmoid, the softmax of Switch Transformer, DeepSeek-V4's $\sqrt{\operatorname{softplus}}$.
# * **The choice rule** (step 2): `config.hash_routing` picks the rule registered as `"hash"` instead of
#   K3's biased top-$k$ (`refimpl.layer.selection.EXPERT_CHOICE`); it reads `token_ids`.
# * **The serving rule** (step 2): `config.capacity_factor` applies the rule registered as `"capacity"`
#   (`refimpl.layer.selection.SERVING`), which drops the assignments an expert has no room for.
# * **The experts' input precision** (steps 4-5): `mxfp8_inputs=True` rounds each expert product's input
#   with the entry `"mxfp8"` below.
# * **A given route** (step 2): `routing=(index, weights)` bypasses the selection altogether.
#
# The page "The other routers and balancers" registers its choice and serving rules; the kit and the
# training loop use nothing else.

#: Roundings of the experts' inputs, by name (the keyword `mxfp8_inputs=True` uses `"mxfp8"`).
EXPERT_INPUT_PRECISIONS: dict[str, Callable[[Array], Array]] = {
    # MXFP8: E4M3 elements, one E8M0 scale per 32 values along the product's inner axis (`refimpl.mx`).
    "mxfp8": mxfp8_round,
}


def _given_routing(routing: Any, m: int, config: MoEConfig) -> Selection:
    """A route passed as `routing=(index, weights)`: two `[m, k]` arrays, ids in `[0, n)`, finite weights."""
    if not (isinstance(routing, tuple | list) and len(routing) == 2):
        raise TypeError(f"routing must be a pair (index, weights) of [m, k] arrays, got {type(routing).__name__}")
    index, weights = routing
    for name, a in (("index", index), ("weights", weights)):
        if tuple(getattr(a, "shape", ())) != (m, config.top_k):
            raise ValueError(f"routing's {name} must have shape [{m}, {config.top_k}] (tokens, top_k), "
                             f"got {list(getattr(a, 'shape', ()))}")
    check_float_array("routing's weights", weights)
    xp = array_namespace(index)
    if not xp.isdtype(index.dtype, "integral"):
        raise TypeError(f"routing's index must be an integer array, got dtype {index.dtype}")
    if m and (int(xp.min(index)) < 0 or int(xp.max(index)) >= config.num_experts):
        raise ValueError(f"routing's index must hold expert ids in [0, {config.num_experts - 1}], got values in "
                         f"[{int(xp.min(index))}, {int(xp.max(index))}]")
    check_finite("routing's weights", weights)
    return Selection(index, weights)


# ---------------------------------------------------------------------------
# By hand
# ---------------------------------------------------------------------------

def stable_latent_moe_reference(x: Array, params: Mapping[str, Array], config: MoEConfig, *,
                                token_ids: Array | None = None) -> np.ndarray:
    r"""Eq. (11) by hand: one token at a time, one expert at a time, in float64 NumPy.

    The same layer as `stable_latent_moe`, written as directly as possible and
    independently of the rest of the package (its own sigmoid, SiTU-GLU,
    top-k, RMSNorm, and its own versions of the other systems' rules), so the
    two can check each other. It loops over tokens in Python: use it on small
    inputs only.
    """
    check_layer_inputs(x, params, config)
    p = {name: (np.stack([np.asarray(a[e], dtype=np.float64) for e in range(config.num_experts)]) if is_packed_stack(a)
                 else to_numpy(a).astype(np.float64)) for name, a in params.items()}
    xs = to_numpy(x).astype(np.float64)
    b1, b2 = config.situ_beta, config.situ_linear_beta

    def act(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        sig = 1.0 / (1.0 + np.exp(-a))
        if config.activation == "situ":
            return (b1 * np.tanh(a / b1) * sig) * (b if b2 is None else b2 * np.tanh(b / b2))
        if config.activation == "relu2":
            return np.maximum(a, 0.0) * b  # relu(u)^2 when the gate and up weights are one matrix
        if config.swiglu_limit is not None:  # DeepSeek-V4: the gate clamped from above, the up branch both ways
            limit = config.swiglu_limit
            a = np.where(a > limit, limit, a)
            b = np.where(b > limit, limit, np.where(b < -limit, -limit, b))
            sig = 1.0 / (1.0 + np.exp(-a))
        return a * sig * b

    def score(logits: np.ndarray) -> np.ndarray:
        if config.score_function == "softmax":
            e = np.exp(logits - logits.max())
            return e / e.sum()
        if config.score_function == "sqrtsoftplus":
            return np.sqrt(np.logaddexp(0.0, logits))
        return 1.0 / (1.0 + np.exp(-logits))

    def biased_top_k(s_i: np.ndarray) -> list[int]:
        """K3's choice for one token: the k largest s + b (within the best groups), ties to the lower id."""
        biased = s_i + p["gate.e_score_correction_bias"]
        allowed = np.ones(config.num_experts, dtype=bool)
        if config.n_group > 1:
            size = config.num_experts // config.n_group
            group_score = [sum(sorted(biased[g * size:(g + 1) * size])[-2:]) for g in range(config.n_group)]
            best = sorted(range(config.n_group), key=lambda g: (-group_score[g], g))[:config.topk_group]
            allowed = np.array([j // size in best for j in range(config.num_experts)])
        return sorted((j for j in range(config.num_experts) if allowed[j]), key=lambda j: (-biased[j], j))[:config.top_k]

    def hashed_experts(token_id: int) -> list[int]:
        """The hash-routing rule by hand, with Python integers: the k experts of largest splitmix64 key."""
        mask = 2**64 - 1

        def mix(z: int) -> int:
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            return z ^ (z >> 31)

        v = mix(token_id)
        key = [mix((v + (e + 1) * 0x9E3779B97F4A7C15) & mask) >> 1 for e in range(config.num_experts)]
        return sorted(range(config.num_experts), key=lambda e: (-key[e], e))[:config.top_k]

    if config.hash_routing and token_ids is None:
        raise ValueError("token_ids must be given (an [m] integer array) when config.hash_routing is True")
    ids = None if token_ids is None else to_numpy(token_ids).tolist()
    routes = []
    for i, x_i in enumerate(xs):
        s_i = score(p["gate.weight"] @ x_i)  # [n]
        routes.append((s_i, hashed_experts(int(ids[i])) if config.hash_routing else biased_top_k(s_i)))
    # A capacity serves every token's first choice, then every second choice, ..., tokens in order.
    served = [[True] * config.top_k for _ in routes]
    if config.capacity_factor is not None:
        capacity = math.ceil(Fraction(str(config.capacity_factor)) * config.top_k * xs.shape[0] / config.num_experts)
        load = [0] * config.num_experts
        for r in range(config.top_k):
            for i, (_, chosen) in enumerate(routes):
                served[i][r] = load[chosen[r]] < capacity
                load[chosen[r]] += served[i][r]

    y = np.zeros_like(xs)
    for i, x_i in enumerate(xs):
        s_i, chosen = routes[i]
        p_i = np.array([s_i[j] for j in chosen])
        if config.renormalize:
            p_i = p_i / p_i.sum()
        # Dropped assignments weigh nothing; the others keep their weights (no renormalization).
        p_i = p_i * config.routed_scaling_factor * np.array(served[i], dtype=float)
        z_i = p["routed_expert_down_proj.weight"] @ x_i if config.use_latent_projection else x_i
        u_i = np.zeros(config.latent_size)
        for weight_ie, e in zip(p_i, chosen, strict=True):
            hidden = act(p["experts.w1"][e] @ z_i, p["experts.w3"][e] @ z_i)
            u_i += weight_ie * (p["experts.w2"][e] @ hidden)
        if config.use_latent_norm:
            u_i = u_i / np.sqrt(np.mean(u_i**2) + config.rms_norm_eps) * p["routed_expert_norm.weight"]
        y_routed = p["routed_expert_up_proj.weight"] @ u_i if config.use_latent_projection else u_i
        y_shared = np.zeros(config.hidden_size)
        if config.shared_size:
            hidden = act(p["shared_experts.gate_proj.weight"] @ x_i, p["shared_experts.up_proj.weight"] @ x_i)
            y_shared = p["shared_experts.down_proj.weight"] @ hidden
        y[i] = y_shared + y_routed
    return y
