"""A checkpoint that is damaged, or that belongs to another run, is refused before it is loaded.

- Checksums: when a checkpoint is published, every file in it gets a CRC-32 in `checksums.json` (the ranks share
  the reading); a resume verifies them the same way, so a flipped block of the right length is caught, named, and
  the previous good checkpoint offered (DCP itself checks only that each file is long enough).
- Fit: the checkpoint's tensor names and shapes (its DCP metadata) are compared with what this run would load into;
  another model or optimizer is refused in one line naming the difference, with the two ways out that work.
"""

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..utils.checksum import file_crc32

CHECKSUMS = "checksums.json"


def _files(folder: str) -> List[str]:
    found = []
    for dirpath, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(dirpath, n), folder) for n in names]
    return sorted(f for f in found if f not in (CHECKSUMS, "meta.json") and not f.endswith(".part"))


def _world() -> Tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(value: Any) -> List[Any]:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def write_checksums(folder: str) -> None:
    """Collective: every rank checksums a share of the files; rank 0 writes them beside the checkpoint."""
    rank, world = _world()
    names = [_files(folder) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(names, src=0)
    mine = {name: file_crc32(os.path.join(folder, name)) for name in names[0][rank::world]}
    merged = {k: v for part in _gather(mine) for k, v in part.items()}
    if rank == 0:
        with open(os.path.join(folder, CHECKSUMS), "w") as f:
            json.dump(merged, f, indent=0, sort_keys=True)


def damaged_files(folder: str) -> Optional[List[str]]:
    """Collective: the files whose checksum does not match (every rank gets the same list); None when the
    checkpoint has no checksums (written by an earlier version)."""
    rank, world = _world()
    path = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        expected: Dict[str, int] = json.load(f)
    bad = []
    for name in sorted(expected)[rank::world]:
        full = os.path.join(folder, name)
        if not os.path.isfile(full) or file_crc32(full) != expected[name]:
            bad.append(name)
    return sorted(b for part in _gather(bad) for b in part)


def _flat(state: Dict[str, Any], prefix: str = "") -> Dict[str, Tuple[int, ...]]:
    """DCP's flattened names (nested dict keys joined by '.') -> tensor shapes (global shapes of DTensors)."""
    out: Dict[str, Tuple[int, ...]] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        elif isinstance(value, torch.Tensor):
            out[name] = tuple(value.shape)
    return out


def misfit(state: Dict[str, Any], saved: Dict[str, Any]) -> Optional[str]:
    """Why `saved` (DCP metadata's state_dict_metadata) cannot fill `state`, in words, or None if it can."""
    ours = _flat(state)
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
