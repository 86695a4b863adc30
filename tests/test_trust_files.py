"""Hostile files: `save_hf_layer` loses nothing, `load_hf_layer` reads only what the checkpoint holds.

Every test writes the bad input, runs what a user runs, and checks both the error and that nothing
was lost or invented: the folder is compared byte for byte (names, contents, permissions) with a
snapshot taken before, and a checkpoint that should have survived is loaded and compared with what
was loaded from it before. Safetensors headers are cross-checked against the `safetensors` library,
which implements the format independently of `refimpl.checkpoints.hf_checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import example, given
from hypothesis import strategies as st

from refimpl import MoEConfig, init_params, stable_latent_moe
from refimpl.checkpoints import (
    INCOMPLETE_SAVE_MARK,
    ExpertStack,
    load_hf_layer,
    open_safetensors,
    read_safetensors_header,
    save_hf_layer,
)

TINY = MoEConfig(hidden_size=64, latent_size=32, num_experts=4, top_k=2, intermediate_size=64,
                 num_shared_experts=1, num_moe_layers=2)
# A second layer that differs in its configuration too: a mix of the two would not be caught by shapes.
OTHER = TINY.replace(routed_scaling_factor=2.5, situ_beta=3.0)
SHARDS = 20_000  # bytes: TINY's MXFP4 layer in several shards
BASE = "language_model.model.layers.1.block_sparse_moe."


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder` (hidden ones too): relative name -> (contents, permission bits)."""
    out = {}
    for file in sorted(folder.rglob("*")):
        if file.is_file() or file.is_symlink():
            out[str(file.relative_to(folder))] = (file.read_bytes() if file.exists() else b"<dangling>",
                                                  stat.S_IMODE(os.lstat(file).st_mode))
    return out


def loaded(folder: Path, **kwargs) -> tuple[MoEConfig, dict[str, np.ndarray]]:
    """The layer in `folder`, every expert decoded, as plain arrays (for exact comparisons)."""
    config, params = load_hf_layer(folder, 1, **kwargs)
    out = {}
    for name, value in params.items():
        out[name] = np.stack(list(value)) if isinstance(value, ExpertStack) else np.asarray(value)
    return config, out


def assert_same_layer(a: tuple[MoEConfig, dict], b: tuple[MoEConfig, dict]) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        np.testing.assert_array_equal(a[1][name], b[1][name], err_msg=name)


def save(folder: Path, config: MoEConfig = TINY, seed: int = 0, **kwargs) -> Path:
    return save_hf_layer(folder, config, init_params(config, seed, bias_scale=0.05), layer=1, **kwargs)


# ---------------------------------------------------------------------------
# save_hf_layer: asks before it replaces
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("existing", ["config.json", "model.safetensors.index.json", "model.safetensors",
                                      INCOMPLETE_SAVE_MARK])
def test_a_folder_holding_a_checkpoint_is_refused(tmp_path, existing):
    (tmp_path / existing).write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=rf"{tmp_path} already holds a checkpoint \({existing}\): pass "
                                              r"overwrite=True to replace it"):
        save(tmp_path)
    assert snapshot(tmp_path) == before


def test_saving_twice_is_refused_and_changes_nothing(tmp_path):
    save(tmp_path, shard_size=SHARDS)
    before, layer = snapshot(tmp_path), loaded(tmp_path)
    with pytest.raises(FileExistsError, match=r"config.json, model.safetensors.index.json"):
        save(tmp_path, OTHER, seed=1, shard_size=SHARDS)
    assert snapshot(tmp_path) == before
    assert_same_layer(loaded(tmp_path), layer)


def test_a_folder_of_other_files_is_written_into(tmp_path):
    (tmp_path / "model-finetuned.safetensors").write_bytes(b"not ours")
    save(tmp_path)
    assert (tmp_path / "model-finetuned.safetensors").read_bytes() == b"not ours"
    assert loaded(tmp_path)[0] == TINY


