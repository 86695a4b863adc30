r"""Eq. (11), checked: a user's forward pass against the reference on tokens whose routing is unambiguous."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import settings as Settings
from hypothesis import strategies as st

from .._lib.validation import check_float_dtype, check_int
from .._lib.xp import dtype_name
from ..config import MoEConfig
from ..layer.activations import sigmoid
from ..layer.latent_moe import routed_experts, stable_latent_moe
from . import strategies as rst
from .outputs import error_line, float_output, fmt, token_lines, within
from .profiles import kit_settings
from .report import (
    CheckResult,
    Code,
    Invariant,
    Violation,
    call_user,
    run_check,
)
from .router_check import dtype_tolerances

__all__ = ["ConfigRepr", "check_forward", "dtype_expr", "reference_forward"]


# ---------------------------------------------------------------------------
# Eq. (11): the forward pass
# ---------------------------------------------------------------------------

def reference_forward(case: rst.ForwardCase, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference on the inputs the user receives, and a mask of tokens fit to compare.

    A token is left out when its routing is ambiguous at the user's precision
    (its $k$-th and $(k+1)$-th biased scores are closer than 1e-4) or when
    its latent sum cancels so strongly that the RMSNorm magnifies rounding
    (the terms are over 100 times larger than their sum).
    """
    config = case.config
    x64 = case.x.astype(dtype).astype(np.float64)
    params64 = {name: value.astype(np.float64) for name, value in case.params(dtype).items()}
    out = stable_latent_moe(x64, params64, config, return_intermediates=True)
    keep = np.ones(x64.shape[0], dtype=bool)
    if config.top_k < config.num_experts:
        s = sigmoid(x64 @ params64["gate.weight"].T)  # [m, n]
        sb = np.sort(s + params64["gate.e_score_correction_bias"], axis=1)[:, ::-1]
        keep &= (sb[:, config.top_k - 1] - sb[:, config.top_k]) > 1e-4
    if config.use_latent_norm:
        terms = np.zeros_like(out.u)
        for r in range(config.top_k):  # |p_r E_r(z)| of each slot, summed: the size before cancellation
            terms += np.abs(routed_experts(out.z, out.index[:, r:r + 1], out.weights[:, r:r + 1],
                                           params64["experts.w1"], params64["experts.w3"],
                                           params64["experts.w2"], config))
        size = np.sqrt(np.mean(terms**2, axis=1))
        rms = np.sqrt(np.mean(out.u**2, axis=1) + config.rms_norm_eps)
        keep &= size <= 100.0 * rms
    return np.asarray(out.y), keep


def check_forward(fn: Callable[[np.ndarray, dict[str, np.ndarray], MoEConfig], Any], *,
                  rtol: float | None = None, atol: float | None = None, dtype: Any = np.float32,
                  configs: st.SearchStrategy[MoEConfig] | MoEConfig | None = None, max_tokens: int = 6,
                  settings: str | Settings | None = None) -> CheckResult:
    r"""Check a layer `fn(x, params, config) -> y` against `stable_latent_moe` (Eq. 11).

    `x` `[m, d]` and every parameter (a `dict` with the HF names of
    `parameter_shapes`) arrive as NumPy arrays of `dtype`; `y` `[m, d]` must
    come back. The reference is computed in float64 from the very same
    (rounded) inputs, so `rtol`/`atol` measure only the error of the user's
    arithmetic: about 1e-4 suits float32, a few 1e-2 bfloat16. By default (`None`) they are 1e-4 and 1e-5,
    and $2^{-29}$ times those for float64 (`router_check.dtype_tolerances`): a layer that computes in float32
    fails a float64 check. A half dtype has no default of its own: pass the tolerance it needs.

    `configs` is a strategy of `MoEConfig` (default: small layers with K3's
    switches, see `strategies.configs`) or one fixed config.

    Invariants: **output shape and dtype** (`[m, d]`, finite), and **matches
    stable_latent_moe** on every token whose routing is unambiguous at that
    precision (see `reference_forward`).
    """
    if not callable(fn):
        raise TypeError(f"fn must be the layer, a function, got {type(fn).__name__} {fn!r:.60}")
    dtype = check_float_dtype(dtype, "dtype")
    rtol, atol = dtype_tolerances(dtype, rtol, atol, 1e-4, 1e-5)
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    resolved = kit_settings(settings)  # a bad profile name is an error before anything runs
    if configs is None:
        configs = rst.configs()
    elif not isinstance(configs, MoEConfig | st.SearchStrategy):
        raise TypeError(f"configs must be a MoEConfig or a strategy of them, got {type(configs).__name__} "
                        f"{configs!r:.60}")
    cases = rst.forward_cases(config=configs, max_tokens=max_tokens)

    def run(case: rst.ForwardCase) -> np.ndarray:
        out = call_user(fn, case.x.astype(dtype), case.params(dtype), case.config)
        return float_output("y", out, case.x.shape, "[m, d]")

    def inputs(case: rst.ForwardCase) -> dict[str, Any]:
        return {"config": ConfigRepr(case.config), "x": case.x.astype(dtype),
                "params": Code(f"refimpl.testing.strategies.ForwardCase(config, x, param_seed={case.param_seed}, "
                               f"bias_scale={case.bias_scale}).params({dtype_expr(dtype)})")}

    def output_form(case: rst.ForwardCase) -> None:
        run(case)

    def matches(case: rst.ForwardCase) -> None:
        y = run(case)
        expected, keep = reference_forward(case, dtype)
        bad = np.flatnonzero(keep & ~np.all(within(y, expected, rtol, atol), axis=1))
        if bad.size:
            details = token_lines(bad, lambda i: (
                f"token {i}: expected y {fmt(expected[i], 5)}, got {fmt(y[i], 5)}"))
            details.append(error_line(y[keep], expected[keep], rtol, atol))
            if (~keep).any():
                details.append(f"{int((~keep).sum())} tokens with ambiguous routing or a cancelling "
                               "latent sum were not compared")
            raise Violation(f"{bad.size} of {case.x.shape[0]} tokens differ from stable_latent_moe",
                            details, inputs(case))

    invariants = [
        Invariant("output shape and dtype", "y has the shape [m, d] of x and is finite", cases,
                  output_form, basic=True, describe=inputs),
        Invariant("matches stable_latent_moe",
                  "Eq. (11): y = shared(x) + W_up RMSNorm(sum_e p_e E_e(W_down x)), reduced before the norm",
                  cases, matches, describe=inputs),
    ]
    return run_check("check_forward", invariants, resolved)


class ConfigRepr:
    """Prints a `MoEConfig` by the fields that differ from K3's, so a report stays short."""

    def __init__(self, config: MoEConfig):
        self.config = config

    def __repr__(self) -> str:
        k3 = MoEConfig.k3()
        changed = [f"{name}={getattr(self.config, name)!r}" for name in self.config.__dataclass_fields__
                   if getattr(self.config, name) != getattr(k3, name)]
        return f"MoEConfig({', '.join(changed)})"


def dtype_expr(dtype: Any) -> str:
    name = dtype_name(np.dtype(dtype))
    return "ml_dtypes.bfloat16" if name == "bfloat16" else f"np.{name}"
