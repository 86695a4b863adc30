"""Tests of the accounting: K3's parameter counts, payload and combinatorial sparsity.

Each K3 number is checked twice: against the literal value the technical
report states, and against the formula evaluated here from the sizes.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refimpl.config import MoEConfig
from refimpl.layer.accounting import (
    combinatorial_sparsity,
    dispatch_payload,
    log10_binomial,
    parameter_counts,
)
from refimpl.layer.latent_moe import parameter_shapes

D, ELL, N, K, F, NS, LAYERS = 7168, 3584, 896, 16, 3072, 2, 92


def test_k3_parameter_counts_literal_values():
    c = parameter_counts(MoEConfig.k3())
    assert c["routed_expert"] == 33_030_144
    assert c["routed"] == 29_595_009_024
    assert c["routed_all_layers"] == 2_722_740_830_208
    assert c["activated_routed"] == 528_482_304
    assert c["shared"] == 132_120_576
    assert c["projections"] == 51_380_224
    assert c["activated"] == 711_983_104
    assert c["router_weight"] == 6_422_528


def test_k3_parameter_counts_from_the_formulas():
    c = parameter_counts(MoEConfig.k3())
    assert c["routed_expert"] == 3 * ELL * F
    assert c["routed"] == N * 3 * ELL * F
    assert c["routed_all_layers"] == LAYERS * N * 3 * ELL * F
    assert c["activated_routed"] == K * 3 * ELL * F
    assert c["shared"] == 3 * D * NS * F
    assert c["projections"] == 2 * D * ELL
    assert c["activated"] == K * 3 * ELL * F + 3 * D * NS * F + 2 * D * ELL
    assert c["activated_with_router"] == c["activated"] + N * D
    assert c["router"] == N * D + N
    assert c["norm"] == ELL
    assert c["activated_all_layers"] == LAYERS * c["activated"]


def test_k3_shares_of_the_whole_model():
    c = parameter_counts(MoEConfig.k3())
    # About 2.72T of K3's 2.78T (98%), and about 65.5B of its 104.2B activated.
    assert round(c["routed_all_layers"] / 1e12, 2) == 2.72
    assert round(c["routed_all_layers"] / 2.78e12, 2) == 0.98
    assert round(c["activated_all_layers"] / 1e9, 1) == 65.5
    assert c["activated_all_layers"] < 104.2e9


def test_total_equals_the_sum_of_the_parameter_shapes():
    for config in (MoEConfig.k3(), MoEConfig.tiny(), MoEConfig.small(),
                   MoEConfig.tiny(use_latent_norm=False, latent_size=8, use_latent_projection=False),
                   MoEConfig.tiny(num_shared_experts=0)):
        total = sum(math.prod(shape) for shape in parameter_shapes(config).values())
        assert parameter_counts(config)["total"] == total


def test_k3_dispatch_payload():
    p = dispatch_payload(MoEConfig.k3())
    assert p["latent_values"] == K * ELL == 57_344
    assert p["full_width_values"] == K * D == 114_688
    assert p["ratio"] == 0.5
    assert p["latent_bytes"] == 2 * 57_344 and p["full_width_bytes"] == 2 * 114_688
    assert dispatch_payload(MoEConfig.k3(), bytes_per_value=1)["latent_bytes"] == 57_344
    # The LatentMoE bargain: twice the experts, twice the k, half the width, the same traffic
    # as the full-width layer with 448 experts and top-8.
    base = MoEConfig(hidden_size=D, latent_size=D, num_experts=N // 2, top_k=K // 2, use_latent_projection=False)
    assert dispatch_payload(base)["latent_values"] == p["latent_values"]


def exact_log10_binomial(n: int, k: int) -> float:
    """log10 C(n, k) through an exact product of fractions."""
    value = Fraction(1)
    for i in range(k):
        value *= Fraction(n - i, i + 1)
    assert value.denominator == 1
    return math.log10(value.numerator)


def test_k3_combinatorial_sparsity():
    s = combinatorial_sparsity(MoEConfig.k3())
    assert s["alpha"] == 2.0
    assert s["log10_latent"] == pytest.approx(exact_log10_binomial(896, 16), rel=1e-15)
    assert s["log10_base_power_alpha"] == pytest.approx(2 * exact_log10_binomial(448, 8), rel=1e-15)
    assert round(s["log10_latent"], 2) == 33.86
    assert round(s["log10_base_power_alpha"], 2) == 33.15
    assert s["log10_ratio"] == pytest.approx(s["log10_latent"] - s["log10_base_power_alpha"])


@given(N=st.integers(1, 60), k=st.integers(0, 60), alpha=st.integers(1, 4))
def test_combinatorial_inequality(N, k, alpha):
    # C(alpha N, alpha k) >= C(N, k)^alpha, in exact integers.
    k = min(k, N)
    assert math.comb(alpha * N, alpha * k) >= math.comb(N, k) ** alpha
    assert log10_binomial(N, k) == pytest.approx(exact_log10_binomial(N, k), rel=1e-14, abs=1e-15)


@given(n_over=st.integers(1, 40), k_over=st.integers(1, 8), alpha=st.integers(1, 4))
def test_combinatorial_sparsity_of_drawn_configs(n_over, k_over, alpha):
    k_over = min(k_over, n_over)
    config = MoEConfig(hidden_size=4 * alpha, latent_size=4, num_experts=alpha * n_over, top_k=alpha * k_over)
    s = combinatorial_sparsity(config)
    assert s["log10_latent"] >= s["log10_base_power_alpha"] - 1e-12


def test_accounting_of_small_presets():
    c = parameter_counts(MoEConfig.tiny())
    assert c["routed_expert"] == 3 * 4 * 6 and c["routed"] == 6 * 72
    assert c["activated"] == 2 * 72 + 3 * 8 * 6 + 2 * 8 * 4
    plain = parameter_counts(MoEConfig.tiny(latent_size=8, use_latent_projection=False, use_latent_norm=False))
    assert plain["projections"] == 0 and plain["norm"] == 0
    assert np.isclose(dispatch_payload(MoEConfig.tiny())["ratio"], 0.5)


def test_bad_input():
    with pytest.raises(TypeError, match=r"config must be a MoEConfig, got dict"):
        parameter_counts({"top_k": 2})
    with pytest.raises(TypeError, match=r"config must be a MoEConfig, got NoneType"):
        dispatch_payload(None)
    with pytest.raises(ValueError, match=r"bytes_per_value must be a positive number, got 0"):
        dispatch_payload(MoEConfig.k3(), bytes_per_value=0)
    with pytest.raises(ValueError, match=r"bytes_per_value must be a positive number, got True"):
        dispatch_payload(MoEConfig.k3(), bytes_per_value=True)
    with pytest.raises(ValueError, match=r"need integers 0 <= k <= n, got n=3, k=4"):
        log10_binomial(3, 4)
    with pytest.raises(ValueError, match=r"need integers 0 <= k <= n, got n=True, k=0"):
        log10_binomial(True, 0)
    with pytest.raises(ValueError, match=r"needs an integer alpha dividing n and k, got alpha=1.6, n=6, k=2"):
        combinatorial_sparsity(MoEConfig.tiny(latent_size=5))
    with pytest.raises(ValueError, match=r"needs an integer alpha dividing n and k, got alpha=2.0, n=6, k=3"):
        combinatorial_sparsity(MoEConfig.tiny(top_k=3))
