"""Which dtype parameters live in and which FSDP2 MixedPrecisionPolicy casts them: one decision per device.

Pure bf16 (parameters and AdamW state in bf16) loses every update smaller than half a bf16 ulp of its weight:
at lr 5e-5, 47% of the weights of a model were unchanged after 10 steps on an H100. So the default keeps fp32
master weights and optimizer state, and computes in bf16 on CUDA (`MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`), in fp32 on CPU (where bf16 matmuls are slow and only lose accuracy). DDP gets the same
choice: fp32 parameters and gradients (all-reduced in fp32), the forward under `torch.autocast` in the compute dtype
(`autocast_module`; DDP has no casting policy of its own that runs on every device). Pure low precision happens
only when asked for (`mixed_precision.enable false` with a 16-bit `param_dtype`), and says so.

TF32 (`train.tf32`, on by default): on CUDA, the fp32 matmuls and convolutions that remain (fp32 runs, fp32 parts of
a bf16 step) use TensorFloat-32 tensor cores (`set_tf32`).

The compute dtype `mixed_precision` resolves to is the one the model computes in, inside any autocast. A caller that
wraps every forward in `torch.autocast(dtype=bfloat16)` regardless would silently override that choice. verl's VeOmni
engine does so: it means to skip autocast when the configured dtype is float32 ("a no-op at best and a footgun at
worst"), but its fallback is bf16 for an engine that does not record the dtype, which its VeOmni engine never does.
So when the resolved compute dtype is float32, the model's forward runs with autocast off for its device
(`keep_fp32_compute`); when it is a 16-bit dtype, FSDP2's MixedPrecisionPolicy already casts and an enclosing
autocast of the same dtype changes nothing.
"""

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..models.auto import to_dtype
from ..utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype  # dtype the model is built in: parameters, gradients, optimizer state
    policy: Optional[MixedPrecisionPolicy]  # FSDP2 casts for compute and gradient reduction; None: no casting


def default_compute_dtype(device_type: str, mode: str = "fsdp2") -> str:
    """`mixed_precision.param_dtype: null` means this (FSDP2 and DDP alike)."""
    return "bfloat16" if device_type == "cuda" else "float32"


@functools.lru_cache(maxsize=None)
def _warn_pure(dtype: str) -> None:
    """Said once, by rank 0 alone (veomni's loggers drop other ranks' records unless told otherwise)."""
    logger.warning(
        f"pure {dtype} training: parameters and optimizer state are {dtype}, so updates smaller than about "
        f"1/256 of a weight are lost. Set train.accelerator.fsdp_config.mixed_precision.enable true for fp32 "
        "master weights."
    )


def resolve_precision(mixed_precision: Any, device_type: str, mode: str = "fsdp2") -> Precision:
    """The model dtype and FSDP2 policy for the `mixed_precision` config group (`.enable`, `.param_dtype` (null:
    `default_compute_dtype`), `.reduce_dtype`) on `device_type`. Also accepts True (bf16 compute, fp32 reduce)
    and False/None (no casting: the model keeps the dtype it was built in, fp32 here)."""
    if mixed_precision is None or isinstance(mixed_precision, bool):
        if not mixed_precision:
            return Precision(torch.float32, None)
        return Precision(torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    compute = to_dtype(getattr(mixed_precision, "param_dtype", None) or default_compute_dtype(device_type, mode))
    reduce = to_dtype(getattr(mixed_precision, "reduce_dtype", None) or "float32")
    if not getattr(mixed_precision, "enable", True):
        if compute != torch.float32:
            _warn_pure(str(compute).replace("torch.", ""))
        return Precision(compute, None)
    if compute == torch.float32 and reduce == torch.float32:
        return Precision(torch.float32, None)  # nothing to cast: plain fp32 (what CPU and DDP run)
    return Precision(torch.float32, MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce))


def autocast_module(module: nn.Module, device_type: str, dtype: Optional[torch.dtype] = None, enabled: bool = True):
    """Every forward of `module` runs inside `torch.autocast(device_type, dtype, enabled)`, entered by a forward
    pre-hook and left by a forward hook that runs even when the forward raises (torch's hooks, not a replaced
    `forward`). Used for DDP's bf16 compute over fp32 parameters (matmuls in `dtype`, reductions and norms in fp32 as
    autocast decides; gradients and the all-reduce stay fp32), and with `enabled=False` to keep float32 compute
    inside a caller's autocast (`keep_fp32_compute`)."""
    entered = []  # a stack: a module may be re-entered (nested calls) before it returns

    def enter(_module, _args):
        context = torch.autocast(device_type, dtype=dtype, enabled=enabled)
        context.__enter__()
        entered.append(context)

    def leave(_module, _args, _output):
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def resolved_compute_dtype(mixed_precision, device_type: str, mode: str) -> torch.dtype:
    precision = resolve_precision(mixed_precision, device_type, mode)
    return precision.policy.param_dtype if precision.policy is not None else precision.param_dtype


def keep_fp32_compute(model: nn.Module, device_type: str) -> None:
    """Run `model`'s forward with `device_type` autocast disabled (an enclosing autocast no longer lowers it)."""
    autocast_module(model, device_type, enabled=False)
    logger.info(f"mixed precision resolves to float32 compute: an enclosing {device_type} autocast is turned off")


def set_tf32(enabled: bool, device_type: str) -> None:
    """TensorFloat-32 for fp32 matmuls and convolutions on CUDA (`train.tf32`); nothing on other devices (CPU
    matmuls stay exact fp32, which the parity tests rely on)."""
    if device_type != "cuda":
        return
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
