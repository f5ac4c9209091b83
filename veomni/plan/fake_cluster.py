"""A world of any size in this one process: torch's "fake" process group, whose collectives return at once and
move nothing, so meshes, FSDP2, TP and EP plans can be built for rank r of W without W processes or a network.

The fake backend and DTensor's caches are private torch APIs, reached through veomni.compat.torch.
"""

import os
from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist

from ..compat.torch import clear_dtensor_sharding_caches, init_fake_process_group
from ..distributed.parallel_state import destroy_parallel_state
from ..utils.device import FORCE_ENV


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Within the block this process is rank `rank` of a fake world of `world_size`; meshes are built on CPU
    (the planner decides GPU dtypes itself), so no device is touched. Refused inside a real process group."""
    if dist.is_initialized():
        raise RuntimeError("fake_world inside an initialised process group: plan in a process of its own")
    saved = {key: os.environ.get(key) for key in (FORCE_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update({FORCE_ENV: "cpu", "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"})
    init_fake_process_group(rank, world_size)
    try:
        yield
    finally:
        clear_dtensor_sharding_caches()
        destroy_parallel_state()  # forgets the meshes and destroys the fake group
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
