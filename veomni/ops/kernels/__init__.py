"""`model.ops_implementation.kernels`: fused kernels bound to one model instance.

    auto    liger-kernel on CUDA when it is installed (`pip install veomni[kernels]`), eager otherwise
    liger   liger-kernel's RMSNorm, RoPE and SwiGLU (refused where it cannot run)
    eager   transformers' own modules

The decision is said once in the log. Binding touches only the given model (see `liger.bind_liger`): another
model built in the same process, bound or not, runs its own modules. The fused linear cross-entropy is a loss,
not a module of the model: `model.ops_implementation.loss_implementation` (`auto` by default) runs CausalLMLoss's
head through liger_loss.py, registered here as the head-loss backend "liger", on CUDA where liger is installed: on an
H200 (benchmarks/gpu_speed.py, 2026-11-27, Qwen3-1.7B head, 8192 tokens, bf16) it took 25.9 ms and 2.7 GB against
the chunked loss's 61.4 ms and 4.9 GB.
"""

import functools
import importlib.util
import os
from typing import Dict, Optional

from torch import nn

from ...utils.logging import get_logger
from ..loss import register_head_loss_backend
from .liger_loss import liger_linear_cross_entropy_sum

logger = get_logger(__name__)

CHOICES = ("auto", "liger", "eager")
KEY = "model.ops_implementation.kernels"
LOSS_KEY = "model.ops_implementation.loss_implementation"

__all__ = ["CHOICES", "bind_kernels", "liger_available", "resolve_kernels", "resolve_loss_implementation"]

register_head_loss_backend("liger", liger_linear_cross_entropy_sum)  # (liger itself is imported when it runs)


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def resolve_kernels(choice: str, device_type: str, tp_size: int = 1, compiled: bool = False) -> str:
    """`liger` or `eager` for the configured `choice` on `device_type`; a choice that cannot run raises, naming
    the key. Tensor parallel keeps eager (liger's kernels take plain tensors, not DTensors). `auto` under
    `compile: true` is eager: inductor fuses the norms, RoPE and SwiGLU itself, and better than liger's kernels
    inside its graphs (H200, Qwen3-1.7B 8k, benchmarks/gpu_speed.py: compile 37.7% MFU, compile + liger 33.8%)."""
    if choice not in CHOICES:
        raise ValueError(f"{KEY}={choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "eager":
        return "eager"
    blocker = _liger_blocker(device_type, tp_size)
    if choice == "liger":
        if blocker:
            raise ValueError(f"{KEY}=liger {blocker}")
        _said(choice, "liger", "asked for")
        return "liger"
    if compiled and not blocker:
        blocker = "ops_implementation.compile: inductor fuses these layers itself, faster than with liger inside"
    if blocker:
        _said(choice, "eager", blocker)
        return "eager"
    _said(choice, "liger", "liger-kernel RMSNorm, RoPE and SwiGLU on this model")
    return "liger"


def _liger_blocker(device_type: str, tp_size: int) -> Optional[str]:
    """Why liger's kernels cannot run here (worded to follow `<key>=liger`), or None."""
    if not liger_available():
        return "needs liger-kernel and triton: pip install veomni[kernels]"
    # Triton's interpreter runs kernels on CPU tensors (tests only: it is slow, and needs test-side adaptations)
    if not (device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return f"needs a CUDA GPU (Triton kernels); this run is on {device_type}"
    if tp_size > 1:
        return f"with tensor parallel (tp_size={tp_size}): liger's kernels take no DTensors"
    return None


def resolve_loss_implementation(choice: str, device_type: str, tp_size: int = 1) -> str:
    """The head-loss backend of CausalLMLoss for `model.ops_implementation.loss_implementation`: `liger` where it
    can run (asked for: else a ValueError naming the key; `auto`: on CUDA with liger installed and no tensor
    parallel), `chunked` otherwise."""
    if choice not in ("auto", "chunked", "liger"):
        raise ValueError(f"{LOSS_KEY}={choice!r}: choose auto, chunked or liger")
    blocker = _liger_blocker(device_type, tp_size)
    if choice == "liger" and blocker:
        raise ValueError(f"{LOSS_KEY}=liger {blocker}")
    if choice == "auto":
        return "liger" if device_type == "cuda" and not blocker else "chunked"
    return choice


@functools.lru_cache(maxsize=None)
def _said(choice: str, chosen: str, why: str) -> None:
    logger.info(f"{KEY}={choice}: {chosen} ({why})")  # (rank 0's: our loggers say INFO on rank 0 only)


def bind_kernels(
    model: nn.Module, choice: str, device_type: str, tp_size: int = 1, compiled: bool = False
) -> Dict[str, int]:
    """Bind the kernels `choice` resolves to onto `model` (this instance only); returns how many modules of each
    kind were bound ({} for eager). Call before sharding and compiling."""
    if resolve_kernels(choice, device_type, tp_size, compiled) == "eager":
        return {}
    from .liger import bind_liger

    counts = bind_liger(model)
    if not any(counts.values()):
        logger.warning(f"{KEY}: no module of {type(model).__name__} has a liger kernel here; it runs eager")
    return counts
