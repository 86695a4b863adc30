r"""Porting: one block's weights to and from Hugging Face tensor names.

A port of the K3 block into another framework (an inference engine, a training
stack, a fused kernel) holds its weights under the names of the reference
modeling code: a PyTorch `state_dict()`, a safetensors shard, a dictionary of
JAX arrays. This module turns such a mapping into the `MoEParams` that every
function of this package takes, and back, so that a port and the reference can
run on the very same weights:

```python
import refimpl

config = refimpl.MoEConfig.from_hf_config(text_config)
params = refimpl.params_from_hf_state_dict(my_block.state_dict(), config)
y_reference = refimpl.stable_latent_moe(x, params, config)

state_dict = refimpl.hf_state_dict_from_params(params, config)
my_block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
```

## The names

The reference block (`KimiSparseMoeBlock`) registers one module per routed
expert, so its `state_dict()` holds, for a layer with $n$ experts, a latent of
width $\ell$, expert width $f$ and $N_s$ shared experts:

| name | shape | `MoEParams` name |
|---|---|---|
| `gate.weight` | $[n, d]$ | the same |
| `gate.e_score_correction_bias` | $[n]$ | the same |
| `routed_expert_down_proj.weight` | $[\ell, d]$ | the same (only with a latent) |
| `routed_expert_norm.weight` | $[\ell]$ | the same (only with the latent norm) |
| `routed_expert_up_proj.weight` | $[d, \ell]$ | the same (only with a latent) |
| `experts.{e}.w1.weight` | $[f, \ell]$ | `experts.w1[e]` (gate) |
| `experts.{e}.w3.weight` | $[f, \ell]$ | `experts.w3[e]` (up) |
| `experts.{e}.w2.weight` | $[\ell, f]$ | `experts.w2[e]` (down) |
| `shared_experts.{gate,up,down}_proj.weight` | $[N_s f, d]$, $[d, N_s f]$ | the same; zero-element with $N_s = 0$ (the reference module's width-0 MLP), and then optional when read |

These are the **block-relative** names (`layer=None`). Inside a whole model
the block of decoder layer $L$ sits under
`{prefix}model.layers.{L}.block_sparse_moe.`, with `prefix="language_model."` in
K3's multimodal checkpoint; pass `layer=L` (and `prefix`) to read or write
those full names. Then every other tensor of the model is ignored, so a whole
model's `state_dict()` can be passed as it is. With `layer=None`, `prefix` is
simply put in front of the block-relative names (`prefix="mlp."` for a block
held under another name).

A routed expert may instead be stored as **MXFP4**, the way K3's checkpoint
ships (compressed-tensors' `mxfp4-pack-quantized`): `.weight` is then replaced
by the pair `.weight_packed` (uint8 $[\text{out}, \text{in}/2]$) and
`.weight_scale` (uint8 $[\text{out}, \text{in}/32]$). Such experts **stay
packed**: `params_from_hf_state_dict` returns them as an `ExpertStack` that
decodes one expert on `w[e]`, and `hf_state_dict_from_params(..., mxfp4=True)`
copies packed bytes through untouched (and encodes float experts with
`refimpl.mx.mxfp4_encode`).

## The other families

Every family of `refimpl.families` holds its block under other names, and
transformers 5 fuses each block's experts into two tensors. Pass
`model_type=` (any key of `refimpl.families.ALL_RECORDS`) to read and write
them; `family_tensor_shapes` lists the names, and the checkpoints page has a
table of every family's prefixes and names:

```python
config = refimpl.MoEConfig.from_hf_config(hf_block.config.to_dict())        # model_type "deepseek_v3"
params = refimpl.params_from_hf_state_dict(hf_block.state_dict(), config, model_type="deepseek_v3")
state_dict = refimpl.hf_state_dict_from_params(params, config, model_type="deepseek_v3")
hf_block.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
```

`experts.gate_up_proj` $[n, 2f, d]$ holds each expert's gate rows, then its
up rows, and is split into `experts.w1` and `experts.w3`; `experts.down_proj`
$[n, d, f]$ is `experts.w2`. The per-expert modules that `save_pretrained`
writes by default, under the original checkpoint's names and prefix
(`experts.{e}.gate_proj.weight`, Mixtral's and Kimi Linear's
`experts.{e}.w1.weight` under `block_sparse_moe.`, DeepSeek-V4's under
`ffn.`, ...), are read too, and written with `expert_layout="per_expert"`;
with `layer=L` the block's full name is the family's in memory (fused) or
on disk (per expert). A router without a selection bias (Qwen3-MoE,
Mixtral) reads as a zero bias, and writing a nonzero one for it is an
error; what a family's block cannot hold (a latent for DeepSeek-V3, shared
experts for Mixtral) is refused by name, never written half.

## The values

A value may be a NumPy array, a PyTorch tensor on any device and of any float
dtype (bfloat16 included; one that requires grad is detached), or anything
else that NumPy can read through `__array__` or DLPack (`__dlpack__`): JAX,
CuPy, TensorFlow. PyTorch is never imported by this module: a tensor is
recognized only when PyTorch is already loaded, which it is whenever a tensor
exists. bfloat16 tensors are read bit for bit (as `ml_dtypes.bfloat16`) and
then widened to float32, which is exact. By default every floating tensor
comes out in float32, or float64 if it was float64, so nothing is rounded;
`dtype=` chooses one dtype for all of them, except the selection bias, which
never goes below float32 (a bias in bfloat16 merges nearby values and changes
the routes; see the routing page).

## What is checked

Everything, before anything is returned: a name that is missing, a name the
block does not have, a tensor of the wrong shape or dtype (a float expert
where bytes were expected, an integer router), and an expert given both as
`.weight` and packed. All the problems are listed in one `ValueError`, so a
port with three misnamed modules learns about all three at once. Expert ids
are printed as ranges (`experts.{0-895}.w1.weight`), so a layer whose experts
are all misnamed gives a short message. A common case it catches: a latent
norm sized by `hidden_size` instead of the latent width $\ell$ is a wrong shape,
not a silently broadcast gain.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from .._lib.validation import check_float_dtype
from .._lib.values import switch_value
from .._lib.xp import dtype_name, is_array
from ..config import MoEConfig
from ..families import EXPERT_ROLES, HFFamily, family_prefix, record_of
from ..layer.latent_moe import MoEParams, check_params, parameter_shapes
from ..mx import MX_BLOCK, mxfp4_encode
from .hf_checkpoint import ExpertStack, layer_prefix
from .safetensors import to_dtype

__all__ = [
    "EXPERT_LAYOUTS",
    "EXPERT_MATRICES",
    "as_numpy",
    "block_prefix",
    "family_tensor_shapes",
    "hf_hash_table",
    "hf_state_dict_from_params",
    "hf_tensor_shapes",
    "params_from_hf_state_dict",
]

#: The three matrices of a routed expert: the reference block's module name and the `MoEParams` stack.
EXPERT_MATRICES: dict[str, str] = {"w1": "experts.w1", "w3": "experts.w3", "w2": "experts.w2"}

#: How the transformers families store their routed experts: "fused", one `[n, 2f, d]` gate-and-up tensor and
#: one `[n, d, f]` down tensor, as transformers 5 holds them; "per_expert", one module per expert under the
#: original checkpoint's names (`experts.{e}.gate_proj.weight`, `experts.{e}.w1.weight`, ...), as
#: `save_pretrained` writes them.
EXPERT_LAYOUTS = ("fused", "per_expert")

#: Floating dtypes a weight may have (by name: bfloat16 is not a NumPy floating type).
_FLOATS = ("float16", "bfloat16", "float32", "float64")


# ---------------------------------------------------------------------------
# Names and shapes
# ---------------------------------------------------------------------------

def block_prefix(layer: int | None = None, prefix: str = "", model_type: str | None = None,
                 expert_layout: str = "fused") -> str:
    """What stands before the block-relative names: `prefix`, or the full name of decoder layer `layer`'s block.

    K3's block is `{prefix}model.layers.{layer}.block_sparse_moe.`; a transformers family's block is where its
    record (`refimpl.families`) puts it: in memory for `expert_layout="fused"` (`model.layers.{layer}.mlp.`
    for most), as `save_pretrained` writes it for `"per_expert"` (Mixtral's `block_sparse_moe.`,
    Nemotron-H's `backbone.layers.{layer}.mixer.`, DeepSeek-V4's `ffn.`, Kimi K2.5's
    `language_model.model.blocks.{layer}.mlp.`).
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a string, got {type(prefix).__name__} {prefix!r}")
    family = None if model_type is None else record_of(model_type)
    if layer is None:
        return prefix
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or layer < 0:
        raise ValueError(f"layer must be None (block-relative names) or a decoder layer index >= 0, got {layer!r}")
    if family is not None:
        return prefix + family_prefix(family, int(layer), expert_layout)
    return layer_prefix(int(layer), prefix)