def test_a_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "ckpt").write_text("a file")
    with pytest.raises(FileExistsError, match="exists and is not a folder"):
        save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt").read_text() == "a file"


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    params = init_params(TINY, 0)
    with pytest.raises(TypeError, match="overwrite must be True or False, got str 'yes'"):
        save_hf_layer(tmp_path / "a", TINY, params, overwrite="yes")
    with pytest.raises(ValueError, match="shard_size must be a positive number of bytes or None, got 0"):
        save_hf_layer(tmp_path / "a", TINY, params, shard_size=0)
    bad = dict(params)
    bad["experts.w3"] = bad["experts.w3"].copy()
    bad["experts.w3"][2, 0, 0] = np.nan
    with pytest.raises(ValueError, match=r"params\['experts.w3'\] holds 1 non-finite value\(s\) \(NaN or infinity\), "
                                         r"the first at index \(2, 0, 0\)"):
        save_hf_layer(tmp_path / "a", TINY, bad)
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------------------
# save_hf_layer(overwrite=True): replaces only what it wrote
# ---------------------------------------------------------------------------

def test_overwrite_keeps_every_file_it_did_not_write(tmp_path):
    save(tmp_path, shard_size=SHARDS)
    old_shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    count = len(old_shards)
    assert count >= 2
    # The user's files: an unrelated checkpoint, notes, and a file with the name a new shard would take.
    safetensors.numpy.save_file({"w": np.arange(4, dtype=np.float32)}, tmp_path / "model-finetuned.safetensors")
    (tmp_path / "notes.txt").write_text("keep me")
    clash = f"model-00001-of-{count:05d}-2.safetensors"
    (tmp_path / clash).write_bytes(b"a user's file named like a shard")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.safetensors").write_bytes(b"in a subfolder")
    mine = {name: value for name, value in snapshot(tmp_path).items()
            if name in ("model-finetuned.safetensors", "notes.txt", clash, "sub/model.safetensors")}

    save(tmp_path, OTHER, seed=1, shard_size=SHARDS, overwrite=True)
    after = snapshot(tmp_path)
    for name, value in mine.items():
        assert after[name] == value, name  # untouched, byte for byte and mode
    new_shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert not new_shards & old_shards and clash not in new_shards  # fresh names: the old index never saw them
    assert set(after) == set(mine) | new_shards | {"config.json", "model.safetensors.index.json"}
    assert_same_layer(loaded(tmp_path), (OTHER, loaded_fresh(tmp_path.parent / "fresh", OTHER, 1)[1]))


def loaded_fresh(folder: Path, config: MoEConfig, seed: int, **kwargs):
    """The layer as a fresh save into an empty folder loads it: what an overwrite must produce."""
    save(folder, config, seed=seed, **kwargs)
    return loaded(folder)


@pytest.mark.parametrize("old_shards,new_shards", [(None, None), (None, SHARDS), (SHARDS, None), (SHARDS, SHARDS)])
def test_overwrite_between_layouts(tmp_path, old_shards, new_shards):
    folder = tmp_path / "ckpt"
    save(folder, shard_size=old_shards)
    (folder / "README.md").write_text("mine")
    save(folder, OTHER, seed=1, shard_size=new_shards, overwrite=True)
    assert_same_layer(loaded(folder), loaded_fresh(tmp_path / "fresh", OTHER, 1, shard_size=new_shards))
    names = set(snapshot(folder))
    if new_shards is None:
        assert names == {"README.md", "config.json", "model.safetensors"}  # a stale index would shadow the file
    else:
        listed = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert names == {"README.md", "config.json", "model.safetensors.index.json"} | listed


def test_overwrite_never_deletes_outside_the_folder(tmp_path):
    folder = tmp_path / "ckpt"
    save(folder, shard_size=SHARDS)
    outside = tmp_path / "precious.safetensors"
    outside.write_bytes(b"not in the checkpoint")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["some.other.tensor"] = "../precious.safetensors"
    index["weight_map"]["and.another"] = str(outside)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save(folder, OTHER, seed=1, shard_size=SHARDS, overwrite=True)
    assert outside.read_bytes() == b"not in the checkpoint"
    assert loaded(folder)[0] == OTHER


# ---------------------------------------------------------------------------
# Transactional: a failure leaves the old checkpoint, never a mix
# ---------------------------------------------------------------------------

