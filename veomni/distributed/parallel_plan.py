"""Parallel plans as data: a parameter-name pattern -> its placement over an extra parallel dimension.

Expert parallelism shards every fused expert tensor on dim 0 (whole experts per rank) over `ep`; FSDP then shards
those local experts over `ep_fsdp` (dim 1), while the rest of the model is FSDP-sharded over all data ranks.
A model family with other parameter names adds an entry to PARALLEL_PLANS (keyed by config.model_type).
"""

import re
from typing import Dict, List

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..compat.transformers import config_experts_implementation
from ..ops.moe import FUSED, ExpertParallel, set_expert_parallel
from .parallel_state import ParallelState

EXPERT_PLAN: Dict[str, Shard] = {r"(^|\.)experts\.(gate_up_proj|down_proj|gate_proj|up_proj)$": Shard(0)}
PARALLEL_PLANS: Dict[str, Dict[str, Shard]] = {"qwen3_moe": EXPERT_PLAN, "qwen2_moe": EXPERT_PLAN}


def get_parallel_plan(model: nn.Module) -> Dict[str, Shard]:
    return PARALLEL_PLANS.get(getattr(model.config, "model_type", ""), EXPERT_PLAN)


def apply_ep(model: nn.Module, state: ParallelState) -> List[nn.Module]:
    """Keep this rank's experts of every planned parameter (as a DTensor over `ep`); return the modules that
    own them, each told how to dispatch tokens (`set_expert_parallel`)."""
    implementation = config_experts_implementation(model.config)
    if implementation != FUSED:
        raise ValueError(
            f"expert parallel needs model.ops_implementation.moe_implementation=fused (the experts run "
            f"{implementation!r}): only the fused experts dispatch tokens to the rank that holds their expert by "
            "all-to-all; transformers' eager experts would index this rank's share of the experts with global "
            "expert ids"
        )
    plan = [(re.compile(pattern), placement) for pattern, placement in get_parallel_plan(model).items()]
    ep_mesh = state.extra_mesh("ep")["ep"]
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    owners = []
    for module_name, module in model.named_modules():
        found = False
        for name, param in list(module.named_parameters(recurse=False)):
            full_name = f"{module_name}.{name}" if module_name else name
            placement = next((pl for pattern, pl in plan if pattern.search(full_name)), None)
            if placement is None:
                continue
            dim = placement.dim
            if param.shape[dim] % size:
                raise ValueError(f"{full_name}: {param.shape[dim]} experts do not split evenly over ep={size}")
            local = param.detach().chunk(size, dim=dim)[rank]
            local = local if local.is_meta else local.clone()
            dtensor = DTensor.from_local(local, ep_mesh, [placement], run_check=False)
            setattr(module, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))
            found = True
        if found:
            # expert grads are averaged over ep_fsdp only (ranks that hold the same experts), the rest over all
            # data ranks: scale them by 1/ep so every parameter sees the same global-token mean
            set_expert_parallel(module, ExpertParallel(ep_mesh.get_group(), size, rank, grad_scale=1.0 / size))
            owners.append(module)
    if not owners:
        raise ValueError(f"expert parallel is on but no parameter of {type(model).__name__} matches its plan")
    return owners


def expert_shard_placement(param: torch.Tensor, zero_comm: bool = False, ep_fsdp_size: int = 1):
    """FSDP shards local experts on their hidden dim (dim 1) by default, so whole experts stay on their ep rank.

    `zero_comm` (optimizer.muon_expert_zero_comm) shards on dim 0 instead: each ep_fsdp rank holds whole experts,
    so Muon orthogonalises them with no communication. It needs the local experts to split evenly over ep_fsdp.
    """
    local_experts = (param.to_local() if isinstance(param, DTensor) else param).shape[0]
    return Shard(0) if zero_comm and local_experts % ep_fsdp_size == 0 else Shard(1)
