"""The MoE families of transformers, held against transformers itself (the pinned version of the `test` extra).

For every family of `refimpl.families.FAMILIES` whose block takes the hidden states alone (DeepSeek-V4's hash
layers also take the token ids: `tests/test_deepseek_v4.py` holds it), on drawn configurations in each model's
own keys:

* `MoEConfig.from_hf_config(ConfigClass(**keys).to_dict())` is the layer the block computes: every field equals
  what the constructed block holds (its router's top-k, groups, scaling, renormalization; its experts' count and
  widths; its shared MLP's width), and the number of MoE layers equals the count of blocks in the real model;
* `params_from_hf_state_dict(block.state_dict(), config, model_type=...)` followed by `stable_latent_moe` equals
  the block's forward in float64, within a tolerance derived from the block's float32 router;
* both converters round-trip, and what `hf_state_dict_from_params` writes loads with `strict=True`;
* the defaults the reader assumes for absent keys are the configuration classes' own.

Nothing is skipped: transformers is a test dependency.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import refimpl
from refimpl import MoEConfig
from refimpl.checkpoints import family_tensor_shapes, hf_state_dict_from_params, params_from_hf_state_dict
from refimpl.families import ALL_RECORDS, FAMILIES, K3_ONLY_KEYS


def family_classes(model_type: str) -> tuple[type, type]:
    """transformers' configuration class and MoE block of `model_type`, found by the names its record holds."""
    family = FAMILIES[model_type]
    return getattr(transformers, family.config_class), getattr(importlib.import_module(family.module),
                                                               family.block_class)


# Every family whose block is called on the hidden states alone (DeepSeek-V4's hash layers also take the token
# ids: test_deepseek_v4.py holds it).
BLOCKS = {model_type: family_classes(model_type) for model_type, family in FAMILIES.items()
          if family.hash_table is None}
# A block without shared experts builds zero-width linears; PyTorch's initializer says so, harmlessly.
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")

SIGMOID = tuple(model_type for model_type, family in FAMILIES.items() if family.fixed.get("score_function") == "sigmoid")
U32 = float(np.finfo(np.float32).eps) / 2  # float32's unit roundoff

# Attention sizes the configuration classes need to construct; the MoE block does not read them.
ATTENTION = dict(num_attention_heads=2, num_key_value_heads=2, vocab_size=32)


def test_the_families_are_the_blocks_of_the_pinned_transformers():
    assert transformers.__version__ == "5.24.0"
    # DeepSeek-V4's block takes its layer index and, in hash layers, the token ids: test_deepseek_v4.py holds it.
    assert set(FAMILIES) == set(BLOCKS) | {t for t, family in FAMILIES.items() if family.hash_table is not None}
    for model_type, (config_class, block_class) in BLOCKS.items():
        family = FAMILIES[model_type]
        assert (family.config_class, family.block_class) == (config_class.__name__, block_class.__name__)
        assert config_class.model_type == model_type


# ---------------------------------------------------------------------------
# Defaults: what an absent key means is what the configuration class makes of it
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", sorted(BLOCKS))
def test_each_absent_key_takes_its_configuration_class_default(model_type):
    config_class, _ = BLOCKS[model_type]
    family = FAMILIES[model_type]
    written = config_class().to_dict()
    for field, spec in family.keys.items():
        assert written[spec.key] == spec.default, (field, spec.key)
        for alias in spec.aliases:  # the class accepts the other spelling, and writes its own
            other = 3 if spec.kind in ("integer", "count") else 0.5 if spec.kind == "factor" else not spec.default
            if spec.kind == "activation":
                continue
            assert config_class(**{alias: other}).to_dict()[spec.key] == other, alias
    if family.rule.counts_by_list:  # the layer count is the length of its list of layer kinds
        assert written["layers_block_type"] == family.layer_defaults["layers_block_type"]
        assert config_class().num_hidden_layers == family.num_hidden_layers
    else:
        assert written["num_hidden_layers"] == family.num_hidden_layers
    if family.layers == "first_k_dense":
        assert written["first_k_dense_replace"] == family.layer_defaults["first_k_dense_replace"]
    if family.layers == "mlp_layer_types":  # the class derives its layer types from first_k_dense_replace
        first = family.layer_defaults["first_k_dense_replace"]
        assert written["mlp_layer_types"] == ["dense"] * first + ["sparse"] * (family.num_hidden_layers - first)
    if family.layers == "sparse_step":
        assert written["decoder_sparse_step"] == family.layer_defaults["decoder_sparse_step"]
        assert written["mlp_only_layers"] == family.layer_defaults["mlp_only_layers"]


