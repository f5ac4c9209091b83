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

    resumed = Checkpointer(out, save_total_limit=1)  # the run restarts from global_step_20
    older = os.path.join(root, "global_step_20")
    resumed.load(older, model, optimizer)
    assert resolve_checkpoint("auto", out) == older  # a crash before the next save resumes this timeline
    saved = _save(resumed, 21, model, optimizer)
    assert list_checkpoints(root) == [21, 30]
    assert resolve_checkpoint("auto", out) == saved  # `latest` names the new checkpoint, and it exists
    _save(resumed, 22, model, optimizer)
    assert list_checkpoints(root) == [22, 30]  # 21 retired: the limit counts this timeline only
    _save(resumed, 30, model, optimizer)  # reaching the abandoned step replaces it
    assert list_checkpoints(root) == [30]


# ------------------------------------------------------------------ batch-size warmup follows the global step
def _token_docs(path, n=80, seed=0, longest=40):
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for d in range(n):
            f.write(json.dumps({"input_ids": [3 + (d * 7 + t) % 500 for t in range(rng.randint(4, longest))]}) + "\n")
    return str(path)


def _warmup_loader(path, kind, warmup_ratio):
    from functools import partial

    from veomni.data import build_dataloader, build_dataset
    from veomni.data.data_transform import process_pretrain_example

    dataset = build_dataset(
        train_path=path,
        datasets_type=kind,
        transform=partial(process_pretrain_example, tokenizer=None, max_seq_len=32),
        seed=5,
    )
    return build_dataloader(
        dataset=dataset,
        micro_batch_size=2,
        dataloader_batch_size=2,
        max_seq_len=32,
        dyn_bsz=True,
        drop_last=False,
        dp_rank=0,
        dp_size=1,
        dyn_bsz_buffer_size=8,
        train_steps=20,
        bsz_warmup_ratio=warmup_ratio,
        bsz_warmup_init_mbtoken=8,
        seed=5,
    )


def _micro_batch_tokens(loader, epoch, first_step):
    loader.set_epoch(epoch, first_step=first_step)
    return [tuple(mb["input_ids"][0].tolist()) for step in loader for mb in step]


@pytest.mark.parametrize("kind", ["mapping", "iterable"])  # global-batch plan / per-rank micro-batch stream
def test_bsz_warmup_follows_the_global_step_not_the_epoch(tmp_path, kind):
    """A 10-step token-budget warmup (ratio 0.5 of 20 steps): the second epoch, starting at global step 30, has
    full budgets, i.e. the very micro-batches of a run without warmup; the first epoch does warm up."""
    path = _token_docs(tmp_path / "docs.jsonl")
    warm, plain = _warmup_loader(path, kind, 0.5), _warmup_loader(path, kind, 0.0)
    assert _micro_batch_tokens(warm, 0, 0) != _micro_batch_tokens(plain, 0, 0)  # the warmup is on
    assert _micro_batch_tokens(warm, 1, 30) == _micro_batch_tokens(plain, 1, 30)
    # an epoch starting mid-warmup continues it (budgets of steps 5.. of the warmup, not 0..)
    assert _micro_batch_tokens(warm, 1, 5) not in (_micro_batch_tokens(warm, 1, 0), _micro_batch_tokens(plain, 1, 5))


# ------------------------------------------------------------ dynamic batching: every epoch's steps, counted
def _steps_of_each_epoch(loader, epochs):
    """What the loader really yields per epoch, each epoch starting at the run's global step so far."""
    steps = []
    for epoch in range(epochs):
        loader.set_epoch(epoch, first_step=sum(steps))
        steps.append(sum(1 for _ in loader))
    loader.set_epoch(0, first_step=0)
    return steps


@pytest.mark.parametrize("warmup_ratio", [0.0, 0.5])
def test_dyn_bsz_schedule_spans_the_steps_each_epoch_really_has(tmp_path, one_process_group, warmup_ratio):
    """The trainer's step count (hence the LR schedule) is the sum of what every epoch yields: dynamic batching
    packs each epoch's shuffle into a different number of micro-batches, and a warmup only lengthens the first."""
    from types import SimpleNamespace

    from veomni.trainer.base import BaseTrainer

    path = _token_docs(tmp_path / "docs.jsonl", n=60, seed=1, longest=64)  # epochs of 18, 17, 18, 18 steps
    train = SimpleNamespace(max_steps=None, bsz_warmup_ratio=warmup_ratio, num_train_epochs=4, dyn_bsz=True)
    train.train_steps = 0
    trainer = BaseTrainer.__new__(BaseTrainer)
    trainer.args = SimpleNamespace(train=train)
    trainer.device, trainer.parallel_state = torch.device("cpu"), SimpleNamespace(dp_group=None)

    def build():  # as TextTrainer does: the warmup length follows the counted steps
        loader = _warmup_loader(path, "mapping", warmup_ratio)
        loader.set_warmup_steps(int(train.train_steps * warmup_ratio))
        return loader

    trainer.build_dataloader = build
    trainer.train_dataloader = build()
    trainer.compute_train_steps()
    real = _steps_of_each_epoch(trainer.train_dataloader, 4)
    assert len(set(real)) > 1  # the epochs differ (else this test shows nothing)
    assert trainer.total_steps == sum(real)
    assert trainer.epoch_steps == real


