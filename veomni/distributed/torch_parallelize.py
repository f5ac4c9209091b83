"""`build_parallelize_model`: FSDP2 (or DDP), mixed precision, activation checkpointing, CPU offload, and
meta-device materialisation with weights read on rank 0 and broadcast."""

from functools import partial
from typing import Any, List, Optional, Sequence

from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ..utils.device import get_device, get_device_type
from ..utils.logging import get_logger
from .compile import compile_basic_modules
from .mixed_precision import resolve_precision
from .parallel_plan import apply_expert_parallel, expert_shard_placement
from .parallel_state import get_parallel_state
from .sequence_parallel import apply_ulysses
from .tensor_parallel import apply_tensor_parallel
from .weight_loading import materialize_meta_model

logger = get_logger(__name__)


def _mixed_precision_policy(mixed_precision: Any) -> Optional[MixedPrecisionPolicy]:
    """Accepts the config group (`.enable`, `.param_dtype`, `.reduce_dtype`), a bool, or None."""
    return resolve_precision(mixed_precision, get_device_type(), get_parallel_state().mode).policy


def no_split_module_names(model: nn.Module) -> List[str]:
    """`_no_split_modules` of the model and of every sub-model in it (a VL model's vision tower and audio tower
    name their own blocks), so encoder blocks become FSDP units as decoder layers do."""
    names = []
    for module in model.modules():
        for name in getattr(type(module), "_no_split_modules", None) or []:
            if name not in names:
                names.append(name)
    return names


def _basic_module_instances(model: nn.Module, basic_modules: Sequence[str]) -> List[nn.Module]:
    """Instances of the named classes, deepest first: FSDP2 must wrap a unit's sub-units before the unit itself
    (e.g. Omni's `Qwen2_5OmniVisionEncoder` around its `Qwen2_5OmniVisionBlock`s)."""
    names = set(basic_modules)
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if names and not found:
        raise ValueError(f"none of basic_modules {sorted(names)} occurs in {type(model).__name__}")
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(found, key=lambda m: -depth[id(m)])  # stable: forward order kept within a depth


def _prefetch_chains(units: List[nn.Module]) -> List[List[nn.Module]]:
    """Forward prefetch runs along each stack of same-class units (decoder layers, vision blocks), in model order."""
    chains: dict = {}
    for unit in units:
        chains.setdefault(type(unit).__name__, []).append(unit)
    return [chain for chain in chains.values() if len(chain) > 1]


def _enable_gradient_checkpointing(model: nn.Module, reentrant: bool) -> None:
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns, gone in v6
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(f"{type(model).__name__} does not support gradient checkpointing")
    if reentrant and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad


def _reference_init(model: nn.Module):
    """Rank 0's full-size initialisation of a meta model trained from scratch."""
    from ..models.multimodal import model_class_for

    def build():
        dtype = next(model.parameters()).dtype
        return model_class_for(model.config).from_config(
            model.config, attn_implementation=model.config._attn_implementation, dtype=dtype
        )

    return build


