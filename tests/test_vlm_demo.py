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
