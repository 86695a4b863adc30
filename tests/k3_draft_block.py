"""K3's MoE block as transformers' draft `kimi_k3` builds it, on the pinned transformers' own classes.

The draft (huggingface/transformers PR #47670, `src/transformers/models/kimi_k3/modular_kimi_k3.py` at
`aa83b548`) does not ship in transformers 5.24, but its MoE block is made of classes that do:
`KimiK3MoE(DeepseekV3MoE)` routes with `DeepseekV3TopkRouter` (the draft's `KimiK3TopkRouter` adds nothing),
runs `KimiK3Experts(DeepseekV4Experts)` on the latent and adds `KimiK3MLP` as the shared experts. Only the
lines the draft writes for K3 are transcribed here, verbatim in substance: `situ_and_mul`, `KimiK3MLP`,
`KimiK3Experts.__init__` and `_apply_gate`, and `KimiK3MoE`'s latent modules and forward. Everything else (the
router, the experts' dispatch loop, `DeepseekV3MoE.__init__`, the RMSNorm) is transformers' code, run as it is.

No configuration class of the draft is in the index: the block is built from a `DeepseekV3Config` given the
three keys the draft's block reads beyond it (`routed_expert_hidden_size`, `activation_situ_beta`,
`activation_situ_linear_beta`). As the generated modeling file would, the block's `experts` and
`shared_experts` are K3's classes where `DeepseekV3MoE.__init__` names DeepSeek-V3's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DeepseekV3Config
from transformers.integrations.moe import use_experts_implementation
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import refimpl


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """The draft's SiTU-GLU: computed in float32 and cast back to the input's dtype."""
    original_dtype = gate.dtype
    gate = gate.to(torch.float32)
    up = up.to(torch.float32)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    out = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up
    return out.to(original_dtype)


class KimiK3MLP(nn.Module):
    """The draft's shared experts: one SiTU-GLU MLP on the full width."""

    def __init__(self, config: Any, intermediate_size: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.beta = config.activation_situ_beta
        self.linear_beta = config.activation_situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_and_mul(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


@use_experts_implementation
class KimiK3Experts(DeepseekV4Experts):
    """The draft's routed experts: DeepSeek-V4's fused stacks at the latent width, SiTU-GLU for the gate."""

    def __init__(self, config: Any):
        nn.Module.__init__(self)
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.routed_expert_hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.beta = config.activation_situ_beta
        self.linear_beta = config.activation_situ_linear_beta

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return situ_and_mul(gate, up, self.beta, self.linear_beta)


class KimiK3MoE(DeepseekV3MoE):
    """The draft's block: DeepSeek-V3's router and shared experts around a latent with its norm."""

    def __init__(self, config: Any):
        super().__init__(config)
        # What the generated modeling file builds in DeepseekV3MoE.__init__'s place: K3's experts and MLP.
        self.experts = KimiK3Experts(config)
        self.shared_experts = KimiK3MLP(config, intermediate_size=config.moe_intermediate_size
                                        * config.n_shared_experts)
        self.hidden_size = config.hidden_size
        self.moe_hidden_size = config.routed_expert_hidden_size
        self.rms_norm_eps = config.rms_norm_eps
        self.routed_expert_down_proj = nn.Linear(self.hidden_size, self.moe_hidden_size, bias=False)
        self.routed_expert_norm = LlamaRMSNorm(self.moe_hidden_size, self.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(self.moe_hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        orig_shape = hidden_states.shape
        _, topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.routed_expert_down_proj(hidden_states)
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights)
        hidden_states = self.routed_expert_norm(hidden_states)
        hidden_states = self.routed_expert_up_proj(hidden_states)
        hidden_states = hidden_states.view(*orig_shape)
        return hidden_states + self.shared_experts(residuals)


def draft_config(config: refimpl.MoEConfig, norm_topk_prob: bool | None = None) -> DeepseekV3Config:
    """The draft block's configuration for a K3 layer: DeepSeek-V3's keys and the draft's three more.

    `norm_topk_prob` is the file's `moe_renormalize` (default: `config.renormalize`); a K3 file of a top-1
    layer may say true, which K3's code ignores for a single expert and the draft's router does not.
    """
    hf = DeepseekV3Config(
        hidden_size=config.hidden_size, n_routed_experts=config.num_experts, num_experts_per_tok=config.top_k,
        moe_intermediate_size=config.intermediate_size, n_shared_experts=config.num_shared_experts,
        routed_scaling_factor=config.routed_scaling_factor, n_group=config.n_group, topk_group=config.topk_group,
        norm_topk_prob=config.renormalize if norm_topk_prob is None else norm_topk_prob, rms_norm_eps=config.rms_norm_eps)
    hf.routed_expert_hidden_size = config.latent_size
    hf.activation_situ_beta = config.situ_beta
    hf.activation_situ_linear_beta = config.situ_linear_beta
    hf._experts_implementation = "eager"  # the experts' loop, which runs in any dtype
    return hf


def draft_block(config: refimpl.MoEConfig, norm_topk_prob: bool | None = None) -> KimiK3MoE:
    """An untrained float64 draft block for `config` (load its weights with `load_state_dict`)."""
    return KimiK3MoE(draft_config(config, norm_topk_prob)).double().eval()
