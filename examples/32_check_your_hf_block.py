r"""Check your own K3 block: a PyTorch port with one mistake, the report, the fix

You have ported K3's MoE block to your framework: an `nn.Module` that loads
the checkpoint's tensors by their Hugging Face names and runs the layer.
`refimpl.testing.check_hf_moe_block` holds it, whole, against the reference:
it draws configurations the reference modeling code accepts (as `text_config`
keys), weights and tokens, hands your `build` the config and the tensors, and
compares what your block returns with `stable_latent_moe`.

The port below is written the way such ports are written, and it carries one
mistake that real inference engines have shipped (vLLM #12002; a regression
in transformers, #41647): its router takes the mixture weights from the
**biased** scores $s + b$, the ones it selects with, instead of the raw scores
$s$. On a block whose bias is zero (a freshly initialized model) the two agree;
on a trained model they do not. The example runs the check, reads its report
(which names the mistake), pastes the case the report prints to see the
difference token by token, fixes the one line, and runs the check again.

The port needs PyTorch; without it the example says so and stops.
"""

# %%
from __future__ import annotations

import argparse
import json
import re
import warnings
from pathlib import Path

import numpy as np

import refimpl
from refimpl.testing import CheckFailure, CheckResult, check_hf_moe_block

try:
    import torch
    from torch import nn
except ImportError:  # the example explains itself without PyTorch, and stops
    torch = None

Module = nn.Module if torch is not None else object  # lets this file load without PyTorch


# %%
class Expert(Module):
    """One routed expert: w1 (gate), w3 (up), w2 (down), as the checkpoint names them."""

    def __init__(self, width: int, f: int):
        super().__init__()
        self.w1 = nn.Linear(width, f, bias=False)
        self.w3 = nn.Linear(width, f, bias=False)
        self.w2 = nn.Linear(f, width, bias=False)


