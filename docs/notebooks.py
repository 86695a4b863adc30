r"""Every worked example as a notebook, made from the script itself.

The scripts in `examples/` are the only copy of each example. They are written
in jupytext's *percent* format, so an editor with a Python notebook mode (VS
Code, PyCharm, Spyder, JupyterLab with jupytext) steps through them as they
are, and this module turns each into `examples/NN_slug.ipynb` for the site.

## The convention an example follows

```python
r'''Title of the example, one line.

The intro, Markdown with $math$: it becomes the page's intro and the notebook's first cell.
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    ...                            # the first step of the computation

    # Step 2: what it does
    ...                            # a `# Step` comment at main's indentation starts a notebook cell
    return results                # a dict the tests read


# %%
if __name__ == "__main__":
    main()
```

* `# %%` at the start of a line separates the top-level blocks, as jupytext
  and every notebook editor read them. (An indented `# %%` is read as a
  `# Step` comment, below, rather than cutting a function apart.)
* `main(argv)` parses its arguments, computes, prints and returns what the
  tests check; `--out DIR` saves the figures. The tests import the script and
  call `main([...])`; the site runs it with `--out`.
* In the notebook, `main` is *unrolled*: its body becomes cells at top level,
  split before each comment line at `main`'s own indentation that starts with
  `# Step` (`# Step 2: the margins`, `# Step: the figures`), after a first
  line `argv = ["--out", "figures"]`; its final `return X` becomes
  `result = X`. A reader therefore runs the computation step by step and
  inspects every intermediate array. (`# %%` itself cannot mark these steps:
  jupytext and some editors take an indented `# %%` for a cell boundary too,
  which would cut `main` apart.)
* When `main` cannot be unrolled faithfully (a `return` before its end, a
  `global` or `nonlocal` statement, a `yield`, or a local variable that
  shadows a top-level name its helpers use), the notebook keeps `def main`
  and calls it in one last cell, `result = main(argv)`. The reason is given
  by `unroll_problem`.
* The `if __name__ == "__main__":` guard is left out of the notebook.

## One run for the page and the notebook

`python docs/notebooks.py run SCRIPT OUT RESULT.json` executes the notebook's
code cells in order in a fresh interpreter (as a kernel would: a new
`__main__` module, `from __future__` flags carried from cell to cell, the value
of a cell's last expression kept as its result) with `--out OUT`, and records
each cell's printed text, result and the files it saved. The site generator
uses that one run twice: the example's page shows the printed text of all
cells, and the notebook carries each cell's output and the figures it saved.
The tests compare that text with what `python examples/NN_slug.py` prints.
"""

from __future__ import annotations
import __future__

import ast
import base64
import contextlib
import io
import json
import re
import sys
import textwrap
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

#: A comment that starts a new step, hence a new notebook cell, inside `main` (at its indentation).
STEP = re.compile(r"^# Step\b")

#: A `# %%` line inside a block (indented), which `steps_for_indented_markers` turns into a step.
INDENTED_MARKER = re.compile(r"^(?P<indent>[ \t]+)#\s*%%(?P<title>.*)$", re.M)

#: The argument list the notebook's unrolled `main` starts from (figures go to `./figures`).
NOTEBOOK_ARGV = ["--out", "figures"]

#: Image files a cell saves that the notebook shows as the cell's output, with their MIME types.
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".svg": "image/svg+xml"}


@dataclass
class Cell:
    """One notebook cell: Markdown or code, and what running it produced."""

    kind: str  # "markdown" or "code"
    source: str
    stdout: str = ""
    result: str | None = None  # repr of the last expression's value, when not None
    files: list[str] = field(default_factory=list)  # files the cell saved under the output folder
    error: str | None = None


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


def _unrolled_main(source: str, main: ast.FunctionDef, argv: list[str]) -> list[str]:
    """The body of `main` as top-level code cells, split before its `# Step` comments."""
    lines = source.splitlines()
    body = _body_without_docstring(main)
    indent = body[0].col_offset
    start = body[0].lineno
    while start - 2 >= main.lineno and lines[start - 2].strip().startswith("#") \
            and len(lines[start - 2]) - len(lines[start - 2].lstrip()) == indent:
        start -= 1  # comments just above the first statement belong to it
    last = body[-1]
    text = lines[start - 1: main.end_lineno]
    if isinstance(last, ast.Return):
        row = last.lineno - start
        head = " " * indent + "return"
        text[row] = (" " * indent + "result = " + text[row][len(head):].lstrip()) if last.value is not None else ""
    code = textwrap.dedent("\n".join(text))
    parameter = main.args.args[0].arg if main.args.args else None
    if parameter is not None:
        code = f"{parameter} = {argv!r}  # the command-line arguments of the script\n" + code
    cells: list[str] = []
    current: list[str] = []
    for line in code.split("\n"):
        if STEP.match(line):
            cells.append("\n".join(current))
            current = []
        current.append(line)
    cells.append("\n".join(current))
    return [c.strip("\n") for c in cells if c.strip()]


