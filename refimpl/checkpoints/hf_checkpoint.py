r"""Checkpoint folders: one MoE layer of any family's folder, K3's release with its experts kept packed.

`load_hf_layer(folder, L)` reads MoE layer $L$ of a Hugging Face folder: a
`config.json`, and the tensors in one `model.safetensors` or in shards listed
by `model.safetensors.index.json`. Which code the folder was written for
decides how it reads (`refimpl.config.hf_reading_family`, the `model_type`
in `config.json`):

* **A family of `refimpl.families`**, as transformers' `save_pretrained`
  writes it: the family's configuration keys and class defaults, its own
  MoE-layer rule, and the block under its record's prefix, per expert
  under the original checkpoint's names or fused under the in-memory ones
  (`save_original_format=False`). The block is read strictly through
  `params_from_hf_state_dict`: every tensor under the prefix is read, and
  one left over is an error. A DeepSeek-V4 hash layer comes back with its
  table as `params.tid2eid`. The checkpoints page has a table of every
  family's names, an example per family and the measured agreement.
* **K3 as released**, described below, and K3 in transformers' draft layout
  (`kimi_k3`: fused experts under `model.layers.{L}.mlp.`), told apart by
  their names.

K3 is published as a nested `config.json` (its `text_config` holds the
language model's keys, see the configuration page), a
`model.safetensors.index.json` and the `*.safetensors` shards. One MoE layer
$L$ lives under

    {prefix}model.layers.{L}.block_sparse_moe.

with `prefix = "language_model."` in the released multimodal checkpoint and
no prefix in text-only exports. The layer's tensors are the names of
`MoEParams`, except that the routed experts are **one module per expert**,
`experts.{e}.w1.weight` (gate, $[f, \ell]$), `experts.{e}.w3.weight` (up) and
`experts.{e}.w2.weight` (down, $[\ell, f]$), and that in the release they are
**MXFP4**: each `.weight` is replaced by `.weight_packed` and `.weight_scale`
(see `refimpl.mx`). Everything else (router, latent projections, norm,
shared experts) stays unquantized, in bfloat16; the selection bias is kept in
float32 or wider here whatever the file holds (see the routing page).

## Why the experts stay packed

A K3 MoE layer holds $896 \times 3 \ell f \approx 29.6$ billion routed
weights: 15.7 GB in MXFP4, 118 GB in float32. `load_hf_layer` therefore
**memory-maps** the shards and keeps each routed-expert matrix as it is
stored. `experts.w1`, `experts.w3` and `experts.w2` become `ExpertStack`
objects: read-only array-likes with the shapes of `MoEParams`
(`[n, f, \ell]`, `[n, \ell, f]`) whose indexing `w[e]` decodes one expert to
float32. The forward pass (`stable_latent_moe`) already runs expert by
expert, so it never holds more than one expert in float32, and only the
pages of the experts a batch uses are ever read from disk.

## Reading a layer, step by step

1. `config.json` gives the `MoEConfig` (`MoEConfig.from_hf_config`, with the
   meaning of absent keys of the code the file was written for, every value
   checked) and, for K3's release, the quantization: only
   compressed-tensors' `mxfp4-pack-quantized` (4-bit floats, groups of 32) is
   understood; any other format is an error, not a guess. A family's folder
   holds floating experts, and a `quantization_config` in it is refused.
2. The layer must exist and be an MoE layer by the family's own rule
   (K3's `first_k_dense_replace` and `moe_layer_freq`; Qwen3-MoE's
   `mlp_only_layers` and `decoder_sparse_step`; Kimi Linear's
   `mlp_layer_types`; Nemotron-H's `layers_block_type`; the record of each
   family names its rule); a dense layer is an error that says so.
3. The tensor names are found through the index file (or the single
   `model.safetensors`): under the family's prefix on disk or in memory,
   and for K3 with or without the `language_model.` prefix.
4. Every tensor is checked for presence, dtype and shape before anything is
   returned: an error names the tensor, the file and what was expected, and
   nothing half-loaded escapes.

The safetensors format is simple enough to read directly: an 8-byte
little-endian header length, a JSON header mapping each name to its dtype,
shape and byte range, then the raw bytes. `read_safetensors_header` and
`open_safetensors` do that with `numpy.memmap`, so a tensor costs nothing
until its bytes are used. Writing goes through the `safetensors` library,
which the tests also use to read what this module writes.

## Reading only what the checkpoint holds

A checkpoint folder comes from somewhere else, so the loader trusts none of
it until it has been checked:

* **Only files inside the folder are read.** A `weight_map` entry that is an
  absolute path or climbs out with `..`, and a file (shard, index or
  `config.json`) that is a symbolic link resolving outside the folder, is a
  `ValueError` naming the entry. A checkpoint downloaded from a hub cannot
  make the loader read `/etc/passwd` or another user's files as weights.
* **Every safetensors header is validated before a byte of data is used**:
  the 8-byte length must lie within the file, the header must be JSON (an
  object, no name twice) of at most 100 MB, every tensor needs a dtype this
  reader knows, a shape of non-negative integers and a byte range
  `data_offsets` whose length is the dtype's size times the product of the
  shape; and the byte ranges, in order, must tile the data exactly:
  starting at 0, each where the previous one ends, the last at the end of
  the file. That is the format's own rule (the `safetensors` library
  enforces it too); without it, overlapping or negative offsets would read
  the header's own bytes, or another tensor's, as weights.
* **Malformed JSON** in `config.json` or the index is a `ValueError` naming
  the file and the place, not a traceback from the `json` module.
* **`dtype` must be a floating type** (float32, float64, bfloat16 or float16);
  an integer type would truncate every weight.
* **Decoding refuses what it cannot represent.** An E8M0 scale byte of 255
  (NaN) is a `ValueError` naming the tensor and the expert when that expert
  is decoded, and so is a value the requested dtype cannot hold (scale byte
  254 times 6 is $1.02 \times 10^{39}$, beyond float32; the message suggests
  `dtype=np.float64`, which decodes it exactly). Casting a stored float64
  tensor to float32 is checked the same way.

## Writing without losing anything

`save_hf_layer` writes K3's released layout, or with `model_type` a
family's own (its `config.json` keys and names, or a `ValueError` before
anything is written when the family cannot express the layer). It writes
into a folder that may hold other things, so it promises three things:

* **It asks before it replaces.** A folder that already holds a checkpoint
  (`config.json`, the index, `model.safetensors`, or the mark of an
  interrupted save) is refused with `FileExistsError` naming it, unless
  `overwrite=True`.
* **It touches only what it writes.** Other files in the folder (a user's
  `model-finetuned.safetensors`, notes, a README) are never opened,
  replaced or deleted, with `overwrite=True` too. New shards get names no
  file in the folder has (`model-00001-of-00003.safetensors`, or with a
  `-2` suffix when those are taken), so the old index can never point to a
  new shard. With `overwrite=True` the files the old checkpoint listed (its
  index's shards, or its `model.safetensors`) are removed, and only after
  the new checkpoint is complete.
* **It is transactional.** Every file is first written in full under a
  temporary name in the same folder and flushed to disk (`fsync`); a
  failure then (a full disk, a bad tensor) removes the temporary files and
  leaves the folder exactly as it was. Only then are they renamed into
  place, the shards first, then `config.json`, the index last. The new
  shards have fresh names, so until `config.json` is replaced the old
  checkpoint is untouched, and a failure takes the new files back again.
  Renaming within a folder is atomic, but two files (`config.json` and the
  index) cannot change in one step, so while the renames run a mark,
  `.save_hf_layer-incomplete.json`, says a save is under way; a failure or
  a crash between the two leaves it behind, and `load_hf_layer` then
  refuses the folder rather than pair the new weights with the old
  configuration. Saving again with `overwrite=True` finishes the job and
  removes what the interrupted save left. New files get the permissions of
  the process's umask, as any file the user creates.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .._lib.files import flush_file, fsync_folder, new_file_mode
from ..config import MoEConfig, family_hf_config, hf_reading_family, is_moe_layer
from ..families import ALL_RECORDS, HFFamily, family_prefix, read_layer_keys, record_of
from ..layer.latent_moe import MoEParams, check_params, is_packed_stack, parameter_shapes
from ..mx import MX_BLOCK, check_float_dtype, mxfp4_decode, mxfp4_encode
from .safetensors import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    Shards,
    inside_folder,
    non_finite,
    read_json,
    to_dtype,
)

__all__ = [
    "ExpertStack",
    "INCOMPLETE_SAVE_MARK",
    "K3_QUANTIZATION_CONFIG",
    "layer_prefix",
    "load_hf_layer",
    "save_hf_layer",
]

#: The `quantization_config` of K3's `text_config`: compressed-tensors MXFP4 on the routed experts only.
K3_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                        "group_size": 32, "dynamic": False, "scale_dtype": "torch.uint8"},
            "input_activations": None,
            "output_activations": None,
        },
    },
    # Everything but the routed experts stays in bfloat16.
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*routed_expert_(down|up)_proj$",
               "re:.*block_sparse_moe\\.gate$", "re:.*mlp\\..*", "re:vision.*", "re:.*mm_projector.*"],
}

#: The file that marks a folder whose `save_hf_layer` stopped between its renames (see the page).
INCOMPLETE_SAVE_MARK = ".save_hf_layer-incomplete.json"

# The three matrices of a routed expert: HF module name -> MoEParams stack name.
_EXPERT_MATRICES = {"w1": "experts.w1", "w3": "experts.w3", "w2": "experts.w2"}

# ---------------------------------------------------------------------------
# The packed expert stack
# ---------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ExpertStack:
    r"""A read-only stack of `n` expert matrices `[n, out, in]` that decodes one expert on `w[e]`.

    Each expert is held as stored: MXFP4 (`packed [out, in/2]` and `scale
    [out, in/32]` uint8, `format="mxfp4"`) or a floating matrix `[out, in]`
    (`format="dense"`, e.g. bfloat16), usually memory-mapped views of the
    checkpoint. `w[e]` (or `w[e, ...]`) returns expert `e` as a fresh
    `[out, in]` array of `dtype`; nothing else is supported, so a stack can
    never be materialized by accident. `nbytes` is the stored size. `names`
    holds each expert's module name in the checkpoint, for error messages:
    decoding an expert whose bytes have no value in `dtype` (an E8M0 NaN
    scale, an overflow) is a `ValueError` naming the tensor and the expert.
    """

    format: str
    parts: tuple[tuple[np.ndarray, ...], ...]
    shape: tuple[int, int, int]
    dtype: Any = np.float32
    names: tuple[str, ...] = ()

    @property
    def ndim(self) -> int:
        return 3

    @property
    def nbytes(self) -> int:
        """Bytes of the stored (packed) matrices."""
        return sum(a.nbytes for part in self.parts for a in part)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple) and len(key) == 2 and key[1] is Ellipsis:
            key = key[0]
        if isinstance(key, bool) or not isinstance(key, int | np.integer):
            raise TypeError(f"an ExpertStack decodes one expert at a time: index it with an integer e, got {key!r}")
        e = int(key)
        if not -len(self) <= e < len(self):
            raise IndexError(f"expert {e} out of range for a stack of {len(self)} experts")
        e %= len(self)
        part = self.parts[e]
        name = self.names[e] if self.names else f"expert {e}"
        if self.format == "mxfp4":
            try:
                return mxfp4_decode(part[0], part[1], dtype=self.dtype)  # [out, in]
            except ValueError as exc:
                raise ValueError(f"tensor '{name}.weight_scale' (expert {e} of {len(self)}): {exc}") from None
        return to_dtype(part[0], np.dtype(self.dtype), f"{name}.weight")  # [out, in], a fresh copy

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[e] for e in range(len(self)))

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("an ExpertStack is never converted to one array (a K3 layer would take 118 GB in "
                        "float32); index it, w[e], to decode one expert")

    def __repr__(self) -> str:
        return (f"ExpertStack({self.format}, shape={list(self.shape)}, dtype={np.dtype(self.dtype).name}, "
                f"stored {self.nbytes / 1e6:.1f} MB)")


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------

def layer_prefix(layer: int, prefix: str = "language_model.") -> str:
    """The name prefix of MoE layer `layer`'s tensors: `{prefix}model.layers.{layer}.block_sparse_moe.`."""
    return f"{prefix}model.layers.{layer}.block_sparse_moe."


