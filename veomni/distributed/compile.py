"""`model.ops_implementation.compile`: `torch.compile` of each basic module (decoder layer, vision block).

Inductor fuses what eager runs as many small memory-bound kernels: the RMS norms with their fp32 upcasts, rotary
embeddings, SwiGLU, residual adds, bf16 casts. The attention and MoE-experts dispatch stay eager
(`torch.compiler.disable` in veomni.ops): a graph break around kernels that are fused already.

What is compiled is the layer's own `forward`, bound to the instance (veomni.compat's `bind_instance_method`: torch's
`Module.compile` would compile FSDP2's hooks and transformers' checkpoint wrapper with it), so the module, FSDP2's
hooks on it and the state-dict names stay as they are. transformers checkpoints activations inside `forward` (a wrapper on every
subclass of `GradientCheckpointingLayer`, FSDP's `FSDP<Layer>` included, of which only the outermost checkpoints):
a compiled layer skips those wrappers, so when checkpointing is on it is applied here instead, around the compiled
forward (non-reentrant), and transformers' own is switched off for the layer.
"""

import types
from typing import List, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..compat.transformers import bind_instance_method, undecorated_forward
from ..utils.logging import get_logger
from .fsdp import basic_module_instances

logger = get_logger(__name__)


class CompiledForward:
    """A unit's compiled forward, checkpointed (when the unit had activation checkpointing on) in training."""

    def __init__(self, unit: nn.Module):
        self.unit = unit
        self.compiled = torch.compile(types.MethodType(undecorated_forward(unit), unit))
        self.checkpointing = bool(getattr(unit, "gradient_checkpointing", False))
        if self.checkpointing:
            unit.gradient_checkpointing = False  # done here, outside the compiled region

    def __call__(self, *args, **kwargs):
        if self.checkpointing and self.unit.training and torch.is_grad_enabled():
            return checkpoint(self.compiled, *args, use_reentrant=False, **kwargs)
        return self.compiled(*args, **kwargs)


def compile_basic_modules(units: List[nn.Module]) -> None:
    """Install a `CompiledForward` on each unit (call after enabling activation checkpointing, before sharding).
    Units of one class share their compiled code; a sequence length that changes between micro-batches makes it
    recompile once, with dynamic shapes."""
    for unit in units:
        bind_instance_method(unit, "forward", CompiledForward(unit))
    if units:
        logger.info(f"torch.compile: the forward of {len(units)} {type(units[0]).__name__} units (cold compile ahead)")


def apply_compile(model: nn.Module, basic_modules: Sequence[str], checkpointing_reentrant: bool = False) -> None:
    """The compile step of `parallelize`: after activation checkpointing is set (the compiled forward takes it
    over), before sharding."""
    if checkpointing_reentrant:
        raise ValueError(
            "model.ops_implementation.compile with train.gradient_checkpointing.enable_reentrant: compiled layers "
            "checkpoint non-reentrantly; set enable_reentrant false"
        )
    compile_basic_modules(basic_module_instances(model, basic_modules))
