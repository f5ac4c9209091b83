"""Predicted step time: FLOPs at a stated MFU, plus communication at stated link bandwidths.

    compute  = sum over micro-batches of (local tokens * FLOPs per token / tp) / (peak bf16 FLOP/s * MFU)
    comm     = per collective, bytes * f / bandwidth, f = (n-1)/n (all-gather, reduce-scatter, all-to-all) or
               2(n-1)/n (all-reduce) over a ring of n ranks; bandwidth is NVLink's when the group lies in one node,
               the per-GPU inter-node link's otherwise
    step     = max(compute, FSDP2 collectives, which prefetching overlaps with compute) + the rest of the
               collectives (tensor parallel, Ulysses and expert all-to-alls sit on the critical path)
FLOPs per token (model_shape.py) assume documents as long as max_seq_len: causal attention over `context`.
Link bandwidths are per GPU and per direction: NVLink 4 (H100/H200) 450 GB/s, NVLink 3 (A100) 300 GB/s; one
400 Gb/s NIC per GPU (50 GB/s), 200 Gb/s on A100 systems (25 GB/s). All overridable on the command line.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from .comm import Collective

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: float  # bytes torch reports as total (torch.cuda.mem_get_info)
    tflops: float  # dense bf16
    intra_gbps: float  # GB/s per GPU per direction, within a node
    inter_gbps: float  # GB/s per GPU per direction, between nodes


GPUS: Dict[str, Gpu] = {
    "h100": Gpu("H100 80GB", 79.1 * 2**30, 989.0, 450.0, 50.0),
    "h200": Gpu("H200 141GB", 139.8 * 2**30, 989.0, 450.0, 50.0),
    "a100": Gpu("A100 80GB", 79.2 * 2**30, 312.0, 300.0, 25.0),
}


@dataclass(frozen=True)
class Hardware:
    gpu: Gpu
    gpus_per_node: int
    mfu: float = 0.4
    intra_gbps: Optional[float] = None
    inter_gbps: Optional[float] = None

    def bandwidth(self, spans_nodes: bool) -> float:
        if spans_nodes:
            return (self.inter_gbps or self.gpu.inter_gbps) * GB
        return (self.intra_gbps or self.gpu.intra_gbps) * GB


def _ring_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def spans_nodes(item: Collective, gpus_per_node: int, strides: Dict[str, int]) -> bool:
    """From the group's ranks when known, else from its stride in the mesh (inner dims are adjacent ranks)."""
    if item.ranks:
        return len({r // gpus_per_node for r in item.ranks}) > 1
    return strides.get(item.label, 1) * item.size > gpus_per_node


@dataclass
class StepTime:
    compute: float
    overlapped: float
    exposed: float

    @property
    def total(self) -> float:
        return max(self.compute, self.overlapped) + self.exposed


def step_time(flops: float, collectives: Sequence[Collective], hardware: Hardware, strides: Dict[str, int]) -> StepTime:
    compute = flops / (hardware.gpu.tflops * 1e12 * hardware.mfu)
    overlapped = exposed = 0.0
    for item in collectives:
        bandwidth = hardware.bandwidth(spans_nodes(item, hardware.gpus_per_node, strides))
        seconds = item.nbytes * _ring_factor(item.kind, item.size) / bandwidth
        if item.overlapped:
            overlapped += seconds
        else:
            exposed += seconds
    return StepTime(compute, overlapped, exposed)
