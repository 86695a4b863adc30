r"""Kimi K3 checkpoints as released: read one MoE layer, keep its experts packed, write the same layout.

K3 is published as a Hugging Face directory: a nested `config.json`
(`text_config` holds the language model's keys, §9.1 of the spec), a
`model.safetensors.index.json` that maps every tensor name to its shard, and
the `*.safetensors` shards. One MoE layer $L$ lives under

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
   reference code's meaning of absent keys) and the quantization: only
   compressed-tensors' `mxfp4-pack-quantized` (4-bit floats, groups of 32) is
   understood; any other format is an error, not a guess.
2. The layer must exist and be an MoE layer (`first_k_dense_replace`,
   `moe_layer_freq`); a dense layer is an error that says so.
3. The tensor names are found through the index file (or the single
   `model.safetensors`), with or without the `language_model.` prefix.
4. Every tensor is checked for presence, dtype and shape before anything is
   returned: an error names the tensor, the file and what was expected, and
   nothing half-loaded escapes.

The safetensors format is simple enough to read directly: an 8-byte
little-endian header length, a JSON header mapping each name to its dtype,
shape and byte range, then the raw bytes. `read_safetensors_header` and
`open_safetensors` do that with `numpy.memmap`, so a tensor costs nothing
until its bytes are used. Writing goes through the `safetensors` library,
which the tests also use to read what this module writes.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .config import MoEConfig, is_moe_layer
from .latent_moe import MoEParams, check_params, parameter_shapes
from .mx import MX_BLOCK, mxfp4_decode, mxfp4_encode

__all__ = [
    "ExpertStack",
    "K3_QUANTIZATION_CONFIG",
    "layer_prefix",
    "load_hf_layer",
    "open_safetensors",
    "read_safetensors_header",
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

# The three matrices of a routed expert: HF module name -> MoEParams stack name.
_EXPERT_MATRICES = {"w1": "experts.w1", "w3": "experts.w3", "w2": "experts.w2"}

# safetensors dtype names -> NumPy dtypes.
_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


# ---------------------------------------------------------------------------
# safetensors, memory-mapped
# ---------------------------------------------------------------------------

def read_safetensors_header(file: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The JSON header of a `.safetensors` file and the byte offset where its data starts."""
    file = Path(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{file} is not a safetensors file: shorter than its 8-byte header length")
        size = int.from_bytes(prefix, "little")
        if size > os.path.getsize(file) - 8:
            raise ValueError(f"{file} is not a safetensors file: header length {size} exceeds the file")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file} is not a safetensors file: its header is not JSON ({exc})") from None
    return header, 8 + size