def _check_quantization(text: Mapping[str, Any], hf: Mapping[str, Any]) -> bool:
    """True when the config declares compressed-tensors MXFP4; raise for any other quantization."""
    qc = text.get("quantization_config", hf.get("quantization_config"))
    if qc is None:
        return False
    if not isinstance(qc, Mapping):
        raise ValueError(f"config.json: quantization_config must be a mapping, got {type(qc).__name__}")
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise ValueError(
            "config.json: unknown quantization format: quant_method="
            f"{method!r}, format={fmt!r} (only 'compressed-tensors' with 'mxfp4-pack-quantized' is understood)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ValueError(f"config.json: quantization_config.config_groups must be a mapping, got "
                         f"{type(groups).__name__}")
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise ValueError(f"config.json: quantization_config.config_groups.{group_name} must be a mapping "
                             f"with a 'weights' mapping, got {group!r:.80}")
        bits, size = weights.get("num_bits"), weights.get("group_size")
        kind = weights.get("type", "float")
        if (bits, size, kind) != (4, MX_BLOCK, "float") or isinstance(bits, bool) or isinstance(size, bool):
            raise ValueError(
                f"config.json: quantization_config.config_groups.{group_name}.weights must be 4-bit floats in "
                f"groups of {MX_BLOCK} (MXFP4), got num_bits={bits!r}, group_size={size!r}, type={kind!r}")
    return True


