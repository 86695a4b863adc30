"""Every worked example as a notebook: the conversion's rules, and records that are current and run anywhere.

`docs/notebooks.py` turns a percent-cell script into notebook cells. Its rules
are checked first on small made-up scripts whose cells are known by hand, and
on a script whose `main` cannot be unrolled.

Then every example's **record** (`examples/NN_slug.ipynb`, the executed
notebook the site renders and serves) is checked the way a reader uses it:

* it was made from the script as it is now (its cells are the script's cells);
* copied alone into an empty folder and run top to bottom by `nbclient` in a
  fresh Jupyter kernel, it prints and draws what the record holds, compared
  by meaning rather than as text (see `same_by_meaning`: words and counts
  exactly, a decimal to the last digit the record prints or to the rounding its
  arithmetic allows; run times, and every decimal of the examples whose
  subject is a timing, masked). A record that differs is stale, and the
  failure says how to refresh it;
* it still holds when every random input moves by one unit in the last place (`test_records_nudged.py`)
  (the way another processor's rounding moves them): what the record prints
  must not hinge on the last bits of its inputs;
* it holds no path of the machine that made it, and every step of the example
  is its own cell with its own result;
* together its cells print what `python examples/NN_slug.py` prints (checked on
  the quicker examples).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from conftest import load_script
from records import (
    EXAMPLES,
    REFRESH,
    ROOT,
    differences,
    masked,
    read_record,
    same_by_meaning,
    stdout_of,
)

#: The examples whose record is also compared with a run of the script itself.
SCRIPT_COMPARED = {"01_forward_by_hand", "02_k3_accounting", "10_qb_by_hand", "12_lp_crosscheck"}



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
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--out", type=Path, default=None, help="save the figure here")
        parser.add_argument("--times", type=int, default=2, help="how often")
        args = parser.parse_args(argv)

        # Step 1: the first step
        # It triples.
        value = triple(args.times)
        print("value", value)

        # Step 2: the second step
        doubled = 2 * value
        print("doubled", doubled)
        return {"value": value, "doubled": doubled}


    # %%
    if __name__ == "__main__":
        main()
    ''')


def write_script(folder: Path, text: str = SCRIPT, name: str = "99_made_up.py") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# The conversion's rules, on made-up scripts
# ---------------------------------------------------------------------------

def test_cells_of_a_script_that_follows_the_convention(nb, tmp_path):
    cells = nb.script_cells(write_script(tmp_path))
    assert [c.kind for c in cells] == ["markdown", "markdown", "code", "code", "code", "markdown", "code",
                                       "markdown", "code"]
    assert cells[0].source == "# A made-up example\n\nIts intro, with $x^2$."
    assert cells[1].metadata == {"refimpl": "note"} and "99_made_up.py" in cells[1].source
    assert cells[2].source.startswith("from __future__ import annotations")
    assert cells[3].source.startswith("def triple")
    # The argument parsing becomes the options at their defaults, one line each with its help text.
    options = cells[4].source
    assert "argv" not in options and "parse_args" not in options
    assert "args = argparse.Namespace(\n    out=None,  # save the figure here\n    times=2,   # how often\n)" \
        in options
    assert cells[5].source == "## Step 1: the first step\n\nIt triples."
    assert cells[5].metadata == {"refimpl": "step"}
    assert cells[6].source == 'value = triple(args.times)\nprint("value", value)'
    assert cells[7].source == "## Step 2: the second step"
    assert cells[8].source.endswith('result = {"value": value, "doubled": doubled}')
    # No def main, no __main__ guard, no __doc__ line, nothing indented.
    assert not any("def main" in c.source or "__name__" in c.source or "__doc__" in c.source for c in cells)
    assert all(not line.startswith(" ") for c in cells[5:] if c.kind == "code" for line in c.source.splitlines())


@pytest.mark.parametrize("body, reason", [
    ("    if argv:\n        return {}\n    return {'a': 1}\n", "returns early"),
    ("    global SCALE\n    SCALE = 2\n    return {}\n", "global"),
    ("    triple = 5\n    return {'t': triple}\n", "top-level names: triple"),
])
def test_a_main_that_cannot_be_unrolled_is_called_whole(nb, tmp_path, body, reason):
    source = '"""Title."""\n\nSCALE = 1\n\n# %%\ndef triple(x):\n    return x\n\n# %%\ndef main(argv=None):\n' + body
    assert reason in nb.unroll_problem(source)
    cells = nb.script_cells(write_script(tmp_path, source))
    assert any(c.source.startswith("def main(") for c in cells)
    assert cells[-1].source == "result = main([])  # the script's defaults"


def test_a_what_to_see_comment_becomes_prose_right_under_its_output(nb, tmp_path):
    source = SCRIPT.replace("    # Step 2: the second step",
                            "    # What to see: the value is three times\n    # the option.\n\n    # Step 2: the second step")
    cells = nb.script_cells(write_script(tmp_path, source))
    assert [c.kind for c in cells[5:]] == ["markdown", "code", "markdown", "markdown", "code"]
    assert cells[7].source == "**What to see.** The value is three times the option."
    assert cells[7].metadata == {"refimpl": "reading"}
    assert cells[8].source == "## Step 2: the second step"


def test_a_what_to_see_after_mains_last_statement_is_the_reading_of_its_last_step(nb, tmp_path):
    """Python ends `main` at its last statement (here a loop); the reading after it still belongs to main."""
    source = SCRIPT.replace(
        '    print("doubled", doubled)\n    return {"value": value, "doubled": doubled}\n',
        '    for i in range(2):\n        print("doubled", doubled + i)\n'
        '        # a comment inside the loop\n\n    # What to see: two lines,\n    # one apart.\n')
    assert "# one apart" in source
    cells = nb.script_cells(write_script(tmp_path, source))
    assert [c.kind for c in cells] == ["markdown", "markdown", "code", "code", "code", "markdown", "code",
                                       "markdown", "code", "markdown"]
    assert cells[8].source.startswith("doubled = 2 * value\nfor i in range(2):")
    assert "What to see" not in cells[8].source
    assert cells[9].source == "**What to see.** Two lines, one apart."
    assert cells[9].metadata == {"refimpl": "reading"}
    assert not any(c.kind == "code" and "What to see" in c.source for c in cells)


def test_the_reading_of_a_main_called_whole_comes_after_the_call_and_keeps_its_list(nb, tmp_path):
    source = ('"""Title."""\n\n# %%\ndef main(argv=None):\n    if argv:\n        return 1\n    print(2)\n    return 2\n\n'
              '    # What to see: two\n    # parts:\n    #\n    # 1. the first,\n    #    on two lines;\n'
              '    # 2. the second.\n\n\n# %%\nif __name__ == "__main__":\n    main()\n')
    cells = nb.script_cells(write_script(tmp_path, source))
    assert [c.kind for c in cells] == ["markdown", "markdown", "code", "code", "markdown"]
    assert cells[2].source.startswith("def main(") and "What to see" not in cells[2].source
    assert cells[3].source == "result = main([])  # the script's defaults"
    assert cells[4].source == "**What to see.** Two parts:\n\n1. the first, on two lines;\n2. the second."
    assert cells[4].metadata == {"refimpl": "reading"}


def test_an_indented_cell_marker_starts_a_step_not_a_cell(nb, tmp_path):
    source = SCRIPT.replace("    # Step 2: the second step", "    # %% the second step")
    cells = nb.script_cells(write_script(tmp_path, source))
    assert cells[7].kind == "markdown" and cells[7].source == "## The second step"


def test_a_made_up_notebook_runs_in_a_kernel_and_prints_what_the_script_prints(nb, tmp_path):
    script = write_script(tmp_path)
    whole = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    executed = nb.execute(nb.notebook(nb.script_cells(script), script.name), empty, timeout=120)
    printed = ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
               for c in executed.cells if c.cell_type == "code"]
    assert "".join(printed) == whole.stdout == "value 6\ndoubled 12\n"
    assert printed[-2:] == ["value 6\n", "doubled 12\n"]  # each step under its own cell
    nbformat.validate(executed)


def test_a_failing_cell_stops_the_record(nb, tmp_path):
    script = write_script(tmp_path, '"""Broken."""\n\n# %%\nprint("before")\n\n# %%\nraise ValueError("no luck")\n')
    from nbclient.exceptions import CellExecutionError

    with pytest.raises(CellExecutionError, match="no luck"):
        nb.record(script, timeout=120)


def run_printing_the_kernels_transport(nb, tmp_path) -> tuple[str, str]:
    """Run a notebook whose kernel prints its transport and where its sockets are: (transport, socket prefix)."""
    script = write_script(tmp_path, '"""Sockets."""\n\n# %%\nimport json\nimport ipykernel.connect\n'
                                    'info = json.load(open(ipykernel.connect.get_connection_file()))\n'
                                    'print(info["transport"], info["ip"])\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    executed = nb.execute(nb.notebook(nb.script_cells(script), script.name), empty, timeout=120)
    printed = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs
                      if o.output_type == "stream")
    transport, ip = printed.split()
    return transport, ip


@pytest.mark.skipif(os.name != "posix", reason="Unix sockets only where the system has them")
def test_the_kernel_talks_over_sockets_of_its_own_not_ports_anyone_can_take(nb, tmp_path):
    """The kernel binds Unix socket files in a private folder, removed afterwards, never TCP ports.

    Over TCP the client frees five ports and the kernel binds them a moment later; a notebook or server starting
    beside it in that moment took one, and the kernel died before replying to kernel_info (a test of the suite
    failed that way). A socket file in a folder of this run's own cannot be taken.
    """
    transport, ip = run_printing_the_kernels_transport(nb, tmp_path)
    assert transport == "ipc"
    folder = Path(ip).parent
    assert folder.name.startswith("refimpl-kernel-")
    assert not folder.exists()  # removed with the sockets' files


@pytest.mark.skipif(os.name != "posix", reason="Unix sockets only where the system has them")
def test_a_temporary_folder_too_long_for_a_socket_path_moves_the_sockets_to_tmp(nb, tmp_path, monkeypatch):
    """A socket's path holds about a hundred bytes: under a long temporary folder the sockets go to /tmp."""
    import tempfile

    long = tmp_path / ("x" * 80)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    transport, ip = run_printing_the_kernels_transport(nb, tmp_path)
    assert transport == "ipc"
    assert Path(ip).parent.parent == Path("/tmp")


