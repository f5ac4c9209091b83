"""Datasets and the loader: exactly-once sharding (2 ranks x 2 workers), exact resume, interleaving,
dynamic batching, bad data."""

import gc
import json
import os
import time
from functools import partial

import pytest
import torch
import yaml

from helpers import document_starts, token_dataset, token_loader
from veomni.data import build_dataset
from veomni.data.data_loader import MicroBatchLoader
from veomni.data.data_report import data_report
from veomni.data.data_transform import DataFormatError, process_pretrain_example

MAX_LEN = 64


def _write(path, ids_list):
    with open(path, "w") as f:
        for ids in ids_list:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def _records(start, n, seed=0):
    """Record r is [1000 + r, ...] so every packed document tells which record it came from."""
    g = torch.Generator().manual_seed(seed + start)
    return [
        [1000 + r] + torch.randint(3, 500, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
        for r in range(start, start + n)
    ]


@pytest.fixture()
def files(tmp_path):
    """257 records over 3 jsonl files (odd sizes, so shards are uneven)."""
    sizes, start, paths = [100, 90, 67], 0, []
    for i, n in enumerate(sizes):
        paths.append(_write(str(tmp_path / f"part{i}.jsonl"), _records(start, n)))
        start += n
    return str(tmp_path), 257


# the loader tests' defaults: dyn_bsz from a small buffer; iterable data shuffled through a small buffer
_loader = partial(token_loader, max_seq_len=MAX_LEN, dyn=True, dyn_bsz_buffer_size=8)
_dataset = partial(token_dataset, max_seq_len=MAX_LEN, shuffle_buffer_size=16)


def _record_ids(micro_batch):
    return [t - 1000 for t in document_starts(micro_batch) if t >= 1000]


def _all_ids(loader, epoch=0):
    loader.set_epoch(epoch)
    return [r for step in loader for mb in step for r in _record_ids(mb)]


@pytest.mark.parametrize("kind", ["iterable", "mapping"])
def test_every_record_exactly_once_on_2_ranks_x_2_workers(files, kind):
    folder, n = files
    seen, dropped, unread = [], [], []
    for rank in range(2):
        loader = _loader(_dataset(folder, kind), rank=rank, dp=2, workers=2)
        seen += _all_ids(loader)
        report = data_report(loader)
        dropped.append(report["dropped"])
        unread.append(report.get("unread", 0))
    assert len(seen) == len(set(seen))
    assert seen != sorted(seen)  # shuffled
    if kind == "iterable":  # streamed slots end with the first that runs dry: what the others hold is counted
        assert len(seen) + sum(dropped) + sum(unread) == n and len(seen) > n // 2
    else:  # the epoch's tail that fits no full global step is dropped and reported, the same on every rank
        assert dropped[0] == dropped[1] and len(seen) + dropped[0] == n and 0 < dropped[0] < 2 * 2 * 2


def test_epochs_reshuffle(files):
    folder, _ = files
    loader = _loader(_dataset(folder, "mapping"))
    first, second = _all_ids(loader, 0), _all_ids(loader, 1)
    assert sorted(first) == sorted(second) and first != second


def _flatten(batches):
    return [mb for step in batches for mb in step]


@pytest.mark.parametrize("kind,workers", [("iterable", 0), ("iterable", 2), ("mapping", 2)])
def test_resume_gives_identical_next_batches(files, kind, workers):
    folder, _ = files
    loader = _loader(_dataset(folder, kind), workers=workers)
    loader.set_epoch(0)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(6)]

    resumed = _loader(_dataset(folder, kind), workers=workers)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    it = iter(resumed)
    got = [next(it) for _ in range(6)]
    for a, b in zip(_flatten(expected), _flatten(got)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


@pytest.mark.parametrize("kind", ["iterable", "mapping"])
def test_state_taken_right_after_a_resume_is_the_loaded_position(files, kind):
    """A checkpoint saved after load_state_dict but before the first batch (the streams answered with their previous,
    empty position until iteration began, so that checkpoint restarted the epoch)."""
    folder, _ = files
    dataset = _dataset(folder, kind)
    for workers in (0, 2):
        loader = _loader(dataset, workers=workers)
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
        rest = [r for step in it for mb in step for r in _record_ids(mb)]
        resumed = _loader(dataset, workers=workers)
        resumed.load_state_dict(state)
        again = _loader(dataset, workers=workers)
        again.load_state_dict(resumed.state_dict())
        assert [r for step in again for mb in step for r in _record_ids(mb)] == rest, workers


def _stopped_within(workers, seconds=1.0):
    """True once every worker process has exited (checked for up to `seconds`)."""
    deadline = time.monotonic() + seconds
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(w.is_alive() for w in workers)


def _stopped_cleanly(workers, seconds=30.0):
    """Every worker exited by itself (exit code 0): told to stop, not terminated by torch after its 5 s join timeout
    (exit code -SIGTERM). The wait is generous: a loaded box is slow, a worker left running waits it out and fails."""
    return _stopped_within(workers, seconds) and all(w.exitcode == 0 for w in workers)


def test_abandoned_iterator_workers_stop_at_once(files):
    """An epoch iterator left mid-way (max_steps, a resume, the end of training) is still referenced, as a trainer's
    loop variable is: its 2 workers exit as fast as a normal shutdown does, on load_state_dict, on close(), and when
    the loader is collected in a reference cycle (torch alone left them until the iterator was collected, then waited
    5 s per worker). A closed loader still gives the position reached. A second iter() leaves the first iterator
    working: a DataLoader may be iterated twice at once (stopping it there cut its epoch short, silently).

    Stopped means exited by itself, which torch's own shutdown does at once: a worker terminated by torch after its
    5 s join timeout, or one left running, fails (no timing bound: a loaded box made any bound flaky)."""
    folder, _ = files
    loader = _loader(_dataset(folder, "mapping"), workers=2)

    def abandon_mid_epoch(loader):
        it = iter(loader)
        next(it), next(it)
        assert all(w.is_alive() for w in it._workers)
        return it

    whole_epoch = len(list(iter(loader)))
    old = abandon_mid_epoch(loader)
    new = iter(loader)
    assert all(w.is_alive() for w in new._workers)
    assert 2 + len(list(old)) == whole_epoch  # the first iterator still gives the rest of its epoch
    del old
    state = loader.state_dict()
    loader.load_state_dict(state)
    assert _stopped_cleanly(new._workers), "load_state_dict left the abandoned iterator's workers running"

    it = abandon_mid_epoch(loader)  # resumes the loaded position; a trainer that stops here calls close()
    position = loader.state_dict()
    loader.close()
    assert _stopped_cleanly(it._workers), "close() left the workers running"
    assert loader.state_dict() == position  # what the final checkpoint saves after close()

    loader.cycle = loader  # a loader reachable only through a cycle is freed by the garbage collector
    it = abandon_mid_epoch(loader)
    workers = it._workers
    del it, loader
    gc.collect()
    assert _stopped_cleanly(workers), "collecting the loader did not stop them"


def test_loader_still_iterated_or_closed_keeps_its_data(files):
    """Stopping workers never costs data: a loader held only by the `for` loop over it (its finalizer used to stop the
    iterator in use: 0 batches), and iter() after close() with persistent workers (their queues were closed) or
    after a state_dict() taken before the first iter() (that closed iterator came back empty, the position lost)."""
    folder, _ = files
    dataset = _dataset(folder, "mapping")
    every = [r for step in _loader(dataset, workers=2) for mb in step for r in _record_ids(mb)]
    assert sorted(every) == list(range(257))

    loader = _loader(dataset, workers=2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    rest = [r for step in it for mb in step for r in _record_ids(mb)]
    resumed = _loader(dataset, workers=2)
    resumed.load_state_dict(state)
    resumed.state_dict()  # e.g. a report before training starts
    resumed.close()
    assert [r for step in resumed for mb in step for r in _record_ids(mb)] == rest

    persistent = MicroBatchLoader(
        loader.stream,
        batch_size=loader.batch_size,
        collate_fn=loader.collate_fn,
        num_workers=2,
        persistent_workers=True,
    )
    next(iter(persistent))
    persistent.close()
    assert sorted(r for step in persistent for mb in step for r in _record_ids(mb)) == list(range(257))


def test_a_worker_never_collects_the_garbage_it_inherited(files):
    """A loader worker is a fork of the training process: the parent's garbage -- here a gloo group still in a
    reference cycle -- must not be finalized in it, where the group's threads do not exist (its destructor hung
    there, or aborted: a worker killed by SIGABRT in CI). The collate function runs the worker's collector."""
    import threading

    import torch.distributed as dist

    from veomni.data.data_collator import MainCollator

    collator = MainCollator(max_seq_len=MAX_LEN)

    def collate(samples):
        gc.collect()
        return collator(samples)

    class Cycle:
        pass

    gc.disable()  # the garbage must outlive the fork
    try:
        garbage = Cycle()
        garbage.me, garbage.group = garbage, dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        del garbage
        it = iter(_loader(_dataset(files[0], "mapping"), workers=1, collate_fn=collate))
    finally:
        gc.enable()
    watchdog = threading.Timer(60, lambda: [w.kill() for w in it._workers])  # a hung worker fails the test
    watchdog.start()
    try:
        assert sorted(r for step in it for mb in step for r in _record_ids(mb)) == list(range(257))
    finally:
        watchdog.cancel()
    gc.collect()  # the group's own process finalizes it


def test_dynamic_batching_fills_token_budget(files):
    folder, _ = files
    budget = 2 * MAX_LEN
    for kind in ("mapping", "iterable"):  # the global-batch and the streaming planner
        micro = _flatten(list(_loader(_dataset(folder, kind), dyn_bsz_buffer_size=64)))
        sizes = [mb["input_ids"].numel() for mb in micro]
        assert max(sizes) <= budget, kind
        assert sum(sizes[:-3]) / (budget * len(sizes[:-3])) > 0.97, kind  # all but the tail are nearly full


def test_fixed_micro_batch_size_without_dyn_bsz(files):
    folder, _ = files
    steps = list(_loader(_dataset(folder, "mapping"), dyn=False, micro=3, dlbs=2, drop_last=True))
    assert all(len(step) == 2 for step in steps)
    assert all(len(_record_ids(mb)) == 3 for step in steps for mb in step)


@pytest.mark.parametrize("kind", ["mapping", "iterable"])
def test_bsz_warmup_grows_the_budget(files, kind):
    folder, _ = files
    loader = _loader(_dataset(folder, kind), train_steps=20, bsz_warmup_ratio=0.5, bsz_warmup_init_mbtoken=40)
    micro = _flatten(list(loader))
    first = micro[0]["input_ids"].numel()
    assert first <= 60  # one document, or documents within the small initial budget
    assert max(mb["input_ids"].numel() for mb in micro[-10:]) > 100


def test_interleave_by_weight_sees_all_records(tmp_path):
    a = _write(str(tmp_path / "a.jsonl"), _records(0, 120))
    b = _write(str(tmp_path / "b.jsonl"), _records(500, 40))
    spec = tmp_path / "mix.yaml"
    spec.write_text(yaml.safe_dump({"sources": [{"path": os.path.basename(a), "weight": 3}, {"path": b, "weight": 1}]}))
    for kind in ("mapping", "iterable"):
        ds = _dataset(str(spec), kind)
        seen = _all_ids(_loader(ds, micro=1, dyn=False, dlbs=1))
        assert sorted(seen) == list(range(120)) + list(range(500, 540)), kind
        head = seen[:80]
        ratio = sum(r < 500 for r in head) / sum(r >= 500 for r in head)
        assert 2 < ratio < 4.5, (kind, ratio)  # about 3:1 while both last


def test_interleave_spec_errors(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump({"sources": [{"path": "x.jsonl", "wieght": 2}]}))
    with pytest.raises(ValueError, match=r"sources\[0\] has unknown keys \['wieght'\]"):
        _dataset(str(spec), "mapping")


def test_bad_data_is_named_or_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"text": "good one"}),
        "{not json",
        json.dumps({"body": "no text key"}),
        json.dumps({"text": "ok"}),
    ]
    path.write_text("\n".join(lines) + "\n")

    class Tok:
        eos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    transform = partial(process_pretrain_example, tokenizer=Tok(), max_seq_len=MAX_LEN)
    with pytest.raises(DataFormatError, match=rf"{path}:2: malformed JSON"):  # when its cache is built
        list(_loader(build_dataset(train_path=str(path), datasets_type="mapping", transform=transform)))
    ds = build_dataset(train_path=str(path), datasets_type="iterable", transform=transform)
    with pytest.raises(DataFormatError, match=rf"{path}:2: malformed JSON"):
        list(_loader(ds))
    lines[1] = json.dumps({"text": "fine"})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=rf"{path}:3: no text key \['text'\]"):
        list(_loader(build_dataset(train_path=str(path), datasets_type="mapping", transform=transform)))

    lines[1] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    for kind in ("mapping", "iterable"):
        ds = build_dataset(train_path=str(path), datasets_type=kind, transform=transform, skip_bad_samples=True)
        loader = _loader(ds, micro=1, dyn=False, dlbs=1)
        loader.set_epoch(0)
        batches = list(loader)
        assert len(batches) == 2, kind
        assert data_report(loader, count_unread=False)["skipped"] == 2, kind


