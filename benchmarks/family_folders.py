"""Every family's folder, as transformers' `save_pretrained` writes it, read by `load_hf_layer`: files and agreement.

For every record of `refimpl.families` whose model ships in the pinned transformers, a tiny whole model
(`tests/family_folders.py`: hidden 64, 8 experts, 3-4 layers, float64) is saved in each layout a porter meets
(per-expert original names in one file, the same sharded with an index, the fused in-memory names); each MoE
layer is read with `load_hf_layer` and run against the model's own block on 16 random tokens. Printed per
family and layout: the files the layers were read from, and the largest difference relative to the largest
output (float32's rounding of the routers, float64's for DeepSeek-V4's).

    python benchmarks/family_folders.py            # needs torch and transformers (the test extra)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from family_folders import (  # noqa: E402 - the tests' helpers build the tiny models
    LAYOUTS,
    SHIPPED,
    block_of,
    block_output,
    files_read,
    moe_layers,
    refimpl_output,
    save,
    tiny_model,
)

import refimpl  # noqa: E402
from refimpl.families import ALL_RECORDS  # noqa: E402


def main() -> None:
    print(f"{'model_type':<12} {'layout':<19} {'MoE layers':>10} {'files read':<40} {'largest relative difference':>28}")
    rng = np.random.default_rng(0)
    for model_type in SHIPPED:
        family = ALL_RECORDS[model_type]
        model = tiny_model(family)
        for layout in LAYOUTS:
            with tempfile.TemporaryDirectory() as tmp:
                folder = save(model, Path(tmp) / "model", layout)
                hf = json.loads((folder / "config.json").read_text())
                vocab = hf.get("text_config", hf)["vocab_size"]
                layers, files, worst = moe_layers(folder), set(), 0.0
                for layer in layers:
                    config, params = refimpl.load_hf_layer(folder, layer, dtype=np.float64)
                    x = rng.standard_normal((16, config.hidden_size))
                    ids = rng.integers(0, vocab, 16) if params.tid2eid is not None else None
                    y_model = block_output(block_of(model, family, layer), x, ids)
                    y = np.asarray(refimpl_output(config, params, x, ids))
                    worst = max(worst, float(np.abs(y - y_model).max() / np.abs(y_model).max()))
                    files.update(files_read(folder, family, layer))
                shown = ", ".join(sorted(files)) if len(files) <= 2 else f"{len(files)} shards of the index"
                print(f"{model_type:<12} {layout:<19} {len(layers):>10} {shown:<40} {worst:>28.2e}")


if __name__ == "__main__":
    main()
