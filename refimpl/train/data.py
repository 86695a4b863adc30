r"""The training data: real text every machine has offline, and batches drawn from it.

The corpus is a fixed list of source files of the Python standard library
(`CORPUS_FILES`), concatenated in that order. Their sizes and SHA-256
digests are printed and logged, so a run says exactly what it read; the last
5% of the bytes are held out for the evaluation loss. Bytes are the tokens
(a vocabulary of 256). A batch is $m$ positions drawn uniformly by the run's
random generator, each with the $c$ bytes before it; the same seed gives the
same batches, bit for bit.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._lib.files import read_bytes

#: Bytes are the tokens: a vocabulary of 256.
VOCAB = 256

#: The corpus: these standard-library source files, in this order (any that a Python lacks are skipped and
#: the run says so). About 0.7 MB of Python on CPython 3.11.
CORPUS_FILES: tuple[str, ...] = (
    "argparse.py", "ast.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "fractions.py",
    "functools.py", "inspect.py", "json/decoder.py", "json/encoder.py", "pprint.py", "statistics.py",
    "string.py", "textwrap.py",
)

#: Share of the corpus held out for the evaluation loss (its last bytes).
HELD_OUT = 0.05


# ---------------------------------------------------------------------------
# The data
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """The training text as bytes, and what it was read from.

    `data` is a `uint8` array of the concatenated files; `files` lists each
    file read as `(name, size, sha256)`; `missing` the listed files this
    Python does not have; `sha256` is the digest of `data`; `split` is the
    index where the held-out part begins.
    """

    data: np.ndarray
    files: tuple[tuple[str, int, str], ...]
    missing: tuple[str, ...]
    sha256: str
    split: int

    def describe(self) -> str:
        """A few lines saying exactly what was read."""
        lines = [f"corpus: {len(self.files)} standard-library files, {self.data.size:,} bytes, "
                 f"sha256 {self.sha256[:16]} (held out: the last {self.data.size - self.split:,} bytes)"]
        lines += [f"  {name:<26}{size:>9,} bytes  sha256 {digest[:16]}" for name, size, digest in self.files]
        if self.missing:
            lines.append(f"  not found on this Python: {', '.join(self.missing)}")
        return "\n".join(lines)

    def record(self) -> dict[str, Any]:
        """What the log says about the corpus: its digest, size, files read and files missing."""
        return {"sha256": self.sha256, "bytes": int(self.data.size),
                "files": [list(entry) for entry in self.files], "missing": list(self.missing)}


def load_corpus(root: str | Path | None = None, names: Sequence[str] = CORPUS_FILES) -> Corpus:
    """Read the corpus: the files `names` under `root` (default: this Python's standard library)."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise ValueError(f"root must be a directory holding the standard library sources, got {str(root)!r}")
    chunks, files, missing = [], [], []
    for name in names:
        path = root / name
        if not path.is_file():
            missing.append(name)
            continue
        text = read_bytes(path, "the corpus file")  # a regular file only, even if swapped since the check
        chunks.append(text)
        files.append((name, len(text), hashlib.sha256(text).hexdigest()))
    joined = b"".join(chunks)
    if len(joined) < 10_000:
        raise ValueError(f"the corpus under {str(root)!r} holds only {len(joined)} bytes of the files {list(names)}; "
                         "at least 10,000 are needed")
    data = np.frombuffer(joined, dtype=np.uint8)
    return Corpus(data=data, files=tuple(files), missing=tuple(missing), sha256=hashlib.sha256(joined).hexdigest(),
                  split=int(len(joined) * (1.0 - HELD_OUT)))


def sample_batch(data: np.ndarray, rng: np.random.Generator, m: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """`m` training pairs drawn uniformly from `data`: the `context` bytes before a position, and its byte.

    Returns `tokens` `[m, context]` (int64) and `targets` `[m]` (int64).
    """
    position = rng.integers(context, data.size, size=m)  # [m]
    window = position[:, None] + np.arange(-context, 0)[None, :]  # [m, c]
    return data[window].astype(np.int64), data[position].astype(np.int64)
