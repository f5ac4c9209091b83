"""Datasets: a registry of builders (users add their own) and the local-file readers behind them."""

import glob
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Tuple

from torch.utils.data import Dataset

from .data_transform import DataFormatError

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


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


# ------------------------------------------------------------------------------------------- file reading
def resolve_data_files(train_path: str) -> List[str]:
    """A file, a glob, or a folder (every supported file below it), sorted for a stable order."""
    if train_path is None:
        raise ValueError("data.train_path is not set")
    if os.path.isdir(train_path):
        files = [os.path.join(root, f) for root, _, names in os.walk(train_path) for f in names]
    elif any(c in train_path for c in "*?["):
        files = glob.glob(train_path, recursive=True)
    elif os.path.isfile(train_path):
        return [train_path]
    else:
        raise FileNotFoundError(f"data.train_path does not exist: {train_path}")
    files = sorted(f for f in files if f.endswith(SUPPORTED_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no {'/'.join(SUPPORTED_SUFFIXES)} files under {train_path}")
    return files


def iter_records(path: str) -> Iterator[Tuple[Dict[str, Any], str]]:
    """Yield `(record, location)` where location is `file:line` (jsonl) or `file:row N` (tables)."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataFormatError(f"{path}:{lineno}: malformed JSON ({err.msg})") from None
                if not isinstance(record, dict):
                    raise DataFormatError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
                yield record, f"{path}:{lineno}"
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for i, record in enumerate(data if isinstance(data, list) else [data]):
            yield record, f"{path}:item {i}"
    else:
        yield from _iter_table(path)


def _iter_table(path: str) -> Iterator[Tuple[Dict[str, Any], str]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    if path.endswith(".parquet"):
        batches = pq.ParquetFile(path).iter_batches()
    else:
        with pa.memory_map(path) as source:
            try:
                batches = pa.ipc.open_file(source).to_batches()
            except pa.ArrowInvalid:
                batches = pa.ipc.open_stream(source).read_all().to_batches()
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield record, f"{path}:row {row}"
            row += 1


# ------------------------------------------------------------------------------------------------ datasets
class MappingDataset(Dataset):
    """All records in memory; `transform` runs on access and may return several samples for one record."""

    def __init__(self, records: List[Dict[str, Any]], locations: List[str], transform: Optional[Callable] = None):
        self.records, self.locations, self.transform = records, locations, transform

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        record = self.records[index]
        if self.transform is None:
            return record
        try:
            return self.transform(record)
        except DataFormatError as err:
            raise DataFormatError(f"{self.locations[index]}: {err}") from None


@DATASET_REGISTRY.register("mapping")
def build_mapping_dataset(
    train_path: str,
    transform: Optional[Callable] = None,
    namespace: Literal["train", "test"] = "train",
    seed: int = 42,
    source_name: Optional[str] = None,
    **kwargs,
) -> MappingDataset:
    records, locations = [], []
    for path in resolve_data_files(train_path):
        for record, location in iter_records(path):
            records.append(record)
            locations.append(location)
    if not records:
        raise ValueError(f"no records in {train_path}")
    return MappingDataset(records, locations, transform)


def build_dataset(
    dataset_name: Optional[str] = None,
    transform: Optional[Callable] = None,
    seed: int = 42,
    train_path: Optional[str] = None,
    datasets_type: str = "mapping",
    **kwargs,
):
    """Build the registered dataset `dataset_name` (default: the builder for `datasets_type`)."""
    builder = DATASET_REGISTRY.get(dataset_name or datasets_type)
    return builder(train_path=train_path, transform=transform, seed=seed, datasets_type=datasets_type, **kwargs)