#: The prefixes K3's released block can sit under: the multimodal release's, and a text-only model's.
K3_PREFIXES = ("language_model.", "")


def _k3_block_prefix(shards: Shards, layer: int) -> str | None:
    """Where layer `layer`'s K3 block is in `shards`: a released prefix, None for transformers' draft layout.

    Exactly one of the places may hold tensors of the block: two copies (under both released prefixes, or
    released and draft) are refused by name, since reading either would silently drop the other.
    """
    draft = family_prefix(ALL_RECORDS["kimi_k3"], layer)
    places = {layer_prefix(layer, prefix): prefix for prefix in K3_PREFIXES}
    places[draft] = None
    held = [base for base in places if any(name.startswith(base) for name in shards.file_of)]
    if len(held) > 1:
        raise ValueError(f"{shards.path} holds layer {layer}'s block more than once, under "
                         f"{' and '.join(repr(base) for base in held)}: keep one copy of it")
    if held:
        return places[held[0]]
    if f"{draft}gate.weight" in shards:
        return None
    raise ValueError(f"{shards.path} has no tensor {layer_prefix(layer)}gate.weight (nor without the "
                     "'language_model.' prefix): the layer's router is missing")


def _refuse_leftovers(shards: Shards, base: str, read: set[str], why: str) -> None:
    """A `ValueError` listing the tensors under `base` that were not read (`read`): nothing is left over."""
    left = sorted(name for name in shards.file_of if name.startswith(base) and name not in read)
    if left:
        shown_names = ", ".join(repr(name) for name in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5
                                                                     else "")
        raise ValueError(f"{shards.path} holds {len(left)} tensor(s) of the block that {why}: {shown_names}")


