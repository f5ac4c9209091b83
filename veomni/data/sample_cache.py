"""An on-disk, memory-mapped cache of a map-style dataset's samples: the data is transformed once, by all ranks
together (each with one build process per core, cache_writer.py), and every later run and rank maps the result.

    <cache_dir>/<name>-<key>/
        manifest.json               written last: parts, counts, checksums, the data fingerprint
        part-R.json                 rank R's part descriptions (R, R-001, ...: its build processes)
        part-P.records.npy          int64 (records, 3): file index, position in the file, samples of the record
        part-P.lengths.npy          int32 (samples,): tokens per sample (all the global batch plan reads)
        part-P.<field>.bin          int32 tokens of a field, samples back to back (token mode only)

The key covers the data files (path, size, mtime and a hash of their content, fingerprint.py), the transform (its
code and arguments), the tokenizer (its full serialisation and chat template) and the bad-sample policy: a change
to any of them builds a new cache. Records keep their file order, so record r is the r-th record of the files.

Verification follows what is read: on opening, the manifest, every file's size and the index arrays (read in full
by the batch plan) are checked, and a cache that fails is rebuilt, never used; a token file is checked chunk by
chunk (CHUNK_BYTES, CRC-32 computed while it was written) when a sample first reads that chunk, and a chunk that
fails is refused naming the file, so start-up does not grow with the cache. A build holds a lock in its
`.building-*` folder; a later open removes the build folders no live process holds (and, on shared storage, those
of another host older than `VEOMNI_HOST_TIMEOUT_MINUTES`).
"""

import atexit
import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import socket
import time
import uuid
import zlib
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..utils.collectives import host_group, on_every_rank, on_rank0, rank_and_world
from ..utils.logging import get_logger
from .cache_writer import CHUNK_BYTES, build_share, part_files, part_path, shares, whole_file_crc
from .data_transform import DataFormatError
from .fingerprint import Unfingerprintable, data_fingerprint, files_fingerprint, fingerprint

logger = get_logger(__name__)
FORMAT = 2
_HELD_LOCKS: Dict[str, int] = {}  # folder -> the lock file this process holds there (its builds, its own caches)


