"""Device and backend chosen from the hardware that is present: never a hard-coded `cuda`.

One decision, `select_device_type`, that every caller (process group, meshes, trainer, tests) goes through:
CUDA/NCCL only when each local rank can have a GPU of its own; otherwise CPU/gloo, with one log line saying why
(e.g. a 2-rank test on a 1-GPU machine would otherwise die with `invalid device ordinal`).
"""

import functools
import os
from typing import Optional

import torch

from .logging import get_logger

logger = get_logger(__name__)

FORCE_ENV = "VEOMNI_DEVICE"  # `cpu` forces CPU/gloo even where GPUs are present


@functools.lru_cache(maxsize=None)
def _log_fallback(local_world_size: int, cuda_count: int) -> None:
    logger.warning(
        f"{local_world_size} local ranks but {cuda_count} GPU(s): running on CPU with gloo "
        f"(give each rank its own GPU, e.g. NPROC_PER_NODE={cuda_count}, to use them)"
    )


def select_device_type(local_world_size: Optional[int] = None, cuda_count: Optional[int] = None) -> str:
    """`cuda` when there are at least as many GPUs as local ranks (torchrun's LOCAL_WORLD_SIZE), else `cpu`.

    Every rank of a node sees the same counts, so all of them choose the same backend."""
    if os.environ.get(FORCE_ENV, "").lower() == "cpu":
        return "cpu"
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cuda_count == 0:
        return "cpu"
    if local_world_size > cuda_count:
        _log_fallback(local_world_size, cuda_count)
        return "cpu"
    return "cuda"


get_device_type = select_device_type  # for this process's LOCAL_WORLD_SIZE and GPUs


def get_dist_backend() -> str:
    return "nccl" if get_device_type() == "cuda" else "gloo"


def get_device(local_rank: int | None = None) -> torch.device:
    if get_device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank)
    return torch.device("cpu")


def synchronize() -> None:
    if get_device_type() == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
