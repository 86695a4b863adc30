"""Checkpoint folders, a fourth look: what an audit of the readers and writers found, each refused by name.

* a block is read strictly wherever it sits: K3's released layout, like every family's, refuses a tensor of the
  block it has no place for (a fifth expert, shared experts the configuration says it has not, an expert both
  packed and as floats), and a folder holding the block twice (under two prefixes) is refused, never read as
  one of the copies;
* what `save_hf_layer` writes, `load_hf_layer` reads: a `prefix` the reader does not look under is refused,
  and so are NaN and infinities, before anything is written;
* the headers and the configuration are checked before NumPy or a dict sees them: a shape no array can have,
  a `model_type` that is not a string, a dangling link named `model.safetensors`, a path that is not a path;
* a configuration that lists its layers one by one is not written for a layer index of a million.

(What interrupted saves leave, and how the next one removes it, is tested in `tests/test_trust_files.py`.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from refimpl import MoEConfig, MoEParams, init_params
from refimpl.checkpoints import load_hf_layer, open_safetensors, read_safetensors_header, save_hf_layer
from refimpl.config import family_hf_config
from refimpl.families import ALL_RECORDS, MAX_LISTED_LAYERS, family_prefix

TINY = MoEConfig(hidden_size=64, latent_size=32, num_experts=4, top_k=2, intermediate_size=64,
                 num_shared_experts=1, num_moe_layers=2)
BASE = "language_model.model.layers.1.block_sparse_moe."

#: The families whose folders put the block somewhere else per expert (as saved) than fused (in memory).
TWO_PLACES = sorted(name for name, family in ALL_RECORDS.items()
                    if family.block != family.block_on_disk and family.saved_layout == "per_expert"
                    and not family.k3_configuration)
#: The families whose configuration lists its layers one by one.
LISTING = sorted(name for name, family in ALL_RECORDS.items()
                 if family.rule.lists_layers and not family.k3_configuration)


def k3_folder(folder: Path, *, mxfp4: bool = False, config: MoEConfig = TINY) -> Path:
    return save_hf_layer(folder, config, init_params(config, 0, bias_scale=0.05), layer=1, mxfp4=mxfp4)


def edit(folder: Path, change) -> None:
    """Apply `change` to the tensors of the folder's single file, and write them back."""
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


# ---------------------------------------------------------------------------
# K3's released layout: strict, like every family's
# ---------------------------------------------------------------------------

def test_a_fifth_expert_and_an_unknown_tensor_in_a_four_expert_layer_are_refused(tmp_path):
    folder = k3_folder(tmp_path / "x")

    def extra(tensors):
        for name in ("w1", "w3", "w2"):
            tensors[BASE + f"experts.4.{name}.weight"] = tensors[BASE + f"experts.0.{name}.weight"].copy()
        tensors[BASE + "unknown.weight"] = np.ones(3, np.float32)
    edit(folder, extra)
    with pytest.raises(ValueError, match=r"holds 4 tensor\(s\) of the block that this configuration has no place "
                                         r"for \(num_experts = 4.*'language_model\.model\.layers\.1\."
                                         r"block_sparse_moe\.experts\.4\.w1\.weight'.*'[^']*unknown\.weight'"):
        load_hf_layer(folder, 1)


def test_shared_experts_in_the_file_that_the_configuration_does_not_have_are_refused_not_dropped(tmp_path):
    folder = k3_folder(tmp_path / "x")
    hf = json.loads((folder / "config.json").read_text())
    hf["text_config"]["num_shared_experts"] = None  # K3's code then builds no shared module
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"no place for \(num_experts = 4, shared experts none.*"
                                         r"shared_experts\.down_proj\.weight"):
        load_hf_layer(folder, 1)


def test_an_expert_stored_both_packed_and_as_floats_is_refused(tmp_path):
    folder = k3_folder(tmp_path / "x", mxfp4=True)
    edit(folder, lambda tensors: tensors.__setitem__(BASE + "experts.2.w1.weight", np.zeros((64, 32), np.float32)))
    with pytest.raises(ValueError, match=r"experts stored as MXFP4\): '[^']*experts\.2\.w1\.weight'"):
        load_hf_layer(folder, 1)


