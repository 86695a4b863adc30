"""Tests of the training loop (`refimpl.train`): the hand-written gradients, determinism, balance, the command.

Every run here is tiny (a few dozen steps of a model with 8 to 32 experts),
so the whole file takes well under a minute. The gradients of the pieces
written by hand in `refimpl.train` (embedding, mixing, RMSNorm, output layer,
cross-entropy) are checked against central finite differences of the whole
model's loss in float64, and RMSNorm and the cross-entropy also against
PyTorch's autograd.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refimpl.balancing import quantile_balancing_update
from refimpl.train import (
    BALANCERS,
    HistogramBalancer,
    TrainConfig,
    cross_entropy,
    forward_backward,
    init_model,
    load_corpus,
    main,
    noise_floor,
    rms_norm_vjp,
    routed_activation_peak,
    sample_batch,
    train,
)

ROOT = Path(__file__).resolve().parents[1]

#: A model small enough for a step in a few milliseconds.
TINY = dict(d=16, latent=8, experts=8, top_k=2, intermediate=8, layers=2, context=4, embed=4, batch=128,
            eval_batch=64, stats_every=5, eval_every=10)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def tiny(**changes) -> TrainConfig:
    return TrainConfig(**{**TINY, **changes})


# ---------------------------------------------------------------------------
# The data
# ---------------------------------------------------------------------------

def test_corpus_is_the_listed_files_and_says_so(corpus, tmp_path):
    # The digest and sizes printed are those of the files on disk, read independently here.
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    joined = b"".join((root / name).read_bytes() for name, _, _ in corpus.files)
    assert corpus.sha256 == hashlib.sha256(joined).hexdigest()
    assert corpus.data.tobytes() == joined
    for name, size, digest in corpus.files:
        assert size == (root / name).stat().st_size
        assert digest == hashlib.sha256((root / name).read_bytes()).hexdigest()
        assert name in corpus.describe()
    # A missing file is named, not silently replaced; a corpus too small is refused.
    (tmp_path / "a.py").write_bytes(b"x = 1\n" * 3000)
    small = load_corpus(tmp_path, ["a.py", "not_there.py"])
    assert small.missing == ("not_there.py",) and "not_there.py" in small.describe()
    with pytest.raises(ValueError, match="at least 10,000"):
        load_corpus(tmp_path, ["not_there.py"])


def test_batches_are_the_bytes_before_each_target(corpus):
    rng = np.random.default_rng(3)
    tokens, targets = sample_batch(corpus.data, rng, 50, 6)
    raw = corpus.data.tobytes()
    for window, target in zip(tokens, targets, strict=True):
        # Find the window followed by its target somewhere in the text: the pair is real text.
        assert bytes(window.tolist()) + bytes([int(target)]) in raw


# ---------------------------------------------------------------------------
# The hand-written gradients
# ---------------------------------------------------------------------------

def test_rms_norm_and_cross_entropy_match_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x, g, dy = rng.standard_normal((5, 7)), rng.standard_normal(7), rng.standard_normal((5, 7))
    y, backward = rms_norm_vjp(x, g, 1e-5)
    dx, dg = backward(dy)
    xt, gt = torch.tensor(x, requires_grad=True), torch.tensor(g, requires_grad=True)
    yt = xt * torch.rsqrt((xt * xt).mean(-1, keepdim=True) + 1e-5) * gt
    (yt * torch.tensor(dy)).sum().backward()
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dg, gt.grad.numpy(), rtol=1e-10, atol=1e-12)

    logits, targets = rng.standard_normal((6, 11)) * 3, rng.integers(0, 11, 6)
    loss, dlogits = cross_entropy(logits, targets)
    lt = torch.tensor(logits, requires_grad=True)
    reference = torch.nn.functional.cross_entropy(lt, torch.tensor(targets))
    reference.backward()
    assert loss == pytest.approx(reference.item(), rel=1e-12)
    np.testing.assert_allclose(dlogits, lt.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_model_gradients_match_finite_differences(corpus):
    # float64 weights: the layer then computes in float64; no balancing, so the bias stays put.
    config = tiny(balancer="none", layers=2)
    params = {name: value.astype(np.float64) for name, value in init_model(config, np.random.default_rng(1)).items()}
    tokens, targets = sample_batch(corpus.data, np.random.default_rng(2), 32, config.context)

    def loss_at(p):
        balancers = [BALANCERS["none"](config) for _ in range(config.layers)]
        return forward_backward(p, tokens, targets, balancers, config)

    result = loss_at(params)
    rng = np.random.default_rng(5)
    # A small step: the selection is piecewise constant, and a step that moves a token across a tie would
    # add the jump to the difference quotient.
    h = 1e-6
    values, counts = np.unique(tokens, return_counts=True)
    rare_byte = int(values[np.argmin(counts)])
    names = ["embed.weight", "mix.weight", "layers.0.norm.weight", "layers.1.moe.routed_expert_up_proj.weight",
             "layers.0.moe.gate.weight", "norm.weight", "out.weight"]
    for name in names:
        for _ in range(3):
            position = tuple(int(rng.integers(0, s)) for s in params[name].shape)
            if name == "embed.weight":  # a byte that occurs in the batch (else the gradient is zero), rarely
                position = (rare_byte, position[1])
            plus, minus = dict(params), dict(params)
            plus[name], minus[name] = params[name].copy(), params[name].copy()
            plus[name][position] += h
            minus[name][position] -= h
            numeric = (loss_at(plus).loss - loss_at(minus).loss) / (2 * h)
            assert result.grads[name][position] == pytest.approx(numeric, rel=2e-4, abs=1e-7), (name, position)


def test_the_bias_never_receives_a_gradient_and_adam_never_moves_it(corpus):
    config = tiny(balancer="none", steps=4)
    params = init_model(config, np.random.default_rng(0))
    tokens, targets = sample_batch(corpus.data, np.random.default_rng(1), config.batch, config.context)
    balancers = [BALANCERS["none"](config) for _ in range(config.layers)]
    grads = forward_backward(params, tokens, targets, balancers, config).grads
    for layer in range(config.layers):
        bias_grad = grads[f"layers.{layer}.moe.gate.e_score_correction_bias"]
        assert bias_grad.shape == (config.experts,) and not np.any(bias_grad)
        assert np.any(grads[f"layers.{layer}.moe.gate.weight"])  # the router itself does learn
    # Without a balancer the bias is exactly zero after training while the router moved: only a balancer
    # may set the bias, never the optimizer.
    start = init_model(config, np.random.default_rng(config.seed))
    final: dict = {}
    train(config, corpus=corpus, final_params=final)
    for layer in range(config.layers):
        assert not np.any(final[f"layers.{layer}.moe.gate.e_score_correction_bias"])
        assert not np.array_equal(final[f"layers.{layer}.moe.gate.weight"], start[f"layers.{layer}.moe.gate.weight"])


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------

def test_same_seed_same_losses_bit_for_bit(corpus):
    first = train(tiny(steps=6, balancer="qb"), corpus=corpus)
    second = train(tiny(steps=6, balancer="qb"), corpus=corpus)
    other = train(tiny(steps=6, balancer="qb", seed=1), corpus=corpus)
    losses = [r["loss"] for r in first["steps"]]
    assert losses == [r["loss"] for r in second["steps"]]
    assert [r["max_violation"] for r in first["steps"]] == [r["max_violation"] for r in second["steps"]]
    assert losses != [r["loss"] for r in other["steps"]]


def test_the_loss_falls(corpus):
    log = train(tiny(steps=40, lr=1e-2), corpus=corpus)
    losses = np.array([r["loss"] for r in log["steps"]])
    # From about ln 256 = 5.55 nats per byte (a uniform guess) to well below it.
    assert losses[0] > 5.0
    assert np.mean(losses[-5:]) < losses[0] - 1.5
    assert log["summary"]["final_eval_loss"] < losses[0] - 1.0


def test_quantile_balancing_beats_the_sign_rule_and_no_balancing(corpus):
    config = dict(steps=30, d=32, latent=16, experts=32, top_k=2, intermediate=16, layers=1, batch=512,
                  context=8, embed=8, stats_every=100, eval_every=100)
    settled = {}
    for balancer in ("qb", "sign", "none"):
        log = train(TrainConfig(balancer=balancer, **config), corpus=corpus)
        settled[balancer] = float(np.mean([r["max_violation"] for r in log["steps"][-10:]]))
    assert settled["qb"] < settled["sign"]
    assert settled["qb"] < 0.5 * settled["none"]


def test_max_violation_is_the_load_of_the_batch_routed_with_the_bias_in_use(corpus):
    # Recompute step 2's violation independently: route its batch with the bias QB computed from step 1.
    from refimpl.routing import route, router_scores

    config = tiny(steps=2, layers=1, balancer="qb")
    params = init_model(config, np.random.default_rng(0))
    rng = np.random.default_rng(9)
    batches = [sample_batch(corpus.data, rng, config.batch, config.context) for _ in range(2)]
    balancers = [BALANCERS["qb"](config)]
    first = forward_backward(params, *batches[0], balancers, config)
    scores = []
    for tokens, _ in batches:
        m = tokens.shape[0]
        h = params["embed.weight"][tokens].reshape(m, -1) @ params["mix.weight"].T
        a, _ = rms_norm_vjp(h, params["layers.0.norm.weight"])
        scores.append(router_scores(a, params["layers.0.moe.gate.weight"]))
    bias = quantile_balancing_update(scores[0], np.zeros(config.experts, np.float32), config.top_k)
    second = forward_backward(params, *batches[1], balancers, config)
    index, _ = route(scores[1], bias, config.top_k)
    q = config.batch * config.top_k / config.experts
    expected = np.bincount(index.reshape(-1), minlength=config.experts).max() / q - 1
    assert second.violations[0] == pytest.approx(expected, abs=1e-12)
    assert first.violations[0] == pytest.approx(
        np.bincount(route(scores[0], np.zeros(config.experts, np.float32), config.top_k)[0].reshape(-1),
                    minlength=config.experts).max() / q - 1, abs=1e-12)


def test_histogram_balancer_is_within_one_bin_of_exact_qb():
    rng = np.random.default_rng(4)
    scores = rng.random((400, 16)).astype(np.float32)
    bias = (0.05 * rng.standard_normal(16)).astype(np.float32)
    balancer = HistogramBalancer(16, 3, bins=500, micro_batches=3, bias=bias)
    step = balancer.step(scores)
    exact = quantile_balancing_update(scores, bias, 3)
    width = (bias.max() - bias.min() + 2) / 500
    assert np.max(np.abs(step.next_bias - exact)) <= 2 * width


def test_routed_activation_peak_matches_a_loop_over_pairs():
    from refimpl.config import MoEConfig

    rng = np.random.default_rng(7)
    for activation in ("situ", "swiglu"):
        config = MoEConfig.tiny(activation=activation)
        z = 4 * rng.standard_normal((20, config.ell))
        index = np.argsort(rng.random((20, config.n)), axis=1)[:, :config.k]
        w1, w3 = rng.standard_normal((2, config.n, config.f, config.ell))
        expected = 0.0
        for i in range(20):
            for e in index[i]:
                a, b = w1[e] @ z[i], w3[e] @ z[i]
                sig = 1 / (1 + np.exp(-a))
                h = 4 * np.tanh(a / 4) * sig * 25 * np.tanh(b / 25) if activation == "situ" else a * sig * b
                expected = max(expected, float(np.max(np.abs(h))))
        assert routed_activation_peak(z, index, w1, w3, config) == pytest.approx(expected, rel=1e-12)
        if activation == "situ":
            assert expected < 100.0  # the bound beta_1 beta_2


def test_noise_floor_matches_the_binomial_loads():
    # Each expert's load under fair random routing is Binomial(m, k/n); the floor's median matches a direct draw.
    floor = noise_floor(512, 16, 2, draws=300, seed=1)
    rng = np.random.default_rng(2)
    direct = np.array([rng.binomial(512, 2 / 16, size=16).max() / 64 - 1 for _ in range(3000)])
    assert abs(np.median(floor) - np.median(direct)) < 0.05


def test_low_precision_runs_log_what_overflows(corpus):
    log = train(tiny(steps=3, precision="bfloat16", activation="swiglu"), corpus=corpus)
    assert all(np.isfinite(r["loss"]) for r in log["steps"])
    assert log["summary"]["activation_overflow_steps"] == 0
    assert "activation_peak" in log["steps"][0]


def test_a_diverging_run_skips_its_steps_to_the_end(corpus):
    """At a learning rate of 1 the model blows up within a few dozen steps: every non-finite step is skipped.

    The weights grow until the forward pass overflows (layer inputs that are infinite), which the loop must
    meet with a skipped step, as it meets an infinite loss or gradient, not with an error.
    """
    config = TrainConfig(lr=1.0, steps=60, batch=256, eval_every=1000, stats_every=1000)
    log = train(config, corpus=corpus)
    loss = np.array([r["loss"] for r in log["steps"]])
    skipped = np.array([bool(r.get("skipped")) for r in log["steps"]])
    assert len(loss) == config.steps
    # A skipped step is one with no finite gradient; no step updates the weights with a non-finite loss.
    assert np.all(skipped[~np.isfinite(loss)])
    assert log["summary"]["skipped_steps"] == int(skipped.sum()) > 0
    # Diverged for good: the loss is NaN from some step to the end, and so is the held-out loss.
    first = int(np.flatnonzero(np.isfinite(loss))[-1]) + 1
    assert first < config.steps and not np.any(np.isfinite(loss[first:]))
    assert np.isnan(log["summary"]["final_eval_loss"])


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------

def small_flags() -> list[str]:
    return ["--d", "16", "--latent", "8", "--experts", "8", "--top-k", "2", "--intermediate", "8",
            "--layers", "1", "--context", "4", "--embed", "4", "--batch", "64", "--quiet"]


def test_command_writes_the_json_log(tmp_path):
    out = tmp_path / "run.json"
    result = main(["--balancer", "sign", "--steps", "3", "--seed", "2", "--out", str(out), *small_flags()])
    written = json.loads(out.read_text())
    assert set(written) >= {"config", "steps"}
    assert written["config"]["balancer"] == "sign" and written["config"]["seed"] == 2
    assert [r["step"] for r in written["steps"]] == [1, 2, 3]
    for record in written["steps"]:
        assert isinstance(record["loss"], float) and isinstance(record["max_violation"], float)
    assert written["steps"] == json.loads(json.dumps(result["steps"]))


def test_command_runs_as_a_module(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", "--balancer", "qb-hist", "--steps", "2",
                           "--out", str(out), *small_flags()[:-1]], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "sha256" in proc.stdout and "tokens/s" in proc.stdout
    assert len(json.loads(out.read_text())["steps"]) == 2


@pytest.mark.parametrize(("flags", "message"), [
    (["--balancer", "magic"], "invalid choice: 'magic'"),
    (["--precision", "float8"], "invalid choice: 'float8'"),
    (["--steps", "0"], "steps must be a positive integer, got 0"),
    (["--experts", "8", "--top-k", "8"], "top_k must be smaller than experts=8"),
    (["--lr", "-1"], "lr must be a positive finite number, got -1.0"),
    (["--latent", "64", "--d", "32"], "latent must be <= d=32, got 64"),
])
def test_bad_flags_give_clear_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="balancer must be one of"):
        TrainConfig(balancer="magic")
    with pytest.raises(TypeError, match="latent_norm must be True or False"):
        TrainConfig(latent_norm="off")
    assert dataclasses.replace(TrainConfig(), experts=128).target_load == 1024 * 4 / 128


def test_benchmark_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench_train.py", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    written = json.loads((tmp_path / "train.json").read_text())
    assert all(run["tokens_per_second"] > 0 for run in written["runs"].values())
    assert "tokens/s" in (tmp_path / "train.md").read_text()


# ---------------------------------------------------------------------------
# The recorded experiments still match the code
# ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("stem", "figure"), [
    ("61_balance_while_learning", "balance_while_learning.png"),
    ("62_activations_while_training", "activations_while_training.png"),
    ("63_latent_norm_while_training", "latent_norm_while_training.png"),
])
def test_experiment_records_replay(stem, figure, tmp_path):
    # Each example replays the first steps of one recorded long run with today's code (one BLAS thread, as
    # recorded): a change to the model, the layer or its gradients that moves a loss beyond rounding shows up
    # here, and the committed results must then be rerun.
    proc = subprocess.run([sys.executable, f"examples/{stem}.py", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    # Within rounding (1e-5 relative for the losses, 1e-4 with the activation peaks): a change of the arithmetic
    # that keeps the meaning (a fused fast path) moves the last bits, a change of meaning moves far more.
    assert "replayed: " in proc.stdout and "DIFFERENT" not in proc.stdout
    assert (tmp_path / figure).stat().st_size > 10_000
