"""A step's metrics, read without stalling the next step.

Reading a device value on the host (`.item()`, `float(t)`, `tolist()`) waits for every kernel queued before it: the
host can no longer queue the next step while the accelerator works, and the host's own per-step work (optimizer
bookkeeping, hooks, Python) shows up as accelerator idle time. So a step's device scalars (loss, grad norm, MoE
statistics) are packed into one float64 vector at the end of the step and copied to pinned host memory without
waiting (`non_blocking`), with an event recorded after the copy; the trainer reads them one step later (or at once
before an evaluation, a checkpoint, a stop or the end of training), when the copy is long done.

The step time is measured the same way on CUDA, by two timing events around the step, so no `synchronize()` is
needed; elsewhere the host clock around the step is the step time (a CPU runs its kernels synchronously).
"""

import math
import time
from typing import Any, Callable, Dict, Tuple

import torch

from ..ops.loss import count_loss_tokens


def timed(device: torch.device, step: Callable[[], Any]) -> Tuple[Any, Callable[[], float]]:
    """`step()`'s result and its seconds, as a function to call once its end has been reached: CUDA timing events
    on CUDA (read later, no sync), the host clock elsewhere."""
    if device.type != "cuda":
        started = time.perf_counter()
        result = step()
        seconds = time.perf_counter() - started
        return result, lambda: seconds
    started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    started.record()
    result = step()
    ended.record()
    return result, lambda: started.elapsed_time(ended) / 1000.0


class PendingMetrics:
    """The metrics of one step: `host` values as they are, `device` tensors copied to host memory in the background.
    `resolve()` returns them all as Python numbers (0-dim tensors as numbers, others as lists; integer tensors as
    ints: exact in float64 up to 2**53), then applies `finish` (derived values such as tokens per second)."""

    def __init__(
        self,
        host: Dict[str, Any],
        device: Dict[str, torch.Tensor],
        step_seconds: Callable[[], float],
        finish: Callable[[Dict[str, Any]], None],
    ):
        self.host, self.step_seconds, self.finish = host, step_seconds, finish
        self.shapes = {name: tuple(t.shape) for name, t in device.items()}
        self.integer = {name for name, t in device.items() if not (t.is_floating_point() or t.is_complex())}
        self.copy, self.done = None, None
        if device:
            flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in device.values()])
            if flat.device.type == "cpu":
                self.copy = flat  # already in host memory: nothing to wait for
            else:
                self.copy = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                self.copy.copy_(flat, non_blocking=True)
                self.done = torch.Event(flat.device)  # the host copy is complete when the stream reaches it
                self.done.record()

    def resolve(self) -> Dict[str, Any]:
        if self.done is not None:
            self.done.synchronize()  # the step ended long ago (one step later) or must be read now (a save)
        out = dict(self.host)
        values = self.copy.tolist() if self.copy is not None else []
        start = 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            part = values[start : start + size]
            part = [int(v) for v in part] if name in self.integer else part
            out[name] = part[0] if shape == () else part
            start += size
        out["step_time"] = self.step_seconds()
        self.finish(out)
        return out


def host_loss_tokens(micro_batch: Dict[str, Any]) -> int:
    """Loss tokens of a micro-batch as the loader gave it (its CPU labels: a host read, no device involved), or its
    `loss_units` where its collator counts another unit than the token (a preference loss: its pairs)."""
    units = micro_batch.get("loss_units")
    return int(units) if units is not None else count_loss_tokens(micro_batch["labels"])
