"""Bad inputs a checkpoint or a weight folder can bring, each refused in one line naming the file (and the previous
complete checkpoint where there is one): checksums.json deleted or malformed in a checkpoint written with checksums;
a safetensors shard cut short, with an absurd header length, or a header listing a tensor past the file's end; an
index entry that leaves the model folder. And how checkpoints are published: checksums from the bytes as written
(not read back; on DCP's writing thread for async saves), a step saved again replaces the old folder only once the
new one is in place, and retention never leaves a half-deleted checkpoint that looks complete."""

import json
import os
import shutil
import struct
import threading

import pytest
import torch
from torch import nn

from helpers import write_model_config
from veomni.checkpoint import Checkpointer, CheckpointError, list_checkpoints, resolve_checkpoint
from veomni.checkpoint.integrity import file_crc32
from veomni.models import build_foundation_model

uses_group = pytest.mark.usefixtures("one_process_group")


def _save(out: str, steps=(1, 2), **kwargs) -> Checkpointer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(out, **kwargs)
    for step in steps:
        checkpointer.save(step, model, optimizer, {"trainer": {}, "rng": {}}, {})
    checkpointer.wait()
    return checkpointer


def _load(out: str, path: str):
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 3))
    return Checkpointer(out).load(path, model, torch.optim.AdamW(model.parameters()))


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# ------------------------------------------------------------------------------------------- (1) (2) checksums
@uses_group
@pytest.mark.parametrize("damage", ["deleted", "malformed", "a list", "an entry outside"])
def test_checksums_of_a_checkpoint_written_with_them_are_required(tmp_path, damage):
    out = str(tmp_path / "run")
    _save(out)
    path = resolve_checkpoint("auto", out)
    with open(os.path.join(path, "meta.json")) as f:
        assert json.load(f)["checksums"] == "checksums.json"  # the checkpoint says it has them
    file = os.path.join(path, "checksums.json")
    if damage == "deleted":
        os.remove(file)
    else:
        text = {"malformed": '{"model_optimizer/.metadata": 12', "a list": "[1, 2]"}.get(damage)
        with open(file, "w") as f:
            f.write(text or json.dumps({"../../etc/passwd": 1}))
    with pytest.raises(CheckpointError) as err:
        _load(out, path)
    text = _one_line(err)
    assert f"{file} is {'missing' if damage == 'deleted' else 'malformed'}" in text, text
    assert f"previous complete checkpoint is {os.path.join(out, 'checkpoints', 'global_step_1')}" in text, text


# ------------------------------------------------------------------------------------- (3) (4) (5) safetensors
def _hub(folder: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    write_model_config(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder, max_shard_size="300KB")
    return folder


def _header(path: str):
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _with_header(path: str, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + body)


@pytest.mark.parametrize("damage", ["cut short", "absurd header length", "a tensor past the end"])
def test_a_damaged_shard_is_named(tmp_path, damage):
    folder = _hub(str(tmp_path / "hub"))
    shard = os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[1])
    if damage == "cut short":
        os.truncate(shard, os.path.getsize(shard) - 1000)
    elif damage == "absurd header length":
        with open(shard, "r+b") as f:
            f.write(struct.pack("<Q", 2**62))
    else:
        header, body = _header(shard)
        key = next(k for k in header if k != "__metadata__")
        start, end = header[key]["data_offsets"]
        header[key]["data_offsets"] = [len(body) + 64, len(body) + 64 + end - start]  # wholly after the file's end
        _with_header(shard, header, body)
    with pytest.raises(ValueError) as err:
        build_foundation_model(folder, folder, torch_dtype="float32")
    assert _one_line(err).startswith(f"{shard}: not a readable safetensors file"), str(err.value)


# ------------------------------------------------------------------------------------------------ (6) index
@pytest.mark.parametrize("entry", ["../../etc/passwd", "/etc/passwd"])
def test_an_index_entry_outside_the_model_folder_is_refused(tmp_path, entry):
    folder = _hub(str(tmp_path / "hub"))
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    key = sorted(data["weight_map"])[0]
    data["weight_map"][key] = entry
    with open(index, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError) as err:
        build_foundation_model(folder, folder, torch_dtype="float32")
    assert _one_line(err) == (
        f"{index}: '{key}' is listed in {entry!r}, which is not a file of this folder; refusing to open it"
    )


