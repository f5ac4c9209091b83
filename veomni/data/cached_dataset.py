"""Map-style data of any size: records stay in their files, samples come from a shared on-disk cache.

`FileMappingDataset` (what `datasets_type: mapping` builds) holds no record in memory. Its first use on a run
(`len()`, or `build_dataloader`; a collective: every rank calls it) opens the dataset's sample cache, building it
with all ranks if needed (veomni/data/sample_cache.py). Then:

- the global batch plan (packing, dyn_bsz, world-size independence, exact resume; global_batches.py) reads only
  the cached sample lengths, through `CachedSampleIndex`;
- a sample is read from the mapped token files (text), or, for samples the cache cannot hold (a VL sample's
  pixels), the record is read back from its file and transformed on access, in the loader's workers.

So start-up and memory do not grow with the data: a second run maps the cache and starts at once.
"""

import os
import re
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Tuple

import numpy as np
from torch.utils.data import Dataset

from .data_transform import DataFormatError
from .dataset import DATASET_REGISTRY, Key, _Transforming, shuffled_shard_keys
from .readers import RecordFiles, resolve_data_files
from .sample_cache import SampleCache, open_or_build


class FileMappingDataset(Dataset, _Transforming):
    """Records in files, transformed once into a cache every rank maps; `transform` may give several samples for
    one record (a long document's pieces)."""

    def __init__(
        self,
        files: List[str],
        transform=None,
        seed: int = 42,
        shuffle: bool = True,
        skip_bad_samples: bool = False,
        cache_dir: Optional[str] = None,
        name: str = "data",
    ):
        self.files, self.transform = files, transform
        self.seed, self.shuffle, self.skip_bad_samples = seed, shuffle, skip_bad_samples
        self.cache_dir, self.name = cache_dir, name
        self.reader = RecordFiles(files)
        self.cache: Optional[SampleCache] = None
        self._last: Tuple[int, List[Dict[str, Any]]] = (-1, [])

    def prepare(self) -> SampleCache:
        """Open (or build, with every rank) the sample cache. Collective: call on every rank alike."""
        if self.cache is None:
            self.cache = open_or_build(self, self.cache_dir, self.name)
        return self.cache

    def __len__(self) -> int:
        return self.prepare().num_records

    @property
    def skipped(self) -> int:  # bad records left out when the cache was built
        return self.cache.manifest["skipped"] if self.cache is not None else self.__dict__.get("_skipped", 0)

    @skipped.setter
    def skipped(self, value: int) -> None:
        self.__dict__["_skipped"] = value

    @property
    def empty(self) -> int:
        return self.cache.manifest["empty"] if self.cache is not None else self.__dict__.get("_empty", 0)

    @empty.setter
    def empty(self, value: int) -> None:
        self.__dict__["_empty"] = value

    def record_samples(self, record: int) -> List[Dict[str, Any]]:
        """The samples of record `record`: from the cache, or transformed again from the file (length mode)."""
        if self._last[0] == record:
            return self._last[1]
        cache = self.prepare()
        first, last = int(cache.record_offsets[record]), int(cache.record_offsets[record + 1])
        if cache.token_mode:
            samples = [cache.sample(i) for i in range(first, last)]
        else:
            key = (int(cache.keys[record][0]), int(cache.keys[record][1]))
            samples = self._apply(self.reader.fetch(key), self.reader.location(key))
            lengths = [len(s["input_ids"]) for s in samples]
            if lengths != cache.lengths[first:last].tolist():
                raise DataFormatError(
                    f"{self.reader.location(key)}: the transform gave samples of {lengths} tokens, but "
                    f"{cache.lengths[first:last].tolist()} when the data cache was built: it must be deterministic"
                )
        self._last = (record, samples)
        return samples

    def __getitem__(self, index: int) -> List[Dict[str, Any]]:
        return self.record_samples(index)

    def iter_keys(self, epoch: int, shard: int, num_shards: int, state: Dict[str, Any]) -> Iterator[Key]:
        return shuffled_shard_keys(len(self), self.seed, epoch, self.shuffle, shard, num_shards, state)

    def samples(self, key: Key) -> List[Dict[str, Any]]:
        return self.record_samples(key[0])

    def record_order(self, epoch: int) -> np.ndarray:
        """Record indices in this epoch's order (the permutation `iter_keys` walks)."""
        import torch

        n = len(self)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).numpy()


