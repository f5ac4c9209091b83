"""The planner's printout: per rank memory, per collective bytes, step time, and the layouts that fit."""

from typing import Dict, List

from .analytic import Layout
from .comm import by_label
from .memory import GIB
from .planner import PlanResult


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f} GiB"


def describe(layout: Layout) -> str:
    return (
        f"dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard}, ulysses={layout.ulysses}, tp={layout.tp}, "
        f"ep={layout.ep}, checkpointing={'on' if layout.checkpointing else 'off'}, micro-batch {layout.mb_tokens:,} tokens"
    )


def _memory_lines(result: PlanResult) -> List[str]:
    """One block per distinct memory prediction: ranks predicted alike share theirs (`ranks 0 and 7:`)."""
    blocks: Dict[tuple, List[int]] = {}  # lines without the header -> the ranks predicted so
    for report in result.ranks:
        m = report.memory
        verdict = "fits" if m.peak <= result.capacity else "DOES NOT FIT"
        body = [
            f"  parameters          {_gib(m.params)}",
            f"  gradients           {_gib(m.grads)}",
            f"  optimizer state     {_gib(m.optimizer)}",
            f"  FSDP gathered peak  {_gib(m.gathered)}",
            f"  activations         {_gib(m.activations)}  (kept for backward, one micro-batch)",
            f"  backward / loss     {_gib(m.transient)}  (one layer's backward or the output head, the larger)",
            f"  predicted peak      {_gib(m.peak)}  of {result.capacity / GIB:.1f} GiB usable: {verdict}",
        ]
        blocks.setdefault(tuple(body), []).append(report.rank)
    lines = []
    for body, ranks in blocks.items():
        names = (
            f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
        )
        lines += [f"{names}:", *body]
    return lines


def _comm_lines(result: PlanResult) -> List[str]:
    totals = by_label(result.ranks[0].collectives)
    lines = [f"communication per step, rank {result.ranks[0].rank} ({result.micro_batches} micro-batches):"]
    for (kind, label), nbytes in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<15} {label:<13} {_gib(nbytes)}")
    return lines


def _candidate_lines(result: PlanResult) -> List[str]:
    if not result.candidates:
        return ["no layout of this world fits the GPU: more GPUs, a larger GPU, or a smaller micro-batch"]
    header = "  dp_rep dp_shard ulysses tp  ep ckpt  mb_tokens  peak GiB  step s  tok/s/GPU  checked"
    mfu = f"at MFU {result.hardware.mfu:.2f}"
    lines = [f"layouts that fit, by predicted step time {mfu} (and the nearest to the configured one):", header]
    for c in result.candidates:
        lay, checked = c.layout, result.validated.get(c.layout)
        tokens = c.micro_batches * lay.mb_tokens * lay.dims.dp / lay.world
        lines.append(
            f"  {lay.dp_replicate:6d} {lay.dp_shard:8d} {lay.ulysses:7d} {lay.tp:2d} {lay.ep:3d} "
            f"{'on ' if lay.checkpointing else 'off'}  {lay.mb_tokens:9,d}  {c.memory.peak / GIB:8.1f}  "
            f"{c.time.total:6.2f}  {tokens / c.time.total:9,.0f}  "
            f"{'' if checked is None else 'real plan' if checked else 'MISMATCH'}"
        )
    return lines


def render(result: PlanResult) -> str:
    hw, shape, lay = result.hardware, result.shape, result.layout
    t = result.time
    lines = [
        f"{shape.model_type}: {shape.layers} layers, hidden {shape.hidden}"
        + (f", {shape.experts} experts top-{shape.top_k}" if shape.is_moe else ""),
        f"{lay.world} x {hw.gpu.name} ({lay.world // hw.gpus_per_node} nodes x {hw.gpus_per_node}); layout: "
        + describe(lay),
        *result.notes,
        *_memory_lines(result),
        *_comm_lines(result),
        f"step time: compute {t.compute:.2f} s at MFU {hw.mfu:.2f} of {hw.gpu.tflops:.0f} TFLOP/s, FSDP "
        f"collectives {t.overlapped:.2f} s (overlapped), other collectives {t.exposed:.2f} s -> {t.total:.2f} s",
        *_candidate_lines(result),
    ]
    return "\n".join(lines)
