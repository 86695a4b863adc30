r"""Every worked example as a notebook, made from the script itself, run once and recorded.

The scripts in `examples/` are the only copy of each example's code. They are
written in jupytext's *percent* format, so an editor with a Python notebook
mode (VS Code, PyCharm, Spyder, JupyterLab with jupytext) steps through them
as they are. This module turns each `examples/NN_slug.py` into a notebook,
runs that notebook in a fresh Jupyter kernel in an empty folder, and keeps
the executed notebook as the example's **record**, `examples/NN_slug.ipynb`,
committed next to the script:

* the site is built from the records (the page shows the cells with their
  outputs and figures, and offers the record for download), so building the
  site runs no example;
* the test suite (`tests/test_notebooks.py`) runs every record again the way
  a reader would (copied alone into an empty folder, executed by `nbclient` in
  a fresh kernel) and fails when what it prints or draws differs from the
  record, or when the record was made from another version of the script;
* `make records` (or `python docs/notebooks.py record [NN_slug ...]`)
  refreshes them.

## The convention an example follows

```python
r'''Title of the example, one line.

The intro, Markdown with $math$: it becomes the notebook's first cell and the page's intro.
'''

# %%
from __future__ import annotations
import argparse
...

# %%
def helper(...): ...               # one top-level block per cell: constants, helpers, plots

# %%
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="save the figures in this folder")
    args = parser.parse_args(argv)

    # Step 1: what the first step computes
    # (more comment lines: the step's explanation, Markdown)
    ...                            # compute, then print what was computed

    # Step 2: the second step
    ...
    return results                # a dict the tests read


# %%
if __name__ == "__main__":
    main()
```

* `# %%` at the start of a line separates the top-level blocks, as jupytext
  and every notebook editor read them. (An indented `# %%` is read as a
  `# Step` comment, below, rather than cutting a function apart.)
* `main(argv)` parses its arguments, computes, prints and returns what the
  tests check; `--out DIR` saves the figures (through `refimpl.studies.figures.show_figure`,
  which in a notebook shows them under their cell instead). The tests import
  the script and call `main([...])`.
* In the notebook, `main` is *unrolled*: its body becomes top-level cells.
  The argument parsing at its top becomes one cell that sets the options to
  their defaults, `args = argparse.Namespace(out=None, ...)`, one line per
  option with its help text; each comment line at `main`'s own indentation
  that starts with `# Step` starts a new step: the comment block becomes a
  Markdown cell (`## Step 2: the second step` and the lines after it as
  prose) and the code up to the next step its code cell. The final
  `return X` becomes `result = X`. A reader therefore runs the computation
  step by step, sees each step's result under it, and can inspect every
  intermediate array.
* When `main` cannot be unrolled faithfully (a `return` before its end, a
  `global` or `nonlocal` statement, a `yield`, or a local variable that
  shadows a top-level name its helpers use), the notebook keeps `def main`
  and calls it in one last cell, `result = main([])`. The reason is given by
  `unroll_problem`.
* The `if __name__ == "__main__":` guard is left out of the notebook, and
  nothing in a notebook may depend on where it is run: the recorded runs an
  example replays ship with the package (`refimpl.studies.recorded`), and a record
  that holds a path of the machine that made it is refused.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: A comment that starts a new step, hence a new notebook cell, inside `main` (at its indentation).
STEP = re.compile(r"^# Step\b")
#: A comment that reads the output of the code above it: a Markdown cell right after that code's cell.
READING = re.compile(r"^# What to see:")

#: A `# %%` line inside a block (indented), which `steps_for_indented_markers` turns into a step.
INDENTED_MARKER = re.compile(r"^(?P<indent>[ \t]+)#\s*%%(?P<title>.*)$", re.M)

#: How long one notebook may run when it is recorded or checked (seconds).
TIMEOUT = 900

#: The command that refreshes the records; every message about a stale record names it.
REFRESH = "make records"

#: The second cell of every notebook: where it comes from and how to run it.
NOTE = ("*This notebook is the worked example `examples/{script}` of "
        "[refimpl](https://refimpl.github.io/refimpl/), with the outputs of its recorded run. It runs top to "
        "bottom in any folder, in a Python kernel where refimpl is installed with the extra that draws the "
        "figures (no release is on the package index yet: `pip install \"refimpl[examples] @ "
        "git+https://github.com/refimpl/refimpl\"`, or `pip install \"./refimpl[examples]\"` next to a clone). "
        "Each step is a cell; change a value and run it again.*")


@dataclass
class Cell:
    """One notebook cell: Markdown or code."""

    kind: str  # "markdown" or "code"
    source: str
    metadata: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------
# From the script to cells
# ---------------------------------------------------------------------------

def steps_for_indented_markers(source: str) -> str:
    """`source` with every indented `# %%` line turned into a `# Step` comment at the same indentation.

    jupytext would split a function at such a line; as a step marker it splits only the unrolled `main`.
    """
    def replace(match: re.Match) -> str:
        title = match.group("title").strip()
        return f"{match.group('indent')}# Step{': ' + title if title else ''}"

    return INDENTED_MARKER.sub(replace, source)


def _percent_cells(source: str) -> list[tuple[str, str]]:
    """The top-level cells of a percent-format script, as jupytext reads them: (kind, source)."""
    import jupytext

    notebook = jupytext.reads(source, fmt="py:percent")
    return [(cell.cell_type, cell.source) for cell in notebook.cells if cell.source.strip()]


def _scope_nodes(nodes: list[ast.stmt]):
    """Every node under `nodes` that belongs to their scope (nested functions, classes and lambdas left out)."""
    stack: list[ast.AST] = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue  # its name is bound here, its body belongs to its own scope
        stack.extend(ast.iter_child_nodes(node))


def _bound_names(nodes: list[ast.stmt]) -> set[str]:
    """Names the statements bind in their own scope."""
    names: set[str] = set()
    for node in _scope_nodes(nodes):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _main_node(tree: ast.Module) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)


def _body_without_docstring(node: ast.FunctionDef) -> list[ast.stmt]:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


def unroll_problem(source: str) -> str | None:
    """Why the script's `main` cannot be unrolled into top-level cells, or None when it can."""
    tree = ast.parse(source)
    main = _main_node(tree)
    if main is None:
        return "the script has no top-level `def main`"
    body = _body_without_docstring(main)
    if not body:
        return "`main` is empty"
    if main.args.posonlyargs or main.args.kwonlyargs or main.args.vararg or main.args.kwarg \
            or len(main.args.args) > 1:
        return "`main` takes other arguments than `argv`"
    for node in _scope_nodes(body):
        if isinstance(node, ast.Return) and node is not body[-1]:
            return f"`main` returns early (line {node.lineno})"
        if isinstance(node, ast.Global | ast.Nonlocal):
            return f"`main` has a `{type(node).__name__.lower()}` statement (line {node.lineno})"
        if isinstance(node, ast.Yield | ast.YieldFrom | ast.Await):
            return f"`main` is a generator or a coroutine (line {node.lineno})"
    top_level = _bound_names([n for n in tree.body if n is not main])
    shadowed = sorted(_bound_names(body) & top_level)
    if shadowed:
        return f"`main` binds names that are also top-level names: {', '.join(shadowed)}"
    return None


