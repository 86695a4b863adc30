r"""Check a DeepSeek-V3 port: the same kit, that model's keys, tensors and rules

`check_hf_moe_block` is not only for K3. With `model_type="deepseek_v3"` it
draws configurations in DeepSeek-V3's own keys (`n_routed_experts`,
`num_experts_per_tok`, `n_group`, ...; absent keys meaning what
transformers' `DeepseekV3Config` makes of them), hands the tensors under the
names of transformers' `DeepseekV3MoE` (its experts fused into
`experts.gate_up_proj` and `experts.down_proj`), and holds the output to
DeepSeek-V3's rules: one chosen expert's weight is renormalized to 1, which
K3's code does not do.

The port below is a small PyTorch DeepSeek-V3 block written from those
names. It carries a mistake that shipped in real code: the experts of the
groups a token does not choose are masked with **0** instead of $-\infty$.
While the biased scores $s + b$ are positive (sigmoid scores, a bias near
zero) the masked experts still lose, and the mistake shows only on the rare
token whose chosen groups hold a negative $s + b$. Trained biases sit far
from zero; once $s + b$ is negative, a masked expert at 0 beats every expert
of the chosen groups. The kit shifts every bias by one constant, which
changes nothing for a correct block, and draws biases far from zero. Either
can catch the mistake: the plain comparison on a drawn case whose bias makes a
kept score negative, the bias shift on any case with groups. Below, the shift
(every bias moved by -40) catches it and the report names it; none of this
run's 50 drawn cases for the plain comparison happened to hold such a score.
The example runs the check, reads the report, fixes the one line, and checks
again.

The port needs PyTorch; without it the example says so and stops.
"""

# %%
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np

from refimpl.testing import CheckFailure, CheckResult, check_hf_moe_block

try:
    import torch
    from torch import nn
except ImportError:  # the example explains itself without PyTorch, and stops
    torch = None

Module = nn.Module if torch is not None else object  # lets this file load without PyTorch


# %%
class Router(Module):
    """DeepSeek-V3's gate: `weight` [n, d] and the selection bias `e_score_correction_bias` [n], in float32."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(n))


class Experts(Module):
    """The routed experts, fused as transformers 5 stores them: gate rows then up rows, and the down matrices."""

    def __init__(self, n: int, d: int, f: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * f, d))  # [n, 2f, d]
        self.down_proj = nn.Parameter(torch.empty(n, d, f))  # [n, d, f]


class MyDeepseekV3Block(Module):
    """A port of DeepSeek-V3's MoE block, built from its config keys, with its module names."""

    # What DeepSeek-V3's configuration class makes of an absent key.
    DEFAULTS = {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                "norm_topk_prob": True}

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = {**self.DEFAULTS, **cfg}
        d, n, f = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        self.gate = Router(n, d)
        self.experts = Experts(n, d, f)
        shared = self.cfg["n_shared_experts"] * f
        # With n_shared_experts = 0 the shared MLP has width 0 and the state dict holds its zero-element tensors.
        # (PyTorch warns that initializing a zero-element tensor does nothing: true, and harmless here.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
            self.shared_experts = nn.ModuleDict({
                "gate_proj": nn.Linear(d, shared, bias=False), "up_proj": nn.Linear(d, shared, bias=False),
                "down_proj": nn.Linear(shared, d, bias=False)})

    MASKED = 0.0  # THE PLANTED MISTAKE: the experts of dropped groups get 0; it should be float("-inf")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, n = self.cfg, self.cfg["n_routed_experts"]
        scores = (x.float() @ self.gate.weight.float().T).sigmoid()  # [m, n], float32
        biased = scores + self.gate.e_score_correction_bias
        groups, keep = cfg["n_group"], cfg["topk_group"]
        group_score = biased.view(len(x), groups, -1).topk(2, dim=-1).values.sum(-1)  # [m, G]: its two best
        dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(
            1, group_score.topk(keep, dim=-1).indices, False)
        biased = biased.masked_fill(dropped.repeat_interleave(n // groups, dim=1), self.MASKED)
        index = biased.topk(cfg["num_experts_per_tok"], dim=-1).indices  # [m, k]
        weights = scores.gather(1, index)  # the raw scores weigh the chosen experts
        if cfg["norm_topk_prob"]:  # DeepSeek-V3 renormalizes a single weight too
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return index, weights * cfg["routed_scaling_factor"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weights = self.route(x)
        f = self.cfg["moe_intermediate_size"]
        y = torch.zeros_like(x)
        for e in range(self.cfg["n_routed_experts"]):
            token, slot = torch.nonzero(index == e, as_tuple=True)
            if len(token):
                gate, up = (x[token] @ self.experts.gate_up_proj[e].T).split(f, dim=-1)
                out = (nn.functional.silu(gate) * up) @ self.experts.down_proj[e].T
                y.index_add_(0, token, out * weights[token, slot, None].to(x.dtype))
        s = self.shared_experts
        return y + s["down_proj"](nn.functional.silu(s["gate_proj"](x)) * s["up_proj"](x))


# %%
class FixedDeepseekV3Block(MyDeepseekV3Block):
    """The same port with the one line fixed: dropped groups are masked with minus infinity."""

    MASKED = float("-inf")


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


def check_port(block_class: type) -> CheckFailure | CheckResult | None:
    """Run the check on a port: the report it raises, or the result when it passes (None without PyTorch)."""
    if torch is None:
        print("PyTorch is not installed: this example's port is a PyTorch module (pip install torch).")
        return None
    torch.manual_seed(0)
    try:
        return check_hf_moe_block(builder(block_class), model_type="deepseek_v3")
    except CheckFailure as failure:
        return failure


# %%
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="accepted for uniformity; this example draws no figure")
    parser.parse_args(argv)

    # Step 1: check the port, as DeepSeek-V3
    report = check_port(MyDeepseekV3Block)
    print(report)
    print()

    # What to see: the failing case has n = 4 experts in two groups of two, keeps one group and asks for
    # k = 1. Shifted by -40, every s + b of the kept group is far below 0, and an expert of the dropped group,
    # masked at 0, beats them: y moves from [-1.48796, 1.61662] to [-0.864, 0.33607], where a correct block
    # would give the same y twice. The plain comparison with the reference block held on its 50 drawn cases:
    # no drawn bias made a kept s + b negative there, which is why the kit also shifts every bias.

    # Step 2: the names the report gives, invariant by invariant
    named = ({v.invariant.name: v.conventions for v in report.violations}
             if isinstance(report, CheckFailure) else None)
    print("the report names:", named)
    print()

    # What to see: the failed invariant names the known mistake, groups_masked_with_zero: replayed on the
    # failing case, and on 6 more cases of the same configuration, it reproduces the port's output.

    # Step 3: fix the one line and check again
    result = check_port(FixedDeepseekV3Block)
    print(result)

    # What to see: with the dropped groups masked at minus infinity, all 4 invariants hold: no expert of a
    # dropped group can win, whatever the sign of s + b.

    return {"named": named, "fixed": getattr(result, "passed", None)}


# %%
if __name__ == "__main__":
    main()