def _failing_on_call(n: int, real, error: BaseException):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("old_shards", [None, SHARDS])
@pytest.mark.parametrize("new_shards", [None, SHARDS])
def test_a_full_disk_at_the_second_shard_leaves_the_old_checkpoint(tmp_path, monkeypatch, old_shards, new_shards):
    save(tmp_path, shard_size=old_shards)
    before, layer = snapshot(tmp_path), loaded(tmp_path)
    monkeypatch.setattr(safetensors.numpy, "save_file",
                        _failing_on_call(2 if new_shards else 1, safetensors.numpy.save_file,
                                         OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left on device"):
        save(tmp_path, OTHER, seed=1, shard_size=new_shards, overwrite=True)
    assert snapshot(tmp_path) == before  # no temporary file left, nothing replaced
    assert_same_layer(loaded(tmp_path), layer)


def test_a_failed_first_save_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors.numpy, "save_file",
                        _failing_on_call(2, safetensors.numpy.save_file, OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        save(tmp_path / "new" / "ckpt", shard_size=SHARDS)
    assert not (tmp_path / "new").exists()  # the folders it made are gone again


def _renames_of_a_save(tmp_path: Path, monkeypatch) -> int:
    """How many os.replace calls an overwriting sharded save makes (the mark, the shards, config, index)."""
    folder = tmp_path / "count"
    save(folder, shard_size=SHARDS)
    counter = _failing_on_call(0, os.replace, AssertionError())
    monkeypatch.setattr(os, "replace", counter)
    save(folder, OTHER, seed=1, shard_size=SHARDS, overwrite=True)
    monkeypatch.undo()
    return len(counter.__closure__[0].cell_contents)


def test_a_failure_at_any_rename_never_loads_a_mix(tmp_path, monkeypatch):
    renames = _renames_of_a_save(tmp_path, monkeypatch)
    assert renames >= 5  # the mark, >= 2 shards, config.json, the index
    new = loaded_fresh(tmp_path / "fresh", OTHER, 1, shard_size=SHARDS)
    real_replace = os.replace
    for k in range(1, renames + 1):
        folder = tmp_path / f"at-{k}"
        save(folder, shard_size=SHARDS)
        before, old = snapshot(folder), loaded(folder)
        monkeypatch.setattr(os, "replace", _failing_on_call(k, real_replace, OSError(5, "Input/output error")))
        with pytest.raises(OSError, match="Input/output error"):
            save(folder, OTHER, seed=1, shard_size=SHARDS, overwrite=True)
        monkeypatch.setattr(os, "replace", real_replace)
        assert not [name for name in snapshot(folder) if name.endswith(".tmp")], k
        if k <= renames - 2:  # the mark and the new shards (fresh names): all taken back
            assert snapshot(folder) == before, k
            assert_same_layer(loaded(folder), old)
        else:  # config.json or the index was being replaced: the folder says so instead of loading
            with pytest.raises(ValueError, match=rf"holds {INCOMPLETE_SAVE_MARK}: a save_hf_layer into this "
                                                 "folder stopped while it replaced the checkpoint"):
                load_hf_layer(folder, 1)
            with pytest.raises(FileExistsError, match=INCOMPLETE_SAVE_MARK):
                save(folder, OTHER, seed=1, shard_size=SHARDS)
        # Saving again with overwrite=True completes it and cleans up what the interrupted save left.
        save(folder, OTHER, seed=1, shard_size=SHARDS, overwrite=True)
        assert_same_layer(loaded(folder), new)
        listed = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert set(snapshot(folder)) == {"config.json", "model.safetensors.index.json"} | listed, k


def _crash_during_save(folder: Path, k: int) -> int:
    """Run an overwriting save in a forked child that dies (os._exit: no handler, no cleanup) at its k-th rename."""
    return _crash_at_call(folder, os, "replace", k, seed=1, after=False)


def _crash_at_call(folder: Path, owner, name: str, k: int, *, seed: int, after: bool) -> int:
    """Run an overwriting save in a forked child that dies (os._exit) at its k-th call of `owner.name`, before
    the call or, with `after`, once it has returned; the child's exit code (3 when it died there)."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 4
        try:
            calls = []
            real = getattr(owner, name)

            def dying(*args):
                calls.append(args)
                if len(calls) == k and not after:
                    os._exit(3)  # a crash: power cut, kill -9
                result = real(*args)
                if len(calls) == k:
                    os._exit(3)
                return result
            setattr(owner, name, dying)
            save(folder, OTHER, seed=seed, shard_size=SHARDS, overwrite=True)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="simulates a crash in a forked process")
def test_a_crash_at_any_rename_never_loads_a_mix(tmp_path, monkeypatch):
    renames = _renames_of_a_save(tmp_path, monkeypatch)
    new = loaded_fresh(tmp_path / "fresh", OTHER, 1, shard_size=SHARDS)
    for k in range(1, renames + 1):
        folder = tmp_path / f"crash-{k}"
        save(folder, shard_size=SHARDS)
        old = loaded(folder)
        assert _crash_during_save(folder, k) == 3
        try:
            state = loaded(folder)
        except ValueError as exc:
            assert INCOMPLETE_SAVE_MARK in str(exc)
        else:
            assert k == 1  # only before the mark is in place does the folder still load, as it was
            assert_same_layer(state, old)
        save(folder, OTHER, seed=1, shard_size=SHARDS, overwrite=True)
        assert_same_layer(loaded(folder), new)
        # Nothing of the crashed save is left: its mark listed its files, temporary ones included, and a crash
        # at the mark's own rename (k = 1) leaves only temporary files named as a save names them.
        assert set(snapshot(folder)) == _checkpoint_files(folder), k


def _checkpoint_files(folder: Path) -> set[str]:
    """The files of the sharded checkpoint in `folder`: its config, its index and the shards the index lists."""
    listed = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    return {"config.json", "model.safetensors.index.json"} | listed


def _crash_while_staging(folder: Path, k: int, seed: int) -> int:
    """Run an overwriting save in a forked child that dies (os._exit) once it has staged its k-th shard."""
    import refimpl.checkpoints.hf_checkpoint as module

    return _crash_at_call(folder, module, "_write_safetensors", k, seed=seed, after=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="simulates a crash in a forked process")
def test_a_crash_while_staging_leaves_the_old_checkpoint_and_the_next_save_removes_its_files(tmp_path):
    folder = save(tmp_path / "ckpt", shard_size=SHARDS)
    old = loaded(folder)
    (folder / ".notes.tmp").write_text("mine")  # a hidden file of the user's, not named as a save names its own
    assert _crash_while_staging(folder, 2, seed=1) == 3
    assert_same_layer(loaded(folder), old)  # no mark yet: the old checkpoint loads as it was
    assert len(set(snapshot(folder)) - _checkpoint_files(folder)) == 3  # two staged shards and the user's file
    save(folder, OTHER, seed=2, shard_size=SHARDS, overwrite=True)
    assert set(snapshot(folder)) == _checkpoint_files(folder) | {".notes.tmp"}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="simulates a crash in a forked process")
def test_two_crashed_saves_in_a_row_leave_nothing_after_a_complete_one(tmp_path, monkeypatch):
    renames = _renames_of_a_save(tmp_path, monkeypatch)
    folder = save(tmp_path / "ckpt", shard_size=SHARDS)
    assert _crash_during_save(folder, 3) == 3
    assert _crash_during_save(folder, renames - 1) == 3  # the second one, too, placed shards of its own
    with pytest.raises(ValueError, match=INCOMPLETE_SAVE_MARK):
        loaded(folder)
    save(folder, OTHER, seed=1, shard_size=SHARDS, overwrite=True)
    assert_same_layer(loaded(folder), loaded_fresh(tmp_path / "fresh", OTHER, 1, shard_size=SHARDS))
    assert set(snapshot(folder)) == _checkpoint_files(folder)


# ---------------------------------------------------------------------------
# Permissions and flushing
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002, 0o077])
def test_new_files_get_the_umask_permissions(tmp_path, umask):
    previous = os.umask(umask)
    try:
        save(tmp_path, shard_size=SHARDS)
    finally:
        os.umask(previous)
    for name, (_, mode) in snapshot(tmp_path).items():
        assert mode == 0o666 & ~umask, (name, oct(mode))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name an fsync'ed descriptor")
def test_every_file_is_flushed_before_it_is_renamed(tmp_path, monkeypatch):
    flushed = []
    real_fsync = os.fsync

    def fsync(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    save(tmp_path, shard_size=SHARDS)
    names = [Path(f).name for f in flushed]
    for final in snapshot(tmp_path):
        assert any(name.startswith(f".{final}.") and name.endswith(".tmp") for name in names), final
    assert str(tmp_path) in flushed  # the folder itself, after the renames


# ---------------------------------------------------------------------------
# load_hf_layer: only files inside the folder
# ---------------------------------------------------------------------------

def _point_index_at(folder: Path, tensor: str, entry) -> None:
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"][tensor] = entry
    index_file.write_text(json.dumps(index))


@pytest.mark.parametrize("entry_of", [
    lambda outside: "../outside.safetensors",
    lambda outside: str(outside),
    lambda outside: "sub/../../outside.safetensors",
    lambda outside: "..\\outside.safetensors",
    lambda outside: "C:\\weights\\x.safetensors",
    lambda outside: "",
    lambda outside: 7,
    lambda outside: None,
], ids=["dotdot", "absolute", "climbing", "windows-dotdot", "windows-drive", "empty", "number", "null"])
def test_a_weight_map_entry_leaving_the_folder_is_refused(tmp_path, entry_of):
    folder = tmp_path / "ckpt"
    save(folder, shard_size=SHARDS)
    outside = tmp_path / "outside.safetensors"
    # A valid shard outside the folder that holds the very tensor: a loader that followed the entry would work.
    tensor = BASE + "gate.weight"
    safetensors.numpy.save_file({tensor: np.full((4, 64), 1e30, np.float32)}, outside)
    entry = entry_of(outside)
    _point_index_at(folder, tensor, entry)
    with pytest.raises(ValueError, match=rf"weight_map entry '{tensor}' -> {re.escape(repr(entry))}"):
        load_hf_layer(folder, 1)


def test_a_symbolic_link_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    save(folder, shard_size=SHARDS)
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][BASE + "gate.weight"]
    (folder / shard).rename(tmp_path / shard)
    (folder / shard).symlink_to(tmp_path / shard)
    with pytest.raises(ValueError, match=rf"{re.escape(repr(shard))} resolves to .*, outside the checkpoint folder"):
        load_hf_layer(folder, 1)


def test_a_symbolic_link_inside_the_folder_is_followed(tmp_path):
    folder = tmp_path / "ckpt"
    save(folder, shard_size=SHARDS)
    layer = loaded(folder)
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][BASE + "gate.weight"]
    (folder / "store").mkdir()
    (folder / shard).rename(folder / "store" / shard)
    (folder / shard).symlink_to(Path("store") / shard)
    assert_same_layer(loaded(folder), layer)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_linked_config_or_single_shard_outside_is_refused(tmp_path, name):
    folder = tmp_path / "ckpt"
    save(folder)
    (folder / name).rename(tmp_path / name)
    (folder / name).symlink_to(tmp_path / name)
    with pytest.raises(ValueError, match=rf"'{name}' resolves to .*outside the checkpoint folder"):
        load_hf_layer(folder, 1)


def test_a_folder_with_the_mark_of_an_interrupted_save_is_refused(tmp_path):
    save(tmp_path)
    (tmp_path / INCOMPLETE_SAVE_MARK).write_text("{}")
    with pytest.raises(ValueError, match=rf"holds {INCOMPLETE_SAVE_MARK}.*overwrite=True"):
        load_hf_layer(tmp_path, 1)


# ---------------------------------------------------------------------------
# load_hf_layer: malformed JSON and safetensors headers
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("content,pattern", [
    (b'{"text_config": {', r"config.json is not valid JSON: Expecting .* at line 1, column"),
    (b"\xff\xfe{}", r"config.json is not UTF-8 text"),
    (b"[1, 2]", r"config.json must hold a JSON object \(the model's configuration\), got list"),
    (b'{"text_config": 5}', r"config.json: hf\['text_config'\] must be a mapping"),
    (b'{"text_config": {"hidden_size": "64", "num_experts": 4, "num_experts_per_token": 2, '
     b'"moe_intermediate_size": 64}}', r"config.json: hf\['text_config'\]\['hidden_size'\] must be a positive "
                                       r"integer, got '64'"),
])
def test_a_malformed_config_is_named(tmp_path, content, pattern):
    save(tmp_path)
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=pattern):
        load_hf_layer(tmp_path, 1)


@pytest.mark.parametrize("content,pattern", [
    (b'{"weight_map": {', r"model.safetensors.index.json is not valid JSON"),
    (b"[]", r"model.safetensors.index.json has no 'weight_map' mapping"),
    (b'{"weight_map": ["a"]}', r"model.safetensors.index.json has no 'weight_map' mapping"),
])
def test_a_malformed_index_is_named(tmp_path, content, pattern):
    save(tmp_path, shard_size=SHARDS)
    (tmp_path / "model.safetensors.index.json").write_bytes(content)
    with pytest.raises(ValueError, match=pattern):
        load_hf_layer(tmp_path, 1)


def _split(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _join(file: Path, header, data: bytes, *, text: str | None = None, length: int | None = None) -> None:
    body = (json.dumps(header) if text is None else text).encode()
    file.write_bytes((len(body) if length is None else length).to_bytes(8, "little") + body + data)


def _first_two(header: dict) -> tuple[str, str]:
    """The names of the first two tensors in data order."""
    names = sorted((e["data_offsets"], n) for n, e in header.items() if n != "__metadata__")
    return names[0][1], names[1][1]


def _negative(h, d):
    a, _ = _first_two(h)
    h[a]["data_offsets"] = [-8, h[a]["data_offsets"][1] - 8]
    return h, d


def _overlap(h, d):
    a, b = _first_two(h)
    size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]  # reads a's bytes as b's
    return h, d


def _gap(h, d):
    a, _ = _first_two(h)
    begin, end = h[a]["data_offsets"]
    h[a]["data_offsets"] = [begin + 4, end + 4]  # shifted into the next tensor
    return h, d


def _beyond(h, d):
    last = max((e["data_offsets"][1], n) for n, e in h.items() if n != "__metadata__")[1]
    begin, end = h[last]["data_offsets"]
    h[last]["data_offsets"] = [begin, end + 1024]
    h[last]["shape"] = [(end + 1024 - begin) // 4]
    h[last]["dtype"] = "F32"
    return h, d


def _count(h, d):
    a, _ = _first_two(h)
    h[a]["shape"] = [h[a]["shape"][0] + 1] + h[a]["shape"][1:]
    return h, d


def _set(field, value):
    def change(h, d):
        a, _ = _first_two(h)
        h[a][field] = value
        return h, d
    return change


HEADER_CASES = {
    "negative offsets": (_negative, r"needs data_offsets \[begin, end\] of two non-negative integers"),
    "overlapping tensors": (_overlap, r"overlaps the tensor before it"),
    "a gap": (_gap, r"leaves bytes \[0, 4\) unused"),
    "beyond the file": (_beyond, r"has data_offsets .* outside the \d+ bytes of data"),
    "byte count": (_count, r"needs \d+ bytes, but its data_offsets \[\d+, \d+\] hold \d+"),
    "unknown dtype": (_set("dtype", "Q4_K"), r"has dtype 'Q4_K', which this reader does not know"),
    "boolean shape": (_set("shape", [True, 2]), r"needs a shape that is a list of non-negative integers"),
    "negative shape": (_set("shape", [-1, 2]), r"needs a shape that is a list of non-negative integers"),
    "three offsets": (_set("data_offsets", [0, 4, 8]), r"needs data_offsets \[begin, end\]"),
    "entry not an object": (lambda h, d: ({**h, "x": [1, 2]}, d), r"tensor 'x' has a header entry that is not an object"),
    "trailing bytes": (lambda h, d: (h, d + b"\0" * 16), r"its tensors cover \d+ bytes of data, but \d+ follow"),
    "metadata": (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d), r"__metadata__ must map names to strings"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_a_malformed_header_is_refused_before_any_byte_is_used(tmp_path, case):
    save(tmp_path, mxfp4=False)
    shard = tmp_path / "model.safetensors"
    change, pattern = HEADER_CASES[case]
    header, data = _split(shard)
    _join(shard, *change(header, data))
    with pytest.raises(ValueError, match=pattern):
        read_safetensors_header(shard)
    with pytest.raises(ValueError, match=rf"{re.escape(str(shard))}: "):
        load_hf_layer(tmp_path, 1)
    with pytest.raises(Exception):  # noqa: B017 - the safetensors library refuses it as well, in its own words
        safetensors.numpy.load(shard.read_bytes())


@pytest.mark.parametrize("raw,pattern", [
    (b"\x05\x00\x00", r"fewer than the 8 of its header length"),
    ((10**6).to_bytes(8, "little") + b"{}", r"its header length 1000000 exceeds the 2 bytes that follow it"),
    ((4).to_bytes(8, "little") + b"\xff\xfe\xfd\xfc", r"its header is not UTF-8 text"),
    ((4).to_bytes(8, "little") + b"{x:1", r"its header is not valid JSON"),
    ((5).to_bytes(8, "little") + b'{"a":', r"its header is not valid JSON"),
    ((7).to_bytes(8, "little") + b"[1,2,3]", r"a safetensors header must be a JSON object, got list"),
    (len(b'{"a": {"dtype": "F32"}, "a": 1}').to_bytes(8, "little") + b'{"a": {"dtype": "F32"}, "a": 1}',
     r"the name 'a' appears twice"),
])
def test_a_file_that_is_not_safetensors_is_named(tmp_path, raw, pattern):
    file = tmp_path / "x.safetensors"
    file.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"{re.escape(str(file))}.*{pattern}"):
        read_safetensors_header(file)


# The property: for headers drawn around a valid one, refimpl accepts exactly what the safetensors library
# accepts, and reads the same values. (Dtypes whose NumPy form both sides share: no bfloat16, float8, bool.)
DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32, "I8": np.int8, "U8": np.uint8,
          "I64": np.int64, "I16": np.int16}


@st.composite
def headers(draw):
    count = draw(st.integers(1, 3))
    entries, position = {}, 0
    for i in range(count):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=2))
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        entries[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + size]}
        position += size
    data = draw(st.binary(min_size=position, max_size=position))
    # Then perturb: shift an offset, change a shape or dtype, add or cut trailing bytes.
    for name in entries:
        if draw(st.booleans()):
            begin, end = entries[name]["data_offsets"]
            entries[name]["data_offsets"] = [begin + draw(st.integers(-2, 2)), end + draw(st.integers(-2, 2))]
        if draw(st.integers(0, 4)) == 0:
            entries[name]["shape"] = draw(st.lists(st.integers(0, 3), max_size=2))
        if draw(st.integers(0, 4)) == 0:
            entries[name]["dtype"] = draw(st.sampled_from(sorted(DTYPES)))
    extra = draw(st.integers(-2, 2))
    data = data + b"\x01" * extra if extra > 0 else data[:len(data) + extra] if extra < 0 else data
    return entries, data


@given(case=headers())
@example(case=({"t0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "t1": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]}}, b"\0\0\x80?"))
@example(case=({"t0": {"dtype": "F16", "shape": [], "data_offsets": [0, 2]}}, b"\0\0"))  # a scalar tensor
def test_headers_are_accepted_exactly_when_the_safetensors_library_accepts_them(case):
    entries, data = case
    body = json.dumps(entries).encode()
    raw = len(body).to_bytes(8, "little") + body + data
    try:
        theirs = safetensors.numpy.load(raw)
    except Exception:
        theirs = None
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / "x.safetensors"
        file.write_bytes(raw)
        try:
            ours = {name: np.array(t) for name, t in open_safetensors(file).items()}
        except ValueError:
            ours = None
    assert (ours is None) == (theirs is None), (entries, len(data))
    if ours is not None:
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape
            np.testing.assert_array_equal(ours[name].reshape(-1).view(np.uint8), theirs[name].reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------
# load_hf_layer: dtype, NaN scales, values the dtype cannot hold
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int32, np.uint8, bool, "int64", np.complex64, "not a dtype"])
def test_dtype_must_be_floating(tmp_path, dtype):
    save(tmp_path)
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype \(float16, bfloat16, float32 or float64\)"):
        load_hf_layer(tmp_path, 1, dtype=dtype)


def test_float64_loading_decodes_exactly_what_float32_does(tmp_path):
    save(tmp_path)
    c32, p32 = loaded(tmp_path)
    c64, p64 = loaded(tmp_path, dtype="float64")
    assert c32 == c64
    for name in p32:
        assert p64[name].dtype == np.float64
        np.testing.assert_array_equal(p64[name], p32[name].astype(np.float64), err_msg=name)


def _rewrite_single(folder: Path, change) -> None:
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    change(tensors)
    safetensors.numpy.save_file(tensors, folder / "model.safetensors")


def test_a_nan_scale_byte_is_refused_naming_tensor_and_expert(tmp_path):
    save(tmp_path)
    name = BASE + "experts.2.w3.weight_scale"

    def change(t):
        t[name] = t[name].copy()
        t[name][5, 0] = 255
    _rewrite_single(tmp_path, change)
    config, params = load_hf_layer(tmp_path, 1)  # lazy: nothing is decoded yet
    with pytest.raises(ValueError, match=rf"tensor '{name}' \(expert 2 of 4\): scale holds the E8M0 NaN byte 255 "
                                         r"in 1 block\(s\), the first at scale index \[5, 0\]"):
        params["experts.w3"][2]
    params["experts.w3"][1]  # the other experts decode
    x = np.random.default_rng(3).standard_normal((64, config.d)).astype(np.float32)  # uses every expert
    with pytest.raises(ValueError, match=r"expert 2 of 4.*NaN byte 255"):
        stable_latent_moe(x, params, config)


def test_a_scale_float32_cannot_hold_is_refused_and_float64_decodes_it(tmp_path):
    save(tmp_path)
    packed_name, scale_name = BASE + "experts.1.w1.weight_packed", BASE + "experts.1.w1.weight_scale"
    original = loaded(tmp_path)[1]["experts.w1"][1]

    def change(t):
        t[scale_name], t[packed_name] = t[scale_name].copy(), t[packed_name].copy()
        t[scale_name][0, 0] = 254  # 2^127
        t[packed_name][0, :16] = 0x77  # 32 values of code 7 = 6: 6 * 2^127 is beyond float32
    _rewrite_single(tmp_path, change)
    _, params = load_hf_layer(tmp_path, 1)
    with pytest.raises(ValueError, match=rf"tensor '{BASE}experts.1.w1.weight_scale' \(expert 1 of 4\): MXFP4 "
                                         r"values overflow float32.*scale byte 254.*dtype=np.float64"):
        params["experts.w1"][1]
    _, wide = load_hf_layer(tmp_path, 1, dtype=np.float64)
    w = wide["experts.w1"][1]
    assert w[0, :32].tolist() == [6 * 2.0**127] * 32  # exact
    np.testing.assert_array_equal(w[0, 32:], original[0, 32:])
    np.testing.assert_array_equal(w[1:], original[1:])


def test_a_float64_tensor_float32_cannot_hold_is_refused(tmp_path):
    params = init_params(TINY, 0, dtype=np.float64)
    params["routed_expert_up_proj.weight"][3, 4] = 1e300
    save_hf_layer(tmp_path, TINY, params, mxfp4=False)
    with pytest.raises(ValueError, match=rf"tensor '{BASE}routed_expert_up_proj.weight' holds 1e\+300, beyond "
                                         r"float32's largest value 3.40282e\+38: load it with dtype=np.float64"):
        load_hf_layer(tmp_path, 1)
    _, wide = load_hf_layer(tmp_path, 1, dtype=np.float64)
    assert wide["routed_expert_up_proj.weight"][3, 4] == 1e300


def test_bfloat16_loading_keeps_the_bias_in_float32(tmp_path):
    save(tmp_path)
    _, params = load_hf_layer(tmp_path, 1, dtype=ml_dtypes.bfloat16)
    assert params["gate.weight"].dtype == ml_dtypes.bfloat16
    assert params["gate.e_score_correction_bias"].dtype == np.float32
    assert params["experts.w2"][0].dtype == ml_dtypes.bfloat16
