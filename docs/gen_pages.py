r"""Generate the pages of the documentation site from the repository itself.

mkdocs-gen-files runs this script at the start of every `mkdocs build` and
`mkdocs serve`. It runs no example and writes nothing into the working tree;
every page below exists only inside the build, and it logs a line per stage:

* `paper/<module>.md`: one literate page per module of `refimpl/`. The module
  docstring is the prose; the code follows in blocks, and every comment that
  stands on its own line becomes prose between them (`# $$...$$` comments
  become display math). Function and class docstrings are prose too. The page
  then lists the properties the module's tests check, the worked examples that
  use the module, and the hand-written fragment `docs/sections/<module>.md`
  when there is one. A fragment that holds the marker
  `<!-- refimpl:module-docstring -->` opens the page instead, with the module's
  essay where the marker stands, and the code comes last, folded (the
  conformance kit's page reads this way: install it, a test file, what each
  check catches, then the reference and the source).
* `reference/<module>.md`: the API reference, rendered by mkdocstrings.
* `examples/<NN_slug>.md` and `examples/<NN_slug>.ipynb`: each example
  `examples/NN_slug.py` has a **record**, the notebook `examples/NN_slug.ipynb`
  committed next to it, executed in a fresh kernel by `make records`
  (`docs/notebooks.py`). The page shows the record's cells with what each
  printed and drew (figures with their captions), then the script; the record
  itself is served for download. The test suite checks that every record is
  current.
* `pages/<slug>.md`: the hand-written stand-alone pages `docs/pages/<slug>.md`
  (first line `# Title`), with their markers expanded, listed under
  "Studies" in the order of `STUDIES` and then alphabetically.
* `puzzles/index.md` and `puzzles/<NN_name>.md`: the puzzles of `refimpl.testing.puzzles`, made by
  `docs/puzzles.py` (the page shows what the check prints for the stub, computed here), with each
  committed notebook `examples/puzzles/NN_name.ipynb` served for download. The overview is the
  "Puzzles" entry of the navigation, before the conformance kit; the puzzles link to each other.
* `tests/<file>.md`: the test files, rendered the same literate way, one anchor
  per test so the module pages can link to each property; `tests/index.md`
  lists them.
* `internals/index.md`: the helper modules, which have pages but no place of
  their own in the navigation.
* `benchmark-results/index.md`: one plot per benchmark, drawn from
  `docs/benchmarks/*.json`, then the results the benchmark scripts saved
  (`*.md` verbatim, `*.json` as tables), then `docs/sections/benchmarks.md`.
* `index.md`: the hand-written landing page with its computed parts filled in
  (the K3 numbers, the three "Start here" reading paths and the reading path).
  Links to pages that do not exist in this build are left out.
* `SUMMARY.md`: the navigation, read by mkdocs-literate-nav: at most one link
  per page, short labels.

On a literate page the import block and the `__all__` list that open a module
are folded away to the end of its code, so the first screen after the essay
shows the first idea and the code that computes it.

Modules that do not exist yet are skipped with a message; a missing record or
a module that does not parse is reported as a warning, which fails
`mkdocs build --strict`.
"""

from __future__ import annotations

import ast
import base64
import html
import importlib.util
import io
import json
import logging
import re
import struct
import sys
import textwrap
import time
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "refimpl"
TESTS = ROOT / "tests"
EXAMPLES = ROOT / "examples"
PAGES = DOCS / "pages"

#: The packages whose modules each get a page of their own; the package's page is its essay, a table of its
#: modules and what it exports. The other packages (`train`, `testing`) read as one page, file by file.
SPLIT_PACKAGES = ("layer", "balancing", "checkpoints", "parallel", "studies", "_lib")

#: Folders of a package whose files have pages of their own, left out of the package's page: the puzzles
#: (`docs/puzzles.py` makes their pages, each answer folded), whose source printed on the kit's page would
#: give every answer away.
OWN_PAGES = {"testing": ("puzzles",)}

#: A split package whose page opens with one of its modules, shown on the package's page rather than its own:
#: the room of balancing is read first as Eq. (14).
ROOM_OPENERS = {"balancing": "quantile"}

#: Pages that a search for their own subject must find first, however often smaller pages repeat its word:
#: "quantile" is Eq. (14)'s page before the histogram's or the kit's. Material's per-page search boost.
SEARCH_BOOST = {"balancing": 4}

#: The reading path: module (or package) and navigation label, in reading order. A learner starts where the
#: paper does, at Eq. (11), the whole block, and runs it by hand (`PATH_EXAMPLES`); then its two pieces,
#: Eqs. (12) and (13); then the numbers and the notation, and the room of the layer with its other modules.
#: The rooms of the house come in the paper's order: the layer (Eqs. 11-13), its number formats and
#: checkpoints, balancing (Eq. 14, Appendices C and D), parallelism, training and the conformance kit.
READING_PATH: list[tuple[str, str]] = [
    ("latent_moe", "Eq. (11): the forward pass"),
    ("activations", "Eq. (12) & App. B: SiTU-GLU"),
    ("routing", "Eq. (13): routing"),
    ("config", "Configuration"),
    ("layer", "The layer: Eqs. (11)-(13)"),
    ("selection", "Step 2 and its extension points"),
    ("backward", "The backward pass"),
    ("accounting", "Accounting"),
    ("mx", "MXFP4 and MXFP8"),
    ("checkpoints", "Checkpoints and tensors"),
    ("hf_checkpoint", "Loading the released checkpoint"),
    ("safetensors", "Reading safetensors safely"),
    ("state_dict", "Porting: HF tensor names"),
    ("families", "The other MoE families in transformers"),
    ("balancing", "Eq. (14): Quantile Balancing"),
    ("balancer", "The balancer interface"),
    ("dual", "App. C: the LP and its dual"),
    ("histogram", "App. D: the histogram estimator"),
    ("shipped", "Eq. (14) as others ship it"),
    ("baselines", "The other routers and balancers"),
    ("other_balancers", "Other balancers in training"),
    ("parallel", "Expert parallelism over MPI"),
    ("expert_parallel", "The layer across ranks"),
    ("exchange", "The exchange between ranks"),
    ("padded", "One device: padded experts"),
    ("train", "Training a small model"),
    ("testing", "The conformance kit"),
    ("goldens", "Golden vectors"),
]

#: Worked examples read on the reading path, right after a module's page: module -> example. They stand there
#: in the navigation and on the landing page's reading path, and not again under "Worked examples".
PATH_EXAMPLES = {"latent_moe": "01_forward_by_hand"}

#: Test files named after a module that has since been renamed: module -> the stem in `tests/test_<stem>.py`.
TEST_STEMS = {"hf_checkpoint": "checkpoint"}

#: The stand-alone pages `docs/pages/<slug>.md` that come first under "Studies", in this order;
#: any other page follows, alphabetically by slug.
STUDIES = ["why-stable", "balance-is-speed", "report-card", "conventions"]

#: Helper modules: pages of their own, listed on `internals/index.md` rather than in the navigation.
INTERNALS = {"_lib": "the private helpers, together", "studies": "what the worked examples and study pages share",
             "xp": "the array-API helpers the standard lacks", "validation": "input checks with clear errors",
             "recorded": "the recorded long runs the examples replay", "figures": "how the examples save and "
             "show their figures", "workloads": "the skewed router of the balance-is-speed examples",
             "fast": "the fast paths, each beside the readable code it replaces",
             "files": "atomic writes: a temporary name, flushed, then renamed",
             "values": "checked sizes and factors, shared by the configuration readers"}

#: Modules whose page is reached from another page rather than from the navigation: the report card from its
#: study page, the smaller modules of a room from the room's page, whose table links each of its modules (the
#: sidebar holds at most 60 links).
NOT_IN_NAV = {"report_card", "safetensors", "exchange", "padded", "balancer", "other_balancers", "shipped",
              "selection"}

#: Examples whose page is reached from the page they measure, the examples index and the reading paths rather
#: than from the navigation (the sidebar holds at most 60 links).
EXAMPLES_NOT_IN_NAV = {"15_qb_as_others_ship_it"}

#: Navigation labels of modules outside the reading path whose title is long.
MODULE_LABELS: dict[str, str] = {}

#: The example shown as its own page, "Compare the variants".
COMPARE_EXAMPLE = "40_compare_variants"

#: Short navigation labels of the examples whose title is long (the others use the title up to its colon).
NAV_LABELS = {
    "01_forward_by_hand": "One forward pass by hand", "02_k3_accounting": "The K3 accounting",
    "03_situ_vs_swiglu": "SiTU-GLU against SwiGLU", "13_fixed_batch_stall": "Where iterated Eq. (14) stops",
    "14_fresh_batch_noise": "Fresh batches at K3 scale", "15_qb_as_others_ship_it": "Eq. (14) as others ship it", "20_histogram_of_r": "Where the histogram reads",
    "21_bins_and_traffic": "Bins and traffic", "22_mpi_allreduce": "Appendix D over MPI",
    "50_k3_checkpoint": "A K3 checkpoint", "60_backward_by_hand": "One backward pass by hand",
    "61_balance_while_learning": "Balance while learning", "62_activations_while_training": "Activations in training",
    "63_latent_norm_while_training": "The latent norm in training", "70_capacity_by_hand": "Capacity by hand", "72_capacity_mistakes": "Capacity mistakes",
    "80_balance_is_speed": "Balance is speed", "81_expert_parallel_mpi": "Expert parallelism over MPI",
}

#: Markers a hand-written page or fragment may contain, filled from the examples' records and the package:
#: `<!-- refimpl:example-output NN_slug -->` (everything the example printed),
#: `<!-- refimpl:example-figure NN_slug/name.png -->` (one of its figures, with its caption and alt text),
#: `<!-- refimpl:example-block NN_slug "First words" -->` (one block of what it printed: from the line that
#: starts with the words to the next rule of `=`), and `<!-- refimpl:report-card -->` (the MoE report card).
_MARKER = re.compile(r'<!--\s*refimpl:(?P<kind>example-output|example-figure|example-block|report-card)'
                     r'(?:\s+(?P<arg>[^\s"]+))?(?:\s+"(?P<words>[^"]+)")?\s*-->')

#: Whole-model totals as the technical report states them (the landing page compares the layer's share).
K3_TOTAL_PARAMETERS = 2.78e12
K3_ACTIVATED_PARAMETERS = 104.2e9

log = logging.getLogger("mkdocs.plugins.gen_pages")


def _load_notebooks():
    """`docs/notebooks.py`: the script-to-notebook conversion (docs/ is not a package)."""
    name = "refimpl_docs_notebooks"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DOCS / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


