"""train.checkpoint.keep_best and train.early_stopping_patience on a forced eval-loss sequence, through the real
retention of the Checkpointer (folders on disk) and the loop's order: callbacks, then the scheduled save."""

import json
import os
from types import SimpleNamespace

import pytest

from veomni.checkpoint import list_checkpoints
from veomni.checkpoint.checkpointer import Checkpointer
from veomni.trainer import callbacks
from veomni.trainer.callbacks import BestEvalCallback

SAVE_STEPS, LIMIT = 2, 1


class LoopStandIn:
    """What the callback reads of a trainer, and a save that writes a checkpoint folder and retires old ones."""

    def __init__(self, out, total_steps, global_step=0):
        self.output_dir, self.total_steps, self.global_step, self.is_main = out, total_steps, global_step, True
        self.checkpointer = SimpleNamespace(checkpointer=Checkpointer(out, LIMIT))
        self.checkpointer.root = self.checkpointer.checkpointer.root

    def save_checkpoint(self):
        folder = os.path.join(self.checkpointer.root, f"global_step_{self.global_step}")
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, "meta.json"), "w").write("{}")
        self.checkpointer.checkpointer._retire_old(self.global_step)
        self.saved = self.global_step


def run(out, eval_losses, keep_best, patience, total_steps=10):
    """The loop's order per step: the step's metrics to the callback, then the scheduled save; the final save."""
    trainer = LoopStandIn(out, total_steps)
    callback = BestEvalCallback(keep_best, patience, SAVE_STEPS, out, True)
    callback.on_train_begin(trainer)
    for loss in eval_losses:
        if trainer.global_step >= trainer.total_steps:
            break
        trainer.global_step += 1
        trainer.saved = None
        callback.on_step_end(trainer, {"step": trainer.global_step, "eval_loss": loss})
        if trainer.global_step % SAVE_STEPS == 0:
            trainer.save_checkpoint()
    if trainer.saved != trainer.global_step:
        trainer.save_checkpoint()
    return trainer, list_checkpoints(trainer.checkpointer.root)


LOSSES = [5.0, 4.0, 4.5, 4.8, 4.9, 3.0, 2.0]  # best at step 2, then three evaluations without a new lowest


def test_keep_best_keeps_the_lowest_eval_loss_through_retention_and_early_stopping_stops(tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(callbacks.logger, "info", said.append)
    trainer, kept = run(str(tmp_path / "run"), LOSSES, keep_best=True, patience=3)
    assert trainer.total_steps == 5 and trainer.global_step == 5  # stopped after the 3rd stale evaluation
    assert kept == [2, 5]  # the best (step 2) beside the newest save_total_limit=1
    assert said == [
        "early stopping at step 5: eval loss 4.9000 has not improved on 4.0000 (step 2) for 3 evaluation(s) "
        "(train.early_stopping_patience=3)"
    ]
    record = json.load(open(tmp_path / "run" / "best_checkpoint.json"))
    assert record["step"] == 2 and record["eval_loss"] == 4.0 and record["checkpoint"].endswith("global_step_2")
    # re-running the command resumes at step 5 with nothing left to train
    again = LoopStandIn(str(tmp_path / "run"), 10, global_step=5)
    BestEvalCallback(True, 3, SAVE_STEPS, str(tmp_path / "run"), True).on_train_begin(again)
    assert again.total_steps == 5 and again.checkpointer.checkpointer.protected_steps == {2}


# keep_best keeps the best (step 7) beside the newest save_total_limit=1 others (step 6); without it, the newest
@pytest.mark.parametrize("keep_best, patience, steps, kept", [(False, 0, 7, [7]), (True, 0, 7, [6, 7])])
def test_without_them_the_run_goes_on_and_retention_keeps_the_newest(tmp_path, keep_best, patience, steps, kept):
    trainer, found = run(str(tmp_path / "run"), LOSSES, keep_best=keep_best, patience=patience, total_steps=7)
    assert trainer.global_step == steps and found == kept


def test_a_new_best_between_scheduled_saves_is_saved(tmp_path):
    _, kept = run(str(tmp_path / "run"), [5.0, 4.0, 3.0, 3.5, 3.6], keep_best=True, patience=0, total_steps=5)
    assert kept == [3, 5]  # step 3 is no scheduled save (every 2): saved for being the best


@pytest.mark.parametrize(
    "flag, value", [("train.checkpoint.keep_best", "true"), ("train.early_stopping_patience", "2")]
)
def test_they_need_held_out_data_and_say_so_before_anything_is_built(flag, value):
    from helpers import REPO
    from veomni.arguments import ConfigError, VeOmniArguments, parse_args
    from veomni.trainer.preflight import check_paths

    here = os.path.join(REPO, "README.md")  # paths that exist: only the missing eval data is wrong
    argv = [os.path.join(REPO, "configs/text/demo.yaml"), "--model.tokenizer_path", REPO, "--data.train_path", here]
    args = parse_args(VeOmniArguments, argv + ["--data.eval_path", "null", f"--{flag}", value])
    with pytest.raises(ConfigError, match=f"^{flag} compares eval losses: it needs data.eval_path"):
        check_paths(args)
