"""The "compare the variants" example: each claim it prints, checked against an independent computation."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import load_script
from scipy.special import expit

from refimpl.layer.latent_moe import stable_latent_moe

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "40_compare_variants.py"


@pytest.fixture(scope="module")
def example():
    """The example script, imported as a module."""
    return load_script(EXAMPLE, "example_40_compare_variants")


@pytest.fixture(scope="module")
def run(example, tmp_path_factory):
    """One quick run with figures: (results, printed text, figure folder)."""
    out = tmp_path_factory.mktemp("variants")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = example.main(["--quick", "--out", str(out)])
    return results, printed.getvalue(), out


@pytest.fixture(scope="module")
def layers(example):
    """Small versions of the three layers, sharing router and tokens, with graded expert gains."""
    configs = example.variants(16, 8, 8, 2, 12)
    gains = np.geomspace(0.25, 4.0, 8)
    params = example.shared_router_params(configs, gains, seed=3)
    x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    return configs, params, x


def test_the_variants_differ_only_in_the_two_switches(layers):
    """Plain MoE has no projection and no norm, LatentMoE a projection only, Stable LatentMoE both."""
    configs, _, _ = layers
    switches = {name: (c.use_latent_projection, c.use_latent_norm, c.ell == c.d) for name, c in configs.items()}
    assert switches == {"plain MoE": (False, False, True), "LatentMoE": (True, False, False),
                        "Stable LatentMoE": (True, True, False)}
    sizes = {(c.d, c.n, c.k, c.f, c.num_shared_experts) for c in configs.values()}
    assert len(sizes) == 1


def test_every_variant_chooses_the_same_experts(layers):
    """One router on the full-width token: the selection and its weights agree across the variants."""
    configs, params, x = layers
    outs = [stable_latent_moe(x, params[name], config, return_intermediates=True)
            for name, config in configs.items()]
    for out in outs[1:]:
        np.testing.assert_array_equal(out.index, outs[0].index)
        np.testing.assert_array_equal(out.weights, outs[0].weights)


def test_the_norm_makes_every_routed_sum_unit_rms(layers):
    """Computed by hand from the intermediates: RMS(v) = 1 per token under the norm (gain one), not without."""
    configs, params, x = layers
    out = stable_latent_moe(x, params["Stable LatentMoE"], configs["Stable LatentMoE"], return_intermediates=True)
    u = np.asarray(out.u, dtype=np.float64)
    v = np.asarray(out.v, dtype=np.float64)
    eps = configs["Stable LatentMoE"].rms_norm_eps
    expected = np.sqrt(np.mean(u**2, axis=1) / (np.mean(u**2, axis=1) + eps))  # RMS of u / sqrt(ms(u) + eps)
    np.testing.assert_allclose(np.sqrt(np.mean(v**2, axis=1)), expected, rtol=1e-5)
    latent = stable_latent_moe(x, params["LatentMoE"], configs["LatentMoE"], return_intermediates=True)
    np.testing.assert_array_equal(latent.v, latent.u)


def test_stable_output_scale_does_not_follow_the_selection(run):
    """Moving tokens to louder experts scales the unnormalized outputs several times, the normed one not at all."""
    results, _, _ = run
    rows = results["output_scale"]
    gains = [r["mean gain"] for r in rows]
    assert gains == sorted(gains) and gains[-1] > 4 * gains[0]
    for name, low, high in (("plain MoE", 3.0, None), ("LatentMoE", 3.0, None), ("Stable LatentMoE", None, 1.02)):
        values = [r[name] for r in rows]
        ratio = max(values) / min(values)
        if low is not None:
            assert ratio > low, (name, ratio)
        if high is not None:
            assert ratio < high, (name, ratio)


def test_the_scaling_factor_scales_only_the_unnormalized_variants(run):
    """Without the norm y_routed is linear in the mixture weights; with it a constant factor cancels (up to eps)."""
    results, _, _ = run
    rows = {r["factor"]: r for r in results["scaling_factor"]}
    for name in ("plain MoE", "LatentMoE"):
        assert rows[2.5][name] / rows[1.0][name] == pytest.approx(2.5, rel=1e-5)
        assert rows[0.5][name] / rows[1.0][name] == pytest.approx(0.5, rel=1e-5)
    stable = [r["Stable LatentMoE"] for r in rows.values()]
    # RMSNorm divides by sqrt(ms(u) + eps), so a small u feels eps: invariance holds to about eps / ms(u).
    assert max(stable) - min(stable) < 2e-3 * stable[0]


def test_activation_magnitudes_on_hand_made_inputs(example):
    """a = b = 300: SwiGLU gives 300 sigma(300) 300 = 90,000, past float16's 65,504; SiTU-GLU stays at 100."""
    gate = np.array([300.0, 1.0])
    up = np.array([300.0, 1.0])
    f16 = example.activation_magnitudes(gate, up, np.float16)
    assert f16["SwiGLU"]["overflow"] == 0.5
    assert f16["SwiGLU"]["max"] == pytest.approx(1.0 / (1.0 + np.exp(-1.0)), rel=1e-3)
    assert f16["SiTU-GLU"]["overflow"] == 0.0
    assert f16["SiTU-GLU"]["max"] <= 100.0
    bf16 = example.activation_magnitudes(gate, up, ml_dtypes.bfloat16)
    assert bf16["SwiGLU"]["overflow"] == 0.0
    assert bf16["SwiGLU"]["max"] == pytest.approx(90_000.0, rel=1e-2)  # bfloat16 keeps 8 significant bits
    assert bf16["SwiGLU"]["above 100"] == 0.5