@pytest.mark.parametrize("second", ["model.layers.1.block_sparse_moe.", "model.layers.1.mlp."])
def test_a_k3_block_held_twice_is_refused_naming_both_places(tmp_path, second):
    folder = k3_folder(tmp_path / "x")

    def copy(tensors):
        for name, value in list(tensors.items()):
            tensors[second + name[len(BASE):]] = np.zeros_like(value)
    edit(folder, copy)
    with pytest.raises(ValueError, match=rf"holds layer 1's block more than once, under '{BASE}' and "
                                         rf"'{second}': keep one copy of it"):
        load_hf_layer(folder, 1)


def test_the_released_block_is_still_read_beside_other_layers(tmp_path):
    """A neighbour's tensors (layer 10, the dense layer 0) are not the block's: they are not refused."""
    folder = k3_folder(tmp_path / "x")
    edit(folder, lambda tensors: tensors.update({
        "language_model.model.layers.10.block_sparse_moe.gate.weight": np.zeros((4, 64), np.float32),
        "language_model.model.layers.0.mlp.gate_proj.weight": np.zeros((8, 64), np.float32)}))
    config, params = load_hf_layer(folder, 1)
    assert config == TINY
    np.testing.assert_array_equal(params["gate.weight"], init_params(TINY, 0, bias_scale=0.05)["gate.weight"])


@pytest.mark.parametrize("model_type", TWO_PLACES)
def test_a_family_block_saved_under_both_its_prefixes_is_refused(tmp_path, model_type):
    config = MoEConfig.from_hf_config({"model_type": model_type, **ALL_RECORDS[model_type].test_keys})
    config = config.replace(num_hash_layers=0)  # DeepSeek-V4's hash layers would need their table too
    first = save_hf_layer(tmp_path / "a", config, init_params(config, 0), 1, model_type=model_type,
                          expert_layout="per_expert")
    second = save_hf_layer(tmp_path / "b", config, init_params(config, 1), 1, model_type=model_type,
                           expert_layout="fused")
    edit(first, lambda tensors: tensors.update(load_file(second / "model.safetensors")))
    family = ALL_RECORDS[model_type]
    with pytest.raises(ValueError, match=rf"holds layer 1's block twice, under "
                                         rf"'{family_prefix(family, 1, 'per_expert')}' .* and under "
                                         rf"'{family_prefix(family, 1, 'fused')}'"):
        load_hf_layer(first, 1)


# ---------------------------------------------------------------------------
# What is written is what can be read
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["model.", "foo.", "language_model.language_model."])
def test_a_prefix_the_reader_does_not_look_under_is_refused_before_writing(tmp_path, prefix):
    with pytest.raises(ValueError, match=rf"prefix must be 'language_model\.' .* or '' .*got '{prefix}'"):
        save_hf_layer(tmp_path / "x", TINY, init_params(TINY, 0), layer=1, prefix=prefix, mxfp4=False)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("prefix", ["language_model.", ""])
def test_both_prefixes_the_reader_knows_round_trip(tmp_path, prefix):
    params = init_params(TINY, 0, bias_scale=0.05)
    folder = save_hf_layer(tmp_path / "x", TINY, params, layer=1, prefix=prefix, mxfp4=False)
    assert any(name.startswith(f"{prefix}model.layers.1.") for name in load_file(folder / "model.safetensors"))
    _, back = load_hf_layer(folder, 1)
    for name, value in params.items():
        np.testing.assert_array_equal(np.stack(list(back[name])) if name.startswith("experts.") else back[name],
                                      value, err_msg=name)


@pytest.mark.parametrize(("name", "index", "value"), [("gate.weight", (0, 0), np.nan),
                                                      ("shared_experts.up_proj.weight", (3, 5), np.inf),
                                                      ("experts.w2", (1, 2, 3), -np.inf)])
@pytest.mark.parametrize("model_type", [None, "qwen3_moe"])
def test_non_finite_parameters_are_refused_before_anything_is_written(tmp_path, name, index, value, model_type):
    config = TINY if model_type is None else MoEConfig.from_hf_config(
        {"model_type": model_type, **ALL_RECORDS[model_type].test_keys})
    if np.size(init_params(config, 0)[name]) == 0:
        pytest.skip(f"{model_type}'s test configuration has no {name}")
    params = MoEParams(init_params(config, 0))
    damaged = np.array(params[name])
    damaged[index] = value
    params[name] = damaged
    with pytest.raises(ValueError, match=rf"params\['{name}'\] holds 1 non-finite value\(s\) \(NaN or infinity\), "
                                         rf"the first at index \({', '.join(map(str, index))}\).*nothing was written"):
        save_hf_layer(tmp_path / "x", config, params, layer=1, model_type=model_type, mxfp4=False)
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------
# Checked before NumPy or a dict sees it
# ---------------------------------------------------------------------------