notebooks = _load_notebooks()


def _load_puzzles():
    """`docs/puzzles.py`: the puzzles' notebooks and pages, made from `refimpl.testing.puzzles`."""
    name = "refimpl_docs_puzzles"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DOCS / "puzzles.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def puzzle_pages() -> tuple[dict[str, str], list[str]]:
    """The puzzles: their pages by site path and their navigation lines; empty when the puzzles are
    not there (a warning, which fails a strict build, when they are there but cannot be imported)."""
    if not (DOCS / "puzzles.py").is_file() or not (PACKAGE / "testing" / "puzzles" / "__init__.py").is_file():
        return {}, []
    try:
        puzzles = _load_puzzles()
        return puzzles.pages(), puzzles.nav_lines()
    except Exception as exc:  # Hypothesis missing, or the package mid-edit
        log.warning("the puzzles' pages could not be made (%r): install the docs extra, which includes "
                    "Hypothesis", exc)
        return {}, []


# ---------------------------------------------------------------------------
# Repository links
# ---------------------------------------------------------------------------

def _mkdocs_config_value(key: str, default: str) -> str:
    """A value of `mkdocs.yml` when running inside a build, else `default`."""
    config = getattr(mkdocs_gen_files, "config", None)
    try:
        value = config[key] if config is not None else None
    except (KeyError, TypeError):
        value = None
    return value or default


def repo_file_url(relpath: str) -> str:
    """The address of a repository file on the repository host (for "view source" links)."""
    repo = _mkdocs_config_value("repo_url", "https://github.com/refimpl/refimpl").rstrip("/")
    return f"{repo}/blob/main/{relpath}"


# ---------------------------------------------------------------------------
# Markdown helpers
# ---------------------------------------------------------------------------

def fence(text: str, lang: str = "") -> str:
    """A fenced code block that survives backticks inside `text`."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}\n"


def normalize_display_math(text: str) -> str:
    r"""Put every `$$...$$` formula in a block of its own, so arithmatex renders it as display math.

    Python-Markdown only sees display math that starts a block. Comments such
    as `# 1. Scores: $$s = \sigma(x W^\top)$$` and docstring lines that end in
    a formula are split into text, a blank line, the formula and a blank line,
    keeping the indentation of list items. Fenced code is left alone.

    The sentence stays whole around its formula: the punctuation that follows
    a formula goes inside the display, as typesetting puts it, so the text
    after it reads on ("$$u = ...$$, in rank order" shows the formula with
    its comma, then "in rank order"), never as a paragraph that opens with
    ", in rank order".
    """
    out: list[str] = []
    in_math = False
    in_code = False
    in_item = False  # after a formula was moved into a list item, its later lines must follow it
    for line in text.split("\n"):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if not indent or re.match(r"([*+-]|\d+\.)\s", stripped):
            in_item = False
        if 0 < len(indent) < 4 and not re.match(r"([*+-]|\d+\.)\s", stripped):
            indent = "    "  # a list item's continuation needs four spaces in Python-Markdown
            if in_item and not in_math and not in_code:
                line = indent + stripped
        if stripped.startswith(("```", "~~~")):
            in_code = not in_code
            out.append(line)
            continue
        if in_code:
            out.append(line)
            continue
        if in_math:
            if "$$" in line:
                head, _, tail = line.partition("$$")
                mark, tail = _leading_punctuation(tail)
                if mark:
                    out.append(f"{head.rstrip()}{mark}" if head.strip() else f"{indent}{mark}")
                    head = ""
                out.append(f"{head.rstrip()}$$" if head.strip() else f"{indent}$$")
                out.append("")
                if tail.strip():
                    out.append(f"{indent}{tail.strip()}")
                in_math = False
            else:
                out.append(line)
            continue
        if "$$" not in line:
            out.append(line)
            continue
        pieces = line.split("$$")
        # Even positions are text, odd positions are formulas; an even count of
        # pieces means the last formula opens here and closes on a later line.
        complete = pieces if len(pieces) % 2 == 1 else pieces[:-1]
        for position, piece in enumerate(complete):
            if position % 2 == 0:
                if piece.strip():
                    out.append(f"{indent}{piece.strip()}")
            else:
                mark = ""
                if position + 1 < len(complete):  # the text after the formula: its punctuation joins it
                    mark, complete[position + 1] = _leading_punctuation(complete[position + 1])
                out += ["", f"{indent}$$", f"{indent}{piece.strip()}{mark}", f"{indent}$$", ""]
                in_item = in_item or bool(indent)
        if len(pieces) % 2 == 0:
            out += ["", f"{indent}$$"]
            if pieces[-1].strip():
                out.append(f"{indent}{pieces[-1].strip()}")
            in_math = True
    return "\n".join(out)


def _leading_punctuation(text: str) -> tuple[str, str]:
    """The punctuation mark that opens `text` (after spaces) and the rest: `", then x"` -> `(",", "then x")`."""
    match = re.match(r"\s*([,;:.])(?!\.)\s*(.*)", text, flags=re.S)
    return (match.group(1), match.group(2)) if match else ("", text)


_NUMPYDOC_ITEM_SECTIONS = {"Parameters", "Other Parameters", "Returns", "Yields", "Receives", "Raises",
                           "Warns", "Attributes", "Methods"}
_NUMPYDOC_SECTIONS = _NUMPYDOC_ITEM_SECTIONS | {"See Also", "Notes", "References", "Examples", "Warnings"}


def numpydoc_to_markdown(doc: str) -> str:
    """Turn numpydoc section headers and items into Markdown.

    `Parameters` underlined with dashes would otherwise become a second-level
    heading, and the indented descriptions code blocks. Items become a bullet
    list (`name` (*type*): description); doctest lines in `Examples` become a
    `pycon` block. Docstrings without sections come back unchanged.
    """
    lines = doc.split("\n")
    out: list[str] = []
    section = ""
    item: list[str] = []
    in_doctest = False

    def flush_item() -> None:
        if item:
            head, *desc = item
            name, sep, kind = head.partition(":")
            text = f"- `{name.strip()}`" if sep or section != "Returns" else f"- *{head.strip()}*"
            if sep and kind.strip():
                text += f" (*{kind.strip()}*)"
            if desc:
                text += ": " + " ".join(d.strip() for d in desc)
            out.append(text)
            item.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        underline = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() in _NUMPYDOC_SECTIONS and re.fullmatch(r"\s*-{3,}\s*", underline):
            flush_item()
            if in_doctest:
                out.append("```")
                in_doctest = False
            section = line.strip()
            out += ["", f"**{section}**", ""]
            i += 2
            continue
        if section in _NUMPYDOC_ITEM_SECTIONS:
            if line.strip() and not line.startswith((" ", "\t")):
                flush_item()
                item.append(line)
            elif line.strip():
                if item:
                    item.append(line)
                else:
                    out.append(line.strip())
            else:
                flush_item()
                out.append("")
        elif section == "Examples":
            if line.lstrip().startswith(">>>") and not in_doctest:
                out.append("```pycon")
                in_doctest = True
            if in_doctest and not line.strip():
                out.append("```")
                in_doctest = False
            out.append(line.strip() if in_doctest else line)
        else:
            out.append(line)
        i += 1
    flush_item()
    if in_doctest:
        out.append("```")
    return "\n".join(out)


def docstring_markdown(doc: str) -> str:
    """A docstring (already dedented) as Markdown prose."""
    return normalize_display_math(numpydoc_to_markdown(doc))


# ---------------------------------------------------------------------------
# Literate rendering of a Python file
# ---------------------------------------------------------------------------

_RULE = re.compile(r"^[-=#~*_+\s]{3,}$")  # a comment that is only a ruler: "# ------"
_BANNER = re.compile(r"^-{2,}\s*(?P<text>[^-].*?)\s*-{2,}$")  # "# -- the paper's symbols -----"
_TOOL_COMMENT = re.compile(r"^#\s*(noqa|type:|fmt:|pragma|ruff:|pyright:|mypy:|!|-\*-)")
_ORDERED_ITEM = re.compile(r"^(\s*)(\d+)\.(\s)")


@dataclass
class _Definition:
    """A function or class whose docstring moves out of the code and into the prose."""

    name: str
    anchor: str  # the heading id, or "" when the definition gets no heading
    level: int  # heading level
    first_line: int  # its first decorator, or the `def` / `class` line
    doc: str  # the docstring, dedented, or "" when it stays in the code
    doc_lines: range  # the lines of the docstring in the source


@dataclass
class LiterateFile:
    """A Python file split into prose and code."""

    title: str  # first line of the module docstring, without the final period
    intro: str  # the rest of the module docstring, as Markdown
    body: str  # the code with its comments and docstrings as prose, as Markdown
    anchors: dict[str, str] = field(default_factory=dict)  # qualified name -> heading id


def _comment_lines(source: str) -> dict[int, str]:
    """Line number -> comment, for every line that holds a comment and nothing else."""
    lines = source.splitlines()
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            if not lines[row - 1][:col].strip():
                found[row] = token.string
    return found


def _definitions(tree: ast.Module, *, test_file: bool) -> list[_Definition]:
    """Every function and class, with the heading it gets and the docstring that moves.

    Public top-level definitions get a third-level heading whose id is their
    name; in a test file the `test_*` methods of `Test*` classes get a
    fourth-level heading with the id `Class-method`, so properties can be
    linked one by one.
    """
    found: list[_Definition] = []

    def visit(nodes: Iterable[ast.stmt], parent: str, depth: int) -> None:
        for node in nodes:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            anchor, level = "", 0
            if depth == 0 and not node.name.startswith("_"):
                anchor, level = node.name, 3
            elif depth == 1 and test_file and parent.startswith("Test") and node.name.startswith("test"):
                anchor, level = f"{parent}-{node.name}", 4
            doc, doc_lines = "", range(0)
            body = node.body
            if (len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str) and body[0].lineno > node.lineno):
                doc = textwrap.dedent(ast.get_docstring(node, clean=True) or "")
                doc_lines = range(body[0].lineno, body[0].end_lineno + 1)
            found.append(_Definition(node.name, anchor, level, first, doc, doc_lines))
            visit(node.body, node.name, depth + 1)

    visit(tree.body, "", 0)
    return found


def _comment_prose(block: list[str]) -> tuple[str, str]:
    """A run of comment lines as ("heading", text) or ("prose", markdown)."""
    texts: list[str] = []
    had_rule = False
    for comment in block:
        body = comment[1:]
        if body.startswith(":"):  # Sphinx-style `#:` attribute comment
            body = body[1:]
        body = body[1:] if body.startswith(" ") else body
        stripped = body.strip()
        if stripped and _RULE.fullmatch(stripped):
            had_rule = True
            continue
        banner = _BANNER.fullmatch(stripped)
        if banner:
            return "heading", banner.group("text")
        texts.append(body.rstrip())
    text = "\n".join(texts).strip("\n")
    if had_rule and text and "\n" not in text:  # one line between rulers is a section's title, however long
        return "heading", text
    text = "\n".join(_ORDERED_ITEM.sub(r"\1\2\\.\3", line) for line in text.split("\n"))
    return "prose", normalize_display_math(text)


def _is_preamble(node: ast.stmt) -> bool:
    """Whether a top-level statement is bookkeeping a reader can skip: an import, `__all__`, a TYPE_CHECKING block."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        return True
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        return True
    if isinstance(node, ast.Try):  # `try: import x / except ImportError: ...`
        return all(isinstance(n, ast.Import | ast.ImportFrom | ast.Pass | ast.Assign) for n in node.body)
    return False


