"""Streaming that scales and loses nothing silently: each reader parses only its units (jsonl byte ranges,
parquet row groups); what an epoch does not deliver (drop_last tail, uneven ranks) is counted; blank lines and
empty texts are counted; a user's plain IterableDataset resumes by skipping, or refuses clearly."""

import json
from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import IterableDataset

import veomni.data.readers as readers
from helpers import document_starts, token_dataset, token_loader
from veomni.data import build_dataset
from veomni.data.data_report import data_report
from veomni.data.data_transform import process_pretrain_example

MAX_LEN = 64
N = 600


def _ids(r):
    return [1000 + r] + [3 + (r * 7 + t) % 400 for t in range(5 + r % 40)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """600 records: two jsonl files (with blank lines) and a parquet file of 4 row groups."""
    folder = tmp_path_factory.mktemp("stream")
    for name, rows in (("a.jsonl", range(0, 250)), ("b.jsonl", range(250, 400))):
        with open(folder / name, "w") as f:
            for r in rows:
                f.write(json.dumps({"input_ids": _ids(r)}) + "\n" + ("\n" if r % 50 == 0 else ""))
    table = pa.table({"input_ids": [_ids(r) for r in range(400, N)]})
    pq.write_table(table, folder / "c.parquet", row_group_size=50)
    return str(folder)


_dataset = partial(token_dataset, max_seq_len=MAX_LEN, shuffle_buffer_size=16)
_loader = partial(token_loader, max_seq_len=MAX_LEN)


def _records(micro_batch):
    return [t - 1000 for t in document_starts(micro_batch)]


def test_each_reader_parses_only_its_units(corpus, monkeypatch):
    parsed_lines, row_groups = [], []
    parse, read_group = readers._parse_json_line, pq.ParquetFile.read_row_group
    monkeypatch.setattr(readers, "_parse_json_line", lambda line, where: parsed_lines.append(1) or parse(line, where))
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i: row_groups.append(i) or read_group(self, i))
    dataset = _dataset(corpus, unit_bytes=2048)
    assert len(dataset.units) > 8
    seen = []
    for shard in range(4):
        before = (len(parsed_lines), len(row_groups))
        keys = list(dataset.iter_keys(0, shard, 4, {}))
        seen += [r for key in keys for s in dataset.samples_many([key])[0] for r in [s["input_ids"][0] - 1000]]
        lines, groups = len(parsed_lines) - before[0], len(row_groups) - before[1]
        jsonl = sum(1 for k in keys if dataset.files[k[0]].endswith(".jsonl"))
        assert lines <= 2 * jsonl  # its own lines (and each re-read once by samples_many()), never the others'
        assert groups <= 2  # at most its parquet row groups, each decoded once
        assert 0 < len(keys) < N / 2
    assert sorted(seen) == list(range(N))
    assert len(row_groups) == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_uneven_ranks_and_drop_last_are_counted(corpus, workers):
    """Two ranks step together as the trainer does (stop when one runs out); what is not delivered is reported."""
    loaders = [_loader(_dataset(corpus, unit_bytes=4096), r, 2, workers, drop_last=True) for r in range(2)]
    iters, fetched = [iter(lo) for lo in loaders], []
    while True:
        steps = [next(it, None) for it in iters]
        fetched += [r for s in steps if s is not None for mb in s for r in _records(mb)]
        if any(s is None for s in steps):
            break
    reports = [data_report(lo) for lo in loaders]
    assert len(fetched) == len(set(fetched)) == sum(r["samples"] for r in reports)
    lost = sum(r["dropped"] + r["unread"] for r in reports)
    assert len(fetched) + lost == N and lost > 0, reports


def test_at_most_once_without_drop_last_and_the_rest_counted(tmp_path, corpus):
    """Each micro-batch slot of a step is its own stream (world-size independence), so an epoch ends when the first
    slot's stream runs dry: the records other slots had not reached are counted as unread, never silently lost."""
    loader = _loader(_dataset(corpus, unit_bytes=2048), drop_last=False)
    seen = [r for step in loader for mb in step for r in _records(mb)]
    report = data_report(loader)
    assert len(seen) == len(set(seen)) == report["samples"] and len(seen) > N * 3 // 4
    assert len(seen) + report["unread"] + report["dropped"] == N, report
    assert (report["skipped"], report["empty"]) == (0, 0) and report["blank"] <= 8
    one_slot = _loader(_dataset(corpus), micro=1, dlbs=1, drop_last=False)  # one stream: every record, once
    assert sorted(r for step in one_slot for mb in step for r in _records(mb)) == list(range(N))
    assert data_report(one_slot) == {
        "samples": N,
        "skipped": 0,
        "empty": 0,
        "blank": 8,
        "dropped": 0,
        "unread": 0,
        "whole_dataset": False,
    }

    class Tok:
        eos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    path = tmp_path / "texts.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["some text", "", "more", ""]) + "\n\n")
    transform = partial(process_pretrain_example, tokenizer=Tok(), max_seq_len=MAX_LEN)
    for kind in ("iterable", "mapping"):
        loader = _loader(build_dataset(train_path=str(path), datasets_type=kind, transform=transform), micro=1, dlbs=1)
        assert len(list(loader)) == 2
        report = data_report(loader)
        assert (report["samples"], report["empty"]) == (2, 2), (kind, report)
        assert report["blank"] == 1, (kind, report)  # mapping data counts them too (when its cache is built)


class Counting(IterableDataset):
    """A user's plain iterable dataset (no state): re-iterable, same order each time."""

    def __init__(self, one_shot=False):
        self.one_shot, self.used = one_shot, False

    def __iter__(self):
        if self.one_shot and self.used:
            return iter(())
        self.used = True
        return ({"input_ids": _ids(r), "labels": _ids(r)} for r in range(200))


def test_plain_iterable_dataset_resumes_by_skipping_or_refuses_clearly():
    loader = _loader(Counting(), dyn=True)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    expected = [_records(mb) for _ in range(5) for mb in next(it)]
    resumed = _loader(Counting(), dyn=True)
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert [_records(mb) for _ in range(5) for mb in next(it)] == expected

    one_shot = Counting(one_shot=True)
    list(iter(one_shot))
    broken = _loader(one_shot, dyn=True)
    broken.load_state_dict(state)
    with pytest.raises(RuntimeError, match="cannot resume Counting: it yielded 0 items"):
        next(iter(broken))


def test_the_end_of_run_account_names_only_what_was_left_out():
    from veomni.trainer.text_trainer import left_out_message

    total = {"empty": 0, "blank": 3, "dropped": 2, "unread": 0, "samples": 1200}
    assert left_out_message(total) == (
        "the last epoch left out 3 blank lines, 2 samples of a tail too small for a step (1,200 samples handed out)"
    )
    assert left_out_message({**total, "blank": 0, "dropped": 0}) is None
