"""Under torchrun: LoRA trainings one after another in this launch (`ARGV... :: ARGV... ...`, each a TextTrainer as
tasks/train_text.py runs it), each followed by a report that rank 0 writes to <output_dir>/lora_report.pt.
`stall_at_6 ARGV...`: one training whose step 6 never ends (after step 5 and its checkpoint), to be SIGKILLed.

inputs       a fixed sequence (input_ids, position_ids)
logits       the trained (sharded) model's logits on a fixed sequence, in eval mode
grad_names   the parameters that got a gradient from one backward on that sequence
optim_names  the parameters the optimizer holds state for
optim_bytes  optimizer-state bytes summed over the ranks (sharded: each rank holds its slice)
base_changed the frozen parameters that differ from the base checkpoint's (model.model_path) tensors
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from trainer_scenarios import split_runs

from veomni.arguments import VeOmniArguments, parse_args
from veomni.distributed import destroy_parallel_state
from veomni.trainer import TextTrainer


def probe_inputs(vocab_size: int, length: int = 24):
    ids = (torch.arange(length) * 7 + 5) % vocab_size
    return {"input_ids": ids[None], "position_ids": torch.arange(length)[None]}


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size() if local.dim() > 0 else 0  # 0-dim step counters left out


def base_changed(trainer: TextTrainer) -> list:
    """Frozen parameters (gathered one at a time, every rank alike) that differ from the base checkpoint's."""
    from safetensors.torch import load_file

    base = load_file(os.path.join(trainer.args.model.model_path, "model.safetensors"))
    changed = []
    for name, param in trainer.model.named_parameters():
        if ".lora_" in name:
            continue
        full = (param.full_tensor() if isinstance(param, DTensor) else param).detach().cpu()
        if not torch.equal(full, base[name.replace(".base_layer.", ".")].to(full.dtype)):
            changed.append(name)
    return changed


def report(trainer: TextTrainer) -> dict:
    model, device = trainer.model, trainer.device
    probe = probe_inputs(model.config.vocab_size)
    inputs = {k: v.to(device) for k, v in probe.items()}
    model.eval()
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float().cpu()
    model.train()
    model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()  # FSDP2/DDP: every rank alike
    names = {id(p): n for n, p in model.named_parameters()}
    grad_names = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    optim_names = sorted(names[id(p)] for p in trainer.optimizer.state)
    nbytes = torch.tensor(
        [sum(_local_bytes(v) for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    )
    dist.all_reduce(nbytes)
    return {
        "inputs": probe,
        "logits": logits,
        "grad_names": grad_names,
        "optim_names": optim_names,
        "optim_bytes": int(nbytes),
        "base_changed": base_changed(trainer),
    }


class StallAtStep6(TextTrainer):
    def forward_loss_sum(self, micro_batch):
        while self.global_step == 5:  # step 5 and its checkpoint are done; wait here for the SIGKILL
            time.sleep(1)
        return super().forward_loss_sum(micro_batch)


def main():
    if sys.argv[1] == "stall_at_6":
        try:
            return StallAtStep6(parse_args(VeOmniArguments, sys.argv[2:])).fit()
        finally:
            destroy_parallel_state()
    try:
        for argv in split_runs(sys.argv[1:]):
            trainer = TextTrainer(parse_args(VeOmniArguments, argv))
            trainer.fit()
            result = report(trainer)
            if dist.get_rank() == 0:
                torch.save(result, os.path.join(trainer.output_dir, "lora_report.pt"))
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
