"""AnyPrecisionAdamW (as in Llama-recipes): AdamW whose moments and an optional Kahan compensation buffer live
in chosen dtypes, so pure-bf16 training keeps fp32-like accuracy at bf16 memory."""

from typing import Iterable, Tuple

import torch
from torch.optim import Optimizer

from .multi_optimizer import closure_loss


class AnyPrecisionAdamW(Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        use_kahan_summation: bool = False,
        momentum_dtype: torch.dtype = torch.float32,
        variance_dtype: torch.dtype = torch.float32,
        compensation_buffer_dtype: torch.dtype = torch.bfloat16,
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            use_kahan_summation=use_kahan_summation,
            momentum_dtype=momentum_dtype,
            variance_dtype=variance_dtype,
            compensation_buffer_dtype=compensation_buffer_dtype,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            kahan = group["use_kahan_summation"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=group["momentum_dtype"])
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=group["variance_dtype"])
                    if kahan:
                        state["compensation"] = torch.zeros_like(p, dtype=group["compensation_buffer_dtype"])
                state["step"] += 1
                step = state["step"].item()
                grad = p.grad
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if decay:
                    p.mul_(1 - lr * decay)
                exp_avg.mul_(beta1).add_(grad.to(exp_avg.dtype), alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad.to(exp_avg_sq.dtype), grad.to(exp_avg_sq.dtype), value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                update = (exp_avg / denom).mul_(-step_size)
                if kahan:  # add the update to the running error first, so small steps are not lost in bf16
                    comp = state["compensation"]
                    comp.add_(update.to(comp.dtype))
                    previous = p.detach().clone()
                    p.add_(comp.to(p.dtype))
                    comp.add_(previous.sub_(p).to(comp.dtype))
                else:
                    p.add_(update.to(p.dtype))
        return loss
