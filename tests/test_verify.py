"""`python -m veomni.verify` (veomni/verify): a clean layout passes, the resume is bit-identical, the reshard
resume within tolerance, and each deliberate break (VEOMNI_VERIFY_BREAK, veomni/verify/breaks.py) is named with
its layout and parameter, with a non-zero exit; the resume is a real SIGKILL mid-step after a checkpoint; the
peak-memory column reads each rank and keeps the largest. Two verify runs in all (5 launches), 1-2 steps of tiny
models."""

import os
import subprocess
import sys

import pytest

from helpers import REPO, TINY_QWEN2, child_env, write_model_config, write_moe_config, write_token_data, write_tokenizer


def _config(tmp: str, model_dir: str) -> str:
    import yaml

    tok, data = os.path.join(tmp, "tokenizer"), os.path.join(tmp, "data.jsonl")
    if not os.path.isdir(tok):
        write_tokenizer(tok)
        write_token_data(data, n=40, high=64)
    config = {
        "model": {"config_path": model_dir, "tokenizer_path": tok},
        "data": {"train_path": data, "max_seq_len": 64},
        "train": {"seed": 0, "micro_batch_size": 2, "global_batch_size": 4, "dyn_bsz": False, "max_steps": 50},
    }
    path = os.path.join(model_dir, "run.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def _verify(config: str, breaks: str, *flags: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**child_env(), "VEOMNI_VERIFY_BREAK": breaks, **env_extra}
    cmd = [sys.executable, "-m", "veomni.verify", config, "--nproc", "2", *flags]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _row(stdout: str, layout: str) -> str:
    rows = [line for line in stdout.splitlines() if line.startswith(layout + " ")]
    assert len(rows) == 1, f"no row {layout!r} in:\n{stdout}"
    return rows[0]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny Qwen3 (q_norm / k_norm) under FSDP2, TP 2 and Ulysses 2 sync for 2 steps, with the SP and TP breaks:
    FSDP2 and both resumes must pass, TP and Ulysses must fail, each naming its own parameter. A stand-in peak
    reader ((rank + 1) MiB, measure.FAKE_PEAK_ENV) runs the GPU's peak-memory column on CPU."""
    tmp = str(tmp_path_factory.mktemp("verify"))
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16}
    model = write_model_config(os.path.join(tmp, "qwen3"), **{**TINY_QWEN2, **qwen3})
    report = os.path.join(tmp, "report.md")
    proc = _verify(_config(tmp, model), "sp_gather,tp_norm", "--layouts", "fsdp2,tp,ulysses", "--steps", "2",
                   "--report", report, VEOMNI_VERIFY_FAKE_PEAK_BYTES=str(2**20))  # fmt: skip
    return proc, report


def test_clean_layout_and_resumes_pass(dense):
    proc, _ = dense
    assert _row(proc.stdout, "FSDP2 2").endswith("ok [loss/grad norm 1e-05, grads 1e-04]"), proc.stdout
    # the one-process run was SIGKILLed in step 2 after its step-1 checkpoint, and resumed bit-identically
    assert "ok [bit-identical]" in _row(proc.stdout, "SIGKILL in step 2, resume 1 -> 1"), proc.stdout
    assert " ok [" in _row(proc.stdout, "reshard resume 2 -> 1"), proc.stdout
    # the planner's exact figures on CPU: predicted = measured parameter and optimizer bytes
    plans = {line.split(":")[0].strip(): line for line in proc.stdout.splitlines() if line.startswith("  ")}
    plan = plans["FSDP2 2"]
    for part in plan.split(":", 1)[1].split(","):
        if "-" not in part and "peak" not in part:
            predicted, measured = part.split()[-3], part.split()[-1]
            assert predicted == measured, plan
    # the peak column: each rank's reading, the largest over the ranks (rank 1's 2 MiB; one process: 1 MiB)
    assert "peak " in plan and " / 2.000 (measured/predicted " in plan, plan
    assert " / 1.000 (measured/predicted " in plans["one process"], plans


