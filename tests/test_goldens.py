"""The golden files, read back as a port in another language would: safetensors and PyTorch, not refimpl.

`python -m refimpl.goldens DIR --sizes test` runs once as a subprocess, as a user runs it. Its files are read with
safetensors' PyTorch reader (`safetensors.torch.load_file`) and its manifest with `json`, then:

* each family's file loads strictly into transformers' own block, built literally from the manifest's
  `text_config` (`ConfigClass(**text_config)`, eager experts), whose output, router logits, route, weights and
  gradients (PyTorch's autograd) agree with the stored ones within the manifest's tolerance; K3's file does the same
  with the PyTorch transcription of K3's modeling code (`tests/hf_reference_block.py`);
* the stages are recomputed in PyTorch from the stored inputs: the logits exactly in float32, the scores, the
  route (with groups) and the weights, the latent sum from the expert outputs, Eq. (14) from its definition;
* every route has the margin the manifest claims, and float32 selects it;
* two runs write the same bytes; an existing manifest and a bad folder are refused in one line.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from hf_reference_block import KimiSparseMoeBlock
from safetensors.torch import load_file

import refimpl
import refimpl.goldens
from refimpl import MoEConfig
from refimpl.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")


def run_goldens(folder: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "refimpl.goldens", str(folder), *extra], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


@pytest.fixture(scope="module")
def goldens(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("goldens") / "out"
    done = run_goldens(folder, "--sizes", "test")
    assert done.returncode == 0, done.stderr
    return folder, json.loads((folder / "manifest.json").read_text())


def entry_of(goldens, model_type: str) -> tuple[dict, dict[str, torch.Tensor]]:
    folder, manifest = goldens
    (entry,) = [e for e in manifest["files"] if e["model_type"] == model_type and e["widths"] == "test"]
    return entry, load_file(str(folder / entry["file"]))


def within(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> bool:
    """The manifest's rule: max |actual - expected| <= rtol * max |expected| over the whole tensor."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max()) <= rtol * float(expected.abs().max())


def block_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block's own tensors: every name that is not an input, a stage, a gradient or a balancing batch."""
    return {name: value for name, value in tensors.items()
            if name not in ("x", "y", "dy") and not name.startswith(("stage.", "grad.", "balancing."))}


# ---------------------------------------------------------------------------
# The command and the manifest
# ---------------------------------------------------------------------------

def test_the_manifest_lists_k3_and_every_family_with_a_tolerance_for_every_tensor(goldens):
    folder, manifest = goldens
    assert manifest["refimpl_version"] == refimpl.__version__
    assert sorted(e["model_type"] for e in manifest["files"]) == sorted(["kimi_k3", *FAMILIES])
    assert {p.name for p in folder.iterdir()} == {"manifest.json"} | {e["file"] for e in manifest["files"]}
    for entry in manifest["files"]:
        tensors = load_file(str(folder / entry["file"]))
        assert set(entry["tolerance"]) == set(tensors), entry["file"]
        assert all(0 <= rtol < 1e-4 for rtol in entry["tolerance"].values())
        exact = ["x", "dy", "stage.route_index", "stage.logits", "balancing.scores", "balancing.bias",
                 *block_tensors(tensors)]
        assert all(entry["tolerance"][name] == 0 for name in exact), entry["file"]
        assert {"stage.scores", "stage.biased_scores", "stage.route_weights", "stage.expert_outputs",
                "stage.latent_sum", "stage.routed_output", "stage.output", "grad.x", "balancing.eq14",
                "balancing.appendix_d"} <= set(tensors)
        assert tensors["x"].dtype == torch.float32 and tensors["y"].dtype == torch.float64
        assert torch.equal(tensors["y"], tensors["stage.output"])
        # What reads the keys reads the layer the file was computed for (K3's keys as K3's own code).
        config = MoEConfig.from_hf_config(entry["text_config"])
        assert tensors["stage.route_index"].shape == (entry["tokens"], config.top_k)


def test_two_runs_write_the_same_bytes(goldens, tmp_path):
    folder, manifest = goldens
    assert run_goldens(tmp_path / "again", "--sizes", "test").returncode == 0
    for name in ["manifest.json", *(e["file"] for e in manifest["files"])]:
        assert (tmp_path / "again" / name).read_bytes() == (folder / name).read_bytes(), name


def test_an_existing_manifest_and_a_bad_folder_are_refused_in_one_line(goldens, tmp_path):
    folder, _ = goldens
    before = (folder / "manifest.json").read_bytes()
    refused = run_goldens(folder, "--sizes", "test")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "--overwrite" in refused.stderr
    assert (folder / "manifest.json").read_bytes() == before
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    refused = run_goldens(a_file, "--sizes", "test")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "not a folder" in refused.stderr


# ---------------------------------------------------------------------------
# Each family's file against transformers' own block; K3's against its code's transcription
# ---------------------------------------------------------------------------

