"""Reports: how a check runs each invariant as a Hypothesis property and tells what broke.

A check is a list of `Invariant`s. Each invariant is run as its own
Hypothesis property, so each one that fails is shrunk on its own to the
simplest input that breaks *it*. The body of an invariant raises `Violation`
with the details a person needs (what was expected, what came back, how far
apart); the runner keeps the violation of the shrunk example and the check
gathers every failed invariant into one `CheckFailure`.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import inspect
import math
import numbers
import shutil
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given, reject
from hypothesis import settings as Settings
from hypothesis.errors import Flaky, Unsatisfiable
from hypothesis.strategies import SearchStrategy

from .._lib.xp import dtype_name

__all__ = [
    "COMMON_SETTINGS",
    "Code",
    "CheckFailure",
    "CheckResult",
    "Coverage",
    "Invariant",
    "OutOfScope",
    "Outcome",
    "Violation",
    "MIN_COVERED",
    "Unsupported",
    "call_deadline",
    "call_user",
    "call_user_keeping_inputs",
    "describe_inputs",
    "errors",
    "format_array",
    "outcome_of",
    "run_check",
    "run_invariant",
    "kit_storage",
    "too_few_covered",
    "written_inputs",
]


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------

class Violation(AssertionError):
    """One invariant broken on one input.

    `summary` is one sentence; `details` are further lines (expected against
    actual, error sizes); `inputs` maps argument names to the values to
    print so the failure can be reproduced; `conventions` names the known
    conventions that reproduce the wrong output, where a check looks for them.
    """

    def __init__(self, summary: str, details: Sequence[str] = (), inputs: dict[str, Any] | None = None):
        super().__init__(summary)
        self.summary = summary
        self.details = list(details)
        self.inputs = dict(inputs or {})
        self.invariant: Invariant | None = None
        self.conventions: list[str] = []  # the known conventions that reproduce the output, when a check names them


class Code(str):
    """A piece of Python shown as is in a report (its repr has no quotes)."""

    def __repr__(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Invariant:
    """A named property: `body(case)` raises `Violation` when the user's code breaks it.

    `why` says in one line what the paper requires and where (the equation
    or appendix). `strategy` draws the cases; `describe(case)` names the inputs
    to print when the body's violation does not (for instance when the
    user's function raised).
    """

    name: str
    why: str
    strategy: SearchStrategy
    body: Callable[[Any], None]
    basic: bool = False  # when a basic invariant fails, the others are not run
    describe: Callable[[Any], dict[str, Any]] | None = None  # the inputs to print, if the body gave none


@dataclass(frozen=True)
class Coverage:
    """How many drawn cases an invariant ran on, and how many it could not use.

    `covered`: cases the user's code answered and the invariant judged (up to the first failure, for one
    that failed); `declined`: cases the user's code declined with `Unsupported`; `scoped_out`: cases left
    out because a difference already named would show on them (see `check_hf_moe_block`); `reasons`: the
    distinct reasons given for declining.
    """

    covered: int = 0
    declined: int = 0
    scoped_out: int = 0
    reasons: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.covered} cases covered, {self.declined} declined"
        if self.scoped_out:
            text += f", {self.scoped_out} scoped out"
        return text


@dataclass
class CheckResult:
    """What a check that passed ran: its name, the invariants it verified and how many cases each covered.

    `str(result)` is the summary a test can print: one line per invariant with the cases covered and the
    cases the user's code declined (`Unsupported`); `covered` and `declined` are the totals; `notes` says
    what the cases could and could not tell apart, where a check knows.
    """

    check: str
    passed: list[str]
    max_examples: int
    coverage: dict[str, Coverage] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def covered(self) -> int:
        """Cases covered, over every invariant."""
        return sum(c.covered for c in self.coverage.values())

    @property
    def declined(self) -> int:
        """Cases the user's code declined with `Unsupported`, over every invariant."""
        return sum(c.declined for c in self.coverage.values())

    def __str__(self) -> str:
        lines = [f"{self.check}: all {len(self.passed)} invariants hold "
                 f"(up to {self.max_examples} examples each; {self.covered} cases covered, "
                 f"{self.declined} declined)"]
        for name in self.passed:
            cover = f" ({self.coverage[name]})" if name in self.coverage else ""
            lines.append(f"  [passed] {name}{cover}")
        reasons = sorted({r for c in self.coverage.values() for r in c.reasons})
        if reasons:
            lines.append("  declined because: " + "; ".join(reasons[:3])
                         + (f" (and {len(reasons) - 3} other reasons)" if len(reasons) > 3 else ""))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


