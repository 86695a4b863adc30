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
(`refimpl.latent_moe`), so the two read as a pair. A bar over a symbol is
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

**What the forward keeps.** The VJP runs the forward pass of
`refimpl.latent_moe` stage by stage with the same functions (`router_scores`,
`route`, `rms_norm`) and keeps what the backward reads: the scores, the
route, $z$, $u$, $v$, and for every expert its activation $h$ **with both
partial derivatives** $\partial_a\phi$, $\partial_b\phi$. These come from
`glu_and_grad`, which evaluates value and derivatives from the same
exponentials, so the backward recomputes no product and no transcendental
function: $3mk f$ routed values and $3 m N_s f$ shared ones are the price,
as in any autograd framework that saves activations.

**Grouped by expert.** The routed backward loops over experts, never over
tokens: the $mk$ token-slots are sorted by expert exactly as in the forward,
each expert gathers its tokens' latents and upstream gradients, and the
latent gradients of the slots are summed back per token by the same
slot-at-a-time combine. On NumPy the VJP runs both expert loops by a
labelled fast path (after the readable functions, which are the ones to
read): the same products, written into a few reused buffers and straight
into the gradient stacks, because at the benchmark size the fresh
per-expert temporaries of the readable loops cost a large share of the
step in the allocator and in page faults (the speed section below).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._xp import Array, array_namespace, bincount, compute_dtype, to_numpy
from .activations import _sech2, rms_norm, sigmoid
from .config import MoEConfig
from .latent_moe import MoEParams, _check_inputs, _select
from .routing import router_scores
from .validation import check_finite, check_float_array

__all__ = ["glu_and_grad", "rms_norm_backward", "stable_latent_moe_vjp"]

Backward = Callable[..., tuple[Array, Mapping[str, Array]]]


# ---------------------------------------------------------------------------
# Eq. (12) differentiated: the expert activation and its two partials
# ---------------------------------------------------------------------------

def glu_and_grad(a: Array, b: Array, activation: str = "situ", beta: float = 4.0,
                 linear_beta: float | None = 25.0) -> tuple[Array, Array, Array]:
    r"""The GLU $h = \phi(a, b)$ and its partials $\partial_a \phi$, $\partial_b \phi$, all three at once.

    For SiTU-GLU, $\phi(a, b) = \gamma(a)\,\lambda(b)$ with the capped gate
    $\gamma(a) = \operatorname{softcap}(a, \beta_1)\,\sigma(a)$ and the capped
    up branch $\lambda(b) = \operatorname{softcap}(b, \beta_2)$; `linear_beta=None`
    leaves the up branch uncapped, $\lambda(b) = b$ (the meaning of an absent
    `activation_situ_linear_beta` in the released code). For SwiGLU,
    $\gamma(a) = a\,\sigma(a)$ and $\lambda(b) = b$. In every case

    $$\partial_a \phi = \gamma'(a)\,\lambda(b), \qquad \partial_b \phi = \gamma(a)\,\lambda'(b).$$

    The three share their sigmoid and tanh, which is why they are computed
    together. `a` and `b` are pre-activations of the same shape, in float32
    or float64 (the caller's compute dtype).
    """
    xp = array_namespace(a, b)
    sig = sigmoid(a)
    # $$\sigma'(a) = \sigma(a)\,\sigma(-a)$$ (no cancellation, unlike $\sigma(1 - \sigma)$)
    sig_prime = sig * sigmoid(-a)
    if activation == "situ":
        capped = beta * xp.tanh(a / beta)
        # $$\gamma(a) = \beta_1 \tanh(a/\beta_1)\,\sigma(a)$$
        gamma = capped * sig
        # $$\gamma'(a) = \operatorname{sech}^2(a/\beta_1)\,\sigma(a) + \beta_1\tanh(a/\beta_1)\,\sigma'(a)$$
        gamma_prime = _sech2(a / beta) * sig + capped * sig_prime
    else:
        # $$\gamma(a) = a\,\sigma(a), \qquad \gamma'(a) = \sigma(a) + a\,\sigma'(a)$$
        gamma = a * sig
        gamma_prime = sig + a * sig_prime
    if activation == "situ" and linear_beta is not None:
        # $$\lambda(b) = \beta_2 \tanh(b/\beta_2), \qquad \lambda'(b) = \operatorname{sech}^2(b/\beta_2)$$
        lam = linear_beta * xp.tanh(b / linear_beta)
        lam_prime = _sech2(b / linear_beta)
        d_up = gamma * lam_prime
    else:
        # Uncapped up branch: $$\lambda(b) = b, \qquad \lambda'(b) = 1$$
        lam = b
        d_up = gamma
    return gamma * lam, gamma_prime * lam, d_up


def _config_glu_and_grad(a: Array, b: Array, config: MoEConfig) -> tuple[Array, Array, Array]:
    """`glu_and_grad` with the activation and caps of `config`."""
    return glu_and_grad(a, b, config.activation, config.situ_beta, config.situ_linear_beta)


