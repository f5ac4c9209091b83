"""Under torchrun: the TextTrainer with an injected event. argv: scenario config.yaml [--overrides].

offload        offload + onload model and optimizer after step 3, then continue (prints bytes moved)
nan_at_3       the loss of step 3 becomes NaN
stall_at_11    step 11 never ends (after step 10 and its checkpoint): a window, as long as needed, to SIGKILL the
               job between two checkpoints, whatever the model's speed
crash_in_save  SIGKILL this process in the middle of writing the step-20 checkpoint (after some shards)
sequence       `sequence SCENARIO ARGV... :: SCENARIO ARGV... ...`: the runs one after another in this launch (the
               process group stays; each trainer builds its own meshes), which saves a launch's start-up per run
evaluate       no training: the trainer built, its held-out set evaluated once at the initial weights; every rank
               writes what it got to <output_dir>/eval_rank<r>.json
dpo            the DPOTrainer (tasks/train_dpo.py's); dpo_stall_at_4: step 4 never ends (SIGKILL window)
same_batches   every world size trains on one process's global batches (rank r takes micro-batches r, r+dp, ...);
               `same_batches:fsdp2,ddp` trains once per mode in this launch, into <output_dir>/<mode>
"""

import json
import os
import signal
import sys
import time

import torch
from torch.distributed.tensor import DTensor

import veomni.checkpoint.checkpointer as checkpointer_module
from veomni.arguments import VeOmniArguments, parse_args
from veomni.compat.torch import local_tensor
from veomni.distributed import destroy_parallel_state
from veomni.distributed.offload import (
    load_veomni_model_to_gpu,
    load_veomni_optimizer,
    offload_veomni_model_to_cpu,
    offload_veomni_optimizer,
)
from veomni.optim.multi_optimizer import named_optimizers
from veomni.trainer import TextTrainer
from veomni.utils import get_device
from veomni.verify.harness import SameGlobalBatches


def _local_bytes(tensors, device) -> int:
    local = [local_tensor(t) for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if t.device == device)


def model_device_bytes(model, device) -> int:
    """Bytes of this rank's parameters, gradients and buffers that sit on `device`."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return _local_bytes([*model.parameters(), *grads, *model.buffers()], device)


def optimizer_device_bytes(optimizer, device) -> int:
    """Bytes of every inner optimizer's state tensors on `device`."""
    states = [s for opt in named_optimizers(optimizer).values() for s in opt.state.values()]
    return _local_bytes([v for state in states for v in state.values() if torch.is_tensor(v)], device)


class MoveSpy:
    """Counts the bytes of every `Tensor.to(device)` call made inside the block, by target device type. On a CPU-only
    machine the offload moves are no-ops by design (host and "device" are one), so what shows that offload really
    asks for each parameter, gradient, buffer and optimizer state to go to the host and back is the requests."""

    def __enter__(self):
        self.bytes = {}
        self.real = torch.Tensor.to
        spy = self

        def to(tensor, *args, **kwargs):
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is not None:
                local = local_tensor(tensor)
                spy.bytes[device.type] = spy.bytes.get(device.type, 0) + local.numel() * local.element_size()
            return spy.real(tensor, *args, **kwargs)

        torch.Tensor.to = to
        return self

    def __exit__(self, *exc):
        torch.Tensor.to = self.real


