"""One layer, one contract: every path of the package computes the layer `stable_latent_moe` computes.

The layers of `tests/one_layer_worker.py` (every score function,
renormalization off, two capacity factors, hash routing with token ids,
expert groups, top-1 with a scale and no norm, a plain MoE with SwiGLU, no
shared expert with the up branch uncapped, Nemotron-H's squared ReLU, and every preset at a small
width) run on each path, and each path's `y` must equal the single-process
forward of the same tokens to 1e-10 relative in float64:

* `stable_latent_moe_vjp` (its `y`, before any gradient is asked);
* `ep_forward` under `mpiexec -n 1`, `-n 2` and `-n 4`, grouped and padded,
  with uneven token shards and a rank holding none, against the forward of
  the union of the ranks' tokens (in rank order: the order in which a
  capacity serves them);
* the training loop's layer: the model's forward, block by block, against
  `stable_latent_moe` of each block's input with the bias the balancer held.

Relative means the largest difference over the largest entry of `y`: the
paths add the same products in another order (the expert-parallel combine
adds per-rank partial sums), so they agree to rounding, some 1e-15 here.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT, load_script, run_under_mpiexec

from refimpl import stable_latent_moe
from refimpl.layer.backward import stable_latent_moe_vjp
from refimpl.parallel import ep_forward, shard_params
from refimpl.train import BALANCERS

worker = load_script(ROOT / "tests" / "one_layer_worker.py", "one_layer_worker")
NAMES = list(worker.LAYERS)
RTOL = 1e-10


def relative(have: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(have - want), initial=0.0)) / max(float(np.max(np.abs(want), initial=0.0)), 1e-300)


def union_forward(name: str, size: int) -> np.ndarray:
    """The single-process layer on the union of the ranks' tokens, in rank order."""
    config, params = worker.layer(name)
    xs, ids = worker.tokens(size, config.d)
    x, token_ids = np.concatenate(xs), np.concatenate(ids)
    return stable_latent_moe(x, params, config, token_ids=token_ids if config.hash_routing else None)


@pytest.mark.parametrize("name", NAMES)
def test_the_vjp_computes_the_forward(name):
    config, params = worker.layer(name)
    xs, ids = worker.tokens(1, config.d)
    token_ids = ids[0] if config.hash_routing else None
    y, backward = stable_latent_moe_vjp(xs[0], params, config, token_ids=token_ids)
    assert relative(y, stable_latent_moe(xs[0], params, config, token_ids=token_ids)) <= RTOL
    dx, dparams = backward(np.ones_like(y))
    assert np.all(np.isfinite(dx)) and sorted(dparams) == sorted(params)


