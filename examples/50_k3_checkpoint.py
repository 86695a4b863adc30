r"""A K3 checkpoint in the released layout: write it, read it back, decode one MXFP4 group by hand

K3 is released as a Hugging Face directory: a nested `config.json`, an index of
safetensors shards, and one MoE layer's tensors under
`language_model.model.layers.{L}.block_sparse_moe.`, with one module per routed
expert stored in MXFP4 (`weight_packed`, `weight_scale`). This example builds a
tiny layer, writes it in exactly that layout with `save_hf_layer`, loads it back
with `load_hf_layer` (the experts stay packed and decode one at a time), runs the
forward pass on it, and decodes one 32-value MXFP4 group by hand from the raw
bytes, so every bit of the format is on the page. It ends with the recipe for the
real checkpoint and the memory that needs.

With `--out DIR` it also draws the error MXFP4 makes on one expert's weights.
"""

# %%
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from refimpl import MoEConfig, init_params, load_hf_layer, save_hf_layer, stable_latent_moe
from refimpl.checkpoints import open_safetensors
from refimpl.layer.latent_moe import stable_latent_moe_reference
from refimpl.mx import E2M1_VALUES, mxfp4_decode
from refimpl.studies.figures import figures_wanted, show_figure

# A layer small enough to print, with widths that are multiples of 32 (MXFP4 blocks).
CONFIG = MoEConfig(hidden_size=64, latent_size=32, num_experts=4, top_k=2, intermediate_size=64,
                   num_shared_experts=1, num_moe_layers=2)
LAYER = 1


# %%
def write_and_list(folder: Path) -> dict[str, np.ndarray]:
    """Write the tiny layer in shards of at most 20 kB and list the folder; returns the original weights."""
    params = init_params(CONFIG, 0, bias_scale=0.05)
    save_hf_layer(folder, CONFIG, params, layer=LAYER, shard_size=20_000)
    print("files:", ", ".join(sorted(p.name for p in folder.iterdir())))
    hf = json.loads((folder / "config.json").read_text())
    text = hf["text_config"]
    print(f"config.json: model_type={hf['model_type']!r}, text_config.model_type={text['model_type']!r}, "
          f"quantization {text['quantization_config']['format']!r}")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    print(f"{len(index)} tensors, for example:")
    shown = ("gate.weight", "gate.e_score_correction_bias", "routed_expert_norm.weight",
             "experts.0.w1.weight_packed", "experts.0.w1.weight_scale")
    for name in [n for n in sorted(index) if n.endswith(shown)]:
        tensor = open_safetensors(folder / index[name])[name]
        print(f"  {name:72s} {str(tensor.dtype):8s} {list(tensor.shape)}  ({index[name]})")
    return params


# %%
def load_and_run(folder: Path, params: dict[str, np.ndarray]) -> None:
    """Load the layer back, show the packed stacks, and run it against the float32 weights it came from."""
    config, packed = load_hf_layer(folder, LAYER)
    print(f"\nload_hf_layer: config == CONFIG: {config == CONFIG}")
    for name in ("experts.w1", "experts.w3", "experts.w2"):
        print(f"  {name}: {packed[name]!r}")
    x = np.random.default_rng(1).standard_normal((6, config.d)).astype(np.float32)
    y_packed = stable_latent_moe(x, packed, config)
    y_float = stable_latent_moe(x, params, config)
    y_by_hand = stable_latent_moe_reference(x, packed, config)  # token by token, float64, same MXFP4 weights
    rel = np.linalg.norm(y_packed - y_float) / np.linalg.norm(y_float)
    print(f"forward on the packed layer vs the float32 weights it was written from: relative difference "
          f"{rel:.3f} (the MXFP4 rounding of the experts)")
    print(f"forward on the packed layer vs the token-by-token reference on the same weights: max difference "
          f"{np.abs(y_packed - y_by_hand).max():.1e}")