def test_float16_overflow_matches_the_exact_product(example):
    """The overflow share equals the share of |a sigma(a) b| (float64) past float16's rounding threshold."""
    rng = np.random.default_rng(5)
    gate = 300.0 * rng.standard_normal(20_000)
    up = 300.0 * rng.standard_normal(20_000)
    a = gate.astype(np.float16).astype(np.float64)
    b = up.astype(np.float16).astype(np.float64)
    exact = a * expit(a) * b
    threshold = 65_520.0  # values from here on round to infinity in float16
    boundary = np.abs(np.abs(exact) - threshold) < 64.0  # too close to call in float32 arithmetic
    expected = np.mean(np.abs(exact) >= threshold)
    measured = example.activation_magnitudes(gate, up, np.float16)["SwiGLU"]["overflow"]
    assert abs(measured - expected) <= boundary.mean() + 1e-12
    assert expected > 0.05


def test_half_precision_sweep_claims(run):
    """SiTU-GLU never overflows nor exceeds 100; SwiGLU overflows in float16 at large inputs, not in bfloat16."""
    results, _, _ = run
    rows = results["half_precision"]
    for row in rows:
        for dtype in ("float16", "bfloat16"):
            assert row[dtype]["SiTU-GLU"]["overflow"] == 0.0
            assert row[dtype]["SiTU-GLU"]["max"] <= 100.0
            assert row[dtype]["SwiGLU"]["overflow"] == 0.0 or dtype == "float16"
    assert rows[0]["float16"]["SwiGLU"]["overflow"] == 0.0
    assert rows[-1]["float16"]["SwiGLU"]["overflow"] > 0.1
    assert rows[-1]["bfloat16"]["SwiGLU"]["max"] > 65_504.0


def test_payload_per_token(run):
    """k values of width l (or d) per token per pass: 2 bytes each in bfloat16, 1 in fp8."""
    results, _, _ = run
    rows = {r["variant"]: r for r in results["payload"]}
    assert rows["plain MoE, K3's n and k"]["values"] == 16 * 7168
    assert rows["plain MoE, n/2 and k/2"]["values"] == 8 * 7168
    assert rows["LatentMoE"]["values"] == 16 * 3584
    assert rows["Stable LatentMoE (K3)"]["values"] == 16 * 3584
    for row in rows.values():
        assert row["bf16 bytes"] == 2 * row["values"]
        assert row["fp8 bytes"] == row["values"]
    assert rows["LatentMoE"]["bf16 bytes"] == rows["plain MoE, n/2 and k/2"]["bf16 bytes"]
    assert rows["plain MoE, K3's n and k"]["bf16 bytes"] == 2 * rows["Stable LatentMoE (K3)"]["bf16 bytes"]


def test_the_printout_and_the_figures(run):
    """The script prints its three parts and, with --out, saves its two figures as PNG files."""
    _, printed, out = run
    for heading in ("1. Routed output scale", "2. Expert activations stored in 16 bits", "3. Payload per token"):
        assert heading in printed
    assert "(bound 100)" in printed
    for name in ("output_scale.png", "half_precision.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_without_out_nothing_is_saved(example, tmp_path, monkeypatch):
    """The script writes files only when asked to."""
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        example.main(["--quick"])
    assert list(tmp_path.iterdir()) == []
