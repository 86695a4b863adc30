"""Hostile arguments to the public API: each case lost a value silently, returned NaN or huge weights, or
raised a raw NumPy error on the release before this one.

* `MoEConfig.to_hf_config` refuses the fields K3's keys cannot hold (`capacity_factor`, `hash_routing`,
  `num_hash_layers`): the round trip returned another layer, whose forward differed by 2.2;
* the records comparator decides by the record: a whole number there is a count, and a fresh "3.5" does
  not reproduce "3";
* a cap or epsilon the compute dtype cannot hold (`beta=1e39`, `eps=1e-50` in float32) is refused by
  name instead of returning NaN;
* renormalized weights refuse negative scores (one gave weights of +-5000), and `mixture_weights`
  checks its `raw` scores (a 0-d array, a list, booleans, NaN, infinity);
* `init_params(bias_scale=...)` takes a finite real number >= 0 whose bias stays in range;
* `e8m0_decode` and `e2m1_decode` take integer codes in range (256, -1 and 1.7 were wrapped silently,
  code 16 was a raw IndexError).
"""

from __future__ import annotations

import math
import re
import sys
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from refimpl import MoEConfig, init_params, route, stable_latent_moe
from refimpl.checkpoints import save_hf_layer
from refimpl.config import family_hf_config
from refimpl.layer.activations import (
    hard_clamp,
    hard_clamp_grad,
    rms_norm,
    situ_glu,
    situ_glu_grad,
    softcap,
    softcap_grad,
    swiglu,
)
from refimpl.layer.routing import mixture_weights, score_function_values
from refimpl.mx import E2M1_VALUES, e2m1_decode, e8m0_decode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import decimals_agree, same_by_meaning  # noqa: E402 - the comparator lives with the tests

# ---------------------------------------------------------------------------
# to_hf_config: what K3's keys cannot hold is refused, not dropped
# ---------------------------------------------------------------------------

NOT_IN_K3 = {
    "capacity_factor": (dict(capacity_factor=0.5),
                        r"MoEConfig.capacity_factor must be None to write K3's configuration, got 0.5: K3's keys "
                        r"have no expert capacity"),
    "hash_routing": (dict(hash_routing=True),
                     r"MoEConfig.hash_routing must be False to write K3's configuration, got True: K3's keys have "
                     r"no hash routing"),
    "num_hash_layers": (dict(num_moe_layers=4, num_hash_layers=2),
                        r"MoEConfig.num_hash_layers must be 0 to write K3's configuration, got 2: K3's keys have "
                        r"no table-routed layers"),
}


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("field", sorted(NOT_IN_K3))
def test_to_hf_config_refuses_a_field_k3s_keys_cannot_hold(field, nested):
    change, message = NOT_IN_K3[field]
    config = MoEConfig.tiny(**change)
    with pytest.raises(ValueError, match=message):
        config.to_hf_config(nested=nested)
    # The writers that go through it refuse too: the K3 family's config.json, and a checkpoint folder.
    with pytest.raises(ValueError, match=message):
        family_hf_config(config, "kimi_k3", 1)


def test_a_checkpoint_of_a_capacity_layer_is_refused_before_anything_is_written(tmp_path):
    config = MoEConfig.tiny(capacity_factor=0.5)
    with pytest.raises(ValueError, match=r"MoEConfig.capacity_factor must be None to write K3's configuration"):
        save_hf_layer(tmp_path / "layer", config, init_params(config, 0), layer=1, mxfp4=False)
    assert not (tmp_path / "layer").exists()


def test_what_k3s_keys_hold_still_reads_back_as_the_same_layer():
    # The round trip the refusal protects: capacity_factor=0.5 would come back as None, a forward 2.2 away.
    config = MoEConfig.tiny(score_function="sqrtsoftplus", routed_scaling_factor=2.5, num_moe_layers=3)
    assert MoEConfig.from_hf_config(config.to_hf_config(nested=True)) == config
    capped = MoEConfig.tiny(capacity_factor=0.5)
    params = init_params(capped, 0)
    x = np.random.default_rng(0).standard_normal((12, 8)).astype(np.float32)
    dropped = stable_latent_moe(x, params, capped)
    served = stable_latent_moe(x, params, capped.replace(capacity_factor=None))
    assert np.abs(dropped - served).max() > 0.1  # what the old round trip silently changed


