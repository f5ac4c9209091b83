"""HF exports written by every rank (veomni/checkpoint/hf_export.py): on 2 ranks, each rank's peak-RSS growth
during an export stays within 1.3 x (its shard + the largest tensor), for the HF export and LoRA's merged and adapter
exports; each folder holds exactly what the rank-0 export wrote (same keys, dtypes, values, and the files byte for
byte as safetensors writes them). The rank-0 export gathered the whole model on rank 0: its growth there was the
model (benchmarks/hf_export.py measures both at Qwen3-1.7B's shape)."""

import json
import os

import torch

from helpers import REPO, torchrun

SCRIPT = os.path.join(REPO, "tests", "dist", "check_export_memory.py")
# Qwen3-shaped, 17M parameters (69 MB fp32): the largest tensor (the embedding, 6 MB) is 9% of the whole
SHAPE = dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=8, head_dim=48)
SHAPE.update(num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=False)


def _write_hub(folder: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE), dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="20MB")
    return folder


def test_every_rank_exports_within_its_shard_plus_one_tensor(tmp_path):
    hub = _write_hub(str(tmp_path / "hub"))
    proc = torchrun(SCRIPT, [hub, str(tmp_path / "out")], 2, timeout=900)
    marker = "EXPORT_MEMORY "
    results = [json.loads(line[len(marker) :]) for line in proc.stdout.splitlines() if line.startswith(marker)]
    assert sorted((r["what"], r["rank"]) for r in results) == [
        (what, rank) for what in ("hf", "lora_adapter", "lora_merged") for rank in (0, 1)
    ], proc.stdout[-2000:]
    for r in results:
        budget = 1.3 * (r["shard"] + r["largest"])
        print(f"{r['what']} rank {r['rank']}: growth {r['growth'] / 2**20:.1f} MiB, budget {budget / 2**20:.1f} MiB")
        assert r["largest"] < (2 * r["shard"]) / 8  # the whole is the two shards
        assert r["growth"] <= budget, f"{r['what']} on rank {r['rank']}: grew {r['growth']} bytes, budget {budget}"
    assert "EXPORT_CHECKS_OK" in proc.stdout, proc.stdout[-3000:]


def test_merge_dcp_to_hf_on_two_ranks_writes_what_one_process_writes(tmp_path, one_process_group):
    """scripts/merge_dcp_to_hf.py under torchrun (the ranks share the tensors) writes the same files, byte for byte,
    as dcp_to_hf in one process, for Qwen3-MoE (per-expert hub keys split from the fused experts)."""
    import filecmp
    import sys

    from hf_families import write_checkpoint

    from helpers import child_env, launch_ranks
    from veomni.checkpoint import Checkpointer, dcp_to_hf
    from veomni.checkpoint.hf_export import architecture_of, export_config
    from veomni.models import build_foundation_model

    hub = write_checkpoint("qwen3_moe", str(tmp_path / "hub"))
    model = build_foundation_model(hub, hub, torch_dtype="float32")
    attach = lambda folder: export_config(model.config, os.path.join(folder, "hf_config"), architecture_of(model))  # noqa: E731
    path = Checkpointer(str(tmp_path / "run")).save(1, model, torch.optim.AdamW(model.parameters()), {}, {}, attach)
    one = dcp_to_hf(path, str(tmp_path / "one"), max_shard_bytes=300_000)
    script = os.path.join(REPO, "scripts", "merge_dcp_to_hf.py")
    two = str(tmp_path / "two")
    cmd = [sys.executable, script, "--checkpoint", path, "--output", two, "--max-shard-gb", str(300_000 / 2**30)]
    proc = launch_ranks(cmd, 2, child_env(), timeout=600)
    assert proc.returncode == 0 and f"wrote {two}" in proc.stdout, proc.stderr[-3000:]
    names = sorted(os.listdir(one))
    assert names == sorted(os.listdir(two)) and len([n for n in names if n.endswith(".safetensors")]) > 1
    assert all(filecmp.cmp(os.path.join(one, n), os.path.join(two, n), shallow=False) for n in names), names
    assert any(
        ".experts.3.gate_proj" in k
        for k in json.load(open(os.path.join(two, "model.safetensors.index.json")))["weight_map"]
    )