def cached_sources(dataset) -> Optional[List[FileMappingDataset]]:
    """The cached sources of a dataset the cached index can serve (one FileMappingDataset, or an interleave of
    them), or None."""
    if isinstance(dataset, FileMappingDataset):
        return [dataset]
    sources = getattr(dataset, "sources", None)
    if sources and hasattr(dataset, "iter_keys") and all(isinstance(s, FileMappingDataset) for s in sources):
        return list(sources)
    return None


class CachedSampleIndex:
    """SampleIndex (global_batches.py) for cached sources: an epoch's global sample order and lengths come from
    the cache's index arrays; a sample is read when a micro-batch is collated."""

    def __init__(self, dataset, sources: List[FileMappingDataset]):
        self.dataset, self.sources = dataset, sources
        for source in sources:
            source.prepare()
        counts = [s.cache.num_samples for s in sources]
        self.bases = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._order: Dict[int, Tuple[np.ndarray, List[int]]] = {}

    def order(self, epoch: int) -> Tuple[np.ndarray, List[int]]:
        """`(sample ids, lengths)` of the epoch in global order."""
        if epoch not in self._order:
            if len(self.sources) == 1 and self.dataset is self.sources[0]:
                ids = self.sources[0].cache.epoch_samples(self.sources[0].record_order(epoch))
            else:  # an interleave: its own draw of records, each record's samples in place
                parts = []
                for key in self.dataset.iter_keys(epoch, 0, 1, {}):
                    cache, base = self.sources[key[0]].cache, self.bases[key[0]]
                    parts.append(base + np.arange(cache.record_offsets[key[1]], cache.record_offsets[key[1] + 1]))
                ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
            self._order = {epoch: (ids, self._lengths(ids).tolist())}  # one epoch at a time
        return self._order[epoch]

    def _lengths(self, ids: np.ndarray) -> np.ndarray:
        if len(self.sources) == 1:
            return self.sources[0].cache.lengths[ids]
        which = np.searchsorted(self.bases, ids, side="right") - 1
        out = np.empty(len(ids), dtype=np.int32)
        for s, source in enumerate(self.sources):
            mask = which == s
            out[mask] = source.cache.lengths[ids[mask] - self.bases[s]]
        return out

    def sample(self, sample_id) -> Dict[str, Any]:
        s = int(np.searchsorted(self.bases, sample_id, side="right")) - 1
        source = self.sources[s]
        local = int(sample_id) - int(self.bases[s])
        if source.cache.token_mode:
            return source.cache.sample(local)
        record, piece = source.cache.record_of(local)
        return source.record_samples(record)[piece]

    @property
    def skipped(self) -> int:
        return sum(s.skipped for s in self.sources)

    @property
    def empty(self) -> int:
        return sum(s.empty for s in self.sources)

    @property
    def blank(self) -> int:  # blank lines of the files, left out when the cache was built
        return sum(s.cache.manifest.get("blank", 0) for s in self.sources)


@DATASET_REGISTRY.register("mapping")
def build_mapping_dataset(
    train_path: str,
    transform: Optional[Callable] = None,
    namespace: Literal["train", "test"] = "train",
    seed: int = 42,
    source_name: Optional[str] = None,
    skip_bad_samples: bool = False,
    cache_dir: Optional[str] = None,
    **kwargs,
) -> FileMappingDataset:
    """Map-style data from a file, glob or folder: nothing is read until the first use (see the module doc)."""
    files = resolve_data_files(train_path)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", source_name or os.path.basename(train_path.rstrip("/"))) or "data"
    return FileMappingDataset(
        files, transform, seed=seed, skip_bad_samples=skip_bad_samples, cache_dir=cache_dir, name=name
    )
