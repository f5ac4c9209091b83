"""IterativeDataset: records streamed from files, memory one shuffle buffer whatever the data size.

The files are cut into units (jsonl byte ranges, parquet row groups; see readers.py); each epoch deals a seeded
permutation of the units round-robin to the shards (the loader's slot sub-streams, streamed_batches.py), so a reader
parses only its own units, and a seeded shuffle buffer mixes their records. Blank lines are skipped and counted
(`blank` in the loader state). A dataset of the streamed kind offers
    iter_keys(epoch, shard, num_shards, state)  -> keys of this shard's records, advancing the dict `state`
    samples_many(keys)                          -> the transformed samples of those records
so the loader's resume state is a few integers per buffered sample.
"""

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import IterableDataset

from .data_transform import Key, Transforming
from .fingerprint import Unfingerprintable, data_fingerprint
from .readers import BLANK, RecordFiles


def mix(*values: int) -> int:
    """A stateless 64-bit hash (splitmix64 chain): randomness that needs no saved RNG state."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x


class IterativeDataset(IterableDataset, Transforming):
    """Records streamed from `files` through a seeded shuffle buffer of `shuffle_buffer_size` records."""

    source: Optional[str] = None  # where the data came by name from (a hub dataset), in the fingerprint

    def __init__(
        self,
        files: List[str],
        transform: Optional[Callable] = None,
        seed: int = 42,
        shuffle_buffer_size: int = 1000,
        skip_bad_samples: bool = False,
        unit_bytes: Optional[int] = None,
    ):
        self.files, self.transform, self.seed = files, transform, seed
        self.shuffle_buffer_size, self.skip_bad_samples = shuffle_buffer_size, skip_bad_samples
        self.reader = RecordFiles(files)
        self.units = self.reader.units(unit_bytes)
        self._pending: Dict[Key, Tuple[Any, str]] = {}

    def cut_units(self, at_least: int) -> None:
        """Cut the units finer (each into equal pieces) until there are `at_least`, so that many readers each get
        several: a reader with one or two units runs out early and ends the streamed epoch for everyone."""
        if not self.units or len(self.units) >= at_least:
            return
        pieces = -(-at_least // len(self.units))
        units: List[Tuple[int, int, int]] = []
        for fi, start, end in self.units:
            least = 256 if self.files[fi].endswith(".jsonl") else 1  # bytes or rows: a piece holds something
            step = max(-(-(end - start) // pieces), least)
            units += [(fi, a, min(a + step, end)) for a in range(start, end, step)]
        self.units = units

    def data_fingerprint(self) -> Optional[Dict[str, Any]]:
        """What the data is made of (files, transform, tokenizer; fingerprint.py), None when it cannot be told."""
        if not hasattr(self, "_fingerprint"):
            try:
                self._fingerprint = data_fingerprint(self.files, self.transform, self.source)
            except Unfingerprintable:
                self._fingerprint = None
        return self._fingerprint

    def shard_units(self, epoch: int, shard: int, num_shards: int) -> List[Tuple[int, int, int]]:
        order = torch.randperm(len(self.units), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        return [self.units[u] for u in order[shard::num_shards]]

    def unread(self, epoch: int, shard: int, num_shards: int, state: Dict[str, Any]) -> int:
        """Records of this shard not reached at `state` (its shuffle buffer included), counted without parsing."""
        units, at = self.shard_units(epoch, shard, num_shards), state.get("unit", 0)
        left = sum(self.reader.count_unit(u) for u in units[at + 1 :]) + len(state.get("buffer", []))
        return left + (self.reader.count_unit(units[at], state.get("position")) if at < len(units) else 0)

    def iter_keys(self, epoch: int, shard: int, num_shards: int, state: Dict[str, Any]) -> Iterator[Key]:
        units = self.shard_units(epoch, shard, num_shards)
        state.setdefault("unit", 0)  # the unit being read (index into this shard's units)
        state.setdefault("position", None)  # where that unit continues (None: at its start)
        state.setdefault("buffer", [])  # keys waiting in the shuffle buffer
        state.setdefault("popped", 0)
        state.setdefault("blank", 0)
        wanted = [tuple(key) for key in state["buffer"] if tuple(key) not in self._pending]  # a resumed buffer
        fetch_many = getattr(self.reader, "fetch_many", None)  # (a hub stream reads each shard once for them all)
        for key, record in (fetch_many(wanted) if fetch_many else {k: self.reader.fetch(k) for k in wanted}).items():
            self._pending[key] = (record, self.reader.location(key))
        stream = None
        while True:
            if len(state["buffer"]) < self.shuffle_buffer_size and state["unit"] < len(units):
                if stream is None:
                    stream = self.reader.iter_unit(units[state["unit"]], state["position"])
                item = next(stream, None)
                if item is None:
                    state["unit"], state["position"], stream = state["unit"] + 1, None, None
                    continue
                key, record, where, next_key = item
                state["position"] = next_key[1]
                if record is BLANK:
                    state["blank"] += 1
                    continue
                self._pending[key] = (record, where)
                state["buffer"].append(list(key))
                continue
            if not state["buffer"]:
                return
            pick = mix(self.seed, epoch, shard, state["popped"]) % len(state["buffer"])
            state["popped"] += 1
            state["buffer"][pick], state["buffer"][-1] = state["buffer"][-1], state["buffer"][pick]
            yield tuple(state["buffer"].pop())

    def samples_many(self, keys: List[Key]) -> List[List[Dict[str, Any]]]:
        items = [self._pending.pop(k, None) or (self.reader.fetch(k), self.reader.location(k)) for k in keys]
        return self._apply_many([r for r, _ in items], [w for _, w in items])

    def __iter__(self):
        """Plain iteration (one process, epoch 0) for users who read the dataset without the loader."""
        for key in self.iter_keys(0, 0, 1, {}):
            yield from self.samples_many([key])[0]
