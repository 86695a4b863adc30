"""Tests of the conformance kit `refimpl.testing`: it passes correct code and names the mistake in wrong code.

Three kinds of evidence:

* **Correct implementations pass every check**: the reference functions
  themselves, and the independent float32 NumPy implementations of
  `examples/30_test_your_router.py` (written with full sorts, `np.add.at`
  and a two-rank forward pass, not with the reference's code), and the
  PyTorch router there when PyTorch is installed.
* **Every deliberate mistake is caught, by the invariant that describes it**:
  the catalogue of `examples/31_mistakes_the_kit_catches.py` is run and each
  report must name the expected invariant.
* **The machinery does what the reports promise**: the strategies produce
  what their docstrings say (checked by sorting and counting), a printed
  input reproduces the failure when pasted back, a function that raises or
  returns the wrong shape is reported as such, and the kit imports without
  the balancing modules.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import load_example
from hypothesis import given, settings
from hypothesis import strategies as st

import refimpl.testing as kit
from refimpl.testing import strategies as rst
from refimpl.testing.profiles import PROFILES, QUICK, THOROUGH, profile

ROOT = Path(__file__).resolve().parents[1]



good = load_example("30_test_your_router")
mistakes = load_example("31_mistakes_the_kit_catches")


def failure_of(check, fn, **options) -> kit.CheckFailure:
    """The CheckFailure a check raises (the test fails if the check passes)."""
    with pytest.raises(kit.CheckFailure) as info:
        check(fn, **options)
    return info.value


# ---------------------------------------------------------------------------
# Correct implementations pass
# ---------------------------------------------------------------------------


def _reference_balancer(initial_bias, top_k):
    from refimpl.balancing import QuantileBalancer

    balancer = QuantileBalancer(initial_bias.shape[0], top_k, bias=initial_bias)
    return lambda scores: balancer.step(scores).index


def _reference(name):
    """The reference function with the signature its check expects (imported when the test runs)."""
    from refimpl.balancing import quantile_balancing_update
    from refimpl.balancing.histogram import histogram_balancing_update
    from refimpl.layer.latent_moe import stable_latent_moe
    from refimpl.layer.routing import route

    return {"route": route, "update": quantile_balancing_update, "histogram": histogram_balancing_update,
            "balancer": _reference_balancer, "forward": stable_latent_moe}[name]


CHECKS = {  # the check, its options, and how many invariants it runs
    "route": (kit.check_router, {"tie_order": "lower_id"}, 8),
    "update": (kit.check_balancing_update, {}, 6),
    "histogram": (kit.check_histogram_update, {}, 7),
    "balancer": (kit.check_balancer, {}, 2),
    "forward": (kit.check_forward, {}, 2),
}

INDEPENDENT = {"route": "router", "update": "qb_update", "histogram": "histogram_update",
               "balancer": "make_balancer", "forward": "forward"}


class TestCorrectCodePasses:
    @pytest.mark.parametrize("name", list(CHECKS))
    def test_reference_functions_pass_their_own_checks(self, name):
        """The reference route, Eq. (14) update, histogram update, balancer and forward pass pass every check."""
        check, options, count = CHECKS[name]
        assert len(check(_reference(name), **options).passed) == count

    @pytest.mark.parametrize("name", list(CHECKS))
    def test_independent_numpy_implementations_pass(self, name):
        """The float32 implementations of example 30 (own sorts, own histogram, two ranks) pass every check."""
        check, options, count = CHECKS[name]
        assert len(check(getattr(good, INDEPENDENT[name]), **options).passed) == count

    def test_histogram_with_few_bins_passes_with_its_bin_count(self):
        """With B = 7 bins the tolerance is one (wide) bin, and a correct estimator still passes."""
        kit.check_histogram_update(functools.partial(good.histogram_update, bins=7), bins=7)

    def test_renormalize_false_and_scaling_factor(self):
        """A router without renormalization, scaled by 2.5, passes when the check is told so."""
        from refimpl.layer.routing import route

        def fn(scores, bias, top_k):
            return route(scores, bias, top_k, renormalize=False, scaling_factor=2.5)

        result = kit.check_router(fn, renormalize=False, scaling_factor=2.5)
        assert "weights sum to the scaling factor" not in result.passed
        # The same router fails when the check expects K3's renormalized weights.
        assert "weights from raw scores" in failure_of(kit.check_router, fn).failed

    def test_forward_in_bfloat16_with_a_loose_tolerance(self):
        """Inputs in bfloat16: the reference at the same rounded inputs agrees within a bfloat16 tolerance."""
        from refimpl.layer.latent_moe import stable_latent_moe

        kit.check_forward(stable_latent_moe, dtype=ml_dtypes.bfloat16, rtol=2e-2, atol=2e-2)

    def test_docstring_example_runs_and_passes(self):
        """The example at the top of the kit's page is real code that passes."""
        block = re.search(r"```python\n(.*?)```", kit.__doc__, re.S).group(1)
        exec(compile(block, "refimpl.testing docstring", "exec"), {})

    @pytest.mark.slow
    def test_examples_run(self, capsys):
        """Both example scripts run to the end and report what the docs show."""
        good.main([])
        out = capsys.readouterr().out
        assert out.count("all ") >= 5 and "FAILED" not in out
        mistakes.main([])
        out = capsys.readouterr().out
        assert "NOT CAUGHT" not in out and out.count("FAILED:") >= len(mistakes.MISTAKES)


