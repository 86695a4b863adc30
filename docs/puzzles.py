r"""The puzzles' notebooks and pages, made from the `PUZZLES` objects so that they never drift from the code.

Every puzzle of `refimpl.testing.puzzles` becomes

* a notebook, `examples/puzzles/NN_name.ipynb`, committed: the task with its
  equation, the rules, a set-up cell, the stub (the solution's definition and
  docstring with a body that raises `NotImplementedError`), the one-line check
  `puzzle.run(fn)`, then a hint and the answer, both collapsed
  (`"jupyter": {"source_hidden": true}`), and a link to the next puzzle;
* a page of the site, `puzzles/NN_name.md`, with the same parts, the hint and
  the answer folded (`<details>`), what the check prints for the stub, the
  mistakes the check names, and links to the previous and next puzzles (the
  sidebar holds one link, to the overview `puzzles/index.md`).

The notebooks are committed **without outputs**: a puzzle starts clean, and
the stub's verdict is shown on its page instead (computed by the check itself
when the site is built). `tests/test_puzzles.py` checks that the committed
notebooks are exactly what this script makes, and runs each in a fresh kernel.

    python docs/puzzles.py write     # (re)write examples/puzzles/*.ipynb
    python docs/puzzles.py check     # exit 1 if a committed notebook differs
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "examples" / "puzzles"

#: The command that rewrites the notebooks, named in the test that finds one stale.
REFRESH = "python docs/puzzles.py write"

RULES = """## The rules

* Write the function below with **NumPy only** (`np` is imported in the set-up cell): no refimpl, no SciPy,
  no other library in your answer. The point is to write this piece yourself.
* The arguments arrive as NumPy arrays (float64 unless the task says otherwise) and Python numbers; return
  NumPy arrays of the shapes the task asks for.
* Run the check cell. It calls your function on many small inputs that Hypothesis draws, and compares each
  answer with refimpl's own function on the same input. When an answer is wrong it prints the simplest input
  that breaks it, what was expected and what came back, and names the mistake when it is one that real ports
  of the layer made. The inputs are the same on every run.
* A hint and the answer are at the end, collapsed: open them only when you need them."""


def source_of(puzzle: Any) -> str:
    """The file that defines the puzzle, relative to the repository: `refimpl/testing/puzzles/<part>.py`."""
    return puzzle.solution.__module__.replace(".", "/") + ".py"


def _puzzles() -> dict[str, Any]:
    from refimpl.testing.puzzles import PUZZLES

    return PUZZLES


def setup_source(puzzle: Any) -> str:
    """The set-up cell: NumPy for the answer, the puzzle for the check."""
    return f'import numpy as np\n\nfrom refimpl.testing.puzzles import PUZZLES\n\npuzzle = PUZZLES["{puzzle.name}"]'


def check_source(puzzle: Any) -> str:
    """The one-line check."""
    return f"puzzle.run({puzzle.function_name})"


def _next(puzzle: Any) -> Any | None:
    names = list(_puzzles())
    at = names.index(puzzle.name)
    return _puzzles()[names[at + 1]] if at + 1 < len(names) else None


def notebook(puzzle: Any):
    """The puzzle as an nbformat v4 notebook, without outputs, with cell ids by position."""
    from nbformat import v4

    nb = v4.new_notebook()
    nb.metadata.update({
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "refimpl": {"puzzle": puzzle.name, "source": source_of(puzzle), "refresh": REFRESH},
    })
    after = _next(puzzle)
    closing = (f"Next: puzzle {after.number}, *{after.title}* (`{after.slug}.ipynb`)." if after is not None else
               "That was the last puzzle: you have written the layer and its balancing from Eq. (13) to "
               "Appendix D.")
    hidden = {"jupyter": {"source_hidden": True}}
    cells = [
        ("markdown", f"# Puzzle {puzzle.number}: {puzzle.title}\n\n{puzzle.spec}", {}),
        ("markdown", RULES, {}),
        ("code", setup_source(puzzle), {"tags": ["setup"]}),
        ("markdown", f"## Your answer\n\nReplace `raise NotImplementedError` with the body of "
                     f"`{puzzle.signature}`, run the cell, then run the check.", {}),
        ("code", puzzle.stub_source.rstrip("\n"), {"tags": ["stub"]}),
        ("code", check_source(puzzle), {"tags": ["check"]}),
        ("markdown", "## Hint\n\nThe next cell is collapsed: open it for a hint.", {}),
        ("markdown", puzzle.hint, {**hidden, "tags": ["hint"]}),
        ("markdown", "## The answer\n\nThe next cell is collapsed: it holds one answer. Run it, then the check "
                     "cell again, to see a pass.", {}),
        ("code", puzzle.answer_source.rstrip("\n"), {**hidden, "tags": ["answer"]}),
        ("markdown", closing, {}),
    ]
    for number, (kind, source, metadata) in enumerate(cells):
        cell = v4.new_markdown_cell(source) if kind == "markdown" else v4.new_code_cell(source)
        cell.id = f"cell-{number}"
        cell.metadata.update(metadata)
        nb.cells.append(cell)
    return nb


def notebook_text(puzzle: Any) -> str:
    """The notebook's file content."""
    import nbformat

    text = nbformat.writes(notebook(puzzle))
    return text if text.endswith("\n") else text + "\n"


