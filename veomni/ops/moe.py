"""Mixture-of-experts compute: a fused (sorted-token, grouped) experts forward, and expert parallelism.

transformers 5 stores experts fused (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) and dispatches the
experts forward through `ExpertsInterface` by `config._experts_implementation`. We register `veomni_fused`:

    sort the (token, k) assignments by expert -> one contiguous block per expert -> one matmul pair per expert
    (torch._grouped_mm on CUDA when available) -> weight by the router -> scatter-add back to tokens

With expert parallelism (an `ExpertParallel` registered for the module by `apply_ep`) each rank holds E/ep experts; the
sorted tokens travel to the rank owning their expert by all-to-all (per-expert counts exchanged first, so the
splits may be uneven or zero), are computed there, and come back the same way. Both all-to-alls carry autograd.
"""

import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers.integrations.moe import ExpertsInterface

from ..compat.torch import all_to_all_single_autograd, grouped_mm, grouped_mm_available
from ..compat.transformers import experts_gate
from ..utils.collectives import gather_seq
from .loss import IGNORE_INDEX
from .preference_loss import all_reduce_sum

FUSED = "veomni_fused"


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times `scale` (expert weights are averaged over fewer ranks than the rest)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _grouped_mlp(
    x: torch.Tensor,
    counts: Union[torch.Tensor, List[int]],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    apply_gate: Callable,
    host_counts: Optional[List[int]] = None,
) -> torch.Tensor:
    """Rows of `x` are grouped by expert (`counts[e]` rows for expert e: a device tensor, or host ints); each group
    through its expert's MLP.

    With torch's grouped matmul the counts stay on the device (their cumulative sum is the kernel's offsets): no
    sync. The per-expert loops (CPU, or no kernel) slice by expert on the host: they read the counts there, unless
    the caller has them (`host_counts`, expert parallelism's exchanged splits); on CPU that read waits for nothing.

    Whatever the counts (zero rows in total included), the output is a function of `x` and of every expert's
    weights: under expert parallelism a rank that received no rows must still backpropagate through its
    all-to-alls and give its experts a (zero) gradient, or its collectives part ways with the other ranks'
    (a deadlock). Which kernel runs may follow the local counts; what the graph connects may not.
    """
    rows = x.shape[0]
    if isinstance(counts, (list, tuple)):
        counts, host_counts = torch.tensor(counts, device=x.device), list(counts)
    if grouped_mm_available(x) and rows:
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = apply_gate(grouped_mm(x, gate_up.transpose(1, 2), offs=offsets))
        return grouped_mm(hidden, down.transpose(1, 2), offs=offsets)
    counts = host_counts if host_counts is not None else counts.tolist()
    if max(counts, default=0) * len(counts) <= 1.5 * rows:  # balanced, or no rows at all
        return _padded_bmm_mlp(x, counts, gate_up, down, apply_gate)
    linear = torch.nn.functional.linear
    # every expert, the empty ones too, so that each one's weights take part in the graph
    return torch.cat([linear(apply_gate(linear(r, gate_up[e])), down[e]) for e, r in enumerate(x.split(counts))])


def _padded_bmm_mlp(x, counts, gate_up, down, apply_gate) -> torch.Tensor:
    """Balanced loads: every expert's rows padded to the busiest one's, then one batched matmul per projection
    instead of one small matmul per expert (far better on CPU; padding rows are zeros and cost no accuracy)."""
    experts, width = len(counts), max(counts)
    sizes = torch.tensor(counts, device=x.device)
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x.device), sizes)
    slot = torch.arange(x.shape[0], device=x.device) - (sizes.cumsum(0) - sizes)[expert_of_row]
    padded = x.new_zeros(experts, width, x.shape[1]).index_put((expert_of_row, slot), x)
    hidden = apply_gate(torch.bmm(padded, gate_up.transpose(1, 2)))
    return torch.bmm(hidden, down.transpose(1, 2))[expert_of_row, slot]


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


# compiled decoder layers (ops_implementation.compile) call it eagerly: its grouping reads per-expert counts
@torch.compiler.disable
def fused_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    num_experts = self.num_experts
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    # rows per expert from the sorted choices: fixed shapes (bincount sizes its output from the data: a device sync)
    bounds = torch.searchsorted(flat[order], torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype))
    counts = bounds[1:] - bounds[:-1]
    x = hidden_states[token_of]
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    if torch.is_autocast_enabled(x.device.type):  # as a Linear under autocast (grouped_mm takes no fp32 under it)
        dtype = torch.get_autocast_dtype(x.device.type)
        x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    ep = _EXPERT_PARALLEL.get(self)
    args = (x, counts, gate_up, down, experts_gate(self))
    y = _grouped_mlp(*args) if ep is None else _expert_parallel_mlp(*args, ep)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, token_of, y.to(out.dtype))


@dataclass(frozen=True)
class ExpertParallel:
    """What an experts module needs to dispatch: its ep group, size and rank, and the gradient scale."""

    group: Any
    size: int
    rank: int
    grad_scale: float


# experts module -> how it dispatches; weak, so a module's entry goes with it (no attribute planted on the module)
_EXPERT_PARALLEL: "weakref.WeakKeyDictionary[torch.nn.Module, ExpertParallel]" = weakref.WeakKeyDictionary()


def set_expert_parallel(experts: torch.nn.Module, ep: ExpertParallel) -> None:
    """Make `experts` (a fused experts module holding this rank's E/ep experts) dispatch its tokens over `ep`."""
    _EXPERT_PARALLEL[experts] = ep


def expert_parallel_of(experts: torch.nn.Module) -> Optional[ExpertParallel]:
    return _EXPERT_PARALLEL.get(experts)