def family_block(model_type: str, text_config: dict) -> torch.nn.Module:
    """transformers' block, built literally: `ConfigClass(**text_config)`, eager experts, float64."""
    family = FAMILIES[model_type]
    config = getattr(transformers, family.config_class)(**text_config)
    config._experts_implementation = "eager"
    block_class = getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"),
                          family.block_class)
    takes_layer = "layer_idx" in inspect.signature(block_class.__init__).parameters
    return (block_class(config, 0) if takes_layer else block_class(config)).double()


def check_block(block: torch.nn.Module, entry: dict, tensors: dict[str, torch.Tensor], *, batched: bool = True) -> None:
    """Load strictly, run x (`[1, m, d]` when `batched`), hold y, the router's outputs and the gradients."""
    rtol = entry["tolerance"]
    block.load_state_dict(block_tensors(tensors), strict=True)
    router = {}
    block.gate.register_forward_hook(lambda module, args, out: router.update(out=out))
    x = tensors["x"].double().requires_grad_()
    y = block(x[None])[0] if batched else block(x)
    assert within(y.detach(), tensors["y"], rtol["y"])
    if len(router["out"]) == 3:  # transformers' routers: logits, top-k weights, top-k experts
        logits, weights, index = router["out"]
        assert torch.equal(logits.double(), tensors["stage.logits"])  # the grid makes float32 exact
        # The same experts and weights; DeepSeek's router lists them in its own order (topk, not sorted).
        ours, order = index.sort(dim=-1)
        expected, expected_order = tensors["stage.route_index"].sort(dim=-1)
        assert torch.equal(ours, expected)
        assert within(weights.detach().gather(1, order),
                      tensors["stage.route_weights"].gather(1, expected_order), rtol["stage.route_weights"])
    (y * tensors["dy"].double()).sum().backward()
    assert within(x.grad, tensors["grad.x"], rtol["grad.x"])
    for name, parameter in block.named_parameters():  # an expert no token chose has no gradient: zeros
        grad = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad
        assert within(grad, tensors[f"grad.{name}"], rtol[f"grad.{name}"]), name


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_familys_file_matches_transformers_block(goldens, model_type):
    entry, tensors = entry_of(goldens, model_type)
    check_block(family_block(model_type, entry["text_config"]), entry, tensors)


def test_k3s_file_matches_the_transcription_of_k3s_code(goldens):
    entry, tensors = entry_of(goldens, "kimi_k3")
    block = KimiSparseMoeBlock(entry["text_config"]).double()
    check_block(block, entry, tensors, batched=False)
    # K3's gate returns (experts, weights): the route, by biased score descending as stored.
    index, weights = block.gate(tensors["x"].double())
    assert torch.equal(index, tensors["stage.route_index"])
    assert within(weights, tensors["stage.route_weights"], entry["tolerance"]["stage.route_weights"])


# ---------------------------------------------------------------------------
# The stages, recomputed in PyTorch
# ---------------------------------------------------------------------------

