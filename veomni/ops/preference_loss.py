"""Preference losses (DPO) over packed sequences: per-sequence summed response log-probs, and the pair losses.

A micro-batch packs the chosen and the rejected sequence of each pair as two documents of one row (position ids
restart at each, so each attends only within itself). `sequence_index[t]` names the document of token t (chosen of
pair p = 2p, rejected = 2p + 1; -1 on padding): the shifted labels' log-probs are summed per document with one
`index_add`. Where a sequence is split over ranks (Ulysses), each rank sums its own tokens and the sums are
all-reduced over the sequence-parallel group (`group`); its backward all-reduces the gradient, so a rank that
backpropagates `loss / sp_size` gives every shard its exact share (the trainer's loss sum, all-reduced over the
group for the log, counts the pair once). Tensor-parallel logits (vocab-sharded DTensors) give per-token log-probs
through the vocab-parallel cross-entropy, identical on every tp rank.

Losses, as TRL's DPOTrainer computes them (tests/test_dpo_trl_parity.py), per pair:
    sigmoid  -(1 - eps) * logsigmoid(beta * d) - eps * logsigmoid(-beta * d),
             d = (chosen - ref_chosen) - (rejected - ref_rejected)       (eps = label_smoothing: conservative DPO)
    ipo      (d' - 1 / (2 * beta)) ** 2, d' the same difference with each log-ratio divided by its response tokens
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .loss import IGNORE_INDEX, _target_positions, forward_to_head_input, map_chunks, supports_chunked_loss
from .vocab_parallel_loss import vocab_parallel_token_cross_entropy


class _AllReduceSum(torch.autograd.Function):
    """Sum over `group`, forward and backward: every rank holds the whole sum, and each shard's gradient is the sum
    of every rank's upstream gradient (so a rank that backpropagates 1/size of the loss gives its shard the full
    derivative)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` summed over `group` (differentiable); unchanged without a group."""
    return tensor if group is None else _AllReduceSum.apply(tensor, group)


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row of `logits` ([N, V], fp32 result [N]); 0 where the target is IGNORE_INDEX."""
    if isinstance(logits, DTensor):  # a tensor-parallel head's vocab-sharded logits, reduced without gathering
        return -vocab_parallel_token_cross_entropy(logits, targets)
    return -F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


def _head_logps(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """`token_logps(head(hidden), targets)`, `chunk_size` rows of logits at a time (recomputed in backward)."""
    pieces = map_chunks(lambda h, t: token_logps(head(h), t), hidden, targets, chunk_size)
    return torch.cat(pieces) if pieces else hidden.new_zeros((0,), dtype=torch.float32)


class SequenceLogps(nn.Module):
    """`model` -> (summed response log-probs [S], response tokens [S], model outputs) of the S sequences of a packed
    micro-batch with shifted `labels` and their `sequence_index`. With `chunk_size > 0` (and a plain linear head)
    only the response positions reach the head, `chunk_size` at a time, as in CausalLMLoss."""

    def __init__(self, model: nn.Module, chunk_size: int = 0, group=None):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size if chunk_size > 0 and supports_chunked_loss(model) else 0
        self.group = group  # the sequence-parallel group the sequences are split over, or None

    def forward(
        self,
        labels: torch.Tensor,
        sequence_index: torch.Tensor,
        num_sequences: int,
        num_targets: Optional[int] = None,
        **inputs,
    ) -> Tuple[torch.Tensor, torch.Tensor, object]:
        """`num_targets`: the labels' scored tokens counted on the host (the collator's), so nothing waits for the
        device."""
        targets = labels.reshape(-1)
        index = sequence_index.reshape(-1).to(targets.device)
        keep = _target_positions(targets, num_targets)
        if not self.chunk_size:
            outputs = self.model(**inputs)
            flat = outputs.logits.reshape(-1, outputs.logits.shape[-1])
            logps = token_logps(flat.index_select(0, keep.to(flat.device)), targets.index_select(0, keep))
        else:
            outputs, hidden = forward_to_head_input(self.model, inputs)
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
            head = self.model.get_output_embeddings()
            logps = _head_logps(head, hidden, targets.index_select(0, keep), self.chunk_size)
        owner = index.index_select(0, keep)
        sums = logps.new_zeros(num_sequences).index_add(0, owner, logps)
        tokens = logps.new_zeros(num_sequences).index_add(0, owner, torch.ones_like(logps))  # (logps: fp32)
        return all_reduce_sum(sums, self.group), all_reduce_sum(tokens, self.group).detach(), outputs


def split_pairs(per_sequence: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[2P] values of sequences (chosen, rejected, chosen, ...) -> ([P] chosen, [P] rejected)."""
    return per_sequence[0::2], per_sequence[1::2]


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: Optional[torch.Tensor] = None,
    rejected_tokens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The loss of each pair ([P], fp32): `sigmoid` (DPO, conservative with `label_smoothing`) or `ipo` (needs each
    sequence's response tokens)."""
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        delta = beta * (chosen_ratio - rejected_ratio)
        return -(1 - label_smoothing) * F.logsigmoid(delta) - label_smoothing * F.logsigmoid(-delta)
    if loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs each sequence's response tokens (chosen_tokens, rejected_tokens)")
        delta = chosen_ratio / chosen_tokens.clamp(min=1.0) - rejected_ratio / rejected_tokens.clamp(min=1.0)
        return (delta - 1 / (2 * beta)) ** 2
    raise ValueError(f"dpo.loss_type={loss_type!r}; expected one of ['sigmoid', 'ipo']")
