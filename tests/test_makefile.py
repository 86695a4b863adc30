"""The Makefile's environment step: a Python that cannot make a venv with pip is told what to install.

The step runs `make` itself, in a scratch folder holding a copy of the Makefile, with `PYTHON` pointing at a
stand-in that behaves like Debian's python3 without python3-venv (`import ensurepip` fails). Nothing is
fetched from the network, and no venv is left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_python_without_ensurepip_gets_a_clear_error_and_no_venv(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    fake = tmp_path / "python3-without-venv"
    fake.write_text(f"""#!/bin/sh
case "$*" in *ensurepip*) echo "ModuleNotFoundError: No module named 'ensurepip'" >&2; exit 1;; esac
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    proc = subprocess.run(["make", f"PYTHON={fake}", ".venv/bin/python"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "ensurepip module is missing" in proc.stderr and "python3-venv" in proc.stderr, proc.stderr
    assert "make PYTHON=" in proc.stderr
    assert not (tmp_path / ".venv").exists()


def test_the_makefile_names_no_package_index_host():
    text = (REPO / "Makefile").read_text()
    for host in ("pypi.org", "files.pythonhosted.org", "--index-url", "--extra-index-url"):
        assert host not in text, host


def test_installing_prints_its_stage_not_pips_lines(tmp_path):
    """`make serve`'s install step prints one line of its own; pip, told `--quiet`, prints nothing unless it fails.

    The venv's Python is a stand-in that answers `-m pip install` as pip does without `--quiet`: a hundred lines
    of what it collected. The step must pass `--quiet` and say what it does in one line."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'stand-in'\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text("""#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
case "$*" in *--quiet*) exit 0;; esac
i=0; while [ $i -lt 100 ]; do echo "Collecting package-$i"; i=$((i+1)); done
""")
    python.chmod(0o755)
    # As a reader types it in a shell: not as a sub-make of `make test`, whose MAKEFLAGS and MAKELEVEL would
    # add make's own "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(["make", ".venv/.installed-docs"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    calls = (bin_dir / "calls").read_text().splitlines()
    assert len(calls) == 1 and "-m pip install" in calls[0] and "--quiet" in calls[0], calls
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Installing refimpl and what the site needs"), proc.stdout
    assert (tmp_path / ".venv" / ".installed-docs").is_file()