# ------------------------------------------------------------------------------- stops through the launcher
def test_launcher_gives_stopped_workers_time_to_save(monkeypatch):
    """torchrun SIGKILLs workers 30 s after forwarding a stop; veomni.launch waits DEFAULT_STOP_GRACE_S unless
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT or --shutdown-timeout says otherwise."""
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.api import PContext

    from veomni import launch

    granted = []
    monkeypatch.setattr(
        torchrun_module, "run", lambda args: granted.append(torchrun_module.config_from_args(args)[0].shutdown_timeout)
    )
    monkeypatch.setattr(PContext, "close", PContext.close)  # main() patches it: restored after the test
    monkeypatch.setenv("VEOMNI_LAUNCHER", "1")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    argv = ["--nproc_per_node=1", "task.py"]
    assert launch.main(argv) == 0 and launch.main(["--shutdown-timeout=7", *argv]) == 0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert launch.main(argv) == 0
    assert granted == [launch.DEFAULT_STOP_GRACE_S, 7, 45] and launch.DEFAULT_STOP_GRACE_S >= 600


_REPEATED_STOP = """
import os, signal, sys, time
from veomni.trainer import lifecycle
lifecycle.REPEAT_WINDOW_S = 1.0
lifecycle.install_stop_handlers()
lifecycle.set_loop_active(True)
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # the same request by a second route (Slurm and the launcher)
print("still saving", lifecycle.stop_requested() == signal.SIGTERM, flush=True)
time.sleep(1.2)
os.kill(os.getpid(), signal.SIGTERM)  # a deliberate second request: leave now
time.sleep(5)
print("not reached")
"""


def test_a_stop_told_twice_at_once_is_one_request_a_later_one_exits_now():
    import subprocess
    import sys

    from helpers import REPO, child_env

    proc = subprocess.run(
        [sys.executable, "-c", _REPEATED_STOP], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split("\n")[0] == "still saving True", proc.stdout + proc.stderr
    assert proc.returncode == 143 and "not reached" not in proc.stdout, proc.stdout + proc.stderr
    assert "second SIGTERM: exiting now without saving" in proc.stderr


def test_a_stop_after_the_last_step_lets_the_final_save_and_teardown_finish(one_process_group, capfd):
    """A SIGTERM after the last step's all-reduce (in the final save, the export, the teardown barrier) must not
    end one rank at once ("nothing was saved", exit 143) while its peers wait in a collective: the run finishes."""
    import signal
    from types import SimpleNamespace

    from veomni.trainer import lifecycle
    from veomni.trainer.base import BaseTrainer
    from veomni.trainer.checkpointing import TrainState

    class Loader:
        closed = 0  # close(): the loader's worker processes stopped

        def set_epoch(self, epoch, first_step=0):
            pass

        def __iter__(self):
            return iter([[{}], [{}]])

        def close(self):
            self.closed += 1

    saved = []
    trainer = BaseTrainer.__new__(BaseTrainer)
    checkpoint = SimpleNamespace(save_steps=0, save_hf_weights=False)
    trainer.args = SimpleNamespace(train=SimpleNamespace(num_train_epochs=1, checkpoint=checkpoint))
    trainer.state, trainer.epoch_steps, trainer.total_steps = TrainState(), [2], 2
    trainer.train_dataloader, trainer.callbacks, trainer.evaluator = Loader(), [], None
    trainer._step_totals = lambda micro_batches: {"loss_tokens": 1, "tokens": 1, "stop": None}
    trainer.train_step = lambda micro_batches, totals: {"loss": torch.tensor(1.0), "grad_norm": torch.tensor(1.0)}
    trainer.save_checkpoint = lambda: saved.append((trainer.global_step, trainer.train_dataloader.closed))
    trainer.checkpointer = SimpleNamespace(wait=lambda: None)
    trainer.device, trainer.run_dir = torch.device("cpu"), SimpleNamespace(release=lambda: None)
    trainer.moe_metrics = SimpleNamespace(finish=lambda metrics, loss_tokens: None)
    trainer.host_group = SimpleNamespace(close=lambda: None)

    previous = {sig: signal.getsignal(sig) for sig in lifecycle.STOP_EXIT_CODES}
    lifecycle.install_stop_handlers()
    try:
        trainer.fit()
        assert saved == [(2, 1)]  # the loader's workers were stopped after the last step, before the final save
        assert trainer.train_dataloader.closed == 2  # and once more, harmlessly, as fit() returns (or fails)
        os.kill(os.getpid(), signal.SIGTERM)  # late: e.g. while every rank is in the teardown barrier
        dist.barrier()
        assert lifecycle.stop_requested() == signal.SIGTERM
        assert "SIGTERM after the last step: finishing the final save" in capfd.readouterr().err
    finally:
        lifecycle._state.update(stop_signal=None, loop_active=False, exiting=False, training_done=False)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_host_group_is_the_gloo_world_or_one_made_and_freed(one_process_group):
    """The trainer's host-side group: on a gloo world the world itself (nothing made); otherwise (NCCL) a gloo group
    that `close()` frees, so trainers run one after another in one process do not pile groups up."""
    import torch.distributed as dist

    from veomni.utils.collectives import HostGroup

    reused = HostGroup(reuse_gloo_world=True)
    assert reused.get() is dist.group.WORLD
    reused.close()
    assert dist.is_initialized()  # the world is not the host group's to close
    made = HostGroup(timeout_minutes=1)
    group = made.get()
    assert group is not dist.group.WORLD and made.get() is group  # made once, then reused
    stats = torch.ones(2)
    dist.all_reduce(stats, group=group)
    made.close()
    assert made.group is None
    with pytest.raises(ValueError, match="not registered"):  # freed: torch no longer knows it
        dist.get_rank(group)
