"""MultiOptimizer: several optimizers over disjoint parameter sets, driven as one (e.g. Muon + AdamW)."""

from typing import Dict, List, Optional

import torch

from ..compat.torch import reset_optimizer_step_hooks


def closure_loss(closure) -> Optional[torch.Tensor]:
    """An optimizer step's `closure()` (re-evaluating the loss with gradients on), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def named_optimizers(optimizer) -> Dict[str, torch.optim.Optimizer]:
    """Each inner optimizer of a multi-optimizer (`.optimizers_dict`), or the optimizer itself."""
    inner = getattr(optimizer, "optimizers_dict", None)
    return dict(inner) if inner else {"optimizer": optimizer}


class MultiOptimizer(torch.optim.Optimizer):
    """Steps, zeroes and schedules its inner optimizers together; `optimizers_dict` names them for checkpoints
    and offloading, which handle each one separately.

    `param_groups` is the live concatenation of the inner optimizers' groups (in `optimizers_dict` order), so an
    LR scheduler built on the MultiOptimizer drives every group from its own initial lr, and keeps doing so after
    an inner `load_state_dict` has replaced that optimizer's group dicts.
    """

    def __init__(self, optimizers: Dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("MultiOptimizer needs at least one optimizer")
        self.optimizers_dict = dict(optimizers)
        seen = set()
        for name, opt in self.optimizers_dict.items():
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError(f"a parameter is given to more than one optimizer (again in {name!r})")
                    seen.add(id(p))
        self.defaults = {}
        reset_optimizer_step_hooks(self)

    # VeOmni's MultiOptimizer interface, read by its clients (verl's offload walks `optimizers_dict` when
    # `_is_multi_optimizer` is set; `key_names` are the inner optimizers' names, in stepping order)
    _is_multi_optimizer = True

    @property
    def key_names(self) -> List[str]:
        return list(self.optimizers_dict)

    @property
    def param_groups(self) -> List[dict]:
        return [g for opt in self.optimizers_dict.values() for g in opt.param_groups]

    @property
    def state(self):
        return {p: p_state for opt in self.optimizers_dict.values() for p, p_state in opt.state.items()}

    def named_lrs(self) -> Dict[str, float]:
        """Current lr of each inner optimizer (its first group), for logging: {"adamw": ..., "muon": ...}."""
        return {name: opt.param_groups[0]["lr"] for name, opt in self.optimizers_dict.items()}

    def step(self, closure=None):
        loss = closure_loss(closure)
        for opt in self.optimizers_dict.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers_dict.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {name: opt.state_dict() for name, opt in self.optimizers_dict.items()}

    def load_state_dict(self, state_dict) -> None:
        for name, opt in self.optimizers_dict.items():
            opt.load_state_dict(state_dict[name])
