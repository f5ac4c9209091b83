"""A checkpoint that is damaged, or that belongs to another run, is refused before it is loaded.

- Checksums: every file of a checkpoint gets a CRC-32 in `checksums.json`, computed from the bytes as they are
  written (DCP's files through a file system that checksums its streams; for an async save that is DCP's writing
  thread, not the training one), and read back only for the few small files other code writes (configs). meta.json
  records that the checkpoint has them, so a missing or malformed `checksums.json` is refused, not skipped. A resume
  verifies them (the ranks share the reading), so a flipped block of the right length is caught, named, and the
  previous good checkpoint offered (DCP itself checks only that each file is long enough).
- Fit: the checkpoint's tensor names and shapes (its DCP metadata) are compared with what this run would load into;
  another model or optimizer is refused in one line naming the difference, with the two ways out that work.
"""

import contextlib
import json
import os
import zlib
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from ..utils.collectives import on_every_rank, on_rank0, rank_and_world
from ..utils.hub import first_line
from ..utils.logging import get_logger

logger = get_logger(__name__)
CHECKSUMS = "checksums.json"


class ChecksumsError(ValueError):
    """`checksums.json` missing from a checkpoint written with it or unreadable, or a file that does not match it:
    the message names the file."""


class _ChecksummedStream:
    """A file being written, its CRC-32 updated with every write (the rest is the file's own)."""

    def __init__(self, stream):
        self._stream, self.crc = stream, 0

    def write(self, data) -> int:
        written = self._stream.write(data)
        self.crc = zlib.crc32(data, self.crc)
        return written

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording `crcs[path relative to root]` of each file it writes, as it writes it."""

    def __init__(self, root: str, crcs: Dict[str, int]):
        super().__init__()
        self.root, self.crcs = root, crcs

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            checksummed = _ChecksummedStream(stream)
            yield checksummed
        self.crcs[os.path.relpath(path, self.root)] = checksummed.crc

    def rename(self, path, new_path) -> None:  # DCP writes `.metadata.tmp`, then renames it
        super().rename(path, new_path)
        crc = self.crcs.pop(os.path.relpath(path, self.root), None)
        if crc is not None:
            self.crcs[os.path.relpath(new_path, self.root)] = crc


def checksumming_writer(folder: str, root: str, crcs: Dict[str, int]) -> FileSystemWriter:
    """DCP's FileSystemWriter for `folder` whose files' CRC-32s land in `crcs` (relative to `root`) as written.
    DCP writes through the writer's `fs` (FileSystem.create_stream); tests/test_checkpoint_integrity.py checks that
    it still does, so a torch that stops would fail there, not record nothing."""
    writer = FileSystemWriter(folder)
    writer.fs = ChecksummingFileSystem(root, crcs)
    return writer


def file_crc32(path: str) -> int:
    """CRC-32 of a file, read in 4 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


def _files(folder: str) -> List[str]:
    found = []
    for dirpath, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(dirpath, n), folder) for n in names]
    return sorted(f for f in found if f not in (CHECKSUMS, "meta.json") and not f.endswith(".part"))


def _gather(value: Any) -> List[Any]:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _shared(fn: Callable[[], Any], what: str) -> List[Any]:
    """Every rank's `fn()`; a failure on one rank (an unreadable file) is raised on all, not left in the gather."""
    return _gather(on_every_rank(fn, what, error_type=OSError))


def shared_crcs(folder: str, names: List[str]) -> Dict[str, int]:
    """Collective: the CRC-32 of each file (relative to `folder`), the ranks sharing the reading."""
    rank, world = rank_and_world()
    mine = lambda: {name: file_crc32(os.path.join(folder, name)) for name in names[rank::world]}  # noqa: E731
    return {k: v for part in _shared(mine, f"checksumming files of {folder}") for k, v in part.items()}


