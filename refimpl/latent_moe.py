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

**The computation.** `stable_latent_moe` is the fast path: it sorts the
$m k$ token-slots by expert, runs one matrix product per expert on its
contiguous slice, puts the results back in slot order and combines. Its loop
runs over experts, never over tokens. `stable_latent_moe_reference` is the same
equation written token by token, for reading and for testing; it is slow on
purpose.

Weights use the PyTorch `Linear` layout `[out, in]`, so a projection is
`x @ W.T`, and carry the Hugging Face names of the released checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import array_api_compat
import numpy as np

from ._xp import Array, array_namespace, bincount, compute_dtype, is_numpy, to_numpy
from .activations import rms_norm, situ_glu, swiglu
from .baselines import capacity_keep, expert_capacity, route_by_hash
from .config import MoEConfig
from .mx import MX_BLOCK, mxfp8_round
from .routing import route, router_scores
from .validation import check_finite, check_float_array

__all__ = [
    "MoEOutput",
    "MoEParams",
    "check_params",
    "init_params",
    "parameter_shapes",
    "routed_experts",
    "shared_experts",
    "stable_latent_moe",
    "stable_latent_moe_reference",
]


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------

def parameter_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every parameter of one layer, HF names, `[out, in]` layout.

    Projections are absent when `config.use_latent_projection` is false, and
    the norm gain when `config.use_latent_norm` is false.
    """
    d, ell, n, f, s = config.d, config.ell, config.n, config.f, config.shared_size
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
    wherever a `MoEParams` is expected; this class only adds a readable repr.
    """

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}: {list(a.shape)}" for name, a in self.items())
        return f"MoEParams({parts})"


