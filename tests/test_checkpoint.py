"""Checkpoints: exact resume after SIGKILL, crash during save, resharded resume, HF export, offload, NaN guard."""

import json
import os
import sys
import time

import pytest
import torch

from helpers import (
    REPO,
    assert_close_series,
    child_env,
    descendants,
    kill_tree,
    launch_sequence,
    read_metrics,
    run_python,
    run_text_task,
    run_text_tasks,
    start_ranks,
    tiny_run_config,
    torchrun,
    write_model_config,
    write_token_data,
)
from veomni.checkpoint import list_checkpoints

SCENARIOS = os.path.join(REPO, "tests", "dist", "trainer_scenarios.py")


def _ckpts(out):
    return list_checkpoints(os.path.join(out, "checkpoints"))


def test_exact_resume_after_sigkill_with_packing_dyn_bsz_and_workers(tmp_path):
    """20 steps uninterrupted vs killed (SIGKILL to launcher and workers) after step 10's checkpoint and
    resumed: steps 11-20 have bit-identical loss and grad norm. 2 ranks, dyn_bsz packing, 2 loader workers,
    attention dropout (so the RNG restore is exercised). The killed run stalls in step 11 (stall_at_11) rather
    than relying on a model slow enough to be caught between the two checkpoints: the tiny model will do."""
    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=1500)
    config = tiny_run_config(tmp)
    # attention dropout on: the resumed steps draw the same masks only if the RNG state is restored
    write_model_config(f"{tmp}/model", attention_dropout=0.1)
    flags = [
        "--train.max_steps",
        "20",
        "--train.dyn_bsz",
        "true",
        "--data.dataloader.num_workers",
        "2",
        "--train.checkpoint.save_steps",
        "10",
        "--train.micro_batch_size",
        "2",
    ]
    out = f"{tmp}/killed"
    cmd = [sys.executable, SCENARIOS, "stall_at_11", config, "--train.checkpoint.output_dir", out, *flags]
    with open(os.devnull, "w") as null:
        ranks = start_ranks(cmd, 2, child_env(), null, null)
    latest = os.path.join(out, "checkpoints", "latest")
    deadline = time.time() + 240
    while time.time() < deadline and not (os.path.isfile(latest) and open(latest).read() == "global_step_10"):
        assert all(rank.poll() is None for rank in ranks), "the run ended before its step-10 checkpoint"
        time.sleep(0.02)
    workers = [pid for rank in ranks for pid in [rank.pid, *descendants(rank.pid)]]
    for rank in ranks:
        kill_tree(rank.pid)  # every rank and its loader workers at once, as a node failure
    [rank.wait() for rank in ranks]
    for pid in workers:  # all gone before the resume starts
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
            time.sleep(0.01)
    assert _ckpts(out) == [10]
    steps_before = len(read_metrics(out))
    assert 10 <= steps_before < 20, steps_before

    # the resume first in a fresh launch (what it proves), the uninterrupted reference after it in the same one
    resumed, ref = run_text_tasks(2, [(config, out, flags + ["--train.checkpoint.load_path", "auto"]),
                                      (config, f"{tmp}/ref", flags)])  # fmt: skip
    assert [m["step"] for m in ref] == list(range(1, 21))
    assert [m["step"] for m in resumed] == list(range(1, 21))  # metrics.jsonl continued, nothing duplicated
    for a, b in zip(ref[10:], resumed[10:]):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    assert _ckpts(out) == [10, 20]


def test_crash_during_save_leaves_previous_checkpoint(tmp_path):
    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=400)
    config = tiny_run_config(tmp)
    out = f"{tmp}/out"
    flags = ["--train.max_steps", "20", "--train.checkpoint.save_steps", "10", "--train.checkpoint.output_dir", out]
    proc = torchrun(SCENARIOS, ["crash_in_save", config, *flags], 2, check=False)
    assert proc.returncode != 0
    assert _ckpts(out) == [10]
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "global_step_10"
    assert os.path.isdir(os.path.join(out, "checkpoints", "global_step_20.tmp"))  # the half-written save
    before = read_metrics(out)
    assert len(before) == 20  # step 20 ran; only its checkpoint was lost

    resumed = run_text_task(config, 2, out, flags + ["--train.checkpoint.load_path", "auto"])
    for a, b in zip(before[10:], resumed[10:]):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert _ckpts(out) == [10, 20] and not os.path.exists(os.path.join(out, "checkpoints", "global_step_20.tmp"))


