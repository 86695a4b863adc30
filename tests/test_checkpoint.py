"""Tests of `refimpl.checkpoints.hf_checkpoint` and of the configuration semantics of the reference modeling code.

The oracle is a transcription, in PyTorch, of the reference code's `KimiMoEGate` and
`KimiSparseMoeBlock` (one module per expert, its own gate, its own SiTU, its own RMSNorm),
fed from the raw configuration keys. It shares nothing with `refimpl` but the weights.
Checkpoints are read back with the `safetensors` library and MXFP4 experts decoded with
compressed-tensors, independently of `refimpl.checkpoints.hf_checkpoint` and `refimpl.mx`.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors import safe_open

from refimpl import MoEConfig, init_params, stable_latent_moe
from refimpl.checkpoints import ExpertStack, load_hf_layer, save_hf_layer
from refimpl.layer.latent_moe import parameter_shapes
from refimpl.mx import mxfp4_decode

# ---------------------------------------------------------------------------
# The reference block, transcribed
# ---------------------------------------------------------------------------


def reference_block(text: dict, tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The reference `KimiSparseMoeBlock.forward` (inference) for one layer, from the config keys.

    `tensors` uses the checkpoint's module names relative to `block_sparse_moe.`, one
    module per expert (`experts.{e}.w1.weight`, ...), all floating point.
    """
    n, top_k = text["num_experts"], text["num_experts_per_token"]
    # KimiMoEGate: float32 logits, sigmoid, biased choice, weights from raw scores.
    scores = torch.sigmoid(x.float() @ tensors["gate.weight"].float().T)  # [m, n]
    choice = scores + tensors["gate.e_score_correction_bias"].float()[None, :]
    groups, keep_groups = text.get("num_expert_group", 1), text.get("topk_group", 1)
    if groups > 1 and groups > keep_groups:
        group_score = choice.view(len(x), groups, -1).topk(2, dim=-1).values.sum(-1)  # [m, G]
        chosen = group_score.topk(keep_groups, dim=-1).indices
        mask = torch.zeros_like(group_score).scatter_(1, chosen, 1.0).bool()
        mask = mask[:, :, None].expand(len(x), groups, n // groups).reshape(len(x), n)
        choice = choice.masked_fill(~mask, float("-inf"))
    idx = torch.topk(choice, top_k, dim=-1).indices  # [m, k]
    weight = scores.gather(1, idx)
    if top_k > 1 and text.get("moe_renormalize", True):
        weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
    weight = weight * text.get("routed_scaling_factor", 1.0)

    beta = text.get("activation_situ_beta") or 1.0
    linear_beta = text.get("activation_situ_linear_beta")

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if text.get("hidden_act", "silu") == "situ":
            g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
            if linear_beta is not None:
                up = linear_beta * torch.tanh(up / linear_beta)
            return g * up
        return torch.nn.functional.silu(gate) * up

    latent = text.get("routed_expert_hidden_size") is not None
    h = x @ tensors["routed_expert_down_proj.weight"].T if latent else x
    y = torch.zeros_like(h)
    for e in range(n):
        token, slot = torch.nonzero(idx == e, as_tuple=True)
        if len(token) == 0:
            continue
        z = h[token]
        out = act(z @ tensors[f"experts.{e}.w1.weight"].T, z @ tensors[f"experts.{e}.w3.weight"].T)
        out = out @ tensors[f"experts.{e}.w2.weight"].T
        y.index_add_(0, token, out * weight[token, slot, None])
    if latent:
        if text.get("latent_moe_use_norm", False):
            eps = text.get("rms_norm_eps", 1e-6)
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * tensors["routed_expert_norm.weight"]
        y = y @ tensors["routed_expert_up_proj.weight"].T
    if text.get("num_shared_experts", 0) is not None and text.get("num_shared_experts", 0) > 0:
        shared = act(x @ tensors["shared_experts.gate_proj.weight"].T, x @ tensors["shared_experts.up_proj.weight"].T)
        y = y + shared @ tensors["shared_experts.down_proj.weight"].T
    return y


def per_expert(params) -> dict[str, torch.Tensor]:
    """`MoEParams` (stacked) as the reference's per-expert module names, float32 torch tensors."""
    out = {}
    for name, value in params.items():
        if name.startswith("experts."):
            for e in range(len(value)):
                out[f"experts.{e}.{name.split('.')[1]}.weight"] = torch.from_numpy(np.asarray(value[e], np.float32))
        else:
            out[name] = torch.from_numpy(np.asarray(value, np.float32))
    return out


def _compare(text: dict, seed: int = 0, m: int = 12, bias_scale: float = 0.05) -> float:
    config = MoEConfig.from_hf_config(text)
    params = init_params(config, seed, bias_scale=bias_scale)
    x = np.random.default_rng(seed + 100).standard_normal((m, config.d)).astype(np.float32)
    ours = stable_latent_moe(x, params, config)
    theirs = reference_block(text, per_expert(params), torch.from_numpy(x)).numpy()
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


BASE = {"hidden_size": 16, "num_experts": 6, "num_experts_per_token": 2, "moe_intermediate_size": 8}


# ---------------------------------------------------------------------------
# The configuration cases of the reference code
# ---------------------------------------------------------------------------

def test_k3_style_keys_agree_with_the_reference():
    text = dict(BASE, routed_expert_hidden_size=8, latent_moe_use_norm=True, num_shared_experts=2,
                activation_situ_beta=4.0, activation_situ_linear_beta=25.0, hidden_act="situ",
                rms_norm_eps=1e-5, moe_renormalize=True, routed_scaling_factor=1.0)
    assert _compare(text) < 1e-5


def test_top1_without_renormalization_agrees_with_the_reference():
    # top_k = 1, norm off, scaling 2.5: the reference keeps the raw score of the single expert.
    text = dict(BASE, num_experts_per_token=1, routed_expert_hidden_size=8, latent_moe_use_norm=False,
                routed_scaling_factor=2.5, moe_renormalize=True, hidden_act="situ",
                activation_situ_beta=4.0, activation_situ_linear_beta=25.0, num_shared_experts=1)
    assert MoEConfig.from_hf_config(text).renormalize is False
    assert _compare(text) < 1e-5


def test_absent_latent_keys_agree_with_the_reference():
    # Kimi Linear's style: no routed_expert_hidden_size, no latent_moe_use_norm.
    text = dict(BASE, num_shared_experts=1, hidden_act="situ", activation_situ_beta=4.0,
                activation_situ_linear_beta=25.0)
    config = MoEConfig.from_hf_config(text)
    assert (config.use_latent_projection, config.use_latent_norm) == (False, False)
    assert _compare(text) < 1e-5


def test_latent_without_norm_key_has_no_norm():
    text = dict(BASE, routed_expert_hidden_size=8, hidden_act="situ")
    assert MoEConfig.from_hf_config(text).use_latent_norm is False
    assert _compare(text) < 1e-5


def test_absent_betas_agree_with_the_reference():
    text = dict(BASE, routed_expert_hidden_size=8, latent_moe_use_norm=True, hidden_act="situ",
                num_shared_experts=1)
    config = MoEConfig.from_hf_config(text)
    assert (config.situ_beta, config.situ_linear_beta) == (1.0, None)
    # Large inputs, where the uncapped up branch and beta = 1 matter.
    assert _compare(text, m=16) < 1e-5


def test_null_shared_experts_agree_with_the_reference():
    text = dict(BASE, routed_expert_hidden_size=8, latent_moe_use_norm=True, hidden_act="silu",
                num_shared_experts=None)
    config = MoEConfig.from_hf_config(text)
    assert config.num_shared_experts == 0 and config.activation == "swiglu"
    assert _compare(text) < 1e-5


def test_grouped_routing_agrees_with_the_reference():
    text = dict(BASE, num_experts=8, num_experts_per_token=3, num_expert_group=4, topk_group=2,
                routed_expert_hidden_size=8, latent_moe_use_norm=True, hidden_act="situ",
                activation_situ_beta=4.0, activation_situ_linear_beta=25.0)
    assert _compare(text, bias_scale=0.2) < 1e-5


def test_the_old_reading_of_top1_would_differ():
    # The check above can fail: renormalizing the single weight (the old reading) is far off.
    text = dict(BASE, num_experts_per_token=1, routed_expert_hidden_size=8, latent_moe_use_norm=False,
                routed_scaling_factor=2.5, hidden_act="situ")
    config = MoEConfig.from_hf_config(text).replace(renormalize=True)
    params = init_params(config, 0)
    x = np.random.default_rng(100).standard_normal((12, config.d)).astype(np.float32)
    theirs = reference_block(text, per_expert(params), torch.from_numpy(x)).numpy()
    ours = stable_latent_moe(x, params, config)
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) > 0.05


