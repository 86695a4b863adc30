"""Hostile numbers: integer inputs, NaN, huge biases, empty batches, and changes between forward and backward.

Each case gave a silently wrong number or a raw error from NumPy, SciPy or Python on the release before
this one. Now an integer or boolean input is promoted (its float result compared with the float input's),
and everything else is a `ValueError` or `TypeError` naming the argument.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from refimpl import MoEConfig, init_params, sigmoid, stable_latent_moe
from refimpl.balancing import quantile_balancing_update
from refimpl.balancing.dual import solve_assignment_lp
from refimpl.balancing.histogram import BiasHistogram, histogram_balancing_update
from refimpl.balancing.quantile import interpolated_kth_largest, kth_largest, sign_balancing_update
from refimpl.checkpoints import ExpertStack, load_hf_layer, save_hf_layer
from refimpl.layer.activations import hard_clamp, rms_norm, situ_glu, softcap, swiglu
from refimpl.layer.backward import stable_latent_moe_vjp
from refimpl.layer.routing import score_function_values

RNG = np.random.default_rng(0)
SCORES = RNG.random((64, 8)).astype(np.float32)
CONFIG = MoEConfig(hidden_size=32, latent_size=16, num_experts=8, top_k=2, intermediate_size=16,
                   num_shared_experts=1)


# ---------------------------------------------------------------------------
# Integer and boolean inputs are promoted, never truncated
# ---------------------------------------------------------------------------

INTEGERS = np.array([[-3, -1, 0, 1, 2, 5]])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.bool_])
@pytest.mark.parametrize("function", [
    sigmoid, lambda z: softcap(z, 4.0), lambda z: hard_clamp(z, 1.5), lambda z: swiglu(z, z),
    lambda z: situ_glu(z, z), lambda z: rms_norm(z, np.ones(z.shape[-1], np.float32)),
    *(lambda z, f=f: score_function_values(z, f) for f in ("sigmoid", "softmax", "sqrtsoftplus")),
], ids=["sigmoid", "softcap", "hard_clamp", "swiglu", "situ_glu", "rms_norm", "sigmoid_scores",
        "softmax_scores", "sqrtsoftplus_scores"])
def test_integer_and_boolean_inputs_are_promoted_or_refused_never_truncated(function, dtype):
    z = INTEGERS.astype(dtype)
    try:
        got = function(z)
    except TypeError as exc:  # refused, naming the argument and the dtype: also fine
        assert f"got dtype {np.dtype(dtype).name}" in str(exc), str(exc)
        return
    assert np.issubdtype(got.dtype, np.floating), got.dtype
    np.testing.assert_allclose(got, function(z.astype(np.float32)), rtol=1e-6, atol=1e-7)


def test_sigmoid_of_integers_is_not_zero():
    # The case as reported: sigmoid(3) was returned as the integer 0.
    np.testing.assert_allclose(sigmoid(np.array([3, -3, 0])), [0.95257413, 0.04742587, 0.5], rtol=1e-6)


# ---------------------------------------------------------------------------
# NaN, negative counts and overflowing steps are refused by name
# ---------------------------------------------------------------------------

def test_nan_has_no_rank():
    with pytest.raises(ValueError, match=r"x must hold no NaN .*got 1 NaN entries"):
        kth_largest(np.array([[1.0, np.nan, 3.0]]), 1)
    with pytest.raises(ValueError, match=r"values must hold no NaN"):
        interpolated_kth_largest(np.array([1.0, np.nan, 3.0]), 1.5)
    with pytest.raises(ValueError, match=r"values must hold no NaN"):
        interpolated_kth_largest(np.array([[1.0, 2.0], [np.nan, 0.0], [3.0, 1.0]]), 2, axis=0)
    # Infinities are ordered, and +inf with -inf (whose sum is NaN) is not mistaken for NaN.
    np.testing.assert_array_equal(kth_largest(np.array([[np.inf, -np.inf, 0.0]]), 2), [0.0])


@pytest.mark.parametrize("r,previous", [(0, False), (4, False), (1, True), (2.0, False)])
def test_kth_largest_rank_out_of_range_is_named(r, previous):
    with pytest.raises((ValueError, TypeError), match=r"\br\b"):
        kth_largest(np.array([[1.0, 2.0, 3.0]]), r, previous=previous)


def test_kth_largest_still_agrees_with_a_sort():
    x = RNG.standard_normal((5, 40))
    for r in (1, 7, 40):
        np.testing.assert_array_equal(kth_largest(x, r), np.sort(x, axis=1)[:, 40 - r])


def test_a_negative_load_is_not_a_token_count():
    with pytest.raises(ValueError, match=r"load must hold token counts, which are never negative, got -1"):
        sign_balancing_update(np.array([-1, 3, 2, 2]), np.zeros(4, np.float32), 0.01)


@pytest.mark.parametrize("dtype,rate", [(np.float32, 1e300), (np.float32, 1e39), (np.float64, 1e308)])
def test_a_rate_that_overflows_the_bias_is_refused(dtype, rate):
    bias = np.array([1e308 if dtype == np.float64 else 3e38, 0, 0, 0], dtype)
    with pytest.raises(ValueError, match=r"moves the bias beyond what float(32|64) holds"):
        sign_balancing_update(np.array([0, 3, 2, 3]), bias, rate)
    # An ordinary step is unchanged, exactly.
    np.testing.assert_array_equal(sign_balancing_update(np.array([1, 3, 2, 2]), np.zeros(4, dtype), 1e-3),
                                  np.array([1e-3, -1e-3, 0, 0], dtype))


@pytest.mark.parametrize("bias", [np.full(8, 1e30, np.float32), np.array([1e308, -1e308, 0, 0, 0, 0, 0, 0]),
                                  np.full(8, 2.0**60)])
def test_a_bias_the_bins_cannot_divide_is_refused(bias):
    with pytest.raises(ValueError, match=r"bias must span an interval the histogram's bins can divide"):
        histogram_balancing_update(SCORES, bias, 2)
    with pytest.raises(ValueError, match=r"bias must span an interval"):
        BiasHistogram(bias, 2)


def test_a_large_bias_the_bins_can_divide_is_still_estimated_within_a_bin():
    bias = np.array([3e3, -3e3, 0, 0, 0, 0, 0, 0], np.float64)
    histogram = BiasHistogram(bias, 2).add(SCORES)
    exact = quantile_balancing_update(SCORES.astype(np.float64), bias, 2, center=False)
    assert np.max(np.abs(histogram.thresholds() - exact)) <= histogram.width


def test_an_lp_of_no_tokens_is_named():
    with pytest.raises(ValueError, match=r"scores must hold at least one token \(got m=0\)"):
        solve_assignment_lp(np.zeros((0, 8)), 2)
    with pytest.raises(TypeError, match=r"options must be a dict"):
        solve_assignment_lp(np.zeros((8, 8)), 2, options=[("time_limit", 1)])


# ---------------------------------------------------------------------------
# Between forward and backward: the gradients of the forward that ran, or a refusal
# ---------------------------------------------------------------------------

def _vjp_case():
    params = init_params(CONFIG, 0)
    x = RNG.standard_normal((16, 32)).astype(np.float32)
    dy = RNG.standard_normal((16, 32)).astype(np.float32)
    return params, x, dy


@pytest.mark.parametrize("change", [lambda x: x.fill(0), lambda x: x.__imul__(3), lambda x: x.__setitem__(0, 9)])
def test_changing_the_input_after_the_forward_changes_no_gradient(change):
    params, x, dy = _vjp_case()
    _, backward = stable_latent_moe_vjp(x.copy(), params, CONFIG)
    dx_want, grads_want = backward(dy)
    mine = x.copy()
    _, backward = stable_latent_moe_vjp(mine, params, CONFIG)
    change(mine)
    dx, grads = backward(dy)
    np.testing.assert_array_equal(dx, dx_want)
    for name in grads_want:
        np.testing.assert_array_equal(grads[name], grads_want[name], err_msg=name)


@pytest.mark.parametrize("name", ["experts.w1", "gate.weight", "shared_experts.down_proj.weight"])
def test_changing_a_weight_after_the_forward_is_refused(name):
    params, x, dy = _vjp_case()
    _, backward = stable_latent_moe_vjp(x, params, CONFIG)
    params[name].flat[3] += 1e-3
    with pytest.raises(ValueError, match=rf"params\['{name}'\] changed between the forward pass and backward"):
        backward(dy)
    # Changed back, the backward runs: the fingerprint is of the values, not of the array's identity.
    params[name].flat[3] -= 1e-3
    _, backward_again = stable_latent_moe_vjp(x, params, CONFIG)
    np.testing.assert_array_equal(backward_again(dy)[0], stable_latent_moe_vjp(x, params, CONFIG)[1](dy)[0])


def test_a_weight_changed_by_one_unit_in_the_last_place_is_refused():
    """A change that a sum of the entries would round away still moves the weight's fingerprint."""
    params, x, dy = _vjp_case()
    _, backward = stable_latent_moe_vjp(x, params, CONFIG)
    w = params["experts.w2"]
    w.flat[7] = np.nextafter(w.flat[7], np.float32(np.inf))
    with pytest.raises(ValueError, match=r"params\['experts.w2'\] changed between the forward pass and backward"):
        backward(dy)


