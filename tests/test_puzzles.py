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
    assert message.startswith(f"Not yet: `{puzzle.function_name}` is not written yet: it raised "
                              "NotImplementedError")
    assert caught.value.kind == "stub"
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




#: Mistakes whose wrong answers depend on how this machine's NumPy sorts equal values: np.argsort's default
#: kind is stable for short rows on some CPUs (its answer then passes there) and not on others.
MACHINE_DEPENDENT = {("routing", "unstable_on_ties")}


@pytest.mark.parametrize("name, mistake, form", [(n, m.name, f) for n in NAMES for m in PUZZLES[n].mistakes
                                                 for f in range(len(m.forms))])
def test_every_catalogued_mistake_is_named(name, mistake, form):
    """Each form of each catalogued mistake, checked as an answer, is named for that mistake and no other:
    the inputs the check tries tell every catalogued mistake apart from every other."""
    puzzle = PUZZLES[name]
    entry = next(m for m in puzzle.mistakes if m.name == mistake)
    try:
        puzzle.check(entry.forms[form])
    except PuzzleFailure as failure:
        assert failure.mistake is entry and failure.reproduced, str(failure)
        assert f"The mistake: {entry.title}." in str(failure)
        assert str(failure).startswith("Not yet: ")
    else:
        assert (name, mistake) in MACHINE_DEPENDENT, f"{name}: the wrong answer {mistake} (form {form}) passed"


def test_every_puzzle_has_two_wrong_answers_here():
    for name in NAMES:
        assert sum(1 for n, _, _ in WRONG if n == name) >= 2, name


def test_an_unknown_mistake_shows_the_input_expected_and_got():
    def bias_as_a_factor(logits, bias, top_k):
        return np.argsort(-(sigmoid(logits) * (1 + bias)), axis=1, kind="stable")[:, :top_k]

    with pytest.raises(PuzzleFailure) as caught:
        PUZZLES["routing"].check(bias_as_a_factor)
    message = str(caught.value)
    assert caught.value.mistake is None and not caught.value.reproduced
    assert "The check cannot name a mistake for sure here" in message and "The mistake:" not in message
    assert "logits = np.array(" in message and "Got (bias_as_a_factor):" in message
    assert "What differs: token " in message


def test_a_malformed_answer_or_an_error_is_a_message_not_a_traceback(capsys):
    def wrong_shape(scores, bias, top_k):
        return np.zeros(scores.shape[1] + 1)

    def crashes(scores, bias, top_k):
        return scores[scores.shape[0] + 5]

    puzzle = PUZZLES["cutoffs"]
    for fn, words in ((wrong_shape, "alpha must have shape"), (crashes, "raised an error: IndexError")):
        puzzle.run(fn)
        out = " ".join(capsys.readouterr().out.split())  # the message's lines are wrapped
        assert out.startswith("Not yet: ") and words in out and "Traceback" not in out


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
    """Copied alone into an empty folder: the stub's check prints "not written yet"; after the answer cell
    (a function defined in the kernel, which the check's forked worker runs), the same check prints a pass. Nothing prints a traceback or goes to stderr."""
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
    assert printed(check).startswith(f"Not yet: `{puzzle.function_name}` is not written yet")
    assert printed(code[-1]).startswith(f"Passed: `{puzzle.function_name}`")
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error" or o.get("name") == "stderr"]
    assert "Traceback" not in json.dumps([printed(c) for c in code])
    assert sorted(p.name for p in folder.iterdir()) == [path.name]  # the check wrote nothing beside it


# ---------------------------------------------------------------------------
# More learners' wrong answers: each names its mistake, or says plainly what differs, never a wrong name
# ---------------------------------------------------------------------------

# 1. Routing
def route_first_k_of_an_ascending_sort(logits, bias, top_k):
    return np.argsort(sigmoid(logits) + bias, axis=1, kind="stable")[:, :top_k]


def route_last_k_of_an_ascending_sort(logits, bias, top_k):
    return np.argsort(sigmoid(logits) + bias, axis=1, kind="stable")[:, -top_k:]


def route_by_argpartition(logits, bias, top_k):
    biased = sigmoid(logits) + bias
    return np.argpartition(-biased, top_k - 1, axis=1)[:, :top_k]


def route_sorted_down_the_tokens(logits, bias, top_k):
    biased = sigmoid(logits) + bias
    return np.argsort(-biased, axis=0, kind="stable")[:, :top_k]


def route_bias_as_a_factor(logits, bias, top_k):
    return np.argsort(-(sigmoid(logits) * (1 + bias)), axis=1, kind="stable")[:, :top_k]


