r"""Generate the pages of the documentation site from the repository itself.

mkdocs-gen-files runs this script at the start of every `mkdocs build` and
`mkdocs serve`. Nothing is written into the working tree except the example
cache; every page below exists only inside the build:

* `paper/<module>.md`: one literate page per module of `refimpl/`. The module
  docstring is the prose; the code follows in blocks, and every comment that
  stands on its own line becomes prose between them (`# $$...$$` comments
  become display math). Function and class docstrings are prose too. The page
  then lists the properties the module's tests check, the worked examples that
  use the module, and the hand-written fragment `docs/sections/<module>.md`
  when there is one.
* `reference/<module>.md`: the API reference, rendered by mkdocstrings.
* `examples/<NN_slug>.md` and `examples/<NN_slug>.ipynb`: each
  `examples/NN_slug.py` is run once, cell by cell, with `--out DIR`
  (`docs/notebooks.py` states the percent-cell convention of the scripts and
  how a script becomes a notebook). Its intro, printed output, figures and
  source make the page; the same run's outputs fill the notebook, which the
  page offers for download. Runs are cached in `.cache/examples/`, keyed by a
  hash of the example, of `refimpl/` and of `docs/notebooks.py`.
* `pages/<slug>.md`: the hand-written stand-alone pages `docs/pages/<slug>.md`
  (first line `# Title`), with their example markers expanded, listed under
  "Studies" in the order of `STUDIES` and then alphabetically.
* `tests/<file>.md`: the test files, rendered the same literate way, one anchor
  per test so the module pages can link to each property.
* `benchmark-results/index.md`: the results the benchmark scripts saved under
  `docs/benchmarks/` (`*.md` verbatim, `*.json` as tables), then `docs/sections/benchmarks.md`.
* `index.md`: the hand-written landing page with its computed parts filled in
  (the K3 numbers, the three "Start here" reading paths and the reading path).
  Links to pages that do not exist in this build are left out.
* `SUMMARY.md`: the navigation, read by mkdocs-literate-nav.

On a literate page the import block and the `__all__` list that open a module
are folded away to the end of its code, so the first screen after the essay
shows the first idea and the code that computes it.

Modules that do not exist yet are skipped with a message; a failing example
or a module that does not parse is reported as a warning, which fails
`mkdocs build --strict`.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import tokenize
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "refimpl"
TESTS = ROOT / "tests"
EXAMPLES = ROOT / "examples"
CACHE = ROOT / ".cache" / "examples"
PAGES = DOCS / "pages"

#: Bump to invalidate every cached example run.
GENERATOR_VERSION = "2"

#: The reading path: module and navigation label, in reading order.
READING_PATH: list[tuple[str, str]] = [
    ("config", "Configuration"),
    ("activations", "Eq. (12) & App. B: SiTU-GLU"),
    ("routing", "Eq. (13): routing"),
    ("latent_moe", "Eq. (11): the forward pass"),
    ("backward", "The backward pass"),
    ("accounting", "Accounting"),
    ("mx", "MXFP4 and MXFP8"),
    ("checkpoint", "Loading the released checkpoint"),
    ("state_dict", "Porting: HF tensor names"),
    ("balancing", "Eq. (14): Quantile Balancing"),
    ("dual", "App. C: the LP and its dual"),
    ("histogram", "App. D: the histogram estimator"),
    ("baselines", "The other routers and balancers"),
    ("expert_parallel", "Expert parallelism over MPI"),
    ("train", "Training a small model"),
    ("testing", "The conformance kit"),
]

#: The stand-alone pages `docs/pages/<slug>.md` that come first under "Studies", in this order;
#: any other page follows, alphabetically by slug.
STUDIES = ["why-stable", "balance-is-speed", "report-card", "conventions"]

#: Helper modules every other module uses; they come after the reading path.
INTERNALS = {"_xp": "Array helpers (_xp)", "validation": "Input checks"}

#: The example shown as its own page, "Compare the variants".
COMPARE_EXAMPLE = "40_compare_variants"

#: How long one example may run before the build gives up on it (seconds).
EXAMPLE_TIMEOUT = 600

#: Files an example saves with `--out` that are shown as figures (other files can be embedded by markers).
IMAGE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg")

#: Markers a hand-written page or fragment may contain, replaced by an example's cached results:
#: `<!-- refimpl:example-output NN_slug -->` (what it printed) and
#: `<!-- refimpl:example-file NN_slug/name.txt -->` (a file it saved with `--out`; `.md` files are inserted as is).
_MARKER = re.compile(r"<!--\s*refimpl:(?P<kind>example-output|example-file)\s+(?P<arg>[^\s]+)\s*-->")

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
                out += ["", f"{indent}$$", f"{indent}{piece.strip()}", f"{indent}$$", ""]
                in_item = in_item or bool(indent)
        if len(pieces) % 2 == 0:
            out += ["", f"{indent}$$"]
            if pieces[-1].strip():
                out.append(f"{indent}{pieces[-1].strip()}")
            in_math = True
    return "\n".join(out)


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
    if had_rule and text and "\n" not in text and len(text) < 70:
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

    name: str  # "latent_moe", "testing", "_xp"
    files: list[Path]  # the module file, or a package's `__init__.py` then its submodules

    @property
    def slug(self) -> str:
        return self.name.lstrip("_")

    @property
    def dotted(self) -> str:
        return f"refimpl.{self.name}"


def discover_modules() -> dict[str, Module]:
    """Every module and subpackage of `refimpl/`, by name."""
    found: dict[str, Module] = {}
    if not PACKAGE.is_dir():
        return found
    for path in sorted(PACKAGE.iterdir()):
        if path.suffix == ".py" and path.stem != "__init__":
            found[path.stem] = Module(path.stem, [path])
        elif path.is_dir() and (path / "__init__.py").is_file():
            subs = sorted(p for p in path.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)
            found[path.name] = Module(path.name, [path / "__init__.py", *subs])
    return found


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
                found[alias.asname or alias.name] = node.module.split(".")[0]
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
                used.add(node.module.split(".")[1])
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
    slug = module.lstrip("_")
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
# Examples: run once, cache, render
# ---------------------------------------------------------------------------

@dataclass
class ExampleRun:
    """What one run of an example produced."""

    stdout: str
    stderr: str
    returncode: int
    seconds: float
    figures: dict[str, bytes]
    cached: bool = False
    cells: list[dict] = field(default_factory=list)  # the notebook cells and what each printed and saved


def example_key(path: Path) -> str:
    """A hash of everything an example's output depends on: itself, helper scripts, `refimpl/` and the
    recorded long runs in `docs/results/` that some examples print and plot."""
    digest = hashlib.sha256()
    digest.update(f"{GENERATOR_VERSION}|{sys.version_info[:2]}|".encode())
    helpers = [p for p in EXAMPLES.glob("*.py") if not re.match(r"\d\d_", p.name)]
    results = sorted((DOCS / "results").glob("*.json"))
    sources = [path, *sorted(helpers), *sorted(PACKAGE.rglob("*.py")), DOCS / "notebooks.py", *results]
    for source in sources:
        if "__pycache__" in source.parts:
            continue
        digest.update(str(source.relative_to(DOCS)).encode() if source.is_relative_to(DOCS)
                      else str(source.relative_to(ROOT)).encode())
        digest.update(b"\0")
        digest.update(source.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _read_cells(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []


def run_example(path: Path) -> ExampleRun:
    """Run the example's notebook cells in order with `--out DIR`, or read the cached run for the same sources.

    The cells run in a fresh interpreter (`python docs/notebooks.py run ...`); what they print together is
    what `python examples/NN_slug.py --out DIR` prints, and each cell's share goes into the notebook.
    """
    key = example_key(path)
    home = CACHE / path.stem
    done = home / key
    if (done / "run.json").is_file():
        meta = json.loads((done / "run.json").read_text(encoding="utf-8"))
        figures = {p.name: p.read_bytes() for p in sorted((done / "out").glob("*")) if p.is_file()}
        return ExampleRun(meta["stdout"], meta["stderr"], 0, meta["seconds"], figures, cached=True,
                          cells=_read_cells(done / "cells.json"))

    work = home / f"{key}.running-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "out").mkdir(parents=True)
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    try:
        command = [sys.executable, str(DOCS / "notebooks.py"), "run", str(path), str(work / "out"),
                   str(work / "cells.json")]
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, code = f"timed out after {EXAMPLE_TIMEOUT} s", -1
    seconds = time.perf_counter() - start
    figures = {p.name: p.read_bytes() for p in sorted((work / "out").glob("*")) if p.is_file()}
    cells = _read_cells(work / "cells.json")
    if code != 0:
        shutil.rmtree(work, ignore_errors=True)
        return ExampleRun(stdout, stderr, code, seconds, figures, cells=cells)
    meta = {"stdout": stdout, "stderr": stderr, "seconds": round(seconds, 2), "example": path.name}
    (work / "run.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    for stale in home.iterdir():  # keep one cached run per example
        if stale != work and not stale.name.startswith(f"{key}.running"):
            shutil.rmtree(stale, ignore_errors=True)
    try:
        work.rename(done)
    except OSError:  # another build finished the same run first
        shutil.rmtree(work, ignore_errors=True)
    return ExampleRun(stdout, stderr, 0, seconds, figures, cells=cells)


def run_examples(paths: list[Path]) -> dict[Path, ExampleRun]:
    """Run every example (two at a time), reusing cached runs."""
    if not paths:
        return {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(paths, pool.map(run_example, paths), strict=True))


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


def example_notebook(path: Path, run: ExampleRun) -> str | None:
    """The `.ipynb` text of an example, with the outputs of `run`; None when the run left no cells."""
    if not run.cells:
        return None
    cells = notebooks.cells_from_json(run.cells)
    try:
        return notebooks.notebook_json(cells, None, script_name=path.name, files=run.figures)
    except Exception as exc:  # an invalid notebook is a bug of the converter: report it, keep the page
        log.warning("examples/%s: the notebook is not valid: %s", path.name, exc)
        return None


def example_page(path: Path, run: ExampleRun, notebook: bool = False) -> str:
    """The Markdown of one example's page; `notebook` says whether `NN_slug.ipynb` is served beside it."""
    title, intro, code = example_title(path)
    rel = f"examples/{path.name}"
    download = (f"[Download as notebook]({path.stem}.ipynb){{ .md-button download='{path.stem}.ipynb' }} "
                f"(`{path.stem}.ipynb`, with the outputs shown below; it runs from the repository root, where "
                "`refimpl` is installed).\n") if notebook else ""
    parts = [f"# {title}\n", intro + "\n" if intro else "",
             f"Run it with `python {rel}`; add `--out DIR` to save the figures as PNG files. "
             f"Its cells (`# %%`) step through in any editor's notebook mode. "
             f"[View `{rel}` on the repository]({repo_file_url(rel)}).\n", download]
    if run.returncode != 0:
        parts += ["!!! failure \"This example failed when the site was built\"\n",
                  textwrap.indent(fence((run.stdout + "\n" + run.stderr).strip()[-4000:], "text"), "    ")]
    parts += ["## Output\n",
              f"What `python {rel}` printed when this page was built, its cells run in order "
              f"({run.seconds:.1f} s{', cached' if run.cached else ''}; the notebook carries the same run):\n",
              fence(run.stdout or "(no output)", "text")]
    pngs = [name for name in run.figures if name.lower().endswith(IMAGE_SUFFIXES)]
    if pngs:
        parts.append("## Figures\n")
        for name in pngs:
            parts.append(f"![{Path(name).stem.replace('_', ' ')}]({path.stem}/{name})\n")
    parts += ["## Source\n", fence(code, "python")]
    return "\n".join(p for p in parts if p)