def _expert_parallel_mlp(x, counts, gate_up, down, apply_gate, ep: ExpertParallel) -> torch.Tensor:
    local_experts = gate_up.shape[0]
    # 1. how many rows each rank sends to each expert of each other rank
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=ep.group)
    # the all-to-all's split sizes are host arguments: ONE read of both count tables (token-choice dispatch without
    # capacity padding cannot know them otherwise); everything below is host arithmetic on it
    sent, received_rows = torch.stack([counts, recv_counts]).tolist()  # [rank-major experts] each
    per_rank = lambda rows: [sum(rows[r * local_experts : (r + 1) * local_experts]) for r in range(ep.size)]  # noqa: E731
    send_splits, recv_splits = per_rank(sent), per_rank(received_rows)
    # 2. rows go to the owner of their expert
    received = all_to_all_single_autograd(x, recv_splits, send_splits, ep.group)
    # 3. received rows are source-major; regroup them expert-major for the grouped matmul
    blocks = list(torch.arange(received.shape[0], device=x.device).split(received_rows))
    perm = torch.cat([blocks[s * local_experts + e] for e in range(local_experts) for s in range(ep.size)])
    gate_up, down = (_ScaleGrad.apply(weight, ep.grad_scale) for weight in (gate_up, down))
    by_expert = recv_counts.view(ep.size, local_experts).sum(0)  # on the device: the grouped matmul's offsets
    host_by_expert = [sum(received_rows[s * local_experts + e] for s in range(ep.size)) for e in range(local_experts)]
    y = _grouped_mlp(received[perm], by_expert, gate_up, down, apply_gate, host_by_expert)
    y = torch.empty_like(y).index_copy_(0, perm, y) if y.shape[0] else y  # back to source-major order
    # 4. results return to the ranks the rows came from
    return all_to_all_single_autograd(y, send_splits, recv_splits, ep.group)


ExpertsInterface.register(FUSED, fused_experts_forward)


def load_balancing_loss_sum(
    router_logits: Sequence[torch.Tensor],
    top_k: int,
    labels: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Summed router load-balancing loss of a micro-batch: each document's own Switch-Transformer loss
    (transformers' `load_balancing_loss_func`: experts * sum_e f_e * P_e, f and P pooled over layers) times the
    document's loss tokens (its shifted labels that are not IGNORE_INDEX).

    Why per document: the balance statistics are a product of two means, so computed over a whole micro-batch
    (as transformers does) they depend on which documents share it, and the micro-batches of one process are
    not those of two or four ranks: the loss and gradients moved with the parallel layout (MoE demo, step 1,
    1 process vs 2 ranks: loss 1.4e-5 relative). Per document they do not; a one-document micro-batch gets
    exactly transformers' value. Documents are told apart by `position_ids` restarting at 0 (rows otherwise).

    `group`: the row is a sequence shard of a Ulysses group. A document's statistics (expert picks, router
    probabilities, tokens, loss tokens) are sums over its tokens, which may sit on several ranks: each rank sums its
    own, one autograd all-reduce adds them up, and every rank then holds the whole value and returns 1/sp of it (the
    gradient of the all-reduce sums the ranks' parts), so the sum over the group equals the unsharded value.
    """
    sp, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    rows, local = labels.reshape(-1, labels.shape[-1]).shape
    starts = torch.zeros(rows, sp * local, dtype=torch.bool, device=labels.device)
    if position_ids is not None:
        starts = gather_seq(position_ids.reshape(rows, local).to(labels.device), group) == 0
    starts[:, 0] = True
    document = (starts.reshape(-1).cumsum(0) - 1).view(rows, sp * local)[:, rank * local : (rank + 1) * local].flatten()
    documents = starts.numel()  # at most one per position: a fixed shape (the true count would be a device sync)
    counted = (labels.reshape(-1) != IGNORE_INDEX).float()
    num_experts = router_logits[0].shape[-1]
    chosen = torch.zeros(documents, num_experts, device=labels.device)
    probs = torch.zeros(documents, num_experts, device=labels.device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1).to(labels.device)
        # the k distinct choices of each token as 1s (one_hot checks its indices' range with host reads on CPU)
        picks = torch.zeros_like(p).scatter_(1, p.topk(top_k, dim=-1).indices, 1.0)
        chosen = chosen.index_add(0, document, picks)
        probs = probs.index_add(0, document, p)
    tokens = torch.zeros(documents, device=labels.device).index_add_(0, document, torch.ones_like(counted))
    loss_tokens = torch.zeros(documents, device=labels.device).index_add_(0, document, counted)
    if group is not None:
        stats = all_reduce_sum(torch.cat([chosen, probs, tokens[:, None], loss_tokens[:, None]], dim=1), group)
        chosen, probs = stats[:, :num_experts], stats[:, num_experts : 2 * num_experts]
        tokens, loss_tokens = stats[:, -2], stats[:, -1]
    # an unused document slot has no tokens (and adds exactly 0): clamped so it divides 0 by 1, not by 0
    pooled = (tokens[:, None] * len(router_logits)).clamp(min=1)
    per_document = num_experts * ((chosen / pooled) * (probs / pooled)).sum(-1)
    return (per_document * loss_tokens).sum() / sp


def experts_implementation(moe_implementation: Optional[str]) -> Optional[str]:
    """Our config name -> transformers' `_experts_implementation`."""
    if moe_implementation in (None, "eager"):
        return "eager"
    if moe_implementation == "fused":
        return FUSED
    raise ValueError(f"unknown moe_implementation {moe_implementation!r}; choose eager or fused")
