"""Hostile files, second round: special files, JSON at its limits, training checkpoints that cannot be fooled.

Each case here failed on the release before this one: it hung, lost someone's data, gave a silently wrong
number or a raw error from a dependency. A case that could hang runs in a daemon thread with a deadline;
should it block, the test unblocks it (by opening the FIFO's other end) and fails, so the suite never hangs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from refimpl import MoEConfig, init_params
from refimpl._lib.files import MAX_JSON_INTEGER_DIGITS, parse_json, read_json
from refimpl.balancing import Balancer, QuantileBalancer
from refimpl.checkpoints import load_hf_layer, open_safetensors, read_safetensors_header, save_hf_layer
from refimpl.train import TrainConfig, default_layer, load_corpus, main, read_checkpoint, train
from refimpl.train.checkpoints import checkpoint_lock

ROOT = Path(__file__).resolve().parents[1]
LAYER = MoEConfig(hidden_size=64, latent_size=32, num_experts=4, top_k=2, intermediate_size=64,
                  num_shared_experts=1, num_moe_layers=2)
SHARDS = 20_000  # bytes: the layer in several shards
DEADLINE = 20.0  # seconds; reading a few kilobytes takes milliseconds


def within_deadline(call: Callable[[], Any], fifos: list[Path]) -> BaseException | None:
    """Run `call` in a daemon thread; the exception it raised (None if none). A call still blocked at the
    deadline is unblocked by opening each FIFO for writing, and the test fails: it would have hung."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the caller inspects it
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    if thread.is_alive():
        for fifo in fifos:
            with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
                pass
        thread.join(DEADLINE)
        pytest.fail(f"the call blocked for {DEADLINE} s on a FIFO instead of refusing it")
    return outcome[0]


def assert_refused(call: Callable[[], Any], fifos: list[Path], pattern: str) -> None:
    error = within_deadline(call, fifos)
    assert isinstance(error, ValueError), f"expected a ValueError, got {error!r}"
    assert re.search(pattern, str(error)), str(error)


def replace_with_fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def save_layer(folder: Path, **kwargs) -> Path:
    return save_hf_layer(folder, LAYER, init_params(LAYER, 0, bias_scale=0.05), layer=1, **kwargs)


def first_shard(folder: Path) -> str:
    return sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]


# ---------------------------------------------------------------------------
# Special files: refused by name, never waited on
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout,name", [("single", "config.json"), ("single", "model.safetensors"),
                                         ("sharded", "model.safetensors.index.json"), ("sharded", "shard")])
def test_a_fifo_in_a_hf_checkpoint_is_refused_not_waited_on(tmp_path, layout, name):
    save_layer(tmp_path, **({"shard_size": SHARDS} if layout == "sharded" else {}))
    name = first_shard(tmp_path) if name == "shard" else name
    fifo = replace_with_fifo(tmp_path / name)
    assert_refused(lambda: load_hf_layer(tmp_path, 1), [fifo], rf"{re.escape(name)} is a FIFO \(named pipe\)")


@pytest.mark.parametrize("name", ["config.json", "shard"])
def test_a_link_inside_the_folder_to_a_fifo_is_refused(tmp_path, name):
    save_layer(tmp_path, shard_size=SHARDS)
    name = first_shard(tmp_path) if name == "shard" else name
    (tmp_path / name).unlink()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / name).symlink_to("pipe")
    assert_refused(lambda: load_hf_layer(tmp_path, 1), [fifo], r"is a FIFO \(named pipe\), not a regular file")


@pytest.mark.parametrize("reader", [read_safetensors_header, open_safetensors])
def test_a_device_or_folder_is_not_read_as_safetensors(tmp_path, reader):
    assert_refused(lambda: reader("/dev/zero"), [], r"/dev/zero is a character device, not a regular file")
    assert_refused(lambda: reader(tmp_path), [], r"is a folder, not a regular file")


