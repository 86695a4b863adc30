"""The puzzles: every answer passes, every stub is "not written yet", and wrong answers are named for their mistake.

The wrong answers below are written the way a learner or a port would write
them, independently of the catalogue in `refimpl.testing.puzzles`: each must
fail its puzzle's check with a message that names the mistake it makes. The
notebooks `examples/puzzles/NN_name.ipynb` must be exactly what
`docs/puzzles.py` makes from the puzzles, and each one, copied alone into an
empty folder, must run top to bottom in a fresh kernel: the check prints that
the stub is not written yet (no traceback), and after the answer cell it
prints a pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

from refimpl import MoEConfig
from refimpl.testing.puzzles import PUZZLES, NotWrittenYet, PuzzleFailure

ROOT = Path(__file__).resolve().parents[1]
NAMES = list(PUZZLES)


@pytest.fixture(scope="module")
def generator():
    """`docs/puzzles.py`, imported as a module."""
    return load_script(ROOT / "docs" / "puzzles.py", "refimpl_docs_puzzles_under_test")


def defined(source: str, name: str):
    """The function `name` defined by `source` in a namespace that holds NumPy and nothing else."""
    namespace = {"np": np}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace[name]


# ---------------------------------------------------------------------------
# The collection
# ---------------------------------------------------------------------------

def test_ten_puzzles_in_reading_order():
    assert NAMES == ["routing", "mixture_weights", "situ_glu", "latent_forward", "cutoffs", "qb_update",
                     "dual_step", "sign_rule", "histogram_quantile", "capacity"]
    assert [p.number for p in PUZZLES.values()] == list(range(1, 11))
    for puzzle in PUZZLES.values():
        assert puzzle.title and "$$" in puzzle.spec and puzzle.hint
        assert puzzle.signature.startswith(puzzle.function_name + "(")
        assert len(puzzle.mistakes) >= 2
        assert len({m.name for m in puzzle.mistakes}) == len(puzzle.mistakes)


def test_the_top1_rule_is_the_configs():
    """Puzzle 2's rule (no renormalization of a single weight) is what `MoEConfig.from_hf_config` reads."""
    hf = MoEConfig.tiny().to_hf_config()
    hf.update(num_experts_per_token=1, moe_renormalize=True)
    assert MoEConfig.from_hf_config(hf).renormalize is False


# ---------------------------------------------------------------------------
# Solutions and stubs
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_the_solution_passes_with_numpy_alone(name):
    """The answer cell's source, run where only NumPy is defined, passes the check (no refimpl in it)."""
    puzzle = PUZZLES[name]
    assert "refimpl" not in puzzle.answer_source
    passed = puzzle.check(defined(puzzle.answer_source, puzzle.function_name))
    assert str(passed).startswith(f"Passed: `{puzzle.function_name}`")
    assert passed.examples > 0


@pytest.mark.parametrize("name", NAMES)
def test_the_stub_is_not_written_yet(name, capsys):
    puzzle = PUZZLES[name]
    stub = defined(puzzle.stub_source, puzzle.function_name)
    with pytest.raises(NotWrittenYet) as caught:
        puzzle.check(stub)
    message = str(caught.value)
    assert message.startswith(f"Not written yet: `{puzzle.function_name}` raised NotImplementedError")
    assert isinstance(caught.value, AssertionError) and caught.value.puzzle == name
    puzzle.run(stub)  # the notebook's form: prints the message, raises nothing
    printed = capsys.readouterr()
    assert printed.out == message + "\n" and printed.err == ""
    assert "Traceback" not in printed.out and len(printed.out.splitlines()) == 1


def test_a_check_writes_nothing_and_draws_the_same_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    puzzle = PUZZLES["qb_update"]
    wrong = puzzle.mistakes[0].answer
    messages = []
    for _ in range(2):
        with pytest.raises(PuzzleFailure) as caught:
            puzzle.check(wrong)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert list(tmp_path.iterdir()) == []  # no .hypothesis folder


