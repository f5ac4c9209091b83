"""Causal-LM loss as a token *sum*, so the trainer can normalise by the global number of loss tokens.

`causal_lm_loss_sum` takes full logits. `chunked_lm_head_loss` never materialises them: inside the model's
forward it takes over the output head, applies it to `chunk_size` tokens at a time under activation
checkpointing, and sums the cross-entropy, so the (tokens x vocab) fp32 logits of only one chunk live at once
(in forward, and again in backward, where each chunk is recomputed). The head is called as a module, so FSDP's
hooks and tied embeddings behave as in the plain forward.
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
    keep = targets != IGNORE_INDEX
    flat, targets = flat[keep], targets[keep]
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