# ---------------------------------------------------------------------------
# Mistakes are caught, by the right invariant
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mistake", mistakes.MISTAKES, ids=[m.slug for m in mistakes.MISTAKES])
def test_each_mistake_is_caught_by_its_invariant(mistake):
    """Each deliberate mistake fails its check, and the report names the expected invariant."""
    failure = mistake.run()
    assert failure is not None, f"{mistake.slug} passed {mistake.check.__name__}"
    assert isinstance(failure, AssertionError)
    assert mistake.caught_by in failure.failed
    report = str(failure)
    assert f"FAILED: {mistake.caught_by}" in report
    assert "input (the simplest one Hypothesis found):" in report
    assert "why:" in report and "what broke:" in report


class TestWhatTheReportsSay:
    def test_subtracted_bias_still_passes_shift_invariance(self):
        """-b shifts with b, so only the selection invariants can see the sign error."""
        failure = failure_of(kit.check_router, mistakes.bias_subtracted)
        assert "bias-shift invariance" in failure.passed
        assert "selection is the top-k of s + b" in failure.failed

    def test_biased_weights_are_recognised(self):
        """The report says the weights are those of the biased scores."""
        failure = failure_of(kit.check_router, mistakes.weights_from_biased_scores)
        assert "the weights returned are those of the BIASED scores" in str(failure)

    def test_look_ahead_is_named(self):
        """The balancer report recognises routes made with the batch's own bias."""
        report = str(failure_of(kit.check_balancer, mistakes.make_look_ahead_balancer))
        assert "these are the experts chosen with the bias computed from this very batch" in report

    def test_printed_input_reproduces_the_failure(self):
        """The shrunk input, pasted back as NumPy code, makes the mistaken router choose wrongly."""
        failure = failure_of(kit.check_router, mistakes.bias_subtracted)
        violation = failure.violations[failure.failed.index("selection is the top-k of s + b")]
        section = str(failure).split("FAILED: selection is the top-k of s + b")[1].split("[2] FAILED")[0]
        code = section.split("input (the simplest one Hypothesis found):")[1]
        code = code.split("Invariants that held")[0]
        namespace = {"np": np, "ml_dtypes": ml_dtypes}
        exec(compile("\n".join(line.strip() for line in code.strip().splitlines() if line.strip())
                     .replace(",\n", ", "), "report", "exec"), namespace)
        np.testing.assert_array_equal(namespace["scores"], violation.inputs["scores"])
        scores, bias, k = namespace["scores"], namespace["bias"], namespace["top_k"]
        index, _ = mistakes.bias_subtracted(scores, bias, k)
        # Independent expectation: the k largest s + b by a Python sort, ties to the lower id.
        expected = [sorted(range(scores.shape[1]), key=lambda j: (-(row[j] + bias[j]), j))[:k] for row in scores]
        assert any(set(i) != set(e) for i, e in zip(index.tolist(), expected, strict=True))

    def test_a_function_that_raises_is_reported_with_its_input(self):
        """An exception inside the user's code becomes a failure that names it and shows the input."""
        def broken(scores, bias, top_k):
            raise RuntimeError("kernel launch failed")

        failure = failure_of(kit.check_router, broken)
        assert failure.failed == ["output shape and dtype"]
        report = str(failure)
        assert "RuntimeError: kernel launch failed" in report and "scores = np.array(" in report
        # The other invariants would only repeat it: they are listed as not run.
        assert "Not run" in report and "selection is the top-k of s + b" in failure.skipped

    def test_wrong_shapes_are_reported(self):
        """Transposed outputs fail the basic invariant with the expected and actual shapes."""
        def transposed(scores, bias, top_k):
            index, weights = good.router(scores, bias, top_k)
            return index.T, weights.T

        failure = failure_of(kit.check_router, transposed)
        assert "must both have shape [m, k]" in str(failure)

    def test_a_stateful_function_is_reported_as_not_deterministic(self):
        """A router whose answer changes from call to call is reported, not silently accepted."""
        calls = {"n": 0}

        def drifting(scores, bias, top_k):
            calls["n"] += 1
            index, weights = good.router(scores, bias, top_k)
            if calls["n"] % 3 == 0:
                weights = weights * 1.01
            return index, weights

        report = str(failure_of(kit.check_router, drifting))
        assert "not deterministic" in report and "scores = np.array(" in report

    def test_an_uncentred_update_fails_centring(self):
        """Eq. (14) without step 3 fails the centring invariant."""
        from refimpl.balancing import quantile_balancing_update

        def uncentred(scores, bias, top_k):
            return quantile_balancing_update(scores, bias, top_k, center=False)

        assert "centred" in failure_of(kit.check_balancing_update, uncentred).failed

    def test_each_update_invariant_is_a_named_function_and_the_report_names_the_one_that_failed(self):
        """check_balancing_update runs one function of update_check per invariant; the report says which failed."""
        from refimpl.balancing import quantile_balancing_update
        from refimpl.testing import update_check

        def shifted_by_half(scores, bias, top_k):  # Eq. (14) plus 0.5 on every expert: no longer centred
            return quantile_balancing_update(scores, bias, top_k) + 0.5

        failure = failure_of(kit.check_balancing_update, shifted_by_half)
        assert failure.failed == ["centred", "matches Eq. (14)"], str(failure)
        assert failure.passed == ["output shape and dtype", "bias-shift invariance", "token-permutation invariance",
                                  "expert-permutation equivariance"]
        centred = failure.violations[0]
        assert centred.invariant.body.func is update_check.centred
        assert centred.summary == "the new bias has mean 0.5, not 0"
        report = str(failure)
        assert "[1] FAILED: centred\n    why: Eq. (14) step 3: b(t+1) = b~ - mean(b~)" in report
        assert "[2] FAILED: matches Eq. (14)" in report


