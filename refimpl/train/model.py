r"""The model around the layers: embedding, norms, output layer, loss and optimizer, with their gradients by hand.

$$
h^{(0)} = \bigl[E_{t_{-c}}; \dots; E_{t_{-1}}\bigr] W_{\text{mix}}^\top,
\qquad
\text{logits} = \bigl(\operatorname{RMSNorm}(h^{(L)}) \odot g_f\bigr) W_{\text{out}}^\top.
$$

Every parameter lives in one flat dict of named float32 arrays
(`init_model`): the byte embedding, the mixing matrix, per block its norm
and the layer's weights under `layers.<l>.moe.` (the names of
`refimpl.layer.latent_moe.init_params`, without the selection bias, which
its balancer holds), the final norm and the output layer. Adam updates
them; the cross-entropy and the RMSNorm backward are written out here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..config import MoEConfig
from ..layer.activations import expert_glu, rms_norm, rms_norm_backward
from ..layer.latent_moe import init_params, parameter_shapes
from .config import PRECISIONS, TrainConfig
from .data import VOCAB

# ---------------------------------------------------------------------------
# The small pieces and their gradients, by hand
# ---------------------------------------------------------------------------

def rms_norm_vjp(x: np.ndarray, g: np.ndarray, eps: float = 1e-5) -> tuple[np.ndarray, Callable]:
    r"""RMSNorm $y = x\,r \odot g$ with $r = (\overline{x^2} + \varepsilon)^{-1/2}$, and its backward pass.

    Returns `y` `[m, d]` and `backward(dy) -> (dx, dg)`: the package's one
    RMSNorm (`refimpl.layer.activations.rms_norm`) and its one backward
    (`rms_norm_backward`), paired. With $a = dy \odot g$:

    $$
    \frac{\partial \mathcal L}{\partial x} = r\,a - \frac{r^3}{d}\,x\,(a \cdot x),
    \qquad
    \frac{\partial \mathcal L}{\partial g} = \sum_i dy_i \odot x_i\,r_i .
    $$
    """
    y = rms_norm(x, g, eps)  # [m, d]

    def backward(dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return rms_norm_backward(x, g, dy, eps)  # [m, d], [d]

    return y, backward


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    r"""Mean cross-entropy of `logits` `[m, V]` against `targets` `[m]`, and its gradient `[m, V]`.

    $$
    \mathcal L = \frac1m \sum_i \Bigl(\log \sum_v e^{z_{iv}} - z_{i y_i}\Bigr),
    \qquad
    \frac{\partial \mathcal L}{\partial z_{iv}} = \frac{\operatorname{softmax}(z_i)_v - [v = y_i]}{m}.
    $$
    """
    m = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)  # [m, V], the largest at 0: no overflow
    log_total = np.log(np.sum(np.exp(shifted), axis=1))  # [m]
    picked = shifted[np.arange(m), targets]  # [m]
    loss = float(np.mean(log_total - picked))
    # $$\operatorname{softmax}(z_i) - \mathbf 1_{y_i}$$, divided by m for the mean
    dlogits = np.exp(shifted - log_total[:, None])  # [m, V]
    dlogits[np.arange(m), targets] -= 1.0
    return loss, dlogits / m


class Adam:
    r"""Adam with bias correction, over a dict of float32 arrays.

    $$
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
    \theta_t = \theta_{t-1} - \eta\,\frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}.
    $$

    Only the names given at construction are trained; the selection biases are
    left out, since the balancer sets them. Its state is `t` and the moments
    `m`, `v` (dicts of arrays), which a checkpoint saves.
    """

    def __init__(self, names: Sequence[str], params: Mapping[str, np.ndarray], lr: float,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
        self.names = list(names)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.t = 0
        self.m = {name: np.zeros_like(params[name]) for name in self.names}
        self.v = {name: np.zeros_like(params[name]) for name in self.names}

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        """Update `params` in place from `grads`."""
        self.t += 1
        beta1, beta2 = self.betas
        correction1, correction2 = 1.0 - beta1**self.t, 1.0 - beta2**self.t
        for name in self.names:
            g = grads[name]
            self.m[name] = beta1 * self.m[name] + (1.0 - beta1) * g
            self.v[name] = beta2 * self.v[name] + (1.0 - beta2) * (g * g)
            # $$\theta \leftarrow \theta - \eta\,\hat m / (\sqrt{\hat v} + \epsilon)$$
            update = (self.m[name] / correction1) / (np.sqrt(self.v[name] / correction2) + self.eps)
            params[name] = (params[name] - self.lr * update).astype(np.float32)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

BIAS = "gate.e_score_correction_bias"


def moe_prefix(layer: int) -> str:
    return f"layers.{layer}.moe."


def model_shapes(config: TrainConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every parameter of the model, in the order `init_model` draws them."""
    d, c, e = config.moe.hidden_size, config.context, config.embed
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, e), "mix.weight": (d, c * e)}
    for layer in range(config.moe.num_moe_layers):
        shapes[f"layers.{layer}.norm.weight"] = (d,)
        shapes.update({moe_prefix(layer) + name: shape for name, shape in parameter_shapes(config.moe).items()})
    shapes["norm.weight"] = (d,)
    shapes["out.weight"] = (VOCAB, d)
    return shapes


