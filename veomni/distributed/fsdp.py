"""The data-parallel steps of `parallelize`: FSDP2 (`apply_fsdp`, with expert modules sharded over their own mesh
first) or DDP (`apply_ddp`); and which modules become FSDP units."""

from collections import defaultdict
from functools import partial
from typing import Any, Dict, List, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ..compat.torch import replicate
from ..compat.transformers import no_split_modules
from ..utils.device import get_device, get_device_type
from ..utils.logging import get_logger
from .mixed_precision import autocast_module, resolve_precision
from .parallel_plan import expert_shard_placement
from .parallel_state import ParallelState

logger = get_logger(__name__)


def no_split_module_names(model: nn.Module) -> List[str]:
    """`_no_split_modules` of the model and of every sub-model in it (a VL model's vision tower and audio tower
    name their own blocks), so encoder blocks become FSDP units as decoder layers do."""
    return list(dict.fromkeys(name for module in model.modules() for name in no_split_modules(type(module))))


def basic_module_instances(model: nn.Module, basic_modules: Sequence[str]) -> List[nn.Module]:
    """Instances of the named classes, deepest first: FSDP2 must wrap a unit's sub-units before the unit itself
    (e.g. Omni's `Qwen2_5OmniVisionEncoder` around its `Qwen2_5OmniVisionBlock`s)."""
    names = set(basic_modules)
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if names and not found:
        raise ValueError(f"none of basic_modules {sorted(names)} occurs in {type(model).__name__}")
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(found, key=lambda m: -depth[id(m)])  # stable: forward order kept within a depth


def _fully_shard_kwargs(state: ParallelState, fsdp) -> Dict[str, Any]:
    """`fully_shard`'s keywords for `train.accelerator.fsdp_config` (an FSDPConfig)."""
    mesh = state.fsdp_mesh
    # None: reshard, except over a single rank, where keeping the gathered (cast) copies costs 2 bytes per
    # parameter and spares backward a second gather and cast of every unit, the bulk of FSDP's host time there
    reshard = mesh.size() > 1 if fsdp.reshard_after_forward is None else fsdp.reshard_after_forward
    mp_policy = resolve_precision(fsdp.mixed_precision, get_device_type(), state.mode).policy or MixedPrecisionPolicy()
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard and fsdp.full_shard, "mp_policy": mp_policy}
    if fsdp.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=get_device_type() == "cuda")
    return kwargs


def _shard_experts(experts: List[nn.Module], state: ParallelState, kwargs: Dict, zero_comm: bool) -> None:
    """Expert modules (already split over ep by `apply_ep`) become FSDP units over ep_fsdp."""
    if not experts:
        return
    ep_fsdp = state.extra_mesh("ep")["ep_fsdp"]
    placement = partial(expert_shard_placement, zero_comm=zero_comm, ep_fsdp_size=ep_fsdp.size())
    warned = False
    for module in experts:
        if zero_comm and not warned and any(placement(p).dim != 0 for p in module.parameters(False)):
            warned = True  # once, not once per layer
            logger.warning(
                f"muon_expert_zero_comm: {type(module).__name__}'s local experts do not split evenly over "
                f"ep_fsdp={ep_fsdp.size()} ((num_experts / ep_size) % ep_fsdp_size != 0): sharding their "
                "hidden dim instead; Muon gathers them over ep_fsdp (moe_gather_3d)"
            )
        fully_shard(module, **dict(kwargs, mesh=ep_fsdp), shard_placement_fn=placement)


def apply_fsdp(
    model: nn.Module,
    state: ParallelState,
    fsdp,
    basic_modules: Sequence[str],
    experts: Sequence[nn.Module] = (),
    expert_zero_comm: bool = False,
):
    """FSDP2 as `fsdp` (an FSDPConfig) asks: experts over ep_fsdp, then each basic module as its own unit, then the
    root; forward prefetch along each stack of units. `full_shard=False` keeps parameters gathered between forward
    and backward."""
    kwargs = _fully_shard_kwargs(state, fsdp)
    _shard_experts(list(experts), state, kwargs, expert_zero_comm)
    units = basic_module_instances(model, basic_modules)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if fsdp.forward_prefetch:  # along each stack of same-class units (decoder layers, vision blocks), in model order
        chains = defaultdict(list)
        for unit in units:
            chains[type(unit).__name__].append(unit)
        for chain in chains.values():
            for current, following in zip(chain, chain[1:]):
                current.set_modules_to_forward_prefetch([following])
    logger.info(
        f"FSDP2 over mesh {tuple(state.fsdp_mesh.shape)} with {len(units)} units; reshard_after_forward="
        f"{kwargs['reshard_after_forward']}, mixed_precision={kwargs['mp_policy'].param_dtype is not None}, "
        f"offload={'offload_policy' in kwargs}, expert_parallel={state.ep_size}, tensor_parallel={state.tp_size}"
    )


def check_ddp_options(state: ParallelState, fsdp) -> None:
    """What DDP cannot do, refused before anything is built."""
    if fsdp.offload:
        raise ValueError("fsdp_config.offload needs fsdp_mode=fsdp2, not ddp")
    policy = resolve_precision(fsdp.mixed_precision, get_device_type(), state.mode).policy
    if policy is not None and policy.reduce_dtype not in (None, torch.float32):
        raise ValueError(
            "fsdp_config.mixed_precision.reduce_dtype bfloat16 needs fsdp_mode=fsdp2: DDP all-reduces its fp32 "
            "gradients (set reduce_dtype float32)"
        )
    if state.ep_enabled:
        raise ValueError("expert parallel needs fsdp_mode=fsdp2, not ddp")
    if state.tp_enabled:
        raise ValueError("tensor parallel (tp_size > 1) needs fsdp_mode=fsdp2, not ddp")


def apply_ddp(model: nn.Module, state: ParallelState, mixed_precision: Any = None) -> None:
    """DDP over the data ranks; sequence-parallel ranks hold the same parameters but different tokens, so their
    gradients are summed too. With a compute dtype (`mixed_precision`, bf16 by default on CUDA), the forward runs
    under autocast over the fp32 parameters, as FSDP2 computes in bf16 over fp32 masters."""
    model.to(get_device())
    replicate(model, device_mesh=state.flat_meshes["dp_sp"] if state.sp_enabled else state.dp_mesh)
    policy = resolve_precision(mixed_precision, get_device_type(), state.mode).policy
    compute = policy.param_dtype if policy is not None else None
    if compute not in (None, torch.float32):
        autocast_module(model, get_device_type(), compute)
    logger.info(f"DDP over {state.dp_size} ranks, compute dtype {str(compute or torch.float32).replace('torch.', '')}")
