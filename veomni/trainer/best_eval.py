"""The lowest eval loss of a run: `train.checkpoint.keep_best` keeps its checkpoint through retention, and
`train.early_stopping_patience` ends the run after that many evaluations in a row without a new lowest.

Every rank decides alike (the eval loss is all-reduced). A new lowest at a step that is not saved anyway is saved
then (keep_best), and its step is shielded from `save_total_limit`; `output_dir/best_checkpoint.json` names it (a
resumed run reads it back). Early stopping shortens the run to the current step, so the loop ends there and the
run finishes as at its last step: final checkpoint, HF export, summary."""

import json
import os
from typing import Optional

from ..utils.logging import get_logger
from .callbacks import Callback

logger = get_logger(__name__)

RECORD = "best_checkpoint.json"


class BestEvalCallback(Callback):
    def __init__(self, keep_best: bool, patience: int, save_steps: int, output_dir: str, is_main: bool):
        self.keep_best, self.patience, self.save_steps = keep_best, patience, save_steps
        self.record, self.is_main = os.path.join(output_dir, RECORD), is_main
        self.best_loss: Optional[float] = None
        self.best_step: Optional[int] = None
        self.stale = 0  # evaluations since the lowest

    def on_train_begin(self, trainer):
        if not (self.keep_best or self.patience) or not os.path.isfile(self.record):
            return
        with open(self.record) as f:
            saved = json.load(f)
        if saved["step"] <= trainer.global_step:  # the same on every rank: they read the same file
            self.best_loss, self.best_step, self.stale = saved["eval_loss"], saved["step"], saved.get("stale", 0)
            self._protect(trainer)
            if self.patience and self.stale >= self.patience:  # resumed after an early stop: nothing left to train
                trainer.total_steps = trainer.global_step

    def on_step_end(self, trainer, metrics):
        if "eval_loss" not in metrics or not (self.keep_best or self.patience):
            return
        step, loss = metrics["step"], metrics["eval_loss"]
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.best_step, self.stale = loss, step, 0
            if self.keep_best:
                self._protect(trainer)
                saved_anyway = (self.save_steps > 0 and step % self.save_steps == 0) or step >= trainer.total_steps
                if not saved_anyway:
                    trainer.save_checkpoint()
        else:
            self.stale += 1
        self._write(trainer)
        if self.patience and self.stale >= self.patience and step < trainer.total_steps:
            if trainer.is_main:
                logger.info(
                    f"early stopping at step {step}: eval loss {loss:.4f} has not improved on {self.best_loss:.4f} "
                    f"(step {self.best_step}) for {self.stale} evaluation(s) (train.early_stopping_patience="
                    f"{self.patience})"
                )
            trainer.total_steps = step  # the loop ends after this step and the run finishes as at its last

    def _protect(self, trainer) -> None:
        if self.keep_best:
            trainer.checkpointer.checkpointer.protected_steps = {self.best_step}

    def _write(self, trainer) -> None:
        if not self.is_main:
            return
        path = os.path.join(trainer.checkpointer.root, f"global_step_{self.best_step}") if self.keep_best else None
        record = {"step": self.best_step, "eval_loss": self.best_loss, "stale": self.stale, "checkpoint": path}
        tmp = self.record + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.record)