# ---------------------------------------------------------------------------
# Records: a whole number of the record is a count, and a fresh decimal does not reproduce it
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("was", "now", "stem"), [
    ("dropped 3 tokens", "dropped 3.5 tokens", ""),
    ("dropped 0 tokens", "dropped 0.4 tokens", ""),
    ("expert 12 has load 100", "expert 12 has load 99.6", ""),
    ("k = 2", "k = 2.0", ""),
    ("1,048,576 tokens", "1,048,576.4 tokens", ""),
    ("under-loaded: 194 of 194", "under-loaded: 194 of 194.0", ""),
    # An example's rounding tolerance widens its decimals, never the whole numbers on the same line.
    ("x (2, 2) 2.716363274 2.716363273 4.3e-10", "x (2.4, 2) 2.716363274 2.716363273 4.3e-10",
     "60_backward_by_hand"),
])
def test_a_fresh_decimal_does_not_reproduce_a_whole_number_of_the_record(was, now, stem):
    problems = same_by_meaning(was, now, stem)
    assert problems and "against" in problems[0], problems


@pytest.mark.parametrize(("was", "now"), [
    ("loss 1e-12 at step 3", "loss 0 at step 3"),  # the record's decimal, within its last digit
    ("loss 9.99 at step 3", "loss 10 at step 3"),
    ("dropped 3 tokens", "dropped 3 tokens"),
    ("1,048,576 tokens", "1,048,576 tokens"),
])
def test_a_recorded_decimal_may_come_back_whole_within_its_last_digit(was, now):
    assert same_by_meaning(was, now, "") == []


def test_the_decimal_rule_itself_is_unchanged():
    # decimals_agree is what the record's decimals go through; the fix decides only which pairs get there.
    assert decimals_agree("2.716", "2.717") and not decimals_agree("2.716", "2.718")
    assert same_by_meaning("error 2.716 at step 3", "error 2.717 at step 3", "") == []


# ---------------------------------------------------------------------------
# Activations: a cap or epsilon the compute dtype cannot hold is refused, not NaN
# ---------------------------------------------------------------------------