def _tensor(shards: Shards, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """The stored tensor `name`, checked for presence, dtype kind ('float' or 'uint8') and shape."""
    if name not in shards:
        raise ValueError(f"checkpoint {shards.path} has no tensor {name!r}")
    t = shards.get(name)
    if kind == "uint8" and t.dtype != np.uint8:
        raise ValueError(f"tensor {name!r} must be uint8 (MXFP4 bytes), got {t.dtype}")
    if kind == "float" and not (np.issubdtype(t.dtype, np.floating) or t.dtype == ml_dtypes.bfloat16):
        raise ValueError(f"tensor {name!r} must be floating point, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} must have shape {list(shape)}, got {list(t.shape)}")
    return t


def _expert_stack(shards: Shards, base: str, hf_name: str, n: int, shape: tuple[int, int],
                  quantized: bool, dtype: np.dtype, read: set[str]) -> ExpertStack:
    """Stack `hf_name` of the `n` experts under `base`, kept as stored; the names it uses are added to `read`."""
    out, inp = shape
    first = f"{base}experts.0.{hf_name}.weight_packed"
    packed_layout = first in shards
    if packed_layout and not quantized:
        raise ValueError(f"tensor {first!r} is MXFP4 but config.json declares no quantization_config")
    parts, names = [], []
    for e in range(n):
        name = f"{base}experts.{e}.{hf_name}"
        if packed_layout:
            if inp % MX_BLOCK:
                raise ValueError(f"{name} cannot be MXFP4: its input width {inp} is not a multiple of {MX_BLOCK}")
            parts.append((_tensor(shards, f"{name}.weight_packed", (out, inp // 2), "uint8"),
                          _tensor(shards, f"{name}.weight_scale", (out, inp // MX_BLOCK), "uint8")))
        else:
            parts.append((_tensor(shards, f"{name}.weight", (out, inp), "float"),))
        names.append(name)
        read.update(f"{name}.{kind}" for kind in (("weight_packed", "weight_scale") if packed_layout else ("weight",)))
    return ExpertStack("mxfp4" if packed_layout else "dense", tuple(parts), (n, out, inp), dtype, tuple(names))


def load_hf_layer(path: str | os.PathLike, layer: int, *,
                  dtype: Any = np.float32) -> tuple[MoEConfig, MoEParams]:
    """Read MoE layer `layer` of the checkpoint directory `path`: `(config, params)`.

    `path` is any family's folder as `save_pretrained` writes it (per expert or fused, one file or
    sharded; a DeepSeek-V4 hash layer with its table as `params.tid2eid`), K3's release, or K3 in
    transformers' draft layout; the module docstring says how each is told apart.
    Only that layer's tensors are touched, through memory maps, and only
    files inside `path`. The router, bias, projections, norm and shared
    experts are returned as arrays of `dtype` (float32, float64, bfloat16 or
    float16; the bias stays float32 or wider); the release's routed experts
    `experts.w1/w3/w2` are `ExpertStack`s that keep the stored bytes (MXFP4
    when the checkpoint is quantized) and decode one expert to `dtype` on
    `w[e]`. Every function that takes parameters accepts the result.

    Raises `ValueError` naming the file, key, entry or tensor for: a missing
    or malformed config, index or shard (every safetensors header is
    validated before its data is used), a `weight_map` entry or symbolic
    link leading out of the folder, a layer out of range or dense (by the family's rule), an
    unknown quantization format, a configuration `MoEConfig` cannot
    represent, a missing or misshapen tensor, a tensor under the block's
    prefix that the configuration has no place for, the block held twice
    (under two prefixes), a folder left by an
    interrupted `save_hf_layer`, and (when the expert is decoded) a scale
    byte 255 or a value `dtype` cannot hold. `TypeError` for a `layer` that
    is not an integer, a `dtype` that is not floating or a `path` that is
    not a path. Nothing is returned unless everything checks.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a folder's path (str or os.PathLike), got {type(path).__name__} {path!r:.80}")
    path = Path(path)
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
        raise TypeError(f"layer must be an integer, got {type(layer).__name__} {layer!r}")
    layer = int(layer)
    dtype = check_float_dtype(dtype)
    if os.path.lexists(path / INCOMPLETE_SAVE_MARK):
        raise ValueError(
            f"{path} holds {INCOMPLETE_SAVE_MARK}: a save_hf_layer into this folder stopped while it replaced the "
            "checkpoint, so config.json and the weights may come from different saves; save the layer again "
            f"with overwrite=True (which also removes what the interrupted save left), or delete "
            f"{INCOMPLETE_SAVE_MARK} if you know the files belong together")
    if not os.path.lexists(path / CONFIG_FILE):
        raise ValueError(f"{path} has no {CONFIG_FILE}")
    config_file = inside_folder(path, CONFIG_FILE, "the configuration")
    hf = read_json(config_file)
    if not isinstance(hf, dict):
        raise ValueError(f"{config_file} must hold a JSON object (the model's configuration), "
                         f"got {type(hf).__name__}")
    try:
        config = MoEConfig.from_hf_config(hf)
    except ValueError as exc:
        raise ValueError(f"{config_file}: {exc}") from None
    text = hf.get("text_config", hf)
    family = hf_reading_family(hf)
    if family is not None:
        return _load_family_layer(path, hf, text, family, config, layer, dtype)
    total = text.get("num_hidden_layers")
    if total is not None and not 0 <= layer < total:
        raise ValueError(f"layer must be in [0, {total - 1}] (num_hidden_layers={total}), got {layer}")
    first_dense, freq = text.get("first_k_dense_replace", 0), text.get("moe_layer_freq", 1)
    if not is_moe_layer(layer, first_dense, freq):
        raise ValueError(f"layer {layer} is a dense layer (first_k_dense_replace={first_dense}, "
                         f"moe_layer_freq={freq}), not an MoE layer")
    quantized = _check_quantization(text, hf)
    shards = Shards(path)
    prefix = _k3_block_prefix(shards, layer)
    if prefix is None:  # K3 as transformers' draft holds it: fused experts under mlp.
        if quantized:
            raise ValueError(f"{config_file}: quantization_config declares MXFP4 experts, but {path} holds K3 in "
                             "transformers' fused layout, whose experts are floating")
        return config, _read_block(shards, ALL_RECORDS["kimi_k3"], config, layer, "fused", False, dtype)
    base = layer_prefix(layer, prefix)

    params = MoEParams()
    read: set[str] = set()  # the names of the block's tensors taken; any other under `base` is refused
    for name, shape in parameter_shapes(config).items():
        if name in _EXPERT_MATRICES.values():
            continue
        if name.startswith("shared_experts.") and config.shared_size == 0:
            params[name] = np.zeros(shape, dtype=dtype)  # no shared experts: empty matrices
            continue
        _tensor(shards, base + name, shape, "float")  # present, floating, the right shape
        keep = np.dtype(np.float32) if name == "gate.e_score_correction_bias" and dtype.itemsize < 4 else dtype
        params[name] = to_dtype(shards.read(base + name), keep, base + name)  # in memory, detached from the map
        read.add(base + name)
    shapes = parameter_shapes(config)
    for hf_name, stack in _EXPERT_MATRICES.items():
        params[stack] = _expert_stack(shards, base, hf_name, config.num_experts, shapes[stack][1:], quantized, dtype,
                                      read)
    _refuse_leftovers(shards, base, read, f"this configuration has no place for (num_experts = {config.num_experts}, "
                      f"shared experts {config.num_shared_experts or 'none'}, experts stored "
                      f"{'as MXFP4' if quantized else 'as floating tensors'})")
    # Order as parameter_shapes, the order every other function lists them in.
    return config, MoEParams((name, params[name]) for name in shapes)


def _load_family_layer(path: Path, hf: Mapping[str, Any], text: Mapping[str, Any], family: HFFamily,
                       config: MoEConfig, layer: int, dtype: np.dtype) -> tuple[MoEConfig, MoEParams]:
    """`load_hf_layer` for a family of `refimpl.families`: its MoE-layer rule, its prefixes, its names."""
    where = "config.json" + ("['text_config']" if text is not hf else "")
    total, layer_keys = read_layer_keys(text, where, family)
    if not 0 <= layer < total:
        raise ValueError(f"layer must be in [0, {total - 1}] ({family.model_type} has {total} layers), got {layer}")
    if not family.rule.is_moe(layer, layer_keys):
        shown_keys = {key: text[key] for key in family.rule.keys if key in text}
        raise ValueError(f"layer {layer} is a dense layer of this {family.model_type} model, not an MoE layer "
                         f"(by {family.config_class}'s layer keys {shown_keys or 'at their defaults'})")
    if text.get("quantization_config", hf.get("quantization_config")) is not None:
        raise ValueError(f"config.json: quantization_config is read for K3's released layout only; this "
                         f"{family.model_type} folder's experts must be stored as floating tensors")
    shards = Shards(path)
    layouts = [layout for layout in ("per_expert", "fused")
               if any(name.startswith(family_prefix(family, layer, layout)) for name in shards.file_of)]
    if not layouts:
        raise ValueError(f"{path} has no tensor under {family_prefix(family, layer, 'per_expert')!r} (as "
                         f"save_pretrained writes {family.model_type}) nor under "
                         f"{family_prefix(family, layer, 'fused')!r} (with save_original_format=False): "
                         f"layer {layer}'s block is missing")
    same = family.block == family.block_on_disk  # then the names tell the layouts apart
    if len(layouts) > 1 and not same:
        raise ValueError(f"{path} holds layer {layer}'s block twice, under "
                         f"{family_prefix(family, layer, 'per_expert')!r} (as save_pretrained writes "
                         f"{family.model_type}) and under {family_prefix(family, layer, 'fused')!r} (the in-memory "
                         "names): keep one copy of it")
    hashed = family.rule.hashed(layer, layer_keys)
    return config, _read_block(shards, family, config, layer, None if same else layouts[0], hashed, dtype)


def _read_block(shards: Shards, family: HFFamily, config: MoEConfig, layer: int, layout: str | None, hashed: bool,
                dtype: np.dtype) -> MoEParams:
    """Every tensor under the block's prefix, read strictly through the converter; a hash layer's table attached.

    `layout` is "fused" or "per_expert", or None when both have one prefix (then the names tell them apart).
    """
    from .state_dict import hf_hash_table, params_from_hf_state_dict  # that module imports this one

    base = family_prefix(family, layer, layout or "fused")
    tensors = {name: shards.get(name) for name in shards.file_of if name.startswith(base)}  # memory-mapped
    try:
        params = params_from_hf_state_dict(tensors, config, layer=layer, model_type=family.model_type, dtype=dtype,
                                           hash_layer=hashed, expert_layout=layout)
        table = hf_hash_table(tensors, config, layer=layer, model_type=family.model_type) if hashed else None
    except ValueError as exc:
        raise ValueError(f"{shards.path}, layer {layer}: {exc}") from None
    params.tid2eid = table
    return params


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------

def _expert_tensors(name: str, w: Any, e: int, mxfp4: bool, stack: str) -> dict[str, np.ndarray]:
    """The stored tensors of expert `e` of stack `w` (`params[stack]`) under module name `name`."""
    if isinstance(w, ExpertStack) and w.format == "mxfp4" and mxfp4:
        packed, scale = w.parts[e]  # already packed: copy the bytes, no re-encoding
        return {f"{name}.weight_packed": np.array(packed), f"{name}.weight_scale": np.array(scale)}
    matrix = np.asarray(w[e])  # [out, in]
    if mxfp4:
        try:
            packed, scale = mxfp4_encode(matrix)
        except ValueError as exc:
            raise ValueError(f"params[{stack!r}][{e}] (expert {e}) cannot be written as MXFP4: {exc}") from None
        return {f"{name}.weight_packed": packed, f"{name}.weight_scale": scale}
    return {f"{name}.weight": np.ascontiguousarray(matrix)}


def save_hf_layer(path: str | os.PathLike, config: MoEConfig, params: Mapping[str, Any], layer: int = 1, *,
                  model_type: str | None = None, expert_layout: str | None = None, mxfp4: bool | None = None,
                  prefix: str | None = None, tid2eid: Any = None, shard_size: int | None = None,
                  overwrite: bool = False) -> Path:
    """Write one MoE layer as a checkpoint directory; returns the path.

    **K3's released layout** (`model_type=None`): `config.json` is K3's
    (nested, `config.to_hf_config(nested=True)`, with K3's
    `quantization_config` when `mxfp4`, the default), the tensors of layer
    `layer` go under `{prefix}model.layers.{layer}.block_sparse_moe.`
    (`prefix` `"language_model."`, the default, or `""`) with one module per expert
    (MXFP4-encoded with `refimpl.mx.mxfp4_encode` when `mxfp4`, otherwise
    as given). Layer 0 is dense in this layout, so `layer` must be in
    `[1, config.num_moe_layers]`.

    **A family's layout** (`model_type` one of `refimpl.families.ALL_RECORDS`): `config.json` holds the
    family's own keys (`refimpl.config.family_hf_config`: its configuration class reads them back to
    `config`, and its MoE-layer rule makes `layer` the first of `config.num_moe_layers` MoE layers), and the
    layer's tensors go under the family's names and prefix, `expert_layout` `"per_expert"` (the original
    checkpoint's modules, as `save_pretrained` writes the family; the default) or `"fused"` (the in-memory
    names; the default for K3 in transformers' draft, `"kimi_k3"`). A DeepSeek-V4 hash layer is written with
    its table, `tid2eid` (default `params.tid2eid`, as `load_hf_layer` returns it). What the family cannot
    express is a `ValueError` naming it, before anything is written: a field its keys give otherwise (shared
    experts for Mixtral, a latent for DeepSeek-V3, ...), a nonzero selection bias for a router without one,
    a hash layer without its table or a table for a layer that routes by scores, `mxfp4=True`, a `prefix`.

    Either way the result is one `model.safetensors` or, with `shard_size`
    (bytes), shards listed in `model.safetensors.index.json`, and
    `load_hf_layer(path, layer)` reads the layer back; so NaN or an
    infinity in any parameter, which the reader refuses as damage, is a
    `ValueError` naming the parameter before anything is written.

    A folder that already holds a checkpoint (`config.json`, the index,
    `model.safetensors` or the mark of an interrupted save) is refused with
    `FileExistsError` unless `overwrite=True`. Other files in the folder are
    never touched; with `overwrite=True` the old checkpoint's files are
    removed once the new one is complete. The write is transactional: every
    file is written and flushed under a temporary name in the folder first,
    so a failure there leaves the folder as it was; then the files are
    renamed into place, the index last. New files get the permissions of
    the process's umask. What interrupted saves left (the files their
    mark lists, and the hidden temporary files of a save killed while it
    wrote them) goes once a save completes. See the page for the details.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {type(overwrite).__name__} {overwrite!r}")
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"prefix must be a string such as 'language_model.' or '', got {type(prefix).__name__}")
    if mxfp4 is not None and not isinstance(mxfp4, bool):
        raise TypeError(f"mxfp4 must be True, False or None, got {type(mxfp4).__name__} {mxfp4!r}")
    if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int | np.integer)
                                   or shard_size < 1):
        raise ValueError(f"shard_size must be a positive number of bytes or None, got {shard_size!r}")
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a folder's path (str or os.PathLike), got {type(path).__name__} {path!r:.80}")
    check_params(params, config)
    _check_finite_params(params)
    if model_type is None:
        hf, tensors_of = _k3_checkpoint(config, params, layer, expert_layout, mxfp4 is not False,
                                        "language_model." if prefix is None else prefix, tid2eid)
    else:
        hf, tensors_of = _family_checkpoint(config, params, layer, model_type, expert_layout, mxfp4, prefix, tid2eid)
    path = Path(path)
    found = _checkpoint_files_in(path)  # before any encoding: a refusal costs nothing
    if found and not overwrite:
        raise FileExistsError(f"{path} already holds a checkpoint ({', '.join(found)}): pass overwrite=True to "
                              "replace it (files save_hf_layer did not write are kept)")
    tensors = tensors_of()

    groups = _shard_groups(tensors, int(shard_size) if shard_size is not None else None)
    old = _old_checkpoint_files(path) if found else set()
    shard_names = _fresh_shard_names(path, len(groups), taken=old)
    files: dict[str, Callable[[str], None]] = {}  # final name -> how to write it; written in this order
    for shard, names in zip(shard_names, groups, strict=True):
        files[shard] = lambda tmp, names=names: _write_safetensors({k: tensors[k] for k in names}, tmp)
    files[CONFIG_FILE] = lambda tmp: Path(tmp).write_text(json.dumps(hf, indent=2))
    if len(groups) > 1:
        weight_map = {k: shard for shard, names in zip(shard_names, groups, strict=True) for k in names}
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        files[INDEX_FILE] = lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2))
    _write_transaction(path, files, old)
    return path


def _check_finite_params(params: Mapping[str, Any]) -> None:
    """Refuse NaN and infinities before anything is written: `load_hf_layer` refuses them as a damaged file.

    A packed stack is checked as each expert is decoded for writing (`to_dtype`); its MXFP4 bytes, copied as
    they are, hold no NaN but a scale byte 255, which the reader refuses when it decodes.
    """
    for name, value in params.items():
        if is_packed_stack(value):
            continue
        found = non_finite(value)
        if found:
            raise ValueError(f"params[{name!r}] holds {found}: a checkpoint holding it could not be read back "
                             "(load_hf_layer refuses it as damaged), so nothing was written")


def _k3_checkpoint(config: MoEConfig, params: Mapping[str, Any], layer: Any, expert_layout: Any, mxfp4: bool,
                   prefix: str, tid2eid: Any) -> tuple[dict[str, Any], Callable[[], dict[str, np.ndarray]]]:
    """K3's released layout: its `config.json`, and how to make the layer's tensors (encoded only when asked)."""
    if expert_layout not in (None, "per_expert"):
        raise ValueError(f"expert_layout={expert_layout!r} chooses a transformers family's layout: pass model_type "
                         "too (K3's released checkpoint stores one module per expert)")
    if tid2eid is not None:
        raise ValueError("tid2eid is DeepSeek-V4's hash-layer table: pass model_type='deepseek_v4' too")
    if prefix not in K3_PREFIXES:
        raise ValueError(f"prefix must be 'language_model.' (the multimodal release's) or '' (a text-only model's), "
                         f"the two places load_hf_layer reads K3's block from; got {prefix!r}")
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or not 1 <= layer <= config.num_moe_layers:
        raise ValueError(f"layer must be an MoE layer in [1, {config.num_moe_layers}] (layer 0 is dense), "
                         f"got {layer!r}")
    if mxfp4 and (config.latent_size % MX_BLOCK or config.intermediate_size % MX_BLOCK):
        raise ValueError(f"mxfp4=True needs latent_size and intermediate_size that are multiples of {MX_BLOCK}, "
                         f"got {config.latent_size} and {config.intermediate_size}")
    hf = config.to_hf_config(nested=True)  # raises for a config the reference code cannot express
    if mxfp4:
        hf["text_config"]["quantization_config"] = json.loads(json.dumps(K3_QUANTIZATION_CONFIG))
    base = layer_prefix(int(layer), prefix)

    def tensors_of() -> dict[str, np.ndarray]:
        tensors: dict[str, np.ndarray] = {}
        for name, value in params.items():
            if name in _EXPERT_MATRICES.values() or (name.startswith("shared_experts.") and config.shared_size == 0):
                continue
            tensors[base + name] = np.ascontiguousarray(np.asarray(value))
        for hf_name, stack in _EXPERT_MATRICES.items():
            for e in range(config.num_experts):
                tensors.update({base + key: value for key, value in
                                _expert_tensors(f"experts.{e}.{hf_name}", params[stack], e, mxfp4, stack).items()})
        return tensors

    return hf, tensors_of


def _family_checkpoint(config: MoEConfig, params: Mapping[str, Any], layer: Any, model_type: str,
                       expert_layout: Any, mxfp4: bool | None, prefix: str | None, tid2eid: Any
                       ) -> tuple[dict[str, Any], Callable[[], dict[str, np.ndarray]]]:
    """A family's layout: its `config.json` and the layer's tensors under its names, or a `ValueError`."""
    from .state_dict import EXPERT_LAYOUTS, check_saved_layout, hf_state_dict_from_params  # imports this one

    family = record_of(model_type)
    if mxfp4:
        raise ValueError(f"mxfp4=True writes K3's released packed experts; model_type={model_type!r} stores float "
                         "experts")
    if prefix is not None:
        raise ValueError(f"prefix={prefix!r} places K3's released block; model_type={model_type!r} places its block "
                         f"where its model does ({family.block_on_disk!r})")
    layout = family.saved_layout if expert_layout is None else expert_layout
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be None (as the family saves) or one of {EXPERT_LAYOUTS}, "
                         f"got {expert_layout!r}")
    check_saved_layout(family, layout)
    hf = family_hf_config(config, model_type, layer)  # raises for a layer the family's keys cannot express
    text = hf.get("text_config", hf)
    _, layer_keys = read_layer_keys(text, "config.json", family)
    hashed = family.rule.hashed(int(layer), layer_keys)
    table = getattr(params, "tid2eid", None) if tid2eid is None else tid2eid
    if hashed and table is None:
        raise ValueError(f"layer {layer} of this {model_type} configuration routes by a table (the first "
                         f"num_hash_layers = {config.num_hash_layers} layers do): pass its table as tid2eid")
    if not hashed and table is not None:
        raise ValueError(f"tid2eid is a hash layer's table, but layer {layer} of this {model_type} configuration "
                         f"routes by its scores (num_hash_layers = {config.num_hash_layers}): writing would lose it")
    tensors = hf_state_dict_from_params(params, config, model_type=model_type, layer=int(layer),
                                        expert_layout=layout, tid2eid=table)  # checked before anything is written
    if table is not None:  # the table has a row per token id: the model's vocabulary
        text["vocab_size"] = int(np.shape(table)[0])
    return hf, lambda: tensors


