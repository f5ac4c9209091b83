"""End to end through train.sh on the bundled demo (real Shakespeare text, repo-built tokenizer). Slow."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from helpers import REPO, child_env, read_metrics, tiny_run_config


def _train_sh(task, config, *extra, timeout=600):
    env = child_env()
    env.pop("OMP_NUM_THREADS")
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", "train.sh", task, config, *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
def test_demo_runs_through_train_sh_with_overrides(tmp_path):
    out = str(tmp_path / "demo")
    _train_sh(
        "tasks/train_text.py",
        "configs/text/demo.yaml",
        "--train.max_steps",
        "4",
        "--train.checkpoint.output_dir",
        out,
        "--train.optimizer.lr",
        "0.002",
        "--train.loss_plot",
        "true",
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr", "tokens", "tokens_per_sec"):
        assert all(isinstance(m[key], (int, float)) for m in metrics), key
    assert metrics[0]["tokens"] > 0 and metrics[-1]["loss"] < metrics[0]["loss"]
    # the demo evaluates its held-out split (data.eval_path) after the last step
    assert "eval_loss" not in metrics[0] and metrics[-1]["eval_tokens"] > 10_000 and metrics[-1]["eval_ppl"] > 1
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
    resolved = yaml.safe_load(open(os.path.join(out, "veomni_config.yaml")))
    assert resolved["train"]["optimizer"]["lr"] == 0.002 and resolved["train"]["max_steps"] == 4
    assert resolved["data"]["max_seq_len"] == 512  # from the YAML


@pytest.mark.slow
def test_plain_torch_script_matches_trainer(tmp_path):
    """tasks/deprecated_task/train_torch.py and the trainer build the same thing: same losses."""
    config = tiny_run_config(str(tmp_path))
    _train_sh("tasks/deprecated_task/train_torch.py", config, "--train.checkpoint.output_dir", str(tmp_path / "plain"))
    _train_sh("tasks/train_text.py", config, "--train.checkpoint.output_dir", str(tmp_path / "trainer"))
    plain = [json.loads(x) for x in open(tmp_path / "plain" / "metrics.jsonl")]
    trainer = read_metrics(str(tmp_path / "trainer"))
    assert len(plain) == len(trainer) == 10
    for a, b in zip(plain, trainer):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"])
