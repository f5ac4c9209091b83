"""InterleaveDataset: records drawn from several datasets with probabilities proportional to their weights.

`InterleavedMappingDataset` (sources of the mapping kind) is sized: its draw is one global record order, whose
samples go through the global batch plan like a MappingDataset's. `InterleavedIterableDataset` (streamed sources)
is streamed: each slot sub-stream draws from its own shard of every source.
`stopping_strategy="all_exhausted"` keeps drawing from the sources that still have records; `"first_exhausted"`
ends the epoch when any source runs out.
"""

from functools import cached_property
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import IterableDataset

from .data_transform import Key
from .fingerprint import fingerprint
from .sample_cache import expand_runs
from .streaming import IterativeDataset, mix


class InterleaveDataset(IterableDataset):
    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float],
        seed: int = 42,
        stopping_strategy: Literal["all_exhausted", "first_exhausted"] = "all_exhausted",
        names: Optional[Sequence[str]] = None,
    ):
        if len(sources) != len(weights) or not sources:
            raise ValueError("interleave needs one weight per source")
        if any(w <= 0 for w in weights):
            raise ValueError(f"interleave weights must be positive, got {list(weights)}")
        self.sources, self.weights, self.seed = list(sources), list(weights), seed
        self.stopping_strategy, self.names = stopping_strategy, list(names or range(len(sources)))

    def __len__(self) -> int:  # TypeError (as for any unsized dataset) when a source is streamed
        return sum(len(s) for s in self.sources)

    def iter_keys(self, epoch: int, shard: int, num_shards: int, state: Dict[str, Any]) -> Iterator[Key]:
        state.setdefault("sources", [{} for _ in self.sources])
        state.setdefault("active", list(range(len(self.sources))))
        state.setdefault("draws", 0)
        iters = [s.iter_keys(epoch, shard, num_shards, state["sources"][i]) for i, s in enumerate(self.sources)]
        while state["active"]:
            total = sum(self.weights[i] for i in state["active"])
            point = mix(self.seed, epoch, shard, state["draws"]) / 2**64 * total
            state["draws"] += 1
            for i in state["active"]:
                point -= self.weights[i]
                if point < 0:
                    break
            key = next(iters[i], None)
            if key is None:
                if self.stopping_strategy == "first_exhausted":
                    return
                state["active"].remove(i)
                continue
            yield (i, *key)

    def data_fingerprint(self) -> Optional[Dict[str, Any]]:
        """The sources' fingerprints, part by part (files: every source's and the mixture's weights)."""
        parts = [s.data_fingerprint() for s in self.sources]
        if any(p is None for p in parts):
            return None
        files = fingerprint([p["files"] for p in parts], self.weights, self.stopping_strategy, package=False)
        return {"files": files, "transform": parts[0]["transform"], "tokenizer": parts[0]["tokenizer"]}

    def peek(self, n: int) -> List[Tuple[str, Any, Any]]:
        return [item for source in self.sources for item in source.peek(n)]


class InterleavedMappingDataset(InterleaveDataset):
    """Interleaved mapping sources: sized, so its global batches do not depend on the world size."""

    def prepare(self) -> None:
        for source in self.sources:
            source.prepare()

    def plan_store(self) -> Optional[Tuple[str, Any]]:
        """Batch plans are kept in the first source's cache folder (see MappingDataset.plan_store)."""
        stores = [s.plan_store() for s in self.sources]
        if any(store is None for store in stores):
            return None
        identity = ("interleave", stores, self.weights, self.seed, self.stopping_strategy)
        return stores[0][0], identity

    def counts(self) -> Dict[str, int]:
        parts = [s.counts() for s in self.sources]
        return {name: sum(p[name] for p in parts) for name in parts[0]}

    @cached_property
    def _bases(self) -> np.ndarray:
        counts = [s.prepare().num_samples for s in self.sources]
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __iter__(self):
        """Plain iteration (one process, epoch 0) for users who read the dataset without the loader."""
        return (self.sample(i) for i in self.epoch_order(0)[0])

    def epoch_order(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """The draw's records in order, each record's samples in place (ids numbered source after source)."""
        caches, bases = [s.prepare() for s in self.sources], self._bases
        keys = np.array(list(self.iter_keys(epoch, 0, 1, {})), dtype=np.int64).reshape(-1, 2)
        firsts, counts = np.zeros(len(keys), np.int64), np.zeros(len(keys), np.int64)
        for s, cache in enumerate(caches):
            mine = keys[:, 0] == s
            firsts[mine] = bases[s] + cache.record_offsets[keys[mine, 1]]
            counts[mine] = np.diff(cache.record_offsets)[keys[mine, 1]]
        ids = expand_runs(firsts, counts)
        return ids, np.concatenate([c.lengths for c in caches])[ids]

    def sample(self, i: int) -> Dict[str, Any]:
        bases = self._bases
        s = int(np.searchsorted(bases, i, side="right")) - 1
        return self.sources[s].sample(int(i) - int(bases[s]))


class InterleavedIterableDataset(InterleaveDataset):
    """Interleaved streamed sources: each slot sub-stream draws from its own shard of every source."""

    def cut_units(self, at_least: int) -> None:
        for source in self.sources:
            source.cut_units(at_least)

    def samples_many(self, keys: List[Key]) -> List[List[Dict[str, Any]]]:
        out: List[Any] = [None] * len(keys)
        for s, source in enumerate(self.sources):
            idx = [i for i, k in enumerate(keys) if k[0] == s]
            for i, res in zip(idx, source.samples_many([tuple(keys[i][1:]) for i in idx]) if idx else []):
                out[i] = res
        return out

    __iter__ = IterativeDataset.__iter__  # plain iteration through iter_keys and samples_many, as a single source

    @property
    def skipped(self) -> int:
        return sum(s.skipped for s in self.sources)

    @property
    def empty(self) -> int:
        return sum(s.empty for s in self.sources)