def _is_parse_args(node: ast.stmt) -> bool:
    """Whether a statement calls `<parser>.parse_args(...)` (assigning its result or not)."""
    value = node.value if isinstance(node, ast.Assign | ast.Expr) else None
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "parse_args"


def _options_prelude(main: ast.FunctionDef) -> tuple[list[ast.stmt], str | None]:
    """The statements of `main` that build and run its argument parser, and the name the options go to.

    They are the statements up to the first `parse_args` call; none when `main` parses no arguments.
    """
    body = _body_without_docstring(main)
    for position, node in enumerate(body):
        if _is_parse_args(node):
            target = None
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target = node.targets[0].id
            return body[: position + 1], target
    return [], None


def _literal(value: object) -> str:
    """Python source for an option's default value (a literal, or a `Path`)."""
    if isinstance(value, Path):
        return f"Path({str(value)!r})"
    text = repr(value)
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"an option's default {value!r} is not a literal the notebook can hold") from exc
    return text


def options_cell(script: Path, source: str, main: ast.FunctionDef) -> tuple[str | None, int]:
    """The notebook cell that sets `main`'s options to their defaults, and the last line of `main` it replaces.

    The parser is built by running the prelude of `main` (its statements up to `parse_args`) with an
    empty argument list in the script's own namespace, so every default is the script's own.
    """
    prelude, target = _options_prelude(main)
    if not prelude:
        return None, 0
    last = prelude[-1].end_lineno
    if target is None:  # the options are parsed (so `--help` works) but not used
        return None, last
    lines = source.splitlines()
    code = textwrap.dedent("\n".join(lines[prelude[0].lineno - 1: last]))
    namespace = dict(vars(load_script(script)))
    parameter = main.args.args[0].arg if main.args.args else "argv"
    namespace[parameter] = []
    exec(compile(code, f"<options of {script.name}>", "exec"), namespace)
    args = namespace[target]
    parse = prelude[-1].value
    parser = namespace[parse.func.value.id] if isinstance(parse.func.value, ast.Name) else None
    helps = {}
    if isinstance(parser, argparse.ArgumentParser):
        helps = {a.dest: (a.help or "") for a in parser._actions if a.dest != "help"}
    names = list(vars(args))
    items = [(f"{name}={_literal(getattr(args, name))},", helps.get(name, "")) for name in names]
    width = max((len(text) for text, _ in items), default=0)
    body = "\n".join(f"    {text:<{width}}  # {comment}".rstrip().rstrip("#").rstrip() for text, comment in items)
    head = f"# The options of `python examples/{script.name}`, at their defaults (`--help` lists them)."
    if "out" in names:
        head += "\n# With out=None the figures are shown under the cells that draw them, not saved."
    return f"{head}\n{target} = argparse.Namespace(\n{body}\n)", last