def _is_all_list(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and _is_preamble(node)


def _preamble_lines(tree: ast.Module, lines: list[str]) -> range:
    """The lines of the import block and `__all__` list that open a module, comments between them included."""
    body = list(tree.body)
    start = 1
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        start = body[0].end_lineno + 1
        body = body[1:]
    end = 0
    for node in body:
        if not _is_preamble(node):
            break
        end = node.end_lineno
    return range(start, end + 1) if end else range(0)


def literate(source: str, *, test_file: bool = False, fold_preamble: bool = True) -> LiterateFile:
    """Split a Python source file into a literate Markdown page (pycco / docco style).

    * The module docstring gives the title (its first line) and the intro.
    * With `fold_preamble`, the imports and the `__all__` list that open the
      file are not shown first: they follow the code, folded, so the page goes
      from the essay straight to the first idea.
    * A comment on a line of its own is prose between code blocks; a comment
      after code on the same line stays in the code. A comment that is a ruler
      with a short title (or `# -- title ---`) becomes a section heading.
    * A function's or class's docstring is prose placed before its code, under
      a heading for public top-level names (and for tests, so they can be linked).
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    comments = _comment_lines(source)

    title, intro, skip = "", "", set()
    module_doc = ast.get_docstring(tree, clean=True)
    if module_doc is not None:
        first, _, rest = module_doc.partition("\n")
        title = first.strip().rstrip(".")
        intro = docstring_markdown(rest.strip("\n"))
        node = tree.body[0]
        skip.update(range(node.lineno, node.end_lineno + 1))

    preamble = ""
    if fold_preamble:
        folded = _preamble_lines(tree, lines)
        pieces = ["\n".join(lines[i - 1] for i in folded).strip("\n")]
        skip.update(folded)
        for node in tree.body:  # an `__all__` list further down (after a type alias, say) is folded too
            if _is_all_list(node) and node.lineno not in folded:
                pieces.append("\n".join(lines[node.lineno - 1: node.end_lineno]))
                skip.update(range(node.lineno, node.end_lineno + 1))
        preamble = "\n\n".join(p for p in pieces if p)

    definitions = _definitions(tree, test_file=test_file)
    starts: dict[int, list[_Definition]] = {}
    used_ids: set[str] = set()
    anchors: dict[str, str] = {}
    for definition in definitions:
        skip.update(definition.doc_lines)
        if definition.anchor in used_ids:  # an @overload repeated, say: one heading only
            definition.anchor = ""
        if definition.anchor:
            used_ids.add(definition.anchor)
            anchors[definition.anchor.replace("-", ".")] = definition.anchor
        if definition.anchor or definition.doc:  # only these interrupt the code
            starts.setdefault(definition.first_line, []).append(definition)

    items: list[tuple[str, str]] = []  # (kind, text): kind is "code", "prose" or "heading"
    code: list[str] = []
    pending: list[str] = []  # comment lines not yet turned into prose
    pending_end = 0

    def flush_code() -> None:
        while code and not code[-1].strip():
            code.pop()
        while code and not code[0].strip():
            code.pop(0)
        if code:
            items.append(("code", "\n".join(code)))
        code.clear()

    def flush_comments() -> None:
        if pending:
            flush_code()
            items.append(_comment_prose(pending))
            pending.clear()

    for lineno, line in enumerate(lines, start=1):
        if lineno in starts:
            attached = pending_end == lineno - 1 and bool(pending)
            held = list(pending) if attached else []
            if attached:
                pending.clear()
            flush_comments()
            flush_code()
            for definition in starts[lineno]:
                if definition.anchor:
                    hashes = "#" * definition.level
                    label = definition.anchor.replace("-", ".")
                    items.append(("heading-raw", f"{hashes} `{label}` {{ #{definition.anchor} }}"))
                if held:
                    items.append(_comment_prose(held))
                    held = []
                if definition.doc:
                    items.append(("prose", docstring_markdown(definition.doc)))
        if lineno in skip:
            continue
        if lineno in comments:
            if _TOOL_COMMENT.match(comments[lineno]):
                continue
            pending.append(comments[lineno])
            pending_end = lineno
            continue
        if pending and not line.strip():
            pending.append("#")  # a blank line inside a comment run: a paragraph break
            continue
        flush_comments()
        code.append(line)
    flush_comments()
    flush_code()

    parts: list[str] = []
    for kind, text in items:
        if kind == "code":
            parts.append(fence(text, "python"))
        elif kind == "heading":
            parts.append(f"## {text[:1].upper()}{text[1:]}\n")
        elif kind == "heading-raw":
            parts.append(text + "\n")
        else:
            parts.append(text.strip("\n") + "\n")
    if preamble:
        parts.append('??? note "The imports and exports this file opens with"\n\n'
                     + textwrap.indent(fence(preamble, "python"), "    "))
    return LiterateFile(title=title, intro=intro, body="\n".join(parts), anchors=anchors)


# ---------------------------------------------------------------------------
# The package: modules, their tests and their examples
# ---------------------------------------------------------------------------

@dataclass
class Module:
    """A module (or package) of `refimpl/` and the pages made from it."""

    name: str  # "latent_moe", "testing", "xp"
    files: list[Path]  # the module file, or a package's `__init__.py` then its submodules
    package: str = ""  # the package a module of a split package lives in ("layer" for "latent_moe")

    @property
    def slug(self) -> str:
        return self.name.lstrip("_")

    @property
    def dotted(self) -> str:
        return f"refimpl.{self.package + '.' if self.package else ''}{self.name}"


def discover_modules() -> dict[str, Module]:
    """Every module and subpackage of `refimpl/`, by name."""
    found: dict[str, Module] = {}
    if not PACKAGE.is_dir():
        return found
    for path in sorted(PACKAGE.iterdir()):
        if path.suffix == ".py" and path.stem != "__init__":
            found[path.stem] = Module(path.stem, [path])
        elif path.is_dir() and (path / "__init__.py").is_file():
            apart = OWN_PAGES.get(path.name, ())
            subs = sorted(p for p in path.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts
                          and p.relative_to(path).parts[0] not in apart)
            if path.name not in SPLIT_PACKAGES:
                found[path.name] = Module(path.name, [path / "__init__.py", *subs])
                continue
            opener = [p for p in subs if p.stem == ROOM_OPENERS.get(path.name)]
            found[path.name] = Module(path.name, [path / "__init__.py", *opener])
            for sub in subs:
                if sub in opener:
                    continue
                if sub.stem in found or sub.stem.lstrip("_") in {m.lstrip("_") for m in found}:
                    log.warning("refimpl/%s/%s.py: a page of that name exists already", path.name, sub.stem)
                    continue
                found[sub.stem] = Module(sub.stem, [sub], package=path.name)
    return found


def page_of(dotted: str, name: str | None = None) -> str:
    """The page that shows `name` of the module `refimpl.<dotted>` (or the module itself): the module's page in
    a split package, following a package's re-exports to the module that defines the name."""
    parts = dotted.split(".")
    if parts[0] not in SPLIT_PACKAGES:
        return parts[0]
    if len(parts) > 1:
        return parts[0] if ROOM_OPENERS.get(parts[0]) == parts[1] else parts[1]
    init = PACKAGE / parts[0] / "__init__.py"
    if name is not None and init.is_file():
        for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module \
                    and any((alias.asname or alias.name) == name for alias in node.names):
                return page_of(f"{parts[0]}.{node.module.split('.')[0]}")
    return parts[0]


def public_names(path: Path) -> list[str]:
    """The names a module exports: its `__all__` when it is a literal, else its public definitions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                try:
                    return [str(name) for name in ast.literal_eval(node.value)]
                except ValueError:
                    break
    return [node.name for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and not node.name.startswith("_")]


def reexports() -> dict[str, str]:
    """Name -> module for every name `refimpl/__init__.py` imports from a submodule."""
    init = PACKAGE / "__init__.py"
    found: dict[str, str] = {}
    if not init.is_file():
        return found
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                found[alias.asname or alias.name] = page_of(node.module, alias.name)
    return found


def modules_used(source: str, exported: dict[str, str]) -> set[str]:
    """The `refimpl` modules a script uses, from its imports and its `refimpl.<name>` attributes."""
    used: set[str] = set()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return used
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "refimpl":
                used.update(exported.get(alias.name, alias.name) for alias in node.names)
            elif node.module.startswith("refimpl."):
                used.update(page_of(node.module[len("refimpl."):], alias.name) for alias in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "refimpl":
            used.add(exported.get(node.attr, node.attr))
    return used


@dataclass
class PropertyTest:
    """One test function: its qualified name, its anchor on the test page and its first docstring line."""

    qualname: str
    anchor: str
    summary: str


def tests_of_module(module: str) -> list[Path]:
    """The test files of a module: `tests/test_<module>.py` and `tests/test_<module>_*.py`."""
    slug = TEST_STEMS.get(module, module).lstrip("_")
    return sorted({*TESTS.glob(f"test_{slug}.py"), *TESTS.glob(f"test_{slug}_*.py")})


def cases_in(path: Path) -> list[PropertyTest]:
    """The tests a file defines, in source order, each with a one-line summary."""

    def summary(node: ast.AST, name: str) -> str:
        doc = ast.get_docstring(node) or ""
        first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if first:
            return first
        words = name.removeprefix("test_").replace("_", " ")
        return words[:1].upper() + words[1:]

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except SyntaxError:
        return []
    cases: list[PropertyTest] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            cases.append(PropertyTest(node.name, node.name, summary(node, node.name)))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for method in node.body:
                if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) and method.name.startswith("test"):
                    cases.append(PropertyTest(f"{node.name}.{method.name}", f"{node.name}-{method.name}",
                                          summary(method, method.name)))
    return cases


# ---------------------------------------------------------------------------
# Examples: rendered from their records, never run here
# ---------------------------------------------------------------------------

@dataclass
class Figure:
    """A figure of an example's record: the PNG, and what the example says about it."""

    name: str
    data: bytes
    caption: str
    alt: str
    width: int
    height: int


@dataclass
class Record:
    """The recorded run of one example: its executed notebook `examples/NN_slug.ipynb`, read."""

    notebook: str  # the notebook's JSON text, served for download as it is
    cells: list[dict]  # the notebook's cells
    figures: dict[str, Figure] = field(default_factory=dict)

    @property
    def stdout(self) -> str:
        """Everything the cells printed, in order: what the script prints when run as a whole."""
        return "".join(_stream(cell) for cell in self.cells if cell.get("cell_type") == "code")


def _text(value: str | list[str]) -> str:
    return "".join(value) if isinstance(value, list) else value


def _stream(cell: dict, name: str = "stdout") -> str:
    return "".join(_text(o.get("text", "")) for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == name)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of PNG data, from its header (0, 0 for anything else)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return 0, 0
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def read_record(script: Path) -> Record | None:
    """The record of `examples/NN_slug.py`, or None (with a warning, which fails a strict build) when it is
    missing or not a notebook."""
    path = script.with_suffix(".ipynb")
    where = path.relative_to(ROOT).as_posix()
    if not path.is_file():
        log.warning("%s has no record %s: run `%s` (or `python docs/notebooks.py record %s`)", script.name, where,
                    notebooks.REFRESH, script.stem)
        return None
    text = path.read_text(encoding="utf-8")
    try:
        cells = json.loads(text)["cells"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        log.warning("%s is not a notebook (%s): refresh it with `%s`", where, exc, notebooks.REFRESH)
        return None
    record = Record(text, cells)
    for cell in cells:
        for output in cell.get("outputs", []):
            meta = (output.get("metadata") or {}).get("refimpl") or {}
            png = (output.get("data") or {}).get("image/png")
            if png and meta.get("filename"):
                data = base64.b64decode(_text(png))
                record.figures[meta["filename"]] = Figure(meta["filename"], data, meta.get("caption", ""),
                                                          meta.get("alt", ""), *png_size(data))
    return record


def example_title(path: Path) -> tuple[str, str, str]:
    """An example's page title, its intro (the rest of its docstring) and its source without the docstring."""
    source = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return path.stem, "", source
    doc = ast.get_docstring(tree, clean=True)
    if doc is None:
        return path.stem.replace("_", " "), "", source
    first, _, rest = doc.partition("\n")
    node = tree.body[0]
    lines = source.splitlines()
    code = "\n".join(lines[: node.lineno - 1] + lines[node.end_lineno:]).strip("\n")
    return first.strip().rstrip("."), docstring_markdown(rest.strip("\n")), code


def nav_label(path: Path, title: str) -> str:
    """The short label of an example in the navigation: `NN Label`."""
    label = NAV_LABELS.get(path.stem)
    if label is None:
        label = title.split(":")[0].strip()
        if len(label) > 34:
            label = label.split(", ")[0]
        while len(label) > 34 and " " in label:
            label = label.rsplit(" ", 1)[0]
    return f"{path.stem[:2]} {label}"


def figure_markdown(figure: Figure, src: str) -> str:
    """A figure with its caption, as the site shows it (Markdown inside HTML, by `md_in_html`)."""
    alt = figure.alt.replace('"', "'").replace("[", "(").replace("]", ")")
    size = f'{{ width="{figure.width}" height="{figure.height}" }}' if figure.width else ""
    return (f'<figure class="refimpl-figure" markdown="span">\n'
            f"  ![{alt}]({src}){size}\n"
            f"  <figcaption>{html.escape(figure.caption)}</figcaption>\n"
            f"</figure>\n")


def _defines_only(source: str) -> list[str]:
    """The names a code cell defines when it only defines functions and classes (else an empty list)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        else:
            return []
    return names


def _fold(title: str, body: str, kind: str = "note") -> str:
    """A collapsed block: the reader opens it to read `body`."""
    return f'??? {kind} "{title}"\n\n' + textwrap.indent(body.strip("\n") + "\n", "    ") + "\n"


#: Printed output longer than this many lines is shown in a box of its own height that scrolls, its long lines
#: wrapped: a page stays readable past it, and no line is cut at the right edge (`refimpl-output--long`).
LONG_OUTPUT_LINES = 80


def output_markdown(text: str) -> str:
    """What a cell printed, set apart from its code; a long output in a box that scrolls, saying how long."""
    lines = text.rstrip("\n").count("\n") + 1
    if lines <= LONG_OUTPUT_LINES:
        return '<div class="refimpl-output" markdown>\n\n' + fence(text, "text") + "\n</div>\n"
    return (f'<div class="refimpl-output refimpl-output--long" markdown>\n\n'
            f"<small>It printed {lines} lines; the box scrolls, and long lines wrap.</small>\n\n"
            + fence(text, "text") + "\n</div>\n")


def cell_markdown(cell: dict, stem: str, figures: dict[str, Figure]) -> str:
    """One notebook cell as page Markdown: prose, or code followed by what it printed and drew."""
    source = _text(cell.get("source", ""))
    if cell.get("cell_type") == "markdown":
        # A step's heading sits under the page's "The run, step by step": one level down.
        return normalize_display_math(re.sub(r"^(#{2,5}) ", r"#\1 ", source, flags=re.M)) + "\n"
    if cell.get("cell_type") != "code" or not source.strip():
        return ""
    outputs = cell.get("outputs", [])
    defined = _defines_only(source)
    if defined and not outputs:
        names = ", ".join(f"`{name}`" for name in defined)
        return _fold(f"Defines {names}", fence(source, "python"), "abstract")
    parts = [fence(source, "python")]
    printed = _stream(cell)
    if printed.strip():
        parts.append(output_markdown(printed))
    for output in outputs:
        meta = (output.get("metadata") or {}).get("refimpl") or {}
        if meta.get("filename") in figures:
            parts.append(figure_markdown(figures[meta["filename"]], f"{stem}/{meta['filename']}"))
        elif output.get("output_type") == "execute_result" and not meta:
            value = _text((output.get("data") or {}).get("text/plain", ""))
            if value.strip():
                parts.append(output_markdown(value))
        elif output.get("output_type") == "error":
            parts.append("!!! failure \"This cell raised an error when the record was made\"\n\n"
                         + textwrap.indent(fence(f"{output.get('ename')}: {output.get('evalue')}", "text"), "    "))
    return "\n".join(parts)


def example_page(path: Path, record: Record | None) -> str:
    """The Markdown of one example's page, rendered from its record: intro, cells with outputs, source."""
    title, intro, code = example_title(path)
    rel = f"examples/{path.name}"
    parts = [f"# {title}\n", intro + "\n" if intro else ""]
    if record is not None:
        parts.append(f"[Download as notebook]({path.stem}.ipynb){{ .md-button download='{path.stem}.ipynb' }} "
                     f"`{path.stem}.ipynb` holds the cells below with their outputs. It runs in any folder, in a "
                     "Jupyter kernel where refimpl is installed with the extra that draws the figures "
                     "(no release is on the package index yet: `pip install \"refimpl[examples] @ "
                     "git+https://github.com/refimpl/refimpl\"`, or `pip install \"./refimpl[examples]\"` "
                     "next to a clone).\n")
    parts.append(f"As a script: `python {rel}` prints the same, and `--out DIR` saves the figures as PNG files "
                 f"([`{rel}` on the repository]({repo_file_url(rel)})).\n")
    if record is None:
        parts.append(f'!!! failure "No recorded run"\n\n    `{rel}` has no record yet: run '
                     f"`{notebooks.REFRESH}`.\n")
    else:
        parts.append('## The run, step by step { #the-run }\n')
        cells = [c for c in record.cells if (c.get("metadata") or {}).get("refimpl") != "note"]
        if cells and cells[0].get("cell_type") == "markdown" and _text(cells[0]["source"]).startswith("# "):
            cells = cells[1:]  # the title and intro, shown above
        parts += [cell_markdown(cell, path.stem, record.figures) for cell in cells]
    parts += ["## Source\n", _fold(f"The whole script, {rel}", fence(code, "python"), "abstract")]
    return "\n".join(p for p in parts if p)


# ---------------------------------------------------------------------------
# Benchmark tables
# ---------------------------------------------------------------------------

def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | dict):
        return "`" + json.dumps(value)[:80] + "`"
    return str(value).replace("|", "\\|").replace("\n", " ")


def json_to_markdown(data: object, level: int = 3) -> str:
    """Render benchmark JSON as tables: scalars as a key/value table, lists of records as a table."""
    if isinstance(data, list):
        if data and all(isinstance(row, dict) for row in data):
            keys: list[str] = []
            for row in data:
                keys += [k for k in row if k not in keys]
            lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in data]
            return "\n".join(lines) + "\n"
        return fence(json.dumps(data, indent=2), "json")
    if not isinstance(data, dict):
        return f"{_cell(data)}\n"
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict | list)}
    parts: list[str] = []
    if scalars:
        lines = ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in scalars.items()]
        parts.append("\n".join(lines) + "\n")
    for key, value in data.items():
        if isinstance(value, dict | list):
            parts.append(f"{'#' * level} {key}\n")
            parts.append(json_to_markdown(value, min(level + 1, 6)))
    return "\n".join(parts)


