"""The kit installed the way its page says, into a fresh virtual environment, runs the page's test file.

The page gives three install lines; the one that works before a release is on the package index and needs
no network access to the repository is the clone form, `pip install "./refimpl[testing]" pytest`. This test
runs that line (with this checkout as the clone) in a new venv, saves the page's "complete test file" under
the name the page gives, and runs pytest on it there, as a user would: nothing of this repository's own
environment is visible to it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "sections" / "testing.md"


def page_blocks() -> tuple[str, str, str]:
    """(the clone install line, the test file's name, the test file) as the kit page prints them."""
    text = PAGE.read_text(encoding="utf-8")
    clone = re.search(r"^git clone \S+\n(pip install .*)$", text, re.M).group(1)
    name = re.search(r"Save this as `([^`]+\.py)`", text).group(1)
    section = text.split("## A complete test file")[1]
    test_file = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return clone, name, test_file


def test_the_page_gives_the_repository_and_clone_forms_next_to_the_index_form():
    text = PAGE.read_text(encoding="utf-8")
    assert 'pip install "refimpl[testing] @ git+https://github.com/refimpl/refimpl" pytest' in text
    assert 'pip install "./refimpl[testing]" pytest' in text
    assert 'pip install "refimpl[testing]" pytest' in text


def test_the_kit_installs_into_a_fresh_venv_as_the_page_says_and_its_test_file_passes(tmp_path):
    clone_line, name, test_file = page_blocks()
    assert clone_line == 'pip install "./refimpl[testing]" pytest'
    # The clone: this checkout's files (tracked, and new ones git does not ignore), so that building the
    # package writes into the copy, never into the checkout.
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (tmp_path / "refimpl" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, tmp_path / "refimpl" / rel)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # The page's line, word for word, run next to the clone with the new venv's pip.
    argv = [str(python), "-m", *shlex.split(clone_line)[:1], "--quiet", "--disable-pip-version-check",
            *shlex.split(clone_line)[1:]]
    install = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    project = tmp_path / "project"
    (project / Path(name).parent).mkdir(parents=True)
    (project / name).write_text(test_file, encoding="utf-8")
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", name], cwd=project,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", run.stdout), run.stdout[-2000:]
    # The kit it ran is the one installed in the new venv, not this checkout's.
    where = subprocess.run([str(python), "-c", "import refimpl, sys; print(refimpl.__file__)"], cwd=project,
                           capture_output=True, text=True, timeout=120)
    assert str(env_dir) in where.stdout, where.stdout
    assert sys.prefix not in where.stdout
