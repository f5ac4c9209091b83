"""The real-size recipes (configs/text/qwen3_*_{sft,pretrain}.yaml, the Qwen2.5-VL and Qwen3-VL-MoE SFT files,
the Qwen3-30B-A3B Muon + EP file) and the seed's interleaved dataset.yaml.

Each recipe parses with the project's parser and validation at the world size its header plans for (8 GPUs), its
model builds on the meta device from its config.json with the published parameter count, its header says what it
was measured at (or that it was not), and the paths the user must replace are placeholders. Meta builds only: a few
seconds in all."""

import functools
import json
import os
import re
import wave

import pytest
import yaml

from helpers import REPO
from veomni.arguments import VeOmniArguments, parse_args
from veomni.models import build_foundation_model

# recipe -> published size in billions of parameters (embeddings counted once when tied)
RECIPES = {
    **{
        f"configs/text/qwen3_{k}_{kind}.yaml": n
        for k, n in (("0_6b", 0.60), ("1_7b", 1.72), ("4b", 4.02), ("8b", 8.19))
        for kind in ("sft", "pretrain")
    },
    "configs/text/qwen3_moe_muon.yaml": 30.53,
    "configs/text/qwen3_8b_lora_sft.yaml": 8.19,
    "configs/multimodal/qwen2_5_vl/qwen2_5_vl_3b_sft.yaml": 3.75,
    "configs/multimodal/qwen2_5_vl/qwen2_5_vl_7b_sft.yaml": 8.29,
    "configs/multimodal/qwen3_vl/qwen3_vl_moe.yaml": 31.07,
}
SEED_DATASET = "configs/multimodal/data/tulu_sharegpt4v_llavavideo_voiceassistant.yaml"


@functools.lru_cache(maxsize=None)
def _billions(config_path, moe_implementation):
    model = build_foundation_model(config_path=config_path, init_device="meta", moe_implementation=moe_implementation)
    return sum(p.numel() for p in model.parameters()) / 1e9


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_parses_builds_on_meta_and_says_what_it_was_measured_at(recipe, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # the GPU count the headers plan for: the batch must split over it
    path = os.path.join(REPO, recipe)
    args = parse_args(VeOmniArguments, [path])
    header = "".join(line for line in open(path) if line.startswith("#"))
    assert "H100" in header and ("MEASURED" in header or "PLANNED, NOT MEASURED" in header), recipe
    assert "tokens/s" in header and "GB" in header, recipe  # throughput and memory, measured or computed
    assert args.data.train_path.startswith("/path/to/") and "PLACEHOLDER" in open(path).read()
    # SFT: the released weights; pretraining: the tokenizer of one
    weights = args.model.model_path or args.model.tokenizer_path
    # the user's own copy; the LoRA recipe names the released weights on the hub (veomni.utils.hub)
    assert weights.startswith("/path/to/") or (args.model.lora.enable and weights == "Qwen/Qwen3-8B"), recipe
    size = _billions(os.path.join(REPO, args.model.config_path), args.model.ops_implementation.moe_implementation)
    assert abs(size - RECIPES[recipe]) <= 0.01 * RECIPES[recipe], (recipe, size)
    if "pretrain" in recipe:  # from scratch: no weights, and a token budget the step count follows
        assert args.model.model_path is None and args.data.train_size
        steps = args.compute_train_steps(None)
        assert f"{steps:,} steps" in header, (recipe, steps)


def test_the_moe_recipes_run_expert_parallel_with_whole_experts_per_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    for recipe in ("configs/text/qwen3_moe_muon.yaml", "configs/multimodal/qwen3_vl/qwen3_vl_moe.yaml"):
        args = parse_args(VeOmniArguments, [os.path.join(REPO, recipe)])
        acc = args.train.accelerator
        assert acc.extra_parallel_names == ["ep"] and acc.extra_parallel_sizes == [8]
        assert args.model.ops_implementation.moe_implementation == "fused"  # EP refuses eager
    config = json.load(open(os.path.join(REPO, "configs/model/qwen3_30b_a3b/config.json")))
    assert config["num_experts"] % 8 == 0 and args.train.optimizer.type == "adamw"
    muon = parse_args(VeOmniArguments, [os.path.join(REPO, "configs/text/qwen3_moe_muon.yaml")]).train.optimizer
    assert muon.type == "muon" and muon.muon_expert_zero_comm  # (128 / 8) % ep_fsdp == 0 on 8 or 16 GPUs


# ------------------------------------------------------------------------------ the seed's dataset.yaml
def test_seed_dataset_yaml_parses_as_veomni_schema():
    from veomni.data.dataset import load_interleave_spec

    spec = load_interleave_spec(os.path.join(REPO, SEED_DATASET))
    names = [s["name"] for s in spec["sources"]]
    assert names == ["tulu-3-sft-mixture", "sharegpt4v_captioner_sft", "LLaVA-Video-178K", "VoiceAssistant"]
    assert [s["weight"] for s in spec["sources"]] == [0.25] * 4 and spec["stopping_strategy"] == "all_exhausted"
    assert all(s["path"].startswith("/path/to/") for s in spec["sources"])


def _png(path, color):
    from PIL import Image

    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (28, 28), color).save(path)
    return path