#: The records of this build, by script name (filled by `main` before any page is written).
RECORDS: dict[str, Record] = {}


def hand_written(path: Path, prefix: str = "../") -> str:
    """A hand-written page or fragment, with its markers expanded (`prefix` leads from the page to the site root)."""
    return expand_markers(path.read_text(encoding="utf-8"), RECORDS, str(path.relative_to(ROOT)), prefix)


def output_block(text: str, words: str) -> str | None:
    """The block of printed `text` that starts at the line beginning with `words` and ends before the next
    rule of `=` (or at the end); None when no line begins so. A starting line that is a title (a rule of `=`
    under it) is left out, with its rule. A title wins over an earlier line that merely starts with the same
    words (a row of a summary table printed first), so each entry's block is its own report."""
    lines = text.split("\n")
    rule = re.compile(r"={10,}")
    starts = [i for i, line in enumerate(lines) if line.startswith(words)]
    titles = [i for i in starts if i + 1 < len(lines) and rule.fullmatch(lines[i + 1].strip())]
    start = (titles or starts or [None])[0]
    if start is None:
        return None
    if start + 1 < len(lines) and rule.fullmatch(lines[start + 1].strip()):
        start += 2
    end = start
    while end < len(lines) and not rule.fullmatch(lines[end].strip()):
        end += 1
    return "\n".join(lines[start:end]).strip("\n")


