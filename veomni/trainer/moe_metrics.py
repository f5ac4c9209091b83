"""MoE metrics of a training step: the router load-balancing (aux) loss on its own, and how evenly each MoE layer's
router spread its tokens over the experts.

Counting: a forward pre-hook on every experts module (transformers 5's `use_experts_implementation` classes, called
as `experts(hidden_states, top_k_index, top_k_weights)`) adds a count of the router's top-k indices to one
[MoE layers, experts] tensor on the device. That is what the router chose, counted on the rank that routed the token
and before any expert-parallel dispatch, so each (token, choice) is counted once whatever the layout. Every routed
token counts, padding included (Ulysses pads a sequence to a multiple of the SP size; the experts compute those
rows too). An activation-checkpointing recompute runs the hook again inside backward: those calls are not counted.

Reduction: the counts and the aux-loss sum ride in the step's one loss all-reduce over the data x sequence-parallel
ranks (tensor-parallel ranks hold the same tokens, so they are not summed; expert-parallel ranks are data ranks).
No collective of their own, and the reduced tensor's shape comes from the model (layers x experts and whether the
config outputs router logits), never from a rank's data: every rank issues the same all-reduce.

Reported per step (`step_metrics`): with `count_e` an expert's (token, choice) pairs summed over the micro-batches
and ranks of the step, `load_e = count_e / mean_e(count_e)` (1 is uniform), per layer its max and min and the
normalised entropy `-sum_e p_e log p_e / log E` of `p_e = count_e / sum(count)` (1 uniform, 0 one expert); per-layer
lists go to metrics.jsonl, the worst layer (largest max load, smallest min load and entropy) to every sink.
`aux_loss` is the token-weighted mean of the per-document load-balancing loss (not scaled by the coefficient), so
`loss = lm_loss + router_aux_loss_coef * aux_loss`: `loss` stays the objective that is backpropagated.
"""

import math
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from ..compat.torch import in_backward
from ..compat.transformers import is_experts_module


class RoutingCounter:
    """Per-expert (token, choice) counts of every MoE layer of `model`, accumulated until `reset`."""

    def __init__(self, model: nn.Module, device: torch.device):
        modules = [m for m in model.modules() if is_experts_module(m)]  # one per MoE layer, in model order
        self.num_layers = len(modules)
        self.num_experts = int(modules[0].num_experts) if modules else 0
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=device)
        for layer, module in enumerate(modules):
            module.register_forward_pre_hook(self._hook(layer), with_kwargs=True)

    def _hook(self, layer: int):
        # compiled decoder layers run it eagerly (it reads whether autograd is in backward)
        @torch.compiler.disable
        def count(module, args, kwargs):
            if in_backward():  # a checkpoint recompute: these tokens were counted in the forward
                return
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            # a fixed-shape count (bincount's output size depends on the data: a device sync on CUDA)
            flat = index.reshape(-1).to(self.counts.device)
            self.counts[layer].index_add_(0, flat, torch.ones_like(flat))

        return count

    def reset(self) -> None:
        self.counts.zero_()