def notebook_path(puzzle: Any) -> Path:
    """Where the puzzle's notebook is committed: `examples/puzzles/NN_name.ipynb`."""
    return FOLDER / f"{puzzle.slug}.ipynb"


def stale() -> list[Path]:
    """The committed notebooks that differ from what this script makes (missing ones included)."""
    found = []
    for puzzle in _puzzles().values():
        path = notebook_path(puzzle)
        if not path.is_file() or path.read_text(encoding="utf-8") != notebook_text(puzzle):
            found.append(path)
    return found


def write() -> list[Path]:
    """Write every notebook that differs; returns the ones written."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    written = []
    for puzzle in _puzzles().values():
        path = notebook_path(puzzle)
        text = notebook_text(puzzle)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


# ---------------------------------------------------------------------------
# The site's pages
# ---------------------------------------------------------------------------

def _fence(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text.rstrip()}\n```\n"


def _folded(kind: str, title: str, body: str) -> str:
    """A collapsed block (pymdownx.details renders it as `<details>`)."""
    return f'??? {kind} "{title}"\n\n' + textwrap.indent(body.strip("\n") + "\n", "    ") + "\n"


def stub_verdict(puzzle: Any) -> str:
    """What the check prints for the stub, computed by running it."""
    namespace: dict[str, Any] = {"np": __import__("numpy")}
    exec(compile(puzzle.stub_source, f"<stub of {puzzle.name}>", "exec"), namespace)
    from refimpl.testing.puzzles import NotWrittenYet

    try:
        puzzle.check(namespace[puzzle.function_name])
    except NotWrittenYet as failure:
        return str(failure)
    raise AssertionError(f"the stub of puzzle {puzzle.name!r} was not reported as not written")


def page(puzzle: Any) -> str:
    """The Markdown of the puzzle's page on the site."""
    name = f"{puzzle.slug}.ipynb"
    parts = [f"# Puzzle {puzzle.number}: {puzzle.title}\n",
             " · ".join(_neighbours(puzzle)) + "\n",
             f"[Download the notebook]({name}){{ .md-button download='{name}' }} `{name}` runs in any folder, in "
             "a Jupyter kernel where refimpl is installed with its `testing` extra "
             "(no release is on the package index yet: `pip install \"refimpl[testing] @ "
             "git+https://github.com/refimpl/refimpl\"`, or `pip install \"./refimpl[testing]\"` next to a "
             "clone).\n",
             "## The task\n", puzzle.spec + "\n", RULES + "\n",
             "## Your answer\n",
             "The set-up cell, then the stub to fill in:\n",
             _fence(setup_source(puzzle), "python"), _fence(puzzle.stub_source, "python"),
             "and the one-line check:\n", _fence(check_source(puzzle), "python"),
             "Run on the stub, the check says:\n",
             VERDICT_BLOCK.format(_fence(stub_verdict(puzzle), "text"))]
    mistakes = "\n".join(f"- **{m.title}**: {m.why}" for m in puzzle.mistakes)
    parts.append(_folded("note", f"The mistakes this check names ({len(puzzle.mistakes)})",
                         "Each is a wrong answer that real implementations wrote. When your answer makes one of "
                         "them, the check's message names it:\n\n" + mistakes))
    parts.append(_folded("tip", "Hint", puzzle.hint))
    parts.append(_folded("success", "The answer", "One answer, NumPy only (refimpl's own code is "
                         f"`{puzzle.reference_name}`):\n\n" + _fence(puzzle.answer_source, "python")))
    parts.append(" · ".join(_neighbours(puzzle)) + "\n")
    return "\n".join(parts)


def _neighbours(puzzle: Any) -> list[str]:
    """Links to the previous puzzle, the overview and the next puzzle (the puzzles are not in the sidebar)."""
    names = list(_puzzles())
    at = names.index(puzzle.name)
    links = []
    if at > 0:
        before = _puzzles()[names[at - 1]]
        links.append(f"Previous: [puzzle {before.number}, {before.title}]({before.slug}.md)")
    links.append("[All puzzles](index.md)")
    after = _next(puzzle)
    links.append(f"Next: [puzzle {after.number}, {after.title}]({after.slug}.md)" if after is not None
                 else "That was the last puzzle")
    return links


