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

Reading is guarded the same way everywhere. `read_bytes` opens only a
regular file: a FIFO, a device or a socket (named directly, or through a
symbolic link) would block the reader forever or never end, so it is refused
by name before a byte is read, and the check is made again on the open
descriptor, so a file swapped in between is refused too. `read_json` parses
what it reads with the limits a file from elsewhere needs: a name given twice
in one object, an integer of more than `MAX_JSON_INTEGER_DIGITS` digits, the
non-standard `NaN` and `Infinity`, and nesting deeper than Python's parser can
follow are each a `ValueError` that names the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["Content", "MAX_JSON_INTEGER_DIGITS", "check_regular_file", "flush_file", "fsync_folder",
           "new_file_mode", "new_folder_mode", "parse_json", "read_bytes", "read_json", "write_atomically",
           "write_new_file"]


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


# ---------------------------------------------------------------------------
# Reading: regular files only, JSON within limits
# ---------------------------------------------------------------------------

#: The longest integer a JSON file may hold, in digits. The largest integers refimpl writes are a random
#: generator's 128-bit state words (39 digits); Python's own limit (4300 digits) fails with a message that names
#: no file.
MAX_JSON_INTEGER_DIGITS = 100


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: str | os.PathLike, what: str = "the file") -> Path:
    """`path`, if it is a regular file (a symbolic link is followed); else a `ValueError` naming it.

    A FIFO, device or socket is refused without being opened: opening one for reading can block forever.
    A missing file is a `FileNotFoundError`, as `open` would raise.
    """
    path = Path(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {path} is {_kind(mode)}, not a regular file: it is refused, not read")
    return path


def read_bytes(path: str | os.PathLike, what: str = "the file") -> bytes:
    """The bytes of the regular file `path`; anything else is refused by name, never waited on.

    The file is opened without blocking (`O_NONBLOCK`, which makes opening a FIFO return at once) and its
    descriptor checked again, so a regular file replaced by a FIFO after the first check is refused as well.
    """
    path = check_regular_file(path, what)
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{what} {path} is {_kind(mode)}, not a regular file: it is refused, not read")
        chunks = []
        while chunk := os.read(descriptor, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(descriptor)


def _pairs_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a name given twice is refused (which value would be meant?)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the name {key!r} appears twice in one object")
        out[key] = value
    return out


def _integer(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INTEGER_DIGITS:
        raise ValueError(f"an integer of {digits} digits, more than the {MAX_JSON_INTEGER_DIGITS} allowed")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} overflows a float")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (the standard has no NaN or Infinity)")


def parse_json(data: bytes | str, source: str) -> Any:
    """The JSON document `data` read from `source` (a file's name, for the message), within the limits above.

    Every problem is a `ValueError` that starts with `source`: text that is not UTF-8 or not JSON, a name
    given twice in an object, an integer longer than `MAX_JSON_INTEGER_DIGITS` digits, a number that overflows a float, `NaN` or
    `Infinity`,
    and nesting too deep for the parser.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_pairs_without_duplicates, parse_int=_integer,
                          parse_float=_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") \
            from None
    except RecursionError:
        raise ValueError(f"{source} is nested too deeply to be read as JSON") from None
    except ValueError as exc:
        raise ValueError(f"{source} is refused: {exc}") from None


def read_json(path: str | os.PathLike, what: str = "the file") -> Any:
    """The JSON document in the regular file `path`, read with `read_bytes` and parsed with `parse_json`."""
    return parse_json(read_bytes(path, what), f"{what} {path}" if what != "the file" else str(path))
