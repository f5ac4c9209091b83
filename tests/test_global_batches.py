"""Global batches independent of the world size: the samples of each global step are the same on 1, 2 and 4
ranks (and any number of loader workers for mapping data; streamed data depends on the workers per rank, not on
the ranks), with documents longer than max_seq_len; a resume on another world size continues the same sequence. (2 real ranks vs 1 process on such data: tests/test_parity_data_parallel.py, whose
documents are longer than max_seq_len.)"""

import json
import random

import pytest

from helpers import document_starts, token_dataset, token_loader
from veomni.data.data_loader import reshard_loader_state

MAX_LEN = 32
GLOBAL = 8  # samples per global step (without dyn_bsz)


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory):
    """Pre-tokenised documents of 5..120 tokens (many longer than MAX_LEN, so they split into several samples);
    token t of document d is d * 1000 + t, so a sample names its document and piece by its first token."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("long") / "docs.jsonl"
    with open(path, "w") as f:
        for d in range(1, 161):
            f.write(json.dumps({"input_ids": [d * 1000 + t for t in range(rng.randint(5, 120))]}) + "\n")
    return str(path)


def _loader(path, rank, dp, dyn, workers=0, micro=2, kind="mapping"):
    stream = {"shuffle_buffer_size": 8, "unit_bytes": 1024} if kind == "iterable" else {}
    dataset = token_dataset(path, kind, max_seq_len=MAX_LEN, seed=5, **stream)
    loader = token_loader(
        dataset, rank, dp, workers, max_seq_len=MAX_LEN, dyn=dyn, micro=micro, dlbs=GLOBAL // (micro * dp),
        dyn_bsz_buffer_size=16, seed=5,
    )  # fmt: skip
    loader.set_epoch(0)
    return loader


def _samples(micro_batch):
    """The first tokens (document * 1000 + offset) of the samples packed in a micro-batch."""
    return tuple(document_starts(micro_batch))


def _global_steps(loaders, start=0, count=None):
    """Per global step: the micro-batches of all ranks in rank order."""
    per_rank = [[[_samples(mb) for mb in step] for step in loader] for loader in loaders]
    steps = [sum((rank[s] for rank in per_rank), []) for s in range(min(len(r) for r in per_rank))]
    return steps[start:] if count is None else steps[start : start + count]


@pytest.mark.parametrize("dyn", [False, True])
def test_global_steps_identical_on_1_2_4_ranks_and_with_workers(long_docs, dyn):
    one = _global_steps([_loader(long_docs, 0, 1, dyn)])
    assert len(one) >= 8
    assert any(s % 1000 for step in one for mb in step for s in mb)  # long documents did split into pieces
    for dp in (2, 4):
        assert _global_steps([_loader(long_docs, r, dp, dyn) for r in range(dp)]) == one, f"{dp} ranks"
    assert _global_steps([_loader(long_docs, r, 2, dyn, workers=2) for r in range(2)]) == one, "2 ranks x 2 workers"
    if not dyn:  # another micro-batch split of the same global batch: same samples per step
        regrouped = _global_steps([_loader(long_docs, 0, 1, dyn, micro=4)])
        full = [sorted(sum(s, ())) for s in one if len(sum(s, ())) == GLOBAL]  # the tail may split differently
        assert [sorted(sum(s, ())) for s in regrouped][: len(full)] == full
    loader = _loader(long_docs, 0, 1, dyn)
    assert loader.num_batches() == len(one)


@pytest.mark.parametrize("dyn", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_global_steps_identical_on_1_2_4_ranks(long_docs, dyn, workers):
    """Streamed files: each of the step's micro-batch slots is its own stream, read by the rank that owns it."""
    one = _global_steps([_loader(long_docs, 0, 1, dyn, workers, kind="iterable")])
    assert len(one) >= 8 and any(s % 1000 for step in one for mb in step for s in mb)
    for dp in (2, 4):
        steps = _global_steps([_loader(long_docs, r, dp, dyn, workers, kind="iterable") for r in range(dp)])
        assert steps == one, f"{dp} ranks"
    seen = sorted(s for step in one for mb in step for s in mb)
    assert len(seen) == len(set(seen))  # no sample twice