# ---------------------------------------------------------------------------
# Settings profiles
# ---------------------------------------------------------------------------


class TestProfiles:
    def test_named_profiles(self, monkeypatch):
        """Names map to the two profiles; the environment variable picks the default."""
        assert profile("quick") is QUICK and profile("thorough") is THOROUGH
        assert set(PROFILES) == {"quick", "thorough"}
        assert QUICK.derandomize and QUICK.database is None and QUICK.deadline is None
        assert THOROUGH.max_examples > QUICK.max_examples
        monkeypatch.setenv("REFIMPL_TESTING_PROFILE", "thorough")
        assert profile() is THOROUGH
        monkeypatch.delenv("REFIMPL_TESTING_PROFILE")
        assert profile() is QUICK

    def test_settings_object_and_bad_name(self):
        """A hypothesis.settings is used as given; an unknown name is a ValueError that lists the names."""
        custom = settings(QUICK, max_examples=5)
        assert profile(custom) is custom
        result = kit.check_router(good.router, settings=custom)
        assert result.max_examples == 5
        with pytest.raises(ValueError, match="quick"):
            profile("slow")

    def test_bad_tie_order_is_rejected(self):
        with pytest.raises(ValueError, match="tie_order"):
            kit.check_router(good.router, tie_order="higher_id")