def test_a_record_that_holds_a_machine_path_is_refused(nb, tmp_path):
    script = write_script(tmp_path, '"""Leaky."""\n\n# %%\nimport os\nprint(os.getcwd())\n')
    with pytest.raises(ValueError, match="paths of this machine"):
        nb.record(script, timeout=120)


# ---------------------------------------------------------------------------
# The records
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_the_record_is_made_from_the_script_as_it_is(nb, script):
    """The record's cells are the cells of today's script: editing the script without refreshing fails here."""
    record = read_record(script)
    nbformat.validate(record)
    expected = [(c.kind, c.source) for c in nb.script_cells(script)]
    recorded = [(c.cell_type, c.source) for c in record.cells]
    if recorded != expected:
        diff = "\n".join(difflib.unified_diff([f"{k}: {s}" for k, s in recorded], [f"{k}: {s}" for k, s in expected],
                                              "the record", "the script now", lineterm="", n=1))
        pytest.fail(f"examples/{script.stem}.ipynb was made from another version of examples/{script.name}; "
                    f"refresh it with `{REFRESH.format(stem=script.stem)}`:\n{diff[:4000]}")


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_the_record_holds_no_path_of_the_machine_that_made_it(script):
    text = script.with_suffix(".ipynb").read_text(encoding="utf-8")
    found = [m.group(0) for m in re.finditer(r"(/tmp/|/root\b|/home/|/work/|/var/folders/|ipykernel_\d+|"
                                             r"[A-Z]:\\\\Users)[^\"\s]*", text)]
    assert str(ROOT) not in text and found == [], found[:5]
    assert "argv = [" not in text  # no argument list handed to the script's main


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_every_step_is_a_cell_that_shows_its_result(script):
    """Each step (a `# Step` comment of `main`, a Markdown cell in the notebook) is followed by code cells
    that print or draw something."""
    record = read_record(script)
    cells = record.cells
    silent = []
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown" and (cell.get("metadata") or {}).get("refimpl") == "step":
            following = []
            for later in cells[i + 1:]:
                if later.cell_type == "markdown":
                    break
                following.append(later)
            if following and not any(later.get("outputs") for later in following):
                silent.append(cell.source.split("\n")[0])
    assert silent == [], f"steps of {script.name} whose cells show nothing: {silent}"


