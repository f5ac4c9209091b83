"""Datasets: a registry of builders, and three kinds that share one small protocol.

A dataset that the loader can resume exactly offers
    iter_keys(epoch, shard, num_shards, state)  -> keys of this shard's records, in this epoch's order,
                                                    advancing the dict `state` so that iteration can restart
    samples(key)                                -> the transformed samples of one record ([] if skipped)
Keys are tuples of ints, so the loader's resume state is a few integers per buffered sample.

- MappingDataset: records in memory (a user's own small data); a seeded permutation per epoch.
- FileMappingDataset (cached_dataset.py, what `datasets_type: mapping` builds): records in files, samples in a
  shared on-disk cache built once; the same protocol and order as MappingDataset.
- StreamingDataset (public name `IterativeDataset`): files read lazily (bounded memory) through a seeded shuffle
  buffer.
- InterleavedDataset (`InterleavedMappingDataset` / `InterleavedIterableDataset`): several of either, drawn by
  weight.
Every shard (data-parallel rank x dataloader worker) sees a disjoint part; together they see each record of an
epoch exactly once.
"""

import os
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple

import yaml
from torch.utils.data import Dataset, IterableDataset

from ..utils.logging import EVERY_RANK, get_logger
from .data_transform import DataFormatError
from .readers import BLANK, RecordFiles, resolve_data_files

logger = get_logger(__name__)
Key = Tuple[int, ...]


class Registry:
    """Name -> builder; `@DATASET_REGISTRY.register("custom")` adds one."""

    def __init__(self, kind: str):
        self.kind, self._items = kind, {}

    def register(self, name: str):
        def decorator(fn):
            self._items[name] = fn
            return fn

        return decorator

    def get(self, name: str):
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} '{name}'; registered: {sorted(self._items)}")
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items


DATASET_REGISTRY = Registry("dataset")


def mix(*values: int) -> int:
    """A stateless 64-bit hash (splitmix64 chain): randomness that needs no saved RNG state."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x


def shuffled_shard_keys(
    n: int, seed: int, epoch: int, shuffle: bool, shard: int, num_shards: int, state: Dict[str, Any]
) -> Iterator[Key]:
    """Indices `0..n-1` in this epoch's seeded order, this shard's share, from `state["cursor"]` on.

    Strided, so the first k records of all shards together are the first k * num_shards of the order: a global
    batch holds the same records whatever the data-parallel size (parity with one process). The last
    `n % num_shards` records of the order are left out so that every shard gets the same count.
    """
    import torch

    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist() if shuffle else list(range(n))
    )
    mine = order[: n // num_shards * num_shards][shard::num_shards]
    state.setdefault("cursor", 0)
    while state["cursor"] < len(mine):
        state["cursor"] += 1
        yield (mine[state["cursor"] - 1],)


class _Transforming:
    """Applies the transform with the bad-data policy: raise naming the record, or skip and count."""

    transform: Optional[Callable]
    skip_bad_samples: bool
    skipped: int = 0  # bad records skipped (data.skip_bad_samples)
    empty: int = 0  # records that gave no sample (empty text, a one-token document): counted, not errors

    def _apply(self, record: Any, where: str) -> List[Dict[str, Any]]:
        if isinstance(record, DataFormatError):  # the reader's error, already naming file and line
            return self._reject(record, None)
        try:
            out = self.transform(record) if self.transform is not None else record
        except DataFormatError as err:
            return self._reject(err, where)
        out = out if isinstance(out, list) else [out]
        self.empty += not out
        return out

    def _reject(self, err: DataFormatError, where: Optional[Any]) -> List[Dict[str, Any]]:
        """Raise the bad record's error, or skip it. `where` (a lazy location: counting a jsonl line reads the
        file up to it) becomes text only when the message is shown, so skipping stays linear in the data."""

        def message() -> str:
            return str(err) if where is None else f"{where}: {err}"

        if not self.skip_bad_samples:
            raise DataFormatError(message() + " (set data.skip_bad_samples to skip such samples)") from None
        self.skipped += 1
        if self.skipped <= 5:
            logger.warning(f"skipped bad sample: {message()}", extra=EVERY_RANK)
        return []

    def _apply_many(self, records: List[Any], wheres: List[Any]) -> List[List[Dict[str, Any]]]:
        """`_apply` over many records, through the transform's batched form when it has one."""
        batched = _batched_form(self.transform)
        if batched is None:
            return [self._apply(r, w) for r, w in zip(records, wheres)]
        ok = [i for i, r in enumerate(records) if not isinstance(r, DataFormatError)]
        out: List[List[Dict[str, Any]]] = [[] for _ in records]
        for i, record in enumerate(records):
            if isinstance(record, DataFormatError):
                out[i] = self._reject(record, None)
        for i, res in zip(ok, batched([records[i] for i in ok])):  # a transform's error gets its record's location
            if isinstance(res, DataFormatError):
                out[i] = self._reject(res, wheres[i])
            else:
                out[i] = res
                self.empty += not res
        return out


