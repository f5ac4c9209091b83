"""A world of any size in this one process: torch's "fake" process group, whose collectives return at once and
move nothing, so meshes, FSDP2, TP and EP plans can be built for rank r of W without W processes or a network.

PRIVATE API: `FakeStore` and the "fake" backend registration live in torch.testing._internal; this is the only
module that imports them (to be gathered into veomni/compat.py with the project's other private-API uses).
"""

import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from ..distributed.parallel_state import destroy_parallel_state
from ..utils.device import FORCE_ENV


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Within the block this process is rank `rank` of a fake world of `world_size`; meshes are built on CPU
    (the planner decides GPU dtypes itself), so no device is touched. Refused inside a real process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_world inside an initialised process group: plan in a process of its own")
    saved = {key: os.environ.get(key) for key in (FORCE_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update({FORCE_ENV: "cpu", "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"})
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        _forget_cached_shardings()
        destroy_parallel_state()  # forgets the meshes and destroys the fake group
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _forget_cached_shardings() -> None:
    """DTensor caches each op's output sharding keyed by meshes that compare equal across worlds (same shape and
    ranks), and the cached sharding holds the mesh object, so the next world's DTensors would carry this world's
    meshes (whose process groups are gone). Cleared on leaving a world."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # C++ fast path's copy
    if clear_native is not None:
        clear_native()
