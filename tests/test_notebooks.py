"""Every worked example as a notebook: the conversion's rules, and notebooks that reproduce their scripts.

`docs/notebooks.py` turns a percent-cell script into notebook cells. Its rules
are checked first on small made-up scripts whose cells are known by hand, and
on a script whose `main` cannot be unrolled. Then, for every example, the
notebook the site serves (`examples/NN_slug.ipynb` of the build shared with
`test_docs_build.py`) must be valid nbformat v4 and carry outputs, and its code
cells, executed in order in a fresh interpreter by a loop written here (not
the converter's own runner), must print what each cell's recorded output says
and, all together, what `python examples/NN_slug.py` prints (the script is run
for the quicker examples).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from conftest import load_script
from test_docs_build import build_site

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))

#: The examples whose notebook is also compared with a run of the script itself.
SCRIPT_COMPARED = {"01_forward_by_hand", "02_k3_accounting", "10_qb_by_hand", "12_lp_crosscheck",
                   "40_compare_variants"}


@pytest.fixture(scope="module")
def nb():
    """`docs/notebooks.py`, imported as a module."""
    return load_script(ROOT / "docs" / "notebooks.py", "refimpl_docs_notebooks_under_test")


SCRIPT = textwrap.dedent('''\
    r"""A made-up example.

    Its intro, with $x^2$.
    """

    # %%
    from __future__ import annotations

    import argparse
    from pathlib import Path

    SCALE = 3


    # %%
    def triple(x: int) -> int:
        return SCALE * x


    # %%
    def main(argv: list[str] | None = None) -> dict:
        parser = argparse.ArgumentParser()
        parser.add_argument("--out", type=Path, default=None)
        args = parser.parse_args(argv)
        value = triple(2)
        print("value", value)

        # Step 2: the second step
        doubled = 2 * value
        print("doubled", doubled)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "plot.png").write_bytes(b"\\x89PNG fake")
        return {"value": value, "doubled": doubled}


    # %%
    if __name__ == "__main__":
        main()
    ''')


# ---------------------------------------------------------------------------
# The conversion's rules, on made-up scripts
# ---------------------------------------------------------------------------

def test_cells_of_a_script_that_follows_the_convention(nb):
    cells = nb.script_cells(SCRIPT, ["--out", "figs"])
    kinds = [c.kind for c in cells]
    assert kinds == ["markdown", "code", "code", "code", "code"]
    assert cells[0].source == "# A made-up example\n\nIts intro, with $x^2$."
    assert cells[1].source.startswith("from __future__ import annotations")
    assert cells[2].source.startswith("def triple")
    # main is unrolled: its def and the __main__ guard are gone, its body is split at its `# %%` line.
    assert not any("def main" in c.source or "__name__" in c.source for c in cells)
    assert cells[3].source.startswith("argv = ['--out', 'figs']")
    assert "parser.parse_args(argv)" in cells[3].source and "print(\"value\", value)" in cells[3].source
    assert cells[4].source.startswith("# Step 2: the second step\ndoubled = 2 * value")
    assert cells[4].source.rstrip().endswith('result = {"value": value, "doubled": doubled}')
    assert all(not line.startswith(" ") for line in cells[3].source.splitlines())  # dedented to top level


@pytest.mark.parametrize("body, reason", [
    ("    if argv:\n        return {}\n    return {'a': 1}\n", "returns early"),
    ("    global SCALE\n    SCALE = 2\n    return {}\n", "global"),
    ("    triple = 5\n    return {'t': triple}\n", "top-level names: triple"),
])
def test_a_main_that_cannot_be_unrolled_is_called_whole(nb, body, reason):
    source = "SCALE = 1\n\n# %%\ndef triple(x):\n    return x\n\n# %%\ndef main(argv=None):\n" + body
    assert reason in nb.unroll_problem(source)
    cells = nb.script_cells(source, [])
    assert any(c.source.startswith("def main(") for c in cells)
    assert cells[-1].source == "argv = []  # the command-line arguments of the script\nresult = main(argv)"


def test_an_indented_cell_marker_starts_a_step_not_a_cell(nb):
    source = SCRIPT.replace("    # Step 2: the second step", "    # %% the second step")
    cells = nb.script_cells(source, [])
    assert [c.kind for c in cells] == ["markdown", "code", "code", "code", "code"]
    assert cells[4].source.startswith("# Step: the second step\ndoubled = 2 * value")


def test_running_the_cells_prints_what_the_script_prints(nb, tmp_path):
    script = tmp_path / "99_made_up.py"
    script.write_text(SCRIPT, encoding="utf-8")
    whole = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "a")], capture_output=True,
                           text=True, check=True)
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "notebooks.py"), "run", str(script),
                          str(tmp_path / "b"), str(tmp_path / "cells.json")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout == whole.stdout == "value 6\ndoubled 12\n"
    cells = nb.cells_from_json(json.loads((tmp_path / "cells.json").read_text(encoding="utf-8")))
    assert [c.stdout for c in cells if c.kind == "code"] == ["", "", "value 6\n", "doubled 12\n"]
    assert cells[-1].files == ["plot.png"]
    notebook = nbformat.reads(nb.notebook_json(cells, tmp_path / "b", script_name=script.name), as_version=4)
    nbformat.validate(notebook)
    outputs = notebook.cells[-1].outputs
    assert [o.output_type for o in outputs] == ["stream", "display_data"]
    assert "image/png" in outputs[1].data


def test_a_failing_cell_is_reported(nb, tmp_path):
    script = tmp_path / "98_broken.py"
    script.write_text('"""Broken."""\n\n# %%\nprint("before")\n\n# %%\nraise ValueError("no luck")\n',
                      encoding="utf-8")
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "notebooks.py"), "run", str(script),
                          str(tmp_path / "out"), str(tmp_path / "cells.json")], capture_output=True, text=True)
    assert run.returncode == 1 and "no luck" in run.stderr and run.stdout == "before\n"


# ---------------------------------------------------------------------------
# The notebooks the site serves
# ---------------------------------------------------------------------------

#: Executes the code cells of a notebook in order, the way an interactive interpreter does
#: (`codeop.Compile` carries `from __future__` imports from cell to cell), and prints JSON:
#: the text each cell printed.
EXECUTE = textwrap.dedent('''\
    import codeop, contextlib, io, json, sys, types
    notebook = json.load(open(sys.argv[1], encoding="utf-8"))
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    compiler = codeop.Compile()
    printed = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compiler(source, "<cell>", "exec"), main.__dict__)
        printed.append(buffer.getvalue())
    sys.stdout.write(json.dumps(printed))
    ''')


#: Examples whose subject is a measured time (tables of milliseconds and their ratios): two runs print
#: the same words and counts but other decimals, so their decimals are not compared.
TIMED = {"80_balance_is_speed", "81_expert_parallel_mpi"}


def without_timings(text: str, script: Path | None = None) -> str:
    """Printed text with run times ("1.2 s", "0.35s") replaced: the only thing two runs may print differently.

    For the examples in `TIMED`, every decimal number is replaced, with the spaces that pad it to its
    column; integers and words must still agree.
    """
    if script is not None and script.stem in TIMED:
        return re.sub(r" *\d+\.\d+", " <decimal>", text)  # with the padding that a number's width sets
    return re.sub(r"\d+\.\d+ ?s\b", "<time> s", text)


@pytest.fixture(scope="module")
def site(request, tmp_path_factory) -> Path:
    return build_site(request.config, tmp_path_factory).require()


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_the_served_notebook_reproduces_the_script(site, script, tmp_path):
    path = site / "examples" / f"{script.stem}.ipynb"
    assert path.is_file()
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.nbformat == 4
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert notebook.cells[0].cell_type == "markdown" and notebook.cells[0].source.startswith("# ")
    recorded = ["".join(o.text for o in c.outputs if o.output_type == "stream" and o.name == "stdout")
                for c in code]
    assert sum(bool(text) for text in recorded) >= 1  # it carries outputs
    assert len(code) >= 3  # imports, helpers, and the computation, at least

    # Run the notebook's cells in a fresh interpreter, from a folder where `examples/` and the recorded runs
    # of `docs/results/` are at hand, with the examples' helper modules importable (as in a Jupyter kernel
    # started in `examples/`).
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "docs").symlink_to(ROOT / "docs")
    path_entries = [str(ROOT / "examples"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0", PYTHONPATH=os.pathsep.join(path_entries))
    fresh = subprocess.run([sys.executable, "-c", EXECUTE, str(path)], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    printed = json.loads(fresh.stdout)
    assert [without_timings(t, script) for t in printed] == [without_timings(t, script) for t in recorded]

    # Together, the cells print what the script prints (checked on the quicker examples: the others
    # would run a third time in the suite, and their cells already match the run the site shows).
    if script.stem not in SCRIPT_COMPARED:
        return
    whole = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "script-out")], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert without_timings("".join(printed), script) == without_timings(whole.stdout, script)
    # The figures the script saves are shown in the notebook, each under the cell that saved it.
    shown = {o.metadata.get("filename") for c in code for o in c.outputs if o.output_type == "display_data"}
    saved = {p.name for p in (tmp_path / "script-out").glob("*.png")}
    assert saved <= shown