# ---------------------------------------------------------------------------
# Tiny checkpoints: writing, reading back, the reference on the stored bytes
# ---------------------------------------------------------------------------

TINY = MoEConfig(hidden_size=64, latent_size=32, num_experts=4, top_k=2, intermediate_size=64,
                 num_shared_experts=1, num_moe_layers=2)


def _read_with_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, read by the safetensors library (not by refimpl)."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for file in files:
        with safe_open(path / file, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = t
    return out


def _ct_expert(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    weights = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                               scale_dtype=torch.uint8)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]


@pytest.mark.parametrize("prefix", ["language_model.", ""])
@pytest.mark.parametrize("shard_size", [None, 40_000])
def test_saved_layer_matches_the_reference_on_its_bytes(tmp_path, prefix, shard_size):
    params = init_params(TINY, 1, bias_scale=0.1)
    save_hf_layer(tmp_path, TINY, params, layer=2, prefix=prefix, shard_size=shard_size)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_size is not None)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "kimi_k3" and hf["text_config"]["model_type"] == "kimi_linear"
    assert hf["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"

    # The reference side: safetensors reads the files, compressed-tensors decodes the experts.
    stored = _read_with_safetensors(tmp_path)
    base = f"{prefix}model.layers.2.block_sparse_moe."
    assert all(k.startswith(base) for k in stored)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in stored.items():
        name = key[len(base):]
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            tensors[module + ".weight"] = _ct_expert(t, stored[base + module + ".weight_scale"]).float()
        elif not name.endswith(".weight_scale"):
            tensors[name] = t.float()
    assert len([k for k in stored if k.endswith("weight_packed")]) == 3 * TINY.n

    config, loaded = load_hf_layer(tmp_path, 2)
    assert config == TINY
    assert list(loaded) == list(parameter_shapes(TINY))
    assert isinstance(loaded["experts.w1"], ExpertStack) and loaded["experts.w1"].format == "mxfp4"
    x = np.random.default_rng(2).standard_normal((10, TINY.d)).astype(np.float32)
    ours = stable_latent_moe(x, loaded, config)
    theirs = reference_block(hf["text_config"], tensors, torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


def test_round_trip_unquantized_is_exact(tmp_path):
    params = init_params(TINY, 3, bias_scale=0.1)
    save_hf_layer(tmp_path, TINY, params, layer=1, mxfp4=False, prefix="")
    config, loaded = load_hf_layer(tmp_path, 1)
    assert config == TINY
    for name, value in params.items():
        stack = loaded[name]
        got = np.stack([stack[e] for e in range(len(stack))]) if isinstance(stack, ExpertStack) else stack
        np.testing.assert_array_equal(got, value, err_msg=name)


def test_round_trip_of_a_packed_layer_keeps_the_bytes(tmp_path):
    params = init_params(TINY, 4)
    save_hf_layer(tmp_path / "a", TINY, params, layer=1)
    config, loaded = load_hf_layer(tmp_path / "a", 1)
    save_hf_layer(tmp_path / "b", config, loaded, layer=1)
    a, b = _read_with_safetensors(tmp_path / "a"), _read_with_safetensors(tmp_path / "b")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_packed_experts_decode_one_expert(tmp_path):
    params = init_params(TINY, 5)
    save_hf_layer(tmp_path, TINY, params, layer=1)
    _, loaded = load_hf_layer(tmp_path, 1)
    w2 = loaded["experts.w2"]
    assert w2.shape == (TINY.n, TINY.ell, TINY.f) and w2.dtype == np.float32
    stored = _read_with_safetensors(tmp_path)
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"
    expected = _ct_expert(stored[name + ".weight_packed"], stored[name + ".weight_scale"]).float().numpy()
    np.testing.assert_array_equal(w2[3], expected)
    np.testing.assert_array_equal(w2[3, ...], expected)
    # MXFP4 is close to the original weights: within the codec's bound (one step at the block's top).
    assert np.abs(w2[3] - params["experts.w2"][3]).max() <= np.abs(params["experts.w2"][3]).max() / 3.5
    with pytest.raises(TypeError, match="never converted to one array"):
        np.asarray(w2)
    with pytest.raises(TypeError, match="index it with an integer"):
        w2[0:2]
    assert w2.nbytes == TINY.n * TINY.ell * (TINY.f // 2 + TINY.f // 32)


def test_mxfp8_inputs_option_is_the_rounded_products(tmp_path):
    # Independent check: the reference block on MXFP8-rounded expert inputs, rounded here by ml_dtypes directly.
    params = init_params(TINY, 6)
    config = TINY
    x = np.random.default_rng(7).standard_normal((9, config.d)).astype(np.float32)
    plain = stable_latent_moe(x, params, config)
    low = stable_latent_moe(x, params, config, mxfp8_inputs=True)
    rel = np.linalg.norm(low - plain) / np.linalg.norm(plain)
    assert 1e-4 < rel < 0.1  # something changed, and not much
    with pytest.raises(ValueError, match="mxfp8_inputs=True needs latent_size and intermediate_size"):
        stable_latent_moe(np.zeros((2, 8), np.float32), init_params(MoEConfig.tiny(), 0), MoEConfig.tiny(),
                          mxfp8_inputs=True)


# ---------------------------------------------------------------------------
# Malformed input: clear errors, nothing half-loaded
# ---------------------------------------------------------------------------

def _saved(tmp_path, **kwargs) -> Path:
    save_hf_layer(tmp_path, TINY, init_params(TINY, 0), layer=1, **kwargs)
    return tmp_path


def _rewrite(path: Path, change) -> None:
    """Rewrite the single shard after `change(dict_of_arrays)` with the safetensors library."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    path = _saved(tmp_path)
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"
    _rewrite(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"has no tensor '{name}'"):
        load_hf_layer(path, 1)


def test_misshapen_tensor_is_named(tmp_path):
    path = _saved(tmp_path, mxfp4=False)
    name = "language_model.model.layers.1.block_sparse_moe.routed_expert_up_proj.weight"

    def change(t):
        t[name] = np.zeros((64, 31), np.float32)
    _rewrite(path, change)
    with pytest.raises(ValueError, match=rf"tensor '{name}' must have shape \[64, 32\], got \[64, 31\]"):
        load_hf_layer(path, 1)


def test_dense_and_out_of_range_layers(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(ValueError, match=r"layer 0 is a dense layer \(first_k_dense_replace=1"):
        load_hf_layer(path, 0)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\] \(num_hidden_layers=3\), got 3"):
        load_hf_layer(path, 3)
    with pytest.raises(ValueError, match=r"has no tensor language_model.model.layers.2.block_sparse_moe.gate"):
        load_hf_layer(path, 2)  # an MoE layer of the config that this file does not hold
    with pytest.raises(TypeError, match="layer must be an integer"):
        load_hf_layer(path, "1")


def test_unknown_quantization_format(tmp_path):
    path = _saved(tmp_path)
    hf = json.loads((path / "config.json").read_text())
    hf["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="unknown quantization format.*'nvfp4-pack-quantized'"):
        load_hf_layer(path, 1)
    del hf["text_config"]["quantization_config"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="is MXFP4 but config.json declares no quantization_config"):
        load_hf_layer(path, 1)


def test_config_it_cannot_represent(tmp_path):
    path = _saved(tmp_path)
    hf = json.loads((path / "config.json").read_text())
    hf["text_config"]["topk_method"] = "greedy"
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="topk_method"):
        load_hf_layer(path, 1)
    del hf["text_config"]["num_experts"]
    hf["text_config"]["topk_method"] = "noaux_tc"
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"hf\['text_config'\]\['num_experts'\] is required"):
        load_hf_layer(path, 1)


def test_missing_files(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf_layer(tmp_path, 1)
    path = _saved(tmp_path / "x")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_hf_layer(path, 1)


def test_save_errors(tmp_path):
    params = init_params(TINY, 0)
    with pytest.raises(ValueError, match=r"layer must be an MoE layer in \[1, 2\] \(layer 0 is dense\), got 0"):
        save_hf_layer(tmp_path, TINY, params, layer=0)
    tiny = MoEConfig.tiny()
    with pytest.raises(ValueError, match="mxfp4=True needs latent_size and intermediate_size that are multiples"):
        save_hf_layer(tmp_path, tiny, init_params(tiny, 0), layer=1)
    bad = dict(params)
    bad["experts.w1"] = bad["experts.w1"][:, :, :16]
    with pytest.raises(ValueError, match=r"params\['experts.w1'\] must have shape"):
        save_hf_layer(tmp_path, TINY, bad, layer=1)


def test_bfloat16_checkpoint_loads_in_float32(tmp_path):
    params = init_params(TINY, 8, dtype=ml_dtypes.bfloat16)
    save_hf_layer(tmp_path, TINY, params, layer=1, mxfp4=False)
    config, loaded = load_hf_layer(tmp_path, 1)
    assert loaded["gate.weight"].dtype == np.float32 and loaded["experts.w1"].format == "dense"
    np.testing.assert_array_equal(loaded["gate.weight"], params["gate.weight"].astype(np.float32))
    np.testing.assert_array_equal(loaded["experts.w3"][1], params["experts.w3"][1].astype(np.float32))
    # A bfloat16 checkpoint re-saved as MXFP4 decodes to what mxfp4 gives those weights.
    save_hf_layer(tmp_path / "q", config, loaded, layer=1)
    _, q = load_hf_layer(tmp_path / "q", 1)
    assert q["experts.w3"].format == "mxfp4"
    packed, scale = q["experts.w3"].parts[1]
    np.testing.assert_array_equal(q["experts.w3"][1], mxfp4_decode(packed, scale))


# ---------------------------------------------------------------------------
# The worked example still runs
# ---------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_example_50_runs(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "examples/50_k3_checkpoint.py", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mxfp4_decode agrees on all 32: True" in proc.stdout
    assert "config == CONFIG: True" in proc.stdout
    assert (tmp_path / "mxfp4_levels.png").exists()


def test_only_the_layer_asked_for_is_touched(tmp_path):
    # The index also lists another layer's tensors in a shard that does not exist: loading layer 1 never opens it.
    save_hf_layer(tmp_path, TINY, init_params(TINY, 9), layer=1, shard_size=30_000)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    other = "language_model.model.layers.2.block_sparse_moe.gate.weight"
    index["weight_map"][other] = "model-99999-of-99999.safetensors"
    index_file.write_text(json.dumps(index))
    config, loaded = load_hf_layer(tmp_path, 1)
    assert config == TINY
    # The packed bytes are read-only views of the files.
    packed, scale = loaded["experts.w1"].parts[0]
    assert not packed.flags.writeable and not scale.flags.writeable
    with pytest.raises(ValueError, match="mapped to model-99999-of-99999.safetensors, which is not in"):
        load_hf_layer(tmp_path, 2)


def test_save_writes_nothing_on_error(tmp_path):
    config = TINY.replace(top_k=1, renormalize=True)  # no HF form: the reference never renormalizes one weight
    with pytest.raises(ValueError, match="top_k=1 with renormalize=True has no Hugging Face configuration"):
        save_hf_layer(tmp_path / "out", config, init_params(config, 0), layer=1)
    assert not (tmp_path / "out").exists()
