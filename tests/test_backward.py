"""Tests of the hand-written backward pass, `stable_latent_moe_vjp`.

Three independent references:

* **central finite differences** in float64 of the forward pass
  `stable_latent_moe` (which the tests of `latent_moe` check against two
  other computations), along random directions, on configurations drawn by
  Hypothesis; draws where the perturbation would change a token's chosen
  experts are rejected, since the layer jumps there;
* **PyTorch autograd** of a transcription of the forward written for this
  file only: every expert on every token (`einsum`), the route as a dense
  mask from `torch.topk`, RMSNorm and SiTU-GLU from their formulas;
* closed forms: the bias gradient is exactly zero, a top-1 renormalized
  router gets exactly no gradient.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from refimpl._lib.xp import to_numpy
from refimpl.config import MoEConfig
from refimpl.layer.activations import (
    glu_and_grad,
    rms_norm_backward,
    situ_glu,
    situ_glu_grad,
    swiglu,
    swiglu_grad,
)
from refimpl.layer.backward import stable_latent_moe_vjp
from refimpl.layer.latent_moe import init_params, stable_latent_moe
from refimpl.layer.routing import route, router_scores

torch = pytest.importorskip("torch")

# ---------------------------------------------------------------------------
# Drawing layers
# ---------------------------------------------------------------------------

@st.composite
def configs(draw) -> MoEConfig:
    """Small layers with every switch of `MoEConfig` the backward supports."""
    use_projection = draw(st.booleans())
    d = draw(st.integers(3, 7))
    ell = draw(st.integers(2, d)) if use_projection else d
    n_group = draw(st.sampled_from([1, 1, 2, 3]))
    n = n_group * draw(st.integers(2 if n_group > 1 else 3, 4))
    topk_group = draw(st.integers(1, n_group))
    reachable = topk_group * (n // n_group)
    k = draw(st.integers(1, min(reachable, 4)))
    return MoEConfig.tiny(
        hidden_size=d, latent_size=ell, num_experts=n, top_k=k,
        intermediate_size=draw(st.integers(2, 5)),
        num_shared_experts=draw(st.integers(0, 2)),
        use_latent_projection=use_projection,
        use_latent_norm=draw(st.booleans()),
        renormalize=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 0.7])),
        activation=draw(st.sampled_from(["situ", "swiglu"])),
        situ_beta=draw(st.sampled_from([4.0, 1.5])),
        situ_linear_beta=draw(st.sampled_from([25.0, 2.0, None])),
        score_function=draw(st.sampled_from(["sigmoid", "sigmoid", "softmax", "sqrtsoftplus"])),
        n_group=n_group, topk_group=topk_group)


def make_layer(config: MoEConfig, seed: int, m: int, *, scale: float = 1.0):
    """float64 weights (gain and bias not at their trivial values), tokens and an upstream gradient."""
    rng = np.random.default_rng(seed)
    params = init_params(config, rng, dtype=np.float64, bias_scale=0.2)
    for name in params:
        if name == "routed_expert_norm.weight":
            params[name] = params[name] + 0.3 * rng.standard_normal(params[name].shape)
        elif name != "gate.e_score_correction_bias":
            params[name] = scale * params[name]
    x = 1.5 * rng.standard_normal((m, config.d))
    dy = rng.standard_normal((m, config.d))
    return x, params, dy


def loss(x, params, config, dy) -> float:
    return float(np.sum(stable_latent_moe(x, params, config) * dy))


def chosen(x, params, config) -> np.ndarray:
    """The route (expert ids of each token) the forward pass takes."""
    scores = router_scores(x, params["gate.weight"], config.score_function)
    index, _ = route(scores, params["gate.e_score_correction_bias"], config.k, n_group=config.n_group,
                     topk_group=config.topk_group)
    return index


def moved(x, params, name: str, delta):
    """`(x, params)` with `delta` added to `x` (name "x") or to the parameter `name`."""
    if name == "x":
        return x + delta, params
    return x, {**params, name: params[name] + delta}


# ---------------------------------------------------------------------------
# Finite differences
# ---------------------------------------------------------------------------

EPS = 1e-6


@given(config=configs(), seed=st.integers(0, 2**32 - 1), m=st.integers(1, 6))
# A small router gradient (3e-6) beside a loss whose terms sum to 14: the difference quotient's rounding,
# about u * 14 / EPS = 1.5e-9, exceeded the fixed 1e-9 allowance (found with HYPOTHESIS_PROFILE=dev).
@example(config=MoEConfig(hidden_size=4, latent_size=4, num_experts=4, top_k=1, intermediate_size=3,
                          num_shared_experts=1, renormalize=False, routed_scaling_factor=0.7,
                          use_latent_projection=False), seed=429, m=1)
# The ungated squared ReLU of Nemotron-H (the GLU max(a, 0) b), with its latent path and without.
@example(config=MoEConfig.tiny(activation="relu2", use_latent_norm=False, shared_intermediate_size=5), seed=7, m=5)
@example(config=MoEConfig(hidden_size=6, latent_size=6, num_experts=4, top_k=2, intermediate_size=3,
                          num_shared_experts=1, activation="relu2", use_latent_projection=False,
                          use_latent_norm=False), seed=8, m=4)
# DeepSeek-V4's clamped SwiGLU: entries past the limit pass no gradient.
@example(config=MoEConfig(hidden_size=6, latent_size=6, num_experts=4, top_k=2, intermediate_size=3,
                          num_shared_experts=1, activation="swiglu", situ_linear_beta=None, swiglu_limit=0.4,
                          use_latent_projection=False, use_latent_norm=False, score_function="sqrtsoftplus",
                          routed_scaling_factor=1.5), seed=9, m=5)
def test_directional_derivatives_match_central_differences(config, seed, m):
    """For x and each parameter, <gradient, V> equals (L(θ + εV) - L(θ - εV)) / 2ε along a random V."""
    x, params, dy = make_layer(config, seed, m)
    y, backward = stable_latent_moe_vjp(x, params, config)
    dx, dparams = backward(dy)
    rng = np.random.default_rng(seed + 1)
    names = ["x", *(name for name in params if name != "gate.e_score_correction_bias")]
    for name in names:
        value = x if name == "x" else params[name]
        grad = dx if name == "x" else dparams[name]
        direction = rng.standard_normal(value.shape)
        plus = moved(x, params, name, +EPS * direction)
        minus = moved(x, params, name, -EPS * direction)
        # The layer jumps where a token's chosen set changes: keep only draws away from such ties.
        assume(np.array_equal(chosen(*plus, config), chosen(*minus, config)))
        numeric = (loss(*plus, config, dy) - loss(*minus, config, dy)) / (2 * EPS)
        analytic = float(np.sum(grad * direction))
        scale = float(np.sum(np.abs(grad * direction))) + 1e-12
        # Each loss is a sum of terms y * dy, each off by a few units in the last place: the quotient
        # carries that rounding times 1 / (2 EPS), on top of its own truncation error (EPS^2 terms).
        magnitude = float(np.sum(np.abs(y * dy)))
        rounding = 8 * np.finfo(np.float64).eps * magnitude / (2 * EPS)
        assert abs(numeric - analytic) <= 1e-6 * scale + 1e-9 + rounding, (name, numeric, analytic, config)


def test_every_entry_matches_central_differences():
    """Entry by entry, on one small layer with every stage on (norm, projections, shared, renormalized)."""
    config = MoEConfig.tiny(num_shared_experts=1, routed_scaling_factor=1.7)
    x, params, dy = make_layer(config, seed=3, m=5)
    _, backward = stable_latent_moe_vjp(x, params, config)
    dx, dparams = backward(dy)
    for name in ["x", *params]:
        value = x if name == "x" else params[name]
        numeric = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            step = np.zeros_like(value)
            step[idx] = EPS
            plus, minus = moved(x, params, name, step), moved(x, params, name, -step)
            numeric[idx] = (loss(*plus, config, dy) - loss(*minus, config, dy)) / (2 * EPS)
        analytic = dx if name == "x" else dparams[name]
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8, err_msg=name)


# ---------------------------------------------------------------------------
# PyTorch autograd of an independent transcription
# ---------------------------------------------------------------------------

def torch_layer(x, p, config: MoEConfig):
    """Eq. (11) in PyTorch, every expert on every token, for autograd."""
    logits = x @ p["gate.weight"].T  # [m, n]
    if config.score_function == "softmax":
        s = torch.softmax(logits, dim=-1)
    elif config.score_function == "sqrtsoftplus":
        s = torch.sqrt(torch.nn.functional.softplus(logits))
    else:
        s = torch.sigmoid(logits)
    biased = (s + p["gate.e_score_correction_bias"]).detach()  # selection only
    m, n = s.shape
    if config.n_group > 1:
        grouped = biased.reshape(m, config.n_group, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [m, G]
        keep = torch.zeros_like(group_score).scatter(1, group_score.topk(config.topk_group, dim=-1).indices, 1.0)
        biased = torch.where(keep.repeat_interleave(n // config.n_group, dim=1) > 0, biased, -torch.inf)
    mask = torch.zeros_like(s).scatter(1, biased.topk(config.k, dim=-1).indices, 1.0)  # [m, n]
    w = s * mask
    if config.renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * config.routed_scaling_factor

    def act(a, b):
        if config.activation == "swiglu":
            return a * torch.sigmoid(a) * b
        b1, b2 = config.situ_beta, config.situ_linear_beta
        up = b if b2 is None else b2 * torch.tanh(b / b2)
        return b1 * torch.tanh(a / b1) * torch.sigmoid(a) * up

    z = x @ p["routed_expert_down_proj.weight"].T if config.use_latent_projection else x
    hidden = act(torch.einsum("ml,efl->mef", z, p["experts.w1"]), torch.einsum("ml,efl->mef", z, p["experts.w3"]))
    u = torch.einsum("me,mef,elf->ml", w, hidden, p["experts.w2"])  # [m, l]
    if config.use_latent_norm:
        u = u / torch.sqrt((u * u).mean(-1, keepdim=True) + config.rms_norm_eps) * p["routed_expert_norm.weight"]
    y = u @ p["routed_expert_up_proj.weight"].T if config.use_latent_projection else u
    if config.shared_size:
        shared = act(x @ p["shared_experts.gate_proj.weight"].T, x @ p["shared_experts.up_proj.weight"].T)
        y = y + shared @ p["shared_experts.down_proj.weight"].T
    return y


def torch_gradients(x, params, config, dy):
    tx = torch.tensor(x, requires_grad=True)
    tp = {name: torch.tensor(v, requires_grad=True) for name, v in params.items()}
    y = torch_layer(tx, tp, config)
    (y * torch.tensor(dy)).sum().backward()
    grads = {name: t.grad.numpy() if t.grad is not None else np.zeros(t.shape) for name, t in tp.items()}
    return y.detach().numpy(), tx.grad.numpy(), grads


@given(config=configs(), seed=st.integers(0, 2**32 - 1), m=st.integers(1, 8))
def test_matches_pytorch_autograd(config, seed, m):
    x, params, dy = make_layer(config, seed, m)
    y, backward = stable_latent_moe_vjp(x, params, config)
    y_torch, dx_torch, grads_torch = torch_gradients(x, params, config, dy)
    # torch.topk may order ties differently; with continuous random draws the routes agree.
    assume(np.allclose(y, y_torch, rtol=1e-10, atol=1e-12))
    dx, dparams = backward(dy)
    np.testing.assert_allclose(dx, dx_torch, rtol=1e-9, atol=1e-11)
    for name, grad in grads_torch.items():
        np.testing.assert_allclose(dparams[name], grad, rtol=1e-9, atol=1e-11, err_msg=name)


def test_on_every_backend_matches_pytorch(xp):
    """The same array-API code on NumPy, array_api_strict and CuPy, against PyTorch autograd."""
    config = MoEConfig.tiny(n_group=2, topk_group=1, num_shared_experts=2, routed_scaling_factor=2.0)
    x, params, dy = make_layer(config, seed=11, m=9)
    _, dx_torch, grads_torch = torch_gradients(x, params, config, dy)
    y, backward = stable_latent_moe_vjp(xp.asarray(x), {k: xp.asarray(v) for k, v in params.items()}, config)
    dx, dparams = backward(xp.asarray(dy))
    np.testing.assert_allclose(to_numpy(dx), dx_torch, rtol=1e-9, atol=1e-12)
    assert list(dparams) == list(params)
    for name, grad in grads_torch.items():
        np.testing.assert_allclose(to_numpy(dparams[name]), grad, rtol=1e-9, atol=1e-12, err_msg=name)


def test_float32_matches_float64_to_float32_rounding():
    config = MoEConfig.tiny()
    x, params, dy = make_layer(config, seed=5, m=16)
    _, back64 = stable_latent_moe_vjp(x, params, config)
    dx64, dp64 = back64(dy)
    p32 = {k: v.astype(np.float32) for k, v in params.items()}
    y32, back32 = stable_latent_moe_vjp(x.astype(np.float32), p32, config)
    dx32, dp32 = back32(dy.astype(np.float32))
    assert dx32.dtype == np.float32 and y32.dtype == np.float32
    np.testing.assert_allclose(dx32, dx64, rtol=2e-4, atol=2e-5)
    for name in params:
        assert dp32[name].dtype == np.float32, name
        np.testing.assert_allclose(dp32[name], dp64[name], rtol=2e-4, atol=2e-5, err_msg=name)


# ---------------------------------------------------------------------------
# What receives no gradient
# ---------------------------------------------------------------------------

@given(config=configs(), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=30)
def test_bias_gradient_is_exactly_zero(config, seed):
    x, params, dy = make_layer(config, seed, 5)
    _, backward = stable_latent_moe_vjp(x, params, config)
    _, dparams = backward(dy)
    bias_grad = dparams["gate.e_score_correction_bias"]
    assert bias_grad.shape == params["gate.e_score_correction_bias"].shape
    assert np.all(bias_grad == 0.0)
    assert sorted(dparams) == sorted(params)


def test_top1_renormalized_router_gets_no_gradient():
    """With k = 1 and renormalization every weight is the scaling factor: the router cannot learn through it."""
    config = MoEConfig.tiny(top_k=1, routed_scaling_factor=1.5)
    x, params, dy = make_layer(config, seed=2, m=6)
    _, backward = stable_latent_moe_vjp(x, params, config)
    _, dparams = backward(dy)
    assert np.all(dparams["gate.weight"] == 0.0)
    # Without renormalization the raw score is the weight and the router does learn.
    config = config.replace(renormalize=False)
    _, backward = stable_latent_moe_vjp(x, params, config)
    _, dparams = backward(dy)
    assert np.count_nonzero(dparams["gate.weight"]) > 0


# ---------------------------------------------------------------------------
# The pieces
# ---------------------------------------------------------------------------

@given(st.lists(st.floats(-60, 60), min_size=1, max_size=12), st.lists(st.floats(-80, 80), min_size=12,
                                                                       max_size=12))
def test_glu_and_grad_agrees_with_the_activation_module(a_list, b_list):
    """Value and partials equal `situ_glu`/`swiglu` and their derivatives in `refimpl.layer.activations`."""
    a = np.array(a_list)
    b = np.array(b_list[:len(a_list)])
    h, da, db = glu_and_grad(a, b, "situ", 4.0, 25.0)
    da_ref, db_ref = situ_glu_grad(a, b, 4.0, 25.0)
    np.testing.assert_allclose(h, situ_glu(a, b, 4.0, 25.0), rtol=1e-13, atol=1e-300)
    np.testing.assert_allclose(da, da_ref, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(db, db_ref, rtol=1e-12, atol=1e-300)
    h, da, db = glu_and_grad(a, b, "swiglu")
    da_ref, db_ref = swiglu_grad(a, b)
    np.testing.assert_allclose(h, swiglu(a, b), rtol=1e-13, atol=1e-300)
    np.testing.assert_allclose(da, da_ref, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(db, db_ref, rtol=1e-12, atol=1e-300)


def test_glu_and_grad_uncapped_up_branch_matches_pytorch():
    """`linear_beta=None`: softcap(a) σ(a) · b, against autograd."""
    rng = np.random.default_rng(0)
    a, b = 5 * rng.standard_normal(50), 40 * rng.standard_normal(50)
    h, da, db = glu_and_grad(a, b, "situ", 4.0, None)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    th = 4.0 * torch.tanh(ta / 4.0) * torch.sigmoid(ta) * tb
    th.sum().backward()
    np.testing.assert_allclose(h, th.detach().numpy(), rtol=1e-13)
    np.testing.assert_allclose(da, ta.grad.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-12, atol=1e-15)
    # Uncapped means large b passes straight through, unlike the capped branch.
    assert np.max(np.abs(h)) > 100.0


def test_rms_norm_backward_matches_pytorch():
    rng = np.random.default_rng(1)
    u, g, dv = rng.standard_normal((6, 5)), rng.standard_normal(5), rng.standard_normal((6, 5))
    u[2] *= 1e-3  # a row whose mean square is near epsilon
    du, dg = rms_norm_backward(u, g, dv, 1e-5)
    tu, tg = torch.tensor(u, requires_grad=True), torch.tensor(g, requires_grad=True)
    v = tu / torch.sqrt((tu * tu).mean(-1, keepdim=True) + 1e-5) * tg
    (v * torch.tensor(dv)).sum().backward()
    np.testing.assert_allclose(du, tu.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(dg, tg.grad.numpy(), rtol=1e-12)


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

def test_bad_upstream_gradient_is_refused_by_name():
    config = MoEConfig.tiny()
    x, params, dy = make_layer(config, seed=0, m=3)
    _, backward = stable_latent_moe_vjp(x, params, config)
    with pytest.raises(ValueError, match=r"dy must have the shape of y, \[3, 8\], got \[3, 7\]"):
        backward(dy[:, :7])
    with pytest.raises(TypeError, match="dy must be a real floating array"):
        backward(np.ones((3, 8), dtype=np.int64))
    with pytest.raises(TypeError, match="dy must be an array"):
        backward([[0.0] * 8] * 3)
    bad = dy.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="dy must be finite"):
        backward(bad)


def test_bad_layer_input_is_refused_by_name():
    config = MoEConfig.tiny()
    x, params, _ = make_layer(config, seed=0, m=3)
    with pytest.raises(ValueError, match=r"x must have shape \[m, 8\]"):
        stable_latent_moe_vjp(x[:, :5], params, config)
    with pytest.raises(ValueError, match="missing"):
        stable_latent_moe_vjp(x, {k: v for k, v in params.items() if k != "experts.w2"}, config)
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        stable_latent_moe_vjp(x, params, {"hidden_size": 8})


# ---------------------------------------------------------------------------
# The worked example still runs
# ---------------------------------------------------------------------------

def test_worked_example_agrees_with_its_difference_quotients(capsys):
    from conftest import load_example

    result = load_example("60_backward_by_hand").main([])
    assert result["worst"] < 1e-7
    assert result["bias_quotients"] == [0.0] * result["config"].n
    unused = [j for j in range(result["config"].n) if j not in result["used"]]
    assert np.all(result["row_norm"][unused] == 0.0) and np.all(result["row_norm"][result["used"]] > 0.0)
    # The step sweep shows both regimes: the best step beats the extremes by orders of magnitude.
    errors = np.array(result["errors"])
    assert errors.min() < 1e-3 * min(errors[0], errors[-1])
    assert "difference quotients along each bias entry" in capsys.readouterr().out


@given(config=configs(), seed=st.integers(0, 2**32 - 1), m=st.integers(1, 8))
@settings(max_examples=30)
def test_output_is_the_forward_pass(config, seed, m):
    """`y` of the VJP is `stable_latent_moe(x)`, in float64 and in float32, to rounding."""
    x, params, _ = make_layer(config, seed, m)
    y, _ = stable_latent_moe_vjp(x, params, config)
    np.testing.assert_allclose(y, stable_latent_moe(x, params, config), rtol=1e-12, atol=1e-13)
    p32 = {k: v.astype(np.float32) for k, v in params.items()}
    y32, _ = stable_latent_moe_vjp(x.astype(np.float32), p32, config)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, stable_latent_moe(x.astype(np.float32), p32, config), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# backward(dy, out=): writing into the gradients of an earlier step
# ---------------------------------------------------------------------------

@given(config=configs(), seed=st.integers(0, 2**32 - 1), m=st.integers(1, 8),
       dtype=st.sampled_from([np.float32, np.float64]))
@settings(max_examples=30)
def test_out_gives_the_new_arrays_gradients_exactly(config, seed, m, dtype):
    """`out=` filled with NaN (an idle expert's stale gradient included) ends equal, bit for bit, to a fresh call."""
    x, params, dy = make_layer(config, seed, m)
    x, dy = x.astype(dtype), dy.astype(dtype)
    params = {name: a.astype(dtype) for name, a in params.items()}
    _, backward = stable_latent_moe_vjp(x, params, config)
    dx, fresh = backward(dy)
    out = {name: np.full_like(g, np.nan) for name, g in fresh.items()}
    dx_out, returned = backward(dy, out=out)
    assert returned is out
    np.testing.assert_array_equal(dx_out, dx)
    for name in params:
        np.testing.assert_array_equal(out[name], fresh[name], err_msg=name)


def test_out_on_every_backend(xp):
    """array_api_strict (and CuPy) take the readable path, which copies into `out`; the values are a fresh call's."""
    config = MoEConfig.tiny(num_shared_experts=1)
    x, params, dy = make_layer(config, seed=3, m=7)
    _, backward = stable_latent_moe_vjp(xp.asarray(x), {k: xp.asarray(v) for k, v in params.items()}, config)
    _, fresh = backward(xp.asarray(dy))
    out = {name: xp.zeros(g.shape, dtype=g.dtype) for name, g in fresh.items()}
    _, returned = backward(xp.asarray(dy), out=out)
    assert returned is out
    for name in params:
        np.testing.assert_array_equal(to_numpy(out[name]), to_numpy(fresh[name]), err_msg=name)


def test_bad_out_is_refused_by_name():
    config = MoEConfig.tiny()
    x, params, dy = make_layer(config, seed=1, m=4)
    _, backward = stable_latent_moe_vjp(x, params, config)
    _, good = backward(dy)
    with pytest.raises(TypeError, match="out must be a mapping"):
        backward(dy, out=[good["experts.w1"]])
    with pytest.raises(ValueError, match=r"missing \['experts.w1'\]"):
        backward(dy, out={k: v for k, v in good.items() if k != "experts.w1"})
    with pytest.raises(ValueError, match=r"out\['experts.w2'\] must be an array of shape"):
        backward(dy, out={**good, "experts.w2": good["experts.w2"][:1]})
    with pytest.raises(ValueError, match=r"out\['gate.weight'\].*dtype float64.*float32"):
        backward(dy, out={**good, "gate.weight": good["gate.weight"].astype(np.float32)})
    frozen = good["experts.w3"].copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\['experts.w3'\] must be writable"):
        backward(dy, out={**good, "experts.w3": frozen})


def test_out_that_aliases_is_refused_by_name():
    """Gradient arrays that overlap each other, a parameter, `x` or `dy` would be read half-overwritten."""
    config = MoEConfig.tiny()
    x, params, dy = make_layer(config, seed=1, m=4)
    _, backward = stable_latent_moe_vjp(x, params, config)
    _, good = backward(dy)
    shared = {**good, "shared_experts.up_proj.weight": good["shared_experts.gate_proj.weight"]}
    with pytest.raises(ValueError, match=r"share memory"):
        backward(dy, out=shared)
    with pytest.raises(ValueError, match=r"out\['gate.weight'\] shares memory with params\['gate.weight'\]"):
        backward(dy, out={**good, "gate.weight": params["gate.weight"]})
    stack = np.empty((2, *good["experts.w1"].shape))
    with pytest.raises(ValueError, match=r"out\['experts.w1'\] and out\['experts.w3'\] share memory"):
        backward(dy, out={**good, "experts.w1": stack[0], "experts.w3": stack[0]})
    big = np.zeros((64, 8))
    sliced = {**good, "routed_expert_norm.weight": big[0, :4]}
    with pytest.raises(ValueError, match=r"shares memory with dy"):
        backward(big[:4], out=sliced)
    # After every refusal the arrays passed as parameters are untouched and a plain call still works.
    _, again = backward(dy)
    for name in params:
        np.testing.assert_array_equal(again[name], good[name], err_msg=name)


@given(config=configs(), seed=st.integers(0, 2**32 - 1), m=st.integers(1, 6))
@settings(max_examples=25)
def test_dscores_is_the_gradient_of_a_loss_on_the_scores(config, seed, m):
    """`backward(dy, dscores=g)` is the gradient of L = <y, dy> + <scores, g>, checked by central differences."""
    x, params, dy = make_layer(config, seed, m)
    out, backward = stable_latent_moe_vjp(x, params, config, return_intermediates=True)
    g = np.random.default_rng(seed + 7).standard_normal(out.scores.shape)
    dx, dparams = backward(dy, dscores=g)

    def total(x_, params_):
        o = stable_latent_moe(x_, params_, config, return_intermediates=True)
        return float(np.sum(o.y * dy) + np.sum(o.scores * g))

    rng = np.random.default_rng(seed + 1)
    for name in ("x", "gate.weight"):
        value = x if name == "x" else params[name]
        grad = dx if name == "x" else dparams[name]
        direction = rng.standard_normal(value.shape)
        plus, minus = moved(x, params, name, +EPS * direction), moved(x, params, name, -EPS * direction)
        assume(np.array_equal(chosen(*plus, config), chosen(*minus, config)))
        numeric = (total(*plus) - total(*minus)) / (2 * EPS)
        analytic = float(np.sum(grad * direction))
        assert abs(numeric - analytic) <= 1e-6 * (float(np.sum(np.abs(grad * direction))) + 1e-12) + 1e-9


def test_dscores_of_the_wrong_shape_is_refused():
    config = MoEConfig.tiny()
    x, params, dy = make_layer(config, seed=1, m=4)
    _, backward = stable_latent_moe_vjp(x, params, config)
    with pytest.raises(ValueError, match=r"dscores must have the shape of the scores, \[4, 6\], got \[4, 5\]"):
        backward(dy, dscores=np.zeros((4, 5)))


# ---------------------------------------------------------------------------
# backward(dy) without out=: the workspaces kept between calls
# ---------------------------------------------------------------------------

def benchmark_like_layer(dtype=np.float32, m: int = 48):
    """A layer with every stage on (shared experts, latent path, norm), big enough that every expert is busy."""
    config = MoEConfig.small(hidden_size=32, latent_size=16, num_experts=8, top_k=2, intermediate_size=12)
    rng = np.random.default_rng(11)
    params = init_params(config, rng, dtype=dtype)
    return config, params, rng.standard_normal((m, config.d)).astype(dtype), \
        rng.standard_normal((m, config.d)).astype(dtype)


def all_gradients(dx, dparams) -> dict[str, np.ndarray]:
    return {"x": dx, **dparams}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_default_call_equals_out_and_the_readable_path(dtype):
    """Pooled new arrays, `out=` and the readable path (fast paths off) give the same gradients, call after call."""
    from refimpl._lib import fast

    config, params, x, dy = benchmark_like_layer(dtype)
    with mock.patch.object(fast, "ENABLED", False):
        readable = all_gradients(*stable_latent_moe_vjp(x, params, config)[1](dy))
    first = all_gradients(*stable_latent_moe_vjp(x, params, config)[1](dy))
    expected = {name: g.copy() for name, g in first.items()}
    del first  # its memory goes back to the pool and serves the next calls
    for _ in range(3):
        pooled = all_gradients(*stable_latent_moe_vjp(x, params, config)[1](dy))
        _, backward = stable_latent_moe_vjp(x, params, config)
        out = {name: np.full_like(g, np.nan) for name, g in pooled.items() if name != "x"}
        written = all_gradients(*backward(dy, out=out))
        for name, want in expected.items():
            np.testing.assert_array_equal(pooled[name], want, err_msg=name)
            np.testing.assert_array_equal(written[name], want, err_msg=name)
            # Fast and readable order the same products alike up to BLAS blocking: float rounding of a few terms.
            tol = 1e-4 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(want, readable[name], rtol=tol, atol=tol * float(np.abs(want).max()),
                                       err_msg=name)


def test_results_of_two_calls_never_share_memory():
    """What one call returned is not written by the next, whether kept whole, as a view or as a memoryview."""
    config, params, x, dy = benchmark_like_layer()
    y1, backward1 = stable_latent_moe_vjp(x, params, config)
    first = all_gradients(*backward1(dy))
    before = {name: g.copy() for name, g in first.items()}
    second = all_gradients(*backward1(2.0 * dy))  # the same backward again
    _, backward3 = stable_latent_moe_vjp(0.5 * x, params, config)  # a new forward
    third = all_gradients(*backward3(-dy))
    for a in (first, second, third):
        for b in (first, second, third):
            if a is not b:
                for name_a, ga in a.items():
                    for name_b, gb in b.items():
                        assert not np.shares_memory(ga, gb), (name_a, name_b)
    for name, g in first.items():
        np.testing.assert_array_equal(g, before[name], err_msg=name)
    np.testing.assert_array_equal(second["experts.w1"], 2.0 * first["experts.w1"])  # linear in dy, exact by 2
    # Only a view of the stack is kept (numpy views point at the whole array), then only a memoryview.
    view, kept = first["experts.w2"][1:], first["experts.w2"][1:].copy()
    del first, second
    fourth = all_gradients(*stable_latent_moe_vjp(x, params, config)[1](4.0 * dy))
    assert not any(np.shares_memory(view, g) for g in fourth.values())
    window = memoryview(third["experts.w3"])
    kept3 = third["experts.w3"].copy()
    del third, view
    fifth = all_gradients(*stable_latent_moe_vjp(x, params, config)[1](dy))
    assert not any(np.shares_memory(np.asarray(window), g) for g in fifth.values())
    np.testing.assert_array_equal(np.asarray(window), kept3)
    np.testing.assert_array_equal(fourth["experts.w2"][1:], 4.0 * kept)


def test_memory_let_go_serves_the_next_call_and_release_frees_it():
    """The pool recycles a stack the caller dropped (same address), and `release_workspaces` empties it."""
    from refimpl._lib.fast import WORKSPACES
    from refimpl.layer.backward import release_workspaces

    config, params, x, dy = benchmark_like_layer()
    release_workspaces()
    assert WORKSPACES.held_bytes() == 0
    _, grads = stable_latent_moe_vjp(x, params, config)[1](dy)
    expected = {name: g.copy() for name, g in grads.items()}
    address = grads["experts.w1"].__array_interface__["data"][0]
    del grads
    assert WORKSPACES.held_bytes() >= 3 * expected["experts.w1"].nbytes
    _, again = stable_latent_moe_vjp(x, params, config)[1](dy)
    addresses = {again[name].__array_interface__["data"][0] for name in ("experts.w1", "experts.w3")}
    assert address in addresses
    freed = release_workspaces()
    assert freed > 0 and WORKSPACES.held_bytes() == 0
    _, after = stable_latent_moe_vjp(x, params, config)[1](dy)
    for name, g in expected.items():
        np.testing.assert_array_equal(again[name], g, err_msg=name)
        np.testing.assert_array_equal(after[name], g, err_msg=name)


def test_threads_running_the_layer_at_once_get_their_own_arrays():
    """Four threads, each its own input, all at once: each result equals the one computed alone, none shared."""
    import threading

    config, params, x, dy = benchmark_like_layer()
    inputs = [(x * (1.0 + 0.25 * t)).astype(np.float32) for t in range(4)]
    alone = []
    for xt in inputs:
        dx, grads = stable_latent_moe_vjp(xt, params, config)[1](dy)
        alone.append({name: g.copy() for name, g in all_gradients(dx, grads).items()})
    results: list = [None] * len(inputs)
    start = threading.Barrier(len(inputs))

    def work(t):
        start.wait()
        for _ in range(3):
            results[t] = all_gradients(*stable_latent_moe_vjp(inputs[t], params, config)[1](dy))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t, got in enumerate(results):
        for name, want in alone[t].items():
            np.testing.assert_array_equal(got[name], want, err_msg=f"thread {t}: {name}")
        for other in results[t + 1:]:
            assert not any(np.shares_memory(g, h) for g in got.values() for h in other.values())
