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
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refimpl.balancing import quantile_balancing_update
from refimpl.config import MoEConfig
from refimpl.studies.recorded import load_record
from refimpl.train import (
    BALANCERS,
    HistogramBalancer,
    TrainConfig,
    cross_entropy,
    default_layer,
    forward_backward,
    init_model,
    load_corpus,
    main,
    noise_floor,
    read_checkpoint,
    rms_norm_vjp,
    routed_activation_peak,
    sample_batch,
    train,
)

ROOT = Path(__file__).resolve().parents[1]

#: A model small enough for a step in a few milliseconds.
TINY_LAYER = dict(hidden_size=16, latent_size=8, num_experts=8, top_k=2, intermediate_size=8, num_moe_layers=2)
TINY = dict(context=4, embed=4, batch=128, eval_batch=64, stats_every=5, eval_every=10)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def tiny(layers: int = 2, **changes) -> TrainConfig:
    layer = {**TINY_LAYER, "num_moe_layers": layers}
    layer.update({name: changes.pop(name) for name in list(changes) if name in MoEConfig.__dataclass_fields__})
    return TrainConfig(moe=default_layer(**layer), **{**TINY, **changes})


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
    config = tiny(balancer="none")
    params = {name: value.astype(np.float64) for name, value in init_model(config, np.random.default_rng(1)).items()}
    tokens, targets = sample_batch(corpus.data, np.random.default_rng(2), 32, config.context)

    def loss_at(p):
        balancers = [BALANCERS["none"](config) for _ in range(config.moe.num_moe_layers)]
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
    balancers = [BALANCERS["none"](config) for _ in range(config.moe.num_moe_layers)]
    grads = forward_backward(params, tokens, targets, balancers, config).grads
    for layer in range(config.moe.num_moe_layers):
        bias_grad = grads[f"layers.{layer}.moe.gate.e_score_correction_bias"]
        assert bias_grad.shape == (config.moe.num_experts,) and not np.any(bias_grad)
        assert np.any(grads[f"layers.{layer}.moe.gate.weight"])  # the router itself does learn
    # Without a balancer the bias is exactly zero after training while the router moved: only a balancer
    # may set the bias, never the optimizer.
    start = init_model(config, np.random.default_rng(config.seed))
    final: dict = {}
    train(config, corpus=corpus, final_params=final)
    for layer in range(config.moe.num_moe_layers):
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
    config = dict(steps=30, batch=512, context=8, embed=8, stats_every=100, eval_every=100,
                  moe=default_layer(hidden_size=32, latent_size=16, num_experts=32, top_k=2, intermediate_size=16,
                                    num_moe_layers=1))
    settled = {}
    for balancer in ("qb", "sign", "none"):
        log = train(TrainConfig(balancer=balancer, **config), corpus=corpus)
        settled[balancer] = float(np.mean([r["max_violation"] for r in log["steps"][-10:]]))
    assert settled["qb"] < settled["sign"]
    assert settled["qb"] < 0.5 * settled["none"]


def test_max_violation_is_the_load_of_the_batch_routed_with_the_bias_in_use(corpus):
    # Recompute step 2's violation independently: route its batch with the bias QB computed from step 1.
    from refimpl.layer.routing import route, router_scores

    config = tiny(layers=1, steps=2, balancer="qb")
    params = init_model(config, np.random.default_rng(0))
    rng = np.random.default_rng(9)
    batches = [sample_batch(corpus.data, rng, config.batch, config.context) for _ in range(2)]
    balancers = [BALANCERS["qb"](config)]
    first = forward_backward(params, *batches[0], balancers, config)
    scores = []
    for tokens, _ in batches:
        m = tokens.shape[0]
        h = params["embed.weight"][tokens].reshape(m, -1) @ params["mix.weight"].T
        a = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + 1e-5) * params["layers.0.norm.weight"]
        scores.append(router_scores(a, params["layers.0.moe.gate.weight"]))
    n, k = config.moe.num_experts, config.moe.top_k
    bias = quantile_balancing_update(scores[0], np.zeros(n, np.float32), k)
    second = forward_backward(params, *batches[1], balancers, config)
    index, _ = route(scores[1], bias, k)
    q = config.batch * k / n
    expected = np.bincount(index.reshape(-1), minlength=n).max() / q - 1
    assert second.violations[0] == pytest.approx(expected, abs=1e-12)
    assert first.violations[0] == pytest.approx(
        np.bincount(route(scores[0], np.zeros(n, np.float32), k)[0].reshape(-1), minlength=n).max() / q - 1,
        abs=1e-12)


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
# The configuration
# ---------------------------------------------------------------------------