def _write_safetensors(tensors: dict[str, np.ndarray], file: str) -> None:
    """Write `tensors` to `file` with the safetensors library (PyTorch's metadata, as the release has)."""
    from safetensors.numpy import save_file

    save_file(tensors, file, metadata={"format": "pt"})


def _checkpoint_files_in(path: Path) -> list[str]:
    """The files of a checkpoint that `path` already holds (those `save_hf_layer` would replace)."""
    if os.path.lexists(path) and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a folder: save_hf_layer writes a checkpoint folder")
    if not path.is_dir():
        return []
    return [name for name in (CONFIG_FILE, INDEX_FILE, SINGLE_FILE, INCOMPLETE_SAVE_MARK)
            if os.path.lexists(path / name)]


def _is_plain_file_name(entry: Any) -> bool:
    """A bare name of a shard in the folder itself: no directory part, no '..', ending in .safetensors."""
    return (isinstance(entry, str) and entry.endswith(".safetensors") and "/" not in entry and "\\" not in entry
            and "\x00" not in entry and entry not in (".", ".."))


def _is_temporary_name(entry: Any) -> bool:
    """A bare name of the kind `_stage` gives its temporary files: `.{final name}.{random}.tmp`."""
    return (isinstance(entry, str) and entry.startswith(".") and entry.endswith(".tmp") and "/" not in entry
            and "\\" not in entry and "\x00" not in entry)