def _prints(cell) -> bool:
    """Whether a code cell printed text (a figure shows its own caption; printed numbers need reading)."""
    return any(output.get("output_type") == "stream" and output.get("name") == "stdout"
               for output in cell.get("outputs", []))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_every_printed_step_is_followed_by_what_to_see_in_it(script):
    """A step whose cells print something ends with a "What to see" cell (a `# What to see:` comment after the
    step's code), so that the reader is told what the numbers show; a step that only draws has its caption."""
    cells = read_record(script).cells
    unread = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown" or (cell.get("metadata") or {}).get("refimpl") != "step":
            continue
        last_print, reading = None, None
        for j in range(i + 1, len(cells)):
            later = cells[j]
            if later.cell_type == "markdown" and (later.get("metadata") or {}).get("refimpl") == "step":
                break
            if later.cell_type == "code" and _prints(later):
                last_print = j
            if later.cell_type == "markdown" and (later.get("metadata") or {}).get("refimpl") == "reading":
                reading = j
        if last_print is not None and (reading is None or reading < last_print):
            unread.append(cell.source.split("\n")[0])
    assert unread == [], f"steps of {script.name} whose printed output no 'What to see' follows: {unread}"
    readings = [c for c in cells if c.cell_type == "markdown" and (c.get("metadata") or {}).get("refimpl") == "reading"]
    assert readings or not any(c.cell_type == "code" and _prints(c) for c in cells), (
        f"{script.name} prints but has no step with a 'What to see' reading")


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_the_record_is_current(nb, script, tmp_path):
    """The record, copied alone into an empty folder and run by nbclient in a fresh kernel, shows what it holds."""
    record = read_record(script)
    folder = tmp_path / "reader"
    folder.mkdir()
    shutil.copy(script.with_suffix(".ipynb"), folder / f"{script.stem}.ipynb")
    notebook = nbformat.read(folder / f"{script.stem}.ipynb", as_version=4)
    env = os.environ.get("PYTHONPATH")
    assert env is None or "examples" not in env  # nothing of examples/ is importable in the kernel
    try:
        fresh = nb.execute(notebook, folder)
    except Exception as exc:  # a cell raised: the record cannot be current
        pytest.fail(f"examples/{script.stem}.ipynb does not run in a fresh kernel in an empty folder:\n"
                    f"{str(exc)[-4000:]}")
    # It wrote nothing there (but Hypothesis, which the kit runs, keeps a cache of constants in .hypothesis/).
    assert sorted(p.name for p in folder.iterdir() if p.name != ".hypothesis") == [f"{script.stem}.ipynb"]
    assert len(fresh.cells) == len(record.cells)
    problems = differences(record, fresh, script.stem)
    if problems:
        pytest.fail(f"examples/{script.stem}.ipynb is stale: {problems[0]} shows something else when run again "
                    f"(compared by meaning, run times masked). If the change is meant, refresh the record with "
                    f"`{REFRESH.format(stem=script.stem)}` and commit it.\n" + "\n".join(problems[1:])[:6000])


