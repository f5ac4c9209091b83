"""The parity harness: every layout trains on one process's global batches, and each step's gradients are also
taken at the one-process weights of that step, so a difference is pinned on the parameter that causes it.

tests/dist/*_scenarios.py and `python -m veomni.verify` share these classes."""

import dataclasses
import os
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

import veomni.trainer.text_trainer as text_trainer_module
from veomni.compat.torch import local_tensor
from veomni.trainer import TextTrainer
from veomni.trainer.vlm_trainer import VLMTrainer

KILL_MARKER = "verify_awaiting_kill"  # written into output_dir by a run stalled for its SIGKILL


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (sharded) DTensor; a collective: every rank calls it for the same tensors."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class RankShare:
    """A one-process loader seen by one data-parallel rank: its share of each global batch's micro-batches."""

    def __init__(self, loader, dp_rank: int, dp_size: int):
        self.loader, self.dp_rank, self.dp_size = loader, dp_rank, dp_size

    def __iter__(self):
        for micro_batches in self.loader:
            yield micro_batches[self.dp_rank :: self.dp_size]

    def set_epoch(self, epoch, first_step=0):
        self.loader.set_epoch(epoch, first_step)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


class SameGlobalBatches(TextTrainer):
    """Identical global batches whatever the number of ranks, so parity with one process tests the parallelism
    alone (how the real loader deals data out over ranks is tested in test_data_loader.py)."""

    def build_dataloader(self):
        real, dp = text_trainer_module.build_loader, self.parallel_state.dp_size

        def one_process_loader(dataset, collate_fn, batching, dp_rank, dp_size, **kwargs):
            batching = dataclasses.replace(batching, dataloader_batch_size=batching.dataloader_batch_size * dp)
            return real(dataset, collate_fn, batching, 0, 1, **kwargs)

        text_trainer_module.build_loader = one_process_loader
        try:
            return RankShare(super().build_dataloader(), self.parallel_state.dp_rank, dp)
        finally:
            text_trainer_module.build_loader = real


class GradProbe:
    """Before each optimizer step: the step's gradients at the one-process weights of that step.

    The one-process run (`record`) writes its weights and gradients per step to `ref_dir`; a layout's run loads
    those weights, takes the gradients of the same global batch, compares them per parameter on rank 0 (the largest
    |difference| over the reference's largest |gradient|), and restores its own weights, so its own trajectory (the
    loss and grad-norm series) runs on untouched."""

    def __init__(self, ref_dir: str, record: bool):
        self.ref_dir, self.record = ref_dir, record
        self.diffs: Dict[int, Dict[str, float]] = {}  # step -> parameter -> relative difference (rank 0)

    def _path(self, kind: str, step: int) -> str:
        return os.path.join(self.ref_dir, f"{kind}_step{step}.pt")

    def run(self, trainer: "ProbedTrainer", micro_batches: List[dict], totals: dict) -> None:
        step, model = trainer.global_step + 1, trainer.model
        params = dict(model.named_parameters())
        main = dist.get_rank() == 0
        if self.record:
            weights = {n: full(p.detach()).clone() for n, p in params.items()}
            if main:
                torch.save(weights, self._path("weights", step))
        else:
            own = {n: local_tensor(p.detach()).clone() for n, p in params.items()}
            reference = torch.load(self._path("weights", step), map_location=trainer.device, weights_only=True)
            set_model_state_dict(model, reference, options=StateDictOptions(full_state_dict=True, strict=False))
        trainer.accumulate_gradients(micro_batches, totals)
        grads = {n: full(p.grad).detach().cpu() for n, p in params.items() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        if self.record:
            if main:
                torch.save(grads, self._path("grads", step))
            return
        with torch.no_grad():
            for n, p in params.items():
                local_tensor(p).copy_(own[n])
        if main:
            self.diffs[step] = relative_differences(grads, torch.load(self._path("grads", step), weights_only=True))


def relative_differences(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Per parameter (in the reference's order): max |got - want| / max |want|; a missing gradient is 1.0."""
    out = {}
    for name, ref in want.items():
        mine = got.get(name)
        if mine is None or mine.shape != ref.shape:
            out[name] = 1.0
            continue
        scale = ref.abs().max().item()
        diff = (mine.double() - ref.double()).abs().max().item()
        out[name] = diff / scale if scale > 0 else diff
    return out


class ProbedTrainer(SameGlobalBatches):
    """The trainer a verify run uses: one process's global batches, a gradient probe before each step."""

    probe: Optional[GradProbe] = None
    step_watch = None  # (trainer, micro_batches) -> a context around the first optimizer step (veomni.verify.measure)
    keep_checkpoints = True  # False: a run no resume reads saves nothing (seconds per layout)
    stall_at: Optional[int] = None  # the step after which this run waits, mid-step, to be SIGKILLed (verify.run)

    def save_checkpoint(self):
        if self.keep_checkpoints:
            super().save_checkpoint()

    def train_step(self, micro_batches, totals):
        if self.stall_at is not None and self.global_step == self.stall_at:
            self._await_kill(micro_batches, totals)
        if self.probe is not None:
            self.probe.run(self, micro_batches, totals)
        if self.step_watch is None:
            return super().train_step(micro_batches, totals)
        with self.step_watch(self, micro_batches):
            return super().train_step(micro_batches, totals)

    def _await_kill(self, micro_batches, totals, patience: float = 600.0) -> None:
        """In the step after `stall_at`, its checkpoint published and this step's gradients taken (no update):
        say so, then wait for the parent's SIGKILL, which no cleanup survives (as a node failure)."""
        self.checkpointer.wait()
        self.accumulate_gradients(micro_batches, totals)
        if dist.get_rank() == 0:
            open(os.path.join(self.output_dir, KILL_MARKER), "w").close()
        time.sleep(patience)  # the SIGKILL ends the process while it sleeps
        raise RuntimeError(f"verify: no SIGKILL came within {patience:.0f} s of step {self.stall_at + 1}")


class ProbedVLMTrainer(ProbedTrainer, VLMTrainer):
    """The same for a vision/audio-language config (tasks/train_vlm.py's trainer: its processor, transform,
    collate infos and per-modality token counts)."""


def probed_trainer_class(args) -> type:
    """The verify trainer of this config: ProbedVLMTrainer for a multimodal model, else ProbedTrainer."""
    from veomni.models import build_config
    from veomni.models.multimodal import is_multimodal

    config = build_config(args.model.config_path, trust_remote_code=args.model.trust_remote_code)
    return ProbedVLMTrainer if is_multimodal(config) else ProbedTrainer
