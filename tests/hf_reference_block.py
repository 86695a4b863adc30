"""The reference K3 MoE block as PyTorch modules, for the tests of the porter's toolkit.

A transcription of the reference modeling code's `KimiMoEGate` and
`KimiSparseMoeBlock` as `nn.Module`s, built from the raw `text_config` keys with the
reference's meaning of absent keys, one module per routed expert, so that its
`state_dict()` has exactly the names of the released checkpoint. It shares no code
with `refimpl`: `tests/test_hf_block.py` checks it against the functional
transcription `tests/test_checkpoint.py::reference_block`, and then uses it as "a
port" that must pass `refimpl.testing.check_hf_moe_block`.

Precision follows the reference: the gate runs in float32 whatever the block's dtype,
the SiTU activation is computed in float32 and cast back, the routed experts are
accumulated in float32, and the RMSNorm computes in float32.

`mistakes` plants known porting mistakes, one keyword each (the names of
`refimpl.testing.conventions`), each written the way a port would write it, in
PyTorch, independently of the catalogue's NumPy variants.

MXFP4 experts (`weight_packed` / `weight_scale`) are decoded by compressed-tensors, the
library whose format the checkpoint uses, before `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np
import torch
from torch import nn

MISTAKES = {
    "bias_in_weights", "scale_applied_twice", "scale_skipped_without_renormalization", "top1_renormalized",
    "groups_by_max", "up_cap_flipped", "latent_norm_dropped", "silu_for_situ", "bf16_router",
    "mxfp4_nibbles_swapped", "e8m0_bias_125", "e8m0_as_e4m3", "gate_up_swapped", "bias_subtracted",
    "shared_experts_dropped", "bias_on_logits", "router_in_bfloat16", "norm_after_up_projection", "norm_eps_other",
    "experts_summed_in_bfloat16",
}


class KimiMoEGate(nn.Module):
    """The router: float32 logits, sigmoid (or softmax) scores, biased top-k, weights from raw scores."""

    def __init__(self, text: Mapping, mistakes: frozenset[str]):
        super().__init__()
        self.text, self.mistakes = text, mistakes
        n, d = text["num_experts"], text["hidden_size"]
        self.weight = nn.Parameter(torch.empty(n, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(n, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        text, mistakes = self.text, self.mistakes
        n, top_k = text["num_experts"], text["num_experts_per_token"]
        if "bf16_router" in mistakes:
            logits = (x.bfloat16() @ self.weight.bfloat16().T).float()  # the GEMM's output rounded to bfloat16
        elif "router_in_bfloat16" in mistakes:
            logits = x.bfloat16() @ self.weight.bfloat16().T  # and everything after it stays bfloat16
        else:
            logits = x.float() @ self.weight.float().T  # [m, n], float32 whatever the block's dtype
        if text.get("moe_router_activation_func", "sigmoid") == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        bias = self.e_score_correction_bias.float()
        if "router_in_bfloat16" in mistakes:
            bias = bias.bfloat16()
        choice = scores - bias if "bias_subtracted" in mistakes else scores + bias  # [m, n]
        if "bias_on_logits" in mistakes:
            choice = logits + bias  # Megatron-Core's QB router: top-k of logits - qb_beta
        groups, keep = text.get("num_expert_group") or 1, text.get("topk_group") or 1
        if groups > 1 and groups > keep:
            grouped = choice.view(len(x), groups, -1)  # [m, G, n/G]
            if "groups_by_max" in mistakes:
                group_score = grouped.max(dim=-1).values
            else:
                group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [m, G]
            chosen = group_score.topk(keep, dim=-1).indices
            mask = torch.zeros_like(group_score).scatter_(1, chosen, 1.0).bool()
            choice = choice.masked_fill(~mask[:, :, None].expand_as(grouped).reshape(len(x), n), float("-inf"))
        if "router_in_bfloat16" in mistakes:  # bfloat16 ties are common: a stable sort keeps the lower id first
            idx = torch.sort(choice.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
        else:
            idx = torch.topk(choice, top_k, dim=-1).indices  # [m, k]
        weight = (choice if "bias_in_weights" in mistakes else scores).gather(1, idx)
        renormalize = top_k > 1 or "top1_renormalized" in mistakes
        if renormalize and text.get("moe_renormalize", True):
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        scale = text.get("routed_scaling_factor", 1.0)
        if "scale_applied_twice" in mistakes:
            weight = weight * scale
        renormalized = top_k > 1 and text.get("moe_renormalize", True)
        if renormalized or "scale_skipped_without_renormalization" not in mistakes:
            weight = weight * scale
        return idx, weight.float()


class SiTU(nn.Module):
    """The experts' activation from the config keys, computed in float32 and cast back."""

    def __init__(self, text: Mapping, mistakes: frozenset[str]):
        super().__init__()
        self.situ = text.get("hidden_act", "silu") == "situ" and "silu_for_situ" not in mistakes
        self.beta = text.get("activation_situ_beta") or 1.0
        self.linear_beta = text.get("activation_situ_linear_beta")
        if "up_cap_flipped" in mistakes:
            self.linear_beta = 25.0 if self.linear_beta is None else None

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        dtype = gate.dtype
        gate, up = gate.float(), up.float()
        if not self.situ:
            return (nn.functional.silu(gate) * up).to(dtype)
        g = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        if self.linear_beta is not None:
            up = self.linear_beta * torch.tanh(up / self.linear_beta)
        return (g * up).to(dtype)


