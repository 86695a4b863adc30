"""What a puzzle is made of: the inputs, the catalogued mistakes, the failures a check raises, the
`Puzzle` that runs an answer against refimpl's own function, and how values are printed and compared."""

from __future__ import annotations

import ast
import inspect
import math
import multiprocessing
import pickle
import tempfile
import textwrap
import threading
import time
import traceback
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
    up rather than down, say), which a check recognizes as well. `like(got,
    wrong, case)` says whether an answer gives what this mistake gives on
    `case`; by default it is the puzzle's own `agree`, and a mistake whose
    answers vary with the order of the arithmetic (float32) loosens it, and
    sets `narrow`: it is then named only for an answer whose results come
    back in a floating type narrower than float64. Where a catalogued form
    rounds part of the computation to float32 but returns float64 (so that
    `narrow` would refuse the form itself), `like` keeps the tight agreement
    and loosens it only for an answer whose values are all float32 numbers
    (`_float32_valued`): a float64 answer is never called float32 for
    differing from the reference by float32-sized amounts alone.

    A mistake whose results are implementation-defined (an unstable sort or
    np.argpartition leaves equal values in any order, and np.argpartition
    the chosen ones too) cannot be recognized by running its forms: another
    machine's NumPy gives other results. It sets `shows` instead, and is
    named from what the answer does: `shows(results)`, with `results` the
    triples `(case, got, expected)` of every input tried (the answer's
    value and the reference's), says whether they show this mistake (for an
    unstable sort: the answer agrees with the reference on every input
    without ties, and differs from it only by how it orders equal values on
    the others). Such a mistake is named only when no catalogued form
    explains the answer; its forms are examples.
    """

    name: str
    title: str
    why: str
    answer: Callable[..., Any]
    also: tuple[Callable[..., Any], ...] = ()
    like: Callable[[Any, Any, Case], bool] | None = None
    narrow: bool = False
    shows: Callable[[list[tuple[Case, Any, Any]]], bool] | None = None

    @property
    def forms(self) -> tuple[Callable[..., Any], ...]:
        """Every wrong answer that makes this mistake: `answer`, then `also`."""
        return (self.answer, *self.also)


class PuzzleFailure(AssertionError):
    """A puzzle's check found something wrong with the answer; `str()` is the teaching message.

    Every message opens with "Not yet:". Attributes: `puzzle` (its name),
    `kind` (what went wrong: "differs", "raised", "malformed", "mutated",
    "timeout", "ended", "unstable", "stub" or "kit"), `mistake` (the
    catalogued `Mistake` the answer makes, or None: a mistake is named only
    when it gives the answer's results on every input the check tried and no
    other catalogued mistake does), `reproduced` (True when a mistake is
    named), `case` (the shrunk `Case`, or None), `expected` and `got`.
    """

    def __init__(self, message: str, *, puzzle: str, kind: str = "differs", mistake: Mistake | None = None,
                 reproduced: bool = False, case: Case | None = None, expected: Any = None, got: Any = None):
        super().__init__(message)
        self.puzzle = puzzle
        self.kind = kind
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


#: How every failure's message begins.
OPENING = "Not yet: "


class _Mismatch(Exception):
    """Raised inside a Hypothesis property when the answer is wrong on one case (so Hypothesis shrinks it).

    `kind` is "differs" (a value that is not the expected one), "raised" (the answer's own error, of type
    `error`), "malformed" (a value of the wrong shape or type) or "mutated" (it wrote into an argument).
    """

    def __init__(self, case: Case, expected: Any, got: Any, problem: str, error: type | None = None,
                 kind: str = "differs", narrow: bool = False):
        super().__init__(problem)
        self.case, self.expected, self.got, self.problem, self.error = case, expected, got, problem, error
        self.kind, self.narrow = kind, narrow


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


#: Examples drawn per family of inputs when a check runs, and per family for the inputs on which a
#: catalogued mistake must give the answer's results before it is named.
EXAMPLES = 60
DIAGNOSIS_EXAMPLES = 30

#: Seconds one call of the learner's function may take before the check stops it. The puzzles' inputs
#: are tiny: a right answer returns in milliseconds, so a call this long is a loop that never ends.
SECONDS = 10.0


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


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {key: _copy(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _copied(args: tuple) -> tuple:
    """The arguments, copied: an answer that writes into its inputs cannot change the reference's."""
    return tuple(_copy(a) for a in args)


