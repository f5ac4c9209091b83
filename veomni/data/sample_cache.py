"""An on-disk, memory-mapped cache of a map-style dataset's samples: the data is transformed once, by all ranks
together, and every later run and rank maps the result read-only.

    <cache_dir>/<name>-<fingerprint>/
        manifest.json              written last: parts, counts, checksums, what was fingerprinted
        part-00000.records.npy     int64 (records, 3): file index, position in the file, samples of the record
        part-00000.lengths.npy     int32 (samples,): tokens per sample (all the global batch plan reads)
        part-00000.<field>.bin     int32 tokens of a field, samples back to back (token mode only)

The fingerprint covers the data files (path, size, mtime), the transform (its code and arguments, the tokenizer's
full serialisation and chat template) and the bad-sample policy: a change to any of them builds a new cache. Each
rank transforms a contiguous share of the files (whole jsonl byte ranges, parquet row groups) into its own part;
records keep their file order, so record r is the r-th record of the files, as if read by one process.

Token mode stores every field of every sample (`input_ids`, `labels`, ...: integer sequences as long as the
sample), a field equal to `input_ids` or constant (`attention_mask`) as a note only. Samples with anything else
(a VL sample's pixels) put the cache in length mode: only the record positions and sample lengths are kept, and
the transform runs again on access, in the loader's workers, on the record read back from its file.

A cache whose files are missing, of the wrong size, or whose checksums (verified when it is opened, each rank a
share of the files) do not match is rebuilt, never used. A partial build (a crash) never has a manifest.
"""

import atexit
import json
import os
import shutil
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..utils.checksum import file_crc32
from ..utils.collectives import host_group, on_every_rank, on_rank0
from ..utils.logging import get_logger
from .data_transform import DataFormatError
from .fingerprint import Unfingerprintable, files_fingerprint, fingerprint
from .readers import BLANK

logger = get_logger(__name__)
FORMAT = 1
_CHUNK = 512  # records per (batched) transform call while building
_INT32 = np.iinfo(np.int32)