def router_by_default_sort(scores, bias, top_k):
    """Eq. (13) with np.argsort's default kind: unstable, so a tie goes to whichever expert the sort leaves first."""
    index = np.argsort(-(scores + bias), axis=1)[:, :top_k]
    raw = np.take_along_axis(scores, index, axis=1)
    return index, raw / raw.sum(axis=1, keepdims=True)


class TestTieOrderOnLongRows:
    """An unstable sort is caught whatever the machine's sort does with short rows."""

    def test_long_rows_are_drawn_whatever_max_experts_says(self):
        """The declared tie order is tried on rows of 17 to 32 experts even when max_experts is 8."""
        widths = []

        def recording(scores, bias, top_k):
            widths.append(scores.shape[1])
            return good.router(scores, bias, top_k)

        kit.check_router(recording, tie_order="lower_id", max_experts=8)
        assert max(widths) >= 17 and min(widths) <= 8
        assert sum(w >= 17 for w in widths) >= 10  # not one lucky draw
        widths.clear()
        kit.check_router(recording, max_experts=8)  # no declared tie order: no long rows
        assert max(widths) <= 8

    def test_an_unstable_numpy_sort_fails_the_declared_tie_order(self):
        failure = failure_of(kit.check_router, router_by_default_sort, tie_order="lower_id")
        assert failure.failed == ["tie order: lower id first"], str(failure)

    def test_torch_topk_fails_the_declared_tie_order(self):
        torch = pytest.importorskip("torch")

        def torch_topk_router(scores, bias, top_k):
            s = torch.from_numpy(scores)
            index = torch.topk(s + torch.from_numpy(bias), top_k, dim=-1).indices  # [m, k], ties unspecified
            raw = torch.gather(s, 1, index)
            return index.numpy(), (raw / raw.sum(dim=-1, keepdim=True)).numpy()

        failure = failure_of(kit.check_router, torch_topk_router, tie_order="lower_id")
        assert failure.failed == ["tie order: lower id first"], str(failure)

    def test_a_cpp_port_with_std_sort_fails_the_declared_tie_order(self, tmp_path):
        """libstdc++'s std::sort (introsort, finished by insertion sort below 17 values) keeps ties in id
        order on short rows: the kit catches a C++ top-k built on it by its long rows."""
        import ctypes
        import shutil

        compiler = shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            pytest.skip("no C++ compiler (g++ or c++) on this machine")
        source = tmp_path / "topk.cpp"
        source.write_text(
            "#include <algorithm>\n#include <vector>\n"
            "extern \"C\" void topk(const float* v, int m, int n, int k, long long* out) {\n"
            "  std::vector<int> ids(n);\n"
            "  for (int i = 0; i < m; ++i) {\n"
            "    const float* row = v + (long long)i * n;\n"
            "    for (int j = 0; j < n; ++j) ids[j] = j;\n"
            "    std::sort(ids.begin(), ids.end(), [row](int a, int b) { return row[a] > row[b]; });\n"
            "    for (int r = 0; r < k; ++r) out[(long long)i * k + r] = ids[r];\n"
            "  }\n"
            "}\n")
        library = tmp_path / "libtopk.so"
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(source), "-o", str(library)], check=True,
                       capture_output=True, timeout=120)
        topk = ctypes.CDLL(str(library)).topk

        def cpp_router(scores, bias, top_k):
            biased = np.ascontiguousarray(scores + bias, dtype=np.float32)  # [m, n]
            index = np.empty((biased.shape[0], top_k), dtype=np.int64)  # [m, k]
            topk(biased.ctypes.data_as(ctypes.c_void_p), biased.shape[0], biased.shape[1], top_k,
                 index.ctypes.data_as(ctypes.c_void_p))
            raw = np.take_along_axis(scores, index, axis=1)
            return index, raw / raw.sum(axis=1, keepdims=True)

        failure = failure_of(kit.check_router, cpp_router, tie_order="lower_id")
        assert failure.failed == ["tie order: lower id first"], str(failure)
        assert failure.violations[0].inputs["scores"].shape[1] >= 17, str(failure)  # short rows pass

    def test_an_unstable_sort_is_caught_where_numpy_has_no_vectorized_sort(self):
        """With NumPy's dispatched paths off (as on a CPU it has no vectorized sort for), np.argsort orders
        rows of up to 16 values by insertion, keeping ties in id order: only the long rows show the mistake."""
        import inspect
        import os

        from numpy._core._multiarray_umath import __cpu_dispatch__

        script = (
            "import numpy as np\n"
            "import refimpl.testing as kit\n"
            + inspect.getsource(router_by_default_sort) +
            "row = -np.array([[0.5, 0.5, 0.5, 0.2, 0.5, 0.9, 0.5, 0.5]])\n"
            "print(np.array_equal(np.argsort(row, axis=1), np.argsort(row, axis=1, kind='stable')))\n"
            "try:\n"
            "    kit.check_router(router_by_default_sort, tie_order='lower_id')\n"
            "except kit.CheckFailure as failure:\n"
            "    print(failure.failed)\n"
        )
        env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(__cpu_dispatch__)}
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == ["True", "['tie order: lower id first']"], run.stdout