def test_registry_custom_dataset(tmp_path):
    from veomni.data import DATASET_REGISTRY

    @DATASET_REGISTRY.register("custom_test")
    def build_custom_dataset(train_path, transform=None, namespace="train", seed=42, source_name=None, **kwargs):
        return [transform({"input_ids": [5, 6, 7, i + 1000]}) for i in range(10)]

    ds = build_dataset(
        dataset_name="custom_test",
        transform=partial(process_pretrain_example, tokenizer=None, max_seq_len=MAX_LEN),
        train_path="unused",
    )
    micro = _flatten(list(_loader(ds, micro=1, dyn=False, dlbs=1)))
    assert len(micro) == 10


def test_exactly_once_on_two_real_ranks(files):
    from helpers import REPO, torchrun

    folder, n = files
    proc = torchrun(os.path.join(REPO, "tests", "dist", "check_exactly_once.py"), [folder, str(n)], 2)
    assert proc.stdout.count("EXACTLY_ONCE_OK") == 2


def test_veomni_dataset_yaml_schema_and_seed_class_names(tmp_path):
    from veomni.data import InterleavedIterableDataset, InterleavedMappingDataset, IterativeDataset

    a = _write(str(tmp_path / "a.jsonl"), _records(0, 120))
    b = _write(str(tmp_path / "b.jsonl"), _records(500, 40))
    ours, theirs = tmp_path / "ours.yaml", tmp_path / "veomni.yaml"
    ours.write_text(yaml.safe_dump({"sources": [{"path": "a.jsonl", "weight": 3}, {"path": b, "weight": 1}]}))
    theirs.write_text(
        "sources:\n  - a.jsonl\n  - " + b + "\nnames:\n  - web\n  - code\n"
        "schedule:\n  - { schedule_type: const, weights: [3, 1] }\nstopping_strategy: all_exhausted\n"
    )
    for kind, cls in (("mapping", InterleavedMappingDataset), ("iterable", InterleavedIterableDataset)):
        dataset = _dataset(str(theirs), kind)
        assert type(dataset) is cls and dataset.names == ["web", "code"] and dataset.weights == [3.0, 1.0]
        assert _all_ids(_loader(dataset, micro=1, dyn=False, dlbs=1)) == _all_ids(
            _loader(_dataset(str(ours), kind), micro=1, dyn=False, dlbs=1)
        )
    assert isinstance(_dataset(a, "iterable"), IterativeDataset)
    theirs.write_text("sources: [a.jsonl]\nschedule:\n  - {schedule_type: linear, weights: [1]}\n")
    with pytest.raises(ValueError, match="only one `schedule_type: const` entry is supported"):
        _dataset(str(theirs), "mapping")