def write_checksums(folder: str, written: Optional[Dict[str, int]] = None) -> None:
    """Collective: `checksums.json` beside the checkpoint, from each rank's `written` CRCs (computed as the files
    were written); files no rank wrote itself (configs other code wrote) are read, the ranks sharing the reading."""
    known = {k: v for part in _gather(written or {}) for k, v in part.items()}
    names = on_rank0(lambda: _files(folder))
    merged = dict(known, **shared_crcs(folder, [n for n in names if n not in known]))

    def write():
        with open(os.path.join(folder, CHECKSUMS), "w") as f:
            json.dump({n: merged[n] for n in names}, f, indent=0, sort_keys=True)

    on_rank0(write)


def _expected(folder: str, required: bool) -> Optional[Dict[str, int]]:
    path = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(path):
        if required:
            raise ChecksumsError(f"{path} is missing (its meta.json says it was written with checksums)")
        logger.warning(f"{folder} has no {CHECKSUMS} (written by an earlier version): its files are not verified")
        return None
    try:
        with open(path) as f:
            expected = json.load(f)
        root = os.path.normpath(os.path.abspath(folder))
        for name, crc in expected.items():  # names inside the checkpoint only, CRCs as written
            inside = os.path.normpath(os.path.join(root, name)).startswith(root + os.sep) and not os.path.isabs(name)
            if not inside or not isinstance(crc, int):
                raise ValueError(f"entry {name!r}: {crc!r} is not a file of this checkpoint and its CRC-32")
    except (ValueError, AttributeError, UnicodeDecodeError) as err:
        raise ChecksumsError(f"{path} is malformed ({first_line(err)})") from err
    return expected


def verify_checksums(folder: str, required: bool = False) -> None:
    """Collective: raise ChecksumsError (the same on every rank) naming the first file whose checksum does not
    match; a checkpoint without checksums (written by an earlier version) is not verified. `required` (its meta.json
    says it has them): a missing or malformed `checksums.json` raises too."""
    expected = _expected(folder, required)
    if expected is None:
        return
    crcs = shared_crcs(folder, [name for name in sorted(expected) if os.path.isfile(os.path.join(folder, name))])
    damaged = [name for name in sorted(expected) if crcs.get(name) != expected[name]]  # a missing file too
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise ChecksumsError(f"{os.path.join(folder, damaged[0])} does not match its checksum{more}")


def flat_dict(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """The leaves of nested dicts under their keys joined by '.' (DCP's flattened names, a config's dotted keys)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat_dict(value, f"{prefix}{key}."))
    return out


def misfit(state: Dict[str, Any], saved: Dict[str, Any]) -> Optional[str]:
    """Why `saved` (DCP metadata's state_dict_metadata) cannot fill `state`, in words, or None if it can."""
    ours = {k: tuple(v.shape) for k, v in flat_dict(state).items() if isinstance(v, torch.Tensor)}  # global shapes
    missing = [k for k in ours if k not in saved]
    shapes = [
        (k, tuple(saved[k].size), ours[k])
        for k in ours
        if k in saved and hasattr(saved[k], "size") and tuple(saved[k].size) != ours[k]
    ]
    if not missing and not shapes:
        return None
    saved_optims, our_optims = _optimizers(saved), _optimizers(ours)
    if saved_optims != our_optims:
        return f"it holds the state of optimizer(s) {saved_optims}, this run has {our_optims}"
    if shapes:
        key, was, now = shapes[0]
        more = f" (and {len(shapes) - 1} more)" if len(shapes) > 1 else ""
        return f"'{key}' has shape {was} in it, {now} in this run{more}: another model size"
    model_missing = [k for k in missing if k.startswith("model.")]
    if model_missing:
        return f"it has no '{model_missing[0]}' ({len(model_missing)} model tensors missing): another model"
    return f"it has no '{missing[0]}' ({len(missing)} tensors missing)"


def _optimizers(keys) -> List[str]:
    """The optimizer state groups (`optim.<name>`) among flattened checkpoint names."""
    return sorted({".".join(k.split(".")[:2]) for k in keys if k.startswith("optim.")})