class Router(Module):
    """The gate: `weight` [n, d] and the selection bias `e_score_correction_bias` [n]."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(n))


class MyK3Block(Module):
    """A port of K3's MoE block, built from the `text_config` keys, with the checkpoint's module names."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        d, n, f = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
        latent = cfg.get("routed_expert_hidden_size")  # absent: no latent, the experts see x itself
        width = latent or d
        self.gate = Router(n, d)
        if latent:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
            if cfg.get("latent_moe_use_norm", False):
                self.routed_expert_norm = nn.RMSNorm(latent, eps=cfg.get("rms_norm_eps", 1e-6))
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)
        self.experts = nn.ModuleList(Expert(width, f) for _ in range(n))
        # The shared MLP exists unless num_shared_experts is null, as in the reference code: absent or 0 it has
        # width 0, and the checkpoint's state dict holds its zero-element tensors; null, there is none.
        # (PyTorch warns that initializing a zero-element tensor does nothing: true, and harmless here.)
        shared = cfg.get("num_shared_experts", 0)
        if shared is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
                self.shared_experts = nn.ModuleDict({
                    "gate_proj": nn.Linear(d, shared * f, bias=False),
                    "up_proj": nn.Linear(d, shared * f, bias=False),
                    "down_proj": nn.Linear(shared * f, d, bias=False)})

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiTU-GLU (or SwiGLU for hidden_act "silu"), with the reference's meaning of absent caps."""
        if self.cfg.get("hidden_act", "silu") != "situ":
            return nn.functional.silu(gate) * up
        beta = self.cfg.get("activation_situ_beta") or 1.0
        linear_beta = self.cfg.get("activation_situ_linear_beta")  # absent: the up branch is not capped
        if linear_beta is not None:
            up = linear_beta * torch.tanh(up / linear_beta)
        return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up

    def mixture_weights(self, scores: torch.Tensor, biased: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The k weights of each token's chosen experts, before renormalization. THE PLANTED MISTAKE:"""
        return biased.gather(1, index)  # should be scores.gather(1, index): the bias only selects

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        k, n = cfg["num_experts_per_token"], cfg["num_experts"]
        logits = x.float() @ self.gate.weight.float().T  # [m, n], float32 as in the reference
        if cfg.get("moe_router_activation_func", "sigmoid") == "softmax":
            scores = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
        biased = scores + self.gate.e_score_correction_bias
        groups, keep = cfg.get("num_expert_group") or 1, cfg.get("topk_group") or 1
        if groups > 1:  # DeepSeek-V3's group-limited routing: a group is scored by its two best experts
            group_score = biased.view(len(x), groups, -1).topk(2, dim=-1).values.sum(-1)  # [m, G]
            dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(
                1, group_score.topk(keep, dim=-1).indices, False)
            biased = biased.masked_fill(dropped.repeat_interleave(n // groups, dim=1), float("-inf"))
        index = biased.topk(k, dim=-1).indices  # [m, k]
        weights = self.mixture_weights(scores, biased, index)
        if k > 1 and cfg.get("moe_renormalize", True):  # the reference keeps a single weight as it is
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return index, weights * cfg.get("routed_scaling_factor", 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weights = self.route(x)
        h = self.routed_expert_down_proj(x) if hasattr(self, "routed_expert_down_proj") else x
        u = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(index == e, as_tuple=True)
            if len(token):
                z = h[token]
                out = expert.w2(self.act(expert.w1(z), expert.w3(z)))
                u.index_add_(0, token, out * weights[token, slot, None])
        if hasattr(self, "routed_expert_norm"):
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u) if hasattr(self, "routed_expert_up_proj") else u
        if hasattr(self, "shared_experts"):
            s = self.shared_experts
            y = y + s["down_proj"](self.act(s["gate_proj"](x), s["up_proj"](x)))
        return y


# %%
class FixedK3Block(MyK3Block):
    """The same port with the one line fixed: the weights come from the raw scores."""

    def mixture_weights(self, scores: torch.Tensor, biased: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return scores.gather(1, index)


def builder(block_class: type) -> callable:
    """The `build` the check calls: make the block, load the tensors strictly, return a NumPy forward."""

    def build(text_config: dict, state_dict: dict[str, np.ndarray]):
        block = block_class(text_config)
        block.load_state_dict({name: torch.from_numpy(value) for name, value in state_dict.items()}, strict=True)

        def forward(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return block(torch.from_numpy(x)).numpy()

        return forward

    return build


# %%
def check_port(block_class: type) -> CheckFailure | CheckResult | None:
    """Run the check on a port: the report it raises, or the result when it passes (None without PyTorch).

    The port's loader reads float tensors only, so the check draws no MXFP4 cases (`mxfp4=False`).
    """
    if torch is None:
        print("PyTorch is not installed: this example's port is a PyTorch module (pip install torch).")
        return None
    torch.manual_seed(0)
    try:
        return check_hf_moe_block(builder(block_class), mxfp4=False)
    except CheckFailure as failure:
        return failure


def paste_case(report: CheckFailure | None) -> dict | None:
    """Paste the case a report prints, exactly as printed, and compare the port with the reference on it."""
    if not isinstance(report, CheckFailure):
        return None
    pasted = re.findall(r"^ +((?:text_config|case) = .*)$", str(report), flags=re.MULTILINE)[:2]
    namespace = {"json": json, "np": np, "refimpl": refimpl}
    exec("\n".join(pasted), namespace)  # the two lines a reader copies from the report
    text_config, case = namespace["text_config"], namespace["case"]
    y = builder(MyK3Block)(text_config, case.state_dict)(case.x)
    expected = case.expected()
    print(f"the pasted case: {case.tokens} token(s), d = {case.config.d}, n = {case.config.n}, "
          f"bias {np.round(case.state_dict['gate.e_score_correction_bias'], 4)}")
    print("  yours   ", np.round(y[0], 5))
    print("  expected", np.round(expected[0], 5))
    return {"text_config": text_config, "difference": y - expected}


# %%
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="accepted for uniformity; this example draws no figure")
    parser.parse_args(argv)

    # Step 1: check the port
    report = check_port(MyK3Block)
    print(report)
    print()

    # What to see: on one token with n = 2 and k = 1, both entries of y come out too large by the same factor:
    # with a single expert chosen, y is that expert's output times its weight, and the port's weight is s + b,
    # not s. Shifting every bias by 8 should change nothing, yet y jumps to [1.40066, 0.11956], because the
    # shift goes into the weight. The report names the mistake, bias_in_weights, after checking that it
    # reproduces the port's output on 6 more cases.

    # Step 2: read the report: the catalogue entry it names, and the case it prints
    named = report.violations[0].conventions if isinstance(report, CheckFailure) else None
    print("the report names:", named)
    pasted = paste_case(report)
    print()

    # What to see: the two lines pasted from the report rebuild its case exactly, and the port gives the same
    # y as in the report: 0.07558 against the expected 0.0636 in its first entry. Its output is the larger
    # because the chosen expert's bias is positive (0.0723), so s + b exceeds s; with a zero bias, as in a
    # freshly initialized model, the two would agree.

    # Step 3: fix the one line and check again
    result = check_port(FixedK3Block)
    print(result)

    # What to see: with the weights taken from the raw scores, all 4 invariants hold on up to 50 cases each,
    # the bias shift included: the bias only selects the experts and never weighs them. The closing note says
    # the check also saw that the port keeps a single weight raw, as K3's code does, on every top-1 case.

    return {"named": named, "pasted": pasted, "fixed": getattr(result, "passed", None)}


# %%
if __name__ == "__main__":
    main()
