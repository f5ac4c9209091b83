"""The streaming reader's work per record does not grow with the number of records (issue #30), nor does the
mapping path's first pass: the sample cache built from the file, then one packed epoch read from it (issue #37).

A jsonl location used to be counted from the file's start for every record a reader yielded mid-file (a unit of
another reader, a shuffled unit, a resume): 5x the records made each token 4x dearer. Here the whole loader path
(IterativeDataset -> SlotStream -> micro-batches) reads 500 and then 5,000 records, on 1 rank and on 2 ranks, and
counts, per record yielded, the work done: bytes pulled from the data file (every `open` of it, whoever opens it),
records parsed, and function calls (Python and C, as sys.setprofile sees them). Each must stay flat from the small
data to the 10x larger one. Made to fail on purpose (readers.py, then restored): the line number counted from the
file's start per record (bytes read per byte 3.98 -> 2,524 at 5,000 records), a unit's first line found by reading
from the file's start (3.98 -> 88), the unit plan recomputed per record (calls per record 102 -> 283). The first
pass is counted the same way, its build in this process; made to fail on purpose (cache_writer.py, then restored):
the unit plan recomputed per record by the build (calls per record 135 -> 649 at 5,000 records).
"""

import builtins
import io
import json
import os
import random
import sys
from collections import Counter

import pytest

import veomni.data.readers as readers
from helpers import document_starts, token_dataset, token_loader

MAX_LEN = 64
SIZES = (500, 5000)
FLAT = 1.5  # the larger data may cost at most this much more per record than the smaller one


def _write(path, n):
    """`n` pre-tokenised records of 8..40 tokens (no tokenizer: the reader's work, not the tokenizer's, is
    measured); the first token names the record."""
    rng = random.Random(n)
    with open(path, "w") as f:
        for r in range(n):
            ids = [100_000 + r] + [rng.randrange(3, 500) for _ in range(rng.randint(8, 40))]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return str(path)


class _CountingFileIO(io.FileIO):
    """The raw file under a BufferedReader: counts the bytes actually read from the file (read-ahead included)."""

    def __init__(self, name, counter):
        super().__init__(name, "r")
        self._counter = counter

    def readinto(self, buffer):
        n = super().readinto(buffer)
        self._counter["bytes"] += n or 0
        return n

    def readall(self):
        data = super().readall()
        self._counter["bytes"] += len(data)
        return data


def _count_reads_of(path, counter, monkeypatch):
    """Every read-only `open` of `path` (by the readers or anything else) goes through a counting raw file."""
    real_open, target = builtins.open, os.path.realpath(path)

    def counting_open(
        file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True, opener=None
    ):
        if isinstance(file, (str, os.PathLike)) and set(mode) <= set("rbt") and os.path.realpath(file) == target:
            raw = io.BufferedReader(_CountingFileIO(file, counter))
            return raw if "b" in mode else io.TextIOWrapper(raw, encoding=encoding, errors=errors, newline=newline)
        return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)

    monkeypatch.setattr(builtins, "open", counting_open)


def _counting(monkeypatch, path):
    """A counter of records parsed, bytes read from `path` and function calls (Python and C), with its profiler."""
    counter = Counter()
    parse = readers._parse_json_line
    monkeypatch.setattr(readers, "_parse_json_line", lambda line, where: counter.update(parsed=1) or parse(line, where))

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            counter["calls"] += 1

    return counter, profile


def _per_record(counter, path, seen, n):
    assert sorted(seen) == list(range(len(seen))) and len(seen) > n * 0.95, "records lost or repeated"
    size = os.path.getsize(path)
    return {
        "bytes read per byte of data": counter["bytes"] / size,
        "parses per record": counter["parsed"] / len(seen),
        "function calls per record": counter["calls"] / len(seen),
    }


def _first_pass_cost(path, n, cache_dir, monkeypatch):
    """Per record of the mapping path's first pass, built in this process from dataset to the epoch's last batch."""
    monkeypatch.setenv("VEOMNI_DATA_BUILD_PROCESSES", "1")
    counter, profile = _counting(monkeypatch, path)
    _count_reads_of(path, counter, monkeypatch)
    sys.setprofile(profile)
    try:
        dataset = token_dataset(path, "mapping", max_seq_len=MAX_LEN, cache_dir=cache_dir)
        loader = token_loader(dataset, max_seq_len=MAX_LEN, dyn=True, micro=4, dlbs=1)
        loader.set_epoch(0)
        seen = [d - 100_000 for step in loader for mb in step for d in document_starts(mb)]
    finally:
        sys.setprofile(None)
        monkeypatch.undo()
    return _per_record(counter, path, seen, n)


def _one_epoch_cost(path, n, ranks, monkeypatch):
    """Per record yielded (over all ranks, run one after the other): bytes read from the data file, records
    parsed, function calls. Also checks that every record came out exactly once."""
    counter, profile = _counting(monkeypatch, path)
    loaders = []
    for rank in range(ranks):  # built (units planned) outside the measured pass
        dataset = token_dataset(path, max_seq_len=MAX_LEN, shuffle_buffer_size=64)
        loader = token_loader(dataset, rank, ranks, max_seq_len=MAX_LEN, dyn=True, micro=4, dlbs=1)
        loader.set_epoch(0)
        loaders.append(loader)
    seen = []
    _count_reads_of(path, counter, monkeypatch)
    sys.setprofile(profile)
    try:
        for loader in loaders:
            seen += [d - 100_000 for step in loader for mb in step for d in document_starts(mb)]
    finally:
        sys.setprofile(None)
        monkeypatch.undo()
    return _per_record(counter, path, seen, n)


def _assert_flat(small, large, what_ran: str, bytes_per_byte: float) -> None:
    report = {k: (round(small[k], 2), round(large[k], 2)) for k in small}
    print(f"{what_ran}, per record at {SIZES[0]} vs {SIZES[1]} records: {report}")
    for what in small:
        assert large[what] <= FLAT * small[what], f"{what} grows with the data: {report}"
    assert large["parses per record"] <= 1.01, f"records parsed more than once: {report}"
    assert large["bytes read per byte of data"] < bytes_per_byte, f"the data is read far more than once: {report}"


@pytest.mark.parametrize("ranks", [1, 2])
def test_streaming_work_per_record_is_flat_in_the_data_size(tmp_path, monkeypatch, ranks):
    small, large = (_one_epoch_cost(_write(tmp_path / f"{n}.jsonl", n), n, ranks, monkeypatch) for n in SIZES)
    _assert_flat(small, large, f"{ranks} rank(s)", bytes_per_byte=8)


def test_first_pass_work_per_record_is_flat_in_the_data_size(tmp_path, monkeypatch):
    """The raw-text first pass (benchmarks/data_pipeline.py --first-pass) is tokenizer-bound and too noisy on this
    box to show flat per token by the clock: counted here, with the tokenizer's part left out (pre-tokenised)."""
    small, large = (
        _first_pass_cost(_write(tmp_path / f"{n}.jsonl", n), n, str(tmp_path / f"cache-{n}"), monkeypatch)
        for n in SIZES
    )
    # on data this small the units are 4 KiB, each read through its own 8 KiB buffer: about 3 bytes read per byte
    _assert_flat(small, large, "first pass", bytes_per_byte=4)
