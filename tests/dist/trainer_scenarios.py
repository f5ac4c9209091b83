"""Under torchrun: the TextTrainer with an injected event. argv: scenario config.yaml [--overrides].

offload        offload + onload model and optimizer after step 3, then continue (prints bytes moved)
nan_at_3       the loss of step 3 becomes NaN
crash_in_save  SIGKILL this process in the middle of writing the step-20 checkpoint (after some shards)
"""

import json
import os
import signal
import sys

import torch

import veomni.checkpoint.checkpointer as checkpointer_module
from veomni.arguments import VeOmniArguments, parse_args
from veomni.distributed import destroy_parallel_state
from veomni.distributed.offload import (
    load_veomni_model_to_gpu,
    load_veomni_optimizer,
    model_device_bytes,
    offload_veomni_model_to_cpu,
    offload_veomni_optimizer,
    optimizer_device_bytes,
)
from veomni.trainer import TextTrainer
from veomni.utils import get_device


class OffloadAfterStep3:
    def on_train_begin(self, trainer): ...

    def on_train_end(self, trainer): ...

    def on_step_end(self, trainer, metrics):
        if metrics["step"] != 3:
            return
        device = get_device()
        before = model_device_bytes(trainer.model, device) + optimizer_device_bytes(trainer.optimizer, device)
        offload_veomni_model_to_cpu(trainer.model)
        offload_veomni_optimizer(trainer.optimizer)
        cpu = torch.device("cpu")
        moved = model_device_bytes(trainer.model, cpu) + optimizer_device_bytes(trainer.optimizer, cpu)
        load_veomni_model_to_gpu(trainer.model)
        load_veomni_optimizer(trainer.optimizer)
        print(json.dumps({"offload_bytes_before": before, "offload_bytes_on_host": moved}), flush=True)


class NanAtStep3(TextTrainer):
    def forward_loss_sum(self, micro_batch):
        loss = super().forward_loss_sum(micro_batch)
        return loss * float("nan") if self.global_step == 2 else loss


def crash_in_the_middle_of_step_20():
    real_save = checkpointer_module.dcp.save

    def save(state, checkpoint_id, **kwargs):
        if "global_step_20" in str(checkpoint_id):
            os.makedirs(checkpoint_id, exist_ok=True)
            with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
                f.write(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    checkpointer_module.dcp.save = save


def main():
    scenario, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(VeOmniArguments, argv)
    trainer_class = NanAtStep3 if scenario == "nan_at_3" else TextTrainer
    if scenario == "crash_in_save":
        crash_in_the_middle_of_step_20()
    trainer = trainer_class(args)
    if scenario == "offload":
        trainer.callbacks.append(OffloadAfterStep3())
    try:
        trainer.fit()
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