def open_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a `.safetensors` file as a read-only NumPy view of one memory map (nothing is read yet)."""
    file = Path(file)
    header, start = read_safetensors_header(file)
    whole = np.memmap(file, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry.get("dtype") not in _ST_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {entry.get('dtype')!r}, which this reader "
                             f"does not know (known: {sorted(_ST_DTYPES)})")
        dtype = np.dtype(_ST_DTYPES[entry["dtype"]])
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or start + end > whole.size:
            raise ValueError(f"{file}: tensor {name!r} of shape {list(shape)} and dtype {entry['dtype']} does "
                             f"not fit its byte range [{begin}, {end})")
        tensors[name] = whole[start + begin:start + end].view(dtype).reshape(shape)
    return tensors


class _Shards:
    """The tensors of a checkpoint directory, found through the index file or a single file, opened lazily."""

    def __init__(self, path: Path):
        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, Mapping):
                raise ValueError(f"{index} has no 'weight_map' mapping of tensor names to shard files")
            self.file_of = dict(weight_map)
        elif (path / "model.safetensors").is_file():
            single = path / "model.safetensors"
            header, _ = read_safetensors_header(single)
            self.file_of = {name: single.name for name in header if name != "__metadata__"}
        else:
            raise ValueError(f"{path} has neither model.safetensors.index.json nor model.safetensors")
        self._open: dict[str, dict[str, np.ndarray]] = {}
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> np.ndarray:
        file = self.file_of[name]
        if file not in self._open:
            if not (self.path / file).is_file():
                raise ValueError(f"tensor {name!r} is mapped to {file}, which is not in {self.path}")
            self._open[file] = open_safetensors(self.path / file)
            self._headers[file] = read_safetensors_header(self.path / file)
        tensors = self._open[file]
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is mapped to {file} by the index, but that file does not hold it")
        return tensors[name]

    def read(self, name: str) -> np.ndarray:
        """A private in-memory copy of tensor `name`, read with ordinary file reads.

        Copying out of the memory map would leave the copied pages mapped, and
        counted as resident, for as long as the map lives (the experts keep it
        alive); a plain read does not touch the map at all.
        """
        view = self.get(name)  # checks that the tensor is there and fits its byte range
        file = self.file_of[name]
        header, start = self._headers[file]
        offset = start + header[name]["data_offsets"][0]
        return np.fromfile(self.path / file, dtype=view.dtype, count=view.size, offset=offset).reshape(view.shape)


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
    never be materialized by accident. `nbytes` is the stored size.
    """

    format: str
    parts: tuple[tuple[np.ndarray, ...], ...]
    shape: tuple[int, int, int]
    dtype: Any = np.float32

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
        part = self.parts[e]
        if self.format == "mxfp4":
            return mxfp4_decode(part[0], part[1], dtype=self.dtype)  # [out, in]
        return np.array(part[0], dtype=self.dtype)  # [out, in], a fresh copy

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
    for group_name, group in (qc.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        bits, size = weights.get("num_bits"), weights.get("group_size")
        kind = weights.get("type", "float")
        if (bits, size, kind) != (4, MX_BLOCK, "float"):
            raise ValueError(
                f"config.json: quantization_config.config_groups.{group_name}.weights must be 4-bit floats in "
                f"groups of {MX_BLOCK} (MXFP4), got num_bits={bits!r}, group_size={size!r}, type={kind!r}")
    return True


def _find_prefix(shards: _Shards, layer: int) -> str:
    for prefix in ("language_model.", ""):
        if f"{layer_prefix(layer, prefix)}gate.weight" in shards:
            return prefix
    raise ValueError(f"{shards.path} has no tensor {layer_prefix(layer)}gate.weight (nor without the "
                     "'language_model.' prefix): the layer's router is missing")


def _tensor(shards: _Shards, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
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


def _expert_stack(shards: _Shards, base: str, hf_name: str, n: int, shape: tuple[int, int],
                  quantized: bool, dtype: Any) -> ExpertStack:
    out, inp = shape
    first = f"{base}experts.0.{hf_name}.weight_packed"
    packed_layout = first in shards
    if packed_layout and not quantized:
        raise ValueError(f"tensor {first!r} is MXFP4 but config.json declares no quantization_config")
    parts = []
    for e in range(n):
        name = f"{base}experts.{e}.{hf_name}"
        if packed_layout:
            if inp % MX_BLOCK:
                raise ValueError(f"{name} cannot be MXFP4: its input width {inp} is not a multiple of {MX_BLOCK}")
            parts.append((_tensor(shards, f"{name}.weight_packed", (out, inp // 2), "uint8"),
                          _tensor(shards, f"{name}.weight_scale", (out, inp // MX_BLOCK), "uint8")))
        else:
            parts.append((_tensor(shards, f"{name}.weight", (out, inp), "float"),))
    return ExpertStack("mxfp4" if packed_layout else "dense", tuple(parts), (n, out, inp), np.dtype(dtype))


def load_hf_layer(path: str | os.PathLike, layer: int, *,
                  dtype: Any = np.float32) -> tuple[MoEConfig, MoEParams]:
    """Read MoE layer `layer` of the checkpoint directory `path`: `(config, params)`.

    Only that layer's tensors are touched, through memory maps. The router,
    bias, projections, norm and shared experts are returned as arrays of
    `dtype` (the bias stays float32 or wider); the routed experts
    `experts.w1/w3/w2` are `ExpertStack`s that keep the stored bytes (MXFP4
    when the checkpoint is quantized) and decode one expert to `dtype` on
    `w[e]`. Every function that takes parameters accepts the result.

    Raises `ValueError` naming the file, key or tensor for: a missing or
    unreadable config or shard, a layer out of range or dense, an unknown
    quantization format, a configuration `MoEConfig` cannot represent, and a
    missing or misshapen tensor. Nothing is returned unless everything checks.
    """
    path = Path(path)
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
        raise TypeError(f"layer must be an integer, got {type(layer).__name__} {layer!r}")
    layer = int(layer)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json")
    hf = json.loads(config_file.read_text())
    config = MoEConfig.from_hf_config(hf)
    text = hf.get("text_config", hf)
    total = text.get("num_hidden_layers")
    if total is not None and not 0 <= layer < total:
        raise ValueError(f"layer must be in [0, {total - 1}] (num_hidden_layers={total}), got {layer}")
    first_dense, freq = text.get("first_k_dense_replace", 0), text.get("moe_layer_freq", 1)
    if not is_moe_layer(layer, first_dense, freq):
        raise ValueError(f"layer {layer} is a dense layer (first_k_dense_replace={first_dense}, "
                         f"moe_layer_freq={freq}), not an MoE layer")
    quantized = _check_quantization(text, hf)
    shards = _Shards(path)
    base = layer_prefix(layer, _find_prefix(shards, layer))

    params = MoEParams()
    for name, shape in parameter_shapes(config).items():
        if name in _EXPERT_MATRICES.values():
            continue
        if name.startswith("shared_experts.") and config.shared_size == 0:
            params[name] = np.zeros(shape, dtype=dtype)  # no shared experts: empty matrices
            continue
        _tensor(shards, base + name, shape, "float")  # present, floating, the right shape
        keep = np.float32 if name == "gate.e_score_correction_bias" and np.dtype(dtype).itemsize < 4 else dtype
        params[name] = shards.read(base + name).astype(keep, copy=False)  # in memory, detached from the map
    shapes = parameter_shapes(config)
    for hf_name, stack in _EXPERT_MATRICES.items():
        params[stack] = _expert_stack(shards, base, hf_name, config.n, shapes[stack][1:], quantized, dtype)
    # Order as parameter_shapes, the order every other function lists them in.
    return config, MoEParams((name, params[name]) for name in shapes)


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------

def _expert_tensors(name: str, w: Any, e: int, mxfp4: bool) -> dict[str, np.ndarray]:
    """The stored tensors of expert `e` of stack `w` under module name `name`."""
    if isinstance(w, ExpertStack) and w.format == "mxfp4" and mxfp4:
        packed, scale = w.parts[e]  # already packed: copy the bytes, no re-encoding
        return {f"{name}.weight_packed": np.array(packed), f"{name}.weight_scale": np.array(scale)}
    matrix = np.asarray(w[e])  # [out, in]
    if mxfp4:
        packed, scale = mxfp4_encode(matrix)
        return {f"{name}.weight_packed": packed, f"{name}.weight_scale": scale}
    return {f"{name}.weight": np.ascontiguousarray(matrix)}


def save_hf_layer(path: str | os.PathLike, config: MoEConfig, params: Mapping[str, Any], layer: int = 1, *,
                  mxfp4: bool = True, prefix: str = "language_model.",
                  shard_size: int | None = None) -> Path:
    """Write one MoE layer as a checkpoint directory in the released layout; returns the path.

    Writes `config.json` (nested, `config.to_hf_config(nested=True)`, with
    K3's `quantization_config` when `mxfp4`), the tensors of layer `layer`
    under `{prefix}model.layers.{layer}.block_sparse_moe.` with one module
    per expert (MXFP4-encoded with `refimpl.mx.mxfp4_encode` when `mxfp4`,
    otherwise as given), and either one `model.safetensors` or, with
    `shard_size` (bytes), shards listed in `model.safetensors.index.json`.
    Layer 0 is dense in this layout, so `layer` must be in
    `[1, config.num_moe_layers]`. Files are written under temporary names and
    renamed, so a checkpoint that is memory-mapped elsewhere is never
    truncated under it.
    """
    from safetensors.numpy import save_file

    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    check_params(params, config)
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or not 1 <= layer <= config.num_moe_layers:
        raise ValueError(f"layer must be an MoE layer in [1, {config.num_moe_layers}] (layer 0 is dense), "
                         f"got {layer!r}")
    if mxfp4 and (config.ell % MX_BLOCK or config.f % MX_BLOCK):
        raise ValueError(f"mxfp4=True needs latent_size and intermediate_size that are multiples of {MX_BLOCK}, "
                         f"got {config.ell} and {config.f}")
    hf = config.to_hf_config(nested=True)  # raises for a config the reference code cannot express
    path = Path(path)
    if mxfp4:
        hf["text_config"]["quantization_config"] = json.loads(json.dumps(K3_QUANTIZATION_CONFIG))
    base = layer_prefix(layer, prefix)

    tensors: dict[str, np.ndarray] = {}
    for name, value in params.items():
        if name in _EXPERT_MATRICES.values() or (name.startswith("shared_experts.") and config.shared_size == 0):
            continue
        tensors[base + name] = np.ascontiguousarray(np.asarray(value))
    for hf_name, stack in _EXPERT_MATRICES.items():
        for e in range(config.n):
            tensors.update({base + key: value for key, value in
                            _expert_tensors(f"experts.{e}.{hf_name}", params[stack], e, mxfp4).items()})

    groups = _shard_groups(tensors, shard_size)
    path.mkdir(parents=True, exist_ok=True)  # only now: every check and every encoding has succeeded
    old = [p for p in path.glob("model*.safetensors*")]
    written: list[Path] = []
    for i, names in enumerate(groups):
        file = path / ("model.safetensors" if len(groups) == 1
                       else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors")
        _atomic(file, lambda tmp, names=names: save_file({k: tensors[k] for k in names}, tmp,
                                                         metadata={"format": "pt"}))
        written.append(file)
    if len(groups) > 1:
        weight_map = {k: written[i].name for i, names in enumerate(groups) for k in names}
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        _atomic(path / "model.safetensors.index.json", lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2)))
        written.append(path / "model.safetensors.index.json")
    _atomic(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(hf, indent=2)))
    for stale in old:  # files of an earlier save that this layout does not use
        if stale not in written:
            stale.unlink()
    return path


def _shard_groups(tensors: Mapping[str, np.ndarray], shard_size: int | None) -> list[list[str]]:
    """Tensor names split into consecutive shards of at most `shard_size` bytes (one tensor may exceed it)."""
    names = list(tensors)
    if shard_size is None:
        return [names]
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive number of bytes or None, got {shard_size!r}")
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


def _atomic(file: Path, write: Any) -> None:
    """Write `file` through `write(tmp_name)` into a temporary file of the same folder, then rename it."""
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, file)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