def test_without_hypothesis_the_kit_says_what_to_install():
    """The kit alone needs Hypothesis: without it the import fails naming the package and the extra,
    while the rest of refimpl imports and runs."""
    script = (
        "import sys\n"
        "sys.modules['hypothesis'] = None  # makes `import hypothesis` raise ImportError\n"
        "import refimpl\n"
        "assert refimpl.route is not None\n"
        "try:\n"
        "    import refimpl.testing\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported without Hypothesis')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "Hypothesis" in done.stdout and "refimpl[testing]" in done.stdout


# ---------------------------------------------------------------------------
# The strategies keep their promises
# ---------------------------------------------------------------------------


class TestStrategies:
    @settings(max_examples=50, deadline=None)
    @given(rst.routing_cases(ties=True, min_experts=17, max_experts=20))
    def test_min_experts_bounds_the_rows(self, case):
        assert 17 <= case.n <= 20

    @pytest.mark.parametrize("low", [0, 11])
    def test_min_experts_outside_one_to_max_experts_is_refused(self, low):
        @settings(max_examples=1, deadline=None, database=None)
        @given(rst.routing_cases(min_experts=low, max_experts=10))
        def draw(case):
            pass

        with pytest.raises(ValueError, match=f"min_experts must be .* max_experts \\(10\\), got {low}"):
            draw()

    @settings(max_examples=200, deadline=None)
    @given(rst.routing_cases(distinct=True, max_tokens=16, max_experts=12), rst.bias_shifts())
    def test_distinct_cases_have_no_near_ties_even_after_a_shift(self, case, c):
        """Within a token, biased scores differ by at least 2^-14, also after adding c in float32."""
        assert np.all((case.scores > 0) & (case.scores < 1))
        for bias in (case.bias, (case.bias + c).astype(np.float32)):
            biased = np.sort(case.scores.astype(np.float32) + bias.astype(np.float32), axis=1)
            if case.n > 1:
                assert np.diff(biased, axis=1).min() >= 2.0**-14 * 0.9

    @settings(max_examples=100, deadline=None)
    @given(rst.routing_cases(ties=True))
    def test_tie_cases_are_exact_eighths(self, case):
        """Tie cases lie on a grid of eighths, exactly representable in bfloat16."""
        for a in (case.scores, case.bias):
            np.testing.assert_array_equal(a * 8, np.round(a * 8))
            np.testing.assert_array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float64), a)

    @settings(max_examples=100, deadline=None)
    @given(st.integers(1, 20).flatmap(lambda m: st.tuples(st.just(m), rst.partitions(m))))
    def test_partitions_cover_every_token_once(self, drawn):
        m, part = drawn
        ids = np.concatenate([ids for rank in part.blocks for ids in rank])
        np.testing.assert_array_equal(np.sort(ids), np.arange(m))
        assert len({len(rank) for rank in part.blocks}) == 1  # same micro-batch count on every rank

    @settings(max_examples=100, deadline=None)
    @given(st.integers(1, 20).flatmap(lambda m: st.tuples(st.just(m), rst.partitions(m, allow_empty=False))))
    def test_partitions_without_empty_blocks(self, drawn):
        m, part = drawn
        assert all(len(ids) > 0 for rank in part.blocks for ids in rank)

    @pytest.mark.parametrize("integer_q", [False, True])
    def test_min_tokens_for_update_is_the_smallest_valid_batch(self, integer_q):
        """Checked against the definition ceil(mk/n) + 1 <= m by brute force over m."""
        for n in range(2, 12):
            for k in range(1, n):
                m = rst.min_tokens_for_update(n, k, integer_q=integer_q)
                ok = [t for t in range(1, 200)
                      if -(-t * k // n) + 1 <= t and (not integer_q or t * k % n == 0)]
                assert m == ok[0]

    @settings(max_examples=100, deadline=None)
    @given(rst.routing_sizes(integer_q=True, for_update=True))
    def test_update_sizes(self, sizes):
        m, n, k = sizes
        assert 1 <= k < n and m * k % n == 0 and -(-m * k // n) + 1 <= m

    @settings(max_examples=30, deadline=None)
    @given(rst.forward_cases())
    def test_forward_cases_rebuild_their_parameters(self, case):
        """The parameters of a case are a pure function of its seed."""
        a, b = case.params(), case.params()
        assert a.keys() == b.keys() and all(np.array_equal(a[name], b[name]) for name in a)
        assert case.x.shape[1] == case.config.d

    @settings(max_examples=30, deadline=None)
    @given(rst.balancer_cases())
    def test_balancer_cases_are_valid_for_the_update(self, case):
        low = rst.min_tokens_for_update(case.n, case.top_k)
        assert all(batch.shape[0] >= low and batch.shape[1] == case.n for batch in case.batches)
        assert not any(np.array_equal(case.batches[0], b) for b in case.batches[1:])


# ---------------------------------------------------------------------------
# Packaging
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# PyTorch (optional)
# ---------------------------------------------------------------------------


class TestPyTorch:
    def test_torch_router_passes(self):
        """The PyTorch router of example 30, behind its NumPy adapter, passes every router invariant."""
        pytest.importorskip("torch")
        assert len(kit.check_router(good.torch_router, tie_order="lower_id").passed) == 8

    def test_torch_router_with_a_bfloat16_bias_is_caught(self):
        """The same router with `bias.to(torch.bfloat16)` fails the bias-shift invariance."""
        torch = pytest.importorskip("torch")

        def torch_bf16_bias(scores, bias, top_k):
            b = torch.from_numpy(bias).to(torch.bfloat16).float()
            return good.torch_router(scores, b.numpy(), top_k)

        assert "bias-shift invariance" in failure_of(kit.check_router, torch_bf16_bias).failed

    def test_the_docs_example_runs_and_passes(self):
        """The PyTorch example of the kit's docs page is real code: its test passes."""
        pytest.importorskip("torch")
        text = (ROOT / "docs" / "sections" / "testing.md").read_text(encoding="utf-8")
        section = text.split("## A complete example: a PyTorch router")[1]
        block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        namespace: dict = {}
        exec(compile(block, "docs/sections/testing.md", "exec"), namespace)
        namespace["test_router_conforms"]()