def _old_checkpoint_files(path: Path) -> set[str]:
    """The files of the checkpoint in `path` that a complete new save may remove.

    Those its index lists (plain names in the folder only: an entry pointing
    elsewhere is never deleted), or its `model.safetensors` when it has no
    index, and the files (shards, temporary files) an interrupted save
    recorded in its mark.
    """
    old: set[str] = set()
    if os.path.lexists(path / INDEX_FILE):
        try:
            weight_map = read_json(path / INDEX_FILE).get("weight_map", {})
            old.update(file for file in weight_map.values() if _is_plain_file_name(file))
        except (ValueError, AttributeError, OSError):
            pass  # an unreadable index lists nothing; its shards are left alone
    elif os.path.lexists(path / SINGLE_FILE):
        old.add(SINGLE_FILE)
    written, temporary = _marked_files(path)
    old.update(written)
    old.update(temporary)
    return old | _stray_temporaries(path)


def _marked_files(path: Path) -> tuple[set[str], set[str]]:
    """The files an interrupted save recorded in its mark: (final names it was writing, its temporary files)."""
    if not os.path.lexists(path / INCOMPLETE_SAVE_MARK):
        return set(), set()
    try:
        mark = read_json(path / INCOMPLETE_SAVE_MARK)
        return ({file for file in mark.get("writing", []) if _is_plain_file_name(file)},
                {file for file in mark.get("temporary", []) if _is_temporary_name(file)})
    except (ValueError, AttributeError, TypeError, OSError):
        return set(), set()  # an unreadable mark lists nothing; what it listed is left alone