def test_a_fifo_as_a_balancer_state_is_refused(tmp_path):
    fifo = tmp_path / "state.npz"
    os.mkfifo(fifo)
    assert_refused(lambda: Balancer.restore(fifo), [fifo], r"the balancer state .*state.npz is a FIFO")


# ---------------------------------------------------------------------------
# JSON at its limits: each a ValueError naming the file
# ---------------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE = b'{"a": ' + b"9" * 5000 + b"}"

JSON_CASES = [
    (DEEP, r"is nested too deeply to be read as JSON"),
    (HUGE, r"an integer of 5000 digits, more than the 100 allowed"),
    (b'{"a": 1, "a": 2}', r"the name 'a' appears twice in one object"),
    (b'{"a": NaN}', r"NaN is not JSON"),
    (b'{"a": -Infinity}', r"-Infinity is not JSON"),
    (b'{"a": 1e999}', r"the number 1e999 overflows a float"),
]


@pytest.mark.parametrize("content,pattern", JSON_CASES)
def test_json_beyond_its_limits_is_refused_naming_the_file(tmp_path, content, pattern):
    file = tmp_path / "x.json"
    file.write_bytes(content)
    with pytest.raises(ValueError, match=rf"{re.escape(str(file))} .*{pattern}"):
        read_json(file)


def test_the_integer_limit_is_what_it_says():
    assert parse_json("9" * MAX_JSON_INTEGER_DIGITS, "x") == int("9" * MAX_JSON_INTEGER_DIGITS)
    assert parse_json("-" + "9" * MAX_JSON_INTEGER_DIGITS, "x") == -int("9" * MAX_JSON_INTEGER_DIGITS)
    with pytest.raises(ValueError, match="101 digits"):
        parse_json("1" + "0" * MAX_JSON_INTEGER_DIGITS, "x")


@pytest.mark.parametrize("content,pattern", JSON_CASES[:3] + [
    (b'{"text_config": {"hidden_size": 64, "hidden_size": 128}}', r"the name 'hidden_size' appears twice"),
])
def test_config_json_beyond_its_limits_is_named(tmp_path, content, pattern):
    save_layer(tmp_path)
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=rf"config.json .*{pattern}"):
        load_hf_layer(tmp_path, 1)


def test_an_index_naming_a_tensor_twice_is_refused(tmp_path):
    save_layer(tmp_path, shard_size=SHARDS)
    index = tmp_path / "model.safetensors.index.json"
    text = index.read_text()
    name, shard = next(iter(json.loads(text)["weight_map"].items()))
    index.write_text(text.replace('"weight_map": {', f'"weight_map": {{"{name}": "elsewhere", ', 1))
    with pytest.raises(ValueError, match=rf"index.json .*the name '{re.escape(name)}' appears twice"):
        load_hf_layer(tmp_path, 1)
    for content, pattern in JSON_CASES[:2]:
        index.write_bytes(content)
        with pytest.raises(ValueError, match=rf"index.json .*{pattern}"):
            load_hf_layer(tmp_path, 1)


@pytest.mark.parametrize("header,pattern", [
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + b"4" * 200 + b"]}}",
     r"its header is refused: an integer of 200 digits"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"its header is nested too deeply"),
])
def test_a_safetensors_header_beyond_json_limits_is_named(tmp_path, header, pattern):
    file = tmp_path / "x.safetensors"
    file.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match=rf"{re.escape(str(file))} is not a safetensors file: {pattern}"):
        read_safetensors_header(file)


# ---------------------------------------------------------------------------
# Training checkpoints: every byte covered, one writer, nothing of anyone else's replaced
# ---------------------------------------------------------------------------

