"""Optimizers (AdamW, AnyPrecisionAdamW, Muon, multi-optimizer) and learning-rate schedules."""

from .anyprecision_adamw import AnyPrecisionAdamW
from .local_shards import LocalShardAdamW
from .lr_scheduler import build_lr_scheduler
from .multi_optimizer import MultiOptimizer
from .muon import DistributedMuon, Muon, classify_param, zeropower_via_newtonschulz
from .optimizer import build_optimizer

__all__ = [
    "AnyPrecisionAdamW",
    "LocalShardAdamW",
    "DistributedMuon",
    "Muon",
    "MultiOptimizer",
    "build_lr_scheduler",
    "build_optimizer",
    "classify_param",
    "zeropower_via_newtonschulz",
]
