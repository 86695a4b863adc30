"""Every record still says the same when its random inputs move by one unit in the last place.

Another processor rounds some operations differently (a product's order of summation, a vectorized
exp), which moves the inputs of what an example prints by about one unit in the last place. A printed
fact that changes under such a move (a count that hinges on a near-tie, a rounding error printed to its
last digit) would make the record stale on some machines. Each record is run here with every float
that a NumPy random generator draws moved by one unit in the last place (`records.NUDGE`, put before
its first cell) and compared with the record by meaning (`records.same_by_meaning`).
"""

from __future__ import annotations

import nbformat
import numpy as np
import pytest
from conftest import load_script
from records import EXAMPLES, NUDGE, ROOT, TIMED, differences, read_record

DEFAULT_RNG = np.random.default_rng


@pytest.fixture(scope="module")
def nb():
    """`docs/notebooks.py`, imported as a module."""
    return load_script(ROOT / "docs" / "notebooks.py", "refimpl_docs_notebooks_nudged")


def test_the_nudge_moves_every_draw_by_one_ulp():
    scope: dict = {}
    exec(NUDGE, scope)  # noqa: S102 - the cell the test below puts first in every record
    try:
        nudged = np.random.default_rng(3)
        plain = np.random.Generator(np.random.PCG64(3))
        assert np.array_equal(nudged.normal(size=5), np.nextafter(plain.normal(size=5), np.inf))
        assert np.array_equal(nudged.random(4, dtype=np.float32), np.nextafter(plain.random(4, dtype=np.float32),
                                                                               np.float32(np.inf)))
        assert np.array_equal(nudged.integers(0, 9, 6), plain.integers(0, 9, 6))
    finally:
        np.random.default_rng = DEFAULT_RNG


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_the_record_holds_when_its_inputs_move_by_one_ulp(nb, script, tmp_path):
    """Run with every random draw one unit in the last place away, the record shows the same, by meaning.

    Another processor rounds some operations differently (a product's order of summation, a vectorized exp),
    which moves the inputs of what an example prints by about one unit in the last place. A printed fact
    that changes under such a move (a count that hinges on a near-tie, a rounding error printed to its last
    digit) would make the record stale on some machines: it must be printed differently, or the example's
    inputs drawn so that it cannot happen.
    """
    if script.stem in TIMED:
        pytest.skip("its decimals are timings, masked already, and its ranks run in processes of their own")
    record = read_record(script)
    folder = tmp_path / "reader"
    folder.mkdir()
    notebook = nbformat.read(script.with_suffix(".ipynb"), as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(NUDGE))
    try:
        fresh = nb.execute(notebook, folder)
    except Exception as exc:
        pytest.fail(f"examples/{script.stem}.ipynb does not run with its inputs nudged:\n{str(exc)[-4000:]}")
    problems = differences(record, nbformat.from_dict({**fresh, "cells": fresh.cells[1:]}), script.stem)
    if problems:
        pytest.fail(f"examples/{script.stem}.ipynb prints something else when its random inputs move by one "
                    f"unit in the last place: {problems[0]}\n" + "\n".join(problems[1:])[:6000])
