"""Cross-entropy over logits sharded on the vocabulary (tensor parallel lm_head), without gathering them.

Each tp rank holds logits[:, v0:v0 + V/tp]. Three all-reduces of one value per token over the tp group give the
global max, the global sum of exponentials and the target's logit (held by exactly one rank); the gradient
softmax - onehot is then local. torch's `loss_parallel` does the same but needs the backward to run inside its
context manager too, which the trainer's backward (and the chunked loss's recomputation) cannot promise.
"""

from typing import Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def vocab_shard(logits: DTensor) -> Tuple[torch.Tensor, object, int]:
    """(local logits, process group, first vocabulary id held here) of logits sharded on their last dim."""
    last = logits.ndim - 1
    dims = [i for i, p in enumerate(logits.placements) if p.is_shard() and p.dim % logits.ndim == last]
    others = [p for i, p in enumerate(logits.placements) if i not in dims and not p.is_replicate()]
    if len(dims) != 1 or others:
        raise ValueError(f"vocab-parallel loss needs logits sharded on the vocabulary only, got {logits.placements}")
    mesh, mesh_dim = logits.device_mesh, dims[0]
    local = logits.to_local()
    if logits.shape[-1] % mesh.size(mesh_dim):
        raise ValueError(f"vocabulary {logits.shape[-1]} does not split evenly over {mesh.size(mesh_dim)}")
    return local, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim) * local.shape[-1]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy (0 where the target is IGNORE_INDEX) of vocab-sharded logits."""

    @staticmethod
    def forward(ctx, local_logits, targets, group, vocab_start):
        logits = local_logits.float()
        local_vocab = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - row_max.unsqueeze(-1)).exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        valid = targets != IGNORE_INDEX
        local_target = targets - vocab_start
        here = valid & (local_target >= 0) & (local_target < local_vocab)
        index = torch.where(here, local_target, torch.zeros_like(local_target))
        target_logit = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - row_max
        target_logit = torch.where(here, target_logit, torch.zeros_like(target_logit))
        dist.all_reduce(target_logit, group=group)
        loss = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(target_logit))
        ctx.save_for_backward(exp, sum_exp, index, here, valid)
        ctx.input_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, index, here, valid = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        grad.scatter_add_(-1, index.unsqueeze(-1), -here.to(grad.dtype).unsqueeze(-1))
        grad = grad * (valid.to(grad.dtype) * grad_loss).unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_token_cross_entropy(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (fp32, [N]; 0 where the target is IGNORE_INDEX) of [..., V] logits sharded on V
    against [...] targets: the same on every rank of the tp group (the LM loss sums it, the preference loss sums it
    per sequence)."""
    local, group, start = vocab_shard(logits)
    flat = local.reshape(-1, local.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1).to(local.device), group, start)
