"""How a worked example's record is compared with a fresh run of it: by meaning, not as text.

Used by the notebook tests (`test_notebooks.py`, a fresh run in a fresh kernel) and by the run with
every random input moved by one unit in the last place (`test_records_nudged.py`). The rules:

* the words between numbers must be equal (runs of spaces count as one), and so must whole numbers:
  counts, sizes and ids are facts of the method (the record decides: a fresh decimal never
  reproduces a whole number of the record, "3.5" is not "3");
* a decimal agrees when it is within one unit of the last digit the record prints (a value on a
  rounding boundary prints either neighbour; a fresh run that prints fewer digits gets no wider
  tolerance from them), or, on the lines an example's `ROUNDING` entry names, within a
  tolerance that follows from the arithmetic that computed it (a difference quotient's rounding, float32
  sums in another order, a solver's tolerance);
* run times are masked, and for the examples whose subject is a timing every decimal is.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The command that refreshes records (the Makefile's target), named in every failure.
REFRESH = "make records EXAMPLES={stem}"

#: The worked examples, each with its record examples/NN_slug.ipynb.
EXAMPLES = sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))

#: Examples whose subject is a measured time (tables of milliseconds and their ratios): two runs print
#: the same words and counts but other decimals, so their decimals are not compared.
TIMED = {"80_balance_is_speed", "81_expert_parallel_mpi"}

#: Printed numbers whose last digits are rounding error, by example: on the lines that match the pattern,
#: two decimals (those followed by the suffix, when one is given) agree when they are within the absolute
#: tolerance, which follows from the arithmetic that computed them. Everywhere else a decimal must agree
#: to the last digit it prints (one unit either way: a value on a rounding boundary prints either
#: neighbour), and words and whole numbers exactly.
ROUNDING: dict[str, list[tuple[str, float, str]]] = {
    # The same float64 forward by hand and by the library: outputs of size about 1 after sums of a few
    # dozen terms differ by a few units of 2**-52 (2.2e-16 to 4.4e-16 measured); 1e-12 bounds it.
    "01_forward_by_hand": [(r"^max \|y_by_hand", 1e-12, "")],
    # Counting into the histogram is exact, but the scores it counts come from float32 products whose last
    # bits differ between machines, and so does each rank's float32 bias: the threshold read inside a bin
    # and the exact one move by a few units of 2**-24 (values near 0.5: 3e-8 each); 1e-6 bounds their
    # difference, and the mean of a centred float32 bias of 64 entries of size 0.3.
    "20_histogram_of_r": [(r"^\d+ \d+ [-+]\d\.\d{5} ", 1e-6, ""), (r"largest \|error\|", 1e-6, "")],
    "22_mpi_allreduce": [(r"^new bias: mean", 1e-6, "")],
    # HiGHS stops at a dual feasibility tolerance of 1e-7 per constraint; the recovered dual objective then
    # agrees with the LP optimum (a few hundred to a few thousand) to far less, and what it prints is the
    # float64 rounding of sums of m * n terms of size 1 (a few 1e-13).
    "12_lp_crosscheck": [(r"^\d+ \d+ \d+ \d+ \d+\.\d+ <time> s", 1e-9, "")],
    # float32 forward passes in two orders of summation (d = 64 terms, then f = 64, then l = 32): each output
    # of size about 1 carries a few units of 2**-24 times the number of terms, far below 1e-5.
    "50_k3_checkpoint": [(r"max difference", 1e-5, "")],
    # Logits in float32 are rounded to bfloat16 (8 bits): a token's route or tie changes when one of its
    # logits lies within float32 rounding (about sqrt(d) * 2**-24, 5e-6 relative) of a bfloat16 rounding
    # boundary, about 2 * 5e-6 / 2**-8 = 0.26% of the 2,048 tokens, 5 tokens: 0.5 percentage points is 10.
    # Each changed token moves the mean relative error over the changed ones (about 100 tokens, errors
    # below 1) by at most 0.01, and the mean over all by 1 / 2,048.
    "51_bf16_router_precision": [(r"^(N\(0|kaiming|c = |router N\(0)", 0.5, "%"),
                                 (r"^relative error", 0.02, "")],
    # A central difference quotient with eps = 1e-6 carries the rounding of the loss, u * |L| / eps with
    # |L| about 4 and u = 1.1e-16, about 4e-10, times the few terms of L's sum; 1e-8 bounds it.
    "60_backward_by_hand": [(r"^(x|gate|routed|experts|shared)\S* \(", 1e-8, ""),
                            (r"largest relative difference", 1e-8, ""),
                            (r"^eps = 1e-06: error", 1e-8, ""),
                            # At eps = 1e-12 the quotient is rounding: u * |L| / eps, about 4e-4.
                            (r"^eps = 1e-12: error", 1e-3, "")],
}

#: A number as the examples print it: a sign, digits (thousands may be grouped with commas), decimals and an
#: exponent, none of them part of a name (w1, float32) or of a dotted version (5.24.0).
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.]*\d)")


def masked(text: str, stem: str) -> str:
    """Printed text with what two runs may print differently replaced: run times ("1.2 s", "0.35s").

    For the examples in `TIMED`, every decimal number is replaced, with the spaces that pad it to its
    column; integers and words must still agree.
    """
    if stem in TIMED:
        return re.sub(r" *\d+\.\d+(e[-+]?\d+)?", " <decimal>", text)
    return re.sub(r"\d+\.\d+ ?s\b", "<time> s", text)


def last_digit(token: str) -> float:
    """The value of one unit in the last digit a printed decimal shows: 0.001 for "2.716", 1e-11 for "4.3e-10"."""
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def is_decimal(token: str) -> bool:
    """Whether a printed number is a decimal (it has a point or an exponent), not a whole number."""
    return any(c in token for c in ".eE")


def decimals_agree(recorded: str, fresh: str, tolerance: float = 0.0) -> bool:
    """Whether a fresh run's printed decimal reproduces the record's, to the record's own precision.

    The record is the reference: the fresh value must lie within one unit of the last digit the record
    prints (a value on a rounding boundary prints either neighbour). A fresh value printed with more digits
    is held closer still: the two printed values must be roundings of one number, that is, their
    half-unit intervals must touch (|x - y| <= (u_record + u_fresh) / 2). A fresh value printed with fewer
    digits never widens the tolerance: "1" does not reproduce "0.02", nor "1e-11" "1e-12". On the lines an
    example's `ROUNDING` entry names, `tolerance` (from the arithmetic) may widen it.
    """
    x, y = float(recorded.replace(",", "")), float(fresh.replace(",", ""))
    unit, unit_fresh = last_digit(recorded), last_digit(fresh)
    allowed = max(min(unit, (unit + unit_fresh) / 2), tolerance)
    return abs(x - y) <= allowed * (1 + 1e-9)


def same_by_meaning(was: str, now: str, stem: str) -> list[str]:
    """What differs in meaning between two printed texts (masked already): an empty list when nothing does.

    Line by line, runs of spaces are one space (a number one digit wider shifts its column); the words
    between numbers must be equal, and so must the record's whole numbers (counts, sizes, ids: a fresh
    "3.5" or "3.0" does not reproduce a recorded "3"); a decimal of the record agrees with
    the record's when it is within one unit of the last digit the record prints (`decimals_agree`), or
    within the example's `ROUNDING` tolerance on the lines it names.
    """
    old_lines, new_lines = was.split("\n"), now.split("\n")
    if len(old_lines) != len(new_lines):
        # The lines themselves, so that a failure seen once (on another machine, under load) says what changed.
        changed = list(difflib.unified_diff(old_lines, new_lines, "record", "now", n=1, lineterm=""))
        return [f"{len(old_lines)} lines in the record, {len(new_lines)} now:", *changed[:40]]
    problems = []
    for old, new in zip(old_lines, new_lines, strict=True):
        old, new = re.sub(" +", " ", old.strip()), re.sub(" +", " ", new.strip())
        a, b = NUMBER.findall(old), NUMBER.findall(new)
        if NUMBER.split(old) != NUMBER.split(new) or len(a) != len(b):
            problems.append(f"- {old}\n+ {new}")
            continue
        rules = [(t, suffix) for pattern, t, suffix in ROUNDING.get(stem, []) if re.search(pattern, old)]
        for x, y, after in zip(a, b, NUMBER.split(old)[1:], strict=True):
            tolerance = max([t for t, suffix in rules if after.startswith(suffix)], default=0.0)
            if x == y:
                continue
            # The record decides what a number is: a whole number there (a count, a size, an id) must come back
            # as the same text, so a fresh "3.5" does not reproduce a recorded "3"; a recorded decimal may come
            # back as a whole one when it is within the record's last digit ("1e-12" against "0").
            ok = is_decimal(x) and decimals_agree(x, y, tolerance)
            if not ok:
                problems.append(f"- {old}\n+ {new}\n  ({x} against {y})")
                break
    return problems


def outputs_of(cell) -> list[str]:
    """What a code cell shows, one string per output: printed text, a figure's name, caption and alt text.

    Consecutive chunks of one stream are joined: a kernel sends printed text in pieces of no meaning."""
    shown = []
    previous = None
    for output in cell.get("outputs", []):
        kind = output.get("output_type")
        meta = (output.get("metadata") or {}).get("refimpl") or {}
        if kind == "stream" and previous == output["name"]:
            shown[-1] += output["text"]
        elif kind == "stream":
            shown.append(f"{output['name']}: {output['text']}")
        elif meta.get("filename"):
            assert "image/png" in output.get("data", {}), meta
            shown.append(f"figure {meta['filename']}: {meta.get('caption')} [alt: {meta.get('alt')}]")
        elif meta.get("caption_of"):
            shown.append(f"caption of {meta['caption_of']}: {output['data'].get('text/markdown')}")
        elif kind == "execute_result":
            shown.append(f"result: {output['data'].get('text/plain')}")
        elif kind == "error":
            shown.append(f"error: {output.get('ename')}: {output.get('evalue')}")
        else:
            shown.append(f"{kind}: {sorted(output.get('data', {}))}")
        previous = output["name"] if kind == "stream" else None
    return shown


def stdout_of(notebook) -> str:
    return "".join(o["text"] for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def read_record(script: Path):
    path = script.with_suffix(".ipynb")
    if not path.is_file():
        pytest.fail(f"{path.relative_to(ROOT)} is missing: make it with `{REFRESH.format(stem=script.stem)}`")
    return nbformat.read(path, as_version=4)


def differences(record, fresh, stem: str) -> list[str]:
    """The code cells whose outputs differ in meaning between two runs of a notebook, and how; or []."""
    found = []
    for number, (old, new) in enumerate(zip(record.cells, fresh.cells, strict=True)):
        if old.cell_type != "code":
            continue
        was = [masked(text, stem) for text in outputs_of(old)]
        now = [masked(text, stem) for text in outputs_of(new)]
        problems = same_by_meaning("\n".join(was), "\n".join(now), stem)
        if problems:
            found += [f"cell {number}:", *problems]
    return [f"cells {', '.join(p[5:-1] for p in found if p.startswith('cell '))}", *found] if found else []


#: A first cell for a record's run: every float a NumPy random generator draws moves one unit in the last
#: place (towards +inf), as inputs computed on another processor may. Integers (token ids) stay as they are.
NUDGE = textwrap.dedent("""\
    import numpy as _np

    class _NudgedGenerator(_np.random.Generator):
        pass

    def _nudged(name):
        draw = getattr(_np.random.Generator, name)

        def method(self, *args, **kwargs):
            out = draw(self, *args, **kwargs)
            if isinstance(out, float) or (isinstance(out, _np.ndarray) and out.dtype.kind == "f"):
                return _np.nextafter(out, _np.inf)
            return out
        return method

    for _name in ("random", "standard_normal", "normal", "uniform", "exponential", "standard_exponential",
                  "gamma", "standard_gamma", "beta", "lognormal", "laplace", "standard_t", "dirichlet"):
        setattr(_NudgedGenerator, _name, _nudged(_name))

    def _default_rng(seed=None):
        if isinstance(seed, _np.random.Generator):
            return seed
        return _NudgedGenerator(seed if isinstance(seed, _np.random.BitGenerator) else _np.random.PCG64(seed))

    _np.random.default_rng = _default_rng
    """)