FLAGS = ["--d", "16", "--latent", "8", "--experts", "8", "--top-k", "2", "--intermediate", "8", "--layers", "2",
         "--context", "4", "--embed", "4", "--batch", "64", "--eval-every", "4", "--stats-every", "3", "--quiet",
         "--seed", "3", "--balancer", "qb"]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def tiny(seed: int = 3, steps: int = 3) -> TrainConfig:
    layer = default_layer(hidden_size=16, latent_size=8, num_experts=8, top_k=2, intermediate_size=8,
                          num_moe_layers=2)
    return TrainConfig(moe=layer, context=4, embed=4, batch=64, eval_batch=64, stats_every=3, eval_every=4,
                       seed=seed, steps=steps)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def digest(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def checkpoint_of(tmp_path: Path, steps: int = 3) -> Path:
    folder = tmp_path / "ck"
    main([*FLAGS, "--steps", str(steps), "--checkpoint", str(folder)])
    return folder


def edit_manifest(folder: Path, change: Callable[[dict], None], *, repair_digest: bool) -> Path:
    """Change the current checkpoint's manifest; with `repair_digest` the pointer is made to agree, as an
    attacker who knows the format would."""
    pointer = json.loads((folder / "latest.json").read_text())
    manifest_file = folder / pointer["checkpoint"] / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    change(manifest)
    manifest_file.write_text(json.dumps(manifest, indent=1))
    if repair_digest:
        pointer["manifest"] = digest(manifest_file)
        (folder / "latest.json").write_text(json.dumps(pointer))
    return manifest_file


def test_an_edited_digit_of_the_random_state_is_refused(tmp_path):
    folder = checkpoint_of(tmp_path)

    def edit(manifest):
        manifest["rng"]["state"]["state"] += 1

    manifest_file = edit_manifest(folder, edit, repair_digest=False)
    with pytest.raises(ValueError, match=rf"{re.escape(str(manifest_file))} is not the manifest the checkpoint "
                                         r"wrote .* the checkpoint is damaged"):
        read_checkpoint(folder)
    with pytest.raises(SystemExit) as exc:
        main(["--resume", str(folder), "--steps", "5", "--quiet"])
    assert exc.value.code == 2


@pytest.mark.parametrize("change,pattern", [
    (lambda m: m["rng"].__setitem__("bit_generator", "NoSuchGenerator"), r"random generator's state cannot be "
                                                                          r"restored"),
    (lambda m: m["rng"]["state"].__setitem__("state", "x"), r"random generator's state cannot be restored"),
    (lambda m: m.__setitem__("adam_step", -1), r"adam_step must be a non-negative integer, got -1"),
    (lambda m: m.__setitem__("overflow_steps", "3"), r"overflow_steps must be a non-negative integer, got '3'"),
])
def test_a_manifest_numpy_cannot_take_is_refused_by_name(tmp_path, corpus, change, pattern):
    folder = checkpoint_of(tmp_path)
    manifest_file = edit_manifest(folder, change, repair_digest=True)
    config = dataclasses.replace(read_checkpoint(folder).config, steps=5)
    with pytest.raises(ValueError, match=rf"{re.escape(str(manifest_file))}: .*{pattern}"):
        train(config, corpus=corpus, resume=folder)


def test_a_pointer_of_the_earlier_format_says_what_to_do(tmp_path):
    folder = checkpoint_of(tmp_path)
    pointer = json.loads((folder / "latest.json").read_text())
    pointer["version"] = 1
    del pointer["manifest"]
    (folder / "latest.json").write_text(json.dumps(pointer))
    with pytest.raises(ValueError, match=r"version 1 of the checkpoint format; this code reads version 2 .*resume "
                                         r"it with the release that wrote it"):
        read_checkpoint(folder)


@pytest.mark.parametrize("name", ["latest.json", "manifest.json", "params.npz", "balancer-1.npz"])
def test_a_fifo_in_a_training_checkpoint_is_refused(tmp_path, corpus, name):
    folder = checkpoint_of(tmp_path)
    where = folder if name == "latest.json" else folder / json.loads((folder / "latest.json").read_text())[
        "checkpoint"]
    config = dataclasses.replace(read_checkpoint(folder).config, steps=5)
    fifo = replace_with_fifo(where / name)
    assert_refused(lambda: train(config, corpus=corpus, resume=folder), [fifo],
                   rf"{re.escape(name)} is a FIFO|{re.escape(name)} is not the file the checkpoint wrote")


def test_the_api_will_not_replace_another_runs_checkpoint(tmp_path, corpus):
    folder = checkpoint_of(tmp_path)
    before = snapshot(folder)
    with pytest.raises(ValueError, match=r"already holds a training checkpoint; pass --resume .*overwrite=True"):
        train(tiny(seed=9), corpus=corpus, checkpoint=folder)
    assert snapshot(folder) == before
    # With overwrite=True it is replaced, as asked, and a file of the user's own stays.
    (folder / "notes.txt").write_text("mine")
    train(tiny(seed=9), corpus=corpus, checkpoint=folder, overwrite=True)
    assert read_checkpoint(folder).config.seed == 9
    assert (folder / "notes.txt").read_text() == "mine"


def test_the_api_will_not_write_into_a_folder_of_other_files(tmp_path, corpus):
    (tmp_path / "data.csv").write_text("1,2,3")
    with pytest.raises(ValueError, match=r"holds files that are not a training checkpoint \(data.csv\)"):
        train(tiny(), corpus=corpus, checkpoint=tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv"]


def test_a_second_writer_is_refused_before_it_writes(tmp_path, corpus):
    folder = tmp_path / "ck"
    with checkpoint_lock(folder):
        with pytest.raises(ValueError, match=r"another run is writing checkpoints into .*ck"):
            train(tiny(), corpus=corpus, checkpoint=folder)
        assert list(folder.iterdir()) == []
    train(tiny(), corpus=corpus, checkpoint=folder)  # the lock went with its holder
    assert read_checkpoint(folder).step == 3


def test_a_second_process_is_refused_while_the_first_holds_the_folder(tmp_path):
    folder = tmp_path / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, refimpl.train.checkpoints as T\n"
                               f"with T.checkpoint_lock({str(folder)!r}):\n"
                               "    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        run = subprocess.run([sys.executable, "-m", "refimpl.train", *FLAGS, "--steps", "2", "--checkpoint",
                              str(folder)], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode != 0
        assert "another run is writing checkpoints into" in run.stderr, run.stderr
        assert list(folder.iterdir()) == []
    finally:
        holder.communicate("", timeout=60)


def test_out_inside_the_checkpoint_folder_is_refused(tmp_path, capsys):
    folder = checkpoint_of(tmp_path)
    before = snapshot(folder)
    for out in (folder / "latest.json", folder / "log.json", folder / "sub" / "run.json"):
        with pytest.raises(SystemExit) as exc:
            main(["--resume", str(folder), "--steps", "5", "--quiet", "--out", str(out)])
        assert exc.value.code == 2
        assert "argument --out:" in capsys.readouterr().err
    assert snapshot(folder) == before
    assert read_checkpoint(folder).step == 3


def test_a_fifo_corpus_file_is_not_read(tmp_path):
    (tmp_path / "a.py").write_bytes(b"x = 1\n" * 3000)
    fifo = tmp_path / "b.py"
    os.mkfifo(fifo)
    error = within_deadline(lambda: load_corpus(tmp_path, ["a.py", "b.py"]), [fifo])
    assert error is None
    assert load_corpus(tmp_path, ["a.py", "b.py"]).missing == ("b.py",)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_quantile_balancer_round_trips_through_the_guarded_reader(tmp_path):
    # The positive control for the guards above: a regular file is still read, bit for bit.
    balancer = QuantileBalancer(8, 2)
    balancer.step(np.random.default_rng(0).random((64, 8)).astype(np.float32))
    balancer.save(tmp_path / "b.npz")
    np.testing.assert_array_equal(Balancer.restore(tmp_path / "b.npz").bias, balancer.bias)
