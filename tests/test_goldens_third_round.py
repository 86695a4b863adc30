"""`python -m refimpl.goldens DIR`, third round: it never replaces a file it was not asked to replace.

Every file a run would write (each case's `.safetensors` and `manifest.json`) is checked before anything is
written: one that exists is refused unless `--overwrite`, in one line naming it; one that exists and is not a
regular file (a folder, a symbolic link) is refused even with `--overwrite`, so that a refused run leaves the
folder exactly as it was, never a partial set of files. Only qwen3_moe's small case is written (a second).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import refimpl.goldens

ROOT = Path(__file__).resolve().parents[1]
CASE = "qwen3_moe.test.safetensors"


def run_goldens(folder: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "refimpl.goldens", str(folder), "--model-type", "qwen3_moe",
                           *extra], capture_output=True, text=True, env=env, timeout=300, check=False)


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under `folder`: a file's bytes, a link's target, a folder as "folder"."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        found[name] = (f"link to {os.readlink(path)}" if path.is_symlink() else "folder" if path.is_dir()
                       else path.read_bytes())
    return found


def refused_in_one_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def test_a_users_own_data_file_is_not_replaced_unasked(tmp_path):
    """No manifest in the folder, but a file of a case's name: the run is refused and writes nothing."""
    mine = tmp_path / CASE
    mine.write_text("the user's own file\n")
    before = snapshot(tmp_path)
    refused_in_one_line(run_goldens(tmp_path), CASE, "--overwrite")
    assert snapshot(tmp_path) == before
    with pytest.raises(FileExistsError, match=CASE):
        refimpl.goldens.write_goldens(tmp_path, model_types=["qwen3_moe"])
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("target", ["manifest.json", CASE])
@pytest.mark.parametrize("kind", ["folder", "link"])
def test_what_is_not_a_regular_file_is_refused_even_with_overwrite(tmp_path, target, kind):
    """A folder (or a link) where a golden file goes: nothing is written, not even the other files first."""
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("another file\n")
    folder = tmp_path / "out"
    folder.mkdir()
    if kind == "folder":
        (folder / target).mkdir()
        (folder / target / "kept.txt").write_text("kept\n")
    else:
        (folder / target).symlink_to(elsewhere)
    before = snapshot(tmp_path)
    refused_in_one_line(run_goldens(folder, "--overwrite"), target, "not a regular file")
    assert snapshot(tmp_path) == before
    with pytest.raises(FileExistsError, match="not a regular file"):
        refimpl.goldens.write_goldens(folder, model_types=["qwen3_moe"], overwrite=True)
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_regular_files_and_leaves_others(tmp_path):
    """With --overwrite the run replaces its own files (the user's file of a case's name included, as asked)
    and leaves every other file of the folder alone; the result is what a fresh run writes."""
    fresh = tmp_path / "fresh"
    assert run_goldens(fresh).returncode == 0
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / CASE).write_text("old\n")
    (folder / "manifest.json").write_text("{}\n")
    (folder / "notes.txt").write_text("mine\n")
    done = run_goldens(folder, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert snapshot(folder) == {**snapshot(fresh), "notes.txt": b"mine\n"}
