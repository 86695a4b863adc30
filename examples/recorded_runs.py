"""Where the recorded long runs live: the repository's `docs/results/` folder.

Examples 61–63 and 73 print and plot training runs recorded with their `--full`
flag. A script finds the repository above its own file; a notebook, which has
no `__file__`, above its working folder, so open the notebooks from a clone's
`examples/` folder (where this helper sits too).
"""

from __future__ import annotations

from pathlib import Path


def results_file(name: str, script: str | None) -> Path:
    """The path of `docs/results/<name>`, found above `script` (an example's `__file__`) or the working folder."""
    here = Path(script).resolve().parent if script else Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "docs" / "results").is_dir():
            return folder / "docs" / "results" / name
    raise FileNotFoundError(f"no docs/results/ folder above {here}: run the example from a clone of the repository")