def test_steps_per_epoch_follow_the_seed_formula_without_dyn_bsz(files):
    """One sample per record: floor(records / global batch), the seed's `len / dp / (micro * dataloader_bs)`."""
    folder, n = files
    for dp in (1, 2):
        loader = _loader(_dataset(folder, "mapping"), rank=0, dp=dp, dyn=False, micro=2, dlbs=4 // dp, drop_last=True)
        assert loader.num_batches() == n // 8 == len(list(loader))


class _CountingRecords(torch.utils.data.Dataset):
    """A user's map-style dataset that counts its reads."""

    def __init__(self, n):
        self.n, self.reads = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads.append(i)
        return {"input_ids": [5, 6, 7, i % 50 + 100] * (i % 3 + 1)}


def test_a_users_map_style_dataset_goes_through_the_mapped_sample_cache(monkeypatch):
    """#37: a registered builder's map-style dataset is not held in RAM as a per-rank index: each record is read
    once, to build the memory-mapped sample cache (token mode), and every batch of every epoch comes from the cache
    (no read of the user's dataset), equal to the records; the run's own cache is removed at exit."""
    from veomni.data import DATASET_REGISTRY, sample_cache

    records = _CountingRecords(40)
    DATASET_REGISTRY.register("counting_test")(lambda train_path, transform=None, **kwargs: records)
    exits = []
    monkeypatch.setattr(sample_cache.atexit, "register", lambda *a: exits.append(a))
    ds = build_dataset(dataset_name="counting_test", train_path="unused")
    loader = _loader(ds, micro=1, dyn=False, dlbs=1)
    cache = loader.stream.dataset.prepare()
    assert cache.token_mode and sorted(records.reads) == list(range(40))  # each record read once, to build it
    records.reads.clear()
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        got = sorted(tuple(mb["input_ids"][0].tolist()) for mb in _flatten(list(loader)))
        assert got == sorted(tuple(_CountingRecords(40)[i]["input_ids"]) for i in range(40)), epoch
        assert records.reads == [], epoch  # every sample read from the mapped token files
    assert any(cache.folder in a for a in exits)  # removed at exit (it serves this run only)
