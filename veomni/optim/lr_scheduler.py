"""`build_lr_scheduler`: linear warmup from lr_start, then constant / linear / cosine decay to lr_min."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def lr_at(
    step: int,
    train_steps: int,
    lr: float,
    lr_min: float,
    lr_start: float,
    warmup_ratio: float,
    decay_style: str,
    decay_ratio: float,
) -> float:
    warmup = int(train_steps * warmup_ratio)
    if step < warmup:  # step 0 already moves: the last warmup step reaches the peak
        return lr_start + (lr - lr_start) * (step + 1) / warmup
    if decay_style == "constant":
        return lr
    decay_steps = max(int(train_steps * decay_ratio) - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    if decay_style == "linear":
        return lr + (lr_min - lr) * progress
    if decay_style == "cosine":
        return lr_min + (lr - lr_min) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_decay_style {decay_style!r}; choose constant, linear or cosine")


def build_lr_scheduler(
    optimizer: Optimizer,
    train_steps: int,
    lr: float = None,
    lr_min: float = 1e-7,
    lr_decay_style: str = "constant",
    lr_decay_ratio: float = 1.0,
    lr_warmup_ratio: float = 0.0,
    lr_start: float = 0.0,
) -> LambdaLR:
    """Every param group follows the same curve, scaled to its own initial lr (so a Muon group keeps its ratio)."""
    peak = lr if lr is not None else optimizer.param_groups[0]["lr"]
    if peak <= 0:
        raise ValueError(f"peak lr must be positive, got {peak}")

    def factor(step: int) -> float:
        return lr_at(step, train_steps, peak, lr_min, lr_start, lr_warmup_ratio, lr_decay_style, lr_decay_ratio) / peak

    return LambdaLR(optimizer, factor)  # (which calls factor(0) at once: a bad decay style raises here)
