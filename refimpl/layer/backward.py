r"""The backward pass of Eqs. (11)–(13), by hand.

$$
y \;=\; \underbrace{\operatorname{GLU}(x G_s^\top, x U_s^\top)\,D_s^\top}_{\text{shared}}
\;+\; \underbrace{\operatorname{RMSNorm}\!\Bigl(\sum_{e \in \mathcal{T}_i} p_{i,e}\,
E_e\bigl(W_\downarrow x\bigr)\Bigr) \odot g \; W_\uparrow^\top}_{\text{routed}}
$$

Training needs, for a loss $L$ and the upstream gradient
$\bar y = \partial L / \partial y$ (`dy`, shape `[m, d]`), the gradient of $L$
in the input, $\bar x$, and in every parameter. This page derives each one
and computes it, stage by stage, in the reverse order of the forward page
(`refimpl.layer.latent_moe`), so the two read as a pair. A bar over a symbol is
its gradient: $\bar v = \partial L / \partial v$, with the shape of $v$.

`stable_latent_moe_vjp(x, params, config)` runs the forward pass and returns
`y` and a function `backward(dy) -> (dx, dparams)`: a vector–Jacobian product
(VJP), which is what reverse-mode autodiff computes, written out.

**What carries gradient and what does not.** The layer is piecewise smooth.
The selection $\mathcal{T}_i = \operatorname{argtopk}_k(s_i + b)$ is piecewise
constant: moving a score a little changes no chosen set (except on a tie,
where the function jumps), so the selection contributes nothing to the
derivative. The router still learns, through the **mixture weights**, which
are raw sigmoid scores of the chosen experts:
$p_{i,e} = c\,s_{i,e} / \sum_{r \in \mathcal{T}_i} s_{i,r}$. The bias $b$
enters only the selection, so its gradient is exactly zero; Quantile
Balancing, not the loss, moves it. `dparams["gate.e_score_correction_bias"]`
is therefore an array of zeros, there so that `dparams` has exactly the names
of `params`.

**The order of the stages** (forward numbering):

| stage | forward | backward |
|---|---|---|
| 9 | $y = y_s + y_r$ | $\bar y_s = \bar y_r = \bar y$ |
| 7 | $y_r = v W_\uparrow^\top$ | $\bar W_\uparrow = \bar y^\top v$, $\bar v = \bar y W_\uparrow$ |
| 6 | $v = \operatorname{RMSNorm}(u) \odot g$ | $\bar g$, $\bar u$ below |
| 4–5 | $u_i = \sum_e p_{i,e} E_e(z_i)$ | per expert: $\bar D_e, \bar G_e, \bar U_e$; $\bar z$, $\bar p$ |
| 2 | $p = c\,s_{\mathcal{T}} / \sum s_{\mathcal{T}}$ | $\bar s$ on the chosen entries |
| 1 | $s = \sigma(x W_r^\top)$ | $\bar W_r$, $\bar x$ |
| 3 | $z = x W_\downarrow^\top$ | $\bar W_\downarrow = \bar z^\top x$, $\bar x \mathrel{+}= \bar z W_\downarrow$ |
| 8 | shared GLU | $\bar G_s, \bar U_s, \bar D_s$, $\bar x$ |

Every product $Y = X W^\top$ (the PyTorch `Linear` layout) has the same two
rules, used over and over below:
$\bar X = \bar Y W$ and $\bar W = \bar Y^\top X$.

**What the forward keeps.** The VJP does not write a forward pass of its
own: it calls `stable_latent_moe(..., save_for_backward=True)`, the layer of
the forward page, which returns every intermediate (the scores, the
selection, $z$, $u$, $v$) and, for every expert, its activation $h$ **with
both partial derivatives** $\partial_a\phi$, $\partial_b\phi$. These come
from `refimpl.layer.activations.glu_and_grad`, which evaluates value and
derivatives from the same exponentials, so the backward recomputes no
product and no transcendental function: $3mk f$ routed values and
$3 m N_s f$ shared ones are the price, as in any autograd framework that
saves activations. So whatever the forward computes (any score function, a
capacity, hash routing, groups), the VJP differentiates that same layer.

**Grouped by expert.** The routed backward loops over experts, never over
tokens: the $mk$ token-slots are sorted by expert exactly as in the forward,
each expert gathers its tokens' latents and upstream gradients, and the
latent gradients of the slots are summed back per token by the same
slot-at-a-time combine. On NumPy the VJP runs both expert loops by a
labelled fast path (after the readable functions, which are the ones to
read): the same products, written into a few reused buffers and straight
into the gradient stacks, because at the benchmark size the fresh
per-expert temporaries of the readable loops cost a large share of the
step in the allocator and in page faults (the speed section below). The
four products that add up to $\bar x$ (router, down-projection, shared
gate and up) run there as one product of concatenated operands,
$[\bar z_r \,|\, \bar z \,|\, \bar a_s \,|\, \bar b_s]\,[W_r;\, W_\downarrow;\, G_s;\, U_s]$:
the same sum, one pass over the `[m, d]` result instead of four, and
enough terms per entry for the BLAS to run at its speed.

**Workspaces kept between calls.** A step's largest arrays — the three
expert gradient stacks ($3 n f \ell$ numbers, 300 MB at the benchmark
size), the sorted expert outputs and products of the forward, the results
of the large products and of the latent norm — are memory
the operating system must map and zero again whenever they are made anew,
which costs a step about half of its arithmetic again. On NumPy the fast
path takes them from a pool kept between calls (`release_workspaces()`
frees it), so `backward(dy)` costs what `backward(dy, out=grads)` costs. The
pool hands an array out again **only when nothing outside it refers to the
array any more**: gradients returned to you stay yours, and are never
written by a later call, for as long as you keep them or any view of them
(a slice, a memoryview, a tensor made by `torch.from_numpy`). When you let
them go — the next step's assignment to `grads` does — their memory serves
the step after, as PyTorch's caching allocator reuses freed tensors. So a
loop that keeps one step's gradients at a time holds two sets of them,
yours and the pool's spare. Several threads may run the layer at once:
the pool's lock and the same count keep their arrays apart. The one thing
the count cannot see is a raw address taken out of an array
(`a.ctypes.data`); code that keeps one must keep the array too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._lib.fast import (
    fast_path_applies,
    fingerprint,
    input_backward_in_one_product,
    matmul,
    on_own_threads,
    release_workspaces,
    routed_experts_backward_in_buffers,
)
from .._lib.validation import check_finite, check_float_array
from .._lib.values import switch_value
from .._lib.xp import Array, array_namespace, compute_dtype
from ..config import MoEConfig
from .activations import rms_norm_backward
from .latent_moe import MoEOutput, MoEParams, RoutedActivations, combine, is_packed_stack, stable_latent_moe
from .routing import score_function_grad, weighting

__all__ = [
    "check_upstream",
    "latent_output_backward",
    "release_workspaces",
    "route_backward",
    "routed_experts_backward",
    "router_and_input_backward",
    "router_backward",
    "shared_experts_backward",
    "stable_latent_moe_vjp",
]

Backward = Callable[..., tuple[Array, Mapping[str, Array]]]


# ---------------------------------------------------------------------------
# The whole layer
# ---------------------------------------------------------------------------

@on_own_threads
def stable_latent_moe_vjp(x: Array, params: Mapping[str, Array], config: MoEConfig, *,
                          token_ids: Array | None = None,
                          return_intermediates: bool = False) -> tuple[Array | MoEOutput, Backward]:
    r"""One Stable LatentMoE layer and its vector–Jacobian product: `(y, backward)`.

    `y` is the layer's output, `[m, d]`: exactly `stable_latent_moe(x, params,
    config, token_ids=token_ids)`, since it is that function's forward pass
    (with `return_intermediates=True`, its whole `MoEOutput`, from which a
    training loop reads its statistics without a second forward).
    `backward(dy)` takes the upstream gradient $\bar y = \partial L / \partial y$,
    `[m, d]`, and returns `(dx, dparams)`: `dx` $= \partial L / \partial x$
    `[m, d]` in the dtype of `x`, and `dparams` a `MoEParams` with exactly the
    names of `params`, each gradient in its parameter's dtype when that is
    float32 or float64 and in the compute dtype otherwise (a half-precision
    weight gets a float32 gradient). The bias entry is zeros (the bias only
    selects). The arithmetic runs in the forward's compute dtype (float32, or
    float64 for float64 input). `backward` may be called more than once,
    and from several threads at once: each call writes arrays of its own.

    Every configuration the forward accepts is differentiated: the sigmoid,
    softmax and $\sqrt{\operatorname{softplus}}$ score functions, groups, a
    capacity (a dropped assignment gets no gradient), hash routing (the
    weights still come from the router's scores, so the router learns).

    `backward(dy, dscores=g)` adds a gradient `g` `[m, n]` in the router's
    scores (an auxiliary balance loss computed from `y.scores`), so the
    layer's one backward carries it to the router and the input.

    `backward(dy, out=grads)` writes the gradients into the arrays of `grads`
    instead of new ones, as NumPy's `out=` does, and returns that same
    mapping as `dparams`: it must have the names, shapes and dtypes of the
    `dparams` above (the `dparams` of an earlier step will do, once its
    values are used), and no array of it may overlap another, a parameter,
    `x`, `dy` or `dscores` (all read while the gradients are written). A
    training loop saves by it what matters most on a CPU at
    scale: the three expert gradient stacks, $3 n f \ell$ numbers (300 MB at
    the benchmark size), are written where they lie instead of being
    allocated and faulted in by the kernel again at every step. Without
    `out=`, on NumPy, the new gradient arrays come from the layer's pool of
    workspaces (`release_workspaces`): memory of gradients you have let go
    of, never of ones you still hold, so the default call costs what `out=`
    costs once the loop has run a step.
    """
    return_intermediates = switch_value(return_intermediates, "return_intermediates")
    # The forward pass of `refimpl.layer.latent_moe`, keeping what the backward reads.
    fwd = stable_latent_moe(x, params, config, token_ids=token_ids, save_for_backward=True)
    xp = array_namespace(x)
    dtype = compute_dtype(xp, x)
    m, d = x.shape
    # The backward must differentiate the forward that ran: the input is kept as it was (a copy, `m d`
    # numbers; the caller may reuse its array), and the weights, too large to copy, are fingerprinted.
    x_kept = xp.astype(x, dtype, copy=True)  # [m, d]
    z_kept = latent_for_backward(fwd, x_kept, config)  # [m, l]
    prints = weight_fingerprints(params)

    def weight(name: str) -> Array:
        return xp.astype(params[name], dtype, copy=False)

    @on_own_threads
    def backward(dy: Array, *, out: Mapping[str, Array] | None = None,
                 dscores: Array | None = None) -> tuple[Array, Mapping[str, Array]]:
        check_upstream(dy, (m, d), dscores, tuple(fwd.scores.shape))
        check_weights_unchanged(params, prints)
        if out is not None:
            read = {"x": x, "dy": dy, **({} if dscores is None else {"dscores": dscores})}
            _check_out(out, params, lambda name: _grad_dtype(xp, params[name], dtype), inputs=read)
        h = x_kept  # [m, d]
        y_bar = xp.astype(dy, dtype, copy=False)  # [m, d]
        # 9-6. $$y = y_s + y_r \;\Rightarrow\; \bar y_s = \bar y_r = \bar y$$, then the up-projection and the norm.
        u_bar, grads = latent_output_backward(y_bar, fwd.u, fwd.v, weight, config)  # [m, l]
        # 4-5. The routed experts, grouped by expert: $\bar z$, $\bar p$ and the three stacks.
        z_bar, p_bar, grads["experts.w1"], grads["experts.w3"], grads["experts.w2"] = routed_experts_backward(
            z_kept, fwd.routed, params["experts.w1"], params["experts.w3"], params["experts.w2"], u_bar,
            None if out is None else (out["experts.w1"], out["experts.w3"], out["experts.w2"]))
        # 2, 1, 3, 8. The weights to the router, the latent to the input, the shared experts.
        x_bar, more = router_and_input_backward(h, y_bar, fwd.scores, fwd.index, fwd.kept, p_bar, z_bar,
                                                fwd.shared, weight, params, config, dscores=dscores)
        grads.update(more)
        x_bar = xp.astype(x_bar, x.dtype, copy=False)
        if out is None:
            return x_bar, MoEParams((name, xp.astype(grads[name], _grad_dtype(xp, params[name], dtype),
                                                     copy=False)) for name in params)
        for name in params:
            if grads[name] is not out[name]:  # the expert stacks were written in place already
                out[name][...] = grads[name]
        return x_bar, out

    return (fwd if return_intermediates else fwd.y), backward


def latent_for_backward(fwd: MoEOutput, x_kept: Array, config: MoEConfig) -> Array:
    r"""The latent $z$ the backward reads, `[m, l]`: the forward's, or the kept input where $z$ is the input.

    Without a latent projection `down_project` returns the input itself, so
    `fwd.z` may be the caller's own array (a float32 input needs no cast),
    which the caller may change before calling `backward`. The kept copy of
    the input holds the same values as they were; with a projection `fwd.z` is
    the layer's own product and is read as it is, with no copy.
    """
    return fwd.z if config.use_latent_projection else x_kept


def weight_fingerprints(params: Mapping[str, Array]) -> dict[str, bytes | float]:
    """One value per weight: what `check_weights_unchanged` compares after the forward (`weight_fingerprint`)."""
    return {name: weight_fingerprint(value) for name, value in params.items()}


def weight_fingerprint(value: Any) -> bytes | float:
    """A weight's fingerprint: equal at two times if the weight did not change in between.

    On NumPy, `refimpl._lib.fast.fingerprint`: integer sums of the array's
    bytes by rows and columns of blocks, in one read of the weight from memory,
    on as many threads as the BLAS may use. Any change of one entry moves it, however
    small (an optimizer step, zeroing, a new load), and so do a rescale by any
    power of two or by $-1$ (of the whole weight or of one expert's matrix),
    sign flips of a few entries, and two experts' matrices or two rows
    swapped; that function says exactly what it cannot see (a rearrangement
    that keeps every row and column sum of a block). A packed expert stack is
    fingerprinted by the bytes it stores (`packed_stack_fingerprint`).
    Elsewhere (CuPy, `array_api_strict`), the sum of the entries in the
    compute dtype, which a change too small to survive the sum's rounding, a
    rearrangement or two sign flips of equal entries would not move.
    """
    if isinstance(value, np.ndarray):
        return fingerprint(value)
    if is_packed_stack(value):
        return packed_stack_fingerprint(value)
    xp = array_namespace(value)
    return float(xp.sum(value, dtype=compute_dtype(xp, value)))


def packed_stack_fingerprint(stack: Any) -> bytes:
    """The fingerprint of a stack that decodes one expert on `stack[e]` (`refimpl.checkpoints.ExpertStack`).

    The weights are what the stored bytes decode to, so an `ExpertStack` is
    fingerprinted by its `parts` (MXFP4 blocks and scales, or dense matrices,
    each `refimpl._lib.fast.fingerprint`), with its format, dtype and shape:
    one read of the stored bytes, decoding nothing. A stack without `parts`
    is fingerprinted by its experts decoded one at a time.
    """
    header = f"{getattr(stack, 'format', type(stack).__name__)} {np.dtype(stack.dtype).str} {tuple(stack.shape)}"
    digest = hashlib.sha256(header.encode())
    parts = getattr(stack, "parts", None)
    if parts is not None:
        for expert in parts:
            for stored in expert:
                digest.update(fingerprint(np.asarray(stored)))
    else:
        for e in range(stack.shape[0]):
            digest.update(fingerprint(np.asarray(stack[e])))
    return digest.digest()


def check_weights_unchanged(params: Mapping[str, Array], prints: Mapping[str, bytes | float]) -> None:
    """A `ValueError` naming the first weight whose fingerprint moved since the forward pass."""
    now = weight_fingerprints(params)
    for name, before in prints.items():
        after = now.get(name)
        if after != before and not (after != after and before != before):  # NaN equals NaN here
            raise ValueError(f"params[{name!r}] changed between the forward pass and backward(): the gradients "
                             "would be those of other weights; call stable_latent_moe_vjp again after changing "
                             "the weights (update them after backward, as a training step does)")


def check_upstream(dy: Array, y_shape: tuple[int, int], dscores: Array | None, scores_shape: tuple[int, int],
                   *, whose: str = "") -> None:
    """A backward's upstream gradients: `dy` finite and of the shape of `y`, `dscores` (if given) of the scores'.

    `whose` ("this rank's ") goes into the messages of a layer split over ranks.
    """
    check_float_array("dy", dy, ndim=2)
    if tuple(dy.shape) != tuple(y_shape):
        raise ValueError(f"dy must have the shape of {whose}y, {list(y_shape)}, got {list(dy.shape)}")
    check_finite("dy", dy)
    if dscores is not None:
        check_float_array("dscores", dscores, ndim=2)
        if tuple(dscores.shape) != tuple(scores_shape):
            raise ValueError(f"dscores must have the shape of {whose or 'the '}scores, {list(scores_shape)}, "
                             f"got {list(dscores.shape)}")
        check_finite("dscores", dscores)


def _overlaps(a: Any, b: Any) -> bool:
    """Whether two arrays share memory (NumPy's exact test; other libraries: the same object)."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    return a is b


def _check_out(out: Mapping[str, Array], params: Mapping[str, Array], grad_dtype: Callable[[str], Any], *,
               inputs: Mapping[str, Array]) -> None:
    """`backward`'s `out=`: the names of `params`, each a writable array of its gradient's shape and dtype.

    No two targets may overlap, and none may overlap a parameter or an input:
    the backward reads those while it writes the gradients, and an alias
    would return gradients computed from half-overwritten values.
    """
    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a mapping of gradient arrays (the dparams of an earlier call), "
                        f"got {type(out).__name__}")
    missing, extra = sorted(set(params) - set(out)), sorted(set(out) - set(params))
    if missing or extra:
        raise ValueError(f"out must have exactly the names of params; missing {missing}, unexpected {extra}")
    for name in params:
        target, shape, dtype = out[name], tuple(params[name].shape), grad_dtype(name)
        if tuple(getattr(target, "shape", ())) != shape or getattr(target, "dtype", None) != dtype:
            raise ValueError(f"out[{name!r}] must be an array of shape {list(shape)} and dtype {dtype}, got "
                             f"shape {list(getattr(target, 'shape', ()))} and dtype {getattr(target, 'dtype', None)}")
        if isinstance(target, np.ndarray) and not target.flags.writeable:
            raise ValueError(f"out[{name!r}] must be writable")
    names = list(params)
    for i, name in enumerate(names):
        for other in names[i + 1:]:
            if _overlaps(out[name], out[other]):
                raise ValueError(f"out[{name!r}] and out[{other!r}] share memory: each gradient needs an "
                                 "array of its own")
        for what, array in [*((f"params[{p!r}]", params[p]) for p in names), *inputs.items()]:
            if _overlaps(out[name], array):
                raise ValueError(f"out[{name!r}] shares memory with {what}, which the backward reads while "
                                 "it writes the gradients: pass separate arrays")


def _grad_dtype(xp: Any, param: Array, dtype: Any) -> Any:
    """A gradient's dtype: its parameter's, unless that cannot hold it (a packed or integer store)."""
    if getattr(param, "dtype", None) is not None and param.dtype in (xp.float32, xp.float64):
        return param.dtype
    return dtype


# ---------------------------------------------------------------------------
# Stages 4–5 differentiated: the routed experts, grouped by expert
# ---------------------------------------------------------------------------

def routed_experts_backward(z: Array, saved: RoutedActivations, w1: Array, w3: Array, w2: Array, du: Array,
                            out: tuple[Array, Array, Array] | None = None,
                            ) -> tuple[Array, Array, Array, Array, Array]:
    r"""Gradients of $u_i = \sum_{e \in \mathcal{T}_i} p_{i,e} E_e(z_i)$ in $z$, $p$ and the expert stacks.

    Slot $t$ of token $i$ and expert $e$ computed $a_t = z_i G_e^\top$,
    $b_t = z_i U_e^\top$ (both $[f]$), $h_t = \phi(a_t, b_t)$ and contributed
    $p_t\, h_t D_e^\top$ to $u_i$. With $\bar u_i$ given, let
    $\bar o_t = \bar u_i D_e$ (width $f$), the gradient reaching the hidden
    activation before the weight. Then

    $$\bar p_t = \bar o_t \cdot h_t, \qquad \bar h_t = p_t\,\bar o_t, \qquad
    \bar D_e = \textstyle\sum_{t \in e} \bar u_i^\top (p_t h_t),$$

    $$\bar a_t = \bar h_t \odot \partial_a\phi, \quad \bar b_t = \bar h_t \odot \partial_b\phi, \quad
    \bar G_e = \textstyle\sum_{t \in e} \bar a_t^\top z_i, \quad \bar U_e = \textstyle\sum_{t \in e} \bar b_t^\top z_i,$$

    $$\bar z_i = \textstyle\sum_{t \in i} \bigl(\bar a_t G_e + \bar b_t U_e\bigr).$$

    `saved` is what `refimpl.layer.latent_moe.routed_experts(..., save=True)` kept.
    Shapes: `z`, `du` `[m, l]`; stacks as in the forward (`w1`, `w3`
    `[n, f, l]`, `w2` `[n, l, f]`). Returns `(dz [m, l], dweights [m, k],
    dw1, dw3, dw2)`, all in the dtype of `z`. Experts that received no token
    get zero gradients. `out` (three stacks of the gradients' shapes and
    dtype) receives the stack gradients instead of new arrays.
    """
    if fast_path_applies(z, du) and (out is None or fast_path_applies(z, *out)):
        return routed_experts_backward_in_buffers(z, saved, w1, w3, w2, du, out)
    xp = array_namespace(z, du)
    dispatch = saved.dispatch
    (m, k), (n, ell, f) = dispatch.position.shape, w2.shape
    dz_sorted = xp.empty((m * k, ell), dtype=z.dtype)  # [m*k, l]
    dp_sorted = xp.empty((m * k,), dtype=z.dtype)  # [m*k]
    dw1 = xp.zeros((n, f, ell), dtype=z.dtype)
    dw3 = xp.zeros((n, f, ell), dtype=z.dtype)
    dw2 = xp.zeros((n, ell, f), dtype=z.dtype)
    for e in dispatch.experts():
        rows = dispatch.rows(e)
        z_e = xp.take(z, dispatch.token[rows], axis=0)  # [m_e, l]
        du_e = xp.take(du, dispatch.token[rows], axis=0)  # [m_e, l]
        p_e = dispatch.weight[rows, :]  # [m_e, 1]
        h, dh_da, dh_db = saved.hidden[e]  # [m_e, f] each
        g_e, u_e, d_e = (xp.astype(w[e, ...], z.dtype, copy=False) for w in (w1, w3, w2))  # [f,l] [f,l] [l,f]
        # The gradient at the weighted hidden activation: $$\bar o_t = \bar u_i D_e$$
        o_bar = du_e @ d_e  # [m_e, f]
        # $$\bar p_t = \bar o_t \cdot h_t$$
        dp_sorted[rows] = xp.sum(o_bar * h, axis=1)
        # $$\bar D_e = \textstyle\sum_t \bar u_i^\top (p_t h_t)$$
        dw2[e, ...] = du_e.T @ (p_e * h)  # [l, f]
        # $$\bar a_t = p_t\,\bar o_t \odot \partial_a\phi, \qquad \bar b_t = p_t\,\bar o_t \odot \partial_b\phi$$
        h_bar = p_e * o_bar  # [m_e, f]
        a_bar = h_bar * dh_da  # [m_e, f]
        b_bar = h_bar * dh_db  # [m_e, f]
        # $$\bar G_e = \textstyle\sum_t \bar a_t^\top z_i, \qquad \bar U_e = \textstyle\sum_t \bar b_t^\top z_i$$
        dw1[e, ...] = a_bar.T @ z_e  # [f, l]
        dw3[e, ...] = b_bar.T @ z_e  # [f, l]
        # Each slot's share of the latent gradient: $$\bar a_t G_e + \bar b_t U_e$$
        dz_sorted[rows, :] = a_bar @ g_e + b_bar @ u_e  # [m_e, l]
    # Back to slot order, and the $k$ shares of each token summed:
    # $$\bar z_i = \textstyle\sum_r \bigl(\bar a_{i,r} G_{\mathcal{T}_{i,r}} + \bar b_{i,r} U_{\mathcal{T}_{i,r}}\bigr)$$
    dweights = xp.reshape(xp.take(dp_sorted, xp.reshape(dispatch.position, (m * k,))), (m, k))  # [m, k]
    if out is not None:
        for target, value in zip(out, (dw1, dw3, dw2), strict=True):
            target[...] = value
        dw1, dw3, dw2 = out
    return combine(dz_sorted, dispatch), dweights, dw1, dw3, dw2


# ---------------------------------------------------------------------------
# Stage 2 differentiated: the weights through renormalization and scaling
# ---------------------------------------------------------------------------

def route_backward(scores: Array, index: Array, dweights: Array, *, renormalize: bool,
                   scaling_factor: float) -> Array:
    r"""The gradient in the chosen raw scores, `[m, k]`, from the gradient in the weights `dweights` `[m, k]`.

    With $\hat s_{i,r} = s_{i,\mathcal{T}_{i,r}}$, $S_i = \sum_r \hat s_{i,r}$ and
    $p_{i,r} = c\,\hat s_{i,r} / S_i$, the Jacobian
    $\partial p_{i,r'}/\partial \hat s_{i,r} = c\,(\delta_{r r'} / S_i - \hat s_{i,r'} / S_i^2)$ gives

    $$\bar{\hat s}_{i,r} = \frac{c}{S_i}\Bigl(\bar p_{i,r} - \sum_{r'} \bar p_{i,r'}\,\frac{\hat s_{i,r'}}{S_i}\Bigr).$$

    The sum is over the chosen experts only, so a token's weights always add
    to $c$ and moving them all up together does nothing: for $k = 1$ the
    gradient is exactly zero. Without renormalization, $\bar{\hat s} = c\,\bar p$.
    The selection itself is piecewise constant and contributes nothing.
    """
    renormalize, scaling_factor = weighting(renormalize, scaling_factor)
    xp = array_namespace(scores, index, dweights)
    s_hat = xp.take_along_axis(xp.astype(scores, dweights.dtype), index, axis=-1)  # [m, k]
    if not renormalize:
        # $$\bar{\hat s} = c\,\bar p$$
        return scaling_factor * dweights
    s_sum = xp.sum(s_hat, axis=-1, keepdims=True)  # [m, 1]
    # $$\bar{\hat s}_{i,r} = \tfrac{c}{S_i}\bigl(\bar p_{i,r} - \textstyle\sum_{r'} \bar p_{i,r'} \hat s_{i,r'} / S_i\bigr)$$
    # (With the shares $\hat s / S$ formed first, $k = 1$ gives $\bar p - \bar p \cdot 1 = 0$ exactly.)
    mean_dp = xp.sum(dweights * (s_hat / s_sum), axis=-1, keepdims=True)  # [m, 1]
    return (scaling_factor / s_sum) * (dweights - mean_dp)


# ---------------------------------------------------------------------------
# Stage 1 differentiated: the score function, to the router logits
# ---------------------------------------------------------------------------

def router_backward(scores: Array, index: Array, ds_hat: Array, score_function: str = "sigmoid",
                    dscores: Array | None = None) -> Array:
    r"""The gradient in the router logits $z_{i,j} = x_i \cdot W_r[j]$, `[m, n]`, from that in the chosen scores.

    The chosen scores' gradient `ds_hat` `[m, k]` is scattered to the dense
    $\bar s$ `[m, n]` (zero off the chosen experts: an unchosen expert's
    score enters no weight), one routing slot at a time like the forward's
    combine; a token's $k$ experts are distinct, so no entry is written
    twice. `dscores` `[m, n]`, if given, is a further gradient in all the
    scores (an auxiliary balance loss computed from them) and is added.
    Then the score function's derivative (`refimpl.layer.routing.score_function_grad`):
    for the sigmoid $\bar z_{i,j} = \bar s_{i,j}\, s_{i,j}(1 - s_{i,j})$, so
    only the chosen entries (and those of `dscores`) are non-zero; a softmax
    spreads the gradient over every logit of the token.
    """
    xp = array_namespace(scores, index, ds_hat)
    m, n = scores.shape
    experts = xp.arange(n, dtype=index.dtype)  # [n]
    s_bar = xp.zeros((m, n), dtype=ds_hat.dtype)  # [m, n]
    for r in range(index.shape[1]):
        # $$\bar s_{i,\mathcal{T}_{i,r}} = \bar{\hat s}_{i,r}$$
        s_bar += xp.where(index[:, r:r + 1] == experts[None, :], ds_hat[:, r:r + 1], 0.0)
    if dscores is not None:
        s_bar = s_bar + xp.astype(dscores, s_bar.dtype)
    return score_function_grad(xp.astype(scores, s_bar.dtype), s_bar, score_function)


# ---------------------------------------------------------------------------
# Stage 8 differentiated: the shared experts
# ---------------------------------------------------------------------------

def shared_experts_backward(x: Array, gate_proj: Array, up_proj: Array, down_proj: Array,
                            hidden: tuple[Array, Array, Array] | None,
                            dy: Array) -> tuple[Array, Array, Array, Array]:
    r"""Gradients of $y_s = \phi(x G_s^\top, x U_s^\top)\,D_s^\top$ in $x$, $G_s$, $U_s$, $D_s$.

    The same rules as one routed expert, on every token and without a
    weight: $\bar D_s = \bar y^\top h$, $\bar h = \bar y D_s$,
    $\bar a = \bar h \odot \partial_a\phi$, $\bar b = \bar h \odot \partial_b\phi$,
    $\bar G_s = \bar a^\top x$, $\bar U_s = \bar b^\top x$ and
    $\bar x = \bar a G_s + \bar b U_s$. `hidden` is what the forward kept,
    `(h, da, db)`; with no shared experts (None) every gradient is zero.
    """
    xp = array_namespace(x, dy)
    if hidden is None:
        return (xp.zeros(x.shape, dtype=x.dtype), xp.zeros(gate_proj.shape, dtype=x.dtype),
                xp.zeros(up_proj.shape, dtype=x.dtype), xp.zeros(down_proj.shape, dtype=x.dtype))
    h, dh_da, dh_db = hidden  # [m, N_s f] each
    # $$\bar D_s = \bar y^\top h, \qquad \bar h = \bar y D_s$$
    d_down = dy.T @ h  # [d, N_s f]
    h_bar = dy @ down_proj  # [m, N_s f]
    # $$\bar a = \bar h \odot \partial_a\phi, \qquad \bar b = \bar h \odot \partial_b\phi$$
    a_bar = h_bar * dh_da
    b_bar = h_bar * dh_db
    # $$\bar G_s = \bar a^\top x, \quad \bar U_s = \bar b^\top x, \quad \bar x = \bar a G_s + \bar b U_s$$
    return a_bar @ gate_proj + b_bar @ up_proj, a_bar.T @ x, b_bar.T @ x, d_down


# ---------------------------------------------------------------------------
# The stages around the routed experts, in the order the backward meets them
# ---------------------------------------------------------------------------

def latent_output_backward(y_bar: Array, u: Array, v: Array, weight: Callable[[str], Array],
                           config: MoEConfig) -> tuple[Array, dict[str, Array]]:
    r"""Stages 9, 7 and 6 in reverse: from $\bar y$ to $\bar u$, with the up-projection's and the norm's gradients.

    $y = y_s + y_r$ passes $\bar y$ to both branches; then
    $\bar W_\uparrow = \bar y^\top v$, $\bar v = \bar y W_\uparrow$, and the norm's
    backward (`refimpl.layer.activations.rms_norm_backward`) gives $\bar u$ and $\bar g$.
    `u`, `v` are the forward's `[m, l]`; `weight(name)` a parameter in the
    compute dtype. Returns `(u_bar [m, l], grads)`.
    """
    grads: dict[str, Array] = {}
    # 7. The up-projection: $$\bar W_\uparrow = \bar y^\top v, \qquad \bar v = \bar y W_\uparrow$$
    if config.use_latent_projection:
        grads["routed_expert_up_proj.weight"] = matmul(y_bar.T, v)  # [d, l]
        v_bar = matmul(y_bar, weight("routed_expert_up_proj.weight"))  # [m, l]
    else:
        v_bar = y_bar
    # 6. RMSNorm on the latent sum.
    if config.use_latent_norm:
        u_bar, grads["routed_expert_norm.weight"] = rms_norm_backward(
            u, weight("routed_expert_norm.weight"), v_bar, config.rms_norm_eps)  # [m, l], [l]
    else:
        u_bar = v_bar
    return u_bar, grads


def router_and_input_backward(h: Array, y_bar: Array, scores: Array, index: Array, kept: Array | None,
                              p_bar: Array, z_bar: Array, shared: tuple[Array, Array, Array] | None,
                              weight: Callable[[str], Array], params: Mapping[str, Array], config: MoEConfig, *,
                              dscores: Array | None = None) -> tuple[Array, dict[str, Array]]:
    r"""Stages 2, 1, 3 and 8 in reverse: from $\bar p$ and $\bar z$ to $\bar x$, with the router's, the down-projection's and the shared experts' gradients.

    `h` is the input in the compute dtype, `y_bar` the upstream gradient,
    `scores`, `index`, `kept` the forward's selection, `p_bar` `[m, k]` and
    `z_bar` `[m, l]` what the routed experts' backward returned, `shared` the
    shared experts' saved activations. Returns `(x_bar [m, d], grads)` with
    the router's, the bias's (zeros), the down-projection's and the shared
    experts' gradients.
    """
    xp = array_namespace(h, y_bar)
    grads: dict[str, Array] = {}
    # A capacity holds a dropped assignment's weight at zero: no gradient reaches its score.
    if kept is not None:
        p_bar = p_bar * xp.astype(kept, p_bar.dtype)  # [m, k]
    # 2. The weights, through renormalization and scaling, to the chosen raw scores.
    s_hat_bar = route_backward(scores, index, p_bar, renormalize=config.renormalize,
                               scaling_factor=config.routed_scaling_factor)  # [m, k]
    # 1. The score function, to the router logits (for the sigmoid: zero off the chosen experts).
    logit_bar = router_backward(scores, index, s_hat_bar, config.score_function, dscores)  # [m, n]
    # The bias only selects: $$\bar b = 0$$
    grads["gate.e_score_correction_bias"] = xp.zeros(params["gate.e_score_correction_bias"].shape, dtype=h.dtype)
    if config.use_latent_projection and fast_path_applies(h, y_bar, logit_bar, z_bar):
        # On NumPy the four products of $\bar x$ below run as one (`refimpl._lib.fast`); same gradients.
        x_bar, more = input_backward_in_one_product(
            h, y_bar, logit_bar, z_bar, shared, weight("gate.weight"), weight("routed_expert_down_proj.weight"),
            weight("shared_experts.gate_proj.weight"), weight("shared_experts.up_proj.weight"),
            weight("shared_experts.down_proj.weight"))
        return x_bar, {**grads, **more}
    # $$\bar W_r = \bar z^\top x, \qquad \bar x = \bar z\, W_r$$
    grads["gate.weight"] = logit_bar.T @ h  # [n, d]
    x_bar = logit_bar @ weight("gate.weight")  # [m, d]
    # 3. The down-projection: $$\bar W_\downarrow = \bar z^\top x, \qquad \bar x \mathrel{+}= \bar z W_\downarrow$$
    if config.use_latent_projection:
        grads["routed_expert_down_proj.weight"] = z_bar.T @ h  # [l, d]
        x_bar = x_bar + z_bar @ weight("routed_expert_down_proj.weight")
    else:
        x_bar = x_bar + z_bar  # z = x
    # 8. The shared experts on the full width.
    shared_x_bar, grads["shared_experts.gate_proj.weight"], grads["shared_experts.up_proj.weight"], \
        grads["shared_experts.down_proj.weight"] = shared_experts_backward(
            h, weight("shared_experts.gate_proj.weight"), weight("shared_experts.up_proj.weight"),
            weight("shared_experts.down_proj.weight"), shared, y_bar)
    return x_bar + shared_x_bar, grads
