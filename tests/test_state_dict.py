"""Tests of `refimpl.checkpoints.state_dict`: one block's weights to and from Hugging Face tensor names.

The independent side is the reference block written as PyTorch modules
(`tests/hf_reference_block.py`): its own `state_dict()` gives the names, its
`load_state_dict(strict=True)` judges what `hf_state_dict_from_params` writes, and
its forward pass must equal `stable_latent_moe` on the converted weights. MXFP4
experts are decoded by compressed-tensors, not by `refimpl.mx`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch
from hf_reference_block import KimiSparseMoeBlock, decode_mxfp4_pairs, to_torch

import refimpl
from refimpl import MoEConfig, hf_state_dict_from_params, init_params, params_from_hf_state_dict
from refimpl.checkpoints import ExpertStack
from refimpl.checkpoints.state_dict import as_numpy, hf_tensor_shapes

# Text configs of the reference code: K3's switches, no latent, latent without norm, no shared experts.
TEXTS = {
    "k3": dict(hidden_size=16, routed_expert_hidden_size=8, latent_moe_use_norm=True, num_experts=4,
               num_experts_per_token=2, moe_intermediate_size=6, num_shared_experts=2, hidden_act="situ",
               activation_situ_beta=4.0, activation_situ_linear_beta=25.0, rms_norm_eps=1e-5),
    "no_latent": dict(hidden_size=8, num_experts=3, num_experts_per_token=1, moe_intermediate_size=4,
                      num_shared_experts=1, hidden_act="silu"),
    "no_norm": dict(hidden_size=8, routed_expert_hidden_size=4, num_experts=3, num_experts_per_token=2,
                    moe_intermediate_size=4, num_shared_experts=0, hidden_act="situ"),
}

# MXFP4 needs latent and expert widths that are multiples of 32.
MX_TEXT = dict(hidden_size=64, routed_expert_hidden_size=32, latent_moe_use_norm=True, num_experts=3,
               num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1, hidden_act="situ",
               activation_situ_beta=4.0, activation_situ_linear_beta=25.0)


def _params(text: dict, seed: int = 0):
    config = MoEConfig.from_hf_config(text)
    return config, init_params(config, seed, bias_scale=0.1)


def _assert_params_equal(a, b) -> None:
    assert list(a) == list(b)
    for name in a:
        if isinstance(a[name], ExpertStack) or isinstance(b[name], ExpertStack):
            for e in range(len(a[name])):
                np.testing.assert_array_equal(np.asarray(a[name][e]), np.asarray(b[name][e]), err_msg=name)
        else:
            assert np.asarray(a[name]).shape == np.asarray(b[name]).shape, name
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def _reference_module(text: dict, state_dict: dict) -> KimiSparseMoeBlock:
    block = KimiSparseMoeBlock(text)
    block.load_state_dict({k: to_torch(v) for k, v in state_dict.items()}, strict=True)
    return block


# ---------------------------------------------------------------------------
# The names are the reference block's
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_names_and_shapes_are_the_reference_blocks(kind):
    text = TEXTS[kind]
    config = MoEConfig.from_hf_config(text)
    block = KimiSparseMoeBlock(text)
    expected = {name: tuple(t.shape) for name, t in block.state_dict().items()}
    assert hf_tensor_shapes(config) == expected


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_block_relative_output_loads_strictly_and_computes_the_same_layer(kind):
    text = TEXTS[kind]
    config, params = _params(text)
    state_dict = hf_state_dict_from_params(params, config)
    block = _reference_module(text, state_dict)  # strict=True: no name missing, none extra
    x = np.random.default_rng(1).standard_normal((7, config.d)).astype(np.float32)
    with torch.no_grad():
        theirs = block(torch.from_numpy(x)).numpy()
    ours = refimpl.stable_latent_moe(x, params, config)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_a_modules_own_state_dict_is_read(kind):
    """The porter's path: their module's state_dict() straight in, the reference's answer out."""
    text = TEXTS[kind]
    config = MoEConfig.from_hf_config(text)
    torch.manual_seed(3)
    block = KimiSparseMoeBlock(text)
    with torch.no_grad():
        block.gate.e_score_correction_bias.normal_(0.0, 0.1)
        for p in block.parameters():
            p.normal_(0.0, 0.4)
    params = params_from_hf_state_dict(block.state_dict(), config)
    x = torch.randn(6, config.d)
    with torch.no_grad():
        theirs = block(x).numpy()
    ours = refimpl.stable_latent_moe(x.numpy(), params, config)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