# 2. Mixture weights
def weights_scaled_in_the_gate_and_the_layer(scores, bias, index, scaling_factor):
    w = np.take_along_axis(scores, index, axis=1)
    if index.shape[1] > 1:
        w = w / w.sum(axis=1, keepdims=True)
    gate = scaling_factor * w  # the gate scales
    return scaling_factor * gate  # and the layer scales again


def weights_by_softmax(scores, bias, index, scaling_factor):
    chosen = np.take_along_axis(scores, index, axis=1)
    if index.shape[1] > 1:
        chosen = np.exp(chosen) / np.exp(chosen).sum(axis=1, keepdims=True)
    return scaling_factor * chosen


def weights_in_float32(scores, bias, index, scaling_factor):
    s = scores.astype(np.float32)
    chosen = np.take_along_axis(s, index, axis=1)
    if index.shape[1] > 1:
        chosen = chosen / chosen.sum(axis=1, keepdims=True)
    return np.float32(scaling_factor) * chosen


def weights_summed_down_the_tokens(scores, bias, index, scaling_factor):
    chosen = np.take_along_axis(scores, index, axis=1)
    if index.shape[1] > 1:
        chosen = chosen / chosen.sum(axis=0)
    return scaling_factor * chosen


def weights_over_the_largest(scores, bias, index, scaling_factor):
    chosen = np.take_along_axis(scores, index, axis=1)
    return scaling_factor * chosen / chosen.max(axis=1, keepdims=True)


# 3. SiTU-GLU
def glu_in_float32(gate, up, beta, linear_beta):
    a, b = gate.astype(np.float32), up.astype(np.float32)
    return softcap(a, np.float32(beta)) / (1 + np.exp(-a)) * softcap(b, np.float32(linear_beta))


def glu_cap_without_division(gate, up, beta, linear_beta):
    return beta * np.tanh(gate) * sigmoid(gate) * linear_beta * np.tanh(up)


def glu_sigmoid_of_the_cap(gate, up, beta, linear_beta):
    capped = softcap(gate, beta)
    return capped * sigmoid(capped) * softcap(up, linear_beta)


def glu_sigmoid_of_up(gate, up, beta, linear_beta):
    return softcap(gate, beta) * sigmoid(up) * softcap(up, linear_beta)


# 4. The latent forward
def layer_with(x, index, weights, params, config, *, eps="inside", axis=-1, weighted=True, dtype=np.float64):
    x = x.astype(dtype)
    p = {name: value.astype(dtype) for name, value in params.items()}

    def glu(a, b):
        return softcap(a, config.situ_beta) * sigmoid(a) * softcap(b, config.situ_linear_beta)

    z = x @ p["routed_expert_down_proj.weight"].T
    u = np.zeros_like(z)
    for i in range(len(x)):
        for e, w in zip(index[i], weights[i], strict=True):
            u[i] += (w if weighted else 1.0) * (p["experts.w2"][e] @ glu(p["experts.w1"][e] @ z[i],
                                                                         p["experts.w3"][e] @ z[i]))
    ms = (u**2).mean(axis=axis, keepdims=True)
    u = u / (np.sqrt(ms) + config.rms_norm_eps) if eps == "outside" else u / np.sqrt(ms + config.rms_norm_eps)
    y = (u * p["routed_expert_norm.weight"]) @ p["routed_expert_up_proj.weight"].T
    h = glu(x @ p["shared_experts.gate_proj.weight"].T, x @ p["shared_experts.up_proj.weight"].T)
    return y + h @ p["shared_experts.down_proj.weight"].T


def layer_eps_outside(x, index, weights, params, config):
    return layer_with(x, index, weights, params, config, eps="outside")


def layer_norm_down_the_tokens(x, index, weights, params, config):
    return layer_with(x, index, weights, params, config, axis=0)


def layer_unweighted(x, index, weights, params, config):
    return layer_with(x, index, weights, params, config, weighted=False)


def layer_in_float32(x, index, weights, params, config):
    return layer_with(x, index, weights, params, config, dtype=np.float32)


# 5. Cutoffs
def cutoff_among_distinct_values(scores, bias, top_k):
    return np.array([np.unique(row)[::-1][top_k] for row in scores + bias])


def cutoff_bias_subtracted(scores, bias, top_k):
    return np.sort(scores - bias, axis=1)[:, -(top_k + 1)]


def cutoff_in_float32(scores, bias, top_k):
    return np.sort((scores + bias).astype(np.float32), axis=1)[:, -(top_k + 1)]


