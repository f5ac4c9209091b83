"""`plan(...)`: the configured layout under the real plan on a fake world, and the layouts that fit, ranked."""

import argparse
from dataclasses import dataclass, field, replace
from typing import Dict, List

from ..distributed.torch_parallelize import no_split_module_names
from ..trainer.base import build_model_from_args
from .analytic import Layout, ShapeModel
from .comm import Collective, step_collectives
from .cost import GPUS, Hardware, StepTime, step_time
from .measured import measured_mfu
from .memory import Memory, predict_memory
from .model_shape import ModelShape
from .real_plan import (
    args_for_layout,
    dtype_bytes,
    layout_of,
    load_args,
    model_shape,
    plan_rank,
    reshard_after_forward,
    step_shape,
)
from .search import Budget, Candidate, changes, evaluate, layouts, step_work

HEADROOM = 0.95  # of the GPU's memory: the caching allocator's fragmentation needs some


@dataclass
class RankReport:
    rank: int
    memory: Memory
    collectives: List[Collective]


@dataclass
class PlanResult:
    shape: ModelShape
    layout: Layout
    hardware: Hardware
    micro_batches: int
    ranks: List[RankReport]
    time: StepTime
    capacity: float
    candidates: List[Candidate] = field(default_factory=list)
    validated: Dict[Layout, bool] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def _parse(argv: List[str], world: int, notes: List[str]):
    """The run's arguments on `world` ranks, and its global batch in tokens. A global batch that does not split
    over this many data-parallel ranks is planned as one micro-batch per rank per step, in as many tokens."""
    base = load_args(argv, None)  # the config's own sizes (an ep 8 recipe needs 8 ranks)
    tokens = (base.train.global_batch_size or base.train.micro_batch_size) * base.data.max_seq_len
    try:
        return load_args(argv, world), tokens
    except ValueError as refusal:
        acc = base.train.accelerator
        dp = world // (acc.ulysses_size * acc.tp_size)
        notes.append(
            f"THE TRAINER REFUSES THIS CONFIG ON {world} RANKS: {refusal} -- planned below as if "
            f"train.global_batch_size were {base.train.micro_batch_size * dp} (one micro-batch per data-parallel "
            "rank), layouts ranked by step time per token"
        )
        return load_args(argv + ["--train.global_batch_size", str(base.train.micro_batch_size * dp)], world), tokens


def _rank_report(args, layout: Layout, world: int, rank: int, micro_batches: int, shape: ModelShape) -> RankReport:
    plan = plan_rank(args, world, rank, "cuda")
    local = layout.mb_tokens // layout.ulysses
    step = step_shape(args, [(local, local)] * micro_batches, "cuda")
    memory = predict_memory(
        plan, shape, replace(step, micro_batches=step.micro_batches[:1]), dtype_bytes(args, "cuda")[2]
    )
    return RankReport(rank, memory, step_collectives(plan, shape, step))


def plan(argv: List[str], options: argparse.Namespace) -> PlanResult:
    """The plan of config `argv` for the planner's flags `options` (veomni/plan/__main__.py's)."""
    world, notes, mfu, gpu = options.nnodes * options.nproc_per_node, [], options.mfu, GPUS[options.gpu]
    args, global_tokens = _parse(argv, world, notes)
    shape = model_shape(args)
    if mfu is None:  # measured on this GPU for the nearest benchmarked size, said beside the throughputs
        mfu, source = measured_mfu(options.gpu, shape.billions, gpu.tflops)
        notes.append(f"MFU {mfu:.2f} ({source}; --mfu to assume another)")
    hardware = Hardware(gpu, options.nproc_per_node, mfu, options.intra_node_gbps, options.inter_node_gbps)
    layout = layout_of(args, world)
    if options.tokens:
        layout = replace(layout, mb_tokens=options.tokens)
    micro_batches, flops = step_work(shape, layout, global_tokens, args.data.max_seq_len)
    # rank 0 holds the largest shards (torch.chunk gives the remainder to the last ranks), the last rank the smallest
    reports = [_rank_report(args, layout, world, r, micro_batches, shape) for r in sorted({0, world - 1})]
    time = step_time(flops, reports[0].collectives, hardware, layout.strides())
    result = PlanResult(shape, layout, hardware, micro_batches, reports, time, gpu.memory * HEADROOM, notes=notes)
    _search(result, args, global_tokens, options.top)
    return result


def search_layouts(args, world: int, hardware: Hardware, mb_tokens: int, global_tokens: int) -> List[Candidate]:
    """Every layout of `world` ranks for the model and precision of `args`, sized by the shape model (GPU dtypes),
    fastest first."""
    model = build_model_from_args(args, "cuda", "meta")
    shapes = ShapeModel(model, no_split_module_names(model) + list(args.model.basic_modules), args.train.optimizer.type)
    step, param = step_shape(args, (), "cuda"), dtype_bytes(args, "cuda")[2]
    budget = Budget(global_tokens, args.data.max_seq_len, step, param, reshard_after_forward(args, 2))
    shape, cache = model_shape(args), {}
    candidates = layouts(shape, world, hardware.gpus_per_node, mb_tokens, budget.max_seq_len)
    found = [evaluate(shapes, shape, layout, budget, hardware, cache) for layout in candidates]
    return sorted(found, key=lambda c: c.seconds_per_token)  # per token of the step: Candidate.seconds_per_token


def _search(result: PlanResult, args, global_tokens: int, top: int) -> None:
    found = search_layouts(args, result.layout.world, result.hardware, result.layout.mb_tokens, global_tokens)
    fitting = [c for c in found if c.fits(result.capacity)]
    shown = fitting[:top]
    nearest = min(fitting, key=lambda c: (changes(c.layout, result.layout), c.time.total), default=None)
    if nearest is not None and nearest not in shown:
        shown.append(nearest)
    result.candidates = shown
    for candidate in shown[:3]:  # the shape model's sizes, checked against the real plan of rank 0
        real = plan_rank(args_for_layout(args, candidate.layout), result.layout.world, 0, "cuda")
        result.validated[candidate.layout] = real.param_bytes == candidate.memory.params
