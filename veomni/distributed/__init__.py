"""Distributed: the DeviceMesh parallel state, FSDP2/DDP wrapping, gradient clipping, offload, MoE parallel."""

from .clip_grad_norm import clip_grad_norm, total_grad_norm
from .parallel_state import destroy_parallel_state, get_parallel_state, init_distributed, init_parallel_state

__all__ = [
    "clip_grad_norm",
    "destroy_parallel_state",
    "get_parallel_state",
    "init_distributed",
    "init_parallel_state",
    "total_grad_norm",
]
