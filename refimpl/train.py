r"""Training a small Stable LatentMoE language model, with the bias following the router.

Everything else in this package looks at one layer at a time, with fixed
weights. K3 calls its layer *Stable* because of what happens while the
weights move: activations inside the routed experts that grow, a routed sum
whose scale drifts with the chosen experts, and a load balance that must
track a router which changes every step. This module trains a model small
enough for two CPU cores so that all three can be watched.

**The model.** A byte-level language model: it reads the $c$ bytes before a
position and predicts the byte at it.

$$
h^{(0)} = \bigl[E_{t_{-c}}; \dots; E_{t_{-1}}\bigr] W_{\text{mix}}^\top,
\qquad
h^{(l)} = h^{(l-1)} + \operatorname{MoE}_l\!\bigl(\operatorname{RMSNorm}(h^{(l-1)}) \odot g_l\bigr),
$$

$$
\text{logits} = \bigl(\operatorname{RMSNorm}(h^{(L)}) \odot g_f\bigr) W_{\text{out}}^\top,
\qquad
\mathcal L = -\frac{1}{m}\sum_i \log \operatorname{softmax}(\text{logits}_i)_{y_i}.
$$

The byte embedding $E$ (`[256, e]`) is shared by the $c$ positions; the
$c$ embeddings are concatenated and mixed into the width $d$ by one matrix.
Each of the $L$ blocks is a pre-norm residual around one Stable LatentMoE
layer of Eq. (11) (`stable_latent_moe`). There is no attention: the context
window is the whole memory, which keeps the model a pure test bed for the
MoE layer.

**The gradients.** The MoE layer's backward pass is
`refimpl.backward.stable_latent_moe_vjp`, derived by hand on its own page.
The rest is small and written out here: the embedding and mixing, RMSNorm,
the output layer and the cross-entropy. The optimizer is Adam.

**The bias.** The selection bias of each layer is not a trained parameter:
it never receives a gradient (it only chooses experts, Eq. 13), and Adam
never touches it. Each step, each layer's bias is set by a *balancer* from
that step's router scores, with next-step semantics: step $t$ is routed with
the bias computed from step $t-1$, and its own scores give the bias of step
$t+1$ (Eq. 14). The balancers are a small table (`BALANCERS`):

| name | rule |
|---|---|
| `qb` | exact Quantile Balancing, Eq. (14) (`quantile_balancing_update`) |
| `qb-hist` | the histogram estimator of Appendix D, the batch split into micro-batches (`BiasHistogram`) |
| `sign` | DeepSeek-V3's sign rule $b_j \leftarrow b_j + \gamma\,\operatorname{sign}(q - \text{load}_j)$ |
| `none` | the bias stays zero |

The rules K3 is compared with join the table from `refimpl.train_baselines`:
`aux` (an auxiliary balance loss), `seq` (the sign rule with DeepSeek's
sequence-wise loss), `capacity-1.0` and `capacity-1.25` (token dropping) and
`hash` (hash routing on the byte being read).

**What is measured.** Every step logs the loss and the *max violation*
$\max_j \text{load}_j / q - 1$, $q = mk/n$, on that step's batch routed with
the bias in use at that step (the largest over the layers, and each layer's).
Every `stats_every` steps it also logs, per layer, the largest routed-expert
activation $\max |h|$ (the GLU output inside the experts), the RMS of the
routed sum $u$ before the latent norm, and the norms of the gradients of the
two latent projections.

**Precision.** `precision="float16"` or `"bfloat16"` emulates a
low-precision forward pass with `ml_dtypes`: the weights, each block's input
and output and the residual stream are rounded to that format (values past
its range become infinite), while the arithmetic, the gradients and Adam's
master weights stay in float32, as in mixed-precision training. The layer
itself computes in float32, so an overflow *inside* the experts cannot
happen in the emulation; the log therefore counts the steps whose largest
routed activation lies beyond the format's largest finite value (65,504 for
float16), which a kernel storing $h$ in that format would have turned into
infinities, and skips those steps as it skips a step whose loss or
gradients are not finite: that is what dynamic loss scaling does with an
infinity. (Only float16 has a range small enough for this to happen.)

**The data.** Real text that every machine has offline: a fixed list of
source files of the Python standard library (`CORPUS_FILES`), concatenated in
that order. Their sizes and SHA-256 digests are printed and logged, so a run
says exactly what it read; the last 5% of the bytes are held out for the
evaluation loss. Batches are $m$ positions drawn uniformly with the run's
seed; the same seed gives the same losses, bit for bit.

Run it as `python -m refimpl.train --balancer qb --steps 300 --seed 0 --out run.json`;
`python -m refimpl.train --help` lists the sizes and switches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .activations import expert_glu
from .backward import stable_latent_moe_vjp
from .balancing import Balancer, QuantileBalancer, SignBalancer
from .baselines import capacity_keep, expert_capacity
from .config import ACTIVATIONS, MoEConfig
from .histogram import histogram_balancing_update
from .latent_moe import init_params, stable_latent_moe
from .routing import route, router_scores, score_function_vjp
from .train_baselines import AuxLossBalancer, CapacityBalancer, HashBalancer, SequenceLossBalancer

__all__ = [
    "BALANCERS",
    "CORPUS_FILES",
    "PRECISIONS",
    "Adam",
    "Corpus",
    "FrozenBalancer",
    "HistogramBalancer",
    "TrainConfig",
    "cross_entropy",
    "load_corpus",
    "main",
    "rms_norm_vjp",
    "routed_activation_peak",
    "noise_floor",
    "sample_batch",
    "train",
    "train_many",
]

#: Bytes are the tokens: a vocabulary of 256.
VOCAB = 256

#: Floating formats the forward pass can be rounded to, and their largest finite value.
PRECISIONS: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}

#: The corpus: these standard-library source files, in this order (any that a Python lacks are skipped and
#: the run says so). About 0.7 MB of Python on CPython 3.11.
CORPUS_FILES: tuple[str, ...] = (
    "argparse.py", "ast.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "fractions.py",
    "functools.py", "inspect.py", "json/decoder.py", "json/encoder.py", "pprint.py", "statistics.py",
    "string.py", "textwrap.py",
)

#: Share of the corpus held out for the evaluation loss (its last bytes).
HELD_OUT = 0.05


# ---------------------------------------------------------------------------
# The data
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """The training text as bytes, and what it was read from.

    `data` is a `uint8` array of the concatenated files; `files` lists each
    file read as `(name, size, sha256)`; `missing` the listed files this
    Python does not have; `sha256` is the digest of `data`; `split` is the
    index where the held-out part begins.
    """

    data: np.ndarray
    files: tuple[tuple[str, int, str], ...]
    missing: tuple[str, ...]
    sha256: str
    split: int

    def describe(self) -> str:
        """A few lines saying exactly what was read."""
        lines = [f"corpus: {len(self.files)} standard-library files, {self.data.size:,} bytes, "
                 f"sha256 {self.sha256[:16]} (held out: the last {self.data.size - self.split:,} bytes)"]
        lines += [f"  {name:<26}{size:>9,} bytes  sha256 {digest[:16]}" for name, size, digest in self.files]
        if self.missing:
            lines.append(f"  not found on this Python: {', '.join(self.missing)}")
        return "\n".join(lines)


def load_corpus(root: str | Path | None = None, names: Sequence[str] = CORPUS_FILES) -> Corpus:
    """Read the corpus: the files `names` under `root` (default: this Python's standard library)."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise ValueError(f"root must be a directory holding the standard library sources, got {str(root)!r}")
    chunks, files, missing = [], [], []
    for name in names:
        path = root / name
        if not path.is_file():
            missing.append(name)
            continue
        text = path.read_bytes()
        chunks.append(text)
        files.append((name, len(text), hashlib.sha256(text).hexdigest()))
    joined = b"".join(chunks)
    if len(joined) < 10_000:
        raise ValueError(f"the corpus under {str(root)!r} holds only {len(joined)} bytes of the files {list(names)}; "
                         "at least 10,000 are needed")
    data = np.frombuffer(joined, dtype=np.uint8)
    return Corpus(data=data, files=tuple(files), missing=tuple(missing), sha256=hashlib.sha256(joined).hexdigest(),
                  split=int(len(joined) * (1.0 - HELD_OUT)))


def sample_batch(data: np.ndarray, rng: np.random.Generator, m: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """`m` training pairs drawn uniformly from `data`: the `context` bytes before a position, and its byte.

    Returns `tokens` `[m, context]` (int64) and `targets` `[m]` (int64).
    """
    position = rng.integers(context, data.size, size=m)  # [m]
    window = position[:, None] + np.arange(-context, 0)[None, :]  # [m, c]
    return data[window].astype(np.int64), data[position].astype(np.int64)


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; the defaults are the default run.

    Sizes: `d` model width, `latent` the latent width $\\ell$, `experts` $n$,
    `top_k` $k$, `intermediate` $f$, `shared` the number of shared experts,
    `layers` $L$, `context` $c$ bytes, `embed` $e$ the byte-embedding width,
    `batch` $m$ tokens per step. Optimizer: Adam with `lr`, `betas`, `eps`,
    gradients clipped to a global norm of `grad_clip` (0: no clipping).
    Balancing: `balancer` (a key of `BALANCERS`), the sign rule's `sign_rate`
    $\\gamma$, the histogram's `bins` and `micro_batches`.
    """

    balancer: str = "qb"
    steps: int = 300
    seed: int = 0
    activation: str = "situ"
    latent_norm: bool = True
    precision: str = "float32"
    d: int = 64
    latent: int = 32
    experts: int = 64
    top_k: int = 4
    intermediate: int = 32
    shared: int = 1
    layers: int = 2
    context: int = 16
    embed: int = 16
    batch: int = 1024
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 0.0
    sign_rate: float = 1e-3
    bins: int = 1000
    micro_batches: int = 4
    stats_every: int = 10
    eval_every: int = 50
    eval_batch: int = 2048

    def __post_init__(self) -> None:
        for name in ("steps", "d", "latent", "experts", "top_k", "intermediate", "layers", "context", "embed",
                     "batch", "bins", "micro_batches", "stats_every", "eval_every", "eval_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.shared, bool) or not isinstance(self.shared, int) or self.shared < 0:
            raise ValueError(f"shared must be a non-negative integer, got {self.shared!r}")
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer must be one of {sorted(BALANCERS)}, got {self.balancer!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {self.activation!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.latent_norm, bool):
            raise TypeError(f"latent_norm must be True or False, got {self.latent_norm!r}")
        if self.top_k >= self.experts:
            raise ValueError(f"top_k must be smaller than experts={self.experts} for balancing to mean "
                             f"anything, got {self.top_k}")
        if self.latent > self.d:
            raise ValueError(f"latent must be <= d={self.d}, got {self.latent}")
        if self.micro_batches > self.batch:
            raise ValueError(f"micro_batches must be <= batch={self.batch}, got {self.micro_batches}")
        for name in ("lr", "eps", "sign_rate"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"grad_clip must be >= 0 (0: off), got {self.grad_clip!r}")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        # Eq. (14) needs the (q+1)-th largest margin of each expert: at least n/(n-k) tokens per step.
        if self.batch * (self.experts - self.top_k) < self.experts * 2:
            raise ValueError(f"batch={self.batch} is too small for {self.experts} experts and top_k={self.top_k}")

    def moe_config(self) -> MoEConfig:
        """The `MoEConfig` of every block."""
        return MoEConfig(hidden_size=self.d, latent_size=self.latent, num_experts=self.experts,
                         top_k=self.top_k, intermediate_size=self.intermediate, num_shared_experts=self.shared,
                         activation=self.activation, use_latent_norm=self.latent_norm, num_moe_layers=self.layers)

    @property
    def target_load(self) -> float:
        """$q = mk/n$ of one training batch."""
        return self.batch * self.top_k / self.experts


# ---------------------------------------------------------------------------
# The balancers: a table of rules, each with the `Balancer.step` interface
# ---------------------------------------------------------------------------

class FrozenBalancer(Balancer):
    """No balancing: routes with the bias it was given (zero) and never changes it."""

    kind = "none"

    def _route_and_update(self, scores: Any, bias: Any) -> tuple[Any, Any]:
        index, _ = route(scores, bias, self.top_k)  # [m, k]
        return index, bias


class HistogramBalancer(Balancer):
    """Appendix D inside a training step: the batch is split into `micro_batches`, each counted into one histogram.

    The result is the bias of `histogram_balancing_update` on the blocks, the
    same as one histogram of the whole batch (counts add), within one bin
    width of exact Quantile Balancing.
    """

    kind = "histogram"

    def __init__(self, num_experts: int, top_k: int, *, bins: int = 1000, micro_batches: int = 4,
                 bias: Any = None) -> None:
        super().__init__(num_experts, top_k, bias=bias)
        self.bins = bins
        self.micro_batches = micro_batches

    def _route_and_update(self, scores: Any, bias: Any) -> tuple[Any, Any]:
        index, _ = route(scores, bias, self.top_k)  # [m, k]
        blocks = np.array_split(np.asarray(scores), self.micro_batches, axis=0)  # micro-batches [m_i, n]
        return index, histogram_balancing_update(blocks, bias, self.top_k, self.bins)


#: The balancers, by name: each entry builds one balancer for one layer from the run's configuration.
#: A new rule (an auxiliary loss, capacity dropping, hash routing) is one more entry whose object has
#: `Balancer`'s `step(scores) -> BalanceStep`.
BALANCERS: dict[str, Callable[[TrainConfig], Balancer]] = {
    "qb": lambda config: QuantileBalancer(config.experts, config.top_k),
    "qb-hist": lambda config: HistogramBalancer(config.experts, config.top_k, bins=config.bins,
                                                micro_batches=config.micro_batches),
    "sign": lambda config: SignBalancer(config.experts, config.top_k, rate=config.sign_rate),
    "none": lambda config: FrozenBalancer(config.experts, config.top_k),
    # The other balancers (refimpl.train_baselines): auxiliary losses, capacity with dropping, hash routing.
    "aux": lambda config: AuxLossBalancer(config.experts, config.top_k),
    "seq": lambda config: SequenceLossBalancer(config.experts, config.top_k, rate=config.sign_rate),
    "capacity-1.0": lambda config: CapacityBalancer(config.experts, config.top_k, capacity_factor=1.0),
    "capacity-1.25": lambda config: CapacityBalancer(config.experts, config.top_k, capacity_factor=1.25),
    "hash": lambda config: HashBalancer(config.experts, config.top_k),
}


# ---------------------------------------------------------------------------
# The small pieces and their gradients, by hand
# ---------------------------------------------------------------------------

def rms_norm_vjp(x: np.ndarray, g: np.ndarray, eps: float = 1e-5) -> tuple[np.ndarray, Callable]:
    r"""RMSNorm $y = x\,r \odot g$ with $r = (\overline{x^2} + \varepsilon)^{-1/2}$, and its backward pass.

    Returns `y` `[m, d]` and `backward(dy) -> (dx, dg)`. With $a = dy \odot g$:

    $$
    \frac{\partial \mathcal L}{\partial x} = r\,a - \frac{r^3}{d}\,x\,(a \cdot x),
    \qquad
    \frac{\partial \mathcal L}{\partial g} = \sum_i dy_i \odot x_i\,r_i .
    $$
    """
    d = x.shape[-1]
    # $$r_i = \bigl(\tfrac1d \textstyle\sum_j x_{ij}^2 + \varepsilon\bigr)^{-1/2}$$
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)  # [m, 1]
    x_hat = x * r  # [m, d]
    y = x_hat * g  # [m, d]

    def backward(dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a = dy * g  # [m, d]
        # $$\partial x = r\,a - \tfrac{r^3}{d}\,x\,(a \cdot x)$$
        dx = r * a - (r**3 / d) * x * np.sum(a * x, axis=-1, keepdims=True)  # [m, d]
        # $$\partial g = \textstyle\sum_i dy_i \odot \hat x_i$$
        dg = np.sum(dy * x_hat, axis=0)  # [d]
        return dx, dg

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
    left out, since the balancer sets them.
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


def _moe_prefix(layer: int) -> str:
    return f"layers.{layer}.moe."


def init_model(config: TrainConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 weights of the whole model, in one flat dict of named arrays.

    Names: `embed.weight` `[256, e]`, `mix.weight` `[d, c e]`, per layer `l`
    `layers.l.norm.weight` `[d]` and `layers.l.moe.<HF name>` (the layer of
    `init_params`), `norm.weight` `[d]`, `out.weight` `[256, d]`.
    """
    d, c, e = config.d, config.context, config.embed
    params: dict[str, np.ndarray] = {
        "embed.weight": rng.standard_normal((VOCAB, e)).astype(np.float32),
        "mix.weight": (rng.standard_normal((d, c * e)) / np.sqrt(c * e)).astype(np.float32),
    }
    moe = config.moe_config()
    for layer in range(config.layers):
        params[f"layers.{layer}.norm.weight"] = np.ones(d, dtype=np.float32)
        for name, value in init_params(moe, rng).items():
            params[_moe_prefix(layer) + name] = value
    params["norm.weight"] = np.ones(d, dtype=np.float32)
    params["out.weight"] = (rng.standard_normal((VOCAB, d)) / np.sqrt(d)).astype(np.float32)
    return params


def _layer_params(params: Mapping[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    prefix = _moe_prefix(layer)
    return {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}


def _rounded(x: np.ndarray, precision: str) -> np.ndarray:
    """`x` rounded to the precision's format and back to float32 (overflow becomes infinity)."""
    if precision == "float32":
        return x
    with np.errstate(over="ignore"):
        return x.astype(PRECISIONS[precision]).astype(np.float32)


def routed_activation_peak(z: np.ndarray, index: np.ndarray, w1: np.ndarray, w3: np.ndarray,
                           config: MoEConfig) -> float:
    r"""The largest $|h|$ inside the routed experts: $h = \operatorname{GLU}(z G_e^\top, z U_e^\top)$ of every chosen pair.

    `z` `[m, l]` is the latent, `index` `[m, k]` the route. This is the
    activation that SiTU-GLU bounds by $\beta_1 \beta_2 = 100$ and SwiGLU does not.
    """
    peak = 0.0
    for e in np.unique(index).tolist():
        rows = np.flatnonzero(np.any(index == e, axis=1))  # the tokens that chose expert e
        z_e = z[rows]  # [m_e, l]
        h = expert_glu(z_e @ w1[e].T, z_e @ w3[e].T, config)  # [m_e, f]
        peak = max(peak, float(np.max(np.abs(h))))
    return peak


@dataclass
class StepResult:
    """What one forward and backward pass computed (before the optimizer step)."""

    loss: float
    grads: dict[str, np.ndarray]
    violations: list[float]
    stats: dict[str, list[float]] = field(default_factory=dict)
    balancing: dict[str, list[float]] = field(default_factory=dict)  # per layer: aux_loss, drop_rate


def forward_backward(params: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
                     balancers: Sequence[Balancer], config: TrainConfig, *,
                     with_stats: bool = False) -> StepResult:
    """One training step's loss and gradients; each layer's balancer routes the batch and moves to its next bias.

    The bias written into `params` before a layer runs is the balancer's held
    bias, computed from the previous step; the balancer then reads this
    step's scores for the next one.
    """
    moe = config.moe_config()
    precision = config.precision
    m, c = tokens.shape
    q = config.target_load
    # Embedding: $$h^{(0)} = [E_{t_{-c}}; \dots; E_{t_{-1}}]\, W_{\text{mix}}^\top$$
    embedded = params["embed.weight"][tokens].reshape(m, c * config.embed)  # [m, c e]
    w_mix = _rounded(params["mix.weight"], precision)
    h = _rounded(embedded @ w_mix.T, precision)  # [m, d]
    backs, violations = [], []
    stats: dict[str, list[float]] = {"activation_peak": [], "routed_rms": []}
    balancing: dict[str, list[float]] = {}
    token_ids = tokens[:, -1]  # [m], the byte each position reads last (what hash routing keys on)
    auxiliary_total = 0.0
    for layer, balancer in enumerate(balancers):
        # The layer's switches for this balancer (a capacity, hash routing), and its token ids if it needs them.
        layer_moe = moe.replace(**getattr(balancer, "layer_changes", {}))
        layer_ids = token_ids if layer_moe.hash_routing else None
        if getattr(balancer, "needs_token_ids", False):
            balancer.token_ids = token_ids
        # Pre-norm: $$a = \operatorname{RMSNorm}(h) \odot g_l$$
        a, norm_back = rms_norm_vjp(h, params[f"layers.{layer}.norm.weight"], moe.rms_norm_eps)  # [m, d]
        a = _rounded(a, precision)
        layer_params = {name: (value if name == BIAS else _rounded(value, precision))
                        for name, value in _layer_params(params, layer).items()}
        scores = router_scores(a, layer_params["gate.weight"])  # [m, n], float32
        # A forward pass that overflowed (a sigmoid can turn an infinite input into a finite score): no step.
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(scores))):
            return StepResult(math.nan, {}, [math.nan] * len(balancers))
        # Route with the bias held from the previous step; the balancer then computes the next one.
        step = balancer.step(scores)
        layer_params[BIAS] = step.bias
        params[_moe_prefix(layer) + BIAS] = step.bias
        # $$\max_j \text{load}_j / q - 1$$
        violations.append(float(step.load.max() / q - 1.0))
        # An auxiliary loss on the router scores: its value now, its gradient on the way back.
        auxiliary = None
        if hasattr(balancer, "auxiliary"):
            value, dscores = balancer.auxiliary(np.asarray(scores, dtype=np.float64), np.asarray(step.index))
            auxiliary_total += balancer.coefficient * value
            auxiliary = balancer.coefficient * dscores  # [m, n]
            balancing.setdefault("aux_loss", []).append(value)
        if layer_moe.capacity_factor is not None:
            capacity = expert_capacity(m, moe.n, moe.k, layer_moe.capacity_factor)
            kept = capacity_keep(np.asarray(step.index), moe.n, capacity)  # [m, k], as the layer will serve
            balancing.setdefault("drop_rate", []).append(float(1.0 - kept.mean()))
        y, moe_back = stable_latent_moe_vjp(a, layer_params, layer_moe, token_ids=layer_ids)  # [m, d]
        if with_stats:
            out = stable_latent_moe(a, layer_params, moe, return_intermediates=True)
            stats["activation_peak"].append(routed_activation_peak(
                np.asarray(out.z), np.asarray(out.index), layer_params["experts.w1"], layer_params["experts.w3"],
                moe))
            stats["routed_rms"].append(float(np.sqrt(np.mean(np.asarray(out.u, dtype=np.float64) ** 2))))
        # Residual: $$h^{(l)} = h^{(l-1)} + \operatorname{MoE}_l(a)$$
        h = _rounded(h + _rounded(np.asarray(y), precision), precision)
        backs.append((norm_back, moe_back, auxiliary, a, layer_params["gate.weight"]))
    # Output: $$z = (\operatorname{RMSNorm}(h^{(L)}) \odot g_f)\, W_{\text{out}}^\top$$
    a_f, final_back = rms_norm_vjp(h, params["norm.weight"], moe.rms_norm_eps)  # [m, d]
    a_f = _rounded(a_f, precision)
    w_out = _rounded(params["out.weight"], precision)
    logits = a_f @ w_out.T  # [m, 256]
    with np.errstate(invalid="ignore", over="ignore"):
        loss, dlogits = cross_entropy(logits, targets)
    if not math.isfinite(loss):
        return StepResult(loss, {}, violations, stats, balancing)

    # ---- backward: the same path in reverse ----
    grads: dict[str, np.ndarray] = {}
    # $$\partial W_{\text{out}} = \partial z^\top a_f, \qquad \partial a_f = \partial z\, W_{\text{out}}$$
    grads["out.weight"] = dlogits.T @ a_f  # [256, d]
    dh, grads["norm.weight"] = final_back(dlogits @ w_out)  # [m, d], [d]
    for layer in reversed(range(len(balancers))):
        if not np.all(np.isfinite(dh)):
            # The gradient overflowed on its way back: no update this step, as for a non-finite loss.
            return StepResult(loss, {}, violations, stats, balancing)
        norm_back, moe_back, auxiliary, a, w_gate = backs[layer]
        # The residual passes $\partial h$ through and adds the block's path.
        da, dmoe = moe_back(dh)  # [m, d], the layer's parameter gradients
        for name, value in dmoe.items():
            grads[_moe_prefix(layer) + name] = np.asarray(value)
        if auxiliary is not None:
            # The auxiliary loss reaches the router through the sigmoid: $$\bar z = \bar s\, s (1 - s)$$
            logit_bar = score_function_vjp(a.astype(np.float64) @ w_gate.T.astype(np.float64), auxiliary)  # [m, n]
            grads[_moe_prefix(layer) + "gate.weight"] += (logit_bar.T @ a).astype(np.float32)  # [n, d]
            da = np.asarray(da) + (logit_bar @ w_gate).astype(np.float32)  # [m, d]
        dx, grads[f"layers.{layer}.norm.weight"] = norm_back(np.asarray(da))
        dh = dh + dx  # [m, d]
        if with_stats and moe.use_latent_projection:
            for name, key in (("routed_expert_down_proj.weight", "grad_norm_down"),
                              ("routed_expert_up_proj.weight", "grad_norm_up")):
                stats.setdefault(key, []).insert(0, float(np.linalg.norm(dmoe[name])))
    # $$\partial W_{\text{mix}} = \partial h^{(0)\top} [E], \qquad \partial [E] = \partial h^{(0)} W_{\text{mix}}$$
    grads["mix.weight"] = dh.T @ embedded  # [d, c e]
    dembedded = (dh @ w_mix).reshape(m * c, config.embed)  # [m c, e]
    # Each byte's embedding gathers the gradient of every place it was read (a scatter-add).
    grads["embed.weight"] = np.zeros_like(params["embed.weight"])
    np.add.at(grads["embed.weight"], tokens.reshape(m * c), dembedded)
    grads = {name: value.astype(np.float32) for name, value in grads.items()}
    if auxiliary_total:
        balancing["objective"] = [loss + auxiliary_total]  # what the gradient is of; `loss` stays the LM loss
    return StepResult(loss, grads, violations, stats, balancing)


def evaluate(params: Mapping[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
             config: TrainConfig, layer_changes: Sequence[Mapping[str, Any]] | None = None) -> float:
    """The loss on held-out tokens with the biases frozen as they are (inference: no quantile is computed).

    `layer_changes` are each layer's `MoEConfig` switches (hash routing); a capacity is not applied at
    evaluation, where nothing is dropped.
    """
    moe = config.moe_config()
    m, c = tokens.shape
    h = params["embed.weight"][tokens].reshape(m, c * config.embed) @ params["mix.weight"].T  # [m, d]
    for layer in range(config.layers):
        a, _ = rms_norm_vjp(h, params[f"layers.{layer}.norm.weight"], moe.rms_norm_eps)
        if not np.all(np.isfinite(a)):
            return math.nan  # a model that has diverged: its activations overflow
        changes = {key: value for key, value in (layer_changes or [{}] * config.layers)[layer].items()
                   if key != "capacity_factor"}
        layer_moe = moe.replace(**changes)
        ids = tokens[:, -1] if layer_moe.hash_routing else None
        h = h + np.asarray(stable_latent_moe(a, _layer_params(params, layer), layer_moe, token_ids=ids))
    a_f, _ = rms_norm_vjp(h, params["norm.weight"], moe.rms_norm_eps)
    loss, _ = cross_entropy(a_f @ params["out.weight"].T, targets)
    return loss


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------

def _clip(grads: dict[str, np.ndarray], max_norm: float) -> float:
    """Scale all gradients so their global norm is at most `max_norm` (0: no clipping); returns the norm before."""
    total = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    if max_norm > 0 and total > max_norm:
        for name in grads:
            grads[name] = (grads[name] * (max_norm / total)).astype(np.float32)
    return total


def train(config: TrainConfig, *, corpus: Corpus | None = None, progress: bool = False,
          log: Callable[[str], None] | None = None,
          final_params: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Train the model of `config` and return the log `{"config", "corpus", "steps", "summary"}`.

    `steps` holds one record per step: `step` (from 1), `loss`,
    `max_violation` (largest over layers), `max_violation_layers` and
    `grad_norm` (global, before clipping; absent on a skipped step); on every
    `stats_every`-th step (every step in a low-precision run) the per-layer
    `activation_peak`, `routed_rms`, `grad_norm_down` and `grad_norm_up`; on every `eval_every`-th step
    `eval_loss`, `overflow: true` where the largest routed activation lies
    beyond the precision's range, and `skipped: true` where the update was
    skipped (an overflow, or a loss or gradient that is not finite). A run
    whose weights grow until its forward pass overflows has diverged: it goes
    on to the end with every step skipped and its loss NaN, and its held-out
    loss is NaN. `summary` has the
    wall time and the throughput in tokens per second. If `final_params` is a
    dict, it receives the trained weights.
    """
    corpus = load_corpus() if corpus is None else corpus
    rng = np.random.default_rng(config.seed)
    params = init_model(config, rng)
    balancers = [BALANCERS[config.balancer](config) for _ in range(config.layers)]
    trained = [name for name in params if not name.endswith(BIAS)]
    adam = Adam(trained, params, config.lr, config.betas, config.eps)
    train_data = corpus.data[:corpus.split]
    eval_rng = np.random.default_rng([config.seed, 1])
    eval_tokens, eval_targets = sample_batch(corpus.data[corpus.split:], eval_rng, config.eval_batch, config.context)
    peak_limit = float(ml_dtypes.finfo(PRECISIONS[config.precision]).max)
    records: list[dict[str, Any]] = []
    overflow_steps = skipped = 0
    steps = range(1, config.steps + 1)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"train {config.balancer}", unit="step", file=sys.stderr, leave=False)
    start = time.perf_counter()
    for t in steps:
        tokens, targets = sample_batch(train_data, rng, config.batch, config.context)
        # A low-precision run needs the peak every step: it decides whether the step overflowed.
        with_stats = t % config.stats_every == 0 or t == 1 or config.precision != "float32"
        result = forward_backward(params, tokens, targets, balancers, config, with_stats=with_stats)
        record: dict[str, Any] = {"step": t, "loss": result.loss, "max_violation": max(result.violations),
                                  "max_violation_layers": result.violations, **result.balancing}
        overflow = bool(result.stats.get("activation_peak")) and max(result.stats["activation_peak"]) > peak_limit
        overflow_steps += overflow
        finite = bool(result.grads) and all(np.all(np.isfinite(g)) for g in result.grads.values())
        if overflow:
            record["overflow"] = True
        if finite and not overflow:
            record["grad_norm"] = _clip(result.grads, config.grad_clip)
            adam.step(params, result.grads)
        else:
            record["skipped"] = True
            skipped += 1
        if with_stats:
            record.update(result.stats)
        if t % config.eval_every == 0 or t == config.steps:
            record["eval_loss"] = evaluate(params, eval_tokens, eval_targets, config,
                                           [getattr(b, "layer_changes", {}) for b in balancers])
        records.append(record)
        if progress:
            steps.set_postfix(loss=f"{result.loss:.3f}", viol=f"{record['max_violation']:.2f}")
    seconds = time.perf_counter() - start
    if final_params is not None:
        final_params.update(params)
    summary = {"seconds": seconds, "tokens_per_second": config.batch * config.steps / seconds,
               "skipped_steps": skipped, "activation_overflow_steps": overflow_steps,
               "final_eval_loss": records[-1]["eval_loss"]}
    if log is not None:
        log(f"{config.steps} steps of {config.batch} tokens in {seconds:.1f} s: "
            f"{summary['tokens_per_second']:,.0f} tokens/s; final loss {records[-1]['loss']:.4f}, "
            f"held-out loss {summary['final_eval_loss']:.4f}, last max violation {records[-1]['max_violation']:.3f}")
    config_record = asdict(config)
    config_record["betas"] = list(config.betas)
    return {"config": config_record,
            "corpus": {"sha256": corpus.sha256, "bytes": int(corpus.data.size),
                       "files": [list(entry) for entry in corpus.files], "missing": list(corpus.missing)},
            "steps": records, "summary": summary}


def _train_quietly(config: TrainConfig) -> dict[str, Any]:
    return train(config)


def train_many(configs: Sequence[TrainConfig], processes: int = 2) -> list[dict[str, Any]]:
    """Train several configurations, `processes` at a time (one process each), and return their logs in order.

    The experiments' long runs use it; each run is as deterministic as a
    single `train` call, whatever the order the processes finish in.
    """
    configs = list(configs)
    if processes <= 1 or len(configs) <= 1:
        return [train(config) for config in configs]
    from multiprocessing import get_context

    with get_context("fork").Pool(processes) as pool:
        return pool.map(_train_quietly, configs, chunksize=1)


def noise_floor(m: int, n: int, top_k: int, *, draws: int = 200, seed: int = 0) -> np.ndarray:
    r"""The max violation of perfectly fair random routing: `draws` samples, `[draws]`.

    Each of $m$ tokens picks $k$ distinct experts uniformly at random (the
    top-$k$ of i.i.d. uniform scores), so every expert's expected load is
    exactly $q = mk/n$; what remains is sampling noise. No bias computed from
    a past batch can do better on a fresh batch of independent tokens.
    """
    rng = np.random.default_rng(seed)
    q = m * top_k / n
    floor = np.empty(draws)
    for draw in range(draws):
        index, _ = route(rng.random((m, n), dtype=np.float32), np.zeros(n, np.float32), top_k)  # [m, k]
        load = np.bincount(index.reshape(-1), minlength=n)  # [n]
        floor[draw] = load.max() / q - 1.0
    return floor


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m refimpl.train",
                                     description="Train a small byte-level Stable LatentMoE language model and "
                                                 "log loss and load balance per step as JSON.")
    parser.add_argument("--balancer", choices=sorted(BALANCERS), default=defaults.balancer,
                        help="how each layer's selection bias follows the router (default %(default)s)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of weights and batches")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON log to this file")
    parser.add_argument("--activation", choices=list(ACTIVATIONS), default=defaults.activation,
                        help="expert activation: situ (SiTU-GLU, K3) or swiglu")
    parser.add_argument("--latent-norm", choices=["on", "off"], default="on",
                        help="RMSNorm on the routed latent sum: on (Stable LatentMoE) or off (LatentMoE)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default=defaults.precision,
                        help="format the forward pass is rounded to (default %(default)s)")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate (default %(default)s)")
    parser.add_argument("--grad-clip", type=float, default=defaults.grad_clip,
                        help="clip the global gradient norm to this (0: off, the default)")
    parser.add_argument("--gamma", "--sign-rate", dest="sign_rate", type=float, default=defaults.sign_rate,
                        help="the sign rule's step (default %(default)s, DeepSeek-V3's)")
    parser.add_argument("--bins", type=int, default=defaults.bins, help="histogram bins for qb-hist")
    parser.add_argument("--micro-batches", type=int, default=defaults.micro_batches,
                        help="micro-batches per step for qb-hist")
    sizes = parser.add_argument_group("sizes")
    for name, text in (("d", "model width"), ("latent", "latent width l"), ("experts", "routed experts n"),
                       ("top-k", "experts per token k"), ("intermediate", "expert intermediate size f"),
                       ("shared", "shared experts"), ("layers", "MoE blocks L"), ("context", "bytes of context"),
                       ("embed", "byte embedding width"), ("batch", "tokens per step m"),
                       ("stats-every", "log activation and gradient statistics every this many steps"),
                       ("eval-every", "held-out loss every this many steps")):
        attr = name.replace("-", "_")
        sizes.add_argument(f"--{name}", dest=attr, type=int, default=getattr(defaults, attr),
                           help=f"{text} (default %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of parsed command-line arguments."""
    fields = {name: getattr(args, name) for name in TrainConfig.__dataclass_fields__ if hasattr(args, name)}
    fields["latent_norm"] = args.latent_norm == "on"
    return TrainConfig(**fields)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command `python -m refimpl.train`: train, print what was read and the throughput, write the log."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    say = (lambda text: None) if args.quiet else print
    corpus = load_corpus()
    say(corpus.describe())
    result = train(config, corpus=corpus, progress=not args.quiet and config.steps >= 50, log=say)
    result["command"] = "python -m refimpl.train " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        say(f"log written to {args.out}")
    return result


if __name__ == "__main__":
    main()