def torch_route(biased: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek's group-limited top-k: groups scored by their two best, the rest masked out."""
    m, n = biased.shape
    if n_group > 1 and topk_group < n_group:
        grouped = biased.view(m, n_group, -1)
        chosen = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices  # [m, tg]
        keep = torch.zeros(m, n_group, dtype=torch.bool).scatter_(1, chosen, True)
        biased = biased.masked_fill(~keep.repeat_interleave(n // n_group, dim=1), float("-inf"))
    return biased.topk(k, dim=-1).indices


@pytest.mark.parametrize("model_type", sorted(["kimi_k3", *FAMILIES]))
def test_the_stages_recomputed_in_pytorch(goldens, model_type):
    entry, t = entry_of(goldens, model_type)
    rtol = entry["tolerance"]
    config = MoEConfig.from_hf_config(entry["text_config"])  # the layer's numbers, as its keys give them
    x, w = t["x"], t["gate.weight"]
    logits32 = x @ w.T  # float32, in PyTorch's own order: exact on the grid
    assert torch.equal(logits32.double(), t["stage.logits"])
    logits = t["stage.logits"]
    scores = {"sigmoid": torch.sigmoid, "softmax": lambda z: z.softmax(-1),
              "sqrtsoftplus": lambda z: torch.nn.functional.softplus(z).sqrt()}[config.score_function](logits)
    assert within(scores, t["stage.scores"], rtol["stage.scores"])
    bias = t.get("gate.e_score_correction_bias", torch.zeros(config.num_experts)).double()
    assert within(scores + bias, t["stage.biased_scores"], rtol["stage.biased_scores"])
    index = torch_route(t["stage.biased_scores"], config.top_k, config.n_group, config.topk_group)
    assert torch.equal(index, t["stage.route_index"])
    raw = scores.gather(1, index)
    if config.renormalize:
        raw = raw / raw.sum(-1, keepdim=True)
    assert within(raw * config.routed_scaling_factor, t["stage.route_weights"], rtol["stage.route_weights"])
    mixed = torch.einsum("mk,mkl->ml", t["stage.route_weights"], t["stage.expert_outputs"])
    assert within(mixed, t["stage.latent_sum"], rtol["stage.latent_sum"])
    total = t["stage.routed_output"] + t.get("stage.shared_output", torch.zeros_like(t["y"]))
    assert within(total, t["y"], rtol["y"])


@pytest.mark.parametrize("model_type", sorted(["kimi_k3", *FAMILIES]))
def test_every_route_has_its_margin_and_float32_selects_it(goldens, model_type):
    entry, t = entry_of(goldens, model_type)
    config = MoEConfig.from_hf_config(entry["text_config"])
    biased = t["stage.biased_scores"]
    chosen = biased.gather(1, t["stage.route_index"])  # [m, k], descending
    others = biased.scatter(1, t["stage.route_index"], float("-inf"))
    if config.n_group == 1:  # without groups, the k-th chosen is ahead of every other expert by the margin
        first_out = others.max(-1).values
        assert (chosen[:, -1] - first_out >= entry["route_margin_required"]).all()
    assert (chosen[:, :-1] - chosen[:, 1:] >= entry["route_margin_required"]).all()
    assert entry["route_margin"] >= entry["route_margin_required"] > 0
    # The gate as float32 computes it: the same experts.
    scores32 = {"sigmoid": torch.sigmoid, "softmax": lambda z: z.softmax(-1),
                "sqrtsoftplus": lambda z: torch.nn.functional.softplus(z).sqrt()}[config.score_function](
        t["x"] @ t["gate.weight"].T)
    bias32 = t.get("gate.e_score_correction_bias", torch.zeros(config.num_experts))
    index32 = torch_route(scores32 + bias32, config.top_k, config.n_group, config.topk_group)
    assert torch.equal(index32, t["stage.route_index"])


@pytest.mark.parametrize("model_type", ["kimi_k3", "qwen3_moe"])
def test_the_balancing_updates_are_eq_14_and_its_histogram(goldens, model_type):
    entry, t = entry_of(goldens, model_type)
    s, b = t["balancing.scores"].double(), t["balancing.bias"].double()
    k, bins = entry["balancing"]["top_k"], entry["balancing"]["bins"]
    m, n = s.shape
    q, rest = divmod(m * k, n)
    assert rest == 0  # a whole target load: the (q + 1)-th largest margin, no interpolation
    alpha = (s + b).topk(k + 1, dim=-1).values[:, -1]  # [m] each token's cutoff
    margins = s - alpha[:, None]  # [m, n]
    threshold = -margins.topk(q + 1, dim=0).values[-1]  # [n]
    eq14 = threshold - threshold.mean()
    assert within(eq14, t["balancing.eq14"], entry["tolerance"]["balancing.eq14"])
    width = (float(b.max()) - float(b.min()) + 2) / bins  # Appendix D: within a bin width, then centred
    assert float((t["balancing.appendix_d"] - t["balancing.eq14"]).abs().max()) <= 2 * width


def test_one_familys_published_widths_match_its_block(tmp_path):
    """`--sizes published --model-type qwen3_moe`: the published widths (Qwen3MoeConfig's own defaults, the
    routed experts cut as the manifest says), stored in bfloat16, still match transformers' block."""
    folder = tmp_path / "published"
    done = run_goldens(folder, "--sizes", "published", "--model-type", "qwen3_moe")
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads((folder / "manifest.json").read_text())["files"]
    defaults = transformers.Qwen3MoeConfig()
    assert entry["widths"] == "published" and entry["model_type"] == "qwen3_moe"
    assert entry["text_config"]["hidden_size"] == defaults.hidden_size
    assert entry["text_config"]["moe_intermediate_size"] == defaults.moe_intermediate_size
    assert set(entry["capped"]) <= {"num_local_experts", "num_experts_per_tok"}
    tensors = load_file(str(folder / entry["file"]))
    assert tensors["x"].dtype == torch.bfloat16 and not any(name.startswith("grad.") for name in tensors)
    block = family_block("qwen3_moe", entry["text_config"])
    block.load_state_dict({name: value.double() for name, value in block_tensors(tensors).items()}, strict=True)
    with torch.no_grad():
        y = block(tensors["x"].double()[None])[0]
    assert within(y, tensors["y"], entry["tolerance"]["y"])


def test_an_unknown_family_is_refused_by_the_command_and_the_function(tmp_path):
    refused = run_goldens(tmp_path / "out", "--model-type", "llama")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and "llama" in refused.stderr
    with pytest.raises(ValueError, match="model_types"):
        refimpl.goldens.golden_cases("test", ["llama"])
    assert not (tmp_path / "out").exists()
