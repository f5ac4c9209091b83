"""Filling a (possibly sharded) model from a checkpoint, one tensor group at a time.

Two ways, both streaming (no rank ever holds more than one group of full tensors):

* `broadcast_from_rank0`: rank 0 reads and converts (transformers' rules, veomni/models/loader.py), then broadcasts
  in bounded chunks; a read error on rank 0 is broadcast too, so every rank raises it instead of waiting.
* otherwise every rank reads the files itself, and a tensor that is only renamed is read as just this rank's slice
  of it (FSDP2 / TP / EP `Shard` placements).

A model trained from scratch is initialised by rank 0 alone and broadcast the same way (its failure told to all).

Each rank keeps only its own shard: `distribute_tensor(..., src_data_rank=None)` slices locally with exactly the
layout FSDP2 uses, so no further communication happens after the chunk broadcast.
"""

import math
from typing import Callable, Iterable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..models.loader import ModelWeights, WeightsMismatchError
from ..models.placement import copy_into, local_index, tie_again, tied_sources
from ..utils.device import get_device
from ..utils.logging import get_logger

logger = get_logger(__name__)


def _chunks(read: Callable[[], Iterable[Tuple[str, torch.Tensor]]], max_bytes: int) -> Iterator[list]:
    chunk, size = [], 0
    for name, tensor in read():  # called at the first chunk: an error reading or building is one of the stream's
        if chunk and size + tensor.nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += tensor.nbytes
    if chunk:
        yield chunk


def _broadcast_chunks(read: Callable[[], Iterable[Tuple[str, torch.Tensor]]], max_bytes: int):
    """Rank 0 alone calls `read()`, inside the stream, so that its failure (a mismatch found up front, out of
    memory) is told to every rank; every rank receives the same stream of full tensors, one chunk per broadcast,
    as `(name, tensor, False)` for `_copy_into`."""
    device = get_device()
    rank = dist.get_rank()
    chunks = _chunks(read, max_bytes) if rank == 0 else None
    while True:
        chunk = error = None
        if rank == 0:
            try:
                chunk = next(chunks, None)
            except Exception as err:  # told to every rank before it is raised here
                error = err
        if error is not None:  # a tuple, told apart from a chunk's list of metadata (None: the stream is done)
            meta = [(isinstance(error, WeightsMismatchError), str(error))]
        else:
            meta = [[(n, tuple(t.shape), t.dtype) for n, t in chunk] if chunk is not None else None]
        dist.broadcast_object_list(meta, src=0)
        if isinstance(meta[0], tuple):
            if error is not None:
                raise error
            mismatch, message = meta[0]
            raise (WeightsMismatchError if mismatch else RuntimeError)(f"(read on rank 0) {message}")
        if meta[0] is None:
            return
        sizes = [math.prod(s) * d.itemsize for _, s, d in meta[0]]
        if rank == 0:
            parts = [t.contiguous().view(-1).view(torch.uint8) for _, t in chunk]
            flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device)
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0)
        for (name, shape, dtype), part in zip(meta[0], flat.split(sizes)):
            yield name, part.view(dtype).view(shape), False


def load_checkpoint(model: nn.Module, weights_path: str, broadcast_from_rank0: bool, max_broadcast_bytes: int) -> None:
    """Fill `model` (materialised, possibly sharded) from an HF checkpoint folder, with transformers' key rules."""
    if broadcast_from_rank0 and dist.get_world_size() > 1:

        def read():
            return ((name, tensor) for name, tensor, _ in ModelWeights(weights_path, model).tensors())

        copy_into(model, _broadcast_chunks(read, max_broadcast_bytes), weights_path)
        return
    state = model.state_dict()
    weights = ModelWeights(weights_path, model)
    slices = copy_into(model, weights.tensors(lambda name: local_index(state[name])), weights_path)
    logger.info(f"read {slices} of {len(state)} tensors as this rank's slice only (the rest whole, then sliced)")


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
    full model with `reference_init()` and broadcasts it (also when `broadcast_from_rank0` is off: there is nothing
    to read, and a full model on every rank is what no rank can afford), so every rank and world size start
    identically.
    """
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    tied = tied_sources(model)
    model.to_empty(device=get_device())
    tie_again(model, tied)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name].to(buf.device))
    if weights_path is not None:
        load_checkpoint(model, weights_path, broadcast_from_rank0, max_broadcast_bytes)
        name = weights_path
    else:  # always from rank 0, whatever broadcast_from_rank0 says: no other rank builds a full model
        name = "rank-0 initialisation"
        copy_into(model, _broadcast_chunks(lambda: reference_init().state_dict().items(), max_broadcast_bytes), name)
    logger.info(f"materialised meta model from {name}")
