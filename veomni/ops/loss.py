"""Causal-LM loss as a token *sum*, so the trainer can normalise by the global number of loss tokens.

`causal_lm_loss_sum` takes full logits. `chunked_lm_head_loss` never materialises them: inside the model's
forward it takes over the output head and runs it on `chunk_size` tokens at a time, so the (tokens x vocab) fp32
logits of only one chunk live at once. In training this is a fused linear + cross-entropy: each chunk's gradients
(softmax - one-hot, through the head) are computed in the forward pass, so backward neither recomputes the
logits nor the softmax (~10% of a step of the demo model; the price is the head's weight gradient held from
forward to backward; no second-order gradients: a create_graph backward raises). A tensor-parallel head (DTensor
weight) checkpoints each chunk and recomputes it instead.
The head's own forward is still called once as a module, so FSDP's hooks and tied embeddings behave as in the
plain forward.
"""

from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from .vocab_parallel_loss import vocab_parallel_cross_entropy_sum

IGNORE_INDEX = -100


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss once labels are shifted (HF convention)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropy (fp32) and the number of tokens in it."""
    if isinstance(logits, DTensor):  # a tensor-parallel head's vocab-sharded logits: reduced without gathering
        targets = _next_token_targets(labels.to(logits.device))
        return vocab_parallel_cross_entropy_sum(logits, targets), (targets != IGNORE_INDEX).sum()
    shift_logits = logits[..., :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (shift_labels != IGNORE_INDEX).sum()


def _next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """targets[..., t] = labels[..., t + 1]; the last position of each row predicts nothing."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[..., :-1] = labels[..., 1:]
    return targets


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    if isinstance(logits, DTensor):  # tensor parallel: this chunk's logits sharded on the vocabulary
        return vocab_parallel_cross_entropy_sum(logits, targets)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_i CE(hidden_i @ W^T + b, target_i) over rows whose target is not IGNORE_INDEX, chunk by chunk; the
    gradients are computed in forward and only scaled by the incoming (scalar) gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        # only the gradients autograd will ask for (a frozen head or bias costs neither time nor memory)
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
            logits = F.linear(h, weight, bias).float()
            valid = t != IGNORE_INDEX
            picked = t.masked_fill(~valid, 0)
            log_z = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, picked[:, None]).squeeze(1)
            total += torch.where(valid, log_z - target_logit, 0.0).sum()
            if not (want_hidden or want_weight or want_bias):
                continue
            grad_logits = logits.sub_(log_z[:, None]).exp_()  # softmax, in place of the logits
            grad_logits[torch.arange(len(t), device=t.device), picked] -= 1.0
            grad_logits = grad_logits.mul_(valid[:, None]).to(weight.dtype)
            if want_hidden:
                grad_hidden[start : start + chunk_size] = grad_logits @ weight
            if want_weight:
                grad_weight += (grad_logits.t() @ h).float()
            if want_bias:
                grad_bias += grad_logits.float().sum(0)
        ctx.save_for_backward(
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if torch.is_grad_enabled():  # create_graph: the saved gradients carry no graph, a penalty on them would be 0
            raise RuntimeError(
                "the fused linear + cross-entropy loss has no second-order gradient (create_graph=True): set "
                "model.ops_implementation.loss_chunk_size 0 for the plain loss"
            )
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_total.float()
        return (
            None if grad_hidden is None else _scaled(grad_hidden, scale),
            None if grad_weight is None else _scaled(grad_weight, scale),
            None if grad_bias is None else _scaled(grad_bias, scale),
            None,
            None,
        )


def _scaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad * scale (0-dim fp32), the product taken in fp32 as the plain loss's backward takes it: a bf16 gradient
    times the scale rounded to bf16 is off by up to 0.4% everywhere (1/300: 0.2% low)."""
    if grad.dtype == torch.float32 or grad.device.type == "cpu":
        return grad * scale  # CPU's kernel multiplies by a 0-dim operand's own fp32 value (and 4x faster than below)
    return _scaled_in_fp32(grad, scale)  # elsewhere (CUDA) the 0-dim operand is first cast to grad's dtype


def _scaled_in_fp32(grad: torch.Tensor, scale: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """A block of rows at a time, so no fp32 copy of a head-sized gradient is made."""
    out = torch.empty_like(grad)
    for start in range(0, grad.shape[0], rows):
        out[start : start + rows] = grad[start : start + rows].float() * scale
    return out


def chunked_head_loss_sum(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk_size: int, labels_shifted: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """`causal_lm_loss_sum(head(hidden), labels)` with the logits of at most `chunk_size` tokens alive at once.

    `labels_shifted`: labels[t] is already the target of position t (sequence parallel shards, see MainCollator)."""
    labels = labels.to(hidden.device)
    targets = (labels if labels_shifted else _next_token_targets(labels)).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    # only positions with a target reach the head: masked ones add exactly 0 to the sum and its gradient, and in SFT
    # (prompts, image tokens) they are most of the row
    # (index_select, not a boolean mask: its backward is an index_add, where a mask's would wait for the GPU again)
    keep = torch.nonzero(targets != IGNORE_INDEX).squeeze(1)
    flat, targets = flat.index_select(0, keep), targets.index_select(0, keep)
    if torch.is_grad_enabled() and isinstance(head, nn.Linear) and not isinstance(head.weight, DTensor):
        total = _LinearCrossEntropySum.apply(flat, head.weight, head.bias, targets, chunk_size)
        return total, (targets != IGNORE_INDEX).sum()
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_size):
        h, t = flat[start : start + chunk_size], targets[start : start + chunk_size]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, head, h, t, use_reentrant=False)
        else:
            total = total + _chunk_loss(head, h, t)
    return total, (targets != IGNORE_INDEX).sum()


def supports_chunked_loss(model: nn.Module) -> bool:
    """Models whose logits are exactly `get_output_embeddings()(hidden)` (no soft-capping or scaling after it)."""
    config = getattr(model, "config", None)
    for cfg in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: None)()) if c}.values():
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
            return False
        if getattr(cfg, "logits_scaling", 1) not in (None, 1):  # e.g. Granite divides the logits after the head
            return False
    return isinstance(getattr(model, "get_output_embeddings", lambda: None)(), nn.Linear)


@contextmanager
def chunked_lm_head_loss(
    model: nn.Module, labels: torch.Tensor, chunk_size: int, labels_shifted: bool = False
) -> Iterator[Optional[Dict[str, Any]]]:
    """Within the block, `model(...)` computes the loss chunk by chunk at its output head instead of full logits.

    The summed loss comes back *as* `outputs.logits` (a 0-dim tensor): taking it from the model's own output lets
    FSDP see the backward reach the model and unshard the root's parameters before the chunks are recomputed.
    Yields a dict that holds `tokens` (loss tokens) once the forward has run, or None when the model cannot be
    chunked (`chunk_size <= 0`, soft-capped logits, ...): then `outputs.logits` are the plain logits.
    """
    if chunk_size <= 0 or not supports_chunked_loss(model):
        yield None
        return
    head = model.get_output_embeddings()
    result: Dict[str, Any] = {}
    inside = [False]

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if inside[0]:  # a chunk calling the head through its module (hooks included): the real projection
            return type(head).forward(head, hidden)
        if isinstance(hidden, DTensor):  # a tensor-parallel head's input hook made it a replicated DTensor
            hidden = hidden.to_local()  # each chunk's call of the head wraps its slice again
        inside[0] = True
        try:
            loss_sum, result["tokens"] = chunked_head_loss_sum(head, hidden, labels, chunk_size, labels_shifted)
        finally:
            inside[0] = False
        return loss_sum

    head.forward = forward
    try:
        yield result
    finally:
        del head.forward