# ---------------------------------------------------------------------------
# Benchmark results
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


#: The example runs of this build, by script name (filled by `main` before any page is written).
EXAMPLE_RUNS: dict[str, ExampleRun] = {}


def hand_written(path: Path) -> str:
    """A hand-written page or fragment, with its example markers expanded."""
    return expand_markers(path.read_text(encoding="utf-8"), EXAMPLE_RUNS, str(path.relative_to(ROOT)))


def expand_markers(text: str, runs: dict[str, ExampleRun], where: str) -> str:
    """Replace the example markers of a hand-written page by the cached results they name."""

    def replace(match: re.Match) -> str:
        kind, arg = match.group("kind"), match.group("arg")
        stem, _, name = arg.partition("/")
        run = runs.get(stem)
        if run is None or (kind == "example-file" and name not in run.figures):
            log.warning("%s: %s names no result of the examples (%s)", where, match.group(0), arg)
            return ""
        if kind == "example-output":
            return fence(run.stdout or "(no output)", "text")
        data = run.figures[name].decode("utf-8", errors="replace")
        return data if name.endswith(".md") else fence(data, "text")

    return _MARKER.sub(replace, text)


def benchmarks_page() -> tuple[str, dict[str, bytes]]:
    """The benchmark results page and the images it shows."""
    folder = DOCS / "benchmarks"
    parts = ["# Benchmark results\n",
             "The numbers below were measured by the scripts in `benchmarks/` (run them with `make bench`), "
             "which save their results under `docs/benchmarks/`. Each section says on which machine and when "
             "it was measured; nothing here is typed by hand.\n"]
    images: dict[str, bytes] = {}
    files = sorted(folder.glob("*")) if folder.is_dir() else []
    # A benchmark that wrote both `<name>.md` (for people) and `<name>.json` (for tools) shows the first.
    stems_with_md = {p.stem for p in files if p.suffix == ".md"}
    results = [p for p in files if p.suffix == ".md" or (p.suffix == ".json" and p.stem not in stems_with_md)]
    if not results:
        parts.append("!!! note \"No results recorded yet\"\n    Run `make bench` to measure and record them.\n")
    for path in results:
        if path.suffix == ".md":
            text = path.read_text(encoding="utf-8")
            text = re.sub(r"^(#{1,5}) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)  # demote headings
            parts.append(text.strip() + "\n")
        else:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                log.warning("docs/benchmarks/%s is not valid JSON: %s", path.name, exc)
                continue
            name = data.get("title") or data.get("name") or path.stem if isinstance(data, dict) else path.stem
            parts.append(f"## {name}\n")
            parts.append(f"From `docs/benchmarks/{path.name}`.\n")
            parts.append(json_to_markdown(data))
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


def module_page(module: Module, examples: list[tuple[Path, str]], tests: dict[Path, list[PropertyTest]]) -> str:
    """The literate page of a module: prose, code, tested properties, examples and the fragment."""
    main = literate(module.files[0].read_text(encoding="utf-8"))
    rel = module.files[0].relative_to(ROOT).as_posix()
    title = main.title or module.dotted
    links = [f"[`{rel}`]({repo_file_url(rel)})", f"[API reference](../reference/{module.slug}.md)"]
    links += [f"[`tests/{p.name}`](../tests/{p.stem}.md)" for p in tests]
    parts = [f"# {title}\n", f"<small>Source: {' · '.join(links)}</small>\n", main.intro + "\n", main.body]
    for sub in module.files[1:]:
        part = literate(sub.read_text(encoding="utf-8"))
        subrel = sub.relative_to(ROOT).as_posix()
        parts += [f"## `{subrel}`\n", f"**{part.title}.**\n" if part.title else "", part.intro + "\n",
                  re.sub(r"^(#{2,5}) ", r"#\1 ", part.body, flags=re.M)]
    if tests:
        parts.append("## Properties the tests check\n")
        for path, cases in tests.items():
            parts.append(f"From [`tests/{path.name}`](../tests/{path.stem}.md) "
                         f"([on the repository]({repo_file_url('tests/' + path.name)})):\n")
            parts.append("\n".join(f"- [{case.summary}](../tests/{path.stem}.md#{case.anchor})"
                                   f" (`{case.qualname}`)" for case in cases) + "\n")
    if examples:
        parts.append("## Worked examples using this module\n")
        parts.append("\n".join(f"- [{title}](../examples/{path.stem}.md)" for path, title in examples) + "\n")
    fragment = DOCS / "sections" / f"{module.slug}.md"
    if fragment.is_file():
        parts.append(hand_written(fragment).strip() + "\n")
    return "\n".join(parts)


def reference_page(module: Module, extra_names: Iterable[str]) -> str:
    """The API reference of one module: every name it exports, rendered by mkdocstrings."""
    names = public_names(module.files[0])
    names += [n for n in extra_names if n not in names]
    doc = ast.get_docstring(ast.parse(module.files[0].read_text(encoding="utf-8"))) or ""
    summary = doc.strip().split("\n")[0] if doc else ""
    parts = [f"# `{module.dotted}`\n", f"{summary}\n" if summary else "",
             f"The narrative and the code side by side: [the literate page](../paper/{module.slug}.md).\n"]
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
        parts.append(f"## [`refimpl.{mod}`]({present[mod].slug}.md)\n")
        parts.append("\n".join(f"- [`{n}`][refimpl.{mod}.{n}]" for n in sorted(names, key=str.lower)) + "\n")
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
        from refimpl.accounting import combinatorial_sparsity, dispatch_payload, parameter_counts
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


def reading_path(modules: dict[str, Module], compare: bool) -> str:
    """The landing page's reading path: the pages of this build, in order."""
    lines = []
    for name, label in READING_PATH:
        if name in modules:
            title = literate_title(modules[name])
            lines.append(f"1. [{label}](paper/{modules[name].slug}.md): {title}.")
    if compare:
        lines.append(f"1. [Compare the variants](examples/{COMPARE_EXAMPLE}.md): plain MoE, LatentMoE and "
                     "Stable LatentMoE on the same inputs.")
    lines.append("1. [Worked examples](examples/index.md), [benchmark results](benchmark-results/index.md) and the "
                 "[API reference](reference/index.md).")
    return "\n".join(lines) + "\n"


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
#: (kind, name, text): kind "paper" (a module), "example" (an example's stem), "page" (a stand-alone page)
#: or "site" (a fixed page of the site); steps whose page does not exist in a build are left out.
START_HERE: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("Learning the layer", "You want to understand what the block computes, and why.", [
        ("page", "why-stable", "why the plain design needed the stable additions"),
        ("paper", "config", "the sizes and switches, K3's numbers"),
        ("paper", "activations", "the smoothly capped SwiGLU of every expert"),
        ("paper", "routing", "sigmoid scores, the bias that only selects"),
        ("paper", "latent_moe", "the whole block, stage by stage"),
        ("example", "01_forward_by_hand", "the whole forward pass printed on a tiny layer"),
        ("example", "40_compare_variants", "plain MoE, LatentMoE and Stable LatentMoE side by side"),
        ("paper", "backward", "the gradients, section by section beside the forward pass"),
        ("paper", "train", "a small model trained end to end"),
    ]),
    ("Porting it to your framework", "You have your own kernels and want to know they agree.", [
        ("paper", "testing", "checks that take your own function and report where it disagrees"),
        ("example", "30_test_your_router", "run the kit on a router of your own"),
        ("example", "31_mistakes_the_kit_catches", "the mistakes it catches"),
        ("paper", "checkpoint", "one layer of the released weights, read as they are stored"),
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
        ("paper", "train", "the balancers compared while a small model trains"),
        ("page", "report-card", "the report card"),
    ]),
]


