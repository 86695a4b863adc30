r"""Checkpoints and tensors: one MoE layer of any family's folder, read in one call and written back.

A porter holds files, not a state dict: a folder that transformers' `save_pretrained` wrote, or a
release. `load_hf_layer(folder, L)` reads MoE layer $L$ of such a folder for every family of
`refimpl.families`, and returns `(config, params)` that every function of this package computes with:

* **as `save_pretrained` writes it**: by default one tensor per expert under the family's original
  names (`experts.{e}.gate_proj.weight`, Mixtral's `experts.{e}.w1.weight`, ...) and prefix; with
  `save_original_format=False` the fused names transformers holds in memory
  (`experts.gate_up_proj`, `experts.down_proj`); in one `model.safetensors` or sharded with
  `model.safetensors.index.json`;
* **as released**: K3's own folder, its experts packed in MXFP4 and kept packed
  (`refimpl.checkpoints.hf_checkpoint`), and K3 in transformers' draft layout (`kimi_k3`, fused).

It is strict: every tensor of the block is read and none is left over, and which layers are MoE
follows the family's own rule (`first_k_dense_replace`, `mlp_only_layers`/`decoder_sparse_step`,
`mlp_layer_types`, `layers_block_type`, read from `config.json` with the family's class defaults); a
dense layer is refused by name.

## One layer of a folder, start to end

A tiny Qwen3-MoE, saved by transformers and read back (a trained model would come from
`from_pretrained`; the folder is all that matters):

```python
import numpy as np
import torch
import transformers

import refimpl

hf = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, num_hidden_layers=4, mlp_only_layers=[0, 2],
                                 num_attention_heads=2, num_key_value_heads=2, head_dim=32, vocab_size=32,
                                 experts_implementation="eager")  # the experts as a loop, in float64 too
model = transformers.Qwen3MoeForCausalLM(hf).double().eval()
model.save_pretrained("qwen3-tiny")                       # model.layers.{L}.mlp.experts.{e}.gate_proj.weight, ...

config, params = refimpl.load_hf_layer("qwen3-tiny", 1, dtype=np.float64)   # layers 1 and 3 are MoE
x = np.random.default_rng(0).standard_normal((5, 64))    # [m, d]
y = refimpl.stable_latent_moe(x, params, config)         # [m, d]
with torch.no_grad():
    y_model = model.model.layers[1].mlp(torch.from_numpy(x)[None])[0].numpy()   # equals y (float32 router)

refimpl.save_hf_layer("qwen3-layer", config, params, layer=1, model_type="qwen3_moe")   # back as Qwen3-MoE
```

`load_hf_layer("qwen3-tiny", 0)` says that layer 0 is a dense layer of this model, by
`Qwen3MoeConfig`'s layer keys. The test suite runs this block as written and holds `y` to the
block's output within the float32 rounding of transformers' router.

## Every family

The same four lines read every family's folder; what changes is the model that writes it and the
keys that say which layers are MoE (the rule's keys, and the MoE layers of the small model the tests
save, `HFFamily.test_keys`):

<div class="refimpl-names" markdown>

| `model_type` | the model saved | MoE layers by | the tests' model | what else differs |
|---|---|---|---|---|
| `deepseek_v3` | `DeepseekV3ForCausalLM` | `first_k_dense_replace` | 1, 2 of 3 | its attention keys (`kv_lora_rank`, ...) in the configuration; expert groups |
| `deepseek_v4` | `DeepseekV4ForCausalLM` | `mlp_layer_types`, `num_hash_layers` | 0, 1, 2, 3 of 4 | a hash layer comes back with its table, `params.tid2eid`: route it with `route_by_table` and the token ids, and pass the result as `routing=` |
| `dots1` | `Dots1ForCausalLM` | `first_k_dense_replace` | 1, 2 of 3 | its expert counts are required keys (`Dots1Config` leaves them `None`) |
| `glm4_moe` | `Glm4MoeForCausalLM` | `first_k_dense_replace` | 1, 2 of 3 | nothing |
| `kimi_k25` | `Kimi_K25ForConditionalGeneration` | `first_k_dense_replace` | 1, 2 of 3 | DeepSeek-V3 under `text_config`, its blocks under `language_model.` |
| `kimi_k3` | `KimiK3ForCausalLM` (transformers' draft) | `mlp_layer_types`, `first_k_dense_replace` | 1, 2 of 3 | K3's configuration, read by K3's own code; the fused names only |
| `kimi_linear` | `KimiLinearForCausalLM` | `mlp_layer_types`, `first_k_dense_replace` | 0, 2 of 3 | read as `KimiLinearConfig` reads it; with `auto_map` or a key only K3's code reads, as K3's code |
| `mixtral` | `MixtralForCausalLM` | every layer | 0, 1, 2 of 3 | no selection bias (read as zero), no shared experts |
| `nemotron_h` | `NemotronHForCausalLM` | `layers_block_type`, `hybrid_override_pattern` | 0, 3 of 4 | ungated ReLU² experts on a latent (`activation="relu2"`) |
| `qwen3_moe` | `Qwen3MoeForCausalLM` | `decoder_sparse_step`, `mlp_only_layers` | 1, 3 of 4 | the example above |
| K3, released | the release, or `save_hf_layer` | `first_k_dense_replace`, `moe_layer_freq` | layer 0 dense | the experts stay packed: `ExpertStack`s that decode one expert on `w[e]` |

</div>

## The layouts

Where each family's layer $L$ sits and what its tensors are called, from its record in
`refimpl.families` (a test holds both tables to the records). As `save_pretrained` writes a folder
by default, the routed experts are `experts.{e}.{module}.weight` and the shared ones
`shared_experts.{module}.weight`, the modules in the order gate, up, down (an ungated expert has no
gate). The router is `gate.weight` everywhere; the latent projections keep their names
(Nemotron-H's `fc1_latent_proj`/`fc2_latent_proj`, K3's `routed_expert_*`).

<div class="refimpl-names" markdown>

| `model_type` | block on disk | expert modules | shared modules | router's selection bias, hash table |
|---|---|---|---|---|
| `deepseek_v3` | `model.layers.{L}.mlp.` | `gate_proj` `up_proj` `down_proj` | `gate_proj` `up_proj` `down_proj` | `gate.e_score_correction_bias` |
| `deepseek_v4` | `model.layers.{L}.ffn.` | `w1` `w3` `w2` | `w1` `w3` `w2` | `gate.bias`, `gate.tid2eid` |
| `dots1` | `model.layers.{L}.mlp.` | `gate_proj` `up_proj` `down_proj` | `gate_proj` `up_proj` `down_proj` | `gate.e_score_correction_bias` |
| `glm4_moe` | `model.layers.{L}.mlp.` | `gate_proj` `up_proj` `down_proj` | `gate_proj` `up_proj` `down_proj` | `gate.e_score_correction_bias` |
| `kimi_k25` | `language_model.model.blocks.{L}.mlp.` | `gate_proj` `up_proj` `down_proj` | `gate_proj` `up_proj` `down_proj` | `gate.e_score_correction_bias` |
| `kimi_k3` | — (fused only) | — | `gate_proj` `up_proj` `down_proj` | `gate.e_score_correction_bias` |
| `kimi_linear` | `model.layers.{L}.block_sparse_moe.` | `w1` `w3` `w2` | `gate_proj` `up_proj` `down_proj` | `gate.e_score_correction_bias` |
| `mixtral` | `model.layers.{L}.block_sparse_moe.` | `w1` `w3` `w2` | none | none |
| `nemotron_h` | `backbone.layers.{L}.mixer.` | `up_proj` `down_proj` | `up_proj` `down_proj` | `gate.e_score_correction_bias` |
| `qwen3_moe` | `model.layers.{L}.mlp.` | `gate_proj` `up_proj` `down_proj` | none | none |
| K3, released | `model.layers.{L}.block_sparse_moe.` under `language_model.` | `w1` `w3` `w2` in MXFP4: `.weight_packed`, `.weight_scale` | `gate_proj` `up_proj` `down_proj` | `gate.e_score_correction_bias` |

</div>

In memory, and in the files `save_original_format=False` writes, the experts are fused into
`experts.{name}` tensors, the shared modules are `gate_proj`, `up_proj`, `down_proj` and the
selection bias is `gate.e_score_correction_bias`:

<div class="refimpl-names" markdown>

| `model_type` | block in memory | fused experts |
|---|---|---|
| `deepseek_v3` | `model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |
| `deepseek_v4` | `model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |
| `dots1` | `model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |
| `glm4_moe` | `model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |
| `kimi_k25` | `model.language_model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |
| `kimi_k3` | `model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |
| `kimi_linear` | `model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |
| `mixtral` | `model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |
| `nemotron_h` | `model.layers.{L}.mixer.` | `up_proj` `down_proj` |
| `qwen3_moe` | `model.layers.{L}.mlp.` | `gate_up_proj` `down_proj` |

</div>

## Writing back

Each direction has one name for a layout, and a layout a writer cannot express is refused with a
`ValueError` naming it, before anything is written:

* `hf_state_dict_from_params(params, config, model_type=..., layer=L, expert_layout="per_expert")`
  gives the names and prefix `save_pretrained` writes (the on-disk table above), which the
  family's `from_pretrained` loads; `expert_layout="fused"` (the default) gives the in-memory names,
  which its block loads with `load_state_dict(strict=True)`. Without `model_type`, K3's names.
* `save_hf_layer(folder, config, params, layer=L, model_type=...)` writes a folder of that family:
  its own `config.json` keys (which the family's configuration class reads back to the same
  `MoEConfig`, its MoE-layer rule making $L$ an MoE layer) and the layer under its names, per expert
  by default (`kimi_k3`: fused). Without `model_type`, K3's released layout, MXFP4 by default.

Refused, each by name: a field the family's keys give otherwise (shared experts for Mixtral, a latent
for DeepSeek-V3, SiTU for any of them); a nonzero selection bias for a router without one (Qwen3-MoE,
Mixtral); unequal gate and up matrices for Nemotron-H's ungated experts; a DeepSeek-V4 hash layer
without its table, a table for a layer routed by scores, or a table that names an expert twice in a
row; `mxfp4=True` or a `prefix` with a `model_type`; per-expert names for `kimi_k3`, whose folders hold
its fused names only (refused in memory too: `hf_state_dict_from_params`, `params_from_hf_state_dict` and
`family_tensor_shapes` with `expert_layout="per_expert"`); `expert_layout="per_expert"` without a `model_type`; a layer index whose
`config.json` would list more than 100,000 layers one by one (Qwen3-MoE's `mlp_only_layers`, Kimi
Linear's and DeepSeek-V4's `mlp_layer_types`, Nemotron-H's `layers_block_type`: the list grows with the
index, and no model has a thousand layers), while a family whose keys say it in closed form
(`first_k_dense_replace`) writes any index; NaN or an infinity in any parameter.
`tests/test_save_family_layer.py` and `tests/test_family_folders.py` reload what is written through
the family's own `from_pretrained` and compare every tensor.

## Measured: every family's folder

`python benchmarks/family_folders.py` saves each shipped family's small model (float64, hidden 64, 8
experts) in the three layouts, reads every MoE layer with `load_hf_layer` and runs it against the
model's own block on 16 random tokens. It printed the files read and the largest difference relative
to the largest output:

```text
model_type   layout              MoE layers files read                                largest relative difference
deepseek_v3  per_expert                   2 model.safetensors                                            9.64e-08
deepseek_v3  per_expert_sharded           2 12 shards of the index                                       8.73e-08
deepseek_v3  fused                        2 model.safetensors                                            5.32e-08
deepseek_v4  per_expert                   4 model.safetensors                                            7.54e-16
deepseek_v4  per_expert_sharded           4 20 shards of the index                                       7.19e-16
deepseek_v4  fused                        4 model.safetensors                                            8.72e-16
dots1        per_expert                   2 model.safetensors                                            6.72e-08
dots1        per_expert_sharded           2 12 shards of the index                                       7.91e-08
dots1        fused                        2 model.safetensors                                            4.35e-08
glm4_moe     per_expert                   2 model.safetensors                                            1.03e-07
glm4_moe     per_expert_sharded           2 12 shards of the index                                       6.18e-08
glm4_moe     fused                        2 model.safetensors                                            2.68e-08
kimi_k25     per_expert                   2 model.safetensors                                            7.70e-08
kimi_k25     per_expert_sharded           2 12 shards of the index                                       1.36e-07
kimi_k25     fused                        2 model.safetensors                                            1.06e-07
kimi_linear  per_expert                   2 model.safetensors                                            1.05e-07
kimi_linear  per_expert_sharded           2 12 shards of the index                                       9.27e-08
kimi_linear  fused                        2 model.safetensors                                            1.19e-07
mixtral      per_expert                   3 model.safetensors                                            5.36e-08
mixtral      per_expert_sharded           3 12 shards of the index                                       5.78e-08
mixtral      fused                        3 model.safetensors                                            7.27e-08
nemotron_h   per_expert                   2 model.safetensors                                            6.69e-08
nemotron_h   per_expert_sharded           2 8 shards of the index                                        8.77e-08
nemotron_h   fused                        2 model.safetensors                                            5.38e-08
qwen3_moe    per_expert                   2 model.safetensors                                            4.02e-08
qwen3_moe    per_expert_sharded           2 8 shards of the index                                        6.64e-08
qwen3_moe    fused                        2 model.safetensors                                            7.30e-08
```

float32's rounding of the routers, which transformers computes in float32 in a float64 block;
DeepSeek-V4's router runs in the block's dtype, and its rows are float64's rounding. K3's draft
layout is not in transformers 5.24: `tests/test_kimi_k3_draft.py` holds it against a literal build of
the draft's block.

## The modules

| module | what it holds |
|---|---|
| `refimpl.checkpoints.hf_checkpoint` | one MoE layer of a checkpoint folder, any family's or K3's release (experts kept packed in MXFP4), read and written |
| `refimpl.checkpoints.safetensors` | the files of such a folder read safely: headers checked, tensors memory-mapped, nothing outside the folder opened |
| `refimpl.checkpoints.state_dict` | porting: one block's weights to and from each family's tensor names, for any framework's state dict |

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
