"""Tests of Eq. (11): the Stable LatentMoE forward pass.

Three computations of the same layer are compared:

* `stable_latent_moe`, the grouped fast path (sort slots by expert, one
  product per expert);
* `stable_latent_moe_reference`, the per-token path of the package;
* `dense_forward` below, written for this file only: every expert runs on
  every token with `einsum`, the top-k is a mask built by counting, for each
  expert, how many others beat it (no sorting), and the combine is a masked
  weighted sum.

They must agree to a relative 1e-12 in float64, on configurations drawn by
Hypothesis.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl._lib.xp import to_numpy
from refimpl.config import MoEConfig
from refimpl.layer.latent_moe import (
    MoEOutput,
    MoEParams,
    check_params,
    init_params,
    parameter_shapes,
    stable_latent_moe,
    stable_latent_moe_reference,
)

with_xp = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

RTOL = 1e-12


# ---------------------------------------------------------------------------
# The independent dense computation
# ---------------------------------------------------------------------------

def rank_with_ties_to_lower_id(values: np.ndarray) -> np.ndarray:
    """rank[..., j] = how many entries of the last axis come before j (larger, or equal with a lower id)."""
    n = values.shape[-1]
    ids = np.arange(n)
    larger = values[..., None, :] > values[..., :, None]  # [..., j, r]: r beats j
    equal_lower = (values[..., None, :] == values[..., :, None]) & (ids[None, :] < ids[:, None])
    return np.sum(larger | equal_lower, axis=-1)


def dense_forward(x, params, config: MoEConfig, *, return_u: bool = False, return_parts: bool = False):
    """Eq. (11) with every expert on every token, in float64, without any sort."""
    x = to_numpy(x).astype(np.float64)
    p = {name: to_numpy(a).astype(np.float64) for name, a in params.items()}
    b1, b2 = config.situ_beta, config.situ_linear_beta

    def sigmoid(t):
        return np.exp(np.minimum(t, 0.0)) / (1.0 + np.exp(-np.abs(t)))

    def act(a, b):
        if config.activation == "situ":
            return b1 * np.tanh(a / b1) * sigmoid(a) * (b2 * np.tanh(b / b2))
        return a * sigmoid(a) * b

    m, n = x.shape[0], config.n
    s = sigmoid(np.einsum("md,nd->mn", x, p["gate.weight"]))  # [m, n]
    biased = s + p["gate.e_score_correction_bias"]  # [m, n]
    if config.n_group > 1:
        size = n // config.n_group
        grouped = biased.reshape(m, config.n_group, size)
        group_score = np.sum(np.where(rank_with_ties_to_lower_id(grouped) < 2, grouped, 0.0), axis=-1)
        keep = rank_with_ties_to_lower_id(group_score) < config.topk_group  # [m, G]
        biased = np.where(np.repeat(keep, size, axis=1), biased, -np.inf)
    chosen = rank_with_ties_to_lower_id(biased) < config.k  # [m, n] mask
    weight = np.where(chosen, s, 0.0)
    if config.renormalize:
        weight = weight / np.sum(weight, axis=1, keepdims=True)
    weight = weight * config.routed_scaling_factor
    z = np.einsum("md,ld->ml", x, p["routed_expert_down_proj.weight"]) if config.use_latent_projection else x
    hidden = act(np.einsum("ml,efl->mef", z, p["experts.w1"]), np.einsum("ml,efl->mef", z, p["experts.w3"]))
    every = np.einsum("mef,elf->mel", hidden, p["experts.w2"])  # [m, n, l]: every expert on every token
    u = np.einsum("me,mel->ml", weight, every)
    v = u
    if config.use_latent_norm:
        v = u / np.sqrt(np.mean(u * u, axis=1, keepdims=True) + config.rms_norm_eps) \
            * p["routed_expert_norm.weight"]
    y_routed = np.einsum("ml,dl->md", v, p["routed_expert_up_proj.weight"]) if config.use_latent_projection else v
    y_shared = np.zeros_like(x)
    if config.shared_size:
        h = act(x @ p["shared_experts.gate_proj.weight"].T, x @ p["shared_experts.up_proj.weight"].T)
        y_shared = h @ p["shared_experts.down_proj.weight"].T
    y = y_shared + y_routed
    if return_parts:
        return {"y": y, "u": u, "v": v, "z": z, "y_routed": y_routed, "y_shared": y_shared}
    return (y, u, chosen) if return_u else y


def assert_close(actual, expected, rtol=RTOL):
    actual, expected = to_numpy(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


# ---------------------------------------------------------------------------
# Drawn configurations
# ---------------------------------------------------------------------------

@st.composite
def layers(draw, groups: bool | None = None):
    """A small config (alpha 1 or 2, norm and projection on or off, groups on or off) and its inputs."""
    alpha = draw(st.sampled_from([1, 2]))
    ell = draw(st.integers(1, 5))
    projection = True if alpha == 2 else draw(st.booleans())
    use_groups = draw(st.booleans()) if groups is None else groups
    n_group = draw(st.sampled_from([2, 3])) if use_groups else 1
    n = n_group * draw(st.integers(1, 3)) if use_groups else draw(st.integers(1, 7))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, topk_group * (n // n_group)))
    config = MoEConfig(
        hidden_size=alpha * ell, latent_size=ell, num_experts=n, top_k=k,
        intermediate_size=draw(st.integers(1, 5)), num_shared_experts=draw(st.integers(0, 2)),
        use_latent_norm=draw(st.booleans()), use_latent_projection=projection,
        activation=draw(st.sampled_from(["situ", "swiglu"])), renormalize=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])), n_group=n_group, topk_group=topk_group,
        num_moe_layers=1)
    seed = draw(st.integers(0, 2**32 - 1))
    m = draw(st.integers(0, 5))
    rng = np.random.default_rng(seed)
    # Inputs large enough to reach the SiTU caps now and then.
    x = rng.standard_normal((m, config.d)) * draw(st.sampled_from([1.0, 4.0]))
    params = init_params(config, rng, dtype=np.float64, bias_scale=draw(st.sampled_from([0.0, 0.05, 1.0])))
    return config, x, params


def to_xp(xp, x, params):
    return xp.asarray(x), {name: xp.asarray(a) for name, a in params.items()}


# ---------------------------------------------------------------------------
# The forward pass against the reference and the dense computation
# ---------------------------------------------------------------------------

@with_xp
@given(layer=layers())
def test_forward_equals_reference_and_dense(xp, layer):
    config, x, params = layer
    xs, ps = to_xp(xp, x, params)
    y = stable_latent_moe(xs, ps, config)
    assert y.dtype == xp.float64 and tuple(y.shape) == x.shape
    expected = dense_forward(x, params, config)
    assert_close(y, expected)
    assert_close(stable_latent_moe_reference(xs, ps, config), expected)


@with_xp
@given(layer=layers(groups=True))
def test_forward_with_group_limited_routing(xp, layer):
    config, x, params = layer
    xs, ps = to_xp(xp, x, params)
    assert_close(stable_latent_moe(xs, ps, config), dense_forward(x, params, config))


@with_xp
@given(layer=layers())
def test_intermediates(xp, layer):
    config, x, params = layer
    xs, ps = to_xp(xp, x, params)
    out = stable_latent_moe(xs, ps, config, return_intermediates=True)
    assert isinstance(out, MoEOutput)
    m = x.shape[0]
    shapes = dict(y=(m, config.d), scores=(m, config.n), index=(m, config.k), weights=(m, config.k),
                  z=(m, config.ell), u=(m, config.ell), v=(m, config.ell), y_routed=(m, config.d),
                  y_shared=(m, config.d))
    for name, shape in shapes.items():
        assert tuple(getattr(out, name).shape) == shape, name
    _, u, chosen = dense_forward(x, params, config, return_u=True)
    assert_close(out.u, u)
    # Each stage of the forward against the dense computation, which shares no code with it.
    parts = dense_forward(x, params, config, return_parts=True)
    for name in ("z", "v", "y_routed", "y_shared"):
        assert_close(getattr(out, name), parts[name])
    # The index holds the dense top-k mask's experts.
    index = to_numpy(out.index)
    assert all(set(index[i].tolist()) == set(np.flatnonzero(chosen[i]).tolist()) for i in range(m))


def test_exact_ties_in_the_forward_pass_go_to_the_lower_id(xp):
    # A zero router gives every expert the score 1/2; a bias on a coarse grid makes exact ties.
    config = MoEConfig.tiny(top_k=3)
    params = init_params(config, 0, dtype=np.float64)
    params["gate.weight"] = np.zeros_like(params["gate.weight"])
    params["gate.e_score_correction_bias"] = np.array([0.0, 0.25, 0.0, 0.25, 0.0, 0.0])
    x = np.random.default_rng(1).standard_normal((4, 8))
    xs, ps = to_xp(xp, x, params)
    out = stable_latent_moe(xs, ps, config, return_intermediates=True)
    np.testing.assert_array_equal(to_numpy(out.index), [[1, 3, 0]] * 4)
    assert_close(out.y, dense_forward(x, params, config))
    assert_close(out.y, stable_latent_moe_reference(x, params, config))


# ---------------------------------------------------------------------------
# Invariances of Eq. (11)
# ---------------------------------------------------------------------------

@with_xp
@given(layer=layers(), seed=st.integers(0, 2**32 - 1))
def test_permuting_tokens_permutes_outputs(xp, layer, seed):
    config, x, params = layer
    perm = np.random.default_rng(seed).permutation(x.shape[0])
    y = to_numpy(stable_latent_moe(*to_xp(xp, x, params), config))
    y_perm = stable_latent_moe(*to_xp(xp, x[perm], params), config)
    assert_close(y_perm, y[perm])


@with_xp
@given(layer=layers(groups=False), seed=st.integers(0, 2**32 - 1))
def test_permuting_experts_consistently_leaves_y_unchanged(xp, layer, seed):
    config, x, params = layer
    pi = np.random.default_rng(seed).permutation(config.n)
    permuted = dict(params)
    for name in ("gate.weight", "gate.e_score_correction_bias", "experts.w1", "experts.w3", "experts.w2"):
        permuted[name] = params[name][pi]  # router rows, bias and expert weights move together
    y = to_numpy(stable_latent_moe(*to_xp(xp, x, params), config))
    assert_close(stable_latent_moe(*to_xp(xp, x, permuted), config), y)


@with_xp
@given(layer=layers(), c=st.floats(0.01, 100.0))
def test_rescaling_the_routed_sum_leaves_the_normed_branch_unchanged(xp, layer, c):
    config, x, params = layer
    if not config.renormalize:
        config = config.replace(renormalize=True)
    # A routed scaling factor c multiplies u by c.
    scaled = config.replace(routed_scaling_factor=c * config.routed_scaling_factor)
    if config.use_latent_norm:
        # RMSNorm_eps(c u) = RMSNorm_{eps / c^2}(u) exactly: the only trace of c is through eps.
        same = config.replace(rms_norm_eps=config.rms_norm_eps / c**2)
        assert_close(stable_latent_moe(*to_xp(xp, x, params), scaled),
                     to_numpy(stable_latent_moe(*to_xp(xp, x, params), same)))
        # With a negligible eps the routed branch does not see c at all.
        tiny_eps = config.replace(rms_norm_eps=1e-30)
        a = stable_latent_moe(*to_xp(xp, x, params), tiny_eps, return_intermediates=True)
        b = stable_latent_moe(*to_xp(xp, x, params), tiny_eps.replace(routed_scaling_factor=c),
                              return_intermediates=True)
        assert_close(b.u, c * to_numpy(a.u) / tiny_eps.routed_scaling_factor)
        if float(np.min(np.mean(to_numpy(a.u) ** 2, axis=1), initial=1.0)) > 1e-12:
            assert_close(b.y_routed, to_numpy(a.y_routed), rtol=1e-9)
    else:
        # Without the norm (the original LatentMoE) the routed branch scales with c.
        a = stable_latent_moe(*to_xp(xp, x, params), config, return_intermediates=True)
        b = stable_latent_moe(*to_xp(xp, x, params), scaled, return_intermediates=True)
        assert_close(b.y_routed, c * to_numpy(a.y_routed))


def test_alpha_one_with_identity_projections_equals_the_plain_moe(xp):
    # With l = d, W_down = W_up = I and no norm, the LatentMoE is an ordinary full-width MoE.
    plain = MoEConfig.tiny(latent_size=8, use_latent_projection=False, use_latent_norm=False)
    latent = plain.replace(use_latent_projection=True)
    params = init_params(plain, 3, dtype=np.float64, bias_scale=0.1)
    with_identity = dict(params)
    with_identity["routed_expert_down_proj.weight"] = np.eye(8)
    with_identity["routed_expert_up_proj.weight"] = np.eye(8)
    x = np.random.default_rng(4).standard_normal((5, 8))
    assert_close(stable_latent_moe(*to_xp(xp, x, with_identity), latent),
                 to_numpy(stable_latent_moe(*to_xp(xp, x, params), plain)))


def test_the_three_variants_differ_only_where_they_should():
    # Stable LatentMoE vs LatentMoE: the same scores, route and latent sum u; only v and y change.
    config = MoEConfig.tiny()
    params = init_params(config, 5, dtype=np.float64)
    x = np.random.default_rng(6).standard_normal((4, 8))
    stable = stable_latent_moe(x, params, config, return_intermediates=True)
    original_params = {k: v for k, v in params.items() if k != "routed_expert_norm.weight"}
    original = stable_latent_moe(x, original_params, config.replace(use_latent_norm=False),
                                 return_intermediates=True)
    np.testing.assert_array_equal(stable.index, original.index)
    np.testing.assert_allclose(stable.u, original.u, rtol=1e-14)
    np.testing.assert_allclose(original.v, original.u, rtol=0)
    rms = np.sqrt(np.mean(stable.v**2, axis=1))
    np.testing.assert_allclose(rms, 1.0 / np.sqrt(1.0 + 1e-5 / np.mean(stable.u**2, axis=1)), rtol=1e-12)


# ---------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------

def test_float32_forward(xp):
    config = MoEConfig.tiny()
    params = init_params(config, 7, dtype=np.float32, bias_scale=0.05)
    x = np.random.default_rng(8).standard_normal((6, 8)).astype(np.float32)
    y = stable_latent_moe(*to_xp(xp, x, params), config)
    assert y.dtype == xp.float32
    assert_close(y, dense_forward(x, params, config), rtol=1e-5)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_half_precision_forward_returns_half_precision(dtype_name):
    import ml_dtypes

    dtype = np.float16 if dtype_name == "float16" else ml_dtypes.bfloat16
    config = MoEConfig.tiny()
    params = init_params(config, 9, dtype=dtype)
    assert params["gate.e_score_correction_bias"].dtype == np.float32  # the bias stays float32
    x = np.random.default_rng(10).standard_normal((6, 8)).astype(dtype)
    y = stable_latent_moe(x, params, config)
    assert y.dtype == np.dtype(dtype)
    expected = dense_forward(x.astype(np.float64), {k: v.astype(np.float64) for k, v in params.items()}, config)
    eps = float(ml_dtypes.finfo(dtype).eps)
    np.testing.assert_allclose(y.astype(np.float64), expected, rtol=0, atol=8 * eps * np.max(np.abs(expected)))


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------

def test_parameter_shapes_of_k3_follow_the_hf_names():
    # The released checkpoint's names and shapes, typed in.
    d, ell, n, f, s = 7168, 3584, 896, 3072, 6144
    assert parameter_shapes(MoEConfig.k3()) == {
        "gate.weight": (n, d),
        "gate.e_score_correction_bias": (n,),
        "routed_expert_down_proj.weight": (ell, d),
        "routed_expert_norm.weight": (ell,),
        "routed_expert_up_proj.weight": (d, ell),
        "experts.w1": (n, f, ell),
        "experts.w3": (n, f, ell),
        "experts.w2": (n, ell, f),
        "shared_experts.gate_proj.weight": (s, d),
        "shared_experts.up_proj.weight": (s, d),
        "shared_experts.down_proj.weight": (d, s),
    }


def test_parameter_shapes_of_the_variants():
    names = set(parameter_shapes(MoEConfig.tiny(use_latent_norm=False)))
    assert "routed_expert_norm.weight" not in names
    plain = set(parameter_shapes(MoEConfig.tiny(latent_size=8, use_latent_projection=False)))
    assert not {"routed_expert_down_proj.weight", "routed_expert_up_proj.weight"} & plain


def test_init_params():
    config = MoEConfig.tiny()
    params = init_params(config, 0)
    assert isinstance(params, MoEParams) and isinstance(params, dict)
    assert {k: v.shape for k, v in params.items()} == parameter_shapes(config)
    assert all(v.dtype == np.float32 for v in params.values())
    np.testing.assert_array_equal(params["routed_expert_norm.weight"], 1.0)
    np.testing.assert_array_equal(params["gate.e_score_correction_bias"], 0.0)
    again = init_params(config, 0)
    assert all(np.array_equal(params[k], again[k]) for k in params)
    assert "experts.w1: [6, 6, 4]" in repr(params)
    biased = init_params(MoEConfig.tiny(num_experts=600, top_k=2), 1, bias_scale=0.5)
    assert np.std(biased["gate.e_score_correction_bias"]) == pytest.approx(0.5, rel=0.1)
    wide = init_params(MoEConfig.small(), 2)
    # N(0, 1/fan_in): unit-scale activations through each product.
    assert np.std(wide["gate.weight"]) == pytest.approx(1 / np.sqrt(1024), rel=0.05)
    assert np.std(wide["experts.w2"][0]) == pytest.approx(1 / np.sqrt(384), rel=0.05)


def test_a_plain_dict_of_weights_is_accepted(xp):
    config = MoEConfig.tiny()
    params = dict(init_params(config, 0, dtype=np.float64))
    x = np.random.default_rng(0).standard_normal((3, 8))
    assert_close(stable_latent_moe(*to_xp(xp, x, params), config), dense_forward(x, params, config))


def test_empty_batch(xp):
    config = MoEConfig.tiny()
    params = init_params(config, 0, dtype=np.float64)
    x = np.zeros((0, 8))
    y = stable_latent_moe(*to_xp(xp, x, params), config)
    assert tuple(y.shape) == (0, 8)
    assert stable_latent_moe_reference(x, params, config).shape == (0, 8)


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

def test_bad_input(xp):
    config = MoEConfig.tiny()
    params = init_params(config, 0, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((3, 8))
    xs, ps = to_xp(xp, x, params)

    def forward(x=xs, params=ps, config=config):
        return stable_latent_moe(x, params, config)

    with pytest.raises(ValueError, match=r"x must have 2 dimensions, got shape \(8,\)"):
        forward(x=xp.asarray(x[0]))
    with pytest.raises(ValueError, match=r"x must have 2 dimensions, got shape \(1, 3, 8\)"):
        forward(x=xp.asarray(x[None]))
    with pytest.raises(ValueError, match=r"x must have shape \[m, 8\] \(hidden_size\), got \[3, 7\]"):
        forward(x=xp.asarray(x[:, :7]))
    with pytest.raises(ValueError, match=r"x must have shape \[m, 8\] \(hidden_size\), got \[3, 1\]"):
        forward(x=xp.asarray(x[:, :1]))  # never broadcast
    with pytest.raises(TypeError, match=r"x must be a real floating array .*got dtype .*int"):
        forward(x=xp.asarray(np.ones((3, 8), dtype=np.int64)))
    with pytest.raises(TypeError, match=r"x must be an array, got list"):
        forward(x=x.tolist())
    bad = x.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"x must be finite, got 1 non-finite entries"):
        forward(x=xp.asarray(bad))
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"x must be finite, got 2 non-finite entries"):
        forward(x=xp.asarray(bad))

    def with_param(name, value):
        changed = dict(ps)
        changed[name] = value
        return changed

    bias = np.zeros(6)
    bias[3] = np.inf
    with pytest.raises(ValueError, match=r"params\['gate.e_score_correction_bias'\] must be finite, got 1 non-finite"):
        forward(params=with_param("gate.e_score_correction_bias", xp.asarray(bias)))
    with pytest.raises(ValueError, match=r"params\['gate.e_score_correction_bias'\] must have shape \[6\], got \[1\]"):
        forward(params=with_param("gate.e_score_correction_bias", xp.asarray(np.zeros(1))))
    with pytest.raises(ValueError, match=r"params\['experts.w2'\] must have shape \[6, 4, 6\], got \[6, 6, 4\]"):
        forward(params=with_param("experts.w2", ps["experts.w1"]))
    with pytest.raises(ValueError, match=r"params\['routed_expert_norm.weight'\] must have shape \[4\], got \[1\]"):
        forward(params=with_param("routed_expert_norm.weight", xp.asarray(np.ones(1))))
    with pytest.raises(ValueError, match=r"params\['gate.weight'\] must have shape \[6, 8\], got \[7, 8\]"):
        forward(params=with_param("gate.weight", xp.asarray(np.ones((7, 8)))))
    with pytest.raises(TypeError, match=r"params\['experts.w1'\] must be a real floating array .*int"):
        forward(params=with_param("experts.w1", xp.asarray(np.ones((6, 6, 4), dtype=np.int64))))
    missing = {k: v for k, v in ps.items() if k != "experts.w3"}
    with pytest.raises(ValueError, match=r"missing \['experts.w3'\], extra \[\]"):
        forward(params=missing)
    with pytest.raises(ValueError, match=r"missing \[\], extra \['experts.w4'\]"):
        forward(params=with_param("experts.w4", ps["experts.w3"]))
    no_norm = config.replace(use_latent_norm=False)
    with pytest.raises(ValueError, match=r"extra \['routed_expert_norm.weight'\]"):
        forward(config=no_norm)
    with pytest.raises(TypeError, match=r"params must be a mapping from parameter names to arrays, got list"):
        forward(params=list(ps.values()))
    with pytest.raises(TypeError, match=r"config must be a MoEConfig, got dict"):
        forward(config={"top_k": 2})
    with pytest.raises(ValueError, match=r"MoEConfig.top_k must be <= num_experts=6, got 7"):
        config.replace(top_k=7)  # k > n cannot even be configured
    with pytest.raises(TypeError, match=r"config must be a MoEConfig, got dict"):
        init_params({"top_k": 2})
    with pytest.raises(ValueError, match=r"params\['experts.w1'\] must have shape \[6, 6, 4\]"):
        check_params(init_params(MoEConfig.tiny(intermediate_size=5), 0), config)


# ---------------------------------------------------------------------------
# Packed expert stacks (checkpoints): decoded one expert at a time
# ---------------------------------------------------------------------------

class _CountingStack:
    """An expert stack that is not an array: decodes on `w[e]` and tracks how many decoded matrices are alive."""

    alive: list = []  # weak references to every matrix handed out, shared by the three stacks
    peak = 0

    def __init__(self, stacked: np.ndarray):
        self.stacked, self.shape, self.dtype = stacked, stacked.shape, np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        import weakref
        e = key[0] if isinstance(key, tuple) else key
        live = [r for r in _CountingStack.alive if r() is not None]
        _CountingStack.peak = max(_CountingStack.peak, len(live))
        out = np.array(self.stacked[e], dtype=np.float32)
        _CountingStack.alive = live + [weakref.ref(out)]
        return out


def test_forward_on_lazy_stacks_holds_one_expert_at_a_time():
    config = MoEConfig.tiny(num_experts=6, top_k=3)
    params = init_params(config, 0)
    x = np.random.default_rng(1).standard_normal((40, config.d)).astype(np.float32)
    lazy = dict(params)
    for name in ("experts.w1", "experts.w3", "experts.w2"):
        lazy[name] = _CountingStack(params[name])
    _CountingStack.alive, _CountingStack.peak = [], 0
    np.testing.assert_array_equal(stable_latent_moe(x, lazy, config), stable_latent_moe(x, params, config))
    # When a matrix is decoded, at most the two others of the same expert are still alive.
    assert _CountingStack.peak <= 2
    np.testing.assert_allclose(stable_latent_moe_reference(x, lazy, config),
                               stable_latent_moe_reference(x, params, config))


def test_check_params_accepts_lazy_stacks_of_the_right_shape_only():
    config = MoEConfig.tiny()
    params = dict(init_params(config, 0))
    params["experts.w1"] = _CountingStack(params["experts.w1"][:, :, :2])
    with pytest.raises(ValueError, match=r"params\['experts.w1'\] must have shape \[6, 6, 4\], got \[6, 6, 2\]"):
        check_params(params, config)


def test_a_given_routing_replaces_the_selection():
    """`routing=(index, weights)` runs the layer with that route: its own route gives the same `y`, another
    route gives the layer of that route (checked against the per-token reference with the bias that forces it)."""
    config = MoEConfig.tiny()
    params = init_params(config, 3, dtype=np.float64)
    x = np.random.default_rng(3).standard_normal((7, config.d))
    out = stable_latent_moe(x, params, config, return_intermediates=True)
    again = stable_latent_moe(x, params, config, routing=(out.index, out.weights))
    np.testing.assert_allclose(again, out.y, rtol=1e-13, atol=1e-13)
    # A bias of +10 on experts 0 and 1 forces them: the same route passed by hand gives the same layer.
    forced = dict(params)
    forced["gate.e_score_correction_bias"] = np.array([10.0, 9.0, 0, 0, 0, 0])
    expected = stable_latent_moe_reference(x, forced, config)
    scores = out.scores[:, :2]
    index = np.tile([0, 1], (7, 1))
    given = stable_latent_moe(x, params, config, routing=(index, scores / scores.sum(1, keepdims=True)))
    np.testing.assert_allclose(given, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"routing's index must have shape \[7, 2\]"):
        stable_latent_moe(x, params, config, routing=(index[:, :1], scores[:, :1]))
    with pytest.raises(ValueError, match=r"expert ids in \[0, 5\]"):
        stable_latent_moe(x, params, config, routing=(index + 5, scores))
