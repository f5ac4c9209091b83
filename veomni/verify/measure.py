"""The planner in a verify run: this rank's predicted bytes of parameters, gradients and optimizer state, and of
the collectives of one step, beside the measured ones (the largest over the ranks, gathered to rank 0)."""

from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..trainer.callbacks import Callback


class PlanMeasure(Callback):
    def __init__(self, trainer):
        self.trainer = trainer
        self.predicted: Optional[Dict[str, float]] = None
        self.measured: Dict[str, float] = {}

    def on_train_begin(self, trainer) -> None:
        from ..plan.runlog import predict_for_trainer

        try:
            memory = predict_for_trainer(trainer)
            self.predicted = {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer}
        except Exception as err:  # a model the planner cannot read: the table says so, the check goes on
            self.predicted = {"error": f"{type(err).__name__}: {err}"}

    def on_step_end(self, trainer, metrics) -> None:
        if self.measured:
            return
        from ..plan.runlog import _tensor_bytes
        from ..plan.shards import nbytes

        params = sum(nbytes(p) for p in trainer.model.parameters())
        self.measured = {"params": params, "optimizer": _tensor_bytes(trainer) - params}

    def result(self) -> Dict[str, Dict[str, float]]:
        return {"predicted": self.predicted or {}, "measured": self.measured}

    def on_train_end(self, trainer) -> None:
        """Every rank: the largest of each figure over the ranks (what must fit on a device)."""
        for table in (self.predicted or {}, self.measured):
            keys = sorted(k for k, v in table.items() if isinstance(v, (int, float)))
            if not keys:
                dist.barrier()  # keep the ranks' collectives in step
                continue
            values = torch.tensor([float(table[k]) for k in keys], dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=trainer._host_group())
            table.update(zip(keys, values.tolist()))
