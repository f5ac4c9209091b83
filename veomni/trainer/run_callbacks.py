"""The callbacks every run has (`BaseTrainer.build_callbacks`), and the run's closing summary line."""

import dataclasses
import os
import time
from typing import List

from ..utils.logging import get_logger
from .best_eval import BestEvalCallback
from .callbacks import (
    Callback,
    LossPlotCallback,
    MetricsFileCallback,
    ProgressCallback,
    TensorBoardCallback,
    WandbCallback,
    _clock,
)
from .generation import SampleGenerationCallback

logger = get_logger(__name__)


class SummaryCallback(Callback):
    """Rank 0, at the end: one line with the steps, tokens and time of this run, the final train loss, the final and
    best eval loss, and where the checkpoints and the HF export are."""

    def __init__(self, metrics: MetricsFileCallback, best: BestEvalCallback, progress: ProgressCallback):
        self.metrics, self.best, self.progress = metrics, best, progress  # (the progress bar times the run)

    def on_train_end(self, trainer):
        if not self.metrics.history:
            return
        last = self.metrics.history[-1]
        evals = [m for m in self.metrics.history if "eval_loss" in m]
        parts = [
            f"run summary: steps {self.progress.first_step + 1}..{trainer.global_step} of {trainer.total_steps}",
            f"{trainer.state.consumed_tokens:,} tokens in total",
            f"{_clock(time.perf_counter() - self.progress.start)}",
            f"final train loss {last['loss']:.4f}",
        ]
        if evals:
            best = min(evals, key=lambda m: m["eval_loss"])
            parts.append(
                f"eval loss {evals[-1]['eval_loss']:.4f} (best {best['eval_loss']:.4f} at step {best['step']})"
            )
        parts.append(f"checkpoints in {trainer.checkpointer.root}")
        if self.best.keep_best and self.best.best_step is not None:
            parts.append(f"best checkpoint global_step_{self.best.best_step}")
        hf = os.path.join(trainer.output_dir, "hf")
        if os.path.isdir(hf):
            parts.append(f"HF export in {hf} (talk to it: python -m veomni.chat {trainer.output_dir})")
        logger.info("; ".join(parts))


def standard_callbacks(trainer) -> List[Callback]:
    """eval_prompts samples and the best eval loss (every rank); on rank 0 metrics.jsonl, progress, and those asked
    for of loss.png, wandb and TensorBoard, then the summary. Order matters: what adds to a step's metrics (samples)
    comes before what writes them."""
    args, out = trainer.args, trainer.output_dir
    train, ckpt = args.train, args.train.checkpoint
    best = BestEvalCallback(ckpt.keep_best, train.early_stopping_patience, ckpt.save_steps, out, trainer.is_main)
    every_rank = [SampleGenerationCallback(train.eval_prompts, train.eval_max_new_tokens, ckpt.save_steps), best]
    if not trainer.is_main:
        return every_rank
    metrics, progress = MetricsFileCallback(os.path.join(out, "metrics.jsonl")), ProgressCallback(train.log_steps)
    sinks = [metrics, progress]
    if train.loss_plot:
        sinks.append(LossPlotCallback(metrics, os.path.join(out, "loss.png")))
    if train.wandb.enable:
        wandb = train.wandb
        sinks.append(WandbCallback(wandb.project, wandb.name, wandb.mode, dataclasses.asdict(args), out))
    if train.use_tensorboard:
        sinks.append(TensorBoardCallback(os.path.join(out, "tensorboard")))
    return every_rank + sinks + [SummaryCallback(metrics, best, progress)]
