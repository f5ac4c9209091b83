"""Map-style data through its on-disk sample cache: transformed once and mapped by later runs, rebuilt (never
used) when stale or corrupt, shared by ranks that each transform their own share, and for VL samples only lengths
cached (pixels decoded on access). The batches equal those of the in-memory dataset on the same records."""

import json
import os
from functools import partial

import numpy as np
import pytest

from helpers import REPO, child_env, document_starts, token_loader, torchrun, write_token_data
from veomni.data import build_dataset
from veomni.data.data_transform import DataFormatError, process_pretrain_example
from veomni.data.dataset import MappingDataset

MAX_LEN = 48
CALLS = []  # records each counting transform saw (module level: a test's transform keeps one fingerprint)


def read_all_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def counting_transform(example, max_seq_len):
    CALLS.append(example["input_ids"][0])
    return process_pretrain_example(example, tokenizer=None, max_seq_len=max_seq_len)


def _dataset(path, cache, max_seq_len=MAX_LEN, **kw):
    transform = partial(counting_transform, max_seq_len=max_seq_len)
    return build_dataset(train_path=path, datasets_type="mapping", transform=transform, seed=5, cache_dir=cache, **kw)


def _batches(dataset, dyn=True):
    loader = token_loader(dataset, max_seq_len=MAX_LEN, dyn=dyn, micro=3, dlbs=2, dyn_bsz_buffer_size=8)
    loader.set_epoch(0)
    return [[mb["input_ids"].tolist() for mb in step] for step in loader]


@pytest.fixture()
def data(tmp_path):
    return write_token_data(str(tmp_path / "docs.jsonl"), n=150, low=8, high=120), str(tmp_path / "cache")


def test_second_run_maps_the_cache_and_batches_equal_the_in_memory_dataset(data):
    path, cache = data
    CALLS.clear()
    first = _batches(_dataset(path, cache))
    assert len(CALLS) == 150  # every record transformed once
    CALLS.clear()
    again = _dataset(path, cache)
    assert _batches(again) == first and CALLS == []  # the second run only maps the cache
    assert again.cache.token_mode and len(again) == 150
    records = read_all_records(path)  # the same records as a user's map-style dataset (its cache serves this run)
    memory = MappingDataset(records, partial(counting_transform, max_seq_len=MAX_LEN), seed=5, cache_dir=cache)
    for dyn in (True, False):
        assert _batches(_dataset(path, cache), dyn) == _batches(memory, dyn), dyn
    stored = sorted(os.listdir(again.cache.folder))
    assert "part-00000.input_ids.bin" in stored and not any("labels" in f or "attention" in f for f in stored)


def test_a_changed_file_or_transform_builds_a_new_cache(data):
    path, cache = data
    _batches(_dataset(path, cache))
    with open(path, "a") as f:
        f.write(json.dumps({"input_ids": list(range(5000, 5030))}) + "\n")
    CALLS.clear()
    assert len(_dataset(path, cache)) == 151 and len(CALLS) == 151
    CALLS.clear()
    _dataset(path, cache, max_seq_len=32).prepare()  # another transform argument: another cache
    assert len(CALLS) == 151 and len(os.listdir(cache)) == 3


@pytest.mark.parametrize("damage", ["truncate", "no_manifest"])
def test_a_corrupt_or_unfinished_cache_is_rebuilt_never_used(data, damage):
    path, cache = data
    expected = _batches(_dataset(path, cache))
    folder = _dataset(path, cache).prepare().folder
    tokens = os.path.join(folder, "part-00000.input_ids.bin")
    if damage == "truncate":
        os.truncate(tokens, os.path.getsize(tokens) - 8)
    else:  # as a build that crashed before publishing would leave it
        os.remove(os.path.join(folder, "manifest.json"))
    CALLS.clear()
    assert _batches(_dataset(path, cache)) == expected
    assert len(CALLS) == 150  # rebuilt from the records