def _first_change(before: Any, after: Any, where: str = "") -> str | None:
    """Where `after` no longer holds what `before` held (`[2, 1]`, `['experts.w1'][0, 3]`), or None."""
    if isinstance(before, np.ndarray):
        if not isinstance(after, np.ndarray) or after.shape != before.shape or after.dtype != before.dtype:
            return where or "the whole argument"
        same = (before == after) | (np.isnan(before) & np.isnan(after)) if before.dtype.kind in "fc" else \
            before == after
        if np.all(same):
            return None
        at = tuple(int(i) for i in np.argwhere(~same)[0])
        return f"{where}[{', '.join(map(str, at))}]" if at else where or "its value"
    if isinstance(before, dict):
        if not isinstance(after, dict) or after.keys() != before.keys():
            return where or "its keys"
        for key in before:
            found = _first_change(before[key], after[key], f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(before, list):
        if not isinstance(after, list) or len(after) != len(before):
            return where or "its length"
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            found = _first_change(b, a, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _quietly(fn: Callable[..., Any], args: tuple) -> Any:
    """Call `fn` on copies of `args` with NumPy's floating-point warnings silenced (an overflow to 0 in a
    sigmoid is not an error)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*_copied(args))


@dataclass(frozen=True)
class _Outcome:
    """What one call gave: a converted value, the type of an error it raised, or a malformed result."""

    value: Any = None
    error: type | None = None
    malformed: bool = False
    narrow: bool = False

    @property
    def answered(self) -> bool:
        return self.error is None and not self.malformed

    def same_kind(self, other: _Outcome) -> bool:
        """Both raised an error of one type, or both returned something malformed."""
        if self.error is not None or other.error is not None:
            return self.error is not None and other.error is not None and issubclass(self.error, other.error)
        return self.malformed and other.malformed


# ---------------------------------------------------------------------------
# Running the learner's function with a deadline
# ---------------------------------------------------------------------------

class _Watched:
    """The learner's function, calling home before and after each call so that a watcher can stop it.

    In the worker process that runs a check, every call of the learner's
    function (the puzzle's own and the kit's) sends `("call", case)` on the
    pipe before it starts and `("done",)` when it ends; the process that
    waits for the verdict stops the worker when a call lasts longer than the
    deadline. Without a pipe (no worker) the windows send nothing.
    """

    def __init__(self, fn: Callable[..., Any], conn: Any = None):
        self.fn = fn
        self.conn = conn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self._lock = threading.Lock()

    def _send(self, message: tuple) -> None:
        if self.conn is None:
            return
        with self._lock:
            try:
                self.conn.send(message)
            except (pickle.PicklingError, TypeError, AttributeError):  # an input that does not pickle
                self.conn.send((message[0], None))

    @contextmanager
    def window(self, case: Case | None) -> Iterator[None]:
        """Announce a call of the learner's code on `case` for its duration."""
        self._send(("call", case))
        try:
            yield
        finally:
            self._send(("done",))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.window(Case(tuple(args))):
            return self.fn(*args, **kwargs)


def _fork_context() -> Any:
    """multiprocessing's "fork" context where the platform has it (Linux, macOS), else None.

    A forked worker inherits the learner's function as it is, even one
    defined in a notebook cell (which could not be pickled by reference for
    a fresh interpreter).
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    return multiprocessing.get_context("fork")


#: Seconds the waiting process lets the worker go without a word while no call of the learner is running
#: (the check's own work between calls takes milliseconds).
_SILENCE = 120.0


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
    * `probes`: inputs built by hand that tell the catalogued mistakes apart, tried with the
      shrunk input and the drawn ones before a mistake is named;
    * `differ(case, expected, got)`: what differs, in plain words (lines); by default the
      entries that differ and a common offset or factor when there is one;
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
    probes: tuple[Case, ...] = ()
    differ: Callable[[Case, Any, Any], list[str]] | None = None
    #: What naming a mistake computes once per process: the drawn inputs, the catalogued forms' outcomes.
    _known: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
        return f"{self.function_name}({', '.join(self.argument_names)})"

    @property
    def argument_names(self) -> list[str]:
        """The names of the function's arguments, as its solution declares them."""
        return list(inspect.signature(self.solution).parameters)

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
    def check(self, fn: Callable[..., Any], *, seconds: float = SECONDS) -> PuzzlePassed:
        """Try to break `fn`; return a `PuzzlePassed` when every input agrees, else raise `PuzzleFailure`.

        A stub (the answer raises `NotImplementedError`) raises `NotWrittenYet`.
        Each call of `fn` gets at most `seconds` to return: the check runs in
        a forked worker process, which is stopped when a call takes longer, and
        the failure says so (where the platform cannot fork, the check runs in
        this process without a deadline).
        """
        if not callable(fn):
            raise TypeError(f"check needs the function you wrote, got {type(fn).__name__}")
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
            raise ValueError(f"seconds must be a positive finite number, got {seconds!r}")
        with _nothing_written_here():
            context = _fork_context()
            if context is None:
                return self._check(_Watched(fn))
            return self._check_in_worker(context, fn, float(seconds))

    def run(self, fn: Callable[..., Any], *, seconds: float = SECONDS) -> None:
        """Check `fn` and print the verdict, without raising: the one-line check of a notebook.

        Whatever goes wrong (a wrong answer, an answer that never returns,
        something that is not a function) is printed as a verdict; only an
        interrupt (Ctrl-C, the notebook's stop button) goes through.
        """
        try:
            print(self.check(fn, seconds=seconds))
        except PuzzleFailure as failure:
            print(failure)
        except Exception as exc:  # noqa: BLE001 - printed, never raised: the notebook shows a verdict
            print(textwrap.fill(f"{OPENING}the check could not run: {type(exc).__name__}: {exc}", 100))

    def _check_in_worker(self, context: Any, fn: Callable[..., Any], seconds: float) -> PuzzlePassed:
        """Run `_check` in a forked worker; stop it when one call of `fn` lasts longer than `seconds`."""
        reader, writer = context.Pipe(duplex=False)
        worker = context.Process(target=self._worker, args=(fn, writer), daemon=True,
                                 name=f"refimpl-puzzle-{self.name}")
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a process with threads (a notebook kernel's) may deadlock the
            # child: the worker calls no code of those threads, and a stuck worker is stopped below anyway.
            warnings.simplefilter("ignore", DeprecationWarning)
            worker.start()
        writer.close()
        name = getattr(fn, "__name__", type(fn).__name__)
        try:
            started, case = None, None
            while True:
                wait = _SILENCE if started is None else max(0.0, started + seconds - time.monotonic())
                if reader.poll(wait):
                    try:
                        message = reader.recv()
                    except EOFError:
                        worker.join(5.0)
                        raise self._ended(name, worker.exitcode, case if started is not None else None) from None
                    if message[0] == "call":
                        started, case = time.monotonic(), message[1]
                    elif message[0] == "done":
                        started = None
                    else:
                        return self._rebuilt(message[1])
                elif started is not None:
                    raise self._late(name, seconds, case)
                else:
                    raise RuntimeError(f"the check's worker process said nothing for {_SILENCE:g} s while no call "
                                       f"of `{name}` was running")
        finally:
            if worker.is_alive():
                worker.kill()
            worker.join()
            reader.close()

    def _worker(self, fn: Callable[..., Any], conn: Any) -> None:
        """The worker process: run the check, send its outcome as plain data (a failure's mistake by name)."""
        known = set(self._known)
        try:
            outcome: tuple = ("passed", self._check(_Watched(fn, conn)))
        except PuzzleFailure as failure:
            outcome = ("failed", {"message": str(failure), "kind": failure.kind, "stub": isinstance(
                failure, NotWrittenYet), "mistake": failure.mistake.name if failure.mistake else None,
                "reproduced": failure.reproduced, "case": failure.case, "expected": failure.expected,
                "got": failure.got, "known": {k: v for k, v in self._known.items() if k not in known}})
        except BaseException:  # noqa: BLE001 - the check's own error, carried to the caller as text
            outcome = ("error", traceback.format_exc())
        try:
            conn.send(("result", outcome))
        except Exception:  # a value that does not pickle: send the message without the values
            if outcome[0] == "failed":
                outcome[1].update(case=None, expected=None, got=None, known=None)
            conn.send(("result", outcome))
        conn.close()

    def _rebuilt(self, outcome: tuple) -> PuzzlePassed:
        """The worker's outcome in this process: a `PuzzlePassed` returned, a failure raised."""
        tag, data = outcome
        if tag == "passed":
            return data
        if tag == "error":
            raise RuntimeError(f"the check of puzzle {self.name!r} failed in its worker process:\n{data}")
        self._known.update(data.get("known") or {})  # the next check's worker starts from them
        mistake = next((m for m in self.mistakes if m.name == data["mistake"]), None)
        cls = NotWrittenYet if data["stub"] else PuzzleFailure
        raise cls(data["message"], puzzle=self.name, kind=data["kind"], mistake=mistake,
                  reproduced=data["reproduced"], case=data["case"], expected=data["expected"], got=data["got"])

    def _late(self, name: str, seconds: float, case: Case | None) -> PuzzleFailure:
        """The failure of a call that did not return within `seconds`."""
        head = (f"{OPENING}`{name}` did not return within {seconds:g} s, so the check stopped it. On these small "
                "inputs an answer returns in milliseconds: look for a loop whose condition never changes, or a "
                "wait for something that never comes.")
        return PuzzleFailure("\n".join([textwrap.fill(head, 100), *self._input_lines(case, "The input it was given:")]),
                             puzzle=self.name, kind="timeout", case=case)

    def _ended(self, name: str, code: int | None, case: Case | None) -> PuzzleFailure:
        """The failure of a worker that ended without a verdict (the answer exited, or crashed Python)."""
        how = f"with exit code {code}" if code is not None and code >= 0 else \
            f"killed by signal {-code}" if code is not None else "without saying why"
        head = (f"{OPENING}the process that ran `{name}` ended ({how}) before the check could finish: an answer "
                "must return its result, not exit (sys.exit, os._exit) or crash Python.")
        lines = [textwrap.fill(head, 100)]
        if case is not None:
            lines += self._input_lines(case, "The input it was running on:")
        return PuzzleFailure("\n".join(lines), puzzle=self.name, kind="ended", case=case)

    def _input_lines(self, case: Case | None, title: str) -> list[str]:
        if case is None:
            return []
        return ["", title, *(f"    {line}" for line in self.describe(case))]

    def _check(self, fn: _Watched) -> PuzzlePassed:
        name = fn.__name__
        for trial in self.trials:
            try:
                found = self._first_mismatch(fn, trial, EXAMPLES)
            except _Stub:
                raise NotWrittenYet(
                    f"{OPENING}`{name}` is not written yet: it raised NotImplementedError. Replace the line "
                    "`raise NotImplementedError` with your answer, run that cell, then run the check again.",
                    puzzle=self.name, kind="stub") from None
            if found is not None:
                raise self._failure(fn, name, trial, found)
        kit = self.kit(fn) if self.kit is not None else ""
        return PuzzlePassed(self.name, name, self.reference_name, tuple(t.where for t in self.trials),
                            EXAMPLES * len(self.trials), kit)

    def _expected(self, case: Case) -> Any:
        with np.errstate(all="ignore"):
            return self.reference(*_copied(case.args))

    def _converted(self, raw: Any, case: Case) -> Any:
        """The answer's value through `output`; whatever refuses the conversion is `_Malformed`."""
        try:
            return self.output(raw, case)
        except _Malformed:
            raise
        except Exception as exc:  # an object NumPy cannot turn into an array, a ragged list, ...
            raise _Malformed(f"its result, a {type(raw).__name__}, could not be read as an array: "
                             f"{type(exc).__name__}: {exc}") from None

    def _attempt(self, fn: _Watched, case: Case) -> None:
        """Raise `_Mismatch` (or `_Stub`) unless `fn` answers `case` as the reference does, leaving its
        arguments as they were."""
        expected = self._expected(case)
        given = _copied(case.args)
        with fn.window(case):
            try:
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    raw = fn.fn(*given)
            except NotImplementedError as exc:
                raise _Stub(str(exc)) from None
            except (Exception, SystemExit) as exc:  # the answer's own error, reported with the input
                raise _Mismatch(case, expected, None, f"it raised {type(exc).__name__}: {exc}", type(exc),
                                kind="raised") from None
            try:
                got = self._converted(raw, case)
            except _Malformed as exc:
                raise _Mismatch(case, expected, None, str(exc), kind="malformed") from None
        for arg_name, before, after in zip(self.argument_names, case.args, given, strict=False):
            where = _first_change(before, after)
            if where is not None:
                at = "" if where in ("the whole argument", "its value") else f" (first at `{arg_name}{where}`)"
                raise _Mismatch(case, expected, got, f"it changed its argument `{arg_name}`{at}", kind="mutated")
        if not self.agree(got, expected, case):
            narrow = _narrow_floats(raw)
            note = (f"Your answer came back as {' and '.join(narrow)}; the arguments are float64, and the "
                    "expected values are computed in float64." if narrow else "")
            raise _Mismatch(case, expected, got, note, narrow=bool(narrow))

    def _first_mismatch(self, fn: _Watched, trial: Trial, examples: int) -> _Mismatch | None:
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
                inner[0].kind = "unstable"
                return inner[0]
            raise
        return None

    # -- naming a mistake ----------------------------------------------------
    def _drawn(self) -> list[Case]:
        """The inputs a mistake must also explain before it is named: `DIAGNOSIS_EXAMPLES` of each family,
        drawn the same way on every run."""
        if "drawn" not in self._known:
            cases: list[Case] = []
            for trial in self.trials:
                @Settings(_settings(DIAGNOSIS_EXAMPLES), phases=(Phase.generate,))
                @given(trial.cases)
                def collect(case: Case) -> None:
                    cases.append(case)

                collect()
            self._known["drawn"] = cases
        return self._known["drawn"]

    def _form_outcomes(self, mistake: int, form: int) -> list[_Outcome]:
        """What the catalogued wrong answer `self.mistakes[mistake].forms[form]` gives on `probes` and the
        drawn inputs (computed once per process)."""
        key = ("form", mistake, form)
        if key not in self._known:
            answer = self.mistakes[mistake].forms[form]
            self._known[key] = [self._outcome(answer, case) for case in (*self.probes, *self._drawn())]
        return self._known[key]

    def _outcome(self, fn: Callable[..., Any], case: Case, watched: _Watched | None = None) -> _Outcome:
        """What `fn` gives on `case` (inside `watched`'s window when it is the learner's function)."""
        def call() -> _Outcome:
            raw = _quietly(fn, case.args)
            return _Outcome(value=self._converted(raw, case), narrow=bool(_narrow_floats(raw)))

        try:
            if watched is None:
                return call()
            with watched.window(case):
                return call()
        except _Malformed:
            return _Outcome(malformed=True)
        except (Exception, SystemExit) as exc:
            return _Outcome(error=type(exc))

    def _gives(self, mistake: int, form: int, cases: list[Case], answers: list[_Outcome]) -> bool:
        """Whether the wrong answer `self.mistakes[mistake].forms[form]` gives the learner's `answers` on
        `cases` (the first being the shrunk input, which it must explain; on the others an input where the
        wrong answer itself fails is passed over)."""
        entry = self.mistakes[mistake]
        like = entry.like or self.agree
        outcomes = [self._outcome(entry.forms[form], cases[0]), *self._form_outcomes(mistake, form)]
        evidence = False  # an input on which both returned a value, and the same one
        for index, (case, mine, theirs) in enumerate(zip(cases, answers, outcomes, strict=True)):
            if not theirs.answered:
                if index == 0 and not theirs.same_kind(mine):
                    return False
                continue
            if not mine.answered or (entry.narrow and not mine.narrow) or not like(mine.value, theirs.value, case):
                return False
            evidence = True
        return evidence

    def _diagnose(self, fn: _Watched, found: _Mismatch) -> Mistake | None:
        """The catalogued mistake `fn` makes, or None when none can be named for sure.

        A mistake is named when one of its forms gives what `fn` gives on the
        shrunk input (the same value, the same kind of error, or a malformed
        result too), on every input of `probes` and on `DIAGNOSIS_EXAMPLES`
        drawn inputs of each family where the form returns a value (at least
        one), and no other catalogued mistake does: a mistake that fits the
        shrunk input alone is not named. When no form fits, a mistake whose
        results are implementation-defined is named if its `shows` holds for
        the answer's results next to the reference's on all those inputs, and
        no other such mistake's does.
        """
        if found.kind not in ("differs", "raised", "malformed"):
            return None
        cases = [found.case, *self.probes, *self._drawn()]
        first = _Outcome(value=found.got, narrow=found.narrow, error=found.error,
                         malformed=found.kind == "malformed")
        answers = [first, *(self._outcome(fn.fn, case, fn) for case in cases[1:])]
        fitting = [m for i, m in enumerate(self.mistakes) if m.shows is None
                   and any(self._gives(i, f, cases, answers) for f in range(len(m.forms)))]
        if fitting:
            return fitting[0] if len(fitting) == 1 else None
        if not all(answer.answered for answer in answers):
            return None
        results = [(found.case, found.got, found.expected),
                   *((case, answer.value, expected) for case, answer, expected
                     in zip(cases[1:], answers[1:], self._references(), strict=True))]
        shown = [m for m in self.mistakes if m.shows is not None and m.shows(results)]
        return shown[0] if len(shown) == 1 else None

    def _references(self) -> list[Any]:
        """The reference's results on `probes` and the drawn inputs (computed once per process)."""
        if "references" not in self._known:
            self._known["references"] = [self._expected(case) for case in (*self.probes, *self._drawn())]
        return self._known["references"]

    # -- the message -----------------------------------------------------------
    def _failure(self, fn: _Watched, name: str, trial: Trial, found: _Mismatch) -> PuzzleFailure:
        mistake = self._diagnose(fn, found)
        on = f"on {trial.where}"
        if found.kind == "mutated":
            head = (f"{OPENING}`{name}` writes into its inputs: {on}, {found.problem}. An answer must leave its "
                    "arguments as they were: its caller reads them again (the same scores weigh the experts and "
                    "feed the next bias). Work on a copy (`x = x.copy()`) or on new arrays (`x = x + y`, not "
                    "`x += y`).")
        elif found.kind == "raised":
            head = f"{OPENING}{on}, `{name}` raised an error: {found.problem.removeprefix('it raised ')}."
        elif found.kind in ("malformed", "unstable"):
            head = f"{OPENING}{on}, `{name}` did not return a valid answer: {found.problem}."
        else:
            head = f"{OPENING}{on}, `{name}` differs from {self.reference_name}."
        lines = [textwrap.fill(head, 100), ""]
        if mistake is not None:
            lines += [f"The mistake: {mistake.title}.", textwrap.fill(mistake.why, 100), ""]
        elif found.kind == "differs":
            lines += [textwrap.fill("The check cannot name a mistake for sure here: none of the mistakes it "
                                    "knows gives your answers on every input it tried. Compare what was "
                                    "expected with what came back.", 100), ""]
        lines.append("The simplest input Hypothesis found:")
        lines += [f"    {line}" for line in self.describe(found.case)]
        lines.append(f"Expected ({self.reference_name}):")
        lines += [f"    {line}" for line in self.show(found.expected).splitlines()]
        if found.got is not None and found.kind != "mutated":
            lines.append(f"Got ({name}):")
            lines += [f"    {line}" for line in self.show(found.got).splitlines()]
            differ = self.differ or _differ_arrays
            lines += [textwrap.fill(line, 100, subsequent_indent="    ")
                      for line in differ(found.case, found.expected, found.got)]
            if self.explain is not None:
                lines += self.explain(found.case, found.expected, found.got)
            if found.kind == "differs" and found.problem:
                lines.append(textwrap.fill(found.problem, 100))
        return PuzzleFailure("\n".join(lines), puzzle=self.name, kind=found.kind, mistake=mistake,
                             reproduced=mistake is not None, case=found.case, expected=found.expected,
                             got=found.got)

    def describe(self, case: Case) -> list[str]:
        """The input as lines of Python that rebuild it, one argument each."""
        names = self.argument_names
        if len(names) != len(case.args):  # a call of the kit's, with its own arguments
            names = [f"argument {i + 1}" for i in range(len(case.args))]
        lines = []
        for arg_name, value in zip(names, case.args, strict=True):
            text = case.shown.get(arg_name) or _code(value, prefix=f"{arg_name} = ")
            lines += f"{arg_name} = {text}".splitlines()
        return lines


def _differ_arrays(case: Case, expected: Any, got: Any, name: str = "") -> list[str]:
    """What differs between two arrays of one shape, in plain words: how many entries, the largest
    difference and where, and a common offset or factor when every entry shares one."""
    e, g = np.asarray(expected), np.asarray(got)
    if e.shape != g.shape:
        return [f"What differs: the shape, {list(e.shape)} expected, {list(g.shape)} got."]
    label = f"{name}: " if name else ""
    if e.dtype.kind in "biu" or g.dtype.kind in "biu":
        wrong = np.argwhere(e != g)
        if not len(wrong):
            return []
        at = tuple(int(i) for i in wrong[0])
        return [f"What differs: {label}{len(wrong)} of {e.size} entries; the first at "
                f"{list(at)}: expected {e[at]}, got {g[at]}."]
    e, g = e.astype(np.float64), g.astype(np.float64)
    gap = np.abs(g - e)
    scale = np.finfo(np.float64).eps * 64 * (1.0 + np.max(np.abs(e), initial=0.0))
    wrong = gap > scale
    if not np.any(wrong):
        return []
    at = tuple(int(i) for i in np.unravel_index(np.argmax(gap), gap.shape))
    text = (f"What differs: {label}{int(wrong.sum())} of {e.size} entries; the largest difference, "
            f"{gap[at]:.3g}, at {list(at)}: expected {e[at]:.10g}, got {g[at]:.10g}.")
    if e.size > 1:
        shift = g - e
        if np.all(np.abs(shift - shift.flat[0]) <= scale):
            text += f" Every entry is off by the same amount, {shift.flat[0]:.6g}."
        elif np.all(np.abs(e) > scale):
            ratio = g / e
            if np.all(np.abs(ratio - ratio.flat[0]) <= 1e-9 * np.abs(ratio.flat[0])):
                text += f" Every entry is {ratio.flat[0]:.6g} times the expected one."
    return [text]


def _float32_like(got: Any, wrong: Any, case: Case) -> bool:
    """An answer is what a float32 computation gives when it agrees with it to float32's rounding (a few
    hundred units of float32's last place, relative to the largest value): float32 answers that order their
    arithmetic differently differ by that much."""
    parts = zip(got, wrong, strict=True) if isinstance(got, tuple) else ((got, wrong),)
    for g, w in parts:
        g, w = np.asarray(g, dtype=np.float64), np.asarray(w, dtype=np.float64)
        if not np.all(np.abs(g - w) <= 256 * np.finfo(np.float32).eps * (1.0 + np.max(np.abs(w), initial=0.0))):
            return False
    return True


def _float32_valued(got: Any) -> bool:
    """Whether every float of an answer (an array, or a tuple of them) is a float32 number: what an answer
    whose result was float32 holds once converted to float64, and what a float64 computation almost never
    gives (a smoothed step, a result rounded to decimals). A loosened `like` uses it to tell narrowing from
    values when the catalogued form itself returns float64."""
    parts = got if isinstance(got, tuple) else (got,)
    for part in parts:
        a = np.asarray(part)
        if a.dtype.kind != "f":
            continue
        with np.errstate(over="ignore"):
            if not np.array_equal(a, a.astype(np.float32).astype(a.dtype)):
                return False
    return True


def _narrow_floats(raw: Any) -> list[str]:
    """The floating dtypes narrower than float64 in an answer's raw result (an array, or a pair of them).

    Each part is read through `np.asarray`, as the check reads the answer, so that an array of another
    library (a torch tensor, whose `dtype` NumPy cannot interpret) counts by the NumPy type it converts
    to; a part that does not convert is not counted here (the check reports it as malformed).
    """
    parts = raw if isinstance(raw, tuple | list) else (raw,)
    found = []
    for part in parts:
        if getattr(part, "dtype", None) is None:
            continue
        try:
            kind = np.asarray(part).dtype
        except Exception:  # noqa: BLE001 - an object NumPy cannot read: the conversion reports it
            continue
        if kind.kind == "f" and kind.itemsize < 8:
            found.append(kind.name)
    return sorted(set(found))


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
                            f"own {name} found more.\n\n{failure.report()}", puzzle=name, kind="kit") from None
    return f"The kit's {name} holds too: {len(result.passed)} invariants ({'; '.join(result.passed)})."
