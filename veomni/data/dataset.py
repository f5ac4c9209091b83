"""Datasets: a registry of builders, and the three kinds (each in its own module).

- MappingDataset (mapping.py, `datasets_type: mapping`, and any user map-style dataset): sized; samples in a shared
  memory-mapped cache built once; global batches that do not depend on the world size.
- IterativeDataset (streaming.py, `datasets_type: iterable`): files read lazily through a seeded shuffle buffer,
  batched by the loader's slot streams (user iterables take that path too).
- InterleaveDataset (interleave.py; `InterleavedMappingDataset` / `InterleavedIterableDataset`): several of one kind,
  drawn by weight; a `dataset.yaml` train_path builds it.
Every dataset answers `peek(n)`: its first records and what the transform makes of them (pre-flight, preview).
"""

import os
import re
from typing import Any, Callable, Dict, List, Optional

import yaml

from ..utils.logging import get_logger
from .hub_datasets import HubIterativeDataset, hub_data
from .interleave import InterleaveDataset, InterleavedIterableDataset, InterleavedMappingDataset
from .mapping import MappingDataset
from .readers import RecordFiles, resolve_data_files
from .streaming import IterativeDataset

logger = get_logger(__name__)


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
            raise KeyError(f"unknown {self.kind} '{name}'; registered: {self.names()}")
        return self._items[name]

    def names(self):
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


DATASET_REGISTRY = Registry("dataset")


@DATASET_REGISTRY.register("mapping")
def build_mapping_dataset(
    train_path: str,
    transform: Optional[Callable] = None,
    seed: int = 42,
    source_name: Optional[str] = None,
    skip_bad_samples: bool = False,
    cache_dir: Optional[str] = None,
    shuffle: bool = True,
    **kwargs,
) -> MappingDataset:
    """Map-style data from a file, glob or folder, or a hub dataset (`hf://datasets/...`, hub_datasets.py): nothing
    is read until the first use (see mapping.py)."""
    train_path, hub, entry = hub_data(train_path, streaming=False)
    files = entry["files"] if hub else resolve_data_files(train_path)
    source_name = source_name or (hub.cache_name() if hub else os.path.basename(train_path.rstrip("/")))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", source_name) or "data"
    dataset = MappingDataset(RecordFiles(files), transform, seed, shuffle, skip_bad_samples, cache_dir, name)
    dataset.source = hub.describe() if hub else None
    return dataset


@DATASET_REGISTRY.register("iterable")
def build_iterable_dataset(
    train_path: str,
    transform: Optional[Callable] = None,
    seed: int = 42,
    skip_bad_samples: bool = False,
    shuffle_buffer_size: int = 1000,
    unit_bytes: Optional[int] = None,
    **kwargs,
) -> IterativeDataset:
    options = {"shuffle_buffer_size": shuffle_buffer_size, "skip_bad_samples": skip_bad_samples}
    train_path, hub, entry = hub_data(train_path, streaming=True)
    if hub:
        return HubIterativeDataset(hub, entry, transform, seed=seed, **options)
    return IterativeDataset(resolve_data_files(train_path), transform, seed=seed, unit_bytes=unit_bytes, **options)


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
        if unknown := set(src) - {"path", "weight", "name"}:
            raise ValueError(f"{path}: sources[{i}] has unknown keys {sorted(unknown)}; allowed: path, weight, name")
        src["path"] = src["path"] if os.path.isabs(src["path"]) else os.path.normpath(os.path.join(base, src["path"]))
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


def build_interleave_dataset(
    train_path: str, datasets_type: str, transform: Optional[Callable] = None, seed: int = 42, **kwargs
) -> InterleaveDataset:
    spec = load_interleave_spec(train_path)
    builder = DATASET_REGISTRY.get(datasets_type)
    sources = [
        builder(train_path=s["path"], transform=transform, seed=seed + i, **kwargs)
        for i, s in enumerate(spec["sources"])
    ]
    kind = InterleavedMappingDataset if datasets_type == "mapping" else InterleavedIterableDataset
    weights = [float(s.get("weight", 1.0)) for s in spec["sources"]]
    names = [s.get("name", s["path"]) for s in spec["sources"]]
    return kind(sources, weights, seed=seed, stopping_strategy=spec["stopping_strategy"], names=names)


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
