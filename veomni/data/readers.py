"""Local data files read as records, each with a small key that finds it again (for exact resume).

A key is `(file index, position)`: the byte offset of a jsonl line, or the row / item index of a parquet, arrow
or json file. `RecordFiles.fetch(key)` re-reads one record; iteration can start at any position.

For streaming, the files are cut into *units* of work that readers share out without reading each other's:
byte ranges of jsonl files (a line belongs to the range it starts in), row groups of parquet files, row ranges
of json / arrow files. A reader seeks to its units and parses only them.
"""

import bisect
import glob
import json
import os
from functools import lru_cache
from typing import Any, Dict, Iterator, List, Optional, Tuple

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
        raise FileNotFoundError(f"data.train_path does not exist: {train_path}")
    files = sorted(f for f in files if f.endswith(SUPPORTED_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no {'/'.join(SUPPORTED_SUFFIXES)} files under {train_path}")
    return files


def _parse_json_line(line: bytes, where: str) -> Dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:  # the whole reason, with the column and the text around it
        near = line[max(err.pos - 20, 0) : err.pos + 20].decode("utf-8", "replace").strip()
        raise DataFormatError(f"{where}: malformed JSON: {err.msg} at character {err.pos + 1}, near {near!r}") from None
    except UnicodeDecodeError as err:
        raise DataFormatError(f"{where}: not UTF-8 text: {err}") from None
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


@lru_cache(maxsize=4)
def _json_items(path: str) -> List[Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


def _arrow_table(path: str):
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.memory_map(path)).read_all()


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
    def iter_from(self, file_index: int = 0, position: int = 0) -> Iterator[Tuple[Key, Dict[str, Any], str, Key]]:
        """Yield `(key, record, location, next_key)`; `next_key` is where to restart after this record.

        A malformed record yields a DataFormatError in place of the record, so callers may skip it.
        """
        for fi in range(file_index, len(self.files)):
            start = position if fi == file_index else 0
            path = self.files[fi]
            if path.endswith(".jsonl"):
                yield from self._iter_jsonl(fi, path, start)
            else:
                rows = self._rows(fi)
                for row in range(start, len(rows)):
                    yield (fi, row), rows[row], f"{path}:row {row}", (fi, row + 1)

    def iter_unit(self, unit: Unit, position: Optional[int] = None):
        """The records that start inside `unit` (from `position`, a record start, when resuming), as `iter_from`."""
        fi, start, end = unit
        path = self.files[fi]
        if not path.endswith(".jsonl"):
            rows = self._rows(fi)
            for row in range(start if position is None else position, end):
                yield (fi, row), rows[row], f"{path}:row {row}", (fi, row + 1)
            return
        if position is None:
            position = start
            if start > 0:  # the line that straddles `start` belongs to the previous unit
                with open(path, "rb") as f:
                    f.seek(start - 1)
                    position = start - 1 + len(f.readline())
        yield from self._iter_jsonl(fi, path, position, end)

    def count_unit(self, unit: Unit, position: Optional[int] = None) -> int:
        """Records left in a unit from `position` (blank lines not counted), without parsing them."""
        fi, start, end = unit
        if not self.files[fi].endswith(".jsonl"):
            return end - (start if position is None else position)
        return sum(1 for key, record, _, _ in self._iter_lines(unit, position) if record is not BLANK)

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

    def _iter_lines(self, unit: Unit, position: Optional[int]):
        fi, start, end = unit
        with open(self.files[fi], "rb") as f:
            if position is None:
                position = start
                if start > 0:
                    f.seek(start - 1)
                    position = start - 1 + len(f.readline())
            f.seek(position)
            while position < end:
                line = f.readline()
                if not line:
                    return
                yield (fi, position), (BLANK if not line.strip() else line), "", (fi, position + len(line))
                position += len(line)

    def _iter_jsonl(self, fi: int, path: str, offset: int, end: Optional[int] = None):
        """The records of lines starting at `offset` up to (not including) a line starting at `end` or later."""
        with open(path, "rb") as f:
            f.seek(offset)
            lineno = None if offset else 0  # line numbers are known when reading from the start
            while end is None or offset < end:  # the line starting at `end` is the next unit's: not even parsed
                line = f.readline()
                if not line:
                    return
                here, offset = offset, offset + len(line)
                if lineno is not None:
                    lineno += 1
                if not line.strip():
                    yield (fi, here), BLANK, "", (fi, offset)
                    continue
                # mid-file (a unit of another reader, a resume) the line number is counted only if a message needs it:
                # counting it per record would re-read the file from its start for every record
                where = f"{path}:{lineno}" if lineno is not None else LineOf(path, here)
                if len(line) > BIG_RECORD_BYTES:  # minutes of tokenising with nothing else to show for it
                    logger.warning(
                        f"{where}: a record of {len(line) / 2**20:.0f} MB; transforming it takes a while",
                        extra=EVERY_RANK,
                    )
                try:
                    record = _parse_json_line(line, where)
                except DataFormatError as err:
                    record = err
                yield (fi, here), record, where, (fi, offset)

    def _rows(self, fi: int):
        if fi not in self._tables:
            path = self.files[fi]
            if path.endswith(".json"):
                self._tables[fi] = _json_items(path)
            elif path.endswith(".parquet"):
                self._tables[fi] = _ParquetRows(path)
            else:
                self._tables[fi] = _ArrowRows(path)
        return self._tables[fi]

    # ---------------------------------------------------------------------------------------- random access
    def location(self, key: Key):
        """Where a record lives, for messages: `file:line` (1-based) for jsonl, `file:row N` otherwise.

        Readers keep byte offsets, not line numbers; an error is rare, so a jsonl line is counted only when the
        location is shown (`LineOf`)."""
        path = self.files[key[0]]
        if not path.endswith(".jsonl"):
            return f"{path}:row {key[1]}"
        return LineOf(path, key[1])

    def fetch(self, key: Key) -> Dict[str, Any]:
        fi, position = key
        path = self.files[fi]
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                f.seek(position)
                return _parse_json_line(f.readline(), self.location(key))
        return self._rows(fi)[position]


class _ArrowRows:
    def __init__(self, path: str):
        self.table = _arrow_table(path)

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
        self.starts = [0]
        for n in sizes:
            self.starts.append(self.starts[-1] + n)
        self._group, self._rows = -1, []

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, row: int) -> Dict[str, Any]:
        group = bisect.bisect_right(self.starts, row) - 1
        if group != self._group:
            self._group, self._rows = group, self.file.read_row_group(group).to_pylist()
        return self._rows[row - self.starts[group]]


def read_all_records(files: List[str], skip_bad: bool = False) -> Tuple[List[Any], List[str]]:
    """Every record with its location (map-style datasets). A malformed record is an immediate error, or with
    `skip_bad` is kept as its DataFormatError, to be skipped and counted when accessed."""
    records, locations = [], []
    for _, record, where, _ in RecordFiles(files).iter_from():
        if record is BLANK:
            continue
        if isinstance(record, DataFormatError) and not skip_bad:
            raise DataFormatError(f"{record} (set data.skip_bad_samples to skip such samples)")
        records.append(record)
        locations.append(where)
    return records, locations


def _line_at(path: str, offset: int) -> int:
    """1-based number of the line that starts at byte `offset` (counted in 1 MiB blocks)."""
    newlines, left = 0, offset
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            newlines += block.count(b"\n")
            left -= len(block)
    return newlines + 1