def hf_tensor_shapes(config: MoEConfig, *, mxfp4: bool = False, model_type: str | None = None,
                     expert_layout: str = "fused") -> dict[str, tuple[int, ...]]:
    """The reference block's `state_dict()` names (block-relative) and shapes for `config`.

    With a transformers `model_type` (see `refimpl.families`), the names of that family's block instead
    (`family_tensor_shapes`); otherwise K3's:

    One entry per routed expert matrix, `experts.{e}.w1.weight` etc.; with
    `mxfp4=True` each is replaced by its `weight_packed` / `weight_scale`
    pair. The latent projections and the norm gain appear only when the block
    has them; the shared experts always do, as zero-element matrices `[0, d]`,
    `[0, d]`, `[d, 0]` when $N_s = 0$ (the reference module builds its shared
    MLP with width $N_s f$, zero included).
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    mxfp4 = switch_value(mxfp4, "mxfp4")
    if model_type is not None:
        if mxfp4:
            raise ValueError(f"mxfp4=True is K3's packed layout; model_type={model_type!r} stores float experts")
        return family_tensor_shapes(config, model_type, expert_layout)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in parameter_shapes(config).items():
        if name in EXPERT_MATRICES.values():
            continue
        shapes[name] = shape  # with no shared experts, the reference block's width-0 MLP: zero-element tensors
    all_shapes = parameter_shapes(config)
    for e in range(config.num_experts):
        for module, stack in EXPERT_MATRICES.items():
            out, inp = all_shapes[stack][1:]
            for key, shape in _expert_entries(out, inp, mxfp4).items():
                shapes[f"experts.{e}.{module}.{key}"] = shape
    return shapes


def _expert_entries(out: int, inp: int, mxfp4: bool) -> dict[str, tuple[int, int]]:
    """The stored tensors of one `[out, in]` expert matrix: `weight`, or the MXFP4 pair."""
    if not mxfp4:
        return {"weight": (out, inp)}
    return {"weight_packed": (out, inp // 2), "weight_scale": (out, inp // MX_BLOCK)}


# ---------------------------------------------------------------------------
# Values from any framework
# ---------------------------------------------------------------------------

def as_numpy(value: Any, name: str = "value") -> np.ndarray:
    """One tensor of any framework as a NumPy array on the host, its values untouched.

    * a PyTorch tensor (recognized only if PyTorch is already imported): detached, moved to
      the CPU; bfloat16 and the float8 types are read bit for bit as `ml_dtypes` arrays;
    * anything with `__array__` (NumPy, JAX, TensorFlow, ...): `np.asarray`;
    * anything with `__dlpack__`: `np.from_dlpack`, asking for a copy on the CPU if needed.

    `name` (the tensor's name) goes into the error for a value that is none of these.
    """
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.is_meta or value.layout != torch.strided or value.is_quantized or value.is_nested:
            # No values to read as they are: say which kind of tensor came.
            kind = ("meta" if value.is_meta else "quantized" if value.is_quantized else "nested" if value.is_nested
                    else str(value.layout).removeprefix("torch."))
            raise ValueError(f"tensor {name!r} must be a dense tensor with values, got a PyTorch {kind} tensor")
        return _torch_to_numpy(torch, value, name)
    if hasattr(value, "__array__"):
        return np.asarray(value)
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError, ValueError):
            pass  # on another device, or a dtype NumPy's DLPack lacks (bfloat16)
        try:
            return np.from_dlpack(value, device="cpu", copy=True)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            if torch is not None:  # PyTorch reads every DLPack dtype, bfloat16 included
                return _torch_to_numpy(torch, torch.from_dlpack(value), name)
            raise TypeError(f"tensor {name!r}: NumPy cannot read this DLPack tensor ({exc}); convert it to "
                            "a NumPy array (float32 for bfloat16) before passing it") from None
    raise TypeError(f"tensor {name!r} must be an array (NumPy, PyTorch, or anything with __array__ or "
                    f"__dlpack__), got {type(value).__name__}")


# PyTorch dtypes NumPy has no name for, read through an integer view of the same width.
_TORCH_BITS = {"bfloat16": ("int16", ml_dtypes.bfloat16), "float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
               "float8_e5m2": ("uint8", ml_dtypes.float8_e5m2), "float8_e8m0fnu": ("uint8", ml_dtypes.float8_e8m0fnu),
               "float8_e4m3fnuz": ("uint8", ml_dtypes.float8_e4m3fnuz),
               "float8_e5m2fnuz": ("uint8", ml_dtypes.float8_e5m2fnuz)}


def _torch_to_numpy(torch: Any, tensor: Any, name: str = "value") -> np.ndarray:
    """A PyTorch tensor as a NumPy array: detached, on the CPU, contiguous, bit for bit.

    A dtype neither NumPy nor `_TORCH_BITS` can hold (`complex32`, `bits8`,
    the packed `float4_e2m1fn_x2`) is a `TypeError` naming the tensor `name`
    and its dtype.
    """
    t = tensor.detach().to("cpu").contiguous()
    kind = dtype_name(t.dtype)
    if kind in _TORCH_BITS:
        through, dtype = _TORCH_BITS[kind]
        return t.view(getattr(torch, through)).numpy().view(dtype)
    try:
        return t.resolve_conj().resolve_neg().numpy()
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"tensor {name!r} has the PyTorch dtype {kind}, which has no NumPy counterpart to read "
                        f"it as ({exc}); convert it to a float dtype (float32, bfloat16, float8_*) first") from None


def _float_dtype(stored: Any, dtype: Any, *, bias: bool = False) -> Any:
    """The dtype a stored floating tensor is returned in: `dtype`, or float32/float64 when None."""
    if dtype is None:
        dtype = np.float64 if dtype_name(stored) == "float64" else np.float32
    if bias and np.dtype(dtype).itemsize < 4:
        return np.float32  # the selection bias stays float32 or wider
    return dtype


# ---------------------------------------------------------------------------
# Reading: HF names -> MoEParams
# ---------------------------------------------------------------------------

class _Problems:
    """The problems found in a state dict, gathered so that one error lists them all."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.extra: list[str] = []
        self.wrong: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra or self.wrong)

    def error(self, where: str) -> ValueError:
        lines = [f"the state dict does not hold the block's tensors ({where}):"]
        for label, names in (("missing", self.missing), ("not in the block", self.extra)):
            if names:
                grouped = _group_expert_names(names)
                lines.append(f"  {label} ({len(names)}): " + ", ".join(grouped))
        if self.wrong:
            lines.append(f"  wrong shape or dtype ({len(self.wrong)}):")
            lines += [f"    {line}" for line in self.wrong]
        return ValueError("\n".join(lines))


