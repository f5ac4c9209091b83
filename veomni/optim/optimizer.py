"""`build_optimizer`: AdamW variants with no weight decay on biases and norms (Muon plugs in here too)."""

from typing import Callable, Dict, List, Sequence

import torch
from torch import nn

from .anyprecision_adamw import AnyPrecisionAdamW


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, norm weights and other vectors take no weight decay."""
    return param.ndim < 2 or name.endswith(".bias") or "norm" in name.lower()


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if is_no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _adamw(model, lr, weight_decay, betas, eps, **kwargs):
    fused = kwargs.pop("fused", None)
    extra = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, **extra)


def _anyprecision_adamw(model, lr, weight_decay, betas, eps, **kwargs):
    return AnyPrecisionAdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, **kwargs)


def _muon(model, lr, weight_decay, betas, eps, **kwargs):
    raise NotImplementedError("optimizer type 'muon' is not implemented yet; use 'adamw' or 'anyprecision_adamw'")


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