class KimiExpert(nn.Module):
    """One routed expert: w1 (gate) and w3 (up) [f, width], w2 (down) [width, f]."""

    def __init__(self, width: int, f: int, act: SiTU, swap: bool):
        super().__init__()
        self.w1 = nn.Linear(width, f, bias=False)
        self.w3 = nn.Linear(width, f, bias=False)
        self.w2 = nn.Linear(f, width, bias=False)
        self.act, self.swap = act, swap

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(z), self.w3(z)
        if self.swap:
            gate, up = up, gate
        return self.w2(self.act(gate, up))


class KimiMLP(nn.Module):
    """The merged shared experts: one GLU of width N_s * f on the full-width input."""

    def __init__(self, d: int, width: int, act: SiTU):
        super().__init__()
        self.gate_proj = nn.Linear(d, width, bias=False)
        self.up_proj = nn.Linear(d, width, bias=False)
        self.down_proj = nn.Linear(width, d, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class KimiRMSNorm(nn.Module):
    """RMSNorm computed in float32, its gain applied after the cast back."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class KimiSparseMoeBlock(nn.Module):
    """The reference MoE block of one layer, from the `text_config` keys."""

    def __init__(self, text: Mapping, mistakes: Iterable[str] = ()):
        super().__init__()
        mistakes = frozenset(mistakes)
        unknown = mistakes - MISTAKES
        if unknown:
            raise ValueError(f"unknown mistakes {sorted(unknown)}; known: {sorted(MISTAKES)}")
        self.text, self.mistakes = dict(text), mistakes
        d, n, f = text["hidden_size"], text["num_experts"], text["moe_intermediate_size"]
        act = SiTU(text, mistakes)
        self.gate = KimiMoEGate(text, mistakes)
        latent = text.get("routed_expert_hidden_size")
        self.latent = latent is not None
        self.use_norm = self.latent and bool(text.get("latent_moe_use_norm", False))
        width = latent if self.latent else d
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
            if self.use_norm:
                eps = text.get("rms_norm_eps", 1e-6)
                if "norm_eps_other" in mistakes:
                    eps = 1e-6 if eps == 1e-5 else 1e-5
                self.routed_expert_norm = KimiRMSNorm(latent, eps)
            if "norm_after_up_projection" in mistakes and latent != d:
                from refimpl.testing import Unsupported

                raise Unsupported("a norm after the up-projection needs a gain as wide as the model")
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)
        self.experts = nn.ModuleList(KimiExpert(width, f, act, "gate_up_swapped" in mistakes) for _ in range(n))
        shared = text.get("num_shared_experts", 0)
        self.has_shared = bool(shared)
        # The reference code builds the shared MLP when num_shared_experts is not None (`if
        # config.num_shared_experts is not None`): absent or 0 it is a width-0 MLP, whose state_dict() holds
        # zero-element tensors ([0, d], [0, d], [d, 0]); null, there is no shared module at all.
        if shared is not None:
            self.shared_experts = KimiMLP(d, shared * f, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weight = self.gate(x)  # [m, k] each, float32 weights
        h = self.routed_expert_down_proj(x) if self.latent else x  # [m, width]
        summed = torch.bfloat16 if "experts_summed_in_bfloat16" in self.mistakes else torch.float32
        u = torch.zeros(h.shape, dtype=summed)  # the routed sum, accumulated in float32
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(idx == e, as_tuple=True)
            if len(token) == 0:
                continue
            out = expert(h[token])  # [m_e, width]
            u.index_add_(0, token, (out.float() * weight[token, slot, None]).to(summed))
        after_up = "norm_after_up_projection" in self.mistakes
        if self.use_norm and "latent_norm_dropped" not in self.mistakes and not after_up:
            y = self.routed_expert_norm(u.to(h.dtype))
        else:
            y = u.to(h.dtype)
        if self.latent:
            y = self.routed_expert_up_proj(y)
        if self.use_norm and after_up:
            y = self.routed_expert_norm(y)
        if self.has_shared and "shared_experts_dropped" not in self.mistakes:
            y = y + self.shared_experts(x)
        return y


# ---------------------------------------------------------------------------
# NumPy in, NumPy out: the `build` that check_hf_moe_block calls
# ---------------------------------------------------------------------------

def to_torch(a: np.ndarray) -> torch.Tensor:
    """A NumPy array (bfloat16 from ml_dtypes included) as a tensor of the same dtype."""
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                            scale_dtype=torch.uint8)
    return QuantizationScheme(targets=["Linear"], weights=args)


def _decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, mistakes: frozenset[str]) -> torch.Tensor:
    """Expert matrices (rows stacked) from their MXFP4 pairs, decoded by compressed-tensors.

    A planted mistake, if any, is applied to the bytes or the result the way a port's loader would.
    """
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

    if "mxfp4_nibbles_swapped" in mistakes:
        packed = ((packed & 0x0F) << 4) | (packed >> 4)
    if "e8m0_bias_125" in mistakes:
        scale = scale + 2  # 2^(s - 125) = 2^((s + 2) - 127)
    if "e8m0_as_e4m3" in mistakes:
        # Decode with unit scales (byte 127 = 2^0), then multiply each block by the byte read as E4M3.
        unit = torch.full_like(scale, 127)
        w = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": unit}, _scheme())["weight"]
        e4m3 = scale.view(torch.float8_e4m3fn).float()  # [out, in/32]
        return (w.float().view(*scale.shape, 32) * e4m3[..., None]).view(w.shape)
    return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, _scheme())["weight"]


def decode_mxfp4_pairs(state_dict: Mapping[str, np.ndarray], mistakes: frozenset[str]) -> dict[str, torch.Tensor]:
    """Every MXFP4 pair of the state dict as a float32 `.weight`, one decoder call per matrix shape."""
    modules = [name[: -len(".weight_packed")] for name in state_dict if name.endswith(".weight_packed")]
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for module in modules:
        by_shape.setdefault(tuple(state_dict[module + ".weight_packed"].shape), []).append(module)
    out = {}
    for names in by_shape.values():
        packed = torch.cat([to_torch(state_dict[m + ".weight_packed"]) for m in names])  # [len * out, in/2]
        scale = torch.cat([to_torch(state_dict[m + ".weight_scale"]) for m in names])  # [len * out, in/32]
        weights = _decode_mxfp4(packed, scale, mistakes).float().split(len(packed) // len(names))
        out.update({m + ".weight": w for m, w in zip(names, weights, strict=True)})
    return out


def build_block(text: Mapping, state_dict: Mapping[str, np.ndarray], mistakes: Iterable[str] = ()):
    """`build` for `check_hf_moe_block`: the reference block loaded strictly; returns its NumPy forward.

    The block runs in the dtype of the state dict's `gate.weight` (the bias stays float32).
    """
    block = KimiSparseMoeBlock(text, mistakes)
    tensors = {name: to_torch(value) for name, value in state_dict.items()
               if not name.endswith((".weight_packed", ".weight_scale"))}
    tensors.update(decode_mxfp4_pairs(state_dict, block.mistakes))
    dtype = tensors["gate.weight"].dtype
    block = block.to(dtype)
    block.load_state_dict(tensors, strict=True)
    block.gate.e_score_correction_bias.data = tensors["gate.e_score_correction_bias"].float()

    def forward(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            y = block(to_torch(x).to(dtype))
        return y.float().numpy()

    return forward


def planted(*mistakes: str):
    """A `build` whose block carries the given mistakes."""
    return lambda text, state_dict: build_block(text, state_dict, mistakes)
