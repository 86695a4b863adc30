r"""The private helpers, together: what every room of the package uses and no reader of the paper needs first.

| module | what it holds |
|---|---|
| `refimpl._lib.xp` | the array-API helpers the standard lacks (top-k, bincount) and the one "is it an array" probe |
| `refimpl._lib.validation` | input checks whose errors name the argument and what was expected |
| `refimpl._lib.fast` | the fast paths, each beside the readable code it replaces, all behind one switch |
| `refimpl._lib.files` | the one atomic writer: a temporary name, flushed, then renamed |
"""

from __future__ import annotations

from . import fast, files, validation, xp

__all__ = ["fast", "files", "validation", "xp"]