# ---------------------------------------------------------------------------
# A dense checkpoint's weights are finite
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("name", ["experts.w2", "gate.weight"])
def test_a_non_finite_dense_weight_is_refused_naming_the_tensor(tmp_path, value, name):
    params = {k: v.astype(ml_dtypes.bfloat16) if "bias" not in k else v for k, v in init_params(CONFIG, 0).items()}
    config = CONFIG.replace(num_moe_layers=2)
    save_hf_layer(tmp_path, config, params, layer=1, mxfp4=False)  # refuses non-finite weights: damage the file
    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    key = "language_model.model.layers.1.block_sparse_moe." + ("experts.2.w2.weight" if name.startswith("experts")
                                                               else "gate.weight")
    tensors[key] = tensors[key].copy()
    tensors[key].flat[5] = value
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    x = RNG.standard_normal((16, 32)).astype(np.float32)
    with pytest.raises(ValueError, match=r"non-finite value\(s\) \(NaN or infinity\)"):
        _, loaded = load_hf_layer(tmp_path, 1)
        if name.startswith("experts"):
            stack = loaded[name]
            assert isinstance(stack, ExpertStack)
            stack[0]  # a finite expert decodes
            stack[2]
        stable_latent_moe(x, loaded, config)


def test_the_expert_parallel_backward_keeps_its_input_and_refuses_changed_weights():
    from mpi4py import MPI

    from refimpl.parallel import ep_vjp

    params, x, dy = _vjp_case()
    _, _, backward = ep_vjp(x.copy(), params, CONFIG, MPI.COMM_SELF)
    dx_want, _ = backward(dy)
    mine = x.copy()
    _, _, backward = ep_vjp(mine, params, CONFIG, MPI.COMM_SELF)
    mine *= 3
    np.testing.assert_array_equal(backward(dy)[0], dx_want)
    params["gate.weight"].flat[0] += 1e-3
    with pytest.raises(ValueError, match=r"ep_vjp's backward: rank 0 of 1: params\['gate.weight'\] changed"):
        backward(dy)