def expand_markers(text: str, records: dict[str, Record], where: str, prefix: str = "../") -> str:
    """Replace the markers of a hand-written page by what they name (see `_MARKER`)."""

    def replace(match: re.Match) -> str:
        kind, arg, words = match.group("kind"), match.group("arg") or "", match.group("words")
        if kind == "report-card":
            return report_card_markdown()
        stem, _, name = arg.partition("/")
        record = records.get(stem)
        if record is None:
            log.warning("%s: %s names no recorded example (%s)", where, match.group(0), stem)
            return ""
        if kind == "example-output":
            return fence(record.stdout or "(no output)", "text")
        if kind == "example-figure":
            if name not in record.figures:
                log.warning("%s: %s names no figure of %s (it has %s)", where, match.group(0), stem,
                            ", ".join(record.figures) or "none")
                return ""
            return figure_markdown(record.figures[name], f"{prefix}examples/{stem}/{name}")
        block = output_block(record.stdout, words or "")
        if block is None:
            log.warning("%s: %s: no line of what %s printed starts with %r", where, match.group(0), stem, words)
            return ""
        return fence(block, "text")

    def indented(match: re.Match) -> str:
        # A marker indented on its line (inside a list item or a folded block) keeps its block there.
        line_start = text.rfind("\n", 0, match.start()) + 1
        indent = text[line_start: match.start()]
        result = replace(match)
        if indent and not indent.strip():
            result = textwrap.indent(result, indent)[len(indent):]
        return result

    return _MARKER.sub(indented, text)


def report_card_markdown() -> str:
    """The MoE report card, computed by the package (`refimpl.studies.report_card.report_card()`)."""
    try:
        from refimpl.studies.report_card import report_card
    except Exception as exc:  # the package is mid-edit or not installed
        log.warning("cannot import refimpl.studies.report_card to build the report card: %r", exc)
        return "*(The report card could not be computed for this build.)*\n"
    return report_card().strip() + "\n"


# ---------------------------------------------------------------------------
# Benchmark results: one plot per benchmark, then the recorded tables
# ---------------------------------------------------------------------------

def _timing(record: dict, scale: float = 1.0) -> tuple[float, float, float]:
    """Median, fastest and slowest of a timing record `{median_s, best_s, worst_s}`, times `scale`."""
    return (record["median_s"] * scale, record.get("best_s", record["median_s"]) * scale,
            record.get("worst_s", record["median_s"]) * scale)


def _bar_figure(rows: list[tuple[str, float, float, float]], xlabel: str, log_scale: bool = False) -> bytes:
    """Horizontal bars (label, median, low, high), the range as an error bar; PNG data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 0.3 * len(rows) + 1.1), constrained_layout=True)
    labels = [r[0] for r in rows]
    middle = np.array([r[1] for r in rows])
    error = [middle - np.array([r[2] for r in rows]), np.array([r[3] for r in rows]) - middle]
    ax.barh(range(len(rows)), middle, xerr=error, color="#3f51b5", ecolor="0.3", capsize=3)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    if log_scale:
        ax.set_xscale("log")
    for position, value in enumerate(middle):
        ax.text(value, position, f"  {value:.3g}", va="center", fontsize=8)
    ax.margins(x=0.15)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def benchmark_plot(stem: str, data: dict) -> tuple[bytes, str, str] | None:
    """The one plot of a benchmark's JSON: (PNG, caption, alt text), or None for a benchmark without one."""
    if stem == "forward" and "stages" in data:
        rows = [(name, *_timing(t, 1e3)) for name, t in data["stages"].items()]
        return (_bar_figure(rows, "milliseconds (median; bar: fastest to slowest run)"),
                "Where the time of one forward pass of the K3-shaped layer goes on this CPU, stage by stage.",
                "Horizontal bars of the median time of each stage of the forward pass, in milliseconds")
    if stem == "backward" and "timings" in data:
        rows = [(name.replace("_", " "), *_timing(t)) for name, t in data["timings"].items()]
        return (_bar_figure(rows, "seconds (median; bar: fastest to slowest run)"),
                "The time of the forward pass and of a whole training step (forward and backward) of each "
                "implementation measured.",
                "Horizontal bars of the median seconds of the forward pass and of the training step per "
                "implementation")
    if stem == "balancing" and data.get("lp"):
        rows = []
        for r in data["lp"]:
            size = f"m = {r['m']}, n = {r['n']}, k = {r['k']}"
            rows += [(f"{size}: HiGHS", r["seconds"], r["seconds"], r["seconds"]),
                     (f"{size}: Eq. (14) iterated", r["cd_seconds"], r["cd_seconds"], r["cd_seconds"])]
        return (_bar_figure(rows, "seconds (log scale)", log_scale=True),
                "Solving the balanced-assignment LP with HiGHS, and iterating Eq. (14) on the same batch, at "
                "each size measured (log scale).",
                "Horizontal bars on a log scale of the seconds HiGHS and iterated Eq. (14) take, at four "
                "problem sizes")
    if stem == "checkpoint" and "timings" in data:
        rows = [(name, *_timing(t)) for name, t in data["timings"].items()]
        return (_bar_figure(rows, "seconds (median; bar: fastest to slowest run)"),
                "One forward pass of a layer at K3's widths (16 experts, 512 tokens), its experts held as "
                "float32 arrays, kept packed in MXFP4, and packed with MXFP8 inputs.",
                "Horizontal bars of the median seconds of the forward pass for each way of holding the experts")
    if stem == "expert_parallel" and data.get("runs"):
        rows = [(f"{ranks} rank{'s' if int(ranks) > 1 else ''}: {row['case']}", row["step_ms"],
                 row.get("best_ms", row["step_ms"]), row["step_ms"])
                for ranks, run in data["runs"].items() for row in run["rows"]]
        return (_bar_figure(rows, "milliseconds per ep_forward step (median; bar from the fastest)"),
                "One ep_forward step under mpiexec with 1, 2 and 4 ranks, for the zero bias, the sign rule and "
                "Quantile Balancing.",
                "Horizontal bars of the median step time in milliseconds, grouped by the number of ranks, one "
                "bar per bias")
    if stem == "gpu" and isinstance(data.get("k3"), dict) and data["k3"].get("stages"):
        rows = [(name, *_timing(stage["timing"], 1e3)) for name, stage in data["k3"]["stages"].items()
                if isinstance(stage, dict) and "timing" in stage]
        return (_bar_figure(rows, "milliseconds on the GPU (median; bar: fastest to slowest run)"),
                "The K3 layer on one GPU, stage by stage: where the time of one forward pass goes.",
                "Horizontal bars of the median milliseconds of each stage of the K3 layer on the GPU")
    if stem == "histogram" and isinstance(data.get("wall_seconds"), dict):
        rows = [(name, value, value, value) for name, value in data["wall_seconds"].items()]
        return (_bar_figure(rows, "seconds of wall time"),
                "The wall time of each pass of the histogram estimator at scale, from generating the scores "
                "to reading the new bias out of the summed counts.",
                "Horizontal bars of the wall seconds of each pass of the histogram estimator")
    if stem == "torch_compare" and isinstance(data.get("forward"), dict) and data["forward"].get("timings"):
        rows = [(f"forward: {name.replace('_', ' ')}", *_timing(t)) for name, t in data["forward"]["timings"].items()]
        rows += [(f"balancing: {name.replace('_', ' ')}", *_timing(t))
                 for name, t in (data.get("balancing") or {}).get("timings", {}).items()]
        return (_bar_figure(rows, "seconds (median; bar: fastest to slowest run)"),
                "NumPy against PyTorch on the same CPU: the forward pass and the balancing update.",
                "Horizontal bars of the median seconds of the forward pass and of the balancing update in "
                "NumPy and in PyTorch")
    if stem == "train" and isinstance(data.get("runs"), dict):
        rows = [(name, run["tokens_per_second"], run["tokens_per_second"], run["tokens_per_second"])
                for name, run in data["runs"].items()]
        return (_bar_figure(rows, "tokens per second"),
                "Training throughput of the small model with one and with two BLAS threads on this machine.",
                "Horizontal bars of the tokens trained per second with one and with two BLAS threads")
    return None


def benchmark_title(path: Path) -> str:
    """A benchmark's heading: the title its `.md` record opens with, or its file name in words."""
    record = path.with_suffix(".md")
    if record.is_file():
        for line in record.read_text(encoding="utf-8").splitlines():
            if line.startswith("# "):
                return line[2:].strip()
    return path.stem.replace("_", " ").capitalize()


