r"""Training checkpoints: the complete state of a run, written so that a killed run loses nothing.

`train(config, checkpoint=DIR, checkpoint_every=N)` (the command's
`--checkpoint DIR --checkpoint-every N`) writes the complete state of the
run every $N$ steps and at the end, and `train(config, resume=DIR)`
(`--resume DIR`) continues it: the log of a resumed run is the log of the
run that was never interrupted, number for number (timings apart), on the
same machine with the same number of BLAS threads. The folder holds:

| file | holds |
|---|---|
| `latest.json` | `{"format": "refimpl.train checkpoint", "version": 2, "checkpoint": "step-00000005-…", "step": 5, "manifest": {"size": …, "sha256": …}}`: which folder is the checkpoint, and its manifest's digest |
| `step-00000005-…/manifest.json` | the configuration, the step, the corpus digest, the random generator's state (the data position), Adam's step, the counters of the log, and each file's size and SHA-256 |
| `…/params.npz` | every parameter of the model, float32, by name |
| `…/adam.npz` | Adam's moments, `m.<name>` and `v.<name>` |
| `…/balancer-<l>.npz` | layer $l$'s balancer, as `Balancer.save` writes it (kind, options, bias, history) |
| `…/log.json` | the log so far: every step's record and the time of each session |

Nothing in it needs pickle: arrays in `.npz` files and JSON (a
non-finite number in `log.json` is written as the string `"NaN"`,
`"Infinity"` or `"-Infinity"`). A checkpoint is written into a new folder
(`.step-…partial`), each file flushed to the disk, the folder renamed to
its final name, and only then is `latest.json` replaced (atomically) to
name it; the previous checkpoint's folder is removed after that. A run
killed at any moment therefore leaves `latest.json` naming a complete
checkpoint (or no `latest.json` at all, if it died before its first one),
and resuming checks every file against its digest. `latest.json` holds the
manifest's own size and SHA-256, so an edit anywhere (a digit of the random
generator's state in the manifest included) is refused by name. A checkpoint
is resumed only by the configuration that wrote it: any other field (the
steps apart) is refused, naming it.

**One writer at a time, and nothing of anyone else's replaced.** A run that
writes checkpoints holds an exclusive lock on its folder (`flock` on the
folder itself, released by the operating system when the process ends, so a
killed run leaves no stale lock): a second run on the same folder is refused
at once, before it writes anything. `check_checkpoint_folder` is what both
the command and `train(checkpoint=...)` ask first: a folder that already
holds a checkpoint is continued only when it is also the run being resumed,
or replaced only with `overwrite=True`; a folder holding other files is
refused. Only the names a checkpoint uses are ever written or removed.
Every file is read only if it is a regular file (never a FIFO or a device,
which could block the reader), and its JSON within the limits of
`refimpl._lib.files.read_json`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import numbers
import os
import re
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._lib.files import (
    check_regular_file,
    fsync_folder,
    new_folder_mode,
    read_bytes,
    read_json,
    write_atomically,
    write_new_file,
)
from .._lib.values import switch_value
from ..balancing import Balancer
from .config import TrainConfig, new_balancers
from .data import Corpus
from .model import Adam, init_model, model_shapes, trained_params
from .step import ONE_PROCESS, Ranks

# ---------------------------------------------------------------------------
# The state of a run, and its checkpoint
# ---------------------------------------------------------------------------

#: What `latest.json` says a checkpoint folder is, and the layout's version.
CHECKPOINT_FORMAT = "refimpl.train checkpoint"
CHECKPOINT_VERSION = 2
POINTER_FILE = "latest.json"
#: The names a checkpoint folder holds: the pointer, the checkpoints, the ones being written.
CHECKPOINT_NAME = re.compile(r"step-\d{8}-[0-9a-f]{8}")
PARTIAL_NAME = re.compile(r"\.step-\d{8}-.+\.partial")
POINTER_PARTIAL = re.compile(r"\.latest\.json\..+\.partial")


@dataclass
class RunState:
    """The complete state of a run between two steps: what a checkpoint holds.

    `step` steps are done; `rng` draws the next batch (its state is the data
    position); `records` is the log so far, `sessions` the stretches of steps
    each process trained (`first_step`, `last_step`, `seconds`).
    """

    step: int
    params: dict[str, np.ndarray]
    adam: Adam
    balancers: list[Balancer]
    rng: np.random.Generator
    records: list[dict[str, Any]] = field(default_factory=list)
    overflow_steps: int = 0
    skipped: int = 0
    sessions: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(cls, config: TrainConfig, ranks: Ranks = ONE_PROCESS) -> RunState:
        """Step 0: the weights drawn with `config.seed` (this process's part of them), fresh balancers and optimizer."""
        rng = np.random.default_rng(config.seed)
        params = ranks.shard(trained_params(init_model(config, rng)))
        adam = Adam(list(params), params, config.lr, config.betas, config.eps)
        return cls(0, params, adam, new_balancers(config), rng)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint on disk, as `read_checkpoint` finds it: its folder, the steps done and the configuration."""

    folder: Path
    step: int
    config: TrainConfig
    manifest: dict[str, Any]


def json_safe(value: Any, nonfinite: Callable[[float], Any]) -> Any:
    """`value` with every non-finite float replaced by `nonfinite(x)` and NumPy scalars made plain."""
    if isinstance(value, Mapping):
        return {key: json_safe(item, nonfinite) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item, nonfinite) for item in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else nonfinite(float(value))
    return value


#: How `log.json` of a checkpoint writes a number that is not finite, so that it reads back exactly.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _nonfinite_name(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _numbers_back(value: Any) -> Any:
    """The inverse of writing non-finite numbers as `_NONFINITE`'s strings (a step record holds no other string)."""
    if isinstance(value, dict):
        return {key: _numbers_back(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_numbers_back(item) for item in value]
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _write_file(path: Path, data: bytes) -> None:
    """Write a new file of a checkpoint being staged, flushed to the disk."""
    write_new_file(path, data)


def _digest(path: Path) -> dict[str, Any]:
    data = read_bytes(path, "the checkpoint file")
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_checkpoint(folder: str | Path, run: RunState, config: TrainConfig, corpus: Corpus) -> Path:
    """Write the state of `run` as a new checkpoint in `folder` and make it the current one; returns its folder.

    The files go into a new folder under a temporary name, each flushed to
    the disk; the folder is renamed to its final name, then `latest.json` is
    replaced atomically to name it, and only then are the earlier
    checkpoints of the folder removed. A process killed at any moment
    leaves `latest.json` naming a complete checkpoint.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"step-{run.step:08d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{stem}-", suffix=".partial", dir=folder))
    try:
        os.chmod(staging, new_folder_mode())
        _write_file(staging / "params.npz", _npz_bytes(run.params))
        _write_file(staging / "adam.npz", _npz_bytes({**{f"m.{name}": value for name, value in run.adam.m.items()},
                                                       **{f"v.{name}": value for name, value in run.adam.v.items()}}))
        for number, balancer in enumerate(run.balancers):
            balancer.save(staging / f"balancer-{number}.npz")
        log = {"steps": run.records, "sessions": run.sessions}
        _write_file(staging / "log.json", json.dumps(json_safe(log, _nonfinite_name), allow_nan=False).encode())
        manifest = {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": run.step,
            "config": config.to_record(), "corpus_sha256": corpus.sha256,
            "rng": run.rng.bit_generator.state, "adam_step": run.adam.t,
            "overflow_steps": run.overflow_steps, "skipped_steps": run.skipped,
            "files": {path.name: _digest(path) for path in sorted(staging.iterdir())},
        }
        _write_file(staging / "manifest.json", json.dumps(manifest, indent=1, allow_nan=False).encode())
        fsync_folder(staging)
        final = folder / f"{stem}-{secrets.token_hex(4)}"
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_folder(folder)
    # The pointer holds the manifest's digest: an edit of the manifest (its random state, a step count) is
    # refused as an edit of any other file is refused through the digests the manifest holds.
    pointer = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "checkpoint": final.name,
               "step": run.step, "manifest": _digest(final / "manifest.json")}
    write_atomically(folder / POINTER_FILE, json.dumps(pointer, indent=1))
    prune_checkpoints(folder, keep=final.name)
    return final


def prune_checkpoints(folder: Path, keep: str) -> None:
    """Remove from `folder` the checkpoints other than `keep`, and any left half-written by a killed run.

    Only what a run writes is removed: a real folder with a checkpoint's name, a regular file with the
    pointer's temporary name. Anything else stays, whatever its name: a symbolic link named like a
    checkpoint is not one of ours (removing it would not free its target, and following it would delete
    files outside the folder), and a folder that vanished meanwhile is gone already. Pruning never fails
    the run whose checkpoint is already written and current: what cannot be removed is a warning.
    """
    for entry in folder.iterdir():
        if entry.name == keep or entry.is_symlink():
            continue
        try:
            if entry.is_dir() and (CHECKPOINT_NAME.fullmatch(entry.name) or PARTIAL_NAME.fullmatch(entry.name)):
                shutil.rmtree(entry)
            elif entry.is_file() and POINTER_PARTIAL.fullmatch(entry.name):
                entry.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:  # a file the process may not remove: the run's checkpoint is current anyway
            warnings.warn(f"checkpoint: could not remove the earlier checkpoint {entry}: {exc.strerror or exc}",
                          RuntimeWarning, stacklevel=2)


def _read_json(path: Path, what: str) -> Any:
    """The JSON in `path`, a regular file, within `read_json`'s limits; every problem a `ValueError` naming it."""
    try:
        return read_json(path, what)
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} is missing") from None
    except OSError as exc:
        raise ValueError(f"{what}: {path} cannot be read: {exc.strerror or exc}") from None


def read_checkpoint(folder: str | Path) -> Checkpoint:
    """The current checkpoint of `folder` (the one `latest.json` names): its configuration and steps done.

    Raises `ValueError` naming the file when the folder holds no complete
    checkpoint, or one written by another format, and naming the folder when
    the operating system cannot look at it (a name too long, a folder above it
    this process may not enter): never a bare `OSError`.
    """
    folder = Path(folder)
    try:
        return _read_checkpoint(folder)
    except OSError as exc:
        raise ValueError(f"{_short(folder)} cannot be read as a training checkpoint: {exc.strerror or exc}") \
            from None


def _short(path: Path) -> str:
    """`path` for a message: whole when short, else its start and its length (a 4,000-character name helps no one)."""
    text = str(path)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _read_checkpoint(folder: Path) -> Checkpoint:
    """`read_checkpoint`'s work, which may raise `OSError` from the file system."""
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder holding a training checkpoint")
    if not (folder / POINTER_FILE).exists():  # present but not a regular file: refused by name below
        raise ValueError(f"{folder} holds no complete training checkpoint (no {POINTER_FILE}: a run that wrote "
                         "none yet, or another folder)")
    pointer = _read_json(folder / POINTER_FILE, "the checkpoint pointer")
    if not isinstance(pointer, dict) or pointer.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{folder / POINTER_FILE} is not a {CHECKPOINT_FORMAT!r} pointer")
    if pointer.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{folder / POINTER_FILE} is version {pointer.get('version')!r} of the checkpoint format; "
                         f"this code reads version {CHECKPOINT_VERSION} (version 1 pointers hold no digest of the "
                         "manifest: resume it with the release that wrote it, or start a new run)")
    name = pointer.get("checkpoint")
    if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name):
        raise ValueError(f"{folder / POINTER_FILE} names no checkpoint folder of this format, got {name!r}")
    manifest_file = folder / name / "manifest.json"
    manifest_digest = None if not manifest_file.exists() else _digest(manifest_file)
    if manifest_digest != pointer.get("manifest"):
        raise ValueError(f"{manifest_file} is not the manifest the checkpoint wrote (missing, or its size or "
                         f"SHA-256 differs from what {folder / POINTER_FILE} records): the checkpoint is damaged")
    manifest = _read_json(manifest_file, "the checkpoint manifest")
    try:
        config = TrainConfig.from_record(manifest["config"])
        step = int(manifest["step"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{folder / name / 'manifest.json'} holds no readable configuration and step: {exc}") \
            from None
    return Checkpoint(folder / name, step, config, manifest)


def _differences(saved: Any, wanted: Any, where: str = "") -> list[str]:
    """The fields whose values differ between two configuration records, as `name: saved -> wanted`."""
    if isinstance(saved, dict) and isinstance(wanted, dict):
        return [line for key in sorted(set(saved) | set(wanted))
                for line in _differences(saved.get(key), wanted.get(key), f"{where}{key}.")]
    return [] if saved == wanted else [f"{where[:-1]}={saved!r} in the checkpoint, {wanted!r} here"]


def _count(manifest: Mapping[str, Any], key: str, where: Path) -> int:
    """The manifest's non-negative integer `key`; a `ValueError` naming the manifest otherwise."""
    value = manifest.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where / 'manifest.json'}: {key} must be a non-negative integer, got {value!r}")
    return value


def _restore_rng(rng: np.random.Generator, state: Any, manifest: Path) -> None:
    """Set `rng` to the saved `state`; a state NumPy cannot take is a `ValueError` naming the manifest."""
    try:
        rng.bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise ValueError(f"{manifest}: the random generator's state cannot be restored ({exc})") from None


def load_run(folder: str | Path, config: TrainConfig, corpus: Corpus) -> RunState:
    """The run saved in `folder`, checked against `config` and `corpus` and against every file's digest."""
    found = read_checkpoint(folder)
    where, manifest = found.folder, found.manifest
    saved, wanted = found.config.to_record(), config.to_record()
    saved.pop("steps")
    wanted.pop("steps")
    different = _differences(saved, wanted)
    if different:
        raise ValueError(f"the checkpoint in {folder} was written by a different configuration: "
                         + "; ".join(different))
    if manifest.get("corpus_sha256") != corpus.sha256:
        raise ValueError(f"the checkpoint in {folder} was trained on another corpus (sha256 "
                         f"{str(manifest.get('corpus_sha256'))[:16]}, this one {corpus.sha256[:16]})")
    if found.step > config.steps:
        raise ValueError(f"the checkpoint in {folder} has done {found.step} steps, more than steps={config.steps}")
    for name, expected in manifest.get("files", {}).items():
        path = where / name
        if not path.is_file() or _digest(path) != expected:
            raise ValueError(f"{path} is not the file the checkpoint wrote (missing, or its size or SHA-256 "
                             "differs): the checkpoint is damaged")
    expected_files = {"params.npz", "adam.npz", "log.json",
                      *(f"balancer-{number}.npz" for number in range(config.moe.num_moe_layers))}
    if not expected_files <= set(manifest.get("files", {})):
        raise ValueError(f"{where / 'manifest.json'} lists the files {sorted(manifest.get('files', {}))}, not "
                         f"{sorted(expected_files)}")
    run = RunState.start(config)  # the structure to fill (the weights drawn here are all replaced)
    with np.load(check_regular_file(where / "params.npz"), allow_pickle=False) as data:
        params = {name: data[name] for name in data.files}
    shapes = trained_params(model_shapes(config))
    if set(params) != set(shapes) or any(params[name].shape != shapes[name] or params[name].dtype != np.float32
                                         for name in shapes):
        raise ValueError(f"{where / 'params.npz'} does not hold the parameters of this model")
    run.params = params
    run.adam.m, run.adam.v = _read_moments(where / "adam.npz", {name: shapes[name] for name in run.adam.names})
    run.adam.t = _count(manifest, "adam_step", where)
    for number, fresh in enumerate(run.balancers):
        restored = Balancer.restore(where / f"balancer-{number}.npz")
        if (type(restored), restored.options(), restored.num_experts, restored.top_k) != \
                (type(fresh), fresh.options(), fresh.num_experts, fresh.top_k):
            raise ValueError(f"{where / f'balancer-{number}.npz'} holds a {restored.kind} balancer with "
                             f"{restored.options()}, not the {fresh.kind} balancer {fresh.options()} of this run")
        run.balancers[number] = restored
    _restore_rng(run.rng, manifest.get("rng"), where / "manifest.json")
    log = _numbers_back(_read_json(where / "log.json", "the checkpoint log"))
    run.records, run.sessions = log["steps"], log["sessions"]
    if [record["step"] for record in run.records] != list(range(1, found.step + 1)):
        raise ValueError(f"{where / 'log.json'} does not hold the records of steps 1 to {found.step}")
    run.step = found.step
    run.overflow_steps, run.skipped = _count(manifest, "overflow_steps", where), _count(manifest, "skipped_steps", where)
    # The run that wrote it may have stopped at its own last step, which it evaluated; this one evaluates
    # only on its schedule.
    for record in run.records:
        if record["step"] % config.eval_every and record["step"] != config.steps:
            record.pop("eval_loss", None)
    return run


def _few(names: list[str], shown: int = 4) -> str:
    """The first `shown` of `names` and how many more, for a message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def _read_moments(path: Path, shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, np.ndarray],
                                                                             dict[str, np.ndarray]]:
    """Adam's moments `m` and `v` from `adam.npz`, each checked; a `ValueError` naming the file and the key else.

    The file must hold exactly `m.<name>` and `v.<name>` for each trained parameter `name` (`shapes`), each
    float32 of the parameter's shape and finite, and every `v` non-negative (a mean of squared gradients:
    a negative one makes the step's square root NaN, and the run would train on NaN to the end). The
    digests prove only that the file is the one the manifest lists; a tool that rewrote both is caught here.
    """
    with np.load(check_regular_file(path), allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    expected = {f"{moment}.{name}" for name in shapes for moment in ("m", "v")}
    missing, unexpected = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
    if missing or unexpected:
        listed = "; ".join(f"{label} {_few(keys)}" for label, keys in (("missing", missing), ("unexpected", unexpected))
                           if keys)
        raise ValueError(f"{path} must hold exactly Adam's moments m.<name> and v.<name> of the {len(shapes)} "
                         f"trained parameters: {listed}")
    moments: dict[str, dict[str, np.ndarray]] = {"m": {}, "v": {}}
    for name, shape in shapes.items():
        for moment in ("m", "v"):
            key, value = f"{moment}.{name}", arrays[f"{moment}.{name}"]
            if value.dtype != np.float32 or value.shape != tuple(shape):
                raise ValueError(f"{path}: {key} must be float32 of shape {list(shape)} (its parameter's), got "
                                 f"{value.dtype} of shape {list(value.shape)}")
            if not np.isfinite(value).all():
                raise ValueError(f"{path}: {key} must be finite, got {int((~np.isfinite(value)).sum())} entries "
                                 "that are NaN or infinite")
            if moment == "v" and (value < 0).any():
                raise ValueError(f"{path}: {key} must be non-negative (a mean of squared gradients), got a "
                                 f"smallest entry of {float(value.min()):g}")
            moments[moment][name] = value
    return moments["m"], moments["v"]


# ---------------------------------------------------------------------------
# Who may write a checkpoint folder
# ---------------------------------------------------------------------------

def _is_checkpoint_name(name: str) -> bool:
    """A name a checkpoint folder holds: the pointer, a checkpoint, one being written."""
    return name == POINTER_FILE or any(pattern.fullmatch(name) for pattern in
                                       (CHECKPOINT_NAME, PARTIAL_NAME, POINTER_PARTIAL))


def check_checkpoint_folder(folder: str | Path, *, resume: str | Path | None = None,
                            overwrite: bool = False) -> None:
    """Refuse, with a `ValueError` naming `folder`, a checkpoint folder this run must not write into.

    `folder` must be a new or empty folder, or one of training checkpoints: one that holds a checkpoint
    already is continued only when it is also `resume`, and replaced (once this run writes its first
    checkpoint) only with `overwrite=True`. A folder without a checkpoint that holds other files is refused
    whatever the flags: they are someone else's. Nothing is written or created here.
    """
    overwrite = switch_value(overwrite, "overwrite")
    folder = Path(folder)
    try:
        _check_checkpoint_folder(folder, resume=resume, overwrite=overwrite)
    except OSError as exc:
        raise ValueError(f"checkpoint: {_short(folder)} cannot be checked: {exc.strerror or exc}") from None


def _check_checkpoint_folder(folder: Path, *, resume: str | Path | None, overwrite: bool) -> None:
    """`check_checkpoint_folder`'s work, which may raise `OSError` from the file system."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"checkpoint: {folder} is a file, not a folder")
    if not folder.is_dir():
        return
    names = sorted(entry.name for entry in folder.iterdir())
    resuming_here = resume is not None and folder.resolve() == Path(resume).resolve()
    if POINTER_FILE in names:
        # A checkpoint folder: only its own names are ever written or removed; files the user added stay.
        if not (resuming_here or overwrite):
            raise ValueError(f"checkpoint: {folder} already holds a training checkpoint; pass --resume {folder} "
                             "(resume= in Python) to continue it, or --overwrite (overwrite=True) to replace it "
                             "once this run writes its first checkpoint")
        return
    others = [name for name in names if not _is_checkpoint_name(name)]
    if others:
        raise ValueError(f"checkpoint: {folder} holds files that are not a training checkpoint "
                         f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); name a new or empty "
                         "folder")


@contextlib.contextmanager
def checkpoint_lock(folder: str | Path) -> Iterator[Path]:
    """Hold the exclusive lock on the checkpoint folder `folder` (created if missing) while the block runs.

    A second holder, in this process or another, is refused at once with a `ValueError` naming the folder.
    The lock is the operating system's (`flock` on the folder), so a process that dies releases it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"checkpoint: another run is writing checkpoints into {folder} (it holds the "
                             "folder's lock); wait for it to end, or name another folder") from None
        yield folder
    finally:
        os.close(descriptor)  # closing the descriptor releases the lock
