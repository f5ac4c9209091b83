"""`build_optimizer`: AdamW variants with no weight decay on biases and norms, and Muon (+ AdamW) as a
MultiOptimizer."""

from typing import Callable, Dict, List, Optional, Sequence, Set

import torch
from torch import nn

from ..compat.torch import fused_kernel_devices
from ..utils.logging import get_logger
from .anyprecision_adamw import AnyPrecisionAdamW
from .local_shards import LocalShardAdamW
from .multi_optimizer import MultiOptimizer
from .muon import PATHS, DistributedMuon

logger = get_logger(__name__)


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, norm weights and other vectors take no weight decay."""
    return param.ndim < 2 or name.endswith(".bias") or "norm" in name.lower()


def param_groups(model: nn.Module, weight_decay: float, exclude: Set[int] = frozenset()) -> List[Dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in exclude:
            (no_decay if is_no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _local_adamw(groups: List[Dict], lr, betas, eps, fused: Optional[bool]) -> LocalShardAdamW:
    """AdamW with `fused` (one kernel per parameter group, ~5x faster than `foreach` on CPU: 8.5 vs 41 ms per step
    for 4M FSDP2 parameters) wherever torch has the kernel for every parameter's device; `foreach` elsewhere.
    `fused=True` insists (torch raises where it cannot), `fused=False` keeps `foreach`."""
    if fused is None:
        supported = fused_kernel_devices()
        fused = all(p.device.type in supported and p.is_floating_point() for g in groups for p in g["params"])
    kernel = {"fused": True} if fused else {"foreach": True}
    return LocalShardAdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **kernel)


def _adamw(model, lr, weight_decay, betas, eps, fused: Optional[bool] = None):
    return _local_adamw(param_groups(model, weight_decay), lr, betas, eps, fused)


def _anyprecision_adamw(model, lr, weight_decay, betas, eps, **kwargs):
    return AnyPrecisionAdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, **kwargs)


def _embedding_ids(model: nn.Module) -> Set[int]:
    """Input embeddings and lm_head (tied or not): matrices, but not hidden ones, so AdamW trains them."""
    ids = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)() if hasattr(model, getter) else None
        except NotImplementedError:
            module = None
        if module is not None:
            ids.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():  # models without the HF getters
        if "embed" in name or name.startswith("lm_head") or ".lm_head." in name:
            ids.add(id(param))
    return ids


# MoE routers: transformers names them `<Family>TopKRouter` (mlp.gate), plus Qwen2-MoE's `shared_expert_gate`
_ROUTER_ATTRS = ("gate", "router", "shared_expert_gate")


def _router_ids(model: nn.Module) -> Set[int]:
    """MoE router (gate) weights: matrices, but classifier heads over the experts, so AdamW trains them.

    Muon's update orthogonalises a matrix, i.e. gives every direction of the [num_experts, hidden] router the
    same step size; that is meant for hidden weights, not for a head whose rows are per-expert scores (the
    reason embeddings and lm_head stay on AdamW, as in Keller Jordan's and Moonlight's recipes). MoE trainers
    that split Muon from AdamW by role keep the router on AdamW as well. Dense MLPs' `gate_proj` is not a router.
    """
    ids = set()
    for name, module in model.named_modules():
        attr = name.rsplit(".", 1)[-1]
        if "router" in type(module).__name__.lower() or attr in _ROUTER_ATTRS:
            ids.update(id(p) for p in module.parameters())
    return ids


def muon_params(model: nn.Module) -> List[torch.Tensor]:
    """What Muon trains: 2-D hidden weights and 3-D expert stacks. Not embeddings, lm_head, MoE routers, biases
    or norms."""
    excluded = _embedding_ids(model) | _router_ids(model)
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and p.ndim in (2, 3) and id(p) not in excluded and not is_no_decay(name, p)
    ]


# build_optimizer's Muon keywords -> DistributedMuon's arguments (whose defaults are the config's)
_MUON_KEYS = {f"muon_{name}": name for name in ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "eps")}
_MUON_KEYS.update(muon_ns_coefficients="ns_coefficients", muon_adjust_lr_fn="adjust_lr_fn")
_MUON_KEYS.update(ns_dtype="ns_dtype", strategy="strategy", bucket_numel="bucket_numel")


def _muon(model, lr, weight_decay, betas, eps, muon_expert_zero_comm: bool = False, fused=None, **muon_kwargs):
    """MultiOptimizer {"adamw": AdamW(lr, weight_decay, betas, eps), "muon": DistributedMuon(...)}.

    `muon_kwargs` (the keys of `_MUON_KEYS`) are DistributedMuon's arguments: `muon_<name>` is its `<name>`.
    `muon_expert_zero_comm` is honoured where the model is sharded (build_parallelize_model's expert_zero_comm):
    here it only reports expert stacks that still need communication.
    """
    unknown = sorted(set(muon_kwargs) - set(_MUON_KEYS))
    if unknown:
        raise TypeError(f"unknown Muon options {unknown}; choose from {sorted(_MUON_KEYS)}")
    matrices = muon_params(model)
    taken = {id(p) for p in matrices}
    optimizers = {}
    rest = param_groups(model, weight_decay, exclude=taken)
    if rest:
        optimizers["adamw"] = _local_adamw(rest, lr, betas, eps, fused)
    if matrices:
        muon = DistributedMuon(matrices, **{_MUON_KEYS[k]: v for k, v in muon_kwargs.items()})
        counts = {path: sum(muon.path_of(p) == path for p in matrices) for path in PATHS}
        logger.info(f"Muon on {len(matrices)} matrices/expert stacks ({counts}); AdamW on the other parameters")
        if muon_expert_zero_comm and counts["moe_gather_3d"]:
            logger.warning(
                f"muon_expert_zero_comm is on but {counts['moe_gather_3d']} expert stacks are split inside their "
                "matrices (moe_gather_3d): their Newton-Schulz communicates over ep_fsdp"
            )
        optimizers["muon"] = muon
    return MultiOptimizer(optimizers)


OPTIMIZERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "anyprecision_adamw": _anyprecision_adamw,
    "muon": _muon,
}


def build_optimizer(
    model: nn.Module,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    optimizer_type: str = "adamw",
    **kwargs,
) -> torch.optim.Optimizer:
    """Build the optimizer named by `optimizer_type` (`train.optimizer.type`) over the model's parameters.

    Extra keyword arguments go to that optimizer (e.g. `use_kahan_summation` for anyprecision_adamw,
    `muon_*` knobs for muon).
    """
    if optimizer_type not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer type {optimizer_type!r}; choose one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[optimizer_type](model, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, **kwargs)