def start_here(modules: dict[str, Module], examples: set[str], studies: dict[str, tuple[str, Path]]) -> str:
    """The "Start here" reading paths, with links to the pages of this build."""
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
            elif kind == "site":
                items.append(f"[{text[:1].upper()}{text[1:]}]({name})")
        if items:
            body = "\n".join(f"    {i}. {item}" for i, item in enumerate(items, start=1))
            blocks.append(f'=== "{heading}"\n\n    {who}\n\n{body}\n')
    return "\n".join(blocks)


def landing_page(modules: dict[str, Module], compare: bool, examples: set[str] | None = None,
                 studies: dict[str, tuple[str, Path]] | None = None) -> str | None:
    """`docs/index.md` with its markers replaced by computed content."""
    index = DOCS / "index.md"
    if not index.is_file():
        return None
    text = hand_written(index)
    text = text.replace("<!-- refimpl:k3-numbers -->", k3_numbers())
    text = text.replace("<!-- refimpl:start-here -->", start_here(modules, examples or set(), studies or {}))
    return text.replace("<!-- refimpl:reading-path -->", reading_path(modules, compare))


def parse_ok(path: Path) -> bool:
    """Whether a file parses; a file that does not is reported and left out."""
    try:
        ast.parse(path.read_text(encoding="utf-8"))
    except SyntaxError as exc:
        log.warning("%s does not parse (%s); its pages are left out", path.relative_to(ROOT), exc)
        return False
    return True