def load_stats(counts: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per layer (rows of `counts` [layers, experts]): max and min load relative to uniform, normalised entropy."""
    counts = counts.double()
    experts = counts.shape[-1]
    total = counts.sum(-1, keepdim=True)
    share = counts / total.clamp(min=1)
    load = share * experts  # count / mean count
    plogp = torch.where(share > 0, share * share.clamp(min=1e-300).log(), torch.zeros_like(share))
    entropy = -plogp.sum(-1) / math.log(experts) if experts > 1 else torch.ones(counts.shape[0], dtype=torch.float64)
    return {"max_load": load.max(-1).values, "min_load": load.min(-1).values, "entropy": entropy}


class MoEMetrics:
    """What the trainer asks of the MoE metrics each step: `start_step`, `add_aux` (per micro-batch),
    `all_reduce(loss_sum, group)` in place of the loss all-reduce, then `step_metrics`. A dense model has no
    layers and no aux loss: then it is the plain loss all-reduce and adds no metric."""

    def __init__(self, model: nn.Module, device: torch.device):
        config = getattr(model, "config", None)
        self.has_aux = bool(getattr(config, "output_router_logits", False))
        self.aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        self.counter = RoutingCounter(model, device)
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.reduced = None  # [aux_sum, counts...] of the last step, summed over the ranks

    def start_step(self) -> None:
        self.counter.reset()
        self.aux_sum.zero_()

    def add_aux(self, aux_sum: torch.Tensor) -> None:
        self.aux_sum += aux_sum.detach().double()

    def all_reduce(self, loss_sum: torch.Tensor, group) -> torch.Tensor:
        """Sum `loss_sum` (float64, 0-d) over `group`, the aux sum and the routing counts with it; returns the sum."""
        parts = [loss_sum.reshape(1)]
        if self.has_aux:
            parts.append(self.aux_sum.reshape(1))
        parts.append(self.counter.counts.reshape(-1).double())  # exact in float64 up to 2**53 tokens
        packed = torch.cat(parts)
        dist.all_reduce(packed, group=group)
        self.reduced = packed[1:]
        return packed[0]

    def step_tensors(self) -> Dict[str, torch.Tensor]:
        """The step's MoE statistics as device tensors (read later, without stalling the step): `aux_sum`, the worst
        layer's loads and entropy, and the per-layer lists; `finish` turns them into the logged metrics."""
        out: Dict[str, torch.Tensor] = {}
        reduced = self.reduced
        if self.has_aux:
            out["aux_sum"] = reduced[0]
            reduced = reduced[1:]
        if self.counter.num_layers:
            stats = load_stats(reduced.view(self.counter.num_layers, self.counter.num_experts))
            out.update(
                moe_max_load=stats["max_load"].max(),
                moe_min_load=stats["min_load"].min(),
                moe_entropy=stats["entropy"].min(),
            )
            out.update({f"moe_{name}_layers": s for name, s in stats.items()})
        return out

    def finish(self, metrics: Dict[str, object], loss_tokens: int) -> None:
        """`step_tensors`' values read on the host (floats and lists) -> the logged metrics, in place."""
        if "aux_sum" in metrics:
            aux = metrics.pop("aux_sum") / max(loss_tokens, 1)
            metrics.update(aux_loss=aux, lm_loss=metrics["loss"] - self.aux_coef * aux)
        for name in ("max_load", "min_load", "entropy"):
            if f"moe_{name}_layers" in metrics:
                metrics[f"moe_{name}_layers"] = [round(v, 4) for v in metrics[f"moe_{name}_layers"]]

    def step_metrics(self, loss: float, loss_tokens: int) -> Dict[str, object]:
        """`step_tensors` read at once (tests and tools; the trainer reads them a step later)."""
        out: Dict[str, object] = {"loss": loss}
        for name, t in self.step_tensors().items():
            out[name] = t.item() if t.dim() == 0 else t.tolist()
        self.finish(out, loss_tokens)
        del out["loss"]
        return out

    def last_counts(self) -> List[List[int]]:
        """The last step's per-layer, per-expert counts summed over the ranks (for tests and debugging)."""
        counts = self.reduced[1:] if self.has_aux else self.reduced
        return counts.view(self.counter.num_layers, self.counter.num_experts).long().tolist()


def moe_summary(metrics: Dict[str, object]) -> str:
    """The log line's MoE part ('' for a dense model)."""
    parts = []
    if "aux_loss" in metrics:
        parts.append(f"aux_loss {metrics['aux_loss']:.4f}")
    if "moe_max_load" in metrics:
        parts.append(
            f"expert load max {metrics['moe_max_load']:.2f} min {metrics['moe_min_load']:.2f} "
            f"entropy {metrics['moe_entropy']:.3f}"
        )
    return (" " + " ".join(parts)) if parts else ""
