"""Fixes from the review of the last landing: checkpoint retention after resuming an older checkpoint, the batch-size
warmup across epochs, dynamic-batching step counts per epoch, the launcher's grace period for a stop, and stop
signals that arrive after the last step's all-reduce."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from veomni.checkpoint import Checkpointer, list_checkpoints
from veomni.checkpoint.checkpointer import resolve_checkpoint


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _save(checkpointer, step, model, optimizer):
    return checkpointer.save(step, model, optimizer, {"trainer": {"global_step": step}}, {"dp_size": 1})


def test_retention_after_resuming_an_older_checkpoint_keeps_the_new_timeline(tmp_path, one_process_group):
    """Saved 10, 20, 30; resumed from 20 by an explicit load_path (abandoning 30): with save_total_limit 1 the new
    step-21 checkpoint must survive and be `latest`; the abandoned 30 is neither counted nor deleted."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    out = str(tmp_path)
    root = os.path.join(out, "checkpoints")
    first = Checkpointer(out, save_total_limit=2)
    for step in (10, 20, 30):
        _save(first, step, model, optimizer)
    assert list_checkpoints(root) == [20, 30]

    resumed = Checkpointer(out, save_total_limit=1)  # the run restarted from global_step_20
    saved = _save(resumed, 21, model, optimizer)
    assert list_checkpoints(root) == [21, 30]
    assert resolve_checkpoint("auto", out) == saved  # `latest` names the new checkpoint, and it exists
    _save(resumed, 22, model, optimizer)
    assert list_checkpoints(root) == [22, 30]  # 21 retired: the limit counts this timeline only
    _save(resumed, 30, model, optimizer)  # reaching the abandoned step replaces it
    assert list_checkpoints(root) == [30]
    with open(os.path.join(root, "global_step_30", "extra_state", "rank_0.pt"), "rb"):
        pass
