"""Hub datasets through the `datasets` library: `data.train_path: hf://datasets/org/name[@rev][/config][:split]`.

`load_dataset` resolves the config (the repo card's `configs:`, else `default`) and the split (its data files) as
the hub defines them. The revision is resolved once (to a commit, by local rank 0 of each node, veomni.utils.hub)
and every rank reads that commit. With `HF_HUB_OFFLINE=1` the repo's snapshot in the huggingface_hub cache
(`datasets--org--name/snapshots/<commit>`, found through `refs/<rev>`) is given to `load_dataset` as a folder: the
same configs and split patterns, nothing downloaded (`load_dataset(name)` itself reads only its own prepared cache
offline).

- map-style (`datasets_type: mapping`, and eval data): local rank 0 of each node runs `load_dataset`, which prepares
  the split as arrow files in the `datasets` cache (`HF_DATASETS_CACHE`); every rank then reads those files as it
  reads local arrow files, into our memory-mapped sample cache.
- streaming (`datasets_type: iterable`): `load_dataset(..., streaming=True)` on every rank, nothing prepared. Its
  shards (files; parquet row groups through `reshard()` when there are too few files) are the units the epoch deals
  to the sub-streams (streaming.py), so each rank reads only its own shards.

The data fingerprint records the name, commit, config and split (`source`). `datasets` is imported only here, when
such a path is used (`pip install veomni[hub]`).
"""

import os
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from ..utils import hub
from ..utils.hub import HubData  # the reference and its grammar live with the hub names
from .streaming import IterativeDataset


def _datasets():
    try:
        import datasets
    except ImportError:
        raise hub.HubNameError(
            "hf://datasets/...[:split] paths are read with the `datasets` library: pip install 'veomni[hub]'"
        ) from None
    datasets.disable_progress_bars()
    return datasets


def _source(ref: HubData, key: str, path: str) -> Tuple[HubData, str, Optional[str]]:
    """(ref pinned to its commit, what load_dataset reads, the revision to give it). Offline the snapshot folder in
    the hub cache; online the repo id at the commit the hub names for `ref.revision`."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        if hub.offline():
            folder = huggingface_hub.snapshot_download(ref.repo, revision=ref.revision, repo_type="dataset")
            return replace(ref, revision=os.path.basename(folder)), folder, None
        commit = huggingface_hub.HfApi().dataset_info(ref.repo, revision=ref.revision).sha
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        raise hub.HubNameError(hub.explain(key, path, err)) from None
    return replace(ref, revision=commit), ref.repo, commit


def _check_config_and_split(ref: HubData, source: str, revision: Optional[str], key: str, path: str) -> None:
    """One line naming the key and the configs / splits the repo has when `ref` asks for another."""
    datasets = _datasets()
    try:
        builder = datasets.load_dataset_builder(source, ref.config, revision=revision)
    except ValueError as err:
        if ref.config is None or "BuilderConfig" not in str(err):
            raise hub.HubNameError(f"{key}: {path}: {hub.first_line(err)}") from None
        configs = datasets.get_dataset_config_names(source, revision=revision)
        raise hub.HubNameError(
            f"{key}: {path}: {ref.repo} has no config (nor file or folder) '{ref.config}'; its configs: {configs}"
        ) from None
    splits = list(builder.config.data_files or builder.info.splits or [])
    if ref.split not in splits:
        raise hub.HubNameError(
            f"{key}: {path}: {ref.repo} (config {builder.config.name}) has no split '{ref.split}'; its splits: {splits}"
        )


def prepare_split(ref: HubData, key: str, path: str, data) -> str:
    """Local rank 0's part (utils.hub's `prepare_dataset`): pin the revision, check the config and split, and
    (map-style; `data` is "iterable" for a streamed split) let `load_dataset` prepare the split's arrow files.
    Registers what the ranks need under the pinned path, which it returns."""
    pinned, source, revision = _source(ref, key, path)
    _check_config_and_split(pinned, source, revision, key, path)
    files = None
    if data != "iterable":
        try:
            split = _datasets().load_dataset(source, pinned.config, split=pinned.split, revision=revision)
        except Exception as err:  # noqa: BLE001 - any failure of the preparation, said in one line
            raise hub.HubNameError(f"{key}: {path}: load_dataset failed: {hub.first_line(err)}") from None
        files = [f["filename"] for f in split.cache_files]
        if not files:
            raise hub.HubNameError(f"{key}: {path}: load_dataset gave an in-memory split (no arrow files to map)")
    hub.data_entries[pinned.path()] = {"source": source, "revision": revision, "files": files}
    return pinned.path()


def hub_data(path: str, key: str = "data.train_path", streaming: bool = False):
    """(local path, None, None) for an `hf://datasets/...` path of the repo's files, or (pinned path, HubData,
    {"source", "revision", "files"}) for one read through `datasets`; any other path as it is, (path, None, None).
    A path the trainer's pre-flight did not resolve (the library used on its own, one process) is resolved here."""
    if not isinstance(path, str) or not path.startswith(hub.DATA_PREFIX):
        return path, None, None
    pinned = (
        path if path in hub.data_entries else hub.download(path, key, "iterable" if streaming else True, prepare_split)
    )
    ref = hub.dataset_reference(pinned)
    if ref is None:
        return pinned, None, None
    if not streaming and hub.data_entries[pinned]["files"] is None:  # resolved for streaming, read map-style
        pinned = prepare_split(ref, key, path, data=True)
    return pinned, ref, hub.data_entries[pinned]