def _remove_lines(cell: str, first: int, last: int) -> str:
    """`cell` without its lines `first`..`last` (1-based, inclusive)."""
    lines = cell.split("\n")
    return "\n".join(lines[: first - 1] + lines[last:])


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    names = [ast.unparse(node.test.left)] + [ast.unparse(c) for c in node.test.comparators]
    return "__name__" in names and any(n.strip("'\"") == "__main__" for n in names)


def _uses_module_doc(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Name) and node.id == "__doc__" for node in ast.walk(tree))


def _insert_after_future_imports(text: str, line: str) -> str:
    """`text` with `line` added after its `from __future__` imports (which must stay first), or at its top."""
    tree = ast.parse(text)
    futures = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    lines = text.split("\n")
    at = futures[-1].end_lineno if futures else 0
    return "\n".join(lines[:at] + [line] + lines[at:])


def script_cells(source: str, argv: list[str] | None = None) -> list[Cell]:
    """The notebook cells of an example script (see the module docstring for the rules).

    `argv` is the argument list the unrolled `main` starts from (`NOTEBOOK_ARGV` by default).
    """
    argv = NOTEBOOK_ARGV if argv is None else argv
    source = steps_for_indented_markers(source)
    problem = unroll_problem(source)
    tree = ast.parse(source)
    main = _main_node(tree)
    cells: list[Cell] = []
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
            cells.append(Cell("markdown", f"# {first.strip().rstrip('.')}\n\n{textwrap.dedent(rest).strip()}"))
            text = _remove_lines(text, statements[0].lineno, statements[0].end_lineno)
            statements = statements[1:]
            if _uses_module_doc(tree):
                # The docstring is now a Markdown cell; the code that reads `__doc__` (an argument
                # parser's description) gets its first line, as a script would.
                line = f"__doc__ = {first.strip()!r}  # the title of the first cell, read by the argument parser"
                text = _insert_after_future_imports(text, line)
        # Remove from the bottom up, so earlier line numbers stay valid.
        for node in reversed(statements):
            is_main = isinstance(node, ast.FunctionDef) and node.name == "main" and main is not None
            if _is_main_guard(node) or (is_main and problem is None):
                first_line = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                text = _remove_lines(text, first_line, node.end_lineno)
        if text.strip():
            cells.append(Cell("code", text.strip("\n")))
    if main is not None and problem is None:
        cells += [Cell("code", text) for text in _unrolled_main(source, main, argv)]
    elif main is not None:
        parameter = "argv" if main.args.args else None
        call = f"result = main({parameter})" if parameter else "result = main()"
        prefix = f"argv = {argv!r}  # the command-line arguments of the script\n" if parameter else ""
        cells.append(Cell("code", prefix + call))
    return cells


# ---------------------------------------------------------------------------
# Running the cells in order, as a kernel would
# ---------------------------------------------------------------------------

def _snapshot(folder: Path) -> dict[str, float]:
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def run_cells(script: Path, out: Path) -> list[Cell]:
    """Execute the notebook cells of `script` in this interpreter, with `--out out`, recording each cell's output.

    Stops at the first cell that raises; that cell's `error` holds the traceback.
    """
    script = script.resolve()
    source = script.read_text(encoding="utf-8")
    cells = script_cells(source, ["--out", str(out)])
    out.mkdir(parents=True, exist_ok=True)
    module = types.ModuleType("__main__")
    module.__file__ = str(script)
    module.__doc__ = ast.get_docstring(ast.parse(source), clean=False)
    sys.modules["__main__"] = module
    sys.argv = [str(script), "--out", str(out)]  # what a script that reads sys.argv itself would see
    sys.path.insert(0, str(script.parent))
    flags = 0
    for index, cell in enumerate(cells):
        if cell.kind != "code":
            continue
        before = _snapshot(out)
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                tree = ast.parse(cell.source)
                for node in tree.body:
                    if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                        for alias in node.names:
                            flags |= getattr(__future__, alias.name).compiler_flag
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                name = f"<cell {index}>"
                exec(compile(tree, name, "exec", flags=flags, dont_inherit=True), module.__dict__)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), name, "eval", flags=flags, dont_inherit=True),
                                 module.__dict__)
                    cell.result = None if value is None else repr(value)
        except BaseException:  # noqa: BLE001  (a cell that fails is reported, as a kernel does)
            cell.error = traceback.format_exc()
        cell.stdout = buffer.getvalue()
        after = _snapshot(out)
        cell.files = sorted(name for name, stamp in after.items() if before.get(name) != stamp)
        if cell.error:
            break
    return cells


