r"""Eq. (12) and Appendix B: SiTU-GLU, the bounded activation of every K3 expert.

$$
\operatorname{softcap}(z, \beta) = \beta \tanh(z / \beta),
\qquad
\operatorname{SiTU\text{-}GLU}(a, b) =
\bigl[\operatorname{softcap}(a, \beta_1)\,\sigma(a)\bigr] \odot \operatorname{softcap}(b, \beta_2)
$$

with $\beta_1 = 4$ on the gate pre-activation $a$ and $\beta_2 = 25$ on the
up (linear) pre-activation $b$. SwiGLU, the activation it replaces, is
$[a\,\sigma(a)] \odot b$.

**Why.** SwiGLU grows without bound: $a\,\sigma(a) \approx a$ for large $a$,
and $b$ is linear, so one large pre-activation passes straight through, and in
half precision it overflows. The paper reports activation blow-ups inside the
routed branch at K3's sparsity and scale; SiTU-GLU caps both factors with a
smooth $\tanh$ instead of a clamp.

Appendix B argues three properties, each checked by the tests and drawn in the
worked example:

1. **First-order equivalence.** $\operatorname{softcap}(z,\beta) = z - z^3/(3\beta^2) + O(z^5/\beta^4)$,
   so near zero, where training starts, SiTU-GLU *is* SwiGLU, and as
   $\beta_1, \beta_2 \to \infty$ it converges to SwiGLU pointwise.
2. **Bounded output, when both branches are capped.** $|\operatorname{softcap}(a,\beta_1)\,\sigma(a)| < \beta_1$ and
   $|\operatorname{softcap}(b,\beta_2)| < \beta_2$, so every coordinate obeys
   $|\operatorname{SiTU\text{-}GLU}| < \beta_1\beta_2 = 100$. (In floating point
   $\tanh$ rounds to exactly 1 for large arguments, so the computed value can
   reach the bound itself; it never exceeds it.) With the up branch uncapped
   (`linear_beta=None`, below) only the gate factor is bounded, $|\cdot| < \beta_1 |b|$,
   and the output grows linearly in $b$ like SwiGLU's.
3. **Smooth saturation.** $\frac{d}{dz}\operatorname{softcap}(z,\beta) = 1 - \tanh^2(z/\beta) > 0$
   everywhere, so a saturated unit still passes gradient, whereas a hard clamp
   $\min(\max(z,-\beta),\beta)$ has derivative exactly zero past the bound.

**The uncapped up branch.** The reference modeling code caps the up branch
only when the configuration sets `activation_situ_linear_beta`; without it the
activation is $\operatorname{softcap}(a,\beta_1)\,\sigma(a)\,b$ (and an absent
`activation_situ_beta` means $\beta_1 = 1$). `situ_glu`, `situ_glu_grad` and the
layer take `linear_beta=None` for that form, so configurations written that way
(Kimi Linear's style) compute what they compute there. K3 sets both caps.

**Precision.** As in the K3 code, the activation is computed in float32 (or
float64 for float64 input) and cast back to the input dtype, so float16 and
bfloat16 inputs work and stay bounded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._lib.fast import (
    fast_path_applies,
    glu_and_grad_by_chunks,
    glu_by_chunks,
    rms_norm_backward_by_chunks,
    rms_norm_by_chunks,
)
from .._lib.validation import check_float_array, check_positive
from .._lib.xp import Array, array_namespace, compute_dtype, dtype_name, is_real_floating

if TYPE_CHECKING:
    from ..config import MoEConfig

__all__ = [
    "expert_glu",
    "expert_glu_and_grad",
    "glu_and_grad",
    "hard_clamp",
    "hard_clamp_grad",
    "relu_glu",
    "rms_norm",
    "rms_norm_backward",
    "sigmoid",
    "situ_glu",
    "situ_glu_grad",
    "softcap",
    "softcap_grad",
    "swiglu",
    "swiglu_grad",
]


def situ_glu(gate: Array, up: Array, beta: float = 4.0, linear_beta: float | None = 25.0) -> Array:
    r"""Eq. (12): $\operatorname{SiTU\text{-}GLU}(a, b) = [\operatorname{softcap}(a,\beta_1)\sigma(a)] \odot \operatorname{softcap}(b,\beta_2)$.

    `gate` is the gate pre-activation $a$ (HF `w1`), `up` the up
    pre-activation $b$ (HF `w3`); both have the same shape. Computed in float32
    or wider and returned in the input dtype. `linear_beta=None` leaves the up
    branch uncapped: $\operatorname{softcap}(a,\beta_1)\sigma(a)\,b$, which is not
    bounded (the reference code's form when `activation_situ_linear_beta` is absent).
    """
    xp, a, b, beta, linear_beta = _situ_inputs(gate, up, beta, linear_beta)
    # The capped gate: $$\operatorname{softcap}(a, \beta_1)\,\sigma(a) \in (-\beta_1, \beta_1)$$
    capped_gate = beta * xp.tanh(a / beta) * sigmoid(a)
    if linear_beta is None:
        # The uncapped linear branch: $$b$$
        return xp.astype(capped_gate * b, _result_dtype(gate), copy=False)
    # The capped linear branch: $$\operatorname{softcap}(b, \beta_2) \in (-\beta_2, \beta_2)$$
    capped_up = linear_beta * xp.tanh(b / linear_beta)
    return xp.astype(capped_gate * capped_up, _result_dtype(gate), copy=False)


def _upcast(xp: Any, *arrays: Array) -> tuple[Any, list[Array]]:
    """Cast every array to the compute dtype (float32, or float64 when an input is float64).

    An array already in that dtype is returned as it is, not copied: the
    callers only read these arrays, and on a GPU each needless copy is one
    more kernel to launch.
    """
    dtype = compute_dtype(xp, *arrays)
    return dtype, [xp.astype(a, dtype, copy=False) for a in arrays]


def _result_dtype(x: Array) -> Any:
    """The dtype a function of `x` returns: that of `x` when it is floating; the compute dtype (float32)
    when `x` holds integers or booleans, which are promoted, never truncated back (sigmoid(3) is 0.95, not 0)."""
    return x.dtype if is_real_floating(x) else compute_dtype(array_namespace(x), x)


def sigmoid(z: Array) -> Array:
    r"""The logistic function $\sigma(z) = 1 / (1 + e^{-z})$, accurate on both sides and without overflow.

    With $t = e^{-|z|} \in (0, 1]$,
    $\sigma(z) = 1/(1 + t)$ for $z \ge 0$ and $\sigma(z) = t/(1 + t)$ for $z < 0$.
    Neither branch overflows, and the negative side keeps full relative
    precision down to the smallest positive float. (The tempting
    $\tfrac12(1 + \tanh(z/2))$ is exact on paper but cancels for negative $z$:
    it returns exactly 0 below $z \approx -38$ in float64 and $-20$ in float32,
    where the true value is tiny but positive, and a router whose chosen scores
    are all 0 would then divide 0 by 0.)
    Computed in float32 or wider and returned in the dtype of `z` (integers and booleans in float32).
    """
    xp = array_namespace(z)
    _, (z32,) = _upcast(xp, z)
    # $$t = e^{-|z|} \in (0, 1]$$
    t = xp.exp(-xp.abs(z32))
    # $$\sigma(z) = \begin{cases} 1/(1+t) & z \ge 0 \\ t/(1+t) & z < 0 \end{cases}
    #   = \frac{e^{\min(z, 0)}}{1 + t}$$
    # (one expression for both branches: a `where` over a random sign mask is slow in NumPy)
    return xp.astype(xp.exp(xp.minimum(z32, 0.0)) / (1.0 + t), _result_dtype(z), copy=False)


def _sech2(u: Array) -> Array:
    r"""$\operatorname{sech}^2(u) = 1 - \tanh^2(u)$, without the cancellation of the second form.

    `1 - tanh(u)**2` is exactly 0 as soon as $\tanh(u)$ rounds to 1 (from
    $|u| \approx 10$ in float32, $19$ in float64), although the true value is
    positive. With $e = e^{-2|u|}$ it equals $4e/(1+e)^2$, which stays
    accurate until $e$ itself underflows.
    """
    xp = array_namespace(u)
    e = xp.exp(-2.0 * xp.abs(u))
    # $$\operatorname{sech}^2(u) = \frac{4 e^{-2|u|}}{(1 + e^{-2|u|})^2}$$
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


def _factor_in(name: str, value: Any, dtype: Any) -> float:
    """`value` as a Python float if it is a positive finite real that `dtype`, the compute dtype, holds.

    A cap or an epsilon enters the arithmetic in the compute dtype (float32 for float32 and half inputs):
    one float32 rounds to infinity (`beta=1e39`) or to zero (`beta=1e-46`, `eps=1e-50`) makes the
    result NaN (infinity over infinity, zero over zero), so it is refused, naming the argument and
    the dtype's range, rather than computed. The Python float is what the callers compute with: it
    takes the arrays' dtype (a NumPy float64 would widen float32 arithmetic, a Fraction would stop it).
    """
    number = check_positive(name, value)
    # NumPy's and CuPy's float32 is a scalar type NumPy reads; another library's (torch.float32) goes by its name.
    compute = np.dtype(dtype) if isinstance(dtype, type) else np.dtype(dtype_name(dtype))
    with np.errstate(over="ignore", under="ignore"):
        held = compute.type(number)
    if not 0 < held < np.inf:
        info = np.finfo(compute)
        raise ValueError(f"{name} must be a number {compute.name} (the compute dtype of these inputs) holds: between "
                         f"{float(info.smallest_subnormal):.4g} and {float(info.max):.8g}, got {value!r}, which "
                         f"{compute.name} rounds to {held}")
    return number


def _capped_input(x: Array, beta: float) -> tuple[Any, Array, float]:
    """Check a cap's input and its bound; return the namespace, `x` in the compute dtype and the bound."""
    check_float_array("x", x)
    xp = array_namespace(x)
    dtype, (x32,) = _upcast(xp, x)
    return xp, x32, _factor_in("beta", beta, dtype)


def softcap(x: Array, beta: float) -> Array:
    r"""Smoothly cap `x` to $(-\beta, \beta)$: $\operatorname{softcap}(x, \beta) = \beta\tanh(x/\beta)$."""
    xp, x32, beta = _capped_input(x, beta)
    # $$\beta \tanh(x / \beta)$$
    out = beta * xp.tanh(x32 / beta)
    return xp.astype(out, _result_dtype(x), copy=False)


def softcap_grad(x: Array, beta: float) -> Array:
    r"""Derivative of `softcap` in `x`: $1 - \tanh^2(x/\beta) = \operatorname{sech}^2(x/\beta)$, positive everywhere.

    Evaluated as $\operatorname{sech}^2$ (see `_sech2`) so that it stays
    non-zero, as it is mathematically, far past the cap, until the exponential
    underflows.
    """
    xp, x32, beta = _capped_input(x, beta)
    # $$\frac{d}{dx}\,\beta\tanh(x/\beta) = \operatorname{sech}^2(x/\beta)$$
    return xp.astype(_sech2(x32 / beta), _result_dtype(x), copy=False)


def hard_clamp(x: Array, beta: float) -> Array:
    r"""The hard cap $\min(\max(x, -\beta), \beta)$ that `softcap` replaces (for comparison).

    Computed in float32 or wider and returned in the dtype of `x`, like the
    other activations (NumPy's `clip` refuses bfloat16 directly).
    """
    xp, x32, beta = _capped_input(x, beta)
    return xp.astype(xp.clip(x32, -beta, beta), _result_dtype(x), copy=False)


def hard_clamp_grad(x: Array, beta: float) -> Array:
    r"""Derivative of `hard_clamp`: 1 inside $(-\beta, \beta)$, exactly 0 outside."""
    xp, x32, beta = _capped_input(x, beta)
    return xp.astype(xp.abs(x32) < beta, _result_dtype(x), copy=False)


def _check_pair(gate: Array, up: Array) -> None:
    check_float_array("gate", gate)
    check_float_array("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got gate {gate.shape} and up {up.shape}")


def _situ_inputs(gate: Array, up: Array, beta: float,
                 linear_beta: float | None) -> tuple[Any, Array, Array, float, float | None]:
    """Check SiTU-GLU's inputs and caps; return the namespace, the pre-activations in the compute dtype and
    the caps as Python floats (each one the compute dtype holds, see `_factor_in`)."""
    _check_pair(gate, up)
    check_positive("beta", beta)
    if linear_beta is not None:
        check_positive("linear_beta", linear_beta)
    xp = array_namespace(gate, up)
    dtype, (a, b) = _upcast(xp, gate, up)
    beta = _factor_in("beta", beta, dtype)
    linear_beta = None if linear_beta is None else _factor_in("linear_beta", linear_beta, dtype)
    return xp, a, b, beta, linear_beta


def glu_and_grad(a: Array, b: Array, activation: str = "situ", beta: float = 4.0,
                 linear_beta: float | None = 25.0) -> tuple[Array, Array, Array]:
    r"""The GLU $h = \phi(a, b)$ and its partials $\partial_a \phi$, $\partial_b \phi$, all three at once.

    For SiTU-GLU, $\phi(a, b) = \gamma(a)\,\lambda(b)$ with the capped gate
    $\gamma(a) = \operatorname{softcap}(a, \beta_1)\,\sigma(a)$ and the capped
    up branch $\lambda(b) = \operatorname{softcap}(b, \beta_2)$; `linear_beta=None`
    leaves the up branch uncapped, $\lambda(b) = b$. For SwiGLU
    (`activation="swiglu"`), $\gamma(a) = a\,\sigma(a)$ and $\lambda(b) = b$. For the ungated
    squared ReLU (`activation="relu2"`), $\gamma(a) = \max(a, 0)$ and $\lambda(b) = b$: an expert whose
    gate and up weights are the same matrix $W$ computes $\max(u, 0)\,u = \max(u, 0)^2$ with $u = W z$,
    which is exactly Nemotron-H's $\operatorname{relu}(W z)^2$. In every case

    $$\partial_a \phi = \gamma'(a)\,\lambda(b), \qquad \partial_b \phi = \gamma(a)\,\lambda'(b),$$

    with $\gamma'(a) = \operatorname{sech}^2(a/\beta_1)\,\sigma(a) + \operatorname{softcap}(a,\beta_1)\,\sigma'(a)$
    for SiTU and $\sigma(a) + a\,\sigma'(a)$ for SwiGLU. The three share their
    sigmoid and tanh, which is why they are computed together: this is the
    one place the derivative of Eq. (12) is written, used by `situ_glu_grad`,
    `swiglu_grad` and the backward pass. `a` and `b` are pre-activations of
    the same shape in float32 or float64 (the caller's compute dtype).
    """
    xp = array_namespace(a, b)
    sig = sigmoid(a)
    # $$\sigma'(a) = \sigma(a)\,\sigma(-a)$$ (no cancellation, unlike $\sigma(1 - \sigma)$)
    sig_prime = sig * sigmoid(-a)
    if activation == "relu2":
        # $$\gamma(a) = \max(a, 0), \qquad \gamma'(a) = [a > 0]$$ (with tied weights, $\gamma(u)\,u = \max(u, 0)^2$)
        gamma = xp.maximum(a, 0.0)
        gamma_prime = xp.astype(a > 0, a.dtype)
    elif activation == "situ":
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
        d_up = gamma * _sech2(b / linear_beta)
    else:
        # Uncapped up branch: $$\lambda(b) = b, \qquad \lambda'(b) = 1$$
        lam = b
        d_up = gamma
    return gamma * lam, gamma_prime * lam, d_up


def situ_glu_grad(gate: Array, up: Array, beta: float = 4.0,
                  linear_beta: float | None = 25.0) -> tuple[Array, Array]:
    r"""Partial derivatives of `situ_glu` in `gate` and in `up`, returned as a pair.

    With $g(a) = \operatorname{softcap}(a,\beta_1)\sigma(a)$ and $h(b) = \operatorname{softcap}(b,\beta_2)$:
    $\partial_a = g'(a)\,h(b)$ with
    $g'(a) = \operatorname{sech}^2(a/\beta_1)\,\sigma(a) + \operatorname{softcap}(a,\beta_1)\,\sigma(a)\sigma(-a)$,
    and $\partial_b = g(a)\,\operatorname{sech}^2(b/\beta_2)$ (see `glu_and_grad`, which computes them).
    With `linear_beta=None` (uncapped up branch) $h(b) = b$ and $h'(b) = 1$.
    Computed in float32 or wider and returned in the input dtype.
    """
    xp, a, b, beta, linear_beta = _situ_inputs(gate, up, beta, linear_beta)
    _, d_gate, d_up = glu_and_grad(a, b, "situ", beta, linear_beta)
    return xp.astype(d_gate, _result_dtype(gate), copy=False), xp.astype(d_up, _result_dtype(gate), copy=False)


def relu_glu(gate: Array, up: Array) -> Array:
    r"""The squared-ReLU expert as a GLU: $\max(a, 0) \odot b$; with `gate` and `up` from one matrix, $\max(u, 0)^2$.

    NVIDIA's LatentMoE (Nemotron-H) uses ungated experts, $W_\downarrow \operatorname{relu}(W_\uparrow z)^2$.
    Since $\max(u, 0)^2 = \max(u, 0)\,u$, the same expert is a GLU whose gate and up weights are both
    $W_\uparrow$: the layer computes it with its GLU machinery, and the converters store Nemotron-H's
    `up_proj` as both `w1` and `w3`.
    """
    _check_pair(gate, up)
    xp = array_namespace(gate, up)
    _, (a, b) = _upcast(xp, gate, up)
    # $$\max(a, 0)\, b$$
    return xp.astype(xp.maximum(a, 0.0) * b, _result_dtype(gate), copy=False)


def swiglu(gate: Array, up: Array) -> Array:
    r"""SwiGLU: $[a\,\sigma(a)] \odot b$ (unbounded), computed like `situ_glu` for comparison."""
    _check_pair(gate, up)
    xp = array_namespace(gate, up)
    _, (a, b) = _upcast(xp, gate, up)
    # $$\operatorname{Swish}(a) \odot b = a\,\sigma(a)\, b$$
    return xp.astype(a * sigmoid(a) * b, _result_dtype(gate), copy=False)


def swiglu_grad(gate: Array, up: Array) -> tuple[Array, Array]:
    r"""Partial derivatives of `swiglu`: $(\sigma(a) + a\sigma(a)\sigma(-a))\,b$ and $a\sigma(a)$ (see `glu_and_grad`)."""
    _check_pair(gate, up)
    xp = array_namespace(gate, up)
    _, (a, b) = _upcast(xp, gate, up)
    _, d_gate, d_up = glu_and_grad(a, b, "swiglu")
    return xp.astype(d_gate, _result_dtype(gate), copy=False), xp.astype(d_up, _result_dtype(gate), copy=False)


def rms_norm(x: Array, weight: Array, eps: float = 1e-5) -> Array:
    r"""RMSNorm over the last axis: $\operatorname{RMSNorm}(x) \odot g = \dfrac{x}{\sqrt{\operatorname{mean}(x^2) + \varepsilon}} \odot g$.

    `x` is `[..., width]` and `weight` (the gain $g$) is `[width]`. Computed in
    float32 or wider and returned in the dtype of `x`. Because it divides by
    the root mean square, `rms_norm(c * x) == rms_norm(x)` for any $c > 0$ up to
    the small $\varepsilon$: the reason the Stable LatentMoE branch does not
    care how large the routed sum is.
    """
    check_float_array("x", x)
    check_float_array("weight", weight)
    eps = _factor_in("eps", eps, compute_dtype(array_namespace(x, weight), x, weight))
    if weight.ndim != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"weight must have shape [{x.shape[-1]}] to match the last axis of x {x.shape}, got {weight.shape}")
    if fast_path_applies(x, weight) and x.ndim == 2 and x.flags.c_contiguous:
        return rms_norm_by_chunks(x, weight, eps)  # on NumPy: a few rows at a time, the same values
    xp = array_namespace(x, weight)
    _, (x32, g) = _upcast(xp, x, weight)
    # $$\operatorname{rms}(x) = \sqrt{\tfrac{1}{\ell}\textstyle\sum_c x_c^2 + \varepsilon}$$
    rms = xp.sqrt(xp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [..., 1]
    return xp.astype(x32 / rms * g, _result_dtype(x), copy=False)


def rms_norm_backward(u: Array, weight: Array, dv: Array, eps: float) -> tuple[Array, Array]:
    r"""Gradients of $v = \operatorname{RMSNorm}(u) \odot g$ in $u$ and in the gain $g$, from $\bar v$.

    With $\rho_i = \sqrt{\operatorname{mean}_c(u_{i,c}^2) + \varepsilon}$ and
    $\hat u_i = u_i / \rho_i$, $v_i = \hat u_i \odot g$, so
    $\bar g = \sum_i \bar v_i \odot \hat u_i$ and, writing $\bar{\hat u} = \bar v \odot g$,

    $$\bar u_i = \frac{1}{\rho_i}\Bigl(\bar{\hat u}_i - \hat u_i\,
    \operatorname{mean}_c\bigl(\bar{\hat u}_{i,c}\,\hat u_{i,c}\bigr)\Bigr).$$

    The second term is the norm's own Jacobian: the component of the
    gradient along $u_i$ is removed (up to $\varepsilon$), because scaling
    $u_i$ does not change $v_i$. `u`, `dv` are `[..., width]` and `weight`
    `[width]`, in the caller's compute dtype; returns `(du, dweight)`. The
    latent norm of the layer and the training model's pre-norms both use it.
    """
    if fast_path_applies(u, weight, dv) and u.ndim == 2 and u.shape == dv.shape and u.flags.c_contiguous \
            and dv.flags.c_contiguous:
        return rms_norm_backward_by_chunks(u, weight, dv, eps)  # on NumPy: a few rows at a time
    xp = array_namespace(u, weight, dv)
    # $$\rho_i = \sqrt{\tfrac{1}{\ell}\textstyle\sum_c u_{i,c}^2 + \varepsilon}$$
    rho = xp.sqrt(xp.mean(u * u, axis=-1, keepdims=True) + eps)  # [m, 1]
    u_hat = u / rho  # [m, l]
    # $$\bar g = \textstyle\sum_i \bar v_i \odot \hat u_i$$
    dweight = xp.sum(xp.reshape(dv * u_hat, (-1, u.shape[-1])), axis=0)  # [l]
    du_hat = dv * weight  # [m, l]
    # $$\bar u_i = \bigl(\bar{\hat u}_i - \hat u_i \operatorname{mean}(\bar{\hat u}_i \odot \hat u_i)\bigr) / \rho_i$$
    du = (du_hat - u_hat * xp.mean(du_hat * u_hat, axis=-1, keepdims=True)) / rho  # [m, l]
    return du, dweight


# ---------------------------------------------------------------------------
# The layer's activation, as its configuration chooses it
# ---------------------------------------------------------------------------

def _clamp_branches(a: Array, b: Array, limit: float) -> tuple[Array, Array]:
    r"""DeepSeek-V4's clamp of SwiGLU's branches: $(\min(a, L),\ \operatorname{clip}(b, -L, L))$, new arrays.

    transformers' `DeepseekV4Experts` and `DeepseekV4MLP` clamp the gate
    pre-activation from above only and the up pre-activation on both sides,
    then apply SwiGLU: $\operatorname{silu}(\min(a, L))\,\operatorname{clip}(b, -L, L)$.
    """
    xp = array_namespace(a, b)
    # $$a' = \min(a, L), \qquad b' = \max(\min(b, L), -L)$$
    return xp.minimum(a, limit), xp.clip(b, -limit, limit)


def _clamp_masks(a: Array, b: Array, limit: float) -> tuple[Array, Array]:
    r"""Where the clamp passes gradient: $a \le L$ and $-L \le b \le L$ (PyTorch's `clamp` counts the bounds in)."""
    xp = array_namespace(a, b)
    return xp.astype(a <= limit, a.dtype), xp.astype((b >= -limit) & (b <= limit), b.dtype)


def expert_glu(a: Array, b: Array, config: MoEConfig) -> Array:
    r"""The experts' activation $\phi(a, b)$ of a layer: SiTU-GLU with the config's caps (K3), or SwiGLU.

    `a`, `b` are fresh products (gate and up pre-activations) in the compute
    dtype. On NumPy the fast path (`refimpl._lib.fast.glu_by_chunks`) overwrites
    them instead of allocating; the values are those of `situ_glu` / `swiglu`.
    With `config.swiglu_limit` set, the branches are clamped first (`_clamp_branches`).
    """
    if config.swiglu_limit is not None:
        a, b = _clamp_branches(a, b, config.swiglu_limit)
    if fast_path_applies(a, b):
        return glu_by_chunks(a, b, config.activation, config.situ_beta, config.situ_linear_beta)
    if config.activation == "situ":
        return situ_glu(a, b, config.situ_beta, config.situ_linear_beta)
    if config.activation == "relu2":
        return relu_glu(a, b)
    return swiglu(a, b)


def expert_glu_and_grad(a: Array, b: Array, config: MoEConfig, *,
                        d_gate_out: Array | None = None) -> tuple[Array, Array, Array]:
    r"""`glu_and_grad` with the layer's activation and caps: $(h, \partial_a\phi, \partial_b\phi)$ of fresh products.

    On NumPy the fast path (`refimpl._lib.fast.glu_and_grad_by_chunks`) writes
    $h$ and $\partial_b\phi$ into the products' buffers and $\partial_a\phi$ into
    `d_gate_out` (an array of `a`'s shape that a loop keeps from one step to the
    next; ignored elsewhere), a few rows at a time. With `config.swiglu_limit`
    set, the partials are those of the clamped branches times the clamp's own
    derivative: $\partial_a\phi = \operatorname{silu}'(a')\,b'\,[a \le L]$ and
    $\partial_b\phi = \operatorname{silu}(a')\,[|b| \le L]$ (new arrays: `d_gate_out`
    then holds the clamped branches' partial, before the mask).
    """
    limit = config.swiglu_limit
    if limit is not None:
        pass_a, pass_b = _clamp_masks(a, b, limit)  # [.., f] each
        a, b = _clamp_branches(a, b, limit)
    if fast_path_applies(a, b):
        h, d_gate, d_up = glu_and_grad_by_chunks(a, b, config.activation, config.situ_beta, config.situ_linear_beta,
                                                 d_gate_out)
    else:
        h, d_gate, d_up = glu_and_grad(a, b, config.activation, config.situ_beta, config.situ_linear_beta)
    if limit is None:
        return h, d_gate, d_up
    # $$\partial_a \phi = \partial_{a'} \phi\,[a \le L], \qquad \partial_b \phi = \partial_{b'} \phi\,[|b| \le L]$$
    return h, d_gate * pass_a, d_up * pass_b