@pytest.mark.parametrize("dyn", [False, True])
@pytest.mark.parametrize("kind", ["mapping", "iterable"])
def test_resume_on_another_world_size_continues_the_sequence(long_docs, dyn, kind):
    one = _global_steps([_loader(long_docs, 0, 1, dyn, kind=kind)])
    saved = []
    for r in range(2):  # 2 ranks train 3 steps and save
        loader = _loader(long_docs, r, 2, dyn, kind=kind)
        it = iter(loader)
        for _ in range(3):
            next(it)
        saved.append(loader.state_dict())
    resumed = []
    for r in range(4):  # 4 ranks resume from the 2-rank states
        loader = _loader(long_docs, r, 4, dyn, kind=kind)
        loader.load_state_dict(reshard_loader_state(saved, r, 4))
        resumed.append(loader)
    assert _global_steps(resumed) == one[3:]


def test_streamed_resume_before_every_worker_has_yielded(long_docs):
    """Saved after one step with 2 loader workers (the second has not yielded yet), resumed on 4 ranks."""
    one = _global_steps([_loader(long_docs, 0, 1, False, workers=2, kind="iterable")])
    saved = []
    for r in range(2):
        loader = _loader(long_docs, r, 2, False, workers=2, kind="iterable")
        next(iter(loader))
        saved.append(loader.state_dict())
    resumed = []
    for r in range(4):
        loader = _loader(long_docs, r, 4, False, workers=2, kind="iterable")
        loader.load_state_dict(reshard_loader_state(saved, r, 4))
        resumed.append(loader)
    assert _global_steps(resumed) == one[1:]


def test_many_streamed_slots_still_read_most_of_the_epoch(tmp_path):
    """An epoch ends at the first step a slot cannot fill: with many slots per step, each slot's sub-stream needs
    many units (the files are cut finer) or the others' records are left unread. The unread are counted."""
    from veomni.data import data_report

    rng = random.Random(1)
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for d in range(1, 1201):
            f.write(json.dumps({"input_ids": [d * 1000 + t for t in range(rng.randint(5, 60))]}) + "\n")
    dataset = token_dataset(str(path), "iterable", max_seq_len=64, seed=5, shuffle_buffer_size=8, unit_bytes=4096)
    loader = token_loader(dataset, 0, 1, 0, max_seq_len=64, dyn=False, micro=1, dlbs=32, seed=5)
    loader.set_epoch(0)
    trained = sum(len(_samples(mb)) for step in loader for mb in step)
    report = data_report(loader)
    assert loader.epoch_ended and trained + report["unread"] + report["dropped"] == 1200
    # 16% here (37 records a slot); 32% with the files' own 83 units (2.6 a slot)
    assert report["unread"] < 0.2 * 1200, report


def test_build_dataloader_takes_global_batch_size_as_the_seed_passes_it(long_docs):
    """`global_batch_size=` sets the micro-batches per rank (it was ignored); a contradiction is refused."""
    from veomni.data import InterleaveDataset, InterleavedIterableDataset, InterleavedMappingDataset, build_dataloader

    assert issubclass(InterleavedMappingDataset, InterleaveDataset)
    assert issubclass(InterleavedIterableDataset, InterleaveDataset)
    dataset = token_dataset(long_docs, "mapping", max_seq_len=MAX_LEN, seed=5)
    common = dict(dataset=dataset, micro_batch_size=2, max_seq_len=MAX_LEN, dyn_bsz=False, dp_rank=0, dp_size=2)
    loader = build_dataloader(global_batch_size=GLOBAL, **common)
    loader.set_epoch(0)
    assert len(next(iter(loader))) == GLOBAL // (2 * 2)  # micro-batches per rank and step
    with pytest.raises(ValueError, match="does not split over 2 data-parallel ranks"):
        build_dataloader(global_batch_size=6, **common)
    with pytest.raises(ValueError, match=r"global_batch_size=8 but .* = 2 \* 3 \* 2 = 12"):
        build_dataloader(global_batch_size=8, dataloader_batch_size=3, **common)