def _comment_prose(lines: list[str]) -> str:
    """Comment lines (without their `#`) as Markdown: lines run together, an empty line starts a paragraph and
    a line that starts a list item (`1. `, `- `) starts a line of its own."""
    text = ""
    for line in (part.strip() for part in lines):
        if not line:
            text = text.rstrip(" ") + "\n\n"
        elif re.match(r"^(\d+\.|-)\s", line) and text and not text.endswith("\n"):
            text = text.rstrip(" ") + "\n" + line + " "
        else:
            text += line + " "
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _step_cells(code: str) -> list[Cell]:
    """Dedented code of `main` split into steps: each `# Step` comment block becomes a Markdown cell.

    A `# What to see:` comment block (at `main`'s indentation, after a step's code) becomes a Markdown cell
    after that code's cell, so that the reading of the output comes right under it.
    """
    cells: list[Cell] = []
    lines = code.split("\n")
    current: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if READING.match(line):
            if "\n".join(current).strip():
                cells.append(Cell("code", "\n".join(current).strip("\n")))
            current = []
            comment = []
            while i < len(lines) and lines[i].startswith("#") and not STEP.match(lines[i]):
                comment.append(re.sub(r"^#\s?", "", lines[i]))
                i += 1
            text = re.sub(r"^What to see:\s*", "", _comment_prose(comment)).strip()
            text = text[:1].upper() + text[1:]
            cells.append(Cell("markdown", f"**What to see.** {text}", {"refimpl": "reading"}))
            continue
        if STEP.match(line):
            if "\n".join(current).strip():
                cells.append(Cell("code", "\n".join(current).strip("\n")))
            current = []
            comment = []
            while i < len(lines) and lines[i].startswith("#"):
                comment.append(re.sub(r"^#\s?", "", lines[i]))
                i += 1
            head, *rest = comment
            title = re.sub(r"^Step\s*:\s*", "", head).strip().rstrip(".")
            title = title[:1].upper() + title[1:]
            text = f"## {title}" + ("\n\n" + "\n".join(rest).strip() if "\n".join(rest).strip() else "")
            cells.append(Cell("markdown", text, {"refimpl": "step"}))
            continue
        current.append(line)
        i += 1
    if "\n".join(current).strip():
        cells.append(Cell("code", "\n".join(current).strip("\n")))
    return cells


def _end_with_trailing_comments(lines: list[str], node: ast.FunctionDef) -> int:
    """The last line of `node` (1-based), counting the comment lines right after it, indented as its body or more.

    Python ends a function at its last statement; a `# What to see:` block after a final loop belongs to the
    function all the same, as its reading of the last step.
    """
    indent = " " * node.body[0].col_offset
    end = last = node.end_lineno
    while end < len(lines) and (not lines[end].strip()
                                or (lines[end].startswith(indent) and lines[end].lstrip().startswith("#"))):
        end += 1
        if lines[end - 1].strip():
            last = end
    return last