@pytest.mark.parametrize("model_type", sorted(BLOCKS))
def test_a_default_configuration_reads_as_its_class_builds_it(model_type):
    config_class, block_class = BLOCKS[model_type]
    hf = config_class(**ATTENTION).to_dict()
    for key in ("hidden_size", "moe_intermediate_size", "intermediate_size"):  # small, so the block is cheap
        hf[key] = 16
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if key in hf:
            hf[key] = 16
    hf.update({key: 2 for key in ("n_group", "num_expert_group") if key in hf})
    hf.update({key: 1 for key in ("topk_group",) if key in hf})
    hf.update({spec.key: 2 for spec in FAMILIES[model_type].keys.values() if spec.required and hf[spec.key] is None})
    keys = {k: v for k, v in hf.items() if k not in ("model_type", "transformers_version")}
    block = _block(model_type, keys)
    assert MoEConfig.from_hf_config(hf) == expected_config(block, model_type, hf)


# ---------------------------------------------------------------------------
# Drawn configurations, in each model's own keys
# ---------------------------------------------------------------------------

@st.composite
def family_keys(draw, model_type: str) -> dict:
    """Keys of `model_type`'s configuration for a small block; some left out, to take the class's defaults."""
    family = FAMILIES[model_type]
    spelled = {field: spec.key for field, spec in family.keys.items()}
    n = draw(st.sampled_from([4, 6, 8]))
    if model_type in SIGMOID:
        n_group = draw(st.sampled_from([g for g in (1, 2, 3, 4) if n % g == 0 and n // g >= 2]))
        topk_group = draw(st.integers(1, n_group))
        reachable = topk_group * (n // n_group)
    else:
        reachable = n
    keys = {spelled["hidden_size"]: draw(st.sampled_from([8, 12, 16])), spelled["num_experts"]: n,
            spelled["top_k"]: draw(st.integers(1, min(4, reachable))),
            spelled["intermediate_size"]: draw(st.integers(2, 8)), "num_hidden_layers": draw(st.integers(1, 5))}
    if model_type in SIGMOID:
        keys[spelled["n_group"]], keys["topk_group"] = n_group, topk_group
        keys[spelled["num_shared_experts"]] = draw(st.integers(0 if "shared_intermediate_size" not in family.keys else 1, 2))
    if family.latent_projections is not None:  # Nemotron-H: its own shared width (0: the dense width), a latent
        keys["moe_shared_expert_intermediate_size"] = draw(st.integers(0, 6))
        keys["intermediate_size"] = draw(st.integers(1, 6))
        if draw(st.booleans()):
            keys["moe_latent_size"] = draw(st.integers(2, keys["hidden_size"]))
        keys["layers_block_type"] = draw(st.lists(st.sampled_from(["moe", "mlp", "full_attention"]), min_size=1,
                                                  max_size=5))
        del keys["num_hidden_layers"]
    optional = {}
    if "routed_scaling_factor" in spelled:
        optional[spelled["routed_scaling_factor"]] = draw(st.sampled_from([1.0, 2.5, 0.75]))
    if "renormalize" in spelled:
        optional[spelled["renormalize"]] = draw(st.booleans())
    optional["rms_norm_eps"] = 1e-6
    leave_out = draw(st.sets(st.sampled_from(sorted(optional))))
    keys.update({k: v for k, v in optional.items() if k not in leave_out})
    total = keys.get("num_hidden_layers", len(keys.get("layers_block_type", [])))
    if family.layers in ("first_k_dense", "mlp_layer_types") and draw(st.booleans()):
        keys["first_k_dense_replace"] = draw(st.integers(0, total - 1))
    if family.layers == "mlp_layer_types" and draw(st.booleans()):
        kinds = draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=total, max_size=total))
        assume("sparse" in kinds)
        keys["mlp_layer_types"] = kinds
    if family.layers == "sparse_step":
        keys["decoder_sparse_step"] = draw(st.integers(1, 2))
        keys["mlp_only_layers"] = draw(st.lists(st.integers(0, total + 1), max_size=2, unique=True))
    assume(_moe_layers_of(model_type, keys, None) > 0)  # a configuration with no MoE layer is refused, tested below
    return keys


def _hf_config(model_type: str, keys: dict):
    """transformers' configuration object of `model_type` for `keys` (with the attention sizes it needs)."""
    return BLOCKS[model_type][0](**{**ATTENTION, **keys})


def _block(model_type: str, keys: dict) -> torch.nn.Module:
    """transformers' MoE block of `model_type` for `keys`, in float64, in inference mode."""
    return BLOCKS[model_type][1](_hf_config(model_type, keys)).double().eval()


def expected_config(block: torch.nn.Module, model_type: str, hf: dict) -> MoEConfig:
    """The layer a constructed transformers block computes, read from the block's own attributes."""
    router = block.gate
    d = router.weight.shape[1]
    sigmoid = model_type in SIGMOID
    model_config = block.config if hasattr(block, "config") else None
    if not FAMILIES[model_type].gated:  # Nemotron-H
        n, f, ell = block.experts.up_proj.shape
        latent = isinstance(block.fc1_latent_proj, torch.nn.Linear)
        return MoEConfig(
            hidden_size=d, latent_size=ell, use_latent_projection=latent, use_latent_norm=False, num_experts=n,
            top_k=router.top_k, intermediate_size=f, num_shared_experts=hf.get("n_shared_experts", 1),
            shared_intermediate_size=block.shared_experts.up_proj.weight.shape[0], activation="relu2",
            situ_linear_beta=None, renormalize=router.norm_topk_prob, routed_scaling_factor=router.routed_scaling_factor,
            n_group=router.num_group, topk_group=router.topk_group,
            rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5), num_moe_layers=_moe_layers_of(model_type, hf, None))
    n, f = block.experts.gate_up_proj.shape[0], block.experts.gate_up_proj.shape[1] // 2
    shared = block.shared_experts.gate_proj.weight.shape[0] if sigmoid else 0
    return MoEConfig(
        hidden_size=d, latent_size=d, use_latent_projection=False, use_latent_norm=False, num_experts=n,
        top_k=router.top_k, intermediate_size=f, num_shared_experts=shared // f, activation="swiglu",
        situ_linear_beta=None, score_function="sigmoid" if sigmoid else "softmax",
        renormalize=router.norm_topk_prob if hasattr(router, "norm_topk_prob") else FAMILIES[model_type].fixed.get("renormalize", False),
        routed_scaling_factor=router.routed_scaling_factor if sigmoid else 1.0,
        n_group=router.num_group if sigmoid else 1, topk_group=router.topk_group if sigmoid else 1,
        rms_norm_eps=hf.get("rms_norm_eps", FAMILIES[model_type].keys["rms_norm_eps"].default),
        num_moe_layers=_moe_layers_of(model_type, hf, model_config))


def _moe_layers_of(model_type: str, hf: dict, model_config) -> int:
    """The decoder layers that hold the MoE block, by the modeling code's own test on the configuration object."""
    c = _hf_config(model_type, {k: v for k, v in hf.items() if k not in ("model_type", "transformers_version")})
    c.pad_token_id = c.bos_token_id = c.eos_token_id = None  # the model's embedding needs none of them
    family = FAMILIES[model_type]
    with torch.device("meta"):  # the whole model, built without memory: count the blocks it holds
        model = getattr(transformers, family.model_class)(c)
    return sum(isinstance(module, BLOCKS[model_type][1]) for module in model.modules())


@pytest.mark.parametrize("model_type", sorted(BLOCKS))
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_from_hf_config_of_a_drawn_configuration_is_the_layer_its_block_computes(model_type, data):
    keys = data.draw(family_keys(model_type))
    hf = _hf_config(model_type, keys).to_dict()
    assert MoEConfig.from_hf_config(hf) == expected_config(_block(model_type, keys), model_type, hf)


#: Every record whose model ships in the pinned transformers (K3's draft does not), wrappers included.
SHIPPED_RECORDS = sorted(model_type for model_type, family in ALL_RECORDS.items() if family.draft is None)


def _whole_model_config(family, keys: dict):
    """The family's configuration object of its whole model (the wrapper's class for a multimodal one)."""
    if family.wraps is not None:
        return type(transformers.AutoConfig.for_model(family.model_type))(**keys)
    return getattr(transformers, family.config_class)(**keys)


def _layer_keys_written(family) -> dict:
    """The record's test configuration with the layer keys its rule writes: layer 1 the first of 2 MoE layers."""
    keys = dict(family.test_keys)
    text = keys.get("text_config", keys)
    text = {k: v for k, v in text.items() if k not in family.rule.keys}
    text.update(family.rule.write(1, 2, 0))
    return {**keys, "text_config": text} if "text_config" in keys else text


@pytest.mark.parametrize("written", [False, True], ids=["test_keys", "rule_written"])
@pytest.mark.parametrize("model_type", SHIPPED_RECORDS)
def test_the_moe_layer_count_is_the_real_models_count_of_blocks(model_type, written):
    """Built as a whole model on the meta device, each record's test configuration (and the same with the layer
    keys its rule writes) holds as many MoE blocks as `num_moe_layers` says."""
    family = ALL_RECORDS[model_type]
    block_class = getattr(importlib.import_module(family.module), family.block_class)
    config = _whole_model_config(family, _layer_keys_written(family) if written else family.test_keys)
    with torch.device("meta"):  # the whole model, built without memory: count the blocks it holds
        model = getattr(transformers, family.model_class)(config)
    blocks = sum(isinstance(module, block_class) for module in model.modules())
    assert MoEConfig.from_hf_config(config.to_dict()).num_moe_layers == blocks > 0
    if written:
        assert blocks == 2


# ---------------------------------------------------------------------------
# The block's forward against refimpl's, in float64
# ---------------------------------------------------------------------------

def _fill(block: torch.nn.Module, rng: np.random.Generator, bias_offset: float) -> None:
    """Random weights; a selection bias far from zero, as trained checkpoints hold it."""
    with torch.no_grad():
        for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
            if name == "gate.e_score_correction_bias":
                value = bias_offset + rng.uniform(-0.5, 0.5, tensor.shape)
            else:
                value = rng.standard_normal(tensor.shape) * (1.0 if name == "gate.weight" else 0.4)
            tensor.copy_(torch.from_numpy(value))


def _selection_margin(x: np.ndarray, params, config: MoEConfig) -> float:
    """The smallest gap, over tokens, between a chosen and an unchosen expert's selection score (groups too)."""
    scores = refimpl.router_scores(x, params["gate.weight"], config.score_function)  # [m, n] float64
    biased = scores + params["gate.e_score_correction_bias"][None, :]
    m, n = biased.shape
    gaps = []
    if 1 < config.n_group and config.topk_group < config.n_group:
        grouped = np.sort(biased.reshape(m, config.n_group, -1), axis=-1)[:, :, ::-1]
        group_score = np.sort(grouped[:, :, :2].sum(-1), axis=-1)[:, ::-1]  # [m, G]
        gaps.append(group_score[:, config.topk_group - 1] - group_score[:, config.topk_group])
        biased = np.where(_kept(grouped, biased, config), biased, -np.inf)
    ordered = np.sort(biased, axis=-1)[:, ::-1]
    if config.top_k < ordered.shape[1] and np.isfinite(ordered[:, config.top_k]).all():
        gaps.append(ordered[:, config.top_k - 1] - ordered[:, config.top_k])
    return float(min((g.min() for g in gaps), default=np.inf))


def _kept(grouped_sorted: np.ndarray, biased: np.ndarray, config: MoEConfig) -> np.ndarray:
    """[m, n] True for the experts of each token's chosen groups."""
    m, n = biased.shape
    chosen = np.argsort(-grouped_sorted[:, :, :2].sum(-1), axis=-1, kind="stable")[:, :config.topk_group]  # [m, tg]
    group_of = np.arange(n) // (n // config.n_group)
    return (group_of[None, :, None] == chosen[:, None, :]).any(-1)


def _tolerance(x: np.ndarray, params, config: MoEConfig, y: np.ndarray) -> np.ndarray:
    """|y_transformers - y_refimpl| allowed per element: the router's float32 rounding, carried through the weights.

    transformers forms the router's logits and scores in float32. A float32 dot product of length d is off by at
    most (d + 2) u sum_j |x_j w_j| (inputs rounded, then d sums), which moves each score by at most that relative
    amount plus 4u; a renormalized or softmax weight moves by at most three times its score's relative error. The
    output moves by that times each chosen expert's output, summed. Nemotron-H also sums its experts in a float32
    buffer: each weighted output rounded, then k additions, (k + 1) u of the sum of their sizes; and its latent
    up-projection carries both to the output through |W_up|. float64's own rounding is far below.
    """
    d = x.shape[1]
    dz = (d + 2) * U32 * (np.abs(x) @ np.abs(params["gate.weight"]).T)  # [m, n]
    relative = 3 * 2 * (dz.max(axis=1) + 4 * U32)  # [m]
    index, weights = refimpl.route(refimpl.router_scores(x, params["gate.weight"], config.score_function),
                                   params["gate.e_score_correction_bias"], config.top_k,
                                   renormalize=config.renormalize, scaling_factor=config.routed_scaling_factor,
                                   n_group=config.n_group, topk_group=config.topk_group)
    latent = config.use_latent_projection
    z = x @ params["routed_expert_down_proj.weight"].T if latent else x  # [m, l]
    bound = np.zeros_like(z)
    for i in range(x.shape[0]):
        sizes = np.zeros(z.shape[1])
        for r, e in enumerate(index[i]):
            w1, w3, w2 = (params[f"experts.{w}"][e] for w in ("w1", "w3", "w2"))
            gate, up = w1 @ z[i], w3 @ z[i]
            act = np.maximum(gate, 0) * up if config.activation == "relu2" else gate / (1 + np.exp(-gate)) * up
            expert = np.abs(weights[i, r] * (w2 @ act))  # [l]
            bound[i] += relative[i] * expert
            sizes += expert
        if config.activation == "relu2":
            bound[i] += (config.top_k + 1) * U32 * sizes
    if latent:
        bound = bound @ np.abs(params["routed_expert_up_proj.weight"]).T  # [m, d]
    return bound + 1e-12 * (1 + np.abs(y))


@pytest.mark.parametrize("model_type", sorted(BLOCKS))
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_the_blocks_forward_equals_refimpls(model_type, data):
    keys = data.draw(family_keys(model_type))
    seed = data.draw(st.integers(0, 2**32 - 1))
    m = data.draw(st.integers(1, 8))
    bias_offset = data.draw(st.sampled_from([0.0, -3.0, 40.0])) if model_type in SIGMOID else 0.0
    rng = np.random.default_rng(seed)
    block = _block(model_type, keys)
    _fill(block, rng, bias_offset)
    config = MoEConfig.from_hf_config(_hf_config(model_type, keys).to_dict())
    params = params_from_hf_state_dict(block.state_dict(), config, model_type=model_type)
    x = rng.standard_normal((m, config.hidden_size))
    # Only cases whose routes float32 cannot flip: every chosen expert ahead of every other by more than the
    # router's float32 error (scores, and the bias added to them in float32).
    d = config.hidden_size
    dz = (d + 2) * U32 * float((np.abs(x) @ np.abs(params["gate.weight"]).T).max())
    error = 2 * (dz + 4 * U32 + 2 * U32 * (1 + abs(bias_offset) + 0.5))
    assume(_selection_margin(x, params, config) > 2 * error)
    with torch.no_grad():
        y_block = block(torch.from_numpy(x)[None]).numpy()[0]
    y = refimpl.stable_latent_moe(x, params, config)
    assert y.dtype == np.float64
    tolerance = _tolerance(x, params, config, y_block)
    assert (np.abs(y - y_block) <= tolerance).all(), (np.abs(y - y_block).max(), tolerance.min())


# ---------------------------------------------------------------------------
# The converters: round trips, and a strict load into the real block
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", sorted(BLOCKS))
@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_both_converters_round_trip_and_load_strictly(model_type, data):
    keys = data.draw(family_keys(model_type))
    block = _block(model_type, keys)
    _fill(block, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))), 0.25)
    state = {name: tensor.numpy() for name, tensor in block.state_dict().items()}
    config = MoEConfig.from_hf_config(_hf_config(model_type, keys).to_dict())
    params = params_from_hf_state_dict(state, config, model_type=model_type)
    written = hf_state_dict_from_params(params, config, model_type=model_type)
    assert set(written) == set(state) == set(family_tensor_shapes(config, model_type))
    for name in state:
        np.testing.assert_array_equal(written[name], state[name], err_msg=name)
    fresh = _block(model_type, keys)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in written.items()}, strict=True)
    # The per-expert layout of released checkpoints reads back to the same weights, under a whole model's names.
    per_expert = hf_state_dict_from_params(params, config, model_type=model_type, expert_layout="per_expert",
                                           layer=3, prefix="language_model.")
    on_disk = "language_model." + FAMILIES[model_type].block_on_disk.format(L=3)  # as save_pretrained writes it
    assert all(name.startswith(on_disk) for name in per_expert)
    again = params_from_hf_state_dict(per_expert, config, model_type=model_type, layer=3, prefix="language_model.")
    assert list(again) == list(params)
    for name in params:
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(params[name]), err_msg=name)


