"""Moving a wrapped model and its optimizer state off the accelerator and back, so that an RL framework can
free device memory between phases (rollout / training). Works for FSDP2 and DDP models, and for each inner
optimizer of a MultiOptimizer. On a CPU-only machine the moves are no-ops and training simply continues.

    offload_veomni_model_to_cpu(model); offload_veomni_optimizer(optimizer)
    ... the device is free ...
    load_veomni_model_to_gpu(model); load_veomni_optimizer(optimizer)
"""

import torch
from torch import nn

from ..optim.multi_optimizer import named_optimizers
from ..utils.device import empty_cache, get_device, synchronize


@torch.no_grad()
def offload_veomni_model_to_cpu(model: nn.Module, empty_cache_after: bool = True) -> None:
    """Move this rank's parameter shards, gradients and buffers to host memory.

    `Module.to` is the move FSDP2 supports: it re-points its sharded parameters at the new storage.
    """
    synchronize()
    model.to("cpu", non_blocking=True)
    synchronize()
    if empty_cache_after:
        empty_cache()


@torch.no_grad()
def load_veomni_model_to_gpu(model: nn.Module, device: torch.device = None) -> None:
    """Bring the model back to the accelerator (the current device when not given)."""
    model.to(device or get_device(), non_blocking=True)
    synchronize()


def _move_state(optimizer, device: torch.device, keep_cpu_step: bool) -> None:
    for opt in named_optimizers(optimizer).values():
        fused = any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
        for state in opt.state.values():
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                if keep_cpu_step and key == "step" and value.dim() == 0 and not fused:
                    continue  # non-fused Adam keeps its step counter on the host
                state[key] = value.to(device, non_blocking=True)


@torch.no_grad()
def offload_veomni_optimizer(optimizer, empty_cache_after: bool = True) -> None:
    """Move every state tensor (exp_avg, exp_avg_sq, ...) of every inner optimizer to host memory."""
    synchronize()
    _move_state(optimizer, torch.device("cpu"), keep_cpu_step=False)
    synchronize()
    if empty_cache_after:
        empty_cache()


@torch.no_grad()
def load_veomni_optimizer(optimizer, device: torch.device = None) -> None:
    """Bring every state tensor of every inner optimizer back to the accelerator."""
    _move_state(optimizer, device or get_device(), keep_cpu_step=True)
    synchronize()
