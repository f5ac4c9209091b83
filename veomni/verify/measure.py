"""The planner in a verify run: this rank's predicted bytes of parameters, gradients and optimizer state, of the
collectives of one step, and its predicted peak memory, beside the measured ones (the largest over the ranks,
gathered to rank 0). The peak is measured on an accelerator only (its allocator's high-water mark over the
training steps, the gradient probe's own work left out); on CPU no allocator keeps one: "n/a (no GPU)"."""

import contextlib
import os
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..trainer.callbacks import Callback

# tests only: a stand-in peak reader on CPU, `(rank + 1) * this many bytes`, so that a CPU test runs the peak
# column's path (reset, read per step, MAX over the ranks, the table) that a GPU takes
FAKE_PEAK_ENV = "VEOMNI_VERIFY_FAKE_PEAK_BYTES"


class PeakReader:
    """The device allocator's peak: `reset()` starts a window, `read()` is its high-water mark in bytes."""

    def __init__(self, reset: Callable[[], None], read: Callable[[], float]):
        self.reset, self.read = reset, read


def peak_reader(device: torch.device) -> Optional[PeakReader]:
    """The peak reader of this device (any accelerator torch.accelerator knows: CUDA, ROCm, XPU, ...), or None
    where there is none to read (CPU)."""
    fake = os.environ.get(FAKE_PEAK_ENV)
    if fake:
        return PeakReader(lambda: None, lambda: float(fake) * (dist.get_rank() + 1))
    if device.type == "cpu" or not torch.accelerator.is_available():
        return None
    return PeakReader(
        lambda: torch.accelerator.reset_peak_memory_stats(device),
        lambda: float(torch.accelerator.max_memory_allocated(device)),
    )


class PlanMeasure(Callback):
    def __init__(self, peak: Optional[PeakReader] = None):
        self.peak = peak
        self.predicted: Optional[Dict[str, float]] = None
        self.measured: Dict[str, float] = {}
        self.steps = 0

    def on_train_begin(self, trainer) -> None:
        from ..plan.runlog import predict_for_trainer

        try:
            memory = predict_for_trainer(trainer).as_dict()
            self.predicted = {key: memory[key] for key in ("params", "grads", "optimizer", "peak")}
        except Exception as err:  # a model the planner cannot read: the table says so, the check goes on
            self.predicted = {"error": f"{type(err).__name__}: {err}"}

    def on_step_end(self, trainer, metrics) -> None:
        if "params" in self.measured:
            return
        from ..plan.runlog import _tensor_bytes
        from ..plan.shards import nbytes

        params = sum(nbytes(p) for p in trainer.model.parameters())
        self.measured.update(params=params, optimizer=_tensor_bytes(trainer) - params)

    @contextlib.contextmanager
    def watch(self, trainer, micro_batches: List[dict]):
        """Around each optimizer step (ProbedTrainer.step_watch): the device's peak memory of every step; on the
        first, its collectives counted and its gradients' bytes read just before the update (the trainer frees
        them after)."""
        self.steps += 1
        if self.peak is not None:
            self.peak.reset()
        with self._first_step(trainer, micro_batches) if self.steps == 1 else contextlib.nullcontext():
            yield
        if self.peak is not None:
            self.measured["peak"] = max(self.measured.get("peak", 0.0), self.peak.read())

    @contextlib.contextmanager
    def _first_step(self, trainer, micro_batches: List[dict]):
        from ..plan.collectives import CollectiveCounter
        from ..plan.shards import nbytes

        real_step = trainer.optimizer.step

        def counted_step(*args, **kwargs):
            self.measured["grads"] = sum(nbytes(p.grad) for p in trainer.model.parameters() if p.grad is not None)
            return real_step(*args, **kwargs)

        trainer.optimizer.step = counted_step
        try:
            with CollectiveCounter() as counter:
                yield
        finally:
            trainer.optimizer.step = real_step
        self.measured["collectives"] = sum(counter.by_group().values())
        if self.predicted is not None and "error" not in self.predicted:
            self.predicted["collectives"] = _predicted_collectives(trainer, micro_batches)

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
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=trainer.host_group.get())
            table.update(zip(keys, values.tolist()))


def _predicted_collectives(trainer, micro_batches: List[dict]) -> float:
    """The planner's bytes of this rank's collectives in one optimizer step of these micro-batches (the host
    all-reduce of the token counts, which comes before the step, left out)."""
    from ..plan.comm import step_collectives
    from ..plan.model_shape import ModelShape
    from ..plan.real_plan import reshard_after_forward, step_shape
    from ..plan.shards import read_rank_plan
    from ..utils.device import get_device_type

    args, state, model = trainer.args, trainer.parallel_state, trainer.model
    plan = read_rank_plan(model, state, args.train.optimizer.type, reshard_after_forward(args, state.fsdp_size))
    shapes = [(int(mb["input_ids"].numel()), int((mb["labels"] != -100).sum())) for mb in micro_batches]
    step = step_shape(args, shapes, get_device_type())
    return sum(
        c.nbytes for c in step_collectives(plan, ModelShape.from_config(model.config), step) if c.label != "world"
    )