def _state_bytes(trainer, device) -> int:
    """Model parameters and buffers plus optimizer state tensors on `device` (0-dim step counters left out: a
    non-fused AdamW keeps them on the host)."""
    model = model_device_bytes(trainer.model, device)
    tensors = [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    local = [local_tensor(v) for v in tensors if v.dim() > 0]
    opt = sum(v.numel() * v.element_size() for v in local if v.device == device)
    return model + opt


class OffloadAfterStep3:
    def on_train_begin(self, trainer): ...

    def on_train_end(self, trainer): ...

    def on_step_end(self, trainer, metrics):
        if metrics["step"] != 3:
            return
        device, cpu = get_device(), torch.device("cpu")
        before = model_device_bytes(trainer.model, device) + optimizer_device_bytes(trainer.optimizer, device)
        resident = _state_bytes(trainer, device)
        with MoveSpy() as to_host:
            offload_veomni_model_to_cpu(trainer.model)
            offload_veomni_optimizer(trainer.optimizer)
        moved = model_device_bytes(trainer.model, cpu) + optimizer_device_bytes(trainer.optimizer, cpu)
        left_on_device = 0 if device.type == "cpu" else _state_bytes(trainer, device)
        with MoveSpy() as to_device:
            load_veomni_model_to_gpu(trainer.model)
            load_veomni_optimizer(trainer.optimizer)
        report = {
            "offload_bytes_before": before,
            "offload_bytes_on_host": moved,
            "resident_bytes": resident,
            "asked_to_host": to_host.bytes.get("cpu", 0),
            "asked_to_device": to_device.bytes.get(device.type, 0),
            "left_on_device": left_on_device,
            "back_on_device": _state_bytes(trainer, device),
        }
        sys.stdout.write(json.dumps(report) + "\n")  # one write: the ranks share stdout, unbuffered


class NanAtStep3(TextTrainer):
    def forward_loss_sum(self, micro_batch):
        loss = super().forward_loss_sum(micro_batch)
        return loss * float("nan") if self.global_step == 2 else loss


class StallAtStep11(TextTrainer):
    def forward_loss_sum(self, micro_batch):
        while self.global_step == 10:  # step 10 and its checkpoint are done; wait here for the SIGKILL
            time.sleep(1)
        return super().forward_loss_sum(micro_batch)


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


def train_once_per_mode(modes, argv):
    """One trainer after another in this process (the process group stays; each builds its own meshes)."""
    try:
        root = parse_args(VeOmniArguments, argv).train.checkpoint.output_dir
        for mode in modes:
            mode_flags = ["--train.accelerator.fsdp_config.fsdp_mode", mode]
            out_flags = ["--train.checkpoint.output_dir", os.path.join(root, mode)]
            SameGlobalBatches(parse_args(VeOmniArguments, argv + mode_flags + out_flags)).fit()
    finally:
        destroy_parallel_state()


def evaluate_only(argv):
    """Build the trainer (its own meshes) and evaluate at the initial weights, which follow the seed and not the
    layout; each rank writes its result, so a test sees every rank agree."""
    trainer = TextTrainer(parse_args(VeOmniArguments, argv))
    result = trainer.evaluate()
    state = trainer.parallel_state  # the layout it ran under, so a test sees the flags took effect
    meshes = {d for p in trainer.model.parameters() if isinstance(p, DTensor) for d in p.device_mesh.mesh_dim_names}
    result["layout"] = {"dp": state.dp_size, "sp": state.sp_size, "tp": state.tp_size, "ep": state.ep_size}
    result["layout"]["mesh_dims"] = sorted(meshes)  # what the parameters are sharded over
    with open(os.path.join(trainer.output_dir, f"eval_rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def build_dpo_trainer(scenario, argv):
    """`dpo`: the DPOTrainer as tasks/train_dpo.py runs it; `dpo_stall_at_4`: the same, step 4 never ends."""
    from veomni.arguments.dpo_arguments import DPOVeOmniArguments
    from veomni.trainer.dpo_trainer import DPOTrainer

    class StallingDPO(DPOTrainer):
        def train_step(self, micro_batches, totals):
            if self.global_step + 1 == 4:
                self.checkpointer.wait()  # the step-3 checkpoint complete on disk: now SIGKILL may come
                print("STALLING", flush=True)
                time.sleep(3600)
            return super().train_step(micro_batches, totals)

    trainer_class = StallingDPO if scenario == "dpo_stall_at_4" else DPOTrainer
    return trainer_class(parse_args(DPOVeOmniArguments, argv))


def build_trainer(scenario, argv):
    trainer_class = {"nan_at_3": NanAtStep3, "stall_at_11": StallAtStep11, "same_batches": SameGlobalBatches}
    if scenario.startswith("dpo"):
        return build_dpo_trainer(scenario, argv)
    if scenario == "crash_in_save":
        crash_in_the_middle_of_step_20()
    trainer = trainer_class.get(scenario, TextTrainer)(parse_args(VeOmniArguments, argv))
    if scenario == "offload":
        trainer.callbacks.append(OffloadAfterStep3())
    return trainer


def split_runs(argv):
    """`a b :: c d` -> [[a, b], [c, d]]."""
    runs = [[]]
    for arg in argv:
        if arg == "::":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def main():
    scenario, argv = sys.argv[1], sys.argv[2:]
    if scenario.startswith("same_batches:"):
        return train_once_per_mode(scenario.split(":", 1)[1].split(","), argv)
    runs = [(run[0], run[1:]) for run in split_runs(argv)] if scenario == "sequence" else [(scenario, argv)]
    try:
        for run_scenario, run_argv in runs:
            if run_scenario == "evaluate":
                evaluate_only(run_argv)
            else:
                build_trainer(run_scenario, run_argv).fit()
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