#: The hidden files `_stage` makes (`tempfile.mkstemp`'s eight random characters) for a checkpoint's files.
_STAGED_NAME = re.compile(r"\.(config\.json|model\.safetensors\.index\.json|model(-\d{5}-of-\d{5}(-\d+)?)?"
                          r"\.safetensors|" + re.escape(INCOMPLETE_SAVE_MARK) + r")\.[a-z0-9_]{8}\.tmp")


def _stray_temporaries(path: Path) -> set[str]:
    """The temporary files of a save killed while it wrote them, before any mark could list them.

    Only names `_stage` gives a checkpoint's own files match; they are hidden, and nothing reads them.
    """
    try:
        names = os.listdir(path)
    except OSError:
        return set()
    return {name for name in names if _STAGED_NAME.fullmatch(name) and os.path.isfile(path / name)
            and not os.path.islink(path / name)}


def _fresh_shard_names(path: Path, count: int, taken: set[str]) -> list[str]:
    """Shard file names that no file in `path` has and the old checkpoint does not list.

    One shard is `model.safetensors` (the name the single-file layout
    requires; it replaces the old one in one rename). Several are
    `model-00001-of-0000N.safetensors`, or with the suffix `-2`, `-3`, ...
    when those names are in use, so a new shard never overwrites a file.
    """
    if count == 1:
        return [SINGLE_FILE]
    for generation in itertools.count(1):
        suffix = "" if generation == 1 else f"-{generation}"
        names = [f"model-{i + 1:05d}-of-{count:05d}{suffix}.safetensors" for i in range(count)]
        if not any(name in taken or os.path.lexists(path / name) for name in names):
            return names
    raise AssertionError("unreachable")