def _unrolled_main(source: str, main: ast.FunctionDef, skip_until: int) -> list[Cell]:
    """The body of `main` as top-level cells (after line `skip_until`, the options), split at its steps."""
    lines = source.splitlines()
    body = _body_without_docstring(main)
    rest = [node for node in body if node.lineno > skip_until]
    if not rest:
        return []
    indent = body[0].col_offset
    start = rest[0].lineno
    while start - 2 >= max(main.lineno, skip_until) and lines[start - 2].strip().startswith("#") \
            and len(lines[start - 2]) - len(lines[start - 2].lstrip()) == indent:
        start -= 1  # comments just above the first statement belong to it
    last = body[-1]
    text = lines[start - 1: _end_with_trailing_comments(lines, main)]
    if isinstance(last, ast.Return):
        row = last.lineno - start
        head = " " * indent + "return"
        text[row] = (" " * indent + "result = " + text[row][len(head):].lstrip()) if last.value is not None else ""
    return _step_cells(textwrap.dedent("\n".join(text)))


def _remove_lines(cell: str, first: int, last: int) -> str:
    """`cell` without its lines `first`..`last` (1-based, inclusive)."""
    lines = cell.split("\n")
    return "\n".join(lines[: first - 1] + lines[last:])


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    names = [ast.unparse(node.test.left)] + [ast.unparse(c) for c in node.test.comparators]
    return "__name__" in names and any(n.strip("'\"") == "__main__" for n in names)


def _uses_module_doc(sources: list[str]) -> bool:
    for text in sources:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        if any(isinstance(node, ast.Name) and node.id == "__doc__" for node in ast.walk(tree)):
            return True
    return False


def _insert_after_future_imports(text: str, line: str) -> str:
    """`text` with `line` added after its `from __future__` imports (which must stay first), or at its top."""
    tree = ast.parse(text)
    futures = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    lines = text.split("\n")
    at = futures[-1].end_lineno if futures else 0
    return "\n".join(lines[:at] + [line] + lines[at:])


def script_cells(script: Path) -> list[Cell]:
    """The notebook cells of an example script (see the module docstring for the rules)."""
    source = steps_for_indented_markers(Path(script).read_text(encoding="utf-8"))
    problem = unroll_problem(source)
    tree = ast.parse(source)
    main = _main_node(tree)
    cells: list[Cell] = []
    title = ""
    closing = ""  # the reading after a main that is called whole
    for kind, text in _percent_cells(source):
        if kind == "markdown":
            cells.append(Cell("markdown", text))
            continue
        try:
            cell_tree = ast.parse(text)
        except SyntaxError:
            cells.append(Cell("code", text))
            continue
        statements = list(cell_tree.body)
        if statements and not cells and isinstance(statements[0], ast.Expr) \
                and isinstance(statements[0].value, ast.Constant) and isinstance(statements[0].value.value, str):
            doc = textwrap.dedent(statements[0].value.value).strip()
            first, _, rest = doc.partition("\n")
            title = first.strip().rstrip(".")
            cells.append(Cell("markdown", f"# {title}\n\n{textwrap.dedent(rest).strip()}"))
            cells.append(Cell("markdown", NOTE.format(script=Path(script).name), {"refimpl": "note"}))
            text = _remove_lines(text, statements[0].lineno, statements[0].end_lineno)
            statements = statements[1:]
        # Remove from the bottom up, so earlier line numbers stay valid.
        for node in reversed(statements):
            is_main = isinstance(node, ast.FunctionDef) and node.name == "main" and main is not None
            if not (is_main or _is_main_guard(node)):
                continue
            lines = text.split("\n")
            end = _end_with_trailing_comments(lines, node) if is_main else node.end_lineno
            if is_main and problem is not None:
                # A main called whole keeps its definition; the reading after it comes after the call.
                closing = textwrap.dedent("\n".join(lines[node.end_lineno: end]))
                text = _remove_lines(text, node.end_lineno + 1, end)
            else:
                first_line = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                text = _remove_lines(text, first_line, end)
        if text.strip():
            cells.append(Cell("code", text.strip("\n")))
    if main is not None and problem is None:
        options, last = options_cell(Path(script), source, main)
        if options is not None:
            cells.append(Cell("code", options))
        cells += _unrolled_main(source, main, last)
    elif main is not None:
        call = "result = main([])  # the script's defaults" if main.args.args else "result = main()"
        cells.append(Cell("code", call))
        cells += [cell for cell in _step_cells(closing) if cell.kind == "markdown"]
    code = [c.source for c in cells if c.kind == "code"]
    if title and _uses_module_doc(code):
        # Code that reads `__doc__` (an argument parser's description) gets the title, as a script would.
        first_code = next(c for c in cells if c.kind == "code")
        first_code.source = _insert_after_future_imports(
            first_code.source, f"__doc__ = {title!r}  # the title of this notebook, read by the code below")
    return cells