# ---------------------------------------------------------------------------
# Round trips, from every kind of value
# ---------------------------------------------------------------------------

def test_round_trip_numpy_is_exact():
    config, params = _params(TEXTS["k3"])
    back = params_from_hf_state_dict(hf_state_dict_from_params(params, config), config)
    _assert_params_equal(back, params)
    assert all(np.asarray(v).dtype == np.float32 for v in back.values())


def test_float64_stays_float64_and_dtype_chooses():
    config = MoEConfig.from_hf_config(TEXTS["k3"])
    params = init_params(config, 0, dtype=np.float64, bias_scale=0.1)
    state_dict = hf_state_dict_from_params(params, config)
    back = params_from_hf_state_dict(state_dict, config)
    _assert_params_equal(back, params)
    assert back["experts.w1"].dtype == np.float64
    half = params_from_hf_state_dict(state_dict, config, dtype=np.float16)
    assert half["gate.weight"].dtype == np.float16
    assert half["gate.e_score_correction_bias"].dtype == np.float32  # the bias never below float32


def test_round_trip_torch_float32():
    config, params = _params(TEXTS["k3"])
    tensors = {k: torch.from_numpy(v) for k, v in hf_state_dict_from_params(params, config).items()}
    _assert_params_equal(params_from_hf_state_dict(tensors, config), params)


def test_torch_bfloat16_is_read_bit_for_bit():
    config, params = _params(TEXTS["k3"])
    tensors = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in hf_state_dict_from_params(params, config).items()}
    back = params_from_hf_state_dict(tensors, config)
    for name, t in tensors.items():
        ours = back[name] if not name.startswith("experts.") else None
        if ours is not None:
            np.testing.assert_array_equal(ours, t.float().numpy())  # PyTorch's own widening
    e, module = 2, "w3"
    np.testing.assert_array_equal(back["experts.w3"][e], tensors[f"experts.{e}.{module}.weight"].float().numpy())
    assert back["gate.weight"].dtype == np.float32
    # The same values as ml_dtypes bfloat16 arrays round-trip too.
    again = hf_state_dict_from_params(back, config)
    np.testing.assert_array_equal(again["gate.weight"], tensors["gate.weight"].float().numpy())


def test_tensors_that_require_grad():
    config, params = _params(TEXTS["no_norm"])
    tensors = {k: torch.from_numpy(v.copy()).requires_grad_(True)
               for k, v in hf_state_dict_from_params(params, config).items()}
    back = params_from_hf_state_dict(tensors, config)
    _assert_params_equal(back, params)
    # The result is a copy: training the tensors afterwards does not change it.
    with torch.no_grad():
        tensors["gate.weight"].add_(1.0)
    np.testing.assert_array_equal(back["gate.weight"], params["gate.weight"])


