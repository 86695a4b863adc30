r"""One training step, forward and backward, and the processes it runs on.

`forward_backward` runs the model on a batch: each block's layer once,
forward and backward, through `refimpl.layer.backward.stable_latent_moe_vjp`;
each block's balancer reads the layer's own scores and route and computes
the bias of the next step. The step asks a `Ranks` object every question
whose answer needs more than one process's arrays (the layer, a balancer's
step, the loss of the batch, its gradients, "is it finite?"): on one process
(`ONE_PROCESS`) the answers are the plain computations, and
`refimpl.train.expert_parallel.ExpertParallel` gives the same answers
across the ranks of an MPI job. `evaluate` is the held-out loss with the
biases frozen, as at inference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..balancing import Balancer, BalanceStep
from ..config import MoEConfig
from ..layer.activations import rms_norm, rms_norm_backward
from ..layer.backward import stable_latent_moe_vjp
from ..layer.latent_moe import MoEOutput, stable_latent_moe
from ..layer.routing import router_scores
from .config import TrainConfig
from .model import BIAS, block_params, cross_entropy, moe_prefix, rounded

#: A layer with its backward, as a training step calls it: `layer_vjp(x [m, d], params, config, token_ids)`
#: returns the layer's `MoEOutput` (with the route and the intermediates) and its `backward(dy, dscores=None)
#: -> (dx, dparams)`.
LayerVJP = Callable[[np.ndarray, Mapping[str, np.ndarray], MoEConfig, "np.ndarray | None"],
                    tuple[MoEOutput, Callable[..., tuple[Any, Mapping[str, Any]]]]]


def single_process_layer(x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
                         token_ids: np.ndarray | None) -> tuple[MoEOutput, Callable]:
    """The layer on one process: `stable_latent_moe_vjp`, keeping every intermediate."""
    return stable_latent_moe_vjp(x, params, config, token_ids=token_ids, return_intermediates=True)


class Ranks:
    r"""The processes a training step runs on; this class is one process, holding the whole batch and every expert.

    The training step (`forward_backward`), the evaluation and the loop ask
    this object every question whose answer depends on more than what one
    process holds, and nothing else differs between one process and many:

    * `shard(params)`: the part of the model's parameters this process keeps;
      `rows(m)`: its slice of a batch of `m` tokens;
    * `layer_vjp(x, params, config, token_ids) -> (MoEOutput, backward)`: the
      layer with its route and intermediates, and `backward(dy, dscores=None)
      -> (dx, dparams)`; `layer(x, params, config, token_ids) -> y`: the
      layer's forward alone (the evaluation);
    * `balance(balancer, scores, index, token_ids) -> BalanceStep`: the
      balancer's step on the whole batch, and `auxiliary(balancer, scores,
      index) -> (value, dscores)`: its auxiliary loss of the whole batch and
      the gradient in these rows' scores;
    * `all(flag)`, `max(value)`, `mean(values)`: a condition, a largest
      value and a mean over the whole batch; `cross_entropy(logits,
      targets)`: the mean loss of the whole batch and the gradient of these
      rows' logits;
    * `gradients(grads)`: the whole batch's gradients from these rows'
      (`sum_of_squares(grads)`: of all of them, for the global norm);
    * `step_record()`: what the step's log record adds (nothing here).

    Here each answer is the plain computation on the process's own arrays.
    `refimpl.train.expert_parallel.ExpertParallel` answers the same questions
    across the ranks of an MPI job, each rank with its slice of the batch
    and its block of experts; `size` and `rank` say how many processes there
    are and which one this is.
    """

    rank, size = 0, 1

    def shard(self, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return params

    def rows(self, m: int) -> slice:
        return slice(0, m)

    def layer_vjp(self, x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
                  token_ids: np.ndarray | None) -> tuple[MoEOutput, Callable]:
        return single_process_layer(x, params, config, token_ids)

    def layer(self, x: np.ndarray, params: Mapping[str, np.ndarray], config: MoEConfig,
              token_ids: np.ndarray | None) -> np.ndarray:
        return stable_latent_moe(x, params, config, token_ids=token_ids)

    def balance(self, balancer: Balancer, scores: np.ndarray, index: np.ndarray,
                token_ids: np.ndarray | None) -> BalanceStep:
        return balancer.step(scores, index=index, token_ids=token_ids)

    def auxiliary(self, balancer: Balancer, scores: np.ndarray, index: np.ndarray) -> tuple[float, np.ndarray]:
        return balancer.auxiliary(scores, index)

    def all(self, flag: bool) -> bool:
        return bool(flag)

    def max(self, value: float) -> float:
        return value

    def mean(self, values: np.ndarray) -> float:
        return float(np.mean(values))

    def cross_entropy(self, logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        return cross_entropy(logits, targets)

    def gradients(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return grads

    def sum_of_squares(self, grads: Mapping[str, np.ndarray]) -> float:
        return sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values())

    def step_record(self) -> dict[str, Any]:
        return {}


#: The one process of a run that is not distributed.
ONE_PROCESS = Ranks()


def _router_underflowed(x: np.ndarray, weight: np.ndarray, config: MoEConfig) -> bool:
    """Whether some router score of `x` underflowed to exactly 0 (asked only after the layer refused its input)."""
    return bool(np.any(router_scores(x, weight, config.score_function) == 0))


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
                     with_stats: bool = False, ranks: Ranks = ONE_PROCESS,
                     layer_vjp: LayerVJP | None = None) -> StepResult:
    """One training step's loss and gradients; each layer's balancer reads the layer's route and moves to its next bias.

    Each block runs the layer its balancer asks for (`layer_config`), once,
    forward and backward, through `ranks.layer_vjp` (or `layer_vjp`, if
    given: a test records the layer's calls through it). The bias written into
    `params` before a layer runs is the balancer's held bias, computed from
    the previous step; the balancer then reads this step's scores and the
    layer's route for the next one. The statistics are read off the values
    this pass computed.

    `tokens` and `targets` are this process's rows of the batch, and
    `ranks` says where the rest is (`Ranks`, the default: nowhere, one process;
    `refimpl.train.expert_parallel.ExpertParallel`: on the other ranks); the loss,
    the loads, the statistics and the gradients returned are those of the
    whole batch.
    """
    precision = config.precision
    eps = config.moe.rms_norm_eps
    m, c = tokens.shape
    q = config.target_load
    # The layer each balancer balances, once per step.
    layers = [balancer.layer_config(config.moe) for balancer in balancers]
    # Embedding: $$h^{(0)} = [E_{t_{-c}}; \dots; E_{t_{-1}}]\, W_{\text{mix}}^\top$$
    embedded = params["embed.weight"][tokens].reshape(m, c * config.embed)  # [m, c e]
    w_mix = rounded(params["mix.weight"], precision)
    h = rounded(embedded @ w_mix.T, precision)  # [m, d]
    backs, violations = [], []
    stats: dict[str, list[float]] = {"activation_peak": [], "routed_rms": []}
    balancing: dict[str, list[float]] = {}
    token_ids = tokens[:, -1]  # [m], the byte each position reads last (what hash routing keys on)
    auxiliary_total = 0.0
    for number, (balancer, layer) in enumerate(zip(balancers, layers, strict=True)):
        # Pre-norm: $$a = \operatorname{RMSNorm}(h) \odot g_l$$
        g = params[f"layers.{number}.norm.weight"]
        a = rounded(rms_norm(h, g, eps), precision)  # [m, d]
        # The layer's weights, and the bias its balancer holds from the previous step (stored there only).
        layer_params = {name: (value if name == BIAS else rounded(value, precision))
                        for name, value in block_params(params, number, balancer.bias).items()}
        # A forward pass that overflowed (an infinite input or router weight): no step.
        if not ranks.all(np.all(np.isfinite(a)) and np.all(np.isfinite(layer_params["gate.weight"]))):
            return StepResult(math.nan, {}, [math.nan] * len(balancers))
        # Route with the bias held from the previous step: the layer runs once, forward and backward.
        ids = token_ids if (layer.hash_routing or balancer.needs_token_ids) else None
        try:
            out, moe_back = (ranks.layer_vjp if layer_vjp is None else layer_vjp)(a, layer_params, layer, ids)
        except ValueError:
            # A diverged router whose scores underflowed to 0 (the layer refuses weights of 0/0): no step.
            # (Only on one process: across ranks, the others are waiting in the layer's exchange, and the
            # error ends the job.)
            if ranks.size == 1 and _router_underflowed(a, layer_params["gate.weight"], layer):
                return StepResult(math.nan, {}, [math.nan] * len(balancers))
            raise
        # The balancer reads the layer's scores and route, and computes the next bias.
        step = ranks.balance(balancer, out.scores, out.index, ids)
        # $$\max_j \text{load}_j / q - 1$$
        violations.append(float(step.load.max() / q - 1.0))
        # An auxiliary loss on the router scores: its value now, its gradient through the layer's backward.
        dscores = None
        if balancer.coefficient:
            value, grad = ranks.auxiliary(balancer, out.scores, out.index)
            auxiliary_total += balancer.coefficient * value
            dscores = balancer.coefficient * grad  # [m, n]
            balancing.setdefault("aux_loss", []).append(value)
        if out.kept is not None:
            balancing.setdefault("drop_rate", []).append(1.0 - ranks.mean(out.kept))
        if with_stats:
            stats["activation_peak"].append(ranks.max(out.routed.peak()))
            stats["routed_rms"].append(float(np.sqrt(ranks.mean(np.asarray(out.u, dtype=np.float64) ** 2))))
        # Residual: $$h^{(l)} = h^{(l-1)} + \operatorname{MoE}_l(a)$$
        backs.append((h, g, moe_back, dscores))
        h = rounded(h + rounded(np.asarray(out.y), precision), precision)
    # Output: $$z = (\operatorname{RMSNorm}(h^{(L)}) \odot g_f)\, W_{\text{out}}^\top$$
    a_f = rounded(rms_norm(h, params["norm.weight"], eps), precision)  # [m, d]
    w_out = rounded(params["out.weight"], precision)
    logits = a_f @ w_out.T  # [m, 256]
    with np.errstate(invalid="ignore", over="ignore"):
        loss, dlogits = ranks.cross_entropy(logits, targets)
    if not math.isfinite(loss):
        return StepResult(loss, {}, violations, stats, balancing)

    # ---- backward: the same path in reverse ----
    grads: dict[str, np.ndarray] = {}
    # $$\partial W_{\text{out}} = \partial z^\top a_f, \qquad \partial a_f = \partial z\, W_{\text{out}}$$
    grads["out.weight"] = dlogits.T @ a_f  # [256, d]
    dh, grads["norm.weight"] = rms_norm_backward(h, params["norm.weight"], dlogits @ w_out, eps)  # [m, d], [d]
    for number in reversed(range(len(balancers))):
        if not ranks.all(np.all(np.isfinite(dh))):
            # The gradient overflowed on its way back: no update this step, as for a non-finite loss
            # (the statistics keep the gradient norms of the layers above, which were finite).
            if with_stats:
                _gradient_norms(ranks.gradients(grads), config, stats)
            return StepResult(loss, {}, violations, stats, balancing)
        h_in, g, moe_back, dscores = backs[number]
        # The residual passes $\partial h$ through and adds the block's path; an auxiliary loss adds its
        # gradient in the scores, which the layer's backward carries to the router and the input.
        da, dmoe = moe_back(dh, dscores=dscores)  # [m, d], the layer's parameter gradients
        for name, value in dmoe.items():
            grads[moe_prefix(number) + name] = np.asarray(value)
        dx, grads[f"layers.{number}.norm.weight"] = rms_norm_backward(h_in, g, np.asarray(da), eps)
        dh = dh + dx  # [m, d]
    # $$\partial W_{\text{mix}} = \partial h^{(0)\top} [E], \qquad \partial [E] = \partial h^{(0)} W_{\text{mix}}$$
    grads["mix.weight"] = dh.T @ embedded  # [d, c e]
    dembedded = (dh @ w_mix).reshape(m * c, config.embed)  # [m c, e]
    # Each byte's embedding gathers the gradient of every place it was read (a scatter-add).
    grads["embed.weight"] = np.zeros_like(params["embed.weight"])
    np.add.at(grads["embed.weight"], tokens.reshape(m * c), dembedded)
    # The gradients of the whole batch (on one process: these already are).
    grads = ranks.gradients(grads)
    if with_stats:
        _gradient_norms(grads, config, stats)
    grads = {name: value.astype(np.float32) for name, value in grads.items()}
    if auxiliary_total:
        balancing["objective"] = [loss + auxiliary_total]  # what the gradient is of; `loss` stays the LM loss
    return StepResult(loss, grads, violations, stats, balancing)


def _gradient_norms(grads: Mapping[str, np.ndarray], config: TrainConfig, stats: dict[str, list[float]]) -> None:
    """Add to `stats` the norms of the two latent projections' gradients of every layer `grads` holds, in order."""
    if not config.moe.use_latent_projection:
        return
    for name, key in (("routed_expert_down_proj.weight", "grad_norm_down"),
                      ("routed_expert_up_proj.weight", "grad_norm_up")):
        names = [moe_prefix(number) + name for number in range(config.moe.num_moe_layers)]
        norms = [float(np.linalg.norm(grads[name])) for name in names if name in grads]
        if norms:
            stats[key] = norms


def evaluate(params: Mapping[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
             config: TrainConfig, layers: Sequence[MoEConfig] | None = None, *,
             biases: Sequence[np.ndarray] | None = None, ranks: Ranks = ONE_PROCESS) -> float:
    """The loss on held-out tokens with the biases frozen as they are (inference: no quantile is computed).

    `layers` are the blocks' layers as the balancers give them (default:
    `config.moe` in every block); a capacity is not applied at evaluation,
    where nothing is dropped. `biases` are the blocks' biases as their
    balancers hold them (default: zero). `tokens`, `targets` and `ranks` are as in
    `forward_backward`: the loss is that of the whole held-out batch.
    """
    eps = config.moe.rms_norm_eps
    layers = [config.moe] * config.moe.num_moe_layers if layers is None else layers
    if biases is None:  # the biases the parameters hold, if they do (zero otherwise)
        biases = [params.get(moe_prefix(number) + BIAS, np.zeros(config.moe.num_experts, dtype=np.float32))
                  for number in range(len(layers))]
    m, c = tokens.shape
    h = params["embed.weight"][tokens].reshape(m, c * config.embed) @ params["mix.weight"].T  # [m, d]
    for number, layer in enumerate(layers):
        a = rms_norm(h, params[f"layers.{number}.norm.weight"], eps)
        if not ranks.all(np.all(np.isfinite(a))):
            return math.nan  # a model that has diverged: its activations overflow
        served = layer.replace(capacity_factor=None)
        ids = tokens[:, -1] if served.hash_routing else None
        layer_params = block_params(params, number, biases[number])
        try:
            h = h + np.asarray(ranks.layer(a, layer_params, served, ids))
        except ValueError:
            if ranks.size == 1 and _router_underflowed(a, layer_params["gate.weight"], served):
                return math.nan  # a diverged router, whose weights would be 0/0
            raise
    a_f = rms_norm(h, params["norm.weight"], eps)
    loss, _ = ranks.cross_entropy(a_f @ params["out.weight"].T, targets)
    return loss
