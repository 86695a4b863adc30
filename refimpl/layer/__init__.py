r"""The layer: Eqs. (11)-(13), the Stable LatentMoE block of Kimi K3, forward and backward.

$$
y = \sum_j E_j^{\text{shared}}(x) + W_\uparrow\,\operatorname{RMSNorm}\Bigl(\sum_{i \in \mathcal{T}_k(x)} p_i\, E_i^{\text{routed}}(W_\downarrow x)\Bigr)
$$

Read in this order: the whole block first, then its two pieces, then what
builds on them.

| module | what it holds |
|---|---|
| `refimpl.layer.latent_moe` | Eq. (11): the parameters and the nine stages of the forward pass |
| `refimpl.layer.activations` | Eq. (12) and Appendix B: softcap, SiTU-GLU, SwiGLU and their derivatives |
| `refimpl.layer.routing` | Eq. (13): sigmoid scores, the bias that only selects, weights from the raw scores |
| `refimpl.layer.selection` | step 2 as a configuration describes it, and the tables where the other systems enter |
| `refimpl.layer.backward` | the backward pass by hand, section by section beside the forward |
| `refimpl.layer.accounting` | parameters, activated parameters, payload and combinatorial sparsity, from a config |
| `refimpl.layer.baselines` | the other routers and balancers: capacity, auxiliary losses, hash routing |

The K3 layer comes first and whole; the comparison systems enter only
through the named extension points of `refimpl.layer.selection`. Every
other path of the package (expert parallelism, training, the conformance
kit) calls these functions; none writes the layer again.
"""

from __future__ import annotations

from . import accounting, activations, backward, baselines, latent_moe, routing, selection

__all__ = ["accounting", "activations", "backward", "baselines", "latent_moe", "routing", "selection"]
