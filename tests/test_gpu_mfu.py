"""benchmarks/gpu_mfu.py: refuses politely without a GPU; its whole code path runs on CPU (`--smoke`); its FLOP
count's parameter term matches the model."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, child_env

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu_mfu  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_refuses_politely_on_cpu():
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_mfu.py"], cwd=REPO, env=child_env(), capture_output=True, text=True
    )
    assert done.returncode == 1 and "no CUDA GPU: nothing measured" in done.stdout
    assert "Traceback" not in done.stderr


def test_smoke_run_goes_through_the_whole_path_on_cpu():
    """Trainer and bare loop, dense and MoE, on the demo models: the first GPU run must not find a bug in the script
    (this test found two: the synthetic trainer set no data path and no per-epoch step counts)."""
    env = dict(child_env(), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_mfu.py", "--smoke"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if "trainer/bare" in line]
    assert [row.split()[0] for row in rows] == ["demo_qwen2"] * 2 + ["demo_qwen3_moe"] * 2, done.stdout
    assert [row.split()[3] for row in rows] == ["ckpt=off", "ckpt=on"] * 2  # with and without checkpointing
    assert all("MFU" in row and "GiB" in row for row in rows)


def test_flop_formula_counts_the_matmul_parameters(tmp_path):
    import json

    from veomni.models import build_foundation_model

    for name in ("qwen3_0_6b", "qwen3_30b_a3b"):
        config = dict(gpu_mfu.model_config(name, moe_layers=2), num_hidden_layers=2)
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        model = build_foundation_model(str(tmp_path / name), init_device="meta")
        layers = model.model.layers
        matmul = sum(p.numel() for layer in layers for p in layer.parameters() if p.dim() >= 2)
        if config.get("num_experts"):  # only the top-k of the experts' weights work per token
            experts = sum(p.numel() for layer in layers for p in layer.mlp.experts.parameters())
            matmul -= experts - experts * config["num_experts_per_tok"] // config["num_experts"]
        assert gpu_mfu.active_params(config) == matmul + model.lm_head.weight.numel()
    # attention: 6 * layers * heads * head_dim * sum(len^2), checked on a hand-sized example
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8, "hidden_size": 32, "num_key_value_heads": 2,
            "intermediate_size": 64, "vocab_size": 100}  # fmt: skip
    assert gpu_mfu.step_flops(tiny, [3, 5]) - gpu_mfu.step_flops(tiny, [8]) == 6 * 2 * 4 * 8 * (9 + 25 - 64)
