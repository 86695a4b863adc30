"""What a puzzle is made of: the inputs, the catalogued mistakes, the failures a check raises, the
`Puzzle` that runs an answer against refimpl's own function, and how values are printed and compared."""

from __future__ import annotations

import ast
import inspect
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
    MoEConfig,
)
from refimpl.testing import CheckFailure

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
# The kit's own checks, run on a passing answer
# ---------------------------------------------------------------------------

def _run_kit(name: str, run: Callable[[], Any]) -> str:
    """Run one of the kit's checks on a passing answer; its report becomes a `PuzzleFailure` if it fails."""
    try:
        result = run()
    except CheckFailure as failure:
        raise PuzzleFailure(f"Not yet: your answer agrees with the reference on the puzzle's inputs, but the kit's "
                            f"own {name} found more.\n\n{failure.report()}", puzzle=name) from None
    return f"The kit's {name} holds too: {len(result.passed)} invariants ({'; '.join(result.passed)})."