@pytest.fixture(scope="module")
def world_size_runs(tmp_path_factory):
    """10 steps with a checkpoint at 5, on 2 ranks and on 1, each resumed from step 5 on the other world size:
    {(save_ranks, resume_ranks): (uninterrupted run's output dir, its metrics, the resumed run's metrics)}.
    The one-process resume of the 2-rank run and the one-process reference share a launch (the resume first, so
    it starts in a fresh process as it would alone); each resume loads what another process saved."""
    tmp = str(tmp_path_factory.mktemp("world_size"))
    config = tiny_run_config(tmp)  # lr warmup 20% then cosine: every step after the resume has a different lr
    save = ["--train.max_steps", "10", "--train.checkpoint.save_steps", "5"]

    def resume_from(out):
        return ["--train.max_steps", "10", "--train.checkpoint.load_path", f"{out}/checkpoints/global_step_5"]

    saved_on_2 = run_text_task(config, 2, f"{tmp}/saved_on_2", save)
    resumed_on_1, saved_on_1 = run_text_tasks(
        1, [(config, f"{tmp}/resumed_on_1", resume_from(f"{tmp}/saved_on_2")), (config, f"{tmp}/saved_on_1", save)]
    )
    resumed_on_2 = run_text_task(config, 2, f"{tmp}/resumed_on_2", resume_from(f"{tmp}/saved_on_1"))
    return {
        (2, 1): (f"{tmp}/saved_on_2", saved_on_2, resumed_on_1),
        (1, 2): (f"{tmp}/saved_on_1", saved_on_1, resumed_on_2),
    }


@pytest.mark.parametrize("save_ranks,resume_ranks", [(2, 1), (1, 2)])
def test_resume_on_another_world_size(world_size_runs, save_ranks, resume_ranks):
    """10 steps on `save_ranks` (checkpoint at 5) vs the same run resumed from step 5 on `resume_ranks`: steps 6-10
    agree, so lost AdamW moments (they steer every later update) or a lost warmup+cosine position would show."""
    out, ref, resumed = world_size_runs[(save_ranks, resume_ranks)]
    assert _ckpts(out) == [5, 10] and len({m["lr"] for m in ref[5:]}) == 5
    assert [m["step"] for m in resumed] == [6, 7, 8, 9, 10]
    assert [m["lr"] for m in resumed] == [m["lr"] for m in ref[5:]]
    assert_close_series([m["loss"] for m in ref[5:]], [m["loss"] for m in resumed], 1e-5, "resumed loss")
    assert_close_series([m["grad_norm"] for m in ref[5:]], [m["grad_norm"] for m in resumed], 1e-5, "resumed grad norm")


def test_hf_export_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = str(tmp_path)
    config = tiny_run_config(tmp)
    out = f"{tmp}/out"
    run_text_task(config, 2, out, ["--train.max_steps", "3", "--train.checkpoint.save_hf_weights", "true"])
    merged = f"{tmp}/merged"
    merge = [sys.executable, os.path.join(REPO, "scripts", "merge_dcp_to_hf.py")]
    merge += ["--checkpoint", os.path.join(out, "checkpoints", "global_step_3"), "--output", merged]
    run_python(merge, env=child_env(), check=True)
    ids = torch.randint(3, 500, (2, 40))
    logits = []
    for folder in (os.path.join(out, "hf"), merged):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert type(model).__name__ == "Qwen2ForCausalLM"
        AutoTokenizer.from_pretrained(folder)  # tokenizer files travel with the weights
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    assert torch.equal(logits[0], logits[1])
    # the export holds the trained weights: they differ from the initialisation the run started from
    init = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(merged).config)
    assert not torch.equal(init.model.norm.weight, AutoModelForCausalLM.from_pretrained(merged).model.norm.weight)