def benchmarks_page() -> tuple[str, dict[str, bytes]]:
    """The benchmark results page (a plot per benchmark first, the tables after) and the images it shows."""
    folder = DOCS / "benchmarks"
    parts = ["# Benchmark results\n",
             "The numbers below were measured by the scripts in `benchmarks/` (run them with `make bench`), "
             "which save their results under `docs/benchmarks/`. Each section says on which machine and when "
             "it was measured; nothing here is typed by hand. First one plot per benchmark, drawn from its "
             "JSON file when this site was built, then the full results.\n"]
    images: dict[str, bytes] = {}
    files = sorted(folder.glob("*")) if folder.is_dir() else []
    plots: list[str] = []
    for path in (p for p in files if p.suffix == ".json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            drawn = benchmark_plot(path.stem, data) if isinstance(data, dict) else None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            log.warning("docs/benchmarks/%s: no plot (%s: %s)", path.name, type(exc).__name__, exc)
            continue
        if drawn is None:
            continue
        png, caption, alt = drawn
        name = f"{path.stem}.png"
        images[name] = png
        date = (data.get("machine") or {}).get("date", "")
        figure = Figure(name, png, f"{caption} (From docs/benchmarks/{path.name}{', ' + date if date else ''}.)",
                        alt, *png_size(png))
        plots += [f"### {benchmark_title(path)}\n", figure_markdown(figure, name)]
    if plots:
        parts += ["## At a glance\n"] + plots + ["## The recorded results\n"]
    # A benchmark that wrote both `<name>.md` (for people) and `<name>.json` (for tools) shows the first.
    stems_with_md = {p.stem for p in files if p.suffix == ".md"}
    results = [p for p in files if p.suffix == ".md" or (p.suffix == ".json" and p.stem not in stems_with_md)]
    if not results:
        parts.append("!!! note \"No results recorded yet\"\n    Run `make bench` to measure and record them.\n")
    for path in results:
        if path.suffix == ".md":
            text = path.read_text(encoding="utf-8")
            text = re.sub(r"^(#{1,4}) ", lambda m: "##" + m.group(1) + " ", text, flags=re.M)  # demote headings
            text = re.sub(r"^\| load average[^\n]*\n", "", text, flags=re.M)  # the host's load says nothing to a reader
            parts.append(text.strip() + "\n")
        else:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                log.warning("docs/benchmarks/%s is not valid JSON: %s", path.name, exc)
                continue
            name = data.get("title") or data.get("name") or path.stem if isinstance(data, dict) else path.stem
            parts.append(f"### {name}\n")
            parts.append(f"From `docs/benchmarks/{path.name}`.\n")
            parts.append(json_to_markdown(data, level=4))
    for path in files:
        if path.suffix.lower() in {".png", ".svg"}:
            images[path.name] = path.read_bytes()
    fragment = DOCS / "sections" / "benchmarks.md"
    if fragment.is_file():
        parts.append(hand_written(fragment).strip() + "\n")
    return "\n".join(parts), images


# ---------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------

def write(path: str, text: str, edit: str | None = None) -> None:
    """Write a generated page; `edit` is the repository file its edit button should open."""
    with mkdocs_gen_files.open(path, "w") as handle:
        handle.write(text)
    if edit:
        mkdocs_gen_files.set_edit_path(path, f"../{edit}")


#: A fragment that holds this marker opens its module's page, with the module's essay where the marker stands.
MODULE_DOC_MARKER = "<!-- refimpl:module-docstring -->"


def module_page(module: Module, examples: list[tuple[Path, str]], tests: dict[Path, list[PropertyTest]]) -> str:
    """The literate page of a module: prose, code, tested properties, examples and the fragment.

    When the module's fragment holds `MODULE_DOC_MARKER`, the page is the fragment with the essay in it,
    then the tested properties, the examples, a summary of the API and the source, folded.
    """
    main = literate(module.files[0].read_text(encoding="utf-8"))
    rel = module.files[0].relative_to(ROOT).as_posix()
    title = main.title or module.dotted
    links = [f"[`{rel}`]({repo_file_url(rel)})", f"[API reference](../reference/{module.slug}.md)"]
    links += [f"[`tests/{p.name}`](../tests/{p.stem}.md)" for p in tests]
    fragment = DOCS / "sections" / f"{module.slug}.md"
    text = hand_written(fragment).strip() + "\n" if fragment.is_file() else ""
    if MODULE_DOC_MARKER in text:
        return usage_first_page(module, title, links, text.replace(MODULE_DOC_MARKER, main.intro), examples, tests)
    intro, linked = linked_module_table(module, main.intro)
    parts = [f"# {title}\n", f"<small>Source: {' · '.join(links)}</small>\n", intro + "\n", main.body]
    for sub in module.files[1:]:
        part = literate(sub.read_text(encoding="utf-8"))
        subrel = sub.relative_to(ROOT).as_posix()
        parts += [f"## `{subrel}` {{ #file-{sub.stem.lstrip('_')} }}\n", f"**{part.title}.**\n" if part.title else "",
                  part.intro + "\n", re.sub(r"^(#{2,5}) ", r"#\1 ", part.body, flags=re.M)]
    if module.name in SPLIT_PACKAGES and not module.package and not linked:
        subs = sorted(p for p in (PACKAGE / module.name).glob("*.py")
                      if p.stem not in ("__init__", ROOM_OPENERS.get(module.name)))
        parts.append("## Its modules\n")
        parts.append("\n".join(f"- [`{module.dotted}.{s.stem}`]({s.stem.lstrip('_')}.md): "
                               f"{(ast.get_docstring(ast.parse(s.read_text(encoding='utf-8'))) or '').split(chr(10))[0]}"
                               for s in subs) + "\n")
    parts += properties_and_examples(tests, examples)
    if text:
        parts.append(text)
    return "\n".join(parts)


def linked_module_table(module: Module, intro: str) -> tuple[str, bool]:
    """A package's essay with its table of modules linked, and whether every module of the package is in it.

    A row that opens with a module's dotted name in code quotes (`| `refimpl.layer.routing` | ... |`) links
    it: to the module's own page in a split package, else to the module's part of this page (`#file-<stem>`).
    A package whose table links all its modules needs no second list of them ("Its modules").
    """
    if module.package or len(module.files[0].parts) < 2 or module.files[0].name != "__init__.py":
        return intro, False
    folder = module.files[0].parent
    subs = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    on_this_page = {p.stem for p in module.files[1:]}
    seen: set[str] = set()

    def link(match: re.Match) -> str:
        stem = match.group("stem")
        if stem not in subs:
            return match.group(0)
        seen.add(stem)
        target = f"#file-{stem.lstrip('_')}" if stem in on_this_page else f"{stem.lstrip('_')}.md"
        return f"| [`{module.dotted}.{stem}`]({target}) |"

    row = re.compile(rf"^\| `{re.escape(module.dotted)}\.(?P<stem>\w+)` \|", flags=re.M)
    return row.sub(link, intro), bool(subs) and subs <= seen


def properties_and_examples(tests: dict[Path, list[PropertyTest]], examples: list[tuple[Path, str]],
                            folded: bool = False) -> list[str]:
    """The "Properties the tests check" and "Worked examples using this module" sections of a module page."""
    parts: list[str] = []
    if tests:
        parts.append("## Properties the tests check\n")
        lists = []
        for path, cases in tests.items():
            lists.append(f"From [`tests/{path.name}`](../tests/{path.stem}.md) "
                         f"([on the repository]({repo_file_url('tests/' + path.name)})):\n")
            lists.append("\n".join(f"- [{case.summary}](../tests/{path.stem}.md#{case.anchor})"
                                   f" (`{case.qualname}`)" for case in cases) + "\n")
        count = sum(len(cases) for cases in tests.values())
        parts.append(_fold(f"The {count} tests, each linked to its code", "\n".join(lists)) if folded
                     else "\n".join(lists))
    if examples:
        parts.append("## Worked examples using this module\n")
        parts.append("\n".join(f"- [{title}](../examples/{path.stem}.md)" for path, title in examples) + "\n")
    return parts


def _docstring_summary(files: list[Path], name: str) -> str:
    """What one exported name is, in one line: its docstring's first paragraph, the `#:` comment above a
    constant, or a submodule's title."""
    for path in files:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
                doc = ast.get_docstring(node) or ""
                return doc.strip().split("\n\n")[0].replace("\n", " ")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                comments, row = [], node.lineno - 2
                while row >= 0 and lines[row].strip().startswith("#:"):
                    comments.insert(0, lines[row].strip()[2:].strip())
                    row -= 1
                if comments:
                    return " ".join(comments)
    sub = next((p for p in files if p.stem == name), None)
    if sub is not None:
        return (ast.get_docstring(ast.parse(sub.read_text(encoding="utf-8"))) or "").split("\n")[0]
    return ""


def usage_first_page(module: Module, title: str, links: list[str], text: str, examples: list[tuple[Path, str]],
                     tests: dict[Path, list[PropertyTest]]) -> str:
    """A page that opens with how to use the module (its fragment) and ends with its reference and source."""
    parts = [f"# {title}\n", f"<small>Source: {' · '.join(links)}</small>\n", text]
    parts += properties_and_examples(tests, examples, folded=True)
    names = public_names(module.files[0])
    if names:
        parts.append("## API reference\n")
        parts.append(f"Everything `{module.dotted}` exports; [the reference page](../reference/{module.slug}.md) "
                     "has every parameter.\n")
        rows = []
        for name in names:
            summary = _docstring_summary(module.files, name)
            rows.append(f"- [`{name}`](../reference/{module.slug}.md#{module.dotted}.{name})"
                        + (f": {summary}" if summary else ""))
        parts.append("\n".join(rows) + "\n")
    parts.append("## The source\n")
    parts.append(f"The code of `{module.dotted}`, file by file. Each file's essay is its module docstring.\n")
    for path in module.files:
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(source)) or ""
        label = f"`{rel}`: {doc.split(chr(10))[0].rstrip('.')}" if doc else f"`{rel}`"
        parts.append(_fold(label.replace('"', "'"), fence(source, "python"), "abstract"))
    return "\n".join(parts)


def reference_page(module: Module, extra_names: Iterable[str]) -> str:
    """The API reference of one module: every name it exports, rendered by mkdocstrings."""
    names = public_names(module.files[0])
    names += [n for n in extra_names if n not in names]
    doc = ast.get_docstring(ast.parse(module.files[0].read_text(encoding="utf-8"))) or ""
    summary = doc.strip().split("\n")[0] if doc else ""
    parts = [f"# `{module.dotted}`\n", f"{summary}\n" if summary else "",
             f"The narrative and the code side by side: [the literate page](../paper/{module.slug}.md).\n"]
    if module.name in SPLIT_PACKAGES and not module.package:
        opener = ROOM_OPENERS.get(module.name)
        subs = sorted(p.stem for p in (PACKAGE / module.name).glob("*.py") if p.stem not in ("__init__", opener))
        parts.append("Its modules, each with its own reference page:\n")
        parts.append("\n".join(f"- [`{module.dotted}.{s}`]({s.lstrip('_')}.md)" for s in subs) + "\n")
        if opener:
            parts.append(f"## `{module.dotted}.{opener}`\n")
            parts.append(f"::: {module.dotted}.{opener}\n")
        return "\n".join(p for p in parts if p)
    if not names:
        parts.append(f"::: {module.dotted}\n")
    for name in names:
        parts.append(f"::: {module.dotted}.{name}\n")
    return "\n".join(p for p in parts if p)


def reference_index(modules: list[Module], exported: dict[str, str]) -> str:
    """The overview of the public API: every name of `refimpl.__all__`, by module."""
    parts = ["# API reference\n",
             "Everything below is importable from the top-level package (`from refimpl import ...`). "
             "Each module's page documents the rest of what it exports.\n"]
    by_module: dict[str, list[str]] = {}
    for name, mod in exported.items():
        by_module.setdefault(mod, []).append(name)
    present = {m.name: m for m in modules}
    for mod, names in by_module.items():
        if mod not in present:
            continue
        dotted = present[mod].dotted + (f".{ROOM_OPENERS[mod]}" if mod in ROOM_OPENERS else "")
        parts.append(f"## [`{dotted}`]({present[mod].slug}.md)\n")
        parts.append("\n".join(f"- [`{n}`][{dotted}.{n}]" for n in sorted(names, key=str.lower)) + "\n")
    parts.append("## All modules\n")
    parts.append("\n".join(f"- [`{m.dotted}`]({m.slug}.md)" for m in modules) + "\n")
    return "\n".join(parts)


