"""MultiOptimizer: several optimizers over disjoint parameter sets, driven as one (e.g. Muon + AdamW)."""

from typing import Dict

import torch


class MultiOptimizer(torch.optim.Optimizer):
    """Steps, zeroes and schedules its inner optimizers together; `optimizers_dict` names them for checkpoints
    and offloading, which handle each one separately."""

    def __init__(self, optimizers: Dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("MultiOptimizer needs at least one optimizer")
        self.optimizers_dict = dict(optimizers)
        # param_groups is the concatenation, so LR schedulers see every group (in a stable order)
        self.param_groups = [g for opt in self.optimizers_dict.values() for g in opt.param_groups]
        self.defaults = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @property
    def state(self):
        merged = {}
        for opt in self.optimizers_dict.values():
            merged.update(opt.state)
        return merged

    def step(self, closure=None):
        loss = closure() if closure is not None else None
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