# ---------------------------------------------------------------------------
# Wrong answers, written as a learner or a port would write them
# ---------------------------------------------------------------------------

def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def softcap(z, beta):
    return beta * np.tanh(z / beta)


# 1. Routing
def route_with_softmax(logits, bias, top_k):
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return np.argsort(-(p + bias), axis=1, kind="stable")[:, :top_k]


def route_bias_in_the_logits(logits, bias, top_k):
    return np.argsort(-sigmoid(logits + bias), axis=1, kind="stable")[:, :top_k]


def route_reversed_ascending_sort(logits, bias, top_k):
    return np.argsort(sigmoid(logits) + bias, axis=1, kind="stable")[:, ::-1][:, :top_k]


def route_with_argpartition(logits, bias, top_k):
    biased = sigmoid(logits) + bias
    chosen = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
    return np.sort(chosen, axis=1)


# 2. Mixture weights
def weights_from_biased_scores(scores, bias, index, scaling_factor):
    w = np.take_along_axis(scores + bias, index, axis=1)
    if index.shape[1] > 1:
        w = w / w.sum(axis=1, keepdims=True)
    return scaling_factor * w


def weights_always_renormalized(scores, bias, index, scaling_factor):
    w = np.take_along_axis(scores, index, axis=1)
    return scaling_factor * w / w.sum(axis=1, keepdims=True)


def weights_scaled_only_when_renormalized(scores, bias, index, scaling_factor):
    w = np.take_along_axis(scores, index, axis=1)
    if index.shape[1] == 1:
        return w
    return scaling_factor * w / w.sum(axis=1, keepdims=True)


# 3. SiTU-GLU
def glu_swiglu(gate, up, beta, linear_beta):
    return gate * sigmoid(gate) * up


def glu_caps_swapped(gate, up, beta, linear_beta):
    return softcap(gate, linear_beta) * sigmoid(gate) * softcap(up, beta)


def glu_clipped(gate, up, beta, linear_beta):
    return np.clip(gate, -beta, beta) * sigmoid(gate) * np.clip(up, -linear_beta, linear_beta)


# 4. The latent forward: one vectorized learner's layer, with a switch per mistake
def layer(x, index, weights, params, config, *, norm="sum", shared=True):
    def glu(a, b):
        return softcap(a, config.situ_beta) * sigmoid(a) * softcap(b, config.situ_linear_beta)

    def rms(t):
        return t / np.sqrt((t**2).mean(axis=-1, keepdims=True) + config.rms_norm_eps)

    z = x @ params["routed_expert_down_proj.weight"].T  # [m, l]
    g1, g3, g2 = (params[f"experts.w{i}"][index] for i in (1, 3, 2))  # [m, k, f, l], [m, k, f, l], [m, k, l, f]
    h = glu(np.einsum("mkfl,ml->mkf", g1, z), np.einsum("mkfl,ml->mkf", g3, z))
    out = np.einsum("mklf,mkf->mkl", g2, h)  # [m, k, l]
    if norm == "each":
        out = rms(out) * params["routed_expert_norm.weight"]
    u = np.einsum("mk,mkl->ml", weights, out)
    if norm == "sum":
        u = rms(u) * params["routed_expert_norm.weight"]
    y = u @ params["routed_expert_up_proj.weight"].T
    if shared:
        s = glu(x @ params["shared_experts.gate_proj.weight"].T, x @ params["shared_experts.up_proj.weight"].T)
        y = y + s @ params["shared_experts.down_proj.weight"].T
    return y


def layer_without_the_norm(x, index, weights, params, config):
    return layer(x, index, weights, params, config, norm="none")


def layer_norm_per_expert(x, index, weights, params, config):
    return layer(x, index, weights, params, config, norm="each")


def layer_without_shared_experts(x, index, weights, params, config):
    return layer(x, index, weights, params, config, shared=False)


# 5. Cutoffs
def cutoff_kth(scores, bias, top_k):
    return np.sort(scores + bias, axis=1)[:, -top_k]


