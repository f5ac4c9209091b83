"""Layouts of a world: every split into dp_replicate x dp_shard x ulysses x tp (and ep for MoE models), with and
without activation checkpointing, at the configured micro-batch tokens and at 1/2 and 1/4 of them; each sized by
the shape model (analytic.py) and costed (cost.py) for the same global batch (micro-batches never below
max_seq_len tokens); planner.search_layouts ranks them by predicted step time.
"""

import math
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Tuple

from .analytic import Layout, ShapeModel
from .comm import StepShape, step_collectives
from .cost import Hardware, StepTime, step_time
from .memory import Memory, predict_memory
from .model_shape import ModelShape


@dataclass
class Candidate:
    layout: Layout
    memory: Memory
    time: StepTime
    micro_batches: int

    def fits(self, capacity: float) -> bool:
        return self.memory.peak <= capacity

    @property
    def seconds_per_token(self) -> float:
        """Step time per token of the step: the step time for the global batch, where every layout takes it in
        full; a layout whose one micro-batch per rank already exceeds it is not credited for the surplus idly."""
        return self.time.total / (self.micro_batches * self.layout.mb_tokens * self.layout.dims.dp)


@dataclass(frozen=True)
class Budget:
    """What every layout must do in one step, and with what precision."""

    global_tokens: int
    max_seq_len: int
    step: StepShape  # the run's precision and loss chunk; evaluate() sets its layout and one micro-batch
    param_bytes: int
    reshard: bool = True


def _powers_of_two(limit: int) -> List[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def _splits_ok(shape: ModelShape, tp: int, sp: int) -> bool:
    if tp > 1 and shape.tp_refusal(tp):
        return False
    if sp > 1:
        from ..distributed.sequence_parallel.comm import kv_replication

        try:
            kv_replication(shape.kv_heads, shape.heads, sp)
        except ValueError:
            return False
    return not (tp > 1 and sp > 1)  # Ulysses and TP do not compose yet (build_parallelize_model refuses)


def layouts(shape: ModelShape, world: int, gpus_per_node: int, mb_tokens: int, max_seq_len: int) -> Iterator[Layout]:
    """Micro-batches hold at least one max_seq_len document: smaller budgets would change what trains."""
    inner = [2**i for i in range(int(math.log2(gpus_per_node)) + 1) if world % 2**i == 0]
    eps = [e for e in _powers_of_two(min(world, shape.experts)) if shape.experts % e == 0] if shape.is_moe else [1]
    budgets = sorted({t for t in (mb_tokens, mb_tokens // 2, mb_tokens // 4) if t >= max_seq_len} or {mb_tokens})
    for tp in inner:
        for sp in inner:
            if world % (tp * sp) or not _splits_ok(shape, tp, sp):
                continue
            dp = world // (tp * sp)
            for replicate in [r for r in _powers_of_two(dp) if dp % r == 0]:
                for ep in eps:
                    for ckpt in (False, True):
                        for tokens in budgets:
                            if tokens % sp == 0:
                                yield Layout(world, replicate, dp // replicate, sp, tp, ep, ckpt, tokens)


def step_work(shape: ModelShape, layout: Layout, global_tokens: int, max_seq_len: int) -> Tuple[int, float]:
    """(micro-batches of a step, at least one per rank; this rank's FLOPs in them), documents taken as long as
    allowed whatever the packing."""
    micro_batches = max(1, math.ceil(global_tokens / (layout.dims.dp * layout.mb_tokens)))
    local = layout.mb_tokens // layout.ulysses
    return micro_batches, micro_batches * local * shape.flops_per_token(max_seq_len, layout.checkpointing) / layout.tp


def evaluate(
    model: ShapeModel, shape: ModelShape, layout: Layout, budget: Budget, hardware: Hardware, cache: Dict
) -> Candidate:
    key = (layout.dp_replicate, layout.dp_shard, layout.ulysses, layout.tp, layout.ep)
    if key not in cache:  # checkpointing and micro-batch size do not change the shards
        cache[key] = model.rank_plan(replace(layout, checkpointing=False, mb_tokens=0), budget.reshard)
    plan = cache[key]
    micro_batches, flops = step_work(shape, layout, budget.global_tokens, budget.max_seq_len)
    local = layout.mb_tokens // layout.ulysses
    step = replace(  # one micro-batch; every collective of the step scales with their number
        budget.step,
        micro_batches=((local, local),),
        checkpointing=layout.checkpointing,
        tp=layout.tp,
        sp=layout.ulysses,
        ep=layout.ep,
    )
    memory = predict_memory(plan, shape, step, budget.param_bytes)
    collectives = step_collectives(plan, shape, step)
    for item in collectives:
        item.nbytes *= micro_batches
    time = step_time(flops, collectives, hardware, layout.strides())
    return Candidate(layout, memory, time, micro_batches)


def changes(a: Layout, b: Layout) -> int:
    """How many knobs differ: the nearest fitting layout changes the fewest."""
    fields = ("dp_replicate", "dp_shard", "ulysses", "tp", "ep", "checkpointing", "mb_tokens")
    return sum(getattr(a, f) != getattr(b, f) for f in fields)
