"""Local data files read as records, each with a small key that finds it again (for exact resume).

A key is `(file index, position)`: the byte offset of a jsonl line, or the row / item index of a parquet, arrow
or json file. `RecordFiles.fetch(key)` re-reads one record; iteration can start at any position.

For streaming, the files are cut into *units* of work that readers share out without reading each other's:
byte ranges of jsonl files (a line belongs to the range it starts in), row groups of parquet files, row ranges
of json / arrow files. A reader seeks to its units and parses only them.
"""

import bisect
import glob
import itertools
import json
import os
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

from ..utils.demo_assets import missing_asset_hint
from ..utils.logging import EVERY_RANK, get_logger
from .data_transform import DataFormatError

logger = get_logger(__name__)
BIG_RECORD_BYTES = 8 << 20  # a record this large is said in the log when it is read

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
Key = Tuple[int, int]
Unit = Tuple[int, int, int]  # (file index, start, end): bytes of a jsonl file, rows of the others
BLANK = object()  # yielded for a blank jsonl line, so that readers count what they skip


def resolve_data_files(train_path: str) -> List[str]:
    """A file, a glob, or a folder (every supported file below it), sorted for a stable order."""
    if train_path is None:
        raise ValueError("data.train_path is not set")
    if os.path.isdir(train_path):
        files = [os.path.join(root, f) for root, _, names in os.walk(train_path) for f in names]
    elif any(c in train_path for c in "*?["):
        files = glob.glob(train_path, recursive=True)
    elif os.path.isfile(train_path):
        if not train_path.endswith(SUPPORTED_SUFFIXES):
            raise ValueError(f"{train_path}: unsupported file type; expected one of {SUPPORTED_SUFFIXES}")
        return [train_path]
    else:
        raise FileNotFoundError(f"data.train_path does not exist: {train_path}{missing_asset_hint(train_path)}")
    files = sorted(f for f in files if f.endswith(SUPPORTED_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no {'/'.join(SUPPORTED_SUFFIXES)} files under {train_path}")
    return files


def _parse_json_line(line: bytes, where) -> Any:
    """The record of a jsonl line, or its DataFormatError (so callers may skip it)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:  # the whole reason, with the column and the text around it
        near = line[max(err.pos - 20, 0) : err.pos + 20].decode("utf-8", "replace").strip()
        return DataFormatError(f"{where}: malformed JSON: {err.msg} at character {err.pos + 1}, near {near!r}")
    except UnicodeDecodeError as err:
        return DataFormatError(f"{where}: not UTF-8 text: {err}")
    if not isinstance(record, dict):
        return DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


@lru_cache(maxsize=4)
def _json_items(path: str) -> List[Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


class LineOf:
    """`file:line` of the record at byte `offset` of a jsonl file, as text; the line is counted when first shown."""

    __slots__ = ("path", "offset", "_text")

    def __init__(self, path: str, offset: int):
        self.path, self.offset, self._text = path, offset, None

    def __str__(self) -> str:
        if self._text is None:
            try:
                self._text = f"{self.path}:{_line_at(self.path, self.offset)}"
            except OSError:
                self._text = f"{self.path}@byte {self.offset}"
        return self._text

    __repr__ = __str__


class RecordFiles:
    """Sequential and random access to the records of a list of files."""

    def __init__(self, files: List[str]):
        self.files = files
        self._tables: Dict[int, Any] = {}

    # ---------------------------------------------------------------------------------------- iteration
    def iter_unit(self, unit: Unit, position: Optional[int] = None, parse: bool = True):
        """Yield `(key, record, location, next_key)` for the records that start inside `unit` (from `position`, a
        record start, when resuming); `next_key` is where to restart after this record. A malformed record yields
        a DataFormatError in place of the record, so callers may skip it; a blank line yields BLANK. With
        `parse=False` a jsonl record is its raw line (counting)."""
        fi, start, end = unit
        path = self.files[fi]
        if not path.endswith(".jsonl"):
            rows = self._rows(fi)
            for row in range(start if position is None else position, end):
                yield (fi, row), rows[row], f"{path}:row {row}", (fi, row + 1)
            return
        with open(path, "rb") as f:
            if position is None:  # the line that straddles `start` belongs to the previous unit
                f.seek(max(start - 1, 0))
                position = start - 1 + len(f.readline()) if start > 0 else 0
            f.seek(position)
            while position < end:  # the line starting at `end` is the next unit's: not even parsed
                line = f.readline()
                if not line:
                    return
                here, position = position, position + len(line)
                if not line.strip():
                    yield (fi, here), BLANK, "", (fi, position)
                elif not parse:
                    yield (fi, here), line, "", (fi, position)
                else:  # the line number is counted only if a message needs it (`LineOf`)
                    where = LineOf(path, here)
                    if len(line) > BIG_RECORD_BYTES:  # minutes of tokenising with nothing else to show for it
                        logger.warning(
                            f"{where}: a record of {len(line) / 2**20:.0f} MB; transforming it takes a while",
                            extra=EVERY_RANK,
                        )
                    yield (fi, here), _parse_json_line(line, where), where, (fi, position)

    def count_unit(self, unit: Unit, position: Optional[int] = None) -> int:
        """Records left in a unit from `position` (blank lines not counted), without parsing them."""
        fi, start, end = unit
        if not self.files[fi].endswith(".jsonl"):
            return end - (start if position is None else position)
        return sum(1 for _, record, _, _ in self.iter_unit(unit, position, parse=False) if record is not BLANK)

    def units(self, unit_bytes: Optional[int] = None, unit_rows: int = 50_000) -> List[Unit]:
        """The files cut into units of work (in file order). `unit_bytes` defaults to 1/256 of the jsonl data,
        clamped to [4 KiB, 64 MiB]: enough units to share among many readers, few enough to keep seeks rare."""
        sizes = {fi: os.path.getsize(p) for fi, p in enumerate(self.files) if p.endswith(".jsonl")}
        if unit_bytes is None:
            unit_bytes = min(max(sum(sizes.values()) // 256, 4 << 10), 64 << 20)
        units: List[Unit] = []
        for fi, path in enumerate(self.files):
            if path.endswith(".jsonl"):
                units += [(fi, a, min(a + unit_bytes, sizes[fi])) for a in range(0, sizes[fi], unit_bytes)]
            elif path.endswith(".parquet"):
                starts = self._rows(fi).starts
                units += [(fi, a, b) for a, b in zip(starts[:-1], starts[1:])]
            else:
                n = len(self._rows(fi))
                units += [(fi, a, min(a + unit_rows, n)) for a in range(0, n, unit_rows)]
        return units

    def first(self, n: int) -> List[Tuple[Any, Any]]:
        """The first `n` records (blank lines left out) with their locations, read from the files' start."""
        records = (
            (record, where)
            for fi, path in enumerate(self.files)
            for _, record, where, _ in self.iter_unit(
                (fi, 0, os.path.getsize(path) if path.endswith(".jsonl") else len(self._rows(fi)))
            )
            if record is not BLANK
        )
        return list(itertools.islice(records, n))

    def _rows(self, fi: int):
        if fi not in self._tables:
            path = self.files[fi]
            read = {".json": _json_items, ".parquet": _ParquetRows, ".arrow": _ArrowRows}[os.path.splitext(path)[1]]
            self._tables[fi] = read(path)
        return self._tables[fi]

    # ---------------------------------------------------------------------------------------- random access
    def location(self, key: Key):
        """Where a record lives, for messages: `file:line` (1-based; readers keep byte offsets, and an error is rare,
        so the line is counted only when shown: `LineOf`) for jsonl, `file:row N` otherwise."""
        path = self.files[key[0]]
        if not path.endswith(".jsonl"):
            return f"{path}:row {key[1]}"
        return LineOf(path, key[1])

    def fetch(self, key: Key) -> Any:
        """The record at `key`, or its DataFormatError (as iteration gives it)."""
        fi, position = key
        path = self.files[fi]
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                f.seek(position)
                return _parse_json_line(f.readline(), self.location(key))
        return self._rows(fi)[position]


class RecordList:
    """A user's map-style dataset (`len` and `[i]`) read as RecordFiles reads files: key `(0, i)` is `dataset[i]`,
    units are runs of indices (so ranks share a cache build the same way)."""

    files: List[str] = []  # nothing on disk to fingerprint: its cache serves one run

    def __init__(self, dataset, unit_rows: int = 4096):
        self.dataset, self.unit_rows = dataset, unit_rows

    def units(self, unit_bytes: Optional[int] = None) -> List[Unit]:
        n = len(self.dataset)
        return [(0, a, min(a + self.unit_rows, n)) for a in range(0, n, self.unit_rows)]

    def iter_unit(self, unit: Unit, position: Optional[int] = None):
        for i in range(unit[1] if position is None else position, unit[2]):
            yield (0, i), self.dataset[i], self.location((0, i)), (0, i + 1)

    def first(self, n: int) -> List[Tuple[Any, Any]]:
        return [(self.dataset[i], self.location((0, i))) for i in range(min(n, len(self.dataset)))]

    def location(self, key: Key) -> str:
        return f"{type(self.dataset).__name__}[{key[1]}]"

    def fetch(self, key: Key) -> Any:
        return self.dataset[key[1]]


class _ArrowRows:
    def __init__(self, path: str):
        import pyarrow as pa

        try:  # the file format, else the stream format
            self.table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        except pa.ArrowInvalid:
            self.table = pa.ipc.open_stream(pa.memory_map(path)).read_all()

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, row: int) -> Dict[str, Any]:
        return self.table.slice(row, 1).to_pylist()[0]


class _ParquetRows:
    """Row access by row group: one group decoded at a time, so memory stays at one group."""

    def __init__(self, path: str):
        import pyarrow.parquet as pq

        self.file = pq.ParquetFile(path)
        sizes = [self.file.metadata.row_group(i).num_rows for i in range(self.file.num_row_groups)]
        self.starts = [0, *itertools.accumulate(sizes)]
        self._group, self._rows = -1, []

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, row: int) -> Dict[str, Any]:
        group = bisect.bisect_right(self.starts, row) - 1
        if group != self._group:
            self._group, self._rows = group, self.file.read_row_group(group).to_pylist()
        return self._rows[row - self.starts[group]]


def _line_at(path: str, offset: int) -> int:
    """1-based number of the line that starts at byte `offset` (counted in 1 MiB blocks)."""
    newlines = 0
    with open(path, "rb") as f:
        for done in range(0, offset, 1 << 20):
            newlines += f.read(min(offset - done, 1 << 20)).count(b"\n")
    return newlines + 1
