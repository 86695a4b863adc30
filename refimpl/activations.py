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
2. **Bounded output.** $|\operatorname{softcap}(a,\beta_1)\,\sigma(a)| < \beta_1$ and
   $|\operatorname{softcap}(b,\beta_2)| < \beta_2$, so every coordinate obeys
   $|\operatorname{SiTU\text{-}GLU}| < \beta_1\beta_2 = 100$. (In floating point
   $\tanh$ rounds to exactly 1 for large arguments, so the computed value can
   reach the bound itself; it never exceeds it.)
3. **Smooth saturation.** $\frac{d}{dz}\operatorname{softcap}(z,\beta) = 1 - \tanh^2(z/\beta) > 0$
   everywhere, so a saturated unit still passes gradient, whereas a hard clamp
   $\min(\max(z,-\beta),\beta)$ has derivative exactly zero past the bound.

**Precision.** As in the K3 code, the activation is computed in float32 (or
float64 for float64 input) and cast back to the input dtype, so float16 and
bfloat16 inputs work and stay bounded.
"""

from __future__ import annotations

from typing import Any

from ._xp import Array, array_namespace, compute_dtype
from .validation import check_float_array, check_positive

__all__ = [
    "hard_clamp",
    "hard_clamp_grad",
    "rms_norm",
    "sigmoid",
    "situ_glu",
    "situ_glu_grad",
    "softcap",
    "softcap_grad",
    "swiglu",
    "swiglu_grad",
]


def _upcast(xp: Any, *arrays: Array) -> tuple[Any, list[Array]]:
    """Cast every array to the compute dtype (float32, or float64 when an input is float64)."""
    dtype = compute_dtype(xp, *arrays)
    return dtype, [xp.astype(a, dtype) for a in arrays]


def sigmoid(z: Array) -> Array:
    r"""The logistic function $\sigma(z) = 1 / (1 + e^{-z})$, without overflow warnings.

    Written as $\tfrac12(1 + \tanh(z/2))$, which is exact and never evaluates
    $e^{z}$ for large $|z|$.
    """
    xp = array_namespace(z)
    return 0.5 * (1.0 + xp.tanh(0.5 * z))


def softcap(x: Array, beta: float) -> Array:
    r"""Smoothly cap `x` to $(-\beta, \beta)$: $\operatorname{softcap}(x, \beta) = \beta\tanh(x/\beta)$."""
    check_float_array("x", x)
    check_positive("beta", beta)
    xp = array_namespace(x)
    _, (x32,) = _upcast(xp, x)
    # $$\beta \tanh(x / \beta)$$
    out = beta * xp.tanh(x32 / beta)
    return xp.astype(out, x.dtype)


def softcap_grad(x: Array, beta: float) -> Array:
    r"""Derivative of `softcap` in `x`: $1 - \tanh^2(x/\beta)$, positive everywhere."""
    check_float_array("x", x)
    check_positive("beta", beta)
    xp = array_namespace(x)
    _, (x32,) = _upcast(xp, x)
    t = xp.tanh(x32 / beta)
    return xp.astype(1.0 - t * t, x.dtype)


def hard_clamp(x: Array, beta: float) -> Array:
    r"""The hard cap $\min(\max(x, -\beta), \beta)$ that `softcap` replaces (for comparison)."""
    check_float_array("x", x)
    xp = array_namespace(x)
    return xp.clip(x, -beta, beta)


def hard_clamp_grad(x: Array, beta: float) -> Array:
    """Derivative of `hard_clamp`: 1 inside $(-\\beta, \\beta)$, exactly 0 outside."""
    check_float_array("x", x)
    xp = array_namespace(x)
    return xp.astype(xp.abs(x) < beta, x.dtype)


def _check_pair(gate: Array, up: Array) -> None:
    check_float_array("gate", gate)
    check_float_array("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got gate {gate.shape} and up {up.shape}")


def situ_glu(gate: Array, up: Array, beta: float = 4.0, linear_beta: float = 25.0) -> Array:
    r"""Eq. (12): $\operatorname{SiTU\text{-}GLU}(a, b) = [\operatorname{softcap}(a,\beta_1)\sigma(a)] \odot \operatorname{softcap}(b,\beta_2)$.

    `gate` is the gate pre-activation $a$ (HF `w1`), `up` the up
    pre-activation $b$ (HF `w3`); both have the same shape. Computed in float32
    or wider and returned in the input dtype.
    """
    _check_pair(gate, up)
    check_positive("beta", beta)
    check_positive("linear_beta", linear_beta)
    xp = array_namespace(gate, up)
    _, (a, b) = _upcast(xp, gate, up)
    # The capped gate: $$\operatorname{softcap}(a, \beta_1)\,\sigma(a) \in (-\beta_1, \beta_1)$$
    capped_gate = beta * xp.tanh(a / beta) * sigmoid(a)
    # The capped linear branch: $$\operatorname{softcap}(b, \beta_2) \in (-\beta_2, \beta_2)$$
    capped_up = linear_beta * xp.tanh(b / linear_beta)
    return xp.astype(capped_gate * capped_up, gate.dtype)


def situ_glu_grad(gate: Array, up: Array, beta: float = 4.0,
                  linear_beta: float = 25.0) -> tuple[Array, Array]:
    r"""Partial derivatives of `situ_glu` in `gate` and in `up`, returned as a pair.

    With $g(a) = \operatorname{softcap}(a,\beta_1)\sigma(a)$ and $h(b) = \operatorname{softcap}(b,\beta_2)$:
    $\partial_a = g'(a)\,h(b)$ where
    $g'(a) = (1 - \tanh^2(a/\beta_1))\,\sigma(a) + \operatorname{softcap}(a,\beta_1)\,\sigma(a)(1-\sigma(a))$,
    and $\partial_b = g(a)\,(1 - \tanh^2(b/\beta_2))$.
    """
    _check_pair(gate, up)
    xp = array_namespace(gate, up)
    _, (a, b) = _upcast(xp, gate, up)
    sig = sigmoid(a)
    ta = xp.tanh(a / beta)
    tb = xp.tanh(b / linear_beta)
    g = beta * ta * sig
    g_prime = (1.0 - ta * ta) * sig + beta * ta * sig * (1.0 - sig)
    h = linear_beta * tb
    h_prime = 1.0 - tb * tb
    return xp.astype(g_prime * h, gate.dtype), xp.astype(g * h_prime, gate.dtype)


def swiglu(gate: Array, up: Array) -> Array:
    r"""SwiGLU: $[a\,\sigma(a)] \odot b$ (unbounded), computed like `situ_glu` for comparison."""
    _check_pair(gate, up)
    xp = array_namespace(gate, up)
    _, (a, b) = _upcast(xp, gate, up)
    # $$\operatorname{Swish}(a) \odot b = a\,\sigma(a)\, b$$
    return xp.astype(a * sigmoid(a) * b, gate.dtype)


def swiglu_grad(gate: Array, up: Array) -> tuple[Array, Array]:
    r"""Partial derivatives of `swiglu`: $(\sigma(a) + a\sigma(a)(1-\sigma(a)))\,b$ and $a\sigma(a)$."""
    _check_pair(gate, up)
    xp = array_namespace(gate, up)
    _, (a, b) = _upcast(xp, gate, up)
    sig = sigmoid(a)
    d_gate = (sig + a * sig * (1.0 - sig)) * b
    d_up = a * sig
    return xp.astype(d_gate, gate.dtype), xp.astype(d_up, gate.dtype)


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
    check_positive("eps", eps)
    if weight.ndim != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"weight must have shape [{x.shape[-1]}] to match the last axis of x {x.shape}, got {weight.shape}")
    xp = array_namespace(x, weight)
    _, (x32, g) = _upcast(xp, x, weight)
    # $$\operatorname{rms}(x) = \sqrt{\tfrac{1}{\ell}\textstyle\sum_c x_c^2 + \varepsilon}$$
    rms = xp.sqrt(xp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [..., 1]
    return xp.astype(x32 / rms * g, x.dtype)