@pytest.mark.parametrize("name", NAMES)
def test_ep_forward_on_one_process_computes_the_forward(name):
    """`MPI.COMM_SELF`: the expert-parallel code path with one rank, grouped and padded."""
    MPI = pytest.importorskip("mpi4py.MPI")
    config, params = worker.layer(name)
    xs, ids = worker.tokens(1, config.d)
    expected = union_forward(name, 1)
    for padded in (False, True):
        y, _ = ep_forward(xs[0], shard_params(params, config, 0, 1), config, MPI.COMM_SELF, padded=padded,
                          token_ids=ids[0] if config.hash_routing else None)
        assert relative(y, expected) <= RTOL, (name, padded)


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2, 4])
def test_ep_forward_under_mpiexec_computes_the_forward(size, tmp_path):
    out = tmp_path / "ranks.npz"
    proc = run_under_mpiexec(size, ["tests/one_layer_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = np.load(out)
    assert int(saved["size"]) == size
    for number, name in enumerate(NAMES):
        expected = union_forward(name, size)
        for padded in (0, 1):
            y = np.concatenate([saved[f"{number}_{padded}_{r}"] for r in range(size)])
            assert y.shape == expected.shape
            assert relative(y, expected) <= RTOL, (name, size, padded, relative(y, expected))


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_ep_vjp_under_mpiexec_is_the_one_process_vjp(size, tmp_path):
    """y, dx per rank, each rank's expert block and the ranks' shares of the replicated gradients, summed."""
    out = tmp_path / "ranks.npz"
    proc = run_under_mpiexec(size, ["tests/one_layer_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = np.load(out)
    for number, name in enumerate(NAMES):
        config, params = worker.layer(name)
        xs, ids = worker.tokens(size, config.d)
        x, token_ids = np.concatenate(xs), np.concatenate(ids)
        y, backward = stable_latent_moe_vjp(x, params, config, token_ids=token_ids if config.hash_routing else None)
        dx, dparams = backward(np.concatenate(worker.upstream(size, config.d)))
        have_y = np.concatenate([saved[f"{number}_vjp_y_{r}"] for r in range(size)])
        have_dx = np.concatenate([saved[f"{number}_vjp_dx_{r}"] for r in range(size)])
        assert relative(have_y, y) <= RTOL, name
        assert relative(have_dx, dx) <= RTOL, name
        per_rank = config.n // size
        for key, grad in dparams.items():
            parts = [saved[f"{number}_vjp_d:{key}_{r}"] for r in range(size)]
            if key.startswith("experts."):
                have = np.concatenate(parts)  # each rank's block, in expert order
            else:
                have = np.sum(parts, axis=0)  # the ranks' shares of a replicated parameter
            assert have.shape == grad.shape, (name, key)
            assert relative(have, grad) <= RTOL or float(np.max(np.abs(grad), initial=0.0)) == 0.0, (
                name, key, relative(have, grad))
            if key == "gate.e_score_correction_bias":
                assert not np.any(have)
        assert per_rank * size == config.n


def test_a_route_that_cannot_be_computed_is_refused_by_name():
    """Hash routing without token ids, on every path, names the missing argument."""
    MPI = pytest.importorskip("mpi4py.MPI")
    config, params = worker.layer("hash routing")
    x = worker.tokens(1, config.d)[0][0]
    for call in (lambda: stable_latent_moe(x, params, config),
                 lambda: stable_latent_moe_vjp(x, params, config),
                 lambda: ep_forward(x, params, config, MPI.COMM_SELF)):
        with pytest.raises(ValueError, match="token_ids must be given"):
            call()
    with pytest.raises(ValueError, match="mxfp8_inputs=True runs the grouped expert loop"):
        ep_forward(x, params, config, MPI.COMM_SELF, padded=True, mxfp8_inputs=True)


@pytest.mark.parametrize("balancer", sorted(BALANCERS))
def test_the_training_loop_trains_the_forward(balancer):
    """Every block of a training step runs `stable_latent_moe` of its input, with the held bias and the layer
    its balancer asks for (a capacity, hash routing on the byte read): the loop's layer call is recorded and
    held against the forward computed apart, and the layer's switches against what the balancer declares."""
    from refimpl import train as training

    config = training.TrainConfig(balancer=balancer, steps=2, batch=256, eval_every=1000, stats_every=1000,
                                  moe=training.default_layer(num_experts=8, top_k=2, num_moe_layers=2))
    corpus = training.load_corpus()
    rng = np.random.default_rng(0)
    params = training.init_model(config, rng)
    balancers = [training.BALANCERS[balancer](config) for _ in range(config.moe.num_moe_layers)]
    calls = []

    def recording_layer(x, layer_params, layer_config, token_ids):
        out, back = training.single_process_layer(x, layer_params, layer_config, token_ids)
        calls.append((x.copy(), {k: v.copy() for k, v in layer_params.items()}, layer_config,
                      None if token_ids is None else token_ids.copy(), out.y.copy()))
        return out, back

    for _ in range(2):  # the second step routes with the bias the first one computed
        tokens, targets = training.sample_batch(corpus.data[:corpus.split], rng, config.batch, config.context)
        training.forward_backward(params, tokens, targets, balancers, config, layer_vjp=recording_layer)
    assert len(calls) == 4
    for x, layer_params, layer_config, token_ids, y in calls:
        assert layer_config == balancers[0].layer_config(config.moe)
        assert layer_config.hash_routing == (balancer == "hash")
        assert (layer_config.capacity_factor is not None) == balancer.startswith("capacity")
        expected = stable_latent_moe(x, layer_params, layer_config, token_ids=token_ids)
        assert relative(y, expected) <= 1e-6  # float32: the VJP's forward keeps its partials, same values
