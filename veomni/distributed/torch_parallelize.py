"""`build_parallelize_model`: the public entry that makes a model ready to train on the parallel state's meshes.

`parallelize` runs a short sequence of steps, each one function with one job:

    apply_sp       Ulysses sequence parallel (sequence_parallel/apply.py)
    apply_tp       tensor parallel, by the family's plan (tensor_parallel.py)
    apply_fp8      torchao float8 training of the large linear layers (fp8.py)
    apply_ac       activation checkpointing (activation_checkpointing.py)
    apply_compile  torch.compile of each basic module (compile.py)
    apply_ep       expert parallel, by the family's plan (parallel_plan.py)
    apply_fsdp     FSDP2 / HSDP units, experts first (fsdp.py)  -- or apply_ddp
    materialize    a meta-built model allocated and filled after sharding (weight_loading.py)

Per-family differences live in the plans (TP_PLANS, PARALLEL_PLANS), not in branches here.
"""

import functools
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..arguments.arguments_types import MixedPrecisionArguments, VeOmniArguments
from ..compat.transformers import config_attn_implementation
from ..models.multimodal import model_class_for
from ..utils.device import get_device_type
from ..utils.logging import get_logger
from .activation_checkpointing import apply_ac
from .clip_grad_norm import bind_clip_grad_norm
from .compile import apply_compile
from .fp8 import apply_fp8
from .fsdp import apply_ddp, apply_fsdp, basic_module_instances, check_ddp_options, no_split_module_names
from .mixed_precision import keep_fp32_compute, resolved_compute_dtype
from .parallel_plan import apply_ep
from .parallel_state import ParallelState, get_parallel_state
from .sequence_parallel import apply_sp
from .tensor_parallel import apply_tp
from .weight_loading import materialize_meta_model

logger = get_logger(__name__)

__all__ = ["basic_module_instances", "build_parallelize_model", "no_split_module_names", "parallelize"]


def parallelize(
    model: nn.Module,
    state: ParallelState,
    args,
    basic_modules: Optional[Sequence[str]] = None,
    materialize: bool = True,
) -> nn.Module:
    """Apply each step the parallel state and the config (`args`, a VeOmniArguments) ask for, in the order they
    compose; returns `model`. `basic_modules` (the FSDP units and compiled units): by default the model's
    no-split modules and `model.basic_modules`. `materialize=False` leaves a meta model unallocated (the planner
    reads its shards' shapes only)."""
    train, fsdp = args.train, args.train.accelerator.fsdp_config
    if basic_modules is None:
        basic_modules = sorted(set(no_split_module_names(model)) | set(args.model.basic_modules))
    if state.mode == "ddp":
        check_ddp_options(state, fsdp)  # before anything is built
    if state.sp_enabled:
        apply_sp(model, state)
    if state.tp_enabled:  # before FSDP, which then shards the tp DTensors over dp_shard (2-D parameters)
        apply_tp(model, state.tp_mesh)
    if train.fp8 != "off":  # before checkpointing and compile wrap the layers (torchao's order)
        apply_fp8(model, train.fp8, state.tp_size)
    checkpointing = train.gradient_checkpointing
    if checkpointing.enable:
        apply_ac(model, checkpointing.enable_reentrant)
    if args.model.ops_implementation.compile:  # after checkpointing is set, which the compiled forward takes over
        apply_compile(model, basic_modules, checkpointing.enable and checkpointing.enable_reentrant)
    fill = _materializer(model, args) if materialize else lambda: None
    if state.mode == "ddp":
        fill()
        apply_ddp(model, state, fsdp.mixed_precision)
        return model
    experts = apply_ep(model, state) if state.ep_enabled else []  # split over ep before FSDP shards over ep_fsdp
    zero_comm = train.optimizer.type == "muon" and train.optimizer.muon_expert_zero_comm
    apply_fsdp(model, state, fsdp, basic_modules, experts, zero_comm)
    fill()  # after sharding: no rank ever holds the full model unless it reads the checkpoint
    return model