def main() -> None:
    """Generate every page and the navigation."""
    modules = {name: m for name, m in discover_modules().items() if all(parse_ok(f) for f in m.files)}
    for name, _ in READING_PATH:
        if name not in modules:
            log.info("refimpl/%s.py does not exist yet: its pages are skipped", name)
    ordered = [modules[name] for name, _ in READING_PATH if name in modules]
    known = {name for name, _ in READING_PATH} | set(INTERNALS)
    extras = [m for name, m in modules.items() if name not in known and not name.startswith("_")]
    internals = [modules[name] for name in INTERNALS if name in modules]
    exported = reexports()

    example_paths = sorted(p for p in EXAMPLES.glob("[0-9][0-9]_*.py") if parse_ok(p)) if EXAMPLES.is_dir() else []
    start = time.perf_counter()
    runs = run_examples(example_paths)
    EXAMPLE_RUNS.update({path.stem: run for path, run in runs.items()})
    fresh = [p.name for p, r in runs.items() if not r.cached]
    log.info("examples: %d reused from .cache/examples, %d run (%s) in %.1f s", len(runs) - len(fresh),
             len(fresh), ", ".join(fresh) or "none", time.perf_counter() - start)
    example_titles: dict[Path, str] = {}
    served_notebooks: set[Path] = set()
    for path, run in runs.items():
        if run.returncode != 0:
            log.warning("examples/%s failed (exit %s):\n%s", path.name, run.returncode,
                        (run.stderr or run.stdout).strip()[-3000:])
        notebook = example_notebook(path, run) if run.returncode == 0 else None
        if notebook is not None:
            with mkdocs_gen_files.open(f"examples/{path.stem}.ipynb", "w") as handle:
                handle.write(notebook)
            served_notebooks.add(path)
        write(f"examples/{path.stem}.md", example_page(path, run, notebook is not None),
              edit=f"examples/{path.name}")
        for name, data in run.figures.items():
            if name.lower().endswith(IMAGE_SUFFIXES):
                with mkdocs_gen_files.open(f"examples/{path.stem}/{name}", "wb") as handle:
                    handle.write(data)
        example_titles[path] = example_title(path)[0]
    uses = {path: modules_used(path.read_text(encoding="utf-8"), exported) for path in example_paths}

    test_paths = sorted(p for p in TESTS.glob("test_*.py") if parse_ok(p)) if TESTS.is_dir() else []
    for path in test_paths:
        write(f"tests/{path.stem}.md", tests_page(path), edit=f"tests/{path.name}")

    all_modules = ordered + extras + internals
    for module in all_modules:
        tests = {p: cases_in(p) for p in tests_of_module(module.name) if p in test_paths}
        examples = [(p, example_titles[p]) for p in example_paths if module.name in uses[p]]
        write(f"paper/{module.slug}.md", module_page(module, examples, tests),
              edit=module.files[0].relative_to(ROOT).as_posix())
        extra_names = [n for n, mod in exported.items() if mod == module.name]
        write(f"reference/{module.slug}.md", reference_page(module, extra_names),
              edit=module.files[0].relative_to(ROOT).as_posix())
    write("reference/index.md", reference_index(all_modules, exported), edit="refimpl/__init__.py")

    examples_index = ["# Worked examples\n",
                      "Each example is a script in `examples/` that runs in seconds. The site runs every one "
                      "when it is built and shows what it printed and the figures it drew. Each is also a "
                      "notebook with the outputs of that run: step through it cell by cell, and change it.\n",
                      "| | example | uses | notebook |", "|---|---|---|---|"]
    for path in example_paths:
        used = ", ".join(f"[`{m}`](../paper/{m.lstrip('_')}.md)" for m in sorted(uses[path]) if m in modules)
        notebook = f"[`{path.stem}.ipynb`]({path.stem}.ipynb)" if path in served_notebooks else ""
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

    studies = study_pages()
    for slug, (_, path) in studies.items():
        write(f"pages/{slug}.md", hand_written(path), edit=path.relative_to(ROOT).as_posix())

    compare = EXAMPLES / f"{COMPARE_EXAMPLE}.py" in example_paths
    landing = landing_page(modules, compare, {p.stem for p in example_paths}, studies)
    if landing is not None:
        write("index.md", landing, edit="docs/index.md")

    nav = ["* [Home](index.md)"] if landing is not None else []
    nav.append("* The paper, module by module")
    labels = dict(READING_PATH)
    for module in ordered + extras:
        nav.append(f"    * [{labels.get(module.name) or literate_title(module)}](paper/{module.slug}.md)")
    if compare:
        nav.append(f"* [Compare the variants](examples/{COMPARE_EXAMPLE}.md)")
    nav.append("* Worked examples")
    nav.append("    * [All examples](examples/index.md)")
    for path in example_paths:
        if path.stem != COMPARE_EXAMPLE:
            nav.append(f"    * [{path.stem[:2]} · {example_titles[path]}](examples/{path.stem}.md)")
    if studies:
        nav.append("* Studies")
        nav += [f"    * [{title}](pages/{slug}.md)" for slug, (title, _) in studies.items()]
    nav.append("* [Benchmark results](benchmark-results/index.md)")
    if internals:
        nav.append("* Internals")
        nav += [f"    * [{INTERNALS[m.name]}](paper/{m.slug}.md)" for m in internals]
    nav.append("* API reference")
    nav.append("    * [Overview](reference/index.md)")
    nav += [f"    * [{m.dotted}](reference/{m.slug}.md)" for m in all_modules]
    if test_paths:
        nav.append("* Test suite")
        nav += [f"    * [{p.name}](tests/{p.stem}.md)" for p in test_paths]
    write("SUMMARY.md", "\n".join(nav) + "\n")


if __name__ in {"__main__", "<run_path>"}:
    main()