class CheckFailure(AssertionError):
    """Raised by a check when at least one invariant fails; `str()` is the full report.

    `failed` lists the names of the broken invariants, `passed` the ones that
    held, `skipped` those not run because a basic invariant (the form of the
    output) already failed, and `violations` the shrunk `Violation` of each
    broken one.
    """

    def __init__(self, check: str, violations: list[Violation], passed: list[str],
                 skipped: list[str] | None = None, coverage: dict[str, Coverage] | None = None,
                 notes: Sequence[str] = ()):
        self.check = check
        self.violations = violations
        self.passed = passed
        self.skipped = list(skipped or [])
        self.coverage = dict(coverage or {})
        self.notes = list(notes)  # lines a check adds after its head line (e.g. every difference it named)
        super().__init__(self.report())

    @property
    def failed(self) -> list[str]:
        """Names of the invariants that failed, in the order they were run."""
        return [v.invariant.name for v in self.violations if v.invariant is not None]

    def report(self) -> str:
        """The readable report: every broken invariant with its shrunk input, then the others."""
        total = len(self.violations) + len(self.passed) + len(self.skipped)
        head = (f"{self.check}: {len(self.violations)} of {total} invariants failed: "
                + "; ".join(self.failed) + ".")
        parts = [head, *self.notes]
        for number, v in enumerate(self.violations, 1):
            parts.append(_format_violation(number, v))
        if self.passed:
            parts.append("Invariants that held: " + "; ".join(self.passed) + ".")
        if self.skipped:
            parts.append("Not run (they need a well-formed output): " + "; ".join(self.skipped) + ".")
        if self.coverage:
            covered = sum(c.covered for c in self.coverage.values())
            declined = sum(c.declined for c in self.coverage.values())
            lines = [f"Cases: {covered} covered, {declined} declined in all."]
            lines += [f"  {name}: {c}" for name, c in self.coverage.items()]
            parts.append("\n".join(lines))
        return "\n\n".join(parts)

    def __str__(self) -> str:
        return self.report()


def _format_violation(number: int, v: Violation) -> str:
    inv = v.invariant
    name = inv.name if inv else "?"
    lines = [f"[{number}] FAILED: {name}"]
    if inv is not None:
        lines.append(_indent(f"why: {inv.why}"))
    lines.append(_indent(f"what broke: {v.summary}"))
    lines += [_indent(line) for line in v.details]
    if v.inputs:
        lines.append(_indent("input (the simplest one Hypothesis found):"))
        lines += [_indent(line, 2) for line in describe_inputs(v.inputs)]
    return "\n".join(lines)


def _indent(text: str, level: int = 1) -> str:
    return textwrap.indent(text, "    " * level)


# ---------------------------------------------------------------------------
# Formatting numbers
# ---------------------------------------------------------------------------

def format_array(a: Any, *, prefix: str = "", max_entries: int = 400) -> str:
    """`a` as a NumPy expression that rebuilds it: `np.array([...], dtype=np.float32)`.

    Floats are printed with the fewest digits that round-trip, so a copied
    failure reproduces the exact input. `prefix` is the text that will stand
    before the expression on its first line, so that rows line up.
    """
    a = np.asarray(a)
    name = dtype_name(a.dtype)
    options = dict(separator=", ", floatmode="unique", threshold=max_entries, max_line_width=110,
                   prefix=prefix + "np.array(")
    if name == "bfloat16":
        body = np.array2string(a.astype(np.float32), **options)
        return f"np.array({body}, dtype=np.float32).astype(ml_dtypes.bfloat16)"
    return f"np.array({np.array2string(a, **options)}, dtype=np.{name})"


def describe_inputs(inputs: dict[str, Any]) -> list[str]:
    """One `name = value` line (or block) per input, arrays as rebuildable NumPy expressions."""
    lines = []
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            shape = ", ".join(str(s) for s in value.shape)
            lines.append(f"{name} = {format_array(value, prefix=f'{name} = ')}  # [{shape}]")
        elif isinstance(value, list) and value and all(isinstance(b, np.ndarray) for b in value):
            lines.append(f"{name} = [")
            for b in value:
                shape = ", ".join(str(s) for s in b.shape)
                lines.append(f"    {format_array(b, prefix='    ')},  # [{shape}]")
            lines.append("]")
        else:
            lines.append(f"{name} = {value!r}")
    return [piece for line in lines for piece in line.split("\n")]


