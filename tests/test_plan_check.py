"""train.plan_check (veomni/plan/runlog.py PlanCheckCallback, handed to the trainer by tasks/train_text.py): a
layout predicted to exceed the device's memory is refused in one line naming the largest term and the layouts that
fit; `warn` runs it with a warning. The budget is made tiny (train.plan_check_memory_gib) so the tiny model is over."""

import os
import subprocess
import sys

from helpers import REPO, child_env, run_python, tiny_run_config

TINY_BUDGET = ["--train.plan_check_memory_gib", "1e-5", "--train.max_steps", "1"]


def _train(config: str, out: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(REPO, "tasks", "train_text.py"), config, *TINY_BUDGET, *flags]
    cmd += ["--train.checkpoint.output_dir", out]
    return run_python(cmd, env=child_env(), timeout=300)


def test_refuse_is_one_line_and_warn_runs(tmp_path):
    tmp = str(tmp_path)
    config = tiny_run_config(tmp)
    refused = _train(config, f"{tmp}/refused")
    assert refused.returncode == 1, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if "train.plan_check" in line]
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    line = lines[0]
    assert "error: PlanRefused: train.plan_check: this layout is predicted to need" in line, line
    assert "over the 10.49 KiB of device memory" in line and "largest term: " in line, line
    assert "layouts of 1 ranks that fit: " in line, line
    assert not os.path.exists(f"{tmp}/refused/metrics.jsonl")  # no step ran

    warned = _train(config, f"{tmp}/warned", "--train.plan_check", "warn")
    assert warned.returncode == 0, warned.stderr[-3000:]
    assert "(train.plan_check: warn, so it runs)" in warned.stderr + warned.stdout
    assert os.path.isfile(f"{tmp}/warned/metrics.jsonl")
