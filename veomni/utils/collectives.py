"""Rank-0 work that every rank waits for, without a barrier that could wait forever.

A plain `if rank == 0: work(); dist.barrier()` leaves the other ranks in the barrier until the collective timeout
when rank 0's work fails (a full disk, a permission). `on_rank0` broadcasts rank 0's result or its error instead:
every rank returns the same value or raises the same error at once.
"""

import pickle
from typing import Any, Callable

import torch.distributed as dist


def on_rank0(fn: Callable[[], Any]) -> Any:
    """`fn()` on rank 0; its result (or its exception) on every rank. Collective: call on every rank alike."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as err:
            box = [("error", err)]
            try:
                pickle.dumps(err)
            except Exception:  # an exception that cannot travel: its type and message do
                box = [("error", RuntimeError(f"{type(err).__name__}: {err}"))]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