def tests_page(path: Path) -> str:
    """A test file as a literate page, with one anchor per test."""
    page = literate(path.read_text(encoding="utf-8"), test_file=True)
    rel = path.relative_to(ROOT).as_posix()
    title = f"`{rel}`" + (f": {page.title}" if page.title else "")
    return "\n".join([f"# {title}\n", f"<small>[View `{rel}` on the repository]({repo_file_url(rel)})</small>\n",
                      page.intro + "\n", page.body])


def k3_numbers() -> str:
    """The K3 table of the landing page, computed by the package at build time."""
    try:
        import refimpl
        from refimpl.layer.accounting import combinatorial_sparsity, dispatch_payload, parameter_counts
    except Exception as exc:  # the package is mid-edit or not installed
        log.warning("cannot import refimpl to compute the K3 numbers: %r", exc)
        return "*(The K3 numbers could not be computed for this build.)*\n"
    config = refimpl.MoEConfig.k3()
    counts = parameter_counts(config)
    payload = dispatch_payload(config, bytes_per_value=2)
    sparsity = combinatorial_sparsity(config)
    layers = config.num_moe_layers
    half_n, half_k = config.n // int(sparsity["alpha"]), config.k // int(sparsity["alpha"])
    rows = [
        ("model width $d$ / latent width $\\ell$ / $\\alpha = d/\\ell$",
         f"{config.d:,} / {config.ell:,} / {config.alpha:g}"),
        ("routed experts $n$, chosen per token $k$, expert width $f$", f"{config.n}, {config.k}, {config.f:,}"),
        ("shared experts (merged width $N_s f$)", f"{config.num_shared_experts} ({config.shared_size:,})"),
        ("one routed expert, $3\\ell f$", f"{counts['routed_expert']:,}"),
        ("routed experts per layer, $3\\ell f n$", f"{counts['routed']:,}"),
        (f"routed experts over the {layers} MoE layers",
         f"{counts['routed_all_layers']:,} ({counts['routed_all_layers'] / 1e12:.2f} T)"),
        ("activated per token per layer ($k$ experts + shared + $W_\\downarrow$, $W_\\uparrow$)",
         f"{counts['activated']:,}"),
        ("… of which the two latent projections, $2 d \\ell$", f"{counts['projections']:,}"),
        ("router weight, $n d$ (on top)", f"{counts['router_weight']:,}"),
        (f"routed experts' share of K3's {K3_TOTAL_PARAMETERS / 1e12:.2f} T parameters",
         f"{counts['routed_all_layers'] / K3_TOTAL_PARAMETERS:.0%}"),
        (f"activated per token over {layers} layers",
         f"{counts['activated_all_layers']:,} ({counts['activated_all_layers'] / 1e9:.1f} B)"),
        (f"… their share of K3's {K3_ACTIVATED_PARAMETERS / 1e9:.1f} B activated parameters",
         f"{counts['activated_all_layers'] / K3_ACTIVATED_PARAMETERS:.0%}"),
        ("values sent per token per all-to-all pass, $k\\ell$ (full width: $kd$)",
         f"{payload['latent_values']:,} ({payload['full_width_values']:,})"),
        ("bytes per token per pass in bfloat16", f"{payload['latent_bytes']:,.0f}"),
        (f"$\\log_{{10}}\\binom{{{config.n}}}{{{config.k}}}$ vs. "
         f"$\\alpha\\log_{{10}}\\binom{{{half_n}}}{{{half_k}}}$",
         f"{sparsity['log10_latent']:.2f} vs. {sparsity['log10_base_power_alpha']:.2f}"),
    ]
    lines = ["| K3 layer | value |", "|---|---:|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def reading_path(modules: dict[str, Module], compare: bool, puzzles: bool = False,
                 examples: dict[str, str] | None = None) -> str:
    """The landing page's reading path: the pages of this build, in order, as the navigation lists them
    (`examples`: the title of each example of this build, by stem, for those of `PATH_EXAMPLES`)."""
    lines = []
    examples = examples or {}
    for name, label in READING_PATH:
        if name == "testing" and puzzles:
            lines.append("1. [Puzzles](puzzles/index.md): write each piece yourself, from Eq. (13) to Appendix D, "
                         "with the kit trying to break every answer.")
        if name in modules:
            title = without_repeated_head(label, literate_title(modules[name]))
            link = f"[{label}](paper/{modules[name].slug}.md)"
            if title.lower().startswith(label.lower()):  # "The backward pass of Eqs. (11)-(13)": the link is its start
                lines.append(f"1. {link}{title[len(label):]}.")
            else:
                lines.append(f"1. {link}: {title}.")
            stem = PATH_EXAMPLES.get(name, "")
            if stem in examples:
                lines.append(f"1. [Example {stem[:2]}](examples/{stem}.md): {examples[stem]}.")
    if compare:
        lines.append(f"1. [Compare the variants](examples/{COMPARE_EXAMPLE}.md): plain MoE, LatentMoE and "
                     "Stable LatentMoE on the same inputs.")
    lines.append("1. [Worked examples](examples/index.md), [benchmark results](benchmark-results/index.md) and the "
                 "[API reference](reference/index.md).")
    return "\n".join(lines) + "\n"


def _plain(words: str) -> str:
    """Words as a reader compares them: "Appendix" and "App.", "and" and "&" are the same."""
    words = re.sub(r"\bAppendix\b", "App.", words)
    return re.sub(r"\s+", " ", words.replace(" and ", " & ")).strip().lower()


def without_repeated_head(label: str, title: str) -> str:
    """The title without its leading clauses ("Eq. (13): ...", "Configuration: ...") that the link's label says.

    Without this, a line of the reading path reads "Configuration: Configuration: the numbers ...".
    """
    while True:
        clause = re.match(r"(.+?)(?::|,) (.+)", title)  # the first clause, up to ": " or ", "
        if not clause or _plain(clause[1]) not in _plain(label):
            return title
        title = clause[2]


def literate_title(module: Module) -> str:
    doc = ast.get_docstring(ast.parse(module.files[0].read_text(encoding="utf-8"))) or module.dotted
    return doc.strip().split("\n")[0].rstrip(".")


def study_pages() -> dict[str, tuple[str, Path]]:
    """The stand-alone pages `docs/pages/<slug>.md`: slug -> (title, file), in navigation order.

    The title is the page's first line, `# Title`. `STUDIES` come first in their order, then the rest by slug.
    """
    found: dict[str, tuple[str, Path]] = {}
    paths = sorted(PAGES.glob("*.md")) if PAGES.is_dir() else []
    order = {slug: i for i, slug in enumerate(STUDIES)}
    for path in sorted(paths, key=lambda p: (order.get(p.stem, len(order)), p.stem)):
        first = path.read_text(encoding="utf-8").lstrip().split("\n", 1)[0]
        if not first.startswith("# "):
            log.warning("docs/pages/%s: the first line must be the title, `# Title`", path.name)
            continue
        found[path.stem] = (first[2:].strip(), path)
    return found


#: The landing page's three reading paths: (heading, who it is for, steps). A step is
#: (kind, name, text): kind "paper" (a module), "example" (an example's stem), "page" (a stand-alone page),
#: "puzzles" (their overview) or "site" (a fixed page of the site); steps whose page does not exist in a build
#: are left out. The first path, a learner's, follows the reading path of the navigation (`READING_PATH`).
START_HERE: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("Learning the layer", "You want to understand what the block computes, and why.", [
        ("paper", "latent_moe", "the whole block, stage by stage"),
        ("example", "01_forward_by_hand", "the whole forward pass printed on a tiny layer"),
        ("paper", "activations", "the smoothly capped SwiGLU of every expert"),
        ("paper", "routing", "sigmoid scores, the bias that only selects"),
        ("paper", "config", "the notation, the sizes and switches, K3's numbers"),
        ("example", "40_compare_variants", "plain MoE, LatentMoE and Stable LatentMoE side by side"),
        ("page", "why-stable", "what the stable additions change, measured on the equations above"),
        ("paper", "backward", "the gradients, section by section beside the forward pass"),
        ("paper", "train", "a small model trained end to end"),
        ("puzzles", "puzzles/index.md", "now write each piece yourself, from Eq. (13) to Appendix D, with a check "
         "that tries to break every answer"),
    ]),
    ("Porting it to your framework", "You have your own kernels and want to know they agree.", [
        ("paper", "testing", "checks that take your own function and report where it disagrees"),
        ("example", "30_test_your_router", "run the kit on a router of your own"),
        ("example", "31_mistakes_the_kit_catches", "the mistakes it catches"),
        ("paper", "families", "DeepSeek-V3, GLM-4 MoE, Kimi Linear, Qwen3-MoE, Mixtral and Nemotron-H, held against "
         "transformers"),
        ("example", "33_check_a_deepseek_v3_port", "the kit on a DeepSeek-V3 port, with that model's keys and rules"),
        ("paper", "hf_checkpoint", "one layer of the released weights, read as they are stored"),
        ("paper", "mx", "the element formats of the deployed experts"),
        ("paper", "expert_parallel", "dispatch and combine between ranks, and their bytes"),
        ("site", "reference/index.md", "the API reference"),
    ]),
    ("Studying balancing", "You care about how the load of nearly a thousand experts is kept even.", [
        ("page", "balance-is-speed", "why balance is speed"),
        ("paper", "balancing", "the exact bias update, and the atom of ties it meets"),
        ("example", "10_qb_by_hand", "one update by hand"),
        ("paper", "dual", "why the update is right: it is coordinate descent on a dual"),
        ("example", "12_lp_crosscheck", "the LP solved by HiGHS against Eq. (14)"),
        ("paper", "histogram", "the same update at scale, from integer counts"),
        ("paper", "baselines", "the sign rule, auxiliary losses, capacity and hashing, side by side"),
        ("example", "14_fresh_batch_noise", "fresh batches and the noise floor"),
        ("paper", "shipped", "the update as Megatron-Core and others ship it"),
        ("example", "15_qb_as_others_ship_it", "those conventions measured on one stream of batches"),
        ("paper", "train", "the balancers compared while a small model trains"),
        ("page", "report-card", "the report card"),
    ]),
]