class _DLPackOnly:
    """A tensor known only through DLPack (no __array__), as some frameworks hand them out."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __dlpack__(self, **kwargs):
        return self._tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


def test_dlpack_only_values():
    config, params = _params(TEXTS["k3"])
    values = {k: _DLPackOnly(torch.from_numpy(v)) for k, v in hf_state_dict_from_params(params, config).items()}
    assert not hasattr(next(iter(values.values())), "__array__")
    _assert_params_equal(params_from_hf_state_dict(values, config), params)


def test_dlpack_bfloat16_goes_through_pytorch_when_loaded():
    t = torch.randn(3, 4).to(torch.bfloat16)
    np.testing.assert_array_equal(as_numpy(_DLPackOnly(t), "w").astype(np.float32), t.float().numpy())


class _ArrayOnly:
    """A value known only through __array__ (as JAX and TensorFlow arrays are to NumPy)."""

    def __init__(self, a: np.ndarray):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


def test_array_protocol_values():
    config, params = _params(TEXTS["no_latent"])
    values = {k: _ArrayOnly(v) for k, v in hf_state_dict_from_params(params, config).items()}
    _assert_params_equal(params_from_hf_state_dict(values, config), params)


def test_full_names_with_a_layer_and_a_prefix_ignore_the_rest_of_the_model():
    config, params = _params(TEXTS["k3"])
    full = hf_state_dict_from_params(params, config, layer=5, prefix="language_model.")
    assert all(k.startswith("language_model.model.layers.5.block_sparse_moe.") for k in full)
    assert "language_model.model.layers.5.block_sparse_moe.experts.3.w2.weight" in full
    # A whole model: other layers, attention, embeddings are not the block's business.
    model = dict(full)
    other = hf_state_dict_from_params(init_params(config, 9), config, layer=6, prefix="language_model.")
    model.update(other)
    model["language_model.model.embed_tokens.weight"] = np.zeros((3, config.d), np.float32)
    model["language_model.model.layers.5.self_attn.q_proj.weight"] = np.zeros((2, 2), np.float32)
    _assert_params_equal(params_from_hf_state_dict(model, config, layer=5, prefix="language_model."), params)
    # The same with no prefix, as text-only exports have it.
    bare = hf_state_dict_from_params(params, config, layer=2)
    assert "model.layers.2.block_sparse_moe.gate.weight" in bare
    _assert_params_equal(params_from_hf_state_dict(bare, config, layer=2), params)
    # Without a layer, a prefix stands before the block-relative names.
    held = hf_state_dict_from_params(params, config, prefix="mlp.")
    assert "mlp.gate.weight" in held
    _assert_params_equal(params_from_hf_state_dict(held, config, prefix="mlp."), params)


# ---------------------------------------------------------------------------
# MXFP4 stays packed
# ---------------------------------------------------------------------------

def test_packed_mxfp4_stays_packed_and_round_trips_byte_for_byte():
    config, params = _params(MX_TEXT)
    packed = hf_state_dict_from_params(params, config, layer=1, prefix="language_model.", mxfp4=True)
    base = "language_model.model.layers.1.block_sparse_moe."
    assert f"{base}experts.0.w1.weight_packed" in packed and f"{base}experts.0.w1.weight" not in packed
    assert packed[f"{base}experts.0.w1.weight_packed"].shape == (config.f, config.ell // 2)
    assert packed[f"{base}experts.0.w2.weight_scale"].shape == (config.ell, config.f // 32)
    tensors = {k: torch.from_numpy(v) for k, v in packed.items()}
    back = params_from_hf_state_dict(tensors, config, layer=1, prefix="language_model.")
    for stack in ("experts.w1", "experts.w3", "experts.w2"):
        assert isinstance(back[stack], ExpertStack) and back[stack].format == "mxfp4"
    # Decoded by compressed-tensors, independently of refimpl.mx.
    decoded = decode_mxfp4_pairs({k[len(base):]: v for k, v in packed.items()}, frozenset())
    for e in range(config.n):
        np.testing.assert_array_equal(back["experts.w3"][e], decoded[f"experts.{e}.w3.weight"].numpy())
    again = hf_state_dict_from_params(back, config, layer=1, prefix="language_model.", mxfp4=True)
    assert sorted(again) == sorted(packed)
    for name in packed:
        np.testing.assert_array_equal(again[name], packed[name], err_msg=name)
    # Written unpacked, the stack decodes; the reference block loads it strictly.
    dense = hf_state_dict_from_params(back, config)
    _reference_module(MX_TEXT, dense)


def test_mxfp4_needs_widths_that_are_multiples_of_32():
    config, params = _params(TEXTS["k3"])
    with pytest.raises(ValueError, match="multiples of 32"):
        hf_state_dict_from_params(params, config, mxfp4=True)


# ---------------------------------------------------------------------------
# NumPy input never imports PyTorch
# ---------------------------------------------------------------------------

def test_numpy_input_never_imports_torch():
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import refimpl
        config = refimpl.MoEConfig.tiny()
        params = refimpl.init_params(config, 0, bias_scale=0.1)
        state_dict = refimpl.hf_state_dict_from_params(params, config, layer=1, mxfp4=False)
        back = refimpl.params_from_hf_state_dict(state_dict, config, layer=1)
        assert np.array_equal(back["experts.w2"], params["experts.w2"])
        import refimpl.testing  # the kit, its check and its catalogue do not need PyTorch either
        case = refimpl.testing.hf_block_case({"hidden_size": 4, "num_experts": 2, "num_experts_per_token": 1,
                                              "moe_intermediate_size": 2}, seed=0)
        assert case.state_dict["gate.weight"].shape == (2, 4)
        assert "torch" not in sys.modules, "torch was imported"
        print("no torch")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no torch" in out.stdout


# ---------------------------------------------------------------------------
# Bad input: every problem in one error
# ---------------------------------------------------------------------------

def test_missing_extra_and_misshapen_tensors_are_listed_together():
    config, params = _params(TEXTS["k3"])
    state_dict = hf_state_dict_from_params(params, config)
    del state_dict["gate.e_score_correction_bias"]
    for e in (0, 1, 3):
        del state_dict[f"experts.{e}.w2.weight"]
    state_dict["experts.0.w4.weight"] = np.zeros((2, 2), np.float32)
    state_dict["router.weight"] = np.zeros((2, 2), np.float32)
    state_dict["routed_expert_norm.weight"] = np.ones(config.d, np.float32)  # sized by hidden_size
    state_dict["experts.2.w1.weight"] = np.zeros((config.f, config.ell), np.int32)
    with pytest.raises(ValueError) as info:
        params_from_hf_state_dict(state_dict, config)
    message = str(info.value)
    assert "missing (4): gate.e_score_correction_bias, experts.{0-1,3}.w2.weight" in message
    assert "not in the block (2): router.weight, experts.0.w4.weight" in message
    assert f"routed_expert_norm.weight: expected floating [{config.ell}], got float32 [{config.d}]" in message
    assert "sized by hidden_size instead of the latent width" in message
    assert "experts.2.w1.weight: expected floating" in message and "got int32" in message


def test_whole_layers_of_misnamed_experts_give_a_short_message():
    config = MoEConfig.from_hf_config(dict(TEXTS["no_latent"], num_experts=64))
    state_dict = hf_state_dict_from_params(init_params(config, 0), config)
    renamed = {k.replace(".w1.", ".gate_proj."): v for k, v in state_dict.items()}
    with pytest.raises(ValueError) as info:
        params_from_hf_state_dict(renamed, config)
    message = str(info.value)
    assert "missing (64): experts.{0-63}.w1.weight" in message
    assert "not in the block (64): experts.{0-63}.gate_proj.weight" in message
    assert len(message) < 400


def test_mixed_and_doubled_expert_storage_is_refused():
    config, params = _params(MX_TEXT)
    packed = hf_state_dict_from_params(params, config, mxfp4=True)
    dense = hf_state_dict_from_params(params, config)
    both = dict(packed, **{"experts.1.w1.weight": dense["experts.1.w1.weight"]})
    with pytest.raises(ValueError, match=r"experts\.1\.w1: given both as \.weight and as MXFP4"):
        params_from_hf_state_dict(both, config)
    mixed = dict(packed)
    del mixed["experts.0.w2.weight_packed"], mixed["experts.0.w2.weight_scale"]
    mixed["experts.0.w2.weight"] = dense["experts.0.w2.weight"]
    with pytest.raises(ValueError, match=r"experts\.\*\.w2: 1 experts stored as \.weight and 2 as MXFP4"):
        params_from_hf_state_dict(mixed, config)
    half = dict(packed)
    del half["experts.2.w3.weight_scale"]
    half["experts.2.w1.weight_packed"] = half["experts.2.w1.weight_packed"].astype(np.float32)
    with pytest.raises(ValueError) as info:
        params_from_hf_state_dict(half, config)
    assert "missing (1): experts.2.w3.weight_scale" in str(info.value)
    assert "experts.2.w1.weight_packed: expected uint8 (MXFP4 bytes)" in str(info.value)


def test_bad_arguments_are_named():
    config, params = _params(TEXTS["k3"])
    state_dict = hf_state_dict_from_params(params, config)
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        params_from_hf_state_dict(list(state_dict.items()), config)
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        params_from_hf_state_dict(state_dict, TEXTS["k3"])
    with pytest.raises(TypeError, match="tensor 'gate.weight' must be an array"):
        params_from_hf_state_dict(dict(state_dict, **{"gate.weight": [[1.0]]}), config)
    with pytest.raises(ValueError, match="layer must be None"):
        params_from_hf_state_dict(state_dict, config, layer=-1)
    with pytest.raises(TypeError, match="prefix must be a string"):
        hf_state_dict_from_params(params, config, prefix=None)


def test_bfloat16_numpy_arrays_are_widened_exactly():
    config, params = _params(TEXTS["no_norm"])
    state_dict = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_state_dict_from_params(params, config).items()}
    back = params_from_hf_state_dict(state_dict, config)
    np.testing.assert_array_equal(back["experts.w1"][1], state_dict["experts.1.w1.weight"].astype(np.float32))
    assert back["gate.e_score_correction_bias"].dtype == np.float32


def test_a_null_shared_count_builds_no_module_and_the_writers_zero_element_tensors_are_all_it_lacks():
    """`num_shared_experts: null` builds no shared module in K3's code (0 builds a width-0 one). A
    `MoEConfig` holds 0 either way, so the writer writes the width-0 module's zero-element tensors; they hold
    nothing, and leaving them out gives exactly the null block's `state_dict()`, which the reader reads too."""
    text = dict(TEXTS["no_norm"], num_shared_experts=None)
    config, params = _params(text)
    written = hf_state_dict_from_params(params, config)
    shared = {name for name in written if name.startswith("shared_experts.")}
    assert shared and all(written[name].size == 0 for name in shared)
    without = {name: value for name, value in written.items() if name not in shared}
    block = _reference_module(text, without)  # strict=True: no shared module, nothing missing or left over
    assert set(block.state_dict()) == set(without)
    _assert_params_equal(params_from_hf_state_dict(without, config), params)


