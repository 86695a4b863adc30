"""The other balancers in the training loop: each trains, logs what it should, and its pieces are right."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refimpl import capacity_keep, expert_capacity, hash_route, stable_latent_moe
from refimpl.balancing.other_balancers import AuxLossBalancer
from refimpl.train import (
    BALANCERS,
    TrainConfig,
    default_layer,
    forward_backward,
    init_model,
    load_corpus,
    routed_activation_peak,
    sample_batch,
    train,
)

LAYER = default_layer(num_experts=16, top_k=2, hidden_size=32, latent_size=16, intermediate_size=16)
SMALL = dict(steps=2, batch=128, moe=LAYER, eval_every=2, eval_batch=256)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.mark.parametrize("rule", ["aux", "seq", "capacity-1.0", "capacity-1.25", "hash"])
def test_each_rule_trains_and_logs(rule, corpus):
    log = train(TrainConfig(balancer=rule, **SMALL), corpus=corpus)
    step = log["steps"][-1]
    assert np.isfinite(step["loss"]) and np.isfinite(step["eval_loss"]) and "skipped" not in step
    assert ("aux_loss" in step) == (rule in ("aux", "seq"))
    assert ("drop_rate" in step) == rule.startswith("capacity")
    if rule in ("aux", "seq"):
        coefficient = 1e-2 if rule == "aux" else 1e-4
        assert step["objective"][0] == pytest.approx(step["loss"] + coefficient * sum(step["aux_loss"]))


def test_hash_rule_routes_by_the_last_byte():
    """The hash balancer's loads are those of hash_route on the batch's token ids, computed independently."""
    balancer = BALANCERS["hash"](TrainConfig(balancer="hash", **SMALL))
    ids = np.arange(128) % 7
    step = balancer.step(np.random.default_rng(0).uniform(size=(128, 16)).astype(np.float32), token_ids=ids)
    np.testing.assert_array_equal(step.load, np.bincount(hash_route(ids, 16, 2).ravel(), minlength=16))
    assert balancer.layer_config(LAYER) == LAYER.replace(hash_routing=True)


def test_capacity_rule_changes_the_layer_and_keeps_the_bias():
    balancer = BALANCERS["capacity-1.0"](TrainConfig(balancer="capacity-1.0", **SMALL))
    scores = np.random.default_rng(1).uniform(size=(128, 16)).astype(np.float32)
    step = balancer.step(scores)
    kept = capacity_keep(np.asarray(step.index), 16, expert_capacity(128, 16, 2, 1.0))
    assert balancer.layer_config(LAYER) == LAYER.replace(capacity_factor=1.0)
    assert np.bincount(np.asarray(step.index)[kept], minlength=16).max() <= 16
    assert not np.any(balancer.bias)


@pytest.mark.parametrize("rule", ["hash", "capacity-1.0"])
def test_statistics_are_those_of_the_layer_that_was_trained(rule, corpus):
    """Step 1's logged peak, routed RMS and drop rate are those of the layer the rule asks for, run here alone."""
    config = TrainConfig(balancer=rule, **{**SMALL, "steps": 1})
    logged = train(config, corpus=corpus)["steps"][0]
    # Step 1 again, by hand: the same weights and batch, the plain forward of each block's layer.
    rng = np.random.default_rng(config.seed)
    params = init_model(config, rng)
    tokens, _ = sample_batch(corpus.data[:corpus.split], rng, config.batch, config.context)
    layer = BALANCERS[rule](config).layer_config(config.moe)
    h = params["embed.weight"][tokens].reshape(config.batch, -1) @ params["mix.weight"].T
    for number in range(config.moe.num_moe_layers):
        g = params[f"layers.{number}.norm.weight"]
        a = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + 1e-5) * g
        layer_params = {name[len(f"layers.{number}.moe."):]: value for name, value in params.items()
                        if name.startswith(f"layers.{number}.moe.")}
        out = stable_latent_moe(a, layer_params, layer, token_ids=tokens[:, -1], return_intermediates=True)
        rms = np.sqrt(np.mean(np.asarray(out.u, np.float64) ** 2))
        assert logged["routed_rms"][number] == pytest.approx(rms, rel=1e-6)
        peak = routed_activation_peak(out.z, out.index, layer_params["experts.w1"], layer_params["experts.w3"],
                                      layer)
        assert logged["activation_peak"][number] == pytest.approx(peak, rel=1e-6)
        if rule.startswith("capacity"):
            assert logged["drop_rate"][number] == pytest.approx(1 - np.mean(out.kept), abs=1e-12)
        # The layer K3 would run instead gives another routed sum: the check can fail.
        plain = stable_latent_moe(a, layer_params, config.moe, return_intermediates=True)
        assert abs(np.sqrt(np.mean(np.asarray(plain.u, np.float64) ** 2)) - rms) > 1e-4 * rms
        h = h + out.y


@pytest.mark.parametrize("rule", ["aux", "seq"])
def test_the_auxiliary_loss_reaches_the_router_through_the_layers_backward(rule, corpus):
    """The gradient of loss + coefficient * aux (f held) against central differences of that objective, float64."""
    config = TrainConfig(balancer=rule, **{**SMALL, "moe": LAYER.replace(num_moe_layers=1)})
    params = {name: value.astype(np.float64) for name, value in init_model(config, np.random.default_rng(1)).items()}
    tokens, targets = sample_batch(corpus.data, np.random.default_rng(2), config.batch, config.context)

    def objective(p):
        result = forward_backward(p, tokens, targets, [BALANCERS[rule](config)], config)
        return result, result.balancing["objective"][0]

    result, _ = objective(params)
    rng = np.random.default_rng(3)
    h = 1e-6
    for name in ("layers.0.moe.gate.weight", "mix.weight"):
        for _ in range(4):
            position = tuple(int(rng.integers(0, s)) for s in params[name].shape)
            plus, minus = dict(params), dict(params)
            plus[name], minus[name] = params[name].copy(), params[name].copy()
            plus[name][position] += h
            minus[name][position] -= h
            numeric = (objective(plus)[1] - objective(minus)[1]) / (2 * h)
            assert result.grads[name][position] == pytest.approx(numeric, rel=2e-4, abs=1e-7), (name, position)


def test_aux_balancer_gradient_matches_autograd():
    """The auxiliary term's gradient in the scores, against PyTorch on the same formula."""
    rng = np.random.default_rng(2)
    scores = 1 / (1 + np.exp(-rng.standard_normal((64, 8))))
    index = np.argsort(-scores, axis=1, kind="stable")[:, :2]
    value, grad = AuxLossBalancer(8, 2).auxiliary(scores, index)
    s = torch.tensor(scores, requires_grad=True)
    f = torch.tensor(8 / (2 * 64) * np.bincount(index.ravel(), minlength=8))
    loss = (f * (s / s.sum(dim=1, keepdim=True)).mean(dim=0)).sum()
    loss.backward()
    assert value == pytest.approx(loss.item())
    np.testing.assert_allclose(grad, s.grad.numpy(), rtol=1e-10, atol=1e-14)
