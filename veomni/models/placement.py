"""Placing tensors into a model's parameters, plain or DTensor-sharded (FSDP2, TP, EP): which slice of a full
tensor a rank's shard holds, the copy of a full tensor or a stream of them into the parameters, and the one record
of tied parameters."""

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def local_index(target: torch.Tensor) -> Optional[Tuple[slice, ...]]:
    """The slice of the full tensor that this rank's shard of `target` holds, for `Shard`/`Replicate` placements
    (torch.chunk's split, as DTensor makes it); None where it is not one block (a strided FSDP2-over-TP shard)."""
    if not isinstance(target, DTensor) or any(type(p) not in (Shard, Replicate) for p in target.placements):
        return None
    coordinate = target.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return None
    bounds = [[0, size] for size in target.shape]
    for mesh_dim, placement in enumerate(target.placements):
        if isinstance(placement, Shard):
            start, end = bounds[placement.dim]
            parts = target.device_mesh.size(mesh_dim)
            step = -(-(end - start) // parts)
            lo = min(start + coordinate[mesh_dim] * step, end)
            bounds[placement.dim] = [lo, min(lo + step, end)]
    return tuple(slice(lo, hi) for lo, hi in bounds)


def copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into `target`: a plain tensor, or a DTensor of which this rank keeps its own
    shard, sliced locally with exactly DTensor's layout (no communication). `copy_` casts: no full-size temporary
    in the target's dtype."""
    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    index = local_index(target)
    if index is None:  # a strided shard: DTensor slices it
        full = full.to(device=target.device, dtype=target.dtype)
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(full.to_local())
    else:
        target.to_local().copy_(full[index])


def tied_sources(model: nn.Module) -> Dict[str, str]:
    """{tied name: the earlier parameter it is} (e.g. lm_head.weight -> model.embed_tokens.weight): the one
    record of tied parameters, which are neither loaded, saved nor exported separately (HF re-ties on load)."""
    seen, tied = {}, {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied[name] = seen[id(param)]
        else:
            seen[id(param)] = name
    return tied


def tie_again(model: nn.Module, tied: Dict[str, str]) -> None:
    """Point each tied name of `tied` (from `tied_sources`) at its source's parameter again: `to_empty` allocates,
    and each TP style shards, every slot of a shared parameter separately."""
    for name, source in tied.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(source))


@torch.no_grad()
def copy_into(model: nn.Module, stream: Iterable[Tuple[str, torch.Tensor, bool]], source_name: str) -> int:
    """Copy a stream of `(model name, tensor, is_local_slice)` into `model` (plain or DTensor-sharded parameters),
    every tensor of its state dict exactly once; returns how many came as this rank's slice only."""
    state: Dict[str, torch.Tensor] = model.state_dict()
    tied = set(tied_sources(model))
    loaded, slices = set(), 0
    for name, tensor, is_local in stream:
        slices += is_local
        if name not in state:
            if name in tied:
                continue
            raise KeyError(f"{source_name}: key '{name}' matches no parameter of {type(model).__name__}")
        target = state[name]
        if is_local:
            (target.to_local() if isinstance(target, DTensor) else target).copy_(tensor)
        elif tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{source_name}: '{name}' has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
            )
        else:
            copy_full(target, tensor)
        loaded.add(name)
    missing = [n for n in state if n not in loaded and n not in tied]
    if missing:
        raise KeyError(f"{source_name}: no value for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return slices
