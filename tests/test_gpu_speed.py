"""benchmarks/gpu_speed.py --smoke: the GPU script's whole code path on CPU with the tiny demo Qwen3 (CUDA tests
stage, trainer and bare loop per variant, the HF Trainer row, the sync and profile stages, the results file and
table), so that a short GPU loan finds no bug in it. The figures mean nothing here."""

import json
import os
import subprocess
import sys

from helpers import REPO, child_env


def test_smoke_runs_every_stage_and_writes_the_results(tmp_path):
    env = dict(child_env(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "benchmarks/gpu_speed.py", "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    (results,) = [f for f in os.listdir(tmp_path) if f.startswith("smoke_") and f.endswith(".jsonl")]
    rows = [json.loads(line) for line in open(tmp_path / results)]
    steps = {(r["variant"], r["loop"]) for r in rows if r["kind"] == "step"}
    assert steps == {(v, loop) for v in ("eager", "compile+kernels+fp8") for loop in ("trainer", "bare")}, rows
    assert all(r["mfu"] > 0 and r["s"] > 0 for r in rows if r["kind"] in ("step", "hf"))
    assert [r["kind"] for r in rows if r["kind"] in ("hf", "sync")] == ["hf", "sync"]
    assert {r["loop"] for r in rows if r["kind"] == "profile"} == {"trainer", "bare"}
    assert [r["loss"] for r in rows if r["kind"] == "loss"] == ["chunked"]  # liger's needs CUDA
    assert not [r for r in rows if r["kind"] == "error"]
    for stage in ("tests", "speed:", "hf:", "sync:", "profile:", "loss:"):
        assert f"=== {stage}" in done.stdout and "trainer/bare" in done.stdout
