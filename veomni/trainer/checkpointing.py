"""The run folder and the run's checkpoints: where a run resumes from, what is saved beside the model and optimizer,
and resuming on another world size (the data loader's position is resharded over the new data-parallel ranks).

Two components of the trainer: `RunDir` is settled first, before any data is read (a locked folder or a completed
run stops in seconds); `TrainCheckpointer` is built once the model, optimizer and loader exist, and is handed them.
"""

import os
import warnings
from dataclasses import asdict, dataclass
from typing import Dict

import torch.distributed as dist
import yaml

from ..arguments.parser import save_args
from ..checkpoint import Checkpointer, RunDirError, move_run_aside, plan_run, rng_state, set_rng_state
from ..checkpoint.checkpointer import checkpoint_step
from ..checkpoint.hf_export import architecture_of, copy_tokenizer, export_config
from ..checkpoint.integrity import flat_dict
from ..checkpoint.rng import reseed
from ..checkpoint.run_dir import is_inside, lock_run_dir, remap_into
from ..data.data_loader import reshard_loader_state
from ..utils.collectives import on_rank0
from ..utils.logging import get_logger
from . import lifecycle

logger = get_logger(__name__)
RUN_CONFIG = "veomni_config.yaml"
# keys that shape the learning-rate schedule: a resume that changes them is told which schedule it follows
_SCHEDULE_KEYS = ("train.optimizer.lr", "train.optimizer.lr_min", "train.optimizer.lr_start", "train.max_steps",
                  "train.num_train_epochs", "train.optimizer.lr_warmup_ratio", "train.optimizer.lr_decay_style",
                  "train.optimizer.lr_decay_ratio")  # fmt: skip
# keys that differ between runs without changing what is trained
_RUN_ONLY_KEYS = ("train.checkpoint.load_path", "train.checkpoint.overwrite")


@dataclass
class TrainState:
    """Where the loop is: what a checkpoint saves of it and a resume restores."""

    global_step: int = 0
    epoch: int = 0
    epoch_step: int = 0  # steps taken in the current epoch
    consumed_tokens: int = 0
    last_saved_step: int = -1

    def state_dict(self) -> Dict[str, int]:
        return {k: getattr(self, k) for k in ("global_step", "epoch", "epoch_step", "consumed_tokens")}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self.last_saved_step = self.global_step