# %%
def decode_by_hand(folder: Path) -> None:
    """One 32-value group of experts.0.w1, row 0, from its 16 bytes and its one scale byte."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    base = f"language_model.model.layers.{LAYER}.block_sparse_moe.experts.0.w1"
    packed = open_safetensors(folder / index[base + ".weight_packed"])[base + ".weight_packed"]
    scale = open_safetensors(folder / index[base + ".weight_scale"])[base + ".weight_scale"]
    group, s = packed[0, :16], int(scale[0, 0])
    print(f"\nrow 0, columns 0-31 of experts.0.w1: 16 bytes {' '.join(f'{b:02X}' for b in group)}, "
          f"scale byte {s} -> X = 2^({s} - 127) = 2^{s - 127}")
    print("byte  low nibble (even column)   high nibble (odd column)")
    values = []
    for c, b in enumerate(group[:4].tolist()):
        low, high = b & 0x0F, b >> 4
        print(f"  {b:02X}   code {low:2d} = {E2M1_VALUES[low]:+4.1f} -> col {2 * c:2d}   "
              f"code {high:2d} = {E2M1_VALUES[high]:+4.1f} -> col {2 * c + 1:2d}")
    for b in group.tolist():
        values += [E2M1_VALUES[b & 0x0F], E2M1_VALUES[b >> 4]]
    by_hand = np.array(values, dtype=np.float32) * np.float32(2.0 ** (s - 127))
    decoded = mxfp4_decode(packed[:1, :16], scale[:1, :1])[0]
    print(f"by hand, first 8 values: {np.array2string(by_hand[:8], precision=4)}")
    print(f"mxfp4_decode agrees on all 32: {np.array_equal(by_hand, decoded)}")


# %%
def recipe() -> None:
    """The real checkpoint: the call, and the memory one layer needs."""
    k3 = MoEConfig.k3()
    per_matrix = k3.ell * k3.f  # weights of one expert matrix
    packed = k3.n * 3 * (per_matrix // 2 + per_matrix // 32)  # bytes: codes and scales
    rest = 2 * (k3.n * k3.d + 2 * k3.d * k3.ell + 3 * k3.d * k3.shared_size + k3.ell) + 4 * k3.n  # bf16, bias f32
    float32_experts = k3.n * 3 * per_matrix * 4
    print("\nThe real thing (not run here):")
    print('    config, params = load_hf_layer("/path/to/Kimi-K3", layer=1)')
    print("    y = stable_latent_moe(x, params, config)            # experts decode one at a time")
    print(f"one K3 MoE layer: MXFP4 experts {packed / 1e9:.1f} GB + bf16 router, projections and shared "
          f"experts {rest / 1e9:.2f} GB in the file; in memory after loading: the experts stay packed "
          f"(memory-mapped), the rest becomes float32 ({2 * rest / 1e9:.2f} GB)")
    print(f"the same experts as float32 arrays would take {float32_experts / 1e9:.0f} GB; one expert in "
          f"float32 is {3 * per_matrix * 4 / 1e6:.0f} MB, and the forward pass holds at most one at a time")


# %%
def save_figure(out: Path, folder: Path, params: dict[str, np.ndarray]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, packed = load_hf_layer(folder, LAYER)
    original, decoded = params["experts.w1"][0], packed["experts.w1"][0]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.scatter(original.ravel(), decoded.ravel(), s=4)
    ax.set_xlabel("float32 weight")
    ax.set_ylabel("after MXFP4 (decoded)")
    ax.set_title("experts.0.w1: 16 E2M1 levels per block of 32, one power-of-two scale each")
    fig.tight_layout()
    show_figure(fig, out, "mxfp4_levels.png",
                caption="MXFP4 keeps 16 levels per block of 32 weights with one power-of-two scale, so the "
                        "decoded weights lie on a staircase along the diagonal.",
                alt="Scatter of the decoded MXFP4 weights against the float32 weights of one expert, forming "
                    "steps along the diagonal")


# %%
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figure in this folder")
    args = parser.parse_args(argv)

    # Step 1: a tiny layer, written, loaded back and decoded by hand
    with tempfile.TemporaryDirectory(prefix="k3-tiny-") as tmp:
        folder = Path(tmp)
        params = write_and_list(folder)
        load_and_run(folder, params)
        decode_by_hand(folder)
        if figures_wanted(args.out):
            save_figure(args.out, folder, params)

    # What to see: the router, its bias and the norm are stored whole, in float32, while each expert matrix
    # becomes two uint8 tensors: [64, 16] codes, two 4-bit codes per byte for its 32 columns, and [64, 1]
    # scales, one byte per block of 32. Rounding every expert weight to 4 bits moves the layer's output by a
    # relative 0.184; on the same decoded weights, the float64 token-by-token reference agrees to about 1e-6,
    # the float32 layer's rounding. By hand, byte 92 holds code 2 = +1.0 in its low nibble and code 9 = -0.5
    # in its high one (the nibble's top bit is the sign), and scale byte 123 multiplies both by 2^-4: 0.0625 and -0.0312.

    # Step 2: the real checkpoint
    # MXFP4 stores half a byte per weight plus one scale byte per 32 weights, about an eighth of float32's
    # four bytes; since the forward pass decodes one expert at a time, the float32 copy it needs is one
    # expert's.
    recipe()

    # What to see: the experts of one K3 layer take 15.7 GB packed in the file and would take 118 GB as
    # float32 arrays, 7.5 times more (4.25 bits a weight against 32). Loaded, they stay packed and
    # memory-mapped, and the forward pass decodes one expert at a time, so float32 costs 132 MB at a time, not
    # 118 GB. Only the bfloat16 router, projections and shared experts (0.38 GB) are widened, to 0.76 GB.


if __name__ == "__main__":
    main()
