"""refimpl: a readable NumPy reference for the Stable LatentMoE layer of Kimi K3.

The public API re-exported here follows the paper section by section:

* configuration: `MoEConfig`;
* Eq. (12) and Appendix B: `softcap`, `situ_glu`, `swiglu`, their derivatives, `rms_norm`; `relu_glu`, the
  ungated squared ReLU of NVIDIA's LatentMoE;
* Eq. (13): `router_scores`, `route`, `selection_cutoff`, `expert_load`;
* the other routers and balancers: `capacity_keep`, `expert_capacity`, `switch_balance_loss`,
  `sequence_balance_loss`, `hash_route`, `route_by_hash`, `route_by_table`;
* Eq. (11): `init_params`, `MoEParams`, `stable_latent_moe`, `stable_latent_moe_reference`;
* its backward pass by hand: `stable_latent_moe_vjp`;
* accounting: `parameter_counts`, `dispatch_payload`, `combinatorial_sparsity`;
* Eq. (14): `quantile_balancing_update`, `sign_balancing_update`, the stateful balancers;
* Appendix C: `dual_objective`, the coordinate steps, `solve_assignment_lp`;
* Appendix D: `histogram_balancing_update`, `BiasHistogram`;
* real checkpoints: `load_hf_layer`, `save_hf_layer`, `ExpertStack` (packed experts),
  and the microscaling formats `mxfp4_encode`, `mxfp4_decode`, `mxfp8_round` (`refimpl.mx`);
* porting: `params_from_hf_state_dict` and `hf_state_dict_from_params`, one block's weights to and
  from Hugging Face tensor names (`refimpl.checkpoints.state_dict`);
* expert parallelism: `ep_forward` and its backward `ep_vjp`, `ep_balance_update`, `shard_params`,
  `padded_routed_experts`;
* the conformance kit: the subpackage `refimpl.testing` (imported on first use,
  since it needs Hypothesis).
"""

from importlib import import_module
from typing import Any

from .balancing import (
    AssignmentLP,
    Balancer,
    BalanceStep,
    BiasHistogram,
    DescentTrace,
    QuantileBalancer,
    SeparatingDual,
    SignBalancer,
    SubgradientCheck,
    alpha_step,
    beta_step,
    beta_subgradient,
    coordinate_descent,
    cutoffs,
    dual_objective,
    histogram_balancing_update,
    histogram_range,
    interpolated_kth_largest,
    load_ratio,
    margins,
    quantile_balancing_update,
    required_bias,
    separating_dual,
    sign_balancing_update,
    solve_assignment_lp,
    subgradient_check,
    target_load,
)
from .checkpoints import (
    ExpertStack,
    hf_state_dict_from_params,
    load_hf_layer,
    params_from_hf_state_dict,
    save_hf_layer,
)
from .config import MoEConfig
from .layer.accounting import combinatorial_sparsity, dispatch_payload, log10_binomial, parameter_counts
from .layer.activations import (
    hard_clamp,
    hard_clamp_grad,
    relu_glu,
    rms_norm,
    sigmoid,
    situ_glu,
    situ_glu_grad,
    softcap,
    softcap_grad,
    swiglu,
    swiglu_grad,
)
from .layer.backward import stable_latent_moe_vjp
from .layer.baselines import (
    capacity_keep,
    expert_capacity,
    hash_route,
    route_by_hash,
    route_by_table,
    sequence_balance_loss,
    sequence_balance_loss_grad,
    switch_balance_loss,
    switch_balance_loss_grad,
)
from .layer.latent_moe import (
    MoEOutput,
    MoEParams,
    check_params,
    init_params,
    parameter_shapes,
    stable_latent_moe,
    stable_latent_moe_reference,
)
from .layer.routing import (
    biased_scores,
    expert_load,
    route,
    router_scores,
    score_function_values,
    score_function_vjp,
    selection_cutoff,
    softplus,
)
from .layer.selection import select_experts
from .mx import mxfp4_decode, mxfp4_encode, mxfp8_round
from .parallel import (
    EPStats,
    ep_balance_update,
    ep_forward,
    ep_vjp,
    expected_remote_ranks,
    expert_block,
    padded_routed_experts,
    padding_waste,
    shard_params,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import the conformance kit `refimpl.testing` lazily: it needs Hypothesis, the rest does not."""
    if name == "testing":
        return import_module(".testing", __name__)
    raise AttributeError(f"module 'refimpl' has no attribute {name!r}")


__all__ = [
    "score_function_vjp",
    "select_experts",
    "softplus",
    "score_function_values",
    "switch_balance_loss_grad",
    "switch_balance_loss",
    "sequence_balance_loss_grad",
    "sequence_balance_loss",
    "route_by_hash",
    "route_by_table",
    "hash_route",
    "expert_capacity",
    "capacity_keep",
    "AssignmentLP",
    "BalanceStep",
    "Balancer",
    "BiasHistogram",
    "DescentTrace",
    "ExpertStack",
    "EPStats",
    "MoEConfig",
    "MoEOutput",
    "MoEParams",
    "QuantileBalancer",
    "SeparatingDual",
    "SignBalancer",
    "SubgradientCheck",
    "alpha_step",
    "beta_step",
    "beta_subgradient",
    "biased_scores",
    "check_params",
    "combinatorial_sparsity",
    "coordinate_descent",
    "cutoffs",
    "dispatch_payload",
    "dual_objective",
    "ep_balance_update",
    "ep_forward",
    "ep_vjp",
    "expected_remote_ranks",
    "expert_block",
    "expert_load",
    "hard_clamp",
    "hard_clamp_grad",
    "histogram_balancing_update",
    "hf_state_dict_from_params",
    "histogram_range",
    "init_params",
    "interpolated_kth_largest",
    "load_hf_layer",
    "load_ratio",
    "log10_binomial",
    "margins",
    "mxfp4_decode",
    "mxfp4_encode",
    "mxfp8_round",
    "padded_routed_experts",
    "padding_waste",
    "parameter_counts",
    "parameter_shapes",
    "params_from_hf_state_dict",
    "quantile_balancing_update",
    "required_bias",
    "relu_glu",
    "rms_norm",
    "route",
    "save_hf_layer",
    "router_scores",
    "selection_cutoff",
    "separating_dual",
    "shard_params",
    "sigmoid",
    "sign_balancing_update",
    "situ_glu",
    "situ_glu_grad",
    "softcap",
    "softcap_grad",
    "solve_assignment_lp",
    "stable_latent_moe",
    "stable_latent_moe_reference",
    "stable_latent_moe_vjp",
    "subgradient_check",
    "swiglu",
    "swiglu_grad",
    "target_load",
]