class RunDir:
    """`train.checkpoint.output_dir`, locked for this run: resume by default, never overwrite a run by accident
    (see veomni/checkpoint/run_dir.py). Rank 0 decides and moves a previous run aside; every rank gets the same
    answer (or the same error). Collective."""

    def __init__(self, ckpt):
        self.output_dir = ckpt.output_dir
        self._lock = None

        def decide():
            self._lock = lock_run_dir(self.output_dir)  # first: a second run on this folder stops here
            plan = plan_run(self.output_dir, ckpt.load_path, ckpt.overwrite)
            path, moved = plan.load_path, None
            if plan.move_aside:
                moved = move_run_aside(self.output_dir)
                path = remap_into(path, self.output_dir, moved)
            return path, moved, plan.message

        self.resume_path, moved, message = on_rank0(decide)
        # what happens to the folder (resume, fresh start, previous run moved aside): said once the run goes ahead
        self.message = message + (f"; previous run moved to {moved}" if moved else "")

    def release(self) -> None:
        """Free the folder now rather than when this process ends (a failed run inside a longer-lived process: the
        next run there, a benchmark's next variant say, may take the folder)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def refuse_completed(self, total_steps: int) -> None:
        """Resuming this folder's own run with no step left to train stops before the model is built, with the
        three ways on. (A checkpoint of another folder starts a new run from it: not this trap.)"""
        path = self.resume_path
        step = checkpoint_step(path) if path and is_inside(path, self.output_dir) else None
        if step is not None and step >= total_steps:
            raise RunDirError(
                f"train.checkpoint.output_dir={self.output_dir} holds a completed run (checkpoint of step {step}, "
                f"this run would train {total_steps} steps): nothing to train. Give a new output_dir, add "
                "--train.checkpoint.overwrite true (the old run is moved aside), or raise train.max_steps"
            )


class TrainCheckpointer:
    """Saves the run (model and optimizer by DCP; beside them the loop's state, the LR schedule, the loader's
    position and this rank's generators) and restores it, on this world size or another."""

    def __init__(self, args, run_dir: RunDir, parallel_state, model, optimizer, lr_scheduler, loader, state):
        ckpt = args.train.checkpoint
        self.args, self.run_dir, self.parallel_state = args, run_dir, parallel_state
        self.model, self.optimizer, self.lr_scheduler, self.loader, self.state = (
            model, optimizer, lr_scheduler, loader, state
        )  # fmt: skip
        self.checkpointer = Checkpointer(run_dir.output_dir, ckpt.save_total_limit, ckpt.async_save)

    @property
    def root(self) -> str:
        return self.checkpointer.root

    def wait(self) -> None:
        self.checkpointer.wait()

    def save(self) -> None:
        state, parallel = self.state, self.parallel_state
        lifecycle.set_progress(state.global_step, f"saving checkpoint global_step_{state.global_step}")
        extra = {
            "trainer": state.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": self.loader.state_dict(),
            "rng": rng_state(),
            "dp_rank": parallel.dp_rank,
        }
        meta = {"dp_size": parallel.dp_size, "epoch": state.epoch}

        def attach_hf_config(folder: str) -> None:  # the checkpoint carries what an HF export needs
            export_config(self.model.config, os.path.join(folder, "hf_config"), architecture_of(self.model))
            copy_tokenizer(self.args.model.tokenizer_path, os.path.join(folder, "hf_config"))
            save_args(self.args, folder, RUN_CONFIG)  # what a resume compares its own config with

        self.checkpointer.save(state.global_step, self.model, self.optimizer, extra, meta, attach=attach_hf_config)
        state.last_saved_step = state.global_step

    def resume(self, is_main: bool) -> None:
        """Restore `run_dir.resume_path`, if any (collective)."""
        path = self.run_dir.resume_path
        if path is None:
            return
        if is_main:
            report_config_changes(self.args, path)
        loaded = self.checkpointer.load(path, self.model, self.optimizer)
        meta, extras = loaded["meta"], loaded["extra_states"]
        rank, parallel = dist.get_rank(), self.parallel_state
        same_world = meta["world_size"] == dist.get_world_size()
        mine = extras[rank] if same_world else extras[0]
        self.state.load_state_dict(mine["trainer"])
        self._resume_schedule()
        if same_world and meta["dp_size"] == parallel.dp_size:
            self.loader.load_state_dict(mine["dataloader"])
        else:
            by_dp_rank = {e["dp_rank"]: e["dataloader"] for e in extras}
            try:
                shares = [by_dp_rank[r] for r in range(meta["dp_size"])]
                self.loader.load_state_dict(reshard_loader_state(shares, parallel.dp_rank, parallel.dp_size))
            except NotImplementedError as err:
                logger.warning(f"{err}: epoch {self.state.epoch} starts its data again")
        restore_rank_rng(extras, rank, self.args.train.seed, self.state.global_step)

    def _resume_schedule(self) -> None:
        """The schedule is a function of the step: recomputed under this run's settings, not loaded. A resume that
        raises max_steps (a longer schedule) takes its very first step on the new curve, not the saved one."""
        self.lr_scheduler.last_epoch = self.state.global_step - 1
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended, nothing is skipped
            warnings.simplefilter("ignore")
            self.lr_scheduler.step()  # sets every param group's lr for step global_step + 1


def report_config_changes(args, resume_path: str) -> None:
    """What this run's resolved config changes against the checkpoint's, and the schedule rule (rank 0)."""
    saved = os.path.join(resume_path, RUN_CONFIG)
    if not os.path.isfile(saved):
        return
    with open(saved) as f:
        before = flat_dict(yaml.safe_load(f) or {})
    now = flat_dict(asdict(args))
    changed = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k) and k not in _RUN_ONLY_KEYS]
    if not changed:
        return
    lines = "; ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed)
    logger.warning(f"resuming with a config that differs from the checkpoint's: {lines}")
    if any(k in _SCHEDULE_KEYS for k in changed):
        logger.warning(
            "the learning-rate schedule follows this run's settings from the resume step on, as if they had held "
            "from step 0 (the saved schedule is not continued)"
        )


def restore_rank_rng(extras, rank: int, seed: int, step: int) -> None:
    """Each rank its own generators after a resume on another world size: a rank that existed before gets its own
    saved state, a new rank a fresh seed of its own (rank 0's state on every rank would give every rank the same
    dropout masks)."""
    if rank < len(extras):
        set_rng_state(extras[rank]["rng"])
    else:
        reseed(seed, rank, step)
