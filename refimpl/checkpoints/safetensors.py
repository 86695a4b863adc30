r"""safetensors files read safely: headers checked, tensors memory-mapped, nothing outside the folder opened."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import ml_dtypes
import numpy as np

from .._lib.files import check_regular_file, parse_json
from .._lib.files import read_json as _read_json_file

# The files of a checkpoint folder.
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


__all__ = ["CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE", "Shards", "inside_folder", "non_finite", "open_safetensors",
           "read_json", "read_safetensors_header", "to_dtype"]

# safetensors dtype names -> NumPy dtypes.
_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}

# The largest safetensors header read (the safetensors library's own limit).
_MAX_HEADER_BYTES = 100_000_000


# ---------------------------------------------------------------------------
# Files inside the folder, JSON that parses
# ---------------------------------------------------------------------------

def inside_folder(folder: Path, entry: Any, what: str) -> Path:
    """`folder / entry`, if `entry` names a file inside `folder`; else a `ValueError` naming `what` and `entry`.

    Refused: anything but a non-empty string, an absolute path (POSIX or
    Windows), a `..` component, and a path that resolves (through symbolic
    links) outside the folder.
    """
    if not isinstance(entry, str) or not entry or "\x00" in entry:
        raise ValueError(f"{what} {entry!r} is not a file name")
    posix, windows = PurePosixPath(entry), PureWindowsPath(entry)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts + windows.parts:
        raise ValueError(f"{what} {entry!r} is not a file inside the checkpoint folder {folder}: absolute paths "
                         "and '..' are refused")
    target = folder / entry
    resolved = target.resolve()
    if not resolved.is_relative_to(folder.resolve()):
        raise ValueError(f"{what} {entry!r} resolves to {resolved}, outside the checkpoint folder {folder} "
                         "(a symbolic link out of it is refused)")
    return target


def read_json(file: Path) -> Any:
    """The JSON document in `file`; a `ValueError` naming the file when it is not a regular file holding UTF-8
    JSON within the limits of `refimpl._lib.files.parse_json` (no name twice, no huge integer, no deep nesting)."""
    try:
        return _read_json_file(file)
    except FileNotFoundError:
        raise ValueError(f"{file} cannot be read: it does not exist") from None
    except OSError as exc:
        raise ValueError(f"{file} cannot be read: {exc.strerror}") from None


# ---------------------------------------------------------------------------
# safetensors, validated and memory-mapped
# ---------------------------------------------------------------------------

def read_safetensors_header(file: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The JSON header of a `.safetensors` file and the byte offset where its data starts, both checked.

    Raises `ValueError` naming the file (and the tensor) unless: the 8-byte
    header length lies within the file, the header is a JSON object of at
    most 100 MB with no name twice, `__metadata__` (if present) maps names to
    strings, every tensor has a known dtype, a shape of non-negative
    integers and `data_offsets` of `dtype size x product of shape` bytes, and
    the tensors' byte ranges tile the data exactly (in order, from 0, each
    where the previous ends, the last at the end of the file).
    """
    file = check_regular_file(file, "the safetensors file")
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{file} is not a safetensors file: it has {size} bytes, fewer than the 8 of its "
                             "header length")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise ValueError(f"{file} is not a safetensors file: its header length {length} exceeds the "
                             f"{size - 8} bytes that follow it")
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{file}: its header length {length} exceeds the {_MAX_HEADER_BYTES} bytes a "
                             "safetensors header may have")
        raw = f.read(length)
    try:
        header = parse_json(raw, "its header")
    except ValueError as exc:  # not UTF-8 or JSON, a name given twice, a huge integer, deep nesting
        raise ValueError(f"{file} is not a safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: a safetensors header must be a JSON object, got {type(header).__name__}")
    metadata = header.get("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError(f"{file}: __metadata__ must map names to strings, got {metadata!r:.80}")
    data_size = size - 8 - length
    spans = sorted((_checked_entry(file, name, entry, data_size), name)
                   for name, entry in header.items() if name != "__metadata__")
    # The format's rule: the tensors' bytes follow each other, in order, with no gap and no overlap.
    position = 0
    for (begin, end), name in spans:
        if begin != position:
            problem = "overlaps the tensor before it" if begin < position else f"leaves bytes [{position}, {begin}) unused"
            raise ValueError(f"{file}: tensor {name!r} starts at byte {begin} of the data, where the tensor "
                             f"before it ends at {position}: it {problem} (the tensors' bytes must be contiguous)")
        position = end
    if position != data_size:
        raise ValueError(f"{file}: its tensors cover {position} bytes of data, but {data_size} follow the header")
    return header, 8 + length


def _checked_entry(file: Path, name: str, entry: Any, data_size: int) -> tuple[int, int]:
    """The byte range `[begin, end)` of tensor `name`'s header entry, after checking dtype, shape and size."""
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} has a header entry that is not an object: {entry!r:.80}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ST_DTYPES:
        raise ValueError(f"{where} has dtype {dtype!r}, which this reader does not know (known: {sorted(_ST_DTYPES)})")
    if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise ValueError(f"{where} needs a shape that is a list of non-negative integers, got {shape!r:.80}")
    nonzero_bytes = int(np.prod([max(n, 1) for n in shape], dtype=object)) * np.dtype(_ST_DTYPES[dtype]).itemsize
    if len(shape) > _MAX_DIMS or nonzero_bytes > _MAX_BYTES:
        raise ValueError(f"{where} has shape {shape!r:.80}, which no array can have (at most {_MAX_DIMS} "
                         f"dimensions, and the product of the nonzero ones times the item size at most "
                         f"{_MAX_BYTES} bytes)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)):
        raise ValueError(f"{where} needs data_offsets [begin, end] of two non-negative integers, "
                         f"got {offsets!r:.80}")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise ValueError(f"{where} has data_offsets [{begin}, {end}], outside the {data_size} bytes of data "
                         "(or ending before it begins)")
    count = int(np.prod(shape, dtype=object)) * np.dtype(_ST_DTYPES[dtype]).itemsize  # Python ints: no overflow
    if end - begin != count:
        raise ValueError(f"{where} of shape {shape} and dtype {dtype} needs {count} bytes, but its data_offsets "
                         f"[{begin}, {end}] hold {end - begin}")
    return begin, end


#: NumPy's limits on an array: its number of dimensions, and the product of its nonzero dimensions times its
#: item size (an empty array of shape `[0, 10**30]` is still refused by `reshape`).
_MAX_DIMS = 64
_MAX_BYTES = np.iinfo(np.intp).max


def _is_count(n: Any) -> bool:
    """A non-negative JSON integer (not a boolean)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def open_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a `.safetensors` file as a read-only NumPy view of one memory map (nothing is read yet).

    The header is validated first (`read_safetensors_header`), so every view
    lies within the file and no two overlap.
    """
    file = Path(file)
    header, start = read_safetensors_header(file)  # a regular file: mapping a FIFO would block
    whole = np.memmap(file, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[entry["dtype"]])
        tensors[name] = whole[start + begin:start + end].view(dtype).reshape(entry["shape"])
    return tensors


class Shards:
    """The tensors of a checkpoint directory, found through the index file or a single file, opened lazily."""

    def __init__(self, path: Path):
        self.path = path
        if os.path.lexists(path / INDEX_FILE):
            index = inside_folder(path, INDEX_FILE, "the index")
            document = read_json(index)
            weight_map = document.get("weight_map") if isinstance(document, dict) else None
            if not isinstance(weight_map, Mapping):
                raise ValueError(f"{index} has no 'weight_map' mapping of tensor names to shard files")
            checked: set[Any] = set()
            for name, file in weight_map.items():  # every entry, before any shard is opened
                if not (isinstance(file, str) and file in checked):
                    inside_folder(path, file, f"{index}: weight_map entry {name!r} ->")
                    checked.add(file)
            self.file_of = dict(weight_map)
        elif os.path.lexists(path / SINGLE_FILE):
            single = inside_folder(path, SINGLE_FILE, "the shard")
            if not single.exists():
                raise ValueError(f"{single} is a symbolic link to {single.resolve()}, which does not exist")
            header, _ = read_safetensors_header(single)
            self.file_of = {name: SINGLE_FILE for name in header if name != "__metadata__"}
        else:
            raise ValueError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        self._open: dict[str, dict[str, np.ndarray]] = {}
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> np.ndarray:
        file = self.file_of[name]
        if file not in self._open:
            target = inside_folder(self.path, file, f"weight_map entry {name!r} ->")  # follows links, now
            if not target.exists():
                raise ValueError(f"tensor {name!r} is mapped to {file}, which is not in {self.path}")
            check_regular_file(target, f"tensor {name!r} is mapped to")
            self._headers[file] = read_safetensors_header(target)
            self._open[file] = open_safetensors(target)
        tensors = self._open[file]
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is mapped to {file} by the index, but that file does not hold it")
        return tensors[name]

    def read(self, name: str) -> np.ndarray:
        """A private in-memory copy of tensor `name`, read with ordinary file reads.

        Copying out of the memory map would leave the copied pages mapped, and
        counted as resident, for as long as the map lives (the experts keep it
        alive); a plain read does not touch the map at all.
        """
        view = self.get(name)  # checks that the tensor is there and fits its byte range
        file = self.file_of[name]
        header, start = self._headers[file]
        offset = start + header[name]["data_offsets"][0]
        return np.fromfile(self.path / file, dtype=view.dtype, count=view.size, offset=offset).reshape(view.shape)


def non_finite(array: Any) -> str:
    """"N non-finite value(s) (NaN or infinity), the first at index (i, j)" for `array`, or "" when all are finite."""
    bad = ~np.isfinite(np.asarray(array).astype(np.float64))
    if not np.any(bad):
        return ""
    return (f"{int(np.sum(bad))} non-finite value(s) (NaN or infinity), the first at index "
            f"{tuple(int(i) for i in np.argwhere(bad)[0])}")


def to_dtype(array: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """`array` as a fresh array of `dtype`; a `ValueError` naming tensor `name` if it holds NaN or an
    infinity (a weight never does: the forward would spread it to every token that reaches it silently), or
    if a finite value overflows `dtype`."""
    with np.errstate(over="ignore"):
        out = np.array(array, dtype=dtype)
    if out.size and not math.isfinite(float(np.sum(out, dtype=np.float64))):  # one sum; the count if it fails
        found = non_finite(array)
        if found:
            raise ValueError(f"tensor {name!r} holds {found}: the checkpoint is damaged")
    if ml_dtypes.finfo(dtype).max < ml_dtypes.finfo(array.dtype).max:  # a narrowing cast: look for overflow
        overflow = np.isinf(out) & np.isfinite(array)
        if np.any(overflow):
            value = float(np.asarray(array)[overflow].astype(np.float64).flat[0])
            raise ValueError(f"tensor {name!r} holds {value:.6g}, beyond {dtype.name}'s largest value "
                             f"{float(ml_dtypes.finfo(dtype).max):.6g}: load it with dtype=np.float64")
    return out
