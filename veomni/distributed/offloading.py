"""Activation offload: tensors that autograd saves for backward wait in host memory instead of on the accelerator.

    model_fwd_context, model_bwd_context = build_activation_offloading_context(
        enable_activation_offload, enable_gradient_checkpointing, activation_gpu_limit
    )
    with model_fwd_context:
        loss = model(**batch).loss
    with model_bwd_context:
        loss.backward()

Built on `torch.autograd.graph.saved_tensors_hooks` (what `torch.autograd.graph.save_on_cpu` uses): each saved
activation is copied to host memory when forward saves it and copied back when backward needs it. Parameters (which
live on the device anyway; FSDP2 frees its gathered copies itself) and tiny tensors stay where they are. The first
`activation_gpu_limit` GB of activations of a pass stay on the device, so short models pay no copies.

With gradient checkpointing, forward saves only each checkpointed layer's inputs: the forward context offloads all
of them; the layers' activations are recomputed inside backward, where the backward context offloads those beyond
`activation_gpu_limit` (the recomputed layer is freed once its gradient is taken).

On a machine without an accelerator there is nothing to offload to: both contexts are no-ops (`nullcontext`).
"""

from contextlib import nullcontext
from typing import ContextManager, Tuple

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..utils.device import get_device_type
from ..utils.logging import get_logger

logger = get_logger(__name__)

_MIN_OFFLOAD_BYTES = 1024  # a copy costs more than the memory it frees below this


class ActivationOffload(saved_tensors_hooks):
    """Saved activations on the host (pinned memory on CUDA), back on their device when backward unpacks them.
    `gpu_limit_bytes` of a pass's activations stay on the device. `offloaded_bytes` / `kept_bytes` count what it did.
    """

    def __init__(self, gpu_limit_bytes: int = 0, pin_memory: bool = True):
        self.gpu_limit_bytes = gpu_limit_bytes
        self.kept_bytes = 0
        self.offloaded_bytes = 0

        def pack(tensor: torch.Tensor):
            nbytes = tensor.nbytes
            is_parameter = tensor.requires_grad and tensor.grad_fn is None
            if tensor.device.type == "cpu" or is_parameter or nbytes <= _MIN_OFFLOAD_BYTES:
                return tensor.device, False, tensor
            if self.kept_bytes + nbytes <= self.gpu_limit_bytes:
                self.kept_bytes += nbytes
                return tensor.device, False, tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
            host.copy_(tensor, non_blocking=pin_memory)
            self.offloaded_bytes += nbytes
            return tensor.device, True, host

        def unpack(packed) -> torch.Tensor:
            device, moved, tensor = packed
            return tensor.to(device, non_blocking=True) if moved else tensor

        super().__init__(pack, unpack)

    def __enter__(self):
        self.kept_bytes = 0  # the device budget is per pass: each forward (or backward) starts with all of it
        return super().__enter__()


def build_activation_offloading_context(
    enable_activation_offload: bool = False,
    enable_gradient_checkpointing: bool = False,
    activation_gpu_limit: float = 0.0,
) -> Tuple[ContextManager, ContextManager]:
    """(forward context, backward context) that offload activations to host memory (see the module docstring);
    `activation_gpu_limit` in GB. Two `nullcontext`s when offload is off or there is no accelerator."""
    if not enable_activation_offload:
        return nullcontext(), nullcontext()
    if get_device_type() == "cpu":
        logger.info("activation offload: no accelerator here, activations already live in host memory (no-op)")
        return nullcontext(), nullcontext()
    limit = int(activation_gpu_limit * 2**30)
    if enable_gradient_checkpointing:
        # forward saves only the checkpointed layers' inputs: all offloaded, so the limit applies to the recomputed
        # activations of backward
        return ActivationOffload(0), ActivationOffload(limit)
    return ActivationOffload(limit), nullcontext()
