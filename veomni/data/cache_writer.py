"""Writing a sample cache: each build process transforms a contiguous share of the records into its own part.

A part's token fields are int32 files written in large sequential blocks, a CRC-32 computed per CHUNK_BYTES chunk
from the bytes as they are written (no read-back). A field equal to `input_ids` in every sample (pretraining's
`labels`) or constant (`attention_mask`) is only noted; it is written out when a sample breaks the rule. A sample the
files cannot hold (floats, pixels) puts the part in length mode: only record positions and sample lengths are kept.
On a rank, the build runs in one process per core it has (`VEOMNI_DATA_BUILD_PROCESSES`), forked so that the
transform and its tokenizer need not be pickled; each tokenises its records in batches.
"""

import contextlib
import ctypes
import multiprocessing
import os
import signal
import zlib
from array import array
from concurrent.futures import ProcessPoolExecutor, wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .readers import BLANK, Unit

CHUNK_BYTES = 4 << 20  # a token file is checksummed per chunk, each verified when it is first read
_FLUSH_BYTES = 16 << 20  # a field's tokens go to disk in blocks of this size
_BATCH = 512  # records per (batched) transform call
_INT32 = (-(2**31), 2**31 - 1)
_ALIAS = {"alias": "input_ids"}  # a field noted as equal to input_ids (as the manifest describes it)


def part_path(folder: str, part: str, suffix: str) -> str:
    """File `suffix` of part `part` (the layout: sample_cache.py), as the writer and the reader name it."""
    return os.path.join(folder, f"part-{part}.{suffix}")


def part_files(part: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """A part's files (suffix -> its `bytes` and `crc32` as described): its stored token fields and index arrays."""
    return {**{f"{name}.bin": how for name, how in part["fields"].items() if "stored" in how}, **part["index"]}


class _FieldFile:
    """One token field of a part: appended bytes, written in large blocks, checksummed per chunk as written."""

    def __init__(self, path: str):
        self.path, self.file, self.buffer = path, open(path, "wb"), bytearray()
        self.size, self.crc, self.in_chunk, self.crcs = 0, 0, 0, []

    def write(self, data) -> None:
        self.buffer += data
        if len(self.buffer) >= _FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        with memoryview(self.buffer) as view:
            pos = 0
            while pos < len(view):
                take = min(CHUNK_BYTES - self.in_chunk, len(view) - pos)
                self.crc = zlib.crc32(view[pos : pos + take], self.crc)
                self.in_chunk, pos = self.in_chunk + take, pos + take
                if self.in_chunk == CHUNK_BYTES:
                    self.crcs.append(self.crc)
                    self.crc = self.in_chunk = 0
            self.file.write(view)
        self.size += len(self.buffer)
        self.buffer.clear()

    def close(self) -> Dict[str, Any]:
        self.flush()
        self.file.close()
        return {"stored": True, "bytes": self.size, "crc32": self.crcs + ([self.crc] if self.in_chunk else [])}

    def discard(self) -> None:
        self.file.close()
        os.remove(self.path)


def _int32(value, n: int):
    """The bytes of an integer sequence of length `n` as int32, or None (floats, bools, nested, out of range)."""
    if hasattr(value, "numpy") and hasattr(value, "dim"):  # a tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or len(value) != n or value.dtype.kind not in "iu":
            return None
        if n and (value.min() < _INT32[0] or value.max() > _INT32[1]):
            return None
        return value.astype(np.int32).tobytes()
    if not isinstance(value, (list, tuple)) or len(value) != n or (n and type(value[0]) is not int):
        return None
    try:
        return array("i", value)
    except (TypeError, OverflowError):
        return None


class PartWriter:
    """One build process's part: appends each record's samples."""

    def __init__(self, folder: str, part: str):
        self.folder, self.part = folder, part
        self.records, self.lengths = array("q"), array("i")
        self.fields: Optional[List[str]] = None  # None until the first sample; [] in length mode
        self.kind: Dict[str, Any] = {}  # field -> _ALIAS (equal to input_ids), {"const": c}, or its _FieldFile
        self.tokens = 0

    def add(self, key: Tuple[int, int], samples: List[Dict[str, Any]]) -> None:
        self.records.extend((key[0], key[1], len(samples)))
        for sample in samples:
            ids = sample["input_ids"]
            n = len(ids)
            self.lengths.append(n)
            if self.fields != [] and not self._store(sample, ids, n):
                self._to_length_mode()
            self.tokens += n

    def _store(self, sample: Dict[str, Any], ids, n: int) -> bool:
        if self.fields is None:
            self.fields = list(sample)
        if list(sample) != self.fields:
            return False
        for name in self.fields:
            value, kind = sample[name], self.kind.get(name)
            if kind == _ALIAS and (value is ids or _same(value, ids)):
                continue
            if isinstance(kind, dict) and "const" in kind and _constant(value, n, kind["const"]):
                continue
            if not isinstance(kind, _FieldFile):
                kind = self.kind[name] = self._kind_from_now(name, value, ids, n, kind)
                if not isinstance(kind, _FieldFile):
                    continue
            data = _int32(value, n)
            if data is None:
                return False
            kind.write(data)
        return True

    def _kind_from_now(self, name: str, value, ids, n: int, before):
        """A new field, or one that stops being an alias or a constant. While no token is kept, it may be noted as
        an alias or a constant; else its file, holding what it was so far."""
        if not self.tokens and name != "input_ids":
            if value is ids or _same(value, ids):
                return _ALIAS
            if n and isinstance(value, (list, tuple)) and type(value[0]) is int and _constant(value, n, value[0]):
                return {"const": value[0]}
        field = _FieldFile(part_path(self.folder, self.part, f"{name}.bin"))
        if self.tokens and before != _ALIAS:
            field.write(np.full(self.tokens, before["const"], dtype=np.int32).tobytes())
        elif self.tokens:  # an alias of input_ids so far: a copy of its tokens so far
            source = self.kind["input_ids"]
            source.flush()
            with open(source.path, "rb") as f:
                field.write(f.read(self.tokens * 4))
        return field

    def _to_length_mode(self) -> None:
        for kind in self.kind.values():
            if isinstance(kind, _FieldFile):
                kind.discard()
        self.fields, self.kind = [], {}

    def close(self, counts: Dict[str, int]) -> Dict[str, Any]:
        """Write the index arrays; returns this part's description."""
        np.save(part_path(self.folder, self.part, "records.npy"), np.frombuffer(self.records, np.int64).reshape(-1, 3))
        np.save(part_path(self.folder, self.part, "lengths.npy"), np.frombuffer(self.lengths, dtype=np.int32))
        fields = {
            name: kind.close() if isinstance(kind, _FieldFile) else dict(kind) for name, kind in self.kind.items()
        }
        index = {s: whole_file_crc(part_path(self.folder, self.part, s)) for s in ("records.npy", "lengths.npy")}
        return {
            "part": self.part,
            "records": len(self.records) // 3,
            "samples": len(self.lengths),
            "tokens": self.tokens,
            "token_mode": self.fields != [],
            "fields": fields,
            "index": index,
            **counts,
        }


def _same(value, ids) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(ids, (list, tuple)):
        return value == ids
    try:
        return bool(np.array_equal(np.asarray(value), np.asarray(ids)))
    except (TypeError, ValueError, RuntimeError):
        return False


def _constant(value, n: int, c: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n and value.count(c) == n


def whole_file_crc(path: str) -> Dict[str, int]:
    with open(path, "rb") as f:
        data = f.read()
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


# ---------------------------------------------------------------------------------------------- building
def build_part(dataset, folder: str, part: str, units: Sequence[Unit], progress=None) -> Dict[str, Any]:
    """Transform the records of `units` (in order) into part `part` of the cache in `folder`."""
    reader, writer = dataset.reader, PartWriter(folder, part)
    skipped, empty, blank = dataset.skipped, dataset.empty, 0
    batch: List[Tuple[Tuple[int, int], Any, Any]] = []

    def flush():
        results = dataset._apply_many([r for _, r, _ in batch], [w for _, _, w in batch])
        for (key, _, _), samples in zip(batch, results):
            writer.add(key, samples)
        batch.clear()

    for unit in units:
        for key, record, where, _ in reader.iter_unit(unit):
            if record is BLANK:
                blank += 1
                continue
            batch.append((key, record, where))
            if len(batch) == _BATCH:
                flush()
        if progress is not None:
            with progress.get_lock():
                progress.value += unit[2] - unit[1]
    flush()
    return writer.close({"skipped": dataset.skipped - skipped, "empty": dataset.empty - empty, "blank": blank})


def shares(units: Sequence[Unit], n: int) -> List[List[Unit]]:
    """Contiguous runs of units, `n` of them, of about equal size (bytes of jsonl, rows of the others)."""
    total = sum(end - start for _, start, end in units) or 1
    out: List[List[Unit]] = [[] for _ in range(n)]
    done = 0
    for unit in units:
        out[min(done * n // total, n - 1)].append(unit)
        done += unit[2] - unit[1]
    return out


def build_processes(files: Sequence[str], units: Sequence[Unit]) -> int:
    """Build processes on this rank: the cores it may use (its share of the host's), at most one per unit; one for
    small data (under 8 MiB of `files`, or 20,000 records of a user's dataset, which has no files), where a fork
    costs more than it saves."""
    wanted = os.environ.get("VEOMNI_DATA_BUILD_PROCESSES")
    if wanted:
        return max(1, min(int(wanted), len(units)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_rank = cores // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    small = sum(map(os.path.getsize, files)) < 8 << 20 if files else sum(e - s for _, s, e in units) < 20_000
    return 1 if small else max(1, min(per_rank, len(units)))


def build_share(dataset, folder: str, rank: int, units: Sequence[Unit], show: bool) -> List[Dict[str, Any]]:
    """This rank's share of the records, transformed into parts `<rank>`, `<rank>-001`, ... by its build processes.
    Returns the parts' descriptions in record order; a process's failure is raised here (its own error)."""
    from tqdm import tqdm

    processes = build_processes(dataset.files, units)
    pieces = shares(units, processes)
    unit = "B" if dataset.files and dataset.files[0].endswith(".jsonl") else " rows"
    total = sum(e - s for _, s, e in units)
    bar = tqdm(total=total, unit=unit, unit_scale=True, desc="building the data cache", disable=not show, mininterval=2)
    names = [f"{rank:05d}" + (f"-{w:03d}" if w else "") for w in range(processes)]
    if processes == 1:
        with bar:
            done = [build_part(dataset, folder, names[0], pieces[0])]
            bar.update(total)
        return done
    # forked: the dataset (its transform and tokenizer) reaches the processes without being pickled
    ctx = multiprocessing.get_context("fork")
    progress = ctx.Value("q", 0)
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a process (and no warning about the fork)
    pool = ProcessPoolExecutor(processes, ctx, initializer=_start_child, initargs=(dataset, progress))
    try:
        parts = [pool.submit(_build_child, folder, name, piece) for name, piece in zip(names, pieces)]
        while wait(parts, timeout=0.2).not_done:  # every part ends, failed or not, before any error is raised
            bar.update(progress.value - bar.n)
        return [part.result() for part in parts]  # (a failed process's own error)
    finally:  # a stop signal is not held up by the building: the processes end with their part or with this one
        pool.shutdown(wait=False, cancel_futures=True)
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism
        bar.close()


_CHILD: Dict[str, Any] = {}  # a build process's dataset and progress counter, inherited through the fork


def _start_child(dataset, progress) -> None:
    """A build process outlives no killed parent (Linux's PR_SET_PDEATHSIG): nobody would publish its part, and it
    would keep holding the build folder's lock (inherited through the fork)."""
    with contextlib.suppress(OSError, AttributeError):  # (no prctl: not Linux)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    _CHILD.update(dataset=dataset, progress=progress)


def _build_child(folder: str, part: str, units) -> Dict[str, Any]:
    return build_part(_CHILD["dataset"], folder, part, units, _CHILD["progress"])