@pytest.mark.parametrize(("was", "now", "stem", "same"), [
    # A decimal on a rounding boundary prints either neighbour: one unit of its last digit is allowed.
    ("LP optimum 401.777139", "LP optimum 401.777140", "", True),
    ("LP optimum 401.777139", "LP optimum 401.777141", "", False),
    ("error 4.3e-10", "error 4.4e-10", "", True),
    # A share that hinges on near-ties, or a count, is a fact only when it is the same.
    ("same route 98.4%", "same route 97.7%", "", False),
    ("under-loaded: 194 of 194", "under-loaded: 195 of 195", "", False),
    ("1,048,576 tokens", "1,048,577 tokens", "", False),
    # Words must agree; a column one digit wider only moves the spaces.
    ("loss    9.99 at step 3", "loss   10.00 at step 3", "", True),
    ("loss    9.99 at step 3", "loss   10.01 at step 3", "", False),
    ("loss    9.99 at step 3", "loss 9.99 at step 3", "", True),
    ("identical: yes", "identical: NO", "", False),
    ("dtype float32, w1 [4, 64]", "dtype float16, w1 [4, 64]", "", False),
    ("transformers 5.24.0", "transformers 5.24.1", "", False),
    # An example's rounding tolerance applies on the lines it names, and only there.
    ("   largest relative difference: 6.4e-10", "   largest relative difference: 8.6e-10", "60_backward_by_hand",
     True),
    ("   largest relative difference: 6.4e-10", "   largest relative difference: 8.6e-10", "", False),
    ("   largest relative difference: 6.4e-10", "   largest relative difference: 6.4e-07", "60_backward_by_hand",
     False),
    # A tolerance with a suffix holds for the numbers it follows, and only for them.
    ("c = 6  5.999  0.00  7.76%", "c = 6  5.999  0.00  7.96%", "51_bf16_router_precision", True),
    ("c = 6  5.999  0.00  7.76%", "c = 6  5.899  0.00  7.76%", "51_bf16_router_precision", False),
    ("float64 1.8e+308 100 inf", "float64 1.8e+308 100 inf", "", True),
    ("one line", "one line\nand another", "", False),
])
def test_records_are_compared_by_meaning(was, now, stem, same):
    assert (same_by_meaning(was, now, stem) == []) == same