def errors(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    r"""The largest absolute difference, and the same relative to the largest expected magnitude.

    The relative error is taken against $\max |e|$ rather than entry by
    entry, so an expected value of zero does not make it infinite.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.size == 0:
        return 0.0, 0.0
    abs_err = float(np.max(np.abs(a - e)))
    size = float(np.max(np.abs(e)))
    return abs_err, (abs_err / size if size > 0 else (0.0 if abs_err == 0 else np.inf))


# ---------------------------------------------------------------------------
# Calling the user's code
# ---------------------------------------------------------------------------

#: The per-call deadline in seconds (None: none), set by `call_deadline`.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("refimpl_kit_deadline", default=None)


@contextlib.contextmanager
def call_deadline(seconds: float | None) -> Iterator[None]:
    """Give every call of the user's code, inside the block, at most `seconds` to return.

    ```python
    with call_deadline(5.0):
        check_router(my_router)
    ```

    A call that has not returned by then is a broken invariant ("did not return within 5 s"), and the check
    goes on; the call itself is left running in a background thread (Python cannot stop it), so a function
    that never returns costs a thread, not the test session. `None` removes the deadline.
    """
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, numbers.Real)
                                or not 0 < seconds < math.inf):
        raise ValueError(f"seconds must be a positive finite number of seconds or None, got {seconds!r}")
    token = _DEADLINE.set(None if seconds is None else float(seconds))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _argument_names(fn: Callable[..., Any], count: int) -> list[str]:
    """The names of `fn`'s first `count` positional parameters, as far as its signature tells."""
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else f"argument {i + 1}" for i in range(count)]


def _changed(before: Any, after: Any) -> bool:
    """Whether the user's call wrote into an argument (arrays compared bit for bit, NaN equal to NaN)."""
    if isinstance(before, np.ndarray):
        return (not isinstance(after, np.ndarray) or before.shape != after.shape
                or not np.array_equal(before, after, equal_nan=before.dtype.kind in "fc"))
    if isinstance(before, list | tuple):
        return len(before) != len(after) or any(_changed(b, a) for b, a in zip(before, after, strict=True))
    if isinstance(before, dict):
        return (not isinstance(after, dict) or before.keys() != after.keys()
                or any(_changed(before[k], after[k]) for k in before))
    if isinstance(before, float) and isinstance(after, float) and math.isnan(before) and math.isnan(after):
        return False
    try:
        return type(before) is not type(after) or bool(before != after)
    except Exception:  # a value that cannot be compared (the user's own object): not ours to judge
        return False