def test_a_flipped_byte_is_refused_naming_the_file_when_its_chunk_is_first_read(data, monkeypatch):
    """Token files are verified chunk by chunk as they are read (#37: start-up does not read the cache): a byte
    flipped in chunk 2 goes unnoticed by opening the cache and reading chunk 0, and is refused, naming the file and
    the chunk, by the first read of chunk 2; so is every later read of it, by a fresh process (a loader worker)."""
    from veomni.data import cache_writer, sample_cache

    monkeypatch.setattr(cache_writer, "CHUNK_BYTES", 4096)  # 1,024 tokens a chunk: the test data spans several
    monkeypatch.setattr(sample_cache, "CHUNK_BYTES", 4096)
    path, cache = data
    folder = _dataset(path, cache).prepare().folder
    tokens = os.path.join(folder, "part-00000.input_ids.bin")
    assert os.path.getsize(tokens) > 3 * 4096
    with open(tokens, "r+b") as f:  # one token of chunk 2 changed, the size unchanged
        f.seek(2 * 4096 + 100)
        byte = f.read(1)
        f.seek(2 * 4096 + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    CALLS.clear()
    dataset = _dataset(path, cache)
    built = dataset.prepare()  # opening reads no token file: the damage is not seen, nothing is rebuilt
    assert CALLS == [] and len(dataset) == 150
    starts = built._token_starts[0]
    in_chunk = [int(np.searchsorted(starts, c * 1024, side="right")) for c in range(4)]
    for i in range(in_chunk[1] - 1):  # samples wholly inside chunk 0
        built.sample(i)
    with pytest.raises(sample_cache.DataFormatError, match=rf"data cache file {tokens}: chunk 2 .* checksum"):
        built.sample(in_chunk[2])
    with pytest.raises(Exception, match="part-00000.input_ids.bin: chunk 2"):
        _batches(_dataset(path, cache))  # the loader reads every chunk: refused there too
    assert CALLS == []


def test_a_killed_build_leaves_nothing_after_the_next_run(tmp_path):
    """A build killed midway (SIGKILL: no cleanup ran) leaves its `.building-*` folder; the next open removes it
    (no live process holds its lock), and also a `.stale-*` folder of an interrupted replace."""
    import signal
    import subprocess
    import sys
    import time

    path = write_token_data(str(tmp_path / "docs.jsonl"), n=300, low=8, high=120)
    cache = tmp_path / "cache"
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_BUILD, path, str(cache)], cwd=REPO, env=child_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (cache.exists() and any(".building-" in p.name for p in cache.iterdir())):
        assert child.poll() is None and time.monotonic() < deadline, child.stdout.read()
        time.sleep(0.1)
    time.sleep(1.0)  # well inside the build (the transform sleeps on every record)
    child.send_signal(signal.SIGKILL)
    child.wait()
    (cache / "docs.jsonl-0123abcd.stale-89abcdef").mkdir()  # an earlier replace that was interrupted
    assert any(".building-" in p.name for p in cache.iterdir())
    folder = _dataset(path, str(cache)).prepare().folder
    assert os.listdir(cache) == [os.path.basename(folder)]


_SLOW_BUILD = """
import sys, time
from veomni.data import build_dataset
from veomni.data.data_transform import process_pretrain_example

def slow(example):
    time.sleep(0.05)
    return process_pretrain_example(example, tokenizer=None, max_seq_len=48)

build_dataset(train_path=sys.argv[1], datasets_type="mapping", transform=slow, cache_dir=sys.argv[2]).prepare()
"""


