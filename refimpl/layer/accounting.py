r"""Accounting: parameters, activated parameters, payload and combinatorial sparsity.

The numbers that make the case for the layer, computed from a `MoEConfig`
rather than typed in. For K3 ($d = 7168$, $\ell = 3584$, $n = 896$, $k = 16$,
$f = 3072$, $N_s = 2$, 92 MoE layers):

* One routed expert is a three-matrix GLU on the latent: $3\ell f = 33{,}030{,}144$
  parameters. A layer holds $n$ of them, $29{,}595{,}009{,}024$, and 92 layers hold
  $2{,}722{,}740{,}830{,}208$: about 2.72T of K3's 2.78T, 98% of the model.
* A token activates, per layer, $k$ routed experts ($528{,}482{,}304$), the merged
  shared experts $3 d N_s f$ ($132{,}120{,}576$) and the two latent projections
  $2 d\ell$ ($51{,}380{,}224$): $711{,}983{,}104$ in all, plus the router's $n d$
  ($6{,}422{,}528$).
* Dispatch and combine carry $k\ell$ values per token each way, against $kd$ for a
  full-width MoE with the same $k$: the latent halves the all-to-all traffic at
  $\alpha = 2$.
* Scaling $n$ and $k$ together by $\alpha$ multiplies the number of expert
  combinations super-exponentially:
  $$\binom{\alpha N}{\alpha k} \ge \binom{N}{k}^{\alpha}.$$
  For K3, $\log_{10}\binom{896}{16} \approx 33.86$ against
  $2\log_{10}\binom{448}{8} \approx 33.15$.
"""

from __future__ import annotations

import math

from ..config import MoEConfig

__all__ = ["combinatorial_sparsity", "dispatch_payload", "log10_binomial", "parameter_counts"]


def _check_config(config: MoEConfig) -> None:
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")


def parameter_counts(config: MoEConfig) -> dict[str, int]:
    """Parameter counts of one layer and of the model's MoE layers, as exact integers.

    Keys (all per layer unless the name says otherwise): `routed_expert`
    (one expert), `routed` (all $n$), `shared`, `projections` (down and up),
    `norm`, `router` (weight and bias), `total`, `activated` (what one token
    uses: $k$ experts, the shared experts and the projections, router
    excluded), `activated_with_router`, and `routed_all_layers`,
    `activated_all_layers` over `config.num_moe_layers` layers.
    """
    _check_config(config)
    d, ell, n, k, f = config.hidden_size, config.latent_size, config.num_experts, config.top_k, config.intermediate_size
    # One routed expert: gate and up $[f, \ell]$, down $[\ell, f]$.
    routed_expert = 3 * ell * f
    routed = n * routed_expert
    # The merged shared GLU of width $N_s f$ on the full width $d$.
    shared = 3 * d * config.shared_size
    projections = 2 * d * ell if config.use_latent_projection else 0
    norm = ell if config.use_latent_norm else 0
    router_weight = n * d
    activated = k * routed_expert + shared + projections
    return {
        "routed_expert": routed_expert,
        "routed": routed,
        "shared": shared,
        "projections": projections,
        "norm": norm,
        "router_weight": router_weight,
        "router": router_weight + n,
        "total": routed + shared + projections + norm + router_weight + n,
        "activated_routed": k * routed_expert,
        "activated": activated,
        "activated_with_router": activated + router_weight,
        "routed_all_layers": config.num_moe_layers * routed,
        "activated_all_layers": config.num_moe_layers * activated,
    }


def dispatch_payload(config: MoEConfig, bytes_per_value: float = 2.0) -> dict[str, float]:
    r"""Values (and bytes) each token sends per all-to-all pass: $k\ell$ here, $kd$ full width.

    Returns `latent_values`, `full_width_values`, their ratio $\ell/d = 1/\alpha$,
    and the same in bytes at `bytes_per_value` (2 for bf16).
    """
    _check_config(config)
    is_number = isinstance(bytes_per_value, int | float) and not isinstance(bytes_per_value, bool)
    if not (is_number and math.isfinite(bytes_per_value) and bytes_per_value > 0):
        raise ValueError(f"bytes_per_value must be a positive number, got {bytes_per_value!r}")
    latent = config.top_k * config.latent_size
    full = config.top_k * config.hidden_size
    return {
        "latent_values": latent,
        "full_width_values": full,
        "ratio": latent / full,
        "latent_bytes": latent * bytes_per_value,
        "full_width_bytes": full * bytes_per_value,
    }


def log10_binomial(n: int, k: int) -> float:
    r"""$\log_{10}\binom{n}{k}$, exact to double precision through `math.comb`."""
    integers = all(isinstance(v, int) and not isinstance(v, bool) for v in (n, k))
    if not (integers and 0 <= k <= n):
        raise ValueError(f"need integers 0 <= k <= n, got n={n!r}, k={k!r}")
    return math.log10(math.comb(n, k))


def combinatorial_sparsity(config: MoEConfig) -> dict[str, float]:
    r"""Compare $\log_{10}\binom{n}{k}$ with $\alpha \log_{10}\binom{n/\alpha}{k/\alpha}$.

    The second is the combinatorial richness of the layer that LatentMoE
    started from (width $d$, $n/\alpha$ experts, top-$k/\alpha$), raised to the
    power $\alpha$; the inequality $\binom{\alpha N}{\alpha k} \ge \binom{N}{k}^\alpha$
    says the first is at least as large. Needs $\alpha$ to be an integer that
    divides $n$ and $k$.
    """
    _check_config(config)
    alpha = config.alpha
    a = round(alpha)
    if abs(alpha - a) > 1e-12 or config.num_experts % a or config.top_k % a:
        raise ValueError(
            f"combinatorial_sparsity needs an integer alpha dividing n and k, got alpha={alpha}, "
            f"n={config.num_experts}, k={config.top_k}")
    latent = log10_binomial(config.num_experts, config.top_k)
    base = a * log10_binomial(config.num_experts // a, config.top_k // a)
    return {"alpha": float(a), "log10_latent": latent, "log10_base_power_alpha": base,
            "log10_ratio": latent - base}