# ------------------------------------------------------------------------------------------------ publishing
@uses_group
@pytest.mark.parametrize("async_save", [False, True])
def test_checksums_are_computed_as_the_files_are_written(tmp_path, monkeypatch, async_save):
    """No checkpoint file the save wrote itself is read back to checksum it (only the small files other code
    writes into the folder would be); async: the DCP files are checksummed on DCP's thread, not the caller's."""
    import veomni.checkpoint.integrity as integrity

    read_back, threads = [], set()
    monkeypatch.setattr(integrity, "file_crc32", lambda path: read_back.append(path) or file_crc32(path))
    real_write = integrity._ChecksummedStream.write
    monkeypatch.setattr(
        integrity._ChecksummedStream, "write", lambda s, data: threads.add(threading.get_ident()) or real_write(s, data)
    )
    out = str(tmp_path / "run")
    _save(out, steps=(1,), async_save=async_save)
    assert read_back == []
    path = os.path.join(out, "checkpoints", "global_step_1")
    with open(os.path.join(path, "checksums.json")) as f:
        recorded = json.load(f)
    files = sorted(
        os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names
    )  # fmt: skip
    assert sorted(recorded) == [f for f in files if f not in ("checksums.json", "meta.json")]
    assert any(f.endswith(".distcp") for f in recorded) and "model_optimizer/.metadata" in recorded
    assert all(recorded[f] == file_crc32(os.path.join(path, f)) for f in recorded)
    assert (threading.get_ident() in threads) != async_save, threads


@uses_group
def test_saving_a_step_again_keeps_the_old_folder_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    import veomni.checkpoint.checkpointer as checkpointer

    out = str(tmp_path / "run")
    _save(out, steps=(1, 2))
    final = os.path.join(out, "checkpoints", "global_step_2")
    real_replace = checkpointer.os.replace

    def failing(src, dst):
        if src.endswith("global_step_2.tmp"):
            raise OSError(5, "Input/output error", src)
        return real_replace(src, dst)

    monkeypatch.setattr(checkpointer.os, "replace", failing)
    with pytest.raises(CheckpointError, match="saving checkpoint .*global_step_2.tmp failed"):
        _save(out, steps=(2,))
    monkeypatch.setattr(checkpointer.os, "replace", real_replace)
    assert list_checkpoints(os.path.join(out, "checkpoints")) == [1, 2]
    _load(out, final)  # complete and verified


@uses_group
def test_a_crash_while_retiring_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """save_total_limit 1: step 2's save retires step 1; the deletion dies after removing the shards. Every
    checkpoint still listed is complete (loads, checksums verified)."""
    import veomni.checkpoint.checkpointer as checkpointer

    out = str(tmp_path / "run")
    checkpointer_ = _save(out, steps=(1,), save_total_limit=1)
    real_rmtree = shutil.rmtree

    def dying(path, ignore_errors=False):
        if os.path.isdir(os.path.join(path, "model_optimizer")) and "global_step_1" in path:
            real_rmtree(os.path.join(path, "model_optimizer"))
            raise KeyboardInterrupt("killed while deleting")
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpointer.shutil, "rmtree", dying)
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 3))
    with pytest.raises(KeyboardInterrupt):
        checkpointer_.save(2, model, torch.optim.AdamW(model.parameters()), {"trainer": {}, "rng": {}}, {})
    monkeypatch.setattr(checkpointer.shutil, "rmtree", real_rmtree)
    steps = list_checkpoints(os.path.join(out, "checkpoints"))
    assert steps == [2], steps
    for step in steps:
        _load(out, os.path.join(out, "checkpoints", f"global_step_{step}"))


def test_the_checksumming_file_system_is_the_one_dcp_writes_through(tmp_path):
    """Canary: DCP's FileSystemWriter writes every file through its `fs.create_stream` (what integrity.py wraps)."""
    import torch.distributed.checkpoint as dcp

    from veomni.checkpoint.integrity import checksumming_writer

    crcs = {}
    folder = str(tmp_path / "model_optimizer")
    dcp.save({"a": torch.arange(10.0)}, storage_writer=checksumming_writer(folder, str(tmp_path), crcs), no_dist=True)
    written = sorted(os.path.relpath(os.path.join(folder, f), tmp_path) for f in os.listdir(folder))
    assert sorted(crcs) == written and all(crcs[f] == file_crc32(os.path.join(tmp_path, f)) for f in crcs)