def index_page(example: bool = True) -> str:
    """The puzzles' overview: the module's essay with its table linked, and (`example`) one wrong answer with
    what the check prints for it."""
    import ast

    import refimpl.testing.puzzles as module

    doc = ast.get_docstring(ast.parse(Path(module.__file__).read_text(encoding="utf-8"))) or ""
    title, _, essay = doc.partition("\n")
    parts = [f"# {title.strip().rstrip('.')}\n", linked_table(essay.strip()) + "\n", INSTALL]
    if example:
        parts += ["## What a wrong answer meets\n",
                  "Puzzle 2 asks for the mixture weights. This answer renormalizes the weights whatever $k$ is, so "
                  "a single top-1 weight becomes 1 (the reference gate keeps the raw score):\n",
                  _fence(WRONG_WEIGHTS, "python"), "`puzzle.run(mixture_weights)` prints:\n",
                  VERDICT_BLOCK.format(_fence(wrong_verdict(), "text"))]
    return "\n".join(parts)


#: How to get the puzzles running, on the overview (the site's other pages say it the same way).
INSTALL = """## What you need

Each puzzle is a Jupyter notebook: download it from its page, or find them all in `examples/puzzles/` of a
clone. They need Jupyter and refimpl with its `testing` extra (Hypothesis, which draws the inputs). No release
is on the package index yet, so install from the repository:

```sh
pip install jupyterlab "refimpl[testing] @ git+https://github.com/refimpl/refimpl"
```

or, next to a clone (`git clone https://github.com/refimpl/refimpl`), `pip install jupyterlab "./refimpl[testing]"`.
Then open a notebook (`jupyter lab 01_routing.ipynb`) and run its cells from the top.
"""

#: A wrong answer to puzzle 2, as a learner writes it: the index page shows what the check tells it.
WRONG_WEIGHTS = """\
def mixture_weights(scores, bias, index, scaling_factor):
    raw = np.take_along_axis(scores, index, axis=1)
    return scaling_factor * raw / raw.sum(axis=1, keepdims=True)
"""

#: What a check prints, on a page: wrapped rather than scrolled (`refimpl-verdict` in extra.css).
VERDICT_BLOCK = '<div class="refimpl-output refimpl-verdict" markdown>\n\n{}\n</div>\n'


def wrong_verdict() -> str:
    """The message of puzzle 2's check for `WRONG_WEIGHTS`."""
    from refimpl.testing.puzzles import PuzzleFailure

    namespace: dict[str, Any] = {"np": __import__("numpy")}
    exec(compile(WRONG_WEIGHTS, "<a wrong answer>", "exec"), namespace)
    try:
        _puzzles()["mixture_weights"].check(namespace["mixture_weights"])
    except PuzzleFailure as failure:
        return str(failure)
    raise AssertionError("the wrong answer shown on the puzzles' page passed its check")


def linked_table(essay: str) -> str:
    """The essay with its table of puzzles linked, each title to its page (which offers its notebook)."""
    by_number = {p.number: p for p in _puzzles().values()}
    out = []
    for line in essay.split("\n"):
        row = re.fullmatch(r"\| (\d+) \| (.+?) \| (.+) \|", line)
        if row and int(row.group(1)) in by_number:
            p = by_number[int(row.group(1))]
            line = f"| {p.number} | [{row.group(2)}]({p.slug}.md) | {row.group(3)} |"
        out.append(line)
    return "\n".join(out)


def pages() -> dict[str, str]:
    """Every page of the puzzles' section, by its path in the site."""
    out = {"puzzles/index.md": index_page()}
    for puzzle in _puzzles().values():
        out[f"puzzles/{puzzle.slug}.md"] = page(puzzle)
    return out


def nav_lines(indent: str = "    ") -> list[str]:
    """The puzzles' entry in the navigation (a literate-nav line), indented by `indent`.

    One link, to the overview: the sidebar stays short (the site keeps it under 60 links), and the
    overview's table and each page's previous and next links lead through the ten puzzles in order.
    """
    return [f"{indent}* [Puzzles](puzzles/index.md)"]


def _main(argv: list[str]) -> int:
    if argv == ["write"]:
        for path in write():
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    if argv == ["check"]:
        found = stale()
        for path in found:
            print(f"{path.relative_to(ROOT)} differs from what {REFRESH.split()[1]} makes: run `{REFRESH}`")
        return 1 if found else 0
    print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
    print("usage: python docs/puzzles.py write | check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