def start_here(modules: dict[str, Module], examples: set[str], studies: dict[str, tuple[str, Path]],
               puzzles: bool = False) -> str:
    """The "Start here" reading paths, with links to the pages of this build (`puzzles`: whether it has them)."""
    labels = dict(READING_PATH)
    blocks: list[str] = []
    for heading, who, steps in START_HERE:
        items: list[str] = []
        for kind, name, text in steps:
            if kind == "paper" and name in modules:
                items.append(f"[{labels.get(name, name)}](paper/{modules[name].slug}.md): {text}")
            elif kind == "example" and name in examples:
                items.append(f"[Example {name[:2]}](examples/{name}.md): {text}")
            elif kind == "page" and name in studies:
                items.append(f"[{studies[name][0]}](pages/{name}.md): {text}")
            elif kind == "puzzles" and puzzles:
                items.append(f"[Puzzles]({name}): {text}")
            elif kind == "site":
                items.append(f"[{text[:1].upper()}{text[1:]}]({name})")
        if items:
            body = "\n".join(f"    {i}. {item}" for i, item in enumerate(items, start=1))
            blocks.append(f'=== "{heading}"\n\n    {who}\n\n{body}\n')
    return "\n".join(blocks)


def landing_page(modules: dict[str, Module], compare: bool, examples: dict[str, str] | None = None,
                 studies: dict[str, tuple[str, Path]] | None = None, puzzles: bool = False) -> str | None:
    """`docs/index.md` with its markers replaced by computed content (`examples`: title by stem)."""
    index = DOCS / "index.md"
    if not index.is_file():
        return None
    text = hand_written(index, prefix="")
    text = text.replace("<!-- refimpl:k3-numbers -->", k3_numbers())
    text = text.replace("<!-- refimpl:start-here -->", start_here(modules, set(examples or {}), studies or {}, puzzles))
    return text.replace("<!-- refimpl:reading-path -->", reading_path(modules, compare, puzzles, examples))


def parse_ok(path: Path) -> bool:
    """Whether a file parses; a file that does not is reported and left out."""
    try:
        ast.parse(path.read_text(encoding="utf-8"))
    except SyntaxError as exc:
        log.warning("%s does not parse (%s); its pages are left out", path.relative_to(ROOT), exc)
        return False
    return True


def tests_index(test_paths: list[Path]) -> str:
    """The test suite's overview: every test file with the first line of its docstring."""
    lines = ["# The test suite\n",
             "Every file of `tests/`, rendered as a literate page with one anchor per test. `make test` runs "
             "them all; each module's page lists the properties its tests check.\n",
             "| file | what it tests |", "|---|---|"]
    for path in test_paths:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        summary = doc.strip().split("\n")[0].replace("|", "\\|")
        lines.append(f"| [`{path.name}`]({path.stem}.md) | {summary} |")
    return "\n".join(lines) + "\n"


def internals_index(internals: list[Module]) -> str:
    """The overview of the helper modules."""
    lines = ["# Internals\n",
             "Modules that the others use, each a literate page of its own:\n"]
    for module in internals:
        lines.append(f"- [`{module.dotted}`](../paper/{module.slug}.md): {INTERNALS[module.name]}; "
                     f"{literate_title(module)}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Generate every page and the navigation, saying what each stage did."""
    start = time.perf_counter()

    def stage(message: str, *args: object) -> None:
        log.info("gen_pages %5.1f s: " + message, time.perf_counter() - start, *args)

    modules = {name: m for name, m in discover_modules().items() if all(parse_ok(f) for f in m.files)}
    for name, _ in READING_PATH:
        if name not in modules:
            log.info("refimpl/%s.py does not exist yet: its pages are skipped", name)
    ordered = [modules[name] for name, _ in READING_PATH if name in modules]
    known = {name for name, _ in READING_PATH} | set(INTERNALS)
    extras = [m for name, m in modules.items() if name not in known and not name.startswith("_")]
    internals = [modules[name] for name in INTERNALS if name in modules]
    exported = reexports()
    stage("%d modules of refimpl/", len(modules))

    example_paths = sorted(p for p in EXAMPLES.glob("[0-9][0-9]_*.py") if parse_ok(p)) if EXAMPLES.is_dir() else []
    example_titles: dict[Path, str] = {}
    for path in example_paths:
        record = read_record(path)
        if record is not None:
            RECORDS[path.stem] = record
            with mkdocs_gen_files.open(f"examples/{path.stem}.ipynb", "w") as handle:
                handle.write(record.notebook)
            for name, figure in record.figures.items():
                with mkdocs_gen_files.open(f"examples/{path.stem}/{name}", "wb") as handle:
                    handle.write(figure.data)
        write(f"examples/{path.stem}.md", example_page(path, record), edit=f"examples/{path.name}")
        example_titles[path] = example_title(path)[0]
    stage("%d example pages, from their records examples/NN_slug.ipynb (%d figures; no example is run)",
          len(example_paths), sum(len(r.figures) for r in RECORDS.values()))
    uses = {path: modules_used(path.read_text(encoding="utf-8"), exported) for path in example_paths}

    test_paths = sorted(p for p in TESTS.glob("test_*.py") if parse_ok(p)) if TESTS.is_dir() else []
    for path in test_paths:
        write(f"tests/{path.stem}.md", tests_page(path), edit=f"tests/{path.name}")
    write("tests/index.md", tests_index(test_paths))
    stage("%d test pages", len(test_paths))

    all_modules = ordered + extras + internals
    for module in all_modules:
        tests = {p: cases_in(p) for p in tests_of_module(module.name) if p in test_paths}
        examples = [(p, example_titles[p]) for p in example_paths if module.name in uses[p]]
        boost = f"---\nsearch:\n  boost: {SEARCH_BOOST[module.name]}\n---\n\n" if module.name in SEARCH_BOOST else ""
        write(f"paper/{module.slug}.md", boost + module_page(module, examples, tests),
              edit=module.files[0].relative_to(ROOT).as_posix())
        extra_names = [n for n, mod in exported.items() if mod == module.name]
        write(f"reference/{module.slug}.md", reference_page(module, extra_names),
              edit=module.files[0].relative_to(ROOT).as_posix())
    write("reference/index.md", reference_index(all_modules, exported), edit="refimpl/__init__.py")
    if internals:
        write("internals/index.md", internals_index(internals))
    stage("%d literate module pages and their API reference pages", len(all_modules))

    examples_index = ["# Worked examples\n",
                      "Each example is a script in `examples/` that runs in seconds to a minute. Its page shows "
                      "its recorded run, cell by cell: what each step printed and drew. The record is the "
                      "notebook `examples/NN_slug.ipynb`, which you can download and step through in any "
                      "folder; the test suite runs every example again and checks that its record is current.\n",
                      "| | example | uses | notebook |", "|---|---|---|---|"]
    for path in example_paths:
        used = ", ".join(f"[`{m}`](../paper/{m.lstrip('_')}.md)" for m in sorted(uses[path]) if m in modules)
        notebook = f"[`{path.stem}.ipynb`]({path.stem}.ipynb)" if path.stem in RECORDS else ""
        examples_index.append(f"| {path.stem[:2]} | [{example_titles[path]}]({path.stem}.md) | {used} | {notebook} |")
    if not example_paths:
        examples_index.append("| | (none yet) | | |")
    fragment = DOCS / "sections" / "examples.md"
    if fragment.is_file():
        examples_index += ["", hand_written(fragment).strip()]
    pages_with_fragments = {m.slug for m in all_modules} | {"benchmarks", "examples"}
    for fragment in sorted((DOCS / "sections").glob("*.md")):
        if fragment.stem not in pages_with_fragments:
            log.info("docs/sections/%s is not shown: no module or page is called %r", fragment.name, fragment.stem)
    write("examples/index.md", "\n".join(examples_index) + "\n")

    text, images = benchmarks_page()
    write("benchmark-results/index.md", text)
    for name, data in images.items():
        with mkdocs_gen_files.open(f"benchmark-results/{name}", "wb") as handle:
            handle.write(data)
    stage("the benchmark page (%d plots)", len(images))

    puzzle_texts, puzzle_nav = puzzle_pages()
    for site_path, text in puzzle_texts.items():
        write(site_path, text, edit="refimpl/testing/puzzles/__init__.py")
    for notebook in sorted((EXAMPLES / "puzzles").glob("[0-9][0-9]_*.ipynb")) if puzzle_texts else []:
        with mkdocs_gen_files.open(f"puzzles/{notebook.name}", "w") as handle:
            handle.write(notebook.read_text(encoding="utf-8"))
    stage("%d puzzle pages and their notebooks", len(puzzle_texts))

    studies = study_pages()
    for slug, (_, path) in studies.items():
        write(f"pages/{slug}.md", hand_written(path), edit=path.relative_to(ROOT).as_posix())

    compare = EXAMPLES / f"{COMPARE_EXAMPLE}.py" in example_paths
    landing = landing_page(modules, compare, {p.stem: example_titles[p] for p in example_paths}, studies,
                           bool(puzzle_texts))
    if landing is not None:
        write("index.md", landing, edit="docs/index.md")
    stage("%d study pages and the landing page", len(studies))

    nav = ["* [Home](index.md)"] if landing is not None else []
    nav.append("* The paper, module by module")
    labels = dict(READING_PATH)
    for module in [m for m in ordered + extras if m.name not in NOT_IN_NAV]:
        if module.name == "testing":
            nav += puzzle_nav  # after the equations and the balancers, before the kit
        label = labels.get(module.name) or MODULE_LABELS.get(module.name) or literate_title(module).split(":")[0]
        nav.append(f"    * [{label}](paper/{module.slug}.md)")
        follows = EXAMPLES / f"{PATH_EXAMPLES.get(module.name)}.py"
        if follows in example_titles:
            nav.append(f"    * [{nav_label(follows, example_titles[follows])}](examples/{follows.stem}.md)")
    if compare:
        nav.append(f"* [Compare the variants](examples/{COMPARE_EXAMPLE}.md)")
    nav.append("* Worked examples")
    nav.append("    * [All examples](examples/index.md)")
    for path in example_paths:
        if path.stem != COMPARE_EXAMPLE and path.stem not in EXAMPLES_NOT_IN_NAV | set(PATH_EXAMPLES.values()):
            nav.append(f"    * [{nav_label(path, example_titles[path])}](examples/{path.stem}.md)")
    if studies:
        nav.append("* Studies")
        nav += [f"    * [{title}](pages/{slug}.md)" for slug, (title, _) in studies.items()]
    nav.append("* [Benchmark results](benchmark-results/index.md)")
    if internals:
        nav.append("* [Internals](internals/index.md)")
    nav.append("* [API reference](reference/index.md)")
    if test_paths:
        nav.append("* [Test suite](tests/index.md)")
    write("SUMMARY.md", "\n".join(nav) + "\n")
    stage("the navigation: %d links; mkdocs now renders the pages", sum("](" in line for line in nav))


if __name__ in {"__main__", "<run_path>"}:
    main()