def _call_within_deadline(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)`, in a daemon thread when a deadline is set; a late call is a `Violation`."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return fn(*args, **kwargs)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - carried back to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="refimpl-kit-call")
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        raise Violation(f"the function did not return within the deadline of {deadline:g} s "
                        "(refimpl.testing.call_deadline); it is left running in the background")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class OutOfScope(Exception):  # noqa: N818 - a case the check itself leaves out, not an error
    """Raised by an invariant's body for a case it leaves out (a difference already named would show on it)."""


class Unsupported(Exception):  # noqa: N818 - named for what the user says, as NotImplementedError is
    """Raise it from your code for a drawn case your port does not cover: the check draws another.

    ```python
    def build(text_config, state_dict):
        if text_config.get("n_group", 1) > 1:
            raise refimpl.testing.Unsupported("no group-limited routing in this port")
        ...
    ```

    A declined case is neither a pass nor a failure. When fewer than `MIN_COVERED` cases of an invariant
    were covered (or none at all), the invariant fails, saying how many were declined and why: a check that
    saw almost nothing proves almost nothing.
    """


#: The fewest cases an invariant must cover (not declined with `Unsupported`) to count as checked.
MIN_COVERED = 10


def call_user(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the user's function; an exception it raises becomes a `Violation` naming it.

    The function gets copies of the arguments, so one that writes into its inputs cannot corrupt the
    reference computed from them afterwards; and such a write is itself reported, naming the argument: the
    caller of a router or an update reads its inputs again (the layer weighs the experts with the same scores
    the balancer reads next). Within `call_deadline`, a call that does not return in time is reported too.
    """
    return call_user_keeping_inputs(fn, *args, **kwargs)[0]


def call_user_keeping_inputs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, tuple, tuple]:
    """`call_user`, also returning the copies the function received and copies of them as they were.

    A `build` that keeps the state dict it was handed can write into it later, from `forward`:
    `written_inputs(fn, kept, given)` after those calls tells.
    """
    given = tuple(_copy(a) for a in args)
    kept = tuple(_copy(a) for a in given)
    try:
        out = _call_within_deadline(fn, given, kwargs)
    except (Violation, Unsupported):
        raise
    except Exception as exc:  # the user's code failed: report it as a broken invariant
        raise Violation(f"the function raised {type(exc).__name__}: {exc}") from exc
    written = written_inputs(fn, kept, given)
    if written:
        raise Violation(f"the function wrote into its input{'s' if len(written) > 1 else ''} "
                        f"{', '.join(written)}: it must leave its arguments as they were, since its caller "
                        "reads them again (the same scores weigh the experts and feed the next bias)")
    return out, given, kept


def written_inputs(fn: Callable[..., Any], kept: tuple, given: tuple) -> list[str]:
    """The names of `fn`'s arguments whose `given` copy no longer equals the `kept` one."""
    return [name for name, before, after in zip(_argument_names(fn, len(kept)), kept, given, strict=True)
            if _changed(before, after)]


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------
# Running the invariants
# ---------------------------------------------------------------------------

def resolved_settings(user: Settings | None, default: Settings) -> Settings:
    """The settings a property runs with: the user's (or the default), one bug per property."""
    base = user if user is not None else default
    return Settings(base, report_multiple_bugs=False)


@dataclass
class Outcome:
    """One invariant run: the shrunk violation (None if it held) and the cases it covered."""

    invariant: Invariant
    violation: Violation | None
    coverage: Coverage


def run_invariant(invariant: Invariant, settings: Settings) -> Outcome:
    """Run one invariant as a Hypothesis property: its shrunk violation, if any, and its coverage.

    Cases are counted until the first failure (the shrinking that follows reruns cases that are not new). An
    invariant that held on fewer than `MIN_COVERED` cases (or `max_examples`, if fewer) is reported as broken
    (`too_few_covered`), whatever kept the cases out: a property that ran on nothing proves nothing.
    """
    covered, declined, scoped_out = [0], [], [0]
    failed = [False]
    gave_up = False  # whether Hypothesis found no case at all that it could use

    @settings
    @given(invariant.strategy)
    def prop(case: Any) -> None:
        try:
            invariant.body(case)
        except Unsupported as exc:
            if not failed[0]:
                declined.append(str(exc) or "Unsupported")
            reject()  # not this case: Hypothesis draws another
        except OutOfScope:
            if not failed[0]:
                scoped_out[0] += 1
            reject()
        except Violation as v:
            failed[0] = True
            if not v.inputs and invariant.describe is not None:
                v.inputs = invariant.describe(case)
            raise
        if not failed[0]:
            covered[0] += 1

    def coverage() -> Coverage:
        return Coverage(covered[0], len(declined), scoped_out[0], tuple(sorted(set(declined))))

    try:
        prop()
    except Violation as v:
        v.invariant = invariant
        return Outcome(invariant, v, coverage())
    except Unsatisfiable:
        covered[0] = 0  # Hypothesis gave up: every case it drew was declined, scoped out or rejected
        gave_up = True
    except Flaky as exc:
        # Hypothesis saw a failure it could not reproduce; the failure itself is inside the group.
        inner = next((e for e in getattr(exc, "exceptions", ()) if isinstance(e, Violation)), None)
        details = ([f"on one of the calls: {inner.summary}", *inner.details] if inner is not None
                   else [f"Hypothesis reported: {type(exc).__name__}"])
        v = Violation("the result changed between two calls with the same input (the function is not "
                      "deterministic, or keeps state between calls)", details,
                      inner.inputs if inner is not None else None)
        v.invariant = invariant
        return Outcome(invariant, v, coverage())
    needed = min(MIN_COVERED, settings.max_examples)
    if covered[0] < needed:
        v = too_few_covered(coverage(), needed, gave_up)
        v.invariant = invariant
        return Outcome(invariant, v, coverage())
    return Outcome(invariant, None, coverage())


def too_few_covered(coverage: Coverage, needed: int, gave_up: bool = False) -> Violation:
    """The violation of an invariant that covered fewer than `needed` cases, saying what kept the others out.

    Cases are lost three ways: declined by the user's code (`Unsupported`), scoped out by the check (a
    difference already named shows on them), or rejected while they were drawn (the strategy could not make a
    case, as with pinned config keys no configuration satisfies); Hypothesis gives up (`gave_up`) when it
    found no case at all.
    """
    lost = [f"{coverage.declined} declined with refimpl.testing.Unsupported",
            f"{coverage.scoped_out} scoped out"]
    details = [f"declined because: {reason}" for reason in coverage.reasons[:3]]
    if len(coverage.reasons) > 3:
        details.append(f"(and {len(coverage.reasons) - 3} other reasons)")
    if coverage.scoped_out:
        details.append("scoped out: a difference already named shows on every one of these cases, so this round "
                       "could check nothing beyond it; correct that difference and run the check again to look "
                       "for others")
    if gave_up and not coverage.declined and not coverage.scoped_out:
        details.append("every case Hypothesis tried was rejected while it was drawn: the strategy could make no "
                       "case (pinned config keys that no configuration satisfies are one cause)")
    elif not coverage.declined and not coverage.scoped_out:
        details.append("the other draws were rejected while they were drawn (the strategy could make few cases, "
                       "or the settings allow few examples)")
    return Violation(f"too few cases were covered to check anything: {coverage.covered} covered, "
                     f"{', '.join(lost)} (at least {needed} must be covered)", details)


_STORAGE: list[str] = []  # this process's private Hypothesis folder, made on first use


@contextlib.contextmanager
def kit_storage() -> Iterator[None]:
    """Point Hypothesis's storage at a private temporary folder while a check runs, then back.

    With `database=None` Hypothesis keeps no examples, but it still caches the constants it reads from local
    modules under `.hypothesis/` in the working directory: a check run from the user's project would leave
    that folder behind. The folder used instead is removed when the process ends.
    """
    import hypothesis.configuration as configuration

    if not _STORAGE:
        _STORAGE.append(tempfile.mkdtemp(prefix="refimpl-kit-hypothesis-"))
        atexit.register(shutil.rmtree, _STORAGE[0], ignore_errors=True)
    key = "__hypothesis_home_directory"  # the setting set_hypothesis_home_dir writes (None until resolved)
    previous = vars(configuration).get(key)
    configuration.set_hypothesis_home_dir(_STORAGE[0])
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(previous)


def run_check(check: str, invariants: Sequence[Invariant], settings: Settings) -> CheckResult:
    """Run every invariant; raise `CheckFailure` listing all that broke, else return a `CheckResult`.

    The basic invariants (marked `basic=True`, listed first) check the form of
    the output; once one fails, the rest are reported as not run, since they
    would only repeat that the output is malformed.
    """
    with kit_storage():
        outcomes: list[Outcome] = []
        skipped: list[str] = []
        for invariant in invariants:
            if any(o.violation is not None and o.invariant.basic for o in outcomes):
                skipped.append(invariant.name)
                continue
            outcomes.append(run_invariant(invariant, settings))
    return outcome_of(check, outcomes, skipped, settings)


def outcome_of(check: str, outcomes: Sequence[Outcome], skipped: Sequence[str], settings: Settings,
               notes: Sequence[str] = ()) -> CheckResult:
    """The `CheckResult` of invariants that all held, or the `CheckFailure` (raised) listing those that broke."""
    coverage = {o.invariant.name: o.coverage for o in outcomes}
    violations = [o.violation for o in outcomes if o.violation is not None]
    passed = [o.invariant.name for o in outcomes if o.violation is None]
    if violations:
        raise CheckFailure(check, violations, passed, list(skipped), coverage, notes)
    return CheckResult(check, passed, settings.max_examples, coverage, list(notes))


# Settings shared by the profiles: no deadline (the first call of a framework can be slow),
# no example database (a check must not write files into the user's directory), and the
# health checks that complain about slow or large inputs switched off.
COMMON_SETTINGS = dict(deadline=None, database=None, verbosity=Verbosity.quiet,
                       phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                              HealthCheck.filter_too_much, HealthCheck.large_base_example])
