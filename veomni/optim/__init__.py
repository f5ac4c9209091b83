"""Optimizers (AdamW, AnyPrecisionAdamW, Muon, multi-optimizer) and learning-rate schedules."""

from .anyprecision_adamw import AnyPrecisionAdamW
from .lr_scheduler import build_lr_scheduler
from .optimizer import build_optimizer

__all__ = ["AnyPrecisionAdamW", "build_lr_scheduler", "build_optimizer"]
