"""The SFT demo as the README runs it (`bash train.sh tasks/train_text.py configs/text/sft_demo.yaml`), made short:
the real Qwen3 tokenizer and chat template, the real FastChat conversations (both fetched into .assets/chat by
train.sh on first use), a tiny Qwen3 with the full 151,936-row vocabulary, 3 steps on 2 CPU ranks. Slow."""

import json
import math
import os
import subprocess
import sys

import pytest

from helpers import REPO, child_env, read_metrics


@pytest.mark.slow
def test_sft_demo_runs_through_train_sh_on_the_real_qwen_vocabulary(tmp_path):
    out = str(tmp_path / "sft_demo")
    env = dict(child_env(), PYTHON=sys.executable, NPROC_PER_NODE="2")
    env.pop("OMP_NUM_THREADS")  # train.sh picks one thread per rank
    cmd = ["bash", "train.sh", "tasks/train_text.py", "configs/text/sft_demo.yaml"]
    extra = ["--train.max_steps", "3", "--train.num_train_epochs", "1", "--train.checkpoint.output_dir", out]
    proc = subprocess.run(cmd + extra, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "chat template: the tokenizer's own" in proc.stdout  # Qwen3's template, not a stand-in
    assert "<|im_start|>assistant\n[[<think>" in proc.stdout  # the first sample: the reply, marked as trained
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # from scratch over the full vocabulary: the first loss is about ln(151,936) = 11.93
    assert abs(metrics[0]["loss"] - math.log(151936)) < 0.5, metrics[0]
    assert metrics[-1]["loss"] < metrics[0]["loss"] and metrics[-1]["eval_tokens"] > 500  # 20 held-out chats
    config = json.load(open(os.path.join(out, "hf", "tokenizer_config.json")))
    assert "<|im_start|>" in config["chat_template"]  # the export serves with the template it was trained on