GATE = np.array([-2.0, 0.0, 3.0], np.float32)
UP = np.array([1.0, 2.0, 3.0], np.float32)
ROWS = np.array([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
FLOAT32_RANGE = r"between 1.401e-45 and 3.4028235e\+38"

CAPPED = {
    "situ_glu(beta=1e39)": ("beta", "1e+39", lambda a, b: situ_glu(a, b, beta=1e39)),
    "situ_glu(beta=1e-46)": ("beta", "1e-46", lambda a, b: situ_glu(a, b, beta=1e-46)),
    "situ_glu(linear_beta=1e39)": ("linear_beta", "1e+39", lambda a, b: situ_glu(a, b, linear_beta=1e39)),
    "situ_glu(linear_beta=1e-46)": ("linear_beta", "1e-46", lambda a, b: situ_glu(a, b, linear_beta=1e-46)),
    "situ_glu_grad(beta=1e39)": ("beta", "1e+39", lambda a, b: situ_glu_grad(a, b, beta=1e39)),
    "situ_glu_grad(linear_beta=1e39)": ("linear_beta", "1e+39", lambda a, b: situ_glu_grad(a, b, linear_beta=1e39)),
    "softcap(1e39)": ("beta", "1e+39", lambda a, b: softcap(a, 1e39)),
    "softcap(1e-46)": ("beta", "1e-46", lambda a, b: softcap(a, 1e-46)),
    "softcap_grad(1e39)": ("beta", "1e+39", lambda a, b: softcap_grad(a, 1e39)),
    "hard_clamp(1e39)": ("beta", "1e+39", lambda a, b: hard_clamp(a, 1e39)),
    "hard_clamp_grad(1e-46)": ("beta", "1e-46", lambda a, b: hard_clamp_grad(a, 1e-46)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("call", sorted(CAPPED))
def test_a_cap_float32_cannot_hold_is_refused_by_name(call, dtype):
    name, shown, function = CAPPED[call]
    with pytest.raises(ValueError, match=rf"^{name} must be a number float32 \(the compute dtype of these inputs\) "
                                         rf"holds: {FLOAT32_RANGE}, got {re.escape(shown)}, which float32 rounds to"):
        function(GATE.astype(dtype), UP.astype(dtype))


@pytest.mark.parametrize("eps", [1e-50, 1e39])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_an_rms_norm_epsilon_float32_cannot_hold_is_refused_by_name(eps, dtype):
    with pytest.raises(ValueError, match=rf"^eps must be a number float32 \(the compute dtype of these inputs\) "
                                         rf"holds: {FLOAT32_RANGE}, got {re.escape(f'{eps:g}')}, which float32 "
                                         rf"rounds to"):
        rms_norm(ROWS.astype(dtype), np.ones(4, dtype), eps=eps)


def test_float64_inputs_hold_those_values_and_compute_them():
    a, b = GATE.astype(np.float64), UP.astype(np.float64)
    # Caps far above the inputs: SiTU-GLU is SwiGLU to float64 rounding.
    np.testing.assert_allclose(situ_glu(a, b, beta=1e39, linear_beta=1e39), swiglu(a, b), rtol=1e-12)
    np.testing.assert_allclose(softcap(a, 1e39), a, rtol=1e-12)
    out = rms_norm(ROWS.astype(np.float64), np.ones(4), eps=1e-50)
    assert np.all(out[0] == 0.0)
    row = ROWS[1].astype(np.float64)
    np.testing.assert_allclose(out[1], row / np.sqrt(np.mean(row**2)), rtol=1e-12)
    # A float64 gain widens a float32 x's arithmetic, so eps is judged in float64 there too.
    assert np.all(np.isfinite(rms_norm(ROWS, np.ones(4), eps=1e-50)))


def test_the_smallest_caps_float32_holds_still_compute():
    # x / 1e-45 overflows to infinity on the way, and tanh saturates it to the cap's sign: no NaN.
    with np.errstate(over="ignore"):
        assert np.all(np.isfinite(softcap(GATE, 1e-45)))
        assert np.all(np.isfinite(situ_glu(GATE, UP, beta=1e-45, linear_beta=3e38)))
    assert np.all(np.isfinite(rms_norm(ROWS, np.ones(4, np.float32), eps=1e-45)))


def test_a_fraction_cap_computes_as_its_float():
    # The checked cap is the Python float the arithmetic uses (a Fraction stopped NumPy's tanh before).
    np.testing.assert_array_equal(situ_glu(GATE, UP, beta=Fraction(4), linear_beta=Fraction(25)),
                                  situ_glu(GATE, UP, beta=4.0, linear_beta=25.0))
    np.testing.assert_array_equal(rms_norm(ROWS, np.ones(4, np.float32), eps=Fraction(1, 10**5)),
                                  rms_norm(ROWS, np.ones(4, np.float32), eps=1e-5))


# ---------------------------------------------------------------------------
# Routing: renormalized weights refuse negative scores; mixture_weights checks raw
# ---------------------------------------------------------------------------

def test_route_refuses_a_negative_score_it_would_renormalize():
    # 0.5 and -0.4999 are chosen: their sum 1e-4 made the weights +5000.66 and -4999.66.
    scores = np.array([[0.5, -0.4999, -0.9, -0.9]], np.float32)
    with pytest.raises(ValueError, match=r"^scores must be >= 0 to be renormalized \(router scores: sigmoid, softmax "
                                         r"and sqrtsoftplus give no negative value\), got 3 negative entries "
                                         r"\(the smallest -0.9\)"):
        route(scores, np.zeros(4, np.float32), 2)


def test_all_chosen_scores_negative_is_named_as_negative_not_as_underflow():
    scores = np.array([[-0.1, -0.2, 0.0, -0.4]])
    with pytest.raises(ValueError, match=r"^scores must be >= 0 to be renormalized .* got 3 negative entries"):
        route(scores, np.zeros(4), 2)


def test_route_without_renormalizing_still_selects_by_any_finite_values():
    # The testing kit's mistakes select by the logits (z + b) this way and keep only the index.
    logits = np.array([[-0.3, 1.2, -2.0, 0.4], [-1.0, -0.5, -3.0, -0.7]])
    index, weights = route(logits, np.zeros(4), 2, renormalize=False, scaling_factor=2.0)
    np.testing.assert_array_equal(index, [[1, 3], [1, 3]])
    np.testing.assert_array_equal(weights, 2.0 * np.take_along_axis(logits, index, axis=1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("score_function", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_every_score_function_gives_scores_route_accepts(score_function, dtype):
    logits = np.concatenate([np.linspace(-1e4, 1e4, 41), [-200.0, -105.0, -88.0, 0.0, 88.0]]).astype(dtype)
    scores = score_function_values(np.stack([logits, logits[::-1]]), score_function)
    assert scores.min() >= 0 and np.all(np.isfinite(scores))
    route(scores, np.zeros(scores.shape[1], dtype), 3, renormalize=False)  # no refusal for real scores


@pytest.mark.parametrize(("raw", "error", "message"), [
    (np.array(0.5), ValueError, r"^raw must have 2 dimensions, got shape \(\)"),
    (np.array([0.2, 0.3]), ValueError, r"^raw must have 2 dimensions, got shape \(2,\)"),
    ([[0.1, 0.2]], TypeError, r"^raw must be an array, got list"),
    (np.array([[True, False]]), TypeError, r"^raw must be a real floating array .* got dtype bool"),
    (np.array([[1, 2]]), TypeError, r"^raw must be a real floating array .* got dtype int64"),
    (np.array([[np.inf, 0.2]]), ValueError, r"^raw must be finite, got 1 non-finite entries"),
    (np.array([[np.nan, 0.2]]), ValueError, r"^raw must be finite, got 1 non-finite entries"),
    (np.array([[-1.0, 2.0]]), ValueError, r"^raw must be >= 0 to be renormalized \(the scores of each token's "
                                          r"chosen experts\), got 1 negative entry \(the smallest -1\)"),
    (np.array([[3e38, 3e38]], np.float32), ValueError, r"^raw must have a sum within float32's range for every "
                                                       r"token to be renormalized, got an infinite sum for 1 token"),
])
def test_mixture_weights_checks_its_raw_scores(raw, error, message):
    with pytest.raises(error, match=message):
        mixture_weights(raw)


def test_mixture_weights_of_good_scores_is_unchanged():
    raw = np.array([[0.2, 0.6], [0.0, 0.5]])
    np.testing.assert_allclose(mixture_weights(raw, scaling_factor=2.0), [[0.5, 1.5], [0.0, 2.0]], rtol=1e-15)
    np.testing.assert_array_equal(mixture_weights(raw, renormalize=False, scaling_factor=2.0), 2.0 * raw)
    with pytest.raises(ValueError, match=r"got a sum of 0 for 1 token\(s\) \(the scores underflowed\)"):
        mixture_weights(np.array([[0.0, 0.0], [0.1, 0.2]]))


# ---------------------------------------------------------------------------
# init_params(bias_scale=...)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0.1", True, np.True_, None, 1j, [0.1]])
def test_a_bias_scale_that_is_no_real_number_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"^bias_scale must be a real number >= 0 \(the router bias's standard "
                                        r"deviation\), got "):
        init_params(MoEConfig.tiny(), 0, bias_scale=value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -0.1, 10**400])
def test_a_bias_scale_that_is_not_finite_and_non_negative_is_refused(value):
    with pytest.raises(ValueError, match=r"^bias_scale must be a finite number >= 0"):
        init_params(MoEConfig.tiny(), 0, bias_scale=value)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_a_bias_scale_beyond_the_bias_dtype_is_refused(dtype):
    # Half weights keep a float32 bias, so float32's range is the one that counts for them too.
    with pytest.raises(ValueError, match=r"^bias_scale must keep the router bias within float32's range \(at most "
                                         r"3.4028235e\+38\), got 1e\+300, which makes 6 of its 6 entries infinite"):
        init_params(MoEConfig.tiny(), 0, dtype=dtype, bias_scale=1e300)


def test_good_bias_scales_give_the_bias_they_always_gave():
    biases = [init_params(MoEConfig.tiny(), 0, bias_scale=value)["gate.e_score_correction_bias"]
              for value in (0.05, np.float64(0.05), Fraction(1, 20))]
    for bias in biases[1:]:
        np.testing.assert_array_equal(bias, biases[0])
    assert biases[0].dtype == np.float32 and np.all(np.isfinite(biases[0])) and np.any(biases[0] != 0)
    assert np.all(init_params(MoEConfig.tiny(), 0, bias_scale=0)["gate.e_score_correction_bias"] == 0)
    wide = init_params(MoEConfig.tiny(), 0, dtype=np.float64, bias_scale=1e300)["gate.e_score_correction_bias"]
    assert wide.dtype == np.float64 and np.all(np.isfinite(wide))


# ---------------------------------------------------------------------------
# MX element helpers: integer codes in range, or an error naming them
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("scale", "error", "message"), [
    (np.array([256, -1, 1.7]), TypeError, r"^scale must be an array of E8M0 scale bytes \(uint8, or integers in "
                                          r"\[0, 255\]\), got dtype float64"),
    (np.array([1.0]), TypeError, r"got dtype float64"),
    (np.array([True]), TypeError, r"got dtype bool"),
    (np.array([256]), ValueError, r"^scale must hold E8M0 scale bytes in \[0, 255\], got 1 value\(s\) outside it "
                                  r"\(values in \[256, 256\]\)"),
    (np.array([127, -1]), ValueError, r"^scale must hold E8M0 scale bytes in \[0, 255\], got 1 value\(s\) outside "
                                      r"it \(values in \[-1, 127\]\)"),
])
def test_e8m0_decode_refuses_what_is_no_scale_byte(scale, error, message):
    with pytest.raises(error, match=message):
        e8m0_decode(scale)


@pytest.mark.parametrize(("codes", "error", "message"), [
    (np.array([16]), ValueError, r"^codes must hold 4-bit E2M1 codes in \[0, 15\], got 1 value\(s\) outside it "
                                 r"\(values in \[16, 16\]\)"),
    (np.array([3, 255], np.uint8), ValueError, r"^codes must hold 4-bit E2M1 codes in \[0, 15\], got 1 value"),
    (np.array([-1]), ValueError, r"^codes must hold 4-bit E2M1 codes in \[0, 15\]"),
    (np.array([1.0]), TypeError, r"^codes must be an array of 4-bit E2M1 codes .* got dtype float64"),
    (np.array([False]), TypeError, r"got dtype bool"),
])
def test_e2m1_decode_refuses_what_is_no_code(codes, error, message):
    with pytest.raises(error, match=message):
        e2m1_decode(codes)


def test_the_mx_helpers_decode_every_code_as_before():
    np.testing.assert_array_equal(e2m1_decode(np.arange(16, dtype=np.uint8)), E2M1_VALUES)
    np.testing.assert_array_equal(e2m1_decode(np.arange(16, dtype=np.int64)), E2M1_VALUES)
    decoded = e8m0_decode(np.array([0, 127, 254], np.int64))
    np.testing.assert_array_equal(decoded, np.array([2.0**-127, 1.0, 2.0**127], np.float32))
    assert decoded.dtype == np.float32
    every = e8m0_decode(np.arange(256, dtype=np.uint8))
    assert np.isnan(every[255]) and np.array_equal(every[:255], np.ldexp(np.float32(1), np.arange(255) - 127))