def _batched_form(transform: Optional[Callable]) -> Optional[Callable]:
    """The batched version of a transform (`fn.batched`, also through functools.partial), or None."""
    if transform is None:
        return None
    if isinstance(transform, partial):
        inner = getattr(transform.func, "batched", None)
        return partial(inner, *transform.args, **transform.keywords) if inner else None
    return getattr(transform, "batched", None)


# ------------------------------------------------------------------------------------------------ mapping
class MappingDataset(Dataset, _Transforming):
    """All records in memory; `transform` runs on access and may return several samples for one record."""

    def __init__(
        self,
        records: List[Dict[str, Any]],
        locations: List[str],
        transform: Optional[Callable] = None,
        seed: int = 42,
        shuffle: bool = True,
        skip_bad_samples: bool = False,
    ):
        self.records, self.locations, self.transform = records, locations, transform
        self.seed, self.shuffle, self.skip_bad_samples = seed, shuffle, skip_bad_samples

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        return self._apply(self.records[index], self.locations[index])

    def iter_keys(self, epoch: int, shard: int, num_shards: int, state: Dict[str, Any]) -> Iterator[Key]:
        return shuffled_shard_keys(len(self), self.seed, epoch, self.shuffle, shard, num_shards, state)

    def samples(self, key: Key) -> List[Dict[str, Any]]:
        return self[key[0]]

    def samples_many(self, keys: List[Key]) -> List[List[Dict[str, Any]]]:
        return self._apply_many([self.records[k[0]] for k in keys], [self.locations[k[0]] for k in keys])


def _iterate_samples(self):
    """Plain iteration (one process, epoch 0) for users who read a dataset without the loader."""
    for key in self.iter_keys(0, 0, 1, {}):
        yield from self.samples(key)