def printed_text(cells: list[Cell]) -> str:
    """Everything the cells printed, in order: what the script prints when run as a whole."""
    return "".join(cell.stdout for cell in cells)


# ---------------------------------------------------------------------------
# The notebook file
# ---------------------------------------------------------------------------

def notebook_json(cells: list[Cell], out: Path | None, *, script_name: str, files: dict[str, bytes] | None = None,
                  ) -> str:
    """The `.ipynb` text (nbformat v4) of executed cells; images a cell saved become its display outputs.

    The images are read from `files` (name -> bytes) when given, else from the folder `out`.
    """
    import jupytext
    import nbformat
    from nbformat import v4

    notebook = v4.new_notebook()
    notebook.metadata.update({
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python", "version": f"{sys.version_info.major}.{sys.version_info.minor}"},
        "refimpl": {"source": f"examples/{script_name}", "generated": "docs/notebooks.py"},
    })
    count = 0
    note = (f"*This notebook is made from the script `examples/{script_name}`, with the outputs of the run the "
            "site shows. Run it from the repository's root folder, where `refimpl` is installed (`make venv`, "
            "then the `.venv` interpreter as the kernel); figures are saved under `figures/`.*")
    for number, cell in enumerate(cells):
        if cell.kind == "markdown":
            notebook.cells.append(v4.new_markdown_cell(cell.source + ("\n\n" + note if number == 0 else "")))
            continue
        count += 1
        outputs = []
        if cell.stdout:
            outputs.append(v4.new_output("stream", name="stdout", text=cell.stdout))
        for name in cell.files:
            mime = IMAGE_TYPES.get(Path(name).suffix.lower())
            data = (files or {}).get(name)
            if data is None and out is not None and (out / name).is_file():
                data = (out / name).read_bytes()
            if mime is None or data is None:
                continue
            payload = data.decode("utf-8") if mime == "image/svg+xml" else base64.b64encode(data).decode("ascii")
            outputs.append(v4.new_output("display_data", data={mime: payload, "text/plain": f"<{name}>"},
                                         metadata={"filename": name}))
        if cell.result is not None:
            outputs.append(v4.new_output("execute_result", data={"text/plain": cell.result}, execution_count=count))
        if cell.error:
            lines = cell.error.rstrip("\n").split("\n")
            outputs.append(v4.new_output("error", ename=lines[-1].split(":")[0], evalue=lines[-1],
                                         traceback=lines))
        notebook.cells.append(v4.new_code_cell(cell.source, outputs=outputs, execution_count=count))
    nbformat.validate(notebook)
    return jupytext.writes(notebook, fmt="ipynb")


def cells_to_json(cells: list[Cell]) -> list[dict]:
    return [cell.__dict__ for cell in cells]


def cells_from_json(data: list[dict]) -> list[Cell]:
    return [Cell(**item) for item in data]


def _main(argv: list[str]) -> int:
    """`run SCRIPT OUT RESULT.json`: run the cells of SCRIPT and save what each produced."""
    if len(argv) != 4 or argv[0] != "run":
        print("usage: python docs/notebooks.py run SCRIPT OUT RESULT.json", file=sys.stderr)
        return 2
    script, out, result = Path(argv[1]), Path(argv[2]), Path(argv[3])
    real_stdout = sys.stdout
    cells = run_cells(script, out)
    result.write_text(json.dumps(cells_to_json(cells), indent=1), encoding="utf-8")
    real_stdout.write(printed_text(cells))
    failed = next((c for c in cells if c.error), None)
    if failed is not None:
        sys.stderr.write(f"a cell of {script.name} raised:\n{failed.source}\n{failed.error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
