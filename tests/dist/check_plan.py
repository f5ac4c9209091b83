"""Under torchrun: the measured side of `python -m veomni.plan` (tests/test_plan.py). argv: out_dir then runs
`NAME CONFIG.yaml [--overrides] :: NAME CONFIG.yaml ...`, one after another in this launch (the process group
stays; each trainer builds its own meshes).

For each run, one real optimizer step of the TextTrainer (the `_fit` loop body: token all-reduce, forward and
backward of every micro-batch, clip, optimizer step) with every collective counted, and this rank's tensor bytes:
parameters and optimizer state after the step, gradients just before `optimizer.step` (the trainer frees them
after it). Writes out_dir/NAME.rank<r>.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from veomni.arguments import VeOmniArguments, parse_args
from veomni.distributed import destroy_parallel_state
from veomni.plan.collectives import CollectiveCounter
from veomni.trainer import TextTrainer


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def optimizer_state_tensors(optimizer):
    inner = getattr(optimizer, "optimizers", None)  # MultiOptimizer (Muon + AdamW)
    optimizers = inner.values() if isinstance(inner, dict) else [optimizer]
    return [v for opt in optimizers for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def one_run(out_dir: str, name: str, argv) -> None:
    trainer = TextTrainer(parse_args(VeOmniArguments, argv))
    seen = {}
    step = trainer.optimizer.step

    def counted_step(*args, **kwargs):  # the gradients exist only until the trainer's zero_grad after the step
        seen["grad_bytes"] = local_bytes(p.grad for p in trainer.model.parameters() if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = counted_step
    micro_batches = next(iter(trainer.train_dataloader))
    with CollectiveCounter() as counter:
        totals = trainer._step_totals(micro_batches)
        trainer.train_step(micro_batches, totals)
    result = {
        "param_bytes": local_bytes(trainer.model.parameters()),
        "grad_bytes": seen["grad_bytes"],
        "optimizer_bytes": local_bytes(optimizer_state_tensors(trainer.optimizer)),
        "comm": counter.by_group(),
        "calls": counter.calls,
        "tokens": [int(mb["input_ids"].numel()) for mb in micro_batches],
        "labels": [mb["labels"].reshape(-1).tolist() for mb in micro_batches],
    }
    with open(os.path.join(out_dir, f"{name}.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    trainer.checkpointer.wait()  # the next run's init_parallel_state keeps the process group, builds new meshes


def main(out_dir: str, argv) -> None:
    runs, current = [], []
    for arg in argv + ["::"]:
        if arg == "::":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    for name, *run_argv in runs:
        one_run(out_dir, name, run_argv)
    destroy_parallel_state()
    print("CHECK_PLAN_OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
