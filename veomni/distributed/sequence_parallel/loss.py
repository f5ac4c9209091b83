"""Losses over a sequence sharded by Ulysses.

The collator shifts the labels before it slices the row (`labels[t]` is already the target of position t), so
each rank's shard holds its own targets, including the one across the shard border. Hence no shift here, and a
loss token is simply a label that is not IGNORE_INDEX. The trainer sums these token losses and divides by the
count of loss tokens over ALL data- and sequence-parallel ranks (see BaseTrainer), which makes the gradients
those of the unsharded run.
"""

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...ops.loss import IGNORE_INDEX
from .comm import gather_seq, sp_all_reduce


def count_loss_tokens_shifted(labels: torch.Tensor) -> int:
    """Loss tokens of pre-shifted labels (every position's label is its own target)."""
    return int((labels != IGNORE_INDEX).sum())


def shifted_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor):
    """Summed next-token cross-entropy (fp32) for pre-shifted labels, and its token count."""
    flat_labels = labels.reshape(-1).to(logits.device)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), flat_labels, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (flat_labels != IGNORE_INDEX).sum()


def sp_load_balancing_loss_sum(
    router_logits: Sequence[torch.Tensor],
    top_k: int,
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """`ops.moe.load_balancing_loss_sum` (per-document Switch loss times the document's loss tokens) for a
    sequence sharded over `group`, equal to the unsharded value once summed over the group.

    A document's statistics (expert picks, router probabilities, tokens, loss tokens) are sums over its tokens,
    which may sit on several ranks: each rank sums its own, one autograd all-reduce adds them up, and every rank
    then holds the whole value and returns 1/sp of it (the gradient of the all-reduce sums the ranks' parts).
    """
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, local = labels.reshape(-1, labels.shape[-1]).shape
    full = gather_seq(position_ids.reshape(rows, local).to(labels.device), group, dim=-1)  # [rows, sp * local]
    starts = full == 0
    starts[:, 0] = True
    document = (starts.reshape(-1).cumsum(0) - 1).view(rows, sp * local)[:, rank * local : (rank + 1) * local]
    document = document.reshape(-1)
    documents = int(starts.sum())
    counted = (labels.reshape(-1) != IGNORE_INDEX).float()
    num_experts = router_logits[0].shape[-1]
    chosen = torch.zeros(documents, num_experts, device=labels.device)
    probs = torch.zeros(documents, num_experts, device=labels.device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1).to(labels.device)
        picks = F.one_hot(p.topk(top_k, dim=-1).indices, num_experts).sum(1).float()
        chosen = chosen.index_add(0, document, picks)
        probs = probs.index_add(0, document, p)
    tokens = torch.zeros(documents, device=labels.device).index_add_(0, document, torch.ones_like(counted))
    loss_tokens = torch.zeros(documents, device=labels.device).index_add_(0, document, counted)
    stats = sp_all_reduce(torch.cat([chosen, probs, tokens[:, None], loss_tokens[:, None]], dim=1), group)
    chosen, probs = stats[:, :num_experts], stats[:, num_experts : 2 * num_experts]
    tokens, loss_tokens = stats[:, -2], stats[:, -1]
    pooled = tokens[:, None] * len(router_logits)
    per_document = num_experts * ((chosen / pooled) * (probs / pooled)).sum(-1)
    return (per_document * loss_tokens).sum() / sp
