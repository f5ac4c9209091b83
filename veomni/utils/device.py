"""Device and backend chosen from the hardware that is present: never a hard-coded `cuda`."""

import os

import torch


def get_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_dist_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def get_nccl_backend() -> str:
    """VeOmni's name for the collective backend; picks gloo where there is no GPU."""
    return get_dist_backend()


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_device(local_rank: int | None = None) -> torch.device:
    if get_device_type() == "cuda":
        return torch.device("cuda", get_local_rank() if local_rank is None else local_rank)
    return torch.device("cpu")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
