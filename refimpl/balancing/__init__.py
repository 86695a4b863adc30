r"""Balancing: Eq. (14), why it is right (Appendix C), how it scales (Appendix D), and the rules it is compared with.

The bias $b$ of Eq. (13) only selects experts; this package sets it. Read in
this order:

| module | what it holds |
|---|---|
| `refimpl.balancing.balancer` | `Balancer`, the one interface of every rule: it holds a layer's bias between steps, routes a batch with it, then computes the next |
| `refimpl.balancing.quantile` | Eq. (14): the cutoffs, the margins and the quantile that give the next bias (`QuantileBalancer`), and DeepSeek-V3's sign rule beside it |
| `refimpl.balancing.dual` | Appendix C: the balanced-assignment LP, its dual, and Eq. (14) as coordinate descent on it, checked with HiGHS |
| `refimpl.balancing.histogram` | Appendix D: the same update read from integer counts that add across ranks and micro-batches |
| `refimpl.balancing.shipped` | Eq. (14) as other code ships it: the bias's sign, Megatron-Core's per-micro-batch update on raw logits, a fixed histogram range |
| `refimpl.balancing.other_balancers` | the other balancers a small model is trained with: auxiliary losses, capacity with dropping, hash routing |

Data flows one way: the layer's routing (`refimpl.layer.routing`) gives the
cutoffs; Eq. (14) reads them; the dual explains the update; the histogram
estimates it at scale. Every rule is a `Balancer`, and every kind is known
(`Balancer.kinds`) once this package is imported.
"""

from __future__ import annotations

from .balancer import FORMER_KINDS, Balancer, BalanceStep, load_ratio
from .dual import (
    AssignmentLP,
    DescentTrace,
    SeparatingDual,
    SubgradientCheck,
    alpha_step,
    beta_step,
    beta_subgradient,
    coordinate_descent,
    dual_objective,
    separating_dual,
    solve_assignment_lp,
    subgradient_check,
)
from .histogram import (
    BiasHistogram,
    HistogramBalancer,
    histogram_balancing_update,
    histogram_range,
    required_bias,
)
from .other_balancers import AuxLossBalancer, CapacityBalancer, HashBalancer, SequenceLossBalancer
from .quantile import (
    FrozenBalancer,
    QuantileBalancer,
    SignBalancer,
    cutoff_values,
    cutoffs,
    expert_major_margins,
    interpolated_kth_largest,
    kth_largest,
    margins,
    quantile_balancing_update,
    quantile_rank,
    quantile_thresholds,
    sign_balancing_update,
    target_load,
)
from .shipped import (
    MegatronGlobalBatchQB,
    TorchtitanQuantileBalancer,
    megatron_global_batch_update,
    megatron_qb_update,
    megatron_quantile,
    torchtitan_estimate,
    torchtitan_qb_update,
)

__all__ = [
    "FORMER_KINDS", "AssignmentLP", "MegatronGlobalBatchQB", "TorchtitanQuantileBalancer", "AuxLossBalancer", "BalanceStep", "Balancer", "BiasHistogram",
    "CapacityBalancer", "DescentTrace", "FrozenBalancer", "HashBalancer", "HistogramBalancer", "QuantileBalancer",
    "SeparatingDual", "SequenceLossBalancer", "SignBalancer", "SubgradientCheck", "alpha_step", "beta_step",
    "beta_subgradient", "coordinate_descent", "cutoff_values", "cutoffs", "dual_objective", "expert_major_margins",
    "histogram_balancing_update", "histogram_range", "interpolated_kth_largest", "kth_largest", "load_ratio",
    "margins", "megatron_global_batch_update", "megatron_qb_update", "megatron_quantile", "quantile_balancing_update", "quantile_rank", "quantile_thresholds", "required_bias",
    "separating_dual", "sign_balancing_update", "solve_assignment_lp", "subgradient_check", "target_load", "torchtitan_estimate", "torchtitan_qb_update",
]
