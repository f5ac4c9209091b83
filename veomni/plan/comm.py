"""Collectives of one optimizer step, per rank, predicted from the plan and the micro-batches' token counts.

Bytes per call as veomni/plan/collectives.py counts them (c: compute dtype bytes, r: gradient-reduce dtype bytes,
T: this rank's tokens of a micro-batch, n: its loss tokens, h: hidden size; every line per micro-batch):
    trainer       all_reduce world  8*(3 + stop signals) (token counts, in host memory) once; all_reduce dp_sp 8
                  (loss) once; 8 per sharded mesh dim of each gradient (mesh, placements) group (the grad norm) once
    FSDP2         per unit over more than one rank: all_gather W*P*c (twice when resharded after forward: forward
                  and backward), reduce_scatter W*P*r, HSDP all_reduce P*r over dp_replicate (P: padded shard)
    tensor par.   all_reduce T*h*c: the embedding's and each layer's o_proj/down output in forward (o_proj's again
                  when recomputed), each layer's q/k/v/gate/up input gradient in backward; the vocab-parallel loss per
                  chunk of at most `chunk` loss tokens: 3 fp32 all_reduces of its rows in forward and again when
                  the checkpointed chunk is recomputed, and its input gradient (rows*h*c)
    Ulysses       per layer all_to_all of q, k, v (KV heads repeated to split) and the output, T*heads*dh*c each,
                  in forward, backward and recomputation; the position ids all_gather (sp*T*8) once per forward
    expert par.   per MoE layer all_to_all of the per-expert counts (E*8) in forward and recomputation, and of
                  the routed rows: T*k*h*c out and the rows received back -- T*k*h*c when the router spreads tokens
                  evenly -- in forward, backward and recomputation. The received share follows the routing: only
                  its sum over the ep group is exact, T*k*h*c summed over the group's ranks.
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..trainer.lifecycle import STOP_EXIT_CODES
from .collectives import group_key
from .model_shape import F32, ModelShape
from .shards import RankPlan, Ranks


@dataclass
class Collective:
    kind: str
    label: str
    ranks: Ranks
    size: int
    nbytes: float
    overlapped: bool = False  # FSDP2's prefetched gathers and reduce-scatters run beside compute


@dataclass(frozen=True)
class StepShape:
    """What one step runs on this rank, besides the plan."""

    micro_batches: Tuple[Tuple[int, int], ...]  # (local tokens, loss tokens) per micro-batch
    compute_bytes: int
    reduce_bytes: int
    checkpointing: bool
    loss_chunk: int
    tp: int = 1
    sp: int = 1
    ep: int = 1
    moe_metric_values: int = 0  # float64s the MoE metrics add to the loss all-reduce (aux sum, layers x experts)


class _Book:
    def __init__(self, plan: RankPlan):
        self.plan, self.items = plan, []

    def add(self, kind, label, nbytes, ranks=None, size=None, overlapped=False):
        ranks = ranks if ranks is not None else self.plan.groups.get(label)
        size = size if size is not None else self.plan.sizes.get(label, len(ranks) if ranks else 1)
        self.items.append(Collective(kind, label, ranks, size, nbytes, overlapped))


def _trainer(book: _Book, step: StepShape) -> None:
    book.add("all_reduce", "world", 8 * (3 + len(STOP_EXIT_CODES)))  # on the host, over every rank (gloo)
    book.add("all_reduce", "dp_sp", 8 * (1 + step.moe_metric_values))  # the loss, MoE metrics riding along
    for ranks in book.plan.grad_norm_ranks:
        book.add("all_reduce", "grad_norm", 8, ranks=ranks, size=len(ranks) if ranks else 1)


def _fsdp(book: _Book, step: StepShape) -> None:
    for unit in book.plan.units:
        for _ in step.micro_batches:
            if unit.shard_size > 1:
                gathered = unit.shard_size * unit.padded_numel * step.compute_bytes
                for _ in range(2 if book.plan.reshard else 1):
                    book.add("all_gather", unit.label, gathered, unit.shard_ranks, unit.shard_size, True)
                scattered = unit.shard_size * unit.padded_numel * step.reduce_bytes
                book.add("reduce_scatter", unit.label, scattered, unit.shard_ranks, unit.shard_size, True)
            if unit.replicate_size > 1:
                size = unit.padded_numel * step.reduce_bytes
                book.add("all_reduce", "dp_replicate", size, unit.replicate_ranks, unit.replicate_size, True)


def _chunks(rows: int, chunk: int) -> List[int]:
    return [min(chunk, rows - start) for start in range(0, rows, chunk)] if chunk > 0 else [rows]


def _tensor_parallel(book: _Book, shape: ModelShape, step: StepShape) -> None:
    c, h = step.compute_bytes, shape.hidden
    # recomputation stops once backward's saved tensors are back (torch.utils.checkpoint's early stop): the layer's
    # last all-reduce (down_proj's output) feeds nothing saved, so only o_proj's repeats
    recomputed = 1 if step.checkpointing else 0
    for tokens, loss_tokens in step.micro_batches:
        activation = tokens * h * c
        book.add("all_reduce", "tp", activation)  # embedding output
        for _ in range(shape.layers * (2 + recomputed + 5)):  # o/down, recomputed o, q/k/v/gate/up input grads
            book.add("all_reduce", "tp", activation)
        if step.loss_chunk > 0:
            for rows in _chunks(loss_tokens, step.loss_chunk):
                for _ in range(6):  # max, sum of exp, target logit; forward and recomputation
                    book.add("all_reduce", "tp", rows * F32)
                book.add("all_reduce", "tp", rows * h * c)
        else:  # full vocab-sharded logits: every position's row, and the head's input gradient
            for _ in range(3):
                book.add("all_reduce", "tp", tokens * F32)
            book.add("all_reduce", "tp", activation)


def _ulysses(book: _Book, shape: ModelShape, step: StepShape) -> None:
    from ..distributed.sequence_parallel.comm import kv_replication

    c, dh = step.compute_bytes, shape.head_dim
    repeat = kv_replication(shape.kv_heads, shape.heads, step.sp)
    passes = 3 if step.checkpointing else 2
    for tokens, _ in step.micro_batches:
        per_layer = [tokens * shape.heads * dh * c] * 2 + [tokens * shape.kv_heads * repeat * dh * c] * 2
        for _ in range(shape.layers * passes):
            for size in per_layer:
                book.add("all_to_all", "ulysses", size)
        book.add("all_gather", "ulysses", step.sp * tokens * 8)


def _expert_parallel(book: _Book, shape: ModelShape, step: StepShape) -> None:
    c = step.compute_bytes
    forwards = 2 if step.checkpointing else 1
    for tokens, _ in step.micro_batches:
        rows = tokens * shape.top_k * shape.hidden * c
        for _ in range(shape.moe_layers):
            for _ in range(forwards):
                book.add("all_to_all", "ep", shape.experts * 8)
            for _ in range(2 * (forwards + 1)):  # out and back, in each forward and in backward
                book.add("all_to_all", "ep", rows)


def step_collectives(plan: RankPlan, shape: ModelShape, step: StepShape) -> List[Collective]:
    book = _Book(plan)
    _trainer(book, step)
    _fsdp(book, step)
    if step.tp > 1:
        _tensor_parallel(book, shape, step)
    if step.sp > 1:
        _ulysses(book, shape, step)
    if step.ep > 1:
        _expert_parallel(book, shape, step)
    return book.items


def by_group(collectives: Sequence[Collective]) -> Dict[str, float]:
    """Bytes per `kind@ranks`, the keys CollectiveCounter.by_group measures."""
    totals: Dict[str, float] = {}
    for item in collectives:
        key = group_key(item.kind, item.ranks or ())
        totals[key] = totals.get(key, 0) + item.nbytes
    return totals


def by_label(collectives: Sequence[Collective]) -> Dict[Tuple[str, str], float]:
    totals: Dict[Tuple[str, str], float] = {}
    for item in collectives:
        totals[(item.kind, item.label)] = totals.get((item.kind, item.label), 0) + item.nbytes
    return totals