@pytest.mark.slow
@pytest.mark.parametrize("stem", sorted(SCRIPT_COMPARED))
def test_the_cells_together_print_what_the_script_prints(stem, tmp_path):
    script = ROOT / "examples" / f"{stem}.py"
    record = read_record(script)
    whole = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "figures")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert same_by_meaning(masked(stdout_of(record), stem), masked(whole.stdout, stem), stem) == []
    # The figures the script saves are the figures the notebook shows, by name.
    shown = {o.metadata["refimpl"]["filename"] for c in record.cells if c.cell_type == "code"
             for o in c.outputs if (o.get("metadata") or {}).get("refimpl", {}).get("filename")}
    assert {p.name for p in (tmp_path / "figures").glob("*.png")} == shown


def test_records_are_valid_notebooks_with_outputs():
    for script in EXAMPLES:
        record = read_record(script)
        nbformat.validate(record)
        assert record.cells[0].cell_type == "markdown" and record.cells[0].source.startswith("# ")
        assert any(c.get("outputs") for c in record.cells if c.cell_type == "code"), script.name
        assert json.loads(script.with_suffix(".ipynb").read_text(encoding="utf-8"))["nbformat"] == 4
        # A live check that failed when the record was made would be compared with itself ever after.
        assert "DIFFERENT from the record" not in stdout_of(record), script.name