@pytest.mark.parametrize("shared", [None, 0])
def test_a_width_zero_shared_mlp_is_written_and_read_either_way(shared):
    """With no shared experts the reference module still holds its width-0 MLP: zero-element tensors, which the
    converters write (so a strict load succeeds) and read, present or left out."""
    text = {"hidden_size": 16, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 8,
            **({} if shared is None else {"num_shared_experts": shared})}
    config = MoEConfig.from_hf_config(text)
    params = init_params(config, 0)
    written = hf_state_dict_from_params(params, config)
    assert {name: written[name].shape for name in written if name.startswith("shared_experts.")} == {
        "shared_experts.gate_proj.weight": (0, 16), "shared_experts.up_proj.weight": (0, 16),
        "shared_experts.down_proj.weight": (16, 0)}
    _reference_module(text, written)  # strict=True
    without = {name: value for name, value in written.items() if not name.startswith("shared_experts.")}
    for state_dict in (written, without, {k: to_torch(v) for k, v in written.items()}):
        read = params_from_hf_state_dict(state_dict, config)
        assert read.keys() == params.keys()
        assert read["shared_experts.down_proj.weight"].shape == (16, 0)
    # A shared tensor that is not zero-element, when the configuration has none, is still refused.
    wrong = dict(written, **{"shared_experts.gate_proj.weight": np.zeros((8, 16), np.float32)})
    with pytest.raises(ValueError, match=r"shared_experts.gate_proj.weight: expected floating \[0, 16\]"):
        params_from_hf_state_dict(wrong, config)