def test_config_holds_the_layer_and_reads_every_recorded_run():
    config = TrainConfig()
    assert config.moe == MoEConfig(hidden_size=64, latent_size=32, num_experts=64, top_k=4, intermediate_size=32,
                                   num_shared_experts=1, num_moe_layers=2)
    assert TrainConfig.from_record(json.loads(json.dumps(config.to_record()))) == config
    assert config.to_record()["moe"]["num_experts"] == 64  # the log holds the layer's fields
    assert dataclasses.replace(config, moe=config.moe.replace(num_experts=128)).target_load == 1024 * 4 / 128
    # The runs recorded before the configuration held a MoEConfig: flat fields, read with their old meaning.
    flat = {"d": "hidden_size", "latent": "latent_size", "experts": "num_experts", "top_k": "top_k",
            "intermediate": "intermediate_size", "shared": "num_shared_experts", "activation": "activation",
            "latent_norm": "use_latent_norm", "layers": "num_moe_layers"}
    records = []
    for name in ("61_balance_while_learning", "62_activations_while_training", "63_latent_norm_while_training",
                 "61_balance_at_k3_scale", "balancers_training", "default_run"):
        data = load_record(f"{name}.json")
        runs = data.get("runs", {})
        for run in (runs if isinstance(runs, list) else [r for by_seed in runs.values() for r in by_seed.values()]):
            records.append(run["config"])
        if "config" in data:
            records.append(data["config"])
    assert len(records) > 50
    for record in records:
        read = TrainConfig.from_record(record)
        for old, new in flat.items():
            if old in record:
                assert getattr(read.moe, new) == record[old], (old, record)
        assert read.lr == record["lr"] and read.balancer == record["balancer"] and read.seed == record["seed"]
        assert read.moe.capacity_factor is None and not read.moe.hash_routing and read.moe.situ_beta == 4.0
    with pytest.raises(ValueError, match=r"does not have: \['colour'\]"):
        TrainConfig.from_record({**config.to_record(), "colour": "red"})
    with pytest.raises(ValueError, match=r"lacks \['layers'\]"):
        TrainConfig.from_record({"d": 8, "latent": 4, "experts": 6, "top_k": 2, "intermediate": 6, "shared": 1,
                                 "activation": "situ", "latent_norm": True})


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="balancer must be one of"):
        TrainConfig(balancer="magic")
    with pytest.raises(TypeError, match="moe must be a MoEConfig"):
        TrainConfig(moe={"num_experts": 8})
    for field_name, value, message in [("seed", -1, "seed must be a non-negative integer, got -1"),
                                       ("steps", 0, "steps must be a positive integer, got 0"),
                                       ("lr", float("nan"), "lr must be a positive finite number, got nan"),
                                       ("grad_clip", -1.0, "grad_clip must be a non-negative finite number"),
                                       ("batch", 1, "batch does not suit the balancer 'qb': a batch of 1 tokens")]:
        with pytest.raises(ValueError, match=re.escape(message)) as exc:
            TrainConfig(**{field_name: value})
        assert exc.value.field == field_name
    with pytest.raises(ValueError, match="moe.top_k must be smaller than moe.num_experts=8"):
        TrainConfig(moe=default_layer(num_experts=8, top_k=8))
    assert TrainConfig(steps=np.int64(7)).steps == 7 and type(TrainConfig(steps=np.int64(7)).steps) is int


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------

def small_flags(batch: int = 64) -> list[str]:
    return ["--d", "16", "--latent", "8", "--experts", "8", "--top-k", "2", "--intermediate", "8",
            "--layers", "1", "--context", "4", "--embed", "4", "--batch", str(batch), "--quiet"]