# ---------------------------------------------------------------------------------------------------- reading
class SampleCache:
    """A built cache, mapped read-only. Picklable by path (loader workers map the files themselves).
    `trusted`: built by this process's run, so its chunks need no check."""

    def __init__(self, folder: str, trusted: bool = False):
        self.folder, self.trusted = folder, trusted
        with open(os.path.join(folder, "manifest.json")) as f:
            self.manifest = json.load(f)
        parts = self.manifest["parts"]
        self.token_mode = self.manifest["token_mode"]
        lengths = [np.load(self._path(p, "lengths.npy")) for p in range(len(parts))]
        records = np.concatenate([np.load(self._path(p, "records.npy")) for p in range(len(parts))])  # (1+ parts)
        self.record_offsets = np.concatenate([[0], np.cumsum(records[:, 2])]).astype(np.int64)
        self.keys = records[:, :2]
        self.lengths = np.concatenate(lengths)
        self.sample_bases = np.concatenate([[0], np.cumsum([p["samples"] for p in parts])]).astype(np.int64)
        self._token_starts = [np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in lengths]
        self._tokens: Dict[Tuple[int, str], np.ndarray] = {}
        self._checked: Dict[Tuple[int, str], np.ndarray] = {}  # per token file: which chunks were verified

    def _path(self, part: int, name: str) -> str:
        return part_path(self.folder, self.manifest["parts"][part]["part"], name)

    def __reduce__(self):
        return SampleCache, (self.folder, self.trusted)

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
        fields = self.manifest["parts"][part]["fields"]  # a field stored, a constant, or an alias of another
        return {
            name: np.full(end - start, how["const"], np.int64) if "const" in how else self._read(part, name, start, end)
            for name, how in fields.items()
        }

    def _read(self, part: int, name: str, start: int, end: int) -> np.ndarray:
        """Tokens `start:end` of field `name` (of the field it is an alias of), each chunk checked on its first read."""
        fields = self.manifest["parts"][part]["fields"]
        name = fields[name].get("alias", name)
        key, crcs, per_chunk = (part, name), fields[name]["crc32"], CHUNK_BYTES // 4
        if key not in self._tokens:
            self._tokens[key] = np.memmap(self._path(part, f"{name}.bin"), dtype=np.int32, mode="r")
            self._checked[key] = np.full(len(crcs), self.trusted)
        tokens, checked = self._tokens[key], self._checked[key]
        for chunk in range(start // per_chunk, (end - 1) // per_chunk + 1 if end > start else 0):
            if not checked[chunk] and zlib.crc32(tokens[chunk * per_chunk : (chunk + 1) * per_chunk]) != crcs[chunk]:
                last = min((chunk + 1) * CHUNK_BYTES, tokens.nbytes)
                raise DataFormatError(
                    f"data cache file {self._path(part, f'{name}.bin')}: chunk {chunk} (bytes {chunk * CHUNK_BYTES}.."
                    f"{last}) does not match its checksum (changed or corrupt on disk); delete {self.folder} to "
                    "rebuild it"
                )
            checked[chunk] = True
        return tokens[start:end].astype(np.int64)

    def record_of(self, i: int) -> Tuple[int, int]:
        """(record, piece) of sample `i`."""
        record = int(np.searchsorted(self.record_offsets, i, side="right")) - 1
        return record, i - int(self.record_offsets[record])

    def epoch_samples(self, record_order: np.ndarray) -> np.ndarray:
        """The sample ids of records in `record_order`, each record's pieces in order."""
        return expand_runs(self.record_offsets[:-1][record_order], np.diff(self.record_offsets)[record_order])

    def describe(self) -> str:
        m = self.manifest
        size = sum(how["bytes"] for p in m["parts"] for how in part_files(p).values()) / 2**20
        kind = "tokens" if self.token_mode else "sample lengths (transformed on access)"
        return (
            f"{self.folder}: {m['records']:,} records, {m['samples']:,} samples, {m['tokens']:,} tokens; "
            f"{kind}, {size:.1f} MiB"
        )


def expand_runs(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`firsts[0], firsts[0] + 1, ... (counts[0] of them), firsts[1], ...` as one int64 array."""
    starts = np.repeat(firsts - np.cumsum(counts) + counts, counts)
    return (starts + np.arange(int(counts.sum()), dtype=np.int64)).astype(np.int64)


def _problem(folder: str) -> Optional[str]:
    """Why the cache in `folder` cannot be used (None if it can): what is checked on opening (the module doc)."""
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
    for part in parts:
        for suffix, how in part_files(part).items():
            full = part_path(folder, part["part"], suffix)
            if not os.path.isfile(full) or os.path.getsize(full) != how["bytes"]:
                return f"{os.path.basename(full)} is missing or of the wrong size"
            if suffix in part["index"] and whole_file_crc(full) != how:
                return f"{os.path.basename(full)} does not match its checksum (corrupt)"
    return None


# ------------------------------------------------------------------------------------------ opening, building
def open_or_build(dataset, cache_dir: Optional[str], name: str = "data") -> SampleCache:
    """The dataset's cache, built if needed by all ranks together (call on every rank alike). A dataset that cannot
    be fingerprinted (a user's own, or a transform that hides its state) gets a cache of this run's own, never
    reused, removed at exit.

    The ranks coordinate on a gloo group of their own (CPU flags work under NCCL too) whose timeout allows for a
    long build (`VEOMNI_HOST_TIMEOUT_MINUTES`); a rank that fails its share fails every rank at once."""
    cache_dir = cache_dir or os.environ.get("VEOMNI_DATA_CACHE", os.path.expanduser("~/.cache/veomni/data"))
    with host_group() as group:
        rank, world = rank_and_world()
        folder, parts = on_rank0(lambda: _key(dataset, cache_dir, name), group)
        problem = _problem(folder)
        build = not _all_ok(problem is None, group)
        if build:
            if rank == 0 and os.path.exists(folder):
                logger.warning(f"data cache {folder} is unusable ({problem}): rebuilding it")
            _build(dataset, folder, parts, rank, world, group)
            problem = _problem(folder)
            if not _all_ok(problem is None, group):
                raise DataFormatError(
                    f"data cache {folder}: unusable right after building it on rank {rank} ({problem}); "
                    "data.cache_dir must be on storage every rank sees"
                )
    cache = SampleCache(folder, trusted=build)
    if rank == 0:
        logger.info(f"data cache {'built: ' if build else ''}{cache.describe()}")
    return cache


def _all_ok(ok: bool, group) -> bool:
    """True when `ok` holds on every rank (a collective on `group`, the host group of every rank)."""
    if group is None:
        return ok
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _key(dataset, cache_dir: str, name: str) -> Tuple[str, Optional[Dict[str, str]]]:
    """Rank 0: the cache's folder and the data fingerprint (None for a cache of this run's own). Rank 0 alone reads
    the files' sampled blocks; it also sweeps the cache_dir of builds no live process holds."""
    os.makedirs(cache_dir, exist_ok=True)
    sweep(cache_dir)
    try:
        if not dataset.files:
            raise Unfingerprintable(f"a {type(dataset.reader.dataset).__name__} in memory")
        parts = data_fingerprint(dataset.files, dataset.transform, getattr(dataset, "source", None))
        key = fingerprint(FORMAT, files_fingerprint(dataset.files), sorted(parts.items()), dataset.skip_bad_samples)
        return os.path.join(cache_dir, f"{name}-{key}"), parts
    except Unfingerprintable as err:
        if dataset.files:
            logger.warning(f"the data transform cannot be fingerprinted ({err}): its cache serves this run only")
        folder = os.path.join(cache_dir, f"{name}-unshared-{uuid.uuid4().hex[:12]}")
        atexit.register(shutil.rmtree, folder, True)
        return folder, None


def _build(dataset, folder: str, parts: Optional[Dict[str, str]], rank: int, world: int, group) -> None:
    tmp = on_rank0(lambda: _start_build(folder), group)
    mine = shares(dataset.reader.units(), world)[rank]
    start, cpu = time.perf_counter(), time.process_time()
    try:
        my_share = functools.partial(build_share, dataset, tmp, rank, mine, show=rank == 0)
        metas = on_every_rank(my_share, "building its share of the data cache", group, DataFormatError)
    except BaseException:  # a bad record on some rank (or a stop): the half-built cache only takes space
        if rank == 0:  # (once every rank has stopped writing to it)
            release_lock(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    tokens = sum(m["tokens"] for m in metas)
    with open(part_path(tmp, f"{rank:05d}", "json"), "w") as f:
        json.dump(metas, f)
    logger.info(
        f"data cache share of rank {rank}: {sum(m['records'] for m in metas):,} records, {tokens:,} tokens in "
        f"{seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s; {len(metas)} build process(es), this one "
        f"{time.process_time() - cpu:.1f} CPU-s)"
    )
    _all_ok(True, group)  # every rank's description written before rank 0 reads them
    on_rank0(lambda: _publish(tmp, folder, world, parts), group)  # rank 0's failure ends every rank at once


def _publish(tmp: str, folder: str, world: int, parts_fingerprint: Optional[Dict[str, str]] = None) -> None:
    """Rank 0: the manifest from every rank's part descriptions, then the folder renamed into place (a cache of
    this run's own, `-unshared-`, keeps its lock: it is in use until the run ends)."""
    parts = []
    for rank in range(world):
        path = part_path(tmp, f"{rank:05d}", "json")
        if not os.path.isfile(path):
            raise DataFormatError(
                f"data cache {tmp}: rank {rank}'s parts are not visible to rank 0; data.cache_dir must be on storage "
                "every rank sees"
            )
        with open(path) as f:
            parts += json.load(f)
    fields = [list(p["fields"]) for p in parts if p["samples"]]
    # a part in length mode, or parts that disagree on the sample fields: keep lengths, transform on access
    token_mode = all(p["token_mode"] for p in parts if p["samples"]) and all(f == fields[0] for f in fields)
    if token_mode:  # a part without samples has no fields: give it the others', for `sample()` never reaches it
        for p in parts:
            p["fields"] = p["fields"] or {name: {"const": 0} for name in (fields[0] if fields else ["input_ids"])}
    manifest = {
        "format": FORMAT,
        "token_mode": token_mode,
        "fingerprint": parts_fingerprint,
        **{c: sum(p[c] for p in parts) for c in ("records", "samples", "tokens", "skipped", "empty", "blank")},
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "parts": parts,
    }
    with open(os.path.join(tmp, "manifest.json.tmp"), "w") as f:
        json.dump(manifest, f)
    os.replace(os.path.join(tmp, "manifest.json.tmp"), os.path.join(tmp, "manifest.json"))
    if "-unshared-" not in folder:  # a shared cache holds no lock once published
        release_lock(tmp)
    if os.path.exists(folder):
        if _problem(folder) is None:  # another job finished the same cache meanwhile (it may be reading it)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        stale = f"{folder}.stale-{uuid.uuid4().hex[:8]}"  # moved aside first: no half-deleted cache under its name
        with contextlib.suppress(OSError):
            os.replace(folder, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, folder)
    except OSError:  # another job published the same cache at this moment: theirs is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------- locks and the sweep
_LOCK = ".lock"
_SWEPT = re.compile(r"\.(building|stale)-[0-9a-f]+$|-unshared-[0-9a-f]+$")


def _start_build(folder: str) -> str:
    """Rank 0: a fresh `.building-*` folder, holding the lock that says a live process is building it (for this
    process's life, or until `release_lock`): the lock names this host and process."""
    tmp = f"{folder}.building-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    fd = os.open(os.path.join(tmp, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "created": time.time()}).encode())
    _HELD_LOCKS[tmp] = fd
    return tmp


def release_lock(folder: str) -> None:
    fd = _HELD_LOCKS.pop(folder, None)
    if fd is not None:
        os.remove(os.path.join(folder, _LOCK))
        os.close(fd)


def _in_use(folder: str) -> bool:
    """A live process holds the folder: its lock is held (this host), or it is younger than the host timeout
    (another host's, whose lock this host cannot see). A folder without a lock is in use for its first minute."""
    path = os.path.join(folder, _LOCK)
    try:
        with open(path) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        try:
            return time.time() - os.path.getmtime(folder) < 60 and ".stale-" not in folder
        except OSError:
            return False
    if owner.get("host") != socket.gethostname():
        return time.time() - owner.get("created", 0) < 60 * float(os.environ.get("VEOMNI_HOST_TIMEOUT_MINUTES", 720))
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def sweep(cache_dir: str) -> None:
    """Remove the build folders (`.building-*`), half-deleted caches (`.stale-*`) and run-own caches
    (`-unshared-*`) of `cache_dir` that no live process holds."""
    removed = [e for e in os.scandir(cache_dir) if e.is_dir() and _SWEPT.search(e.name) and not _in_use(e.path)]
    for entry in removed:
        shutil.rmtree(entry.path, ignore_errors=True)
    if removed:
        logger.info(f"data cache dir {cache_dir}: removed {len(removed)} left by builds that did not finish")