def test_tp_replicated_norm_gradient_break_is_named(dense):
    proc, _ = dense
    assert proc.returncode == 1, proc.stderr[-3000:]
    row = _row(proc.stdout, "TP 2")
    assert "FAIL: model.layers.0.self_attn.q_norm.weight under TP 2 (step 1)" in row, proc.stdout


def test_sp_gradient_exchange_break_is_named(dense):
    proc, report = dense
    row = _row(proc.stdout, "Ulysses 2 sync")
    assert "FAIL: model.layers.0.self_attn.k_proj.weight under Ulysses 2 sync (step 1)" in row, proc.stdout
    with open(report) as f:
        text = f.read()
    assert "Verdict: **FAILED**" in text and "k_proj.weight under Ulysses 2 sync" in text and "torch " in text


def test_ep_gradient_scaling_break_is_named(tmp_path):
    model = write_moe_config(os.path.join(str(tmp_path), "moe"))
    proc = _verify(_config(str(tmp_path), model), "ep_scale", "--layouts", "ep", "--steps", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    row = _row(proc.stdout, "EP 2 (FSDP2 2)")
    assert "FAIL: model.layers.0.mlp.experts.gate_up_proj under EP 2 (FSDP2 2) (step 1)" in row, proc.stdout
    plan = [line for line in proc.stdout.splitlines() if line.startswith("  EP 2 (FSDP2 2): ")]
    assert plan and plan[0].endswith(" / n/a (no GPU)"), proc.stdout  # CPU: no allocator peak to measure


def test_layouts_auto_lists_skipped_layouts_with_reasons():
    from veomni.arguments import VeOmniArguments, parse_args
    from veomni.plan.model_shape import ModelShape
    from veomni.verify.layouts import choose_layouts

    args = parse_args(VeOmniArguments, [os.path.join(REPO, "configs", "text", "qwen3_moe_demo.yaml")])
    sizes = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, tied=False)
    moe = ModelShape("qwen3_moe", **sizes, experts=8, top_k=2, moe_intermediate=32, moe_layers=2)
    runs, skipped = choose_layouts(args, moe, 2, ["auto"])
    assert [r.name for r in runs] == ["FSDP2 2", "Ulysses 2 sync", "Ulysses 2 async", "EP 2 (FSDP2 2)"]
    assert dict(skipped) == {
        "hsdp": "needs 2 replicas x 2 shards: 4 ranks (--nproc is 2)",
        "tp": "tensor parallel does not take MoE models (use EP)",
        "ep_ulysses": "needs EP 2 x Ulysses 2: 4 ranks (--nproc is 2)",
    }
    dense = ModelShape("qwen2", **sizes)
    runs, skipped = choose_layouts(args, dense, 4, ["auto"])
    names = [r.name for r in runs]
    assert names == ["FSDP2 4", "HSDP 2x2", "TP 2 x FSDP2 2", "Ulysses 2 sync x FSDP2 2", "Ulysses 2 async x FSDP2 2"]
    assert dict(skipped) == {"ep": "not a MoE model", "ep_ulysses": "not a MoE model"}


def test_peak_reader_reads_the_accelerator_it_is_given(monkeypatch):
    """The peak column's reader: none on CPU; on an accelerator, torch.accelerator's allocator peak of that device
    (stood in for here: no GPU on CI), whatever its kind."""
    import torch

    from veomni.verify.measure import FAKE_PEAK_ENV, peak_reader

    monkeypatch.delenv(FAKE_PEAK_ENV, raising=False)
    assert peak_reader(torch.device("cpu")) is None
    calls = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda d: calls.append(("read", d)) or 123)
    reader = peak_reader(torch.device("xpu", 1))
    reader.reset()
    assert reader.read() == 123.0
    assert calls == [("reset", torch.device("xpu", 1)), ("read", torch.device("xpu", 1))]
