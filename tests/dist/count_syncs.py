"""Counts the host reads of device values (syncs on an accelerator) that the training loop makes per step.

`python count_syncs.py OUT.json [--grouped-mm] ARGV... [:: OUT.json ...]` trains with the TextTrainer and, around each step's
work (the step's all-reduce of token counts, the queued step, the reading and logging of a step's metrics), counts:
- through a TorchDispatchMode: `aten._local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`) and the ops whose output
  shape depends on the data (`nonzero`, `bincount`, `masked_select`, `unique`, indexing by a boolean mask,
  `repeat_interleave` by a tensor);
- by patching: `Tensor.tolist`, `Tensor.cpu`, `Tensor.numpy`, `torch.cuda.synchronize` and veomni's `synchronize`.
Each event is named by its innermost veomni frame (`veomni/path.py:function`), or by the outermost frame of
`SITES_OF_RECORD` on its stack, so an allowance names a function, not a line. Rank 0 writes
{"steps": n, "events": {site: count}} to OUT.json.

`--grouped-mm`: the MoE experts take torch's grouped-matmul path (what CUDA bf16 runs) on CPU too, so its syncs are
counted here; the per-expert CPU loops read the counts on the host by design.
"""

import json
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import veomni
import veomni.ops.moe
import veomni.utils.device as device_utils
from veomni.arguments import VeOmniArguments, parse_args
from veomni.distributed import destroy_parallel_state
from veomni.trainer import TextTrainer

GROUPED_MM_AVAILABLE = veomni.ops.moe.grouped_mm_available
VEOMNI = os.path.dirname(os.path.abspath(veomni.__file__))
aten = torch.ops.aten
DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
    aten.argwhere.default,
}
# functions an allowance may name although the read happens in a helper they call
SITES_OF_RECORD = ("veomni/trainer/step_metrics.py:host_loss_tokens",)


def site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(VEOMNI)]
    names = [f"veomni/{os.path.relpath(f.filename, VEOMNI)}:{f.name}" for f in frames]
    for name in names:
        if name in SITES_OF_RECORD:
            return name
    return names[-1] if names else "outside veomni"


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.events = {}

    def add(self, what: str) -> None:
        key = f"{site()} [{what}]"
        self.events[key] = self.events.get(key, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            self.add("item")
        elif func in DATA_DEPENDENT:
            self.add(func.__name__)
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            indices = args[1] if len(args) > 1 else []
            if any(t is not None and t.dtype == torch.bool for t in indices):
                self.add(f"{func.__name__} by a boolean mask")
        return func(*args, **kwargs)


COUNTER = Counter()


def patch_host_reads() -> None:
    for name in ("tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if COUNTER.active:
                COUNTER.add(_name)
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    for module, name in ((torch.cuda, "synchronize"), (device_utils, "synchronize")):
        original = getattr(module, name)

        def counted_sync(*args, _original=original, **kwargs):
            if COUNTER.active:
                COUNTER.add("synchronize")
            return _original(*args, **kwargs)

        setattr(module, name, counted_sync)


COUNTER.active = False


def counted(method):
    """A trainer method run under the counter."""

    def run(self, *args, **kwargs):
        if COUNTER.active:  # nested: already counted
            return method(self, *args, **kwargs)
        COUNTER.active = True
        try:
            with COUNTER:
                return method(self, *args, **kwargs)
        finally:
            COUNTER.active = False

    return run


class CountingTrainer(TextTrainer):
    _step_totals = counted(TextTrainer._step_totals)
    _timed_step = counted(TextTrainer._timed_step)
    _publish = counted(TextTrainer._publish)


def run(out, argv):
    grouped = argv[0] == "--grouped-mm"
    if grouped:
        argv = argv[1:]
    import veomni.ops.moe as moe

    # torch's CPU grouped matmul: the device path of the experts, counted on CPU
    moe.grouped_mm_available = (lambda x: True) if grouped else GROUPED_MM_AVAILABLE
    COUNTER.events = {}
    trainer = CountingTrainer(parse_args(VeOmniArguments, argv))
    trainer.fit()
    if trainer.is_main:
        with open(out, "w") as f:
            json.dump({"steps": trainer.global_step, "events": COUNTER.events}, f, indent=1)


def main():
    """`count_syncs.py OUT.json [--grouped-mm] ARGV... [:: OUT.json ...]`: the runs one after another."""
    patch_host_reads()
    runs, current = [], []
    for arg in sys.argv[1:]:
        if arg == "::":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    try:
        for out, *argv in runs:  # one process group for all (each trainer builds its own meshes)
            run(out, argv)
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
