"""Writing files so that nothing is lost: a temporary name in the same folder, flushed to disk, then renamed.

A reader of the target sees either the old file or the complete new one, never
a part: the new bytes go to a temporary file next to the target, are flushed
to the disk (`fsync`), and only then replace the target with one `os.replace`,
which is atomic within a file system. The folder itself is flushed after the
rename, so the new name survives a power cut. A write that fails on the way
(a full disk, an exception in the code that produces the bytes) removes its
temporary file and leaves the target as it was.

Files get the permissions any file the user creates gets (`0o666` less the
process umask); the temporary file starts private (`0o600`) and is widened
just before the rename. Every name here is shared by the modules that write
files (the balancer's state, the training log and the training checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["Content", "flush_file", "write_new_file", "fsync_folder", "new_file_mode", "new_folder_mode", "write_atomically"]


def _umask() -> int:
    """The process umask (read by setting it and putting it back: POSIX offers no other way)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The permissions of a new file: `0o666` less the umask."""
    return 0o666 & ~_umask()


def new_folder_mode() -> int:
    """The permissions of a new folder: `0o777` less the umask."""
    return 0o777 & ~_umask()


def fsync_folder(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (the names of the files in it) to the disk, where the platform allows it.

    Some platforms and file systems cannot open or flush a folder; there the
    rename is as durable as the platform makes it, and nothing is raised.
    """
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


#: What a file is written from: its bytes, its text (UTF-8), or a function that writes into a binary handle.
Content = bytes | str | Callable[[IO[bytes]], None]


def _writer(content: Content) -> Callable[[IO[bytes]], None]:
    if callable(content):
        return content
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    return lambda handle: handle.write(data)


def flush_file(path: str | os.PathLike) -> None:
    """Flush the file `path` to the disk (`fsync`), e.g. one a library wrote by name."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_new_file(path: str | os.PathLike, content: Content) -> None:
    """Write a new file `path` (it must not exist) from `content` and flush it to the disk.

    For a file inside a folder that is itself renamed into place once complete (a training checkpoint
    being staged); a file that replaces another uses `write_atomically`.
    """
    with open(path, "xb") as handle:
        _writer(content)(handle)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomically(path: str | os.PathLike, content: Content, *, make_folder: bool = False) -> None:
    """Write `path` from `content` into a temporary file beside it, flush it, then rename it to `path`.

    `content` is bytes, text (written as UTF-8) or a function that receives a binary file opened for
    writing. If writing raises, or the flush or rename fails, the temporary file is removed and `path`
    keeps what it held (or stays absent). `make_folder=True` creates the folder first.
    """
    path = Path(path)
    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    write = _writer(content)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".partial",
                                         delete=False)
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, new_file_mode())
        os.replace(handle.name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)
        raise
    fsync_folder(path.parent)
