"""Filling a (possibly sharded) model from full tensors: read once on rank 0, broadcast in bounded chunks.

Each rank keeps only its own shard of every tensor: `distribute_tensor(..., src_data_rank=None)` slices locally
with exactly the layout FSDP2 uses, so no further communication happens after the chunk broadcast.
"""

from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..models.loader import iter_model_weights, tied_parameter_names
from ..utils.device import get_device
from ..utils.logging import get_logger

logger = get_logger(__name__)


def _chunks(tensors: Iterable[Tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    chunk, size = [], 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def _broadcast_chunks(source: Optional[Iterable[Tuple[str, torch.Tensor]]], max_bytes: int):
    """Rank 0 reads `source`; every rank receives the same `(name, tensor)` stream, one chunk per broadcast."""
    device = get_device()
    rank = dist.get_rank()
    chunks = _chunks(source, max_bytes) if rank == 0 else None
    while True:
        chunk = next(chunks, None) if rank == 0 else None
        meta = [[(n, tuple(t.shape), t.dtype) for n, t in chunk] if chunk is not None else None]
        dist.broadcast_object_list(meta, src=0)
        if meta[0] is None:
            return
        sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in meta[0]]
        if rank == 0:
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in chunk]).to(device)
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0)
        for (name, shape, dtype), part in zip(meta[0], flat.split(sizes)):
            yield name, part.view(dtype).view(shape)


def _shared_parameter_slots(model: nn.Module) -> List[List[Tuple[nn.Module, str]]]:
    slots: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, attr))
    return [group for group in slots.values() if len(group) > 1]


@torch.no_grad()
def load_full_tensors(
    model: nn.Module,
    tensors: Optional[Iterable[Tuple[str, torch.Tensor]]],
    broadcast_from_rank0: bool = True,
    max_broadcast_bytes: int = 2**30,
    source_name: str = "weights",
) -> None:
    """Copy full tensors into `model`, whose parameters may be FSDP2 DTensor shards or plain tensors.

    With `broadcast_from_rank0`, only rank 0 needs `tensors` (others pass None).
    """
    state: Dict[str, torch.Tensor] = model.state_dict()
    tied = set(tied_parameter_names(model))
    stream = _broadcast_chunks(tensors, max_broadcast_bytes) if broadcast_from_rank0 else tensors
    loaded = set()
    for name, full in stream:
        if name not in state:
            if name in tied:
                continue
            raise KeyError(f"{source_name}: key '{name}' matches no parameter of {type(model).__name__}")
        target = state[name]
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(
                f"{source_name}: '{name}' has shape {tuple(full.shape)}, model expects {tuple(target.shape)}"
            )
        full = full.to(device=target.device, dtype=target.dtype)
        if isinstance(target, DTensor):
            shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)
        loaded.add(name)
    missing = [n for n in state if n not in loaded and n not in tied]
    if missing:
        raise KeyError(f"{source_name}: no value for {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def materialize_meta_model(
    model: nn.Module,
    weights_path: Optional[str],
    broadcast_from_rank0: bool,
    max_broadcast_bytes: int,
    reference_init=None,
) -> None:
    """Allocate a meta-built (and possibly sharded) model on the device, then fill it.

    Buffers were kept real at build time (`init_empty_weights`); `to_empty` would leave them as garbage, so they
    are saved and restored (RoPE `inv_freq` is not in checkpoints). Without `weights_path`, rank 0 initialises a
    full model with `reference_init()` and broadcasts it, so every rank and world size start identically.
    """
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    shared = _shared_parameter_slots(model)
    model.to_empty(device=get_device())
    for slots in shared:  # to_empty allocates each slot separately: tie them again (e.g. lm_head = embed)
        first = getattr(slots[0][0], slots[0][1])
        for module, attr in slots[1:]:
            setattr(module, attr, first)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name].to(buf.device))
    reading = dist.get_rank() == 0 or not broadcast_from_rank0
    if weights_path is not None:
        source = iter_model_weights(weights_path, getattr(model, "config", None)) if reading else None
        name = weights_path
    else:
        source = reference_init().state_dict().items() if reading else None
        name = "rank-0 initialisation"
    load_full_tensors(model, source, broadcast_from_rank0, max_broadcast_bytes, source_name=name)
    logger.info(f"materialised meta model from {name}")