def _group_expert_names(names: list[str]) -> list[str]:
    """Names with their expert ids folded into ranges: `experts.{0-3,7}.w1.weight`.

    Only ids written as `str(e)` are folded; a name that spells its id another
    way (`experts.01.w1.weight`) is listed as it is, so that the error shows
    the key the state dict holds.
    """
    pattern = re.compile(r"^(?P<head>.*experts\.)(?P<e>\d+)(?P<tail>\..*)$")
    groups: dict[tuple[str, str], list[int]] = {}
    plain: list[str] = []
    for name in names:
        match = pattern.match(name)
        if match is None or str(int(match["e"])) != match["e"]:
            plain.append(name)
        else:
            groups.setdefault((match["head"], match["tail"]), []).append(int(match["e"]))
    folded = []
    for (head, tail), ids in groups.items():
        folded.append(f"{head}{ids[0]}{tail}" if len(ids) == 1 else f"{head}{{{_ranges(sorted(ids))}}}{tail}")
    return plain + folded


def _ranges(ids: list[int]) -> str:
    """Sorted integers as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], ids[0]
    for previous, current in zip(ids, [*ids[1:], None], strict=True):
        if current != previous + 1:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(parts)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _names_under(state_dict: Mapping[str, Any], base: str) -> dict[Any, Any]:
    """Block-relative name -> the state dict's key, for the keys under `base`.

    With a namespace, the rest of a model is not the block's business; without one, every key is (a key
    that is not a string is kept, to be reported as not in the block).
    """
    ours = {key[len(base):]: key for key in state_dict if isinstance(key, str) and key.startswith(base)}
    if not base:
        ours.update({key: key for key in state_dict if not isinstance(key, str)})
    return ours


def params_from_hf_state_dict(state_dict: Mapping[str, Any], config: MoEConfig, *, layer: int | None = None,
                              prefix: str = "", dtype: Any = None, model_type: str | None = None,
                              hash_layer: bool = False, expert_layout: str | None = None) -> MoEParams:
    """One block's weights from a mapping of Hugging Face tensor names: a `MoEParams`.

    `state_dict` maps the reference block's names (block-relative with
    `layer=None`, or `{prefix}model.layers.{layer}.block_sparse_moe.…`) to
    tensors of any framework (see `as_numpy`). Routed experts become stacks
    `[n, out, in]`: a NumPy array when stored as floats, an `ExpertStack` that
    keeps the bytes and decodes one expert on `w[e]` when stored as MXFP4
    pairs. Floating tensors come out in `dtype` (default: float32, or float64
    when stored as float64); the bias never below float32.

    With a `model_type` of `refimpl.families.ALL_RECORDS` (every transformers family, Kimi K2.5, and
    `"kimi_k3"`, K3 in transformers' draft layout) the names are that family's block
    (`family_tensor_shapes`; with `layer`, under the family's own prefix), its experts fused as transformers 5
    holds them or one module per expert under the names `save_pretrained` writes (`expert_layout`, told
    apart by the names when None). A router without a selection bias (Qwen3-MoE, Mixtral) reads as a zero bias.
    DeepSeek-V4's hash layers (`hash_layer=True`) hold the table `gate.tid2eid`
    instead of a bias: the weights read with a zero bias, and the table with
    `hf_hash_table`, to route with `route_by_table`.

    Raises `ValueError` listing every missing, unexpected, misshapen or
    mistyped tensor, and `TypeError` for a value that is not an array.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping from tensor names to tensors, got {type(state_dict).__name__}")
    dtype = None if dtype is None else check_float_dtype(dtype)
    _check_layout(expert_layout)
    _check_hash_layer(hash_layer, model_type)
    if model_type is not None:
        base, layout = _family_base(state_dict, record_of(model_type), layer, prefix, expert_layout)
        return _params_from_family_state_dict(state_dict, config, model_type, base, dtype, hash_layer, layout)
    if expert_layout not in (None, "per_expert"):
        raise ValueError(f"expert_layout={expert_layout!r} chooses a transformers family's layout: pass model_type "
                         "too (K3's released block stores one module per expert)")
    base = block_prefix(layer, prefix)
    where = "block-relative names" if not base else f"names under {base!r}"
    ours = _names_under(state_dict, base)
    problems = _Problems()
    unused = set(ours)

    def take(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray | None:
        """The tensor `name` (block-relative), checked; None (and a problem noted) if it is wrong."""
        unused.discard(name)
        full = base + name
        value = as_numpy(state_dict[ours[name]], full)
        ok_dtype = (dtype_name(value.dtype) in _FLOATS) if kind == "float" else value.dtype == np.uint8
        if not ok_dtype or tuple(value.shape) != tuple(shape):
            want = "floating" if kind == "float" else "uint8 (MXFP4 bytes)"
            hint = ""
            if name == "routed_expert_norm.weight" and tuple(value.shape) == (config.hidden_size,) != tuple(shape):
                hint = " (sized by hidden_size instead of the latent width routed_expert_hidden_size?)"
            problems.wrong.append(f"{full}: expected {want} {_shape_text(shape)}, "
                                  f"got {value.dtype} {_shape_text(tuple(value.shape))}{hint}")
            return None
        return value

    params = MoEParams()
    for name, shape in hf_tensor_shapes(config).items():
        if name.startswith("experts."):
            continue
        if name not in ours:
            if not math.prod(shape):
                continue  # a zero-element tensor (the width-0 shared MLP) may be left out: it holds nothing
            problems.missing.append(base + name)
            continue
        value = take(name, shape, "float")
        if value is not None:
            params[name] = to_dtype(value, np.dtype(_float_dtype(value.dtype, dtype,
                                                                 bias=name == "gate.e_score_correction_bias")), base + name)
    shapes = parameter_shapes(config)
    for module, stack in EXPERT_MATRICES.items():
        out, inp = shapes[stack][1:]
        params[stack] = _read_stack(module, out, inp, config.num_experts, ours, take, problems, base, dtype)
    if unused:
        problems.extra += sorted(base + name for name in unused if isinstance(name, str))
        problems.extra += [repr(name) for name in unused if not isinstance(name, str)]
    if problems:
        raise problems.error(where)
    if config.shared_size == 0:
        d = config.hidden_size
        for name, shape in (("gate_proj", (0, d)), ("up_proj", (0, d)), ("down_proj", (d, 0))):
            params[f"shared_experts.{name}.weight"] = np.zeros(shape, dtype=_float_dtype(np.float32, dtype))
    ordered = MoEParams((name, params[name]) for name in shapes)  # the order of parameter_shapes
    check_params(ordered, config)
    return ordered


def _read_stack(module: str, out: int, inp: int, n: int, ours: Mapping[str, str], take: Any,
                problems: _Problems, base: str, dtype: Any) -> np.ndarray | ExpertStack | None:
    """The `n` experts' matrices `experts.{e}.{module}`: float `[n, out, in]`, or a packed `ExpertStack`."""
    dense: list[np.ndarray | None] = []
    packed: list[tuple[np.ndarray, np.ndarray] | None] = []
    for e in range(n):
        name = f"experts.{e}.{module}"
        has_weight = f"{name}.weight" in ours
        has_pair = f"{name}.weight_packed" in ours or f"{name}.weight_scale" in ours
        if has_weight and has_pair:
            problems.wrong.append(f"{base}{name}: given both as .weight and as MXFP4 .weight_packed/.weight_scale")
            take(f"{name}.weight", (out, inp), "float")
            continue
        if has_weight:
            dense.append(take(f"{name}.weight", (out, inp), "float"))
        elif has_pair:
            pair = []
            for key, shape in _expert_entries(out, inp, mxfp4=True).items():
                if f"{name}.{key}" in ours:
                    pair.append(take(f"{name}.{key}", shape, "uint8"))
                else:
                    problems.missing.append(f"{base}{name}.{key}")
                    pair.append(None)
            if inp % MX_BLOCK:
                problems.wrong.append(f"{base}{name}: cannot be MXFP4, its input width {inp} is not a multiple "
                                      f"of {MX_BLOCK}")
            packed.append(None if any(p is None for p in pair) else (pair[0], pair[1]))
        else:
            problems.missing.append(f"{base}{name}.weight")
    if dense and packed:
        problems.wrong.append(f"{base}experts.*.{module}: {len(dense)} experts stored as .weight and "
                              f"{len(packed)} as MXFP4 pairs; a matrix's experts must all be stored one way")
        return None
    if problems or (not dense and not packed):
        return None
    if packed:
        parts = tuple((np.array(p, dtype=np.uint8), np.array(s, dtype=np.uint8)) for p, s in packed)
        return ExpertStack("mxfp4", parts, (n, out, inp), np.dtype(_float_dtype(np.float32, dtype)))
    stack = np.empty((n, out, inp), dtype=np.result_type(*(np.dtype(_float_dtype(w.dtype, dtype)) for w in dense)))
    for e, w in enumerate(dense):  # one expert at a time, each cast checked for overflow by name
        stack[e] = to_dtype(w, stack.dtype, f"{base}experts.{e}.{module}.weight")
    return stack  # [n, out, in]


# ---------------------------------------------------------------------------
# Writing: MoEParams -> HF names
# ---------------------------------------------------------------------------

def _host_params(params: Any) -> Any:
    """`params` with every array read into NumPy by `as_numpy`, as the reader reads a state dict.

    A PyTorch tensor that requires grad is detached, a bfloat16 or float8 one
    read bit for bit (as `ml_dtypes`), one on another device copied to the
    host; a meta, sparse, nested or quantized tensor is refused by name.
    Packed `ExpertStack`s and what is not an array are left as they are, for
    `check_params` to judge.
    """
    if not isinstance(params, Mapping):
        return params
    return {name: as_numpy(value, str(name)) if is_array(value) and not isinstance(value, ExpertStack) else value
            for name, value in params.items()}


def hf_state_dict_from_params(params: Mapping[str, Any], config: MoEConfig, *, layer: int | None = None,
                              prefix: str = "", mxfp4: bool = False, model_type: str | None = None,
                              expert_layout: str = "fused", tid2eid: Any = None) -> dict[str, np.ndarray]:
    """The inverse of `params_from_hf_state_dict`: the block's tensors under Hugging Face names.

    Returns fresh NumPy arrays, block-relative names when `layer` is None
    (they load with `load_state_dict(strict=True)` into the reference block
    once converted to tensors), full names under
    `{prefix}model.layers.{layer}.block_sparse_moe.` otherwise. With
    `mxfp4=True` every routed expert matrix is written as its
    `weight_packed`/`weight_scale` pair (packed stacks are copied byte for
    byte, float ones encoded with `mxfp4_encode`); the latent width and the
    expert width must then be multiples of 32. Packed stacks written with
    `mxfp4=False` are decoded.

    With a `model_type` of `refimpl.families.ALL_RECORDS`, the names of that family's block
    (`family_tensor_shapes`, and with `layer` its prefix), the experts `expert_layout="fused"` (they load
    into transformers' block with `strict=True`) or `"per_expert"`, the names and prefix `save_pretrained`
    writes, so that the family's `from_pretrained` reloads them (refused for a family known in its fused
    names only, `kimi_k3`: its per-expert names would be made up); a nonzero
    selection bias for a family whose router has none is a `ValueError`, and
    so is `mxfp4=True`. A DeepSeek-V4 hash layer is written with its table,
    `tid2eid` `[vocab, k]` (expert ids), as `gate.tid2eid` in place of the bias,
    which must then be zero; a table that names an expert twice in a row is refused.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    mxfp4 = switch_value(mxfp4, "mxfp4")
    params = _host_params(params)
    check_params(params, config)
    _check_layout(expert_layout)
    base = block_prefix(layer, prefix, model_type, expert_layout)
    if model_type is None and expert_layout != "fused":
        raise ValueError(f"expert_layout={expert_layout!r} chooses a transformers family's expert layout: pass "
                         "model_type too (K3's block always stores one module per expert)")
    if model_type is not None:
        if mxfp4:
            raise ValueError(f"mxfp4=True writes K3's packed experts; model_type={model_type!r} stores float experts")
        family_tensor_shapes(config, model_type, expert_layout)  # the layout and the config checked first
        table = None if tid2eid is None else _checked_table(tid2eid, config, "tid2eid", model_type, distinct=True)
        k3 = hf_state_dict_from_params(params, config)
        return _family_state_dict_from_params(k3, config, model_type, base, expert_layout, table)
    if tid2eid is not None:
        raise ValueError("tid2eid is DeepSeek-V4's hash-layer table: pass model_type='deepseek_v4' too")
    if mxfp4 and (config.latent_size % MX_BLOCK or config.intermediate_size % MX_BLOCK):
        raise ValueError(f"mxfp4=True needs latent_size and intermediate_size that are multiples of {MX_BLOCK}, "
                         f"got {config.latent_size} and {config.intermediate_size}")
    out: dict[str, np.ndarray] = {}
    for name in hf_tensor_shapes(config):
        if not name.startswith("experts."):
            out[base + name] = np.array(as_numpy(params[name], name))
    for e in range(config.num_experts):
        for module, stack in EXPERT_MATRICES.items():
            w = params[stack]
            key = f"{base}experts.{e}.{module}"
            if mxfp4 and isinstance(w, ExpertStack) and w.format == "mxfp4":
                packed, scale = w.parts[e]  # already packed: the stored bytes, not a re-encoding
                out[f"{key}.weight_packed"], out[f"{key}.weight_scale"] = np.array(packed), np.array(scale)
            elif mxfp4:
                out[f"{key}.weight_packed"], out[f"{key}.weight_scale"] = mxfp4_encode(np.asarray(w[e]))
            else:
                out[f"{key}.weight"] = np.array(w[e])  # [out, in]; a packed stack decodes expert e
    return out


# ---------------------------------------------------------------------------
# The transformers families: their block's names, translated to and from K3's
# ---------------------------------------------------------------------------

def family_tensor_shapes(config: MoEConfig, model_type: str, expert_layout: str = "fused") -> dict[str, tuple[int, ...]]:
    r"""The block-relative names and shapes of `model_type`'s block for `config`, in memory or on disk.

    `expert_layout="fused"` gives the block's `state_dict()` as transformers 5 holds it (and as
    `save_pretrained(..., save_original_format=False)` writes it); `"per_expert"` the names `save_pretrained`
    writes by default, one module per expert under the original checkpoint's names (a `ValueError` for
    `kimi_k3`, whose checkpoints are known in their fused names only). Each family's record
    (`refimpl.families`) gives the names; for a family with a latent of width $\ell$ ($\ell = d$ without one):

    | name | shape | when |
    |---|---|---|
    | `gate.weight` | $[n, d]$ | always |
    | the selection bias (`gate.e_score_correction_bias`; on disk DeepSeek-V4's `gate.bias`) | $[n]$ | a router with a bias |
    | `experts.gate_up_proj` | $[n, 2f, \ell]$, the gate's $f$ rows first | `"fused"`, gated experts |
    | `experts.up_proj` | $[n, f, \ell]$ | `"fused"`, ungated experts (Nemotron-H) |
    | `experts.down_proj` | $[n, \ell, f]$ | `"fused"` |
    | `experts.{e}.{gate,up,down}` module `.weight` (`gate_proj/up_proj/down_proj`, or Mixtral's, Kimi Linear's and DeepSeek-V4's `w1/w3/w2`) | $[f, \ell]$, $[f, \ell]$, $[\ell, f]$ | `"per_expert"` |
    | the latent projections (`fc1_latent_proj`/`fc2_latent_proj`, K3's `routed_expert_down_proj`/`routed_expert_up_proj`) | $[\ell, d]$, $[d, \ell]$ | a latent |
    | `routed_expert_norm.weight` | $[\ell]$ | K3's latent norm |
    | `shared_experts.{gate,up,down}` module `.weight` (DeepSeek-V4 on disk `w1/w3/w2`) | $[N_s f, d]$, $[N_s f, d]$, $[d, N_s f]$ | shared experts |

    Nemotron-H's ungated experts (`activation="relu2"`) have no gate matrix, and its shared expert no
    `gate_proj`. Read, `up_proj` becomes both `experts.w1` and `experts.w3`; written, the two must be equal.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    family = record_of(model_type)
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    check_saved_layout(family, expert_layout)
    _check_family_config(config, family)
    n, d, f, shared, ell = (config.num_experts, config.hidden_size, config.intermediate_size, config.shared_size,
                            config.latent_size)
    on_disk = expert_layout == "per_expert"
    shapes: dict[str, tuple[int, ...]] = {"gate.weight": (n, d)}
    if family.bias is not None:
        shapes[family.bias_on_disk if on_disk else family.bias] = (n,)
    expert_shapes = {"gate": (f, ell), "up": (f, ell), "down": (ell, f)}
    if on_disk:
        for e in range(n):
            for role, module in family.expert_modules.items():
                shapes[f"experts.{e}.{module}.weight"] = expert_shapes[role]
    else:
        shapes["experts.gate_up_proj" if family.gated else "experts.up_proj"] = (n, 2 * f if family.gated else f, ell)
        shapes["experts.down_proj"] = (n, ell, f)
    if family.latent_projections is not None and config.use_latent_projection:
        down, up = family.latent_projections
        shapes[down], shapes[up] = (ell, d), (d, ell)
    if family.latent_norm is not None:
        shapes[family.latent_norm] = (ell,)
    shared_shapes = {"gate": (shared, d), "up": (shared, d), "down": (d, shared)}
    for role, name in _shared_names(family, on_disk).items():
        shapes[name] = shared_shapes[role]
    return shapes


def check_saved_layout(family: HFFamily, expert_layout: str) -> None:
    """A `ValueError` for per-expert names of a family whose checkpoints are known in their fused names only.

    Its per-expert names would be made up (K3 in transformers' draft: no conversion from another layout is
    known), so neither a state dict nor a folder is written or read under them.
    """
    if expert_layout == "per_expert" and family.saved_layout == "fused":
        raise ValueError(f"expert_layout='per_expert': {family.model_type}'s folders hold its fused names only "
                         "(no per-expert names of its checkpoints are known); use expert_layout='fused'")


#: The shared MLP's modules in memory, by role (every family spells them so in transformers 5).
_SHARED_IN_MEMORY = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _shared_names(family: HFFamily, on_disk: bool) -> dict[str, str]:
    """The shared MLP's tensor names by role ("gate", "up", "down"), in memory or on disk; none without one."""
    if family.shared_modules is None:
        return {}
    return {role: f"shared_experts.{module if on_disk else _SHARED_IN_MEMORY[role]}.weight"
            for role, module in family.shared_modules.items()}


def _k3_names_of(family: HFFamily, config: MoEConfig, on_disk: bool) -> dict[str, str]:
    """The family's names of the tensors other than the routed experts -> K3's block-relative names."""
    names = {"gate.weight": "gate.weight"}
    if family.bias is not None:
        names[family.bias_on_disk if on_disk else family.bias] = "gate.e_score_correction_bias"
    if family.latent_projections is not None and config.use_latent_projection:
        down, up = family.latent_projections
        names[down], names[up] = "routed_expert_down_proj.weight", "routed_expert_up_proj.weight"
    if family.latent_norm is not None:
        names[family.latent_norm] = "routed_expert_norm.weight"
    for role, name in _shared_names(family, on_disk).items():
        names[name] = f"shared_experts.{_SHARED_IN_MEMORY[role]}.weight"
    return names


def _check_family_config(config: MoEConfig, family: HFFamily) -> None:
    """A `ValueError` when `config` is a layer `family`'s block cannot hold (a latent, shared experts, ...)."""
    wrong = [f"{field}={getattr(config, field)!r} (the block has {value!r})" for field, value in family.fixed.items()
             if field != "situ_linear_beta" and getattr(config, field) != value]
    if config.latent_size != config.hidden_size and family.latent_projections is None:
        wrong.append(f"latent_size={config.latent_size} (the block has none: latent_size = hidden_size)")
    if config.activation != family.activation:
        wrong.append(f"activation={config.activation!r} (the block's experts are {family.activation!r})")
    if config.shared_intermediate_size not in (None, config.num_shared_experts * config.intermediate_size) \
            and "shared_intermediate_size" not in family.keys:
        wrong.append(f"shared_intermediate_size={config.shared_intermediate_size} (the block's shared width is "
                     "num_shared_experts x intermediate_size)")
    if family.shared_modules is None and config.shared_size:
        wrong.append(f"num_shared_experts={config.num_shared_experts} (the block has no shared experts)")
    if wrong:
        raise ValueError(f"config is not a layer {family.block_class} ({family.model_type}) holds: " + ", ".join(wrong))


def _expert_layout_of(names: set[str], family: HFFamily) -> str:
    """'per_expert' when the block-relative names hold the family's modules one per expert, else 'fused'."""
    modules = "|".join(map(re.escape, family.expert_modules.values()))
    return "per_expert" if any(re.match(rf"experts\.\d+\.({modules})\.", name) for name in names) else "fused"


def _k3_names_from_family(values: Mapping[str, np.ndarray], config: MoEConfig, family: HFFamily,
                          layout: str) -> dict[str, np.ndarray]:
    """The K3 block's names for a family block's checked tensors: the fused experts split, a zero bias added."""
    n, d, f = config.num_experts, config.hidden_size, config.intermediate_size
    on_disk = layout == "per_expert"
    out = {ours: values[theirs] for theirs, ours in _k3_names_of(family, config, on_disk).items() if theirs in values}
    if family.has_shared and not family.gated and "shared_experts.up_proj.weight" in out:
        # An ungated shared expert: the GLU relu(a) b, gate and up one matrix. (A zero-width one's
        # zero-element tensors may be left out of the state dict: then neither is there.)
        out["shared_experts.gate_proj.weight"] = out["shared_experts.up_proj.weight"]
    for e in range(n):
        if on_disk:
            matrices = {role: values[f"experts.{e}.{module}.weight"] for role, module in family.expert_modules.items()}
        elif family.gated:
            gate_up = values["experts.gate_up_proj"][e]  # [2f, l]: the gate's rows, then the up's
            matrices = {"gate": gate_up[:f], "up": gate_up[f:], "down": values["experts.down_proj"][e]}
        else:
            matrices = {"up": values["experts.up_proj"][e], "down": values["experts.down_proj"][e]}
        if not family.gated:  # ungated: w1 = w3 = up, so that relu(W z) (W z) = relu(W z)^2
            matrices["gate"] = matrices["up"]
        for role, module in EXPERT_ROLES.items():
            out[f"experts.{e}.{module}.weight"] = matrices[role]
    if not family.has_bias:  # a router without a selection bias selects by the scores alone: b = 0
        out["gate.e_score_correction_bias"] = np.zeros(n, dtype=np.float32)
    if not family.has_shared:
        out.update({"shared_experts.gate_proj.weight": np.zeros((0, d), np.float32),
                    "shared_experts.up_proj.weight": np.zeros((0, d), np.float32),
                    "shared_experts.down_proj.weight": np.zeros((d, 0), np.float32)})
    return out


def _check_layout(expert_layout: Any) -> None:
    if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be None (told by the names) or one of {EXPERT_LAYOUTS}, "
                         f"got {expert_layout!r}")


def _family_base(state_dict: Mapping[str, Any], family: HFFamily, layer: int | None, prefix: str,
                 expert_layout: str | None) -> tuple[str, str | None]:
    """`(base, layout)`: where the block's names start, and its layout when the base tells it (None: the names)."""
    if layer is None or expert_layout is not None:
        return block_prefix(layer, prefix, family.model_type, expert_layout or "fused"), expert_layout
    fused = block_prefix(layer, prefix, family.model_type, "fused")
    on_disk = block_prefix(layer, prefix, family.model_type, "per_expert")
    if fused == on_disk:
        return fused, None
    if any(isinstance(key, str) and key.startswith(on_disk) for key in state_dict):
        return on_disk, "per_expert"
    return fused, "fused"


def _params_from_family_state_dict(state_dict: Mapping[str, Any], config: MoEConfig, model_type: str,
                                   base: str, dtype: Any, hash_layer: bool = False,
                                   expert_layout: str | None = None) -> MoEParams:
    """`params_from_hf_state_dict` for a transformers family's block (`model_type`)."""
    family = record_of(model_type)
    ours = _names_under(state_dict, base)
    layout = expert_layout or _expert_layout_of({name for name in ours if isinstance(name, str)}, family)
    shapes = family_tensor_shapes(config, model_type, layout)
    problems, values = _Problems(), {}
    table = family.hash_table
    table_name = {table} if table is not None and (table in ours or hash_layer) else set()
    bias = family.bias_on_disk if layout == "per_expert" else family.bias
    if hash_layer:  # DeepSeek-V4's hash layer: the table stands where the bias would (read by hf_hash_table)
        del shapes[bias]
        if table not in ours:
            problems.missing.append(base + table)
    elif table is not None and table in ours:
        problems.wrong.append(f"{base}{table}: a hash layer's table; read the layer with hash_layer=True "
                              "and its table with hf_hash_table")
    for name, shape in shapes.items():
        if name not in ours:
            if math.prod(shape):
                problems.missing.append(base + name)
            continue
        value = as_numpy(state_dict[ours[name]], base + name)
        if dtype_name(value.dtype) not in _FLOATS or tuple(value.shape) != shape:
            problems.wrong.append(f"{base}{name}: expected floating {_shape_text(shape)}, "
                                  f"got {value.dtype} {_shape_text(tuple(value.shape))}")
        values[name] = value
    extra = [name for name in ours if name not in shapes and name not in table_name]
    problems.extra += sorted(base + name for name in extra if isinstance(name, str))
    problems.extra += [repr(name) for name in extra if not isinstance(name, str)]
    if problems:
        where = f"{family.block_class}'s names, {layout}" + (f", under {base!r}" if base else "")
        raise problems.error(where)
    if hash_layer:
        _checked_table(as_numpy(state_dict[ours[table]], base + table), config, base + table, model_type,
                       distinct=True)
    k3 = _k3_names_from_family(values, config, family, layout)
    if hash_layer:
        k3["gate.e_score_correction_bias"] = np.zeros(config.num_experts, dtype=np.float32)
    return params_from_hf_state_dict(k3, config, dtype=dtype)


def _check_hash_layer(hash_layer: Any, model_type: str | None) -> None:
    """`hash_layer` must be a bool, and True only for a family with hash layers (DeepSeek-V4)."""
    if not isinstance(hash_layer, bool):
        raise TypeError(f"hash_layer must be True or False, got {type(hash_layer).__name__} {hash_layer!r}")
    if hash_layer and (model_type is None or record_of(model_type).hash_table is None):
        raise ValueError(f"hash_layer=True reads the hash layers of {_hashed_families()}: pass one of them as "
                         f"model_type, got model_type={model_type!r}")


def _hashed_families() -> list[str]:
    from ..families import ALL_RECORDS

    return sorted(name for name, family in ALL_RECORDS.items() if family.hash_table is not None)


def _checked_table(table: Any, config: MoEConfig, name: str, model_type: str | None, *,
                   distinct: bool = False) -> np.ndarray:
    """A hash layer's table `[vocab, k]` of expert ids in `[0, n)`, as int64; a `ValueError` naming `name`.

    With `distinct`, each row must name $k$ different experts (as `route_by_table` requires).
    """
    if model_type is None or record_of(model_type).hash_table is None:
        raise ValueError(f"{name} is a hash layer's table, held by {_hashed_families()}: pass one of them as "
                         f"model_type, got model_type={model_type!r}")
    value = as_numpy(table, name)
    if not np.issubdtype(value.dtype, np.integer) or value.ndim != 2 or value.shape[1] != config.top_k:
        raise ValueError(f"{name} must be an integer table [vocab, k={config.top_k}] of expert ids, got "
                         f"{value.dtype} {_shape_text(tuple(value.shape))}")
    if value.size and (int(value.min()) < 0 or int(value.max()) >= config.num_experts):
        raise ValueError(f"{name} must hold expert ids in [0, {config.num_experts}), got values in "
                         f"[{int(value.min())}, {int(value.max())}]")
    if distinct and value.size:
        ordered = np.sort(value, axis=1)
        repeated = np.flatnonzero(np.any(ordered[:, 1:] == ordered[:, :-1], axis=1))
        if repeated.size:
            row = int(repeated[0])
            raise ValueError(f"{name}[{row}] = {value[row].tolist()} names an expert twice ({repeated.size} rows "
                             "do): each token's k experts must be distinct, as route_by_table requires")
    return value.astype(np.int64)


def hf_hash_table(state_dict: Mapping[str, Any], config: MoEConfig, *, layer: int | None = None,
                  prefix: str = "", model_type: str = "deepseek_v4") -> np.ndarray:
    """A hash layer's table (DeepSeek-V4's `gate.tid2eid`), `[vocab, k]` int64: each token id's experts.

    Pass it with the token ids to `route_by_table`, and the route to
    `stable_latent_moe(..., routing=...)`. Names as `params_from_hf_state_dict`
    reads them with `model_type` (in memory or on disk with `layer`); a missing or malformed table
    is a `ValueError` naming it.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping from tensor names to tensors, got {type(state_dict).__name__}")
    family = record_of(model_type)
    _check_hash_layer(True, model_type)
    base, _ = _family_base(state_dict, family, layer, prefix, None)
    ours = _names_under(state_dict, base)
    table = family.hash_table
    if table not in ours:
        raise ValueError(f"the state dict holds no hash-layer table {base}{table} (a {family.model_type} layer "
                         "routed by a table holds one)")
    return _checked_table(as_numpy(state_dict[ours[table]], base + table), config, base + table, model_type,
                          distinct=True)


def _family_state_dict_from_params(k3: Mapping[str, np.ndarray], config: MoEConfig, model_type: str, base: str,
                                   expert_layout: str, table: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """`hf_state_dict_from_params` for a transformers family's block, from K3's block-relative names."""
    family = record_of(model_type)
    on_disk = expert_layout == "per_expert"
    names = family_tensor_shapes(config, model_type, expert_layout)
    bias = k3["gate.e_score_correction_bias"]
    if (not family.has_bias or table is not None) and np.any(bias != 0):
        holder = "a hash layer, which routes by its table," if table is not None else family.block_class
        raise ValueError(f"params['gate.e_score_correction_bias'] holds nonzero values, and {holder} "
                         f"has no selection bias to hold them (model_type={model_type!r}): writing would change "
                         "the routes")
    if table is not None:
        del names[family.bias_on_disk if on_disk else family.bias]
    if not family.gated:
        _check_tied(k3, config)
    n = config.num_experts
    k3_name = _k3_names_of(family, config, on_disk)
    module_role = {module: role for role, module in family.expert_modules.items()}
    out: dict[str, np.ndarray] = {}
    for name in names:
        if name == "experts.up_proj":  # [n, f, l], ungated experts
            out[base + name] = np.stack([k3[f"experts.{e}.w3.weight"] for e in range(n)])
        elif name == "experts.gate_up_proj":  # [n, 2f, l]: the gate's rows, then the up's
            out[base + name] = np.stack([np.concatenate([k3[f"experts.{e}.w1.weight"], k3[f"experts.{e}.w3.weight"]])
                                         for e in range(n)])
        elif name == "experts.down_proj":  # [n, l, f]
            out[base + name] = np.stack([k3[f"experts.{e}.w2.weight"] for e in range(n)])
        elif name.startswith("experts."):
            e, module = name.split(".")[1:3]
            out[base + name] = k3[f"experts.{e}.{EXPERT_ROLES[module_role[module]]}.weight"]
        else:
            out[base + name] = k3[k3_name[name]]
    if table is not None:
        out[base + family.hash_table] = table.copy()
    return out


def _check_tied(k3: Mapping[str, np.ndarray], config: MoEConfig) -> None:
    """Ungated experts are written from tied weights only: every expert's w1 equals its w3, as the shared gate its up."""
    untied = [e for e in range(config.num_experts)
              if not np.array_equal(k3[f"experts.{e}.w1.weight"], k3[f"experts.{e}.w3.weight"])]
    if untied or not np.array_equal(k3["shared_experts.gate_proj.weight"], k3["shared_experts.up_proj.weight"]):
        where = f"experts.w1 and experts.w3 differ for experts {untied[:5]}" if untied else \
            "shared_experts.gate_proj.weight and shared_experts.up_proj.weight differ"
        raise ValueError(f"activation='relu2' is an ungated expert, stored as one up matrix: the GLU's gate and up "
                         f"weights must be equal, but {where}")
