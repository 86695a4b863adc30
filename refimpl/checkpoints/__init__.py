r"""Checkpoints and tensors: the released weights read as they are stored, and written back.

| module | what it holds |
|---|---|
| `refimpl.checkpoints.hf_checkpoint` | one MoE layer of a Kimi K3 checkpoint directory: read with its experts kept packed in MXFP4, and written in the same layout |
| `refimpl.checkpoints.safetensors` | the files of such a directory read safely: headers checked, tensors memory-mapped, nothing outside the folder opened |
| `refimpl.checkpoints.state_dict` | porting: one block's weights to and from Hugging Face tensor names, for any framework's state dict |

The element formats themselves (MXFP4, MXFP8) are `refimpl.mx`, which the
layer also uses for its deployment precision.
"""

from __future__ import annotations

from .hf_checkpoint import (
           INCOMPLETE_SAVE_MARK,
           K3_QUANTIZATION_CONFIG,
           ExpertStack,
           load_hf_layer,
           save_hf_layer,
)
from .safetensors import open_safetensors, read_safetensors_header
from .state_dict import (
           family_tensor_shapes,
           hf_hash_table,
           hf_state_dict_from_params,
           hf_tensor_shapes,
           params_from_hf_state_dict,
)

__all__ = ["INCOMPLETE_SAVE_MARK", "K3_QUANTIZATION_CONFIG", "ExpertStack", "family_tensor_shapes",
           "hf_hash_table", "hf_state_dict_from_params", "hf_tensor_shapes", "load_hf_layer", "open_safetensors", "params_from_hf_state_dict",
           "read_safetensors_header", "save_hf_layer"]