# --------------------------------------------------------------------------------------------------- streaming
class HubStreamRecords:
    """RecordFiles' reading interface over a `datasets` streaming split. A unit is `(shard, piece, pieces)`: the
    records of shard `shard` whose index in it is `piece` mod `pieces` (pieces > 1 only when the split has fewer
    shards than the sub-streams want); a key is `(shard, index in the shard)`."""

    files: List[str] = []  # nothing local: the fingerprint's `source` names the data

    def __init__(self, ref: HubData, entry: Dict[str, Any]):
        self.ref = ref
        self.dataset = _datasets().load_dataset(
            entry["source"], ref.config, split=ref.split, revision=entry["revision"], streaming=True
        )

    def units(self) -> List[Tuple[int, int, int]]:
        return [(s, 0, 1) for s in range(self.dataset.num_shards)]

    def _shard(self, shard: int, start: int = 0):
        stream = self.dataset.shard(num_shards=self.dataset.num_shards, index=shard)
        return stream.skip(start) if start else stream

    def iter_unit(self, unit, position: Optional[int] = None):
        shard, piece, pieces = unit
        start = position or 0
        for i, record in enumerate(self._shard(shard, start), start):
            if i % pieces == piece:
                yield (shard, i), record, self.location((shard, i)), (shard, i + 1)

    def count_unit(self, unit, position: Optional[int] = None) -> int:
        return sum(1 for _ in self.iter_unit(unit, position))

    def first(self, n: int) -> List[Tuple[Any, str]]:
        return [(r, self.location((0, i))) for i, r in enumerate(self.dataset.take(n))]

    def location(self, key) -> str:
        return f"{self.ref.path()} shard {key[0]} row {key[1]}"

    def fetch(self, key) -> Dict[str, Any]:
        return next(iter(self._shard(key[0], key[1])))

    def fetch_many(self, keys) -> Dict[Tuple[int, int], Dict[str, Any]]:
        """Records of many keys, each shard read once up to its last key (a resumed shuffle buffer)."""
        found, by_shard = {}, {}
        for shard, row in keys:
            by_shard.setdefault(shard, set()).add(row)
        for shard, rows in by_shard.items():
            first = min(rows)
            for i, record in enumerate(self._shard(shard, first).take(max(rows) - first + 1), first):
                if i in rows:
                    found[(shard, i)] = record
        return found


class HubIterativeDataset(IterativeDataset):
    """IterativeDataset (seeded units per sub-stream, shuffle buffer, exact resume) over a `datasets` stream."""

    def __init__(self, ref: HubData, entry: Dict[str, Any], transform=None, seed: int = 42, **kwargs):
        super().__init__([], transform, seed=seed, **kwargs)
        self.reader, self.source = HubStreamRecords(ref, entry), ref.describe()
        self.units = self.reader.units()

    def cut_units(self, at_least: int) -> None:
        """Row groups as shards when there are too few files, then each shard read by several sub-streams at a
        stride when there are still too few (each such reader decodes the whole shard)."""
        if len(self.units) >= at_least:
            return
        self.reader.dataset = self.reader.dataset.reshard()  # a shard per parquet row group, where the format allows
        self.units = self.reader.units()
        if self.units and len(self.units) < at_least:
            pieces = -(-at_least // len(self.units))
            self.units = [(s, p, pieces) for s, _, _ in self.units for p in range(pieces)]