def build_parallelize_model(
    model: nn.Module,
    init_device: str = "cpu",
    weights_path: Optional[str] = None,
    enable_full_shard: bool = True,
    enable_reshard_after_forward: Optional[bool] = None,
    mixed_precision: Any = None,
    enable_gradient_checkpointing: bool = False,
    enable_fsdp_offload: bool = False,
    basic_modules: Optional[Sequence[str]] = None,
    enable_reentrant: bool = False,
    enable_forward_prefetch: bool = True,
    broadcast_model_weights_from_rank0: bool = True,
    max_load_broadcast_size: int = 2**30,
    expert_zero_comm: bool = False,
    enable_compile: bool = False,
) -> nn.Module:
    """Wrap `model` for data-parallel training per the parallel state's mode; returns the same module object.

    FSDP2: each module whose class name is in `basic_modules` becomes its own shard unit, then the root.
    `enable_full_shard=False` keeps parameters gathered between forward and backward (ZeRO-2 style).
    A model built on `meta` is materialised after sharding, so no rank ever holds the full model unless it reads
    the checkpoint (rank 0 with `broadcast_model_weights_from_rank0`).
    `expert_zero_comm` (optimizer.muon_expert_zero_comm): with expert parallel, FSDP shards whole experts (dim 0)
    over ep_fsdp instead of their hidden dim, when the local experts split evenly (else a warning, and dim 1).
    `enable_compile`: `torch.compile` each basic module's forward (decoder layers, vision blocks; see
    `compile_basic_modules`).
    """
    state = get_parallel_state()
    if state.sp_enabled and state.tp_enabled:
        raise NotImplementedError(
            f"ulysses_size={state.ulysses_size} with tp_size={state.tp_size}: Ulysses sequence parallel and tensor "
            "parallel do not compose yet; use one of them"
        )
    if state.sp_enabled:  # attention gathers the sequence per head; parameters stay replicated over sp
        from ..models.multimodal import enable_multimodal_sequence_parallel, is_multimodal

        if is_multimodal(model.config):  # each rank keeps the visual embeddings of its own sequence shard
            enable_multimodal_sequence_parallel(model, state.sp_group)  # (refuses the families it cannot shard)
        apply_ulysses(model, async_enabled=state.async_enabled)
    if state.tp_enabled:  # TP first: FSDP2 then shards the tp DTensors over dp_shard (2-D parameters)
        if state.mode == "ddp":
            raise ValueError("tensor parallel (tp_size > 1) needs fsdp_mode=fsdp2, not ddp")
        apply_tensor_parallel(model, state.tp_mesh)
    if enable_gradient_checkpointing:
        _enable_gradient_checkpointing(model, enable_reentrant)
    if enable_compile:  # after checkpointing is set, which the compiled forward takes over
        if enable_gradient_checkpointing and enable_reentrant:
            raise ValueError(
                "model.ops_implementation.compile with train.gradient_checkpointing.enable_reentrant: compiled layers "
                "checkpoint non-reentrantly; set enable_reentrant false"
            )
        compile_basic_modules(_basic_module_instances(model, basic_modules or []))
    on_meta = init_device == "meta" or any(p.is_meta for p in model.parameters())
    reference_init = _reference_init(model) if on_meta and weights_path is None else None

    if state.mode == "ddp":
        if enable_fsdp_offload or _mixed_precision_policy(mixed_precision) is not None:
            raise ValueError("fsdp_config.offload and mixed_precision need fsdp_mode=fsdp2, not ddp")
        if state.ep_enabled:
            raise ValueError("expert parallel needs fsdp_mode=fsdp2, not ddp")
        if on_meta:
            materialize_meta_model(
                model, weights_path, broadcast_model_weights_from_rank0, max_load_broadcast_size, reference_init
            )
        model.to(get_device())
        # sequence-parallel ranks hold the same parameters but different tokens: their gradients are summed too
        replicate(model, device_mesh=state.flat_meshes["dp_sp"] if state.sp_enabled else state.dp_mesh)
        logger.info(f"DDP over {state.dp_size} ranks")
        return model

    mesh = state.fsdp_mesh
    mp_policy = _mixed_precision_policy(mixed_precision) or MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=get_device_type() == "cuda") if enable_fsdp_offload else None
    # None: reshard, except over a single rank, where keeping the gathered (cast) copies costs 2 bytes per
    # parameter and spares backward a second gather and cast of every unit, the bulk of FSDP's host time there
    if enable_reshard_after_forward is None:
        enable_reshard_after_forward = mesh.size() > 1
    reshard = enable_reshard_after_forward and enable_full_shard
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard, "mp_policy": mp_policy}
    if offload is not None:
        kwargs["offload_policy"] = offload
    if state.ep_enabled:  # experts first: sharded over ep by the plan, then FSDP over ep_fsdp
        ep_fsdp = state.extra_mesh("ep")["ep_fsdp"]
        placement = partial(expert_shard_placement, zero_comm=expert_zero_comm, ep_fsdp_size=ep_fsdp.size())
        uneven = False
        for experts in apply_expert_parallel(model, state):
            if expert_zero_comm and not uneven and any(placement(p).dim != 0 for p in experts.parameters(False)):
                uneven = True  # warn once, not once per layer
                logger.warning(
                    f"muon_expert_zero_comm: {type(experts).__name__}'s local experts do not split evenly over "
                    f"ep_fsdp={ep_fsdp.size()} ((num_experts / ep_size) % ep_fsdp_size != 0): sharding their "
                    "hidden dim instead; Muon gathers them over ep_fsdp (moe_gather_3d)"
                )
            fully_shard(experts, **dict(kwargs, mesh=ep_fsdp), shard_placement_fn=placement)
    units = _basic_module_instances(model, basic_modules or [])
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if enable_forward_prefetch:
        for chain in _prefetch_chains(units):
            for current, following in zip(chain, chain[1:]):
                current.set_modules_to_forward_prefetch([following])

    if on_meta:
        materialize_meta_model(
            model, weights_path, broadcast_model_weights_from_rank0, max_load_broadcast_size, reference_init
        )
    logger.info(
        f"FSDP2 over mesh {tuple(mesh.shape)} with {len(units)} units; reshard_after_forward={reshard}, "
        f"mixed_precision={mp_policy.param_dtype is not None}, offload={offload is not None}, "
        f"expert_parallel={state.ep_size if state.ep_enabled else 1}, tensor_parallel={state.tp_size}"
    )
    return model
