"""The planner's figures checked on every run: before the first step every rank predicts its peak memory, and a
layout whose largest rank exceeds the device's memory (`train.plan_check_memory_gib`, or 95% of the GPU's) is
refused in one line naming the largest term and the layouts that fit (`train.plan_check: refuse`), or warned about
(`warn`); rank 0 logs the prediction, and after the second step the measured peak beside it
(torch.cuda.max_memory_allocated on CUDA; on CPU, where no allocator keeps a peak, the bytes of parameters and
optimizer state, against their exact prediction)."""

from typing import List, Optional

import torch
import torch.distributed as dist

from ..arguments import ConfigError
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
    from ..optim.multi_optimizer import named_optimizers
    from .shards import nbytes

    optimizers = named_optimizers(trainer.optimizer).values()
    states = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(nbytes(p) for p in trainer.model.parameters()) + sum(nbytes(v) for v in states)


class PlanRefused(ConfigError):
    """The layout is predicted not to fit the device's memory (said in one line, like a config mistake)."""


def device_budget(args) -> Optional[float]:
    """Bytes the predicted peak must fit: train.plan_check_memory_gib, else 95% of the GPU's (None on CPU)."""
    if args.train.plan_check_memory_gib is not None:
        return args.train.plan_check_memory_gib * GIB
    if get_device_type() == "cuda":
        from .planner import HEADROOM

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory * HEADROOM
    return None


def fitting_layouts(args, world: int, capacity: float, top: int = 3) -> List[str]:
    """The planner's fastest layouts of this world size whose predicted peak fits `capacity` (GPU dtypes)."""
    from .cost import GPUS, Hardware
    from .planner import search_layouts
    from .real_plan import layout_of
    from .report import describe

    tokens = (args.train.global_batch_size or args.train.micro_batch_size) * args.data.max_seq_len
    hardware = Hardware(GPUS["h100"], min(world, 8), 0.4, None, None)
    found = search_layouts(args, world, hardware, layout_of(args, world).mb_tokens, tokens)
    return [describe(c.layout) for c in found if c.fits(capacity)][:top]


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale / 10:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def refusal(trainer, predicted, peak: float, budget: float) -> str:
    """The one line that refuses (or warns about) a layout predicted not to fit."""
    terms = {k: v for k, v in predicted.as_dict().items() if k != "peak"} if predicted else {"another rank's": peak}
    largest = max(terms, key=terms.get)
    try:
        fits = fitting_layouts(trainer.args, dist.get_world_size(), budget)
    except Exception as err:  # the search is advice: its failure must not hide the verdict
        fits, why = [], f" (no search: {type(err).__name__})"
    else:
        why = ""
    alternatives = "; ".join(fits) if fits else "none found" + why
    return (
        f"train.plan_check: this layout is predicted to need {_size(peak)} per rank, over the {_size(budget)} of "
        f"device memory (train.plan_check_memory_gib); largest term: {largest} {_size(terms[largest])}; layouts of "
        f"{dist.get_world_size()} ranks that fit: {alternatives}"
    )


class PlanCheckCallback(Callback):
    """Handed to the trainer by the task (tasks/train_text.py): the planner is not part of the training loop."""

    def __init__(self):
        self.predicted, self.steps = None, 0

    def on_train_begin(self, trainer):
        mode, budget = trainer.args.train.plan_check, device_budget(trainer.args)
        if mode == "off" or (budget is None and not trainer.is_main):
            return
        try:
            self.predicted = predict_for_trainer(trainer)
            peak = self.predicted.peak
        except Exception as err:  # a model the planner cannot read must not stop training
            logger.warning(f"plan: no memory prediction for this run ({type(err).__name__}: {err})")
            self.predicted, peak = None, 0.0
        if budget is not None:  # every rank alike: the verdict is the same everywhere
            largest = torch.tensor([peak], dtype=torch.float64)  # over the ranks: one all-reduce in host memory
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=trainer.host_group.get())
            peak = float(largest.item())
            if peak > budget:
                message = refusal(trainer, self.predicted, peak, budget)
                if mode == "refuse":
                    raise PlanRefused(message + " (train.plan_check: warn to run anyway)")
                if trainer.is_main:
                    logger.warning(message + " (train.plan_check: warn, so it runs)")
        if self.predicted is None or not trainer.is_main:
            return
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.predicted.as_dict().items())
        logger.info(f"plan (python -m veomni.plan) predicts per rank, GiB: {parts}")
        if get_device_type() == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, trainer, metrics):
        self.steps += 1
        if self.predicted is None or self.steps != 2 or not trainer.is_main:
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