def strict_json(text: str):
    """Parse JSON refusing NaN and Infinity, which are not JSON."""
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_command_writes_the_json_log(tmp_path):
    out = tmp_path / "run.json"
    result = main(["--balancer", "sign", "--steps", "3", "--seed", "2", "--out", str(out), *small_flags()])
    written = strict_json(out.read_text())
    assert set(written) >= {"config", "steps"}
    assert written["config"]["balancer"] == "sign" and written["config"]["seed"] == 2
    assert written["config"]["moe"]["num_experts"] == 8 and written["config"]["moe"]["hidden_size"] == 16
    assert [r["step"] for r in written["steps"]] == [1, 2, 3]
    for record in written["steps"]:
        assert isinstance(record["loss"], float) and isinstance(record["max_violation"], float)
    assert written["steps"] == json.loads(json.dumps(result["steps"]))
    # New files get the permissions of the umask, like any file the user creates.
    assert (out.stat().st_mode & 0o777) == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_command_runs_as_a_module(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", "--balancer", "qb-hist", "--steps", "2",
                           "--out", str(out), *small_flags()[:-1]], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "sha256" in proc.stdout and "tokens/s" in proc.stdout
    assert len(json.loads(out.read_text())["steps"]) == 2
    # A bad value, the way a user meets it: exit status 2, one line naming the flag, no traceback.
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", "--context", "1000000000", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "argument --context:" in proc.stderr and "Traceback" not in proc.stderr
    assert "TiB" in proc.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--balancer", "magic"], "invalid choice: 'magic'"),
    (["--precision", "float8"], "invalid choice: 'float8'"),
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--seed", "-1"], "argument --seed: must be between 0 and"),
    (["--seed", "x"], "argument --seed: must be an integer, got 'x'"),
    (["--batch", "1"], "argument --batch: batch does not suit the balancer 'qb': a batch of 1 tokens is too small"),
    (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
    (["--batch", "100", "--balancer", "seq"], "argument --batch: batch does not suit the balancer 'seq'"),
    (["--batch", "3", "--balancer", "qb-hist", "--experts", "4", "--top-k", "1"],
     "argument --batch: batch does not suit the balancer 'qb-hist': a batch of 3 tokens cannot be split into "
     "micro_batches=4"),
    (["--context", "1000000000"], "argument --context: the run would need about"),
    (["--batch", "1000000000"], "argument --batch: the run would need about"),
    (["--d", "0"], "argument --d: must be between 1 and 65,536, got 0"),
    (["--experts", "-4"], "argument --experts: must be between 1 and 65,536, got -4"),
    (["--shared", "-1"], "argument --shared: must be between 0 and 1,024, got -1"),
    (["--experts", "8", "--top-k", "8"], "argument --top-k: must be smaller than --experts (8)"),
    (["--lr", "-1"], "argument --lr: must be a positive finite number, got -1"),
    (["--lr", "nan"], "argument --lr: must be a positive finite number, got nan"),
    (["--gamma", "inf"], "argument --gamma/--sign-rate: must be a positive finite number, got inf"),
    (["--grad-clip", "-0.5"], "argument --grad-clip: must be a non-negative finite number, got -0.5"),
    (["--latent", "64", "--d", "32"], "argument --latent: must be at most --d (32), got 64"),
    (["--checkpoint-every", "2"], "argument --checkpoint-every: needs --checkpoint DIR"),
    (["--checkpoint-every", "-1"], "argument --checkpoint-every: must be at least 0, got -1"),
])
def test_bad_flags_give_clear_errors_before_anything_runs(flags, message, capsys, monkeypatch):
    # Nothing may be trained or read: the corpus loader fails the test if it is reached.
    monkeypatch.setattr("refimpl.train.cli.load_corpus", lambda: pytest.fail("the corpus was read"))
    with pytest.raises(SystemExit) as exc:
        main(flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_context_longer_than_the_held_out_text_is_refused(capsys, monkeypatch):
    monkeypatch.setattr("refimpl.train.cli.train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        main(["--context", "60000", "--batch", "64", "--quiet"])
    assert exc.value.code == 2
    assert "argument --context: context must be shorter than the held-out text" in capsys.readouterr().err


def unwritable_folder(tmp_path: Path) -> Path | None:
    """A folder this process cannot create a file in: a read-only one of its own, or (as root) one of /sys."""
    import tempfile

    candidates = [tmp_path / "locked", Path("/sys/kernel")]
    candidates[0].mkdir(mode=0o500)
    for folder in candidates:
        try:
            with tempfile.NamedTemporaryFile(dir=folder):
                pass
        except OSError:
            return folder
    return None


def test_out_is_checked_before_the_first_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("refimpl.train.cli.load_corpus", lambda: pytest.fail("the corpus was read"))
    (tmp_path / "file.txt").write_text("a file")
    (tmp_path / "old.json").write_text("the previous log")
    cases = [(tmp_path, "is a folder"), (tmp_path / "file.txt" / "run.json", "is a file, not a folder"),
             (tmp_path / "old.json", "already exists; pass --overwrite")]
    locked = unwritable_folder(tmp_path)
    if locked is not None:
        cases.append((locked / "run.json", "cannot write in the folder"))
    for out, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(["--out", str(out), *small_flags()])
        assert exc.value.code == 2
        error = capsys.readouterr().err
        assert "argument --out:" in error and message in error, error
    assert (tmp_path / "old.json").read_text() == "the previous log"
    # A refused run leaves nothing behind: the folders of --out are made only when the log is written.
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "new" / "run.json"), "--checkpoint", str(tmp_path / "file.txt"),
              *small_flags()])
    assert "argument --checkpoint:" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_a_diverging_run_writes_strict_json(tmp_path):
    out = tmp_path / "run.json"
    main(["--lr", "1", "--steps", "60", "--batch", "256", "--eval-every", "1000", "--stats-every", "1000",
          "--quiet", "--out", str(out)])
    written = strict_json(out.read_text())
    losses = [step["loss"] for step in written["steps"]]
    assert None in losses and losses[-1] is None  # NaN losses of the diverged steps are null
    assert written["summary"]["final_eval_loss"] is None


