"""What one rank holds once `build_parallelize_model` has sharded the model, read off the model itself.

`read_rank_plan(model, state, ...)` works on any sharded model: the meta model of a fake world (the planner) or the
real one of a training run (veomni/plan/runlog.py). Per rank it gives the bytes of parameters, gradients and
optimizer state (the local shards, exactly as allocated), the FSDP2 units (padded shard numel and the ranks they
all-gather over: what the collectives move) and the groups the gradient norm reduces over.
"""

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..compat.torch import DTENSOR_REDISTRIBUTE_LOGGER, fsdp_param_group, local_tensor

Ranks = Optional[Tuple[int, ...]]


@dataclass
class Unit:
    """One FSDP2 parameter group: gathered in forward (and again in backward when resharded), reduce-scattered."""

    name: str
    label: str  # the mesh it shards over, as printed: fsdp or ep_fsdp
    shard_size: int
    replicate_size: int
    padded_numel: int  # this rank's padded shard, summed over the unit's parameters (all-gather input)
    shard_ranks: Ranks = None
    replicate_ranks: Ranks = None
    is_root: bool = False


@dataclass
class RankPlan:
    rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    units: List[Unit]
    grad_norm_ranks: List[Ranks]  # one 8-byte all-reduce per entry (total_grad_norm's per-mesh-dim reductions)
    groups: Dict[str, Ranks] = field(default_factory=dict)  # dp_sp, tp, ulysses, ep -> ranks
    reshard: bool = True
    sizes: Dict[str, int] = field(default_factory=dict)  # dp_sp, tp, ulysses, ep -> group size


def nbytes(t: torch.Tensor) -> int:
    return local_tensor(t).nbytes


def _ranks(group) -> Ranks:
    return tuple(dist.get_process_group_ranks(group))


def optimizer_state_bytes(model: nn.Module, optimizer_type: str) -> int:
    """Optimizer state of the trainable local shards, as torch allocates it on the first step: AdamW keeps
    exp_avg and exp_avg_sq (the parameter's dtype) and a 4-byte fp32 `step` per parameter; Muon one momentum buffer
    per matrix it trains (veomni.optim.optimizer.muon_params) and AdamW's state for the rest;
    anyprecision_adamw its two moments in fp32 (its default)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer_type == "muon":
        from ..optim.optimizer import muon_params

        muon = {id(p) for p in muon_params(model)}
        return sum(nbytes(p) if id(p) in muon else 2 * nbytes(p) + 4 for p in params)
    if optimizer_type == "anyprecision_adamw":
        return sum(2 * local_tensor(p).numel() * 4 + 4 for p in params)
    return sum(2 * nbytes(p) + 4 for p in params)


def _fsdp_units(model: nn.Module) -> List[Unit]:
    units = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = fsdp_param_group(module)
        if group is None:
            continue
        info = group.mesh_info
        replicate = (
            getattr(info, "replicate_mesh_size", 1) if getattr(info, "replicate_mesh_dim", None) is not None else 1
        )
        units.append(
            Unit(
                name=name or "<root>",
                label="ep_fsdp" if "ep_fsdp" in (info.mesh.mesh_dim_names or ()) else "fsdp",
                shard_size=info.shard_mesh_size,
                replicate_size=replicate,
                padded_numel=sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params),
                shard_ranks=_ranks(info.shard_process_group),
                replicate_ranks=_ranks(info.replicate_process_group) if replicate > 1 else None,
                is_root=module is model,
            )
        )
    return units


def grad_norm_ranks(model: nn.Module) -> List[Ranks]:
    """The ranks of each all-reduce of `total_grad_norm` (one float64 each), found by running it on zero
    gradients of the meta model under a CollectiveCounter: how DTensor reduces a norm over a strided (FSDP over
    TP) sharding is its own business, so it is asked rather than re-derived. A model not on meta: the rule
    total_grad_norm follows for plain shardings (one all-reduce per sharded mesh dim of each group)."""
    from ..distributed.clip_grad_norm import total_grad_norm
    from .collectives import CollectiveCounter

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable or not all(p.is_meta for p in trainable):
        seen, out = set(), []
        for p in trainable:
            key = (id(p.device_mesh), tuple(p.placements)) if isinstance(p, DTensor) else None
            if key is not None and key not in seen:
                seen.add(key)
                out += [_ranks(p.device_mesh.get_group(d)) for d, pl in enumerate(p.placements) if pl.is_shard()]
        return out
    for p in trainable:
        p.grad = torch.zeros_like(p)
    try:
        # DTensor warns (once per redistribution) that a 2-D norm reduces dim by dim: true, and not the planner's concern
        with logger_levels([DTENSOR_REDISTRIBUTE_LOGGER], logging.ERROR), CollectiveCounter() as counter:
            total_grad_norm(trainable)
    finally:
        for p in trainable:
            p.grad = None
    return [ranks for _, _, ranks in counter.calls]


def _named_groups(state) -> Dict[str, Ranks]:
    groups = {"dp_sp": _ranks(state.dp_sp_group), "world": _ranks(dist.group.WORLD)}
    if state.tp_enabled:
        groups["tp"] = _ranks(state.tp_group)
    if state.sp_enabled:
        groups["ulysses"] = _ranks(state.sp_group)
    if state.ep_enabled:
        groups["ep"] = _ranks(state.ep_group)
    return groups


@contextlib.contextmanager
def logger_levels(names: Iterable[str], level: int) -> Iterator[None]:
    """Within the block the named loggers say only what is at `level` or above; their levels are restored after
    (the planner may run inside another program: a test, a notebook)."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, before in zip(loggers, saved):
            logger.setLevel(before)


def read_rank_plan(model: nn.Module, state, optimizer_type: str, reshard: bool) -> RankPlan:
    """This rank's share of a model sharded by `build_parallelize_model` under the parallel state `state`."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = _named_groups(state)
    return RankPlan(
        rank=dist.get_rank(),
        param_bytes=sum(nbytes(p) for p in model.parameters()),
        grad_bytes=sum(nbytes(p) for p in trainable),  # FSDP2's sharded gradients take the parameter's dtype
        optimizer_bytes=optimizer_state_bytes(model, optimizer_type),
        units=_fsdp_units(model),
        grad_norm_ranks=grad_norm_ranks(model),
        groups=groups,
        reshard=reshard,
        sizes={label: len(ranks) for label, ranks in groups.items()},
    )