# **Fast path** (NumPy only; the same arithmetic as `glu_and_grad` above, which is the one to read).
def _glu_and_grad_in_place(a: np.ndarray, b: np.ndarray, config: MoEConfig,
                           da: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""`glu_and_grad` for NumPy float32/float64 blocks, in place: $h$ over `a`, $\partial_b\phi$ over `b`.

    $\partial_a\phi$ goes into `da` (a new array if None). The same formulas
    with every step written into an existing buffer, with four temporaries
    instead of some twenty, and with fewer exponentials: three `exp` and two
    `tanh` per entry instead of six and two, which is what costs most on a
    CPU. One identity saves them: with $t = e^{-|a|}$,
    $\sigma'(a) = \sigma(a)\sigma(-a) = t/(1+t)^2$ and
    $\sigma(a) = \max(t, [a \ge 0]) / (1 + t)$. The derivative of a cap is
    $\operatorname{sech}^2(u) = 4e/(1+e)^2$ with $e = e^{-2|u|}$, as in
    `activations` (no cancellation, unlike $1 - \tanh^2$). (Getting $\tanh$
    from the same $e$, as $(1-e)/(1+e)$, would save one more call but loses
    digits: $1 - e$ cancels for small $|u|$, and $e$ rebuilt from `expm1`
    cancels for large $|u|$.)
    """
    situ = config.activation == "situ"
    # $$t = e^{-|a|}, \qquad \sigma(a) = \frac{\max(t, [a \ge 0])}{1 + t}, \qquad \sigma'(a) = \frac{t}{(1 + t)^2}$$
    abs_a = np.abs(a)
    gamma_prime = np.negative(abs_a, out=da)
    np.exp(gamma_prime, out=gamma_prime)  # t
    one_plus = gamma_prime + 1.0
    sig = np.maximum(gamma_prime, a >= 0)
    sig /= one_plus
    gamma_prime /= one_plus
    gamma_prime /= one_plus  # sigma'(a)
    if situ:
        beta = config.situ_beta
        # $$\operatorname{softcap}(a, \beta_1) = \beta_1 \tanh(a/\beta_1), \qquad
        #   \operatorname{sech}^2(a/\beta_1) = \frac{4e}{(1+e)^2}, \quad e = e^{-2|a|/\beta_1}$$
        gamma = np.divide(a, beta)
        np.tanh(gamma, out=gamma)
        gamma *= beta  # softcap(a, beta1)
        e = abs_a
        e *= -2.0 / beta
        np.exp(e, out=e)
        np.add(e, 1.0, out=one_plus)
        np.reciprocal(one_plus, out=one_plus)  # 1 / (1 + e)
        e *= one_plus
        e *= one_plus
        e *= 4.0  # sech^2(a / beta1)
        # $$\gamma'(a) = \operatorname{sech}^2(a/\beta_1)\,\sigma(a) + \operatorname{softcap}(a, \beta_1)\,\sigma'(a)$$
        gamma_prime *= gamma
        e *= sig
        gamma_prime += e
        # $$\gamma(a) = \operatorname{softcap}(a, \beta_1)\,\sigma(a)$$
        gamma *= sig
    else:
        # $$\gamma(a) = a\,\sigma(a), \qquad \gamma'(a) = \sigma(a) + a\,\sigma'(a)$$
        gamma = np.multiply(a, sig, out=abs_a)
        gamma_prime *= a
        gamma_prime += sig
    lam_prime = None
    if situ and config.situ_linear_beta is not None:
        beta = config.situ_linear_beta
        # The up branch the same way:
        # $$\lambda(b) = \operatorname{softcap}(b, \beta_2), \qquad \lambda'(b) = \operatorname{sech}^2(b/\beta_2)$$
        lam_prime = np.abs(b)
        lam_prime *= -2.0 / beta
        np.exp(lam_prime, out=lam_prime)  # e
        np.add(lam_prime, 1.0, out=one_plus)
        np.reciprocal(one_plus, out=one_plus)  # 1 / (1 + e)
        b /= beta
        np.tanh(b, out=b)
        b *= beta  # lambda(b)
        lam_prime *= one_plus
        lam_prime *= one_plus
        lam_prime *= 4.0
    # $$h = \gamma(a)\,\lambda(b), \qquad \partial_a\phi = \gamma'(a)\,\lambda(b)$$
    h = np.multiply(gamma, b, out=a)
    gamma_prime *= b
    if lam_prime is not None:
        # $$\partial_b\phi = \gamma(a)\,\lambda'(b)$$
        d_up = np.multiply(lam_prime, gamma, out=b)
    else:
        # Uncapped up branch: $\lambda(b) = b$, $\partial_b\phi = \gamma(a)$
        np.copyto(b, gamma)
        d_up = b
    return h, gamma_prime, d_up


# Rows of a block that the in-place GLU transforms at a time: some 16,000 entries, so that its
# temporaries stay in the core's own cache instead of streaming through memory once per operation.
_GLU_CHUNK = 1 << 14


def _expert_glu_and_grad(a: Array, b: Array, config: MoEConfig) -> tuple[Array, Array, Array]:
    """`glu_and_grad` with the config's activation, on fresh products: in place on NumPy float32/64, by row chunks."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and a.dtype in (np.float32, np.float64) and a.ndim == 2 and a.flags.c_contiguous \
            and b.flags.c_contiguous:
        da = np.empty_like(a)  # [rows, f]
        step = max(1, _GLU_CHUNK // max(1, a.shape[1]))
        for start in range(0, a.shape[0], step):
            rows = slice(start, start + step)
            _glu_and_grad_in_place(a[rows], b[rows], config, da[rows])
        return a, da, b
    return _config_glu_and_grad(a, b, config)


# ---------------------------------------------------------------------------
# Stage 6 differentiated: RMSNorm on the latent sum
# ---------------------------------------------------------------------------

def rms_norm_backward(u: Array, weight: Array, dv: Array, eps: float) -> tuple[Array, Array]:
    r"""Gradients of $v = \operatorname{RMSNorm}(u) \odot g$ in $u$ and in the gain $g$.

    With $\rho_i = \sqrt{\operatorname{mean}_c(u_{i,c}^2) + \varepsilon}$ and
    $\hat u_i = u_i / \rho_i$, $v_i = \hat u_i \odot g$, so
    $\bar g = \sum_i \bar v_i \odot \hat u_i$ and, writing $\bar{\hat u} = \bar v \odot g$,

    $$\bar u_i = \frac{1}{\rho_i}\Bigl(\bar{\hat u}_i - \hat u_i\,
    \operatorname{mean}_c\bigl(\bar{\hat u}_{i,c}\,\hat u_{i,c}\bigr)\Bigr).$$

    The second term is the norm's own Jacobian: the component of the
    gradient along $u_i$ is removed (up to $\varepsilon$), because scaling
    $u_i$ does not change $v_i$. `u`, `dv` are `[m, l]` and `weight` `[l]`;
    returns `(du [m, l], dweight [l])`.
    """
    xp = array_namespace(u, weight, dv)
    # $$\rho_i = \sqrt{\tfrac{1}{\ell}\textstyle\sum_c u_{i,c}^2 + \varepsilon}$$
    rho = xp.sqrt(xp.mean(u * u, axis=-1, keepdims=True) + eps)  # [m, 1]
    u_hat = u / rho  # [m, l]
    # $$\bar g = \textstyle\sum_i \bar v_i \odot \hat u_i$$
    dweight = xp.sum(dv * u_hat, axis=0)  # [l]
    du_hat = dv * weight  # [m, l]
    # $$\bar u_i = \bigl(\bar{\hat u}_i - \hat u_i \operatorname{mean}(\bar{\hat u}_i \odot \hat u_i)\bigr) / \rho_i$$
    du = (du_hat - u_hat * xp.mean(du_hat * u_hat, axis=-1, keepdims=True)) / rho  # [m, l]
    return du, dweight


# ---------------------------------------------------------------------------
# Stages 4–5, forward and backward: the routed experts, grouped by expert
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Slots:
    """The dispatch of the $mk$ token-slots, sorted by expert, as the forward pass makes it.

    Slot $t = i k + r$ is the $r$-th expert of token $i$. `token` `[m*k]` and
    `weight` `[m*k, 1]` are the sorted slots' token and mixture weight;
    expert $e$ owns sorted slots `start[e] : start[e + 1]`; `position[i, r]`
    is where slot $i k + r$ went (the inverse permutation).
    """

    token: Array
    weight: Array
    start: np.ndarray
    position: Array

    def rows(self, e: int) -> slice:
        return slice(int(self.start[e]), int(self.start[e + 1]))

    def experts(self) -> list[int]:
        """The experts that received at least one token."""
        return np.flatnonzero(np.diff(self.start)).tolist()


def _sort_slots(index: Array, weights: Array, n: int) -> _Slots:
    """Sort the token-slots by expert (stable, so tokens keep their order within an expert)."""
    xp = array_namespace(index, weights)
    m, k = index.shape
    slot_expert = xp.reshape(index, (m * k,))  # [m*k]
    order = xp.argsort(slot_expert, stable=True)  # [m*k]
    count = to_numpy(bincount(slot_expert, n))  # [n]
    return _Slots(token=order // k, weight=xp.take(xp.reshape(weights, (m * k,)), order)[:, None],
                  start=np.concatenate(([0], np.cumsum(count))),
                  position=xp.reshape(xp.argsort(order), (m, k)))


def _combine(sorted_rows: Array, slots: _Slots) -> Array:
    """Sum each token's $k$ sorted rows back into one row per token, one routing slot at a time."""
    xp = array_namespace(sorted_rows)
    m, k = slots.position.shape
    total = xp.zeros((m, sorted_rows.shape[1]), dtype=sorted_rows.dtype)  # [m, width]
    for r in range(k):
        total += xp.take(sorted_rows, slots.position[:, r], axis=0)  # [m, width]
    return total


def _combine_fast(sorted_rows: np.ndarray, slots: _Slots) -> np.ndarray:
    """`_combine` on NumPy, gathering each slot's rows into one reused buffer (same sums, same order)."""
    m, k = slots.position.shape
    total = np.take(sorted_rows, slots.position[:, 0], axis=0)  # [m, width]
    rows = np.empty_like(total)  # [m, width]
    for r in range(1, k):
        total += np.take(sorted_rows, slots.position[:, r], axis=0, out=rows)
    return total


@dataclass(frozen=True)
class _RoutedSaved:
    r"""What the routed forward keeps for the backward: the dispatch, and per expert $h$, $\partial_a\phi$, $\partial_b\phi$."""

    slots: _Slots
    hidden: dict[int, tuple[Array, Array, Array]]
    # The fast path's `[m*k, l]` sorted-output buffer, kept for the backward's sorted latent gradients.
    workspace: np.ndarray | None = None


def routed_experts_forward(z: Array, index: Array, weights: Array, w1: Array, w3: Array, w2: Array,
                           config: MoEConfig) -> tuple[Array, _RoutedSaved]:
    r"""The routed sum $u_i = \sum_{e \in \mathcal{T}_i} p_{i,e} E_e(z_i)$, `[m, l]`, and what its backward needs.

    The grouped computation of `refimpl.latent_moe.routed_experts`, with one
    difference: each expert's activation is evaluated by `glu_and_grad`, so
    its two partial derivatives come out of the same exponentials as the
    value and are kept, with $h$, for the backward ($3 m k f$ values). The
    backward then recomputes nothing.
    """
    xp = array_namespace(z, index, weights)
    slots = _sort_slots(index, weights, w2.shape[0])
    out_sorted = xp.empty((index.shape[0] * index.shape[1], w2.shape[1]), dtype=z.dtype)  # [m*k, l]
    hidden = {}
    for e in slots.experts():
        rows = slots.rows(e)
        z_e = xp.take(z, slots.token[rows], axis=0)  # [m_e, l]
        g_e, u_e, d_e = (xp.astype(w[e, ...], z.dtype, copy=False) for w in (w1, w3, w2))  # [f,l] [f,l] [l,f]
        # $$h = \phi(z G_e^\top, z U_e^\top)$$ with its partials $\partial_a\phi$, $\partial_b\phi$
        hidden[e] = _expert_glu_and_grad(z_e @ g_e.T, z_e @ u_e.T, config)  # [m_e, f] x3
        # $$p_{i,e}\, E_e(z_i) = (p_{i,e}\, h_i)\, D_e^\top$$
        out_sorted[rows, :] = (slots.weight[rows, :] * hidden[e][0]) @ d_e.T  # [m_e, l]
    return _combine(out_sorted, slots), _RoutedSaved(slots, hidden)


# **Fast path** (NumPy only; the same products as `routed_experts_forward` above, which is the one to read).
def _routed_experts_forward_fast(z: np.ndarray, index: Array, weights: Array, w1: Array, w3: Array, w2: Array,
                                 config: MoEConfig) -> tuple[np.ndarray, _RoutedSaved]:
    r"""`routed_experts_forward` for NumPy float32/float64: the gather and the weighted activation in reused buffers.

    Each expert's latents are gathered into one buffer sized for the busiest
    expert, $p\,h$ is formed in another, and the down-projection is written
    straight into its rows of the sorted output (`out=`), so the only fresh
    arrays per expert are the two products the backward keeps.
    """
    slots = _sort_slots(index, weights, w2.shape[0])
    dtype = z.dtype
    out_sorted = np.empty((index.shape[0] * index.shape[1], w2.shape[1]), dtype=dtype)  # [m*k, l]
    hidden = {}
    experts = slots.experts()
    busiest = int(np.max(np.diff(slots.start))) if experts else 0
    z_buf = np.empty((busiest, z.shape[1]), dtype=dtype)  # [m_e, l]
    ph_buf = np.empty((busiest, w1.shape[1]), dtype=dtype)  # [m_e, f]
    for e in experts:
        rows = slots.rows(e)
        m_e = rows.stop - rows.start
        z_e, ph = z_buf[:m_e], ph_buf[:m_e]
        np.take(z, slots.token[rows], axis=0, out=z_e, mode="clip")  # [m_e, l]
        g_e, u_e, d_e = (np.asarray(w[e, ...], dtype=dtype) for w in (w1, w3, w2))  # [f,l] [f,l] [l,f]
        hidden[e] = _expert_glu_and_grad(z_e @ g_e.T, z_e @ u_e.T, config)  # [m_e, f] x3
        np.multiply(hidden[e][0], slots.weight[rows, :], out=ph)
        np.matmul(ph, d_e.T, out=out_sorted[rows, :])  # [m_e, l]
    # The sorted outputs are spent once combined: the buffer is kept for the backward's sorted gradients.
    return _combine_fast(out_sorted, slots), _RoutedSaved(slots, hidden, workspace=out_sorted)


def _routed_forward(z: Array, index: Array, weights: Array, w1: Array, w3: Array, w2: Array,
                    config: MoEConfig) -> tuple[Array, _RoutedSaved]:
    """`routed_experts_forward`, by the fast path on NumPy float32/float64."""
    if isinstance(z, np.ndarray) and isinstance(weights, np.ndarray) and z.dtype == weights.dtype \
            and z.dtype in (np.float32, np.float64):
        return _routed_experts_forward_fast(z, index, weights, w1, w3, w2, config)
    return routed_experts_forward(z, index, weights, w1, w3, w2, config)


def routed_experts_backward(z: Array, saved: _RoutedSaved, w1: Array, w3: Array, w2: Array,
                            du: Array) -> tuple[Array, Array, Array, Array, Array]:
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

    Shapes: `z`, `du` `[m, l]`; stacks as in the forward (`w1`, `w3`
    `[n, f, l]`, `w2` `[n, l, f]`). Returns `(dz [m, l], dweights [m, k],
    dw1, dw3, dw2)`, all in the dtype of `z`. Experts that received no token
    get zero gradients.
    """
    xp = array_namespace(z, du)
    slots = saved.slots
    (m, k), (n, ell, f) = slots.position.shape, w2.shape
    dz_sorted = xp.empty((m * k, ell), dtype=z.dtype)  # [m*k, l]
    dp_sorted = xp.empty((m * k,), dtype=z.dtype)  # [m*k]
    dw1 = xp.zeros((n, f, ell), dtype=z.dtype)
    dw3 = xp.zeros((n, f, ell), dtype=z.dtype)
    dw2 = xp.zeros((n, ell, f), dtype=z.dtype)
    for e in slots.experts():
        rows = slots.rows(e)
        z_e = xp.take(z, slots.token[rows], axis=0)  # [m_e, l]
        du_e = xp.take(du, slots.token[rows], axis=0)  # [m_e, l]
        p_e = slots.weight[rows, :]  # [m_e, 1]
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
    dweights = xp.reshape(xp.take(dp_sorted, xp.reshape(slots.position, (m * k,))), (m, k))  # [m, k]
    return _combine(dz_sorted, slots), dweights, dw1, dw3, dw2


# **Fast path** (NumPy only; the same products as `routed_experts_backward` above, which is the one to read).
def _routed_experts_backward_fast(z: np.ndarray, saved: _RoutedSaved, w1: Array, w3: Array, w2: Array,
                                  du: np.ndarray, out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`routed_experts_backward` for NumPy float32/float64, with a handful of reused buffers.

    The readable loop makes some fifteen fresh arrays per expert (gathers,
    products, elementwise temporaries, then a copy of each weight gradient
    into its stack). At the benchmark size that is close to a gigabyte of
    short-lived memory per backward, which the allocator keeps handing back
    to the system and faulting in again: the products themselves then run at
    half the speed they reach alone. Here every per-expert array is a slice
    of one of six buffers sized for the busiest expert, gathers and products
    write into them (`out=`), and the three weight gradients are written by
    their product straight into the stack (`out=dw[e]`), which is allocated
    empty and zeroed only for experts without tokens. A transposed operand
    (`a.T` of a C-contiguous block) costs no copy: BLAS reads it with its
    transpose flag. With `out` (three stacks of the gradients' shapes and
    dtype, from an earlier step) the gradients are written there instead of
    into new stacks.
    """
    slots = saved.slots
    (m, k), (n, ell, f) = slots.position.shape, w2.shape
    dtype = z.dtype
    dz_sorted = saved.workspace if saved.workspace is not None else np.empty((m * k, ell), dtype=dtype)  # [m*k, l]
    dp_sorted = np.empty((m * k,), dtype=dtype)  # [m*k]
    dw1, dw3, dw2 = out if out is not None else (np.empty((n, f, ell), dtype=dtype),
                                                 np.empty((n, f, ell), dtype=dtype),
                                                 np.empty((n, ell, f), dtype=dtype))
    experts = slots.experts()
    idle = np.setdiff1d(np.arange(n), experts)
    dw1[idle], dw3[idle], dw2[idle] = 0, 0, 0
    busiest = int(np.max(np.diff(slots.start)))
    z_buf, du_buf, lat_buf = (np.empty((busiest, ell), dtype=dtype) for _ in range(3))  # [m_e, l] each
    o_buf, a_buf, b_buf = (np.empty((busiest, f), dtype=dtype) for _ in range(3))  # [m_e, f] each
    for e in experts:
        rows = slots.rows(e)
        m_e = rows.stop - rows.start
        z_e, du_e, lat, o_bar, a_bar, b_bar = (buf[:m_e] for buf in (z_buf, du_buf, lat_buf, o_buf, a_buf, b_buf))
        np.take(z, slots.token[rows], axis=0, out=z_e, mode="clip")  # [m_e, l]
        np.take(du, slots.token[rows], axis=0, out=du_e, mode="clip")  # [m_e, l]
        p_e = slots.weight[rows, :]  # [m_e, 1]
        h, dh_da, dh_db = saved.hidden[e]  # [m_e, f] each
        g_e, u_e, d_e = (np.asarray(w[e, ...], dtype=dtype) for w in (w1, w3, w2))  # [f,l] [f,l] [l,f]
        np.matmul(du_e, d_e, out=o_bar)  # o_bar = du_e D_e
        np.multiply(o_bar, h, out=a_bar)
        np.sum(a_bar, axis=1, out=dp_sorted[rows])  # dp = o_bar . h
        np.multiply(h, p_e, out=a_bar)
        np.matmul(du_e.T, a_bar, out=dw2[e])  # dD_e = du_e^T (p h)
        o_bar *= p_e  # h_bar
        np.multiply(o_bar, dh_da, out=a_bar)
        np.multiply(o_bar, dh_db, out=b_bar)
        np.matmul(a_bar.T, z_e, out=dw1[e])  # dG_e = a_bar^T z_e
        np.matmul(b_bar.T, z_e, out=dw3[e])  # dU_e = b_bar^T z_e
        np.matmul(a_bar, g_e, out=dz_sorted[rows])  # a_bar G_e
        dz_sorted[rows] += np.matmul(b_bar, u_e, out=lat)  # + b_bar U_e
    dweights = np.take(dp_sorted, slots.position.reshape(m * k)).reshape(m, k)  # [m, k]
    return _combine_fast(dz_sorted, slots), dweights, dw1, dw3, dw2


def _routed_backward(z: Array, saved: _RoutedSaved, w1: Array, w3: Array, w2: Array, du: Array,
                     out: tuple[Array, Array, Array] | None = None) -> tuple[Array, Array, Array, Array, Array]:
    """`routed_experts_backward`, by the fast path on NumPy float32/float64 (which writes into `out` if given)."""
    if isinstance(z, np.ndarray) and isinstance(du, np.ndarray) and z.dtype == du.dtype \
            and z.dtype in (np.float32, np.float64) \
            and (out is None or all(isinstance(o, np.ndarray) and o.dtype == z.dtype for o in out)):
        return _routed_experts_backward_fast(z, saved, w1, w3, w2, du, out)
    return routed_experts_backward(z, saved, w1, w3, w2, du)


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


def router_backward(scores: Array, index: Array, ds_hat: Array) -> Array:
    r"""The gradient in the router logits $\ell_{i,j} = x_i \cdot W_r[j]$, `[m, n]`, from that in the chosen scores.

    Only the $k$ chosen entries of each row are non-zero:
    $\bar\ell_{i,j} = \bar s_{i,j}\,\sigma'(\ell_{i,j}) = \bar s_{i,j}\, s_{i,j}(1 - s_{i,j})$
    for $j \in \mathcal{T}_i$, and 0 elsewhere (an unchosen expert's score
    enters no weight). The scatter into the dense `[m, n]` array takes one
    routing slot at a time, like the combine of the forward: a token's $k$
    experts are distinct, so no entry is written twice.
    """
    xp = array_namespace(scores, index, ds_hat)
    m, n = scores.shape
    s_hat = xp.take_along_axis(xp.astype(scores, ds_hat.dtype), index, axis=-1)  # [m, k]
    # $$\bar\ell_{i,\mathcal{T}_{i,r}} = \bar{\hat s}_{i,r}\, \hat s_{i,r} (1 - \hat s_{i,r})$$
    dlogit_hat = ds_hat * s_hat * (1.0 - s_hat)  # [m, k]
    experts = xp.arange(n, dtype=index.dtype)  # [n]
    dlogits = xp.zeros((m, n), dtype=ds_hat.dtype)  # [m, n]
    for r in range(index.shape[1]):
        dlogits += xp.where(index[:, r:r + 1] == experts[None, :], dlogit_hat[:, r:r + 1], 0.0)
    return dlogits


# ---------------------------------------------------------------------------
# Stage 8, forward and backward: the shared experts
# ---------------------------------------------------------------------------

def shared_experts_forward(x: Array, gate_proj: Array, up_proj: Array, down_proj: Array,
                           config: MoEConfig) -> tuple[Array, tuple[Array, Array, Array] | None]:
    r"""$y_s = \phi(x G_s^\top, x U_s^\top)\,D_s^\top$, `[m, d]`, and $(h, \partial_a\phi, \partial_b\phi)$ for the backward.

    `refimpl.latent_moe.shared_experts` with the activation's partials kept,
    as in `routed_experts_forward`. With no shared experts (width 0) $y_s = 0$
    and nothing is kept.
    """
    xp = array_namespace(x)
    if gate_proj.shape[0] == 0:
        return xp.zeros(x.shape, dtype=x.dtype), None
    hidden = _expert_glu_and_grad(x @ gate_proj.T, x @ up_proj.T, config)  # [m, N_s f] x3
    return hidden[0] @ down_proj.T, hidden


def shared_experts_backward(x: Array, gate_proj: Array, up_proj: Array, down_proj: Array,
                            hidden: tuple[Array, Array, Array] | None,
                            dy: Array) -> tuple[Array, Array, Array, Array]:
    r"""Gradients of $y_s = \phi(x G_s^\top, x U_s^\top)\,D_s^\top$ in $x$, $G_s$, $U_s$, $D_s$.

    The same rules as one routed expert, on every token and without a
    weight: $\bar D_s = \bar y^\top h$, $\bar h = \bar y D_s$,
    $\bar a = \bar h \odot \partial_a\phi$, $\bar b = \bar h \odot \partial_b\phi$,
    $\bar G_s = \bar a^\top x$, $\bar U_s = \bar b^\top x$ and
    $\bar x = \bar a G_s + \bar b U_s$. With no shared experts (width 0)
    every gradient is zero.
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
# The whole layer
# ---------------------------------------------------------------------------

def _check_config_supported(config: MoEConfig) -> None:
    """The backward covers the sigmoid router (with or without a capacity); refuse anything else by name."""
    score_function = getattr(config, "score_function", "sigmoid")
    if score_function != "sigmoid":
        raise ValueError(
            f"stable_latent_moe_vjp differentiates the sigmoid router only; config.score_function must be "
            f"'sigmoid', got {score_function!r}")


def stable_latent_moe_vjp(x: Array, params: Mapping[str, Array],
                          config: MoEConfig, *, token_ids: Array | None = None) -> tuple[Array, Backward]:
    r"""One Stable LatentMoE layer and its vector–Jacobian product: `(y, backward)`.

    `y` is the layer's output, `[m, d]`, equal to `stable_latent_moe(x,
    params, config)` to rounding. `backward(dy)` takes the upstream gradient
    $\bar y = \partial L / \partial y$, `[m, d]`, and returns `(dx, dparams)`:
    `dx` $= \partial L / \partial x$ `[m, d]` in the dtype of `x`, and `dparams`
    a `MoEParams` with exactly the names of `params`, each gradient in its
    parameter's dtype when that is float32 or float64 and in the compute
    dtype otherwise (a half-precision weight gets a float32 gradient). The
    bias entry is zeros (the bias only selects). The arithmetic runs in the
    forward's compute dtype (float32, or float64 for float64 input).
    `backward` may be called more than once. `token_ids` (`[m]`) are passed to
    a hash-routed layer; with a capacity, dropped assignments get no gradient.

    `backward(dy, out=grads)` writes the gradients into the arrays of `grads`
    instead of new ones, as NumPy's `out=` does, and returns that same
    mapping as `dparams`: it must have the names, shapes and dtypes of the
    `dparams` above (the `dparams` of an earlier step will do, once its
    values are used). A training loop saves by it what matters most on a
    CPU at scale: the three expert gradient stacks, $3 n f \ell$ numbers
    (300 MB at the benchmark size), are written where they lie instead of
    being allocated and faulted in by the kernel again at every step.
    """
    _check_config_supported(config)
    _check_inputs(x, params, config)
    # The expert stacks may be read-only stacks that decode one expert on `w[e]`: x names the namespace.
    xp = array_namespace(x)
    dtype = compute_dtype(xp, x)
    m, d = x.shape

    def weight(name: str) -> Array:
        return xp.astype(params[name], dtype, copy=False)

    # The forward pass of `refimpl.latent_moe`, stage by stage, keeping what the backward reads.
    h = xp.astype(x, dtype, copy=False)  # [m, d]
    # 1-2. Scores and route (Eq. 13), by the forward's own functions.
    scores = router_scores(h, weight("gate.weight"))  # [m, n]
    # A hash-routed layer takes its experts from `token_ids`; a capacity zeroes dropped weights (`kept`).
    index, weights, kept = _select(scores, params["gate.e_score_correction_bias"], config, token_ids)
    weights = xp.astype(weights, dtype)
    # 3. $$z = x W_\downarrow^\top$$
    z = h @ weight("routed_expert_down_proj.weight").T if config.use_latent_projection else h  # [m, l]
    # 4-5. The routed experts, each activation's partials kept.
    u, routed = _routed_forward(z, index, weights, params["experts.w1"], params["experts.w3"],
                                params["experts.w2"], config)  # [m, l]
    # 6. $$v = \operatorname{RMSNorm}(u) \odot g$$
    v = rms_norm(u, weight("routed_expert_norm.weight"), config.rms_norm_eps) if config.use_latent_norm else u
    # 7-9. $$y = y_{\text{shared}} + v W_\uparrow^\top$$
    y_routed = v @ weight("routed_expert_up_proj.weight").T if config.use_latent_projection else v  # [m, d]
    y_shared, shared = shared_experts_forward(h, weight("shared_experts.gate_proj.weight"),
                                              weight("shared_experts.up_proj.weight"),
                                              weight("shared_experts.down_proj.weight"), config)  # [m, d]
    y = xp.astype(y_shared + y_routed, x.dtype)

    def backward(dy: Array, *, out: Mapping[str, Array] | None = None) -> tuple[Array, Mapping[str, Array]]:
        check_float_array("dy", dy, ndim=2)
        if tuple(dy.shape) != (m, d):
            raise ValueError(f"dy must have the shape of y, [{m}, {d}], got {list(dy.shape)}")
        check_finite("dy", dy)
        if out is not None:
            _check_out(out, params, lambda name: _grad_dtype(xp, params[name], dtype))
        grads: dict[str, Array] = {}
        y_bar = xp.astype(dy, dtype, copy=False)  # [m, d]
        # 9. $$y = y_s + y_r \;\Rightarrow\; \bar y_s = \bar y_r = \bar y$$
        # 7. The up-projection: $$\bar W_\uparrow = \bar y^\top v, \qquad \bar v = \bar y W_\uparrow$$
        if config.use_latent_projection:
            grads["routed_expert_up_proj.weight"] = y_bar.T @ v  # [d, l]
            v_bar = y_bar @ weight("routed_expert_up_proj.weight")  # [m, l]
        else:
            v_bar = y_bar
        # 6. RMSNorm on the latent sum (see `rms_norm_backward`).
        if config.use_latent_norm:
            u_bar, grads["routed_expert_norm.weight"] = rms_norm_backward(
                u, weight("routed_expert_norm.weight"), v_bar, config.rms_norm_eps)  # [m, l], [l]
        else:
            u_bar = v_bar
        # 4-5. The routed experts, grouped by expert: $\bar z$, $\bar p$ and the three stacks.
        z_bar, p_bar, grads["experts.w1"], grads["experts.w3"], grads["experts.w2"] = _routed_backward(
            z, routed, params["experts.w1"], params["experts.w3"], params["experts.w2"], u_bar,
            None if out is None else (out["experts.w1"], out["experts.w3"], out["experts.w2"]))
        # A capacity holds a dropped assignment's weight at zero: no gradient reaches its score.
        if kept is not None:
            p_bar = p_bar * xp.astype(kept, p_bar.dtype)  # [m, k]
        # 2. The weights, through renormalization and scaling, to the chosen raw scores.
        s_hat_bar = route_backward(scores, index, p_bar, renormalize=config.renormalize,
                                   scaling_factor=config.routed_scaling_factor)  # [m, k]
        # 1. The sigmoid, to the router logits (zero off the chosen experts).
        logit_bar = router_backward(scores, index, s_hat_bar)  # [m, n]
        # $$\bar W_r = \bar\ell^\top x, \qquad \bar x = \bar\ell\, W_r$$
        grads["gate.weight"] = logit_bar.T @ h  # [n, d]
        x_bar = logit_bar @ weight("gate.weight")  # [m, d]
        # The bias only selects: $$\bar b = 0$$
        grads["gate.e_score_correction_bias"] = xp.zeros(params["gate.e_score_correction_bias"].shape,
                                                         dtype=dtype)
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
        x_bar = x_bar + shared_x_bar  # [m, d]
        x_bar = xp.astype(x_bar, x.dtype, copy=False)
        if out is None:
            return x_bar, MoEParams((name, xp.astype(grads[name], _grad_dtype(xp, params[name], dtype),
                                                     copy=False)) for name in params)
        for name in params:
            if grads[name] is not out[name]:  # the fast path wrote the expert stacks in place already
                out[name][...] = grads[name]
        return x_bar, out

    return y, backward


def _check_out(out: Mapping[str, Array], params: Mapping[str, Array], grad_dtype: Callable[[str], Any]) -> None:
    """`backward`'s `out=`: the names of `params`, each a writable array of its gradient's shape and dtype."""
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


def _grad_dtype(xp: Any, param: Array, dtype: Any) -> Any:
    """A gradient's dtype: its parameter's, unless that cannot hold it (a packed or integer store)."""
    if getattr(param, "dtype", None) is not None and param.dtype in (xp.float32, xp.float64):
        return param.dtype
    return dtype
