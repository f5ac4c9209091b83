"""The compute dtype that `mixed_precision` resolves to is the one the model computes in, inside any autocast.

`build_parallelize_model(mixed_precision=...)` decides the compute dtype (veomni.distributed.mixed_precision): bf16
on CUDA by default, float32 on CPU (bf16 matmuls there are slow and only lose accuracy) or whenever param_dtype is
float32. A caller that wraps every forward in `torch.autocast(dtype=bfloat16)` regardless would silently override
that choice. verl's VeOmni engine does so: it means to skip autocast when the configured dtype is float32 ("a no-op at
best and a footgun at worst"), but its fallback is bf16 for an engine that does not record the dtype, which its
VeOmni engine never does. So when the resolved compute dtype is float32, the model's forward runs with autocast off
for its device; when it is a 16-bit dtype, FSDP2's MixedPrecisionPolicy already casts and an enclosing autocast of
the same dtype changes nothing.
"""

import torch
from torch import nn

from ..utils.logging import get_logger
from .mixed_precision import autocast_module, resolve_precision

logger = get_logger(__name__)


def resolved_compute_dtype(mixed_precision, device_type: str, mode: str) -> torch.dtype:
    precision = resolve_precision(mixed_precision, device_type, mode)
    return precision.policy.param_dtype if precision.policy is not None else precision.param_dtype


def keep_fp32_compute(model: nn.Module, device_type: str) -> None:
    """Run `model`'s forward with `device_type` autocast disabled (an enclosing autocast no longer lowers it)."""
    autocast_module(model, device_type, enabled=False)
    logger.info(f"mixed precision resolves to float32 compute: an enclosing {device_type} autocast is turned off")