def _wav(path):
    with wave.open(path, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(b"\x00\x01" * 1600)
    return path


def _local_copy(tmp):
    """The seed's dataset.yaml with each placeholder path pointed at a few records in that source's published form."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(f"{tmp}/tulu/data")
    chats = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "ok"}] for i in range(3)]
    pq.write_table(pa.table({"id": ["a", "b", "c"], "messages": chats}), f"{tmp}/tulu/data/train-00000.parquet")
    with open(f"{tmp}/sharegpt4v.jsonl", "w") as f:  # LLaVA form: one `image`, relative to media_dir
        for i, color in enumerate(("red", "blue")):
            _png(f"{tmp}/media/coco/{i}.png", color)
            turns = [{"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": f"A {color} square."}]
            f.write(json.dumps({"id": str(i), "image": f"coco/{i}.png", "conversations": turns}) + "\n")
    frames = [_png(f"{tmp}/media/video0/{k:03d}.png", c) for k, c in enumerate(("red", "green", "blue", "white"))]
    with open(f"{tmp}/llava_video.jsonl", "w") as f:  # `video`: a folder of extracted frames
        turns = [{"from": "human", "value": "<video>\nWhat changes?"}, {"from": "gpt", "value": "The colour."}]
        f.write(json.dumps({"id": "v0", "video": os.path.dirname(frames[0]), "conversations": turns}) + "\n")
    with open(f"{tmp}/voice.jsonl", "w") as f:
        user = [{"type": "audio", "audio": _wav(f"{tmp}/media/q0.wav")}]
        f.write(json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "Hi."}]}))
    text = open(os.path.join(REPO, SEED_DATASET)).read()
    for old, new in (
        ("/path/to/tulu-3-sft-mixture/data", f"{tmp}/tulu/data"),
        ("/path/to/ShareGPT4V/sharegpt4v_instruct_gpt4-vision_cap100k.jsonl", f"{tmp}/sharegpt4v.jsonl"),
        ("/path/to/LLaVA-Video-178K/llava_video.jsonl", f"{tmp}/llava_video.jsonl"),
        ("/path/to/VoiceAssistant-400K/voice_assistant.jsonl", f"{tmp}/voice.jsonl"),
    ):
        assert old in text
        text = text.replace(old, new)
    with open(f"{tmp}/dataset.yaml", "w") as f:
        f.write(text)
    return f"{tmp}/dataset.yaml"


@pytest.mark.parametrize("datasets_type", ["mapping", "iterable"])
def test_seed_dataset_yaml_loads_every_source_with_the_real_loader(tmp_path, datasets_type):
    """The seed's commands pass the yaml with --data.datasets_type mapping / iterable: the interleaved dataset of
    that kind draws from all four sources, and the multimodal pipeline's own normalisation reads each record's media
    (images by path under media_dir, a video as its frames, speech as a WAV)."""
    from veomni.data import InterleavedIterableDataset, InterleavedMappingDataset, build_dataset
    from veomni.data.multimodal.preprocess import conversation_from_sample, media_of

    tmp = str(tmp_path)
    path = _local_copy(tmp)

    def transform(record):
        media = media_of(conversation_from_sample(record, media_dir=f"{tmp}/media"))
        kinds = "+".join(k for k in ("image", "video", "audio") for _ in media[k]) or "text"
        return {"input_ids": [1, 2, 3], "kinds": kinds}  # a non-token field: the cache keeps lengths only, as for VL

    dataset = build_dataset(
        train_path=path, datasets_type=datasets_type, transform=transform, seed=0, cache_dir=f"{tmp}/cache"
    )
    assert isinstance(dataset, InterleavedMappingDataset if datasets_type == "mapping" else InterleavedIterableDataset)
    kinds = sorted(sample["kinds"] for sample in dataset)
    assert kinds == sorted(["text"] * 3 + ["image"] * 2 + ["video", "audio"]), kinds


def test_recipe_headers_and_the_seed_paths_exist():
    """Every path the seed's documents name is in the repository."""
    for rel in (
        "configs/text/qwen2_5.yaml",
        "configs/text/qwen3_moe_muon.yaml",
        "configs/multimodal/qwen3_vl/qwen3_vl_moe.yaml",
        SEED_DATASET,
        "tasks/train_text.py",
        "tasks/train_vlm.py",
        "tasks/deprecated_task/train_torch.py",
    ):
        assert os.path.isfile(os.path.join(REPO, rel)), rel
    demo = yaml.safe_load(open(os.path.join(REPO, "configs/text/qwen3_moe_muon_demo.yaml")))
    assert demo["model"]["config_path"] == "configs/model/demo_qwen3_moe"  # the tiny demo kept its own name
    readme = open(os.path.join(REPO, "README.md")).read()
    assert re.search(r"configs/text/qwen3_moe_muon_demo\.yaml", readme)  # every reference moved with it
