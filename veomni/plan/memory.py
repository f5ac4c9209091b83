"""Peak memory of one rank: the tensors that live through the step, plus the largest transient ones.

    peak = parameters + gradients + optimizer state          (exact: the local shards, veomni/plan/shards.py)
         + FSDP gathered parameters                           (compute dtype)
         + activations kept for backward (one micro-batch)    (veomni/plan/model_shape.py)
         + max(one layer's backward working set, output head + loss)

FSDP2 gathered peak: resharding after forward, the root unit (embeddings, final norm, head) stays gathered
through the step, and in backward a layer unit is gathered while the next is prefetched, its unsharded gradient
(compute dtype) and its reduce-scatter input (reduce dtype) exist at once: root + 3 layer copies + a layer in
the reduce dtype. Without resharding every unit stays gathered. A one-rank unit in its own dtype needs no copy.
Activation bytes assume every micro-batch holds its full token budget (the dyn_bsz packer fills toward it).
"""

import dataclasses
from typing import Dict

from .comm import StepShape
from .model_shape import ModelShape
from .shards import RankPlan

GIB = 2**30


@dataclasses.dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    transient: float

    @property
    def peak(self) -> float:
        return sum(dataclasses.astuple(self))

    def as_dict(self) -> Dict[str, float]:
        return {**dataclasses.asdict(self), "peak": self.peak}


def gathered_bytes(plan: RankPlan, step: StepShape, param_bytes: int) -> float:
    """Gathered (unsharded, compute-dtype) parameters at FSDP2's peak, in backward."""

    def full(unit, dtype_bytes):
        if unit.shard_size == 1 and dtype_bytes == param_bytes:
            return 0  # FSDP computes on the local parameter itself
        return unit.shard_size * unit.padded_numel * dtype_bytes

    c, r = step.compute_bytes, step.reduce_bytes
    root = sum(full(u, c) for u in plan.units if u.is_root)
    layers = [u for u in plan.units if not u.is_root]
    # a decoder layer unit, and with expert parallel the experts unit it holds (gathered together)
    layer = max((full(u, c) for u in layers if u.label == "fsdp"), default=0)
    layer += max((full(u, c) for u in layers if u.label == "ep_fsdp"), default=0)
    layer_numel = layer / c if c else 0
    if not plan.reshard:
        return sum(full(u, c) for u in plan.units) + layer + layer_numel * r
    return root + 3 * layer + layer_numel * r


def predict_memory(plan: RankPlan, shape: ModelShape, step: StepShape, param_bytes: int) -> Memory:
    """Peak memory of this rank for the largest micro-batch of `step` (its (local tokens, loss tokens))."""
    tokens = max(t for t, _ in step.micro_batches)
    loss_tokens = max(n for _, n in step.micro_batches)
    c = step.compute_bytes
    kept, working = shape.activation_bytes(tokens, c, step.tp, step.ep, step.checkpointing)
    head = shape.loss_bytes(loss_tokens, c, step.loss_chunk, step.tp)
    return Memory(
        params=plan.param_bytes,
        grads=plan.grad_bytes,
        optimizer=plan.optimizer_bytes,
        gathered=gathered_bytes(plan, step, param_bytes),
        activations=kept,
        transient=max(working, head),
    )