def cutoff_raw(scores, bias, top_k):
    return np.sort(scores, axis=1)[:, -(top_k + 1)]


# 6. Quantile Balancing
def qb_margins(scores, bias, top_k):
    alpha = np.sort(scores + bias, axis=1)[:, -(top_k + 1)]
    return scores - alpha[:, None]


def qb_qth(scores, bias, top_k):
    m, n = scores.shape
    q = m * top_k // n
    b = -np.sort(qb_margins(scores, bias, top_k), axis=0)[m - q]  # ascending row m - q: the q-th largest
    return b - b.mean()


def qb_numpy_quantile(scores, bias, top_k):
    n = scores.shape[1]
    b = -np.quantile(qb_margins(scores, bias, top_k), 1 - top_k / n, axis=0)
    return b - b.mean()


def qb_uncentred(scores, bias, top_k):
    m, n = scores.shape
    return -np.sort(qb_margins(scores, bias, top_k), axis=0)[m - m * top_k // n - 1]


def qb_distinct_margins(scores, bias, top_k):
    m, n = scores.shape
    q = m * top_k // n
    margins = qb_margins(scores, bias, top_k)
    b = np.array([-np.unique(margins[:, j])[::-1][q] for j in range(n)])
    return b - b.mean()


# 7. The dual step
def dual_centred(scores, beta, top_k):
    m, n = scores.shape
    alpha = np.sort(scores - beta, axis=1)[:, -(top_k + 1)]
    new = np.sort(scores - alpha[:, None], axis=0)[m - m * top_k // n - 1]
    return alpha, new - new.mean()


def dual_beta_qth(scores, beta, top_k):
    m, n = scores.shape
    alpha = np.sort(scores - beta, axis=1)[:, -(top_k + 1)]
    return alpha, np.sort(scores - alpha[:, None], axis=0)[m - m * top_k // n]


# 8. The sign rule
def sign_flipped(load, bias, rate):
    q = load.mean()
    return bias - rate * np.sign(q - load)


def sign_proportional(load, bias, rate):
    return bias + rate * (load.mean() - load)


def sign_moves_everyone(load, bias, rate):
    return np.where(load > load.mean(), bias - rate, bias + rate)


# 9. The histogram quantile
def hist_read(counts, bias, top_k, *, rank_offset=1, inside="middle"):
    n, bins = counts.shape
    t = counts[0].sum() * top_k // n + rank_offset
    low = bias.min() - 1
    w = (bias.max() + 1 - low) / bins
    out = np.empty(n)
    for j in range(n):
        cum = np.cumsum(counts[j])
        b = int(np.searchsorted(cum, t))  # first bin whose cumulative count reaches t
        before = cum[b] - counts[j, b]
        frac = {"middle": (t - before - 0.5) / counts[j, b], "edge": 0.0, "cdf": (t - before) / counts[j, b]}[inside]
        out[j] = low + (b + frac) * w
    return out


def hist_bin_edge(counts, bias, top_k):
    return hist_read(counts, bias, top_k, inside="edge")


def hist_rank_q(counts, bias, top_k):
    return hist_read(counts, bias, top_k, rank_offset=0)


def hist_cdf(counts, bias, top_k):
    return hist_read(counts, bias, top_k, inside="cdf")


# 10. Capacity
def capacity_token_major(index, weights, num_experts, capacity):
    used = [0] * num_experts
    kept = np.zeros(index.shape, dtype=bool)
    for i, row in enumerate(index):
        for r, e in enumerate(row):
            if used[e] < capacity:
                used[e] += 1
                kept[i, r] = True
    return kept, weights * kept


def capacity_renormalized(index, weights, num_experts, capacity):
    m, k = index.shape
    used = np.zeros(num_experts, dtype=int)
    kept = np.zeros((m, k), dtype=bool)
    for r in range(k):
        for i in range(m):
            if used[index[i, r]] < capacity:
                used[index[i, r]] += 1
                kept[i, r] = True
    w = weights * kept
    total = w.sum(axis=1, keepdims=True)
    return kept, np.divide(w, total, out=np.zeros_like(w), where=total > 0)


WRONG = [
    ("routing", route_with_softmax, "softmax_scores"),
    ("routing", route_bias_in_the_logits, "bias_on_logits"),
    ("routing", route_reversed_ascending_sort, "ties_to_higher_id"),
    ("routing", route_with_argpartition, "ids_in_id_order"),
    ("mixture_weights", weights_from_biased_scores, "bias_in_weights"),
    ("mixture_weights", weights_always_renormalized, "top1_renormalized"),
    ("mixture_weights", weights_scaled_only_when_renormalized, "scale_skipped_without_renormalization"),
    ("situ_glu", glu_swiglu, "swiglu"),
    ("situ_glu", glu_caps_swapped, "caps_swapped"),
    ("situ_glu", glu_clipped, "hard_clamp"),
    ("latent_forward", layer_without_the_norm, "norm_skipped"),
    ("latent_forward", layer_norm_per_expert, "norm_per_expert"),
    ("latent_forward", layer_without_shared_experts, "shared_left_out"),
    ("cutoffs", cutoff_kth, "kth_not_k_plus_1th"),
    ("cutoffs", cutoff_raw, "bias_left_out"),
    ("qb_update", qb_qth, "qth_not_q_plus_1th"),
    ("qb_update", qb_numpy_quantile, "numpy_quantile"),
    ("qb_update", qb_uncentred, "not_centred"),
    ("qb_update", qb_distinct_margins, "ties_counted_once"),
    ("dual_step", dual_centred, "beta_centred"),
    ("dual_step", dual_beta_qth, "beta_qth"),
    ("sign_rule", sign_flipped, "sign_flipped"),
    ("sign_rule", sign_proportional, "gradient_not_sign"),
    ("sign_rule", sign_moves_everyone, "on_target_moved"),
    ("histogram_quantile", hist_bin_edge, "bin_edge"),
    ("histogram_quantile", hist_rank_q, "rank_q"),
    ("histogram_quantile", hist_cdf, "cdf_interpolation"),
    ("capacity", capacity_token_major, "token_major"),
    ("capacity", capacity_renormalized, "renormalized_after_drop"),
]


@pytest.mark.parametrize("name, wrong, mistake", WRONG, ids=[w.__name__ for _, w, _ in WRONG])
def test_a_wrong_answer_is_named_for_its_mistake(name, wrong, mistake, capsys):
    puzzle = PUZZLES[name]
    with pytest.raises(PuzzleFailure) as caught:
        puzzle.check(wrong)
    failure = caught.value
    assert not isinstance(failure, NotWrittenYet)
    assert failure.mistake is not None and failure.mistake.name == mistake, str(failure)
    assert failure.reproduced
    message = str(failure)
    assert message.startswith("Not yet: on ") and f"`{wrong.__name__}`" in message.split("\n\n")[0]
    assert f"The mistake: {failure.mistake.title}." in message
    assert "The simplest input Hypothesis found:" in message and f"Expected ({puzzle.reference_name}):" in message
    puzzle.run(wrong)
    assert capsys.readouterr().out == message + "\n"


MADE_BELOW = {(name, mistake) for name, _, mistake in WRONG}


@pytest.mark.parametrize("name, mistake", [(n, m.name) for n in NAMES for m in PUZZLES[n].mistakes
                                           if (n, m.name) not in MADE_BELOW])
def test_every_other_catalogued_mistake_is_named(name, mistake):
    """A catalogued mistake that no wrong answer above makes is named when its own answer is checked."""
    puzzle = PUZZLES[name]
    entry = next(m for m in puzzle.mistakes if m.name == mistake)
    with pytest.raises(PuzzleFailure) as caught:
        puzzle.check(entry.answer)
    assert caught.value.mistake is entry and caught.value.reproduced
    assert f"The mistake: {entry.title}." in str(caught.value)


def test_every_puzzle_has_two_wrong_answers_here():
    for name in NAMES:
        assert sum(1 for n, _, _ in WRONG if n == name) >= 2, name


def test_an_unknown_mistake_shows_the_input_expected_and_got():
    def smallest_first(logits, bias, top_k):
        return np.argsort(sigmoid(logits) + bias, axis=1, kind="stable")[:, :top_k]

    with pytest.raises(PuzzleFailure) as caught:
        PUZZLES["routing"].check(smallest_first)
    message = str(caught.value)
    assert caught.value.mistake is None
    assert "none of the mistakes this puzzle knows" in message
    assert "logits = np.array(" in message and "Got (smallest_first):" in message


def test_a_malformed_answer_or_an_error_is_a_message_not_a_traceback(capsys):
    def wrong_shape(scores, bias, top_k):
        return np.zeros(scores.shape[1] + 1)

    def crashes(scores, bias, top_k):
        return scores[scores.shape[0] + 5]

    puzzle = PUZZLES["cutoffs"]
    for fn, words in ((wrong_shape, "alpha must have shape"), (crashes, "it raised IndexError")):
        puzzle.run(fn)
        out = " ".join(capsys.readouterr().out.split())  # the message's lines are wrapped
        assert "did not return a valid answer" in out and words in out and "Traceback" not in out


# ---------------------------------------------------------------------------
# The notebooks
# ---------------------------------------------------------------------------

def test_the_committed_notebooks_are_what_the_generator_makes(generator):
    stale = generator.stale()
    assert not stale, f"{[str(p.relative_to(ROOT)) for p in stale]} differ: run `{generator.REFRESH}`"
    committed = sorted(p.name for p in (ROOT / "examples" / "puzzles").glob("*.ipynb"))
    assert committed == sorted(f"{p.slug}.ipynb" for p in PUZZLES.values())


def test_a_notebook_hides_the_hint_and_the_answer(generator):
    import nbformat

    for puzzle in PUZZLES.values():
        nb = generator.notebook(puzzle)
        nbformat.validate(nb)
        by_tag = {tag: cell for cell in nb.cells for tag in cell.metadata.get("tags", [])}
        assert by_tag["stub"].source.rstrip().endswith("raise NotImplementedError  # your answer here")
        assert by_tag["check"].source == f"puzzle.run({puzzle.function_name})"
        for tag in ("hint", "answer"):
            assert by_tag[tag].metadata["jupyter"] == {"source_hidden": True}
        assert "refimpl" not in by_tag["stub"].source + by_tag["answer"].source
        assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")


def printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_notebook_runs_alone_in_a_fresh_kernel(name, tmp_path):
    """Copied alone into an empty folder: the stub's check prints "not written yet"; after the answer cell,
    the same check prints a pass. Nothing prints a traceback or goes to stderr."""
    import nbformat

    notebooks = load_script(ROOT / "docs" / "notebooks.py", "refimpl_docs_notebooks_for_puzzles")
    puzzle = PUZZLES[name]
    folder = tmp_path / "empty"
    folder.mkdir()
    path = folder / f"{puzzle.slug}.ipynb"
    shutil.copy(ROOT / "examples" / "puzzles" / path.name, path)
    nb = nbformat.read(path, as_version=4)
    # After the (collapsed) answer cell, run the one-line check again, as a learner who opened it would.
    again = nbformat.v4.new_code_cell(f"puzzle.run({puzzle.function_name})")
    again.id = "check-again"
    nb.cells.append(again)
    executed = notebooks.execute(nb, folder, timeout=300)
    code = [c for c in executed.cells if c.cell_type == "code"]
    check = next(c for c in code if "check" in c.metadata.get("tags", []))
    assert printed(check).startswith(f"Not written yet: `{puzzle.function_name}` raised NotImplementedError")
    assert printed(code[-1]).startswith(f"Passed: `{puzzle.function_name}`")
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error" or o.get("name") == "stderr"]
    assert "Traceback" not in json.dumps([printed(c) for c in code])
    assert sorted(p.name for p in folder.iterdir()) == [path.name]  # the check wrote nothing beside it