def test_a_failed_write_leaves_the_previous_log(tmp_path, capsys, monkeypatch):
    """The write fails after 512 bytes (a full disk): the old file is intact and no temporary file remains."""
    out = tmp_path / "run.json"
    out.write_text("the previous log\n")
    import refimpl._lib.files as files

    opened = files.tempfile.NamedTemporaryFile

    class FullDisk:
        def __init__(self, handle):
            self.handle, self.name = handle, handle.name

        def write(self, data):
            self.handle.write(data[:512])
            raise OSError(27, "File too large")

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(files.tempfile, "NamedTemporaryFile", lambda **kw: FullDisk(opened(**kw)))
    with pytest.raises(SystemExit) as exc:
        main(["--steps", "2", "--out", str(out), "--overwrite", *small_flags()])
    assert exc.value.code == 1
    assert f"could not write the log to {out}" in capsys.readouterr().err
    assert out.read_text() == "the previous log\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
    # With --overwrite and a write that works, the file is replaced.
    monkeypatch.undo()
    main(["--steps", "2", "--out", str(out), "--overwrite", *small_flags()])
    assert len(strict_json(out.read_text())["steps"]) == 2




# ---------------------------------------------------------------------------
# Checkpoint and resume
# ---------------------------------------------------------------------------

TIMINGS = ("seconds", "tokens_per_second", "sessions")