# ---------------------------------------------------------------------------------------------- streaming
class StreamingDataset(IterableDataset, _Transforming):
    """Records streamed from files: memory is one shuffle buffer, whatever the data size.

    The files are cut into units (jsonl byte ranges, parquet row groups; see readers.py); each epoch deals a
    seeded permutation of the units round-robin to the shards (data-parallel rank x loader worker), so a reader
    parses only its own units, and a seeded shuffle buffer mixes their records. Blank lines are skipped and
    counted (`blank` in the loader state).
    """

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

    def shard_units(self, epoch: int, shard: int, num_shards: int) -> List[Tuple[int, int, int]]:
        import torch

        order = torch.randperm(len(self.units), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        return [self.units[u] for u in order[shard::num_shards]]

    def iter_keys(self, epoch: int, shard: int, num_shards: int, state: Dict[str, Any]) -> Iterator[Key]:
        units = self.shard_units(epoch, shard, num_shards)
        state.setdefault("unit", 0)  # the unit being read (index into this shard's units)
        state.setdefault("position", None)  # where that unit continues (None: at its start)
        state.setdefault("buffer", [])  # keys waiting in the shuffle buffer
        state.setdefault("popped", 0)
        state.setdefault("blank", 0)
        for key in state["buffer"]:  # a resumed buffer: read its records again
            key = tuple(key)
            if key not in self._pending:
                self._pending[key] = (self._fetch(key), self.reader.location(key))
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

    def _fetch(self, key: Key):
        try:
            return self.reader.fetch(key)
        except DataFormatError as err:
            return err

    def samples(self, key: Key) -> List[Dict[str, Any]]:
        record, where = self._pending.pop(key, None) or (self._fetch(key), self.reader.location(key))
        return self._apply(record, where)

    def samples_many(self, keys: List[Key]) -> List[List[Dict[str, Any]]]:
        items = [self._pending.pop(k, None) or (self._fetch(k), self.reader.location(k)) for k in keys]
        return self._apply_many([r for r, _ in items], [w for _, w in items])

    __iter__ = _iterate_samples


# --------------------------------------------------------------------------------------------- interleave
class InterleavedDataset(IterableDataset):
    """Draws records from several datasets with probabilities proportional to `weights`.

    `stopping_strategy="all_exhausted"` keeps drawing from the sources that still have records;
    `"first_exhausted"` ends the epoch when any source runs out.
    """

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

    __iter__ = _iterate_samples

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

    def cut_units(self, at_least: int) -> None:
        for source in self.sources:
            if hasattr(source, "cut_units"):
                source.cut_units(at_least)

    def samples(self, key: Key) -> List[Dict[str, Any]]:
        return self.sources[key[0]].samples(tuple(key[1:]))

    def samples_many(self, keys: List[Key]) -> List[List[Dict[str, Any]]]:
        out: List[Any] = [None] * len(keys)
        for s, source in enumerate(self.sources):
            idx = [i for i, k in enumerate(keys) if k[0] == s]
            if idx:
                for i, res in zip(idx, samples_many(source, [tuple(keys[i][1:]) for i in idx])):
                    out[i] = res
        return out

    @property
    def skipped(self) -> int:
        return sum(getattr(s, "skipped", 0) for s in self.sources)

    @property
    def empty(self) -> int:
        return sum(getattr(s, "empty", 0) for s in self.sources)


def samples_many(source, keys: List[Key]) -> List[List[Dict[str, Any]]]:
    """Samples of many records at once (batched transforms), for any source of the protocol."""
    if hasattr(source, "samples_many"):
        return source.samples_many(keys)
    return [source.samples(k) for k in keys]


# ----------------------------------------------------------------------------------------------- builders
@DATASET_REGISTRY.register("iterable")
def build_iterable_dataset(
    train_path: str,
    transform: Optional[Callable] = None,
    namespace: Literal["train", "test"] = "train",
    seed: int = 42,
    source_name: Optional[str] = None,
    skip_bad_samples: bool = False,
    shuffle_buffer_size: int = 1000,
    unit_bytes: Optional[int] = None,
    **kwargs,
) -> StreamingDataset:
    return StreamingDataset(
        resolve_data_files(train_path),
        transform,
        seed=seed,
        shuffle_buffer_size=shuffle_buffer_size,
        skip_bad_samples=skip_bad_samples,
        unit_bytes=unit_bytes,
    )


def load_interleave_spec(path: str) -> Dict[str, Any]:
    """A dataset.yaml, in either schema (paths relative to the yaml):
    ours      `sources: [{path, weight, name}]`, optional `stopping_strategy`;
    VeOmni's  `sources: [path, ...]`, `names: [...]`, `schedule: [{schedule_type: const, weights: [...]}]`,
              optional `stopping_strategy` (its `level`, `upstream_sharded` and `val_sources` are not used here).
    Returns ours: `{"sources": [{path, weight, name}], "stopping_strategy": ...}`."""
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    sources = spec.get("sources")
    if not isinstance(sources, list) or not sources:
        raise ValueError(f"{path}: expected a non-empty list under 'sources'")
    if all(isinstance(s, str) for s in sources):
        sources = _veomni_sources(path, spec, sources)
    base = os.path.dirname(os.path.abspath(path))
    for i, src in enumerate(sources):
        if not isinstance(src, dict) or "path" not in src:
            raise ValueError(f"{path}: sources[{i}] needs a 'path' (or list paths with VeOmni's names/schedule)")
        unknown = set(src) - {"path", "weight", "name"}
        if unknown:
            raise ValueError(f"{path}: sources[{i}] has unknown keys {sorted(unknown)}; allowed: path, weight, name")
        src["path"] = src["path"] if os.path.isabs(src["path"]) else os.path.join(base, src["path"])
    return {"sources": sources, "stopping_strategy": spec.get("stopping_strategy", "all_exhausted")}


def _veomni_sources(path: str, spec: Dict[str, Any], paths: List[str]) -> List[Dict[str, Any]]:
    names = spec.get("names") or [os.path.basename(p.rstrip("/")) for p in paths]
    schedule = spec.get("schedule") or [{"schedule_type": "const", "weights": [1.0] * len(paths)}]
    if len(names) != len(paths):
        raise ValueError(f"{path}: {len(names)} names for {len(paths)} sources")
    if len(schedule) != 1 or schedule[0].get("schedule_type") != "const":
        raise ValueError(f"{path}: only one `schedule_type: const` entry is supported, got {schedule}")
    weights = schedule[0].get("weights")
    if not isinstance(weights, list) or len(weights) != len(paths):
        raise ValueError(f"{path}: schedule weights {weights} must list one weight per source ({len(paths)})")
    if spec.get("level", "sample") != "sample":
        logger.warning(f"{path}: level={spec['level']!r} is read as per-sample weights")
    return [{"path": p, "weight": float(w), "name": n} for p, w, n in zip(paths, weights, names)]


InterleaveDataset = InterleavedDataset  # the seed's name for the family (mapping | iterable interleaves)


class InterleavedMappingDataset(InterleavedDataset):
    """Interleaved in-memory sources (the seed's name): sized, so its global batches do not depend on the world
    size."""


class InterleavedIterableDataset(InterleavedDataset):
    """Interleaved streamed sources (the seed's name)."""


IterativeDataset = StreamingDataset  # the seed's name for the streaming dataset


def build_interleave_dataset(
    train_path: str, datasets_type: str, transform: Optional[Callable] = None, seed: int = 42, **kwargs
) -> InterleavedDataset:
    spec = load_interleave_spec(train_path)
    builder = DATASET_REGISTRY.get(datasets_type)
    sources = [
        builder(train_path=s["path"], transform=transform, seed=seed + i, **kwargs)
        for i, s in enumerate(spec["sources"])
    ]
    kind = InterleavedMappingDataset if datasets_type == "mapping" else InterleavedIterableDataset
    return kind(
        sources,
        [float(s.get("weight", 1.0)) for s in spec["sources"]],
        seed=seed,
        stopping_strategy=spec["stopping_strategy"],
        names=[s.get("name", s["path"]) for s in spec["sources"]],
    )


def build_dataset(
    dataset_name: Optional[str] = None,
    transform: Optional[Callable] = None,
    seed: int = 42,
    train_path: Optional[str] = None,
    datasets_type: str = "mapping",
    **kwargs,
):
    """Build the registered dataset `dataset_name` (default: `datasets_type`); a `.yaml` train_path interleaves
    sources of that type."""
    kwargs.pop("dataloader", None)
    name = dataset_name or datasets_type
    if name in ("mapping", "iterable") and train_path is not None and train_path.endswith((".yaml", ".yml")):
        return build_interleave_dataset(train_path, name, transform=transform, seed=seed, **kwargs)
    builder = DATASET_REGISTRY.get(name)
    return builder(train_path=train_path, transform=transform, seed=seed, datasets_type=datasets_type, **kwargs)
