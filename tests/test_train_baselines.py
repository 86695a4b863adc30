"""The other balancers in the training loop: each trains, logs what it should, and its pieces are right."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refimpl import capacity_keep, expert_capacity, hash_route
from refimpl.train import BALANCERS, TrainConfig, train
from refimpl.train_baselines import AuxLossBalancer

SMALL = dict(steps=2, batch=128, experts=16, top_k=2, d=32, latent=16, intermediate=16, eval_every=2,
             eval_batch=256)


@pytest.mark.parametrize("rule", ["aux", "seq", "capacity-1.0", "capacity-1.25", "hash"])
def test_each_rule_trains_and_logs(rule):
    log = train(TrainConfig(balancer=rule, **SMALL))
    step = log["steps"][-1]
    assert np.isfinite(step["loss"]) and np.isfinite(step["eval_loss"]) and "skipped" not in step
    assert ("aux_loss" in step) == (rule in ("aux", "seq"))
    assert ("drop_rate" in step) == rule.startswith("capacity")
    if rule in ("aux", "seq"):
        coefficient = 1e-2 if rule == "aux" else 1e-4
        assert step["objective"][0] == pytest.approx(step["loss"] + coefficient * sum(step["aux_loss"]))


def test_hash_rule_routes_by_the_last_byte():
    """The hash balancer's loads are those of hash_route on the batch's last bytes, computed independently."""
    config = TrainConfig(balancer="hash", **SMALL)
    balancer = BALANCERS["hash"](config)
    ids = np.arange(128) % 7
    balancer.token_ids = ids
    step = balancer.step(np.random.default_rng(0).uniform(size=(128, 16)).astype(np.float32))
    np.testing.assert_array_equal(step.load, np.bincount(hash_route(ids, 16, 2).ravel(), minlength=16))


def test_capacity_drop_rate_matches_capacity_keep():
    config = TrainConfig(balancer="capacity-1.0", **SMALL)
    balancer = BALANCERS["capacity-1.0"](config)
    scores = np.random.default_rng(1).uniform(size=(128, 16)).astype(np.float32)
    step = balancer.step(scores)
    kept = capacity_keep(np.asarray(step.index), 16, expert_capacity(128, 16, 2, 1.0))
    assert balancer.layer_changes == {"capacity_factor": 1.0}
    assert np.bincount(np.asarray(step.index)[kept], minlength=16).max() <= 16


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
