"""Global gradient norm and clipping that is right for any mix of plain tensors and DTensors.

Gradients are grouped by (mesh, placements) so each group's norm is reduced over its own mesh exactly once
(FSDP shards, expert-parallel shards and replicated tensors each count once), then combined.
"""

from collections import defaultdict
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    groups = defaultdict(list)
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else ("local", g.device)
        groups[key].append(g)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


@torch.no_grad()
def clip_grad_norm(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> float:
    """Clip in place when `max_norm > 0`; return the total norm before clipping as a Python float."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = total_grad_norm(params, norm_type).item()
    coef = max_norm / (total + 1e-6)
    if max_norm > 0 and coef < 1.0:  # a Python scalar works for DTensor and plain grads alike
        torch._foreach_mul_([p.grad for p in params], coef)
    return total