def _materializer(model: nn.Module, args) -> Callable[[], None]:
    """What allocates and fills a meta-built model once it is sharded (nothing for a model built on a device).
    Decided before any step runs, since sharding changes what the parameters look like. Without a checkpoint, rank 0
    initialises a full-size model (`reference_init`) and broadcasts it."""
    if not (args.train.init_device == "meta" or any(p.is_meta for p in model.parameters())):
        return lambda: None

    def reference_init() -> nn.Module:
        config, dtype = model.config, next(model.parameters()).dtype
        attn = config_attn_implementation(config)
        return model_class_for(config).from_config(config, attn_implementation=attn, dtype=dtype)

    return lambda: materialize_meta_model(
        model,
        args.model.model_path,
        args.train.broadcast_model_weights_from_rank0,
        args.train.accelerator.fsdp_config.max_load_broadcast_size,
        reference_init,
    )


# build_parallelize_model's keywords -> the config keys they spell
SEED_KEYWORDS = {
    "init_device": "train.init_device",
    "weights_path": "model.model_path",  # a meta model is filled from it
    "enable_full_shard": "train.accelerator.fsdp_config.full_shard",  # False: ZeRO-2 style
    "enable_reshard_after_forward": "train.accelerator.fsdp_config.reshard_after_forward",
    "mixed_precision": "train.accelerator.fsdp_config.mixed_precision",  # the group, a bool, or None: none
    "enable_fsdp_offload": "train.accelerator.fsdp_config.offload",
    "enable_forward_prefetch": "train.accelerator.fsdp_config.forward_prefetch",
    "max_load_broadcast_size": "train.accelerator.fsdp_config.max_load_broadcast_size",
    "enable_gradient_checkpointing": "train.gradient_checkpointing.enable",
    "enable_reentrant": "train.gradient_checkpointing.enable_reentrant",
    "broadcast_model_weights_from_rank0": "train.broadcast_model_weights_from_rank0",
    "expert_zero_comm": "train.optimizer.muon_expert_zero_comm",  # with Muon: whole experts per rank
    "enable_compile": "model.ops_implementation.compile",
}


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
    enable_mixed_precision: Optional[bool] = None,
    **ignored: Any,
) -> nn.Module:
    """The seed's entry: `parallelize` on `get_parallel_state()` with the config these keywords spell (each sets the
    key `SEED_KEYWORDS` names); returns the same module object. `basic_modules`: the FSDP (and compiled) units,
    exactly these class names.

    VeOmni's calling convention works too: `enable_mixed_precision=True/False` (VeOmni's name before its
    MixedPrecisionConfig, and the seed's) is `mixed_precision=MixedPrecisionConfig(enable=...)`, and keywords VeOmni
    takes that mean nothing here are accepted with one warning naming them (`fqn_to_index_mapping`: the loader
    reads the safetensors index itself). The returned model has `model.clip_grad_norm_(max_norm)`, which returns the total norm as a tensor over
    every gradient, experts included; and when `mixed_precision` resolves to float32 compute, an enclosing autocast
    does not lower it (mixed_precision.py)."""
    if enable_mixed_precision is not None:
        if mixed_precision is not None:
            raise ValueError("build_parallelize_model: pass mixed_precision or enable_mixed_precision, not both")
        mixed_precision = MixedPrecisionArguments(enable=bool(enable_mixed_precision))
    if ignored:
        logger.warning(f"build_parallelize_model ignores {sorted(ignored)}: no effect in this implementation")
    given = locals()
    args = VeOmniArguments()
    for keyword, key in SEED_KEYWORDS.items():
        *groups, leaf = key.split(".")
        setattr(functools.reduce(getattr, groups, args), leaf, given[keyword])
    if expert_zero_comm:  # (a Muon key: the trainer honours it with Muon only)
        args.train.optimizer.type = "muon"
    state = get_parallel_state()
    model = parallelize(model, state, args, basic_modules=list(basic_modules or []))
    bind_clip_grad_norm(model)
    compute = resolved_compute_dtype(mixed_precision, get_device_type(), state.mode)
    if mixed_precision is not None and compute == torch.float32:
        keep_fp32_compute(model, get_device_type())
    return model
