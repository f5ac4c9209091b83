"""The VL demo's path end to end through train.sh, made short: 2 ranks, tiny batches, a few real easy-vqa samples,
the real Qwen processor; metrics count text and visual tokens apart, loss.png is drawn, and the HF export (with
the processor beside it) reloads."""

import json
import os
import subprocess

import pytest
import yaml

from helpers import REPO, child_env, read_metrics
from veomni.data.multimodal.demo_data import write_easy_vqa_jsonl
from veomni.data.multimodal.processor_builder import build_qwen_processor_folder

DEMO = os.path.join(REPO, "configs", "multimodal", "qwen2_5_vl", "demo.yaml")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    processor = build_qwen_processor_folder(
        "qwen2_5_vl", str(root / "processor"), min_pixels=56 * 56, max_pixels=56 * 56
    )
    data = write_easy_vqa_jsonl(str(root / "vqa.jsonl"), "train", limit=24)
    return processor, data


def test_vlm_demo_runs_through_train_sh(assets, tmp_path):
    processor, data = assets
    out = tmp_path / "run"
    with open(DEMO) as f:  # the demo config on the test's assets (train.sh then builds no demo assets)
        config = yaml.safe_load(f)
    config["model"].update(tokenizer_path=processor, config_path=os.path.join(REPO, config["model"]["config_path"]))
    config["data"]["train_path"] = data
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(config))
    overrides = {
        "train.max_steps": "3",
        "train.micro_batch_size": "4",
        "train.global_batch_size": "8",
        "train.checkpoint.output_dir": str(out),
        "train.checkpoint.save_steps": "0",
        "train.log_steps": "1",
        "train.loss_plot": "true",
    }
    args = [a for k, v in overrides.items() for a in (f"--{k}", v)]
    env = dict(child_env(), NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", "train.sh", "tasks/train_vlm.py", str(tmp_path / "demo.yaml"), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = read_metrics(str(out))
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["visual_tokens"] > 0 and m["text_tokens"] > 0 and m["audio_tokens"] == 0
        assert m["visual_tokens"] + m["text_tokens"] == m["tokens"]
        assert m["visual_tokens_per_sec"] > 0
    assert os.path.isfile(out / "loss.png")
    hf = out / "hf"
    assert json.load(open(hf / "config.json"))["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert os.path.isfile(hf / "processor_config.json") and os.path.isfile(hf / "tokenizer.json")


def test_a_hub_layout_qwen2_5_vl_checkpoint_fine_tunes_and_exports_back(assets, tmp_path):
    """A released Qwen2.5-VL checkpoint names its tensors `model.layers.*` and `visual.*` (transformers renames
    them on load): it trains through tasks/train_vlm.py and the export is written back in that hub layout."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    processor, data = assets
    hub = tmp_path / "hub"
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(os.path.join(REPO, "configs", "multimodal", "qwen2_5_vl", "demo_model"))
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(hub)  # transformers' own hub layout
    with safe_open(hub / "model.safetensors", "pt") as f:
        before = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.layers.0.mlp.up_proj.weight" in before and "visual.merger.mlp.0.weight" in before
    with open(DEMO) as f:
        run = yaml.safe_load(f)
    run["model"] = dict(run["model"], model_path=str(hub), config_path=None, tokenizer_path=processor)
    run["data"]["train_path"] = data
    run["train"].update(max_steps=2, micro_batch_size=4, global_batch_size=8, log_steps=1, init_device="meta")
    run["train"]["optimizer"].update(lr=1e-4, lr_min=1e-4, lr_warmup_ratio=0.0, weight_decay=0.0)
    run["train"]["checkpoint"].update(output_dir=str(tmp_path / "run"), save_steps=0)
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(run))
    env = dict(child_env(), NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", "train.sh", "tasks/train_vlm.py", str(tmp_path / "ft.yaml")], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert [m["step"] for m in read_metrics(str(tmp_path / "run"))] == [1, 2]
    with safe_open(tmp_path / "run" / "hf" / "model.safetensors", "pt") as f:
        after = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(after) == sorted(before)  # the hub's own names, every one of them
    assert all(after[k].dtype == before[k].dtype for k in before)
    # two Adam steps of lr 1e-4 move each weight by at most ~2e-4: the run started from the hub weights (a fresh
    # initialisation would be ~1e-2 away) and trained them (some moved)
    drift = {k: (after[k] - before[k]).abs().max().item() for k in before}
    assert max(drift.values()) < 2.5e-4, max(drift.items(), key=lambda kv: kv[1])
    assert sum(d > 0 for d in drift.values()) > len(drift) // 2
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    assert torch.equal(
        reloaded.model.language_model.layers[0].mlp.up_proj.weight, after["model.layers.0.mlp.up_proj.weight"]
    )
