"""Validation (data.eval_path): the token-weighted loss of the held-out set equals transformers' loss over the same
documents one by one, and is the same on 1 and 2 ranks (an odd number of held-out micro-batches: a rank that has
run out joins the others' forwards with a masked batch); logged every eval_steps and after the last step."""

import json
import os

import torch
from transformers import AutoModelForCausalLM

from helpers import read_metrics, run_text_tasks, tiny_run_config, torchrun, write_token_data
from veomni.utils.device import get_device  # noqa: F401  (the package imports before the helpers' runs)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = os.path.join(REPO, "tasks", "train_text.py")


def _reference_loss(hf_dir, path):
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for line in open(path):
            ids = torch.tensor([json.loads(line)["input_ids"]])
            loss = model(input_ids=ids, labels=ids).loss  # mean over the document's len - 1 predictions
            total, tokens = total + loss.item() * (ids.shape[1] - 1), tokens + ids.shape[1] - 1
    return total / tokens, tokens


def test_eval_loss_equals_transformers_and_is_the_same_on_1_and_2_ranks(tmp_path):
    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=60, low=20, high=120)
    held_out = write_token_data(f"{tmp}/valid.jsonl", n=9, low=40, high=120, seed=7)  # 5 micro-batches: 3 + 2
    config = tiny_run_config(tmp)
    frozen = ["--train.optimizer.lr", "1e-20", "--train.optimizer.weight_decay", "0", "--train.max_steps", "2",
              "--train.dyn_bsz", "false", "--data.eval_path", held_out, "--train.eval_steps", "1",
              "--train.checkpoint.save_hf_weights", "true"]  # fmt: skip
    one = run_text_tasks(1, [(config, f"{tmp}/one", frozen)])[0]
    torchrun(TASK, [config, "--train.checkpoint.output_dir", f"{tmp}/two", *frozen], 2)
    two = read_metrics(f"{tmp}/two")
    expected, tokens = _reference_loss(f"{tmp}/one/hf", held_out)
    for metrics in (one, two):
        assert [m["step"] for m in metrics if "eval_loss" in m] == [1, 2]  # every step, and the last
        for m in metrics:
            assert m["eval_tokens"] == tokens
            assert abs(m["eval_loss"] - expected) <= 1e-5 * expected, (m["eval_loss"], expected)
    assert abs(one[-1]["eval_loss"] - two[-1]["eval_loss"]) <= 1e-6 * expected


def test_eval_runs_at_its_steps_and_after_the_last(tmp_path):
    tmp = str(tmp_path)
    held_out = write_token_data(f"{tmp}/valid.jsonl", n=5, low=40, high=100, seed=3)
    config = tiny_run_config(tmp)
    proc = torchrun(TASK, [config, "--train.checkpoint.output_dir", f"{tmp}/run", "--train.max_steps", "5",
                           "--data.eval_path", held_out, "--train.eval_steps", "2"], 2)  # fmt: skip
    metrics = read_metrics(f"{tmp}/run")
    assert [m["step"] for m in metrics if "eval_loss" in m] == [2, 4, 5]
    assert "step 5/5: eval loss" in proc.stdout
    losses = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert losses[-1] < losses[0]  # the model learns the held-out arithmetic runs too
