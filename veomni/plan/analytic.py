"""The real plan's shard sizes without building it, for searching hundreds of layouts quickly.

From the unsharded meta model, each parameter's fate under build_parallelize_model is read once: the TP style
that matches its module (veomni.distributed.tensor_parallel plans: colwise shards dim 0, rowwise dim 1, a rowwise
embedding dim 0), whether the expert plan shards it over ep (dim 0), and which FSDP2 unit holds it (the innermost
basic module, else the root; the experts module under EP). A layout then gives, as FSDP2 and torch.chunk split
tensors, rank 0's (the largest) shard of each: ceil(dim / parts) rows. tests/test_plan.py checks these sizes against
the real plan on a fake world.
"""

import fnmatch
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

from torch import nn

from ..distributed.parallel_dims import ExtraDim, ParallelDims
from .shards import RankPlan, Unit


@dataclass(frozen=True)
class Layout:
    world: int
    dp_replicate: int
    dp_shard: int
    ulysses: int = 1
    tp: int = 1
    ep: int = 1
    checkpointing: bool = False
    mb_tokens: int = 0  # tokens of one micro-batch of a data-parallel rank (before the Ulysses split)

    @cached_property
    def dims(self) -> ParallelDims:
        """The degrees as the run resolves them (one formula: veomni.distributed.parallel_dims)."""
        extras = (ExtraDim("ep", self.ep),) if self.ep > 1 else ()
        return ParallelDims(self.world, self.dp_replicate, self.dp_shard, self.ulysses, self.tp, extras)

    def strides(self) -> Dict[str, int]:
        """Rank distance between neighbours of each group: mesh (dp_replicate, dp_shard, ulysses, tp), tp innermost;
        the expert mesh (ep_fsdp, ep), ep innermost."""
        return {
            "tp": 1,
            "ulysses": self.tp,
            "fsdp": self.tp,
            "dp_sp": self.tp,
            "dp_replicate": self.tp * self.dims.fsdp,
            "ep": 1,
            "ep_fsdp": self.ep,
        }


@dataclass(frozen=True)
class _Param:
    numel_rest: Tuple[int, ...]  # full shape
    tp_dim: Optional[int]
    expert: bool
    unit: str
    nbytes: int  # element size
    trainable: bool
    muon: bool


def _tp_dims(model: nn.Module) -> Dict[str, Optional[Tuple[int, int]]]:
    """module name -> (weight dim, bias dim or None) that the TP plan shards."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ..distributed.tensor_parallel import get_tp_plan

    plan, out = get_tp_plan(model), {}
    for name, module in model.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if isinstance(style, ColwiseParallel):
            out[name] = (0, 0)
        elif isinstance(style, RowwiseParallel):
            out[name] = (0, None) if isinstance(module, nn.Embedding) else (1, None)
    return out


class ShapeModel:
    """Per-parameter facts of one model; `rank_plan(layout)` sizes rank 0's share under that layout."""

    def __init__(self, model: nn.Module, basic_modules: List[str], optimizer_type: str):
        from ..distributed.parallel_plan import get_parallel_plan
        from ..optim.optimizer import muon_params

        tp_dims = _tp_dims(model)
        expert_patterns = [re.compile(p) for p in get_parallel_plan(model)]
        unit_names = [n for n, m in model.named_modules() if n and type(m).__name__ in set(basic_modules)]
        muon = {id(p) for p in muon_params(model)} if optimizer_type == "muon" else set()
        self.optimizer_type, self.params = optimizer_type, []
        for name, p in model.named_parameters():
            module_name, _, attr = name.rpartition(".")
            dims = tp_dims.get(module_name)
            tp_dim = None if dims is None else (dims[0] if attr == "weight" else dims[1])
            owner = max((u for u in unit_names if name.startswith(u + ".")), key=len, default="")
            expert = any(pattern.search(name) for pattern in expert_patterns)
            self.params.append(
                _Param(tuple(p.shape), tp_dim, expert, owner, p.element_size(), p.requires_grad, id(p) in muon)
            )
        self.moe = any(p.expert for p in self.params)

    def _local_shape(self, p: _Param, layout: Layout) -> Tuple[Tuple[int, ...], int, int]:
        """(shape after TP/EP, FSDP shard dim, FSDP group size)."""
        shape = list(p.numel_rest)
        if p.expert and layout.ep > 1:
            shape[0] //= layout.ep
            return tuple(shape), 1, layout.world // layout.ep
        if p.tp_dim is not None and layout.tp > 1:
            shape[p.tp_dim] //= layout.tp
        return tuple(shape), 0, layout.dims.fsdp

    def rank_plan(self, layout: Layout, reshard: bool) -> RankPlan:
        units: Dict[Tuple[str, str], List[int]] = {}
        param_bytes = grad_bytes = optimizer_bytes = 0
        for p in self.params:
            shape, dim, parts = self._local_shape(p, layout)
            rows = math.ceil(shape[dim] / parts) if shape else 1
            rest = math.prod(shape) // shape[dim] if shape and shape[dim] else 0
            local = rows * rest * p.nbytes
            param_bytes += local
            if p.trainable:
                grad_bytes += local
                optimizer_bytes += local if p.muon else 2 * local + 4
            ep_unit = p.expert and layout.ep > 1
            key = (p.unit + ".experts" if ep_unit else p.unit, "ep_fsdp" if ep_unit else "fsdp")
            units.setdefault(key, [parts, 0])[1] += rows * rest
        plan_units = [
            Unit(name or "<root>", label, parts, layout.dp_replicate if label == "fsdp" else 1, numel, is_root=not name)
            for (name, label), (parts, numel) in units.items()
        ]
        sizes = {"dp_sp": layout.dims.dp_sp, "tp": layout.tp, "ulysses": layout.ulysses, "ep": layout.ep}
        return RankPlan(0, param_bytes, grad_bytes, optimizer_bytes, plan_units, [], {}, reshard, sizes)