def init_params(config: MoEConfig, rng: np.random.Generator | int | None = None, *,
                dtype: Any = np.float32, bias_scale: float = 0.0) -> MoEParams:
    r"""Random weights for `config`, as NumPy arrays of `dtype`.

    Matrices are drawn from $\mathcal{N}(0, 1/\text{fan\_in})$ so activations
    keep unit scale through each product; the norm gain is one; the router
    bias is $\mathcal{N}(0, \text{bias\_scale}^2)$ (zero by default, as at the start of
    training). `rng` is a NumPy `Generator` or a seed.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    rng = np.random.default_rng(rng)
    params = MoEParams()
    for name, shape in parameter_shapes(config).items():
        if name == "routed_expert_norm.weight":
            value = np.ones(shape)
        elif name == "gate.e_score_correction_bias":
            value = bias_scale * rng.standard_normal(shape)
            params[name] = value.astype(np.float32 if np.dtype(dtype).itemsize < 4 else dtype)
            continue
        else:
            fan_in = shape[-1]
            value = rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))
        params[name] = value.astype(dtype)
    return params


def _is_lazy_stack(w: Any) -> bool:
    """True for an expert stack that is not an array but decodes one expert on `w[e]` (a packed stack)."""
    return not array_api_compat.is_array_api_obj(w) and hasattr(w, "__getitem__")


def check_params(params: Mapping[str, Array], config: MoEConfig) -> None:
    """Raise if `params` does not have exactly the names and shapes `config` needs.

    The expert stacks may be arrays or read-only stacks that decode one
    expert on `w[e]` (`refimpl.checkpoint.ExpertStack`, e.g. MXFP4 weights
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
        if name.startswith("experts.") and _is_lazy_stack(params[name]):
            if not (hasattr(params[name], "shape") and hasattr(params[name], "dtype")):
                raise TypeError(f"params[{name!r}] must be an array or an expert stack with shape and dtype, "
                                f"got {type(params[name]).__name__}")
        check_float_array(f"params[{name!r}]", params[name])
        if tuple(params[name].shape) != shape:
            raise ValueError(f"params[{name!r}] must have shape {list(shape)}, got {list(params[name].shape)}")
    check_finite("params['gate.e_score_correction_bias']", params["gate.e_score_correction_bias"])


# ---------------------------------------------------------------------------
# The two branches
# ---------------------------------------------------------------------------

def _glu(a: Array, b: Array, config: MoEConfig) -> Array:
    """The expert activation chosen by the config: SiTU-GLU (K3) or SwiGLU."""
    if config.activation == "situ":
        return situ_glu(a, b, config.situ_beta, config.situ_linear_beta)
    return swiglu(a, b)


def _glu_in_place(a: Array, b: Array, config: MoEConfig) -> Array:
    r"""`_glu(a, b, config)` for NumPy float32/float64 blocks, overwriting `a` and `b`.

    The same formula as `situ_glu` (or `swiglu`), evaluated with `out=` so that
    an expert's `[m_e, f]` block is transformed where it lies, in cache, with
    one temporary instead of the dozen of the general version; at the
    benchmark size this is four times faster than `_glu`. Use it only on
    fresh products that nothing else holds. The sigmoid is the branch-free
    form of the accurate one in `activations.sigmoid`:
    $\sigma(a) = e^{\min(a, 0)} / (1 + e^{-|a|})$, exact on both sides, never
    overflowing.
    """
    # $$\sigma(a) = e^{\min(a, 0)} \,/\, (1 + e^{-|a|})$$
    sig = np.minimum(a, 0.0)  # [m_e, f], the only temporary besides the denominator
    np.exp(sig, out=sig)
    denominator = np.abs(a)
    np.negative(denominator, out=denominator)
    np.exp(denominator, out=denominator)
    denominator += 1.0
    sig /= denominator
    if config.activation == "situ":
        # $$\operatorname{softcap}(a, \beta_1) = \beta_1 \tanh(a / \beta_1)$$
        np.divide(a, config.situ_beta, out=a)
        np.tanh(a, out=a)
        a *= config.situ_beta
        if config.situ_linear_beta is not None:  # None: the up branch stays uncapped
            # $$\operatorname{softcap}(b, \beta_2) = \beta_2 \tanh(b / \beta_2)$$
            np.divide(b, config.situ_linear_beta, out=b)
            np.tanh(b, out=b)
            b *= config.situ_linear_beta
    # SiTU-GLU: $$[\operatorname{softcap}(a, \beta_1)\,\sigma(a)] \odot \operatorname{softcap}(b, \beta_2)$$
    # (SwiGLU: $[a\,\sigma(a)] \odot b$.)
    a *= sig
    a *= b
    return a


def _expert_glu(a: Array, b: Array, config: MoEConfig) -> Array:
    """The expert activation on fresh products `a`, `b`: in place on NumPy, `_glu` elsewhere."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and a.dtype in (np.float32, np.float64):
        return _glu_in_place(a, b, config)
    return _glu(a, b, config)


def routed_experts(z: Array, index: Array, weights: Array, w1: Array, w3: Array, w2: Array,
                   config: MoEConfig, *, mxfp8_inputs: bool = False) -> Array:
    r"""The routed sum $u_i = \sum_{e \in \mathcal{T}_i} p_{i,e}\,E_e(z_i)$, grouped by expert.

    `z` is the latent `[m, l]`, `index` and `weights` are `[m, k]`, and the
    expert weights are stacked: `w1`, `w3` `[n, f, l]`, `w2` `[n, l, f]`.
    Returns `u`, `[m, l]`, in the dtype of `z`. The stacks may be stored in
    a narrower dtype than `z` (a float16 checkpoint), or be packed stacks
    that decode one expert on `w[e]` (`refimpl.checkpoint.ExpertStack`,
    MXFP4): each expert's matrices are cast or decoded when its turn comes
    and dropped before the next expert's, so at most one expert is ever held
    in the compute dtype.

    `mxfp8_inputs=True` is K3's deployment precision for the activations:
    the input of each expert product (the latents $z$ before $G_e, U_e$ and
    the hidden activation $h$ before $D_e$) is rounded to MXFP8 and back
    (`refimpl.mx.mxfp8_round`, blocks of 32 along the product's inner axis)
    and the products run in the compute dtype. The mixture weight then
    multiplies the expert output, as in the reference code, so that it does
    not change what is rounded. NumPy only.

    The $mk$ (token, expert) pairs are sorted by expert so that each expert's
    tokens form one contiguous slice; each expert gathers its tokens'
    latents, runs one GLU on them and writes its outputs to its slice. This
    is the dispatch / compute / combine of an MoE kernel, on one device.
    Choices that keep it fast without changing the arithmetic's meaning:

    * the mixture weight $p_{i,e}$ multiplies the expert's hidden activation
      (width $f$) before the down-projection rather than its output (width
      $\ell$), since $(p\,h) D^\top = p\,(h D^\top)$;
    * each expert gathers only its own tokens, a block that is used at once
      while it is in cache, instead of one sorted copy of all $mk$ latents;
    * the combine, the portable form of a scatter-add, takes one routing slot
      at a time: the $r$-th outputs of all tokens are gathered from the
      sorted rows and added, so no unsorted copy of the $mk$ outputs is made.
      (Fewer large temporaries also means fewer page faults, which on a CPU
      cost as much as the copies themselves.)
    """
    xp = array_namespace(z, index, weights)
    m, k = index.shape
    n, ell = w2.shape[0], w2.shape[1]
    # Flatten the token-slots: slot $t = i k + r$ is the $r$-th expert of token $i$.
    slot_expert = xp.reshape(index, (m * k,))  # [m*k]
    # Dispatch: order the slots by expert id (stable, so tokens keep their order within an expert).
    order = xp.argsort(slot_expert, stable=True)  # [m*k]
    token_sorted = order // k  # [m*k], the token of each sorted slot
    p_sorted = xp.take(xp.reshape(weights, (m * k,)), order)[:, None]  # [m*k, 1]
    # Expert $e$ owns sorted slots `start[e] : start[e + 1]`.
    count = to_numpy(bincount(slot_expert, n))  # [n]
    start = np.concatenate(([0], np.cumsum(count)))  # [n + 1]
    out_sorted = xp.empty((m * k, ell), dtype=z.dtype)  # [m*k, l]
    for e in np.flatnonzero(count).tolist():
        rows = slice(int(start[e]), int(start[e + 1]))
        z_e = xp.take(z, token_sorted[rows], axis=0)  # [m_e, l], the latents of expert e's tokens
        # Expert $e$'s matrices in the dtype of `z` (free unless the stacks are stored narrower or packed).
        g_e, u_e, d_e = (xp.astype(w[e, ...], z.dtype, copy=False) for w in (w1, w3, w2))  # [f,l] [f,l] [l,f]
        if mxfp8_inputs:
            # Deployment precision: $$h = \operatorname{SiTU\text{-}GLU}(Q_8(z) G_e^\top, Q_8(z) U_e^\top)$$
            z_q = xp.astype(mxfp8_round(z_e), z.dtype, copy=False)  # [m_e, l]
            h = _expert_glu(z_q @ g_e.T, z_q @ u_e.T, config)  # [m_e, f]
            # $$p_{i,e}\, E_e(z_i) = p_{i,e}\,(Q_8(h_i)\, D_e^\top)$$
            h_q = xp.astype(mxfp8_round(h), z.dtype, copy=False)  # [m_e, f]
            out_sorted[rows, :] = p_sorted[rows, :] * (h_q @ d_e.T)  # [m_e, l]
        else:
            # $$h = \operatorname{SiTU\text{-}GLU}(z G_e^\top, z U_e^\top)$$
            h = _expert_glu(z_e @ g_e.T, z_e @ u_e.T, config)  # [m_e, f]
            # $$p_{i,e}\, E_e(z_i) = (p_{i,e}\, h_i)\, D_e^\top$$
            out_sorted[rows, :] = (p_sorted[rows, :] * h) @ d_e.T  # [m_e, l]
        del g_e, u_e, d_e, h  # drop this expert before the next one is decoded
    # Combine: slot $t = i k + r$ sits at sorted position `position[i, r]` (the inverse permutation).
    position = xp.reshape(xp.argsort(order), (m, k))  # [m, k]
    u = xp.zeros((m, ell), dtype=z.dtype)  # [m, l]
    for r in range(k):
        # $$u_i \mathrel{+}= p_{i,r}\, E_{\mathcal{T}_{i,r}}(z_i)$$ for every token $i$ at once
        u += xp.take(out_sorted, position[:, r], axis=0)  # [m, l]
    return u


def shared_experts(x: Array, gate_proj: Array, up_proj: Array, down_proj: Array,
                   config: MoEConfig) -> Array:
    r"""The shared experts on the full width: $\operatorname{SiTU\text{-}GLU}(x G_s^\top, x U_s^\top)\,D_s^\top$, `[m, d]`.

    $N_s$ shared experts of width $f$ summed are one GLU of width $N_s f$,
    which is how the checkpoint stores them.
    """
    xp = array_namespace(x)
    if gate_proj.shape[0] == 0:  # no shared experts
        return xp.zeros(x.shape, dtype=x.dtype)
    return _expert_glu(x @ gate_proj.T, x @ up_proj.T, config) @ down_proj.T


# ---------------------------------------------------------------------------
# The forward pass
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MoEOutput:
    """The output `y` of a layer and every intermediate of Eq. (11), for teaching and tests.

    Shapes: `y`, `y_shared`, `y_routed` `[m, d]`; `scores` `[m, n]`; `index`,
    `weights` `[m, k]` (zero where a capacity dropped the assignment); `z`, `u`, `v` `[m, l]`;
    `kept` `[m, k]` bool, or None when the layer has no capacity.
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


def _check_inputs(x: Array, params: Mapping[str, Array], config: MoEConfig) -> None:
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    check_float_array("x", x, ndim=2)
    if x.shape[1] != config.d:
        raise ValueError(f"x must have shape [m, {config.d}] (hidden_size), got {list(x.shape)}")
    check_finite("x", x)
    check_params(params, config)


def _select(scores: Array, bias: Array, config: MoEConfig,
            token_ids: Array | None) -> tuple[Array, Array, Array | None]:
    r"""The router's choice for the layer: `index`, `weights` `[m, k]`, and `kept` (None without a capacity).

    * A learned layer selects by $s + b$ (Eq. 13); a hash-routed layer
      (`config.hash_routing`, DeepSeek-V4's first layers) takes the experts a
      hash of `token_ids` gives, weighted by their raw scores.
    * With a capacity factor $c$, each expert serves at most
      $C = \lceil c\,mk/n \rceil$ assignments, rank by rank, then token by
      token; a dropped assignment's weight becomes 0 and the others are
      **not** renormalized (`capacity_keep`).
    """
    if config.hash_routing:
        if token_ids is None:
            raise ValueError("token_ids must be given (an [m] integer array) when config.hash_routing is True")
        index, weights = route_by_hash(scores, token_ids, config.k, renormalize=config.renormalize,
                                       scaling_factor=config.routed_scaling_factor)  # [m, k] each
    else:
        index, weights = route(scores, bias, config.k, renormalize=config.renormalize,
                               scaling_factor=config.routed_scaling_factor,
                               n_group=config.n_group, topk_group=config.topk_group)  # [m, k] each
    if config.capacity_factor is None:
        return index, weights, None
    xp = array_namespace(scores)
    m = scores.shape[0]
    capacity = expert_capacity(m, config.n, config.k, config.capacity_factor)
    kept = capacity_keep(index, config.n, capacity)  # [m, k] bool
    # Dropped assignments contribute nothing: $$p_{i,r} \leftarrow p_{i,r}\,\text{kept}_{i,r}$$
    return index, weights * xp.astype(kept, weights.dtype), kept


def _given_routing(routing: Any, m: int, config: MoEConfig) -> tuple[Array, Array, None]:
    """Check a route passed as `routing=(index, weights)`: two `[m, k]` arrays, ids in `[0, n)`."""
    if not (isinstance(routing, tuple | list) and len(routing) == 2):
        raise TypeError(f"routing must be a pair (index, weights) of [m, k] arrays, got {type(routing).__name__}")
    index, weights = routing
    for name, a in (("index", index), ("weights", weights)):
        if tuple(getattr(a, "shape", ())) != (m, config.k):
            raise ValueError(f"routing's {name} must have shape [{m}, {config.k}] (tokens, top_k), "
                             f"got {list(getattr(a, 'shape', ()))}")
    check_float_array("routing's weights", weights)
    xp = array_namespace(index)
    if not xp.isdtype(index.dtype, "integral"):
        raise TypeError(f"routing's index must be an integer array, got dtype {index.dtype}")
    if m and (int(xp.min(index)) < 0 or int(xp.max(index)) >= config.n):
        raise ValueError(f"routing's index must hold expert ids in [0, {config.n - 1}], got values in "
                         f"[{int(xp.min(index))}, {int(xp.max(index))}]")
    check_finite("routing's weights", weights)
    return index, weights, None


def stable_latent_moe(x: Array, params: Mapping[str, Array], config: MoEConfig, *,
                      return_intermediates: bool = False, mxfp8_inputs: bool = False,
                      token_ids: Array | None = None,
                      routing: tuple[Array, Array] | None = None) -> Array | MoEOutput:
    r"""Eq. (11): one Stable LatentMoE layer on a batch `x` of shape `[m, d]`.

    `params` is any mapping with the names of `parameter_shapes(config)`; the
    expert stacks may be packed (`load_hf_layer` keeps MXFP4 experts packed
    and they are decoded one expert at a time). `token_ids` (`[m]` integers)
    are needed only by a hash-routed layer (`config.hash_routing`).
    Returns `y`, `[m, d]`, in the dtype of `x` (computed in float32, or float64
    for float64 input); with `return_intermediates=True`, a `MoEOutput` whose
    first field is `y`.

    `mxfp8_inputs=True` runs the routed experts at K3's deployment precision
    for activations: each expert product's input is rounded to MXFP8 and back
    and the arithmetic stays in float32 (the weights are MXFP4 when the
    stacks are; see `routed_experts`). It needs NumPy arrays and
    `latent_size`, `intermediate_size` that are multiples of 32.

    `routing=(index, weights)` (both `[m, k]`) replaces step 2: the layer
    runs with that route instead of its own selection. It is the seam for
    comparing the layer under another routing convention (the conformance
    kit uses it to reproduce known porting mistakes); the layer's capacity,
    if any, is not applied to a given route.
    """
    _check_inputs(x, params, config)
    if mxfp8_inputs and (config.ell % MX_BLOCK or config.f % MX_BLOCK):
        raise ValueError(f"mxfp8_inputs=True needs latent_size and intermediate_size that are multiples of "
                         f"{MX_BLOCK} (MXFP8 blocks), got {config.ell} and {config.f}")
    xp = array_namespace(x, *(a for a in params.values() if not _is_lazy_stack(a)))
    if mxfp8_inputs and not is_numpy(xp):
        raise TypeError("mxfp8_inputs=True needs NumPy arrays (refimpl.mx is NumPy code)")
    dtype = compute_dtype(xp, x)

    def weight(name: str) -> Array:
        return xp.astype(params[name], dtype, copy=False)

    h = xp.astype(x, dtype, copy=False)  # [m, d]
    # 1. Router scores on the full width: $$s = \sigma(x W_r^\top)$$
    # (or the softmax, or DeepSeek-V4's $\sqrt{\operatorname{softplus}}$, as `config.score_function` says).
    scores = router_scores(h, weight("gate.weight"), config.score_function)  # [m, n]
    # 2. Selection by $s + b$, weights from raw $s$ (Eq. 13).
    if routing is None:
        index, weights, kept = _select(scores, params["gate.e_score_correction_bias"], config, token_ids)
    else:
        index, weights, kept = _given_routing(routing, x.shape[0], config)
    weights = xp.astype(weights, dtype)
    # 3. One down-projection for all routed experts: $$z = x W_\downarrow^\top$$
    if config.use_latent_projection:
        z = h @ weight("routed_expert_down_proj.weight").T  # [m, l]
    else:
        z = h  # alpha = 1, no projection: a plain MoE
    # 4-5. Each token's k experts on the latent, mixed in the latent space:
    # $$u_i = \textstyle\sum_{e \in \mathcal{T}_i} p_{i,e} E_e(z_i)$$
    # The expert stacks go in as stored: `routed_experts` casts one expert at a time, so a
    # float16 checkpoint of K3's 896 experts is never copied whole.
    u = routed_experts(z, index, weights, params["experts.w1"], params["experts.w3"],
                       params["experts.w2"], config, mxfp8_inputs=mxfp8_inputs)  # [m, l]
    # 6. The Stable addition: $$v = \operatorname{RMSNorm}(u) \odot g$$
    if config.use_latent_norm:
        v = rms_norm(u, weight("routed_expert_norm.weight"), config.rms_norm_eps)  # [m, l]
    else:
        v = u  # the original LatentMoE
    # 7. One up-projection, once per token after the combine: $$y_{\text{routed}} = v W_\uparrow^\top$$
    if config.use_latent_projection:
        y_routed = v @ weight("routed_expert_up_proj.weight").T  # [m, d]
    else:
        y_routed = v
    # 8. Shared experts on the full width, one merged GLU of width $N_s f$.
    y_shared = shared_experts(h, weight("shared_experts.gate_proj.weight"),
                              weight("shared_experts.up_proj.weight"),
                              weight("shared_experts.down_proj.weight"), config)  # [m, d]
    # 9. $$y = y_{\text{shared}} + y_{\text{routed}}$$
    y = xp.astype(y_shared + y_routed, x.dtype)
    if not return_intermediates:
        return y
    return MoEOutput(y=y, scores=scores, index=index, weights=weights, z=z, u=u, v=v,
                     y_routed=y_routed, y_shared=y_shared, kept=kept)


def _reference_hash(token_id: int, n: int, k: int, seed: int = 0) -> list[int]:
    """Hash routing by hand, with Python integers: the `k` experts of largest splitmix64 key."""
    mask = 2**64 - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    v = mix(token_id + (seed << 32))
    key = [mix((v + (e + 1) * 0x9E3779B97F4A7C15) & mask) >> 1 for e in range(n)]
    return sorted(range(n), key=lambda e: (-key[e], e))[:k]


def stable_latent_moe_reference(x: Array, params: Mapping[str, Array], config: MoEConfig, *,
                                token_ids: Array | None = None) -> np.ndarray:
    r"""Eq. (11) by hand: one token at a time, one expert at a time, in float64 NumPy.

    The same layer as `stable_latent_moe`, written as directly as possible and
    independently of the rest of the package (its own sigmoid, SiTU-GLU,
    top-k and RMSNorm), so the two can check each other. It loops over tokens
    in Python: use it on small inputs only.
    """
    _check_inputs(x, params, config)
    p = {name: (np.stack([np.asarray(a[e], dtype=np.float64) for e in range(config.n)]) if _is_lazy_stack(a)
                 else to_numpy(a).astype(np.float64)) for name, a in params.items()}
    xs = to_numpy(x).astype(np.float64)
    b1, b2 = config.situ_beta, config.situ_linear_beta

    def act(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        sig = 1.0 / (1.0 + np.exp(-a))
        if config.activation == "situ":
            return (b1 * np.tanh(a / b1) * sig) * (b if b2 is None else b2 * np.tanh(b / b2))
        return a * sig * b

    def score(logits: np.ndarray) -> np.ndarray:
        if config.score_function == "softmax":
            e = np.exp(logits - logits.max())
            return e / e.sum()
        if config.score_function == "sqrtsoftplus":
            return np.sqrt(np.logaddexp(0.0, logits))
        return 1.0 / (1.0 + np.exp(-logits))

    if config.hash_routing and token_ids is None:
        raise ValueError("token_ids must be given (an [m] integer array) when config.hash_routing is True")
    ids = None if token_ids is None else to_numpy(token_ids).tolist()
    # A capacity, served in the sketch's order: every token's first choice, then every second choice, ...
    capacity = None
    if config.capacity_factor is not None:
        exact = Fraction(str(config.capacity_factor)) * config.k * xs.shape[0] / config.n
        capacity = math.ceil(exact)
    routes = []
    for i, x_i in enumerate(xs):
        s_i = score(p["gate.weight"] @ x_i)  # [n]
        if config.hash_routing:
            routes.append((s_i, _reference_hash(int(ids[i]), config.n, config.k)))
            continue
        biased = s_i + p["gate.e_score_correction_bias"]
        allowed = np.ones(config.n, dtype=bool)
        if config.n_group > 1:
            size = config.n // config.n_group
            group_score = [sum(sorted(biased[g * size:(g + 1) * size])[-2:]) for g in range(config.n_group)]
            best = sorted(range(config.n_group), key=lambda g: (-group_score[g], g))[:config.topk_group]
            allowed = np.array([j // size in best for j in range(config.n)])
        # Top-k by biased score, ties to the lower id.
        chosen = sorted((j for j in range(config.n) if allowed[j]), key=lambda j: (-biased[j], j))[:config.k]
        routes.append((s_i, chosen))
    served = [[True] * config.k for _ in routes]
    if capacity is not None:
        load = [0] * config.n
        for r in range(config.k):
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
        u_i = np.zeros(config.ell)
        for weight_ie, e in zip(p_i, chosen, strict=True):
            hidden = act(p["experts.w1"][e] @ z_i, p["experts.w3"][e] @ z_i)
            u_i += weight_ie * (p["experts.w2"][e] @ hidden)
        if config.use_latent_norm:
            u_i = u_i / np.sqrt(np.mean(u_i**2) + config.rms_norm_eps) * p["routed_expert_norm.weight"]
        y_routed = p["routed_expert_up_proj.weight"] @ u_i if config.use_latent_projection else u_i
        y_shared = np.zeros(config.d)
        if config.shared_size:
            hidden = act(p["shared_experts.gate_proj.weight"] @ x_i, p["shared_experts.up_proj.weight"] @ x_i)
            y_shared = p["shared_experts.down_proj.weight"] @ hidden
        y[i] = y_shared + y_routed
    return y
