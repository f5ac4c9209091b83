"""The planner's figures checked on every run: rank 0 logs the predicted memory when training starts, and after
its second step the measured peak beside the prediction (torch.cuda.max_memory_allocated on CUDA; on CPU, where
no allocator keeps a peak, the bytes of parameters and optimizer state, against their exact prediction)."""

import torch

from ..trainer.callbacks import Callback
from ..utils.device import get_device_type
from ..utils.logging import get_logger
from .memory import GIB

logger = get_logger(__name__)


def predict_for_trainer(trainer):
    """The Memory the planner predicts for this rank of this run (its real, sharded model)."""
    from .memory import predict_memory
    from .model_shape import ModelShape
    from .real_plan import reshard_after_forward, step_shape
    from .shards import read_rank_plan

    args, state = trainer.args, trainer.parallel_state
    device_type = get_device_type()
    plan = read_rank_plan(trainer.model, state, args.train.optimizer.type, reshard_after_forward(args, state.fsdp_size))
    tokens = args.train.micro_batch_size * args.data.max_seq_len // state.sp_size
    step = step_shape(args, [(tokens, tokens)], device_type)
    param_bytes = next(trainer.model.parameters()).element_size()
    return predict_memory(plan, ModelShape.from_config(trainer.model.config), step, param_bytes)


def _tensor_bytes(trainer) -> int:
    from .shards import nbytes

    optimizer = trainer.optimizer
    inner = getattr(optimizer, "optimizers", None)
    optimizers = inner.values() if isinstance(inner, dict) else [optimizer]
    states = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(nbytes(p) for p in trainer.model.parameters()) + sum(nbytes(v) for v in states)


class PlanCheckCallback(Callback):
    """Handed to the trainer by the task (tasks/train_text.py): the planner is not part of the training loop."""

    def __init__(self):
        self.predicted, self.steps = None, 0

    def on_train_begin(self, trainer):
        if not trainer.is_main:
            return
        try:
            self.predicted = predict_for_trainer(trainer)
        except Exception as err:  # a model the planner cannot read must not stop training
            logger.warning(f"plan: no memory prediction for this run ({type(err).__name__}: {err})")
            return
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.predicted.as_dict().items())
        logger.info(f"plan (python -m veomni.plan) predicts per rank, GiB: {parts}")
        if get_device_type() == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, trainer, metrics):
        self.steps += 1
        if self.predicted is None or self.steps != 2:
            return
        if get_device_type() == "cuda":
            measured, predicted, what = torch.cuda.max_memory_allocated(), self.predicted.peak, "peak memory"
        else:
            measured, what = _tensor_bytes(trainer), "parameter + optimizer-state bytes"
            predicted = self.predicted.params + self.predicted.optimizer
        logger.info(
            f"plan check after 2 steps: {what} predicted {predicted / GIB:.3f} GiB, measured {measured / GIB:.3f} GiB "
            f"(measured / predicted = {measured / max(predicted, 1):.3f})"
        )
