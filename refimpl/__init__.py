"""refimpl: a readable NumPy reference for the Stable LatentMoE layer of Kimi K3.

The public API re-exported here follows the paper section by section:

* configuration: `MoEConfig`;
* Eq. (12) and Appendix B: `softcap`, `situ_glu`, `swiglu`, `rms_norm`;
* Eq. (13): `router_scores`, `route`, `expert_load`;
* Eq. (11): `init_params`, `MoEParams`, `stable_latent_moe`;
* accounting: `parameter_counts`, `dispatch_payload`, `combinatorial_sparsity`.
"""

from .accounting import combinatorial_sparsity, dispatch_payload, parameter_counts
from .activations import (
    hard_clamp,
    rms_norm,
    situ_glu,
    situ_glu_grad,
    softcap,
    softcap_grad,
    swiglu,
    swiglu_grad,
)
from .config import MoEConfig
from .latent_moe import (
    MoEOutput,
    MoEParams,
    init_params,
    parameter_shapes,
    stable_latent_moe,
    stable_latent_moe_reference,
)
from .routing import biased_scores, expert_load, route, router_scores

__version__ = "0.1.0"

__all__ = [
    "MoEConfig",
    "MoEOutput",
    "MoEParams",
    "biased_scores",
    "combinatorial_sparsity",
    "dispatch_payload",
    "expert_load",
    "hard_clamp",
    "init_params",
    "parameter_counts",
    "parameter_shapes",
    "rms_norm",
    "route",
    "router_scores",
    "situ_glu",
    "situ_glu_grad",
    "softcap",
    "softcap_grad",
    "stable_latent_moe",
    "stable_latent_moe_reference",
    "swiglu",
    "swiglu_grad",
]