def _with_extra_entry(folder: Path, shape: list[int], size: int) -> Path:
    """The folder's single file with one more tensor `extra` of `shape` and `size` bytes (zeros)."""
    file = folder / "model.safetensors"
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    header["extra"] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + size]}
    body = json.dumps(header).encode()
    file.write_bytes(len(body).to_bytes(8, "little") + body + data + b"\0" * size)
    return file


@pytest.mark.parametrize(("shape", "size"), [([0, 10**30], 0), ([0, 2**40, 2**40], 0), ([0, 2**62], 0),
                                             ([1] * 70, 4)])
def test_a_shape_no_array_can_have_is_refused_in_the_header(tmp_path, shape, size):
    folder = k3_folder(tmp_path / "x")
    file = _with_extra_entry(folder, shape, size)
    with pytest.raises(ValueError, match=rf"{file}: tensor 'extra' has shape .*, which no array can have"):
        read_safetensors_header(file)
    with pytest.raises(ValueError, match="which no array can have"):
        load_hf_layer(folder, 1)


def test_the_largest_shapes_an_array_can_have_are_not_refused(tmp_path):
    """The limits are NumPy's own: 64 dimensions, and zeros beside 2**60 float32 entries (2**62 bytes)."""
    for shape, size in (([1] * 64, 4), ([0, 2**60], 0)):
        file = _with_extra_entry(k3_folder(tmp_path / f"x{len(shape)}"), shape, size)
        header, _ = read_safetensors_header(file)
        assert header["extra"]["shape"] == shape
        assert open_safetensors(file)["extra"].shape == tuple(shape)


@pytest.mark.parametrize("model_type", [["kimi_k3"], {"name": "kimi_k3"}, 3])
def test_a_model_type_that_is_not_a_string_is_refused_by_name(tmp_path, model_type):
    folder = k3_folder(tmp_path / "x")
    hf = json.loads((folder / "config.json").read_text())
    hf["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"hf\['model_type'\] must be a string naming the model"):
        MoEConfig.from_hf_config(hf)
    with pytest.raises(ValueError, match=r"config\.json: hf\['model_type'\] must be a string naming the model"):
        load_hf_layer(folder, 1)


def test_a_dangling_link_named_model_safetensors_is_a_value_error(tmp_path):
    folder = k3_folder(tmp_path / "x")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("gone.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors is a symbolic link to .*gone\.safetensors, which "
                                         "does not exist"):
        load_hf_layer(folder, 1)


@pytest.mark.parametrize("path", [None, 3, b"/tmp/x"])
def test_a_path_that_is_not_a_path_is_a_type_error_naming_it(tmp_path, path):
    with pytest.raises(TypeError, match=r"path must be a folder's path \(str or os\.PathLike\)"):
        load_hf_layer(path, 1)
    with pytest.raises(TypeError, match=r"path must be a folder's path \(str or os\.PathLike\)"):
        save_hf_layer(path, TINY, init_params(TINY, 0), layer=1)


# ---------------------------------------------------------------------------
# Layer lists: bounded
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", LISTING)
def test_a_configuration_listing_its_layers_is_not_written_for_a_layer_index_of_a_million(model_type):
    config = MoEConfig.from_hf_config({"model_type": model_type, **ALL_RECORDS[model_type].test_keys})
    config = config.replace(num_moe_layers=2, num_hash_layers=0)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"would list {10**6 + 2} of them, more than the {MAX_LISTED_LAYERS}"):
        family_hf_config(config, model_type, 10**6)
    assert time.perf_counter() - start < 5  # refused before any list is built (a list took seconds)


@pytest.mark.parametrize("model_type", LISTING)
def test_the_listing_bound_leaves_every_real_layer_index_alone(model_type):
    """A few thousand layers (no model has a thousand) are written and read back as the configuration."""
    config = MoEConfig.from_hf_config({"model_type": model_type, **ALL_RECORDS[model_type].test_keys})
    config = config.replace(num_moe_layers=config.num_moe_layers + 2, num_hash_layers=0)
    layer = 0 if ALL_RECORDS[model_type].rule.name == "hash_mlp_layer_types" else 4000
    hf = family_hf_config(config, model_type, layer)
    assert MoEConfig.from_hf_config(hf) == config
