"""A safetensors folder laid out before any tensor exists, so that every rank writes its own bytes into it.

`safetensors.torch.save_file` needs every tensor of a file in memory at once, on one process. Here a file's header
(and so every tensor's byte offset) is computed from names, shapes and dtypes alone: the same header and tensor
order `save_file` writes, so the files are byte for byte what it would write. One rank creates the files at their
full size; then each rank writes the bytes it holds at their offsets (`os.pwrite`): a whole tensor, or the block of
rows of one that it keeps (a shard on the first dimension is one contiguous range of the tensor's bytes).
"""

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from ..models.loader import INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE

_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# the order safetensors writes a file's tensors in: by dtype, this list first to last, then by name
_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2", "F8_E4M3", "I8")
_ORDER += ("U8", "BOOL")
_MAX_WRITE = 1 << 30  # bytes per pwrite call (Linux writes at most ~2 GiB at once)

Spec = Tuple[str, Tuple[int, ...], torch.dtype]  # a tensor to be written: name, shape, dtype


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass
class Slot:
    """Where one tensor's bytes go."""

    file: str
    offset: int  # of the tensor's first byte in the file
    shape: Tuple[int, ...]
    dtype: torch.dtype


def shard_names(count: int) -> List[str]:
    """`model.safetensors`, or `model-0000i-of-0000N.safetensors` as transformers names shards."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header(specs: Sequence[Spec]) -> Tuple[bytes, Dict[str, int]]:
    """A file's header bytes (length prefix included) and each tensor's offset in the file, as `save_file`
    writes them."""
    order = sorted(specs, key=lambda s: (_ORDER.index(_NAMES[s[2]]), s[0]))
    entries, offsets, position = {"__metadata__": {"format": "pt"}}, {}, 0  # save_file's metadata
    for name, shape, dtype in order:
        size = nbytes(shape, dtype)
        entries[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [position, position + size]}
        offsets[name], position = position, position + size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {name: start + offset for name, offset in offsets.items()}


class Layout:
    """Files of named tensors, decided up front: `files[name] = specs` in the order the caller chose."""

    def __init__(self, files: Dict[str, List[Spec]]):
        self.files = files
        self.slots: Dict[str, Slot] = {}
        self.headers: Dict[str, bytes] = {}
        for file, specs in files.items():
            self.headers[file], offsets = header(specs)
            for name, shape, dtype in specs:
                if name in self.slots:
                    raise ValueError(f"tensor '{name}' is planned twice ({self.slots[name].file} and {file})")
                self.slots[name] = Slot(file, offsets[name], tuple(shape), dtype)
        self._fds: Dict[str, int] = {}

    def create(self, folder: str) -> None:
        """Each file with its header, at its full size (the data still holes), and the index of a sharded folder.
        One rank calls it before any rank writes."""
        os.makedirs(folder, exist_ok=True)
        for file, head in self.headers.items():
            size = len(head) + sum(nbytes(shape, dtype) for _, shape, dtype in self.files[file])
            with open(os.path.join(folder, file), "wb") as f:  # mode 0666 less the umask, as any other file
                f.write(head)
                f.truncate(size)
        if len(self.files) > 1:
            weight_map = {name: slot.file for name, slot in self.slots.items()}
            total = sum(nbytes(slot.shape, slot.dtype) for slot in self.slots.values())
            with open(os.path.join(folder, INDEX_FILE), "w") as f:
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1
                )

    def write(self, folder: str, name: str, tensor: torch.Tensor, first_row: int = 0) -> None:
        """`tensor` (the whole tensor `name`, or its rows from `first_row` on) into its place."""
        slot = self.slots[name]
        shape = tuple(tensor.shape)
        fits = (
            shape == slot.shape
            if not slot.shape
            else (shape[1:] == slot.shape[1:] and first_row + shape[0] <= slot.shape[0])
        )
        if tensor.dtype != slot.dtype or not fits:
            raise ValueError(
                f"'{name}': got {tensor.dtype} {shape} at row {first_row}, planned {slot.dtype} {slot.shape}"
            )
        if tensor.numel() == 0:
            return
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        view, position = memoryview(data), slot.offset + first_row * nbytes(slot.shape[1:], slot.dtype)
        path = os.path.join(folder, slot.file)
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_WRONLY)
        while len(view):
            written = os.pwrite(self._fds[path], view[:_MAX_WRITE], position)
            view, position = view[written:], position + written

    def close(self, sync: bool = True) -> None:
        """Flush this rank's writes to disk and close its files."""
        for fd in self._fds.values():
            if sync:
                os.fsync(fd)
            os.close(fd)
        self._fds.clear()