def test_offload_onload_then_continue_matches(tmp_path):
    tmp = str(tmp_path)
    config = tiny_run_config(tmp)
    steps = ["--train.max_steps", "6"]
    # the plain run first, in a fresh process as it would run alone; then the offloading one in the same launch
    proc = launch_sequence(2, [("plain", config, f"{tmp}/ref", steps), ("offload", config, f"{tmp}/off", steps)])
    ref, got = read_metrics(f"{tmp}/ref"), read_metrics(f"{tmp}/off")
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref]
    report = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"offload')]
    assert len(report) == 2 and all(r["offload_bytes_on_host"] > 0 for r in report)
    for r in report:  # every resident byte was sent to the host and brought back (a no-op offload sends none)
        assert r["resident_bytes"] > 0 and r["asked_to_host"] >= r["resident_bytes"], r
        assert r["asked_to_device"] >= r["resident_bytes"] and r["back_on_device"] == r["resident_bytes"], r
        assert r["left_on_device"] == 0, r  # on an accelerator nothing stays behind


def test_nonfinite_loss_stops_and_saves_nothing_poisoned(tmp_path):
    """One launch: first the run that skips the NaN step and goes on, then the one that stops on it (it ends the
    launch with an error, so it comes last)."""
    tmp = str(tmp_path)
    config = tiny_run_config(tmp)
    out, skip = f"{tmp}/out", f"{tmp}/skip"
    steps = ["--train.max_steps", "5"]
    proc = launch_sequence(
        2,
        [
            ("nan_at_3", config, skip, [*steps, "--train.skip_nonfinite_steps", "true"]),
            ("nan_at_3", config, out, [*steps, "--train.checkpoint.save_steps", "1"]),
        ],
        check=False,
    )
    assert proc.returncode != 0
    # the stopping run's error (the skipping run only warns "...at step 3: step skipped")
    stopped = "non-finite loss nan or grad norm nan at step 3 (set train.skip_nonfinite_steps to skip such steps)"
    assert stopped in proc.stderr + proc.stdout
    assert _ckpts(out) == [1, 2]

    metrics = read_metrics(skip)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert metrics[2]["skipped"] is True and all(m["loss"] == m["loss"] for m in metrics[3:])  # finite again


def test_multi_optimizer_checkpoint_and_offload(tmp_path):
    model_dir = write_model_config(str(tmp_path / "model"))
    proc = torchrun(os.path.join(REPO, "tests", "dist", "check_multi_optimizer.py"), [model_dir, str(tmp_path)], 2)
    assert proc.stdout.count("MULTI_OPTIMIZER_OK") == 2


def test_async_save_retention_and_explicit_path(tmp_path):
    tmp = str(tmp_path)
    config = tiny_run_config(tmp)
    out = f"{tmp}/out"
    flags = [
        "--train.max_steps",
        "9",
        "--train.checkpoint.save_steps",
        "3",
        "--train.checkpoint.async_save",
        "true",
        "--train.checkpoint.save_total_limit",
        "2",
    ]
    ref = run_text_task(config, 2, out, flags)
    assert _ckpts(out) == [6, 9]  # step 3 retired
    again = f"{tmp}/again"
    resumed = run_text_task(
        config, 2, again, flags + ["--train.checkpoint.load_path", os.path.join(out, "checkpoints", "global_step_6")]
    )
    assert [m["step"] for m in resumed] == [7, 8, 9]
    for a, b in zip(ref[6:], resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    proc = torchrun(
        os.path.join(REPO, "tasks", "train_text.py"),
        [config, "--train.checkpoint.load_path", f"{tmp}/nowhere"],
        1,
        check=False,
    )
    assert proc.returncode != 0 and "is not a complete checkpoint" in proc.stderr