def _write_transaction(path: Path, files: dict[str, Callable[[str], None]], old: set[str]) -> None:
    """Write `files` (final name -> writer) into `path` all or nothing, then remove `old` files it does not use.

    1. Each file is written under a temporary name in `path` and flushed;
       any failure removes them all and leaves the folder as it was.
    2. The mark `INCOMPLETE_SAVE_MARK` is put in place, the files are renamed
       in the order given (shards, config.json, the index last), a stale
       index is removed when the new layout is a single file, the folder is
       flushed, and the mark is removed. A failure before a file of the old
       checkpoint is replaced (while the new shards, under fresh names, go
       in) still takes everything back; after that, the mark stays.
    3. Only then are the old checkpoint's files that the new one does not
       use removed.
    """
    created = [folder for folder in (path, *path.parents) if not folder.exists()]  # deepest first
    path.mkdir(parents=True, exist_ok=True)
    mode = new_file_mode()
    staged: list[tuple[Path, Path]] = []  # (temporary, final)
    placed: list[Path] = []  # new files renamed into place under names no file had
    replaced = False  # whether a file the old checkpoint reads (config.json, the index, model.safetensors) changed
    mark_placed = False
    try:
        for name, write in files.items():
            staged.append((_stage(path, name, write, mode), path / name))
        stale_index = INDEX_FILE not in files and os.path.lexists(path / INDEX_FILE)
        # An interrupted save's mark stays until a save succeeds; this save's mark adds its own files to what that
        # one listed, so that whichever save completes next removes what every interrupted one left.
        earlier = os.path.lexists(path / INCOMPLETE_SAVE_MARK)
        written, temporary = _marked_files(path)
        mark = {"writing": sorted(written | set(files)),
                "temporary": sorted(temporary | {temporary.name for temporary, _ in staged}),
                "replacing": sorted(old | ({INDEX_FILE} if stale_index else set()))}
        staged.append((_stage(path, INCOMPLETE_SAVE_MARK, lambda tmp: Path(tmp).write_text(json.dumps(mark)),
                              mode), path / INCOMPLETE_SAVE_MARK))
        os.replace(*staged[-1])
        staged.pop()
        mark_placed = not earlier
        for temporary, final in staged:
            replacing = os.path.lexists(final)
            replaced = replaced or replacing
            os.replace(temporary, final)
            if not replacing:
                placed.append(final)
        if stale_index:
            os.unlink(path / INDEX_FILE)  # the single file is the checkpoint now; the old index would shadow it
        fsync_folder(path)
        os.unlink(path / INCOMPLETE_SAVE_MARK)
        fsync_folder(path)
    except BaseException:
        for temporary, _ in staged:
            if os.path.lexists(temporary):
                os.unlink(temporary)
        if not replaced:  # the old checkpoint is intact: take back the new files and the mark, as if never run
            for final in placed:
                os.unlink(final)
            if mark_placed:
                os.unlink(path / INCOMPLETE_SAVE_MARK)
        for folder in created:  # the folders this save made, if nothing else is in them now
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    for name in sorted(old - set(files)):  # the new checkpoint is complete: the old one's other files go
        if os.path.lexists(path / name) and not (path / name).is_dir():
            os.unlink(path / name)
    fsync_folder(path)


def _stage(path: Path, name: str, write: Callable[[str], None], mode: int) -> Path:
    """A temporary file in `path` holding what `write(temporary_name)` writes, flushed, with the umask's mode."""
    fd, temporary = tempfile.mkstemp(dir=path, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(temporary)
        os.chmod(temporary, mode)  # mkstemp creates 0600; a new file gets what the umask allows
        flush_file(temporary)
    except BaseException:
        if os.path.lexists(temporary):
            os.unlink(temporary)
        raise
    return Path(temporary)


def _shard_groups(tensors: Mapping[str, np.ndarray], shard_size: int | None) -> list[list[str]]:
    """Tensor names split into consecutive shards of at most `shard_size` bytes (one tensor may exceed it)."""
    names = list(tensors)
    if shard_size is None:
        return [names]
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        size = tensors[name].nbytes
        if groups[-1] and used + size > shard_size:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups
