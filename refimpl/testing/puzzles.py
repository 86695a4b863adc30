r"""Puzzles: learn the layer by writing it, with the kit trying to break each answer.

Reading a reference implementation teaches what it computes; writing it
yourself teaches why each line is the way it is. Each puzzle below hands you
one piece of the Stable LatentMoE layer of Kimi K3, in the order a reader
meets them from Eq. (13) to Appendix D, as a small task: its equation, the
arguments your function receives and what it returns. You write the function
with NumPy alone, and the puzzle's check tries to break it.

| | puzzle | the equation |
|---|---|---|
| 1 | sigmoid routing with a selection-only bias | Eq. (13): $\mathcal T_i = \operatorname{argtopk}_k(s_i + b)$ |
| 2 | the mixture weights and the top-1 rule | Eq. (13): $p_{i,j} = c\,s_{i,j} / \sum_{r \in \mathcal T_i} s_{i,r}$ |
| 3 | SiTU-GLU and its bound | Eq. (12): $[\operatorname{softcap}(a, \beta_1)\,\sigma(a)] \odot \operatorname{softcap}(b, \beta_2)$ |
| 4 | the latent forward | Eq. (11): the weighted sum in the latent, normalized once |
| 5 | the cutoffs | Eq. (14) step 1: the $(k{+}1)$-th biased score |
| 6 | the Quantile Balancing update, with ties | Eq. (14): $\tilde b_j = -$ the $(q{+}1)$-th largest margin |
| 7 | the dual coordinate step | Appendix C: the exact $\alpha$- and $\beta$-steps |
| 8 | the sign rule as SignSGD on the dual | $b_j \leftarrow b_j + \gamma \operatorname{sign}(q - \text{load}_j)$ |
| 9 | the histogram quantile within one bin | Appendix D |
| 10 | capacity with the drop priority of the textbook sketch | served rank by rank, then token by token |

## How a check tries to break an answer

`PUZZLES[name].check(fn)` calls your function on inputs that
[Hypothesis](https://hypothesis.readthedocs.io) draws (a few tokens, a few
experts) and compares every answer with what refimpl's own function returns
on the same input, so a puzzle teaches exactly what the library computes.
Each puzzle states where its expected answer comes from (`refimpl.route`,
`refimpl.quantile_balancing_update`, ...). When an answer differs,
Hypothesis **shrinks** the input to the simplest one that still breaks it,
and the check then asks which of the puzzle's **catalogued mistakes**
reproduces your answer: the mistakes real ports of the layer made, such as
the bias added into the mixture weights, a single top-1 weight renormalized
to 1, the $q$-th instead of the $(q+1)$-th order statistic, or capacity
served token by token instead of rank by rank. An answer that makes one of
them fails with its name and with why it is wrong. The failure is a
`PuzzleFailure`, an `AssertionError` whose message holds the shrunk input as
NumPy code you can paste, what was expected and what came back.

Three of the puzzles then hand a passing answer to the kit's own check for
that signature (`check_balancing_update`, `check_forward`,
`check_capacity`), which tries the invariants of the page "The conformance
kit" as well: the same tests a port of the layer would face.

The checks do not fail by luck. The draws are **derandomized** (the same
inputs on every run and every machine) and nothing is written into your
folder. The inputs are built so that float rounding cannot flip a selection:
scores and biases on a grid whose biased values are at least $2^{-14}$
apart, except in the properties that are about ties, where ties are exact
(values on a grid of eighths). Tolerances follow from the arithmetic: a few
units in the last place of float64, scaled by the size of the values
involved.

## In a notebook

Every puzzle is a notebook, `examples/puzzles/NN_name.ipynb`: the task, the
rules, a stub that raises `NotImplementedError`, a one-line check, a hint and
the answer, the last two collapsed. The one-line check is `puzzle.run(fn)`,
which prints the verdict instead of raising, so a notebook shows a message,
not a traceback: on the stub it says that the function is not written yet
(`check` raises `NotWrittenYet`, a `PuzzleFailure`, for it); on a wrong answer
it prints the teaching message; on a right one, what was checked.

```python
from refimpl.testing.puzzles import PUZZLES

puzzle = PUZZLES["routing"]
print(puzzle.spec)                 # the task, with its equation
puzzle.run(my_route_with_bias)     # prints the verdict
puzzle.check(my_route_with_bias)   # the same, raising PuzzleFailure when wrong (for a test)
```

Each puzzle's `solution` is a readable answer in NumPy alone; the tests of
this module check that every solution passes, that every stub is reported as
not written, and that wrong answers written the way ports wrote them are
named for their mistake.
"""

from __future__ import annotations

import ast
import inspect
import math
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given
from hypothesis import configuration as hypothesis_configuration
from hypothesis import settings as Settings
from hypothesis import strategies as st

from refimpl import (
    BiasHistogram,
    MoEConfig,
    alpha_step,
    beta_step,
    capacity_keep,
    dual_objective,
    quantile_balancing_update,
    route,
    router_scores,
    sigmoid,
    sign_balancing_update,
    stable_latent_moe,
)
from refimpl import cutoffs as reference_cutoffs
from refimpl import situ_glu as reference_situ_glu
from refimpl.testing import CheckFailure, check_balancing_update, check_capacity, check_forward
from refimpl.testing import strategies as rst

__all__ = [
    "PUZZLES",
    "Case",
    "Mistake",
    "NotWrittenYet",
    "Puzzle",
    "PuzzleFailure",
    "PuzzlePassed",
    "Trial",
]


# ---------------------------------------------------------------------------
# What a puzzle is made of
# ---------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Case:
    """One input of a puzzle: the arguments of the learner's function, and how to print them.

    `shown` maps an argument's name to the code that rebuilds it, for the
    arguments too large to print (a layer's weights); the others are printed
    as NumPy code.
    """

    args: tuple
    shown: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Trial:
    """One family of inputs a check draws: `where` says what they have in common ("exact ties")."""

    where: str
    cases: st.SearchStrategy[Case]


@dataclass(frozen=True)
class Mistake:
    """A mistake real implementations made, and a function that reproduces it.

    `name` is a short identifier, `title` the mistake in a few words, `why`
    what is wrong with it (one or two sentences that teach), and `answer` a
    wrong answer with the puzzle's signature that makes exactly this mistake;
    `also` holds other forms of the same mistake (moving an expert on target
    up rather than down, say), which a check recognizes as well.
    """

    name: str
    title: str
    why: str
    answer: Callable[..., Any]
    also: tuple[Callable[..., Any], ...] = ()

    @property
    def forms(self) -> tuple[Callable[..., Any], ...]:
        """Every wrong answer that makes this mistake: `answer`, then `also`."""
        return (self.answer, *self.also)


class PuzzleFailure(AssertionError):
    """A puzzle's check found an input on which the answer is wrong; `str()` is the teaching message.

    Attributes: `puzzle` (its name), `mistake` (the catalogued `Mistake` the
    answer reproduces, or None), `reproduced` (True when the answer makes that
    mistake on every input tried, False when it only matches it on the shrunk
    input), `case` (the shrunk `Case`, or None), `expected` and `got`.
    """

    def __init__(self, message: str, *, puzzle: str, mistake: Mistake | None = None, reproduced: bool = False,
                 case: Case | None = None, expected: Any = None, got: Any = None):
        super().__init__(message)
        self.puzzle = puzzle
        self.mistake = mistake
        self.reproduced = reproduced
        self.case = case
        self.expected = expected
        self.got = got


class NotWrittenYet(PuzzleFailure):
    """The answer is still the stub: it raised `NotImplementedError`."""


@dataclass(frozen=True)
class PuzzlePassed:
    """What a passing check tried: the puzzle, the function's name, the input families and their count."""

    puzzle: str
    function: str
    reference: str
    trials: tuple[str, ...]
    examples: int
    kit: str = ""

    def __str__(self) -> str:
        kinds = "; ".join(self.trials)
        text = (f"Passed: `{self.function}` agreed with {self.reference} on all {self.examples} inputs "
                f"Hypothesis drew: {kinds}.")
        return text + (f"\n{self.kit}" if self.kit else "")


class _Mismatch(Exception):
    """Raised inside a Hypothesis property when the answer differs on one case (so Hypothesis shrinks it)."""

    def __init__(self, case: Case, expected: Any, got: Any, problem: str, error: type | None = None):
        super().__init__(problem)
        self.case, self.expected, self.got, self.problem, self.error = case, expected, got, problem, error


class _Stub(Exception):
    """Raised inside a Hypothesis property when the answer raised `NotImplementedError`."""


class _Malformed(Exception):
    """The answer returned something of the wrong shape or type."""


def _settings(max_examples: int) -> Settings:
    # The same draws on every run and machine (derandomize), no example database written into the
    # learner's folder, no deadline (a first call can be slow), no "explain" phase (it adds nothing here).
    return Settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    verbosity=Verbosity.quiet, report_multiple_bugs=False,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
                    suppress_health_check=list(HealthCheck))


#: Examples drawn per family of inputs when a check runs, and when it tests whether a mistake reproduces an answer.
EXAMPLES = 60
DIAGNOSIS_EXAMPLES = 30


@contextmanager
def _nothing_written_here() -> Iterator[None]:
    """Point Hypothesis's storage at a temporary folder while a check runs, then back where it was.

    `database=None` keeps the example database out of the learner's folder,
    but Hypothesis also caches the constants it finds in local modules under
    `.hypothesis/constants` of the working folder; during a check that cache
    goes to a temporary folder that is removed afterwards.
    """
    previous = getattr(hypothesis_configuration, "__hypothesis_home_directory", None)
    with tempfile.TemporaryDirectory(prefix="refimpl-puzzle-") as scratch:
        hypothesis_configuration.set_hypothesis_home_dir(scratch)
        try:
            yield
        finally:
            hypothesis_configuration.set_hypothesis_home_dir(previous)


def _copied(args: tuple) -> tuple:
    """The arguments, copied: an answer that writes into its inputs cannot change the reference's."""
    def copy(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return value.copy()
        if isinstance(value, dict):
            return {key: copy(v) for key, v in value.items()}
        return value
    return tuple(copy(a) for a in args)


def _quietly(fn: Callable[..., Any], args: tuple) -> Any:
    """Call `fn` with NumPy's floating-point warnings silenced (an overflow to 0 in a sigmoid is not an error)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*_copied(args))


@dataclass(frozen=True, eq=False)
class Puzzle:
    r"""One puzzle: a piece of the layer to write, its check, its catalogued mistakes and its answer.

    * `title`, `spec` (Markdown with the equation: the task in words), `hint`;
    * `solution`: a readable answer, NumPy only (its source is the notebook's answer cell);
    * `reference`: refimpl's own computation of the expected answer, `reference(*case.args)`,
      and `reference_name`, how the messages name it;
    * `trials`: the families of inputs the check draws;
    * `output(value, case)`: the answer's return value, validated and converted (raises on a
      malformed one); `agree(got, expected, case)`: whether an answer is right within the
      tolerance the arithmetic allows; `show(value)`: a value as the messages print it;
    * `mistakes`: the catalogued wrong answers;
    * `kit`: the kit's own check for this signature, run on an answer that passed (or None);
    * `explain(case, expected, got)`: more lines for a failure's message (or None).
    """

    number: int
    name: str
    title: str
    spec: str
    hint: str
    solution: Callable[..., Any]
    reference: Callable[..., Any]
    reference_name: str
    trials: tuple[Trial, ...]
    output: Callable[[Any, Case], Any]
    agree: Callable[[Any, Any, Case], bool]
    show: Callable[[Any], str]
    mistakes: tuple[Mistake, ...]
    kit: Callable[[Callable[..., Any]], str] | None = None
    explain: Callable[[Case, Any, Any], list[str]] | None = None

    # -- what the learner sees ---------------------------------------------
    @property
    def slug(self) -> str:
        """The file name of the puzzle's notebook and page, `NN_name`."""
        return f"{self.number:02d}_{self.name}"

    @property
    def function_name(self) -> str:
        """The name of the function the learner writes."""
        return self.solution.__name__

    @property
    def signature(self) -> str:
        """The function to write with its arguments, `name(a, b, c)`, as its solution declares it."""
        return f"{self.function_name}({', '.join(inspect.signature(self.solution).parameters)})"

    @property
    def answer_source(self) -> str:
        """The solution's source code: the notebook's answer cell."""
        return textwrap.dedent(inspect.getsource(self.solution)).strip() + "\n"

    @property
    def stub_source(self) -> str:
        """The solution's definition line and docstring with a body that raises `NotImplementedError`."""
        source = self.answer_source
        tree = ast.parse(source)
        node = tree.body[0]
        lines = source.splitlines()
        # Everything up to the end of the docstring (or of the definition line): not the answer's comments.
        if ast.get_docstring(node) is not None:
            head = lines[: node.body[0].end_lineno]
        else:
            head = lines[: node.body[0].lineno - 1]
            while head and head[-1].strip().startswith("#"):
                head.pop()
        indent = " " * node.body[0].col_offset
        return "\n".join(head + [f"{indent}raise NotImplementedError  # your answer here"]) + "\n"

    # -- checking ----------------------------------------------------------
    def _expected(self, case: Case) -> Any:
        with np.errstate(all="ignore"):
            return self.reference(*_copied(case.args))

    def _attempt(self, fn: Callable[..., Any], case: Case) -> None:
        """Raise `_Mismatch` (or `_Stub`) unless `fn` answers `case` as the reference does."""
        expected = self._expected(case)
        try:
            raw = _quietly(fn, case.args)
        except NotImplementedError as exc:
            raise _Stub(str(exc)) from None
        except Exception as exc:  # the answer's own error, reported with the input that causes it
            raise _Mismatch(case, expected, None, f"it raised {type(exc).__name__}: {exc}", type(exc)) from None
        try:
            got = self.output(raw, case)
        except _Malformed as exc:
            raise _Mismatch(case, expected, None, str(exc)) from None
        if not self.agree(got, expected, case):
            raise _Mismatch(case, expected, got, "")

    def _first_mismatch(self, fn: Callable[..., Any], trial: Trial, examples: int) -> _Mismatch | None:
        """Run one family of inputs as a Hypothesis property; the shrunk mismatch, or None when all agree."""

        @_settings(examples)
        @given(trial.cases)
        def prop(case: Case) -> None:
            self._attempt(fn, case)

        try:
            prop()
        except _Mismatch as found:
            return found
        except _Stub:
            raise
        except Exception as exc:  # Hypothesis saw a failure it could not repeat: a function with state
            inner = [e for e in getattr(exc, "exceptions", ()) if isinstance(e, _Mismatch | _Stub)]
            if inner and isinstance(inner[0], _Stub):
                raise inner[0] from None
            if inner:
                inner[0].problem = ("it gave different results for the same input (does it keep state "
                                    "between calls, or draw random numbers?)")
                return inner[0]
            raise
        return None

    def _same_on(self, answer: Callable[..., Any], found: _Mismatch) -> bool:
        """Whether `answer` does on the mismatch's input what the learner's function did: returns the same
        value (within the tolerance), or raises the same kind of error."""
        try:
            value = self.output(_quietly(answer, found.case.args), found.case)
        except Exception as exc:
            return found.error is not None and isinstance(exc, found.error)
        return found.got is not None and bool(self.agree(found.got, value, found.case))

    def _reproduces(self, fn: Callable[..., Any], mistake: Callable[..., Any]) -> bool:
        """Whether `fn` answers like the wrong answer `mistake` on every input of every family drawn (the
        wrong answer's own errors skip an input)."""
        cases = st.one_of(*(t.cases for t in self.trials))

        @_settings(DIAGNOSIS_EXAMPLES)
        @given(cases)
        def prop(case: Case) -> None:
            try:
                wrong = self.output(_quietly(mistake, case.args), case)
            except Exception:
                return
            got = self.output(_quietly(fn, case.args), case)
            if not self.agree(got, wrong, case):
                raise _Mismatch(case, wrong, got, "")

        try:
            prop()
        except Exception:
            return False
        return True

    def _diagnose(self, fn: Callable[..., Any], found: _Mismatch) -> tuple[Mistake | None, bool]:
        """The catalogued mistake that `fn` reproduces, judged from its mismatch: `(mistake, everywhere)`.

        A mistake that does on the shrunk input what `fn` did (the same
        answer, or the same kind of error) is a candidate; the first candidate
        that `fn` follows on every drawn input is returned with
        `everywhere=True`, else the first candidate with `False`, else `(None, False)`.
        """
        if found.got is None and found.error is None:
            return None, False
        candidates = [(m, form) for m in self.mistakes for form in m.forms if self._same_on(form, found)]
        for mistake, form in candidates:
            if self._reproduces(fn, form):
                return mistake, True
        return (candidates[0][0], False) if candidates else (None, False)

    def check(self, fn: Callable[..., Any]) -> PuzzlePassed:
        """Try to break `fn`; return a `PuzzlePassed` when every input agrees, else raise `PuzzleFailure`.

        A stub (the answer raises `NotImplementedError`) raises `NotWrittenYet`.
        """
        if not callable(fn):
            raise TypeError(f"check needs the function you wrote, got {type(fn).__name__}")
        with _nothing_written_here():
            return self._check(fn)

    def _check(self, fn: Callable[..., Any]) -> PuzzlePassed:
        name = getattr(fn, "__name__", type(fn).__name__)
        for trial in self.trials:
            try:
                found = self._first_mismatch(fn, trial, EXAMPLES)
            except _Stub:
                raise NotWrittenYet(
                    f"Not written yet: `{name}` raised NotImplementedError. Replace the line "
                    "`raise NotImplementedError` with your answer, run that cell, then run the check again.",
                    puzzle=self.name) from None
            if found is not None:
                raise self._failure(fn, name, trial, found)
        kit = self.kit(fn) if self.kit is not None else ""
        return PuzzlePassed(self.name, name, self.reference_name, tuple(t.where for t in self.trials),
                            EXAMPLES * len(self.trials), kit)

    def run(self, fn: Callable[..., Any]) -> None:
        """Check `fn` and print the verdict, without raising: the one-line check of a notebook."""
        try:
            print(self.check(fn))
        except PuzzleFailure as failure:
            print(failure)

    def _failure(self, fn: Callable[..., Any], name: str, trial: Trial, found: _Mismatch) -> PuzzleFailure:
        mistake, everywhere = self._diagnose(fn, found)
        if found.got is None:
            head = f"Not yet: on {trial.where}, `{name}` did not return a valid answer: {found.problem}."
        else:
            head = f"Not yet: on {trial.where}, `{name}` differs from {self.reference_name}."
            if found.problem:
                head += f" Also, {found.problem}."
        lines = [textwrap.fill(head, 100), ""]
        if mistake is not None and everywhere:
            lines += [f"The mistake: {mistake.title}.", textwrap.fill(mistake.why, 100), ""]
        elif mistake is not None:
            lines += [f"On this input your answer is what this mistake gives: {mistake.title} "
                      "(though not on every input).", textwrap.fill(mistake.why, 100), ""]
        else:
            lines += ["It is none of the mistakes this puzzle knows; compare what was expected with what "
                      "came back.", ""]
        lines.append("The simplest input Hypothesis found:")
        lines += [f"    {line}" for line in self.describe(found.case)]
        lines.append(f"Expected ({self.reference_name}):")
        lines += [f"    {line}" for line in self.show(found.expected).splitlines()]
        if found.got is not None:
            lines.append(f"Got ({name}):")
            lines += [f"    {line}" for line in self.show(found.got).splitlines()]
            if self.explain is not None:
                lines += self.explain(found.case, found.expected, found.got)
        return PuzzleFailure("\n".join(lines), puzzle=self.name, mistake=mistake, reproduced=everywhere,
                             case=found.case, expected=found.expected, got=found.got)

    def describe(self, case: Case) -> list[str]:
        """The input as lines of Python that rebuild it, one argument each."""
        names = list(inspect.signature(self.solution).parameters)
        lines = []
        for arg_name, value in zip(names, case.args, strict=True):
            text = case.shown.get(arg_name) or _code(value, prefix=f"{arg_name} = ")
            lines += f"{arg_name} = {text}".splitlines()
        return lines


# ---------------------------------------------------------------------------
# Printing and comparing values
# ---------------------------------------------------------------------------

def _code(value: Any, prefix: str = "") -> str:
    """`value` as Python that rebuilds it: arrays as `np.array(...)` with round-trip digits."""
    if isinstance(value, np.ndarray):
        kind = value.dtype
        options = dict(separator=", ", threshold=10_000, max_line_width=100, prefix=prefix + "np.array(")
        if np.issubdtype(kind, np.floating):
            options["floatmode"] = "unique"
        body = np.array2string(value, **options)
        suffix = "" if kind in (np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.bool_)) else \
            f", dtype=np.{kind.name}"
        return f"np.array({body}{suffix})"
    if isinstance(value, MoEConfig):
        return _config_code(value)
    return repr(value)


def _config_code(config: MoEConfig) -> str:
    """A `MoEConfig` by the fields that differ from K3's."""
    k3 = MoEConfig.k3()
    changed = [f"{f.name}={getattr(config, f.name)!r}" for f in fields(config)
               if getattr(config, f.name) != getattr(k3, f.name)]
    return f"MoEConfig({', '.join(changed)})"


def _show_array(value: Any, precision: int = 8, prefix: str = "") -> str:
    """An answer's array as the messages print it (`prefix`: the text before it on its first line)."""
    a = np.asarray(value)
    options = dict(separator=", ", max_line_width=100, threshold=10_000, prefix=prefix)
    if np.issubdtype(a.dtype, np.floating):
        options["precision"] = precision
    return prefix + np.array2string(a, **options)


def _eps_close(got: np.ndarray, expected: np.ndarray, scale: float, ulps: float = 64.0) -> bool:
    """`|got - expected| <= ulps * eps * scale` everywhere: agreement up to float64 rounding at `scale`."""
    return bool(np.all(np.abs(got - expected) <= ulps * np.finfo(np.float64).eps * scale))


def _array_output(name: str, shape: Callable[[Case], tuple[int, ...]], kind: str) -> Callable[[Any, Case], np.ndarray]:
    """A validator of an answer that is one array: its shape, and integer, boolean or (finite) float values."""

    def output(value: Any, case: Case) -> np.ndarray:
        if isinstance(value, tuple | list) and not isinstance(value, np.ndarray):
            raise _Malformed(f"it returned a {type(value).__name__}; return one array, {name}")
        a = np.asarray(value)
        want = shape(case)
        if a.shape != want:
            raise _Malformed(f"{name} must have shape {list(want)}, got {list(a.shape)}")
        return _typed(name, a, kind)

    return output


def _typed(name: str, a: np.ndarray, kind: str) -> np.ndarray:
    if kind == "int":
        if not np.issubdtype(a.dtype, np.integer):
            raise _Malformed(f"{name} must hold integers (expert ids), got dtype {a.dtype}")
        return a.astype(np.int64)
    if kind == "bool":
        if a.dtype != np.bool_:
            raise _Malformed(f"{name} must be a boolean array, got dtype {a.dtype}")
        return a
    if not np.issubdtype(a.dtype, np.floating):
        raise _Malformed(f"{name} must hold floats, got dtype {a.dtype}")
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise _Malformed(f"{name} must be finite, got {int(np.sum(~np.isfinite(a)))} NaN or infinite entries")
    return a


# ---------------------------------------------------------------------------
# 1. Sigmoid routing with a selection-only bias (Eq. 13)
# ---------------------------------------------------------------------------

def route_with_bias(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Each token's top_k experts by sigmoid score plus bias, best first; ties to the lower id.

    logits [m, n] float, bias [n] float, top_k int  ->  index [m, top_k] int
    """
    # s = sigma(z): each expert scored on its own, in (0, 1)
    scores = 1.0 / (1.0 + np.exp(-logits))
    # Selection by the biased scores s + b
    biased = scores + bias[None, :]
    # Largest first; a stable sort keeps the lower id first among equal values
    order = np.argsort(-biased, axis=1, kind="stable")
    return order[:, :top_k]


def _routing_reference(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    return np.asarray(route(sigmoid(logits), bias, top_k)[0])


def _logits_of(scores: np.ndarray) -> np.ndarray:
    """The logits whose sigmoids are `scores`: $z = \\log s - \\log(1 - s)$."""
    return np.log(scores) - np.log1p(-scores)


@st.composite
def _separated_logits(draw: st.DrawFn) -> Case:
    # The kit's tie-free grid: no two biased scores of a token closer than 2^-14.
    case = draw(rst.routing_cases(distinct=True, max_tokens=6, max_experts=8))
    return Case((_logits_of(case.scores), case.bias, case.top_k))


#: Logits and biases whose biased scores either tie exactly or differ by more than 0.01.
_TIE_LOGITS = (0.0, 1.0, -1.0)
_TIE_BIASES = (0.0, 0.125, -0.125)


@st.composite
def _tied_logits(draw: st.DrawFn) -> Case:
    m, n, k = draw(rst.routing_sizes(max_tokens=6, max_experts=8, allow_all_experts=True))
    z = draw(st.lists(st.sampled_from(_TIE_LOGITS), min_size=m * n, max_size=m * n))
    b = draw(st.lists(st.sampled_from(_TIE_BIASES), min_size=n, max_size=n))
    return Case((np.array(z, dtype=np.float64).reshape(m, n), np.array(b, dtype=np.float64), k))


def _softmax_routing(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    scores = e / e.sum(axis=1, keepdims=True)
    return np.argsort(-(scores + bias), axis=1, kind="stable")[:, :top_k]


def _routing_by(select: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    """A router that ranks by `select(s, z, b)` (stable, largest first)."""
    def answer(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        s = 1.0 / (1.0 + np.exp(-logits))
        return np.argsort(-select(s, logits, bias), axis=1, kind="stable")[:, :top_k]
    return answer


def _ties_to_higher_id(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-logits))
    return np.argsort(s + bias, axis=1, kind="stable")[:, ::-1][:, :top_k]


def _ids_in_order(logits: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    return np.sort(route_with_bias(logits, bias, top_k), axis=1)


ROUTING = Puzzle(
    number=1, name="routing", title="Sigmoid routing with a selection-only bias",
    spec=r"""The router of a K3 layer scores every expert for every token with a **sigmoid** of the router
logits $z = x W_r^\top$, and chooses each token's $k$ experts by the scores **plus a bias** $b$, one number
per expert (`e_score_correction_bias`):

$$
s_{i,j} = \sigma(z_{i,j}) = \frac{1}{1 + e^{-z_{i,j}}},
$$

$$
\mathcal{T}_i = \operatorname{argtopk}_k\,(s_i + b).
$$

The sigmoid scores each expert on its own, in $(0, 1)$; the experts do not compete for one unit of
probability as they would under a softmax. The bias is the balancer's knob (puzzles 5 to 9 set it): it
decides which experts a token visits, and nothing else (puzzle 2).

Write `route_with_bias(logits, bias, top_k)`:

* `logits`: `[m, n]` floats, one row per token; `bias`: `[n]` floats; `top_k`: $k$, with $1 \le k \le n$;
* return `index`, `[m, k]` integers: each token's $k$ experts with the largest $s + b$, **best first**;
  when two experts tie, the **lower id** comes first (refimpl's rule: `torch.topk` leaves it open).""",
    hint=r"""Compute the scores, add the bias to every row (broadcasting `bias[None, :]`), and sort each row
from the largest: `np.argsort(-values, axis=1, kind="stable")` keeps equal values in id order, so the lower id
comes first among ties. The first `top_k` columns are the route.""",
    solution=route_with_bias,
    reference=_routing_reference,
    reference_name="refimpl.route(sigmoid(logits), bias, top_k)[0]",
    trials=(Trial("inputs whose biased scores are well separated", _separated_logits()),
            Trial("inputs with exact ties among the biased scores", _tied_logits())),
    output=_array_output("index", lambda c: (c.args[0].shape[0], c.args[2]), "int"),
    agree=lambda got, expected, case: bool(np.array_equal(got, expected)),
    show=_show_array,
    mistakes=(
        Mistake("softmax_scores", "a softmax instead of the sigmoid",
                "A softmax makes the experts of a token compete for one unit of probability, so its scores live "
                "on another scale than the one the bias was set for, and s + b picks other experts. K3 scores "
                "each expert on its own: s = 1 / (1 + exp(-z)).", _softmax_routing),
        Mistake("bias_ignored", "the bias left out of the selection",
                "The bias exists to change which experts are chosen: the top-k is taken over s + b, not over s.",
                _routing_by(lambda s, z, b: s)),
        Mistake("bias_subtracted", "the bias subtracted instead of added",
                "Some code keeps a correction beta = -b and subtracts it; here b itself is added: s + b.",
                _routing_by(lambda s, z, b: s - b)),
        Mistake("bias_on_logits", "the bias added to the logits, inside the sigmoid",
                "sigma(z + b) is not sigma(z) + b: the bias is added to the sigmoid scores, after the sigmoid.",
                _routing_by(lambda s, z, b: 1.0 / (1.0 + np.exp(-(z + b))))),
        Mistake("ties_to_higher_id", "ties broken toward the higher expert id",
                "Reversing an ascending sort puts the higher id first among equal values; the rule here is the "
                "lower id first (a stable sort of the negated values).", _ties_to_higher_id),
        Mistake("ids_in_id_order", "the chosen experts listed by id, not best first",
                "The set is right but the order is not: the route lists each token's experts from the largest "
                "s + b down (np.argpartition, or sorting the chosen ids, loses that order; capacity in puzzle 10 "
                "serves first choices first).", _ids_in_order),
    ),
)


# ---------------------------------------------------------------------------
# 2. The mixture weights and the top-1 rule
# ---------------------------------------------------------------------------

def mixture_weights(scores: np.ndarray, bias: np.ndarray, index: np.ndarray,
                    scaling_factor: float) -> np.ndarray:
    """The weights of each token's chosen experts, from the raw scores (never s + b).

    scores [m, n], bias [n], index [m, k] (the route, best first), scaling_factor c
    ->  weights [m, k]
    """
    # The raw scores of the chosen experts; the bias only chose them
    raw = np.take_along_axis(scores, index, axis=1)
    top_k = index.shape[1]
    if top_k > 1:
        # p = s / (sum of the chosen s): renormalized over the k chosen experts
        raw = raw / raw.sum(axis=1, keepdims=True)
    # A single expert keeps its raw score; every weight is then scaled by c
    return scaling_factor * raw


def _weights_reference(scores: np.ndarray, bias: np.ndarray, index: np.ndarray,
                       scaling_factor: float) -> np.ndarray:
    top_k = index.shape[1]
    # `moe_renormalize: true` as the reference gate reads it (`MoEConfig.from_hf_config`): only when top_k > 1.
    return np.asarray(route(scores, bias, top_k, renormalize=top_k > 1, scaling_factor=scaling_factor)[1])


@st.composite
def _weight_cases(draw: st.DrawFn, top1: bool) -> Case:
    n = draw(st.integers(2, 8), label="n")
    k = 1 if top1 else draw(st.integers(2, n), label="k")
    m = draw(st.integers(1, 6), label="m")
    s = draw(rst.scores(m, n))
    b = draw(rst.biases(n, scale=0.5))
    c = draw(st.sampled_from([1.0, 2.5]), label="scaling_factor")
    return Case((s, b, np.asarray(route(s, b, k)[0]), c))


def _weights_from(transform: Callable[[np.ndarray, np.ndarray, np.ndarray, int, float], np.ndarray]
                  ) -> Callable[..., np.ndarray]:
    def answer(scores: np.ndarray, bias: np.ndarray, index: np.ndarray, scaling_factor: float) -> np.ndarray:
        raw = np.take_along_axis(scores, index, axis=1)
        return transform(raw, scores, bias[index], index.shape[1], scaling_factor)
    return answer


def _renormalized(raw: np.ndarray) -> np.ndarray:
    return raw / raw.sum(axis=1, keepdims=True)


MIXTURE_WEIGHTS = Puzzle(
    number=2, name="mixture_weights", title="The mixture weights and the top-1 rule",
    spec=r"""Once the route $\mathcal{T}_i$ is chosen by $s + b$ (puzzle 1), each chosen expert's output is
weighted by its **raw** score, renormalized over the chosen set and multiplied by the routed scaling factor
$c$ (1.0 in K3):

$$
p_{i,j} = c\,\frac{s_{i,j}}{\sum_{r \in \mathcal{T}_i} s_{i,r}} \qquad (j \in \mathcal{T}_i).
$$

The bias is not in $p$: it decides which experts are chosen, never how much each contributes, and it
carries no gradient from the language-model loss.

**The top-1 rule.** K3's configuration says `moe_renormalize: true`, and the reference gate renormalizes
only when $k > 1$: with a single expert per token, the weight stays the raw score, $p_{i,j} = c\,s_{i,j}$,
not $c \cdot 1$ (a top-1 sigmoid router whose weight were always 1 would pass no gradient to the router).

Write `mixture_weights(scores, bias, index, scaling_factor)`:

* `scores`: `[m, n]` sigmoid scores $s$; `bias`: `[n]`; `index`: `[m, k]` each token's route, best first
  (what puzzle 1 returns); `scaling_factor`: $c$;
* return `weights`, `[m, k]` floats: `weights[i, r]` belongs to expert `index[i, r]`.""",
    hint=r"""`np.take_along_axis(scores, index, axis=1)` gathers each token's chosen raw scores in route
order. Divide by their row sum only when `index.shape[1] > 1`, then multiply everything by the scaling factor.
The bias is an argument only so that you can leave it out.""",
    solution=mixture_weights,
    reference=_weights_reference,
    reference_name="refimpl.route(scores, bias, k, renormalize=k > 1, scaling_factor=c)[1]",
    trials=(Trial("routes of two or more experts per token", _weight_cases(top1=False)),
            Trial("top-1 routes (one expert per token)", _weight_cases(top1=True))),
    output=_array_output("weights", lambda c: c.args[2].shape, "float"),
    agree=lambda got, expected, case: _eps_close(got, expected, scale=case.args[3]),
    show=_show_array,
    mistakes=(
        Mistake("bias_in_weights", "the bias added into the mixture weights",
                "The weights come from the raw scores s; the bias b only chooses the experts. With s + b in the "
                "weights the balancer leaks into the forward pass and moves every token's output whenever it "
                "rebalances.",
                _weights_from(lambda raw, s, b, k, c: c * (_renormalized(raw + b) if k > 1 else raw + b))),
        Mistake("top1_renormalized", "a single top-1 weight renormalized to 1",
                "With k = 1 the reference gate does not renormalize: the weight is the raw score s (times c). "
                "Renormalizing makes it exactly 1 for every token, so the router's score no longer scales the "
                "expert's output and the router learns nothing from the loss.",
                _weights_from(lambda raw, s, b, k, c: c * _renormalized(raw))),
        Mistake("scale_skipped_without_renormalization",
                "the scaling factor dropped on the path that does not renormalize",
                "The routed scaling factor c multiplies the weights whether or not they are renormalized; code "
                "that applies it inside the renormalizing branch forgets it for top-1 routes.",
                _weights_from(lambda raw, s, b, k, c: c * _renormalized(raw) if k > 1 else raw)),
        Mistake("normalized_over_all_experts", "the scores divided by their sum over all n experts",
                "The sum runs over the chosen set T_i only, so that the k weights of a token sum to c; a sum "
                "over every expert makes them small and depend on the experts that were not chosen.",
                _weights_from(lambda raw, s, b, k, c: c * (raw / s.sum(axis=1, keepdims=True) if k > 1 else raw))),
    ),
)


# ---------------------------------------------------------------------------
# 3. SiTU-GLU and its bound (Eq. 12)
# ---------------------------------------------------------------------------

def situ_glu(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    """Eq. (12): [softcap(a, beta) * sigmoid(a)] * softcap(b, linear_beta), elementwise.

    gate (a), up (b): arrays of one shape; beta (K3: 4.0), linear_beta (K3: 25.0)
    ->  an array of that shape
    """
    # softcap(a, beta) = beta * tanh(a / beta), a smooth cap to (-beta, beta)
    capped_gate = beta * np.tanh(gate / beta)
    # sigmoid(a), written so that exp never overflows
    sig = np.exp(-np.logaddexp(0.0, -gate))
    # The up branch gets its own, wider cap
    capped_up = linear_beta * np.tanh(up / linear_beta)
    return capped_gate * sig * capped_up


def _situ_reference(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    return np.asarray(reference_situ_glu(gate, up, beta=beta, linear_beta=linear_beta))


@st.composite
def _glu_cases(draw: st.DrawFn, limit: float) -> Case:
    rows, cols = draw(st.integers(1, 3), label="rows"), draw(st.integers(1, 4), label="cols")
    values = st.floats(-limit, limit, allow_nan=False, allow_infinity=False)
    a = np.array(draw(st.lists(values, min_size=rows * cols, max_size=rows * cols), label="gate"))
    b = np.array(draw(st.lists(values, min_size=rows * cols, max_size=rows * cols), label="up"))
    beta = draw(st.sampled_from([4.0, 1.0, 2.5]), label="beta")
    linear_beta = draw(st.sampled_from([25.0, 10.0, 3.0]), label="linear_beta")
    return Case((a.reshape(rows, cols), b.reshape(rows, cols), beta, linear_beta))


def _glu_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    # Each factor is good to a few units in the last place of itself, or (a sigmoid written with tanh) of 1;
    # the product is bounded by beta * linear_beta, so a relative plus a bound-sized absolute tolerance.
    eps = np.finfo(np.float64).eps
    bound = case.args[2] * case.args[3]
    return bool(np.all(np.abs(got - expected) <= 64 * eps * (np.abs(expected) + bound)))


def _sig(a: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -a))


SITU_GLU = Puzzle(
    number=3, name="situ_glu", title="SiTU-GLU and its bound",
    spec=r"""Every expert of a K3 layer is a gated linear unit whose activation is **SiTU-GLU**, a SwiGLU
with both branches smoothly capped by a scaled $\tanh$:

$$
\operatorname{softcap}(z, \beta) = \beta \tanh(z / \beta),
$$

$$
\begin{aligned}
\operatorname{SiTU\text{-}GLU}(a, b) = {}& \bigl[\operatorname{softcap}(a, \beta_1)\,\sigma(a)\bigr] \\
&\odot \operatorname{softcap}(b, \beta_2),
\end{aligned}
$$

with $a$ the gate pre-activation, $b$ the up pre-activation, $\beta_1 = 4$ (`activation_situ_beta`) and
$\beta_2 = 25$ (`activation_situ_linear_beta`). SwiGLU is $[a\,\sigma(a)] \odot b$: near zero the two agree
($\operatorname{softcap}(z, \beta) = z - z^3/(3\beta^2) + \dots$), but SwiGLU is unbounded while every
coordinate of SiTU-GLU obeys

$$|\operatorname{SiTU\text{-}GLU}(a, b)| < \beta_1 \beta_2 = 100,$$

since $|\operatorname{softcap}(a, \beta_1)| < \beta_1$, $0 < \sigma(a) < 1$ and
$|\operatorname{softcap}(b, \beta_2)| < \beta_2$. The caps are smooth: the derivative is never zero, unlike
that of a hard clamp past its bound.

Write `situ_glu(gate, up, beta, linear_beta)` for arrays `gate`, `up` of one shape, elementwise. The check
also feeds pre-activations in the thousands, where the bound is what keeps the output finite and small.""",
    hint=r"""Three factors, multiplied: `beta * np.tanh(gate / beta)`, the sigmoid of `gate`, and
`linear_beta * np.tanh(up / linear_beta)`. For very negative `gate`, `1 / (1 + np.exp(-gate))` overflows to
`inf` in the exponential (harmlessly giving 0, with a warning); `np.exp(-np.logaddexp(0, -gate))` is the
same sigmoid without the overflow.""",
    solution=situ_glu,
    reference=_situ_reference,
    reference_name="refimpl.situ_glu(gate, up, beta, linear_beta)",
    trials=(Trial("pre-activations between -40 and 40", _glu_cases(40.0)),
            Trial("pre-activations in the thousands, where the caps bind", _glu_cases(1e4))),
    output=_array_output("the output", lambda c: c.args[0].shape, "float"),
    agree=_glu_agree,
    show=_show_array,
    mistakes=(
        Mistake("swiglu", "SwiGLU in place of SiTU-GLU (no caps)",
                "[a sigma(a)] * b has no bound: one large pre-activation gives an output as large. SiTU-GLU caps "
                "the gate factor with softcap(a, beta_1) and the up branch with softcap(b, beta_2).",
                lambda a, b, beta, lb: a * _sig(a) * b),
        Mistake("caps_swapped", "the caps applied to the wrong branches",
                "beta_1 = 4 (activation_situ_beta) caps the gate a; beta_2 = 25 (activation_situ_linear_beta) "
                "caps the up branch b. Swapped, the gate saturates at 25 and the up branch at 4.",
                lambda a, b, beta, lb: lb * np.tanh(a / lb) * _sig(a) * beta * np.tanh(b / beta)),
        Mistake("up_uncapped", "only the gate capped, the up branch left linear",
                "Both branches are capped; with b uncapped the output is unbounded in b (this is the reference "
                "code's form when activation_situ_linear_beta is absent, not K3's).",
                lambda a, b, beta, lb: beta * np.tanh(a / beta) * _sig(a) * b),
        Mistake("hard_clamp", "a hard clamp instead of the tanh softcap",
                "np.clip(z, -beta, beta) has the same bound but a kink, and its derivative is exactly 0 past the "
                "bound, so a saturated unit stops learning; softcap(z, beta) = beta tanh(z / beta) is smooth.",
                lambda a, b, beta, lb: np.clip(a, -beta, beta) * _sig(a) * np.clip(b, -lb, lb)),
        Mistake("tanh_without_beta", "softcap written as tanh(z / beta), without the factor beta",
                "softcap(z, beta) = beta tanh(z / beta): the factor beta makes it z to first order near 0 "
                "(so SiTU-GLU matches SwiGLU there) and sets the bound beta_1 beta_2.",
                lambda a, b, beta, lb: np.tanh(a / beta) * _sig(a) * np.tanh(b / lb)),
    ),
)


# ---------------------------------------------------------------------------
# 4. The latent forward (Eq. 11)
# ---------------------------------------------------------------------------

def latent_moe(x: np.ndarray, index: np.ndarray, weights: np.ndarray, params: dict,
               config: object) -> np.ndarray:
    """Eq. (11) with the route given: y = shared(x) + W_up RMSNorm(sum_e p_e E_e(W_down x)).

    x [m, d]; index, weights [m, k] (the route); params: the layer's arrays by HF name;
    config: beta_1 = config.situ_beta, beta_2 = config.situ_linear_beta, eps = config.rms_norm_eps
    ->  y [m, d]
    """
    def glu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # SiTU-GLU (puzzle 3)
        beta, linear_beta = config.situ_beta, config.situ_linear_beta
        sig = np.exp(-np.logaddexp(0.0, -a))
        return beta * np.tanh(a / beta) * sig * linear_beta * np.tanh(b / linear_beta)

    # Down-projection, one matrix for all routed experts: z = x W_down^T, [m, l]
    z = x @ params["routed_expert_down_proj.weight"].T
    # The weighted sum of the chosen experts, in the latent space: u_i = sum_e p_ie E_e(z_i), [m, l]
    u = np.zeros_like(z)
    for i in range(x.shape[0]):
        for e, p in zip(index[i], weights[i], strict=True):
            hidden = glu(params["experts.w1"][e] @ z[i], params["experts.w3"][e] @ z[i])  # [f]
            u[i] += p * (params["experts.w2"][e] @ hidden)  # [l]
    # RMSNorm of the sum, once per token, times the gain g: v = u / sqrt(mean(u^2) + eps) * g
    rms = np.sqrt(np.mean(u * u, axis=1, keepdims=True) + config.rms_norm_eps)
    v = u / rms * params["routed_expert_norm.weight"]
    # Up-projection, once per token after the sum: [m, d]
    y_routed = v @ params["routed_expert_up_proj.weight"].T
    # The shared experts: one GLU on the full-width input
    gate_s = x @ params["shared_experts.gate_proj.weight"].T
    up_s = x @ params["shared_experts.up_proj.weight"].T
    y_shared = glu(gate_s, up_s) @ params["shared_experts.down_proj.weight"].T
    return y_shared + y_routed


def _latent_reference(x: np.ndarray, index: np.ndarray, weights: np.ndarray, params: dict,
                      config: MoEConfig) -> np.ndarray:
    return np.asarray(stable_latent_moe(x, params, config, routing=(index, weights)))


_WEIGHT_PALETTE = (0.5, 0.25, 1.0, 0.75, 0.125)
_GAIN_PALETTE = (1.0, 0.5, 2.0, 1.5)


@st.composite
def _latent_cases(draw: st.DrawFn) -> Case:
    # The kit's small layers (K3's switches) and token batches, with a route drawn on top.
    case = draw(rst.forward_cases(config=rst.configs(max_experts=6, max_width=8), max_tokens=4))
    config = case.config
    m, n, k = case.x.shape[0], config.n, config.k
    rows = [draw(st.permutations(range(n)), label=f"experts of token {i}")[:k] for i in range(m)]
    index = np.array(rows, dtype=np.int64).reshape(m, k)
    p = draw(st.lists(st.sampled_from(_WEIGHT_PALETTE), min_size=m * k, max_size=m * k), label="weights")
    weights = np.array(p, dtype=np.float64).reshape(m, k)
    params = dict(case.params(np.float64))
    # A trained norm's gain is not all ones (init_params starts it there): draw it.
    gain = draw(st.lists(st.sampled_from(_GAIN_PALETTE), min_size=config.ell, max_size=config.ell), label="gain")
    params["routed_expert_norm.weight"] = np.array(gain, dtype=np.float64)
    shown = {"params": f"{{**refimpl.testing.strategies.ForwardCase(config, x, param_seed={case.param_seed}, "
                       f"bias_scale={case.bias_scale}).params(np.float64),\n"
                       f"          'routed_expert_norm.weight': {_code(params['routed_expert_norm.weight'])}}}"}
    return Case((case.x, index, weights, params, config), shown)


def _latent_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    # float64 throughout; the RMSNorm can magnify the rounding of a cancelling sum by at most 1/sqrt(eps) ~ 316.
    return bool(np.all(np.abs(got - expected) <= 1e-9 * (1.0 + np.max(np.abs(expected), initial=0.0))))


def _latent_variant(*, norm: str = "sum", shared: bool = True, activation: str = "situ",
                    gain: bool = True) -> Callable[..., np.ndarray]:
    """The latent forward with one stage changed, for the catalogue of mistakes."""

    def answer(x: np.ndarray, index: np.ndarray, weights: np.ndarray, params: dict,
               config: MoEConfig) -> np.ndarray:
        def glu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            if activation == "swiglu":
                return a * _sig(a) * b
            return reference_situ_glu(a, b, beta=config.situ_beta, linear_beta=config.situ_linear_beta)

        g = params["routed_expert_norm.weight"] if gain else np.ones(config.ell)

        def normed(t: np.ndarray) -> np.ndarray:
            return t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + config.rms_norm_eps) * g

        z = x @ params["routed_expert_down_proj.weight"].T
        u = np.zeros_like(z)
        for i in range(x.shape[0]):
            for e, p in zip(index[i], weights[i], strict=True):
                out = params["experts.w2"][e] @ glu(params["experts.w1"][e] @ z[i], params["experts.w3"][e] @ z[i])
                u[i] += p * (normed(out) if norm == "per_expert" else out)
        v = normed(u) if norm == "sum" else u
        y = v @ params["routed_expert_up_proj.weight"].T
        if shared:
            h = glu(x @ params["shared_experts.gate_proj.weight"].T, x @ params["shared_experts.up_proj.weight"].T)
            y = y + h @ params["shared_experts.down_proj.weight"].T
        return y

    return answer


def _kit_forward(fn: Callable[..., Any]) -> str:
    """The kit's `check_forward` on the answer, with the route computed by refimpl from the layer's router."""

    def layer(x: np.ndarray, params: dict, config: MoEConfig) -> np.ndarray:
        scores = router_scores(x, params["gate.weight"])
        index, weights = route(scores, params["gate.e_score_correction_bias"], config.k,
                               renormalize=config.renormalize, scaling_factor=config.routed_scaling_factor)
        return fn(x, np.asarray(index), np.asarray(weights), params, config)

    return _run_kit("check_forward", lambda: check_forward(
        layer, dtype=np.float64, rtol=1e-9, atol=1e-9, configs=rst.configs(max_experts=6, max_width=8),
        max_tokens=4, settings=_settings(30)))


LATENT_FORWARD = Puzzle(
    number=4, name="latent_forward", title="The latent forward",
    spec=r"""The Stable LatentMoE layer runs its routed experts on a **latent** of width $\ell = d/\alpha$
(K3: $\alpha = 2$), sums them there, normalizes the sum once, and projects it back:

$$
u = \sum_{e \in \mathcal{T}(x)} p_e\, E_e\bigl(W_\downarrow x\bigr),
$$

$$
y = \sum_j E^{\text{shared}}_j(x) + W_\uparrow\,\operatorname{RMSNorm}(u).
$$

Stage by stage, for a batch `x` of shape `[m, d]` and its route (`index`, `weights`, puzzles 1 and 2):

1. $z = x W_\downarrow^\top$, `[m, l]`, with $W_\downarrow$ = `routed_expert_down_proj.weight` `[l, d]`;
2. each routed expert $e$ is a GLU on the latent, $E_e(z) = \operatorname{SiTU\text{-}GLU}(z G_e^\top, z U_e^\top)\,D_e^\top$
   with $G_e$ = `experts.w1[e]` `[f, l]`, $U_e$ = `experts.w3[e]` `[f, l]`, $D_e$ = `experts.w2[e]` `[l, f]`;
3. the weighted sum **in the latent**: $u_i = \sum_{e \in \mathcal{T}_i} p_{i,e} E_e(z_i)$, `[m, l]`;
4. the Stable addition, **one** RMSNorm of the sum: $v = \dfrac{u}{\sqrt{\operatorname{mean}(u^2) + \varepsilon}}
   \odot g$ (mean over the $\ell$ coordinates of a token, $g$ = `routed_expert_norm.weight`);
5. $y_{\text{routed}} = v W_\uparrow^\top$ with $W_\uparrow$ = `routed_expert_up_proj.weight` `[d, l]`;
6. the shared experts, one GLU on the full width: $y_{\text{shared}} =
   \operatorname{SiTU\text{-}GLU}(x G_s^\top, x U_s^\top)\,D_s^\top$ with `shared_experts.gate_proj.weight`,
   `shared_experts.up_proj.weight` `[N_s f, d]` and `shared_experts.down_proj.weight` `[d, N_s f]`
   (possibly with $N_s f = 0$ rows: no shared expert);
7. $y = y_{\text{shared}} + y_{\text{routed}}$, `[m, d]`.

The norm sees the **sum**: the sum of normalized outputs is not the norm of the sum, which is why, split
over devices, the partial sums of $u$ are reduced before the norm.

Write `latent_moe(x, index, weights, params, config)`. `params` is a `dict` of arrays named as above (it
also holds the router's `gate.weight` and `gate.e_score_correction_bias`, which the route already used);
from `config` read $\beta_1$ = `config.situ_beta`, $\beta_2$ = `config.situ_linear_beta` and
$\varepsilon$ = `config.rms_norm_eps`.""",
    hint=r"""Loop over tokens and their $k$ experts if it helps (the sizes are tiny): `experts.w1[e] @ z[i]`
is expert `e`'s gate pre-activation for token `i`. Accumulate $p \cdot E_e(z_i)$ into a zero `[m, l]` array,
then normalize each row of the sum (`np.mean(u * u, axis=1, keepdims=True)`), multiply by the gain, and
project up. Write SiTU-GLU as a small helper inside the function.""",
    solution=latent_moe,
    reference=_latent_reference,
    reference_name="refimpl.stable_latent_moe(x, params, config, routing=(index, weights))",
    trials=(Trial("small layers with K3's switches and a drawn route", _latent_cases()),),
    output=_array_output("y", lambda c: c.args[0].shape, "float"),
    agree=_latent_agree,
    show=lambda value: _show_array(value, precision=6),
    mistakes=(
        Mistake("norm_skipped", "the RMSNorm of the sum skipped",
                "Without step 4 the layer is the original LatentMoE, not the Stable one: the routed branch then "
                "grows with the size of u, which is what the norm exists to stop.", _latent_variant(norm="none")),
        Mistake("norm_per_expert", "the norm applied to each expert's output instead of to the sum",
                "The norm is taken once, of the weighted sum u: a sum of normalized outputs is not the norm of "
                "the sum (under expert parallelism the partial sums are reduced before the norm for this "
                "reason).", _latent_variant(norm="per_expert")),
        Mistake("shared_left_out", "the shared experts left out",
                "y is the routed branch plus the shared experts, a GLU of width N_s f on the full-width x.",
                _latent_variant(shared=False)),
        Mistake("swiglu_experts", "SwiGLU in place of SiTU-GLU in the experts",
                "Every expert (routed and shared) uses the capped activation of Eq. (12), with the betas of the "
                "config.", _latent_variant(activation="swiglu")),
        Mistake("gain_left_out", "the norm's gain g left out",
                "RMSNorm multiplies by its learned gain routed_expert_norm.weight after dividing by the root "
                "mean square.", _latent_variant(gain=False)),
    ),
    kit=_kit_forward,
)


# ---------------------------------------------------------------------------
# 5. The cutoffs (Eq. 14, step 1)
# ---------------------------------------------------------------------------

def cutoffs(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Each token's cutoff alpha_i: the (k+1)-th largest biased score s_i + b.

    scores [m, n], bias [n], top_k (k < n)  ->  alpha [m]
    """
    biased = scores + bias[None, :]
    # Each row from the largest down; position top_k (counting from 0) is the (k+1)-th largest
    ordered = -np.sort(-biased, axis=1)
    return ordered[:, top_k]


@st.composite
def _cutoff_cases(draw: st.DrawFn, ties: bool) -> Case:
    case = draw(rst.routing_cases(distinct=not ties, ties=ties, max_tokens=6, max_experts=8,
                                  allow_all_experts=False))
    return Case((case.scores, case.bias, case.top_k))


def _kth_of(values: Callable[[np.ndarray, np.ndarray], np.ndarray], rank: Callable[[int], int]
            ) -> Callable[..., np.ndarray]:
    def answer(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        return -np.sort(-values(scores, bias), axis=1)[:, rank(top_k)]
    return answer


def _raw_score_at_cutoff(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    order = np.argsort(-(scores + bias), axis=1, kind="stable")
    return np.take_along_axis(scores, order[:, top_k: top_k + 1], axis=1)[:, 0]


def _biased(scores: np.ndarray, bias: np.ndarray) -> np.ndarray:
    return scores + bias[None, :]


CUTOFFS = Puzzle(
    number=5, name="cutoffs", title="The cutoffs",
    spec=r"""Quantile Balancing (Eq. 14) starts by routing each token with the top-$(k{+}1)$ of its biased
scores instead of the top-$k$. The first $k$ are the route; the $(k{+}1)$-th biased score is the token's
**cutoff**, the $(k{+}1)$-th largest of $s_{i,1} + b_1, \dots, s_{i,n} + b_n$:

$$
\alpha_i = \bigl(s_i + b\bigr)_{(k+1)},
$$

the value an expert outside the route must beat to enter token $i$'s top-$k$: expert $j$ is chosen exactly
when $s_{i,j} + b_j > \alpha_i$ (with the lower id first on a tie, puzzle 1). The cutoffs turn selection into
a threshold per token, which is what lets Eq. (14) count, for each expert, how many tokens a new bias would
bring it.

Write `cutoffs(scores, bias, top_k)`: `scores` `[m, n]`, `bias` `[n]`, $1 \le k < n$; return `alpha`, `[m]`.
Ties do not matter here: the $(k{+}1)$-th largest value is one number however equal values are ordered.""",
    hint=r"""Sort each row of `scores + bias` from the largest (`-np.sort(-values, axis=1)`): column 0 is the
largest, so column `top_k` is the $(k{+}1)$-th largest.""",
    solution=cutoffs,
    reference=lambda s, b, k: np.asarray(reference_cutoffs(s, b, k)),
    reference_name="refimpl.cutoffs(scores, bias, top_k)",
    trials=(Trial("inputs whose biased scores are well separated", _cutoff_cases(ties=False)),
            Trial("inputs with exact ties among the biased scores", _cutoff_cases(ties=True))),
    output=_array_output("alpha", lambda c: (c.args[0].shape[0],), "float"),
    agree=lambda got, expected, case: _eps_close(got, expected, scale=2.0 + np.max(np.abs(case.args[1]))),
    show=_show_array,
    mistakes=(
        Mistake("kth_not_k_plus_1th", "the k-th largest biased score instead of the (k+1)-th",
                "The k-th largest is the last expert inside the route; the cutoff is the best expert outside it, "
                "the (k+1)-th, the score an outsider has to beat.", _kth_of(_biased, lambda k: k - 1)),
        Mistake("bias_left_out", "the cutoff read from the raw scores s, without the bias",
                "Selection is by s + b, so the cutoff, the value to beat in that selection, is a biased score.",
                _kth_of(lambda s, b: s, lambda k: k)),
        Mistake("raw_score_of_the_cutoff_expert", "the raw score of the (k+1)-th expert instead of its biased score",
                "alpha_i is compared with s_ij + b_j, so it is itself the biased value s + b of the (k+1)-th "
                "expert, not that expert's raw score.", _raw_score_at_cutoff),
        Mistake("counted_from_the_bottom", "the (k+1)-th smallest instead of the (k+1)-th largest",
                "An ascending sort puts the smallest first: position k of the descending order is the one wanted.",
                lambda s, b, k: np.sort(s + b, axis=1)[:, k]),
    ),
)


# ---------------------------------------------------------------------------
# 6. The Quantile Balancing update, with ties (Eq. 14)
# ---------------------------------------------------------------------------

def qb_update(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Eq. (14): b~_j = -(the (q+1)-th largest margin s_ij - alpha_i of expert j), then centred.

    scores [m, n], bias [n], top_k (k < n; q = m k / n a whole number)  ->  new bias [n]
    """
    m, n = scores.shape
    q = m * top_k // n
    # Step 1: each token's cutoff, the (k+1)-th largest biased score
    alpha = -np.sort(-(scores + bias[None, :]), axis=1)[:, top_k]
    # Step 2: the margins M_ij = s_ij - alpha_i; each column from the largest down
    margins = -np.sort(-(scores - alpha[:, None]), axis=0)
    # The (q+1)-th largest of each column (equal values counted one by one), negated
    b_tilde = -margins[q]
    # Step 3: remove the mean, which changes no top-k
    return b_tilde - b_tilde.mean()


@st.composite
def _update_cases(draw: st.DrawFn, ties: bool) -> Case:
    case = draw(rst.routing_cases(distinct=not ties, ties=ties, max_tokens=12, max_experts=6, integer_q=True,
                                  for_update=True))
    return Case((case.scores, case.bias, case.top_k))


def _update_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    return _eps_close(got, expected, scale=2.0 + np.max(np.abs(case.args[1])))


def _qb_variant(*, rank_shift: int = 0, center: bool = True, sign: float = -1.0, alpha_rank_shift: int = 0,
                distinct: bool = False, quantile: bool = False) -> Callable[..., np.ndarray]:
    """The exact update with one rule changed, for the catalogue of mistakes."""

    def answer(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        m, n = scores.shape
        q = m * top_k // n
        alpha = -np.sort(-(scores + bias[None, :]), axis=1)[:, top_k + alpha_rank_shift]
        margin = scores - alpha[:, None]
        if quantile:
            threshold = np.quantile(margin, 1.0 - top_k / n, axis=0)
        elif distinct:
            threshold = np.array([-np.unique(-margin[:, j])[q] for j in range(n)])
        else:
            threshold = -np.sort(-margin, axis=0)[q + rank_shift]
        b_tilde = sign * threshold
        return b_tilde - b_tilde.mean() if center else b_tilde

    return answer


def _kit_balancing(fn: Callable[..., Any]) -> str:
    return _run_kit("check_balancing_update", lambda: check_balancing_update(
        fn, dtype=np.float64, rtol=1e-12, atol=1e-12, integer_q_only=True, max_experts=6,
        settings=_settings(30)))


QB_UPDATE = Puzzle(
    number=6, name="qb_update", title="The Quantile Balancing update, with ties",
    spec=r"""A batch of $m$ tokens, each routed to $k$ of $n$ experts, is balanced when every expert gets
the **target load** $q = mk/n$. Quantile Balancing reads the bias that would give each expert exactly $q$
tokens off the batch, with no step size:

1. the cutoffs $\alpha_i$ = the $(k{+}1)$-th largest of $s_i + b$ (puzzle 5);
2. the **margins** $M_{i,j} = s_{i,j} - \alpha_i$: with the cutoffs held, token $i$ takes expert $j$ under a
   new bias $\tilde b$ when $s_{i,j} + \tilde b_j > \alpha_i$, that is when $M_{i,j} > -\tilde b_j$. For
   exactly $q$ margins of column $j$ to clear the bar, the bar is the $(q{+}1)$-th largest margin of the column;
3. **centre**: $b^{(t+1)} = \tilde b - \operatorname{mean}(\tilde b)$. A common shift changes no top-$k$,
   and keeping the bias near zero keeps float32 fine enough to separate the experts.

$$
\tilde b_j = -\bigl(M_{:,j}\bigr)_{(q+1)},
$$

$$
b^{(t+1)} = \tilde b - \operatorname{mean}(\tilde b).
$$

**Ties.** Equal margins are order statistics like any others: a value that occurs $c$ times takes $c$
consecutive ranks. Ties are not rare here, they are built in: for every token whose $(k{+}1)$-th choice is
expert $j$, $\alpha_i = s_{i,j} + b_j$ and so $M_{i,j} = -b_j$ exactly. Each column has this **atom** of equal
margins at $-b_j$, between the tokens that chose $j$ (above) and those that did not (below); when the
$(q{+}1)$-th largest falls inside it, $\tilde b_j = b_j$ and the expert's bias does not move. The check
draws batches with many exact ties (scores and biases on a grid of eighths).

Write `qb_update(scores, bias, top_k)`: `scores` `[m, n]`, `bias` `[n]`, $1 \le k < n$, and $m$ a multiple of
$n / \gcd(n, k)$ so that $q = mk/n$ is a whole number (refimpl interpolates between two ranks for a
fractional $q$; the page on Eq. (14) has that rule). Return the new bias, `[n]`.""",
    hint=r"""`alpha = -np.sort(-(scores + bias), axis=1)[:, top_k]`. Then sort each **column** of
`scores - alpha[:, None]` from the largest (`axis=0`): row `q` of the sorted margins (counting from 0) is the
$(q{+}1)$-th largest of every column. A sort counts equal values one by one, which is what the rule wants.""",
    solution=qb_update,
    reference=lambda s, b, k: np.asarray(quantile_balancing_update(s, b, k)),
    reference_name="refimpl.quantile_balancing_update(scores, bias, top_k)",
    trials=(Trial("batches whose biased scores are well separated", _update_cases(ties=False)),
            Trial("batches with many exact ties (scores and biases in eighths)", _update_cases(ties=True))),
    output=_array_output("the new bias", lambda c: (c.args[0].shape[1],), "float"),
    agree=_update_agree,
    show=_show_array,
    mistakes=(
        Mistake("qth_not_q_plus_1th", "the q-th largest margin instead of the (q+1)-th",
                "With the bar at the q-th largest margin only q - 1 margins clear it (the q-th sits on it, and "
                "must be strictly above): the bar is the (q+1)-th, so that exactly q lie above.",
                _qb_variant(rank_shift=-1)),
        Mistake("not_centred", "the new bias not centred",
                "Step 3 subtracts the mean: it changes no route, and without it the bias drifts from update to "
                "update to where float32 (and bfloat16 far worse) can no longer tell the experts apart.",
                _qb_variant(center=False)),
        Mistake("sign_flipped", "the sign of the update flipped",
                "b~_j = -(the (q+1)-th largest margin): an over-loaded expert has many large margins, so its bar "
                "rises and its bias falls. Without the minus sign the busiest experts are pushed up.",
                _qb_variant(sign=1.0)),
        Mistake("numpy_quantile", "np.quantile(margins, 1 - k/n) with its default interpolation",
                "A library quantile interpolates between order statistics with its own convention (NumPy's "
                "default puts the (1 - k/n) quantile at position (m - 1)(1 - k/n)); the rule is the (q+1)-th "
                "largest margin itself.", _qb_variant(quantile=True)),
        Mistake("alpha_is_kth", "the cutoff taken as the k-th biased score instead of the (k+1)-th",
                "alpha_i is the best score outside the route, the (k+1)-th; the k-th is inside it, and the "
                "margins measured from it are all shifted.", _qb_variant(alpha_rank_shift=-1)),
        Mistake("ties_counted_once", "equal margins counted once (distinct values ranked)",
                "The (q+1)-th largest counts equal values one by one: the atom of tokens whose margin is exactly "
                "-b_j holds many ranks, and ranking only distinct values (np.unique) skips past them.",
                _qb_variant(distinct=True)),
    ),
    kit=_kit_balancing,
)


# ---------------------------------------------------------------------------
# 7. The dual coordinate step (Appendix C)
# ---------------------------------------------------------------------------

def dual_step(scores: np.ndarray, beta: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """One exact coordinate step on the dual: alpha from beta, then the new beta from that alpha.

    scores [m, n], beta [n], top_k (k < n; q = m k / n whole)  ->  (alpha [m], new_beta [n])
    """
    m, n = scores.shape
    q = m * top_k // n
    # alpha-step: alpha_i = the (k+1)-th largest of s_i - beta
    alpha = -np.sort(-(scores - beta[None, :]), axis=1)[:, top_k]
    # beta-step: beta_j = the (q+1)-th largest of s_:,j - alpha
    new_beta = -np.sort(-(scores - alpha[:, None]), axis=0)[q]
    return alpha, new_beta


def _dual_reference(scores: np.ndarray, beta: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    alpha = np.asarray(alpha_step(scores, beta, top_k))
    return alpha, np.asarray(beta_step(scores, alpha, top_k))


@st.composite
def _dual_cases(draw: st.DrawFn, ties: bool) -> Case:
    case = draw(_update_cases(ties))
    scores, bias, k = case.args
    return Case((scores, -bias, k))


def _dual_output(value: Any, case: Case) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise _Malformed(f"it returned {type(value).__name__}; return the pair (alpha, new_beta)")
    m, n = case.args[0].shape
    alpha = _array_output("alpha", lambda c: (m,), "float")(value[0], case)
    beta = _array_output("new_beta", lambda c: (n,), "float")(value[1], case)
    return alpha, beta


def _dual_agree(got: tuple, expected: tuple, case: Case) -> bool:
    scale = 2.0 + np.max(np.abs(case.args[1]))
    return _eps_close(got[0], expected[0], scale) and _eps_close(got[1], expected[1], scale)


def _dual_show(value: tuple) -> str:
    return _show_array(value[0], prefix="alpha    = ") + "\n" + _show_array(value[1], prefix="new_beta = ")


def _dual_explain(case: Case, expected: tuple, got: tuple) -> list[str]:
    """The dual objective before the step, after the exact step and after the learner's."""
    scores, beta, k = case.args
    before = dual_objective(scores, expected[0], beta, k)
    exact = dual_objective(scores, *expected, k)
    yours = dual_objective(scores, *got, k)
    return [f"D(alpha, beta) after the alpha-step: {before:.10g}; after the exact beta-step: {exact:.10g}; "
            f"at your (alpha, new_beta): {yours:.10g}" + (" (higher than the exact step's)" if yours > exact else "")]


def _dual_variant(*, alpha_shift: int = 0, beta_shift: int = 0, beta_sign: float = -1.0,
                  centre: bool = False) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    def answer(scores: np.ndarray, beta: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        m, n = scores.shape
        q = m * top_k // n
        alpha = -np.sort(-(scores + beta_sign * beta[None, :]), axis=1)[:, top_k + alpha_shift]
        new_beta = -np.sort(-(scores - alpha[:, None]), axis=0)[q + beta_shift]
        return alpha, (new_beta - new_beta.mean() if centre else new_beta)
    return answer


DUAL_STEP = Puzzle(
    number=7, name="dual_step", title="The dual coordinate step",
    spec=r"""Why is Eq. (14) right? Perfect balance is an assignment problem: give each token $k$ experts
and each expert $q = mk/n$ tokens with the largest total score. Its LP dual, with a multiplier $\alpha_i$ per
token and $\beta_j$ per expert, is

$$
\begin{aligned}
D(\alpha, \beta) = {}& k \sum_i \alpha_i + q \sum_j \beta_j \\
&+ \sum_{i,j} \max\bigl(0,\; s_{i,j} - \alpha_i - \beta_j\bigr),
\end{aligned}
$$

convex and piecewise linear; its minimum equals the best balanced score, and at the minimum each token takes
its top-$k$ of $s_i - \beta$: routing needs only the expert side, with **$b = -\beta$**.

**Coordinate descent has closed forms.** With $\beta$ fixed, $D$ in $\alpha_i$ has slope
$k - \#\{j : s_{i,j} - \beta_j > \alpha_i\}$, which changes sign where exactly $k$ values lie above: $\alpha_i$ is
the $(k{+}1)$-th largest of $s_i - \beta$. Symmetrically, with $\alpha$ fixed, $\beta_j$ is the $(q{+}1)$-th
largest of column $j$ of $s - \alpha$:

$$
\alpha_i = \bigl(s_i - \beta\bigr)_{(k+1)},
$$

$$
\beta_j = \bigl(s_{:,j} - \alpha\bigr)_{(q+1)}.
$$

The $\alpha$-step is the cutoff of puzzle 5 (with $b = -\beta$) and the $\beta$-step is the quantile of
puzzle 6 before centring: one Quantile Balancing update **is** one $\alpha$-step followed by one $\beta$-step.
Each exact step can only lower $D$.

Write `dual_step(scores, beta, top_k)`: `scores` `[m, n]`, `beta` `[n]`, $1 \le k < n$, $q = mk/n$ whole.
Return the pair `(alpha, new_beta)`: the $\alpha$-step from `beta`, `[m]`, then the $\beta$-step from that
$\alpha$, `[n]`. Do not centre: the dual's own coordinates are wanted.""",
    hint=r"""Puzzle 5 with `-beta` in place of `bias` gives alpha; puzzle 6's step 2 without the minus sign
and without centring gives the new beta: row `q` of the columns of `scores - alpha[:, None]` sorted from the
largest.""",
    solution=dual_step,
    reference=_dual_reference,
    reference_name="refimpl.alpha_step(scores, beta, top_k), then refimpl.beta_step(scores, alpha, top_k)",
    trials=(Trial("batches whose scores are well separated", _dual_cases(ties=False)),
            Trial("batches with many exact ties (scores and multipliers in eighths)", _dual_cases(ties=True))),
    output=_dual_output,
    agree=_dual_agree,
    show=_dual_show,
    explain=_dual_explain,
    mistakes=(
        Mistake("beta_qth", "the beta-step at the q-th largest instead of the (q+1)-th",
                "D in beta_j has slope q - #{i : s_ij - alpha_i > beta_j}: it turns from negative to positive "
                "where exactly q values lie above, at the (q+1)-th largest.", _dual_variant(beta_shift=-1)),
        Mistake("alpha_kth", "the alpha-step at the k-th largest instead of the (k+1)-th",
                "D in alpha_i has slope k - #{j : s_ij - beta_j > alpha_i}: its minimum has exactly k values "
                "above, at the (k+1)-th largest.", _dual_variant(alpha_shift=-1)),
        Mistake("beta_added", "beta added to the scores instead of subtracted",
                "The dual's margins are s - alpha - beta: the alpha-step ranks s_i - beta (and routing uses "
                "b = -beta, added).", _dual_variant(beta_sign=1.0)),
        Mistake("beta_centred", "the new beta centred, as the bias is",
                "Centring is harmless for the bias (a common shift changes no route) but not for one multiplier "
                "alone: D changes unless alpha moves the other way, (alpha - c, beta + c). The coordinate step "
                "is the minimizer itself.", _dual_variant(centre=True)),
    ),
)


# ---------------------------------------------------------------------------
# 8. The sign rule as SignSGD on the dual
# ---------------------------------------------------------------------------

def sign_update(load: np.ndarray, bias: np.ndarray, rate: float) -> np.ndarray:
    """DeepSeek-V3's rule: b_j <- b_j + rate * sign(q - load_j), q the mean load.

    load [n] int (tokens per expert), bias [n], rate (gamma > 0)  ->  new bias [n]
    """
    n = load.shape[0]
    # sign(q - load_j) with q = sum(load) / n, in integers: sign(sum(load) - n load_j),
    # exactly 0 on target
    direction = np.sign(load.sum() - n * load)
    return bias + rate * direction


@st.composite
def _sign_cases(draw: st.DrawFn, on_target: bool) -> Case:
    n = draw(st.integers(2, 8), label="n")
    if on_target:
        # A whole target q and loads around it: deltas in {-1, 0, 1}, the last expert absorbing the rest.
        q = draw(st.integers(n, n + 6), label="q")
        deltas = draw(st.lists(st.sampled_from([0, 1, -1]), min_size=n - 1, max_size=n - 1), label="deltas")
        load = np.array([q + d for d in deltas] + [q - sum(deltas)], dtype=np.int64)
    else:
        load = np.array(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n), label="load"), dtype=np.int64)
    bias = draw(rst.biases(n, scale=0.5))
    rate = draw(st.sampled_from([1e-3, 1e-2, 0.5]), label="rate")
    return Case((load, bias, rate))


SIGN_RULE = Puzzle(
    number=8, name="sign_rule", title="The sign rule as SignSGD on the dual",
    spec=r"""DeepSeek-V3 balances without an auxiliary loss by nudging each bias after every batch:

$$
b_j \leftarrow b_j + \gamma\,\operatorname{sign}\bigl(q - \text{load}_j\bigr),
$$

with $\text{load}_j$ the tokens expert $j$ received, $q = \frac1n \sum_r \text{load}_r = mk/n$ the mean load
and $\gamma$ a step size (Megatron-Core's default is $10^{-3}$). An under-loaded expert's bias rises, an
over-loaded one's falls, and one exactly on target stays where it is.

**It is SignSGD on the dual of puzzle 7.** The derivative of $D(\alpha, \beta)$ in $\beta_j$ is
$q - \#\{i : s_{i,j} - \alpha_i - \beta_j > 0\}$, which at the $\alpha$-step's $\alpha$ is $q - \text{load}_j$.
A signed gradient step on $\beta$ is $\beta_j \leftarrow \beta_j - \gamma \operatorname{sign}(q - \text{load}_j)$,
and with $b = -\beta$ that is the rule above. It keeps only the direction of the load error and needs a step
size; Quantile Balancing jumps to the coordinate minimum and has none. The rule is not centred (a common shift
changes no route anyway).

Write `sign_update(load, bias, rate)`: `load` `[n]` integer counts, `bias` `[n]` floats, `rate` $\gamma > 0$;
return the new bias, `[n]`. Mind the expert exactly on target: its sign is 0.""",
    hint=r"""`q = load.sum() / n` can be fractional, and comparing a float with an integer load is exact here;
or stay in integers: $\operatorname{sign}(q - \text{load}_j) = \operatorname{sign}(\sum_r \text{load}_r - n\,\text{load}_j)$.
`np.sign` returns 0 for 0.""",
    solution=sign_update,
    reference=lambda load, bias, rate: np.asarray(sign_balancing_update(load, bias, rate)),
    reference_name="refimpl.sign_balancing_update(load, bias, rate)",
    trials=(Trial("loads around a whole target, some exactly on it", _sign_cases(on_target=True)),
            Trial("any loads", _sign_cases(on_target=False))),
    output=_array_output("the new bias", lambda c: c.args[1].shape, "float"),
    agree=lambda got, expected, case: _eps_close(got, expected, scale=1.0 + np.max(np.abs(case.args[1]))),
    show=_show_array,
    mistakes=(
        Mistake("sign_flipped", "the sign of the update flipped",
                "An under-loaded expert (load below q) must become more attractive: its bias rises, "
                "b + gamma sign(q - load). The flipped rule starves the idle experts further.",
                lambda load, b, rate: b - rate * np.sign(load.mean() - load)),
        Mistake("gradient_not_sign", "a gradient step gamma (q - load) instead of its sign",
                "SignSGD keeps only the direction of the load error: every expert off target moves by exactly "
                "gamma, whatever the size of its error.",
                lambda load, b, rate: b + rate * (load.mean() - load)),
        Mistake("on_target_moved", "an expert exactly on target moved",
                "sign(0) = 0: an expert whose load equals q keeps its bias. Writing the rule as "
                "'up if below q, else down' (or 'down if above q, else up') moves it.",
                lambda load, b, rate: b + np.where(load < load.mean(), rate, -rate),
                also=(lambda load, b, rate: b + np.where(load > load.mean(), -rate, rate),)),
    ),
)


# ---------------------------------------------------------------------------
# 9. The histogram quantile within one bin (Appendix D)
# ---------------------------------------------------------------------------

def histogram_thresholds(counts: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Each expert's threshold b~_j, the (q+1)-th smallest required bias, from its histogram row.

    counts [n, B] int (row j: expert j's required biases r binned), bias [n] (it fixed the range),
    top_k (q = m k / n whole, m = the row sum)  ->  thresholds [n] (not centred)
    """
    n, bins = counts.shape
    m = int(counts[0].sum())
    q = m * top_k // n
    t = q + 1  # the rank to read
    # The range [min b - 1, max b + 1], split into B equal bins
    low, high = bias.min() - 1.0, bias.max() + 1.0
    width = (high - low) / bins
    cumulative = np.cumsum(counts, axis=1)
    # The first bin whose cumulative count reaches t
    beta = np.argmax(cumulative >= t, axis=1)
    rows = np.arange(n)
    inside = counts[rows, beta]
    before = cumulative[rows, beta] - inside
    # The value of rank t is the u-th of the c values in its bin, taken as evenly spread:
    # the middle of the u-th of c equal slices
    u = t - before
    return low + (beta + (u - 0.5) / inside) * width


def _histogram_reference(counts: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    histogram = BiasHistogram(bias, top_k, counts.shape[1])
    histogram.counts = counts.astype(np.int64)  # the counts after the all-reduce
    return np.asarray(histogram.thresholds())


@st.composite
def _histogram_cases(draw: st.DrawFn, piled: bool) -> Case:
    n = draw(st.integers(2, 6), label="n")
    k = draw(st.integers(1, n - 1), label="k")
    step = n // math.gcd(n, k)
    m = rst.min_tokens_for_update(n, k, integer_q=True) + step * draw(st.integers(0, 2), label="more tokens")
    bins = draw(st.integers(1, 10), label="bins")
    eighths = draw(st.lists(st.integers(-8, 8), min_size=n, max_size=n), label="bias eighths")
    bias = np.array(eighths, dtype=np.float64) / 8.0
    rows = []
    for j in range(n):
        if piled:
            # Most of the column in a few bins: the atom of ties at the old bias makes columns like this.
            where = st.sampled_from(sorted({0, bins // 2, bins - 1}))
        else:
            where = st.integers(0, bins - 1)
        ids = draw(st.lists(where, min_size=m, max_size=m), label=f"bins of expert {j}")
        rows.append(np.bincount(np.array(ids, dtype=np.int64), minlength=bins))
    return Case((np.array(rows, dtype=np.int64), bias, k))


def _histogram_agree(got: np.ndarray, expected: np.ndarray, case: Case) -> bool:
    bias = case.args[1]
    return _eps_close(got, expected, scale=2.0 + np.max(np.abs(bias)))


def _histogram_variant(*, rank_shift: int = 0, place: str = "slice", fixed_range: bool = False
                       ) -> Callable[..., np.ndarray]:
    def answer(counts: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
        n, bins = counts.shape
        m = int(counts[0].sum())
        t = m * top_k // n + 1 + rank_shift
        low, high = (-1.0, 1.0) if fixed_range else (bias.min() - 1.0, bias.max() + 1.0)
        width = (high - low) / bins
        cumulative = np.cumsum(counts, axis=1)
        beta = np.argmax(cumulative >= t, axis=1)
        inside = counts[np.arange(n), beta]
        u = t - (cumulative[np.arange(n), beta] - inside)
        offset = {"slice": (u - 0.5) / np.maximum(inside, 1), "edge": 0.0 * u, "centre": 0.5 + 0.0 * u,
                  "cdf": u / np.maximum(inside, 1)}[place]
        return low + (beta + offset) * width

    return answer


HISTOGRAM_QUANTILE = Puzzle(
    number=9, name="histogram_quantile", title="The histogram quantile within one bin",
    spec=r"""At K3's scale the margins of Eq. (14) are billions of numbers spread over ranks and
micro-batches: they cannot be gathered and sorted. Appendix D histograms them instead. Written as the bias an
expert *would need*, $r_{i,j} = \alpha_i - s_{i,j}$ (token $i$ takes expert $j$ exactly when $b_j > r_{i,j}$),
the exact threshold of puzzle 6, before centring, is the **$(q{+}1)$-th smallest** $r_{:,j}$: exactly $q$ values
lie below it.

Since scores lie in $(0, 1)$ and $\alpha_i$ is some expert's biased score, every $r_{i,j}$ lies in
$[\min_j b_j - 1,\ \max_j b_j + 1]$. That range, recomputed from the current bias, is split into $B$ equal bins
of width $w$ (K3: $B = 1000$), and each expert's $r$ values are counted into its row of an $n \times B$ integer
matrix; one all-reduce (a sum) of the counts gives every rank the histogram of the global batch.

**Reading a threshold.** The value of rank $t = q + 1$ lies in the first bin $\beta$ whose cumulative count
reaches $t$. Inside it, the $c$ values it holds are taken as **evenly spread**, so the one of rank $t$, the
$u$-th of the bin, sits at the middle of the $u$-th of $c$ equal slices:

$$
\hat r_{(t)} = e_\beta + \frac{u - \tfrac12}{c}\, w,
$$

where $u = t - (\text{the count before bin } \beta)$ and $e_\beta = \text{low} + \beta w$ is the bin's lower edge.

The exact value is inside that bin, so the estimate is **within one bin width** of it.

Write `histogram_thresholds(counts, bias, top_k)`: `counts` `[n, B]` integers whose rows all sum to the number
of tokens $m$; `bias` `[n]`, the bias the histogram was built with (it fixed the range); $1 \le k < n$, with
$q = mk/n$ whole. Return the thresholds $\tilde b_j$, `[n]`, not centred.""",
    hint=r"""`np.cumsum(counts, axis=1)`; the first bin reaching `t` in every row is
`np.argmax(cumulative >= t, axis=1)`. Read the bin's count and the count before it with fancy indexing
(`counts[np.arange(n), beta]`). The bin width is `(high - low) / B`.""",
    solution=histogram_thresholds,
    reference=_histogram_reference,
    reference_name="refimpl.BiasHistogram(bias, top_k, B) with these counts, .thresholds()",
    trials=(Trial("histograms spread over all the bins", _histogram_cases(piled=False)),
            Trial("histograms piled up in a few bins", _histogram_cases(piled=True))),
    output=_array_output("the thresholds", lambda c: (c.args[0].shape[0],), "float"),
    agree=_histogram_agree,
    show=_show_array,
    mistakes=(
        Mistake("bin_edge", "the bin's lower edge, without interpolating inside the bin",
                "Reading the edge e_beta throws away where the value sits in its bin: the estimate is then off "
                "by up to a whole bin width even when the bin holds many values. Spread the bin's c values evenly "
                "and read the middle of the u-th slice.", _histogram_variant(place="edge")),
        Mistake("rank_q", "the q-th smallest value instead of the (q+1)-th",
                "The threshold is the value the (q+1)-th token needs, so that exactly q tokens lie below it. The "
                "q-th and (q+1)-th can sit many bins apart (the atom of ties at the old bias), so the q-th can "
                "miss by many bin widths.", _histogram_variant(rank_shift=-1)),
        Mistake("cdf_interpolation", "(u / c) w instead of ((u - 1/2) / c) w inside the bin",
                "Interpolating the cumulative count linearly puts the u-th of c values at the end of its slice; "
                "the reading here puts it at the middle of its slice, e_beta + (u - 1/2) w / c.",
                _histogram_variant(place="cdf")),
        Mistake("bin_centre", "the centre of the bin, whatever the rank inside it",
                "The middle of the bin is right only when the bin holds one value; with c values the rank's "
                "place inside the bin, (u - 1/2) / c, decides.", _histogram_variant(place="centre")),
        Mistake("fixed_range", "the range taken as [-1, 1] instead of [min b - 1, max b + 1]",
                "r = alpha - s moves with the bias (alpha is a biased score), so the range is recomputed from "
                "the current bias at every step; every rank gets the same edges from the same bias.",
                _histogram_variant(fixed_range=True)),
    ),
)


# ---------------------------------------------------------------------------
# 10. Capacity with the drop priority of the textbook sketch
# ---------------------------------------------------------------------------

def serve_with_capacity(index: np.ndarray, weights: np.ndarray, num_experts: int,
                        capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep at most `capacity` assignments per expert: first choices first, then token order.

    index [m, k] int (best first), weights [m, k], num_experts n, capacity C
    ->  (kept [m, k] bool, new_weights [m, k])
    """
    m, k = index.shape
    served = np.zeros(num_experts, dtype=np.int64)
    kept = np.zeros((m, k), dtype=bool)
    # Rank by rank: every token's first choice, then every second choice, ...
    for r in range(k):
        # Within a rank, in token order
        for i in range(m):
            e = index[i, r]
            if served[e] < capacity:
                kept[i, r] = True
                served[e] += 1
    # A dropped assignment's weight becomes 0; the others stay as they were (no renormalization)
    return kept, weights * kept


def _capacity_reference(index: np.ndarray, weights: np.ndarray, num_experts: int,
                        capacity: int) -> tuple[np.ndarray, np.ndarray]:
    kept = np.asarray(capacity_keep(index, num_experts, capacity))
    return kept, weights * kept


@st.composite
def _capacity_cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, 6), label="num_experts")
    k = draw(st.integers(1, n), label="top_k")
    m = draw(st.integers(1, 8), label="m")
    rows = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True),
                         min_size=m, max_size=m), label="routes")
    raw = draw(st.lists(st.lists(st.integers(1, 16), min_size=k, max_size=k), min_size=m, max_size=m),
               label="weights")
    w = np.array(raw, dtype=np.float64)
    capacity = draw(st.integers(0, m + 1), label="capacity")
    return Case((np.array(rows, dtype=np.int64).reshape(m, k), w / w.sum(axis=1, keepdims=True), n, capacity))


def _capacity_output(value: Any, case: Case) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise _Malformed(f"it returned {type(value).__name__}; return the pair (kept, new_weights)")
    shape = case.args[0].shape
    kept = _array_output("kept", lambda c: shape, "bool")(value[0], case)
    weights = _array_output("new_weights", lambda c: shape, "float")(value[1], case)
    return kept, weights


def _capacity_variant(*, token_major: bool = False, renormalize: bool = False, slack: int = 0
                      ) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    def answer(index: np.ndarray, weights: np.ndarray, num_experts: int,
               capacity: int) -> tuple[np.ndarray, np.ndarray]:
        m, k = index.shape
        served = np.zeros(num_experts, dtype=np.int64)
        kept = np.zeros((m, k), dtype=bool)
        order = [(i, r) for i in range(m) for r in range(k)] if token_major else \
            [(i, r) for r in range(k) for i in range(m)]
        for i, r in order:
            if served[index[i, r]] < capacity + slack:
                kept[i, r] = True
                served[index[i, r]] += 1
        new = weights * kept
        if renormalize:
            total = new.sum(axis=1, keepdims=True)
            new = np.where(total > 0, new / np.where(total > 0, total, 1.0), 0.0)
        return kept, new
    return answer


def _kit_capacity(fn: Callable[..., Any]) -> str:
    return _run_kit("check_capacity", lambda: check_capacity(fn, settings=_settings(30)))


CAPACITY = Puzzle(
    number=10, name="capacity", title="Capacity with the drop priority of the textbook sketch",
    spec=r"""K3 serves every assignment its router makes. The systems it is compared with (Switch Transformer
and the textbook MoE sketch) give each expert a **capacity** $C = \lceil c\,mk/n \rceil$ and drop what does not
fit. Which assignments are dropped is fixed by a priority:

* assignments are served **rank by rank**: every token's first choice before any token's second choice;
* within a rank, **in token order**;
* an assignment is kept while its expert has served fewer than $C$; a dropped assignment's weight becomes 0,
  and the token's other weights are **not renormalized**.

With $\text{position}_{i,r}$ the number of assignments to expert `index[i, r]` served before $(i, r)$:

$$
\text{kept}_{i,r} = \bigl[\,\text{position}_{i,r} < C\,\bigr],
$$

$$
p'_{i,r} = p_{i,r}\,\text{kept}_{i,r}.
$$

Serving each token's $k$ choices together, token after token, would let the first tokens of a batch take all
the room: late tokens would lose even their first choice while early ones keep their $k$-th.

Write `serve_with_capacity(index, weights, num_experts, capacity)`: `index` `[m, k]` integers (each row a
token's distinct experts, best first), `weights` `[m, k]`, `num_experts` $n$, `capacity` $C \ge 0$. Return the
pair `(kept, new_weights)`: `kept` `[m, k]` booleans, `new_weights` `[m, k]`.""",
    hint=r"""Two loops in serving order, ranks outside and tokens inside, with a counter per expert: keep
`(i, r)` while `served[index[i, r]] < capacity`. Then `weights * kept`.""",
    solution=serve_with_capacity,
    reference=_capacity_reference,
    reference_name="refimpl.capacity_keep(index, num_experts, capacity), and weights * kept",
    trials=(Trial("routes of a few tokens over a few experts, capacities from 0 to m + 1", _capacity_cases()),),
    output=_capacity_output,
    agree=lambda got, expected, case: bool(np.array_equal(got[0], expected[0]))
    and _eps_close(got[1], expected[1], scale=1.0),
    show=lambda value: (_show_array(value[0], prefix="kept        = ") + "\n"
                        + _show_array(value[1], 4, prefix="new_weights = ")),
    mistakes=(
        Mistake("token_major", "capacity served token by token instead of rank by rank",
                "Serving each token's k choices together lets the first tokens of the batch fill the experts: "
                "later tokens lose even their first choice while early ones keep their k-th. The sketch serves "
                "every first choice before any second choice.", _capacity_variant(token_major=True)),
        Mistake("renormalized_after_drop", "the kept weights renormalized after a drop",
                "The sketch sets a dropped weight to 0 and leaves the others as they were, so a token that lost "
                "an expert gets a smaller routed output; renormalizing changes its scale exactly when its experts "
                "were busy.", _capacity_variant(renormalize=True)),
        Mistake("capacity_plus_one", "one assignment more than the capacity kept",
                "An expert of capacity C serves C assignments: keep while fewer than C were served (< C, not "
                "<= C).", _capacity_variant(slack=1)),
    ),
    kit=_kit_capacity,
)


# ---------------------------------------------------------------------------
# The kit's own checks, and the collection
# ---------------------------------------------------------------------------

def _run_kit(name: str, run: Callable[[], Any]) -> str:
    """Run one of the kit's checks on a passing answer; its report becomes a `PuzzleFailure` if it fails."""
    try:
        result = run()
    except CheckFailure as failure:
        raise PuzzleFailure(f"Not yet: your answer agrees with the reference on the puzzle's inputs, but the kit's "
                            f"own {name} found more.\n\n{failure.report()}", puzzle=name) from None
    return f"The kit's {name} holds too: {len(result.passed)} invariants ({'; '.join(result.passed)})."


#: The puzzles by name, in reading order: from Eq. (13) through Eq. (12), (11), (14) and Appendices C and D.
PUZZLES: dict[str, Puzzle] = {p.name: p for p in (
    ROUTING, MIXTURE_WEIGHTS, SITU_GLU, LATENT_FORWARD, CUTOFFS, QB_UPDATE, DUAL_STEP, SIGN_RULE,
    HISTOGRAM_QUANTILE, CAPACITY)}

