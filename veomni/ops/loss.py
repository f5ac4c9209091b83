"""Causal-LM loss as a token *sum*, so the trainer can normalise by the global number of loss tokens."""

from typing import Tuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss once labels are shifted (HF convention)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropy (fp32) and the number of tokens in it."""
    shift_logits = logits[..., :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (shift_labels != IGNORE_INDEX).sum()