def load_script(path: Path):
    """Import `path` as a module of its own (examples/ is not a package), without running its `main`."""
    name = f"refimpl_notebooks_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# The notebook, executed in a fresh kernel in an empty folder
# ---------------------------------------------------------------------------

def notebook(cells: list[Cell], script_name: str):
    """An nbformat v4 notebook of `cells`, without outputs."""
    from nbformat import v4

    nb = v4.new_notebook()
    nb.metadata.update({
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "refimpl": {"source": f"examples/{script_name}", "refresh": REFRESH},
    })
    for number, cell in enumerate(cells):
        new = v4.new_markdown_cell(cell.source) if cell.kind == "markdown" else v4.new_code_cell(cell.source)
        # Ids by position, not nbformat's random ones: refreshing a record changes only what the run changed.
        new.id = f"cell-{number}"
        if cell.metadata:
            new.metadata.update(copy.deepcopy(cell.metadata))
        nb.cells.append(new)
    return nb


def execute(nb, folder: Path, timeout: int = TIMEOUT):
    """Run every cell of `nb` in a fresh Python kernel whose working folder is `folder`; the executed copy.

    A failing cell raises `nbclient.exceptions.CellExecutionError` with the cell's traceback.

    The kernel talks to this process over Unix sockets in a private folder where the system has them. Over TCP
    (Jupyter's default, and the fallback elsewhere) the client picks five free ports, frees them and hands their
    numbers to the kernel, which binds them a moment later; another process starting a kernel or a server in that
    moment can take one, and the kernel dies before it answers ("Kernel died before replying to kernel_info").
    Several notebooks run at once in the test suite, so that race is met, not hypothetical. A socket file named
    after a folder of this run's own cannot be taken by anyone else.
    """
    from nbclient import NotebookClient

    nb = copy.deepcopy(nb)
    with _unix_sockets() as config:
        # The kernel's own log (its start-up warnings) is not the example's.
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False, config=config,
                                extra_arguments=["--IPKernelApp.log_level=ERROR"],
                                resources={"metadata": {"path": str(folder)}})
        client.execute()
    return nb


#: The longest folder the kernel's socket files may be put in: a Unix socket's path holds at most 104 bytes
#: (macOS; 108 on Linux), and the files are named `<folder>/refimpl-kernel-XXXXXXXX/kernel-ipc-N` below it.
SOCKET_FOLDER_LIMIT = 60


def _socket_folder() -> str | None:
    """Where the kernel's socket files go: the system's temporary folder, or /tmp where that is too long to
    hold them; None where neither will do (no Unix sockets then, Jupyter's TCP)."""
    if os.name != "posix":
        return None
    for folder in (tempfile.gettempdir(), "/tmp"):
        if len(os.fsencode(folder)) <= SOCKET_FOLDER_LIMIT and os.path.isdir(folder) and os.access(folder, os.W_OK):
            return folder
    return None