def init_model(config: TrainConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 weights of the whole model, in one flat dict of named arrays.

    Names: `embed.weight` `[256, e]`, `mix.weight` `[d, c e]`, per layer `l`
    `layers.l.norm.weight` `[d]` and `layers.l.moe.<HF name>` (the layer of
    `init_params`, its selection bias zero), `norm.weight` `[d]`,
    `out.weight` `[256, d]`. A training run keeps `trained_params` of it: each
    layer's bias lives in its balancer, and only there.
    """
    d, c, e = config.moe.hidden_size, config.context, config.embed
    params: dict[str, np.ndarray] = {
        "embed.weight": rng.standard_normal((VOCAB, e)).astype(np.float32),
        "mix.weight": (rng.standard_normal((d, c * e)) / np.sqrt(c * e)).astype(np.float32),
    }
    for layer in range(config.moe.num_moe_layers):
        params[f"layers.{layer}.norm.weight"] = np.ones(d, dtype=np.float32)
        for name, value in init_params(config.moe, rng).items():
            params[moe_prefix(layer) + name] = value
    params["norm.weight"] = np.ones(d, dtype=np.float32)
    params["out.weight"] = (rng.standard_normal((VOCAB, d)) / np.sqrt(d)).astype(np.float32)
    return params


def trained_params(params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters the optimizer trains: all but the layers' selection biases, which their balancers hold."""
    return {name: value for name, value in params.items() if not name.endswith("." + BIAS)}


def block_params(params: Mapping[str, np.ndarray], layer: int, bias: np.ndarray) -> dict[str, np.ndarray]:
    """The parameters of block `layer`'s MoE layer under their HF names, with `bias` (its balancer's) as its bias."""
    prefix = moe_prefix(layer)
    block = {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}
    block[BIAS] = bias
    return block


def rounded(x: np.ndarray, precision: str) -> np.ndarray:
    """`x` rounded to the precision's format and back to float32 (overflow becomes infinity)."""
    if precision == "float32":
        return x
    with np.errstate(over="ignore"):
        return x.astype(PRECISIONS[precision]).astype(np.float32)


def routed_activation_peak(z: np.ndarray, index: np.ndarray, w1: np.ndarray, w3: np.ndarray,
                           config: MoEConfig) -> float:
    r"""The largest $|h|$ inside the routed experts: $h = \operatorname{GLU}(z G_e^\top, z U_e^\top)$ of every chosen pair.

    `z` `[m, l]` is the latent, `index` `[m, k]` the route. This is the
    activation that SiTU-GLU bounds by $\beta_1 \beta_2 = 100$ and SwiGLU
    does not. The training step reads the same value off the layer's own
    forward pass (`RoutedActivations.peak`); this function computes it from
    scratch, for a layer outside a training step.
    """
    peak = 0.0
    for e in np.unique(index).tolist():
        rows = np.flatnonzero(np.any(index == e, axis=1))  # the tokens that chose expert e
        z_e = z[rows]  # [m_e, l]
        h = expert_glu(z_e @ w1[e].T, z_e @ w3[e].T, config)  # [m_e, f]
        peak = max(peak, float(np.max(np.abs(h))))
    return peak