def flatten(value, path=()):
    """Every leaf of a JSON-like value, as (path, value)."""
    if isinstance(value, dict):
        for key in sorted(value):
            yield from flatten(value[key], (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from flatten(item, (*path, i))
    else:
        yield path, value


def assert_same_log(resumed: dict, straight: dict) -> None:
    """Two logs hold the same configuration, steps and summary, every number to 1e-12 relative, timings apart."""
    def leaves(log):
        summary = {key: value for key, value in log["summary"].items() if key not in TIMINGS}
        return dict(flatten({"config": log["config"], "steps": log["steps"], "summary": summary}))

    a, b = leaves(resumed), leaves(straight)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    for path, value in a.items():
        other = b[path]
        if isinstance(value, float) and isinstance(other, float):
            assert (math.isnan(value) and math.isnan(other)) or value == pytest.approx(other, rel=1e-12, abs=0), path
        else:
            assert value == other, path


RESUME_FLAGS = ["--d", "16", "--latent", "8", "--experts", "8", "--top-k", "2", "--intermediate", "8",
                "--layers", "2", "--context", "4", "--embed", "4", "--batch", "128", "--eval-every", "4",
                "--stats-every", "3", "--quiet", "--seed", "3"]


@pytest.mark.parametrize("balancer", sorted(BALANCERS))
def test_resume_after_5_of_12_steps_logs_the_uninterrupted_run(tmp_path, balancer):
    flags = ["--balancer", balancer, *RESUME_FLAGS]
    straight = main([*flags, "--steps", "12", "--out", str(tmp_path / "straight.json")])
    main([*flags, "--steps", "5", "--checkpoint", str(tmp_path / "ck")])
    resumed = main(["--resume", str(tmp_path / "ck"), "--steps", "12", "--quiet",
                    "--out", str(tmp_path / "resumed.json")])
    assert_same_log(resumed, straight)
    assert_same_log(json.loads((tmp_path / "resumed.json").read_text()),
                    json.loads((tmp_path / "straight.json").read_text()))
    assert [(s["first_step"], s["last_step"]) for s in resumed["summary"]["sessions"]] == [(1, 5), (6, 12)]
    assert resumed["config"] == straight["config"]


def test_checkpoint_folder_is_arrays_and_json(tmp_path):
    main(["--balancer", "qb", *RESUME_FLAGS, "--steps", "4", "--checkpoint", str(tmp_path / "ck"),
          "--checkpoint-every", "2"])
    pointer = json.loads((tmp_path / "ck" / "latest.json").read_text())
    assert pointer["format"] == "refimpl.train checkpoint" and pointer["step"] == 4
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted(["latest.json", pointer["checkpoint"]])
    folder = tmp_path / "ck" / pointer["checkpoint"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["adam.npz", "balancer-0.npz", "balancer-1.npz", "log.json",
                                         "params.npz"]
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if name.endswith(".npz"):
            with np.load(folder / name, allow_pickle=False) as arrays:
                assert arrays.files
    assert manifest["step"] == 4 and manifest["adam_step"] == 4
    assert len(strict_json((folder / "log.json").read_text())["steps"]) == 4


def test_resume_refuses_what_is_not_its_checkpoint(tmp_path, capsys, corpus):
    ck = tmp_path / "ck"
    main(["--balancer", "sign", *RESUME_FLAGS, "--steps", "3", "--checkpoint", str(ck)])

    def error(argv):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        return capsys.readouterr().err

    assert "argument --experts: the checkpoint in" in error(["--resume", str(ck), "--steps", "6", "--experts", "16"])
    assert "trained with --gamma 0.001" in error(["--resume", str(ck), "--steps", "6", "--gamma", "0.01"])
    assert "--steps must be at least that, got 2" in error(["--resume", str(ck), "--steps", "2"])
    assert "holds no complete training checkpoint" in error(["--resume", str(tmp_path), "--steps", "6"])
    # The API names the field that differs.
    config = read_checkpoint(ck).config
    with pytest.raises(ValueError, match=r"moe.num_experts=8 in the checkpoint, 16 here"):
        train(dataclasses.replace(config, moe=config.moe.replace(num_experts=16)), corpus=corpus, resume=ck)
    with pytest.raises(ValueError, match=r"lr=0.003 in the checkpoint, 0.01 here"):
        train(dataclasses.replace(config, lr=0.01), corpus=corpus, resume=ck)
    # A damaged file is found by its digest.
    params = next(ck.glob("step-*/params.npz"))
    data = bytearray(params.read_bytes())
    data[-100] ^= 1
    params.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="params.npz is not the file the checkpoint wrote"):
        train(dataclasses.replace(config, steps=6), corpus=corpus, resume=ck)


def test_checkpoint_folder_is_checked_before_the_first_step(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    main(["--balancer", "none", *RESUME_FLAGS, "--steps", "1", "--checkpoint", str(tmp_path / "ck")])
    monkeypatch.setattr("refimpl.train.cli.train", lambda *a, **k: pytest.fail("training started"))
    for folder, message in [(tmp_path / "file", "is a file, not a folder"),
                            (tmp_path / "file" / "ck", "is a file, not a folder"),
                            (tmp_path / "notes", "holds files that are not a training checkpoint (todo.txt)"),
                            (tmp_path / "ck", "already holds a training checkpoint; pass --resume")]:
        with pytest.raises(SystemExit) as exc:
            main(["--balancer", "none", *RESUME_FLAGS, "--steps", "2", "--checkpoint", str(folder)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --checkpoint:" in err and message in err, err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    # A file of the user's own next to a checkpoint (the log, say) is neither refused nor touched by a resume.
    monkeypatch.undo()
    (tmp_path / "ck" / "run.json").write_text("my log")
    main(["--resume", str(tmp_path / "ck"), "--steps", "2", "--quiet"])
    assert (tmp_path / "ck" / "run.json").read_text() == "my log"
    assert read_checkpoint(tmp_path / "ck").step == 2


#: Run the command in a process that stops, at its second checkpoint, at the place named by argv[1], and says so.
PAUSING = """
import sys, time
import refimpl.train
import refimpl.train.checkpoints as T

where, argv = sys.argv[1], sys.argv[2:]
calls = {"write": 0, "pointer": 0, "remove": 0}

def pause():
    print("PAUSED", flush=True)
    time.sleep(600)

write_file, write_atomically, rmtree = T._write_file, T.write_atomically, T.shutil.rmtree

def paused_write_file(path, data):
    calls["write"] += 1
    if where == "file" and calls["write"] == 5:  # the second checkpoint's params.npz, half written
        with open(path, "xb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
        pause()
    write_file(path, data)

def paused_pointer(path, write):
    calls["pointer"] += 1
    if where == "pointer" and calls["pointer"] == 2:  # the second checkpoint is in place, latest.json not yet
        pause()
    write_atomically(path, write)

def paused_remove(path, *args, **kwargs):
    calls["remove"] += 1
    if where == "cleanup" and calls["remove"] == 1:  # latest.json names the second, the first is not yet gone
        pause()
    rmtree(path, *args, **kwargs)

T._write_file, T.write_atomically, T.shutil.rmtree = paused_write_file, paused_pointer, paused_remove
refimpl.train.main(argv)
"""


@pytest.fixture(scope="module")
def straight_qb_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "straight.json"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", "--balancer", "qb", *RESUME_FLAGS, "--steps",
                           "12", "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("where", ["file", "pointer", "cleanup"])
def test_a_run_killed_while_checkpointing_resumes_from_what_is_on_disk(tmp_path, where, straight_qb_run):
    """SIGKILL at three moments of the second checkpoint's write; resume from the folder as it was left."""
    import signal

    ck = tmp_path / "ck"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", PAUSING, where, "--balancer", "qb", *RESUME_FLAGS, "--steps",
                                "12", "--checkpoint", str(ck), "--checkpoint-every", "3"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.strip() == "PAUSED", process.stderr.read()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        process.stdout.close()
        process.stderr.close()
    # What the kill left: the first checkpoint (step 3) is current, or the second (step 6) once latest.json
    # named it; a half-written folder may remain, and is cleaned up by the next checkpoint.
    pointer = json.loads((ck / "latest.json").read_text())
    assert pointer["step"] == (6 if where == "cleanup" else 3)
    out = tmp_path / "resumed.json"
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", "--resume", str(ck), "--steps", "12", "--quiet",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert_same_log(json.loads(out.read_text()), straight_qb_run)
    final = json.loads((ck / "latest.json").read_text())
    assert final["step"] == 12
    assert sorted(p.name for p in ck.iterdir()) == sorted(["latest.json", final["checkpoint"]])


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
    # Within 1e-4 relative over the first two steps: a change of the arithmetic that keeps the meaning (a fused
    # fast path, another machine's BLAS, a token within rounding of a tie) moves the losses by less, a change of
    # meaning by far more.
    assert "replayed: " in proc.stdout and "DIFFERENT" not in proc.stdout
    assert (tmp_path / figure).stat().st_size > 10_000


def test_a_relu2_layer_is_refused_for_training_by_name():
    """Training moves each expert's gate and up matrices apart, which would untie an ungated relu2 expert."""
    from refimpl.train import TrainConfig, TrainConfigError, default_layer

    with pytest.raises(TrainConfigError, match=r"moe.activation must be 'situ' or 'swiglu'.*got 'relu2'"):
        TrainConfig(moe=default_layer(activation="relu2", use_latent_norm=False))