def default_cache_dir() -> str:
    return os.environ.get("VEOMNI_DATA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "veomni", "data"))


# ------------------------------------------------------------------------------------------------ collectives
def _world() -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_ok(ok: bool, group) -> bool:
    """True when `ok` holds on every rank (a collective on `group`, the host group of every rank)."""
    import torch
    import torch.distributed as dist

    if group is None:
        return ok
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _from_rank0(value: Any, group) -> Any:
    import torch.distributed as dist

    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


# ---------------------------------------------------------------------------------------------------- writing
class _PartWriter:
    """One rank's share: appends each record's samples; token files are dropped when a sample cannot be stored."""

    def __init__(self, folder: str, part: int):
        self.prefix = os.path.join(folder, f"part-{part:05d}")
        self.records: List[Tuple[int, int, int]] = []
        self.lengths: List[int] = []
        self.fields: Optional[List[str]] = None  # None until the first sample; [] in length mode
        self.files: Dict[str, Any] = {}
        self.alias: Dict[str, bool] = {}  # field equal to input_ids in every sample so far
        self.const: Dict[str, Optional[int]] = {}  # the one value of a constant field (None: not constant)

    def add(self, key: Tuple[int, int], samples: List[Dict[str, Any]]) -> None:
        self.records.append((key[0], key[1], len(samples)))
        for sample in samples:
            ids = sample["input_ids"]
            self.lengths.append(len(ids))
            if self.fields != []:
                self._store(sample, len(ids))

    def _store(self, sample: Dict[str, Any], n: int) -> None:
        arrays = _token_arrays(sample, n)
        if arrays is None or (self.fields is not None and list(arrays) != self.fields):
            self._to_length_mode()
            return
        if self.fields is None:
            self.fields = list(arrays)
            self.files = {name: open(f"{self.prefix}.{name}.bin", "wb") for name in self.fields}
            self.alias = {name: name != "input_ids" for name in self.fields}
            self.const = {name: None if not n else int(arrays[name][0]) for name in self.fields}
        ids = arrays["input_ids"]
        for name, values in arrays.items():
            self.files[name].write(values.tobytes())
            self.alias[name] = self.alias[name] and np.array_equal(values, ids)
            c = self.const[name]
            if n and (c is None or not (values == c).all()):
                self.const[name] = None

    def _to_length_mode(self) -> None:
        for name, f in self.files.items():
            f.close()
            os.remove(f"{self.prefix}.{name}.bin")
        self.files, self.fields = {}, []

    def close(self, skipped: int, empty: int, blank: int) -> Dict[str, Any]:
        """Write the index arrays and this part's description (returned)."""
        np.save(f"{self.prefix}.records.npy", np.asarray(self.records, dtype=np.int64).reshape(-1, 3))
        np.save(f"{self.prefix}.lengths.npy", np.asarray(self.lengths, dtype=np.int32))
        fields = {}
        for name in self.fields or []:
            self.files[name].close()
            if self.alias[name] or self.const[name] is not None:
                os.remove(f"{self.prefix}.{name}.bin")
                fields[name] = {"alias": "input_ids"} if self.alias[name] else {"const": self.const[name]}
            else:
                fields[name] = {"stored": True}
        files = [f"{self.prefix}.records.npy", f"{self.prefix}.lengths.npy"]
        files += [f"{self.prefix}.{n}.bin" for n, how in fields.items() if "stored" in how]
        meta = {
            "records": len(self.records),
            "samples": len(self.lengths),
            "tokens": int(sum(self.lengths)),
            "skipped": skipped,
            "empty": empty,
            "blank": blank,
            "token_mode": self.fields != [],
            "fields": fields,
            "files": {os.path.basename(p): {"bytes": os.path.getsize(p), "crc32": file_crc32(p)} for p in files},
        }
        with open(f"{self.prefix}.json", "w") as f:
            json.dump(meta, f)
        return meta


def _token_arrays(sample: Dict[str, Any], n: int) -> Optional[Dict[str, np.ndarray]]:
    """Every field as an int32 array of the sample's length, or None when one is something else."""
    out = {}
    for name, value in sample.items():
        if not isinstance(value, (list, tuple, np.ndarray)) or len(value) != n:
            return None
        try:
            array = np.asarray(value) if n else np.zeros(0, np.int64)
        except (TypeError, ValueError, OverflowError):
            return None
        if array.dtype.kind not in "iu":  # floats (loss weights), bools, objects: kept as the transform made them
            return None
        if array.ndim != 1 or (n and (array.min() < _INT32.min or array.max() > _INT32.max)):
            return None
        out[name] = array.astype(np.int32)
    return out if "input_ids" in out else None


def _shares(units: Sequence[Tuple[int, int, int]], world: int) -> List[List[Tuple[int, int, int]]]:
    """Contiguous runs of units, one per rank, of about equal size (bytes of jsonl, rows of the others)."""
    total = sum(end - start for _, start, end in units) or 1
    shares: List[List[Tuple[int, int, int]]] = [[] for _ in range(world)]
    done = 0
    for unit in units:
        shares[min(done * world // total, world - 1)].append(unit)
        done += unit[2] - unit[1]
    return shares


def _build_part(dataset, folder: str, part: int, units, show: bool) -> Dict[str, Any]:
    from tqdm import tqdm

    reader, writer = dataset.reader, _PartWriter(folder, part)
    skipped, empty = dataset.skipped, dataset.empty
    bar = tqdm(
        total=sum(e - s for _, s, e in units), unit="B" if dataset.files and dataset.files[0].endswith(".jsonl") else " rows",
        unit_scale=True, desc="building the data cache", disable=not show, mininterval=2.0,
    )  # fmt: skip
    chunk: List[Tuple[Tuple[int, int], Any, str]] = []

    def flush():
        results = dataset._apply_many([r for _, r, _ in chunk], [w for _, _, w in chunk])
        for (key, _, _), samples in zip(chunk, results):
            writer.add(key, samples)
        chunk.clear()

    blank = 0
    for unit in units:
        for key, record, where, _ in reader.iter_unit(unit):
            if record is BLANK:
                blank += 1
                continue
            chunk.append((key, record, where))
            if len(chunk) == _CHUNK:
                flush()
        bar.update(unit[2] - unit[1])
    flush()
    bar.close()
    return writer.close(dataset.skipped - skipped, dataset.empty - empty, blank)


# ---------------------------------------------------------------------------------------------------- reading
class SampleCache:
    """A built cache, mapped read-only. Picklable by path (loader workers map the files themselves)."""

    def __init__(self, folder: str):
        self.folder = folder
        with open(os.path.join(folder, "manifest.json")) as f:
            self.manifest = json.load(f)
        self._map()

    def _map(self) -> None:
        parts = self.manifest["parts"]
        self.token_mode = self.manifest["token_mode"]
        records = [np.load(self._path(p, "records.npy"), mmap_mode="r") for p in range(len(parts))]
        lengths = [np.load(self._path(p, "lengths.npy"), mmap_mode="r") for p in range(len(parts))]
        counts = np.concatenate([r[:, 2] for r in records]) if records else np.zeros(0, np.int64)
        self.record_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.keys = np.concatenate([r[:, :2] for r in records]) if records else np.zeros((0, 2), np.int64)
        self.lengths = np.concatenate(lengths).astype(np.int32) if lengths else np.zeros(0, np.int32)
        self.sample_bases = np.concatenate([[0], np.cumsum([p["samples"] for p in parts])]).astype(np.int64)
        self._token_starts = [np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in lengths]
        self._tokens: Dict[Tuple[int, str], np.ndarray] = {}

    def _path(self, part: int, name: str) -> str:
        return os.path.join(self.folder, f"part-{part:05d}.{name}")

    def __getstate__(self):
        return {"folder": self.folder, "manifest": self.manifest}

    def __setstate__(self, state):
        self.folder, self.manifest = state["folder"], state["manifest"]
        self._map()

    @property
    def num_records(self) -> int:
        return len(self.keys)

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> Dict[str, np.ndarray]:
        """Sample `i` (token mode): every field as an int64 array."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of a data cache of {self.num_samples} samples ({self.folder})")
        part = int(np.searchsorted(self.sample_bases, i, side="right")) - 1
        j = i - int(self.sample_bases[part])
        start, end = int(self._token_starts[part][j]), int(self._token_starts[part][j + 1])
        out: Dict[str, np.ndarray] = {}
        ids = None
        for name, how in self.manifest["parts"][part]["fields"].items():
            if "stored" in how:
                out[name] = self._field(part, name)[start:end].astype(np.int64)
            elif "const" in how:
                out[name] = np.full(end - start, how["const"], dtype=np.int64)
            if name == "input_ids":
                ids = out[name]
        for name, how in self.manifest["parts"][part]["fields"].items():
            if "alias" in how:
                out[name] = ids.copy()
        return {name: out[name] for name in self.manifest["parts"][part]["fields"]}

    def _field(self, part: int, name: str) -> np.ndarray:
        if (part, name) not in self._tokens:
            self._tokens[(part, name)] = np.memmap(self._path(part, f"{name}.bin"), dtype=np.int32, mode="r")
        return self._tokens[(part, name)]

    def record_of(self, i: int) -> Tuple[int, int]:
        """(record, piece) of sample `i`."""
        record = int(np.searchsorted(self.record_offsets, i, side="right")) - 1
        return record, i - int(self.record_offsets[record])

    def epoch_samples(self, record_order: np.ndarray) -> np.ndarray:
        """The sample ids of records in `record_order`, each record's pieces in order."""
        return expand_runs(self.record_offsets[:-1][record_order], np.diff(self.record_offsets)[record_order])

    def describe(self) -> str:
        m = self.manifest
        size = sum(f["bytes"] for p in m["parts"] for f in p["files"].values()) / 2**20
        kind = "tokens" if self.token_mode else "sample lengths (transformed on access)"
        return (
            f"{self.folder}: {m['records']:,} records, {m['samples']:,} samples, {m['tokens']:,} tokens; "
            f"{kind}, {size:.1f} MiB"
        )


def expand_runs(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`firsts[0], firsts[0] + 1, ... (counts[0] of them), firsts[1], ...` as one int64 array."""
    starts = np.repeat(firsts - np.cumsum(counts) + counts, counts)
    return (starts + np.arange(int(counts.sum()), dtype=np.int64)).astype(np.int64)


def _problem(folder: str, share: Tuple[int, int]) -> Optional[str]:
    """Why the cache in `folder` cannot be used (None if it can), checking this rank's share of its files."""
    path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(path):
        return "no manifest (not built, or its build did not finish)"
    try:
        with open(path) as f:
            manifest = json.load(f)
        parts = manifest["parts"]
    except (OSError, ValueError, KeyError) as err:
        return f"unreadable manifest ({err})"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')} (this version writes {FORMAT})"
    files = sorted((name, info) for p in parts for name, info in p["files"].items())
    for k, (name, info) in enumerate(files):
        full = os.path.join(folder, name)
        if not os.path.isfile(full) or os.path.getsize(full) != info["bytes"]:
            return f"{name} is missing or of the wrong size"
        if k % share[1] == share[0] and file_crc32(full) != info["crc32"]:
            return f"{name} does not match its checksum (corrupt)"
    return None


def open_or_build(dataset, cache_dir: Optional[str], name: str = "data") -> SampleCache:
    """The dataset's cache, built if needed by all ranks together (call on every rank alike). A transform that
    cannot be fingerprinted gets a cache of this run's own, never reused, removed at exit.

    The ranks coordinate on a gloo group of their own (CPU flags work under NCCL too) whose timeout allows for a
    long build (`VEOMNI_HOST_TIMEOUT_MINUTES`); a rank that fails its share fails every rank at once."""
    with host_group() as group:
        return _open_or_build(dataset, cache_dir, name, group)


def _open_or_build(dataset, cache_dir: Optional[str], name: str, group) -> SampleCache:
    rank, world = _world()
    try:
        if not dataset.files:
            raise Unfingerprintable(f"a {type(dataset.reader.dataset).__name__} in memory")
        key = fingerprint(FORMAT, files_fingerprint(dataset.files), dataset.transform, dataset.skip_bad_samples)
    except Unfingerprintable as err:
        key = _from_rank0(f"unshared-{uuid.uuid4().hex[:12]}", group)
        if dataset.files:
            logger.warning(f"the data transform cannot be fingerprinted ({err}): its cache serves this run only")
        if rank == 0:
            atexit.register(shutil.rmtree, os.path.join(cache_dir or default_cache_dir(), f"{name}-{key}"), True)
    folder = os.path.join(cache_dir or default_cache_dir(), f"{name}-{key}")
    problem = _problem(folder, (rank, world))
    if _all_ok(problem is None, group):
        cache = SampleCache(folder)
        if rank == 0:
            logger.info(f"data cache {cache.describe()}")
        return cache
    if rank == 0 and os.path.exists(folder):
        logger.warning(f"data cache {folder} is unusable ({problem}): rebuilding it")
    _build(dataset, folder, rank, world, group)
    problem = _problem(folder, (rank, world))
    if not _all_ok(problem is None, group):
        raise DataFormatError(
            f"data cache {folder}: unusable right after building it on rank {rank} ({problem}); data.cache_dir "
            "must be on storage every rank sees"
        )
    cache = SampleCache(folder)
    if rank == 0:
        logger.info(f"data cache built: {cache.describe()}")
    return cache


def _build(dataset, folder: str, rank: int, world: int, group) -> None:
    tmp = _from_rank0(f"{folder}.building-{uuid.uuid4().hex[:8]}", group)
    on_rank0(lambda: os.makedirs(tmp), group)
    units = dataset.reader.units()
    start, cpu = time.perf_counter(), time.process_time()

    def build_share() -> Dict[str, Any]:
        return _build_part(dataset, tmp, rank, _shares(units, world)[rank], show=rank == 0)

    try:
        meta = on_every_rank(build_share, "building its share of the data cache", group, DataFormatError)
    except BaseException:  # a bad record on some rank (or a stop): the half-built cache only takes space
        if rank == 0:  # (once every rank has stopped writing to it)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    meta.update(
        seconds=round(seconds, 3), cpu_seconds=round(time.process_time() - cpu, 3)
    )  # (the tokenizer's threads too)
    with open(os.path.join(tmp, f"part-{rank:05d}.json"), "w") as f:
        json.dump(meta, f)
    logger.info(
        f"data cache part {rank}: {meta['records']:,} records, {meta['tokens']:,} tokens in {seconds:.1f} s "
        f"({meta['tokens'] / max(seconds, 1e-9):,.0f} tokens/s)"
    )
    _all_ok(True, group)  # every part's description written before rank 0 reads them
    error = on_rank0(lambda: _publish(tmp, folder, world), group)  # rank 0's failure ends every rank at once
    if error:
        raise DataFormatError(error)


def _publish(tmp: str, folder: str, world: int) -> Optional[str]:
    """Rank 0: the manifest from every part's description, then the folder renamed into place."""
    parts = []
    for part in range(world):
        path = os.path.join(tmp, f"part-{part:05d}.json")
        if not os.path.isfile(path):
            return (
                f"data cache {tmp}: rank {part}'s part is not visible to rank 0; data.cache_dir must be on storage "
                "every rank sees"
            )
        with open(path) as f:
            parts.append(json.load(f))
    token_mode = all(p["token_mode"] or p["samples"] == 0 for p in parts)
    fields = [list(p["fields"]) for p in parts if p["samples"]]
    if token_mode and any(f != fields[0] for f in fields):
        token_mode = False  # parts disagree on the sample fields: keep lengths, transform on access
    if token_mode:  # a part without samples has no fields: give it the others', for `sample()` never reaches it
        for p in parts:
            p["fields"] = p["fields"] or {name: {"const": 0} for name in (fields[0] if fields else ["input_ids"])}
    manifest = {
        "format": FORMAT,
        "token_mode": token_mode,
        "records": sum(p["records"] for p in parts),
        "samples": sum(p["samples"] for p in parts),
        "tokens": sum(p["tokens"] for p in parts),
        "skipped": sum(p["skipped"] for p in parts),
        "empty": sum(p["empty"] for p in parts),
        "blank": sum(p.get("blank", 0) for p in parts),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "parts": parts,
    }
    with open(os.path.join(tmp, "manifest.json.tmp"), "w") as f:
        json.dump(manifest, f)
    os.replace(os.path.join(tmp, "manifest.json.tmp"), os.path.join(tmp, "manifest.json"))
    if os.path.exists(folder):
        if _problem(folder, (0, 1)) is None:  # another job finished the same cache meanwhile (it may be reading it)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        stale = f"{folder}.stale-{uuid.uuid4().hex[:8]}"  # moved aside first: no half-deleted cache under its name
        try:
            os.replace(folder, stale)
        except OSError:
            pass
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, folder)
    except OSError:  # another job published the same cache at this moment: theirs is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return None