def test_a_same_size_same_mtime_edit_builds_a_new_cache(data):
    """`cp -p` or `rsync -a` of an edited file keeps its size and mtime: the key's content hash still changes."""
    path, cache = data
    before = _dataset(path, cache).prepare().folder
    stat = os.stat(path)
    with open(path, "r+b") as f:  # one digit of a token changed: the same size
        f.seek(20)
        digit = f.read(1)
        f.seek(20)
        f.write(b"7" if digit != b"7" else b"8")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (os.path.getsize(path), os.stat(path).st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    CALLS.clear()
    after = _dataset(path, cache).prepare().folder
    assert after != before and len(CALLS) == 150


def test_a_later_run_reads_the_batch_plan_kept_beside_the_cache(data, monkeypatch):
    """The epoch's global batch plan (per-sample Python work with dyn_bsz) is kept in the cache folder: a second run
    with the same data and batching reads it instead of planning again, and gets the same batches."""
    from veomni.data import global_batches

    path, cache = data
    first = _batches(_dataset(path, cache))
    folder = _dataset(path, cache).prepare().folder
    assert len(os.listdir(os.path.join(folder, "plans"))) == 1

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(global_batches, "plan_micro_batches", no_planning)
    assert _batches(_dataset(path, cache)) == first
    with pytest.raises(AssertionError, match="planned again"):  # other batching: another plan
        _batches(_dataset(path, cache), dyn=False)


def test_two_ranks_transform_each_record_once_in_total(tmp_path):
    path = write_token_data(str(tmp_path / "docs.jsonl"), n=301, low=8, high=120)
    script = os.path.join(REPO, "tests", "dist", "check_sample_cache.py")
    torchrun(script, [path, str(tmp_path / "cache"), str(tmp_path)], 2, timeout=300)
    seen = [json.load(open(tmp_path / f"calls_{rank}.json")) for rank in range(2)]
    assert seen[0] and seen[1], "both ranks take a share"
    assert sorted(seen[0] + seen[1]) == sorted(json.loads(line)["input_ids"][0] for line in open(path))
    plans = [json.load(open(tmp_path / f"batches_{rank}.json")) for rank in range(2)]
    one = _batches(_dataset(path, str(tmp_path / "cache")), dyn=True)  # one process maps the 2-rank cache
    assert [a + b for a, b in zip(*plans)] == one  # each rank holds its half of every global step


def _tiny_vl_transform(example, processor, template):
    from veomni.data.multimodal import process_sample_qwen2_5_vl

    CALLS.append(1)
    return process_sample_qwen2_5_vl(example, processor=processor, chat_template=template, position_id_func=_rope)


def _rope(input_ids, **kwargs):  # stands in for the M-RoPE function: three rows of 0..L-1
    return np.tile(np.arange(len(input_ids)), (3, 1))


def test_vl_samples_cache_lengths_only_and_decode_images_on_access(tmp_path, mm_assets, mm_processors):
    from veomni.data import build_multimodal_chat_template

    processor = mm_processors["qwen2_5_vl"]
    images = mm_assets["images"]
    with open(tmp_path / "vl.jsonl", "w") as f:
        for name in ("astronaut", "camera", "coffee", "moon"):
            content = [{"type": "image", "image": images[name]["path"]}, {"type": "text", "text": "What is it?"}]
            f.write(json.dumps({"messages": [{"role": "user", "content": content},
                                             {"role": "assistant", "content": images[name]["caption"]}]}) + "\n")  # fmt: skip
    template = build_multimodal_chat_template("qwen2_5_vl", processor.tokenizer)
    transform = partial(_tiny_vl_transform, processor=processor, template=template)
    CALLS.clear()
    dataset = build_dataset(
        train_path=str(tmp_path / "vl.jsonl"), datasets_type="mapping", transform=transform,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert len(dataset) == 4 and len(CALLS) == 4 and not dataset.cache.token_mode
    assert sorted(os.listdir(dataset.cache.folder)) == [
        "manifest.json", "part-00000.json", "part-00000.lengths.npy", "part-00000.records.npy"
    ]  # fmt: skip
    CALLS.clear()
    sample = dataset[2]  # read back from the file and transformed now
    assert len(CALLS) == 1 and sample[0]["pixel_values"].ndim == 2
    assert len(sample[0]["input_ids"]) == int(dataset.cache.lengths[2])


def test_start_of_each_document_survives_the_round_trip(data):
    """Long documents split into pieces: the pieces of one record stay together, in order."""
    path, cache = data
    dataset = _dataset(path, cache, max_seq_len=16)
    n = len(dataset)
    pieces = [dataset[r] for r in range(n)]
    records = read_all_records(path)
    for record, samples in zip(records, pieces):
        joined = [t for s in samples for t in s["input_ids"].tolist()]
        assert joined[: len(record["input_ids"])] == record["input_ids"][: len(joined)]
    assert document_starts  # (the helper is the loader tests' own)


def _weighted(example):  # a float field: the cache keeps lengths only, the transform runs again on access
    ids = example["input_ids"]
    return [{"input_ids": ids, "labels": ids, "loss_weights": [0.5] * len(ids)}]


def test_float_fields_are_not_rounded_into_the_token_files(data):
    path, cache = data
    dataset = build_dataset(train_path=path, datasets_type="mapping", transform=_weighted, cache_dir=cache)
    assert not dataset.prepare().token_mode
    assert dataset[3][0]["loss_weights"][:3] == [0.5, 0.5, 0.5]


def test_a_sample_outside_the_cache_is_an_index_error(data):
    path, cache = data
    built = _dataset(path, cache).prepare()
    built.sample(built.num_samples - 1)
    for bad in (built.num_samples, -1):
        with pytest.raises(IndexError, match=f"sample {bad} of a data cache of {built.num_samples}"):
            built.sample(bad)


def test_skipping_bad_records_stays_linear(tmp_path, monkeypatch):
    """A skipped record's location (its line, counted from the file's start) is made text only when shown."""
    import veomni.data.readers as readers

    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(2000):
            f.write(json.dumps({"oops": i} if i % 10 == 3 else {"input_ids": [i % 500 + 3] * 20}) + "\n")
    counted = []
    line_at = readers._line_at
    monkeypatch.setattr(readers, "_line_at", lambda *a: counted.append(a) or line_at(*a))
    transform = partial(process_pretrain_example, tokenizer=None, max_seq_len=32)
    dataset = build_dataset(
        train_path=str(tmp_path / "docs.jsonl"), datasets_type="mapping", transform=transform,
        skip_bad_samples=True, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    built = dataset.prepare()
    assert built.num_samples == 1800 and built.manifest["skipped"] == 200
    assert len(counted) <= 5  # the five that are logged, not one per skipped record


def test_a_finished_cache_of_another_job_is_kept_not_replaced(data):
    """Two jobs built the same cache at once: the later to publish keeps the earlier's (which may be in use)."""
    import shutil

    from veomni.data import sample_cache

    path, cache = data
    folder = _dataset(path, cache).prepare().folder
    inode = os.stat(os.path.join(folder, "part-00000.input_ids.bin")).st_ino
    late = folder + ".building-late"  # the other job's finished build, about to be published
    shutil.copytree(folder, late)
    assert sample_cache._publish(late, folder, 1) is None
    assert not os.path.exists(late) and os.stat(os.path.join(folder, "part-00000.input_ids.bin")).st_ino == inode
    shutil.copytree(folder, late)
    os.remove(os.path.join(folder, "part-00000.lengths.npy"))  # a stale cache is replaced
    assert sample_cache._publish(late, folder, 1) is None
    assert sample_cache.SampleCache(folder).num_records == 150 and os.listdir(cache) == [os.path.basename(folder)]


def test_build_processes_write_the_same_cache_as_one(data, tmp_path, monkeypatch):
    """A rank's share is built by one forked process per core (here 3): each its own part, records in file order,
    the same samples and batches as one process; a bad record in a later process's share fails the build naming its
    line, and no half-built folder is left."""
    path, cache = data
    one = _batches(_dataset(path, cache))
    monkeypatch.setenv("VEOMNI_DATA_BUILD_PROCESSES", "3")
    three = _dataset(path, str(tmp_path / "cache3"))
    assert _batches(three) == one and len(three) == 150
    assert [p["part"] for p in three.cache.manifest["parts"]] == ["00000", "00000-001", "00000-002"]
    assert sorted(f for f in os.listdir(three.cache.folder) if f.endswith(".bin")) == [
        "part-00000-001.input_ids.bin", "part-00000-002.input_ids.bin", "part-00000.input_ids.bin"
    ]  # fmt: skip
    with open(path, "a") as f:
        f.write("{not json, in the last share\n")
    with pytest.raises(DataFormatError, match=rf"{path}:151: malformed JSON"):
        _dataset(path, str(tmp_path / "bad")).prepare()
    assert os.listdir(tmp_path / "bad") == []


def test_a_rank_failing_its_share_fails_every_rank_at_once(tmp_path):
    path = write_token_data(str(tmp_path / "docs.jsonl"), n=301, low=8, high=120)
    with open(path, "a") as f:
        f.write(json.dumps({"text": "no input_ids: rank 1's share"}) + "\n")
    script = os.path.join(REPO, "tests", "dist", "check_sample_cache.py")
    torchrun(script, [path, str(tmp_path / "cache"), str(tmp_path), "expect-failure"], 2, timeout=120)
    errors = [open(tmp_path / f"error_{rank}.txt").read() for rank in range(2)]
    assert "KeyError" in errors[1] and "rank 1 failed building its share of the data cache" in errors[0], errors
    assert not os.listdir(tmp_path / "cache")  # nothing half-built left


def test_fingerprint_follows_helpers_base_classes_and_tensor_values(tmp_path, monkeypatch):
    import importlib
    import sys

    import torch

    from veomni.data.fingerprint import fingerprint

    source = (
        "def helper(ids):\n    return ids[:4]\n\n"
        "class Base:\n    def encode(self, ids):\n        return {'input_ids': ids}\n\n"
        "class Sub(Base):\n    pass\n\n"
        "def transform(example, template):\n    return [template.encode(helper(example['ids']))]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def fingerprint_of(text):
        (tmp_path / "user_transform.py").write_text(text)
        sys.modules.pop("user_transform", None)
        importlib.invalidate_caches()
        module = importlib.import_module("user_transform")
        return fingerprint(partial(module.transform, template=module.Sub()))

    original = fingerprint_of(source)
    assert fingerprint_of(source) == original
    assert fingerprint_of(source.replace("ids[:4]", "ids[:5]")) != original  # a helper the transform calls
    assert fingerprint_of(source.replace("{'input_ids': ids}", "{'input_ids': ids[1:]}")) != original  # a base
    table = torch.arange(100)
    assert fingerprint(partial(_weighted, table=table)) != fingerprint(partial(_weighted, table=table.flip(0)))
    assert fingerprint(torch.ones(3, dtype=torch.bfloat16)) != fingerprint(torch.zeros(3, dtype=torch.bfloat16))