def cutoff_halfway(scores, bias, top_k):
    ordered = np.sort(scores + bias, axis=1)[:, ::-1]
    return (ordered[:, top_k - 1] + ordered[:, top_k]) / 2


# 6. Quantile Balancing
def qb_ascending_sort(scores, bias, top_k):
    m, n = scores.shape
    b = -np.sort(qb_margins(scores, bias, top_k), axis=0)[m * top_k // n]
    return b - b.mean()


def qb_margins_from_biased_scores(scores, bias, top_k):
    m, n = scores.shape
    alpha = np.sort(scores + bias, axis=1)[:, -(top_k + 1)]
    b = -np.sort(scores + bias - alpha[:, None], axis=0)[m - m * top_k // n - 1]
    return b - b.mean()


def qb_median(scores, bias, top_k):
    m, n = scores.shape
    b = -np.sort(qb_margins(scores, bias, top_k), axis=0)[m - m * top_k // n - 1]
    return b - np.median(b)


def qb_in_float32(scores, bias, top_k):
    m, n = scores.shape
    s, b = scores.astype(np.float32), bias.astype(np.float32)
    alpha = np.sort(s + b, axis=1)[:, -(top_k + 1)]
    new = -np.sort(s - alpha[:, None], axis=0)[m - m * top_k // n - 1]
    return new - new.mean()


def qb_sorted_along_the_experts(scores, bias, top_k):
    m, n = scores.shape
    b = -np.sort(qb_margins(scores, bias, top_k), axis=1)[:, ::-1][m * top_k // n]
    return b - b.mean()


def qb_qth_on_small_batches(scores, bias, top_k):
    """The q-th largest margin on batches of up to 4 tokens, right on larger ones: it fits the q-th mistake on
    the small shrunk input alone, so the check must not name that mistake."""
    m, n = scores.shape
    q = m * top_k // n
    b = -np.sort(qb_margins(scores, bias, top_k), axis=0)[m - q - (0 if m <= 4 else 1)]
    return b - b.mean()


# 7. The dual step
def dual_ascending(scores, beta, top_k):
    m, n = scores.shape
    alpha = np.sort(scores - beta, axis=1)[:, -(top_k + 1)]
    return alpha, np.sort(scores - alpha[:, None], axis=0)[m * top_k // n]


def dual_negated(scores, beta, top_k):
    m, n = scores.shape
    alpha = np.sort(scores - beta, axis=1)[:, -(top_k + 1)]
    return alpha, -np.sort(scores - alpha[:, None], axis=0)[m - m * top_k // n - 1]


def dual_in_float32(scores, beta, top_k):
    m, n = scores.shape
    s, bt = scores.astype(np.float32), beta.astype(np.float32)
    alpha = np.sort(s - bt, axis=1)[:, -(top_k + 1)]
    return alpha, np.sort(s - alpha[:, None], axis=0)[m - m * top_k // n - 1]


# 8. The sign rule
def sign_integer_target(load, bias, rate):
    return bias + rate * np.sign(load.sum() // len(load) - load)


def sign_median_target(load, bias, rate):
    return bias + rate * np.sign(np.median(load) - load)


def sign_float32_bias(load, bias, rate):
    return bias.astype(np.float32) + rate * np.sign(load.mean() - load)


def sign_scaled_by_n(load, bias, rate):
    return bias + rate * np.sign(load.mean() - load) / len(load)


# 9. The histogram quantile
def hist_general(counts, bias, top_k, *, gaps=0, side="left", spread=1.0, centred=False):
    n, bins = counts.shape
    t = counts[0].sum() * top_k // n + 1
    low, high = bias.min() - spread, bias.max() + spread
    w = (high - low) / (bins + gaps)
    out = np.empty(n)
    for j in range(n):
        cum = np.cumsum(counts[j])
        h = int(np.searchsorted(cum, t, side=side))
        before = cum[h] - counts[j, h]
        out[j] = low + (h + (t - before - 0.5) / counts[j, h]) * w
    return out - out.mean() if centred else out


def hist_width_over_b_minus_1(counts, bias, top_k):
    return hist_general(counts, bias, top_k, gaps=-1)


def hist_searchsorted_right(counts, bias, top_k):
    return hist_general(counts, bias, top_k, side="right")


def hist_no_margin(counts, bias, top_k):
    return hist_general(counts, bias, top_k, spread=0.0)


def hist_centred(counts, bias, top_k):
    return hist_general(counts, bias, top_k, centred=True)


# 10. Capacity
def capacity_served(index, weights, num_experts, capacity, *, limit=None, zero=True, restart=False):
    m, k = index.shape
    kept = np.zeros((m, k), dtype=bool)
    used = np.zeros(num_experts, dtype=int)
    for r in range(k):
        if restart:
            used[:] = 0
        for i in range(m):
            e = index[i, r]
            if used[e] < (capacity if limit is None else limit(capacity)):
                used[e] += 1
                kept[i, r] = True
    return kept, (weights * kept if zero else weights)


def capacity_one_short(index, weights, num_experts, capacity):
    return capacity_served(index, weights, num_experts, capacity, limit=lambda c: c - 1)


def capacity_weights_untouched(index, weights, num_experts, capacity):
    return capacity_served(index, weights, num_experts, capacity, zero=False)


def capacity_fresh_count_each_rank(index, weights, num_experts, capacity):
    return capacity_served(index, weights, num_experts, capacity, restart=True)


def capacity_heaviest_first(index, weights, num_experts, capacity):
    m, k = index.shape
    kept = np.zeros((m, k), dtype=bool)
    used = np.zeros(num_experts, dtype=int)
    for flat in np.argsort(-weights, axis=None, kind="stable"):
        i, r = divmod(int(flat), k)
        if used[index[i, r]] < capacity:
            used[index[i, r]] += 1
            kept[i, r] = True
    return kept, weights * kept


# Orders and ties: answers that get the set right and the order wrong, break ties some other way, or are
# wrong on inputs without ties while also mishandling ties (never to be named for a tie mistake).

def route_with_bias(logits, bias, top_k):
    s = 1 / (1 + np.exp(-logits))
    return np.argsort(s + bias, axis=1)[:, -top_k:]  # ascending: the right set, best last


def route_one_past_the_best(logits, bias, top_k):
    return np.argsort(-(sigmoid(logits) + bias), axis=1, kind="stable")[:, 1:top_k + 1]


def route_ties_by_higher_id(logits, bias, top_k):
    biased = sigmoid(logits) + bias
    ids = np.arange(biased.shape[1])
    return np.array([np.lexsort((-ids, -row))[:top_k] for row in biased])  # equal values: higher id first


def route_chosen_listed_by_raw_score(logits, bias, top_k):
    s = sigmoid(logits)
    chosen = np.argsort(-(s + bias), axis=1, kind="stable")[:, :top_k]
    raw = np.take_along_axis(s, chosen, axis=1)
    return np.take_along_axis(chosen, np.argsort(-raw, axis=1, kind="stable"), axis=1)


def route_ids_sorted_after_a_default_sort(logits, bias, top_k):
    return np.sort(np.argsort(-(sigmoid(logits) + bias), axis=1)[:, :top_k], axis=1)


def route_first_k_of_a_default_sort(logits, bias, top_k):
    return np.argsort(sigmoid(logits) + bias, axis=1)[:, :top_k]


def weights_over_all_experts_even_top1(scores, bias, index, scaling_factor):
    return scaling_factor * np.take_along_axis(scores, index, axis=1) / scores.sum(axis=1, keepdims=True)


def weights_over_all_experts(scores, bias, index, scaling_factor):
    w = np.take_along_axis(scores, index, axis=1)
    if index.shape[1] > 1:
        w = w / scores.sum(axis=1, keepdims=True)
    return scaling_factor * w


def weights_scaled_then_renormalized(scores, bias, index, scaling_factor):
    w = scaling_factor * np.take_along_axis(scores, index, axis=1)
    if index.shape[1] > 1:
        w = w / w.sum(axis=1, keepdims=True)
    return w


def weights_top1_set_to_one(scores, bias, index, scaling_factor):
    if index.shape[1] == 1:
        return scaling_factor * np.ones(index.shape)
    w = np.take_along_axis(scores, index, axis=1)
    return scaling_factor * w / w.sum(axis=1, keepdims=True)


def weights_biased_over_raw_sum(scores, bias, index, scaling_factor):
    w = np.take_along_axis(scores, index, axis=1)
    if index.shape[1] > 1:
        return scaling_factor * np.take_along_axis(scores + bias, index, axis=1) / w.sum(axis=1, keepdims=True)
    return scaling_factor * w


def cutoff_kth_distinct(scores, bias, top_k):
    return np.array([np.unique(row)[::-1][top_k - 1] for row in scores + bias])


def cutoff_by_partition_kth(scores, bias, top_k):
    n = scores.shape[1]
    return np.partition(scores + bias, n - top_k, axis=1)[:, n - top_k]


def cutoff_raw_after_a_default_sort(scores, bias, top_k):
    order = np.argsort(-(scores + bias), axis=1)
    return scores[np.arange(len(scores)), order[:, top_k]]


def cutoff_smallest_of_the_route(scores, bias, top_k):
    return np.sort(scores + bias, axis=1)[:, ::-1][:, :top_k].min(axis=1)


def cutoff_k_plus_2th(scores, bias, top_k):
    ordered = np.sort(scores + bias, axis=1)[:, ::-1]
    return ordered[:, min(top_k + 1, ordered.shape[1] - 1)]


def qb_distinct_qth(scores, bias, top_k):
    m, n = scores.shape
    q = m * top_k // n
    margins = qb_margins(scores, bias, top_k)
    b = np.array([-np.unique(margins[:, j])[::-1][max(q - 1, 0)] for j in range(n)])
    return b - b.mean()


def capacity_at_most(index, weights, num_experts, capacity):
    return capacity_served(index, weights, num_experts, capacity, limit=lambda c: c + 1)


def capacity_last_choices_first(index, weights, num_experts, capacity):
    m, k = index.shape
    kept = np.zeros((m, k), dtype=bool)
    used = np.zeros(num_experts, dtype=int)
    for r in reversed(range(k)):
        for i in range(m):
            if used[index[i, r]] < capacity:
                used[index[i, r]] += 1
                kept[i, r] = True
    return kept, weights * kept


def capacity_last_token_first(index, weights, num_experts, capacity):
    kept, new = capacity_served(index[::-1], weights[::-1], num_experts, capacity)
    return kept[::-1], new[::-1]


def capacity_all_or_nothing(index, weights, num_experts, capacity):
    demand = np.bincount(index.ravel(), minlength=num_experts)
    kept = demand[index] <= capacity
    return kept, weights * kept


#: (puzzle, learner's answer, the mistake it must be named for, or None: the message says what differs).
MORE_WRONG = [
    ("routing", route_first_k_of_an_ascending_sort, "smallest_first"),
    ("routing", route_last_k_of_an_ascending_sort, "best_last"),
    # np.argpartition's order depends on the machine's NumPy: where it leaves the chosen experts sorted on
    # inputs without ties, the answer differs only on ties; elsewhere it lists them in no order.
    ("routing", route_by_argpartition, frozenset({"unstable_on_ties", "unsorted_choice"})),
    ("routing", route_sorted_down_the_tokens, "wrong_axis"),
    ("routing", route_bias_as_a_factor, None),
    ("mixture_weights", weights_scaled_in_the_gate_and_the_layer, "scaled_twice"),
    ("mixture_weights", weights_by_softmax, "softmax_of_chosen"),
    ("mixture_weights", weights_in_float32, "float32"),
    ("mixture_weights", weights_summed_down_the_tokens, "summed_over_tokens"),
    ("mixture_weights", weights_over_the_largest, None),
    ("situ_glu", glu_in_float32, "float32"),
    ("situ_glu", glu_cap_without_division, "tanh_not_divided"),
    ("situ_glu", glu_sigmoid_of_the_cap, "sigmoid_of_capped_gate"),
    ("situ_glu", glu_sigmoid_of_up, None),
    ("latent_forward", layer_eps_outside, "eps_outside_root"),
    ("latent_forward", layer_norm_down_the_tokens, "norm_over_tokens"),
    ("latent_forward", layer_unweighted, "weights_left_out"),
    ("latent_forward", layer_in_float32, "float32"),
    ("cutoffs", cutoff_among_distinct_values, "distinct_values"),
    ("cutoffs", cutoff_bias_subtracted, "bias_subtracted"),
    ("cutoffs", cutoff_in_float32, "float32"),
    ("cutoffs", cutoff_halfway, "midpoint"),
    ("qb_update", qb_ascending_sort, "counted_from_the_bottom"),
    ("qb_update", qb_margins_from_biased_scores, "margins_from_biased_scores"),
    ("qb_update", qb_median, "centred_on_the_median"),
    ("qb_update", qb_in_float32, "float32"),
    ("qb_update", qb_sorted_along_the_experts, "wrong_axis"),
    ("qb_update", qb_qth_on_small_batches, None),
    ("dual_step", dual_ascending, "beta_from_the_bottom"),
    ("dual_step", dual_negated, "beta_negated"),
    ("dual_step", dual_in_float32, "float32"),
    ("sign_rule", sign_integer_target, "target_floored"),
    ("sign_rule", sign_median_target, "target_median"),
    ("sign_rule", sign_float32_bias, "float32"),
    ("sign_rule", sign_scaled_by_n, None),
    ("histogram_quantile", hist_width_over_b_minus_1, "width_over_b_minus_1"),
    ("histogram_quantile", hist_searchsorted_right, "searchsorted_right"),
    ("histogram_quantile", hist_no_margin, "range_without_margin"),
    ("histogram_quantile", hist_centred, "centred"),
    ("capacity", capacity_one_short, "capacity_minus_one"),
    ("capacity", capacity_weights_untouched, "dropped_weight_kept"),
    ("capacity", capacity_fresh_count_each_rank, "count_restarted_per_rank"),
    ("capacity", capacity_heaviest_first, None),
    ("routing", route_with_bias, "best_last"),
    ("routing", route_one_past_the_best, None),
    ("routing", route_ties_by_higher_id, "ties_to_higher_id"),
    ("routing", route_chosen_listed_by_raw_score, "unsorted_choice"),
    ("routing", route_ids_sorted_after_a_default_sort, "ids_in_id_order"),
    ("routing", route_first_k_of_a_default_sort, "smallest_first"),
    ("mixture_weights", weights_over_all_experts_even_top1, None),
    ("mixture_weights", weights_over_all_experts, "normalized_over_all_experts"),
    ("mixture_weights", weights_scaled_then_renormalized, "scaled_before_renormalizing"),
    ("mixture_weights", weights_top1_set_to_one, "top1_renormalized"),
    ("mixture_weights", weights_biased_over_raw_sum, None),
    ("cutoffs", cutoff_kth_distinct, None),
    ("cutoffs", cutoff_by_partition_kth, "kth_not_k_plus_1th"),
    ("cutoffs", cutoff_raw_after_a_default_sort, "raw_score_of_the_cutoff_expert"),
    ("cutoffs", cutoff_smallest_of_the_route, "kth_not_k_plus_1th"),
    ("cutoffs", cutoff_k_plus_2th, None),
    ("qb_update", qb_distinct_qth, None),
    ("capacity", capacity_at_most, "capacity_plus_one"),
    ("capacity", capacity_last_choices_first, None),
    ("capacity", capacity_last_token_first, "tokens_from_the_end"),
    ("capacity", capacity_all_or_nothing, None),
]


@pytest.mark.parametrize("name, wrong, mistake", MORE_WRONG, ids=[w.__name__ for _, w, _ in MORE_WRONG])
def test_a_learners_answer_is_named_right_or_described(name, wrong, mistake):
    puzzle = PUZZLES[name]
    with pytest.raises(PuzzleFailure) as caught:
        puzzle.check(wrong)
    failure, message = caught.value, str(caught.value)
    assert message.startswith("Not yet: ") and not isinstance(failure, NotWrittenYet)
    if mistake is None:
        assert failure.mistake is None and "The mistake:" not in message, message
        assert "What differs: " in message or failure.kind == "raised", message
    else:
        names = mistake if isinstance(mistake, frozenset) else {mistake}
        assert failure.mistake is not None and failure.mistake.name in names, message
        assert f"The mistake: {failure.mistake.title}." in message


def test_three_new_wrong_answers_per_puzzle():
    """Each puzzle meets at least three learners' answers whose mistakes its first catalogue did not hold."""
    before = {name for _, _, name in WRONG} | {"softmax_scores", "bias_ignored", "bias_subtracted",
                                               "normalized_over_all_experts", "up_uncapped", "tanh_without_beta",
                                               "swiglu_experts", "gain_left_out", "raw_score_of_the_cutoff_expert",
                                               "counted_from_the_bottom", "sign_flipped", "alpha_is_kth",
                                               "alpha_kth", "beta_added", "bin_centre", "fixed_range",
                                               "capacity_plus_one"}
    for name in NAMES:
        new = [w for n, w, m in MORE_WRONG if n == name and (m is None or m not in before or
                                                              (name, m) == ("qb_update", "counted_from_the_bottom"))]
        assert len(new) >= 3, name


def test_an_ascending_sort_is_not_named_for_another_mistake():
    """Sorting ascending fits "the q-th instead of the (q+1)-th" (QB) or "listed by id" (routing) on some small
    inputs; the check names what the answer does on every input it tried."""
    for name, wrong, right in (("qb_update", qb_ascending_sort, "counted_from_the_bottom"),
                               ("routing", route_last_k_of_an_ascending_sort, "best_last")):
        with pytest.raises(PuzzleFailure) as caught:
            PUZZLES[name].check(wrong)
        assert caught.value.mistake.name == right


def test_the_right_set_best_last_is_named_for_its_order_not_for_ties(capsys):
    """np.argsort(s + b)[:, -k:] (the default, unstable kind) holds the right experts, best last: the message
    names that order, never an unstable sort, which would be right on every input without ties."""
    PUZZLES["routing"].run(route_with_bias)
    message = capsys.readouterr().out
    assert message.startswith("Not yet: ") and "unstable" not in message.lower(), message
    assert "The mistake: the right experts in reverse order, best last" in message
    assert "gets the right experts in reverse order, best last" in message


#: The catalogued mistakes about ties: each is named only for an answer that is right on every input the check
#: tries without ties (an answer that gets the ties right is right, one wrong without ties makes another mistake).
TIE_MISTAKES = {"routing": ("ties_to_higher_id", "unstable_on_ties"), "cutoffs": ("distinct_values",),
                "qb_update": ("ties_counted_once",)}


def tied(name, case):
    """Whether an input of the puzzle has equal values where its rule ranks them: s + b per token, or (the
    update) the margins s - alpha per expert."""
    if name == "routing":
        logits, bias, _ = case.args
        values = sigmoid(logits) + bias
    elif name == "qb_update":
        values = qb_margins(*case.args).T
    else:
        values = case.args[0] + case.args[1]
    return any(len(np.unique(row)) < len(row) for row in values)


@pytest.mark.parametrize("name", sorted(TIE_MISTAKES))
def test_a_tie_mistake_is_right_on_every_input_without_ties(name):
    puzzle = PUZZLES[name]
    tie_free = [case for case in (*puzzle.probes, *puzzle._drawn()) if not tied(name, case)]
    with_ties = [case for case in (*puzzle.probes, *puzzle._drawn()) if tied(name, case)]
    assert len(with_ties) >= 20
    # The update's margins always tie (each column's atom at -b_j), so only its forms on ties are checked.
    assert len(tie_free) >= 20 or name == "qb_update"
    if puzzle.probes:  # the hand-built inputs hold both kinds
        assert any(tied(name, c) for c in puzzle.probes) and not all(tied(name, c) for c in puzzle.probes)
    for entry in (m for m in puzzle.mistakes if m.name in TIE_MISTAKES[name]):
        for form in entry.forms:
            for case in tie_free:
                assert puzzle.agree(puzzle.output(form(*case.args), case), puzzle._expected(case), case), \
                    (entry.name, case)


@pytest.mark.parametrize("name, wrong", [("routing", route_with_bias), ("routing", route_one_past_the_best),
                                         ("cutoffs", cutoff_kth_distinct), ("qb_update", qb_distinct_qth),
                                         ("routing", route_first_k_of_a_default_sort)])
def test_an_answer_wrong_without_ties_is_never_named_for_ties(name, wrong):
    with pytest.raises(PuzzleFailure) as caught:
        PUZZLES[name].check(wrong)
    failure = caught.value
    assert failure.mistake is None or failure.mistake.name not in TIE_MISTAKES[name], str(failure)
    assert "The mistake: equal values" not in str(failure) and "unstable" not in str(failure).lower()


def test_an_unstable_sort_is_named_only_where_it_differs_on_ties():
    """Heapsort orders equal values its own way: right on every input without ties, it is named for the ties
    (for the higher id first, should it put the higher id first on every tie the check tries)."""
    def route_heapsort(logits, bias, top_k):
        return np.argsort(-(sigmoid(logits) + bias), axis=1, kind="heapsort")[:, :top_k]

    with pytest.raises(PuzzleFailure) as caught:
        PUZZLES["routing"].check(route_heapsort)
    assert caught.value.mistake.name in TIE_MISTAKES["routing"], str(caught.value)
    assert tied("routing", caught.value.case)


_UNSTABLE_ON_A_PLAIN_CPU = """
import numpy as np
from refimpl.testing.puzzles import PUZZLES
from refimpl.testing.puzzles.core import PuzzleFailure

row = -np.array([[0.5, 0.5, 0.5, 0.2, 0.5, 0.9, 0.5, 0.5]])
print("short rows stable:", np.array_equal(np.argsort(row, axis=1), np.argsort(row, axis=1, kind="stable")))

def route_with_bias(logits, bias, top_k):
    return np.argsort(-(1.0 / (1.0 + np.exp(-logits)) + bias), axis=1)[:, :top_k]

try:
    PUZZLES["routing"].check(route_with_bias)
    print("passed")
except PuzzleFailure as failure:
    print("named:", failure.mistake.name if failure.mistake else None, "experts:", failure.case.args[0].shape[1])
"""


def test_an_unstable_sort_is_caught_on_a_numpy_without_its_vectorized_sort():
    """On a CPU for which NumPy has no vectorized sort (its dispatched paths switched off here to stand for
    one), np.argsort sorts a row of up to 16 values by insertion, which keeps ties in id order: the default
    sort is then right on every short row, and only the family of rows longer than 16 experts shows it."""
    import os
    import subprocess
    import sys

    from numpy._core._multiarray_umath import __cpu_dispatch__

    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(__cpu_dispatch__)}
    run = subprocess.run([sys.executable, "-c", _UNSTABLE_ON_A_PLAIN_CPU], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "short rows stable: True", run.stdout  # the setting took: insertion sort on short rows
    named, experts = lines[1].removeprefix("named: ").split(" experts: ")
    assert named == "unstable_on_ties" and int(experts) > 16, run.stdout


def test_a_mistake_that_fits_the_shrunk_input_alone_is_not_named():
    with pytest.raises(PuzzleFailure) as caught:
        PUZZLES["qb_update"].check(qb_qth_on_small_batches)
    assert caught.value.mistake is None and "What differs: " in str(caught.value)
    assert caught.value.case.args[0].shape[0] <= 4  # the shrunk input is one the q-th mistake fits


# ---------------------------------------------------------------------------
# Answers that never return, write into their inputs, exit, or return what NumPy cannot read
# ---------------------------------------------------------------------------

def route_forever(logits, bias, top_k):
    while True:
        pass


def test_an_answer_that_never_returns_gets_a_verdict(capsys):
    import time

    from refimpl.testing import call_deadline

    puzzle = PUZZLES["routing"]
    start = time.monotonic()
    with pytest.raises(PuzzleFailure) as caught:
        puzzle.check(route_forever, seconds=0.5)
    assert time.monotonic() - start < 30  # stopped, not waited for (a bound far above the deadline)
    failure = caught.value
    assert failure.kind == "timeout" and failure.mistake is None
    message = str(failure)
    assert message.startswith("Not yet: `route_forever` did not return within 0.5 s")
    assert "logits = np.array(" in message  # the input it was given
    with call_deadline(0.2):  # the kit's deadline around the check changes nothing of that
        puzzle.run(route_forever, seconds=0.5)
    assert capsys.readouterr().out.startswith("Not yet: `route_forever` did not return within 0.5 s")


def test_an_answer_that_writes_into_its_inputs_fails_saying_so():
    def route_in_place(logits, bias, top_k):
        logits += 0.0 * logits + 1.0  # a shift: the same route, and the caller's logits changed
        return np.argsort(-(sigmoid(logits - 1.0) + bias), axis=1, kind="stable")[:, :top_k]

    def cutoffs_sorting_in_place(scores, bias, top_k):
        scores += bias
        scores.sort(axis=1)
        return scores[:, -(top_k + 1)]

    for name, fn, argument in (("routing", route_in_place, "logits"), ("cutoffs", cutoffs_sorting_in_place,
                                                                        "scores")):
        with pytest.raises(PuzzleFailure) as caught:
            PUZZLES[name].check(fn)
        assert caught.value.kind == "mutated"
        message = " ".join(str(caught.value).split())
        assert message.startswith(f"Not yet: `{fn.__name__}` writes into its inputs")
        assert f"it changed its argument `{argument}`" in message


def test_run_prints_and_never_raises(capsys):
    import os
    import sys

    class Unreadable:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("not an array")

    def unreadable(scores, bias, top_k):
        return Unreadable()

    def ragged(scores, bias, top_k):
        return [np.zeros(1), np.zeros(2)]

    def exits(scores, bias, top_k):
        sys.exit(1)

    def leaves(scores, bias, top_k):
        os._exit(3)

    puzzle = PUZZLES["cutoffs"]
    for fn, words in ((unreadable, "could not be read as an array: RuntimeError: not an array"),
                      (ragged, "did not return a valid answer"), (exits, "raised an error: SystemExit"),
                      (leaves, "ended (with exit code 3)"), (42, "check needs the function you wrote"),
                      (hist_searchsorted_right, "raised an error: IndexError")):
        puzzle.run(fn)
        printed = capsys.readouterr()
        out = " ".join(printed.out.split())
        assert out.startswith("Not yet: ") and words in out and "Traceback" not in out, out
        assert printed.err == ""
