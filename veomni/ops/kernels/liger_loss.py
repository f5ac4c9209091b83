"""liger-kernel's fused linear cross-entropy as a head-loss backend of `veomni.ops.loss.CausalLMLoss`
(`model.ops_implementation.loss_implementation: liger`, registered as "liger" by veomni.ops.kernels).

    liger_linear_cross_entropy_sum(head, hidden [N, H], targets [N], chunk_size) -> summed fp32 loss

It gets what every head-loss backend gets (`chunked_head_loss_sum`): only the rows that have a target, the head's
parameters gathered. Like the chunked loss, the head's gradients are computed in forward chunk by chunk and the full
logits never exist; liger's Triton kernel fuses softmax, loss and logits gradient in place of the chunk's logits. Its
chunk is chosen by liger's memory rule (transient logits <= C x tokens x hidden); `chunk_size` bounds it from above
(C is derived from it). Gradients accumulate in fp32 (`accum_dtype`), as the chunked loss does.
Not for a tensor-parallel head (a DTensor weight) or a head that is not a plain nn.Linear: ValueError.
On CUDA liger reads the number of loss tokens on the host (one sync per call, inside liger).
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..loss import IGNORE_INDEX


def liger_linear_cross_entropy_sum(
    head: nn.Module, flat: torch.Tensor, targets: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """sum_i CE(head(hidden_i), targets_i) through liger's fused linear cross-entropy (fp32)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    if not isinstance(head, nn.Linear) or isinstance(head.weight, DTensor):
        raise ValueError(
            f"liger's fused linear cross-entropy takes a plain nn.Linear head, not {type(head).__name__}"
            f"{' with a DTensor weight (tensor parallel)' if isinstance(head, nn.Linear) else ''}: use the chunked loss"
        )
    if flat.shape[0] == 0:  # nothing to predict here: a zero that still reaches the head's parameters
        return (flat.sum() + head.weight.sum() * 0).float()
    weight, bias = head.weight, head.bias
    device_type = flat.device.type
    if torch.is_autocast_enabled(device_type):  # the head runs in the compute dtype, as F.linear would under autocast
        dtype = torch.get_autocast_dtype(device_type)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    flat = flat.to(weight.dtype)
    # liger's chunk = next_pow2(tokens / ceil(vocab / (C * hidden))): the largest C whose chunk is <= chunk_size
    # (1 at least: liger's smallest)
    (tokens, hidden), vocab = flat.shape, weight.shape[0]
    mem_const = max(1, (vocab * max(chunk_size, 1)) // max(hidden * tokens, 1))
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        flat,
        weight,
        targets,
        bias,
        None,  # ce_weight
        IGNORE_INDEX,
        0.0,  # lse_square_scale
        0.0,  # label_smoothing
        "sum",
        None,  # softcap
        False,  # return_z_loss
        torch.float32,  # accum_dtype: fp32 gradient sums for a bf16 head
        False,  # use_token_scaling
        False,  # return_token_accuracy
        False,  # return_predicted_tokens
        None,  # ce_impl
        None,  # ce_mode
        mem_const,
    )
    if isinstance(loss, tuple):  # liger returns (loss, z_loss, accuracy, predicted tokens)
        loss = loss[0]
    return loss.float()