@contextlib.contextmanager
def _unix_sockets():
    """Configuration for a kernel manager whose sockets are files in a folder of its own, removed afterwards with
    whatever the kernel left in it; empty (Jupyter's TCP default) where no such folder can be made."""
    from traitlets.config import Config

    base = _socket_folder()
    if base is None:
        yield Config()
        return
    sockets = tempfile.mkdtemp(prefix="refimpl-kernel-", dir=base)
    try:
        yield Config({"KernelManager": {"transport": "ipc", "connection_file": os.path.join(sockets, "kernel.json")}})
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def coalesce_streams(nb) -> None:
    """Join each cell's consecutive outputs to the same stream into one (the kernel sends printed text in
    chunks whose boundaries depend on timing; the record keeps what was printed, not how it was sent)."""
    for cell in nb.cells:
        merged = []
        for output in cell.get("outputs", []):
            if (output.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                    and merged[-1].get("name") == output.get("name")):
                merged[-1]["text"] += output["text"]
            else:
                merged.append(output)
        if "outputs" in cell:
            cell["outputs"] = merged


def machine_paths(text: str, *folders: Path) -> list[str]:
    """The places in `text` that name a folder of this machine: `folders`, the repository, the home folder."""
    names = {str(Path(f).resolve()) for f in folders} | {str(Path(f)) for f in folders}
    names |= {str(ROOT), str(Path.home()), tempfile.gettempdir() + os.sep}
    found = []
    for name in sorted(n for n in names if len(n) > 1):
        at = text.find(name)
        if at >= 0:
            found.append(text[max(0, at - 60): at + len(name) + 60])
    return found


def record(script: Path, timeout: int = TIMEOUT) -> tuple[str, float]:
    """Make the record of one example: its notebook, executed alone in an empty folder. (JSON text, seconds.)"""
    import nbformat

    script = Path(script)
    nb = notebook(script_cells(script), script.name)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="refimpl-record-") as folder:
        executed = execute(nb, Path(folder), timeout)
        coalesce_streams(executed)
        text = nbformat.writes(executed)
        found = machine_paths(text, Path(folder))
    if found:
        raise ValueError(f"the record of {script.name} would hold paths of this machine: {found}")
    nbformat.validate(nbformat.reads(text, as_version=4))
    return text + ("" if text.endswith("\n") else "\n"), time.perf_counter() - start


def record_path(script: Path) -> Path:
    """Where the record of `examples/NN_slug.py` lives: `examples/NN_slug.ipynb`."""
    return Path(script).with_suffix(".ipynb")


def examples(names: list[str] | None = None) -> list[Path]:
    """The example scripts, all of them or those named (`10_qb_by_hand`, `10`, or a path)."""
    every = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
    if not names:
        return every
    chosen = []
    for name in names:
        stem = Path(name).stem
        match = [p for p in every if p.stem == stem or p.stem.startswith(f"{stem}_")]
        if not match:
            raise SystemExit(f"no example called {name!r} in examples/ (they are {', '.join(p.stem for p in every)})")
        chosen += [p for p in match if p not in chosen]
    return chosen


def _record_one(script: Path) -> str:
    text, seconds = record(script)
    target = record_path(script)
    old = target.read_text(encoding="utf-8") if target.is_file() else None
    from refimpl._lib.files import write_atomically

    write_atomically(target, text, make_folder=True)
    state = "unchanged" if old == text else ("written" if old is None else "refreshed")
    return f"{target.relative_to(ROOT)}: {state} ({seconds:.0f} s)"


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python docs/notebooks.py",
                                     description="Run worked examples as notebooks and record them.")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run examples in a fresh kernel and write examples/NN_slug.ipynb")
    rec.add_argument("names", nargs="*", help="examples to record (NN_slug or NN); all when none is given")
    rec.add_argument("--jobs", "-j", type=int, default=1, help="notebooks to run at the same time")
    show = sub.add_parser("cells", help="print the cells the notebook of one example is made of")
    show.add_argument("name")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if args.command == "cells":
        for cell in script_cells(examples([args.name])[0]):
            print(f"--- {cell.kind}\n{cell.source}")
        return 0
    scripts = examples(args.names)
    print(f"recording {len(scripts)} example(s), {args.jobs} at a time; each runs in a fresh kernel", flush=True)
    failed = []

    def one(script: Path) -> None:
        try:
            print(_record_one(script), flush=True)
        except Exception as exc:  # report every failure, then exit non-zero
            failed.append(script.name)
            print(f"{script.name}: FAILED: {type(exc).__name__}: {str(exc)[-3000:]}", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, scripts))
    if failed:
        print(f"{len(failed)} example(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
