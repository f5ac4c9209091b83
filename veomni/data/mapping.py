"""MappingDataset: map-style data of any size, its samples in a shared memory-mapped cache.

The records are data files (what `datasets_type: mapping` builds) or a user's own map-style dataset (anything with
`len()` and `[i]`, e.g. from a registered builder: `build_dataloader` wraps it). Nothing is held in memory: the first
use on a run (`len()`, or `build_dataloader`; a collective: every rank calls it) opens the sample cache, building it
with all ranks if needed (sample_cache.py). Then the global batch plan (global_batches.py) reads only the cached
sample lengths, and a sample is read from the mapped token files or, for samples the cache cannot hold (a VL
sample's pixels), re-read from its record and transformed again, in the loader's workers. A user's dataset cannot
be fingerprinted, so its cache serves the one run that built it.

The sized protocol the loader reads (also offered by InterleavedMappingDataset):
    prepare()             open or build the cache (collective)
    epoch_order(epoch)    (sample ids in the epoch's global order, their lengths)
    sample(i)             one sample; counts() -> skipped / empty / blank records left out when building
"""

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from .data_transform import DataFormatError, Key, Transforming
from .readers import RecordFiles, RecordList
from .sample_cache import SampleCache, open_or_build


class MappingDataset(Dataset, Transforming):
    """`records`: RecordFiles over data files, or any map-style dataset of records; `transform` may give several
    samples for one record (a long document's pieces). Epoch e shuffles the records with seed `seed + e`."""

    source: Optional[str] = None  # where files that came by name came from (a hub dataset), in the fingerprint

    def __init__(
        self,
        records,
        transform: Optional[Callable] = None,
        seed: int = 42,
        shuffle: bool = True,
        skip_bad_samples: bool = False,
        cache_dir: Optional[str] = None,
        name: str = "data",
    ):
        self.reader = records if isinstance(records, (RecordFiles, RecordList)) else RecordList(records)
        self.files, self.transform = self.reader.files, transform
        self.seed, self.shuffle, self.skip_bad_samples = seed, shuffle, skip_bad_samples
        self.cache_dir, self.name = cache_dir, name
        self.cache: Optional[SampleCache] = None
        self._last: Tuple[int, List[Dict[str, Any]]] = (-1, [])

    def prepare(self) -> SampleCache:
        """Open (or build, with every rank) the sample cache. Collective: call on every rank alike."""
        if self.cache is None:
            self.cache = open_or_build(self, self.cache_dir, self.name)
        return self.cache

    def __len__(self) -> int:
        return self.prepare().num_records

    def data_fingerprint(self) -> Optional[Dict[str, Any]]:
        """What the data is made of (files, transform, tokenizer; fingerprint.py), None for a user's own dataset."""
        return self.prepare().manifest.get("fingerprint")

    def plan_store(self) -> Optional[Tuple[str, Any]]:
        """Where batch plans over this data are kept (its cache folder) and what else they depend on; None for a
        cache of one run's own."""
        cache = self.prepare()
        return (cache.folder, ("mapping", self.seed, self.shuffle)) if self.data_fingerprint() is not None else None

    def counts(self) -> Dict[str, int]:
        manifest = self.prepare().manifest
        return {name: manifest.get(name, 0) for name in ("skipped", "empty", "blank")}

    def __getitem__(self, record: int) -> List[Dict[str, Any]]:
        """The samples of record `record`: from the cache, or transformed again from the record (length mode)."""
        if self._last[0] == record:
            return self._last[1]
        cache = self.prepare()
        first, last = int(cache.record_offsets[record]), int(cache.record_offsets[record + 1])
        if cache.token_mode:
            samples = [cache.sample(i) for i in range(first, last)]
        else:
            key = (int(cache.keys[record][0]), int(cache.keys[record][1]))
            samples = self._apply_many([self.reader.fetch(key)], [self.reader.location(key)])[0]
            lengths = [len(s["input_ids"]) for s in samples]
            if lengths != cache.lengths[first:last].tolist():
                raise DataFormatError(
                    f"{self.reader.location(key)}: the transform gave samples of {lengths} tokens, but "
                    f"{cache.lengths[first:last].tolist()} when the data cache was built: it must be deterministic"
                )
        self._last = (record, samples)
        return samples

    def record_order(self, epoch: int) -> np.ndarray:
        """Record indices in this epoch's order."""
        if not self.shuffle:
            return np.arange(len(self), dtype=np.int64)
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(self.seed + epoch)).numpy()

    def epoch_order(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        cache = self.prepare()
        ids = cache.epoch_samples(self.record_order(epoch))
        return ids, cache.lengths[ids]

    def sample(self, i: int) -> Dict[str, Any]:
        cache = self.prepare()
        if cache.token_mode:
            return cache.sample(int(i))
        record, piece = cache.record_of(int(i))
        return self[record][piece]

    def iter_keys(self, epoch: int, shard: int, num_shards: int, state: Dict[str, Any]) -> Iterator[Key]:
        """`(record,)` in this epoch's order, this shard's stride: an interleave's draw, made whole, never resumed
        part way (InterleavedMappingDataset.epoch_order), so `state` is not needed."""
        return ((record,) for record in self.record_order(epoch)[shard::num_shards].tolist())