def test_the_fused_gate_rows_come_first_as_the_block_splits_them():
    """`experts.gate_up_proj[e]`'s first f rows are the gate (SiLU'd), the last f the up: checked on one expert."""
    block = _block("qwen3_moe", dict(hidden_size=8, num_local_experts=4, num_experts_per_tok=1,
                                     moe_intermediate_size=3, num_hidden_layers=1))
    _fill(block, np.random.default_rng(5), 0.0)
    config = MoEConfig.from_hf_config(BLOCKS["qwen3_moe"][0](**ATTENTION, hidden_size=8, num_local_experts=4,
                                                             num_experts_per_tok=1, moe_intermediate_size=3,
                                                             num_hidden_layers=1).to_dict())
    params = params_from_hf_state_dict(block.state_dict(), config, model_type="qwen3_moe")
    gate_up = block.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(params["experts.w1"][2], gate_up[2, :3])
    np.testing.assert_array_equal(params["experts.w3"][2], gate_up[2, 3:])


def test_a_bias_the_block_cannot_hold_is_refused_by_name():
    config = MoEConfig.from_hf_config({"model_type": "mixtral", "hidden_size": 8, "intermediate_size": 4,
                                       "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1})
    params = refimpl.init_params(config, 0, dtype=np.float64)
    params["gate.e_score_correction_bias"] = np.full(4, 0.5, dtype=np.float32)
    with pytest.raises(ValueError, match=r"gate\.e_score_correction_bias.*nonzero.*MixtralSparseMoeBlock"):
        hf_state_dict_from_params(params, config, model_type="mixtral")


def test_a_wrong_tensor_is_named_in_the_familys_own_names():
    config = MoEConfig.from_hf_config({"model_type": "deepseek_v3", "hidden_size": 8, "moe_intermediate_size": 4,
                                       "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                                       "topk_group": 1, "num_hidden_layers": 4})
    state = hf_state_dict_from_params(refimpl.init_params(config, 0), config, model_type="deepseek_v3")
    state["experts.gate_up_proj"] = state["experts.gate_up_proj"][:, :4]
    del state["gate.e_score_correction_bias"]
    state["experts.0.w1.weight"] = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError) as info:
        params_from_hf_state_dict(state, config, model_type="deepseek_v3")
    message = str(info.value)
    assert "DeepseekV3MoE" in message and "gate.e_score_correction_bias" in message
    assert "experts.gate_up_proj: expected floating [4, 8, 8], got float32 [4, 4, 8]" in message
    assert "not in the block (1): experts.0.w1.weight" in message


def test_a_k3_layer_is_not_written_as_a_family_block():
    with pytest.raises(ValueError, match=r"DeepseekV3MoE.*latent_size=4"):
        family_tensor_shapes(MoEConfig.tiny(), "deepseek_v3")


# ---------------------------------------------------------------------------
# Which code reads a file
# ---------------------------------------------------------------------------

def test_an_unknown_model_type_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"model_type must be one of \['deepseek_v3', 'deepseek_v4', 'dots1', 'glm4_moe', 'kimi_linear', "
                                         r"'mixtral', 'nemotron_h', 'qwen3_moe'\].*got 'llama4_text'"):
        MoEConfig.from_hf_config({"model_type": "llama4_text", "hidden_size": 8})


def test_kimi_linear_is_k3s_code_when_the_file_says_so_and_transformers_otherwise():
    keys = dict(model_type="kimi_linear", hidden_size=8, num_experts=4, num_experts_per_token=2,
                moe_intermediate_size=4, num_hidden_layers=2)
    as_transformers = MoEConfig.from_hf_config(keys)
    assert (as_transformers.routed_scaling_factor, as_transformers.num_shared_experts) == (2.446, 1)
    assert as_transformers.num_moe_layers == 1  # the class makes the first layer dense
    as_k3 = MoEConfig.from_hf_config(keys, code="k3")
    assert (as_k3.routed_scaling_factor, as_k3.num_shared_experts, as_k3.activation) == (1.0, 0, "swiglu")
    assert MoEConfig.from_hf_config(dict(keys, auto_map={"AutoConfig": "remote.Config"})) == as_k3
    assert MoEConfig.from_hf_config({"model_type": "kimi_k3", "text_config": keys}) == as_k3
    for key in K3_ONLY_KEYS:
        value = {"routed_expert_hidden_size": 8, "latent_moe_use_norm": False,
                 "moe_router_activation_func": "sigmoid"}.get(key, 1.0)
        assert MoEConfig.from_hf_config(dict(keys, **{key: value})).routed_scaling_factor == 1.0, key
    assert MoEConfig.from_hf_config(dict(keys, auto_map={}), code="transformers") == as_transformers
    with pytest.raises(ValueError, match=r"code must be None.*got 'remote'"):
        MoEConfig.from_hf_config(keys, code="remote")


def test_a_family_key_given_twice_with_two_values_is_refused():
    with pytest.raises(ValueError, match=r"two values.*'num_local_experts'\] = 8.*'num_experts'\] = 4"):
        MoEConfig.from_hf_config({"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts": 4})


def test_a_family_value_is_checked_by_name():
    with pytest.raises(ValueError, match=r"hf\['n_routed_experts'\] must be a positive integer, got 2.5"):
        MoEConfig.from_hf_config({"model_type": "deepseek_v3", "n_routed_experts": 2.5})
    with pytest.raises(ValueError, match=r"hf\['hidden_act'\] must be 'silu'.*got 'gelu'"):
        MoEConfig.from_hf_config({"model_type": "mixtral", "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"no MoE layer"):
        MoEConfig.from_hf_config({"model_type": "deepseek_v3", "num_hidden_layers": 3})
    with pytest.raises(ValueError, match=r"top_k.*num_experts_per_tok"):
        MoEConfig.from_hf_config({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3})


def test_the_pages_porting_example_runs_and_agrees_with_the_block():
    """The example at the top of the families page, run as written, then held against the block it builds."""
    import re

    import refimpl.families

    code = re.search(r"```python\n(.*?)```", refimpl.families.__doc__, re.S).group(1)
    scope: dict = {}
    torch.manual_seed(0)
    exec(code, scope)
    with torch.no_grad():
        y_block = scope["block"](scope["x"][None])[0].numpy()
    assert scope["config"].n_group == 4 and scope["config"].num_experts == 16
    x = scope["x"].numpy()
    assert (np.abs(scope["y"] - y_block) <= _tolerance(x, scope["params"], scope["config"], y_block)).all()


# ---------------------------------------------------------------------------
# DeepSeek-V4's routers (its whole block is not read yet: see the families page)
# ---------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([4, 8, 16]), k=st.integers(1, 4),
       offset=st.sampled_from([0.0, 5.0, -30.0]))
def test_deepseek_v4s_sqrt_softplus_router_is_refimpls_route(seed, n, k, offset):
    """transformers' DeepseekV4TopKRouter in float64: sqrt(softplus) scores, top-k of s + b, weights from the raw
    s always renormalized (+1e-20), times routed_scaling_factor: the same experts and weights as refimpl's
    `route(router_scores(..., "sqrtsoftplus"), ...)`. Its logits stay in the block's dtype, so float64 agrees to
    float64's rounding."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    k = min(k, n)
    hf = transformers.DeepseekV4Config(hidden_size=16, n_routed_experts=n, num_experts_per_tok=k, vocab_size=32,
                                       num_attention_heads=2, num_key_value_heads=2)
    router = DeepseekV4TopKRouter(hf).double()
    rng = np.random.default_rng(seed)
    weight, bias = rng.standard_normal((n, 16)), offset + rng.uniform(-0.5, 0.5, n)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
    x = rng.standard_normal((12, 16))
    with torch.no_grad():
        _, hf_weights, hf_index = (t.numpy() for t in router(torch.from_numpy(x)))
    scores = refimpl.router_scores(x, weight, "sqrtsoftplus")
    ordered = np.sort(scores + bias, axis=1)[:, ::-1]
    assume(k == n or (ordered[:, k - 1] - ordered[:, k]).min() > 1e-12)  # no near-tie for float64 to flip
    index, weights = refimpl.route(scores, bias, k, renormalize=True, scaling_factor=hf.routed_scaling_factor)
    order = np.argsort(hf_index, axis=1)  # transformers' top-k is unsorted: compare as sets, weight by weight
    mine = np.argsort(index, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(hf_index, order, 1), np.take_along_axis(index, mine, 1))
    # Both evaluate the same float64 formulas in another order: a 16-term dot product and a few functions of
    # it, some (16 + 10) u of relative rounding each way; 1e-13 is about 450 u.
    np.testing.assert_allclose(np.take_along_axis(hf_weights, order, 1), np.take_along_axis(weights, mine, 1),
                               rtol=1e-13, atol=1e-18)


def test_the_converters_refuse_what_they_cannot_lay_out_by_name():
    config = MoEConfig.from_hf_config({"model_type": "mixtral", "hidden_size": 8, "intermediate_size": 4,
                                       "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1})
    with pytest.raises(TypeError, match=r"config must be a MoEConfig, got dict"):
        family_tensor_shapes({"hidden_size": 8}, "mixtral")
    with pytest.raises(ValueError, match=r"expert_layout must be one of \('fused', 'per_expert'\), got 'stacked'"):
        family_tensor_shapes(config, "mixtral", "stacked")
    with pytest.raises(ValueError, match=r"model_type must be one of .*got 'mixtral_v9'"):
        family_tensor_shapes(config, "mixtral_v9")
    k3 = MoEConfig.tiny()
    with pytest.raises(ValueError, match=r"expert_layout='per_expert' chooses a transformers family's .*model_type"):
        hf_state_dict_from_params(refimpl.init_params(k3, 0), k3, expert_layout="per_expert")


def test_the_nemotron_3_super_preset_is_what_nemotron_hs_class_reads_from_its_keys():
    """The preset's numbers, written as the model's own keys and read by transformers' class, build the same layer."""
    keys = dict(hidden_size=4096, n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
                moe_latent_size=1024, moe_shared_expert_intermediate_size=5376, n_shared_experts=1,
                routed_scaling_factor=5.0, n_group=1, topk_group=1, norm_topk_prob=True, mlp_hidden_act="relu2",
                layer_norm_epsilon=1e-5, layers_block_type=["mamba", "moe", "attention", "moe"])
    hf = transformers.NemotronHConfig(**ATTENTION, **keys).to_dict()
    assert MoEConfig.from_hf_config(hf) == MoEConfig.nemotron_3_super(num_moe_layers=2)


def test_the_families_pages_tables_list_exactly_the_records():
    """The page's two tables (the families, the measured agreement) name each family of the records once."""
    doc = refimpl.families.__doc__
    for header in ("| `model_type` | block |", "| `model_type` | largest relative difference |"):
        rows = doc[doc.index(header):].split("\n\n")[0].splitlines()[2:]
        named = [row.split("`")[1] for row in rows]
        assert sorted(named) == sorted(FAMILIES), header


# ---------------------------------------------------------------------------
# The checkpoints page: its example and its tables, held to the records
# ---------------------------------------------------------------------------

def _page_rows(doc: str, header: str) -> list[list[str]]:
    """The cells of the markdown table that opens with `header`, one list per row."""
    rows = doc[doc.index(header):].split("\n\n")[0].splitlines()[2:]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def _moe_layers_text(family) -> str:
    """The MoE layers of the record's test model, by its rule: "1, 3 of 4"."""
    text = family.test_keys.get("text_config", family.test_keys)
    total, keys = refimpl.families.read_layer_keys(text, "test_keys", family)
    return ", ".join(str(layer) for layer in range(total) if family.rule.is_moe(layer, keys)) + f" of {total}"


def _layout_row(family) -> list[str]:
    """A row of the layouts table, from the record alone."""
    def modules(by_role):
        return " ".join(f"`{by_role[role]}`" for role in ("gate", "up", "down") if role in by_role)
    fused_only = family.saved_layout == "fused"
    return [f"`{family.model_type}`", "— (fused only)" if fused_only else f"`{family.block_on_disk}`",
            "—" if fused_only else modules(family.expert_modules),
            "none" if family.shared_modules is None else modules(family.shared_modules),
            ", ".join(f"`{name}`" for name in (family.bias_on_disk, family.hash_table) if name is not None) or "none",
            f"`{family.block}`",
            "`gate_up_proj` `down_proj`" if family.gated else "`up_proj` `down_proj`"]


def test_the_checkpoints_pages_tables_list_exactly_the_records():
    """Both tables of the checkpoints page: a row per record, K3's release last, every derivable cell derived."""
    doc = refimpl.checkpoints.__doc__
    families = _page_rows(doc, "| `model_type` | the model saved |")
    assert families[-1][0] == "K3, released"
    assert [row[0] for row in families[:-1]] == [f"`{name}`" for name in sorted(ALL_RECORDS)]
    for row in families[:-1]:
        family = ALL_RECORDS[row[0].strip("`")]
        assert row[1] == f"`{family.model_class}`" + (" (transformers' draft)" if family.draft else ""), row
        assert row[2] == (", ".join(f"`{key}`" for key in family.rule.keys) or "every layer"), row
        assert row[3] == _moe_layers_text(family), row
    expected = [_layout_row(ALL_RECORDS[name]) for name in sorted(ALL_RECORDS)]
    on_disk = _page_rows(doc, "| `model_type` | block on disk |")
    assert on_disk[:-1] == [row[:5] for row in expected], "\n".join("| " + " | ".join(row) + " |" for row in expected)
    assert on_disk[-1][0] == "K3, released"
    in_memory = _page_rows(doc, "| `model_type` | block in memory |")
    assert in_memory == [[row[0], *row[5:]] for row in expected]


def test_the_checkpoints_pages_example_runs_and_agrees_with_the_model(tmp_path, monkeypatch):
    """The page's example, run as written: the layer read from save_pretrained's folder computes the model's block,
    a dense layer is refused by name, and the layer written back as Qwen3-MoE reads back the same."""
    import re

    code = re.search(r"```python\n(.*?)```", refimpl.checkpoints.__doc__, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    torch.manual_seed(0)
    exec(code, scope)
    x, y, y_model, config, params = (scope[name] for name in ("x", "y", "y_model", "config", "params"))
    assert (config.num_moe_layers, config.score_function) == (2, "softmax")
    assert (np.abs(y - y_model) <= _tolerance(x, params, config, y_model)).all()
    with pytest.raises(ValueError, match=r"layer 0 is a dense layer of this qwen3_moe model"):
        refimpl.load_hf_layer("qwen3-tiny", 0)
    again, back = refimpl.load_hf_layer("qwen3-layer", 1, dtype=np.float64)
    assert again == config
    for name in params:
        stacked = name.startswith("experts.")
        for e in range(config.num_experts) if stacked else [None]:
            ours, theirs = (params[name][e], back[name][e]) if stacked else (params[name], back[name])
            np.testing.assert_array_equal(np.asarray(theirs), np.asarray(ours), err_msg=name)
