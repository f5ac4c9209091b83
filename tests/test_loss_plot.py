"""loss.png: the LR on its own axis and the steps where the run was resumed (marked in metrics.jsonl)."""

import json
import os
from types import SimpleNamespace

from veomni.trainer.callbacks import MetricsFileCallback, draw_loss_plot


def test_a_resumed_run_marks_its_first_step_and_the_plot_draws_it_with_the_lr(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    metrics = MetricsFileCallback(path)
    metrics.on_train_begin(SimpleNamespace(global_step=0))
    for step in (1, 2, 3):
        metrics.on_step_end(None, {"step": step, "loss": 3.0 - step / 10, "lr": 1e-3 * step})
    resumed = MetricsFileCallback(path)  # the next process, resuming from the checkpoint of step 2
    resumed.on_train_begin(SimpleNamespace(global_step=2))
    for step in (3, 4):
        resumed.on_step_end(None, {"step": step, "loss": 3.0 - step / 10, "lr": 1e-3 * step, "eval_loss": 2.9})
    history = [json.loads(line) for line in open(path)]
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert [m.get("resumed_from") for m in history] == [None, None, 2, None]
    png = str(tmp_path / "loss.png")
    labels = draw_loss_plot(history, png)
    assert labels == ["train loss", "eval loss", "resumed at step 2", "lr"] and os.path.getsize(png) > 1000
